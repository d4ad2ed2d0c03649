//! One plan for a kernel's dynamic shared memory.
//!
//! A generator lays out everything it keeps in shared memory with a [`SmemPlan`]
//! (swizzled tiles on 1024-byte boundaries, mbarriers on 8-byte ones); the plan's size
//! is the launch's dynamic shared-memory size, and the kernel reaches each piece through
//! the [`Smem`] the plan declares. There is no static `.shared`: it would shift the
//! dynamic buffer's base off the alignment swizzled tiles need.
//!
//! Shared addresses are [`SmemAddr`]s and mbarriers are [`Mbarrier`]s: neither is an
//! integer or a global address, so one cannot be passed where the other is expected.

use super::kernel::{Kernel, Reg, Src};
use super::layout::SmemLayout;
use super::types::U32;

/// Alignment of every tile: the largest swizzle atom (and TMA's 128-byte minimum).
pub const TILE_ALIGN: u32 = 1024;

/// A tile region of a plan: `copies` tiles of one layout, each `stride` bytes apart
/// (a stage ring's slots, say).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileSlot {
    pub offset: u32,
    pub layout: SmemLayout,
    pub copies: u32,
    pub stride: u32,
}

/// `count` mbarriers, 8 bytes each, from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarrierSlot {
    pub offset: u32,
    pub count: u32,
}

/// A plain byte region (staging buffers), aligned as asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawSlot {
    pub offset: u32,
    pub bytes: u32,
}

/// The layout of a kernel's dynamic shared memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SmemPlan {
    bytes: u32,
}

impl SmemPlan {
    pub fn new() -> SmemPlan {
        SmemPlan::default()
    }

    fn take(&mut self, bytes: u32, align: u32) -> u32 {
        let at = self.bytes.next_multiple_of(align);
        self.bytes = at + bytes;
        at
    }

    /// `copies` tiles of `layout`, each starting on a 1024-byte boundary.
    pub fn tile(&mut self, layout: SmemLayout, copies: u32) -> TileSlot {
        let stride = layout.bytes().next_multiple_of(TILE_ALIGN);
        let offset = self.take(stride * copies, TILE_ALIGN);
        TileSlot {
            offset,
            layout,
            copies,
            stride,
        }
    }

    /// `count` mbarriers (8 bytes each, 8-byte aligned).
    pub fn mbarriers(&mut self, count: u32) -> BarrierSlot {
        BarrierSlot {
            offset: self.take(8 * count, 8),
            count,
        }
    }

    /// `bytes` bytes aligned to `align` (a power of two).
    pub fn raw(&mut self, bytes: u32, align: u32) -> RawSlot {
        RawSlot {
            offset: self.take(bytes, align.max(1)),
            bytes,
        }
    }

    /// Total bytes: the launch's dynamic shared-memory size.
    pub fn bytes(&self) -> u32 {
        self.bytes
    }
}

/// A 32-bit address in the shared-memory window. Made only from a plan's pieces, moved
/// only by byte offsets ([`Kernel::smem_offset`]).
#[derive(Debug, Clone, Copy)]
pub struct SmemAddr(pub(super) Reg<U32>);

impl SmemAddr {
    pub(super) fn name(&self) -> String {
        self.0.name()
    }
    pub(super) fn owner(&self) -> Option<u32> {
        Src::<U32>::owner(&self.0)
    }
}

/// The shared address of one 8-byte mbarrier object.
#[derive(Debug, Clone, Copy)]
pub struct Mbarrier(pub(super) Reg<U32>);

impl Mbarrier {
    pub(super) fn name(&self) -> String {
        self.0.name()
    }
    pub(super) fn owner(&self) -> Option<u32> {
        Src::<U32>::owner(&self.0)
    }
}

/// The kernel's dynamic shared memory, declared from a [`SmemPlan`].
#[derive(Debug, Clone, Copy)]
pub struct Smem {
    base: Reg<U32>,
}

impl Kernel {
    /// Declares the dynamic shared-memory buffer for `plan` (launch it with
    /// `plan.bytes()` bytes).
    pub fn shared_memory(&mut self, _plan: &SmemPlan) -> Smem {
        Smem {
            base: self.declare_dynamic_smem(TILE_ALIGN),
        }
    }

    /// `addr + offset` bytes.
    pub fn smem_offset(&mut self, addr: SmemAddr, offset: impl Src<U32>) -> SmemAddr {
        SmemAddr(self.add(addr.0, offset))
    }
}

impl Smem {
    /// Copy `copy` (a constant) of a tile slot.
    pub fn tile(&self, k: &mut Kernel, slot: TileSlot, copy: u32) -> SmemAddr {
        match slot.offset + copy * slot.stride {
            0 => SmemAddr(self.base),
            at => SmemAddr(k.add(self.base, at)),
        }
    }

    /// Copy `copy` (a register) of a tile slot.
    pub fn tile_at(&self, k: &mut Kernel, slot: TileSlot, copy: Reg<U32>) -> SmemAddr {
        let at = k.mad(copy, slot.stride, slot.offset);
        SmemAddr(k.add(self.base, at))
    }

    /// The tile slot's first copy plus a byte offset computed in the kernel (an
    /// `ldmatrix` row address, say).
    pub fn tile_byte(&self, k: &mut Kernel, slot: TileSlot, byte: Reg<U32>) -> SmemAddr {
        let at = k.add(byte, slot.offset);
        SmemAddr(k.add(self.base, at))
    }

    /// The start of a raw region.
    pub fn raw(&self, k: &mut Kernel, slot: RawSlot) -> SmemAddr {
        SmemAddr(k.add(self.base, slot.offset))
    }

    /// Barrier `i` (a constant) of a slot.
    pub fn barrier(&self, k: &mut Kernel, slot: BarrierSlot, i: u32) -> Mbarrier {
        Mbarrier(k.add(self.base, slot.offset + 8 * i))
    }

    /// Barrier `i` (a register) of a slot.
    pub fn barrier_at(&self, k: &mut Kernel, slot: BarrierSlot, i: Reg<U32>) -> Mbarrier {
        let at = k.mad(i, 8u32, slot.offset);
        Mbarrier(k.add(self.base, at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::Swizzle;

    #[test]
    fn tiles_are_atom_aligned_and_barriers_follow() {
        let mut plan = SmemPlan::new();
        let q = plan.tile(SmemLayout::new(64, 96, 2, Swizzle::B128), 1);
        let bars = plan.mbarriers(3);
        let kv = plan.tile(SmemLayout::new(128, 128, 2, Swizzle::B128), 2);
        let raw = plan.raw(100, 16);
        assert_eq!(q.offset, 0);
        assert_eq!(q.stride, 12288);
        assert_eq!(bars.offset, 12288);
        assert_eq!(
            kv.offset, 13312,
            "the next 1024-byte boundary after the barriers"
        );
        assert_eq!(kv.stride, 32768);
        assert_eq!(raw.offset, 13312 + 65536);
        assert_eq!(plan.bytes(), 13312 + 65536 + 100);
    }
}
