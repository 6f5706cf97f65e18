//! The matmul against the core's FMA peak: a microbenchmark of independent
//! FMAs (the physical limit, per ISA), then `npukern::matmul` on the step's
//! shapes (hidden 1024, MLP 2816, vocab 32 000, 512 tokens; each with its
//! transposes: forward `x W^T`, dx `dy W`, dW `dy^T x`) on one thread,
//! GFLOP/s and the fraction of the peak.
//!
//!   taskset -c 0 cargo run --release -p npukern-benches --bin matmul_peak [-- --isa avx2] [--quick] [--filter dW] [--shape 672x256x512:tb]
//!
//! Times are the thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), best of
//! several runs, the peak's as the matmul's: on a machine shared with other
//! work the wall clock counts their time slices too, the thread's CPU time
//! only its own (both agree on an idle core).

use npukern::*;

/// Seconds of CPU time this thread has run.
fn thread_secs() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer; the clock exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// The least thread CPU time of three runs of `f`, in seconds.
///
/// # Safety
/// `f`'s ISA is available.
#[cfg(target_arch = "x86_64")]
unsafe fn best_of_3(f: unsafe fn() -> f32) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = thread_secs();
        // SAFETY: the caller's.
        let s = unsafe { f() };
        best = best.min(thread_secs() - t);
        std::hint::black_box(s);
    }
    best
}

/// What VDPBF16PS computes, against three definitions on random lanes
/// (normal bf16 over a wide exponent range, subnormal ones, sums that
/// cancel): `(lanes, matches of each)`. Intel's pseudo-code is the first
/// (`acc + a[2j+1] b[2j+1]`, then `+ a[2j] b[2j]`, each rounded, bf16
/// subnormals read as 0, subnormal results flushed): a matmul on this
/// instruction has bits a portable FMA chain can reproduce only if the
/// CPU does exactly that.
///
/// # Safety
/// AVX512-BF16 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dpbf16_bits() -> (u64, u64, u64, u64) {
    use core::arch::x86_64::*;
    let bf = |x: u16| f32::from_bits(u32::from(x) << 16);
    let flush = |x: f32| {
        if x.is_subnormal() {
            0f32.copysign(x)
        } else {
            x
        }
    };
    // One FMA with x86's FTZ, whose tininess is detected after rounding
    // (tests/matmul_dot.rs: `fma_ftz`).
    let fma_ftz = |a: f32, b: f32, c: f32| {
        let r = a.mul_add(b, c);
        let t = f64::from(f32::MIN_POSITIVE) * (1.0 - 2f64.powi(-25));
        if (f64::from(c) + f64::from(a) * f64::from(b)).abs() < t {
            0f32.copysign(r)
        } else {
            r
        }
    };
    let mut s: u64 = 0x1234_5678_9abc_def1;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut m = (0u64, 0u64, 0u64, 0u64);
    for it in 0..20_000u64 {
        let spread = if it % 10 == 0 { 200 } else { 16 };
        let mut acc = [0f32; 16];
        let mut a = [0u16; 32];
        let mut b = [0u16; 32];
        for j in 0..16 {
            let mut e = || {
                let r = rnd();
                ((r & 1) as u16) << 15
                    | ((120 + (r >> 1) % spread) as u16) << 7
                    | ((r >> 8) & 0x7f) as u16
            };
            (a[2 * j], a[2 * j + 1], b[2 * j], b[2 * j + 1]) = (e(), e(), e(), e());
            if it % 7 == 0 {
                a[2 * j] = (rnd() & 0x807f) as u16; // a bf16 subnormal
            }
            let r = rnd();
            acc[j] = if it % 3 == 0 {
                -(bf(a[2 * j]) * bf(b[2 * j])) // the pair's sum cancels
            } else {
                f32::from_bits(
                    (r as u32 & 0x8000_0000)
                        | (((r >> 32) as u32 % 40 + 110) << 23)
                        | ((r >> 40) as u32 & 0x7f_ffff),
                )
            };
        }
        let mut got = [0f32; 16];
        // SAFETY: AVX512-BF16 (the caller's); 64-byte arrays.
        unsafe {
            let r = _mm512_dpbf16_ps(
                _mm512_loadu_ps(acc.as_ptr()),
                core::mem::transmute::<[u16; 32], __m512bh>(a),
                core::mem::transmute::<[u16; 32], __m512bh>(b),
            );
            _mm512_storeu_ps(got.as_mut_ptr(), r);
        }
        for j in 0..16 {
            let (a0, a1) = (flush(bf(a[2 * j])), flush(bf(a[2 * j + 1])));
            let (b0, b1) = (flush(bf(b[2 * j])), flush(bf(b[2 * j + 1])));
            let c = flush(acc[j]);
            let odd = fma_ftz(a0, b0, fma_ftz(a1, b1, c));
            let even = fma_ftz(a1, b1, fma_ftz(a0, b0, c));
            let once = flush(
                (f64::from(a0) * f64::from(b0) + f64::from(a1) * f64::from(b1) + f64::from(c))
                    as f32,
            );
            let same = |x: f32| x.to_bits() == got[j].to_bits() || (x.is_nan() && got[j].is_nan());
            m.0 += 1;
            m.1 += u64::from(same(odd));
            m.2 += u64::from(same(even));
            m.3 += u64::from(same(once));
        }
    }
    m
}

/// GFLOP/s of 12 independent FMA chains on the widest vectors of `isa`.
#[cfg(target_arch = "x86_64")]
fn fma_peak(isa: Isa) -> Option<f64> {
    use core::arch::x86_64::*;
    const N: usize = 12;
    const ITERS: usize = 20_000_000;
    #[target_feature(enable = "avx512f")]
    unsafe fn zmm() -> f32 {
        let mut acc = [_mm512_set1_ps(0.5); N];
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..ITERS {
            for v in &mut acc {
                *v = _mm512_fmadd_ps(a, *v, b);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }
    #[target_feature(enable = "avx2,fma")]
    unsafe fn ymm() -> f32 {
        let mut acc = [_mm256_set1_ps(0.5); N];
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..ITERS {
            for v in &mut acc {
                *v = _mm256_fmadd_ps(a, *v, b);
            }
        }
        let mut s = [0f32; 8];
        for v in acc {
            let mut t = [0f32; 8];
            _mm256_storeu_ps(t.as_mut_ptr(), v);
            for i in 0..8 {
                s[i] += t[i];
            }
        }
        s.iter().sum()
    }
    // The microkernel's own instruction mix on L1-resident panels: per
    // step 2 vector loads, 14 broadcast loads, 28 FMAs (14 x 32 on zmm).
    #[target_feature(enable = "avx512f")]
    unsafe fn zmm_mix() -> f32 {
        const KS: usize = 128;
        let a = vec![0.5f32; 14 * KS];
        let b = vec![1e-7f32; 32 * KS];
        let mut acc = [[_mm512_set1_ps(0.5); 2]; 14];
        for _ in 0..ITERS / KS {
            let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
            for _ in 0..KS {
                let b0 = _mm512_loadu_ps(pb);
                let b1 = _mm512_loadu_ps(pb.add(16));
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*pa.add(r));
                    row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                    row[1] = _mm512_fmadd_ps(av, b1, row[1]);
                }
                pa = pa.add(14);
                pb = pb.add(32);
            }
        }
        acc.iter().flatten().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }
    // The pair dot's microkernel mix on L1-resident panels: per pair step
    // NG vector loads, MR broadcast words, MR x NG VDPBF16PS (the block of
    // `pairs.rs`, 14 x 32 there), unrolled by two as it is.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn pair_mix<const MR: usize, const NG: usize>() -> f32 {
        const KS: usize = 128;
        let a = vec![0x3f80_3f80i32; MR * KS];
        let b = vec![1e-7f32; NG * 16 * KS];
        let mut acc = [[_mm512_set1_ps(0.5); NG]; MR];
        for _ in 0..ITERS / KS {
            let (mut pa, mut pb) = (a.as_ptr(), b.as_ptr());
            for _ in 0..KS / 2 {
                for _ in 0..2 {
                    let bv: [__m512bh; NG] = core::array::from_fn(|g| {
                        core::mem::transmute::<__m512, __m512bh>(_mm512_loadu_ps(pb.add(g * 16)))
                    });
                    for (r, row) in acc.iter_mut().enumerate() {
                        let av = core::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                            *pa.add(r),
                        ));
                        for (v, bg) in row.iter_mut().zip(&bv) {
                            *v = _mm512_dpbf16_ps(*v, av, *bg);
                        }
                    }
                    pa = pa.add(MR);
                    pb = pb.add(NG * 16);
                }
            }
        }
        acc.iter().flatten().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }
    // VDPBF16PS: 32 bf16 products summed pairwise into 16 f32 lanes per
    // instruction (64 flops), `CHAINS` independent accumulators. The
    // alternative to widening bf16 while packing and using FMA: on a core
    // where it runs at the FMA's instruction rate it doubles the peak.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn dpbf16<const CHAINS: usize>() -> f32 {
        let mut acc = [_mm512_set1_ps(0.5); CHAINS];
        // Through black_box: constant operands let LLVM fold the chains away.
        let one = std::hint::black_box(_mm512_set1_ps(1.0));
        let tiny = std::hint::black_box(_mm512_set1_ps(1e-7));
        let (a, b) = (
            _mm512_cvtne2ps_pbh(one, one),
            _mm512_cvtne2ps_pbh(tiny, tiny),
        );
        for _ in 0..ITERS {
            for v in &mut acc {
                *v = _mm512_dpbf16_ps(*v, a, b);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }
    if std::env::var("NPK_MIX").is_ok() && isa.name() == "avx512bf16" {
        for (chains, f) in [(12, dpbf16::<12> as unsafe fn() -> f32), (24, dpbf16::<24>)] {
            // SAFETY: the ISA (AVX512-BF16) was detected as available.
            let best = unsafe { best_of_3(f) };
            println!(
                "VDPBF16PS, {chains} chains: {:.1} GFLOP/s (2 flops a bf16 product)",
                (chains * ITERS * 64) as f64 / best / 1e9
            );
        }
    }
    if std::env::var("NPK_MIX").is_ok() && isa.name() == "avx512bf16" {
        // SAFETY: the ISA (AVX512-BF16) was detected as available.
        let (n, odd_first, even_first, one_rounding) = unsafe { dpbf16_bits() };
        println!(
            "VDPBF16PS bits, {n} random lanes: two FMAs, odd element first, subnormals flushed: {odd_first}; \
             even first: {even_first}; the pair's sum rounded once: {one_rounding}"
        );
    }
    if std::env::var("NPK_MIX").is_ok() && isa.name().starts_with("avx512") {
        // SAFETY: the ISA was detected as available.
        let best = unsafe { best_of_3(zmm_mix) };
        println!(
            "microkernel mix on L1 panels: {:.1} GFLOP/s",
            (ITERS / 128 * 128 * 28 * 16 * 2) as f64 / best / 1e9
        );
    }
    if std::env::var("NPK_MIX").is_ok() && isa.name() == "avx512bf16" {
        // (Zen 4, 2026-12-08: 6 x 64, 7 x 48, 8 x 48 and 10 x 32 ran as
        // 14 x 32 does, 228-230 GFLOP/s: the block's shape is not a bound.)
        // SAFETY: the ISA (AVX512-BF16) was detected as available.
        let best = unsafe { best_of_3(pair_mix::<14, 2>) };
        println!(
            "pair dot mix 14 x 32 on L1 panels: {:.1} GFLOP/s",
            (ITERS / 128 * 128 * 14 * 32 * 4) as f64 / best / 1e9
        );
    }
    let name = isa.name();
    let (lanes, f): (usize, unsafe fn() -> f32) = if name.starts_with("avx512") {
        (16, zmm)
    } else if name == "avx2" {
        (8, ymm)
    } else {
        return None;
    };
    // SAFETY: the ISA was detected as available.
    let best = unsafe { best_of_3(f) };
    Some((N * ITERS * lanes * 2) as f64 / best / 1e9)
}

#[cfg(not(target_arch = "x86_64"))]
fn fma_peak(_: Isa) -> Option<f64> {
    None
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let filter = args
        .iter()
        .position(|a| a == "--filter")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_default();
    let isa = args
        .iter()
        .position(|a| a == "--isa")
        .and_then(|i| args.get(i + 1))
        .map(|n| {
            *Isa::ALL
                .iter()
                .find(|i| i.name() == n)
                .expect("an ISA name")
        })
        .unwrap_or_else(|| *Isa::ALL.iter().rev().find(|i| i.is_available()).unwrap());
    let peak = fma_peak(isa);
    match peak {
        Some(p) => println!(
            "FMA peak ({}): {p:.1} GFLOP/s (12 independent chains, best of 3)",
            isa.name()
        ),
        None => println!("FMA peak ({}): not measured on this ISA", isa.name()),
    }
    let cpu = Cpu::new(Serial).with_isa(isa);
    let exec = Exec::new(&cpu).with_ub(UbConfig {
        blocks: 1,
        ..UbConfig::default()
    });
    // (name, M, K, N, trans_a, trans_b)
    let mut shapes: Vec<(String, usize, usize, usize, bool, bool)> = [
        ("up/gate fwd x W^T", 512, 1024, 2816, false, true),
        ("down fwd x W^T", 512, 2816, 1024, false, true),
        ("up dx = dy W", 512, 2816, 1024, false, false),
        ("up dW = dy^T x", 2816, 512, 1024, true, false),
        ("lm head fwd", 512, 1024, 32000, false, true),
        ("lm head dx", 512, 32000, 1024, false, false),
    ]
    .map(|(s, m, k, n, ta, tb)| (s.to_string(), m, k, n, ta, tb))
    .to_vec();
    // `--shape MxKxN[:ta][:tb]`: one shape of the caller's instead.
    if let Some(spec) = args
        .iter()
        .position(|a| a == "--shape")
        .and_then(|i| args.get(i + 1))
    {
        let mut parts = spec.split(':');
        let d: Vec<usize> = parts
            .next()
            .unwrap_or_default()
            .split('x')
            .map(|v| v.parse().expect("--shape MxKxN[:ta][:tb]"))
            .collect();
        assert_eq!(d.len(), 3, "--shape MxKxN[:ta][:tb]");
        let flags: Vec<&str> = parts.collect();
        let (ta, tb) = (flags.contains(&"ta"), flags.contains(&"tb"));
        shapes = vec![(spec.clone(), d[0], d[1], d[2], ta, tb)];
    }
    println!("| shape | M x K x N | dtype | ms | GFLOP/s | of peak |");
    println!("|---|---|---|---|---|---|");
    for (name, m, k, n, ta, tb) in shapes {
        let name = name.as_str();
        if quick && (n == 32000 || k == 32000) || !name.contains(filter.as_str()) {
            continue;
        }
        for dt in ["bf16", "bf16>f32", "f32", "bf16 dot", "bf16 dot>f32"] {
            if std::env::var("NPK_DT").is_ok_and(|d| d != dt) {
                continue;
            }
            // "bf16 dot": MatmulMath::Bf16Dot (VDPBF16PS where the CPU has
            // it); ">f32": bf16 operands, an f32 c.
            let o = MatmulOptions {
                trans_a: ta,
                trans_b: tb,
                accumulate: false,
                math: if dt.starts_with("bf16 dot") {
                    MatmulMath::Bf16Dot
                } else {
                    MatmulMath::Chain
                },
            };
            let (ad, bd) = (
                if ta { [k, m] } else { [m, k] },
                if tb { [n, k] } else { [k, n] },
            );
            let secs = if dt.starts_with("bf16") {
                let a: Vec<bf16> = (0..m * k)
                    .map(|i| bf16::from_f32((i % 13) as f32 * 0.1 - 0.6))
                    .collect();
                let b: Vec<bf16> = (0..k * n)
                    .map(|i| bf16::from_f32((i % 7) as f32 * 0.1 - 0.3))
                    .collect();
                if dt.ends_with(">f32") {
                    let mut c = vec![0f32; m * n];
                    time(&exec, &a, &ad, &b, &bd, &o, &mut c)
                } else {
                    let mut c = vec![bf16::ZERO; m * n];
                    time(&exec, &a, &ad, &b, &bd, &o, &mut c)
                }
            } else {
                let a: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
                let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
                let mut c = vec![0f32; m * n];
                time(&exec, &a, &ad, &b, &bd, &o, &mut c)
            };
            let gf = 2.0 * (m * n * k) as f64 / secs / 1e9;
            let frac = peak
                .map(|p| format!("{:.0}%", 100.0 * gf / p))
                .unwrap_or_default();
            println!(
                "| {name} | {m} x {k} x {n} | {dt} | {:.1} | {gf:.1} | {frac} |",
                secs * 1e3
            );
        }
    }
}

/// Best of 5 runs (after one warm-up), seconds.
fn time<T: Float, O: Float>(
    exec: &Exec<'_>,
    a: &[T],
    ad: &[usize],
    b: &[T],
    bd: &[usize],
    o: &MatmulOptions,
    c: &mut [O],
) -> f64 {
    let (ta, tb) = (
        TensorRef::new(a, ad).unwrap(),
        TensorRef::new(b, bd).unwrap(),
    );
    let mut ws = vec![0u8; matmul_workspace_size(exec, ta, tb, O::DTYPE, o).unwrap()];
    let mut best = f64::MAX;
    for _ in 0..6 {
        let t = thread_secs();
        matmul(exec, ta, tb, o, c, &mut ws).unwrap();
        best = best.min(thread_secs() - t);
    }
    best
}
