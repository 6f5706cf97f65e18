//! `adamw_with_scales` with the compact state formats: split masters,
//! stochastically rounded bf16 moments or params, 8-bit moments (codes and
//! block scales, amsgrad's maxima too), with arbitrary tensor lengths
//! (partial quantization blocks, empty tensors, row lengths that cut
//! short blocks, now and then one that does not divide), any values (NaN, Inf,
//! subnormals), any option flags (clip, grad scale, maximize, L2) and
//! formats the validation refuses.
//!
//! Checked:
//! - an error, or a skipped step, changes no byte of any tensor;
//! - a step is bit-identical (NaN payloads aside) on every ISA, one and two
//!   threads, and several block cuts, over two steps;
//! - on tame values, params (and split masters) are within a bf16 step plus
//!   the update's size of the f64 reference (`Exec::reference()`), which
//!   quantizes alike but decides its own stochastic roundings in f64.
//!
//! Run: `cargo +nightly fuzz run adamw_formats`, or
//! `scripts/fuzz_smoke.sh adamw_formats`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{dims, isas, some_values, Bytes};

/// Most elements of one tensor.
const CAP: usize = 1100;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Moments {
    F32,
    Bf16,
    Q8,
}

/// One state: bf16 params and grads, moments as `Moments` says.
#[derive(Clone, PartialEq, Debug)]
struct State {
    p: Vec<Vec<bf16>>,
    g: Vec<Vec<bf16>>,
    mf: Vec<[Vec<f32>; 3]>,
    mb: Vec<[Vec<bf16>; 3]>,
    mq: Vec<[Vec<u8>; 3]>,
    sc: Vec<[Vec<f32>; 3]>,
    low: Vec<Vec<i16>>,
    w: Vec<Vec<f32>>,
    /// 8-bit moments' row lengths (`q8_rows`; empty: none given).
    rows: Vec<u64>,
}

/// The call's choices.
struct Case {
    moments: Moments,
    ams: bool,
    formats: (bool, u32, u64),
    o: AdamWOptions,
}

fn bits(s: &State) -> Vec<u32> {
    let f = |x: f32| if x.is_nan() { 0x7fc0_0000 } else { x.to_bits() };
    let mut out = vec![];
    for t in &s.p {
        out.extend(t.iter().map(|x| f(x.to_f32())));
    }
    for t in s.mf.iter().chain(&s.sc) {
        out.extend(t.iter().flatten().map(|&x| f(x)));
    }
    for t in &s.mb {
        out.extend(t.iter().flatten().map(|x| f(x.to_f32())));
    }
    for t in &s.mq {
        out.extend(t.iter().flatten().map(|&x| x as u32));
    }
    out.extend(s.low.iter().flatten().map(|&x| x as u32));
    out.extend(s.w.iter().flatten().map(|&x| f(x)));
    out
}

fn state(b: &mut Bytes<'_>, moments: Moments, ams: bool, split: bool, master: bool) -> State {
    let tame = !b.one_in(4);
    let count = 1 + b.below(4);
    let mut s = State {
        p: vec![],
        g: vec![],
        mf: vec![],
        mb: vec![],
        mq: vec![],
        sc: vec![],
        low: vec![],
        w: vec![],
        rows: vec![],
    };
    // Row lengths for 8-bit moments now and then (a divisor of each
    // tensor, or its length; rarely one that does not divide, refused).
    let with_rows = moments == Moments::Q8 && b.bool();
    let xn = |n: usize| if ams { n } else { 0 };
    for _ in 0..count {
        let n = dims(b, 1, CAP)[0];
        let p: Vec<bf16> = some_values(b, n, tame);
        s.g.push(
            some_values::<f32>(b, n, tame)
                .iter()
                .map(|&x| bf16::from_f32(x * 1e-2))
                .collect(),
        );
        if split {
            s.low.push(vec![0; n]);
        } else if master {
            s.w.push(p.iter().map(|x| x.to_f32()).collect());
        }
        s.p.push(p);
        match moments {
            Moments::F32 => s.mf.push([vec![0.0; n], vec![0.0; n], vec![0.0; xn(n)]]),
            Moments::Bf16 => s.mb.push([
                vec![bf16::ZERO; n],
                vec![bf16::ZERO; n],
                vec![bf16::ZERO; xn(n)],
            ]),
            Moments::Q8 => {
                let mut row = 0;
                if with_rows {
                    let d = b.pick(&[0usize, 1, 2, 3, 7, 16, 100, 256, 300, n]);
                    row = if d != 0 && n % d == 0 { d } else { 0 };
                    if b.one_in(16) {
                        row = n + 1;
                    }
                    s.rows.push(row as u64);
                }
                let q = if Q8Grid::valid(n, row) {
                    Q8Grid::new(n, row).scales_len(n)
                } else {
                    q8_scales_len(n)
                };
                s.mq.push([vec![0; n], vec![0; n], vec![0; xn(n)]]);
                s.sc.push([vec![0.0; q], vec![0.0; q], vec![0.0; xn(q)]]);
            }
        }
    }
    s
}

fn run(s: &mut State, c: &Case, exec: &Exec<'_>) -> Result<AdamWReport> {
    let mut p: Vec<GradTensorMut<'_>> = s.p.iter_mut().map(|t| t.as_mut_slice().into()).collect();
    let g: Vec<GradTensor<'_>> = s.g.iter().map(|t| t[..].into()).collect();
    let mut lists: [Vec<GradTensorMut<'_>>; 3] = [vec![], vec![], vec![]];
    let mut scales: [Vec<GradTensorMut<'_>>; 3] = [vec![], vec![], vec![]];
    for t in s.mf.iter_mut() {
        for (l, x) in lists.iter_mut().zip(t.iter_mut()) {
            l.push(x.as_mut_slice().into());
        }
    }
    for t in s.mb.iter_mut() {
        for (l, x) in lists.iter_mut().zip(t.iter_mut()) {
            l.push(x.as_mut_slice().into());
        }
    }
    for t in s.mq.iter_mut() {
        for (l, x) in lists.iter_mut().zip(t.iter_mut()) {
            l.push(x.as_mut_slice().into());
        }
    }
    for t in s.sc.iter_mut() {
        for (l, x) in scales.iter_mut().zip(t.iter_mut()) {
            l.push(x.as_mut_slice().into());
        }
    }
    if !c.ams {
        lists[2].clear();
        scales[2].clear();
    }
    let mut w: Vec<GradTensorMut<'_>> = if s.low.is_empty() {
        s.w.iter_mut().map(|t| t.as_mut_slice().into()).collect()
    } else {
        s.low.iter_mut().map(|t| t.as_mut_slice().into()).collect()
    };
    let [m, v, x] = &mut lists;
    let [sm, sv, sx] = &mut scales;
    let mut t = AdamWTensors {
        params: &mut p,
        grads: &g,
        exp_avgs: m,
        exp_avg_sqs: v,
        max_exp_avg_sqs: x,
        masters: &mut w,
    };
    let mut sc = AdamWScales {
        exp_avgs: sm,
        exp_avg_sqs: sv,
        max_exp_avg_sqs: sx,
    };
    let f = AdamWFormats {
        split_masters: c.formats.0,
        rounding: c.formats.1,
        quantized_moments: c.moments == Moments::Q8,
        seed: c.formats.2,
        keys: &[],
        q8_rows: &s.rows,
    };
    let n = adamw_with_scales_workspace_size(exec, &mut t, &mut sc, &c.o, &f)?;
    let mut ws = vec![0u8; n];
    adamw_with_scales(exec, &mut t, &mut sc, &c.o, &f, &mut ws)
}

fn go(b: &mut Bytes<'_>) {
    let moments = b.pick(&[Moments::F32, Moments::Bf16, Moments::Q8, Moments::Q8]);
    let split = b.bool();
    // Mostly the valid pairings; now and then one the validation refuses.
    let mut rounding = match moments {
        Moments::Bf16 => ADAMW_SR_MOMENTS,
        _ => 0,
    } | if split || b.bool() { 0 } else { ADAMW_SR_PARAMS };
    if b.one_in(16) {
        rounding = b.below(8) as u32;
    }
    let master = !split && rounding & ADAMW_SR_PARAMS == 0 && b.bool();
    let ams = b.one_in(3);
    let mut flags = if ams { ADAMW_AMSGRAD } else { 0 };
    for f in [ADAMW_CLIP, ADAMW_MAXIMIZE, ADAMW_L2, ADAMW_GRAD_SCALE] {
        if b.one_in(3) {
            flags |= f;
        }
    }
    let o = AdamWOptions {
        lr: b.pick(&[0.0, 1e-3, 1e-2, 0.3]),
        weight_decay: b.pick(&[0.0, 0.01, 0.1]),
        max_grad_norm: b.pick(&[1e-3, 1.0, 1e30]),
        grad_scale: b.pick(&[1.0, 65536.0, 0.5, 3.0, 1e-30]),
        step: 1 + b.below(1000) as u64,
        flags,
        ..AdamWOptions::new(1e-3)
    };
    let c = Case {
        moments,
        ams,
        formats: (split, rounding, b.u64()),
        o,
    };
    let base = state(b, moments, ams, split, master);
    let tame = base
        .p
        .iter()
        .flatten()
        .chain(base.g.iter().flatten())
        .all(|x| x.to_f32().is_finite());

    let mut first: Option<(Result<AdamWReport>, State)> = None;
    for isa in isas() {
        for (threads, blocks) in [(1usize, 1u32), (2, 3), (1, 64)] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let exec = Exec::new(&cpu).with_ub(UbConfig {
                blocks,
                ..UbConfig::default()
            });
            let mut s = base.clone();
            let r1 = run(&mut s, &c, &exec);
            match &r1 {
                Err(_) => assert!(bits(&s) == bits(&base), "an error wrote"),
                Ok(r) if r.stepped == 0 => assert!(bits(&s) == bits(&base), "a skip wrote"),
                Ok(_) => {}
            }
            if r1.is_ok() {
                let mut c2 = Case { ..c };
                c2.o.step += 1;
                run(&mut s, &c2, &exec).unwrap();
            }
            match &first {
                None => first = Some((r1, s)),
                Some((r0, s0)) => {
                    assert_eq!(r0.is_ok(), r1.is_ok(), "{isa:?}");
                    assert!(bits(s0) == bits(&s), "{isa:?} {threads} threads {blocks} blocks");
                }
            }
        }
    }

    // Against the f64 reference on one step of tame values.
    let Some((Ok(r), _)) = &first else { return };
    if !tame || r.stepped == 0 {
        return;
    }
    let (mut got, mut want) = (base.clone(), base.clone());
    run(&mut got, &c, &Exec::cpu()).unwrap();
    run(&mut want, &c, &Exec::reference()).unwrap();
    let lr = c.o.lr;
    for (a, b) in got.p.iter().flatten().zip(want.p.iter().flatten()) {
        let (x, y) = (a.to_f64(), b.to_f64());
        if !(x.is_finite() && y.is_finite()) {
            continue;
        }
        // Two bf16 steps and a few updates' size (stochastic roundings
        // decided apart, codes one step apart, the decay).
        let tol = y.abs() * 2f64.powi(-6) + 4.0 * lr * (1.0 + y.abs()) + 1e-30;
        assert!((x - y).abs() <= tol, "param {x:e} vs reference {y:e}");
    }
}

fuzz_target!(|data: &[u8]| go(&mut Bytes(data)));
