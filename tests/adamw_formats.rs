//! AdamW's compact state (`adamw_with_formats`): split masters against f32
//! masters bit for bit over 1 000 steps; stochastically rounded bf16
//! moments and params the same bits on every ISA, thread count, block cut
//! and shard cut, unbiased, and within one bf16 step of the float64 model
//! of the same rounding (identical but where f32 arithmetic moved a value
//! across the random threshold); bad formats refused with nothing written.

mod common;

use common::Rng;
use half::bf16;
use npukern::*;

/// bf16 params with grads, moments of `md`, optional maxima, and masters
/// as `Masters` says.
#[derive(Clone, Debug, PartialEq)]
struct St {
    p: Vec<Vec<bf16>>,
    g: Vec<Vec<bf16>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    mb: Vec<Vec<bf16>>,
    vb: Vec<Vec<bf16>>,
    x: Vec<Vec<bf16>>,
    w: Vec<Vec<f32>>,
    low: Vec<Vec<i16>>,
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Masters {
    None,
    F32,
    Split,
}

impl St {
    fn new(rng: &mut Rng, lens: &[usize], masters: Masters, bf16_moments: bool, ams: bool) -> St {
        let mut s = St {
            p: vec![],
            g: vec![],
            m: vec![],
            v: vec![],
            mb: vec![],
            vb: vec![],
            x: vec![],
            w: vec![],
            low: vec![],
        };
        for &n in lens {
            let w: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
            s.p.push(w.iter().map(|&x| bf16::from_f32(x)).collect());
            match masters {
                Masters::F32 => s.w.push(w.clone()),
                Masters::Split => s.low.push(vec![0; n]),
                Masters::None => {}
            }
            if bf16_moments {
                s.mb.push(vec![bf16::ZERO; n]);
                s.vb.push(vec![bf16::ZERO; n]);
                if ams {
                    s.x.push(vec![bf16::ZERO; n]);
                }
            } else {
                s.m.push(vec![0.0; n]);
                s.v.push(vec![0.0; n]);
            }
            s.g.push(vec![bf16::ZERO; n]);
        }
        // Split masters start as their params (low halves 0).
        s
    }

    fn new_grads(&mut self, rng: &mut Rng) {
        for g in &mut self.g {
            for x in g.iter_mut() {
                *x = bf16::from_f64(rng.mag() * 1e-3);
            }
        }
    }

    fn run(
        &mut self,
        exec: &Exec<'_>,
        o: &AdamWOptions,
        f: &AdamWFormats<'_>,
    ) -> Result<AdamWReport> {
        let mut p: Vec<GradTensorMut<'_>> =
            self.p.iter_mut().map(|t| t.as_mut_slice().into()).collect();
        let g: Vec<GradTensor<'_>> = self.g.iter().map(|t| t[..].into()).collect();
        let (mut m, mut v): (Vec<GradTensorMut<'_>>, Vec<GradTensorMut<'_>>) = if self.m.is_empty()
        {
            (
                self.mb
                    .iter_mut()
                    .map(|t| t.as_mut_slice().into())
                    .collect(),
                self.vb
                    .iter_mut()
                    .map(|t| t.as_mut_slice().into())
                    .collect(),
            )
        } else {
            (
                self.m.iter_mut().map(|t| t.as_mut_slice().into()).collect(),
                self.v.iter_mut().map(|t| t.as_mut_slice().into()).collect(),
            )
        };
        let mut x: Vec<GradTensorMut<'_>> =
            self.x.iter_mut().map(|t| t.as_mut_slice().into()).collect();
        let mut w: Vec<GradTensorMut<'_>> = if self.low.is_empty() {
            self.w.iter_mut().map(|t| t.as_mut_slice().into()).collect()
        } else {
            self.low
                .iter_mut()
                .map(|t| t.as_mut_slice().into())
                .collect()
        };
        let mut t = AdamWTensors {
            params: &mut p,
            grads: &g,
            exp_avgs: &mut m,
            exp_avg_sqs: &mut v,
            max_exp_avg_sqs: &mut x,
            masters: &mut w,
        };
        let n = adamw_with_formats_workspace_size(exec, &mut t, o, f)?;
        let mut ws = vec![0u8; n];
        adamw_with_formats(exec, &mut t, o, f, &mut ws)
    }
}

fn split_f(s: bool, rounding: u32, seed: u64) -> AdamWFormats<'static> {
    AdamWFormats {
        split_masters: s,
        rounding,
        seed,
        ..Default::default()
    }
}

fn opts(step: u64, flags: u32) -> AdamWOptions {
    AdamWOptions {
        lr: 1e-3,
        weight_decay: 0.1,
        step,
        flags,
        max_grad_norm: 1.0,
        ..AdamWOptions::new(1e-3)
    }
}

#[test]
fn split_masters_are_f32_masters_bit_for_bit_over_1000_steps() {
    let exec = Exec::cpu();
    let lens = [1000, 37, 16, 1];
    for flags in [0, ADAMW_CLIP, ADAMW_L2 | ADAMW_MAXIMIZE] {
        let mut rng = Rng(5);
        let mut a = St::new(&mut rng, &lens, Masters::F32, false, false);
        // The same masters: f32 ones that are bf16 values (a split master's
        // start, low halves 0).
        for (w, p) in a.w.iter_mut().zip(&a.p) {
            *w = p.iter().map(|x| x.to_f32()).collect();
        }
        let mut rng = Rng(5);
        let mut b = St::new(&mut rng, &lens, Masters::Split, false, false);
        assert_eq!(a.p, b.p);
        let (mut ties, mut grng) = (0usize, Rng(77));
        for step in 1..=1000u64 {
            a.new_grads(&mut grng);
            b.g = a.g.clone();
            let o = opts(step, flags);
            a.run(&exec, &o, &AdamWFormats::default()).unwrap();
            b.run(&exec, &o, &split_f(true, 0, 0)).unwrap();
            assert_eq!(a.m, b.m, "step {step}");
            assert_eq!(a.v, b.v, "step {step}");
            for (t, &len) in lens.iter().enumerate() {
                for i in 0..len {
                    let want = a.w[t][i];
                    let hi = b.p[t][i].to_bits();
                    let got = join(hi, b.low[t][i]);
                    assert_eq!(got.to_bits(), want.to_bits(), "step {step} [{t}][{i}]");
                    if a.p[t][i].to_bits() != hi {
                        // Only a master exactly halfway rounds otherwise (away
                        // from zero, not to even).
                        assert_eq!(want.to_bits() & 0xffff, 0x8000, "step {step}");
                        ties += 1;
                    }
                }
            }
        }
        println!("flags {flags:#x}: params differing from f32 masters' (exact ties): {ties}");
    }
}

/// The f32 master of a split pair, as the module documents it.
fn join(hi: u16, lo: i16) -> f32 {
    f32::from_bits(((hi as u32) << 16).wrapping_add(lo as i32 as u32))
}

#[test]
fn stochastic_rounding_is_the_same_on_every_isa_thread_count_and_block_cut() {
    let mut rng = Rng(9);
    let lens = [100_003, 5, 64, 31];
    for (masters, rounding, ams) in [
        (Masters::Split, ADAMW_SR_MOMENTS, true),
        (Masters::None, ADAMW_SR_MOMENTS | ADAMW_SR_PARAMS, false),
        (Masters::F32, ADAMW_SR_MOMENTS, false),
    ] {
        let mut base = St::new(&mut rng, &lens, masters, true, ams);
        base.new_grads(&mut rng);
        let flags = ADAMW_CLIP | if ams { ADAMW_AMSGRAD } else { 0 };
        let mut first: Option<St> = None;
        common::for_every_exec(&[1, 7, 64], |exec, what| {
            let mut s = base.clone();
            for step in 1..=3 {
                s.run(
                    exec,
                    &opts(step, flags),
                    &split_f(masters == Masters::Split, rounding, 42),
                )
                .unwrap();
            }
            match &first {
                None => first = Some(s),
                Some(f) => assert_eq!(f, &s, "{what}"),
            }
        });
        // Another seed rounds otherwise.
        let mut s = base.clone();
        for step in 1..=3 {
            s.run(
                &Exec::cpu(),
                &opts(step, flags),
                &split_f(masters == Masters::Split, rounding, 43),
            )
            .unwrap();
        }
        assert_ne!(first.unwrap().vb, s.vb);
    }
}

#[test]
fn a_tensor_cut_into_shards_with_their_keys_rounds_as_the_whole() {
    // FSDP's shards: a tensor of 1000 elements as one, and as two tensors of
    // 400 and 600 whose keys are their offsets in the whole.
    let mut rng = Rng(21);
    let mut whole = St::new(&mut rng, &[1000], Masters::None, true, false);
    whole.new_grads(&mut rng);
    let f = AdamWFormats {
        rounding: ADAMW_SR_MOMENTS | ADAMW_SR_PARAMS,
        seed: 3,
        keys: &[5000],
        ..Default::default()
    };
    let cut = |v: &Vec<bf16>| vec![v[..400].to_vec(), v[400..].to_vec()];
    let mut shards = St {
        p: cut(&whole.p[0]),
        g: cut(&whole.g[0]),
        mb: cut(&whole.mb[0]),
        vb: cut(&whole.vb[0]),
        ..St::new(&mut rng, &[], Masters::None, true, false)
    };
    let fs = AdamWFormats {
        keys: &[5000, 5400],
        ..f
    };
    for step in 1..=4 {
        whole.run(&Exec::cpu(), &opts(step, 0), &f).unwrap();
        shards.run(&Exec::cpu(), &opts(step, 0), &fs).unwrap();
    }
    assert_eq!([&shards.p[0][..], &shards.p[1][..]].concat(), whole.p[0]);
    assert_eq!([&shards.mb[0][..], &shards.mb[1][..]].concat(), whole.mb[0]);
    assert_eq!([&shards.vb[0][..], &shards.vb[1][..]].concat(), whole.vb[0]);
}

#[test]
fn stochastic_rounding_matches_the_f64_model_of_the_same_rounding() {
    let mut rng = Rng(31);
    let lens = [4096, 333, 17];
    let (mut differ, mut cancelled, mut total) = (0usize, 0usize, 0usize);
    for (masters, rounding) in [
        (Masters::Split, ADAMW_SR_MOMENTS),
        (Masters::None, ADAMW_SR_MOMENTS | ADAMW_SR_PARAMS),
    ] {
        let mut base = St::new(&mut rng, &lens, masters, true, true);
        for step in 1..=5 {
            base.new_grads(&mut rng);
            let o = opts(step, ADAMW_AMSGRAD);
            let f = split_f(masters == Masters::Split, rounding, 11);
            let mut got = base.clone();
            got.run(&Exec::cpu(), &o, &f).unwrap();
            let mut want = base.clone();
            want.run(&common::reference(), &o, &f).unwrap();
            for (a, b) in [
                (&got.mb, &want.mb),
                (&got.vb, &want.vb),
                (&got.x, &want.x),
                (&got.p, &want.p),
            ] {
                for (ta, tb) in a.iter().zip(b) {
                    // One bf16 step of the larger, beside f32's error under
                    // cancellation (m's two terms nearly equal and opposite).
                    let scale = tb.iter().map(|y| y.to_f64().abs()).fold(0.0, f64::max);
                    for (x, y) in ta.iter().zip(tb) {
                        let (xf, yf) = (x.to_f64(), y.to_f64());
                        let big = xf.abs().max(yf.abs());
                        let bf_step =
                            f64::from(bf16::from_bits(bf16::from_f64(big).to_bits() + 1).to_f32())
                                - f64::from(bf16::from_f64(big).to_f32());
                        let off = (xf - yf).abs();
                        assert!(off <= bf_step + scale * 2f64.powi(-22), "{xf} vs {yf}");
                        if x.to_bits() != y.to_bits() {
                            differ += 1;
                            cancelled += (off > bf_step) as usize;
                        }
                        total += 1;
                    }
                }
            }
            base = got;
        }
    }
    println!(
        "stochastic rounding vs the f64 model: {differ} of {total} differ ({cancelled} by f32's error under \
         cancellation, the rest by one bf16 step)"
    );
    assert!(differ * 100 < total, "{differ} of {total}");
}

#[test]
fn stochastically_rounded_params_follow_updates_below_bf16s_step() {
    // An update of 0.1 of a bf16 step, 200 times: round to nearest never
    // moves the param; stochastic rounding moves it by 20 steps on average.
    let n = 4096;
    let mut p_sr = vec![bf16::from_f32(1.0); n];
    let mut p_rne = p_sr.clone();
    let step = 2f32.powi(-7);
    for (k, p) in [(true, &mut p_sr), (false, &mut p_rne)] {
        // f32 moments: m / sqrt(v) is 1 to f32's precision every step.
        let mut m = vec![0f32; n];
        let mut v = vec![0f32; n];
        for t in 1..=200u64 {
            // maximize with a gradient that makes m / sqrt(v) = 1: the
            // update is lr (bias-corrected Adam's first steps are exact).
            let g = vec![bf16::from_f32(1.0); n];
            let mut pl: Vec<GradTensorMut<'_>> = vec![p.as_mut_slice().into()];
            let gl: Vec<GradTensor<'_>> = vec![g[..].into()];
            let mut ml: Vec<GradTensorMut<'_>> = vec![m.as_mut_slice().into()];
            let mut vl: Vec<GradTensorMut<'_>> = vec![v.as_mut_slice().into()];
            let mut t_ = AdamWTensors {
                params: &mut pl,
                grads: &gl,
                exp_avgs: &mut ml,
                exp_avg_sqs: &mut vl,
                max_exp_avg_sqs: &mut [],
                masters: &mut [],
            };
            let o = AdamWOptions {
                lr: (step * 0.1) as f64,
                weight_decay: 0.0,
                eps: 0.0,
                step: t,
                flags: ADAMW_MAXIMIZE,
                ..AdamWOptions::new(1e-3)
            };
            let f = if k {
                split_f(false, ADAMW_SR_PARAMS, 1)
            } else {
                AdamWFormats::default()
            };
            let ws_n = adamw_with_formats_workspace_size(&Exec::cpu(), &mut t_, &o, &f).unwrap();
            let mut ws = vec![0u8; ws_n];
            adamw_with_formats(&Exec::cpu(), &mut t_, &o, &f, &mut ws).unwrap();
        }
    }
    assert!(p_rne.iter().all(|x| x.to_f32() == 1.0));
    let mean = p_sr.iter().map(|x| x.to_f64()).sum::<f64>() / n as f64;
    // 1 + 200 * 0.1 steps, but steps double past 2.0: within 10%.
    let want = 1.0 + 20.0 * step as f64;
    println!("mean param after 200 updates of 0.1 step: {mean} (want about {want})");
    assert!((mean - want).abs() < 2.0 * step as f64, "{mean} vs {want}");
}

#[test]
fn bad_formats_are_refused_and_change_nothing() {
    let mut rng = Rng(2);
    let base = {
        let mut s = St::new(&mut rng, &[40, 3], Masters::Split, true, false);
        s.new_grads(&mut rng);
        s
    };
    let o = opts(1, 0);
    let exec = Exec::cpu();
    let refused = |mut s: St, f: AdamWFormats<'_>, arg: &str| {
        let before = s.clone();
        let e = s.run(&exec, &o, &f).unwrap_err();
        assert!(format!("{e:?}").contains(arg), "{e:?} (want {arg})");
        assert_eq!(s, before, "{e:?}");
    };
    // One defect each.
    refused(base.clone(), split_f(false, ADAMW_SR_MOMENTS, 0), "masters"); // i16 masters without split
    refused(base.clone(), split_f(true, 4, 0), "formats"); // unknown rounding bit
    refused(
        base.clone(),
        split_f(true, ADAMW_SR_MOMENTS | ADAMW_SR_PARAMS, 0),
        "formats",
    );
    let keys = [0u64];
    refused(
        base.clone(),
        AdamWFormats {
            keys: &keys,
            ..split_f(true, ADAMW_SR_MOMENTS, 0)
        },
        "keys",
    );
    let keys = [u64::MAX - 10, 0];
    refused(
        base.clone(),
        AdamWFormats {
            keys: &keys,
            ..split_f(true, ADAMW_SR_MOMENTS, 0)
        },
        "keys",
    );
    let mut s = base.clone();
    s.low.pop();
    refused(s, split_f(true, ADAMW_SR_MOMENTS, 0), "masters");
    // f32 moments under stochastic rounding.
    let mut s = St::new(&mut rng, &[40], Masters::Split, false, false);
    s.new_grads(&mut rng);
    refused(s, split_f(true, ADAMW_SR_MOMENTS, 0), "exp_avgs");
    // The i16 list is no float list: gradient health refuses it.
    let mut low = vec![0i16; 8];
    let list: Vec<GradTensorMut<'_>> = vec![low.as_mut_slice().into()];
    let ro: Vec<GradTensor<'_>> = list.iter().map(|t| t.as_ref()).collect();
    assert!(grad_stats_workspace_size(&exec, &ro).is_err());
    low[0] = 1;
}
