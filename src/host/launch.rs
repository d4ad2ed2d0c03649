//! Raw kernel launches on a caller's stream through `cuLaunchKernel`.

use std::ffi::c_void;
use std::ptr;

use cudarc::driver::sys::{self, CUstream};

use super::device::{ContextScope, check};
use super::module::{DEFAULT_DYNAMIC_SMEM, LoadedKernel};
use crate::error::{Error, Result};

/// Grid and block shape of one launch, plus its dynamic shared memory in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub dynamic_smem: u32,
}

/// Hardware limits that hold on every GPU from sm_30 up.
const MAX_GRID_X: u32 = i32::MAX as u32;
const MAX_GRID_YZ: u32 = 65_535;
const MAX_BLOCK_THREADS: u32 = 1024;
const MAX_BLOCK_Z: u32 = 64;

impl LaunchDims {
    /// Checks the shape against the hardware limits and against what `kernel` was loaded for,
    /// so a bad launch is an [`Error::InvalidArgument`] that names the problem rather than a
    /// bare `CUDA_ERROR_INVALID_VALUE`.
    pub fn validate(&self, kernel: &LoadedKernel) -> Result<()> {
        self.check_limits(&kernel.entry, kernel.max_threads, kernel.dynamic_smem)
    }

    /// [`LaunchDims::validate`] on plain numbers, so it can be tested without a GPU.
    fn check_limits(&self, entry: &str, max_threads: i32, loaded_smem: u32) -> Result<()> {
        let (gx, gy, gz) = self.grid;
        let (bx, by, bz) = self.block;
        let bad = |what: String| Err(Error::InvalidArgument(format!("launch of {entry}: {what}")));
        if gx == 0 || gy == 0 || gz == 0 {
            return bad(format!("empty grid {:?}", self.grid));
        }
        if bx == 0 || by == 0 || bz == 0 {
            return bad(format!("empty block {:?}", self.block));
        }
        if gx > MAX_GRID_X || gy > MAX_GRID_YZ || gz > MAX_GRID_YZ {
            return bad(format!(
                "grid {:?} exceeds ({MAX_GRID_X}, {MAX_GRID_YZ}, {MAX_GRID_YZ})",
                self.grid
            ));
        }
        let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
        // max_threads is 0 only for a kernel whose attributes were never read (not the case
        // after module::load); fall back to the hardware limit then.
        let limit = match u32::try_from(max_threads) {
            Ok(n) if n > 0 => n.min(MAX_BLOCK_THREADS),
            _ => MAX_BLOCK_THREADS,
        };
        if bz > MAX_BLOCK_Z || threads > u64::from(limit) {
            return bad(format!(
                "block {:?} ({threads} threads) exceeds this kernel's limit of {limit} \
                 threads (z <= {MAX_BLOCK_Z})",
                self.block
            ));
        }
        // Above 48 KiB the kernel must have been opted in (by module::load) to at least this.
        if self.dynamic_smem > DEFAULT_DYNAMIC_SMEM && self.dynamic_smem > loaded_smem {
            return bad(format!(
                "{} bytes of dynamic shared memory, but the kernel was loaded for {loaded_smem}",
                self.dynamic_smem
            ));
        }
        Ok(())
    }
}

/// The parameter pointers of a kernel whose parameters are by-value values (an argument
/// block, tensor maps) followed, in a padded kernel, by the tensors' `u32` head dim: the
/// sm80 forward, decode, merge and sm90a forward kernels. The pointers borrow nothing:
/// the values they point at must outlive the launch that reads them.
pub(crate) struct PaddedParams {
    ptrs: [*mut c_void; PaddedParams::MAX],
    len: usize,
}

impl PaddedParams {
    /// The most parameters (an argument block, four tensor maps, a head dim).
    const MAX: usize = 6;

    /// `values` in order, then `head_dim` where given.
    pub(crate) fn new<const N: usize>(
        values: [*mut c_void; N],
        head_dim: Option<&mut u32>,
    ) -> Self {
        const { assert!(N < Self::MAX, "one slot stays for the head dim") };
        let mut ptrs = [ptr::null_mut(); Self::MAX];
        ptrs[..N].copy_from_slice(&values);
        let mut len = N;
        if let Some(d) = head_dim {
            ptrs[len] = (d as *mut u32).cast();
            len += 1;
        }
        PaddedParams { ptrs, len }
    }

    /// The pointer list [`launch`] takes.
    pub(crate) fn list(&mut self) -> &mut [*mut c_void] {
        &mut self.ptrs[..self.len]
    }
}

/// Launches `kernel` with `dims` on `stream` (null = the context's legacy default stream).
/// The shape is validated first ([`LaunchDims::validate`]); the kernel's context is current
/// during the call only (the calling thread's current context is put back before it
/// returns, see [`ContextScope`]). The launch is asynchronous: errors raised while the kernel runs
/// surface at the next synchronizing call.
///
/// # Safety
///
/// - `params` must have exactly one entry per parameter of the kernel, in order, and entry
///   `i` must point to a live, initialised host value with the size and alignment of
///   parameter `i` (for a `.b8 [128]` tensor-map parameter: a pointer to the 128-byte map).
///   The values are copied during the call, so they only need to live until it returns.
/// - Every device pointer passed this way must be valid, for as long as the kernel runs, for
///   every access the kernel makes through it (extent, alignment, no conflicting writes
///   from other work), and must belong to the kernel's context.
/// - `stream` must be null or a live stream of the kernel's context.
pub unsafe fn launch(
    kernel: &LoadedKernel,
    dims: &LaunchDims,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    let (_scope, param_ptr) = prepare(kernel, dims, params)?;
    let (gx, gy, gz) = dims.grid;
    let (bx, by, bz) = dims.block;
    // SAFETY: the function handle is live (owned by `kernel`) and its context current; the
    // shape was validated above; `param_ptr` and `stream` satisfy this function's contract,
    // which the caller upholds; `extra` is null because parameters go through `param_ptr`.
    check("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(
            kernel.function(),
            gx,
            gy,
            gz,
            bx,
            by,
            bz,
            dims.dynamic_smem,
            stream,
            param_ptr,
            ptr::null_mut(),
        )
    })
}

/// [`launch`] with programmatic stream serialization (`cuLaunchKernelEx`, Hopper and
/// later): the kernel may be scheduled before the work ahead of it in `stream` has
/// finished, so it must execute `griddepcontrol.wait` before touching that work's
/// results or anything the work before it may still use.
///
/// # Safety
///
/// As for [`launch`]; and the kernel waits as above before its first access to memory
/// that earlier work in `stream` writes or reads.
pub unsafe fn launch_programmatic(
    kernel: &LoadedKernel,
    dims: &LaunchDims,
    stream: CUstream,
    params: &mut [*mut c_void],
) -> Result<()> {
    let (_scope, param_ptr) = prepare(kernel, dims, params)?;
    // SAFETY: `CUlaunchAttribute` is plain data (an id and a union of plain values), for
    // which all-zero bytes are a valid value.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let (gx, gy, gz) = dims.grid;
    let (bx, by, bz) = dims.block;
    let config = sys::CUlaunchConfig {
        gridDimX: gx,
        gridDimY: gy,
        gridDimZ: gz,
        blockDimX: bx,
        blockDimY: by,
        blockDimZ: bz,
        sharedMemBytes: dims.dynamic_smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: as in `launch`; `config` and the one attribute it points to outlive the
    // call, which copies them.
    check("cuLaunchKernelEx", unsafe {
        sys::cuLaunchKernelEx(&config, kernel.function(), param_ptr, ptr::null_mut())
    })
}

/// What both launches do first: check the shape, make the kernel's context current (until
/// the returned scope drops), and pass the parameters as the driver takes them (a kernel
/// without parameters gets a null list rather than a dangling pointer).
fn prepare(
    kernel: &LoadedKernel,
    dims: &LaunchDims,
    params: &mut [*mut c_void],
) -> Result<(ContextScope, *mut *mut c_void)> {
    dims.validate(kernel)?;
    let scope = ContextScope::enter(kernel.context())?;
    let param_ptr = if params.is_empty() {
        ptr::null_mut()
    } else {
        params.as_mut_ptr()
    };
    Ok((scope, param_ptr))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values in order, then the head dim's address where a padded kernel takes it.
    #[test]
    fn padded_params_append_the_head_dim() {
        let (mut a, mut b, mut d) = (1u64, 2u64, 80u32);
        let a_ptr = (&mut a as *mut u64).cast::<c_void>();
        let b_ptr = (&mut b as *mut u64).cast::<c_void>();
        let d_ptr = (&mut d as *mut u32).cast::<c_void>();
        assert_eq!(
            PaddedParams::new([a_ptr, b_ptr], None).list(),
            [a_ptr, b_ptr]
        );
        let mut padded = PaddedParams::new([a_ptr, b_ptr], Some(&mut d));
        assert_eq!(padded.list(), [a_ptr, b_ptr, d_ptr]);
        let five = [a_ptr; 5];
        assert_eq!(PaddedParams::new(five, Some(&mut d)).list().len(), 6);
    }

    fn dims(grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32) -> LaunchDims {
        LaunchDims {
            grid,
            block,
            dynamic_smem: smem,
        }
    }

    fn rejected(d: LaunchDims, max_threads: i32, loaded_smem: u32) -> bool {
        matches!(
            d.check_limits("k", max_threads, loaded_smem),
            Err(Error::InvalidArgument(_))
        )
    }

    #[test]
    fn accepts_ordinary_shapes() {
        assert!(
            dims((132, 16, 4), (384, 1, 1), 200_000)
                .check_limits("k", 384, 200_000)
                .is_ok()
        );
        assert!(
            dims((1, 65_535, 65_535), (32, 32, 1), 0)
                .check_limits("k", 1024, 0)
                .is_ok()
        );
        assert!(
            dims((1, 1, 1), (128, 1, 1), 48 * 1024)
                .check_limits("k", 0, 0)
                .is_ok()
        );
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(rejected(dims((0, 1, 1), (128, 1, 1), 0), 1024, 0));
        assert!(rejected(dims((1, 1, 0), (128, 1, 1), 0), 1024, 0));
        assert!(rejected(dims((1, 1, 1), (128, 0, 1), 0), 1024, 0));
        assert!(rejected(dims((1, 65_536, 1), (128, 1, 1), 0), 1024, 0));
        assert!(rejected(dims((1, 1, 65_536), (128, 1, 1), 0), 1024, 0));
        assert!(rejected(dims((1 << 31, 1, 1), (128, 1, 1), 0), 1024, 0));
        assert!(rejected(dims((1, 1, 1), (1025, 1, 1), 0), 1024, 0));
        assert!(rejected(dims((1, 1, 1), (1, 1, 65), 0), 1024, 0));
        // The kernel's own limit (e.g. from .maxntid) is tighter than the hardware's.
        assert!(rejected(dims((1, 1, 1), (512, 1, 1), 0), 384, 0));
        // More than 48 KiB needs the opt-in done at load time.
        assert!(rejected(
            dims((1, 1, 1), (128, 1, 1), 100_000),
            1024,
            64 * 1024
        ));
    }
}
