//! AdamW / Adam over tensor lists against an independent float64 model: every
//! (param, grad, moment) dtype triple, masters, amsgrad, maximize, L2 mode,
//! AMP's scale and found_inf, the clip inside the step; lengths around the
//! lane width and the block cut; bit-identical across thread counts, ISAs
//! and block counts; bad input refused with nothing written.
//!
//! Tolerances (per element, against the exact f64 result `want`):
//! `|got - want| <= ulp_T(want) + 2^-24 * S`, where S bounds the f32
//! arithmetic's error: `4 (|m b1| + |g (1 - b1)|)` for exp_avg,
//! `4 (|v b2| + g^2 (1 - b2))` for exp_avg_sq, `2 |p decayed| + 16 |update|`
//! plus the moments' errors carried through for the param (or master), and
//! L2 mode's `|p wd|` before its cancellation with g. `cargo test --release --test adamw -- --nocapture` prints
//! the worst score (1.0 = at the bound) per dtype triple.

mod common;

use common::owned::Owned;
use common::{ulp_at, Rng};
use half::bf16;
use npukern::*;

/// One optimizer state: the six parallel lists.
#[derive(Clone, Debug, PartialEq)]
struct State {
    p: Vec<Owned>,
    g: Vec<Owned>,
    m: Vec<Owned>,
    v: Vec<Owned>,
    x: Vec<Owned>,
    w: Vec<Owned>,
}

impl State {
    fn new(
        rng: &mut Rng,
        lens: &[usize],
        (pd, gd, md): (DType, DType, DType),
        ams: bool,
        master: bool,
        step: u64,
    ) -> State {
        let mut s = State {
            p: vec![],
            g: vec![],
            m: vec![],
            v: vec![],
            x: vec![],
            w: vec![],
        };
        for &n in lens {
            let pv: Vec<f64> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
            let gv: Vec<f64> = (0..n).map(|_| rng.mag() * 1e-2).collect();
            let first = step == 1;
            let mv: Vec<f64> = (0..n)
                .map(|i| {
                    if first {
                        0.0
                    } else {
                        gv[i] * rng.uniform(-2.0, 2.0)
                    }
                })
                .collect();
            let vv: Vec<f64> = (0..n)
                .map(|i| {
                    if first {
                        0.0
                    } else {
                        gv[i] * gv[i] * rng.uniform(0.0, 3.0)
                    }
                })
                .collect();
            if master {
                s.w.push(Owned::F32(pv.iter().map(|&x| x as f32).collect()));
                let wv = s.w.last().unwrap().f64s();
                s.p.push(Owned::from_f64(pd, &wv));
            } else {
                s.p.push(Owned::from_f64(pd, &pv));
            }
            s.g.push(Owned::from_f64(gd, &gv));
            s.m.push(Owned::from_f64(md, &mv));
            s.v.push(Owned::from_f64(md, &vv));
            if ams {
                let xv: Vec<f64> = vv.iter().map(|&v| v * rng.uniform(0.5, 1.5)).collect();
                s.x.push(Owned::from_f64(md, &xv));
            }
        }
        s
    }

    /// Runs `f` on the state's lists as the operator takes them.
    fn with<R>(&mut self, f: impl FnOnce(&mut AdamWTensors<'_, '_>) -> R) -> R {
        let mut p: Vec<_> = self.p.iter_mut().map(|t| t.view_mut()).collect();
        let g: Vec<_> = self.g.iter().map(|t| t.view()).collect();
        let mut m: Vec<_> = self.m.iter_mut().map(|t| t.view_mut()).collect();
        let mut v: Vec<_> = self.v.iter_mut().map(|t| t.view_mut()).collect();
        let mut x: Vec<_> = self.x.iter_mut().map(|t| t.view_mut()).collect();
        let mut w: Vec<_> = self.w.iter_mut().map(|t| t.view_mut()).collect();
        f(&mut AdamWTensors {
            params: &mut p,
            grads: &g,
            exp_avgs: &mut m,
            exp_avg_sqs: &mut v,
            max_exp_avg_sqs: &mut x,
            masters: &mut w,
        })
    }

    fn run(&mut self, exec: &Exec<'_>, o: &AdamWOptions) -> Result<AdamWReport> {
        self.with(|t| {
            let n = adamw_workspace_size(exec, t, o)?;
            let mut ws = vec![0u8; n];
            adamw(exec, t, o, &mut ws)
        })
    }
}

fn powi(x: f64, n: u64) -> f64 {
    x.powi(n as i32)
}

/// The independent f64 model: the exact results (before rounding) and the
/// error scales of the tolerance, per list and element; the global norm.
struct Want {
    p: Vec<Vec<(f64, f64)>>,
    m: Vec<Vec<(f64, f64)>>,
    v: Vec<Vec<(f64, f64)>>,
    x: Vec<Vec<f64>>,
    norm: f64,
    stepped: bool,
}

fn model(s: &State, o: &AdamWOptions) -> Want {
    let has = |f| o.flags & f != 0;
    let scale = if has(ADAMW_GRAD_SCALE) {
        o.grad_scale as f64
    } else {
        1.0
    };
    let mut sq = 0.0f64;
    for g in &s.g {
        for x in g.f64s() {
            sq += x * x;
        }
    }
    let norm = sq.sqrt() / scale.abs();
    let mut coef = 1.0f64;
    let mut stepped = !(has(ADAMW_FOUND_INF) && o.found_inf != 0.0);
    if has(ADAMW_CLIP_COEF) {
        coef = o.clip_coef as f64;
    }
    if has(ADAMW_CLIP) {
        if norm.is_finite() && (norm as f32).is_finite() {
            coef = clip_coefficient(norm, o.max_grad_norm) as f64;
        } else {
            stepped = false;
        }
    }
    let bc1 = 1.0 - powi(o.beta1, o.step);
    let bc2s = (1.0 - powi(o.beta2, o.step)).sqrt();
    let sign = if has(ADAMW_MAXIMIZE) { -1.0 } else { 1.0 };
    let mut w = Want {
        p: vec![],
        m: vec![],
        v: vec![],
        x: vec![],
        norm,
        stepped,
    };
    for k in 0..s.p.len() {
        let p0 = if s.w.is_empty() {
            s.p[k].f64s()
        } else {
            s.w[k].f64s()
        };
        let (g0, m0, v0) = (s.g[k].f64s(), s.m[k].f64s(), s.v[k].f64s());
        let x0 = s.x.get(k).map(|x| x.f64s());
        let (mut pp, mut mm, mut vv, mut xx) = (vec![], vec![], vec![], vec![]);
        for i in 0..p0.len() {
            let mut g = g0[i] / scale * coef * sign;
            // Magnitude of g's terms before any cancellation (L2's p * wd).
            let mut gs = g.abs();
            let mut p = p0[i];
            if has(ADAMW_L2) {
                g += p * o.weight_decay;
                gs += (p * o.weight_decay).abs();
            } else {
                p *= 1.0 - o.lr * o.weight_decay;
            }
            let m = m0[i] * o.beta1 + g * (1.0 - o.beta1);
            let v = v0[i] * o.beta2 + g * g * (1.0 - o.beta2);
            let ms = 4.0 * ((m0[i] * o.beta1).abs() + (g * (1.0 - o.beta1)).abs())
                + 2.0 * gs * (1.0 - o.beta1);
            let vs = 4.0 * ((v0[i] * o.beta2).abs() + g * g * (1.0 - o.beta2))
                + 4.0 * g.abs() * gs * (1.0 - o.beta2);
            mm.push((m, ms));
            vv.push((v, vs));
            let d = match &x0 {
                Some(x) => {
                    let mx = x[i].max(v);
                    xx.push(mx);
                    mx
                }
                None => v,
            };
            let den = d.sqrt() / bc2s + o.eps;
            let upd = o.lr / bc1 * m / den;
            // The update's own roundings, and m's and v's errors carried in.
            let us = 16.0 * upd.abs()
                + o.lr / bc1 * ms / den
                + upd.abs() / den * vs / (2.0 * bc2s * d.sqrt().max(1e-300));
            pp.push((p - upd, 2.0 * p.abs() + us));
        }
        w.p.push(pp);
        w.m.push(mm);
        w.v.push(vv);
        w.x.push(xx);
    }
    w
}

/// The worst error score (1.0 = at the tolerance) of `got` against `want`.
fn score(got: &Owned, want: &[(f64, f64)]) -> f64 {
    let mut worst = 0.0f64;
    for (i, (&g, &(w, s))) in got.f64s().iter().zip(want).enumerate() {
        let sc = (g - w).abs() / (got.ulp(w) + s * 2f64.powi(-24));
        if sc > worst {
            worst = sc;
            if sc > 1.0 && std::env::var("ADAMW_DEBUG").is_ok() {
                println!("element {i}: got {g:e} want {w:e} scale {s:e} score {sc}");
            }
        }
    }
    worst
}

/// Checks a stepped state against the model; returns the worst score.
fn check(before: &State, after: &State, o: &AdamWOptions, r: &AdamWReport) -> f64 {
    let w = model(before, o);
    assert_eq!(r.stepped != 0, w.stepped, "stepped");
    if o.flags & ADAMW_CLIP != 0 {
        let rel = (r.grad_norm - w.norm).abs() / w.norm.max(1e-300);
        assert!(
            rel < 1e-12 || (r.grad_norm.is_nan() && w.norm.is_nan()),
            "norm {} vs {}",
            r.grad_norm,
            w.norm
        );
    } else {
        assert!(r.grad_norm.is_nan());
    }
    if !w.stepped {
        assert_eq!(before, after, "a skipped step changed something");
        return 0.0;
    }
    assert_eq!(before.g, after.g, "grads are read only");
    let mut worst = 0.0f64;
    for k in 0..before.p.len() {
        if after.w.is_empty() {
            worst = worst.max(score(&after.p[k], &w.p[k]));
        } else {
            worst = worst.max(score(&after.w[k], &w.p[k]));
            // The param is its master rounded once.
            let wv: Vec<f64> = after.w[k].f64s();
            let want = Owned::from_f64(after.p[k].dtype(), &wv);
            let (got_bits, want_bits) = (after.p[k].bits(), want.bits());
            if let Some(i) = (0..wv.len()).find(|&i| got_bits[i] != want_bits[i]) {
                panic!(
                    "param = round(master) fails at [{k}][{i}]: master {:e}, param {:e}, want {:e}",
                    wv[i],
                    after.p[k].f64s()[i],
                    want.f64s()[i]
                );
            }
        }
        worst = worst.max(score(&after.m[k], &w.m[k]));
        worst = worst.max(score(&after.v[k], &w.v[k]));
        if let Some(x) = after.x.get(k) {
            let want: Vec<(f64, f64)> = w.x[k]
                .iter()
                .zip(&w.v[k])
                .map(|(&x, &(_, s))| (x, s))
                .collect();
            worst = worst.max(score(x, &want));
        }
    }
    worst
}

const TRIPLES: [(DType, DType, DType); 11] = [
    (DType::F32, DType::F32, DType::F32),
    (DType::F32, DType::BF16, DType::F32),
    (DType::BF16, DType::BF16, DType::F32),
    (DType::BF16, DType::BF16, DType::BF16),
    (DType::BF16, DType::F32, DType::F32),
    (DType::BF16, DType::F16, DType::BF16),
    (DType::F16, DType::F16, DType::F32),
    (DType::F16, DType::F16, DType::F16),
    (DType::F16, DType::F32, DType::F16),
    (DType::F32, DType::F16, DType::F32),
    (DType::F16, DType::BF16, DType::F32),
];

// Around the lane width (16), the clip's 512-element window and the
// 4096-element minimum block: 13 180 elements in 4 blocks, two tensors
// across block cuts.
const LENS: [usize; 7] = [1, 15, 16, 17, 4097, 33, 9_001];

fn options(rng: &mut Rng, step: u64, flags: u32) -> AdamWOptions {
    let mut o = AdamWOptions::new(rng.uniform(1e-4, 1e-2));
    o.step = step;
    o.weight_decay = [0.0, 0.01, 0.1][rng.below(3) as usize];
    o.beta1 = [0.9, 0.8, 0.0][rng.below(3) as usize];
    o.beta2 = [0.999, 0.95][rng.below(2) as usize];
    o.eps = [1e-8, 1e-6][rng.below(2) as usize];
    o.flags = flags;
    o.grad_scale = 1024.0;
    o.max_grad_norm = 0.5;
    o.clip_coef = 0.37;
    o
}

#[test]
fn every_dtype_and_option_against_f64() {
    let mut rng = Rng(7);
    let cpu = Exec::cpu();
    let reference = Exec::reference();
    for &tr in &TRIPLES {
        let (mut worst, mut worst_ref) = (0.0f64, 0.0f64);
        for flags in [
            0,
            ADAMW_AMSGRAD,
            ADAMW_MAXIMIZE | ADAMW_L2,
            ADAMW_CLIP,
            ADAMW_GRAD_SCALE | ADAMW_CLIP | ADAMW_AMSGRAD,
        ] {
            for master in [false, true] {
                for step in [1u64, 7, 1000] {
                    let o = options(&mut rng, step, flags);
                    let ams = flags & ADAMW_AMSGRAD != 0;
                    let mut s = State::new(&mut rng, &LENS, tr, ams, master, step);
                    for g in s.g.iter_mut() {
                        // AMP: gradients carry the scale.
                        if flags & ADAMW_GRAD_SCALE != 0 {
                            let v: Vec<f64> = g.f64s().iter().map(|x| x * 1024.0).collect();
                            *g = Owned::from_f64(g.dtype(), &v);
                        }
                    }
                    let before = s.clone();
                    let r = s.run(&cpu, &o).unwrap();
                    let sc = check(&before, &s, &o, &r);
                    if sc > 1.0 || std::env::var("ADAMW_DEBUG").is_ok() {
                        println!("{tr:?} flags {flags} master {master} step {step}: {sc} {o:?}");
                    }
                    worst = worst.max(sc);
                    let mut s2 = before.clone();
                    let r2 = s2.run(&reference, &o).unwrap();
                    worst_ref = worst_ref.max(check(&before, &s2, &o, &r2));
                }
            }
        }
        println!("{tr:?}: worst score {worst:.3} (reference model {worst_ref:.3})");
        assert!(worst <= 1.0, "{tr:?}: {worst}");
        assert!(worst_ref <= 1.0, "{tr:?} reference: {worst_ref}");
    }
}

#[test]
fn same_bits_on_every_runner_isa_and_block_count() {
    let mut rng = Rng(11);
    for &tr in &TRIPLES[..4] {
        let flags = ADAMW_AMSGRAD | ADAMW_CLIP;
        let o = options(&mut rng, 3, flags);
        let base = State::new(
            &mut rng,
            &[100_003, 5, 64, 31],
            tr,
            true,
            tr.0 != DType::F32,
            3,
        );
        let mut first: Option<(State, u64)> = None;
        common::for_every_exec(&[1, 7, 64], |exec, what| {
            let mut s = base.clone();
            let r = s.run(exec, &o).unwrap();
            match &first {
                None => first = Some((s, r.grad_norm.to_bits())),
                Some((f, _)) => {
                    for k in 0..f.p.len() {
                        assert_eq!(f.p[k].bits(), s.p[k].bits(), "{what}");
                        assert_eq!(f.m[k].bits(), s.m[k].bits());
                        assert_eq!(f.v[k].bits(), s.v[k].bits());
                        assert_eq!(f.x[k].bits(), s.x[k].bits());
                    }
                    assert_eq!(f.w, s.w);
                }
            }
        });
    }
}

#[test]
fn clip_norm_is_grad_stats_norm() {
    let mut rng = Rng(3);
    let tr = (DType::BF16, DType::BF16, DType::F32);
    let mut s = State::new(&mut rng, &[1000, 4097, 3], tr, false, true, 1);
    let o = AdamWOptions {
        flags: ADAMW_CLIP,
        max_grad_norm: 0.01,
        ..AdamWOptions::new(1e-3)
    };
    let g: Vec<_> = s.g.iter().map(|t| t.view()).collect();
    let exec = Exec::cpu();
    let mut ws = vec![0u8; grad_stats_workspace_size(&exec, &g).unwrap()];
    let norm = grad_stats(&exec, &g, &mut ws).unwrap().norm();
    let r = s.run(&exec, &o).unwrap();
    assert_eq!(r.grad_norm.to_bits(), norm.to_bits());
    assert_eq!(r.stepped, 1);
}

#[test]
fn nonfinite_norm_and_found_inf_skip_the_step() {
    let mut rng = Rng(5);
    let tr = (DType::BF16, DType::BF16, DType::F32);
    for (bad, flags, found) in [
        (f64::NAN, ADAMW_CLIP, 0.0),
        (f64::INFINITY, ADAMW_CLIP, 0.0),
        (0.5, ADAMW_FOUND_INF, 1.0),
    ] {
        let mut s = State::new(&mut rng, &[100, 17], tr, false, true, 2);
        let mut gv = s.g[1].f64s();
        gv[3] = bad;
        s.g[1] = Owned::from_f64(DType::BF16, &gv);
        let o = AdamWOptions {
            flags,
            found_inf: found,
            max_grad_norm: 1.0,
            ..AdamWOptions::new(1e-3)
        };
        let before = s.clone();
        let r = s.run(&Exec::cpu(), &o).unwrap();
        assert_eq!(r.stepped, 0);
        assert_eq!(before, s);
        if flags & ADAMW_CLIP != 0 {
            assert!(!r.grad_norm.is_finite());
        }
    }
    // Finite gradients whose norm is past f32's range (16 of 1e38: 4e38):
    // the norm reads inf in f32, and the step is skipped as for inf.
    let f32s = (DType::F32, DType::F32, DType::F32);
    let mut s = State::new(&mut rng, &[40], f32s, false, false, 2);
    let mut gv = s.g[0].f64s();
    for v in &mut gv[..16] {
        *v = 1e38;
    }
    s.g[0] = Owned::from_f64(DType::F32, &gv);
    let o = AdamWOptions {
        flags: ADAMW_CLIP,
        max_grad_norm: 1.0,
        ..AdamWOptions::new(1e-3)
    };
    let before = s.clone();
    let r = s.run(&Exec::cpu(), &o).unwrap();
    assert!(r.grad_norm.is_finite() && (r.grad_norm as f32).is_infinite());
    assert_eq!(r.stepped, 0);
    assert_eq!(before, s);
}

#[test]
fn a_nonfinite_param_leaves_its_decoupled_moments_finite() {
    // torch's AdamW decays p and never adds it to g: an infinite or NaN
    // param keeps the moments a finite one gets (the kernel once formed
    // g + p * 0: NaN).
    let mut rng = Rng(9);
    let f32s = (DType::F32, DType::F32, DType::F32);
    for bad in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
        for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
            let finite = State::new(&mut rng, &[40], f32s, false, false, 3);
            let mut s = finite.clone();
            let mut pv = s.p[0].f64s();
            pv[21] = bad;
            s.p[0] = Owned::from_f64(DType::F32, &pv);
            let mut o = options(&mut rng, 3, 0);
            o.weight_decay = 0.1;
            let cpu = Cpu::new(Threads::new(1)).with_isa(isa);
            let exec = Exec::new(&cpu);
            let mut want = finite;
            want.run(&exec, &o).unwrap();
            s.run(&exec, &o).unwrap();
            // Every moment as with a finite param: bit for bit.
            assert_eq!(s.m[0].bits(), want.m[0].bits(), "{isa:?} {bad}");
            assert_eq!(s.v[0].bits(), want.v[0].bits(), "{isa:?} {bad}");
            let p = s.p[0].f64s()[21];
            assert_eq!(p.is_nan(), bad.is_nan(), "{isa:?} {bad}: {p}");
            if !bad.is_nan() {
                assert_eq!(p, bad, "{isa:?}");
            }
        }
    }
}

#[test]
fn ten_steps_track_f64_adamw() {
    // bf16 params with f32 masters vs f64 AdamW carried in f64: the masters
    // stay within a few f32 ulp per step of the f64 trajectory.
    let mut rng = Rng(9);
    let n = 5000;
    let tr = (DType::BF16, DType::BF16, DType::F32);
    let mut s = State::new(&mut rng, &[n], tr, false, true, 1);
    let mut p: Vec<f64> = s.w[0].f64s();
    let (mut m, mut v) = (vec![0.0f64; n], vec![0.0f64; n]);
    let mut o = AdamWOptions::new(1e-3);
    for step in 1..=10u64 {
        let gv: Vec<f64> = (0..n).map(|_| rng.mag() * 1e-3).collect();
        s.g[0] = Owned::from_f64(DType::BF16, &gv);
        let g = s.g[0].f64s();
        o.step = step;
        s.run(&Exec::cpu(), &o).unwrap();
        let bc1 = 1.0 - 0.9f64.powi(step as i32);
        let bc2s = (1.0 - 0.999f64.powi(step as i32)).sqrt();
        for i in 0..n {
            p[i] *= 1.0 - 1e-3 * 0.01;
            m[i] = m[i] * 0.9 + g[i] * 0.1;
            v[i] = v[i] * 0.999 + g[i] * g[i] * (1.0 - 0.999);
            p[i] -= 1e-3 / bc1 * m[i] / (v[i].sqrt() / bc2s + 1e-8);
        }
    }
    let w = s.w[0].f64s();
    let worst = (0..n)
        .map(|i| (w[i] - p[i]).abs() / (ulp_at::<f32>(p[i]) + 2f64.powi(-24) * 1e-3))
        .fold(0.0, f64::max);
    println!("10 steps: worst master error {worst:.2} f32 ulp (+ 2^-24 lr)");
    assert!(worst < 20.0, "{worst}");
}

fn err_of(s: &mut State, o: &AdamWOptions) -> Error {
    let before = s.clone();
    let e = s.run(&Exec::cpu(), o).unwrap_err();
    assert_eq!(&before, s, "a refused call changed something");
    e
}

fn arg(e: &Error) -> &'static str {
    match *e {
        Error::InvalidParam { arg, .. } | Error::DtypeUnsupported { arg, .. } => arg,
        Error::SizeOverflow { arg } | Error::NullPointer { arg } => arg,
        _ => "",
    }
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let mut rng = Rng(13);
    let tr = (DType::BF16, DType::BF16, DType::F32);
    let base = State::new(&mut rng, &[40, 17], tr, true, true, 2);
    let ok = AdamWOptions {
        flags: ADAMW_AMSGRAD,
        ..AdamWOptions::new(1e-3)
    };
    // Options.
    for (name, o) in [
        ("lr", AdamWOptions { lr: f64::NAN, ..ok }),
        ("lr", AdamWOptions { lr: -1.0, ..ok }),
        ("beta1", AdamWOptions { beta1: 1.0, ..ok }),
        ("beta2", AdamWOptions { beta2: -0.1, ..ok }),
        (
            "eps",
            AdamWOptions {
                eps: f64::INFINITY,
                ..ok
            },
        ),
        (
            "weight_decay",
            AdamWOptions {
                weight_decay: -0.1,
                ..ok
            },
        ),
        ("step", AdamWOptions { step: 0, ..ok }),
        (
            "max_grad_norm",
            AdamWOptions {
                flags: ADAMW_AMSGRAD | ADAMW_CLIP,
                max_grad_norm: -1.0,
                ..ok
            },
        ),
        (
            "flags",
            AdamWOptions {
                flags: 1 << 20,
                ..ok
            },
        ),
        ("max_exp_avg_sqs", AdamWOptions { flags: 0, ..ok }),
    ]
    .into_iter()
    .chain([0.0f32, -2.0, f32::NAN, f32::INFINITY].map(|g| {
        (
            "grad_scale",
            AdamWOptions {
                flags: ADAMW_AMSGRAD | ADAMW_GRAD_SCALE,
                grad_scale: g,
                ..ok
            },
        )
    })) {
        let e = err_of(&mut base.clone(), &o);
        assert_eq!(arg(&e), name, "{e:?}");
    }
    // Lists.
    let mut s = base.clone();
    s.g.pop();
    assert_eq!(arg(&err_of(&mut s, &ok)), "grads");
    let mut s = base.clone();
    s.v[1] = Owned::F32(vec![0.0; 16]);
    assert_eq!(arg(&err_of(&mut s, &ok)), "exp_avg_sqs");
    let mut s = base.clone();
    s.g[1] = Owned::F32(vec![0.0; 17]);
    assert_eq!(arg(&err_of(&mut s, &ok)), "grads");
    let mut s = base.clone();
    s.m =
        s.m.iter()
            .map(|t| Owned::from_f64(DType::F16, &t.f64s()))
            .collect();
    s.v =
        s.v.iter()
            .map(|t| Owned::from_f64(DType::F16, &t.f64s()))
            .collect();
    s.x =
        s.x.iter()
            .map(|t| Owned::from_f64(DType::F16, &t.f64s()))
            .collect();
    assert_eq!(arg(&err_of(&mut s, &ok)), "exp_avgs");
    let mut s = base.clone();
    s.w[0] = Owned::BF16(vec![bf16::ZERO; 40]);
    s.w[1] = Owned::BF16(vec![bf16::ZERO; 17]);
    assert_eq!(arg(&err_of(&mut s, &ok)), "masters");
    let mut s = base.clone();
    s.w.pop();
    assert_eq!(arg(&err_of(&mut s, &ok)), "masters");
    // Workspace too small.
    let mut s = base.clone();
    let before = s.clone();
    s.with(|t| {
        let n = adamw_workspace_size(&Exec::cpu(), t, &ok).unwrap();
        let mut ws = vec![0u8; n - 1];
        let e = adamw(&Exec::cpu(), t, &ok, &mut ws).unwrap_err();
        assert!(matches!(e, Error::WorkspaceTooSmall { .. }), "{e:?}");
    });
    assert_eq!(before, s);
}

#[test]
fn empty_lists_and_empty_tensors() {
    let mut rng = Rng(17);
    let tr = (DType::F32, DType::F32, DType::F32);
    let mut s = State::new(&mut rng, &[], tr, false, false, 1);
    let o = AdamWOptions {
        flags: ADAMW_CLIP,
        max_grad_norm: 1.0,
        ..AdamWOptions::new(1e-3)
    };
    let r = s.run(&Exec::cpu(), &o).unwrap();
    assert_eq!((r.grad_norm, r.stepped), (0.0, 1));
    let mut s = State::new(&mut rng, &[0, 5, 0], tr, false, false, 1);
    let before = s.clone();
    let r = s.run(&Exec::cpu(), &o).unwrap();
    assert!(check(&before, &s, &o, &r) <= 1.0);
}

/// Gradients whose factors are all 1 (no AMP scale, no clipping, minimizing)
/// skip the three products in full groups; a tensor's tail (< 16 elements)
/// still takes them. The same inputs through both must give the same bits,
/// subnormal, signed-zero, infinite and NaN gradients (payloads included)
/// among them.
#[test]
fn unit_gradient_factors_keep_the_bits_of_their_products() {
    let specials: [u32; 16] = [
        0x0000_6c2d, // subnormal
        0x7f80_0001, // signaling NaN
        0x7fc0_1234, // quiet NaN with a payload
        0xff80_0005, // negative signaling NaN
        0x7f80_0000, // inf
        0xff80_0000, // -inf
        0x0000_0000,
        0x8000_0000,
        0x0020_0000, // subnormal
        0x3fc0_0000,
        0xbb23_d70a,
        0x1f07_9b6e,
        0x7149_f2ca,
        0x80d9_a1b0,
        0x3e80_0000,
        0x0000_0001, // the smallest subnormal
    ];
    let mut rng = Rng(21);
    let g16: Vec<f32> = specials.iter().map(|&b| f32::from_bits(b)).collect();
    let rand = |rng: &mut Rng, lo: f64, hi: f64| -> Vec<f32> {
        (0..16).map(|_| rng.uniform(lo, hi) as f32).collect()
    };
    let (p, m, v) = (
        rand(&mut rng, -1.0, 1.0),
        rand(&mut rng, -1e-2, 1e-2),
        rand(&mut rng, 0.0, 1e-4),
    );
    let two = |x: &[f32]| vec![Owned::F32(x.to_vec()), Owned::F32(x[..15].to_vec())];
    for master in [false, true] {
        let base = State {
            p: if master {
                let b: Vec<bf16> = p.iter().map(|&x| bf16::from_f32(x)).collect();
                vec![Owned::BF16(b.clone()), Owned::BF16(b[..15].to_vec())]
            } else {
                two(&p)
            },
            g: two(&g16),
            m: two(&m),
            v: two(&v),
            x: vec![],
            w: if master { two(&p) } else { vec![] },
        };
        for flags in [0, ADAMW_L2, ADAMW_CLIP] {
            let mut base = base.clone();
            if flags == ADAMW_CLIP {
                // A non-finite norm skips the step: finite gradients here.
                let g: Vec<f32> = g16
                    .iter()
                    .map(|x| if x.is_finite() { *x } else { 0.5 })
                    .collect();
                base.g = two(&g);
            }
            let mut o = AdamWOptions::new(1e-3);
            o.step = 5;
            o.weight_decay = 0.1;
            o.flags = flags;
            // A norm below the bound: the clip's coefficient is 1.
            o.max_grad_norm = f64::INFINITY;
            for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
                let cpu = Cpu::new(Threads::new(1)).with_isa(isa);
                let mut s = base.clone();
                let r = s.run(&Exec::new(&cpu), &o).unwrap();
                assert_eq!(r.stepped, 1);
                for t in [&s.p, &s.m, &s.v, &s.w] {
                    if let [full, tail] = &t[..] {
                        assert_eq!(
                            full.bits()[..15],
                            tail.bits()[..],
                            "{isa:?} master {master} flags {flags}"
                        );
                    }
                }
            }
        }
    }
}
