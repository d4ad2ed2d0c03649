//! The compile-time shape of a kernel: tile sizes, consumer warpgroups, register
//! budgets, and where Q, K, V, O and the rings live in shared memory.

use super::schedule::WorkQueue;
use crate::kernels::attention::FwdConfig;
use crate::ptx::{
    Kernel, Mbarrier, RawSlot, Reg, RingBarriers, S32, SmemAddr, SmemLayout, SmemPlan, Swizzle,
    TileSlot, TmaDesc,
};

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
    /// shared memory at the end (`exchange.rs`). For grids that leave SMs idle, where one
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
    /// (see `exchange.rs`).
    pub exchange: Option<RawSlot>,
}

/// The dynamic shared memory a block may have on sm_90.
pub const MAX_SMEM: u32 = 227 * 1024;

impl Shape {
    /// Bytes of the split-keys exchange (`exchange.rs`): per thread of a warpgroup, O's
    /// `d/2` registers and 4 of statistics, as 16-byte vectors.
    fn exchange_bytes(&self) -> u32 {
        128 * 16 * (self.head_dim / 8 + 1)
    }

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
            // d256 with 64-key tiles where they pay (see `FwdConfig::narrow_keys`).
            _ if cfg.narrow_keys => 64,
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
    /// ([`with_fma_exps`]; 0: none). One in 32 for three consumer warpgroups (head dim 64,
    /// 192-row tiles), whose softmax shares each SM's exponent units three ways: 2–4%
    /// faster from S 2048 without a mask, causal level. The other kernels measured level
    /// (64-row tiles) or 1–2% slower (128-row tiles). In the two-consumer head-dim-64
    /// kernels (H200, 2026-11-29): one in 16 +3% at B32 H32 S512 without a mask but 2–9%
    /// slower on the causal rows from S 2048, one in 8 or 4 slower on every causal row.
    ///
    /// [`with_fma_exps`]: crate::kernels::attention::softmax::OnlineSoftmax::with_fma_exps
    pub fn fma_exp_every(&self) -> usize {
        if self.consumers() == 3 { 32 } else { 0 }
    }

    /// How far (log2 units) a row's running maximum may trail a tile's before it moves
    /// ([`OnlineSoftmax::update_scaled`]'s `lag`), so that a warp whose rows' maxima all
    /// stay skips O's rescale; probabilities then reach up to `2^lag`, which the 16-bit
    /// types hold exactly as well as `[0, 1]`. 8 for the kernels whose consumer
    /// warpgroups take turns (two or three; the rescale lies between a warpgroup's
    /// softmax and its next `P V`, on the path the turns wait for). On the H200, same
    /// call, against the rescale on every tile (f16 and bf16, the Hopper grid): head dim
    /// 128 +1.4% to +9.1% (mean +5%), 256 +0.6% to +4.8% (one f16 row, B1 S16384, 9%
    /// slower, within that row's known spread between runs), the three-consumer head-dim-64
    /// kernels −3% to +4.5% (mean +1.8%), the two-consumer head-dim-64 ones +2% at B32 S512
    /// without a mask and up to +4.6% causal. The one-consumer kernel has no turns to
    /// shorten and measured level or 1% slower; the split-keys kernels merge their
    /// warpgroups' maxima and keep the exact ones.
    ///
    /// [`OnlineSoftmax::update_scaled`]: crate::kernels::attention::softmax::OnlineSoftmax::update_scaled
    pub fn max_lag(&self) -> Option<f32> {
        (!self.split_keys && self.consumers() >= 2).then_some(8.0)
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
            exchange: self.split_keys.then(|| plan.raw(self.exchange_bytes(), 16)),
        };
        (plan, slots)
    }
}
