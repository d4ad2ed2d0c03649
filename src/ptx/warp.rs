//! Warp-level operations: shuffles and leader election.

use super::error::PtxError;
use super::kernel::{Cmp, Kernel, Reg, Src};
use super::target::Feature;
use super::types::*;

impl Kernel {
    /// `shfl.sync.bfly.b32` over the full warp: the value of lane `lane ^ lane_mask`.
    /// Masks 1 and 2 reduce across the 4 lanes of an `mma` quad (one accumulator row).
    pub fn shfl_bfly<T: Word32>(&mut self, v: Reg<T>, lane_mask: u32) -> Reg<T> {
        if lane_mask >= 32 {
            self.fail(PtxError::BadOperand(format!(
                "shfl lane mask {lane_mask} >= 32"
            )));
        }
        self.check_owner(&[Src::<T>::owner(&v)]);
        let d = self.reg::<T>();
        self.emit(format!(
            "shfl.sync.bfly.b32 {}, {}, {lane_mask}, 0x1f, 0xffffffff;",
            d.name(),
            v.name()
        ));
        d
    }

    /// `vote.sync.all.pred` over the full warp: true in every lane when `p` is true in
    /// every lane. Makes a per-thread condition warp-uniform (for a branch around
    /// shuffles, which need the whole warp).
    pub fn vote_all(&mut self, p: Reg<Pred>) -> Reg<Pred> {
        self.vote("all", p)
    }

    /// `vote.sync.any.pred` over the full warp: true in every lane when `p` is true in
    /// some lane. A branch the whole warp takes when any lane needs it.
    pub fn vote_any(&mut self, p: Reg<Pred>) -> Reg<Pred> {
        self.vote("any", p)
    }

    /// `vote.sync.{mode}.pred` over the full warp.
    fn vote(&mut self, mode: &str, p: Reg<Pred>) -> Reg<Pred> {
        self.check_owner(&[Src::<Pred>::owner(&p)]);
        let d = self.reg::<Pred>();
        self.emit(format!(
            "vote.sync.{mode}.pred {}, {}, 0xffffffff;",
            d.name(),
            p.name()
        ));
        d
    }

    /// `elect.sync`: true in exactly one lane of the (fully active) warp, the same lane
    /// in every call. The lane that issues a warp's TMA copies and barrier arrivals.
    pub fn elect_one(&mut self) -> Reg<Pred> {
        self.requires(Feature::Hopper);
        let p = self.reg::<Pred>();
        self.emit(format!("elect.sync _|{}, 0xffffffff;", p.name()));
        p
    }

    /// Runs `body` in one thread of the block's first warp, the lane `elect.sync` picks
    /// (`tid` is `%tid.x`): the thread that issues a producer warpgroup's TMA copies.
    pub fn elected_thread_of_warp_0(&mut self, tid: Reg<U32>, body: impl FnOnce(&mut Self)) {
        let warp = self.shr(tid, 5);
        let first_warp = self.setp(Cmp::Eq, warp, 0u32);
        self.if_(first_warp, |k| {
            let leader = k.elect_one();
            k.if_(leader, body);
        });
    }
}
