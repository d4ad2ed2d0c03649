//! The consumer warpgroups: S = QKᵀ, the online softmax, O += PV, and the epilogue.

use std::mem::offset_of;

use super::exchange::Exchange;
use super::roles::Fwd;
use super::roles::{ConsumerRoles, Rings};
use super::schedule::{Block, Role};
use crate::kernels::attention::FwdArgs;
use crate::kernels::attention::epilogue::{LseForm, OutputBlock, store_output_staged};
use crate::kernels::attention::mask::{causal_key_limit, row_key_limit};
use crate::kernels::attention::rows::Slab;
use crate::kernels::attention::softcap;
use crate::kernels::attention::softmax::{
    OnlineSoftmax, pack_probs_into, rescale_moved_rows, rescale_rows,
};
use crate::ptx::{
    Acc, Cmp, F32, Half2, InFlight, KMajor, Kernel, MnMajor, NamedBarrier, Reg, S32, ScaleD,
    SmemDesc, Special, StageRing, U32, WgmmaD, WgmmaInput, WgmmaN,
};

/// A consumer warpgroup's registers and roles for one work item.
pub(super) struct Consumer<'a, H: Half2> {
    f: &'a Fwd,
    b: &'a Block,
    roles: ConsumerRoles,
    /// This warpgroup's 64 rows of the Q tile (the Q ring has one stage).
    q: SmemDesc<KMajor>,
    scale_log2: Reg<F32>,
    /// Soft-capping kernels: the factor inside the `tanh` ([`FwdArgs::softcap_pre`]).
    softcap_pre: Option<Reg<F32>>,
    softmax: OnlineSoftmax,
    /// Each row's pending rescale of O, from the last softmax.
    factors: [Reg<F32>; 2],
    /// P of the last softmax, as the A fragments of the next `P V`.
    p: Vec<[Reg<H>; 4]>,
    /// The consumer threads that share a V stage meet here once they have zeroed its
    /// rows past a packed sequence's end ([`Consumer::zero_v_past_end`]).
    v_zeroed: NamedBarrier,
}

/// How a warpgroup meets the others at the barrier after zeroing V rows past a packed
/// sequence's end.
#[derive(Debug, Clone, Copy)]
enum Meet {
    /// It reads the tile next: it waits until every thread sharing the stage has zeroed.
    Wait,
    /// It passes the tile by: it only tells the others that its share is zeroed.
    ArriveOnly,
}

/// Warpgroups 1 and 2: the attention itself, for 64 query rows each of every work item.
pub(super) fn consume<H, NS, NO>(k: &mut Kernel, f: &Fwd, tid: Reg<U32>)
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
    let softcap_pre = f
        .softcap
        .then(|| k.load_param_at::<F32>(f.args, offset_of!(FwdArgs, softcap_pre)));
    let o_in_q = f.s.o_in_q();
    let stage = roles.output_stage(f.smem, f.slots.o, (f.maps[3], f.s.columns), o_in_q);
    let ring_barriers = [&f.slots.q_ring, &f.slots.k_ring, &f.slots.v_ring];
    let mut rings = Rings::consumer(k, f.smem, ring_barriers);
    let exchange = f
        .slots
        .exchange
        .map(|slot| Exchange::new(k, f, &roles, slot, &mut rings));
    let v_zeroed = k.named_barrier(128 * f.s.kv_consumers());
    f.items().run(k, Role::Consumer, |k, b| {
        let c = Consumer {
            f,
            b,
            roles,
            q,
            scale_log2,
            softcap_pre,
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
        let last = if self.may_see_none_of_last_tile() {
            let last = k.mov::<S32>(first);
            self.pass_unseen_tile(k, kr, vr, last);
            last
        } else {
            first
        };

        let s = self
            .roles
            .scores_alone(k, kr, |k, kr| self.scores::<NS>(k, kr));
        self.release_kv(k, kr);
        let tiles = s.tiles();
        self.cap(k, &tiles);
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
        self.zero_v_past_end(k, vr, last, Meet::Wait);

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
        let o = match self.b.head_masked {
            None => k.for_range_carry(first_unmasked, -1i32, -stride, o, |k, n, o| {
                self.step::<NS, NO>(k, n, false, o, kr, vr)
            }),
            // A window (never with split keys): the unmasked tiles end where the tiles
            // that cut a row's window on the left begin.
            Some(head) => {
                let head_end = k.sub(head, 1i32);
                let o = k.for_range_carry(first_unmasked, head_end, -1, o, |k, n, o| {
                    self.step::<NS, NO>(k, n, false, o, kr, vr)
                });
                k.comment("Tiles that cut a row's window on the left.");
                let top = k.min(head, last);
                let top = k.sub(top, 1i32);
                k.for_range_carry(top, -1i32, -1, o, |k, n, o| {
                    self.step::<NS, NO>(k, n, true, o, kr, vr)
                })
            }
        };
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

    /// Whether this kernel's warpgroups can differ in their last visible key tile: causal,
    /// with two warpgroups on different rows of an item, whose last tile is that of its
    /// last row. (The first warpgroup's rows end 64 keys before the item's last, so with
    /// tiles of 64 keys or more only the last tile can be unseen. The three-consumer
    /// kernels, at 160 registers, spilled 12–16 bytes with the check.)
    fn may_see_none_of_last_tile(&self) -> bool {
        let s = &self.f.s;
        self.f.causal && !s.split_keys && s.consumers() == 2
    }

    /// Where none of this warpgroup's rows sees key tile `last` (the item's last, there
    /// for the item's later rows; at least one tile below it), the warpgroup passes it
    /// by: it takes its turn with nothing to issue, so that the turns keep alternating,
    /// and releases the tile's K and V stages once they have landed. `last` then names
    /// the tile below. The tile's scores and `P V` would cost a whole tile of tensor-core
    /// time and exponentials for nothing but zeros.
    ///
    /// In packed batches the tile may hold the sequence's end, whose V rows past it the
    /// warpgroups sharing the stage zero before the other warpgroup's `P V` reads them
    /// ([`Consumer::zero_v_past_end`]). The passing warpgroup zeroes its share too, and
    /// only arrives at their barrier: the other waits there from its own site, and
    /// waiting at one barrier from two `bar.sync` sites is what compute-sanitizer's
    /// synccheck reports as divergent.
    fn pass_unseen_tile(
        &self,
        k: &mut Kernel,
        kr: &mut StageRing,
        vr: &mut StageRing,
        last: Reg<S32>,
    ) {
        let b = self.b;
        // The warpgroup's last row: 64 per warpgroup, the rows in turn.
        let which = self.roles.which(k);
        let wg_last = k.mad(which, 64u32, 63u32);
        let row = k.add_sat(b.m_start, wg_last.cast::<S32>());
        let limit = causal_key_limit(k, row, b.seq.seqlen_k, b.causal_offset);
        let first_key = k.mul(last, self.f.s.block_n as i32);
        let unseen = k.setp(Cmp::Ge, first_key, limit);
        let below = k.setp(Cmp::Gt, last, 0i32);
        let pass = k.and_pred(unseen, below);
        k.if_(pass, |k| {
            k.comment("No row of this warpgroup sees the item's last key tile: pass it by.");
            self.roles.wait_turn(k);
            self.roles.pass_turn(k);
            kr.wait_full(k);
            self.release_kv(k, kr);
            self.zero_v_past_end(k, vr, last, Meet::ArriveOnly);
            vr.wait_full(k);
            self.release_kv(k, vr);
            let next = k.sub(last, 1i32);
            k.mov_to(last, next);
        });
    }

    /// Packed sequences: key tile `last` (this warpgroup's first) may run past its
    /// sequence's end, and TMA then brings the rows that follow (the next sequence's, or
    /// after the last sequence whatever the buffer holds there) instead of zeros. Their
    /// probabilities are exactly 0, but `0 · v` is NaN where `v` is infinite or NaN, so
    /// before any `P V` reads the tile, the warpgroups that share its V stage zero those
    /// rows: whole 128-byte rows of every column block (the swizzle only permutes the
    /// 16-byte chunks within a row), each thread a chunk per pass, then a proxy fence
    /// (the tensor cores read through the async proxy) and a barrier among them, which
    /// a warpgroup that will not read the tile only arrives at (`meet`).
    fn zero_v_past_end(&self, k: &mut Kernel, vr: &StageRing, last: Reg<S32>, meet: Meet) {
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
            match meet {
                Meet::Wait => k.bar_wait(self.v_zeroed),
                Meet::ArriveOnly => k.bar_arrive(self.v_zeroed),
            }
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
        self.cap(k, &s.tiles());
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
    /// with the scale folded into the exponent or not ([`FwdConfig::fold_scale`](crate::kernels::attention::FwdConfig::fold_scale)).
    fn exponentiate<NS: WgmmaN>(&self, k: &mut Kernel, s: &Acc<NS>) {
        self.exponentiate_tiles(k, &s.tiles());
    }

    /// [`Consumer::exponentiate`] on some of the tile's 8-column tiles.
    fn exponentiate_tiles(&self, k: &mut Kernel, tiles: &Slab) {
        let (tiles, factors) = ([tiles.clone()], [self.factors]);
        if self.f.fold_scale {
            let lag = self.max_lag();
            self.softmax
                .update_scaled(k, &tiles, self.scale_log2, 0.0, lag, &factors);
        } else {
            self.softmax.update(k, &tiles, self.scale_log2, &factors);
        }
    }

    /// How far a row's running maximum may trail ([`Shape::max_lag`](super::shape::Shape::max_lag)):
    /// only where the scale is folded into the exponent, whose softmax
    /// ([`OnlineSoftmax::update_scaled`]) is the one that lags.
    fn max_lag(&self) -> Option<f32> {
        self.f.s.max_lag().filter(|_| self.f.fold_scale)
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
        if self.max_lag().is_some() {
            rescale_moved_rows(k, &o.tiles(), self.factors);
        } else {
            rescale_rows(k, &[o.tiles()], &[self.factors]);
        }
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

    /// Soft-capping kernels: the scores capped ([`softcap::cap_scores`]), before the mask.
    fn cap(&self, k: &mut Kernel, tiles: &Slab) {
        if let Some(pre) = self.softcap_pre {
            softcap::cap_scores(k, tiles, pre);
        }
    }

    /// The mask of key tile `n` on this warpgroup's scores.
    fn mask<NS: WgmmaN>(&self, k: &mut Kernel, s: &Acc<NS>, n: Reg<S32>) {
        self.mask_tiles(k, &s.tiles(), n);
    }

    /// [`Consumer::mask`] on some of the tile's 8-column tiles, from its first.
    fn mask_tiles(&self, k: &mut Kernel, tiles: &Slab, n: Reg<S32>) {
        let scores = (&self.roles.rows, std::slice::from_ref(tiles));
        let tile = (n, self.f.s.block_n);
        self.b.mask_tile(k, scores, tile, self.f.causal);
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

/// A descriptor moved by `bytes` (nothing emitted for 0).
pub(crate) fn advance<M: crate::ptx::Major>(
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
