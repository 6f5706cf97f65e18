//! The seed's four typical bf16 cases through RmsNorm and RmsNormGrad on the
//! CPU backend (one thread per core), each checked against the f64 reference:
//! prints the max error and the time.
//!
//! Run: `cargo run --release --example seed_cases`

use std::time::Instant;

use half::bf16;
use npukern::*;

/// One case's shape: x is `[a, b, h]`, gamma `[h]`.
pub struct Case {
    /// x's shape.
    pub shape: [usize; 3],
}

/// The four seed cases.
pub const CASES: [Case; 4] = [
    Case {
        shape: [1024, 1, 12288],
    },
    Case {
        shape: [512, 4, 4096],
    },
    Case {
        shape: [4, 2048, 5120],
    },
    Case {
        shape: [2, 2048, 4096],
    },
];

/// Errors and times of one case.
#[derive(Debug, Default)]
pub struct Report {
    /// Max ulp distance of y from the reference's correctly rounded y.
    pub y_ulps: u32,
    /// Max relative error of rstd.
    pub rstd_rel: f64,
    /// Max |dx - ref| / (1 ulp + 1e-5 * row gradient scale); <= 1 passes.
    pub dx_score: f64,
    /// Max |dgamma - ref| / sum_m |dy * xh|.
    pub dgamma_rel: f64,
    /// Forward time, seconds.
    pub fwd_s: f64,
    /// Backward time, seconds.
    pub bwd_s: f64,
}

struct Rng(u64);
impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    /// A typical activation: normal-ish with the occasional outlier.
    fn act(&mut self) -> f32 {
        let u = self.unit() + self.unit() + self.unit() - 1.5;
        (if self.unit() < 0.001 {
            u * 50.0
        } else {
            u * 2.0
        }) as f32
    }
}

fn ulps(a: bf16, b: bf16) -> u32 {
    let o = |v: bf16| {
        let b = v.to_bits() as i32;
        if b & 0x8000 != 0 {
            -(b & 0x7fff)
        } else {
            b
        }
    };
    (o(a) - o(b)).unsigned_abs()
}

fn ulp(v: f64) -> f64 {
    let t = bf16::from_f64(v.abs());
    bf16::from_bits(t.to_bits() + 1).to_f64() - t.to_f64()
}

/// Runs one case: forward and backward on `exec`, the same on the reference.
pub fn run(case: &Case, exec: &Exec<'_>) -> Report {
    let [a, b, h] = case.shape;
    let m = a * b;
    let mut rng = Rng(h as u64 * 31 + m as u64);
    let x: Vec<bf16> = (0..m * h).map(|_| bf16::from_f32(rng.act())).collect();
    let dy: Vec<bf16> = (0..m * h)
        .map(|_| bf16::from_f32(rng.act() * 1e-3))
        .collect();
    let g: Vec<bf16> = (0..h)
        .map(|_| bf16::from_f32(1.0 + rng.act() * 0.1))
        .collect();
    let xt = TensorRef::new(&x, &case.shape).unwrap();
    let dyt = TensorRef::new(&dy, &case.shape).unwrap();
    let gt = TensorRef::new(&g, &[h]).unwrap();
    let opts = RmsNormOptions::default();
    let gopts = RmsNormGradOptions::default();
    static REF: Reference = Reference;
    let refx = Exec::new(&REF);
    let mut rep = Report::default();

    let fwd = |e: &Exec<'_>| {
        let mut ws = vec![0u8; rms_norm_workspace_size(e, xt, gt, &opts).unwrap()];
        let (mut y, mut rstd) = (vec![bf16::ZERO; m * h], vec![0f32; m]);
        // Best of three (the first also faults the fresh output pages in).
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            rms_norm(e, xt, gt, &opts, &mut y, Some(&mut rstd), &mut ws).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        (y, rstd, best)
    };
    let (y, rstd, t) = fwd(exec);
    rep.fwd_s = t;
    let (yr, rstdr, _) = fwd(&refx);
    rep.y_ulps = y
        .iter()
        .zip(&yr)
        .map(|(p, q)| ulps(*p, *q))
        .max()
        .unwrap_or(0);
    rep.rstd_rel = rstd
        .iter()
        .zip(&rstdr)
        .map(|(p, q)| ((p - q) / q).abs() as f64)
        .fold(0.0, f64::max);

    let rt = TensorRef::new(&rstd, &[m]).unwrap();
    let inputs = RmsNormGradInputs::new(xt, rt, gt);
    let bwd = |e: &Exec<'_>| {
        let mut ws = vec![0u8; rms_norm_grad_workspace_size(e, dyt, &inputs, &gopts).unwrap()];
        let (mut dx, mut dg) = (vec![bf16::ZERO; m * h], vec![0f32; h]);
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            let dgamma = Some(&mut dg[..]);
            rms_norm_grad(
                e,
                dyt,
                &inputs,
                &gopts,
                &mut dx,
                DgammaOut {
                    dgamma,
                    dgamma_cast: None,
                },
                &mut ws,
            )
            .unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        (dx, dg, best)
    };
    let (dx, dg, t) = bwd(exec);
    rep.bwd_s = t;
    let (dxr, dgr, _) = bwd(&refx);
    let mut cond = vec![0f64; h];
    for (r, &rs) in rstd.iter().enumerate() {
        let rs = rs as f64;
        let mut scale = 0f64;
        for j in 0..h {
            let i = r * h + j;
            let t = dy[i].to_f64() * x[i].to_f64() * rs;
            cond[j] += t.abs();
            scale = scale.max((rs * dy[i].to_f64() * g[j].to_f64()).abs());
        }
        for j in 0..h {
            let i = r * h + j;
            let err = (dx[i].to_f64() - dxr[i].to_f64()).abs();
            rep.dx_score = rep
                .dx_score
                .max(err / (ulp(dxr[i].to_f64()) + 1e-5 * scale));
        }
    }
    for j in 0..h {
        rep.dgamma_rel = rep
            .dgamma_rel
            .max((dg[j] as f64 - dgr[j] as f64).abs() / cond[j].max(f64::MIN_POSITIVE));
    }
    rep
}

fn main() {
    let cpu = Cpu::new(Threads::per_core());
    let exec = Exec::new(&cpu);
    println!(
        "npukern {} seed cases, bf16, CPU backend on {} threads, ISA {:?}",
        VERSION,
        Threads::per_core().threads(),
        Isa::detected()
    );
    println!(
        "RmsNorm forward and RmsNormGrad backward per case, each error against the f64 reference:"
    );
    println!("  y ulps      largest error of y in bf16 ulps (bound {Y_ULPS})");
    println!("  rstd rel    largest relative error of rstd (bound {RSTD_REL:e})");
    println!("  dx score    largest dx error in units of 1 bf16 ulp + 1e-5 of the row's gradient scale (bound {DX_SCORE})");
    println!("  dgamma rel  largest dgamma error relative to sum |dy * x * rstd| of its column (bound {DGAMMA_REL:e})");
    println!("  fwd / bwd   best of 3 wall-clock times");
    println!(
        "{:<18} {:>7} {:>10} {:>9} {:>11} {:>9} {:>9}  verdict",
        "x shape", "y ulps", "rstd rel", "dx score", "dgamma rel", "fwd ms", "bwd ms"
    );
    let mut all_ok = true;
    for case in &CASES {
        let r = run(case, &exec);
        let ok = r.y_ulps <= Y_ULPS
            && r.rstd_rel <= RSTD_REL
            && r.dx_score <= DX_SCORE
            && r.dgamma_rel <= DGAMMA_REL;
        all_ok &= ok;
        println!(
            "{:<18} {:>7} {:>10.2e} {:>9.3} {:>11.2e} {:>9.2} {:>9.2}  {}",
            format!("{:?}", case.shape),
            r.y_ulps,
            r.rstd_rel,
            r.dx_score,
            r.dgamma_rel,
            r.fwd_s * 1e3,
            r.bwd_s * 1e3,
            if ok { "within bounds" } else { "OUT OF BOUNDS" }
        );
    }
    let worst = embedding_case(&exec);
    all_ok &= worst <= EMBEDDING_ULPS;
    println!(
        "embedding verdict: {} (bound {EMBEDDING_ULPS} bf16 ulp)",
        if worst <= EMBEDDING_ULPS {
            "within bounds"
        } else {
            "OUT OF BOUNDS"
        }
    );
    println!(
        "overall: {}",
        if all_ok {
            "every case within its bound"
        } else {
            "SOME CASE OUT OF BOUNDS"
        }
    );
    if !all_ok {
        std::process::exit(1);
    }
}

// The bounds the demo holds each case to; tests/seed_cases.rs asserts them.
/// y: bf16 ulps from the f64 reference.
pub const Y_ULPS: u32 = 1;
/// rstd: relative error.
pub const RSTD_REL: f64 = 1e-6;
/// dx: 1 bf16 ulp + 1e-5 of the row's gradient scale.
pub const DX_SCORE: f64 = 1.0;
/// dgamma: error relative to its column's sum |dy * x * rstd|.
pub const DGAMMA_REL: f64 = 1e-5;
/// The embedding gradient: bf16 ulps from the f64 reference.
pub const EMBEDDING_ULPS: u32 = 1;

/// The seed's embedding case: the bf16 gradient of a 32000 x 4096 table from
/// 8192 tokens (Zipf-like ids, so some rows repeat many times), checked
/// against the f64 reference, timed against a copy of the same bytes.
pub fn embedding_case(exec: &Exec<'_>) -> u32 {
    let (n, h, v) = (8192usize, 4096usize, 32000usize);
    let mut rng = Rng(7);
    let idx: Vec<i64> = (0..n)
        .map(|_| ((v as f64).powf(rng.unit()) - 1.0) as i64)
        .collect();
    let grad: Vec<bf16> = (0..n * h)
        .map(|_| bf16::from_f32(rng.act() * 1e-3))
        .collect();
    let gt = TensorRef::new(&grad, &[n, h]).unwrap();
    let it = TensorRef::new(&idx, &[n]).unwrap();
    let opts = EmbeddingGradOptions::default();
    let table = |e: &Exec<'_>| {
        let bytes = embedding_dense_grad_workspace_size(e, gt, it, v, &opts).unwrap();
        let mut ws = vec![0u8; bytes];
        let mut out = vec![bf16::ONE; v * h];
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            embedding_dense_grad(e, gt, it, v, &opts, &mut out, &mut ws).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        (out, best)
    };
    let (out, t) = table(exec);
    // The ratio compares like with like: one thread for the kernel and the copy.
    let (_, t1) = table(&Exec::cpu());
    static REF: Reference = Reference;
    let (outr, _) = table(&Exec::new(&REF));
    let worst = out
        .iter()
        .zip(&outr)
        .map(|(p, q)| ulps(*p, *q))
        .max()
        .unwrap_or(0);
    // The floor: a copy moving the same bytes (table written, grad read); a
    // copy reads and writes its length, so it copies half of them.
    let moved = (v * h + n * h) * 2;
    let src = vec![1u8; moved / 2];
    let mut dst = vec![0u8; moved / 2];
    let mut copy = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        copy = copy.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    let distinct = {
        let mut s = idx.clone();
        s.sort();
        s.dedup();
        s.len()
    };
    println!(
        "embedding dense grad: grad [{n}, {h}] bf16, {distinct} distinct of {v} rows -> [{v}, {h}] bf16: \
         max {worst} bf16 ulp from the f64 reference, {:.2} ms; single thread {:.2} ms = {:.2}x a single-thread copy moving the same {:.0} MB ({:.2} ms)",
        t * 1e3,
        t1 * 1e3,
        t1 / copy,
        moved as f64 / 1e6,
        copy * 1e3
    );
    worst
}
