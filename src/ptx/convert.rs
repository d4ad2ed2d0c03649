//! `cvt`: widening, int/float, and packing two f32 into one 16-bit pair.

use super::kernel::{Kernel, Reg, Src};
use super::target::Feature;
use super::types::*;

impl Kernel {
    /// Zero-extends a `u32` to `u64`.
    pub fn cvt_u64_u32(&mut self, a: impl Src<U32>) -> Reg<U64> {
        let d = self.reg::<U64>();
        self.check_owner(&[a.owner()]);
        self.emit(format!("cvt.u64.u32 {}, {};", d.name(), a.operand()));
        d
    }

    /// Sign-extends an `s32` to `s64`.
    pub fn cvt_s64_s32(&mut self, a: impl Src<S32>) -> Reg<S64> {
        let d = self.reg::<S64>();
        self.check_owner(&[a.owner()]);
        self.emit(format!("cvt.s64.s32 {}, {};", d.name(), a.operand()));
        d
    }

    /// The bits of an f32, as an integer (`mov.b32`: a reinterpretation, no conversion).
    pub fn f32_bits(&mut self, a: Reg<F32>) -> Reg<U32> {
        let d = self.reg::<U32>();
        self.check_owner(&[Src::<F32>::owner(&a)]);
        self.emit(format!("mov.b32 {}, {};", d.name(), a.name()));
        d
    }

    /// The f32 whose bits are `a` (`mov.b32`: a reinterpretation, no conversion).
    pub fn f32_from_bits(&mut self, a: Reg<U32>) -> Reg<F32> {
        let d = self.reg::<F32>();
        self.check_owner(&[Src::<U32>::owner(&a)]);
        self.emit(format!("mov.b32 {}, {};", d.name(), a.name()));
        d
    }

    /// `s32 -> f32`, round to nearest.
    pub fn cvt_f32_s32(&mut self, a: impl Src<S32>) -> Reg<F32> {
        let d = self.reg::<F32>();
        self.check_owner(&[a.owner()]);
        self.emit(format!("cvt.rn.f32.s32 {}, {};", d.name(), a.operand()));
        d
    }

    /// Packs two f32 into a 16-bit float pair, round to nearest: `lo` lands in the low
    /// half (the lower address / lower k index), `hi` in the high half. PTX's `cvt` takes
    /// the high source first; this method takes them in memory order.
    pub fn pack_half2<H: Half2>(&mut self, lo: impl Src<F32>, hi: impl Src<F32>) -> Reg<H> {
        let d = self.reg::<H>();
        self.pack_half2_to(d, lo, hi);
        d
    }

    /// [`Kernel::pack_half2`] into an existing register.
    pub fn pack_half2_to<H: Half2>(&mut self, d: Reg<H>, lo: impl Src<F32>, hi: impl Src<F32>) {
        self.check_owner(&[Src::<H>::owner(&d), lo.owner(), hi.owner()]);
        let e = H::ELEM;
        self.emit(format!(
            "cvt.rn.{e}x2.f32 {}, {}, {};",
            d.name(),
            hi.operand(),
            lo.operand()
        ));
    }

    /// Widens a 16-bit float pair to two f32 (`[low half, high half]`), exactly. bf16 is
    /// the top half of an f32, so it widens by a shift and a mask (`cvt.f32.bf16` needs
    /// sm_90); f16 goes through `cvt.f32.f16`.
    pub fn unpack_half2<H: Half2>(&mut self, w: Reg<H>) -> [Reg<F32>; 2] {
        self.check_owner(&[Src::<H>::owner(&w)]);
        let [lo, hi] = self.regs::<F32, 2>();
        if H::ELEM == "bf16" {
            let [a, b] = self.regs::<B32, 2>();
            self.emit(format!("shl.b32 {}, {}, 16;", a.name(), w.name()));
            self.emit(format!("and.b32 {}, {}, 0xffff0000;", b.name(), w.name()));
            self.emit(format!("mov.b32 {}, {};", lo.name(), a.name()));
            self.emit(format!("mov.b32 {}, {};", hi.name(), b.name()));
        } else {
            let [a, b] = self.regs::<B16, 2>();
            self.emit(format!(
                "mov.b32 {{{}, {}}}, {};",
                a.name(),
                b.name(),
                w.name()
            ));
            self.emit(format!("cvt.f32.f16 {}, {};", lo.name(), a.name()));
            self.emit(format!("cvt.f32.f16 {}, {};", hi.name(), b.name()));
        }
        [lo, hi]
    }

    /// Packs two f32 into two e4m3 bytes, round to nearest, saturating to ±448 (`lo` in
    /// byte 0). Needs sm_89.
    pub fn pack_e4m3x2(&mut self, lo: impl Src<F32>, hi: impl Src<F32>) -> Reg<B16> {
        self.requires(Feature::Fp8);
        let d = self.reg::<B16>();
        self.check_owner(&[lo.owner(), hi.owner()]);
        let (hi, lo) = (hi.operand(), lo.operand());
        self.emit(format!(
            "cvt.rn.satfinite.e4m3x2.f32 {}, {hi}, {lo};",
            d.name()
        ));
        d
    }

    /// Widens four e4m3 codes (byte `i` of `w` is element `i`) into two 16-bit pairs,
    /// exactly: every e4m3 value is an f16 and a bf16. f16 takes one `cvt` per pair; bf16
    /// goes through f32, as no `cvt` from e4m3 to bf16 exists before sm_100. Needs sm_89.
    pub fn unpack_e4m3x4<H: Half2>(&mut self, w: Reg<B32>) -> [Reg<H>; 2] {
        self.requires(Feature::Fp8);
        self.check_owner(&[Src::<B32>::owner(&w)]);
        let [lo, hi] = self.regs::<B16, 2>();
        self.emit(format!(
            "mov.b32 {{{}, {}}}, {};",
            lo.name(),
            hi.name(),
            w.name()
        ));
        [lo, hi].map(|pair| {
            let d = self.reg::<H>();
            if H::ELEM == "f16" {
                self.emit(format!(
                    "cvt.rn.f16x2.e4m3x2 {}, {};",
                    d.name(),
                    pair.name()
                ));
            } else {
                let h = self.reg::<B32>();
                let [a, b] = self.regs::<B16, 2>();
                let [x, y] = self.regs::<F32, 2>();
                self.emit(format!(
                    "cvt.rn.f16x2.e4m3x2 {}, {};",
                    h.name(),
                    pair.name()
                ));
                self.emit(format!(
                    "mov.b32 {{{}, {}}}, {};",
                    a.name(),
                    b.name(),
                    h.name()
                ));
                self.emit(format!("cvt.f32.f16 {}, {};", x.name(), a.name()));
                self.emit(format!("cvt.f32.f16 {}, {};", y.name(), b.name()));
                self.emit(format!(
                    "cvt.rn.bf16x2.f32 {}, {}, {};",
                    d.name(),
                    y.name(),
                    x.name()
                ));
            }
            d
        })
    }

    /// Joins two 16-bit halves into one 32-bit word (`lo` in the low half).
    pub fn join_b16x2(&mut self, lo: Reg<B16>, hi: Reg<B16>) -> Reg<B32> {
        let d = self.reg::<B32>();
        self.check_owner(&[Src::<B16>::owner(&lo), Src::<B16>::owner(&hi)]);
        self.emit(format!(
            "mov.b32 {}, {{{}, {}}};",
            d.name(),
            lo.name(),
            hi.name()
        ));
        d
    }

    /// Byte permute (`prmt.b32`): byte i of the result is byte `sel` nibble i of the
    /// eight bytes {b, a} (a = bytes 0..3, b = bytes 4..7).
    pub fn prmt(&mut self, a: impl Src<B32>, b: impl Src<B32>, sel: u32) -> Reg<B32> {
        let d = self.reg::<B32>();
        self.check_owner(&[a.owner(), b.owner()]);
        self.emit(format!(
            "prmt.b32 {}, {}, {}, {sel:#x};",
            d.name(),
            a.operand(),
            b.operand()
        ));
        d
    }

    /// Truncates a `u64` to its low 32 bits.
    pub fn cvt_u32_u64(&mut self, a: impl Src<U64>) -> Reg<U32> {
        let d = self.reg::<U32>();
        self.check_owner(&[a.owner()]);
        self.emit(format!("cvt.u32.u64 {}, {};", d.name(), a.operand()));
        d
    }

    /// The low 32 bits of an `s64` as an `s32` (the caller knows the value fits).
    pub fn cvt_s32_s64(&mut self, a: impl Src<S64>) -> Reg<S32> {
        let d = self.reg::<S32>();
        self.check_owner(&[a.owner()]);
        self.emit(format!("cvt.s32.s64 {}, {};", d.name(), a.operand()));
        d
    }
}
