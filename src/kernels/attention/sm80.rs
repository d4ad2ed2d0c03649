//! FlashAttention-2 style forward for sm_80 and up (`.target sm_80`: the same module runs
//! on Ampere, Ada and Hopper).
//!
//! One block owns `block_m` query rows of one (batch, head); each warp owns
//! `16 * m_tiles` of those rows. The block walks the keys backwards in tiles of `block_n`,
//! so the tiles that need masking (the causal diagonal, the sequence tail) come first, in
//! a loop of their own, and the rest run in a second loop with no mask code at all:
//!
//! ```text
//! load Q, K[last]                                   (cp.async)
//! for n in (mask_from..end).rev(): step(n, masked)
//! for n in (head..mask_from).rev(): step(n, unmasked)
//! for n in (0..head).rev():         step(n, masked)     (a window's left edge; else head = 0)
//!
//! step(n):
//!     wait K[n]; issue V[n]                         (V lands while S is computed)
//!     S = Q K[n]^T                                  (ldmatrix + mma.sync m16n8k16)
//!     [mask S]
//!     online softmax: m, l, rescale O, P = exp2((S − m)·scale·log2e)
//!     wait V[n]; issue K[n-1]                       (K lands while PV is computed)
//!     O += P V[n]                                   (P never leaves registers)
//! O /= l; store O and LSE
//! ```
//!
//! Shared-memory tiles use the column-block layout of [`SmemLayout`] (`[d / 64][rows]
//! [128 B]`, or 64-byte blocks when d is not a multiple of 64: d = 32, 96) under the
//! 128-byte swizzle, so the 8 row addresses of an `ldmatrix` land in 8 different bank
//! groups. K and V each have one buffer: each is refilled while the other is consumed.
//!
//! Windowed kernels ([`FwdConfig::window`]) rebase the block's keys to the first key tile
//! its rows' windows reach ([`windowed_keys`]); the tiles that cut a row's window on the
//! left are masked in the third loop, or, where its registers do not fit
//! ([`FwdConfig::masks_window_edges_only`]), every tile is masked in the first.

use std::marker::PhantomData;
use std::mem::offset_of;

use super::epilogue::{OutputBlock, store_output};
use super::mask::{KeyTiles, apply_mask, key_tiles, query_block, window_head_tiles, windowed_keys};
use super::rows::{Rows, Slab, zeroed_slabs};
use super::sequence::sequence;
use super::softcap::cap_scores;
use super::softmax::OnlineSoftmax;
use super::{BLOCK_M_NARROW, FwdArgs, FwdConfig, HalfType, Tiling};
use crate::ptx::{
    Bf16x2, Cmp, F16x2, F32, Half2, Kernel, KernelText, Module, Param, ParamBytes, Pred, PtxError,
    PtxType, Reg, S32, Smem, SmemAddr, SmemLayout, SmemPlan, Special, Swizzle, Target, TileSlot,
    U32, U64,
};

/// The compile-time shape of one configuration.
#[derive(Debug, Clone, Copy)]
struct Shape {
    head_dim: u32,
    warps: u32,
    /// 16-row MMA tiles per warp.
    m_tiles: u32,
    block_n: u32,
}

/// Where Q, K and V live in shared memory.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    q: TileSlot,
    k: TileSlot,
    v: TileSlot,
}

impl Shape {
    fn of(cfg: &FwdConfig) -> Shape {
        // Register budget per thread (255 at most): O takes m_tiles·d/2, S takes
        // m_tiles·block_n/2. Two MMA tiles per warp halve the shared-memory reads of K and
        // V per FLOP; d > 128 cannot afford them, and narrow blocks (64 query rows) trade
        // them for twice the blocks on small grids.
        let wide_head = cfg.head_dim > 128;
        let block_n = if wide_head { 32 } else { 64 };
        let (warps, m_tiles) = match (cfg.block_m, wide_head) {
            (BLOCK_M_NARROW, _) => (4, 1),
            (_, true) => (8, 1),
            _ => (4, 2),
        };
        debug_assert_eq!(warps * 16 * m_tiles, cfg.block_m);
        Shape {
            head_dim: cfg.head_dim,
            warps,
            m_tiles,
            block_n,
        }
    }
    fn threads(&self) -> u32 {
        self.warps * 32
    }
    fn block_m(&self) -> u32 {
        self.warps * 16 * self.m_tiles
    }
    fn layout(&self, rows: u32) -> SmemLayout {
        SmemLayout::new(rows, self.head_dim, 2, Swizzle::B128)
    }
    fn plan(&self) -> (SmemPlan, Tiles) {
        let mut plan = SmemPlan::new();
        let tiles = Tiles {
            q: plan.tile(self.layout(self.block_m()), 1),
            k: plan.tile(self.layout(self.block_n), 1),
            v: plan.tile(self.layout(self.block_n), 1),
        };
        (plan, tiles)
    }
    /// Bytes of one row of a column block (128, or 64 for d = 32, 96).
    fn row_bytes(&self) -> u32 {
        self.layout(self.block_n).block_bytes
    }
    /// Column blocks per row.
    fn col_blocks(&self) -> u32 {
        self.layout(self.block_n).col_blocks()
    }
    /// 16-byte chunks per row of a column block.
    fn chunks_per_block_row(&self) -> u32 {
        self.row_bytes() / 16
    }
    /// Rows of one column block covered by one pass of all threads. A pass spans
    /// `threads · 16` bytes, a whole number of 1024-byte swizzle atoms, so every pass of a
    /// thread lands at the same swizzle phase and its address simply adds.
    fn rows_per_pass(&self) -> u32 {
        self.threads() / self.chunks_per_block_row()
    }
    /// k16 steps (32 bytes each) inside one column-block row.
    fn k16_per_block(&self) -> u32 {
        self.row_bytes() / 32
    }
}

pub(crate) fn tiling(cfg: &FwdConfig) -> Tiling {
    let s = Shape::of(cfg);
    Tiling {
        block_m: s.block_m(),
        block_n: s.block_n,
        threads: s.threads(),
        smem_bytes: s.plan().0.bytes(),
    }
}

pub(crate) fn generate(cfg: &FwdConfig) -> Result<Module, PtxError> {
    let kernel = match cfg.dtype {
        HalfType::F16 => build::<F16x2>(cfg)?,
        HalfType::Bf16 => build::<Bf16x2>(cfg)?,
    };
    let mut module = Module::new(Target::Sm80);
    module.push(kernel)?;
    Ok(module)
}

/// One thread's part in copying `rows`-row tiles of a [seq, d] slice into shared memory.
///
/// Thread `t` always copies chunk `t % cpb` of a column-block row (`cpb` 16-byte chunks per
/// row), for rows `t / cpb + i · rows_per_pass` of every column block.
struct TileLoader {
    rows: u32,
    /// Global address of this thread's chunk in row 0 of the slice (column block 0).
    /// Row 0 always exists, so it is also the source handed to the zero-filling copies
    /// of rows past the sequence end: every address a copy is given lies in the view.
    row0: Reg<U64>,
    /// This thread's first row inside a tile (`t / cpb`).
    thread_row: Reg<S32>,
    /// Bytes from one sequence row to the next.
    row_stride: Reg<U64>,
    /// Shared address of this thread's chunk in its first row (column block 0) of a
    /// tile at offset 0: the same for Q, K and V, whose tiles differ by `tile_offset`.
    line: SmemAddr,
    tile_offset: u32,
    /// Padded kernels ([`FwdConfig::padded`]): the parameter holding the tensors' head
    /// dim. The chunks past it are zero-filled, copied from column 0 of row 0. What that
    /// takes is worked out again at each tile from `%tid.x` and the parameter, not kept
    /// in registers: the d = 128 wide tile has none to spare.
    columns: Option<Param<U32>>,
}

impl TileLoader {
    /// Issues the `cp.async` copies of the tile starting at sequence row `first_row`.
    /// Rows at or past the sequence end (`seqlen`) are zero-filled: their copies read 0
    /// bytes.
    fn issue(&self, k: &mut Kernel, s: &Shape, first_row: Reg<S32>, seqlen: Reg<S32>) {
        self.issue_passes(k, s, first_row, 0..self.passes(s), seqlen);
    }

    /// Passes (`rows_per_pass` rows each) that make up a tile.
    fn passes(&self, s: &Shape) -> u32 {
        self.rows / s.rows_per_pass()
    }

    /// The copies of passes `range` of the tile at `first_row`.
    fn issue_passes(
        &self,
        k: &mut Kernel,
        s: &Shape,
        first_row: Reg<S32>,
        range: std::ops::Range<u32>,
        seqlen: Reg<S32>,
    ) {
        let rpp = s.rows_per_pass();
        let row = k.add(first_row, self.thread_row);
        let row = k.add(row, (range.start * rpp) as i32);
        let left = k.sub(seqlen, row);
        let offset = k.cvt_s64_s32(row).cast::<U64>();
        let offset = k.mul(offset, self.row_stride);
        let mut src = k.add(self.row0, offset);
        let pass_stride = k.mul(self.row_stride, rpp as u64);
        let columns = self.columns.map(|p| self.columns_inside(k, s, p));
        for pass in range.clone() {
            let valid = k.setp(Cmp::Gt, left, ((pass - range.start) * rpp) as i32);
            let from = k.selp(src, self.row0, valid);
            let bytes = k.selp(16u32, 0u32, valid);
            for block in 0..s.col_blocks() {
                let mut from = k.add(from, (block * s.row_bytes()) as u64);
                let mut bytes = bytes;
                if let Some((inside, origin)) = &columns {
                    let inside = inside[block as usize];
                    from = k.selp(from, *origin, inside);
                    bytes = k.selp(bytes, 0u32, inside);
                }
                let at = block * self.rows * s.row_bytes() + pass * rpp * s.row_bytes();
                let dst = k.smem_offset(self.line, self.tile_offset + at);
                k.cp_async_16(dst, from, bytes);
            }
            if pass + 1 < range.end {
                src = k.add(src, pass_stride);
            }
        }
    }

    /// A padded kernel's column checks: per column block, whether this thread's chunk
    /// lies inside the head dim (`head_dim`), and column 0 of row 0 (the source of the
    /// zero-filling copies of the chunks past it).
    fn columns_inside(
        &self,
        k: &mut Kernel,
        s: &Shape,
        head_dim: Param<U32>,
    ) -> (Vec<Reg<Pred>>, Reg<U64>) {
        let d = k.load_param(head_dim);
        let tid = k.special(Special::TidX);
        let chunk = k.and(tid, s.chunks_per_block_row() - 1);
        let first_col = k.shl(chunk, 3);
        let inside = (0..s.col_blocks())
            .map(|block| {
                let col = k.add(first_col, block * s.row_bytes() / 2);
                k.setp(Cmp::Lt, col, d)
            })
            .collect();
        let chunk_bytes = k.shl(chunk, 4);
        let chunk_bytes = k.cvt_u64_u32(chunk_bytes);
        (inside, k.sub(self.row0, chunk_bytes))
    }
}

/// Accumulator state and per-thread constants shared by the phases of the kernel.
struct Fwd<H: Half2> {
    s: Shape,
    causal: bool,
    /// Output accumulators: one slab per 16-row MMA tile of the warp.
    o: Vec<Slab>,
    softmax: OnlineSoftmax,
    /// ldmatrix row addresses, one per 32-byte step inside a 128-byte line, for each
    /// operand's lane roles.
    q_frag: Vec<SmemAddr>,
    k_frag: Vec<SmemAddr>,
    v_frag: Vec<SmemAddr>,
    _h: PhantomData<H>,
}

/// Probabilities packed as `mma` A fragments: `p[mt][t]` covers keys 16t..16t+15.
type Probs<H> = Vec<Vec<[Reg<H>; 4]>>;

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

/// Which (batch, head, query block) this block owns, read from the special registers.
///
/// Read again where needed (the masked steps, the epilogue) rather than kept: these
/// kernels run at the register limit, and a special-register read is cheap.
#[derive(Clone, Copy)]
pub(super) struct Coords {
    pub(super) batch: Reg<U32>,
    pub(super) head: Reg<U32>,
    pub(super) m_start: Reg<S32>,
}

pub(super) fn coords(k: &mut Kernel, causal: bool, block_m: u32) -> Coords {
    let block_x = k.special(Special::CtaidX);
    let head = k.special(Special::CtaidY);
    let batch = k.special(Special::CtaidZ);
    let blocks = k.special(Special::NctaidX);
    let m_block = query_block(k, block_x, blocks, causal);
    let m_start = k.mul(m_block.cast::<S32>(), block_m as i32);
    Coords {
        batch,
        head,
        m_start,
    }
}

/// The thread's accumulator rows (from `%tid.x`; see [`Coords`] for why it is re-read).
pub(super) fn thread_rows(k: &mut Kernel, m_tiles: u32) -> (Reg<U32>, Rows) {
    let tid = k.special(Special::TidX);
    let lane = k.and(tid, 31u32);
    let warp = k.shr(tid, 5);
    let warp_rows = k.mul(warp, 16 * m_tiles);
    (warp_rows, Rows::new(k, lane, warp_rows))
}

fn build<H: Half2>(cfg: &FwdConfig) -> Result<KernelText, PtxError> {
    let s = Shape::of(cfg);
    let (block_m, block_n) = (s.block_m(), s.block_n);
    let (plan, tiles) = s.plan();
    let mut k = Kernel::new(&cfg.id());
    // Without a minimum occupancy ptxas may trade spills for more resident blocks
    // (it took d64's 64-row tile to 96 registers and spilled); one block is all a key
    // loop of this size needs.
    k.max_threads(s.threads()).min_blocks_per_sm(1);
    let args = k.param_bytes("args", FwdArgs::SIZE, 8);
    // A padded kernel's second parameter: the tensors' head dim (a multiple of 8 below
    // the kernel's).
    let head_dim = cfg.padded.then(|| k.param::<U32>("head_dim"));
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);

    k.comment("Which (batch, head, query block) this block owns, and where its sequence is.");
    let scale_log2 = arg::<F32>(&mut k, args, offset_of!(FwdArgs, scale_log2));
    let group = arg::<U32>(&mut k, args, offset_of!(FwdArgs, group));
    let Coords {
        batch,
        head,
        m_start,
    } = coords(&mut k, cfg.causal, block_m);
    // The sequence, its keys rebased past those no row's window reaches in a windowed
    // kernel; read again where needed (see `keys_again`).
    // (`m_start` is the block's first query row, needed by a windowed kernel only.)
    let keys_of = |k: &mut Kernel, batch: Reg<U32>, m_start: Option<Reg<S32>>| {
        let seq = sequence(k, args, batch, cfg.cache_reads());
        match m_start {
            Some(m_start) if cfg.window => {
                let w = windowed_keys(k, args, seq, m_start, block_n);
                (w.seq, w.offset, Some(w.low))
            }
            _ => {
                let offset = seq.causal_offset(k);
                (seq, offset, None)
            }
        }
    };
    let (seq, causal_offset, low) = keys_of(&mut k, batch, Some(m_start));
    let (seqlen_q, seqlen_k) = (seq.seqlen_q, seq.seqlen_k);
    let kv_head = k.div(head, group);

    k.comment("Key tiles to visit: 0..end; tiles mask_from.. need masking.");
    let causal = cfg.causal.then_some(causal_offset);
    let n = key_tiles(
        &mut k, seqlen_q, seqlen_k, m_start, block_m, block_n, causal,
    );
    // A windowed kernel also masks the tiles that cut a row's window on the left,
    // `0..head`, below the unmasked ones, or every tile where that third loop's registers
    // do not fit (`FwdConfig::masks_window_edges_only`).
    let head_masked = low
        .filter(|_| cfg.masks_window_edges_only())
        .map(|low| window_head_tiles(&mut k, m_start, (block_m, block_n), low, n.end));
    let n = match (head_masked, cfg.window) {
        (Some(head), _) => KeyTiles {
            mask_from: k.max(n.mask_from, head),
            ..n
        },
        (None, true) => KeyTiles {
            mask_from: k.mov(0i32),
            ..n
        },
        (None, false) => n,
    };

    let f = Fwd::<H>::new(&mut k, s, cfg.causal, tid, &smem, &tiles);
    let epilogue = k.label();
    let nothing = k.setp(Cmp::Le, n.end, 0i32);
    k.bra_if(nothing, true, epilogue);

    k.comment("Tile loaders; Q and the last K tile go first.");
    let chunk = k.and(tid, s.chunks_per_block_row() - 1);
    let first_row = k.shr(tid, s.chunks_per_block_row().trailing_zeros());
    let line = k.mul(first_row, s.row_bytes());
    let line = k.mad(chunk, 16u32, line);
    let line = Swizzle::B128.apply_in(&mut k, line);
    let line = smem.tile_byte(&mut k, tiles.q, line);
    let loader = |k: &mut Kernel, tensor, strides, batch, head, start, slot: TileSlot| {
        f.loader(
            k,
            args,
            (tensor, strides),
            [batch, head],
            start,
            (chunk, head_dim),
            first_row,
            (line, slot.offset - tiles.q.offset),
            slot.layout.rows,
        )
    };
    let q = loader(
        &mut k,
        offset_of!(FwdArgs, q),
        offset_of!(FwdArgs, q_stride),
        seq.tensor_batch,
        head,
        seq.q_start,
        tiles.q,
    );
    let key = loader(
        &mut k,
        offset_of!(FwdArgs, k),
        offset_of!(FwdArgs, k_stride),
        seq.kv_batch,
        kv_head,
        seq.k_start,
        tiles.k,
    );
    let val = loader(
        &mut k,
        offset_of!(FwdArgs, v),
        offset_of!(FwdArgs, v_stride),
        seq.kv_batch,
        kv_head,
        seq.k_start,
        tiles.v,
    );
    q.issue(&mut k, &s, m_start, seqlen_q);
    let last = k.sub(n.end, 1i32);
    let last_row = k.mul(last, block_n as i32);
    key.issue(&mut k, &s, last_row, seqlen_k);
    k.cp_async_commit();

    // The sequence's lengths are read again where needed, not kept: a value that may
    // come from the packed offsets cannot be rematerialised from the parameter space,
    // and one more register across the loop spills d96's wide tile.
    let keys_again = |k: &mut Kernel| {
        let batch = k.special(Special::CtaidZ);
        let m_start = cfg.window.then(|| coords(k, f.causal, block_m).m_start);
        keys_of(k, batch, m_start)
    };
    let seq_again = |k: &mut Kernel| {
        if cfg.window {
            return keys_again(k).0;
        }
        let batch = k.special(Special::CtaidZ);
        sequence(k, args, batch, cfg.cache_reads())
    };
    let step = |k: &mut Kernel, n: Reg<S32>, masked: bool| {
        let n_row = k.mul(n, block_n as i32);
        k.cp_async_wait(0);
        k.sync_threads();
        let seqlen_k = seq_again(k).seqlen_k;
        val.issue(k, &s, n_row, seqlen_k);
        k.cp_async_commit();

        let scores = f.scores(k);
        if cfg.softcap {
            // Read where used: one more register across the loop spills the widest tiles.
            let pre = arg::<F32>(k, args, offset_of!(FwdArgs, softcap_pre));
            for slab in &scores {
                cap_scores(k, slab, pre);
            }
        }
        if masked {
            let (seq, causal_offset, low) = keys_again(k);
            let causal = f.causal.then_some(causal_offset);
            let m_start = coords(k, f.causal, block_m).m_start;
            let (_, rows) = thread_rows(k, s.m_tiles);
            apply_mask(k, &rows, &scores, n_row, m_start, seq.seqlen_k, causal, low);
        }

        // Every warp is done with K[n], and V[n] has landed: refill K with K[n-1], half
        // of it now and half after the softmax, so the softmax, its conversion to P and
        // the PV product stay apart (ptxas overlapping them runs out of registers).
        k.cp_async_wait(0);
        k.sync_threads();
        let more = k.setp(Cmp::Gt, n, 0i32);
        let prev_row = k.sub(n_row, block_n as i32);
        let half = key.passes(&s) / 2;
        k.if_(more, |k| {
            let seqlen_k = seq_again(k).seqlen_k;
            key.issue_passes(k, &s, prev_row, 0..half, seqlen_k)
        });
        let p: Probs<H> = f.softmax.step_packed(k, &scores, &f.o, scale_log2);
        k.if_(more, |k| {
            let seqlen_k = seq_again(k).seqlen_k;
            key.issue_passes(k, &s, prev_row, half..key.passes(&s), seqlen_k)
        });
        k.cp_async_commit();
        f.accumulate_pv(k, &p);
    };

    k.comment("Key tiles that cross the sequence end or the diagonal, last to first.");
    let unmasked = k.min(n.mask_from, n.end);
    let last_unmasked = k.sub(unmasked, 1i32);
    k.for_range(last, last_unmasked, -1, |k, n| step(k, n, true));
    k.comment("The remaining key tiles need no mask.");
    match head_masked {
        None => k.for_range(last_unmasked, -1i32, -1, |k, n| step(k, n, false)),
        Some(head) => {
            let head_end = k.sub(head, 1i32);
            k.for_range(last_unmasked, head_end, -1, |k, n| step(k, n, false));
            k.comment("Key tiles that cut a row's window on the left.");
            let top = k.min(head, unmasked);
            let top = k.sub(top, 1i32);
            k.for_range(top, -1i32, -1, |k, n| step(k, n, true));
        }
    }

    k.place(epilogue);
    let c = coords(&mut k, cfg.causal, block_m);
    let (_, rows) = thread_rows(&mut k, s.m_tiles);
    let at = OutputBlock {
        batch: c.batch,
        head: c.head,
        m_start: c.m_start,
        seq: sequence(&mut k, args, c.batch, cfg.cache_reads()),
    };
    let columns = head_dim.map(|p| k.load_param(p));
    store_output::<H>(&mut k, args, &rows, &f.o, &f.softmax, at, columns);
    k.finish()
}

impl<H: Half2> Fwd<H> {
    fn new(k: &mut Kernel, s: Shape, causal: bool, tid: Reg<U32>, smem: &Smem, t: &Tiles) -> Self {
        k.comment("Accumulators and per-thread fragment addresses.");
        let mt_n = s.m_tiles as usize;
        let o = zeroed_slabs(k, mt_n, (s.head_dim / 8) as usize);
        let softmax = OnlineSoftmax::new(k, mt_n);

        let (warp_rows, _) = thread_rows(k, s.m_tiles);
        let lane = k.and(tid, 31u32);

        // ldmatrix lane roles (lane L feeds row L%8 of matrix L/8), chosen so that each
        // mma's fragment pair comes back in consecutive registers: mma.sync takes its
        // B operand as an aligned register pair, and any other order costs a MOV per
        // register per tile (ptxas re-pairs them).
        //   Q (A operand):                    row L%16,              column half L/16
        //   K (B operand of S, K-major):      row L%8 + 8·(L/16),    column half (L/8)%2
        //   V (B operand of O, transposed):   row L%16,              column half L/16
        let LaneRoles { l8, l16, hi16, mid } = LaneRoles::of(k, lane);
        let q_row = k.add(warp_rows, l16);
        let k_row = k.mad(hi16, 8u32, l8);
        let q_frag = frag_addresses(k, smem, t.q, q_row, hi16);
        let k_frag = frag_addresses(k, smem, t.k, k_row, mid);
        let v_frag = frag_addresses(k, smem, t.v, l16, hi16);
        Fwd {
            s,
            causal,
            o,
            softmax,
            q_frag,
            k_frag,
            v_frag,
            _h: PhantomData,
        }
    }

    /// A loader for the rows from row `start` of the [seq, d] slice of `tensor` at
    /// (batch, head); `head_dim`: the parameter of the tensors' head dim, in a padded
    /// kernel.
    #[allow(clippy::too_many_arguments)]
    fn loader(
        &self,
        k: &mut Kernel,
        args: ParamBytes,
        (tensor, strides): (usize, usize),
        [batch, head]: [Reg<U32>; 2],
        start: Reg<S32>,
        (chunk, head_dim): (Reg<U32>, Option<Param<U32>>),
        first_row: Reg<U32>,
        (line, tile_offset): (SmemAddr, u32),
        rows: u32,
    ) -> TileLoader {
        let base = arg::<U64>(k, args, tensor);
        let batch_stride = arg::<U64>(k, args, strides);
        let seq_stride = arg::<U64>(k, args, strides + 8);
        let head_stride = arg::<U64>(k, args, strides + 16);
        let b = k.cvt_u64_u32(batch);
        let h = k.cvt_u64_u32(head);
        let elems = k.mul(b, batch_stride);
        let elems = k.mad(h, head_stride, elems);
        let first = k.cvt_u64_u32(start.cast::<U32>());
        let elems = k.mad(first, seq_stride, elems);
        let c = k.cvt_u64_u32(chunk);
        let c = k.shl(c, 3);
        let elems = k.add(elems, c);
        let bytes = k.shl(elems, 1);
        let row0 = k.add(base, bytes);
        let row_stride = k.shl(seq_stride, 1);
        TileLoader {
            rows,
            row0,
            thread_row: first_row.cast::<S32>(),
            row_stride,
            line,
            tile_offset,
            columns: head_dim,
        }
    }

    /// `S = Q K^T` for the current key tile.
    fn scores(&self, k: &mut Kernel) -> Vec<Slab> {
        let s = &self.s;
        let acc = zeroed_slabs(k, s.m_tiles as usize, (s.block_n / 8) as usize);
        let kpb = s.k16_per_block();
        for kk in 0..s.head_dim / 16 {
            let (step, block) = ((kk % kpb) as usize, kk / kpb);
            let q: Vec<[Reg<H>; 4]> = (0..s.m_tiles)
                .map(|mt| {
                    let at = block * s.block_m() * s.row_bytes() + mt * 16 * s.row_bytes();
                    let addr = k.smem_offset(self.q_frag[step], at);
                    k.ldmatrix_x4::<H>(addr, false)
                })
                .collect();
            for np in 0..s.block_n / 16 {
                let at = block * s.block_n * s.row_bytes() + np * 16 * s.row_bytes();
                let addr = k.smem_offset(self.k_frag[step], at);
                let [b0, b1, b2, b3] = k.ldmatrix_x4::<H>(addr, false);
                for (mt, a) in q.iter().enumerate() {
                    let (lo, hi) = (&acc[mt][2 * np as usize], &acc[mt][2 * np as usize + 1]);
                    k.mma_m16n8k16(lo, a, &[b0, b1], lo);
                    k.mma_m16n8k16(hi, a, &[b2, b3], hi);
                }
            }
        }
        acc
    }

    /// `O += P V` for the current value tile.
    fn accumulate_pv(&self, k: &mut Kernel, p: &Probs<H>) {
        let s = &self.s;
        let kpb = s.k16_per_block();
        for t in 0..s.block_n / 16 {
            for np in 0..s.head_dim / 16 {
                let (step, block) = ((np % kpb) as usize, np / kpb);
                let at = block * s.block_n * s.row_bytes() + t * 16 * s.row_bytes();
                let addr = k.smem_offset(self.v_frag[step], at);
                let [b0, b1, b2, b3] = k.ldmatrix_x4::<H>(addr, true);
                for (mt, probs) in p.iter().enumerate() {
                    let a = &probs[t as usize];
                    let (lo, hi) = (
                        &self.o[mt][2 * np as usize],
                        &self.o[mt][2 * np as usize + 1],
                    );
                    k.mma_m16n8k16(lo, a, &[b0, b1], lo);
                    k.mma_m16n8k16(hi, a, &[b2, b3], hi);
                }
            }
        }
    }
}

/// A lane's parts for the ldmatrix roles: `lane % 8`, `lane % 16`, `lane / 16` and
/// `(lane / 8) % 2`.
pub(super) struct LaneRoles {
    pub l8: Reg<U32>,
    pub l16: Reg<U32>,
    pub hi16: Reg<U32>,
    pub mid: Reg<U32>,
}

impl LaneRoles {
    pub(super) fn of(k: &mut Kernel, lane: Reg<U32>) -> LaneRoles {
        let l8 = k.and(lane, 7u32);
        let l16 = k.and(lane, 15u32);
        let hi16 = k.shr(lane, 4);
        let mid = k.shr(lane, 3);
        let mid = k.and(mid, 1u32);
        LaneRoles { l8, l16, hi16, mid }
    }
}

/// Per-thread `ldmatrix` row addresses for a tile slot: row `row` of the tile, 16-byte
/// column `half`, one address per 32-byte step `i` inside a 128-byte line. Stepping by
/// 32 bytes flips bits 5..6, which the swizzle leaves alone, so each step's address is
/// the swizzled base XOR `i << 5`; other offsets (16-row groups, column blocks) are
/// multiples of 1024 bytes and simply add.
pub(super) fn frag_addresses(
    k: &mut Kernel,
    smem: &Smem,
    slot: TileSlot,
    row: Reg<U32>,
    half: Reg<U32>,
) -> Vec<SmemAddr> {
    let row_bytes = slot.layout.block_bytes;
    let line = k.mul(row, row_bytes);
    let line = k.mad(half, 16u32, line);
    let base = Swizzle::B128.apply_in(k, line);
    (0..row_bytes / 32)
        .map(|i| {
            let stepped = k.xor(base, i << 5);
            smem.tile_byte(k, slot, stepped)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::all_fwd_configs;

    /// The address arithmetic adds pass, 16-row and column-block offsets to a swizzled
    /// base; that is only right when each of them is a whole number of 1024-byte atoms.
    #[test]
    fn every_tiling_keeps_offsets_atom_aligned() {
        for cfg in all_fwd_configs() {
            if cfg.path != super::super::Path::Sm80 {
                continue;
            }
            let s = Shape::of(&cfg);
            let id = cfg.id();
            assert_eq!(s.block_m(), cfg.block_m, "{id}");
            let rpp = s.rows_per_pass();
            for rows in [s.block_m(), s.block_n] {
                assert!(s.layout(rows).is_valid(), "{id}: {rows}-row layout");
                assert_eq!(rows % rpp, 0, "{id}: {rows} rows in passes of {rpp}");
                assert_eq!(
                    rows * s.row_bytes() % 1024,
                    0,
                    "{id}: column block of {rows} rows"
                );
            }
            assert_eq!(rpp * s.row_bytes() % 1024, 0, "{id}: pass of {rpp} rows");
            assert_eq!(16 * s.row_bytes() % 1024, 0, "{id}: 16-row MMA tile");
            let (plan, t) = s.plan();
            assert_eq!(
                t.k.offset,
                s.block_m() * s.head_dim * 2,
                "{id}: K follows Q"
            );
            assert!(
                plan.bytes() <= 99 * 1024,
                "{id}: fits the sm_86/sm_89 opt-in limit"
            );
        }
    }

    /// A padded kernel takes the tensors' head dim as a second parameter, checks each
    /// 16-byte chunk's column against it before copying, and each 8-column tile of O
    /// before storing; the unpadded kernel of the same shape has none of that.
    #[test]
    fn padded_kernels_check_their_columns() {
        for cfg in all_fwd_configs() {
            if cfg.path != super::super::Path::Sm80 || !cfg.padded {
                continue;
            }
            let padded = generate(&cfg).unwrap().to_ptx();
            let plain = generate(&FwdConfig {
                padded: false,
                ..cfg
            })
            .unwrap()
            .to_ptx();
            let id = cfg.id();
            assert!(padded.contains(".param .u32 head_dim"), "{id}");
            assert!(!plain.contains("head_dim"), "{id}");
            let stores = |ptx: &str| ptx.matches("st.global.b32").count();
            let guards = |ptx: &str| ptx.matches("setp.lt.u32").count();
            // One store per 8-column tile and row half, each behind its own column check.
            assert_eq!(stores(&padded), stores(&plain), "{id}");
            assert!(guards(&padded) >= guards(&plain) + stores(&plain), "{id}");
        }
    }

    /// The head dims the forward serves: the kernels' own, and the other multiples of 8
    /// up to 256 on the next larger kernel.
    #[test]
    fn head_dims_pad_to_the_next_kernel() {
        use crate::kernels::attention::padded_head_dim;
        assert_eq!(padded_head_dim(64), Some((64, false)));
        assert_eq!(padded_head_dim(8), Some((64, true)));
        assert_eq!(padded_head_dim(24), Some((64, true)));
        assert_eq!(padded_head_dim(40), Some((64, true)));
        assert_eq!(padded_head_dim(80), Some((96, true)));
        assert_eq!(padded_head_dim(136), Some((192, true)));
        assert_eq!(padded_head_dim(248), Some((256, true)));
        for d in [0, 1, 7, 12, 100, 257, 264, 1 << 20, usize::MAX] {
            assert_eq!(padded_head_dim(d), None, "{d}");
        }
        let served = (0..=300).filter(|&d| padded_head_dim(d).is_some()).count();
        assert_eq!(served, 32, "every multiple of 8 from 8 to 256");
    }
}
