//! EmbeddingDenseGrad against a memcpy of the same bytes (the grad read once
//! plus the table written once), single-threaded, in one criterion group.
//!
//! Run: `cargo bench -p npukern-benches --bench embedding`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use npukern::*;
use npukern_benches::{zeros, Aligned};

fn bench(c: &mut Criterion) {
    // The seed's case: 8192 tokens of H = 4096 into a 32000-row table, bf16,
    // with a Zipf-like skew (a few hot rows, many untouched).
    let (n, h, v) = (8192usize, 4096usize, 32000usize);
    let mut s = 0x2545_f491u32;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        s
    };
    let grad: Vec<bf16> = (0..n * h)
        .map(|_| bf16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0))
        .collect();
    let indices: Vec<i64> = (0..n)
        .map(|_| {
            let u = (next() % 1_000_000) as f64 / 1e6;
            ((v as f64).powf(u) as i64 - 1).clamp(0, v as i64 - 1)
        })
        .collect();
    let bytes = (n * h + v * h) * 2;
    let mut g = c.benchmark_group(format!("embedding_dense_grad/BF16/{n}x{h}->{v}"));
    g.throughput(Throughput::Bytes(bytes as u64));
    // A copy reads and writes its length, so copying half of (grad + table)
    // bytes moves as many bytes as the kernel (grad read + table written).
    let src = Aligned::filled(1u8, bytes / 2);
    let mut dst = Aligned::filled(0u8, bytes / 2);
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    let (gt, it) = (
        TensorRef::new(&grad, &[n, h]).unwrap(),
        TensorRef::new(&indices, &[n]).unwrap(),
    );
    let exec = Exec::cpu();
    let opts = EmbeddingGradOptions::default();
    let mut ws = vec![0u8; embedding_dense_grad_workspace_size(&exec, gt, it, v, &opts).unwrap()];
    let mut table = zeros::<bf16>(v * h);
    g.bench_function("embedding_dense_grad", |b| {
        b.iter(|| embedding_dense_grad(&exec, gt, it, v, &opts, &mut table, &mut ws).unwrap())
    });
    g.finish();
}

criterion_group! {
    name = group;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(group);
