//! AdamW over tensor lists: one step on the CPU kernels (3 blocks) against
//! the library's f64 reference (within one ulp of each output's dtype plus
//! 1e-5 of the list's largest value), the clip's norm against grad_stats'
//! to the bit, a NaN gradient skipping the step with nothing written; every
//! updated list and the report hashed. 8-bit moments (split masters, and
//! stochastically rounded params without masters): two steps against the
//! reference (params within a bf16 step, decoded moments within a code
//! step), codes, scales, params and low halves hashed.

use npukern::{bf16, f16};
use npukern::{q8_decode, q8_scales_len, AdamWFormats, AdamWScales, Q8_BLOCK};
use npukern::{AdamWOptions, AdamWReport, AdamWTensors, Float, GradTensor, GradTensorMut, Result};
use npukern::{ADAMW_AMSGRAD, ADAMW_CLIP, ADAMW_L2, ADAMW_MAXIMIZE, ADAMW_SR_PARAMS};

use crate::api;
use crate::data::{pow2, same_bits, ulp, Rng};
use crate::hash::BitHash;
use crate::{name, Checker};

/// The tensors' lengths: across the 3 blocks, a partial lane group, one
/// element.
const A: usize = 300;
const B: usize = 33;
const N: usize = A + B + 1;

/// The six lists, each tensor a piece of one flat array.
#[derive(Clone, Copy)]
struct State<P, G, M> {
    p: [P; N],
    g: [G; N],
    m: [M; N],
    v: [M; N],
    x: [M; N],
    w: [f32; N],
}

fn split<T>(a: &mut [T; N]) -> [&mut [T]; 3] {
    let (x, rest) = a.split_at_mut(A);
    let (y, z) = rest.split_at_mut(B);
    [x, y, z]
}

impl<P: Float, G: Float, M: Float> State<P, G, M>
where
    for<'a> &'a mut [P]: Into<GradTensorMut<'a>>,
    for<'a> &'a [G]: Into<GradTensor<'a>>,
    for<'a> &'a mut [M]: Into<GradTensorMut<'a>>,
{
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let mut f = |e: i64| rng.mag::<f32>() * pow2(e) as f32;
        let w: [f32; N] = core::array::from_fn(|_| f(-10));
        State {
            p: w.map(P::from_f32),
            g: core::array::from_fn(|_| G::from_f32(f(-16))),
            m: core::array::from_fn(|_| M::from_f32(f(-20))),
            v: core::array::from_fn(|_| M::from_f32(f(-30).abs())),
            x: core::array::from_fn(|_| M::from_f32(f(-30).abs())),
            w,
        }
    }

    fn grads(&self) -> [GradTensor<'_>; 3] {
        [&self.g[..A], &self.g[A..A + B], &self.g[A + B..]].map(Into::into)
    }

    fn step(&mut self, reference: bool, o: &AdamWOptions, masters: bool) -> Result<AdamWReport> {
        let ams = o.has(ADAMW_AMSGRAD);
        let gl = [&self.g[..A], &self.g[A..A + B], &self.g[A + B..]].map(Into::into);
        let mut p = split(&mut self.p).map(Into::into);
        let mut m = split(&mut self.m).map(Into::into);
        let mut v = split(&mut self.v).map(Into::into);
        let mut x = split(&mut self.x).map(Into::into);
        let mut w = split(&mut self.w).map(Into::into);
        let mut t = AdamWTensors {
            params: &mut p,
            grads: &gl,
            exp_avgs: &mut m,
            exp_avg_sqs: &mut v,
            max_exp_avg_sqs: if ams { &mut x } else { &mut [] },
            masters: if masters { &mut w } else { &mut [] },
        };
        api::adamw(reference, &mut t, o)
    }
}

fn within<T: Float>(c: &mut Checker<'_>, what: &str, got: &[T], want: &[T]) {
    let scale = want.iter().fold(0f64, |s, x| s.max(x.to_f64().abs()));
    c.within(what, got, want, |_, w| ulp(T::DTYPE, w) + 1e-5 * scale);
    c.hash(what, BitHash::of(got));
}

fn case<P: Float, G: Float, M: Float>(c: &mut Checker<'_>, seed: u64, flags: u32, masters: bool)
where
    for<'a> &'a mut [P]: Into<GradTensorMut<'a>>,
    for<'a> &'a [G]: Into<GradTensor<'a>>,
    for<'a> &'a mut [M]: Into<GradTensorMut<'a>>,
{
    let o = AdamWOptions {
        step: 7,
        max_grad_norm: 0.01, // below the grads' norm (about 0.05): clipped
        flags,
        ..AdamWOptions::new(1e-3)
    };
    let (p, g, m) = (P::DTYPE.name(), G::DTYPE.name(), M::DTYPE.name());
    let tag = name!(
        "{p}.{g}.{m}.{}{flags:#x}",
        if masters { "master." } else { "" }
    );
    let tag = tag.as_str();
    let s0 = State::<P, G, M>::new(seed);
    let (mut cpu, mut re) = (s0, s0);
    let (r, rr) = match (cpu.step(false, &o, masters), re.step(true, &o, masters)) {
        (Ok(r), Ok(rr)) => (r, rr),
        (a, b) => {
            c.check(
                name!("adamw.{tag}").as_str(),
                false,
                format_args!("{a:?} / {b:?}"),
            );
            return;
        }
    };
    within(c, name!("adamw.{tag}.params").as_str(), &cpu.p, &re.p);
    within(c, name!("adamw.{tag}.exp_avgs").as_str(), &cpu.m, &re.m);
    within(c, name!("adamw.{tag}.exp_avg_sqs").as_str(), &cpu.v, &re.v);
    if o.has(ADAMW_AMSGRAD) {
        within(
            c,
            name!("adamw.{tag}.max_exp_avg_sqs").as_str(),
            &cpu.x,
            &re.x,
        );
    }
    if masters {
        within(c, name!("adamw.{tag}.masters").as_str(), &cpu.w, &re.w);
    }
    c.check(
        name!("adamw.{tag}.grads_read_only").as_str(),
        same_bits(&cpu.g, &s0.g),
        format_args!("a gradient was written"),
    );
    if o.has(ADAMW_CLIP) {
        let norm = api::grad_stats(false, &s0.grads()).map(|s| s.norm());
        let ok = norm.is_ok_and(|n| n.to_bits() == r.grad_norm.to_bits())
            && (r.grad_norm - rr.grad_norm).abs() <= 1e-12 * rr.grad_norm
            && r.grad_norm > o.max_grad_norm;
        c.check(
            name!("adamw.{tag}.grad_norm").as_str(),
            ok,
            format_args!("{r:?}, reference {rr:?}, grad_stats {norm:?}"),
        );
        // A NaN gradient: the step is skipped, nothing written.
        let mut nan = s0;
        nan.g[A + 5] = G::from_f32(f32::NAN);
        let before = nan;
        let r = nan.step(false, &o, masters);
        let same = same_bits(&nan.p, &before.p)
            && same_bits(&nan.m, &before.m)
            && same_bits(&nan.v, &before.v)
            && same_bits(&nan.x, &before.x)
            && same_bits(&nan.w, &before.w);
        let skipped = matches!(r, Ok(AdamWReport { stepped: 0, grad_norm }) if grad_norm.is_nan());
        c.check(
            name!("adamw.{tag}.nan_skips").as_str(),
            same && skipped,
            format_args!("{r:?}, tensors untouched: {same}"),
        );
    }
    let mut h = BitHash::new();
    h.u64(r.grad_norm.to_bits()).u64(r.stepped as u64);
    c.hash(name!("adamw.{tag}.report").as_str(), h.0);
}

/// Scales per moment tensor of the q8 case.
const NQ: usize = q8_scales_len(A) + q8_scales_len(B) + q8_scales_len(1);

/// The 8-bit state: bf16 params and grads, u8 codes and f32 scales of
/// both moments and amsgrad's maximum, split masters' low halves.
#[derive(Clone, Copy)]
struct Q8 {
    p: [bf16; N],
    g: [bf16; N],
    c: [[u8; N]; 3],
    s: [[f32; NQ]; 3],
    low: [i16; N],
}

/// A tensor list's scale pieces (one per 256 elements of each tensor).
fn split_scales(a: &mut [f32; NQ]) -> [&mut [f32]; 3] {
    let (x, rest) = a.split_at_mut(q8_scales_len(A));
    let (y, z) = rest.split_at_mut(q8_scales_len(B));
    [x, y, z]
}

impl Q8 {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let mut f = |e: i64| rng.mag::<f32>() * pow2(e) as f32;
        Q8 {
            p: core::array::from_fn(|_| bf16::from_f32(f(-10))),
            g: core::array::from_fn(|_| bf16::from_f32(f(-16))),
            c: [[0; N]; 3],
            s: [[0.0; NQ]; 3],
            low: [0; N],
        }
    }

    fn step(
        &mut self,
        reference: bool,
        o: &AdamWOptions,
        split_masters: bool,
    ) -> Result<AdamWReport> {
        let gl = [&self.g[..A], &self.g[A..A + B], &self.g[A + B..]].map(Into::into);
        let mut p = split(&mut self.p).map(Into::into);
        let [c0, c1, c2] = &mut self.c;
        let [s0, s1, s2] = &mut self.s;
        let mut m = split(c0).map(Into::into);
        let mut v = split(c1).map(Into::into);
        let mut x = split(c2).map(Into::into);
        let mut sm = split_scales(s0).map(Into::into);
        let mut sv = split_scales(s1).map(Into::into);
        let mut sx = split_scales(s2).map(Into::into);
        let mut w = split(&mut self.low).map(Into::into);
        let mut t = AdamWTensors {
            params: &mut p,
            grads: &gl,
            exp_avgs: &mut m,
            exp_avg_sqs: &mut v,
            max_exp_avg_sqs: &mut x,
            masters: if split_masters { &mut w } else { &mut [] },
        };
        let mut s = AdamWScales {
            exp_avgs: &mut sm,
            exp_avg_sqs: &mut sv,
            max_exp_avg_sqs: &mut sx,
        };
        let f = AdamWFormats {
            split_masters,
            rounding: if split_masters { 0 } else { ADAMW_SR_PARAMS },
            quantized_moments: true,
            seed: 5,
            keys: &[],
            q8_rows: &[],
        };
        api::adamw_with_scales(reference, &mut t, &mut s, o, &f)
    }

    /// Moment `k`'s element `i`, decoded, and its block's scale.
    fn decoded(&self, k: usize, i: usize) -> (f32, f32) {
        // The scale index: the element's tensor, then its block.
        let q = if i < A {
            i / Q8_BLOCK
        } else if i < A + B {
            q8_scales_len(A) + (i - A) / Q8_BLOCK
        } else {
            q8_scales_len(A) + q8_scales_len(B)
        };
        let s = self.s[k][q];
        if k == 0 {
            (q8_decode::<true>(s, self.c[0][i]), s)
        } else {
            (q8_decode::<false>(s, self.c[k][i]), s)
        }
    }
}

/// Two steps with 8-bit moments against the reference.
fn q8_case(c: &mut Checker<'_>, seed: u64, split_masters: bool) {
    let tag = if split_masters { "split" } else { "sr" };
    let o = AdamWOptions {
        flags: ADAMW_AMSGRAD,
        ..AdamWOptions::new(1e-3)
    };
    let s0 = Q8::new(seed);
    let (mut cpu, mut re) = (s0, s0);
    for step in 1..=2 {
        let o = AdamWOptions { step, ..o };
        let ok =
            cpu.step(false, &o, split_masters).is_ok() && re.step(true, &o, split_masters).is_ok();
        c.check(
            name!("adamw.q8.{tag}.step{step}").as_str(),
            ok,
            format_args!("an error"),
        );
        if !ok {
            return;
        }
        // Params: a bf16 step (stochastic roundings decided apart) and
        // the update's size (codes one step apart).
        let p_ok = cpu.p.iter().zip(&re.p).all(|(a, b)| {
            let (a, b) = (a.to_f64(), b.to_f64());
            (a - b).abs() <= b.abs() * pow2(-7) + 4e-3
        });
        c.check(
            name!("adamw.q8.{tag}.params{step}").as_str(),
            p_ok,
            format_args!("params off"),
        );
        // Decoded moments: one code step (1/8 of the value) apart, or the
        // smallest code (2^-14 of the block's scale for exp_avg, 2^-30 for
        // the second moments), beside f32's error on the scale.
        let m_ok = (0..3).all(|k| {
            let floor = pow2(if k == 0 { -13 } else { -29 });
            (0..N).all(|i| {
                let ((a, _), (b, s)) = (cpu.decoded(k, i), re.decoded(k, i));
                let (a, b, s) = (a as f64, b as f64, s as f64);
                (a - b).abs() <= a.abs().max(b.abs()) / 8.0 + s * (floor + pow2(-20))
            })
        });
        c.check(
            name!("adamw.q8.{tag}.moments{step}").as_str(),
            m_ok,
            format_args!("moments off"),
        );
    }
    c.hash(name!("adamw.q8.{tag}.params").as_str(), BitHash::of(&cpu.p));
    let mut h = BitHash::new();
    for k in 0..3 {
        for &b in &cpu.c[k] {
            h.u64(b as u64);
        }
        for &s in &cpu.s[k] {
            h.u64(s.to_bits() as u64);
        }
    }
    for &l in &cpu.low {
        h.u64(l as u16 as u64);
    }
    c.hash(name!("adamw.q8.{tag}.state").as_str(), h.0);
}

/// Runs the AdamW checks.
pub fn run(c: &mut Checker<'_>) {
    q8_case(c, 34, true);
    q8_case(c, 35, false);
    case::<bf16, bf16, f32>(c, 31, ADAMW_CLIP | ADAMW_AMSGRAD, true);
    case::<f32, f32, f32>(c, 32, 0, false);
    case::<f16, f16, f16>(c, 33, ADAMW_L2 | ADAMW_MAXIMIZE, false);
}
