//! A host thread's floating-point modes do not reach the kernels. PyTorch's
//! `torch.set_flush_denormal(True)` sets x86's FTZ and DAZ on the calling
//! thread only; a C caller may set a rounding mode. Under those, every ISA,
//! thread and block count gives the bits of the default modes — RmsNorm of
//! subnormal rows, Matmul's chain and pair dot with subnormal products and
//! ties — and the caller's modes are in force again after the call.
#![cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]

mod common;

use common::Rng;
use core::arch::asm;
use half::bf16;
use npukern::*;

/// The host's modes: flush-to-zero (and x86's denormals-are-zero), and
/// rounding toward zero.
#[cfg(target_arch = "x86_64")]
const HOST: u64 = 1 << 15 | 1 << 6 | 3 << 13;
#[cfg(target_arch = "aarch64")]
const HOST: u64 = 1 << 24 | 3 << 22;

/// MXCSR.
#[cfg(target_arch = "x86_64")]
fn control() -> u64 {
    let mut v = 0u32;
    // SAFETY: STMXCSR writes the 4 bytes of v.
    unsafe { asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack, preserves_flags)) };
    u64::from(v)
}

#[cfg(target_arch = "x86_64")]
fn set_control(v: u64) {
    let v = v as u32;
    // SAFETY: v is MXCSR's value with defined mode bits changed.
    unsafe { asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, preserves_flags, readonly)) };
}

/// FPCR.
#[cfg(target_arch = "aarch64")]
fn control() -> u64 {
    let v: u64;
    // SAFETY: FPCR is readable at EL0.
    unsafe { asm!("mrs {}, fpcr", out(reg) v, options(nomem, nostack, preserves_flags)) };
    v
}

#[cfg(target_arch = "aarch64")]
fn set_control(v: u64) {
    // SAFETY: FPCR is writable at EL0; only flush and rounding modes change.
    unsafe { asm!("msr fpcr, {}", in(reg) v, options(nostack, preserves_flags)) };
}

/// `f` with the host's modes set on this thread, and whether they were in
/// force (2^-70 squared flushed) and back after it.
fn under_host_modes<R>(f: impl FnOnce() -> R) -> R {
    let saved = control();
    set_control(saved | HOST);
    let x = core::hint::black_box(2f32.powi(-70));
    let flushed = core::hint::black_box(x * x) == 0.0;
    let r = f();
    let after = control();
    set_control(saved);
    assert!(
        flushed,
        "the host's flush-to-zero had no effect: the test cannot fail"
    );
    assert_eq!(after & HOST, HOST, "the caller's modes are restored");
    r
}

/// Every ISA, thread and block count.
fn configs() -> Vec<(Isa, usize, u32)> {
    let mut v = Vec::new();
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        for (threads, blocks) in [(1usize, 8u32), (2, 8), (3, 5)] {
            v.push((isa, threads, blocks));
        }
    }
    v
}

fn exec_run<R>(isa: Isa, threads: usize, blocks: u32, f: impl FnOnce(&Exec<'_>) -> R) -> R {
    let cpu = Cpu::new(Threads::new(threads)).with_isa(isa);
    let ub = UbConfig {
        blocks,
        ..UbConfig::default()
    };
    f(&Exec::new(&cpu).with_ub(ub))
}

fn rms(exec: &Exec<'_>, x: &[f32], g: &[f32], n: usize) -> Vec<u32> {
    let xt = TensorRef::new(x, &[x.len() / n, n]).unwrap();
    let gt = TensorRef::new(g, &[n]).unwrap();
    let opts = RmsNormOptions::default();
    let mut ws = vec![0u8; rms_norm_workspace_size(exec, xt, gt, &opts).unwrap()];
    let mut y = vec![0f32; x.len()];
    rms_norm(exec, xt, gt, &opts, &mut y, None, &mut ws).unwrap();
    y.iter().map(|v| v.to_bits()).collect()
}

fn mm(exec: &Exec<'_>, a: &[bf16], b: &[bf16], mkn: [usize; 3], math: MatmulMath) -> Vec<u32> {
    let [m, k, n] = mkn;
    let at = TensorRef::new(a, &[m, k]).unwrap();
    let bt = TensorRef::new(b, &[n, k]).unwrap();
    let o = MatmulOptions {
        trans_b: true,
        math,
        ..MatmulOptions::default()
    };
    let mut ws = vec![0u8; matmul_workspace_size(exec, at, bt, DType::F32, &o).unwrap()];
    let mut c = vec![0f32; m * n];
    matmul(exec, at, bt, &o, &mut c, &mut ws).unwrap();
    c.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn rms_norm_of_subnormal_rows_keeps_its_bits_under_a_flushing_host() {
    let n = 300;
    let mut rng = Rng(0xf7a);
    let x: Vec<f32> = (0..40 * n)
        .map(|_| {
            f32::from_bits(1 + rng.below(0x7f_ffff) as u32)
                * if rng.below(2) == 0 { 1.0 } else { -1.0 }
        })
        .collect();
    let g: Vec<f32> = (0..n).map(|_| rng.uniform(0.5, 1.5) as f32).collect();
    let want = exec_run(Isa::Portable, 1, 1, |e| rms(e, &x, &g, n));
    assert!(
        want.iter().any(|&b| b & 0x7fff_ffff != 0),
        "y of subnormal x is not zero"
    );
    for (isa, threads, blocks) in configs() {
        let got = under_host_modes(|| exec_run(isa, threads, blocks, |e| rms(e, &x, &g, n)));
        assert!(
            got == want,
            "RmsNorm on {isa} x{threads}/{blocks} under the host's modes"
        );
    }
}

#[test]
fn matmul_keeps_its_bits_under_a_flushing_host() {
    let mut rng = Rng(0xf7b);
    // Magnitudes 2^-60 .. 2^-76: products and sums subnormal and near 2^-126;
    // a tenth of them 1 .. 2, so sums round (toward zero, under the host).
    let mut v = || {
        let s = if rng.below(2) == 0 { 0 } else { 0x8000 };
        let e = if rng.below(10) == 0 {
            127
        } else {
            51 + rng.below(17) as u16
        };
        bf16::from_bits(s | e << 7 | rng.below(128) as u16)
    };
    let mkn = [45, 70, 97];
    let a: Vec<bf16> = (0..mkn[0] * mkn[1]).map(|_| v()).collect();
    let b: Vec<bf16> = (0..mkn[2] * mkn[1]).map(|_| v()).collect();
    for math in [MatmulMath::Chain, MatmulMath::Bf16Dot] {
        let want = exec_run(Isa::Portable, 1, 1, |e| mm(e, &a, &b, mkn, math));
        for (isa, threads, blocks) in configs() {
            let got =
                under_host_modes(|| exec_run(isa, threads, blocks, |e| mm(e, &a, &b, mkn, math)));
            assert!(
                got == want,
                "Matmul {math:?} on {isa} x{threads}/{blocks} under the host's modes"
            );
        }
    }
}
