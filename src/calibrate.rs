//! FP8 calibration: how far each way of computing attention lands from float64, on inputs
//! built to break FP8.
//!
//! One run draws every [`Distribution`] at each sequence length, computes attention with
//! every [`Method`] (our 16-bit kernel, and the FP8 kernel on operands quantized per tensor,
//! per block, per block with K smoothing, per block with the Hadamard rotation) and
//! compares each with a float64 reference on the same 16-bit inputs. The quantization runs
//! on the CPU ([`crate::quant`], bit for bit what the GPU quantizer writes, which
//! `tests/gpu_quantize.rs` checks): it is the only quantizer that also scales per tensor.
//! The attention runs on the GPU ([`run_gpu`]), or, without one, in [`fp8_model`]: the FP8
//! kernels' arithmetic on the CPU with exact sums.
//!
//! The reference costs `S` times more than one output row, so errors are measured on up to
//! `rows` query rows per head, spread evenly over the sequence (the first and the last
//! included); on the GPU every output element and LSE of every row is still checked to be
//! finite (the CPU model computes the sampled rows only, which are checked).
//!
//! What E4M3 itself allows: its 3 mantissa bits round each operand by about 2.4% RMS.
//! On zero-mean inputs the output is an average of V's rows, which shrinks the output and
//! its error alike, so V's rounding costs about 2.4–2.8% relative L2, P's about 2.4%, and
//! Q's and K's, through the scores, the most: with P and V left unrounded, [`fp8_model`]
//! still gives 3.9–4.0e-2 on normal inputs at S 512 and 2048 (5.4e-2 with all four
//! rounded). No choice of scales recovers bits that the format does not have.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

use crate::error::{Error, Result};
use crate::host::attention::Attention;
use crate::host::fp8::{Fp8Operands, VtView};
use crate::host::tensor::{AttentionParams, DType, LseView, TensorView};
use crate::kernels::attention::HalfType;
use crate::kernels::attention::fp8::{SCALE_BLOCK, max_dequant, vt_min_pitch, vt_position};
use crate::quant::{
    self, Granularity, HadamardSigns, Quantized, RowTransform, e4m3_from_f32, e4m3_to_f32,
};
use crate::reference::{Rng, f64_to_half_bits, half_bits_to_f64};
use crate::shape::AttnShape;

/// How the inputs are drawn. Every tensor is rounded to f16 afterwards: the reference,
/// the 16-bit kernel and the quantizer all see the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distribution {
    /// Q, K, V ~ N(0, 1).
    Normal,
    /// Q, K, V ~ U(−√3, √3) (unit variance).
    Uniform,
    /// Q, K, V ~ N(0, 1) + N(0, 10²)·Bernoulli(0.001): FlashAttention-3's outlier test.
    Outliers,
    /// Q, V ~ N(0, 1); K ~ N(0, 1) plus, on 4 channels of each head, a constant offset of
    /// ±(10 to 50): the per-channel offsets real models' keys carry.
    ChannelOffsets,
    /// Head `h`'s K and V times `f_h`, its Q divided by `f_h`, with `f_h` log-spaced over
    /// `[1/√1000, √1000]`: every head's scores are N(0, 1), its tensors 1000x apart.
    HeadScales,
    /// Q, K ~ N(0, 128²), V ~ N(0, 1): elements beyond E4M3's 448 and scores in the
    /// thousands (one-hot softmax), which overflow FP8 unless scaled.
    LargeScores,
}

impl Distribution {
    pub const ALL: [Distribution; 6] = [
        Distribution::Normal,
        Distribution::Uniform,
        Distribution::Outliers,
        Distribution::ChannelOffsets,
        Distribution::HeadScales,
        Distribution::LargeScores,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Distribution::Normal => "normal",
            Distribution::Uniform => "uniform",
            Distribution::Outliers => "outliers",
            Distribution::ChannelOffsets => "channel-offsets",
            Distribution::HeadScales => "head-scales",
            Distribution::LargeScores => "large-scores",
        }
    }
}

/// A way of computing attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// The 16-bit kernel on the f16 inputs.
    F16,
    /// FP8 with one scale per tensor (every block given the tensor's scale).
    Fp8PerTensor,
    /// FP8 with one scale per 128 rows of each (batch, head): flashcore's scheme.
    Fp8PerBlock,
    /// Per block, K's per-channel mean subtracted first (the LSE restored by `lse_shift`).
    Fp8Smooth,
    /// Per block, Q and K rotated by a random-sign Hadamard transform first.
    Fp8Hadamard,
}

impl Method {
    pub const ALL: [Method; 5] = [
        Method::F16,
        Method::Fp8PerTensor,
        Method::Fp8PerBlock,
        Method::Fp8Smooth,
        Method::Fp8Hadamard,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Method::F16 => "f16",
            Method::Fp8PerTensor => "fp8-tensor",
            Method::Fp8PerBlock => "fp8-block",
            Method::Fp8Smooth => "fp8-block+smooth",
            Method::Fp8Hadamard => "fp8-block+hadamard",
        }
    }

    /// The per-block FP8 methods.
    pub fn per_block(self) -> bool {
        matches!(
            self,
            Method::Fp8PerBlock | Method::Fp8Smooth | Method::Fp8Hadamard
        )
    }
}

/// The Hadamard signs' seed of [`Method::Fp8Hadamard`].
pub const HADAMARD_SEED: u64 = 0x5EED_4AD4;

/// Q, K, V as f32 (each exactly an f16), contiguous `[B, S, H, D]`.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub shape: AttnShape,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl Inputs {
    pub fn q_dims(&self) -> [usize; 4] {
        let s = &self.shape;
        [s.batch, s.seqlen_q, s.heads_q, s.head_dim]
    }

    pub fn kv_dims(&self) -> [usize; 4] {
        let s = &self.shape;
        [s.batch, s.seqlen_k, s.heads_kv, s.head_dim]
    }

    /// `1/√D`.
    pub fn scale(&self) -> f64 {
        1.0 / (self.shape.head_dim as f64).sqrt()
    }
}

/// Draws `dist` for `shape` ([`Distribution::HeadScales`] scales each KV head's K by its
/// factor and the query heads of its group by the inverse).
pub fn draw(dist: Distribution, shape: AttnShape, rng: &mut Rng) -> Inputs {
    let d = shape.head_dim;
    let (hq, hkv) = (shape.heads_q, shape.heads_kv);
    let to_f16 = |x: Vec<f64>| -> Vec<f32> {
        half_bits_to_f64(&f64_to_half_bits(&x, HalfType::F16), HalfType::F16)
            .into_iter()
            .map(|v| v as f32)
            .collect()
    };
    let normal = |rng: &mut Rng, n: usize| -> Vec<f64> { (0..n).map(|_| rng.normal()).collect() };
    let (nq, nkv) = (shape.q_len(), shape.kv_len());
    // (element index) -> head, in [B, S, H, D] order.
    let head_of = |i: usize, h: usize| (i / d) % h;
    let (q, k, v) = match dist {
        Distribution::Normal => (normal(rng, nq), normal(rng, nkv), normal(rng, nkv)),
        Distribution::Uniform => {
            let mut u = |n: usize| -> Vec<f64> {
                (0..n)
                    .map(|_| (2.0 * rng.uniform() - 1.0) * 3f64.sqrt())
                    .collect()
            };
            (u(nq), u(nkv), u(nkv))
        }
        Distribution::Outliers => {
            let mut x = |n: usize| -> Vec<f64> {
                (0..n)
                    .map(|_| {
                        let base = rng.normal();
                        let spike = rng.normal() * 10.0;
                        if rng.uniform() < 0.001 {
                            base + spike
                        } else {
                            base
                        }
                    })
                    .collect()
            };
            (x(nq), x(nkv), x(nkv))
        }
        Distribution::ChannelOffsets => {
            let mut offset = vec![0f64; hkv * d];
            for h in 0..hkv {
                for _ in 0..4 {
                    let c = (rng.next_u64() % d as u64) as usize;
                    let size = 10.0 + 40.0 * rng.uniform();
                    let sign = if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 };
                    offset[h * d + c] = sign * size;
                }
            }
            let q = normal(rng, nq);
            let k = (0..nkv)
                .map(|i| rng.normal() + offset[head_of(i, hkv) * d + i % d])
                .collect();
            (q, k, normal(rng, nkv))
        }
        Distribution::HeadScales => {
            let factor = |h: usize, heads: usize| -> f64 {
                let t = if heads > 1 {
                    h as f64 / (heads - 1) as f64
                } else {
                    0.5
                };
                10f64.powf(3.0 * t - 1.5)
            };
            let group = hq / hkv;
            let q = (0..nq)
                .map(|i| rng.normal() / factor(head_of(i, hq) / group, hkv))
                .collect();
            let kv = |rng: &mut Rng| -> Vec<f64> {
                (0..nkv)
                    .map(|i| rng.normal() * factor(head_of(i, hkv), hkv))
                    .collect()
            };
            let k = kv(rng);
            let v = kv(rng);
            (q, k, v)
        }
        Distribution::LargeScores => {
            let mut big = |n: usize| -> Vec<f64> { (0..n).map(|_| 128.0 * rng.normal()).collect() };
            let q = big(nq);
            let k = big(nkv);
            (q, k, normal(rng, nkv))
        }
    };
    Inputs {
        shape,
        q: to_f16(q),
        k: to_f16(k),
        v: to_f16(v),
    }
}

/// FP8 operands in host memory: what the kernel reads.
#[derive(Debug, Clone)]
pub struct HostFp8 {
    pub q: Quantized,
    pub k: Quantized,
    /// `Vᵀ8`, `[B, Hkv, D, pitch]` with keys permuted ([`vt_position`]).
    pub vt: Quantized,
    pub pitch: usize,
    /// `q · mean(K)` per query row, `[B, Hq, Sq]`, when K was smoothed.
    pub lse_shift: Option<Vec<f32>>,
}

/// Quantizes `x` as the FP8 `method` does (`None` for [`Method::F16`]).
pub fn quantize(x: &Inputs, method: Method) -> Option<HostFp8> {
    let granularity = match method {
        Method::F16 => return None,
        Method::Fp8PerTensor => Granularity::PerTensor,
        _ => Granularity::PerBlock,
    };
    let signs = (method == Method::Fp8Hadamard)
        .then(|| HadamardSigns::from_seed(HADAMARD_SEED, x.shape.head_dim));
    let mean = (method == Method::Fp8Smooth).then(|| quant::key_mean(&x.k, x.kv_dims()));
    let q = quant::quantize_rows_with(
        &x.q,
        x.q_dims(),
        granularity,
        RowTransform {
            mean: None,
            hadamard: signs.as_ref(),
        },
    );
    let k = quant::quantize_rows_with(
        &x.k,
        x.kv_dims(),
        granularity,
        RowTransform {
            mean: mean.as_deref(),
            hadamard: signs.as_ref(),
        },
    );
    let pitch = vt_min_pitch(x.shape.seqlen_k as u64) as usize;
    let vt = quant::quantize_vt(&x.v, x.kv_dims(), pitch, granularity);
    let lse_shift = mean
        .as_ref()
        .map(|m| quant::lse_shift(&x.q, x.q_dims(), m, x.shape.heads_kv));
    Some(HostFp8 {
        q,
        k,
        vt,
        pitch,
        lse_shift,
    })
}

/// Up to `max` query rows spread evenly over `0..seqlen`, the first and the last included.
pub fn sample_rows(seqlen: usize, max: usize) -> Vec<usize> {
    if seqlen <= max || max < 2 {
        return (0..seqlen.min(max.max(1))).collect();
    }
    let mut rows: Vec<usize> = (0..max).map(|i| i * (seqlen - 1) / (max - 1)).collect();
    rows.dedup();
    rows
}

/// Attention outputs on the sampled rows: `out` is `[B, Hq, rows, D]`, `lse` `[B, Hq, rows]`.
#[derive(Debug, Clone)]
pub struct RowOutputs {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
}

/// Runs `f(b, h, row index, row)` for every sampled row of every (batch, query head) on
/// all cores and gathers the `(out, lse)` results in `[B, Hq, rows]` order.
fn per_row<F>(shape: &AttnShape, rows: &[usize], f: F) -> RowOutputs
where
    F: Fn(usize, usize, usize) -> (Vec<f64>, f64) + Sync,
{
    let d = shape.head_dim;
    let jobs: Vec<(usize, usize, usize)> = (0..shape.batch)
        .flat_map(|b| (0..shape.heads_q).flat_map(move |h| rows.iter().map(move |&r| (b, h, r))))
        .collect();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(jobs.len().max(1));
    let chunk = jobs.len().div_ceil(threads).max(1);
    let mut out = vec![0f64; jobs.len() * d];
    let mut lse = vec![0f64; jobs.len()];
    std::thread::scope(|scope| {
        for ((job, o), l) in jobs
            .chunks(chunk)
            .zip(out.chunks_mut(chunk * d))
            .zip(lse.chunks_mut(chunk))
        {
            let f = &f;
            scope.spawn(move || {
                for (i, &(b, h, r)) in job.iter().enumerate() {
                    let (row, row_lse) = f(b, h, r);
                    o[i * d..(i + 1) * d].copy_from_slice(&row);
                    l[i] = row_lse;
                }
            });
        }
    });
    RowOutputs { out, lse }
}

/// The float64 softmax(QKᵀ/√D)·V of the sampled rows, non-causal.
pub fn reference(x: &Inputs, rows: &[usize]) -> RowOutputs {
    let s = x.shape;
    let (d, group) = (s.head_dim, s.heads_q / s.heads_kv);
    let scale = x.scale();
    per_row(&s, rows, |b, h, i| {
        let kh = h / group;
        let q = &x.q[((b * s.seqlen_q + i) * s.heads_q + h) * d..][..d];
        let scores: Vec<f64> = (0..s.seqlen_k)
            .map(|j| {
                let k = &x.k[((b * s.seqlen_k + j) * s.heads_kv + kh) * d..][..d];
                scale
                    * q.iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
            })
            .collect();
        let m = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
        let mut o = vec![0f64; d];
        let mut l = 0f64;
        for (j, &sc) in scores.iter().enumerate() {
            let p = (sc - m).exp();
            l += p;
            let v = &x.v[((b * s.seqlen_k + j) * s.heads_kv + kh) * d..][..d];
            o.iter_mut().zip(v).for_each(|(o, &v)| *o += p * v as f64);
        }
        o.iter_mut().for_each(|o| *o /= l);
        (o, m + l.ln())
    })
}

/// The exponent offset of the FP8 kernels' probabilities: `p ∈ [0, 2^8]` before rounding
/// to E4M3, so the small ones keep their mantissa bits.
const P_SHIFT_LOG2: f64 = 8.0;

/// The FP8 kernels' arithmetic on the sampled rows, with exact (f64) sums, key tiles of
/// `block_n` keys walked last tile first as the kernels walk them: each tile's scores from the codes, dequantised in the exponent with the
/// running maximum in log2 units, probabilities scaled by 2^8 and rounded to E4M3, each
/// tile's `P8·V8` summed on its own and added with the tile's V scale, the row sum over
/// the unrounded probabilities.
pub fn fp8_model(x: &Inputs, f: &HostFp8, rows: &[usize], block_n: usize) -> RowOutputs {
    let s = x.shape;
    let (d, group) = (s.head_dim, s.heads_q / s.heads_kv);
    let blocks = |n: usize| n.div_ceil(SCALE_BLOCK as usize);
    let (qb, kb) = (blocks(s.seqlen_q), blocks(s.seqlen_k));
    let scale = x.scale();
    let scale_log2 = scale * std::f64::consts::LOG2_E;
    per_row(&s, rows, |b, h, i| {
        let kh = h / group;
        let q_at = ((b * s.seqlen_q + i) * s.heads_q + h) * d;
        let q_scale = f.q.scales[(b * s.heads_q + h) * qb + i / SCALE_BLOCK as usize] as f64;
        let (mut m, mut l, mut o) = (f64::NEG_INFINITY, 0f64, vec![0f64; d]);
        for first in (0..s.seqlen_k).step_by(block_n).rev() {
            let keys = first..(first + block_n).min(s.seqlen_k);
            let kv_block = (b * s.heads_kv + kh) * kb + first / SCALE_BLOCK as usize;
            let k_scale = f.k.scales[kv_block] as f64;
            let v_scale = f.vt.scales[kv_block] as f64;
            let dequant = (q_scale * k_scale * scale_log2)
                .clamp(f32::MIN_POSITIVE as f64, max_dequant(d as u32) as f64);
            let scores: Vec<f64> = keys
                .clone()
                .map(|j| {
                    let k_at = ((b * s.seqlen_k + j) * s.heads_kv + kh) * d;
                    (0..d)
                        .map(|e| {
                            e4m3_to_f32(f.q.codes[q_at + e]) as f64
                                * e4m3_to_f32(f.k.codes[k_at + e]) as f64
                        })
                        .sum()
                })
                .collect();
            let tile_max = scores.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
            let new_m = m.max(tile_max * dequant);
            let rescale = (m - new_m).exp2();
            l *= rescale;
            o.iter_mut().for_each(|v| *v *= rescale);
            m = new_m;
            let mut tile = vec![0f64; d];
            let vt_row = (b * s.heads_kv + kh) * d;
            for (j, &score) in keys.zip(&scores) {
                let p = (score * dequant + P_SHIFT_LOG2 - m).exp2();
                l += p;
                let p8 = e4m3_to_f32(e4m3_from_f32(p as f32)) as f64;
                let pos = vt_position(j as u32) as usize;
                for (e, t) in tile.iter_mut().enumerate() {
                    *t += p8 * e4m3_to_f32(f.vt.codes[(vt_row + e) * f.pitch + pos]) as f64;
                }
            }
            o.iter_mut().zip(&tile).for_each(|(o, t)| *o += v_scale * t);
        }
        o.iter_mut().for_each(|v| *v /= l);
        let shift = f.lse_shift.as_ref().map_or(0.0, |sh| {
            scale * sh[(b * s.heads_q + h) * s.seqlen_q + i] as f64
        });
        let lse = std::f64::consts::LN_2 * (m + l.log2() - P_SHIFT_LOG2) + shift;
        (o, lse)
    })
}

/// A method's output against the reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Measured {
    pub rmse: f64,
    pub rel_l2: f64,
    /// The largest relative L2 error of one (batch, head)'s rows.
    pub worst_head_rel_l2: f64,
    /// The largest log-sum-exp error.
    pub lse_max_abs: f64,
    /// Output elements (all rows, not only the sampled ones) and LSE entries that are
    /// NaN or infinite.
    pub nonfinite: usize,
}

/// Compares the sampled rows `got` with `want`. `nonfinite` is what the caller counted
/// over the whole output and LSE (the GPU run's every row; 0 where only the sampled rows
/// exist): the record's count is the larger of it and the sampled rows' own. A sampled
/// value that is NaN or infinite makes every error measure NaN (`null` in the JSON, and
/// no target met by it), rather than leaving the value out of the sums.
pub fn measure(
    shape: &AttnShape,
    got: &RowOutputs,
    want: &RowOutputs,
    nonfinite: usize,
) -> Measured {
    let d = shape.head_dim;
    let per_head = want.out.len() / (shape.batch * shape.heads_q).max(1);
    let sampled_bad = got
        .out
        .iter()
        .chain(&got.lse)
        .filter(|v| !v.is_finite())
        .count();
    let (mut err2, mut ref2) = (0f64, 0f64);
    let mut worst = 0f64;
    for (g, w) in got
        .out
        .chunks(per_head.max(1))
        .zip(want.out.chunks(per_head.max(1)))
    {
        let (mut e, mut r) = (0f64, 0f64);
        for (&a, &b) in g.iter().zip(w) {
            e += (a - b) * (a - b);
            r += b * b;
        }
        err2 += e;
        ref2 += r;
        if r > 0.0 {
            worst = worst.max((e / r).sqrt());
        }
    }
    let lse_max_abs = got
        .lse
        .iter()
        .zip(&want.lse)
        .map(|(&a, &b)| (a - b).abs())
        .fold(0f64, f64::max);
    let n = want.out.len().max(1);
    debug_assert!(n.is_multiple_of(d));
    let poisoned = |x: f64| if sampled_bad > 0 { f64::NAN } else { x };
    Measured {
        rmse: poisoned((err2 / n as f64).sqrt()),
        rel_l2: poisoned(if ref2 > 0.0 {
            (err2 / ref2).sqrt()
        } else {
            0.0
        }),
        worst_head_rel_l2: poisoned(worst),
        lse_max_abs: poisoned(lse_max_abs),
        nonfinite: nonfinite.max(sampled_bad),
    }
}

fn driver(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Driver {
        call,
        code: format!("{e:?}"),
    }
}

fn upload<T: DeviceRepr>(s: &Arc<CudaStream>, x: &[T]) -> Result<CudaSlice<T>> {
    s.clone_htod(x).map_err(driver("cuMemcpyHtoD"))
}

fn address<T>(s: &Arc<CudaStream>, x: &CudaSlice<T>) -> u64 {
    x.device_ptr(s).0
}

fn download<T: DeviceRepr + ValidAsZeroBits + Default + Clone>(
    s: &Arc<CudaStream>,
    x: &CudaSlice<T>,
) -> Result<Vec<T>> {
    let v = s.clone_dtoh(x).map_err(driver("cuMemcpyDtoH"))?;
    s.synchronize().map_err(driver("cuStreamSynchronize"))?;
    Ok(v)
}

/// Runs `method` on the GPU (FP8 methods on `fp8`, the operands [`quantize`] made) with f16
/// output, and returns the sampled rows and the number of non-finite values in the whole
/// output and LSE. The output starts as NaN, so an unwritten element counts as non-finite.
pub fn run_gpu(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    x: &Inputs,
    fp8: Option<&HostFp8>,
    rows: &[usize],
) -> Result<(RowOutputs, usize)> {
    let s = x.shape;
    let (b, d) = (s.batch, s.head_dim);
    let o = upload(stream, &vec![0x7FFFu16; s.q_len()])?;
    let lse = upload(stream, &vec![f32::NAN; s.lse_len()])?;
    let ov = TensorView::bshd(address(stream, &o), DType::F16, b, s.seqlen_q, s.heads_q, d);
    let lv = LseView {
        ptr: address(stream, &lse),
    };
    let params = AttentionParams {
        softmax_scale: Some(x.scale() as f32),
        causal: false,
        ..Default::default()
    };
    let cu = stream.cu_stream();
    match fp8 {
        None => {
            let bits = |v: &[f32]| -> Vec<u16> {
                v.iter()
                    .map(|&x| half::f16::from_f32(x).to_bits())
                    .collect()
            };
            let (q, k, v) = (
                upload(stream, &bits(&x.q))?,
                upload(stream, &bits(&x.k))?,
                upload(stream, &bits(&x.v))?,
            );
            let view = |p: &CudaSlice<u16>, seq: usize, heads: usize| {
                TensorView::bshd(address(stream, p), DType::F16, b, seq, heads, d)
            };
            // SAFETY: every view describes a live allocation of this stream's context of
            // exactly the view's extent; the stream is the context's.
            unsafe {
                attn.forward(
                    &view(&q, s.seqlen_q, s.heads_q),
                    &view(&k, s.seqlen_k, s.heads_kv),
                    &view(&v, s.seqlen_k, s.heads_kv),
                    &ov,
                    Some(&lv),
                    &params,
                    cu,
                )?;
            }
        }
        Some(f) => {
            let (q, k, vt) = (
                upload(stream, &f.q.codes)?,
                upload(stream, &f.k.codes)?,
                upload(stream, &f.vt.codes)?,
            );
            let (qs, ks, vs) = (
                upload(stream, &f.q.scales)?,
                upload(stream, &f.k.scales)?,
                upload(stream, &f.vt.scales)?,
            );
            let shift = match &f.lse_shift {
                Some(v) => Some(upload(stream, v)?),
                None => None,
            };
            let ops = Fp8Operands {
                q: TensorView::bshd(
                    address(stream, &q),
                    DType::E4m3,
                    b,
                    s.seqlen_q,
                    s.heads_q,
                    d,
                ),
                k: TensorView::bshd(
                    address(stream, &k),
                    DType::E4m3,
                    b,
                    s.seqlen_k,
                    s.heads_kv,
                    d,
                ),
                vt: VtView {
                    ptr: address(stream, &vt),
                    batch: b,
                    heads: s.heads_kv,
                    head_dim: d,
                    seqlen: s.seqlen_k,
                    strides: [s.heads_kv * d * f.pitch, d * f.pitch, f.pitch],
                },
                q_scale: address(stream, &qs),
                k_scale: address(stream, &ks),
                v_scale: address(stream, &vs),
                lse_shift: shift.as_ref().map(|p| address(stream, p)),
            };
            // SAFETY: as above: every pointer is a live allocation of this context sized
            // by the operands' shapes (Vᵀ with its pitch, scales [B, H, blocks]).
            unsafe { attn.forward_fp8(&ops, &ov, Some(&lv), &params, cu)? };
            stream
                .synchronize()
                .map_err(driver("cuStreamSynchronize"))?;
        }
    }
    let o_bits = download(stream, &o)?;
    let lse_all = download(stream, &lse)?;
    let nonfinite = o_bits.iter().filter(|&&h| h & 0x7C00 == 0x7C00).count()
        + lse_all.iter().filter(|v| !v.is_finite()).count();
    let mut out = Vec::with_capacity(b * s.heads_q * rows.len() * d);
    let mut row_lse = Vec::with_capacity(b * s.heads_q * rows.len());
    for bi in 0..b {
        for h in 0..s.heads_q {
            for &i in rows {
                let at = ((bi * s.seqlen_q + i) * s.heads_q + h) * d;
                out.extend(
                    o_bits[at..at + d]
                        .iter()
                        .map(|&h| half::f16::from_bits(h).to_f64()),
                );
                row_lse.push(lse_all[(bi * s.heads_q + h) * s.seqlen_q + i] as f64);
            }
        }
    }
    Ok((RowOutputs { out, lse: row_lse }, nonfinite))
}

/// One (distribution, length, method) result.
#[derive(Debug, Clone, Copy)]
pub struct Record {
    pub dist: Distribution,
    pub seqlen: usize,
    pub method: Method,
    pub measured: Measured,
}

/// One of the targets, evaluated on a run's records.
#[derive(Debug, Clone)]
pub struct Verdict {
    pub target: &'static str,
    /// `None` where the records hold nothing the target is judged on (its input or a
    /// method it compares was not run).
    pub met: Option<bool>,
    pub detail: String,
}

fn find(
    records: &[Record],
    dist: Distribution,
    seqlen: usize,
    method: Method,
) -> Option<&Measured> {
    records
        .iter()
        .find(|r| r.dist == dist && r.seqlen == seqlen && r.method == method)
        .map(|r| &r.measured)
}

/// The calibration targets on `records`: no NaN or Inf anywhere; per block at most half
/// per tensor's RMSE on the outlier and channel-offset inputs (plain per-block, and the
/// best per-block variant); per-block with either option (the better of K smoothing and
/// the Hadamard rotation) at most 9e-3 RMSE on the outlier input; every per-block variant's relative
/// L2 at most 3e-2 on normal inputs. Each at every length run; a target whose input or
/// methods were not run is not judged (`met: None`).
pub fn verdicts(records: &[Record]) -> Vec<Verdict> {
    let mut seqlens: Vec<usize> = records.iter().map(|r| r.seqlen).collect();
    seqlens.sort_unstable();
    seqlens.dedup();
    let mut out = Vec::new();
    let bad: Vec<String> = records
        .iter()
        .filter(|r| r.measured.nonfinite > 0)
        .map(|r| {
            format!(
                "{} S{} {}: {}",
                r.dist.name(),
                r.seqlen,
                r.method.name(),
                r.measured.nonfinite
            )
        })
        .collect();
    out.push(Verdict {
        target: "no NaN or Inf, any input, any method",
        met: Some(bad.is_empty()),
        detail: if bad.is_empty() {
            format!("{} runs, all finite", records.len())
        } else {
            bad.join("; ")
        },
    });
    let block_variants = [Method::Fp8PerBlock, Method::Fp8Smooth, Method::Fp8Hadamard];
    for (dist, label_plain, label_best) in [
        (
            Distribution::Outliers,
            "outliers: fp8-block RMSE <= 0.5x fp8-tensor",
            "outliers: best per-block variant RMSE <= 0.5x fp8-tensor",
        ),
        (
            Distribution::ChannelOffsets,
            "channel offsets: fp8-block RMSE <= 0.5x fp8-tensor",
            "channel offsets: best per-block variant RMSE <= 0.5x fp8-tensor",
        ),
    ] {
        let (mut plain_ok, mut best_ok) = (true, true);
        let (mut plain, mut best) = (Vec::new(), Vec::new());
        for &s in &seqlens {
            let Some(tensor) = find(records, dist, s, Method::Fp8PerTensor) else {
                continue;
            };
            if let Some(m) = find(records, dist, s, Method::Fp8PerBlock) {
                let r = m.rmse / tensor.rmse;
                plain_ok &= r <= 0.5;
                plain.push(format!("S{s} {r:.2}x"));
            }
            let best_m = block_variants
                .iter()
                .filter_map(|&m| find(records, dist, s, m).map(|x| (m, x.rmse)))
                .min_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((m, rmse)) = best_m {
                let r = rmse / tensor.rmse;
                best_ok &= r <= 0.5;
                best.push(format!("S{s} {r:.2}x ({})", m.name()));
            }
        }
        out.push(Verdict {
            target: label_plain,
            met: (!plain.is_empty()).then_some(plain_ok),
            detail: plain.join(", "),
        });
        out.push(Verdict {
            target: label_best,
            met: (!best.is_empty()).then_some(best_ok),
            detail: best.join(", "),
        });
    }
    // Per block with either option: the better of the two at each length (issue 9's
    // 9e-3; FlashAttention-3's 9.1e-3 is per block with the Hadamard rotation).
    let mut ok = true;
    let mut best = Vec::new();
    for &s in &seqlens {
        let got = [Method::Fp8Smooth, Method::Fp8Hadamard]
            .iter()
            .filter_map(|&m| find(records, Distribution::Outliers, s, m).map(|x| (m, x.rmse)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some((m, rmse)) = got {
            ok &= rmse <= 9e-3;
            best.push(format!("S{s} {rmse:.2e} ({})", m.name()));
        }
    }
    out.push(Verdict {
        target: "outliers: per-block with either option (the better of smoothing, Hadamard) RMSE <= 9e-3",
        met: (!best.is_empty()).then_some(ok),
        detail: best.join(", "),
    });
    let mut ok = true;
    let mut worst = Vec::new();
    for &s in &seqlens {
        let got: Vec<f64> = block_variants
            .iter()
            .filter_map(|&m| find(records, Distribution::Normal, s, m).map(|x| x.rel_l2))
            .collect();
        if got.is_empty() {
            continue;
        }
        // A NaN (a non-finite output) is the worst of all and meets no limit.
        let w = got
            .iter()
            .copied()
            .fold(0f64, |a, b| if b.is_nan() || b > a { b } else { a });
        ok &= got.iter().all(|&v| v <= 3e-2);
        worst.push(format!("S{s} worst {w:.2e}"));
    }
    out.push(Verdict {
        target: "normal: every per-block variant relative L2 <= 3e-2",
        met: (!worst.is_empty()).then_some(ok),
        detail: worst.join(", "),
    });
    out
}

/// The records as a table: one line per (distribution, length), RMSE and relative L2 per
/// method.
pub fn table(records: &[Record]) -> String {
    let mut methods: Vec<Method> = Vec::new();
    for r in records {
        if !methods.contains(&r.method) {
            methods.push(r.method);
        }
    }
    let mut s = format!("{:<16} {:>6}", "input", "S");
    for m in &methods {
        s += &format!(" | {:>19}", m.name());
    }
    s += &format!("\n{:<16} {:>6}", "", "");
    for _ in &methods {
        s += &format!(" | {:>9} {:>9}", "RMSE", "rel L2");
    }
    s.push('\n');
    let mut keys: Vec<(Distribution, usize)> = Vec::new();
    for r in records {
        if !keys.contains(&(r.dist, r.seqlen)) {
            keys.push((r.dist, r.seqlen));
        }
    }
    for (dist, seqlen) in keys {
        s += &format!("{:<16} {:>6}", dist.name(), seqlen);
        for &m in &methods {
            match find(records, dist, seqlen, m) {
                Some(x) if x.nonfinite > 0 => {
                    s += &format!(" | {:>19}", format!("{} NaN/Inf", x.nonfinite))
                }
                Some(x) => s += &format!(" | {:>9.2e} {:>9.2e}", x.rmse, x.rel_l2),
                None => s += &format!(" | {:>19}", "-"),
            }
        }
        s.push('\n');
    }
    s
}

/// The records and verdicts as JSON.
pub fn json(records: &[Record], verdicts: &[Verdict], context: &str) -> String {
    let num = |x: f64| {
        if x.is_finite() {
            format!("{x:e}")
        } else {
            "null".to_string()
        }
    };
    let escape = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"");
    let rows: Vec<String> = records
        .iter()
        .map(|r| {
            let m = &r.measured;
            format!(
                "    {{\"input\": \"{}\", \"seqlen\": {}, \"method\": \"{}\", \"rmse\": {}, \
                 \"rel_l2\": {}, \"worst_head_rel_l2\": {}, \"lse_max_abs\": {}, \"nonfinite\": {}}}",
                r.dist.name(),
                r.seqlen,
                r.method.name(),
                num(m.rmse),
                num(m.rel_l2),
                num(m.worst_head_rel_l2),
                num(m.lse_max_abs),
                m.nonfinite
            )
        })
        .collect();
    let targets: Vec<String> = verdicts
        .iter()
        .map(|v| {
            format!(
                "    {{\"target\": \"{}\", \"met\": {}, \"detail\": \"{}\"}}",
                escape(v.target),
                v.met.map_or("null".to_string(), |m| m.to_string()),
                escape(&v.detail)
            )
        })
        .collect();
    format!(
        "{{\n  \"context\": \"{}\",\n  \"results\": [\n{}\n  ],\n  \"targets\": [\n{}\n  ]\n}}\n",
        escape(context),
        rows.join(",\n"),
        targets.join(",\n")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(s: usize, h: usize, d: usize) -> AttnShape {
        AttnShape {
            batch: 1,
            seqlen_q: s,
            seqlen_k: s,
            heads_q: h,
            heads_kv: h,
            head_dim: d,
        }
    }

    #[test]
    fn sampled_rows_cover_both_ends() {
        assert_eq!(sample_rows(5, 8), vec![0, 1, 2, 3, 4]);
        let r = sample_rows(16384, 512);
        assert_eq!((r[0], *r.last().unwrap(), r.len()), (0, 16383, 512));
        assert!(r.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn inputs_are_what_they_claim() {
        let mut rng = Rng::new(7);
        let s = shape(256, 4, 64);
        let x = draw(Distribution::LargeScores, s, &mut rng);
        let amax = x.q.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            amax > 448.0,
            "large scores must overflow E4M3 unscaled: {amax}"
        );
        let x = draw(Distribution::HeadScales, s, &mut rng);
        let head_amax = |h: usize| {
            x.k.chunks(64)
                .enumerate()
                .filter(|(i, _)| i % 4 == h)
                .flat_map(|(_, r)| r)
                .fold(0f32, |m, v| m.max(v.abs()))
        };
        assert!(head_amax(3) / head_amax(0) > 300.0);
        let x = draw(Distribution::ChannelOffsets, s, &mut rng);
        let mean = quant::key_mean(&x.k, x.kv_dims());
        assert!(mean.iter().any(|m| m.abs() > 9.0));
        let x = draw(Distribution::Outliers, s, &mut rng);
        assert!(x.v.iter().any(|v| v.abs() > 6.0));
    }

    /// The model is the reference up to FP8 rounding: on normal inputs it lands within
    /// what E4M3 allows, on every method.
    #[test]
    fn fp8_model_tracks_the_reference() {
        let mut rng = Rng::new(11);
        let x = draw(Distribution::Normal, shape(300, 2, 64), &mut rng);
        let rows = sample_rows(300, 64);
        let want = reference(&x, &rows);
        for method in &Method::ALL[1..] {
            let f = quantize(&x, *method).unwrap();
            let got = fp8_model(&x, &f, &rows, 128);
            let m = measure(&x.shape, &got, &want, 0);
            assert!(m.rel_l2 < 0.07, "{method:?}: {m:?}");
            assert!(m.lse_max_abs < 0.05, "{method:?}: {m:?}");
        }
    }

    /// Named regression: an earlier FP8 prototype (one scale per head) gave NaN at S=512.
    /// The scheme, run as the kernels run it, stays finite there on every input.
    #[test]
    fn fp8_s512_nan_regression_cpu() {
        let mut rng = Rng::new(512);
        let rows = sample_rows(512, 48);
        for dist in Distribution::ALL {
            let x = draw(dist, shape(512, 2, 128), &mut rng);
            let want = reference(&x, &rows);
            for method in &Method::ALL[1..] {
                let f = quantize(&x, *method).unwrap();
                let got = fp8_model(&x, &f, &rows, 128);
                let m = measure(&x.shape, &got, &want, 0);
                assert_eq!(m.nonfinite, 0, "{dist:?} {method:?}");
                assert!(got.lse.iter().all(|v| v.is_finite()), "{dist:?} {method:?}");
            }
        }
    }

    #[test]
    fn verdicts_read_the_records() {
        let m = |rmse: f64, rel_l2: f64| Measured {
            rmse,
            rel_l2,
            worst_head_rel_l2: rel_l2,
            lse_max_abs: 0.0,
            nonfinite: 0,
        };
        let rec = |dist, method, x| Record {
            dist,
            seqlen: 512,
            method,
            measured: x,
        };
        let mut records = vec![
            rec(Distribution::Outliers, Method::Fp8PerTensor, m(2e-2, 0.1)),
            rec(Distribution::Outliers, Method::Fp8PerBlock, m(8e-3, 0.05)),
            rec(Distribution::Normal, Method::Fp8PerBlock, m(1e-3, 0.04)),
        ];
        let v = verdicts(&records);
        let get = |v: &[Verdict], t: &str| v.iter().find(|x| x.target.starts_with(t)).unwrap().met;
        assert_eq!(get(&v, "no NaN"), Some(true));
        assert_eq!(get(&v, "outliers: fp8-block RMSE"), Some(true));
        assert_eq!(get(&v, "normal: every per-block"), Some(false));
        // No option variant was run: that target is not judged, in the JSON too.
        assert_eq!(get(&v, "outliers: per-block with either option"), None);
        assert!(json(&records, &v, "unit").contains("\"met\": null"));
        records.push(rec(
            Distribution::Outliers,
            Method::Fp8Smooth,
            m(1.2e-2, 0.05),
        ));
        records.push(rec(
            Distribution::Outliers,
            Method::Fp8Hadamard,
            m(7e-3, 0.05),
        ));
        let v = verdicts(&records);
        // The better option (here the rotation) meets it.
        assert_eq!(
            get(&v, "outliers: per-block with either option"),
            Some(true)
        );
        records[1].measured.nonfinite = 3;
        records[1].measured.rmse = 1.5e-2;
        // A non-finite output's error is NaN: it meets no limit, nor is it the better.
        records[4].measured.rmse = f64::NAN;
        let v = verdicts(&records);
        assert_eq!(get(&v, "no NaN"), Some(false));
        assert_eq!(get(&v, "outliers: fp8-block RMSE"), Some(false));
        assert_eq!(
            get(&v, "outliers: per-block with either option"),
            Some(false)
        );
        assert!(json(&records, &v, "unit").contains("\"met\": false"));
    }

    /// A sampled value that is NaN or infinite poisons every error measure (it used to be
    /// left out of the sums, so an all-NaN output measured an error of 0), and is counted
    /// once with the caller's count over the whole output.
    #[test]
    fn nonfinite_outputs_measure_as_nan() {
        let x = draw(Distribution::Normal, shape(64, 1, 64), &mut Rng::new(7));
        let rows = sample_rows(64, 4);
        let want = reference(&x, &rows);
        let mut got = want.clone();
        assert_eq!(measure(&x.shape, &got, &want, 0).rmse, 0.0);
        got.out.iter_mut().for_each(|v| *v = f64::NAN);
        let m = measure(&x.shape, &got, &want, 0);
        assert!(m.rmse.is_nan() && m.rel_l2.is_nan() && m.worst_head_rel_l2.is_nan());
        assert_eq!(m.nonfinite, got.out.len());
        // The caller's count covers these same values (and more rows): not added twice.
        assert_eq!(
            measure(&x.shape, &got, &want, got.out.len() + 5).nonfinite,
            got.out.len() + 5
        );
        let mut got = want.clone();
        got.lse[0] = f64::INFINITY;
        let m = measure(&x.shape, &got, &want, 0);
        assert!(m.lse_max_abs.is_nan() && m.nonfinite == 1);
    }
}
