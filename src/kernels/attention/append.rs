//! Appending new tokens' keys and values to a KV cache (`.target sm_80`).
//!
//! Token `j` of sequence `b`'s `Sq` new tokens goes to position `len_b + j`, where `len_b`
//! is the sequence's length before the append (read from the device, so a captured graph
//! appends wherever the sequence has got to). The cache is contiguous `[B, capacity, Hkv,
//! D]` or a paged pool with a block table, as for decode. Positions outside the cache
//! and block table entries outside the pool are never written.
//!
//! One thread copies one 16-byte chunk of a row of K and the same chunk of V; the grid
//! strides over all `B · Sq · Hkv · D/8` chunks.
//!
//! **e4m3 caches** (`.target sm_89`): the thread holds 8 values of a row instead, the
//! `D/8` threads of a row (8, 16 or 32 lanes of one warp) agree on the row's absolute
//! maximum by shuffles, and each writes its 8 codes (`cvt.rn.satfinite`, scale `amax /
//! 448`, the amax over the row's finite values; NaN codes for the others, as in
//! [`crate::quant::quantize_value`]); the row's first thread writes the scale. Whole
//! warps run the loop together so the shuffles always have every lane.

use std::mem::offset_of;

use super::HalfType;
use crate::kernels::quantize::{block_scale, fold_amax, scaled};
use crate::ptx::{
    B32, Bf16x2, Cmp, F16x2, F32, Half2, Kernel, KernelText, Module, ParamBytes, Pred, PtxError,
    PtxType, Reg, S32, Special, Target, U32, U64,
};

/// Threads per block.
pub const THREADS: u32 = 256;

/// One append-kernel configuration (for a 16-bit cache the element type does not
/// matter: rows move as bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AppendConfig {
    pub paged: bool,
    /// An e4m3 cache, fed new tokens of this type; `None`: a 16-bit cache.
    pub fp8_from: Option<HalfType>,
}

/// The by-value argument block of the append kernel; strides in elements (batch or page,
/// position, head).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AppendArgs {
    pub k_new: u64,
    pub v_new: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub seqlens: u64,
    pub block_table: u64,
    pub k_new_stride: [u64; 3],
    pub v_new_stride: [u64; 3],
    pub k_cache_stride: [u64; 3],
    pub v_cache_stride: [u64; 3],
    pub block_table_stride: u64,
    pub new_tokens: u32,
    pub heads: u32,
    /// 16-byte chunks per row (`D / 8`).
    pub chunks: u32,
    pub capacity: u32,
    pub pool_pages: u32,
    pub page_shift: u32,
    /// `B · Sq · Hkv · D/8`, below 2^31.
    pub total: u32,
    pub _pad: u32,
    /// e4m3 cache: its float32 scales, strided like its first three dims (elements).
    pub k_scale: u64,
    pub v_scale: u64,
    pub k_scale_stride: [u64; 3],
    pub v_scale_stride: [u64; 3],
}

impl AppendArgs {
    pub const SIZE: usize = std::mem::size_of::<AppendArgs>();
}

impl AppendConfig {
    /// `kv_append[_paged]`, `kv_append_e4m3_from_bf16[_paged]`.
    pub fn id(&self) -> String {
        format!(
            "kv_append{}{}",
            match self.fp8_from {
                Some(t) => format!("_e4m3_from_{}", t.name()),
                None => String::new(),
            },
            if self.paged { "_paged" } else { "" }
        )
    }

    pub fn generate(&self) -> Result<Module, PtxError> {
        let (target, kernel) = match self.fp8_from {
            None => (Target::Sm80, build(self)?),
            Some(HalfType::F16) => (Target::Sm89, build_fp8::<F16x2>(self)?),
            Some(HalfType::Bf16) => (Target::Sm89, build_fp8::<Bf16x2>(self)?),
        };
        let mut module = Module::new(target);
        module.push(kernel)?;
        Ok(module)
    }
}

pub fn all_append_configs() -> Vec<AppendConfig> {
    let mut v = Vec::new();
    for fp8_from in [None, Some(HalfType::F16), Some(HalfType::Bf16)] {
        for paged in [false, true] {
            v.push(AppendConfig { paged, fp8_from });
        }
    }
    v
}

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

fn strides(k: &mut Kernel, args: ParamBytes, at: usize) -> [Reg<U64>; 3] {
    std::array::from_fn(|i| arg::<U64>(k, args, at + 8 * i))
}

/// The launch's geometry and cache metadata, read once from the argument block.
struct Geometry {
    chunks: Reg<U32>,
    heads: Reg<U32>,
    new_tokens: Reg<U32>,
    capacity: Reg<S32>,
    seqlens: Reg<U64>,
    page_shift: Reg<U32>,
    pool_pages: Reg<U32>,
    table: Reg<U64>,
    table_stride: Reg<U64>,
    page_mask: Reg<S32>,
}

/// Where chunk `i` of the grid belongs: chunk `c` of head `h` of new token `j` of
/// sequence `b`, at cache position `pos`, which `ok` says is inside `[0, capacity)`.
struct Chunk {
    c: Reg<U32>,
    h: Reg<U32>,
    b: Reg<U32>,
    j: Reg<U32>,
    pos: Reg<S32>,
    ok: Reg<Pred>,
}

impl Geometry {
    fn load(k: &mut Kernel, args: ParamBytes) -> Geometry {
        let chunks = arg::<U32>(k, args, offset_of!(AppendArgs, chunks));
        let heads = arg::<U32>(k, args, offset_of!(AppendArgs, heads));
        let new_tokens = arg::<U32>(k, args, offset_of!(AppendArgs, new_tokens));
        let capacity = arg::<S32>(k, args, offset_of!(AppendArgs, capacity));
        let seqlens = arg::<U64>(k, args, offset_of!(AppendArgs, seqlens));
        let page_shift = arg::<U32>(k, args, offset_of!(AppendArgs, page_shift));
        let pool_pages = arg::<U32>(k, args, offset_of!(AppendArgs, pool_pages));
        let table = arg::<U64>(k, args, offset_of!(AppendArgs, block_table));
        let table_stride = arg::<U64>(k, args, offset_of!(AppendArgs, block_table_stride));
        let one = k.mov(1i32);
        let page_mask = k.shl_by(one, page_shift);
        let page_mask = k.sub(page_mask, 1i32);
        Geometry {
            chunks,
            heads,
            new_tokens,
            capacity,
            seqlens,
            page_shift,
            pool_pages,
            table,
            table_stride,
            page_mask,
        }
    }

    /// Decomposes grid chunk `i` (`((b·Sq + j)·Hkv + h)·chunks + c`) and reads the
    /// sequence's length to find the position.
    fn chunk(&self, k: &mut Kernel, i: Reg<U32>) -> Chunk {
        let t = k.div(i, self.chunks);
        let c = k.mad(t, self.chunks, 0u32);
        let c = k.sub(i, c);
        let bj = k.div(t, self.heads);
        let h = k.mad(bj, self.heads, 0u32);
        let h = k.sub(t, h);
        let b = k.div(bj, self.new_tokens);
        let j = k.mad(b, self.new_tokens, 0u32);
        let j = k.sub(bj, j);

        let at = k.mul_wide_u32(b, 4u32);
        let at = k.add(self.seqlens, at);
        let len = k.ld_global::<S32>(at, 0);
        // Clamped below as the decode kernels clamp it (above, positions past the
        // capacity are not written).
        let len = k.max(len, 0i32);
        let pos = k.add(len, j.cast::<S32>());
        // Only a length within `Snew` of 2^31, whose sum wraps, fails this.
        let low = k.setp(Cmp::Ge, pos, 0i32);
        let high = k.setp(Cmp::Lt, pos, self.capacity);
        let ok = k.and_pred(low, high);
        Chunk {
            c,
            h,
            b,
            j,
            pos,
            ok,
        }
    }
}

/// `base + 2·(a·s[0] + b·s[1] + c·s[2] + rest)`.
fn address(
    k: &mut Kernel,
    base: Reg<U64>,
    s: &[Reg<U64>; 3],
    idx: [Reg<U64>; 3],
    rest: Reg<U64>,
) -> Reg<U64> {
    address_of(k, base, s, idx, rest, 1)
}

/// `base + (a·s[0] + b·s[1] + c·s[2] + rest) << elem_shift`.
fn address_of(
    k: &mut Kernel,
    base: Reg<U64>,
    s: &[Reg<U64>; 3],
    [a, b, c]: [Reg<U64>; 3],
    rest: Reg<U64>,
    elem_shift: u32,
) -> Reg<U64> {
    let e = k.mad(a, s[0], rest);
    let e = k.mad(b, s[1], e);
    let e = k.mad(c, s[2], e);
    let e = k.shl(e, elem_shift);
    k.add(base, e)
}

fn build(cfg: &AppendConfig) -> Result<KernelText, PtxError> {
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(THREADS);
    let args = k.param_bytes("args", AppendArgs::SIZE, 8);
    let tid = k.special(Special::TidX);
    let block = k.special(Special::CtaidX);
    let blocks = k.special(Special::NctaidX);
    let first = k.mad(block, THREADS, tid).cast::<S32>();
    let stride = k.mul(blocks, THREADS).cast::<S32>();
    let total = arg::<S32>(&mut k, args, offset_of!(AppendArgs, total));
    let g = Geometry::load(&mut k, args);

    k.for_stride(first, total, stride, |k, i| {
        let i = i.cast::<U32>();
        let Chunk {
            c,
            h,
            b,
            j,
            pos,
            ok,
        } = g.chunk(k, i);
        k.if_(ok, |k| {
            let chunk = k.cvt_u64_u32(c);
            let chunk = k.shl(chunk, 3);
            let b64 = k.cvt_u64_u32(b);
            let j64 = k.cvt_u64_u32(j);
            let h64 = k.cvt_u64_u32(h);
            let copy = |k: &mut Kernel, row: Reg<U64>, page: Reg<U64>| {
                for (src, src_s, dst, dst_s) in [
                    (
                        offset_of!(AppendArgs, k_new),
                        offset_of!(AppendArgs, k_new_stride),
                        offset_of!(AppendArgs, k_cache),
                        offset_of!(AppendArgs, k_cache_stride),
                    ),
                    (
                        offset_of!(AppendArgs, v_new),
                        offset_of!(AppendArgs, v_new_stride),
                        offset_of!(AppendArgs, v_cache),
                        offset_of!(AppendArgs, v_cache_stride),
                    ),
                ] {
                    let src_base = arg::<U64>(k, args, src);
                    let ss = strides(k, args, src_s);
                    let from = address(k, src_base, &ss, [b64, j64, h64], chunk);
                    let dst_base = arg::<U64>(k, args, dst);
                    let ds = strides(k, args, dst_s);
                    let to = address(k, dst_base, &ds, [page, row, h64], chunk);
                    let words = k.ld_global_v4::<B32>(from, 0);
                    k.st_global_v4::<B32>(to, 0, words);
                }
            };
            if cfg.paged {
                let index = k.shr_by(pos.cast::<U32>(), g.page_shift);
                let index = k.cvt_u64_u32(index);
                let entry = k.mad(b64, g.table_stride, index);
                let entry = k.shl(entry, 2);
                let entry = k.add(g.table, entry);
                let page = k.ld_global::<U32>(entry, 0);
                let inside = k.setp(Cmp::Lt, page, g.pool_pages);
                k.if_(inside, |k| {
                    let row = k.and(pos, g.page_mask);
                    let row = k.cvt_u64_u32(row.cast::<U32>());
                    let page = k.cvt_u64_u32(page);
                    copy(k, row, page);
                });
            } else {
                let row = k.cvt_u64_u32(pos.cast::<U32>());
                copy(k, row, b64);
            }
        });
    });
    k.finish()
}

/// The e4m3 append: see the module docs.
fn build_fp8<H: Half2>(cfg: &AppendConfig) -> Result<KernelText, PtxError> {
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(THREADS);
    let args = k.param_bytes("args", AppendArgs::SIZE, 8);
    let tid = k.special(Special::TidX);
    let block = k.special(Special::CtaidX);
    let blocks = k.special(Special::NctaidX);
    let lane = k.and(tid, 31u32);
    let first = k.mad(block, THREADS, tid).cast::<S32>();
    let stride = k.mul(blocks, THREADS).cast::<S32>();
    let total = arg::<S32>(&mut k, args, offset_of!(AppendArgs, total));
    // Whole warps iterate: the loop runs to `total` rounded up to 32.
    let padded = k.add(total, 31i32);
    let padded = k.and(padded.cast::<U32>(), !31u32).cast::<S32>();
    let last = k.sub(total, 1i32);
    let g = Geometry::load(&mut k, args);
    // The row's lanes: `chunks` (8, 16 or 32) consecutive lanes, aligned.
    let in_row = k.sub(g.chunks, 1u32);
    let row_lane = k.and(lane, in_row);
    let row_first = k.setp(Cmp::Eq, row_lane, 0u32);

    k.for_stride(first, padded, stride, |k, i| {
        let valid = k.setp(Cmp::Lt, i, total);
        let i = k.min(i, last).cast::<U32>();
        let Chunk {
            c,
            h,
            b,
            j,
            pos,
            ok,
        } = g.chunk(k, i);
        let ok = k.and_pred(ok, valid);
        let b64 = k.cvt_u64_u32(b);
        let j64 = k.cvt_u64_u32(j);
        let h64 = k.cvt_u64_u32(h);
        // Where the row goes: (page, row in page) or (batch, position).
        let (outer, row, ok) = if cfg.paged {
            let page = k.mov(0u32);
            k.if_(ok, |k| {
                let index = k.shr_by(pos.cast::<U32>(), g.page_shift);
                let index = k.cvt_u64_u32(index);
                let entry = k.mad(b64, g.table_stride, index);
                let entry = k.shl(entry, 2);
                let entry = k.add(g.table, entry);
                let p = k.ld_global::<U32>(entry, 0);
                k.mov_to(page, p);
            });
            let inside = k.setp(Cmp::Lt, page, g.pool_pages);
            let ok = k.and_pred(ok, inside);
            let row = k.and(pos, g.page_mask);
            (k.cvt_u64_u32(page), k.cvt_u64_u32(row.cast::<U32>()), ok)
        } else {
            let pos = k.max(pos, 0i32);
            (b64, k.cvt_u64_u32(pos.cast::<U32>()), ok)
        };
        let chunk = k.cvt_u64_u32(c);
        let chunk = k.shl(chunk, 3);
        for (src, src_s, dst, dst_s, scales, scales_s) in [
            (
                offset_of!(AppendArgs, k_new),
                offset_of!(AppendArgs, k_new_stride),
                offset_of!(AppendArgs, k_cache),
                offset_of!(AppendArgs, k_cache_stride),
                offset_of!(AppendArgs, k_scale),
                offset_of!(AppendArgs, k_scale_stride),
            ),
            (
                offset_of!(AppendArgs, v_new),
                offset_of!(AppendArgs, v_new_stride),
                offset_of!(AppendArgs, v_cache),
                offset_of!(AppendArgs, v_cache_stride),
                offset_of!(AppendArgs, v_scale),
                offset_of!(AppendArgs, v_scale_stride),
            ),
        ] {
            let src_base = arg::<U64>(k, args, src);
            let ss = strides(k, args, src_s);
            let from = address(k, src_base, &ss, [b64, j64, h64], chunk);
            let words = k.ld_global_v4::<H>(from, 0);
            let values: Vec<Reg<F32>> = words
                .into_iter()
                .flat_map(|w| k.unpack_half2::<H>(w))
                .collect();
            let amax = k.mov(0f32);
            for &v in &values {
                fold_amax(k, amax, v);
            }
            for mask in [1u32, 2, 4, 8, 16] {
                // Lanes `mask` apart share a row when the row has more than `mask` lanes.
                let other = k.shfl_bfly(amax, mask);
                let same_row = k.setp(Cmp::Gt, g.chunks, mask);
                let wider = k.max(amax, other);
                k.selp_to(amax, wider, amax, same_row);
            }
            let (scale, inv) = block_scale(k, amax);
            let codes: Vec<_> = values
                .chunks(2)
                .map(|pair| {
                    let lo = scaled(k, pair[0], inv);
                    let hi = scaled(k, pair[1], inv);
                    k.pack_e4m3x2(lo, hi)
                })
                .collect();
            let w0 = k.join_b16x2(codes[0], codes[1]);
            let w1 = k.join_b16x2(codes[2], codes[3]);
            let dst_base = arg::<U64>(k, args, dst);
            let ds = strides(k, args, dst_s);
            let to = address_of(k, dst_base, &ds, [outer, row, h64], chunk, 0);
            let scale_base = arg::<U64>(k, args, scales);
            let sc = strides(k, args, scales_s);
            let zero = k.mov(0u64);
            let scale_at = address_of(k, scale_base, &sc, [outer, row, h64], zero, 2);
            k.if_(ok, |k| {
                k.st_global(to, 0, w0);
                k.st_global(to, 4, w1);
                k.guarded(row_first, true, |k| k.st_global(scale_at, 0, scale));
            });
        }
    });
    k.finish()
}
