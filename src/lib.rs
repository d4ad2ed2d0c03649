//! flashcore: attention kernels for NVIDIA GPUs, generated at run time from a Rust PTX DSL
//! and loaded through the CUDA driver API. No CUDA toolkit at build time.
//!
//! - [`ptx`]: the typed PTX builder.
//! - [`kernels`]: kernel generators (`config -> ptx::Module`) and the dispatch catalog.
//! - [`tma`]: tensor-map descriptions for the Hopper path.
//! - [`host`]: the driver layer and the public forward API.
//! - [`reference`](mod@reference): float64 CPU reference with the kernels' exact semantics.
//! - [`quant`]: the CPU E4M3 quantizer, the GPU one's reference (bit for bit but for
//!   Hopper's tensor-core rotation, which agrees to f32 rounding).
//! - [`calibrate`]: FP8 error against float64 on inputs built to break FP8.

pub mod calibrate;
pub mod check;
pub mod error;
pub mod ffi;
pub mod host;
pub mod kernels;
pub mod ptx;
pub mod quant;
pub mod reference;
pub mod shape;
pub mod tma;

pub use error::{Error, Result};
