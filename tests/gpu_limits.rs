//! Forward attention at the edges of what validation accepts: sequences at the length
//! limit (2^25 keys, broadcast through a zero sequence stride so a few bytes of memory
//! suffice), lengths just past it (a typed error, nothing written), and softmax scales so
//! large that `max · scale` leaves the float range. Run on a GPU machine with
//! `cargo test --release --test gpu_limits -- --include-ignored`.

mod common;

use std::sync::Arc;

use common::{FAR, FarPair, worse};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use flashcore::Error;
use flashcore::check::{LSE_TOLERANCE, TestSeeds, tolerance};
use flashcore::host::attention::Attention;
use flashcore::host::device::Device;
use flashcore::host::tensor::{AttentionParams, DType, LseView, TensorView, Window};
use flashcore::host::validate::MAX_SEQLEN;
use flashcore::kernels::attention::{BLOCK_M_WIDE, FwdConfig, HalfType, Path};
use flashcore::reference::{self, RefParams, Rng};
use flashcore::shape::AttnShape;

fn setup() -> (Attention, Arc<CudaStream>) {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let stream = device.context().default_stream();
    (Attention::new(device).expect("an sm_80+ GPU"), stream)
}

fn seeds() -> TestSeeds {
    TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"))
}

/// Device buffers of one case: Q `[1, Sq, 1, D]`, one K row and one V row (broadcast to
/// any Sk by a zero sequence stride), O and LSE poisoned with NaN.
struct Buffers {
    stream: Arc<CudaStream>,
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
    sq: usize,
    d: usize,
}

impl Buffers {
    fn new(
        stream: &Arc<CudaStream>,
        q: &[u16],
        k: &[u16],
        v: &[u16],
        sq: usize,
        d: usize,
    ) -> Buffers {
        let up = |x: &[u16]| stream.clone_htod(x).expect("upload");
        Buffers {
            q: up(q),
            k: up(k),
            v: up(v),
            o: up(&vec![reference::POISON_F16; sq * d]),
            lse: stream.clone_htod(&vec![f32::NAN; sq]).expect("upload"),
            stream: stream.clone(),
            sq,
            d,
        }
    }

    /// Q from the host; K and V `rows` rows of zeros each (to be viewed with stride `D`).
    fn zero_kv(stream: &Arc<CudaStream>, q: &[u16], rows: usize, sq: usize, d: usize) -> Buffers {
        let zeros = || stream.alloc_zeros::<u16>(rows * d).expect("K/V memory");
        Buffers {
            q: stream.clone_htod(q).expect("upload"),
            k: zeros(),
            v: zeros(),
            o: stream
                .clone_htod(&vec![reference::POISON_F16; sq * d])
                .expect("upload"),
            lse: stream.clone_htod(&vec![f32::NAN; sq]).expect("upload"),
            stream: stream.clone(),
            sq,
            d,
        }
    }

    /// Writes `k` and `v` into row `row` of K and V, and poisons O and the LSE again.
    fn set_row(&mut self, row: usize, k: &[u16], v: &[u16]) {
        let d = self.d;
        let s = &self.stream;
        s.memcpy_htod(k, &mut self.k.slice_mut(row * d..(row + 1) * d))
            .expect("upload");
        s.memcpy_htod(v, &mut self.v.slice_mut(row * d..(row + 1) * d))
            .expect("upload");
        s.memcpy_htod(&vec![reference::POISON_F16; self.sq * d], &mut self.o)
            .expect("upload");
        s.memcpy_htod(&vec![f32::NAN; self.sq], &mut self.lse)
            .expect("upload");
    }

    fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// Runs with `sk` keys: K and V are `[1, sk, 1, D]` views with sequence stride
    /// `kv_stride` (0: every key is the buffer's one row; `D`: `sk` real rows).
    fn run(
        &self,
        attn: &Attention,
        sk: usize,
        kv_stride: usize,
        params: &AttentionParams,
        cfg: Option<&FwdConfig>,
    ) -> Result<(), Error> {
        let (sq, d) = (self.sq, self.d);
        let q = TensorView::bshd(self.ptr(&self.q), DType::F16, 1, sq, 1, d);
        let o = TensorView::bshd(self.ptr(&self.o), DType::F16, 1, sq, 1, d);
        let kv = |p| TensorView::strided(p, DType::F16, [1, sk, 1, d], [0, kv_stride, d, 1]);
        let (k, v) = (kv(self.ptr(&self.k)), kv(self.ptr(&self.v)));
        let lse = LseView {
            ptr: self.ptr(&self.lse),
        };
        let s = self.stream.cu_stream();
        // SAFETY: every view lies inside its own buffer (K and V repeat row 0 when their
        // stride is 0), all allocated on `stream`'s device and alive for this call.
        unsafe {
            match cfg {
                None => attn.forward(&q, &k, &v, &o, Some(&lse), params, s),
                Some(c) => attn.forward_with_config(c, &q, &k, &v, &o, Some(&lse), params, s),
            }
        }
    }

    fn download(&self) -> (Vec<f64>, Vec<f32>) {
        let o = self.stream.clone_dtoh(&self.o).expect("download");
        let lse = self.stream.clone_dtoh(&self.lse).expect("download");
        self.stream.synchronize().expect("sync");
        (reference::half_bits_to_f64(&o, HalfType::F16), lse)
    }
}

/// Sk at the limit and just below it, with every key equal: each row's output is V's one
/// row, and its LSE is `ln(visible keys) + scale · q·k`. V's entries are signed powers
/// of two (1/8 to 1): a sum of 2^25 copies of such a value is exact, in f32 and in the
/// tensor cores' narrower accumulators, so any error is a key visited twice or missed
/// (what this test is about), not rounding. (With arbitrary values, adding the same
/// number 2^25 times drifts; and at 2^27 keys the tensor cores' sum stops growing, which
/// is why validation stops at 2^25.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn longest_sequences_are_exact() {
    let (attn, stream) = setup();
    let mut seeds = seeds();
    let wide = |d: u32| FwdConfig::sm80(HalfType::F16, d, false, BLOCK_M_WIDE, false);
    // (head dim, Sk, Sq, causal, forced kernel)
    let cases = [
        (64, MAX_SEQLEN, 1, false, None),
        (64, MAX_SEQLEN - 63, 1, false, None),
        (256, MAX_SEQLEN - 1, 1, false, None),
        (64, MAX_SEQLEN - 126, 5, true, None),
        (128, MAX_SEQLEN, 3, false, Some(wide(128))),
    ];
    let mut failures = Vec::new();
    for (d, sk, sq, causal, cfg) in cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let (q_bits, q) = reference::random_half(&mut rng, sq * d, HalfType::F16);
        let (k_bits, k) = reference::random_half(&mut rng, d, HalfType::F16);
        let v: Vec<f64> = (0..d)
            .map(|_| {
                let r = rng.next_u64();
                let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                sign / f64::from(1u32 << ((r >> 1) % 4))
            })
            .collect();
        let v_bits = reference::f64_to_half_bits(&v, HalfType::F16);
        let buf = Buffers::new(&stream, &q_bits, &k_bits, &v_bits, sq, d);
        let params = AttentionParams {
            softmax_scale: None,
            causal,
            ..Default::default()
        };
        let t = std::time::Instant::now();
        buf.run(&attn, sk, 0, &params, cfg.as_ref())
            .unwrap_or_else(|e| panic!("d{d} Sk {sk}: {e}"));
        let (o, lse) = buf.download();
        let secs = t.elapsed().as_secs_f64();
        let scale = params.scale_for(d) as f64;
        let shape = AttnShape {
            seqlen_q: sq,
            seqlen_k: sk,
            ..AttnShape::square(1, 1, 1, d)
        };
        let mut worst_o = 0f64;
        let mut worst_lse = 0f64;
        for i in 0..sq {
            let seen = shape.visible_keys(i, causal);
            let row = &o[i * d..][..d];
            let (want_o, want_lse) = if seen == 0 {
                (vec![0.0; d], f64::NEG_INFINITY)
            } else {
                let s: f64 = q[i * d..][..d].iter().zip(&k).map(|(a, b)| a * b).sum();
                (v.clone(), (seen as f64).ln() + scale * s)
            };
            // A NaN (O's poison, unwritten) must fail.
            worst_o = worse(worst_o, reference::rel_l2(row, &want_o));
            worst_lse = worse(worst_lse, lse_error(lse[i], want_lse));
        }
        let line = format!(
            "d{d} Sk {sk} Sq {sq} causal {causal}: out {worst_o:.2e} lse {worst_lse:.2e} in \
             {secs:.2} s ({replay})"
        );
        println!("{line}");
        if !(worst_o <= 2e-3 && worst_lse <= 1e-5) {
            failures.push(line);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every tile of the longest sequences is read: `longest_sequences_are_exact` repeats one
/// key, so a tile skipped there changes nothing it can see. Here K and V are real
/// `[2^25, D]` buffers of zeros (4 to 8 GiB each) with one needle row: a key scoring 30
/// (e^30 ≈ 1e13 outweighs the 2^25 zero scores) and a value of signed powers of two. A
/// row that sees the needle outputs its value (weight `e^30 / (seen − 1 + e^30)`) with
/// LSE `ln(seen − 1 + e^30)`; a row whose kernel missed the needle's tile outputs zeros
/// with LSE `ln(seen)`, 12.7 lower. The needle visits both ends of the sequence, the
/// edges of the first tiles, 2^24 (where f32 stops counting keys exactly) and the last
/// tiles of a length that is no multiple of a tile, on the kernels each shape takes:
/// decode-shaped rows (the split-KV kernels), a causal pair of queries, 32 rows (the
/// Hopper forward on sm_90) and the sm80 forward.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_needle_in_the_longest_sequences_is_found_anywhere() {
    let (attn, stream) = setup();
    let wide = |d: u32| FwdConfig::sm80(HalfType::F16, d, false, BLOCK_M_WIDE, false);
    // (head dim, Sk, Sq, causal, forced kernel)
    let cases = [
        (64, MAX_SEQLEN, 1, false, None),
        (128, MAX_SEQLEN - 63, 2, true, None),
        (64, MAX_SEQLEN - 1, 32, false, None),
        (128, MAX_SEQLEN, 3, false, Some(wide(128))),
    ];
    let mut failures = Vec::new();
    for (d, sk, sq, causal, cfg) in cases {
        // q = 1 everywhere; the needle key t·1 scores scale·d·t = 30.
        let scale = 1.0 / (d as f64).sqrt();
        let t = 30.0 / (scale * d as f64);
        let k_bits = reference::f64_to_half_bits(&vec![t; d], HalfType::F16);
        let needle_score =
            scale * d as f64 * reference::half_bits_to_f64(&k_bits, HalfType::F16)[0];
        let v: Vec<f64> = (0..d)
            .map(|i| (if i % 3 == 0 { -1.0 } else { 1.0 }) / f64::from(1u32 << (i % 4)))
            .collect();
        let v_bits = reference::f64_to_half_bits(&v, HalfType::F16);
        let zeros = vec![0u16; d];
        let q_bits = reference::f64_to_half_bits(&vec![1.0; sq * d], HalfType::F16);
        let mut buf = Buffers::zero_kv(&stream, &q_bits, sk, sq, d);
        let params = AttentionParams {
            softmax_scale: None,
            causal,
            ..Default::default()
        };
        let shape = AttnShape {
            seqlen_q: sq,
            seqlen_k: sk,
            ..AttnShape::square(1, 1, 1, d)
        };
        for needle in [0, 63, 64, 1 << 24, (1 << 24) + 17, sk - 65, sk - 1] {
            buf.set_row(needle, &k_bits, &v_bits);
            buf.run(&attn, sk, d, &params, cfg.as_ref())
                .unwrap_or_else(|e| panic!("d{d} Sk {sk}: {e}"));
            let (o, lse) = buf.download();
            buf.set_row(needle, &zeros, &zeros);
            let (mut worst_o, mut worst_lse) = (0f64, 0f64);
            for i in 0..sq {
                let seen = shape.visible_keys(i, causal);
                let (want_o, want_lse) = if seen == 0 {
                    (vec![0.0; d], f64::NEG_INFINITY)
                } else if needle < seen {
                    let big = needle_score.exp();
                    let w = big / (seen as f64 - 1.0 + big);
                    (
                        v.iter().map(|x| x * w).collect(),
                        (seen as f64 - 1.0 + big).ln(),
                    )
                } else {
                    (vec![0.0; d], (seen as f64).ln())
                };
                let row = &o[i * d..][..d];
                // Zero rows: an absolute error (every element must be 0).
                let err_o = if want_o.iter().all(|&x| x == 0.0) {
                    row.iter().map(|x| x.abs()).fold(0.0, worse)
                } else {
                    reference::rel_l2(row, &want_o)
                };
                // NaN must fail.
                worst_o = worse(worst_o, err_o);
                worst_lse = worse(worst_lse, lse_error(lse[i], want_lse));
            }
            let line = format!(
                "d{d} Sk {sk} Sq {sq} causal {causal}: needle at {needle}: out {worst_o:.2e} lse \
                 {worst_lse:.2e}"
            );
            println!("{line}");
            if !(worst_o <= 2e-3 && worst_lse <= 1e-5) {
                failures.push(line);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A row's LSE error relative to max(1, |want|): 0 where both are the same infinity (a
/// row that sees no key), infinite where only one is finite or `got` is NaN (the poison,
/// unwritten).
fn lse_error(got: f32, want: f64) -> f64 {
    let got = got as f64;
    if want.is_finite() && got.is_finite() {
        (got - want).abs() / want.abs().max(1.0)
    } else if got == want {
        0.0
    } else {
        f64::INFINITY
    }
}

/// One key past the limit, and the lengths near 2^31 that once wrapped, are typed errors
/// that write nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn lengths_past_the_limit_are_refused() {
    let (attn, stream) = setup();
    let mut rng = Rng::new(1);
    let d = 64;
    let (bits, _) = reference::random_half(&mut rng, d, HalfType::F16);
    let buf = Buffers::new(&stream, &bits, &bits, &bits, 1, d);
    for sk in [MAX_SEQLEN + 1, (1 << 31) - 63, (1 << 31) - 1] {
        for causal in [false, true] {
            let params = AttentionParams {
                softmax_scale: None,
                causal,
                ..Default::default()
            };
            match buf.run(&attn, sk, 0, &params, None) {
                Err(Error::InvalidArgument(m)) => println!("Sk {sk}: {m}"),
                other => panic!("Sk {sk}: expected InvalidArgument, got {other:?}"),
            }
        }
    }
    let (o, lse) = buf.download();
    assert!(o.iter().all(|x| x.is_nan()), "a refused call wrote O");
    assert!(
        lse.iter().all(|x| x.is_nan()),
        "a refused call wrote the LSE"
    );
}

/// Scales large enough that `max · scale` overflows f32: softmax at such a temperature is
/// the average of V over the keys with the top score. Here q = 1 and key j is `c_j · 1`,
/// so scores are exact (q·k = 64 for the top key at D = 64).
#[test]
#[ignore = "needs a CUDA GPU"]
fn huge_scales_pick_the_top_keys() {
    let (attn, stream) = setup();
    let mut seeds = seeds();
    let (d, sq, sk) = (64usize, 4usize, 100usize);
    let q_bits = reference::f64_to_half_bits(&vec![1.0; sq * d], HalfType::F16);
    for (scale, causal, tie) in [
        (1e37f32, false, false),
        (1e37, true, false),
        (1e30, false, true),
        (2e38, false, false),
        (1e37, true, true),
    ] {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        // Key j scores 64·c_j: c = 1 at key 97 (and 41 with a tie), below 1 elsewhere.
        let c: Vec<f64> = (0..sk)
            .map(|j| match j {
                97 => 1.0,
                41 if tie => 1.0,
                _ => (j % 7) as f64 / 8.0 - 0.5,
            })
            .collect();
        let k: Vec<f64> = c
            .iter()
            .flat_map(|&cj| std::iter::repeat_n(cj, d))
            .collect();
        let k_bits = reference::f64_to_half_bits(&k, HalfType::F16);
        let (v_bits, v) = reference::random_half(&mut rng, sk * d, HalfType::F16);
        let buf = Buffers::new(&stream, &q_bits, &k_bits, &v_bits, sq, d);
        let params = AttentionParams {
            softmax_scale: Some(scale),
            causal,
            ..Default::default()
        };
        if attn.device().compute_capability() == (9, 0) {
            // The sm90 kernel with the scale folded into the exponent would overflow
            // `max · scale`: forcing it is refused, and nothing is written.
            let folded = FwdConfig {
                path: Path::Sm90,
                dtype: HalfType::F16,
                head_dim: d as u32,
                causal,
                window: false,
                block_m: 64,
                split_keys: false,
                fold_scale: true,
                padded: false,
                narrow_keys: false,
                softcap: false,
            };
            match buf.run(&attn, sk, d, &params, Some(&folded)) {
                Err(Error::InvalidArgument(m)) => println!("scale {scale}, folded: {m}"),
                other => panic!("scale {scale}: a folded kernel ran: {other:?}"),
            }
            let (o, lse) = buf.download();
            assert!(o.iter().all(|x| x.is_nan()) && lse.iter().all(|x| x.is_nan()));
        }
        buf.run(&attn, sk, d, &params, None)
            .unwrap_or_else(|e| panic!("scale {scale}: {e}"));
        let (o, lse) = buf.download();
        let shape = AttnShape {
            seqlen_q: sq,
            seqlen_k: sk,
            ..AttnShape::square(1, 1, 1, d)
        };
        let q = vec![1.0; sq * d];
        let want = reference::attention_f64(&shape, &q, &k, &v, scale as f64, causal);
        let out_err = reference::rel_l2(&o, &want.out);
        // The true LSE may exceed the f32 range: then +inf is the right answer.
        let lse_ok = lse.iter().zip(&want.lse).all(|(&g, &w)| {
            let w32 = w as f32;
            if w32.is_infinite() {
                g == w32
            } else {
                ((g as f64) - w).abs() <= 1e-6 * w.abs().max(1.0)
            }
        });
        let line = format!(
            "scale {scale:e} causal {causal} tie {tie}: out {out_err:.2e} lse {lse:?} want \
             {:?} ({replay})",
            want.lse
        );
        println!("{line}");
        assert!(out_err <= 1e-3 && lse_ok, "{line}");
    }
}

/// A view no tensor map can describe (K's batches 2^40 bytes apart, a stride validation
/// accepts) runs on Hopper on the sm80 kernel instead of failing, with the same answers;
/// on other GPUs it is the sm80 path's ordinary work.
#[test]
#[ignore = "needs a CUDA GPU"]
fn strides_no_tensor_map_holds_fall_back_to_the_sm80_kernel() {
    let (attn, stream) = setup();
    let mut seeds = seeds();
    let up16 = |x: &[u16]| stream.clone_htod(x).expect("upload");
    let dev = |x: &CudaSlice<u16>| x.device_ptr(&stream).0;
    let mut failures = Vec::new();
    // Plain and causal at every head dim; a key window and a soft cap, which the sm80
    // kernels' own twins must take over, at two.
    let sliding = AttentionParams::sliding_window(32);
    let left_only = Window {
        left: Some(16),
        right: None,
    };
    let options = [
        ("plain", AttentionParams::default()),
        (
            "causal",
            AttentionParams {
                causal: true,
                ..Default::default()
            },
        ),
        ("sliding 32", sliding),
        (
            "window (16, -1)",
            AttentionParams {
                window: left_only,
                ..Default::default()
            },
        ),
        (
            "softcap 30, scale 0.5",
            AttentionParams {
                softmax_scale: Some(0.5),
                softcap: Some(30.0),
                ..Default::default()
            },
        ),
        (
            "softcap 30, causal",
            AttentionParams {
                causal: true,
                softcap: Some(30.0),
                ..Default::default()
            },
        ),
    ];
    for d in [64, 80, 128, 192, 256] {
        for (name, params) in options {
            if !matches!(name, "plain" | "causal") && ![64, 128].contains(&d) {
                continue;
            }
            let causal = params.causal;
            let dtype = HalfType::F16;
            let shape = AttnShape {
                seqlen_q: 130,
                seqlen_k: 300,
                heads_q: 4,
                heads_kv: 2,
                ..AttnShape::square(2, 4, 1, d)
            };
            let mut rng = seeds.next_case();
            let replay = seeds.replay(&rng);
            let (q_bits, q) = reference::random_half(&mut rng, shape.q_len(), dtype);
            let (k_bits, k) = reference::random_half(&mut rng, shape.kv_len(), dtype);
            let (v_bits, v) = reference::random_half(&mut rng, shape.kv_len(), dtype);
            let per_batch = shape.kv_len() / 2;
            let far = FarPair::new(&stream, per_batch * 2);
            for i in 0..2 {
                far.write(i, &k_bits[i * per_batch..][..per_batch]);
            }
            let (dq, dv) = (up16(&q_bits), up16(&v_bits));
            let o = up16(&vec![reference::POISON_F16; shape.q_len()]);
            let lse = stream
                .clone_htod(&vec![f32::NAN; shape.lse_len()])
                .expect("upload");
            let (b, sq, sk, hq, hkv) = (2, 130, 300, 4, 2);
            let qv = TensorView::bshd(dev(&dq), DType::F16, b, sq, hq, d);
            let ov = TensorView::bshd(dev(&o), DType::F16, b, sq, hq, d);
            let vv = TensorView::bshd(dev(&dv), DType::F16, b, sk, hkv, d);
            let kv = TensorView::strided(
                far.base,
                DType::F16,
                [b, sk, hkv, d],
                [FAR as usize / 2, hkv * d, d, 1],
            );
            let lse_view = LseView {
                ptr: lse.device_ptr(&stream).0,
            };
            // SAFETY: Q, V, O and the LSE are whole allocations of this context; K's two
            // batches are the two mapped halves of `far`, alive until after the sync.
            let run = unsafe {
                attn.forward(
                    &qv,
                    &kv,
                    &vv,
                    &ov,
                    Some(&lse_view),
                    &params,
                    stream.cu_stream(),
                )
            };
            let got = stream.clone_dtoh(&o).expect("download");
            let got_lse = stream.clone_dtoh(&lse).expect("download");
            stream.synchronize().expect("sync");
            drop(far);
            let line = match run {
                Err(e) => format!("d{d} {name}: {e}"),
                Ok(()) => {
                    let reference_params = RefParams {
                        scale: params.scale_for(d) as f64,
                        causal,
                        window: params.window,
                        softcap: params.softcap.map(f64::from),
                    };
                    let want = reference::attention_f64_with(&shape, &q, &k, &v, &reference_params);
                    let out =
                        reference::rel_l2(&reference::half_bits_to_f64(&got, dtype), &want.out);
                    let lse_err = got_lse
                        .iter()
                        .zip(&want.lse)
                        .map(|(&g, &w)| {
                            if w == f64::NEG_INFINITY {
                                if g == f32::NEG_INFINITY {
                                    0.0
                                } else {
                                    f64::INFINITY
                                }
                            } else if g.is_finite() {
                                (g as f64 - w).abs() / w.abs().max(1.0)
                            } else {
                                // Unwritten (NaN poison) or overflowed: f64::max would
                                // drop a NaN.
                                f64::INFINITY
                            }
                        })
                        .fold(0.0, f64::max);
                    let ok = out <= tolerance(dtype) && lse_err <= LSE_TOLERANCE;
                    let line = format!("d{d} {name}: out {out:.2e} lse {lse_err:.2e}");
                    println!("{line}");
                    if ok {
                        continue;
                    }
                    format!("{line} ({replay})")
                }
            };
            failures.push(line);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
