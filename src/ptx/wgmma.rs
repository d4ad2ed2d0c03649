//! Warpgroup MMA (`wgmma.mma_async`, sm_90a): typed accumulators, shared-memory matrix
//! descriptors, and the in-flight rule.
//!
//! - An accumulator of an m64nN instruction is an [`Acc<N>`]: `N/2` f32 registers per
//!   thread, a count that follows from the type `N` ([`N64`](shapes::N64), [`N256`](shapes::N256), ...).
//! - Issuing a wgmma consumes the accumulator and returns an [`InFlight<N>`], which has
//!   no registers to read or rescale; only [`Kernel::wgmma_retire`] turns it back into an
//!   `Acc`, and it refuses (at `finish`) unless a `wgmma.wait_group` has retired the
//!   commit group it belongs to. Touching accumulators mid-flight is undefined behaviour
//!   on the hardware and makes ptxas serialize the pipeline (warning C7515).
//! - Operands in shared memory are [`SmemDesc`]s, 64-bit matrix descriptors built from a
//!   [`SmemLayout`] (one swizzle description for TMA, descriptors and address math);
//!   a descriptor cannot be turned back into an address or an integer.
//! - FP8 (e4m3) operands must be K-major: the transpose bits exist only for f16/bf16,
//!   and [`MajorFor`] is implemented accordingly, so an MN-major e4m3 operand does not
//!   compile.
//!
//! Per thread t of the warpgroup (warp w = t/32, g = lane/4, c = lane%4), register `i` of
//! an m64nN accumulator holds row `16w + g + 8·((i>>1)&1)`, column `8·(i>>2) + 2c + (i&1)`:
//! registers `4j..4j+4` are exactly an `mma.sync` m16n8 C fragment of columns `8j..8j+8`,
//! which is what lets the softmax and epilogue code serve both kernel paths.

use std::marker::PhantomData;

use super::error::PtxError;
use super::kernel::{Kernel, Reg, Src};
use super::layout::SmemLayout;
use super::smem::SmemAddr;
use super::target::Feature;
use super::types::*;

/// The N of an m64nNk* instruction, as a type: fixes the accumulator's register count.
pub trait WgmmaN: 'static {
    const N: u32;
    /// `N / 2` f32 registers.
    type Regs: Copy + AsRef<[Reg<F32>]> + std::fmt::Debug;
    #[doc(hidden)]
    fn fresh(k: &mut Kernel) -> Self::Regs;
}

/// The N of each wgmma shape (`N8` ... `N256`, multiples of 8), as types.
pub mod shapes {
    use super::{F32, Kernel, Reg, WgmmaN};

    macro_rules! wgmma_n {
        ($($name:ident = $n:literal),* $(,)?) => {$(
            #[doc = concat!("N = ", stringify!($n), ": an m64n", stringify!($n), " accumulator.")]
            #[derive(Debug, Clone, Copy)]
            pub struct $name;
            impl WgmmaN for $name {
                const N: u32 = $n;
                type Regs = [Reg<F32>; $n / 2];
                fn fresh(k: &mut Kernel) -> Self::Regs {
                    k.regs()
                }
            }
        )*};
    }

    wgmma_n!(
        N8 = 8,
        N16 = 16,
        N24 = 24,
        N32 = 32,
        N40 = 40,
        N48 = 48,
        N56 = 56,
        N64 = 64,
        N72 = 72,
        N80 = 80,
        N88 = 88,
        N96 = 96,
        N104 = 104,
        N112 = 112,
        N120 = 120,
        N128 = 128,
        N136 = 136,
        N144 = 144,
        N152 = 152,
        N160 = 160,
        N168 = 168,
        N176 = 176,
        N184 = 184,
        N192 = 192,
        N200 = 200,
        N208 = 208,
        N216 = 216,
        N224 = 224,
        N232 = 232,
        N240 = 240,
        N248 = 248,
        N256 = 256,
    );
}

/// Input element types of wgmma, as the packed register word that carries them in the
/// register-A form.
pub trait WgmmaInput: Word32 {
    /// The element's name in the instruction.
    const ELEM: &'static str;
    /// The K of one instruction: 16 for 16-bit inputs, 32 for fp8.
    const K: u32;
    /// Bytes per element.
    const BYTES: u32;
    /// Whether the transpose immediates exist (f16/bf16 only).
    const TRANSPOSABLE: bool;
}
impl WgmmaInput for F16x2 {
    const ELEM: &'static str = "f16";
    const K: u32 = 16;
    const BYTES: u32 = 2;
    const TRANSPOSABLE: bool = true;
}
impl WgmmaInput for Bf16x2 {
    const ELEM: &'static str = "bf16";
    const K: u32 = 16;
    const BYTES: u32 = 2;
    const TRANSPOSABLE: bool = true;
}
impl WgmmaInput for E4m3x4 {
    const ELEM: &'static str = "e4m3";
    const K: u32 = 32;
    const BYTES: u32 = 1;
    const TRANSPOSABLE: bool = false;
}

/// How an operand is stored: K-major (the reduction dimension contiguous) or MN-major.
pub trait Major: Copy + std::fmt::Debug + 'static {
    /// The transpose immediate (0 for K-major, 1 for MN-major).
    const TRANS: u32;
}
/// The reduction dimension is contiguous (A row-major, B "column-major").
#[derive(Debug, Clone, Copy)]
pub struct KMajor;
/// The M (or N) dimension is contiguous: a transposed operand.
#[derive(Debug, Clone, Copy)]
pub struct MnMajor;
impl Major for KMajor {
    const TRANS: u32 = 0;
}
impl Major for MnMajor {
    const TRANS: u32 = 1;
}

/// Which storage orders an input type accepts: every type K-major, only f16/bf16 MN-major.
pub trait MajorFor<E: WgmmaInput>: Major {}
impl<E: WgmmaInput> MajorFor<E> for KMajor {}
impl<E: WgmmaInput + Half2> MajorFor<E> for MnMajor {}

/// The bits of a wgmma shared-memory matrix descriptor: start address, leading- and
/// stride-dimension byte offsets (each `>> 4` in a 14-bit field) and the swizzle mode;
/// base offset 0 (tiles start on their swizzle atom).
pub const fn desc_bits(addr: u32, lbo: u32, sbo: u32, swizzle: super::Swizzle) -> u64 {
    const fn enc(x: u32) -> u64 {
        ((x & 0x3FFFF) >> 4) as u64
    }
    enc(addr) | enc(lbo) << 16 | enc(sbo) << 32 | swizzle.desc_code() << 62
}

/// A 64-bit shared-memory matrix descriptor of an operand stored `M`-major.
#[derive(Debug, Clone, Copy)]
pub struct SmemDesc<M: Major> {
    value: Reg<U64>,
    _m: PhantomData<M>,
}

/// The leading- and stride-dimension byte offsets of a swizzled layout read `M`-major.
pub trait DescOffsets: Major {
    /// `(lbo, sbo)` in bytes.
    fn offsets(layout: &SmemLayout) -> (u32, u32);
}
impl DescOffsets for KMajor {
    /// K-major: 8-row core-matrix groups are 8 lines apart (SBO); LBO is unused under a
    /// swizzle (16 by convention).
    fn offsets(layout: &SmemLayout) -> (u32, u32) {
        (16, 8 * layout.block_bytes)
    }
}
impl DescOffsets for MnMajor {
    /// MN-major: consecutive column blocks along M/N are a block apart (LBO); 8 K-rows
    /// are 8 lines apart (SBO).
    fn offsets(layout: &SmemLayout) -> (u32, u32) {
        (layout.block_stride(), 8 * layout.block_bytes)
    }
}

/// Whether D is overwritten (the first k-step) or accumulated into.
#[derive(Debug, Clone, Copy)]
pub enum ScaleD {
    /// D = A·B.
    Zero,
    /// D += A·B.
    Accumulate,
    /// Decided at run time: accumulate where the predicate is true.
    When(Reg<Pred>),
}

impl ScaleD {
    fn operand(&self) -> String {
        match self {
            ScaleD::Zero => "0".into(),
            ScaleD::Accumulate => "1".into(),
            ScaleD::When(p) => p.name(),
        }
    }
}

/// An m64nN f32 accumulator whose registers may be read and written.
#[derive(Debug)]
pub struct Acc<N: WgmmaN> {
    regs: N::Regs,
}

/// An accumulator with wgmmas in flight: nothing to read until retired.
#[derive(Debug)]
#[must_use = "an in-flight accumulator must be retired with wgmma_retire"]
pub struct InFlight<N: WgmmaN> {
    regs: N::Regs,
    group: u32,
}

impl<N: WgmmaN> Acc<N> {
    /// All `N/2` registers, in the fragment order of the module docs.
    pub fn regs(&self) -> &[Reg<F32>] {
        self.regs.as_ref()
    }

    /// The `N/8` m16n8 C fragments (columns `8j..8j+8`).
    pub fn tiles(&self) -> Vec<[Reg<F32>; 4]> {
        self.regs
            .as_ref()
            .chunks(4)
            .map(|c| [c[0], c[1], c[2], c[3]])
            .collect()
    }
}

/// What a wgmma accumulates into: a readable [`Acc`] (fenced first) or an [`InFlight`]
/// accumulator being chained (no fence: only wgmmas touched it).
pub trait WgmmaD<N: WgmmaN> {
    #[doc(hidden)]
    fn open(self, k: &mut Kernel) -> N::Regs;
}

impl<N: WgmmaN> WgmmaD<N> for Acc<N> {
    fn open(self, k: &mut Kernel) -> N::Regs {
        // Its registers may have been written by ordinary instructions.
        k.wgmma_fence();
        self.regs
    }
}

impl<N: WgmmaN> WgmmaD<N> for InFlight<N> {
    fn open(self, _k: &mut Kernel) -> N::Regs {
        self.regs
    }
}

fn reg_list<T: PtxType>(regs: &[Reg<T>]) -> String {
    let names: Vec<String> = regs.iter().map(|r| r.name()).collect();
    format!("{{{}}}", names.join(", "))
}

impl Kernel {
    /// A fresh accumulator (contents undefined: start with [`ScaleD::Zero`]).
    pub fn acc<N: WgmmaN>(&mut self) -> Acc<N> {
        Acc {
            regs: N::fresh(self),
        }
    }

    /// A fresh accumulator set to 0.0.
    pub fn acc_zeroed<N: WgmmaN>(&mut self) -> Acc<N> {
        let acc = self.acc::<N>();
        for &r in acc.regs() {
            self.mov_to(r, 0f32);
        }
        acc
    }

    /// The descriptor of the operand at `addr` stored in `layout` (the slab the
    /// instruction reads starts there; move along K with [`Kernel::desc_advance`]).
    pub fn smem_desc<M: DescOffsets>(
        &mut self,
        addr: SmemAddr,
        layout: &SmemLayout,
    ) -> SmemDesc<M> {
        if layout.swizzle == super::Swizzle::None || !layout.is_valid() {
            self.fail(PtxError::BadOperand(format!(
                "wgmma descriptors need a valid swizzled layout, not {layout:?}"
            )));
        }
        let (lbo, sbo) = M::offsets(layout);
        let hi = desc_bits(0, lbo, sbo, layout.swizzle);
        let a = self.shr(addr.0, 4);
        let a = self.and(a, 0x3FFFu32);
        let a = self.cvt_u64_u32(a).cast::<B64>();
        SmemDesc {
            value: self.or(a, hi).cast(),
            _m: PhantomData,
        }
    }

    /// `d` moved by `bytes` (a multiple of 16) in shared memory.
    pub fn desc_advance<M: Major>(&mut self, d: SmemDesc<M>, bytes: u32) -> SmemDesc<M> {
        if !bytes.is_multiple_of(16) {
            self.fail(PtxError::BadOperand(format!(
                "descriptor advanced by {bytes} bytes, not a multiple of 16"
            )));
        }
        SmemDesc {
            value: self.add(d.value, u64::from(bytes >> 4)),
            _m: PhantomData,
        }
    }

    /// `wgmma.fence`: orders earlier register accesses before the wgmmas that follow.
    pub fn wgmma_fence(&mut self) {
        self.requires(Feature::Wgmma);
        self.emit("wgmma.fence.sync.aligned;".to_string());
    }

    /// Closes the current wgmma commit group.
    pub fn wgmma_commit(&mut self) {
        self.requires(Feature::Wgmma);
        self.sync.wgmma_committed += 1;
        self.emit("wgmma.commit_group.sync.aligned;".to_string());
    }

    /// Waits until at most `pending` commit groups are in flight.
    pub fn wgmma_wait(&mut self, pending: u32) {
        self.requires(Feature::Wgmma);
        if pending > 7 {
            self.fail(PtxError::BadOperand(format!(
                "wgmma.wait_group {pending}: at most 7"
            )));
        }
        let done = self.sync.wgmma_committed.saturating_sub(pending);
        self.sync.wgmma_retired = self.sync.wgmma_retired.max(done);
        self.emit(format!("wgmma.wait_group.sync.aligned {pending};"));
    }

    /// The accumulator of a retired group, readable again. Refused unless its group was
    /// committed and a `wgmma_wait` has retired it.
    pub fn wgmma_retire<N: WgmmaN>(&mut self, f: InFlight<N>) -> Acc<N> {
        if f.group >= self.sync.wgmma_committed {
            self.fail(PtxError::BadSync(
                "accumulator retired before its wgmma group was committed".into(),
            ));
        } else if f.group >= self.sync.wgmma_retired {
            self.fail(PtxError::BadSync(
                "accumulator read while its wgmma group may still be in flight".into(),
            ));
        }
        Acc { regs: f.regs }
    }

    fn wgmma_shape<E: WgmmaInput, N: WgmmaN>(&mut self) -> String {
        self.requires(Feature::Wgmma);
        let n = N::N;
        if n == 0 || n > 256 || !n.is_multiple_of(8) {
            self.fail(PtxError::BadOperand(format!("wgmma N = {n}")));
        }
        format!("m64n{n}k{}.f32.{e}.{e}", E::K, e = E::ELEM)
    }

    /// `D (+)= A·B` with both operands in shared memory (one m64nNk instruction).
    pub fn wgmma_ss<E, N, MA, MB>(
        &mut self,
        d: impl WgmmaD<N>,
        a: SmemDesc<MA>,
        b: SmemDesc<MB>,
        scale_d: ScaleD,
    ) -> InFlight<N>
    where
        E: WgmmaInput,
        N: WgmmaN,
        MA: MajorFor<E>,
        MB: MajorFor<E>,
    {
        let regs = d.open(self);
        self.check_owner(&[Src::<U64>::owner(&a.value), Src::<U64>::owner(&b.value)]);
        let a = a.value.name().to_string();
        self.emit_wgmma::<E, N>(regs, &a, b.value, scale_d, &[MA::TRANS, MB::TRANS])
    }

    /// `D (+)= A·B` with A from registers (the K-major A fragment of the module docs:
    /// for 16-bit inputs `a[j]` packs two consecutive k, for e4m3 four).
    pub fn wgmma_rs<E, N, MB>(
        &mut self,
        d: impl WgmmaD<N>,
        a: &[Reg<E>; 4],
        b: SmemDesc<MB>,
        scale_d: ScaleD,
    ) -> InFlight<N>
    where
        E: WgmmaInput,
        N: WgmmaN,
        MB: MajorFor<E>,
    {
        let regs = d.open(self);
        self.check_owner(&a.map(|r| Src::<E>::owner(&r)));
        self.check_owner(&[Src::<U64>::owner(&b.value)]);
        self.emit_wgmma::<E, N>(regs, &reg_list(a), b.value, scale_d, &[MB::TRANS])
    }

    /// Emits one `wgmma.mma_async` with its A operand already spelled (a descriptor or a
    /// register list); `trans` holds the transpose flags, written only for the 16-bit
    /// inputs that take them.
    fn emit_wgmma<E: WgmmaInput, N: WgmmaN>(
        &mut self,
        regs: N::Regs,
        a: &str,
        b: Reg<U64>,
        scale_d: ScaleD,
        trans: &[u32],
    ) -> InFlight<N> {
        let shape = self.wgmma_shape::<E, N>();
        let trans: String = if E::TRANSPOSABLE {
            trans.iter().map(|t| format!(", {t}")).collect()
        } else {
            String::new()
        };
        self.emit(format!(
            "wgmma.mma_async.sync.aligned.{shape} {}, {a}, {}, {}, 1, 1{trans};",
            reg_list(regs.as_ref()),
            b.name(),
            scale_d.operand()
        ));
        InFlight {
            regs,
            group: self.sync.wgmma_committed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::Swizzle;

    /// Known-good descriptors, from the bit layout in the PTX ISA ("Matrix Descriptor
    /// Format") and CUTLASS's `GmmaDescriptor`.
    #[test]
    fn descriptor_bits() {
        // K-major SW128 tile at 0x400: start 0x40, LBO 1 (16 B), SBO 64 (1024 B), layout 1.
        assert_eq!(
            desc_bits(0x400, 16, 1024, Swizzle::B128),
            0x4000_0040_0001_0040
        );
        // MN-major SW128 tile of 64 K-rows at 0x8000: LBO = 64·128 = 8192 (enc 512),
        // SBO 1024 (enc 64).
        assert_eq!(
            desc_bits(0x8000, 8192, 1024, Swizzle::B128),
            0x4000_0040_0200_0800
        );
        // SW64 and SW32 codes sit in bits 62..63; addresses wrap at 2^18.
        assert_eq!(desc_bits(0, 16, 512, Swizzle::B64) >> 62, 2);
        assert_eq!(desc_bits(0, 16, 256, Swizzle::B32) >> 62, 3);
        assert_eq!(desc_bits(0x4_0010, 0, 0, Swizzle::None), 1);
        // The largest start address fills exactly the 14-bit field.
        assert_eq!(desc_bits(0x3FFF0, 0, 0, Swizzle::None), 0x3FFF);
    }

    #[test]
    fn offsets_follow_the_layout() {
        let k = SmemLayout::new(64, 128, 2, Swizzle::B128);
        assert_eq!(KMajor::offsets(&k), (16, 1024));
        assert_eq!(MnMajor::offsets(&k), (64 * 128, 1024));
        let k64 = SmemLayout::new(64, 32, 2, Swizzle::B64);
        assert_eq!(KMajor::offsets(&k64), (16, 512));
    }
}
