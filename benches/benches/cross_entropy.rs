//! CrossEntropy fused (loss, lse and dlogits in place, one call per chunk
//! of tokens, as the fused linear cross-entropy runs it) and the forward,
//! against a memcpy of the same bytes (the logits read twice and written
//! once), single-threaded, in one criterion group.
//!
//! Run: `cargo bench -p npukern-benches --bench cross_entropy`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use npukern::*;
use npukern_benches::Aligned;

fn bench(c: &mut Criterion) {
    // 64 tokens of a Llama 3 vocabulary (128 256 classes), bf16: 16 MiB.
    let (n, v) = (64usize, 128_256usize);
    let mut s = 0x2545_f491u32;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        s
    };
    let logits: Vec<bf16> = (0..n * v)
        .map(|_| bf16::from_f32((next() % 2000) as f32 / 200.0 - 5.0))
        .collect();
    let target: Vec<i64> = (0..n).map(|_| (next() as usize % v) as i64).collect();
    let bytes = 3 * n * v * 2;
    let mut g = c.benchmark_group(format!("cross_entropy/BF16/{n}x{v}"));
    g.throughput(Throughput::Bytes(bytes as u64));
    // A copy reads and writes its length: half of the kernel's bytes.
    let src = Aligned::filled(1u8, bytes / 2);
    let mut dst = Aligned::filled(0u8, bytes / 2);
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    let exec = Exec::cpu();
    let opts = CrossEntropyOptions::default();
    let tt = TensorRef::new(&target, &[n]).unwrap();
    let (mut loss, mut lse) = (vec![0f32; n], vec![0f32; n]);
    let mut x = logits.clone();
    g.bench_function("fused_in_place", |b| {
        b.iter(|| {
            // The same logits every time (the copy is outside the kernel's
            // bytes but inside the timing: a second memcpy-sized stream).
            x.copy_from_slice(&logits);
            let xm = TensorMut::new(&mut x, &[n, v]).unwrap();
            let t = CrossEntropyTargets::new(tt);
            cross_entropy_fused(
                &exec,
                xm,
                t,
                &[1.0 / n as f32],
                &opts,
                &mut loss,
                Some(&mut lse),
                &mut [],
            )
            .unwrap()
        })
    });
    let xt = TensorRef::new(&logits, &[n, v]).unwrap();
    let mut ws = vec![
        0u8;
        cross_entropy_workspace_size(&exec, xt, CrossEntropyTargets::new(tt), &opts)
            .unwrap()
    ];
    let mut scalar = [0f32];
    g.bench_function("forward", |b| {
        b.iter(|| {
            cross_entropy(
                &exec,
                xt,
                CrossEntropyTargets::new(tt),
                &opts,
                &mut scalar,
                Some(&mut lse),
                &mut ws,
            )
            .unwrap()
        })
    });
    g.finish();
}

criterion_group! {
    name = group;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(group);
