//! mbarriers and the stage ring built on them.
//!
//! An mbarrier counts arrivals and (on Hopper) transaction bytes; a phase completes when
//! both reach zero, and waiters test the parity of the phase they expect. A
//! [`StageRing`] pairs a FULL and an EMPTY barrier per stage of a multi-buffered tile
//! pipeline: the producer waits EMPTY, announces the bytes its TMA copies will deliver
//! on FULL and issues them; the consumer waits FULL, reads, and arrives on EMPTY. Only
//! the ring holds the stage index and the phase bit, and only [`StageRing::advance`]
//! moves them, so a parity can never be confused with an index or a byte count.

use super::error::PtxError;
use super::kernel::{Kernel, Reg, Src};
use super::smem::{BarrierSlot, Mbarrier, Smem, SmemAddr, SmemPlan, TileSlot};
use super::target::Feature;
use super::types::*;

/// The phase parity a wait expects: a constant for barriers that complete once, or a
/// stage ring's own phase register.
#[derive(Debug, Clone, Copy)]
pub enum Parity {
    Zero,
    One,
    /// Owned by a [`StageRing`]; not constructible outside the builder.
    #[doc(hidden)]
    Ring(RingPhase),
}

/// A stage ring's phase register (opaque).
#[derive(Debug, Clone, Copy)]
pub struct RingPhase(Reg<U32>);

impl Parity {
    fn operand(&self) -> String {
        match self {
            Parity::Zero => "0".into(),
            Parity::One => "1".into(),
            Parity::Ring(RingPhase(r)) => r.name(),
        }
    }
    fn owner(&self) -> Option<u32> {
        match self {
            Parity::Ring(RingPhase(r)) => Src::<U32>::owner(r),
            _ => None,
        }
    }
}

impl Kernel {
    /// Refuses a barrier operation before any `mbarrier.init` was fenced.
    fn check_barrier_ready(&mut self, what: &str) {
        if !self.sync.fenced_any {
            self.fail(PtxError::BadSync(format!(
                "{what} before any mbarrier.init was followed by fence.mbarrier_init"
            )));
        }
    }

    /// `mbarrier.init`: the barrier's phase completes after `count` arrivals
    /// (1..2^20). Initialise from one thread, then [`Kernel::fence_mbarrier_init`] and a
    /// block barrier before anyone uses it.
    pub fn mbarrier_init(&mut self, bar: Mbarrier, count: u32) {
        self.requires(Feature::Hopper);
        if count == 0 || count >= 1 << 20 {
            self.fail(PtxError::BadOperand(format!(
                "mbarrier arrival count {count} outside 1..2^20"
            )));
        }
        self.check_owner(&[bar.owner()]);
        self.sync.unfenced_inits = true;
        self.emit(format!(
            "mbarrier.init.shared::cta.b64 [{}], {count};",
            bar.name()
        ));
    }

    /// One arrival (`mbarrier.arrive`).
    pub fn mbarrier_arrive(&mut self, bar: Mbarrier) {
        self.requires(Feature::Hopper);
        self.check_barrier_ready("mbarrier.arrive");
        self.check_owner(&[bar.owner()]);
        self.emit(format!(
            "mbarrier.arrive.shared::cta.b64 _, [{}];",
            bar.name()
        ));
    }

    /// Announces `bytes` of transactions (TMA copies completing on `bar`) and arrives
    /// once (`mbarrier.arrive.expect_tx`).
    pub fn mbarrier_arrive_expect_tx(&mut self, bar: Mbarrier, bytes: u32) {
        self.requires(Feature::Hopper);
        self.check_barrier_ready("mbarrier.arrive.expect_tx");
        if bytes >= 1 << 20 {
            self.fail(PtxError::BadOperand(format!(
                "expect_tx of {bytes} bytes: at most 2^20 - 1 per phase"
            )));
        }
        self.check_owner(&[bar.owner()]);
        self.emit(format!(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, [{}], {bytes};",
            bar.name()
        ));
    }

    /// Spins until the phase of parity `parity` of `bar` has completed
    /// (`mbarrier.try_wait.parity` in a loop).
    pub fn mbarrier_wait(&mut self, bar: Mbarrier, parity: Parity) {
        self.requires(Feature::Hopper);
        self.check_barrier_ready("mbarrier.try_wait");
        self.check_owner(&[bar.owner(), parity.owner()]);
        let top = self.label();
        let done = self.reg::<Pred>();
        self.place(top);
        self.emit(format!(
            "mbarrier.try_wait.parity.shared::cta.b64 {}, [{}], {};",
            done.name(),
            bar.name(),
            parity.operand()
        ));
        self.bra_if(done, false, top);
    }
}

/// The FULL and EMPTY barriers of a `stages`-deep ring, as laid out in a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingBarriers {
    full: BarrierSlot,
    empty: BarrierSlot,
    pub stages: u32,
}

impl RingBarriers {
    /// Reserves `2 · stages` mbarriers in `plan`.
    pub fn plan(plan: &mut SmemPlan, stages: u32) -> RingBarriers {
        RingBarriers {
            full: plan.mbarriers(stages),
            empty: plan.mbarriers(stages),
            stages,
        }
    }

    /// Initialises every barrier: FULL completes after `producer_arrivals` arrivals (plus
    /// the announced bytes), EMPTY after `consumer_arrivals`. Emits the
    /// `fence.mbarrier_init`; run it from one thread, then synchronise the block.
    pub fn init(
        &self,
        k: &mut Kernel,
        smem: &Smem,
        producer_arrivals: u32,
        consumer_arrivals: u32,
    ) {
        for s in 0..self.stages {
            let full = smem.barrier(k, self.full, s);
            k.mbarrier_init(full, producer_arrivals);
            let empty = smem.barrier(k, self.empty, s);
            k.mbarrier_init(empty, consumer_arrivals);
        }
        k.fence_mbarrier_init();
    }

    /// The producer's view: its first wait on each EMPTY barrier passes at once (phase 1).
    pub fn producer(&self, k: &mut Kernel, smem: Smem) -> StageRing {
        self.view(k, smem, 1)
    }

    /// The consumer's view: waits for FULL, starting with phase 0.
    pub fn consumer(&self, k: &mut Kernel, smem: Smem) -> StageRing {
        self.view(k, smem, 0)
    }

    fn view(&self, k: &mut Kernel, smem: Smem, phase: u32) -> StageRing {
        StageRing {
            bars: *self,
            smem,
            stage: k.mov(0u32),
            phase: RingPhase(k.mov(phase)),
        }
    }
}

/// One side (producer or consumer) of a multi-buffered pipeline: the current stage and
/// its phase, which only [`StageRing::advance`] changes.
#[derive(Debug)]
pub struct StageRing {
    bars: RingBarriers,
    smem: Smem,
    stage: Reg<U32>,
    phase: RingPhase,
}

impl StageRing {
    /// The current stage index (0..stages), for address arithmetic of the caller's own.
    pub fn stage(&self) -> Reg<U32> {
        self.stage
    }

    fn full(&self, k: &mut Kernel) -> Mbarrier {
        self.smem.barrier_at(k, self.bars.full, self.stage)
    }

    fn empty(&self, k: &mut Kernel) -> Mbarrier {
        self.smem.barrier_at(k, self.bars.empty, self.stage)
    }

    /// Producer: waits until the consumers have released the current stage.
    pub fn acquire(&self, k: &mut Kernel) {
        let bar = self.empty(k);
        k.mbarrier_wait(bar, Parity::Ring(self.phase));
    }

    /// Producer: the FULL barrier of the current stage, on which its TMA copies complete.
    pub fn full_barrier(&self, k: &mut Kernel) -> Mbarrier {
        self.full(k)
    }

    /// Producer: arrives on the current FULL barrier announcing `bytes` of copies (the
    /// full boxes, out-of-bounds fill included).
    pub fn arrive_expect_tx(&self, k: &mut Kernel, bytes: u32) {
        let bar = self.full(k);
        k.mbarrier_arrive_expect_tx(bar, bytes);
    }

    /// Producer: fills the current stage by asynchronous copies: waits until the consumers
    /// have released it, announces `bytes` on its FULL barrier, lets `load` issue the
    /// copies (given this ring, for [`StageRing::slot`], and the FULL barrier they
    /// complete on), and moves to the next stage.
    pub fn fill(
        &mut self,
        k: &mut Kernel,
        bytes: u32,
        load: impl FnOnce(&mut Kernel, &StageRing, Mbarrier),
    ) {
        self.acquire(k);
        self.arrive_expect_tx(k, bytes);
        let full = self.full_barrier(k);
        load(k, self, full);
        self.advance(k);
    }

    /// Producer: arrives on the current FULL barrier with no copies to wait for, having
    /// written the stage itself (the arrival releases those writes to the consumers).
    pub fn arrive_full(&self, k: &mut Kernel) {
        let bar = self.full(k);
        k.mbarrier_arrive(bar);
    }

    /// Consumer: waits until the current stage's data has landed.
    pub fn wait_full(&self, k: &mut Kernel) {
        let bar = self.full(k);
        k.mbarrier_wait(bar, Parity::Ring(self.phase));
    }

    /// Consumer: releases the current stage back to the producer (one arrival).
    pub fn release(&self, k: &mut Kernel) {
        let bar = self.empty(k);
        k.mbarrier_arrive(bar);
    }

    /// Moves to the next stage; the phase flips when the index wraps to 0.
    pub fn advance(&mut self, k: &mut Kernel) {
        let wrap = k.advance_stage(self.stage, self.bars.stages);
        let RingPhase(phase) = self.phase;
        let flipped = k.xor(phase, 1u32);
        k.selp_to(phase, flipped, phase, wrap);
    }

    /// The current stage's copy of `slot` (which must have one copy per stage).
    pub fn slot(&self, k: &mut Kernel, slot: TileSlot) -> SmemAddr {
        if slot.copies != self.bars.stages {
            k.fail(PtxError::BadShared(format!(
                "tile slot with {} copies used by a {}-stage ring",
                slot.copies, self.bars.stages
            )));
        }
        self.smem.tile_at(k, slot, self.stage)
    }
}
