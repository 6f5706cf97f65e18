//! Bit-identical across architectures: every operator on fixed-seed inputs
//! (every dtype pairing, merge-N and split-D rows, specials, embedding with
//! duplicates / padding / scaling / sharding / accumulation, gradient health,
//! cross-entropy forward / backward / fused with every option, SwiGLU and
//! GeGLU forward and backward fused and eager, AdamW over tensor lists,
//! Matmul)
//! under every ISA this machine has, each output hashed bit for bit and
//! compared with `tests/data/bit_hashes.txt`. The file is produced on
//! x86_64; scripts/cross.sh runs this test on aarch64 too (the NEON lanes,
//! then the portable ones forced), so a kernel whose bits depend on the ISA or the architecture fails
//! here, naming the operator and case. `NPK_BLESS=1` rewrites the file.

#[path = "bit_hashes/adamw.rs"]
mod adamw_cases;
#[path = "../embedded/checks/src/ce_options.rs"]
mod ce_options;
mod common;
#[path = "../embedded/checks/src/hash.rs"]
mod hash;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use common::*;
use hash::BitHash;
use npukern::*;
use npukern::{bf16, f16};

const FILE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/bit_hashes.txt");

/// Hashes per case name, for one ISA.
#[derive(Default)]
struct Run(BTreeMap<String, u64>);

impl Run {
    fn put(&mut self, name: String, h: u64) {
        assert!(
            self.0.insert(name.clone(), h).is_none(),
            "case {name} twice"
        );
    }
    fn out<T: Float>(&mut self, name: &str, v: &[T]) {
        self.put(name.to_string(), BitHash::of(v));
    }
}

fn dname<T: Element>() -> &'static str {
    T::DTYPE.name()
}

/// Random magnitudes (1e-3..1e3, both signs) with specials planted in row 0
/// when the row is long enough: NaN, +-Inf, a huge, a tiny and a -0.0.
fn data<T: Float>(rng: &mut Rng, len: usize, specials: bool) -> Vec<T> {
    let mut v: Vec<T> = vec_of(len, || rng.mag());
    if specials && len > 8 {
        for (i, s) in [f64::NAN, f64::INFINITY, -f64::INFINITY, 6e4, 1e-7, -0.0]
            .into_iter()
            .enumerate()
        {
            v[1 + i] = T::from_f64(s);
        }
    }
    v
}

/// (name, rows, cols, tiling, specials): merge-N, split-D by a small UB and
/// by row length (110000 > a 192 KiB UB's 49152 f32), odd widths.
fn norm_shapes() -> [(&'static str, usize, usize, UbConfig, bool); 4] {
    let ub = |ub_bytes, blocks| UbConfig { ub_bytes, blocks };
    [
        ("7x300", 7, 300, UbConfig::default(), true),
        ("9x17.ub1k", 9, 17, ub(1024, 64), false),
        ("5x4095.ub1k", 5, 4095, ub(1024, 3), true),
        ("2x110000", 2, 110_000, UbConfig::default(), false),
    ]
}

fn norms<T: Float, G: Float>(run: &mut Run, cpu: &Cpu, seed: u64) {
    for (si, (shape, m, n, ub, specials)) in norm_shapes().into_iter().enumerate() {
        let exec = Exec::new(cpu).with_ub(ub);
        let mut rng = Rng(seed * 100 + si as u64);
        let x: Vec<T> = data(&mut rng, m * n, specials);
        let x2: Vec<T> = data(&mut rng, m * n, false);
        let dy: Vec<T> = data(&mut rng, m * n, false);
        let dres: Vec<T> = data(&mut rng, m * n, false);
        let g: Vec<G> = vec_of(n, || rng.uniform(-2.0, 2.0));
        let (xs, gs) = ([m, n], [n]);
        let case = format!("{}_{}.{shape}", dname::<T>(), dname::<G>());

        let fwd = run_rms_norm(&exec, &x, &xs, &g, &gs, &RmsNormOptions::default());
        run.out(&format!("rms_norm.fused.{case}.y"), &fwd.y);
        run.out(&format!("rms_norm.fused.{case}.rstd"), &fwd.rstd);
        let cast = RmsNormOptions {
            gamma_offset: 1.0,
            rounding: Rounding::CastBeforeGamma,
            eps: 1e-5f32,
        };
        let f2 = run_rms_norm(&exec, &x, &xs, &g, &gs, &cast);
        run.out(&format!("rms_norm.cast_offset.{case}.y"), &f2.y);

        let add = run_add_rms_norm(&exec, &x, &x2, &xs, &g, &gs, &RmsNormOptions::default());
        run.out(&format!("add_rms_norm.{case}.y"), &add.y);
        run.out(&format!("add_rms_norm.{case}.rstd"), &add.rstd);
        run.out(&format!("add_rms_norm.{case}.x_sum"), &add.x_sum);
        // In place: x_sum over x1, same bits as out of place.
        let mut x1 = x.clone();
        let (mut y, mut rstd) = (vec![T::from_f64(0.0); m * n], vec![0f32; m]);
        {
            let (x2t, gt) = (
                TensorRef::new(&x2, &xs).unwrap(),
                TensorRef::new(&g, &gs).unwrap(),
            );
            let opts = RmsNormOptions::default();
            let x1t = TensorRef::new(&x, &xs).unwrap();
            let sz = add_rms_norm_workspace_size(&exec, x1t, x2t, gt, &opts).unwrap();
            let mut ws = vec![0u8; sz];
            let x1m = TensorMut::new(&mut x1, &xs).unwrap();
            add_rms_norm_in_place(&exec, x1m, x2t, gt, &opts, &mut y, Some(&mut rstd), &mut ws)
                .unwrap();
        }
        let what = format!("add_rms_norm_in_place {case}");
        assert_same_bits(&x1, &add.x_sum, &what);
        assert_same_bits(&y, &add.y, &what);
        assert_same_bits(&rstd, &add.rstd, &what);

        let gopts = RmsNormGradOptions::default();
        let rs = &fwd.rstd;
        let b = run_grad(&exec, &dy, &x, &xs, rs, &g, &gs, Some(&dres), &gopts, None);
        run.out(&format!("rms_norm_grad.dres.{case}.dx"), &b.dx);
        run.out(&format!("rms_norm_grad.dres.{case}.dgamma"), &b.dgamma);
        run.out(
            &format!("rms_norm_grad.dres.{case}.dgamma_cast"),
            &b.dgamma_cast,
        );
        let acc = RmsNormGradOptions {
            gamma_offset: 0.5,
            dgamma_mode: DgammaMode::Accumulate,
        };
        let init: Vec<f32> = vec_of(n, || rng.mag());
        let b2 = run_grad(&exec, &dy, &x, &xs, rs, &g, &gs, None, &acc, Some(init));
        run.out(&format!("rms_norm_grad.offset_acc.{case}.dx"), &b2.dx);
        run.out(
            &format!("rms_norm_grad.offset_acc.{case}.dgamma"),
            &b2.dgamma,
        );
        // In place: dx over dy (with dres), same bits as out of place.
        let mut dydx = dy.clone();
        let (mut dgamma, mut dgc) = (vec![0f32; n], vec![G::from_f64(0.0); n]);
        {
            let (dyt, xt) = (
                TensorRef::new(&dy, &xs).unwrap(),
                TensorRef::new(&x, &xs).unwrap(),
            );
            let (rt, gt) = (
                TensorRef::new(&rs[..], &[m]).unwrap(),
                TensorRef::new(&g, &gs).unwrap(),
            );
            let dr = Some(TensorRef::new(&dres, &xs).unwrap());
            let sz = rms_norm_grad_workspace_size(
                &exec,
                dyt,
                &RmsNormGradInputs {
                    x: xt,
                    rstd: rt,
                    gamma: gt,
                    dres: dr,
                },
                &gopts,
            )
            .unwrap();
            let mut ws = vec![0u8; sz];
            rms_norm_grad_in_place(
                &exec,
                TensorMut::new(&mut dydx, &xs).unwrap(),
                &RmsNormGradInputs {
                    x: xt,
                    rstd: rt,
                    gamma: gt,
                    dres: dr,
                },
                &gopts,
                DgammaOut {
                    dgamma: Some(&mut dgamma),
                    dgamma_cast: Some(&mut dgc),
                },
                &mut ws,
            )
            .unwrap();
        }
        let what = format!("rms_norm_grad_in_place {case}");
        assert_same_bits(&dydx, &b.dx, &what);
        assert_same_bits(&dgamma, &b.dgamma, &what);
        assert_same_bits(&dgc, &b.dgamma_cast, &what);
    }
}

/// Embedding options worth a hash each: plain sums of duplicates, padding,
/// frequency scaling, a vocab shard ignoring foreign ids, accumulation.
fn embedding_options() -> [(&'static str, EmbeddingGradOptions, usize); 5] {
    let d = EmbeddingGradOptions::default();
    [
        ("plain", d, 40),
        (
            "padding3",
            EmbeddingGradOptions {
                padding_idx: 3,
                ..d
            },
            40,
        ),
        (
            "scale_freq.padding0",
            EmbeddingGradOptions {
                scale_grad_by_freq: true,
                padding_idx: 0,
                ..d
            },
            40,
        ),
        (
            "shard16of40",
            EmbeddingGradOptions {
                vocab_start: 16,
                out_of_range: IndexPolicy::Ignore,
                ..d
            },
            16,
        ),
        (
            "accumulate.scale_freq",
            EmbeddingGradOptions {
                accumulate: true,
                scale_grad_by_freq: true,
                ..d
            },
            40,
        ),
    ]
}

fn embedding<G: Float, I: Element + TryFrom<u64>, O: Float>(run: &mut Run, cpu: &Cpu, seed: u64)
where
    <I as TryFrom<u64>>::Error: std::fmt::Debug,
{
    // (positions, H, tiling): one H row per UB tile and H split across tiles.
    let shapes = [
        (96usize, 33usize, UbConfig::default()),
        (
            50,
            3000,
            UbConfig {
                ub_bytes: 1024,
                blocks: 7,
            },
        ),
    ];
    for (si, (n, h, ub)) in shapes.into_iter().enumerate() {
        let exec = Exec::new(cpu).with_ub(ub);
        let mut rng = Rng(seed * 100 + si as u64);
        let grad: Vec<G> = vec_of(n * h, || rng.mag());
        // Ids below 40 with heavy duplication (a quarter of them id 7).
        let idx: Vec<I> = (0..n)
            .map(|_| {
                let v = if rng.below(4) == 0 { 7 } else { rng.below(40) };
                I::try_from(v).unwrap()
            })
            .collect();
        let (gt, it) = (
            TensorRef::new(&grad, &[n, h]).unwrap(),
            TensorRef::new(&idx, &[n]).unwrap(),
        );
        for (oname, opts, rows) in embedding_options() {
            let mut out: Vec<O> = vec_of(rows * h, || rng.uniform(-1.0, 1.0));
            let sz = embedding_dense_grad_workspace_size(&exec, gt, it, rows, &opts).unwrap();
            let mut ws = vec![0u8; sz];
            embedding_dense_grad(&exec, gt, it, rows, &opts, &mut out, &mut ws).unwrap();
            let name = format!(
                "embedding_dense_grad.{oname}.{}_{}_{}.{n}x{h}",
                dname::<G>(),
                dname::<I>(),
                dname::<O>()
            );
            run.out(&name, &out);
        }
    }
}

/// Mixed-dtype gradient lists: the summary (every field's bits) and
/// clip_grad_norm's scaled tensors and norm.
fn grad_health(run: &mut Run, cpu: &Cpu) {
    let mut rng = Rng(4242);
    let a: Vec<f32> = data(&mut rng, 3001, false);
    let b: Vec<bf16> = data(&mut rng, 777, false);
    let c: Vec<f16> = data(&mut rng, 4099, false);
    let d: Vec<bf16> = data(&mut rng, 65, true);
    let summary = |s: &GradSummary| {
        let mut h = BitHash::new();
        h.u64(s.sum_sq.to_bits()).u64(s.nan_count).u64(s.inf_count);
        h.floats(&[s.min, s.max, s.absmax]).0
    };
    for (ub_name, blocks) in [("blocks1", 1u32), ("blocks64", 64)] {
        let exec = Exec::new(cpu).with_ub(UbConfig {
            blocks,
            ..UbConfig::default()
        });
        let lists: [(&str, Vec<GradTensor>); 2] = [
            (
                "finite",
                vec![
                    GradTensor::F32(&a),
                    GradTensor::BF16(&b),
                    GradTensor::F16(&c),
                ],
            ),
            ("specials", vec![GradTensor::F32(&a), GradTensor::BF16(&d)]),
        ];
        for (lname, list) in lists {
            let mut ws = vec![0u8; grad_stats_workspace_size(&exec, &list).unwrap()];
            let s = grad_stats(&exec, &list, &mut ws).unwrap();
            run.put(format!("grad_stats.{lname}.{ub_name}.summary"), summary(&s));
        }
        for max_norm in [1.0f64, 1e9] {
            let (mut a2, mut b2, mut c2) = (a.clone(), b.clone(), c.clone());
            let mut list = [
                GradTensorMut::F32(&mut a2),
                GradTensorMut::BF16(&mut b2),
                GradTensorMut::F16(&mut c2),
            ];
            let opts = ClipGradNormOptions {
                max_norm,
                error_if_nonfinite: true,
            };
            let sz = clip_grad_norm_workspace_size(&exec, &list, &opts).unwrap();
            let mut ws = vec![0u8; sz];
            let norm = clip_grad_norm(&exec, &mut list, &opts, &mut ws).unwrap();
            let mut h = BitHash::new();
            h.u64(norm.to_bits()).floats(&a2).floats(&b2).floats(&c2);
            run.put(format!("clip_grad_norm.max{max_norm:e}.{ub_name}"), h.0);
        }
    }
}

/// Forward (loss, lse), backward (dlogits; in place the same bits) and the
/// fused form (loss, dlogits; its lse the forward's) per option set. Rows
/// sharing a tile, a tile split across blocks, rows of three 2048-column
/// segments; the first shape has a masked (-Inf) class and an ignored NaN
/// row.
fn cross_entropy_case<T: Float, I: Element + TryFrom<i64>>(run: &mut Run, cpu: &Cpu, seed: u64)
where
    <I as TryFrom<i64>>::Error: std::fmt::Debug,
{
    let ub = |ub_bytes, blocks| UbConfig { ub_bytes, blocks };
    let shapes = [
        ("7x300", 7usize, 300usize, UbConfig::default()),
        ("9x17.ub1k", 9, 17, ub(1024, 64)),
        ("3x4133.ub1k", 3, 4133, ub(1024, 3)),
    ];
    for (si, (shape, n, c, ub)) in shapes.into_iter().enumerate() {
        let exec = Exec::new(cpu).with_ub(ub);
        let mut rng = Rng(seed * 100 + si as u64);
        // Pure arithmetic (no libm) so every target draws the same logits.
        let mut x: Vec<T> = vec_of(n * c, || {
            if rng.below(7) == 0 {
                rng.uniform(-40.0, 40.0)
            } else {
                rng.uniform(-8.0, 8.0)
            }
        });
        // -1 marks the ignored rows; each option set puts its ignore_index there.
        let mut tgt64: Vec<i64> = (0..n)
            .map(|_| {
                if rng.below(4) == 0 {
                    -1
                } else {
                    rng.below(c as u64) as i64
                }
            })
            .collect();
        if si == 0 {
            // A masked class (not row 0's target) and a NaN row, ignored:
            // its lse is NaN, its loss and gradient 0, the sums finite.
            x[1] = T::from_f64(f64::NEG_INFINITY);
            x[c + 5] = T::from_f64(f64::NAN);
            tgt64[0] = 3;
            tgt64[1] = -1;
        }
        let w: Vec<f32> = (0..c).map(|_| rng.uniform(0.5, 2.0) as f32).collect();
        let g_rows: Vec<f32> = (0..n).map(|_| rng.uniform(0.25, 2.0) as f32).collect();
        let xt = TensorRef::new(&x, &[n, c]).unwrap();
        let case = format!("{}_{}.{shape}", dname::<T>(), dname::<I>());
        for (oname, opts, weighted) in ce_options::variants() {
            let tgt: Vec<I> = tgt64
                .iter()
                .map(|&t| I::try_from(if t < 0 { opts.ignore_index } else { t }).unwrap())
                .collect();
            let tt = CrossEntropyTargets::new(TensorRef::new(&tgt, &[n]).unwrap());
            let tt = if weighted {
                tt.with_weight(TensorRef::new(&w, &[c]).unwrap())
            } else {
                tt
            };
            let reduced = opts.reduction != Reduction::None;
            let g = if reduced { &[0.75f32][..] } else { &g_rows[..] };
            let name = |out: &str| format!("cross_entropy.{oname}.{case}.{out}");

            let mut loss = vec![0f32; if reduced { 1 } else { n }];
            let mut lse = vec![0f32; n];
            let sz = cross_entropy_workspace_size(&exec, xt, tt, &opts).unwrap();
            let mut ws = vec![0u8; sz];
            cross_entropy(&exec, xt, tt, &opts, &mut loss, Some(&mut lse), &mut ws).unwrap();
            run.out(&name("loss"), &loss);
            run.out(&name("lse"), &lse);

            let mut dx = vec![T::from_f64(0.0); n * c];
            let sz = cross_entropy_grad_workspace_size(&exec, xt, tt, &opts).unwrap();
            let mut ws = vec![0u8; sz];
            cross_entropy_grad(&exec, xt, tt, &lse, g, &opts, &mut dx, &mut ws).unwrap();
            run.out(&name("dlogits"), &dx);
            let mut dx2 = x.clone();
            let xm = TensorMut::new(&mut dx2, &[n, c]).unwrap();
            cross_entropy_grad_in_place(&exec, xm, tt, &lse, g, &opts, &mut ws).unwrap();
            assert_same_bits(
                &dx2,
                &dx,
                &format!("cross_entropy_grad_in_place {}", name("")),
            );

            let (mut fl, mut flse, mut fx) = (vec![0f32; n], vec![0f32; n], x.clone());
            let sz = cross_entropy_fused_workspace_size(&exec, xt, tt, &opts).unwrap();
            let mut ws = vec![0u8; sz];
            let xm = TensorMut::new(&mut fx, &[n, c]).unwrap();
            cross_entropy_fused(&exec, xm, tt, g, &opts, &mut fl, Some(&mut flse), &mut ws)
                .unwrap();
            assert_same_bits(
                &flse,
                &lse,
                &format!("cross_entropy_fused lse {}", name("")),
            );
            run.out(&name("fused.loss"), &fl);
            run.out(&name("fused.dlogits"), &fx);
        }
    }
}

/// SwiGLU forward and backward (two-tensor form; the split form is the
/// same kernel at other offsets), fused and eager rounding, an odd-length
/// row with specials and rows longer than a line pair.
fn swiglu_case<T: Float>(run: &mut Run, cpu: &Cpu, seed: u64) {
    let exec = Exec::new(cpu);
    for (si, (m, n, specials)) in [(3usize, 77usize, true), (2, 1000, false)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng(seed * 100 + si as u64);
        let (g, u, dy): (Vec<T>, Vec<T>, Vec<T>) = (
            data(&mut rng, m * n, specials),
            data(&mut rng, m * n, false),
            data(&mut rng, m * n, false),
        );
        let d = [m, n];
        let (gt, ut, dyt) = (
            TensorRef::new(&g, &d).unwrap(),
            TensorRef::new(&u, &d).unwrap(),
            TensorRef::new(&dy, &d).unwrap(),
        );
        for (rname, rounding) in [
            ("fused", ElemRounding::Fused),
            ("eager", ElemRounding::Eager),
        ] {
            let opts = SwigluOptions { dim: -1, rounding };
            let case = format!("{}.{rname}.{m}x{n}", dname::<T>());
            let mut y = vec![T::from_f64(0.0); m * n];
            silu_mul(&exec, gt, ut, &opts, &mut y, &mut []).unwrap();
            run.out(&format!("swiglu.{case}.y"), &y);
            let (mut da, mut db) = (vec![T::from_f64(0.0); m * n], vec![T::from_f64(0.0); m * n]);
            silu_mul_grad(&exec, dyt, gt, ut, &opts, &mut da, &mut db, &mut []).unwrap();
            run.out(&format!("swiglu_grad.{case}.da"), &da);
            run.out(&format!("swiglu_grad.{case}.db"), &db);
        }
    }
}

/// GeGLU forward (with its gelu output, split form) and backward
/// (two-tensor form), both GELU forms, fused and eager rounding, an
/// odd-length row with specials and rows longer than a line pair.
fn geglu_case<T: Float>(run: &mut Run, cpu: &Cpu, seed: u64) {
    let exec = Exec::new(cpu);
    for (si, (m, n, specials)) in [(3usize, 77usize, true), (2, 1000, false)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng(seed * 100 + si as u64);
        let (x, dy): (Vec<T>, Vec<T>) = (
            data(&mut rng, m * 2 * n, specials),
            data(&mut rng, m * n, false),
        );
        let (g, u): (Vec<T>, Vec<T>) = (x[..m * n].to_vec(), x[m * n..].to_vec());
        let (d, dx) = ([m, n], [m, 2 * n]);
        let (xt, gt, ut, dyt) = (
            TensorRef::new(&x, &dx).unwrap(),
            TensorRef::new(&g, &d).unwrap(),
            TensorRef::new(&u, &d).unwrap(),
            TensorRef::new(&dy, &d).unwrap(),
        );
        for (aname, approximate) in [
            ("tanh", GeluApproximate::Tanh),
            ("erf", GeluApproximate::None),
        ] {
            for (rname, rounding) in [
                ("fused", ElemRounding::Fused),
                ("eager", ElemRounding::Eager),
            ] {
                let opts = GegluOptions {
                    rounding,
                    approximate,
                    ..GegluOptions::default()
                };
                let case = format!("{}.{aname}.{rname}.{m}x{n}", dname::<T>());
                let (mut y, mut act) =
                    (vec![T::from_f64(0.0); m * n], vec![T::from_f64(0.0); m * n]);
                geglu(&exec, xt, &opts, &mut y, Some(&mut act), &mut []).unwrap();
                run.out(&format!("geglu.{case}.y"), &y);
                run.out(&format!("geglu.{case}.gelu"), &act);
                let (mut da, mut db) =
                    (vec![T::from_f64(0.0); m * n], vec![T::from_f64(0.0); m * n]);
                gelu_mul_grad(&exec, dyt, gt, ut, &opts, &mut da, &mut db, &mut []).unwrap();
                run.out(&format!("geglu_grad.{case}.da"), &da);
                run.out(&format!("geglu_grad.{case}.db"), &db);
            }
        }
    }
}

/// Matmul: both transposes, a 16-bit and an f32 c, accumulate; shapes with
/// corner blocks and K over one slice (257 > 256); specials in a.
fn matmul_case<T: Float>(run: &mut Run, cpu: &Cpu, seed: u64) {
    let exec = Exec::new(cpu);
    for (si, (m, n, k)) in [(17usize, 45usize, 257usize), (3, 33, 40)]
        .into_iter()
        .enumerate()
    {
        let mut rng = Rng(seed * 100 + si as u64);
        let a: Vec<T> = data(&mut rng, m * k, si == 1);
        let b: Vec<T> = vec_of(k * n, || rng.uniform(-2.0, 2.0));
        let c0: Vec<f32> = vec_of(m * n, || rng.uniform(-8.0, 8.0));
        for (ta, tb) in [(false, false), (false, true), (true, false)] {
            let ad = if ta { [k, m] } else { [m, k] };
            let bd = if tb { [n, k] } else { [k, n] };
            let (at, bt) = (
                TensorRef::new(&a, &ad).unwrap(),
                TensorRef::new(&b, &bd).unwrap(),
            );
            let case = format!("{}.{m}x{n}x{k}.t{}{}", dname::<T>(), ta as u8, tb as u8);
            let mut o = MatmulOptions {
                trans_a: ta,
                trans_b: tb,
                accumulate: false,
                ..Default::default()
            };
            let mut ws = vec![0u8; matmul_workspace_size(&exec, at, bt, T::DTYPE, &o).unwrap()];
            let mut c = vec![T::from_f64(0.0); m * n];
            matmul(&exec, at, bt, &o, &mut c, &mut ws).unwrap();
            run.out(&format!("matmul.{case}.c"), &c);
            o.accumulate = true;
            let mut ws = vec![0u8; matmul_workspace_size(&exec, at, bt, DType::F32, &o).unwrap()];
            let mut c = c0.clone();
            matmul(&exec, at, bt, &o, &mut c, &mut ws).unwrap();
            run.out(&format!("matmul.{case}.accumulate"), &c);
            if T::DTYPE == DType::BF16 {
                // The pair dot: VDPBF16PS's bits, the same on every ISA.
                o.math = MatmulMath::Bf16Dot;
                let n32 = matmul_workspace_size(&exec, at, bt, DType::F32, &o).unwrap();
                let mut ws = vec![0u8; n32];
                let mut c = c0.clone();
                matmul(&exec, at, bt, &o, &mut c, &mut ws).unwrap();
                run.out(&format!("matmul.{case}.dot.accumulate"), &c);
                o.accumulate = false;
                let n16 = matmul_workspace_size(&exec, at, bt, T::DTYPE, &o).unwrap();
                let mut ws = vec![0u8; n16];
                let mut c = vec![T::from_f64(0.0); m * n];
                matmul(&exec, at, bt, &o, &mut c, &mut ws).unwrap();
                run.out(&format!("matmul.{case}.dot.c"), &c);
                // Arm's pair dot: BFDOT's bits (its model's off AArch64).
                o.math = MatmulMath::Bf16DotArm;
                let mut ws = vec![0u8; n16];
                let mut c = vec![T::from_f64(0.0); m * n];
                matmul(&exec, at, bt, &o, &mut c, &mut ws).unwrap();
                run.out(&format!("matmul.{case}.arm_dot.c"), &c);
                o.accumulate = true;
                let mut ws = vec![0u8; n32];
                let mut c = c0.clone();
                matmul(&exec, at, bt, &o, &mut c, &mut ws).unwrap();
                run.out(&format!("matmul.{case}.arm_dot.accumulate"), &c);
            }
        }
    }
}

/// Attention, forward and backward: both layouts, causal or not, grouped
/// heads, more rows than a block (100 > 84), an odd head dim; specials in q.
fn attention_case<T: Float>(run: &mut Run, cpu: &Cpu, seed: u64) {
    let exec = Exec::new(cpu);
    for (si, (hq, hkv, sq, skv, d, causal, bsnd)) in [
        (4usize, 2usize, 100usize, 100usize, 20usize, true, false),
        (2, 2, 7, 33, 17, false, true),
    ]
    .into_iter()
    .enumerate()
    {
        let mut rng = Rng(seed * 100 + si as u64);
        let q: Vec<T> = data(&mut rng, hq * sq * d, si == 1);
        let k: Vec<T> = vec_of(hkv * skv * d, || rng.uniform(-2.0, 2.0));
        let v: Vec<T> = vec_of(hkv * skv * d, || rng.uniform(-2.0, 2.0));
        let dout: Vec<T> = vec_of(hq * sq * d, || rng.uniform(-1.0, 1.0));
        let (qd, kd) = if bsnd {
            ([1, sq, hq, d], [1, skv, hkv, d])
        } else {
            ([1, hq, sq, d], [1, hkv, skv, d])
        };
        let o = AttentionOptions {
            causal,
            scale: 1.0 / (d as f32).sqrt(),
            layout: if bsnd {
                AttentionLayout::Bsnd
            } else {
                AttentionLayout::Bnsd
            },
        };
        let (qt, kt, vt) = (
            TensorRef::new(&q, &qd).unwrap(),
            TensorRef::new(&k, &kd).unwrap(),
            TensorRef::new(&v, &kd).unwrap(),
        );
        let case = format!("attention.{}.{si}", dname::<T>());
        let mut ws = vec![0u8; attention_workspace_size(&exec, qt, kt, vt, &o, false).unwrap()];
        let mut out = vec![T::from_f64(0.0); q.len()];
        let (mut mx, mut sm) = (vec![0f32; hq * sq], vec![0f32; hq * sq]);
        attention(&exec, qt, kt, vt, &o, &mut out, &mut mx, &mut sm, &mut ws).unwrap();
        run.out(&format!("{case}.out"), &out);
        run.out(&format!("{case}.max"), &mx);
        run.out(&format!("{case}.sum"), &sm);
        let saved = AttentionSaved {
            out: TensorRef::new(&out, &qd).unwrap(),
            dout: TensorRef::new(&dout, &qd).unwrap(),
            softmax_max: TensorRef::new(&mx, &[1, hq, sq]).unwrap(),
            softmax_sum: TensorRef::new(&sm, &[1, hq, sq]).unwrap(),
        };
        let (mut dq, mut dk, mut dv) = (q.clone(), k.clone(), v.clone());
        let mut ws = vec![0u8; attention_workspace_size(&exec, qt, kt, vt, &o, true).unwrap()];
        attention_backward(
            &exec, qt, kt, vt, &saved, &o, &mut dq, &mut dk, &mut dv, &mut ws,
        )
        .unwrap();
        run.out(&format!("{case}.dq"), &dq);
        run.out(&format!("{case}.dk"), &dk);
        run.out(&format!("{case}.dv"), &dv);
    }
}

fn run_all(isa: Isa) -> Run {
    let cpu = Cpu::new(Serial).with_isa(isa);
    let mut run = Run::default();
    norms::<f32, f32>(&mut run, &cpu, 1);
    norms::<f16, f16>(&mut run, &cpu, 2);
    norms::<f16, f32>(&mut run, &cpu, 3);
    norms::<bf16, bf16>(&mut run, &cpu, 4);
    norms::<bf16, f32>(&mut run, &cpu, 5);
    embedding::<f32, i64, f32>(&mut run, &cpu, 6);
    embedding::<bf16, i32, bf16>(&mut run, &cpu, 7);
    embedding::<bf16, i64, f32>(&mut run, &cpu, 8);
    embedding::<f16, i32, f16>(&mut run, &cpu, 9);
    embedding::<f16, i64, f32>(&mut run, &cpu, 10);
    grad_health(&mut run, &cpu);
    cross_entropy_case::<f32, i64>(&mut run, &cpu, 11);
    cross_entropy_case::<bf16, i32>(&mut run, &cpu, 12);
    cross_entropy_case::<f16, i64>(&mut run, &cpu, 13);
    swiglu_case::<f32>(&mut run, &cpu, 14);
    swiglu_case::<bf16>(&mut run, &cpu, 15);
    swiglu_case::<f16>(&mut run, &cpu, 16);
    geglu_case::<f32>(&mut run, &cpu, 17);
    geglu_case::<bf16>(&mut run, &cpu, 18);
    geglu_case::<f16>(&mut run, &cpu, 19);
    matmul_case::<f32>(&mut run, &cpu, 24);
    matmul_case::<bf16>(&mut run, &cpu, 25);
    matmul_case::<f16>(&mut run, &cpu, 26);
    attention_case::<f32>(&mut run, &cpu, 29);
    attention_case::<bf16>(&mut run, &cpu, 30);
    attention_case::<f16>(&mut run, &cpu, 31);
    use adamw_cases::adamw_case;
    let (clip_ams, l2) = (ADAMW_CLIP | ADAMW_AMSGRAD, ADAMW_L2 | ADAMW_MAXIMIZE);
    adamw_case::<bf16, bf16, f32>(
        &mut run,
        &cpu,
        20,
        "bf16.master.clip.amsgrad",
        clip_ams,
        true,
    );
    adamw_case::<f32, f32, f32>(&mut run, &cpu, 21, "f32.plain", 0, false);
    adamw_case::<f16, f16, f16>(&mut run, &cpu, 22, "f16.moments.l2.maximize", l2, false);
    let scaled = ADAMW_GRAD_SCALE | ADAMW_CLIP_COEF | ADAMW_AMSGRAD;
    adamw_case::<bf16, f32, bf16>(&mut run, &cpu, 23, "bf16.moments.scale.coef", scaled, false);
    use adamw_cases::adamw_q8_case;
    adamw_q8_case(
        &mut run,
        &cpu,
        27,
        "q8.split.clip.amsgrad",
        clip_ams,
        (true, false),
    );
    adamw_q8_case(
        &mut run,
        &cpu,
        28,
        "q8.sr_params.l2.maximize",
        l2,
        (false, false),
    );
    adamw_q8_case(
        &mut run,
        &cpu,
        29,
        "q8.rows.split.clip.amsgrad",
        clip_ams,
        (true, true),
    );
    run
}

fn read_expected() -> BTreeMap<String, u64> {
    let text = std::fs::read_to_string(FILE).unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (k, v) = l.split_once(' ').expect("`name hash` lines");
            let v = u64::from_str_radix(v.trim().trim_start_matches("0x"), 16).expect("hex hash");
            (k.to_string(), v)
        })
        .collect()
}

#[test]
fn output_bits_match_the_checked_in_hashes() {
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|&i| i.is_available()).collect();
    let runs: Vec<(Isa, Run)> = isas.iter().map(|&i| (i, run_all(i))).collect();
    let (first_isa, first) = &runs[0];
    let mut errors = String::new();
    // Every ISA of this machine agrees with the first (the portable lanes).
    for (isa, r) in &runs[1..] {
        for (k, v) in &r.0 {
            if first.0.get(k) != Some(v) {
                let _ = writeln!(errors, "{k}: {isa:?} differs from {first_isa:?}");
            }
        }
    }
    if std::env::var_os("NPK_BLESS").is_some_and(|v| v == "1") {
        assert!(errors.is_empty(), "ISAs disagree, not blessing:\n{errors}");
        let mut text = String::from(
            "# FNV-1a 64 of each output's bits (tests/bit_hashes.rs); NPK_BLESS=1 rewrites.\n",
        );
        for (k, v) in &first.0 {
            let _ = writeln!(text, "{k} {v:#018x}");
        }
        std::fs::write(FILE, text).unwrap();
        return;
    }
    let want = read_expected();
    for (k, v) in &first.0 {
        match want.get(k) {
            Some(w) if w == v => {}
            Some(w) => {
                let _ = writeln!(
                    errors,
                    "{k}: bits differ on {} ({first_isa:?}): {v:#018x}, expected {w:#018x}",
                    std::env::consts::ARCH
                );
            }
            None => {
                let _ = writeln!(errors, "{k}: no expected hash (NPK_BLESS=1 to add)");
            }
        }
    }
    for k in want.keys().filter(|k| !first.0.contains_key(*k)) {
        let _ = writeln!(errors, "{k}: expected but not produced");
    }
    assert!(
        errors.is_empty(),
        "{} cases on {} ({isas:?}):\n{errors}",
        first.0.len(),
        std::env::consts::ARCH
    );
    println!(
        "{} output hashes match on {} under {isas:?}",
        first.0.len(),
        std::env::consts::ARCH
    );
}
