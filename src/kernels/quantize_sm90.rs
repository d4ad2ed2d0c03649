//! The Hadamard option's rows kernel for Hopper (`.target sm_90a`): Q or K rotated by
//! `H · diag(s) / sqrt(D)` (K minus its mean first, with K smoothing) and quantized to
//! e4m3 with one scale per 128 rows, the rotation done as a matrix product on the tensor
//! cores.
//!
//! The butterfly kernel of [`super::quantize`] spends about seven float operations per
//! value on the rotation and is bound by instruction issue (74% of copy bandwidth at
//! D128, 57% at D256). Here the rotation is `Y = X · Tᵀ`, one wgmma chain per 64 rows, so
//! the per-value work is what any quantizer does: an amax, two multiplies and a convert.
//!
//! ```text
//! all threads: build T (the signed Hadamard, permuted as below) in shared memory, once
//! producer (warpgroup 0)                  consumers (warpgroups 1, 2; rows 64c..64c+64)
//! for each 128-row block of each head:    for each block:
//!     acquire a stage; TMA X[128 x D]         wait FULL; [Q: lse_shift from X]
//!                                             Y = X Tᵀ [− K's rotated mean] (wgmma SS)
//!                                             release
//!                                             amax of Y: shuffles, then both warpgroups
//!                                             through shared memory and a named barrier
//!                                             codes = e4m3(Y · norm · 448 / amax)
//! ```
//!
//! # The matrix
//!
//! Row `a` of `T` is output column `a` of the accumulator; its channel is `n(a)`, chosen
//! so that each thread's accumulator columns are whole runs of 16 channels: thread `t`
//! of a quad holds columns `8i + 2t + u`, and `n = 64·(i / 8) + 16t + 2·(i % 8) + u`
//! makes columns `i = 8m .. 8m + 7` channels `64m + 16t .. 64m + 16t + 15`, which leave
//! as one 16-byte store. `T[a][c] = s_c · (−1)^popc(n(a) & c)`.
//!
//! At D = 256 the Sylvester matrix splits on the top index bit: `H₂₅₆[n][c] =
//! (−1)^(n₇ c₇) · H₁₂₈[n mod 128][c mod 128]`. So `T` has 128 rows (64 KiB rather than
//! 128 beside 64 KiB stages): `U` rotates channels 0..127 by its left half, `V`
//! channels 128..255 by its right half, and the outputs are `U + V` and `U − V`, the
//! butterfly [`crate::quant::rotate_row`] ends with. Half the tensor work of a dense
//! 256 × 256 product, for one add per value.
//!
//! # K smoothing
//!
//! The rotation is linear, so `(x − μ) · Tᵀ = x · Tᵀ − μ · Tᵀ`: keys are rotated as they
//! are and the rotated mean (`k_mean_rotated`, which the key-mean kernel of
//! [`super::quantize`] writes first) is taken off. It goes in as the accumulators'
//! starting value, `−rotate(μ) / norm` (at D = 256, `U` and `V` start at minus half the
//! sum and half the difference of its two halves), which costs no registers beside the
//! accumulators. Rows past the sequence arrive as zeros and leave as minus the mean:
//! they are kept out of the amax (and, as always, not stored).
//!
//! Q's `lse_shift = q · μ` comes from the unrotated rows, read from the staged tile
//! before the products are issued, in [`crate::quant::lse_shift`]'s order (two threads
//! per row, see `LseRows`), so it equals the CPU's bit for bit.
//!
//! # Numbers
//!
//! The products are exact (16-bit inputs times ±1) and summed in f32 on the tensor cores,
//! in another order than [`crate::quant::rotate_row`]'s butterflies: the rotated values
//! agree with the CPU reference to f32 rounding, so a code can differ from it by one step
//! where a value lies within that rounding of a boundary between two codes. The amax,
//! scale and codes then follow [`crate::quant`]'s arithmetic: `y = acc · norm`, scale
//! `amax / 448`, code `cvt.rn.satfinite(y · 448 / amax)`.

use std::mem::offset_of;

use super::attention::HalfType;
use super::attention::fp8::{HEAD_DIMS, SCALE_BLOCK};
use super::quantize::{
    QuantArgs, Smoothing, address, arg, bhn_address, block_scale, fold_amax, lse_shift_address,
    scaled, strides, widen,
};
use crate::ptx::{
    Acc, B32, Bf16x2, Cmp, F16x2, F32, InFlight, KMajor, Kernel, KernelText, Module, N64, N128,
    ParamBytes, Pred, PtxError, RawSlot, Reg, RingBarriers, S32, ScaleD, Smem, SmemAddr, SmemDesc,
    SmemLayout, SmemPlan, Special, Swizzle, Target, TileSlot, TmaDesc, U32, U64, WgmmaInput,
    WgmmaN,
};
use crate::quant::{ELEMS_PER_THREAD, hadamard_norm};

/// Threads per block: a producer warpgroup and two consumer warpgroups.
pub const THREADS: u32 = 384;
/// Output channels per accumulator (and rows of `T`): 128, or the head dim below it.
const MAX_N: u32 = 128;

/// One configuration of the rotated rows kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RotateConfig {
    /// The 16-bit input's element type.
    pub input: HalfType,
    pub head_dim: u32,
    /// K smoothing's part: Q's `lse_shift`, or K minus the rotated mean.
    pub smoothing: Smoothing,
}

/// Where everything lives in shared memory.
#[derive(Debug, Clone, Copy)]
struct Slots {
    /// `T`, one copy for the kernel's life.
    t: TileSlot,
    /// The ring of 128-row X tiles.
    x: TileSlot,
    ring: RingBarriers,
    /// With smoothing, each stage's head's mean (Q) or rotated mean (K): D floats.
    mean: Option<TileSlot>,
    /// Two sets (alternate blocks) of one f32 amax per consumer warp.
    amax: RawSlot,
}

impl RotateConfig {
    /// The kernel id, e.g. `quant_e4m3_rows_bf16_d128_smooth_k_hadamard_sm90a`.
    pub fn id(&self) -> String {
        format!(
            "quant_e4m3_rows_{}_d{}{}_hadamard_sm90a",
            self.input.name(),
            self.head_dim,
            match self.smoothing {
                Smoothing::None => "",
                Smoothing::Query => "_smooth_q",
                Smoothing::Key => "_smooth_k",
            }
        )
    }

    /// Output channels per accumulator: the N of each wgmma.
    pub fn n(&self) -> u32 {
        self.head_dim.min(MAX_N)
    }

    /// Accumulators per consumer thread: 2 at D = 256 (`U` and `V`, see the module docs).
    pub fn halves(&self) -> u32 {
        self.head_dim / self.n()
    }

    /// X stages in flight: as many as fit beside `T` (two at D = 256, four below).
    pub fn stages(&self) -> u32 {
        if self.head_dim == 256 { 2 } else { 4 }
    }

    pub fn x_layout(&self) -> SmemLayout {
        SmemLayout::new(SCALE_BLOCK, self.head_dim, 2, Swizzle::B128)
    }

    pub fn t_layout(&self) -> SmemLayout {
        SmemLayout::new(self.n(), self.head_dim, 2, Swizzle::B128)
    }

    fn plan(&self) -> (SmemPlan, Slots) {
        let mut plan = SmemPlan::new();
        let t = plan.tile(self.t_layout(), 1);
        let x = plan.tile(self.x_layout(), self.stages());
        let ring = RingBarriers::plan(&mut plan, self.stages());
        let mean = (self.smoothing != Smoothing::None).then(|| {
            let row = SmemLayout::new(1, self.head_dim, 4, Swizzle::None);
            plan.tile(row, self.stages())
        });
        let amax = plan.raw(2 * 8 * 4, 16);
        (
            plan,
            Slots {
                t,
                x,
                ring,
                mean,
                amax,
            },
        )
    }

    /// Dynamic shared memory per block, bytes.
    pub fn smem_bytes(&self) -> u32 {
        self.plan().0.bytes()
    }

    pub fn threads(&self) -> u32 {
        THREADS
    }

    /// Blocks resident per SM, which the host's persistent grid is sized by. At D = 64 a
    /// block's 128-row item is short, and its dependent steps (the products, the amax
    /// across both warpgroups, Q's `lse_shift`) leave the SM idle between loads unless a
    /// second block's items interleave with them; its accumulators need few registers.
    pub fn blocks_per_sm(&self) -> u32 {
        if self.head_dim == 64 && self.smoothing != Smoothing::None {
            2
        } else {
            1
        }
    }

    /// Registers per thread after reallocation, producer and consumers: their sum over the
    /// block's warpgroups fills its share of the SM's 65536 (`128·40 + 256·232 = 64512`
    /// with one block, `128·32 + 256·104 = 30720` with two: 80 a thread at launch).
    pub fn regs(&self) -> (u32, u32) {
        if self.blocks_per_sm() == 2 {
            (32, 104)
        } else {
            (40, 232)
        }
    }

    pub fn generate(&self) -> Result<Module, PtxError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(PtxError::BadOperand(format!(
                "no rotated quantization kernel for head dim {}",
                self.head_dim
            )));
        }
        let kernel = match (self.input, self.n()) {
            (HalfType::F16, 64) => build::<F16x2, N64>(self)?,
            (HalfType::F16, _) => build::<F16x2, N128>(self)?,
            (HalfType::Bf16, 64) => build::<Bf16x2, N64>(self)?,
            (HalfType::Bf16, _) => build::<Bf16x2, N128>(self)?,
        };
        let mut module = Module::new(Target::Sm90a);
        module.push(kernel)?;
        Ok(module)
    }
}

/// Every configuration: each smoothing part, f16 and bf16 input, every FP8 head dim.
pub fn all_rotate_configs() -> Vec<RotateConfig> {
    let mut v = Vec::new();
    for smoothing in [Smoothing::None, Smoothing::Query, Smoothing::Key] {
        for input in [HalfType::F16, HalfType::Bf16] {
            for head_dim in HEAD_DIMS {
                v.push(RotateConfig {
                    input,
                    head_dim,
                    smoothing,
                });
            }
        }
    }
    v
}

/// The channel of accumulator column `a` (see the module docs).
pub fn column_channel(a: u32) -> u32 {
    let (i, t, u) = (a >> 3, (a >> 1) & 3, a & 1);
    ((i >> 3) << 6) | (t << 4) | ((i & 7) << 1) | u
}

/// One 128-row block of one head of one batch.
#[derive(Debug, Clone, Copy)]
struct Item {
    block: Reg<U32>,
    head: Reg<U32>,
    batch: Reg<U32>,
}

/// The kernel's shared state.
struct Rotate {
    cfg: RotateConfig,
    args: ParamBytes,
    map: TmaDesc,
    smem: Smem,
    slots: Slots,
}

impl Rotate {
    /// `for item in (blockIdx.x..B·H·blocks).step_by(gridDim.x)`, blocks fastest.
    fn for_each_item(&self, k: &mut Kernel, body: impl FnOnce(&mut Kernel, Item)) {
        let heads = arg::<U32>(k, self.args, offset_of!(QuantArgs, heads));
        let blocks = arg::<U32>(k, self.args, offset_of!(QuantArgs, scale_blocks));
        let batch = arg::<U32>(k, self.args, offset_of!(QuantArgs, batch));
        let per_batch = k.mul(heads, blocks);
        let items = k.mul(per_batch, batch);
        k.for_grid_stride(items.cast::<S32>(), |k, item| {
            let item = item.cast::<U32>();
            let block = k.rem(item, blocks);
            let rest = k.div(item, blocks);
            let head = k.rem(rest, heads);
            let batch = k.div(rest, heads);
            body(k, Item { block, head, batch });
        });
    }
}

fn build<H: WgmmaInput, N: WgmmaN>(cfg: &RotateConfig) -> Result<KernelText, PtxError> {
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(THREADS)
        .min_blocks_per_sm(cfg.blocks_per_sm());
    let args = k.param_bytes("args", QuantArgs::SIZE, 8);
    let map = k.tensor_map_param("tmap_x");
    let (plan, slots) = cfg.plan();
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);
    let r = Rotate {
        cfg: *cfg,
        args,
        map,
        smem,
        slots,
    };

    k.comment("Every thread writes its part of T; one thread initialises the ring.");
    write_rotation(&mut k, &r, tid);
    // T is read by wgmma, through the async proxy.
    k.fence_proxy_async();
    let first_thread = k.setp(Cmp::Eq, tid, 0u32);
    // FULL: the producer's arrival plus the bytes; EMPTY: one arrival per consumer warp.
    k.if_(first_thread, |k| slots.ring.init(k, &smem, 1, 8));
    k.sync_threads();

    let warpgroup = k.shr(tid, 7);
    let producer = k.setp(Cmp::Eq, warpgroup, 0u32);
    k.if_else(
        producer,
        |k| produce(k, &r, tid),
        |k| consume::<H, N>(k, &r, tid),
    );
    k.finish()
}

/// `T[a][c] = s_c · (−1)^popc(n(a) & c & (N − 1))` as 16-bit ±1, eight channels (one
/// 16-byte chunk of the swizzled tile) per turn of each thread.
fn write_rotation(k: &mut Kernel, r: &Rotate, tid: Reg<U32>) {
    let cfg = r.cfg;
    let d = cfg.head_dim;
    let layout = cfg.t_layout();
    let chunks_per_row = d / 8;
    let chunks = cfg.n() * chunks_per_row;
    let one: u32 = match cfg.input {
        HalfType::F16 => 0x3C00,
        HalfType::Bf16 => 0x3F80,
    };
    let signs_at = offset_of!(QuantArgs, hadamard_signs);
    let words: Vec<Reg<U32>> = (0..d / 32)
        .map(|w| arg::<U32>(k, r.args, signs_at + 4 * w as usize))
        .collect();
    let t_at = r.smem.tile(k, r.slots.t, 0);
    let stride = k.mov::<S32>(THREADS as i32);
    k.for_stride(tid.cast::<S32>(), chunks as i32, stride, |k, chunk| {
        let chunk = chunk.cast::<U32>();
        let a = k.div(chunk, chunks_per_row);
        let q = k.rem(chunk, chunks_per_row);
        let c0 = k.shl(q, 3);
        // n(a), the channel of output column a.
        let i = k.shr(a, 3);
        let hi = k.shr(i, 3);
        let hi = k.shl(hi, 6);
        let t = k.shr(a, 1);
        let t = k.and(t, 3u32);
        let t = k.shl(t, 4);
        let lo = k.and(i, 7u32);
        let lo = k.shl(lo, 1);
        let u = k.and(a, 1u32);
        let n = k.or(hi, t);
        let n = k.or(n, lo);
        let n = k.or(n, u);
        // The parity of n & c0 (channel bits 3 and up), folded to bit 0.
        let x = k.and(n, c0);
        let x = k.and(x, cfg.n() - 1);
        let mut x = x;
        for sh in [4, 2, 1] {
            let y = k.shr(x, sh);
            x = k.xor(x, y);
        }
        let base = k.and(x, 1u32);
        let base = k.mul(base, 0xFFu32);
        // Bit e of the Walsh mask: the parity of n & e (bits 0..2), from a table of the
        // eight masks.
        let v = k.and(n, 7u32);
        let upper = k.setp(Cmp::Ge, v, 4u32);
        let table = k.selp(0x963C_5AF0u32, 0x66CC_AA00u32, upper);
        let v = k.and(v, 3u32);
        let v = k.shl(v, 3);
        let walsh = k.shr_by(table, v);
        // The signs of channels c0 .. c0 + 7: byte (c0 % 32) / 8 of word c0 / 32.
        let word_index = k.shr(c0, 5);
        let mut word = words[0];
        for (j, &w) in words.iter().enumerate().skip(1) {
            let this = k.setp(Cmp::Eq, word_index, j as u32);
            word = k.selp(w, word, this);
        }
        let byte = k.and(c0, 31u32);
        let signs = k.shr_by(word, byte);
        let bits = k.xor(signs, walsh);
        let bits = k.xor(bits, base);
        let halves: [Reg<B32>; 4] = std::array::from_fn(|j| {
            let lo = k.shr(bits, 2 * j as u32);
            let lo = k.and(lo, 1u32);
            let lo = k.shl(lo, 15);
            let hi = k.shr(bits, 2 * j as u32 + 1);
            let hi = k.and(hi, 1u32);
            let hi = k.shl(hi, 31);
            let w = k.or(lo, hi);
            k.or(w, one | (one << 16)).cast::<B32>()
        });
        // The chunk's logical offset, then the swizzle.
        let block = k.shr(q, 3);
        let block = k.mul(block, layout.block_stride());
        let row = k.mul(a, layout.block_bytes);
        let inner = k.and(q, 7u32);
        let inner = k.shl(inner, 4);
        let off = k.add(block, row);
        let off = k.add(off, inner);
        let off = layout.swizzle.apply_in(k, off);
        let at = k.smem_offset(t_at, off);
        k.st_shared_v4(at, 0, halves);
    });
}

/// Warpgroup 0: one elected thread streams each block's 128 rows into the ring.
fn produce(k: &mut Kernel, r: &Rotate, tid: Reg<U32>) {
    k.comment("Producer: TMA loads of X tiles into the stage ring.");
    k.setmaxnreg_dec(r.cfg.regs().0);
    k.elected_thread_of_warp_0(tid, |k| {
        k.tma_prefetch_desc(r.map);
        let zero = k.mov::<S32>(0i32);
        let mut ring = r.slots.ring.producer(k, r.smem);
        let d = r.cfg.head_dim;
        let mean_bytes = if r.slots.mean.is_some() { 4 * d } else { 0 };
        let bytes = r.cfg.x_layout().bytes() + mean_bytes;
        r.for_each_item(k, |k, it| {
            ring.fill(k, bytes, |k, ring, full| {
                let at = ring.slot(k, r.slots.x);
                let row = k.mul(it.block, SCALE_BLOCK).cast::<S32>();
                let (head, batch) = (it.head.cast::<S32>(), it.batch.cast::<S32>());
                // Rows past the sequence arrive as zeros (the consumers keep them out of the
                // amax where K's mean makes them nonzero).
                k.tma_load(at, r.map, [zero, row, zero, head, batch], full);
                if let Some(slot) = r.slots.mean {
                    k.comment("... and the head's mean beside them.");
                    // mean[b, head / group]: Q's group of heads shares its KV head's mean;
                    // K's (group 1) is its own, rotated.
                    let mean = arg::<U64>(k, r.args, offset_of!(QuantArgs, mean));
                    let heads = arg::<U32>(k, r.args, offset_of!(QuantArgs, mean_heads));
                    let group = arg::<U32>(k, r.args, offset_of!(QuantArgs, group));
                    let kv_head = k.div(it.head, group);
                    let bh = k.mad(it.batch, heads, kv_head);
                    let from = k.mul_wide_u32(bh, 4 * d);
                    let from = k.add(mean, from);
                    let to = ring.slot(k, slot);
                    k.bulk_load(to, from, mean_bytes, full);
                }
            });
        });
    });
}

/// `d` moved `bytes` along K (no instruction for 0).
fn along_k(k: &mut Kernel, d: SmemDesc<KMajor>, bytes: u32) -> SmemDesc<KMajor> {
    if bytes == 0 {
        d
    } else {
        k.desc_advance(d, bytes)
    }
}

/// `start + X · Tᵀ` over channels `16·steps` for the consumer's 64 rows (a fresh
/// accumulator without `start`).
fn rotate_rows<H: WgmmaInput, N: WgmmaN>(
    k: &mut Kernel,
    cfg: &RotateConfig,
    x: SmemDesc<KMajor>,
    t: SmemDesc<KMajor>,
    steps: std::ops::Range<u32>,
    start: Option<Acc<N>>,
) -> InFlight<N> {
    let (xl, tl) = (cfg.x_layout(), cfg.t_layout());
    let at = |k: &mut Kernel, step: u32| {
        let xs = along_k(k, x, xl.logical_offset(0, 16 * step));
        let ts = along_k(k, t, tl.logical_offset(0, 16 * step));
        (xs, ts)
    };
    let (xs, ts) = at(k, steps.start);
    let (acc, scale) = match start {
        Some(acc) => (acc, ScaleD::Accumulate),
        None => (k.acc::<N>(), ScaleD::Zero),
    };
    let mut f = k.wgmma_ss::<H, N, KMajor, KMajor>(acc, xs, ts, scale);
    for step in steps.start + 1..steps.end {
        let (xs, ts) = at(k, step);
        f = k.wgmma_ss::<H, N, KMajor, KMajor>(f, xs, ts, ScaleD::Accumulate);
    }
    f
}

/// Warpgroups 1 and 2: each rotates, scales and stores its 64 rows of every block.
fn consume<H: WgmmaInput, N: WgmmaN>(k: &mut Kernel, r: &Rotate, tid: Reg<U32>) {
    k.comment("Consumers: Y = X T^T, the block's amax, the codes.");
    k.setmaxnreg_inc(r.cfg.regs().1);
    let cfg = r.cfg;
    let args = r.args;
    let ct = k.sub(tid, 128u32);
    let consumer = k.shr(ct, 7);
    let in_wg = k.and(ct, 127u32);
    let warp = k.shr(in_wg, 5);
    let lane = k.and(ct, 31u32);
    let leader = k.setp(Cmp::Eq, lane, 0u32);
    let first_thread = k.setp(Cmp::Eq, ct, 0u32);
    // Thread (warp w, quad g, t) holds rows 16w + g (+ 8) of its warpgroup's 64.
    let quad = k.shr(lane, 2);
    let pair = k.and(lane, 3u32);
    let tile_row = k.mad(consumer, 64u32, quad);
    let tile_row = k.mad(warp, 16u32, tile_row);

    let seqlen = arg::<U32>(k, args, offset_of!(QuantArgs, seqlen));
    let heads = arg::<U32>(k, args, offset_of!(QuantArgs, heads));
    let blocks = arg::<U32>(k, args, offset_of!(QuantArgs, scale_blocks));
    let scales = arg::<U64>(k, args, offset_of!(QuantArgs, scales));
    let dst = arg::<U64>(k, args, offset_of!(QuantArgs, dst));
    let ds = strides(k, args, offset_of!(QuantArgs, dst_stride));
    let norm = hadamard_norm(cfg.head_dim as usize);
    let lse = (cfg.smoothing == Smoothing::Query).then(|| LseRows::new(k, r, consumer, warp, lane));

    let mut ring = r.slots.ring.consumer(k, r.smem);
    let x_rows = k.mul(consumer, cfg.x_layout().logical_offset(64, 0));
    let t_at = r.smem.tile(k, r.slots.t, 0);
    let t = k.smem_desc::<KMajor>(t_at, &cfg.t_layout());
    let amax_at = r.smem.raw(k, r.slots.amax);
    let my_amax = k.mad(consumer, 4u32, warp);
    let my_amax = k.shl(my_amax, 2);
    let parity = k.mov(0u32);
    let both = k.named_barrier(256);
    // The k-steps of each product: all D channels, or (D = 256) U's and V's halves.
    let per_half = cfg.head_dim / 16 / cfg.halves();

    r.for_each_item(k, |k, it| {
        ring.wait_full(k);
        let x_at = ring.slot(k, r.slots.x);
        let x_at = k.smem_offset(x_at, x_rows);
        let x = k.smem_desc::<KMajor>(x_at, &cfg.x_layout());
        let mean_at = r.slots.mean.map(|slot| ring.slot(k, slot));
        // Q's shift: before the products at D = 256 (beside their accumulators its loads
        // would not fit), else while they run.
        let lse_first = cfg.head_dim > MAX_N;
        if let (Some(lse), Some(mean), true) = (&lse, mean_at, lse_first) {
            lse.write(k, r, x_at, mean, it, seqlen);
            // Keeps ptxas from moving that work in among the products.
            k.sync_warp();
        }
        let mut starts = match (cfg.smoothing, mean_at) {
            (Smoothing::Key, Some(mean)) => minus_rotated_mean::<N>(k, &cfg, mean, norm, pair),
            _ => Vec::new(),
        }
        .into_iter();
        let flying: Vec<InFlight<N>> = (0..cfg.halves())
            .map(|half| {
                let steps = half * per_half..(half + 1) * per_half;
                rotate_rows::<H, N>(k, &cfg, x, t, steps, starts.next())
            })
            .collect();
        k.wgmma_commit();
        if let (Some(lse), Some(mean), false) = (&lse, mean_at, lse_first) {
            lse.write(k, r, x_at, mean, it, seqlen);
        }
        k.wgmma_wait(0);
        k.guarded(leader, true, |k| ring.release(k));
        ring.advance(k);
        let ys: Vec<Acc<N>> = flying.into_iter().map(|f| k.wgmma_retire(f)).collect();
        if let [u, v] = &ys[..] {
            // The last butterfly stage: (U + V, U − V), in place.
            for (&a, &b) in u.regs().iter().zip(v.regs()) {
                let sum = k.add(a, b);
                k.sub_to(b, a, b);
                k.mov_to(a, sum);
            }
        }

        k.comment("The block's amax: the thread's, the warp's, both warpgroups'.");
        let local = if cfg.smoothing == Smoothing::Key {
            // Rows past the sequence arrived as zeros but hold minus the mean now: a
            // maximum per row of the thread (fragment elements 0, 1 and 2, 3 of every
            // tile), those past the sequence dropped.
            let row_max = [k.mov(0.0f32), k.mov(0.0f32)];
            for y in &ys {
                for tile in y.tiles() {
                    for (e, &v) in tile.iter().enumerate() {
                        fold_amax(k, row_max[e / 2], v);
                    }
                }
            }
            let row0 = k.mad(it.block, SCALE_BLOCK, tile_row);
            for (row_half, m) in row_max.iter().enumerate() {
                let row = k.add(row0, 8 * row_half as u32);
                let inside = k.setp(Cmp::Lt, row, seqlen);
                k.selp_to(*m, *m, 0.0f32, inside);
            }
            k.max(row_max[0], row_max[1])
        } else {
            let local = k.mov(0.0f32);
            for y in &ys {
                for &v in y.regs() {
                    fold_amax(k, local, v);
                }
            }
            local
        };
        for mask in [16, 8, 4, 2, 1] {
            let other = k.shfl_bfly(local, mask);
            k.max_to(local, local, other);
        }
        // Alternate blocks use alternate sets: a warp that runs ahead into the next
        // block cannot overwrite a set the other warpgroup is still reading.
        let set = k.shl(parity, 5);
        let set_at = k.smem_offset(amax_at, set);
        let mine = k.smem_offset(set_at, my_amax);
        k.guarded(leader, true, |k| k.st_shared(mine, 0, local));
        k.bar_wait(both);
        let raw = k.mov(0.0f32);
        for quarter in 0..2 {
            for w in k.ld_shared_v4::<F32>(set_at, 16 * quarter) {
                k.max_to(raw, raw, w);
            }
        }
        k.xor_to(parity, parity, 1u32);
        // max |acc · norm| = max |acc| · norm: rounding is monotonic.
        let amax = k.mul(raw, norm);
        let (scale, inv) = block_scale(k, amax);
        // The rotation's norm folded into the multiplier: one rounding fewer per value.
        let norm_inv = k.mul(norm, inv);

        let scale_at = bhn_address(k, scales, [heads, blocks], [it.batch, it.head, it.block]);
        k.guarded(first_thread, true, |k| k.st_global(scale_at, 0, scale));

        k.comment("Codes: 16 channels of a row per 16-byte store.");
        let row0 = k.mad(it.block, SCALE_BLOCK, tile_row);
        let lanes = k.mul_wide_u32(pair, 16u32);
        let at = address(k, dst, &ds, [it.batch, row0, it.head], 1, lanes);
        let eight_rows = k.mul(ds[1], 8u64);
        for row_half in 0..2usize {
            let row = k.add(row0, 8 * row_half as u32);
            let inside = k.setp(Cmp::Lt, row, seqlen);
            let at = if row_half == 0 {
                at
            } else {
                k.add(at, eight_rows)
            };
            for (half, y) in ys.iter().enumerate() {
                let tiles = y.tiles();
                for run in 0..cfg.n() / 64 {
                    let pairs: Vec<_> = (0..8)
                        .map(|i| {
                            let tile = tiles[(8 * run + i) as usize];
                            let [lo, hi] = [tile[2 * row_half], tile[2 * row_half + 1]]
                                .map(|v| scaled(k, v, norm_inv));
                            k.pack_e4m3x2(lo, hi)
                        })
                        .collect();
                    let words: [Reg<B32>; 4] =
                        std::array::from_fn(|w| k.join_b16x2(pairs[2 * w], pairs[2 * w + 1]));
                    let offset = (MAX_N * half as u32 + 64 * run) as i32;
                    k.guarded(inside, true, |k| k.st_global_v4(at, offset, words));
                }
            }
        }
    });
}

/// K smoothing: the accumulators' start, `−rotate(mean) / norm` in every row, so that
/// `y = acc · norm` comes out minus the rotated mean (`mean`: the stage's copy). Thread
/// `t` of a quad holds channels `64m + 16t .. +15` of run `m` (see the module docs): 16
/// consecutive floats of the rotated mean per run, four 16-byte loads. At D = 256 the outputs are `U ± V`, so `U`
/// starts at minus half the sum of the two halves' means and `V` at minus half their
/// difference.
fn minus_rotated_mean<N: WgmmaN>(
    k: &mut Kernel,
    cfg: &RotateConfig,
    mean: SmemAddr,
    norm: f32,
    pair: Reg<U32>,
) -> Vec<Acc<N>> {
    let channel = k.mul(pair, 16 * 4u32);
    let at = k.smem_offset(mean, channel);
    let accs: Vec<Acc<N>> = (0..cfg.halves()).map(|_| k.acc::<N>()).collect();
    let tiles: Vec<_> = accs.iter().map(|a| a.tiles()).collect();
    let scale = -1.0 / norm / cfg.halves() as f32;
    for run in 0..cfg.n() / 64 {
        let load = |k: &mut Kernel, half: u32| -> Vec<Reg<F32>> {
            let first = 4 * (MAX_N * half + 64 * run) as i32;
            (0..4)
                .flat_map(|v| k.ld_shared_v4::<F32>(at, first + 16 * v))
                .collect()
        };
        let starts: Vec<Vec<Reg<F32>>> = if cfg.halves() == 2 {
            let (lo, hi) = (load(k, 0), load(k, 1));
            let sum = lo.iter().zip(&hi).map(|(&a, &b)| k.add(a, b)).collect();
            let diff = lo.iter().zip(&hi).map(|(&a, &b)| k.sub(a, b)).collect();
            vec![sum, diff]
        } else {
            vec![load(k, 0)]
        };
        for (tiles, start) in tiles.iter().zip(&starts) {
            for i in 0..8 {
                let tile = tiles[(8 * run + i) as usize];
                for (e, &v) in tile.iter().enumerate() {
                    k.mul_to(v, start[2 * i as usize + e % 2], scale);
                }
            }
        }
    }
    accs
}

/// Q smoothing's `lse_shift = q · mean` for a warpgroup's 64 rows, read from the staged
/// tile in [`crate::quant::lse_shift`]'s order. Lanes `l` and `l + 16` of warp `w` share
/// row `16w + l % 16`, one half of its channels each: runs of 8 channels by fused
/// multiply-adds from zero, the runs summed pairwise as a tree, and the halves added by
/// one shuffle (the tree's top level; additions commute, so both lanes get the
/// reference's bits).
struct LseRows {
    /// The thread's row of the warpgroup's 64.
    row: Reg<U32>,
    /// The row's first 16-byte chunk of the thread's half, logical (unswizzled) bytes.
    chunk0: Reg<U32>,
    /// The 128-byte swizzle's XOR pattern for the row.
    swizzle: Reg<U32>,
    /// The first channel of the thread's half.
    channel0: Reg<U32>,
    /// The lane that writes the sum (the lower half).
    writer: Reg<Pred>,
    /// Rows `64·consumer` of the block.
    first_row: Reg<U32>,
}

impl LseRows {
    fn new(
        k: &mut Kernel,
        r: &Rotate,
        consumer: Reg<U32>,
        warp: Reg<U32>,
        lane: Reg<U32>,
    ) -> LseRows {
        let layout = r.cfg.x_layout();
        let half_width = r.cfg.head_dim / 2;
        let in_warp = k.and(lane, 15u32);
        let row = k.mad(warp, 16u32, in_warp);
        let half = k.shr(lane, 4);
        // logical_offset(row, half · D/2): row · 128 bytes inside a column block, plus
        // the half's start (whole column blocks, or 64 bytes at D = 64).
        let start = layout.logical_offset(0, half_width);
        let chunk0 = k.mul(row, layout.block_bytes);
        let chunk0 = k.mad(half, start, chunk0);
        let swizzle = k.and(row, 7u32);
        let swizzle = k.shl(swizzle, 4);
        let channel0 = k.mul(half, half_width);
        let writer = k.setp(Cmp::Eq, half, 0u32);
        let first_row = k.mul(consumer, 64u32);
        LseRows {
            row,
            chunk0,
            swizzle,
            channel0,
            writer,
            first_row,
        }
    }

    /// `x_at`: the warpgroup's rows of the stage; `mean`: the stage's copy of the mean.
    fn write(
        &self,
        k: &mut Kernel,
        r: &Rotate,
        x_at: SmemAddr,
        mean: SmemAddr,
        it: Item,
        seqlen: Reg<U32>,
    ) {
        let cfg = r.cfg;
        let layout = cfg.x_layout();
        let runs = cfg.head_dim / 2 / ELEMS_PER_THREAD as u32;
        let channel = k.shl(self.channel0, 2);
        let mean_at = k.smem_offset(mean, channel);
        let mut partial: Vec<Reg<F32>> = (0..runs)
            .map(|j| {
                // Chunk j of the half; the swizzle XORs the row's pattern into bits 4..6.
                let logical = k.add(self.chunk0, layout.logical_offset(0, 8 * j));
                let physical = k.xor(logical, self.swizzle);
                let at = k.smem_offset(x_at, physical);
                let words = k.ld_shared_v4::<B32>(at, 0);
                let q = widen(k, cfg.input, words);
                let lo = k.ld_shared_v4::<F32>(mean_at, 32 * j as i32);
                let hi = k.ld_shared_v4::<F32>(mean_at, 32 * j as i32 + 16);
                let mut dot = k.mov(0.0f32);
                for e in 0..8 {
                    let m = if e < 4 { lo[e] } else { hi[e - 4] };
                    dot = k.mad(q[e], m, dot);
                }
                dot
            })
            .collect();
        while partial.len() > 1 {
            partial = partial.chunks(2).map(|p| k.add(p[0], p[1])).collect();
        }
        let mine = partial[0];
        let other = k.shfl_bfly(mine, 16);
        let sum = k.add(mine, other);

        let row = k.mad(it.block, SCALE_BLOCK, self.first_row);
        let row = k.add(row, self.row);
        let inside = k.setp(Cmp::Lt, row, seqlen);
        let write = k.and_pred(inside, self.writer);
        let at = lse_shift_address(k, r.args, [it.batch, it.head, row], seqlen);
        k.guarded(write, true, |k| k.st_global(at, 0, sum));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_map_to_channels_one_to_one_in_runs_of_sixteen() {
        for n in [64u32, 128] {
            let mut seen = vec![false; n as usize];
            for a in 0..n {
                let c = column_channel(a);
                assert!(c < n, "n = {n}: column {a} -> {c}");
                assert!(!seen[c as usize], "channel {c} twice");
                seen[c as usize] = true;
            }
            // Thread t's columns 8i + 2t + u, i = 8m .. 8m + 7: channels 64m + 16t + e.
            for t in 0..4 {
                for m in 0..n / 64 {
                    for e in 0..16 {
                        let a = 8 * (8 * m + e / 2) + 2 * t + e % 2;
                        assert_eq!(column_channel(a), 64 * m + 16 * t + e);
                    }
                }
            }
        }
    }

    #[test]
    fn plans_fit_and_generate() {
        for cfg in all_rotate_configs() {
            let (plan, s) = cfg.plan();
            assert!(plan.bytes() <= 232_448, "{}: {}", cfg.id(), plan.bytes());
            assert!(cfg.x_layout().is_valid() && cfg.t_layout().is_valid());
            assert_eq!(s.t.offset % 1024, 0);
            assert_eq!(s.x.stride % 1024, 0);
            let ptx = cfg.generate().expect("generates").to_ptx();
            assert!(ptx.contains(".target sm_90a"));
            // Every channel once per product: D/16 k-steps per 64 rows.
            let steps = ptx.matches("wgmma.mma_async").count() as u32;
            assert_eq!(steps, cfg.head_dim / 16, "{}", cfg.id());
        }
    }
}
