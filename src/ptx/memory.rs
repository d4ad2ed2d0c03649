//! Loads and stores (global and shared, scalar and vector), `cp.async` and global
//! reductions (`red`).
//!
//! Global addresses are `Reg<U64>` (generic 64-bit), shared addresses [`SmemAddr`]
//! (the 32-bit shared window). Offsets are byte immediates.

use super::error::PtxError;
use super::kernel::{Kernel, Reg, Src};
use super::smem::SmemAddr;
use super::target::Feature;
use super::types::*;

fn addr(base: String, offset: i32) -> String {
    match offset {
        0 => format!("[{base}]"),
        o => format!("[{base}+{o}]"),
    }
}

impl Kernel {
    /// `ld.global` of one 32-bit word.
    pub fn ld_global<T: Word32>(&mut self, base: Reg<U64>, offset: i32) -> Reg<T> {
        let d = self.reg::<T>();
        self.check_owner(&[Src::<U64>::owner(&base)]);
        let a = addr(base.name(), offset);
        self.emit(format!("ld.global.{} {}, {a};", T::MEM, d.name()));
        d
    }

    /// `ld.global` of one 32-bit word into an existing register: a load issued ahead
    /// of the loop iteration that uses it.
    pub fn ld_global_into<T: Word32>(&mut self, dst: Reg<T>, base: Reg<U64>, offset: i32) {
        self.check_owner(&[Src::<U64>::owner(&base), Src::<T>::owner(&dst)]);
        let a = addr(base.name(), offset);
        self.emit(format!("ld.global.{} {}, {a};", T::MEM, dst.name()));
    }

    /// `ld.global.v4` of four 32-bit words (16 bytes; the address must be 16-byte aligned).
    pub fn ld_global_v4<T: Word32>(&mut self, base: Reg<U64>, offset: i32) -> [Reg<T>; 4] {
        let d = self.regs::<T, 4>();
        self.check_owner(&[Src::<U64>::owner(&base)]);
        let a = addr(base.name(), offset);
        let [x, y, z, w] = d.map(|r| r.name());
        self.emit(format!(
            "ld.global.v4.{} {{{x}, {y}, {z}, {w}}}, {a};",
            T::MEM
        ));
        d
    }

    /// `ld.global.v4` into existing registers: under a guard ([`Kernel::guarded`]) a
    /// load that does not happen leaves them as they were (zeros set beforehand, say).
    pub fn ld_global_v4_into<T: Word32>(&mut self, dst: [Reg<T>; 4], base: Reg<U64>, offset: i32) {
        self.check_owner(&[Src::<U64>::owner(&base)]);
        self.check_owner(&dst.map(|r| Src::<T>::owner(&r)));
        let a = addr(base.name(), offset);
        let [x, y, z, w] = dst.map(|r| r.name());
        self.emit(format!(
            "ld.global.v4.{} {{{x}, {y}, {z}, {w}}}, {a};",
            T::MEM
        ));
    }

    /// `st.global` of one 32-bit word.
    pub fn st_global<T: Word32>(&mut self, base: Reg<U64>, offset: i32, v: impl Src<T>) {
        self.check_owner(&[Src::<U64>::owner(&base), v.owner()]);
        let a = addr(base.name(), offset);
        self.emit(format!("st.global.{} {a}, {};", T::MEM, v.operand()));
    }

    /// `st.global.v4` of four 32-bit words (16-byte aligned).
    pub fn st_global_v4<T: Word32>(&mut self, base: Reg<U64>, offset: i32, v: [Reg<T>; 4]) {
        self.check_owner(&[Src::<U64>::owner(&base)]);
        self.check_owner(&v.map(|r| Src::<T>::owner(&r)));
        let a = addr(base.name(), offset);
        let [x, y, z, w] = v.map(|r| r.name());
        self.emit(format!(
            "st.global.v4.{} {a}, {{{x}, {y}, {z}, {w}}};",
            T::MEM
        ));
    }

    /// `ld.shared` of one 32-bit word.
    pub fn ld_shared<T: Word32>(&mut self, base: SmemAddr, offset: i32) -> Reg<T> {
        let d = self.reg::<T>();
        self.check_owner(&[base.owner()]);
        let a = addr(base.name(), offset);
        self.emit(format!("ld.shared.{} {}, {a};", T::MEM, d.name()));
        d
    }

    /// `ld.shared.v4` of four 32-bit words (16-byte aligned).
    pub fn ld_shared_v4<T: Word32>(&mut self, base: SmemAddr, offset: i32) -> [Reg<T>; 4] {
        let d = self.regs::<T, 4>();
        self.check_owner(&[base.owner()]);
        let a = addr(base.name(), offset);
        let [x, y, z, w] = d.map(|r| r.name());
        self.emit(format!(
            "ld.shared.v4.{} {{{x}, {y}, {z}, {w}}}, {a};",
            T::MEM
        ));
        d
    }

    /// `st.shared` of one 32-bit word.
    pub fn st_shared<T: Word32>(&mut self, base: SmemAddr, offset: i32, v: impl Src<T>) {
        self.check_owner(&[base.owner(), v.owner()]);
        let a = addr(base.name(), offset);
        self.emit(format!("st.shared.{} {a}, {};", T::MEM, v.operand()));
    }

    /// `st.shared.v2` of two 32-bit words (8-byte aligned).
    pub fn st_shared_v2<T: Word32>(&mut self, base: SmemAddr, offset: i32, v: [Reg<T>; 2]) {
        self.check_owner(&[base.owner()]);
        self.check_owner(&v.map(|r| Src::<T>::owner(&r)));
        let a = addr(base.name(), offset);
        let [x, y] = v.map(|r| r.name());
        self.emit(format!("st.shared.v2.{} {a}, {{{x}, {y}}};", T::MEM));
    }

    /// `st.shared.v4` of four 32-bit words (16-byte aligned).
    pub fn st_shared_v4<T: Word32>(&mut self, base: SmemAddr, offset: i32, v: [Reg<T>; 4]) {
        self.check_owner(&[base.owner()]);
        self.check_owner(&v.map(|r| Src::<T>::owner(&r)));
        let a = addr(base.name(), offset);
        let [x, y, z, w] = v.map(|r| r.name());
        self.emit(format!(
            "st.shared.v4.{} {a}, {{{x}, {y}, {z}, {w}}};",
            T::MEM
        ));
    }

    /// `red.global.add.f32`: adds `v` to the f32 at the address, atomically, without
    /// returning the old value (a reduction over blocks into a zeroed buffer). Subnormal
    /// inputs and results are flushed to zero, as for every global f32 atomic add.
    pub fn red_global_add_f32(&mut self, base: Reg<U64>, offset: i32, v: impl Src<F32>) {
        self.check_owner(&[Src::<U64>::owner(&base), v.owner()]);
        let a = addr(base.name(), offset);
        self.emit(format!("red.global.add.f32 {a}, {};", v.operand()));
    }

    /// `atom.global.add.u32`: adds `v` to the word at the address, atomically, and
    /// returns the word it held before (a ticket: concurrent callers get distinct values).
    pub fn atom_global_add_u32(
        &mut self,
        base: Reg<U64>,
        offset: i32,
        v: impl Src<U32>,
    ) -> Reg<U32> {
        self.check_owner(&[Src::<U64>::owner(&base), v.owner()]);
        let d = self.reg::<U32>();
        let a = addr(base.name(), offset);
        self.emit(format!(
            "atom.global.add.u32 {}, {a}, {};",
            d.name(),
            v.operand()
        ));
        d
    }

    /// `red.global.max.u32`: raises the word at the address to `v` if it is lower,
    /// atomically, without returning the old value (a shared counter moved past values
    /// no one needs to draw).
    pub fn red_global_max_u32(&mut self, base: Reg<U64>, offset: i32, v: impl Src<U32>) {
        self.check_owner(&[Src::<U64>::owner(&base), v.owner()]);
        let a = addr(base.name(), offset);
        self.emit(format!("red.global.max.u32 {a}, {};", v.operand()));
    }

    /// `cp.async.cg.shared.global` of 16 bytes, bypassing L1. Only `src_bytes` bytes are
    /// read (0 or 16 in practice); the rest of the 16 is zero-filled, which is how tiles
    /// past the end of a sequence become zeros without a branch.
    pub fn cp_async_16(&mut self, dst: SmemAddr, src: Reg<U64>, src_bytes: impl Src<U32>) {
        self.requires(Feature::Ampere);
        self.check_owner(&[dst.owner(), Src::<U64>::owner(&src), src_bytes.owner()]);
        let n = src_bytes.operand();
        self.emit(format!(
            "cp.async.cg.shared.global [{}], [{}], 16, {n};",
            dst.name(),
            src.name()
        ));
    }

    /// `cp.async.ca.shared.global` of 4 bytes (one float, say), zero-filled when
    /// `src_bytes` is 0.
    pub fn cp_async_4(&mut self, dst: SmemAddr, src: Reg<U64>, src_bytes: impl Src<U32>) {
        self.requires(Feature::Ampere);
        self.check_owner(&[dst.owner(), Src::<U64>::owner(&src), src_bytes.owner()]);
        let n = src_bytes.operand();
        self.emit(format!(
            "cp.async.ca.shared.global [{}], [{}], 4, {n};",
            dst.name(),
            src.name()
        ));
    }

    /// Closes the current group of `cp.async` copies.
    pub fn cp_async_commit(&mut self) {
        self.requires(Feature::Ampere);
        self.emit("cp.async.commit_group;".to_string());
    }

    /// Waits until at most `pending` committed groups are still in flight (this thread's
    /// copies only: a `bar.sync` must follow before other threads read the data).
    pub fn cp_async_wait(&mut self, pending: u32) {
        self.requires(Feature::Ampere);
        if pending > 7 {
            self.fail(PtxError::BadOperand(format!(
                "cp.async.wait_group {pending}: at most 7"
            )));
        }
        self.emit(format!("cp.async.wait_group {pending};"));
    }
}
