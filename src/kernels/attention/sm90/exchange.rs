//! Split keys: the second consumer's partial result handed to the first and merged.

use super::roles::ConsumerRoles;
use super::roles::Fwd;
use super::roles::Rings;
use super::schedule::Block;
use crate::kernels::attention::softmax::OnlineSoftmax;
use crate::ptx::{
    Acc, Cmp, F32, Kernel, NamedBarrier, Pred, RawSlot, Reg, S32, Smem, Special, U32, WgmmaN,
};

/// Split keys ([`Shape::split_keys`](super::Shape::split_keys)): which key tiles each consumer warpgroup takes, and
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
pub(super) struct Exchange {
    slot: RawSlot,
    smem: Smem,
    which: Reg<U32>,
    /// This thread is in the first consumer warpgroup: it merges and writes the output.
    pub(super) first: Reg<Pred>,
    /// The parity of the ring position where the current item's tiles start.
    parity: Reg<U32>,
    written: NamedBarrier,
    read: NamedBarrier,
}

impl Exchange {
    /// The second warpgroup's ring views start one stage on: its first tile is the
    /// ring's second.
    pub(super) fn new(
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
    pub(super) fn first_tile(&self, k: &mut Kernel, b: &Block) -> Reg<S32> {
        let skip = k.xor(self.which, self.parity);
        let last = k.sub(b.tiles.end, 1i32);
        k.sub(last, skip.cast::<S32>())
    }

    /// The warpgroup with fewer tiles of item `b` takes empty turns until both have taken
    /// as many (one with `t > 0` tiles takes `t + 1`: its first `Q Kᵀ`, its steps, its
    /// last `P V`), so that the next item starts with the first warpgroup's turn. `first`
    /// is this warpgroup's first tile ([`Exchange::first_tile`]): it has `(first + 2) / 2`
    /// of the item's tiles.
    pub(super) fn even_turns(
        &self,
        k: &mut Kernel,
        b: &Block,
        first: Reg<S32>,
        roles: &ConsumerRoles,
    ) {
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
    pub(super) fn finish_item(&self, k: &mut Kernel, b: &Block) {
        let odd = k.and(b.tiles.end.cast::<U32>(), 1u32);
        k.xor_to(self.parity, self.parity, odd);
    }

    /// Leaves the first warpgroup's `o` and `softmax` holding both warpgroups' result.
    pub(super) fn merge<N: WgmmaN>(
        &self,
        k: &mut Kernel,
        o: &Acc<N>,
        softmax: &OnlineSoftmax,
        c: Reg<F32>,
    ) {
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
