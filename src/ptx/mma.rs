//! Warp-level matrix instructions: `ldmatrix` and `mma.sync`.
//!
//! Fragment sizes are array lengths, so a wrong-sized fragment does not compile; element
//! types are the packed word types ([`F16x2`], [`Bf16x2`], [`E4m3x4`]), so an f16 fragment
//! cannot feed a bf16 `mma`.
//!
//! Fragment ownership (g = lane / 4, c = lane % 4), m16n8k16:
//! A `[a0..a3]` = (row g, k 2c..2c+1), (g+8, 2c..), (g, 8+2c..), (g+8, 8+2c..);
//! B `[b0, b1]` = (k 2c..2c+1, col g), (k 8+2c.., col g);
//! C/D `[c0..c3]` = (g, 2c), (g, 2c+1), (g+8, 2c), (g+8, 2c+1).

use super::kernel::{Kernel, Reg, Src};
use super::smem::SmemAddr;
use super::target::Feature;
use super::types::*;

fn list<T: PtxType, const N: usize>(r: &[Reg<T>; N]) -> String {
    let names: Vec<String> = r.iter().map(|r| r.name()).collect();
    format!("{{{}}}", names.join(", "))
}

impl Kernel {
    /// `ldmatrix...x4`: four 8x8 matrices of 16-bit elements; lanes 8j..8j+7 give the row
    /// addresses of matrix j (16-byte aligned), register j receives matrix j. With `trans`,
    /// each matrix arrives transposed (meaningless for e4m3 words: it moves byte pairs).
    pub fn ldmatrix_x4<H: MatrixWord>(&mut self, row_addr: SmemAddr, trans: bool) -> [Reg<H>; 4] {
        self.requires(Feature::Ampere);
        let d = self.regs::<H, 4>();
        self.check_owner(&[row_addr.owner()]);
        let t = if trans { ".trans" } else { "" };
        self.emit(format!(
            "ldmatrix.sync.aligned.m8n8.x4{t}.shared.b16 {}, [{}];",
            list(&d),
            row_addr.name()
        ));
        d
    }

    /// `ldmatrix...x2`: two 8x8 matrices; lanes 0..15 give the row addresses.
    pub fn ldmatrix_x2<H: MatrixWord>(&mut self, row_addr: SmemAddr, trans: bool) -> [Reg<H>; 2] {
        self.requires(Feature::Ampere);
        let d = self.regs::<H, 2>();
        self.check_owner(&[row_addr.owner()]);
        let t = if trans { ".trans" } else { "" };
        self.emit(format!(
            "ldmatrix.sync.aligned.m8n8.x2{t}.shared.b16 {}, [{}];",
            list(&d),
            row_addr.name()
        ));
        d
    }

    /// `stmatrix...x4`: the inverse of [`Kernel::ldmatrix_x4`]; register j of each thread
    /// holds (row lane/4, columns 2·(lane%4)..+1) of 8x8 matrix j, and lanes 8j..8j+7
    /// give matrix j's row addresses (16-byte aligned). With `trans`, transposed. sm_90.
    pub fn stmatrix_x4<H: Half2>(&mut self, row_addr: SmemAddr, v: [Reg<H>; 4], trans: bool) {
        self.requires(Feature::Hopper);
        self.check_owner(&[row_addr.owner()]);
        self.check_owner(&v.map(|r| Src::<H>::owner(&r)));
        let t = if trans { ".trans" } else { "" };
        self.emit(format!(
            "stmatrix.sync.aligned.x4{t}.m8n8.shared.b16 [{}], {};",
            row_addr.name(),
            list(&v)
        ));
    }

    /// `d = a * b + c` on one m16n8k16 tile, f16 or bf16 inputs, f32 accumulators
    /// (`d` and `c` may be the same registers).
    pub fn mma_m16n8k16<H: Half2>(
        &mut self,
        d: &[Reg<F32>; 4],
        a: &[Reg<H>; 4],
        b: &[Reg<H>; 2],
        c: &[Reg<F32>; 4],
    ) {
        self.requires(Feature::Ampere);
        self.check_fragments(d, c);
        self.check_owner(&a.map(|r| Src::<H>::owner(&r)));
        self.check_owner(&b.map(|r| Src::<H>::owner(&r)));
        let e = H::ELEM;
        self.emit(format!(
            "mma.sync.aligned.m16n8k16.row.col.f32.{e}.{e}.f32 {}, {}, {}, {};",
            list(d),
            list(a),
            list(b),
            list(c)
        ));
    }

    /// `d = a * b + c` on one m16n8k32 tile of e4m3 inputs, f32 accumulators. Needs sm_89.
    pub fn mma_m16n8k32_e4m3(
        &mut self,
        d: &[Reg<F32>; 4],
        a: &[Reg<E4m3x4>; 4],
        b: &[Reg<E4m3x4>; 2],
        c: &[Reg<F32>; 4],
    ) {
        self.requires(Feature::Fp8);
        self.check_fragments(d, c);
        self.check_owner(&a.map(|r| Src::<E4m3x4>::owner(&r)));
        self.check_owner(&b.map(|r| Src::<E4m3x4>::owner(&r)));
        self.emit(format!(
            "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {}, {}, {}, {};",
            list(d),
            list(a),
            list(b),
            list(c)
        ));
    }

    fn check_fragments(&mut self, d: &[Reg<F32>; 4], c: &[Reg<F32>; 4]) {
        self.check_owner(&d.map(|r| Src::<F32>::owner(&r)));
        self.check_owner(&c.map(|r| Src::<F32>::owner(&r)));
    }
}
