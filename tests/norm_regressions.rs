//! Regression tests for defects found by trying the crate as a new user
//! (issue 9): empty rows must not cost time per row, and padding lanes must
//! never turn an infinite rstd into NaN.

use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use npukern::*;

/// Runs `f` on a thread and fails if it has not finished within 10 s (a
/// regression of defect 1 would otherwise hang the suite).
fn within_10s(what: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(10)).is_ok(),
        "{what} did not return: work must be proportional to the bytes touched"
    );
}

/// x = [2^31, 2^31, 0] with gamma [0] and no rstd: 2^62 rows of nothing.
/// Every backend must return at once (it used to walk every empty row).
#[test]
fn empty_rows_without_rstd_return_at_once() {
    within_10s("rms_norm / add_rms_norm over 2^62 empty rows", || {
        let dims = [1usize << 31, 1 << 31, 0];
        let (x, g): (Vec<f32>, Vec<f32>) = (vec![], vec![]);
        let xt = TensorRef::new(&x, &dims).unwrap();
        let gt = TensorRef::new(&g, &[0]).unwrap();
        let opts = RmsNormOptions::default();
        let cpu = Cpu::new(Threads::new(2));
        for exec in [Exec::cpu(), Exec::new(&cpu), Exec::reference()] {
            let n = rms_norm_workspace_size(&exec, xt, gt, &opts).unwrap();
            let mut ws = vec![0u8; n];
            rms_norm(&exec, xt, gt, &opts, &mut [], None, &mut ws).unwrap();
            let n = add_rms_norm_workspace_size(&exec, xt, xt, gt, &opts).unwrap();
            let mut ws = vec![0u8; n];
            add_rms_norm(&exec, xt, xt, gt, &opts, &mut [], None, None, &mut ws).unwrap();
        }
    });
}

/// Rows of length 0 still get rstd = NaN when rstd is given (that is the
/// work), on every backend; the backward of such rows writes nothing.
#[test]
fn empty_rows_with_rstd_get_nan() {
    within_10s("rms_norm over 10^6 empty rows with rstd", || {
        let m = 1_000_000;
        let (x, g): (Vec<bf16>, Vec<bf16>) = (vec![], vec![]);
        let xt = TensorRef::new(&x, &[1000, 1000, 0]).unwrap();
        let gt = TensorRef::new(&g, &[0]).unwrap();
        let opts = RmsNormOptions::default();
        for exec in [Exec::cpu(), Exec::reference()] {
            let mut rstd = vec![1.0f32; m];
            let mut ws = vec![0u8; rms_norm_workspace_size(&exec, xt, gt, &opts).unwrap()];
            rms_norm(&exec, xt, gt, &opts, &mut [], Some(&mut rstd), &mut ws).unwrap();
            assert!(rstd.iter().all(|v| v.is_nan()));
            let rt = TensorRef::new(&rstd, &[m]).unwrap();
            let go = RmsNormGradOptions::default();
            let n =
                rms_norm_grad_workspace_size(&exec, xt, &RmsNormGradInputs::new(xt, rt, gt), &go)
                    .unwrap();
            let mut ws = vec![0u8; n];
            let mut dg: [f32; 0] = [];
            rms_norm_grad(
                &exec,
                xt,
                &RmsNormGradInputs::new(xt, rt, gt),
                &go,
                &mut [],
                DgammaOut {
                    dgamma: Some(&mut dg),
                    dgamma_cast: None,
                },
                &mut ws,
            )
            .unwrap();
        }
    });
}

/// dx of one row: dy = 1, x = 1e-30, gamma = 1, rstd = +Inf (what rms_norm
/// returns for that x with eps = 0), f32.
fn dx_inf_rstd(exec: &Exec<'_>, n: usize) -> Vec<f32> {
    let (dy, x, g) = (vec![1.0f32; n], vec![1e-30f32; n], vec![1.0f32; n]);
    let rstd = [f32::INFINITY];
    let (dyt, xt) = (
        TensorRef::new(&dy, &[1, n]).unwrap(),
        TensorRef::new(&x, &[1, n]).unwrap(),
    );
    let gt = TensorRef::new(&g, &[n]).unwrap();
    let rt = TensorRef::new(&rstd, &[1]).unwrap();
    let o = RmsNormGradOptions::default();
    let inputs = RmsNormGradInputs::new(xt, rt, gt);
    let mut ws = vec![0u8; rms_norm_grad_workspace_size(exec, dyt, &inputs, &o).unwrap()];
    let mut dx = vec![0f32; n];
    rms_norm_grad(
        exec,
        dyt,
        &inputs,
        &o,
        &mut dx,
        DgammaOut::default(),
        &mut ws,
    )
    .unwrap();
    dx
}

/// Padding lanes (N not a multiple of 16) used to add 0 * Inf = NaN to the
/// row sum, so dx was NaN for N = 15 and -Inf for N = 16. The result may not
/// depend on N mod 16: every N gives the reference's -Inf, on every ISA, in
/// merge-N and split-D tilings.
#[test]
fn infinite_rstd_gives_the_same_dx_for_every_row_length() {
    let reference = Exec::reference();
    let split = UbConfig {
        ub_bytes: 1024, // 256 floats / 3 streams: chunks of 80, split-D from N = 81
        blocks: 4,
    };
    for isa in Isa::ALL.into_iter().filter(|i| i.is_available()) {
        let cpu = Cpu::new(Serial).with_isa(isa);
        for exec in [Exec::new(&cpu), Exec::new(&cpu).with_ub(split)] {
            for n in (1..=40).chain([79, 80, 81, 95, 96, 97, 250]) {
                let want = dx_inf_rstd(&reference, n);
                assert!(want.iter().all(|v| *v == f32::NEG_INFINITY), "n {n}");
                let got = dx_inf_rstd(&exec, n);
                assert!(
                    got.iter().all(|v| *v == f32::NEG_INFINITY),
                    "{isa:?} n {n} ub {:?}: {:?}",
                    exec.ub,
                    &got[..n.min(4)]
                );
            }
        }
    }
}
