//! RmsNorm / AddRmsNorm / RmsNormGrad against a memcpy of the same bytes, in
//! one criterion group per (operator, dtype, shape), single-threaded (serial
//! runner, as the oneDNN figures in the README). The figure that matters is
//! kernel time / copy time.
//!
//! Run: `cargo bench -p npukern-benches --bench rms_norm` (add `-- --quick` for a short run).

mod common;

use common::copy_baseline;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use npukern::*;
use npukern_benches::{data, zeros};

fn forward<T: Float>(c: &mut Criterion, m: usize, n: usize) {
    let name = format!("rms_norm/{:?}/{m}x{n}", T::DTYPE);
    let mut g = c.benchmark_group(&name);
    let elem = core::mem::size_of::<T>();
    let bytes = m * n * elem; // read x, write y: a copy of x's bytes
    g.throughput(Throughput::Bytes(2 * bytes as u64));
    copy_baseline(&mut g, bytes);
    let x = data::<T>(m * n, 1);
    let gamma = data::<T>(n, 2);
    let (xt, gt) = (
        TensorRef::new(&x, &[m, n]).unwrap(),
        TensorRef::new(&gamma, &[n]).unwrap(),
    );
    let exec = Exec::cpu();
    let opts = RmsNormOptions::default();
    let mut ws = vec![0u8; rms_norm_workspace_size(&exec, xt, gt, &opts).unwrap()];
    let mut y = zeros::<T>(m * n);
    let mut rstd = vec![0f32; m];
    g.bench_function("rms_norm", |b| {
        b.iter(|| rms_norm(&exec, xt, gt, &opts, &mut y, Some(&mut rstd), &mut ws).unwrap())
    });
    // AddRmsNorm reads two inputs and writes two outputs: twice the copy.
    let x2 = data::<T>(m * n, 3);
    let x2t = TensorRef::new(&x2, &[m, n]).unwrap();
    let mut s = zeros::<T>(m * n);
    let mut ws2 = vec![0u8; add_rms_norm_workspace_size(&exec, xt, x2t, gt, &opts).unwrap()];
    g.bench_function(BenchmarkId::new("add_rms_norm_per_2x", ""), |b| {
        b.iter(|| {
            add_rms_norm(
                &exec,
                xt,
                x2t,
                gt,
                &opts,
                &mut y,
                Some(&mut rstd),
                Some(&mut s),
                &mut ws2,
            )
            .unwrap()
        })
    });
    g.finish();
}

fn backward<T: Float>(c: &mut Criterion, m: usize, n: usize) {
    let name = format!("rms_norm_grad/{:?}/{m}x{n}", T::DTYPE);
    let mut g = c.benchmark_group(&name);
    let elem = core::mem::size_of::<T>();
    // read dy and x, write dx: the traffic of copying 1.5 tensors.
    let bytes = m * n * elem * 3 / 2;
    g.throughput(Throughput::Bytes(2 * bytes as u64));
    copy_baseline(&mut g, bytes);
    let x = data::<T>(m * n, 1);
    let dy = data::<T>(m * n, 4);
    let gamma = data::<T>(n, 2);
    let rstd = vec![0.7f32; m];
    let (xt, dyt, gt) = (
        TensorRef::new(&x, &[m, n]).unwrap(),
        TensorRef::new(&dy, &[m, n]).unwrap(),
        TensorRef::new(&gamma, &[n]).unwrap(),
    );
    let rt = TensorRef::new(&rstd, &[m]).unwrap();
    let exec = Exec::cpu();
    let opts = RmsNormGradOptions::default();
    let mut ws =
        vec![
            0u8;
            rms_norm_grad_workspace_size(&exec, dyt, &RmsNormGradInputs::new(xt, rt, gt), &opts)
                .unwrap()
        ];
    let mut dx = zeros::<T>(m * n);
    let mut dg = vec![0f32; n];
    g.bench_function("rms_norm_grad", |b| {
        b.iter(|| {
            let dgamma = Some(&mut dg[..]);
            rms_norm_grad(
                &exec,
                dyt,
                &RmsNormGradInputs::new(xt, rt, gt),
                &opts,
                &mut dx,
                DgammaOut {
                    dgamma,
                    dgamma_cast: None,
                },
                &mut ws,
            )
            .unwrap()
        })
    });
    g.finish();
}

fn benches(c: &mut Criterion) {
    // The seed shapes ([a, b, h] as a*b rows of h; gamma [h]) and a long
    // split-D row, at sizes around or beyond this machine's L3.
    let shapes = [
        (1024usize, 12288usize),
        (512 * 4, 4096),
        (4 * 2048, 5120),
        (2 * 2048, 4096),
        (320, 110_000),
    ];
    for &(m, n) in &shapes {
        forward::<bf16>(c, m, n);
        forward::<f16>(c, m, n);
        forward::<f32>(c, m, n);
        backward::<bf16>(c, m, n);
        backward::<f16>(c, m, n);
        backward::<f32>(c, m, n);
    }
}

criterion_group! {
    name = group;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(group);
