//! Bad input gets a specific error and changes nothing: every output is
//! poisoned before the call and compared byte for byte after it.

mod common;

use common::*;
use half::{bf16, f16};
use npukern::*;

const POISON_BF16: u16 = 0x7fa5;
const POISON_F32: u32 = 0x7fc0_1234;

fn poison_bf16(n: usize) -> Vec<bf16> {
    vec![bf16::from_bits(POISON_BF16); n]
}
fn poison_f32(n: usize) -> Vec<f32> {
    vec![f32::from_bits(POISON_F32); n]
}
fn untouched_bf16(v: &[bf16]) -> bool {
    v.iter().all(|x| x.to_bits() == POISON_BF16)
}
fn untouched_f32(v: &[f32]) -> bool {
    v.iter().all(|x| x.to_bits() == POISON_F32)
}

struct Fwd {
    x: Vec<bf16>,
    g: Vec<bf16>,
}

fn data(m: usize, n: usize) -> Fwd {
    let mut rng = Rng(5);
    Fwd {
        x: vec_of(m * n, || rng.mag()),
        g: vec_of(n, || rng.uniform(-1.0, 1.0)),
    }
}

/// Runs rms_norm with poisoned outputs and returns the error, asserting that
/// nothing was written.
fn rms_err<G: Float>(
    exec: &Exec<'_>,
    x: TensorRef<'_, bf16>,
    g: TensorRef<'_, G>,
    opts: &RmsNormOptions,
    y_len: usize,
    rstd_len: usize,
    ws_len: usize,
) -> Error {
    let mut y = poison_bf16(y_len);
    let mut rstd = poison_f32(rstd_len);
    let mut ws = vec![0u8; ws_len];
    let e = rms_norm(exec, x, g, opts, &mut y, Some(&mut rstd), &mut ws).unwrap_err();
    assert!(
        untouched_bf16(&y) && untouched_f32(&rstd),
        "outputs written on error {e}"
    );
    e
}

#[test]
fn rank_and_shape_errors() {
    let d = data(4, 8);
    assert!(matches!(
        TensorRef::new(&d.x, &[]),
        Err(Error::InvalidParam { .. })
    ));
    assert!(matches!(
        TensorRef::new(&d.x, &[1, 1, 1, 1, 1, 1, 1, 4, 8]),
        Err(Error::InvalidParam { .. })
    ));
    assert!(matches!(
        Shape::new(&[1 << 40, 1 << 40]),
        Err(Error::SizeOverflow { .. })
    ));
    assert!(matches!(
        Shape::new(&[usize::MAX, 2]),
        Err(Error::SizeOverflow { .. })
    ));
    let x = TensorRef::new(&d.x, &[4, 8]).unwrap();
    let exec = Exec::cpu();
    let opts = RmsNormOptions::default();
    let ws = 1 << 20;
    // gamma not the trailing dims of x
    let g4 = TensorRef::new(&d.g[..4], &[4]).unwrap();
    let e = rms_err(&exec, x, g4, &opts, 32, 4, ws);
    assert_eq!(
        e.to_string(),
        "gamma: shape [4] is not the trailing dims of x [4, 8]"
    );
    let g2 = TensorRef::new(&d.g, &[2, 4]).unwrap();
    assert_eq!(rms_err(&exec, x, g2, &opts, 32, 4, ws).argument(), "gamma");
    let xg = TensorRef::new(&d.x, &[32]).unwrap();
    let g8 = TensorRef::new(&d.g, &[1, 8]).unwrap(); // gamma of higher rank than x
    assert_eq!(rms_err(&exec, xg, g8, &opts, 32, 1, ws).argument(), "gamma");
    let g = TensorRef::new(&d.g, &[8]).unwrap();
    // y and rstd of the wrong length
    assert!(matches!(
        rms_err(&exec, x, g, &opts, 31, 4, ws),
        Error::InvalidParam { arg: "y", .. }
    ));
    assert!(matches!(
        rms_err(&exec, x, g, &opts, 32, 5, ws),
        Error::InvalidParam { arg: "rstd", .. }
    ));
    assert!(matches!(
        rms_err(&exec, x, g, &opts, 32, 3, ws),
        Error::InvalidParam { arg: "rstd", .. }
    ));
}

#[test]
fn dtype_pairs() {
    let d = data(4, 8);
    let x = TensorRef::new(&d.x, &[4, 8]).unwrap();
    let g16: Vec<f16> = d.g.iter().map(|v| f16::from_f32(v.to_f32())).collect();
    let g = TensorRef::new(&g16, &[8]).unwrap();
    let e = rms_err(
        &Exec::cpu(),
        x,
        g,
        &RmsNormOptions::default(),
        32,
        4,
        1 << 20,
    );
    assert_eq!(
        e.to_string(),
        "gamma: dtype f16 is neither x's (bf16) nor f32"
    );
}

#[test]
fn eps_and_config() {
    let d = data(4, 8);
    let (x, g) = (
        TensorRef::new(&d.x, &[4, 8]).unwrap(),
        TensorRef::new(&d.g, &[8]).unwrap(),
    );
    for eps in [-1e-6, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let o = RmsNormOptions {
            eps,
            ..Default::default()
        };
        assert!(
            matches!(
                rms_err(&Exec::cpu(), x, g, &o, 32, 4, 1 << 20),
                Error::InvalidParam { arg: "eps", .. }
            ),
            "{eps}"
        );
    }
    let o = RmsNormOptions {
        gamma_offset: f32::NAN,
        ..Default::default()
    };
    assert!(matches!(
        rms_err(&Exec::cpu(), x, g, &o, 32, 4, 1 << 20),
        Error::InvalidParam {
            arg: "gamma_offset",
            ..
        }
    ));
    let opts = RmsNormOptions::default();
    let bad_ub = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 100,
        blocks: 4,
    });
    assert!(matches!(
        rms_err(&bad_ub, x, g, &opts, 32, 4, 1 << 20),
        Error::InvalidParam {
            arg: "ub_bytes",
            ..
        }
    ));
    let bad_blocks = Exec::cpu().with_ub(UbConfig {
        ub_bytes: 4096,
        blocks: 0,
    });
    assert!(matches!(
        rms_err(&bad_blocks, x, g, &opts, 32, 4, 1 << 20),
        Error::InvalidParam { arg: "blocks", .. }
    ));
}

#[test]
fn workspace_too_small() {
    let d = data(4, 8);
    let (x, g) = (
        TensorRef::new(&d.x, &[4, 8]).unwrap(),
        TensorRef::new(&d.g, &[8]).unwrap(),
    );
    let exec = Exec::cpu();
    let opts = RmsNormOptions::default();
    let need = rms_norm_workspace_size(&exec, x, g, &opts).unwrap();
    assert!(need > 0);
    let e = rms_err(&exec, x, g, &opts, 32, 4, need - 1);
    assert_eq!(
        e,
        Error::WorkspaceTooSmall {
            needed: need,
            given: need - 1
        }
    );
    // Exactly the size works, whatever the buffer's alignment.
    let mut buf = vec![0u8; need + 7];
    for off in 0..8 {
        let mut y = poison_bf16(32);
        rms_norm(&exec, x, g, &opts, &mut y, None, &mut buf[off..off + need]).unwrap();
        assert!(!untouched_bf16(&y));
    }
}

#[test]
fn isa_unavailable() {
    let d = data(4, 8);
    let (x, g) = (
        TensorRef::new(&d.x, &[4, 8]).unwrap(),
        TensorRef::new(&d.g, &[8]).unwrap(),
    );
    // Every ISA this build or CPU lacks (the other architecture's, at least).
    for isa in Isa::ALL.into_iter().filter(|i| !i.is_available()) {
        let cpu = Cpu::new(Serial).with_isa(isa);
        let e = rms_err(
            &Exec::new(&cpu),
            x,
            g,
            &RmsNormOptions::default(),
            32,
            4,
            1 << 20,
        );
        assert_eq!(e, Error::IsaUnavailable);
    }
}

#[test]
fn add_rms_norm_errors() {
    let d = data(4, 8);
    let x1 = TensorRef::new(&d.x, &[4, 8]).unwrap();
    let x2_wrong = TensorRef::new(&d.x, &[2, 16]).unwrap();
    let g = TensorRef::new(&d.g, &[8]).unwrap();
    let g16 = TensorRef::new(&d.g[..], &[2, 4]).unwrap();
    let opts = RmsNormOptions::default();
    let exec = Exec::cpu();
    let run = |x2: TensorRef<'_, bf16>, g: TensorRef<'_, bf16>, y_len: usize, s_len: usize| {
        let mut y = poison_bf16(y_len);
        let mut s = poison_bf16(s_len);
        let mut r = poison_f32(4);
        let mut ws = vec![0u8; 1 << 20];
        let e = add_rms_norm(
            &exec,
            x1,
            x2,
            g,
            &opts,
            &mut y,
            Some(&mut r),
            Some(&mut s),
            &mut ws,
        )
        .unwrap_err();
        assert!(untouched_bf16(&y) && untouched_bf16(&s) && untouched_f32(&r));
        e
    };
    assert!(matches!(
        run(x2_wrong, g, 32, 32),
        Error::InvalidParam { arg: "x2", .. }
    ));
    assert!(matches!(
        run(x1, g16, 32, 32),
        Error::InvalidParam { arg: "gamma", .. }
    ));
    assert!(matches!(
        run(x1, g, 32, 31),
        Error::InvalidParam { arg: "x_sum", .. }
    ));
    assert!(matches!(
        run(x1, g, 33, 32),
        Error::InvalidParam { arg: "y", .. }
    ));
}

#[test]
fn rms_norm_grad_errors() {
    let d = data(4, 8);
    let x = TensorRef::new(&d.x, &[4, 8]).unwrap();
    let dy_wrong = TensorRef::new(&d.x, &[8, 4]).unwrap();
    let g = TensorRef::new(&d.g, &[8]).unwrap();
    let rstd = vec![1.0f32; 4];
    let exec = Exec::cpu();
    let run = |dy: TensorRef<'_, bf16>,
               rstd: &[f32],
               opts: RmsNormGradOptions,
               dx_len: usize,
               dg_len: usize,
               with_dg: bool| {
        let mut dx = poison_bf16(dx_len);
        let mut dg = poison_f32(dg_len);
        let mut dgc = poison_bf16(8);
        let mut ws = vec![0u8; 1 << 20];
        let rstd = TensorRef::new(rstd, &[rstd.len()]).unwrap();
        let e = rms_norm_grad(
            &exec,
            dy,
            &RmsNormGradInputs::new(x, rstd, g),
            &opts,
            &mut dx,
            DgammaOut {
                dgamma: with_dg.then_some(&mut dg[..]),
                dgamma_cast: Some(&mut dgc),
            },
            &mut ws,
        )
        .unwrap_err();
        assert!(
            untouched_bf16(&dx) && untouched_f32(&dg) && untouched_bf16(&dgc),
            "{e}"
        );
        e
    };
    let o = RmsNormGradOptions::default();
    assert!(matches!(
        run(dy_wrong, &rstd, o, 32, 8, true),
        Error::InvalidParam { arg: "dy", .. }
    ));
    assert!(matches!(
        run(x, &rstd[..3], o, 32, 8, true),
        Error::InvalidParam { arg: "rstd", .. }
    ));
    assert!(matches!(
        run(x, &rstd, o, 31, 8, true),
        Error::InvalidParam { arg: "dx", .. }
    ));
    assert!(matches!(
        run(x, &rstd, o, 32, 7, true),
        Error::InvalidParam { arg: "dgamma", .. }
    ));
    let acc = RmsNormGradOptions {
        dgamma_mode: DgammaMode::Accumulate,
        ..o
    };
    assert!(matches!(
        run(x, &rstd, acc, 32, 8, false),
        Error::InvalidParam { arg: "dgamma", .. }
    ));
    let nan_off = RmsNormGradOptions {
        gamma_offset: f32::INFINITY,
        ..o
    };
    assert!(matches!(
        run(x, &rstd, nan_off, 32, 8, true),
        Error::InvalidParam {
            arg: "gamma_offset",
            ..
        }
    ));
}

#[test]
fn empty_tensors_are_valid() {
    // No rows: nothing to write, no workspace needed.
    let x: Vec<f32> = vec![];
    let g = vec![1.0f32; 8];
    let (xt, gt) = (
        TensorRef::new(&x, &[0, 8]).unwrap(),
        TensorRef::new(&g, &[8]).unwrap(),
    );
    let exec = Exec::cpu();
    let opts = RmsNormOptions::default();
    assert_eq!(rms_norm_workspace_size(&exec, xt, gt, &opts).unwrap(), 0);
    rms_norm(&exec, xt, gt, &opts, &mut [], Some(&mut []), &mut []).unwrap();
    // dgamma of zero rows is zero (overwrite).
    let rt = TensorRef::new(&[] as &[f32], &[0]).unwrap();
    let mut dg = vec![5.0f32; 8];
    let ws_len = rms_norm_grad_workspace_size(
        &exec,
        xt,
        &RmsNormGradInputs::new(xt, rt, gt),
        &RmsNormGradOptions::default(),
    )
    .unwrap();
    let mut ws = vec![0u8; ws_len];
    rms_norm_grad(
        &exec,
        xt,
        &RmsNormGradInputs::new(xt, rt, gt),
        &RmsNormGradOptions::default(),
        &mut [],
        DgammaOut {
            dgamma: Some(&mut dg),
            dgamma_cast: None,
        },
        &mut ws,
    )
    .unwrap();
    assert!(dg.iter().all(|v| *v == 0.0));
    // Zero-length rows: y is empty, rstd = 1/sqrt(0/0 + eps) = NaN (as torch's mean of nothing).
    let x0: Vec<f32> = vec![];
    let g0: Vec<f32> = vec![];
    let (xt, gt) = (
        TensorRef::new(&x0, &[3, 0]).unwrap(),
        TensorRef::new(&g0, &[0]).unwrap(),
    );
    let mut rstd = vec![0f32; 3];
    let mut ws = vec![0u8; rms_norm_workspace_size(&exec, xt, gt, &opts).unwrap()];
    rms_norm(&exec, xt, gt, &opts, &mut [], Some(&mut rstd), &mut ws).unwrap();
    assert!(rstd.iter().all(|v| v.is_nan()));
}
