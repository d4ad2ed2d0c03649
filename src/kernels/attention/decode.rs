//! Split-KV decode: a few query tokens per sequence against a long KV cache
//! (`.target sm_80`, so the same module runs on Ampere, Ada and Hopper).
//!
//! Decode reads every cached key and value once per step and does little arithmetic on
//! them, so the kernel is built to keep the memory system busy:
//!
//! - **GQA packing**: the `Sq · group` query rows that share one KV head form one 16-row
//!   MMA tile (row `qi · group + g` is query `qi` of head `kv_head · group + g`), so each
//!   K/V byte is read once per step, not once per query head.
//! - **Split-KV**: the grid is `(splits, kv_heads · row_chunks, batch)`; block `split`
//!   takes the sequence's tiles `split`, `split + splits`, `split + 2·splits`, ... Where
//!   a block's tiles lie does not depend on the length, so its first tile is issued
//!   while the length is still being read (bounded by the capacity, and cut to the
//!   length once it is known). `splits` comes from the capacities and the SM count,
//!   never from the lengths, so one captured CUDA graph stays valid as the caches grow.
//!   It aims at
//!   [`DecodeConfig::blocks_per_sm`] blocks per SM: for a 16-bit cache just enough to
//!   keep 64 KiB of reads in flight (one block of head dim 128), since every extra
//!   split costs a ring fill, an epilogue and a partial result to merge.
//! - **A ring of `stages` K/V tiles** filled by `cp.async`, `stages − 1` in flight while
//!   the warps work on the oldest.
//! - **Warps split the keys**: the 4 warps take 16 keys each of every 64-key tile, each
//!   keeping its own online softmax over the same 16 rows; the block merges the four by
//!   their maxima at the end.
//!
//! ```text
//! issue the length's load, (paged: the fill's table entries, then wait for them) Q,
//!     tile 0; issue tiles 1 .. stages−2 (once the length is in)
//! for t in 0..tiles:
//!     wait tile t; issue tile t + stages − 1 (into the slot tile t − 1 used)
//!     S = Q K[t, warp]^T; mask; online softmax; O += P V[t, warp]
//! merge the warps' (m, l, O); write O and the LSE (one split) or the split's partial
//! result (several; the merge kernel combines them)
//! ```
//!
//! The cache is contiguous `[B, capacity, Hkv, D]` or paged: a pool `[pages, page_size,
//! Hkv, D]` and a block table `[B, max_pages]` of page indices. The table entries travel
//! through shared memory a ring ahead of the copies that use them (`TableRing`), so the
//! copies never wait on the table.
//!
//! **FP8 caches** (`.target sm_89`): the ring holds e4m3 codes and their per-(position,
//! head) scales, half the bytes of a 16-bit ring. Each warp widens its own 16 keys of K
//! and V into a 16-bit tile (`cvt` from e4m3 is exact), so the MMAs and the softmax are
//! the 16-bit kernel's. The scales are applied in f32 where they cost least: K's to the
//! scores' columns (`S = (Q·codesᵀ)·scale`), V's to the probabilities, relative to the
//! largest V scale the warp has met so far, `u`, so that `P·(scale/u)` stays in
//! `[0, 1]` and keeps the 16-bit precision of `P`; the output is carried in units of `u`
//! (rescaled with the softmax's own factor when `u` grows) and multiplied by it at the
//! end. Keys a block table entry
//! outside the pool would name are never read (zero-filled instead); lengths are clamped
//! to the capacity. Queries sit at the end of their sequence: query `qi` of `Sq` is
//! position `len − Sq + qi`, and with causal masking sees keys up to that position.
//!
//! **Packed batches** ([`DecodeConfig::packed`]): a variable-length forward call's
//! sequences, one after another in `[1, total, H, D]` tensors, with at most
//! [`MAX_QUERIES`] queries each. Block `(.., b)` reads sequence `b`'s query and key
//! offsets first: its queries are rows `cu_q[b] ..` of Q and O (`n_b` of them, fewer than
//! `Sq` where the sequence is short, bottom-right aligned against its own keys), its keys
//! rows `cu_k[b] .. cu_k[b + 1]` of K and V, which stand in for the cache's capacity, so
//! the first tile waits for them. Offsets are clamped to the tensors. A block whose row
//! chunk holds none of the sequence's `n_b · group` rows returns at once; the partial
//! results keep the dense `[splits, B, Sq, Hq, D]` layout, whose rows past `n_b` the
//! packed merge skips.
//!
//! **Packed queries over a cache**: the contiguous and paged kernels take their queries
//! packed the same way when `cu_seqlens_q` is non-null (a serving batch mixing decode
//! steps and prompt chunks in one `[1, total_q, Hq, D]` tensor), their keys still the
//! cache's. Each block then reads its sequence's query offsets where it places Q and
//! again where it stores O, rather than keeping them live through the key loop.

use std::marker::PhantomData;
use std::mem::offset_of;

use super::rows::{Rows, Slab, half_of, zeroed_slabs};
use super::sequence::clamped_offsets;
use super::sm80::{LaneRoles, frag_addresses};
use super::softcap::cap_scores;
use super::softmax::{OnlineSoftmax, pack_probs, rescale_rows};
use super::{FWD_HEAD_DIMS, HalfType, PADDED_HEAD_DIMS, WINDOW_UNBOUNDED, padded_head_dim};
use crate::ptx::{
    B32, Bf16x2, Cmp, F16x2, F32, Half2, Kernel, KernelText, Module, Param, ParamBytes, Pred,
    PtxError, PtxType, RawSlot, Reg, S32, Smem, SmemAddr, SmemLayout, SmemPlan, Special, Swizzle,
    Target, TileSlot, U32, U64,
};

/// Packed query rows per block (one MMA tile).
pub const ROWS: u32 = 16;
/// The most query tokens per sequence a decode call takes.
pub const MAX_QUERIES: usize = 16;
/// Keys each warp takes per stage: a stage holds `16 · warps` keys.
const WARP_KEYS: u32 = 16;
/// The most blocks per SM a decode kernel is built for: three blocks of 128 threads
/// leave each thread 168 registers, which the e4m3-cache kernels need.
pub const MAX_RESIDENT: u32 = 3;
/// Bytes of cache reads a 16-bit decode keeps in flight per SM. An H200 streams about
/// 33 GB/s per SM (4.4 TB/s over 132) at roughly 2 µs of loaded latency; 64 KiB covers
/// that, and blocks beyond it only add splits (ring fills, epilogues, partial results
/// to merge) without reading faster: one block per SM of the 3-stage head-dim-128 ring
/// measured 8–12% faster than two at batch 1 and 6% at batch 16 (same run).
const IN_FLIGHT_PER_SM: u32 = 64 * 1024;

/// Head dimensions the decode kernels are generated for: those of the forward.
pub const HEAD_DIMS: [u32; 6] = FWD_HEAD_DIMS;

/// One decode-kernel configuration: everything that changes the generated code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DecodeConfig {
    pub dtype: HalfType,
    pub head_dim: u32,
    /// Paged cache (block table) rather than contiguous.
    pub paged: bool,
    /// K/V tiles in the ring (2 to 9; see [`DecodeConfig::preferred_stages`]).
    pub stages: u32,
    /// Warps per block (4, or 2 where shared memory is short): each takes 16 keys of
    /// every stage.
    pub warps: u32,
    /// The cache holds e4m3 codes with per-(position, head) scales.
    pub fp8: bool,
    /// The cache's head dim is a multiple of 8 below `head_dim` (80 on the 96 kernel;
    /// see [`kernel_head_dim`]), the kernel's second parameter. The copies zero-fill the
    /// columns past it in shared memory, where they add nothing to `Q·Kᵀ` and give O
    /// zero columns, which a single split does not store (several write them to the
    /// workspace, whose merge reads only the cache's columns). 16-bit caches only.
    pub padded: bool,
    /// Packed sequences of a variable-length forward call (see the module docs): query
    /// and key rows found through the cumulative offsets `cu_seqlens_q`/`cu_seqlens_k`.
    /// Contiguous 16-bit K/V only.
    pub packed: bool,
    /// Packed queries over a cache (a serving batch's, see the module docs): query rows
    /// found through `cu_seqlens_q`, keys in the contiguous or paged cache.
    pub packed_queries: bool,
}

/// The decode kernel head dim that serves a cache of head dim `d`, and whether it runs
/// padded ([`DecodeConfig::padded`]): a 16-bit cache's as the forward's
/// ([`padded_head_dim`]: every multiple of 8 up to 256, 80 on the 96 kernel); an e4m3
/// cache's only [`FP8_HEAD_DIMS`], unpadded.
pub fn kernel_head_dim(d: usize, fp8: bool) -> Option<(u32, bool)> {
    if fp8 {
        let d = u32::try_from(d).ok()?;
        return FP8_HEAD_DIMS.contains(&d).then_some((d, false));
    }
    padded_head_dim(d)
}

impl DecodeConfig {
    /// The ring depth a head dim gets when shared memory allows. A 16-bit cache keeps at
    /// least 64 KiB of reads in flight per block (`stages − 1` stages of K and V), which
    /// one block per SM needs to stream at the memory's rate: head dim 32 nine stages of
    /// 8 KiB, 64 five of 16 KiB, 96 four of 24 (72 KiB), 128 three of 32, 192 three of 48
    /// (96 KiB), 256 two of 64. With fewer, a step whose blocks are one per SM (B16, B64)
    /// was bound by the bytes in flight. On an H100, Hq32 Hkv8, same call, two rounds
    /// each, µs:
    ///
    /// | head dim, stages | B16 Skv 8192 | B64 Skv 4096 | B1 Skv 32768 |
    /// |---|---|---|---|
    /// | 32: 9 / 4 | 55.2–55.3 / 60.9–61.4 | 120.5–120.6 / 133.5–134.3 | 19.4–19.6 / 20.5–20.8 |
    /// | 64: 5 / 4 (6) | 90.8–91.0 / 99.6–100.1 (92.5–92.7) | 183.5–183.8 / 189.9 (185.5–185.6) | 28.6–28.8 / 30.1 (29.0–29.1) |
    /// | 96: 4 / 3 | 147.6–147.7 / 151.3–151.4 | 292.8–293.0 / 299.8–300.0 | 42.0–42.2 / 43.9–44.1 |
    /// | 192: 3 / 2 | 269.3–269.6 / 273.7 | 530.0–530.1 / 534.7–534.8 | 73.3–73.5 / 74.9–75.2 |
    ///
    /// (80 on the 96 kernel: B16 130.4 against 145.5.) A paged cache at head dim 128
    /// takes a stage more: with small pages each tile's copies wait on their block-table
    /// entries, and 96 KiB in flight hides that (on the H200, page 16 at B1 Skv 32768:
    /// 40.0–40.2 µs against 40.9–41.8 with three stages, 39.0–39.7 contiguous; B64 Skv
    /// 4096 1% slower). e4m3 codes: a stage is half the bytes, and the ring is kept short
    /// so that three blocks (head dim 128) share an SM: widening the codes lengthens each
    /// tile's chain of dependent steps, which more warps per SM hide.
    pub fn preferred_stages(head_dim: u32, paged: bool, fp8: bool) -> u32 {
        match (head_dim, fp8) {
            (0..=32, false) => 9,
            (33..=64, false) => 5,
            (65..=96, false) => 4,
            (97..=128, false) if paged => 4,
            (97..=192, false) => 3,
            (_, false) => 2,
            (0..=64, true) => 4,
            (65..=128, true) => 3,
            (_, true) => 2,
        }
    }

    /// The ring shapes to try, best first, on a GPU whose blocks may use `smem_optin`
    /// bytes: the preferred ring, two stages, two stages of half the keys.
    pub fn candidates(
        dtype: HalfType,
        (head_dim, padded): (u32, bool),
        layout: DecodeLayout,
        fp8: bool,
    ) -> [DecodeConfig; 3] {
        let paged = matches!(layout, DecodeLayout::Paged | DecodeLayout::PackedOverPaged);
        let cfg = |stages, warps| DecodeConfig {
            dtype,
            head_dim,
            paged,
            stages,
            warps,
            fp8,
            padded,
            packed: layout == DecodeLayout::Packed,
            packed_queries: matches!(
                layout,
                DecodeLayout::PackedOverContiguous | DecodeLayout::PackedOverPaged
            ),
        };
        [
            cfg(Self::preferred_stages(head_dim, paged, fp8), 4),
            cfg(2, 4),
            cfg(2, 2),
        ]
    }

    id_static!(DecodeConfig, all_decode_configs, "attn_decode_unknown");

    /// The kernel id, also its PTX entry name: `attn_decode_f16_d128_s3w4_paged`,
    /// `attn_decode_bf16_kv_e4m3_d128_s4w4` (an e4m3 cache, bf16 queries),
    /// `attn_decode_f16_d96_s3w4_padded`.
    pub fn id(&self) -> String {
        format!(
            "attn_decode_{}{}_d{}_s{}w{}{}{}{}{}",
            self.dtype.name(),
            if self.fp8 { "_kv_e4m3" } else { "" },
            self.head_dim,
            self.stages,
            self.warps,
            if self.paged { "_paged" } else { "" },
            if self.packed { "_packed" } else { "" },
            if self.packed_queries { "_pq" } else { "" },
            if self.padded { "_padded" } else { "" }
        )
    }

    /// Queries packed in `[1, total_q, Hq, D]` ([`DecodeConfig::packed`] or
    /// [`DecodeConfig::packed_queries`]) rather than `[B, Sq, Hq, D]`.
    pub fn queries_packed(&self) -> bool {
        self.packed || self.packed_queries
    }

    pub fn threads(&self) -> u32 {
        self.warps * 32
    }

    /// Keys per ring stage.
    pub fn block_n(&self) -> u32 {
        self.warps * WARP_KEYS
    }

    /// Bytes of the cross-warp statistics (max and sum of each warp's 16 rows).
    fn stats_bytes(&self) -> u32 {
        self.warps * ROWS * 8
    }

    /// Bytes from one row of a warp's O to the next in the merge scratch: the row's
    /// floats and 16 bytes more. Unpadded, the rows (a multiple of 128 bytes apart) all
    /// start in the same bank: the fragment stores conflicted 8 ways and the float4
    /// loads 16 ways, and the merge took about 3900 cycles (2 µs at the end of every
    /// block) where padded it takes a fraction of that.
    fn merge_row_bytes(&self) -> u32 {
        self.head_dim * 4 + 16
    }

    /// Bytes of the merge scratch: the statistics, then each warp's O.
    #[cfg(test)]
    fn scratch_bytes(&self) -> u32 {
        self.stats_bytes() + self.warps * ROWS * self.merge_row_bytes()
    }

    fn q_layout(&self) -> SmemLayout {
        SmemLayout::new(ROWS, self.head_dim, 2, Swizzle::B128)
    }

    fn kv_layout(&self) -> SmemLayout {
        SmemLayout::new(self.block_n(), self.head_dim, 2, Swizzle::B128)
    }

    /// A stage of e4m3 codes: dense rows of `D` bytes (the warps read them as 16-byte
    /// chunks in order, which no swizzle would improve).
    fn code_layout(&self) -> SmemLayout {
        SmemLayout::new(self.block_n(), self.head_dim, 1, Swizzle::None)
    }

    fn plan(&self) -> (SmemPlan, Slots) {
        let mut plan = SmemPlan::new();
        let q = plan.tile(self.q_layout(), 1);
        let (k, v, codes) = if self.fp8 {
            let code_k = plan.tile(self.code_layout(), self.stages);
            let code_v = plan.tile(self.code_layout(), self.stages);
            // One 16-bit tile for K and then V: each warp widens its keys of K, computes
            // the scores, then widens V into the same rows.
            let k = plan.tile(self.kv_layout(), 1);
            let scales = plan.raw(self.stages * self.scale_stage_bytes(), 16);
            let codes = Codes {
                k: code_k,
                v: code_v,
                scales,
            };
            (k, k, Some(codes))
        } else {
            let k = plan.tile(self.kv_layout(), self.stages);
            let v = plan.tile(self.kv_layout(), self.stages);
            (k, v, None)
        };
        let table = self
            .paged
            .then(|| plan.raw((2 * self.stages - 1) * self.table_stage_bytes(), 16));
        (
            plan,
            Slots {
                q,
                k,
                v,
                codes,
                table,
            },
        )
    }

    /// Bytes of one stage's scales: K's `block_n` floats, then V's.
    fn scale_stage_bytes(&self) -> u32 {
        self.block_n() * 8
    }

    /// Bytes of one stage's block-table entries: one per key at most (pages of one token).
    fn table_stage_bytes(&self) -> u32 {
        self.block_n() * 4
    }

    /// Dynamic shared memory per block, bytes.
    pub fn smem_bytes(&self) -> u32 {
        self.plan().0.bytes()
    }

    /// Blocks per SM a decode launch aims for (the split count follows from it): a
    /// 16-bit ring, enough blocks to keep `IN_FLIGHT_PER_SM` bytes of reads in
    /// flight; an e4m3 ring, every block that fits: widening the codes lengthens each
    /// tile's chain of dependent steps, which more warps per SM hide.
    pub fn blocks_per_sm(&self) -> u32 {
        if self.fp8 {
            return self.resident_blocks();
        }
        let in_flight = (self.stages - 1) * 2 * self.kv_layout().bytes();
        IN_FLIGHT_PER_SM
            .div_ceil(in_flight)
            .clamp(1, self.resident_blocks())
    }

    /// Blocks of this kernel an sm_90 SM holds (228 KiB of shared memory, 1 KiB of it
    /// reserved per block), at most [`MAX_RESIDENT`]. The kernel is built for that many
    /// (`.minnctapersm`), so ptxas keeps its registers within what they leave each
    /// thread and registers never cut the residency the split count assumes.
    pub fn resident_blocks(&self) -> u32 {
        const SM90_SMEM_PER_SM: u32 = 228 * 1024;
        (SM90_SMEM_PER_SM / (self.smem_bytes() + 1024)).clamp(1, MAX_RESIDENT)
    }

    /// Generates the module; a configuration [`all_decode_configs`] does not list is
    /// refused.
    pub fn generate(&self) -> Result<Module, PtxError> {
        crate::kernels::listed("decode", self, all_decode_configs())?;
        let kernel = match self.dtype {
            HalfType::F16 => build::<F16x2>(self)?,
            HalfType::Bf16 => build::<Bf16x2>(self)?,
        };
        let mut module = Module::new(if self.fp8 { Target::Sm89 } else { Target::Sm80 });
        module.push(kernel)?;
        Ok(module)
    }
}

/// Head dims of the e4m3-cache kernels (those of the FP8 forward).
pub const FP8_HEAD_DIMS: [u32; 3] = [64, 128, 256];

/// Where a decode kernel's shared memory goes.
struct Slots {
    q: TileSlot,
    /// The tiles the MMAs read: the ring itself (16-bit cache), or the one tile the
    /// warps widen their codes of K, then of V, into (e4m3 cache).
    k: TileSlot,
    v: TileSlot,
    /// The e4m3 cache's rings.
    codes: Option<Codes>,
    /// Paged caches: each stage's block-table entries, then the fill's ([`TableRing`]).
    table: Option<RawSlot>,
}

/// The rings of an e4m3 cache: codes, and per stage the keys' K and V scales.
struct Codes {
    k: TileSlot,
    v: TileSlot,
    scales: RawSlot,
}

impl Slots {
    /// The start of the rings: scratch for the warps' merge at the end.
    fn scratch(&self) -> TileSlot {
        self.codes.as_ref().map_or(self.k, |c| c.k)
    }
}

/// Where a decode kernel finds each sequence's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeLayout {
    /// `[B, capacity, Hkv, D]`.
    Contiguous,
    /// Pages of a pool through a block table.
    Paged,
    /// Rows `cu_k[b] .. cu_k[b + 1]` of `[1, total_k, Hkv, D]` ([`DecodeConfig::packed`]).
    Packed,
    /// A contiguous cache under packed queries ([`DecodeConfig::packed_queries`]).
    PackedOverContiguous,
    /// A paged cache under packed queries.
    PackedOverPaged,
}

/// Every decode configuration the dispatch can choose: each head dim's
/// [`DecodeConfig::candidates`], for 16-bit caches (unpadded, and padded where
/// [`PADDED_HEAD_DIMS`] has the head dim; contiguous, paged and packed, and contiguous and
/// paged under packed queries) and (head dims 64, 128, 256, contiguous and paged, under
/// dense or packed queries) e4m3.
pub fn all_decode_configs() -> Vec<DecodeConfig> {
    let mut v = Vec::new();
    for fp8 in [false, true] {
        for dtype in [HalfType::F16, HalfType::Bf16] {
            for head_dim in HEAD_DIMS {
                if fp8 && !FP8_HEAD_DIMS.contains(&head_dim) {
                    continue;
                }
                let paddings: &[bool] = if !fp8 && PADDED_HEAD_DIMS.contains(&head_dim) {
                    &[false, true]
                } else {
                    &[false]
                };
                let layouts: &[DecodeLayout] = if fp8 {
                    &[
                        DecodeLayout::Contiguous,
                        DecodeLayout::Paged,
                        DecodeLayout::PackedOverContiguous,
                        DecodeLayout::PackedOverPaged,
                    ]
                } else {
                    &[
                        DecodeLayout::Contiguous,
                        DecodeLayout::Paged,
                        DecodeLayout::Packed,
                        DecodeLayout::PackedOverContiguous,
                        DecodeLayout::PackedOverPaged,
                    ]
                };
                for &padded in paddings {
                    for &layout in layouts {
                        let kernel = (head_dim, padded);
                        for cfg in DecodeConfig::candidates(dtype, kernel, layout, fp8) {
                            if !v.contains(&cfg) {
                                v.push(cfg);
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

/// The by-value argument block of the decode kernels. Strides are in elements: for Q and
/// O (batch, query, head); for a contiguous cache (batch, position, head); for a paged
/// pool (page, position in page, head).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct DecodeArgs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    /// float32 `[B, Hq, Sq]` (packed: `[Hq, total_q]`), or 0.
    pub lse: u64,
    /// Partial outputs, float32 `[splits, B, Sq, Hq, D]` (unused with one split).
    pub o_part: u64,
    /// Partial log-sum-exps, float32 `[splits, B, Hq, Sq]`.
    pub lse_part: u64,
    /// int32 `[B]`: each sequence's length (the new tokens included); 0: every sequence
    /// holds `capacity` positions (a contiguous cache; the forward's decode route).
    pub seqlens: u64,
    /// int32 `[B, block_table_stride]` page indices (paged only).
    pub block_table: u64,
    pub q_stride: [u64; 3],
    pub k_stride: [u64; 3],
    pub v_stride: [u64; 3],
    pub o_stride: [u64; 3],
    pub block_table_stride: u64,
    pub seqlen_q: u32,
    pub group: u32,
    pub heads_q: u32,
    pub batch: u32,
    /// Positions each sequence can hold: lengths are clamped to it.
    pub capacity: u32,
    /// Pages in the pool: entries at or past it are never followed.
    pub pool_pages: u32,
    /// log2 of the page size.
    pub page_shift: u32,
    pub splits: u32,
    pub scale_log2: f32,
    pub scale: f32,
    /// Nonzero: query `qi` (position `len − Sq + qi`) sees keys up to its position plus
    /// `window_right`.
    pub causal: u32,
    /// Query `qi` sees keys from its position minus `window_left` on; at
    /// [`WINDOW_UNBOUNDED`] (the most it holds) every key. Below it, a block skips its
    /// tiles that lie before the sequence's first query's window.
    pub window_left: u32,
    /// With `causal`: how far past its position a query sees (0: causal masking).
    pub window_right: u32,
    /// 16-row chunks of the packed `Sq · group` rows.
    pub row_chunks: u32,
    /// e4m3 cache: float32 scales, one per (position, head), strided like the cache's
    /// first three dims (elements); 0 for a 16-bit cache.
    pub k_scale: u64,
    pub v_scale: u64,
    pub k_scale_stride: [u64; 3],
    pub v_scale_stride: [u64; 3],
    /// Packed kernels: int32 `[B + 1]` cumulative query and key offsets (rows of Q and O,
    /// of K and V), and the rows the tensors hold, which clamp them.
    pub cu_seqlens_q: u64,
    pub cu_seqlens_k: u64,
    pub total_q: u32,
    pub total_k: u32,
    /// Nonzero: the scores are soft-capped, each `q·k` becoming `tanh(q·k · softcap_pre)`
    /// before the mask ([`ScoreScaling`](super::softcap::ScoreScaling); `scale` and
    /// `scale_log2` then carry the cap).
    pub softcap_pre: f32,
    /// Nonzero: a packed sequence with more than `seqlen_q` queries is another launch's
    /// (a serving batch's long runs, on the forward kernels) and has none here, rather
    /// than its first `seqlen_q`.
    pub skip_longer: u32,
}

impl DecodeArgs {
    pub const SIZE: usize = std::mem::size_of::<DecodeArgs>();
}

/// Whether the call caps its scores ([`DecodeArgs::softcap_pre`] nonzero), and the factor:
/// read once, before the key loop, so that a tile of an uncapped call pays one branch
/// every thread takes alike.
struct SoftCap {
    capped: Reg<Pred>,
    pre: Reg<F32>,
}

impl SoftCap {
    fn new(k: &mut Kernel, args: ParamBytes) -> SoftCap {
        let pre = arg::<F32>(k, args, offset_of!(DecodeArgs, softcap_pre));
        let capped = k.setp(Cmp::Ne, pre, 0f32);
        SoftCap { capped, pre }
    }

    /// The scores capped ([`cap_scores`]) when the call asks for it.
    fn apply(&self, k: &mut Kernel, scores: &Slab) {
        k.if_(self.capped, |k| cap_scores(k, scores, self.pre));
    }
}

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

/// `(batch, position, head)` strides of one tensor, read from the argument block.
fn strides(k: &mut Kernel, args: ParamBytes, at: usize) -> [Reg<U64>; 3] {
    std::array::from_fn(|i| arg::<U64>(k, args, at + 8 * i))
}

/// The element offset of row `(batch, query, head)` of a tensor with those `strides`.
fn row_offset(k: &mut Kernel, strides: [Reg<U64>; 3], at: [Reg<U32>; 3]) -> Reg<U64> {
    let b = k.cvt_u64_u32(at[0]);
    let e = k.mul(b, strides[0]);
    let q = k.cvt_u64_u32(at[1]);
    let e = k.mad(q, strides[1], e);
    let h = k.cvt_u64_u32(at[2]);
    k.mad(h, strides[2], e)
}

/// Where the block sits in the grid, known before its sequence's length is. Its tiles
/// are the sequence's tiles `split`, `split + splits`, `split + 2·splits`, ...: where
/// each lies does not depend on the length, so the first is issued while the length is
/// still on its way (see [`Block::keys`]).
#[derive(Clone, Copy)]
struct Block {
    batch: Reg<U32>,
    kv_head: Reg<U32>,
    chunk: Reg<U32>,
    split: Reg<U32>,
    splits: Reg<S32>,
    /// Positions the cache holds: what the first tile's copies are bounded by.
    capacity: Reg<S32>,
    /// The sequence's length as loaded, first used by [`Block::keys`].
    loaded_len: Reg<S32>,
    /// How many of the block's tiles lie wholly before the window of the sequence's
    /// first query, skipped: its tile `t` is the sequence's tile `split + (skipped +
    /// t)·splits` ([`Block::skip_before_window`]). 0 without a window.
    skipped: Reg<S32>,
    block_n: u32,
    /// A packed kernel's sequence: where its rows are.
    packed: Option<PackedSequence>,
}

/// The comment before each read of a sequence's query offsets (two global loads).
const QUERY_OFFSETS: &str = "Packed queries: the sequence's rows from cu_seqlens_q.";

/// Where the block's sequence's queries lie in Q and O (and the LSE): at the block's
/// batch index of dense `[B, Sq, Hq, D]` tensors, or, in a kernel whose queries are
/// packed ([`DecodeConfig::queries_packed`]: a variable-length forward call, or a serving
/// batch's queries over a cache), at the sequence's rows of `[1, total_q, Hq, D]` ones.
#[derive(Clone, Copy)]
struct QueryRows {
    /// Q's and O's batch index: the block's, or 0 when packed.
    batch: Reg<U32>,
    /// The row of the sequence's first query, when packed.
    start: Option<Reg<U32>>,
    /// The sequence's queries: `Sq`, or when packed its own count (at most `Sq`).
    count: Reg<U32>,
}

impl QueryRows {
    /// Sequence `batch`'s query rows: dense, or (`packed`) from its offsets, clamped to
    /// `0 ≤ start ≤ end ≤ total_q` whatever the array holds.
    fn load(k: &mut Kernel, args: ParamBytes, batch: Reg<U32>, packed: bool) -> QueryRows {
        let most = arg::<U32>(k, args, offset_of!(DecodeArgs, seqlen_q));
        if !packed {
            return QueryRows {
                batch,
                start: None,
                count: most,
            };
        }
        k.comment(QUERY_OFFSETS);
        let cu = arg::<U64>(k, args, offset_of!(DecodeArgs, cu_seqlens_q));
        let at = k.mul_wide_u32(batch, 4u32);
        let total = |k: &mut Kernel| arg::<S32>(k, args, offset_of!(DecodeArgs, total_q));
        let (start, end) = clamped_offsets(k, cu, at, total);
        let queries = k.sub(end, start).cast::<U32>();
        let count = k.min(queries, most);
        // More queries than `Sq`, where those are another launch's: none here.
        let skips = arg::<U32>(k, args, offset_of!(DecodeArgs, skip_longer));
        let skips = k.setp(Cmp::Ne, skips, 0u32);
        let longer = k.setp(Cmp::Gt, queries, most);
        let elsewhere = k.and_pred(skips, longer);
        let count = k.selp(0u32, count, elsewhere);
        QueryRows {
            batch: k.mov(0u32),
            start: Some(start.cast::<U32>()),
            count,
        }
    }

    /// The element offset of query `qi`'s row of `head` in Q or O (with their
    /// `strides`).
    fn row(
        &self,
        k: &mut Kernel,
        strides: [Reg<U64>; 3],
        qi: Reg<U32>,
        head: Reg<U32>,
    ) -> Reg<U64> {
        let row = match self.start {
            Some(start) => k.add(start, qi),
            None => qi,
        };
        row_offset(k, strides, [self.batch, row, head])
    }
}

/// A packed kernel's sequence ([`DecodeConfig::packed`]): its queries, and its first row
/// of K and V, its offsets clamped to the tensors.
#[derive(Clone, Copy)]
struct PackedSequence {
    rows: QueryRows,
    /// Its first row of K and V.
    k_start: Reg<U32>,
}

impl PackedSequence {
    /// Loads sequence `batch`'s offsets: rows `[start, end)` of each, with
    /// `0 ≤ start ≤ end ≤ total` whatever the arrays hold. Returns the sequence and its
    /// key count.
    fn load(k: &mut Kernel, args: ParamBytes, batch: Reg<U32>) -> (PackedSequence, Reg<S32>) {
        let rows = QueryRows::load(k, args, batch, true);
        let at = k.mul_wide_u32(batch, 4u32);
        let cu = arg::<U64>(k, args, offset_of!(DecodeArgs, cu_seqlens_k));
        let total = |k: &mut Kernel| arg::<S32>(k, args, offset_of!(DecodeArgs, total_k));
        let (k_start, end) = clamped_offsets(k, cu, at, total);
        let keys = k.sub(end, k_start);
        let seq = PackedSequence {
            rows,
            k_start: k_start.cast::<U32>(),
        };
        (seq, keys)
    }
}

impl Block {
    /// Issues the length's load before anything else (packed: the sequence's offsets,
    /// whose key count stands in for the capacity as well).
    fn new(k: &mut Kernel, args: ParamBytes, cfg: &DecodeConfig) -> Block {
        let block_n = cfg.block_n();
        let batch = k.special(Special::CtaidZ);
        if cfg.packed {
            let (seq, keys) = PackedSequence::load(k, args, batch);
            let (split, kv_head, chunk) = Block::position(k, args);
            let block = Block {
                batch,
                kv_head,
                chunk,
                split,
                splits: arg::<S32>(k, args, offset_of!(DecodeArgs, splits)),
                capacity: keys,
                loaded_len: keys,
                skipped: k.mov(0i32),
                block_n,
                packed: Some(seq),
            };
            block.skip_before_window(k, args, cfg);
            return block;
        }
        let seqlens = arg::<U64>(k, args, offset_of!(DecodeArgs, seqlens));
        let at = k.mul_wide_u32(batch, 4u32);
        let at = k.add(seqlens, at);
        let capacity = arg::<S32>(k, args, offset_of!(DecodeArgs, capacity));
        // No lengths (a forward call run as decode): every sequence fills the cache.
        let loaded_len = k.mov::<S32>(capacity);
        let given = k.setp(Cmp::Ne, seqlens, 0u64);
        k.guarded(given, true, |k| k.ld_global_into(loaded_len, at, 0));
        let (split, kv_head, chunk) = Block::position(k, args);
        let block = Block {
            batch,
            kv_head,
            chunk,
            split,
            splits: arg::<S32>(k, args, offset_of!(DecodeArgs, splits)),
            capacity,
            loaded_len,
            skipped: k.mov(0i32),
            block_n,
            packed: None,
        };
        block.skip_before_window(k, args, cfg);
        block
    }

    /// With a key window, sets [`Block::skipped`]: the block's tiles wholly before the
    /// first key of the sequence's first query's window (`len − Sq − window_left`),
    /// which no query sees. Those of the sequence are tiles `0..t0`; the block's are
    /// those with `split + j·splits < t0`, `j < ⌈(t0 − split) / splits⌉`. Only a call
    /// with a window waits for the length here; the others issue their first tile
    /// before it arrives.
    fn skip_before_window(&self, k: &mut Kernel, args: ParamBytes, cfg: &DecodeConfig) {
        let left = arg::<U32>(k, args, offset_of!(DecodeArgs, window_left));
        let windowed = k.setp(Cmp::Lt, left, WINDOW_UNBOUNDED);
        k.if_(windowed, |k| {
            k.comment("A key window: skip the tiles before the first query's window.");
            let len = k.max(self.loaded_len, 0i32);
            let len = k.min(len, self.capacity);
            let queries = self.query_rows(k, args, cfg).count.cast::<S32>();
            // In s32: len <= 2^30, left < 2^30, queries <= 16.
            let first = k.sub(len, queries);
            let first = k.sub(first, left.cast::<S32>());
            let first = k.max(first, 0i32);
            let t0 = k.shr(first, self.block_n.trailing_zeros());
            // t0 − split > −splits, so the dividend is never negative.
            let n = k.sub(t0, self.split.cast::<S32>());
            let n = k.add(n, self.splits);
            let n = k.sub(n, 1i32);
            let skipped = k.div(n, self.splits);
            k.mov_to(self.skipped, skipped);
        });
    }

    /// The block's split, KV head and row chunk, from its grid position.
    fn position(k: &mut Kernel, args: ParamBytes) -> (Reg<U32>, Reg<U32>, Reg<U32>) {
        let split = k.special(Special::CtaidX);
        let y = k.special(Special::CtaidY);
        let row_chunks = arg::<U32>(k, args, offset_of!(DecodeArgs, row_chunks));
        let kv_head = k.div(y, row_chunks);
        let chunk = k.mad(kv_head, row_chunks, 0u32);
        let chunk = k.sub(y, chunk);
        (split, kv_head, chunk)
    }

    /// Where the sequence's queries lie: a packed kernel's, loaded with its offsets, or
    /// loaded here (a serving batch's packed queries again at each call, rather than
    /// kept live through the key loop).
    fn query_rows(&self, k: &mut Kernel, args: ParamBytes, cfg: &DecodeConfig) -> QueryRows {
        match &self.packed {
            Some(seq) => seq.rows,
            None => QueryRows::load(k, args, self.batch, cfg.packed_queries),
        }
    }

    /// The first key of the block's tile `t`: `(split + (skipped + t)·splits)·block_n`.
    fn tile_key0(&self, k: &mut Kernel, t: Reg<S32>) -> Reg<S32> {
        let t = k.add(t, self.skipped);
        let tile = k.mad(t, self.splits, self.split.cast::<S32>());
        k.shl(tile, self.block_n.trailing_zeros())
    }

    /// How many of the block's tiles start below key `keys`: of the sequence's
    /// `n = ⌈keys / block_n⌉` tiles, `⌈(n − split) / splits⌉` (0 when `n ≤ split`: the
    /// dividend is then in `[0, splits)`), less the [`Block::skipped`] ones (at least 0).
    fn tiles_below(&self, k: &mut Kernel, keys: Reg<S32>) -> Reg<S32> {
        let n = k.add(keys, (self.block_n - 1) as i32);
        let n = k.shr(n, self.block_n.trailing_zeros());
        let n = k.sub(n, self.split.cast::<S32>());
        let n = k.add(n, self.splits);
        let n = k.sub(n, 1i32);
        let n = k.div(n, self.splits);
        let n = k.sub(n, self.skipped);
        k.max(n, 0i32)
    }

    /// The length, clamped to `[0, capacity]`, and the block's tiles under it.
    fn keys(self, k: &mut Kernel) -> Work {
        let seqlen = k.max(self.loaded_len, 0i32);
        let seqlen = k.min(seqlen, self.capacity);
        let tiles = self.tiles_below(k, seqlen);
        Work {
            block: self,
            seqlen,
            tiles,
        }
    }
}

/// The block and the tiles of its sequence it owns.
struct Work {
    block: Block,
    /// The sequence's length, clamped to `[0, capacity]`: the keys are `0..seqlen`.
    seqlen: Reg<S32>,
    /// The block's tiles that hold keys.
    tiles: Reg<S32>,
}

/// One thread's part in filling a tile of `layout` with `cp.async`: thread `t` copies
/// 16-byte chunk `t % cpb` of rows `t / cpb + i · rows_per_pass` of every column block
/// (`cpb` chunks per column-block row).
#[derive(Clone)]
struct Loader {
    layout: SmemLayout,
    threads: u32,
    chunk: Reg<U32>,
    thread_row: Reg<U32>,
    /// Swizzled shared offset of this thread's chunk in its first row (column block 0).
    line: Reg<U32>,
    /// A padded kernel's ([`DecodeConfig::padded`]) column checks.
    columns: Option<Columns>,
}

/// Which of a thread's chunks lie inside the cache's head dim, in a padded kernel.
#[derive(Clone)]
struct Columns {
    /// Per column block, whether this thread's chunk of it does.
    inside: Vec<Reg<Pred>>,
    /// Bytes from a row's start to this thread's chunk of column block 0.
    chunk_bytes: Reg<U64>,
}

impl Loader {
    /// `head_dim`: the cache's head dim, in a padded kernel.
    fn new(
        k: &mut Kernel,
        layout: SmemLayout,
        threads: u32,
        tid: Reg<U32>,
        head_dim: Option<Reg<U32>>,
    ) -> Loader {
        let row_bytes = layout.block_bytes;
        let cpb = row_bytes / 16;
        let chunk = k.and(tid, cpb - 1);
        let thread_row = k.shr(tid, cpb.trailing_zeros());
        let line = k.mul(thread_row, row_bytes);
        let line = k.mad(chunk, 16u32, line);
        let line = layout.swizzle.apply_in(k, line);
        let columns = head_dim.map(|d| {
            let first_col = k.mul(chunk, 16 / layout.elem_bytes);
            let inside = (0..layout.col_blocks())
                .map(|block| {
                    let col = k.add(first_col, block * layout.block_cols());
                    k.setp(Cmp::Lt, col, d)
                })
                .collect();
            let chunk_bytes = k.shl(chunk, 4);
            Columns {
                inside,
                chunk_bytes: k.cvt_u64_u32(chunk_bytes),
            }
        });
        Loader {
            layout,
            threads,
            chunk,
            thread_row,
            line,
            columns,
        }
    }

    fn row_bytes(&self) -> u32 {
        self.layout.block_bytes
    }

    fn rows_per_pass(&self) -> u32 {
        self.threads / (self.row_bytes() / 16)
    }

    fn col_blocks(&self) -> u32 {
        self.layout.col_blocks()
    }

    /// Elements of one 16-byte chunk.
    fn chunk_elems(&self) -> u32 {
        16 / self.layout.elem_bytes
    }

    /// Copies one row (this thread's chunk of each column block) from `src` (this
    /// thread's chunk of column block 0 of a row of the tensor) to the tile row at shared
    /// address `dst`, or zero-fills it when `bytes` is 0. In a padded kernel the chunks
    /// past the head dim are zero-filled, by copies of 0 bytes from the row's start.
    fn copy_row(&self, k: &mut Kernel, dst: SmemAddr, rows: u32, src: Reg<U64>, bytes: Reg<U32>) {
        let origin = self.columns.as_ref().map(|c| k.sub(src, c.chunk_bytes));
        for block in 0..self.col_blocks() {
            let mut from = k.add(src, (block * self.row_bytes()) as u64);
            let mut bytes = bytes;
            if let (Some(c), Some(origin)) = (&self.columns, origin) {
                let inside = c.inside[block as usize];
                from = k.selp(from, origin, inside);
                bytes = k.selp(bytes, 0u32, inside);
            }
            let to = k.smem_offset(dst, block * rows * self.row_bytes());
            k.cp_async_16(to, from, bytes);
        }
    }

    /// Zeroes what [`Loader::copy_row`] with `bytes` 0 would have: this thread's chunk
    /// of each column block of the tile row at `dst`.
    fn zero_row(&self, k: &mut Kernel, dst: SmemAddr, rows: u32) {
        let zero = k.mov(0u32);
        for block in 0..self.col_blocks() {
            let to = k.smem_offset(dst, block * rows * self.row_bytes());
            k.st_shared_v4::<U32>(to, 0, [zero; 4]);
        }
    }
}

/// Global memory of the K and V caches as this block sees it.
struct Cache {
    paged: bool,
    /// The addresses of this thread's chunk of head `kv_head` (plus, contiguous, the
    /// batch) at position 0 of page 0 (of the sequence), in K and V.
    k_at: Reg<U64>,
    v_at: Reg<U64>,
    /// Bytes from one position to the next, and (paged) from one page to the next:
    /// below 2^32, which the cache's validation guarantees wherever the extent is above 1.
    k_row: Reg<U32>,
    v_row: Reg<U32>,
    k_page: Reg<U32>,
    v_page: Reg<U32>,
    /// This sequence's row of the block table (paged).
    table_row: Reg<U64>,
    pool_pages: Reg<U32>,
    page_shift: Reg<U32>,
    page_mask: Reg<S32>,
}

impl Cache {
    fn new(
        k: &mut Kernel,
        args: ParamBytes,
        cfg: &DecodeConfig,
        block: &Block,
        loader: &Loader,
    ) -> Cache {
        let elem_shift = loader.layout.elem_bytes.trailing_zeros();
        let h = k.cvt_u64_u32(block.kv_head);
        let c = k.cvt_u64_u32(loader.chunk);
        let c = k.shl(c, loader.chunk_elems().trailing_zeros());
        // (the chunk's address, bytes per position, bytes per page) of K or V.
        let walk = |k: &mut Kernel, base_at: usize, strides_at: usize| {
            let base = arg::<U64>(k, args, base_at);
            let s = strides(k, args, strides_at);
            let e = k.mad(h, s[2], c);
            let e = match (cfg.paged, &block.packed) {
                (true, _) => e,
                (false, Some(seq)) => {
                    let row = k.cvt_u64_u32(seq.k_start);
                    k.mad(row, s[1], e)
                }
                (false, None) => {
                    let b = k.cvt_u64_u32(block.batch);
                    k.mad(b, s[0], e)
                }
            };
            let e = k.shl(e, elem_shift);
            let at = k.add(base, e);
            let bytes = |k: &mut Kernel, s: Reg<U64>| {
                let s = k.cvt_u32_u64(s);
                k.shl(s, elem_shift)
            };
            (at, bytes(k, s[1]), bytes(k, s[0]))
        };
        let (k_at, k_row, k_page) = walk(
            k,
            offset_of!(DecodeArgs, k),
            offset_of!(DecodeArgs, k_stride),
        );
        let (v_at, v_row, v_page) = walk(
            k,
            offset_of!(DecodeArgs, v),
            offset_of!(DecodeArgs, v_stride),
        );
        let table = arg::<U64>(k, args, offset_of!(DecodeArgs, block_table));
        let table_stride = arg::<U64>(k, args, offset_of!(DecodeArgs, block_table_stride));
        let b = k.cvt_u64_u32(block.batch);
        let row = k.mul(b, table_stride);
        let row = k.shl(row, 2);
        let table_row = k.add(table, row);
        let pool_pages = arg::<U32>(k, args, offset_of!(DecodeArgs, pool_pages));
        let page_shift = arg::<U32>(k, args, offset_of!(DecodeArgs, page_shift));
        let one = k.mov(1i32);
        let page_mask = k.shl_by(one, page_shift);
        let page_mask = k.sub(page_mask, 1i32);
        Cache {
            paged: cfg.paged,
            k_at,
            v_at,
            k_row,
            v_row,
            k_page,
            v_page,
            table_row,
            pool_pages,
            page_shift,
            page_mask,
        }
    }

    /// The global addresses of key `key`'s rows (this thread's chunk) in K and V, and
    /// whether they may be read: `key < end` and, paged, its page inside the pool. The
    /// addresses lie inside the cache either way ([`Cache::locate`] clamps the key and
    /// the page), so a copy of 0 bytes from them is safe.
    fn rows(
        &self,
        k: &mut Kernel,
        key: Reg<S32>,
        end: Reg<S32>,
        entry: Option<Reg<U32>>,
    ) -> (Reg<U64>, Reg<U64>, Reg<Pred>) {
        let (page, pos, valid) = self.locate(k, key, end, entry);
        let addr = |k: &mut Kernel, at: Reg<U64>, row: Reg<U32>, page_bytes: Reg<U32>| {
            let a = k.mad_wide_u32(pos, row, at);
            match page {
                Some(p) => k.mad_wide_u32(p, page_bytes, a),
                None => a,
            }
        };
        let ka = addr(k, self.k_at, self.k_row, self.k_page);
        let va = addr(k, self.v_at, self.v_row, self.v_page);
        (ka, va, valid)
    }

    /// Where key `key` lives: its page (paged caches), its row in the page or the
    /// sequence, and whether it may be read (as for [`Cache::rows`]). Both always name a
    /// row of the cache: a contiguous cache's key is clamped to `end − 1`; a page is
    /// that of a key clamped so (`entry`, copied ahead through the [`TableRing`] with the
    /// key clamped; paged caches always pass it), replaced by page 0 when outside the
    /// pool, and the row is the key's in its page. `end > start` (only tiles that exist
    /// are issued), so `min(key, end − 1)` is a position of the sequence and its block
    /// table entry exists.
    fn locate(
        &self,
        k: &mut Kernel,
        key: Reg<S32>,
        end: Reg<S32>,
        entry: Option<Reg<U32>>,
    ) -> (Option<Reg<U32>>, Reg<U32>, Reg<Pred>) {
        let mut valid = k.setp(Cmp::Lt, key, end);
        if !self.paged {
            let last = k.sub(end, 1i32);
            let key = k.min(key, last);
            return (None, key.cast::<U32>(), valid);
        }
        let page = entry.expect("a paged cache's keys come with their block-table entries");
        let inside = k.setp(Cmp::Lt, page, self.pool_pages);
        valid = k.and_pred(valid, inside);
        let page = k.selp(page, 0u32, inside);
        let pos = k.and(key, self.page_mask);
        (Some(page), pos.cast::<U32>(), valid)
    }

    /// The address of the block-table entry of `key` (a position of the sequence).
    fn entry_address(&self, k: &mut Kernel, key: Reg<S32>) -> Reg<U64> {
        let index = k.shr_by(key.cast::<U32>(), self.page_shift);
        let at = k.mul_wide_u32(index, 4u32);
        k.add(self.table_row, at)
    }

    /// The address of the block-table entry of `key` clamped into `[0, end)` (row 0 of
    /// the table always exists), so that reading it is safe for tiles that turn out not
    /// to exist.
    fn clamped_entry_address(&self, k: &mut Kernel, key: Reg<S32>, end: Reg<S32>) -> Reg<U64> {
        let last = k.sub(end, 1i32);
        let key = k.min(key, last);
        let key = k.max(key, 0i32);
        self.entry_address(k, key)
    }
}

/// A paged cache's block-table entries, carried through shared memory a ring ahead of
/// the copies that use them. The `cp.async` group of tile `j` also copies the entries of
/// tile `j + stages − 1` into stage `(j + stages − 1) % stages`; the loop issues that
/// tile right after waiting for tile `j`, so its entries are in shared memory by then and
/// no copy ever waits on a table load. (Entries loaded into registers one tile ahead
/// still stalled the issue: with the memory pipe full, a table read takes about as long
/// as the data behind it.)
///
/// The ring fill's entries have `stages − 1` stages of their own after the ring's,
/// copied in one group that the block waits for before its first copy: the fill then
/// waits out one table latency, not one per tile, and reads them without racing the
/// fill's copies of later tiles' entries into the ring.
///
/// A tile starts on a multiple of its key count, so with pages of `P ≤ block_n` tokens
/// its keys lie on `block_n / P` whole pages, and on one page otherwise: thread `t`
/// copies the entry of key `key0 + t·P` when `t·P < block_n`, into word `t` of the stage.
struct TableRing {
    ring: SmemAddr,
    stages: u32,
    stage_bytes: u32,
    block_n: u32,
    tid: Reg<U32>,
    /// The byte offsets in a stage of the entries of this thread's keys, worked out
    /// once where registers allow (16-bit caches; the e4m3 kernels, at their register
    /// limit, work them out per tile).
    lookups: Option<Vec<Reg<U32>>>,
}

impl TableRing {
    fn stage(&self, k: &mut Kernel, slot: Reg<U32>) -> SmemAddr {
        let at = k.mul(slot, self.stage_bytes);
        k.smem_offset(self.ring, at)
    }

    /// The stage of the fill's tile `s` (past the ring's stages).
    fn fill_stage(&self, k: &mut Kernel, s: u32) -> SmemAddr {
        k.smem_offset(self.ring, (self.stages + s) * self.stage_bytes)
    }

    /// Copies (into the current `cp.async` group) the entries of the tile whose first
    /// key is `key0` into `stage` (clamped keys: a tile past the block's last copies
    /// entries of its keys that are never used).
    fn copy(&self, k: &mut Kernel, cache: &Cache, key0: Reg<S32>, end: Reg<S32>, stage: SmemAddr) {
        let offset = k.shl_by(self.tid, cache.page_shift);
        let copies = k.setp(Cmp::Lt, offset, self.block_n);
        k.if_(copies, |k| {
            let key = k.add(key0, offset.cast::<S32>());
            let at = cache.clamped_entry_address(k, key, end);
            let line = k.shl(self.tid, 2);
            let dst = k.smem_offset(stage, line);
            k.cp_async_4(dst, at, 4u32);
        });
    }

    /// The entries, from the tile whose entries are in `stage`, of the keys at
    /// `offsets` in the tile.
    fn entries(
        &self,
        k: &mut Kernel,
        cache: &Cache,
        stage: SmemAddr,
        offsets: &[Reg<S32>],
    ) -> Vec<Reg<U32>> {
        let lookups = match &self.lookups {
            Some(l) => l.clone(),
            None => Self::lookups(k, cache, offsets),
        };
        lookups
            .into_iter()
            .map(|at| {
                let a = k.smem_offset(stage, at);
                k.ld_shared::<U32>(a, 0)
            })
            .collect()
    }

    /// The byte offset in a stage of the entry of each key offset: `4 · (offset >> log2 P)`.
    fn lookups(k: &mut Kernel, cache: &Cache, offsets: &[Reg<S32>]) -> Vec<Reg<U32>> {
        offsets
            .iter()
            .map(|&off| {
                let page = k.shr_by(off.cast::<U32>(), cache.page_shift);
                k.shl(page, 2)
            })
            .collect()
    }
}

/// One thread's part in filling the scale ring of an e4m3 cache: thread `t` copies the
/// scale of key `t % block_n` of the stage, K's for `t < block_n`, V's after (the
/// threads are exactly twice the keys).
struct ScaleLoader {
    base: Reg<U64>,
    stride: [Reg<U64>; 3],
    /// Element offset of head `kv_head` (plus, contiguous, the batch).
    fixed: Reg<U64>,
    /// This thread's key in the stage.
    key: Reg<S32>,
    /// Shared offset of this thread's float in a stage.
    line: Reg<U32>,
}

impl ScaleLoader {
    fn new(
        k: &mut Kernel,
        args: ParamBytes,
        cfg: &DecodeConfig,
        block: &Block,
        tid: Reg<U32>,
    ) -> ScaleLoader {
        let for_v = k.setp(Cmp::Ge, tid, cfg.block_n());
        let pick = |k: &mut Kernel, kf: usize, vf: usize| {
            let a = arg::<U64>(k, args, kf);
            let b = arg::<U64>(k, args, vf);
            k.selp(b, a, for_v)
        };
        let base = pick(
            k,
            offset_of!(DecodeArgs, k_scale),
            offset_of!(DecodeArgs, v_scale),
        );
        let stride = std::array::from_fn(|i| {
            pick(
                k,
                offset_of!(DecodeArgs, k_scale_stride) + 8 * i,
                offset_of!(DecodeArgs, v_scale_stride) + 8 * i,
            )
        });
        let h = k.cvt_u64_u32(block.kv_head);
        let fixed = k.mul(h, stride[2]);
        let fixed = if cfg.paged {
            fixed
        } else {
            let b = k.cvt_u64_u32(block.batch);
            k.mad(b, stride[0], fixed)
        };
        let key = k.and(tid, cfg.block_n() - 1).cast::<S32>();
        let line = k.shl(tid, 2);
        ScaleLoader {
            base,
            stride,
            fixed,
            key,
            line,
        }
    }

    /// Issues this thread's scale of the stage whose first key is `key0` into the
    /// stage at `dst` (zero for keys that may not be read).
    fn issue(
        &self,
        k: &mut Kernel,
        cache: &Cache,
        key0: Reg<S32>,
        end: Reg<S32>,
        dst: SmemAddr,
        entry: Option<Reg<U32>>,
    ) {
        let key = k.add(key0, self.key);
        let (page, pos, valid) = cache.locate(k, key, end, entry);
        let pos = k.cvt_u64_u32(pos);
        let e = k.mad(pos, self.stride[1], self.fixed);
        let e = match page {
            Some(p) => {
                let p = k.cvt_u64_u32(p);
                k.mad(p, self.stride[0], e)
            }
            None => e,
        };
        let bytes = k.shl(e, 2);
        let src = k.add(self.base, bytes);
        let src = k.selp(src, self.base, valid);
        let n = k.selp(4u32, 0u32, valid);
        let dst = k.smem_offset(dst, self.line);
        k.cp_async_4(dst, src, n);
    }
}

fn build<H: Half2>(cfg: &DecodeConfig) -> Result<KernelText, PtxError> {
    let (plan, slots) = cfg.plan();
    let (q_slot, k_slot, v_slot) = (slots.q, slots.k, slots.v);
    let kv_rows = cfg.block_n();
    let mut k = Kernel::new(&cfg.id());
    // As many blocks per SM as shared memory allows (up to three): registers must not
    // be what limits them, and ptxas must not spill to stay within them.
    k.max_threads(cfg.threads())
        .min_blocks_per_sm(cfg.resident_blocks());
    let args = k.param_bytes("args", DecodeArgs::SIZE, 8);
    // A padded kernel's second parameter: the cache's head dim (below the kernel's).
    let head_dim = cfg.padded.then(|| k.param::<U32>("head_dim"));
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);
    let lane = k.and(tid, 31u32);
    let warp = k.shr(tid, 5);

    k.comment("Which (batch, kv head, row chunk, split) this block owns; its length's load.");
    let block = Block::new(&mut k, args, cfg);
    let queries = block.query_rows(&mut k, args, cfg);
    let seqlen_q = queries.count;
    let group = arg::<U32>(&mut k, args, offset_of!(DecodeArgs, group));
    let packed_rows = k.mul(seqlen_q, group);
    let row_base = k.mul(block.chunk, ROWS);
    if cfg.queries_packed() {
        k.comment("A row chunk past the packed sequence's queries has nothing to do.");
        let idle = k.setp(Cmp::Ge, row_base, packed_rows);
        k.if_(idle, |k| k.ret());
    }

    let columns = head_dim.map(|p| k.load_param(p));
    let loader = Loader::new(&mut k, cfg.kv_layout(), cfg.threads(), tid, columns);
    // The ring's loader: the 16-bit one, or one for rows of e4m3 codes (never padded).
    let ring_loader = match &slots.codes {
        Some(_) => Loader::new(&mut k, cfg.code_layout(), cfg.threads(), tid, None),
        None => loader.clone(),
    };
    let cache = Cache::new(&mut k, args, cfg, &block, &ring_loader);
    let scale_loader = slots
        .codes
        .as_ref()
        .map(|_| ScaleLoader::new(&mut k, args, cfg, &block, tid));

    // The ring's slots: the 16-bit tiles themselves, or the codes.
    let (ring_k, ring_v) = slots
        .codes
        .as_ref()
        .map_or((k_slot, v_slot), |c| (c.k, c.v));
    let ring_rpp = ring_loader.rows_per_pass();
    let passes = kv_rows / ring_rpp;
    // The key offsets (in a tile) this thread copies rows of, one per pass, and (e4m3)
    // the one whose scale it copies.
    let key_offsets = |k: &mut Kernel| -> Vec<Reg<S32>> {
        let mut offsets: Vec<Reg<S32>> = (0..passes)
            .map(|pass| {
                k.add(
                    ring_loader.thread_row.cast::<S32>(),
                    (pass * ring_rpp) as i32,
                )
            })
            .collect();
        if let Some(sl) = &scale_loader {
            offsets.push(sl.key);
        }
        offsets
    };
    let table = slots.table.map(|slot| {
        let lookups = (!cfg.fp8).then(|| {
            let offsets = key_offsets(&mut k);
            TableRing::lookups(&mut k, &cache, &offsets)
        });
        TableRing {
            ring: smem.raw(&mut k, slot),
            stages: cfg.stages,
            stage_bytes: cfg.table_stage_bytes(),
            block_n: cfg.block_n(),
            tid,
            lookups,
        }
    });
    // The ring stage before `slot`, `(slot + stages − 1) % stages`: where the tile
    // `stages − 1` after the one in `slot` goes.
    let ring_before = |k: &mut Kernel, slot: Reg<U32>| {
        let first = k.setp(Cmp::Eq, slot, 0u32);
        let before = k.sub(slot, 1u32);
        k.selp(cfg.stages - 1, before, first)
    };
    // This thread's destinations in ring stage `slot`: its rows of K and V.
    let stage_rows = |k: &mut Kernel, slot: Reg<U32>| {
        let slot_bytes = k.mul(slot, ring_k.stride);
        let line = k.add(ring_loader.line, slot_bytes);
        (
            smem.tile_byte(k, ring_k, line),
            smem.tile_byte(k, ring_v, line),
        )
    };
    // This thread's row of pass `pass` in the stage whose rows start at `dst`.
    let pass_row = |k: &mut Kernel, dst: SmemAddr, pass: u32| {
        k.smem_offset(dst, pass * ring_rpp * ring_loader.row_bytes())
    };
    // Issues the block's tile `tile` into ring stage `slot`, reading keys below `end`
    // (the capacity for the first tile, the length after it). Paged, its block-table
    // entries are in `entry_stage` (a fill stage of the [`TableRing`] for the fill, the
    // ring's stage `slot` in the loop), and the group also carries the entries of tile
    // `tile + stages − 1`.
    let issue = |k: &mut Kernel,
                 tile: Reg<S32>,
                 slot: Reg<U32>,
                 entry_stage: Option<SmemAddr>,
                 end: Reg<S32>| {
        let key0 = block.tile_key0(k, tile);
        let offsets = key_offsets(k);
        let entries: Vec<Option<Reg<U32>>> = match (&table, entry_stage) {
            (Some(table), Some(stage)) => table
                .entries(k, &cache, stage, &offsets)
                .into_iter()
                .map(Some)
                .collect(),
            _ => vec![None; offsets.len()],
        };
        let (k_dst, v_dst) = stage_rows(k, slot);
        for pass in 0..passes {
            let key = k.add(key0, offsets[pass as usize]);
            let (ka, va, valid) = cache.rows(k, key, end, entries[pass as usize]);
            let bytes = k.selp(16u32, 0u32, valid);
            let kd = pass_row(k, k_dst, pass);
            let vd = pass_row(k, v_dst, pass);
            ring_loader.copy_row(k, kd, kv_rows, ka, bytes);
            ring_loader.copy_row(k, vd, kv_rows, va, bytes);
        }
        if let (Some(codes), Some(sl)) = (&slots.codes, &scale_loader) {
            let stage = k.mul(slot, cfg.scale_stage_bytes());
            let dst = smem.raw(k, codes.scales);
            let dst = k.smem_offset(dst, stage);
            sl.issue(k, &cache, key0, end, dst, entries[passes as usize]);
        }
        if let Some(table) = &table {
            let later = k.add(tile, (cfg.stages - 1) as i32);
            let later = block.tile_key0(k, later);
            let later_slot = ring_before(k, slot);
            let stage = table.stage(k, later_slot);
            table.copy(k, &cache, later, end, stage);
        }
    };

    // Paged: the fill's block-table entries (keys clamped below the capacity: the length
    // is not known yet) go first, into the table ring's fill stages in a group of their
    // own, and are waited for once. Loaded straight into registers, they went out one
    // tile at a time: ptxas held each tile's loads back until the tile before was
    // issued, so the fill waited out a table latency per tile.
    if let Some(table) = &table {
        for s in 0..cfg.stages - 1 {
            let t = k.mov(s as i32);
            let key0 = block.tile_key0(&mut k, t);
            let stage = table.fill_stage(&mut k, s);
            table.copy(&mut k, &cache, key0, block.capacity, stage);
        }
        k.cp_async_commit();
    }
    k.comment("Q: the 16 packed rows (query qi of head kv_head*group + g at row qi*group + g).");
    let rpp = loader.rows_per_pass();
    for pass in 0..ROWS.div_ceil(rpp) {
        let tile_row = k.add(loader.thread_row, pass * rpp);
        let q_rows_ok = k.setp(Cmp::Lt, tile_row, ROWS);
        let r = k.add(row_base, tile_row);
        let in_range = k.setp(Cmp::Lt, r, packed_rows);
        let valid = k.and_pred(q_rows_ok, in_range);
        let last = k.sub(packed_rows, 1u32);
        let r = k.min(r, last);
        let qi = k.div(r, group);
        let g = k.mad(qi, group, 0u32);
        let g = k.sub(r, g);
        let head = k.mad(block.kv_head, group, g);
        let q = arg::<U64>(&mut k, args, offset_of!(DecodeArgs, q));
        let s = strides(&mut k, args, offset_of!(DecodeArgs, q_stride));
        let e = queries.row(&mut k, s, qi, head);
        let c = k.cvt_u64_u32(loader.chunk);
        let c = k.shl(c, 3);
        let e = k.add(e, c);
        let e = k.shl(e, 1);
        let src = k.add(q, e);
        // A row past the queries copies nothing, from this thread's chunk of Q's row 0
        // (the whole chunk address, so that a padded kernel's row start is Q's).
        let fallback = match &loader.columns {
            Some(c) => k.add(q, c.chunk_bytes),
            None => q,
        };
        let src = k.selp(src, fallback, valid);
        let bytes = k.selp(16u32, 0u32, valid);
        let dst = smem.tile_byte(&mut k, q_slot, loader.line);
        let dst = k.smem_offset(dst, pass * rpp * loader.row_bytes());
        k.if_(q_rows_ok, |k| loader.copy_row(k, dst, ROWS, src, bytes));
    }
    k.cp_async_commit();
    if table.is_some() {
        // The entries' group (Q's may still be in flight), seen by every thread.
        k.cp_async_wait(1);
        k.sync_threads();
    }
    // Where fill tile `s` finds its block-table entries (paged).
    let fill_stage = |k: &mut Kernel, s: u32| table.as_ref().map(|t| t.fill_stage(k, s));
    k.comment("Fill the ring: tiles 0 .. stages-2, one commit group each.");
    // Tile 0 goes out before the length arrives, bounded by the capacity: the memory
    // system starts streaming a latency earlier. Only one tile, so a block whose tiles
    // all lie past a short sequence wastes little.
    let first_exists = block.tiles_below(&mut k, block.capacity);
    let first_exists = k.setp(Cmp::Gt, first_exists, 0i32);
    k.if_(first_exists, |k| {
        let t = k.mov(0i32);
        let slot = k.mov(0u32);
        let entries = fill_stage(k, 0);
        issue(k, t, slot, entries, block.capacity)
    });
    k.cp_async_commit();
    let w = block.keys(&mut k);
    for s in 1..cfg.stages - 1 {
        let exists = k.setp(Cmp::Gt, w.tiles, s as i32);
        k.if_(exists, |k| {
            let t = k.mov(s as i32);
            let slot = k.mov(s);
            let entries = fill_stage(k, s);
            issue(k, t, slot, entries, w.seqlen)
        });
        k.cp_async_commit();
    }
    k.comment("Tile 0 past the length: zero the rows a copy bounded by it would have.");
    let first = k.mov(0i32);
    let key0 = block.tile_key0(&mut k, first);
    let tile_end = k.add(key0, cfg.block_n() as i32);
    let cut = k.setp(Cmp::Gt, tile_end, w.seqlen);
    let read = k.setp(Cmp::Gt, w.tiles, 0i32);
    let cut = k.and_pred(cut, read);
    k.if_(cut, |k| {
        // Tile 0's group (and Q's before it) complete, as at the loop's first wait.
        k.cp_async_wait(cfg.stages - 2);
        let slot = k.mov(0u32);
        let (k_dst, v_dst) = stage_rows(k, slot);
        let offsets = key_offsets(k);
        for pass in 0..passes {
            let key = k.add(key0, offsets[pass as usize]);
            let past = k.setp(Cmp::Ge, key, w.seqlen);
            k.if_(past, |k| {
                let kd = pass_row(k, k_dst, pass);
                let vd = pass_row(k, v_dst, pass);
                ring_loader.zero_row(k, kd, kv_rows);
                ring_loader.zero_row(k, vd, kv_rows);
            });
        }
        if let (Some(codes), Some(sl)) = (&slots.codes, &scale_loader) {
            let key = k.add(key0, offsets[passes as usize]);
            let past = k.setp(Cmp::Ge, key, w.seqlen);
            let dst = smem.raw(k, codes.scales);
            let dst = k.smem_offset(dst, sl.line);
            k.if_(past, |k| k.st_shared(dst, 0, 0f32));
        }
    });

    let f = WarpState::<H>::new(&mut k, cfg, &smem, [q_slot, k_slot, v_slot], lane, warp);
    let scale_log2 = arg::<F32>(&mut k, args, offset_of!(DecodeArgs, scale_log2));
    let limits = row_limits(&mut k, args, &w, lane, row_base, group, seqlen_q);
    let g4 = k.and(lane, 3u32);
    let col = k.shl(g4, 1);
    let warp_keys = k.mad(warp, WARP_KEYS, col).cast::<S32>();
    let widen = slots
        .codes
        .as_ref()
        .map(|codes| Widen::new(&mut k, cfg, &smem, codes, k_slot, lane, warp, col));

    let softcap = SoftCap::new(&mut k, args);
    k.comment("The key loop: tile t from the ring, tile t + stages - 1 issued behind it.");
    // `t % stages`, kept in step with `t` rather than divided out each turn.
    let slot = k.mov(0u32);
    k.for_range(0i32, w.tiles, 1, |k, t| {
        k.cp_async_wait(cfg.stages - 2);
        k.sync_threads();
        let ahead = k.add(t, (cfg.stages - 1) as i32);
        let more = k.setp(Cmp::Lt, ahead, w.tiles);
        k.if_(more, |k| {
            let ahead_slot = ring_before(k, slot);
            let entries = table.as_ref().map(|t| t.stage(k, ahead_slot));
            issue(k, ahead, ahead_slot, entries, w.seqlen)
        });
        k.cp_async_commit();

        // The key of the thread's column 0 in this tile.
        let first_key = |k: &mut Kernel| {
            let key0 = block.tile_key0(k, t);
            k.add(key0, warp_keys)
        };
        match &widen {
            None => {
                let slot_bytes = k.mul(slot, k_slot.stride);
                let scores = f.scores(k, slot_bytes);
                softcap.apply(k, &scores);
                let key0 = first_key(k);
                mask_scores(k, &scores, limits, key0);
                let p =
                    f.softmax
                        .step_packed::<H>(k, std::slice::from_ref(&scores), &f.o, scale_log2);
                f.accumulate_pv(k, &p[0][0], slot_bytes);
            }
            Some(widen) => {
                let [k_scales, v_scales] = widen.scales(k, slot);
                widen.widen::<H>(k, slot, false);
                let tile = k.mov(0u32);
                let scores = f.scores(k, tile);
                scale_columns(k, &scores, k_scales);
                softcap.apply(k, &scores);
                let key0 = first_key(k);
                mask_scores(k, &scores, limits, key0);
                let scores = std::slice::from_ref(&scores);
                let factors = [[k.mov(1f32), k.mov(1f32)]];
                f.softmax.update(k, scores, scale_log2, &factors);
                widen.apply_v_scales(k, &scores[0], v_scales, &factors[0]);
                rescale_rows(k, &f.o, &factors);
                let p = pack_probs::<H>(k, &scores[0]);
                widen.widen::<H>(k, slot, true);
                f.accumulate_pv(k, &p[0], tile);
            }
        }
        k.advance_stage(slot, cfg.stages);
    });
    k.cp_async_wait(0);
    k.sync_threads();
    if let Some(widen) = &widen {
        k.comment("The output leaves the units of the largest V scale.");
        let unit = [[widen.unit, widen.unit]];
        rescale_rows(&mut k, &f.o, &unit);
    }

    // Read again from the arguments rather than kept live through the loop.
    let queries = block.query_rows(&mut k, args, cfg);
    let group = arg::<U32>(&mut k, args, offset_of!(DecodeArgs, group));
    let packed_rows = k.mul(queries.count, group);
    merge_warps_and_store::<H>(
        &mut k,
        cfg,
        args,
        &smem,
        slots.scratch(),
        &f,
        &w,
        tid,
        warp,
        lane,
        row_base,
        (&queries, packed_rows),
        head_dim,
    );
    k.finish()
}

/// An e4m3 cache's per-warp work on each stage: the warp's 16 keys of K, then of V,
/// widened from codes into its rows of the 16-bit tile, and those keys' scales.
///
/// Lane `l` widens 16-byte chunks `l, l + 32, ...` of the warp's `16·D` code bytes (in
/// order, so the warp's loads are conflict-free); chunk `i` is row `i / (D/16)`,
/// elements `16·(i % (D/16))` on, and lands as two 16-byte chunks of the swizzled
/// 16-bit row.
struct Widen {
    /// This lane's first code chunk in stage 0 of the K ring.
    src: SmemAddr,
    /// From the K ring to the V ring, and from one stage to the next.
    v_ring: u32,
    ring_stride: u32,
    /// Per chunk, its two destinations in the 16-bit tile.
    dst: Vec<[SmemAddr; 2]>,
    /// This thread's four keys' K scales in stage 0 (V's are `block_n` floats on).
    scales: SmemAddr,
    scale_stage: u32,
    block_n: u32,
    /// The largest V scale this warp has met: the unit the output is carried in
    /// (starting at the smallest normal float, so a cache of zeros divides by nothing).
    unit: Reg<F32>,
}

impl Widen {
    #[allow(clippy::too_many_arguments)]
    fn new(
        k: &mut Kernel,
        cfg: &DecodeConfig,
        smem: &Smem,
        codes: &Codes,
        tile: TileSlot,
        lane: Reg<U32>,
        warp: Reg<U32>,
        col: Reg<U32>,
    ) -> Widen {
        let d = cfg.head_dim;
        let per_row = d / 16;
        let lane16 = k.shl(lane, 4);
        let src = k.mad(warp, WARP_KEYS * d, lane16);
        let src = smem.tile_byte(k, codes.k, src);
        let first_row = k.mul(warp, WARP_KEYS);
        let row_bytes = tile.layout.block_bytes;
        let dst = (0..d / 32)
            .map(|i| {
                let chunk = k.add(lane, 32 * i);
                let row = k.shr(chunk, per_row.trailing_zeros());
                let row = k.add(row, first_row);
                let c16 = k.and(chunk, per_row - 1);
                // 16 codes make 32 bytes: chunks 2·(c16 % 4) and the next of column block
                // c16 / 4 (64 elements a block).
                let block = k.shr(c16, 2);
                let block = k.mul(block, tile.layout.block_stride());
                let pair = k.and(c16, 3u32);
                let line = k.mul(row, row_bytes);
                let line = k.mad(pair, 32u32, line);
                std::array::from_fn(|half| {
                    let at = k.add(line, 16 * half as u32);
                    let at = Swizzle::B128.apply_in(k, at);
                    let at = k.add(at, block);
                    smem.tile_byte(k, tile, at)
                })
            })
            .collect();
        let key = k.mad(warp, WARP_KEYS, col);
        let key = k.shl(key, 2);
        let scales = smem.raw(k, codes.scales);
        let scales = k.smem_offset(scales, key);
        Widen {
            src,
            v_ring: codes.v.offset - codes.k.offset,
            ring_stride: codes.k.stride,
            dst,
            scales,
            scale_stage: cfg.scale_stage_bytes(),
            block_n: cfg.block_n(),
            unit: k.mov(f32::MIN_POSITIVE),
        }
    }

    /// Widens the warp's keys of K (`v` false) or V of the stage in ring slot `slot`
    /// into its rows of the 16-bit tile. The warp must be done reading what the tile
    /// held (`bar.warp.sync` before); the rows are ready for `ldmatrix` on return.
    fn widen<H: Half2>(&self, k: &mut Kernel, slot: Reg<U32>, v: bool) {
        k.sync_warp();
        let ring = k.mul(slot, self.ring_stride);
        let src = k.smem_offset(self.src, ring);
        let from = if v { self.v_ring } else { 0 };
        for (i, dst) in self.dst.iter().enumerate() {
            let words = k.ld_shared_v4::<B32>(src, (from + 512 * i as u32) as i32);
            let h: Vec<Reg<H>> = words
                .into_iter()
                .flat_map(|w| k.unpack_e4m3x4::<H>(w))
                .collect();
            k.st_shared_v4(dst[0], 0, [h[0], h[1], h[2], h[3]]);
            k.st_shared_v4(dst[1], 0, [h[4], h[5], h[6], h[7]]);
        }
        k.sync_warp();
    }

    /// This thread's four keys' K and V scales in ring slot `slot` (keys `2c`, `2c + 1`,
    /// `2c + 8`, `2c + 9` of the warp's 16: the score columns and probability columns
    /// the thread holds).
    fn scales(&self, k: &mut Kernel, slot: Reg<U32>) -> [[Reg<F32>; 4]; 2] {
        let stage = k.mul(slot, self.scale_stage);
        let at = k.smem_offset(self.scales, stage);
        std::array::from_fn(|tensor| {
            let base = (tensor as u32 * self.block_n * 4) as i32;
            [0, 4, 32, 36].map(|off| k.ld_shared::<F32>(at, base + off))
        })
    }

    /// Multiplies the probabilities by their keys' V scales over the warp's unit, first
    /// raising the unit to the tile's largest V scale and folding the change into the
    /// output's rescale `factors`.
    fn apply_v_scales(
        &self,
        k: &mut Kernel,
        probs: &Slab,
        v_scales: [Reg<F32>; 4],
        factors: &[Reg<F32>; 2],
    ) {
        let m = k.max(v_scales[0], v_scales[1]);
        let m2 = k.max(v_scales[2], v_scales[3]);
        let m = k.max(m, m2);
        // The quad's four threads hold the warp's 16 keys.
        for mask in [1, 2] {
            let other = k.shfl_bfly(m, mask);
            k.max_to(m, m, other);
        }
        let unit = k.max(self.unit, m);
        let inv = k.rcp(unit);
        let same = k.setp(Cmp::Eq, unit, self.unit);
        let ratio = k.mul(self.unit, inv);
        let ratio = k.selp(1f32, ratio, same);
        for &f in factors {
            k.mul_to(f, f, ratio);
        }
        let r = v_scales.map(|s| k.mul(s, inv));
        scale_columns(k, probs, r);
        k.mov_to(self.unit, unit);
    }
}

/// Multiplies the thread's score (or probability) columns by per-key factors: `f[2·nt +
/// j]` for column `j` of n-tile `nt`.
fn scale_columns(k: &mut Kernel, scores: &Slab, f: [Reg<F32>; 4]) {
    for (nt, tile) in scores.iter().enumerate() {
        for half in 0..2 {
            for (j, v) in half_of(tile, half).into_iter().enumerate() {
                k.mul_to(v, v, f[2 * nt + j]);
            }
        }
    }
}

/// Per row half of this thread (rows `g` and `g + 8` of the tile): the keys the row sees,
/// `first..end`. Without causal masking `end` is the sequence's end; with it, query `qi`
/// (position `len − Sq + qi`) sees keys up to its own position plus the window's right
/// side. `first` is the position less the window's left side (at most 0 without one).
fn row_limits(
    k: &mut Kernel,
    args: ParamBytes,
    w: &Work,
    lane: Reg<U32>,
    row_base: Reg<U32>,
    group: Reg<U32>,
    seqlen_q: Reg<U32>,
) -> [RowKeys; 2] {
    let causal = arg::<U32>(k, args, offset_of!(DecodeArgs, causal));
    let causal = k.setp(Cmp::Ne, causal, 0u32);
    let left = arg::<S32>(k, args, offset_of!(DecodeArgs, window_left));
    let right = arg::<S32>(k, args, offset_of!(DecodeArgs, window_right));
    let g = k.shr(lane, 2);
    std::array::from_fn(|half| {
        let r = k.add(row_base, g);
        let r = k.add(r, 8 * half as u32);
        let qi = k.div(r, group);
        // The position len − Sq + qi, in s32: len <= capacity <= 2^30, Sq <= 16, and
        // both window sides are at most 2^30.
        let pos = k.sub(w.seqlen, seqlen_q.cast::<S32>());
        let pos = k.add(pos, qi.cast::<S32>());
        let lim = k.add(pos, 1i32);
        let lim = k.add_sat(lim, right);
        let lim = k.selp(lim, w.seqlen, causal);
        RowKeys {
            first: k.sub(pos, left),
            end: k.min(lim, w.seqlen),
        }
    })
}

/// The keys one row sees: `first..end`.
#[derive(Clone, Copy)]
struct RowKeys {
    first: Reg<S32>,
    end: Reg<S32>,
}

/// Sets to −∞ the scores of keys outside their row's [`RowKeys`]; `key0` is the key of
/// the thread's column 0 in the tile.
fn mask_scores(k: &mut Kernel, scores: &Slab, rows: [RowKeys; 2], key0: Reg<S32>) {
    for (half, row) in rows.iter().enumerate() {
        let left = k.sub(row.end, key0);
        let before = k.sub(row.first, key0);
        for (nt, tile) in scores.iter().enumerate() {
            for (j, v) in half_of(tile, half).into_iter().enumerate() {
                let c = (8 * nt + j) as i32;
                let sees = k.setp(Cmp::Gt, left, c);
                k.selp_to(v, v, f32::NEG_INFINITY, sees);
                let early = k.setp(Cmp::Gt, before, c);
                k.selp_to(v, f32::NEG_INFINITY, v, early);
            }
        }
    }
}

/// One warp's accumulators and fragment addresses.
struct WarpState<H: Half2> {
    cfg: DecodeConfig,
    o: Vec<Slab>,
    softmax: OnlineSoftmax,
    q_frag: Vec<SmemAddr>,
    k_frag: Vec<SmemAddr>,
    v_frag: Vec<SmemAddr>,
    _h: PhantomData<H>,
}

impl<H: Half2> WarpState<H> {
    fn new(
        k: &mut Kernel,
        cfg: &DecodeConfig,
        smem: &Smem,
        [q, kt, vt]: [TileSlot; 3],
        lane: Reg<U32>,
        warp: Reg<U32>,
    ) -> Self {
        let o = zeroed_slabs(k, 1, (cfg.head_dim / 8) as usize);
        let softmax = OnlineSoftmax::new(k, 1);
        // ldmatrix lane roles as in the sm80 forward; each warp reads its own 16 keys.
        let LaneRoles { l8, l16, hi16, mid } = LaneRoles::of(k, lane);
        let first = k.mul(warp, WARP_KEYS);
        let k_row = k.mad(hi16, 8u32, l8);
        let k_row = k.add(k_row, first);
        let v_row = k.add(l16, first);
        Self {
            cfg: *cfg,
            o,
            softmax,
            q_frag: frag_addresses(k, smem, q, l16, hi16),
            k_frag: frag_addresses(k, smem, kt, k_row, mid),
            v_frag: frag_addresses(k, smem, vt, v_row, hi16),
            _h: PhantomData,
        }
    }

    fn row_bytes(&self) -> u32 {
        self.cfg.kv_layout().block_bytes
    }

    /// `S = Q K^T` for this warp's 16 keys of the tile in the slot at `slot_bytes`.
    fn scores(&self, k: &mut Kernel, slot_bytes: Reg<U32>) -> Slab {
        let rb = self.row_bytes();
        let kpb = rb / 32;
        let k_base: Vec<SmemAddr> = self
            .k_frag
            .iter()
            .map(|&a| k.smem_offset(a, slot_bytes))
            .collect();
        let acc = zeroed_slabs(k, 1, 2).remove(0);
        for kk in 0..self.cfg.head_dim / 16 {
            let (step, block) = ((kk % kpb) as usize, kk / kpb);
            let qa = k.smem_offset(self.q_frag[step], block * ROWS * rb);
            let a = k.ldmatrix_x4::<H>(qa, false);
            let ka = k.smem_offset(k_base[step], block * self.cfg.block_n() * rb);
            let [b0, b1, b2, b3] = k.ldmatrix_x4::<H>(ka, false);
            k.mma_m16n8k16(&acc[0], &a, &[b0, b1], &acc[0]);
            k.mma_m16n8k16(&acc[1], &a, &[b2, b3], &acc[1]);
        }
        acc
    }

    /// `O += P V` for this warp's 16 keys.
    fn accumulate_pv(&self, k: &mut Kernel, p: &[Reg<H>; 4], slot_bytes: Reg<U32>) {
        let rb = self.row_bytes();
        let kpb = rb / 32;
        let v_base: Vec<SmemAddr> = self
            .v_frag
            .iter()
            .map(|&a| k.smem_offset(a, slot_bytes))
            .collect();
        for np in 0..self.cfg.head_dim / 16 {
            let (step, block) = ((np % kpb) as usize, np / kpb);
            let va = k.smem_offset(v_base[step], block * self.cfg.block_n() * rb);
            let [b0, b1, b2, b3] = k.ldmatrix_x4::<H>(va, true);
            let (lo, hi) = (&self.o[0][2 * np as usize], &self.o[0][2 * np as usize + 1]);
            k.mma_m16n8k16(lo, p, &[b0, b1], lo);
            k.mma_m16n8k16(hi, p, &[b2, b3], hi);
        }
    }
}

/// The end of the block: the four warps' softmax states merged through shared memory
/// (which the ring no longer needs), then the rows written, as the final O and LSE when
/// there is one split, as float32 partial results otherwise.
///
/// Thread `t` merges row `t % 16`'s part `t / 16` (`d / parts` columns, `parts` =
/// threads / 16): for each warp `w`,
/// `f_w = exp2((m_w − M)·c)` with `M` the largest `m_w`, `L = Σ l_w f_w`,
/// `O = Σ O_w f_w / L`, `LSE = M·scale + ln L`. A row no key reached has `M = −∞` and
/// every `l_w = 0`: it gets O = 0 and LSE = −∞.
#[allow(clippy::too_many_arguments)]
fn merge_warps_and_store<H: Half2>(
    k: &mut Kernel,
    cfg: &DecodeConfig,
    args: ParamBytes,
    smem: &Smem,
    scratch: TileSlot,
    f: &WarpState<H>,
    w: &Work,
    tid: Reg<U32>,
    warp: Reg<U32>,
    lane: Reg<U32>,
    row_base: Reg<U32>,
    (queries, packed_rows): (&QueryRows, Reg<U32>),
    head_dim: Option<Param<U32>>,
) {
    let d = cfg.head_dim;
    k.comment("Merge the warps: (m, l) and O of each through shared memory.");
    let base = smem.tile(k, scratch, 0);
    let zero = k.mov(0u32);
    let rows = Rows::new(k, lane, zero);
    let stats_bytes = cfg.stats_bytes();
    let is_col0 = k.setp(Cmp::Eq, rows.col, 0i32);
    for half in 0..2 {
        let sum = f.softmax.row_sum(k, 0, half);
        let row = k.add(rows.row0.cast::<U32>(), Rows::offset(0, half));
        let wrow = k.mad(warp, ROWS, row);
        let stat = k.mul(wrow, 8u32);
        let stat = k.smem_offset(base, stat);
        let m = f.softmax.max[0][half];
        // Only the rows that hold queries are merged (4 of the 16 for one token of a
        // 4-head group).
        let packed = k.add(row_base, row);
        let holds = k.setp(Cmp::Lt, packed, packed_rows);
        let stat_writer = k.and_pred(holds, is_col0);
        k.guarded(stat_writer, true, |k| {
            k.st_shared(stat, 0, m);
            k.st_shared(stat, 4, sum);
        });
        let at = k.mul(wrow, cfg.merge_row_bytes());
        let c4 = k.shl(rows.col.cast::<U32>(), 2);
        let at = k.add(at, c4);
        let at = k.add(at, stats_bytes);
        let at = k.smem_offset(base, at);
        k.if_(holds, |k| {
            for (nt, acc) in f.o[0].iter().enumerate() {
                let [lo, hi] = half_of(acc, half);
                k.st_shared(at, (nt * 32) as i32, lo);
                k.st_shared(at, (nt * 32 + 4) as i32, hi);
            }
        });
    }
    k.sync_threads();

    let cols = d / (cfg.threads() / ROWS);
    let row = k.and(tid, ROWS - 1);
    let part = k.shr(tid, ROWS.trailing_zeros());
    let r = k.add(row_base, row);
    let inside = k.setp(Cmp::Lt, r, packed_rows);
    k.if_(inside, |k| {
        let at = [row, part, r];
        merge_row_and_store::<H>(k, cfg, args, base, (w, queries), at, cols, head_dim);
    });
}

/// One thread's share of the warps' merge: columns `part·cols ..` of packed row `row`
/// (`r` counted from the batch's first), from the scratch at `base`; stores them (in a
/// padded kernel, those below the cache's head dim `head_dim` in O; all of them in the
/// workspace, whose rows are the kernel's).
#[allow(clippy::too_many_arguments)]
fn merge_row_and_store<H: Half2>(
    k: &mut Kernel,
    cfg: &DecodeConfig,
    args: ParamBytes,
    base: SmemAddr,
    (w, queries): (&Work, &QueryRows),
    [row, part, r]: [Reg<U32>; 3],
    cols: u32,
    head_dim: Option<Param<U32>>,
) {
    let d = cfg.head_dim;
    let stats_bytes = cfg.stats_bytes();
    let scale_log2 = arg::<F32>(k, args, offset_of!(DecodeArgs, scale_log2));
    let scale = arg::<F32>(k, args, offset_of!(DecodeArgs, scale));
    let stats: Vec<[Reg<F32>; 2]> = (0..cfg.warps)
        .map(|wi| {
            let at = k.add(row, wi * ROWS);
            let at = k.mul(at, 8u32);
            let at = k.smem_offset(base, at);
            [k.ld_shared::<F32>(at, 0), k.ld_shared::<F32>(at, 4)]
        })
        .collect();
    let mut max = stats[0][0];
    for s in &stats[1..] {
        max = k.max(max, s[0]);
    }
    let none = k.setp(Cmp::Eq, max, f32::NEG_INFINITY);
    let max = k.selp(0f32, max, none);
    let total = k.mov(0f32);
    let acc: Vec<Reg<F32>> = (0..cols).map(|_| k.mov(0f32)).collect();
    let col0 = k.mul(part, cols);
    for (wi, s) in stats.iter().enumerate() {
        let drop = k.sub(s[0], max);
        let drop = k.mul(drop, scale_log2);
        let factor = k.ex2(drop);
        k.mad_to(total, s[1], factor, total);
        let at = k.add(row, wi as u32 * ROWS);
        let at = k.mul(at, cfg.merge_row_bytes());
        let c = k.shl(col0, 2);
        let at = k.add(at, c);
        let at = k.add(at, stats_bytes);
        let at = k.smem_offset(base, at);
        for c4 in 0..cols / 4 {
            let v = k.ld_shared_v4::<F32>(at, (c4 * 16) as i32);
            for (j, x) in v.into_iter().enumerate() {
                let a = acc[(4 * c4 + j as u32) as usize];
                k.mad_to(a, x, factor, a);
            }
        }
    }
    let empty = k.setp(Cmp::Eq, total, 0f32);
    let inv = k.rcp(total);
    let inv = k.selp(0f32, inv, empty);
    for &a in &acc {
        k.mul_to(a, a, inv);
    }
    let log_sum = k.lg2(total);
    let log_sum = k.mul(log_sum, std::f32::consts::LN_2);
    let lse = k.mad(max, scale, log_sum);
    let lse = k.selp(f32::NEG_INFINITY, lse, empty);

    k.comment("Store the row: O and LSE with one split, partial results otherwise.");
    let group = arg::<U32>(k, args, offset_of!(DecodeArgs, group));
    let qi = k.div(r, group);
    let g = k.mad(qi, group, 0u32);
    let g = k.sub(r, g);
    let head = k.mad(w.block.kv_head, group, g);
    let heads_q = arg::<U32>(k, args, offset_of!(DecodeArgs, heads_q));
    let seqlen_q = arg::<U32>(k, args, offset_of!(DecodeArgs, seqlen_q));
    let batch = arg::<U32>(k, args, offset_of!(DecodeArgs, batch));
    let splits = arg::<U32>(k, args, offset_of!(DecodeArgs, splits));
    let first_part = k.setp(Cmp::Eq, part, 0u32);
    let single = k.setp(Cmp::Eq, splits, 1u32);
    let bh = k.mad(w.block.batch, heads_q, head);
    k.if_else(
        single,
        |k| {
            let o = arg::<U64>(k, args, offset_of!(DecodeArgs, o));
            let s = strides(k, args, offset_of!(DecodeArgs, o_stride));
            let e = queries.row(k, s, qi, head);
            let c = k.cvt_u64_u32(col0);
            let e = k.add(e, c);
            let e = k.shl(e, 1);
            let addr = k.add(o, e);
            // A padded kernel: the columns left to the head dim from this thread's first.
            let left = head_dim.map(|p| {
                let d = k.load_param(p);
                k.sub(d.cast::<S32>(), col0.cast::<S32>())
            });
            for (i, pair) in acc.chunks(2).enumerate() {
                let word = k.pack_half2::<H>(pair[0], pair[1]);
                match left {
                    Some(left) => {
                        let inside = k.setp(Cmp::Gt, left, (2 * i) as i32);
                        k.guarded(inside, true, |k| k.st_global(addr, (4 * i) as i32, word));
                    }
                    None => k.st_global(addr, (4 * i) as i32, word),
                }
            }
            let lse_ptr = arg::<U64>(k, args, offset_of!(DecodeArgs, lse));
            let wanted = k.setp(Cmp::Ne, lse_ptr, 0u64);
            let wanted = k.and_pred(wanted, first_part);
            // [B, Hq, Sq]; packed, [Hq, total_q] at the sequence's first row.
            let index = match queries.start {
                Some(start) => {
                    let total_q = arg::<U32>(k, args, offset_of!(DecodeArgs, total_q));
                    let row = k.add(start, qi);
                    let index = k.mul_wide_u32(head, total_q);
                    let row = k.cvt_u64_u32(row);
                    k.add(index, row)
                }
                None => {
                    let index = k.mul_wide_u32(bh, seqlen_q);
                    let q64 = k.cvt_u64_u32(qi);
                    k.add(index, q64)
                }
            };
            let index = k.shl(index, 2);
            let at = k.add(lse_ptr, index);
            k.guarded(wanted, true, |k| k.st_global(at, 0, lse));
        },
        |k| {
            // o_part[split][b][qi][head][:], lse_part[split][b][head][qi].
            let sb = k.mad(w.block.split, batch, w.block.batch);
            let sbq = k.mul_wide_u32(sb, seqlen_q);
            let q64 = k.cvt_u64_u32(qi);
            let sbq = k.add(sbq, q64);
            let hq = k.cvt_u64_u32(heads_q);
            let h64 = k.cvt_u64_u32(head);
            let rowi = k.mad(sbq, hq, h64);
            let e = k.mul(rowi, d as u64);
            let c = k.cvt_u64_u32(col0);
            let e = k.add(e, c);
            let e = k.shl(e, 2);
            let o_part = arg::<U64>(k, args, offset_of!(DecodeArgs, o_part));
            let addr = k.add(o_part, e);
            for (i, quad) in acc.chunks(4).enumerate() {
                k.st_global_v4::<F32>(addr, (16 * i) as i32, [quad[0], quad[1], quad[2], quad[3]]);
            }
            let sbh = k.mul_wide_u32(sb, heads_q);
            let sbh = k.add(sbh, h64);
            let sq = k.cvt_u64_u32(seqlen_q);
            let index = k.mad(sbh, sq, q64);
            let index = k.shl(index, 2);
            let lse_part = arg::<U64>(k, args, offset_of!(DecodeArgs, lse_part));
            let at = k.add(lse_part, index);
            k.guarded(first_part, true, |k| k.st_global(at, 0, lse));
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packed queries cost the kernels that take them only: the others' PTX reads no
    /// query offsets (it is what it was before packed queries over a cache existed).
    #[test]
    fn only_kernels_of_packed_queries_read_query_offsets() {
        for c in all_decode_configs() {
            let ptx = c.generate().unwrap().to_ptx();
            let reads = ptx.contains(QUERY_OFFSETS);
            assert_eq!(reads, c.queries_packed(), "{}", c.id());
            assert_eq!(ptx.contains("has nothing to do"), reads, "{}", c.id());
        }
    }

    #[test]
    fn paged_kernels_never_wait_on_the_block_table_inside_the_loop() {
        for c in all_decode_configs().into_iter().filter(|c| c.paged) {
            let ptx = c.generate().unwrap().to_ptx();
            let fill = ptx.find("Fill the ring").unwrap();
            let loop_start = fill + ptx[fill..].find("cp.async.wait_group").unwrap();
            // The loop reads the table only through the ring: 4-byte copies in the same
            // groups as the data, looked up in shared memory. (What follows it, the
            // epilogue, reads packed queries' offsets again: two loads each.)
            let inside = &ptx[loop_start..];
            let offsets = |text: &str| 2 * text.matches(QUERY_OFFSETS).count();
            assert_eq!(
                inside.matches("ld.global").count(),
                offsets(inside),
                "{}",
                c.id()
            );
            assert!(inside.contains("cp.async.ca.shared.global"), "{}", c.id());
            // The fill's entries come through shared memory too: the kernel's one global
            // load besides query offsets is the length; the entries are copied first, in a
            // group of their own (before Q's), and waited for once before the fill.
            let loads = ptx.matches("ld.global").count();
            assert_eq!(loads, 1 + offsets(&ptx), "{}", c.id());
            let before = &ptx[..fill];
            assert_eq!(
                before.matches("cp.async.wait_group").count(),
                1,
                "{}",
                c.id()
            );
            let first_group = &before[..before.find("cp.async.commit_group").unwrap()];
            assert!(!first_group.contains("cp.async.cg"), "{}", c.id());
            assert_eq!(
                first_group.matches("cp.async.ca.shared.global").count(),
                c.stages as usize - 1,
                "{}",
                c.id()
            );
        }
    }

    #[test]
    fn the_first_tile_is_issued_before_the_length_is_used() {
        // (A packed kernel's first tile needs its sequence's offsets.)
        for c in all_decode_configs().into_iter().filter(|c| !c.packed) {
            let ptx = c.generate().unwrap().to_ptx();
            // The length is the kernel's first global load.
            let at = ptx.find("ld.global.b32 ").unwrap();
            let line = &ptx[at..at + ptx[at..].find('\n').unwrap()];
            let reg = line["ld.global.b32 ".len()..].split(',').next().unwrap();
            // Tile 0's group: from the fill's start to its first commit.
            let fill = ptx.find("Fill the ring").unwrap();
            let tile0 = fill + ptx[fill..].find("cp.async.commit_group").unwrap();
            let before = &ptx[at + line.len()..tile0];
            assert!(before.contains("cp.async.cg.shared.global"), "{}", c.id());
            // A call with a key window waits for the length in a branch of its own
            // (which tiles come first depends on it); the others pass that branch by.
            let window = before.find("A key window").expect("the window's branch");
            let branch_end = window + before[window..].find("\n$L_").unwrap();
            let before = format!("{}{}", &before[..window], &before[branch_end..]);
            let uses = before.match_indices(reg).filter(|(i, _)| {
                let next = before[i + reg.len()..].chars().next();
                !next.is_some_and(|ch| ch.is_ascii_digit())
            });
            assert_eq!(
                uses.count(),
                0,
                "{}: {reg} read before tile 0 is issued",
                c.id()
            );
            // Once known, a length that cuts tile 0 zeroes its rows past the end.
            assert!(
                ptx[tile0..].contains("Tile 0 past the length"),
                "{}",
                c.id()
            );
            assert!(ptx.contains("st.shared.v4.b32"), "{}", c.id());
        }
    }

    /// Every multiple of 8 up to 256 has a 16-bit-cache kernel (80 on the padded 96
    /// one); an e4m3 cache only its three; nothing else has one.
    #[test]
    fn head_dims_map_onto_listed_kernels() {
        let listed = all_decode_configs();
        for d in (8..=256).step_by(8) {
            let (kd, padded) = kernel_head_dim(d, false).unwrap();
            assert!(kd as usize >= d && padded == (kd as usize != d), "{d}");
            for layout in [
                DecodeLayout::Contiguous,
                DecodeLayout::Paged,
                DecodeLayout::Packed,
            ] {
                for c in DecodeConfig::candidates(HalfType::Bf16, (kd, padded), layout, false) {
                    assert!(listed.contains(&c), "{d}: {}", c.id());
                }
            }
        }
        assert_eq!(kernel_head_dim(80, false), Some((96, true)));
        assert_eq!(kernel_head_dim(136, false), Some((192, true)));
        assert_eq!(kernel_head_dim(96, false), Some((96, false)));
        for d in [0, 4, 84, 264, 1 << 40] {
            assert_eq!(kernel_head_dim(d, false), None, "{d}");
        }
        for d in (8..=256).step_by(8) {
            let fp8 = FP8_HEAD_DIMS.contains(&(d as u32));
            assert_eq!(kernel_head_dim(d, true), fp8.then_some((d as u32, false)));
        }
        assert!(listed.iter().all(|c| !(c.fp8 && c.padded)));
    }

    /// A padded kernel takes the cache's head dim as a second parameter and checks each
    /// column block of every copy against it (zero-filling those past it) and each pair
    /// of O's columns before storing it; the same copies and stores as the unpadded
    /// kernel of its shape, which has none of that.
    #[test]
    fn padded_kernels_check_their_columns() {
        let count = |ptx: &str, what: &str| ptx.matches(what).count();
        let mut seen = 0;
        for cfg in all_decode_configs().into_iter().filter(|c| c.padded) {
            let id = cfg.id();
            let padded = cfg.generate().unwrap().to_ptx();
            let plain = DecodeConfig {
                padded: false,
                ..cfg
            }
            .generate()
            .unwrap()
            .to_ptx();
            assert!(padded.contains(".param .u32 head_dim"), "{id}");
            assert!(!plain.contains(".param .u32 head_dim"), "{id}");
            for what in ["cp.async.cg.shared.global", "st.global"] {
                assert_eq!(count(&padded, what), count(&plain, what), "{id}: {what}");
            }
            // Q's copies and each pass of K's and V's: one check per column block.
            let blocks = cfg.kv_layout().col_blocks() as usize;
            let copies = count(&plain, "cp.async.cg.shared.global");
            assert!(
                count(&padded, "selp.b32") >= count(&plain, "selp.b32") + copies,
                "{id}"
            );
            assert!(copies % blocks == 0, "{id}");
            // Every 16-bit store of O (one split) under a guard.
            let words = (cfg.head_dim / (cfg.threads() / ROWS) / 2) as usize;
            let guarded = |ptx: &str| {
                ptx.lines()
                    .filter(|l| l.trim_start().starts_with('@') && l.contains("st.global.b32"))
                    .count()
            };
            assert_eq!(guarded(&padded), guarded(&plain) + words, "{id}");
            seen += 1;
        }
        // Five kernel head dims, two dtypes, contiguous, paged and packed and contiguous
        // and paged under packed queries, three rings each at 64, 96, 128 and 192 and
        // two at 256 (whose preferred ring has two stages).
        assert_eq!(seen, 140);
    }

    #[test]
    fn blocks_per_sm_follow_the_bytes_in_flight_and_fit_registers() {
        let cfg = |head_dim, stages, fp8| DecodeConfig {
            dtype: HalfType::F16,
            head_dim,
            paged: false,
            stages,
            warps: 4,
            fp8,
            padded: false,
            packed: false,
            packed_queries: false,
        };
        // 16-bit rings: 64 KiB in flight per SM. Head dim 128 (two 32 KiB stages in
        // flight) and 256 (one of 64 KiB) want one block per SM; head dim 64 (three of
        // 16 KiB) two; head dim 32 (three of 8 KiB) three.
        assert_eq!(cfg(128, 3, false).blocks_per_sm(), 1);
        assert_eq!(cfg(96, 4, false).blocks_per_sm(), 1);
        assert_eq!(cfg(64, 5, false).blocks_per_sm(), 1);
        assert_eq!(cfg(32, 9, false).blocks_per_sm(), 1);
        assert_eq!(cfg(192, 3, false).blocks_per_sm(), 1);
        assert_eq!(cfg(256, 2, false).blocks_per_sm(), 1);
        assert_eq!(cfg(64, 4, false).blocks_per_sm(), 2);
        assert_eq!(cfg(32, 4, false).blocks_per_sm(), 3);
        // e4m3 rings want every block that fits.
        assert_eq!(cfg(128, 3, true).blocks_per_sm(), 3);
        assert_eq!(cfg(256, 2, true).blocks_per_sm(), 2);
        for c in all_decode_configs() {
            let r = c.resident_blocks();
            assert!((1..=MAX_RESIDENT).contains(&r), "{}", c.id());
            assert!(r * (c.smem_bytes() + 1024) <= 228 * 1024, "{}", c.id());
            assert!(c.blocks_per_sm() <= r, "{}", c.id());
            // The kernel is built for that residency, so registers do not cut it.
            let ptx = c.generate().unwrap().to_ptx();
            assert!(ptx.contains(&format!(".minnctapersm {r}")), "{}", c.id());
        }
    }

    #[test]
    fn every_config_fits_and_keeps_its_tiles_atom_aligned() {
        for cfg in all_decode_configs() {
            let id = cfg.id();
            let (plan, slots) = cfg.plan();
            let (q, kt, vt) = (slots.q, slots.k, slots.v);
            let rb = kt.layout.block_bytes;
            assert!(q.layout.is_valid() && kt.layout.is_valid(), "{id}");
            // The warps' 16-key slices, the Q tile's column blocks and a pass of the
            // loader are whole 1024-byte swizzle atoms, so their offsets simply add.
            let rpp = cfg.threads() / (rb / 16);
            assert_eq!(WARP_KEYS * rb % 1024, 0, "{id}");
            assert_eq!(ROWS * rb % 1024, 0, "{id}");
            assert_eq!(rpp * rb % 1024, 0, "{id}");
            assert_eq!(kt.layout.rows % rpp, 0, "{id}: whole passes per stage");
            // The merge scratch fits from the start of the rings to the end of shared
            // memory, and each thread merges whole float4s.
            assert!(
                cfg.scratch_bytes() <= plan.bytes() - slots.scratch().offset,
                "{id}"
            );
            assert_eq!(
                cfg.merge_row_bytes() % 128,
                16,
                "{id}: rows a bank group apart"
            );
            assert_eq!((cfg.head_dim / (cfg.threads() / ROWS)) % 4, 0, "{id}");
            assert!(plan.bytes() <= 227 * 1024, "{id}");
            match &slots.codes {
                None => {
                    assert_eq!(kt.copies, cfg.stages, "{id}");
                    assert_eq!(vt.offset, kt.offset + kt.stride * cfg.stages, "{id}");
                }
                Some(codes) => {
                    // One widened tile each; code rows of whole 16-byte chunks, a
                    // power of two of them, whole passes of the ring's loader; the
                    // scale ring has one float per thread per stage.
                    assert_eq!((kt.copies, vt.copies), (1, 1), "{id}");
                    assert_eq!(codes.k.copies, cfg.stages, "{id}");
                    let row = codes.k.layout.block_bytes;
                    assert_eq!(row, cfg.head_dim, "{id}");
                    assert!((row / 16).is_power_of_two(), "{id}");
                    assert_eq!(cfg.block_n() % (cfg.threads() / (row / 16)), 0, "{id}");
                    assert_eq!(cfg.scale_stage_bytes(), cfg.threads() * 4, "{id}");
                    assert_eq!(codes.scales.bytes, cfg.stages * cfg.threads() * 4, "{id}");
                    // The widened tile's column blocks hold 64 elements (4 chunks of 16
                    // codes).
                    assert_eq!(kt.layout.block_cols(), 64, "{id}");
                }
            }
        }
        // Every head dim has a ring that fits the 99 KiB of sm_86/sm_89, and two blocks
        // of the preferred e4m3 ring fit an sm_90 SM at head dims 64 and 128.
        for d in HEAD_DIMS {
            let paged = DecodeLayout::Paged;
            let [.., last] = DecodeConfig::candidates(HalfType::F16, (d, false), paged, false);
            assert!(
                last.smem_bytes() <= 99 * 1024,
                "d{d}: {}",
                last.smem_bytes()
            );
        }
        for d in FP8_HEAD_DIMS {
            let paged = DecodeLayout::Paged;
            let [first, .., last] =
                DecodeConfig::candidates(HalfType::F16, (d, false), paged, true);
            assert!(
                last.smem_bytes() <= 99 * 1024,
                "d{d}: {}",
                last.smem_bytes()
            );
            if d <= 128 {
                assert!(2 * (first.smem_bytes() + 1024) <= 228 * 1024, "d{d}");
            }
        }
    }
}
