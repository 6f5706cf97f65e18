//! The store-policy table (`docs/performance.md` "Store policy"): every
//! operator with a large output (>= `STREAM_MIN_BYTES`), run into
//!
//! - a **resident** output (mapped and written once, reused every
//!   repetition), and
//! - a **fresh** output (a new anonymous `mmap` every repetition, unmapped
//!   after it, untimed: what `torch.empty` of a large tensor is; the OS
//!   faults and zeroes each page on its first touch),
//!
//! with ordinary stores (`OutputPages::Fresh`) and streaming stores
//! (`OutputPages::Resident`), and also after `madvise(MADV_POPULATE_WRITE)`
//! (every page faulted before the call, in one system call) or, for fresh
//! outputs, `madvise(MADV_HUGEPAGE)` (transparent huge pages), each
//! `madvise` timed with the call. The copy rows write the same output bytes from a
//! resident source with ordinary and streaming 32-byte stores. Medians of
//! interleaved repetitions in ms, one thread; the `flt` column is the minor
//! page faults of one fresh call.
//!
//! Run (Linux): `taskset -c 0 cargo run --release -p npukern-benches --bin stores`
//! (`--reps N`, `--filter STR`, `--threads N`).

use std::alloc::{alloc, dealloc, Layout};
use std::hint::black_box;

use npukern::*;
use npukern_benches::data;

const PROT_READ_WRITE: i32 = 3;
const MAP_PRIVATE_ANONYMOUS: i32 = 0x22;
const MADV_HUGEPAGE: i32 = 14;
const MADV_POPULATE_WRITE: i32 = 23;

#[repr(C)]
struct Timespec {
    sec: i64,
    nsec: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, t: *mut Timespec) -> i32;
    fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
    fn munmap(addr: *mut u8, len: usize) -> i32;
    fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
    fn getrusage(who: i32, usage: *mut [i64; 18]) -> i32;
}

fn now() -> f64 {
    let mut t = Timespec { sec: 0, nsec: 0 };
    // SAFETY: a valid clock id and a writable timespec.
    unsafe { clock_gettime(1, &mut t) };
    t.sec as f64 + t.nsec as f64 * 1e-9
}

/// Minor page faults of this process so far (`ru_minflt`).
fn minflt() -> i64 {
    let mut u = [0i64; 18];
    // SAFETY: RUSAGE_SELF and a buffer of `struct rusage`'s size (144 bytes).
    unsafe { getrusage(0, &mut u) };
    u[8]
}

/// An anonymous private mapping of `len` bytes, page-aligned.
struct Map {
    p: *mut u8,
    len: usize,
}

impl Map {
    fn new(len: usize) -> Map {
        // SAFETY: an anonymous private mapping; checked below.
        let p = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                PROT_READ_WRITE,
                MAP_PRIVATE_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(p as isize != -1 && !p.is_null(), "mmap failed");
        Map { p, len }
    }
}

/// `madvise` on the whole pages inside `[p, p + len)` (what an adapter can
/// do to an output it did not map itself).
fn advise(p: *mut u8, len: usize, advice: i32) {
    let lo = (p as usize).next_multiple_of(4096);
    let hi = (p as usize + len) / 4096 * 4096;
    if hi > lo {
        // SAFETY: pages of a live allocation of ours.
        let r = unsafe { madvise(lo as *mut u8, hi - lo, advice) };
        assert_eq!(r, 0, "madvise({advice}) failed");
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        unsafe { munmap(self.p, self.len) };
    }
}

/// One operator at one shape: its output sizes and a call writing them.
struct Case {
    name: String,
    outs: Vec<usize>,
    #[allow(clippy::type_complexity)]
    run: Box<dyn FnMut(&Exec<'_>, &[*mut u8])>,
}

/// `len` elements of `T` at `p` (a mapping of at least that many bytes).
fn out<'a, T>(p: *mut u8, len: usize) -> &'a mut [T] {
    // SAFETY: the caller's mapping holds `len` Ts, page-aligned, and no
    // other slice of it is live during the call.
    unsafe { std::slice::from_raw_parts_mut(p as *mut T, len) }
}

fn dt<T: Float>() -> String {
    format!("{:?}", T::DTYPE).to_lowercase()
}

fn norm_cases<T: Float + 'static>(cases: &mut Vec<Case>, m: usize, n: usize) {
    let e = core::mem::size_of::<T>();
    let gamma = data::<T>(n, 2);
    let x1 = data::<T>(m * n, 10);
    let x2 = data::<T>(m * n, 11);
    let ropts = RmsNormOptions::default();
    let ex = Exec::cpu();
    let ws_len = {
        let xt = TensorRef::new(&x1, &[m, n]).unwrap();
        let gt = TensorRef::new(&gamma, &[n]).unwrap();
        let a = rms_norm_workspace_size(&ex, xt, gt, &ropts).unwrap();
        let b = add_rms_norm_workspace_size(&ex, xt, xt, gt, &ropts).unwrap();
        let rstd = vec![0.7f32; m];
        let rt = TensorRef::new(&rstd, &[m]).unwrap();
        let c = rms_norm_grad_workspace_size(
            &ex,
            xt,
            &RmsNormGradInputs::new(xt, rt, gt),
            &RmsNormGradOptions::default(),
        )
        .unwrap();
        a.max(b).max(c)
    };
    let shared = std::rc::Rc::new((gamma, x1, x2));
    let s = shared.clone();
    let mut ws = vec![0u8; ws_len];
    let mut rstd = vec![0f32; m];
    cases.push(Case {
        name: format!("RmsNorm {m}x{n} {}", dt::<T>()),
        outs: vec![m * n * e],
        run: Box::new(move |ex, o| {
            let xt = TensorRef::new(&s.1, &[m, n]).unwrap();
            let gt = TensorRef::new(&s.0, &[n]).unwrap();
            rms_norm(
                ex,
                xt,
                gt,
                &ropts,
                out::<T>(o[0], m * n),
                Some(&mut rstd),
                &mut ws,
            )
            .unwrap()
        }),
    });
    let s = shared.clone();
    let mut ws = vec![0u8; ws_len];
    let mut rstd = vec![0f32; m];
    cases.push(Case {
        name: format!("AddRmsNorm {m}x{n} {}", dt::<T>()),
        outs: vec![m * n * e, m * n * e],
        run: Box::new(move |ex, o| {
            let a = TensorRef::new(&s.1, &[m, n]).unwrap();
            let b = TensorRef::new(&s.2, &[m, n]).unwrap();
            let gt = TensorRef::new(&s.0, &[n]).unwrap();
            let (y, xs) = (out::<T>(o[0], m * n), out::<T>(o[1], m * n));
            add_rms_norm(ex, a, b, gt, &ropts, y, Some(&mut rstd), Some(xs), &mut ws).unwrap()
        }),
    });
    let s = shared;
    let mut ws = vec![0u8; ws_len];
    let rstd = vec![0.7f32; m];
    let mut dg = vec![0f32; n];
    cases.push(Case {
        name: format!("RmsNormGrad {m}x{n} {}", dt::<T>()),
        outs: vec![m * n * e],
        run: Box::new(move |ex, o| {
            let dy = TensorRef::new(&s.2, &[m, n]).unwrap();
            let xt = TensorRef::new(&s.1, &[m, n]).unwrap();
            let gt = TensorRef::new(&s.0, &[n]).unwrap();
            let rt = TensorRef::new(&rstd, &[m]).unwrap();
            rms_norm_grad(
                ex,
                dy,
                &RmsNormGradInputs::new(xt, rt, gt),
                &RmsNormGradOptions::default(),
                out::<T>(o[0], m * n),
                DgammaOut {
                    dgamma: Some(&mut dg[..]),
                    dgamma_cast: None,
                },
                &mut ws,
            )
            .unwrap()
        }),
    });
}

fn elt_cases<T: Float + 'static>(
    cases: &mut Vec<Case>,
    tokens: usize,
    inter: usize,
    heads: usize,
    seq: usize,
) {
    let e = core::mem::size_of::<T>();
    let len = tokens * inter;
    let (g, u, dy) = (
        data::<T>(len, 200),
        data::<T>(len, 220),
        data::<T>(len, 240),
    );
    let shared = std::rc::Rc::new((g, u, dy));
    let s = shared.clone();
    let opts = SwigluOptions::default();
    cases.push(Case {
        name: format!("SwiGLU {tokens}x{inter} {}", dt::<T>()),
        outs: vec![len * e],
        run: Box::new(move |ex, o| {
            let g = TensorRef::new(&s.0, &[tokens, inter]).unwrap();
            let u = TensorRef::new(&s.1, &[tokens, inter]).unwrap();
            silu_mul(ex, g, u, &opts, out::<T>(o[0], len), &mut []).unwrap()
        }),
    });
    let s = shared;
    cases.push(Case {
        name: format!("SwiGLUGrad {tokens}x{inter} {}", dt::<T>()),
        outs: vec![len * e, len * e],
        run: Box::new(move |ex, o| {
            let dims = [tokens, inter];
            let dy = TensorRef::new(&s.2, &dims).unwrap();
            let g = TensorRef::new(&s.0, &dims).unwrap();
            let u = TensorRef::new(&s.1, &dims).unwrap();
            let (da, db) = (out::<T>(o[0], len), out::<T>(o[1], len));
            silu_mul_grad(ex, dy, g, u, &opts, da, db, &mut []).unwrap()
        }),
    });
    let d = 128usize;
    let rl = heads * seq * d;
    let (q, k) = (data::<T>(rl, 320), data::<T>(rl, 340));
    let (cos, sin) = (data::<T>(seq * d, 300), data::<T>(seq * d, 301));
    cases.push(Case {
        name: format!("RoPE 2x{heads}x{seq}x{d} {}", dt::<T>()),
        outs: vec![rl * e, rl * e],
        run: Box::new(move |ex, o| {
            let dims = [1, heads, seq, d];
            let cd = [1, 1, seq, d];
            let (ct, st) = (
                TensorRef::new(&cos, &cd).unwrap(),
                TensorRef::new(&sin, &cd).unwrap(),
            );
            let qt = TensorRef::new(&q, &dims).unwrap();
            let kt = TensorRef::new(&k, &dims).unwrap();
            let (qo, ko) = (out::<T>(o[0], rl), out::<T>(o[1], rl));
            rope(
                ex,
                qt,
                Some(kt),
                ct,
                st,
                &RopeOptions::default(),
                qo,
                Some(ko),
                &mut [],
            )
            .unwrap()
        }),
    });
}

fn embedding_case<T: Float + 'static>(cases: &mut Vec<Case>, n: usize, h: usize, v: usize) {
    let e = core::mem::size_of::<T>();
    let mut s = 0x2545_f491u64;
    let indices: Vec<i64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s % 1_000_000) as f64 / 1e6;
            ((v as f64).powf(u) as i64 - 1).clamp(0, v as i64 - 1)
        })
        .collect();
    let grad = data::<T>(n * h, 100);
    let eopts = EmbeddingGradOptions::default();
    let ws_len = {
        let gt = TensorRef::new(&grad, &[n, h]).unwrap();
        let it = TensorRef::new(&indices, &[n]).unwrap();
        embedding_dense_grad_workspace_size(&Exec::cpu(), gt, it, v, &eopts).unwrap()
    };
    let mut ws = vec![0u8; ws_len];
    cases.push(Case {
        name: format!("EmbeddingDenseGrad {n}x{h}->{v} {}", dt::<T>()),
        outs: vec![v * h * e],
        run: Box::new(move |ex, o| {
            let gt = TensorRef::new(&grad, &[n, h]).unwrap();
            let it = TensorRef::new(&indices, &[n]).unwrap();
            embedding_dense_grad(ex, gt, it, v, &eopts, out::<T>(o[0], v * h), &mut ws).unwrap()
        }),
    });
}

/// Copies `src` to `dst` with 32-byte AVX stores, streaming with `STREAM`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn copy_avx<const STREAM: bool>(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::*;
    let mut i = 0;
    while i + 128 <= len {
        for j in 0..4 {
            let o = i + 32 * j;
            // SAFETY: in bounds; dst is 64-byte aligned (page-aligned mapping).
            unsafe {
                let v = _mm256_loadu_si256(src.add(o) as *const __m256i);
                if STREAM {
                    _mm256_stream_si256(dst.add(o) as *mut __m256i, v);
                } else {
                    _mm256_store_si256(dst.add(o) as *mut __m256i, v);
                }
            }
        }
        i += 128;
    }
    // SAFETY: the tail, in bounds.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) };
    if STREAM {
        _mm_sfence();
    }
}

/// The copy baseline's call: the same output bytes from a resident source.
fn copy_case(name: &str, outs: &[usize]) -> Case {
    let srcs: Vec<Vec<u8>> = outs.iter().map(|&b| vec![7u8; b]).collect();
    let outs = outs.to_vec();
    Case {
        name: format!("copy ({name})"),
        outs: outs.clone(),
        run: Box::new(move |ex, o| {
            // The hint picks the stores, as for the kernels.
            let stream = ex.outputs.stream(true);
            for (src, &d) in srcs.iter().zip(o) {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `d` maps `src.len()` bytes; AVX is checked in main.
                unsafe {
                    if stream {
                        copy_avx::<true>(d, src.as_ptr(), src.len())
                    } else {
                        copy_avx::<false>(d, src.as_ptr(), src.len())
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                out::<u8>(d, src.len()).copy_from_slice(src);
            }
            black_box(&outs);
        }),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// What is done to the output mapping before the call (timed with it).
#[derive(Clone, Copy, PartialEq)]
enum Prep {
    /// Nothing.
    None,
    /// `madvise(MADV_POPULATE_WRITE)`: every page faulted in one system call.
    Populate,
    /// `madvise(MADV_HUGEPAGE)`: transparent 2 MiB pages (512 times fewer faults).
    Huge,
}

/// Where the output comes from.
#[derive(Clone, Copy, PartialEq)]
enum Src {
    /// One mapping, written once, reused.
    Resident,
    /// A new `mmap` per repetition.
    Fresh,
    /// `std::alloc` (glibc `malloc`) per repetition, freed after it: what
    /// `torch.empty` gets (glibc's mmap threshold rises to the largest
    /// freed chunk, up to 32 MiB, so smaller outputs come back resident).
    Malloc,
}

/// The columns: (output, preparation, hint).
const MODES: [(Src, Prep, OutputPages); 13] = [
    (Src::Resident, Prep::None, OutputPages::Fresh),
    (Src::Resident, Prep::None, OutputPages::Resident),
    (Src::Resident, Prep::Populate, OutputPages::Resident),
    (Src::Resident, Prep::Huge, OutputPages::Resident),
    (Src::Fresh, Prep::None, OutputPages::Fresh),
    (Src::Fresh, Prep::None, OutputPages::Resident),
    (Src::Fresh, Prep::Populate, OutputPages::Fresh),
    (Src::Fresh, Prep::Populate, OutputPages::Resident),
    (Src::Fresh, Prep::Huge, OutputPages::Fresh),
    (Src::Fresh, Prep::Huge, OutputPages::Resident),
    (Src::Malloc, Prep::None, OutputPages::Fresh),
    (Src::Malloc, Prep::None, OutputPages::Resident),
    (Src::Malloc, Prep::Huge, OutputPages::Resident),
];

const HEADER: &str = "| op | out MiB | resident ordinary | resident stream | resident populate+stream | resident THP+stream | fresh ordinary | fresh stream | fresh populate+ordinary | fresh populate+stream | fresh THP+ordinary | fresh THP+stream | malloc ordinary | malloc stream | malloc THP+stream | faults |";
const RULE: &str = "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

fn measure(c: &mut Case, reps: usize, cpu: &Cpu<Threads>) {
    let resident: Vec<Map> = c.outs.iter().map(|&b| Map::new(b)).collect();
    let rp: Vec<*mut u8> = resident.iter().map(|m| m.p).collect();
    for m in &resident {
        // SAFETY: our mapping, written once so every page is resident.
        unsafe { std::ptr::write_bytes(m.p, 1, m.len) };
    }
    // Warm-up.
    (c.run)(&Exec::new(cpu), &rp);
    let mut t = vec![Vec::new(); MODES.len()];
    let mut faults = 0;
    for r in 0..reps {
        // Rotate which mode goes first, so none always follows another.
        for k in 0..MODES.len() {
            let i = (k + r) % MODES.len();
            let (src, prep, hint) = MODES[i];
            let ex = Exec::new(cpu).with_outputs(hint);
            let fresh: Vec<Map> = match src {
                Src::Fresh => c.outs.iter().map(|&b| Map::new(b)).collect(),
                _ => Vec::new(),
            };
            let layouts: Vec<Layout> = c
                .outs
                .iter()
                .map(|&b| Layout::from_size_align(b, 64).unwrap())
                .collect();
            let p: Vec<*mut u8> = match src {
                Src::Resident => resident.iter().map(|m| m.p).collect(),
                Src::Fresh => fresh.iter().map(|m| m.p).collect(),
                // SAFETY: nonzero sizes; freed below.
                Src::Malloc => layouts.iter().map(|&l| unsafe { alloc(l) }).collect(),
            };
            assert!(p.iter().all(|p| !p.is_null()));
            let f0 = minflt();
            let t0 = now();
            for (&q, &b) in p.iter().zip(&c.outs) {
                match prep {
                    Prep::None => {}
                    Prep::Populate => advise(q, b, MADV_POPULATE_WRITE),
                    Prep::Huge => advise(q, b, MADV_HUGEPAGE),
                }
            }
            (c.run)(&ex, &p);
            t[i].push((now() - t0) * 1e3);
            if i == 4 {
                faults = minflt() - f0;
            }
            if src == Src::Malloc {
                for (&q, &l) in p.iter().zip(&layouts) {
                    // SAFETY: allocated above with this layout.
                    unsafe { dealloc(q, l) };
                }
            }
            drop(fresh);
        }
    }
    let mib: usize = c.outs.iter().sum::<usize>() >> 20;
    let ms: Vec<String> = t.into_iter().map(|v| format!("{:.1}", median(v))).collect();
    println!("| {} | {mib} | {} | {faults} |", c.name, ms.join(" | "));
}

fn main() {
    let mut reps = 7;
    let mut filter: Option<String> = None;
    let mut threads = 1usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => reps = args.next().and_then(|v| v.parse().ok()).unwrap_or(reps),
            "--filter" => filter = args.next(),
            "--threads" => threads = args.next().and_then(|v| v.parse().ok()).unwrap_or(1),
            _ => {}
        }
    }
    #[cfg(target_arch = "x86_64")]
    assert!(
        std::arch::is_x86_feature_detected!("avx"),
        "the copy rows need AVX"
    );
    println!(
        "npukern store-policy table: {threads} thread(s), ISA {:?}, median of {reps} ms (ordinary = OutputPages::Fresh, stream = OutputPages::Resident)\n",
        Isa::detected()
    );
    let cpu = Cpu::new(Threads::new(threads));
    println!("{HEADER}");
    println!("{RULE}");
    let mut cases = Vec::new();
    norm_cases::<bf16>(&mut cases, 2048, 4096);
    norm_cases::<bf16>(&mut cases, 4096, 4096);
    norm_cases::<f32>(&mut cases, 4096, 4096);
    elt_cases::<bf16>(&mut cases, 2048, 11008, 32, 2048);
    elt_cases::<f32>(&mut cases, 2048, 11008, 32, 2048);
    embedding_case::<bf16>(&mut cases, 8192, 4096, 8192);
    embedding_case::<f32>(&mut cases, 8192, 4096, 8192);
    for mib in [16usize, 64] {
        let b = mib << 20;
        cases.push(copy_case(&format!("{mib} MiB"), &[b]));
    }
    for mut c in cases {
        if filter
            .as_ref()
            .is_some_and(|f| !c.name.contains(f.as_str()))
        {
            continue;
        }
        measure(&mut c, reps, &cpu);
    }
}
