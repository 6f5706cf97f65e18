//! Matmul's Arm pair dot (`MatmulMath::Bf16DotArm`): bit for bit a model
//! of Arm's `BFDotAdd` written here in integers (each pair's two products
//! summed, then added to c, both rounded to odd; subnormal inputs and
//! starting sums read as zero, results below 2^-126 before rounding written
//! as zero, 2^128 and beyond infinite) on every ISA, thread and block
//! count — on AArch64 with FEAT_BF16 the `BFDOT` instruction itself (under
//! qemu-user in `scripts/cross.sh aarch64`, whose `BFDOT` is QEMU's own
//! softfloat model), the library's scalar model elsewhere; where it parts
//! from VDPBF16PS's pair dot; within the bound of the f64 reference; a
//! non-bf16 call refused.

mod common;

use common::pair_dot::{uniform, Case};
use common::Rng;
use half::bf16;
use npukern::*;

/// x, or a zero of its sign when subnormal.
fn flush(x: f32) -> f32 {
    if x.is_subnormal() {
        0f32.copysign(x)
    } else {
        x
    }
}

/// A finite f64 as `m * 2^e`, m signed.
fn parts(x: f64) -> (i128, i32) {
    let b = x.to_bits();
    let (exp, frac) = ((b >> 52 & 0x7ff) as i32, (b & ((1 << 52) - 1)) as i128);
    let (m, e) = if exp == 0 {
        (frac, -1074)
    } else {
        (frac | 1 << 52, exp - 1075)
    };
    (if x < 0.0 { -m } else { m }, e)
}

/// `v * 2^e` (v != 0) rounded to odd at 24 bits, tiny (below 2^-126) to
/// zero, 2^128 and beyond to infinity.
fn odd(v: i128, e: i32) -> f32 {
    let sign = if v < 0 { 0x8000_0000u32 } else { 0 };
    let a = v.unsigned_abs();
    let len = 128 - a.leading_zeros() as i32;
    let top = e + len - 1;
    if top < -126 {
        return f32::from_bits(sign);
    }
    if top >= 128 {
        return f32::from_bits(sign | 0x7f80_0000);
    }
    let (kept, cut) = if len > 24 {
        let s = len - 24;
        (a >> s, a & ((1u128 << s) - 1) != 0)
    } else {
        (a << (24 - len), false)
    };
    let kept = kept as u32 | u32::from(cut);
    f32::from_bits(sign | ((top + 127) as u32) << 23 | (kept & 0x007f_ffff))
}

/// `x + y` exactly, then `odd` (x and y finite values of f32 or exact
/// products of two bf16). Terms more than 100 bits apart: the smaller one
/// as a sticky bit below the larger (it only decides the direction).
fn sum_odd(x: f64, y: f64) -> f32 {
    if !x.is_finite() || !y.is_finite() {
        return (x + y) as f32;
    }
    if x == 0.0 && y == 0.0 {
        return (x + y) as f32; // -0 only when both are
    }
    let ((mut mx, mut ex), (mut my, mut ey)) = (parts(x), parts(y));
    if mx == 0 {
        return odd(my, ey);
    }
    if my == 0 {
        return odd(mx, ex);
    }
    // x the one with the higher top bit.
    let top = |m: i128, e: i32| e + 128 - m.unsigned_abs().leading_zeros() as i32;
    if top(mx, ex) < top(my, ey) {
        (mx, ex, my, ey) = (my, ey, mx, ex);
    }
    if ex - ey > 60 {
        // y lies far below x's last bit: x, three bits finer, nudged by y's
        // sign.
        return odd(mx * 8 + my.signum(), ex - 3);
    }
    if ex >= ey {
        let v = (mx << (ex - ey)) + my;
        if v == 0 {
            return 0.0;
        }
        odd(v, ey)
    } else {
        // y's last bit above x's (y's top below x's): shift y.
        let v = mx + (my << (ey - ex));
        if v == 0 {
            return 0.0;
        }
        odd(v, ex)
    }
}

/// One `BFDotAdd`.
fn dot_add(c: f32, a0: f32, a1: f32, b0: f32, b1: f32) -> f32 {
    let prod = |x: f32, y: f32| {
        let p = f64::from(flush(x)) * f64::from(flush(y));
        if p == 0.0 || !p.is_finite() {
            p as f32
        } else {
            let (m, e) = parts(p);
            odd(m, e)
        }
    };
    let t = sum_odd(f64::from(prod(a0, b0)), f64::from(prod(a1, b1)));
    sum_odd(f64::from(flush(c)), f64::from(t))
}

/// The Arm pair dot of one element: `c` (or 0), then each pair `(2i, 2i +
/// 1)` (an odd K's last step with a zero one).
fn model(c: f32, x: &[bf16], y: &[bf16]) -> f32 {
    let mut s = c;
    for p in (0..x.len()).step_by(2) {
        let (a1, b1) = match (x.get(p + 1), y.get(p + 1)) {
            (Some(a), Some(b)) => (a.to_f32(), b.to_f32()),
            _ => (0.0, 0.0),
        };
        s = dot_add(s, x[p].to_f32(), a1, y[p].to_f32(), b1);
    }
    s
}

#[test]
fn the_models_agree_on_hand_cases() {
    let p = |e: i32| 2f32.powi(e);
    // 1 + 2^-30: truncated, the last bit set.
    assert_eq!(
        dot_add(0.0, 1.0, p(-15), 1.0, p(-15)).to_bits(),
        0x3f80_0001
    );
    // 1 - 2^-30 and 3 - 2^-30: the predecessor, odd.
    assert_eq!(
        dot_add(1.0, p(-15), 0.0, -p(-15), 0.0).to_bits(),
        0x3f7f_ffff
    );
    assert_eq!(
        dot_add(3.0, p(-15), 0.0, -p(-15), 0.0).to_bits(),
        0x403f_ffff
    );
    // Far apart: 2^100 + 2^-100.
    assert_eq!(
        dot_add(p(100), p(-50), 0.0, p(-50), 0.0).to_bits(),
        p(100).to_bits() | 1
    );
    assert_eq!(dot_add(f32::MAX, p(103), 0.0, 1.0, 0.0), f32::MAX);
    assert_eq!(dot_add(f32::MAX, p(104), 0.0, 1.0, 0.0), f32::INFINITY);
    assert_eq!(dot_add(0.0, p(-64), 0.0, p(-63), 0.0).to_bits(), 0);
    assert_eq!(dot_add(0.0, p(-63), 0.0, p(-63), 0.0), p(-126));
}

/// The (threads, blocks) each case runs with, on every ISA.
const RUNS: [(usize, u32); 2] = [(1, 64), (3, 5)];

/// Every ISA and thread count: the model's bits.
fn check<O: Float>(case: &Case, c0: &[O]) -> Vec<O> {
    case.check(model, c0, &RUNS)
}

fn arm(trans_a: bool, trans_b: bool, accumulate: bool) -> MatmulOptions {
    common::pair_dot::opts(MatmulMath::Bf16DotArm, trans_a, trans_b, accumulate)
}

#[test]
fn every_layout_and_shape_is_the_models_bits_on_every_isa() {
    // Where the CPU has FEAT_BF16 (qemu-user's does), the BFDOT level runs.
    #[cfg(target_arch = "aarch64")]
    if std::arch::is_aarch64_feature_detected!("bf16")
        && std::env::var("NPK_MAX_CPU_ISA")
            .ok()
            .and_then(|v| Isa::parse(&v))
            .is_none()
    {
        assert!(Isa::parse("neonbf16").is_some_and(|i| i.is_available()));
    }
    eprintln!(
        "ISAs: {:?}",
        Isa::ALL
            .into_iter()
            .filter(|i| i.is_available())
            .collect::<Vec<_>>()
    );
    common::pair_dot::every_layout(
        MatmulMath::Bf16DotArm,
        model,
        &RUNS,
        &[
            (1, 1, 1),
            (1, 33, 7),
            (15, 1, 2),
            (6, 16, 16),
            (29, 70, 31),
            (13, 47, 256),
            // K over a slice (the pair panels' 2 x 256 steps), odd.
            (7, 20, 1031),
            (200, 70, 9),
        ],
        0xa64,
    );
}

#[test]
fn accumulate_starts_each_sum_at_c_flushed() {
    common::pair_dot::accumulate(
        MatmulMath::Bf16DotArm,
        model,
        &RUNS,
        &[(5, 9, 3), (9, 40, 300), (3, 3, 0)],
    );
}

#[test]
fn subnormals_tiny_and_huge_sums_nan_and_inf() {
    let mut rng = Rng(0x5ab);
    // Magnitudes around 2^-63 (products and sums near 2^-126) or 2^63
    // (near 2^128), bf16 subnormals, a few NaN and Inf.
    let mut v = || {
        let r = rng.below(100);
        let s = if r.is_multiple_of(2) { 0 } else { 0x8000 };
        match r {
            0 | 1 => bf16::from_bits(s | (0x0001 + rng.below(0x7f) as u16)),
            2 => bf16::NAN,
            3 => bf16::INFINITY,
            _ if r < 50 => {
                bf16::from_bits(s | ((62 + rng.below(4) as u16) << 7) | rng.below(128) as u16)
            }
            _ => bf16::from_bits(s | ((188 + rng.below(3) as u16) << 7) | rng.below(128) as u16),
        }
    };
    for (ta, tb) in [(false, true), (false, false), (true, false)] {
        let case = Case::new(13, 20, 45, arm(ta, tb, false), &mut v);
        check::<f32>(&case, &vec![0.0; 13 * 20]);
        check::<bf16>(&case, &vec![bf16::ZERO; 13 * 20]);
    }
}

/// Sums where rounding to odd parts from VDPBF16PS's nearest-even FMAs:
/// the two maths give other bits, each its own model's.
#[test]
fn rounding_to_odd_is_not_the_x86_pair_dots() {
    let p = |e: i32| bf16::from_f32(2f32.powi(e));
    // 1 + 2^-30 + 2^-30: odd keeps a last bit, nearest-even drops both.
    let case = Case {
        a: vec![bf16::ONE, p(-15), p(-15), bf16::ZERO],
        b: vec![bf16::ONE, p(-15), p(-15), bf16::ZERO],
        m: 1,
        n: 1,
        k: 4,
        o: arm(false, false, false),
    };
    let got = check::<f32>(&case, &[0.0]);
    assert_eq!(got[0].to_bits(), 0x3f80_0001);
    let cpu = Cpu::new(Threads::new(1));
    let x86 = Case {
        o: MatmulOptions {
            math: MatmulMath::Bf16Dot,
            ..case.o
        },
        ..case
    };
    let mut c = [0f32];
    x86.run(&Exec::new(&cpu), &mut c).unwrap();
    assert_eq!(c[0], 1.0);
}

#[test]
fn within_twice_the_chains_bound_of_the_f64_reference() {
    let mut rng = Rng(0xf64);
    let (m, n, k) = (11, 40, 500);
    let case = Case::new(m, n, k, arm(false, true, false), uniform(&mut rng));
    let got = check::<f32>(&case, &vec![0.0; m * n]);
    // Rounding to odd errs by up to an ulp a sum (nearest: half).
    let worst = common::pair_dot::within_bound(&case, &got, 23);
    eprintln!("arm bf16 dot {m}x{n}x{k}: worst {worst:.3} of the bound");
}

/// bf16 c of a step-sized K (64 x 1024 x 64, uniform [-2, 2]) against
/// float64 rounded once: the share that differs and the worst distance in
/// bf16 steps (docs/accuracy.md quotes both).
#[test]
fn a_step_sized_bf16_product_against_float64() {
    let (m, n, k) = (64, 64, 1024);
    let mut rng = Rng(62);
    let case = Case::new(m, n, k, arm(false, true, false), uniform(&mut rng));
    let got = check::<bf16>(&case, &vec![bf16::ZERO; m * n]);
    let mut worst = 0;
    let mut differ = 0;
    for i in 0..m {
        for j in 0..n {
            let (x, y) = case.vectors(i, j);
            let w = bf16::from_f64(x.iter().zip(&y).map(|(a, b)| a.to_f64() * b.to_f64()).sum());
            let g = got[i * n + j];
            if g != w {
                differ += 1;
                let key = |v: bf16| {
                    let b = v.to_bits() as i32;
                    if b & 0x8000 != 0 {
                        -(b & 0x7fff)
                    } else {
                        b
                    }
                };
                worst = worst.max((key(g) - key(w)).abs());
            }
        }
    }
    eprintln!(
        "{m}x{k}x{n} bf16 arm dot: {:.3}% differ from round(f64), worst {worst} bf16 steps",
        100.0 * differ as f64 / (m * n) as f64
    );
    assert!(differ * 100 < m * n, "{differ} of {} differ", m * n);
}

#[test]
fn an_arm_pair_dot_of_non_bf16_operands_is_refused_and_nothing_is_written() {
    let a = vec![half::f16::ONE; 6];
    let at = TensorRef::new(&a, &[2, 3]).unwrap();
    let bt = TensorRef::new(&a, &[3, 2]).unwrap();
    let o = arm(false, false, false);
    let cpu = Cpu::new(Threads::new(1));
    let exec = Exec::new(&cpu);
    let err = matmul_workspace_size(&exec, at, bt, DType::F16, &o).unwrap_err();
    assert!(err.to_string().contains("math"), "{err}");
    let mut c = vec![half::f16::from_f32(-7.25); 4];
    let mut ws = vec![0u8; 1 << 16];
    assert!(matmul(&exec, at, bt, &o, &mut c, &mut ws).is_err());
    assert!(c.iter().all(|&x| x.to_f32() == -7.25));
}
