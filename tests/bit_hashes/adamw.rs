//! AdamW's cases of the bit-hash table: four parallel lists (a tensor across
//! several blocks, an empty one, one with a partial lane group, a single
//! element) per option set, every updated list and the report hashed.

use super::*;

/// The options every case starts from (step 7: the bias corrections are
/// not 1), `flags` on top.
fn options(flags: u32) -> AdamWOptions {
    AdamWOptions {
        step: 7,
        max_grad_norm: 0.05, // below the clip case's norm (about 0.1)
        grad_scale: 1024.0,
        clip_coef: 0.25,
        flags,
        ..AdamWOptions::new(1e-3)
    }
}

/// One step over fixed-seed lists: params `P` (from f32 masters when
/// `masters`), grads `G`, moments `M`.
pub fn adamw_case<P: Float, G: Float, M: Float>(
    run: &mut Run,
    cpu: &Cpu,
    seed: u64,
    case: &str,
    flags: u32,
    masters: bool,
) where
    for<'a> &'a mut [P]: Into<GradTensorMut<'a>>,
    for<'a> &'a [G]: Into<GradTensor<'a>>,
    for<'a> &'a mut [M]: Into<GradTensorMut<'a>>,
{
    let mut rng = Rng(seed);
    let scale = if flags & ADAMW_GRAD_SCALE != 0 {
        1024.0
    } else {
        1.0
    };
    let (mut p, mut g, mut m, mut v, mut x, mut w) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for n in [3001usize, 0, 77, 1] {
        let wv: Vec<f32> = vec_of(n, || rng.uniform(-1.0, 1.0));
        p.push(vec_of::<P>(n, || 0.0));
        p.last_mut()
            .unwrap()
            .iter_mut()
            .zip(&wv)
            .for_each(|(d, &s)| *d = P::from_f32(s));
        w.push(wv);
        g.push(vec_of::<G>(n, || rng.mag() * 1e-5 * scale));
        m.push(vec_of::<M>(n, || rng.mag() * 1e-6));
        v.push(vec_of::<M>(n, || rng.mag().abs() * 1e-9));
        x.push(vec_of::<M>(n, || rng.mag().abs() * 1e-9));
    }
    let ams = flags & ADAMW_AMSGRAD != 0;
    let report = {
        let mut pl: Vec<GradTensorMut> = p.iter_mut().map(|t| t.as_mut_slice().into()).collect();
        let gl: Vec<GradTensor> = g.iter().map(|t| t.as_slice().into()).collect();
        let mut ml: Vec<GradTensorMut> = m.iter_mut().map(|t| t.as_mut_slice().into()).collect();
        let mut vl: Vec<GradTensorMut> = v.iter_mut().map(|t| t.as_mut_slice().into()).collect();
        let mut xl: Vec<GradTensorMut> = if ams {
            x.iter_mut().map(|t| t.as_mut_slice().into()).collect()
        } else {
            vec![]
        };
        let mut wl: Vec<GradTensorMut> = if masters {
            w.iter_mut().map(|t| t.as_mut_slice().into()).collect()
        } else {
            vec![]
        };
        let mut t = AdamWTensors {
            params: &mut pl,
            grads: &gl,
            exp_avgs: &mut ml,
            exp_avg_sqs: &mut vl,
            max_exp_avg_sqs: &mut xl,
            masters: &mut wl,
        };
        let exec = Exec::new(cpu);
        let o = options(flags);
        let mut ws = vec![0u8; adamw_workspace_size(&exec, &mut t, &o).unwrap()];
        adamw(&exec, &mut t, &o, &mut ws).unwrap()
    };
    let name = |out: &str| format!("adamw.{case}.{out}");
    run.put(name("params"), hash(&p));
    run.put(name("exp_avgs"), hash(&m));
    run.put(name("exp_avg_sqs"), hash(&v));
    if ams {
        run.put(name("max_exp_avg_sqs"), hash(&x));
    }
    if masters {
        run.put(name("masters"), hash(&w));
    }
    let mut h = BitHash::new();
    h.u64(report.grad_norm.to_bits()).u64(report.stepped as u64);
    run.put(name("report"), h.0);
}

/// One hash over every tensor of a list, in order.
fn hash<T: Float>(list: &[Vec<T>]) -> u64 {
    list.iter().fold(BitHash::new(), |mut h, t| *h.floats(t)).0
}

/// One step with 8-bit moments (`quantized_moments`) over fixed-seed
/// lists (a tensor of several quantization blocks and a partial one, an
/// empty one, a partial lane group, a single element), from nonzero codes
/// and scales, bf16 params with split masters or none: params, codes,
/// scales and the masters' low halves hashed. `rows`: tensors cut into
/// rows (`q8_rows`: rows of 32, of 7 and of 300, short last blocks).
pub fn adamw_q8_case(
    run: &mut Run,
    cpu: &Cpu,
    seed: u64,
    case: &str,
    flags: u32,
    (split, rows): (bool, bool),
) {
    let mut rng = Rng(seed);
    let ams = flags & ADAMW_AMSGRAD != 0;
    let (mut p, mut g, mut low) = (vec![], vec![], vec![]);
    let (mut c, mut s) = ([vec![], vec![], vec![]], [vec![], vec![], vec![]]);
    let shapes: [(usize, u64); 4] = if rows {
        [(129 * 32, 32), (0, 0), (77, 7), (600, 300)]
    } else {
        [(3001, 0), (0, 0), (77, 0), (1, 0)]
    };
    let q8_rows: Vec<u64> = if rows {
        shapes.iter().map(|s| s.1).collect()
    } else {
        vec![]
    };
    for (n, row) in shapes {
        p.push(vec_of::<bf16>(n, || rng.uniform(-1.0, 1.0)));
        g.push(vec_of::<bf16>(n, || rng.mag() * 1e-5));
        low.push((0..n).map(|_| rng.next_u64() as i16).collect::<Vec<i16>>());
        for k in 0..3 {
            c[k].push(
                (0..n)
                    .map(|_| rng.next_u64() as u8 & if k == 0 { 0xff } else { 0xf7 })
                    .collect::<Vec<u8>>(),
            );
            let nq = Q8Grid::new(n, row as usize).scales_len(n);
            s[k].push(vec_of::<f32>(nq, || rng.mag().abs() * 1e-6));
        }
    }
    let report = {
        let mut pl: Vec<GradTensorMut> = p.iter_mut().map(|t| t.as_mut_slice().into()).collect();
        let gl: Vec<GradTensor> = g.iter().map(|t| t.as_slice().into()).collect();
        let [c0, c1, c2] = &mut c;
        let [s0, s1, s2] = &mut s;
        fn list<T>(l: &mut [Vec<T>]) -> Vec<GradTensorMut<'_>>
        where
            for<'a> &'a mut [T]: Into<GradTensorMut<'a>>,
        {
            l.iter_mut().map(|t| t.as_mut_slice().into()).collect()
        }
        let flist = list::<f32>;
        let (mut ml, mut vl, mut sml, mut svl) = (list(c0), list(c1), flist(s0), flist(s1));
        let (mut xl, mut sxl) = if ams {
            (list(c2), flist(s2))
        } else {
            (vec![], vec![])
        };
        let mut wl: Vec<GradTensorMut> = if split {
            low.iter_mut().map(|t| t.as_mut_slice().into()).collect()
        } else {
            vec![]
        };
        let mut t = AdamWTensors {
            params: &mut pl,
            grads: &gl,
            exp_avgs: &mut ml,
            exp_avg_sqs: &mut vl,
            max_exp_avg_sqs: &mut xl,
            masters: &mut wl,
        };
        let mut sc = AdamWScales {
            exp_avgs: &mut sml,
            exp_avg_sqs: &mut svl,
            max_exp_avg_sqs: &mut sxl,
        };
        let f = AdamWFormats {
            split_masters: split,
            rounding: if split { 0 } else { ADAMW_SR_PARAMS },
            quantized_moments: true,
            seed: 0x5eed,
            keys: &[],
            q8_rows: &q8_rows,
        };
        let exec = Exec::new(cpu);
        let o = options(flags);
        let n = adamw_with_scales_workspace_size(&exec, &mut t, &mut sc, &o, &f).unwrap();
        let mut ws = vec![0u8; n];
        adamw_with_scales(&exec, &mut t, &mut sc, &o, &f, &mut ws).unwrap()
    };
    let name = |out: &str| format!("adamw.{case}.{out}");
    run.put(name("params"), hash(&p));
    let lists = if ams { 3 } else { 2 };
    for (k, what) in ["exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"]
        .iter()
        .enumerate()
        .take(lists)
    {
        let mut h = BitHash::new();
        c[k].iter().for_each(|t| {
            h.bytes(t);
        });
        run.put(name(what), h.0);
        run.put(name(&format!("{what}.scales")), hash(&s[k]));
    }
    if split {
        let mut h = BitHash::new();
        low.iter().flatten().for_each(|&x| {
            h.u64(x as u16 as u64);
        });
        run.put(name("masters"), h.0);
    }
    let mut h = BitHash::new();
    h.u64(report.grad_norm.to_bits()).u64(report.stepped as u64);
    run.put(name("report"), h.0);
}
