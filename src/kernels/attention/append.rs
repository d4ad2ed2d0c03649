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

use std::mem::offset_of;

use crate::ptx::{
    B32, Cmp, Kernel, KernelText, Module, ParamBytes, PtxError, PtxType, Reg, S32, Special, Target,
    U32, U64,
};

/// Threads per block.
pub const THREADS: u32 = 256;

/// One append-kernel configuration (the element type does not matter: rows move as bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AppendConfig {
    pub paged: bool,
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
}

impl AppendArgs {
    pub const SIZE: usize = std::mem::size_of::<AppendArgs>();
}

impl AppendConfig {
    pub fn id(&self) -> String {
        format!("kv_append{}", if self.paged { "_paged" } else { "" })
    }

    pub fn generate(&self) -> Result<Module, PtxError> {
        let mut module = Module::new(Target::Sm80);
        module.push(build(self)?)?;
        Ok(module)
    }
}

pub fn all_append_configs() -> Vec<AppendConfig> {
    vec![AppendConfig { paged: false }, AppendConfig { paged: true }]
}

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

fn strides(k: &mut Kernel, args: ParamBytes, at: usize) -> [Reg<U64>; 3] {
    std::array::from_fn(|i| arg::<U64>(k, args, at + 8 * i))
}

/// `base + 2·(a·s[0] + b·s[1] + c·s[2] + rest)`.
fn address(
    k: &mut Kernel,
    base: Reg<U64>,
    s: &[Reg<U64>; 3],
    [a, b, c]: [Reg<U64>; 3],
    rest: Reg<U64>,
) -> Reg<U64> {
    let e = k.mad(a, s[0], rest);
    let e = k.mad(b, s[1], e);
    let e = k.mad(c, s[2], e);
    let e = k.shl(e, 1);
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
    let chunks = arg::<U32>(&mut k, args, offset_of!(AppendArgs, chunks));
    let heads = arg::<U32>(&mut k, args, offset_of!(AppendArgs, heads));
    let new_tokens = arg::<U32>(&mut k, args, offset_of!(AppendArgs, new_tokens));
    let capacity = arg::<S32>(&mut k, args, offset_of!(AppendArgs, capacity));
    let seqlens = arg::<U64>(&mut k, args, offset_of!(AppendArgs, seqlens));
    let page_shift = arg::<U32>(&mut k, args, offset_of!(AppendArgs, page_shift));
    let pool_pages = arg::<U32>(&mut k, args, offset_of!(AppendArgs, pool_pages));
    let table = arg::<U64>(&mut k, args, offset_of!(AppendArgs, block_table));
    let table_stride = arg::<U64>(&mut k, args, offset_of!(AppendArgs, block_table_stride));
    let one = k.mov(1i32);
    let page_mask = k.shl_by(one, page_shift);
    let page_mask = k.sub(page_mask, 1i32);

    k.for_stride(first, total, stride, |k, i| {
        let i = i.cast::<U32>();
        let t = k.div(i, chunks);
        let c = k.mad(t, chunks, 0u32);
        let c = k.sub(i, c);
        let bj = k.div(t, heads);
        let h = k.mad(bj, heads, 0u32);
        let h = k.sub(t, h);
        let b = k.div(bj, new_tokens);
        let j = k.mad(b, new_tokens, 0u32);
        let j = k.sub(bj, j);

        let at = k.mul_wide_u32(b, 4u32);
        let at = k.add(seqlens, at);
        let len = k.ld_global::<S32>(at, 0);
        let pos = k.add(len, j.cast::<S32>());
        let low = k.setp(Cmp::Ge, pos, 0i32);
        let high = k.setp(Cmp::Lt, pos, capacity);
        let ok = k.and_pred(low, high);
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
                let index = k.shr_by(pos.cast::<U32>(), page_shift);
                let index = k.cvt_u64_u32(index);
                let entry = k.mad(b64, table_stride, index);
                let entry = k.shl(entry, 2);
                let entry = k.add(table, entry);
                let page = k.ld_global::<U32>(entry, 0);
                let inside = k.setp(Cmp::Lt, page, pool_pages);
                k.if_(inside, |k| {
                    let row = k.and(pos, page_mask);
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
