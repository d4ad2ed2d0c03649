//! The driver layer and the public API.
//!
//! - [`device`]: driver presence, device properties, the CUDA context.
//! - [`module`]: PTX loading through `cuModuleLoadDataEx` with the JIT logs kept.
//! - [`cache`]: generate-and-load once per (kernel, architecture).
//! - [`launch`]: raw kernel launches on a caller's stream.
//! - [`timing`]: CUDA-event timing.
//! - [`tensor`]: tensor views (pointer, shape, strides, dtype).
//! - [`validate`]: argument checks that return typed errors before anything runs.
//! - [`attention`]: the forward-attention entry point and dispatch.
//! - [`buffers`]: the forward over cudarc buffers, without `unsafe`.
//! - [`fp8`]: FP8 (E4M3) forward attention with per-block scales.
//! - [`quantize`]: FP8 quantization of 16-bit Q, K, V on the GPU into those operands.
//! - [`varlen`]: forward attention over packed sequences of different lengths.
//! - [`kv_cache`]: KV caches (contiguous or paged) and their checks.
//! - [`decode`]: serving calls: split-KV decode, appending to a cache, merging partial
//!   results by their log-sum-exp.
//! - [`decode_varlen`]: a serving batch's packed queries (decode steps and prompt chunks
//!   together) against a cache, in one call.
//! - [`gemm`]: the Hopper proof kernels (warp-specialized GEMM, TMA round trip).

pub mod attention;
pub mod buffers;
pub mod cache;
pub mod decode;
pub mod decode_varlen;
pub mod device;
#[cfg(test)]
pub(crate) mod draw;
pub mod fp8;
pub mod gemm;
pub mod kv_cache;
pub mod launch;
pub mod module;
pub mod quantize;
pub mod tensor;
pub mod timing;
pub mod validate;
pub mod varlen;
