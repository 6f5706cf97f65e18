//! SwiGLU (`silu_mul`), GeGLU (`gelu_mul`) and RoPE, forward and backward, against a memcpy of
//! the same bytes, in one criterion group per (operator, dtype, shape),
//! single-threaded. The figure that matters is kernel time / copy time
//! (targets: <= 1.3 forward, <= 1.5 backward).
//!
//! Run: `cargo bench -p npukern-benches --bench elementwise` (add `-- --quick` for a short run).

mod common;

use common::copy_baseline;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use npukern::*;
use npukern_benches::{data, zeros};

/// `silu_mul(gate, up)` on `tokens x inter`, then its backward.
fn swiglu<T: Float>(c: &mut Criterion, tokens: usize, inter: usize) {
    let len = tokens * inter;
    let tb = len * core::mem::size_of::<T>();
    let dims = [tokens, inter];
    let (gate, up, dy) = (data::<T>(len, 1), data::<T>(len, 2), data::<T>(len, 3));
    let (gt, ut, dyt) = (
        TensorRef::new(&gate, &dims).unwrap(),
        TensorRef::new(&up, &dims).unwrap(),
        TensorRef::new(&dy, &dims).unwrap(),
    );
    let exec = Exec::cpu();
    let opts = SwigluOptions::default();
    let (mut y, mut dup) = (zeros::<T>(len), zeros::<T>(len));

    // Reads gate and up, writes y: the traffic of copying 1.5 tensors.
    let mut g = c.benchmark_group(format!("swiglu/{:?}/{tokens}x{inter}", T::DTYPE));
    g.throughput(Throughput::Bytes(3 * tb as u64));
    copy_baseline(&mut g, tb * 3 / 2);
    g.bench_function("silu_mul", |b| {
        b.iter(|| silu_mul(&exec, gt, ut, &opts, &mut y, &mut []).unwrap())
    });
    g.finish();

    // Reads dy, gate, up; writes dgate, dup: 2.5 tensors copied.
    let mut g = c.benchmark_group(format!("swiglu_grad/{:?}/{tokens}x{inter}", T::DTYPE));
    g.throughput(Throughput::Bytes(5 * tb as u64));
    copy_baseline(&mut g, tb * 5 / 2);
    g.bench_function("silu_mul_grad", |b| {
        b.iter(|| silu_mul_grad(&exec, dyt, gt, ut, &opts, &mut y, &mut dup, &mut []).unwrap())
    });
    g.finish();
}

/// `gelu_mul(gate, up)` (GELU's tanh form, Gemma's MLP) on `tokens x
/// inter`, then its backward.
fn geglu<T: Float>(c: &mut Criterion, tokens: usize, inter: usize) {
    let len = tokens * inter;
    let tb = len * core::mem::size_of::<T>();
    let dims = [tokens, inter];
    let (gate, up, dy) = (data::<T>(len, 11), data::<T>(len, 12), data::<T>(len, 13));
    let (gt, ut, dyt) = (
        TensorRef::new(&gate, &dims).unwrap(),
        TensorRef::new(&up, &dims).unwrap(),
        TensorRef::new(&dy, &dims).unwrap(),
    );
    let exec = Exec::cpu();
    let opts = GegluOptions::default();
    let (mut y, mut dup) = (zeros::<T>(len), zeros::<T>(len));

    // Reads gate and up, writes y: the traffic of copying 1.5 tensors.
    let mut g = c.benchmark_group(format!("geglu/{:?}/{tokens}x{inter}", T::DTYPE));
    g.throughput(Throughput::Bytes(3 * tb as u64));
    copy_baseline(&mut g, tb * 3 / 2);
    g.bench_function("gelu_mul", |b| {
        b.iter(|| gelu_mul(&exec, gt, ut, &opts, &mut y, &mut []).unwrap())
    });
    g.finish();

    // Reads dy, gate, up; writes dgate, dup: 2.5 tensors copied.
    let mut g = c.benchmark_group(format!("geglu_grad/{:?}/{tokens}x{inter}", T::DTYPE));
    g.throughput(Throughput::Bytes(5 * tb as u64));
    copy_baseline(&mut g, tb * 5 / 2);
    g.bench_function("gelu_mul_grad", |b| {
        b.iter(|| gelu_mul_grad(&exec, dyt, gt, ut, &opts, &mut y, &mut dup, &mut []).unwrap())
    });
    g.finish();
}

/// RoPE on q and k `[1, heads, seq, 128]`, cos/sin `[1, 1, seq, 128]`
/// (Hugging Face's layout), forward and backward.
fn rope_bench<T: Float>(c: &mut Criterion, heads: usize, seq: usize) {
    let d = 128;
    let len = heads * seq * d;
    let tb = len * core::mem::size_of::<T>();
    let dims = [1, heads, seq, d];
    let (q, k) = (data::<T>(len, 4), data::<T>(len, 5));
    let (cos, sin) = (data::<T>(seq * d, 6), data::<T>(seq * d, 7));
    let (qt, kt) = (
        TensorRef::new(&q, &dims).unwrap(),
        TensorRef::new(&k, &dims).unwrap(),
    );
    let (ct, st) = (
        TensorRef::new(&cos, &[1, 1, seq, d]).unwrap(),
        TensorRef::new(&sin, &[1, 1, seq, d]).unwrap(),
    );
    let exec = Exec::cpu();
    let (mut qo, mut ko) = (zeros::<T>(len), zeros::<T>(len));
    for backward in [false, true] {
        let op = if backward { "rope_grad" } else { "rope" };
        let opts = RopeOptions {
            backward,
            ..Default::default()
        };
        // Reads q and k, writes both (cos/sin stay in cache): a copy of q + k.
        let mut g = c.benchmark_group(format!("{op}/{:?}/2x{heads}x{seq}x{d}", T::DTYPE));
        g.throughput(Throughput::Bytes(4 * tb as u64));
        copy_baseline(&mut g, 2 * tb);
        g.bench_function(op, |b| {
            b.iter(|| {
                rope(
                    &exec,
                    qt,
                    Some(kt),
                    ct,
                    st,
                    &opts,
                    &mut qo,
                    Some(&mut ko),
                    &mut [],
                )
                .unwrap()
            })
        });
        g.finish();
    }
}

fn benches(c: &mut Criterion) {
    // LLaMA shapes: 4096 tokens x the 7B / 8B MLP widths; 32 heads x 4096
    // tokens x head_dim 128.
    for inter in [11008usize, 14336] {
        swiglu::<bf16>(c, 4096, inter);
        swiglu::<f16>(c, 4096, inter);
        swiglu::<f32>(c, 4096, inter);
    }
    geglu::<bf16>(c, 4096, 14336);
    geglu::<f32>(c, 4096, 14336);
    rope_bench::<bf16>(c, 32, 4096);
    rope_bench::<f16>(c, 32, 4096);
    rope_bench::<f32>(c, 32, 4096);
}

criterion_group! {
    name = group;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(group);
