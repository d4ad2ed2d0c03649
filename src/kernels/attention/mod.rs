//! Attention forward kernels: configurations, the argument block shared with the host,
//! and the generators.

pub mod append;
pub mod decode;
pub mod epilogue;
pub mod fp8;
pub mod mask;
pub mod merge;
pub mod rows;
pub mod sequence;
pub mod sm80;
pub mod sm89_fp8;
pub mod sm90;
pub mod sm90_fp8;
pub mod softcap;
pub mod softmax;

use crate::ptx::{FastDivisor, Module, PtxError};
pub use sequence::CacheReads;

/// The 16-bit element type of Q, K, V and O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HalfType {
    F16,
    Bf16,
}

impl HalfType {
    pub fn name(self) -> &'static str {
        match self {
            HalfType::F16 => "f16",
            HalfType::Bf16 => "bf16",
        }
    }
}

/// Which generator family a configuration uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Path {
    /// FlashAttention-2 style: `mma.sync` + `cp.async`, `.target sm_80`; runs on sm_80..sm_90.
    Sm80,
    /// FlashAttention-3 style: warp-specialized TMA + wgmma, `.target sm_90a`; Hopper only.
    Sm90,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::Sm80 => "sm80",
            Path::Sm90 => "sm90a",
        }
    }
}

/// Head dimensions the forward kernels are generated for.
pub const FWD_HEAD_DIMS: [u32; 6] = [32, 64, 96, 128, 192, 256];

/// One forward-kernel configuration: everything that changes the generated code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FwdConfig {
    pub path: Path,
    pub dtype: HalfType,
    pub head_dim: u32,
    pub causal: bool,
    /// A causal kernel that also hides the keys before each row's window
    /// ([`FwdArgs::window_left`]) and moves the diagonal by [`FwdArgs::window_right`]:
    /// each work item starts at the first key tile its rows' windows reach, and masks
    /// every tile. Never with split keys.
    pub window: bool,
    /// Soft-capped scores ([`softcap`]): each `q·k` becomes `tanh(q·k · pre)`
    /// ([`FwdArgs::softcap_pre`]) before the mask, the softmax taking the cap as its
    /// scale. Never with split keys or 192-row tiles; folded on the sm90 path.
    pub softcap: bool,
    /// Query rows per block: [`BLOCK_M_WIDE`] normally, [`BLOCK_M_NARROW`] when the wide
    /// tiles would leave SMs idle (few heads, short sequences).
    pub block_m: u32,
    /// sm90 path, 64-row tiles: two consumer warpgroups share the block's query rows and
    /// take alternate key tiles, merging their partial results at the end (for grids
    /// too small to fill the GPU, where a block's chain of key tiles sets the time; see
    /// [`sm90::has_split`]).
    pub split_keys: bool,
    /// sm90 path without split keys: the scale folded into the softmax's exponent, one
    /// FMA per score (`exp2(s·c − m')`, `c = scale·log2 e`, the running maximum kept in
    /// log2 units, `m' = max(s)·c`) where the unfolded form takes two (`exp2((s − m)·c)`).
    /// Only where `s·c` stays finite for every score the dtype can give
    /// ([`scale_folds`]); the dispatch takes the unfolded kernel otherwise.
    pub fold_scale: bool,
    /// The tensors' head dim is a multiple of 8 below `head_dim` (say 80 on the 96
    /// kernel). Columns past it are zero-filled in shared memory, where they add nothing
    /// to `Q·Kᵀ` and make O's extra columns 0, which are not stored. sm80 path: the head
    /// dim is the kernel's second parameter and the loads and stores check it (see
    /// [`padded_head_dim`]); sm90 path: the tensor maps carry it, and the kernel moves a
    /// tile one 64-column box at a time ([`sm90::MapColumns::PerBlock`]; see
    /// [`sm90::padded_head_dim`]).
    pub padded: bool,
    /// sm90 path, head dim 256 with two consumer warpgroups: key tiles of 64 rather than
    /// 80 ([`sm90::has_narrow_keys`]). For short key ranges, where the causal diagonal's
    /// masked scores weigh most: 64-key tiles line up with the warpgroups' 64 rows, so
    /// the first warpgroup passes a whole tile of each item by.
    pub narrow_keys: bool,
}

/// The kernel head dims with a padded variant ([`FwdConfig::padded`]): every one but 32,
/// whose padded kernel moved registers about more than the assembly checks allow (8, 16
/// and 24 take the 64 kernel instead).
pub const PADDED_HEAD_DIMS: [u32; 5] = [64, 96, 128, 192, 256];

/// The kernel head dim that serves a tensor head dim of `d`, and whether it is padded
/// ([`FwdConfig::padded`]): `d` itself where a kernel has it ([`FWD_HEAD_DIMS`]), else the
/// smallest larger one of [`PADDED_HEAD_DIMS`] for a multiple of 8 up to 256 (8 to 56 on
/// the 64 kernel, 80 on 96, 160 on 192, ...). `None` for anything else: the columns are
/// loaded 16 bytes at a time, so a head dim that is not a multiple of 8 would share a
/// load with what follows it.
pub fn padded_head_dim(d: usize) -> Option<(u32, bool)> {
    serving_head_dim(d, &FWD_HEAD_DIMS, &PADDED_HEAD_DIMS)
}

/// The kernel head dim that serves a tensor head dim of `d` among kernels of head dims
/// `own`, with padded variants at `padded`, and whether it runs padded: `d` itself where
/// `own` has it, else the smallest of `padded` above it for a multiple of 8. `None` for
/// anything else (past the largest of `padded`, or not a multiple of 8: the columns move
/// 16 bytes at a time, so such a head dim would share a load with what follows it).
pub fn serving_head_dim(d: usize, own: &[u32], padded: &[u32]) -> Option<(u32, bool)> {
    let d = u32::try_from(d).ok()?;
    if own.contains(&d) {
        return Some((d, false));
    }
    if d == 0 || !d.is_multiple_of(8) {
        return None;
    }
    padded.iter().find(|&&k| k > d).map(|&k| (k, true))
}

/// Whether the folded exponent ([`FwdConfig::fold_scale`]) is as safe as the unfolded
/// one for `dtype` scores of `head_dim` products at softmax scale `scale`: whether `s·c`
/// (`c = scale·log2 e`) is finite for every finite score `s`. Always where `c ≤ 1` (every
/// usual scale: `1/√d` is at most 0.18); beyond, only for f16, whose scores are at most
/// `head_dim · 65504²` (doubled here for the f32 sums' rounding). A bf16 score may be
/// any finite f32, so a scale of 1 (`c` = 1.44) keeps bf16 unfolded; the unfolded
/// `(s − m)·c` is finite for every finite score and positive scale.
pub fn scale_folds(dtype: HalfType, head_dim: u32, scale: f32) -> bool {
    let c = scale as f64 * std::f64::consts::LOG2_E;
    let largest_score = match dtype {
        HalfType::F16 => 2.0 * head_dim as f64 * 65504f64 * 65504f64,
        HalfType::Bf16 => f64::INFINITY,
    };
    scale > 0.0 && (c <= 1.0 || c * largest_score <= f32::MAX as f64)
}

/// The largest key-window side a kernel argument carries; a side at it (or without a
/// bound) reaches every key of any sequence the kernels accept (2^30 keys at most, the
/// 2^25 of a dense forward call, a cache's capacity), and `position ± side` stays inside
/// 32 bits.
pub const WINDOW_UNBOUNDED: u32 = 1 << 30;

/// The default query tile: more work per K/V tile loaded.
pub const BLOCK_M_WIDE: u32 = 128;
/// The small-grid query tile: twice the blocks for the same problem.
pub const BLOCK_M_NARROW: u32 = 64;

impl FwdConfig {
    /// An sm80-path configuration (that path has no split keys and no folded scale).
    pub fn sm80(dtype: HalfType, head_dim: u32, causal: bool, block_m: u32, padded: bool) -> Self {
        FwdConfig {
            path: Path::Sm80,
            dtype,
            head_dim,
            causal,
            window: false,
            softcap: false,
            block_m,
            split_keys: false,
            fold_scale: false,
            padded,
            narrow_keys: false,
        }
    }

    /// The soft-capping kernel of this configuration ([`FwdConfig::softcap`]): split keys
    /// give way to a single warpgroup's tile and 192-row tiles to 128-row ones (as for
    /// [`FwdConfig::windowed`]), and the sm90 path folds the scale, which a capped score
    /// (at most 1 in magnitude) always allows.
    pub fn softcapped(self) -> Self {
        FwdConfig {
            softcap: true,
            split_keys: false,
            block_m: self.block_m.min(BLOCK_M_WIDE),
            fold_scale: self.path == Path::Sm90,
            ..self
        }
    }

    /// Whether this windowed kernel leaves the key tiles inside every row's window
    /// unmasked, masking only those that cut a window (the diagonal's and the window's
    /// left edge's) in loops of their own; otherwise it masks every tile in one loop.
    /// The third loop costs registers: the sm90 path's head-dim-256 kernels with
    /// 80-key tiles spilled 100–108 bytes with it, and three of the sm80 path's (head
    /// dim 32 on 64 rows and padded 64 on 64 rows re-paired their fragments past the
    /// move budget, padded 128 on 128 rows spilled 8 bytes), so those mask every tile.
    pub fn masks_window_edges_only(&self) -> bool {
        let tight = match self.path {
            Path::Sm90 => self.head_dim == 256 && self.block_m == BLOCK_M_WIDE && !self.narrow_keys,
            Path::Sm80 => matches!(
                (self.head_dim, self.block_m, self.padded),
                (32, BLOCK_M_NARROW, _) | (64, BLOCK_M_NARROW, true) | (128, BLOCK_M_WIDE, true)
            ),
        };
        self.window && !tight
    }

    /// The windowed kernel of this configuration's path, dtype, head dim and tiles
    /// ([`FwdConfig::window`]); split keys give way to a single warpgroup's tile, and
    /// the sm90 path's 192-row tiles (three consumer warpgroups at 128 registers, which
    /// the window's mask spills) to 128-row ones.
    pub fn windowed(self) -> Self {
        FwdConfig {
            causal: true,
            window: true,
            split_keys: false,
            block_m: self.block_m.min(BLOCK_M_WIDE),
            ..self
        }
    }

    /// The kernel id: also the PTX entry name, e.g. `attn_fwd_sm80_f16_d128_m128_causal`,
    /// `attn_fwd_sm90a_bf16_d64_m64_splitkv`, `attn_fwd_sm90a_f16_d128_m128_fold_causal`,
    /// `attn_fwd_sm90a_f16_d256_m128_n64_fold_causal` (64-key tiles),
    /// `attn_fwd_sm90a_bf16_d256_m128_fold_softcap_window` (soft-capped, windowed).
    pub fn id(&self) -> String {
        format!(
            "attn_fwd_{}_{}_d{}_m{}{}{}{}{}{}{}",
            self.path.name(),
            self.dtype.name(),
            self.head_dim,
            self.block_m,
            if self.narrow_keys { "_n64" } else { "" },
            if self.split_keys { "_splitkv" } else { "" },
            if self.fold_scale { "_fold" } else { "" },
            if self.padded { "_padded" } else { "" },
            if self.softcap { "_softcap" } else { "" },
            match (self.causal, self.window) {
                (_, true) => "_window",
                (true, false) => "_causal",
                (false, false) => "",
            }
        )
    }

    id_static!(FwdConfig, all_fwd_configs, "attn_fwd_unknown");

    /// Whether the kernel reads each sequence's used keys ([`FwdArgs::seqused_k`]), and
    /// so serves calls over a KV cache: every one but the windowed kernels whose
    /// registers have no room for the read (it spills them): the sm80 path's, which read
    /// their sequence again on every key tile, and the sm90 path's head-dim-256 ones with
    /// 64-row tiles.
    pub fn reads_used_keys(&self) -> bool {
        !(self.window && (self.path == Path::Sm80 || (self.head_dim == 256 && self.block_m == 64)))
    }

    /// What the kernel reads of a cache: the used keys where [`FwdConfig::reads_used_keys`],
    /// and on the sm90 path also keys apart from packed queries (a serving batch's call,
    /// `Attention::decode_varlen`). The sm80 kernels with 128-row tiles at head dim 128
    /// spilled with that select, so the sm80 path leaves those calls to the decode
    /// kernels.
    pub fn cache_reads(&self) -> CacheReads {
        match (self.reads_used_keys(), self.path) {
            (false, _) => CacheReads::None,
            (true, Path::Sm80) => CacheReads::UsedKeys,
            (true, Path::Sm90) => CacheReads::UnderPackedQueries,
        }
    }

    /// Tile shape and launch geometry.
    pub fn tiling(&self) -> Tiling {
        match self.path {
            Path::Sm80 => sm80::tiling(self),
            Path::Sm90 => sm90::tiling(self),
        }
    }

    /// Generates the module (one entry, named [`FwdConfig::id`]); a configuration
    /// [`all_fwd_configs`] does not list is refused.
    pub fn generate(&self) -> Result<Module, PtxError> {
        crate::kernels::listed("forward", self, all_fwd_configs())?;
        match self.path {
            Path::Sm80 => sm80::generate(self),
            Path::Sm90 => sm90::generate(self),
        }
    }
}

/// Tile shape and launch geometry of a forward kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tiling {
    /// Query rows per block.
    pub block_m: u32,
    /// Key rows per inner-loop step.
    pub block_n: u32,
    /// Threads per block.
    pub threads: u32,
    /// Dynamic shared memory per block, bytes.
    pub smem_bytes: u32,
}

/// The masks a forward kernel is built for, as `(causal, window)`: none, causal, and a
/// key window (on the causal kernels).
const MASKS: [(bool, bool); 3] = [(false, false), (true, false), (true, true)];

/// Every forward configuration the dispatch can choose: the sm80 path's for every head
/// dimension and both query tiles, then the sm90 path's, then the soft-capping kernel of
/// each ([`FwdConfig::softcapped`]), once.
pub fn all_fwd_configs() -> Vec<FwdConfig> {
    let mut v = uncapped_fwd_configs();
    let mut capped: Vec<FwdConfig> = v.iter().map(|c| c.softcapped()).collect();
    capped.sort();
    capped.dedup();
    v.extend(capped);
    v
}

/// [`all_fwd_configs`] without the soft-capping kernels.
fn uncapped_fwd_configs() -> Vec<FwdConfig> {
    let mut v = Vec::new();
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for head_dim in FWD_HEAD_DIMS {
            for (causal, window) in MASKS {
                for block_m in [BLOCK_M_WIDE, BLOCK_M_NARROW] {
                    let paddings: &[bool] = if PADDED_HEAD_DIMS.contains(&head_dim) {
                        &[false, true]
                    } else {
                        &[false]
                    };
                    for &padded in paddings {
                        let cfg = FwdConfig::sm80(dtype, head_dim, causal, block_m, padded);
                        v.push(if window { cfg.windowed() } else { cfg });
                    }
                }
            }
        }
    }
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for head_dim in sm90::HEAD_DIMS {
            for (causal, window) in MASKS {
                for block_m in sm90::BLOCK_MS {
                    for split_keys in [false, true] {
                        if window && (split_keys || block_m > BLOCK_M_WIDE) {
                            continue;
                        }
                        let tile = if split_keys {
                            sm90::has_split(head_dim, block_m)
                        } else {
                            sm90::has_tile(head_dim, block_m)
                        };
                        if !tile {
                            continue;
                        }
                        // Split keys: unfolded only (the two warpgroups' hand-over merges
                        // raw maxima).
                        let folds: &[bool] = if split_keys { &[false] } else { &[true, false] };
                        // Padded: where the dispatch can pick them (no split keys, no
                        // 192-row tiles, which it keeps for head dim 64 itself).
                        let paddings: &[bool] = if sm90::has_padded(head_dim, block_m, split_keys) {
                            &[false, true]
                        } else {
                            &[false]
                        };
                        let narrow: &[bool] =
                            if sm90::has_narrow_keys(head_dim, block_m, split_keys) {
                                &[false, true]
                            } else {
                                &[false]
                            };
                        for &padded in paddings {
                            for &fold_scale in folds {
                                for &narrow_keys in narrow {
                                    v.push(FwdConfig {
                                        path: Path::Sm90,
                                        dtype,
                                        head_dim,
                                        causal,
                                        window,
                                        softcap: false,
                                        block_m,
                                        split_keys,
                                        fold_scale,
                                        padded,
                                        narrow_keys,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

/// The by-value argument block of every forward kernel (`.param .align 8 .b8 args[..]`).
/// Strides are in elements, for the logical dimensions (batch, sequence, head); the head
/// dimension is contiguous. `lse` may be 0 (no log-sum-exp output).
///
/// Packed (variable-length) batches set `cu_seqlens_q` and `cu_seqlens_k`: then Q, K, V
/// and O have batch extent 1, `seqlen_q`/`seqlen_k` are their row counts, `batch` the
/// number of sequences and `q_blocks` the query tiles of the longest one (see
/// [`sequence`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct FwdArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
    pub q_stride: [u64; 3],
    pub k_stride: [u64; 3],
    pub v_stride: [u64; 3],
    pub o_stride: [u64; 3],
    pub seqlen_q: u32,
    pub seqlen_k: u32,
    pub heads_q: u32,
    /// Query heads per key/value head (Hq / Hkv).
    pub group: u32,
    /// softmax_scale · log2(e): scores go through `exp2`.
    pub scale_log2: f32,
    /// softmax_scale itself (for the log-sum-exp).
    pub scale: f32,
    /// Query tiles per (batch, head) and the batch size: the persistent sm90 kernel's
    /// work items are `q_blocks · heads_q · batch`.
    pub q_blocks: u32,
    pub batch: u32,
    /// Device `i32 [batch + 1]` offsets of each sequence's first query row, or 0 (dense).
    pub cu_seqlens_q: u64,
    /// Device `i32 [batch + 1]` offsets of each sequence's first key row (when packed).
    pub cu_seqlens_k: u64,
    /// LSE elements between consecutive batch entries and heads: `[Hq·Sq, Sq]` for the
    /// dense `[B, Hq, Sq]` layout, `[0, total_q]` for the packed `[Hq, total_q]` one
    /// (whose rows add the sequence's first query row).
    pub lse_stride: [u64; 2],
    /// sm90 path: a zeroed device `u32` from which the blocks of a persistent launch take
    /// their next work item, or 0 for a fixed stride (`item + gridDim.x`).
    pub tile_counter: u64,
    /// sm90 path: how many of the last (head, batch) pairs give their work items out query
    /// tile by query tile across the pairs rather than pair by pair (0: none).
    pub tail_heads: u32,
    /// sm90 path: nonzero when the launch passes a tensor map of O (dense O whose layout
    /// TMA can describe): the epilogue stages O in shared memory and stores it by TMA.
    pub o_by_tma: u32,
    /// Windowed kernels ([`FwdConfig::window`]): query row `i` of a sequence, whose
    /// diagonal is key `d = i + Sk − Sq`, sees keys `d − window_left ..= d +
    /// window_right`; each at most [`WINDOW_UNBOUNDED`]. Other kernels ignore them.
    pub window_left: u32,
    pub window_right: u32,
    /// Soft-capping kernels ([`FwdConfig::softcap`]): `scale / cap`, the factor inside the
    /// `tanh` ([`softcap::ScoreScaling`]; `scale` and `scale_log2` then carry the cap).
    pub softcap_pre: f32,
    /// Zero: keeps the block a whole number of 8-byte words.
    pub pad: u32,
    /// Device `i32 [batch]`: the keys each sequence uses (FlashAttention-3's
    /// `seqused_k`, a KV cache's lengths), or 0 for all of its rows. Each is clamped to
    /// the sequence's rows; the rows past it, stale cache entries, are treated as a packed
    /// sequence's successors (see [`sequence`](sequence::sequence)).
    pub seqused_k: u64,
    /// sm90 path: device `i32 [batch, table_stride]` page indices of a paged KV cache
    /// (key `j` of sequence `b` is row `j mod 2^page_shift` of page `block_table[b][j >>
    /// page_shift]` of K's and V's maps, whose "batch" dimension is the pool's pages), or
    /// 0 for K and V as tensors. With a table, [`FwdArgs::seqused_k`] holds the lengths
    /// and `seqlen_k` the capacity, `max_pages · 2^page_shift`.
    pub block_table: u64,
    pub table_stride: u32,
    pub page_shift: u32,
    /// Entries of a sequence's row of the block table.
    pub max_pages: u32,
    /// Packed queries over a cache, split by run length between two launches
    /// (`Attention::decode_varlen`): a sequence with fewer queries is the decode kernels',
    /// and has none here. 0 otherwise.
    pub min_queries: u32,
    /// sm90 path: the divisors a work item's decoding divides by, as multiplies and
    /// shifts ([`FastDivisor`]; [`FwdArgs::set_divisors`]): `q_blocks`, `heads_q`,
    /// `group` and `max(tail_heads, 1)`.
    pub q_blocks_div: FastDivisor,
    pub heads_div: FastDivisor,
    pub group_div: FastDivisor,
    pub tail_div: FastDivisor,
}

impl FwdArgs {
    pub const SIZE: usize = std::mem::size_of::<FwdArgs>();

    /// Sets the [`FastDivisor`]s of `q_blocks`, `heads_q`, `group` and `tail_heads` (once
    /// those are final, before an sm90 launch).
    pub fn set_divisors(&mut self) {
        self.q_blocks_div = FastDivisor::new(self.q_blocks);
        self.heads_div = FastDivisor::new(self.heads_q);
        self.group_div = FastDivisor::new(self.group);
        self.tail_div = FastDivisor::new(self.tail_heads.max(1));
    }
}

impl AsMut<FwdArgs> for FwdArgs {
    fn as_mut(&mut self) -> &mut FwdArgs {
        self
    }
}
