//! FP8 (E4M3) attention with per-block dynamic scaling: the data contract the quantizer,
//! the kernels and the host share, and the kernel configurations.
//!
//! # Operands
//!
//! - `Q8`: e4m3 `[B, Sq, Hq, D]`, `K8`: e4m3 `[B, Sk, Hkv, D]` (strided like the 16-bit
//!   path's views, head dimension contiguous).
//! - `Vᵀ8`: e4m3 `[B, Hkv, D, pitch]`, keys contiguous: the K-major B operand FP8 `P·V`
//!   needs (wgmma has no transpose for FP8, `mma.sync` m16n8k32 reads four consecutive
//!   keys per register). Inside every group of 16 keys, stored position `p` holds key
//!   [`VT_KEY_ORDER`]`[p]` of the group: the order in which a thread's probabilities land
//!   in its A-fragment bytes when the f32 score fragment is packed four to a register
//!   (`(i & 1) + 2·c + 8·(i >> 1)`, the score columns a quad holds). `pitch` is a multiple of
//!   16 and at least `Sk` rounded up to 16; positions of keys `>= Sk` must hold finite values
//!   (the quantizer writes zeros there): they meet probabilities of exactly 0.
//! - Scales: float32, contiguous `[B, H, ceil(S / SCALE_BLOCK)]`, one per block of
//!   [`SCALE_BLOCK`] rows of one (batch, head): `q_scale` over Q's rows, `k_scale` and
//!   `v_scale` over keys. Real values are `e4m3 · scale`. The quantizer's scale is
//!   `amax / 448` (1 for a block of zeros), so a block's largest magnitude maps to E4M3's
//!   largest finite value and an outlier in one block leaves the others' precision alone.
//!   Scales must be finite and positive. (The quantizer takes the amax over a block's
//!   finite elements and gives an infinite or NaN element the NaN code: non-finite inputs
//!   make the outputs that read them non-finite, as in 16-bit attention, and leave the
//!   rest of their block's codes alone.)
//!
//! # What the kernels compute
//!
//! Per key tile `j` (never straddling a scale block), scores `S8 = Q8 K8ᵀ` in f32 are
//! dequantised inside the softmax's exponent: `p = exp2(S8 · (q_scale · k_scale_j ·
//! scale · log2 e) − m + 8)`, with `m` the running row maximum in the same log2 units. The
//! `+ 8` puts probabilities in `[0, 256]`, so E4M3 (smallest subnormal 2⁻⁹) keeps those
//! down to 2⁻¹⁷ of the row's largest. P is rounded to E4M3 in registers; each tile's
//! `P8 Vᵀ8` is accumulated on its own and then added in f32 as `O = O·rescale +
//! v_scale_j · (P8 Vᵀ8)`: the tensor cores' FP8 accumulation keeps fewer bits than f32,
//! so no sum runs longer than one tile inside them (two-level accumulation), and V's
//! per-block scale is exact. The row sum is taken over the f32 probabilities; the factor
//! 256 cancels in `O / l` and is taken out of the log-sum-exp.
//!
//! # Range
//!
//! Write `L` for a row's largest score in the exponent's units, `max(S8) · dc` (its largest
//! logit times log2 e). The running maximum is that product rounded up
//! ([`OnlineSoftmax::with_max_rounded_up`]), so the row's largest probability is
//! `2^(8 − ε)` with `0 <= ε < ulp(L)`: a factor common to the whole row, which cancels in
//! `O / l` and comes back in the log-sum-exp. Hence:
//! - `|L|` below 2^24 (logits up to about 1.2e7, far beyond real models'): `ε < 1`, exact
//!   up to FP8's rounding;
//! - from 2^24 to 2^31: `ε` below 128, so first a row's smallest probabilities and then
//!   its largest fall out of E4M3's range: O loses precision, down to zeros, while the
//!   log-sum-exp (from the f32 sums, whose largest term stays above 2^-120) stays right;
//! - beyond: a row's probabilities can all underflow, and it comes out as a row that saw
//!   no key (O zero, log-sum-exp −∞).
//!
//! Each tile's factor `dc` is also clamped into `[smallest normal f32, max_dequant(D)]`
//! ([`clamp_dequant`]): below, so a zero scale never turns a masked score into NaN
//! (`−∞ · 0`); above, so no score or running maximum in the exponent's units overflows
//! f32 (a raw score is at most `448² · D` in magnitude). Together, no Q or K scale and no
//! softmax scale makes an output NaN or infinite. (A factor that large puts `|L|` past
//! 2^31 unless the row's largest raw score is within 2^-69 of zero.) V's scales and
//! `lse_shift` are applied as they are, like values: a non-finite one reaches the outputs
//! that read it, and O's f32 sums (probabilities up to 256, unnormalised) overflow where a
//! V block's largest magnitude times `256 · Sk` passes f32's range.
//!
//! [`OnlineSoftmax::with_max_rounded_up`]: super::softmax::OnlineSoftmax::with_max_rounded_up
//!
//! `lse_shift` (optional, f32 `[B, Hq, Sq]`) is added, times the softmax scale, to each
//! row's log-sum-exp: with K smoothing (`K − mean_k`) the kernel's scores are `q·k − q·mean`,
//! and the quantizer's `q·mean` per row restores the true log-sum-exp.

use super::{FwdArgs, HalfType};
use crate::ptx::{F32, Kernel, Module, PtxError, Reg};

/// Rows of Q, and keys of K and V, that share one scale.
pub const SCALE_BLOCK: u32 = 128;
/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Keys per permuted group of `Vᵀ8`.
pub const VT_GROUP: u32 = 16;
/// Stored position `p` of a 16-key group of `Vᵀ8` holds key `VT_KEY_ORDER[p]`.
pub const VT_KEY_ORDER: [u8; 16] = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15];
/// The log2 of the factor probabilities are scaled by before rounding to E4M3.
pub const P_SHIFT_LOG2: f32 = 8.0;
/// How far (log2 units) a tile may grow a row's maximum before the Hopper kernel's
/// running maximum follows it ([`OnlineSoftmax::update_scaled`]'s `lag`): the scaled
/// probabilities then stay below `2^(8 + 0.75)` ≈ 431, inside E4M3's 448, and most
/// tiles leave every row's maximum where it was, so O needs no rescale.
///
/// [`OnlineSoftmax::update_scaled`]: super::softmax::OnlineSoftmax::update_scaled
pub const MAX_LAG_LOG2: f32 = 0.75;
/// Head dimensions with FP8 kernels (powers of two: the Hadamard option needs them too).
pub const HEAD_DIMS: [u32; 3] = [64, 128, 256];

/// The largest per-tile dequantization factor the kernels use at head dim `head_dim`
/// ([`clamp_dequant`]): a raw score `S8` is a sum of `D` products of E4M3 values, at most
/// `448² · D` in magnitude, so `S8 · dc` (a scaled score, and a row's running maximum)
/// stays within a quarter of f32's range, which leaves room for the exponent's offset and
/// for differences between maxima.
pub fn max_dequant(head_dim: u32) -> f32 {
    f32::MAX / (4.0 * E4M3_MAX * E4M3_MAX * head_dim as f32)
}

/// A tile's dequantization factor `q_scale · k_scale · scale · log2 e` from `product`,
/// clamped into `[f32::MIN_POSITIVE, max_dequant(head_dim)]`: a zero would turn masked
/// `−∞` scores into NaN, and a factor above the bound would let scores overflow (the
/// module docs say what the result is then). PTX `max` and `min` return the other operand
/// for a NaN, so a NaN product becomes the smallest normal float.
pub fn clamp_dequant(k: &mut Kernel, product: Reg<F32>, head_dim: u32) -> Reg<F32> {
    let dc = k.max(product, f32::MIN_POSITIVE);
    k.min(dc, max_dequant(head_dim))
}

/// The stored position of key `key` in its row of `Vᵀ8` (the inverse of [`VT_KEY_ORDER`]).
pub const fn vt_position(key: u32) -> u32 {
    let group = key & !(VT_GROUP - 1);
    let r = key & (VT_GROUP - 1);
    // r = (b & 1) + 8·(b >> 1) + 2·c  <=>  p = 4·c + b
    let c = (r & 7) >> 1;
    let b = (r & 1) | ((r >> 3) << 1);
    group | (4 * c + b)
}

/// Scale blocks covering `rows` rows.
pub const fn scale_blocks(rows: u32) -> u32 {
    rows.div_ceil(SCALE_BLOCK)
}

/// The smallest `Vᵀ8` pitch (keys per stored row) for `seqlen_k` keys (the largest
/// multiple of the group where that passes `u64`; validated lengths are far below).
pub const fn vt_min_pitch(seqlen_k: u64) -> u64 {
    let group = VT_GROUP as u64;
    match seqlen_k.checked_next_multiple_of(group) {
        Some(pitch) => pitch,
        None => u64::MAX / group * group,
    }
}

/// [`vt_min_pitch`] for host sizes: `None` where it passes `usize`.
pub const fn vt_min_pitch_checked(seqlen_k: usize) -> Option<usize> {
    seqlen_k.checked_next_multiple_of(VT_GROUP as usize)
}

/// Which FP8 kernel family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fp8Path {
    /// Warp-specialized TMA + wgmma e4m3 (`QGMMA`), `.target sm_90a`.
    Sm90,
    /// `mma.sync` m16n8k32 e4m3 + `cp.async`, `.target sm_89`: Ada and later.
    Sm89,
}

impl Fp8Path {
    pub fn name(self) -> &'static str {
        match self {
            Fp8Path::Sm90 => "sm90a",
            Fp8Path::Sm89 => "sm89",
        }
    }
}

/// One FP8 forward configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fp8Config {
    pub path: Fp8Path,
    /// The output's element type.
    pub out: HalfType,
    pub head_dim: u32,
    pub causal: bool,
}

impl Fp8Config {
    /// The kernel id, e.g. `attn_fwd_sm90a_e4m3_bf16_d128_causal`.
    pub fn id(&self) -> String {
        format!(
            "attn_fwd_{}_e4m3_{}_d{}{}",
            self.path.name(),
            self.out.name(),
            self.head_dim,
            if self.causal { "_causal" } else { "" }
        )
    }

    id_static!(Fp8Config, all_fp8_configs, "attn_fwd_fp8_unknown");

    /// Tile shape and launch geometry.
    pub fn tiling(&self) -> super::Tiling {
        match self.path {
            Fp8Path::Sm90 => super::sm90_fp8::tiling(self),
            Fp8Path::Sm89 => super::sm89_fp8::tiling(self),
        }
    }

    /// Generates the module (one entry, named [`Fp8Config::id`]); a configuration
    /// [`all_fp8_configs`] does not list is refused.
    pub fn generate(&self) -> Result<Module, PtxError> {
        crate::kernels::listed("FP8 forward", self, all_fp8_configs())?;
        match self.path {
            Fp8Path::Sm90 => super::sm90_fp8::generate(self),
            Fp8Path::Sm89 => super::sm89_fp8::generate(self),
        }
    }
}

/// Every FP8 configuration.
pub fn all_fp8_configs() -> Vec<Fp8Config> {
    let mut v = Vec::new();
    for path in [Fp8Path::Sm90, Fp8Path::Sm89] {
        let dims: &[u32] = match path {
            Fp8Path::Sm90 => &super::sm90_fp8::HEAD_DIMS,
            Fp8Path::Sm89 => &HEAD_DIMS,
        };
        for out in [HalfType::F16, HalfType::Bf16] {
            for &head_dim in dims {
                for causal in [false, true] {
                    v.push(Fp8Config {
                        path,
                        out,
                        head_dim,
                        causal,
                    });
                }
            }
        }
    }
    v
}

/// The FP8 configurations of one kernel family.
#[cfg(test)]
pub(crate) fn fp8_configs_on(path: Fp8Path) -> impl Iterator<Item = Fp8Config> {
    all_fp8_configs()
        .into_iter()
        .filter(move |c| c.path == path)
}

/// The by-value argument block of the FP8 kernels: the 16-bit kernels' block first (so
/// every helper that reads [`FwdArgs`] fields reads them here at the same offsets), then
/// `Vᵀ8` and the scales. `base.q`/`base.k` and their strides describe Q8 and K8 (strides
/// in elements = bytes); `base.v` and `base.v_stride` are unused; `base.o` is the 16-bit
/// output. Dense batches only (`cu_seqlens_*` are 0).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Fp8Args {
    pub base: FwdArgs,
    /// `Vᵀ8`, e4m3 `[B, Hkv, D, pitch]`.
    pub vt: u64,
    /// `Vᵀ8`'s (batch, head, row) strides in elements; the row stride is the pitch.
    pub vt_stride: [u64; 3],
    /// f32 `[B, Hq, q_scale_blocks]`.
    pub q_scale: u64,
    /// f32 `[B, Hkv, kv_scale_blocks]`.
    pub k_scale: u64,
    /// f32 `[B, Hkv, kv_scale_blocks]`.
    pub v_scale: u64,
    /// f32 `[B, Hq, Sq]` added (times the softmax scale) to each row's LSE, or 0.
    pub lse_shift: u64,
    pub q_scale_blocks: u32,
    pub kv_scale_blocks: u32,
}

impl Fp8Args {
    pub const SIZE: usize = std::mem::size_of::<Fp8Args>();
}

impl AsMut<FwdArgs> for Fp8Args {
    fn as_mut(&mut self) -> &mut FwdArgs {
        &mut self.base
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vt_position_inverts_the_key_order() {
        for (p, &key) in VT_KEY_ORDER.iter().enumerate() {
            assert_eq!(vt_position(key as u32), p as u32);
            assert_eq!(vt_position(32 + key as u32), 32 + p as u32);
        }
        let mut seen = [false; 16];
        for key in 0..16 {
            seen[vt_position(key) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn key_order_matches_the_quad_layout() {
        // Thread c of a quad packs score columns 2c, 2c+1, 8+2c, 9+2c (of each 16) into
        // the four bytes of one A register, which the MMA reads as k = 4c..4c+3.
        for c in 0..4u32 {
            let cols = [2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c];
            for (b, col) in cols.into_iter().enumerate() {
                assert_eq!(VT_KEY_ORDER[(4 * c) as usize + b] as u32, col);
            }
        }
    }

    /// The module docs' "Range": in every FP8 kernel each tile's factor is clamped on
    /// both sides (as many upper clamps as lower ones) and the maxima in the exponent's
    /// units are rounded up (`mul.rp`); the 16-bit forward kernels keep rounding to
    /// nearest.
    #[test]
    fn fp8_kernels_clamp_their_factors_and_round_their_maxima_up() {
        let lines = |ptx: &str, op: &str, last: &str| {
            ptx.lines()
                .map(str::trim)
                .filter(|l| l.starts_with(op) && l.ends_with(last))
                .count()
        };
        for cfg in all_fp8_configs() {
            let ptx = cfg.generate().unwrap().to_ptx();
            let upper = format!(", 0f{:08X};", max_dequant(cfg.head_dim).to_bits());
            let clamps_below = lines(&ptx, "max.f32", ", 0f00800000;");
            assert!(clamps_below > 0, "{}", cfg.id());
            assert_eq!(lines(&ptx, "min.f32", &upper), clamps_below, "{}", cfg.id());
            let rounded_up = lines(&ptx, "mul.rp.f32", ";");
            assert!(rounded_up > 0, "{}", cfg.id());
        }
        for cfg in super::super::all_fwd_configs() {
            let ptx = cfg.generate().unwrap().to_ptx();
            assert!(!ptx.contains("mul.rp"), "{}", cfg.id());
        }
    }

    #[test]
    fn args_keep_the_base_block_first() {
        assert_eq!(std::mem::offset_of!(Fp8Args, base), 0);
        assert_eq!(Fp8Args::SIZE % 8, 0);
        assert_eq!(scale_blocks(1), 1);
        assert_eq!(scale_blocks(128), 1);
        assert_eq!(scale_blocks(129), 2);
        assert_eq!(vt_min_pitch(1), 16);
        assert_eq!(vt_min_pitch(32), 32);
        // Saturates at the largest multiple of the group rather than wrapping.
        assert_eq!(vt_min_pitch(u64::MAX - 3), u64::MAX - 15);
        assert_eq!(vt_min_pitch(u64::MAX - 15), u64::MAX - 15);
    }

    #[test]
    fn ids_are_distinct() {
        let all = all_fp8_configs();
        let ids: std::collections::HashSet<_> = all.iter().map(|c| c.id()).collect();
        assert_eq!(ids.len(), all.len());
        for c in &all {
            assert_eq!(c.id_static(), c.id());
        }
        assert_eq!(all.len(), 24);
    }
}
