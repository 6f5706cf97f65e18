//! EmbeddingDenseGrad with duplicate ids, padding, frequency scaling, a
//! vocab shard and accumulation, for every grad / index / output dtype,
//! checked bit for bit against the contract computed here (f32 sums in
//! position order, one rounding; the data are multiples of 1/8, so the sums
//! are exact) and hashed.

use npukern::{bf16, f16};
use npukern::{DType, Element, EmbeddingGradOptions, Exec, Float, IndexPolicy, UbConfig};

use crate::api::{self, El};
use crate::data::{same_bits, Rng};
use crate::hash::BitHash;
use crate::{name, Checker};

/// Positions, hidden size (a 1 KiB tile holds 256 f32: H is split), rows.
const N: usize = 24;
const H: usize = 300;
const VOCAB: usize = 12;

/// Runs every dtype combination.
pub fn run(c: &mut Checker<'_>) {
    case::<f32, i64, f32>(c, 1);
    case::<bf16, i32, bf16>(c, 2);
    case::<bf16, i64, f32>(c, 3);
    case::<f16, i32, f16>(c, 4);
    case::<f16, i64, f32>(c, 5);
}

fn dname(d: DType) -> &'static str {
    d.name()
}

/// The options of each run, and the rows it writes.
fn variants() -> [(&'static str, EmbeddingGradOptions, usize); 5] {
    let d = EmbeddingGradOptions::default();
    [
        ("plain", d, VOCAB),
        (
            "padding3",
            EmbeddingGradOptions {
                padding_idx: 3,
                ..d
            },
            VOCAB,
        ),
        (
            "scale_freq",
            EmbeddingGradOptions {
                scale_grad_by_freq: true,
                padding_idx: 0,
                ..d
            },
            VOCAB,
        ),
        (
            // Rows 4..10 of the table; other ids belong to other shards.
            "shard4of6",
            EmbeddingGradOptions {
                vocab_start: 4,
                out_of_range: IndexPolicy::Ignore,
                ..d
            },
            6,
        ),
        (
            "accumulate",
            EmbeddingGradOptions {
                accumulate: true,
                scale_grad_by_freq: true,
                ..d
            },
            VOCAB,
        ),
    ]
}

/// What the contract says row `r`, column `j` is.
fn expected<G: Float, O: Float>(
    grad: &[G],
    ids: &[i64],
    o: &EmbeddingGradOptions,
    (r, j): (usize, usize),
    old: O,
) -> O {
    let id = o.vocab_start + r as i64;
    let (mut sum, mut count) = (0f32, 0u32);
    if id != o.padding_idx {
        for (p, _) in ids.iter().enumerate().filter(|(_, &v)| v == id) {
            sum += grad[p * H + j].to_f32();
            count += 1;
        }
    }
    if o.scale_grad_by_freq && count > 0 {
        sum /= count as f32;
    }
    if o.accumulate {
        sum += old.to_f32();
    }
    O::from_f32(sum)
}

fn case<G: El, I: Element + TryFrom<i64>, O: El>(c: &mut Checker<'_>, seed: u64) {
    let exec = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 1024,
        blocks: 5,
    });
    let mut rng = Rng(seed);
    let mut grad = [G::from_f32(0.0); N * H];
    grad.iter_mut().for_each(|v| *v = rng.eighth());
    // Ids 0..12, a third of them id 5: duplicates everywhere.
    let mut ids = [0i64; N];
    ids.iter_mut().for_each(|v| {
        *v = if rng.below(3) == 0 {
            5
        } else {
            rng.below(VOCAB as u64) as i64
        }
    });
    let mut idx = [I::zeroed(); N];
    for (d, &s) in idx.iter_mut().zip(&ids) {
        match I::try_from(s) {
            Ok(v) => *d = v,
            Err(_) => return,
        }
    }
    let types = name!(
        "{}_{}_{}",
        dname(G::DTYPE),
        dname(I::DTYPE),
        dname(O::DTYPE)
    );
    for (vname, opts, rows) in variants() {
        let what = name!("embedding_dense_grad.{vname}.{}", types.as_str());
        let what = what.as_str();
        let mut out = [O::from_f32(0.0); VOCAB * H];
        out.iter_mut().for_each(|v| *v = rng.eighth());
        let old = out;
        let out = &mut out[..rows * H];
        if let Err(e) = api::embedding(&exec, (&grad, H), &idx, &opts, out) {
            c.check(what, false, format_args!("call failed: {e:?}"));
            continue;
        }
        let mut bad = None;
        for r in 0..rows {
            for j in 0..H {
                let want = expected(&grad, &ids, &opts, (r, j), old[r * H + j]);
                if bad.is_none() && !same_bits(&[out[r * H + j]], &[want]) {
                    bad = Some((r, j, want.to_f32()));
                }
            }
        }
        match bad {
            None => c.check(what, true, format_args!("")),
            Some((r, j, w)) => c.check(
                what,
                false,
                format_args!("[{r}, {j}] = {:e}, expected {w:e}", out[r * H + j].to_f32()),
            ),
        };
        c.hash(what, BitHash::of(out));
    }
}
