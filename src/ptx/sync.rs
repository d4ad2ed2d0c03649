//! Block-level barriers, named barriers, fences and register reallocation.

use super::error::PtxError;
use super::kernel::{Kernel, Reg};
use super::target::Feature;
use super::types::U32;

/// A named barrier (`bar.sync id, threads`) that carries its thread count, so every use
/// agrees on it. Ids 1..=15 are handed out once each by [`Kernel::named_barrier`]; id 0
/// is the whole block's [`Kernel::sync_threads`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamedBarrier {
    id: u32,
    threads: u32,
}

/// Named barriers with consecutive ids, each for the same thread count, addressed by a
/// register index: the turns that warpgroups pass around (warpgroup `i` waits at member
/// `i` and, done, arrives at member `i + 1` mod `len`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarrierRing {
    first: NamedBarrier,
    len: u32,
}

impl BarrierRing {
    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Member `i` (a compile-time index).
    pub fn member(&self, i: u32) -> NamedBarrier {
        NamedBarrier {
            id: self.first.id + i,
            threads: self.first.threads,
        }
    }
}

impl NamedBarrier {
    pub fn id(&self) -> u32 {
        self.id
    }
    pub fn threads(&self) -> u32 {
        self.threads
    }
}

impl Kernel {
    /// `bar.sync id` for the whole block, or `bar.sync id, threads` for the first
    /// `threads` threads that arrive (a multiple of 32). Ids are 0..=15; 0 is `__syncthreads`.
    pub fn bar_sync(&mut self, id: u32, threads: Option<u32>) {
        if id > 15 {
            self.fail(PtxError::BadOperand(format!("barrier id {id} > 15")));
        }
        match threads {
            None => self.emit(format!("bar.sync {id};")),
            Some(n) => {
                if n == 0 || n % 32 != 0 {
                    self.fail(PtxError::BadOperand(format!("barrier thread count {n}")));
                }
                self.emit(format!("bar.sync {id}, {n};"));
            }
        }
    }

    /// `bar.warp.sync`: orders the lanes of this warp (all of them) at this point, so
    /// shared memory one lane wrote is seen by the others, and reads finish before writes.
    pub fn sync_warp(&mut self) {
        self.emit("bar.warp.sync 0xffffffff;".to_string());
    }

    /// `bar.sync 0`: every thread of the block.
    pub fn sync_threads(&mut self) {
        self.bar_sync(0, None);
    }

    /// A fresh named barrier for `threads` threads (a multiple of 32): the next free id in
    /// 1..=15. Running out of ids is an error at `finish`.
    pub fn named_barrier(&mut self, threads: u32) -> NamedBarrier {
        if threads == 0 || !threads.is_multiple_of(32) {
            self.fail(PtxError::BadOperand(format!(
                "named barrier for {threads} threads (a multiple of 32 needed)"
            )));
        }
        let used = self.sync.named_barriers;
        let id = (1..16).find(|i| used & (1 << i) == 0).unwrap_or_else(|| {
            self.fail(PtxError::BadOperand(
                "more than 15 named barriers".to_string(),
            ));
            15
        });
        self.sync.named_barriers |= 1 << id;
        NamedBarrier { id, threads }
    }

    /// `len` named barriers with consecutive ids, for warpgroups taking turns (ping-pong
    /// scheduling): member `i` is reached through a register holding `i`
    /// ([`Kernel::bar_wait_member`], [`Kernel::bar_arrive_member`]).
    pub fn named_barrier_ring(&mut self, len: u32, threads: u32) -> BarrierRing {
        let first = self.named_barrier(threads);
        for i in 1..len {
            let next = self.named_barrier(threads);
            if next.id != first.id + i {
                self.fail(PtxError::BadOperand(format!(
                    "named barrier ring got id {} after {}, not consecutive",
                    next.id, first.id
                )));
            }
        }
        BarrierRing { first, len }
    }

    /// Waits at member `which` (a register holding `0..ring.len()`) of a barrier ring.
    pub fn bar_wait_member(&mut self, ring: BarrierRing, which: Reg<U32>) {
        let id = self.add(which, ring.first.id);
        self.emit(format!("bar.sync {}, {};", id.name(), ring.first.threads));
    }

    /// Arrives (without waiting) at member `which` of a barrier ring.
    pub fn bar_arrive_member(&mut self, ring: BarrierRing, which: Reg<U32>) {
        let id = self.add(which, ring.first.id);
        self.emit(format!("bar.arrive {}, {};", id.name(), ring.first.threads));
    }

    /// Waits at `b` until its thread count has arrived (`bar.sync id, n`).
    pub fn bar_wait(&mut self, b: NamedBarrier) {
        self.emit(format!("bar.sync {}, {};", b.id, b.threads));
    }

    /// Arrives at `b` without waiting (`bar.arrive id, n`): the producer side of a
    /// named-barrier handshake.
    pub fn bar_arrive(&mut self, b: NamedBarrier) {
        self.emit(format!("bar.arrive {}, {};", b.id, b.threads));
    }

    /// `fence.acq_rel.gpu`: a release and acquire fence at GPU scope. Before an atomic
    /// ticket it publishes this thread's earlier writes (reductions included) to any
    /// thread that later observes the ticket; after one it makes the writes published
    /// by the tickets this thread observed visible to its later reads (the last block of
    /// a reduction reading everyone's sums).
    pub fn fence_acq_rel_gpu(&mut self) {
        self.emit("fence.acq_rel.gpu;".to_string());
    }

    /// `fence.proxy.async.shared::cta`: orders this thread's ordinary shared-memory
    /// accesses before later async-proxy (TMA, wgmma) accesses to the same memory.
    pub fn fence_proxy_async(&mut self) {
        self.requires(Feature::Hopper);
        self.emit("fence.proxy.async.shared::cta;".to_string());
    }

    /// `griddepcontrol.wait`: waits until the grids this one was launched behind
    /// (programmatically, see the host's PDL launch) have completed and their memory
    /// operations are visible. Without a programmatic launch there is nothing to wait
    /// for and it returns at once.
    pub fn grid_dependency_wait(&mut self) {
        self.requires(Feature::Hopper);
        self.emit("griddepcontrol.wait;".to_string());
    }

    /// `fence.mbarrier_init.release.cluster`: makes preceding `mbarrier.init`s visible to
    /// the async proxy and other threads (follow it with a block barrier).
    pub fn fence_mbarrier_init(&mut self) {
        self.requires(Feature::Hopper);
        if self.sync.unfenced_inits {
            self.sync.fenced_any = true;
        }
        self.sync.unfenced_inits = false;
        self.emit("fence.mbarrier_init.release.cluster;".to_string());
    }

    /// `setmaxnreg.inc`: this warpgroup's registers per thread grow to `regs` (24..=256, a
    /// multiple of 8). Needs `.maxntid` and `.minnctapersm` (checked at `finish`).
    pub fn setmaxnreg_inc(&mut self, regs: u32) {
        self.setmaxnreg("inc", regs);
    }

    /// `setmaxnreg.dec`: this warpgroup gives registers back, down to `regs` per thread.
    pub fn setmaxnreg_dec(&mut self, regs: u32) {
        self.setmaxnreg("dec", regs);
    }

    fn setmaxnreg(&mut self, dir: &str, regs: u32) {
        self.requires(Feature::Setmaxnreg);
        if !(24..=256).contains(&regs) || !regs.is_multiple_of(8) {
            self.fail(PtxError::BadOperand(format!(
                "setmaxnreg {regs}: must be a multiple of 8 in 24..=256"
            )));
        }
        self.sync.setmaxnreg = true;
        self.emit(format!("setmaxnreg.{dir}.sync.aligned.u32 {regs};"));
    }
}
