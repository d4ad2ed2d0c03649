//! FlashAttention-2 style forward for sm_80 and up (`.target sm_80`: the same module runs
//! on Ampere, Ada and Hopper).
//!
//! One block owns `block_m` query rows of one (batch, head); each warp owns
//! `16 * m_tiles` of those rows. The block walks the keys backwards in tiles of `block_n`,
//! so the tiles that need masking (the causal diagonal, the sequence tail) come first and
//! the rest run unmasked:
//!
//! ```text
//! load Q, K[last]                                   (cp.async)
//! for n in (0..n_end).rev():
//!     wait K[n]; issue V[n]                         (V lands while S is computed)
//!     S = Q K[n]^T                                  (ldmatrix + mma.sync m16n8k16)
//!     mask S if tile n crosses the diagonal or the sequence end
//!     online softmax: m, l, rescale O, P = exp2(S·scale·log2e − m·scale·log2e)
//!     wait V[n]; issue K[n-1]                       (K lands while PV is computed)
//!     O += P V[n]                                   (P never leaves registers)
//! O /= l; store O and LSE
//! ```
//!
//! Shared-memory tiles are stored in column blocks, `[d / 64][rows][128 B]` (or
//! `[d / 32][rows][64 B]` when d is not a multiple of 64: d = 32, 96), under the 128-byte
//! XOR [`swizzle`], so the 8 row addresses of an `ldmatrix` land in 8 different bank
//! groups. K and V each have one buffer: each is refilled while the other is consumed.

use super::{BLOCK_M_NARROW, FwdArgs, FwdConfig, HalfType, Tiling};
use crate::ptx::{
    Bf16x2, Cmp, F16x2, F32, Half2, Kernel, KernelText, Module, ParamBytes, PtxError, PtxType, Reg,
    S32, Special, Target, U32, U64,
};
use std::marker::PhantomData;
use std::mem::offset_of;

/// The compile-time shape of one configuration.
#[derive(Debug, Clone, Copy)]
struct Shape {
    head_dim: u32,
    warps: u32,
    /// 16-row MMA tiles per warp.
    m_tiles: u32,
    block_n: u32,
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
    /// Bytes of one row of a column block: 64 elements, or 32 when d is not a multiple
    /// of 64 (d = 32, 96).
    fn row_bytes(&self) -> u32 {
        if self.head_dim.is_multiple_of(64) {
            128
        } else {
            64
        }
    }
    fn tile_bytes(&self, rows: u32) -> u32 {
        rows * self.head_dim * 2
    }
    fn k_offset(&self) -> u32 {
        self.tile_bytes(self.block_m())
    }
    fn v_offset(&self) -> u32 {
        self.k_offset() + self.tile_bytes(self.block_n)
    }
    fn smem_bytes(&self) -> u32 {
        self.v_offset() + self.tile_bytes(self.block_n)
    }
    /// Column blocks per row.
    fn col_blocks(&self) -> u32 {
        self.head_dim * 2 / self.row_bytes()
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
        smem_bytes: s.smem_bytes(),
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

/// The 128-byte XOR swizzle on an offset inside a 1024-byte-aligned tile: the 16-byte
/// chunk index (bits 4..6) is XORed with the 128-byte line index (bits 7..9).
pub fn swizzle(offset: u32) -> u32 {
    offset ^ (((offset >> 7) & 7) << 4)
}

/// The same swizzle, computed in the kernel.
fn swizzle_reg(k: &mut Kernel, offset: Reg<U32>) -> Reg<U32> {
    let line = k.shr(offset, 7);
    let line = k.and(line, 7u32);
    let flip = k.shl(line, 4);
    k.xor(offset, flip)
}

fn log2(x: u32) -> u32 {
    debug_assert!(x.is_power_of_two());
    x.trailing_zeros()
}

/// `ceil(x / d)` for a power-of-two `d`, correct for negative `x` (arithmetic shift).
fn ceil_div(k: &mut Kernel, x: Reg<S32>, d: u32) -> Reg<S32> {
    let t = k.add(x, d as i32 - 1);
    k.shr(t, log2(d))
}

/// `floor(x / d)` for a power-of-two `d`.
fn floor_div(k: &mut Kernel, x: Reg<S32>, d: u32) -> Reg<S32> {
    k.shr(x, log2(d))
}

/// One thread's part in copying `rows`-row tiles of a [seq, d] slice into shared memory.
///
/// Thread `t` always copies chunk `t % cpb` of a column-block row (`cpb` 16-byte chunks per
/// 128-byte row), for rows `t / cpb + i · rows_per_pass` of every column block.
struct TileLoader {
    rows: u32,
    /// Global address of this thread's chunk in its first row of the slice (column block 0).
    global: Reg<U64>,
    /// Bytes from one sequence row to the next.
    row_stride: Reg<U64>,
    /// Shared address of this thread's chunk in its first row (column block 0).
    shared: Reg<U32>,
    /// `seqlen - (this thread's first row)`: rows this thread may read, from row 0.
    rows_left: Reg<S32>,
}

impl TileLoader {
    /// Issues the `cp.async` copies of the tile starting at sequence row `first_row`.
    /// Rows at or past the sequence end are zero-filled, their source never read.
    fn issue(&self, k: &mut Kernel, s: &Shape, first_row: Reg<S32>) {
        let rpp = s.rows_per_pass();
        let left = k.sub(self.rows_left, first_row);
        let offset = k.mul_wide_s32(first_row, 1i32);
        let offset = offset.cast::<U64>();
        let offset = k.mul(offset, self.row_stride);
        let mut src = k.add(self.global, offset);
        let pass_stride = k.mul(self.row_stride, rpp as u64);
        for pass in 0..self.rows / rpp {
            let valid = k.setp(Cmp::Gt, left, (pass * rpp) as i32);
            let from = k.selp(src, self.global, valid);
            let bytes = k.selp(16u32, 0u32, valid);
            for block in 0..s.col_blocks() {
                let from = k.add(from, (block * s.row_bytes()) as u64);
                let at = block * self.rows * s.row_bytes() + pass * rpp * s.row_bytes();
                let dst = k.add(self.shared, at);
                k.cp_async_16(dst, from, bytes);
            }
            if pass + 1 < self.rows / rpp {
                src = k.add(src, pass_stride);
            }
        }
    }
}

/// Accumulator state and per-thread constants shared by the phases of the kernel.
struct Fwd<H: Half2> {
    s: Shape,
    causal: bool,
    /// Output accumulators: `o[mt][nt]` is m16n8 tile `nt` of MMA tile `mt`.
    o: Vec<Vec<[Reg<F32>; 4]>>,
    /// Running row max of raw scores, rows g and g+8 of each MMA tile.
    row_max: Vec<[Reg<F32>; 2]>,
    /// This thread's partial row sums (the quad is summed in the epilogue).
    row_sum: Vec<[Reg<F32>; 2]>,
    /// This thread's first query row inside the block (`16·m_tiles·warp + lane/4`).
    thread_row: Reg<S32>,
    /// `2·(lane % 4)`: this thread's first column inside an m16n8 tile.
    thread_col: Reg<S32>,
    /// ldmatrix row addresses, one per 32-byte step inside a 128-byte line.
    q_frag: Vec<Reg<U32>>,
    k_frag: Vec<Reg<U32>>,
    v_frag: Vec<Reg<U32>>,
    _h: PhantomData<H>,
}

/// Scores of one key tile: `s[mt][nt]`, m16n8 accumulator tiles.
type Scores = Vec<Vec<[Reg<F32>; 4]>>;
/// Probabilities packed as `mma` A fragments: `p[mt][t]` covers keys 16t..16t+15.
type Probs<H> = Vec<Vec<[Reg<H>; 4]>>;

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

fn build<H: Half2>(cfg: &FwdConfig) -> Result<KernelText, PtxError> {
    let s = Shape::of(cfg);
    let (block_m, block_n) = (s.block_m(), s.block_n);
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(s.threads());
    let args = k.param_bytes("args", FwdArgs::SIZE, 8);
    let smem = k.dynamic_shared(1024);
    let tid = k.special(Special::TidX);

    k.comment("Which (batch, head, query block) this block owns.");
    let seqlen_q = arg::<S32>(&mut k, args, offset_of!(FwdArgs, seqlen_q));
    let seqlen_k = arg::<S32>(&mut k, args, offset_of!(FwdArgs, seqlen_k));
    let causal_offset = arg::<S32>(&mut k, args, offset_of!(FwdArgs, causal_offset));
    let scale_log2 = arg::<F32>(&mut k, args, offset_of!(FwdArgs, scale_log2));
    let group = arg::<U32>(&mut k, args, offset_of!(FwdArgs, group));
    let block_x = k.special(Special::CtaidX);
    let head = k.special(Special::CtaidY);
    let batch = k.special(Special::CtaidZ);
    let m_block = if cfg.causal {
        // Causal blocks differ in work: launch the heaviest (last) query blocks first.
        let blocks = k.special(Special::NctaidX);
        let last = k.sub(blocks, 1u32);
        k.sub(last, block_x)
    } else {
        block_x
    };
    let m_start = k.mul(m_block.cast::<S32>(), block_m as i32);
    let kv_head = k.div(head, group);

    k.comment("Key tiles to visit: 0..n_end; tiles n_mask.. need masking.");
    let n_total = ceil_div(&mut k, seqlen_k, block_n);
    let full_tiles = floor_div(&mut k, seqlen_k, block_n);
    let (n_end, n_mask) = if cfg.causal {
        // Row i sees keys j <= i + causal_offset.
        let seen_by_last = k.add(m_start, block_m as i32);
        let seen_by_last = k.add(seen_by_last, causal_offset);
        let n_end = ceil_div(&mut k, seen_by_last, block_n);
        let n_end = k.max(n_end, 0i32);
        let n_end = k.min(n_end, n_total);
        // The first tile holding a key the block's first row cannot see.
        let seen_by_first = k.add(m_start, causal_offset);
        let seen_by_first = k.add(seen_by_first, 1i32);
        let diag = floor_div(&mut k, seen_by_first, block_n);
        let diag = k.max(diag, 0i32);
        (n_end, k.min(diag, full_tiles))
    } else {
        (n_total, full_tiles)
    };

    let f = Fwd::<H>::new(&mut k, s, cfg.causal, tid, smem);
    let epilogue = k.label();
    let nothing = k.setp(Cmp::Le, n_end, 0i32);
    k.bra_if(nothing, true, epilogue);

    k.comment("Tile loaders; Q and the last K tile go first.");
    let chunk = k.and(tid, s.chunks_per_block_row() - 1);
    let first_row = k.shr(tid, log2(s.chunks_per_block_row()));
    let q = f.loader(
        &mut k,
        args,
        (offset_of!(FwdArgs, q), offset_of!(FwdArgs, q_stride)),
        [batch, head],
        seqlen_q,
        chunk,
        first_row,
        smem,
        0,
        block_m,
    );
    let key = f.loader(
        &mut k,
        args,
        (offset_of!(FwdArgs, k), offset_of!(FwdArgs, k_stride)),
        [batch, kv_head],
        seqlen_k,
        chunk,
        first_row,
        smem,
        s.k_offset(),
        block_n,
    );
    let val = f.loader(
        &mut k,
        args,
        (offset_of!(FwdArgs, v), offset_of!(FwdArgs, v_stride)),
        [batch, kv_head],
        seqlen_k,
        chunk,
        first_row,
        smem,
        s.v_offset(),
        block_n,
    );
    q.issue(&mut k, &s, m_start);
    let last = k.sub(n_end, 1i32);
    let last_row = k.mul(last, block_n as i32);
    key.issue(&mut k, &s, last_row);
    k.cp_async_commit();

    k.comment("Main loop over key tiles, last to first.");
    k.for_range(last, -1i32, -1, |k, n| {
        let n_row = k.mul(n, block_n as i32);
        k.cp_async_wait(0);
        k.sync_threads();
        val.issue(k, &s, n_row);
        k.cp_async_commit();

        let scores = f.scores(k);
        let needs_mask = k.setp(Cmp::Ge, n, n_mask);
        k.if_(needs_mask, |k| {
            f.mask(k, &scores, n_row, m_start, seqlen_k, causal_offset)
        });
        let p = f.online_softmax(k, &scores, scale_log2);

        k.cp_async_wait(0);
        k.sync_threads();
        let more = k.setp(Cmp::Gt, n, 0i32);
        k.if_(more, |k| {
            let prev_row = k.sub(n_row, block_n as i32);
            key.issue(k, &s, prev_row);
        });
        k.cp_async_commit();
        f.accumulate_pv(k, &p);
    });

    k.place(epilogue);
    f.epilogue(&mut k, args, batch, head, m_start, seqlen_q, scale_log2);
    k.finish()
}

impl<H: Half2> Fwd<H> {
    fn new(k: &mut Kernel, s: Shape, causal: bool, tid: Reg<U32>, smem: Reg<U32>) -> Self {
        k.comment("Accumulators and per-thread fragment addresses.");
        let mt_n = s.m_tiles as usize;
        let o = (0..mt_n)
            .map(|_| (0..s.head_dim / 8).map(|_| zeros(k)).collect())
            .collect();
        let row_max = (0..mt_n)
            .map(|_| [k.mov(f32::NEG_INFINITY), k.mov(f32::NEG_INFINITY)])
            .collect();
        let row_sum = (0..mt_n).map(|_| [k.mov(0f32), k.mov(0f32)]).collect();

        let lane = k.and(tid, 31u32);
        let warp = k.shr(tid, 5);
        let warp_rows = k.mul(warp, 16 * s.m_tiles);
        let quad = k.shr(lane, 2);
        let thread_row = k.add(warp_rows, quad).cast::<S32>();
        let quad_lane = k.and(lane, 3u32);
        let thread_col = k.shl(quad_lane, 1).cast::<S32>();

        // ldmatrix lane roles (lane L feeds row L%8 of matrix L/8):
        // Q (A operand): row L%16, column half L/16.
        // K (B operand of S): row L%8 + 8·(L/16), column half (L/8)%2.
        // V (B operand of O, transposed): row L%8 + 8·((L/8)%2), column half L/16.
        let l8 = k.and(lane, 7u32);
        let l16 = k.and(lane, 15u32);
        let hi16 = k.shr(lane, 4);
        let mid = k.shr(lane, 3);
        let mid = k.and(mid, 1u32);
        let q_row = k.add(warp_rows, l16);
        let k_row = k.mad(hi16, 8u32, l8);
        let v_row = k.mad(mid, 8u32, l8);
        let q_frag = frag_addresses(k, &s, smem, 0, q_row, hi16);
        let k_frag = frag_addresses(k, &s, smem, s.k_offset(), k_row, mid);
        let v_frag = frag_addresses(k, &s, smem, s.v_offset(), v_row, hi16);
        Fwd {
            s,
            causal,
            o,
            row_max,
            row_sum,
            thread_row,
            thread_col,
            q_frag,
            k_frag,
            v_frag,
            _h: PhantomData,
        }
    }

    /// A loader for the [seq, d] slice of `tensor` at (batch, head).
    #[allow(clippy::too_many_arguments)]
    fn loader(
        &self,
        k: &mut Kernel,
        args: ParamBytes,
        (tensor, strides): (usize, usize),
        [batch, head]: [Reg<U32>; 2],
        seqlen: Reg<S32>,
        chunk: Reg<U32>,
        first_row: Reg<U32>,
        smem: Reg<U32>,
        tile_offset: u32,
        rows: u32,
    ) -> TileLoader {
        let s = &self.s;
        let base = arg::<U64>(k, args, tensor);
        let batch_stride = arg::<U64>(k, args, strides);
        let seq_stride = arg::<U64>(k, args, strides + 8);
        let head_stride = arg::<U64>(k, args, strides + 16);
        let b = k.cvt_u64_u32(batch);
        let h = k.cvt_u64_u32(head);
        let r = k.cvt_u64_u32(first_row);
        let elems = k.mul(b, batch_stride);
        let elems = k.mad(h, head_stride, elems);
        let elems = k.mad(r, seq_stride, elems);
        let bytes = k.shl(elems, 1);
        let c = k.cvt_u64_u32(chunk);
        let c = k.shl(c, 4);
        let bytes = k.add(bytes, c);
        let global = k.add(base, bytes);
        let row_stride = k.shl(seq_stride, 1);

        let line = k.mul(first_row, s.row_bytes());
        let line = k.mad(chunk, 16u32, line);
        let line = swizzle_reg(k, line);
        let shared = k.add(smem, line);
        let shared = k.add(shared, tile_offset);
        let rows_left = k.sub(seqlen, first_row.cast::<S32>());
        TileLoader {
            rows,
            global,
            row_stride,
            shared,
            rows_left,
        }
    }

    /// `S = Q K^T` for the current key tile.
    fn scores(&self, k: &mut Kernel) -> Scores {
        let s = &self.s;
        let (mt_n, nt_n) = (s.m_tiles as usize, (s.block_n / 8) as usize);
        let acc: Scores = (0..mt_n)
            .map(|_| (0..nt_n).map(|_| zeros(k)).collect())
            .collect();
        let kpb = s.k16_per_block();
        for kk in 0..s.head_dim / 16 {
            let (step, block) = ((kk % kpb) as usize, kk / kpb);
            let q: Vec<[Reg<H>; 4]> = (0..s.m_tiles)
                .map(|mt| {
                    let at = block * s.block_m() * s.row_bytes() + mt * 16 * s.row_bytes();
                    let addr = k.add(self.q_frag[step], at);
                    k.ldmatrix_x4::<H>(addr, false)
                })
                .collect();
            for np in 0..s.block_n / 16 {
                let at = block * s.block_n * s.row_bytes() + np * 16 * s.row_bytes();
                let addr = k.add(self.k_frag[step], at);
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

    /// Sets scores of keys a row must not see to −∞: keys at or past `seqlen_k`, and with
    /// causal masking keys past the row's diagonal `row + causal_offset`.
    fn mask(
        &self,
        k: &mut Kernel,
        scores: &Scores,
        n_row: Reg<S32>,
        m_start: Reg<S32>,
        seqlen_k: Reg<S32>,
        causal_offset: Reg<S32>,
    ) {
        let first_col = k.add(n_row, self.thread_col);
        for (mt, tiles) in scores.iter().enumerate() {
            for half in 0..2 {
                let mut limit = seqlen_k;
                if self.causal {
                    let row = k.add(m_start, self.thread_row);
                    let row = k.add(row, (mt * 16 + half * 8) as i32);
                    let diag = k.add(row, causal_offset);
                    let diag = k.add(diag, 1i32);
                    limit = k.min(limit, diag);
                }
                // Column c of tile nt is first_col + 8·nt + j: masked when that >= limit.
                let room = k.sub(limit, first_col);
                for (nt, tile) in tiles.iter().enumerate() {
                    for j in 0..2 {
                        let masked = k.setp(Cmp::Le, room, (nt * 8 + j) as i32);
                        let v = tile[2 * half + j];
                        k.selp_to(v, f32::NEG_INFINITY, v, masked);
                    }
                }
            }
        }
    }

    /// Online softmax over one tile: updates the running max and sums, rescales O, and
    /// returns the probabilities packed as A fragments.
    fn online_softmax(&self, k: &mut Kernel, scores: &Scores, scale_log2: Reg<F32>) -> Probs<H> {
        for (mt, tiles) in scores.iter().enumerate() {
            for half in 0..2 {
                let mut tile_max = k.max(tiles[0][2 * half], tiles[0][2 * half + 1]);
                for tile in &tiles[1..] {
                    tile_max = k.max(tile_max, tile[2 * half]);
                    tile_max = k.max(tile_max, tile[2 * half + 1]);
                }
                for lanes in [1, 2] {
                    let other = k.shfl_bfly(tile_max, lanes);
                    tile_max = k.max(tile_max, other);
                }
                let old_max = self.row_max[mt][half];
                let new_max = k.max(old_max, tile_max);
                // A row that has seen only masked keys keeps max −∞; subtract 0 instead so
                // exp2 gives 0 rather than NaN.
                let none = k.setp(Cmp::Eq, new_max, f32::NEG_INFINITY);
                let usable = k.selp(0f32, new_max, none);
                let neg_max_scaled = k.mul(usable, scale_log2);
                let neg_max_scaled = k.neg(neg_max_scaled);
                let rescale = k.mad(old_max, scale_log2, neg_max_scaled);
                let rescale = k.ex2(rescale);
                k.mov_to(old_max, new_max);
                let sum = self.row_sum[mt][half];
                k.mul_to(sum, sum, rescale);
                for acc in &self.o[mt] {
                    k.mul_to(acc[2 * half], acc[2 * half], rescale);
                    k.mul_to(acc[2 * half + 1], acc[2 * half + 1], rescale);
                }
                for tile in tiles {
                    for j in 0..2 {
                        let v = tile[2 * half + j];
                        let e = k.mad(v, scale_log2, neg_max_scaled);
                        k.ex2_to(v, e);
                        k.add_to(sum, sum, v);
                    }
                }
            }
        }
        // Accumulator tiles 2t and 2t+1 are exactly the A fragment of keys 16t..16t+15.
        scores
            .iter()
            .map(|tiles| {
                tiles
                    .chunks(2)
                    .map(|pair| {
                        let [a, b] = [&pair[0], &pair[1]];
                        [
                            k.pack_half2::<H>(a[0], a[1]),
                            k.pack_half2::<H>(a[2], a[3]),
                            k.pack_half2::<H>(b[0], b[1]),
                            k.pack_half2::<H>(b[2], b[3]),
                        ]
                    })
                    .collect()
            })
            .collect()
    }

    /// `O += P V` for the current value tile.
    fn accumulate_pv(&self, k: &mut Kernel, p: &Probs<H>) {
        let s = &self.s;
        let kpb = s.k16_per_block();
        for t in 0..s.block_n / 16 {
            for np in 0..s.head_dim / 16 {
                let (step, block) = ((np % kpb) as usize, np / kpb);
                let at = block * s.block_n * s.row_bytes() + t * 16 * s.row_bytes();
                let addr = k.add(self.v_frag[step], at);
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

    /// Normalises O by the row sums, stores it (rows < seqlen_q) and the LSE if asked.
    #[allow(clippy::too_many_arguments)]
    fn epilogue(
        &self,
        k: &mut Kernel,
        args: ParamBytes,
        batch: Reg<U32>,
        head: Reg<U32>,
        m_start: Reg<S32>,
        seqlen_q: Reg<S32>,
        scale_log2: Reg<F32>,
    ) {
        k.comment("Epilogue: O / l to global memory, and the log-sum-exp.");
        let o_ptr = arg::<U64>(k, args, offset_of!(FwdArgs, o));
        let o_batch = arg::<U64>(k, args, offset_of!(FwdArgs, o_stride));
        let o_seq = arg::<U64>(k, args, offset_of!(FwdArgs, o_stride) + 8);
        let o_head = arg::<U64>(k, args, offset_of!(FwdArgs, o_stride) + 16);
        let lse_ptr = arg::<U64>(k, args, offset_of!(FwdArgs, lse));
        let heads_q = arg::<U32>(k, args, offset_of!(FwdArgs, heads_q));
        let b = k.cvt_u64_u32(batch);
        let h = k.cvt_u64_u32(head);
        let elems = k.mul(b, o_batch);
        let elems = k.mad(h, o_head, elems);
        let col = k.cvt_u64_u32(self.thread_col.cast::<U32>());
        let elems = k.add(elems, col);
        let bytes = k.shl(elems, 1);
        let o_base = k.add(o_ptr, bytes);
        // lse[(batch·Hq + head)·Sq + row]
        let bh = k.mad(batch, heads_q, head);
        let lse_row0 = k.mul(bh, seqlen_q.cast::<U32>());
        let want_lse = k.setp(Cmp::Ne, lse_ptr, 0u64);
        let quad_lane = k.shr(self.thread_col.cast::<U32>(), 1);
        let lse_lane = k.setp(Cmp::Eq, quad_lane, 0u32);
        let want_lse = k.and_pred(want_lse, lse_lane);

        for mt in 0..self.s.m_tiles as usize {
            for half in 0..2 {
                let mut sum = self.row_sum[mt][half];
                for lanes in [1, 2] {
                    let other = k.shfl_bfly(sum, lanes);
                    sum = k.add(sum, other);
                }
                let empty = k.setp(Cmp::Eq, sum, 0f32);
                let inv = k.rcp(sum);
                let inv = k.selp(0f32, inv, empty);
                let row = k.add(m_start, self.thread_row);
                let row = k.add(row, (mt * 16 + half * 8) as i32);
                let inside = k.setp(Cmp::Lt, row, seqlen_q);
                let row64 = k.cvt_u64_u32(row.cast::<U32>());
                let offset = k.mul(row64, o_seq);
                let offset = k.shl(offset, 1);
                let addr = k.add(o_base, offset);
                let words: Vec<Reg<H>> = self.o[mt]
                    .iter()
                    .map(|acc| {
                        let lo = k.mul(acc[2 * half], inv);
                        let hi = k.mul(acc[2 * half + 1], inv);
                        k.pack_half2::<H>(lo, hi)
                    })
                    .collect();
                k.guarded(inside, true, |k| {
                    for (nt, w) in words.iter().enumerate() {
                        k.st_global(addr, (nt * 16) as i32, *w);
                    }
                });
                // LSE = ln(sum) + max·scale = (log2(sum) + max·scale·log2e)·ln2.
                let log_sum = k.lg2(sum);
                let lse = k.mad(self.row_max[mt][half], scale_log2, log_sum);
                let lse = k.mul(lse, std::f32::consts::LN_2);
                let lse = k.selp(f32::NEG_INFINITY, lse, empty);
                let store = k.and_pred(want_lse, inside);
                let index = k.add(lse_row0, row.cast::<U32>());
                let offset = k.mul_wide_u32(index, 4u32);
                let lse_addr = k.add(lse_ptr, offset);
                k.guarded(store, true, |k| k.st_global(lse_addr, 0, lse));
            }
        }
    }
}

/// Four registers set to 0.0 (one m16n8 accumulator tile).
fn zeros(k: &mut Kernel) -> [Reg<F32>; 4] {
    std::array::from_fn(|_| k.mov(0f32))
}

/// Per-thread `ldmatrix` row addresses for a tile at `tile_offset`: row `row` of the
/// tile, 16-byte column `half`, one address per 32-byte step `i` inside a 128-byte line.
/// Stepping by 32 bytes flips bits 5..6, which the swizzle leaves alone, so each step's
/// address is the swizzled base XOR `i << 5`; other offsets (16-row groups, column
/// blocks) are multiples of 1024 bytes and simply add.
fn frag_addresses(
    k: &mut Kernel,
    s: &Shape,
    smem: Reg<U32>,
    tile_offset: u32,
    row: Reg<U32>,
    half: Reg<U32>,
) -> Vec<Reg<U32>> {
    let line = k.mul(row, s.row_bytes());
    let line = k.mad(half, 16u32, line);
    let base = swizzle_reg(k, line);
    (0..s.k16_per_block())
        .map(|i| {
            let stepped = k.xor(base, i << 5);
            let at = k.add(stepped, tile_offset);
            k.add(smem, at)
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
            let s = Shape::of(&cfg);
            let id = cfg.id();
            assert_eq!(s.block_m(), cfg.block_m, "{id}");
            let rpp = s.rows_per_pass();
            for rows in [s.block_m(), s.block_n] {
                assert_eq!(rows % rpp, 0, "{id}: {rows} rows in passes of {rpp}");
                assert_eq!(
                    rows * s.row_bytes() % 1024,
                    0,
                    "{id}: column block of {rows} rows"
                );
            }
            assert_eq!(rpp * s.row_bytes() % 1024, 0, "{id}: pass of {rpp} rows");
            assert_eq!(16 * s.row_bytes() % 1024, 0, "{id}: 16-row MMA tile");
            assert!(
                s.smem_bytes() <= 99 * 1024,
                "{id}: fits the sm_86/sm_89 opt-in limit"
            );
        }
    }
}
