//! PTX loading through `cuModuleLoadDataEx`, keeping the JIT's logs.
//!
//! cudarc's safe `load_module` uses `cuModuleLoadData` without log buffers, so a ptxas
//! rejection surfaces only as `CUDA_ERROR_INVALID_PTX`. Here the error log (line and column
//! of the offending PTX) goes into [`Error::ModuleLoad`], and the verbose info log (ptxas'
//! "Used N registers ..." lines) is kept on the loaded kernel.

use std::ffi::{CString, c_int, c_uint, c_void};
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUfunction, CUfunction_attribute, CUjit_option, CUmodule};

use super::device::{ContextScope, check, release_context};
use crate::error::{Error, Result};

/// Size of each JIT log buffer. ptxas' verbose output for one kernel is a few hundred
/// bytes; error logs for a badly broken module can be long, hence the headroom.
const LOG_BYTES: usize = 64 * 1024;

/// Dynamic shared memory a kernel may use without opting in.
pub(crate) const DEFAULT_DYNAMIC_SMEM: u32 = 48 * 1024;

/// One loaded PTX module and the function of its single entry point.
///
/// Dropping it unloads the module. Keep it alive (e.g. as an `Arc` held by the cache) until
/// the launches of its function have completed: synchronize their streams before dropping
/// the last reference.
#[derive(Debug)]
pub struct LoadedKernel {
    /// Released through `release_context` in `Drop`.
    ctx: ManuallyDrop<Arc<CudaContext>>,
    module: CUmodule,
    function: CUfunction,
    /// The `.entry` name the function was looked up by.
    pub entry: String,
    /// The JIT's info log (with `CU_JIT_LOG_VERBOSE`: ptxas' resource-usage lines).
    pub info_log: String,
    /// Registers per thread (`CU_FUNC_ATTRIBUTE_NUM_REGS`).
    pub registers: i32,
    /// Local memory per thread in bytes (`CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES`); above zero
    /// means register spills or a stack frame.
    pub local_bytes: i32,
    /// The most threads per block this function can be launched with.
    pub max_threads: i32,
    /// The dynamic shared memory the function was prepared for (opted in above 48 KiB).
    pub dynamic_smem: u32,
    /// Its preferred shared-memory carveout as the driver reports it: a percentage, or
    /// −1 for the driver's choice (see [`Carveout`]).
    pub preferred_carveout: i32,
}

// SAFETY: CUmodule and CUfunction are opaque driver handles, not pointers into Rust memory.
// The driver API is thread-safe, and a function handle may be used from any thread once its
// context is current there; every use in this crate makes `ctx` current first (through a
// ContextScope). The handles are only freed in Drop, which needs exclusive ownership.
unsafe impl Send for LoadedKernel {}
// SAFETY: as above; `&LoadedKernel` only hands out copies of the handles and immutable data.
unsafe impl Sync for LoadedKernel {}

impl LoadedKernel {
    /// The raw function handle, for `cuLaunchKernel` and friends. It stays valid while
    /// `self` lives; do not unload or otherwise free it.
    pub fn function(&self) -> CUfunction {
        self.function
    }

    /// The context the module was loaded into.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A one-line resource summary, e.g. "128 registers, 0 bytes local memory".
    pub fn spill_report(&self) -> String {
        format!(
            "{} registers, {} bytes local memory",
            self.registers, self.local_bytes
        )
    }

    fn attribute(&self, attr: CUfunction_attribute) -> Result<i32> {
        let mut v: c_int = 0;
        // SAFETY: `self.function` is a live function of `self.module`, whose context the
        // caller has made current; `v` is a valid, writable c_int.
        check("cuFuncGetAttribute", unsafe {
            sys::cuFuncGetAttribute(&mut v, attr, self.function)
        })?;
        Ok(v)
    }
}

impl Drop for LoadedKernel {
    fn drop(&mut self) {
        if !self.module.is_null() {
            // cuModuleUnload acts on the current context. A failure to make it current
            // cannot be reported from Drop, so it is ignored like the unload's own status.
            let _scope = ContextScope::enter(&self.ctx).ok();
            // SAFETY: `self.module` was returned by cuModuleLoadDataEx, is unloaded exactly
            // once (here), and the context it lives in is kept alive by `self.ctx`.
            let _ = unsafe { sys::cuModuleUnload(self.module) };
            self.module = ptr::null_mut();
        }
        // SAFETY: `self.ctx` is taken exactly once, here, and not used afterwards.
        let ctx = unsafe { ManuallyDrop::take(&mut self.ctx) };
        release_context(ctx);
    }
}

/// The text of a NUL-terminated log buffer.
fn log_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).trim_end().to_owned()
}

/// Error log and info log of a failed load, labelled, empty parts left out.
fn combine_logs(error_log: &str, info_log: &str) -> String {
    match (error_log.is_empty(), info_log.is_empty()) {
        (true, true) => "(the JIT wrote no log)".to_owned(),
        (false, true) => error_log.to_owned(),
        (true, false) => info_log.to_owned(),
        (false, false) => format!("{error_log}\n--- info log ---\n{info_log}"),
    }
}

/// How much of each SM's unified L1/shared-memory array a kernel asks to be shared memory
/// (`CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Carveout {
    /// The driver's choice: enough for the kernel's blocks, the rest L1.
    #[default]
    Driver,
    /// All of it. For a kernel that runs right behind one that needed it all: an SM whose
    /// split changes between two kernels drains and reconfigures first (the decode step's
    /// merge kernel, whose few KiB would otherwise get a small carveout, cost about
    /// 0.2 µs of every B1 step on the H200).
    MaxShared,
}

/// JIT-compiles `ptx` in `ctx`, looks up `entry`, opts it in to `dynamic_smem` bytes of
/// dynamic shared memory when that exceeds 48 KiB, and reads its resource attributes.
/// `ctx` is current only during the call: the calling thread's current context is put back
/// before it returns (see [`ContextScope`]).
///
/// Errors: [`Error::ModuleLoad`] (with the JIT's error and info logs) when the driver
/// rejects the PTX; [`Error::InvalidArgument`] when `ptx` or `entry` contains a NUL byte;
/// [`Error::Driver`] for any other failed call (e.g. `entry` not in the module).
pub fn load(
    ctx: &Arc<CudaContext>,
    ptx: &str,
    entry: &str,
    dynamic_smem: u32,
) -> Result<LoadedKernel> {
    load_with(ctx, ptx, entry, dynamic_smem, Carveout::Driver)
}

/// [`load`], with the kernel's shared-memory [`Carveout`] preference set.
pub fn load_with(
    ctx: &Arc<CudaContext>,
    ptx: &str,
    entry: &str,
    dynamic_smem: u32,
    carveout: Carveout,
) -> Result<LoadedKernel> {
    let image = CString::new(ptx)
        .map_err(|_| Error::InvalidArgument(format!("PTX for {entry} contains a NUL byte")))?;
    let entry_c = CString::new(entry)
        .map_err(|_| Error::InvalidArgument(format!("entry name {entry:?} contains a NUL byte")))?;
    let smem_attr = c_int::try_from(dynamic_smem).map_err(|_| {
        Error::InvalidArgument(format!(
            "dynamic shared memory {dynamic_smem} bytes for {entry}"
        ))
    })?;

    let _scope = ContextScope::enter(ctx)?;

    let mut info_buf = vec![0u8; LOG_BYTES];
    let mut error_buf = vec![0u8; LOG_BYTES];
    let mut options: [CUjit_option; 5] = [
        CUjit_option::CU_JIT_INFO_LOG_BUFFER,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_LOG_VERBOSE,
    ];
    // Each value is either a pointer (the buffers) or an integer smuggled through a
    // `void*` (the sizes, LOG_VERBOSE=1). The size slots are in/out: the driver writes back
    // how many bytes it used. The logs are NUL-terminated, so `log_text` does not need them.
    let mut values: [*mut c_void; 5] = [
        info_buf.as_mut_ptr().cast(),
        ptr::without_provenance_mut(LOG_BYTES),
        error_buf.as_mut_ptr().cast(),
        ptr::without_provenance_mut(LOG_BYTES),
        ptr::without_provenance_mut(1),
    ];

    let mut module: CUmodule = ptr::null_mut();
    // SAFETY: the context is current on this thread; `image` is a NUL-terminated PTX string
    // that outlives the call; `options` and `values` both hold 5 entries; each buffer
    // pointer refers to LOG_BYTES writable bytes (the size passed next to it) that outlive
    // the call; `module` is a valid out-pointer.
    let r = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            image.as_ptr().cast(),
            options.len() as c_uint,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    let info_log = log_text(&info_buf);
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::ModuleLoad {
            kernel: entry.to_owned(),
            code: format!("{r:?}"),
            log: combine_logs(&log_text(&error_buf), &info_log),
        });
    }

    // From here on Drop unloads the module, whatever fails next.
    let mut kernel = LoadedKernel {
        ctx: ManuallyDrop::new(Arc::clone(ctx)),
        module,
        function: ptr::null_mut(),
        entry: entry.to_owned(),
        info_log,
        registers: 0,
        local_bytes: 0,
        max_threads: 0,
        dynamic_smem,
        preferred_carveout: -1,
    };

    // SAFETY: `module` is the live module just loaded in the current context; `entry_c` is
    // NUL-terminated and outlives the call; `kernel.function` is a valid out-pointer.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut kernel.function, module, entry_c.as_ptr())
    })?;

    if dynamic_smem > DEFAULT_DYNAMIC_SMEM {
        // SAFETY: `kernel.function` is a live function in the current context; the attribute
        // takes a plain integer byte count.
        check("cuFuncSetAttribute", unsafe {
            sys::cuFuncSetAttribute(
                kernel.function,
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_attr,
            )
        })?;
    }

    if carveout == Carveout::MaxShared {
        // SAFETY: as above; the attribute takes a percentage (100: all shared memory).
        check("cuFuncSetAttribute", unsafe {
            sys::cuFuncSetAttribute(
                kernel.function,
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
        })?;
    }
    kernel.preferred_carveout = kernel
        .attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)?;
    kernel.registers = kernel.attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_NUM_REGS)?;
    kernel.local_bytes =
        kernel.attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?;
    kernel.max_threads =
        kernel.attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
    Ok(kernel)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_text_stops_at_nul_and_trims() {
        let mut buf = b"ptxas info : Used 40 registers\n".to_vec();
        buf.extend_from_slice(&[0, b'x', b'y']);
        assert_eq!(log_text(&buf), "ptxas info : Used 40 registers");
        assert_eq!(log_text(&[0; 8]), "");
        assert_eq!(log_text(b"no terminator"), "no terminator");
    }

    #[test]
    fn combined_log_keeps_both_parts() {
        assert_eq!(combine_logs("", ""), "(the JIT wrote no log)");
        assert_eq!(combine_logs("err", ""), "err");
        assert_eq!(combine_logs("", "info"), "info");
        assert_eq!(combine_logs("err", "info"), "err\n--- info log ---\ninfo");
    }
}
