//! Driver presence, device properties and the CUDA context.
//!
//! cudarc loads libcuda lazily and **panics** when it cannot be found, so every path into
//! the driver starts with [`driver_present`], which turns a missing driver into
//! [`Error::NoDriver`] instead.
//!
//! flashcore works in the device's primary context, but leaves the calling thread's
//! current context as it found it: every driver call made on a caller's behalf runs inside
//! a [`ContextScope`], which makes the primary context current and puts the caller's back
//! (or none, if none was current) when it ends, on success and on every error path.

use std::ffi::c_int;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUcontext, CUdevice_attribute, CUresult};
use cudarc::driver::{CudaContext, DriverError};

use crate::error::{Error, Result};

/// Maps a driver status to the crate's error: `CUDA_SUCCESS` is `Ok`, anything else is
/// [`Error::Driver`] naming the failed call.
pub(crate) fn check(call: &'static str, r: CUresult) -> Result<()> {
    match r {
        CUresult::CUDA_SUCCESS => Ok(()),
        _ => Err(Error::Driver {
            call,
            code: format!("{r:?}"),
        }),
    }
}

/// The same mapping for errors coming out of cudarc's safe layer, for use in `map_err`.
pub(crate) fn driver_err(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Driver {
        call,
        code: format!("{:?}", e.0),
    }
}

/// Whether libcuda can be loaded on this machine. Call this before anything else in
/// `cudarc::driver`: cudarc panics instead of returning an error when the library is missing.
pub fn driver_present() -> bool {
    // Loading a library runs its initialisers, so probe once per process; whether a driver
    // is installed does not change while we run.
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: this only tries to dlopen libcuda/nvcuda by name and drops the handle; it
        // calls no driver function. libcuda's initialisers have no preconditions.
        unsafe { sys::is_culib_present() }
    })
}

/// Initialises the driver (idempotent). `Ok(false)` means the driver loaded but reports no
/// device at all (`CUDA_ERROR_NO_DEVICE`), which callers turn into a count of zero.
fn init_driver() -> Result<bool> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    // SAFETY: libcuda is present (checked above); cuInit takes a flags word that must be 0
    // and may be called any number of times from any thread.
    let r = unsafe { sys::cuInit(0) };
    if r == CUresult::CUDA_ERROR_NO_DEVICE {
        return Ok(false);
    }
    check("cuInit", r)?;
    Ok(true)
}

/// The number of CUDA devices the driver reports (0 when it reports none).
pub fn device_count() -> Result<usize> {
    if !init_driver()? {
        return Ok(0);
    }
    let mut count: c_int = 0;
    // SAFETY: the driver is initialised; `count` is a valid, writable c_int.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut count)
    })?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The driver's CUDA version as an integer, e.g. 12080 for CUDA 12.8.
fn driver_version_raw() -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: only called after `init_driver` succeeded, so libcuda is loaded; `v` is a
    // valid, writable c_int.
    check("cuDriverGetVersion", unsafe {
        sys::cuDriverGetVersion(&mut v)
    })?;
    Ok(v)
}

/// The calling thread's current CUDA context, put back when the scope ends.
///
/// The driver API acts on the thread's *current* context, and a caller may have its own
/// current (a context of its own, another device's, or none at all). Every path in
/// flashcore that calls the driver on a caller's behalf holds one of these for as long as
/// it needs its context current:
///
/// ```no_run
/// # use flashcore::host::device::{ContextScope, Device};
/// # fn f(device: &Device) -> flashcore::Result<()> {
/// let _scope = ContextScope::enter(device.context())?;
/// // ... driver calls: the device's primary context is current here ...
/// # Ok(()) }
/// // `_scope` dropped: the caller's context (or none) is current again, also after an
/// // early `?` return or a panic.
/// ```
///
/// [`ContextScope::save`] only remembers the current context, for calls that change it
/// themselves (cudarc's `CudaContext::new`, and its `Drop`, which makes the context
/// current before releasing it). Scopes nest; one that enters the context already current
/// costs a single `cuCtxGetCurrent`. A scope is neither `Send` nor `Sync`: contexts are
/// current per thread, so it must end on the thread it began on. Restoring never panics
/// and ignores driver errors (there is no one to report them to in `Drop`).
#[must_use = "the caller's context is put back when the scope is dropped"]
#[derive(Debug)]
pub struct ContextScope {
    saved: CUcontext,
    _thread_bound: PhantomData<*mut ()>,
}

impl ContextScope {
    /// Remembers the calling thread's current context (possibly none); dropping the scope
    /// makes it current again.
    ///
    /// Errors: [`Error::NoDriver`] without libcuda, [`Error::Driver`] if the driver cannot
    /// say which context is current.
    pub fn save() -> Result<ContextScope> {
        if !driver_present() {
            return Err(Error::NoDriver);
        }
        Self::current()
    }

    /// Remembers the calling thread's current context and makes `ctx` current; dropping
    /// the scope puts the remembered one back. When `ctx` is already current nothing is
    /// changed.
    ///
    /// Errors: [`Error::Driver`] when the driver refuses either call; then the thread's
    /// current context is unchanged.
    pub fn enter(ctx: &CudaContext) -> Result<ContextScope> {
        // A CudaContext exists, so libcuda is loaded and initialised.
        let scope = Self::current()?;
        if scope.saved != ctx.cu_ctx() {
            // SAFETY: `ctx.cu_ctx()` is a live context: `ctx` owns a reference to it for at
            // least as long as this call. Making a context current has no other
            // precondition; the scope puts the previous one back when dropped.
            check("cuCtxSetCurrent", unsafe {
                sys::cuCtxSetCurrent(ctx.cu_ctx())
            })?;
        }
        Ok(scope)
    }

    /// A scope remembering the current context. libcuda must be loaded.
    fn current() -> Result<ContextScope> {
        Ok(ContextScope {
            saved: current_context()?,
            _thread_bound: PhantomData,
        })
    }
}

/// The calling thread's current context, null where there is none (before `cuInit` too).
/// libcuda must be loaded ([`driver_present`]).
pub(crate) fn current_context() -> Result<CUcontext> {
    let mut current: CUcontext = ptr::null_mut();
    // SAFETY: callers ensure libcuda is loaded; `current` is a valid out-pointer.
    let r = unsafe { sys::cuCtxGetCurrent(&mut current) };
    // Before cuInit no context can be current: none.
    if r != CUresult::CUDA_ERROR_NOT_INITIALIZED {
        check("cuCtxGetCurrent", r)?;
    }
    Ok(current)
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        let mut now: CUcontext = ptr::null_mut();
        // SAFETY: a scope only exists once libcuda is loaded; `now` is a valid out-pointer.
        let r = unsafe { sys::cuCtxGetCurrent(&mut now) };
        if r != CUresult::CUDA_SUCCESS || now != self.saved {
            // SAFETY: `self.saved` was current on this thread (scopes are not Send) when the
            // scope began, or is null, which unbinds; flashcore destroys no context the
            // caller made current. A failure cannot be reported from Drop and leaves the
            // thread as it is.
            let _ = unsafe { sys::cuCtxSetCurrent(self.saved) };
        }
    }
}

/// Drops one reference to a context without changing the calling thread's current
/// context: when it is the last, cudarc's `Drop` makes the context current to release it.
pub(crate) fn release_context(ctx: Arc<CudaContext>) {
    let _scope = ContextScope::save().ok();
    drop(ctx);
}

/// One GPU: its (primary) CUDA context and the properties the kernels are chosen by.
///
/// Opening one and dropping it leave the calling thread's current context as they found
/// it (see [`ContextScope`]).
#[derive(Debug, Clone)]
pub struct Device {
    /// Released through [`release_context`] in `Drop`.
    ctx: ManuallyDrop<Arc<CudaContext>>,
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    sm_count: u32,
    smem_optin: u32,
    l2_bytes: u32,
    driver_version: i32,
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: `self.ctx` is taken exactly once, here, and not used afterwards.
        let ctx = unsafe { ManuallyDrop::take(&mut self.ctx) };
        release_context(ctx);
    }
}

impl Device {
    /// Opens device `ordinal`: checks for the driver, initialises it, retains the device's
    /// primary context and reads its properties. The calling thread's current context is
    /// left as it was (cudarc binds the primary context; a scope puts the caller's back).
    ///
    /// Errors: [`Error::NoDriver`] without libcuda, [`Error::NoDevice`] when `ordinal` is
    /// out of range, [`Error::Driver`] when a driver call fails.
    pub fn new(ordinal: usize) -> Result<Device> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        // Declared before `ctx`, so it is dropped after it: on an error below, the context's
        // own Drop (which binds it) runs first and the caller's context is still put back.
        let _scope = ContextScope::save()?;
        let ctx = CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain"))?;
        let name = ctx.name().map_err(driver_err("cuDeviceGetName"))?;
        let attr = |a: CUdevice_attribute| -> Result<i32> {
            ctx.attribute(a).map_err(driver_err("cuDeviceGetAttribute"))
        };
        // Attributes are never negative; clamp rather than fail if a driver ever says so.
        let attr_u32 = |a| attr(a).map(|v| u32::try_from(v).unwrap_or(0));

        let cc = (
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let sm_count = attr_u32(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let smem_optin =
            attr_u32(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let l2_bytes = attr_u32(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?;
        let driver_version = driver_version_raw()?;

        Ok(Device {
            ctx: ManuallyDrop::new(ctx),
            ordinal,
            name,
            cc,
            sm_count,
            smem_optin,
            l2_bytes,
            driver_version,
        })
    }

    /// The device's primary context (shared; cloning the `Arc` is cheap). cudarc's own
    /// calls through it make it current on the calling thread and leave it there; wrap
    /// them in a [`ContextScope`] where that matters.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(major, minor)`, e.g. `(9, 0)` for Hopper.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The most shared memory one block may use after opting in through
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` (static + dynamic), in bytes.
    pub fn smem_optin(&self) -> u32 {
        self.smem_optin
    }

    /// L2 cache size in bytes.
    pub fn l2_bytes(&self) -> u32 {
        self.l2_bytes
    }

    /// The driver's CUDA version, e.g. 12080 for 12.8 or 13000 for 13.0. It bounds the PTX
    /// `.version` the JIT accepts.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// The plain PTX target name of this device, e.g. "sm_90" (never the "a" variant).
    pub fn arch_name(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    /// Fails with [`Error::UnsupportedGpu`] below compute capability 8.0 (no kernel path).
    pub fn require_sm80(&self) -> Result<()> {
        if self.cc < (8, 0) {
            return Err(Error::UnsupportedGpu {
                name: self.name.clone(),
                major: self.cc.0,
                minor: self.cc.1,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_maps_success_and_failure() {
        assert!(check("cuInit", CUresult::CUDA_SUCCESS).is_ok());
        match check("cuModuleLoadDataEx", CUresult::CUDA_ERROR_INVALID_PTX) {
            Err(Error::Driver { call, code }) => {
                assert_eq!(call, "cuModuleLoadDataEx");
                assert_eq!(code, "CUDA_ERROR_INVALID_PTX");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    /// On a machine without libcuda (the CPU build machine) every entry point must return
    /// `NoDriver` instead of letting cudarc panic. On a GPU machine the same calls must
    /// succeed or fail with a typed error, never panic.
    #[test]
    fn missing_driver_is_a_typed_error() {
        if !driver_present() {
            assert!(matches!(Device::new(0), Err(Error::NoDriver)));
            assert!(matches!(device_count(), Err(Error::NoDriver)));
            assert!(matches!(ContextScope::save(), Err(Error::NoDriver)));
        } else {
            drop(ContextScope::save().expect("cuCtxGetCurrent"));
            let count = device_count().expect("driver present but cuDeviceGetCount failed");
            match Device::new(count) {
                Err(Error::NoDevice { ordinal, count: c }) => {
                    assert_eq!((ordinal, c), (count, count))
                }
                other => panic!("expected NoDevice, got {other:?}"),
            }
            if count > 0 {
                let d = Device::new(0).expect("device 0");
                assert!(d.sm_count() > 0);
                assert!(d.arch_name().starts_with("sm_"));
            }
        }
    }
}
