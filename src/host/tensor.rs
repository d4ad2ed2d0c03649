//! Tensor views: a device pointer plus dtype, shape and strides. Nothing here owns memory
//! or touches the driver; [`crate::host::validate`] decides whether a view is usable.
//!
//! Every view has the logical dimensions `[batch, seq, heads, head_dim]`, whatever its
//! memory order: other layouts (`[B, H, S, D]`, slices of packed QKV buffers) are
//! expressed through the strides alone, so kernels only ever see one indexing scheme.

use crate::kernels::attention::HalfType;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16,
    Bf16,
    F32,
    /// FP8 E4M3 (the FP8 path's Q and K; see [`crate::host::fp8`]).
    E4m3,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F16 | DType::Bf16 => 2,
            DType::F32 => 4,
            DType::E4m3 => 1,
        }
    }

    /// Short lower-case name (`"f16"`, `"bf16"`, `"f32"`), as used in kernel ids.
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::E4m3 => "e4m3",
        }
    }

    /// The kernels' 16-bit element type, or `None` for a dtype no kernel takes.
    pub fn half_type(self) -> Option<HalfType> {
        match self {
            DType::F16 => Some(HalfType::F16),
            DType::Bf16 => Some(HalfType::Bf16),
            DType::F32 | DType::E4m3 => None,
        }
    }
}

impl From<HalfType> for DType {
    fn from(h: HalfType) -> DType {
        match h {
            HalfType::F16 => DType::F16,
            HalfType::Bf16 => DType::Bf16,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Index of each logical dimension in [`TensorView::shape`] and [`TensorView::strides`].
pub const DIM_BATCH: usize = 0;
/// See [`DIM_BATCH`].
pub const DIM_SEQ: usize = 1;
/// See [`DIM_BATCH`].
pub const DIM_HEADS: usize = 2;
/// See [`DIM_BATCH`].
pub const DIM_HEAD_DIM: usize = 3;
/// Names of the logical dimensions, in order, for error messages.
pub const DIM_NAMES: [&str; 4] = ["batch", "seqlen", "heads", "head_dim"];

/// A 4-d device tensor with logical dimensions `[batch, seq, heads, head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorView {
    /// Device address (`CUdeviceptr`) of element `[0, 0, 0, 0]`.
    pub ptr: u64,
    pub dtype: DType,
    /// `[batch, seq, heads, head_dim]`.
    pub shape: [usize; 4],
    /// Strides in elements (not bytes) of the logical dimensions.
    pub strides: [usize; 4],
}

impl TensorView {
    /// A contiguous `[B, S, H, D]` tensor.
    ///
    /// Strides are computed with saturating arithmetic so that an absurd shape yields a
    /// view that validation rejects as overflowing rather than a silently wrapped stride.
    pub fn bshd(ptr: u64, dtype: DType, b: usize, s: usize, h: usize, d: usize) -> TensorView {
        let hd = h.saturating_mul(d);
        let shd = s.saturating_mul(hd);
        TensorView {
            ptr,
            dtype,
            shape: [b, s, h, d],
            strides: [shd, hd, d, 1],
        }
    }

    /// A tensor stored contiguously as `[B, H, S, D]`; the logical shape is still
    /// `[b, s, h, d]`, only the strides differ from [`TensorView::bshd`].
    pub fn bhsd(ptr: u64, dtype: DType, b: usize, s: usize, h: usize, d: usize) -> TensorView {
        let sd = s.saturating_mul(d);
        let hsd = h.saturating_mul(sd);
        TensorView {
            ptr,
            dtype,
            shape: [b, s, h, d],
            strides: [hsd, d, sd, 1],
        }
    }

    /// Any layout: `shape` is `[batch, seq, heads, head_dim]`, `strides` in elements.
    pub fn strided(ptr: u64, dtype: DType, shape: [usize; 4], strides: [usize; 4]) -> TensorView {
        TensorView {
            ptr,
            dtype,
            shape,
            strides,
        }
    }

    pub fn batch(&self) -> usize {
        self.shape[DIM_BATCH]
    }

    pub fn seqlen(&self) -> usize {
        self.shape[DIM_SEQ]
    }

    pub fn heads(&self) -> usize {
        self.shape[DIM_HEADS]
    }

    pub fn head_dim(&self) -> usize {
        self.shape[DIM_HEAD_DIM]
    }

    /// Number of logical elements, or `None` on overflow.
    pub fn numel(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &n| acc.checked_mul(n))
    }

    /// Element offset of the last logical element (`Σ (shape_i − 1) · stride_i`), or `None`
    /// if that overflows or the tensor is empty.
    pub fn max_offset(&self) -> Option<usize> {
        let mut off = 0usize;
        for (&n, &st) in self.shape.iter().zip(&self.strides) {
            off = off.checked_add(n.checked_sub(1)?.checked_mul(st)?)?;
        }
        Some(off)
    }

    /// Device byte range `[start, end)` that the view can touch, or `None` if it overflows
    /// (in elements, in bytes, or in the 64-bit address space) or the tensor is empty.
    /// Strides are unsigned, so element `[0, 0, 0, 0]` is always the lowest address.
    pub fn byte_range(&self) -> Option<(u64, u64)> {
        let last = self.max_offset()?;
        let bytes = last.checked_add(1)?.checked_mul(self.dtype.size_bytes())?;
        let end = self.ptr.checked_add(u64::try_from(bytes).ok()?)?;
        Some((self.ptr, end))
    }

    /// Whether the memory order is exactly contiguous `[B, S, H, D]`.
    pub fn is_contiguous_bshd(&self) -> bool {
        let [b, s, h, d] = self.shape;
        *self == TensorView::bshd(self.ptr, self.dtype, b, s, h, d)
    }
}

/// The log-sum-exp output: contiguous float32 `[B, Hq, Sq]`, its shape implied by Q.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LseView {
    /// Device address (`CUdeviceptr`) of `lse[0, 0, 0]`.
    pub ptr: u64,
}

/// Forward-attention options.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AttentionParams {
    /// Multiplier of `q · k` (finite and positive); `None` means `1 / sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    /// Causal masking, aligned bottom-right when `seqlen_q != seqlen_k`.
    pub causal: bool,
    /// A local (sliding) window of keys around each query's diagonal; the default has no
    /// bound on either side. With `causal` its right side is 0 (a right bound above 0
    /// is refused).
    pub window: Window,
    /// Logit soft-capping (Gemma 2, Grok; FlashAttention's `softcap`): each scaled score
    /// `x = q·k · softmax_scale` becomes `cap · tanh(x / cap)` before masking and the
    /// softmax, and the log-sum-exp is that of the capped scores. `None` (the default)
    /// leaves scores as they are; a cap must be finite and positive (FlashAttention's 0
    /// is `None` here). The 16-bit forward and decode take it; the FP8 forward refuses it.
    pub softcap: Option<f32>,
}

/// FlashAttention's `window_size`: query row `i` of a sequence of `Sq` queries and `Sk`
/// keys, whose diagonal is key `d = i + Sk − Sq` (bottom-right alignment, as causal
/// masking), sees the keys `d − left ..= d + right` that exist. `None` leaves a side
/// unbounded (FlashAttention's −1). Causal masking is `right = 0`; a sliding window of
/// `w` keys, as Mistral or Gemma use it, is `causal` with `left = w − 1`
/// ([`Window::sliding`]). A row whose window holds no key gives zeros and an LSE of −∞.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Window {
    /// Keys before the diagonal a row sees.
    pub left: Option<u32>,
    /// Keys after the diagonal a row sees.
    pub right: Option<u32>,
}

impl Window {
    /// No bound on either side: every key (or, with causal masking, every key up to the
    /// diagonal).
    pub const FULL: Window = Window {
        left: None,
        right: None,
    };

    /// The `keys` keys up to and including the diagonal (`left = keys − 1`, `right = 0`):
    /// a causal sliding window. A window holds at least the diagonal: `keys` 0 gives
    /// what 1 does.
    pub fn sliding(keys: u32) -> Window {
        Window {
            left: Some(keys.saturating_sub(1)),
            right: Some(0),
        }
    }

    /// `(left, right)` in FlashAttention's convention, −1 for a side without a bound
    /// (any negative value reads as −1).
    pub fn from_flash(left: i64, right: i64) -> Window {
        let side = |x: i64| (x >= 0).then(|| u32::try_from(x).unwrap_or(u32::MAX));
        Window {
            left: side(left),
            right: side(right),
        }
    }
}

pub use crate::kernels::attention::WINDOW_UNBOUNDED;

/// The masking a call runs with, resolved from its [`AttentionParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Masking {
    /// Keys past a row's diagonal (shifted by the window's right side) are masked: the
    /// causal kernels, which skip the key tiles no row of a query tile sees.
    pub causal: bool,
    /// The window's sides, each at most [`WINDOW_UNBOUNDED`], when a window bounds
    /// something causal masking alone does not (then `causal` is set too).
    pub window: Option<KeyWindow>,
}

/// A window's sides as the kernels take them: row `i` with diagonal `d` sees keys
/// `d − left ..= d + right`, each side at most [`WINDOW_UNBOUNDED`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyWindow {
    pub left: u32,
    pub right: u32,
}

impl AttentionParams {
    /// Causal masking with a sliding window of `keys` keys (see [`Window::sliding`]).
    pub fn sliding_window(keys: u32) -> AttentionParams {
        AttentionParams {
            causal: true,
            window: Window::sliding(keys),
            ..Default::default()
        }
    }

    /// The masking of a call whose sequences have at most `max_q` queries and `max_k`
    /// keys: a side that bounds no row of such sequences is dropped (a left side of
    /// `max_k` or more, a right side of `max_q` or more), a right side of 0 alone is
    /// causal masking. Causal masking with a right side above 0 is an
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    pub fn masking(&self, max_q: usize, max_k: usize) -> crate::Result<Masking> {
        let right = match (self.causal, self.window.right) {
            (true, Some(r)) if r > 0 => {
                return Err(crate::Error::InvalidArgument(format!(
                    "causal masking sees no key past the diagonal, but the window's right \
                     side is {r}; pass right = 0 or none with causal"
                )));
            }
            (true, _) => Some(0),
            (false, r) => r.filter(|&r| (r as usize) < max_q),
        };
        let left = self.window.left.filter(|&l| (l as usize) < max_k);
        Ok(match (left, right) {
            (None, None) => Masking::default(),
            (None, Some(0)) => Masking {
                causal: true,
                window: None,
            },
            (left, right) => {
                let side = |s: Option<u32>| s.map_or(WINDOW_UNBOUNDED, |s| s.min(WINDOW_UNBOUNDED));
                Masking {
                    causal: true,
                    window: Some(KeyWindow {
                        left: side(left),
                        right: side(right),
                    }),
                }
            }
        })
    }

    /// Logit soft-capping at `cap` ([`AttentionParams::softcap`]) on top of these options.
    pub fn with_softcap(self, cap: f32) -> AttentionParams {
        AttentionParams {
            softcap: Some(cap),
            ..self
        }
    }

    /// The scale actually applied for this head dimension.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        // Computed in f64 so the default is the correctly rounded f32 of 1/sqrt(d).
        self.softmax_scale
            .unwrap_or_else(|| (1.0 / (head_dim as f64).sqrt()) as f32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_sizes_and_names() {
        assert_eq!(DType::F16.size_bytes(), 2);
        assert_eq!(DType::Bf16.size_bytes(), 2);
        assert_eq!(DType::F32.size_bytes(), 4);
        assert_eq!(DType::F16.name(), "f16");
        assert_eq!(DType::Bf16.name(), "bf16");
        assert_eq!(DType::F32.name(), "f32");
        assert_eq!(DType::from(HalfType::Bf16), DType::Bf16);
        assert_eq!(DType::F32.half_type(), None);
        assert_eq!(DType::F16.half_type(), Some(HalfType::F16));
    }

    #[test]
    fn bshd_strides() {
        let t = TensorView::bshd(0x1000, DType::F16, 2, 3, 4, 64);
        assert_eq!(t.shape, [2, 3, 4, 64]);
        assert_eq!(t.strides, [3 * 4 * 64, 4 * 64, 64, 1]);
        assert_eq!(
            (t.batch(), t.seqlen(), t.heads(), t.head_dim()),
            (2, 3, 4, 64)
        );
        assert_eq!(t.numel(), Some(2 * 3 * 4 * 64));
        assert_eq!(t.max_offset(), Some(2 * 3 * 4 * 64 - 1));
        assert_eq!(t.byte_range(), Some((0x1000, 0x1000 + 2 * 2 * 3 * 4 * 64)));
        assert!(t.is_contiguous_bshd());
    }

    #[test]
    fn bhsd_strides() {
        let t = TensorView::bhsd(0, DType::Bf16, 2, 3, 4, 64);
        assert_eq!(t.shape, [2, 3, 4, 64]);
        // Memory order [B, H, S, D]: seq stride D, head stride S*D.
        assert_eq!(t.strides, [4 * 3 * 64, 64, 3 * 64, 1]);
        // Same footprint as the contiguous layout, just permuted.
        assert_eq!(t.max_offset(), Some(2 * 3 * 4 * 64 - 1));
        assert!(!t.is_contiguous_bshd());
    }

    #[test]
    fn overflow_is_none() {
        let t = TensorView::bshd(0, DType::F16, 2, usize::MAX / 2, 4, 64);
        assert_eq!(t.max_offset(), None);
        let t = TensorView::strided(u64::MAX - 8, DType::F16, [1, 1, 1, 64], [0, 0, 0, 1]);
        assert_eq!(t.byte_range(), None);
        let t = TensorView::strided(0, DType::F16, [1, 0, 1, 64], [0, 64, 64, 1]);
        assert_eq!(t.max_offset(), None);
    }

    #[test]
    fn windows_resolve_to_the_masking_the_kernels_run() {
        let params = |causal, left, right| AttentionParams {
            causal,
            window: Window { left, right },
            ..Default::default()
        };
        let window = |left, right| Masking {
            causal: true,
            window: Some(KeyWindow { left, right }),
        };
        let m = |p: AttentionParams| p.masking(100, 1000).unwrap();
        let unbounded = WINDOW_UNBOUNDED;
        // No bound, or bounds no row of such sequences meets: no mask, or causal.
        assert_eq!(m(params(false, None, None)), Masking::default());
        assert_eq!(m(params(false, Some(1000), Some(100))), Masking::default());
        assert_eq!(m(params(false, Some(u32::MAX), None)), Masking::default());
        let causal = Masking {
            causal: true,
            window: None,
        };
        assert_eq!(m(params(true, None, None)), causal);
        assert_eq!(m(params(true, None, Some(0))), causal);
        assert_eq!(m(params(false, None, Some(0))), causal);
        assert_eq!(m(params(true, Some(5000), None)), causal);
        // A bound that cuts: the windowed kernels, the other side unbounded.
        assert_eq!(m(params(true, Some(999), None)), window(999, 0));
        assert_eq!(m(params(true, Some(0), None)), window(0, 0));
        assert_eq!(m(params(false, Some(7), None)), window(7, unbounded));
        assert_eq!(m(params(false, None, Some(99))), window(unbounded, 99));
        assert_eq!(m(params(false, Some(3), Some(4))), window(3, 4));
        assert_eq!(
            AttentionParams::sliding_window(4096)
                .masking(100, 10_000)
                .unwrap(),
            window(4095, 0)
        );
        // Causal masking sees nothing past the diagonal.
        let err = params(true, Some(3), Some(1))
            .masking(100, 1000)
            .unwrap_err();
        assert!(matches!(err, crate::Error::InvalidArgument(_)), "{err}");
    }

    #[test]
    fn flash_windows_read_negative_sides_as_unbounded() {
        assert_eq!(Window::from_flash(-1, -1), Window::FULL);
        assert_eq!(
            Window::from_flash(-7, 0),
            Window {
                left: None,
                right: Some(0)
            }
        );
        assert_eq!(Window::from_flash(1 << 40, 3).left, Some(u32::MAX));
        assert_eq!(Window::sliding(1), Window::from_flash(0, 0));
        assert_eq!(Window::sliding(0), Window::from_flash(0, 0));
    }

    #[test]
    fn default_scale() {
        let p = AttentionParams::default();
        assert_eq!(p.softmax_scale, None);
        assert!(!p.causal);
        assert_eq!(p.scale_for(64), 0.125);
        assert_eq!(p.scale_for(128), (1.0 / 128f64.sqrt()) as f32);
        let p = AttentionParams {
            softmax_scale: Some(0.5),
            causal: true,
            ..Default::default()
        };
        assert_eq!(p.scale_for(64), 0.5);
    }
}
