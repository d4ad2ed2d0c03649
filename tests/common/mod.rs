//! Helpers the GPU test binaries share: the run's seeds and moving buffers to and from
//! the device. (Each test binary compiles this module; not every one uses every helper.)
#![allow(dead_code)]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use flashcore::check::TestSeeds;

/// The run's seeds (from `FLASHCORE_SEED` or fresh), printed so a failure can be replayed.
pub fn seeds() -> TestSeeds {
    let seeds = TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
    println!("random inputs: FLASHCORE_SEED={:#x}", seeds.run_seed());
    seeds
}

pub fn up<T: DeviceRepr>(s: &Arc<CudaStream>, x: &[T]) -> CudaSlice<T> {
    s.clone_htod(x).expect("upload")
}

pub fn ptr<T>(s: &Arc<CudaStream>, x: &CudaSlice<T>) -> u64 {
    x.device_ptr(s).0
}

/// Copies `x` back once the stream's work on it is done.
pub fn down<T: DeviceRepr + Default + Clone>(s: &Arc<CudaStream>, x: &CudaSlice<T>) -> Vec<T> {
    let v = s.clone_dtoh(x).expect("download");
    s.synchronize().expect("sync");
    v
}
