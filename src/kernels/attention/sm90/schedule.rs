//! Work items: which (query tile, head, batch) a block takes next, and how the producer
//! hands each one to the consumers.

use std::mem::offset_of;

use crate::kernels::attention::FwdArgs;
use crate::kernels::attention::mask::{
    KeyTiles, apply_mask, key_tiles, query_block, window_head_tiles, windowed_keys,
};
use crate::kernels::attention::rows::{Rows, Slab};
use crate::kernels::attention::sequence::{CacheReads, Sequence, sequence};
use crate::ptx::{
    Cmp, Kernel, ParamBytes, RawSlot, Reg, RingBarriers, S32, Smem, SmemAddr, SmemPlan, Special,
    StageRing, U32, U64,
};

/// A work item's coordinates and the parameters every role reads (shared with the FP8
/// kernel, [`sm90_fp8`](crate::kernels::attention::sm90_fp8)).
pub(crate) struct Block {
    pub batch: Reg<U32>,
    pub head: Reg<U32>,
    /// The query tile's first row, counted from its sequence's first.
    pub m_start: Reg<S32>,
    pub seq: Sequence,
    pub causal_offset: Reg<S32>,
    /// A windowed kernel's: row `i` sees keys from `i + low` on (`seq` rebased, see
    /// [`windowed_keys`]).
    pub low: Option<Reg<S32>>,
    /// A windowed kernel's key tiles `0..head_masked` that cut a row's window on the
    /// left ([`window_head_tiles`]); `tiles.mask_from` is at least it.
    pub head_masked: Option<Reg<S32>>,
    pub tiles: KeyTiles,
}

impl Block {
    /// Masks key tile `n` of `block_n` keys in `scores` (the accumulator rows `rows`
    /// holds): keys past the sequence's end and, in a causal kernel, past each row's
    /// diagonal (in a windowed one, also before each row's window).
    pub fn mask_tile(
        &self,
        k: &mut Kernel,
        (rows, scores): (&Rows, &[Slab]),
        (n, block_n): (Reg<S32>, u32),
        causal: bool,
    ) {
        let first_key = k.mul(n, block_n as i32);
        let causal = causal.then_some(self.causal_offset);
        let (m_start, seqlen_k) = (self.m_start, self.seq.seqlen_k);
        apply_mask(
            k, rows, scores, first_key, m_start, seqlen_k, causal, self.low,
        );
    }
}

/// A causal kernel's work items, handed from the producer to the consumers through shared
/// memory: a 2-stage ring of one item index each. The producer decides the order (a fixed
/// stride, or a counter shared by the grid), so every role sees the same items.
#[derive(Debug, Clone, Copy)]
pub struct WorkQueue {
    ring: RingBarriers,
    items: RawSlot,
    /// The consumer threads, each of which releases every item it takes.
    consumer_threads: u32,
}

impl WorkQueue {
    const STAGES: u32 = 2;

    pub fn plan(plan: &mut SmemPlan, consumer_threads: u32) -> WorkQueue {
        WorkQueue {
            ring: RingBarriers::plan(plan, Self::STAGES),
            items: plan.raw(4 * Self::STAGES, 4),
            consumer_threads,
        }
    }

    /// FULL: the producer's one arrival; EMPTY: every consumer thread's, each after its
    /// own read of the item.
    pub(super) fn init(&self, k: &mut Kernel, smem: &Smem) {
        self.ring.init(k, smem, 1, self.consumer_threads);
    }

    fn slot(&self, k: &mut Kernel, smem: Smem, ring: &StageRing) -> SmemAddr {
        let base = smem.raw(k, self.items);
        let at = k.shl(ring.stage(), 2);
        k.smem_offset(base, at)
    }
}

/// Which end of the [`WorkQueue`] a role holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Picks the items and publishes them (one thread).
    Producer,
    /// Takes them (every consumer thread).
    Consumer,
}

/// The persistent loop of an sm90a forward (16-bit or FP8): its argument block, shared
/// memory and work queue, whether it is causal, and its (query rows, keys) tile. See
/// [`ItemLoop::run`].
#[derive(Clone, Copy)]
pub(crate) struct ItemLoop<'a> {
    pub args: ParamBytes,
    pub smem: Smem,
    pub queue: &'a WorkQueue,
    pub causal: bool,
    /// A windowed kernel ([`FwdConfig::window`](crate::kernels::attention::FwdConfig::window)),
    /// causal too: whether it masks only the tiles at its windows' edges
    /// ([`FwdConfig::masks_window_edges_only`](crate::kernels::attention::FwdConfig::masks_window_edges_only))
    /// or every tile.
    pub window: Option<WindowTiles>,
    pub tile: (u32, u32),
    /// The kernel reads each sequence's used keys ([`FwdArgs::seqused_k`]; see
    /// [`FwdConfig::reads_used_keys`](crate::kernels::attention::FwdConfig::reads_used_keys)).
    pub used_keys: bool,
    /// Every role passes over the items that hold no query row: in a packed batch the
    /// grid is sized by the longest sequence, so the query tiles past a shorter one's
    /// end, and every tile of a sequence another launch takes, are empty.
    pub skip_empty: bool,
}

/// Which key tiles a windowed kernel masks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowTiles {
    Every,
    EdgesOnly,
}

impl ItemLoop<'_> {
    /// Runs `body` on each work item this block's `role` takes: [`for_each_item`].
    pub fn run(&self, k: &mut Kernel, role: Role, body: impl FnOnce(&mut Kernel, &Block)) {
        let queue = (self.queue, self.smem, role);
        let mask = (self.causal, self.window);
        let keys = (self.tile, self.used_keys);
        for_each_item(k, self.args, queue, mask, keys, self.skip_empty, body);
    }
}

/// A causal producer drawn item `item` (block `b`) of a sequence that holds no query row
/// in this launch (another launch takes it, as a serving batch's decode steps take
/// theirs): moves the tile counter past the rest of that sequence's items, whose tickets
/// would draw nothing else, so that the blocks go through them in one step rather than
/// an atomic and a hand-off each. A batch entry's items are consecutive up to
/// `tail_start`; the tail, numbered query tile by query tile, is walked item by item.
/// (Passing a short sequence's empty query tiles head by head as well measured slower on
/// variable-length prefill: 284 → 290 µs for lengths 4096 and 7 × 64, causal, Hq32 Hkv8
/// D128; an unmasked walk gains nothing, its gaps being shorter than its stride.)
fn pass_empty_sequence(
    k: &mut Kernel,
    b: &Block,
    item: Reg<U32>,
    [q_blocks, heads]: [Reg<U32>; 2],
    (tail_start, grid): (Reg<U32>, Reg<U32>),
    counter: Reg<U64>,
) {
    let none = k.setp(Cmp::Le, b.seq.seqlen_q, 0i32);
    let lead = k.setp(Cmp::Lt, item, tail_start);
    let pass = k.and_pred(none, lead);
    k.if_(pass, |k| {
        let next_batch = k.add(b.batch, 1u32);
        let next_batch = k.mul(next_batch, heads);
        let past = k.mul(next_batch, q_blocks);
        let past = k.min(past, tail_start);
        // Ticket `t` draws item `grid + t`.
        let drawn = k.setp(Cmp::Gt, past, grid);
        k.if_(drawn, |k| {
            let ticket = k.sub(past, grid);
            k.red_global_max_u32(counter, 0, ticket);
        });
    });
}

/// The persistent loop of the sm90a kernels. Work items are the
/// `q_blocks · heads · batch` (query tile of `block_m` rows, head, batch) triples (sizes
/// read from the [`FwdArgs`] at the start of `args`), visited with `block_n`-key tiles,
/// numbered head by head so that the blocks running at once share a few heads and each
/// head's K and V come from HBM once and then from L2 (taking one query tile of many heads
/// instead re-read every head's K and V once per query tile: B8 H16 S2048 D128 ran 20%
/// slower).
///
/// Without a mask the items cost the same, and every role steps through them by the grid
/// size on its own. With causal masking they do not (a query tile sees keys up to its
/// diagonal), so the producer picks them and hands them to the consumers through the
/// [`WorkQueue`]: item `blockIdx.x` first, then, when the launch passes a tile counter
/// (zeroed), `gridDim.x` plus a ticket from that counter, so the next item goes to
/// whichever block frees up first (without one, `item + gridDim.x`); finally one past the
/// end, which stops the consumers. Each head's heaviest query tiles (the last ones) come
/// first, and the last `tail_heads` heads are taken query tile by query tile across those
/// heads, heaviest first, so that the items left at the end of the grid are the lightest.
///
/// With `skip_empty`, `body` runs only on items that hold query rows, and a causal block's
/// producer, drawn an item of a sequence that holds none here, moves the counter past the
/// rest of that sequence's items before it takes its next ticket ([`pass_empty_sequence`]).
/// An unmasked walk steps by the grid regardless: its gaps (a head's or a sequence's
/// items) are rarely a whole stride long.
fn for_each_item(
    k: &mut Kernel,
    args: ParamBytes,
    (queue, smem, role): (&WorkQueue, Smem, Role),
    mask: (bool, Option<WindowTiles>),
    keys: ((u32, u32), bool),
    skip_empty: bool,
    body: impl FnOnce(&mut Kernel, &Block),
) {
    let causal = mask.0;
    let arg = |k: &mut Kernel, off| k.load_param_at::<U32>(args, off);
    let q_blocks = arg(k, offset_of!(FwdArgs, q_blocks));
    let heads = arg(k, offset_of!(FwdArgs, heads_q));
    let batch = arg(k, offset_of!(FwdArgs, batch));
    let head_batches = k.mul(heads, batch);
    let items = k.mul(head_batches, q_blocks);
    // Runs `body` on item `b`, or with `skip_empty` only if it holds query rows.
    let visit = |k: &mut Kernel, b: &Block| {
        if !skip_empty {
            return body(k, b);
        }
        let rows = k.setp(Cmp::Lt, b.m_start, b.seq.seqlen_q);
        k.if_(rows, |k| body(k, b));
    };
    if !causal {
        k.for_grid_stride(items.cast::<S32>(), |k, item| {
            let b = item_block(k, args, mask, keys, item.cast(), [q_blocks, heads]);
            visit(k, &b);
        });
        return;
    }
    let item = k.reg::<U32>();
    match role {
        Role::Producer => {
            let mut ring = queue.ring.producer(k, smem);
            let counter = k.load_param_at::<U64>(args, offset_of!(FwdArgs, tile_counter));
            let shared = k.setp(Cmp::Ne, counter, 0u64);
            let grid = k.special(Special::NctaidX);
            let publish = |k: &mut Kernel, ring: &mut StageRing, item: Reg<U32>| {
                ring.acquire(k);
                let at = queue.slot(k, smem, ring);
                k.st_shared::<U32>(at, 0, item);
                ring.arrive_full(k);
                ring.advance(k);
            };
            let first = k.special(Special::CtaidX);
            k.mov_to(item, first);
            publish(k, &mut ring, item);
            let more = |k: &mut Kernel| k.setp(Cmp::Lt, item, items);
            let tail_start = skip_empty.then(|| {
                let tail = k.load_param_at::<U32>(args, offset_of!(FwdArgs, tail_heads));
                let lead = k.sub(head_batches, tail);
                k.mul(lead, q_blocks)
            });
            k.while_(more, |k| {
                let b = item_block(k, args, mask, keys, item, [q_blocks, heads]);
                visit(k, &b);
                // The ticket is taken once this item's loads are issued; its latency
                // hides behind the consumers' last tiles.
                let next = k.add(item, grid);
                k.if_(shared, |k| {
                    if let Some(tail_start) = tail_start {
                        let ids = [q_blocks, heads];
                        pass_empty_sequence(k, &b, item, ids, (tail_start, grid), counter);
                    }
                    let ticket = k.atom_global_add_u32(counter, 0, 1u32);
                    k.add_to(next, ticket, grid);
                });
                k.mov_to(item, next);
                publish(k, &mut ring, item);
            });
        }
        Role::Consumer => {
            let mut ring = queue.ring.consumer(k, smem);
            let take = |k: &mut Kernel, ring: &mut StageRing| {
                ring.wait_full(k);
                let at = queue.slot(k, smem, ring);
                let taken = k.ld_shared::<U32>(at, 0);
                k.mov_to(item, taken);
                ring.release(k);
                ring.advance(k);
            };
            take(k, &mut ring);
            let more = |k: &mut Kernel| k.setp(Cmp::Lt, item, items);
            k.while_(more, |k| {
                let b = item_block(k, args, mask, keys, item, [q_blocks, heads]);
                visit(k, &b);
                take(k, &mut ring);
            });
        }
    }
}

/// The [`FastDivisor`](crate::ptx::FastDivisor) at byte `at` of the argument block, as
/// the (magic, shift) pair [`Kernel::div_fast`] takes. (Work items number below 2^31 on
/// this path, so every quotient of their decoding is exact.)
pub(crate) fn divisor(k: &mut Kernel, args: ParamBytes, at: usize) -> (Reg<U32>, Reg<U32>) {
    let magic = k.load_param_at::<U32>(args, at);
    let shift = k.load_param_at::<U32>(args, at + 4);
    (magic, shift)
}

/// The (query tile, head, batch) of work item `item`: head-batch-major with each head's
/// query tiles in a row, except, with causal masking, the last `tail_heads` head-batches,
/// which are query-tile-major (see [`for_each_item`]). A windowed kernel's item starts
/// at the first key tile its rows' windows reach ([`windowed_keys`]) and masks them all.
pub(super) fn item_block(
    k: &mut Kernel,
    args: ParamBytes,
    (causal, window): (bool, Option<WindowTiles>),
    ((block_m, block_n), used_keys): ((u32, u32), bool),
    item: Reg<U32>,
    [q_blocks, heads]: [Reg<U32>; 2],
) -> Block {
    let q_div = divisor(k, args, offset_of!(FwdArgs, q_blocks_div));
    let (mut hb, mut m_index) = k.div_rem_fast(item, q_blocks, q_div);
    if causal {
        let tail = k.load_param_at::<U32>(args, offset_of!(FwdArgs, tail_heads));
        let batch = k.load_param_at::<U32>(args, offset_of!(FwdArgs, batch));
        let head_batches = k.mul(heads, batch);
        let lead = k.sub(head_batches, tail);
        let lead_items = k.mul(lead, q_blocks);
        let in_lead = k.setp(Cmp::Lt, item, lead_items);
        let past = k.sub(item, lead_items);
        let across = k.max(tail, 1u32);
        // (Past the lead only: `past` wraps for the lead's items, whose quotient the
        // select drops.)
        let tail_div = divisor(k, args, offset_of!(FwdArgs, tail_div));
        let (m_tail, hb_tail) = k.div_rem_fast(past, across, tail_div);
        let hb_tail = k.add(hb_tail, lead);
        m_index = k.selp(m_index, m_tail, in_lead);
        hb = k.selp(hb, hb_tail, in_lead);
    }
    let heads_div = divisor(k, args, offset_of!(FwdArgs, heads_div));
    let (b, head) = k.div_rem_fast(hb, heads, heads_div);
    let m_block = query_block(k, m_index, q_blocks, causal);
    let m_start = k.mul(m_block.cast::<S32>(), block_m as i32);
    // The sm90 path's kernels that read the used keys also serve packed queries over a
    // cache ([`FwdConfig::cache_reads`](crate::kernels::attention::FwdConfig::cache_reads)).
    let cache = match used_keys {
        true => CacheReads::UnderPackedQueries,
        false => CacheReads::None,
    };
    let seq = sequence(k, args, b, cache);
    let (seq, causal_offset, low) = if window.is_some() {
        let w = windowed_keys(k, args, seq, m_start, block_n);
        (w.seq, w.offset, Some(w.low))
    } else {
        let offset = seq.causal_offset(k);
        (seq, offset, None)
    };
    let mask = causal.then_some(causal_offset);
    let (sq, sk) = (seq.seqlen_q, seq.seqlen_k);
    let mut tiles = key_tiles(k, sq, sk, m_start, block_m, block_n, mask);
    let head_masked = match (window, low) {
        (Some(WindowTiles::EdgesOnly), Some(low)) => {
            let head = window_head_tiles(k, m_start, (block_m, block_n), low, tiles.end);
            tiles.mask_from = k.max(tiles.mask_from, head);
            Some(head)
        }
        (Some(WindowTiles::Every), _) => {
            tiles.mask_from = k.mov(0i32);
            None
        }
        _ => None,
    };
    Block {
        batch: b,
        head,
        m_start,
        seq,
        causal_offset,
        low,
        head_masked,
        tiles,
    }
}
