//! KV caches as the serving kernels see them: contiguous per sequence or paged, with
//! per-sequence lengths on the device, and the checks every call on one runs first.
//!
//! The lengths and the block table live in device memory (a captured CUDA graph reads
//! them as they are when it replays), so the host cannot read them on every call. What
//! the host can check, it checks: shapes, strides, alignment, the page size, capacities.
//! The kernels never read or write outside the cache whatever the device metadata holds:
//! lengths are clamped to the capacity, block table entries outside the pool are never
//! followed. A caller that keeps host copies of the metadata passes them as
//! [`HostMetadata`] and gets a typed error, with nothing launched, for a length beyond
//! the capacity or an entry outside the pool.

use crate::error::{Error, Result};
use crate::host::tensor::TensorView;
use crate::host::validate::{
    TENSOR_ALIGN, byte_range_of, check_not_empty, check_pointer, check_strides,
};

/// Page sizes a paged cache may use: powers of two from 1 to 1024 tokens.
pub const PAGE_SIZES: std::ops::RangeInclusive<usize> = 1..=1024;
/// The most positions one sequence of a cache may hold: 2^30.
pub const MAX_CAPACITY: usize = 1 << 30;

/// How a cache's positions map to memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheLayout {
    /// `k`, `v`: `[B, capacity, Hkv, D]`.
    Contiguous,
    /// `k`, `v`: pools `[pages, page_size, Hkv, D]`; `block_table` is device int32
    /// `[B, max_pages]` (rows `table_stride` elements apart): position `p` of sequence
    /// `b` lives in page `block_table[b][p / page_size]`, row `p % page_size`.
    Paged {
        block_table: u64,
        max_pages: usize,
        table_stride: usize,
    },
}

impl CacheLayout {
    /// The block table's address and row stride as the kernels take them: (0, 0) for a
    /// contiguous cache.
    pub fn table(&self) -> (u64, u64) {
        match *self {
            CacheLayout::Paged {
                block_table,
                table_stride,
                ..
            } => (block_table, table_stride as u64),
            CacheLayout::Contiguous => (0, 0),
        }
    }
}

/// A KV cache of a batch of sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCache {
    pub k: TensorView,
    pub v: TensorView,
    /// Device int32 `[B]`: each sequence's length.
    pub seqlens: u64,
    pub layout: CacheLayout,
}

/// Host copies of a cache's device metadata, checked before a launch when given.
#[derive(Debug, Clone, Copy)]
pub struct HostMetadata<'a> {
    /// `[B]`, as on the device.
    pub seqlens: &'a [i32],
    /// `[B, table_stride]` (paged caches), as on the device.
    pub block_table: Option<&'a [i32]>,
}

/// What validation learned about a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub batch: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Positions per sequence.
    pub capacity: usize,
    /// Tokens per page (paged caches), else 0.
    pub page_size: usize,
    /// Pages in the pool (paged caches), else 0.
    pub pool_pages: usize,
}

impl CacheShape {
    pub fn page_shift(&self) -> u32 {
        if self.page_size == 0 {
            0
        } else {
            self.page_size.trailing_zeros()
        }
    }
}

impl KvCache {
    /// Checks the cache of a batch of `batch` sequences (every rule but those on the
    /// device metadata's contents): dtypes equal and 16-bit, k and v of one shape, no
    /// empty dimension, strides and pointers as the kernels need, the page size, the
    /// capacity, the metadata pointers.
    pub fn validate(&self, batch: usize) -> Result<CacheShape> {
        let (k, v) = (&self.k, &self.v);
        if k.dtype != v.dtype || k.dtype.half_type().is_none() {
            return Err(Error::UnsupportedDType(format!(
                "the cache's k and v must share one dtype, f16 or bf16; got k {}, v {}",
                k.dtype, v.dtype
            )));
        }
        for (name, t) in [("k_cache", k), ("v_cache", v)] {
            check_not_empty(name, t)?;
        }
        if v.shape != k.shape {
            return Err(Error::ShapeMismatch(format!(
                "v_cache has shape {:?} but k_cache has {:?}; they must be equal",
                v.shape, k.shape
            )));
        }
        let [outer, rows, heads_kv, head_dim] = k.shape;
        let (capacity, page_size, pool_pages) = match self.layout {
            CacheLayout::Contiguous => {
                if outer != batch {
                    return Err(Error::ShapeMismatch(format!(
                        "the cache holds {outer} sequences but the batch has {batch}"
                    )));
                }
                (rows, 0, 0)
            }
            CacheLayout::Paged {
                block_table,
                max_pages,
                table_stride,
            } => {
                if !rows.is_power_of_two() || !PAGE_SIZES.contains(&rows) {
                    return Err(Error::InvalidArgument(format!(
                        "page size {rows} is not a power of two from {} to {}",
                        PAGE_SIZES.start(),
                        PAGE_SIZES.end()
                    )));
                }
                check_pointer("block_table", block_table, 4)?;
                if max_pages == 0 {
                    return Err(Error::EmptyDimension {
                        tensor: "block_table",
                        dim: "max_pages",
                    });
                }
                if table_stride < max_pages {
                    return Err(Error::BadStrides {
                        tensor: "block_table",
                        reason: format!(
                            "row stride {table_stride} is shorter than a row ({max_pages} pages)"
                        ),
                    });
                }
                let capacity = max_pages.saturating_mul(rows);
                (capacity, rows, outer)
            }
        };
        if capacity > MAX_CAPACITY {
            return Err(Error::InvalidArgument(format!(
                "a sequence may hold at most {MAX_CAPACITY} positions (2^30), the cache holds \
                 {capacity}"
            )));
        }
        if pool_pages > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "{pool_pages} pages exceed the 2^32 a block table can name"
            )));
        }
        for (name, t) in [("k_cache", k), ("v_cache", v)] {
            check_pointer(name, t.ptr, TENSOR_ALIGN)?;
            check_strides(name, t)?;
            byte_range_of(name, t)?;
        }
        check_pointer("seqlens", self.seqlens, 4)?;
        Ok(CacheShape {
            batch,
            heads_kv,
            head_dim,
            capacity,
            page_size,
            pool_pages,
        })
    }

    /// The device byte ranges the cache's kernels may write or read: K, V, the lengths
    /// and the block table.
    pub fn byte_ranges(&self, batch: usize) -> Vec<(&'static str, (u64, u64))> {
        let mut v = Vec::with_capacity(4);
        for (name, t) in [("k_cache", &self.k), ("v_cache", &self.v)] {
            if let Some(r) = t.byte_range() {
                v.push((name, r));
            }
        }
        v.push(("seqlens", (self.seqlens, self.seqlens + 4 * batch as u64)));
        if let CacheLayout::Paged {
            block_table,
            table_stride,
            ..
        } = self.layout
        {
            let bytes = 4 * (table_stride as u64) * batch as u64;
            v.push((
                "block_table",
                (block_table, block_table.saturating_add(bytes)),
            ));
        }
        v
    }
}

impl HostMetadata<'_> {
    /// Checks the lengths (after `extra` more tokens: an append's) against the capacity
    /// and, for a paged cache, that every page they reach is inside the pool.
    pub fn check(&self, cache: &KvCache, shape: &CacheShape, extra: usize) -> Result<()> {
        if self.seqlens.len() != shape.batch {
            return Err(Error::ShapeMismatch(format!(
                "{} host lengths for a batch of {}",
                self.seqlens.len(),
                shape.batch
            )));
        }
        for (b, &len) in self.seqlens.iter().enumerate() {
            let end = usize::try_from(len).ok().map(|l| l + extra);
            match end {
                Some(end) if end <= shape.capacity => {}
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "sequence {b} has length {len}{}, beyond the cache's capacity of {}",
                        if extra > 0 {
                            format!(" + {extra} new tokens")
                        } else {
                            String::new()
                        },
                        shape.capacity
                    )));
                }
            }
        }
        let CacheLayout::Paged {
            max_pages,
            table_stride,
            ..
        } = cache.layout
        else {
            return Ok(());
        };
        let Some(table) = self.block_table else {
            return Err(Error::InvalidArgument(
                "a paged cache's host metadata needs its block table".into(),
            ));
        };
        let need = (shape.batch - 1) * table_stride + max_pages;
        if table.len() < need {
            return Err(Error::ShapeMismatch(format!(
                "the host block table has {} entries, the batch needs {need}",
                table.len()
            )));
        }
        for (b, &len) in self.seqlens.iter().enumerate() {
            let pages = (len as usize + extra).div_ceil(shape.page_size);
            let row = &table[b * table_stride..b * table_stride + pages];
            if let Some((i, &p)) = row
                .iter()
                .enumerate()
                .find(|&(_, &p)| p < 0 || p as usize >= shape.pool_pages)
            {
                return Err(Error::InvalidArgument(format!(
                    "block_table[{b}][{i}] = {p} is outside the pool of {} pages",
                    shape.pool_pages
                )));
            }
        }
        Ok(())
    }
}
