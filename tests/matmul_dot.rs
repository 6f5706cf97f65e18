//! Matmul's bf16 pair dot (`MatmulMath::Bf16Dot`): bit for bit the scalar
//! model of VDPBF16PS (pairs, the odd step first, each an FMA, subnormal
//! inputs and sums as zero) on every ISA — the instruction itself where
//! the CPU has AVX512-BF16, the flushed FMA chain elsewhere — every thread
//! and block count; within the chain's bound of the f64 reference; odd K,
//! K over a slice, corners, accumulate, subnormals, NaN; a non-bf16 call
//! refused.

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

/// One FMA of VDPBF16PS: `a b + c` rounded to nearest even, then zero (of
/// its sign) when tiny — and x86 detects tininess after rounding to 24
/// bits with an unbounded exponent, so a sum that IEEE rounds up to
/// `2^-126` from `[2^-126 - 2^-150, 2^-126 - 2^-151)` is tiny too. The
/// decision from f64: `c + a b` there rounds to f64 exactly on the right
/// side of `T = 2^-126 - 2^-151` (the midpoint that rounds up), since c is
/// a multiple of `2^-149` and `a b` needs bits below `2^-164` to come
/// within f64's half ulp of T, which puts c at least `2^-151 - 2^-163`
/// away from it.
fn fma_ftz(a: f32, b: f32, c: f32) -> f32 {
    let r = a.mul_add(b, c);
    let t = f64::from(f32::MIN_POSITIVE) * (1.0 - 2f64.powi(-25));
    if (f64::from(c) + f64::from(a) * f64::from(b)).abs() < t {
        0f32.copysign(r)
    } else {
        r
    }
}

/// The pair dot of one element: `c` (or 0) then each pair `(2i, 2i + 1)`
/// as `c = fma_ftz(a1, b1, c)`, `c = fma_ftz(a0, b0, c)`, inputs flushed;
/// an odd K's last step after a zero one.
fn model(c: f32, x: &[bf16], y: &[bf16]) -> f32 {
    let mut s = flush(c);
    for p in (0..x.len()).step_by(2) {
        let (a0, b0) = (flush(x[p].to_f32()), flush(y[p].to_f32()));
        let (a1, b1) = match (x.get(p + 1), y.get(p + 1)) {
            (Some(a), Some(b)) => (flush(a.to_f32()), flush(b.to_f32())),
            _ => (0.0, 0.0),
        };
        s = fma_ftz(a1, b1, s);
        s = fma_ftz(a0, b0, s);
    }
    s
}

/// The (threads, blocks) each case runs with, on every ISA.
const RUNS: [(usize, u32); 3] = [(1, 64), (3, 5), (2, 1)];

/// Every ISA and thread count: the model's bits.
fn check<O: Float>(case: &Case, c0: &[O]) -> Vec<O> {
    case.check(model, c0, &RUNS)
}

fn dot(trans_a: bool, trans_b: bool, accumulate: bool) -> MatmulOptions {
    common::pair_dot::opts(MatmulMath::Bf16Dot, trans_a, trans_b, accumulate)
}

#[test]
fn every_layout_and_shape_is_the_models_bits_on_every_isa() {
    common::pair_dot::every_layout(
        MatmulMath::Bf16Dot,
        model,
        &RUNS,
        &[
            (1, 1, 1),
            (1, 33, 7),
            (15, 1, 2),
            (14, 32, 16),
            (29, 70, 31),
            (30, 47, 256),
            (17, 40, 257),
            (45, 97, 600),
            (200, 530, 33),
            // Two tiles down each of two columns, K in one slice: a
            // worker's second tile reuses its column's packed b (a short
            // odd K: this shape was 64% of the file's work at K = 45, 4
            // minutes under qemu-user).
            (700, 530, 11),
            // Whole 14-row panels of a row-major a over three slices (the
            // last short), and with an odd K rows that start between words
            // and an odd last slice.
            (28, 40, 1100),
            (42, 33, 1031),
        ],
        0xd07,
    );
}

#[test]
fn accumulate_starts_each_sum_at_c_flushed() {
    common::pair_dot::accumulate(
        MatmulMath::Bf16Dot,
        model,
        &RUNS,
        &[(5, 9, 3), (20, 40, 300), (3, 3, 0)],
    );
}

#[test]
fn subnormals_tiny_sums_nan_and_inf() {
    let mut rng = Rng(0x5ab);
    // Magnitudes around 2^-63 each: products and sums near 2^-126, bf16
    // subnormal inputs, and a few NaN and Inf.
    let mut v = || {
        let r = rng.below(100);
        match r {
            0 => bf16::from_bits(0x0001 + rng.below(0x7f) as u16),
            1 => bf16::from_bits(0x8000 | (0x0001 + rng.below(0x7f) as u16)),
            2 => bf16::NAN,
            3 => bf16::INFINITY,
            _ => {
                let s = if r.is_multiple_of(2) { 0 } else { 0x8000 };
                bf16::from_bits(s | ((62 + rng.below(4) as u16) << 7) | rng.below(128) as u16)
            }
        }
    };
    for (ta, tb) in [(false, true), (false, false), (true, false)] {
        let case = Case::new(23, 50, 45, dot(ta, tb, false), &mut v);
        check::<f32>(&case, &vec![0.0; 23 * 50]);
        check::<bf16>(&case, &vec![bf16::ZERO; 23 * 50]);
    }
}

/// Sums next to `2^-126` with bits below `2^-149`: where IEEE rounds up to
/// `2^-126` and x86's tininess after rounding flushes (Zen 5's VDPBF16PS
/// gives 0 for `2^-126 - 2^-150`, and keeps `2^-126` for `2^-126 - 2^-160`),
/// in both steps of a pair, either sign.
#[test]
fn tininess_is_detected_after_rounding_as_x86_does() {
    let min = f32::MIN_POSITIVE;
    let p = |e: i32| bf16::from_f32(2f32.powi(e));
    let n = |e: i32| bf16::from_f32(-(2f32.powi(e)));
    let z = bf16::ZERO;
    // (c0, a, b, expected): the pair's odd step, then its even one.
    let cases = [
        (min, [z, p(-75)], [z, n(-75)], 0.0),
        (min, [p(-75), z], [n(-75), z], 0.0),
        // -0 after the odd step; the even one's zero product makes it +0.
        (-min, [z, p(-75)], [z, p(-75)], 0.0),
        (-min, [p(-75), z], [p(-75), z], -0.0),
        (min, [z, p(-80)], [z, n(-80)], min),
        (-min, [p(-80), z], [p(-80), z], -min),
        // 2^-126 - 2^-151, the midpoint, rounds up to 2^-126: not tiny.
        (min, [p(-76), p(-75)], [n(-75), n(-76)], min),
    ];
    for (c0, a, b, want) in cases {
        for k in [2, 3] {
            let (mut a, mut b) = (a.to_vec(), b.to_vec());
            a.resize(k, z);
            b.resize(k, z);
            let case = Case {
                a,
                b,
                m: 1,
                n: 1,
                k,
                o: dot(false, false, true),
            };
            let got = check(&case, &[c0]);
            // (K = 3 adds a zero pair after, which turns a -0 into +0.)
            if k == 2 {
                assert_eq!(got[0].to_bits(), f32::to_bits(want), "{c0:e} {:?}", case.a);
            }
        }
    }
    // Random sums there: starting sums within a few 2^-149 of 2^-126,
    // products of magnitudes 2^-70 .. 2^-82.
    let mut rng = Rng(0x7e1);
    for _ in 0..64 {
        let (m, n, k) = (3, 17, 6);
        let mut v = || {
            let s = if rng.below(2) == 0 { 0 } else { 0x8000 };
            bf16::from_bits(s | ((45 + rng.below(13) as u16) << 7) | rng.below(128) as u16)
        };
        let case = Case::new(m, n, k, dot(false, true, true), &mut v);
        let c0: Vec<f32> = (0..m * n)
            .map(|_| {
                let c = f32::from_bits(0x0080_0000 + rng.below(4) as u32);
                if rng.below(2) == 0 {
                    c
                } else {
                    -c
                }
            })
            .collect();
        check(&case, &c0);
    }
}

#[test]
fn within_the_chains_bound_of_the_f64_reference() {
    let mut rng = Rng(0xf64);
    let (m, n, k) = (37, 90, 700);
    let case = Case::new(m, n, k, dot(false, true, false), uniform(&mut rng));
    let got = check::<f32>(&case, &vec![0.0; m * n]);
    let worst = common::pair_dot::within_bound(&case, &got, 24);
    eprintln!("bf16 dot {m}x{n}x{k}: worst {worst:.3} of the bound");
}

#[test]
fn a_pair_dot_of_non_bf16_operands_is_refused_and_nothing_is_written() {
    let a = vec![1f32; 6];
    let b = vec![1f32; 6];
    let at = TensorRef::new(&a, &[2, 3]).unwrap();
    let bt = TensorRef::new(&b, &[3, 2]).unwrap();
    let o = dot(false, false, false);
    let cpu = Cpu::new(Threads::new(1));
    let exec = Exec::new(&cpu);
    let err = matmul_workspace_size(&exec, at, bt, DType::F32, &o).unwrap_err();
    assert!(err.to_string().contains("math"), "{err}");
    let mut c = vec![-7.25f32; 4];
    let mut ws = vec![0u8; 1 << 16];
    assert!(matmul(&exec, at, bt, &o, &mut c, &mut ws).is_err());
    assert!(c.iter().all(|&x| x == -7.25));
}
