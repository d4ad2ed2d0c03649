//! FP8 forward for Ada and later (`.target sm_89`, `mma.sync` e4m3): see [`super::fp8`] for the data contract.

use super::Tiling;
use super::fp8::Fp8Config;
use crate::ptx::{Module, PtxError};

pub(crate) fn tiling(_cfg: &Fp8Config) -> Tiling {
    Tiling {
        block_m: 128,
        block_n: 128,
        threads: 128,
        smem_bytes: 0,
    }
}

pub(crate) fn generate(cfg: &Fp8Config) -> Result<Module, PtxError> {
    Err(PtxError::BadOperand(format!(
        "{} is not built yet",
        cfg.id()
    )))
}
