//! Host side of the Hopper proof kernels: the warp-specialized GEMM
//! ([`crate::kernels::gemm`]) and the TMA round trip ([`crate::kernels::tma_copy`]).
//! They exist to test and measure the sm_90a building blocks; they are not a public API
//! promise.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::CUstream;

use super::cache::ModuleCache;
use super::device::{ContextScope, Device};
use super::launch::{LaunchDims, launch};
use super::module::LoadedKernel;
use crate::error::{Error, Result};
use crate::kernels::KernelSpec;
use crate::kernels::gemm::{BLOCK_K_BYTES, BLOCK_M, BLOCK_N, GemmArgs, GemmConfig, THREADS};
use crate::kernels::tma_copy::{self, TmaCopyArgs, TmaCopyConfig};
use crate::tma::{TiledMap, TmaType};

/// Loads and launches the proof kernels on one Hopper GPU.
pub struct HopperProofs {
    device: Arc<Device>,
    cache: ModuleCache,
}

impl HopperProofs {
    /// Refuses any GPU but compute capability 9.0: the kernels are `.target sm_90a`.
    pub fn new(device: Arc<Device>) -> Result<HopperProofs> {
        let (major, minor) = device.compute_capability();
        if (major, minor) != (9, 0) {
            return Err(Error::UnsupportedGpu {
                name: format!("{} (the sm_90a kernels need sm_90)", device.name()),
                major,
                minor,
            });
        }
        Ok(HopperProofs {
            device,
            cache: ModuleCache::new(),
        })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Generates and loads `spec` once.
    pub fn prepare(&self, spec: &KernelSpec) -> Result<Arc<LoadedKernel>> {
        let id = spec.id();
        let arch = self.device.compute_capability();
        self.cache
            .get_or_load(self.device.context(), &id, arch, || {
                Ok((spec.generate()?.to_ptx(), spec.smem_bytes()))
            })
    }

    /// `C = scale · A·Bᵀ` with A `[m, k]`, B `[n, k]` and C `[m, n]`, all row-major and
    /// contiguous; f16/bf16 in and out, or e4m3 in and bf16 out (`cfg.dtype`).
    ///
    /// Checked: sizes from 1 to 2^31 − 1, `k` a whole number of 16-byte rows for TMA,
    /// `n` even (C is written in pairs), A and B 16-byte aligned, C 4-byte aligned.
    ///
    /// # Safety
    ///
    /// The pointers must be device memory of this device's primary context holding the
    /// sizes above, live until the kernel has run; `stream` null or a stream of it.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        cfg: &GemmConfig,
        [a, b, c]: [u64; 3],
        [m, n, k]: [usize; 3],
        scale: f32,
        stream: CUstream,
    ) -> Result<()> {
        let bad = |what: String| Err(Error::InvalidArgument(format!("gemm: {what}")));
        let esize = cfg.dtype.in_bytes() as usize;
        for (name, v) in [("m", m), ("n", n), ("k", k)] {
            if v == 0 || v >= 1 << 31 {
                return bad(format!("{name} = {v} outside 1..2^31"));
            }
        }
        if !(k * esize).is_multiple_of(16) {
            return bad(format!(
                "k = {k}: rows of A and B must be a multiple of 16 bytes"
            ));
        }
        if !n.is_multiple_of(2) {
            return bad(format!("n = {n} must be even"));
        }
        for (name, p, align) in [("a", a, 16), ("b", b, 16), ("c", c, 4)] {
            if p == 0 {
                return Err(Error::NullPointer(name));
            }
            if !p.is_multiple_of(align) {
                return Err(Error::Misaligned {
                    tensor: name,
                    ptr: p,
                    align,
                });
            }
        }
        let dtype = match cfg.dtype {
            crate::kernels::gemm::GemmType::E4m3 => TmaType::U8,
            crate::kernels::gemm::GemmType::F16 => TmaType::F16,
            crate::kernels::gemm::GemmType::Bf16 => TmaType::Bf16,
        };
        let pitch = (k * esize) as u64;
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        // The driver encodes tensor maps only where a context is current.
        let _scope = ContextScope::enter(self.device.context())?;
        let map_a = TiledMap::for_layout(dtype, m64, k64, pitch, &cfg.a_layout()).encode(a)?;
        let map_b = TiledMap::for_layout(dtype, n64, k64, pitch, &cfg.b_layout()).encode(b)?;
        let tiles_m = m.div_ceil(BLOCK_M as usize) as u32;
        let tiles_n = n.div_ceil(BLOCK_N as usize) as u32;
        let k_tiles = (k * esize).div_ceil(BLOCK_K_BYTES as usize) as u32;
        let mut args = GemmArgs {
            c,
            ldc: n as u64,
            m: m as u32,
            n: n as u32,
            tiles_m,
            tiles_n,
            k_tiles,
            scale,
        };
        let spec = KernelSpec::Gemm(*cfg);
        let kernel = self.prepare(&spec)?;
        let tiles = tiles_m as u64 * tiles_n as u64;
        let dims = LaunchDims {
            grid: (tiles.min(self.device.sm_count() as u64) as u32, 1, 1),
            block: (THREADS, 1, 1),
            dynamic_smem: spec.smem_bytes(),
        };
        let (mut map_a, mut map_b) = (map_a, map_b);
        let mut params: [*mut c_void; 3] = [
            (&mut args as *mut GemmArgs).cast(),
            (&mut map_a as *mut crate::tma::TensorMap).cast(),
            (&mut map_b as *mut crate::tma::TensorMap).cast(),
        ];
        // SAFETY: the kernel's parameters are the GemmArgs block and two by-value
        // 128-byte tensor maps, which these point at and which outlive the call; the maps
        // describe exactly the A and B extents checked above, the epilogue writes only
        // C's m x n elements; this function's contract makes them live memory of this
        // context and `stream` a stream of it.
        unsafe { launch(&kernel, &dims, stream, &mut params) }
    }

    /// The TMA round trip of `cfg` over a contiguous row-major `[rows][cols]` 16-bit
    /// matrix: `input` → TMA load → TMA store → `out`, and → shared loads at the DSL's
    /// swizzled addresses → `readback`.
    ///
    /// # Safety
    ///
    /// The three pointers must be device memory of this context holding `rows · cols`
    /// 16-bit elements each (16-byte aligned), live until the kernel has run; `stream`
    /// null or a stream of this context.
    pub unsafe fn tma_round_trip(
        &self,
        cfg: &TmaCopyConfig,
        [input, out, readback]: [u64; 3],
        [rows, cols]: [usize; 2],
        stream: CUstream,
    ) -> Result<()> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(8) || rows >= 1 << 31 {
            return Err(Error::InvalidArgument(format!(
                "tma round trip: {rows} x {cols} (cols a multiple of 8)"
            )));
        }
        let layout = cfg.layout();
        let pitch = (cols * 2) as u64;
        let map = |p: u64| {
            TiledMap::for_layout(TmaType::Bf16, rows as u64, cols as u64, pitch, &layout).encode(p)
        };
        // The driver encodes tensor maps only where a context is current.
        let _scope = ContextScope::enter(self.device.context())?;
        let (mut map_in, mut map_out) = (map(input)?, map(out)?);
        if !readback.is_multiple_of(4) {
            return Err(Error::Misaligned {
                tensor: "readback",
                ptr: readback,
                align: 4,
            });
        }
        let mut args = TmaCopyArgs {
            readback,
            ld: cols as u64,
            rows: rows as u32,
            cols: cols as u32,
        };
        let spec = KernelSpec::TmaCopy(*cfg);
        let kernel = self.prepare(&spec)?;
        let dims = LaunchDims {
            grid: (
                cols.div_ceil(cfg.cols as usize) as u32,
                rows.div_ceil(cfg.rows as usize) as u32,
                1,
            ),
            block: (tma_copy::THREADS, 1, 1),
            dynamic_smem: spec.smem_bytes(),
        };
        let mut params: [*mut c_void; 3] = [
            (&mut args as *mut TmaCopyArgs).cast(),
            (&mut map_in as *mut crate::tma::TensorMap).cast(),
            (&mut map_out as *mut crate::tma::TensorMap).cast(),
        ];
        // SAFETY: the parameters are the argument block and two by-value tensor maps
        // that outlive the call; the maps cover exactly the rows x cols matrices the
        // contract makes live memory of this context, and the readback is written only
        // inside them; `stream` is null or a stream of this context.
        unsafe { launch(&kernel, &dims, stream, &mut params) }
    }
}
