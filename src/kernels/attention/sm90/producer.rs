//! The producer warpgroup: TMA loads of Q, K and V into their rings.

use std::mem::offset_of;

use super::roles::{Fwd, Rings};
use super::schedule::{Block, ItemLoop, Role, divisor};
use crate::kernels::attention::FwdArgs;
use crate::ptx::{
    Cmp, Kernel, Mbarrier, Pred, Reg, RingBarriers, S32, SmemAddr, SmemLayout, TmaDesc, U32, U64,
};

/// Where a work item's tiles are in the tensor maps: its query head, the KV head its
/// group reads, its batch, and a zero for the coordinates that start at the origin.
#[derive(Clone, Copy)]
pub(crate) struct ItemAt {
    pub head: Reg<S32>,
    pub kv_head: Reg<S32>,
    /// Q's and O's batch index, and K's and V's (see [`Sequence::kv_batch`]).
    ///
    /// [`Sequence::kv_batch`]: super::super::sequence::Sequence::kv_batch
    pub batch: Reg<S32>,
    pub kv_batch: Reg<S32>,
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
        let group = divisor(k, items.args, offset_of!(FwdArgs, group_div));
        let zero = k.mov::<S32>(0i32);
        let mut rings = Rings::producer(k, items.smem, rings);
        items.run(k, Role::Producer, |k, b| {
            let any = k.setp(Cmp::Gt, b.tiles.end, 0i32);
            k.if_(any, |k| {
                let kv_head = k.div_fast(b.head, group).cast::<S32>();
                let batch = b.seq.tensor_batch.cast::<S32>();
                let kv_batch = b.seq.kv_batch.cast::<S32>();
                let head = b.head.cast::<S32>();
                let at = ItemAt {
                    head,
                    kv_head,
                    batch,
                    kv_batch,
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
            kv_batch,
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
                    let load_tensor = |k: &mut Kernel| {
                        let coords = ([row, kv_head, kv_batch], zero);
                        f.s.columns
                            .load_tile(k, (at, &kv_layout), map, coords, full);
                    };
                    // Only a kernel that reads the sequences' used keys serves a paged
                    // cache (whose lengths they are).
                    if !f.used_keys {
                        return load_tensor(k);
                    }
                    let table = k.load_param_at::<U64>(f.args, offset_of!(FwdArgs, block_table));
                    let paged = k.setp(Cmp::Ne, table, 0u64);
                    k.if_else(
                        paged,
                        |k| {
                            let tile = (at, &kv_layout, map, full);
                            load_paged_tile(k, f, tile, (row, kv_head), b, table);
                        },
                        load_tensor,
                    );
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

/// The comment ahead of each TMA of a paged cache's chunk (the tests count them).
pub(super) const PAGED_LOAD: &str = "a paged cache's chunk";

/// A K or V tile of a paged cache (a pool `[pages, page_size, Hkv, D]` whose map's
/// "batch" is the page; [`FwdArgs::block_table`]): in chunks of `2^min(page_shift,
/// tz(block_n))` rows, each inside one page (the tile starts at a multiple of `block_n`,
/// the chunks at multiples of their size, which divides the page), one TMA per chunk and
/// 64-column block into the tile's rows. Past two chunks a tile, their table entries
/// are all loaded before their TMAs (up to `block_n / 16`: pages of 16), so that the
/// loads' latencies overlap. A chunk at or past the sequence's used keys, or past the
/// block table's row, takes a page coordinate past the pool: TMA zero-fills it and
/// counts its bytes, and no table entry beyond the sequence's is read. An entry the
/// host never checked is bounded the same way by the hardware: a page outside the pool
/// reads as zeros. Pages must hold at least 16 rows (the host sends smaller ones to the
/// decode kernels): each chunk then lands on a whole 1024-byte swizzle pattern, and a
/// tile has at most the `block_n / 16` chunks whose entries are loaded ahead.
fn load_paged_tile(
    k: &mut Kernel,
    f: &Fwd,
    (at, layout, map, full): (SmemAddr, &SmemLayout, TmaDesc, Mbarrier),
    (row, kv_head): (Reg<S32>, Reg<S32>),
    b: &Block,
    table: Reg<U64>,
) {
    let arg = |k: &mut Kernel, at: usize| k.load_param_at::<U32>(f.args, at);
    let page_shift = arg(k, offset_of!(FwdArgs, page_shift));
    let block_n = f.s.block_n;
    let chunk_shift = k.min(page_shift, block_n.trailing_zeros());
    let rows = k.mov::<U32>(block_n);
    let chunks = k.shr_by(rows, chunk_shift).cast::<S32>();
    let one = k.mov::<U32>(1u32);
    let page_mask = k.shl_by(one, page_shift);
    let page_mask = k.sub(page_mask, 1u32).cast::<S32>();
    // (A windowed kernel's keys start at `k_start`, the tiles its rows skip.)
    let end = k.add(b.seq.k_start, b.seq.seqlen_k);
    let max_pages = arg(k, offset_of!(FwdArgs, max_pages)).cast::<S32>();
    let stride = arg(k, offset_of!(FwdArgs, table_stride));
    let table_row = k.mul_wide_u32(b.seq.kv_batch, stride);
    let table_row = k.shl(table_row, 2);
    let table_row = k.add(table, table_row);
    let key_of = |k: &mut Kernel, c: u32| {
        let c = k.mov::<S32>(c as i32);
        let first = k.shl_by(c, chunk_shift);
        (first, k.add(row, first))
    };
    // The chunk's TMAs, one per 64-column block, into its rows of the tile.
    let issue = |k: &mut Kernel, first: Reg<S32>, key: Reg<S32>, page: Reg<S32>| {
        let in_page = k.and(key, page_mask);
        // Rows into the tile: the chunk's first row, times 128 bytes a row.
        let offset = k.shl(first.cast::<U32>(), 7);
        let at = k.smem_offset(at, offset);
        for block in 0..layout.col_blocks() {
            let dst = match block {
                0 => at,
                b => k.smem_offset(at, b * layout.rows * layout.block_bytes),
            };
            let coords = f.s.columns.coords(k, block, [in_page, kv_head, page]);
            k.comment(PAGED_LOAD);
            k.tma_load(dst, map, coords, full);
        }
    };
    let entry_of = |k: &mut Kernel, key: Reg<S32>, some: Option<Reg<Pred>>| {
        let page_index = k.shr_by(key, page_shift);
        let used = k.setp(Cmp::Lt, key, end);
        let listed = k.setp(Cmp::Lt, page_index, max_pages);
        let read = k.and_pred(used, listed);
        let read = match some {
            Some(some) => k.and_pred(read, some),
            None => read,
        };
        let page = k.mov::<S32>(i32::MAX);
        let entry = k.mul_wide_u32(page_index.cast::<U32>(), 4u32);
        let entry = k.add(table_row, entry);
        k.guarded(read, true, |k| k.ld_global_into(page, entry, 0));
        page
    };
    let one_by_one = |k: &mut Kernel| {
        k.for_range(0i32, chunks, 1, |k, c| {
            let first = k.shl_by(c, chunk_shift);
            let key = k.add(row, first);
            let page = entry_of(k, key, None);
            issue(k, first, key, page);
        });
    };
    let ahead = |k: &mut Kernel| {
        let pages: Vec<Reg<S32>> = (0..block_n / 16)
            .map(|c| {
                let (_, key) = key_of(k, c);
                let some = k.setp(Cmp::Gt, chunks, c as i32);
                entry_of(k, key, Some(some))
            })
            .collect();
        for (c, page) in pages.into_iter().enumerate() {
            let some = k.setp(Cmp::Gt, chunks, c as i32);
            k.if_(some, |k| {
                let (first, key) = key_of(k, c as u32);
                issue(k, first, key, page);
            });
        }
    };
    // Entries ahead pay for small pages (on the H200, B4 Hq32 Hkv8 Sq1024 Skv8192 D128
    // causal, pages of 16: 876 µs against 968 one by one) but not for one or two chunks
    // (pages of 64: 813 against 778); a producer of 24 registers spills with them.
    if f.s.registers().0 <= 24 {
        return one_by_one(k);
    }
    let few = k.setp(Cmp::Le, chunks, 2i32);
    k.if_else(few, one_by_one, ahead);
}
