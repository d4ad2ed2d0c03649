//! flashcore leaves the calling thread's current CUDA context as it found it: every entry
//! point (opening a device, forward calls that succeed or fail, kernel loading, timing,
//! dropping, the C ABI) is called with a context of the caller's own current, and again
//! with none current, and after each the current context must be the one from before.
//! Run on a GPU machine with `cargo test --release --test gpu_context -- --include-ignored`.

use std::ptr;
use std::sync::Arc;

use cudarc::driver::DevicePtr;
use cudarc::driver::sys::{self, CUcontext, CUdevice, CUresult};

use flashcore::check::{DeviceCase, FwdCase, LSE_TOLERANCE, Layout, TestSeeds, tolerance};
use flashcore::ffi::{self, FLASHCORE_SUCCESS, FlashcoreContext, FlashcoreTensor};
use flashcore::host::attention::Attention;
use flashcore::host::decode::Workspace;
use flashcore::host::device::{Device, device_count};
use flashcore::host::quantize::{Fp8Layout, QuantizeOptions};
use flashcore::host::tensor::{AttentionParams, TensorView};
use flashcore::host::timing::{Backlog, EventTimer, median_ms, median_ms_queued};
use flashcore::kernels::attention::HalfType;
use flashcore::reference;
use flashcore::shape::AttnShape;
use flashcore::tma::{TiledMap, TmaType};
use flashcore::{Error, ptx::Swizzle};

fn current() -> CUcontext {
    let mut c: CUcontext = ptr::null_mut();
    // SAFETY: the driver is loaded and initialised (device_count ran first); `c` is a valid
    // out-pointer.
    let r = unsafe { sys::cuCtxGetCurrent(&mut c) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "cuCtxGetCurrent");
    c
}

fn set_current(c: CUcontext) {
    // SAFETY: `c` is null or a live context (the test's own, or a primary context that a
    // live Device retains).
    let r = unsafe { sys::cuCtxSetCurrent(c) };
    assert_eq!(r, CUresult::CUDA_SUCCESS, "cuCtxSetCurrent");
}

/// A non-primary context of device 0, destroyed on drop.
struct OwnContext(CUcontext);

impl OwnContext {
    /// Creates the context; the driver makes it current on this thread.
    fn new() -> OwnContext {
        let mut dev: CUdevice = 0;
        // SAFETY: the driver is initialised; `dev` is a valid out-pointer.
        let r = unsafe { sys::cuDeviceGet(&mut dev, 0) };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "cuDeviceGet");
        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; null creation parameters and flags 0 ask
        // for a plain context with the default scheduling.
        let r = unsafe { sys::cuCtxCreate_v4(&mut ctx, ptr::null_mut(), 0, dev) };
        assert_eq!(r, CUresult::CUDA_SUCCESS, "cuCtxCreate");
        assert!(!ctx.is_null());
        OwnContext(ctx)
    }
}

impl Drop for OwnContext {
    fn drop(&mut self) {
        // SAFETY: the context was created by cuCtxCreate and is destroyed once, here;
        // nothing of it is in use any more.
        let _ = unsafe { sys::cuCtxDestroy_v2(self.0) };
    }
}

fn small_case() -> FwdCase {
    FwdCase {
        shape: AttnShape {
            batch: 1,
            seqlen_q: 100,
            seqlen_k: 130,
            heads_q: 2,
            heads_kv: 1,
            head_dim: 64,
        },
        dtype: HalfType::F16,
        causal: true,
        window: Default::default(),
        layout: Layout::Bshd,
        kernel: None,
        softcap: None,
        softmax_scale: None,
    }
}

fn c_tensor(t: &TensorView) -> FlashcoreTensor {
    FlashcoreTensor {
        ptr: t.ptr,
        dtype: ffi::FLASHCORE_F16,
        shape: t.shape.map(|n| n as i64),
        strides: t.strides.map(|n| n as i64),
    }
}

/// Calls every entry point with `expect` current on this thread (re-establishing it where
/// the test itself uses cudarc, which binds the primary context) and asserts after each
/// that `expect` is still current.
fn every_entry_point_keeps(expect: CUcontext, what: &str) {
    let check = |step: &str| {
        assert_eq!(
            current(),
            expect,
            "{what}: after {step} the current context changed"
        );
    };

    set_current(expect);
    let device = Arc::new(Device::new(0).expect("device 0"));
    check("Device::new");
    assert_ne!(
        device.context().cu_ctx(),
        expect,
        "the test needs a context other than the primary one"
    );

    // Buffers in the primary context, through cudarc (which makes it current).
    let stream = device.context().default_stream();
    let case = small_case();
    let mut seeds = TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
    let mut rng = seeds.next_case();
    let replay = seeds.replay(&rng);
    let mut dev = DeviceCase::new(&stream, case, &mut rng).expect("upload");
    let ([q, k, v, o], lse) = dev.views();
    let params = AttentionParams {
        softmax_scale: None,
        causal: true,
        ..Default::default()
    };
    let cu_stream = stream.cu_stream();
    let backlog_buf = stream.alloc_zeros::<u8>(1 << 20).expect("backlog");
    let backlog = Backlog {
        ptr: backlog_buf.device_ptr(&stream).0,
        bytes: backlog_buf.len(),
        passes: 2,
    };
    set_current(expect);

    let attn = Attention::new(device.clone()).expect("an sm_80+ GPU");
    // First call: generates and loads the kernel, then launches.
    // SAFETY: the views are the case's own live buffers, on its stream.
    unsafe { attn.forward(&q, &k, &v, &o, Some(&lse), &params, cu_stream) }
        .expect("forward (cold)");
    check("a forward call that loads its kernel");
    // SAFETY: as above.
    unsafe { attn.forward(&q, &k, &v, &o, Some(&lse), &params, cu_stream) }
        .expect("forward (warm)");
    check("a warm forward call");

    // The safe call over cudarc buffers, on a second stream: cudarc then orders the
    // buffers' uses by events, making the device's context current to wait and record.
    {
        use flashcore::host::buffers::{Layout4, Tensor, TensorMut};
        let side = device.context().new_stream().expect("a second stream");
        let l = Layout4::bshd(1, 64, 2, 64);
        let ones = vec![half::f16::ONE; 64 * 2 * 64];
        let x = side.clone_htod(&ones).expect("upload");
        let mut out = side.clone_htod(&ones).expect("upload");
        set_current(expect);
        let inputs = [Tensor::new(&x, l), Tensor::new(&x, l), Tensor::new(&x, l)];
        attn.forward_buffers(&side, inputs, TensorMut::new(&mut out, l), None, &params)
            .expect("forward_buffers");
        check("forward_buffers on a second stream");
        side.synchronize().expect("synchronize");
        drop((x, out, side));
        set_current(expect);
    }

    // A rejected call: k with heads that do not divide q's.
    let bad_k = TensorView::bshd(k.ptr, k.dtype, 1, 130, 3, 64);
    // SAFETY: as above; validation rejects the call before anything runs.
    let err = unsafe { attn.forward(&q, &bad_k, &v, &o, Some(&lse), &params, cu_stream) };
    assert!(err.is_err(), "a bad head ratio was accepted");
    check("a rejected forward call");

    // A driver failure after the context switch: the JIT refuses this module.
    let broken = ".version 8.4\n.target sm_80\n.address_size 64\n.visible .entry broken()\n{\n    add.f32 %f0, %f1;\n    ret;\n}\n";
    let r = flashcore::host::module::load(device.context(), broken, "broken", 0);
    assert!(r.is_err(), "broken PTX loaded");
    check("a failed kernel load");

    // A kernel's shared-memory carveout: the driver's choice unless asked for all of it.
    use flashcore::host::module::{Carveout, load, load_with};
    let empty =
        ".version 8.4\n.target sm_80\n.address_size 64\n.visible .entry empty()\n{\n    ret;\n}\n";
    let plain = load(device.context(), empty, "empty", 0).expect("load");
    let all = load_with(device.context(), empty, "empty", 0, Carveout::MaxShared).expect("load");
    assert_eq!(
        (plain.preferred_carveout, all.preferred_carveout),
        (-1, 100)
    );
    check("carveout preferences");

    // Timing.
    let timer = EventTimer::new(device.context()).expect("events");
    check("EventTimer::new");
    // SAFETY: a null stream is the legacy default stream of the timer's (primary) context.
    unsafe { timer.record_start(ptr::null_mut()) }.expect("record");
    check("EventTimer::record_start");
    // SAFETY: as above.
    unsafe { timer.record_stop(ptr::null_mut()) }.expect("record");
    check("EventTimer::record_stop");
    timer.elapsed_ms().expect("elapsed");
    check("EventTimer::elapsed_ms");
    drop(timer);
    check("dropping an EventTimer");
    let run = || {
        // SAFETY: as for the forward calls above.
        unsafe { attn.forward(&q, &k, &v, &o, Some(&lse), &params, cu_stream) }
    };
    // SAFETY: `cu_stream` is the case's stream, of the device's context, alive throughout;
    // `run` enqueues on it.
    let stats = unsafe { median_ms(device.context(), cu_stream, 1, 2, run) }.expect("median_ms");
    assert!(stats.median_ms >= 0.0);
    check("median_ms");
    // SAFETY: as above; the backlog's bytes are live memory of the device's context,
    // which nothing else uses.
    let stats = unsafe { median_ms_queued(device.context(), cu_stream, backlog, 1, 2, run) }
        .expect("median_ms_queued");
    assert!(stats.median_ms >= 0.0);
    check("median_ms_queued");

    // O and the LSE poisoned again (cudarc makes its context current to copy): the C
    // call below must write them itself.
    dev.poison().expect("poison");
    set_current(expect);

    // The C ABI: create, forward, a refused forward, destroy.
    let mut handle: *mut FlashcoreContext = ptr::null_mut();
    // SAFETY: `handle` is a valid place for one pointer.
    let rc = unsafe { ffi::flashcore_create(0, &mut handle) };
    assert_eq!(rc, FLASHCORE_SUCCESS);
    check("flashcore_create");
    let [cq, ck, cv, co] = [&q, &k, &v, &o].map(c_tensor);
    // SAFETY: `handle` is live; the tensors describe the case's live buffers; the stream
    // is the primary context's.
    let rc =
        unsafe { ffi::flashcore_forward(handle, &cq, &ck, &cv, &co, lse.ptr, 0.0, 1, cu_stream) };
    assert_eq!(rc, FLASHCORE_SUCCESS);
    check("flashcore_forward");
    let mut bad = ck;
    bad.dtype = 9;
    // SAFETY: as above; the dtype check refuses the call first.
    let rc =
        unsafe { ffi::flashcore_forward(handle, &cq, &bad, &cv, &co, lse.ptr, 0.0, 1, cu_stream) };
    assert_ne!(rc, FLASHCORE_SUCCESS);
    check("a refused flashcore_forward");
    // The header: work queued with a context must have finished before it is destroyed.
    stream.synchronize().expect("synchronize");
    set_current(expect);
    // SAFETY: `handle` came from flashcore_create, is destroyed once, and its work is done.
    unsafe { ffi::flashcore_destroy(handle) };
    check("flashcore_destroy");

    // The kernel ran in the primary context, on the caller's buffers: its output is right.
    let (o_bits, lse_got) = dev.download().expect("download");
    let want = dev.reference(params.scale_for(64) as f64);
    let got = reference::half_bits_to_f64(&o_bits, HalfType::F16);
    let err = reference::rel_l2(&got, &want.out);
    let lse_got: Vec<f64> = lse_got.iter().map(|&x| x as f64).collect();
    let lse_err = reference::rel_l2(&lse_got, &want.lse);
    assert!(
        err <= tolerance(HalfType::F16) && lse_err <= LSE_TOLERANCE,
        "{what}: error {err:.2e}, LSE {lse_err:.2e} ({replay})"
    );
    set_current(expect);

    drop(attn);
    check("dropping the Attention (unloads its kernels)");
    drop(device);
    check("dropping the Device");
    // The case's buffers are released through cudarc, after the checks. cudarc frees
    // without binding a context, so the one they belong to is made current first (else
    // every free fails, which compute-sanitizer counts as an error, and leaks).
    stream.context().bind_to_thread().expect("bind");
    drop((dev, backlog_buf));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_context_of_the_callers_own_stays_current() {
    assert!(device_count().expect("a CUDA driver") > 0, "no CUDA device");
    // A fresh thread: nothing else has touched its context stack.
    std::thread::spawn(|| {
        let own = OwnContext::new();
        assert_eq!(
            current(),
            own.0,
            "cuCtxCreate makes the new context current"
        );
        every_entry_point_keeps(own.0, "own context");
        set_current(own.0);
        drop(own);
    })
    .join()
    .expect("the test thread panicked");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn no_current_context_stays_none() {
    assert!(device_count().expect("a CUDA driver") > 0, "no CUDA device");
    std::thread::spawn(|| {
        assert!(current().is_null(), "a fresh thread has no current context");
        every_entry_point_keeps(ptr::null_mut(), "no context");
    })
    .join()
    .expect("the test thread panicked");
}

/// Tensor maps are encoded in the device's context whatever the caller has current (the
/// driver refuses to encode one where no context is current): with none current, Hopper's
/// 16-bit forward, the Hadamard quantizer and the FP8 forward take their TMA kernels, not
/// the fallbacks a refused map sends a call to.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hopper_calls_with_no_context_current_take_their_tma_kernels() {
    assert!(device_count().expect("a CUDA driver") > 0, "no CUDA device");
    std::thread::spawn(|| {
        let device = Arc::new(Device::new(0).expect("device 0"));
        if device.compute_capability() != (9, 0) {
            println!("skipped: the TMA kernels are Hopper's");
            return;
        }
        // Inputs and a workspace through cudarc, which makes the primary context current.
        let stream = device.context().default_stream();
        let case = small_case();
        let mut seeds = TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
        let mut rng = seeds.next_case();
        let dev = DeviceCase::new(&stream, case, &mut rng).expect("upload");
        let ([q, k, v, o], lse) = dev.views();
        let options = QuantizeOptions {
            smooth_k: false,
            hadamard_seed: Some(7),
        };
        let layout = Fp8Layout::new(&case.shape, &options).expect("layout");
        let workspace_buf = stream.alloc_zeros::<u8>(layout.bytes).expect("workspace");
        let workspace = Workspace {
            ptr: workspace_buf.device_ptr(&stream).0,
            bytes: layout.bytes,
        };
        let params = AttentionParams {
            causal: true,
            ..Default::default()
        };
        let cu_stream = stream.cu_stream();
        set_current(ptr::null_mut());

        // The driver refuses to encode a map with no context current: an error, not the
        // "TMA cannot describe this tensor" that sends a call to its fallback kernels.
        let map = TiledMap::new(TmaType::F16, &[64, 64], &[128], &[64, 64], Swizzle::B128);
        match map.encode(q.ptr) {
            Err(Error::Driver { code, .. }) if code == "CUDA_ERROR_INVALID_CONTEXT" => {}
            other => panic!("a map encoded with no context current: {other:?}"),
        }
        assert!(current().is_null(), "encoding left a context current");

        let attn = Attention::new(device.clone()).expect("an sm_80+ GPU");
        // SAFETY: the views are the case's live buffers and the workspace is live memory
        // of the device's context, all used on the case's stream only.
        unsafe { attn.forward(&q, &k, &v, &o, Some(&lse), &params, cu_stream) }.expect("forward");
        // SAFETY: as above.
        let ops = unsafe { attn.quantize_fp8(&q, &k, &v, &options, workspace, cu_stream) }
            .expect("quantize");
        // SAFETY: as above; `ops` lies in the workspace.
        unsafe { attn.forward_fp8(&ops, &o, Some(&lse), &params, cu_stream) }.expect("FP8 forward");
        assert!(current().is_null(), "a call left a context current");

        let ids: Vec<String> = attn.loaded_kernels().into_iter().map(|k| k.0).collect();
        let took = |prefix: &str| ids.iter().any(|id| id.starts_with(prefix));
        assert!(
            took("attn_fwd_sm90a_f16_") && took("attn_fwd_sm90a_e4m3_"),
            "the forwards did not run the sm90a kernels: {ids:?}"
        );
        assert!(
            !took("attn_fwd_sm80_") && !took("attn_fwd_sm89_"),
            "a forward fell back: {ids:?}"
        );
        assert!(
            ids.iter()
                .any(|id| id.starts_with("quant_e4m3_rows_") && id.ends_with("_hadamard_sm90a")),
            "the quantizer did not rotate on the tensor cores: {ids:?}"
        );
        stream.synchronize().expect("synchronize");
        drop(attn);
        // cudarc frees in whatever context is current: its own first (see above).
        stream.context().bind_to_thread().expect("bind");
        drop((dev, workspace_buf));
    })
    .join()
    .expect("the test thread panicked");
}

/// Timing queued behind a backlog, as the SDPA scripts time: each span holds the call's
/// GPU time, not the host's time between the events (here a 300 µs pause before each
/// call's tiny clear, which the plain median spans and the queued one must not), and the
/// backlog itself lies in no span.
#[test]
#[ignore = "needs a CUDA GPU"]
fn queued_timing_leaves_host_time_and_the_backlog_out_of_the_spans() {
    assert!(device_count().expect("a CUDA driver") > 0, "no CUDA device");
    let device = Arc::new(Device::new(0).expect("device 0"));
    let stream = device.context().new_stream().expect("stream");
    let busy = stream.alloc_zeros::<u8>(256 << 20).expect("backlog");
    let mut word = stream.alloc_zeros::<u32>(1).expect("a word");
    let (warmup, iters) = (2, 9);
    let calls = std::cell::Cell::new(0);
    let mut call = || {
        calls.set(calls.get() + 1);
        std::thread::sleep(std::time::Duration::from_micros(300));
        stream
            .memset_zeros(&mut word)
            .map_err(|e| flashcore::Error::Driver {
                call: "cuMemsetD8Async",
                code: e.to_string(),
            })
    };
    let cu = stream.cu_stream();
    // SAFETY: `cu` is a live stream of the device's context; `call` enqueues a clear of a
    // live buffer of it.
    let plain = unsafe { median_ms(device.context(), cu, warmup, iters, &mut call) }.unwrap();
    assert!(
        plain.median_ms > 0.25,
        "plain spans hold the pause: {plain:?}"
    );

    // One pass of the backlog, timed alone.
    let ptr = busy.device_ptr(&stream).0;
    let one = Backlog {
        ptr,
        bytes: busy.len(),
        passes: 1,
    };
    let timer = EventTimer::new(device.context()).unwrap();
    // SAFETY: as above; `busy` is live memory of the context that nothing else uses.
    unsafe {
        timer.record_start(cu).unwrap();
        sys::cuMemsetD8Async(one.ptr, 0, one.bytes, cu)
            .result()
            .unwrap();
        timer.record_stop(cu).unwrap();
    }
    let pass_ms = timer.elapsed_ms().unwrap();
    // Enough passes to outlast the host's queueing of every call, twice over.
    let passes = ((2.0 * iters as f32 * 0.35) / pass_ms).ceil() as usize + 1;
    let backlog = Backlog { passes, ..one };
    calls.set(0);
    // SAFETY: as above.
    let queued =
        unsafe { median_ms_queued(device.context(), cu, backlog, warmup, iters, &mut call) }
            .unwrap();
    assert_eq!((calls.get(), queued.iters), (warmup + iters, iters));
    assert!(
        queued.median_ms < 0.05,
        "queued spans held the host's pause: {queued:?}"
    );
    let backlog_ms = passes as f32 * pass_ms;
    assert!(
        queued.max_ms < backlog_ms / 2.0,
        "a span held the backlog ({backlog_ms} ms): {queued:?}"
    );
}

/// A second GPU: an `Attention` and a C context of device 1, called from a thread whose
/// current context is device 0's (as a framework that last touched device 0 leaves it),
/// and calls on the two devices in turn. Every call must bind device 1's context itself,
/// run on device 1's buffers and put device 0's context back; both devices' outputs must
/// be right. Skipped, saying so, on a machine with one GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_second_gpu_runs_while_the_first_is_current() {
    let count = device_count().expect("a CUDA driver");
    if count < 2 {
        eprintln!("skipped: {count} CUDA device(s), this test needs two");
        return;
    }
    std::thread::spawn(|| {
        let d0 = Arc::new(Device::new(0).expect("device 0"));
        let d1 = Arc::new(Device::new(1).expect("device 1"));
        let (ctx0, ctx1) = (d0.context().cu_ctx(), d1.context().cu_ctx());
        assert_ne!(ctx0, ctx1);
        let a0 = Attention::new(d0.clone()).expect("an sm_80+ GPU");
        let a1 = Attention::new(d1.clone()).expect("an sm_80+ GPU");
        let (s0, s1) = (d0.context().default_stream(), d1.context().default_stream());
        let mut seeds = TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
        let params = AttentionParams {
            softmax_scale: None,
            causal: true,
            ..Default::default()
        };
        let check_output = |dev: &DeviceCase, what: &str, replay: &str| {
            let (o_bits, _) = dev.download().expect("download");
            let want = dev.reference(params.scale_for(64) as f64);
            let got = reference::half_bits_to_f64(&o_bits, HalfType::F16);
            let err = reference::rel_l2(&got, &want.out);
            println!("{what}: error {err:.2e}");
            assert!(
                err <= tolerance(HalfType::F16),
                "{what}: error {err:.2e} ({replay})"
            );
        };
        // One forward on `attn`'s device (its stream `s`), uploaded through cudarc (which
        // binds that device), then called with the other device's context `other`
        // current, which the call must leave current.
        let mut run_on =
            |attn: &Attention, s: &Arc<cudarc::driver::CudaStream>, other, what: String| {
                let mut rng = seeds.next_case();
                let replay = seeds.replay(&rng);
                let case = DeviceCase::new(s, small_case(), &mut rng).expect("upload");
                let ([q, k, v, o], lse) = case.views();
                set_current(other);
                // SAFETY: the views are the case's live buffers on `attn`'s device, `s` its
                // stream.
                unsafe { attn.forward(&q, &k, &v, &o, Some(&lse), &params, s.cu_stream()) }
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(
                    current(),
                    other,
                    "{what}: the other device's context was replaced"
                );
                check_output(&case, &what, &replay);
            };
        for round in 0..3 {
            run_on(&a1, &s1, ctx0, format!("round {round}, device 1"));
            run_on(&a0, &s0, ctx1, format!("round {round}, device 0"));
        }

        // The C ABI: a context of ordinal 1, created and called with device 0's current.
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let on1 = DeviceCase::new(&s1, small_case(), &mut rng).expect("upload to device 1");
        let ([q, k, v, o], lse) = on1.views();
        set_current(ctx0);
        let mut handle: *mut FlashcoreContext = ptr::null_mut();
        // SAFETY: `handle` is a valid place for one pointer.
        let rc = unsafe { ffi::flashcore_create(1, &mut handle) };
        assert_eq!(rc, FLASHCORE_SUCCESS);
        let [cq, ck, cv, co] = [&q, &k, &v, &o].map(c_tensor);
        // SAFETY: `handle` is live; the tensors describe device 1's live buffers and the
        // stream is device 1's.
        let rc = unsafe {
            ffi::flashcore_forward(handle, &cq, &ck, &cv, &co, lse.ptr, 0.0, 1, s1.cu_stream())
        };
        assert_eq!(rc, FLASHCORE_SUCCESS);
        assert_eq!(
            current(),
            ctx0,
            "flashcore_forward replaced device 0's context"
        );
        s1.synchronize().expect("synchronize");
        set_current(ctx0);
        // SAFETY: created above, destroyed once, its work finished.
        unsafe { ffi::flashcore_destroy(handle) };
        assert_eq!(
            current(),
            ctx0,
            "flashcore_destroy replaced device 0's context"
        );
        check_output(&on1, "the C ABI on device 1", &replay);

        // Safe calls over cudarc buffers: device 0's buffers, or its stream, refused by
        // device 1's Attention, nothing written; device 1's own run.
        use flashcore::host::buffers::{Layout4, Tensor, TensorMut};
        let l = Layout4::bshd(1, 64, 2, 64);
        let ones = vec![half::f16::ONE; 64 * 2 * 64];
        let x0 = s0.clone_htod(&ones).unwrap();
        let x1 = s1.clone_htod(&ones).unwrap();
        let nan = vec![half::f16::NAN; ones.len()];
        let mut o1 = s1.clone_htod(&nan).unwrap();
        let params = AttentionParams::default();
        let refused = |r: flashcore::Result<()>, what: &str| match r {
            Err(flashcore::Error::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {other:?}"),
        };
        refused(
            a1.forward_buffers(
                &s1,
                [
                    Tensor::new(&x1, l),
                    Tensor::new(&x0, l),
                    Tensor::new(&x1, l),
                ],
                TensorMut::new(&mut o1, l),
                None,
                &params,
            ),
            "k is a buffer of another context",
        );
        refused(
            a1.forward_buffers(
                &s0,
                [
                    Tensor::new(&x1, l),
                    Tensor::new(&x1, l),
                    Tensor::new(&x1, l),
                ],
                TensorMut::new(&mut o1, l),
                None,
                &params,
            ),
            "the stream belongs to another context",
        );
        assert!(s1.clone_dtoh(&o1).unwrap().iter().all(|v| v.is_nan()));
        a1.forward_buffers(
            &s1,
            [
                Tensor::new(&x1, l),
                Tensor::new(&x1, l),
                Tensor::new(&x1, l),
            ],
            TensorMut::new(&mut o1, l),
            None,
            &params,
        )
        .expect("device 1's own buffers");
        assert!(
            s1.clone_dtoh(&o1)
                .unwrap()
                .iter()
                .all(|&v| v == half::f16::ONE)
        );
    })
    .join()
    .expect("the test thread panicked");
}
