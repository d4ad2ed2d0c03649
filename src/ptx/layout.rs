//! One description of a shared-memory tile's layout, read by the tensor-map encoder
//! (`crate::tma`), the wgmma matrix descriptors ([`super::wgmma`]) and the generators'
//! own address arithmetic, so the swizzle is spelled in exactly one place.
//!
//! A tile of `rows × cols` elements is stored as column blocks: the first `block_cols`
//! columns of every row, then the next `block_cols`, and so on (`[col_blocks][rows]
//! [block_bytes]`). Inside each 1024-byte-aligned region the 16-byte chunks of a row are
//! permuted by the [`Swizzle`], so the 8 rows an `ldmatrix` or a wgmma core matrix reads
//! land in 8 different bank groups. This is exactly what one TMA load of a box
//! `{block_cols, rows}` per column block writes with the matching swizzle mode.

use super::kernel::{Kernel, Reg};
use super::types::U32;

/// How 16-byte chunks are permuted inside a 1024-byte-aligned region: chunk bits 4..6
/// are XORed with the 128-byte line index (bits 7..9), keeping 3, 2, 1 or 0 of its bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Swizzle {
    None,
    B32,
    B64,
    B128,
}

impl Swizzle {
    /// The widest column block (bytes of one row) the mode allows: a TMA box's inner
    /// extent must not exceed it.
    pub const fn max_span(self) -> u32 {
        match self {
            Swizzle::None => u32::MAX,
            Swizzle::B32 => 32,
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }

    /// Alignment a swizzled region must start on: the pattern repeats every 8 lines of
    /// the span (1024, 512, 256 bytes; 16 without a swizzle).
    pub const fn atom_bytes(self) -> u32 {
        match self {
            Swizzle::None => 16,
            Swizzle::B32 => 256,
            Swizzle::B64 => 512,
            Swizzle::B128 => 1024,
        }
    }

    /// `CUtensorMapSwizzle`: NONE 0, 32B 1, 64B 2, 128B 3.
    pub const fn tensor_map_code(self) -> u32 {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 1,
            Swizzle::B64 => 2,
            Swizzle::B128 => 3,
        }
    }

    /// The wgmma matrix-descriptor layout field (bits 62..63): none 0, 128B 1, 64B 2, 32B 3.
    pub const fn desc_code(self) -> u64 {
        match self {
            Swizzle::None => 0,
            Swizzle::B128 => 1,
            Swizzle::B64 => 2,
            Swizzle::B32 => 3,
        }
    }

    /// The bits of the 128-byte line index that are XORed into the chunk index.
    const fn line_mask(self) -> u32 {
        match self {
            Swizzle::None => 0,
            Swizzle::B32 => 1,
            Swizzle::B64 => 3,
            Swizzle::B128 => 7,
        }
    }

    /// The physical offset of logical byte offset `off` (from a region aligned to
    /// [`Swizzle::atom_bytes`]).
    pub const fn apply(self, off: u32) -> u32 {
        off ^ (((off >> 7) & self.line_mask()) << 4)
    }

    /// [`Swizzle::apply`] computed in the kernel.
    pub fn apply_in(self, k: &mut Kernel, off: Reg<U32>) -> Reg<U32> {
        if self == Swizzle::None {
            return off;
        }
        let line = k.shr(off, 7);
        let line = k.and(line, self.line_mask());
        let flip = k.shl(line, 4);
        k.xor(off, flip)
    }
}

/// A `rows × cols` tile of `elem_bytes`-byte elements in shared memory, stored in column
/// blocks of `block_bytes` per row under a [`Swizzle`] (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SmemLayout {
    pub rows: u32,
    pub cols: u32,
    pub elem_bytes: u32,
    pub swizzle: Swizzle,
    /// Bytes of one row inside a column block: the widest of 128, 64, 32, 16 that
    /// divides a row and fits the swizzle (a whole row when unswizzled).
    pub block_bytes: u32,
}

impl SmemLayout {
    /// The layout of a `rows × cols` tile; see [`SmemLayout::block_bytes`].
    pub const fn new(rows: u32, cols: u32, elem_bytes: u32, swizzle: Swizzle) -> SmemLayout {
        let row = cols * elem_bytes;
        let block_bytes = match swizzle {
            Swizzle::None => row,
            _ => {
                let mut span = swizzle.max_span();
                while span > 16 && !row.is_multiple_of(span) {
                    span /= 2;
                }
                span
            }
        };
        SmemLayout {
            rows,
            cols,
            elem_bytes,
            swizzle,
            block_bytes,
        }
    }

    /// Elements of a row inside one column block (a TMA box's inner extent).
    pub const fn block_cols(&self) -> u32 {
        self.block_bytes / self.elem_bytes
    }

    /// Column blocks per row.
    pub const fn col_blocks(&self) -> u32 {
        self.cols * self.elem_bytes / self.block_bytes
    }

    /// Bytes of one column block (all rows).
    pub const fn block_stride(&self) -> u32 {
        self.rows * self.block_bytes
    }

    /// Bytes of the whole tile.
    pub const fn bytes(&self) -> u32 {
        self.rows * self.cols * self.elem_bytes
    }

    /// Whether the layout is self-consistent: whole 16-byte chunks, rows that split into
    /// column blocks, and (when swizzled) column blocks that are whole swizzle atoms so
    /// every block starts at the pattern's origin.
    pub const fn is_valid(&self) -> bool {
        let row = self.cols * self.elem_bytes;
        self.rows > 0
            && self.cols > 0
            && self.block_bytes.is_multiple_of(16)
            && row.is_multiple_of(self.block_bytes)
            && self.block_bytes <= self.swizzle.max_span()
            && (matches!(self.swizzle, Swizzle::None)
                || self
                    .block_stride()
                    .is_multiple_of(self.swizzle.atom_bytes()))
    }

    /// The logical (unswizzled) byte offset of the element at (`row`, `col`).
    pub const fn logical_offset(&self, row: u32, col: u32) -> u32 {
        let byte = col * self.elem_bytes;
        let block = byte / self.block_bytes;
        block * self.block_stride() + row * self.block_bytes + byte % self.block_bytes
    }

    /// The physical byte offset of the element at (`row`, `col`) from the tile's base.
    pub const fn offset(&self, row: u32, col: u32) -> u32 {
        self.swizzle.apply(self.logical_offset(row, col))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swizzles_permute_chunks_within_their_line() {
        for sw in [Swizzle::None, Swizzle::B32, Swizzle::B64, Swizzle::B128] {
            for atom in 0..3u32 {
                let mut seen = [false; 64];
                for chunk in 0..64u32 {
                    let off = atom * 1024 + chunk * 16 + 3;
                    let s = sw.apply(off);
                    assert_eq!(s / 128, off / 128, "{sw:?}: stays in its 128-byte line");
                    assert_eq!(s % 16, 3, "{sw:?}: bytes inside a chunk stay");
                    seen[((s % 1024) / 16) as usize] = true;
                }
                assert!(seen.iter().all(|&x| x), "{sw:?} is a permutation");
            }
        }
        // The 128-byte pattern: line 1 flips chunk bit 0, line 5 flips bits 0 and 2.
        assert_eq!(Swizzle::B128.apply(128), 128 + 16);
        assert_eq!(Swizzle::B128.apply(5 * 128 + 16), 5 * 128 + 4 * 16);
        assert_eq!(Swizzle::B64.apply(5 * 128 + 16), 5 * 128);
        assert_eq!(Swizzle::B32.apply(5 * 128 + 16), 5 * 128);
        assert_eq!(Swizzle::B32.apply(5 * 128), 5 * 128 + 16);
    }

    #[test]
    fn codes_match_the_driver_and_the_descriptor() {
        assert_eq!(Swizzle::B128.tensor_map_code(), 3);
        assert_eq!(Swizzle::B128.desc_code(), 1);
        assert_eq!(Swizzle::B32.tensor_map_code(), 1);
        assert_eq!(Swizzle::B32.desc_code(), 3);
    }

    #[test]
    fn column_blocks() {
        // bf16, d = 128: two 64-element blocks of 128 bytes.
        let l = SmemLayout::new(64, 128, 2, Swizzle::B128);
        assert_eq!(
            (l.block_bytes, l.block_cols(), l.col_blocks()),
            (128, 64, 2)
        );
        assert!(l.is_valid());
        assert_eq!(l.logical_offset(1, 64), 64 * 128 + 128);
        assert_eq!(l.offset(1, 0), 128 + 16);
        // d = 96: 64-byte blocks, three of them.
        let l = SmemLayout::new(64, 96, 2, Swizzle::B128);
        assert_eq!((l.block_bytes, l.col_blocks()), (64, 3));
        // fp8, 128 columns: one 128-byte block.
        let l = SmemLayout::new(128, 128, 1, Swizzle::B128);
        assert_eq!(l.col_blocks(), 1);
        // Unswizzled: one block of the whole row.
        let l = SmemLayout::new(8, 40, 2, Swizzle::None);
        assert_eq!((l.block_bytes, l.col_blocks()), (80, 1));
        assert!(l.is_valid());
        // 4 rows of 128 bytes are half a 128-byte swizzle atom.
        assert!(!SmemLayout::new(4, 64, 2, Swizzle::B128).is_valid());
    }
}
