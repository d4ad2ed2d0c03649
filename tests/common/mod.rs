//! Helpers the GPU test binaries share: the run's seeds and moving buffers to and from
//! the device. (Each test binary compiles this module; not every one uses every helper.)
#![allow(dead_code)]

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use flashcore::check::TestSeeds;
use flashcore::reference::Rng;

/// The run's seeds (from `FLASHCORE_SEED` or fresh), printed so a failure can be replayed.
pub fn seeds() -> TestSeeds {
    let seeds = TestSeeds::from_env().unwrap_or_else(|e| panic!("{e}"));
    println!("random inputs: FLASHCORE_SEED={:#x}", seeds.run_seed());
    seeds
}

/// The ids of the kernels `attn` has loaded that start with `prefix`.
pub fn loaded_ids(attn: &flashcore::host::attention::Attention, prefix: &str) -> Vec<String> {
    attn.loaded_kernels()
        .into_iter()
        .map(|k| k.0)
        .filter(|id| id.starts_with(prefix))
        .collect()
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

/// Bytes between the two halves of a [`FarPair`]: 2^40, the first stride no tensor map
/// can hold (so a view striding across it must run on a kernel that reads without TMA).
pub const FAR: u64 = 1 << 40;

/// Device memory at two addresses [`FAR`] bytes apart: one reservation of the address
/// range, with physical memory mapped at its start and at `FAR`, and nothing between. A
/// view of batch 2 with batch stride `FAR` then lives in a few MiB.
pub struct FarPair {
    pub base: u64,
    chunk: usize,
    handles: Vec<cudarc::driver::sys::CUmemGenericAllocationHandle>,
}

impl FarPair {
    /// Each half holds at least `bytes`.
    pub fn new(s: &Arc<CudaStream>, bytes: usize) -> FarPair {
        use cudarc::driver::sys::{self, CUresult};
        let ok = |r: CUresult, what: &str| assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
        let ctx = s.context();
        ctx.bind_to_thread().expect("bind the context");
        let location = sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ctx.ordinal() as i32,
        };
        // SAFETY: an all-zero `allocFlags` is the plain, uncompressed allocation.
        let alloc_flags = unsafe { std::mem::zeroed() };
        let prop = sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: alloc_flags,
        };
        let mut granularity = 0usize;
        let minimum = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: out-pointer and property block are live locals; the context is current.
        ok(
            unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, minimum) },
            "granularity",
        );
        let chunk = bytes.max(1).next_multiple_of(granularity);
        let mut pair = FarPair {
            base: 0,
            chunk,
            handles: Vec::new(),
        };
        // SAFETY: reserves address space only; freed in `drop`.
        ok(
            unsafe { sys::cuMemAddressReserve(&mut pair.base, FAR as usize + chunk, 0, 0, 0) },
            "reserve 2^40 bytes of addresses",
        );
        let access = sys::CUmemAccessDesc {
            location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for at in [pair.base, pair.base + FAR] {
            let mut handle = 0;
            // SAFETY: `chunk` is a multiple of the granularity, `at` lies in the
            // reservation with `chunk` bytes after it, and each mapping is undone in
            // `drop` before its handle is released.
            unsafe {
                ok(sys::cuMemCreate(&mut handle, chunk, &prop, 0), "create");
                pair.handles.push(handle);
                ok(sys::cuMemMap(at, chunk, 0, handle, 0), "map");
                ok(sys::cuMemSetAccess(at, chunk, &access, 1), "access");
            }
        }
        pair
    }

    /// The address of half `i` (0 or 1).
    pub fn half(&self, i: usize) -> u64 {
        self.base + i as u64 * FAR
    }

    /// Copies `x` to the start of half `i`.
    pub fn write<T: bytemuck::Pod>(&self, i: usize, x: &[T]) {
        let bytes: &[u8] = bytemuck::cast_slice(x);
        assert!(
            bytes.len() <= self.chunk,
            "{} bytes into a {}-byte half",
            bytes.len(),
            self.chunk
        );
        // SAFETY: the half is mapped, readable and writable, for `chunk` bytes.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyHtoD_v2(self.half(i), bytes.as_ptr().cast(), bytes.len())
        };
        assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS, "copy");
    }
}

impl Drop for FarPair {
    fn drop(&mut self) {
        use cudarc::driver::sys;
        // SAFETY: undoes `new` in reverse: the mappings, their memory, the reservation.
        // Callers synchronize before dropping, so no kernel still reads the halves.
        unsafe {
            for (i, &h) in self.handles.iter().enumerate() {
                sys::cuMemUnmap(self.half(i), self.chunk);
                sys::cuMemRelease(h);
            }
            sys::cuMemAddressFree(self.base, FAR as usize + self.chunk);
        }
    }
}

/// One of `xs`, uniformly: the random-configuration tests' draw.
pub fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[(rng.next_u64() % xs.len() as u64) as usize]
}

/// A sequence length as the random-configuration tests draw it: a third of them one of
/// `edges` (the tiles' edges, empty and one token), the rest anywhere in `1..=most`.
pub fn random_len(rng: &mut Rng, edges: &[usize], most: usize) -> usize {
    if rng.next_u64().is_multiple_of(3) {
        pick(rng, edges)
    } else {
        1 + (rng.next_u64() % most as u64) as usize
    }
}

/// A key window as the random-configuration tests draw it (FlashAttention's
/// `window_size`): each side none, 0, a few keys (shorter than a tile, so a tile's rows
/// see different parts of it), or up to `most` keys; the right side none or 0 with
/// `causal` (which fixes it at 0). At least one side is bounded.
pub fn random_window(rng: &mut Rng, causal: bool, most: u32) -> flashcore::host::tensor::Window {
    let side = |rng: &mut Rng| match rng.next_u64() % 5 {
        0 => None,
        1 => Some(0),
        2 => Some(1 + (rng.next_u64() % 40) as u32),
        _ => Some((rng.next_u64() % u64::from(most + 1)) as u32),
    };
    let left = side(rng);
    let right = if causal {
        pick(rng, &[None, Some(0)])
    } else {
        side(rng)
    };
    let left = match (left, right) {
        (None, None) => Some((rng.next_u64() % u64::from(most + 1)) as u32),
        _ => left,
    };
    flashcore::host::tensor::Window { left, right }
}

/// Relative L2 errors of `[B, Sq, H, D]` outputs over two groups of query rows: those
/// `in_first(row)` picks (the row's index within its sequence) and the rest, `None` for an
/// empty group. A whole-output error is set by the rows with the largest values, so rows
/// that read a block of outliers (×1000) hide every error of the rows that do not; split
/// this way, each group is checked at its own scale.
pub fn rel_l2_of_row_groups(
    got: &[f64],
    want: &[f64],
    [b, sq, h, d]: [usize; 4],
    in_first: impl Fn(usize) -> bool,
) -> [Option<f64>; 2] {
    assert_eq!(got.len(), b * sq * h * d);
    assert_eq!(want.len(), got.len());
    let mut groups: [(Vec<f64>, Vec<f64>); 2] = Default::default();
    for (i, (g, w)) in got.chunks(h * d).zip(want.chunks(h * d)).enumerate() {
        let group = &mut groups[usize::from(!in_first(i % sq))];
        group.0.extend_from_slice(g);
        group.1.extend_from_slice(w);
    }
    groups.map(|(g, w)| (!g.is_empty()).then(|| flashcore::reference::rel_l2(&g, &w)))
}

/// The larger of two errors, a NaN the worst of all (`f64::max` would pass over it, and a
/// NaN must never pass). Folds a worst error: `errors.fold(0.0, worse)`.
pub fn worse(worst: f64, err: f64) -> f64 {
    if err.is_nan() || err > worst {
        err
    } else {
        worst
    }
}
