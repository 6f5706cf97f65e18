//! Every operator on arbitrary shapes, options, tilings and values: the call
//! must return Ok or an Error, never panic, and on error leave the outputs as
//! they were. Run: `cargo +nightly fuzz run ops_any_input` (from the repo root).
#![no_main]

use libfuzzer_sys::fuzz_target;
use npukern::*;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (v, rest) = self.0.split_first().map_or((0, &[][..]), |(v, r)| (*v, r));
        self.0 = rest;
        v
    }
    fn f32(&mut self) -> f32 {
        f32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes(data);
    let rows = (b.u8() % 9) as usize;
    let cols = (b.u8() as usize) * 3 % 301;
    let ub = UbConfig { ub_bytes: 512 + (b.u8() as usize) * 64, blocks: b.u8() as u32 % 70 };
    let exec = Exec::cpu().with_ub(ub);
    let x: Vec<bf16> = (0..rows * cols).map(|_| bf16::from_bits(b.u8() as u16 | (b.u8() as u16) << 8)).collect();
    let g: Vec<f32> = (0..cols).map(|_| b.f32()).collect();
    let opts = RmsNormOptions { eps: b.f32(), gamma_offset: b.f32(), rounding: if b.u8() & 1 == 0 { Rounding::Fused } else { Rounding::CastBeforeGamma } };
    let (Ok(xt), Ok(gt)) = (TensorRef::new(&x, &[rows, cols]), TensorRef::new(&g, &[cols])) else { return };
    let y_len = rows * cols + (b.u8() % 2) as usize; // sometimes the wrong length
    let mut y = vec![bf16::from_bits(0x7fa5); y_len];
    let mut rstd = vec![f32::from_bits(0x7fc0_1234); rows];
    let ws_len = rms_norm_workspace_size(&exec, xt, gt, &opts).unwrap_or(0).saturating_sub((b.u8() % 3) as usize);
    let mut ws = vec![0u8; ws_len];
    if rms_norm(&exec, xt, gt, &opts, &mut y, Some(&mut rstd), &mut ws).is_err() {
        assert!(y.iter().all(|v| v.to_bits() == 0x7fa5));
        assert!(rstd.iter().all(|v| v.to_bits() == 0x7fc0_1234));
    }
    // The backward on the same data.
    let gopts = RmsNormGradOptions { gamma_offset: opts.gamma_offset, dgamma_mode: if b.u8() & 1 == 0 { DgammaMode::Overwrite } else { DgammaMode::Accumulate } };
    if let Ok(rt) = TensorRef::new(&rstd, &[rows]) {
        let ws_len = rms_norm_grad_workspace_size(&exec, xt, xt, rt, gt, None, &gopts).unwrap_or(0);
        let mut ws = vec![0u8; ws_len];
        let mut dx = vec![bf16::ZERO; rows * cols];
        let mut dg = vec![0f32; cols];
        let _ = rms_norm_grad(&exec, xt, xt, rt, gt, None, &gopts, &mut dx, Some(&mut dg), None, &mut ws);
    }
    // EmbeddingDenseGrad with arbitrary (often out-of-range) indices.
    let vocab = (b.u8() % 17) as usize;
    let idx: Vec<i64> = (0..rows).map(|_| b.u8() as i64 - 8).collect();
    let eopts = EmbeddingGradOptions {
        padding_idx: b.u8() as i64 - 4,
        scale_grad_by_freq: b.u8() & 1 == 1,
        out_of_range: if b.u8() & 1 == 0 { IndexPolicy::Error } else { IndexPolicy::Ignore },
        ..Default::default()
    };
    if let Ok(it) = TensorRef::new(&idx, &[rows]) {
        let ws_len = embedding_dense_grad_workspace_size(&exec, xt, it, vocab, &eopts).unwrap_or(0);
        let mut ws = vec![0u8; ws_len];
        let mut table = vec![bf16::from_bits(0x7fa5); vocab * cols];
        if embedding_dense_grad(&exec, xt, it, vocab, &eopts, &mut table, &mut ws).is_err() {
            assert!(table.iter().all(|v| v.to_bits() == 0x7fa5));
        }
    }
});
