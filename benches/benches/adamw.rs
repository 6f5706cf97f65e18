//! The AdamW step pass against a copy of the same bytes, single-threaded
//! (serial runner), one criterion group per recipe:
//! - `bf16_master`: bf16 params and grads, f32 masters and moments — reads
//!   grad 2 + master 4 + m 4 + v 4 bytes and writes param 2 + master 4 +
//!   m 4 + v 4 per element: `copy_floor` copies 14 bytes per element;
//! - `bf16_master_clip`: the same with the clip inside the step
//!   (`ADAMW_CLIP`: one more read of the grads for the norm): floor 16 bytes;
//! - `f32`: float32 params, grads and moments (reads 16, writes 12 bytes):
//!   floor 14 bytes.
//!
//! The `f32` group also times `rmw_floor`: one loop over the same four
//! streams that reads params, grads and both moments and writes params and
//! moments back with one addition each — the step's traffic with no
//! arithmetic, the floor an in-place step can reach on this core (a copy
//! into a second buffer is not one: it fetches the lines it writes).
//!
//! The elements (2^24) are split over 8 tensors of mixed sizes. Ratio to
//! report: `adamw / copy_floor` (an in-place update writes back lines it has
//! just read, which a copy into a cold buffer must first fetch, so the step
//! can come in under its floor).
//!
//! Run: `taskset -c 0 cargo bench -p npukern-benches --bench adamw` (add
//! `-- --quick` for a short run).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use npukern::*;
use npukern_benches::{data, zeros, Aligned};

const ELEMS: usize = 1 << 24;
const SPLIT: [usize; 8] = [1, 3, 2, 5, 1, 7, 4, 9];

fn sizes() -> Vec<usize> {
    let total: usize = SPLIT.iter().sum();
    let mut v: Vec<usize> = SPLIT.iter().map(|p| ELEMS / total * p).collect();
    let used: usize = v.iter().sum();
    v[7] += ELEMS - used;
    v
}

/// One recipe's tensors: params P, grads G, moments (and masters) f32.
struct Lists<P: Float, G: Float> {
    p: Vec<Aligned<P>>,
    g: Vec<Aligned<G>>,
    m: Vec<Aligned<f32>>,
    v: Vec<Aligned<f32>>,
    w: Vec<Aligned<f32>>,
}

fn lists<P: Float, G: Float>(master: bool) -> Lists<P, G> {
    let s = sizes();
    Lists {
        p: s.iter()
            .enumerate()
            .map(|(i, &n)| data(n, i as u32 + 1))
            .collect(),
        // Small gradients, as in training (no subnormal arises: moments of
        // squares of ~1e-3 stay far above f32's normal range).
        g: s.iter()
            .enumerate()
            .map(|(i, &n)| {
                let d: Aligned<f32> = data(n, i as u32 + 11);
                Aligned::from_iter(n, d.iter().map(|x| G::from_f32(x * 1e-3))).unwrap()
            })
            .collect(),
        m: s.iter().map(|&n| zeros(n)).collect(),
        v: s.iter().map(|&n| zeros(n)).collect(),
        w: if master {
            s.iter()
                .enumerate()
                .map(|(i, &n)| data(n, i as u32 + 1))
                .collect()
        } else {
            vec![]
        },
    }
}

fn run<P: Float, G: Float>(
    c: &mut Criterion,
    name: &str,
    floor_bytes_per_elem: usize,
    master: bool,
    flags: u32,
    wrap_p: fn(&mut [P]) -> GradTensorMut<'_>,
    wrap_g: fn(&[G]) -> GradTensor<'_>,
) {
    let bytes = ELEMS * floor_bytes_per_elem;
    let mut grp = c.benchmark_group(format!("adamw/{name}/{ELEMS}x8"));
    grp.throughput(Throughput::Bytes(bytes as u64));
    let src = Aligned::filled(1u8, bytes);
    let mut dst = Aligned::filled(0u8, bytes);
    grp.bench_function("copy_floor", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    drop((src, dst));
    let mut l = lists::<P, G>(master);
    let mut p: Vec<_> = l.p.iter_mut().map(|t| wrap_p(t)).collect();
    let g: Vec<_> = l.g.iter().map(|t| wrap_g(t)).collect();
    let mut m: Vec<_> = l.m.iter_mut().map(|t| GradTensorMut::F32(t)).collect();
    let mut v: Vec<_> = l.v.iter_mut().map(|t| GradTensorMut::F32(t)).collect();
    let mut w: Vec<_> = l.w.iter_mut().map(|t| GradTensorMut::F32(t)).collect();
    let mut t = AdamWTensors {
        params: &mut p,
        grads: &g,
        exp_avgs: &mut m,
        exp_avg_sqs: &mut v,
        max_exp_avg_sqs: &mut [],
        masters: &mut w,
    };
    if name == "f32" {
        rmw_floor(&mut grp);
    }
    let exec = Exec::cpu();
    // lr 0: the values stay put over any number of iterations (same work).
    let o = AdamWOptions {
        lr: 0.0,
        weight_decay: 0.0,
        flags,
        max_grad_norm: 1e30,
        ..AdamWOptions::new(0.0)
    };
    let mut ws = vec![0u8; adamw_workspace_size(&exec, &mut t, &o).unwrap()];
    grp.bench_function("adamw", |b| {
        b.iter(|| adamw(&exec, black_box(&mut t), &o, &mut ws).unwrap())
    });
    grp.finish();
}

/// The f32 step's traffic without its arithmetic (see the module docs).
fn rmw_floor(grp: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    let mut p: Aligned<f32> = data(ELEMS, 1);
    let g: Aligned<f32> = data(ELEMS, 2);
    let mut m: Aligned<f32> = zeros(ELEMS);
    let mut v: Aligned<f32> = zeros(ELEMS);
    grp.bench_function("rmw_floor", |b| {
        b.iter(|| {
            for (((p, g), m), v) in p
                .iter_mut()
                .zip(black_box(&*g).iter())
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                *p += g;
                *m += g;
                *v += g;
            }
        })
    });
}

fn benches(c: &mut Criterion) {
    run::<bf16, bf16>(
        c,
        "bf16_master",
        14,
        true,
        0,
        |s| GradTensorMut::BF16(s),
        |s| GradTensor::BF16(s),
    );
    run::<bf16, bf16>(
        c,
        "bf16_master_clip",
        16,
        true,
        ADAMW_CLIP,
        |s| GradTensorMut::BF16(s),
        |s| GradTensor::BF16(s),
    );
    run::<f32, f32>(
        c,
        "f32",
        14,
        false,
        0,
        |s| GradTensorMut::F32(s),
        |s| GradTensor::F32(s),
    );
}

criterion_group! {
    name = adamw_benches;
    config = Criterion::default().sample_size(20);
    targets = benches
}
criterion_main!(adamw_benches);
