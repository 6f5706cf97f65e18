//! What the criterion benches share: the same-bytes copy each group times
//! beside its kernel.

use std::hint::black_box;

use npukern_benches::Aligned;

/// Times a copy of `bytes` bytes (read + write = the kernel's traffic) as
/// the group's "memcpy".
pub fn copy_baseline(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    bytes: usize,
) {
    let src = Aligned::filled(1u8, bytes);
    let mut dst = Aligned::filled(0u8, bytes);
    c.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
}
