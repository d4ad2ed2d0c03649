//! Forward attention on a GPU against the float64 reference. Run on a GPU machine with
//! `cargo test --release -- --include-ignored`.
//!
//! The random inputs come from a fixed seed, or from `FLASHCORE_SEED` (decimal or 0x-hex)
//! when it is set; every failure names the run's seed to set there to replay it, and the
//! failing case's own seed.

mod common;

use std::sync::Arc;

use common::{pick, random_len, random_window};
use flashcore::check::{
    CheckResult, FwdCase, LSE_TOLERANCE, Layout, TestSeeds, check_forward, tolerance,
};
use flashcore::host::attention::{Attention, dispatch_sm80};
use flashcore::host::device::Device;
use flashcore::host::tensor::{AttentionParams, DType, TensorView, Window};
use flashcore::kernels::attention::{
    BLOCK_M_NARROW, BLOCK_M_WIDE, FwdConfig, HalfType, Path, sm90,
};
use flashcore::reference::{self, Rng};
use flashcore::shape::AttnShape;

const SEQLENS: [usize; 6] = [1, 17, 113, 128, 1000, 2048];

fn setup() -> (Attention, Arc<cudarc::driver::CudaStream>) {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let stream = device.context().default_stream();
    (Attention::new(device).expect("an sm_80+ GPU"), stream)
}

/// Runs every case, prints one line each, and fails listing every case over tolerance.
fn run_cases(cases: &[FwdCase]) {
    let (attn, stream) = setup();
    run_cases_on(&attn, &stream, cases);
}

/// [`run_cases`] with a given `Attention` and stream.
fn run_cases_on(attn: &Attention, stream: &Arc<cudarc::driver::CudaStream>, cases: &[FwdCase]) {
    let mut seeds = seeds();
    let mut failures = Vec::new();
    let mut worst: (f64, String) = (0.0, String::new());
    for case in cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let r: CheckResult = check_forward(attn, stream, *case, &mut rng)
            .unwrap_or_else(|e| panic!("{case} ({replay}): {e}"));
        let line = format!(
            "{case}: out {:.2e} lse {:.2e} unwritten {} ({replay})",
            r.out_err, r.lse_err, r.unwritten
        );
        println!("{line}");
        if r.out_err > worst.0 || r.out_err.is_nan() {
            worst = (r.out_err, line.clone());
        }
        if !r.passes(case.dtype) {
            failures.push(line);
        }
    }
    println!("worst: {}", worst.1);
    assert!(
        failures.is_empty(),
        "{} of {} cases failed (replay all: FLASHCORE_SEED={:#x}):\n{}",
        failures.len(),
        cases.len(),
        seeds.run_seed(),
        failures.join("\n")
    );
}

/// The run's seeds (FLASHCORE_SEED or the fixed default), announced once.
fn seeds() -> TestSeeds {
    let seeds = TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
    println!("random inputs: FLASHCORE_SEED={:#x}", seeds.run_seed());
    seeds
}

/// `c` on fresh inputs from the run's next case seed, run once (default scale): the
/// case's buffers, the parameters it ran with, and how to replay it.
fn run_once(
    attn: &Attention,
    stream: &Arc<cudarc::driver::CudaStream>,
    seeds: &mut TestSeeds,
    c: FwdCase,
) -> (flashcore::check::DeviceCase, AttentionParams, String) {
    let mut rng = seeds.next_case();
    let replay = seeds.replay(&rng);
    let dev = flashcore::check::DeviceCase::new(stream, c, &mut rng).unwrap();
    let params = AttentionParams {
        softmax_scale: None,
        causal: c.causal,
        ..Default::default()
    };
    dev.run(attn, &params).unwrap();
    (dev, params, replay)
}

#[allow(clippy::too_many_arguments)]
fn case(
    dtype: HalfType,
    d: usize,
    causal: bool,
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
) -> FwdCase {
    FwdCase {
        shape: AttnShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
        },
        dtype,
        causal,
        window: Default::default(),
        layout: Layout::Bshd,
        kernel: None,
        softcap: None,
        softmax_scale: None,
    }
}

/// Random shapes (drawn from the run's seed: a new `FLASHCORE_SEED` draws new ones):
/// every head dim, both dtypes and layouts, GQA 1 to 8, Sq and Sk apart or equal, a third
/// of them at a tile edge, causal or not, each through the dispatch's own choice.
#[test]
#[ignore = "needs a CUDA GPU"]
fn random_shapes() {
    run_cases(&random_cases(40));
}

/// One `Attention` shared by four threads, each with its own stream, from cold: their
/// first calls generate and load the same kernels at once (each thread draws the same
/// shapes). Every call is checked.
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_attention_serves_four_threads_at_once() {
    let (attn, _) = setup();
    let cases = random_cases(16);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                let stream = attn.device().context().new_stream().expect("a stream");
                run_cases_on(&attn, &stream, &cases);
            });
        }
    });
}

/// `count` shapes of [`random_shapes`].
fn random_cases(count: usize) -> Vec<FwdCase> {
    const EDGES: [usize; 12] = [1, 2, 17, 63, 64, 65, 113, 127, 128, 129, 192, 193];
    let mut rng = Rng::new(seeds().run_seed().rotate_left(41) ^ 0xF0D);
    let len = |rng: &mut Rng| random_len(rng, &EDGES, 1100);
    (0..count)
        .map(|_| {
            let heads_kv = pick(&mut rng, &[1, 2]);
            let group = pick(&mut rng, &[1, 2, 4, 8]).min(8 / heads_kv);
            let batch = pick(&mut rng, &[1, 2]);
            let seqlen_q = len(&mut rng);
            let seqlen_k = if rng.uniform() < 0.4 {
                seqlen_q
            } else {
                len(&mut rng)
            };
            let mut c = case(
                if rng.uniform() < 0.5 {
                    HalfType::F16
                } else {
                    HalfType::Bf16
                },
                pick(&mut rng, &[32, 64, 96, 128, 192, 256]),
                rng.uniform() < 0.5,
                batch,
                heads_kv * group,
                heads_kv,
                seqlen_q,
                seqlen_k,
            );
            if rng.uniform() < 0.5 {
                c.layout = Layout::Bhsd;
            }
            c
        })
        .collect()
}

/// [`random_cases`] with a random key window each (FlashAttention's `window_size`: a
/// side none, 0, under a tile, or up to 1200 keys; causal fixes the right side at 0).
fn random_window_cases(count: usize) -> Vec<FwdCase> {
    let mut rng = Rng::new(seeds().run_seed().rotate_left(7) ^ 0x71D0);
    random_cases(count)
        .into_iter()
        .map(|c| FwdCase {
            window: random_window(&mut rng, c.causal, 1200),
            ..c
        })
        .collect()
}

/// Key windows through the dispatch's own choice (on Hopper the sm90a windowed kernels)
/// and on the sm80 path's windowed kernels, same shapes: every head dim, both dtypes
/// and layouts, GQA, Sq and Sk apart, rows whose window holds no key (zeros, LSE −∞).
#[test]
#[ignore = "needs a CUDA GPU"]
fn key_windows_on_both_paths() {
    let (attn, stream) = setup();
    let cases = random_window_cases(40);
    run_cases_on(&attn, &stream, &cases);
    let sm80: Vec<FwdCase> = cases.iter().map(|&c| on_sm80_windowed(&attn, c)).collect();
    run_cases_on(&attn, &stream, &sm80);
}

/// [`random_cases`] with soft-capped scores (Gemma 2's `attn_logit_softcapping`): caps
/// of 0.5 to 5, which bend scores of about unit size (the default scale on these
/// inputs), and 30 or 50 with a softmax scale of `8/√d`, whose scores of up to about
/// 40 reach them (and whose sharper softmax weighs every score's error more); a third of
/// them with a random key window.
fn random_softcap_cases(count: usize) -> Vec<FwdCase> {
    let mut rng = Rng::new(seeds().run_seed().rotate_left(13) ^ 0x50F7);
    random_cases(count)
        .into_iter()
        .map(|c| {
            let cap = pick(&mut rng, &[0.5f32, 1.0, 2.0, 5.0, 30.0, 50.0]);
            let scale = (cap >= 30.0).then(|| 8.0 / (c.shape.head_dim as f32).sqrt());
            let window = if rng.uniform() < 1.0 / 3.0 {
                random_window(&mut rng, c.causal, 1200)
            } else {
                Window::FULL
            };
            FwdCase {
                softcap: Some(cap),
                softmax_scale: scale,
                window,
                ..c
            }
        })
        .collect()
}

/// Soft-capped scores through the dispatch's own choice (on Hopper the sm90a kernels)
/// and on the sm80 path's kernels, same shapes: every head dim, both dtypes and
/// layouts, GQA, Sq and Sk apart, causal or not, some with key windows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn softcapped_scores_on_both_paths() {
    let (attn, stream) = setup();
    let cases = random_softcap_cases(40);
    run_cases_on(&attn, &stream, &cases);
    let sm80: Vec<FwdCase> = cases.iter().map(|&c| on_sm80_windowed(&attn, c)).collect();
    run_cases_on(&attn, &stream, &sm80);
}

/// `c` on the sm80 path's kernel of its shape.
fn on_sm80_windowed(attn: &Attention, c: FwdCase) -> FwdCase {
    let (arch, sms) = (attn.device().compute_capability(), attn.device().sm_count());
    let cfg = dispatch_sm80(arch, sms, c.dtype, &c.shape, c.causal).unwrap();
    with_masking(FwdCase {
        kernel: Some(cfg),
        ..c
    })
}

/// `c` with its forced kernel's mask made the one its window resolves to (a side that
/// bounds no row is dropped: a window of more keys than the sequence's is plain causal
/// masking, or none), and soft-capping where the case caps its scores, as a forced
/// kernel must match the call's options.
fn with_masking(c: FwdCase) -> FwdCase {
    let m = c
        .params()
        .masking(c.shape.seqlen_q, c.shape.seqlen_k)
        .unwrap();
    let kernel = c.kernel.map(|k| match m.window {
        Some(_) => k.windowed(),
        None => FwdConfig {
            causal: m.causal,
            window: false,
            ..k
        },
    });
    let kernel = kernel.map(|k| {
        if c.softcap.is_some() {
            k.softcapped()
        } else {
            k
        }
    });
    FwdCase { kernel, ..c }
}

/// Key windows at the tiles' edges: windows of 0, 1, 63, 64, 65, 127, 128 and 129 keys
/// behind the diagonal (and a few ahead of it without causal masking) on sequence
/// lengths 1 to 1023, on the sm80 path's kernels of 64- and 128-row tiles, and with the
/// sm90a kernels of 64- and 128-row tiles forced, and the head dim 256 kernel of 64-key
/// tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn key_windows_at_tile_edges() {
    let mut cases = Vec::new();
    let lefts = [0, 1, 63, 64, 65, 127, 128, 129];
    let lens = [
        (1, 1),
        (17, 17),
        (113, 300),
        (300, 113),
        (1023, 1023),
        (200, 1000),
    ];
    for (i, &left) in lefts.iter().enumerate() {
        for (j, &(sq, sk)) in lens.iter().enumerate() {
            let dtype = if (i + j) % 2 == 0 {
                HalfType::F16
            } else {
                HalfType::Bf16
            };
            let d = [64, 128, 256][(i + 2 * j) % 3];
            let causal = (i + j) % 3 != 0;
            let mut c = case(dtype, d, causal, 1, 4, 2, sq, sk);
            c.window = Window {
                left: Some(left),
                right: if causal {
                    Some(0)
                } else {
                    Some((j * 37 % 130) as u32)
                },
            };
            cases.push(c);
        }
    }
    run_cases(&cases);
    let sm80: Vec<FwdCase> = cases
        .iter()
        .flat_map(|&c| {
            [BLOCK_M_WIDE, BLOCK_M_NARROW].map(|block_m| {
                let cfg =
                    FwdConfig::sm80(c.dtype, c.shape.head_dim as u32, c.causal, block_m, false);
                with_masking(FwdCase {
                    kernel: Some(cfg),
                    ..c
                })
            })
        })
        .collect();
    run_cases(&sm80);
    if !on_sm90() {
        return;
    }
    let mut forced = Vec::new();
    for &c in &cases {
        for block_m in [64, 128] {
            forced.push(with_masking(sm90_kernel(c, block_m, false)));
        }
        if c.shape.head_dim == 256 {
            let mut f = sm90_kernel(c, 128, false);
            if let Some(k) = &mut f.kernel {
                k.narrow_keys = true;
            }
            forced.push(with_masking(f));
        }
    }
    run_cases(&forced);
}

/// Every (Sq, Sk) pair of the grid, causal and not, one head, with each query tile
/// (the dispatch would pick the narrow one for all of these).
fn seqlen_grid(dtype: HalfType, d: usize) {
    let mut cases = Vec::new();
    for causal in [false, true] {
        for block_m in [BLOCK_M_WIDE, BLOCK_M_NARROW] {
            let kernel = FwdConfig::sm80(dtype, d as u32, causal, block_m, false);
            cases.extend(all_seqlen_pairs(kernel));
        }
    }
    run_cases(&cases);
}

/// Whether the GPU runs the sm90 path (sm_90); if not, says so (the caller then checks
/// nothing).
fn on_sm90() -> bool {
    let cc = Device::new(0).expect("a CUDA device").compute_capability();
    if cc != (9, 0) {
        println!("skipped: the sm90 path needs sm_90, this GPU is {cc:?}");
    }
    cc == (9, 0)
}

/// The seqlen grid on the sm90 path (warp-specialized wgmma + TMA) with each query tile
/// (two consumer warpgroups, or one), when the GPU is a Hopper; elsewhere it says so and
/// checks nothing.
fn sm90_seqlen_grid(dtype: HalfType, d: usize) {
    if !on_sm90() {
        return;
    }
    let mut cases = Vec::new();
    for causal in [false, true] {
        for block_m in sm90::BLOCK_MS {
            if !sm90::has_tile(d as u32, block_m) {
                continue;
            }
            // The scale folded into the exponent (what the dispatch takes at the
            // default scale) and not (what it takes for scales that could overflow);
            // at head dim 256 both key tiles.
            let narrow: &[bool] = if sm90::has_narrow_keys(d as u32, block_m, false) {
                &[false, true]
            } else {
                &[false]
            };
            for fold_scale in [true, false] {
                for &narrow_keys in narrow {
                    let kernel = FwdConfig {
                        path: Path::Sm90,
                        dtype,
                        head_dim: d as u32,
                        causal,
                        window: false,
                        block_m,
                        split_keys: false,
                        fold_scale,
                        padded: false,
                        narrow_keys,
                        softcap: false,
                    };
                    cases.extend(all_seqlen_pairs(kernel));
                }
            }
        }
    }
    run_cases(&cases);
}

/// One head, every (Sq, Sk) pair of [`SEQLENS`], on `kernel`.
fn all_seqlen_pairs(kernel: FwdConfig) -> Vec<FwdCase> {
    let (dtype, d) = (kernel.dtype, kernel.head_dim as usize);
    let pairs = SEQLENS.iter().flat_map(|&sq| SEQLENS.map(|sk| (sq, sk)));
    pairs
        .map(|(sq, sk)| FwdCase {
            kernel: Some(kernel),
            ..case(dtype, d, kernel.causal, 1, 1, 1, sq, sk)
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sm90_fp16_seqlens() {
    for d in sm90::HEAD_DIMS {
        sm90_seqlen_grid(HalfType::F16, d as usize);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sm90_bf16_seqlens() {
    for d in sm90::HEAD_DIMS {
        sm90_seqlen_grid(HalfType::Bf16, d as usize);
    }
}

/// Batches and heads: B in {1, 3}, MHA 8:8, GQA 8:2, MQA 8:1, with Sq != Sk.
fn heads_grid(dtype: HalfType, d: usize) {
    let mut cases = Vec::new();
    for causal in [false, true] {
        for b in [1, 3] {
            for (hq, hkv) in [(1, 1), (8, 8), (8, 2), (8, 1)] {
                for (sq, sk) in [(17, 113), (113, 17), (128, 1000), (1000, 128), (1, 2048)] {
                    cases.push(case(dtype, d, causal, b, hq, hkv, sq, sk));
                }
            }
        }
    }
    run_cases(&cases);
}

/// Causal launches with more work items than SMs, where the sm90 path's blocks take
/// items from a shared counter: every item must run exactly once, whether it is numbered
/// head by head or among the tail's heads spread query tile by query tile.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sm90_causal_grids_beyond_one_wave() {
    let cases = [
        // 2 x 24 heads x 9 query tiles = 432 items: 18 head-batches first, 30 in the tail.
        case(HalfType::F16, 64, true, 2, 24, 8, 1100, 1100),
        // 160 items, all in the tail; Sq != Sk.
        case(HalfType::Bf16, 128, true, 1, 16, 4, 1200, 1300),
        // 144 items; the first 100 rows see no key.
        case(HalfType::F16, 256, true, 1, 12, 4, 1500, 1400),
    ];
    run_cases(&cases);
}

/// `c` on the sm90 kernel with `block_m`-row tiles (split keys or not) instead of the
/// dispatch's pick.
fn sm90_kernel(c: FwdCase, block_m: u32, split_keys: bool) -> FwdCase {
    FwdCase {
        kernel: Some(FwdConfig {
            path: Path::Sm90,
            dtype: c.dtype,
            head_dim: c.shape.head_dim as u32,
            causal: c.causal,
            window: false,
            block_m,
            split_keys,
            fold_scale: !split_keys,
            padded: false,
            narrow_keys: false,
            softcap: false,
        }),
        ..c
    }
}

/// The one-consumer (64-row) and three-consumer (192-row) sm90 kernels forced onto grids
/// beyond one wave: their persistent loops (a fixed stride, or the causal counter and
/// tail) must run every item exactly once, as the two-consumer kernel's does.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sm90_other_tiles_beyond_one_wave() {
    if !on_sm90() {
        return;
    }
    let tile = |block_m: u32, c: FwdCase| sm90_kernel(c, block_m, false);
    let narrow = |c| tile(64, c);
    let cases = [
        // 2 x 8 heads x 18 query tiles = 288 items.
        narrow(case(HalfType::F16, 64, false, 2, 8, 2, 1100, 900)),
        narrow(case(HalfType::F16, 64, true, 2, 8, 2, 1100, 1100)),
        // 19 x 16 = 304 items; Sq != Sk.
        narrow(case(HalfType::Bf16, 128, true, 1, 16, 4, 1200, 1300)),
        // 24 x 12 = 288 items; the first 100 rows see no key.
        narrow(case(HalfType::F16, 256, true, 1, 12, 4, 1500, 1400)),
        // 192 rows: 6 x 48 = 288 items, GQA 6:1; and 9 query tiles whose last has 31 rows.
        tile(192, case(HalfType::F16, 64, false, 2, 24, 4, 1100, 2100)),
        tile(192, case(HalfType::Bf16, 64, false, 1, 32, 32, 1567, 4097)),
        // 192 rows from the causal counter: 6 x 48 = 288 items, the first 1000 rows see
        // no key; and Sq = Sk with a 31-row last tile.
        tile(192, case(HalfType::F16, 64, true, 2, 24, 4, 1100, 100)),
        tile(192, case(HalfType::Bf16, 64, true, 1, 32, 8, 1567, 1567)),
    ];
    run_cases(&cases);
}

/// The split-keys sm90 kernel (two consumers on one 64-row query tile, alternate key
/// tiles): a second consumer with no tile (one key), odd tile counts on a grid beyond one
/// wave (the ring positions run on across items, so the consumers' first tiles alternate
/// from item to item), the causal counter with rows that see no key, MQA, and the
/// dispatch's own pick.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sm90_split_keys_kernel() {
    if !on_sm90() {
        return;
    }
    let split = |c: FwdCase| sm90_kernel(c, 64, true);
    let cases = [
        split(case(HalfType::F16, 64, false, 1, 4, 4, 70, 1)),
        split(case(HalfType::Bf16, 64, true, 2, 4, 1, 17, 129)),
        // 2 x 8 heads x 18 query tiles = 288 items of 3 key tiles each.
        split(case(HalfType::F16, 64, false, 2, 8, 2, 1100, 300)),
        // 288 items from the causal counter, 1 to 18 tiles each.
        split(case(HalfType::F16, 64, true, 2, 8, 2, 1100, 1100)),
        // 12 x 24 = 288 items; the first 100 rows see no key.
        split(case(HalfType::Bf16, 64, true, 1, 12, 4, 1500, 1400)),
        // The dispatch's pick (64-row tiles, 1024 keys or more): MQA, causal and not.
        case(HalfType::F16, 64, true, 1, 4, 1, 1024, 1500),
        case(HalfType::Bf16, 64, false, 1, 2, 1, 2000, 1030),
    ];
    run_cases(&cases);
}

/// The sm90a epilogue's TMA store into an O whose heads are padded (rows of d + 8
/// elements) writes the same bits as into a contiguous O, and nothing in the gaps. (The
/// contiguous run is checked against the reference by every other test here; the
/// epilogue's direct stores, for packed sequences, by `gpu_varlen`.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn sm90_padded_output_gets_exactly_its_elements() {
    let (attn, stream) = setup();
    if !on_sm90() {
        return;
    }
    let mut seeds = seeds();
    for (dtype, d, causal, sq, sk) in [
        (HalfType::F16, 64, false, 300, 200),
        (HalfType::Bf16, 128, true, 113, 1000),
        (HalfType::F16, 256, true, 1000, 113),
        (HalfType::Bf16, 256, false, 17, 17),
    ] {
        let c = case(dtype, d, causal, 2, 4, 2, sq, sk);
        let (mut dev, params, replay) = run_once(&attn, &stream, &mut seeds, c);
        let (contiguous, lse_contiguous) = dev.download().unwrap();
        // The LSE again as never written: the second call must write all of it.
        dev.poison().unwrap();

        let pitch = d + 8;
        let (b, h) = (c.shape.batch, c.shape.heads_q);
        let poison = flashcore::reference::poison(dtype);
        let padded = stream
            .clone_htod(&vec![poison; b * sq * h * pitch])
            .unwrap();
        let ([q, k, v, o], lse) = dev.views();
        let o_padded = TensorView {
            ptr: cudarc::driver::DevicePtr::device_ptr(&padded, &stream).0,
            strides: [sq * h * pitch, h * pitch, pitch, 1],
            ..o
        };
        // SAFETY: the views are the case's live buffers and `padded`, which holds every
        // element `o_padded` describes; the stream is the one they were made on.
        unsafe {
            attn.forward(
                &q,
                &k,
                &v,
                &o_padded,
                Some(&lse),
                &params,
                stream.cu_stream(),
            )
        }
        .unwrap();
        let got = stream.clone_dtoh(&padded).unwrap();
        let (_, lse) = dev.download().unwrap();
        let rows = got.chunks(pitch);
        for (i, (row, want)) in rows.zip(contiguous.chunks(d)).enumerate() {
            let at = format!("d{d} causal={causal} Sq{sq} Sk{sk}, row {i} ({replay})");
            assert_eq!(&row[..d], want, "{at}: padded and contiguous O differ");
            assert!(
                row[d..].iter().all(|&x| x == poison),
                "{at}: padding written"
            );
        }
        assert_eq!(lse, lse_contiguous, "LSE differs ({replay})");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_d64_seqlens() {
    seqlen_grid(HalfType::F16, 64);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_d128_seqlens() {
    seqlen_grid(HalfType::F16, 128);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_d64_seqlens() {
    seqlen_grid(HalfType::Bf16, 64);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_d128_seqlens() {
    seqlen_grid(HalfType::Bf16, 128);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_heads_and_batches() {
    heads_grid(HalfType::F16, 64);
    heads_grid(HalfType::F16, 128);
    heads_grid(HalfType::F16, 256);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_heads_and_batches() {
    heads_grid(HalfType::Bf16, 64);
    heads_grid(HalfType::Bf16, 128);
    heads_grid(HalfType::Bf16, 256);
}

/// The other head dims the dispatch offers, and the [B, H, S, D] layout.
#[test]
#[ignore = "needs a CUDA GPU"]
fn other_head_dims_and_bhsd_layout() {
    let mut cases = Vec::new();
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for d in [32, 64, 96, 128, 192, 256] {
            for causal in [false, true] {
                for (sq, sk) in [(113, 1000), (1000, 113), (1023, 1023)] {
                    let mut c = case(dtype, d, causal, 2, 4, 2, sq, sk);
                    cases.push(c);
                    c.layout = Layout::Bhsd;
                    cases.push(c);
                    let head_dim = d as u32;
                    let block_m = BLOCK_M_WIDE;
                    let wide = FwdConfig::sm80(dtype, head_dim, causal, block_m, false);
                    cases.push(FwdCase {
                        kernel: Some(wide),
                        ..c
                    });
                }
            }
        }
    }
    run_cases(&cases);
}

/// Two runs on the same inputs agree bit for bit (a race would make them differ).
#[test]
#[ignore = "needs a CUDA GPU"]
fn repeated_runs_are_identical() {
    let (attn, stream) = setup();
    let mut seeds = seeds();
    for causal in [false, true] {
        let c = case(HalfType::F16, 128, causal, 2, 8, 2, 1000, 2048);
        let (mut dev, params, replay) = run_once(&attn, &stream, &mut seeds, c);
        let first = dev.download().unwrap();
        for _ in 0..5 {
            // Poisoned afresh: a run that writes nothing must not pass as identical.
            dev.poison().unwrap();
            dev.run(&attn, &params).unwrap();
            assert_eq!(
                dev.download().unwrap(),
                first,
                "causal={causal}: runs differ ({replay})"
            );
        }
    }
}

/// A rejected call writes nothing: the poisoned output stays poisoned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn rejected_call_writes_nothing() {
    let (attn, stream) = setup();
    let mut seeds = seeds();
    let c = case(HalfType::F16, 64, false, 1, 2, 2, 64, 64);
    let mut rng = seeds.next_case();
    let replay = seeds.replay(&rng);
    let dev = flashcore::check::DeviceCase::new(&stream, c, &mut rng).unwrap();
    let ([q, k, v, o], lse) = dev.views();
    let bad_k = TensorView::bshd(k.ptr, DType::F16, 1, 64, 3, 64);
    // SAFETY: the views are the case's own live buffers (k only reshaped, so validation
    // rejects it before any launch).
    let err = unsafe {
        attn.forward(
            &q,
            &bad_k,
            &v,
            &o,
            Some(&lse),
            &AttentionParams::default(),
            stream.cu_stream(),
        )
    }
    .unwrap_err();
    println!("rejected: {err}");
    let (o_bits, lse) = dev.download().unwrap();
    assert!(
        o_bits
            .iter()
            .all(|&b| b == flashcore::reference::POISON_F16),
        "a rejected call wrote o ({replay})"
    );
    assert!(
        lse.iter().all(|x| x.is_nan()),
        "a rejected call wrote lse ({replay})"
    );
    assert!(tolerance(HalfType::F16) < tolerance(HalfType::Bf16));
}

/// A module the JIT refuses surfaces as `Error::ModuleLoad` carrying ptxas' own message.
#[test]
#[ignore = "needs a CUDA GPU"]
fn jit_failure_returns_the_log() {
    let device = Device::new(0).unwrap();
    let bad = ".version 8.4\n.target sm_80\n.address_size 64\n.visible .entry broken()\n{\n    add.f32 %f0, %f1;\n    ret;\n}\n";
    match flashcore::host::module::load(device.context(), bad, "broken", 0) {
        Err(flashcore::Error::ModuleLoad { kernel, code, log }) => {
            println!("{kernel}: {code}\n{log}");
            assert_eq!(kernel, "broken");
            assert!(
                log.contains("line 6"),
                "the log names the offending line: {log}"
            );
        }
        Err(other) => panic!("expected ModuleLoad, got {other}"),
        Ok(_) => panic!("broken PTX loaded"),
    }
}

/// A caller's softmax scale reaches the kernel (the grids above use the default).
#[test]
#[ignore = "needs a CUDA GPU"]
fn custom_softmax_scale() {
    let (attn, stream) = setup();
    let mut seeds = seeds();
    for (scale, causal) in [(0.3f32, false), (0.02, true), (1.7, true)] {
        let c = case(HalfType::F16, 128, causal, 2, 4, 2, 200, 333);
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let dev = flashcore::check::DeviceCase::new(&stream, c, &mut rng).unwrap();
        let params = AttentionParams {
            softmax_scale: Some(scale),
            causal,
            ..Default::default()
        };
        dev.run(&attn, &params).unwrap();
        let (o, lse) = dev.download().unwrap();
        let want = dev.reference(scale as f64);
        let got = flashcore::reference::half_bits_to_f64(&o, HalfType::F16);
        let lse: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
        let (out_err, lse_err) = (
            flashcore::reference::rel_l2(&got, &want.out),
            flashcore::reference::rel_l2(&lse, &want.lse),
        );
        let line = format!("{c} scale {scale}: out {out_err:.2e} lse {lse_err:.2e} ({replay})");
        println!("{line}");
        assert!(
            out_err <= tolerance(HalfType::F16) && lse_err <= LSE_TOLERANCE,
            "{line}"
        );
    }
}

/// Head dims without a kernel of their own (multiples of 8 up to 256) run padded on the
/// next larger sm80 kernel, on every GPU: against the float64 reference, both dtypes
/// and layouts, causal or not, GQA, one query row, lengths off every tile.
#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_head_dims() {
    let mut cases = Vec::new();
    let dims = [8, 24, 40, 48, 72, 80, 104, 112, 136, 160, 200, 248];
    for (i, d) in dims.into_iter().enumerate() {
        let (dtype, other) = match i % 2 {
            0 => (HalfType::F16, HalfType::Bf16),
            _ => (HalfType::Bf16, HalfType::F16),
        };
        for causal in [false, true] {
            cases.push(case(dtype, d, causal, 2, 4, 2, 113, 200));
            cases.push(case(other, d, causal, 1, 2, 1, 1, 17));
        }
        let mut bhsd = case(other, d, true, 1, 8, 1, 300, 129);
        bhsd.layout = Layout::Bhsd;
        cases.push(bhsd);
    }
    let (attn, _) = setup();
    // On Hopper they run padded sm90 kernels; the sm80 ones stay selectable there, and
    // are checked too.
    let hopper = attn.device().compute_capability() == (9, 0);
    let path = if hopper { Path::Sm90 } else { Path::Sm80 };
    let mut sm80 = Vec::new();
    for c in &cases {
        let cfg = flashcore::check::planned_kernel(&attn, c).unwrap();
        assert!(cfg.padded && cfg.path == path, "{c}: {}", cfg.id());
        if hopper {
            let (arch, sms) = (attn.device().compute_capability(), attn.device().sm_count());
            let forced = dispatch_sm80(arch, sms, c.dtype, &c.shape, c.causal).unwrap();
            assert!(forced.padded, "{c}: {}", forced.id());
            sm80.push(FwdCase {
                kernel: Some(forced),
                ..*c
            });
        }
    }
    cases.extend(sm80);
    run_cases(&cases);
}

/// The padded sm90 kernels (head dims with no sm90 kernel of their own, on the next
/// larger one) with each query tile and exponent form, causal and not, GQA 2:1, at
/// lengths on and off every tile.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sm90_padded_kernels() {
    if !on_sm90() {
        return;
    }
    let mut cases = Vec::new();
    for (i, d) in [40, 80, 96, 160, 200].into_iter().enumerate() {
        let dtype = [HalfType::F16, HalfType::Bf16][i % 2];
        let (head_dim, padded) = sm90::padded_head_dim(d).unwrap();
        assert!(padded, "{d}");
        for causal in [false, true] {
            for block_m in [128, 64] {
                for fold_scale in [true, false] {
                    let kernel = FwdConfig {
                        path: Path::Sm90,
                        dtype,
                        head_dim,
                        causal,
                        window: false,
                        block_m,
                        split_keys: false,
                        fold_scale,
                        padded: true,
                        // The padded head dim 200 on 64-key tiles as well.
                        narrow_keys: head_dim == 256 && block_m == 128 && fold_scale,
                        softcap: false,
                    };
                    let pairs = [(1, 1), (17, 113), (113, 17), (128, 1000), (1000, 128)];
                    for (sq, sk) in pairs.into_iter().chain([(2048, 2048)]) {
                        cases.push(FwdCase {
                            kernel: Some(kernel),
                            ..case(dtype, d, causal, 1, 2, 1, sq, sk)
                        });
                    }
                }
            }
        }
    }
    run_cases(&cases);
}

/// A padded kernel reads no column past the head dim and writes none: Q, K and V whose
/// rows are followed by 64 NaN columns give O bit for bit as contiguous ones do, and an
/// O with 64 poisoned columns after each row keeps them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn padded_head_dims_touch_only_their_columns() {
    let (attn, stream) = setup();
    let mut seeds = seeds();
    for (dtype, d, causal, sq, sk) in [
        (HalfType::F16, 8, false, 300, 200),
        (HalfType::Bf16, 40, true, 113, 1000),
        (HalfType::F16, 80, true, 1000, 113),
        (HalfType::Bf16, 160, false, 17, 17),
        (HalfType::F16, 248, true, 129, 300),
    ] {
        let c = case(dtype, d, causal, 2, 4, 2, sq, sk);
        let (mut dev, params, replay) = run_once(&attn, &stream, &mut seeds, c);
        let (contiguous, lse_contiguous) = dev.download().unwrap();
        // O and the LSE again as never written: the pitched call must write all of them.
        dev.poison().unwrap();
        let ([q, k, v, o], lse) = dev.views();

        let pitch = d + 64;
        let nan = match dtype {
            HalfType::F16 => 0x7e00u16,
            HalfType::Bf16 => 0x7fc0u16,
        };
        let poison = flashcore::reference::poison(dtype);
        // A copy of `view` (contiguous [B, S, H, D]) with `fill` after each row's d (O's
        // copy is the poison, as `o` was just poisoned).
        let pitched = |view: &TensorView, fill: u16| {
            let rows = view.shape[0] * view.shape[1] * view.shape[2];
            let mut host = vec![0u16; rows * d];
            // SAFETY: `view` is one of the case's live device buffers of `rows · d`
            // elements, read on the stream it was written on.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_sync(&mut host, view.ptr).unwrap();
            }
            let mut padded = vec![fill; rows * pitch];
            for (row, src) in padded.chunks_mut(pitch).zip(host.chunks(d)) {
                row[..d].copy_from_slice(src);
            }
            let buf = stream.clone_htod(&padded).unwrap();
            let (s, h) = (view.shape[1], view.shape[2]);
            let at = TensorView {
                ptr: cudarc::driver::DevicePtr::device_ptr(&buf, &stream).0,
                strides: [s * h * pitch, h * pitch, pitch, 1],
                ..*view
            };
            (buf, at)
        };
        stream.synchronize().unwrap();
        stream.context().bind_to_thread().unwrap();
        let (_qb, qp) = pitched(&q, nan);
        let (_kb, kp) = pitched(&k, nan);
        let (_vb, vp) = pitched(&v, nan);
        let (ob, op) = pitched(&o, poison);
        // SAFETY: the pitched views are the live buffers above, sized for every element
        // they describe, and the LSE the case's own; all on `stream`.
        unsafe { attn.forward(&qp, &kp, &vp, &op, Some(&lse), &params, stream.cu_stream()) }
            .unwrap();
        let got = stream.clone_dtoh(&ob).unwrap();
        let (_, lse_pitched) = dev.download().unwrap();
        for (i, (row, want)) in got.chunks(pitch).zip(contiguous.chunks(d)).enumerate() {
            let at = format!("{dtype:?} d{d} causal={causal} Sq{sq} Sk{sk}, row {i} ({replay})");
            assert_eq!(&row[..d], want, "{at}: pitched and contiguous O differ");
            assert!(
                row[d..].iter().all(|&x| x == poison),
                "{at}: columns past d written"
            );
        }
        assert_eq!(lse_pitched, lse_contiguous, "LSE differs ({replay})");
        println!("{dtype:?} d{d} causal={causal} Sq{sq} Sk{sk}: same bits, nothing past d");
    }
}

/// Forward calls shaped like decode steps (at most 16 queries per sequence against at
/// least `FORWARD_DECODE_MIN_KEYS` keys, fewer with many GQA-packed KV heads) run on the
/// split-KV decode kernels, right for
/// every head dim, GQA ratio, mask and layout, LSE included; an Attention restricted to
/// the sm80 path keeps its forward kernels.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_shaped_forwards_run_on_the_decode_kernels() {
    use flashcore::host::attention::PathChoice;
    use flashcore::host::decode::FORWARD_DECODE_MIN_KEYS;
    let mut cases = Vec::new();
    let min = FORWARD_DECODE_MIN_KEYS;
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for (d, hq, hkv) in [
            (128, 32, 8),
            (64, 8, 8),
            (80, 12, 4),
            (256, 4, 1),
            (32, 16, 2),
        ] {
            for (b, sq, sk) in [(1, 1, min), (3, 7, min + 1), (2, 16, 4097), (1, 5, 32768)] {
                for causal in [false, true] {
                    let mut c = case(dtype, d, causal, b, hq, hkv, sq, sk);
                    if (sq + d) % 3 == 0 {
                        c.layout = Layout::Bhsd;
                    }
                    cases.push(c);
                }
            }
        }
    }
    // Shorter key sets where at least 128 KV heads each serve 4 query heads or more.
    let gqa = flashcore::host::decode::FORWARD_DECODE_MIN_KEYS_GQA;
    for (b, hq, hkv, sq, sk, d, causal) in [
        (16, 32, 8, 1, gqa, 128, false),
        (16, 32, 8, 16, gqa + 188, 64, true),
        (128, 8, 1, 3, gqa + 88, 80, true),
    ] {
        cases.push(case(HalfType::F16, d, causal, b, hq, hkv, sq, sk));
        cases.push(case(HalfType::Bf16, d, !causal, b, hq, hkv, sq, sk));
    }
    let (attn, stream) = setup();
    let mut seeds = seeds();
    let mut failures = Vec::new();
    for c in &cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let r = check_forward(&attn, &stream, *c, &mut rng)
            .unwrap_or_else(|e| panic!("{c} ({replay}): {e}"));
        let line = format!(
            "{c}: out {:.2e} lse {:.2e} unwritten {} ({replay})",
            r.out_err, r.lse_err, r.unwritten
        );
        println!("{line}");
        if !r.passes(c.dtype) {
            failures.push(line);
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
    let loaded = attn.loaded_kernels();
    let forwards = loaded
        .iter()
        .filter(|k| k.0.starts_with("attn_fwd"))
        .count();
    let decodes = loaded
        .iter()
        .filter(|k| k.0.starts_with("attn_decode"))
        .count();
    assert!(decodes > 0 && forwards == 0, "loaded: {loaded:?}");

    // Below the threshold, and on the sm80 path, the forward kernels run.
    let short = case(HalfType::F16, 128, true, 1, 32, 8, 16, min - 1);
    let long = case(HalfType::F16, 128, true, 1, 32, 8, 16, min);
    for (choice, cases) in [
        (PathChoice::Sm80, vec![short, long]),
        (PathChoice::Best, vec![short]),
    ] {
        let (attn, stream) = setup();
        let attn = attn.with_path(choice);
        for c in cases {
            let r = check_forward(&attn, &stream, c, &mut seeds.next_case()).unwrap();
            assert!(r.passes(c.dtype), "{c} ({choice:?}): {:.2e}", r.out_err);
        }
        let loaded = attn.loaded_kernels();
        assert!(
            loaded.iter().all(|k| k.0.starts_with("attn_fwd")),
            "{choice:?}: {loaded:?}"
        );
    }
}

/// A 16-bit element type's conversions from and to its bits.
type BitCasts<T> = (fn(u16) -> T, fn(T) -> u16);

/// One forward over cudarc buffers of `T` ([`Attention::forward_buffers`]), `[B, S, H, D]`
/// contiguous, on a stream of its own: against float64, its LSE too.
fn buffers_case<T>(
    attn: &Attention,
    rng: &mut Rng,
    dtype: HalfType,
    shape: AttnShape,
    causal: bool,
    bits: BitCasts<T>,
) -> (f64, f64)
where
    T: flashcore::host::buffers::HalfElement + cudarc::driver::DeviceRepr + Copy + Default,
{
    use flashcore::host::buffers::{Layout4, Tensor, TensorMut};
    let stream = attn.device().context().new_stream().expect("a stream");
    let AttnShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
    } = shape;
    let mut upload = |n: usize| {
        let (h, x) = reference::random_half(rng, n, dtype);
        let t: Vec<T> = h.into_iter().map(bits.0).collect();
        (stream.clone_htod(&t).expect("upload"), x)
    };
    let (q, qx) = upload(b * sq * hq * d);
    let (k, kx) = upload(b * sk * hkv * d);
    let (v, vx) = upload(b * sk * hkv * d);
    let poison = vec![(bits.0)(reference::poison(dtype)); b * sq * hq * d];
    let mut o = stream.clone_htod(&poison).expect("o");
    let mut lse = stream
        .clone_htod(&vec![f32::NAN; b * hq * sq])
        .expect("lse");
    let params = AttentionParams {
        softmax_scale: None,
        causal,
        ..Default::default()
    };
    attn.forward_buffers(
        &stream,
        [
            Tensor::new(&q, Layout4::bshd(b, sq, hq, d)),
            Tensor::new(&k, Layout4::bshd(b, sk, hkv, d)),
            Tensor::new(&v, Layout4::bshd(b, sk, hkv, d)),
        ],
        TensorMut::new(&mut o, Layout4::bshd(b, sq, hq, d)),
        Some(&mut lse),
        &params,
    )
    .unwrap_or_else(|e| panic!("{shape:?}: {e}"));
    let got: Vec<u16> = stream
        .clone_dtoh(&o)
        .expect("download")
        .into_iter()
        .map(bits.1)
        .collect();
    let got = reference::half_bits_to_f64(&got, dtype);
    let got_lse: Vec<f64> = stream
        .clone_dtoh(&lse)
        .expect("download")
        .into_iter()
        .map(f64::from)
        .collect();
    let want = reference::attention_f64(&shape, &qx, &kx, &vx, params.scale_for(d) as f64, causal);
    (
        reference::rel_l2(&got, &want.out),
        reference::rel_l2(&got_lse, &want.lse),
    )
}

/// The safe forward over cudarc buffers: f16 and bf16, GQA, a tail, causal and not,
/// against float64; then buffers that do not fit their layouts, refused with nothing
/// written.
#[test]
#[ignore = "needs a CUDA GPU"]
fn forward_buffers_match_float64_and_refuse_short_buffers() {
    use flashcore::host::buffers::{Layout4, Tensor, TensorMut};
    let (attn, stream) = setup();
    let mut seeds = seeds();
    let shapes = [
        (AttnShape::square(1, 4, 17, 64), false),
        (
            AttnShape {
                batch: 2,
                seqlen_q: 113,
                seqlen_k: 300,
                heads_q: 8,
                heads_kv: 2,
                head_dim: 128,
            },
            true,
        ),
    ];
    for (shape, causal) in shapes {
        for dtype in [HalfType::F16, HalfType::Bf16] {
            let mut rng = seeds.next_case();
            let replay = seeds.replay(&rng);
            let (err, lse_err) = match dtype {
                HalfType::F16 => buffers_case(
                    &attn,
                    &mut rng,
                    dtype,
                    shape,
                    causal,
                    (half::f16::from_bits, half::f16::to_bits),
                ),
                HalfType::Bf16 => buffers_case(
                    &attn,
                    &mut rng,
                    dtype,
                    shape,
                    causal,
                    (half::bf16::from_bits, half::bf16::to_bits),
                ),
            };
            println!("{shape:?} {dtype:?} causal {causal}: out {err:.2e} lse {lse_err:.2e}");
            assert!(
                err <= tolerance(dtype) && lse_err <= 1e-3,
                "{shape:?} {dtype:?}: out {err:.2e} lse {lse_err:.2e} ({replay})"
            );
        }
    }

    // Buffers one element short of their layouts, and an LSE one float short.
    let (b, s, h, d) = (1, 64, 2, 64);
    let n = b * s * h * d;
    let x = stream.clone_htod(&vec![half::f16::ONE; n]).unwrap();
    let short = stream.clone_htod(&vec![half::f16::ONE; n - 1]).unwrap();
    let poison = vec![half::f16::from_bits(reference::poison(HalfType::F16)); n];
    let mut o = stream.clone_htod(&poison).unwrap();
    let mut o_short = stream.clone_htod(&poison[1..]).unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; b * h * s - 1]).unwrap();
    let l = Layout4::bhsd(b, s, h, d);
    let params = AttentionParams::default();
    let refused = |e: flashcore::Result<()>, what: &str| match e {
        Err(flashcore::Error::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("{what}: {other:?}"),
    };
    let inputs = |q| [Tensor::new(q, l), Tensor::new(&x, l), Tensor::new(&x, l)];
    refused(
        attn.forward_buffers(
            &stream,
            inputs(&short),
            TensorMut::new(&mut o, l),
            None,
            &params,
        ),
        "q's layout",
    );
    refused(
        attn.forward_buffers(
            &stream,
            inputs(&x),
            TensorMut::new(&mut o_short, l),
            None,
            &params,
        ),
        "o's layout",
    );
    refused(
        attn.forward_buffers(
            &stream,
            inputs(&x),
            TensorMut::new(&mut o, l),
            Some(&mut lse),
            &params,
        ),
        "lse holds",
    );
    let o_after: Vec<u16> = stream
        .clone_dtoh(&o)
        .unwrap()
        .into_iter()
        .map(half::f16::to_bits)
        .collect();
    assert!(
        o_after
            .iter()
            .all(|&b| b == reference::poison(HalfType::F16)),
        "a refused call wrote o"
    );
    // The same call with the right buffers runs.
    let mut lse = stream.clone_htod(&vec![f32::NAN; b * h * s]).unwrap();
    attn.forward_buffers(
        &stream,
        inputs(&x),
        TensorMut::new(&mut o, l),
        Some(&mut lse),
        &params,
    )
    .expect("the right buffers");
    let o_after = stream.clone_dtoh(&o).unwrap();
    // Every value 1: the output is 1 everywhere.
    assert!(o_after.iter().all(|&v| v == half::f16::ONE));
}
