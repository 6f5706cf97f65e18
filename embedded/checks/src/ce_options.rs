//! CrossEntropy's option sets, one hash each. Shared, by path, with the
//! root crate's `tests/bit_hashes.rs` (as `hash.rs` is), so the host test
//! and the embedded consumer cover the same options.

use npukern::{CrossEntropyOptions, Reduction};

/// One option set: its name, the options, whether class weights are given.
pub type Variant = (&'static str, CrossEntropyOptions, bool);

/// Plain per-row losses; a weighted mean with label smoothing and z-loss;
/// everything with soft-capping, per row; a soft-capped sum whose
/// ignore_index is a valid class (2). The targets' ignored rows must hold
/// each set's `ignore_index`.
pub fn variants() -> [Variant; 4] {
    let o = |reduction, label_smoothing, lse_square_scale, softcap| CrossEntropyOptions {
        reduction,
        label_smoothing,
        lse_square_scale,
        softcap,
        ..CrossEntropyOptions::default()
    };
    [
        ("plain.none", o(Reduction::None, 0.0, 0.0, 0.0), false),
        (
            "smooth_zloss_weight.mean",
            o(Reduction::Mean, 0.1, 1e-3, 0.0),
            true,
        ),
        (
            "softcap_smooth_zloss_weight.none",
            o(Reduction::None, 0.2, 1e-4, 5.0),
            true,
        ),
        (
            "softcap_ignore2.sum",
            CrossEntropyOptions {
                ignore_index: 2,
                ..o(Reduction::Sum, 0.0, 0.0, 3.0)
            },
            false,
        ),
    ]
}
