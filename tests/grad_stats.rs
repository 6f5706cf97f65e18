//! grad_stats / clip_grad_norm against an independent float64 model, on
//! random mixed-dtype lists, special values, thread counts and bad input.

mod common;

use common::owned::Owned;
use core::ffi::c_void;
use half::{bf16, f16};
use npukern::{
    clip_coefficient, clip_grad_norm, clip_grad_norm_raw, clip_grad_norm_workspace_size,
    grad_stats, grad_stats_raw, grad_stats_workspace_size, grad_stats_workspace_size_raw,
    ClipGradNormOptions, Cpu, DType, Error, Exec, GradSummary, GradTensor, GradTensorMut,
    RawTensor, Threads, UbConfig,
};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Roughly normal, times a random scale over many decades.
    fn val(&mut self, scale: f32) -> f32 {
        let s: f32 = (0..4)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
            .sum();
        (s - 2.0) * scale
    }
}

/// What this file needs of the shared `Owned` beyond its views.
trait OwnedExt {
    /// The PyTorch rule, element by element: round(f32(x) * c) to the dtype.
    fn scaled_bits(&self, c: f32) -> Vec<u32>;
    /// A C descriptor of the tensor (1-D).
    fn raw(&mut self) -> RawTensor;
}

impl OwnedExt for Owned {
    fn scaled_bits(&self, c: f32) -> Vec<u32> {
        match self {
            Owned::F32(v) => v.iter().map(|x| (x * c).to_bits()).collect(),
            Owned::F16(v) => v
                .iter()
                .map(|x| f16::from_f32(x.to_f32() * c).to_bits() as u32)
                .collect(),
            Owned::BF16(v) => v
                .iter()
                .map(|x| bf16::from_f32(x.to_f32() * c).to_bits() as u32)
                .collect(),
        }
    }
    fn raw(&mut self) -> RawTensor {
        let (p, dt, n) = match self {
            Owned::F32(v) => (v.as_mut_ptr() as *mut c_void, DType::F32, v.len()),
            Owned::F16(v) => (v.as_mut_ptr() as *mut c_void, DType::F16, v.len()),
            Owned::BF16(v) => (v.as_mut_ptr() as *mut c_void, DType::BF16, v.len()),
        };
        raw(p, dt, &[n as i64])
    }
}

fn raw(data: *mut c_void, dtype: DType, dims: &[i64]) -> RawTensor {
    let mut shape = [0i64; 8];
    shape[..dims.len()].copy_from_slice(dims);
    RawTensor {
        data,
        dtype,
        ndim: dims.len() as u32,
        shape,
    }
}

fn random_tensor(r: &mut Rng, len: usize) -> Owned {
    let scale = [1e-3f32, 0.1, 1.0, 30.0][r.below(4) as usize];
    match r.below(3) {
        0 => Owned::F32((0..len).map(|_| r.val(scale)).collect()),
        1 => Owned::F16((0..len).map(|_| f16::from_f32(r.val(scale))).collect()),
        _ => Owned::BF16((0..len).map(|_| bf16::from_f32(r.val(scale))).collect()),
    }
}

/// Independent float64 model: Neumaier-compensated sum of squares.
struct Expect {
    sum_sq: f64,
    nan: u64,
    inf: u64,
    min: f32,
    max: f32,
    absmax: f32,
}

fn expect(ts: &[Owned]) -> Expect {
    let (mut s, mut comp) = (0f64, 0f64);
    let mut e = Expect {
        sum_sq: 0.0,
        nan: 0,
        inf: 0,
        min: f32::NAN,
        max: f32::NAN,
        absmax: f32::NAN,
    };
    for t in ts {
        for x in t.values() {
            if x.is_nan() {
                e.nan += 1;
            } else if x.is_infinite() {
                e.inf += 1;
            } else {
                let q = x as f64 * x as f64;
                let t = s + q;
                comp += if s.abs() >= q {
                    (s - t) + q
                } else {
                    (q - t) + s
                };
                s = t;
                e.min = if e.min.is_nan() { x } else { e.min.min(x) };
                e.max = if e.max.is_nan() { x } else { e.max.max(x) };
                e.absmax = if e.absmax.is_nan() {
                    x.abs()
                } else {
                    e.absmax.max(x.abs())
                };
            }
        }
    }
    e.sum_sq = s + comp;
    e
}

/// The kernel's documented bound on `sum_sq`: 11 * 2^-24.
const KERNEL_TOL: f64 = 6.6e-7;

fn same_f32(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a == b
}

fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        ((a - b) / b).abs()
    }
}

fn check(got: &GradSummary, e: &Expect, tol: f64) -> f64 {
    assert_eq!(got.nan_count, e.nan);
    assert_eq!(got.inf_count, e.inf);
    assert!(same_f32(got.min, e.min), "min {} vs {}", got.min, e.min);
    assert!(same_f32(got.max, e.max), "max {} vs {}", got.max, e.max);
    assert!(
        same_f32(got.absmax, e.absmax),
        "absmax {} vs {}",
        got.absmax,
        e.absmax
    );
    let r = rel(got.sum_sq, e.sum_sq);
    assert!(
        r <= tol,
        "sum_sq {} vs {} (rel {r:e})",
        got.sum_sq,
        e.sum_sq
    );
    if got.is_finite() {
        let n = rel(got.norm(), e.sum_sq.sqrt());
        assert!(n <= 1e-6, "norm rel error {n:e}");
        return n;
    }
    r
}

fn stats_of(exec: &Exec<'_>, ts: &[Owned]) -> GradSummary {
    let views: Vec<GradTensor<'_>> = ts.iter().map(|t| t.view()).collect();
    let mut ws = vec![0u8; grad_stats_workspace_size(exec, &views).unwrap()];
    grad_stats(exec, &views, &mut ws).unwrap()
}

fn clip_of(exec: &Exec<'_>, ts: &mut [Owned], max_norm: f64, err: bool) -> Result<f64, Error> {
    let mut views: Vec<GradTensorMut<'_>> = ts.iter_mut().map(|t| t.view_mut()).collect();
    let n = clip_grad_norm_workspace_size(exec, &views, &ClipGradNormOptions::new(1.0)).unwrap();
    // An odd offset: the library must align inside.
    let mut ws = vec![0u8; n + 1];
    clip_grad_norm(
        exec,
        &mut views,
        &ClipGradNormOptions {
            max_norm,
            error_if_nonfinite: err,
        },
        &mut ws[1..],
    )
}

#[test]
fn random_mixed_lists_match_float64() {
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    let mut worst = 0f64;
    for case in 0..40 {
        let count = 1 + r.below(12) as usize;
        let ts: Vec<Owned> = (0..count)
            .map(|_| {
                let len = match r.below(5) {
                    0 => 0,
                    1 => r.below(17) as usize,
                    2 => r.below(1000) as usize,
                    3 => r.below(40_000) as usize,
                    _ => r.below(300_000) as usize,
                };
                random_tensor(&mut r, len)
            })
            .collect();
        let e = expect(&ts);
        let ub = UbConfig {
            blocks: 1 + (case % 70) as u32,
            ..UbConfig::default()
        };
        let exec = Exec::cpu().with_ub(ub);
        let got = stats_of(&exec, &ts);
        worst = worst.max(check(&got, &e, KERNEL_TOL));
        // The reference sums sequentially: less exact than the lanes.
        let refd = stats_of(&Exec::reference().with_ub(ub), &ts);
        check(&refd, &e, 1e-10);
    }
    println!("random lists: worst norm relative error vs float64 {worst:e}");
}

#[test]
fn big_tensor_norm_error() {
    // 2^24 f32 and 2^23 bf16 elements in one list: the largest blocks.
    let mut r = Rng(42);
    let ts = vec![
        Owned::F32((0..1 << 24).map(|_| r.val(1.0)).collect()),
        Owned::BF16((0..1 << 23).map(|_| bf16::from_f32(r.val(3.0))).collect()),
    ];
    let e = expect(&ts);
    let mut worst = 0f64;
    for blocks in [1u32, 7, 64] {
        let exec = Exec::cpu().with_ub(UbConfig {
            blocks,
            ..UbConfig::default()
        });
        worst = worst.max(check(&stats_of(&exec, &ts), &e, KERNEL_TOL));
    }
    println!("2^24 + 2^23 elements: worst norm relative error vs float64 {worst:e}");
}

#[test]
fn empty_lists_and_tensors() {
    let exec = Exec::cpu();
    assert_eq!(grad_stats_workspace_size(&exec, &[]).unwrap(), 0);
    let s = grad_stats(&exec, &[], &mut []).unwrap();
    assert_eq!((s.sum_sq, s.nan_count, s.inf_count), (0.0, 0, 0));
    assert!(s.min.is_nan() && s.max.is_nan() && s.absmax.is_nan());
    assert_eq!(s.norm(), 0.0);
    let ts = vec![Owned::F32(vec![]), Owned::BF16(vec![]), Owned::F16(vec![])];
    let views: Vec<_> = ts.iter().map(|t| t.view()).collect();
    assert_eq!(grad_stats_workspace_size(&exec, &views).unwrap(), 0);
    let s = grad_stats(&exec, &views, &mut []).unwrap();
    assert!(s.min.is_nan());
    let mut ts2 = ts.clone();
    assert_eq!(clip_of(&exec, &mut ts2, 1.0, true).unwrap(), 0.0);
    let mut none: [GradTensorMut<'_>; 0] = [];
    assert_eq!(
        clip_grad_norm(
            &exec,
            &mut none,
            &ClipGradNormOptions {
                max_norm: 1.0,
                error_if_nonfinite: true
            },
            &mut []
        )
        .unwrap(),
        0.0
    );
}

#[test]
fn thousand_small_tensors() {
    let mut r = Rng(7);
    let ts: Vec<Owned> = (0..1000)
        .map(|i| {
            let len = if i % 97 == 0 {
                0
            } else {
                1 + r.below(40) as usize
            };
            random_tensor(&mut r, len)
        })
        .collect();
    let e = expect(&ts);
    for threads in [1, 2, 4] {
        let cpu = Cpu::new(Threads::new(threads));
        let exec = Exec::new(&cpu);
        check(&stats_of(&exec, &ts), &e, KERNEL_TOL);
    }
    let mut a = ts.clone();
    let mut b = ts.clone();
    let na = clip_of(&Exec::cpu(), &mut a, 0.5, false).unwrap();
    let nb = clip_of(&Exec::reference(), &mut b, 0.5, false).unwrap();
    assert!(rel(na, nb) < KERNEL_TOL);
    let c = clip_coefficient(na, 0.5);
    assert!(c < 1.0);
    for ((x, y), t) in a.iter().zip(&b).zip(&ts) {
        assert_eq!(x.bits(), t.scaled_bits(c));
        if clip_coefficient(nb, 0.5) == c {
            assert_eq!(x.bits(), y.bits());
        }
    }
}

fn specials() -> Vec<Owned> {
    let sub32 = f32::from_bits(1); // smallest f32 subnormal
    let sub16 = f16::from_bits(1); // smallest f16 subnormal
    let subbf = bf16::from_bits(1);
    let mut a: Vec<f32> = (0..100).map(|i| i as f32 * 0.25 - 10.0).collect();
    a.extend([sub32, -sub32, 65504.0, -0.0, 3.0e38, -2.5e30]);
    let mut b: Vec<f16> = (0..37).map(|i| f16::from_f32(i as f32 - 18.0)).collect();
    b.extend([sub16, -sub16, f16::MAX, f16::MIN, f16::from_f32(-0.0)]);
    let mut c: Vec<bf16> = (0..53).map(|i| bf16::from_f32(i as f32 * 1.5)).collect();
    c.extend([subbf, bf16::from_f32(65504.0), bf16::MAX]);
    vec![Owned::F32(a), Owned::F16(b), Owned::BF16(c)]
}

fn poison(ts: &mut [Owned], at: usize, v: f32) {
    // Spread the value over every tensor at position `at` (mod length).
    for t in ts.iter_mut() {
        match t {
            Owned::F32(x) => {
                let n = x.len();
                x[at % n] = v
            }
            Owned::F16(x) => {
                let n = x.len();
                x[at % n] = f16::from_f32(v)
            }
            Owned::BF16(x) => {
                let n = x.len();
                x[at % n] = bf16::from_f32(v)
            }
        }
    }
}

#[test]
fn special_values() {
    let exec = Exec::cpu();
    let ts = specials();
    let e = expect(&ts);
    assert!(e.sum_sq.is_finite());
    check(&stats_of(&exec, &ts), &e, KERNEL_TOL);
    for (at, v) in [(5, f32::NAN), (17, f32::INFINITY), (33, f32::NEG_INFINITY)] {
        let mut p = specials();
        poison(&mut p, at, v);
        let e = expect(&p);
        let got = stats_of(&exec, &p);
        check(&got, &e, KERNEL_TOL);
        assert!(!got.is_finite());
        assert!(got.norm().is_nan() == v.is_nan());
        assert!(stats_of(&Exec::reference(), &p).same_bits(&got) || got.min == 0.0);
    }
    // All non-finite: min/max/absmax are NaN.
    let all = vec![Owned::F32(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY])];
    let got = stats_of(&exec, &all);
    assert_eq!((got.nan_count, got.inf_count, got.sum_sq), (1, 2, 0.0));
    assert!(got.min.is_nan() && got.max.is_nan() && got.absmax.is_nan());
}

#[test]
fn nonfinite_inside_a_big_window_is_masked() {
    // NaN/Inf deep inside long tensors: the window re-scan path.
    let mut r = Rng(99);
    let mut ts: Vec<Owned> = (0..3).map(|_| random_tensor(&mut r, 200_003)).collect();
    poison(&mut ts, 123_457, f32::NAN);
    poison(&mut ts, 77, f32::INFINITY);
    poison(&mut ts, 199_999, f32::NEG_INFINITY);
    let e = expect(&ts);
    for blocks in [1u32, 3, 64] {
        let exec = Exec::cpu().with_ub(UbConfig {
            blocks,
            ub_bytes: 4096,
        });
        check(&stats_of(&exec, &ts), &e, KERNEL_TOL);
    }
}

#[test]
fn huge_finite_values_do_not_overflow() {
    let ts = vec![
        Owned::F32(vec![3e38, -3e38, 1e30]),
        Owned::BF16(vec![bf16::MAX; 20]),
    ];
    let e = expect(&ts);
    let got = stats_of(&Exec::cpu(), &ts);
    assert!(got.is_finite() && got.norm().is_finite());
    check(&got, &e, KERNEL_TOL);
}

/// Whole windows (512 elements and more) of magnitudes whose squares leave
/// f32's range both ways (near f32::MAX, and 1e-20 down to subnormals):
/// the fast path's f64 test must keep them (the same bits on every ISA and
/// the float64 model's sum), and one NaN or Inf among them must still be
/// counted and left out.
#[test]
fn whole_windows_beyond_f32_squares() {
    use npukern::Isa;
    let mut r = Rng(2718);
    let mut ts = vec![
        Owned::F32((0..1500).map(|_| r.val(3e38)).collect()),
        Owned::F32((0..1300).map(|_| r.val(1e-20)).collect()),
        Owned::F32((0..1100).map(|_| r.val(1e-39)).collect()),
        Owned::BF16((0..1200).map(|_| bf16::from_f32(r.val(3e38))).collect()),
    ];
    for poisoned in [None, Some(f32::NAN), Some(f32::INFINITY)] {
        if let Some(v) = poisoned {
            poison(&mut ts, 700, v);
        }
        let e = expect(&ts);
        let mut first: Option<GradSummary> = None;
        for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
            let cpu = Cpu::new(npukern::Serial).with_isa(isa);
            let s = stats_of(&Exec::new(&cpu), &ts);
            check(&s, &e, KERNEL_TOL);
            assert!(s.sum_sq.is_finite() && s.sum_sq > 1e76, "{isa:?}");
            match &first {
                None => first = Some(s),
                Some(s0) => assert!(s.same_bits(s0), "{isa:?}"),
            }
        }
    }
}

#[test]
fn clip_scales_by_the_pytorch_rule() {
    let mut r = Rng(1234);
    for (max_norm, err) in [
        (0.0, true),
        (0.1, false),
        (1.0, true),
        (1e3, true),
        (f64::INFINITY, true),
    ] {
        let ts: Vec<Owned> = (0..9)
            .map(|i| random_tensor(&mut r, 1000 * i + 13))
            .collect();
        let e = expect(&ts);
        let mut a = ts.clone();
        let norm = clip_of(&Exec::cpu(), &mut a, max_norm, err).unwrap();
        assert!(rel(norm, e.sum_sq.sqrt()) < 1e-6);
        let c = clip_coefficient(norm, max_norm);
        assert_eq!(c, ((max_norm / (norm + 1e-6)).min(1.0)) as f32);
        for (x, t) in a.iter().zip(&ts) {
            assert_eq!(x.bits(), t.scaled_bits(c));
        }
        let mut b = ts.clone();
        let nb = clip_of(&Exec::reference(), &mut b, max_norm, err).unwrap();
        if clip_coefficient(nb, max_norm) == c {
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(
                    x.bits(),
                    y.bits(),
                    "kernel vs reference (which always multiplies)"
                );
            }
        }
    }
}

#[test]
fn clip_coefficient_one_leaves_bits_alone() {
    let ts = specials();
    let mut a = ts.clone();
    let mut b = ts.clone();
    let na = clip_of(&Exec::cpu(), &mut a, 1e300, true).unwrap();
    clip_of(&Exec::reference(), &mut b, 1e300, true).unwrap();
    assert_eq!(clip_coefficient(na, 1e300), 1.0);
    for ((x, y), t) in a.iter().zip(&b).zip(&ts) {
        assert_eq!(x.bits(), t.bits());
        assert_eq!(y.bits(), t.bits(), "the multiplying reference agrees");
    }
}

#[test]
fn error_if_nonfinite_touches_nothing() {
    for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut ts = specials();
        ts.push(random_tensor(&mut Rng(5), 100_000));
        poison(&mut ts, 60_001, v);
        let before: Vec<Vec<u32>> = ts.iter().map(|t| t.bits()).collect();
        for exec in [Exec::cpu(), Exec::reference()] {
            assert_eq!(clip_of(&exec, &mut ts, 1.0, true), Err(Error::NonFinite));
            let after: Vec<Vec<u32>> = ts.iter().map(|t| t.bits()).collect();
            assert_eq!(before, after);
        }
    }
}

#[test]
fn nonfinite_without_error_applies_the_coefficient() {
    for (v, coef_nan) in [
        (f32::NAN, true),
        (f32::INFINITY, false),
        (f32::NEG_INFINITY, false),
    ] {
        let mut ts = specials();
        poison(&mut ts, 3, v);
        let orig = ts.clone();
        let mut b = ts.clone();
        let n = clip_of(&Exec::cpu(), &mut ts, 1.0, false).unwrap();
        clip_of(&Exec::reference(), &mut b, 1.0, false).unwrap();
        assert_eq!(n.is_nan(), coef_nan);
        assert!(n.is_nan() || n == f64::INFINITY);
        let c = clip_coefficient(n, 1.0);
        assert_eq!(c.is_nan(), coef_nan);
        assert!(coef_nan || c == 0.0);
        for ((x, y), o) in ts.iter().zip(&b).zip(&orig) {
            let (xv, ov) = (x.values(), o.values());
            for (got, was) in xv.iter().zip(&ov) {
                if coef_nan || !was.is_finite() {
                    assert!(got.is_nan());
                } else {
                    assert_eq!(*got, 0.0);
                }
            }
            assert_eq!(x.values().len(), y.values().len());
            for (p, q) in x.values().iter().zip(y.values()) {
                assert!(
                    same_f32(*p, q) && p.is_sign_negative() == q.is_sign_negative() || p.is_nan()
                );
            }
        }
    }
}

#[test]
fn bit_identical_for_any_thread_count() {
    let mut r = Rng(2024);
    let mut ts: Vec<Owned> = (0..20)
        .map(|_| {
            let n = r.below(100_000) as usize;
            random_tensor(&mut r, n)
        })
        .collect();
    ts.push(random_tensor(&mut r, 1_000_001));
    let first = stats_of(&Exec::cpu(), &ts);
    let mut clipped_first: Option<Vec<Vec<u32>>> = None;
    for threads in [1usize, 2, 4] {
        let cpu = Cpu::new(Threads::new(threads));
        let exec = Exec::new(&cpu);
        assert!(stats_of(&exec, &ts).same_bits(&first), "{threads} threads");
        let mut c = ts.clone();
        let n = clip_of(&exec, &mut c, 0.25, true).unwrap();
        assert_eq!(n.to_bits(), first.norm().to_bits());
        let bits: Vec<Vec<u32>> = c.iter().map(|t| t.bits()).collect();
        match &clipped_first {
            None => clipped_first = Some(bits),
            Some(f) => assert_eq!(f, &bits, "{threads} threads"),
        }
    }
}

#[test]
fn errors() {
    let exec = Exec::cpu();
    let mut x = vec![1.0f32; 64];
    let mut idx = vec![1i32; 8];
    let good = raw(x.as_mut_ptr() as *mut c_void, DType::F32, &[8, 8]);
    let bad = raw(idx.as_mut_ptr() as *mut c_void, DType::I32, &[8]);
    assert!(matches!(
        grad_stats_workspace_size_raw(&exec, &[good, bad]),
        Err(Error::DtypeUnsupported { arg: "tensors", .. })
    ));
    // Overflow: one shape, and a list whose element total does not fit.
    let huge = raw(4096 as *mut c_void, DType::F32, &[1 << 62, 4]);
    assert_eq!(
        grad_stats_workspace_size_raw(&exec, &[huge]),
        Err(Error::SizeOverflow { arg: "tensors" })
    );
    let big = raw(4096 as *mut c_void, DType::BF16, &[1 << 61]);
    assert_eq!(
        grad_stats_workspace_size_raw(&exec, &[big; 9]),
        Err(Error::SizeOverflow { arg: "tensors" })
    );
    // NULL data in a non-empty tensor; NULL is fine when empty.
    let null = raw(core::ptr::null_mut(), DType::F16, &[3]);
    assert_eq!(
        grad_stats_workspace_size_raw(&exec, &[null]),
        Err(Error::NullPointer { arg: "tensors" })
    );
    let empty = raw(core::ptr::null_mut(), DType::F16, &[3, 0]);
    assert_eq!(grad_stats_workspace_size_raw(&exec, &[empty]), Ok(0));
    // Workspace too small: nothing written.
    let mut ts = [Owned::F32(vec![2.0; 100])];
    let before = ts[0].bits();
    let mut views: Vec<_> = ts.iter_mut().map(|t| t.view_mut()).collect();
    let need =
        clip_grad_norm_workspace_size(&exec, &views, &ClipGradNormOptions::new(1.0)).unwrap();
    let mut ws = vec![0u8; need - 1];
    assert_eq!(
        clip_grad_norm(
            &exec,
            &mut views,
            &ClipGradNormOptions {
                max_norm: 1.0,
                error_if_nonfinite: false
            },
            &mut ws
        ),
        Err(Error::WorkspaceTooSmall {
            needed: need,
            given: need - 1
        })
    );
    let ro: Vec<_> = views.iter().map(|v| v.as_ref()).collect();
    assert!(matches!(
        grad_stats(&exec, &ro, &mut ws),
        Err(Error::WorkspaceTooSmall { .. })
    ));
    // Bad max_norm.
    let mut ws = vec![0u8; need];
    for m in [f64::NAN, -1.0] {
        assert!(matches!(
            clip_grad_norm(
                &exec,
                &mut views,
                &ClipGradNormOptions {
                    max_norm: m,
                    error_if_nonfinite: false
                },
                &mut ws
            ),
            Err(Error::InvalidParam {
                arg: "max_norm",
                ..
            })
        ));
    }
    drop(views);
    assert_eq!(ts[0].bits(), before);
    // Descriptors: overlapping tensors (clip only), workspace over a tensor.
    let a = raw(x.as_mut_ptr() as *mut c_void, DType::F32, &[40]);
    // SAFETY: in bounds of x.
    let b = raw(
        unsafe { x.as_mut_ptr().add(32) } as *mut c_void,
        DType::F32,
        &[32],
    );
    let need = grad_stats_workspace_size_raw(&exec, &[a, b]).unwrap();
    let mut ws = vec![0u8; need];
    let wsp = ws.as_mut_ptr() as *mut c_void;
    // SAFETY: valid descriptors and workspace.
    unsafe {
        assert!(grad_stats_raw(&exec, &[a, b], wsp, need).is_ok());
        assert!(matches!(
            clip_grad_norm_raw(&exec, &[a, b], &ClipGradNormOptions::new(1.0), wsp, need),
            Err(Error::InvalidParam { arg: "tensors", .. })
        ));
        let xp = x.as_mut_ptr() as *mut c_void;
        assert!(matches!(
            grad_stats_raw(&exec, &[a], xp, 64 * 4),
            Err(Error::InvalidParam {
                arg: "workspace",
                ..
            })
        ));
        let wbad = raw(wsp, DType::F32, &[4]);
        assert!(matches!(
            grad_stats_raw(&exec, &[wbad, a], wsp, need),
            Err(Error::InvalidParam {
                arg: "workspace",
                ..
            })
        ));
    }
    assert!(x.iter().all(|&v| v == 1.0));
    // Bad UbConfig.
    let e = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 10,
        blocks: 1,
    });
    assert!(matches!(
        grad_stats_workspace_size(&e, &[GradTensor::F32(&[1.0])]),
        Err(Error::InvalidParam { .. })
    ));
}

#[test]
fn unavailable_isa_is_an_error() {
    use npukern::Isa;
    for isa in Isa::ALL {
        let cpu = Cpu::new(npukern::Serial).with_isa(isa);
        let exec = Exec::new(&cpu);
        let r = grad_stats(&exec, &[GradTensor::F32(&[1.0; 3])], &mut [0u8; 4096]);
        if isa.is_available() {
            assert_eq!(r.unwrap().sum_sq, 3.0);
        } else {
            assert_eq!(r.unwrap_err(), Error::IsaUnavailable);
        }
    }
}

#[test]
fn descriptors_match_the_typed_api() {
    let mut r = Rng(31337);
    let mut ts: Vec<Owned> = (0..30)
        .map(|i| random_tensor(&mut r, (i * 977) % 5000))
        .collect();
    let typed = stats_of(&Exec::cpu(), &ts);
    let mut descs: Vec<RawTensor> = ts.iter_mut().map(|t| t.raw()).collect();
    // Any shape with the same element count is the same tensor here.
    if let Some(d) = descs
        .iter_mut()
        .find(|d| d.shape[0] % 4 == 0 && d.shape[0] > 0)
    {
        let n = d.shape[0];
        d.ndim = 3;
        d.shape[..3].copy_from_slice(&[2, n / 4, 2]);
    }
    let exec = Exec::cpu();
    let need = grad_stats_workspace_size_raw(&exec, &descs).unwrap();
    let mut ws = vec![0u8; need];
    // SAFETY: the descriptors describe live vectors; the workspace is ours.
    let s = unsafe { grad_stats_raw(&exec, &descs, ws.as_mut_ptr() as *mut c_void, need) }.unwrap();
    assert!(s.same_bits(&typed));
    let mut copy = ts.clone();
    let n1 = clip_of(&exec, &mut copy, 0.5, true).unwrap();
    // SAFETY: as above; the vectors are disjoint.
    let n2 = unsafe {
        let opts = ClipGradNormOptions {
            max_norm: 0.5,
            error_if_nonfinite: true,
        };
        clip_grad_norm_raw(&exec, &descs, &opts, ws.as_mut_ptr() as *mut c_void, need)
    }
    .unwrap();
    assert_eq!(n1.to_bits(), n2.to_bits());
    for (a, b) in copy.iter().zip(&ts) {
        assert_eq!(a.bits(), b.bits());
    }
}

#[test]
fn tiny_values_keep_their_precision() {
    // Squares below f32's range: these windows are summed exactly in f64.
    let mut r = Rng(77);
    let ts = vec![
        Owned::F32((0..5000).map(|_| r.val(1e-30)).collect()),
        Owned::F32((1..3000).map(f32::from_bits).collect()), // subnormals
        Owned::BF16((0..700).map(|_| bf16::from_f32(r.val(1e-36))).collect()),
    ];
    let e = expect(&ts);
    assert!(e.sum_sq > 0.0);
    let got = stats_of(&Exec::cpu(), &ts);
    check(&got, &e, 1e-12);
}

#[test]
fn bit_identical_across_isas() {
    use npukern::Isa;
    let mut r = Rng(555);
    let mut ts: Vec<Owned> = (0..12)
        .map(|_| {
            let n = r.below(50_000) as usize;
            random_tensor(&mut r, n)
        })
        .collect();
    ts.extend(specials());
    let mut poisoned = ts.clone();
    poison(&mut poisoned, 4321, f32::NAN);
    let mut first: Option<(GradSummary, GradSummary, Vec<Vec<u32>>)> = None;
    for isa in Isa::ALL {
        if !isa.is_available() {
            continue;
        }
        let cpu = Cpu::new(npukern::Serial).with_isa(isa);
        let exec = Exec::new(&cpu);
        let s = stats_of(&exec, &ts);
        let p = stats_of(&exec, &poisoned);
        let mut c = ts.clone();
        clip_of(&exec, &mut c, 0.3, true).unwrap();
        let bits: Vec<Vec<u32>> = c.iter().map(|t| t.bits()).collect();
        match &first {
            None => first = Some((s, p, bits)),
            Some((s0, p0, b0)) => {
                assert!(s.same_bits(s0), "{isa:?}");
                assert!(p.same_bits(p0), "{isa:?}");
                assert_eq!(&bits, b0, "{isa:?}");
            }
        }
    }
}
