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
//! first 64 rows of a 128-row item) runs that tile's softmax on the left half alone.
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
//! O leaves through shared memory: each warp writes its 16 rows with `stmatrix` into a
//! staging tile laid out as Q's and one lane sends them out by TMA, which clips the rows
//! past the sequence end (direct stores of O took 3–9% of the time at S 2048). The
//! staging tile is O's own at d ≤ 128; at d = 192 and 256, where shared memory is full,
//! it is Q's tile, so Q is released after the store rather than after the last `Q Kᵀ` (see
//! [`Shape::o_in_q`]). Launches that cannot describe O to TMA (packed sequences, whose
//! boxes would cross into the next sequence, or views whose strides TMA refuses) pass no
//! map of O, and the epilogue stores it directly; a padded kernel's direct stores skip
//! the 8-column tiles past the tensors' head dim, its last parameter.

use std::mem::offset_of;

use super::epilogue::{LseForm, OutputBlock, OutputStage, store_output_staged};
use super::mask::{KeyTiles, apply_mask, key_tiles, query_block, row_key_limit};
use super::rows::{Rows, Slab};
use super::sequence::{Sequence, sequence};
use super::softmax::{OnlineSoftmax, pack_probs_into, rescale_rows};
use super::{FwdArgs, FwdConfig, HalfType, Tiling};
use crate::ptx::{
    Acc, BarrierRing, Bf16x2, Cmp, F16x2, F32, Half2, InFlight, KMajor, Kernel, KernelText,
    Mbarrier, MnMajor, Module, N64, N80, N112, N128, N176, N192, N256, NamedBarrier, Param,
    ParamBytes, Pred, PtxError, RawSlot, Reg, RingBarriers, S32, ScaleD, Smem, SmemAddr, SmemDesc,
    SmemLayout, SmemPlan, Special, StageRing, Swizzle, Target, TileSlot, TmaDesc, U32, U64, WgmmaD,
    WgmmaInput, WgmmaN,
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

/// Registers per thread after reallocation: 128·40 + 256·232 = 64512 <= 65536 (but see
/// [`Shape::registers`]).
pub const PRODUCER_REGS: u32 = 40;
pub const CONSUMER_REGS: u32 = 232;
/// K and V stages in flight.
pub const STAGES: u32 = 2;
/// K and V stages at head dim 64, whose tiles are half as large: four, so that the
/// producer runs further ahead of the short per-tile work (on the H200, same call: B8
/// H32 S2048 causal 406.3–406.5 TFLOP/s against 401.4–401.5 with two, B16 H32 S1024
/// causal 335.2–335.6 against 329.7–329.9; without a mask level).
pub const D64_STAGES: u32 = 4;
/// K and V stages of the split-keys kernel: two per consumer warpgroup, so that each
/// one's next tile lands while it works on its current one.
pub const SPLIT_STAGES: u32 = 4;
/// Head dimensions this path has kernels for (the other multiples of 8 up to 256 run
/// padded on the next of them, see [`padded_head_dim`]).
pub const HEAD_DIMS: [u32; 4] = [64, 128, 192, 256];

/// The compile-time shape of one configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub head_dim: u32,
    /// Query rows per block: 64 per consumer warpgroup.
    pub block_m: u32,
    /// Keys per tile: the N of `S = Q Kᵀ` (and the K of `P V`).
    pub block_n: u32,
    /// Two consumer warpgroups share the block's 64 query rows: consumer `c` takes the
    /// key tiles at ring positions `c, c + 2, ...` (always the same two of the ring's
    /// four stages), taking turns at the tensor cores as the 128-row kernel's do, and the
    /// second hands its partial result (O, row maxima and sums) to the first through
    /// shared memory at the end ([`Exchange`]). For grids that leave SMs idle, where one
    /// warpgroup per SM cannot keep the tensor cores and the exponent units busy at
    /// once: two in turns can.
    pub split_keys: bool,
    /// How the tensor maps address a tile's 64-column blocks: through a dimension of
    /// their own, or one box per block where the tensors' head dim is below the kernel's
    /// ([`FwdConfig::padded`]).
    pub columns: MapColumns,
}

/// How an sm90a kernel's tensor maps of `[B, S, H, D]` tensors address the 64-column
/// blocks of a tile (which lands in shared memory as `[d/64][rows][128 B]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapColumns {
    /// The 5-D view `{64, seq, d/64, heads, batch}`: one box `{64, rows, d/64}` moves
    /// the whole tile.
    Blocked,
    /// The 5-D view `{D, seq, 1, heads, batch}` with the tensors' own head dim `D`,
    /// below the kernel's (a padded kernel): one box `{64, rows, 1}` per column block,
    /// at column `64·b`. Loads zero-fill the columns past `D` (they add nothing to
    /// `Q·Kᵀ` and make O's extra columns 0), stores clip them.
    PerBlock,
}

impl MapColumns {
    /// The coordinates of column block `block` of the tile whose first row is `row`, in
    /// head `head` of batch `batch` (the block's, then the column's, made here).
    pub fn coords(
        self,
        k: &mut Kernel,
        block: u32,
        [row, head, batch]: [Reg<S32>; 3],
    ) -> [Reg<S32>; 5] {
        let (cb, col) = match self {
            MapColumns::Blocked => (block as i32, 0),
            MapColumns::PerBlock => (0, 64 * block as i32),
        };
        let cb = k.mov::<S32>(cb);
        let col = k.mov::<S32>(col);
        [col, row, cb, head, batch]
    }

    /// Loads the tile at `row` of `head`/`batch` through `map` into `at` (laid out as
    /// `layout`), completing on `full`: one TMA, or one per column block. `zero` holds 0.
    pub fn load_tile(
        self,
        k: &mut Kernel,
        (at, layout): (SmemAddr, &SmemLayout),
        map: TmaDesc,
        ([row, head, batch], zero): ([Reg<S32>; 3], Reg<S32>),
        full: Mbarrier,
    ) {
        match self {
            MapColumns::Blocked => k.tma_load(at, map, [zero, row, zero, head, batch], full),
            MapColumns::PerBlock => {
                for block in 0..layout.col_blocks() {
                    let dst = match block {
                        0 => at,
                        b => k.smem_offset(at, b * layout.rows * layout.block_bytes),
                    };
                    let col = k.mov::<S32>(64 * block as i32);
                    k.tma_load(dst, map, [col, row, zero, head, batch], full);
                }
            }
        }
    }
}

/// Where everything lives in shared memory.
#[derive(Debug, Clone, Copy)]
pub struct Slots {
    pub q: TileSlot,
    pub k: TileSlot,
    pub v: TileSlot,
    /// Q is a one-stage ring: the producer loads the next work item's Q as soon as the
    /// consumers have issued their last `Q Kᵀ` of the current one (or, where O is staged
    /// in Q's tile, once O has left it).
    pub q_ring: RingBarriers,
    pub k_ring: RingBarriers,
    pub v_ring: RingBarriers,
    pub work: WorkQueue,
    /// Where O is staged for its TMA store: a tile of its own, or Q's (see
    /// [`Shape::o_in_q`]).
    pub o: TileSlot,
    /// Split keys: where the second consumer leaves its partial result for the first
    /// (see [`Exchange`]).
    pub exchange: Option<RawSlot>,
}

/// The dynamic shared memory a block may have on sm_90.
pub const MAX_SMEM: u32 = 227 * 1024;

impl Shape {
    /// Keys per tile by head dimension: as many as the registers (S takes `block_n / 2`
    /// per thread beside O's `d / 2`) and shared memory (2 stages of K and V beside Q)
    /// allow.
    pub fn of(cfg: &FwdConfig) -> Shape {
        // (176-key tiles for d128, FlashAttention-3's choice, measured 6% slower here at
        // B8 H16 S2048: 579.7 against 614.2 TFLOP/s, 2026-11-22.)
        let block_n = match cfg.head_dim {
            64 | 128 => 128,
            // d192: 112-key tiles, the most that fit two K and two V stages beside Q
            // (O staged in Q's tile); 96 measured level (H100, same call: D192 B2 H16
            // S8192 721.3 / 728.6 TFLOP/s full / causal with 112, 723.1 / 733.4 with 96;
            // D160 on it 598.4 / 660.1 against 589.5 / 650.0 without a mask).
            192 => 112,
            _ => 80,
        };
        Shape {
            head_dim: cfg.head_dim,
            block_m: cfg.block_m,
            block_n,
            split_keys: cfg.split_keys,
            columns: if cfg.padded {
                MapColumns::PerBlock
            } else {
                MapColumns::Blocked
            },
        }
    }

    /// Consumer warpgroups, 64 query rows each. Two take turns at the tensor cores
    /// (ping-pong), so one's softmax hides behind the other's products. One, with half
    /// the rows per block, doubles the blocks of a problem whose wide grid leaves SMs
    /// idle: each block's chain of tiles is as long, but its warpgroup has the SM's tensor
    /// cores and exponent units to itself.
    pub fn consumers(&self) -> u32 {
        if self.split_keys {
            2
        } else {
            self.block_m / 64
        }
    }

    /// One exponential in how many the folded softmax sends to the FMA pipe
    /// ([`OnlineSoftmax::with_fma_exps`]; 0: none). One in 32 for three consumer
    /// warpgroups (head dim 64, 192-row tiles), whose softmax shares each SM's exponent
    /// units three ways: 2–4% faster from S 2048 without a mask, causal level. The
    /// other kernels measured level (64-row tiles) or 1–2% slower (128-row tiles).
    pub fn fma_exp_every(&self) -> usize {
        if self.consumers() == 3 { 32 } else { 0 }
    }

    /// K and V stages in the rings.
    pub fn stages(&self) -> u32 {
        if self.split_keys {
            SPLIT_STAGES
        } else if self.head_dim == 64 {
            D64_STAGES
        } else {
            STAGES
        }
    }

    /// The consumer warpgroups that use each K and V stage: all of them, or with split
    /// keys only the one whose turn of the ring it is.
    pub fn kv_consumers(&self) -> u32 {
        if self.split_keys { 1 } else { self.consumers() }
    }

    /// A producer warpgroup and the consumers.
    pub fn threads(&self) -> u32 {
        128 * (1 + self.consumers())
    }

    pub fn q_layout(&self) -> SmemLayout {
        SmemLayout::new(self.block_m, self.head_dim, 2, Swizzle::B128)
    }

    pub fn kv_layout(&self) -> SmemLayout {
        SmemLayout::new(self.block_n, self.head_dim, 2, Swizzle::B128)
    }

    /// Registers per producer and per consumer thread. At d = 192 and 256 the consumers
    /// take 8 more (128·24 + 256·240 = 64512, the FP8 kernels' split): at 256, O's 128
    /// beside S and P spilled 80 bytes in the key loop once the epilogue issued TMA
    /// stores. The producer's one thread fits in 24.
    pub fn registers(&self) -> (u32, u32) {
        match (self.consumers(), self.head_dim) {
            // 128·24 + 384·160 = 64512.
            (3, _) => (24, 160),
            (_, 192 | 256) => (24, 240),
            _ => (PRODUCER_REGS, CONSUMER_REGS),
        }
    }

    /// O's staging tile: as Q's, `BLOCK_M × d` 16-bit elements in 64-column blocks.
    pub fn o_layout(&self) -> SmemLayout {
        self.q_layout()
    }

    /// O is staged in Q's tile when a tile of its own does not fit beside the rings
    /// (d = 192 and 256). Q's tile is then free only once O has left it, so the next work
    /// item's Q loads after the epilogue rather than beside it.
    pub fn o_in_q(&self) -> bool {
        self.plan_with(false).0.bytes() > MAX_SMEM
    }

    pub fn plan(&self) -> (SmemPlan, Slots) {
        self.plan_with(self.o_in_q())
    }

    fn plan_with(&self, o_in_q: bool) -> (SmemPlan, Slots) {
        let mut plan = SmemPlan::new();
        let q = plan.tile(self.q_layout(), 1);
        let slots = Slots {
            q,
            k: plan.tile(self.kv_layout(), self.stages()),
            v: plan.tile(self.kv_layout(), self.stages()),
            q_ring: RingBarriers::plan(&mut plan, 1),
            k_ring: RingBarriers::plan(&mut plan, self.stages()),
            v_ring: RingBarriers::plan(&mut plan, self.stages()),
            work: WorkQueue::plan(&mut plan, 128 * self.consumers()),
            o: if o_in_q {
                q
            } else {
                plan.tile(self.o_layout(), 1)
            },
            exchange: self
                .split_keys
                .then(|| plan.raw(Exchange::bytes(self.head_dim), 16)),
        };
        (plan, slots)
    }
}

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
        (_, d, n) => Err(PtxError::BadOperand(format!(
            "no sm90 forward for head dim {d} with {n}-key tiles"
        ))),
    }?;
    let mut m = Module::new(Target::Sm90a);
    m.push(kernel)?;
    Ok(m)
}

/// A work item's coordinates and the parameters every role reads (shared with the FP8
/// kernel, [`super::sm90_fp8`]).
pub(super) struct Block {
    pub batch: Reg<U32>,
    pub head: Reg<U32>,
    /// The query tile's first row, counted from its sequence's first.
    pub m_start: Reg<S32>,
    pub seq: Sequence,
    pub causal_offset: Reg<S32>,
    pub tiles: KeyTiles,
}

/// What the roles share: parameters, shared memory, the kernel's shape.
struct Fwd {
    s: Shape,
    causal: bool,
    /// The scale folded into the exponent ([`FwdConfig::fold_scale`]).
    fold_scale: bool,
    args: ParamBytes,
    /// Q, K, V and O.
    maps: [TmaDesc; 4],
    /// A padded kernel's last parameter: the tensors' head dim, below the kernel's. O's
    /// TMA store clips the columns past it; the direct stores (packed batches, or an O
    /// that TMA cannot describe) check them.
    head_dim: Option<Param<U32>>,
    smem: Smem,
    slots: Slots,
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
        fold_scale: cfg.fold_scale,
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

/// The warp-specialized frame of the sm90a forwards (16-bit and FP8): thread 0
/// initialises the Q, K and V rings' barriers (FULL: the producer's arrival plus the
/// bytes; EMPTY: one arrival per warp of the number of consumer warpgroups paired with
/// the ring) and the work queue's (causal kernels) while the block waits, then warpgroup
/// 0 runs `produce` and the consumer warpgroups `consume`.
pub(super) fn split_roles(
    k: &mut Kernel,
    smem: &Smem,
    (rings, work): ([(&RingBarriers, u32); 3], Option<&WorkQueue>),
    tid: Reg<U32>,
    produce: impl FnOnce(&mut Kernel),
    consume: impl FnOnce(&mut Kernel),
) {
    k.comment("One thread initialises the barriers; everyone waits for it.");
    let first = k.setp(Cmp::Eq, tid, 0u32);
    k.if_(first, |k| {
        for (ring, consumers) in rings {
            ring.init(k, smem, 1, 4 * consumers);
        }
        if let Some(work) = work {
            work.init(k, smem);
        }
    });
    k.sync_threads();
    let warpgroup = k.shr(tid, 7);
    let producer = k.setp(Cmp::Eq, warpgroup, 0u32);
    k.if_else(producer, produce, consume);
}

impl Fwd {
    fn for_each_item(&self, k: &mut Kernel, role: Role, body: impl FnOnce(&mut Kernel, &Block)) {
        let queue = (&self.slots.work, self.smem, role);
        let tile = (self.s.block_m, self.s.block_n);
        for_each_item(k, self.args, queue, self.causal, tile, body);
    }
}

/// A causal kernel's work items, handed from the producer to the consumers through shared
/// memory: a 2-stage ring of one item index each. The producer decides the order (a fixed
/// stride, or a counter shared by the grid), so every role sees the same items.
#[derive(Debug, Clone, Copy)]
pub struct WorkQueue {
    ring: RingBarriers,
    items: RawSlot,
    /// The consumer threads, each of which releases every item it takes.
    consumer_threads: u32,
}

impl WorkQueue {
    const STAGES: u32 = 2;

    pub fn plan(plan: &mut SmemPlan, consumer_threads: u32) -> WorkQueue {
        WorkQueue {
            ring: RingBarriers::plan(plan, Self::STAGES),
            items: plan.raw(4 * Self::STAGES, 4),
            consumer_threads,
        }
    }

    /// FULL: the producer's one arrival; EMPTY: every consumer thread's, each after its
    /// own read of the item.
    fn init(&self, k: &mut Kernel, smem: &Smem) {
        self.ring.init(k, smem, 1, self.consumer_threads);
    }

    fn slot(&self, k: &mut Kernel, smem: Smem, ring: &StageRing) -> SmemAddr {
        let base = smem.raw(k, self.items);
        let at = k.shl(ring.stage(), 2);
        k.smem_offset(base, at)
    }
}

/// Which end of the [`WorkQueue`] a role holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Picks the items and publishes them (one thread).
    Producer,
    /// Takes them (every consumer thread).
    Consumer,
}

/// The persistent loop of the sm90a kernels. Work items are the
/// `q_blocks · heads · batch` (query tile of `block_m` rows, head, batch) triples (sizes
/// read from the [`FwdArgs`] at the start of `args`), visited with `block_n`-key tiles,
/// numbered head by head so that the blocks running at once share a few heads and each
/// head's K and V come from HBM once and then from L2 (taking one query tile of many heads
/// instead re-read every head's K and V once per query tile: B8 H16 S2048 D128 ran 20%
/// slower).
///
/// Without a mask the items cost the same, and every role steps through them by the grid
/// size on its own. With causal masking they do not (a query tile sees keys up to its
/// diagonal), so the producer picks them and hands them to the consumers through the
/// [`WorkQueue`]: item `blockIdx.x` first, then, when the launch passes a tile counter
/// (zeroed), `gridDim.x` plus a ticket from that counter, so the next item goes to
/// whichever block frees up first (without one, `item + gridDim.x`); finally one past the
/// end, which stops the consumers. Each head's heaviest query tiles (the last ones) come
/// first, and the last `tail_heads` heads are taken query tile by query tile across those
/// heads, heaviest first, so that the items left at the end of the grid are the lightest.
pub(super) fn for_each_item(
    k: &mut Kernel,
    args: ParamBytes,
    (queue, smem, role): (&WorkQueue, Smem, Role),
    causal: bool,
    tile: (u32, u32),
    body: impl FnOnce(&mut Kernel, &Block),
) {
    let arg = |k: &mut Kernel, off| k.load_param_at::<U32>(args, off);
    let q_blocks = arg(k, offset_of!(FwdArgs, q_blocks));
    let heads = arg(k, offset_of!(FwdArgs, heads_q));
    let batch = arg(k, offset_of!(FwdArgs, batch));
    let head_batches = k.mul(heads, batch);
    let items = k.mul(head_batches, q_blocks);
    if !causal {
        k.for_grid_stride(items.cast::<S32>(), |k, item| {
            let b = item_block(k, args, false, tile, item.cast(), [q_blocks, heads]);
            body(k, &b);
        });
        return;
    }
    let item = k.reg::<U32>();
    match role {
        Role::Producer => {
            let mut ring = queue.ring.producer(k, smem);
            let counter = k.load_param_at::<U64>(args, offset_of!(FwdArgs, tile_counter));
            let shared = k.setp(Cmp::Ne, counter, 0u64);
            let grid = k.special(Special::NctaidX);
            let publish = |k: &mut Kernel, ring: &mut StageRing, item: Reg<U32>| {
                ring.acquire(k);
                let at = queue.slot(k, smem, ring);
                k.st_shared::<U32>(at, 0, item);
                ring.arrive_full(k);
                ring.advance(k);
            };
            let first = k.special(Special::CtaidX);
            k.mov_to(item, first);
            publish(k, &mut ring, item);
            let more = |k: &mut Kernel| k.setp(Cmp::Lt, item, items);
            k.while_(more, |k| {
                let b = item_block(k, args, causal, tile, item, [q_blocks, heads]);
                body(k, &b);
                // The ticket is taken once this item's loads are issued; its latency
                // hides behind the consumers' last tiles.
                let next = k.add(item, grid);
                k.if_(shared, |k| {
                    let ticket = k.atom_global_add_u32(counter, 0, 1u32);
                    k.add_to(next, ticket, grid);
                });
                k.mov_to(item, next);
                publish(k, &mut ring, item);
            });
        }
        Role::Consumer => {
            let mut ring = queue.ring.consumer(k, smem);
            let take = |k: &mut Kernel, ring: &mut StageRing| {
                ring.wait_full(k);
                let at = queue.slot(k, smem, ring);
                let taken = k.ld_shared::<U32>(at, 0);
                k.mov_to(item, taken);
                ring.release(k);
                ring.advance(k);
            };
            take(k, &mut ring);
            let more = |k: &mut Kernel| k.setp(Cmp::Lt, item, items);
            k.while_(more, |k| {
                let b = item_block(k, args, causal, tile, item, [q_blocks, heads]);
                body(k, &b);
                take(k, &mut ring);
            });
        }
    }
}

/// The (query tile, head, batch) of work item `item`: head-batch-major with each head's
/// query tiles in a row, except, with causal masking, the last `tail_heads` head-batches,
/// which are query-tile-major (see [`for_each_item`]).
fn item_block(
    k: &mut Kernel,
    args: ParamBytes,
    causal: bool,
    (block_m, block_n): (u32, u32),
    item: Reg<U32>,
    [q_blocks, heads]: [Reg<U32>; 2],
) -> Block {
    let mut m_index = k.rem(item, q_blocks);
    let mut hb = k.div(item, q_blocks);
    if causal {
        let tail = k.load_param_at::<U32>(args, offset_of!(FwdArgs, tail_heads));
        let batch = k.load_param_at::<U32>(args, offset_of!(FwdArgs, batch));
        let head_batches = k.mul(heads, batch);
        let lead = k.sub(head_batches, tail);
        let lead_items = k.mul(lead, q_blocks);
        let in_lead = k.setp(Cmp::Lt, item, lead_items);
        let past = k.sub(item, lead_items);
        let across = k.max(tail, 1u32);
        let m_tail = k.div(past, across);
        let hb_tail = k.rem(past, across);
        let hb_tail = k.add(hb_tail, lead);
        m_index = k.selp(m_index, m_tail, in_lead);
        hb = k.selp(hb, hb_tail, in_lead);
    }
    let head = k.rem(hb, heads);
    let b = k.div(hb, heads);
    let m_block = query_block(k, m_index, q_blocks, causal);
    let m_start = k.mul(m_block.cast::<S32>(), block_m as i32);
    let seq = sequence(k, args, b);
    let causal_offset = seq.causal_offset(k);
    let mask = causal.then_some(causal_offset);
    let (sq, sk) = (seq.seqlen_q, seq.seqlen_k);
    let tiles = key_tiles(k, sq, sk, m_start, block_m, block_n, mask);
    Block {
        batch: b,
        head,
        m_start,
        seq,
        causal_offset,
        tiles,
    }
}

/// What a consumer warpgroup thread knows about itself: which consumer warpgroup it is
/// in, its lane's role, its accumulator rows, and (with several consumer warpgroups) the
/// named-barrier ring they take turns at the tensor cores with.
#[derive(Clone, Copy)]
pub(super) struct ConsumerRoles {
    /// Which consumer warpgroup, from 0 (see [`ConsumerRoles::which`]).
    which: Reg<U32>,
    /// The warpgroup whose turn follows this one's, where it is kept (two consumers).
    next: Option<Reg<U32>>,
    /// The consumers have no register to spare (three of them get 160 each): what can
    /// be derived again where it is used (the warpgroup index, the next turn, Q's
    /// descriptor) is, instead of being held through the key loop.
    pub lean: bool,
    /// Lane 0 of each warp: it arrives on EMPTY barriers for its warp.
    pub leader: Reg<crate::ptx::Pred>,
    pub rows: Rows,
    /// The turns, one barrier per warpgroup; none with a single consumer warpgroup,
    /// which has the tensor cores to itself, or where the kernel takes no turns.
    pub turns: Option<BarrierRing>,
    /// The consumer warpgroups hold the same query rows (split keys).
    shared_rows: bool,
}

impl ConsumerRoles {
    /// The roles of thread `tid` (from 128) of one of `consumers` warpgroups, after
    /// raising its registers to `regs`. With `turns` (and several consumers) they take
    /// turns at the tensor cores, the first warpgroup first (the last one lets it go);
    /// without, [`Self::wait_turn`] and [`Self::pass_turn`] emit nothing. With
    /// `shared_rows` (split keys) every warpgroup holds the block's 64 rows.
    pub fn new(
        k: &mut Kernel,
        tid: Reg<U32>,
        regs: u32,
        (consumers, turns): (u32, bool),
        shared_rows: bool,
    ) -> ConsumerRoles {
        k.setmaxnreg_inc(regs);
        let ct = k.sub(tid, 128u32);
        let which = k.shr(ct, 7);
        let lean = consumers > 2;
        let next = (consumers == 2).then(|| k.xor(which, 1u32));
        let in_wg = k.and(ct, 127u32);
        let warp = k.shr(in_wg, 5);
        let lane = k.and(ct, 31u32);
        let leader = k.setp(Cmp::Eq, lane, 0u32);
        let warp_row0 = if shared_rows {
            k.mul(warp, 16u32)
        } else {
            let first = k.mul(which, 64u32);
            k.mad(warp, 16u32, first)
        };
        let rows = Rows::new(k, lane, warp_row0);
        let turns = (turns && consumers > 1).then(|| {
            let turns = k.named_barrier_ring(consumers, 256);
            let last = k.setp(Cmp::Eq, which, consumers - 1);
            k.if_(last, |k| k.bar_arrive(turns.member(0)));
            turns
        });
        ConsumerRoles {
            which,
            next,
            lean,
            leader,
            rows,
            turns,
            shared_rows,
        }
    }

    /// Which consumer warpgroup this is: read again from `%tid.x` when [`Self::lean`].
    fn which(&self, k: &mut Kernel) -> Reg<U32> {
        if !self.lean {
            return self.which;
        }
        let tid = k.special(Special::TidX);
        let ct = k.sub(tid, 128u32);
        k.shr(ct, 7)
    }

    /// Waits for this warpgroup's turn at the tensor cores (ping-pong).
    pub fn wait_turn(&self, k: &mut Kernel) {
        if let Some(turns) = self.turns {
            let which = self.which(k);
            k.bar_wait_member(turns, which);
        }
    }

    /// Hands the tensor cores to the next warpgroup once this one's products are issued.
    pub fn pass_turn(&self, k: &mut Kernel) {
        if let Some(turns) = self.turns {
            let next = self.next.unwrap_or_else(|| {
                let which = self.which(k);
                let up = k.add(which, 1u32);
                let wraps = k.setp(Cmp::Eq, up, turns.len());
                let zero = k.mov::<U32>(0u32);
                k.selp(zero, up, wraps)
            });
            k.bar_arrive_member(turns, next);
        }
    }

    /// The warp's part of the block's O staging tile `tile`, sent out through `map`
    /// (`shared`: see [`OutputStage::shared`]).
    pub fn output_stage(
        &self,
        smem: Smem,
        tile: TileSlot,
        (map, columns): (TmaDesc, MapColumns),
        shared: bool,
    ) -> OutputStage {
        OutputStage {
            smem,
            tile,
            map,
            columns,
            leader: self.leader,
            first_thread: 128,
            shared,
        }
    }

    /// Whether the launch passed a map of O (dense O that TMA can describe): the
    /// epilogue stores through it, else directly.
    pub fn o_by_tma(k: &mut Kernel, args: ParamBytes) -> Reg<crate::ptx::Pred> {
        let flag = k.load_param_at::<U32>(args, offset_of!(FwdArgs, o_by_tma));
        k.setp(Cmp::Ne, flag, 0u32)
    }

    /// This warpgroup's 64 rows of the Q tile at `q` (stored in `layout`).
    pub fn q_rows(&self, k: &mut Kernel, q: SmemAddr, layout: &SmemLayout) -> SmemDesc<KMajor> {
        if self.shared_rows {
            return k.smem_desc::<KMajor>(q, layout);
        }
        let which = self.which(k);
        let q_rows = k.mul(which, layout.logical_offset(64, 0));
        let q_at = k.smem_offset(q, q_rows);
        k.smem_desc::<KMajor>(q_at, layout)
    }

    /// Lane 0 of each warp releases the ring's current stage; all move on.
    pub fn release(&self, k: &mut Kernel, ring: &mut StageRing) {
        k.guarded(self.leader, true, |k| ring.release(k));
        ring.advance(k);
    }
}

/// Warpgroup 0: one elected thread loads each work item's Q and streams its K and V,
/// last tile first; the other producer warps only hand their registers back.
fn produce(k: &mut Kernel, f: &Fwd, tid: Reg<U32>) {
    k.comment("Producer: TMA loads of Q, then K and V tiles, into their rings.");
    k.setmaxnreg_dec(f.s.registers().0);
    k.elected_thread_of_warp_0(tid, |k| {
        // Fetch the load descriptors now rather than on the first load of each.
        for map in &f.maps[..3] {
            k.tma_prefetch_desc(*map);
        }
        let group = k.load_param_at::<U32>(f.args, offset_of!(FwdArgs, group));
        let zero = k.mov::<S32>(0i32);
        let mut qr = f.slots.q_ring.producer(k, f.smem);
        let mut kr = f.slots.k_ring.producer(k, f.smem);
        let mut vr = f.slots.v_ring.producer(k, f.smem);
        f.for_each_item(k, Role::Producer, |k, b| {
            let any = k.setp(Cmp::Gt, b.tiles.end, 0i32);
            k.if_(any, |k| {
                let kv_head = k.div(b.head, group).cast::<S32>();
                let batch = b.seq.tensor_batch.cast::<S32>();
                let head = b.head.cast::<S32>();
                let mut load_q = |k: &mut Kernel| {
                    qr.acquire(k);
                    qr.arrive_expect_tx(k, f.s.q_layout().bytes());
                    let full = qr.full_barrier(k);
                    let q_at = qr.slot(k, f.slots.q);
                    let q_row = k.add(b.seq.q_start, b.m_start);
                    let q_tile = (q_at, &f.s.q_layout());
                    let coords = ([q_row, head, batch], zero);
                    f.s.columns.load_tile(k, q_tile, f.maps[0], coords, full);
                    qr.advance(k);
                };
                let kv_layout = f.s.kv_layout();
                let kv_bytes = kv_layout.bytes();
                let mut load_kv = |k: &mut Kernel, n: Reg<S32>| {
                    let row = k.mad(n, f.s.block_n as i32, b.seq.k_start);
                    let rings = [
                        (&mut kr, f.slots.k, f.maps[1]),
                        (&mut vr, f.slots.v, f.maps[2]),
                    ];
                    for (ring, slot, map) in rings {
                        ring.acquire(k);
                        ring.arrive_expect_tx(k, kv_bytes);
                        let full = ring.full_barrier(k);
                        let at = ring.slot(k, slot);
                        let coords = ([row, kv_head, batch], zero);
                        f.s.columns
                            .load_tile(k, (at, &kv_layout), map, coords, full);
                        ring.advance(k);
                    }
                };
                let last = k.sub(b.tiles.end, 1i32);
                if f.s.o_in_q() {
                    // Q's tile is free only after the last item's epilogue: the first K and
                    // V tiles go ahead of it, so only Q's latency follows the epilogue.
                    load_kv(k, last);
                    load_q(k);
                    let next = k.sub(last, 1i32);
                    k.for_range(next, -1i32, -1, |k, n| load_kv(k, n));
                } else {
                    load_q(k);
                    k.for_range(last, -1i32, -1, |k, n| load_kv(k, n));
                }
            });
        });
    });
}

/// A consumer warpgroup's registers and roles for one work item.
struct Consumer<'a, H: Half2> {
    f: &'a Fwd,
    b: &'a Block,
    roles: ConsumerRoles,
    /// This warpgroup's 64 rows of the Q tile (the Q ring has one stage).
    q: SmemDesc<KMajor>,
    scale_log2: Reg<F32>,
    softmax: OnlineSoftmax,
    /// Each row's pending rescale of O, from the last softmax.
    factors: [Reg<F32>; 2],
    /// P of the last softmax, as the A fragments of the next `P V`.
    p: Vec<[Reg<H>; 4]>,
    /// The consumer threads that share a V stage meet here once they have zeroed its
    /// rows past a packed sequence's end ([`Consumer::zero_v_past_end`]).
    v_zeroed: NamedBarrier,
}

/// The rings a consumer walks through, kept across work items.
struct Rings {
    q: StageRing,
    k: StageRing,
    v: StageRing,
}

/// Warpgroups 1 and 2: the attention itself, for 64 query rows each of every work item.
fn consume<H, NS, NO>(k: &mut Kernel, f: &Fwd, tid: Reg<U32>)
where
    H: Half2 + WgmmaInput,
    NS: WgmmaN,
    NO: WgmmaN,
{
    k.comment("Consumers: S = Q K^T, online softmax, O += P V, in ping-pong turns.");
    let split = f.s.split_keys;
    let consumers = (f.s.consumers(), true);
    let roles = ConsumerRoles::new(k, tid, f.s.registers().1, consumers, split);
    let q_at = f.smem.tile(k, f.slots.q, 0);
    let q = roles.q_rows(k, q_at, &f.s.q_layout());
    let scale_log2 = k.load_param_at::<F32>(f.args, offset_of!(FwdArgs, scale_log2));
    let o_in_q = f.s.o_in_q();
    let stage = roles.output_stage(f.smem, f.slots.o, (f.maps[3], f.s.columns), o_in_q);
    let mut rings = Rings {
        q: f.slots.q_ring.consumer(k, f.smem),
        k: f.slots.k_ring.consumer(k, f.smem),
        v: f.slots.v_ring.consumer(k, f.smem),
    };
    let exchange = f
        .slots
        .exchange
        .map(|slot| Exchange::new(k, f, &roles, slot, &mut rings));
    let v_zeroed = k.named_barrier(128 * f.s.kv_consumers());
    f.for_each_item(k, Role::Consumer, |k, b| {
        let c = Consumer {
            f,
            b,
            roles,
            q,
            scale_log2,
            softmax: OnlineSoftmax::new(k, 1).with_fma_exps(f.s.fma_exp_every()),
            factors: [k.mov(1f32), k.mov(1f32)],
            p: (0..f.s.block_n / 16).map(|_| k.regs::<H, 4>()).collect(),
            v_zeroed,
        };
        let mut o = Some(k.acc_zeroed::<NO>());
        let any = k.setp(Cmp::Gt, b.tiles.end, 0i32);
        match &exchange {
            None => {
                k.if_(any, |k| {
                    let acc = o.take().expect("taken once");
                    let last = k.sub(b.tiles.end, 1i32);
                    o = Some(c.attend::<NS, NO>(k, acc, &mut rings, last));
                });
            }
            Some(x) => {
                // This warpgroup's first tile; none when the item has a single tile and
                // it is the other's. Q is then only waited for and released.
                let first = x.first_tile(k, b);
                let mine = k.setp(Cmp::Ge, first, 0i32);
                k.if_(mine, |k| {
                    let acc = o.take().expect("taken once");
                    o = Some(c.attend::<NS, NO>(k, acc, &mut rings, first));
                });
                let idle = k.setp(Cmp::Lt, first, 0i32);
                let idle = k.and_pred(idle, any);
                k.if_(idle, |k| {
                    rings.q.wait_full(k);
                    c.release(k, &mut rings.q);
                });
                x.even_turns(k, b, first, &c.roles);
                let acc = o.take().expect("given back");
                x.merge(k, &acc, &c.softmax, scale_log2);
                x.finish_item(k, b);
                o = Some(acc);
            }
        }
        let o = o.expect("given back");
        let at = OutputBlock {
            batch: b.batch,
            head: b.head,
            m_start: b.m_start,
            seq: b.seq,
        };
        // O staged in Q's tile: only where this item holds that tile (it had keys).
        let by_tma = ConsumerRoles::o_by_tma(k, f.args);
        let by_tma = if o_in_q {
            k.and_pred(by_tma, any)
        } else {
            by_tma
        };
        let form = if f.fold_scale {
            LseForm::Folded
        } else {
            LseForm::Raw
        };
        let rows = &c.roles.rows;
        let stage = (&stage, by_tma);
        let epilogue = |k: &mut Kernel| {
            let columns = f.head_dim.map(|p| k.load_param(p));
            let (o, softmax) = (&o.tiles(), &c.softmax);
            store_output_staged::<H>(k, f.args, rows, o, softmax, at, (form, columns), stage)
        };
        match &exchange {
            None => epilogue(k),
            // The first warpgroup holds the merged result.
            Some(x) => k.if_(x.first, epilogue),
        }
        if o_in_q {
            k.if_(any, |k| c.roles.release(k, &mut rings.q));
        }
    });
    stage.drain(k);
}

impl<H: Half2 + WgmmaInput> Consumer<'_, H> {
    /// The key loop over this warpgroup's tiles, `first` (≥ 0) down to 0 (every one, or
    /// with split keys every other one); returns O (unnormalised).
    fn attend<NS: WgmmaN, NO: WgmmaN>(
        &self,
        k: &mut Kernel,
        o: Acc<NO>,
        rings: &mut Rings,
        first: Reg<S32>,
    ) -> Acc<NO> {
        k.comment("Wait for Q; the last key tile (always masked) starts the pipeline.");
        rings.q.wait_full(k);
        let Rings {
            q: qr,
            k: kr,
            v: vr,
        } = rings;
        let last = first;

        self.roles.wait_turn(k);
        kr.wait_full(k);
        let s = self.scores::<NS>(k, kr);
        k.wgmma_commit();
        self.roles.pass_turn(k);
        k.wgmma_wait(0);
        let s = k.wgmma_retire(s);
        self.release_kv(k, kr);
        let tiles = s.tiles();
        let full = |k: &mut Kernel| {
            self.mask_tiles(k, &tiles, last);
            self.exponentiate_tiles(k, &tiles);
            pack_probs_into(k, &tiles, &self.p);
        };
        if self.f.causal {
            // Where every row of this warp sees only the tile's left part (on the causal
            // diagonal, the first 64 rows of a 128-row item), the softmax covers that
            // part alone and the rest of P is 0: the masked keys cost no exponentials.
            let left = tiles[..self.left_tiles()].to_vec();
            let only_left = self.sees_only_left_part(k, last);
            k.if_else(
                only_left,
                |k| {
                    self.mask_tiles(k, &left, last);
                    self.exponentiate_tiles(k, &left);
                    pack_probs_into(k, &left, &self.p[..left.len() / 2]);
                    let zero = k.mov(0f32);
                    for p in &self.p[left.len() / 2..] {
                        for &r in p {
                            k.pack_half2_to(r, zero, zero);
                        }
                    }
                },
                full,
            );
        } else {
            full(k);
        }
        self.zero_v_past_end(k, vr, last);

        k.comment("Tiles that cross the sequence end or the diagonal, last to first.");
        let stride = self.tile_stride();
        let last_masked_end = k.sub(self.b.tiles.mask_from, 1i32);
        let second_last = k.sub(last, stride);
        let o = k.for_range_carry(second_last, last_masked_end, -stride, o, |k, n, o| {
            self.step::<NS, NO>(k, n, true, o, kr, vr)
        });
        k.comment("The remaining tiles need no mask.");
        let first_unmasked = if stride == 1 {
            let unmasked = k.min(self.b.tiles.mask_from, last);
            k.sub(unmasked, 1i32)
        } else {
            // The first of this warpgroup's tiles below mask_from: every other tile
            // counting from `first`.
            let below = k.min(last_masked_end, second_last);
            let gap = k.sub(last, below).cast::<U32>();
            let odd = k.and(gap, 1u32).cast::<S32>();
            k.sub(below, odd)
        };
        let o = k.for_range_carry(first_unmasked, -1i32, -stride, o, |k, n, o| {
            self.step::<NS, NO>(k, n, false, o, kr, vr)
        });
        // Every Q K^T of this work item is done: the producer may load the next Q while
        // the last P V and the epilogue run (unless O is staged in Q's tile).
        if !self.f.s.o_in_q() {
            self.release(k, qr);
        }

        k.comment("The last P V.");
        self.roles.wait_turn(k);
        let pv = self.rescale_and_pv::<NO>(k, o, vr);
        self.roles.pass_turn(k);
        k.wgmma_wait(0);
        let o = k.wgmma_retire(pv);
        self.release_kv(k, vr);
        o
    }

    /// Packed sequences: key tile `last` (this warpgroup's first) may run past its
    /// sequence's end, and TMA then brings the rows that follow (the next sequence's, or
    /// after the last sequence whatever the buffer holds there) instead of zeros. Their
    /// probabilities are exactly 0, but `0 · v` is NaN where `v` is infinite or NaN, so
    /// before any `P V` reads the tile, the warpgroups that share its V stage zero those
    /// rows: whole 128-byte rows of every column block (the swizzle only permutes the
    /// 16-byte chunks within a row), each thread a chunk per pass, then a proxy fence
    /// (the tensor cores read through the async proxy) and a barrier among them.
    fn zero_v_past_end(&self, k: &mut Kernel, vr: &StageRing, last: Reg<S32>) {
        let f = self.f;
        let block_n = f.s.block_n;
        let first_key = k.mul(last, block_n as i32);
        let inside = k.sub(self.b.seq.seqlen_k, first_key);
        let cut = k.setp(Cmp::Lt, inside, block_n as i32);
        let cut = k.and_pred(cut, self.b.seq.packed);
        k.if_(cut, |k| {
            k.comment("Zero the V rows past the packed sequence's end.");
            vr.wait_full(k);
            let layout = f.s.kv_layout();
            let threads = self.v_zeroed.threads();
            let tid = k.special(Special::TidX);
            // The thread's index among them: every consumer thread, or with split keys
            // (one warpgroup per stage) among its warpgroup's.
            let t = k.sub(tid, 128u32);
            let t = if f.s.split_keys { k.and(t, 127u32) } else { t };
            let row0 = k.shr(t, 3);
            let chunk = k.and(t, 7u32);
            let at = k.shl(chunk, 4);
            let at = k.mad(row0, layout.block_bytes, at);
            let base = vr.slot(k, f.slots.v);
            let base = k.smem_offset(base, at);
            let zero = k.mov(0u32);
            let inside = inside.cast::<U32>();
            let rows_per_pass = threads / 8;
            for pass in 0..block_n.div_ceil(rows_per_pass) {
                let row = k.add(row0, pass * rows_per_pass);
                let past = k.setp(Cmp::Ge, row, inside);
                let within = k.setp(Cmp::Lt, row, block_n);
                let zeroed = k.and_pred(past, within);
                for block in 0..layout.col_blocks() {
                    let offset =
                        block * layout.block_stride() + pass * rows_per_pass * layout.block_bytes;
                    k.guarded(zeroed, true, |k| {
                        k.st_shared_v4::<U32>(base, offset as i32, [zero; 4]);
                    });
                }
            }
            k.fence_proxy_async();
            k.bar_wait(self.v_zeroed);
        });
    }

    /// One key tile `n` with P V of tile `n + 1` overlapping its softmax.
    fn step<NS: WgmmaN, NO: WgmmaN>(
        &self,
        k: &mut Kernel,
        n: Reg<S32>,
        masked: bool,
        o: Acc<NO>,
        kr: &mut StageRing,
        vr: &mut StageRing,
    ) -> Acc<NO> {
        self.roles.wait_turn(k);
        kr.wait_full(k);
        let s = self.scores::<NS>(k, kr);
        k.wgmma_commit();
        let pv = self.rescale_and_pv::<NO>(k, o, vr);
        self.roles.pass_turn(k);
        k.wgmma_wait(1);
        let s = k.wgmma_retire(s);
        self.release_kv(k, kr);
        if masked {
            self.mask(k, &s, n);
        }
        self.exponentiate(k, &s);
        k.wgmma_wait(0);
        let o = k.wgmma_retire(pv);
        self.release_kv(k, vr);
        pack_probs_into(k, &s.tiles(), &self.p);
        o
    }

    /// The online softmax's step on tile `s`: the running maxima raised, the pending
    /// rescale of O in `factors`, the scores turned into unnormalised probabilities,
    /// with the scale folded into the exponent or not ([`FwdConfig::fold_scale`]).
    fn exponentiate<NS: WgmmaN>(&self, k: &mut Kernel, s: &Acc<NS>) {
        self.exponentiate_tiles(k, &s.tiles());
    }

    /// [`Consumer::exponentiate`] on some of the tile's 8-column tiles.
    fn exponentiate_tiles(&self, k: &mut Kernel, tiles: &Slab) {
        let (tiles, factors) = ([tiles.clone()], [self.factors]);
        if self.f.fold_scale {
            self.softmax
                .update_scaled(k, &tiles, self.scale_log2, 0.0, None, &factors);
        } else {
            self.softmax.update(k, &tiles, self.scale_log2, &factors);
        }
    }

    /// `S = Q Kᵀ` on the K ring's current stage (d/16 k-steps, SS).
    fn scores<NS: WgmmaN>(&self, k: &mut Kernel, kr: &StageRing) -> InFlight<NS> {
        let f = self.f;
        let (ql, kl) = (f.s.q_layout(), f.s.kv_layout());
        let k_at = kr.slot(k, f.slots.k);
        let kd = k.smem_desc::<KMajor>(k_at, &kl);
        let acc = k.acc::<NS>();
        let q0 = if self.roles.lean {
            let q_at = f.smem.tile(k, f.slots.q, 0);
            self.roles.q_rows(k, q_at, &ql)
        } else {
            self.q
        };
        let mut flying = k.wgmma_ss::<H, NS, KMajor, KMajor>(acc, q0, kd, ScaleD::Zero);
        for step in 1..f.s.head_dim / 16 {
            let q = advance(k, q0, ql.logical_offset(0, 16 * step));
            let kk = advance(k, kd, kl.logical_offset(0, 16 * step));
            flying = k.wgmma_ss::<H, NS, KMajor, KMajor>(flying, q, kk, ScaleD::Accumulate);
        }
        flying
    }

    /// Applies the last softmax's rescale to O, then issues and commits `O += P V` once
    /// the V ring's current stage has landed.
    fn rescale_and_pv<NO: WgmmaN>(
        &self,
        k: &mut Kernel,
        o: Acc<NO>,
        vr: &StageRing,
    ) -> InFlight<NO> {
        rescale_rows(k, &[o.tiles()], &[self.factors]);
        vr.wait_full(k);
        let pv = self.pv::<NO>(k, o, vr);
        k.wgmma_commit();
        pv
    }

    /// `O += P V` on the V ring's current stage (block_n/16 k-steps, RS, V MN-major).
    fn pv<NO: WgmmaN>(&self, k: &mut Kernel, o: impl WgmmaD<NO>, vr: &StageRing) -> InFlight<NO> {
        let f = self.f;
        let vl = f.s.kv_layout();
        let v_at = vr.slot(k, f.slots.v);
        let vd = k.smem_desc::<MnMajor>(v_at, &vl);
        let mut flying = k.wgmma_rs::<H, NO, MnMajor>(o, &self.p[0], vd, ScaleD::Accumulate);
        for (t, p) in self.p.iter().enumerate().skip(1) {
            let v = advance(k, vd, vl.logical_offset(16 * t as u32, 0));
            flying = k.wgmma_rs::<H, NO, MnMajor>(flying, p, v, ScaleD::Accumulate);
        }
        flying
    }

    /// Whether every row of this thread's warp sees no key of key tile `n` past its left
    /// part ([`Consumer::left_tiles`]; warp-uniform, so that the branch on it keeps the
    /// softmax's shuffles whole).
    fn sees_only_left_part(&self, k: &mut Kernel, n: Reg<S32>) -> Reg<crate::ptx::Pred> {
        let left_keys = (self.left_tiles() * 8) as i32;
        let first_key = k.mul(n, self.f.s.block_n as i32);
        let right = k.add(first_key, left_keys);
        // Of the thread's rows (g and g + 8 of the warp's one slab) the later sees more.
        let b = self.b;
        let causal = Some(b.causal_offset);
        let limit = row_key_limit(
            k,
            &self.roles.rows,
            (0, 1),
            b.m_start,
            b.seq.seqlen_k,
            causal,
        );
        let mine = k.setp(Cmp::Le, limit, right);
        k.vote_all(mine)
    }

    /// The 8-column tiles of a key tile's left part: half of them, rounded up to whole
    /// 16-key fragments of P.
    fn left_tiles(&self) -> usize {
        (self.f.s.block_n as usize / 2).div_ceil(16) * 2
    }

    /// The mask of key tile `n` on this warpgroup's scores.
    fn mask<NS: WgmmaN>(&self, k: &mut Kernel, s: &Acc<NS>, n: Reg<S32>) {
        self.mask_tiles(k, &s.tiles(), n);
    }

    /// [`Consumer::mask`] on some of the tile's 8-column tiles, from its first.
    fn mask_tiles(&self, k: &mut Kernel, tiles: &Slab, n: Reg<S32>) {
        let first_key = k.mul(n, self.f.s.block_n as i32);
        let causal = self.f.causal.then_some(self.b.causal_offset);
        let scores = [tiles.clone()];
        apply_mask(
            k,
            &self.roles.rows,
            &scores,
            first_key,
            self.b.m_start,
            self.b.seq.seqlen_k,
            causal,
        );
    }

    fn release(&self, k: &mut Kernel, ring: &mut StageRing) {
        self.roles.release(k, ring);
    }

    /// Releases the K or V ring's current stage and moves to this warpgroup's next one:
    /// the next stage, or with split keys the one after (the other warpgroup's turn of
    /// the ring lies between).
    fn release_kv(&self, k: &mut Kernel, ring: &mut StageRing) {
        self.roles.release(k, ring);
        if self.f.s.split_keys {
            ring.advance(k);
        }
    }

    /// How far apart this warpgroup's key tiles are: 1, or 2 with split keys.
    fn tile_stride(&self) -> i32 {
        if self.f.s.split_keys { 2 } else { 1 }
    }
}

/// Split keys ([`Shape::split_keys`]): which key tiles each consumer warpgroup takes, and
/// how the second hands its partial result to the first.
///
/// The producer fills the K and V rings with every item's tiles in turn, so the ring
/// positions run on across items; warpgroup `c` takes the positions `≡ c (mod 2)`. Its
/// first tile of an item is the item's last (`end − 1`) or the one below, depending on
/// where the item's tiles start in the ring (`parity`). The two take turns at the tensor
/// cores, and since a warpgroup with `t` tiles takes `t + 1` turns, the one with a tile
/// fewer takes empty turns to keep the alternation ([`Exchange::even_turns`]).
///
/// At the end of an item the second warpgroup writes its O accumulator, row maxima and
/// partial row sums to shared memory as 16-byte vectors, vector `g` of thread `t` at
/// `(128·g + t)·16` (each warp's stores are 512 consecutive bytes); the first warpgroup
/// holds the same rows in the same registers, reads them back and merges them into its
/// own by the rows' maxima, as the online softmax merges tiles. Two named barriers of
/// both warpgroups order the write, the read, and the next item's write.
struct Exchange {
    slot: RawSlot,
    smem: Smem,
    which: Reg<U32>,
    /// This thread is in the first consumer warpgroup: it merges and writes the output.
    first: Reg<Pred>,
    /// The parity of the ring position where the current item's tiles start.
    parity: Reg<U32>,
    written: NamedBarrier,
    read: NamedBarrier,
}

impl Exchange {
    /// Bytes of the exchange at head dim `head_dim`: per thread, O's `d/2` registers and
    /// 4 of statistics, as 16-byte vectors.
    fn bytes(head_dim: u32) -> u32 {
        128 * 16 * (head_dim / 8 + 1)
    }

    /// The second warpgroup's ring views start one stage on: its first tile is the
    /// ring's second.
    fn new(
        k: &mut Kernel,
        f: &Fwd,
        roles: &ConsumerRoles,
        slot: RawSlot,
        rings: &mut Rings,
    ) -> Exchange {
        let which = roles.which(k);
        let first = k.setp(Cmp::Eq, which, 0u32);
        k.guarded(first, false, |k| {
            rings.k.advance(k);
            rings.v.advance(k);
        });
        Exchange {
            slot,
            smem: f.smem,
            which,
            first,
            parity: k.mov(0u32),
            written: k.named_barrier(256),
            read: k.named_barrier(256),
        }
    }

    /// This warpgroup's first (highest) key tile of item `b`: `end − 1` or `end − 2`
    /// (negative when the item's one tile is the other warpgroup's).
    fn first_tile(&self, k: &mut Kernel, b: &Block) -> Reg<S32> {
        let skip = k.xor(self.which, self.parity);
        let last = k.sub(b.tiles.end, 1i32);
        k.sub(last, skip.cast::<S32>())
    }

    /// The warpgroup with fewer tiles of item `b` takes empty turns until both have taken
    /// as many (one with `t > 0` tiles takes `t + 1`: its first `Q Kᵀ`, its steps, its
    /// last `P V`), so that the next item starts with the first warpgroup's turn. `first`
    /// is this warpgroup's first tile ([`Exchange::first_tile`]): it has `(first + 2) / 2`
    /// of the item's tiles.
    fn even_turns(&self, k: &mut Kernel, b: &Block, first: Reg<S32>, roles: &ConsumerRoles) {
        let mine = k.add(first, 2i32);
        let mine = k.shr(mine, 1);
        let theirs = k.sub(b.tiles.end, mine);
        let turns = |k: &mut Kernel, t: Reg<S32>| {
            let some = k.min(t, 1i32);
            k.add(t, some)
        };
        let mine = turns(k, mine);
        let theirs = turns(k, theirs);
        let deficit = k.sub(theirs, mine);
        k.for_range(0i32, deficit, 1, |k, _| {
            roles.wait_turn(k);
            roles.pass_turn(k);
        });
    }

    /// The item's `end` tiles have moved the ring on by as many positions.
    fn finish_item(&self, k: &mut Kernel, b: &Block) {
        let odd = k.and(b.tiles.end.cast::<U32>(), 1u32);
        k.xor_to(self.parity, self.parity, odd);
    }

    /// Leaves the first warpgroup's `o` and `softmax` holding both warpgroups' result.
    fn merge<N: WgmmaN>(&self, k: &mut Kernel, o: &Acc<N>, softmax: &OnlineSoftmax, c: Reg<F32>) {
        k.comment("Split keys: the second warpgroup's partial result joins the first's.");
        let tid = k.special(Special::TidX);
        let thread = k.and(tid, 127u32);
        let off = k.shl(thread, 4);
        let base = self.smem.raw(k, self.slot);
        let at = k.smem_offset(base, off);
        let tiles = o.tiles();
        let vector = |g: usize| (g * 128 * 16) as i32;
        let stats = vector(tiles.len());
        let (max, sum) = (softmax.max[0], softmax.sum[0]);
        k.guarded(self.first, false, |k| {
            for (g, &t) in tiles.iter().enumerate() {
                k.st_shared_v4(at, vector(g), t);
            }
            k.st_shared_v4(at, stats, [max[0], max[1], sum[0], sum[1]]);
        });
        k.bar_wait(self.written);
        k.if_(self.first, |k| {
            let [m0, m1, s0, s1] = k.ld_shared_v4::<F32>(at, stats);
            let (other_max, other_sum) = ([m0, m1], [s0, s1]);
            // Per row half: the factors that bring each side to the joint maximum (0 for
            // a side that saw no key; both 0 for a row that saw none).
            let factors: [[Reg<F32>; 2]; 2] = std::array::from_fn(|half| {
                let joint = k.max(max[half], other_max[half]);
                let none = k.setp(Cmp::Eq, joint, f32::NEG_INFINITY);
                let usable = k.selp(0f32, joint, none);
                let [own, other] = [max[half], other_max[half]].map(|m| {
                    let d = k.sub(m, usable);
                    let d = k.mul(d, c);
                    k.ex2(d)
                });
                k.mul_to(sum[half], sum[half], own);
                k.mad_to(sum[half], other_sum[half], other, sum[half]);
                k.mov_to(max[half], joint);
                [own, other]
            });
            for (g, t) in tiles.iter().enumerate() {
                let theirs = k.ld_shared_v4::<F32>(at, vector(g));
                for (j, (&v, &w)) in t.iter().zip(&theirs).enumerate() {
                    let [own, other] = factors[j / 2];
                    k.mul_to(v, v, own);
                    k.mad_to(v, w, other, v);
                }
            }
        });
        k.bar_wait(self.read);
    }
}

/// A descriptor moved by `bytes` (nothing emitted for 0).
pub(super) fn advance<M: crate::ptx::Major>(
    k: &mut Kernel,
    d: SmemDesc<M>,
    bytes: u32,
) -> SmemDesc<M> {
    if bytes == 0 {
        d
    } else {
        k.desc_advance(d, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(head_dim: u32, dtype: HalfType, causal: bool) -> FwdConfig {
        FwdConfig {
            path: super::super::Path::Sm90,
            dtype,
            head_dim,
            causal,
            block_m: BLOCK_M,
            split_keys: false,
            fold_scale: true,
            padded: false,
        }
    }

    /// The arrival count of every `mbarrier.init` in `ptx`.
    fn mbarrier_counts(ptx: &str) -> Vec<&str> {
        ptx.lines()
            .filter(|l| l.contains("mbarrier.init"))
            .filter_map(|l| l.trim().strip_suffix(';')?.rsplit(", ").next())
            .collect()
    }

    /// The one-consumer kernel: 256 threads, 64-row Q (and O) tiles, EMPTY barriers
    /// counting its four warps, no ping-pong barriers; the two-consumer kernel keeps its
    /// pair.
    #[test]
    fn one_consumer_kernel_takes_no_turns() {
        for d in HEAD_DIMS {
            for causal in [false, true] {
                let narrow = FwdConfig {
                    block_m: 64,
                    ..config(d, HalfType::F16, causal)
                };
                let s = Shape::of(&narrow);
                assert_eq!((s.consumers(), s.threads()), (1, 256));
                assert_eq!(s.q_layout().rows, 64);
                assert!(s.plan().0.bytes() <= MAX_SMEM, "d{d}");
                let t = narrow.tiling();
                assert_eq!((t.block_m, t.threads), (64, 256));
                let ptx = generate(&narrow).unwrap().to_ptx();
                assert!(ptx.contains(".maxntid 256, 1, 1"), "d{d}");
                assert!(!ptx.contains("bar.arrive"), "d{d}: a turn is passed");
                let counts = mbarrier_counts(&ptx);
                // FULL: the producer; EMPTY: 4 warps; the causal queue's EMPTY: 128 threads.
                let want: &[&str] = if causal {
                    &["1", "4", "128"]
                } else {
                    &["1", "4"]
                };
                assert!(counts.iter().all(|c| want.contains(c)), "d{d}: {counts:?}");
                let wide = generate(&config(d, HalfType::F16, causal))
                    .unwrap()
                    .to_ptx();
                assert!(wide.contains(".maxntid 384, 1, 1") && wide.contains("bar.arrive"));
            }
        }
    }

    /// O gets a staging tile of its own where one fits beside Q and the rings, else
    /// (d = 256) it is staged in Q's; every plan fits the GPU.
    /// The three-consumer kernel (head dim 64 only): 512 threads, 24 and 160 registers,
    /// EMPTY barriers counting twelve warps, turns passed round a ring of three named
    /// barriers that the last warpgroup opens at barrier 1 (the first of the ring); with
    /// a causal mask, items from the counter that all 384 consumer threads wait for.
    #[test]
    fn three_consumers_pass_turns_round_a_ring() {
        assert!(has_tile(64, 192));
        assert!(!has_tile(128, 192) && !has_tile(256, 192));
        let cfg = FwdConfig {
            block_m: 192,
            ..config(64, HalfType::Bf16, false)
        };
        let s = Shape::of(&cfg);
        assert_eq!(
            (s.consumers(), s.threads(), s.registers()),
            (3, 512, (24, 160))
        );
        let (t, regs) = (cfg.tiling(), s.registers());
        assert_eq!((t.block_m, t.threads), (192, 512));
        assert!(128 * regs.0 + 384 * regs.1 <= 65536);
        let ptx = generate(&cfg).unwrap().to_ptx();
        assert!(ptx.contains(".maxntid 512, 1, 1"));
        assert!(ptx.contains("setmaxnreg.inc.sync.aligned.u32 160;"));
        let counts = mbarrier_counts(&ptx);
        assert!(counts.iter().all(|c| ["1", "12"].contains(c)), "{counts:?}");
        assert_eq!(ptx.matches("bar.arrive 1, 256;").count(), 1);
        assert!(ptx.contains("setp.eq.u32") && ptx.matches("bar.arrive %r").count() >= 2);
        let causal = FwdConfig {
            causal: true,
            ..cfg
        };
        let ptx = generate(&causal).unwrap().to_ptx();
        assert!(ptx.contains(".maxntid 512, 1, 1"));
        assert!(ptx.contains("atom.global.add.u32"), "items from a counter");
        assert!(
            mbarrier_counts(&ptx).contains(&"384"),
            "the consumers wait for their next item together"
        );
    }

    /// The split-keys kernel (head dim 64, 64-row tiles only): 384 threads on one 64-row
    /// Q tile, a 4-stage K/V ring whose EMPTY barriers count one warpgroup's four warps
    /// (each stage has one user) while Q's counts both's eight, turns taken round two
    /// named barriers, and the partial result handed over through shared memory between
    /// two more barriers of both warpgroups.
    /// Head dim 64 runs a 4-stage K/V ring on every query tile, in shared memory;
    /// the larger head dims keep two stages.
    #[test]
    fn head_dim_64_rings_have_four_stages() {
        for (d, block_ms, stages) in [
            (64, &[64, 128, 192][..], 4),
            (128, &[64, 128], 2),
            (256, &[64, 128], 2),
        ] {
            for &block_m in block_ms {
                for causal in [false, true] {
                    let cfg = FwdConfig {
                        block_m,
                        ..config(d, HalfType::Bf16, causal)
                    };
                    let s = Shape::of(&cfg);
                    let (plan, slots) = s.plan();
                    assert_eq!(
                        (s.stages(), slots.k.copies, slots.v.copies),
                        (stages, stages, stages),
                        "{}",
                        cfg.id()
                    );
                    assert!(plan.bytes() <= MAX_SMEM, "{}", cfg.id());
                }
            }
        }
    }

    /// The folded kernels compute each score's exponent as one FMA where the unfolded
    /// take a subtraction and a multiplication; nothing else in the key loop changes.
    #[test]
    fn folded_exponent_is_one_fma_per_score() {
        let count = |ptx: &str, op: &str| {
            ptx.lines()
                .filter(|l| l.trim_start().starts_with(op))
                .count()
        };
        for (d, block_m) in [(64, 192), (64, 64), (128, 128), (256, 128)] {
            for causal in [false, true] {
                let folded = FwdConfig {
                    block_m,
                    ..config(d, HalfType::Bf16, causal)
                };
                let unfolded = FwdConfig {
                    fold_scale: false,
                    ..folded
                };
                let [f, u] = [folded, unfolded].map(|c| generate(&c).unwrap().to_ptx());
                // The folded softmax sends one exponential in `fma_exp_every` to the FMA
                // pipe: one round-down add, two subtractions, three FMAs and a multiply
                // each, in place of one `ex2.approx`.
                let on_fma = count(&f, "add.rm.f32");
                let every = Shape::of(&folded).fma_exp_every();
                assert_eq!(on_fma > 0, every > 0, "{}", folded.id());
                assert_eq!(count(&f, "ex2.approx") + on_fma, count(&u, "ex2.approx"));
                let fmas = count(&f, "fma.rn.f32") - 3 * on_fma - count(&u, "fma.rn.f32");
                // At least a thread's scores (64 rows of `block_n` over 128 threads) of
                // two tiles: the first, and the loop's.
                let scores = Shape::of(&folded).block_n as usize / 2;
                assert!(fmas >= 2 * scores, "{}: {fmas}", folded.id());
                // The same number fewer subtractions and multiplications, give or take
                // the few per row that raise the maxima and form the LSE.
                let fewer = |op| count(&u, op) as i64 - count(&f, op) as i64;
                for (op, per_fma_exp) in [("sub.f32", 2), ("mul.rn.f32", 1)] {
                    let fewer = fewer(op) + per_fma_exp * on_fma as i64;
                    assert!((fewer - fmas as i64).abs() <= 8, "{op}: {fewer}");
                }
                assert!(folded.id().contains("_fold") && !unfolded.id().contains("_fold"));
            }
        }
    }

    #[test]
    fn split_keys_share_one_query_tile_between_two_consumers() {
        assert!(has_split(64, 64));
        assert!(!has_split(64, 128) && !has_split(128, 64) && !has_split(256, 64));
        for causal in [false, true] {
            let cfg = FwdConfig {
                block_m: 64,
                split_keys: true,
                fold_scale: false,
                ..config(64, HalfType::F16, causal)
            };
            // The hand-over merges raw maxima: no folded split-keys kernel.
            assert!(
                generate(&FwdConfig {
                    fold_scale: true,
                    ..cfg
                })
                .is_err()
            );
            let s = Shape::of(&cfg);
            assert_eq!((s.consumers(), s.kv_consumers(), s.stages()), (2, 1, 4));
            assert_eq!(s.q_layout().rows, 64);
            let (plan, slots) = s.plan();
            assert!(plan.bytes() <= MAX_SMEM);
            assert_eq!((slots.k.copies, slots.v.copies), (4, 4));
            assert!(slots.exchange.is_some());
            assert_eq!(cfg.tiling().threads, 384);
            assert!(cfg.id().ends_with(if causal {
                "_m64_splitkv_causal"
            } else {
                "_m64_splitkv"
            }));
            let ptx = generate(&cfg).unwrap().to_ptx();
            assert!(ptx.contains(".maxntid 384, 1, 1"));
            let counts = mbarrier_counts(&ptx);
            let want: &[&str] = if causal {
                &["1", "4", "8", "256"]
            } else {
                &["1", "4", "8"]
            };
            assert!(counts.iter().all(|c| want.contains(c)), "{counts:?}");
            assert_eq!(counts.iter().filter(|&&c| c == "8").count(), 1, "Q's EMPTY");
            assert_eq!(
                counts.iter().filter(|&&c| c == "4").count(),
                8,
                "K and V EMPTY"
            );
            // Turns at barriers 1 and 2; the hand-over at 3 and 4.
            assert!(ptx.contains("bar.arrive 1, 256;"));
            assert!(ptx.contains("bar.sync 3, 256;") && ptx.contains("bar.sync 4, 256;"));
            // O's 8 vectors and the statistics, out and back.
            assert_eq!(ptx.matches("st.shared.v4.f32").count(), 9);
            assert_eq!(ptx.matches("ld.shared.v4.f32").count(), 9);
        }
        let missing = FwdConfig {
            block_m: 64,
            split_keys: true,
            fold_scale: false,
            ..config(128, HalfType::F16, false)
        };
        assert!(generate(&missing).is_err());
    }

    /// Every 16-bit kernel zeroes the V rows past a packed sequence's end before the
    /// first `P V` reads them: whole rows of every column block, in passes of the sharing
    /// threads' 16-byte chunks, then a proxy fence and a barrier of exactly those threads
    /// (all consumers, or one warpgroup with split keys).
    #[test]
    fn packed_tails_zero_their_v_rows_before_p_v() {
        let mut configs = Vec::new();
        for d in HEAD_DIMS {
            for block_m in BLOCK_MS.into_iter().filter(|&m| has_tile(d, m)) {
                for causal in [false, true] {
                    configs.push(FwdConfig {
                        block_m,
                        ..config(d, HalfType::Bf16, causal)
                    });
                    if has_split(d, block_m) {
                        configs.push(FwdConfig {
                            block_m,
                            split_keys: true,
                            fold_scale: false,
                            ..config(d, HalfType::F16, causal)
                        });
                    }
                }
            }
        }
        assert_eq!(configs.len(), 20);
        for cfg in configs {
            let s = Shape::of(&cfg);
            let ptx = generate(&cfg).unwrap().to_ptx();
            let id = cfg.id();
            let at = ptx
                .find("Zero the V rows past the packed sequence's end.")
                .unwrap_or_else(|| panic!("{id}: no zeroing"));
            let threads = 128 * s.kv_consumers();
            let zeroing = &ptx[at..];
            let fence = zeroing.find("fence.proxy.async.shared::cta;").unwrap();
            let barrier = &zeroing[fence..].lines().nth(1).unwrap().trim();
            assert!(
                barrier.starts_with("bar.sync ") && barrier.ends_with(&format!(", {threads};")),
                "{id}: {barrier}"
            );
            let stores = zeroing[..fence].matches("st.shared.v4.b32").count() as u32;
            let passes = s.block_n.div_ceil(threads / 8);
            assert_eq!(stores, passes * s.kv_layout().col_blocks(), "{id}");
            // Before the first P V: the first wgmma whose A operand is registers (`}, {%`
            // after the accumulator; `Q Kᵀ` reads A through a descriptor).
            let first_pv = ptx
                .lines()
                .scan(0, |at, l| {
                    let here = *at;
                    *at += l.len() + 1;
                    Some((here, l))
                })
                .find(|(_, l)| l.contains("wgmma.mma_async") && l.contains("}, {%"))
                .map(|(at, _)| at)
                .unwrap_or_else(|| panic!("{id}: no P V"));
            assert!(at < first_pv, "{id}: V zeroed after the first P V");
        }
    }

    #[test]
    fn output_is_staged_beside_q_where_it_fits() {
        for d in HEAD_DIMS {
            let s = Shape::of(&config(d, HalfType::F16, false));
            // With 64-row tiles O has a tile of its own at every head dim.
            let narrow = Shape { block_m: 64, ..s };
            assert!(!narrow.o_in_q(), "d{d}");
            assert!(narrow.plan().0.bytes() <= MAX_SMEM, "d{d}");
            let (plan, slots) = s.plan();
            assert!(plan.bytes() <= MAX_SMEM, "d{d}: {} bytes", plan.bytes());
            assert_eq!(s.o_in_q(), d >= 192, "d{d}");
            assert_eq!(slots.o == slots.q, s.o_in_q(), "d{d}");
            assert_eq!(slots.o.layout, s.q_layout());
        }
    }

    /// The epilogue writes O with stmatrix and sends it by TMA (one `{64, 16}` box per
    /// warp and 64-column block), and keeps the direct stores for launches without a map
    /// of O.
    #[test]
    fn causal_diagonal_tile_can_take_its_softmax_on_the_left_part_alone() {
        let count = |ptx: &str, op: &str| ptx.lines().filter(|l| l.contains(op)).count();
        for d in HEAD_DIMS {
            for dtype in [HalfType::F16, HalfType::Bf16] {
                let full = generate(&config(d, dtype, false)).unwrap().to_ptx();
                let causal = generate(&config(d, dtype, true)).unwrap().to_ptx();
                // One warp-uniform choice, only under a causal mask.
                assert_eq!(count(&full, "vote.sync.all.pred"), 0, "d{d}");
                assert_eq!(count(&causal, "vote.sync.all.pred"), 1, "d{d}");
                // The left part's softmax is a second copy of the first tile's: its
                // exponentials (4 per 8-column tile) and the two rows' rescales.
                let block_n = Shape::of(&config(d, dtype, true)).block_n as usize;
                let left_tiles = (block_n / 2).div_ceil(16) * 2;
                assert!(
                    left_tiles * 8 < block_n && left_tiles.is_multiple_of(2),
                    "d{d}"
                );
                assert_eq!(
                    count(&causal, "ex2.approx"),
                    count(&full, "ex2.approx") + 4 * left_tiles + 2,
                    "d{d} {dtype:?}"
                );
            }
        }
    }

    /// A padded kernel (head dims below its own) moves each tile of Q, K and V as one TMA
    /// box per 64-column block, at column 64·b of a map whose innermost dimension is the
    /// tensors' head dim, and stores O the same way; its direct stores of O (no map of O)
    /// check each 8-column tile against its last parameter, the tensors' head dim;
    /// everything else is its unpadded sibling's.
    #[test]
    fn padded_kernels_move_one_box_per_column_block() {
        let count = |ptx: &str, what: &str| ptx.matches(what).count() as u32;
        let loads = "cp.async.bulk.tensor.5d.shared::cluster.global";
        let stores = "cp.async.bulk.tensor.5d.global.shared::cta";
        let padded: Vec<_> = crate::kernels::attention::all_fwd_configs()
            .into_iter()
            .filter(|c| c.path == super::super::Path::Sm90 && c.padded)
            .collect();
        assert_eq!(padded.len(), 64);
        for cfg in padded {
            let id = cfg.id();
            let ptx = generate(&cfg).unwrap().to_ptx();
            let plain = generate(&FwdConfig {
                padded: false,
                ..cfg
            })
            .unwrap()
            .to_ptx();
            let blocks = cfg.head_dim / 64;
            assert_eq!(count(&ptx, loads), blocks * count(&plain, loads), "{id}");
            assert_eq!(count(&ptx, stores), count(&plain, stores), "{id}");
            for what in ["wgmma.mma_async", "ex2.approx", "stmatrix", "mbarrier."] {
                assert_eq!(count(&ptx, what), count(&plain, what), "{id}: {what}");
            }
            assert!(ptx.contains(".param .u32 head_dim"), "{id}");
            assert!(!plain.contains("head_dim"), "{id}");
            // One direct store per 8-column tile and row half, each behind its own check.
            let direct = count(&plain, "st.global.b32");
            assert_eq!(count(&ptx, "st.global.b32"), direct, "{id}");
            assert_eq!(direct, cfg.head_dim / 8 * 2, "{id}");
            let checks = count(&ptx, "setp.lt.u32") - count(&plain, "setp.lt.u32");
            assert!(checks >= direct, "{id}");
            // The first coordinate (the column) of each load and store: 0, 64, ... there.
            let mut columns: Vec<u32> = ptx
                .lines()
                .filter(|l| l.contains(loads) || l.contains(stores))
                .map(|l| {
                    let reg = l.split('{').nth(1).unwrap().split(',').next().unwrap();
                    let def = format!("mov.s32 {reg}, ");
                    let line = ptx.lines().find(|l| l.contains(&def)).unwrap();
                    line.split(", ")
                        .nth(1)
                        .unwrap()
                        .trim_end_matches(';')
                        .parse()
                        .unwrap()
                })
                .collect();
            columns.sort();
            columns.dedup();
            let want: Vec<u32> = (0..blocks).map(|b| 64 * b).collect();
            assert_eq!(columns, want, "{id}");
        }
        assert!(
            generate(&FwdConfig {
                padded: true,
                ..config(64, HalfType::F16, false)
            })
            .is_ok()
        );
        for (block_m, split_keys) in [(192, false), (64, true)] {
            let cfg = FwdConfig {
                block_m,
                split_keys,
                fold_scale: false,
                padded: true,
                ..config(64, HalfType::F16, false)
            };
            assert!(generate(&cfg).is_err(), "{}", cfg.id());
        }
    }

    #[test]
    fn epilogue_stages_output_for_a_tma_store() {
        for d in HEAD_DIMS {
            for causal in [false, true] {
                let cfg = config(d, HalfType::Bf16, causal);
                let ptx = generate(&cfg).unwrap().to_ptx();
                let stores = ptx
                    .matches("cp.async.bulk.tensor.5d.global.shared::cta")
                    .count();
                assert_eq!(stores as u32, d / 64, "d{d} causal={causal}");
                assert_eq!(
                    ptx.matches("stmatrix.sync.aligned.x4.m8n8").count() as u32,
                    d / 16
                );
                assert!(ptx.contains("st.global.b32"), "d{d}: no direct stores");
                let read = ptx.matches("cp.async.bulk.wait_group.read 0;").count();
                // Own tile: waited for before the next write; Q's: right after the store,
                // before Q's tile is released.
                assert_eq!(read, 1, "d{d} causal={causal}");
                let wait_all = ptx.matches("cp.async.bulk.wait_group 0;").count();
                assert_eq!(wait_all, 1, "d{d}: the exit drains the stores");
            }
        }
    }
}
