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
