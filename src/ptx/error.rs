//! The one error type of the PTX builder.

use super::target::{Feature, Target};

/// A kernel the builder refused to emit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PtxError {
    #[error("`{0}` is not a valid PTX identifier")]
    BadName(String),
    #[error("bad parameter: {0}")]
    BadParam(String),
    #[error("bad shared-memory declaration: {0}")]
    BadShared(String),
    #[error("bad control flow: {0}")]
    BadControlFlow(String),
    #[error("kernel `{0}` used a register made by another kernel")]
    ForeignRegister(String),
    #[error("bad operand: {0}")]
    BadOperand(String),
    /// The kernel uses an instruction family the module's target does not have.
    #[error("kernel `{kernel}` needs {feature} ({}), which {target} does not have", feature.name())]
    MissingFeature {
        kernel: String,
        feature: Feature,
        target: Target,
    },
    /// A Hopper ordering rule broken: a barrier used before its initialisation was
    /// fenced, an accumulator read before its wgmma group retired, `setmaxnreg` without
    /// launch bounds, and the like.
    #[error("bad synchronization: {0}")]
    BadSync(String),
}
