//! E4M3 quantization on the CPU, bit for bit what the GPU quantizer produces (but for
//! the Hadamard rotation on Hopper, summed on the tensor cores: see
//! [`crate::kernels::quantize_sm90`]): the reference its tests compare against, and the
//! calibration suite's simulator.
//!
//! Layouts and scale semantics are those of [`crate::kernels::attention::fp8`]: one f32
//! scale per block of [`SCALE_BLOCK`] rows of one (batch, head), `scale = amax / 448`
//! and `e4m3 = rn_satfinite(x · (448 / amax))`; a block whose `448 / amax` is not finite
//! (all zeros, or too small to scale) gets scale 1 and all-zero codes. The amax is over
//! the block's finite elements; an infinity or NaN gets the NaN code (0x7F), so it
//! reaches the outputs that read it as it would in 16-bit attention, and the rest of its
//! block keeps its precision.
//!
//! # Options (each leaves `softmax(Q Kᵀ) V` unchanged)
//!
//! - K smoothing: K's per-channel mean over the sequence ([`key_mean`], f32 `[B, Hkv,
//!   D]`) is subtracted from every row of K before it is quantized (SageAttention). The
//!   scores of query `q` all move by `q · mean`, which the softmax ignores but the
//!   log-sum-exp does not: [`lse_shift`] (f32 `[B, Hq, Sq]`, from the unrotated `q`) is
//!   what the attention adds back, times the softmax scale.
//! - Incoherent processing: every row of Q and K becomes `H · diag(s) · x / sqrt(D)`,
//!   `H` the Sylvester-ordered Walsh-Hadamard matrix and `s` random signs from a seed
//!   ([`HadamardSigns`]). The rotation is orthogonal, so `q' · k' = q · k`, and it spreads
//!   an outlier channel over all of them before the block's amax is taken.
//!
//! K smoothing subtracts the mean first, then rotates. [`transform_rows`] computes both
//! in f32 in exactly the sm_89 GPU quantizer's order of operations, so given the same mean
//! the codes agree bit for bit; only [`key_mean`] (a sum over the sequence, whose order
//! the GPU's atomics do not fix) and the rounding of the mean itself can differ. Hopper's
//! rotation sums in another order (and subtracts the rotated mean after rotating): its
//! values agree to f32 rounding, and a code can differ by one step where a value lies that
//! close to a boundary.

use crate::kernels::attention::fp8::{E4M3_MAX, SCALE_BLOCK, VT_KEY_ORDER, vt_min_pitch};

/// The E4M3 code of `x`: round to nearest even, saturating to ±448 (`cvt.rn.satfinite`);
/// NaN gives 0x7F.
pub fn e4m3_from_f32(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Values are m · 2^(e−7)·… : find the quantum of a's binade (subnormals: 2^-9).
    let exp = if a < f32::MIN_POSITIVE {
        -127
    } else {
        ((a.to_bits() >> 23) as i32) - 127
    };
    let quantum_exp = exp.max(-6) - 3;
    let quantum = f64::powi(2.0, quantum_exp);
    let q = a as f64 / quantum;
    // Round half to even.
    let mut n = q.floor();
    let frac = q - n;
    if frac > 0.5 || (frac == 0.5 && (n as u64) % 2 == 1) {
        n += 1.0;
    }
    let v = n * quantum;
    if v >= E4M3_MAX as f64 {
        return sign | 0x7E;
    }
    if v == 0.0 {
        return sign;
    }
    // Encode v exactly.
    let vb = (v as f32).to_bits();
    let e = ((vb >> 23) as i32) - 127;
    if e < -6 {
        // Subnormal: mantissa = v / 2^-9.
        return sign | (v / f64::powi(2.0, -9)) as u8;
    }
    let mant = ((vb >> 20) & 0x7) as u8;
    sign | (((e + 7) as u8) << 3) | mant
}

/// The value of an E4M3 code (0x7F and 0xFF are NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * f32::powi(2.0, -9)
    } else {
        sign * (1.0 + m / 8.0) * f32::powi(2.0, e - 7)
    }
}

/// `|x|` where `x` is finite, 0 where it is not: a block's amax is taken over these, so
/// an infinity (or NaN) in one element leaves the other elements' scale alone.
pub fn finite_magnitude(x: f32) -> f32 {
    if x.is_finite() { x.abs() } else { 0.0 }
}

/// The code of `x` in a block whose multiplier is `inv` ([`block_scale`]):
/// `rn_satfinite(x · inv)` for a finite `x`, NaN (0x7F) for an infinity or NaN, which
/// saturation would otherwise turn into ±448, a finite value read as data.
pub fn quantize_value(x: f32, inv: f32) -> u8 {
    if x.is_finite() {
        e4m3_from_f32(x * inv)
    } else {
        0x7F
    }
}

/// A block's scale and the multiplier that quantizes it, from its largest magnitude.
pub fn block_scale(amax: f32) -> (f32, f32) {
    let scale = amax / E4M3_MAX;
    let inv = E4M3_MAX / amax;
    if scale > 0.0 && inv.is_finite() {
        (scale, inv)
    } else {
        (1.0, 0.0)
    }
}

/// How many rows share a scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    /// One scale per [`SCALE_BLOCK`] rows of one (batch, head): the FP8 path's scheme.
    PerBlock,
    /// One scale for the whole tensor (written into every block), for comparison.
    PerTensor,
}

/// A quantized tensor: E4M3 codes and the scales, `[B, H, blocks]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

/// The amax of every (batch, head, row block) of a contiguous `[B, S, H, D]` tensor,
/// `[B, H, blocks]`, or the tensor's amax in each entry.
fn amaxes(x: &[f32], [b, s, h, d]: [usize; 4], g: Granularity) -> Vec<f32> {
    assert_eq!(x.len(), b * s * h * d, "tensor length");
    let blocks = s.div_ceil(SCALE_BLOCK as usize);
    let mut amax = vec![0f32; b * h * blocks];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let row = &x[((bi * s + si) * h + hi) * d..][..d];
                let m = row.iter().fold(0f32, |m, &v| m.max(finite_magnitude(v)));
                let slot = &mut amax[(bi * h + hi) * blocks + si / SCALE_BLOCK as usize];
                *slot = slot.max(m);
            }
        }
    }
    if g == Granularity::PerTensor {
        let all = amax.iter().fold(0f32, |m, &v| m.max(v));
        amax.iter_mut().for_each(|v| *v = all);
    }
    amax
}

/// Quantizes Q or K, contiguous `[B, S, H, D]`, to codes of the same layout.
pub fn quantize_rows(x: &[f32], shape: [usize; 4], g: Granularity) -> Quantized {
    let [b, s, h, d] = shape;
    let blocks = s.div_ceil(SCALE_BLOCK as usize);
    let amax = amaxes(x, shape, g);
    let pairs: Vec<(f32, f32)> = amax.iter().map(|&a| block_scale(a)).collect();
    let mut codes = vec![0u8; x.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let (_, inv) = pairs[(bi * h + hi) * blocks + si / SCALE_BLOCK as usize];
                let at = ((bi * s + si) * h + hi) * d;
                for (c, &v) in codes[at..at + d].iter_mut().zip(&x[at..at + d]) {
                    *c = quantize_value(v, inv);
                }
            }
        }
    }
    Quantized {
        codes,
        scales: pairs.iter().map(|p| p.0).collect(),
    }
}

/// Quantizes V, contiguous `[B, Sk, H, D]`, to `Vᵀ8` codes `[B, H, D, pitch]` with the
/// keys of each 16-group in [`VT_KEY_ORDER`] and zeros past `Sk`.
///
/// # Panics
/// If `pitch` is below `Sk` rounded up to 16 or not a multiple of 16.
pub fn quantize_vt(v: &[f32], shape: [usize; 4], pitch: usize, g: Granularity) -> Quantized {
    let [b, s, h, d] = shape;
    assert!(pitch as u64 >= vt_min_pitch(s as u64) && pitch.is_multiple_of(16));
    let blocks = s.div_ceil(SCALE_BLOCK as usize);
    let amax = amaxes(v, shape, g);
    let pairs: Vec<(f32, f32)> = amax.iter().map(|&a| block_scale(a)).collect();
    let mut codes = vec![0u8; b * h * d * pitch];
    for bi in 0..b {
        for hi in 0..h {
            for pos in 0..vt_min_pitch(s as u64) as usize {
                let key = (pos & !15) + VT_KEY_ORDER[pos & 15] as usize;
                if key >= s {
                    continue;
                }
                let (_, inv) = pairs[(bi * h + hi) * blocks + key / SCALE_BLOCK as usize];
                let src = &v[((bi * s + key) * h + hi) * d..][..d];
                for (di, &x) in src.iter().enumerate() {
                    codes[((bi * h + hi) * d + di) * pitch + pos] = quantize_value(x, inv);
                }
            }
        }
    }
    Quantized {
        codes,
        scales: pairs.iter().map(|p| p.0).collect(),
    }
}

/// Elements of a row one GPU thread holds (one 16-byte vector of 16-bit values): the
/// Hadamard transform's stages inside a thread, and the length of the partial dot
/// products of [`lse_shift`].
pub const ELEMS_PER_THREAD: usize = 8;

/// One step of SplitMix64 (Steele, Lea and Flood): advances `state` by the golden-ratio
/// increment and returns the mixed value. The generator of [`HadamardSigns`].
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random signs `s` of the Hadamard option for one head dimension: element `n` of
/// each row is negated when bit `n` is set. Bits `64·i ..` are the `i`-th output of
/// [`splitmix64`] started from the seed (state = seed, first output after one step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HadamardSigns {
    bits: [u64; 4],
    head_dim: usize,
}

impl HadamardSigns {
    /// The largest head dimension the signs cover.
    pub const MAX_HEAD_DIM: usize = 256;

    /// The signs for `seed` and `head_dim`.
    ///
    /// # Panics
    /// If `head_dim` is not a power of two between 8 and [`Self::MAX_HEAD_DIM`].
    pub fn from_seed(seed: u64, head_dim: usize) -> HadamardSigns {
        assert!(
            head_dim.is_power_of_two() && (8..=Self::MAX_HEAD_DIM).contains(&head_dim),
            "the Hadamard option needs a power-of-two head dim in 8..=256, got {head_dim}"
        );
        let mut state = seed;
        let mut bits = [0u64; 4];
        for word in bits.iter_mut().take(head_dim.div_ceil(64)) {
            *word = splitmix64(&mut state);
        }
        if head_dim < 64 {
            bits[0] &= (1u64 << head_dim) - 1;
        }
        HadamardSigns { bits, head_dim }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Whether element `n` is negated.
    pub fn negated(&self, n: usize) -> bool {
        self.bits[n / 64] >> (n % 64) & 1 == 1
    }

    /// The sign bits as the kernels take them: 32 per word, element `n` in bit `n % 32`
    /// of word `n / 32`; words past the head dim are zero.
    pub fn words(&self) -> [u32; 8] {
        std::array::from_fn(|i| (self.bits[i / 2] >> (32 * (i % 2))) as u32)
    }
}

/// `1 / sqrt(d)` rounded to f32: the Hadamard transform's normalization.
pub fn hadamard_norm(head_dim: usize) -> f32 {
    (1.0 / (head_dim as f64).sqrt()) as f32
}

/// Rotates one row in place, `x ← H · diag(s) · x / sqrt(D)`, in the GPU quantizer's f32
/// order: the signs (exact), the fast Walsh-Hadamard butterflies `(a, b) → (a + b, a − b)`
/// over the index bits from the lowest up (bits below [`ELEMS_PER_THREAD`] inside a
/// thread, the rest across lanes), then one multiply by [`hadamard_norm`].
///
/// # Panics
/// If the row's length is not the signs' head dim.
pub fn rotate_row(x: &mut [f32], signs: &HadamardSigns) {
    let d = signs.head_dim();
    assert_eq!(x.len(), d, "row length");
    for (n, v) in x.iter_mut().enumerate() {
        if signs.negated(n) {
            *v = -*v;
        }
    }
    let mut h = 1;
    while h < d {
        for n in 0..d {
            if n & h == 0 {
                let (a, b) = (x[n], x[n + h]);
                x[n] = a + b;
                x[n + h] = a - b;
            }
        }
        h *= 2;
    }
    let norm = hadamard_norm(d);
    x.iter_mut().for_each(|v| *v *= norm);
}

/// K's mean over the sequence per (batch, head, channel), f32 `[B, H, D]`, of a
/// contiguous `[B, S, H, D]` tensor: its finite elements summed in f64, divided by S and
/// rounded once.
pub fn key_mean(k: &[f32], [b, s, h, d]: [usize; 4]) -> Vec<f32> {
    assert_eq!(k.len(), b * s * h * d, "tensor length");
    let mut sum = vec![0f64; b * h * d];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let row = &k[((bi * s + si) * h + hi) * d..][..d];
                let acc = &mut sum[(bi * h + hi) * d..][..d];
                // Finite elements only, as the GPU's key mean: an infinite or NaN one
                // spoils its own codes, not the mean every key and query takes.
                for (a, &x) in acc.iter_mut().zip(row) {
                    if x.is_finite() {
                        *a += x as f64;
                    }
                }
            }
        }
    }
    sum.iter().map(|&x| (x / s as f64) as f32).collect()
}

/// `q · mean` of every query row with its KV head's mean (`mean`: f32 `[B, Hkv, D]`), f32
/// `[B, Hq, Sq]`, from a contiguous `[B, Sq, Hq, D]` `q`, in the GPU quantizer's order:
/// each run of [`ELEMS_PER_THREAD`] channels by fused multiply-adds from 0, then the runs
/// summed pairwise as a butterfly (run `c` with run `c ^ 1`, then `c ^ 2`, ...).
///
/// # Panics
/// If a length does not match, the heads do not group, or `d` is not a power-of-two
/// number of runs (the butterfly's shape; every FP8 head dim is one).
pub fn lse_shift(q: &[f32], [b, s, h, d]: [usize; 4], mean: &[f32], heads_kv: usize) -> Vec<f32> {
    assert!(
        d.is_multiple_of(ELEMS_PER_THREAD) && (d / ELEMS_PER_THREAD).is_power_of_two(),
        "the LSE shift needs a head dim that is a power-of-two multiple of {ELEMS_PER_THREAD}, \
         got {d}"
    );
    assert_eq!(q.len(), b * s * h * d, "tensor length");
    assert_eq!(mean.len(), b * heads_kv * d, "mean length");
    assert!(heads_kv > 0 && h.is_multiple_of(heads_kv), "head ratio");
    let group = h / heads_kv;
    let runs = d / ELEMS_PER_THREAD;
    let mut out = vec![0f32; b * h * s];
    let mut partial = vec![0f32; runs];
    for bi in 0..b {
        for hi in 0..h {
            let m = &mean[(bi * heads_kv + hi / group) * d..][..d];
            for si in 0..s {
                let row = &q[((bi * s + si) * h + hi) * d..][..d];
                for (c, p) in partial.iter_mut().enumerate() {
                    let at = c * ELEMS_PER_THREAD;
                    *p = row[at..at + ELEMS_PER_THREAD]
                        .iter()
                        .zip(&m[at..at + ELEMS_PER_THREAD])
                        .fold(0f32, |acc, (&x, &y)| x.mul_add(y, acc));
                }
                let mut width = 1;
                while width < runs {
                    let before = partial.clone();
                    for (c, p) in partial.iter_mut().enumerate() {
                        *p = before[c] + before[c ^ width];
                    }
                    width *= 2;
                }
                out[(bi * h + hi) * s + si] = partial[0];
            }
        }
    }
    out
}

/// What the quantizer does to every row of Q or K before scaling it.
#[derive(Debug, Clone, Copy, Default)]
pub struct RowTransform<'a> {
    /// Subtracted from every row of head `h` of batch `b`: f32 `[B, H, D]` with this
    /// tensor's heads (K smoothing: [`key_mean`], or the mean the GPU computed).
    pub mean: Option<&'a [f32]>,
    /// The Hadamard rotation's signs ([`rotate_row`]), applied after the mean.
    pub hadamard: Option<&'a HadamardSigns>,
}

/// The rows of a contiguous `[B, S, H, D]` tensor after `t` (the values the quantizer
/// scales and rounds).
///
/// # Panics
/// If `x` does not hold `B·S·H·D` values, or `t.mean` does not hold `B·H·D`.
pub fn transform_rows(x: &[f32], [b, s, h, d]: [usize; 4], t: RowTransform) -> Vec<f32> {
    assert_eq!(x.len(), b * s * h * d, "tensor length");
    if let Some(mean) = t.mean {
        assert_eq!(mean.len(), b * h * d, "mean length ([B, H, D])");
    }
    let mut out = x.to_vec();
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let row = &mut out[((bi * s + si) * h + hi) * d..][..d];
                if let Some(mean) = t.mean {
                    let m = &mean[(bi * h + hi) * d..][..d];
                    row.iter_mut().zip(m).for_each(|(v, &mu)| *v -= mu);
                }
                if let Some(signs) = t.hadamard {
                    rotate_row(row, signs);
                }
            }
        }
    }
    out
}

/// [`quantize_rows`] after [`transform_rows`]: the GPU quantizer's rows with options.
///
/// # Panics
/// As [`transform_rows`].
pub fn quantize_rows_with(
    x: &[f32],
    shape: [usize; 4],
    g: Granularity,
    t: RowTransform,
) -> Quantized {
    quantize_rows(&transform_rows(x, shape, t), shape, g)
}

/// The real values of `Q8`/`K8` codes, `[B, S, H, D]`.
pub fn dequantize_rows(q: &Quantized, [b, s, h, d]: [usize; 4]) -> Vec<f64> {
    let blocks = s.div_ceil(SCALE_BLOCK as usize);
    let mut out = vec![0f64; q.codes.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let scale = q.scales[(bi * h + hi) * blocks + si / SCALE_BLOCK as usize];
                let at = ((bi * s + si) * h + hi) * d;
                for (o, &c) in out[at..at + d].iter_mut().zip(&q.codes[at..at + d]) {
                    *o = e4m3_to_f32(c) as f64 * scale as f64;
                }
            }
        }
    }
    out
}

/// The real values of `Vᵀ8` codes, back in V's `[B, Sk, H, D]` layout.
///
/// # Panics
/// If `pitch` is below `Sk` rounded up to 16, or `q` holds fewer than `B·H·D·pitch`
/// codes or `B·H·ceil(Sk / 128)` scales.
pub fn dequantize_vt(q: &Quantized, [b, s, h, d]: [usize; 4], pitch: usize) -> Vec<f64> {
    assert!(
        pitch as u64 >= vt_min_pitch(s as u64),
        "pitch below Sk rounded up to 16"
    );
    assert!(
        q.codes.len() >= b * h * d * pitch,
        "codes shorter than [B, H, D, pitch]"
    );
    assert!(
        q.scales.len() >= b * h * s.div_ceil(SCALE_BLOCK as usize),
        "scales shorter than [B, H, blocks]"
    );
    let blocks = s.div_ceil(SCALE_BLOCK as usize);
    let mut out = vec![0f64; b * s * h * d];
    for bi in 0..b {
        for hi in 0..h {
            for key in 0..s {
                let pos = crate::kernels::attention::fp8::vt_position(key as u32) as usize;
                let scale = q.scales[(bi * h + hi) * blocks + key / SCALE_BLOCK as usize];
                for di in 0..d {
                    let code = q.codes[((bi * h + hi) * d + di) * pitch + pos];
                    out[((bi * s + key) * h + hi) * d + di] =
                        e4m3_to_f32(code) as f64 * scale as f64;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "power-of-two multiple of 8")]
    fn lse_shift_refuses_head_dims_its_butterfly_cannot_sum() {
        let d = 24;
        lse_shift(&vec![1.0; d], [1, 1, 1, d], &vec![1.0; d], 1);
    }

    #[test]
    fn non_finite_inputs_give_the_documented_scales_and_codes() {
        // One block of 2 rows x 2 columns: an infinity or NaN gets a NaN code and leaves
        // the scale to the finite elements, whose codes are those of the block without it.
        let is_nan = |c: u8| e4m3_to_f32(c).is_nan();
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let q = quantize_rows(&[1.0, bad, -2.0, 0.5], [1, 2, 1, 2], Granularity::PerBlock);
            assert_eq!(q.scales, [2.0 / E4M3_MAX], "{bad}");
            assert!(is_nan(q.codes[1]), "{bad}");
            let values: Vec<f32> = [0, 2, 3].map(|i| e4m3_to_f32(q.codes[i])).to_vec();
            assert_eq!(values, [224.0, -448.0, 112.0], "{bad}");
        }
        // A block of nothing but non-finite values: scale 1, every code NaN.
        let q = quantize_rows(
            &[f32::INFINITY, f32::NAN],
            [1, 1, 1, 2],
            Granularity::PerBlock,
        );
        assert_eq!(q.scales, [1.0]);
        assert!(q.codes.iter().all(|&c| is_nan(c)));
        // Per tensor, likewise: the infinity does not zero the other blocks.
        let q = quantize_rows(&[f32::INFINITY, 4.0], [1, 1, 1, 2], Granularity::PerTensor);
        assert_eq!(q.scales, [4.0 / E4M3_MAX]);
        assert_eq!(e4m3_to_f32(q.codes[1]), 448.0);
        // Vᵀ: the same rule.
        let vt = quantize_vt(
            &[f32::NEG_INFINITY, 3.0],
            [1, 2, 1, 1],
            16,
            Granularity::PerBlock,
        );
        assert_eq!(vt.scales, [3.0 / E4M3_MAX]);
        let at = |key: u32| crate::kernels::attention::fp8::vt_position(key) as usize;
        assert!(is_nan(vt.codes[at(0)]));
        assert_eq!(e4m3_to_f32(vt.codes[at(1)]), 448.0);
    }

    #[test]
    fn every_code_round_trips() {
        for code in 0..=255u8 {
            let v = e4m3_to_f32(code);
            if v.is_nan() {
                assert_eq!(code & 0x7F, 0x7F);
                continue;
            }
            let back = e4m3_from_f32(v);
            // ±0 both round-trip to themselves.
            assert_eq!(back, code, "code {code:#x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), f32::powi(2.0, -9));
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // 1.0 = 0x38; the next value is 1.125. 1.0625 is the midpoint: even (1.0) wins.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.0626), 0x39);
        // 1.1875 is the midpoint of 1.125 (odd mantissa 1) and 1.25 (even 2).
        assert_eq!(e4m3_from_f32(1.1875), 0x3A);
        assert_eq!(e4m3_from_f32(1e9), 0x7E);
        assert_eq!(e4m3_from_f32(-1e9), 0xFE);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32(f32::NAN), 0x7F);
        // Half the smallest subnormal rounds to 0 (even); a bit more to 2^-9.
        assert_eq!(e4m3_from_f32(f32::powi(2.0, -10)), 0x00);
        assert_eq!(e4m3_from_f32(f32::powi(2.0, -10) * 1.01), 0x01);
        // Agrees with the float8 crate wherever the value is in range.
        for i in 0..20000 {
            let x = (i as f32 - 10000.0) * 0.0457;
            let want = float8::F8E4M3::from_f32(x).to_bits();
            assert_eq!(e4m3_from_f32(x), want, "{x}");
        }
    }

    #[test]
    fn blocks_scale_to_448_and_zero_blocks_get_scale_one() {
        let shape = [1, 130, 1, 4];
        let mut x = vec![0f32; 130 * 4];
        x[5] = -3.5;
        x[7] = 1.0;
        let q = quantize_rows(&x, shape, Granularity::PerBlock);
        assert_eq!(q.scales, vec![3.5 / 448.0, 1.0]);
        assert_eq!(q.codes[5], 0xFE);
        let back = dequantize_rows(&q, shape);
        assert!((back[7] - 1.0).abs() < 0.07);
        assert!(back[128 * 4..].iter().all(|&v| v == 0.0));
        let t = quantize_rows(&x, shape, Granularity::PerTensor);
        assert_eq!(t.scales, vec![3.5 / 448.0; 2]);
    }

    #[test]
    fn vt_holds_permuted_keys_and_zero_padding() {
        let (s, d) = (19, 2);
        let v: Vec<f32> = (0..s * d).map(|i| 1.0 + i as f32).collect();
        let q = quantize_vt(&v, [1, s, 1, d], 32, Granularity::PerBlock);
        // Key 8 of the first group is stored at position 2.
        let scale = q.scales[0] as f64;
        let at = |di: usize, pos: usize| e4m3_to_f32(q.codes[di * 32 + pos]) as f64 * scale;
        assert!((at(0, 2) - v[8 * d] as f64).abs() < 0.07 * v[8 * d] as f64);
        // Keys 19.. of the second group are zeros wherever they are stored.
        for pos in 16..32 {
            let key = 16 + VT_KEY_ORDER[pos - 16] as usize;
            if key >= s {
                assert_eq!(q.codes[pos], 0, "pos {pos}");
            }
        }
        let back = dequantize_vt(&q, [1, s, 1, d], 32);
        for (b, &x) in back.iter().zip(&v) {
            assert!((b - x as f64).abs() <= 0.07 * x as f64, "{b} vs {x}");
        }
    }
    #[test]
    fn hadamard_signs_come_from_splitmix64() {
        let signs = HadamardSigns::from_seed(42, 128);
        let mut state = 42u64;
        let (w0, w1) = (splitmix64(&mut state), splitmix64(&mut state));
        assert_eq!(w0, crate::reference::Rng::new(42).next_u64());
        for n in 0..128 {
            let word = if n < 64 { w0 } else { w1 };
            assert_eq!(signs.negated(n), word >> (n % 64) & 1 == 1);
        }
        let words = signs.words();
        assert_eq!((words[0], words[1]), (w0 as u32, (w0 >> 32) as u32));
        assert_eq!((words[2], words[3]), (w1 as u32, (w1 >> 32) as u32));
        assert!(words[4..].iter().all(|&w| w == 0));
        // A head dim below 64 keeps only its own bits.
        let small = HadamardSigns::from_seed(42, 32);
        assert_eq!(small.words()[0], w0 as u32);
        assert!(small.words()[1..].iter().all(|&w| w == 0));
        assert_ne!(HadamardSigns::from_seed(43, 128), signs);
    }

    /// `H[i][j] = (−1)^popcount(i & j)`: the Sylvester-ordered Walsh-Hadamard matrix.
    fn rotate_by_matrix(x: &[f32], signs: &HadamardSigns) -> Vec<f64> {
        let d = x.len();
        (0..d)
            .map(|i| {
                let sum: f64 = (0..d)
                    .map(|j| {
                        let h = if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        let s = if signs.negated(j) { -1.0 } else { 1.0 };
                        h * s * x[j] as f64
                    })
                    .sum();
                sum / (d as f64).sqrt()
            })
            .collect()
    }

    #[test]
    fn rotation_is_the_signed_sylvester_hadamard_and_keeps_dot_products() {
        let mut rng = crate::reference::Rng::new(7);
        for d in [64usize, 128, 256] {
            let signs = HadamardSigns::from_seed(rng.next_u64(), d);
            let x: Vec<f32> = (0..d).map(|_| rng.normal() as f32).collect();
            let y: Vec<f32> = (0..d).map(|_| rng.normal() as f32 * 3.0).collect();
            let (mut rx, mut ry) = (x.clone(), y.clone());
            rotate_row(&mut rx, &signs);
            rotate_row(&mut ry, &signs);
            for (got, want) in rx.iter().zip(rotate_by_matrix(&x, &signs)) {
                assert!((*got as f64 - want).abs() < 1e-5, "d {d}: {got} vs {want}");
            }
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum()
            };
            let (before, after) = (dot(&x, &y), dot(&rx, &ry));
            assert!(
                (before - after).abs() < 1e-4 * d as f64,
                "{before} vs {after}"
            );
        }
    }

    /// An infinite or NaN key element leaves the mean finite: it counts as 0, so it
    /// spoils only its own codes, not every key of its head and every query's shift.
    #[test]
    fn the_key_mean_passes_over_non_finite_elements() {
        let (s, d) = (4, 8);
        let mut k = vec![1.0f32; s * d];
        k[d + 3] = f32::INFINITY;
        k[2 * d + 5] = f32::NAN;
        let mean = key_mean(&k, [1, s, 1, d]);
        assert!(mean.iter().all(|m| m.is_finite()), "{mean:?}");
        assert_eq!((mean[3], mean[5], mean[0]), (0.75, 0.75, 1.0));
    }

    #[test]
    fn mean_and_lse_shift_agree_with_float64() {
        let mut rng = crate::reference::Rng::new(11);
        let (b, s, hq, hkv, d) = (2, 37, 4, 2, 64);
        let k: Vec<f32> = (0..b * s * hkv * d)
            .map(|i| rng.normal() as f32 + (i % d) as f32 * 0.1)
            .collect();
        let q: Vec<f32> = (0..b * s * hq * d).map(|_| rng.normal() as f32).collect();
        let mean = key_mean(&k, [b, s, hkv, d]);
        // Channel c's mean is about 0.1·c.
        assert!((mean[5] - 0.5).abs() < 0.5, "{}", mean[5]);
        let shift = lse_shift(&q, [b, s, hq, d], &mean, hkv);
        for bi in 0..b {
            for h in 0..hq {
                for i in 0..s {
                    let row = &q[((bi * s + i) * hq + h) * d..][..d];
                    let m = &mean[(bi * hkv + h / 2) * d..][..d];
                    let want: f64 = row.iter().zip(m).map(|(&x, &y)| x as f64 * y as f64).sum();
                    let got = shift[(bi * hq + h) * s + i] as f64;
                    assert!((got - want).abs() < 1e-4, "{got} vs {want}");
                }
            }
        }
    }

    /// Attention in float64 on what the quantizer gives, options on, against the
    /// original values: the same output, and the same log-sum-exp once `lse_shift` is
    /// added back.
    #[test]
    fn options_leave_attention_unchanged() {
        use crate::reference::attention_f64;
        use crate::shape::AttnShape;
        let mut rng = crate::reference::Rng::new(5);
        let shape = AttnShape {
            batch: 1,
            seqlen_q: 40,
            seqlen_k: 150,
            heads_q: 4,
            heads_kv: 2,
            head_dim: 64,
        };
        let (b, sq, sk, hq, hkv, d) = (1, 40, 150, 4, 2, 64);
        let q: Vec<f32> = (0..shape.q_len()).map(|_| rng.normal() as f32).collect();
        // Keys with a large per-channel offset, as real models' keys have.
        let k: Vec<f32> = (0..shape.kv_len())
            .map(|i| rng.normal() as f32 + 4.0 * ((i % d) as f32 / d as f32 - 0.5))
            .collect();
        let v: Vec<f32> = (0..shape.kv_len()).map(|_| rng.normal() as f32).collect();
        let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
        let scale = 1.0 / (d as f64).sqrt();
        let exact = attention_f64(&shape, &f64s(&q), &f64s(&k), &f64s(&v), scale, false);

        let signs = HadamardSigns::from_seed(99, d);
        let mean = key_mean(&k, [b, sk, hkv, d]);
        let shift = lse_shift(&q, [b, sq, hq, d], &mean, hkv);
        for (smooth, rotate) in [(false, false), (true, false), (false, true), (true, true)] {
            let hadamard = rotate.then_some(&signs);
            let q8 = quantize_rows_with(
                &q,
                [b, sq, hq, d],
                Granularity::PerBlock,
                RowTransform {
                    mean: None,
                    hadamard,
                },
            );
            let k8 = quantize_rows_with(
                &k,
                [b, sk, hkv, d],
                Granularity::PerBlock,
                RowTransform {
                    mean: smooth.then_some(&mean[..]),
                    hadamard,
                },
            );
            let v8 = quantize_vt(&v, [b, sk, hkv, d], 160, Granularity::PerBlock);
            let got = attention_f64(
                &shape,
                &dequantize_rows(&q8, [b, sq, hq, d]),
                &dequantize_rows(&k8, [b, sk, hkv, d]),
                &dequantize_vt(&v8, [b, sk, hkv, d], 160),
                scale,
                false,
            );
            let err = crate::reference::rel_l2(&got.out, &exact.out);
            assert!(
                err < 0.08,
                "smooth {smooth} rotate {rotate}: output error {err}"
            );
            for (i, (&l, &want)) in got.lse.iter().zip(&exact.lse).enumerate() {
                let l = if smooth {
                    l + scale * shift[i] as f64
                } else {
                    l
                };
                // Smoothing takes the keys' offset out of their scales, so their codes
                // (and the scores) are finer.
                let tolerance = if smooth { 0.05 } else { 0.2 };
                assert!(
                    (l - want).abs() < tolerance,
                    "smooth {smooth} rotate {rotate}: lse {l} vs {want}"
                );
            }
            if smooth {
                // Without the shift the log-sum-exp would be off by far more.
                let off = got
                    .lse
                    .iter()
                    .zip(&exact.lse)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f64, f64::max);
                assert!(
                    off > 0.5,
                    "the smoothing test's keys need a real mean ({off})"
                );
            }
        }
    }
}
