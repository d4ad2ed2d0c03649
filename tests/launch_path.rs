//! The hot path allocates nothing: validation and dispatch on the CPU, and (on a GPU) a
//! whole forward call on an already-loaded configuration, which is what lets it be
//! captured in a CUDA graph and called from a latency-bound server.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use flashcore::host::attention::dispatch;
use flashcore::host::tensor::{AttentionParams, DType, LseView, TensorView};
use flashcore::host::validate::validate_fwd;
use flashcore::kernels::attention::HalfType;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Only the measuring thread counts: the test harness runs other tests beside it.
    static COUNTING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.with(|c| c.get()) {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above, i.e. from `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations_in(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCATIONS.load(Ordering::SeqCst) - before
}

#[test]
fn validation_and_dispatch_do_not_allocate() {
    let q = TensorView::bhsd(0x1000_0000, DType::F16, 2, 512, 8, 64);
    let k = TensorView::bhsd(0x2000_0000, DType::F16, 2, 512, 8, 64);
    let v = TensorView::bhsd(0x3000_0000, DType::F16, 2, 512, 8, 64);
    let o = TensorView::bhsd(0x4000_0000, DType::F16, 2, 512, 8, 64);
    let lse = LseView { ptr: 0x5000_0000 };
    let params = AttentionParams {
        softmax_scale: None,
        causal: true,
        ..Default::default()
    };
    // Warm any lazily built tables first.
    let shape = flashcore::shape::AttnShape::square(2, 8, 512, 64);
    let cfg = dispatch((9, 0), 132, HalfType::F16, &shape, true, 0.125).unwrap();
    let _ = cfg.id_static();
    let n = allocations_in(|| {
        for _ in 0..100 {
            let p = validate_fwd(&q, &k, &v, &o, Some(&lse), &params).unwrap();
            let cfg = dispatch((9, 0), 132, p.dtype, &p.shape, p.causal, p.scale).unwrap();
            std::hint::black_box(cfg.id_static());
            std::hint::black_box(cfg.tiling());
        }
    });
    assert_eq!(
        n, 0,
        "validation + dispatch allocated {n} times in 100 calls"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn warm_forward_does_not_allocate() {
    use flashcore::check::{DeviceCase, FwdCase, Layout as L};
    let (attn, stream, mut seeds) = gpu_setup();
    let case = FwdCase {
        shape: flashcore::shape::AttnShape::square(2, 8, 512, 64),
        dtype: HalfType::F16,
        causal: false,
        window: Default::default(),
        layout: L::Bhsd,
        kernel: None,
        softcap: None,
        softmax_scale: None,
    };
    let mut rng = seeds.next_case();
    let replay = seeds.replay(&rng);
    let dev = DeviceCase::new(&stream, case, &mut rng).unwrap();
    let n = warm_forward_allocations(&attn, &stream, &dev, &AttentionParams::default());
    assert_eq!(
        n, 0,
        "100 warm forward calls allocated {n} times ({replay})"
    );
}

/// An Attention on GPU 0, its default stream and the run's seeds.
fn gpu_setup() -> (
    flashcore::host::attention::Attention,
    std::sync::Arc<cudarc::driver::CudaStream>,
    flashcore::check::TestSeeds,
) {
    let device = std::sync::Arc::new(flashcore::host::device::Device::new(0).unwrap());
    let stream = device.context().default_stream();
    let attn = flashcore::host::attention::Attention::new(device).unwrap();
    let seeds = flashcore::check::TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
    (attn, stream, seeds)
}

/// The host allocations of 100 forward calls on `dev`'s buffers, after one that loads the
/// kernels.
fn warm_forward_allocations(
    attn: &flashcore::host::attention::Attention,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    dev: &flashcore::check::DeviceCase,
    params: &AttentionParams,
) -> usize {
    let ([q, k, v, o], lse) = dev.views();
    let cu = stream.cu_stream();
    // SAFETY: the views are the case's own live buffers, on its stream.
    unsafe { attn.forward(&q, &k, &v, &o, Some(&lse), params, cu) }.unwrap();
    let n = allocations_in(|| {
        for _ in 0..100 {
            // SAFETY: as above.
            unsafe { attn.forward(&q, &k, &v, &o, Some(&lse), params, cu) }.unwrap();
        }
    });
    stream.synchronize().unwrap();
    n
}

/// The same for calls shaped like decode steps, which run on the split-KV decode kernels and
/// their merge: validation as a decode call, the kernel lookups and the launches allocate
/// nothing on the host (the partial results come from the stream-ordered allocator).
#[test]
#[ignore = "needs a CUDA GPU"]
fn warm_decode_shaped_forward_does_not_allocate() {
    use flashcore::check::{DeviceCase, FwdCase, Layout as L};
    use flashcore::host::decode::FORWARD_DECODE_MIN_KEYS;
    let (attn, stream, mut seeds) = gpu_setup();
    for (batch, seqlen_q, causal) in [(1, 1, false), (2, 16, true)] {
        let case = FwdCase {
            shape: flashcore::shape::AttnShape {
                batch,
                seqlen_q,
                seqlen_k: 2 * FORWARD_DECODE_MIN_KEYS,
                heads_q: 32,
                heads_kv: 8,
                head_dim: 128,
            },
            dtype: HalfType::F16,
            causal,
            window: Default::default(),
            layout: L::Bshd,
            kernel: None,
            softcap: None,
            softmax_scale: None,
        };
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let dev = DeviceCase::new(&stream, case, &mut rng).unwrap();
        let params = AttentionParams {
            softmax_scale: None,
            causal,
            ..Default::default()
        };
        let n = warm_forward_allocations(&attn, &stream, &dev, &params);
        assert_eq!(
            n, 0,
            "100 warm calls of {case} allocated {n} times ({replay})"
        );
    }
    let loaded = attn.loaded_kernels();
    assert!(
        loaded.iter().any(|k| k.0.starts_with("attn_decode"))
            && loaded.iter().any(|k| k.0.starts_with("attn_merge"))
            && !loaded.iter().any(|k| k.0.starts_with("attn_fwd")),
        "{loaded:?}"
    );
}
