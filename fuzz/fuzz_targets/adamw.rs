//! npk_adamw / npk_adamw_workspace_size through the C ABI with arbitrary
//! lists (any count, wrong counts, mixed or integer dtypes, mismatched
//! lengths, empty tensors, a grad aliasing its param), any options (NaN,
//! Inf, negative, out-of-range betas and steps, unknown flags), any values
//! and any block count.
//!
//! Checked:
//! - the size call and the run call agree on validation failures;
//! - an error, or a skipped step (`stepped == 0`), changes no byte of any
//!   tensor; gradients are never written;
//! - a step that ran is bit-identical across ISAs (NaN payloads aside) for
//!   one block count, and so is its report;
//! - a step is skipped exactly when found_inf says so or the clip's norm is
//!   not finite.
//!
//! Run: `cargo +nightly fuzz run adamw`, or `scripts/fuzz_smoke.sh adamw`.
#![no_main]

use core::ffi::c_void;
use libfuzzer_sys::fuzz_target;
use npukern::{bf16, f16, DType, RawTensor};
use npukern_fuzz::{dims, isas, some_values, Bytes};

// ---- the C ABI, declared from include/npukern.h ----

#[repr(C)]
#[derive(Clone, Copy)]
struct Array {
    tensors: *const RawTensor,
    count: usize,
}

#[repr(C)]
struct Tensors([Array; LISTS]);

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Options {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
    max_grad_norm: f64,
    grad_scale: f32,
    found_inf: f32,
    flags: u32,
    clip_coef: f32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Report {
    grad_norm: f64,
    stepped: u32,
}

#[repr(C)]
struct Exec {
    ub_bytes: u64,
    blocks: u32,
    isa: u32,
    backend: u32,
    parallel_for: *const c_void,
    runner_ctx: *mut c_void,
    foreign: *const c_void,
    detail: *mut c_void,
}

extern "C" {
    fn npk_adamw_workspace_size(
        t: *const Tensors,
        o: *const Options,
        e: *const Exec,
        ws: *mut usize,
    ) -> i32;
    fn npk_adamw(
        t: *const Tensors,
        o: *const Options,
        r: *mut Report,
        w: *mut c_void,
        wb: usize,
        e: *const Exec,
    ) -> i32;
}

const LISTS: usize = 6;
/// The params', grads' and max_exp_avg_sqs' slots.
const P: usize = 0;
const G: usize = 1;
const X: usize = 4;
const CLIP: u32 = 8;
const FOUND_INF: u32 = 32;
/// Most elements of one list.
const CAP: usize = 3000;

/// One tensor: its bytes and its dtype code.
#[derive(Clone)]
struct Buf {
    bytes: Vec<u8>,
    dtype: u32,
    dims: Vec<usize>,
}

fn buf(b: &mut Bytes<'_>, dtype: u32, dims: Vec<usize>, tame: bool) -> Buf {
    let n: usize = dims.iter().product();
    let bytes = match dtype {
        1 => bytemuck::cast_slice(&some_values::<f16>(b, n, tame)).to_vec(),
        2 => bytemuck::cast_slice(&some_values::<bf16>(b, n, tame)).to_vec(),
        0 => bytemuck::cast_slice(&some_values::<f32>(b, n, tame)).to_vec(),
        3 => vec![0u8; n * 4],
        _ => vec![0u8; n * 8],
    };
    Buf { bytes, dtype, dims }
}

/// Equal bytes, any NaN matching any NaN.
fn same(a: &Buf, c: &Buf) -> bool {
    let nan16 = |h: u16, bf: bool| {
        if bf {
            h & 0x7f80 == 0x7f80 && h & 0x7f != 0
        } else {
            h & 0x7c00 == 0x7c00 && h & 0x3ff != 0
        }
    };
    match a.dtype {
        0 => a.bytes.chunks(4).zip(c.bytes.chunks(4)).all(|(x, y)| {
            let (x, y) = (
                f32::from_le_bytes(x.try_into().unwrap()),
                f32::from_le_bytes(y.try_into().unwrap()),
            );
            x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan()
        }),
        1 | 2 => a.bytes.chunks(2).zip(c.bytes.chunks(2)).all(|(x, y)| {
            let (x, y) = (
                u16::from_le_bytes([x[0], x[1]]),
                u16::from_le_bytes([y[0], y[1]]),
            );
            x == y || nan16(x, a.dtype == 2) && nan16(y, a.dtype == 2)
        }),
        _ => a.bytes == c.bytes,
    }
}

/// The six lists: params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
/// masters.
#[derive(Clone)]
struct Case {
    lists: [Vec<Buf>; LISTS],
    /// grads[i] points at params[i] (an overlap the call must refuse).
    alias: Option<usize>,
}

fn case(b: &mut Bytes<'_>, o: &Options) -> Case {
    let n = b.below(5);
    let tame = b.bool();
    let ams = o.flags & 1 != 0;
    let pd = b.below(3) as u32;
    let gd = if b.one_in(3) { b.below(3) as u32 } else { pd };
    let md = if b.bool() { 0 } else { pd };
    let masters = b.bool();
    let mut left = CAP;
    let shapes: Vec<Vec<usize>> = (0..n)
        .map(|_| {
            let rank = 1 + b.below(2);
            let d = dims(b, rank, left);
            left -= d.iter().product::<usize>().min(left);
            d
        })
        .collect();
    let mut lists: [Vec<Buf>; LISTS] = Default::default();
    for (l, list) in lists.iter_mut().enumerate() {
        let on = match l {
            X => ams,
            5 => masters,
            _ => true,
        };
        // Now and then the wrong count.
        let count = match (on, b.one_in(16)) {
            (_, true) => b.below(6),
            (true, false) => n,
            (false, false) => 0,
        };
        for i in 0..count {
            let mut d = shapes.get(i).cloned().unwrap_or_else(|| vec![3]);
            if b.one_in(32) {
                d = vec![d.iter().product::<usize>() + 1];
            }
            let mut dt = [pd, gd, md, md, md, 0][l];
            if b.one_in(32) {
                dt = b.below(5) as u32; // mixed, or an integer tensor
            }
            let tame_here = tame || l != G;
            let mut t = buf(b, dt, d, tame_here);
            if l == 3 || l == X {
                // Second moments: magnitudes (a negative one is the caller's
                // business, but rarely).
                if !b.one_in(16) {
                    t = abs(t);
                }
            }
            list.push(t);
        }
    }
    let alias = (n > 0 && b.one_in(16)).then(|| b.below(n));
    Case { lists, alias }
}

/// Clears every element's sign bit (floats only).
fn abs(mut t: Buf) -> Buf {
    match t.dtype {
        0 => t.bytes.chunks_mut(4).for_each(|c| c[3] &= 0x7f),
        1 | 2 => t.bytes.chunks_mut(2).for_each(|c| c[1] &= 0x7f),
        _ => {}
    }
    t
}

fn options(b: &mut Bytes<'_>) -> Options {
    let wild = b.one_in(4);
    let flags = if b.one_in(16) {
        b.u32()
    } else {
        b.u8() as u32 & 127 & !(if b.bool() { 64 } else { 8 })
    };
    let r = |b: &mut Bytes<'_>| b.u16() as f64 / 65536.0;
    // Ordinary values, or (wild) anything b.f32() makes.
    let f = |b: &mut Bytes<'_>, tame: f64| if wild { f64::from(b.f32()) } else { tame };
    let (lr, wd) = (r(b) * 1e-2, r(b) * 0.1);
    Options {
        lr: f(b, lr),
        beta1: f(b, 0.9),
        beta2: f(b, 0.999),
        eps: f(b, 1e-8),
        weight_decay: f(b, wd),
        step: match b.u8() % 8 {
            0 => 0,
            1 => (1 << 53) + b.below(2) as u64,
            _ => 1 + b.below(1000) as u64,
        },
        max_grad_norm: if b.bool() {
            r(b) * 4.0
        } else {
            f64::from(b.f32())
        },
        grad_scale: if b.bool() { 1024.0 } else { b.f32() },
        found_inf: if b.one_in(3) { b.f32() } else { 0.0 },
        flags,
        clip_coef: if b.bool() { r(b) as f32 } else { b.f32() },
    }
}

/// The lists' descriptors, pointing into `c`'s buffers.
fn descriptors(c: &mut Case) -> [Vec<RawTensor>; LISTS] {
    let alias = c
        .alias
        .and_then(|i| c.lists[P].get_mut(i))
        .map(|t| t.bytes.as_mut_ptr());
    let mut out: [Vec<RawTensor>; LISTS] = Default::default();
    for (l, list) in c.lists.iter_mut().enumerate() {
        for (i, t) in list.iter_mut().enumerate() {
            let mut shape = [0i64; 8];
            for (k, &d) in t.dims.iter().enumerate() {
                shape[k] = d as i64;
            }
            out[l].push(RawTensor {
                data: match (l, alias) {
                    (G, Some(a)) if c.alias == Some(i) => a.cast(),
                    _ => t.bytes.as_mut_ptr().cast(),
                },
                dtype: [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64]
                    [t.dtype as usize],
                ndim: t.dims.len() as u32,
                shape,
            });
        }
    }
    out
}

/// Runs the step on a copy of `c` on `isa`; the statuses of the size and
/// run calls, the report and the tensors after.
fn run(c: &Case, o: &Options, isa: u32, blocks: u32, short: bool) -> (i32, i32, Report, Case) {
    let mut c = c.clone();
    let d = descriptors(&mut c);
    let t = Tensors(core::array::from_fn(|l| Array {
        tensors: if d[l].is_empty() {
            core::ptr::null()
        } else {
            d[l].as_ptr()
        },
        count: d[l].len(),
    }));
    let e = Exec {
        ub_bytes: 0,
        blocks,
        isa,
        backend: 0,
        parallel_for: core::ptr::null(),
        runner_ctx: core::ptr::null_mut(),
        foreign: core::ptr::null(),
        detail: core::ptr::null_mut(),
    };
    let mut ws = 0usize;
    // SAFETY: every pointer is valid; descriptors describe live buffers
    // (an over-long shape is refused before any data is read).
    let s = unsafe { npk_adamw_workspace_size(&t, o, &e, &mut ws) };
    let bytes = if s == 0 { ws } else { 1 << 12 };
    let bytes = if short {
        bytes.saturating_sub(1)
    } else {
        bytes
    };
    let mut w = vec![0u8; bytes.min(64 << 20)];
    let mut r = Report {
        grad_norm: -1.0,
        stepped: 9,
    };
    // SAFETY: as above; the workspace holds `w.len()` bytes.
    let s2 = unsafe { npk_adamw(&t, o, &mut r, w.as_mut_ptr().cast(), w.len(), &e) };
    drop(d);
    (s, s2, r, c)
}

fn unchanged(a: &Case, c: &Case) -> bool {
    a.lists
        .iter()
        .zip(&c.lists)
        .all(|(x, y)| x.iter().zip(y).all(|(p, q)| p.bytes == q.bytes))
}

fn go(b: &mut Bytes<'_>) {
    let o = options(b);
    let c = case(b, &o);
    let blocks = [0, 1, 3, 64][b.below(4)];
    let short = b.one_in(8);
    let mut first: Option<(Report, Case)> = None;
    for isa in isas() {
        let (s, s2, r, after) = run(&c, &o, isa as u32, blocks, short);
        if s != 0 {
            assert_eq!(s, s2, "the size call refused ({s}), the run call said {s2}");
        }
        if s2 != 0 {
            assert!(unchanged(&c, &after), "an error ({s2}) changed a tensor");
            continue;
        }
        assert!(
            c.lists[G]
                .iter()
                .zip(&after.lists[G])
                .all(|(x, y)| x.bytes == y.bytes),
            "a gradient was written"
        );
        let skip = o.flags & FOUND_INF != 0 && o.found_inf != 0.0
            // A norm past f32's range skips too: it reads inf as a float32 norm.
            || o.flags & CLIP != 0 && !(r.grad_norm as f32).is_finite();
        assert_eq!(r.stepped, u32::from(!skip), "{r:?} under {o:?}");
        if r.stepped == 0 {
            assert!(unchanged(&c, &after), "a skipped step changed a tensor");
        }
        match &first {
            None => first = Some((r, after)),
            Some((r0, a0)) => {
                let nan_same =
                    |x: f64, y: f64| x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan();
                assert!(
                    nan_same(r.grad_norm, r0.grad_norm) && r.stepped == r0.stepped,
                    "reports differ across ISAs: {r:?} vs {r0:?}"
                );
                for (l, (x, y)) in after.lists.iter().zip(&a0.lists).enumerate() {
                    for (i, (p, q)) in x.iter().zip(y).enumerate() {
                        assert!(same(p, q), "list {l} tensor {i} differs across ISAs");
                    }
                }
            }
        }
    }
}

fuzz_target!(|data: &[u8]| go(&mut Bytes(data)));
