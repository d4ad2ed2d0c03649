//! Safe forward and decode calls over cudarc device buffers.
//!
//! [`Attention::forward`] and [`Attention::decode`] take raw device addresses, so calling
//! them is `unsafe`: nothing
//! can tell a live buffer from a dangling one, or memory of this GPU from another's. A
//! Rust caller who holds its tensors in cudarc buffers (`CudaSlice`, or `CudaView`s of
//! them) can call [`Attention::forward_buffers`] and [`Attention::decode_buffers`]
//! instead, with no `unsafe`:
//!
//! - each buffer must belong to this device's context, and hold every element its layout
//!   reaches (checked: a typed error otherwise, nothing launched);
//! - the element type is the dtype (`half::f16`, `half::bf16`);
//! - the borrows keep `o` and `lse` apart from the inputs and from each other;
//! - the buffers are taken as cudarc's own launches take them: the stream first waits
//!   for earlier writes to the inputs (and reads of the outputs) on other streams, and the
//!   call's reads and writes are recorded, so a later use or a drop of a buffer waits for
//!   the kernel.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use flashcore::host::{attention::Attention, device::Device};
//! # use flashcore::host::buffers::{Layout4, Tensor, TensorMut};
//! # use flashcore::host::tensor::AttentionParams;
//! # fn f() -> flashcore::Result<()> {
//! let device = Arc::new(Device::new(0)?);
//! let attn = Attention::new(device.clone())?;
//! let stream = device.context().default_stream();
//! let (b, s, h, d) = (2, 1024, 8, 128);
//! let x = vec![half::f16::from_f32(0.5); b * s * h * d];
//! let q = stream.clone_htod(&x).unwrap();
//! let k = stream.clone_htod(&x).unwrap();
//! let v = stream.clone_htod(&x).unwrap();
//! let mut o = stream.alloc_zeros::<half::f16>(b * s * h * d).unwrap();
//! let layout = Layout4::bhsd(b, s, h, d);
//! let params = AttentionParams { softmax_scale: None, causal: true, ..Default::default() };
//! attn.forward_buffers(
//!     &stream,
//!     [Tensor::new(&q, layout), Tensor::new(&k, layout), Tensor::new(&v, layout)],
//!     TensorMut::new(&mut o, layout),
//!     None,
//!     &params,
//! )?;
//! # Ok(()) }
//! ```

use cudarc::driver::sys::CUcontext;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice};

use crate::error::{Error, Result};
use crate::host::attention::Attention;
use crate::host::device::ContextScope;
use crate::host::kv_cache::{CacheLayout, KvCache};
use crate::host::tensor::{AttentionParams, DType, LseView, TensorView};

/// An element type the forward kernels take: `half::f16` or `half::bf16`.
pub trait HalfElement: sealed::Sealed {
    const DTYPE: DType;
}

impl HalfElement for half::f16 {
    const DTYPE: DType = DType::F16;
}

impl HalfElement for half::bf16 {
    const DTYPE: DType = DType::Bf16;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// How a buffer's elements form a tensor of logical dimensions `[batch, seq, heads,
/// head_dim]`: a [`TensorView`] without its address and dtype. Strides in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout4 {
    pub shape: [usize; 4],
    pub strides: [usize; 4],
}

impl Layout4 {
    /// Stored as `[B, S, H, D]`, contiguous.
    pub fn bshd(b: usize, s: usize, h: usize, d: usize) -> Layout4 {
        Self::of(TensorView::bshd(0, DType::F16, b, s, h, d))
    }

    /// Stored as `[B, H, S, D]`, contiguous (SDPA's order).
    pub fn bhsd(b: usize, s: usize, h: usize, d: usize) -> Layout4 {
        Self::of(TensorView::bhsd(0, DType::F16, b, s, h, d))
    }

    /// Any strides (in elements) of the logical `[batch, seq, heads, head_dim]`.
    pub fn strided(shape: [usize; 4], strides: [usize; 4]) -> Layout4 {
        Layout4 { shape, strides }
    }

    fn of(t: TensorView) -> Layout4 {
        Layout4 {
            shape: t.shape,
            strides: t.strides,
        }
    }

    /// Elements from the first to one past the last the layout reaches; `None` where a
    /// dimension is empty (nothing is reached; validation names it) or the count
    /// overflows (validation names that too).
    fn span(&self) -> Option<usize> {
        self.shape
            .iter()
            .zip(self.strides)
            .try_fold(1usize, |acc, (&n, stride)| {
                let last = n.checked_sub(1)?;
                acc.checked_add(last.checked_mul(stride)?)
            })
    }
}

/// An input tensor in a cudarc buffer (a `CudaSlice`, or a `CudaView` of one).
pub struct Tensor<'a, T> {
    pub data: &'a dyn DevicePtr<T>,
    pub layout: Layout4,
}

impl<'a, T> Tensor<'a, T> {
    pub fn new(data: &'a dyn DevicePtr<T>, layout: Layout4) -> Self {
        Tensor { data, layout }
    }
}

/// An output tensor in a cudarc buffer (a `CudaSlice`, or a `CudaViewMut` of one).
pub struct TensorMut<'a, T> {
    pub data: &'a mut dyn DevicePtrMut<T>,
    pub layout: Layout4,
}

impl<'a, T> TensorMut<'a, T> {
    pub fn new(data: &'a mut dyn DevicePtrMut<T>, layout: Layout4) -> Self {
        TensorMut { data, layout }
    }
}

impl Attention {
    /// [`Attention::forward`] over cudarc buffers, on `stream`: `o = softmax(q kᵀ ·
    /// scale) v`, and the natural-log LSE (float32 `[B, H, Sq]`, contiguous) into `lse`
    /// when given. Safe: see the [module docs](self) for what is checked and how the
    /// buffers are ordered with other streams.
    ///
    /// Errors, with nothing launched: a buffer or `stream` of another context
    /// ([`Error::InvalidArgument`]), a layout reaching past its buffer or an LSE buffer
    /// shorter than `B · H · Sq` ([`Error::InvalidArgument`]), and every error of
    /// [`Attention::forward`].
    pub fn forward_buffers<T: HalfElement>(
        &self,
        stream: &CudaStream,
        [q, k, v]: [Tensor<'_, T>; 3],
        o: TensorMut<'_, T>,
        lse: Option<&mut dyn DevicePtrMut<f32>>,
        params: &AttentionParams,
    ) -> Result<()> {
        let owner = Owner::of(self);
        owner.stream(stream)?;
        for (name, t) in [("q", &q), ("k", &k), ("v", &v)] {
            owner.tensor(name, t.data, &t.layout)?;
        }
        owner.tensor("o", o.data, &o.layout)?;
        if let Some(l) = &lse {
            let [b, sq, h, _] = q.layout.shape;
            owner.rows("lse", *l, b.saturating_mul(h).saturating_mul(sq))?;
        }
        // The stream waits for the buffers' earlier uses on other streams; the guards
        // record this call's uses when dropped, after the launch. cudarc makes the
        // device's context current for both; `_restore`, dropped after the guards, puts
        // the caller's back, as every call of an Attention does.
        let _restore = ContextScope::save()?;
        let (q_ptr, _q_read) = q.data.device_ptr(stream);
        let (k_ptr, _k_read) = k.data.device_ptr(stream);
        let (v_ptr, _v_read) = v.data.device_ptr(stream);
        let (o_ptr, _o_write) = o.data.device_ptr_mut(stream);
        let lse = lse.map(|l| l.device_ptr_mut(stream));
        let lse_view = lse.as_ref().map(|(ptr, _)| LseView { ptr: *ptr });
        // SAFETY: every address comes from a live buffer of this device's context, which
        // holds every element its layout reaches (checked above) and LSE's B·H·Sq floats;
        // `o` and `lse` are borrowed mutably, so nothing else in safe Rust uses them while
        // the call is queued, and the inputs are borrowed shared. cudarc's guards order
        // the buffers' other uses, and their frees, after this call's on `stream`, a live
        // stream of this context.
        unsafe {
            self.forward(
                &view::<T>(q_ptr, &q.layout),
                &view::<T>(k_ptr, &k.layout),
                &view::<T>(v_ptr, &v.layout),
                &view::<T>(o_ptr, &o.layout),
                lse_view.as_ref(),
                params,
                stream.cu_stream(),
            )
        }
    }
}

/// A 16-bit KV cache in cudarc buffers, as [`KvCache`] describes one: `k`, `v`
/// `[B, capacity, Hkv, D]` (contiguous) or page pools `[pages, page_size, Hkv, D]` with a
/// block table; each sequence's length in `seqlens` (int32 `[B]`). Whatever the lengths
/// and the table hold, the kernels read nothing outside the cache (lengths are clamped to
/// the capacity, entries outside the pool are never followed).
pub struct CacheBuffers<'a, T> {
    pub k: Tensor<'a, T>,
    pub v: Tensor<'a, T>,
    pub seqlens: &'a dyn DevicePtr<i32>,
    pub block_table: Option<BlockTable<'a>>,
}

/// A paged cache's block table: int32 `[B, max_pages]`, rows `row_stride` entries apart.
pub struct BlockTable<'a> {
    pub data: &'a dyn DevicePtr<i32>,
    pub max_pages: usize,
    pub row_stride: usize,
}

impl Attention {
    /// [`Attention::decode`] over cudarc buffers, on `stream`: `Sq` new query
    /// tokens per sequence (`q`, `o`: `[B, Sq, Hq, D]`) against `cache`, whose lengths
    /// count the new tokens; the LSE (float32 `[B, Hq, Sq]`, contiguous) into `lse` when
    /// given. The partial results of a split call take memory from the stream-ordered
    /// allocator. Safe: see the [module docs](self).
    ///
    /// Errors, with nothing launched: a buffer or `stream` of another context, a layout
    /// reaching past its buffer, fewer than `B` lengths, a block table shorter than its
    /// `B` rows, an LSE buffer shorter than `B · Hq · Sq` (all
    /// [`Error::InvalidArgument`]), and every error of [`Attention::decode`].
    pub fn decode_buffers<T: HalfElement>(
        &self,
        stream: &CudaStream,
        q: Tensor<'_, T>,
        cache: CacheBuffers<'_, T>,
        o: TensorMut<'_, T>,
        lse: Option<&mut dyn DevicePtrMut<f32>>,
        params: &AttentionParams,
    ) -> Result<()> {
        let owner = Owner::of(self);
        owner.stream(stream)?;
        for (name, t) in [("q", &q), ("k_cache", &cache.k), ("v_cache", &cache.v)] {
            owner.tensor(name, t.data, &t.layout)?;
        }
        owner.tensor("o", o.data, &o.layout)?;
        let [b, sq, hq, _] = q.layout.shape;
        owner.rows("seqlens", cache.seqlens, b)?;
        if let Some(t) = &cache.block_table {
            // (B − 1) rows of `row_stride` entries, then a last row of `max_pages`.
            let rows = b
                .saturating_sub(1)
                .saturating_mul(t.row_stride)
                .saturating_add(t.max_pages);
            owner.rows("block_table", t.data, rows)?;
        }
        if let Some(l) = &lse {
            owner.rows("lse", *l, b.saturating_mul(hq).saturating_mul(sq))?;
        }
        // As in forward_buffers: the caller's context is current again after the guards.
        let _restore = ContextScope::save()?;
        let (q_ptr, _q_read) = q.data.device_ptr(stream);
        let (k_ptr, _k_read) = cache.k.data.device_ptr(stream);
        let (v_ptr, _v_read) = cache.v.data.device_ptr(stream);
        let (lens_ptr, _lens_read) = cache.seqlens.device_ptr(stream);
        let table = cache
            .block_table
            .as_ref()
            .map(|t| (t.data.device_ptr(stream), t.max_pages, t.row_stride));
        let (o_ptr, _o_write) = o.data.device_ptr_mut(stream);
        let lse = lse.map(|l| l.device_ptr_mut(stream));
        let layout = match &table {
            None => CacheLayout::Contiguous,
            Some(((ptr, _), max_pages, table_stride)) => CacheLayout::Paged {
                block_table: *ptr,
                max_pages: *max_pages,
                table_stride: *table_stride,
            },
        };
        let kv = KvCache {
            k: view::<T>(k_ptr, &cache.k.layout),
            v: view::<T>(v_ptr, &cache.v.layout),
            seqlens: lens_ptr,
            layout,
            scales: None,
        };
        let lse_view = lse.as_ref().map(|(ptr, _)| LseView { ptr: *ptr });
        // SAFETY: as in `forward_buffers`: every address comes from a live buffer of this
        // context holding what its layout (or row count: B lengths, the table's rows,
        // B·Hq·Sq LSE floats) reaches; the outputs are borrowed mutably, the inputs
        // shared; cudarc's guards order the buffers' other uses and frees after this
        // call's on `stream`, a live stream of this context. The kernels never follow
        // the lengths or table entries outside the cache.
        unsafe {
            self.decode(
                &view::<T>(q_ptr, &q.layout),
                &kv,
                None,
                &view::<T>(o_ptr, &o.layout),
                lse_view.as_ref(),
                params,
                None,
                stream.cu_stream(),
            )
        }
    }
}

/// The device whose context every buffer and stream of a call must belong to.
struct Owner {
    ctx: CUcontext,
    ordinal: usize,
}

impl Owner {
    fn of(attn: &Attention) -> Owner {
        Owner {
            ctx: attn.device().context().cu_ctx(),
            ordinal: attn.device().ordinal(),
        }
    }

    /// `stream` belongs to this context.
    fn stream(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx {
            return Err(Error::InvalidArgument(format!(
                "the stream belongs to another context than device {}'s",
                self.ordinal
            )));
        }
        Ok(())
    }

    /// Buffer `name` belongs to this context.
    fn buffer<T>(&self, name: &str, buffer: &dyn DeviceSlice<T>) -> Result<()> {
        if buffer.stream().context().cu_ctx() != self.ctx {
            return Err(Error::InvalidArgument(format!(
                "{name} is a buffer of another context than device {}'s",
                self.ordinal
            )));
        }
        Ok(())
    }

    /// Buffer `name` belongs to this context and holds at least `rows` elements.
    fn rows<T>(&self, name: &str, buffer: &dyn DeviceSlice<T>, rows: usize) -> Result<()> {
        self.buffer(name, buffer)?;
        if buffer.len() < rows {
            return Err(Error::InvalidArgument(format!(
                "{name} holds {} elements, the call reads or writes {rows}",
                buffer.len()
            )));
        }
        Ok(())
    }

    /// Buffer `name` belongs to this context and holds every element `layout` reaches.
    fn tensor<T>(&self, name: &str, buffer: &dyn DeviceSlice<T>, layout: &Layout4) -> Result<()> {
        self.buffer(name, buffer)?;
        // An empty or overflowing layout reaches nothing here; validation names it.
        let span = layout.span().unwrap_or(0);
        if span > buffer.len() {
            return Err(Error::InvalidArgument(format!(
                "{name}'s layout (shape {:?}, strides {:?}) reaches {span} elements, its buffer \
                 holds {}",
                layout.shape,
                layout.strides,
                buffer.len()
            )));
        }
        Ok(())
    }
}

/// The view of `layout` at `ptr`, of `T`'s dtype.
fn view<T: HalfElement>(ptr: u64, layout: &Layout4) -> TensorView {
    TensorView::strided(ptr, T::DTYPE, layout.shape, layout.strides)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_count_the_elements_a_layout_reaches() {
        assert_eq!(Layout4::bshd(2, 3, 4, 8).span(), Some(2 * 3 * 4 * 8));
        assert_eq!(Layout4::bhsd(2, 3, 4, 8).span(), Some(2 * 3 * 4 * 8));
        // A head slice of a packed [B, S, 3, H, D] QKV buffer.
        let slice = Layout4::strided([2, 5, 4, 8], [5 * 96, 96, 8, 1]);
        assert_eq!(slice.span(), Some(1 + 5 * 96 + 4 * 96 + 3 * 8 + 7));
        assert_eq!(Layout4::bshd(2, 0, 4, 8).span(), None);
        assert_eq!(
            Layout4::strided([2, 2, 1, 1], [usize::MAX, 1, 1, 1]).span(),
            None
        );
    }
}
