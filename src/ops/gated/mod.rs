//! What the gated-activation operators (SwiGLU, GeGLU) share: the gate's
//! activation (`Gate`: SiLU, GELU's tanh form, GELU's erf form), the
//! operand layout, and the CPU kernels written once over the activation
//! (`forward`, `backward`), so the two operators run one loop body.

pub(crate) mod backward;
pub(crate) mod forward;
pub(crate) mod grad_api;
#[cfg(feature = "capi")]
pub(crate) mod grad_capi;

use crate::dtype::Float;
use crate::lanes::math::{erf, exp, exp_scale, silu_finish, silu_reduce, tanh, ExpArg};
use crate::lanes::Lanes;
use crate::ops::elementwise::eager_round;

/// A gate's activation in two stages, so the line loop can start the next
/// pair's (`reduce`) while it finishes this one's (`value`, `grad`).
pub(crate) trait Gate {
    /// What `reduce` hands the second stage.
    type Arg<L: Lanes>: Copy;
    /// The first stage (of the gate `x`).
    fn reduce<L: Lanes>(x: L) -> Self::Arg<L>;
    /// `act(x)` from `reduce(x)`.
    fn value<L: Lanes>(x: L, arg: Self::Arg<L>) -> L;
    /// `(g * act'(x), act(x))` with `g` the gradient reaching `act(x)`;
    /// `eager` rounds `act(x)` to `T` as eager PyTorch's saved output is.
    fn grad<L: Lanes, T: Float>(x: L, arg: Self::Arg<L>, g: L, eager: bool) -> (L, L);
}

/// SiLU, `x / (1 + e^-x)` (SwiGLU's gate).
pub(crate) struct Silu;

impl Gate for Silu {
    type Arg<L: Lanes> = ExpArg<L>;

    #[inline(always)]
    fn reduce<L: Lanes>(x: L) -> ExpArg<L> {
        silu_reduce(x)
    }

    #[inline(always)]
    fn value<L: Lanes>(x: L, e: ExpArg<L>) -> L {
        silu_finish(x, e)
    }

    /// PyTorch's formulas: `silu = x / (1 + e)`, `s = 1 / (1 + e)` with
    /// `e = exp(-x)`, `g * s * (1 + x * (1 - s))`.
    #[inline(always)]
    fn grad<L: Lanes, T: Float>(x: L, e: ExpArg<L>, g: L, eager: bool) -> (L, L) {
        let one = L::splat(1.0);
        let den = one.add(exp_scale(e));
        let s = one.div(den);
        let silu = eager_round::<L, T>(x.div(den), eager);
        (g.mul(s).mul(one.add(x.mul(one.sub(s)))), silu)
    }
}

/// `sqrt(2 / pi)`, as PyTorch's `M_SQRT2 * M_2_SQRTPI * 0.5` rounded to f32.
const GELU_BETA: f32 = (core::f64::consts::SQRT_2 * core::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
/// The cubic term's weight in GELU's tanh form.
const GELU_KAPPA: f32 = 0.044_715;
/// `1 / sqrt(2)` (the erf form's argument scale).
const GELU_ALPHA: f32 = core::f32::consts::FRAC_1_SQRT_2;
/// `1 / sqrt(2 pi)`, as PyTorch's `M_2_SQRTPI * M_SQRT1_2 * 0.5`.
const GELU_PDF: f32 =
    (core::f64::consts::FRAC_2_SQRT_PI * core::f64::consts::FRAC_1_SQRT_2 * 0.5) as f32;

/// GELU's tanh form, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`
/// (Gemma's `gelu_pytorch_tanh`), in PyTorch's CPU kernel's operation
/// order; the first stage is the tanh's argument.
pub(crate) struct GeluTanh;

impl Gate for GeluTanh {
    type Arg<L: Lanes> = L;

    #[inline(always)]
    fn reduce<L: Lanes>(x: L) -> L {
        let cube = x.mul(x).mul(x);
        L::splat(GELU_BETA).mul(x.add(L::splat(GELU_KAPPA).mul(cube)))
    }

    #[inline(always)]
    fn value<L: Lanes>(x: L, inner: L) -> L {
        let half = L::splat(0.5);
        half.mul(x).mul(L::splat(1.0).add(tanh(inner)))
    }

    /// PyTorch's `GeluBackward` (tanh): `g * (0.5 (1 + t) + 0.5 x (1 - t^2)
    /// beta (1 + 3 kappa x^2))`, `t = tanh(inner)`. Like PyTorch's, it is
    /// NaN where x^2 overflows f32 (|x| > 1.8e19: `0 * Inf`).
    #[inline(always)]
    fn grad<L: Lanes, T: Float>(x: L, inner: L, g: L, eager: bool) -> (L, L) {
        let (one, half) = (L::splat(1.0), L::splat(0.5));
        let t = tanh(inner);
        let left = half.mul(x);
        let right = one.add(t);
        let act = eager_round::<L, T>(left.mul(right), eager);
        let d_left = half.mul(right);
        let d_tanh = one.sub(t.mul(t));
        let three_kappa = L::splat(3.0).mul(L::splat(GELU_KAPPA));
        let d_inner = L::splat(GELU_BETA).mul(one.add(three_kappa.mul(x.mul(x))));
        let d_right = left.mul(d_tanh).mul(d_inner);
        (g.mul(d_left.add(d_right)), act)
    }
}

/// GELU's exact form, `x * 0.5 * (1 + erf(x / sqrt 2))` (`approximate=
/// "none"`), in PyTorch's CPU kernel's operation order; the first stage is
/// the erf.
pub(crate) struct GeluErf;

impl Gate for GeluErf {
    type Arg<L: Lanes> = L;

    #[inline(always)]
    fn reduce<L: Lanes>(x: L) -> L {
        erf(x.mul(L::splat(GELU_ALPHA)))
    }

    #[inline(always)]
    fn value<L: Lanes>(x: L, e: L) -> L {
        x.mul(L::splat(0.5)).mul(L::splat(1.0).add(e))
    }

    /// PyTorch's `GeluBackward` (none): `g * (cdf + x * pdf)`, `cdf = 0.5
    /// (1 + erf(x / sqrt 2))`, `pdf = e^{-x^2/2} / sqrt(2 pi)`.
    #[inline(always)]
    fn grad<L: Lanes, T: Float>(x: L, e: L, g: L, eager: bool) -> (L, L) {
        let (one, half) = (L::splat(1.0), L::splat(0.5));
        let act = eager_round::<L, T>(Self::value(x, e), eager);
        let cdf = half.mul(one.add(e));
        let pdf = L::splat(GELU_PDF).mul(exp(x.mul(x).mul(L::splat(-0.5))));
        (g.mul(cdf.add(x.mul(pdf))), act)
    }
}

/// Where row `r` of the gate and the other operand start, in elements
/// from their bases.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Halves {
    /// Elements between the starts of two rows.
    pub stride: usize,
    /// Offset of the gate from its base.
    pub gate: usize,
    /// Offset of the other operand from its base.
    pub other: usize,
}

/// The layout of a call with row length `cols`: two tensors (`split`
/// false), or the two halves of one, the gate first when `gate_first`.
pub(crate) fn halves(split: bool, gate_first: bool, cols: usize) -> Halves {
    match (split, gate_first) {
        (false, _) => Halves {
            stride: cols,
            gate: 0,
            other: 0,
        },
        (true, true) => Halves {
            stride: 2 * cols,
            gate: 0,
            other: cols,
        },
        (true, false) => Halves {
            stride: 2 * cols,
            gate: cols,
            other: 0,
        },
    }
}
