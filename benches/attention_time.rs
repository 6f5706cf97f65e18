//! Attention's forward and backward on one thread: milliseconds and
//! GFLOP/s (a causal call counted at its useful half) on the step's shape
//! (16 query heads of 64, 4 key/value heads, 512 tokens, causal, bf16) or
//! `--shape B,Hq,Hkv,S,D`, beside `benches/attention_torch.py`'s torch
//! times for the same layer.
//!
//!   taskset -c 0 cargo run --release -p npukern-benches --bin attention_time [-- --shape 1,16,4,512,64] [--f32] [--full]
//!
//! Times are the thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), best of 5.

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

/// The least time of five runs of `f`, in seconds.
fn best(mut f: impl FnMut()) -> f64 {
    let mut b = f64::MAX;
    for _ in 0..5 {
        let t = thread_secs();
        f();
        b = b.min(thread_secs() - t);
    }
    b
}

fn run<T: Float>(dims: [usize; 5], causal: bool) {
    let [b, hq, hkv, s, d] = dims;
    let cpu = Cpu::new(Serial);
    let exec = Exec::new(&cpu).with_ub(UbConfig {
        blocks: 1,
        ..UbConfig::default()
    });
    let mut x = 0x9e37_79b9_u32;
    let mut rnd = |n: usize| -> Vec<T> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                T::from_f32((x as f32 / u32::MAX as f32) * 2.0 - 1.0)
            })
            .collect()
    };
    let (qd, kd) = ([b, hq, s, d], [b, hkv, s, d]);
    let (qv, kv, vv, dov) = (
        rnd(b * hq * s * d),
        rnd(b * hkv * s * d),
        rnd(b * hkv * s * d),
        rnd(b * hq * s * d),
    );
    let q = TensorRef::new(&qv, &qd).unwrap();
    let k = TensorRef::new(&kv, &kd).unwrap();
    let v = TensorRef::new(&vv, &kd).unwrap();
    let o = AttentionOptions {
        causal,
        scale: 1.0 / (d as f32).sqrt(),
        layout: AttentionLayout::Bnsd,
    };
    let mut ws = vec![0u8; attention_workspace_size(&exec, q, k, v, &o, true).unwrap()];
    let zero = T::from_f32(0.0);
    let mut out = vec![zero; qv.len()];
    let (mut mx, mut sm) = (vec![0f32; b * hq * s], vec![0f32; b * hq * s]);
    let fwd = best(|| attention(&exec, q, k, v, &o, &mut out, &mut mx, &mut sm, &mut ws).unwrap());
    let (mut dq, mut dk, mut dv) = (
        vec![zero; qv.len()],
        vec![zero; kv.len()],
        vec![zero; kv.len()],
    );
    let sd = [b, hq, s];
    let saved = AttentionSaved {
        out: TensorRef::new(&out, &qd).unwrap(),
        dout: TensorRef::new(&dov, &qd).unwrap(),
        softmax_max: TensorRef::new(&mx, &sd).unwrap(),
        softmax_sum: TensorRef::new(&sm, &sd).unwrap(),
    };
    let bwd = best(|| {
        attention_backward(
            &exec, q, k, v, &saved, &o, &mut dq, &mut dk, &mut dv, &mut ws,
        )
        .unwrap()
    });
    // Products of 2 s s d flops per head: two forward, five backward (the
    // scores again, dP, dq, dk, dv); causal: half of them.
    let prod = 2.0 * (b * hq) as f64 * (s * s * d) as f64 * if causal { 0.5 } else { 1.0 };
    println!(
        "{:?} B {b} Hq {hq} Hkv {hkv} S {s} D {d} causal {causal}: forward {:.2} ms ({:.0} GFLOP/s), backward {:.2} ms ({:.0} GFLOP/s), together {:.2} ms",
        T::DTYPE,
        fwd * 1e3,
        2.0 * prod / fwd * 1e-9,
        bwd * 1e3,
        5.0 * prod / bwd * 1e-9,
        (fwd + bwd) * 1e3
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dims: [usize; 5] = args
        .iter()
        .position(|a| a == "--shape")
        .and_then(|i| args.get(i + 1))
        .map(|s| {
            let v: Vec<usize> = s.split(',').map(|x| x.parse().expect("a number")).collect();
            v.try_into().expect("B,Hq,Hkv,S,D")
        })
        .unwrap_or([1, 16, 4, 512, 64]);
    let causal = !args.iter().any(|a| a == "--full");
    if args.iter().any(|a| a == "--f32") {
        run::<f32>(dims, causal);
    } else {
        run::<bf16>(dims, causal);
    }
}
