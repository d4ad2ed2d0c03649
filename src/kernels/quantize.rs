//! FP8 (E4M3) quantization kernels (`.target sm_89`: Ada and Hopper alike): 16-bit Q, K
//! and V in, the operands of [`crate::kernels::attention::fp8`] out, bit for bit what
//! [`crate::quant`] computes from the same values. On Hopper the Hadamard option takes
//! [`super::quantize_sm90`]'s rows kernel instead, which rotates on the tensor cores.
//!
//! # Kernels
//!
//! - **Rows** (Q or K): f16/bf16 `[B, S, H, D]` (any strides: head dim contiguous, the
//!   others multiples of 16 bytes) to e4m3 codes `[B, S, H, D]` (byte strides in
//!   [`QuantArgs::dst_stride`]) and f32 scales `[B, H, ceil(S/128)]`. Options:
//!   [`Smoothing::Key`] subtracts `mean[b, h]` (f32 `[B, H, D]`) from every row first;
//!   [`Smoothing::Query`] also writes `lse_shift[b, h, s] = q · mean[b, h / group]` (f32
//!   `[B, H, S]`, from the unrotated row); `hadamard` rotates every row by
//!   `H · diag(s) / sqrt(D)` after the mean ([`crate::quant::rotate_row`]'s order).
//! - **Vᵀ**: V `[B, S, H, D]` to `Vᵀ8` `[B, H, D, pitch]` (byte strides batch, head,
//!   row = pitch), keys permuted per [`VT_KEY_ORDER`] in groups of 16, zeros at every
//!   position in `[S, pitch)`, and V's scales.
//! - **Key mean**: adds `Σ rows · (1/S)` of a slab of [`MEAN_ROW_BLOCKS`] · 128 rows of K to
//!   the f32 `[B, H, D]` mean with `red.global.add` (the buffer must be zeroed first).
//!   With the Hadamard option as well (`rotate`), the last of a (head, batch)'s blocks to
//!   finish (a ticket per pair, in a zeroed `[B, H]` u32 buffer) also writes the finished
//!   mean rotated like a row, `[B, H, D]`: what [`super::quantize_sm90`]'s rows kernel
//!   subtracts from keys it rotated unsmoothed.
//!
//! # Work split
//!
//! One block per (128-row scale block, head, batch): grid `(ceil(S/128), H, B)` (Vᵀ:
//! `ceil(pitch/128)` blocks in x, so the padding past the last key is written too; key
//! mean: `ceil(S/(128·MEAN_ROW_BLOCKS))`). `T = max(256, 2·D)` threads; a row's `D/8`
//! 16-byte vectors go to `C = D/8` consecutive lanes (lane `c` holds channels
//! `8c .. 8c+7`), so one load instruction of a warp reads whole rows (`C · 16` contiguous
//! bytes each). The block's 128 rows are `128·C/T` *slots* of `T/C` rows; a thread loads
//! its vector of every slot before using any (4 to 8 loads, 64 to 128 bytes in flight per
//! thread), keeps them in registers through the block's amax (warp shuffles, then one
//! word per warp in shared memory) and then writes the codes: the input is read once.
//!
//! Row codes leave as 16-byte stores: lanes `2j` and `2j+1` swap the 8 code bytes of two
//! slots (`shfl.xor 1`), so each holds 16 consecutive bytes of one row. Vᵀ codes go
//! through shared memory (`[key][D]` bytes, 4-byte columns XOR-swizzled by the key's
//! 16-group so the transposed reads are conflict-free), then a thread gathers one 4-channel
//! column of one 16-key group (16 words), transposes them 4×4 bytes at a time with `prmt`
//! into [`VT_KEY_ORDER`], and writes four 16-byte vectors, eight lanes per 128-byte run of
//! a `Vᵀ8` row.
//!
//! The Hadamard transform runs in registers: butterflies over a thread's 8 channels
//! (index bits 0..2), then `shfl.xor` over the `C` lanes of the row (bits 3 and up), in
//! the CPU reference's order, so the f32 results agree exactly.

use std::mem::offset_of;

use super::attention::HalfType;
use super::attention::fp8::{E4M3_MAX, HEAD_DIMS, SCALE_BLOCK, VT_GROUP, VT_KEY_ORDER};
use crate::ptx::kernel::SameClass;
use crate::ptx::{
    B32, Bf16x2, Cmp, F16x2, F32, Half2, Kernel, KernelText, Module, ParamBytes, PtxError, PtxType,
    RawSlot, Reg, SmemAddr, SmemPlan, Special, Target, U32, U64,
};
use crate::quant::{ELEMS_PER_THREAD, hadamard_norm};

/// Scale blocks of K one key-mean block sums (fewer atomics, enough blocks).
pub const MEAN_ROW_BLOCKS: u32 = 4;

/// K smoothing's part in a rows kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Smoothing {
    None,
    /// Q: write `lse_shift = q · mean` per row.
    Query,
    /// K: subtract the mean from every row.
    Key,
}

/// Which quantization kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuantKind {
    /// Q or K: codes `[B, S, H, D]`.
    Rows {
        smoothing: Smoothing,
        hadamard: bool,
    },
    /// V: codes `[B, H, D, pitch]`, keys permuted.
    Vt,
    /// K's per-channel mean over the sequence (accumulated), and with `rotate` the
    /// finished mean rotated like the rows, `H · diag(s) · mean / sqrt(D)`, into `dst`:
    /// what the tensor-core rows kernel subtracts from rotated keys.
    KeyMean { rotate: bool },
}

/// One quantization kernel configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QuantConfig {
    pub kind: QuantKind,
    /// The 16-bit input's element type.
    pub input: HalfType,
    pub head_dim: u32,
}

/// The by-value argument block of every quantization kernel (unused fields 0).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct QuantArgs {
    /// 16-bit input `[B, S, H, D]`.
    pub src: u64,
    /// Its (batch, seq, head) strides in elements.
    pub src_stride: [u64; 3],
    /// e4m3 codes (rows, Vᵀ); unused by the key mean.
    pub dst: u64,
    /// Byte strides of the codes: (batch, seq, head) for rows, (batch, head, row = pitch)
    /// for Vᵀ.
    pub dst_stride: [u64; 3],
    /// f32 `[B, H, scale_blocks]`.
    pub scales: u64,
    /// f32 `[B, mean_heads, D]`: read by smoothing rows kernels, accumulated by the key
    /// mean.
    pub mean: u64,
    /// f32 `[B, H, S]` (Q smoothing).
    pub lse_shift: u64,
    pub seqlen: u32,
    /// Heads of this tensor.
    pub heads: u32,
    /// Heads of this tensor per head of the mean (Hq / Hkv for Q, 1 for K).
    pub group: u32,
    /// Heads of the mean (Hkv).
    pub mean_heads: u32,
    /// `ceil(S / 128)`.
    pub scale_blocks: u32,
    /// `1 / S` (key mean).
    pub inv_seqlen: f32,
    /// The Hadamard signs, [`crate::quant::HadamardSigns::words`].
    pub hadamard_signs: [u32; 8],
    /// Batches (the persistent rotated kernel's item count; the others use the grid).
    pub batch: u32,
    /// Unused: keeps the block free of padding.
    pub _pad: u32,
    /// u32 `[B, H]`, zeroed: the key mean's tickets, one per (head, batch), with
    /// `rotate` (see [`QuantKind::KeyMean`]).
    pub tickets: u64,
}

impl QuantArgs {
    pub const SIZE: usize = std::mem::size_of::<QuantArgs>();
}

/// How a block's 128 rows are spread over its threads (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    head_dim: u32,
    threads: u32,
    /// `C`: lanes (16-byte vectors) per row.
    lanes_per_row: u32,
    /// Rows one load instruction of the whole block covers.
    rows_per_slot: u32,
    /// Rows per thread.
    slots: u32,
}

impl Geometry {
    fn of(head_dim: u32) -> Geometry {
        let threads = (2 * head_dim).max(256);
        let lanes_per_row = head_dim / ELEMS_PER_THREAD as u32;
        let rows_per_slot = threads / lanes_per_row;
        Geometry {
            head_dim,
            threads,
            lanes_per_row,
            rows_per_slot,
            slots: SCALE_BLOCK / rows_per_slot,
        }
    }

    fn warps(&self) -> u32 {
        self.threads / 32
    }
}

/// The shared-memory pieces of a kernel.
#[derive(Debug, Clone, Copy)]
struct SmemSlots {
    /// One f32 per warp: the warps' amaxes.
    amax: RawSlot,
    /// Vᵀ: the block's codes, `[128 keys][D]` bytes, swizzled.
    codes: Option<RawSlot>,
    /// Key mean: `[warps][D]` f32 partial sums.
    sums: Option<RawSlot>,
    /// Key mean with `rotate`: whether this block is its (head, batch)'s last (a u32).
    last: Option<RawSlot>,
}

impl QuantConfig {
    /// The kernel id, e.g. `quant_e4m3_rows_bf16_d128_smooth_k_hadamard`.
    pub fn id(&self) -> String {
        let (dt, d) = (self.input.name(), self.head_dim);
        match self.kind {
            QuantKind::Rows {
                smoothing,
                hadamard,
            } => format!(
                "quant_e4m3_rows_{dt}_d{d}{}{}",
                match smoothing {
                    Smoothing::None => "",
                    Smoothing::Query => "_smooth_q",
                    Smoothing::Key => "_smooth_k",
                },
                if hadamard { "_hadamard" } else { "" }
            ),
            QuantKind::Vt => format!("quant_e4m3_vt_{dt}_d{d}"),
            QuantKind::KeyMean { rotate } => format!(
                "quant_key_mean{}_{dt}_d{d}",
                if rotate { "_rotated" } else { "" }
            ),
        }
    }

    /// Threads per block.
    pub fn threads(&self) -> u32 {
        Geometry::of(self.head_dim).threads
    }

    /// Rows of the sequence one block covers (the grid's x extent is the sequence, or
    /// Vᵀ's pitch, divided by this, rounded up).
    pub fn rows_per_block(&self) -> u32 {
        match self.kind {
            QuantKind::KeyMean { .. } => SCALE_BLOCK * MEAN_ROW_BLOCKS,
            _ => SCALE_BLOCK,
        }
    }

    fn plan(&self) -> (SmemPlan, SmemSlots) {
        let g = Geometry::of(self.head_dim);
        let mut plan = SmemPlan::new();
        let amax = plan.raw(4 * g.warps(), 16);
        let codes = (self.kind == QuantKind::Vt).then(|| plan.raw(SCALE_BLOCK * g.head_dim, 16));
        let mean = matches!(self.kind, QuantKind::KeyMean { .. });
        let sums = mean.then(|| plan.raw(4 * g.warps() * g.head_dim, 16));
        let last = (self.kind == QuantKind::KeyMean { rotate: true }).then(|| plan.raw(4, 4));
        (
            plan,
            SmemSlots {
                amax,
                codes,
                sums,
                last,
            },
        )
    }

    /// Dynamic shared memory per block, bytes (below 48 KiB: no opt-in).
    pub fn smem_bytes(&self) -> u32 {
        self.plan().0.bytes()
    }

    /// Generates the module (one entry, named [`QuantConfig::id`]).
    pub fn generate(&self) -> Result<Module, PtxError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(PtxError::BadOperand(format!(
                "no quantization kernel for head dim {}",
                self.head_dim
            )));
        }
        let mut module = Module::new(Target::Sm89);
        module.push(build(self)?)?;
        Ok(module)
    }
}

/// Every quantization configuration: each kind and option set, for f16 and bf16 input and
/// every FP8 head dim.
pub fn all_quant_configs() -> Vec<QuantConfig> {
    let mut kinds = vec![
        QuantKind::Vt,
        QuantKind::KeyMean { rotate: false },
        QuantKind::KeyMean { rotate: true },
    ];
    for smoothing in [Smoothing::None, Smoothing::Query, Smoothing::Key] {
        for hadamard in [false, true] {
            kinds.push(QuantKind::Rows {
                smoothing,
                hadamard,
            });
        }
    }
    let mut v = Vec::new();
    for kind in kinds {
        for input in [HalfType::F16, HalfType::Bf16] {
            for head_dim in HEAD_DIMS {
                v.push(QuantConfig {
                    kind,
                    input,
                    head_dim,
                });
            }
        }
    }
    v
}

pub(super) fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

pub(super) fn strides(k: &mut Kernel, args: ParamBytes, at: usize) -> [Reg<U64>; 3] {
    std::array::from_fn(|i| arg::<U64>(k, args, at + 8 * i))
}

/// `base + elem · (a·s[0] + b·s[1] + c·s[2]) + bytes`, all 64-bit.
pub(super) fn address(
    k: &mut Kernel,
    base: Reg<U64>,
    s: &[Reg<U64>; 3],
    [a, b, c]: [Reg<U32>; 3],
    elem_bytes: u64,
    bytes: Reg<U64>,
) -> Reg<U64> {
    let (a, b, c) = (k.cvt_u64_u32(a), k.cvt_u64_u32(b), k.cvt_u64_u32(c));
    let e = k.mul(a, s[0]);
    let e = k.mad(b, s[1], e);
    let e = k.mad(c, s[2], e);
    let e = if elem_bytes == 1 {
        e
    } else {
        k.mul(e, elem_bytes)
    };
    let at = k.add(base, e);
    k.add(at, bytes)
}

/// Where a thread works: its block's (row block, head, batch) and its lane's part of a
/// row.
#[derive(Debug, Clone, Copy)]
struct Place {
    tid: Reg<U32>,
    /// `c`: the 16-byte vector of each of its rows (channels `8c .. 8c+7`).
    col: Reg<U32>,
    /// Its row of slot 0, inside the block.
    row: Reg<U32>,
    block: Reg<U32>,
    head: Reg<U32>,
    batch: Reg<U32>,
}

fn place(k: &mut Kernel, g: &Geometry) -> Place {
    let tid = k.special(Special::TidX);
    let col = k.and(tid, g.lanes_per_row - 1);
    let row = k.shr(tid, g.lanes_per_row.trailing_zeros());
    Place {
        tid,
        col,
        row,
        block: k.special(Special::CtaidX),
        head: k.special(Special::CtaidY),
        batch: k.special(Special::CtaidZ),
    }
}

/// The thread's 16-byte vector of every slot's row, rows `first_row + i·R` of the
/// sequence; zeros for rows at or past `seqlen`. All loads are issued before any is used.
fn load_slots(
    k: &mut Kernel,
    g: &Geometry,
    args: ParamBytes,
    p: &Place,
    first_row: Reg<U32>,
    seqlen: Reg<U32>,
) -> Vec<[Reg<B32>; 4]> {
    let src = arg::<U64>(k, args, offset_of!(QuantArgs, src));
    let st = strides(k, args, offset_of!(QuantArgs, src_stride));
    let col_bytes = k.mul_wide_u32(p.col, 16u32);
    let mut at = address(k, src, &st, [p.batch, first_row, p.head], 2, col_bytes);
    let step = k.mul(st[1], 2 * g.rows_per_slot as u64);
    let mut slots = Vec::new();
    for i in 0..g.slots {
        if i > 0 {
            at = k.add(at, step);
        }
        let row = k.add(first_row, i * g.rows_per_slot);
        let inside = k.setp(Cmp::Lt, row, seqlen);
        let words = k.regs::<B32, 4>();
        for w in words {
            k.mov_to(w, 0u32);
        }
        k.guarded(inside, true, |k| k.ld_global_v4_into(words, at, 0));
        slots.push(words);
    }
    slots
}

/// Eight 16-bit values (four words) widened to f32, exactly.
pub(super) fn widen(k: &mut Kernel, input: HalfType, words: [Reg<B32>; 4]) -> [Reg<F32>; 8] {
    fn pairs<H: Half2 + SameClass<B32>>(k: &mut Kernel, words: [Reg<B32>; 4]) -> Vec<Reg<F32>> {
        words
            .into_iter()
            .flat_map(|w| k.unpack_half2::<H>(w.cast::<H>()))
            .collect()
    }
    let v = match input {
        HalfType::F16 => pairs::<F16x2>(k, words),
        HalfType::Bf16 => pairs::<Bf16x2>(k, words),
    };
    std::array::from_fn(|e| v[e])
}

/// The block's largest value of `local` (every thread's): warp shuffles, then one word
/// per warp in shared memory. Every thread gets the result.
fn block_max(
    k: &mut Kernel,
    g: &Geometry,
    tid: Reg<U32>,
    local: Reg<F32>,
    red: SmemAddr,
) -> Reg<F32> {
    let mut m = local;
    for mask in [16, 8, 4, 2, 1] {
        let other = k.shfl_bfly(m, mask);
        m = k.max(m, other);
    }
    let lane = k.and(tid, 31u32);
    let warp = k.shr(tid, 5);
    let first = k.setp(Cmp::Eq, lane, 0u32);
    let slot = k.shl(warp, 2);
    let slot = k.smem_offset(red, slot);
    k.guarded(first, true, |k| k.st_shared(slot, 0, m));
    k.sync_threads();
    let total = k.mov(0.0f32);
    for quad in 0..g.warps() / 4 {
        for w in k.ld_shared_v4::<F32>(red, (16 * quad) as i32) {
            k.max_to(total, total, w);
        }
    }
    total
}

/// A block's scale and multiplier from its amax, as [`crate::quant::block_scale`]:
/// `amax / 448` and `448 / amax` (correctly rounded divisions), or (1, 0) when the scale
/// is 0 or the multiplier not finite.
pub(crate) fn block_scale(k: &mut Kernel, amax: Reg<F32>) -> (Reg<F32>, Reg<F32>) {
    let max = k.mov(E4M3_MAX);
    let scale = k.div(amax, max);
    let inv = k.div(max, amax);
    let positive = k.setp(Cmp::Gt, scale, 0.0f32);
    let finite = k.setp(Cmp::Lt, inv, f32::INFINITY);
    let ok = k.and_pred(positive, finite);
    (k.selp(scale, 1.0f32, ok), k.selp(inv, 0.0f32, ok))
}

/// The address of `base[batch, head, i]` in an f32 `[B, H, n]` array: the scales
/// (`n` blocks), `lse_shift` (`n` rows), K's mean and its rotation (`n` channels).
pub(crate) fn bhn_address(
    k: &mut Kernel,
    base: Reg<U64>,
    [heads, n]: [Reg<U32>; 2],
    [batch, head, i]: [Reg<U32>; 3],
) -> Reg<U64> {
    let bh = k.mad(batch, heads, head);
    let index = k.mul_wide_u32(bh, n);
    let i = k.cvt_u64_u32(i);
    let index = k.add(index, i);
    let index = k.shl(index, 2);
    k.add(base, index)
}

/// Thread 0 writes the block's scale to `scales[(b·H + h)·blocks + block]` when the
/// block is one of the sequence's (a Vᵀ block of padding only writes none).
fn store_scale(k: &mut Kernel, args: ParamBytes, p: &Place, scale: Reg<F32>) {
    let scales = arg::<U64>(k, args, offset_of!(QuantArgs, scales));
    let heads = arg::<U32>(k, args, offset_of!(QuantArgs, heads));
    let blocks = arg::<U32>(k, args, offset_of!(QuantArgs, scale_blocks));
    let at = bhn_address(k, scales, [heads, blocks], [p.batch, p.head, p.block]);
    let first = k.setp(Cmp::Eq, p.tid, 0u32);
    let real = k.setp(Cmp::Lt, p.block, blocks);
    let write = k.and_pred(first, real);
    k.guarded(write, true, |k| k.st_global(at, 0, scale));
}

/// What a block's amax is taken over, as [`crate::quant::finite_magnitude`]: `|v|` where
/// `v` is finite, NaN (which `max` passes over) where it is not, so that an infinity in
/// one element leaves the scale of the others alone (its own code is NaN: [`scaled`]).
/// One fused multiply-add: `v · 0 + |v|`, as `v · 0` is ±0 for a finite `v` and NaN
/// otherwise (the Hopper rotation is short of issue slots: a compare and a select per
/// value, here and in [`scaled`], made it 12% slower with K smoothing).
fn finite_magnitude(k: &mut Kernel, v: Reg<F32>) -> Reg<F32> {
    let a = k.abs(v);
    k.mad(v, 0.0f32, a)
}

/// `v` where it is finite, else 0: what the key mean sums, so that an infinite or NaN
/// key element spoils only its own codes (and the outputs that read them), not the mean
/// every key and the LSE shift of every query take. As [`crate::quant::key_mean`].
fn finite_or_zero(k: &mut Kernel, v: Reg<F32>) -> Reg<F32> {
    let a = k.abs(v);
    let finite = k.setp(Cmp::Lt, a, f32::INFINITY);
    k.selp(v, 0.0f32, finite)
}

/// `amax = max(amax, finite_magnitude(v))`: one value into a running amax.
pub(crate) fn fold_amax(k: &mut Kernel, amax: Reg<F32>, v: Reg<F32>) {
    let a = finite_magnitude(k, v);
    k.max_to(amax, amax, a);
}

/// The value whose code is `v`'s in a block with multiplier `inv`, as
/// [`crate::quant::quantize_value`]: `v · inv`, or NaN where `v` is not finite.
/// `cvt.rn.satfinite` would clamp an infinity to ±448, a finite value that attention
/// would then use as if it were data; NaN propagates to the outputs that read it, as the
/// infinity would in 16-bit attention. As `fma(v, inv, v · 0)`: `v · 0` is a zero of
/// `v`'s sign for a finite `v`, which leaves the rounded product as it is (its sign
/// included), and NaN otherwise.
pub(crate) fn scaled(k: &mut Kernel, v: Reg<F32>, inv: Reg<F32>) -> Reg<F32> {
    let zero_or_nan = k.mul(v, 0.0f32);
    k.mad(v, inv, zero_or_nan)
}

/// The e4m3 codes of eight values times `inv` (`cvt.rn.satfinite`; NaN for a value that
/// is not finite), as two words: value `e` in byte `e`.
fn codes(k: &mut Kernel, x: &[Reg<F32>; 8], inv: Reg<F32>) -> [Reg<B32>; 2] {
    let y: Vec<Reg<F32>> = x.iter().map(|&v| scaled(k, v, inv)).collect();
    let h: Vec<_> = y.chunks(2).map(|p| k.pack_e4m3x2(p[0], p[1])).collect();
    [k.join_b16x2(h[0], h[1]), k.join_b16x2(h[2], h[3])]
}

/// Where `lse_shift[batch, head, row]` (f32 `[B, H, S]`) lives.
pub(super) fn lse_shift_address(
    k: &mut Kernel,
    args: ParamBytes,
    [batch, head, row]: [Reg<U32>; 3],
    seqlen: Reg<U32>,
) -> Reg<U64> {
    let lse = arg::<U64>(k, args, offset_of!(QuantArgs, lse_shift));
    let heads = arg::<U32>(k, args, offset_of!(QuantArgs, heads));
    bhn_address(k, lse, [heads, seqlen], [batch, head, row])
}

/// Where the thread's vector of a mean-shaped row starts: `base[b, head, 8c]` in an f32
/// `[B, heads, d]` array.
fn vector_address(
    k: &mut Kernel,
    base: Reg<U64>,
    heads: Reg<U32>,
    p: &Place,
    head: Reg<U32>,
    d: u32,
) -> Reg<U64> {
    let channels = k.mov::<U32>(d);
    let channel = k.mul(p.col, ELEMS_PER_THREAD as u32);
    bhn_address(k, base, [heads, channels], [p.batch, head, channel])
}

/// The mean's eight channels of the thread's vector: `mean[b, head, 8c .. 8c+7]`.
fn load_mean(k: &mut Kernel, args: ParamBytes, p: &Place, head: Reg<U32>, d: u32) -> [Reg<F32>; 8] {
    let mean = arg::<U64>(k, args, offset_of!(QuantArgs, mean));
    let heads = arg::<U32>(k, args, offset_of!(QuantArgs, mean_heads));
    let at = vector_address(k, mean, heads, p, head, d);
    let lo = k.ld_global_v4::<F32>(at, 0);
    let hi = k.ld_global_v4::<F32>(at, 16);
    std::array::from_fn(|e| if e < 4 { lo[e] } else { hi[e - 4] })
}

/// The Hadamard option's per-thread constants: the sign of each of the thread's eight
/// channels, and per lane stage `j` the sign its own value takes in the butterfly (`−1`
/// where lane bit `j` is set: that lane holds `b` of `(a + b, a − b)` and keeps `a − b`).
struct Rotation {
    channel_sign: [Reg<F32>; 8],
    lane_sign: Vec<Reg<F32>>,
    norm: f32,
}

fn rotation(k: &mut Kernel, g: &Geometry, args: ParamBytes, p: &Place) -> Rotation {
    let at = offset_of!(QuantArgs, hadamard_signs);
    // Word c/4 holds the bits of channels 8c .. 8c+7, in byte c%4.
    let word_index = k.shr(p.col, 2);
    let mut word = arg::<U32>(k, args, at);
    for j in 1..g.head_dim / 32 {
        let other = arg::<U32>(k, args, at + 4 * j as usize);
        let this = k.setp(Cmp::Eq, word_index, j);
        word = k.selp(other, word, this);
    }
    let byte = k.and(p.col, 3u32);
    let byte = k.shl(byte, 3);
    let bits = k.shr_by(word, byte);
    let sign_of = |k: &mut Kernel, value: Reg<U32>, bit: u32| {
        let set = k.and(value, 1u32 << bit);
        let negated = k.setp(Cmp::Ne, set, 0u32);
        k.selp(-1.0f32, 1.0f32, negated)
    };
    let channel_sign = std::array::from_fn(|e| sign_of(k, bits, e as u32));
    let lane_sign = (0..g.lanes_per_row.trailing_zeros())
        .map(|j| sign_of(k, p.col, j))
        .collect();
    Rotation {
        channel_sign,
        lane_sign,
        norm: hadamard_norm(g.head_dim as usize),
    }
}

/// `x ← H · diag(s) · x / sqrt(D)` for the row whose channels `8c .. 8c+7` the thread
/// holds: in [`crate::quant::rotate_row`]'s order.
fn rotate(k: &mut Kernel, r: &Rotation, x: [Reg<F32>; 8]) -> [Reg<F32>; 8] {
    let mut y: [Reg<F32>; 8] = std::array::from_fn(|e| k.mul(x[e], r.channel_sign[e]));
    for h in [1, 2, 4] {
        for e in 0..8 {
            if e & h == 0 {
                let (a, b) = (y[e], y[e + h]);
                y[e] = k.add(a, b);
                y[e + h] = k.sub(a, b);
            }
        }
    }
    for (j, &sign) in r.lane_sign.iter().enumerate() {
        for v in y.iter_mut() {
            let other = k.shfl_bfly(*v, 1 << j);
            // a + b in the lane holding a (sign +1), a − b in the one holding b (−1).
            *v = k.mad(sign, *v, other);
        }
    }
    y.map(|v| k.mul(v, r.norm))
}

fn build(cfg: &QuantConfig) -> Result<KernelText, PtxError> {
    let g = Geometry::of(cfg.head_dim);
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(g.threads);
    let args = k.param_bytes("args", QuantArgs::SIZE, 8);
    let (plan, slots) = cfg.plan();
    let smem = k.shared_memory(&plan);
    let p = place(&mut k, &g);
    match cfg.kind {
        QuantKind::Rows {
            smoothing,
            hadamard,
        } => {
            let red = smem.raw(&mut k, slots.amax);
            rows(&mut k, cfg, &g, args, &p, red, smoothing, hadamard)
        }
        QuantKind::Vt => {
            let codes = slots.codes.expect("the Vt plan has a code tile");
            let (red, codes) = (smem.raw(&mut k, slots.amax), smem.raw(&mut k, codes));
            vt(&mut k, cfg, &g, args, &p, red, codes)
        }
        QuantKind::KeyMean { rotate } => {
            let sums = slots.sums.expect("the key-mean plan has partial sums");
            let sums = smem.raw(&mut k, sums);
            key_mean(&mut k, cfg, &g, args, &p, sums);
            if rotate {
                let last = slots.last.expect("the rotating key-mean plan has a flag");
                let last = smem.raw(&mut k, last);
                rotate_when_last(&mut k, &g, args, &p, last);
            }
        }
    }
    k.finish()
}

/// The rows kernel (Q or K), see the module docs.
#[allow(clippy::too_many_arguments)]
fn rows(
    k: &mut Kernel,
    cfg: &QuantConfig,
    g: &Geometry,
    args: ParamBytes,
    p: &Place,
    red: SmemAddr,
    smoothing: Smoothing,
    hadamard: bool,
) {
    let seqlen = arg::<U32>(k, args, offset_of!(QuantArgs, seqlen));
    let first_row = k.mad(p.block, SCALE_BLOCK, p.row);
    let raw = load_slots(k, g, args, p, first_row, seqlen);
    let mean = match smoothing {
        Smoothing::None => None,
        Smoothing::Key => Some(load_mean(k, args, p, p.head, g.head_dim)),
        Smoothing::Query => {
            let group = arg::<U32>(k, args, offset_of!(QuantArgs, group));
            let kv_head = k.div(p.head, group);
            Some(load_mean(k, args, p, kv_head, g.head_dim))
        }
    };
    let rotation = hadamard.then(|| rotation(k, g, args, p));
    let lse_row0 = (smoothing == Smoothing::Query)
        .then(|| lse_shift_address(k, args, [p.batch, p.head, first_row], seqlen));
    let lane_leads_row = k.setp(Cmp::Eq, p.col, 0u32);

    // The values the block quantizes, slot by slot: K smoothing's subtraction (and the
    // rotation) happen here; without the rotation they are recomputed for the codes
    // rather than kept (two f32 per 16-bit input word would double the registers).
    // Rows past the sequence stay zero: minus the mean they would count in the amax.
    let values = |k: &mut Kernel, slot: usize| -> [Reg<F32>; 8] {
        let x = widen(k, cfg.input, raw[slot]);
        match (smoothing, &mean) {
            (Smoothing::Key, Some(m)) => {
                let row = k.add(first_row, slot as u32 * g.rows_per_slot);
                let inside = k.setp(Cmp::Lt, row, seqlen);
                std::array::from_fn(|e| {
                    let centred = k.sub(x[e], m[e]);
                    k.selp(centred, 0.0f32, inside)
                })
            }
            _ => x,
        }
    };

    k.comment("pass 1: every slot's values, the block's amax (and Q's lse_shift)");
    let amax = k.mov(0.0f32);
    let mut kept = Vec::new();
    for i in 0..raw.len() {
        let mut x = values(k, i);
        if let (Some(lse_row0), Some(m)) = (lse_row0, &mean) {
            // q · mean over the thread's 8 channels, then over the row's lanes.
            let mut dot = k.mov(0.0f32);
            for e in 0..8 {
                dot = k.mad(x[e], m[e], dot);
            }
            for j in 0..g.lanes_per_row.trailing_zeros() {
                let other = k.shfl_bfly(dot, 1 << j);
                dot = k.add(dot, other);
            }
            let row = k.add(first_row, i as u32 * g.rows_per_slot);
            let inside = k.setp(Cmp::Lt, row, seqlen);
            let write = k.and_pred(inside, lane_leads_row);
            let offset = (4 * i as u32 * g.rows_per_slot) as i32;
            k.guarded(write, true, |k| k.st_global(lse_row0, offset, dot));
        }
        if let Some(r) = &rotation {
            x = rotate(k, r, x);
            kept.push(x);
        }
        for v in x {
            fold_amax(k, amax, v);
        }
    }
    let amax = block_max(k, g, p.tid, amax, red);
    let (scale, inv) = block_scale(k, amax);
    store_scale(k, args, p, scale);

    k.comment("pass 2: codes, two slots at a time, as 16-byte stores");
    let dst = arg::<U64>(k, args, offset_of!(QuantArgs, dst));
    let ds = strides(k, args, offset_of!(QuantArgs, dst_stride));
    let parity = k.and(p.col, 1u32);
    let odd = k.setp(Cmp::Ne, parity, 0u32);
    // An even lane stores slot i's row, an odd lane slot i+1's; both the 16 bytes of
    // vectors c & !1 and c | 1.
    let row_pair = k.mad(parity, g.rows_per_slot, first_row);
    let pair_col = k.shr(p.col, 1);
    let pair_bytes = k.mul_wide_u32(pair_col, 16u32);
    let mut at = address(k, dst, &ds, [p.batch, row_pair, p.head], 1, pair_bytes);
    let step = k.mul(ds[1], 2 * g.rows_per_slot as u64);
    for pair in 0..g.slots / 2 {
        let i = (2 * pair) as usize;
        let [mine, next] = [i, i + 1].map(|s| {
            let x = match rotation {
                Some(_) => kept[s],
                None => values(k, s),
            };
            codes(k, &x, inv)
        });
        let send: [Reg<B32>; 2] = std::array::from_fn(|w| k.selp(mine[w], next[w], odd));
        let got = send.map(|w| k.shfl_bfly(w, 1));
        let out = [
            k.selp(got[0], mine[0], odd),
            k.selp(got[1], mine[1], odd),
            k.selp(next[0], got[0], odd),
            k.selp(next[1], got[1], odd),
        ];
        if pair > 0 {
            at = k.add(at, step);
        }
        let row = k.add(row_pair, i as u32 * g.rows_per_slot);
        let inside = k.setp(Cmp::Lt, row, seqlen);
        k.guarded(inside, true, |k| k.st_global_v4(at, 0, out));
    }
}

/// The Vᵀ kernel, see the module docs.
fn vt(
    k: &mut Kernel,
    cfg: &QuantConfig,
    g: &Geometry,
    args: ParamBytes,
    p: &Place,
    red: SmemAddr,
    tile: SmemAddr,
) {
    let d = g.head_dim;
    let seqlen = arg::<U32>(k, args, offset_of!(QuantArgs, seqlen));
    let first_row = k.mad(p.block, SCALE_BLOCK, p.row);
    let raw = load_slots(k, g, args, p, first_row, seqlen);
    let amax = k.mov(0.0f32);
    for &words in &raw {
        for v in widen(k, cfg.input, words) {
            fold_amax(k, amax, v);
        }
    }
    let amax = block_max(k, g, p.tid, amax, red);
    let (scale, inv) = block_scale(k, amax);
    store_scale(k, args, p, scale);

    // Word column w of key row r is stored at column w ^ swizzle(r): the 16-group of
    // the key picks which 4-word quad, so the eight groups' words of one column (read
    // together below) sit in eight different quads, hence banks.
    let quads = (d / 16).min(8);
    let swizzle = |k: &mut Kernel, key: Reg<U32>| {
        let group = k.shr(key, VT_GROUP.trailing_zeros());
        let group = k.and(group, quads - 1);
        k.shl(group, 2)
    };
    k.comment("codes to shared memory, [key][D] bytes, swizzled");
    let col_words = k.shl(p.col, 1);
    for (i, &words) in raw.iter().enumerate() {
        let x = widen(k, cfg.input, words);
        let c = codes(k, &x, inv);
        let key = k.add(p.row, i as u32 * g.rows_per_slot);
        let sw = swizzle(k, key);
        let column = k.xor(col_words, sw);
        let column = k.shl(column, 2);
        let at = k.mad(key, d, column);
        let at = k.smem_offset(tile, at);
        k.st_shared_v2(at, 0, c);
    }
    k.sync_threads();

    k.comment("transpose: a 4-channel column of one 16-key group per thread");
    let jobs = 2 * d;
    let working = k.setp(Cmp::Lt, p.tid, jobs);
    k.if_(working, |k| {
        let group = k.and(p.tid, 7u32);
        let column = k.shr(p.tid, 3);
        let first_key = k.shl(group, 4);
        let sw = swizzle(k, first_key);
        let stored = k.xor(column, sw);
        let stored = k.shl(stored, 2);
        let at = k.mad(first_key, d, stored);
        let at = k.smem_offset(tile, at);
        let words: Vec<Reg<B32>> = (0..VT_GROUP)
            .map(|key| k.ld_shared::<B32>(at, (key * d) as i32))
            .collect();
        // out[e][q]: channel 4·column + e, stored positions 4q .. 4q+3.
        let mut out = [[words[0]; 4]; 4];
        for q in 0..4 {
            let [a, b, c, dd] = std::array::from_fn(|j| words[VT_KEY_ORDER[4 * q + j] as usize]);
            // A 4x4 byte transpose: byte e of keys a, b, c, d into word e.
            let t0 = k.prmt(a, b, 0x5140);
            let t1 = k.prmt(c, dd, 0x5140);
            let t2 = k.prmt(a, b, 0x7362);
            let t3 = k.prmt(c, dd, 0x7362);
            out[0][q] = k.prmt(t0, t1, 0x5410);
            out[1][q] = k.prmt(t0, t1, 0x7632);
            out[2][q] = k.prmt(t2, t3, 0x5410);
            out[3][q] = k.prmt(t2, t3, 0x7632);
        }
        let dst = arg::<U64>(k, args, offset_of!(QuantArgs, dst));
        let ds = strides(k, args, offset_of!(QuantArgs, dst_stride));
        let pitch = ds[2];
        let group_position = k.shl(group, VT_GROUP.trailing_zeros());
        let position = k.mad(p.block, SCALE_BLOCK, group_position);
        let position = k.cvt_u64_u32(position);
        let channel = k.shl(column, 2);
        let mut at = address(k, dst, &ds, [p.batch, p.head, channel], 1, position);
        let inside = k.setp(Cmp::Lt, position, pitch);
        for (e, vector) in out.into_iter().enumerate() {
            if e > 0 {
                at = k.add(at, pitch);
            }
            k.guarded(inside, true, |k| k.st_global_v4(at, 0, vector));
        }
    });
}

/// The key-mean kernel, see the module docs.
fn key_mean(
    k: &mut Kernel,
    cfg: &QuantConfig,
    g: &Geometry,
    args: ParamBytes,
    p: &Place,
    sums: SmemAddr,
) {
    let d = g.head_dim;
    let seqlen = arg::<U32>(k, args, offset_of!(QuantArgs, seqlen));
    let acc: [Reg<F32>; 8] = std::array::from_fn(|_| k.mov(0.0f32));
    let slab = k.mad(p.block, SCALE_BLOCK * MEAN_ROW_BLOCKS, p.row);
    k.for_range(0i32, MEAN_ROW_BLOCKS as i32, 1, |k, block| {
        let first_row = k.mad(block.cast::<U32>(), SCALE_BLOCK, slab);
        let raw = load_slots(k, g, args, p, first_row, seqlen);
        for words in raw {
            let x = widen(k, cfg.input, words);
            for e in 0..8 {
                let finite = finite_or_zero(k, x[e]);
                k.add_to(acc[e], acc[e], finite);
            }
        }
    });
    // Lanes c, c + C, ... of a warp hold the same channels of different rows.
    let mut acc = acc;
    let mut mask = g.lanes_per_row;
    while mask < 32 {
        for v in acc.iter_mut() {
            let other = k.shfl_bfly(*v, mask);
            *v = k.add(*v, other);
        }
        mask *= 2;
    }
    let lane = k.and(p.tid, 31u32);
    let warp = k.shr(p.tid, 5);
    let first_row_of_warp = k.setp(Cmp::Lt, lane, g.lanes_per_row);
    let at = k.mad(warp, d, 0u32);
    let at = k.mad(p.col, ELEMS_PER_THREAD as u32, at);
    let at = k.shl(at, 2);
    let at = k.smem_offset(sums, at);
    k.guarded(first_row_of_warp, true, |k| {
        k.st_shared_v4(at, 0, [acc[0], acc[1], acc[2], acc[3]]);
        k.st_shared_v4(at, 16, [acc[4], acc[5], acc[6], acc[7]]);
    });
    k.sync_threads();
    let channel_thread = k.setp(Cmp::Lt, p.tid, d);
    k.if_(channel_thread, |k| {
        let column = k.shl(p.tid, 2);
        let column = k.smem_offset(sums, column);
        let total = k.ld_shared::<F32>(column, 0);
        for w in 1..g.warps() {
            let part = k.ld_shared::<F32>(column, (4 * w * d) as i32);
            k.add_to(total, total, part);
        }
        let inv_seqlen = arg::<F32>(k, args, offset_of!(QuantArgs, inv_seqlen));
        let share = k.mul(total, inv_seqlen);
        let mean = arg::<U64>(k, args, offset_of!(QuantArgs, mean));
        let heads = arg::<U32>(k, args, offset_of!(QuantArgs, heads));
        let channels = k.mov::<U32>(d);
        let at = bhn_address(k, mean, [heads, channels], [p.batch, p.head, p.tid]);
        k.red_global_add_f32(at, 0, share);
    });
}

/// The key mean's last step with `rotate`: every block takes a ticket for its (head,
/// batch) once its sums are in; the one that draws the last (`gridDim.x − 1`) rotates
/// the finished mean. Its first warp does ([`rotate_mean`]); the others are done.
fn rotate_when_last(k: &mut Kernel, g: &Geometry, args: ParamBytes, p: &Place, last: SmemAddr) {
    // This thread's reductions (made under `tid < D`) before the block's ticket.
    k.fence_acq_rel_gpu();
    k.sync_threads();
    let first_thread = k.setp(Cmp::Eq, p.tid, 0u32);
    k.if_(first_thread, |k| {
        let tickets = arg::<U64>(k, args, offset_of!(QuantArgs, tickets));
        let heads = arg::<U32>(k, args, offset_of!(QuantArgs, heads));
        let bh = k.mad(p.batch, heads, p.head);
        let offset = k.mul_wide_u32(bh, 4u32);
        let at = k.add(tickets, offset);
        let ticket = k.atom_global_add_u32(at, 0, 1u32);
        let blocks = k.special(Special::NctaidX);
        let final_ticket = k.sub(blocks, 1u32);
        let is_last = k.setp(Cmp::Eq, ticket, final_ticket);
        let flag = k.selp::<U32>(1u32, 0u32, is_last);
        k.st_shared(last, 0, flag);
        // Every other block's sums (published before its ticket) before the reads below.
        k.fence_acq_rel_gpu();
    });
    k.sync_threads();
    let flag = k.ld_shared::<U32>(last, 0);
    let warp = k.shr(p.tid, 5);
    let first_warp = k.setp(Cmp::Eq, warp, 0u32);
    let last_block = k.setp(Cmp::Ne, flag, 0u32);
    let rotates = k.and_pred(first_warp, last_block);
    k.if_(rotates, |k| {
        // The warp's reads come after the first thread's acquiring fence (through the
        // block barrier); its own fence makes that order explicit for each of them.
        k.fence_acq_rel_gpu();
        rotate_mean(k, g, args, p);
    });
}

/// The mean rotated: `dst[b, h] = rotate(mean[b, h])` (f32 `[B, H, D]` both) by
/// [`rotate`], so in [`crate::quant::rotate_row`]'s order, by the first warp of a block:
/// every group of `C` lanes rotates the row; the first writes it.
fn rotate_mean(k: &mut Kernel, g: &Geometry, args: ParamBytes, p: &Place) {
    let mean = load_mean(k, args, p, p.head, g.head_dim);
    let r = rotation(k, g, args, p);
    let y = rotate(k, &r, mean);
    let dst = arg::<U64>(k, args, offset_of!(QuantArgs, dst));
    let heads = arg::<U32>(k, args, offset_of!(QuantArgs, heads));
    let at = vector_address(k, dst, heads, p, p.head, g.head_dim);
    let first_row = k.setp(Cmp::Eq, p.row, 0u32);
    k.guarded(first_row, true, |k| {
        k.st_global_v4(at, 0, [y[0], y[1], y[2], y[3]]);
        k.st_global_v4(at, 16, [y[4], y[5], y[6], y[7]]);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_covers_the_block_with_whole_rows_per_warp() {
        for d in HEAD_DIMS {
            let g = Geometry::of(d);
            assert_eq!(g.rows_per_slot * g.slots, SCALE_BLOCK, "d {d}");
            assert_eq!(g.threads * g.slots, SCALE_BLOCK * g.lanes_per_row);
            assert!(g.lanes_per_row <= 32 && 32 % g.lanes_per_row == 0);
            assert!(g.slots.is_multiple_of(2), "slots go out in pairs");
            // One transpose job (a 4-channel column of a 16-key group) per thread at most.
            assert!(2 * d <= g.threads);
            assert!(g.warps().is_multiple_of(4));
        }
    }

    #[test]
    fn ids_are_distinct_and_every_kernel_generates() {
        let all = all_quant_configs();
        let ids: std::collections::HashSet<_> = all.iter().map(|c| c.id()).collect();
        assert_eq!(ids.len(), all.len());
        // Nine kinds (the key mean with and without the rotation) for each input type and
        // head dim.
        assert_eq!(all.len(), 9 * 2 * 3);
        for c in &all {
            let ptx = c.generate().unwrap().to_ptx();
            assert!(ptx.contains(".target sm_89"), "{}", c.id());
            assert!(c.smem_bytes() <= 48 * 1024);
        }
        assert_eq!(QuantArgs::SIZE % 8, 0);
    }

    #[test]
    fn swizzled_vt_reads_hit_distinct_banks() {
        // The transpose's lanes: group g = lane % 8, word column 4w + lane / 8, key row
        // 16g + kk; stored column = column ^ 4·(g % quads).
        for d in [128u32, 256] {
            let quads = (d / 16).min(8);
            for kk in 0..16 {
                let banks: std::collections::HashSet<u32> = (0..32)
                    .map(|lane| {
                        let (group, column) = (lane % 8, 4 + lane / 8);
                        let row = 16 * group + kk;
                        let word = row * d / 4 + (column ^ (4 * (group % quads)));
                        word % 32
                    })
                    .collect();
                assert_eq!(banks.len(), 32, "d {d}");
            }
        }
    }
}
