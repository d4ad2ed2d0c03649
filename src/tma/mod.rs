//! Tensor maps for the tensor memory accelerator (TMA): a description of a tiled view of a
//! global tensor ([`TiledMap`]), every rule of `cuTensorMapEncodeTiled` checked in Rust
//! first ([`TiledMap::validate`], one [`TensorMapError`] per rule), and the encoded
//! 128-byte [`TensorMap`] that a kernel takes by value as a parameter.
//!
//! Dimensions are listed innermost first, as the driver and the kernel's coordinates list
//! them: `dims[0]` is the contiguous dimension, `strides[i]` is the byte stride of
//! dimension `i + 1`. The box is what one copy moves; in shared memory it lands as
//! `box[rank-1]` ... `box[0]` elements, the innermost fastest, under the map's swizzle.
//! [`TiledMap::for_layout`] builds the map whose box is exactly a [`SmemLayout`] tile.

use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use crate::error::{Error, Result};
use crate::host::device::{check, current_context, driver_present};
use crate::ptx::{SmemLayout, Swizzle};

/// An encoded `CUtensorMap`: 128 opaque bytes, 64-byte aligned, passed to a kernel by
/// value (a pointer to it goes in the launch's parameter list).
#[repr(C, align(64))]
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TensorMap(sys::CUtensorMap);

impl TensorMap {
    /// All zero bits: the placeholder for a map parameter the kernel is told not to use
    /// (a TMA through it would fault, not write anywhere).
    pub const fn unused() -> TensorMap {
        TensorMap(sys::CUtensorMap { opaque: [0; 16] })
    }
}

impl std::fmt::Debug for TensorMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorMap({:#x}..)", self.0.opaque[0])
    }
}

/// Element types TMA moves. FP8 data goes as `U8`: TMA only copies bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TmaType {
    U8,
    U16,
    U32,
    I32,
    U64,
    I64,
    F16,
    F32,
    F64,
    Bf16,
}

impl TmaType {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            TmaType::U8 => 1,
            TmaType::U16 | TmaType::F16 | TmaType::Bf16 => 2,
            TmaType::U32 | TmaType::I32 | TmaType::F32 => 4,
            TmaType::U64 | TmaType::I64 | TmaType::F64 => 8,
        }
    }

    fn is_float(self) -> bool {
        matches!(
            self,
            TmaType::F16 | TmaType::F32 | TmaType::F64 | TmaType::Bf16
        )
    }

    fn raw(self) -> CUtensorMapDataType {
        use CUtensorMapDataType::*;
        match self {
            TmaType::U8 => CU_TENSOR_MAP_DATA_TYPE_UINT8,
            TmaType::U16 => CU_TENSOR_MAP_DATA_TYPE_UINT16,
            TmaType::U32 => CU_TENSOR_MAP_DATA_TYPE_UINT32,
            TmaType::I32 => CU_TENSOR_MAP_DATA_TYPE_INT32,
            TmaType::U64 => CU_TENSOR_MAP_DATA_TYPE_UINT64,
            TmaType::I64 => CU_TENSOR_MAP_DATA_TYPE_INT64,
            TmaType::F16 => CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            TmaType::F32 => CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
            TmaType::F64 => CU_TENSOR_MAP_DATA_TYPE_FLOAT64,
            TmaType::Bf16 => CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        }
    }
}

/// `CUtensorMapInterleave`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Interleave {
    None,
    B16,
    B32,
}

/// `CUtensorMapL2promotion`: how much L2 fetches around each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum L2Promotion {
    None,
    B64,
    B128,
    B256,
}

/// What out-of-bounds elements of a load become.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OobFill {
    /// Zeros.
    Zero,
    /// NaN (floating-point types only).
    Nan,
}

/// A rule of `cuTensorMapEncodeTiled` that a description breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorMapError {
    #[error("rank {rank} outside 1..=5 (3..=5 when interleaved)")]
    Rank { rank: usize },
    #[error("base address {base:#x} is not {align}-byte aligned")]
    BaseMisaligned { base: u64, align: u64 },
    #[error("dimension {dim} has extent {extent}, outside 1..=2^32")]
    Extent { dim: usize, extent: u64 },
    #[error("stride of dimension {dim} is {stride} bytes, not a multiple of {multiple}")]
    StrideMisaligned {
        dim: usize,
        stride: u64,
        multiple: u64,
    },
    #[error("stride of dimension {dim} is {stride} bytes, not below 2^40")]
    StrideTooLarge { dim: usize, stride: u64 },
    #[error("box dimension {dim} is {size}, outside 1..=256")]
    BoxDim { dim: usize, size: u32 },
    #[error("the box's inner extent is {bytes} bytes, not a multiple of 16")]
    InnerBoxNotMultipleOf16 { bytes: u64 },
    #[error("the box's inner extent is {bytes} bytes, wider than the {span}-byte swizzle")]
    InnerBoxWiderThanSwizzle { bytes: u64, span: u64 },
    #[error("element stride of dimension {dim} is {stride}, outside 1..=8")]
    ElementStride { dim: usize, stride: u32 },
    #[error("NaN fill needs a floating-point element type, not {0:?}")]
    NanFillOnIntegers(TmaType),
    #[error("32-byte interleave needs the 32-byte swizzle or none, not {0:?}")]
    InterleaveSwizzle(Swizzle),
}

/// The most dimensions a tensor map has.
pub const MAX_RANK: usize = 5;

/// A tiled view of a global tensor, as `cuTensorMapEncodeTiled` takes it. Fixed-size
/// arrays (the first `rank` entries used), so describing a map on the hot path of a
/// launch allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TiledMap {
    pub dtype: TmaType,
    /// Dimensions used (1 to 5; at least 3 when interleaved).
    pub rank: usize,
    /// Extents in elements, innermost first.
    pub dims: [u64; MAX_RANK],
    /// Byte strides of dimensions 1..rank.
    pub strides: [u64; MAX_RANK - 1],
    /// The box one copy moves, in elements, innermost first.
    pub box_dims: [u32; MAX_RANK],
    /// Element strides (1 = every element), innermost first.
    pub elem_strides: [u32; MAX_RANK],
    pub interleave: Interleave,
    pub swizzle: Swizzle,
    pub l2: L2Promotion,
    pub oob: OobFill,
}

impl TiledMap {
    /// A map of `dims` with `strides` (see the fields) moving `box_dims`, element strides
    /// 1, no interleave, 128-byte L2 promotion and zero fill.
    ///
    /// `dims` decides the rank; a `strides` or `box_dims` of the wrong length (or a rank
    /// above 5) makes a map that [`TiledMap::validate`] refuses.
    pub fn new(
        dtype: TmaType,
        dims: &[u64],
        strides: &[u64],
        box_dims: &[u32],
        swizzle: Swizzle,
    ) -> TiledMap {
        let consistent = dims.len() <= MAX_RANK
            && strides.len() + 1 == dims.len().max(1)
            && box_dims.len() == dims.len();
        let mut m = TiledMap {
            dtype,
            // An inconsistent description gets a rank validate() refuses.
            rank: if consistent { dims.len() } else { MAX_RANK + 1 },
            dims: [1; MAX_RANK],
            strides: [0; MAX_RANK - 1],
            box_dims: [1; MAX_RANK],
            elem_strides: [1; MAX_RANK],
            interleave: Interleave::None,
            swizzle,
            l2: L2Promotion::B128,
            oob: OobFill::Zero,
        };
        if consistent {
            m.dims[..dims.len()].copy_from_slice(dims);
            m.strides[..strides.len()].copy_from_slice(strides);
            m.box_dims[..box_dims.len()].copy_from_slice(box_dims);
        }
        m
    }

    /// The map of a row-major `[rows][cols]` matrix (rows `row_pitch` bytes apart) whose
    /// box is one `layout` tile: `layout.rows` rows by `layout.cols` columns, arriving in
    /// shared memory in the layout's column blocks. One column block is a 2-D box
    /// `{cols, rows}`; several are a 3-D box `{block_cols, rows, col_blocks}` over the
    /// view `{block_cols, rows, cols / block_cols}` whose third stride is one block's
    /// bytes, so a single copy writes `[col_blocks][rows][block_bytes]`. Coordinates:
    /// `{col, row}` or `{0, row, col / block_cols}`.
    pub fn for_layout(
        dtype: TmaType,
        rows: u64,
        cols: u64,
        row_pitch: u64,
        layout: &SmemLayout,
    ) -> TiledMap {
        let block_cols = layout.block_cols();
        if layout.col_blocks() == 1 {
            TiledMap::new(
                dtype,
                &[cols, rows],
                &[row_pitch],
                &[block_cols, layout.rows],
                layout.swizzle,
            )
        } else {
            TiledMap::new(
                dtype,
                &[u64::from(block_cols), rows, cols / u64::from(block_cols)],
                &[row_pitch, u64::from(layout.block_bytes)],
                &[block_cols, layout.rows, layout.col_blocks()],
                layout.swizzle,
            )
        }
    }

    /// Bytes one full box moves (out-of-bounds fill included): what the copy's mbarrier
    /// must expect.
    pub fn box_bytes(&self) -> u64 {
        let boxes = &self.box_dims[..self.rank.min(MAX_RANK)];
        boxes.iter().map(|&b| u64::from(b)).product::<u64>() * self.dtype.bytes()
    }

    /// Checks every rule the driver imposes, for a tensor at `base`.
    pub fn validate(&self, base: u64) -> Result<(), TensorMapError> {
        let rank = self.rank;
        let interleaved = self.interleave != Interleave::None;
        let min_rank = if interleaved { 3 } else { 1 };
        if !(min_rank..=MAX_RANK).contains(&rank) {
            return Err(TensorMapError::Rank { rank });
        }
        let align = if self.interleave == Interleave::B32 {
            32
        } else {
            16
        };
        if !base.is_multiple_of(align) {
            return Err(TensorMapError::BaseMisaligned { base, align });
        }
        for (dim, &extent) in self.dims[..rank].iter().enumerate() {
            if extent == 0 || extent > 1 << 32 {
                return Err(TensorMapError::Extent { dim, extent });
            }
        }
        for (i, &stride) in self.strides[..rank - 1].iter().enumerate() {
            let dim = i + 1;
            if !stride.is_multiple_of(align) {
                return Err(TensorMapError::StrideMisaligned {
                    dim,
                    stride,
                    multiple: align,
                });
            }
            if stride >= 1 << 40 {
                return Err(TensorMapError::StrideTooLarge { dim, stride });
            }
        }
        for (dim, &size) in self.box_dims[..rank].iter().enumerate() {
            if size == 0 || size > 256 {
                return Err(TensorMapError::BoxDim { dim, size });
            }
        }
        let inner = u64::from(self.box_dims[0]) * self.dtype.bytes();
        if !interleaved && !inner.is_multiple_of(16) {
            return Err(TensorMapError::InnerBoxNotMultipleOf16 { bytes: inner });
        }
        let span = u64::from(self.swizzle.max_span());
        if !interleaved && self.swizzle != Swizzle::None && inner > span {
            return Err(TensorMapError::InnerBoxWiderThanSwizzle { bytes: inner, span });
        }
        for (dim, &stride) in self.elem_strides[..rank].iter().enumerate() {
            if !(1..=8).contains(&stride) {
                return Err(TensorMapError::ElementStride { dim, stride });
            }
        }
        if self.oob == OobFill::Nan && !self.dtype.is_float() {
            return Err(TensorMapError::NanFillOnIntegers(self.dtype));
        }
        if self.interleave == Interleave::B32
            && !matches!(self.swizzle, Swizzle::None | Swizzle::B32)
        {
            return Err(TensorMapError::InterleaveSwizzle(self.swizzle));
        }
        Ok(())
    }

    /// Validates, then encodes the map of the tensor at `base` through the driver, in
    /// the calling thread's current context (that of the memory at `base`: enter it with
    /// [`crate::host::device::ContextScope`]).
    ///
    /// Errors: [`Error::TensorMap`] for a broken rule, [`Error::NoDriver`] without
    /// libcuda, [`Error::Driver`] if the driver still refuses, or (`CUDA_ERROR_INVALID_CONTEXT`)
    /// if no context is current. The driver needs one to encode; without it, it refuses
    /// every map, and a caller that read that as "TMA cannot describe this tensor" would
    /// quietly take its fallback kernels.
    pub fn encode(&self, base: u64) -> Result<TensorMap> {
        self.validate(base)?;
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        if current_context()?.is_null() {
            return Err(Error::Driver {
                call: "cuTensorMapEncodeTiled",
                code: "CUDA_ERROR_INVALID_CONTEXT".into(),
            });
        }
        let rank = self.rank;
        let mut map = TensorMap(sys::CUtensorMap { opaque: [0; 16] });
        let interleave = match self.interleave {
            Interleave::None => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            Interleave::B16 => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_16B,
            Interleave::B32 => CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_32B,
        };
        let swizzle = match self.swizzle {
            Swizzle::None => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
            Swizzle::B32 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B,
            Swizzle::B64 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            Swizzle::B128 => CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        };
        let l2 = match self.l2 {
            L2Promotion::None => CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_NONE,
            L2Promotion::B64 => CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
            L2Promotion::B128 => CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            L2Promotion::B256 => CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        };
        let oob = match self.oob {
            OobFill::Zero => CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            OobFill::Nan => {
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
            }
        };
        // SAFETY: libcuda is loaded (checked above); `map` is a writable, 64-byte aligned
        // CUtensorMap; the dimension, stride, box and element-stride arrays hold at least
        // `rank`, `rank - 1`, `rank` and `rank` entries (rank <= 5, validate checked);
        // the base address is only encoded, never dereferenced here.
        let r = unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                self.dtype.raw(),
                rank as u32,
                base as *mut c_void,
                self.dims.as_ptr(),
                self.strides.as_ptr(),
                self.box_dims.as_ptr(),
                self.elem_strides.as_ptr(),
                interleave,
                swizzle,
                l2,
                oob,
            )
        };
        check("cuTensorMapEncodeTiled", r)?;
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> TiledMap {
        // bf16 [1000 rows][4096 cols], 64 x 128 boxes under the 128-byte swizzle.
        TiledMap::new(
            TmaType::Bf16,
            &[4096, 1000],
            &[8192],
            &[64, 128],
            Swizzle::B128,
        )
    }

    #[test]
    fn a_good_map_passes() {
        assert_eq!(good().validate(0x1000), Ok(()));
        assert_eq!(good().box_bytes(), 64 * 128 * 2);
        let map_size = std::mem::size_of::<TensorMap>();
        assert_eq!((map_size, std::mem::align_of::<TensorMap>()), (128, 64));
    }

    #[test]
    fn rank_out_of_range() {
        let m = TiledMap::new(TmaType::F16, &[8; 6], &[16; 5], &[8; 6], Swizzle::None);
        assert_eq!(m.validate(0), Err(TensorMapError::Rank { rank: 6 }));
        let m = TiledMap::new(TmaType::F16, &[8; 5], &[16; 4], &[8; 5], Swizzle::None);
        assert_eq!(m.validate(0), Ok(()));
        let m = TiledMap::new(TmaType::F16, &[], &[], &[], Swizzle::None);
        assert_eq!(m.validate(0), Err(TensorMapError::Rank { rank: 0 }));
        let m = TiledMap::new(TmaType::F16, &[8, 8], &[16, 16], &[8, 8], Swizzle::None);
        assert!(matches!(m.validate(0), Err(TensorMapError::Rank { .. })));
        let mut m = good();
        m.interleave = Interleave::B16;
        assert_eq!(m.validate(0), Err(TensorMapError::Rank { rank: 2 }));
    }

    #[test]
    fn base_not_16_byte_aligned() {
        assert_eq!(
            good().validate(0x1008),
            Err(TensorMapError::BaseMisaligned {
                base: 0x1008,
                align: 16
            })
        );
    }

    #[test]
    fn extents_in_range() {
        let mut m = good();
        m.dims[1] = 0;
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::Extent { dim: 1, extent: 0 })
        );
        m.dims[1] = (1 << 32) + 1;
        assert!(matches!(m.validate(0), Err(TensorMapError::Extent { .. })));
        m.dims[1] = 1 << 32;
        assert_eq!(m.validate(0), Ok(()));
    }

    #[test]
    fn stride_not_a_multiple_of_16() {
        let mut m = good();
        m.strides[0] = 8200;
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::StrideMisaligned {
                dim: 1,
                stride: 8200,
                multiple: 16
            })
        );
    }

    #[test]
    fn stride_of_2_pow_40() {
        let mut m = good();
        m.strides[0] = 1 << 40;
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::StrideTooLarge {
                dim: 1,
                stride: 1 << 40
            })
        );
        m.strides[0] = (1 << 40) - 16;
        assert_eq!(m.validate(0), Ok(()));
    }

    #[test]
    fn box_dim_over_256() {
        let mut m = good();
        m.box_dims[1] = 257;
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::BoxDim { dim: 1, size: 257 })
        );
        m.box_dims[1] = 0;
        assert!(matches!(m.validate(0), Err(TensorMapError::BoxDim { .. })));
    }

    #[test]
    fn inner_box_not_a_multiple_of_16_bytes() {
        let m = TiledMap::new(TmaType::F16, &[100, 10], &[208], &[4, 8], Swizzle::None);
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::InnerBoxNotMultipleOf16 { bytes: 8 })
        );
    }

    #[test]
    fn inner_box_wider_than_the_swizzle() {
        let mut m = good();
        m.box_dims[0] = 128; // 256 bytes
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::InnerBoxWiderThanSwizzle {
                bytes: 256,
                span: 128
            })
        );
        m.swizzle = Swizzle::B64;
        m.box_dims[0] = 64; // 128 bytes > 64
        assert!(matches!(
            m.validate(0),
            Err(TensorMapError::InnerBoxWiderThanSwizzle { span: 64, .. })
        ));
        // FP8: 128 bytes of one-byte elements fit the 128-byte swizzle.
        let m = TiledMap::new(
            TmaType::U8,
            &[4096, 100],
            &[4096],
            &[128, 64],
            Swizzle::B128,
        );
        assert_eq!(m.validate(0), Ok(()));
    }

    #[test]
    fn element_strides_in_1_to_8() {
        let mut m = good();
        m.elem_strides[1] = 9;
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::ElementStride { dim: 1, stride: 9 })
        );
    }

    #[test]
    fn nan_fill_needs_floats_and_interleave_32_limits_the_swizzle() {
        let mut m = TiledMap::new(TmaType::U8, &[256, 4], &[256], &[64, 4], Swizzle::None);
        m.oob = OobFill::Nan;
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::NanFillOnIntegers(TmaType::U8))
        );
        let mut m = TiledMap::new(
            TmaType::F16,
            &[64, 8, 8],
            &[128, 1024],
            &[16, 8, 8],
            Swizzle::B128,
        );
        m.interleave = Interleave::B32;
        assert_eq!(
            m.validate(0),
            Err(TensorMapError::InterleaveSwizzle(Swizzle::B128))
        );
    }

    #[test]
    fn maps_for_layouts() {
        use crate::ptx::SmemLayout;
        // One 128-byte column block: a 2-D box.
        let l = SmemLayout::new(128, 64, 2, Swizzle::B128);
        let m = TiledMap::for_layout(TmaType::Bf16, 1000, 4096, 8192, &l);
        assert_eq!(&m.dims[..m.rank], &[4096, 1000]);
        assert_eq!(&m.box_dims[..m.rank], &[64, 128]);
        assert_eq!(m.validate(0), Ok(()));
        assert_eq!(m.box_bytes(), u64::from(l.bytes()));
        // d = 128 bf16: two blocks, one 3-D box writing [2][rows][128 B].
        let l = SmemLayout::new(64, 128, 2, Swizzle::B128);
        let m = TiledMap::for_layout(TmaType::Bf16, 777, 128, 3 * 256, &l);
        assert_eq!(&m.dims[..m.rank], &[64, 777, 2]);
        assert_eq!(&m.strides[..m.rank - 1], &[768, 128]);
        assert_eq!(&m.box_dims[..m.rank], &[64, 64, 2]);
        assert_eq!(m.validate(0), Ok(()));
        assert_eq!(m.box_bytes(), u64::from(l.bytes()));
    }

    #[test]
    fn encode_refuses_before_the_driver() {
        let mut m = good();
        m.box_dims[0] = 300;
        assert!(matches!(
            m.encode(0x1000),
            Err(Error::TensorMap(TensorMapError::BoxDim { .. }))
        ));
        if !driver_present() {
            assert!(matches!(good().encode(0x1000), Err(Error::NoDriver)));
        }
    }
}
