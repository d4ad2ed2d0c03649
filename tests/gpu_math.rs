//! The DSL's composite math routines on the GPU against float64. Run with
//! `cargo test --release --test gpu_math -- --include-ignored`.
//!
//! `Kernel::ex2_fma` stands in for `ex2.approx` on some of the softmax's probabilities
//! (`OnlineSoftmax::with_fma_exps`), so it must agree with `2^x` over every exponent a
//! softmax can hand it: from the masked −∞ through the FP8 kernels' `+8.75`.

use std::ffi::c_void;

use cudarc::driver::DevicePtr;

use flashcore::host::device::Device;
use flashcore::host::launch::{LaunchDims, launch};
use flashcore::host::module;
use flashcore::ptx::{Cmp, F32, Kernel, Module, Special, Target, U32, U64};
use flashcore::reference::Rng;

const ENTRY: &str = "flashcore_test_ex2_fma";
const THREADS: u32 = 256;

/// `out[i] = ex2_fma(x[i])` for `i < n`, one element per thread.
fn ex2_fma_module() -> String {
    let mut k = Kernel::new(ENTRY);
    k.max_threads(THREADS);
    let x_p = k.param::<U64>("x");
    let out_p = k.param::<U64>("out");
    let n_p = k.param::<U32>("n");
    let (x, out, n) = (k.load_param(x_p), k.load_param(out_p), k.load_param(n_p));
    let tid = k.special(Special::TidX);
    let block = k.special(Special::CtaidX);
    let i = k.mad(block, THREADS, tid);
    let inside = k.setp(Cmp::Lt, i, n);
    k.if_(inside, |k| {
        let offset = k.mul_wide_u32(i, 4u32);
        let src = k.add(x, offset);
        let v = k.ld_global::<F32>(src, 0);
        let e = k.ex2_fma(v);
        let dst = k.add(out, offset);
        k.st_global(dst, 0, e);
    });
    let mut m = Module::new(Target::Sm80);
    m.push(k.finish().expect("the test kernel builds"))
        .expect("the test kernel fits sm_80");
    m.to_ptx()
}

/// Every exponent the softmax can produce, and the edges of the routine's range.
fn inputs() -> Vec<f32> {
    let mut x: Vec<f32> = (0..(268 * 64)).map(|i| -140.0 + i as f32 / 64.0).collect();
    let mut rng = Rng::new(0xE2F3A);
    x.extend((0..100_000).map(|_| (rng.uniform() * 30.0 - 20.0) as f32));
    x.extend([
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::MAX,
        -1e30,
        -127.5,
        -127.0,
        -126.000_01,
        -126.0,
        -125.999_99,
        -1.0,
        -f32::MIN_POSITIVE,
        -0.0,
        0.0,
        1e-40,
        0.999_999_94,
        1.0,
        8.75,
        127.999_99,
    ]);
    x
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn ex2_fma_matches_float64_over_the_softmax_range() {
    let device = Device::new(0).expect("a CUDA device");
    let ctx = device.context();
    let stream = ctx.default_stream();
    let kernel = module::load(ctx, &ex2_fma_module(), ENTRY, 0).expect("the module loads");

    let x = inputs();
    let n = u32::try_from(x.len()).unwrap();
    // Poison: a NaN no input maps to, so an unwritten element cannot pass.
    let poison = vec![f32::from_bits(0x7FBA_DBAD); x.len()];
    let x_dev = stream.clone_htod(&x).unwrap();
    let out_dev = stream.clone_htod(&poison).unwrap();
    let mut x_ptr: u64 = x_dev.device_ptr(&stream).0;
    let mut out_ptr: u64 = out_dev.device_ptr(&stream).0;
    let mut n_arg = n;
    let mut params: [*mut c_void; 3] = [
        (&raw mut x_ptr).cast(),
        (&raw mut out_ptr).cast(),
        (&raw mut n_arg).cast(),
    ];
    let dims = LaunchDims {
        grid: (n.div_ceil(THREADS), 1, 1),
        block: (THREADS, 1, 1),
        dynamic_smem: 0,
    };
    // SAFETY: three parameters (u64, u64, u32) as the kernel declares them; both buffers
    // hold `n` f32 of this context and outlive the synchronize below.
    unsafe { launch(&kernel, &dims, stream.cu_stream(), &mut params) }.expect("launch");
    let out: Vec<f32> = stream.clone_dtoh(&out_dev).unwrap();
    stream.synchronize().unwrap();

    let mut worst = 0f64;
    let mut failures = Vec::new();
    for (&xi, &got) in x.iter().zip(&out) {
        if got.to_bits() == poison[0].to_bits() {
            failures.push(format!("x {xi:e}: unwritten"));
            continue;
        }
        let ok = if xi.is_nan() {
            got.is_nan()
        } else if xi < -126.0 {
            // Below the normal range (−∞ included): exactly 0, as ex2.approx.ftz gives.
            got == 0.0
        } else {
            let want = (xi as f64).exp2();
            let rel = (got as f64 / want - 1.0).abs();
            worst = worst.max(rel);
            rel <= 1e-4
        };
        if !ok {
            failures.push(format!("x {xi:e} ({:#010x}): got {got:e}", xi.to_bits()));
        }
    }
    println!(
        "ex2_fma: {} inputs, worst relative error {worst:.3e}",
        x.len()
    );
    assert!(
        failures.is_empty(),
        "{} failures, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(10)]
    );
}
