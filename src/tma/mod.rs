//! Tensor-map (TMA) descriptions for the Hopper path: the driver's encoding rules checked
//! in Rust before `cuTensorMapEncodeTiled` sees them.
