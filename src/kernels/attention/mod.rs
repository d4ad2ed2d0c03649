//! Attention forward kernels.
