//! Kernel generators and the catalog of every kernel flashcore can load.

pub mod attention;
pub mod gemm;
pub mod tma_copy;

use crate::ptx::{Module, PtxError};

/// One entry of the catalog: a kernel id and how to make its module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelSpec {
    Fwd(attention::FwdConfig),
    /// The warp-specialized GEMM that proves the Hopper building blocks (test/bench).
    Gemm(gemm::GemmConfig),
    /// The TMA load/store round trip (test).
    TmaCopy(tma_copy::TmaCopyConfig),
}

impl KernelSpec {
    /// The id `flashcore ptx --list` prints (also the PTX entry name).
    pub fn id(&self) -> String {
        match self {
            KernelSpec::Fwd(c) => c.id(),
            KernelSpec::Gemm(c) => c.id(),
            KernelSpec::TmaCopy(c) => c.id(),
        }
    }

    /// Generates the module.
    pub fn generate(&self) -> Result<Module, PtxError> {
        match self {
            KernelSpec::Fwd(c) => c.generate(),
            KernelSpec::Gemm(c) => c.generate(),
            KernelSpec::TmaCopy(c) => c.generate(),
        }
    }

    /// Dynamic shared memory of a launch, in bytes.
    pub fn smem_bytes(&self) -> u32 {
        match self {
            KernelSpec::Fwd(c) => c.tiling().smem_bytes,
            KernelSpec::Gemm(c) => c.smem().0.bytes(),
            KernelSpec::TmaCopy(c) => c.smem().0.bytes(),
        }
    }

    /// SASS instruction classes the kernel exists for: the assembly test requires each
    /// in the kernel's machine code (a kernel that lost its tensor cores or its async
    /// copies to a silent fallback fails it).
    pub fn expected_sass(&self) -> &'static [&'static str] {
        match self {
            // mma.sync and cp.async; or wgmma, TMA loads and mbarrier transactions.
            KernelSpec::Fwd(c) => match c.path {
                attention::Path::Sm80 => &["HMMA", "LDGSTS"],
                attention::Path::Sm90 => &["HGMMA", "UTMALDG", "SYNCS"],
            },
            // wgmma (QGMMA for fp8), TMA loads, mbarrier transactions.
            KernelSpec::Gemm(c) => match c.dtype {
                gemm::GemmType::E4m3 => &["QGMMA", "UTMALDG", "SYNCS"],
                _ => &["HGMMA", "UTMALDG", "SYNCS"],
            },
            KernelSpec::TmaCopy(_) => &["UTMALDG", "UTMASTG", "SYNCS"],
        }
    }
}

/// Every kernel flashcore can load, in a stable order: what the dispatch can choose,
/// then the test and benchmark kernels.
pub fn catalog() -> Vec<KernelSpec> {
    let fwd = attention::all_fwd_configs()
        .into_iter()
        .map(KernelSpec::Fwd);
    let gemm = gemm::all_gemm_configs().into_iter().map(KernelSpec::Gemm);
    let copy = tma_copy::all_configs().into_iter().map(KernelSpec::TmaCopy);
    fwd.chain(gemm).chain(copy).collect()
}

/// Looks a kernel up by id.
pub fn find(id: &str) -> Option<KernelSpec> {
    catalog().into_iter().find(|s| s.id() == id)
}
