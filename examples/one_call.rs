//! Runs one operator call at a given shape on one thread, `REPS` times: the
//! unit `scripts/cross.sh aarch64-insns` counts instructions of under
//! qemu-user (instructions with REPS=2 minus REPS=1 = one call). The ISA is
//! automatic selection under `NPK_MAX_CPU_ISA`.
//!
//! Usage: `one_call OP DTYPE ROWS COLS REPS`, OP one of `rms_norm`,
//! `add_rms_norm`, `rms_norm_grad`, or a matmul `x W^T` of ROWS x COLS by
//! COLS x ROWS (`matmul`: the FMA chain; `matmul_bf16_dot`,
//! `matmul_bf16_dot_arm`: the pair dots, bf16 only); DTYPE one of `f32`,
//! `f16`, `bf16`.

use npukern::*;

fn data<T: Float>(n: usize, seed: u64) -> Vec<T> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            T::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect()
}

/// `x W^T`, x `[m, k]`, W `[m, k]`, `reps` times, with `math`.
fn matmul_calls<T: Float>(math: MatmulMath, m: usize, k: usize, reps: usize) -> Result<()> {
    let cpu = Cpu::new(Serial);
    let exec = Exec::new(&cpu);
    let (x, w) = (data::<T>(m * k, 1), data::<T>(m * k, 2));
    let (xt, wt) = (TensorRef::new(&x, &[m, k])?, TensorRef::new(&w, &[m, k])?);
    let o = MatmulOptions {
        trans_b: true,
        math,
        ..Default::default()
    };
    let mut c = vec![T::from_f32(0.0); m * m];
    let mut ws = vec![0u8; matmul_workspace_size(&exec, xt, wt, T::DTYPE, &o)?];
    for _ in 0..reps {
        matmul(&exec, xt, wt, &o, &mut c, &mut ws)?;
    }
    std::hint::black_box(&c);
    Ok(())
}

fn run<T: Float>(op: &str, m: usize, n: usize, reps: usize) -> Result<()> {
    match op {
        "matmul" => return matmul_calls::<T>(MatmulMath::Chain, m, n, reps),
        "matmul_bf16_dot" => return matmul_calls::<T>(MatmulMath::Bf16Dot, m, n, reps),
        "matmul_bf16_dot_arm" => return matmul_calls::<T>(MatmulMath::Bf16DotArm, m, n, reps),
        _ => {}
    }
    let cpu = Cpu::new(Serial);
    let exec = Exec::new(&cpu);
    let (x, x2, g) = (data::<T>(m * n, 1), data::<T>(m * n, 2), data::<T>(n, 3));
    let (xt, x2t, gt) = (
        TensorRef::new(&x, &[m, n])?,
        TensorRef::new(&x2, &[m, n])?,
        TensorRef::new(&g, &[n])?,
    );
    let (mut y, mut s) = (vec![T::from_f32(0.0); m * n], vec![T::from_f32(0.0); m * n]);
    let rstd = vec![0.7f32; m];
    let opts = RmsNormOptions::default();
    let gopts = RmsNormGradOptions::default();
    let mut dg = vec![0f32; n];
    let rt = TensorRef::new(&rstd, &[m])?;
    let grad_in = RmsNormGradInputs::new(xt, rt, gt);
    let need = match op {
        "rms_norm" => rms_norm_workspace_size(&exec, xt, gt, &opts)?,
        "add_rms_norm" => add_rms_norm_workspace_size(&exec, xt, x2t, gt, &opts)?,
        _ => rms_norm_grad_workspace_size(&exec, x2t, &grad_in, &gopts)?,
    };
    let mut ws = vec![0u8; need];
    for _ in 0..reps {
        match op {
            "rms_norm" => rms_norm(&exec, xt, gt, &opts, &mut y, None, &mut ws)?,
            "add_rms_norm" => add_rms_norm(
                &exec,
                xt,
                x2t,
                gt,
                &opts,
                &mut y,
                None,
                Some(&mut s),
                &mut ws,
            )?,
            _ => {
                let out = DgammaOut {
                    dgamma: Some(&mut dg[..]),
                    dgamma_cast: None,
                };
                rms_norm_grad(&exec, x2t, &grad_in, &gopts, &mut y, out, &mut ws)?
            }
        }
    }
    std::hint::black_box((&y, &s, &dg));
    Ok(())
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let num = |i: usize| a.get(i).and_then(|v| v.parse::<usize>().ok());
    let (Some(op), Some(dt), Some(m), Some(n), Some(reps)) =
        (a.get(1), a.get(2), num(3), num(4), num(5))
    else {
        eprintln!("usage: one_call OP DTYPE ROWS COLS REPS");
        std::process::exit(2);
    };
    const OPS: [&str; 6] = [
        "rms_norm",
        "add_rms_norm",
        "rms_norm_grad",
        "matmul",
        "matmul_bf16_dot",
        "matmul_bf16_dot_arm",
    ];
    if !OPS.contains(&op.as_str()) {
        eprintln!("OP: one of {OPS:?}");
        std::process::exit(2);
    };
    let r = match dt.as_str() {
        "f32" => run::<f32>(op, m, n, reps),
        "f16" => run::<f16>(op, m, n, reps),
        "bf16" => run::<bf16>(op, m, n, reps),
        _ => {
            eprintln!("dtype: f32, f16 or bf16");
            std::process::exit(2);
        }
    };
    if let Err(e) = r {
        eprintln!("one_call {op} {dt}: {e}");
        std::process::exit(1);
    }
    eprintln!("isa {}", Isa::detected());
}
