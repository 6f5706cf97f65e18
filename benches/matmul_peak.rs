//! The matmul against the core's FMA peak: a microbenchmark of independent
//! FMAs (the physical limit, per ISA), then `npukern::matmul` on the step's
//! shapes (hidden 1024, MLP 2816, vocab 32 000, 512 tokens; each with its
//! transposes: forward `x W^T`, dx `dy W`, dW `dy^T x`) on one thread,
//! GFLOP/s and the fraction of the peak.
//!
//!   taskset -c 0 cargo run --release -p npukern-benches --bin matmul_peak [-- --isa avx2] [--quick] [--filter dW]

use npukern::*;
use std::time::Instant;

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
    let name = isa.name();
    let (lanes, f): (usize, unsafe fn() -> f32) = if name.starts_with("avx512") {
        (16, zmm)
    } else if name == "avx2" {
        (8, ymm)
    } else {
        return None;
    };
    let t = Instant::now();
    // SAFETY: the ISA was detected as available.
    let s = unsafe { f() };
    let dt = t.elapsed().as_secs_f64();
    std::hint::black_box(s);
    Some((N * ITERS * lanes * 2) as f64 / dt / 1e9)
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
            "FMA peak ({}): {p:.1} GFLOP/s (12 independent chains)",
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
    let shapes: &[(&str, usize, usize, usize, bool, bool)] = &[
        ("up/gate fwd x W^T", 512, 1024, 2816, false, true),
        ("down fwd x W^T", 512, 2816, 1024, false, true),
        ("up dx = dy W", 512, 2816, 1024, false, false),
        ("up dW = dy^T x", 2816, 512, 1024, true, false),
        ("lm head fwd", 512, 1024, 32000, false, true),
        ("lm head dx", 512, 32000, 1024, false, false),
    ];
    println!("| shape | M x K x N | dtype | ms | GFLOP/s | of peak |");
    println!("|---|---|---|---|---|---|");
    for &(name, m, k, n, ta, tb) in shapes {
        if quick && (n == 32000 || k == 32000) || !name.contains(filter.as_str()) {
            continue;
        }
        for dt in ["bf16", "bf16>f32", "f32"] {
            if std::env::var("NPK_DT").is_ok_and(|d| d != dt) {
                continue;
            }
            let o = MatmulOptions {
                trans_a: ta,
                trans_b: tb,
                accumulate: false,
            };
            let (ad, bd) = (
                if ta { [k, m] } else { [m, k] },
                if tb { [n, k] } else { [k, n] },
            );
            let secs = if dt == "bf16" {
                let a: Vec<bf16> = (0..m * k)
                    .map(|i| bf16::from_f32((i % 13) as f32 * 0.1 - 0.6))
                    .collect();
                let b: Vec<bf16> = (0..k * n)
                    .map(|i| bf16::from_f32((i % 7) as f32 * 0.1 - 0.3))
                    .collect();
                let mut c = vec![bf16::ZERO; m * n];
                time(&exec, &a, &ad, &b, &bd, &o, &mut c)
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
        let t = Instant::now();
        matmul(exec, ta, tb, o, c, &mut ws).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}
