//! EmbeddingDenseGrad against an exact f64 oracle (computed here, independent
//! of the crate) and against the crate's `Reference` backend.
//!
//! Tolerance, for every element of a row with `count` contributions:
//!   |out - exact| <= ulp_out(exact) + (count + 2) * 2^-24 * S
//! where `exact` is the f64 value of `old + sum / count` (scale and old only
//! when enabled), `ulp_out` is the output dtype's ulp at |exact| (one full
//! ulp: half for the final rounding, half for a binade change of the
//! computed sum), and `S` the same expression over absolute values. The
//! second term is the first-order bound of a sequential f32 sum of `count`
//! terms (k = count + 2: the division and the old-value addition add one
//! rounding each). Rows nothing contributed to must be exactly +0.0, or the
//! old bits when accumulating; a single occurrence copies the row exactly.
//! The `Reference` backend must be within half an output ulp (plus f64 noise).
//!
//! Measured errors are printed: `cargo test --release --test embedding -- --nocapture`.

use half::{bf16, f16};
use npukern::*;

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * self.unit()
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    fn vec<T: Float>(&mut self, n: usize, a: f64, b: f64) -> Vec<T> {
        (0..n).map(|_| T::from_f64(self.uniform(a, b))).collect()
    }
}

fn bits<T: Element>(x: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(x).to_vec()
}

/// The output dtype's ulp at |x| (subnormal floor included).
fn ulp(d: DType, x: f64) -> f64 {
    let (p, emin) = match d {
        DType::F32 => (24, -126),
        DType::F16 => (11, -14),
        DType::BF16 => (8, -126),
        _ => unreachable!(),
    };
    let e = if x == 0.0 {
        emin
    } else {
        (x.abs().log2().floor() as i32).max(emin)
    };
    2f64.powi(e - (p - 1))
}

/// Sizes the workspace and runs one call.
#[allow(clippy::too_many_arguments)]
fn run<G: Float, I: Element, O: Float>(
    exec: &Exec<'_>,
    grad: &[G],
    gdims: &[usize],
    idx: &[I],
    idims: &[usize],
    v: usize,
    opts: &EmbeddingGradOptions,
    out: &mut [O],
) -> Result<()> {
    let g = TensorRef::new(grad, gdims).unwrap();
    let i = TensorRef::new(idx, idims).unwrap();
    let bytes = embedding_dense_grad_workspace_size(exec, g, i, v, opts)?;
    let mut ws = vec![0xa5u8; bytes];
    embedding_dense_grad(exec, g, i, v, opts, out, &mut ws)
}

/// The exact f64 result and its error scale, per element.
struct Exact {
    h: usize,
    val: Vec<f64>,
    abs: Vec<f64>,
    count: Vec<usize>,
}

fn exact<G: Float, O: Float>(
    grad: &[G],
    h: usize,
    idx: &[i64],
    v: usize,
    opts: &EmbeddingGradOptions,
    old: &[O],
) -> Exact {
    let mut val = vec![0f64; v * h];
    let mut abs = vec![0f64; v * h];
    let mut count = vec![0usize; v];
    for (p, &x) in idx.iter().enumerate() {
        if opts.padding_idx >= 0 && x == opts.padding_idx {
            continue;
        }
        let r = x as i128 - opts.vocab_start as i128;
        if r < 0 || r >= v as i128 {
            continue;
        }
        let r = r as usize;
        count[r] += 1;
        for j in 0..h {
            let t = grad[p * h + j].to_f64();
            val[r * h + j] += t;
            abs[r * h + j] += t.abs();
        }
    }
    for (r, &c) in count.iter().enumerate() {
        for j in 0..h {
            let k = r * h + j;
            if opts.scale_grad_by_freq && c > 0 {
                val[k] /= c as f64;
                abs[k] /= c as f64;
            }
            if opts.accumulate {
                val[k] += old[k].to_f64();
                abs[k] += old[k].to_f64().abs();
            }
        }
    }
    Exact { h, val, abs, count }
}

/// Measured error of one output: the largest |out - exact| in output ulps
/// of |exact| (large only where the terms cancel), in units of
/// `ulp_out(exact) + 2^-24 * S` (rounding plus one f32 addition's worth),
/// and as a fraction of the stated tolerance.
#[derive(Clone, Copy, Debug, Default)]
struct Measured {
    ulps: f64,
    units: f64,
    of_tol: f64,
}

impl Measured {
    fn max(self, o: Measured) -> Measured {
        Measured {
            ulps: self.ulps.max(o.ulps),
            units: self.units.max(o.units),
            of_tol: self.of_tol.max(o.of_tol),
        }
    }
}

fn check<O: Float>(
    out: &[O],
    ex: &Exact,
    old: &[O],
    opts: &EmbeddingGradOptions,
    what: &str,
) -> Measured {
    let h = ex.h;
    let mut m = Measured::default();
    for (r, &c) in ex.count.iter().enumerate() {
        let row = &out[r * h..(r + 1) * h];
        if c == 0 {
            let want = if opts.accumulate {
                bits(&old[r * h..(r + 1) * h])
            } else {
                vec![0u8; h * O::DTYPE.size_bytes()]
            };
            assert_eq!(bits(row), want, "{what}: untouched row {r}");
            continue;
        }
        for (j, o) in row.iter().enumerate() {
            let (e, s) = (ex.val[r * h + j], ex.abs[r * h + j]);
            let err = (o.to_f64() - e).abs();
            let tol = ulp(O::DTYPE, e) + (c + 2) as f64 * 2f64.powi(-24) * s;
            assert!(
                err <= tol,
                "{what}: row {r} col {j}: got {} want {e} (err {err:e}, tol {tol:e}, count {c})",
                o.to_f64()
            );
            m = m.max(Measured {
                ulps: err / ulp(O::DTYPE, e),
                units: err / (ulp(O::DTYPE, e) + 2f64.powi(-24) * s),
                of_tol: err / tol,
            });
        }
    }
    m
}

/// The `Reference` backend: within half an output ulp of the exact value
/// (plus the f64 sum's own error, far below).
fn check_reference<O: Float>(out: &[O], ex: &Exact, what: &str) {
    let h = ex.h;
    for (r, &c) in ex.count.iter().enumerate() {
        if c == 0 {
            continue;
        }
        for j in 0..h {
            let (e, s) = (ex.val[r * h + j], ex.abs[r * h + j]);
            let err = (out[r * h + j].to_f64() - e).abs();
            let tol = 0.5 * ulp(O::DTYPE, e) + (c + 2) as f64 * 2f64.powi(-53) * s;
            assert!(err <= tol, "{what}: reference row {r} col {j}");
        }
    }
}

fn default_exec() -> Exec<'static> {
    Exec::cpu()
}

/// Runs CPU and Reference on the same case and checks both; returns the
/// CPU's output and measured error.
#[allow(clippy::too_many_arguments)]
fn case<G: Float, I: Element + Into<i64>, O: Float>(
    exec: &Exec<'_>,
    grad: &[G],
    gdims: &[usize],
    idx: &[I],
    idims: &[usize],
    v: usize,
    opts: &EmbeddingGradOptions,
    old: &[O],
    what: &str,
) -> (Vec<O>, Measured) {
    let h = *gdims.last().unwrap();
    let wide: Vec<i64> = idx.iter().map(|&x| x.into()).collect();
    let ex = exact(grad, h, &wide, v, opts, old);
    let mut out = old.to_vec();
    run(exec, grad, gdims, idx, idims, v, opts, &mut out).unwrap();
    let m = check(&out, &ex, old, opts, what);
    let mut refo = old.to_vec();
    let rexec = Exec::new(&Reference).with_ub(exec.ub);
    run(&rexec, grad, gdims, idx, idims, v, opts, &mut refo).unwrap();
    check_reference(&refo, &ex, what);
    check(&refo, &ex, old, opts, what);
    (out, m)
}

fn poison<O: Float>(n: usize) -> Vec<O> {
    (0..n)
        .map(|i| O::from_f64(-1234.5 + i as f64 * 0.25))
        .collect()
}

#[test]
fn pytorch_duplicates() {
    // PyTorch's test_embedding_dense_grad indices.
    let idx: [i64; 8] = [0, 1, 1, 2, 3, 5, 7, 11];
    let (v, h) = (12, 5);
    let mut rng = Rng(1);
    let grad: Vec<f32> = rng.vec(8 * h, -1.0, 1.0);
    let opts = EmbeddingGradOptions::default();
    let (out, _) = case(
        &default_exec(),
        &grad,
        &[2, 4, h],
        &idx,
        &[2, 4],
        v,
        &opts,
        &poison::<f32>(v * h),
        "duplicates",
    );
    for j in 0..h {
        // One f32 addition, first term first.
        assert_eq!(
            out[h + j].to_bits(),
            (grad[h + j] + grad[2 * h + j]).to_bits()
        );
        assert_eq!(out[j].to_bits(), grad[j].to_bits());
        assert_eq!(out[11 * h + j].to_bits(), grad[7 * h + j].to_bits());
    }
    for r in [4, 6, 8, 9, 10] {
        assert!(out[r * h..(r + 1) * h].iter().all(|x| x.to_bits() == 0));
    }
    // The same with i32 indices and half-precision grads.
    let idx32: Vec<i32> = idx.iter().map(|&x| x as i32).collect();
    let gb: Vec<bf16> = rng.vec(8 * h, -1.0, 1.0);
    case(
        &default_exec(),
        &gb,
        &[2, 4, h],
        &idx32,
        &[2, 4],
        v,
        &opts,
        &poison::<bf16>(v * h),
        "duplicates bf16",
    );
    let gh: Vec<f16> = rng.vec(8 * h, -1.0, 1.0);
    case(
        &default_exec(),
        &gh,
        &[8, h],
        &idx32,
        &[8],
        v,
        &opts,
        &poison::<f32>(v * h),
        "duplicates f16->f32",
    );
}

#[test]
fn padding_idx_zero_and_negative() {
    let idx: [i64; 8] = [0, 2, 4, 5, 4, 3, 0, 9];
    let (v, h) = (10, 6);
    let mut rng = Rng(2);
    let grad: Vec<f32> = rng.vec(8 * h, -1.0, 1.0);
    let exec = default_exec();
    let opts = EmbeddingGradOptions {
        padding_idx: 0,
        ..Default::default()
    };
    let (out, _) = case(
        &exec,
        &grad,
        &[2, 4, h],
        &idx,
        &[2, 4],
        v,
        &opts,
        &poison::<f32>(v * h),
        "padding 0",
    );
    assert!(
        out[..h].iter().all(|x| x.to_bits() == 0),
        "padding row zero"
    );
    // Negative = no padding (aclnn); PyTorch's -2 would mean row 8 here,
    // which the caller normalizes itself. Row 0 and row 8 are plain rows.
    let mut none = vec![0f32; v * h];
    run(
        &exec,
        &grad,
        &[8, h],
        &idx,
        &[8],
        v,
        &EmbeddingGradOptions::default(),
        &mut none,
    )
    .unwrap();
    for p in [-1i64, -2, i64::MIN] {
        let opts = EmbeddingGradOptions {
            padding_idx: p,
            ..Default::default()
        };
        let (out, _) = case(
            &exec,
            &grad,
            &[8, h],
            &idx,
            &[8],
            v,
            &opts,
            &poison::<f32>(v * h),
            "negative padding",
        );
        assert_eq!(bits(&out), bits(&none), "padding {p} is none");
        assert_ne!(out[0], 0.0);
    }
}

#[test]
fn padding_copies_mixed_with_others() {
    let (v, h) = (4, 3);
    let exec = default_exec();
    let mut rng = Rng(3);
    for copies in [1usize, 2, 1000] {
        for others in [&[][..], &[1i64, 3][..], &[2][..]] {
            // Padding copies with the others spread among them.
            let n = copies + others.len();
            let mut idx = vec![0i64; n];
            for (k, &o) in others.iter().enumerate() {
                idx[(k * 2 + 1) * n / (2 * others.len()).max(1) % n] = o;
            }
            assert_eq!(idx.iter().filter(|&&x| x == 0).count(), copies);
            let grad: Vec<bf16> = rng.vec(n * h, -1.0, 1.0);
            for accumulate in [false, true] {
                let opts = EmbeddingGradOptions {
                    padding_idx: 0,
                    accumulate,
                    ..Default::default()
                };
                let old = poison::<f32>(v * h);
                let what = format!("{copies} paddings with {others:?}");
                let (out, _) = case(&exec, &grad, &[n, h], &idx, &[n], v, &opts, &old, &what);
                let want = if accumulate {
                    bits(&old[..h])
                } else {
                    vec![0; 4 * h]
                };
                assert_eq!(bits(&out[..h]), want, "{what}: padding row");
            }
        }
    }
}

#[test]
fn one_index_100k_times_bf16() {
    let (n, v, h) = (100_000, 5, 32);
    let mut rng = Rng(4);
    // Mostly positive terms, so the sum grows to ~5e4 and f32 rounding matters.
    let grad: Vec<bf16> = rng.vec(n * h, -1.0, 2.0);
    let idx = vec![3i32; n];
    let exec = default_exec();
    let opts = EmbeddingGradOptions::default();
    let (out, m) = case(
        &exec,
        &grad,
        &[n, h],
        &idx,
        &[n],
        v,
        &opts,
        &vec![bf16::ZERO; v * h],
        "100k bf16",
    );
    let (out32, m32) = case(
        &exec,
        &grad,
        &[n, h],
        &idx,
        &[n],
        v,
        &opts,
        &vec![0f32; v * h],
        "100k bf16->f32",
    );
    let ex = exact(
        &grad,
        h,
        &idx.iter().map(|&x| x as i64).collect::<Vec<_>>(),
        v,
        &opts,
        &out,
    );
    let mut naive_rel = 0f64;
    let mut worst_exact_ulps = 0f64;
    for j in 0..h {
        let e = ex.val[3 * h + j];
        // bf16 output = the f32 sum rounded once.
        assert_eq!(out[3 * h + j], bf16::from_f32(out32[3 * h + j]));
        // Within bf16 rounding of the exact sum: half an ulp plus the f32
        // sum's own (measured) error, which is far below an ulp.
        let f32_err = (out32[3 * h + j] as f64 - e).abs();
        let err = (out[3 * h + j].to_f64() - e).abs();
        assert!(
            f32_err < 0.01 * ulp(DType::BF16, e),
            "col {j}: f32 sum error {f32_err}"
        );
        assert!(err <= 0.5 * ulp(DType::BF16, e) + f32_err, "col {j}");
        worst_exact_ulps = worst_exact_ulps.max(err / ulp(DType::BF16, e));
        // What accumulating in bf16 (PyTorch's CPU kernel) would give.
        let mut acc = bf16::ZERO;
        for p in 0..n {
            acc = bf16::from_f32(acc.to_f32() + grad[p * h + j].to_f32());
        }
        naive_rel = naive_rel.max((acc.to_f64() - e).abs() / e.abs());
    }
    println!(
        "100000 duplicates, bf16 out: max |out - exact| = {:.3} bf16 ulp ({:.3} of tolerance); \
         f32 out: {:.3} f32 ulp; bf16-accumulated sum would be off by {:.1}%",
        worst_exact_ulps,
        m.of_tol,
        m32.ulps,
        naive_rel * 100.0
    );
    // Scaled: the mean of 100 000 terms.
    let opts = EmbeddingGradOptions {
        scale_grad_by_freq: true,
        ..Default::default()
    };
    case(
        &exec,
        &grad,
        &[n, h],
        &idx,
        &[n],
        v,
        &opts,
        &vec![bf16::ZERO; v * h],
        "100k scaled",
    );
    // Same bits when many threads and blocks share a one-row workload.
    let cpu = Cpu::new(Threads::new(4));
    let texec = Exec::new(&cpu).with_ub(UbConfig {
        ub_bytes: 1024,
        blocks: 64,
    });
    let mut o2 = vec![bf16::ZERO; v * h];
    run(
        &texec,
        &grad,
        &[n, h],
        &idx,
        &[n],
        v,
        &EmbeddingGradOptions::default(),
        &mut o2,
    )
    .unwrap();
    assert_eq!(bits(&o2), bits(&out));
}

/// Random data in every dtype pairing, with sorted, reverse-sorted and random
/// indices, with and without the scale.
#[test]
fn random_against_reference_all_dtypes() {
    let (n, v, h) = (2000, 300, 33);
    let mut rng = Rng(5);
    let base: Vec<i64> = (0..n).map(|_| rng.below(v as u64) as i64).collect();
    let mut sorted = base.clone();
    sorted.sort();
    let mut reversed = sorted.clone();
    reversed.reverse();
    let exec = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 1024, // 256-column tiles: several chunks per row when h is large
        blocks: 7,
    });
    // Worst error per output dtype: f32, f16, bf16.
    let mut worst = [Measured::default(); 3];
    for (name, idx) in [
        ("random", &base),
        ("sorted", &sorted),
        ("reversed", &reversed),
    ] {
        let idx32: Vec<i32> = idx.iter().map(|&x| x as i32).collect();
        for scale in [false, true] {
            let opts = EmbeddingGradOptions {
                scale_grad_by_freq: scale,
                ..Default::default()
            };
            let d = &[n, h][..];
            let w = format!("{name} scale={scale}");
            let g32: Vec<f32> = rng.vec(n * h, -2.0, 2.0);
            let g16: Vec<f16> = rng.vec(n * h, -2.0, 2.0);
            let gb: Vec<bf16> = rng.vec(n * h, -2.0, 2.0);
            let p32 = poison::<f32>(v * h);
            let ms = [
                case(&exec, &g32, d, idx, &[n], v, &opts, &p32, &w).1,
                case(
                    &exec,
                    &g16,
                    d,
                    &idx32,
                    &[n],
                    v,
                    &opts,
                    &poison::<f16>(v * h),
                    &w,
                )
                .1,
                case(&exec, &g16, d, idx, &[n], v, &opts, &p32, &w).1,
                case(
                    &exec,
                    &gb,
                    d,
                    &idx32,
                    &[n],
                    v,
                    &opts,
                    &poison::<bf16>(v * h),
                    &w,
                )
                .1,
                case(&exec, &gb, d, idx, &[n], v, &opts, &p32, &w).1,
            ];
            for (k, m) in [0, 1, 0, 2, 0].into_iter().zip(ms) {
                worst[k] = worst[k].max(m);
            }
        }
        // A single occurrence is an exact copy.
        let gb: Vec<bf16> = rng.vec(n * h, -2.0, 2.0);
        let mut out = vec![bf16::ZERO; v * h];
        let opts = EmbeddingGradOptions::default();
        run(&exec, &gb, &[n, h], idx, &[n], v, &opts, &mut out).unwrap();
        for r in 0..v {
            let hits: Vec<usize> = (0..n).filter(|&p| idx[p] == r as i64).collect();
            if let [p] = hits[..] {
                assert_eq!(
                    bits(&out[r * h..(r + 1) * h]),
                    bits(&gb[p * h..(p + 1) * h])
                );
            }
        }
    }
    for (name, m) in ["f32", "f16", "bf16"].iter().zip(worst) {
        println!(
            "random case (N={n}, V={v}, H={h}), {name} out: max |out - exact| = {:.3} x \
             (ulp_out(exact) + 2^-24 sum|t|), {:.3} of tolerance ({:.1} ulp of |exact| where terms cancel)",
            m.units, m.of_tol, m.ulps
        );
    }
}

#[test]
fn num_weights_one() {
    let (n, h) = (9, 7);
    let grad: Vec<f32> = Rng(6).vec(n * h, -1.0, 1.0);
    let idx = vec![0i64; n];
    case(
        &default_exec(),
        &grad,
        &[3, 3, h],
        &idx,
        &[9],
        1,
        &EmbeddingGradOptions::default(),
        &poison::<f32>(h),
        "num_weights 1",
    );
}

#[test]
fn row_lengths_including_split_d() {
    let mut rng = Rng(7);
    let small_ub = UbConfig {
        ub_bytes: 1024,
        blocks: 5,
    };
    for (h, ub) in [
        (1, UbConfig::default()),
        (7, UbConfig::default()),
        (17, UbConfig::default()),
        (1000, small_ub),              // 256-column tiles
        (50_000, UbConfig::default()), // wider than the 192 KiB tile
    ] {
        let (n, v) = (if h > 1000 { 12 } else { 200 }, 6);
        let idx: Vec<i64> = (0..n).map(|_| rng.below(v as u64) as i64).collect();
        let exec = Exec::cpu().with_ub(ub);
        let opts = EmbeddingGradOptions {
            scale_grad_by_freq: h == 17,
            ..Default::default()
        };
        let g: Vec<bf16> = rng.vec(n * h, -1.0, 1.0);
        let w = format!("H={h}");
        case(
            &exec,
            &g,
            &[n, h],
            &idx,
            &[n],
            v,
            &opts,
            &poison::<bf16>(v * h),
            &w,
        );
        let g: Vec<f32> = rng.vec(n * h, -1.0, 1.0);
        let (a, _) = case(
            &exec,
            &g,
            &[n, h],
            &idx,
            &[n],
            v,
            &opts,
            &poison::<f32>(v * h),
            &w,
        );
        // Chunking never changes a bit.
        let mut b = vec![0f32; v * h];
        run(&Exec::cpu(), &g, &[n, h], &idx, &[n], v, &opts, &mut b).unwrap();
        assert_eq!(bits(&a), bits(&b), "{w}");
    }
}

#[test]
fn empty_indices() {
    let (v, h) = (5, 4);
    let exec = default_exec();
    let g: [bf16; 0] = [];
    let i: [i64; 0] = [];
    for (gd, id) in [(&[0, h][..], &[0][..]), (&[2, 0, h][..], &[2, 0][..])] {
        let mut out = poison::<bf16>(v * h);
        run(&exec, &g, gd, &i, id, v, &Default::default(), &mut out).unwrap();
        assert!(out.iter().all(|x| x.to_bits() == 0), "zeros");
        let old = poison::<bf16>(v * h);
        let mut out = old.clone();
        let opts = EmbeddingGradOptions {
            accumulate: true,
            ..Default::default()
        };
        run(&exec, &g, gd, &i, id, v, &opts, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&old), "left alone");
    }
}

#[test]
fn zero_width_or_zero_rows_write_nothing() {
    let exec = default_exec();
    let idx = [1i64, 2, 3];
    // H == 0: valid, nothing written, no workspace.
    let g: [f32; 0] = [];
    let gr = TensorRef::new(&g, &[3, 0]).unwrap();
    let ir = TensorRef::new(&idx, &[3]).unwrap();
    let opts = EmbeddingGradOptions::default();
    assert_eq!(
        embedding_dense_grad_workspace_size(&exec, gr, ir, 4, &opts),
        Ok(0)
    );
    let mut out: [f32; 0] = [];
    run(&exec, &g, &[3, 0], &idx, &[3], 4, &opts, &mut out).unwrap();
    // ... but indices are still validated.
    let bad = [1i64, 9];
    assert_eq!(
        run(&exec, &g, &[2, 0], &bad, &[2], 4, &opts, &mut out),
        Err(Error::IndexOutOfRange {
            arg: "indices",
            position: 1,
            value: 9,
            start: 0,
            end: 4
        })
    );
    // num_weights == 0: every index is outside the (empty) table.
    let g = [1f32; 6];
    let mut out: [f32; 0] = [];
    let ignore = EmbeddingGradOptions {
        out_of_range: IndexPolicy::Ignore,
        ..Default::default()
    };
    run(&exec, &g, &[3, 2], &idx, &[3], 0, &ignore, &mut out).unwrap();
    assert_eq!(
        run(&exec, &g, &[3, 2], &idx, &[3], 0, &opts, &mut out),
        Err(Error::IndexOutOfRange {
            arg: "indices",
            position: 0,
            value: 1,
            start: 0,
            end: 0
        })
    );
}

#[test]
fn shard_ignores_indices_on_both_sides() {
    let (n, v, h, start) = (3000, 50, 24, 100i64);
    let mut rng = Rng(8);
    let idx: Vec<i64> = (0..n).map(|_| rng.below(250) as i64).collect();
    assert!(idx.iter().any(|&x| x < start) && idx.iter().any(|&x| x >= start + v as i64));
    let g: Vec<bf16> = rng.vec(n * h, -1.0, 1.0);
    let exec = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 1024,
        blocks: 8,
    });
    for padding_idx in [-1, 10, 120] {
        let opts = EmbeddingGradOptions {
            vocab_start: start,
            out_of_range: IndexPolicy::Ignore,
            padding_idx,
            ..Default::default()
        };
        let w = format!("shard padding {padding_idx}");
        case(
            &exec,
            &g,
            &[n, h],
            &idx,
            &[n],
            v,
            &opts,
            &poison::<f32>(v * h),
            &w,
        );
        case(
            &exec,
            &g,
            &[n, h],
            &idx,
            &[n],
            v,
            &opts,
            &poison::<bf16>(v * h),
            &w,
        );
    }
    // Under Error the first index outside [100, 150) is named.
    let first = idx
        .iter()
        .position(|&x| !(start..start + v as i64).contains(&x))
        .unwrap();
    let opts = EmbeddingGradOptions {
        vocab_start: start,
        ..Default::default()
    };
    let old = poison::<f32>(v * h);
    let mut out = old.clone();
    assert_eq!(
        run(&exec, &g, &[n, h], &idx, &[n], v, &opts, &mut out),
        Err(Error::IndexOutOfRange {
            arg: "indices",
            position: first as u64,
            value: idx[first],
            start,
            end: start + v as i64
        })
    );
    assert_eq!(bits(&out), bits(&old));
    // A padding index in another shard is never out of range.
    let pad = [5i64, 5, 101, 5];
    let opts = EmbeddingGradOptions {
        vocab_start: start,
        padding_idx: 5,
        ..Default::default()
    };
    let g4: Vec<f32> = rng.vec(4 * h, -1.0, 1.0);
    case(
        &exec,
        &g4,
        &[4, h],
        &pad,
        &[4],
        v,
        &opts,
        &poison::<f32>(v * h),
        "foreign pad",
    );
}

#[test]
fn accumulate_into_existing_f32_table() {
    let (n, v, h) = (1500, 400, 40);
    let mut rng = Rng(9);
    let idx: Vec<i32> = (0..n).map(|_| rng.below(v as u64 / 2) as i32 * 2).collect();
    let old: Vec<f32> = rng.vec(v * h, -3.0, 3.0);
    let exec = default_exec();
    for scale in [false, true] {
        let opts = EmbeddingGradOptions {
            accumulate: true,
            scale_grad_by_freq: scale,
            ..Default::default()
        };
        let gb: Vec<bf16> = rng.vec(n * h, -1.0, 1.0);
        let (out, _) = case(
            &exec,
            &gb,
            &[n, h],
            &idx,
            &[n],
            v,
            &opts,
            &old,
            "acc bf16->f32",
        );
        // Odd rows are never hit: bit-identical to the old table.
        for r in (1..v).step_by(2) {
            assert_eq!(
                bits(&out[r * h..(r + 1) * h]),
                bits(&old[r * h..(r + 1) * h])
            );
        }
        let g: Vec<f32> = rng.vec(n * h, -1.0, 1.0);
        case(&exec, &g, &[n, h], &idx, &[n], v, &opts, &old, "acc f32");
        let oldb: Vec<bf16> = old.iter().map(|&x| bf16::from_f32(x)).collect();
        case(&exec, &gb, &[n, h], &idx, &[n], v, &opts, &oldb, "acc bf16");
    }
}

#[test]
fn bad_index_values_name_the_first_position() {
    let (v, h) = (10, 3);
    let exec = default_exec();
    let opts = EmbeddingGradOptions::default();
    let g = vec![0.5f32; 6 * h];
    let cases: [(&[i64], u64, i64); 4] = [
        (&[1, 2, (1i64 << 31) + 5, -1, 3, 4], 2, (1 << 31) + 5),
        (&[1, -3, 1 << 31, 2, 3, 4], 1, -3),
        (&[1, 2, 3, 4, 5, 10], 5, 10),
        (&[i64::MIN, 0, 0, 0, 0, 0], 0, i64::MIN),
    ];
    for (idx, position, value) in cases {
        let old = poison::<f32>(v * h);
        let mut out = old.clone();
        assert_eq!(
            run(&exec, &g, &[6, h], idx, &[6], v, &opts, &mut out),
            Err(Error::IndexOutOfRange {
                arg: "indices",
                position,
                value,
                start: 0,
                end: v as i64
            })
        );
        assert_eq!(bits(&out), bits(&old), "output untouched");
        assert_eq!(
            Error::IndexOutOfRange {
                arg: "indices",
                position,
                value,
                start: 0,
                end: v as i64
            }
            .status(),
            161004
        );
    }
    let idx32 = [1i32, 2, -7, 3, 4, 5];
    let mut out = poison::<f32>(v * h);
    assert_eq!(
        run(&exec, &g, &[6, h], &idx32, &[6], v, &opts, &mut out),
        Err(Error::IndexOutOfRange {
            arg: "indices",
            position: 2,
            value: -7,
            start: 0,
            end: v as i64
        })
    );
    // Indices above 2^31 are fine in a shard that holds them.
    let start = 3_000_000_000i64;
    let idx = [start + 9, start, start + 9, start + 4, 7, start + 10];
    let opts = EmbeddingGradOptions {
        vocab_start: start,
        out_of_range: IndexPolicy::Ignore,
        ..Default::default()
    };
    let g: Vec<f32> = Rng(10).vec(6 * h, -1.0, 1.0);
    case(
        &exec,
        &g,
        &[6, h],
        &idx,
        &[6],
        v,
        &opts,
        &poison::<f32>(v * h),
        "high shard",
    );
}

#[test]
fn bit_identical_across_threads_blocks_ub_and_isa() {
    let (n, v, h) = (20_000, 3000, 80);
    let mut rng = Rng(11);
    // Skewed: a third of the positions on one hot row, the rest Zipf-ish.
    let idx: Vec<i64> = (0..n)
        .map(|_| {
            if rng.below(3) == 0 {
                17
            } else {
                let u = rng.unit();
                ((v as f64).powf(u) - 1.0) as i64
            }
        })
        .collect();
    let gb: Vec<bf16> = rng.vec(n * h, -1.0, 1.0);
    let g32: Vec<f32> = rng.vec(n * h, -1.0, 1.0);
    let opts = EmbeddingGradOptions {
        scale_grad_by_freq: true,
        padding_idx: 2,
        ..Default::default()
    };
    let mut first: Option<(Vec<u8>, Vec<u8>)> = None;
    let isas = Isa::ALL;
    for threads in [1, 2, 4] {
        for blocks in [1, 3, 64] {
            for ub_bytes in [1024, 196_608] {
                for &isa in isas.iter().filter(|&&i| i.is_available()) {
                    let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
                    let exec = Exec::new(&cpu).with_ub(UbConfig { ub_bytes, blocks });
                    let mut ob = vec![bf16::ZERO; v * h];
                    run(&exec, &gb, &[n, h], &idx, &[n], v, &opts, &mut ob).unwrap();
                    let mut o32 = vec![0f32; v * h];
                    run(&exec, &g32, &[n, h], &idx, &[n], v, &opts, &mut o32).unwrap();
                    let got = (bits(&ob), bits(&o32));
                    match &first {
                        None => {
                            let wide = idx.clone();
                            let ex = exact(&gb, h, &wide, v, &opts, &ob);
                            check(&ob, &ex, &ob, &opts, "skewed bf16");
                            first = Some(got);
                        }
                        Some(f) => assert!(
                            *f == got,
                            "threads {threads} blocks {blocks} ub {ub_bytes} {isa:?}"
                        ),
                    }
                }
            }
        }
    }
}

#[test]
fn bad_input_gets_a_specific_error_and_writes_nothing() {
    let exec = default_exec();
    let opts = EmbeddingGradOptions::default();
    let (v, h) = (4, 3);
    let g = [1f32; 2 * 3];
    let idx = [0i64, 3];
    fn expect<O: Element>(r: Result<()>, out: &[O], old: &[O], want: &str) {
        let e = r.unwrap_err();
        assert_eq!(e.to_string(), want);
        assert_eq!(bits(out), bits(old), "{e}: output untouched");
    }
    let old = poison::<f32>(v * h);
    // Wrong index dtype.
    let fidx = [0f32, 3.0];
    let mut out = old.clone();
    let r = run(&exec, &g, &[2, h], &fidx, &[2], v, &opts, &mut out);
    expect(r, &out, &old, "indices: dtype f32 is not i32 or i64");
    // (An integer grad or out does not compile: they are `Float`.)
    // numel(indices) * H != numel(grad).
    let mut out = old.clone();
    let r = run(&exec, &g, &[2, h], &[0i64, 1, 2], &[3], v, &opts, &mut out);
    assert!(matches!(r, Err(Error::InvalidParam { arg: "indices", .. })));
    assert_eq!(bits(&out), bits(&old));
    let r = run(&exec, &g, &[6], &idx, &[2], v, &opts, &mut out);
    assert!(matches!(r, Err(Error::InvalidParam { arg: "indices", .. })));
    // Output shape not [num_weights, H].
    let gr = TensorRef::new(&g, &[2, h]).unwrap();
    let ir = TensorRef::new(&idx, &[2]).unwrap();
    let mut ws = vec![0u8; embedding_dense_grad_workspace_size(&exec, gr, ir, v, &opts).unwrap()];
    for n in [v * h - 1, v * h + 1, 0] {
        let o = poison::<f32>(n);
        let mut out = o.clone();
        let r = embedding_dense_grad(&exec, gr, ir, v, &opts, &mut out, &mut ws);
        let want = format!("out: shape [{n}] is not [num_weights, H] = [4, 3]");
        expect(r, &out, &o, &want);
    }
    // Unsupported output dtype: another float than grad's or f32.
    let gb = [bf16::ONE; 6];
    let oldh = poison::<f16>(v * h);
    let mut oh = oldh.clone();
    let r = run(&exec, &gb, &[2, h], &idx, &[2], v, &opts, &mut oh);
    expect(
        r,
        &oh,
        &oldh,
        "out: dtype f16 is neither grad's (bf16) nor f32",
    );
    let mut ob = poison::<bf16>(v * h);
    let r = run(&exec, &g, &[2, h], &idx, &[2], v, &opts, &mut ob);
    assert!(matches!(r, Err(Error::DtypeUnsupported { arg: "out", .. })));
    // Overflowing sizes (no buffer of that size is ever touched).
    assert_eq!(
        embedding_dense_grad_workspace_size(&exec, gr, ir, usize::MAX / 2, &opts),
        Err(Error::SizeOverflow { arg: "out" })
    );
    assert_eq!(
        embedding_dense_grad_workspace_size(&exec, gr, ir, usize::MAX, &opts),
        Err(Error::SizeOverflow { arg: "num_weights" })
    );
    let mut out = old.clone();
    let r = embedding_dense_grad(&exec, gr, ir, usize::MAX / 2, &opts, &mut out, &mut ws);
    expect(r, &out, &old, "the size of out overflows");
    // Workspace too small.
    let needed = ws.len();
    let mut out = old.clone();
    let r = embedding_dense_grad(&exec, gr, ir, v, &opts, &mut out, &mut ws[..needed - 1]);
    let want = format!(
        "workspace of {} bytes is smaller than the {needed} needed",
        needed - 1
    );
    expect(r, &out, &old, &want);
    // Bad options and tiling.
    for (o, arg) in [
        (
            EmbeddingGradOptions {
                vocab_start: -1,
                ..opts
            },
            "vocab_start",
        ),
        (
            EmbeddingGradOptions {
                vocab_start: i64::MAX - 2,
                ..opts
            },
            "vocab_start",
        ),
    ] {
        let mut out = old.clone();
        let r = run(&exec, &g, &[2, h], &idx, &[2], v, &o, &mut out);
        assert!(matches!(r, Err(Error::InvalidParam { arg: a, .. }) if a == arg));
        assert_eq!(bits(&out), bits(&old));
    }
    let tiny = exec.with_ub(UbConfig {
        ub_bytes: 512,
        blocks: 4,
    });
    let mut out = old.clone();
    let r = run(&tiny, &g, &[2, h], &idx, &[2], v, &opts, &mut out);
    assert!(matches!(
        r,
        Err(Error::InvalidParam {
            arg: "ub_bytes",
            ..
        })
    ));
    assert_eq!(bits(&out), bits(&old));
    // The C values of the policy.
    assert_eq!(IndexPolicy::Error as u32, 0);
    assert_eq!(IndexPolicy::Ignore as u32, 1);
    assert_eq!(IndexPolicy::from_u32(1), Some(IndexPolicy::Ignore));
    assert_eq!(IndexPolicy::from_u32(2), None);
}

/// A row taking half the positions is split over blocks by column slices
/// (rows of 1024 columns or more): every column's sum keeps its position
/// order, so the table equals one block's, bit for bit, for every option
/// and on 2 threads, including rows whose slices start mid-row.
#[test]
fn hot_row_split_over_blocks_keeps_the_bits() {
    let (n, v, h) = (1200usize, 40usize, 2048 + 48);
    let mut rng = Rng(11);
    let grad: Vec<f32> = rng.vec(n * h, -2.0, 2.0);
    let grad16: Vec<bf16> = grad.iter().map(|&x| bf16::from_f32(x)).collect();
    let idx: Vec<i64> = (0..n)
        .map(|i| if i % 2 == 0 { 7 } else { (i * 13 % v) as i64 })
        .collect();
    let one = Cpu::new(Serial);
    let one = Exec::new(&one).with_ub(UbConfig {
        blocks: 1,
        ..Default::default()
    });
    let pool = Cpu::new(Threads::new(2));
    let many: Vec<Exec<'_>> = [3u32, 8, 64]
        .into_iter()
        .flat_map(|blocks| {
            let ub = UbConfig {
                blocks,
                ..Default::default()
            };
            [Exec::cpu().with_ub(ub), Exec::new(&pool).with_ub(ub)]
        })
        .collect();
    for (scale, accumulate) in [(false, false), (true, false), (false, true)] {
        let opts = EmbeddingGradOptions {
            scale_grad_by_freq: scale,
            accumulate,
            padding_idx: 3,
            ..Default::default()
        };
        let start: Vec<f32> = rng.vec(v * h, -1.0, 1.0);
        let mut want = start.clone();
        run(&one, &grad, &[n, h], &idx, &[n], v, &opts, &mut want).unwrap();
        let mut want16 = vec![bf16::ZERO; v * h];
        run(&one, &grad16, &[n, h], &idx, &[n], v, &opts, &mut want16).unwrap();
        for exec in &many {
            let mut got = start.clone();
            run(exec, &grad, &[n, h], &idx, &[n], v, &opts, &mut got).unwrap();
            assert_eq!(bits(&got), bits(&want), "f32 {:?} {opts:?}", exec.ub);
            let mut got16 = vec![bf16::ZERO; v * h];
            run(exec, &grad16, &[n, h], &idx, &[n], v, &opts, &mut got16).unwrap();
            assert_eq!(bits(&got16), bits(&want16), "bf16 {:?} {opts:?}", exec.ub);
        }
    }
}
