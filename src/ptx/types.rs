//! PTX value types as Rust marker types.
//!
//! A register is `Reg<T>` where `T` is one of the markers below, so an instruction that
//! needs a 64-bit address cannot be handed an `f32` register: the mistake does not compile.
//! Each marker knows its PTX spelling and which register class (declaration) holds it.

use std::fmt;

/// The register classes the emitter declares; several value types share one class
/// (PTX lets `.b32` registers carry any 32-bit type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RegClass {
    /// `.pred`, named `%p<n>`.
    Pred,
    /// `.b16`, named `%h<n>`.
    B16,
    /// `.b32`, named `%r<n>`: u32, s32, b32 and the packed f16x2 / bf16x2 / e4m3x4 words.
    B32,
    /// `.b64`, named `%rd<n>`: u64, s64, b64.
    B64,
    /// `.f32`, named `%f<n>`.
    F32,
}

impl RegClass {
    pub const ALL: [RegClass; 5] = [
        RegClass::Pred,
        RegClass::B16,
        RegClass::B32,
        RegClass::B64,
        RegClass::F32,
    ];
    pub(crate) fn prefix(self) -> &'static str {
        match self {
            RegClass::Pred => "%p",
            RegClass::B16 => "%h",
            RegClass::B32 => "%r",
            RegClass::B64 => "%rd",
            RegClass::F32 => "%f",
        }
    }
    /// The spelling in `selp`, which selects whole registers: the class's own type.
    pub(crate) fn selp(self) -> &'static str {
        match self {
            RegClass::Pred => "pred",
            RegClass::B16 => "b16",
            RegClass::B32 => "b32",
            RegClass::B64 => "b64",
            RegClass::F32 => "f32",
        }
    }
    pub(crate) fn decl(self) -> &'static str {
        match self {
            RegClass::Pred => ".pred",
            RegClass::B16 => ".b16",
            RegClass::B32 => ".b32",
            RegClass::B64 => ".b64",
            RegClass::F32 => ".f32",
        }
    }
}

/// A PTX value type that can live in a register.
pub trait PtxType: Copy + fmt::Debug + 'static {
    /// The type suffix in instructions (`u32`, `f32`, `b64`, ...).
    const NAME: &'static str;
    /// The register class that holds it.
    const CLASS: RegClass;
    /// The spelling where a value is moved without being interpreted: `mov`, a
    /// parameter's declaration and `ld.param`. Packed types move as the bit type of
    /// their width (`b32`), since PTX has no `mov.f16x2`.
    const MOV: &'static str;
}

macro_rules! ptx_type {
    ($(#[$doc:meta])* $name:ident, $ptx:literal, $class:ident, $mov:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name;
        impl PtxType for $name {
            const NAME: &'static str = $ptx;
            const CLASS: RegClass = RegClass::$class;
            const MOV: &'static str = $mov;
        }
    };
}

ptx_type!(/// Predicate (one bit).
    Pred, "pred", Pred, "pred");
ptx_type!(/// Untyped 16 bits (one packed pair of e4m3 bytes, say).
    B16, "b16", B16, "b16");
ptx_type!(/// Untyped 32 bits.
    B32, "b32", B32, "b32");
ptx_type!(/// Unsigned 32-bit integer.
    U32, "u32", B32, "u32");
ptx_type!(/// Signed 32-bit integer.
    S32, "s32", B32, "s32");
ptx_type!(/// Untyped 64 bits.
    B64, "b64", B64, "b64");
ptx_type!(/// Unsigned 64-bit integer; also global addresses.
    U64, "u64", B64, "u64");
ptx_type!(/// Signed 64-bit integer.
    S64, "s64", B64, "s64");
ptx_type!(/// IEEE single precision.
    F32, "f32", F32, "f32");
ptx_type!(/// Two f16 values in one 32-bit register (low half = first element).
    F16x2, "f16x2", B32, "b32");
ptx_type!(/// Two bf16 values in one 32-bit register (low half = first element).
    Bf16x2, "bf16x2", B32, "b32");
ptx_type!(/// Four e4m3 values in one 32-bit register (byte 0 = first element).
    E4m3x4, "b32", B32, "b32");

/// Integer types: `add`, `sub`, `mul.lo`, `mad.lo`, `min`, `max`, shifts.
pub trait Int: PtxType {}
impl Int for U32 {}
impl Int for S32 {}
impl Int for U64 {}
impl Int for S64 {}

/// Bit types and integers: `and`, `or`, `xor`, `mov`.
pub trait Bits: PtxType {
    /// The `.bN` spelling of the same width.
    const BITS_NAME: &'static str;
}
impl Bits for B32 {
    const BITS_NAME: &'static str = "b32";
}
impl Bits for U32 {
    const BITS_NAME: &'static str = "b32";
}
impl Bits for S32 {
    const BITS_NAME: &'static str = "b32";
}
impl Bits for B64 {
    const BITS_NAME: &'static str = "b64";
}
impl Bits for U64 {
    const BITS_NAME: &'static str = "b64";
}
impl Bits for S64 {
    const BITS_NAME: &'static str = "b64";
}

/// Types that fit in one 32-bit register: what `shfl`, `ld/st .b32` and `mov.b32` move.
pub trait Word32: PtxType {
    /// The spelling in `ld`/`st`: `f32` for floats, `b32` for everything else.
    const MEM: &'static str = "b32";
}
impl Word32 for B32 {}
impl Word32 for U32 {}
impl Word32 for S32 {}
impl Word32 for F32 {
    const MEM: &'static str = "f32";
}
impl Word32 for F16x2 {}
impl Word32 for Bf16x2 {}
impl Word32 for E4m3x4 {}

/// The 32-bit words `ldmatrix` delivers: two 16-bit elements of an 8x8 matrix, which
/// are either two 16-bit floats or four e4m3 bytes (an fp8 row of 16 bytes is 8 such
/// pairs, so the same instruction loads `mma.sync` m16n8k32 fragments).
pub trait MatrixWord: Word32 {}
impl MatrixWord for F16x2 {}
impl MatrixWord for Bf16x2 {}
impl MatrixWord for E4m3x4 {}

/// Packed pairs of 16-bit floats: the operand words of `mma.sync` m16n8k16 and `ldmatrix`.
pub trait Half2: MatrixWord {
    /// The element type's name in `mma` (`f16`, `bf16`).
    const ELEM: &'static str;
}
impl Half2 for F16x2 {
    const ELEM: &'static str = "f16";
}
impl Half2 for Bf16x2 {
    const ELEM: &'static str = "bf16";
}

/// Types that can be compared with `setp`.
pub trait Comparable: PtxType {}
impl Comparable for U32 {}
impl Comparable for S32 {}
impl Comparable for U64 {}
impl Comparable for S64 {}
impl Comparable for F32 {}
