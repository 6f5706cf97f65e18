//! CrossEntropy forward + backward on resident buffers, single-threaded,
//! against a memcpy of the same bytes, in one criterion group per dtype:
//! the kernel reads the logits twice (forward; backward) and writes their
//! gradient once, so the copy moves 1.5x the logits (read and write).
//! `forward_backward` is the forward (loss and lse) then the backward into
//! a separate dlogits; `fused_in_place` is the fused linear
//! cross-entropy's call (loss, lse and dlogits over the logits; the
//! gradient of a gradient is as good an input as any: the same work).
//!
//! Run: `cargo bench -p npukern-benches --bench cross_entropy`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use npukern::*;
use npukern_benches::Aligned;

fn rows<T: Float>(c: &mut Criterion, n: usize, v: usize) {
    let mut s = 0x2545_f491u32;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        s
    };
    let logits: Vec<T> = (0..n * v)
        .map(|_| T::from_f32((next() % 2000) as f32 / 200.0 - 5.0))
        .collect();
    let target: Vec<i64> = (0..n).map(|_| (next() as usize % v) as i64).collect();
    let esize = core::mem::size_of::<T>();
    let bytes = 3 * n * v * esize;
    let mut g = c.benchmark_group(format!("cross_entropy/{}/{n}x{v}", T::DTYPE.name()));
    g.throughput(Throughput::Bytes(bytes as u64));
    let src = Aligned::filled(1u8, bytes / 2);
    let mut dst = Aligned::filled(0u8, bytes / 2);
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    let exec = Exec::cpu();
    let opts = CrossEntropyOptions::default();
    let tt = TensorRef::new(&target, &[n]).unwrap();
    let targets = || CrossEntropyTargets::new(tt);
    let xt = TensorRef::new(&logits, &[n, v]).unwrap();
    let mut lse = vec![0f32; n];
    let mut scalar = [0f32];
    let mut dlogits = logits.clone();
    let ws_f = cross_entropy_workspace_size(&exec, xt, targets(), &opts).unwrap();
    let ws_b = cross_entropy_grad_workspace_size(&exec, xt, targets(), &opts).unwrap();
    let mut ws = vec![0u8; ws_f.max(ws_b)];
    g.bench_function("forward_backward", |b| {
        b.iter(|| {
            cross_entropy(
                &exec,
                xt,
                targets(),
                &opts,
                &mut scalar,
                Some(&mut lse),
                &mut ws,
            )
            .unwrap();
            cross_entropy_grad(
                &exec,
                xt,
                targets(),
                &lse,
                &[1.0],
                &opts,
                &mut dlogits,
                &mut ws,
            )
            .unwrap();
        })
    });
    let mut x = logits.clone();
    let mut loss = vec![0f32; n];
    // Its workspace is the exp cache (without it: the same bits, slower).
    let xr = TensorRef::new(&logits, &[n, v]).unwrap();
    let mut fws =
        vec![0u8; cross_entropy_fused_workspace_size(&exec, xr, targets(), &opts).unwrap()];
    g.bench_function("fused_in_place", |b| {
        b.iter(|| {
            let xm = TensorMut::new(&mut x, &[n, v]).unwrap();
            cross_entropy_fused(
                &exec,
                xm,
                targets(),
                &[1.0 / n as f32],
                &opts,
                &mut loss,
                Some(&mut lse),
                &mut fws,
            )
            .unwrap()
        })
    });
    g.finish();
}

fn bench(c: &mut Criterion) {
    // 256 tokens of a Llama 2 vocabulary and 64 of Llama 3's: 16 MiB of bf16
    // logits each (beyond the caches, as in training).
    rows::<bf16>(c, 256, 32_000);
    rows::<bf16>(c, 64, 128_256);
    rows::<f32>(c, 128, 32_000);
}

criterion_group! {
    name = group;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = bench
}
criterion_main!(group);
