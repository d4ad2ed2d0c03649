//! Warp specialization: what the warpgroups share ([`Fwd`]), the split into one producer
//! and the consumers, the turns the consumers take at the tensor cores (ping-pong on
//! named barriers), and the rings each consumer walks through.

use std::mem::offset_of;

use super::schedule::{ItemLoop, WindowTiles, WorkQueue};
use super::shape::{MapColumns, Shape, Slots};
use crate::kernels::attention::FwdArgs;
use crate::kernels::attention::epilogue::OutputStage;
use crate::kernels::attention::rows::Rows;
use crate::ptx::{
    Acc, BarrierRing, Cmp, InFlight, KMajor, Kernel, Param, ParamBytes, Reg, RingBarriers, Smem,
    SmemAddr, SmemDesc, SmemLayout, Special, StageRing, TileSlot, TmaDesc, U32, WgmmaN,
};

/// The warp-specialized frame of the sm90a forwards (16-bit and FP8): thread 0
/// initialises the Q, K and V rings' barriers (FULL: the producer's arrival plus the
/// bytes; EMPTY: one arrival per warp of the number of consumer warpgroups paired with
/// the ring) and the work queue's (causal kernels) while the block waits, then warpgroup
/// 0 runs `produce` and the consumer warpgroups `consume`.
pub(crate) fn split_roles(
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

/// What a consumer warpgroup thread knows about itself: which consumer warpgroup it is
/// in, its lane's role, its accumulator rows, and (with several consumer warpgroups) the
/// named-barrier ring they take turns at the tensor cores with.
#[derive(Clone, Copy)]
pub(crate) struct ConsumerRoles {
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
    pub(super) fn which(&self, k: &mut Kernel) -> Reg<U32> {
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

    /// A key tile's scores with nothing else in flight (the first tile of an item): in
    /// this warpgroup's turn, once the tile has landed in `kr`'s current stage, `issue`
    /// the product; hand the turn on and wait for it.
    pub fn scores_alone<N: WgmmaN>(
        &self,
        k: &mut Kernel,
        kr: &StageRing,
        issue: impl FnOnce(&mut Kernel, &StageRing) -> InFlight<N>,
    ) -> Acc<N> {
        self.wait_turn(k);
        kr.wait_full(k);
        let s = issue(k, kr);
        k.wgmma_commit();
        self.pass_turn(k);
        k.wgmma_wait(0);
        k.wgmma_retire(s)
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

/// What the roles share: parameters, shared memory, the kernel's shape.
pub(super) struct Fwd {
    pub(super) s: Shape,
    pub(super) causal: bool,
    /// A windowed kernel's tile masking ([`ItemLoop::window`]).
    pub(super) window: Option<WindowTiles>,
    /// The scale folded into the exponent ([`FwdConfig::fold_scale`](crate::kernels::attention::FwdConfig::fold_scale)).
    pub(super) fold_scale: bool,
    /// Soft-capped scores ([`FwdConfig::softcap`](crate::kernels::attention::FwdConfig::softcap)).
    pub(super) softcap: bool,
    /// Reads each sequence's used keys ([`FwdConfig::reads_used_keys`](crate::kernels::attention::FwdConfig::reads_used_keys)).
    pub(super) used_keys: bool,
    pub(super) args: ParamBytes,
    /// Q, K, V and O.
    pub(super) maps: [TmaDesc; 4],
    /// A padded kernel's last parameter: the tensors' head dim, below the kernel's. O's
    /// TMA store clips the columns past it; the direct stores (packed batches, or an O
    /// that TMA cannot describe) check them.
    pub(super) head_dim: Option<Param<U32>>,
    pub(super) smem: Smem,
    pub(super) slots: Slots,
}

impl Fwd {
    /// The work items, with this kernel's tile.
    pub(super) fn items(&self) -> ItemLoop<'_> {
        ItemLoop {
            args: self.args,
            smem: self.smem,
            queue: &self.slots.work,
            causal: self.causal,
            window: self.window,
            tile: (self.s.block_m, self.s.block_n),
            used_keys: self.used_keys,
            // Not the windowed kernels: with the branch, ptxas spills in those of head
            // dim 256 (they run the empty items, which write nothing).
            skip_empty: self.window.is_none(),
        }
    }
}

/// One side of the Q, K and V rings, kept across work items: the producer's, or a
/// consumer warpgroup's.
pub(crate) struct Rings {
    pub q: StageRing,
    pub k: StageRing,
    pub v: StageRing,
}

impl Rings {
    /// The producer's side of the Q, K and V rings `[q, k, v]`.
    pub fn producer(k: &mut Kernel, smem: Smem, rings: [&RingBarriers; 3]) -> Rings {
        let [q, kr, v] = rings.map(|ring| ring.producer(k, smem));
        Rings { q, k: kr, v }
    }

    /// A consumer warpgroup's side of the Q, K and V rings `[q, k, v]`.
    pub fn consumer(k: &mut Kernel, smem: Smem, rings: [&RingBarriers; 3]) -> Rings {
        let [q, kr, v] = rings.map(|ring| ring.consumer(k, smem));
        Rings { q, k: kr, v }
    }
}
