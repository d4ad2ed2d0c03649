//! Kernel generators and the catalog of every configuration the dispatch can choose.

pub mod attention;

use crate::ptx::{Module, PtxError};

/// One entry of the catalog: a kernel id and how to make its module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelSpec {
    Fwd(attention::FwdConfig),
}

impl KernelSpec {
    /// The id `flashcore ptx --list` prints (also the PTX entry name).
    pub fn id(&self) -> String {
        match self {
            KernelSpec::Fwd(c) => c.id(),
        }
    }

    /// Generates the module.
    pub fn generate(&self) -> Result<Module, PtxError> {
        match self {
            KernelSpec::Fwd(c) => c.generate(),
        }
    }
}

/// Every kernel the dispatch can choose, in a stable order.
pub fn catalog() -> Vec<KernelSpec> {
    attention::all_fwd_configs()
        .into_iter()
        .map(KernelSpec::Fwd)
        .collect()
}

/// Looks a kernel up by id.
pub fn find(id: &str) -> Option<KernelSpec> {
    catalog().into_iter().find(|s| s.id() == id)
}
