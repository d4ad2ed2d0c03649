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
//!
//! ```
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("scale");
//! let p = k.param::<U64>("x");
//! let x = k.load_param(p);
//! let v = k.ld_global::<F32>(x, 0);
//! let doubled = k.mul(v, 2.0f32);
//! k.st_global(x, 0, doubled);
//! let mut m = Module::new(Target::Sm80);
//! m.push(k.finish()?)?;
//! assert!(m.to_ptx().contains("mul.rn.f32 %f1, %f0, 0f40000000;"));
//! # Ok::<(), PtxError>(())
//! ```
//!
//! An `f32` register where a 64-bit address is needed does not compile:
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let f = k.mov::<F32>(1.0f32);
//! let _ = k.ld_global::<F32>(f, 0);
//! ```
//! Nor does mixing types in arithmetic:
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let f = k.mov::<F32>(1.0f32);
//! let _ = k.add(f, 1u32);
//! ```
//! Nor a fragment of the wrong size:
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let d = k.regs::<F32, 4>();
//! let a = k.regs::<F16x2, 3>();
//! let b = k.regs::<F16x2, 2>();
//! k.mma_m16n8k16(&d, &a, &b, &d);
//! ```
//! Nor an f16 fragment in a bf16 `mma`:
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let d = k.regs::<F32, 4>();
//! let a = k.regs::<F16x2, 4>();
//! let b = k.regs::<Bf16x2, 2>();
//! k.mma_m16n8k16(&d, &a, &b, &d);
//! ```
//! Nor reinterpreting a register as a type of another width:
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let r = k.mov::<U32>(1u32);
//! let _wide: Reg<U64> = r.cast::<U64>();
//! ```

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
