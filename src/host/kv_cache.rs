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
//! the capacity, an entry outside the pool, a page named twice among one sequence's, or
//! an append onto rows of a shared page that another sequence holds or writes.
//!
//! A cache may hold FP8: E4M3 codes in `k` and `v` and, in [`KvScales`], one float32
//! scale per (position, KV head) for each, written by [`crate::host::attention::Attention::append_kv`]
//! from the new tokens' own maxima (a value is its code times its scale). A scale
//! covers one block of `D` values, the finest block there is: an append never has to
//! requantize what is already cached, as a scale shared by several positions would
//! when a later token raised its maximum, and an outlier token costs precision only in
//! its own row.

use crate::error::{Error, Result};
use crate::host::tensor::{DType, TensorView};
use crate::host::validate::{
    TENSOR_ALIGN, byte_range_of, check_no_self_overlap, check_not_empty, check_pointer,
    check_strides, overlaps,
};

/// Page sizes a paged cache may use: powers of two from 1 to 1024 tokens.
pub const PAGE_SIZES: std::ops::RangeInclusive<usize> = 1..=1024;
/// The most positions one sequence of a cache may hold: 2^30.
pub const MAX_CAPACITY: usize = 1 << 30;
/// The most pages a paged cache's pool may have: one fewer than an int32 block table
/// names. The kernels compare entries with the pool's page count as unsigned numbers, so
/// a negative entry (2^31 or more as u32) always lies outside the pool and is never
/// followed; so does `i32::MAX`, which the Hopper producers load for "no page" (TMA then
/// zero-fills the box).
pub const MAX_POOL_PAGES: usize = (1 << 31) - 1;

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
    /// f16, bf16 or (with `scales`) e4m3.
    pub k: TensorView,
    pub v: TensorView,
    /// Device int32 `[B]`: each sequence's length.
    pub seqlens: u64,
    pub layout: CacheLayout,
    /// The dequantization scales of an e4m3 cache; `None` for a 16-bit one.
    pub scales: Option<KvScales>,
}

/// The scales of an FP8 cache: float32 views of shape `[outer, rows, Hkv, 1]`, the
/// cache's own first three dimensions (`[B, capacity, Hkv]` contiguous, `[pages,
/// page_size, Hkv]` paged), so a position's scales live where its codes do. Element
/// `(·, p, h, 0)` of `k` is the scale of key `p`'s head `h`: its values are its codes
/// times it. Strides are free (in elements); pointers 4-byte aligned. Scales are finite
/// and not negative, as an append writes them (`max|x| / 448`, or 1 for a row of zeros):
/// the decode kernels rescale probabilities by V's scales relative to the largest of a
/// tile's, which a negative scale breaks.
///
/// A decode only reads the scales, so they may repeat: zero strides give one scale per
/// KV head (`[0, 0, 1]`), per sequence and head of a contiguous cache (`[Hkv, 0, 1]`,
/// FlashAttention-3's descales) or one for the whole cache (`[0, 0, 0]`), without a
/// tensor of one scale per position. An append writes a scale per (position, head), so
/// its scales must not repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvScales {
    pub k: TensorView,
    pub v: TensorView,
}

/// Head dims an FP8 cache may have (those of the FP8 forward).
pub const FP8_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// A named byte range `[start, end)` of device memory.
type NamedRange = (&'static str, (u64, u64));

impl KvCache {
    /// Whether the cache holds e4m3 codes and scales.
    pub fn is_fp8(&self) -> bool {
        self.k.dtype == DType::E4m3
    }
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
    /// e4m3 codes with per-(position, head) scales.
    pub fp8: bool,
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
    /// device metadata's contents): dtypes equal and 16-bit (or e4m3 with scales), k and
    /// v of one shape, no empty dimension, strides and pointers as the kernels need, the
    /// page size, the capacity, the metadata pointers.
    pub fn validate(&self, batch: usize) -> Result<CacheShape> {
        let (k, v) = (&self.k, &self.v);
        let fp8 = k.dtype == DType::E4m3;
        if k.dtype != v.dtype || !(fp8 || k.dtype.half_type().is_some()) {
            return Err(Error::UnsupportedDType(format!(
                "the cache's k and v must share one dtype, f16, bf16 or e4m3; got k {}, v {}",
                k.dtype, v.dtype
            )));
        }
        match (fp8, &self.scales) {
            (true, None) => {
                return Err(Error::InvalidArgument(
                    "an e4m3 cache needs its scales (KvScales)".into(),
                ));
            }
            (false, Some(_)) => {
                return Err(Error::InvalidArgument(format!(
                    "scales belong to an e4m3 cache, this one is {}",
                    k.dtype
                )));
            }
            _ => {}
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
                // One sequence reads row 0 only: its stride is never used (a [1, n] view
                // may carry any, as an expanded tensor's 0).
                if table_stride < max_pages && batch > 1 {
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
        // The kernels read entries as unsigned: a negative one must land past the pool.
        if pool_pages > MAX_POOL_PAGES {
            return Err(Error::InvalidArgument(format!(
                "a pool of {pool_pages} pages: at most {MAX_POOL_PAGES} (2^31 - 1; an int32 \
                 block table names no more, and i32::MAX means no page)"
            )));
        }
        for (name, t) in [("k_cache", k), ("v_cache", v)] {
            check_pointer(name, t.ptr, TENSOR_ALIGN)?;
            check_strides(name, t)?;
            byte_range_of(name, t)?;
            check_step_strides(name, t, self.layout)?;
        }
        check_pointer("seqlens", self.seqlens, 4)?;
        self.metadata_ranges(batch)?;
        if let Some(scales) = &self.scales {
            if !FP8_HEAD_DIMS.contains(&head_dim) {
                return Err(Error::UnsupportedHeadDim(
                    head_dim,
                    "64, 128, 256 (e4m3 cache)",
                ));
            }
            scales.validate([outer, rows, heads_kv, 1])?;
        }
        Ok(CacheShape {
            batch,
            heads_kv,
            head_dim,
            capacity,
            page_size,
            pool_pages,
            fp8,
        })
    }

    /// The byte ranges of the lengths (`batch` int32) and, paged, of the block table's
    /// rows (`(batch − 1)·table_stride + max_pages` int32 from its pointer): an error
    /// where one passes the end of the 64-bit address space (the kernels' row offsets
    /// would wrap).
    pub(crate) fn metadata_ranges(&self, batch: usize) -> Result<[Option<NamedRange>; 2]> {
        let end = |start: u64, entries: Option<usize>| {
            entries
                .and_then(|n| (n as u64).checked_mul(4))
                .and_then(|bytes| start.checked_add(bytes))
                .map(|end| (start, end))
        };
        let seqlens = end(self.seqlens, Some(batch)).ok_or_else(|| Error::BadStrides {
            tensor: "seqlens",
            reason: format!(
                "{batch} lengths at {:#x} pass the end of the address space",
                self.seqlens
            ),
        })?;
        let table = match self.layout {
            CacheLayout::Contiguous => None,
            CacheLayout::Paged {
                block_table,
                max_pages,
                table_stride,
            } => {
                let entries = batch
                    .saturating_sub(1)
                    .checked_mul(table_stride)
                    .and_then(|n| n.checked_add(max_pages));
                let range = end(block_table, entries).ok_or_else(|| Error::BadStrides {
                    tensor: "block_table",
                    reason: format!(
                        "{batch} rows of stride {table_stride} at {block_table:#x} pass the \
                         end of the address space"
                    ),
                })?;
                Some(("block_table", range))
            }
        };
        Ok([Some(("seqlens", seqlens)), table])
    }

    /// The byte ranges of what an append writes: K, V and an e4m3 cache's scales (arrays,
    /// not Vecs: decode and append validate on every call, and allocate nothing).
    pub(crate) fn data_ranges(&self) -> [Option<NamedRange>; 4] {
        let named = |name, t: &TensorView| t.byte_range().map(|r| (name, r));
        let (k_scale, v_scale) = match &self.scales {
            Some(s) => (named("k_scale", &s.k), named("v_scale", &s.v)),
            None => (None, None),
        };
        [
            named("k_cache", &self.k),
            named("v_cache", &self.v),
            k_scale,
            v_scale,
        ]
    }

    /// The device byte ranges the cache's kernels may write or read: K, V, an e4m3 cache's
    /// scales, the lengths and the block table (of a cache [`KvCache::validate`] accepted
    /// for `batch`).
    pub fn byte_ranges(&self, batch: usize) -> [Option<NamedRange>; 6] {
        let [k, v, k_scale, v_scale] = self.data_ranges();
        // Validation refused metadata past the address space: nothing is left out here.
        let [lengths, table] = self.metadata_ranges(batch).unwrap_or_default();
        [k, v, k_scale, v_scale, lengths, table]
    }
}

impl KvScales {
    /// Both views are float32 of `shape` (the cache's first three dims and 1), 4-byte
    /// aligned and addressable. A decode only reads them, so they may share memory with
    /// each other or the codes; an append, which writes them, checks that they do not
    /// ([`KvScales::check_apart`]).
    fn validate(&self, shape: [usize; 4]) -> Result<()> {
        for (name, t) in [("k_scale", &self.k), ("v_scale", &self.v)] {
            if t.dtype != DType::F32 {
                return Err(Error::UnsupportedDType(format!(
                    "{name} must be f32, got {}",
                    t.dtype
                )));
            }
            if t.shape != shape {
                return Err(Error::ShapeMismatch(format!(
                    "{name} has shape {:?}, the cache needs {shape:?} (its first three \
                     dimensions and 1)",
                    t.shape
                )));
            }
            check_pointer(name, t.ptr, 4)?;
            byte_range_of(name, t)?;
        }
        Ok(())
    }

    /// What an append, which writes the scales, needs beyond [`KvScales::validate`]: each
    /// element its own, and both views apart from the codes and each other.
    pub(crate) fn check_apart(&self, cache: &KvCache) -> Result<()> {
        check_no_self_overlap("k_scale", &self.k)?;
        check_no_self_overlap("v_scale", &self.v)?;
        let codes = [
            ("k_cache", byte_range_of("k_cache", &cache.k)?),
            ("v_cache", byte_range_of("v_cache", &cache.v)?),
        ];
        let k = byte_range_of("k_scale", &self.k)?;
        let v = byte_range_of("v_scale", &self.v)?;
        for (name, r) in [("k_scale", k), ("v_scale", v)] {
            for (other, o) in codes {
                if overlaps(r, o) {
                    return Err(Error::InvalidArgument(format!(
                        "an append writes {name}, whose memory overlaps {other}'s"
                    )));
                }
            }
        }
        if overlaps(k, v) {
            return Err(Error::InvalidArgument(
                "an append writes k_scale and v_scale, whose memory overlaps".into(),
            ));
        }
        Ok(())
    }
}

impl HostMetadata<'_> {
    /// Checks the lengths (after `extra` more tokens: an append's) against the capacity
    /// and, for a paged cache, that every page they reach is inside the pool, that no
    /// sequence reaches one page twice, and (an append) that no sequence's new tokens land
    /// on rows of a page that another sequence holds or writes in the same call.
    pub fn check(&self, cache: &KvCache, shape: &CacheShape, extra: usize) -> Result<()> {
        if self.seqlens.len() != shape.batch {
            return Err(Error::ShapeMismatch(format!(
                "{} host lengths for a batch of {}",
                self.seqlens.len(),
                shape.batch
            )));
        }
        for (b, &len) in self.seqlens.iter().enumerate() {
            let end = usize::try_from(len).ok().and_then(|l| l.checked_add(extra));
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
        if shape.page_size == 0 || shape.capacity > max_pages.saturating_mul(shape.page_size) {
            // `KvCache::validate` never gives such a shape; one built by hand might.
            return Err(Error::InvalidArgument(format!(
                "a paged cache of {} positions in pages of {} tokens, {max_pages} pages per \
                 sequence",
                shape.capacity, shape.page_size
            )));
        }
        let need = shape
            .batch
            .saturating_sub(1)
            .checked_mul(table_stride)
            .and_then(|n| n.checked_add(max_pages));
        if need.is_none_or(|n| table.len() < n) {
            return Err(Error::ShapeMismatch(format!(
                "the host block table has {} entries, the batch needs {}",
                table.len(),
                need.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string())
            )));
        }
        // Each sequence's pages: inside the pool, and none named twice. A page named twice
        // puts two of the sequence's positions on one row, so a decode would read one of
        // them twice and never the other (and an append could write over the sequence's
        // own cached token). Pages shared between sequences (a common prefix) are fine
        // to read; what an append may write on them is checked below.
        let mut sorted = Vec::new();
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
            sorted.clear();
            sorted.extend_from_slice(row);
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(Error::InvalidArgument(format!(
                    "sequence {b}'s block table names page {} twice within its {} positions",
                    w[0],
                    len as usize + extra
                )));
            }
        }
        if extra > 0 {
            check_append_rows(self.seqlens, table, table_stride, shape.page_size, extra)?;
        }
        Ok(())
    }
}

/// An append writes positions `len .. len + extra` of each sequence. Each of those rows
/// must be its writer's alone: a row that two sequences' new tokens share would hold
/// whichever write the kernel's threads happen to run last, and a row that another
/// sequence already holds (a position below its length, on a page the two share) would
/// silently change that sequence's cached token. Sharing pages for reading, a common
/// prefix, stays fine: a fork that shares a partly filled page must give each sequence
/// its own copy before either appends to it (copy on write).
fn check_append_rows(
    seqlens: &[i32],
    table: &[i32],
    table_stride: usize,
    page_size: usize,
    extra: usize,
) -> Result<()> {
    // The rows each sequence writes, as (page, first row, end row, sequence).
    let mut writes = Vec::new();
    for (b, &len) in seqlens.iter().enumerate() {
        let (mut pos, end) = (len as usize, len as usize + extra);
        while pos < end {
            let (index, row) = (pos / page_size, pos % page_size);
            let rows = (page_size - row).min(end - pos);
            writes.push((table[b * table_stride + index], row, row + rows, b));
            pos += rows;
        }
    }
    writes.sort_unstable();
    // Sorted by page and first row, two writes onto one row show as neighbours.
    if let Some(w) = writes
        .windows(2)
        .find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
    {
        return Err(Error::InvalidArgument(format!(
            "sequences {} and {} would both append to rows {}.. of page {}",
            w[0].3, w[1].3, w[1].1, w[0].0
        )));
    }
    // Every page some sequence holds rows of: does another sequence write below the
    // holder's last row there? The writes, sorted by page, find the few pages written
    // on (a search rather than a mark per pool page: a pool's page count is the
    // caller's, and a check must not allocate by it).
    for (holder, &len) in seqlens.iter().enumerate() {
        let len = len as usize;
        for index in 0..len.div_ceil(page_size) {
            let page = table[holder * table_stride + index];
            let on_page = writes.partition_point(|w| w.0 < page);
            if writes.get(on_page).is_none_or(|w| w.0 != page) {
                continue;
            }
            let held = (len - index * page_size).min(page_size);
            if let Some(&(_, first, end, writer)) = writes[on_page..]
                .iter()
                .take_while(|w| w.0 == page)
                .find(|&&(_, first, _, writer)| writer != holder && first < held)
            {
                let end = end.min(held);
                return Err(Error::InvalidArgument(format!(
                    "sequence {writer} would append over rows {first}..{end} of page {page}, \
                     which sequence {holder} holds (its positions {}..{})",
                    index * page_size + first,
                    index * page_size + end
                )));
            }
        }
    }
    Ok(())
}

/// The decode kernels step from one position to the next, and (paged) from one page to
/// the next, in 32-bit byte offsets: those strides must stay below 4 GiB wherever the
/// dimension has more than one entry (no real cache has a token row or a page of 4 GiB;
/// a larger stride would wrap).
fn check_step_strides(name: &'static str, t: &TensorView, layout: CacheLayout) -> Result<()> {
    let dims: &[(usize, &str)] = match layout {
        CacheLayout::Contiguous => &[(1, "position")],
        CacheLayout::Paged { .. } => &[(0, "page"), (1, "position")],
    };
    for &(dim, what) in dims {
        let bytes = t.strides[dim] as u128 * t.dtype.size_bytes() as u128;
        if t.shape[dim] > 1 && bytes > u128::from(u32::MAX) {
            return Err(Error::BadStrides {
                tensor: name,
                reason: format!(
                    "{what} stride {} elements ({bytes} bytes) must be below 4 GiB",
                    t.strides[dim]
                ),
            });
        }
    }
    Ok(())
}
