//! A TMA round trip, the test kernel of the tensor-map and swizzle machinery: each block
//! loads one box of a row-major `[rows][cols]` 16-bit matrix into shared memory through
//! TMA (completing on an mbarrier), then
//!
//! 1. stores the box back through TMA into a second matrix (out-of-bounds parts of edge
//!    boxes arrive as zeros and are not written back), and
//! 2. reads every element of the box with ordinary shared loads at the address
//!    [`SmemLayout::offset`] gives, writing it to a third matrix: so the swizzle the DSL
//!    computes is checked against the one the hardware applied.
//!
//! Both copies must equal the input exactly.

use std::mem::offset_of;

use crate::ptx::{
    B32, Cmp, Kernel, KernelText, Module, Parity, PtxError, Reg, S32, SmemLayout, SmemPlan,
    Special, Swizzle, Target, TileSlot, U32, U64,
};

/// Threads per block.
pub const THREADS: u32 = 128;

/// One box shape and swizzle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TmaCopyConfig {
    pub rows: u32,
    /// Columns of 16-bit elements; more than one column block makes a 3-D box.
    pub cols: u32,
    pub swizzle: Swizzle,
}

/// The argument block: the readback matrix and the sizes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct TmaCopyArgs {
    pub readback: u64,
    /// Row pitch of the matrices, in elements.
    pub ld: u64,
    pub rows: u32,
    pub cols: u32,
}

impl TmaCopyArgs {
    pub const SIZE: usize = std::mem::size_of::<TmaCopyArgs>();
}

/// The round trips the tests run: unswizzled, 64- and 128-byte swizzles, and a box of two
/// 128-byte column blocks (the 3-D box attention tiles use).
pub fn all_configs() -> Vec<TmaCopyConfig> {
    [
        (32, 64, Swizzle::None),
        (32, 32, Swizzle::B64),
        (32, 64, Swizzle::B128),
        (64, 128, Swizzle::B128),
    ]
    .into_iter()
    .map(|(rows, cols, swizzle)| TmaCopyConfig {
        rows,
        cols,
        swizzle,
    })
    .collect()
}

impl TmaCopyConfig {
    pub fn id(&self) -> String {
        let sw = match self.swizzle {
            Swizzle::None => "none",
            Swizzle::B32 => "sw32",
            Swizzle::B64 => "sw64",
            Swizzle::B128 => "sw128",
        };
        format!("tma_copy_sm90_{sw}_{}x{}", self.rows, self.cols)
    }

    pub fn layout(&self) -> SmemLayout {
        SmemLayout::new(self.rows, self.cols, 2, self.swizzle)
    }

    pub fn smem(&self) -> (SmemPlan, TileSlot) {
        let mut plan = SmemPlan::new();
        let tile = plan.tile(self.layout(), 1);
        let _bar = plan.mbarriers(1);
        (plan, tile)
    }

    /// Generates the module; a configuration [`all_configs`] does not list is refused.
    pub fn generate(&self) -> Result<Module, PtxError> {
        crate::kernels::listed("TMA copy", self, all_configs())?;
        let mut m = Module::new(Target::Sm90);
        m.push(self.build()?)?;
        Ok(m)
    }

    fn build(&self) -> Result<KernelText, PtxError> {
        let layout = self.layout();
        let mut k = Kernel::new(&self.id());
        k.max_threads(THREADS);
        let args = k.param_bytes("args", TmaCopyArgs::SIZE, 8);
        let map_in = k.tensor_map_param("tmap_in");
        let map_out = k.tensor_map_param("tmap_out");
        let mut plan = SmemPlan::new();
        let tile = plan.tile(layout, 1);
        let bars = plan.mbarriers(1);
        let smem = k.shared_memory(&plan);
        let tid = k.special(Special::TidX);
        let first = k.setp(Cmp::Eq, tid, 0u32);
        let bar = smem.barrier(&mut k, bars, 0);
        k.if_(first, |k| {
            k.mbarrier_init(bar, 1);
            k.fence_mbarrier_init();
        });
        k.sync_threads();

        // The box's first element: coordinates {col, row}, or {0, row, block} in 3-D.
        let bx = k.special(Special::CtaidX);
        let by = k.special(Special::CtaidY);
        let col0 = k.mul(bx, self.cols);
        let row0 = k.mul(by, self.rows);
        let blocks = layout.col_blocks();
        let dst = smem.tile(&mut k, tile, 0);
        let load_store = |k: &mut Kernel, load: bool| {
            let r = row0.cast::<S32>();
            if blocks == 1 {
                let c = col0.cast::<S32>();
                if load {
                    k.tma_load(dst, map_in, [c, r], bar);
                } else {
                    k.tma_store(map_out, [c, r], dst);
                }
            } else {
                let zero = k.mov::<S32>(0i32);
                let b = k.mul(bx, blocks).cast::<S32>();
                if load {
                    k.tma_load(dst, map_in, [zero, r, b], bar);
                } else {
                    k.tma_store(map_out, [zero, r, b], dst);
                }
            }
        };
        k.if_(first, |k| {
            k.mbarrier_arrive_expect_tx(bar, layout.bytes());
            load_store(k, true);
        });
        k.mbarrier_wait(bar, Parity::Zero);

        k.comment("Readback through the DSL's own swizzle arithmetic.");
        let out = k.load_param_at::<U64>(args, offset_of!(TmaCopyArgs, readback));
        let ld = k.load_param_at::<U64>(args, offset_of!(TmaCopyArgs, ld));
        let rows = k.load_param_at::<U32>(args, offset_of!(TmaCopyArgs, rows));
        let cols = k.load_param_at::<U32>(args, offset_of!(TmaCopyArgs, cols));
        let pairs_per_row = self.cols / 2;
        for i in 0..self.rows * pairs_per_row / THREADS {
            let p = k.add(tid, i * THREADS);
            let r = k.shr(p, pairs_per_row.trailing_zeros());
            let c = k.and(p, pairs_per_row - 1);
            let c = k.shl(c, 1);
            let at = logical_offset(&mut k, &layout, r, c);
            let at = layout.swizzle.apply_in(&mut k, at);
            let from = k.smem_offset(dst, at);
            let v = k.ld_shared::<B32>(from, 0);
            let row = k.add(row0, r);
            let col = k.add(col0, c);
            let row_ok = k.setp(Cmp::Lt, row, rows);
            let col_ok = k.setp(Cmp::Lt, col, cols);
            let ok = k.and_pred(row_ok, col_ok);
            let row64 = k.cvt_u64_u32(row);
            let col64 = k.cvt_u64_u32(col);
            let elem = k.mad(row64, ld, col64);
            let byte = k.shl(elem, 1);
            let addr = k.add(out, byte);
            k.guarded(ok, true, |k| k.st_global(addr, 0, v));
        }

        k.comment("TMA store of the same box (edges clipped by the hardware).");
        k.if_(first, |k| {
            load_store(k, false);
            k.bulk_commit_group();
            k.bulk_wait_group(0);
        });
        k.finish()
    }
}

/// [`SmemLayout::logical_offset`] of element (`row`, `col`) computed in the kernel.
fn logical_offset(k: &mut Kernel, l: &SmemLayout, row: Reg<U32>, col: Reg<U32>) -> Reg<U32> {
    let byte = k.mul(col, l.elem_bytes);
    let block = k.div(byte, l.block_bytes);
    let within = k.rem(byte, l.block_bytes);
    let at = k.mul(block, l.block_stride());
    let at = k.mad(row, l.block_bytes, at);
    k.add(at, within)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_valid_layouts() {
        for c in all_configs() {
            assert!(c.layout().is_valid(), "{}", c.id());
            assert_eq!(c.rows * c.cols / 2 % THREADS, 0, "{}", c.id());
            assert!(c.generate().is_ok(), "{}", c.id());
        }
        assert_eq!(all_configs()[3].layout().col_blocks(), 2);
    }
}
