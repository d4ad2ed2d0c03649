//! E4M3 quantization on the CPU, bit for bit what the GPU quantizer produces: the
//! reference its tests compare against, and the calibration suite's simulator.
//!
//! Layouts and scale semantics are those of [`crate::kernels::attention::fp8`]: one f32
//! scale per block of [`SCALE_BLOCK`] rows of one (batch, head), `scale = amax / 448`
//! and `e4m3 = rn_satfinite(x · (448 / amax))`; a block whose `448 / amax` is not finite
//! (all zeros, or too small to scale) gets scale 1 and all-zero codes.

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
                let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
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
                    *c = e4m3_from_f32(v * inv);
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
                    codes[((bi * h + hi) * d + di) * pitch + pos] = e4m3_from_f32(x * inv);
                }
            }
        }
    }
    Quantized {
        codes,
        scales: pairs.iter().map(|p| p.0).collect(),
    }
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
pub fn dequantize_vt(q: &Quantized, [b, s, h, d]: [usize; 4], pitch: usize) -> Vec<f64> {
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
}
