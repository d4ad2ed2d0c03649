//! The end of a forward block: O divided by the row sums, written to global memory as
//! 16-bit pairs, and the log-sum-exp.
//!
//! `LSE = ln(l) + m·scale`, computed as `ln2·log2(l) + m·scale` so that it overflows only
//! when the true value does. A row that saw no key (l = 0) gets O = 0 and LSE = −∞.
//! Row indices are unsigned and the LSE index is 64-bit: rows past `Sq` (the padding of
//! the last block) are compared, never wrapped, and `(b·Hq + h)·Sq + row` may exceed 2^32.
//! Packed batches put a sequence's rows after its first query row `q_start`, in O and in
//! the `[Hq, total_q]` LSE alike.

use std::mem::offset_of;

use super::FwdArgs;
use super::rows::{Rows, Slab, half_of};
use super::sequence::Sequence;
use super::sm90::shape::MapColumns;
use super::softmax::OnlineSoftmax;
use crate::ptx::{
    Cmp, F32, Half2, Kernel, ParamBytes, Pred, Reg, S32, Smem, SmemAddr, Special, TileSlot,
    TmaDesc, U32, U64,
};

/// The per-block inputs of [`store_output`].
#[derive(Debug, Clone, Copy)]
pub struct OutputBlock {
    pub batch: Reg<U32>,
    pub head: Reg<U32>,
    /// The block's first query row, counted from the sequence's first.
    pub m_start: Reg<S32>,
    pub seq: Sequence,
}

/// How a kernel's running maxima relate to the log-sum-exp.
#[derive(Debug, Clone, Copy)]
pub enum LseForm {
    /// Maxima of the raw scores: `LSE = m·scale + ln l`.
    Raw,
    /// Maxima in log2 units of the scaled scores (`m = max(s)·scale·log2 e`: the sm90
    /// kernels with the scale folded into the exponent): `LSE = ln2·(m + log2 l)`.
    Folded,
    /// Maxima in log2 units of the scaled scores, probabilities scaled by `2^offset`
    /// (the FP8 kernels): `LSE = ln2·(m + log2 l − offset)`, plus `scale · shift[row]`
    /// when `shift` (the address of an f32 array indexed like the dense LSE) is not 0.
    Log2 { offset: f32, shift: Reg<U64> },
}

/// Normalises `o` by the row sums, stores the rows that exist (`row < Sq`) and, when the
/// caller passed an LSE pointer, the log-sum-exp of each row.
pub fn store_output<H: Half2>(
    k: &mut Kernel,
    args: ParamBytes,
    rows: &Rows,
    o: &[Slab],
    softmax: &OnlineSoftmax,
    at: OutputBlock,
    columns: Option<Reg<U32>>,
) {
    k.comment("Epilogue: O / l to global memory, and the log-sum-exp.");
    let out = Destination::new(k, args, rows, at, LseForm::Raw);
    let out = Destination { columns, ..out };
    store_rows::<H>(k, &out, o, softmax);
}

/// [`store_output`] with the maxima in the form `form`.
pub fn store_output_lse<H: Half2>(
    k: &mut Kernel,
    args: ParamBytes,
    rows: &Rows,
    o: &[Slab],
    softmax: &OnlineSoftmax,
    at: OutputBlock,
    form: LseForm,
) {
    k.comment("Epilogue: O / l to global memory, and the log-sum-exp.");
    let out = Destination::new(k, args, rows, at, form);
    store_rows::<H>(k, &out, o, softmax);
}

/// O / l to global memory through `out`, and the log-sum-exp.
fn store_rows<H: Half2>(k: &mut Kernel, out: &Destination, o: &[Slab], softmax: &OnlineSoftmax) {
    for (slab, tiles) in o.iter().enumerate() {
        for half in 0..2 {
            let (sum, empty, inv) = reciprocal(k, softmax, slab, half);
            let row = out.row(k, slab, half);
            let words = pack::<H>(k, tiles, half, inv);
            out.store_words(k, row, &words);
            out.store_lse(k, softmax, slab, half, (sum, empty), row);
        }
    }
}

/// Where a warp of the sm90a forwards stages its 16 rows of O (one [`Slab`]) for a TMA
/// store: its rows of a `BLOCK_M × d` tile laid out as the tile Q arrives in
/// (`[d/64][BLOCK_M][128 B]`, 128-byte swizzle), sent out as one `{64, 16}` box per
/// column block through `map` (a 5-D `{64, seq, d/64, heads, batch}` view of O). The
/// hardware clips the rows past the sequence end.
///
/// The warp's place is derived from `%tid.x` when the epilogue runs, so that nothing of
/// it stays live through the key loop (the d = 256 kernels have no register to spare).
#[derive(Debug, Clone, Copy)]
pub struct OutputStage {
    pub smem: Smem,
    /// The staging tile (the block's, not the warp's).
    pub tile: TileSlot,
    pub map: TmaDesc,
    /// How `map` addresses the column blocks (one box per block where O's head dim is
    /// below the kernel's, whose extra columns the store clips).
    pub columns: MapColumns,
    /// Lane 0 of the warp: it issues the stores.
    pub leader: Reg<Pred>,
    /// The first thread of the warps that hold O: warp `w` from there holds rows
    /// `16w..16w + 16` of the tile.
    pub first_thread: u32,
    /// The tile is not the warp's alone between work items (it is Q's): the store must
    /// have read it before the epilogue returns. Otherwise the next epilogue waits.
    pub shared: bool,
}

impl OutputStage {
    /// Writes the warp's slab `o` times each row half's `inv`, as 16-bit pairs, into the
    /// warp's rows with `stmatrix` (converting a tile pair at a time: O is freed as it
    /// goes), then one lane sends each column block out to `coords` (the tile's first
    /// row, head, batch) plus the warp's rows.
    fn send<H: Half2>(&self, k: &mut Kernel, o: &Slab, inv: [Reg<F32>; 2], coords: [Reg<S32>; 3]) {
        let l = self.tile.layout;
        debug_assert_eq!((l.block_bytes, l.elem_bytes), (128, 2));
        let tid = k.special(Special::TidX);
        let thread = k.sub(tid, self.first_thread);
        let lane = k.and(thread, 31u32);
        let warp = k.shr(thread, 5);
        let warp_row0 = k.mul(warp, 16u32);
        let tile = self.smem.tile(k, self.tile, 0);
        if !self.shared {
            // The last item's store must have read the rows before they are overwritten.
            k.guarded(self.leader, true, |k| k.bulk_wait_group_read(0));
            k.sync_warp();
        }
        k.comment("stmatrix: lanes 8j..8j+7 address the rows of matrix j = (half, tile).");
        // Matrix j = lane/8 of each x4 is row half j%2 of 8-column tile 2i + j/2.
        let half = k.shr(lane, 3);
        let half = k.and(half, 1u32);
        let row = k.and(lane, 7u32);
        let row = k.mad(half, 8u32, row);
        let row = k.add(row, warp_row0);
        let tile_odd = k.shr(lane, 4);
        let line = k.shl(row, 7);
        let chunk = k.shl(tile_odd, 4);
        let logical = k.add(line, chunk);
        let tiles = o.len();
        let pairs_per_block = l.block_cols() / 16;
        // The four chunk offsets (tile pairs at 0, 2, 4, 6 of a column block), swizzled.
        let lane_at: Vec<SmemAddr> = (0..pairs_per_block.min(tiles as u32 / 2))
            .map(|p| {
                let off = k.add(logical, 32 * p);
                let off = l.swizzle.apply_in(k, off);
                k.smem_offset(tile, off)
            })
            .collect();
        let block_stride = l.rows * l.block_bytes;
        for i in 0..tiles / 2 {
            let (block, p) = (i as u32 / pairs_per_block, i % pairs_per_block as usize);
            let at = match block {
                0 => lane_at[p],
                b => k.smem_offset(lane_at[p], b * block_stride),
            };
            let v: [Reg<H>; 4] = std::array::from_fn(|j| {
                let [lo, hi] = half_of(&o[2 * i + j / 2], j % 2);
                let lo = k.mul(lo, inv[j % 2]);
                let hi = k.mul(hi, inv[j % 2]);
                k.pack_half2::<H>(lo, hi)
            });
            k.stmatrix_x4(at, v, false);
        }
        // The writes reach the TMA (async proxy) only after a proxy fence by each writer.
        k.fence_proxy_async();
        k.sync_warp();
        let [row, head, batch] = coords;
        let row = k.add(row, warp_row0.cast::<S32>());
        let rows_at = k.shl(warp_row0, 7);
        let warp_rows = k.smem_offset(tile, rows_at);
        let map = k.tensor_map_here(self.map);
        k.guarded(self.leader, true, |k| {
            for block in 0..l.col_blocks() {
                let src = match block {
                    0 => warp_rows,
                    b => k.smem_offset(warp_rows, b * block_stride),
                };
                let coords = self.columns.coords(k, block, [row, head, batch]);
                k.tma_store(map, coords, src);
            }
        });
        k.guarded(self.leader, true, |k| {
            k.bulk_commit_group();
            if self.shared {
                k.bulk_wait_group_read(0);
            }
        });
    }

    /// Waits, at the end of the kernel, for the last store (its source is this block's
    /// shared memory, which lives only as long as the block).
    pub fn drain(&self, k: &mut Kernel) {
        k.guarded(self.leader, true, |k| k.bulk_wait_group(0));
    }
}

/// [`store_output_lse`] for a warp holding one 16-row slab of O: when `enabled` (the
/// launch passed a map of O), O goes out through `stage` by TMA; otherwise by direct
/// stores as [`store_output_lse`] writes it, only the 8-column tiles below `columns`
/// where given (a padded kernel; its map of O clips the rest).
#[allow(clippy::too_many_arguments)]
pub fn store_output_staged<H: Half2>(
    k: &mut Kernel,
    args: ParamBytes,
    rows: &Rows,
    o: &Slab,
    softmax: &OnlineSoftmax,
    at: OutputBlock,
    (form, columns): (LseForm, Option<Reg<U32>>),
    (stage, enabled): (&OutputStage, Reg<Pred>),
) {
    k.comment("Epilogue: O / l through shared memory and a TMA store, and the log-sum-exp.");
    let out = Destination::new(k, args, rows, at, form);
    let out = Destination { columns, ..out };
    let halves: [_; 2] = std::array::from_fn(|half| reciprocal(k, softmax, 0, half));
    k.if_else(
        enabled,
        |k| {
            let row = k.add(at.seq.q_start, at.m_start);
            let coords = [
                row,
                at.head.cast::<S32>(),
                at.seq.tensor_batch.cast::<S32>(),
            ];
            stage.send::<H>(k, o, [halves[0].2, halves[1].2], coords);
        },
        |k| {
            for (half, &(_, _, inv)) in halves.iter().enumerate() {
                let row = out.row(k, 0, half);
                let words = pack::<H>(k, o, half, inv);
                out.store_words(k, row, &words);
            }
        },
    );
    for (half, (sum, empty, _)) in halves.into_iter().enumerate() {
        let row = out.row(k, 0, half);
        out.store_lse(k, softmax, 0, half, (sum, empty), row);
    }
}

/// Row half `half` of slab `slab`: its sum, whether it is zero (the row saw no key), and
/// the reciprocal O is multiplied by (0 for an empty row, so O is 0 there, not NaN).
fn reciprocal(
    k: &mut Kernel,
    softmax: &OnlineSoftmax,
    slab: usize,
    half: usize,
) -> (Reg<F32>, Reg<Pred>, Reg<F32>) {
    let sum = softmax.row_sum(k, slab, half);
    let empty = k.setp(Cmp::Eq, sum, 0f32);
    let inv = k.rcp(sum);
    let inv = k.selp(0f32, inv, empty);
    (sum, empty, inv)
}

/// Row half `half` of `tiles` times `inv`, one 16-bit pair per 8-column tile.
fn pack<H: Half2>(k: &mut Kernel, tiles: &Slab, half: usize, inv: Reg<F32>) -> Vec<Reg<H>> {
    tiles
        .iter()
        .map(|acc| {
            let [lo, hi] = half_of(acc, half);
            let lo = k.mul(lo, inv);
            let hi = k.mul(hi, inv);
            k.pack_half2::<H>(lo, hi)
        })
        .collect()
}

/// One output row of a thread: whether it exists (`row < Sq`), its 64-bit index, and
/// the address of the thread's first pair in it.
#[derive(Clone, Copy)]
struct OutRow {
    inside: Reg<Pred>,
    row64: Reg<U64>,
    addr: Reg<U64>,
}

/// The addresses an epilogue writes: O's rows, the LSE's, and how the LSE is formed.
struct Destination {
    o_base: Reg<U64>,
    o_seq: Reg<U64>,
    seqlen_q: Reg<S32>,
    m_start: Reg<U32>,
    row0: Reg<S32>,
    lse_ptr: Reg<U64>,
    lse_row0: Reg<U64>,
    want_lse: Reg<Pred>,
    scale: Reg<F32>,
    form: LseForm,
    /// The tensors' head dim where it is below the kernel's (a padded kernel): the
    /// 8-column tiles past it are not stored.
    columns: Option<Reg<U32>>,
}

impl Destination {
    fn new(
        k: &mut Kernel,
        args: ParamBytes,
        rows: &Rows,
        at: OutputBlock,
        form: LseForm,
    ) -> Destination {
        let field = |k: &mut Kernel, off: usize| k.load_param_at::<U64>(args, off);
        let o_ptr = field(k, offset_of!(FwdArgs, o));
        let o_batch = field(k, offset_of!(FwdArgs, o_stride));
        let o_seq = field(k, offset_of!(FwdArgs, o_stride) + 8);
        let o_head = field(k, offset_of!(FwdArgs, o_stride) + 16);
        let lse_ptr = field(k, offset_of!(FwdArgs, lse));
        let lse_batch = field(k, offset_of!(FwdArgs, lse_stride));
        let lse_head = field(k, offset_of!(FwdArgs, lse_stride) + 8);
        let scale = k.load_param_at::<F32>(args, offset_of!(FwdArgs, scale));
        let b = k.cvt_u64_u32(at.seq.tensor_batch);
        let h = k.cvt_u64_u32(at.head);
        let q_start = k.cvt_u64_u32(at.seq.q_start.cast::<U32>());
        let elems = k.mul(b, o_batch);
        let elems = k.mad(h, o_head, elems);
        let elems = k.mad(q_start, o_seq, elems);
        let col = k.cvt_u64_u32(rows.col.cast::<U32>());
        let elems = k.add(elems, col);
        let bytes = k.shl(elems, 1);
        let o_base = k.add(o_ptr, bytes);
        // lse[batch·lse_batch + head·lse_head + q_start + row], in 64 bits.
        let lse_b = k.cvt_u64_u32(at.batch);
        let lse_row0 = k.mad(lse_b, lse_batch, q_start);
        let lse_row0 = k.mad(h, lse_head, lse_row0);
        let want_lse = k.setp(Cmp::Ne, lse_ptr, 0u64);
        let lse_lane = k.setp(Cmp::Eq, rows.col, 0i32);
        let want_lse = k.and_pred(want_lse, lse_lane);
        Destination {
            o_base,
            o_seq,
            seqlen_q: at.seq.seqlen_q,
            m_start: at.m_start.cast::<U32>(),
            row0: rows.row0,
            lse_ptr,
            lse_row0,
            want_lse,
            scale,
            form,
            columns: None,
        }
    }

    fn row(&self, k: &mut Kernel, slab: usize, half: usize) -> OutRow {
        let row = k.add(self.m_start, self.row0.cast::<U32>());
        let row = k.add(row, Rows::offset(slab, half));
        let inside = k.setp(Cmp::Lt, row, self.seqlen_q.cast::<U32>());
        let row64 = k.cvt_u64_u32(row);
        let offset = k.mul(row64, self.o_seq);
        let offset = k.shl(offset, 1);
        let addr = k.add(self.o_base, offset);
        OutRow {
            inside,
            row64,
            addr,
        }
    }

    /// The thread's pairs of one row, one per 8-column tile, if the row exists (and, in
    /// a padded kernel, each tile that lies inside the head dim).
    fn store_words<H: Half2>(&self, k: &mut Kernel, row: OutRow, words: &[Reg<H>]) {
        let Some(d) = self.columns else {
            k.guarded(row.inside, true, |k| {
                for (nt, w) in words.iter().enumerate() {
                    k.st_global(row.addr, (nt * 16) as i32, *w);
                }
            });
            return;
        };
        for (nt, w) in words.iter().enumerate() {
            let column = k.setp(Cmp::Lt, (nt * 8) as u32, d);
            let inside = k.and_pred(row.inside, column);
            k.guarded(inside, true, |k| {
                k.st_global(row.addr, (nt * 16) as i32, *w)
            });
        }
    }

    fn store_lse(
        &self,
        k: &mut Kernel,
        softmax: &OnlineSoftmax,
        slab: usize,
        half: usize,
        (sum, empty): (Reg<F32>, Reg<Pred>),
        row: OutRow,
    ) {
        let log_sum = k.lg2(sum);
        let store = k.and_pred(self.want_lse, row.inside);
        let index = k.add(self.lse_row0, row.row64);
        let offset = k.shl(index, 2);
        let lse = match self.form {
            LseForm::Raw => {
                let log_sum = k.mul(log_sum, std::f32::consts::LN_2);
                k.mad(softmax.max[slab][half], self.scale, log_sum)
            }
            LseForm::Folded => {
                let t = k.add(softmax.max[slab][half], log_sum);
                k.mul(t, std::f32::consts::LN_2)
            }
            LseForm::Log2 {
                offset: shift_log2,
                shift,
            } => {
                let t = k.add(softmax.max[slab][half], log_sum);
                let t = k.sub(t, shift_log2);
                let lse = k.mul(t, std::f32::consts::LN_2);
                let wanted = k.setp(Cmp::Ne, shift, 0u64);
                let wanted = k.and_pred(wanted, store);
                let at = k.add(shift, offset);
                let value = k.mov(0f32);
                k.guarded(wanted, true, |k| {
                    let v = k.ld_global::<F32>(at, 0);
                    k.mov_to(value, v);
                });
                k.mad(value, self.scale, lse)
            }
        };
        let lse = k.selp(f32::NEG_INFINITY, lse, empty);
        let lse_addr = k.add(self.lse_ptr, offset);
        k.guarded(store, true, |k| k.st_global(lse_addr, 0, lse));
    }
}
