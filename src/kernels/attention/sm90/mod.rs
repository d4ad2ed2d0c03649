//! FlashAttention-3 style forward for Hopper (`.target sm_90a`): a TMA producer
//! warpgroup and two consumer warpgroups of 64 query rows each, taking turns at the
//! tensor cores. Grids that would leave SMs idle take a one-consumer variant with 64-row
//! query tiles instead (twice the blocks; no turns to take), see [`Shape::consumers`], or
//! at head dim 64 with long key ranges a variant whose two consumers share the 64 rows
//! and take alternate key tiles ([`Shape::split_keys`]).
//!
//! ```text
//! producer (warpgroup 0)                 consumer c (warpgroups 1, 2; rows 64c..64c+64)
//! load Q once                            wait Q
//! for n in (0..end).rev():               S = Q K[last]^T; mask; softmax -> P [left part]
//!     K ring: acquire, TMA K[n]          for n in (0..last).rev():  [masked, then unmasked]
//!     V ring: acquire, TMA V[n]              my turn:  S = Q K[n]^T             (wgmma SS)
//!                                                      O *= rescale; O += P V[n+1] (wgmma RS)
//!                                            other's turn (named barriers, ping-pong)
//!                                            wait S; release K[n]; [mask]; softmax(S)
//!                                                -> rescale, running sums    (overlaps P V)
//!                                            wait P V; release V[n+1]; P = S as f16/bf16
//!                                        O *= rescale; O += P V[0]; O /= l
//!                                        stmatrix O to shared memory, TMA store; LSE
//! ```
//!
//! On the causal diagonal a warp whose rows see none of the last tile's right half (the
//! first 64 rows of a 128-row item) runs that tile's softmax on the left half alone, and
//! a consumer warpgroup whose rows see none of the item's last tile passes it by (an
//! empty turn; its stages released unread, past a packed sequence's end its share of the
//! V rows zeroed first). Head dim 256 takes
//! 64-key tiles for short key ranges ([`FwdConfig::narrow_keys`]): they line up with the
//! warpgroups' rows, so the first warpgroup passes a whole tile of each diagonal item by.
//!
//! The softmax of tile n runs while the tensor cores multiply P·V of tile n+1 (the
//! intra-warpgroup overlap), and while one consumer warpgroup does its softmax the other
//! issues its products (ping-pong). Q, K and V arrive through 5-D tensor maps over
//! `[d/64 column blocks][seq][128 B]` boxes of the caller's strided tensors; sequence
//! tails arrive zero-filled (packed batches: as the rows that follow the sequence, whose
//! V rows the consumers zero before `P V`) and are masked. Keys are visited last to first, so the
//! tiles that need a mask (the sequence end, the causal diagonal) form a loop of their
//! own ahead of the unmasked ones.
//!
//! Windowed kernels ([`FwdConfig::window`], FlashAttention's `window_size`) are the causal
//! kernels with each work item's keys rebased to the first key tile its rows' windows
//! reach ([`windowed_keys`](super::mask::windowed_keys)), so the producer and the loops
//! above run unchanged over fewer tiles; the tiles that cut a row's window on the left
//! form a third, masked loop after the unmasked ones (every tile is masked at head dim
//! 256 with 80-key tiles, whose registers the third loop would spill; see
//! [`FwdConfig::masks_window_edges_only`]).
//!
//! O leaves through shared memory: each warp writes its 16 rows with `stmatrix` into a
//! staging tile laid out as Q's and one lane sends them out by TMA, which clips the rows
//! past the sequence end (direct stores of O took 3–9% of the time at S 2048). The
//! staging tile is O's own at d ≤ 128; at d = 192 and 256, where shared memory is full,
//! it is Q's tile, so Q is released after the store rather than after the last `Q Kᵀ` (see
//! [`Shape::o_in_q`]). Launches that cannot describe O to TMA (packed sequences, whose
//! boxes would cross into the next sequence, or views whose strides TMA refuses) pass no
//! map of O, and the epilogue stores it directly; a padded kernel's direct stores skip
//! the 8-column tiles past the tensors' head dim, its last parameter.
//!
//! The parts, in the order a block runs them: `shape.rs` (tiles, registers, shared
//! memory), `roles.rs` (warp specialization, the consumers' turns), `schedule.rs` (work
//! items), `producer.rs`, `consumer.rs` (the attention itself) and `exchange.rs` (split
//! keys).

mod consumer;
mod exchange;
mod producer;
mod roles;
mod schedule;
pub(super) mod shape;
#[cfg(test)]
mod tests;

pub(super) use consumer::advance;
use consumer::consume;
use producer::produce;
pub(super) use producer::produce_items;
use roles::Fwd;
pub(super) use roles::{ConsumerRoles, Rings, split_roles};
pub(super) use schedule::{Block, ItemLoop, Role, WindowTiles, WorkQueue, divisor};
pub use shape::{
    CONSUMER_REGS, D64_STAGES, MAX_SMEM, MapColumns, PRODUCER_REGS, SPLIT_STAGES, STAGES, Shape,
    Slots,
};

use super::{FwdArgs, FwdConfig, HalfType, Tiling};
use crate::ptx::{
    Bf16x2, F16x2, Half2, Kernel, KernelText, Module, N64, N80, N112, N128, N176, N192, N256,
    PtxError, Special, Target, U32, WgmmaInput, WgmmaN,
};

/// Query rows per block by default: two consumer warpgroups of 64.
pub const BLOCK_M: u32 = 128;
/// The query tiles this path has kernels for: two consumer warpgroups (128 rows), or one
/// (64 rows) for grids that would leave SMs idle (see [`Shape::consumers`]), or three
/// (192 rows) at head dim 64 ([`has_tile`]).
pub const BLOCK_MS: [u32; 3] = [BLOCK_M, 64, 192];

/// Whether there is a kernel for head dim `head_dim` with `block_m`-row query tiles, with
/// and without a causal mask: three consumer warpgroups leave each 160 registers, which
/// only head dim 64's O fits beside the scores. (The host's `sm90_block_m` decides where
/// each tile pays.)
pub fn has_tile(head_dim: u32, block_m: u32) -> bool {
    HEAD_DIMS.contains(&head_dim)
        && BLOCK_MS.contains(&block_m)
        && (block_m != 192 || head_dim == 64)
}

/// Whether there is a split-keys kernel (two consumer warpgroups on one 64-row query
/// tile, taking alternate key tiles; see [`Shape::split_keys`]) for head dim `head_dim`
/// and `block_m`-row tiles: at head dim 64, where its ring of [`SPLIT_STAGES`] K and V
/// stages fits in shared memory (at 128 it would take 256 KiB).
pub fn has_split(head_dim: u32, block_m: u32) -> bool {
    head_dim == 64 && block_m == 64
}

/// Whether there is a kernel with 64-key tiles ([`FwdConfig::narrow_keys`]) for head dim
/// `head_dim` and `block_m`-row tiles (and split keys or not): head dim 256 with two
/// consumer warpgroups, whose usual tiles are 80 keys.
pub fn has_narrow_keys(head_dim: u32, block_m: u32, split_keys: bool) -> bool {
    head_dim == 256 && block_m == BLOCK_M && !split_keys
}

/// Whether there is a padded kernel ([`FwdConfig::padded`]) for head dim `head_dim` with
/// `block_m`-row query tiles (and split keys or not): the two- and one-consumer kernels
/// of each head dim.
pub fn has_padded(head_dim: u32, block_m: u32, split_keys: bool) -> bool {
    has_tile(head_dim, block_m) && block_m != 192 && !split_keys
}

/// The kernel head dim of this path that serves a tensor head dim of `d`, and whether it
/// is padded ([`FwdConfig::padded`]), as [`super::padded_head_dim`] gives it for the sm80
/// path: `d` itself where [`HEAD_DIMS`] has it, else the smallest larger one for a
/// multiple of 8 up to 256 (8 to 56 on the 64 kernel, 72 to 120 on 128, 136 to 184 on
/// 192, 200 to 248 on 256). `None` for anything else.
pub fn padded_head_dim(d: usize) -> Option<(u32, bool)> {
    super::serving_head_dim(d, &HEAD_DIMS, &HEAD_DIMS)
}

/// Head dimensions this path has kernels for (the other multiples of 8 up to 256 run
/// padded on the next of them, see [`padded_head_dim`]).
pub const HEAD_DIMS: [u32; 4] = [64, 128, 192, 256];

pub(crate) fn tiling(cfg: &FwdConfig) -> Tiling {
    let s = Shape::of(cfg);
    Tiling {
        block_m: s.block_m,
        block_n: s.block_n,
        threads: s.threads(),
        smem_bytes: s.plan().0.bytes(),
    }
}

pub(crate) fn generate(cfg: &FwdConfig) -> Result<Module, PtxError> {
    let s = Shape::of(cfg);
    let exists = if s.split_keys {
        has_split(s.head_dim, s.block_m)
    } else {
        has_tile(s.head_dim, s.block_m)
    };
    if !exists {
        return Err(PtxError::BadOperand(format!(
            "no sm90 forward for head dim {} with {}-row query tiles{}",
            s.head_dim,
            s.block_m,
            if s.split_keys { " and split keys" } else { "" }
        )));
    }
    if cfg.padded && !has_padded(s.head_dim, s.block_m, s.split_keys) {
        return Err(PtxError::BadOperand(format!(
            "no padded sm90 forward for head dim {} with {}-row query tiles{}",
            s.head_dim,
            s.block_m,
            if s.split_keys { " and split keys" } else { "" }
        )));
    }
    if s.split_keys && cfg.fold_scale {
        return Err(PtxError::BadOperand(
            "the split-keys kernels merge raw maxima: no folded scale".into(),
        ));
    }
    let kernel = match (cfg.dtype, s.head_dim, s.block_n) {
        (HalfType::F16, 64, 128) => build::<F16x2, N128, N64>(cfg),
        (HalfType::Bf16, 64, 128) => build::<Bf16x2, N128, N64>(cfg),
        (HalfType::F16, 128, 128) => build::<F16x2, N128, N128>(cfg),
        (HalfType::Bf16, 128, 128) => build::<Bf16x2, N128, N128>(cfg),
        (HalfType::F16, 128, 176) => build::<F16x2, N176, N128>(cfg),
        (HalfType::Bf16, 128, 176) => build::<Bf16x2, N176, N128>(cfg),
        (HalfType::F16, 192, 112) => build::<F16x2, N112, N192>(cfg),
        (HalfType::Bf16, 192, 112) => build::<Bf16x2, N112, N192>(cfg),
        (HalfType::F16, 256, 80) => build::<F16x2, N80, N256>(cfg),
        (HalfType::Bf16, 256, 80) => build::<Bf16x2, N80, N256>(cfg),
        (HalfType::F16, 256, 64) => build::<F16x2, N64, N256>(cfg),
        (HalfType::Bf16, 256, 64) => build::<Bf16x2, N64, N256>(cfg),
        (_, d, n) => Err(PtxError::BadOperand(format!(
            "no sm90 forward for head dim {d} with {n}-key tiles"
        ))),
    }?;
    let mut m = Module::new(Target::Sm90a);
    m.push(kernel)?;
    Ok(m)
}

fn build<H, NS, NO>(cfg: &FwdConfig) -> Result<KernelText, PtxError>
where
    H: Half2 + WgmmaInput,
    NS: WgmmaN,
    NO: WgmmaN,
{
    let s = Shape::of(cfg);
    debug_assert_eq!((NS::N, NO::N), (s.block_n, s.head_dim));
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(s.threads()).min_blocks_per_sm(1);
    let args = k.param_bytes("args", FwdArgs::SIZE, 8);
    let maps = [
        k.tensor_map_param("tmap_q"),
        k.tensor_map_param("tmap_k"),
        k.tensor_map_param("tmap_v"),
        k.tensor_map_param("tmap_o"),
    ];
    let head_dim = cfg.padded.then(|| k.param::<U32>("head_dim"));
    let (plan, slots) = s.plan();
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);
    let f = Fwd {
        s,
        causal: cfg.causal,
        window: cfg.window.then_some(if cfg.masks_window_edges_only() {
            WindowTiles::EdgesOnly
        } else {
            WindowTiles::Every
        }),
        fold_scale: cfg.fold_scale,
        softcap: cfg.softcap,
        used_keys: cfg.reads_used_keys(),
        args,
        maps,
        head_dim,
        smem,
        slots,
    };
    // Every consumer warp releases Q; K and V stages only by the warps that used them.
    let rings = [
        (&f.slots.q_ring, s.consumers()),
        (&f.slots.k_ring, s.kv_consumers()),
        (&f.slots.v_ring, s.kv_consumers()),
    ];
    split_roles(
        &mut k,
        &f.smem,
        (rings, f.causal.then_some(&f.slots.work)),
        tid,
        |k| produce(k, &f, tid),
        |k| consume::<H, NS, NO>(k, &f, tid),
    );
    k.finish()
}
