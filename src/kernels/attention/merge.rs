//! Merging partial attention results by their log-sum-exp (`.target sm_80`).
//!
//! Attention over keys split into shards (the splits of a decode step, the KV shards of
//! ring or context-parallel attention) gives per shard `O_i` (normalised over its own
//! keys) and `LSE_i`. Over all keys:
//!
//! ```text
//! M = max_i LSE_i,   w_i = exp(LSE_i − M),   O = Σ w_i O_i / Σ w_i,   LSE = M + ln Σ w_i
//! ```
//!
//! A shard whose keys were all masked has `LSE_i = −∞` and weight 0: it merges as
//! nothing, whatever its `O_i` holds (NaN included: its values are replaced by 0, never
//! used). A row every shard masked gets O = 0 and LSE = −∞, as the forward gives such a
//! row. An LSE of +∞ or NaN, which no forward writes, makes its row's O and LSE NaN.
//!
//! One block merges one row `(b, s, h)`: warp `w` sums shards `w, w + WARPS, ...` (so a
//! row's shards are read by all warps at once, not one after another), lane `l` owning
//! columns `l·cpl ..` (`cpl` columns per lane, even, so 16-bit values move in pairs).
//! Each warp keeps its own running maximum `m_w` of the LSEs it has read, rescaling its
//! sums when it grows, so a shard's LSE and row are loaded together, in one memory
//! latency, rather than all LSEs first for `M`; the warps' sums meet in shared memory and
//! warp 0 weighs each by `exp(m_w − M)`.

use std::mem::offset_of;

use crate::ptx::{
    Bf16x2, Cmp, F16x2, F32, Half2, Kernel, KernelText, Module, Param, ParamBytes, Pred, PtxError,
    PtxType, RawSlot, Reg, S32, SmemAddr, SmemPlan, Special, Target, U32, U64,
};

use super::sequence::clamped_offsets;
use super::{FWD_HEAD_DIMS, serving_head_dim};

/// Element type of the shards or of the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MergeType {
    F16,
    Bf16,
    F32,
}

impl MergeType {
    pub fn name(self) -> &'static str {
        match self {
            MergeType::F16 => "f16",
            MergeType::Bf16 => "bf16",
            MergeType::F32 => "f32",
        }
    }

    pub fn bytes(self) -> u32 {
        match self {
            MergeType::F32 => 4,
            _ => 2,
        }
    }
}

/// Warps per block, each summing every `WARPS`-th shard of the block's row.
const WARPS: u32 = 8;
/// Shards a warp loads together.
const UNROLL: u32 = 2;

/// One merge-kernel configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MergeConfig {
    pub input: MergeType,
    pub output: MergeType,
    pub head_dim: u32,
    /// Launched behind the kernel that writes its inputs with programmatic stream
    /// serialization (`.target sm_90`): the blocks may be scheduled while that kernel
    /// drains and wait (`griddepcontrol.wait`) for its writes before reading, which
    /// takes the second launch's latency off a decode step.
    pub programmatic: bool,
    /// The rows have fewer columns than `head_dim` (80 on the 96 kernel; see
    /// [`kernel_head_dim`]): the kernel's second parameter, which sets how many lanes
    /// take columns. Only kernels whose lanes take a power of two of columns each
    /// ([`PADDED_HEAD_DIMS`]).
    pub padded: bool,
    /// The output is a packed (variable-length) batch, as a decode of one writes it
    /// (see [`MergeArgs::cu_seqlens`]). Only the decode combine's configurations.
    pub packed: bool,
}

/// The merge kernel head dims with a padded variant ([`MergeConfig::padded`]): each
/// lane takes 2, 4, 4 and 8 columns, which divide every multiple of 8.
pub const PADDED_HEAD_DIMS: [u32; 4] = [64, 96, 128, 256];

/// The merge kernel head dim that serves rows of `d` columns, and whether it runs
/// padded ([`MergeConfig::padded`]): `d` itself where a kernel has it, else the smallest
/// larger one of [`PADDED_HEAD_DIMS`] for a multiple of 8 up to 256 (80 on 96, 136 on
/// 256). `None` for anything else.
pub fn kernel_head_dim(d: usize) -> Option<(u32, bool)> {
    serving_head_dim(d, &FWD_HEAD_DIMS, &PADDED_HEAD_DIMS)
}

/// The by-value argument block of the merge kernel. Strides in elements. The shards'
/// LSEs are float32 `[B, H, S]` per shard, `lse_shard_stride` apart; the output LSE
/// (optional, 0) is float32 `[B, H, S]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MergeArgs {
    pub parts: u64,
    /// (shard, batch, seq, head) strides of the shards' outputs.
    pub part_stride: [u64; 4],
    pub lse_parts: u64,
    pub lse_shard_stride: u64,
    pub out: u64,
    /// (batch, seq, head) strides of the output.
    pub out_stride: [u64; 3],
    pub out_lse: u64,
    pub n_parts: u32,
    pub seqlen: u32,
    pub heads: u32,
    /// `B · S · H`.
    pub rows: u32,
    /// Packed kernels: int32 `[B + 1]` cumulative offsets. Row `(b, s, h)` of the shards
    /// goes to row `(0, cu[b] + s, h)` of the output and index `h · total + cu[b] + s`
    /// of its LSE (`[H, total]`), and only where `s < cu[b + 1] − cu[b]` (offsets
    /// clamped to `[0, total]`): rows past a sequence's end are not written.
    pub cu_seqlens: u64,
    /// Packed kernels: the output's rows.
    pub total: u32,
    /// Packed kernels, nonzero: a sequence with more than `seqlen` rows is another
    /// launch's (see [`DecodeArgs::skip_longer`](super::decode::DecodeArgs::skip_longer)):
    /// none of its rows are written.
    pub skip_longer: u32,
}

impl MergeArgs {
    pub const SIZE: usize = std::mem::size_of::<MergeArgs>();
}

impl MergeConfig {
    id_static!(MergeConfig, all_merge_configs, "attn_merge_unknown");

    pub fn id(&self) -> String {
        format!(
            "attn_merge_{}_to_{}_d{}{}{}{}",
            self.input.name(),
            self.output.name(),
            self.head_dim,
            if self.padded { "_padded" } else { "" },
            if self.packed { "_packed" } else { "" },
            if self.programmatic { "_pdl" } else { "" }
        )
    }

    pub fn threads(&self) -> u32 {
        WARPS * 32
    }

    /// Rows one block merges.
    pub fn rows_per_block(&self) -> u32 {
        1
    }

    /// The warps' partial sums: `WARPS` rows of `head_dim` floats, then `WARPS` totals
    /// and `WARPS` running maxima.
    fn plan(&self) -> (SmemPlan, RawSlot, RawSlot) {
        let mut plan = SmemPlan::new();
        let sums = plan.raw(WARPS * self.head_dim * 4, 16);
        let totals = plan.raw(2 * WARPS * 4, 4);
        (plan, sums, totals)
    }

    /// Dynamic shared memory per block, bytes.
    pub fn smem_bytes(&self) -> u32 {
        self.plan().0.bytes()
    }

    /// Columns per lane: the smallest even count that splits the row over at most 32
    /// lanes exactly.
    pub fn cols_per_lane(&self) -> u32 {
        let d = self.head_dim;
        let mut c = d.div_ceil(32).max(2);
        while !c.is_multiple_of(2) || !d.is_multiple_of(c) {
            c += 1;
        }
        c
    }

    /// Generates the module; a configuration [`all_merge_configs`] does not list is
    /// refused.
    pub fn generate(&self) -> Result<Module, PtxError> {
        crate::kernels::listed("merge", self, all_merge_configs())?;
        let mut module = Module::new(if self.programmatic {
            Target::Sm90
        } else {
            Target::Sm80
        });
        module.push(build(self)?)?;
        Ok(module)
    }
}

/// Every merge configuration: any of the three element types in and out, every head
/// dim; and the decode combine's (float32 partial results to a 16-bit output) launched
/// programmatically on Hopper, and into packed outputs launched either way. Each for the
/// unpadded head dims and for the padded kernels'.
pub fn all_merge_configs() -> Vec<MergeConfig> {
    let types = [MergeType::F16, MergeType::Bf16, MergeType::F32];
    // (programmatic, packed) of the decode combine's configurations.
    let combines = [(true, false), (false, true), (true, true)];
    let mut v = Vec::new();
    for (padded, head_dims) in [(false, &FWD_HEAD_DIMS[..]), (true, &PADDED_HEAD_DIMS[..])] {
        let cfg = |input, output, head_dim, (programmatic, packed)| MergeConfig {
            input,
            output,
            head_dim,
            programmatic,
            padded,
            packed,
        };
        for input in types {
            for output in types {
                for &head_dim in head_dims {
                    v.push(cfg(input, output, head_dim, (false, false)));
                }
            }
        }
        for combine in combines {
            for output in [MergeType::F16, MergeType::Bf16] {
                for &head_dim in head_dims {
                    v.push(cfg(MergeType::F32, output, head_dim, combine));
                }
            }
        }
    }
    v
}

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

/// Loads `n` consecutive values of type `t` at `addr`, widened to f32.
fn load_row(k: &mut Kernel, t: MergeType, addr: Reg<U64>, n: u32) -> Vec<Reg<F32>> {
    match t {
        MergeType::F32 => load_words::<F32>(k, addr, n),
        MergeType::F16 => unpack::<F16x2>(k, addr, n),
        MergeType::Bf16 => unpack::<Bf16x2>(k, addr, n),
    }
}

fn unpack<H: Half2>(k: &mut Kernel, addr: Reg<U64>, n: u32) -> Vec<Reg<F32>> {
    load_words::<H>(k, addr, n / 2)
        .into_iter()
        .flat_map(|w| k.unpack_half2::<H>(w))
        .collect()
}

/// `n` 32-bit words, 16-byte vectors where `n` allows.
fn load_words<T: crate::ptx::Word32>(k: &mut Kernel, addr: Reg<U64>, n: u32) -> Vec<Reg<T>> {
    if n.is_multiple_of(4) {
        (0..n / 4)
            .flat_map(|i| k.ld_global_v4::<T>(addr, (16 * i) as i32))
            .collect()
    } else {
        (0..n)
            .map(|i| k.ld_global::<T>(addr, (4 * i) as i32))
            .collect()
    }
}

/// Stores `values` as type `t` at `addr`.
fn store_row(k: &mut Kernel, t: MergeType, addr: Reg<U64>, values: &[Reg<F32>]) {
    match t {
        MergeType::F32 => store_words::<F32>(k, addr, values.to_vec()),
        MergeType::F16 => pack::<F16x2>(k, addr, values),
        MergeType::Bf16 => pack::<Bf16x2>(k, addr, values),
    }
}

fn pack<H: Half2>(k: &mut Kernel, addr: Reg<U64>, values: &[Reg<F32>]) {
    let words = values
        .chunks(2)
        .map(|p| k.pack_half2::<H>(p[0], p[1]))
        .collect();
    store_words::<H>(k, addr, words);
}

fn store_words<T: crate::ptx::Word32>(k: &mut Kernel, addr: Reg<U64>, words: Vec<Reg<T>>) {
    if words.len().is_multiple_of(4) {
        for (i, q) in words.chunks(4).enumerate() {
            k.st_global_v4::<T>(addr, (16 * i) as i32, [q[0], q[1], q[2], q[3]]);
        }
    } else {
        for (i, w) in words.into_iter().enumerate() {
            k.st_global::<T>(addr, (4 * i) as i32, w);
        }
    }
}

fn build(cfg: &MergeConfig) -> Result<KernelText, PtxError> {
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(cfg.threads());
    let args = k.param_bytes("args", MergeArgs::SIZE, 8);
    // A padded kernel's second parameter: the rows' columns (below the kernel's).
    let head_dim = cfg.padded.then(|| k.param::<U32>("head_dim"));
    if cfg.programmatic {
        k.comment("Wait for the kernel this one was launched behind: its writes are the input.");
        k.grid_dependency_wait();
    }
    let (plan, sums, totals) = cfg.plan();
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);
    let row = k.special(Special::CtaidX);
    let lane = k.and(tid, 31u32);
    let warp = k.shr(tid, 5);
    let rows = arg::<U32>(&mut k, args, offset_of!(MergeArgs, rows));
    // The whole block takes the branch or none: it holds one row.
    let inside = k.setp(Cmp::Lt, row, rows);
    let shared = Shared {
        sums: smem.raw(&mut k, sums),
        totals: smem.raw(&mut k, totals),
    };
    k.if_(inside, |k| {
        merge_row(k, cfg, args, row, [warp, lane], shared, head_dim)
    });
    k.finish()
}

/// Where the warps leave their partial sums.
#[derive(Clone, Copy)]
struct Shared {
    sums: SmemAddr,
    totals: SmemAddr,
}

fn merge_row(
    k: &mut Kernel,
    cfg: &MergeConfig,
    args: ParamBytes,
    row: Reg<U32>,
    [warp, lane]: [Reg<U32>; 2],
    shared: Shared,
    head_dim: Option<Param<U32>>,
) {
    let heads = arg::<U32>(k, args, offset_of!(MergeArgs, heads));
    let seqlen = arg::<U32>(k, args, offset_of!(MergeArgs, seqlen));
    let n_parts = arg::<U32>(k, args, offset_of!(MergeArgs, n_parts));
    let bs = k.div(row, heads);
    let h = k.mad(bs, heads, 0u32);
    let h = k.sub(row, h);
    let b = k.div(bs, seqlen);
    let s = k.mad(b, seqlen, 0u32);
    let s = k.sub(bs, s);
    // The row's LSE index inside a shard: (b·H + h)·S + s.
    let bh = k.mad(b, heads, h);
    let lse_index = k.mul_wide_u32(bh, seqlen);
    let s64 = k.cvt_u64_u32(s);
    let lse_index = k.add(lse_index, s64);
    // A packed output: the sequence's offsets, loaded with the shards' first rows.
    let packed = cfg.packed.then(|| PackedRow::load(k, args, b, s));
    let lse_parts = arg::<U64>(k, args, offset_of!(MergeArgs, lse_parts));
    let lse_shard = arg::<U64>(k, args, offset_of!(MergeArgs, lse_shard_stride));
    let lse_row = k.shl(lse_index, 2);
    let lse_row = k.add(lse_parts, lse_row);
    let lse_step = k.shl(lse_shard, 2);

    k.comment(
        "This warp's shards: O_w = sum w_i O_i, w_i = exp(LSE_i - m_w), m_w its running max.",
    );
    let cpl = cfg.cols_per_lane();
    // The lanes that take the row's columns: a padded kernel's from its parameter (`cpl`
    // a power of two that divides it).
    let lanes = head_dim.map(|p| {
        let d = k.load_param(p);
        k.shr(d, cpl.trailing_zeros())
    });
    let active = match lanes {
        Some(n) => k.setp(Cmp::Lt, lane, n),
        None => k.setp(Cmp::Lt, lane, cfg.head_dim / cpl),
    };
    let st: [Reg<U64>; 4] =
        std::array::from_fn(|i| arg::<U64>(k, args, offset_of!(MergeArgs, part_stride) + 8 * i));
    let parts = arg::<U64>(k, args, offset_of!(MergeArgs, parts));
    let b64 = k.cvt_u64_u32(b);
    let h64 = k.cvt_u64_u32(h);
    let e = k.mul(b64, st[1]);
    let e = k.mad(s64, st[2], e);
    let e = k.mad(h64, st[3], e);
    // Lanes past the row's columns read the last lane's (they store nothing).
    let col_lane = match lanes {
        Some(n) => {
            let last = k.sub(n, 1u32);
            k.min(lane, last)
        }
        None => k.min(lane, cfg.head_dim / cpl - 1),
    };
    let c = k.mul_wide_u32(col_lane, cpl);
    let e = k.add(e, c);
    let e = k.mul(e, u64::from(cfg.input.bytes()));
    let part_row = k.add(parts, e);
    let part_step = k.mul(st[0], u64::from(cfg.input.bytes()));
    let acc: Vec<Reg<F32>> = (0..cpl).map(|_| k.mov(0f32)).collect();
    let total = k.mov(0f32);
    let m = k.mov(f32::NEG_INFINITY);
    // Warp w starts at shard w and steps WARPS shards at a time.
    let w64 = k.cvt_u64_u32(warp);
    let lse_at = k.mad(w64, lse_step, lse_row);
    let row_at = k.mad(w64, part_step, part_row);
    let lse_step = k.mul(lse_step, u64::from(WARPS));
    let part_step = k.mul(part_step, u64::from(WARPS));
    // This warp's shards: ceil((n − w) / WARPS), none when w >= n.
    let mine = k.add(n_parts, WARPS - 1);
    let mine = k.sub(mine, warp);
    let mine = k.div(mine, WARPS);
    let some = k.setp(Cmp::Lt, warp, n_parts);
    let mine = k.selp(mine, 0u32, some);
    // UNROLL shards per step, all their loads issued before any is used (one shard at a
    // time, every step waited for its LSE and then for its row: 29 shards of a decode split
    // took 12 us at batch 1, 58 memory latencies in a row). Loads are unconditional so
    // that nothing waits on them early: past the last shard they re-read the last one,
    // and whatever a shard of weight 0 holds (NaN, say) is replaced by 0, never used.
    k.for_range(0i32, mine.cast(), UNROLL as i32, |k, first| {
        let left = k.sub(mine.cast::<S32>(), first);
        let last = k.sub(left, 1i32);
        let shards: Vec<(Reg<Pred>, Reg<U64>, Reg<U64>)> = (0..UNROLL as i32)
            .map(|u| {
                let exists = k.setp(Cmp::Lt, u, left);
                let at = k.min(last, u);
                let at = k.cvt_u64_u32(at.cast::<U32>());
                let lse = k.mad(at, lse_step, lse_at);
                let row = k.mad(at, part_step, row_at);
                (exists, lse, row)
            })
            .collect();
        let raw: Vec<(Reg<F32>, Vec<Reg<F32>>)> = shards
            .iter()
            .map(|&(_, lse, row)| {
                let l = k.ld_global::<F32>(lse, 0);
                (l, load_row(k, cfg.input, row, cpl))
            })
            .collect();
        let lses: Vec<Reg<F32>> = shards
            .iter()
            .zip(&raw)
            .map(|(&(exists, _, _), &(l, _))| k.selp(l, f32::NEG_INFINITY, exists))
            .collect();
        // The new running max; measured from 0 while no shard has weight (every
        // exponent below is then of −∞, never −∞ − (−∞)).
        let mut grown = m;
        for &l in &lses {
            grown = k.max(grown, l);
        }
        let none = k.setp(Cmp::Eq, grown, f32::NEG_INFINITY);
        let base = k.selp(0f32, grown, none);
        let weight = |k: &mut Kernel, x: Reg<F32>| {
            let x = k.sub(x, base);
            let x = k.mul(x, std::f32::consts::LOG2_E);
            k.ex2(x)
        };
        let rescale = weight(k, m);
        k.mul_to(total, total, rescale);
        for &a in &acc {
            k.mul_to(a, a, rescale);
        }
        k.mov_to(m, grown);
        for (l, (_, vals)) in lses.into_iter().zip(raw) {
            let w = weight(k, l);
            k.add_to(total, total, w);
            let weighs = k.setp(Cmp::Gt, w, 0f32);
            for (&a, v) in acc.iter().zip(vals) {
                let v = k.selp(v, 0f32, weighs);
                k.mad_to(a, v, w, a);
            }
        }
        let lse_jump = k.mul(lse_step, u64::from(UNROLL));
        let part_jump = k.mul(part_step, u64::from(UNROLL));
        k.add_to(lse_at, lse_at, lse_jump);
        k.add_to(row_at, row_at, part_jump);
    });

    k.comment("The warps' partial sums meet in shared memory; warp 0 finishes the row.");
    // (Lanes past the row's columns use the last lane's slot: they store nothing, and warp
    // 0's reads of them stay inside the buffer.)
    let col4 = k.mul(col_lane, cpl * 4);
    let at = k.mad(warp, cfg.head_dim * 4, col4);
    let at = k.smem_offset(shared.sums, at);
    k.if_(active, |k| {
        for (i, &a) in acc.iter().enumerate() {
            k.st_shared(at, (4 * i) as i32, a);
        }
    });
    let lane0 = k.setp(Cmp::Eq, lane, 0u32);
    let total_at = k.mul(warp, 4u32);
    let total_at = k.smem_offset(shared.totals, total_at);
    k.guarded(lane0, true, |k| {
        k.st_shared(total_at, 0, total);
        k.st_shared(total_at, (4 * WARPS) as i32, m);
    });
    k.sync_threads();
    let first = k.setp(Cmp::Eq, warp, 0u32);
    k.if_(first, |k| {
        let (lse_index, b64, s64, holds) = match packed {
            None => (lse_index, b64, s64, None),
            Some(row) => {
                // Row (0, cu[b] + s, h) of O; h · total + cu[b] + s of the LSE.
                let zero = k.mov(0u64);
                let total = arg::<U32>(k, args, offset_of!(MergeArgs, total));
                let index = k.mul_wide_u32(h, total);
                let index = k.add(index, row.at);
                (index, zero, row.at, Some(row.holds))
            }
        };
        finish_row(
            k,
            cfg,
            args,
            shared,
            [lane, col4],
            lse_index,
            [b64, s64, h64, c],
            active,
            holds,
        )
    });
}

/// Where a packed output takes row `(b, s)` of the shards.
#[derive(Clone, Copy)]
struct PackedRow {
    /// Row `cu[b] + s` of the output.
    at: Reg<U64>,
    /// `s` is one of sequence `b`'s rows.
    holds: Reg<Pred>,
}

impl PackedRow {
    fn load(k: &mut Kernel, args: ParamBytes, b: Reg<U32>, s: Reg<U32>) -> PackedRow {
        let cu = arg::<U64>(k, args, offset_of!(MergeArgs, cu_seqlens));
        let at = k.mul_wide_u32(b, 4u32);
        let total = |k: &mut Kernel| arg::<S32>(k, args, offset_of!(MergeArgs, total));
        let (start, end) = clamped_offsets(k, cu, at, total);
        let rows = k.sub(end, start);
        let holds = k.setp(Cmp::Lt, s.cast::<S32>(), rows);
        // A sequence past `seqlen` rows, where those are another launch's: none.
        let skips = arg::<U32>(k, args, offset_of!(MergeArgs, skip_longer));
        let skips = k.setp(Cmp::Ne, skips, 0u32);
        let seqlen = arg::<S32>(k, args, offset_of!(MergeArgs, seqlen));
        let most = k.selp(seqlen, i32::MAX, skips);
        let ours = k.setp(Cmp::Le, rows, most);
        let holds = k.and_pred(holds, ours);
        let row = k.add(start.cast::<U32>(), s);
        PackedRow {
            at: k.cvt_u64_u32(row),
            holds,
        }
    }
}

/// Warp 0: weighs the warps' partial sums by `exp(m_w − M)`, adds them, normalises,
/// stores O and the LSE.
#[allow(clippy::too_many_arguments)]
fn finish_row(
    k: &mut Kernel,
    cfg: &MergeConfig,
    args: ParamBytes,
    shared: Shared,
    [lane, col4]: [Reg<U32>; 2],
    lse_index: Reg<U64>,
    [b64, s64, h64, c]: [Reg<U64>; 4],
    active: Reg<Pred>,
    holds: Option<Reg<Pred>>,
) {
    // `active`: the lane holds columns; `holds` (packed outputs): the row is written.
    let active = match holds {
        Some(h) => k.and_pred(active, h),
        None => active,
    };
    let cpl = cfg.cols_per_lane();
    let maxima: Vec<Reg<F32>> = (0..WARPS)
        .map(|w| k.ld_shared::<F32>(shared.totals, (4 * (WARPS + w)) as i32))
        .collect();
    let mut top = maxima[0];
    for &mw in &maxima[1..] {
        top = k.max(top, mw);
    }
    // M, or 0 for a row no shard saw (the warps' weights are then all 0).
    let none = k.setp(Cmp::Eq, top, f32::NEG_INFINITY);
    let m = k.selp(0f32, top, none);
    let acc: Vec<Reg<F32>> = (0..cpl).map(|_| k.mov(0f32)).collect();
    let total = k.mov(0f32);
    for (w, mw) in (0..WARPS).zip(maxima) {
        let x = k.sub(mw, m);
        let x = k.mul(x, std::f32::consts::LOG2_E);
        let f = k.ex2(x);
        let at = k.smem_offset(shared.sums, col4);
        let vals: Vec<Reg<F32>> = (0..cpl)
            .map(|i| k.ld_shared::<F32>(at, (w * cfg.head_dim * 4 + 4 * i) as i32))
            .collect();
        for (&a, v) in acc.iter().zip(vals) {
            k.mad_to(a, v, f, a);
        }
        let t = k.ld_shared::<F32>(shared.totals, (4 * w) as i32);
        k.mad_to(total, t, f, total);
    }
    k.comment("Normalise and store O; LSE = M + ln sum w_i (-inf for a row no shard saw).");
    let empty = k.setp(Cmp::Eq, total, 0f32);
    let inv = k.rcp(total);
    let inv = k.selp(0f32, inv, empty);
    for &a in &acc {
        k.mul_to(a, a, inv);
    }
    let out = arg::<U64>(k, args, offset_of!(MergeArgs, out));
    let os: [Reg<U64>; 3] =
        std::array::from_fn(|i| arg::<U64>(k, args, offset_of!(MergeArgs, out_stride) + 8 * i));
    let e = k.mul(b64, os[0]);
    let e = k.mad(s64, os[1], e);
    let e = k.mad(h64, os[2], e);
    let e = k.add(e, c);
    let e = k.mul(e, u64::from(cfg.output.bytes()));
    let out_row = k.add(out, e);
    k.if_(active, |k| store_row(k, cfg.output, out_row, &acc));

    let out_lse = arg::<U64>(k, args, offset_of!(MergeArgs, out_lse));
    let ln_sum = k.lg2(total);
    let ln_sum = k.mul(ln_sum, std::f32::consts::LN_2);
    let lse = k.add(m, ln_sum);
    let lse = k.selp(f32::NEG_INFINITY, lse, empty);
    let wanted = k.setp(Cmp::Ne, out_lse, 0u64);
    let lane0 = k.setp(Cmp::Eq, lane, 0u32);
    let wanted = k.and_pred(wanted, lane0);
    let wanted = match holds {
        Some(h) => k.and_pred(wanted, h),
        None => wanted,
    };
    let at = k.shl(lse_index, 2);
    let at = k.add(out_lse, at);
    k.guarded(wanted, true, |k| k.st_global(at, 0, lse));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_cover_each_row_exactly() {
        for cfg in all_merge_configs() {
            let cpl = cfg.cols_per_lane();
            assert_eq!(cpl % 2, 0, "{}", cfg.id());
            assert_eq!(cfg.head_dim % cpl, 0, "{}", cfg.id());
            assert!(cfg.head_dim / cpl <= 32, "{}", cfg.id());
        }
        let d = |head_dim| MergeConfig {
            input: MergeType::F32,
            output: MergeType::F16,
            head_dim,
            programmatic: false,
            padded: false,
            packed: false,
        };
        assert_eq!(d(128).cols_per_lane(), 4);
        assert_eq!(d(96).cols_per_lane(), 4);
        assert_eq!(d(32).cols_per_lane(), 2);
        assert_eq!(d(192).cols_per_lane(), 6);
    }

    /// Every multiple of 8 up to 256 merges on a kernel whose lanes take a whole number
    /// of its columns (80 on the padded 96 kernel, four columns a lane); a padded kernel
    /// counts its lanes from its second parameter.
    #[test]
    fn every_multiple_of_8_has_a_kernel() {
        let listed = all_merge_configs();
        for d in (8..=256u32).step_by(8) {
            let (head_dim, padded) = kernel_head_dim(d as usize).unwrap();
            assert!(head_dim >= d && padded == (head_dim != d), "{d}");
            for programmatic in [false, true] {
                let cfg = MergeConfig {
                    input: MergeType::F32,
                    output: MergeType::F16,
                    head_dim,
                    programmatic,
                    padded,
                    packed: false,
                };
                assert!(listed.contains(&cfg), "{d}: {}", cfg.id());
                let cpl = cfg.cols_per_lane();
                assert_eq!(d % cpl, 0, "{d}");
                assert!(cpl.is_power_of_two() || !padded, "{d}");
                assert!(d / cpl <= 32, "{d}");
            }
        }
        assert_eq!(kernel_head_dim(80), Some((96, true)));
        assert_eq!(kernel_head_dim(136), Some((256, true)));
        assert_eq!(kernel_head_dim(192), Some((192, false)));
        for d in [0, 12, 84, 264] {
            assert_eq!(kernel_head_dim(d), None, "{d}");
        }
        for cfg in listed.iter().filter(|c| c.padded) {
            let ptx = cfg.generate().unwrap().to_ptx();
            assert!(ptx.contains(".param .u32 head_dim"), "{}", cfg.id());
            let plain = MergeConfig {
                padded: false,
                packed: false,
                ..*cfg
            };
            assert!(!plain.generate().unwrap().to_ptx().contains("head_dim"));
        }
    }

    #[test]
    fn the_programmatic_combine_waits_for_its_inputs_first() {
        let plain = MergeConfig {
            input: MergeType::F32,
            output: MergeType::Bf16,
            head_dim: 128,
            programmatic: false,
            padded: false,
            packed: false,
        };
        let chained = MergeConfig {
            programmatic: true,
            ..plain
        };
        assert_eq!(chained.id(), "attn_merge_f32_to_bf16_d128_pdl");
        let text = |c: MergeConfig| c.generate().unwrap().to_ptx();
        let (plain, chained) = (text(plain), text(chained));
        assert!(!plain.contains("griddepcontrol") && plain.contains(".target sm_80"));
        assert!(chained.contains(".target sm_90"));
        // The wait comes before the first global load.
        let wait = chained.find("griddepcontrol.wait;").expect("no wait");
        let load = chained.find("ld.global").expect("no load");
        assert!(wait < load);
    }

    /// A shard's LSE is loaded beside its row, in the one loop over the shards: no pass
    /// over the LSEs first (that cost a memory latency per merge).
    #[test]
    fn each_shard_is_read_in_one_pass() {
        for cfg in all_merge_configs() {
            let ptx = cfg.generate().unwrap().to_ptx();
            // A packed output's two offsets (32-bit words; its shards are float32) are
            // loaded first, beside the row's setup, outside the loop.
            let ptx = if cfg.packed {
                assert_eq!(ptx.matches("ld.global.b32").count(), 2, "{}", cfg.id());
                &ptx[ptx.rfind("ld.global.b32").unwrap() + 1..]
            } else {
                &ptx[..]
            };
            // Every load (LSEs and rows of a step's shards) is issued in one loop, before
            // the first exponential.
            let first_load = ptx.find("ld.global").unwrap();
            let last_load = ptx.rfind("ld.global").unwrap();
            let first_exp = ptx.find("ex2.approx").unwrap();
            assert!(last_load < first_exp, "{}", cfg.id());
            assert!(
                !ptx[first_load..last_load].contains("$L_"),
                "{}: loads in more than one loop",
                cfg.id()
            );
        }
    }
}
