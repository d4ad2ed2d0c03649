//! Forward attention: validation, dispatch, the module cache and the launch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::CUstream;

use super::cache::ModuleCache;
use super::device::Device;
use super::launch::{LaunchDims, launch};
use super::module::LoadedKernel;
use super::tensor::{AttentionParams, LseView, TensorView};
use super::validate::{FwdProblem, validate_fwd};
use crate::error::{Error, Result};
use crate::kernels::attention::{
    BLOCK_M_NARROW, BLOCK_M_WIDE, FWD_HEAD_DIMS, FwdArgs, FwdConfig, HalfType, Path,
};
use crate::shape::AttnShape;

/// Which kernel path an architecture gets, or why it gets none.
pub fn path_for_arch(arch: (i32, i32)) -> Result<Path, String> {
    match arch {
        (major, _) if major >= 8 => Ok(Path::Sm80),
        (major, minor) => Err(format!("sm_{major}{minor} is below sm_80: no kernel path")),
    }
}

/// The kernel configuration a problem dispatches to on a GPU of architecture `arch` with
/// `sm_count` SMs.
///
/// The query tile is the wide one unless the wide grid would leave SMs without a block:
/// then the narrow tile doubles the blocks. (Measured on the H200: with 64 wide blocks the
/// narrow tile is 12% faster, with 128 they tie, from 256 the wide tile is 4-37% faster.)
pub fn dispatch(
    arch: (i32, i32),
    sm_count: u32,
    dtype: HalfType,
    shape: &AttnShape,
    causal: bool,
) -> Result<FwdConfig, String> {
    let path = path_for_arch(arch)?;
    let head_dim = shape.head_dim as u32;
    if !FWD_HEAD_DIMS.contains(&head_dim) {
        return Err(format!("no kernel for head dim {head_dim}"));
    }
    let wide_blocks = shape.seqlen_q.div_ceil(BLOCK_M_WIDE as usize) * shape.heads_q * shape.batch;
    let block_m = if wide_blocks < sm_count as usize {
        BLOCK_M_NARROW
    } else {
        BLOCK_M_WIDE
    };
    Ok(FwdConfig {
        path,
        dtype,
        head_dim,
        causal,
        block_m,
    })
}

/// Forward attention on one device: owns the loaded kernels for it.
///
/// The first call for a configuration generates its PTX and loads it (milliseconds);
/// later calls validate, look the kernel up and launch, with no allocation, so they can
/// be captured in a CUDA graph. Every call (and dropping it) leaves the calling thread's
/// current CUDA context as it found it: the device's primary context is current only
/// inside the driver calls (see [`ContextScope`](super::device::ContextScope)).
pub struct Attention {
    device: Arc<Device>,
    cache: ModuleCache,
}

impl Attention {
    /// Forward attention on `device`; refuses GPUs below sm_80.
    pub fn new(device: Arc<Device>) -> Result<Attention> {
        device.require_sm80()?;
        Ok(Attention {
            device,
            cache: ModuleCache::new(),
        })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The kernels loaded so far: (id, arch, registers, local-memory bytes).
    pub fn loaded_kernels(&self) -> Vec<(String, (i32, i32), i32, i32)> {
        self.cache.loaded()
    }

    /// The configuration `problem` runs with on this device.
    pub fn plan(&self, problem: &FwdProblem) -> Result<FwdConfig> {
        let arch = self.device.compute_capability();
        let sms = self.device.sm_count();
        dispatch(arch, sms, problem.dtype, &problem.shape, problem.causal).map_err(|why| {
            let (major, minor) = arch;
            Error::UnsupportedGpu {
                name: format!("{} ({why})", self.device.name()),
                major,
                minor,
            }
        })
    }

    /// Generates and loads the kernel for `cfg` now (otherwise the first call does it).
    pub fn prepare(&self, cfg: &FwdConfig) -> Result<Arc<LoadedKernel>> {
        let arch = self.device.compute_capability();
        self.cache
            .get_or_load(self.device.context(), cfg.id_static(), arch, || {
                let ptx = cfg.generate()?.to_ptx();
                Ok((ptx, cfg.tiling().smem_bytes))
            })
    }

    /// `o = softmax(q kᵀ · scale) v` over views of device memory, on `stream` (null for the
    /// context's default stream). Writes `lse` (natural log, float32 `[B, H, Sq]`) when given.
    /// Every argument is checked first: on error nothing is launched and nothing written.
    /// The call is asynchronous.
    ///
    /// # Safety
    ///
    /// The views' pointers must be device memory of this device's context, valid for the
    /// extents their shapes and strides describe until the kernel has run, with nothing
    /// else writing `q`, `k`, `v` or reading/writing `o` and `lse` meanwhile; `stream`
    /// must be null or a live stream of this context. (Validation checks what can be
    /// checked from the numbers: null, alignment, extents, overlaps; not liveness.)
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_fwd(q, k, v, o, lse, params)?;
        let cfg = self.plan(&problem)?;
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.launch_forward(&problem, &cfg, [q, k, v, o], lse, stream) }
    }

    /// [`Attention::forward`] with the kernel configuration chosen by the caller instead of
    /// the dispatch (to test or time one configuration). `cfg` must be one of the catalog's,
    /// for this problem's dtype, head dim and causality, on a path this GPU runs.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward_with_config(
        &self,
        cfg: &FwdConfig,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_fwd(q, k, v, o, lse, params)?;
        let planned = self.plan(&problem)?;
        // Everything but the query tile must be what the dispatch would pick.
        let fits = FwdConfig {
            block_m: cfg.block_m,
            ..planned
        } == *cfg;
        if !fits || ![BLOCK_M_WIDE, BLOCK_M_NARROW].contains(&cfg.block_m) {
            return Err(Error::InvalidArgument(format!(
                "kernel {} does not fit this problem (the dispatch would pick {})",
                cfg.id(),
                planned.id()
            )));
        }
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.launch_forward(&problem, cfg, [q, k, v, o], lse, stream) }
    }

    /// Launches `cfg` on a validated problem.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]; `problem` must come from `validate_fwd` on these views.
    unsafe fn launch_forward(
        &self,
        problem: &FwdProblem,
        cfg: &FwdConfig,
        [q, k, v, o]: [&TensorView; 4],
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Result<()> {
        let shape = problem.shape;
        let kernel = self.prepare(cfg)?;
        let tiling = cfg.tiling();
        let mut args = FwdArgs {
            q: q.ptr,
            k: k.ptr,
            v: v.ptr,
            o: o.ptr,
            lse: lse.map_or(0, |l| l.ptr),
            q_stride: strides(q),
            k_stride: strides(k),
            v_stride: strides(v),
            o_stride: strides(o),
            seqlen_q: shape.seqlen_q as u32,
            seqlen_k: shape.seqlen_k as u32,
            heads_q: shape.heads_q as u32,
            group: shape.group() as u32,
            scale_log2: problem.scale * std::f32::consts::LOG2_E,
            causal_offset: shape.seqlen_k as i32 - shape.seqlen_q as i32,
            scale: problem.scale,
            _pad: 0,
        };
        let dims = LaunchDims {
            grid: (
                shape.seqlen_q.div_ceil(tiling.block_m as usize) as u32,
                shape.heads_q as u32,
                shape.batch as u32,
            ),
            block: (tiling.threads, 1, 1),
            dynamic_smem: tiling.smem_bytes,
        };
        let mut params = [&mut args as *mut FwdArgs as *mut c_void];
        // SAFETY: the kernel's one parameter is the by-value `FwdArgs` block, which `args`
        // is and which outlives the call; validate_fwd checked every pointer is non-null and
        // aligned and that the kernel's accesses stay inside the views' extents; this
        // function's contract makes those extents live memory of this context and `stream`
        // a stream of it.
        unsafe { launch(&kernel, &dims, stream, &mut params) }
    }
}

/// (batch, sequence, head) strides in elements.
fn strides(t: &TensorView) -> [u64; 3] {
    [
        t.strides[0] as u64,
        t.strides[1] as u64,
        t.strides[2] as u64,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_below_sm80_get_no_path() {
        assert!(path_for_arch((7, 5)).is_err());
        let shape = AttnShape::square(1, 8, 512, 64);
        assert!(dispatch((7, 0), 40, HalfType::F16, &shape, false).is_err());
        for arch in [(8, 0), (8, 6), (8, 9), (9, 0)] {
            assert_eq!(path_for_arch(arch), Ok(Path::Sm80));
        }
    }

    #[test]
    fn dispatch_covers_exactly_the_catalog() {
        let catalog = crate::kernels::attention::all_fwd_configs();
        let mut chosen = std::collections::HashSet::new();
        for dtype in [HalfType::F16, HalfType::Bf16] {
            for d in 1..=512 {
                for causal in [false, true] {
                    for seqlen in [1, 4096] {
                        let shape = AttnShape::square(4, 32, seqlen, d);
                        match dispatch((9, 0), 132, dtype, &shape, causal) {
                            Ok(cfg) => {
                                assert!(catalog.contains(&cfg), "{cfg:?} not in the catalog");
                                chosen.insert(cfg);
                            }
                            Err(_) => assert!(!FWD_HEAD_DIMS.contains(&(d as u32))),
                        }
                    }
                }
            }
        }
        assert_eq!(
            chosen.len(),
            catalog.len(),
            "some catalog kernels are never chosen"
        );
    }

    #[test]
    fn small_grids_get_the_narrow_tile() {
        let pick = |b, h, s| {
            dispatch(
                (9, 0),
                132,
                HalfType::F16,
                &AttnShape::square(b, h, s, 64),
                false,
            )
        };
        assert_eq!(pick(2, 8, 512).unwrap().block_m, BLOCK_M_NARROW); // 64 wide blocks
        assert_eq!(pick(4, 32, 4096).unwrap().block_m, BLOCK_M_WIDE); // 4096 wide blocks
        assert_eq!(pick(1, 8, 1024).unwrap().block_m, BLOCK_M_NARROW); // 64 < 132
        assert_eq!(pick(1, 16, 2048).unwrap().block_m, BLOCK_M_WIDE); // 256
    }
}
