//! The C ABI: an opaque context, one forward call, and error reporting by code and
//! thread-local message. `include/flashcore.h` declares exactly what is here (the
//! `c_header` test checks the two against each other).
//!
//! Rules every entry point follows:
//!
//! - It returns `FLASHCORE_SUCCESS` (0) or an error code: [`Error::code`] for the crate's
//!   errors, [`FLASHCORE_ERROR_NULL_ARGUMENT`] for a null struct/handle pointer and
//!   [`FLASHCORE_ERROR_PANIC`] for an internal panic. No panic crosses the boundary: every
//!   body runs under [`std::panic::catch_unwind`].
//! - On failure it stores a message in a thread-local buffer that
//!   [`flashcore_last_error`] returns; a successful call leaves the buffer alone.
//! - Arguments are fully checked before anything is launched; on error nothing is written.
//! - It returns with the calling thread's current CUDA context as it found it (see
//!   [`ContextScope`](crate::host::device::ContextScope)).

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::sys::CUstream;

use crate::error::{Error, RETURN_CODES, return_code};
use crate::host::attention::Attention;
use crate::host::device::Device;
use crate::host::tensor::{AttentionParams, DIM_NAMES, DType, LseView, TensorView};
use crate::host::validate::validate_fwd;

// ---- constants (mirrored by the #defines of include/flashcore.h) --------------------------
//
// The return codes (`FLASHCORE_SUCCESS`, `FLASHCORE_ERROR_*`) come from the one table in
// `crate::error` ([`RETURN_CODES`]); only the dtype codes are defined here.

/// `FlashcoreTensor::dtype` of IEEE half precision.
pub const FLASHCORE_F16: i32 = 1;
/// `FlashcoreTensor::dtype` of bfloat16.
pub const FLASHCORE_BF16: i32 = 2;
/// `FlashcoreTensor::dtype` of float32 (describable, but no kernel takes it).
pub const FLASHCORE_F32: i32 = 3;

pub use crate::error::codes::*;

/// The element types, by name: the constants above.
const DTYPES: [(&str, i32); 3] = [
    ("FLASHCORE_F16", FLASHCORE_F16),
    ("FLASHCORE_BF16", FLASHCORE_BF16),
    ("FLASHCORE_F32", FLASHCORE_F32),
];

const N_CONSTANTS: usize = DTYPES.len() + RETURN_CODES.len();

/// [`DTYPES`] followed by [`RETURN_CODES`], built at compile time.
const CONSTANTS: [(&str, i32); N_CONSTANTS] = {
    let mut out = [("", 0); N_CONSTANTS];
    let mut i = 0;
    while i < DTYPES.len() {
        out[i] = DTYPES[i];
        i += 1;
    }
    let mut j = 0;
    while j < RETURN_CODES.len() {
        out[i + j] = (RETURN_CODES[j].name, RETURN_CODES[j].code);
        j += 1;
    }
    out
};

/// Every `FLASHCORE_*` constant by name, for the header test and for bindings: the dtypes,
/// then the return codes of [`RETURN_CODES`].
pub const FLASHCORE_CONSTANTS: &[(&str, i32)] = &CONSTANTS;

// ---- types -------------------------------------------------------------------------------

/// A device tensor as C passes it: logical dimensions `[batch, seq, heads, head_dim]`,
/// strides in elements. 80 bytes: 4 bytes of padding follow `dtype`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashcoreTensor {
    /// Device address (`CUdeviceptr`) of element `[0, 0, 0, 0]`.
    pub ptr: u64,
    /// `FLASHCORE_F16`, `FLASHCORE_BF16` or `FLASHCORE_F32`.
    pub dtype: i32,
    /// `[batch, seq, heads, head_dim]`; negative values are an error.
    pub shape: [i64; 4],
    /// Strides in elements of the same dimensions; negative values are an error.
    pub strides: [i64; 4],
}

/// The opaque handle C holds: forward attention on one device.
pub struct FlashcoreContext {
    attn: Attention,
}

// The header promises that one context may be used from several threads at once.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<FlashcoreContext>()
};

// ---- errors ------------------------------------------------------------------------------

/// Why an entry point failed: its code and message.
#[derive(Debug)]
struct Failure {
    code: i32,
    message: String,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

fn null_argument(what: &str) -> Failure {
    Failure {
        code: FLASHCORE_ERROR_NULL_ARGUMENT,
        message: format!("{what} is a null pointer"),
    }
}

thread_local! {
    /// The message of the last failing call on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: String) {
    // A message with an interior NUL would be cut short by C; replace them instead.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // try_with: during thread teardown the slot may be gone; the code still says enough.
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = c;
        }
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

/// Runs `body` for the entry point `name`: success is 0; a failure or a panic stores its
/// message (prefixed with `name`) for [`flashcore_last_error`] and returns its code.
fn guard(name: &str, body: impl FnOnce() -> Result<(), Failure>) -> i32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => FLASHCORE_SUCCESS,
        Ok(Err(f)) => {
            set_last_error(format!("{name}: {}", f.message));
            f.code
        }
        Err(payload) => {
            set_last_error(format!(
                "{name}: internal panic: {}",
                panic_message(payload.as_ref())
            ));
            FLASHCORE_ERROR_PANIC
        }
    }
}

// ---- conversions -------------------------------------------------------------------------

fn dtype_from_code(code: i32, tensor: &str) -> Result<DType, Error> {
    match code {
        FLASHCORE_F16 => Ok(DType::F16),
        FLASHCORE_BF16 => Ok(DType::Bf16),
        FLASHCORE_F32 => Ok(DType::F32),
        _ => Err(Error::UnsupportedDType(format!(
            "{tensor} has dtype code {code}; expected FLASHCORE_F16 ({FLASHCORE_F16}), \
             FLASHCORE_BF16 ({FLASHCORE_BF16}) or FLASHCORE_F32 ({FLASHCORE_F32})"
        ))),
    }
}

/// A C tensor as a [`TensorView`]: known dtype code, no negative extent or stride.
fn tensor_view(t: &FlashcoreTensor, tensor: &'static str) -> Result<TensorView, Error> {
    let dtype = dtype_from_code(t.dtype, tensor)?;
    let mut shape = [0usize; 4];
    let mut strides = [0usize; 4];
    for i in 0..4 {
        shape[i] = usize::try_from(t.shape[i]).map_err(|_| {
            Error::InvalidArgument(format!(
                "{tensor}.shape[{i}] ({}) is {}, which is not a valid extent",
                DIM_NAMES[i], t.shape[i]
            ))
        })?;
        strides[i] = usize::try_from(t.strides[i]).map_err(|_| Error::BadStrides {
            tensor,
            reason: format!(
                "strides[{i}] ({}) is {}; strides must be non-negative",
                DIM_NAMES[i], t.strides[i]
            ),
        })?;
    }
    Ok(TensorView::strided(t.ptr, dtype, shape, strides))
}

/// Reads the C tensor behind `t`.
///
/// # Safety
///
/// `t` must be null or point to a readable `FlashcoreTensor`.
unsafe fn read_tensor(
    t: *const FlashcoreTensor,
    tensor: &'static str,
) -> Result<TensorView, Failure> {
    // SAFETY: the caller guarantees `t` is null or valid for reads; `as_ref` handles null.
    let t = unsafe { t.as_ref() }.ok_or_else(|| null_argument(tensor))?;
    Ok(tensor_view(t, tensor)?)
}

/// The tensors of a forward call, read from C.
struct ForwardArgs {
    q: TensorView,
    k: TensorView,
    v: TensorView,
    o: TensorView,
    lse: Option<LseView>,
}

impl ForwardArgs {
    /// Reads the four C tensors; an LSE address of 0 means none.
    ///
    /// # Safety
    ///
    /// Each tensor pointer must be null or point to a readable `FlashcoreTensor`.
    unsafe fn read(
        q: *const FlashcoreTensor,
        k: *const FlashcoreTensor,
        v: *const FlashcoreTensor,
        o: *const FlashcoreTensor,
        lse: u64,
    ) -> Result<ForwardArgs, Failure> {
        // SAFETY: forwarded from the caller's guarantee.
        unsafe {
            Ok(ForwardArgs {
                q: read_tensor(q, "q")?,
                k: read_tensor(k, "k")?,
                v: read_tensor(v, "v")?,
                o: read_tensor(o, "o")?,
                lse: (lse != 0).then_some(LseView { ptr: lse }),
            })
        }
    }
}

/// The forward options: scale 0 (either sign) means the default `1/sqrt(head_dim)`, any
/// other value (NaN and infinities included, which validation rejects) is used as given.
fn params(softmax_scale: f32, causal: i32) -> AttentionParams {
    AttentionParams {
        softmax_scale: (softmax_scale != 0.0).then_some(softmax_scale),
        causal: causal != 0,
    }
}

// ---- entry points ------------------------------------------------------------------------

/// Opens device `device_ordinal` and creates a context on it; `*out` receives the handle
/// (null on failure). The context must be released with [`flashcore_destroy`].
///
/// # Safety
///
/// `out` must be null or valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_create(
    device_ordinal: i32,
    out: *mut *mut FlashcoreContext,
) -> i32 {
    guard("flashcore_create", || {
        if out.is_null() {
            return Err(null_argument("out"));
        }
        // SAFETY: `out` is non-null and the caller guarantees it is valid for writes.
        unsafe { out.write(std::ptr::null_mut()) };
        let ordinal = usize::try_from(device_ordinal).map_err(|_| {
            Error::InvalidArgument(format!("device ordinal {device_ordinal} is negative"))
        })?;
        let device = Arc::new(Device::new(ordinal)?);
        let ctx = Box::new(FlashcoreContext {
            attn: Attention::new(device)?,
        });
        // SAFETY: as above; ownership of the box passes to the caller.
        unsafe { out.write(Box::into_raw(ctx)) };
        Ok(())
    })
}

/// Destroys a context made by [`flashcore_create`]; null is a no-op.
///
/// # Safety
///
/// `ctx` must be null or a handle from [`flashcore_create`] not destroyed yet, and no other
/// thread may be using it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_destroy(ctx: *mut FlashcoreContext) {
    if ctx.is_null() {
        return;
    }
    guard("flashcore_destroy", || {
        // SAFETY: `ctx` came from Box::into_raw in flashcore_create and is destroyed once
        // (the caller's contract), so re-boxing it and dropping it is sound.
        drop(unsafe { Box::from_raw(ctx) });
        Ok(())
    });
}

/// `o = softmax(q kᵀ · scale) v` on `stream`; see `include/flashcore.h` for the contract.
///
/// # Safety
///
/// `ctx` must be null or a live handle from [`flashcore_create`]; `q`, `k`, `v`, `o` null
/// or readable `FlashcoreTensor`s whose device memory (and `lse`'s, when non-zero) is live
/// memory of the context's device for the views' extents until the kernel has run;
/// `stream` null or a live stream of the device's primary context.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    stream: CUstream,
) -> i32 {
    guard("flashcore_forward", || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle; only shared access
        // is needed (Attention::forward takes &self).
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees each tensor pointer is null or readable.
        let ForwardArgs { q, k, v, o, lse } = unsafe { ForwardArgs::read(q, k, v, o, lse)? };
        let params = params(softmax_scale, causal);
        // SAFETY: the C contract of flashcore_forward (header): the pointers are device
        // memory of the context's device valid for the described extents, and `stream` is
        // null or a stream of that context.
        unsafe {
            ctx.attn
                .forward(&q, &k, &v, &o, lse.as_ref(), &params, stream)?;
        }
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_forward`] call without a context, a device or a
/// driver: every rule `flashcore_forward` applies before it launches. Nothing is read
/// through the pointers; they are only checked as numbers (non-null, aligned, ranges
/// not overlapping).
///
/// # Safety
///
/// `q`, `k`, `v`, `o` must each be null or point to a readable `FlashcoreTensor`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
) -> i32 {
    guard("flashcore_check_forward", || {
        // SAFETY: the caller guarantees each tensor pointer is null or readable.
        let ForwardArgs { q, k, v, o, lse } = unsafe { ForwardArgs::read(q, k, v, o, lse)? };
        validate_fwd(&q, &k, &v, &o, lse.as_ref(), &params(softmax_scale, causal))?;
        Ok(())
    })
}

/// The message of the last failing flashcore call on this thread, `""` if none failed.
/// The pointer stays valid until the next flashcore call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn flashcore_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| match slot.try_borrow() {
            Ok(s) => s.as_ptr(),
            Err(_) => c"".as_ptr(),
        })
        .unwrap_or(c"".as_ptr())
}

/// The symbolic name of a return code (`"FLASHCORE_ERROR_BAD_STRIDES"`), or
/// `"FLASHCORE_ERROR_UNKNOWN"`; a static string.
#[unsafe(no_mangle)]
pub extern "C" fn flashcore_error_name(code: i32) -> *const c_char {
    error_name(code).as_ptr()
}

fn error_name(code: i32) -> &'static CStr {
    return_code(code).map_or(c"FLASHCORE_ERROR_UNKNOWN", |r| r.c_name)
}

const VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("the package version contains a NUL byte"),
    };

/// The library version, e.g. `"0.1.0"`; a static string.
#[unsafe(no_mangle)]
pub extern "C" fn flashcore_version() -> *const c_char {
    VERSION.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::device::driver_present;
    use crate::ptx::PtxError;
    use std::ptr;

    fn last_error() -> String {
        // SAFETY: flashcore_last_error returns a valid NUL-terminated string that lives
        // until the next flashcore call on this thread; it is copied out at once.
        unsafe { CStr::from_ptr(flashcore_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    fn tensor(dtype: i32) -> FlashcoreTensor {
        FlashcoreTensor {
            ptr: 0x1000,
            dtype,
            shape: [1, 128, 2, 64],
            strides: [128 * 2 * 64, 2 * 64, 64, 1],
        }
    }

    #[test]
    fn null_pointers_are_null_argument() {
        let t = tensor(FLASHCORE_F16);
        // SAFETY: every pointer is null or points at a live local.
        let rc = unsafe {
            flashcore_forward(ptr::null_mut(), &t, &t, &t, &t, 0, 0.0, 0, ptr::null_mut())
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_forward: ctx is a null pointer");

        // SAFETY: a null `out` is allowed and must be reported, not written.
        let rc = unsafe { flashcore_create(0, ptr::null_mut()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_create: out is a null pointer");

        for name in ["q", "k", "v", "o"] {
            // SAFETY: a null tensor pointer is allowed and reported.
            let r = unsafe { read_tensor(ptr::null(), name) };
            let f = r.expect_err("null tensor accepted");
            assert_eq!(f.code, FLASHCORE_ERROR_NULL_ARGUMENT);
            assert_eq!(f.message, format!("{name} is a null pointer"));
        }
        // SAFETY: destroying null is a documented no-op.
        unsafe { flashcore_destroy(ptr::null_mut()) };
    }

    #[test]
    fn failures_set_the_message_and_success_keeps_it() {
        let rc = guard("flashcore_forward", || {
            // SAFETY: points at a live local.
            unsafe { read_tensor(&tensor(7), "k") }.map(drop)
        });
        assert_eq!(rc, FLASHCORE_ERROR_UNSUPPORTED_DTYPE);
        let msg = last_error();
        assert!(msg.starts_with("flashcore_forward: unsupported dtype: k has dtype code 7"));
        assert!(msg.contains("FLASHCORE_BF16 (2)"), "{msg}");
        assert_eq!(guard("flashcore_forward", || Ok(())), FLASHCORE_SUCCESS);
        assert_eq!(last_error(), msg);
        // Messages are per thread.
        let other = std::thread::spawn(last_error).join().unwrap();
        assert_eq!(other, "");
    }

    #[test]
    fn check_forward_applies_the_forward_rules_without_a_device() {
        let (q, k, v) = (
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
        );
        let mut o = tensor(FLASHCORE_F16);
        o.ptr = 0x10_0000; // past q, k and v, which share [0x1000, 0x11000)
        // SAFETY: every tensor pointer points at a live local.
        let check = |o: &FlashcoreTensor, lse: u64, scale: f32| unsafe {
            flashcore_check_forward(&q, &k, &v, o, lse, scale, 1)
        };
        assert_eq!(check(&o, 0, 0.0), FLASHCORE_SUCCESS, "{}", last_error());
        assert_eq!(check(&o, 0x20_0000, 0.125), FLASHCORE_SUCCESS);

        assert_eq!(check(&o, 0, f32::NAN), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(last_error().starts_with("flashcore_check_forward: "));
        assert_eq!(check(&o, 0x20_0002, 0.0), FLASHCORE_ERROR_MISALIGNED);
        let mut bad = o;
        bad.shape[3] = 48;
        assert_eq!(check(&bad, 0, 0.0), FLASHCORE_ERROR_SHAPE_MISMATCH);
        let mut overlapping = o;
        overlapping.ptr = 0x2000;
        assert_eq!(
            check(&overlapping, 0, 0.0),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("overlaps"), "{}", last_error());
        // SAFETY: a null tensor pointer is allowed and reported.
        let rc = unsafe { flashcore_check_forward(&q, ptr::null(), &v, &o, 0, 0.0, 0) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
    }

    #[test]
    fn tensor_conversion() {
        let good = tensor_view(&tensor(FLASHCORE_BF16), "q").unwrap();
        assert_eq!(good.dtype, DType::Bf16);
        assert_eq!(good.shape, [1, 128, 2, 64]);
        assert_eq!(good.strides, [128 * 2 * 64, 2 * 64, 64, 1]);
        assert_eq!(good.ptr, 0x1000);
        assert_eq!(
            tensor_view(&tensor(FLASHCORE_F32), "q").unwrap().dtype,
            DType::F32
        );

        for bad in [0, 4, -1, i32::MAX] {
            let e = tensor_view(&tensor(bad), "v").unwrap_err();
            assert_eq!(e.code(), FLASHCORE_ERROR_UNSUPPORTED_DTYPE, "{bad}");
        }

        let mut t = tensor(FLASHCORE_F16);
        t.shape[1] = -5;
        let e = tensor_view(&t, "q").unwrap_err();
        assert_eq!(e.code(), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(e.to_string().contains("q.shape[1] (seqlen) is -5"), "{e}");

        let mut t = tensor(FLASHCORE_F16);
        t.strides[2] = -64;
        let e = tensor_view(&t, "o").unwrap_err();
        assert_eq!(e.code(), FLASHCORE_ERROR_BAD_STRIDES);
        assert!(e.to_string().contains("bad strides for o"), "{e}");
    }

    #[test]
    fn params_mapping() {
        assert_eq!(params(0.0, 0), AttentionParams::default());
        assert_eq!(params(-0.0, 0).softmax_scale, None);
        let p = params(0.5, 7);
        assert_eq!(p.softmax_scale, Some(0.5));
        assert!(p.causal);
        assert!(params(f32::NAN, 0).softmax_scale.unwrap().is_nan());
    }

    #[test]
    fn create_without_driver_is_no_driver() {
        let mut ctx: *mut FlashcoreContext = ptr::dangling_mut();
        // SAFETY: `ctx` is a valid place for one pointer.
        let rc = unsafe { flashcore_create(-1, &mut ctx) };
        assert_eq!(rc, FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(ctx.is_null(), "out not cleared on failure");
        assert!(last_error().contains("device ordinal -1 is negative"));

        if driver_present() {
            // A GPU machine: a real context, a refused call through it, and its release.
            let count = crate::host::device::device_count().unwrap_or(0);
            // SAFETY: `ctx` is a valid place for one pointer.
            let rc = unsafe { flashcore_create(count as i32, &mut ctx) };
            assert_eq!(rc, FLASHCORE_ERROR_NO_DEVICE, "{}", last_error());
            if count == 0 {
                return;
            }
            // SAFETY: as above.
            let rc = unsafe { flashcore_create(0, &mut ctx) };
            if rc == FLASHCORE_ERROR_UNSUPPORTED_GPU {
                return;
            }
            assert_eq!(rc, FLASHCORE_SUCCESS, "{}", last_error());
            assert!(!ctx.is_null());
            let (good, bad) = (tensor(FLASHCORE_F16), tensor(9));
            // SAFETY: `ctx` is live; the tensors are live locals; nothing is launched
            // because the dtype check fails first.
            let rc = unsafe {
                flashcore_forward(ctx, &bad, &good, &good, &good, 0, 0.0, 1, ptr::null_mut())
            };
            assert_eq!(rc, FLASHCORE_ERROR_UNSUPPORTED_DTYPE);
            assert!(last_error().contains("q has dtype code 9"));
            // SAFETY: `ctx` came from flashcore_create and is destroyed once.
            unsafe { flashcore_destroy(ctx) };
            return;
        }
        ctx = ptr::dangling_mut();
        // SAFETY: as above.
        let rc = unsafe { flashcore_create(0, &mut ctx) };
        assert_eq!(rc, FLASHCORE_ERROR_NO_DRIVER);
        assert!(ctx.is_null());
        let msg = last_error();
        assert!(msg.starts_with("flashcore_create: no CUDA driver"), "{msg}");
    }

    #[test]
    fn panics_become_an_error_code() {
        let rc = guard("flashcore_forward", || panic!("boom {}", 42));
        assert_eq!(rc, FLASHCORE_ERROR_PANIC);
        assert_eq!(last_error(), "flashcore_forward: internal panic: boom 42");
        let rc = guard("flashcore_forward", || std::panic::panic_any(5u8));
        assert_eq!(rc, FLASHCORE_ERROR_PANIC);
        assert!(last_error().ends_with("(no message)"));
    }

    #[test]
    fn error_names_cover_every_code() {
        // One value of every Error variant: its code must be the matching constant.
        let errors = [
            (Error::NoDriver, "FLASHCORE_ERROR_NO_DRIVER"),
            (
                Error::NoDevice {
                    ordinal: 1,
                    count: 0,
                },
                "FLASHCORE_ERROR_NO_DEVICE",
            ),
            (
                Error::UnsupportedGpu {
                    name: "x".into(),
                    major: 7,
                    minor: 5,
                },
                "FLASHCORE_ERROR_UNSUPPORTED_GPU",
            ),
            (
                Error::ShapeMismatch("x".into()),
                "FLASHCORE_ERROR_SHAPE_MISMATCH",
            ),
            (
                Error::BadStrides {
                    tensor: "q",
                    reason: "x".into(),
                },
                "FLASHCORE_ERROR_BAD_STRIDES",
            ),
            (
                Error::EmptyDimension {
                    tensor: "q",
                    dim: "batch",
                },
                "FLASHCORE_ERROR_EMPTY_DIMENSION",
            ),
            (
                Error::UnsupportedHeadDim(48, "x"),
                "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM",
            ),
            (
                Error::UnsupportedDType("x".into()),
                "FLASHCORE_ERROR_UNSUPPORTED_DTYPE",
            ),
            (
                Error::HeadRatio { hq: 3, hkv: 2 },
                "FLASHCORE_ERROR_HEAD_RATIO",
            ),
            (Error::NullPointer("q"), "FLASHCORE_ERROR_NULL_POINTER"),
            (
                Error::Misaligned {
                    tensor: "q",
                    ptr: 1,
                    align: 16,
                },
                "FLASHCORE_ERROR_MISALIGNED",
            ),
            (
                Error::InvalidArgument("x".into()),
                "FLASHCORE_ERROR_INVALID_ARGUMENT",
            ),
            (
                Error::Ptx(PtxError::BadName("x".into())),
                "FLASHCORE_ERROR_PTX",
            ),
            (
                Error::ModuleLoad {
                    kernel: "x".into(),
                    code: "x".into(),
                    log: "x".into(),
                },
                "FLASHCORE_ERROR_MODULE_LOAD",
            ),
            (
                Error::Driver {
                    call: "cuInit",
                    code: "x".into(),
                },
                "FLASHCORE_ERROR_DRIVER",
            ),
            (
                Error::TensorMap(crate::tma::TensorMapError::Rank { rank: 6 }),
                "FLASHCORE_ERROR_TENSOR_MAP",
            ),
        ];
        let value = |name: &str| {
            FLASHCORE_CONSTANTS
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{name} missing from FLASHCORE_CONSTANTS"))
                .1
        };
        for (e, name) in &errors {
            assert_eq!(e.code(), value(name), "{e:?}");
        }

        // Every error code has its own name, and the name is the constant's.
        let mut codes: Vec<i32> = Vec::new();
        for &(name, code) in FLASHCORE_CONSTANTS {
            if name == "FLASHCORE_SUCCESS" || name.starts_with("FLASHCORE_ERROR_") {
                // SAFETY: flashcore_error_name returns a static NUL-terminated string.
                let got = unsafe { CStr::from_ptr(flashcore_error_name(code)) };
                assert_eq!(got.to_str().unwrap(), name);
                assert!(!codes.contains(&code), "code {code} used twice");
                codes.push(code);
            }
        }
        assert_eq!(codes.len(), errors.len() + 3); // + success, null argument, panic
        assert!(codes.iter().all(|&c| c >= 0));
        assert!(
            codes
                .iter()
                .filter(|&&c| c != FLASHCORE_ERROR_NULL_ARGUMENT && c != FLASHCORE_ERROR_PANIC)
                .all(|&c| c < FLASHCORE_ERROR_NULL_ARGUMENT)
        );
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(flashcore_error_name(-3)) };
        assert_eq!(unknown.to_str().unwrap(), "FLASHCORE_ERROR_UNKNOWN");
    }

    #[test]
    fn version_is_the_package_version() {
        // SAFETY: a static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(flashcore_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn tensor_layout_is_the_c_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<FlashcoreTensor>(), 80);
        assert_eq!(align_of::<FlashcoreTensor>(), 8);
        assert_eq!(offset_of!(FlashcoreTensor, ptr), 0);
        assert_eq!(offset_of!(FlashcoreTensor, dtype), 8);
        assert_eq!(offset_of!(FlashcoreTensor, shape), 16);
        assert_eq!(offset_of!(FlashcoreTensor, strides), 48);
    }
}
