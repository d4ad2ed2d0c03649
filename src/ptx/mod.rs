//! A typed builder that emits PTX text.
//!
//! Registers carry their PTX type (`Reg<F32>`, `Reg<U64>`, `Reg<Pred>`), so an operand of
//! the wrong type or a fragment of the wrong size does not compile. What types cannot
//! express (a label placed twice, a register from another kernel, an immediate out of
//! range) is recorded and returned by [`Kernel::finish`] as a [`PtxError`]: a bad
//! kernel is never emitted.
//!
//! Instruction families live one per file and are methods on [`Kernel`]:
//! [`arith`] (integer and float arithmetic, comparisons), [`convert`] (`cvt`, packing),
//! [`memory`] (`ld`/`st`, `cp.async`), [`mma`] (`ldmatrix`, `mma.sync`),
//! [`warp`] (`shfl.sync`), [`sync`] (`bar.sync`).

pub mod arith;
pub mod convert;
pub mod kernel;
pub mod memory;
pub mod mma;
pub mod module;
pub mod sync;
pub mod types;
pub mod warp;

pub use kernel::{Cmp, Kernel, KernelText, Label, Param, ParamBytes, Reg, Special, Src};
pub use module::{Module, Target};
pub use types::*;

/// A kernel the builder refused to emit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PtxError {
    #[error("`{0}` is not a valid PTX identifier")]
    BadName(String),
    #[error("bad parameter: {0}")]
    BadParam(String),
    #[error("bad shared-memory declaration: {0}")]
    BadShared(String),
    #[error("bad control flow: {0}")]
    BadControlFlow(String),
    #[error("kernel `{0}` used a register made by another kernel")]
    ForeignRegister(String),
    #[error("bad operand: {0}")]
    BadOperand(String),
    #[error("kernel `{kernel}` needs {needs} but the module targets {target}")]
    TargetTooOld {
        kernel: String,
        needs: &'static str,
        target: &'static str,
    },
}
