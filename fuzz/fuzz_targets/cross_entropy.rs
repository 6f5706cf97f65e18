//! CrossEntropy (forward, backward, fused in place), differentially:
//! arbitrary shapes (wrong ones too), targets (out of range, ignored, a
//! wrong count), weights, options (invalid ones too), values (NaN, Inf,
//! subnormals), f32/f16/bf16 logits, i32/i64 targets, any tiling.
//!
//! Checked:
//! - every CPU run (each available ISA; two threads; another tiling) fails
//!   exactly when the Reference fails, with the same error, and then leaves
//!   the outputs (the in-place logits included) untouched;
//! - the outputs are bit-identical across ISAs, runners and tilings (NaN
//!   payloads aside);
//! - on values of ordinary magnitude, lse within 1e-5 of the Reference
//!   (relative to max(|lse|, 1));
//! - the host reduction never panics and validates as its factor does.
//!
//! Run: `cargo +nightly fuzz run cross_entropy`, or the stable recipe in
//! `scripts/fuzz_smoke.sh`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{assert_same, isas, some_values, Bytes};

/// Most logits.
const CAP: usize = 4096;

const POISON: f32 = -7.25;

struct Case<T, I> {
    x: Vec<T>,
    xd: Vec<usize>,
    tgt: Vec<I>,
    w: Option<Vec<f32>>,
    g: Vec<f32>,
    o: CrossEntropyOptions,
    mode: u8,
}

impl<T: Float, I: Element> Case<T, I> {
    fn targets(&self) -> Result<CrossEntropyTargets<'_, I>> {
        let t = CrossEntropyTargets::new(TensorRef::new(&self.tgt, &[self.tgt.len()])?);
        Ok(match &self.w {
            Some(w) => t.with_weight(TensorRef::new(w, &[w.len()])?),
            None => t,
        })
    }

    /// Runs on `exec`: the outcome, then (loss, lse) and the logits/dlogits.
    fn run(&self, exec: &Exec<'_>) -> (Result<()>, Vec<f32>, Vec<f32>, Vec<T>) {
        let n = self.xd.first().copied().unwrap_or(0);
        let k = if self.o.reduction == Reduction::None || self.mode != 0 {
            n
        } else {
            1
        };
        let mut loss = vec![POISON; k];
        let mut lse = vec![POISON; n];
        let mut dx = vec![T::from_f32(POISON); self.x.len()];
        let r = (|| -> Result<()> {
            let x = TensorRef::new(&self.x, &self.xd)?;
            let t = self.targets()?;
            match self.mode {
                0 => {
                    let mut ws = vec![0u8; cross_entropy_workspace_size(exec, x, t, &self.o)?];
                    cross_entropy(exec, x, t, &self.o, &mut loss, Some(&mut lse), &mut ws)
                }
                1 => {
                    let mut ws = vec![0u8; cross_entropy_grad_workspace_size(exec, x, t, &self.o)?];
                    let l: Vec<f32> = self.g.iter().map(|v| v * 3.0).take(n).collect();
                    cross_entropy_grad(exec, x, t, &l, &self.g, &self.o, &mut dx, &mut ws)
                }
                _ => {
                    // In place: dx holds the logits before anything can fail.
                    dx.copy_from_slice(&self.x);
                    let mut ws =
                        vec![0u8; cross_entropy_fused_workspace_size(exec, x, t, &self.o)?];
                    let xm = TensorMut::new(&mut dx, &self.xd)?;
                    cross_entropy_fused(
                        exec,
                        xm,
                        t,
                        &self.g,
                        &self.o,
                        &mut loss,
                        Some(&mut lse),
                        &mut ws,
                    )
                }
            }
        })();
        (r, loss, lse, dx)
    }
}

fn go<T: Float, I: Element + TryFrom<i64>>(b: &mut Bytes<'_>) {
    let rows = b.below(6);
    let small = b.bool();
    let cols = b.below(if small { 40 } else { CAP / rows.max(1) + 1 });
    let xd = if b.one_in(16) {
        vec![rows * cols]
    } else {
        vec![rows, cols]
    };
    let tame = b.bool();
    let x: Vec<T> = some_values(b, rows * cols, tame);
    let ignore = if b.bool() {
        -100
    } else {
        b.below(8) as i64 - 4
    };
    let nt = if b.one_in(16) { rows + 1 } else { rows };
    let tgt: Vec<I> = (0..nt)
        .map(|_| {
            let v = match b.below(8) {
                0 => ignore,
                1 => cols as i64 + b.below(3) as i64 - 1,
                2 => -(b.below(3) as i64),
                _ => b.below(cols.max(1)) as i64,
            };
            I::try_from(v)
                .ok()
                .unwrap_or_else(|| I::try_from(0).ok().unwrap())
        })
        .collect();
    let w = b.bool().then(|| {
        let nw = if b.one_in(16) { cols + 1 } else { cols };
        (0..nw).map(|_| b.u16() as f32 / 16384.0).collect()
    });
    let reduction = b.pick(&[Reduction::None, Reduction::Sum, Reduction::Mean]);
    let o = CrossEntropyOptions {
        reduction,
        ignore_index: ignore,
        label_smoothing: b.pick(&[0.0, 0.1, 1.0, 1.5]),
        lse_square_scale: b.pick(&[0.0, 1e-4, -0.5, f32::NAN]),
        softcap: b.pick(&[0.0, 30.0, 0.5, -1.0]),
    };
    let mode = b.below(3) as u8;
    let ng = if reduction == Reduction::None || (mode == 2 && b.bool()) {
        rows
    } else {
        1
    };
    let g = (0..ng).map(|i| 0.5 + i as f32 * 0.25).collect();
    let c = Case::<T, I> {
        x,
        xd,
        tgt,
        w,
        g,
        o,
        mode,
    };
    let (want, rl, rs, rd) = c.run(&Exec::reference());
    let mut first: Option<(Vec<f32>, Vec<f32>, Vec<T>)> = None;
    for isa in isas() {
        for threads in [1, 2] {
            let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
            let ub = UbConfig {
                ub_bytes: 1024 + b.below(4) * 4096,
                blocks: 1 + b.below(9) as u32,
            };
            let (r, l, s, d) = c.run(&Exec::new(&cpu).with_ub(ub));
            assert_eq!(r, want, "{isa:?} outcome");
            if r.is_err() {
                assert!(l.iter().chain(&s).all(|v| *v == POISON), "written on error");
                let untouched = if c.mode == 2 {
                    c.x.clone()
                } else {
                    vec![T::from_f32(POISON); c.x.len()]
                };
                assert_same(&d, &untouched, "dlogits on error");
                continue;
            }
            match &first {
                None => first = Some((l, s, d)),
                Some((l0, s0, d0)) => {
                    assert_same(&l, l0, "loss");
                    assert_same(&s, s0, "lse");
                    assert_same(&d, d0, "dlogits");
                }
            }
        }
    }
    if let (Some((_, s, _)), true) = (&first, tame) {
        for (g, w) in s.iter().zip(&rs) {
            if w.is_finite() {
                assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "lse {g} vs {w}");
            }
        }
    }
    let _ = (rl, rd);
    // The host reduction (`cross_entropy_reduce`, `_grad_scale`): never a
    // panic; both validate alike; a forward that reduced gives its bits.
    if let Ok(t) = c.targets() {
        let rows: Vec<f32> = (0..c.tgt.len()).map(|i| i as f32 * 0.5 - 1.0).collect();
        let r = cross_entropy_reduce(&rows, t, &c.o);
        let s = cross_entropy_grad_scale(t, 0.75, &c.o);
        assert_eq!(r.is_ok(), s.is_ok(), "reduce {r:?} vs grad_scale {s:?}");
        if let (Ok(v), Reduction::Sum) = (r, c.o.reduction) {
            let want: f64 = rows.iter().map(|&x| x as f64).sum();
            assert_eq!(v, want as f32);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    match b.below(4) {
        0 => go::<f32, i64>(&mut b),
        1 => go::<bf16, i64>(&mut b),
        2 => go::<f16, i32>(&mut b),
        _ => go::<bf16, i32>(&mut b),
    }
});
