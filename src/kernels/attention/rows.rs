//! Which accumulator rows and columns a thread holds, for both MMA families.
//!
//! An `mma.sync` m16n8 C fragment and four consecutive registers of a wgmma m64nN
//! accumulator have the same shape: thread (g = lane/4, c = lane%4) holds rows g and
//! g + 8 of a 16-row slab, columns 2c and 2c + 1 of each 8-column tile. So a block's
//! scores or output are, per thread, a list of [`Slab`]s (one per 16-row slab the
//! thread's warp owns), and the softmax, the mask and the epilogue are written once
//! against that view.

use crate::ptx::{F32, Kernel, Reg, S32, U32};

/// One 16-row slab of an f32 accumulator: `tiles[nt]` holds columns `8·nt..8·nt + 8`;
/// registers 0, 1 are row g (columns 2c, 2c + 1), registers 2, 3 row g + 8.
pub type Slab = Vec<[Reg<F32>; 4]>;

/// The registers of row half `half` (0: row g, 1: row g + 8) of tile `tile`.
pub fn half_of(tile: &[Reg<F32>; 4], half: usize) -> [Reg<F32>; 2] {
    [tile[2 * half], tile[2 * half + 1]]
}

/// `count` slabs of `tiles` zeroed 8-column tiles.
pub fn zeroed_slabs(k: &mut Kernel, count: usize, tiles: usize) -> Vec<Slab> {
    (0..count)
        .map(|_| {
            (0..tiles)
                .map(|_| std::array::from_fn(|_| k.mov(0f32)))
                .collect()
        })
        .collect()
}

/// Where a thread's accumulator elements sit in the block's tile.
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    /// Row (within the block's query tile) of half 0 of the thread's first slab; slab
    /// `s` starts 16·s rows further (one register, not one per slab: these kernels run
    /// at the register limit).
    pub row0: Reg<S32>,
    /// `2·(lane % 4)`: the thread's first column inside every 8-column tile.
    pub col: Reg<S32>,
}

impl Rows {
    /// A thread whose warp's first row in the block is `warp_row0`; it holds
    /// consecutive 16-row slabs from there.
    pub fn new(k: &mut Kernel, lane: Reg<U32>, warp_row0: Reg<U32>) -> Rows {
        let g = k.shr(lane, 2);
        let row0 = k.add(warp_row0, g).cast::<S32>();
        let quad_lane = k.and(lane, 3u32);
        let col = k.shl(quad_lane, 1).cast::<S32>();
        Rows { row0, col }
    }

    /// The constant row offset of slab `slab`, half `half`, from [`Rows::row0`].
    pub fn offset(slab: usize, half: usize) -> u32 {
        (16 * slab + 8 * half) as u32
    }
}
