//! A typed builder that emits PTX text.
//!
//! Registers carry their PTX type (`Reg<F32>`, `Reg<U64>`, `Reg<Pred>`), so an operand of
//! the wrong type or a fragment of the wrong size does not compile. What types cannot
//! express (a label placed twice, a register from another kernel, an immediate out of
//! range) is recorded and returned by [`Kernel::finish`] as a [`PtxError`]: a bad
//! kernel is never emitted.
//!
//! Instruction families live one per file and are methods on [`Kernel`]:
//! [`arith`] (integer and float arithmetic, comparisons), [`convert`] (`cvt`, packing,
//! `prmt`), [`memory`] (`ld`/`st`, `cp.async`), [`mma`] (`ldmatrix`, `stmatrix`,
//! `mma.sync`), [`warp`] (`shfl.sync`, `elect.sync`), [`sync`] (`bar.sync`, named
//! barriers, fences, `setmaxnreg`), [`mbarrier`] (mbarriers and the [`StageRing`]),
//! [`tma`] (bulk tensor copies), [`wgmma`] (warpgroup MMA with typed accumulators).
//!
//! Above single instructions: [`smem`] plans a kernel's dynamic shared memory (typed
//! [`SmemAddr`] and [`Mbarrier`] handles), [`layout`] describes a tile's swizzled layout
//! once for TMA, wgmma descriptors and address math, and [`target`] says which
//! instruction families a `.target` has.
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
//! An FP8 operand read MN-major (transposed) does not compile: wgmma has no transpose
//! for e4m3.
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let mut plan = SmemPlan::new();
//! let layout = SmemLayout::new(64, 128, 1, Swizzle::B128);
//! let slot = plan.tile(layout, 1);
//! let smem = k.shared_memory(&plan);
//! let at = smem.tile(&mut k, slot, 0);
//! let a = k.smem_desc::<KMajor>(at, &layout);
//! let b = k.smem_desc::<MnMajor>(at, &layout);
//! let acc = k.acc::<N64>();
//! let _ = k.wgmma_ss::<E4m3x4, N64, KMajor, MnMajor>(acc, a, b, ScaleD::Zero);
//! ```
//! Nor reading an accumulator while its wgmma is in flight: an [`InFlight`] has no
//! registers to hand out.
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let mut plan = SmemPlan::new();
//! let layout = SmemLayout::new(64, 64, 2, Swizzle::B128);
//! let slot = plan.tile(layout, 1);
//! let smem = k.shared_memory(&plan);
//! let at = smem.tile(&mut k, slot, 0);
//! let a = k.smem_desc::<KMajor>(at, &layout);
//! let acc = k.acc::<N64>();
//! let flying = k.wgmma_ss::<Bf16x2, N64, KMajor, KMajor>(acc, a, a, ScaleD::Zero);
//! let _ = flying.regs();
//! ```
//! Nor a shared address where a global one is expected:
//! ```compile_fail
//! use flashcore::ptx::*;
//! let mut k = Kernel::new("bad");
//! let mut plan = SmemPlan::new();
//! let slot = plan.tile(SmemLayout::new(8, 64, 2, Swizzle::B128), 1);
//! let smem = k.shared_memory(&plan);
//! let at = smem.tile(&mut k, slot, 0);
//! let _ = k.ld_global::<F32>(at, 0);
//! ```
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
pub mod error;
pub mod kernel;
pub mod layout;
pub mod mbarrier;
pub mod memory;
pub mod mma;
pub mod module;
pub mod smem;
pub mod sync;
pub mod target;
pub mod tma;
pub mod types;
pub mod warp;
pub mod wgmma;

pub use arith::FastDivisor;
pub use error::PtxError;
pub use kernel::{Cmp, Kernel, KernelText, Label, Param, ParamBytes, Reg, Special, Src};
pub use layout::{SmemLayout, Swizzle};
pub use mbarrier::{Parity, RingBarriers, StageRing};
pub use module::Module;
pub use smem::{BarrierSlot, Mbarrier, RawSlot, Smem, SmemAddr, SmemPlan, TileSlot};
pub use sync::{BarrierRing, NamedBarrier};
pub use target::{Feature, Features, Target};
pub use tma::{CachePolicy, TmaDesc};
pub use types::*;
pub use wgmma::shapes::*;
pub use wgmma::{
    Acc, DescOffsets, InFlight, KMajor, Major, MajorFor, MnMajor, ScaleD, SmemDesc, WgmmaD,
    WgmmaInput, WgmmaN,
};
