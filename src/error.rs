//! The one error type of the crate. Every fallible public function returns [`Result`].
//!
//! The C ABI's return codes are defined here too, in one table ([`RETURN_CODES`]).

use std::ffi::CStr;

use crate::ptx::PtxError;

/// What went wrong, typed so callers (and the C ABI) can tell cases apart.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded on this machine")]
    NoDriver,
    /// The driver is present but reports no device (or not the one asked for).
    #[error("no CUDA device with ordinal {ordinal} (the driver reports {count})")]
    NoDevice { ordinal: usize, count: usize },
    /// The GPU's architecture has no kernel path.
    #[error("unsupported GPU: {name} is sm_{major}{minor}; flashcore needs sm_80 or newer")]
    UnsupportedGpu {
        name: String,
        major: i32,
        minor: i32,
    },
    /// Two tensors disagree on a dimension, or a tensor has the wrong rank or extent.
    #[error("shape mismatch: {0}")]
    ShapeMismatch(String),
    /// A stride is not usable: last dimension not contiguous, or overlapping/overflowing strides.
    #[error("bad strides for {tensor}: {reason}")]
    BadStrides {
        tensor: &'static str,
        reason: String,
    },
    /// A dimension is zero.
    #[error("{tensor} has a zero-size dimension ({dim})")]
    EmptyDimension {
        tensor: &'static str,
        dim: &'static str,
    },
    /// The head dimension has no kernel.
    #[error("unsupported head dimension {0} (supported: {1})")]
    UnsupportedHeadDim(usize, &'static str),
    /// The dtype has no kernel, or the tensors' dtypes differ.
    #[error("unsupported dtype: {0}")]
    UnsupportedDType(String),
    /// Hq is not a multiple of Hkv.
    #[error("query heads ({hq}) must be a multiple of key/value heads ({hkv})")]
    HeadRatio { hq: usize, hkv: usize },
    /// A device pointer is null.
    #[error("{0} is a null pointer")]
    NullPointer(&'static str),
    /// A device pointer is not aligned as the kernel needs.
    #[error("{tensor} pointer {ptr:#x} is not {align}-byte aligned")]
    Misaligned {
        tensor: &'static str,
        ptr: u64,
        align: u64,
    },
    /// An argument outside its domain (a non-finite softmax scale, say).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The PTX builder rejected a kernel (a bug in a generator, surfaced as an error).
    #[error("PTX generation failed: {0}")]
    Ptx(#[from] PtxError),
    /// The driver's JIT (ptxas) refused the module; `log` holds its error log.
    #[error("loading kernel {kernel} failed ({code}): {log}")]
    ModuleLoad {
        kernel: String,
        code: String,
        log: String,
    },
    /// Any other driver call failed.
    #[error("CUDA driver call {call} failed: {code}")]
    Driver { call: &'static str, code: String },
    /// A tensor cannot be described to the tensor memory accelerator (a rule of
    /// `cuTensorMapEncodeTiled` it breaks).
    #[error("tensor map: {0}")]
    TensorMap(#[from] crate::tma::TensorMapError),
}

impl Error {
    /// Whether a tensor map was refused (by its rules, or by the driver as an invalid
    /// value): the sm90a launches then run the call on the kernel that reads without
    /// TMA. Any other failure (no context current, a driver in a bad state) is not the
    /// view's fault and is reported as it is, not hidden behind a slower kernel.
    pub(crate) fn is_map_refusal(&self) -> bool {
        match self {
            Error::TensorMap(_) => true,
            Error::Driver { call, code } => {
                *call == "cuTensorMapEncodeTiled" && code == "CUDA_ERROR_INVALID_VALUE"
            }
            _ => false,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One C ABI return code: its value, its `#define` name and the one-line summary that
/// follows the `#define` in `include/flashcore.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReturnCode {
    pub code: i32,
    /// The symbolic name, e.g. `"FLASHCORE_ERROR_BAD_STRIDES"`.
    pub name: &'static str,
    /// The same name NUL-terminated, for `flashcore_error_name`.
    pub c_name: &'static CStr,
    /// What the code means, as the header's comment says it.
    pub summary: &'static str,
}

/// `s` (which must end in one NUL and contain no other) as a `CStr`, at compile time.
const fn c_str(s: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(s.as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("a return-code name is not a NUL-terminated string"),
    }
}

/// Defines, from one list, everything the return codes are written as in Rust:
/// [`Error::code`] (the entries with `for PATTERN`; the match must be exhaustive, so a new
/// [`Error`] variant does not compile without a code), one `pub const NAME: i32` per entry
/// in [`codes`], and [`RETURN_CODES`]. `tests/c_header.rs` checks the header's `#define`s
/// against [`RETURN_CODES`].
macro_rules! return_codes {
    ($( $name:ident = $code:literal $(for $variant:pat)?, $summary:literal; )*) => {
        /// The C ABI's return codes as constants (re-exported by [`crate::ffi`]).
        pub mod codes {
            $(
                #[doc = concat!($summary, ".")]
                pub const $name: i32 = $code;
            )*
        }

        /// Every C ABI return code, in increasing order: the one table the constants,
        /// [`Error::code`], `flashcore_error_name` and the header are derived from or
        /// checked against.
        pub const RETURN_CODES: &[ReturnCode] = &[
            $(
                ReturnCode {
                    code: $code,
                    name: stringify!($name),
                    c_name: c_str(concat!(stringify!($name), "\0")),
                    summary: $summary,
                },
            )*
        ];

        impl Error {
            /// The stable integer the C ABI returns for this error (0 is success).
            pub fn code(&self) -> i32 {
                match self {
                    $($( $variant => $code, )?)*
                }
            }
        }
    };
}

return_codes! {
    FLASHCORE_SUCCESS = 0, "the call succeeded";
    FLASHCORE_ERROR_NO_DRIVER = 1 for Error::NoDriver, "libcuda could not be loaded";
    FLASHCORE_ERROR_NO_DEVICE = 2 for Error::NoDevice { .. }, "no device with that ordinal";
    FLASHCORE_ERROR_UNSUPPORTED_GPU = 3 for Error::UnsupportedGpu { .. },
        "below sm_80 (FP8: sm_89): no kernel path";
    FLASHCORE_ERROR_SHAPE_MISMATCH = 4 for Error::ShapeMismatch(_),
        "tensors disagree on a dimension";
    FLASHCORE_ERROR_BAD_STRIDES = 5 for Error::BadStrides { .. },
        "unusable or negative stride, or a range past the address space";
    FLASHCORE_ERROR_EMPTY_DIMENSION = 6 for Error::EmptyDimension { .. },
        "a dimension is zero";
    FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM = 7 for Error::UnsupportedHeadDim(..),
        "head_dim has no kernel (forward, decode, merge: a multiple of 8 up to 256; FP8 and e4m3 caches: 64, 128, 256)";
    FLASHCORE_ERROR_UNSUPPORTED_DTYPE = 8 for Error::UnsupportedDType(_),
        "not f16/bf16 (FP8: e4m3 codes), mixed, or unknown code";
    FLASHCORE_ERROR_HEAD_RATIO = 9 for Error::HeadRatio { .. },
        "q heads not a multiple of k/v heads";
    FLASHCORE_ERROR_NULL_POINTER = 10 for Error::NullPointer(_),
        "a device pointer is 0 (tensor, lse parts, lengths, table, offsets, workspace)";
    FLASHCORE_ERROR_MISALIGNED = 11 for Error::Misaligned { .. },
        "pointer not aligned (tensors 16 B; lse, scales, lengths, tables, offsets 4 B; decode workspace 256 B)";
    FLASHCORE_ERROR_INVALID_ARGUMENT = 12 for Error::InvalidArgument(_),
        "bad scale, negative shape or ordinal, overlap, too large";
    FLASHCORE_ERROR_PTX = 13 for Error::Ptx(_),
        "kernel generation failed (a flashcore bug)";
    FLASHCORE_ERROR_MODULE_LOAD = 14 for Error::ModuleLoad { .. },
        "the driver's JIT refused the kernel";
    FLASHCORE_ERROR_DRIVER = 15 for Error::Driver { .. }, "another CUDA driver call failed";
    FLASHCORE_ERROR_TENSOR_MAP = 16 for Error::TensorMap(_),
        "a tensor cannot be described to TMA";
    FLASHCORE_ERROR_NULL_ARGUMENT = 100, "a null host pointer (ctx, tensor struct, out)";
    FLASHCORE_ERROR_PANIC = 101, "internal panic caught (a flashcore bug)";
}

/// The entry of [`RETURN_CODES`] for `code`, if there is one.
pub fn return_code(code: i32) -> Option<&'static ReturnCode> {
    RETURN_CODES.iter().find(|r| r.code == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_well_formed() {
        let mut last = -1;
        for r in RETURN_CODES {
            assert!(
                r.code > last,
                "{} is out of order or repeats a code",
                r.name
            );
            last = r.code;
            assert!(r.name.starts_with("FLASHCORE_"), "{}", r.name);
            assert_eq!(r.c_name.to_str(), Ok(r.name));
            assert!(
                !r.summary.is_empty() && !r.summary.contains("*/") && !r.summary.contains('\n'),
                "{}: the summary must fit in one C comment line",
                r.name
            );
            assert_eq!(return_code(r.code), Some(r));
        }
        assert_eq!(RETURN_CODES[0].name, "FLASHCORE_SUCCESS");
        assert_eq!(RETURN_CODES[0].code, 0);
        assert_eq!(return_code(-1), None);
        assert_eq!(return_code(17), None);
        // The values are the C ABI: they never change.
        assert_eq!(codes::FLASHCORE_ERROR_NO_DRIVER, 1);
        assert_eq!(codes::FLASHCORE_ERROR_DRIVER, 15);
        assert_eq!(codes::FLASHCORE_ERROR_NULL_ARGUMENT, 100);
        assert_eq!(codes::FLASHCORE_ERROR_PANIC, 101);
        assert_eq!(Error::NoDriver.code(), codes::FLASHCORE_ERROR_NO_DRIVER);
        assert_eq!(
            Error::HeadRatio { hq: 3, hkv: 2 }.code(),
            codes::FLASHCORE_ERROR_HEAD_RATIO
        );
    }
}
