//! FP8 (E4M3) forward for Ada and later (`.target sm_89`): the FlashAttention-2 structure
//! of [`super::sm80`] on `mma.sync` m16n8k32 e4m3, with per-block scales. The data
//! contract (operand layouts, scales, what is computed) is [`super::fp8`]'s.
//!
//! One block owns [`BLOCK_M`] = 128 query rows of one (batch, head): exactly one Q scale
//! block, so one `q_scale` serves the whole block. Each of its 8 warps owns 16 rows. The
//! block walks the keys backwards in tiles of `block_n` (128 for d = 64, else 64: the
//! registers decide, see `Shape::of`), which divide the 128-key scale blocks, so every
//! tile has one `k_scale` and one `v_scale`. As in sm80, the tiles that need masking come
//! first, in a loop of their own:
//!
//! ```text
//! load Q8, K8[last]                                 (cp.async)
//! for n in (mask_from..end).rev(): step(n, masked)
//! for n in (0..mask_from).rev():   step(n, unmasked)
//!
//! step(n):
//!     wait K8[n]; issue Vt8[n]                      (Vt lands while S is computed)
//!     S = Q8 K8[n]^T                                (ldmatrix + mma.sync m16n8k32 e4m3)
//!     [mask S]
//!     dc = q_scale · k_scale[n] · scale · log2e, clamped (fp8::clamp_dequant)
//!     online softmax in log2 units: m' = max(m, max(S)·dc); O, l *= exp2(m − m')
//!     P = exp2(S·dc − m' + 8) in [0, 256]; l += rowsum(P); P8 = e4m3(P)   (registers)
//!     wait Vt8[n]; issue K8[n-1]                    (K lands while PV is computed)
//!     per 16 columns of O: T = P8 Vt8[n]            (fresh f32 accumulators)
//!                          O += v_scale[n] · T
//! O /= l; store O and LSE = ln2·(m + log2 l − 8) [+ scale · lse_shift]
//! ```
//!
//! Two-level accumulation: the FP8 tensor cores keep fewer bits than f32 in their sums,
//! so each tile's `P8·Vt8` (at most `block_n` terms) starts from zero and is added to O in
//! f32, which also applies the tile's V scale exactly.
//!
//! Every operand is a row of bytes along the MMA's k dimension: Q8 and K8 rows run along
//! the head dimension (the k of `Q·Kᵀ`), `Vᵀ8` rows along the keys (the k of `P·V`). So
//! plain (non-transposed) `ldmatrix` gives every fragment: its 16-bit element is two
//! E4M3 bytes, and a 32-byte k32 step reads exactly like sm80's k16 step of 16-bit data.
//! P goes from the score accumulators to the A fragment without shuffles because `Vᵀ8`
//! stores its keys in the order the accumulator layout delivers them (see
//! [`pack_e4m3`](super::softmax::pack_e4m3)).
//!
//! Shared memory holds one Q8, one K8 and one `Vᵀ8` tile in the column-block layout of
//! [`SmemLayout`] under the 128-byte swizzle (64-byte rows where a row has 64 bytes: Q8
//! and K8 at d = 64, `Vᵀ8` for 64-key tiles); K and V each have one buffer, each refilled
//! while the other is consumed. At most 64 KiB (d = 256), well inside sm_89's 99 KiB.

use std::mem::offset_of;
use std::ops::Range;

use super::epilogue::{LseForm, OutputBlock, store_output_lse};
use super::fp8::{Fp8Args, Fp8Config, P_SHIFT_LOG2, SCALE_BLOCK, clamp_dequant};
use super::mask::{apply_mask, key_tiles};
use super::rows::{Slab, zeroed_slabs};
use super::sequence::{CacheReads, sequence};
use super::sm80::{Coords, LaneRoles, coords, frag_addresses, thread_rows};
use super::softmax::OnlineSoftmax;
use super::{FwdArgs, HalfType, Tiling};
use crate::ptx::{
    Bf16x2, Cmp, E4m3x4, F16x2, F32, Half2, Kernel, KernelText, Module, ParamBytes, PtxError,
    PtxType, Reg, S32, Smem, SmemAddr, SmemLayout, SmemPlan, Special, Swizzle, Target, TileSlot,
    U32, U64,
};

/// Warps per block, each owning one 16-row MMA tile of queries.
const WARPS: u32 = 8;
const THREADS: u32 = WARPS * 32;
/// Query rows per block: one Q scale block.
pub const BLOCK_M: u32 = WARPS * 16;
const _: () = assert!(BLOCK_M == SCALE_BLOCK);

/// The compile-time shape of one configuration.
#[derive(Debug, Clone, Copy)]
struct Shape {
    head_dim: u32,
    block_n: u32,
}

/// Where Q8, K8 and `Vᵀ8` live in shared memory.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    q: TileSlot,
    k: TileSlot,
    vt: TileSlot,
}

impl Shape {
    fn of(cfg: &Fp8Config) -> Shape {
        // Registers per thread (255 at most): O takes d/2, the f32 scores block_n/2 and
        // the e4m3 probabilities block_n/8, and ptxas wants room to keep fragments in
        // flight. The module also runs on Hopper (the fallback path), where ptxas emulates
        // e4m3 mma.sync with f16 HMMA and needs more: d = 128 with 128-key tiles spills
        // there. d = 256 uses 255 registers on Ada with 64-key tiles already (and 128-key
        // tiles would take 96 KiB of shared memory).
        let block_n = if cfg.head_dim > 64 { 64 } else { 128 };
        debug_assert!(SCALE_BLOCK.is_multiple_of(block_n));
        Shape {
            head_dim: cfg.head_dim,
            block_n,
        }
    }
    /// A tile of `rows` rows of `row_bytes` e4m3 bytes.
    fn layout(rows: u32, row_bytes: u32) -> SmemLayout {
        SmemLayout::new(rows, row_bytes, 1, Swizzle::B128)
    }
    fn plan(&self) -> (SmemPlan, Tiles) {
        let mut plan = SmemPlan::new();
        let tiles = Tiles {
            q: plan.tile(Self::layout(BLOCK_M, self.head_dim), 1),
            k: plan.tile(Self::layout(self.block_n, self.head_dim), 1),
            vt: plan.tile(Self::layout(self.head_dim, self.block_n), 1),
        };
        (plan, tiles)
    }
}

pub(crate) fn tiling(cfg: &Fp8Config) -> Tiling {
    let s = Shape::of(cfg);
    Tiling {
        block_m: BLOCK_M,
        block_n: s.block_n,
        threads: THREADS,
        smem_bytes: s.plan().0.bytes(),
    }
}

pub(crate) fn generate(cfg: &Fp8Config) -> Result<Module, PtxError> {
    let kernel = match cfg.out {
        HalfType::F16 => build::<F16x2>(cfg)?,
        HalfType::Bf16 => build::<Bf16x2>(cfg)?,
    };
    let mut module = Module::new(Target::Sm89);
    module.push(kernel)?;
    Ok(module)
}

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

/// One operand's tile copies: the global slice the tiles come from and the shared-memory
/// tile they go to.
///
/// Thread `t` copies 16-byte chunk `t % cpb` of each row of a column block (`cpb` chunks
/// per row), rows `t / cpb + i · rows_per_pass`, in every column block. A pass spans
/// `THREADS · 16` bytes, whole 1024-byte swizzle atoms, so every pass of a thread lands at
/// the same swizzle phase and its shared address simply adds.
struct TileCopy {
    slot: TileSlot,
    smem: Smem,
    /// Global address of the slice's row 0, column 0: always inside the tensor, so also
    /// the source handed to the zero-filling copies (which read nothing).
    origin: Reg<U64>,
    /// Where the argument block holds the bytes from one global row to the next (read at
    /// each use: a parameter costs no register).
    args: ParamBytes,
    row_stride_at: usize,
}

/// A thread's place in a tile copy (recomputed from `%tid.x` at each use rather than
/// kept across the key loop: the loop runs near the register limit).
struct ThreadChunk {
    /// The thread's first row in the tile.
    row: Reg<U32>,
    /// The byte offset of its chunk inside a column-block row.
    col: Reg<U32>,
    /// The shared address of its chunk in its first row of column block 0.
    dst: SmemAddr,
}

impl TileCopy {
    fn chunks_per_row(&self) -> u32 {
        self.slot.layout.block_bytes / 16
    }
    fn rows_per_pass(&self) -> u32 {
        THREADS / self.chunks_per_row()
    }
    /// Passes (`rows_per_pass` rows each) that make up the tile.
    fn passes(&self) -> u32 {
        self.slot.layout.rows / self.rows_per_pass()
    }

    fn row_stride(&self, k: &mut Kernel) -> Reg<U64> {
        arg::<U64>(k, self.args, self.row_stride_at)
    }

    fn thread_chunk(&self, k: &mut Kernel) -> ThreadChunk {
        let l = self.slot.layout;
        let tid = k.special(Special::TidX);
        let chunk = k.and(tid, self.chunks_per_row() - 1);
        let row = k.shr(tid, self.chunks_per_row().trailing_zeros());
        let col = k.shl(chunk, 4);
        let line = k.mad(row, l.block_bytes, col);
        let line = l.swizzle.apply_in(k, line);
        let dst = self.smem.tile_byte(k, self.slot, line);
        ThreadChunk { row, col, dst }
    }

    /// The shared address of a thread's chunk in pass `pass`, column block `block`.
    fn dst(&self, k: &mut Kernel, t: &ThreadChunk, pass: u32, block: u32) -> SmemAddr {
        let l = self.slot.layout;
        let at = block * l.block_stride() + pass * self.rows_per_pass() * l.block_bytes;
        k.smem_offset(t.dst, at)
    }

    /// Passes `range` of the tile whose first row is slice row `first_row`; rows at or
    /// past `limit` are zero-filled (their copies read 0 bytes). For Q8 and K8, whose rows
    /// are sequence positions.
    fn issue_rows(&self, k: &mut Kernel, first_row: Reg<S32>, limit: Reg<S32>, range: Range<u32>) {
        let t = self.thread_chunk(k);
        let rpp = self.rows_per_pass();
        let row = k.add(first_row, t.row.cast::<S32>());
        let row = k.add(row, (range.start * rpp) as i32);
        let left = k.sub(limit, row);
        let col = k.cvt_u64_u32(t.col);
        let row0 = k.add(self.origin, col);
        let row_stride = self.row_stride(k);
        let offset = k.cvt_s64_s32(row).cast::<U64>();
        let offset = k.mul(offset, row_stride);
        let mut src = k.add(row0, offset);
        let pass_stride = k.mul(row_stride, rpp as u64);
        for pass in range.clone() {
            let valid = k.setp(Cmp::Gt, left, ((pass - range.start) * rpp) as i32);
            let from = k.selp(src, row0, valid);
            let bytes = k.selp(16u32, 0u32, valid);
            for block in 0..self.slot.layout.col_blocks() {
                let from = k.add(from, (block * self.slot.layout.block_bytes) as u64);
                let dst = self.dst(k, &t, pass, block);
                k.cp_async_16(dst, from, bytes);
            }
            if pass + 1 < range.end {
                src = k.add(src, pass_stride);
            }
        }
    }

    /// The whole tile whose first column is slice column `first_col`; every row exists, and
    /// 16-byte chunks starting at or past column `limit` are zero-filled. For `Vᵀ8`, whose
    /// columns are keys: a chunk starting below Sk lies inside the pitch (a multiple of 16
    /// that is at least Sk), and nothing past the last real key's chunk is read.
    fn issue_columns(&self, k: &mut Kernel, first_col: Reg<S32>, limit: Reg<S32>) {
        let t = self.thread_chunk(k);
        let l = self.slot.layout;
        let col = k.add(first_col, t.col.cast::<S32>());
        let left = k.sub(limit, col);
        let row_stride = self.row_stride(k);
        let row = k.cvt_u64_u32(t.row);
        let offset = k.mul(row, row_stride);
        let col = k.cvt_u64_u32(col.cast::<U32>());
        let offset = k.add(offset, col);
        let src = k.add(self.origin, offset);
        let pass_stride = k.mul(row_stride, self.rows_per_pass() as u64);
        for block in 0..l.col_blocks() {
            let valid = k.setp(Cmp::Gt, left, (block * l.block_bytes) as i32);
            let bytes = k.selp(16u32, 0u32, valid);
            let mut chunk = k.add(src, (block * l.block_bytes) as u64);
            for pass in 0..self.passes() {
                let from = k.selp(chunk, self.origin, valid);
                let dst = self.dst(k, &t, pass, block);
                k.cp_async_16(dst, from, bytes);
                if pass + 1 < self.passes() {
                    chunk = k.add(chunk, pass_stride);
                }
            }
        }
    }
}

/// Accumulator state and per-thread constants shared by the phases of the kernel.
struct Fwd {
    s: Shape,
    causal: bool,
    /// Output accumulators: the warp's one 16-row slab.
    o: Vec<Slab>,
    softmax: OnlineSoftmax,
    /// ldmatrix row addresses, one per 32-byte step inside a column-block row, for each
    /// operand's lane roles.
    q_frag: Vec<SmemAddr>,
    k_frag: Vec<SmemAddr>,
    vt_frag: Vec<SmemAddr>,
    tiles: Tiles,
}

/// Probabilities packed as e4m3 A fragments: `p[0][t]` covers the tile's keys
/// 32t..32t+31 (the warp's one slab), in `Vᵀ8`'s stored order.
type Probs = Vec<Vec<[Reg<E4m3x4>; 4]>>;

fn build<H: Half2>(cfg: &Fp8Config) -> Result<KernelText, PtxError> {
    let s = Shape::of(cfg);
    let block_n = s.block_n;
    let (plan, tiles) = s.plan();
    let mut k = Kernel::new(&cfg.id());
    // One block per SM is all a key loop of this size needs; without the bound ptxas may
    // trade spills for occupancy.
    k.max_threads(THREADS).min_blocks_per_sm(1);
    let args = k.param_bytes("args", Fp8Args::SIZE, 8);
    let smem = k.shared_memory(&plan);

    k.comment("Which (batch, head, query block) this block owns, and where its sequence is.");
    let group = arg::<U32>(&mut k, args, offset_of!(FwdArgs, group));
    let Coords {
        batch,
        head,
        m_start,
    } = coords(&mut k, cfg.causal, BLOCK_M);
    let seq = sequence(&mut k, args, batch, CacheReads::None);
    let (seqlen_q, seqlen_k) = (seq.seqlen_q, seq.seqlen_k);
    let causal_offset = seq.causal_offset(&mut k);
    let kv_head = k.div(head, group);

    k.comment("Key tiles to visit: 0..end; tiles mask_from.. need masking.");
    let causal = cfg.causal.then_some(causal_offset);
    let n = key_tiles(
        &mut k, seqlen_q, seqlen_k, m_start, BLOCK_M, block_n, causal,
    );

    let f = Fwd::new(&mut k, s, cfg.causal, &smem, tiles);
    let epilogue = k.label();
    let nothing = k.setp(Cmp::Le, n.end, 0i32);
    k.bra_if(nothing, true, epilogue);

    k.comment("Tile copies; Q8 and the last K8 tile go first.");
    // The global address of a slice: the tensor's base plus each coordinate times the
    // stride (in elements, which for e4m3 are bytes) at the given argument offset.
    let slice = |k: &mut Kernel, tensor: usize, coords: &[(Reg<U32>, usize)]| {
        let mut at = arg::<U64>(k, args, tensor);
        for &(coord, stride) in coords {
            let stride = arg::<U64>(k, args, stride);
            let coord = k.cvt_u64_u32(coord);
            at = k.mad(coord, stride, at);
        }
        at
    };
    let copy = |origin, row_stride_at, slot| TileCopy {
        slot,
        smem,
        origin,
        args,
        row_stride_at,
    };
    // Q8 and K8 are [batch, seq, head, d] (strides in that order); Vt8 is [batch, head, d,
    // pitch], its rows the d rows of one (batch, head).
    let (q_st, k_st) = (offset_of!(FwdArgs, q_stride), offset_of!(FwdArgs, k_stride));
    let vt_st = offset_of!(Fp8Args, vt_stride);
    let (b, q_start, k_start) = (seq.tensor_batch, seq.q_start.cast(), seq.k_start.cast());
    let kv_b = seq.kv_batch;
    let at = slice(
        &mut k,
        offset_of!(FwdArgs, q),
        &[(b, q_st), (q_start, q_st + 8), (head, q_st + 16)],
    );
    let q = copy(at, q_st + 8, tiles.q);
    let at = slice(
        &mut k,
        offset_of!(FwdArgs, k),
        &[(kv_b, k_st), (k_start, k_st + 8), (kv_head, k_st + 16)],
    );
    let key = copy(at, k_st + 8, tiles.k);
    let at = slice(
        &mut k,
        offset_of!(Fp8Args, vt),
        &[(kv_b, vt_st), (kv_head, vt_st + 8)],
    );
    let vt = copy(at, vt_st + 16, tiles.vt);
    q.issue_rows(&mut k, m_start, seqlen_q, 0..q.passes());
    let last = k.sub(n.end, 1i32);
    let last_row = k.mul(last, block_n as i32);
    key.issue_rows(&mut k, last_row, seqlen_k, 0..key.passes());
    k.cp_async_commit();

    k.comment("Dequantisation: the Q scale of this block's rows (one scale block).");
    let q_scale = {
        let blocks = arg::<U32>(&mut k, args, offset_of!(Fp8Args, q_scale_blocks));
        let heads_q = arg::<U32>(&mut k, args, offset_of!(FwdArgs, heads_q));
        let row = k.mad(batch, heads_q, head);
        let m_block = k.shr(m_start.cast::<U32>(), SCALE_BLOCK.trailing_zeros());
        let index = k.mad(row, blocks, m_block);
        let offset = k.mul_wide_u32(index, 4u32);
        let ptr = arg::<U64>(&mut k, args, offset_of!(Fp8Args, q_scale));
        let at = k.add(ptr, offset);
        k.ld_global::<F32>(at, 0)
    };
    // Lengths are read again where needed rather than kept across the loop.
    let seq_again = |k: &mut Kernel| {
        let batch = k.special(Special::CtaidZ);
        sequence(k, args, batch, CacheReads::None)
    };
    let step = |k: &mut Kernel, n: Reg<S32>, masked: bool| {
        let n_row = k.mul(n, block_n as i32);
        k.cp_async_wait(0);
        k.sync_threads();
        let seqlen_k = seq_again(k).seqlen_k;
        vt.issue_columns(k, n_row, seqlen_k);
        k.cp_async_commit();

        // The tile's scales, loaded now so their latency hides behind Q·Kᵀ.
        let (k_scale, v_scale) = tile_scales(k, args, n_row);
        let scores = f.scores(k);
        if masked {
            let seq = seq_again(k);
            let causal_offset = seq.causal_offset(k);
            let causal = f.causal.then_some(causal_offset);
            let m_start = coords(k, f.causal, BLOCK_M).m_start;
            let (_, rows) = thread_rows(k, 1);
            apply_mask(
                k,
                &rows,
                &scores,
                n_row,
                m_start,
                seq.seqlen_k,
                causal,
                None,
            );
        }
        let dequant = {
            let scale_log2 = arg::<F32>(k, args, offset_of!(FwdArgs, scale_log2));
            let qk = k.mul(q_scale, k_scale);
            let dequant = k.mul(qk, scale_log2);
            clamp_dequant(k, dequant, s.head_dim)
        };

        // Every warp is done with K8[n], and Vt8[n] has landed: refill K8 with K8[n-1],
        // half now and half after the softmax, as sm80 does (so ptxas keeps the softmax
        // and the PV product apart).
        k.cp_async_wait(0);
        k.sync_threads();
        let more = k.setp(Cmp::Gt, n, 0i32);
        let prev_row = k.sub(n_row, block_n as i32);
        let half = key.passes() / 2;
        k.if_(more, |k| {
            let seqlen_k = seq_again(k).seqlen_k;
            key.issue_rows(k, prev_row, seqlen_k, 0..half)
        });
        let p: Probs = f.softmax.step_e4m3(k, &scores, &f.o, dequant, P_SHIFT_LOG2);
        k.if_(more, |k| {
            let seqlen_k = seq_again(k).seqlen_k;
            key.issue_rows(k, prev_row, seqlen_k, half..key.passes())
        });
        k.cp_async_commit();
        f.accumulate_pv(k, &p, v_scale);
    };

    k.comment("Key tiles that cross the sequence end or the diagonal, last to first.");
    let unmasked = k.min(n.mask_from, n.end);
    let last_unmasked = k.sub(unmasked, 1i32);
    k.for_range(last, last_unmasked, -1, |k, n| step(k, n, true));
    k.comment("The remaining key tiles need no mask.");
    k.for_range(last_unmasked, -1i32, -1, |k, n| step(k, n, false));

    k.place(epilogue);
    let c = coords(&mut k, cfg.causal, BLOCK_M);
    let (_, rows) = thread_rows(&mut k, 1);
    let at = OutputBlock {
        batch: c.batch,
        head: c.head,
        m_start: c.m_start,
        seq: sequence(&mut k, args, c.batch, CacheReads::None),
    };
    let shift = k.load_param_at::<U64>(args, offset_of!(Fp8Args, lse_shift));
    let form = LseForm::Log2 {
        offset: P_SHIFT_LOG2,
        shift,
    };
    store_output_lse::<H>(&mut k, args, &rows, &f.o, &f.softmax, at, form);
    k.finish()
}

/// `(k_scale, v_scale)` of the key tile starting at key `first_key`: entry
/// `first_key / 128` of the block's (batch, kv head) row of `[B, Hkv, blocks]`.
///
/// The row is found again from the block's coordinates at each tile rather than kept
/// across the key loop (the loop runs at the register limit): with `Hq = Hkv · group`,
/// `(batch · Hq + head) / group` is `batch · Hkv + kv_head`.
fn tile_scales(k: &mut Kernel, args: ParamBytes, first_key: Reg<S32>) -> (Reg<F32>, Reg<F32>) {
    let head = k.special(Special::CtaidY);
    let batch = k.special(Special::CtaidZ);
    let heads_q = arg::<U32>(k, args, offset_of!(FwdArgs, heads_q));
    let group = arg::<U32>(k, args, offset_of!(FwdArgs, group));
    let blocks = arg::<U32>(k, args, offset_of!(Fp8Args, kv_scale_blocks));
    let q_row = k.mad(batch, heads_q, head);
    let kv_row = k.div(q_row, group);
    let block = k.shr(first_key.cast::<U32>(), SCALE_BLOCK.trailing_zeros());
    let index = k.mad(kv_row, blocks, block);
    let offset = k.mul_wide_u32(index, 4u32);
    let mut load = |field: usize| {
        let base = arg::<U64>(k, args, field);
        let addr = k.add(base, offset);
        k.ld_global::<F32>(addr, 0)
    };
    let k_scale = load(offset_of!(Fp8Args, k_scale));
    let v_scale = load(offset_of!(Fp8Args, v_scale));
    (k_scale, v_scale)
}

impl Fwd {
    fn new(k: &mut Kernel, s: Shape, causal: bool, smem: &Smem, tiles: Tiles) -> Self {
        k.comment("Accumulators and per-thread fragment addresses.");
        let o = zeroed_slabs(k, 1, (s.head_dim / 8) as usize);
        let softmax = OnlineSoftmax::new(k, 1).with_max_rounded_up();

        let (warp_rows, _) = thread_rows(k, 1);
        let tid = k.special(Special::TidX);
        let lane = k.and(tid, 31u32);
        // ldmatrix lane roles (lane L feeds row L%8 of matrix L/8), chosen so that each
        // mma's fragments come back in consecutive registers (see sm80):
        //   Q8 (A operand, rows = queries):       row L%16,            column half L/16
        //   K8 and Vt8 (B operands, rows = n):    row L%8 + 8·(L/16),  column half (L/8)%2
        // A B-operand ldmatrix.x4 covers 16 n-rows: registers 0, 1 are the fragment of
        // rows 0..7, registers 2, 3 that of rows 8..15.
        let LaneRoles { l8, l16, hi16, mid } = LaneRoles::of(k, lane);
        let q_row = k.add(warp_rows, l16);
        let b_row = k.mad(hi16, 8u32, l8);
        let q_frag = frag_addresses(k, smem, tiles.q, q_row, hi16);
        let k_frag = frag_addresses(k, smem, tiles.k, b_row, mid);
        let vt_frag = frag_addresses(k, smem, tiles.vt, b_row, mid);
        Fwd {
            s,
            causal,
            o,
            softmax,
            q_frag,
            k_frag,
            vt_frag,
            tiles,
        }
    }

    /// The shared address of 32-byte k step `kk` of the 16 rows from `row` of a tile, for
    /// this thread's lane role (`frag`).
    fn frag_at(
        k: &mut Kernel,
        frag: &[SmemAddr],
        layout: SmemLayout,
        kk: u32,
        row: u32,
    ) -> SmemAddr {
        let steps = layout.block_bytes / 32;
        let (step, block) = ((kk % steps) as usize, kk / steps);
        let at = block * layout.block_stride() + row * layout.block_bytes;
        k.smem_offset(frag[step], at)
    }

    /// `S8 = Q8 K8ᵀ` for the current key tile, in f32.
    fn scores(&self, k: &mut Kernel) -> Vec<Slab> {
        let s = &self.s;
        let acc = zeroed_slabs(k, 1, (s.block_n / 8) as usize);
        let (q, kl) = (self.tiles.q.layout, self.tiles.k.layout);
        for kk in 0..s.head_dim / 32 {
            let addr = Self::frag_at(k, &self.q_frag, q, kk, 0);
            let a = k.ldmatrix_x4::<E4m3x4>(addr, false);
            for np in 0..s.block_n / 16 {
                let addr = Self::frag_at(k, &self.k_frag, kl, kk, 16 * np);
                let [b0, b1, b2, b3] = k.ldmatrix_x4::<E4m3x4>(addr, false);
                let (lo, hi) = (&acc[0][2 * np as usize], &acc[0][2 * np as usize + 1]);
                k.mma_m16n8k32_e4m3(lo, &a, &[b0, b1], lo);
                k.mma_m16n8k32_e4m3(hi, &a, &[b2, b3], hi);
            }
        }
        acc
    }

    /// `O += v_scale · (P8 Vt8)` for the current tile: per 16 output columns, the tile's
    /// product is summed from zero over the tile's keys and then added in f32.
    fn accumulate_pv(&self, k: &mut Kernel, p: &Probs, v_scale: Reg<F32>) {
        let s = &self.s;
        let vt = self.tiles.vt.layout;
        for np in 0..s.head_dim / 16 {
            let t: [[Reg<F32>; 4]; 2] =
                std::array::from_fn(|_| std::array::from_fn(|_| k.mov(0f32)));
            for (kk, a) in p[0].iter().enumerate() {
                let addr = Self::frag_at(k, &self.vt_frag, vt, kk as u32, 16 * np);
                let [b0, b1, b2, b3] = k.ldmatrix_x4::<E4m3x4>(addr, false);
                k.mma_m16n8k32_e4m3(&t[0], a, &[b0, b1], &t[0]);
                k.mma_m16n8k32_e4m3(&t[1], a, &[b2, b3], &t[1]);
            }
            for (o, t) in self.o[0][2 * np as usize..].iter().zip(&t) {
                for (&o, &t) in o.iter().zip(t) {
                    k.mad_to(o, t, v_scale, o);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::fp8::{Fp8Path, fp8_configs_on};

    fn sm89_configs() -> impl Iterator<Item = Fp8Config> {
        fp8_configs_on(Fp8Path::Sm89)
    }

    /// The address arithmetic adds pass, 16-row and column-block offsets to a swizzled
    /// base; that is only right when each of them is a whole number of 1024-byte atoms.
    /// Tiles must also divide the scale blocks and fit sm_89's shared memory.
    #[test]
    fn every_tiling_keeps_offsets_atom_aligned() {
        for cfg in sm89_configs() {
            let s = Shape::of(&cfg);
            let id = cfg.id();
            assert_eq!(
                SCALE_BLOCK % s.block_n,
                0,
                "{id}: tiles straddle scale blocks"
            );
            assert_eq!(s.block_n % 32, 0, "{id}: whole k32 steps of P");
            let (plan, t) = s.plan();
            for slot in [t.q, t.k, t.vt] {
                let l = slot.layout;
                let cpb = l.block_bytes / 16;
                let rpp = THREADS / cpb;
                assert!(l.is_valid(), "{id}: {l:?}");
                assert_eq!(l.rows % rpp, 0, "{id}: {} rows in passes of {rpp}", l.rows);
                assert_eq!(rpp * l.block_bytes % 1024, 0, "{id}: pass of {rpp} rows");
                assert_eq!(16 * l.block_bytes % 1024, 0, "{id}: 16-row MMA tile");
                assert_eq!(l.block_stride() % 1024, 0, "{id}: column block");
                assert_eq!(l.block_bytes % 32, 0, "{id}: whole k32 steps");
            }
            assert!(
                plan.bytes() <= 64 * 1024,
                "{id}: {} bytes of shared memory",
                plan.bytes()
            );
            assert_eq!(cfg.tiling().smem_bytes, plan.bytes());
        }
    }

    #[test]
    fn every_config_generates_for_sm89() {
        for cfg in sm89_configs() {
            let m = cfg
                .generate()
                .unwrap_or_else(|e| panic!("{}: {e}", cfg.id()));
            let ptx = m.to_ptx();
            assert!(ptx.contains(".target sm_89"), "{}", cfg.id());
            assert!(ptx.contains("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"));
            assert!(ptx.contains("cvt.rn.satfinite.e4m3x2.f32"));
        }
    }
}
