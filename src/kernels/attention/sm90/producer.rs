//! The producer warpgroup: TMA loads of Q, K and V into their rings.

use std::mem::offset_of;

use super::roles::Fwd;
use super::schedule::Role;
use crate::kernels::attention::FwdArgs;
use crate::ptx::{Cmp, Kernel, Reg, S32, U32};

/// Warpgroup 0: one elected thread loads each work item's Q and streams its K and V,
/// last tile first; the other producer warps only hand their registers back.
pub(super) fn produce(k: &mut Kernel, f: &Fwd, tid: Reg<U32>) {
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
