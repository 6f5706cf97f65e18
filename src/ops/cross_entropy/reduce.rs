//! The reduction of per-row losses, defined once: the forward's `Sum` /
//! `Mean`, the backward's mean factor, and the public
//! `cross_entropy_reduce` / `cross_entropy_grad_scale` that chunked callers
//! (the fused LM head, the PyTorch adapter) use, so every caller, Rust, C
//! or PyTorch, gets the same bits.
//!
//! The sum is f64 in row order, the denominator (`sum_{i not ignored}
//! w[t_i]`, the count without a weight) f64 in row order, and the result
//! rounded to f32 once: exact for any realistic row count, independent of
//! how rows were split into calls or blocks. N = 0 or every row ignored:
//! `Sum` 0, `Mean` 0/0 = NaN, as torch.

use super::Reduction;

/// `sum_{i not ignored} w[t_i]` (f64, row order) over `n` targets given by
/// `target`; without a weight, the count of rows not ignored. A target
/// outside the weight adds nothing (validation refuses it first).
pub(crate) fn denominator(
    n: usize,
    target: impl Fn(usize) -> i64,
    weight: Option<&[f32]>,
    ignore: i64,
) -> f64 {
    let mut d = 0f64;
    for i in 0..n {
        let v = target(i);
        if v == ignore {
            continue;
        }
        d += match weight {
            Some(w) => usize::try_from(v)
                .ok()
                .and_then(|v| w.get(v))
                .map_or(0.0, |&x| f64::from(x)),
            None => 1.0,
        };
    }
    d
}

/// The f64 sum of `n` row losses in row order.
pub(crate) fn total(n: usize, loss: impl Fn(usize) -> f32) -> f64 {
    (0..n).fold(0f64, |s, i| s + f64::from(loss(i)))
}

/// The reduced loss: `total` (`Sum`) or `total / den` (`Mean`), rounded once.
pub(crate) fn reduced(total: f64, reduction: Reduction, den: f64) -> f32 {
    match reduction {
        Reduction::Mean => (total / den) as f32,
        _ => total as f32,
    }
}

/// The factor every row's gradient gets from the upstream gradient `g` of
/// the reduced loss: `g` (`Sum`, `None`: per row already) or `g / den`
/// (`Mean`), rounded once.
pub(crate) fn grad_factor(g: f32, reduction: Reduction, den: f64) -> f32 {
    match reduction {
        Reduction::Mean => (f64::from(g) / den) as f32,
        _ => g,
    }
}
