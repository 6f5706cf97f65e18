//! grad_stats and clip_grad_norm against the memory floors of the same bytes,
//! in one criterion group per dtype, single-threaded (serial runner):
//! - `read_floor`: a trivial reduction (eight wrapping u64 sums) over the
//!   tensors' bytes — the floor of `grad_stats`, which reads every byte once;
//! - `copy_floor`: a `copy_from_slice` of the same bytes (read + write) —
//!   the floor of the scale pass;
//! - `clip_grad_norm` (max_norm 0: the coefficient is 0 and every iteration
//!   scales, on values that stay zero, so no subnormal slows it down) reads
//!   once for the norm and reads + writes once to scale: its floor is
//!   `read_floor + copy_floor`.
//!
//! The data (64 MiB of f32, 32 MiB of f16/bf16) is split over 8 tensors of
//! mixed sizes (L3 here is 32 MiB). The ISA is the detected one (AVX-512 on
//! the development machine); `grad_stats_2_threads` shows the runner.
//!
//! Ratios to report: `grad_stats / read_floor` and
//! `clip_grad_norm / (read_floor + copy_floor)`. Note an in-place scale moves
//! fewer bytes than a copy into a second buffer (no write-allocate of a cold
//! destination), so clip can come in under its floor.
//!
//! Run: `cargo bench -p npukern-benches --bench grad_stats` (add `-- --quick` for a short run).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use npukern::*;
use npukern_benches::{data, Aligned};

const ELEMS: usize = 1 << 24;
/// Eight tensors of unequal sizes (parts of ELEMS).
const SPLIT: [usize; 8] = [1, 3, 2, 5, 1, 7, 4, 9];

/// The cheapest full read of the bytes: eight independent wrapping u64 sums
/// (no dependency chain, vectorized), so memory is the only limit.
fn read_floor(words: &[u64]) -> u64 {
    let (chunks, rest) = words.as_chunks::<8>();
    let mut acc = [0u64; 8];
    for c in chunks {
        for (a, &w) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(w);
        }
    }
    acc.iter().chain(rest).fold(0u64, |a, &w| a.wrapping_add(w))
}

fn sizes() -> Vec<usize> {
    let total: usize = SPLIT.iter().sum();
    let mut v: Vec<usize> = SPLIT.iter().map(|p| ELEMS / total * p).collect();
    let used: usize = v.iter().sum();
    v[7] += ELEMS - used;
    v
}

fn group<T: Float>(
    c: &mut Criterion,
    wrap: fn(&[T]) -> GradTensor<'_>,
    wrap_mut: fn(&mut [T]) -> GradTensorMut<'_>,
) {
    let elem = core::mem::size_of::<T>();
    let bytes = ELEMS * elem;
    let mut g = c.benchmark_group(format!("grad_stats/{:?}/{}x8", T::DTYPE, ELEMS));
    g.throughput(Throughput::Bytes(bytes as u64));

    let words = vec![1u64; bytes / 8];
    g.bench_function("read_floor", |b| b.iter(|| read_floor(black_box(&words))));
    let src = Aligned::filled(1u8, bytes);
    let mut dst = Aligned::filled(0u8, bytes);
    g.bench_function("copy_floor", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    drop((words, src, dst));

    let mut tensors: Vec<Aligned<T>> = sizes()
        .iter()
        .enumerate()
        .map(|(i, &n)| data(n, i as u32 + 1))
        .collect();
    let exec = Exec::cpu();
    {
        let views: Vec<GradTensor<'_>> = tensors.iter().map(|t| wrap(t)).collect();
        let mut ws = vec![0u8; grad_stats_workspace_size(&exec, &views).unwrap()];
        g.bench_function("grad_stats", |b| {
            b.iter(|| grad_stats(&exec, black_box(&views), &mut ws).unwrap())
        });
        let two = Cpu::new(Threads::new(2));
        let exec2 = Exec::new(&two);
        g.bench_function("grad_stats_2_threads", |b| {
            b.iter(|| grad_stats(&exec2, black_box(&views), &mut ws).unwrap())
        });
    }
    let mut views: Vec<GradTensorMut<'_>> = tensors.iter_mut().map(|t| wrap_mut(t)).collect();
    let clip = ClipGradNormOptions::new(0.0);
    let mut ws = vec![0u8; clip_grad_norm_workspace_size(&exec, &views, &clip).unwrap()];
    g.bench_function("clip_grad_norm", |b| {
        b.iter(|| clip_grad_norm(&exec, black_box(&mut views), &clip, &mut ws).unwrap())
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    group::<f32>(c, |s| GradTensor::F32(s), |s| GradTensorMut::F32(s));
    group::<bf16>(c, |s| GradTensor::BF16(s), |s| GradTensorMut::BF16(s));
    group::<f16>(c, |s| GradTensor::F16(s), |s| GradTensorMut::F16(s));
}

criterion_group! {
    name = grad;
    config = Criterion::default().sample_size(20);
    targets = benches
}
criterion_main!(grad);
