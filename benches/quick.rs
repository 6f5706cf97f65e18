//! The quick ratio table: every operator x dtype x seed shape, kernel time
//! against a same-bytes copy (`copy_from_slice`) in the same process, median
//! of interleaved repetitions, single thread. Buffers rotate over enough sets
//! that the working set exceeds twice the last-level cache (kernel and copy
//! alike), so both run from DRAM.
//!
//! Run: `cargo run --release -p npukern-benches --bin quick` (add `--threads 2`
//! for the pool, the copy then also on 2 threads; `--reps N` for more repetitions, `--filter STR` to select rows (`^STR`: rows starting with it),
//! `--isa avx2` to force an ISA, `--cpu-clock` to time with the thread's CPU clock on a shared machine).

use std::hint::black_box;

use npukern::*;
use npukern_benches::{data, zeros, Aligned};

/// The seed shapes: `[a, b, h]`, gamma `[h]`.
const SHAPES: [[usize; 3]; 4] = [
    [1024, 1, 12288],
    [512, 4, 4096],
    [4, 2048, 5120],
    [2, 2048, 4096],
];

struct Opts {
    reps: usize,
    /// Time with the thread's CPU clock (single thread only): on a machine
    /// shared with other jobs it leaves out the time the thread was not
    /// running; both columns use the same clock.
    cpu_clock: bool,
    threads: usize,
    filter: Option<String>,
    llc: usize,
    /// `--isa portable|avx2|avx512|avx512bf16`: force one (default: the best available).
    isa: Option<Isa>,
}

fn llc_bytes() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let (num, mul) = match s.strip_suffix('K') {
                Some(v) => (v, 1024),
                None => match s.strip_suffix('M') {
                    Some(v) => (v, 1 << 20),
                    None => (s, 1),
                },
            };
            num.parse::<usize>().ok().map(|v| v * mul)
        })
        .unwrap_or(32 << 20)
}

/// Sets of buffers needed so `sets * footprint >= 2 * LLC`.
fn sets_for(footprint: usize, llc: usize) -> usize {
    (2 * llc).div_ceil(footprint.max(1)).max(1)
}

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
}

/// Seconds on CLOCK_THREAD_CPUTIME_ID (3) or CLOCK_MONOTONIC (1).
fn now(cpu: bool) -> f64 {
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: a valid clock id and a writable timespec.
    unsafe { clock_gettime(if cpu { 3 } else { 1 }, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `dst.copy_from_slice(src)`, on one thread or, with `threads > 1`, cut
/// into `threads` 64-byte-aligned parts run by the pool: the floor a
/// multi-threaded kernel is compared with (on a machine whose memory one
/// core saturates, two threads copy little faster than one).
fn copy_on(pool: &Threads, threads: usize, dst: &mut [u8], src: &[u8]) {
    if threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let part = src.len().div_ceil(threads).next_multiple_of(64);
    let (d, s, len) = (dst.as_mut_ptr() as usize, src.as_ptr() as usize, src.len());
    pool.parallel_for(threads, &|b| {
        let lo = (b * part).min(len);
        let hi = (lo + part).min(len);
        // SAFETY: part b of two distinct buffers of `len` bytes; the parts
        // are disjoint, so no two blocks write the same byte.
        unsafe {
            std::ptr::copy_nonoverlapping((s + lo) as *const u8, (d + lo) as *mut u8, hi - lo)
        };
    });
}

/// Times `kernel(set)` and a copy of `copy_bytes` bytes, interleaved, each
/// rotating over `sets` buffer sets; returns the medians in ms.
fn time_pair(
    o: &Opts,
    sets: usize,
    copy_bytes: usize,
    mut kernel: impl FnMut(usize),
) -> (f64, f64) {
    let src: Vec<Aligned<u8>> = (0..sets)
        .map(|i| Aligned::filled(i as u8 + 1, copy_bytes))
        .collect();
    let mut dst: Vec<Aligned<u8>> = (0..sets)
        .map(|_| Aligned::filled(0u8, copy_bytes))
        .collect();
    let pool = Threads::new(o.threads);
    let mut copy = |s: usize| copy_on(&pool, o.threads, &mut dst[s], black_box(&src[s]));
    // Warm-up: touch everything once.
    for s in 0..sets {
        kernel(s);
        copy(s);
    }
    let (mut tk, mut tc) = (Vec::new(), Vec::new());
    for r in 0..o.reps {
        let s = r % sets;
        let t = now(o.cpu_clock);
        kernel(s);
        tk.push((now(o.cpu_clock) - t) * 1e3);
        let t = now(o.cpu_clock);
        copy(s);
        tc.push((now(o.cpu_clock) - t) * 1e3);
    }
    (median(tk), median(tc))
}

/// Whether a row's key (`op shape dtype`) is selected by `--filter`: a
/// substring, or with a leading `^` a prefix.
fn matches(key: &str, filter: &str) -> bool {
    match filter.strip_prefix('^') {
        Some(p) => key.starts_with(p),
        None => key.contains(filter),
    }
}

fn row(op: &str, shape: &str, dt: &str, (k, c): (f64, f64)) {
    println!("| {op} | {shape} | {dt} | {k:.2} | {c:.2} | {:.2} |", k / c);
}

fn exec_for<'a>(cpu: &'a Cpu<Threads>) -> Exec<'a> {
    Exec::new(cpu)
}

fn norms<T: Float>(o: &Opts, cpu: &Cpu<Threads>, shape: [usize; 3]) {
    let n = shape[2];
    let m = shape[0] * shape[1];
    let dims = [shape[0], shape[1], n];
    let sname = format!("{}x{}x{}", shape[0], shape[1], n);
    let dt = format!("{:?}", T::DTYPE).to_lowercase();
    let elem = core::mem::size_of::<T>();
    let tb = m * n * elem;
    let exec = exec_for(cpu);
    let want = |op: &str| {
        o.filter
            .as_ref()
            .is_none_or(|f| matches(&format!("{op} {sname} {dt}"), f))
    };
    let gamma = data::<T>(n, 2);
    let gt = TensorRef::new(&gamma, &[n]).unwrap();
    let ropts = RmsNormOptions::default();
    if want("rms_norm") {
        let sets = sets_for(2 * tb, o.llc);
        let xs: Vec<Aligned<T>> = (0..sets).map(|i| data(m * n, 10 + i as u32)).collect();
        let mut ys: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(m * n)).collect();
        let mut rstd = vec![0f32; m];
        let xt0 = TensorRef::new(&xs[0], &dims).unwrap();
        let mut ws = vec![0u8; rms_norm_workspace_size(&exec, xt0, gt, &ropts).unwrap()];
        let r = time_pair(o, sets, tb, |s| {
            let xt = TensorRef::new(&xs[s], &dims).unwrap();
            rms_norm(&exec, xt, gt, &ropts, &mut ys[s], Some(&mut rstd), &mut ws).unwrap()
        });
        row("RmsNorm", &sname, &dt, r);
    }
    if want("add_rms_norm") {
        let sets = sets_for(4 * tb, o.llc);
        let x1s: Vec<Aligned<T>> = (0..sets).map(|i| data(m * n, 20 + i as u32)).collect();
        let x2s: Vec<Aligned<T>> = (0..sets).map(|i| data(m * n, 40 + i as u32)).collect();
        let mut ys: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(m * n)).collect();
        let mut ss: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(m * n)).collect();
        let mut rstd = vec![0f32; m];
        let a = TensorRef::new(&x1s[0], &dims).unwrap();
        let mut ws = vec![0u8; add_rms_norm_workspace_size(&exec, a, a, gt, &ropts).unwrap()];
        let r = time_pair(o, sets, 2 * tb, |s| {
            let a = TensorRef::new(&x1s[s], &dims).unwrap();
            let b = TensorRef::new(&x2s[s], &dims).unwrap();
            add_rms_norm(
                &exec,
                a,
                b,
                gt,
                &ropts,
                &mut ys[s],
                Some(&mut rstd),
                Some(&mut ss[s]),
                &mut ws,
            )
            .unwrap()
        });
        row("AddRmsNorm", &sname, &dt, r);
    }
    if want("rms_norm_grad") {
        let sets = sets_for(3 * tb, o.llc);
        let dys: Vec<Aligned<T>> = (0..sets).map(|i| data(m * n, 60 + i as u32)).collect();
        let xs: Vec<Aligned<T>> = (0..sets).map(|i| data(m * n, 80 + i as u32)).collect();
        let mut dxs: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(m * n)).collect();
        let rstd = vec![0.7f32; m];
        let rt = TensorRef::new(&rstd, &[shape[0], shape[1]]).unwrap();
        let gopts = RmsNormGradOptions::default();
        let a = TensorRef::new(&xs[0], &dims).unwrap();
        let mut ws =
            vec![
                0u8;
                rms_norm_grad_workspace_size(&exec, a, &RmsNormGradInputs::new(a, rt, gt), &gopts)
                    .unwrap()
            ];
        let mut dg = vec![0f32; n];
        let r = time_pair(o, sets, tb * 3 / 2, |s| {
            let dyt = TensorRef::new(&dys[s], &dims).unwrap();
            let xt = TensorRef::new(&xs[s], &dims).unwrap();
            let dgamma = Some(&mut dg[..]);
            rms_norm_grad(
                &exec,
                dyt,
                &RmsNormGradInputs::new(xt, rt, gt),
                &gopts,
                &mut dxs[s],
                DgammaOut {
                    dgamma,
                    dgamma_cast: None,
                },
                &mut ws,
            )
            .unwrap()
        });
        row("RmsNormGrad", &sname, &dt, r);
    }
}

/// 8192 x 4096 gradient rows into a `v`-row table (Zipf-like ids, or one id
/// taking half the positions when `hot`), grad dtype `G`, table dtype `O`.
fn embedding<G: Float, O: Float>(o: &Opts, cpu: &Cpu<Threads>, v: usize, hot: bool) {
    let (n, h) = (8192usize, 4096usize);
    let name = format!("{n}x{h}->{v}{}", if hot { " hot" } else { "" });
    let dt = format!("{:?}->{:?}", G::DTYPE, O::DTYPE).to_lowercase();
    if o.filter
        .as_ref()
        .is_some_and(|f| !matches(&format!("embedding {name} {dt}"), f))
    {
        return;
    }
    let exec = exec_for(cpu);
    let mut s = 0x2545_f491u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let indices: Vec<i64> = (0..n)
        .map(|i| {
            if hot && i % 2 == 0 {
                return 7;
            }
            let u = (next() % 1_000_000) as f64 / 1e6;
            ((v as f64).powf(u) as i64 - 1).clamp(0, v as i64 - 1)
        })
        .collect();
    let bytes = n * h * core::mem::size_of::<G>() + v * h * core::mem::size_of::<O>();
    let sets = sets_for(bytes, o.llc);
    let grads: Vec<Aligned<G>> = (0..sets).map(|i| data(n * h, 100 + i as u32)).collect();
    let mut tables: Vec<Aligned<O>> = (0..sets).map(|_| zeros::<O>(v * h)).collect();
    let it = TensorRef::new(&indices, &[n]).unwrap();
    let eopts = EmbeddingGradOptions::default();
    let gt0 = TensorRef::new(&grads[0], &[n, h]).unwrap();
    let mut ws = vec![0u8; embedding_dense_grad_workspace_size(&exec, gt0, it, v, &eopts).unwrap()];
    let r = time_pair(o, sets, bytes / 2, |s| {
        let gt = TensorRef::new(&grads[s], &[n, h]).unwrap();
        embedding_dense_grad(&exec, gt, it, v, &eopts, &mut tables[s], &mut ws).unwrap()
    });
    row("EmbeddingDenseGrad", &name, &dt, r);
}

/// One gated MLP activation's rows (`name`, `name_grad`): `fwd(exec, gate,
/// up, y)` and `bwd(exec, dy, gate, up, dgate, dup)` at `tokens x inter`,
/// inputs from seeds `seed`, `seed + 20`, ... (SwiGLU and GeGLU share the
/// traffic and the harness; only the kernel and the labels differ).
#[allow(clippy::too_many_arguments)]
fn gated_rows<T: Float>(
    o: &Opts,
    cpu: &Cpu<Threads>,
    tokens: usize,
    inter: usize,
    (name, label): (&str, &str),
    seed: u32,
    fwd: impl Fn(&Exec<'_>, TensorRef<'_, T>, TensorRef<'_, T>, &mut [T]) -> Result<()>,
    bwd: impl Fn(&Exec<'_>, [TensorRef<'_, T>; 3], &mut [T], &mut [T]) -> Result<()>,
) {
    let sname = format!("{tokens}x{inter}");
    let dt = format!("{:?}", T::DTYPE).to_lowercase();
    let want = |op: &str| {
        o.filter
            .as_ref()
            .is_none_or(|f| matches(&format!("{op} {sname} {dt}"), f))
    };
    let exec = exec_for(cpu);
    let len = tokens * inter;
    let tb = len * core::mem::size_of::<T>();
    let dims = [tokens, inter];
    let inputs = |sets: usize, seed: u32| -> Vec<Aligned<T>> {
        (0..sets).map(|i| data(len, seed + i as u32)).collect()
    };
    if want(name) {
        // Reads gate and up, writes y: the traffic of copying 1.5x one tensor.
        let sets = sets_for(3 * tb, o.llc);
        let (gs, us) = (inputs(sets, seed), inputs(sets, seed + 20));
        let mut ys: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(len)).collect();
        let r = time_pair(o, sets, tb * 3 / 2, |s| {
            let g = TensorRef::new(&gs[s], &dims).unwrap();
            let u = TensorRef::new(&us[s], &dims).unwrap();
            fwd(&exec, g, u, &mut ys[s]).unwrap()
        });
        row(label, &sname, &dt, r);
    }
    if want(&format!("{name}_grad")) {
        // Reads dy, gate, up; writes dgate, dup: 2.5x one tensor copied.
        let sets = sets_for(5 * tb, o.llc);
        let (dys, gs, us) = (
            inputs(sets, seed + 40),
            inputs(sets, seed + 60),
            inputs(sets, seed + 80),
        );
        let mut das: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(len)).collect();
        let mut dbs: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(len)).collect();
        let r = time_pair(o, sets, tb * 5 / 2, |s| {
            let dy = TensorRef::new(&dys[s], &dims).unwrap();
            let g = TensorRef::new(&gs[s], &dims).unwrap();
            let u = TensorRef::new(&us[s], &dims).unwrap();
            bwd(&exec, [dy, g, u], &mut das[s], &mut dbs[s]).unwrap()
        });
        row(&format!("{label}Grad"), &sname, &dt, r);
    }
}

/// SwiGLU (`silu_mul`, the two-input form) forward and backward at a LLaMA
/// MLP shape: `tokens x inter` gate and up.
fn swiglu_rows<T: Float>(o: &Opts, cpu: &Cpu<Threads>, tokens: usize, inter: usize) {
    let opts = SwigluOptions::default();
    gated_rows::<T>(
        o,
        cpu,
        tokens,
        inter,
        ("swiglu", "SwiGLU"),
        200,
        |e, g, u, y| silu_mul(e, g, u, &opts, y, &mut []),
        |e, [dy, g, u], da, db| silu_mul_grad(e, dy, g, u, &opts, da, db, &mut []),
    );
}

/// GeGLU (`gelu_mul`, the two-input form, GELU's tanh form as Gemma's MLP)
/// forward and backward at a Gemma MLP shape: `tokens x inter` gate and up.
fn geglu_rows<T: Float>(o: &Opts, cpu: &Cpu<Threads>, tokens: usize, inter: usize) {
    let opts = GegluOptions::default();
    gated_rows::<T>(
        o,
        cpu,
        tokens,
        inter,
        ("geglu", "GeGLU"),
        300,
        |e, g, u, y| gelu_mul(e, g, u, &opts, y, &mut []),
        |e, [dy, g, u], da, db| gelu_mul_grad(e, dy, g, u, &opts, da, db, &mut []),
    );
}

/// RoPE on q and k `[1, heads, seq, 128]` with cos/sin `[1, 1, seq, 128]`
/// (Hugging Face's layout), forward and backward.
fn rope_rows<T: Float>(o: &Opts, cpu: &Cpu<Threads>, heads: usize, seq: usize) {
    let d = 128usize;
    let sname = format!("2x{heads}x{seq}x{d}");
    let dt = format!("{:?}", T::DTYPE).to_lowercase();
    let exec = exec_for(cpu);
    let len = heads * seq * d;
    let tb = len * core::mem::size_of::<T>();
    let dims = [1, heads, seq, d];
    let cos = data::<T>(seq * d, 300);
    let sin = data::<T>(seq * d, 301);
    let cdims = [1, 1, seq, d];
    for backward in [false, true] {
        let op = if backward { "RoPEGrad" } else { "RoPE" };
        let key = format!("{} {sname} {dt}", op.to_lowercase());
        if o.filter.as_ref().is_some_and(|f| !matches(&key, f)) {
            continue;
        }
        let opts = RopeOptions {
            backward,
            ..Default::default()
        };
        // Reads q and k, writes both (cos/sin stay in cache): a copy of q + k.
        let sets = sets_for(4 * tb, o.llc);
        let qs: Vec<Aligned<T>> = (0..sets).map(|i| data(len, 320 + i as u32)).collect();
        let ks: Vec<Aligned<T>> = (0..sets).map(|i| data(len, 340 + i as u32)).collect();
        let mut qo: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(len)).collect();
        let mut ko: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(len)).collect();
        let (ct, st) = (
            TensorRef::new(&cos, &cdims).unwrap(),
            TensorRef::new(&sin, &cdims).unwrap(),
        );
        let r = time_pair(o, sets, 2 * tb, |s| {
            let q = TensorRef::new(&qs[s], &dims).unwrap();
            let k = TensorRef::new(&ks[s], &dims).unwrap();
            rope(
                &exec,
                q,
                Some(k),
                ct,
                st,
                &opts,
                &mut qo[s],
                Some(&mut ko[s]),
                &mut [],
            )
            .unwrap()
        });
        row(op, &sname, &dt, r);
    }
}

/// CrossEntropy forward (the mean loss and lse) then backward (dlogits out
/// of place) on `tokens x vocab` logits: the logits read twice and dlogits
/// written once, the traffic of copying 1.5x the logits.
fn cross_entropy_rows<T: Float>(o: &Opts, cpu: &Cpu<Threads>, tokens: usize, vocab: usize) {
    let sname = format!("{tokens}x{vocab}");
    let dt = format!("{:?}", T::DTYPE).to_lowercase();
    if o.filter
        .as_ref()
        .is_some_and(|f| !matches(&format!("cross_entropy {sname} {dt}"), f))
    {
        return;
    }
    let exec = exec_for(cpu);
    let len = tokens * vocab;
    let tb = len * core::mem::size_of::<T>();
    let dims = [tokens, vocab];
    let opts = CrossEntropyOptions::default();
    let target: Vec<i64> = (0..tokens).map(|i| (i * 7919 % vocab) as i64).collect();
    let tt = CrossEntropyTargets::new(TensorRef::new(&target, &[tokens]).unwrap());
    let sets = sets_for(2 * tb, o.llc);
    let xs: Vec<Aligned<T>> = (0..sets).map(|i| data(len, 400 + i as u32)).collect();
    let mut dxs: Vec<Aligned<T>> = (0..sets).map(|_| zeros::<T>(len)).collect();
    let (mut loss, mut lse) = ([0f32], vec![0f32; tokens]);
    let x0 = TensorRef::new(&xs[0], &dims).unwrap();
    let mut ws = vec![0u8; cross_entropy_workspace_size(&exec, x0, tt, &opts).unwrap()];
    let r = time_pair(o, sets, tb * 3 / 2, |s| {
        let x = TensorRef::new(&xs[s], &dims).unwrap();
        cross_entropy(&exec, x, tt, &opts, &mut loss, Some(&mut lse), &mut ws).unwrap();
        cross_entropy_grad(&exec, x, tt, &lse, &[1.0], &opts, &mut dxs[s], &mut []).unwrap()
    });
    row("CrossEntropy fwd+bwd", &sname, &dt, r);
    // The fused form (what linear_cross_entropy runs per chunk): the loss
    // and dlogits in place in one call, against the same copy.
    let g = [1.0 / tokens as f32];
    let fopts = CrossEntropyOptions {
        reduction: Reduction::None,
        ..opts
    };
    let mut ws = vec![0u8; cross_entropy_fused_workspace_size(&exec, x0, tt, &fopts).unwrap()];
    let mut losses = vec![0f32; tokens];
    let mut xs = xs;
    let r = time_pair(o, sets, tb * 3 / 2, |s| {
        let x = TensorMut::new(&mut xs[s], &dims).unwrap();
        cross_entropy_fused(&exec, x, tt, &g, &fopts, &mut losses, None, &mut ws).unwrap()
    });
    row("CrossEntropy fused", &sname, &dt, r);
}

/// The per-call cost of a parallel launch: `Threads::parallel_for` over 2
/// empty blocks vs the serial loop, and a 1 x 4096 bf16 RmsNorm (which the
/// plan keeps in one block, so it runs serially on any runner).
fn overhead(o: &Opts) {
    let reps = 2000;
    let t2 = Threads::new(2);
    let time = |f: &dyn Fn()| {
        let mut v: Vec<f64> = (0..o.reps)
            .map(|_| {
                let t = now(false);
                for _ in 0..reps {
                    f();
                }
                (now(false) - t) / reps as f64 * 1e6
            })
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let spawn = time(&|| {
        t2.parallel_for(2, &|b| {
            black_box(b);
        })
    });
    // The same launch after 1 ms idle, when the pool's workers have stopped
    // spinning and sleep: a futex wake.
    let mut cold: Vec<f64> = (0..200)
        .map(|_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            let t = now(false);
            t2.parallel_for(2, &|b| {
                black_box(b);
            });
            (now(false) - t) * 1e6
        })
        .collect();
    cold.sort_by(|a, b| a.total_cmp(b));
    let cold = cold[cold.len() / 2];
    let gamma = data::<bf16>(4096, 2);
    let gt = TensorRef::new(&gamma, &[4096]).unwrap();
    let cpu2 = Cpu::new(t2);
    let (e1, e2) = (Exec::cpu(), Exec::new(&cpu2));
    let opts = RmsNormOptions::default();
    print!(
        "\nper-call overhead (us, median): Threads::new(2).parallel_for(2 empty blocks) {spawn:.2} back to back, {cold:.2} after 1 ms idle"
    );
    // 1 row: one block. 64 rows (512 KiB): blocks, over SERIAL_MAX_BYTES,
    // so they run on the pool.
    for rows in [1usize, 64] {
        let x = data::<bf16>(rows * 4096, 1);
        let xt = TensorRef::new(&x, &[rows, 4096]).unwrap();
        let mut ws = vec![0u8; rms_norm_workspace_size(&e2, xt, gt, &opts).unwrap()];
        let y = std::cell::RefCell::new(vec![bf16::ZERO; rows * 4096]);
        let ws = std::cell::RefCell::new(&mut ws);
        let run = |e: &Exec<'_>| {
            rms_norm(
                e,
                xt,
                gt,
                &opts,
                &mut y.borrow_mut(),
                None,
                &mut ws.borrow_mut(),
            )
            .unwrap()
        };
        let serial = time(&|| run(&e1));
        let pooled = time(&|| run(&e2));
        print!("; rms_norm {rows}x4096 bf16: serial {serial:.2}, on Threads(2) {pooled:.2}");
    }
    println!();
}

fn main() {
    let mut o = Opts {
        reps: 11,
        cpu_clock: false,
        threads: 1,
        filter: None,
        llc: llc_bytes(),
        isa: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => o.reps = args.next().and_then(|v| v.parse().ok()).unwrap_or(o.reps),
            "--threads" => o.threads = args.next().and_then(|v| v.parse().ok()).unwrap_or(1),
            "--filter" => o.filter = args.next(),
            "--cpu-clock" => o.cpu_clock = true,
            "--isa" => {
                let want = args.next().unwrap_or_default().to_lowercase();
                o.isa = Isa::ALL
                    .into_iter()
                    .find(|i| format!("{i:?}").to_lowercase() == want && i.is_available());
            }
            "--overhead" => return overhead(&o),
            _ => {}
        }
    }
    let mut cpu = Cpu::new(Threads::new(o.threads));
    if let Some(isa) = o.isa {
        cpu = cpu.with_isa(isa);
    }
    println!(
        "npukern quick table: {} thread(s), LLC {} MiB, median of {} (kernel / same-bytes copy on {} thread(s)), {} clock\n",
        o.threads,
        o.llc >> 20,
        o.reps,
        o.threads,
        if o.cpu_clock { "thread CPU" } else { "wall" }
    );
    println!("| op | shape | dtype | kernel ms | copy ms | ratio |");
    println!("|---|---|---|---|---|---|");
    for shape in SHAPES {
        norms::<bf16>(&o, &cpu, shape);
        norms::<f16>(&o, &cpu, shape);
        norms::<f32>(&o, &cpu, shape);
    }
    for v in [32000usize, 152_064] {
        embedding::<bf16, bf16>(&o, &cpu, v, false);
        embedding::<f32, f32>(&o, &cpu, v, false);
        embedding::<bf16, f32>(&o, &cpu, v, false);
    }
    embedding::<bf16, bf16>(&o, &cpu, 32000, true);
    embedding::<f32, f32>(&o, &cpu, 32000, true);
    for inter in [11008usize, 14336] {
        swiglu_rows::<bf16>(&o, &cpu, 4096, inter);
        swiglu_rows::<f16>(&o, &cpu, 4096, inter);
        swiglu_rows::<f32>(&o, &cpu, 4096, inter);
    }
    // Gemma 7B's MLP width (Gemma 2 9B: 14336, as LLaMA 3 8B's above).
    for inter in [14336usize, 24576] {
        geglu_rows::<bf16>(&o, &cpu, 4096, inter);
        geglu_rows::<f16>(&o, &cpu, 4096, inter);
        geglu_rows::<f32>(&o, &cpu, 4096, inter);
    }
    rope_rows::<bf16>(&o, &cpu, 32, 4096);
    rope_rows::<f16>(&o, &cpu, 32, 4096);
    rope_rows::<f32>(&o, &cpu, 32, 4096);
    for (tokens, vocab) in [(1024usize, 32000usize), (256, 128_256)] {
        cross_entropy_rows::<bf16>(&o, &cpu, tokens, vocab);
        cross_entropy_rows::<f16>(&o, &cpu, tokens, vocab);
        cross_entropy_rows::<f32>(&o, &cpu, tokens, vocab);
    }
}
