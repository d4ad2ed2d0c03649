//! The one error type of the crate. Every fallible public function returns [`Result`].

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
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The stable integer the C ABI returns for this error (0 is success).
    pub fn code(&self) -> i32 {
        match self {
            Error::NoDriver => 1,
            Error::NoDevice { .. } => 2,
            Error::UnsupportedGpu { .. } => 3,
            Error::ShapeMismatch(_) => 4,
            Error::BadStrides { .. } => 5,
            Error::EmptyDimension { .. } => 6,
            Error::UnsupportedHeadDim(..) => 7,
            Error::UnsupportedDType(_) => 8,
            Error::HeadRatio { .. } => 9,
            Error::NullPointer(_) => 10,
            Error::Misaligned { .. } => 11,
            Error::InvalidArgument(_) => 12,
            Error::Ptx(_) => 13,
            Error::ModuleLoad { .. } => 14,
            Error::Driver { .. } => 15,
        }
    }
}
