//! Integer and float arithmetic, comparisons and selects.
//!
//! Every operation has two forms: `op(..) -> Reg<T>` makes a fresh register, `op_to(dst, ..)`
//! writes an existing one (for values carried around a loop: running max, row sums).

use super::kernel::{Cmp, Kernel, Reg, Src};
use super::types::*;

/// Types with `add`, `sub`, `mul`, `mad`, `min`, `max`, `div`.
pub trait Arith: Comparable {
    /// The multiply that keeps the type (`mul.lo` for integers, `mul.rn` for floats).
    const MUL: &'static str = "mul.lo";
    /// The multiply-add (`mad.lo` for integers, `fma.rn` for floats).
    const MAD: &'static str = "mad.lo";
    /// The division (`div` truncating for integers, `div.rn` for floats).
    const DIV: &'static str = "div";
}
impl Arith for U32 {}
impl Arith for S32 {}
impl Arith for U64 {}
impl Arith for S64 {}
impl Arith for F32 {
    const MUL: &'static str = "mul.rn";
    const MAD: &'static str = "fma.rn";
    const DIV: &'static str = "div.rn";
}

macro_rules! binary {
    ($(#[$doc:meta])* $name:ident, $name_to:ident, $bound:ident, |$t:ident| $op:expr) => {
        $(#[$doc])*
        pub fn $name<T: $bound>(&mut self, a: impl Src<T>, b: impl Src<T>) -> Reg<T> {
            let d = self.reg();
            self.$name_to(d, a, b);
            d
        }
        $(#[$doc])*
        pub fn $name_to<T: $bound>(&mut self, d: Reg<T>, a: impl Src<T>, b: impl Src<T>) {
            self.check_owner(&[Src::<T>::owner(&d), a.owner(), b.owner()]);
            let $t = T::NAME;
            let op: String = $op;
            self.emit(format!("{op} {}, {}, {};", d.name(), a.operand(), b.operand()));
        }
    };
}

macro_rules! unary_f32 {
    ($(#[$doc:meta])* $name:ident, $name_to:ident, $op:literal) => {
        $(#[$doc])*
        pub fn $name(&mut self, a: impl Src<F32>) -> Reg<F32> {
            let d = self.reg();
            self.$name_to(d, a);
            d
        }
        $(#[$doc])*
        pub fn $name_to(&mut self, d: Reg<F32>, a: impl Src<F32>) {
            self.check_owner(&[Src::<F32>::owner(&d), a.owner()]);
            self.emit(format!(concat!($op, " {}, {};"), d.name(), a.operand()));
        }
    };
}

impl Kernel {
    binary!(/// `d = a + b`.
        add, add_to, Arith, |t| format!("add.{t}"));
    binary!(/// `d = a - b`.
        sub, sub_to, Arith, |t| format!("sub.{t}"));
    binary!(/// `d = a * b` (low half for integers, round-to-nearest for floats).
        mul, mul_to, Arith, |t| format!("{}.{t}", T::MUL));
    binary!(/// `d = min(a, b)`.
        min, min_to, Arith, |t| format!("min.{t}"));
    binary!(/// `d = max(a, b)`.
        max, max_to, Arith, |t| format!("max.{t}"));
    binary!(/// `d = a / b`, truncating (integers) or round-to-nearest (floats).
        div, div_to, Arith, |t| format!("{}.{t}", T::DIV));
    binary!(/// `d = a % b` (integers only).
        rem, rem_to, Int, |t| format!("rem.{t}"));
    binary!(/// The high half of the double-width product `a * b` (integers only).
        mul_hi, mul_hi_to, Int, |t| format!("mul.hi.{t}"));
    binary!(/// Bitwise and.
        and, and_to, Bits, |_t| format!("and.{}", T::BITS_NAME));
    binary!(/// Bitwise or.
        or, or_to, Bits, |_t| format!("or.{}", T::BITS_NAME));
    binary!(/// Bitwise exclusive or.
        xor, xor_to, Bits, |_t| format!("xor.{}", T::BITS_NAME));

    /// `d = a + b` clamped to the `s32` range instead of wrapping (`add.sat.s32`).
    pub fn add_sat(&mut self, a: impl Src<S32>, b: impl Src<S32>) -> Reg<S32> {
        let d = self.reg::<S32>();
        self.check_owner(&[a.owner(), b.owner()]);
        let (a, b) = (a.operand(), b.operand());
        self.emit(format!("add.sat.s32 {}, {a}, {b};", d.name()));
        d
    }

    /// `d = a − b` clamped to the `s32` range instead of wrapping (`sub.sat.s32`).
    pub fn sub_sat(&mut self, a: impl Src<S32>, b: impl Src<S32>) -> Reg<S32> {
        let d = self.reg::<S32>();
        self.check_owner(&[a.owner(), b.owner()]);
        let (a, b) = (a.operand(), b.operand());
        self.emit(format!("sub.sat.s32 {}, {a}, {b};", d.name()));
        d
    }

    /// `d = a * b + c` (`mad.lo` for integers, `fma.rn` for floats).
    pub fn mad<T: Arith>(&mut self, a: impl Src<T>, b: impl Src<T>, c: impl Src<T>) -> Reg<T> {
        let d = self.reg();
        self.mad_to(d, a, b, c);
        d
    }

    /// `d = a * b + c` into an existing register.
    pub fn mad_to<T: Arith>(&mut self, d: Reg<T>, a: impl Src<T>, b: impl Src<T>, c: impl Src<T>) {
        self.check_owner(&[Src::<T>::owner(&d), a.owner(), b.owner(), c.owner()]);
        let (op, t) = (T::MAD, T::NAME);
        let (a, b, c) = (a.operand(), b.operand(), c.operand());
        self.emit(format!("{op}.{t} {}, {a}, {b}, {c};", d.name()));
    }

    /// `d = a * b + c`, the product taken as 64 bits from two unsigned 32-bit values
    /// (`mad.wide.u32`): an element's address from its index, its size and a base.
    pub fn mad_wide_u32(
        &mut self,
        a: impl Src<U32>,
        b: impl Src<U32>,
        c: impl Src<U64>,
    ) -> Reg<U64> {
        let d = self.reg::<U64>();
        self.check_owner(&[a.owner(), b.owner(), c.owner()]);
        self.emit(format!(
            "mad.wide.u32 {}, {}, {}, {};",
            d.name(),
            a.operand(),
            b.operand(),
            c.operand()
        ));
        d
    }

    /// `d = a * b` as 64 bits from two unsigned 32-bit values (`mul.wide.u32`).
    pub fn mul_wide_u32(&mut self, a: impl Src<U32>, b: impl Src<U32>) -> Reg<U64> {
        let d = self.reg::<U64>();
        self.check_owner(&[a.owner(), b.owner()]);
        self.emit(format!(
            "mul.wide.u32 {}, {}, {};",
            d.name(),
            a.operand(),
            b.operand()
        ));
        d
    }

    /// `d = a * b` as 64 bits from two signed 32-bit values (`mul.wide.s32`).
    pub fn mul_wide_s32(&mut self, a: impl Src<S32>, b: impl Src<S32>) -> Reg<S64> {
        let d = self.reg::<S64>();
        self.check_owner(&[a.owner(), b.owner()]);
        self.emit(format!(
            "mul.wide.s32 {}, {}, {};",
            d.name(),
            a.operand(),
            b.operand()
        ));
        d
    }

    /// `d = a << n`.
    pub fn shl<T: Bits>(&mut self, a: impl Src<T>, n: u32) -> Reg<T> {
        let d = self.reg();
        self.check_owner(&[a.owner()]);
        if n >= 64 {
            self.fail(super::PtxError::BadOperand(format!("shift by {n}")));
        }
        self.emit(format!(
            "shl.{} {}, {}, {n};",
            T::BITS_NAME,
            d.name(),
            a.operand()
        ));
        d
    }

    /// `d = a >> n`: logical for unsigned and bit types, arithmetic for signed.
    pub fn shr<T: Bits>(&mut self, a: impl Src<T>, n: u32) -> Reg<T> {
        let d = self.reg();
        self.check_owner(&[a.owner()]);
        if n >= 64 {
            self.fail(super::PtxError::BadOperand(format!("shift by {n}")));
        }
        self.emit(format!(
            "shr.{} {}, {}, {n};",
            T::NAME,
            d.name(),
            a.operand()
        ));
        d
    }

    /// `d = a << n` by a run-time count (PTX clamps counts above the width).
    pub fn shl_by<T: Bits>(&mut self, a: impl Src<T>, n: Reg<U32>) -> Reg<T> {
        let d = self.reg();
        self.check_owner(&[a.owner(), Src::<U32>::owner(&n)]);
        self.emit(format!(
            "shl.{} {}, {}, {};",
            T::BITS_NAME,
            d.name(),
            a.operand(),
            n.name()
        ));
        d
    }

    /// `d = a >> n` by a run-time count: logical for unsigned types, arithmetic for
    /// signed.
    pub fn shr_by<T: Bits>(&mut self, a: impl Src<T>, n: Reg<U32>) -> Reg<T> {
        let d = self.reg();
        self.check_owner(&[a.owner(), Src::<U32>::owner(&n)]);
        self.emit(format!(
            "shr.{} {}, {}, {};",
            T::NAME,
            d.name(),
            a.operand(),
            n.name()
        ));
        d
    }

    /// `p = a <cmp> b`.
    pub fn setp<T: Comparable>(&mut self, cmp: Cmp, a: impl Src<T>, b: impl Src<T>) -> Reg<Pred> {
        let p = self.reg::<Pred>();
        self.check_owner(&[a.owner(), b.owner()]);
        let (c, t) = (cmp.name(), T::NAME);
        self.emit(format!(
            "setp.{c}.{t} {}, {}, {};",
            p.name(),
            a.operand(),
            b.operand()
        ));
        p
    }

    /// `p = a && b` on predicates.
    pub fn and_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        let p = self.reg::<Pred>();
        self.check_owner(&[a.owner(), b.owner()]);
        self.emit(format!(
            "and.pred {}, {}, {};",
            p.name(),
            a.name(),
            b.name()
        ));
        p
    }

    /// `p = a || b` on predicates.
    pub fn or_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        let p = self.reg::<Pred>();
        self.check_owner(&[a.owner(), b.owner()]);
        self.emit(format!("or.pred {}, {}, {};", p.name(), a.name(), b.name()));
        p
    }

    /// `p = !a` on a predicate.
    pub fn not_pred(&mut self, a: Reg<Pred>) -> Reg<Pred> {
        let p = self.reg::<Pred>();
        self.check_owner(&[a.owner()]);
        self.emit(format!("not.pred {}, {};", p.name(), a.name()));
        p
    }

    /// `d = p ? a : b`.
    pub fn selp<T: PtxType>(&mut self, a: impl Src<T>, b: impl Src<T>, p: Reg<Pred>) -> Reg<T> {
        let d = self.reg();
        self.selp_to(d, a, b, p);
        d
    }

    /// Steps a ring index in `[0, stages)` to the next stage, wrapping to 0, in place
    /// (one add, compare and select rather than a `rem`); returns whether it wrapped.
    pub fn advance_stage(&mut self, stage: Reg<U32>, stages: u32) -> Reg<Pred> {
        let next = self.add(stage, 1u32);
        let wrap = self.setp(Cmp::Eq, next, stages);
        self.selp_to(stage, 0u32, next, wrap);
        wrap
    }

    /// `d = p ? a : b` into an existing register.
    pub fn selp_to<T: PtxType>(&mut self, d: Reg<T>, a: impl Src<T>, b: impl Src<T>, p: Reg<Pred>) {
        self.check_owner(&[Src::<T>::owner(&d), a.owner(), b.owner(), p.owner()]);
        let t = T::CLASS.selp();
        let (a, b) = (a.operand(), b.operand());
        self.emit(format!("selp.{t} {}, {a}, {b}, {};", d.name(), p.name()));
    }

    /// `max(a, b)` that is NaN when either is (`max.NaN.f32`; plain `max` returns the
    /// other operand).
    pub fn max_nan(&mut self, a: impl Src<F32>, b: impl Src<F32>) -> Reg<F32> {
        let d = self.reg::<F32>();
        self.check_owner(&[a.owner(), b.owner()]);
        let (a, b) = (a.operand(), b.operand());
        self.emit(format!("max.NaN.f32 {}, {a}, {b};", d.name()));
        d
    }

    /// `a · b` rounded toward +∞ (`mul.rp.f32`): never below the exact product.
    pub fn mul_rp(&mut self, a: impl Src<F32>, b: impl Src<F32>) -> Reg<F32> {
        let d = self.reg::<F32>();
        self.check_owner(&[a.owner(), b.owner()]);
        let (a, b) = (a.operand(), b.operand());
        self.emit(format!("mul.rp.f32 {}, {a}, {b};", d.name()));
        d
    }

    /// `a + b` rounded toward −∞ (`add.rm.f32`).
    pub fn add_rm(&mut self, a: impl Src<F32>, b: impl Src<F32>) -> Reg<F32> {
        let d = self.reg::<F32>();
        self.check_owner(&[a.owner(), b.owner()]);
        let (a, b) = (a.operand(), b.operand());
        self.emit(format!("add.rm.f32 {}, {a}, {b};", d.name()));
        d
    }

    /// `2^a` on the FMA and integer pipes instead of the exponent unit (MUFU), for
    /// softmaxes whose exponentials MUFU issues in bunches that stall the MIO queue
    /// (see `OnlineSoftmax::with_fma_exps`). `a` is split into `j = floor(a)` and
    /// `f = a − j`; `2^f` on `[0, 1)` is a cubic (relative error under 7.5e-5, below an
    /// f16 probability's rounding) and `2^j` is built in the exponent bits. `a` is
    /// clamped below at −127, so −∞ (a masked score) and anything under the float range
    /// give 0; NaN stays NaN; `a` must stay below 128.
    pub fn ex2_fma(&mut self, a: impl Src<F32>) -> Reg<F32> {
        let d = self.reg();
        self.ex2_fma_to(d, a);
        d
    }

    /// [`Kernel::ex2_fma`] into an existing register.
    pub fn ex2_fma_to(&mut self, d: Reg<F32>, a: impl Src<F32>) {
        // Least-squares fit of 2^f on [0, 1] in relative error, coefficients of f^0..f^3.
        const C: [f32; 4] = [0.999_925_26, 0.695_833_5, 0.226_067_19, 0.078_024_55];
        // 1.5 · 2^23: adding it rounds to an integer, held in the low mantissa bits.
        const ROUNDER: f32 = 12_582_912.0;
        self.check_owner(&[Src::<F32>::owner(&d), a.owner()]);
        let x = self.max_nan(a, -127f32);
        let t = self.add_rm(x, ROUNDER);
        let j = self.sub(t, ROUNDER);
        let f = self.sub(x, j);
        let p = self.mad(f, C[3], C[2]);
        for c in [C[1], C[0]] {
            self.mad_to(p, p, f, c);
        }
        // t's low bits are j (two's complement, modulo the exponent above them), so
        // t · 2^23 + (127 << 23) is the float 2^j.
        let bits = self.f32_bits(t);
        let exp = self.mad(bits, 1u32 << 23, 127u32 << 23);
        let pow = self.f32_from_bits(exp);
        self.mul_to(d, p, pow);
    }

    unary_f32!(/// `2^a`, approximate (2 ulp), subnormals flushed: the softmax exponential.
        ex2, ex2_to, "ex2.approx.ftz.f32");
    unary_f32!(/// `tanh(a)`, approximate (one MUFU operation, sm_75 on; relative error about
        /// 2^-11): the soft-capping of attention logits.
        tanh, tanh_to, "tanh.approx.f32");
    unary_f32!(/// `log2(a)`, approximate, subnormals flushed.
        lg2, lg2_to, "lg2.approx.ftz.f32");
    unary_f32!(/// `1 / a`, correctly rounded.
        rcp, rcp_to, "rcp.rn.f32");
    unary_f32!(/// `-a`.
        neg, neg_to, "neg.f32");
    unary_f32!(/// `|a|`.
        abs, abs_to, "abs.f32");
}

/// A 32-bit unsigned divisor as a multiply and a shift (Granlund–Montgomery, as
/// CUTLASS's `FastDivmod`): `n / d` is `mul.hi(n, magic) >> shift` for every `n` below
/// 2^31, two integer instructions where `div.u32` takes a reciprocal on the exponent
/// unit and a dozen fix-ups (about 150 cycles of latency on an H200). The host computes
/// the pair once per launch ([`FastDivisor::new`]) and passes it beside the divisor;
/// `d = 1` is `magic = 0`, which [`Kernel::div_fast`] takes as the identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct FastDivisor {
    pub magic: u32,
    pub shift: u32,
}

impl FastDivisor {
    /// The multiply and shift of divisor `d` (0 is taken as 1: nothing divides by it).
    pub fn new(d: u32) -> FastDivisor {
        if d <= 1 {
            return FastDivisor::default();
        }
        // p = ceil(log2 d) >= 1; magic = ceil(2^(31 + p) / d) < 2^32, and
        // n · magic / 2^(31 + p) is within 1/d of n / d from above for n < 2^31.
        let p = 32 - (d - 1).leading_zeros();
        let magic = (1u64 << (31 + p)).div_ceil(u64::from(d));
        FastDivisor {
            magic: magic as u32,
            shift: p - 1,
        }
    }

    /// `n / d` on the host, as the kernels compute it (`n < 2^31`).
    pub fn quotient(self, n: u32) -> u32 {
        debug_assert!(n < 1 << 31);
        match self.magic {
            0 => n,
            m => ((u64::from(n) * u64::from(m)) >> 32) as u32 >> self.shift,
        }
    }
}

impl Kernel {
    /// `n / d` for `n < 2^31` from `d`'s [`FastDivisor`] (`magic`, `shift`), and the
    /// remainder `n − q·d`: a multiply-high, a shift and a select instead of `div.u32`
    /// and `rem.u32`.
    pub fn div_rem_fast(
        &mut self,
        n: Reg<U32>,
        d: Reg<U32>,
        (magic, shift): (Reg<U32>, Reg<U32>),
    ) -> (Reg<U32>, Reg<U32>) {
        let q = self.div_fast(n, (magic, shift));
        let r = self.mul(q, d);
        let r = self.sub(n, r);
        (q, r)
    }

    /// `n / d` for `n < 2^31` from `d`'s [`FastDivisor`] (`magic`, `shift`).
    pub fn div_fast(&mut self, n: Reg<U32>, (magic, shift): (Reg<U32>, Reg<U32>)) -> Reg<U32> {
        let hi = self.mul_hi(n, magic);
        let q = self.shr_by(hi, shift);
        let one = self.setp(Cmp::Eq, magic, 0u32);
        self.selp(n, q, one)
    }
}

#[cfg(test)]
mod tests {
    use super::FastDivisor;

    /// `n / d` by multiply and shift is exact for every `n` below 2^31: each divisor up to
    /// 70 000, powers of two and their neighbours, and large ones, against a spread of
    /// dividends with the ends of the range and each divisor's multiples ± 1.
    #[test]
    fn fast_divisors_are_exact_below_2_pow_31() {
        let mut divisors: Vec<u32> = (1..=70_000).collect();
        for p in 1..32 {
            let t = 1u32 << p;
            divisors.extend([t - 1, t, t.wrapping_add(1)]);
        }
        divisors.extend([u32::MAX, u32::MAX - 1, 0x7fff_ffff, 0x8000_0001, 3 << 29]);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 33) as u32
        };
        for &d in &divisors {
            let f = FastDivisor::new(d);
            let mut ns = vec![0, 1, d.wrapping_sub(1), d, d.wrapping_add(1), (1 << 31) - 1];
            let top = ((1u64 << 31) - 1) / u64::from(d) * u64::from(d);
            ns.extend([top.saturating_sub(1), top, top + 1].map(|n| n as u32));
            ns.extend((0..24).map(|_| next()));
            for n in ns.into_iter().filter(|&n| n < 1 << 31) {
                assert_eq!(f.quotient(n), n / d, "{n} / {d}: {f:?}");
            }
        }
        // Zero divides nothing: taken as 1.
        assert_eq!(FastDivisor::new(0), FastDivisor::new(1));
        assert_eq!(FastDivisor::new(1).quotient(12345), 12345);
    }
}
