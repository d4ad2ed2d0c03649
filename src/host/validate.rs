//! Argument checks for the forward pass. Everything a kernel would otherwise turn into a
//! wrong answer, an illegal address or a hang is rejected here with a typed [`Error`].
//!
//! Checks run from the most basic to the most derived, and the first failure is returned:
//!
//! 1. dtypes: all four equal ([`Error::UnsupportedDType`]), and f16 or bf16 (same variant);
//! 2. no zero dimension in q, k, v, o ([`Error::EmptyDimension`]);
//! 3. shapes: o == q, v == k, batch and head_dim equal across all ([`Error::ShapeMismatch`]);
//! 4. head dim has a kernel ([`Error::UnsupportedHeadDim`]);
//! 5. Hq a multiple of Hkv ([`Error::HeadRatio`]);
//! 6. size limits ([`Error::InvalidArgument`]): seqlens <= 2^25, batch and Hq <= 65535;
//! 7. softmax scale, when given, finite and positive; soft cap, when given, finite and
//!    positive, `scale / cap` a normal float; the window's right side 0 with causal
//!    masking ([`Error::InvalidArgument`]);
//! 8. pointers of q, k, v, o: non-null ([`Error::NullPointer`]) then 16-byte aligned
//!    ([`Error::Misaligned`]); then the LSE pointer: non-null, 4-byte aligned;
//! 9. strides ([`Error::BadStrides`]): head_dim stride 1, every other stride a multiple of
//!    16 bytes; then every tensor's byte range fits in 64-bit arithmetic; then o's elements
//!    do not alias one another;
//! 10. o (and lse) do not overlap any other tensor ([`Error::InvalidArgument`]).
//!
//! A stride that is not a multiple of 16 bytes is reported as [`Error::BadStrides`], not
//! [`Error::Misaligned`]: the pointer is fine, it is the layout that breaks the kernels'
//! 16-byte vector accesses, and `Misaligned` carries a pointer, not a stride.

use crate::error::{Error, Result};
use crate::host::tensor::{
    AttentionParams, DIM_HEAD_DIM, DIM_NAMES, KeyWindow, LseView, TensorView,
};
use crate::kernels::attention::{HalfType, padded_head_dim};
use crate::shape::AttnShape;

/// The forward's head dims as the text [`Error::UnsupportedHeadDim`] carries: those of
/// the kernels and every other multiple of 8 up to 256, padded ([`padded_head_dim`]).
pub const FWD_PADDED_HEAD_DIMS_TEXT: &str =
    "multiples of 8 up to 256 (32, 64, 96, 128, 192, 256 without padding)";

/// Byte alignment the kernels' vector loads and stores need for q, k, v, o.
pub const TENSOR_ALIGN: u64 = 16;
/// Byte alignment of the float32 LSE output.
pub const LSE_ALIGN: u64 = 4;
/// Largest batch and largest Hq: they become grid dimensions limited to 65535.
pub const MAX_GRID_YZ: usize = 65535;
/// The longest sequence (queries or keys) a forward call accepts: 2^25 = 33,554,432.
///
/// Far above any real context, and the range over which every kernel stays exact even on
/// the worst input, a flat row (every key scoring the same): indices are 64-bit or
/// saturating, each thread's share of a row's softmax sum is summed per tile and stays
/// where f32 counts it exactly, and `P·V`, which the tensor cores accumulate with fewer
/// bits than f32 (a flat row of 2^27 keys came out at half its value on the H200, the sum
/// having stopped growing at 2^26), still gets every key counted.
pub const MAX_SEQLEN: usize = 1 << 25;

/// A validated forward problem: the sizes and options a launch needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FwdProblem {
    pub shape: AttnShape,
    pub dtype: HalfType,
    /// The softmax scale actually applied (the default already resolved).
    pub scale: f32,
    /// Keys past each row's diagonal (moved by the window's right side) are masked.
    pub causal: bool,
    /// The key window beyond causal masking, if any (then `causal` is set): see
    /// [`AttentionParams::masking`].
    pub window: Option<KeyWindow>,
    /// The soft cap of the scores, if any ([`AttentionParams::softcap`], checked finite and
    /// positive).
    pub softcap: Option<f32>,
    /// Packed variable-length sequences (`shape.batch` of them, `shape.seqlen_q` the
    /// longest query sequence allowed), or `None` for dense tensors.
    pub packed: Option<Packed>,
    /// Device `i32 [B]`: the keys each sequence uses, at most `seqlen_k` (a KV cache's
    /// lengths, the cache's capacity as `seqlen_k`; see [`FwdArgs::seqused_k`]), or `None`
    /// for all of them. Set by the calls over a cache, never by `validate_fwd`.
    ///
    /// [`FwdArgs::seqused_k`]: crate::kernels::attention::FwdArgs::seqused_k
    pub seqused_k: Option<u64>,
    /// K and V as a paged cache's pools (sm90 path only; see [`FwdArgs::block_table`]),
    /// or `None` for tensors. Set by the calls over a cache, never by `validate_fwd`.
    ///
    /// [`FwdArgs::block_table`]: crate::kernels::attention::FwdArgs::block_table
    pub pages: Option<PageTable>,
}

/// A paged cache's block table as the sm90 forward kernels read it: device `i32`
/// entries, `table_stride` apart per sequence, `max_pages` of them for each; pages of
/// `2^page_shift` positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageTable {
    pub block_table: u64,
    pub table_stride: u32,
    pub page_shift: u32,
    pub max_pages: u32,
}

/// A validated packed batch: where the offsets are and how many rows they index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packed {
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    pub total_q: usize,
    pub total_k: usize,
    /// Which sequences the launch computes.
    pub runs: Runs,
}

/// Which of a packed batch's sequences a launch computes, by query count: all of them,
/// or one side of a serving batch split between the decode and the forward kernels
/// (`Attention::decode_varlen`). A sequence on the other side has no rows written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runs {
    /// Every sequence (queries past the problem's `seqlen_q` uncomputed).
    All,
    /// Those with at most the problem's `seqlen_q` queries.
    Short,
    /// Those with at least this many.
    Long(usize),
}

/// Checks the arguments of a forward call; see the module docs for the order of checks.
pub fn validate_fwd(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    o: &TensorView,
    lse: Option<&LseView>,
    params: &AttentionParams,
) -> Result<FwdProblem> {
    let all: [(&'static str, &TensorView); 4] = [("q", q), ("k", k), ("v", v), ("o", o)];

    // 1. dtypes
    if all.iter().any(|(_, t)| t.dtype != q.dtype) {
        return Err(Error::UnsupportedDType(format!(
            "q, k, v and o must share one dtype, got q {}, k {}, v {}, o {}",
            q.dtype, k.dtype, v.dtype, o.dtype
        )));
    }
    let dtype = q.dtype.half_type().ok_or_else(|| {
        Error::UnsupportedDType(format!(
            "q, k, v and o are {}; the kernels take f16 or bf16",
            q.dtype
        ))
    })?;

    // 2. empty dimensions
    for (name, t) in all {
        check_not_empty(name, t)?;
    }

    // 3. shapes
    if o.shape != q.shape {
        return Err(Error::ShapeMismatch(format!(
            "o has shape {:?} but q has {:?}; they must be equal",
            o.shape, q.shape
        )));
    }
    if v.shape != k.shape {
        return Err(Error::ShapeMismatch(format!(
            "v has shape {:?} but k has {:?}; they must be equal",
            v.shape, k.shape
        )));
    }
    if k.batch() != q.batch() {
        return Err(Error::ShapeMismatch(format!(
            "k/v batch {} differs from q batch {}",
            k.batch(),
            q.batch()
        )));
    }
    if k.head_dim() != q.head_dim() {
        return Err(Error::ShapeMismatch(format!(
            "k/v head_dim {} differs from q head_dim {}",
            k.head_dim(),
            q.head_dim()
        )));
    }
    let (batch, seqlen_q, heads_q, head_dim) = (q.batch(), q.seqlen(), q.heads(), q.head_dim());
    let (seqlen_k, heads_kv) = (k.seqlen(), k.heads());

    // 4. head dim: a kernel's, or a multiple of 8 below 256 that pads to one
    if padded_head_dim(head_dim).is_none() {
        return Err(Error::UnsupportedHeadDim(
            head_dim,
            FWD_PADDED_HEAD_DIMS_TEXT,
        ));
    }

    // 5. GQA/MQA ratio; 6. launch-grid and 32-bit index limits
    check_heads_and_sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_k)?;

    // 7. softmax scale, soft cap and masking
    check_scale(params)?;
    let softcap = checked_softcap(params, head_dim)?;
    let masking = params.masking(seqlen_q, seqlen_k)?;

    // 8. pointers
    for (name, t) in all {
        check_pointer(name, t.ptr, TENSOR_ALIGN)?;
    }
    if let Some(l) = lse {
        check_pointer("lse", l.ptr, LSE_ALIGN)?;
    }

    // 9. strides and extents
    for (name, t) in all {
        check_strides(name, t)?;
    }
    let mut ranges = [(0u64, 0u64); 4];
    for (r, (name, t)) in ranges.iter_mut().zip(all) {
        *r = byte_range_of(name, t)?;
    }
    let lse_range = match lse {
        Some(l) => Some(lse_byte_range(l, batch, heads_q, seqlen_q)?),
        None => None,
    };
    check_no_self_overlap("o", o)?;

    // 10. outputs must not overlap anything else
    let o_range = ranges[3];
    for ((name, _), r) in all.iter().zip(ranges).take(3) {
        if overlaps(o_range, r) {
            return Err(Error::InvalidArgument(format!(
                "o's memory [{:#x}, {:#x}) overlaps {name}'s [{:#x}, {:#x})",
                o_range.0, o_range.1, r.0, r.1
            )));
        }
    }
    if let Some(lr) = lse_range {
        for ((name, _), r) in all.iter().zip(ranges) {
            if overlaps(lr, r) {
                return Err(Error::InvalidArgument(format!(
                    "lse's memory [{:#x}, {:#x}) overlaps {name}'s [{:#x}, {:#x})",
                    lr.0, lr.1, r.0, r.1
                )));
            }
        }
    }

    Ok(FwdProblem {
        shape: AttnShape {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
        },
        dtype,
        scale: params.scale_for(head_dim),
        causal: masking.causal,
        window: masking.window,
        softcap,
        packed: None,
        seqused_k: None,
        pages: None,
    })
}

/// Hq a multiple of Hkv ([`Error::HeadRatio`]), then the size limits
/// ([`Error::InvalidArgument`]): sequence lengths up to [`MAX_SEQLEN`], batch and Hq up to
/// [`MAX_GRID_YZ`].
pub(crate) fn check_heads_and_sizes(
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    seqlen_q: usize,
    seqlen_k: usize,
) -> Result<()> {
    if !heads_q.is_multiple_of(heads_kv) {
        return Err(Error::HeadRatio {
            hq: heads_q,
            hkv: heads_kv,
        });
    }

    for (what, n) in [("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)] {
        if n > MAX_SEQLEN {
            return Err(Error::InvalidArgument(format!(
                "{what} {n} exceeds the limit of {MAX_SEQLEN} (2^25)"
            )));
        }
    }
    if batch > MAX_GRID_YZ {
        return Err(Error::InvalidArgument(format!(
            "batch {batch} exceeds the grid limit {MAX_GRID_YZ}"
        )));
    }
    if heads_q > MAX_GRID_YZ {
        return Err(Error::InvalidArgument(format!(
            "query heads {heads_q} exceed the grid limit {MAX_GRID_YZ}"
        )));
    }
    Ok(())
}

/// `t` has no zero-size dimension.
pub(crate) fn check_not_empty(name: &'static str, t: &TensorView) -> Result<()> {
    match t.shape.iter().position(|&n| n == 0) {
        Some(i) => Err(Error::EmptyDimension {
            tensor: name,
            dim: DIM_NAMES[i],
        }),
        None => Ok(()),
    }
}

/// Whether `head_dim` is one of `dims`, compared without narrowing: a head dim of
/// 2^32 + 64 is not 64.
pub(crate) fn head_dim_in(dims: &[u32], head_dim: usize) -> bool {
    u32::try_from(head_dim).is_ok_and(|d| dims.contains(&d))
}

/// A device pointer is non-null and `align`-byte aligned.
/// A packed call's sequence counts: at least one sequence and at most [`MAX_GRID_YZ`]
/// (the grid's limit), `max_seqlen_q` (the longest query run, which sizes the launch)
/// from 1 to [`MAX_SEQLEN`].
pub(crate) fn check_sequence_counts(batch: usize, max_seqlen_q: usize) -> Result<()> {
    if batch == 0 {
        return Err(Error::EmptyDimension {
            tensor: "cu_seqlens_q",
            dim: "batch",
        });
    }
    if batch > MAX_GRID_YZ {
        return Err(Error::InvalidArgument(format!(
            "{batch} sequences exceed the grid limit {MAX_GRID_YZ}"
        )));
    }
    if !(1..=MAX_SEQLEN).contains(&max_seqlen_q) {
        return Err(Error::InvalidArgument(format!(
            "max_seqlen_q {max_seqlen_q} is outside 1..=2^25"
        )));
    }
    Ok(())
}

pub(crate) fn check_pointer(name: &'static str, ptr: u64, align: u64) -> Result<()> {
    if ptr == 0 {
        return Err(Error::NullPointer(name));
    }
    if !ptr.is_multiple_of(align) {
        return Err(Error::Misaligned {
            tensor: name,
            ptr,
            align,
        });
    }
    Ok(())
}

/// The byte range of `t`, or why it has none.
pub(crate) fn byte_range_of(name: &'static str, t: &TensorView) -> Result<(u64, u64)> {
    t.byte_range().ok_or_else(|| Error::BadStrides {
        tensor: name,
        reason: format!(
            "shape {:?} with strides {:?} at {:#x} overflows 64-bit addressing",
            t.shape, t.strides, t.ptr
        ),
    })
}

/// The softmax scale, when given, is finite and positive, and so is its product with
/// log2(e): the kernels multiply by log2(e) to use exp2, and take each row's maximum of
/// the raw scores as its maximum of the scaled ones, which holds only for a positive
/// scale (as in FlashAttention).
pub(crate) fn check_scale(params: &AttentionParams) -> Result<()> {
    if let Some(s) = params.softmax_scale {
        let s_log2 = s as f64 * std::f64::consts::LOG2_E;
        if !s.is_finite() || s <= 0.0 || s_log2 > f32::MAX as f64 {
            return Err(Error::InvalidArgument(format!(
                "softmax_scale must be finite and positive (and finite times log2(e)), got {s}"
            )));
        }
    }
    Ok(())
}

/// A call's soft cap ([`AttentionParams::softcap`]), once it is known to be finite and
/// positive, with `cap · log2 e` finite and `scale / cap` (the kernels' factor inside the
/// `tanh`) a normal float, for the scale the call runs with at head dim `head_dim`: an
/// [`Error::InvalidArgument`] otherwise. (A cap so far from the scale that their ratio
/// leaves the float range would turn every score into 0 or ±1.)
pub(crate) fn checked_softcap(params: &AttentionParams, head_dim: usize) -> Result<Option<f32>> {
    let Some(cap) = params.softcap else {
        return Ok(None);
    };
    let scale = params.scale_for(head_dim) as f64;
    let ratio = scale / cap as f64;
    let fits = cap.is_finite()
        && cap > 0.0
        && cap as f64 * std::f64::consts::LOG2_E <= f32::MAX as f64
        && (f32::MIN_POSITIVE as f64..=f32::MAX as f64).contains(&ratio);
    if !fits {
        return Err(Error::InvalidArgument(format!(
            "softcap must be finite and positive (None for no cap), with softmax_scale / \
             softcap a normal float; got softcap {cap} at softmax_scale {scale}"
        )));
    }
    Ok(Some(cap))
}

/// Head dimension contiguous; other strides keep 16-byte vectors aligned.
pub(crate) fn check_strides(name: &'static str, t: &TensorView) -> Result<()> {
    if t.strides[DIM_HEAD_DIM] != 1 {
        return Err(Error::BadStrides {
            tensor: name,
            reason: format!(
                "head_dim stride is {}, must be 1 (contiguous)",
                t.strides[DIM_HEAD_DIM]
            ),
        });
    }
    let elem = t.dtype.size_bytes() as u64;
    let dims = t
        .shape
        .iter()
        .zip(&t.strides)
        .zip(DIM_NAMES)
        .take(DIM_HEAD_DIM);
    for ((&n, &st), dim) in dims {
        // A dimension of extent 1 is only ever indexed at 0, so its stride never reaches
        // an address; frameworks often leave arbitrary strides there.
        if n == 1 {
            continue;
        }
        let st = st as u64;
        let Some(bytes) = st.checked_mul(elem) else {
            return Err(Error::BadStrides {
                tensor: name,
                reason: format!("{dim} stride {st} elements overflows in bytes"),
            });
        };
        if !bytes.is_multiple_of(TENSOR_ALIGN) {
            return Err(Error::BadStrides {
                tensor: name,
                reason: format!(
                    "{dim} stride {st} elements ({bytes} bytes) is not a multiple of \
                     {TENSOR_ALIGN} bytes"
                ),
            });
        }
    }
    Ok(())
}

/// Rejects an output whose distinct elements could share an address (a zero stride, say).
///
/// Sufficient, not necessary: sorted by stride, each dimension must step past the whole
/// span of the smaller ones. Every layout that is a permutation of a (possibly padded)
/// dense tensor passes; only exotic interleavings that happen not to collide are refused.
pub(crate) fn check_no_self_overlap(name: &'static str, t: &TensorView) -> Result<()> {
    // A fixed array, not a Vec: this runs on every call and the hot path allocates nothing.
    let mut dims = [0usize, 1, 2, 3];
    dims.sort_by_key(|&i| t.strides[i]);
    let dims = dims.into_iter().filter(|&i| t.shape[i] > 1);
    // Cannot overflow: byte_range() already succeeded, so every partial span fits.
    let mut span = 1usize;
    for i in dims {
        if t.strides[i] < span {
            return Err(Error::BadStrides {
                tensor: name,
                reason: format!(
                    "shape {:?} with strides {:?} maps distinct elements to one address \
                     ({} stride {} < {} elements spanned by the smaller dimensions)",
                    t.shape, t.strides, DIM_NAMES[i], t.strides[i], span
                ),
            });
        }
        span += (t.shape[i] - 1) * t.strides[i];
    }
    Ok(())
}

pub(crate) fn lse_byte_range(l: &LseView, b: usize, h: usize, s: usize) -> Result<(u64, u64)> {
    let bytes = b
        .checked_mul(h)
        .and_then(|n| n.checked_mul(s))
        .and_then(|n| n.checked_mul(4))
        .and_then(|n| u64::try_from(n).ok());
    bytes
        .and_then(|n| l.ptr.checked_add(n))
        .map(|end| (l.ptr, end))
        .ok_or_else(|| Error::BadStrides {
            tensor: "lse",
            reason: format!(
                "[{b}, {h}, {s}] float32 at {:#x} overflows 64-bit addressing",
                l.ptr
            ),
        })
}

/// Whether two views that each pass [`check_no_self_overlap`] share no element: their
/// byte ranges are apart, or they have one dtype, shape and strides and `b` starts at an
/// offset from `a` that no index difference reaches (K and V interleaved in one tensor,
/// `[pages, 2, page, H, D]` say). Sufficient, not necessary.
pub(crate) fn views_disjoint(a: &TensorView, b: &TensorView) -> bool {
    let (Some(ra), Some(rb)) = (a.byte_range(), b.byte_range()) else {
        return false;
    };
    if !overlaps(ra, rb) {
        return true;
    }
    let elem = a.dtype.size_bytes() as u64;
    if (a.dtype, a.shape, a.strides) != (b.dtype, b.shape, b.strides) {
        return false;
    }
    let delta = a.ptr.abs_diff(b.ptr);
    if delta == 0 || !delta.is_multiple_of(elem) {
        return false;
    }
    // Strides nest (each steps past the smaller dimensions' span): see `reaches`.
    let mut dims: Vec<(i128, i128)> = (0..4)
        .filter(|&i| a.strides[i] > 0 && a.shape[i] > 1)
        .map(|i| (a.strides[i] as i128, a.shape[i] as i128))
        .collect();
    dims.sort_by_key(|&(stride, _)| std::cmp::Reverse(stride));
    !reaches(i128::from(delta / elem), &dims)
}

/// Whether some index difference `d` (`|d_i| < n_i`) of `dims`, (stride, extent) pairs
/// largest stride first whose strides nest (each exceeds the span of the smaller ones),
/// reaches `left` elements: `Σ d_i · stride_i = left`. At each level the smaller
/// dimensions reach at most their span, less than the stride, so `d_i` is `left / stride`
/// rounded down or up: at most two paths per level. (Differences of either sign count:
/// with padded rows, one position on and one head back can land on the same element.)
fn reaches(left: i128, dims: &[(i128, i128)]) -> bool {
    let Some((&(stride, n), rest)) = dims.split_first() else {
        return left == 0;
    };
    let q = left.div_euclid(stride);
    [q, q + 1]
        .into_iter()
        .any(|d| d.abs() < n && reaches(left - d * stride, rest))
}

/// Half-open ranges `[a0, a1)` and `[b0, b1)` intersect.
pub(crate) fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::tensor::DType;

    const GB: u64 = 1 << 30;

    /// Valid contiguous [B,S,H,D] views at well-separated addresses.
    fn views(
        b: usize,
        sq: usize,
        sk: usize,
        hq: usize,
        hkv: usize,
        d: usize,
    ) -> (TensorView, TensorView, TensorView, TensorView) {
        let dt = DType::F16;
        (
            TensorView::bshd(GB, dt, b, sq, hq, d),
            TensorView::bshd(2 * GB, dt, b, sk, hkv, d),
            TensorView::bshd(3 * GB, dt, b, sk, hkv, d),
            TensorView::bshd(4 * GB, dt, b, sq, hq, d),
        )
    }

    fn run(
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: Option<&LseView>,
    ) -> Result<FwdProblem> {
        validate_fwd(q, k, v, o, lse, &AttentionParams::default())
    }

    #[test]
    fn soft_caps_are_checked_against_the_scale() {
        let (q, k, v, o) = views(1, 64, 64, 4, 4, 64);
        let with = |softmax_scale, softcap| AttentionParams {
            softmax_scale,
            softcap,
            ..Default::default()
        };
        for (scale, cap) in [
            (None, 50.0),
            (None, 1e-3),
            (Some(1e30), 1e30),
            (Some(1e-30), 1e-30),
        ] {
            let p = validate_fwd(&q, &k, &v, &o, None, &with(scale, Some(cap))).unwrap();
            assert_eq!(p.softcap, Some(cap));
        }
        let p = validate_fwd(&q, &k, &v, &o, None, &with(None, None)).unwrap();
        assert_eq!(p.softcap, None);
        // Not finite, not positive, a cap whose exponent factor overflows, and ratios of
        // scale to cap outside the normal floats.
        for (scale, cap) in [
            (None, 0.0),
            (None, -0.0),
            (None, -50.0),
            (None, f32::NAN),
            (None, f32::INFINITY),
            (None, f32::MAX),
            (Some(1e30), 1e-20),
            (Some(1e-30), 1e20),
        ] {
            let e = validate_fwd(&q, &k, &v, &o, None, &with(scale, Some(cap))).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains("softcap must be")),
                "{scale:?} {cap}: {e:?}"
            );
        }
    }

    #[test]
    fn head_dims_text_matches_table() {
        let dims = crate::kernels::attention::FWD_HEAD_DIMS;
        let text: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
        let unpadded = format!("({} without padding)", text.join(", "));
        assert!(FWD_PADDED_HEAD_DIMS_TEXT.ends_with(&unpadded));
    }

    #[test]
    fn valid_bshd_passes() {
        let (q, k, v, o) = views(2, 128, 256, 8, 2, 64);
        let lse = LseView { ptr: 5 * GB };
        let p = validate_fwd(
            &q,
            &k,
            &v,
            &o,
            Some(&lse),
            &AttentionParams {
                softmax_scale: None,
                causal: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            p,
            FwdProblem {
                shape: AttnShape {
                    batch: 2,
                    seqlen_q: 128,
                    seqlen_k: 256,
                    heads_q: 8,
                    heads_kv: 2,
                    head_dim: 64,
                },
                dtype: HalfType::F16,
                scale: 0.125,
                causal: true,
                window: None,
                packed: None,
                softcap: None,
                seqused_k: None,
                pages: None,
            }
        );
        assert_eq!(p.shape.group(), 4);
    }

    #[test]
    fn valid_bhsd_passes() {
        let dt = DType::Bf16;
        let q = TensorView::bhsd(GB, dt, 3, 77, 4, 128);
        let k = TensorView::bhsd(2 * GB, dt, 3, 50, 1, 128);
        let v = TensorView::bhsd(3 * GB, dt, 3, 50, 1, 128);
        let o = TensorView::bhsd(4 * GB, dt, 3, 77, 4, 128);
        let p = validate_fwd(
            &q,
            &k,
            &v,
            &o,
            None,
            &AttentionParams {
                softmax_scale: Some(0.3),
                causal: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(p.dtype, HalfType::Bf16);
        assert_eq!(
            (
                p.shape.seqlen_q,
                p.shape.seqlen_k,
                p.shape.heads_q,
                p.shape.heads_kv
            ),
            (77, 50, 4, 1)
        );
        assert_eq!(p.scale, 0.3);
    }

    #[test]
    fn valid_packed_qkv_passes() {
        // One [B, S, 3, H, D] buffer: q, k, v interleave (allowed, they are only read).
        let (b, s, h, d) = (2usize, 33usize, 4usize, 32usize);
        let strides = [s * 3 * h * d, 3 * h * d, d, 1];
        let base = GB;
        let dt = DType::F16;
        let step = (h * d * 2) as u64;
        let q = TensorView::strided(base, dt, [b, s, h, d], strides);
        let k = TensorView::strided(base + step, dt, [b, s, h, d], strides);
        let v = TensorView::strided(base + 2 * step, dt, [b, s, h, d], strides);
        let o = TensorView::bshd(4 * GB, dt, b, s, h, d);
        run(&q, &k, &v, &o, None).unwrap();
    }

    #[test]
    fn dtype_mismatch() {
        let (q, mut k, v, o) = views(1, 16, 16, 2, 2, 64);
        k.dtype = DType::Bf16;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::UnsupportedDType(ref m) if m.contains("k bf16")),
            "{e}"
        );
    }

    #[test]
    fn dtype_f32_unsupported() {
        let (mut q, mut k, mut v, mut o) = views(1, 16, 16, 2, 2, 64);
        for t in [&mut q, &mut k, &mut v, &mut o] {
            t.dtype = DType::F32;
        }
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::UnsupportedDType(ref m) if m.contains("f32")),
            "{e}"
        );
    }

    #[test]
    fn empty_dimension() {
        let (q, k, mut v, o) = views(1, 16, 16, 2, 2, 64);
        v.shape[1] = 0;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::EmptyDimension {
                    tensor: "v",
                    dim: "seqlen"
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn unsupported_head_dim() {
        for d in [4, 20, 36, 100, 264, 512] {
            let (q, k, v, o) = views(1, 16, 16, 2, 2, d);
            let e = run(&q, &k, &v, &o, None).unwrap_err();
            assert!(
                matches!(e, Error::UnsupportedHeadDim(got, FWD_PADDED_HEAD_DIMS_TEXT) if got == d),
                "{d}: {e}"
            );
        }
    }

    /// Multiples of 8 below 256 without a kernel of their own run padded.
    #[test]
    fn padded_head_dims_pass() {
        for d in [8, 24, 40, 72, 80, 104, 160, 200, 248] {
            let (q, k, v, o) = views(1, 16, 16, 2, 2, d);
            run(&q, &k, &v, &o, None).unwrap_or_else(|e| panic!("{d}: {e}"));
        }
    }

    #[test]
    fn shape_mismatch_q_o() {
        let (q, k, v, _) = views(1, 16, 16, 2, 2, 64);
        let o = TensorView::bshd(4 * GB, DType::F16, 1, 17, 2, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::ShapeMismatch(ref m) if m.contains("17")),
            "{e}"
        );
    }

    #[test]
    fn shape_mismatch_k_v() {
        let (q, k, _, o) = views(1, 16, 16, 2, 2, 64);
        let v = TensorView::bshd(3 * GB, DType::F16, 1, 16, 1, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch(_)), "{e}");
    }

    #[test]
    fn shape_mismatch_batch() {
        let (q, _, _, o) = views(2, 16, 16, 2, 2, 64);
        let (_, k, v, _) = views(3, 16, 16, 2, 2, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::ShapeMismatch(ref m) if m.contains("batch")),
            "{e}"
        );
    }

    #[test]
    fn shape_mismatch_head_dim() {
        let (q, _, _, o) = views(1, 16, 16, 2, 2, 64);
        let (_, k, v, _) = views(1, 16, 16, 2, 2, 128);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::ShapeMismatch(ref m) if m.contains("head_dim")),
            "{e}"
        );
    }

    #[test]
    fn head_ratio() {
        let (q, k, v, o) = views(1, 16, 16, 6, 4, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::HeadRatio { hq: 6, hkv: 4 }), "{e}");
    }

    #[test]
    fn seqlen_limit() {
        let (q, _, _, o) = views(1, 16, 16, 2, 2, 64);
        for sk in [MAX_SEQLEN + 1, (1 << 31) - 1, 1 << 31] {
            let (_, k, v, _) = views(1, 16, sk, 2, 2, 64);
            let e = run(&q, &k, &v, &o, None).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(ref m) if m.contains("seqlen_k")),
                "{e}"
            );
        }
        // At the limit (K and V 32 GiB apiece, placed apart).
        let k = TensorView::bshd(64 * GB, DType::F16, 1, MAX_SEQLEN, 2, 64);
        let v = TensorView::bshd(128 * GB, DType::F16, 1, MAX_SEQLEN, 2, 64);
        assert!(run(&q, &k, &v, &o, None).is_ok());
        let (q, _, _, o) = views(1, MAX_SEQLEN + 1, 16, 2, 2, 64);
        let (_, k, v, _) = views(1, 16, 16, 2, 2, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("seqlen_q")),
            "{e}"
        );
    }

    #[test]
    fn batch_limit() {
        let (q, k, v, o) = views(65536, 16, 16, 2, 2, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("batch")),
            "{e}"
        );
        let (q, k, v, o) = views(65535, 16, 16, 2, 2, 64);
        assert!(run(&q, &k, &v, &o, None).is_ok());
    }

    #[test]
    fn heads_limit() {
        let (q, k, v, o) = views(1, 16, 16, 65536, 1, 32);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("heads")),
            "{e}"
        );
    }

    #[test]
    fn bad_softmax_scale() {
        let (q, k, v, o) = views(1, 16, 16, 2, 2, 64);
        for s in [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            -0.5,
            f32::MAX,
        ] {
            let p = AttentionParams {
                softmax_scale: Some(s),
                causal: false,
                ..Default::default()
            };
            let e = validate_fwd(&q, &k, &v, &o, None, &p).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("softmax_scale")));
        }
        let p = AttentionParams {
            softmax_scale: Some(1e-30),
            causal: false,
            ..Default::default()
        };
        assert!(validate_fwd(&q, &k, &v, &o, None, &p).is_ok());
    }

    #[test]
    fn null_pointer() {
        let (q, k, v, mut o) = views(1, 16, 16, 2, 2, 64);
        o.ptr = 0;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::NullPointer("o")), "{e}");
    }

    #[test]
    fn misaligned_pointer() {
        let (q, mut k, v, o) = views(1, 16, 16, 2, 2, 64);
        k.ptr += 8;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::Misaligned { tensor: "k", ptr, align: 16 } if ptr == 2 * GB + 8),
            "{e}"
        );
    }

    #[test]
    fn lse_null() {
        let (q, k, v, o) = views(1, 16, 16, 2, 2, 64);
        let e = run(&q, &k, &v, &o, Some(&LseView { ptr: 0 })).unwrap_err();
        assert!(matches!(e, Error::NullPointer("lse")), "{e}");
    }

    #[test]
    fn lse_misaligned() {
        let (q, k, v, o) = views(1, 16, 16, 2, 2, 64);
        let e = run(&q, &k, &v, &o, Some(&LseView { ptr: 5 * GB + 2 })).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Misaligned {
                    tensor: "lse",
                    align: 4,
                    ..
                }
            ),
            "{e}"
        );
        // 4-byte alignment is enough for the LSE.
        assert!(run(&q, &k, &v, &o, Some(&LseView { ptr: 5 * GB + 4 })).is_ok());
    }

    #[test]
    fn head_dim_stride_not_one() {
        let (q, k, v, o) = views(1, 16, 16, 2, 2, 64);
        let q = TensorView::strided(q.ptr, q.dtype, q.shape, [16 * 2 * 128, 2 * 128, 128, 2]);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::BadStrides { tensor: "q", ref reason } if reason.contains("head_dim")),
            "{e}"
        );
    }

    #[test]
    fn stride_not_16_byte_multiple() {
        let (q, _, v, o) = views(1, 16, 16, 2, 2, 64);
        // Head stride 68 elements = 136 bytes: 8-byte aligned only.
        let k = TensorView::strided(2 * GB, DType::F16, [1, 16, 2, 64], [16 * 136, 136, 68, 1]);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::BadStrides { tensor: "k", ref reason } if reason.contains("136 bytes")),
            "{e}"
        );
    }

    #[test]
    fn stride_of_unit_dimension_ignored() {
        let (_, k, v, o) = views(1, 16, 16, 2, 2, 64);
        // Batch of 1 with a junk batch stride, as frameworks produce after slicing.
        let q = TensorView::strided(GB, DType::F16, [1, 16, 2, 64], [3, 128, 64, 1]);
        assert!(run(&q, &k, &v, &o, None).is_ok());
    }

    #[test]
    fn extent_overflow() {
        let (q, k, _, o) = views(1, 16, 16, 2, 2, 64);
        let v = TensorView::strided(
            3 * GB,
            DType::F16,
            [1, 16, 2, 64],
            [0, usize::MAX / 8 * 8, 64, 1],
        );
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::BadStrides { tensor: "v", .. }), "{e}");
        // Fits in elements but runs past the end of the address space.
        let v = TensorView::bshd(u64::MAX - 15, DType::F16, 1, 16, 2, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::BadStrides { tensor: "v", .. }), "{e}");
    }

    #[test]
    fn lse_extent_overflow() {
        let (q, k, v, o) = views(1, 16, 16, 2, 2, 64);
        let e = run(&q, &k, &v, &o, Some(&LseView { ptr: u64::MAX - 3 })).unwrap_err();
        assert!(matches!(e, Error::BadStrides { tensor: "lse", .. }), "{e}");
    }

    #[test]
    fn output_self_overlap() {
        let (q, k, v, _) = views(1, 16, 16, 2, 2, 64);
        // Both heads write to the same memory.
        let o = TensorView::strided(4 * GB, DType::F16, [1, 16, 2, 64], [1024, 64, 0, 1]);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::BadStrides { tensor: "o", .. }), "{e}");
        // Head 1 of row i aliases head 0 of row i + 1.
        let o = TensorView::strided(4 * GB, DType::F16, [1, 16, 2, 64], [4096, 64, 64, 1]);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::BadStrides { tensor: "o", .. }), "{e}");
        // Padded rows are fine.
        let o = TensorView::strided(4 * GB, DType::F16, [1, 16, 2, 64], [0, 256, 64, 1]);
        assert!(run(&q, &k, &v, &o, None).is_ok());
    }

    #[test]
    fn output_overlaps_input() {
        let (q, k, v, _) = views(1, 16, 16, 2, 2, 64);
        // o starts inside q's last row.
        let o = TensorView::bshd(q.ptr + (16 * 2 * 64 - 8) * 2, DType::F16, 1, 16, 2, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("overlaps q")),
            "{e}"
        );
        // Adjacent, not overlapping.
        let o = TensorView::bshd(q.ptr + 16 * 2 * 64 * 2, DType::F16, 1, 16, 2, 64);
        assert!(run(&q, &k, &v, &o, None).is_ok());
        // In place over v.
        let o = TensorView::bshd(v.ptr, DType::F16, 1, 16, 2, 64);
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("overlaps v")),
            "{e}"
        );
    }

    #[test]
    fn lse_overlaps_output() {
        let (q, k, v, o) = views(1, 16, 16, 2, 2, 64);
        let e = run(&q, &k, &v, &o, Some(&LseView { ptr: o.ptr + 64 })).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("lse")),
            "{e}"
        );
        // LSE is [1, 2, 16] f32 = 128 bytes: ending exactly at o is fine.
        assert!(run(&q, &k, &v, &o, Some(&LseView { ptr: o.ptr - 128 })).is_ok());
        let e = run(&q, &k, &v, &o, Some(&LseView { ptr: o.ptr - 124 })).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }

    #[test]
    fn basic_failures_reported_first() {
        // Wrong dtype, empty dim, null pointer and bad strides at once: dtype wins.
        let (mut q, k, v, o) = views(1, 16, 16, 2, 2, 64);
        q.dtype = DType::F32;
        q.shape[0] = 0;
        q.ptr = 0;
        q.strides[3] = 2;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::UnsupportedDType(_)), "{e}");
        q.dtype = DType::F16;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(
            matches!(
                e,
                Error::EmptyDimension {
                    tensor: "q",
                    dim: "batch"
                }
            ),
            "{e}"
        );
        q.shape[0] = 1;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::NullPointer("q")), "{e}");
        q.ptr = GB;
        let e = run(&q, &k, &v, &o, None).unwrap_err();
        assert!(matches!(e, Error::BadStrides { tensor: "q", .. }), "{e}");
    }
}
