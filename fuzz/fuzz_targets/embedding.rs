//! EmbeddingDenseGrad, differentially: arbitrary indices (i32/i64, the
//! integer extremes, shard edges, duplicates, one hot row), num_weights,
//! padding_idx, vocab_start, both out-of-range policies, scale_grad_by_freq,
//! accumulate, grad f32/f16/bf16 into grad's dtype or f32, any H.
//!
//! Checked:
//! - every CPU run (each available ISA; two threads; another tiling) fails
//!   exactly when the Reference fails, with the same error, and then leaves
//!   the table untouched;
//! - the table is bit-identical across ISAs, runners and tilings (NaN
//!   payloads aside);
//! - bit-exact where the contract says so: a row no position contributes to
//!   is +0.0 (its old bits when accumulating), a row with one occurrence (not
//!   accumulating) is the grad row converted exactly;
//! - on values of ordinary magnitude, within ulp_out + (count + 2) 2^-24 S of
//!   the Reference (S: the sum of |terms|, and |old|), as tests/embedding.rs.
//!
//! Run: `cargo +nightly fuzz run embedding`, or the stable recipe in
//! `scripts/fuzz_smoke.sh`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;
use npukern_fuzz::{
    assert_same, capped, dims, isas, same_outcome, some_values, ulp_at, workspace, Bytes,
};

/// Most grad elements.
const CAP: usize = 2048;

struct Case<G, I, O> {
    grad: Vec<G>,
    gd: Vec<usize>,
    idx: Vec<I>,
    id: Vec<usize>,
    h: usize,
    nw: usize,
    /// The table's length (num_weights * H, or a wrong length now and then).
    out_len: usize,
    old: Vec<O>,
    opts: EmbeddingGradOptions,
    tame: bool,
}

/// An index element built from an i64 (i32 truncates).
trait Index: Element {
    fn of(v: i64) -> Self;
    fn get(self) -> i64;
}

impl Index for i32 {
    fn of(v: i64) -> Self {
        v as i32
    }
    fn get(self) -> i64 {
        self as i64
    }
}

impl Index for i64 {
    fn of(v: i64) -> Self {
        v
    }
    fn get(self) -> i64 {
        self
    }
}

impl<G: Float, I: Index, O: Float> Case<G, I, O> {
    fn run(&self, exec: &Exec<'_>) -> (Result<()>, Vec<O>, bool) {
        let mut out = self.old.clone();
        capped();
        let r = (|| {
            let gt = TensorRef::new(&self.grad, &self.gd)?;
            let it = TensorRef::new(&self.idx, &self.id)?;
            let mut ws = workspace(embedding_dense_grad_workspace_size(
                exec, gt, it, self.nw, &self.opts,
            )?);
            embedding_dense_grad(exec, gt, it, self.nw, &self.opts, &mut out, &mut ws)
        })();
        (r, out, capped())
    }

    /// The table row position `p` adds to, if any.
    fn row(&self, p: usize) -> Option<usize> {
        let v = self.idx[p].get();
        if self.opts.padding_idx >= 0 && v == self.opts.padding_idx {
            return None;
        }
        let r = v.checked_sub(self.opts.vocab_start)?;
        (r >= 0 && (r as u64) < self.nw as u64).then_some(r as usize)
    }

    /// The contract's exact bits, and (tame) the tolerance against the reference.
    fn check(&self, got: &[O], want: &[O]) {
        let h = self.h;
        if h == 0 {
            return; // an empty table (num_weights may then be huge)
        }
        let positions = self.idx.len();
        let mut count = vec![0usize; self.nw];
        let mut first = vec![usize::MAX; self.nw];
        let mut s = vec![0f64; self.nw * h];
        for p in 0..positions {
            if let Some(r) = self.row(p) {
                count[r] += 1;
                if first[r] == usize::MAX {
                    first[r] = p;
                }
                for j in 0..h {
                    s[r * h + j] += self.grad[p * h + j].to_f64().abs();
                }
            }
        }
        for r in 0..self.nw {
            let (g, w) = (&got[r * h..(r + 1) * h], &want[r * h..(r + 1) * h]);
            if count[r] == 0 {
                let want_bits: Vec<O> = if self.opts.accumulate {
                    self.old[r * h..(r + 1) * h].to_vec()
                } else {
                    vec![O::from_f32(0.0); h]
                };
                assert_same(g, &want_bits, &format!("row {r}: no contribution"));
                continue;
            }
            if count[r] == 1 && !self.opts.accumulate {
                let p = first[r];
                let copy: Vec<O> = (0..h)
                    .map(|j| O::from_f32(self.grad[p * h + j].to_f32()))
                    .collect();
                assert_same(g, &copy, &format!("row {r}: one occurrence"));
                continue;
            }
            if !self.tame {
                continue;
            }
            for j in 0..h {
                let (a, e) = (g[j].to_f64(), w[j].to_f64());
                if a == e {
                    continue;
                }
                let mut sc = s[r * h + j];
                if self.opts.scale_grad_by_freq {
                    sc /= count[r] as f64;
                }
                if self.opts.accumulate {
                    sc += self.old[r * h + j].to_f64().abs();
                }
                let tol = ulp_at::<O>(e) + (count[r] + 2) as f64 * 2f64.powi(-24) * sc;
                assert!(
                    (a - e).abs() <= tol,
                    "row {r} col {j}: {a:e} vs reference {e:e} (tol {tol:e})"
                );
            }
        }
    }
}

fn ub_of(b: &mut Bytes<'_>) -> UbConfig {
    UbConfig {
        ub_bytes: match b.u8() % 4 {
            0 => 1024,
            1 => 1024 + b.below(8192),
            _ => 1024 << b.below(9),
        },
        blocks: match b.u8() % 3 {
            0 => 1,
            1 => 1 + b.below(70) as u32,
            _ => 64,
        },
    }
}

fn check<G: Float, I: Index, O: Float>(b: &mut Bytes<'_>) {
    let rank = 1 + b.below(3);
    let id = dims(b, rank, 512);
    let positions: usize = id.iter().product();
    let h = dims(b, 1, 64)[0].min(CAP / positions.max(1));
    let mut gd = id.clone();
    gd.push(h);
    let nw = match b.u8() % 16 {
        0 => 0,
        1 => b.u64() as usize, // huge: only its validation runs
        _ => 1 + b.below(40),
    };
    let vocab_start = match b.u8() % 8 {
        0 => b.u64() as i64,
        1 => b.below(1000) as i64,
        _ => 0,
    };
    let hot = if b.one_in(4) {
        Some(b.index(nw.min(1 << 40) as i64, vocab_start))
    } else {
        None
    };
    let idx: Vec<I> = (0..positions)
        .map(|_| match hot {
            Some(v) if !b.one_in(8) => I::of(v),
            _ => I::of(b.index(nw.min(1 << 40) as i64, vocab_start)),
        })
        .collect();
    let tame = b.bool();
    let grad = some_values::<G>(b, positions * h, tame);
    let opts = EmbeddingGradOptions {
        padding_idx: if b.bool() {
            -1
        } else {
            b.index(nw.min(1 << 40) as i64, vocab_start)
        },
        scale_grad_by_freq: b.bool(),
        vocab_start,
        out_of_range: if b.bool() {
            IndexPolicy::Error
        } else {
            IndexPolicy::Ignore
        },
        accumulate: b.bool(),
    };
    // The table: [nw, H] when that is small, else a short (wrong) one.
    let full = nw.checked_mul(h).filter(|&n| n <= 64 * 64);
    let out_len = match full {
        Some(n) if !b.one_in(32) => n,
        _ => b.below(16),
    };
    let old = some_values::<O>(b, out_len, tame);
    let c = Case::<G, I, O> {
        grad,
        gd,
        idx,
        id,
        h,
        nw,
        out_len,
        old,
        opts,
        tame,
    };

    let (want_r, want, want_cap) = c.run(&Exec::reference());
    if want_r.is_err() {
        assert_same(&want, &c.old, "reference wrote on error");
    }
    let ub = ub_of(b);
    let mut first: Option<Vec<O>> = None;
    for isa in isas() {
        let cpu = Cpu::new(Serial).with_isa(isa);
        let (r, got, cap) = c.run(&Exec::new(&cpu).with_ub(ub));
        assert!(
            same_outcome(&r, cap, &want_r, want_cap),
            "{isa:?}: {r:?} differs from the reference's {want_r:?}"
        );
        if r.is_err() {
            assert_same(&got, &c.old, "the table changed on error");
            continue;
        }
        match &first {
            None => {
                assert_eq!(c.out_len, c.nw * c.h);
                if want_r.is_ok() {
                    c.check(&got, &want);
                }
                first = Some(got);
            }
            Some(f) => assert_same(&got, f, &format!("{isa:?} vs the first ISA")),
        }
    }
    let Some(first) = first else { return };
    if b.one_in(3) {
        let threads = Cpu::new(Threads::new(2));
        let (r, got, cap) = c.run(&Exec::new(&threads).with_ub(ub));
        assert!(
            same_outcome(&r, cap, &want_r, want_cap),
            "threads: {r:?} vs {want_r:?}"
        );
        if r.is_ok() {
            assert_same(&got, &first, "threads vs serial");
        }
    }
    let (r, got, cap) = c.run(&Exec::new(&CPU_SERIAL).with_ub(ub_of(b)));
    assert!(
        same_outcome(&r, cap, &want_r, want_cap),
        "tiling 2: {r:?} vs {want_r:?}"
    );
    if r.is_ok() {
        assert_same(&got, &first, "another tiling");
    }
}

fn with_index<G: Float, O: Float>(b: &mut Bytes<'_>) {
    if b.bool() {
        check::<G, i32, O>(b)
    } else {
        check::<G, i64, O>(b)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    match (b.u8() % 3, b.bool()) {
        (0, _) => with_index::<f32, f32>(&mut b),
        (1, false) => with_index::<f16, f16>(&mut b),
        (1, true) => with_index::<f16, f32>(&mut b),
        (_, false) => with_index::<bf16, bf16>(&mut b),
        (_, true) => with_index::<bf16, f32>(&mut b),
    }
});
