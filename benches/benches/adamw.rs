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
//! The compact state formats (`adamw_with_scales`), bf16 params and grads,
//! one group per mode; each floor copies the mean of the bytes that mode's
//! step reads and writes (param, grad, low halves, moments, block scales):
//! - `split`: split masters (bf16 param + i16 low half), f32 moments —
//!   reads 2 + 2 + 2 + 4 + 4, writes 2 + 2 + 4 + 4: 13 bytes;
//! - `split_sr`: split masters, bf16 moments rounded stochastically —
//!   reads 2 + 2 + 2 + 2 + 2, writes 2 + 2 + 2 + 2: 9 bytes;
//! - `split_q8`: split masters, 8-bit moments (one f32 scale per 256
//!   elements of each) — reads 8 + 8/256, writes 6 + 8/256: 7.03 bytes;
//! - `sr_q8`: no masters, params rounded stochastically, 8-bit moments —
//!   reads 6 + 8/256, writes 4 + 8/256: 5.03 bytes.
//!
//! (`bf16_master` above is the float32-master mode.)
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
//! Times are the thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`, as
//! `matmul_peak`): on a core shared with other work the wall clock counts
//! their time slices too (both agree on an idle core).
//!
//! Run: `taskset -c 0 cargo bench -p npukern-benches --bench adamw` (add
//! `-- --quick` for a short run, a filter such as `-- q8` for some groups).

use std::hint::black_box;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use npukern::*;
use npukern_benches::{data, zeros, Aligned};

/// The elements of each group: 2^24, or `NPK_ADAMW_ELEMS` (a multiple of
/// 8192; e.g. 65536 for a cache-resident view of the arithmetic alone).
fn elems() -> usize {
    std::env::var("NPK_ADAMW_ELEMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 24)
}
const SPLIT: [usize; 8] = [1, 3, 2, 5, 1, 7, 4, 9];

/// The thread's CPU time, in nanoseconds, as a criterion measurement.
pub struct ThreadCpu;

fn thread_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer; the clock exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Wall time's formatter (nanoseconds either way).
static WALL: WallTime = WallTime;

impl Measurement for ThreadCpu {
    type Intermediate = u64;
    type Value = u64;
    fn start(&self) -> u64 {
        thread_ns()
    }
    fn end(&self, i: u64) -> u64 {
        thread_ns().saturating_sub(i)
    }
    fn add(&self, a: &u64, b: &u64) -> u64 {
        a + b
    }
    fn zero(&self) -> u64 {
        0
    }
    fn to_f64(&self, v: &u64) -> f64 {
        *v as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        WALL.formatter()
    }
}

type Group<'a> = criterion::BenchmarkGroup<'a, ThreadCpu>;

fn sizes() -> Vec<usize> {
    let total: usize = SPLIT.iter().sum();
    let mut v: Vec<usize> = SPLIT.iter().map(|p| elems() / total * p).collect();
    let used: usize = v.iter().sum();
    v[7] += elems() - used;
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

/// The group `adamw/{name}/{elems}x8`, its throughput `bytes`, with
/// `copy_floor` (a memcpy of `bytes`) timed first.
fn group_with_copy_floor<'a>(
    c: &'a mut Criterion<ThreadCpu>,
    name: &str,
    bytes: usize,
) -> Group<'a> {
    let mut grp = c.benchmark_group(format!("adamw/{name}/{}x8", elems()));
    grp.throughput(Throughput::Bytes(bytes as u64));
    let src = Aligned::filled(1u8, bytes);
    let mut dst = Aligned::filled(0u8, bytes);
    grp.bench_function("copy_floor", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    grp
}

fn run<P: Float, G: Float>(
    c: &mut Criterion<ThreadCpu>,
    name: &str,
    floor_bytes_per_elem: usize,
    master: bool,
    flags: u32,
    wrap_p: fn(&mut [P]) -> GradTensorMut<'_>,
    wrap_g: fn(&[G]) -> GradTensor<'_>,
) {
    let mut grp = group_with_copy_floor(c, name, elems() * floor_bytes_per_elem);
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
fn rmw_floor(grp: &mut Group<'_>) {
    let mut p: Aligned<f32> = data(elems(), 1);
    let g: Aligned<f32> = data(elems(), 2);
    let mut m: Aligned<f32> = zeros(elems());
    let mut v: Aligned<f32> = zeros(elems());
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

/// How a compact mode stores its moments.
#[derive(Clone, Copy, PartialEq)]
enum Moments {
    F32,
    /// bf16, rounded stochastically.
    Bf16Sr,
    /// 8-bit codes and block scales.
    Q8,
}

/// One compact state mode: bf16 params and grads.
struct Mode {
    name: &'static str,
    /// Split masters (else no masters: params rounded stochastically).
    split: bool,
    moments: Moments,
}

const MODES: [Mode; 4] = [
    Mode {
        name: "split",
        split: true,
        moments: Moments::F32,
    },
    Mode {
        name: "split_sr",
        split: true,
        moments: Moments::Bf16Sr,
    },
    Mode {
        name: "split_q8",
        split: true,
        moments: Moments::Q8,
    },
    Mode {
        name: "sr_q8",
        split: false,
        moments: Moments::Q8,
    },
];

/// A mode's moment tensors.
enum MomentBufs {
    F32(Vec<Aligned<f32>>),
    Bf16(Vec<Aligned<bf16>>),
    U8(Vec<Aligned<u8>>),
}

impl MomentBufs {
    fn new(kind: Moments, s: &[usize]) -> Self {
        match kind {
            Moments::F32 => MomentBufs::F32(s.iter().map(|&n| zeros(n)).collect()),
            Moments::Bf16Sr => MomentBufs::Bf16(s.iter().map(|&n| zeros(n)).collect()),
            Moments::Q8 => MomentBufs::U8(s.iter().map(|&n| Aligned::filled(0u8, n)).collect()),
        }
    }

    fn tensors(&mut self) -> Vec<GradTensorMut<'_>> {
        match self {
            MomentBufs::F32(v) => v.iter_mut().map(|t| GradTensorMut::F32(t)).collect(),
            MomentBufs::Bf16(v) => v.iter_mut().map(|t| GradTensorMut::BF16(t)).collect(),
            MomentBufs::U8(v) => v.iter_mut().map(|t| GradTensorMut::U8(t)).collect(),
        }
    }
}

/// The bytes one step of `mode` reads and writes (params, grads, low
/// halves, both moments, their block scales).
fn mode_bytes(mode: &Mode, s: &[usize]) -> (usize, usize) {
    let n = elems();
    let mom = match mode.moments {
        Moments::F32 => 4,
        Moments::Bf16Sr => 2,
        Moments::Q8 => 1,
    };
    let scales: usize = match mode.moments {
        Moments::Q8 => s.iter().map(|&k| 2 * 4 * q8_scales_len(k)).sum(),
        _ => 0,
    };
    let low = if mode.split { 2 } else { 0 };
    // Read: param, grad, low half, m, v; written: param, low half, m, v.
    let read = n * (2 + 2 + low + 2 * mom) + scales;
    let written = n * (2 + low + 2 * mom) + scales;
    (read, written)
}

fn run_mode(c: &mut Criterion<ThreadCpu>, mode: &Mode) {
    let s = sizes();
    let (read, written) = mode_bytes(mode, &s);
    let mut grp = group_with_copy_floor(c, mode.name, (read + written) / 2);
    let mut l = lists::<bf16, bf16>(false);
    let mut low: Vec<Aligned<i16>> = if mode.split {
        s.iter().map(|&n| Aligned::filled(0i16, n)).collect()
    } else {
        vec![]
    };
    let mut mb = MomentBufs::new(mode.moments, &s);
    let mut vb = MomentBufs::new(mode.moments, &s);
    let q8 = mode.moments == Moments::Q8;
    let scale_bufs = || -> Vec<Aligned<f32>> {
        if q8 {
            s.iter().map(|&n| zeros(q8_scales_len(n))).collect()
        } else {
            vec![]
        }
    };
    let (mut sm, mut sv) = (scale_bufs(), scale_bufs());
    let mut p: Vec<_> = l.p.iter_mut().map(|t| GradTensorMut::BF16(t)).collect();
    let g: Vec<_> = l.g.iter().map(|t| GradTensor::BF16(t)).collect();
    let mut m = mb.tensors();
    let mut v = vb.tensors();
    let mut w: Vec<_> = low.iter_mut().map(|t| GradTensorMut::I16(t)).collect();
    let mut smt: Vec<_> = sm.iter_mut().map(|t| GradTensorMut::F32(t)).collect();
    let mut svt: Vec<_> = sv.iter_mut().map(|t| GradTensorMut::F32(t)).collect();
    let mut t = AdamWTensors {
        params: &mut p,
        grads: &g,
        exp_avgs: &mut m,
        exp_avg_sqs: &mut v,
        max_exp_avg_sqs: &mut [],
        masters: &mut w,
    };
    let mut sc = AdamWScales {
        exp_avgs: &mut smt,
        exp_avg_sqs: &mut svt,
        max_exp_avg_sqs: &mut [],
    };
    let f = AdamWFormats {
        split_masters: mode.split,
        rounding: if mode.moments == Moments::Bf16Sr {
            ADAMW_SR_MOMENTS
        } else {
            0
        } | if mode.split { 0 } else { ADAMW_SR_PARAMS },
        quantized_moments: q8,
        seed: 1,
        keys: &[],
        q8_rows: &[],
    };
    let exec = Exec::cpu();
    // lr 0: the params stay put over any number of iterations (same work).
    let o = AdamWOptions {
        lr: 0.0,
        weight_decay: 0.0,
        ..AdamWOptions::new(0.0)
    };
    let mut ws =
        vec![0u8; adamw_with_scales_workspace_size(&exec, &mut t, &mut sc, &o, &f).unwrap()];
    grp.bench_function("adamw", |b| {
        b.iter(|| adamw_with_scales(&exec, black_box(&mut t), &mut sc, &o, &f, &mut ws).unwrap())
    });
    grp.finish();
}

fn benches(c: &mut Criterion<ThreadCpu>) {
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
    for mode in &MODES {
        run_mode(c, mode);
    }
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
    config = Criterion::default()
        .with_measurement(ThreadCpu)
        .sample_size(10)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3));
    targets = benches
}
criterion_main!(adamw_benches);
