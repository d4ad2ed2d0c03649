//! FP8 (E4M3) forward attention on a GPU against the float64 reference. Run on a GPU
//! machine with `cargo test --release --test gpu_fp8 -- --include-ignored`; the tests of
//! one kernel family run with a filter: `sm89` (the `mma.sync` fallback, forced with
//! [`PathChoice::Sm80`] so it also runs on Hopper).
//!
//! Inputs are random, quantized on the CPU by [`flashcore::quant`], and the reference
//! runs on their *dequantized* values (codes times scales, exactly): the comparison
//! measures the kernel (its dequantisation inside the softmax, its rounding of P to E4M3,
//! its two-level accumulation), not the quantizer.
//!
//! Bounds, from first principles:
//!
//! - O: the kernel rounds every probability to E4M3 (3 mantissa bits, round to nearest),
//!   a relative error of at most 2⁻⁴ and about 2.5% RMS over a binade, independent from
//!   key to key; O is a weighted mean of V rows, so its relative L2 error is of that order
//!   (1% to 2.6% measured on the CPU model of the kernel, [`cpu_model`]). Everything else
//!   (f32 sums, `ex2.approx`, the 16-bit output) is far below. Bound: [`OUT_BOUND`] = 4e-2.
//! - LSE: the row sums add the f32 probabilities, before rounding, so the LSE only sees
//!   f32 arithmetic: [`LSE_ABS`] = 1e-3 absolute, plus [`LSE_REL`] of its magnitude
//!   (a few f32 ulps: an outlier block makes scores, and the LSE, thousands).
//! - Rows that see no key (causal, Sq > Sk): O exactly 0 and LSE −∞. O starts as NaN
//!   poison, and a NaN anywhere fails.

mod common;

use std::sync::Arc;

use common::{down, ptr, rel_l2_of_row_groups, seeds, up, worse};
use cudarc::driver::CudaStream;
use flashcore::host::attention::{Attention, PathChoice};
use flashcore::host::device::Device;
use flashcore::host::fp8::{Fp8Operands, Fp8Problem, VtView};
use flashcore::host::tensor::{AttentionParams, DType, LseView, TensorView};
use flashcore::kernels::attention::HalfType;
use flashcore::kernels::attention::fp8::{Fp8Path, P_SHIFT_LOG2, vt_min_pitch, vt_position};
use flashcore::quant::{
    Granularity, Quantized, dequantize_rows, dequantize_vt, e4m3_from_f32, e4m3_to_f32,
    quantize_rows, quantize_vt,
};
use flashcore::reference::{self, RefOutput, Rng, attention_f64, half_bits_to_f64, rel_l2};
use flashcore::shape::AttnShape;

/// Relative L2 bound on O (see the module docs).
const OUT_BOUND: f64 = 4e-2;
/// Absolute LSE bound, plus [`LSE_REL`] of the LSE's magnitude.
const LSE_ABS: f64 = 1e-3;
const LSE_REL: f64 = 1e-6;

/// What is special about the keys of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keys {
    Random,
    /// Keys 128..256 (the second scale block) of K and V are 1000 times larger: their
    /// block's scales are 1000 times the others', whose precision must not suffer.
    OutlierBlock,
    /// Keys 0..128 of K and V are all zero: scale 1, codes 0.
    ZeroBlock,
}

#[derive(Debug, Clone, Copy)]
struct Fp8Case {
    out: HalfType,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
    head_dim: usize,
    causal: bool,
    /// Pass a per-row LSE shift.
    lse_shift: bool,
    keys: Keys,
}

impl std::fmt::Display for Fp8Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} B{} Hq{} Hkv{} Sq{} Sk{} D{}{}{}{}",
            self.out.name(),
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            if self.causal { " causal" } else { "" },
            if self.lse_shift { " lse_shift" } else { "" },
            match self.keys {
                Keys::Random => "",
                Keys::OutlierBlock => " outlier-block",
                Keys::ZeroBlock => " zero-block",
            }
        )
    }
}

impl Fp8Case {
    fn new(out: HalfType, (seqlen_q, seqlen_k): (usize, usize), head_dim: usize) -> Fp8Case {
        Fp8Case {
            out,
            batch: 1,
            heads_q: 2,
            heads_kv: 2,
            seqlen_q,
            seqlen_k,
            head_dim,
            causal: false,
            lse_shift: false,
            keys: Keys::Random,
        }
    }
    fn shape(&self) -> AttnShape {
        AttnShape {
            batch: self.batch,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            head_dim: self.head_dim,
        }
    }
    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// A case's quantized operands, as the kernel reads them.
#[derive(Clone)]
struct Inputs {
    q: Quantized,
    k: Quantized,
    vt: Quantized,
    pitch: usize,
    /// f32 `[B, Hq, Sq]`.
    lse_shift: Option<Vec<f32>>,
}

fn inputs(c: &Fp8Case, rng: &mut Rng) -> Inputs {
    let s = c.shape();
    let mut normal = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32).collect() };
    let q = normal(s.q_len());
    let (mut k, mut v) = (normal(s.kv_len()), normal(s.kv_len()));
    let lse_shift = c.lse_shift.then(|| normal(s.lse_len()));
    let row = c.heads_kv * c.head_dim;
    for b in 0..c.batch {
        let keys = |range: std::ops::Range<usize>| {
            let first = (b * c.seqlen_k + range.start.min(c.seqlen_k)) * row;
            let end = (b * c.seqlen_k + range.end.min(c.seqlen_k)) * row;
            first..end
        };
        match c.keys {
            Keys::Random => {}
            Keys::OutlierBlock => {
                for x in k[keys(128..256)].iter_mut().chain(&mut v[keys(128..256)]) {
                    *x *= 1000.0;
                }
            }
            Keys::ZeroBlock => {
                k[keys(0..128)].fill(0.0);
                v[keys(0..128)].fill(0.0);
            }
        }
    }
    let qs = [c.batch, c.seqlen_q, c.heads_q, c.head_dim];
    let ks = [c.batch, c.seqlen_k, c.heads_kv, c.head_dim];
    let pitch = vt_min_pitch(c.seqlen_k as u64) as usize;
    Inputs {
        q: quantize_rows(&q, qs, Granularity::PerBlock),
        k: quantize_rows(&k, ks, Granularity::PerBlock),
        vt: quantize_vt(&v, ks, pitch, Granularity::PerBlock),
        pitch,
        lse_shift,
    }
}

/// The float64 reference on the dequantized inputs, with the LSE shift added.
fn expected(c: &Fp8Case, x: &Inputs) -> RefOutput {
    let qs = [c.batch, c.seqlen_q, c.heads_q, c.head_dim];
    let ks = [c.batch, c.seqlen_k, c.heads_kv, c.head_dim];
    let q = dequantize_rows(&x.q, qs);
    let k = dequantize_rows(&x.k, ks);
    let v = dequantize_vt(&x.vt, ks, x.pitch);
    let mut r = attention_f64(&c.shape(), &q, &k, &v, c.scale(), c.causal);
    if let Some(shift) = &x.lse_shift {
        for (lse, &s) in r.lse.iter_mut().zip(shift) {
            *lse += c.scale() * s as f64;
        }
    }
    r
}

/// What one run measured.
#[derive(Debug, Clone, Copy)]
struct Measured {
    /// Relative L2 error of O (+∞ with a NaN).
    out_err: f64,
    /// Largest absolute LSE error over rows that see a key.
    lse_err: f64,
    /// Largest LSE error relative to its bound (passes at <= 1).
    lse_excess: f64,
    /// Rows that see no key but got a nonzero O or a finite LSE.
    bad_empty_rows: usize,
}

impl Measured {
    fn passes(&self) -> bool {
        self.out_err <= OUT_BOUND && self.lse_excess <= 1.0 && self.bad_empty_rows == 0
    }
}

/// Compares an output (as f64) and LSE with the reference.
fn measure(c: &Fp8Case, got_o: &[f64], got_lse: &[f64], want: &RefOutput) -> Measured {
    let (mut lse_err, mut lse_excess, mut bad_empty_rows) = (0f64, 0f64, 0);
    let d = c.head_dim;
    for (i, (&g, &w)) in got_lse.iter().zip(&want.lse).enumerate() {
        if w == f64::NEG_INFINITY {
            // LSE index (b, h, row) -> O row (b, row, h).
            let (bh, row) = (i / c.seqlen_q, i % c.seqlen_q);
            let (b, h) = (bh / c.heads_q, bh % c.heads_q);
            let at = ((b * c.seqlen_q + row) * c.heads_q + h) * d;
            if g != w || got_o[at..at + d].iter().any(|&x| x != 0.0) {
                bad_empty_rows += 1;
            }
            continue;
        }
        let err = (g - w).abs();
        lse_err = lse_err.max(err);
        lse_excess = lse_excess.max(err / (LSE_ABS + LSE_REL * w.abs()));
        if err.is_nan() {
            lse_excess = f64::INFINITY;
        }
    }
    // With an outlier block, rows that see one of its keys and rows that do not (causal,
    // Sq > Sk) are measured apart: the first group's ×1000 values would hide the second's.
    let sees_outliers = |row: usize| {
        let last_key = if c.causal {
            (row + c.seqlen_k).checked_sub(c.seqlen_q)
        } else {
            Some(c.seqlen_k - 1)
        };
        c.keys == Keys::OutlierBlock && last_key.is_some_and(|j| j >= 128)
    };
    let shape = [c.batch, c.seqlen_q, c.heads_q, d];
    let groups = rel_l2_of_row_groups(got_o, &want.out, shape, sees_outliers);
    Measured {
        out_err: groups.into_iter().flatten().fold(0.0, worse),
        lse_err,
        lse_excess,
        bad_empty_rows,
    }
}

/// Runs `c` once on `attn` (whose path choice picks the kernel family, checked to be
/// `expect`) with fresh random inputs from `rng`, and measures it against the reference.
fn run_case(
    attn: &Attention,
    s: &Arc<CudaStream>,
    expect: Fp8Path,
    c: &Fp8Case,
    rng: &mut Rng,
) -> Measured {
    let shape = c.shape();
    let problem = Fp8Problem {
        shape,
        out: c.out,
        scale: c.scale() as f32,
        causal: c.causal,
    };
    let cfg = attn.plan_fp8(&problem).expect("an FP8-capable GPU");
    assert_eq!(cfg.path, expect, "{c}: the dispatch picked {}", cfg.id());

    let x = inputs(c, rng);
    let (q8, k8, vt8) = (up(s, &x.q.codes), up(s, &x.k.codes), up(s, &x.vt.codes));
    let scales = [&x.q.scales, &x.k.scales, &x.vt.scales].map(|v| up(s, v));
    let shift = x.lse_shift.as_ref().map(|v| up(s, v));
    let o = up(s, &vec![reference::poison(c.out); shape.q_len()]);
    let lse = up(s, &vec![f32::NAN; shape.lse_len()]);
    let (b, d) = (c.batch, c.head_dim);
    let ops = Fp8Operands {
        q: TensorView::bshd(ptr(s, &q8), DType::E4m3, b, c.seqlen_q, c.heads_q, d),
        k: TensorView::bshd(ptr(s, &k8), DType::E4m3, b, c.seqlen_k, c.heads_kv, d),
        vt: VtView::contiguous(ptr(s, &vt8), b, c.heads_kv, d, c.seqlen_k),
        q_scale: ptr(s, &scales[0]),
        k_scale: ptr(s, &scales[1]),
        v_scale: ptr(s, &scales[2]),
        lse_shift: shift.as_ref().map(|v| ptr(s, v)),
    };
    let o_view = TensorView::bshd(ptr(s, &o), DType::from(c.out), b, c.seqlen_q, c.heads_q, d);
    let params = AttentionParams {
        softmax_scale: None,
        causal: c.causal,
        ..Default::default()
    };
    // SAFETY: every view is a live allocation of this context with the extents given, and
    // the default stream orders the call before the downloads.
    unsafe {
        attn.forward_fp8(
            &ops,
            &o_view,
            Some(&LseView { ptr: ptr(s, &lse) }),
            &params,
            std::ptr::null_mut(),
        )
    }
    .unwrap_or_else(|e| panic!("{c}: {e}"));
    let got_o = half_bits_to_f64(&down(s, &o), c.out);
    let got_lse: Vec<f64> = down(s, &lse).iter().map(|&v| v as f64).collect();
    measure(c, &got_o, &got_lse, &expected(c, &x))
}

/// Runs every case with the kernel family `path` selects (which must be `expect`),
/// prints one line each, and fails listing every case out of bounds.
fn check_cases(path: PathChoice, expect: Fp8Path, cases: &[Fp8Case]) {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let stream = device.context().default_stream();
    let attn = Attention::new(device)
        .expect("an sm_80+ GPU")
        .with_path(path);
    let mut seeds = seeds();
    let mut failures = Vec::new();
    for c in cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let m = run_case(&attn, &stream, expect, c, &mut rng);
        let line = format!(
            "{c}: out {:.2e} lse {:.2e} empty rows wrong {} ({replay})",
            m.out_err, m.lse_err, m.bad_empty_rows
        );
        println!("{line}");
        if !m.passes() {
            failures.push(line);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases out of bounds (O {OUT_BOUND:.0e}, LSE {LSE_ABS:.0e} + {LSE_REL:.0e}·|lse|):\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Square and rectangular lengths, every head dim, causal and not, both outputs.
fn shapes() -> Vec<Fp8Case> {
    let lens = [
        (1, 1),
        (17, 17),
        (113, 113),
        (1023, 1023),
        (130, 300),
        (300, 17),
    ];
    let mut v = Vec::new();
    for (i, &l) in lens.iter().enumerate() {
        for d in HEAD_DIMS {
            for causal in [false, true] {
                let out = if i % 2 == 0 {
                    HalfType::F16
                } else {
                    HalfType::Bf16
                };
                v.push(Fp8Case {
                    causal,
                    ..Fp8Case::new(out, l, d)
                });
            }
        }
    }
    v
}

/// GQA 4:1 and 8:1 with batches, both outputs.
fn gqa() -> Vec<Fp8Case> {
    let mut v = Vec::new();
    for (hq, hkv) in [(8, 2), (8, 1)] {
        for (out, causal) in [(HalfType::F16, false), (HalfType::Bf16, true)] {
            v.push(Fp8Case {
                batch: 2,
                heads_q: hq,
                heads_kv: hkv,
                causal,
                ..Fp8Case::new(out, (300, 300), 128)
            });
        }
    }
    v
}

/// An outlier key block, a zero key block, and the LSE shift, with and without causal
/// masking (Sq > Sk makes rows that see nothing).
fn blocks_and_shift() -> Vec<Fp8Case> {
    let mut v = Vec::new();
    for d in HEAD_DIMS {
        for keys in [Keys::OutlierBlock, Keys::ZeroBlock] {
            for (lens, causal) in [((200, 400), true), ((400, 300), true), ((130, 300), false)] {
                v.push(Fp8Case {
                    causal,
                    lse_shift: true,
                    keys,
                    heads_q: 4,
                    heads_kv: 1,
                    ..Fp8Case::new(HalfType::Bf16, lens, d)
                });
            }
        }
    }
    v
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sm89_shapes() {
    check_cases(PathChoice::Sm80, Fp8Path::Sm89, &shapes());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sm89_gqa() {
    check_cases(PathChoice::Sm80, Fp8Path::Sm89, &gqa());
}

/// The measure [`measure`] applies to outlier cases can fail where a whole-output error
/// could not: rows 10% off beside rows 1000 times larger pass as one vector (about 1e-4)
/// and fail as their own group. (CPU only: it checks the measure, not a kernel.)
#[test]
fn outlier_rows_do_not_hide_the_other_rows_errors() {
    let (sq, row) = (8, 4);
    let want: Vec<f64> = (0..sq * row)
        .map(|i| if i / row < 4 { 1000.0 } else { 1.0 })
        .collect();
    let got: Vec<f64> = want
        .iter()
        .map(|&w| if w == 1.0 { 1.1 } else { w })
        .collect();
    assert!(rel_l2(&got, &want) < 1e-3);
    let [outliers, others] = rel_l2_of_row_groups(&got, &want, [1, sq, 1, row], |r| r < 4);
    assert_eq!(outliers, Some(0.0));
    assert!(others.is_some_and(|e| e > OUT_BOUND), "{others:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sm89_outlier_and_zero_blocks_with_lse_shift() {
    check_cases(PathChoice::Sm80, Fp8Path::Sm89, &blocks_and_shift());
}

/// Logits at the far end of the range (`fp8` module docs, "Range"). Q is all ones and key
/// `j` all `c_j`, so every row scores key 97 highest (`c = 1`, a logit of `scale · D`; the
/// others at most a quarter of that), and at these scales the softmax puts all weight on
/// it: O is V's row 97. On the sm89 kernel and, on Hopper, the sm90a one, head dims 64,
/// 128, 256, causal or not:
/// - the largest logit at 2^20 / log2 e: the running maximum's rounding (an ulp there is
///   1/8) already leaves the largest probability off 256, so its E4M3 rounding shows: O
///   within the module's 4e-2, the LSE within 1e-5;
/// - at 1.1 · 2^26 / log2 e: there a maximum rounded to nearest falls 3.6 log2 units
///   below the exact product (on both kernels' order of multiplications), which put the
///   largest probability at 2^11.6, past E4M3's 448; rounded up it is 2^3.6. Bounds as
///   above;
/// - a caller's scales of 2^60 for every block of Q and K with the default softmax scale
///   (the dequantization factor clamped): O finite, the LSE never NaN.
#[test]
#[ignore = "needs a CUDA GPU"]
fn extreme_logits_stay_finite_and_pick_the_top_key() {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let s = device.context().default_stream();
    let mut paths = vec![(PathChoice::Sm80, Fp8Path::Sm89)];
    if device.compute_capability() == (9, 0) {
        paths.push((PathChoice::Best, Fp8Path::Sm90));
    }
    let mut seeds = seeds();
    let (sq, sk, top) = (4usize, 300usize, 97usize);
    let log2e = std::f64::consts::LOG2_E;
    let mut failures = Vec::new();
    for (choice, expect) in paths {
        let attn = Attention::new(device.clone())
            .expect("an sm_80+ GPU")
            .with_path(choice);
        for d in HEAD_DIMS {
            for causal in [false, true] {
                let mut rng = seeds.next_case();
                let replay = seeds.replay(&rng);
                let c = Fp8Case {
                    heads_q: 1,
                    heads_kv: 1,
                    causal,
                    ..Fp8Case::new(HalfType::F16, (sq, sk), d)
                };
                let problem = Fp8Problem {
                    shape: c.shape(),
                    out: c.out,
                    scale: c.scale() as f32,
                    causal,
                };
                let cfg = attn.plan_fp8(&problem).expect("an FP8-capable GPU");
                assert_eq!(cfg.path, expect, "{c}: the dispatch picked {}", cfg.id());
                let q = vec![1f32; sq * d];
                let k: Vec<f32> = (0..sk)
                    .flat_map(|j| {
                        let cj = if j == top {
                            1.0
                        } else {
                            (j % 7) as f32 / 8.0 - 0.5
                        };
                        std::iter::repeat_n(cj, d)
                    })
                    .collect();
                let v: Vec<f32> = (0..sk * d).map(|_| rng.normal() as f32).collect();
                let (qs, ks) = ([1, sq, 1, d], [1, sk, 1, d]);
                let pitch = vt_min_pitch(sk as u64) as usize;
                let quantized = Inputs {
                    q: quantize_rows(&q, qs, Granularity::PerBlock),
                    k: quantize_rows(&k, ks, Granularity::PerBlock),
                    vt: quantize_vt(&v, ks, pitch, Granularity::PerBlock),
                    pitch,
                    lse_shift: None,
                };
                let mut callers = quantized.clone();
                callers.q.scales.fill(2f32.powi(60));
                callers.k.scales.fill(2f32.powi(60));
                // The scale that puts the largest logit (scale · D) at `l / log2 e`.
                let at = |l: f64| Some((l / (d as f64 * log2e)) as f32);
                for (name, x, scale, bound) in [
                    (
                        "logits 2^20",
                        &quantized,
                        at(2f64.powi(20)),
                        Some(OUT_BOUND),
                    ),
                    (
                        "logits 1.1·2^26",
                        &quantized,
                        at(1.1 * 2f64.powi(26)),
                        Some(OUT_BOUND),
                    ),
                    ("scales of 2^60", &callers, None, None),
                ] {
                    let up_all = |v: &Quantized| (up(&s, &v.codes), up(&s, &v.scales));
                    let (q8, qsc) = up_all(&x.q);
                    let (k8, ksc) = up_all(&x.k);
                    let (vt8, vsc) = up_all(&x.vt);
                    let o = up(&s, &vec![reference::poison(c.out); sq * d]);
                    let lse = up(&s, &vec![f32::NAN; sq]);
                    let ops = Fp8Operands {
                        q: TensorView::bshd(ptr(&s, &q8), DType::E4m3, 1, sq, 1, d),
                        k: TensorView::bshd(ptr(&s, &k8), DType::E4m3, 1, sk, 1, d),
                        vt: VtView::contiguous(ptr(&s, &vt8), 1, 1, d, sk),
                        q_scale: ptr(&s, &qsc),
                        k_scale: ptr(&s, &ksc),
                        v_scale: ptr(&s, &vsc),
                        lse_shift: None,
                    };
                    let o_view = TensorView::bshd(ptr(&s, &o), DType::F16, 1, sq, 1, d);
                    let params = AttentionParams {
                        softmax_scale: scale,
                        causal,
                        ..Default::default()
                    };
                    // SAFETY: every view is a live allocation of this context with the
                    // extents given; the default stream orders the call before the downloads.
                    unsafe {
                        attn.forward_fp8(
                            &ops,
                            &o_view,
                            Some(&LseView { ptr: ptr(&s, &lse) }),
                            &params,
                            std::ptr::null_mut(),
                        )
                    }
                    .unwrap_or_else(|e| panic!("{c} {name}: {e}"));
                    let got_o = half_bits_to_f64(&down(&s, &o), c.out);
                    let got_lse = down(&s, &lse);
                    let finite = got_o.iter().all(|x| x.is_finite());
                    let (ok, detail) = match bound {
                        Some(bound) => {
                            let want = attention_f64(
                                &c.shape(),
                                &dequantize_rows(&x.q, qs),
                                &dequantize_rows(&x.k, ks),
                                &dequantize_vt(&x.vt, ks, pitch),
                                scale.map_or(c.scale(), f64::from),
                                causal,
                            );
                            let err = rel_l2(&got_o, &want.out);
                            let lse_err = got_lse
                                .iter()
                                .zip(&want.lse)
                                .map(|(&g, &w)| ((g as f64 - w) / w).abs())
                                .fold(
                                    0f64,
                                    |a, e| if e.is_nan() { f64::INFINITY } else { a.max(e) },
                                );
                            let ok = finite && err <= bound && lse_err <= 1e-5;
                            (
                                ok,
                                format!("out {err:.2e} (bound {bound:.0e}), lse rel {lse_err:.1e}"),
                            )
                        }
                        None => {
                            let ok = finite && got_lse.iter().all(|x| !x.is_nan());
                            (ok, format!("o finite {finite}, lse {got_lse:?}"))
                        }
                    };
                    let line = format!("{} {c} {name}: {detail} ({replay})", expect.name());
                    println!("{line}");
                    if !ok {
                        failures.push(line);
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- the bounds, on the CPU ---------------------------------------------------------

/// The FP8 kernels' arithmetic on the CPU, key tile by key tile: scores from the codes,
/// dequantised inside the exponent with the running maximum in log2 units, probabilities
/// scaled by 2^8 and rounded to E4M3, each tile's `P8·V8` summed on its own and added
/// with its V scale, the row sum over the unrounded probabilities. Sums are exact (f64),
/// so this is the kernel without its hardware's rounding: what the bounds must admit.
fn cpu_model(c: &Fp8Case, x: &Inputs, block_n: usize) -> RefOutput {
    let s = c.shape();
    let (d, group) = (c.head_dim, c.heads_q / c.heads_kv);
    let blocks = |n: usize| n.div_ceil(128);
    let (qb, kb) = (blocks(c.seqlen_q), blocks(c.seqlen_k));
    let scale_log2 = c.scale() * std::f64::consts::LOG2_E;
    let mut out = vec![0f64; s.q_len()];
    let mut lse = vec![f64::NEG_INFINITY; s.lse_len()];
    for b in 0..c.batch {
        for h in 0..c.heads_q {
            let kh = h / group;
            for i in 0..c.seqlen_q {
                let visible = s.visible_keys(i, c.causal);
                let q_at = ((b * c.seqlen_q + i) * c.heads_q + h) * d;
                let q_scale = x.q.scales[(b * c.heads_q + h) * qb + i / 128] as f64;
                let (mut m, mut l, mut o) = (f64::NEG_INFINITY, 0f64, vec![0f64; d]);
                for first in (0..c.seqlen_k).step_by(block_n).rev() {
                    let keys = first..(first + block_n).min(c.seqlen_k);
                    let kv_scale = (b * c.heads_kv + kh) * kb + first / 128;
                    let k_scale = x.k.scales[kv_scale] as f64;
                    let v_scale = x.vt.scales[kv_scale] as f64;
                    let dequant = (q_scale * k_scale * scale_log2).max(f32::MIN_POSITIVE as f64);
                    let scores: Vec<f64> = keys
                        .clone()
                        .map(|j| {
                            if j >= visible {
                                return f64::NEG_INFINITY;
                            }
                            let k_at = ((b * c.seqlen_k + j) * c.heads_kv + kh) * d;
                            (0..d)
                                .map(|e| {
                                    e4m3_to_f32(x.q.codes[q_at + e]) as f64
                                        * e4m3_to_f32(x.k.codes[k_at + e]) as f64
                                })
                                .sum()
                        })
                        .collect();
                    let tile_max = scores.iter().fold(f64::NEG_INFINITY, |a, &s| a.max(s));
                    let new_m = m.max(tile_max * dequant);
                    let usable = if new_m == f64::NEG_INFINITY {
                        0.0
                    } else {
                        new_m
                    };
                    let rescale = (m - usable).exp2();
                    l *= rescale;
                    o.iter_mut().for_each(|v| *v *= rescale);
                    m = new_m;
                    let mut tile = vec![0f64; d];
                    for (j, &score) in keys.zip(&scores) {
                        let p = (score * dequant + P_SHIFT_LOG2 as f64 - usable).exp2();
                        l += p;
                        let p8 = e4m3_to_f32(e4m3_from_f32(p as f32)) as f64;
                        let vt_row = (b * c.heads_kv + kh) * d;
                        let pos = vt_position(j as u32) as usize;
                        for (e, t) in tile.iter_mut().enumerate() {
                            *t += p8 * e4m3_to_f32(x.vt.codes[(vt_row + e) * x.pitch + pos]) as f64;
                        }
                    }
                    for (o, t) in o.iter_mut().zip(&tile) {
                        *o += v_scale * t;
                    }
                }
                if l > 0.0 {
                    for (dst, v) in out[q_at..q_at + d].iter_mut().zip(&o) {
                        *dst = v / l;
                    }
                    let shift = x.lse_shift.as_ref().map_or(0.0, |s| {
                        c.scale() * s[(b * c.heads_q + h) * c.seqlen_q + i] as f64
                    });
                    let lse_at = (b * c.heads_q + h) * c.seqlen_q + i;
                    lse[lse_at] =
                        std::f64::consts::LN_2 * (m + l.log2() - P_SHIFT_LOG2 as f64) + shift;
                }
            }
        }
    }
    RefOutput { out, lse }
}

/// The bounds hold for the algorithm itself (the CPU model above, with the sm89 kernel's
/// 64- and 128-key tiles) on the shapes and key patterns the GPU tests use, with room to
/// spare, so a GPU failure means a kernel defect, not a bound too tight for FP8's P.
#[test]
fn sm89_bounds_admit_the_algorithm_cpu() {
    let mut seeds = flashcore::check::TestSeeds::new(0x5EED_00F8);
    let mut cases = vec![
        Fp8Case::new(HalfType::F16, (1, 300), 64),
        Fp8Case::new(HalfType::F16, (17, 17), 128),
        Fp8Case {
            causal: true,
            ..Fp8Case::new(HalfType::F16, (300, 17), 64)
        },
        Fp8Case {
            heads_q: 8,
            heads_kv: 2,
            causal: true,
            ..Fp8Case::new(HalfType::F16, (130, 300), 128)
        },
    ];
    for keys in [Keys::OutlierBlock, Keys::ZeroBlock] {
        cases.push(Fp8Case {
            keys,
            lse_shift: true,
            causal: true,
            ..Fp8Case::new(HalfType::F16, (200, 400), 64)
        });
    }
    for c in &cases {
        let mut rng = seeds.next_case();
        let x = inputs(c, &mut rng);
        let want = expected(c, &x);
        for block_n in [64, 128] {
            let got = cpu_model(c, &x, block_n);
            let m = measure(c, &got.out, &got.lse, &want);
            println!(
                "{c} block_n {block_n}: out {:.2e} lse {:.2e}",
                m.out_err, m.lse_err
            );
            assert!(m.passes(), "{c} block_n {block_n}: {m:?}");
            // Room to spare: P's rounding alone stays well inside the bound.
            assert!(m.out_err < 0.75 * OUT_BOUND, "{c}: {m:?}");
        }
    }
}
