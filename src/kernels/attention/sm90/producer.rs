//! The producer warpgroup: TMA loads of Q, K and V into their rings.

use std::mem::offset_of;

use super::roles::{Fwd, Rings};
use super::schedule::{Block, ItemLoop, Role};
use crate::kernels::attention::FwdArgs;
use crate::ptx::{Cmp, Kernel, Reg, RingBarriers, S32, TmaDesc, U32};

/// Where a work item's tiles are in the tensor maps: its query head, the KV head its
/// group reads, its batch, and a zero for the coordinates that start at the origin.
#[derive(Clone, Copy)]
pub(crate) struct ItemAt {
    pub head: Reg<S32>,
    pub kv_head: Reg<S32>,
    pub batch: Reg<S32>,
    pub zero: Reg<S32>,
}

/// Warpgroup 0 of an sm90a forward (16-bit or FP8), at `regs` registers a thread: one
/// elected thread fetches the descriptors of the input `maps`, takes the producer side of
/// the Q, K and V `rings`, and runs `load` on each work item with at least one key tile;
/// the other producer warps only hand their registers back.
pub(crate) fn produce_items(
    k: &mut Kernel,
    (tid, regs): (Reg<U32>, u32),
    items: ItemLoop,
    (maps, rings): ([TmaDesc; 3], [&RingBarriers; 3]),
    load: impl FnOnce(&mut Kernel, &Block, ItemAt, &mut Rings),
) {
    k.setmaxnreg_dec(regs);
    k.elected_thread_of_warp_0(tid, |k| {
        // Fetch the load descriptors now rather than on the first load of each.
        for map in maps {
            k.tma_prefetch_desc(map);
        }
        let group = k.load_param_at::<U32>(items.args, offset_of!(FwdArgs, group));
        let zero = k.mov::<S32>(0i32);
        let mut rings = Rings::producer(k, items.smem, rings);
        items.run(k, Role::Producer, |k, b| {
            let any = k.setp(Cmp::Gt, b.tiles.end, 0i32);
            k.if_(any, |k| {
                let kv_head = k.div(b.head, group).cast::<S32>();
                let batch = b.seq.tensor_batch.cast::<S32>();
                let head = b.head.cast::<S32>();
                let at = ItemAt {
                    head,
                    kv_head,
                    batch,
                    zero,
                };
                load(k, b, at, &mut rings);
            });
        });
    });
}

/// The 16-bit kernels' producer: each work item's Q, then its K and V tiles, last first.
pub(super) fn produce(k: &mut Kernel, f: &Fwd, tid: Reg<U32>) {
    k.comment("Producer: TMA loads of Q, then K and V tiles, into their rings.");
    let inputs = (
        [f.maps[0], f.maps[1], f.maps[2]],
        [&f.slots.q_ring, &f.slots.k_ring, &f.slots.v_ring],
    );
    let producer = (tid, f.s.registers().0);
    produce_items(k, producer, f.items(), inputs, |k, b, at, rings| {
        let ItemAt {
            head,
            kv_head,
            batch,
            zero,
        } = at;
        let q_layout = f.s.q_layout();
        let mut load_q = |k: &mut Kernel| {
            rings.q.fill(k, q_layout.bytes(), |k, qr, full| {
                let q_at = qr.slot(k, f.slots.q);
                let q_row = k.add(b.seq.q_start, b.m_start);
                let coords = ([q_row, head, batch], zero);
                f.s.columns
                    .load_tile(k, (q_at, &q_layout), f.maps[0], coords, full);
            });
        };
        let kv_layout = f.s.kv_layout();
        let kv_bytes = kv_layout.bytes();
        let mut load_kv = |k: &mut Kernel, n: Reg<S32>| {
            let row = k.mad(n, f.s.block_n as i32, b.seq.k_start);
            let rings = [
                (&mut rings.k, f.slots.k, f.maps[1]),
                (&mut rings.v, f.slots.v, f.maps[2]),
            ];
            for (ring, slot, map) in rings {
                ring.fill(k, kv_bytes, |k, ring, full| {
                    let at = ring.slot(k, slot);
                    let coords = ([row, kv_head, batch], zero);
                    f.s.columns
                        .load_tile(k, (at, &kv_layout), map, coords, full);
                });
            }
        };
        let last = k.sub(b.tiles.end, 1i32);
        if f.s.o_in_q() {
            // Q's tile is free only after the last item's epilogue: the first K and V
            // tiles go ahead of it, so only Q's latency follows the epilogue.
            load_kv(k, last);
            load_q(k);
            let next = k.sub(last, 1i32);
            k.for_range(next, -1i32, -1, |k, n| load_kv(k, n));
        } else {
            load_q(k);
            k.for_range(last, -1i32, -1, |k, n| load_kv(k, n));
        }
    });
}
