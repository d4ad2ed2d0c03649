//! Float64 CPU reference.
