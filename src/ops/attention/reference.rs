//! Attention's f64 golden model: every score, exponential, sum and product
//! in f64, each output rounded once. The backward recomputes the
//! probabilities in f64 from q and k (not from the saved stats) and takes
//! `D = sum_d dout out` from the given `out`, as the kernel does (and as
//! FlashAttention's backward does with its saved output).

use super::*;
use crate::lanes::math::exp_f64;
use crate::ops::elementwise::dispatch_t;

/// The f64 golden model.
///
/// # Safety
/// As for `cpu`.
pub(crate) unsafe fn reference(call: &AttentionCall) {
    // SAFETY: forwarded.
    unsafe { dispatch_t!(call.q.dtype, reference_t(call)) }
}

/// Output elements summed at once (a stack array: no allocation).
const CHUNK: usize = 64;

/// Rows (of a KV head's group) whose stats the key gradients keep on the
/// stack: 12 KiB.
const ROWS_CACHED: usize = 512;

/// One row's view of the call, in f64.
struct Model<'a, T> {
    c: &'a AttentionCall,
    hq: usize,
    hkv: usize,
    sq: usize,
    skv: usize,
    d: usize,
    scale: f64,
    _t: core::marker::PhantomData<T>,
}

impl<T: Float> Model<'_, T> {
    /// Flat index of `(b, h, s, x)` in a tensor of `heads` heads of `seq`.
    fn at(&self, heads: usize, seq: usize, b: usize, h: usize, s: usize, x: usize) -> usize {
        let r = if self.c.layout == AttentionLayout::Bsnd as u32 {
            (b * seq + s) * heads + h
        } else {
            (b * heads + h) * seq + s
        };
        r * self.d + x
    }

    /// Element `i` of a T tensor.
    fn rd(&self, t: &RawTensor, i: usize) -> f64 {
        // SAFETY: validated shapes; the reference runs alone.
        unsafe { (*(t.data as *const T).add(i)).to_f64() }
    }

    /// q-like element.
    fn qx(&self, t: &RawTensor, b: usize, h: usize, i: usize, x: usize) -> f64 {
        self.rd(t, self.at(self.hq, self.sq, b, h, i, x))
    }

    /// k-like element.
    fn kx(&self, t: &RawTensor, b: usize, h: usize, j: usize, x: usize) -> f64 {
        self.rd(t, self.at(self.hkv, self.skv, b, h, j, x))
    }

    /// Keys row `i` sees.
    fn seen(&self, i: usize) -> usize {
        if self.c.causal != 0 {
            (i + 1).min(self.skv)
        } else {
            self.skv
        }
    }

    /// `scale q_i . k_j`.
    fn score(&self, b: usize, h: usize, hk: usize, i: usize, j: usize) -> f64 {
        let mut acc = 0.0;
        for x in 0..self.d {
            acc += self.qx(&self.c.q, b, h, i, x) * self.kx(&self.c.k, b, hk, j, x);
        }
        self.scale * acc
    }

    /// Row i's max (NaN never wins, at least -f32::MAX) and sum.
    fn stats(&self, b: usize, h: usize, hk: usize, i: usize) -> (f64, f64) {
        let n = self.seen(i);
        let mut m = -(f32::MAX as f64);
        for j in 0..n {
            let s = self.score(b, h, hk, i, j);
            if m < s {
                m = s;
            }
        }
        let l = (0..n)
            .map(|j| exp_f64(self.score(b, h, hk, i, j) - m))
            .sum();
        (m, l)
    }

    /// `P_ij` and `dS_ij` of row i (stats `(m, l)`, `D` = `dd`).
    #[allow(clippy::too_many_arguments)]
    fn grads(
        &self,
        b: usize,
        h: usize,
        hk: usize,
        i: usize,
        j: usize,
        ml: (f64, f64),
        dd: f64,
    ) -> (f64, f64) {
        let p = exp_f64(self.score(b, h, hk, i, j) - ml.0) / ml.1;
        let mut dp = 0.0;
        for x in 0..self.d {
            dp += self.qx(&self.c.dout, b, h, i, x) * self.kx(&self.c.v, b, hk, j, x);
        }
        (p, p * (dp - dd))
    }

    /// Row i's max, sum and `D` (the key gradients' per-row terms).
    fn row_terms(&self, b: usize, h: usize, hk: usize, i: usize) -> (f64, f64, f64) {
        let (m, l) = self.stats(b, h, hk, i);
        (m, l, self.dsum(b, h, i))
    }

    /// `D_i = dout_i . out_i`.
    fn dsum(&self, b: usize, h: usize, i: usize) -> f64 {
        (0..self.d)
            .map(|x| self.qx(&self.c.dout, b, h, i, x) * self.qx(&self.c.out, b, h, i, x))
            .sum()
    }
}

/// Writes `v` to element `i` of a T tensor.
fn wr<T: Float>(t: &RawTensor, i: usize, v: f64) {
    // SAFETY: validated shapes; the reference runs alone.
    unsafe { *(t.data as *mut T).add(i) = T::from_f64(v) }
}

unsafe fn reference_t<T: Float>(c: &AttentionCall) {
    let t = &c.tiling;
    let md = Model::<T> {
        c,
        hq: t.heads_q as usize,
        hkv: t.heads_kv as usize,
        sq: t.seq_q as usize,
        skv: t.seq_kv as usize,
        d: t.head_dim as usize,
        scale: c.scale as f64,
        _t: core::marker::PhantomData,
    };
    let (bs, d) = (t.batch as usize, md.d);
    let group = md.hq / md.hkv.max(1);
    for b in 0..bs {
        for h in 0..md.hq {
            let hk = h / group;
            for i in 0..md.sq {
                let ml = md.stats(b, h, hk, i);
                let n = md.seen(i);
                let dd = if c.backward != 0 {
                    md.dsum(b, h, i)
                } else {
                    0.0
                };
                for x0 in (0..d).step_by(CHUNK) {
                    let w = CHUNK.min(d - x0);
                    let mut acc = [0f64; CHUNK];
                    for j in 0..n {
                        let (wgt, src) = if c.backward != 0 {
                            (md.grads(b, h, hk, i, j, ml, dd).1, &c.k)
                        } else {
                            (exp_f64(md.score(b, h, hk, i, j) - ml.0), &c.v)
                        };
                        for (x, a) in acc.iter_mut().enumerate().take(w) {
                            *a += wgt * md.kx(src, b, hk, j, x0 + x);
                        }
                    }
                    for (x, a) in acc.iter().enumerate().take(w) {
                        let at = md.at(md.hq, md.sq, b, h, i, x0 + x);
                        if c.backward != 0 {
                            wr::<T>(&c.dq, at, md.scale * a);
                        } else {
                            wr::<T>(&c.out, at, a / ml.1);
                        }
                    }
                }
                if c.backward == 0 {
                    let stat = (b * md.hq + h) * md.sq + i;
                    // SAFETY: stat < B Hq Sq; the stats are f32.
                    unsafe {
                        *(c.softmax_max.data as *mut f32).add(stat) = ml.0 as f32;
                        *(c.softmax_sum.data as *mut f32).add(stat) = ml.1 as f32;
                    }
                }
            }
        }
    }
    if c.backward == 0 {
        return;
    }
    // dk and dv: each element's sum over the group's heads and the rows
    // that see its key. Each row's stats and D are computed once per
    // (batch, KV head) for the first ROWS_CACHED rows of the group: they
    // were recomputed for every key, `B Hq Sq Skv^2 D` work (a row of
    // 3838 keys took 5 s). The same functions give the same values: the
    // same bits.
    let mut cache = [(0f64, 0f64, 0f64); ROWS_CACHED];
    for b in 0..bs {
        for hk in 0..md.hkv {
            for (r, e) in cache.iter_mut().enumerate().take(group * md.sq) {
                *e = md.row_terms(b, hk * group + r / md.sq, hk, r % md.sq);
            }
            for j in 0..md.skv {
                for x0 in (0..d).step_by(CHUNK) {
                    let w = CHUNK.min(d - x0);
                    let (mut ak, mut av) = ([0f64; CHUNK], [0f64; CHUNK]);
                    for h in hk * group..(hk + 1) * group {
                        for i in 0..md.sq {
                            if j >= md.seen(i) {
                                continue;
                            }
                            let r = (h - hk * group) * md.sq + i;
                            let (m, l, dd) = match cache.get(r) {
                                Some(&e) => e,
                                None => md.row_terms(b, h, hk, i),
                            };
                            let (p, ds) = md.grads(b, h, hk, i, j, (m, l), dd);
                            for x in 0..w {
                                ak[x] += ds * md.qx(&c.q, b, h, i, x0 + x);
                                av[x] += p * md.qx(&c.dout, b, h, i, x0 + x);
                            }
                        }
                    }
                    for x in 0..w {
                        let at = md.at(md.hkv, md.skv, b, hk, j, x0 + x);
                        wr::<T>(&c.dk, at, md.scale * ak[x]);
                        wr::<T>(&c.dv, at, av[x]);
                    }
                }
            }
        }
    }
}
