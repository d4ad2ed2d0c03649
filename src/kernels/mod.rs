//! Kernel generators and the catalog of every kernel flashcore can load.

/// Adds `pub fn id_static(&self) -> &'static str` to a kernel configuration type that has
/// `id()` and a catalog: its id without allocating. The catalog's ids are made once per
/// process, so a warm launch looks its kernel up with no allocation; a configuration
/// outside the catalog gets `$unknown` (its generation refuses it).
macro_rules! id_static {
    ($config:ty, $catalog:path, $unknown:literal) => {
        /// [`Self::id`] without allocating: the catalog's ids are made once per process.
        pub fn id_static(&self) -> &'static str {
            use std::collections::HashMap;
            use std::sync::OnceLock;
            static IDS: OnceLock<HashMap<$config, &'static str>> = OnceLock::new();
            let ids = IDS.get_or_init(|| {
                $catalog()
                    .into_iter()
                    .map(|c| (c, &*Box::leak(c.id().into_boxed_str())))
                    .collect()
            });
            ids.get(self).copied().unwrap_or($unknown)
        }
    };
}

pub mod attention;
pub mod gemm;
pub mod quantize;
pub mod quantize_sm90;
pub mod tma_copy;

use crate::ptx::{Module, PtxError};

/// Refuses a configuration the catalog does not list. The generators are written for the
/// catalog's head dims, tile shapes and stage counts: from a hand-made configuration
/// outside it (a head dim of 80, no warps, a ring of no stages) they would build a wrong
/// kernel, panic, or never stop.
pub(crate) fn listed<C: PartialEq + std::fmt::Debug>(
    what: &str,
    config: &C,
    catalog: Vec<C>,
) -> Result<(), PtxError> {
    if catalog.contains(config) {
        Ok(())
    } else {
        Err(PtxError::BadOperand(format!(
            "no {what} kernel for {config:?}: not a configuration of the catalog"
        )))
    }
}

/// One entry of the catalog: a kernel id and how to make its module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelSpec {
    Fwd(attention::FwdConfig),
    /// FP8 (E4M3) forward with per-block scales.
    Fp8(attention::fp8::Fp8Config),
    /// Split-KV decode against a contiguous or paged cache.
    Decode(attention::decode::DecodeConfig),
    /// Merging partial results by their log-sum-exp (decode's combine, KV shards).
    Merge(attention::merge::MergeConfig),
    /// Appending new tokens' K and V to a cache.
    Append(attention::append::AppendConfig),
    /// FP8 quantization of 16-bit Q, K, V (and K's mean for smoothing).
    Quantize(quantize::QuantConfig),
    /// The Hadamard option's rows kernel for Hopper: the rotation on the tensor cores.
    Rotate(quantize_sm90::RotateConfig),
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
            KernelSpec::Fp8(c) => c.id(),
            KernelSpec::Decode(c) => c.id(),
            KernelSpec::Merge(c) => c.id(),
            KernelSpec::Append(c) => c.id(),
            KernelSpec::Quantize(c) => c.id(),
            KernelSpec::Rotate(c) => c.id(),
            KernelSpec::Gemm(c) => c.id(),
            KernelSpec::TmaCopy(c) => c.id(),
        }
    }

    /// Generates the module.
    pub fn generate(&self) -> Result<Module, PtxError> {
        match self {
            KernelSpec::Fwd(c) => c.generate(),
            KernelSpec::Fp8(c) => c.generate(),
            KernelSpec::Decode(c) => c.generate(),
            KernelSpec::Merge(c) => c.generate(),
            KernelSpec::Append(c) => c.generate(),
            KernelSpec::Quantize(c) => c.generate(),
            KernelSpec::Rotate(c) => c.generate(),
            KernelSpec::Gemm(c) => c.generate(),
            KernelSpec::TmaCopy(c) => c.generate(),
        }
    }

    /// Dynamic shared memory of a launch, in bytes.
    pub fn smem_bytes(&self) -> u32 {
        match self {
            KernelSpec::Fwd(c) => c.tiling().smem_bytes,
            KernelSpec::Fp8(c) => c.tiling().smem_bytes,
            KernelSpec::Decode(c) => c.smem_bytes(),
            KernelSpec::Merge(_) | KernelSpec::Append(_) => 0,
            KernelSpec::Quantize(c) => c.smem_bytes(),
            KernelSpec::Rotate(c) => c.smem_bytes(),
            KernelSpec::Gemm(c) => c.smem().0.bytes(),
            KernelSpec::TmaCopy(c) => c.smem().0.bytes(),
        }
    }

    /// SASS instruction classes the kernel exists for: the assembly test requires each
    /// in the kernel's machine code (a kernel that lost its tensor cores or its async
    /// copies to a silent fallback fails it). An entry `sm_NN:OP` applies only to the
    /// machine code for `sm_NN`.
    pub fn expected_sass(&self) -> &'static [&'static str] {
        match self {
            // mma.sync and cp.async; or wgmma, TMA loads and mbarrier transactions, and O
            // staged by stmatrix for a TMA store.
            KernelSpec::Fwd(c) => match c.path {
                attention::Path::Sm80 => &["HMMA", "LDGSTS"],
                attention::Path::Sm90 => &["HGMMA", "UTMALDG", "SYNCS", "STSM", "UTMASTG"],
            },
            // wgmma (QGMMA for fp8), TMA loads, mbarrier transactions.
            KernelSpec::Gemm(c) => match c.dtype {
                gemm::GemmType::E4m3 => &["QGMMA", "UTMALDG", "SYNCS"],
                _ => &["HGMMA", "UTMALDG", "SYNCS"],
            },
            // e4m3 wgmma (QGMMA) on TMA tiles; or e4m3 mma.sync on cp.async tiles, which
            // is QMMA.16832.F32.E4M3.E4M3 on Ada. Hopper, which runs the sm_89 module as
            // its fallback, has no fp8 mma.sync: ptxas unpacks the bytes to f16 and
            // emulates it with HMMA.16816.
            KernelSpec::Fp8(c) => match c.path {
                attention::fp8::Fp8Path::Sm90 if attention::sm90_fp8::stages_output(c) => {
                    &["QGMMA", "UTMALDG", "SYNCS", "STSM", "UTMASTG"]
                }
                attention::fp8::Fp8Path::Sm90 => &["QGMMA", "UTMALDG", "SYNCS"],
                attention::fp8::Fp8Path::Sm89 => &[
                    "sm_89:QMMA.16832.F32.E4M3",
                    "sm_90:HMMA.16816.F32",
                    "LDGSTS",
                ],
            },
            KernelSpec::TmaCopy(_) => &["UTMALDG", "UTMASTG", "SYNCS"],
            // Decode: mma.sync on cp.async tiles (an e4m3 cache's codes widened to f16
            // by F2FP unpacks first). Merge and append are plain loads and stores:
            // 128-bit where the rows allow; an e4m3 append agrees on each row's maximum
            // by shuffles and converts with F2FP.
            KernelSpec::Decode(c) if c.fp8 => &["HMMA", "LDGSTS", "F2FP.F16.E4M3.UNPACK_B"],
            KernelSpec::Decode(_) => &["HMMA", "LDGSTS"],
            KernelSpec::Merge(_) => &[],
            KernelSpec::Append(c) if c.fp8_from.is_some() => {
                &["LDG.E.128", "SHFL.BFLY", "F2FP.SATFINITE.E4M3"]
            }
            KernelSpec::Append(_) => &["LDG.E.128", "STG.E.128"],
            // The e4m3 conversion (F2FP.SATFINITE.E4M3 on sm_89 and sm_90) between
            // 16-byte loads and stores; the key mean's atomic adds.
            KernelSpec::Quantize(c) => match c.kind {
                quantize::QuantKind::KeyMean { rotate: false } => &["LDG.E.128", "RED"],
                // With the rotation: the ticket behind a GPU-scope fence, then the last
                // block's butterflies across lanes and its 16-byte stores.
                quantize::QuantKind::KeyMean { rotate: true } => &[
                    "LDG.E.128",
                    "RED",
                    "MEMBAR",
                    "ATOMG",
                    "SHFL.BFLY",
                    "STG.E.128",
                ],
                _ => &["F2FP.SATFINITE.E4M3", "LDG.E.128", "STG.E.128"],
            },
            // wgmma on TMA tiles, then the conversion and 16-byte stores; with smoothing,
            // each stage's mean beside its tile by a bulk copy.
            KernelSpec::Rotate(c) if c.smoothing != quantize::Smoothing::None => &[
                "HGMMA",
                "UTMALDG",
                "UBLKCP",
                "SYNCS",
                "F2FP.SATFINITE.E4M3",
                "STG.E.128",
            ],
            KernelSpec::Rotate(_) => &[
                "HGMMA",
                "UTMALDG",
                "SYNCS",
                "F2FP.SATFINITE.E4M3",
                "STG.E.128",
            ],
        }
    }
}

/// Every kernel flashcore can load, in a stable order: what the dispatch can choose,
/// then the test and benchmark kernels.
pub fn catalog() -> Vec<KernelSpec> {
    let fwd = attention::all_fwd_configs()
        .into_iter()
        .map(KernelSpec::Fwd);
    let fp8 = attention::fp8::all_fp8_configs()
        .into_iter()
        .map(KernelSpec::Fp8);
    let decode = attention::decode::all_decode_configs()
        .into_iter()
        .map(KernelSpec::Decode);
    let merge = attention::merge::all_merge_configs()
        .into_iter()
        .map(KernelSpec::Merge);
    let append = attention::append::all_append_configs()
        .into_iter()
        .map(KernelSpec::Append);
    let quantize = quantize::all_quant_configs()
        .into_iter()
        .map(KernelSpec::Quantize);
    let rotate = quantize_sm90::all_rotate_configs()
        .into_iter()
        .map(KernelSpec::Rotate);
    let gemm = gemm::all_gemm_configs().into_iter().map(KernelSpec::Gemm);
    let copy = tma_copy::all_configs().into_iter().map(KernelSpec::TmaCopy);
    fwd.chain(fp8)
        .chain(decode)
        .chain(merge)
        .chain(append)
        .chain(quantize)
        .chain(rotate)
        .chain(gemm)
        .chain(copy)
        .collect()
}

/// Looks a kernel up by id.
pub fn find(id: &str) -> Option<KernelSpec> {
    catalog().into_iter().find(|s| s.id() == id)
}

#[cfg(test)]
mod tests {
    use super::attention::decode::DecodeConfig;
    use super::attention::fp8::{Fp8Config, Fp8Path};
    use super::attention::merge::{MergeConfig, MergeType};
    use super::attention::{FwdConfig, HalfType, Path};
    use super::*;

    /// An sm80 forward configuration no catalog lists (head dim 24, no query rows).
    fn outside_sm80() -> FwdConfig {
        FwdConfig {
            path: Path::Sm80,
            dtype: HalfType::F16,
            head_dim: 24,
            causal: false,
            window: false,
            block_m: 0,
            split_keys: false,
            fold_scale: false,
            padded: false,
            narrow_keys: false,
            softcap: false,
        }
    }

    /// `id_static` gives every catalog configuration its `id`, and one outside the
    /// catalog the type's placeholder.
    #[test]
    fn static_ids_match_the_ids() {
        use super::attention::all_fwd_configs;
        use super::attention::decode::all_decode_configs;
        use super::attention::fp8::all_fp8_configs;
        use super::attention::merge::all_merge_configs;
        for c in all_fwd_configs() {
            assert_eq!(c.id_static(), c.id());
        }
        for c in all_decode_configs() {
            assert_eq!(c.id_static(), c.id());
        }
        for c in all_merge_configs() {
            assert_eq!(c.id_static(), c.id());
        }
        for c in all_fp8_configs() {
            assert_eq!(c.id_static(), c.id());
        }
        assert_eq!(outside_sm80().id_static(), "attn_fwd_unknown");
    }

    /// Hand-made configurations outside the catalog get an error, where the generators
    /// divided by zero, indexed past their tables or built a kernel for a head dim that
    /// nothing dispatches to. (A sweep of head dims 0 to 1024, every tile, stage and
    /// warp count found 832 panics before the check and none after.)
    #[test]
    fn generators_refuse_configurations_outside_the_catalog() {
        let refused = |what: &str, r: Result<Module, PtxError>| match r {
            Err(PtxError::BadOperand(m)) => assert!(m.contains("not a configuration"), "{m}"),
            other => panic!("{what}: {:?}", other.map(|_| "a module")),
        };
        let fwd = outside_sm80();
        refused("sm80, no query rows", fwd.generate());
        let sm90 = FwdConfig {
            path: Path::Sm90,
            head_dim: 96,
            block_m: 128,
            ..fwd
        };
        refused("sm90 at head dim 96", sm90.generate());
        let fp8 = Fp8Config {
            path: Fp8Path::Sm89,
            out: HalfType::Bf16,
            head_dim: 40,
            causal: true,
        };
        refused("sm89 FP8 at head dim 40", fp8.generate());
        let decode = DecodeConfig {
            dtype: HalfType::F16,
            head_dim: 80,
            paged: true,
            stages: 3,
            warps: 4,
            fp8: false,
            padded: false,
            packed: false,
            packed_queries: false,
        };
        refused("decode at head dim 80", decode.generate());
        let packed = DecodeConfig {
            head_dim: 128,
            packed: true,
            ..decode
        };
        refused("packed paged decode", packed.generate());
        let packed_e4m3 = DecodeConfig {
            paged: false,
            fp8: true,
            ..packed
        };
        refused("packed e4m3 decode", packed_e4m3.generate());
        let e4m3 = DecodeConfig {
            head_dim: 0,
            fp8: true,
            ..decode
        };
        refused("e4m3 decode at head dim 0", e4m3.generate());
        let e4m3_padded = DecodeConfig {
            head_dim: 128,
            fp8: true,
            padded: true,
            ..decode
        };
        refused("padded e4m3 decode", e4m3_padded.generate());
        let merge = MergeConfig {
            input: MergeType::F32,
            output: MergeType::F16,
            head_dim: 80,
            programmatic: false,
            padded: false,
            packed: false,
        };
        refused("merge at head dim 80", merge.generate());
        let packed = MergeConfig {
            input: MergeType::F16,
            head_dim: 128,
            packed: true,
            ..merge
        };
        refused("packed merge of 16-bit shards", packed.generate());
        let merge = MergeConfig {
            head_dim: 192,
            padded: true,
            ..merge
        };
        refused("padded merge at head dim 192", merge.generate());
        // The catalog's own pass (their modules are the assembly test's).
        for spec in catalog().into_iter().take(3) {
            assert!(spec.generate().is_ok(), "{}", spec.id());
        }
    }
}
