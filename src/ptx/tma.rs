//! The tensor memory accelerator in the kernel: bulk tensor copies between global and
//! shared memory described by a `CUtensorMap` (built on the host by [`crate::tma`]).
//!
//! The map is a 128-byte kernel parameter passed by value; the kernel takes its generic
//! address in parameter space (`cvta.param`) and never copies it to registers or local
//! memory, which TMA would not accept. Coordinates are element indices in the map's
//! dimension order, innermost (contiguous) dimension first.

use super::error::PtxError;
use super::kernel::{Kernel, ParamBytes, Reg, Src};
use super::smem::{Mbarrier, SmemAddr};
use super::target::Feature;
use super::types::*;

/// Bytes of a `CUtensorMap`.
pub const TENSOR_MAP_BYTES: usize = 128;
/// Alignment the driver requires of a tensor map (and its kernel parameter).
pub const TENSOR_MAP_ALIGN: usize = 64;

/// The generic address of a tensor map that lives in a kernel parameter (and which
/// parameter it is, so that [`Kernel::tensor_map_here`] can take the address anew).
#[derive(Debug, Clone, Copy)]
pub struct TmaDesc(Reg<U64>, ParamBytes);

/// L2 eviction priority of a TMA load (`.L2::cache_hint` policies, as CUTLASS encodes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    EvictNormal,
    /// Read once: leave the lines for others.
    EvictFirst,
    /// Read by many blocks (K and V, a GEMM's B): keep them in L2.
    EvictLast,
}

impl CachePolicy {
    fn bits(self) -> u64 {
        match self {
            CachePolicy::EvictNormal => 0x1000_0000_0000_0000,
            CachePolicy::EvictFirst => 0x12F0_0000_0000_0000,
            CachePolicy::EvictLast => 0x14F0_0000_0000_0000,
        }
    }
}

fn coord_list<const R: usize>(coords: &[Reg<S32>; R]) -> String {
    let names: Vec<String> = coords.iter().map(|c| c.name()).collect();
    format!("{{{}}}", names.join(", "))
}

impl Kernel {
    /// Declares a by-value `CUtensorMap` parameter `name` (`.param .align 64 .b8
    /// name[128]`) and returns its address for TMA instructions.
    pub fn tensor_map_param(&mut self, name: &str) -> TmaDesc {
        let p = self.param_bytes(name, TENSOR_MAP_BYTES, TENSOR_MAP_ALIGN);
        TmaDesc(self.param_address(p), p)
    }

    /// `map`'s address taken again where it is used: a map needed only late (an
    /// epilogue's store) then holds no register through the rest of the kernel.
    pub fn tensor_map_here(&mut self, map: TmaDesc) -> TmaDesc {
        TmaDesc(self.param_address(map.1), map.1)
    }

    fn check_rank<const R: usize>(&mut self) {
        if !(1..=5).contains(&R) {
            self.fail(PtxError::BadOperand(format!(
                "a tensor copy has 1 to 5 coordinates, not {R}"
            )));
        }
    }

    /// Copies the box at `coords` of `map` into shared memory at `dst` (aligned to the
    /// map's swizzle atom, at least 128 bytes), completing `bar`'s transaction count by
    /// the box's bytes. Out-of-bounds elements arrive as zeros.
    pub fn tma_load<const R: usize>(
        &mut self,
        dst: SmemAddr,
        map: TmaDesc,
        coords: [Reg<S32>; R],
        bar: Mbarrier,
    ) {
        self.tma_load_inner(dst, map, coords, bar, None);
    }

    /// [`Kernel::tma_load`] with an L2 eviction hint.
    pub fn tma_load_hint<const R: usize>(
        &mut self,
        dst: SmemAddr,
        map: TmaDesc,
        coords: [Reg<S32>; R],
        bar: Mbarrier,
        policy: CachePolicy,
    ) {
        self.tma_load_inner(dst, map, coords, bar, Some(policy));
    }

    /// Copies `bytes` (a multiple of 16) from global memory at `src` to shared memory at
    /// `dst` (both 16-byte aligned) by the bulk-copy engine, completing `bar`'s
    /// transaction count by `bytes`: a plain array (a row of constants, say) beside a
    /// stage's tensor loads.
    pub fn bulk_load(&mut self, dst: SmemAddr, src: Reg<U64>, bytes: u32, bar: Mbarrier) {
        self.requires(Feature::Hopper);
        if bytes == 0 || !bytes.is_multiple_of(16) {
            self.fail(PtxError::BadOperand(format!(
                "a bulk copy moves a positive multiple of 16 bytes, not {bytes}"
            )));
        }
        if !self.sync.fenced_any {
            self.fail(PtxError::BadSync(
                "bulk load completing on an mbarrier before any init was fenced".into(),
            ));
        }
        self.check_owner(&[dst.owner(), bar.owner(), Src::<U64>::owner(&src)]);
        self.emit(format!(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes \
             [{}], [{}], {bytes}, [{}];",
            dst.name(),
            src.name(),
            bar.name()
        ));
    }

    fn tma_load_inner<const R: usize>(
        &mut self,
        dst: SmemAddr,
        map: TmaDesc,
        coords: [Reg<S32>; R],
        bar: Mbarrier,
        policy: Option<CachePolicy>,
    ) {
        self.requires(Feature::Hopper);
        self.check_rank::<R>();
        if !self.sync.fenced_any {
            self.fail(PtxError::BadSync(
                "TMA load completing on an mbarrier before any init was fenced".into(),
            ));
        }
        self.check_owner(&[dst.owner(), bar.owner(), Src::<U64>::owner(&map.0)]);
        self.check_owner(&coords.map(|c| Src::<S32>::owner(&c)));
        let (dst, map, bar) = (dst.name(), map.0.name(), bar.name());
        let c = coord_list(&coords);
        match policy {
            None => self.emit(format!(
                "cp.async.bulk.tensor.{R}d.shared::cluster.global.mbarrier::complete_tx::bytes \
                 [{dst}], [{map}, {c}], [{bar}];"
            )),
            Some(p) => {
                let hint = self.mov::<B64>(p.bits());
                self.emit(format!(
                    "cp.async.bulk.tensor.{R}d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint \
                     [{dst}], [{map}, {c}], [{bar}], {};",
                    hint.name()
                ));
            }
        }
    }

    /// Copies shared memory at `src` to the box at `coords` of `map`; elements outside
    /// the tensor are not written. Every thread that wrote `src` must have run
    /// [`Kernel::fence_proxy_async`] and met the issuing thread at a barrier first.
    /// Completion is tracked by bulk groups ([`Kernel::bulk_commit_group`]).
    pub fn tma_store<const R: usize>(
        &mut self,
        map: TmaDesc,
        coords: [Reg<S32>; R],
        src: SmemAddr,
    ) {
        self.requires(Feature::Hopper);
        self.check_rank::<R>();
        self.check_owner(&[src.owner(), Src::<U64>::owner(&map.0)]);
        self.check_owner(&coords.map(|c| Src::<S32>::owner(&c)));
        let c = coord_list(&coords);
        self.emit(format!(
            "cp.async.bulk.tensor.{R}d.global.shared::cta.bulk_group [{}, {c}], [{}];",
            map.0.name(),
            src.name()
        ));
    }

    /// Closes the current group of bulk (TMA store) copies.
    pub fn bulk_commit_group(&mut self) {
        self.requires(Feature::Hopper);
        self.emit("cp.async.bulk.commit_group;".to_string());
    }

    /// Waits until at most `pending` bulk groups are still reading their shared-memory
    /// source (after which the source may be overwritten).
    pub fn bulk_wait_group_read(&mut self, pending: u32) {
        self.bulk_wait(pending, ".read");
    }

    /// Waits until at most `pending` bulk groups are incomplete (writes visible).
    pub fn bulk_wait_group(&mut self, pending: u32) {
        self.bulk_wait(pending, "");
    }

    fn bulk_wait(&mut self, pending: u32, read: &str) {
        self.requires(Feature::Hopper);
        if pending > 7 {
            self.fail(PtxError::BadOperand(format!(
                "cp.async.bulk.wait_group {pending}: at most 7"
            )));
        }
        self.emit(format!("cp.async.bulk.wait_group{read} {pending};"));
    }

    /// Brings the tensor map into the descriptor cache ahead of its first use.
    pub fn tma_prefetch_desc(&mut self, map: TmaDesc) {
        self.requires(Feature::Hopper);
        self.check_owner(&[Src::<U64>::owner(&map.0)]);
        self.emit(format!("prefetch.tensormap [{}];", map.0.name()));
    }
}
