//! The FP8 path end to end on a GPU, the way its users reach it: 16-bit Q, K and V
//! quantized on the GPU ([`Attention::quantize_fp8`]), the FP8 forward on the operands it
//! returns, and the result against float64 attention on the 16-bit inputs
//! ([`flashcore::check::check_forward_fp8`], what `flashcore run --dtype e4m3` runs); and
//! the same through the C ABI (`flashcore_fp8_workspace_bytes`, `flashcore_quantize_fp8`,
//! `flashcore_forward_fp8`), which must give the Rust API's output bit for bit.
//!
//! Run on an sm_89+ GPU with `cargo test --release --test gpu_fp8_end_to_end --
//! --include-ignored`; on an older GPU the tests say so and pass vacuously.

mod common;

use std::sync::Arc;

use common::{down, ptr, seeds, up};
use cudarc::driver::CudaStream;
use flashcore::check::{FP8_TOLERANCE, FwdCase, Layout, check_forward_fp8};
use flashcore::ffi::{
    FLASHCORE_BF16, FLASHCORE_E4M3, FLASHCORE_F16, FLASHCORE_SUCCESS, FlashcoreContext,
    FlashcoreFp8Operands, FlashcoreQuantizeOptions, FlashcoreTensor, flashcore_check_forward_fp8,
    flashcore_check_quantize_fp8, flashcore_create, flashcore_destroy, flashcore_error_name,
    flashcore_forward_fp8, flashcore_fp8_workspace_bytes, flashcore_last_error,
    flashcore_quantize_fp8,
};
use flashcore::host::attention::{Attention, PathChoice};
use flashcore::host::decode::Workspace;
use flashcore::host::device::Device;
use flashcore::host::quantize::{Fp8Layout, QuantizeOptions};
use flashcore::host::tensor::{AttentionParams, DType, LseView, TensorView};
use flashcore::kernels::attention::HalfType;
use flashcore::reference::{self, Rng};
use flashcore::shape::AttnShape;

/// The device, or `None` (with a note) below sm_89.
fn device() -> Option<Arc<Device>> {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let arch = device.compute_capability();
    if arch < (8, 9) {
        println!("skipped: sm_{}{} has no FP8 tensor cores", arch.0, arch.1);
        return None;
    }
    Some(device)
}

fn shape(b: usize, hq: usize, hkv: usize, sq: usize, sk: usize, d: usize) -> AttnShape {
    AttnShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
    }
}

/// The four option sets: none, smoothing, rotation, both.
fn option_sets() -> [QuantizeOptions; 4] {
    [
        QuantizeOptions::default(),
        QuantizeOptions {
            smooth_k: true,
            hadamard_seed: None,
        },
        QuantizeOptions {
            smooth_k: false,
            hadamard_seed: Some(0x5EED),
        },
        QuantizeOptions {
            smooth_k: true,
            hadamard_seed: Some(u64::MAX),
        },
    ]
}

/// Every FP8 head dim, GQA and MQA, Sq < Sk and Sq > Sk (causal rows that see no key),
/// lengths off the 128-row scale blocks, one key, both layouts and both output types, each
/// with every option set, causal and not; on the kernel family `path` selects.
fn check_all(path: PathChoice) {
    let Some(dev) = device() else { return };
    let stream = dev.context().default_stream();
    let attn = Attention::new(dev.clone())
        .expect("an attention context")
        .with_path(path);
    let shapes = [
        shape(2, 8, 8, 1, 1, 64),
        shape(1, 4, 4, 64, 64, 64),
        shape(2, 8, 2, 113, 300, 128),
        shape(1, 4, 1, 300, 113, 64),
        shape(1, 2, 2, 257, 1023, 256),
        shape(1, 8, 2, 16, 4097, 128),
    ];
    let mut seeds = seeds();
    let mut failures = Vec::new();
    let mut n = 0;
    for (i, &sh) in shapes.iter().enumerate() {
        for causal in [false, true] {
            for options in option_sets() {
                n += 1;
                let case = FwdCase {
                    shape: sh,
                    dtype: if (i + n) % 2 == 0 {
                        HalfType::F16
                    } else {
                        HalfType::Bf16
                    },
                    causal,
                    window: Default::default(),
                    layout: if i % 2 == 0 {
                        Layout::Bshd
                    } else {
                        Layout::Bhsd
                    },
                    kernel: None,
                    softcap: None,
                    softmax_scale: None,
                };
                let mut rng = seeds.next_case();
                let r = check_forward_fp8(&attn, &stream, case, &options, &mut rng)
                    .unwrap_or_else(|e| panic!("{case} {options:?}: {e}"));
                let line = format!(
                    "{case} smooth_k {} hadamard {:?}: out {:.3e}, lse {:.3e}, unwritten {}",
                    options.smooth_k, options.hadamard_seed, r.out_err, r.lse_err, r.unwritten
                );
                println!("{line}");
                if !r.passes() {
                    failures.push(format!("{line} ({})", seeds.replay(&rng)));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {n} cases out of bounds:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn quantized_on_the_gpu_then_fp8_forward_matches_float64() {
    check_all(PathChoice::Best);
}

/// The same through the sm89 kernels (`mma.sync` e4m3), which Hopper runs when asked.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sm89_quantized_on_the_gpu_then_fp8_forward_matches_float64() {
    check_all(PathChoice::Sm80);
}

/// A C tensor of `view`.
fn c_tensor(t: &TensorView) -> FlashcoreTensor {
    FlashcoreTensor {
        ptr: t.ptr,
        dtype: match t.dtype {
            DType::F16 => FLASHCORE_F16,
            DType::Bf16 => FLASHCORE_BF16,
            other => panic!("no 16-bit C code for {other}"),
        },
        shape: t.shape.map(|n| n as i64),
        strides: t.strides.map(|s| s as i64),
    }
}

/// The message of the last failing C call, for a failed assertion.
fn c_error(rc: i32) -> String {
    // SAFETY: both return valid NUL-terminated strings, copied out at once.
    unsafe {
        format!(
            "{}: {}",
            std::ffi::CStr::from_ptr(flashcore_error_name(rc)).to_string_lossy(),
            std::ffi::CStr::from_ptr(flashcore_last_error()).to_string_lossy()
        )
    }
}

/// One problem's 16-bit inputs on the device, `[B, S, H, D]`, with Q stored `[B, H, S,
/// D]` (a strided view) when `q_bhsd`.
struct Inputs {
    q: cudarc::driver::CudaSlice<u16>,
    k: cudarc::driver::CudaSlice<u16>,
    v: cudarc::driver::CudaSlice<u16>,
    views: [TensorView; 3],
}

fn inputs(s: &Arc<CudaStream>, sh: &AttnShape, dtype: HalfType, rng: &mut Rng) -> Inputs {
    let (q_bits, _) = reference::random_half(rng, sh.q_len(), dtype);
    let (k_bits, _) = reference::random_half(rng, sh.kv_len(), dtype);
    let (v_bits, _) = reference::random_half(rng, sh.kv_len(), dtype);
    let (q, k, v) = (up(s, &q_bits), up(s, &k_bits), up(s, &v_bits));
    let dt = DType::from(dtype);
    let (b, d) = (sh.batch, sh.head_dim);
    let views = [
        // The bits are random: their order in memory does not matter, only the views'.
        TensorView::bhsd(ptr(s, &q), dt, b, sh.seqlen_q, sh.heads_q, d),
        TensorView::bshd(ptr(s, &k), dt, b, sh.seqlen_k, sh.heads_kv, d),
        TensorView::bshd(ptr(s, &v), dt, b, sh.seqlen_k, sh.heads_kv, d),
    ];
    Inputs { q, k, v, views }
}

/// The C ABI's quantize and forward against the Rust API's on the same inputs: the same
/// bits in O and the LSE (the kernels are deterministic without K smoothing, whose mean
/// is summed with atomics), the operands at the same offsets of their workspaces, a
/// workspace the C call must align itself, and the check twins agreeing with the calls.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_c_abi_gives_the_rust_apis_output() {
    let Some(dev) = device() else { return };
    let s = dev.context().default_stream();
    let attn = Attention::new(dev.clone()).expect("an attention context");
    let mut ctx: *mut FlashcoreContext = std::ptr::null_mut();
    // SAFETY: `ctx` is a valid place for one pointer.
    let rc = unsafe { flashcore_create(0, &mut ctx) };
    assert_eq!(rc, FLASHCORE_SUCCESS, "{}", c_error(rc));
    let mut seeds = seeds();
    for (sh, dtype, options) in [
        (
            shape(2, 8, 2, 300, 1001, 128),
            HalfType::Bf16,
            QuantizeOptions::default(),
        ),
        (
            shape(1, 4, 4, 129, 129, 64),
            HalfType::F16,
            QuantizeOptions {
                smooth_k: false,
                hadamard_seed: Some(3),
            },
        ),
        (
            shape(1, 2, 1, 77, 200, 256),
            HalfType::F16,
            QuantizeOptions::default(),
        ),
    ] {
        let mut rng = seeds.next_case();
        let x = inputs(&s, &sh, dtype, &mut rng);
        let [cq, ck, cv] = x.views.map(|t| c_tensor(&t));
        let c_options = FlashcoreQuantizeOptions {
            smooth_k: options.smooth_k as i32,
            hadamard: options.hadamard_seed.is_some() as i32,
            hadamard_seed: options.hadamard_seed.unwrap_or(0),
        };
        let layout = Fp8Layout::new(&sh, &options).unwrap();

        // The size C reports: the layout plus room to align it.
        let mut bytes = 0usize;
        // SAFETY: every pointer points at a live local.
        let rc = unsafe { flashcore_fp8_workspace_bytes(&cq, &ck, &cv, &c_options, &mut bytes) };
        assert_eq!(rc, FLASHCORE_SUCCESS, "{}", c_error(rc));
        assert_eq!(bytes, layout.bytes + Fp8Layout::ALIGN - 1);

        // C's workspace starts 16 bytes past an aligned address; Rust's is aligned.
        let c_buf = up(&s, &vec![0xCDu8; bytes + 16]);
        let c_ws = (ptr(&s, &c_buf).next_multiple_of(256) + 16, bytes);
        let r_buf = up(&s, &vec![0xCDu8; layout.bytes + 256]);
        let r_ws = Workspace {
            ptr: ptr(&s, &r_buf).next_multiple_of(256),
            bytes: layout.bytes,
        };
        // SAFETY: every pointer points at a live local; nothing is read through them.
        let rc = unsafe { flashcore_check_quantize_fp8(&cq, &ck, &cv, &c_options, c_ws.0, c_ws.1) };
        assert_eq!(rc, FLASHCORE_SUCCESS, "{}", c_error(rc));
        let mut c_ops = FlashcoreFp8Operands::default();
        // SAFETY: `ctx` is live; the tensors and the workspace lie in the live buffers
        // above, which outlive the downloads below (on the same, default, stream).
        let rc = unsafe {
            flashcore_quantize_fp8(
                ctx,
                &cq,
                &ck,
                &cv,
                &c_options,
                c_ws.0,
                c_ws.1,
                &mut c_ops,
                std::ptr::null_mut(),
            )
        };
        assert_eq!(rc, FLASHCORE_SUCCESS, "{}", c_error(rc));
        let [q, k, v] = x.views;
        // SAFETY: as above.
        let r_ops = unsafe { attn.quantize_fp8(&q, &k, &v, &options, r_ws, s.cu_stream()) }
            .expect("the Rust quantizer");

        // The same layout, 240 bytes further into C's buffer.
        let c_base = c_ws.0.next_multiple_of(256);
        assert_eq!(c_ops.q.dtype, FLASHCORE_E4M3);
        assert_eq!(c_ops.q.ptr - c_base, r_ops.q.ptr - r_ws.ptr);
        assert_eq!(c_ops.vt - c_base, r_ops.vt.ptr - r_ws.ptr);
        assert_eq!(c_ops.v_scale - c_base, r_ops.v_scale - r_ws.ptr);
        assert_eq!(c_ops.lse_shift, 0);
        assert_eq!(
            c_ops.vt_strides,
            r_ops.vt.strides.map(|st| st as i64),
            "Vt's strides"
        );

        let out = |bhsd: bool| {
            let o = up(&s, &vec![reference::poison(dtype); sh.q_len()]);
            let lse = up(&s, &vec![f32::NAN; sh.lse_len()]);
            let make = if bhsd {
                TensorView::bhsd
            } else {
                TensorView::bshd
            };
            let view = make(
                ptr(&s, &o),
                DType::from(dtype),
                sh.batch,
                sh.seqlen_q,
                sh.heads_q,
                sh.head_dim,
            );
            (o, lse, view)
        };
        let (mut c_o, mut c_lse, c_view) = out(true);
        let (mut r_o, mut r_lse, r_view) = out(true);
        let co = c_tensor(&c_view);
        for causal in [false, true] {
            // Poisoned afresh: an element the causal pass left unwritten must not show
            // the first pass's value (the same in both outputs, so equal).
            let poison = vec![reference::poison(dtype); sh.q_len()];
            let nan = vec![f32::NAN; sh.lse_len()];
            for (o, lse) in [(&mut c_o, &mut c_lse), (&mut r_o, &mut r_lse)] {
                s.memcpy_htod(&poison, o).expect("poison O");
                s.memcpy_htod(&nan, lse).expect("poison the LSE");
            }
            // SAFETY: every pointer points at a live local; nothing is read through them.
            let rc = unsafe {
                flashcore_check_forward_fp8(&c_ops, &co, ptr(&s, &c_lse), 0.0, causal as i32)
            };
            assert_eq!(rc, FLASHCORE_SUCCESS, "{}", c_error(rc));
            // SAFETY: `ctx` is live; the operands lie in `c_buf`, O and the LSE in `c_o`
            // and `c_lse`, all alive until the downloads below.
            let rc = unsafe {
                flashcore_forward_fp8(
                    ctx,
                    &c_ops,
                    &co,
                    ptr(&s, &c_lse),
                    0.0,
                    causal as i32,
                    std::ptr::null_mut(),
                )
            };
            assert_eq!(rc, FLASHCORE_SUCCESS, "{}", c_error(rc));
            let params = AttentionParams {
                softmax_scale: None,
                causal,
                ..Default::default()
            };
            // SAFETY: the operands lie in `r_buf`, O and the LSE in `r_o` and `r_lse`, all
            // alive until the downloads below.
            unsafe {
                attn.forward_fp8(
                    &r_ops,
                    &r_view,
                    Some(&LseView {
                        ptr: ptr(&s, &r_lse),
                    }),
                    &params,
                    s.cu_stream(),
                )
            }
            .expect("the Rust FP8 forward");
            let (c_bits, r_bits) = (down(&s, &c_o), down(&s, &r_o));
            assert!(
                c_bits == r_bits,
                "{sh} causal {causal}: C's O differs from Rust's"
            );
            assert!(
                !c_bits.contains(&reference::poison(dtype)),
                "{sh}: O not written"
            );
            let (c_l, r_l) = (down(&s, &c_lse), down(&s, &r_lse));
            assert!(
                c_l.iter()
                    .zip(&r_l)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{sh} causal {causal}: C's LSE differs from Rust's"
            );
            // Rows that see no key hold -inf; NaN is the poison.
            assert!(
                !c_l.iter().any(|x| x.is_nan()),
                "{sh} causal {causal}: LSE not written"
            );
        }
        drop((x.q, x.k, x.v, c_buf, r_buf));
    }
    // SAFETY: `ctx` came from flashcore_create and is destroyed once.
    unsafe { flashcore_destroy(ctx) };
}

/// One infinite input element spoils only the outputs that read it, as in 16-bit
/// attention. An infinity in Q's row `r` makes that row of O non-finite and leaves every
/// other row, those of its own 128-row scale block included, within the FP8 bound of
/// float64 attention on the finite rest; an infinity in causal key `j` spoils the rows of
/// its heads that see key `j` and no others. (A quantizer that took the block's amax over
/// the infinity gave the block an infinite scale and its finite elements zero codes:
/// finite, wrong rows.) Both kernel families; no option, the rotation, K smoothing and
/// both: the key mean sums K's finite elements only (one that summed the infinity made the
/// mean, every key of the head and every query's LSE shift non-finite).
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_infinite_input_spoils_only_the_outputs_that_read_it() {
    let Some(dev) = device() else { return };
    let s = dev.context().default_stream();
    let sh = shape(1, 4, 2, 200, 200, 128);
    let (d, hq, hkv) = (sh.head_dim, sh.heads_q, sh.heads_kv);
    let scale = 1.0 / (d as f64).sqrt();
    // Q's element (row 5, head 1, channel 7); K's (key 150, KV head 0, channel 3).
    let q_at = (5 * hq + 1) * d + 7;
    let (key, k_at) = (150, (150 * hkv) * d + 3);
    let mut seeds = seeds();
    let mut failures = Vec::new();
    for path in [PathChoice::Best, PathChoice::Sm80] {
        let attn = Attention::new(dev.clone())
            .expect("an attention context")
            .with_path(path);
        for (dtype, smooth_k, hadamard_seed) in [
            (HalfType::Bf16, false, None),
            (HalfType::F16, false, Some(9)),
            (HalfType::F16, true, None),
            (HalfType::Bf16, true, Some(4)),
        ] {
            let options = QuantizeOptions {
                smooth_k,
                hadamard_seed,
            };
            for spoiled in ["q", "k"] {
                let mut rng = seeds.next_case();
                let (mut q_bits, mut q) = reference::random_half(&mut rng, sh.q_len(), dtype);
                let (mut k_bits, mut k) = reference::random_half(&mut rng, sh.kv_len(), dtype);
                let (v_bits, v) = reference::random_half(&mut rng, sh.kv_len(), dtype);
                let inf = match dtype {
                    HalfType::F16 => 0x7C00,
                    HalfType::Bf16 => 0x7F80,
                };
                // The reference sees the finite rest: the element as 0.
                if spoiled == "q" {
                    q_bits[q_at] = inf;
                    q[q_at] = 0.0;
                } else {
                    k_bits[k_at] = inf | 0x8000;
                    k[k_at] = 0.0;
                }
                let want = reference::attention_f64(&sh, &q, &k, &v, scale, true);
                let (qd, kd, vd) = (up(&s, &q_bits), up(&s, &k_bits), up(&s, &v_bits));
                let dt = DType::from(dtype);
                let [qv, kv, vv] = [
                    (&qd, sh.seqlen_q, hq),
                    (&kd, sh.seqlen_k, hkv),
                    (&vd, sh.seqlen_k, hkv),
                ]
                .map(|(x, s_len, h)| TensorView::bshd(ptr(&s, x), dt, 1, s_len, h, d));
                let layout = Fp8Layout::new(&sh, &options).unwrap();
                let ws_buf = up(&s, &vec![0xCDu8; layout.bytes + 256]);
                let ws = Workspace {
                    ptr: ptr(&s, &ws_buf).next_multiple_of(256),
                    bytes: layout.bytes,
                };
                let o = up(&s, &vec![reference::poison(dtype); sh.q_len()]);
                let ov = TensorView::bshd(ptr(&s, &o), dt, 1, sh.seqlen_q, hq, d);
                let params = AttentionParams {
                    causal: true,
                    ..Default::default()
                };
                // SAFETY: the views and the workspace lie in the live buffers above, used
                // on `s` only and alive until the download below.
                let ops = unsafe { attn.quantize_fp8(&qv, &kv, &vv, &options, ws, s.cu_stream()) }
                    .expect("quantize");
                // SAFETY: as above; `ops` lies in the workspace.
                unsafe { attn.forward_fp8(&ops, &ov, None, &params, s.cu_stream()) }
                    .expect("FP8 forward");
                let got = reference::half_bits_to_f64(&down(&s, &o), dtype);
                // Which (row, head) pairs read the infinity.
                let reads = |row: usize, head: usize| {
                    if spoiled == "q" {
                        (row, head) == (5, 1)
                    } else {
                        head / (hq / hkv) == 0 && row >= key
                    }
                };
                // The rows that do not read it but whose inputs share its scale block: Q's
                // other rows of block 0 in head 1; the rows of the key's heads that see
                // keys 128.. of its block, but not key 150.
                let neighbour = |row: usize, head: usize| {
                    if spoiled == "q" {
                        head == 1 && row < 128
                    } else {
                        head / (hq / hkv) == 0 && (128..key).contains(&row)
                    }
                };
                let (mut clean, mut near) = ((Vec::new(), Vec::new()), (Vec::new(), Vec::new()));
                let (mut clean_nonfinite, mut spoiled_finite) = (0, 0);
                for row in 0..sh.seqlen_q {
                    for head in 0..hq {
                        let at = (row * hq + head) * d;
                        let out = &got[at..at + d];
                        if reads(row, head) {
                            spoiled_finite += out.iter().filter(|x| x.is_finite()).count();
                            continue;
                        }
                        clean_nonfinite += out.iter().filter(|x| !x.is_finite()).count();
                        let into = if neighbour(row, head) {
                            &mut near
                        } else {
                            &mut clean
                        };
                        into.0.extend_from_slice(out);
                        into.1.extend_from_slice(&want.out[at..at + d]);
                    }
                }
                let err = reference::rel_l2(&clean.0, &clean.1);
                let near_err = reference::rel_l2(&near.0, &near.1);
                let line = format!(
                    "{path:?} {dtype:?} smooth_k {smooth_k} hadamard {hadamard_seed:?}, infinity \
                     in {spoiled}: error {near_err:.3e} on its block's other rows, {err:.3e} on \
                     the rest ({clean_nonfinite} non-finite), {spoiled_finite} finite elements \
                     in the rows that read it"
                );
                println!("{line}");
                let bad = |e: f64| e.is_nan() || e > FP8_TOLERANCE;
                if bad(err) || bad(near_err) || clean_nonfinite > 0 || spoiled_finite > 0 {
                    failures.push(format!("{line} ({})", seeds.replay(&rng)));
                }
                s.synchronize().expect("synchronize");
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
