//! Serving calls on an [`Attention`]: decode against a KV cache (split-KV, GQA packed,
//! contiguous or paged), appending to a cache, and merging partial results by their
//! log-sum-exp.
//!
//! Decode chooses its number of splits from the capacities (batch, heads, the cache's
//! positions per sequence) and the GPU, never from the lengths, so a captured CUDA graph
//! of a decode step stays right as the sequences grow. With more than one split, the
//! partial results go to a float32 workspace and the merge kernel combines them (on
//! Hopper launched with programmatic stream serialization, so that its launch is under
//! way while the decode kernel finishes); the caller passes the workspace
//! ([`Attention::decode_plan`] says how large) or flashcore takes it from the
//! stream-ordered allocator for the call.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::CUstream;

use super::attention::{
    Attention, PathChoice, Sm90Operands, plan_problem, sm90_maps, sm90_paged_maps,
};
use super::device::ContextScope;
use super::kv_cache::{CacheLayout, CacheShape, HostMetadata, KvCache};
use super::launch::{LaunchDims, PaddedParams, launch, launch_programmatic};
use super::module::{Carveout, LoadedKernel};
use super::tensor::{AttentionParams, DType, KeyWindow, LseView, TensorView, WINDOW_UNBOUNDED};
use super::validate::{
    FWD_PADDED_HEAD_DIMS_TEXT, FwdProblem, LSE_ALIGN, MAX_GRID_YZ, MAX_SEQLEN, Packed, PageTable,
    Runs, TENSOR_ALIGN, byte_range_of, check_no_self_overlap, check_not_empty, check_pointer,
    check_scale, check_strides, checked_softcap, lse_byte_range, overlaps, validate_fwd,
    views_disjoint,
};
use super::varlen::Varlen;
use crate::error::{Error, Result};
use crate::kernels::attention::append::{AppendArgs, AppendConfig, THREADS as APPEND_THREADS};
use crate::kernels::attention::decode::{
    self, DecodeArgs, DecodeConfig, DecodeLayout, MAX_QUERIES, ROWS,
};
use crate::kernels::attention::merge::{self, MergeArgs, MergeConfig, MergeType};
use crate::kernels::attention::softcap::ScoreScaling;
use crate::kernels::attention::{CacheReads, FwdConfig, HalfType, Path};
use crate::shape::AttnShape;

/// The head dims of decode with a 16-bit cache and of the merge, as error text: those of
/// the forward, the same kernels serving them ([`decode::kernel_head_dim`],
/// [`merge::kernel_head_dim`]).
const HEAD_DIMS_TEXT: &str = FWD_PADDED_HEAD_DIMS_TEXT;
/// The smallest page the forward kernels read a paged cache in (smaller pages run on the
/// decode kernels): a tile's TMA chunks are whole pages or parts of them, and each must
/// start on a 1024-byte swizzle pattern (8 rows of 128 bytes).
const MIN_FORWARD_PAGE: usize = 16;
/// The fewest keys a split is given: below this the merge costs more than it saves.
const MIN_SPLIT_KEYS: usize = 256;
/// The most splits of one sequence.
const MAX_SPLITS: usize = 128;

/// A validated decode call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeProblem {
    pub cache: CacheShape,
    pub dtype: HalfType,
    pub seqlen_q: usize,
    pub heads_q: usize,
    pub scale: f32,
    /// Keys past each query's position (moved by the window's right side) are masked.
    pub causal: bool,
    /// The key window beyond causal masking, if any: see [`AttentionParams::masking`].
    pub window: Option<KeyWindow>,
    /// The soft cap of the scores, if any ([`AttentionParams::softcap`], checked).
    pub softcap: Option<f32>,
    /// Packed queries, `seqlen_q` bounding each sequence's. With packed keys
    /// (`cu_seqlens_k` non-null), a variable-length forward call's sequences run on the
    /// decode kernels (`Attention::varlen_by_decode`): `cache` then counts the
    /// sequences, the keys of the longest one (or an upper bound) as the capacity.
    /// Without (`Attention::decode_varlen`), queries packed over a real cache, whose
    /// capacity `total_k` is.
    pub packed: Option<Packed>,
}

impl DecodeProblem {
    /// Where the decode kernels find the sequences' keys (and whether their queries are
    /// packed).
    pub fn layout(&self) -> DecodeLayout {
        let paged = self.cache.page_size > 0;
        match (self.packed.map(|p| p.cu_seqlens_k != 0), paged) {
            (Some(true), _) => DecodeLayout::Packed,
            (Some(false), false) => DecodeLayout::PackedOverContiguous,
            (Some(false), true) => DecodeLayout::PackedOverPaged,
            (None, false) => DecodeLayout::Contiguous,
            (None, true) => DecodeLayout::Paged,
        }
    }

    /// Query heads per KV head (a problem from [`decode_problem`] divides evenly; a
    /// hand-made one with no KV heads counts as one, so this never divides by zero).
    pub fn group(&self) -> usize {
        self.heads_q / self.cache.heads_kv.max(1)
    }

    /// 16-row chunks of the `Sq · group` query rows that share a KV head.
    pub fn row_chunks(&self) -> usize {
        self.seqlen_q
            .saturating_mul(self.group())
            .div_ceil(ROWS as usize)
    }
}

/// How a decode call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    pub config: DecodeConfig,
    /// Key runs per sequence, each its own block; 1 writes the output directly.
    pub splits: usize,
    /// Bytes of workspace the call needs (0 with one split).
    pub workspace_bytes: usize,
}

/// Device memory a call may use for scratch: a decode's partial results, the FP8
/// quantizer's operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workspace {
    /// Device address, 256-byte aligned ([`Error::Misaligned`] otherwise), as
    /// `cuMemAlloc` returns them.
    pub ptr: u64,
    /// Its size in bytes.
    pub bytes: usize,
}

/// Shards of attention over disjoint key sets, to merge: shard `i`'s output is `o` moved
/// `i · shard_stride` elements, its LSE float32 `[B, H, S]` at `lse + 4·i·B·H·S`
/// (contiguous `[count, B, H, S]`), as the forward writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergeParts {
    /// Shard 0's output, `[B, S, H, D]`, f16, bf16 or f32.
    pub o: TensorView,
    pub count: usize,
    /// Elements from one shard's output to the next.
    pub shard_stride: usize,
    pub lse: u64,
}

fn dtype_text(t: DType) -> &'static str {
    t.name()
}

/// The append kernels' 32-bit element counter steps by the grid's threads: the largest
/// count of 16-byte chunks one append may move leaves room for the last step (at most
/// [`APPEND_MAX_BLOCKS`] blocks) and for the e4m3 kernel's rounding up to whole warps,
/// below 2^31.
const MAX_APPEND_CHUNKS: usize = (1 << 31) - 1 - 32 - APPEND_MAX_BLOCKS * APPEND_THREADS as usize;

/// The most blocks an append launches (it takes 8 per SM, fewer for small appends).
const APPEND_MAX_BLOCKS: usize = 1 << 12;

/// What an append writes (the cache's K and V, and an e4m3 cache's scales) must be
/// memory of its own: each element once (no zero or aliasing strides), K apart from V
/// element by element (they may interleave), the scales apart from the codes and each
/// other ([`KvScales::check_apart`](super::kv_cache::KvScales::check_apart)), and all of it apart from the lengths and the block
/// table the kernel reads meanwhile.
fn check_append_targets(cache: &KvCache, batch: usize) -> Result<()> {
    for (name, t) in [("k_cache", &cache.k), ("v_cache", &cache.v)] {
        check_no_self_overlap(name, t)?;
    }
    if let Some(scales) = &cache.scales {
        // A scale per (position, head): repeated or shared ones (which a decode may read)
        // would be written by several threads at once.
        scales.check_apart(cache)?;
    }
    if !views_disjoint(&cache.k, &cache.v) {
        return Err(Error::InvalidArgument(
            "an append writes k_cache and v_cache, whose elements overlap".into(),
        ));
    }
    let metadata = cache.metadata_ranges(batch)?;
    for (name, r) in cache.data_ranges().into_iter().flatten() {
        for &(other, o) in metadata.iter().flatten() {
            if overlaps(r, o) {
                return Err(Error::InvalidArgument(format!(
                    "an append writes the cache's {name}, whose memory overlaps its {other}"
                )));
            }
        }
    }
    Ok(())
}

/// o's first rules, checked before q's and the cache's: q's dtype, not empty.
pub(crate) fn check_output_dtype(q: &TensorView, o: &TensorView) -> Result<()> {
    if o.dtype != q.dtype {
        return Err(Error::UnsupportedDType(format!(
            "q and o must share one dtype, got q {}, o {}",
            dtype_text(q.dtype),
            dtype_text(o.dtype)
        )));
    }
    check_not_empty("o", o)
}

/// o's shape, checked once q's are known good: q's.
pub(crate) fn check_output_shape(q: &TensorView, o: &TensorView) -> Result<()> {
    if o.shape != q.shape {
        return Err(Error::ShapeMismatch(format!(
            "o has shape {:?} but q has {:?}; they must be equal",
            o.shape, q.shape
        )));
    }
    Ok(())
}

/// Checks a decode call; see [`Attention::decode`] for the rules.
pub fn validate_decode(
    q: &TensorView,
    cache: &KvCache,
    o: &TensorView,
    lse: Option<&LseView>,
    params: &AttentionParams,
) -> Result<DecodeProblem> {
    check_output_dtype(q, o)?;
    let problem = decode_problem(q, cache, params)?;
    check_output_shape(q, o)?;
    let [batch, seqlen_q, heads_q, _] = q.shape;
    for (name, t) in [("q", q), ("o", o)] {
        check_pointer(name, t.ptr, TENSOR_ALIGN)?;
    }
    check_lse_pointer(lse)?;
    for (name, t) in [("q", q), ("o", o)] {
        check_strides(name, t)?;
    }
    let o_range = byte_range_of("o", o)?;
    let [k, v, k_scale, v_scale, lengths, table] = cache.byte_ranges(batch);
    let q_range = Some(("q", byte_range_of("q", q)?));
    let inputs = [k, v, k_scale, v_scale, lengths, table, q_range];
    check_no_self_overlap("o", o)?;
    let lse_range = match lse {
        Some(l) => Some(lse_byte_range(l, batch, heads_q, seqlen_q)?),
        None => None,
    };
    check_outputs(&inputs, ("o", o_range), lse_range)?;
    Ok(problem)
}

/// [`decode_problem`] with q's own memory rules (pointer, alignment, strides, extent), as
/// [`validate_decode`] applies them: every check of a decode call that involves neither o
/// nor the LSE.
pub(crate) fn decode_q_problem(q: &TensorView, cache: &KvCache) -> Result<DecodeProblem> {
    let problem = decode_problem(q, cache, &AttentionParams::default())?;
    check_pointer("q", q.ptr, TENSOR_ALIGN)?;
    check_strides("q", q)?;
    byte_range_of("q", q)?;
    Ok(problem)
}

/// The rules on q and the cache alone (shapes, dtypes, limits, the cache's own checks):
/// what the plan of a decode call depends on.
pub fn decode_problem(
    q: &TensorView,
    cache: &KvCache,
    params: &AttentionParams,
) -> Result<DecodeProblem> {
    let dtype = decode_dtype(q, cache)?;
    check_not_empty("q", q)?;
    decode_problem_of(dtype, q.shape, cache, params)
}

/// q's dtype, which must be f16 or bf16 and the cache's (or the cache e4m3).
pub(crate) fn decode_dtype(q: &TensorView, cache: &KvCache) -> Result<HalfType> {
    // An e4m3 cache serves queries of either 16-bit type.
    if q.dtype != cache.k.dtype && !(cache.is_fp8() && q.dtype.half_type().is_some()) {
        return Err(Error::UnsupportedDType(format!(
            "q and the cache must share one dtype (or the cache be e4m3), got q {}, cache {}",
            dtype_text(q.dtype),
            dtype_text(cache.k.dtype)
        )));
    }
    q.dtype.half_type().ok_or_else(|| {
        Error::UnsupportedDType(format!("q is {}; decode takes f16 or bf16", q.dtype))
    })
}

/// [`decode_problem`] past q's dtype and emptiness, for queries of `dtype` shaped as a
/// dense `[B, Sq, Hq, D]` call's (packed queries: their sequence count and longest).
pub(crate) fn decode_problem_of(
    dtype: HalfType,
    [batch, seqlen_q, heads_q, head_dim]: [usize; 4],
    cache: &KvCache,
    params: &AttentionParams,
) -> Result<DecodeProblem> {
    let shape = cache.validate(batch)?;
    if shape.head_dim != head_dim {
        return Err(Error::ShapeMismatch(format!(
            "the cache's head_dim {} differs from q's {head_dim}",
            shape.head_dim
        )));
    }
    decode_head_dim(head_dim, shape.fp8)?;
    if !heads_q.is_multiple_of(shape.heads_kv) {
        return Err(Error::HeadRatio {
            hq: heads_q,
            hkv: shape.heads_kv,
        });
    }
    if heads_q > MAX_GRID_YZ {
        return Err(Error::InvalidArgument(format!(
            "query heads {heads_q} exceed the grid limit {MAX_GRID_YZ}"
        )));
    }
    // The forward kernels, which take calls of more than MAX_QUERIES queries, count a
    // sequence's rows in 31 bits; every call bounds its sequences by MAX_SEQLEN.
    if seqlen_q > MAX_SEQLEN {
        return Err(Error::InvalidArgument(format!(
            "{seqlen_q} queries per sequence exceed 2^25"
        )));
    }
    check_scale(params)?;
    let softcap = checked_softcap(params, head_dim)?;
    let masking = params.masking(seqlen_q, shape.capacity)?;
    let problem = DecodeProblem {
        cache: shape,
        dtype,
        seqlen_q,
        heads_q,
        scale: params.scale_for(head_dim),
        causal: masking.causal,
        window: masking.window,
        softcap,
        packed: None,
    };
    // (The decode kernels' grid also holds KV heads x query chunks of 16 rows; that limit
    // is their plan's, since past 16 queries the forward kernels may take the call.)
    if batch > MAX_GRID_YZ {
        return Err(Error::InvalidArgument(format!(
            "batch {batch} exceeds the grid limit {MAX_GRID_YZ}"
        )));
    }
    Ok(problem)
}

/// The decode kernel head dim for a cache of head dim `head_dim`, and whether it runs
/// padded ([`decode::kernel_head_dim`]); an error naming the head dims the cache's type
/// takes otherwise.
fn decode_head_dim(head_dim: usize, fp8: bool) -> Result<(u32, bool)> {
    decode::kernel_head_dim(head_dim, fp8).ok_or_else(|| {
        let text = if fp8 {
            super::fp8::FP8_HEAD_DIMS_TEXT
        } else {
            HEAD_DIMS_TEXT
        };
        Error::UnsupportedHeadDim(head_dim, text)
    })
}

pub(crate) fn check_lse_pointer(lse: Option<&LseView>) -> Result<()> {
    if let Some(l) = lse {
        check_pointer("lse", l.ptr, LSE_ALIGN)?;
    }
    Ok(())
}

/// The output (and the LSE) overlap none of the inputs, nor each other.
pub(crate) fn check_outputs(
    inputs: &[Option<(&'static str, (u64, u64))>],
    (out_name, out): (&'static str, (u64, u64)),
    lse: Option<(u64, u64)>,
) -> Result<()> {
    let outputs = std::iter::once((out_name, out)).chain(lse.map(|r| ("lse", r)));
    for (name, r) in outputs {
        let others = inputs
            .iter()
            .flatten()
            .copied()
            .chain((name == "lse").then_some((out_name, out)));
        for (other, o) in others {
            if overlaps(r, o) {
                return Err(Error::InvalidArgument(format!(
                    "{name}'s memory [{:#x}, {:#x}) overlaps {other}'s [{:#x}, {:#x})",
                    r.0, r.1, o.0, o.1
                )));
            }
        }
    }
    Ok(())
}

/// The split count and kernel for a decode problem on a GPU with `sm_count` SMs whose
/// blocks may use `smem_optin` bytes of shared memory.
///
/// The splits fill the GPU, a wave being [`DecodeConfig::blocks_per_sm`] blocks per SM
/// (what fits, if less), with at least `MIN_SPLIT_KEYS` positions of capacity per
/// split. Where the `batch · kv_heads · row_chunks` blocks of one split fit a wave,
/// the most splits whose blocks all fit it: the blocks run at once, each with a
/// smaller share of the keys (on the H200, B1 Hkv8 D128 with 16 splits rather than
/// 15: 37.4 µs against 38.0 at Skv 32768, in two rounds of one run; an e4m3 cache's
/// 49 rather than 43: 35.9–36.1 µs against 39.0–39.1). Otherwise the smallest count
/// whose blocks fill at least 85% of the last wave.
pub fn plan_decode(p: &DecodeProblem, sm_count: u32, smem_optin: u32) -> Result<DecodePlan> {
    let c = &p.cache;
    // `decode_problem` never gives these; a problem built by hand might.
    let sizes = [
        c.batch, c.heads_kv, c.head_dim, c.capacity, p.seqlen_q, p.heads_q,
    ];
    if sizes.contains(&0) || !p.heads_q.is_multiple_of(c.heads_kv) {
        return Err(Error::InvalidArgument(format!(
            "no decode plan for batch {}, {} query heads over {} KV heads, head dim {}, \
             capacity {}, {} queries: every size must be at least 1 and the KV heads must \
             divide the query heads",
            c.batch, p.heads_q, c.heads_kv, c.head_dim, c.capacity, p.seqlen_q
        )));
    }
    let kernel_head_dim = decode_head_dim(c.head_dim, c.fp8)?;
    // The grid's y: KV heads x blocks of 16 packed query rows.
    let chunks = c.heads_kv.saturating_mul(p.row_chunks());
    if chunks > MAX_GRID_YZ {
        return Err(Error::InvalidArgument(format!(
            "no decode plan for {} queries of {} heads over {} KV heads: KV heads x query \
             chunks {chunks} exceed the decode kernels' grid limit {MAX_GRID_YZ}",
            p.seqlen_q, p.heads_q, c.heads_kv
        )));
    }
    // The partial results' rows (one per split, sequence, query and head) are counted in
    // 31 bits by the merge, as `validate_merge` requires of a caller's.
    let rows = c
        .batch
        .checked_mul(p.seqlen_q)
        .and_then(|n| n.checked_mul(p.heads_q))
        .filter(|&n| n < 1 << 31)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no decode plan for batch {} with {} queries of {} heads: 2^31 query rows or \
                 more",
                c.batch, p.seqlen_q, p.heads_q
            ))
        })?;
    let cfg = DecodeConfig::candidates(p.dtype, kernel_head_dim, p.layout(), c.fp8)
        .into_iter()
        .find(|c| c.smem_bytes() <= smem_optin)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no decode kernel for head dim {} fits the GPU's {smem_optin} bytes of shared \
                 memory per block",
                p.cache.head_dim
            ))
        })?;
    // Blocks per SM: what shared memory (1 KiB of it reserved per block) and threads
    // allow, and no more than the kernel wants.
    let per_sm = ((smem_optin as usize + 1024) / (cfg.smem_bytes() as usize + 1024))
        .clamp(1, 2048 / cfg.threads() as usize)
        .min(cfg.blocks_per_sm() as usize);
    let resident = sm_count.max(1) as usize * per_sm;
    let base = p
        .cache
        .batch
        .checked_mul(p.cache.heads_kv)
        .and_then(|n| n.checked_mul(p.row_chunks()))
        .filter(|&n| n < 1 << 40)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "no decode plan for batch {} with {} KV heads and {} query rows each: too \
                 many blocks",
                p.cache.batch,
                p.cache.heads_kv,
                p.seqlen_q.saturating_mul(p.group())
            ))
        })?;
    let most = p
        .cache
        .capacity
        .div_ceil(MIN_SPLIT_KEYS)
        .clamp(1, MAX_SPLITS);
    let fill = |s: usize| {
        let blocks = base * s;
        blocks as f64 / (blocks.div_ceil(resident) * resident) as f64
    };
    let mut splits = 1;
    if base <= resident {
        splits = (resident / base).min(most);
    } else {
        for s in 1..=most {
            if fill(s) > fill(splits) + 1e-9 {
                splits = s;
            }
            if fill(s) >= 0.85 {
                splits = s;
                break;
            }
        }
    }
    // Each warp sums `P·V` over its share of a split's keys in the tensor cores'
    // accumulators; past MAX_SEQLEN keys (the forward's bound for one such sum) a flat
    // row would stop counting them. A capacity that long takes the splits that keep every
    // share within it (at most 2^30 / (2^25 · 2) = 16).
    splits = splits.max(p.cache.capacity.div_ceil(MAX_SEQLEN * cfg.warps as usize));
    let workspace_bytes = if splits == 1 {
        0
    } else {
        // A hand-made capacity past 2^57 keys asks for more splits than an address space
        // holds rows for.
        splits
            .checked_mul(rows)
            .and_then(|split_rows| {
                // Rows of the kernel's head dim (a padded kernel's extra columns are 0).
                let partials = split_rows.checked_mul(cfg.head_dim as usize * 4)?;
                partials
                    .checked_next_multiple_of(256)?
                    .checked_add(split_rows * 4)
            })
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "no decode plan for a capacity of {} keys: its {splits} splits' partial \
                     results would not fit an address space",
                    c.capacity
                ))
            })?
    };
    Ok(DecodePlan {
        config: cfg,
        splits,
        workspace_bytes,
    })
}

/// A validated append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendProblem {
    pub cache: CacheShape,
    pub new_tokens: usize,
    /// An e4m3 cache: the new tokens' 16-bit type, which the append quantizes.
    pub fp8_from: Option<HalfType>,
}

/// Checks an append of `k_new`, `v_new` (`[B, Snew, Hkv, D]`) to `cache`.
pub fn validate_append(
    cache: &KvCache,
    k_new: &TensorView,
    v_new: &TensorView,
) -> Result<AppendProblem> {
    let fp8_from = if cache.is_fp8() {
        // An e4m3 cache takes 16-bit tokens and quantizes them.
        match k_new.dtype.half_type() {
            Some(t) if v_new.dtype == k_new.dtype => Some(t),
            _ => {
                return Err(Error::UnsupportedDType(format!(
                    "an e4m3 cache takes new tokens of one 16-bit dtype, got k_new {}, v_new {}",
                    k_new.dtype, v_new.dtype
                )));
            }
        }
    } else if k_new.dtype != cache.k.dtype || v_new.dtype != cache.k.dtype {
        return Err(Error::UnsupportedDType(format!(
            "k_new and v_new must have the cache's dtype {}, got {} and {}",
            cache.k.dtype, k_new.dtype, v_new.dtype
        )));
    } else {
        None
    };
    for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
        check_not_empty(name, t)?;
    }
    if v_new.shape != k_new.shape {
        return Err(Error::ShapeMismatch(format!(
            "v_new has shape {:?} but k_new has {:?}",
            v_new.shape, k_new.shape
        )));
    }
    let [batch, new_tokens, heads_kv, head_dim] = k_new.shape;
    let shape = cache.validate(batch)?;
    if (heads_kv, head_dim) != (shape.heads_kv, shape.head_dim) {
        return Err(Error::ShapeMismatch(format!(
            "new tokens have {heads_kv} heads of {head_dim}, the cache {} of {}",
            shape.heads_kv, shape.head_dim
        )));
    }
    if !head_dim.is_multiple_of(8) {
        return Err(Error::UnsupportedHeadDim(head_dim, "multiples of 8"));
    }
    let total = batch
        .checked_mul(new_tokens)
        .and_then(|n| n.checked_mul(heads_kv))
        .and_then(|n| n.checked_mul(head_dim / 8));
    if total.is_none_or(|t| t > MAX_APPEND_CHUNKS) || new_tokens > shape.capacity {
        return Err(Error::InvalidArgument(format!(
            "{new_tokens} new tokens of {batch} sequences are too many for one append \
             (capacity {})",
            shape.capacity
        )));
    }
    for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
        check_pointer(name, t.ptr, TENSOR_ALIGN)?;
        check_strides(name, t)?;
        let r = byte_range_of(name, t)?;
        for (other, o) in cache.byte_ranges(batch).into_iter().flatten() {
            if overlaps(r, o) {
                return Err(Error::InvalidArgument(format!(
                    "{name} overlaps the cache's {other}"
                )));
            }
        }
    }
    check_append_targets(cache, batch)?;
    Ok(AppendProblem {
        cache: shape,
        new_tokens,
        fp8_from,
    })
}

/// The merge kernels' element type of a tensor: 16-bit or f32, never FP8.
fn merge_type(name: &'static str, t: DType) -> Result<MergeType> {
    match t {
        DType::F16 => Ok(MergeType::F16),
        DType::Bf16 => Ok(MergeType::Bf16),
        DType::F32 => Ok(MergeType::F32),
        DType::E4m3 => Err(Error::UnsupportedDType(format!(
            "{name} is e4m3; merging takes f16, bf16 or f32"
        ))),
    }
}

/// Checks a merge of `parts` into `out` (and `out_lse`).
pub fn validate_merge(
    parts: &MergeParts,
    out: &TensorView,
    out_lse: Option<&LseView>,
) -> Result<MergeConfig> {
    let o = &parts.o;
    check_not_empty("parts", o)?;
    if parts.count == 0 {
        return Err(Error::EmptyDimension {
            tensor: "parts",
            dim: "count",
        });
    }
    if out.shape != o.shape {
        return Err(Error::ShapeMismatch(format!(
            "out has shape {:?} but each part has {:?}",
            out.shape, o.shape
        )));
    }
    let input = merge_type("parts", o.dtype)?;
    let output = merge_type("out", out.dtype)?;
    let [batch, seqlen, heads, head_dim] = o.shape;
    let (kernel_head_dim, padded) = merge::kernel_head_dim(head_dim)
        .ok_or(Error::UnsupportedHeadDim(head_dim, HEAD_DIMS_TEXT))?;
    let rows = batch.checked_mul(seqlen).and_then(|n| n.checked_mul(heads));
    if rows.is_none_or(|r| r >= 1 << 31) || parts.count >= 1 << 31 {
        return Err(Error::InvalidArgument(format!(
            "{} parts of {batch} x {seqlen} x {heads} rows are too many to merge",
            parts.count
        )));
    }
    for (name, p) in [("parts", o.ptr), ("out", out.ptr), ("lse_parts", parts.lse)] {
        if p == 0 {
            return Err(Error::NullPointer(name));
        }
    }
    for (name, t) in [("parts", o), ("out", out)] {
        if !t.ptr.is_multiple_of(TENSOR_ALIGN) {
            return Err(Error::Misaligned {
                tensor: name,
                ptr: t.ptr,
                align: TENSOR_ALIGN,
            });
        }
    }
    if !parts.lse.is_multiple_of(LSE_ALIGN) {
        return Err(Error::Misaligned {
            tensor: "lse_parts",
            ptr: parts.lse,
            align: LSE_ALIGN,
        });
    }
    check_lse_pointer(out_lse)?;
    check_strides("parts", o)?;
    check_strides("out", out)?;
    let elem = o.dtype.size_bytes();
    let shard_bytes = parts.shard_stride.checked_mul(elem);
    if parts.count > 1 && shard_bytes.is_none_or(|b| !(b as u64).is_multiple_of(TENSOR_ALIGN)) {
        return Err(Error::BadStrides {
            tensor: "parts",
            reason: format!(
                "shard stride {} elements is not a multiple of {TENSOR_ALIGN} bytes",
                parts.shard_stride
            ),
        });
    }
    let overflow = |tensor| Error::BadStrides {
        tensor,
        reason: "overflows 64-bit addressing".into(),
    };
    let first = byte_range_of("parts", o)?;
    let span = (parts.count as u64 - 1)
        .checked_mul(shard_bytes.unwrap_or(0) as u64)
        .and_then(|s| first.1.checked_add(s))
        .ok_or_else(|| overflow("parts"))?;
    let parts_range = (first.0, span);
    let lse_bytes = (rows.unwrap_or(0) as u64)
        .checked_mul(4 * parts.count as u64)
        .and_then(|n| parts.lse.checked_add(n))
        .ok_or_else(|| overflow("lse_parts"))?;
    let out_range = byte_range_of("out", out)?;
    check_no_self_overlap("out", out)?;
    let lse_range = match out_lse {
        Some(l) => Some(lse_byte_range(l, batch, heads, seqlen)?),
        None => None,
    };
    check_outputs(
        &[
            Some(("parts", parts_range)),
            Some(("lse_parts", (parts.lse, lse_bytes))),
        ],
        ("out", out_range),
        lse_range,
    )?;
    Ok(MergeConfig {
        input,
        output,
        head_dim: kernel_head_dim,
        programmatic: false,
        padded,
        packed: false,
    })
}

/// Launches a merge kernel with its by-value `args` and, in a padded kernel, the rows'
/// head dim `columns` (the parts' innermost extent).
///
/// # Safety
///
/// As for [`launch`]: `args` must describe live device memory of the kernel's context
/// that it may read (the parts) and write (the output), `stream` be null or a live stream
/// of that context.
unsafe fn launch_merge(
    kernel: &LoadedKernel,
    cfg: &MergeConfig,
    args: &mut MergeArgs,
    columns: usize,
    dims: &LaunchDims,
    stream: CUstream,
    programmatic: bool,
) -> Result<()> {
    // Validated (or the decode's own cache's): at most 256.
    let mut head_dim = columns as u32;
    let args_ptr = (args as *mut MergeArgs).cast::<c_void>();
    let mut params = PaddedParams::new([args_ptr], cfg.padded.then_some(&mut head_dim));
    // SAFETY: the kernel's parameters are the by-value `MergeArgs`, which `args` is, and
    // in a padded kernel the `u32` head dim, which `head_dim` is; both outlive the call;
    // the caller vouches for the memory `args` names and for `stream`.
    unsafe {
        if programmatic {
            launch_programmatic(kernel, dims, stream, params.list())
        } else {
            launch(kernel, dims, stream, params.list())
        }
    }
}

/// The merge kernel's arguments and grid; `packed`, the packed batch `out` holds (a
/// packed merge configuration's).
fn merge_launch(
    parts: &MergeParts,
    out: &TensorView,
    out_lse: Option<&LseView>,
    cfg: &MergeConfig,
    packed: Option<&Packed>,
) -> (MergeArgs, LaunchDims) {
    let [batch, seqlen, heads, _] = parts.o.shape;
    let rows = (batch * seqlen * heads) as u32;
    let s = |t: &TensorView| {
        [
            t.strides[0] as u64,
            t.strides[1] as u64,
            t.strides[2] as u64,
        ]
    };
    let ps = s(&parts.o);
    let args = MergeArgs {
        parts: parts.o.ptr,
        part_stride: [parts.shard_stride as u64, ps[0], ps[1], ps[2]],
        lse_parts: parts.lse,
        lse_shard_stride: (batch * heads * seqlen) as u64,
        out: out.ptr,
        out_stride: s(out),
        out_lse: out_lse.map_or(0, |l| l.ptr),
        n_parts: parts.count as u32,
        seqlen: seqlen as u32,
        heads: heads as u32,
        rows,
        cu_seqlens: packed.map_or(0, |p| p.cu_seqlens_q),
        total: packed.map_or(0, |p| p.total_q as u32),
        skip_longer: u32::from(packed.is_some_and(|p| p.runs == Runs::Short)),
    };
    let dims = LaunchDims {
        grid: (rows.div_ceil(cfg.rows_per_block()), 1, 1),
        block: (cfg.threads(), 1, 1),
        dynamic_smem: cfg.smem_bytes(),
    };
    (args, dims)
}

/// An e4m3 cache's scale pointers and strides as the decode and append arguments take
/// them (`k_scale`, `v_scale`, `k_scale_stride`, `v_scale_stride`); zeros otherwise.
fn scale_fields(cache: &KvCache) -> (u64, u64, [u64; 3], [u64; 3]) {
    match &cache.scales {
        Some(s) => (s.k.ptr, s.v.ptr, strides3(&s.k), strides3(&s.v)),
        None => (0, 0, [0; 3], [0; 3]),
    }
}

/// (batch, position, head) strides of a view, in elements.
fn strides3(t: &TensorView) -> [u64; 3] {
    [
        t.strides[0] as u64,
        t.strides[1] as u64,
        t.strides[2] as u64,
    ]
}

/// Keys from which a dense forward call with at most [`MAX_QUERIES`] queries per sequence
/// runs on the decode kernels (`Attention::forward_by_decode`). Measured on an H100
/// (`flashcore run`, the forward kernels' TFLOP/s against decode's, same call): Hq32 Hkv8
/// D128 Sq1 B1 1.2 against 1.1 at 1024 keys, 1.4 against 2.0 at 1536, 1.6 against 3.0 at
/// 2048; B8 4.3 against 6.8 at 1024; Sq16 causal 18.7 against 21.7 at 1024; without GQA
/// (B32 H32 D128, B4 H16 D64) level from 1024 keys, 0.9 against 0.6 at 512.
pub const FORWARD_DECODE_MIN_KEYS: usize = 1536;

/// The same for a batch whose KV heads fill a wave of decode blocks on their own (see
/// [`FORWARD_DECODE_MIN_KV_HEADS`]) with at least 4 query heads to each: there the forward
/// kernels read each K/V tile once per query head. Measured on an H100 (Hq32 Hkv8 D128,
/// TFLOP/s, same call): B16 Sq1 3.8 against 8.0 at 512 keys and 4.8 against 9.7 at 1024,
/// Sq16 causal 53.6 against 76.9 and 69.9 against 102.6; at B2 and B4 (16 and 32 KV heads)
/// the forward kernels were as fast or faster (B2 Sq16 causal 24.3 against 16.5 at 512).
pub const FORWARD_DECODE_MIN_KEYS_GQA: usize = 512;

/// Batch × KV heads from which [`FORWARD_DECODE_MIN_KEYS_GQA`] applies.
pub const FORWARD_DECODE_MIN_KV_HEADS: usize = 128;

/// Query rows per KV head (`Sq · group`) from which a call whose forward work items fill
/// most of one wave keeps the forward kernels (`forward_fills_one_wave`).
pub const FORWARD_ONE_WAVE_ROWS: usize = 64;

/// Whether the forward kernels' work items (one per sequence, query head and 64-row query
/// tile) fill between three quarters of the SMs and all of them, while the decode kernels
/// would take the `Sq · group` rows of a KV head in [`FORWARD_ONE_WAVE_ROWS`] / 16 blocks
/// or more, each reading the KV head's keys again. There one wave of the forward kernels
/// beats the decode kernels. On an H200, Hq32 Hkv8 causal, µs, decode / forward, same
/// call:
///
/// | Sq, D, Sk | B2 | B4 (128 items) | B8 |
/// |---|---|---|---|
/// | 16, 128, 8192 | 46.6 / 66.2 | 79.1 / 68.0 | 116.9 / 197.2 |
/// | 16, 128, 2048 | 19.2 / 21.7 | 24.1 / 22.3 | 35.8 / 58.1 |
/// | 16, 64, 8192 | 33.7 / 44.3 | 54.5 / 45.2 | 73.2 / 196.1 |
/// | 8, 128, 8192 | 28.7 / 66.2 | 48.1 / 67.6 | 79.8 / 192.3 |
///
/// With fewer rows per KV head (Sq 8 above, or no GQA: Hq8 Hkv8 Sq16 B4 39.7 / 66.9)
/// the decode kernels were faster at every batch.
pub(crate) fn forward_fills_one_wave(s: &AttnShape, sm_count: u32) -> bool {
    let sms = sm_count as usize;
    let items = s
        .batch
        .saturating_mul(s.heads_q)
        .saturating_mul(s.seqlen_q.div_ceil(64));
    let rows = s.seqlen_q * (s.heads_q / s.heads_kv.max(1));
    rows >= FORWARD_ONE_WAVE_ROWS && items <= sms && 4 * items >= 3 * sms
}

/// Whether a dense forward call runs on the decode kernels: on the best path (an
/// Attention restricted to the sm80 path keeps the forward kernels), at most
/// [`MAX_QUERIES`] queries per sequence against at least [`FORWARD_DECODE_MIN_KEYS`] keys,
/// or [`FORWARD_DECODE_MIN_KEYS_GQA`] where the batch has [`FORWARD_DECODE_MIN_KV_HEADS`]
/// KV heads or more, each shared by 4 query heads or more; and not where one wave of the
/// forward kernels does better ([`forward_fills_one_wave`], on a GPU of `sm_count` SMs).
pub(crate) fn forward_takes_decode(
    problem: &FwdProblem,
    choice: PathChoice,
    sm_count: u32,
) -> bool {
    let s = &problem.shape;
    let packs_kv = s.heads_kv > 0
        && s.heads_q / s.heads_kv >= 4
        && s.batch.saturating_mul(s.heads_kv) >= FORWARD_DECODE_MIN_KV_HEADS;
    let min_keys = if packs_kv {
        FORWARD_DECODE_MIN_KEYS_GQA
    } else {
        FORWARD_DECODE_MIN_KEYS
    };
    choice == PathChoice::Best
        && problem.packed.is_none()
        && s.seqlen_q <= MAX_QUERIES
        && s.seqlen_k >= min_keys
        && !forward_fills_one_wave(s, sm_count)
}

/// Whether a packed (variable-length) forward call runs on the decode kernels: as
/// [`forward_takes_decode`] decides for a dense call of as many sequences, each with the
/// mean key count `total_k / batch`.
pub(crate) fn varlen_takes_decode(problem: &FwdProblem, choice: PathChoice, sm_count: u32) -> bool {
    let Some(packed) = problem.packed else {
        return false;
    };
    let mut dense = *problem;
    dense.packed = None;
    dense.shape.seqlen_k = packed.total_k / problem.shape.batch.max(1);
    forward_takes_decode(&dense, choice, sm_count)
}

/// A decode call's forward side, ready to launch ([`Attention::prepare_decode_by_forward`]):
/// its forward problem and kernel configuration (loaded), and the sm90 path's tensor maps
/// (`None` on the sm80 path, whose kernels take pointers).
pub(crate) struct ForwardDecode {
    forward: FwdProblem,
    cfg: FwdConfig,
    operands: Option<Sm90Operands>,
}

/// [`Attention::decode_forward_plan`] on a GPU of architecture and SM count `gpu`, with
/// the paths `choice` allows.
pub(crate) fn decode_forward_plan_on(
    (arch, sm_count): ((i32, i32), u32),
    choice: PathChoice,
    problem: &DecodeProblem,
    cache: &KvCache,
) -> Option<(FwdProblem, FwdConfig)> {
    let c = &problem.cache;
    let packed_keys = problem.layout() == DecodeLayout::Packed;
    if problem.seqlen_q <= MAX_QUERIES || c.fp8 || packed_keys || c.capacity > MAX_SEQLEN {
        return None;
    }
    let pages = match cache.layout {
        CacheLayout::Contiguous => None,
        CacheLayout::Paged {
            block_table,
            max_pages,
            table_stride,
        } => {
            if c.page_size < MIN_FORWARD_PAGE {
                return None;
            }
            Some(PageTable {
                block_table,
                table_stride: u32::try_from(table_stride).ok()?,
                page_shift: c.page_shift(),
                max_pages: u32::try_from(max_pages).ok()?,
            })
        }
    };
    let forward = FwdProblem {
        shape: AttnShape {
            batch: c.batch,
            seqlen_q: problem.seqlen_q,
            seqlen_k: c.capacity,
            heads_q: problem.heads_q,
            heads_kv: c.heads_kv,
            head_dim: c.head_dim,
        },
        dtype: problem.dtype,
        scale: problem.scale,
        causal: problem.causal,
        window: problem.window,
        softcap: problem.softcap,
        // Packed queries over the cache: a null `cu_seqlens_k` keeps the keys the cache's.
        packed: problem.packed,
        seqused_k: Some(cache.seqlens),
        pages,
    };
    let cfg = plan_problem(arch, sm_count, choice, &forward).ok()?;
    let reads = match (
        pages.is_some() || problem.packed.is_some(),
        cfg.cache_reads(),
    ) {
        // Pages and keys apart from packed queries: the sm90 path's kernels only.
        (true, reads) => reads == CacheReads::UnderPackedQueries,
        (false, reads) => reads != CacheReads::None,
    };
    if !reads {
        return None;
    }
    Some((forward, cfg))
}

impl Attention {
    /// How a decode call of this problem runs on this device: its kernel, its splits
    /// and the workspace it needs.
    pub fn decode_plan(&self, problem: &DecodeProblem) -> Result<DecodePlan> {
        plan_decode(
            problem,
            self.device().sm_count(),
            self.device().smem_optin(),
        )
    }

    /// The workspace a decode call with these `q` and `cache` needs, in bytes (0 when
    /// its plan has one split). `q` and the cache are checked as [`Attention::decode`]
    /// checks them (the same errors, in the same order).
    pub fn decode_workspace_bytes(&self, q: &TensorView, cache: &KvCache) -> Result<usize> {
        let problem = decode_q_problem(q, cache)?;
        if problem.cache.fp8 {
            self.check_fp8_cache_gpu()?;
        }
        match self.decode_plan(&problem) {
            Ok(plan) => Ok(plan.workspace_bytes),
            // Queries the forward kernels take (which need no workspace) past the decode
            // kernels' 2^31 partial rows: a call whose maps or options leave them to the
            // decode kernels fails on that plan before it launches anything.
            Err(_) if self.decode_forward_plan(&problem, cache).is_some() => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Decode: `o = softmax(q kᵀ · scale) v` for `Sq` new query tokens per sequence
    /// against `cache`, whose lengths count the new tokens (query `i` of `Sq` is position
    /// `len − Sq + i`; with `params.causal` it sees keys up to there). `q`, `o`:
    /// `[B, Sq, Hq, D]`, Sq at most 2^25; `lse`: float32 `[B, Hq, Sq]`. A row that sees no
    /// key (a length of 0, or with `params.causal` a query before the sequence's first
    /// position) gets zeros and LSE −∞.
    ///
    /// Up to [`MAX_QUERIES`] queries (decode steps, speculative verification) run on the
    /// split-KV decode kernels. More (chunked prefill, a prompt after a cached prefix) run
    /// on the forward kernels where they can read the cache (a 16-bit cache, contiguous,
    /// or paged with pages of 16 positions or more on the sm90 path; see
    /// `prepare_decode_by_forward`), on the decode kernels otherwise.
    ///
    /// `host`, when given, holds copies of the cache's lengths (and block table) that are
    /// checked first. `workspace` holds the partial results when the plan has more than
    /// one split; without it, memory comes from the stream-ordered allocator for the call.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]: every view and the cache's metadata must be live
    /// device memory of this device for the extents they describe until the kernels have
    /// run, `stream` null or a live stream of this context, and nothing else writing the
    /// inputs or touching the outputs (and the workspace) meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decode(
        &self,
        q: &TensorView,
        cache: &KvCache,
        host: Option<&HostMetadata>,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
        workspace: Option<Workspace>,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_decode(q, cache, o, lse, params)?;
        if let Some(h) = host {
            h.check(cache, &problem.cache, 0)?;
        }
        if problem.cache.fp8 {
            self.check_fp8_cache_gpu()?;
        }
        if let Some(forward) = self.prepare_decode_by_forward(&problem, q, cache, o, lse, params) {
            let forward = forward?;
            // SAFETY: this function's contract; the call was validated above and
            // `forward` prepared for these views.
            return unsafe { self.launch_decode_by_forward(forward, q, cache, o, lse, stream) };
        }
        let plan = self.decode_plan(&problem)?;
        if let Some(w) = workspace
            && plan.workspace_bytes > 0
        {
            check_workspace(&w, plan.workspace_bytes, cache, q, o, lse, &problem)?;
        }
        // SAFETY: this function's contract; the call was validated above.
        unsafe { self.run_decode(&problem, &plan, q, cache, o, lse, workspace, stream) }
    }

    /// A call with more than [`MAX_QUERIES`] queries per sequence (chunked prefill, a
    /// prompt after a cached prefix) on the forward kernels, where they can take it:
    ///
    /// - a contiguous 16-bit cache is a dense forward whose keys are the cache's capacity
    ///   and whose sequences use their lengths of them ([`FwdProblem::seqused_k`]), on
    ///   either path;
    /// - a paged 16-bit cache with pages of 16 positions or more, on the sm90 path: the
    ///   producer finds each tile's pages in the block table ([`FwdProblem::pages`]);
    ///
    /// and a kernel that reads the used keys ([`FwdConfig::reads_used_keys`]: not the
    /// sm80 path's windowed kernels, nor the sm90 path's head-dim-256 ones with 64-row
    /// tiles).
    ///
    /// The decode kernels give each 16 query rows of a KV head a block that reads all of
    /// its keys, so past a few row tiles the forward's wide query tiles win: on an H200,
    /// B1 Hq32 Hkv8 D128 f16 against 8192 keys, 1024 queries took 935 µs on the decode
    /// kernels (147 TFLOP/s; cuDNN 591 on that shape without a cache). `None` (the
    /// decode kernels run) for an e4m3 cache, pages below 16, a paged cache off the sm90
    /// path, or views the forward's checks or tensor maps refuse.
    ///
    /// This prepares everything short of the launch ([`Attention::launch_decode_by_forward`]):
    /// the forward problem and kernel, the views' checks, the tensor maps, and the kernel
    /// loaded, so that a caller with other launches to make first (`decode_varlen`'s short
    /// runs) learns of any failure before it launches anything. `problem` must come from
    /// validating these views.
    pub(crate) fn prepare_decode_by_forward(
        &self,
        problem: &DecodeProblem,
        q: &TensorView,
        cache: &KvCache,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
    ) -> Option<Result<ForwardDecode>> {
        let (forward, cfg) = self.decode_forward_plan(problem, cache)?;
        let packed = forward.packed.is_some();
        let views = [q, &cache.k, &cache.v, o];
        // The driver encodes tensor maps only where a context is current.
        let _scope = match ContextScope::enter(self.device().context()) {
            Ok(scope) => scope,
            Err(e) => return Some(Err(e)),
        };
        let maps = if forward.pages.is_none() {
            // The forward's own checks of the views (the decode's passed): the cache as
            // K and V of `[B, capacity, Hkv, D]`. Packed queries have a batch extent of
            // their own, and their checks are the decode's plus the capacity's bound,
            // which the plan checked.
            if !packed {
                validate_fwd(q, &cache.k, &cache.v, o, lse, params).ok()?;
            }
            match cfg.path {
                Path::Sm90 => Some(sm90_maps(&cfg, views, packed)),
                Path::Sm80 => None,
            }
        } else {
            let page_size = problem.cache.page_size;
            Some(sm90_paged_maps(&cfg, views, page_size, packed))
        };
        let operands = match maps {
            None => None,
            Some(Ok(maps)) => Some(maps),
            // Views the driver will not map go to the decode kernels: the sm80 kernel a
            // refused map falls back to might not read the used keys.
            Some(Err(e)) if e.is_map_refusal() => return None,
            Some(Err(e)) => return Some(Err(e)),
        };
        Some(self.prepare(&cfg).map(|_| ForwardDecode {
            forward,
            cfg,
            operands,
        }))
    }

    /// Launches what [`Attention::prepare_decode_by_forward`] prepared for these views.
    ///
    /// # Safety
    ///
    /// As for [`Attention::decode`].
    pub(crate) unsafe fn launch_decode_by_forward(
        &self,
        prepared: ForwardDecode,
        q: &TensorView,
        cache: &KvCache,
        o: &TensorView,
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Result<()> {
        let ForwardDecode {
            forward,
            cfg,
            operands,
        } = prepared;
        match operands {
            // SAFETY: this function's contract; the forward's checks (or, packed, the
            // decode's) passed on these views, which the maps cover (a paged cache's
            // pools, whose pages the kernel finds through the table and TMA bounds).
            Some(operands) => unsafe { self.launch_sm90(&forward, &cfg, operands, o, lse, stream) },
            // SAFETY: as above; the plan's kernel reads the used keys.
            None => unsafe {
                let views = [q, &cache.k, &cache.v, o];
                self.launch_forward(&forward, &cfg, views, lse, stream)
            },
        }
    }

    /// The forward problem and kernel a validated decode call runs on when
    /// [`Attention::decode`] gives it to the forward kernels (more than [`MAX_QUERIES`]
    /// queries per sequence and a cache they can read: see `prepare_decode_by_forward`), or
    /// `None` where the decode kernels run it.
    pub fn decode_forward_plan(
        &self,
        problem: &DecodeProblem,
        cache: &KvCache,
    ) -> Option<(FwdProblem, FwdConfig)> {
        let d = self.device();
        let gpu = (d.compute_capability(), d.sm_count());
        decode_forward_plan_on(gpu, self.path_choice(), problem, cache)
    }

    /// Launches a validated decode call (and its merge): its kernels, its workspace (the
    /// caller's, checked, or taken from the stream-ordered allocator and freed behind).
    /// A cache whose `seqlens` is 0 is full: every sequence holds `capacity` positions.
    ///
    /// # Safety
    ///
    /// As for [`Attention::decode`]; `problem` and `plan` must come from validating and
    /// planning these views.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_decode(
        &self,
        problem: &DecodeProblem,
        plan: &DecodePlan,
        q: &TensorView,
        cache: &KvCache,
        o: &TensorView,
        lse: Option<&LseView>,
        workspace: Option<Workspace>,
        stream: CUstream,
    ) -> Result<()> {
        // Both kernels of a step ask for all of the SMs' shared memory, so that no SM
        // changes its L1/shared split between them.
        let kernel = self.load_with(
            plan.config.id_static(),
            plan.config.smem_bytes(),
            Carveout::MaxShared,
            || plan.config.generate(),
        )?;
        // On Hopper the combine is launched programmatically behind the decode kernel
        // (unless the caller turned that off).
        let programmatic =
            self.programmatic_launches() && self.device().compute_capability().0 >= 9;
        // The merge reads the cache's columns of the workspace's rows, which are the
        // decode kernel's (wider where it is padded).
        let (merge_head_dim, merge_padded) = merge::kernel_head_dim(problem.cache.head_dim).ok_or(
            Error::UnsupportedHeadDim(problem.cache.head_dim, HEAD_DIMS_TEXT),
        )?;
        let merge_cfg = MergeConfig {
            input: MergeType::F32,
            output: merge_type("o", o.dtype)?,
            head_dim: merge_head_dim,
            programmatic,
            padded: merge_padded,
            packed: problem.packed.is_some(),
        };
        let merge = if plan.splits > 1 {
            Some(self.load_merge(&merge_cfg)?)
        } else {
            None
        };
        let (ws, owned) = match (plan.workspace_bytes, workspace) {
            (0, _) => (0, false),
            (_, Some(w)) => (w.ptr, false),
            (bytes, None) => (self.alloc_async(bytes, stream)?, true),
        };
        let rows = plan.splits * problem.cache.batch * problem.seqlen_q * problem.heads_q;
        let row = plan.config.head_dim as usize;
        let lse_part = ws + (rows * row * 4).next_multiple_of(256) as u64;
        let c = &problem.cache;
        let (block_table, table_stride) = cache.layout.table();
        let (k_scale, v_scale, k_scale_stride, v_scale_stride) = scale_fields(cache);
        let scaling = ScoreScaling::new(problem.scale, problem.softcap);
        let mut args = DecodeArgs {
            q: q.ptr,
            k: cache.k.ptr,
            v: cache.v.ptr,
            o: o.ptr,
            lse: lse.map_or(0, |l| l.ptr),
            o_part: ws,
            lse_part,
            seqlens: cache.seqlens,
            block_table,
            q_stride: strides3(q),
            k_stride: strides3(&cache.k),
            v_stride: strides3(&cache.v),
            o_stride: strides3(o),
            block_table_stride: table_stride,
            seqlen_q: problem.seqlen_q as u32,
            group: problem.group() as u32,
            heads_q: problem.heads_q as u32,
            batch: c.batch as u32,
            capacity: c.capacity as u32,
            pool_pages: c.pool_pages as u32,
            page_shift: c.page_shift(),
            splits: plan.splits as u32,
            scale_log2: scaling.scale_log2,
            scale: scaling.scale,
            softcap_pre: scaling.softcap_pre,
            skip_longer: u32::from(problem.packed.is_some_and(|p| p.runs == Runs::Short)),
            causal: u32::from(problem.causal),
            window_left: problem.window.map_or(WINDOW_UNBOUNDED, |w| w.left),
            window_right: problem.window.map_or(0, |w| w.right),
            row_chunks: problem.row_chunks() as u32,
            k_scale,
            v_scale,
            k_scale_stride,
            v_scale_stride,
            cu_seqlens_q: problem.packed.map_or(0, |p| p.cu_seqlens_q),
            cu_seqlens_k: problem.packed.map_or(0, |p| p.cu_seqlens_k),
            total_q: problem.packed.map_or(0, |p| p.total_q as u32),
            total_k: problem.packed.map_or(0, |p| p.total_k as u32),
        };
        let dims = LaunchDims {
            grid: (
                plan.splits as u32,
                (c.heads_kv * problem.row_chunks()) as u32,
                c.batch as u32,
            ),
            block: (plan.config.threads(), 1, 1),
            dynamic_smem: plan.config.smem_bytes(),
        };
        // A padded kernel's second parameter: the cache's head dim (below the kernel's).
        let mut head_dim = c.head_dim as u32;
        let args_ptr = (&mut args as *mut DecodeArgs).cast::<c_void>();
        let padded = plan.config.padded.then_some(&mut head_dim);
        let mut params = PaddedParams::new([args_ptr], padded);
        // SAFETY: the kernel's parameters are the by-value `DecodeArgs`, which `args` is,
        // and in a padded kernel the `u32` head dim, which `head_dim` is; both outlive the
        // call. Validation checked every pointer the block carries (non-null, aligned,
        // extents that fit, outputs apart from inputs); the kernel clamps the device
        // lengths to the capacity and follows no block-table entry outside the pool, so it
        // reads only the cache's extents (a padded kernel no column past the head dim, nor
        // writes one of o); the workspace holds `workspace_bytes` (checked, or allocated
        // above); this function's contract makes the memory live and `stream` valid.
        let launched = unsafe { launch(&kernel, &dims, stream, params.list()) };
        let merged = match (launched, merge) {
            (Ok(()), Some(merge)) => {
                let parts = MergeParts {
                    o: TensorView::strided(
                        ws,
                        DType::F32,
                        [c.batch, problem.seqlen_q, problem.heads_q, c.head_dim],
                        [
                            problem.seqlen_q * problem.heads_q * row,
                            problem.heads_q * row,
                            row,
                            1,
                        ],
                    ),
                    count: plan.splits,
                    shard_stride: c.batch * problem.seqlen_q * problem.heads_q * row,
                    lse: lse_part,
                };
                let (mut margs, mdims) =
                    merge_launch(&parts, o, lse, &merge_cfg, problem.packed.as_ref());
                // SAFETY: `margs` describes the partial results the decode kernel wrote to
                // the workspace (its layout is `parts`), which the merge reads, and `o` and
                // `lse`, validated above, which it writes. A programmatic launch may start
                // it before the decode kernel has finished: its first instruction waits
                // for that kernel's end and writes.
                unsafe {
                    launch_merge(
                        &merge,
                        &merge_cfg,
                        &mut margs,
                        c.head_dim,
                        &mdims,
                        stream,
                        programmatic,
                    )
                }
            }
            (r, _) => r,
        };
        if owned {
            self.free_behind_launch(ws, stream);
        }
        merged
    }

    /// A dense forward call with at most [`MAX_QUERIES`] queries per sequence, run as a
    /// decode step against a full cache where [`forward_takes_decode`] says that is faster:
    /// the keys split across the SMs, and each K/V tile read once for its whole query
    /// group. The kernels take no lengths (every sequence holds all `Sk` keys, so the
    /// causal mask is the forward's bottom-right one); the partial results of several
    /// splits go to memory from the stream-ordered allocator, freed behind the launch.
    /// `None` where the call keeps the forward kernels, with nothing launched or written:
    /// a problem the decode kernels refuse, or no memory for the partial results.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]; `problem` must come from validating these views.
    pub(crate) unsafe fn forward_by_decode(
        &self,
        problem: &FwdProblem,
        [q, k, v, o]: [&TensorView; 4],
        lse: Option<&LseView>,
        params: &AttentionParams,
        stream: CUstream,
    ) -> Option<Result<()>> {
        if !forward_takes_decode(problem, self.path_choice(), self.device().sm_count()) {
            return None;
        }
        let mut cache = KvCache {
            k: *k,
            v: *v,
            // Validation wants a lengths address; q's is aligned and, being an input, may
            // overlap other inputs. The launch passes none.
            seqlens: q.ptr,
            layout: CacheLayout::Contiguous,
            scales: None,
        };
        let decode = validate_decode(q, &cache, o, lse, params).ok()?;
        cache.seqlens = 0;
        // SAFETY: the views are the caller's (this function's contract), validated as a
        // decode call just above; a cache without lengths is read up to its capacity, Sk.
        unsafe { self.run_decode_for_forward(&decode, q, &cache, o, lse, stream) }
    }

    /// A packed (variable-length) forward call with at most [`MAX_QUERIES`] queries per
    /// sequence, run on the decode kernels' packed variants where [`varlen_takes_decode`]
    /// says that is faster, as [`Attention::forward_by_decode`] runs a dense one. Each
    /// sequence's keys are its rows of `k` and `v`, found through `cu_seqlens_k` by the
    /// kernels; the plan's capacity is the longest sequence's keys where the host copies
    /// tell it, else every key (an upper bound: it only sizes the splits). `None` where
    /// the call keeps the forward kernels, with nothing launched or written.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward_varlen`]; `problem` must come from validating these
    /// views with `varlen`.
    pub(crate) unsafe fn varlen_by_decode(
        &self,
        problem: &FwdProblem,
        varlen: &Varlen,
        [q, k, v, o]: [&TensorView; 4],
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Option<Result<()>> {
        if !varlen_takes_decode(problem, self.path_choice(), self.device().sm_count()) {
            return None;
        }
        let packed = problem.packed?;
        let s = &problem.shape;
        // The kernels step through K and V rows in 32-bit byte counts.
        let rows_fit = [k, v].iter().all(|t| {
            t.shape[1] <= 1
                || t.strides[1] as u128 * t.dtype.size_bytes() as u128 <= u32::MAX.into()
        });
        let longest = varlen.host.map_or(packed.total_k, |h| {
            let keys = h.cu_seqlens_k.windows(2).map(|w| (w[1] - w[0]) as usize);
            keys.max().unwrap_or(0)
        });
        let decode = DecodeProblem {
            cache: CacheShape {
                batch: s.batch,
                heads_kv: s.heads_kv,
                head_dim: s.head_dim,
                capacity: longest.max(1),
                page_size: 0,
                pool_pages: 0,
                fp8: false,
            },
            dtype: problem.dtype,
            seqlen_q: s.seqlen_q,
            heads_q: s.heads_q,
            scale: problem.scale,
            causal: problem.causal,
            window: problem.window,
            softcap: problem.softcap,
            packed: Some(packed),
        };
        if !rows_fit || s.heads_kv.saturating_mul(decode.row_chunks()) > MAX_GRID_YZ {
            return None;
        }
        let cache = KvCache {
            k: *k,
            v: *v,
            seqlens: 0,
            layout: CacheLayout::Contiguous,
            scales: None,
        };
        // SAFETY: the views and offsets are the caller's (this function's contract),
        // validated as a packed forward call; the kernels clamp every offset to the
        // tensors' rows, and read K and V in steps that fit 32 bits (checked above).
        unsafe { self.run_decode_for_forward(&decode, q, &cache, o, lse, stream) }
    }

    /// Plans and runs a forward call's decode (dense or packed) with its partial results
    /// in memory from the stream-ordered allocator, freed behind the launch. `None`,
    /// with nothing launched, where no plan or no memory is to be had.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]; `problem` must describe these views, validated.
    unsafe fn run_decode_for_forward(
        &self,
        problem: &DecodeProblem,
        q: &TensorView,
        cache: &KvCache,
        o: &TensorView,
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Option<Result<()>> {
        let plan = self.decode_plan(problem).ok()?;
        let workspace = match plan.workspace_bytes {
            0 => None,
            bytes => Some(Workspace {
                ptr: self.alloc_async(bytes, stream).ok()?,
                bytes,
            }),
        };
        // SAFETY: this function's contract; the workspace is `workspace_bytes` of fresh
        // memory, live until its free is queued behind the kernels.
        let ran = unsafe { self.run_decode(problem, &plan, q, cache, o, lse, workspace, stream) };
        if let Some(w) = workspace {
            self.free_behind_launch(w.ptr, stream);
        }
        Some(ran)
    }

    /// Writes `k_new`, `v_new` (`[B, Snew, Hkv, D]`) into `cache` at each sequence's
    /// positions `len .. len + Snew` (the lengths as the device holds them before the
    /// call; the caller advances them). Positions past the capacity and pages outside the
    /// pool are not written; `host` turns them into errors before anything runs, and
    /// also refuses new tokens on rows of a shared page that another sequence holds or
    /// writes in the same call ([`HostMetadata::check`]).
    ///
    /// # Safety
    ///
    /// As for [`Attention::decode`].
    pub unsafe fn append_kv(
        &self,
        cache: &KvCache,
        k_new: &TensorView,
        v_new: &TensorView,
        host: Option<&HostMetadata>,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_append(cache, k_new, v_new)?;
        if let Some(h) = host {
            h.check(cache, &problem.cache, problem.new_tokens)?;
        }
        let cfg = AppendConfig {
            paged: problem.cache.page_size > 0,
            fp8_from: problem.fp8_from,
        };
        if cfg.fp8_from.is_some() {
            self.check_fp8_cache_gpu()?;
        }
        let kernel = self.load(&cfg.id(), 0, || cfg.generate())?;
        let c = &problem.cache;
        let (block_table, table_stride) = cache.layout.table();
        let total = c.batch * problem.new_tokens * c.heads_kv * c.head_dim / 8;
        let (k_scale, v_scale, k_scale_stride, v_scale_stride) = scale_fields(cache);
        let mut args = AppendArgs {
            k_new: k_new.ptr,
            v_new: v_new.ptr,
            k_cache: cache.k.ptr,
            v_cache: cache.v.ptr,
            seqlens: cache.seqlens,
            block_table,
            k_new_stride: strides3(k_new),
            v_new_stride: strides3(v_new),
            k_cache_stride: strides3(&cache.k),
            v_cache_stride: strides3(&cache.v),
            block_table_stride: table_stride,
            new_tokens: problem.new_tokens as u32,
            heads: c.heads_kv as u32,
            chunks: (c.head_dim / 8) as u32,
            capacity: c.capacity as u32,
            pool_pages: c.pool_pages as u32,
            page_shift: c.page_shift(),
            total: total as u32,
            _pad: 0,
            k_scale,
            v_scale,
            k_scale_stride,
            v_scale_stride,
        };
        let blocks = total
            .div_ceil(APPEND_THREADS as usize)
            .min(self.device().sm_count() as usize * 8)
            .min(APPEND_MAX_BLOCKS);
        let dims = LaunchDims {
            grid: (blocks as u32, 1, 1),
            block: (APPEND_THREADS, 1, 1),
            dynamic_smem: 0,
        };
        let mut params = [(&mut args as *mut AppendArgs).cast::<c_void>()];
        // SAFETY: the one parameter is the by-value `AppendArgs`; the kernel reads the
        // validated extents of k_new/v_new and writes only cache rows at positions below
        // the capacity through block-table entries inside the pool; this function's
        // contract makes the memory live and `stream` valid.
        unsafe { launch(&kernel, &dims, stream, &mut params) }
    }

    /// Merges attention results over disjoint key shards into `out` (and `out_lse`): what
    /// attention over all their keys gives. Shards of LSE −∞ (every key masked) count
    /// for nothing; an LSE of +∞ or NaN (which no flashcore call writes, but
    /// FlashAttention-2 marks a row that saw no key with +∞) makes the merged row NaN.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`].
    pub unsafe fn merge(
        &self,
        parts: &MergeParts,
        out: &TensorView,
        out_lse: Option<&LseView>,
        stream: CUstream,
    ) -> Result<()> {
        let cfg = validate_merge(parts, out, out_lse)?;
        let kernel = self.load_merge(&cfg)?;
        let (mut args, dims) = merge_launch(parts, out, out_lse, &cfg, None);
        let columns = parts.o.shape[3];
        // SAFETY: `args` describes the shards' validated extents, which the kernel reads,
        // and `out`'s and `out_lse`'s, which it writes (a padded kernel only the rows'
        // columns); this function's contract makes the memory live.
        unsafe { launch_merge(&kernel, &cfg, &mut args, columns, &dims, stream, false) }
    }

    /// An e4m3 cache needs sm_89's conversions.
    /// A merge kernel, with the decode step's carveout: the decode combine and a public
    /// merge of float32 shards share an id where the combine is not launched
    /// programmatically (before Hopper), and an id always loads with one carveout.
    fn load_merge(&self, cfg: &MergeConfig) -> Result<Arc<LoadedKernel>> {
        self.load_with(
            cfg.id_static(),
            cfg.smem_bytes(),
            Carveout::MaxShared,
            || cfg.generate(),
        )
    }

    pub(crate) fn check_fp8_cache_gpu(&self) -> Result<()> {
        let arch = self.device().compute_capability();
        if arch < (8, 9) {
            return Err(Error::UnsupportedGpu {
                name: format!(
                    "{} (an e4m3 KV cache needs sm_89 or later)",
                    self.device().name()
                ),
                major: arch.0,
                minor: arch.1,
            });
        }
        Ok(())
    }
}

/// The caller's workspace is large enough, aligned and apart from every other buffer.
pub(crate) fn check_workspace(
    w: &Workspace,
    needed: usize,
    cache: &KvCache,
    q: &TensorView,
    o: &TensorView,
    lse: Option<&LseView>,
    p: &DecodeProblem,
) -> Result<()> {
    check_pointer("workspace", w.ptr, 256)?;
    if w.bytes < needed {
        return Err(Error::InvalidArgument(format!(
            "the workspace has {} bytes, this call needs {needed}",
            w.bytes
        )));
    }
    let end = u64::try_from(needed)
        .ok()
        .and_then(|n| w.ptr.checked_add(n))
        .ok_or_else(|| Error::BadStrides {
            tensor: "workspace",
            reason: format!(
                "a workspace of {needed} bytes at {:#x} passes the end of the address space",
                w.ptr
            ),
        })?;
    let range = (w.ptr, end);
    // Packed queries: the LSE is `[Hq, total_q]`, and the offsets are read too.
    let lse = match (lse, p.packed) {
        (Some(l), Some(packed)) => Some(("lse", lse_byte_range(l, 1, p.heads_q, packed.total_q)?)),
        (Some(l), None) => Some((
            "lse",
            lse_byte_range(l, p.cache.batch, p.heads_q, p.seqlen_q)?,
        )),
        (None, _) => None,
    };
    let offsets = p.packed.map(|packed| {
        let bytes = 4 * (p.cache.batch as u64 + 1);
        let start = packed.cu_seqlens_q;
        ("cu_seqlens_q", (start, start.saturating_add(bytes)))
    });
    let [k, v, k_scale, v_scale, lengths, table] = cache.byte_ranges(p.cache.batch);
    let views = [
        q.byte_range().map(|r| ("q", r)),
        o.byte_range().map(|r| ("o", r)),
        lse,
        offsets,
    ];
    let others = [k, v, k_scale, v_scale, lengths, table]
        .into_iter()
        .chain(views);
    for (name, r) in others.flatten() {
        if overlaps(range, r) {
            return Err(Error::InvalidArgument(format!(
                "the workspace overlaps {name}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn forward_problem(
        batch: usize,
        heads_q: usize,
        heads_kv: usize,
        seqlen_q: usize,
        seqlen_k: usize,
    ) -> FwdProblem {
        FwdProblem {
            shape: crate::shape::AttnShape {
                batch,
                seqlen_q,
                seqlen_k,
                heads_q,
                heads_kv,
                head_dim: 128,
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
    }

    #[test]
    fn decode_shaped_forwards_take_the_decode_kernels() {
        let min = FORWARD_DECODE_MIN_KEYS;
        for (sq, sk, routed) in [
            (1, min, true),
            (16, min, true),
            (16, 1 << 20, true),
            (1, min - 1, false),
            (17, min, false),
            (17, 1 << 20, false),
        ] {
            let p = forward_problem(2, 32, 8, sq, sk);
            assert_eq!(
                forward_takes_decode(&p, PathChoice::Best, 132),
                routed,
                "{sq} {sk}"
            );
            assert!(
                !forward_takes_decode(&p, PathChoice::Sm80, 132),
                "{sq} {sk}"
            );
        }
        let packed = FwdProblem {
            packed: Some(super::super::validate::Packed {
                cu_seqlens_q: 256,
                cu_seqlens_k: 512,
                total_q: 4,
                total_k: 4 * min,
                runs: Runs::All,
            }),
            ..forward_problem(4, 32, 8, 1, min)
        };
        assert!(!forward_takes_decode(&packed, PathChoice::Best, 132));
        // Shorter key sets where enough KV heads each serve 4 query heads or more.
        let (gqa, kv) = (FORWARD_DECODE_MIN_KEYS_GQA, FORWARD_DECODE_MIN_KV_HEADS);
        for (b, hq, hkv, sk, routed) in [
            (kv / 8, 32, 8, gqa, true),
            (kv / 8, 32, 8, gqa - 1, false),
            (kv / 8 - 1, 32, 8, gqa, false),
            (kv / 8, 24, 8, gqa, false),
            (kv / 8, 24, 8, min, true),
            (kv, 8, 1, gqa, true),
            (kv, 3, 1, gqa, false),
        ] {
            let p = forward_problem(b, hq, hkv, 16, sk);
            assert_eq!(
                forward_takes_decode(&p, PathChoice::Best, 132),
                routed,
                "B{b} Hq{hq} Hkv{hkv} Sk{sk}"
            );
        }
    }

    /// Where the forward kernels' items fill most of one wave and the decode kernels
    /// would read each KV head's keys for 4 row chunks or more, the forward kernels stay.
    #[test]
    fn one_wave_of_forward_items_keeps_the_forward_kernels() {
        let min = FORWARD_DECODE_MIN_KEYS;
        for (b, hq, hkv, sq, sms, routed) in [
            // 128 items of 64 rows per KV head on 132 SMs: the forward kernels.
            (4, 32, 8, 16, 132, false),
            (3, 32, 8, 16, 128, false),
            (8, 16, 2, 8, 132, false),
            // Fewer rows per KV head, fewer items, or more than a wave: decode.
            (4, 32, 8, 8, 132, true),
            (4, 32, 32, 16, 132, true),
            (3, 32, 8, 16, 132, true),
            (5, 32, 8, 16, 132, true),
            (4, 32, 8, 16, 120, true),
        ] {
            let p = forward_problem(b, hq, hkv, sq, min);
            let at = format!("B{b} Hq{hq} Hkv{hkv} Sq{sq} on {sms} SMs");
            assert_eq!(
                forward_takes_decode(&p, PathChoice::Best, sms),
                routed,
                "{at}"
            );
            let packed = packed_problem(b, (hq, hkv), sq, b * min);
            assert_eq!(
                varlen_takes_decode(&packed, PathChoice::Best, sms),
                routed,
                "{at}"
            );
        }
    }

    /// A packed batch of `batch` sequences, `max_q` queries at most, `total_k` keys.
    fn packed_problem(
        batch: usize,
        heads: (usize, usize),
        max_q: usize,
        total_k: usize,
    ) -> FwdProblem {
        let mut p = forward_problem(batch, heads.0, heads.1, max_q, total_k);
        p.packed = Some(Packed {
            cu_seqlens_q: 256,
            cu_seqlens_k: 512,
            total_q: batch * max_q,
            total_k,
            runs: Runs::All,
        });
        p
    }

    /// Packed batches take the decode kernels as dense calls of their mean key count
    /// would; the plan is a packed kernel's.
    #[test]
    fn decode_shaped_packed_batches_take_the_decode_kernels() {
        let (min, gqa) = (FORWARD_DECODE_MIN_KEYS, FORWARD_DECODE_MIN_KEYS_GQA);
        let kv = FORWARD_DECODE_MIN_KV_HEADS;
        for (b, heads, max_q, total_k, routed) in [
            (4, (32, 8), 1, 4 * min, true),
            (2, (32, 8), 16, 2 * min + 3, true),
            (1, (8, 8), 5, 32768, true),
            (4, (32, 8), 1, 4 * min - 1, false),
            (4, (32, 8), 17, 1 << 20, false),
            (kv / 8, (32, 8), 16, kv / 8 * gqa, true),
            (kv / 8, (32, 8), 16, kv / 8 * gqa - 1, false),
            (kv / 8 - 1, (32, 8), 16, (kv / 8 - 1) * gqa, false),
        ] {
            let p = packed_problem(b, heads, max_q, total_k);
            let at = format!("B{b} {heads:?} {max_q} {total_k}");
            assert_eq!(
                varlen_takes_decode(&p, PathChoice::Best, 132),
                routed,
                "{at}"
            );
            assert!(!varlen_takes_decode(&p, PathChoice::Sm80, 132), "{at}");
            assert!(!forward_takes_decode(&p, PathChoice::Best, 132), "{at}");
        }
        // A dense call is not a packed one.
        let dense = forward_problem(4, 32, 8, 1, 1 << 20);
        assert!(!varlen_takes_decode(&dense, PathChoice::Best, 132));
        // The plan of a packed problem runs a packed kernel.
        let p = packed_problem(4, (32, 8), 16, 1 << 16);
        let problem = DecodeProblem {
            cache: CacheShape {
                batch: 4,
                heads_kv: 8,
                head_dim: 128,
                capacity: 1 << 14,
                page_size: 0,
                pool_pages: 0,
                fp8: false,
            },
            dtype: HalfType::F16,
            seqlen_q: 16,
            heads_q: 32,
            scale: 0.1,
            causal: true,
            window: None,
            packed: p.packed,
            softcap: None,
        };
        assert_eq!(problem.layout(), DecodeLayout::Packed);
        let plan = plan_decode(&problem, 132, 227 * 1024).unwrap();
        assert!(plan.config.packed && !plan.config.paged, "{plan:?}");
        assert!(plan.config.id().ends_with("_packed"), "{plan:?}");
    }
    use crate::host::draw::Draw;
    use crate::host::kv_cache::{CacheLayout, KvScales, MAX_POOL_PAGES};

    pub(crate) const GB: u64 = 1 << 30;

    pub(crate) fn cache(
        b: usize,
        cap: usize,
        hkv: usize,
        d: usize,
        paged: Option<usize>,
    ) -> KvCache {
        let (k, v, layout) = match paged {
            None => (
                TensorView::bshd(GB, DType::F16, b, cap, hkv, d),
                TensorView::bshd(2 * GB, DType::F16, b, cap, hkv, d),
                CacheLayout::Contiguous,
            ),
            Some(page) => {
                let pages = cap / page;
                (
                    TensorView::bshd(GB, DType::F16, b * pages, page, hkv, d),
                    TensorView::bshd(2 * GB, DType::F16, b * pages, page, hkv, d),
                    CacheLayout::Paged {
                        block_table: 3 * GB,
                        max_pages: pages,
                        table_stride: pages,
                    },
                )
            }
        };
        KvCache {
            k,
            v,
            seqlens: 3 * GB + (1 << 20),
            layout,
            scales: None,
        }
    }

    fn q(b: usize, sq: usize, hq: usize, d: usize, at: u64) -> TensorView {
        TensorView::bshd(at, DType::F16, b, sq, hq, d)
    }

    /// `cache(...)` holding e4m3 codes, with scale tensors `[outer, rows, Hkv, 1]` at
    /// 6 GB and 7 GB.
    pub(crate) fn fp8_cache(
        b: usize,
        cap: usize,
        hkv: usize,
        d: usize,
        paged: Option<usize>,
    ) -> KvCache {
        let mut c = cache(b, cap, hkv, d, paged);
        for t in [&mut c.k, &mut c.v] {
            *t = TensorView::bshd(t.ptr, DType::E4m3, t.shape[0], t.shape[1], hkv, d);
        }
        let [outer, rows, ..] = c.k.shape;
        let scale = |at| TensorView::bshd(at, DType::F32, outer, rows, hkv, 1);
        c.scales = Some(KvScales {
            k: scale(6 * GB),
            v: scale(7 * GB),
        });
        c
    }

    #[test]
    fn fp8_caches_take_16_bit_queries_and_pick_the_e4m3_kernels() {
        for paged in [None, Some(16)] {
            for dt in [DType::F16, DType::Bf16] {
                let c = fp8_cache(2, 1024, 2, 128, paged);
                let qv = TensorView {
                    dtype: dt,
                    ..q(2, 3, 8, 128, 4 * GB)
                };
                let p = check(&qv, &c).unwrap();
                assert!(p.cache.fp8);
                let plan = plan_decode(&p, 132, 227 * 1024).unwrap();
                assert!(plan.config.fp8, "{paged:?} {dt}");
                assert_eq!(plan.config.paged, paged.is_some());
                assert_eq!(plan.config.stages, 3);
                // Three blocks share an sm_90 SM.
                assert!(3 * (plan.config.smem_bytes() + 1024) <= 228 * 1024);
                // sm_89's 99 KiB still finds a ring.
                assert!(plan_decode(&p, 58, 99 * 1024).unwrap().config.fp8);
            }
        }
        // The 16-bit cache's plan is unchanged by the new field.
        let p = check(&q(2, 1, 8, 128, 4 * GB), &cache(2, 1024, 2, 128, None)).unwrap();
        assert!(!plan_decode(&p, 132, 227 * 1024).unwrap().config.fp8);
    }

    #[test]
    fn fp8_caches_refuse_bad_scales_and_dtypes_with_typed_errors() {
        let good = fp8_cache(2, 1024, 2, 64, Some(16));
        let q0 = q(2, 1, 4, 64, 4 * GB);
        assert!(check(&q0, &good).is_ok());
        let err = |c: &KvCache| check(&q0, c).unwrap_err();

        let mut none = good;
        none.scales = None;
        assert!(matches!(err(&none), Error::InvalidArgument(m) if m.contains("scales")));
        let mut extra = cache(2, 1024, 2, 64, Some(16));
        extra.scales = good.scales;
        assert!(matches!(err(&extra), Error::InvalidArgument(m) if m.contains("e4m3")));

        let with = |f: &dyn Fn(&mut KvScales)| {
            let mut c = good;
            f(c.scales.as_mut().unwrap());
            c
        };
        assert!(matches!(
            err(&with(&|s| s.k.dtype = DType::F16)),
            Error::UnsupportedDType(_)
        ));
        assert!(matches!(
            err(&with(&|s| s.v.shape[1] = 8)),
            Error::ShapeMismatch(_)
        ));
        assert!(matches!(
            err(&with(&|s| s.v.shape[3] = 2)),
            Error::ShapeMismatch(_)
        ));
        assert!(matches!(
            err(&with(&|s| s.k.ptr += 2)),
            Error::Misaligned { .. }
        ));
        assert!(matches!(
            err(&with(&|s| s.k.ptr = 0)),
            Error::NullPointer("k_scale")
        ));
        // Scales inside the codes, or on each other (one tensor for K and V): a decode
        // reads them; an append, which writes them, refuses them.
        let new = TensorView::bshd(4 * GB, DType::F16, 2, 1, 2, 64);
        let v_new = TensorView { ptr: 5 * GB, ..new };
        assert!(validate_append(&good, &new, &v_new).is_ok());
        for shared in [
            with(&|s| s.k.ptr = GB + 64),
            with(&|s| s.v.ptr = 3 * GB),
            with(&|s| s.v.ptr = s.k.ptr + 4),
            with(&|s| s.v = s.k),
        ] {
            assert!(check(&q0, &shared).is_ok());
            assert!(matches!(
                validate_append(&shared, &new, &v_new),
                Err(Error::InvalidArgument(m)) if m.contains("overlaps")
            ));
        }
        // Repeated scales (zero strides: per KV head, per sequence and head, one for the
        // whole cache) are read by a decode, and refused by an append, which writes them.
        for strides in [[0, 0, 1, 1], [2, 0, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]] {
            let repeated = with(&|s| s.k.strides = strides);
            assert!(check(&q0, &repeated).is_ok(), "{strides:?}");
            assert!(
                matches!(
                    validate_append(&repeated, &new, &v_new),
                    Err(Error::BadStrides {
                        tensor: "k_scale",
                        ..
                    })
                ),
                "{strides:?}"
            );
        }
        let repeated_v = with(&|s| s.v.strides = [0, 0, 1, 1]);
        assert!(check(&q0, &repeated_v).is_ok());
        assert!(matches!(
            validate_append(&repeated_v, &new, &v_new),
            Err(Error::BadStrides {
                tensor: "v_scale",
                ..
            })
        ));
        // Strided scales (a [.., Hkv] slice of a wider tensor) are fine.
        assert!(check(&q0, &with(&|s| s.k.strides = [16 * 4, 4, 1, 1])).is_ok());

        // Head dims without e4m3 kernels, a wrong q dtype, codes of mixed types.
        let d96 = fp8_cache(2, 1024, 2, 96, None);
        assert!(matches!(
            check(&q(2, 1, 4, 96, 4 * GB), &d96),
            Err(Error::UnsupportedHeadDim(96, _))
        ));
        let q8 = TensorView {
            dtype: DType::E4m3,
            ..q0
        };
        assert!(matches!(check(&q8, &good), Err(Error::UnsupportedDType(_))));
        let mut mixed = good;
        mixed.v.dtype = DType::F16;
        assert!(matches!(err(&mixed), Error::UnsupportedDType(_)));
    }

    #[test]
    fn fp8_appends_quantize_16_bit_tokens_only() {
        let c = fp8_cache(2, 1024, 2, 128, None);
        let new = |dt| TensorView::bshd(4 * GB, dt, 2, 3, 2, 128);
        let v_new = |dt| TensorView {
            ptr: 5 * GB,
            ..new(dt)
        };
        for dt in [DType::F16, DType::Bf16] {
            let p = validate_append(&c, &new(dt), &v_new(dt)).unwrap();
            assert_eq!(p.fp8_from, dt.half_type());
        }
        for (k, v) in [
            (DType::E4m3, DType::E4m3),
            (DType::F16, DType::Bf16),
            (DType::F32, DType::F32),
        ] {
            assert!(matches!(
                validate_append(&c, &new(k), &v_new(v)),
                Err(Error::UnsupportedDType(_))
            ));
        }
        // New tokens may not overlap the scales they are about to write.
        let onto = TensorView {
            ptr: 6 * GB,
            ..new(DType::F16)
        };
        assert!(matches!(
            validate_append(&c, &onto, &v_new(DType::F16)),
            Err(Error::InvalidArgument(m)) if m.contains("k_scale")
        ));
        // A 16-bit cache still takes its own dtype only.
        let plain = cache(2, 1024, 2, 128, None);
        let p = validate_append(&plain, &new(DType::F16), &v_new(DType::F16)).unwrap();
        assert_eq!(p.fp8_from, None);
    }

    fn check(qv: &TensorView, c: &KvCache) -> Result<DecodeProblem> {
        let o = TensorView { ptr: 5 * GB, ..*qv };
        validate_decode(qv, c, &o, None, &AttentionParams::default())
    }

    /// The workspace query checks q as the decode call does: a q the call refuses gets
    /// the same error there, never a size.
    #[test]
    fn workspace_query_refuses_what_decode_refuses() {
        let c = cache(2, 1024, 2, 64, None);
        let good = q(2, 1, 8, 64, 4 * GB);
        assert!(decode_q_problem(&good, &c).is_ok());
        let mut strided = good;
        strided.strides[2] = 2;
        for bad in [
            TensorView { ptr: 0, ..good },
            TensorView {
                ptr: 4 * GB + 2,
                ..good
            },
            strided,
        ] {
            let want = check(&bad, &c).unwrap_err();
            let got = decode_q_problem(&bad, &c).unwrap_err();
            assert_eq!(
                std::mem::discriminant(&got),
                std::mem::discriminant(&want),
                "{got} against {want}"
            );
        }
    }

    /// 2^32 + 64 is not 64: a head dim past u32 is refused, not narrowed into the
    /// kernels' list (which would attend over 64 of its columns at the wrong scale).
    #[test]
    fn head_dims_past_u32_are_refused() {
        const HUGE_D: usize = (1 << 32) + 64;
        let far = 1 << 40;
        let c = KvCache {
            k: TensorView::bshd(far, DType::F16, 1, 1, 1, HUGE_D),
            v: TensorView::bshd(2 * far, DType::F16, 1, 1, 1, HUGE_D),
            ..cache(1, 1, 1, 64, None)
        };
        assert!(matches!(
            check(&q(1, 1, 1, HUGE_D, 3 * far), &c),
            Err(Error::UnsupportedHeadDim(HUGE_D, _))
        ));
        let parts = MergeParts {
            o: TensorView::bshd(far, DType::F32, 1, 1, 1, HUGE_D),
            count: 1,
            shard_stride: HUGE_D,
            lse: 2 * far,
        };
        let out = TensorView::bshd(3 * far, DType::F32, 1, 1, 1, HUGE_D);
        assert!(matches!(
            validate_merge(&parts, &out, None),
            Err(Error::UnsupportedHeadDim(HUGE_D, _))
        ));
    }

    #[test]
    fn decode_accepts_contiguous_and_paged_caches() {
        let p = check(&q(4, 1, 32, 128, 4 * GB), &cache(4, 4096, 8, 128, None)).unwrap();
        assert_eq!((p.group(), p.row_chunks(), p.cache.capacity), (4, 1, 4096));
        let p = check(&q(2, 16, 16, 64, 4 * GB), &cache(2, 1024, 2, 64, Some(16))).unwrap();
        assert_eq!((p.cache.page_size, p.cache.pool_pages), (16, 128));
        assert_eq!(p.row_chunks(), 8);
        assert_eq!(p.cache.page_shift(), 4);
    }

    #[test]
    fn position_and_page_strides_of_4_gib_or_more_are_refused() {
        // The kernels step between positions and pages in 32-bit byte offsets.
        let q0 = q(2, 1, 4, 64, 4 * GB);
        let spread = |c: &KvCache, dim: usize, elems: usize| {
            let mut c = *c;
            for (t, at) in [(&mut c.k, 100 * GB), (&mut c.v, 400 * GB)] {
                t.ptr = at;
                t.strides[dim] = elems;
                if dim == 1 {
                    t.strides[0] = elems * t.shape[1];
                }
            }
            c
        };
        let below = (1 << 31) - 64; // elements of 2 bytes: just under 4 GiB
        let contiguous = cache(2, 64, 2, 64, None);
        assert!(check(&q0, &spread(&contiguous, 1, below)).is_ok());
        assert!(matches!(
            check(&q0, &spread(&contiguous, 1, 1 << 31)),
            Err(Error::BadStrides { tensor: "k_cache", ref reason }) if reason.contains("position")
        ));
        let paged = cache(2, 1024, 2, 64, Some(16));
        assert!(check(&q0, &spread(&paged, 0, below)).is_ok());
        assert!(matches!(
            check(&q0, &spread(&paged, 0, 1 << 31)),
            Err(Error::BadStrides { tensor: "k_cache", ref reason }) if reason.contains("page")
        ));
        // A dimension of one entry is only indexed at 0: its stride does not matter.
        let one_page = cache(1, 16, 2, 64, Some(16));
        assert!(check(&q(1, 1, 4, 64, 4 * GB), &spread(&one_page, 0, 1 << 40)).is_ok());
    }

    /// Which calls over a cache the forward kernels take (more than 16 queries, a 16-bit
    /// cache they can read) and what they are given: the capacity as keys, the lengths as
    /// used keys, a paged cache's table on the sm90 path only.
    #[test]
    fn long_query_chunks_over_a_cache_take_the_forward_kernels() {
        const H200: ((i32, i32), u32) = ((9, 0), 132);
        const A100: ((i32, i32), u32) = ((8, 0), 108);
        let plan = |gpu, choice, sq: usize, c: &KvCache, params: &AttentionParams| {
            let problem = decode_problem(&q(2, sq, 8, c.k.shape[3], 4 * GB), c, params).unwrap();
            decode_forward_plan_on(gpu, choice, &problem, c)
        };
        let causal = AttentionParams {
            causal: true,
            ..AttentionParams::default()
        };
        let best = PathChoice::Best;
        let contiguous = cache(2, 4096, 2, 128, None);
        for (sq, taken) in [(1, false), (16, false), (17, true), (1024, true)] {
            let got = plan(H200, best, sq, &contiguous, &causal);
            assert_eq!(got.is_some(), taken, "Sq {sq}");
        }
        let (forward, cfg) = plan(H200, best, 300, &contiguous, &causal).unwrap();
        assert_eq!(forward.shape.seqlen_k, 4096);
        assert_eq!(forward.seqused_k, Some(contiguous.seqlens));
        assert_eq!((forward.pages, forward.causal), (None, true));
        assert_eq!(cfg.path, Path::Sm90);
        // The sm80 path's forward kernels read a contiguous cache, not a paged one.
        let (_, cfg) = plan(A100, best, 300, &contiguous, &causal).unwrap();
        assert_eq!(cfg.path, Path::Sm80);
        let (_, cfg) = plan(H200, PathChoice::Sm80, 300, &contiguous, &causal).unwrap();
        assert_eq!(cfg.path, Path::Sm80);
        for page in [16, 64, 256] {
            let paged = cache(2, 4096, 2, 128, Some(page));
            let (forward, cfg) = plan(H200, best, 300, &paged, &causal).unwrap();
            let table = forward.pages.unwrap();
            assert_eq!(1 << table.page_shift, page);
            assert_eq!(
                (table.max_pages, table.table_stride),
                ((4096 / page) as u32, (4096 / page) as u32)
            );
            assert_eq!(cfg.path, Path::Sm90);
            assert!(
                plan(A100, best, 300, &paged, &causal).is_none(),
                "page {page}"
            );
        }
        // Pages below 16 and e4m3 caches stay on the decode kernels.
        assert!(plan(H200, best, 300, &cache(2, 4096, 2, 128, Some(8)), &causal).is_none());
        assert!(plan(H200, best, 300, &fp8_cache(2, 4096, 2, 128, None), &causal).is_none());
        // So do windows on kernels that do not read the lengths: every sm80 windowed one.
        let windowed = AttentionParams {
            window: crate::host::tensor::Window::sliding(256),
            ..causal
        };
        assert!(plan(A100, best, 300, &contiguous, &windowed).is_none());
        let (forward, cfg) = plan(H200, best, 300, &contiguous, &windowed).unwrap();
        assert!(cfg.window && cfg.reads_used_keys() && forward.window.is_some());
    }

    #[test]
    fn decode_refuses_bad_input_with_typed_errors() {
        let c = cache(2, 1024, 2, 64, Some(16));
        let q0 = q(2, 1, 4, 64, 4 * GB);
        // Any query count: past the decode kernels' grid (KV heads x blocks of 16 query
        // rows) only their plan refuses it, since the forward kernels may take the call.
        assert!(check(&q(2, 17, 4, 64, 4 * GB), &c).is_ok());
        assert!(check(&q(2, 4096, 4, 64, 4 * GB), &c).is_ok());
        let long = check(&q(2, 600_000, 4, 64, 4 * GB), &c).unwrap();
        assert!(matches!(
            plan_decode(&long, 132, 227 * 1024),
            Err(Error::InvalidArgument(e)) if e.contains("grid limit")
        ));
        // 2 KV heads x ceil(Sq · 2 / 16) chunks: 65534 at 262136 queries, 65536 past it.
        let plan = |sq| plan_decode(&check(&q(2, sq, 4, 64, 4 * GB), &c).unwrap(), 132, 1 << 20);
        assert!(plan(262_136).is_ok());
        assert!(
            matches!(plan(262_144), Err(Error::InvalidArgument(e)) if e.contains("grid limit"))
        );
        // Sequences of queries are bounded as every call's are (a paged cache's call of
        // 2^31 queries would reach the forward kernels, which count rows in 31 bits).
        let long = |sq| {
            let q = q(2, sq, 4, 64, 4 * GB);
            let o = TensorView { ptr: 64 * GB, ..q };
            validate_decode(&q, &c, &o, None, &AttentionParams::default())
        };
        assert!(long(MAX_SEQLEN).is_ok());
        assert!(matches!(
            long(MAX_SEQLEN + 1),
            Err(Error::InvalidArgument(e)) if e.contains("2^25")
        ));
        assert!(matches!(
            check(&q(2, 1, 3, 64, 4 * GB), &c),
            Err(Error::HeadRatio { .. })
        ));
        assert!(matches!(
            check(&q(3, 1, 4, 64, 4 * GB), &cache(2, 64, 2, 64, None)),
            Err(Error::ShapeMismatch(_))
        ));
        for d in [264, 512, 1024] {
            assert!(matches!(
                check(&q(2, 1, 4, d, 4 * GB), &cache(2, 64, 2, d, None)),
                Err(Error::UnsupportedHeadDim(got, HEAD_DIMS_TEXT)) if got == d
            ));
        }
        assert!(matches!(
            check(&q(2, 1, 4, 64, 4 * GB + 8), &c),
            Err(Error::Misaligned { .. })
        ));
        let mut odd = c;
        odd.k.shape[1] = 48;
        odd.v.shape[1] = 48;
        assert!(
            matches!(check(&q0, &odd), Err(Error::InvalidArgument(ref m)) if m.contains("power of two"))
        );
        let mut no_table = c;
        no_table.layout = CacheLayout::Paged {
            block_table: 0,
            max_pages: 64,
            table_stride: 64,
        };
        assert!(matches!(
            check(&q0, &no_table),
            Err(Error::NullPointer("block_table"))
        ));
        let mut short = c;
        short.layout = CacheLayout::Paged {
            block_table: 3 * GB,
            max_pages: 64,
            table_stride: 63,
        };
        assert!(matches!(check(&q0, &short), Err(Error::BadStrides { .. })));
        let mut bf = c;
        bf.v.dtype = DType::Bf16;
        assert!(matches!(check(&q0, &bf), Err(Error::UnsupportedDType(_))));
        let mut nolen = c;
        nolen.seqlens = 0;
        assert!(matches!(
            check(&q0, &nolen),
            Err(Error::NullPointer("seqlens"))
        ));
        // The output may not overlap the cache or q, nor the LSE the output.
        let o = TensorView { ptr: GB, ..q0 };
        let e = validate_decode(&q0, &c, &o, None, &AttentionParams::default());
        assert!(matches!(e, Err(Error::InvalidArgument(ref m)) if m.contains("overlaps")));
        let o = TensorView { ptr: 5 * GB, ..q0 };
        let lse = LseView { ptr: 5 * GB };
        let e = validate_decode(&q0, &c, &o, Some(&lse), &AttentionParams::default());
        assert!(matches!(e, Err(Error::InvalidArgument(_))));
        let bad_scale = AttentionParams {
            softmax_scale: Some(-1.0),
            causal: false,
            ..Default::default()
        };
        assert!(validate_decode(&q0, &c, &o, None, &bad_scale).is_err());
    }

    /// The public pieces a caller may drive by hand (a plan, host metadata, a
    /// workspace) refuse inconsistent inputs with an error rather than dividing by zero,
    /// overflowing or wrapping an address.
    #[test]
    fn hand_made_inputs_get_errors_not_panics() {
        let c = cache(2, 1024, 2, 128, None);
        let p = check(&q(2, 1, 8, 128, 4 * GB), &c).unwrap();
        let mut no_batch = p;
        no_batch.cache.batch = 0;
        assert!(plan_decode(&no_batch, 132, 227 * 1024).is_err());
        let mut no_heads = p;
        no_heads.cache.heads_kv = 0;
        assert_eq!(no_heads.group(), 8);
        assert!(plan_decode(&no_heads, 132, 227 * 1024).is_err());
        let mut uneven = p;
        uneven.heads_q = 7;
        assert!(plan_decode(&uneven, 132, 227 * 1024).is_err());
        // Head dims without a kernel: 84 and 264 (whose generators would index past
        // their tables), 2^32 + 64 (not narrowed onto 64), and the 16-bit-only ones on an
        // e4m3 cache, 80 among them.
        let unserved = [
            (84, false),
            (264, false),
            ((1 << 32) + 64, false),
            (32, true),
            (96, true),
            (80, true),
        ];
        for (d, fp8) in unserved {
            let mut odd = p;
            odd.cache.head_dim = d;
            odd.cache.fp8 = fp8;
            assert!(
                matches!(
                    plan_decode(&odd, 132, 227 * 1024),
                    Err(Error::UnsupportedHeadDim(got, _)) if got == d
                ),
                "head dim {d}, fp8 {fp8}"
            );
        }
        let mut fp8 = p;
        fp8.cache.fp8 = true;
        assert!(plan_decode(&fp8, 132, 227 * 1024).unwrap().config.fp8);
        // 2^31 query rows (B · Sq · Hq) or more would wrap the merge's row count: refused,
        // one row fewer planned (with a workspace past 2^40 bytes, computed without
        // overflow).
        let mut rows = p;
        rows.cache.batch = 1 << 20;
        rows.heads_q = 1 << 11;
        rows.cache.heads_kv = 1 << 11;
        rows.seqlen_q = 1;
        assert!(matches!(
            plan_decode(&rows, 132, 227 * 1024),
            Err(Error::InvalidArgument(ref m)) if m.contains("2^31")
        ));
        rows.cache.batch = (1 << 20) - 1;
        rows.cache.capacity = 1 << 20;
        assert!(plan_decode(&rows, 132, 227 * 1024).is_ok());
        // A capacity whose splits' partial results pass the address space.
        let mut endless = rows;
        endless.cache.capacity = usize::MAX;
        assert!(matches!(
            plan_decode(&endless, 132, 227 * 1024),
            Err(Error::InvalidArgument(ref m)) if m.contains("address space")
        ));

        let shape = c.validate(2).unwrap();
        let lens = HostMetadata {
            seqlens: &[4, 3],
            block_table: None,
        };
        assert!(lens.check(&c, &shape, usize::MAX).is_err());
        let paged = cache(2, 64, 2, 64, Some(16));
        let mut pshape = paged.validate(2).unwrap();
        let table: Vec<i32> = (0..8).collect();
        let meta = HostMetadata {
            seqlens: &[4, 3],
            block_table: Some(&table),
        };
        assert!(meta.check(&paged, &pshape, 0).is_ok());
        pshape.page_size = 0;
        assert!(meta.check(&paged, &pshape, 0).is_err());

        // 2^61 heads of 8 (a zero head stride gets this far): the chunk count
        // overflows and is refused.
        let huge = TensorView {
            ptr: GB,
            dtype: DType::F16,
            shape: [1, 1, 1 << 61, 8],
            strides: [0, 0, 0, 1],
        };
        let huge_cache = KvCache {
            k: huge,
            v: TensorView {
                ptr: 2 * GB,
                ..huge
            },
            ..c
        };
        let new = TensorView {
            ptr: 4 * GB,
            ..huge
        };
        let vnew = TensorView {
            ptr: 5 * GB,
            ..huge
        };
        assert!(validate_append(&huge_cache, &new, &vnew).is_err());

        // A split decode's workspace whose end passes 2^64.
        let plan = plan_decode(&p, 132, 227 * 1024).unwrap();
        assert!(plan.splits > 1);
        let o = q(2, 1, 8, 128, 5 * GB);
        let w = Workspace {
            ptr: u64::MAX - 255,
            bytes: usize::MAX,
        };
        let q1 = q(2, 1, 8, 128, 4 * GB);
        let e = check_workspace(&w, plan.workspace_bytes, &c, &q1, &o, None, &p);
        assert!(
            matches!(
                e,
                Err(Error::BadStrides {
                    tensor: "workspace",
                    ..
                })
            ),
            "{e:?}"
        );
    }

    /// Host metadata of a paged cache: `seqlens` and the block table `table`.
    fn paged_meta<'a>(seqlens: &'a [i32], table: &'a [i32]) -> HostMetadata<'a> {
        HostMetadata {
            seqlens,
            block_table: Some(table),
        }
    }

    /// Sequences may share pages (a common prefix) for reading. An append is refused
    /// where two sequences' new tokens land on the same rows of one page, and where a
    /// sequence's new tokens land on rows another sequence holds on a page they share.
    #[test]
    fn appends_into_shared_pages_must_not_collide() {
        let c = cache(2, 64, 2, 64, Some(16));
        let shape = c.validate(2).unwrap();
        // Page 0 is both sequences' first page.
        let table = [0, 1, 2, 3, 0, 5, 6, 7];
        let meta = |lens: &'static [i32]| paged_meta(lens, &table);
        for lens in [&[3, 3][..], &[3, 5], &[20, 3], &[0, 0]] {
            assert!(meta(lens).check(&c, &shape, 0).is_ok(), "{lens:?}: reads");
        }
        // A full shared page, each sequence appending on its own pages, within one page
        // and across two.
        for (lens, extra) in [(&[16, 16][..], 2), (&[20, 16], 2), (&[16, 16], 20)] {
            assert!(
                meta(lens).check(&c, &shape, extra).is_ok(),
                "{lens:?} + {extra}"
            );
        }
        // Both append onto the same rows of page 0.
        for lens in [&[3, 3][..], &[3, 4], &[4, 3], &[1, 0]] {
            let e = meta(lens).check(&c, &shape, 2);
            assert!(
                matches!(e, Err(Error::InvalidArgument(ref m)) if m.contains("both append")
                    && m.contains("page 0")),
                "{lens:?}: {e:?}"
            );
        }
        // One appends over rows the other holds: sequence 0 over sequence 1's positions
        // 3..5; sequence 1 over rows 3..5 of the page sequence 0 has filled; longer appends
        // that reach the shared page from position 0 or cross into the next page.
        for (lens, extra, writer, holder, rows) in [
            (&[3, 5][..], 2, 0, 1, "rows 3..5 of page 0"),
            (&[20, 3], 2, 1, 0, "rows 3..5 of page 0"),
            (&[16, 0], 16, 1, 0, "rows 0..16 of page 0"),
            (&[10, 0], 10, 1, 0, "rows 0..10 of page 0"),
        ] {
            let e = meta(lens).check(&c, &shape, extra);
            let Err(Error::InvalidArgument(m)) = &e else {
                panic!("{lens:?} + {extra}: {e:?}");
            };
            assert!(
                m.contains(&format!("sequence {writer} would append over {rows}"))
                    && m.contains(&format!("sequence {holder} holds")),
                "{lens:?} + {extra}: {m}"
            );
        }
        // The overlap check allocates nothing by the pool's page count, which is the
        // caller's (it was a mark per page: 2 GiB of host memory for a pool described
        // with 2^31 pages, which a check function needs no memory behind): it looks
        // pages up among the writes, wherever in the pool they are.
        let pages = MAX_POOL_PAGES;
        let pool = |at| TensorView::bshd(at, DType::F16, pages, 1, 2, 64);
        let huge = KvCache {
            k: pool(GB),
            v: pool(GB << 10),
            layout: CacheLayout::Paged {
                block_table: 3 * GB,
                max_pages: 4,
                table_stride: 4,
            },
            ..c
        };
        let shape = huge.validate(2).unwrap();
        let far = [i32::MAX - 1, 7, 9, 3, 0, 1, 2, i32::MAX - 1];
        let meta = |lens: &'static [i32]| paged_meta(lens, &far);
        assert!(meta(&[1, 1]).check(&huge, &shape, 2).is_ok());
        // Sequence 1's fourth page is sequence 0's first, which holds one row.
        let e = meta(&[1, 3]).check(&huge, &shape, 1);
        assert!(
            matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("sequence 1 would append over rows 0..1")),
            "{e:?}"
        );
    }

    /// One sequence's live pages are distinct: a page named twice would put two of its
    /// positions on one row. Entries past the live positions are not looked at.
    #[test]
    fn a_sequence_never_names_one_page_twice() {
        let c = cache(2, 64, 2, 64, Some(16));
        let shape = c.validate(2).unwrap();
        // Sequence 0's pages 0 and 2 are both pool page 1.
        let table = [1, 4, 1, 3, 0, 5, 6, 7];
        let meta = |lens: &'static [i32]| paged_meta(lens, &table);
        assert!(
            meta(&[32, 64]).check(&c, &shape, 0).is_ok(),
            "two live pages"
        );
        assert!(
            meta(&[31, 0]).check(&c, &shape, 1).is_ok(),
            "the append ends in page 1"
        );
        for (lens, extra) in [(&[33, 0][..], 0), (&[32, 0], 1), (&[20, 0], 30)] {
            let e = meta(lens).check(&c, &shape, extra);
            assert!(
                matches!(e, Err(Error::InvalidArgument(ref m)) if m.contains("page 1 twice")),
                "{lens:?} + {extra}: {e:?}"
            );
        }
    }

    #[test]
    fn host_metadata_is_checked_against_capacity_and_pool() {
        let c = cache(2, 64, 2, 64, Some(16));
        let shape = c.validate(2).unwrap();
        let table: Vec<i32> = (0..8).collect();
        let ok = HostMetadata {
            seqlens: &[64, 3],
            block_table: Some(&table),
        };
        ok.check(&c, &shape, 0).unwrap();
        assert!(
            ok.check(&c, &shape, 1).is_err(),
            "an append past the capacity"
        );
        let long = HostMetadata {
            seqlens: &[65, 3],
            block_table: Some(&table),
        };
        assert!(
            matches!(long.check(&c, &shape, 0), Err(Error::InvalidArgument(ref m)) if m.contains("capacity"))
        );
        let negative = HostMetadata {
            seqlens: &[-1, 3],
            block_table: Some(&table),
        };
        assert!(negative.check(&c, &shape, 0).is_err());
        let mut bad = table.clone();
        bad[4] = 8;
        let outside = HostMetadata {
            seqlens: &[64, 3],
            block_table: Some(&bad),
        };
        assert!(
            matches!(outside.check(&c, &shape, 0), Err(Error::InvalidArgument(ref m)) if m.contains("outside the pool"))
        );
        // Entries past a sequence's last page are not looked at.
        bad[4] = 0;
        bad[7] = -9;
        HostMetadata {
            seqlens: &[64, 3],
            block_table: Some(&bad),
        }
        .check(&c, &shape, 0)
        .unwrap();
        let missing = HostMetadata {
            seqlens: &[1, 1],
            block_table: None,
        };
        assert!(missing.check(&c, &shape, 0).is_err());
        let count = HostMetadata {
            seqlens: &[1],
            block_table: Some(&table),
        };
        assert!(matches!(
            count.check(&c, &shape, 0),
            Err(Error::ShapeMismatch(_))
        ));
    }

    #[test]
    fn splits_fill_the_gpu_and_depend_only_on_capacities() {
        let plan_paged = |b, cap, pages| {
            let p = decode_problem(
                &q(b, 1, 32, 128, 4 * GB),
                &cache(b, cap, 8, 128, pages),
                &AttentionParams::default(),
            )
            .unwrap();
            plan_decode(&p, 132, 227 * 1024).unwrap()
        };
        let plan = |b, cap| plan_paged(b, cap, None);
        let one = plan(1, 32768);
        // Head dim 128's 3-stage ring keeps 64 KiB of reads in flight: the eight KV heads'
        // splits fill one wave of one block per SM.
        assert_eq!(one.config.blocks_per_sm(), 1);
        // One long sequence is split over the SMs: as many splits as one wave holds.
        assert_eq!(one.splits, 16);
        assert!(one.workspace_bytes >= one.splits * 32 * 128 * 4);
        // A paged cache takes a fourth stage, still one block per SM: the same splits.
        let paged = plan_paged(1, 32768, Some(16));
        assert_eq!((one.config.stages, paged.config.stages), (3, 4));
        assert_eq!(paged.config.blocks_per_sm(), 1);
        assert_eq!(paged.splits, one.splits);
        // Sixteen sequences' 128 blocks are a wave already.
        assert_eq!(plan(16, 8192).splits, 1);
        // An e4m3 cache wants every block that fits (three per SM): more splits.
        let fp8 = |b, cap| {
            let p = decode_problem(
                &q(b, 1, 32, 128, 4 * GB),
                &fp8_cache(b, cap, 8, 128, None),
                &AttentionParams::default(),
            )
            .unwrap();
            plan_decode(&p, 132, 227 * 1024).unwrap()
        };
        assert_eq!(fp8(1, 32768).config.blocks_per_sm(), 3);
        assert_eq!(fp8(1, 32768).splits, 49, "396 blocks a wave, 8 KV heads");
        assert_eq!(fp8(16, 8192).splits, 3);
        // Batches between one split's wave and a wave: the splits that fit one wave.
        assert_eq!(plan(2, 8192).splits, 8);
        assert_eq!(plan(3, 8192).splits, 5);
        // More blocks than a wave holds: the fewest splits that fill the last wave to
        // 85% (160 blocks: 3 splits make 480 of 528 slots).
        assert_eq!(plan(20, 8192).splits, 3);
        assert_eq!(plan(64, 4096).splits, 1, "a full batch needs no split");
        assert_eq!(plan(64, 4096).workspace_bytes, 0);
        // Short capacities are split no finer than MIN_SPLIT_KEYS.
        assert!(plan(1, 512).splits <= 2);
        // A GPU with 99 KiB per block gets a ring that fits it.
        let p = decode_problem(
            &q(1, 1, 8, 256, 4 * GB),
            &cache(1, 4096, 1, 256, Some(64)),
            &AttentionParams::default(),
        )
        .unwrap();
        let small = plan_decode(&p, 58, 99 * 1024).unwrap();
        assert!(small.config.smem_bytes() <= 99 * 1024);
        assert!(plan_decode(&p, 58, 32 * 1024).is_err());
    }

    /// However many blocks a batch makes, no warp sums more than MAX_SEQLEN keys: a
    /// cache of 2^29 or 2^30 positions is split so that every warp's share stays within
    /// it. Sizes that would overflow the block count are refused, never wrapped.
    #[test]
    fn long_caches_split_within_one_sums_reach() {
        let problem = |capacity, heads_q| DecodeProblem {
            cache: CacheShape {
                batch: 1,
                heads_kv: 1,
                head_dim: 32,
                capacity,
                page_size: 0,
                pool_pages: 0,
                fp8: false,
            },
            dtype: HalfType::F16,
            seqlen_q: 16,
            heads_q,
            scale: 0.1,
            causal: false,
            window: None,
            packed: None,
            softcap: None,
        };
        for capacity in [1 << 25, 1 << 27, 1 << 29, 1 << 30] {
            // 256 heads of 16 queries fill a wave without splits.
            let plan = plan_decode(&problem(capacity, 256), 132, 227 * 1024).unwrap();
            let per_warp = capacity.div_ceil(plan.splits * plan.config.warps as usize);
            assert!(per_warp <= MAX_SEQLEN, "{capacity}: {plan:?}");
        }
        assert_eq!(
            plan_decode(&problem(1 << 20, 256), 132, 227 * 1024)
                .unwrap()
                .splits,
            1
        );
        let mut huge = problem(1 << 20, 1 << 40);
        huge.cache.batch = 1 << 30;
        assert!(matches!(
            plan_decode(&huge, 132, 227 * 1024),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn head_dims_without_a_kernel_run_the_next_one_padded() {
        let q80 = q(2, 3, 8, 80, 4 * GB);
        for paged in [None, Some(16)] {
            let c = cache(2, 32768, 2, 80, paged);
            let p = check(&q80, &c).unwrap();
            let plan = plan_decode(&p, 132, 227 * 1024).unwrap();
            assert_eq!(
                (plan.config.head_dim, plan.config.padded),
                (96, true),
                "{paged:?}"
            );
            assert!(plan.config.id().ends_with("_padded"));
            assert!(plan.splits > 1);
            // The workspace holds rows of the kernel's 96 columns, then the LSEs.
            let rows = plan.splits * 2 * 3 * 8;
            assert_eq!(
                plan.workspace_bytes,
                (rows * 96 * 4).next_multiple_of(256) + rows * 4
            );
        }
        // Head dims of a kernel stay unpadded; an e4m3 cache takes only its own three.
        for d in [32, 64, 96, 128, 192, 256] {
            let p = check(&q(1, 1, 8, d, 4 * GB), &cache(1, 4096, 2, d, None)).unwrap();
            let cfg = plan_decode(&p, 132, 227 * 1024).unwrap().config;
            assert_eq!((cfg.head_dim, cfg.padded), (d as u32, false));
        }
        let e4m3 = fp8_cache(2, 64, 2, 80, None);
        assert!(matches!(
            decode_problem(&q(2, 1, 4, 80, 4 * GB), &e4m3, &AttentionParams::default()),
            Err(Error::UnsupportedHeadDim(80, _))
        ));
        // The merge: 80 on the padded 96 kernel, 136 on the 256 one.
        for (d, kernel) in [(80, 96), (136, 256), (8, 64), (248, 256)] {
            let parts = three_shards(DType::F32, d, d);
            let out = TensorView::bshd(3 * GB, DType::Bf16, 2, 5, 4, d);
            let cfg = validate_merge(&parts, &out, None).unwrap();
            assert_eq!((cfg.head_dim, cfg.padded), (kernel, true), "d{d}");
        }
        let parts = three_shards(DType::F32, 84, 88);
        let out = TensorView::bshd(3 * GB, DType::F32, 2, 5, 4, 84);
        assert!(matches!(
            validate_merge(&parts, &out, None),
            Err(Error::UnsupportedHeadDim(84, HEAD_DIMS_TEXT))
        ));
    }

    /// Random queries, caches (contiguous and paged, 16-bit and e4m3), new tokens and
    /// shards: shapes from edge values to 2^63, strides contiguous in either order or
    /// drawn (zero, misaligned, huge), pointers null, misaligned or at the end of the
    /// address space, every dtype, odd softmax scales. Decode, append and merge
    /// validation and the decode plan answer each with a value or an error, never a
    /// panic; what they accept names a listed kernel at or above the tensors' head dim.
    #[test]
    fn validation_of_random_inputs_never_panics() {
        let decode_kernels = decode::all_decode_configs();
        let merge_kernels = crate::kernels::attention::merge::all_merge_configs();
        let mut r = Draw::new(0xF1A5_C0DE);
        let (mut decodes, mut plans, mut appends, mut merges) = (0, 0, 0, 0);
        for i in 0..20_000 {
            r.start(i % 2 == 0);
            let (b, hkv, d) = (r.size(), r.size(), r.head_dim());
            let dtype = r.dtype();
            let sq = r.pick(&[0, 1, 2, 16, 17]);
            let hq = if r.chance(0.8) {
                hkv.saturating_mul(r.pick(&[1, 4, 8]))
            } else {
                r.size()
            };
            let cache_dtype = if r.chance(0.8) { dtype } else { r.dtype() };
            let paged = r.chance(0.5);
            let (outer, rows) = if paged {
                (r.size(), r.pick(&[0, 1, 16, 48, 64, 256, 2048]))
            } else {
                (b, r.size())
            };
            let shape = [outer, rows, hkv, d];
            let (k, v) = (r.view(cache_dtype, shape), r.view(cache_dtype, shape));
            let max_pages = r.size();
            let layout = if paged {
                CacheLayout::Paged {
                    block_table: r.ptr(),
                    max_pages,
                    table_stride: if r.chance(0.8) { max_pages } else { r.size() },
                }
            } else {
                CacheLayout::Contiguous
            };
            let scales = (cache_dtype == DType::E4m3 || r.chance(0.1)).then(|| {
                let one = [outer, rows, hkv, 1];
                KvScales {
                    k: r.view(DType::F32, one),
                    v: r.view(DType::F32, one),
                }
            });
            let cache = KvCache {
                k,
                v,
                seqlens: r.ptr(),
                layout,
                scales,
            };
            let q = r.view(dtype, [b, sq, hq, d]);
            let o = if r.chance(0.8) {
                TensorView { ptr: r.ptr(), ..q }
            } else {
                r.any_view([b, sq, hq, d])
            };
            let lse = r.chance(0.5).then(|| LseView { ptr: r.ptr() });
            let params = AttentionParams {
                softmax_scale: r.softmax_scale(),
                causal: r.chance(0.5),
                ..Default::default()
            };
            let new = [b, r.pick(&[0, 1, 3, 64, 1 << 20]), hkv, d];
            let k_new = r.any_view(new);
            let v_new = if r.chance(0.8) {
                TensorView {
                    ptr: r.ptr(),
                    ..k_new
                }
            } else {
                r.any_view(new)
            };
            let count = r.pick(&[0, 1, 3, 1 << 31]);
            let parts = MergeParts {
                o: r.any_view([b, sq.max(1), hq, d]),
                count,
                shard_stride: r.pick(&[
                    0,
                    3,
                    b.wrapping_mul(sq).wrapping_mul(hq).wrapping_mul(d),
                    1 << 40,
                ]),
                lse: r.ptr(),
            };
            let out = TensorView {
                ptr: r.ptr(),
                dtype: r.dtype(),
                ..parts.o
            };
            let (sms, smem) = (
                r.pick(&[0, 1, 108, 132]),
                r.pick(&[0, 48 << 10, 99 << 10, 227 << 10]),
            );

            let run = std::panic::catch_unwind(|| {
                let _ = decode_problem(&q, &cache, &params);
                let _ = decode_q_problem(&q, &cache);
                let mut counts = (0, 0, 0, 0);
                if let Ok(p) = validate_decode(&q, &cache, &o, lse.as_ref(), &params) {
                    counts.0 += 1;
                    if let Ok(plan) = plan_decode(&p, sms, smem) {
                        counts.1 += 1;
                        let cfg = plan.config;
                        assert!(decode_kernels.contains(&cfg), "{}", cfg.id());
                        assert!(
                            cfg.head_dim as usize >= d
                                && cfg.padded == (cfg.head_dim as usize != d)
                        );
                    }
                }
                if validate_append(&cache, &k_new, &v_new).is_ok() {
                    counts.2 += 1;
                }
                if let Ok(cfg) = validate_merge(&parts, &out, lse.as_ref()) {
                    counts.3 += 1;
                    assert!(merge_kernels.contains(&cfg), "{}", cfg.id());
                    assert!(
                        cfg.head_dim as usize >= d && cfg.padded == (cfg.head_dim as usize != d)
                    );
                }
                counts
            });
            match run {
                Ok(c) => {
                    decodes += c.0;
                    plans += c.1;
                    appends += c.2;
                    merges += c.3;
                }
                Err(_) => panic!(
                    "draw {i}: q {q:?}\ncache {cache:?}\no {o:?} lse {lse:?} {params:?}\n\
                     k_new {k_new:?}\nv_new {v_new:?}\nparts {parts:?}\nout {out:?}\n\
                     {sms} SMs, {smem} bytes"
                ),
            }
        }
        println!(
            "accepted: {decodes} decodes ({plans} planned), {appends} appends, {merges} merges"
        );
        // The draws reach every call's accepting end too.
        assert!(
            decodes > 50 && plans > 50 && appends > 50 && merges > 50,
            "{decodes} {plans} {appends} {merges}"
        );
    }

    /// Three shards' partial results of a `[2, 5, 4, d]` problem at `GB`, one shard every
    /// `2·5·4·span` elements, their LSEs at `2 GB`.
    fn three_shards(dtype: DType, d: usize, span: usize) -> MergeParts {
        MergeParts {
            o: TensorView::bshd(GB, dtype, 2, 5, 4, d),
            count: 3,
            shard_stride: 2 * 5 * 4 * span,
            lse: 2 * GB,
        }
    }

    #[test]
    fn merge_and_append_validation() {
        let parts = three_shards(DType::F16, 128, 128);
        let out = TensorView::bshd(3 * GB, DType::F32, 2, 5, 4, 128);
        let cfg = validate_merge(&parts, &out, None).unwrap();
        assert_eq!((cfg.input, cfg.output), (MergeType::F16, MergeType::F32));
        let into_parts = TensorView {
            ptr: GB + 4096,
            ..out
        };
        assert!(matches!(
            validate_merge(&parts, &into_parts, None),
            Err(Error::InvalidArgument(_))
        ));
        let none = MergeParts { count: 0, ..parts };
        assert!(matches!(
            validate_merge(&none, &out, None),
            Err(Error::EmptyDimension { .. })
        ));
        let odd = MergeParts {
            shard_stride: 3,
            ..parts
        };
        assert!(matches!(
            validate_merge(&odd, &out, None),
            Err(Error::BadStrides { .. })
        ));
        let shape = TensorView::bshd(3 * GB, DType::F32, 2, 6, 4, 128);
        assert!(matches!(
            validate_merge(&parts, &shape, None),
            Err(Error::ShapeMismatch(_))
        ));

        let c = cache(2, 64, 2, 64, Some(16));
        let new = TensorView::bshd(4 * GB, DType::F16, 2, 3, 2, 64);
        let vnew = TensorView { ptr: 5 * GB, ..new };
        assert_eq!(validate_append(&c, &new, &vnew).unwrap().new_tokens, 3);
        let wrong = TensorView::bshd(4 * GB, DType::F16, 2, 3, 4, 64);
        assert!(matches!(
            validate_append(
                &c,
                &wrong,
                &TensorView {
                    ptr: 5 * GB,
                    ..wrong
                }
            ),
            Err(Error::ShapeMismatch(_))
        ));
        let overlapping = TensorView { ptr: GB, ..new };
        assert!(matches!(
            validate_append(&c, &overlapping, &vnew),
            Err(Error::InvalidArgument(_))
        ));
    }

    /// An append writes the cache: what it writes must not alias itself, the other half
    /// of the cache, or the metadata it reads; K and V interleaved in one tensor (their
    /// elements apart) stay accepted.
    #[test]
    fn appends_refuse_caches_that_alias() {
        let new = TensorView::bshd(4 * GB, DType::F16, 2, 3, 2, 64);
        let vnew = TensorView { ptr: 5 * GB, ..new };
        let ok = cache(2, 64, 2, 64, None);
        assert!(validate_append(&ok, &new, &vnew).is_ok());
        let refused = |c: &KvCache| {
            assert!(
                matches!(
                    validate_append(c, &new, &vnew),
                    Err(Error::InvalidArgument(_) | Error::BadStrides { .. })
                ),
                "{c:?}"
            );
        };
        // V on K.
        refused(&KvCache { v: ok.k, ..ok });
        // Every position of a sequence at one address.
        let mut flat = ok;
        flat.k.strides[1] = 0;
        refused(&flat);
        // The lengths inside K.
        refused(&KvCache {
            seqlens: GB + 128,
            ..ok
        });
        // The block table inside V's pool.
        let paged = cache(2, 64, 2, 64, Some(16));
        let CacheLayout::Paged {
            max_pages,
            table_stride,
            ..
        } = paged.layout
        else {
            unreachable!()
        };
        refused(&KvCache {
            layout: CacheLayout::Paged {
                block_table: 2 * GB + 256,
                max_pages,
                table_stride,
            },
            ..paged
        });
        // Decode only reads: the same caches are fine there.
        let q1 = q(2, 1, 4, 64, 4 * GB);
        let o1 = q(2, 1, 4, 64, 5 * GB);
        let read = KvCache { v: ok.k, ..ok };
        assert!(validate_decode(&q1, &read, &o1, None, &AttentionParams::default()).is_ok());

        // K and V interleaved per sequence, `[B, 2, S, H, D]`: apart element by element.
        let (b, s, h, d) = (2usize, 64usize, 2usize, 64usize);
        let seq = 2 * s * h * d;
        let k = TensorView {
            strides: [seq, h * d, d, 1],
            ..TensorView::bshd(GB, DType::F16, b, s, h, d)
        };
        let v = TensorView {
            ptr: GB + (s * h * d * 2) as u64,
            ..k
        };
        let interleaved = KvCache { k, v, ..ok };
        assert!(validate_append(&interleaved, &new, &vnew).is_ok());
        // Shifted by one position instead, V's rows land on K's.
        let shifted = KvCache {
            v: TensorView {
                ptr: GB + (h * d * 2) as u64,
                ..k
            },
            ..interleaved
        };
        refused(&shifted);
        // K `[1, 2, heads, 32]` with padded position rows, V `v_at` elements on; the
        // append's new rows are elsewhere.
        let padded = |strides: [usize; 4], heads: usize, v_at: u64| {
            let k = TensorView {
                strides,
                ..TensorView::bshd(GB, DType::F16, 1, 2, heads, 32)
            };
            let v = TensorView {
                ptr: GB + 2 * v_at,
                ..k
            };
            let new = TensorView::bshd(4 * GB, DType::F16, 1, 1, heads, 32);
            let vnew = TensorView { ptr: 5 * GB, ..new };
            validate_append(&KvCache { k, v, ..ok }, &new, &vnew)
        };
        // Two heads in 96-element rows, V 64 on: one position on and one head back from
        // a K element is a V element. (The search once tried only forward steps.)
        assert!(
            padded([192, 96, 32, 1], 2, 64).is_err(),
            "K and V share elements"
        );
        // One head in 64-element rows, V in the padding: apart, accepted.
        assert!(padded([128, 64, 32, 1], 1, 32).is_ok());
    }

    /// The C header and the Python docstring state the append bound as a number.
    #[test]
    fn the_documented_append_bound_is_the_checked_one() {
        assert_eq!(MAX_APPEND_CHUNKS, 2_146_435_039);
        assert!(include_str!("../../include/flashcore.h").contains("<= 2146435039"));
        assert!(include_str!("../../python/flashcore/serving.py").contains("<= 2146435039"));
    }

    /// The append kernels count 16-byte chunks in 32 bits and step by the grid: an
    /// append so large that the last step would pass 2^31 is refused, not wrapped.
    #[test]
    fn appends_that_would_wrap_the_kernel_counter_are_refused() {
        let (d, big) = (256usize, 1usize << 27);
        let c = KvCache {
            k: TensorView::bshd(1 << 40, DType::F16, 1, big, 1, d),
            v: TensorView::bshd(1 << 41, DType::F16, 1, big, 1, d),
            ..cache(1, 64, 1, d, None)
        };
        // 32 chunks per token: the largest append that fits, and one token more.
        let fits = MAX_APPEND_CHUNKS / 32;
        for (tokens, ok) in [(fits, true), (fits + 1, false), (67_108_000, false)] {
            let new = TensorView::bshd(1 << 42, DType::F16, 1, tokens, 1, d);
            let vnew = TensorView {
                ptr: 1 << 43,
                ..new
            };
            let r = validate_append(&c, &new, &vnew);
            assert_eq!(r.is_ok(), ok, "{tokens} tokens: {r:?}");
        }
        let stride = (APPEND_MAX_BLOCKS * APPEND_THREADS as usize) as u64;
        assert!(MAX_APPEND_CHUNKS as u64 + 32 + stride <= i32::MAX as u64);
    }

    /// Pools hold at most 2^31 − 1 pages, so `i32::MAX` (the Hopper producers' "no page")
    /// and every negative entry lie outside each pool accepted. A table of one row may
    /// carry any stride (an expanded `[1, n]` view's 0): only row 0 is read.
    #[test]
    fn pools_stop_below_the_no_page_entry_and_one_row_takes_any_stride() {
        let paged = |pages: usize, b: usize, stride: usize| KvCache {
            k: TensorView::bshd(GB, DType::F16, pages, 16, 2, 64),
            v: TensorView::bshd(1 << 50, DType::F16, pages, 16, 2, 64),
            layout: CacheLayout::Paged {
                block_table: 3 * GB,
                max_pages: 4,
                table_stride: stride,
            },
            ..cache(b, 64, 2, 64, Some(16))
        };
        assert!(paged(MAX_POOL_PAGES, 2, 4).validate(2).is_ok());
        assert!(MAX_POOL_PAGES <= i32::MAX as usize);
        let e = paged(MAX_POOL_PAGES + 1, 2, 4).validate(2);
        assert!(
            matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("2^31 - 1")),
            "{e:?}"
        );
        for stride in [0, 1, 3] {
            assert!(paged(8, 1, stride).validate(1).is_ok(), "{stride}");
            assert!(matches!(
                paged(8, 2, stride).validate(2),
                Err(Error::BadStrides {
                    tensor: "block_table",
                    ..
                })
            ));
        }
    }

    /// Metadata pointers whose extents pass the end of the address space are refused
    /// with a typed error (they used to overflow, a panic in debug builds).
    #[test]
    fn metadata_past_the_address_space_is_refused() {
        let q1 = q(2, 1, 4, 64, 4 * GB);
        let o1 = q(2, 1, 4, 64, 5 * GB);
        let params = AttentionParams::default();
        let high = KvCache {
            seqlens: u64::MAX - 3,
            ..cache(2, 64, 2, 64, None)
        };
        assert!(matches!(
            validate_decode(&q1, &high, &o1, None, &params),
            Err(Error::BadStrides {
                tensor: "seqlens",
                ..
            })
        ));
        for stride in [1usize << 62, usize::MAX / 2] {
            let c = KvCache {
                layout: CacheLayout::Paged {
                    block_table: 3 * GB,
                    max_pages: 4,
                    table_stride: stride,
                },
                ..cache(2, 64, 2, 64, Some(16))
            };
            assert!(matches!(
                validate_decode(&q1, &c, &o1, None, &params),
                Err(Error::BadStrides {
                    tensor: "block_table",
                    ..
                })
            ));
            let host = HostMetadata {
                seqlens: &[1, 1],
                block_table: Some(&[0; 8]),
            };
            let shape = CacheShape {
                batch: 2,
                ..decode_problem(&q1, &cache(2, 64, 2, 64, Some(16)), &params)
                    .unwrap()
                    .cache
            };
            assert!(host.check(&c, &shape, 0).is_err());
        }
        // More query heads than a grid dimension holds: refused before any product.
        let wide = TensorView {
            strides: [0, 0, 0, 1],
            ..q(1, 16, 1 << 60, 64, 4 * GB)
        };
        assert!(matches!(
            decode_problem(&wide, &cache(1, 64, 1, 64, None), &params),
            Err(Error::InvalidArgument(_))
        ));
    }
}
