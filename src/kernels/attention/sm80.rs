//! FlashAttention-2 style forward: `cp.async` double buffering, `mma.sync` m16n8k16,
//! online softmax in registers.

use super::{FwdConfig, Tiling};
use crate::ptx::{Module, PtxError};

pub(crate) fn tiling(cfg: &FwdConfig) -> Tiling {
    let _ = cfg;
    Tiling { block_m: 128, block_n: 64, threads: 128, smem_bytes: 0 }
}

pub(crate) fn generate(cfg: &FwdConfig) -> Result<Module, PtxError> {
    let _ = cfg;
    todo!()
}
