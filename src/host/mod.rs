//! The driver layer and the public API.
