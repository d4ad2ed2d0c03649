//! Forward attention: validation, dispatch, the module cache and the launch.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUstream};

use super::cache::ModuleCache;
use super::device::{ContextScope, Device, check};
use super::launch::{LaunchDims, PaddedParams, launch};
use super::module::{Carveout, LoadedKernel};
use super::tensor::{AttentionParams, LseView, TensorView};
use super::validate::{FWD_PADDED_HEAD_DIMS_TEXT, FwdProblem, Runs, validate_fwd};
use crate::error::{Error, Result};
use crate::kernels::attention::softcap::ScoreScaling;
use crate::kernels::attention::{
    BLOCK_M_NARROW, BLOCK_M_WIDE, FwdArgs, FwdConfig, HalfType, Path, Tiling, WINDOW_UNBOUNDED,
    padded_head_dim, scale_folds, sm90, sm90::MapColumns,
};
use crate::shape::AttnShape;
use crate::tma::{TensorMap, TiledMap, TmaType};

/// The best kernel path an architecture has, or why it has none: the warp-specialized
/// wgmma/TMA path on Hopper (sm_90, whose `sm_90a` kernels run nowhere else), the
/// `mma.sync` path on every other GPU from sm_80.
pub fn path_for_arch(arch: (i32, i32)) -> Result<Path, String> {
    match arch {
        (9, 0) => Ok(Path::Sm90),
        (major, _) if major >= 8 => Ok(Path::Sm80),
        (major, minor) => Err(format!("sm_{major}{minor} is below sm_80: no kernel path")),
    }
}

/// Which kernel paths the dispatch may choose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PathChoice {
    /// The best path of the GPU ([`path_for_arch`]), the sm80 path where it has no kernel.
    #[default]
    Best,
    /// The sm80 path, even on Hopper (to compare the two on one GPU).
    Sm80,
}

/// The kernel configuration a problem with softmax scale `scale` dispatches to on a GPU
/// of architecture `arch` with `sm_count` SMs: the sm90 path on Hopper for head dims 64,
/// 128, 192 and 256, and padded onto the next of them for the other multiples of 8 up to
/// 256 ([`sm90::padded_head_dim`]; the scale folded into the exponent where that is safe,
/// see [`scale_folds`]), the sm80 path otherwise ([`dispatch_sm80`]). Packed batches
/// dispatch the same way (a padded kernel's direct stores of O skip the columns past the
/// head dim, its last parameter).
pub fn dispatch(
    arch: (i32, i32),
    sm_count: u32,
    dtype: HalfType,
    shape: &AttnShape,
    causal: bool,
    scale: f32,
) -> Result<FwdConfig, String> {
    let path = path_for_arch(arch)?;
    let block_m = sm90_block_m(shape, sm_count, causal);
    let sm90_kernel = sm90::padded_head_dim(shape.head_dim);
    if let (Path::Sm90, Some((head_dim, padded))) = (path, sm90_kernel)
        && sm90_has_kernel(shape, block_m)
    {
        let split_keys = sm90_split_keys(shape, block_m);
        return Ok(FwdConfig {
            path,
            dtype,
            head_dim,
            causal,
            window: false,
            softcap: false,
            block_m,
            split_keys,
            fold_scale: !split_keys && scale_folds(dtype, head_dim, scale),
            padded,
            narrow_keys: sm90_narrow_keys(shape, (head_dim, block_m, split_keys), causal),
        });
    }
    dispatch_sm80(arch, sm_count, dtype, shape, causal)
}

/// [`Attention::plan`] on a GPU of architecture `arch` with `sm_count` SMs.
pub(crate) fn plan_problem(
    arch: (i32, i32),
    sm_count: u32,
    choice: PathChoice,
    problem: &FwdProblem,
) -> Result<FwdConfig, String> {
    let shape = dispatch_shape(problem);
    let sm80 = || dispatch_sm80(arch, sm_count, problem.dtype, &shape, problem.causal);
    let cfg = match choice {
        PathChoice::Best => {
            let (dtype, causal, scale) = (problem.dtype, problem.causal, problem.scale);
            dispatch(arch, sm_count, dtype, &shape, causal, scale)
        }
        PathChoice::Sm80 => sm80(),
    }?;
    // A key window runs the windowed kernel of the causal configuration's tiles, a soft
    // cap the soft-capping kernel of the configuration's.
    let adjust = |cfg: FwdConfig| {
        let cfg = if problem.window.is_some() {
            cfg.windowed()
        } else {
            cfg
        };
        if problem.softcap.is_some() {
            cfg.softcapped()
        } else {
            cfg
        }
    };
    let cfg = adjust(cfg);
    // Both take at most 128-row tiles: a 192-row pick passed the sm90 kernels' 31-bit
    // work-item numbering, which twice the tiles may not (B·Hq near 2^30, 129 to 192
    // query rows).
    if cfg.path == Path::Sm90 && work_items(&shape, cfg.block_m) >= 1 << 31 {
        return Ok(adjust(sm80()?));
    }
    Ok(cfg)
}

/// The shape the dispatch judges a problem by: its own, except that a packed batch's key
/// count is the mean per sequence (its `seqlen_k` counts the rows of every sequence, but
/// a query tile sees only its own sequence's keys).
pub(crate) fn dispatch_shape(problem: &FwdProblem) -> AttnShape {
    let shape = problem.shape;
    match problem.packed {
        Some(p) => AttnShape {
            seqlen_k: p.total_k.div_ceil(shape.batch.max(1)),
            ..shape
        },
        None => shape,
    }
}

/// (query tile, head, batch) triples: the sm80 grid's blocks, the sm90 kernel's work
/// items (saturating: a shape built by hand may hold any sizes; validation bounds them).
pub(crate) fn work_items(shape: &AttnShape, block_m: u32) -> usize {
    shape
        .seqlen_q
        .div_ceil(block_m.max(1) as usize)
        .saturating_mul(shape.heads_q)
        .saturating_mul(shape.batch)
}

/// A shape's head dim as the kernel configurations hold it; one past `u32` has no kernel
/// (rather than wrapping onto one that has).
pub(crate) fn kernel_head_dim(shape: &AttnShape) -> Result<u32, String> {
    u32::try_from(shape.head_dim).map_err(|_| format!("no kernel for head dim {}", shape.head_dim))
}

/// Whether the sm90 path has a kernel for `shape` with `block_m`-row query tiles: its head
/// dim (padded or not) and tile, and work items that fit the 31 bits the persistent
/// kernel numbers them in.
fn sm90_has_kernel(shape: &AttnShape, block_m: u32) -> bool {
    let tile = match sm90::padded_head_dim(shape.head_dim) {
        Some((d, false)) => sm90::has_tile(d, block_m),
        Some((d, true)) => sm90::has_padded(d, block_m, false),
        None => false,
    };
    tile && work_items(shape, block_m) < 1 << 31
}

/// The sm90 path's query tile: 128 rows (two consumer warpgroups in ping-pong), except
/// - 64 rows (one consumer warpgroup) while those tiles still fit in one wave of one
///   block per SM: such a grid leaves at least half the SMs idle with 128-row tiles, and
///   the kernel's time is the latency of one block's chain of key tiles, which a
///   warpgroup alone on its SM runs faster;
/// - 192 rows (three consumer warpgroups) at head dim 64 from 2048 keys without a mask,
///   from 8192 with a causal one, and a full wave of them: more rows share each K/V tile
///   and the tensor cores turn over three warpgroups (on the H200, 4–8% faster without
///   a mask and 4–8% with a causal one from 8192 keys; shorter key loops run slower,
///   causal ones most, since a 192-row tile straddles two diagonal key tiles).
pub(crate) fn sm90_block_m(shape: &AttnShape, sm_count: u32, causal: bool) -> u32 {
    let sms = sm_count as usize;
    let min_keys = if causal { 8192 } else { 2048 };
    if work_items(shape, 64) <= sms {
        64
    } else if shape.head_dim == 64 && shape.seqlen_k >= min_keys && work_items(shape, 192) >= sms {
        192
    } else {
        sm90::BLOCK_M
    }
}

/// Keys from which a 64-row sm90 problem takes the split-keys kernel. Measured on the
/// H200 against the one-consumer kernel, same call (Sq 512 or as noted, D64, f16): Sk
/// 1024 +2–4%, 2048 +7–8%, B1 H2 S4096 +12–13% (causal and not); Sk 512 and below 1–7%
/// slower, where the merge and the second warpgroup's turns cost more than the shorter
/// chain of tiles saves.
pub const SPLIT_MIN_KEYS: usize = 1024;

/// Keys up to which head dim 256 takes 64-key tiles ([`FwdConfig::narrow_keys`]), without
/// a mask and with a causal one. Against 80-key tiles on an H100, same call (f16, H8,
/// B·S = 16384): S 512 +1.9% without a mask and +3.0% causal, S 1024 causal +1.4% but
/// 3.4% slower without a mask, and 2–6% slower from S 2048 either way.
pub const NARROW_KEYS_MAX: [usize; 2] = [512, 1024];

/// Whether a problem on the sm90 path takes the 64-key tiles: where there is such a
/// kernel (`(head_dim, block_m, split_keys)`) and the keys are few
/// ([`NARROW_KEYS_MAX`]).
pub(crate) fn sm90_narrow_keys(
    shape: &AttnShape,
    (head_dim, block_m, split_keys): (u32, u32, bool),
    causal: bool,
) -> bool {
    sm90::has_narrow_keys(head_dim, block_m, split_keys)
        && shape.seqlen_k <= NARROW_KEYS_MAX[usize::from(causal)]
}

/// Whether a problem on the sm90 path with `block_m`-row tiles takes the split-keys
/// kernel: where there is one (64-row tiles, which the dispatch picks for grids that
/// leave SMs idle, at head dim 64) and the blocks see at least [`SPLIT_MIN_KEYS`] keys.
pub(crate) fn sm90_split_keys(shape: &AttnShape, block_m: u32) -> bool {
    kernel_head_dim(shape).is_ok_and(|d| sm90::has_split(d, block_m))
        && shape.seqlen_k >= SPLIT_MIN_KEYS
}

/// The sm80 path's configuration for a problem: at the problem's head dim, or padded to
/// the next one with a kernel ([`padded_head_dim`]: 80 runs the 96 kernel).
///
/// The query tile is the wide one unless the wide grid would leave SMs without a block:
/// then the narrow tile doubles the blocks. (Measured on the H200: with 64 wide blocks the
/// narrow tile is 12% faster, with 128 they tie, from 256 the wide tile is 4-37% faster.)
pub fn dispatch_sm80(
    arch: (i32, i32),
    sm_count: u32,
    dtype: HalfType,
    shape: &AttnShape,
    causal: bool,
) -> Result<FwdConfig, String> {
    path_for_arch(arch)?;
    let Some((head_dim, padded)) = padded_head_dim(shape.head_dim) else {
        return Err(format!("no kernel for head dim {}", shape.head_dim));
    };
    let block_m = if work_items(shape, BLOCK_M_WIDE) < sm_count as usize {
        BLOCK_M_NARROW
    } else {
        BLOCK_M_WIDE
    };
    Ok(FwdConfig::sm80(dtype, head_dim, causal, block_m, padded))
}

/// The sm90 kernels' tensor map of a `[B, S, H, D]` view: the 5-D view
/// `{64, seq, d/64, heads, batch}` (innermost first) whose box `{64, rows, d/64, 1, 1}`
/// lands as the kernel's `[d/64][rows][128 B]` tile. A dimension of extent 1 is never
/// stepped, so its stride (which validation leaves unchecked) is replaced by one TMA
/// accepts.
pub(crate) fn sm90_map(t: &TensorView, rows: u32) -> Result<TensorMap> {
    sm90_map_boxed(t, [rows, t.shape[3] as u32 / 64], MapColumns::Blocked)
}

/// The map of O the sm90a epilogues store through, one `{64, 16}` box (a warp's rows,
/// one column block) at a time, its column blocks addressed as `columns` says; `None`
/// where O cannot go out by TMA (the epilogue then stores it directly): packed sequences
/// (a box would cross into the next sequence's rows) or a layout TMA refuses. Any other
/// failure to encode is an error.
pub(crate) fn sm90_output_map(
    o: &TensorView,
    packed: bool,
    columns: MapColumns,
) -> Result<Option<TensorMap>> {
    if packed {
        return Ok(None);
    }
    match sm90_map_boxed(o, [16, 1], columns) {
        Ok(map) => Ok(Some(map)),
        Err(e) if e.is_map_refusal() => Ok(None),
        Err(e) => Err(e),
    }
}

/// A padded kernel's head dim parameter: the tensors' head dim, which has a kernel only
/// if it fits a `u32`.
fn head_dim_param(d: usize) -> Result<u32> {
    u32::try_from(d).map_err(|_| Error::UnsupportedHeadDim(d, FWD_PADDED_HEAD_DIMS_TEXT))
}

/// What an sm90a forward launch takes beside its argument block: the tensor maps of Q, K
/// and V, O's where O goes out by TMA ([`sm90_output_map`]; direct stores otherwise), and
/// a padded kernel's ([`FwdConfig::padded`]) last parameter, the tensors' head dim.
pub(crate) struct Sm90Operands {
    pub inputs: [TensorMap; 3],
    pub output: Option<TensorMap>,
    pub head_dim: Option<u32>,
}

/// How `cfg`'s maps of `[B, S, H, D]` views of head dim `d` address their column blocks,
/// and how many a box holds: all of them through a dimension of their own, or (a padded
/// kernel) one at a time.
fn map_columns(cfg: &FwdConfig, d: usize) -> (MapColumns, u32) {
    match cfg.padded {
        false => (MapColumns::Blocked, d as u32 / 64),
        true => (MapColumns::PerBlock, 1),
    }
}

/// The [`Sm90Operands`] of a launch of `cfg`. A padded kernel's maps hold the tensors'
/// own head dim: the loads zero-fill the kernel's columns past it, O's TMA store clips
/// them, and the direct stores (a packed batch, or an O that TMA cannot describe) check
/// them against the head dim parameter.
pub(crate) fn sm90_maps(
    cfg: &FwdConfig,
    [q, k, v, o]: [&TensorView; 4],
    packed: bool,
) -> Result<Sm90Operands> {
    let Tiling {
        block_m, block_n, ..
    } = cfg.tiling();
    let d = q.shape[3];
    let (columns, blocks) = map_columns(cfg, d);
    let map = |t: &TensorView, rows| sm90_map_boxed(t, [rows, blocks], columns);
    Ok(Sm90Operands {
        inputs: [map(q, block_m)?, map(k, block_n)?, map(v, block_n)?],
        output: sm90_output_map(o, packed, columns)?,
        head_dim: cfg.padded.then(|| head_dim_param(d)).transpose()?,
    })
}

/// The [`Sm90Operands`] of a launch of `cfg` over a paged cache: Q's and O's as
/// [`sm90_maps`] makes them, K's and V's over the pools `[pages, page_size, Hkv, D]`
/// (the page as the maps' batch), with a box of one 64-column block by a chunk of rows:
/// the page, or the largest power of two that divides the key tile where that is smaller
/// (see the producer's `load_paged_tile`). `packed`: Q and O hold packed sequences.
pub(crate) fn sm90_paged_maps(
    cfg: &FwdConfig,
    [q, k, v, o]: [&TensorView; 4],
    page_size: usize,
    packed: bool,
) -> Result<Sm90Operands> {
    let Tiling {
        block_m, block_n, ..
    } = cfg.tiling();
    let d = q.shape[3];
    let (columns, blocks) = map_columns(cfg, d);
    let chunk = (page_size as u32).min(1 << block_n.trailing_zeros());
    let pool = |t: &TensorView| sm90_map_boxed(t, [chunk, 1], columns);
    Ok(Sm90Operands {
        inputs: [
            sm90_map_boxed(q, [block_m, blocks], columns)?,
            pool(k)?,
            pool(v)?,
        ],
        output: sm90_output_map(o, packed, columns)?,
        head_dim: cfg.padded.then(|| head_dim_param(d)).transpose()?,
    })
}

/// The 5-D map of a `[B, S, H, D]` view with a box of `rows` rows by `blocks` 64-column
/// blocks: through a dimension of column blocks ([`sm90_map`]), or per block
/// (`{D, seq, 1, heads, batch}`, boxes `{64, rows, 1, 1, 1}`; a padded kernel's, see
/// [`MapColumns::PerBlock`]).
fn sm90_map_boxed(
    t: &TensorView,
    [rows, blocks]: [u32; 2],
    columns: MapColumns,
) -> Result<TensorMap> {
    let dtype = match t.dtype {
        super::tensor::DType::Bf16 => TmaType::Bf16,
        _ => TmaType::F16,
    };
    let d = t.shape[3] as u64;
    let bytes = |dim: usize| {
        if t.shape[dim] == 1 {
            16
        } else {
            t.strides[dim] as u64 * 2
        }
    };
    let (inner, col_blocks) = match columns {
        MapColumns::Blocked => (64, d / 64),
        MapColumns::PerBlock => (d, 1),
    };
    let dims = [
        inner,
        t.shape[1] as u64,
        col_blocks,
        t.shape[2] as u64,
        t.shape[0] as u64,
    ];
    let strides = [bytes(1), 128, bytes(2), bytes(0)];
    let boxes = [64, rows, blocks, 1, 1];
    TiledMap::new(dtype, &dims, &strides, &boxes, crate::ptx::Swizzle::B128).encode(t.ptr)
}

/// Forward attention on one device: owns the loaded kernels for it.
///
/// The first call for a configuration generates its PTX and loads it (milliseconds);
/// later calls validate, look the kernel up and launch, with no allocation but a causal
/// sm90a launch's 4-byte tile counter and a decode-shaped call's partial results
/// (stream-ordered, `cuMemAllocAsync`, freed on the caller's stream; without that
/// allocator such a launch runs one block per work item, or on the forward kernels,
/// instead), so they can be captured in a CUDA graph. Every call (and dropping it)
/// leaves the calling thread's current CUDA context as it found it: the device's primary
/// context is current only inside the driver calls (see
/// [`ContextScope`]). Dropping it unloads its kernels: CUDA graphs that captured its calls
/// must not be launched after that.
pub struct Attention {
    device: Arc<Device>,
    cache: ModuleCache,
    choice: PathChoice,
    programmatic: bool,
}

/// The environment variable that turns programmatic launches off
/// ([`Attention::with_programmatic_launches`]): set to anything but `0` or nothing.
pub const NO_PDL_ENV: &str = "FLASHCORE_NO_PDL";

/// Whether `value` (of [`NO_PDL_ENV`]) asks for plain launches.
fn no_pdl(value: Option<&std::ffi::OsStr>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

impl Attention {
    /// Forward attention on `device`; refuses GPUs below sm_80. Programmatic launches are
    /// on where the GPU has them, unless [`NO_PDL_ENV`] is set.
    pub fn new(device: Arc<Device>) -> Result<Attention> {
        device.require_sm80()?;
        Ok(Attention {
            device,
            cache: ModuleCache::new(),
            choice: PathChoice::Best,
            programmatic: !no_pdl(std::env::var_os(NO_PDL_ENV).as_deref()),
        })
    }

    /// The same, restricted to the paths `choice` allows.
    pub fn with_path(mut self, choice: PathChoice) -> Attention {
        self.choice = choice;
        self
    }

    pub fn path_choice(&self) -> PathChoice {
        self.choice
    }

    /// The same, with programmatic launches (Hopper's programmatic dependent launch: a
    /// decode step's combine launched behind its split kernel, its blocks resident before
    /// that kernel ends) on or off. Off, every kernel is launched plainly, as on GPUs
    /// before Hopper: the combine is the one those GPUs run, which this makes testable on
    /// Hopper, and it is an escape hatch for tools or drivers that mishandle the
    /// launch attribute. A few microseconds slower per decode step.
    pub fn with_programmatic_launches(mut self, on: bool) -> Attention {
        self.programmatic = on;
        self
    }

    /// Whether kernels that can be launched programmatically are, on a GPU that has it.
    pub fn programmatic_launches(&self) -> bool {
        self.programmatic
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The kernels loaded so far: (id, arch, registers, local-memory bytes).
    pub fn loaded_kernels(&self) -> Vec<(String, (i32, i32), i32, i32)> {
        self.cache.loaded()
    }

    /// The forward configuration `problem` runs with on this device (before the sm90
    /// path's fallback for views TMA cannot describe, and unless the call is shaped like a
    /// decode step, see [`Attention::forward`]). A packed batch at a padded head dim takes
    /// the padded sm90 kernels too, which store its O by direct stores that skip the
    /// columns past the head dim.
    pub fn plan(&self, problem: &FwdProblem) -> Result<FwdConfig> {
        let arch = self.device.compute_capability();
        let sms = self.device.sm_count();
        plan_problem(arch, sms, self.choice, problem).map_err(|why| {
            let (major, minor) = arch;
            Error::UnsupportedGpu {
                name: format!("{} ({why})", self.device.name()),
                major,
                minor,
            }
        })
    }

    /// Generates and loads the kernel for `cfg` now (otherwise the first call does it).
    pub fn prepare(&self, cfg: &FwdConfig) -> Result<Arc<LoadedKernel>> {
        let arch = self.device.compute_capability();
        self.cache
            .get_or_load(self.device.context(), cfg.id_static(), arch, || {
                let ptx = cfg.generate()?.to_ptx();
                Ok((ptx, cfg.tiling().smem_bytes))
            })
    }

    /// Generates and loads the kernel `id` (made by `generate`, launched with
    /// `dynamic_smem` bytes) once per device; later calls look it up.
    pub(crate) fn load(
        &self,
        id: &str,
        dynamic_smem: u32,
        generate: impl FnOnce() -> std::result::Result<crate::ptx::Module, crate::ptx::PtxError>,
    ) -> Result<Arc<LoadedKernel>> {
        self.load_with(id, dynamic_smem, Carveout::Driver, generate)
    }

    /// [`Attention::load`] with a shared-memory [`Carveout`] preference.
    pub(crate) fn load_with(
        &self,
        id: &str,
        dynamic_smem: u32,
        carveout: Carveout,
        generate: impl FnOnce() -> std::result::Result<crate::ptx::Module, crate::ptx::PtxError>,
    ) -> Result<Arc<LoadedKernel>> {
        let arch = self.device.compute_capability();
        self.cache
            .get_or_load_with(self.device.context(), id, arch, carveout, || {
                Ok((generate()?.to_ptx(), dynamic_smem))
            })
    }

    /// `o = softmax(q kᵀ · scale) v` over views of device memory, on `stream` (null for the
    /// context's default stream). Writes `lse` (natural log, float32 `[B, H, Sq]`) when given.
    /// Every argument is checked first: on error nothing is launched and nothing written.
    /// The call is asynchronous.
    ///
    /// On Hopper the sm90 path runs when the views can be described to TMA (strides
    /// below 2^40 bytes, which validation's 16-byte rule leaves as the only limit); a
    /// view that cannot be runs on the sm80 path instead.
    ///
    /// A call shaped like a decode step (at most 16 queries per sequence against at least
    /// [`FORWARD_DECODE_MIN_KEYS`](super::decode::FORWARD_DECODE_MIN_KEYS) keys, or
    /// [`FORWARD_DECODE_MIN_KEYS_GQA`](super::decode::FORWARD_DECODE_MIN_KEYS_GQA) where
    /// the batch has many KV heads each serving 4 query heads or more, with the best path
    /// chosen) runs on the split-KV decode kernels, GQA packed, as
    /// [`Attention::decode`] against a cache every sequence of which is full: the same
    /// mask, output and LSE, 1.4–4.6x faster there than the forward kernels (H100). Its
    /// partial results take memory from the stream-ordered allocator for the call; where
    /// none can be had, or the decode kernels refuse the views, the forward kernels run.
    ///
    /// # Safety
    ///
    /// The views' pointers must be device memory of this device's context, valid for the
    /// extents their shapes and strides describe until the kernel has run, with nothing
    /// else writing `q`, `k`, `v` or reading/writing `o` and `lse` meanwhile; `stream`
    /// must be null or a live stream of this context. (Validation checks what can be
    /// checked from the numbers: null, alignment, extents, overlaps; not liveness.)
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_fwd(q, k, v, o, lse, params)?;
        // SAFETY: this function's contract, passed on unchanged; `problem` validates these views.
        let by_decode =
            unsafe { self.forward_by_decode(&problem, [q, k, v, o], lse, params, stream) };
        if let Some(ran) = by_decode {
            return ran;
        }
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.run(&problem, [q, k, v, o], lse, stream) }
    }

    /// Dispatches a validated problem and launches it.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]; `problem` must come from validating these views.
    pub(crate) unsafe fn run(
        &self,
        problem: &FwdProblem,
        [q, k, v, o]: [&TensorView; 4],
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Result<()> {
        let problem = *problem;
        let cfg = self.plan(&problem)?;
        // The driver encodes tensor maps only where a context is current.
        let _scope = ContextScope::enter(self.device.context())?;
        let cfg = match cfg.path {
            Path::Sm90 => match sm90_maps(&cfg, [q, k, v, o], problem.packed.is_some()) {
                Ok(operands) => {
                    // SAFETY: this function's contract, passed on unchanged.
                    return unsafe { self.launch_sm90(&problem, &cfg, operands, o, lse, stream) };
                }
                Err(e) if e.is_map_refusal() => {
                    // The sm80 plan of the same problem: its window and soft cap kept, as
                    // `FwdArgs` carries the soft-capped scaling either way.
                    let (arch, sms) = (self.device.compute_capability(), self.device.sm_count());
                    plan_problem(arch, sms, PathChoice::Sm80, &problem)
                        .map_err(Error::InvalidArgument)?
                }
                Err(e) => return Err(e),
            },
            Path::Sm80 => cfg,
        };
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.launch_forward(&problem, &cfg, [q, k, v, o], lse, stream) }
    }

    /// [`Attention::forward`] with the kernel configuration chosen by the caller instead of
    /// the dispatch (to test or time one configuration). `cfg` must be one of the catalog's,
    /// for this problem's dtype, head dim and causality, on a path this GPU runs.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward_with_config(
        &self,
        cfg: &FwdConfig,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_fwd(q, k, v, o, lse, params)?;
        let planned = self.plan(&problem)?;
        let (arch, sms) = (self.device.compute_capability(), self.device.sm_count());
        let head_dim = problem.shape.head_dim as u32;
        // The problem's dtype and masking, and the kernel head dim (padded or not) the
        // dispatch gives it on the configuration's path.
        let shape = dispatch_shape(&problem);
        let kernel_head_dim = match cfg.path {
            Path::Sm80 => dispatch_sm80(arch, sms, problem.dtype, &shape, problem.causal)
                .ok()
                .map(|c| (c.head_dim, c.padded)),
            Path::Sm90 => sm90::padded_head_dim(shape.head_dim),
        };
        let same = (cfg.dtype, cfg.causal, cfg.window, cfg.softcap)
            == (
                planned.dtype,
                planned.causal,
                planned.window,
                planned.softcap,
            )
            && kernel_head_dim == Some((cfg.head_dim, cfg.padded));
        let runs = match cfg.path {
            Path::Sm80 => {
                [BLOCK_M_WIDE, BLOCK_M_NARROW].contains(&cfg.block_m)
                    && !cfg.split_keys
                    && !cfg.fold_scale
                    && !cfg.narrow_keys
            }
            Path::Sm90 => {
                path_for_arch(arch) == Ok(Path::Sm90)
                    && sm90_has_kernel(&problem.shape, cfg.block_m)
                    && (!cfg.split_keys || sm90::has_split(head_dim, cfg.block_m))
                    && (!cfg.narrow_keys
                        || sm90::has_narrow_keys(cfg.head_dim, cfg.block_m, cfg.split_keys))
                    && (!cfg.fold_scale
                        || (!cfg.split_keys
                            && (cfg.softcap
                                || scale_folds(cfg.dtype, cfg.head_dim, problem.scale))))
                    && (!cfg.softcap || (cfg.fold_scale && !cfg.split_keys && cfg.block_m <= 128))
            }
        };
        if !same || !runs {
            return Err(Error::InvalidArgument(format!(
                "kernel {} does not fit this problem on this GPU (the dispatch would pick {})",
                cfg.id(),
                planned.id()
            )));
        }
        if cfg.path == Path::Sm90 {
            // The driver encodes tensor maps only where a context is current.
            let _scope = ContextScope::enter(self.device.context())?;
            let operands = sm90_maps(cfg, [q, k, v, o], problem.packed.is_some())?;
            // SAFETY: this function's contract, passed on unchanged.
            return unsafe { self.launch_sm90(&problem, cfg, operands, o, lse, stream) };
        }
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.launch_forward(&problem, cfg, [q, k, v, o], lse, stream) }
    }

    /// Launches `cfg` on a validated problem.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]; `problem` must come from `validate_fwd` on these views.
    pub(crate) unsafe fn launch_forward(
        &self,
        problem: &FwdProblem,
        cfg: &FwdConfig,
        [q, k, v, o]: [&TensorView; 4],
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Result<()> {
        let kernel = self.prepare(cfg)?;
        let mut args = fwd_args(problem, cfg, [q, k, v, o], lse);
        let dims = sm80_grid(problem, cfg);
        // A padded kernel's second parameter: the tensors' head dim (below the kernel's).
        let mut head_dim = head_dim_param(problem.shape.head_dim)?;
        let args_ptr = (&mut args as *mut FwdArgs).cast::<c_void>();
        let mut params = PaddedParams::new([args_ptr], cfg.padded.then_some(&mut head_dim));
        // SAFETY: the kernel's parameters are the by-value `FwdArgs` block, which `args` is,
        // and in a padded kernel the `u32` head dim, which `head_dim` is; both outlive the
        // call. validate_fwd checked every pointer is non-null and aligned and that the
        // kernel's accesses stay inside the views' extents (a padded kernel reads and writes
        // no column past the head dim); this function's contract makes those extents live
        // memory of this context and `stream` a stream of it.
        unsafe { launch(&kernel, &dims, stream, params.list()) }
    }

    /// Launches an sm90 configuration with its tensor maps of Q, K and V.
    ///
    /// # Safety
    ///
    /// As for [`Attention::launch_forward`]; `operands` must describe this problem's Q, K,
    /// V (and O, where there is a map of O), as [`sm90_maps`] makes them for `cfg`.
    pub(crate) unsafe fn launch_sm90(
        &self,
        problem: &FwdProblem,
        cfg: &FwdConfig,
        operands: Sm90Operands,
        o: &TensorView,
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Result<()> {
        let kernel = self.prepare(cfg)?;
        // Q, K and V reach the kernel through the maps; the block carries O and sizes.
        let none = TensorView { ptr: 0, ..*o };
        let mut args = fwd_args(problem, cfg, [&none, &none, &none, o], lse);
        // SAFETY: the maps cover exactly the validated extents of Q, K and V (their boxes'
        // out-of-bounds parts are zero-filled by the hardware, never read), `args` is the
        // kernel's `FwdArgs` block, and the kernel writes only O's and the LSE's validated
        // extents; this function's contract makes them live memory of this context and
        // `stream` a stream of it.
        unsafe {
            self.launch_scheduled(
                &kernel,
                &problem.shape,
                cfg.tiling(),
                cfg.causal,
                &mut args,
                operands,
                stream,
            )
        }
    }

    /// Launches an sm90a forward (`kernel`, whose parameters are `args`, the four tensor
    /// maps (the three inputs', and O's where it has one, see [`sm90_output_map`]) and a
    /// padded kernel's head dim, see [`Sm90Operands`]) with the
    /// launch shape and the `base` block of the [`sm90_schedule`] of `shape`:
    /// when the schedule takes a tile counter, a zeroed 4-byte one from the stream-ordered
    /// allocator, freed behind the launch. Where that allocator cannot give one (a device
    /// without memory pools, or no memory left), every work item runs in a block of its
    /// own, which needs no counter.
    ///
    /// # Safety
    ///
    /// As for [`launch_with_maps`]: `args` and `operands` must be what `kernel` expects, every
    /// address they hold live memory the kernel may use as its contract says, and `stream`
    /// null or a live stream of this device's context.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch_scheduled<A: AsMut<FwdArgs>>(
        &self,
        kernel: &LoadedKernel,
        shape: &AttnShape,
        tiling: Tiling,
        causal: bool,
        args: &mut A,
        operands: Sm90Operands,
        stream: CUstream,
    ) -> Result<()> {
        let schedule = sm90_schedule(shape, tiling.block_m, causal, self.device.sm_count());
        let (schedule, counter) = match schedule.counter {
            false => (schedule, None),
            true => match self.zeroed_counter(stream)? {
                Some(ptr) => (schedule, Some(ptr)),
                None => {
                    let items = work_items(shape, tiling.block_m);
                    (Sm90Schedule::one_block_per_item(items), None)
                }
            },
        };
        let base = args.as_mut();
        base.tile_counter = counter.unwrap_or(0);
        base.tail_heads = schedule.tail_heads;
        base.o_by_tma = operands.output.is_some() as u32;
        base.set_divisors();
        let dims = LaunchDims {
            grid: (schedule.blocks, 1, 1),
            block: (tiling.threads, 1, 1),
            dynamic_smem: tiling.smem_bytes,
        };
        // SAFETY: the caller vouches for `args`, `operands` and `stream`; the counter (if
        // any) is 4 live bytes of this context, zeroed before the launch on the same stream.
        let launched = unsafe { launch_with_maps(kernel, &dims, stream, args, operands) };
        if let Some(ptr) = counter {
            self.free_behind_launch(ptr, stream);
        }
        launched
    }

    /// A zeroed `u32` from the stream-ordered allocator, ordered on `stream` (null or a
    /// live stream of this device's context), or `None` where it cannot be had.
    fn zeroed_counter(&self, stream: CUstream) -> Result<Option<u64>> {
        let Ok(ptr) = self.alloc_async(4, stream) else {
            return Ok(None);
        };
        let _scope = ContextScope::enter(self.device.context())?;
        // SAFETY: `ptr` is 4 bytes from cuMemAllocAsync in this context, ordered on
        // `stream` (null or live, by this function's contract) before the memset.
        let zeroed = check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(ptr, 0, 1, stream)
        });
        match zeroed {
            Ok(()) => Ok(Some(ptr)),
            Err(_) => self.free_async(ptr, stream).map(|()| None),
        }
    }

    /// `bytes` of device memory from the stream-ordered allocator, ordered on `stream`
    /// (null or a live stream of this device's context).
    pub(crate) fn alloc_async(&self, bytes: usize, stream: CUstream) -> Result<u64> {
        let _scope = ContextScope::enter(self.device.context())?;
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is current; `stream` is null
        // or live (this function's contract).
        check("cuMemAllocAsync", unsafe {
            sys::cuMemAllocAsync(&mut ptr, bytes, stream)
        })?;
        Ok(ptr)
    }

    /// [`Attention::free_async`] behind a kernel already queued on `stream`, whose output
    /// is being written: a refused free is not the call's error (an error must mean
    /// nothing was written). It leaks the memory; the broken context it signals fails the
    /// next call.
    pub(crate) fn free_behind_launch(&self, ptr: u64, stream: CUstream) {
        let _ = self.free_async(ptr, stream);
    }

    /// Returns memory from [`Attention::alloc_async`] once `stream` has run past this point.
    pub(crate) fn free_async(&self, ptr: u64, stream: CUstream) -> Result<()> {
        let _scope = ContextScope::enter(self.device.context())?;
        // SAFETY: `ptr` came from cuMemAllocAsync in this context and is freed once.
        check("cuMemFreeAsync", unsafe {
            sys::cuMemFreeAsync(ptr, stream)
        })
    }
}

/// Launches a kernel whose parameters are a by-value argument block followed by four
/// by-value tensor maps and, in a padded kernel, its head dim (the sm90a forward
/// kernels).
///
/// # Safety
///
/// `args` must be the argument block `kernel` expects and `operands` its maps (and head
/// dim), and every address they hold must be live memory of the kernel's context that
/// the kernel may read or write as its contract says; `stream` is null or a stream of
/// that context.
unsafe fn launch_with_maps<A>(
    kernel: &LoadedKernel,
    dims: &LaunchDims,
    stream: CUstream,
    args: &mut A,
    operands: Sm90Operands,
) -> Result<()> {
    let [mut mq, mut mk, mut mv] = operands.inputs;
    let mut mo = operands.output.unwrap_or(TensorMap::unused());
    let mut head_dim = operands.head_dim;
    let map = |m: &mut TensorMap| (m as *mut TensorMap).cast::<c_void>();
    let values = [
        (args as *mut A).cast(),
        map(&mut mq),
        map(&mut mk),
        map(&mut mv),
        map(&mut mo),
    ];
    let mut params = PaddedParams::new(values, head_dim.as_mut());
    // SAFETY: the parameters are the by-value argument block, four by-value 128-byte
    // tensor maps and (padded) the `u32` head dim, which these point at and which outlive
    // the call; the caller vouches for their contents and the stream.
    unsafe { launch(kernel, dims, stream, params.list()) }
}

/// How an sm90a forward launch hands out its work items (the kernels' `for_each_item`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sm90Schedule {
    pub blocks: u32,
    /// The blocks take their next item from a zeroed counter, whichever block frees up
    /// first; otherwise each steps by the grid size.
    pub counter: bool,
    /// [`FwdArgs::tail_heads`].
    pub tail_heads: u32,
}

impl Sm90Schedule {
    /// Every item its own block, in item order: the hardware hands the next one to
    /// whichever SM frees up first.
    pub(crate) fn one_block_per_item(items: usize) -> Sm90Schedule {
        Sm90Schedule {
            blocks: items as u32,
            counter: false,
            tail_heads: 0,
        }
    }
}

/// The schedule of an sm90a forward launch.
///
/// Equal items (no mask) run on one block per SM (or per item, when there are fewer),
/// each stepping by the grid size, the next item's Q load overlapping this one's epilogue.
/// Causal items differ in cost (a query tile sees keys up to its diagonal): with more
/// items than SMs, one block per SM takes them from a counter, heaviest first, and the
/// last heads are spread query tile by query tile so that the grid ends on the lightest
/// items of all. A fixed stride balances them badly (B1 H16 S16384 D128 causal: 452
/// TFLOP/s, against 684 with one block per item).
pub(crate) fn sm90_schedule(
    shape: &AttnShape,
    block_m: u32,
    causal: bool,
    sm_count: u32,
) -> Sm90Schedule {
    let items = work_items(shape, block_m);
    let sms = sm_count.max(1) as usize;
    if !causal || items <= sms {
        return Sm90Schedule {
            blocks: items.min(sms) as u32,
            counter: false,
            tail_heads: 0,
        };
    }
    let q_blocks = shape.seqlen_q.div_ceil(block_m as usize);
    let head_batches = shape.heads_q * shape.batch;
    // The tail spans two waves of items: enough that the last items to start are light.
    let tail_heads = (2 * sms).div_ceil(q_blocks).min(head_batches);
    Sm90Schedule {
        blocks: sms as u32,
        counter: true,
        tail_heads: tail_heads as u32,
    }
}

/// The argument block of a validated problem.
fn fwd_args(
    problem: &FwdProblem,
    cfg: &FwdConfig,
    [q, k, v, o]: [&TensorView; 4],
    lse: Option<&LseView>,
) -> FwdArgs {
    let shape = problem.shape;
    // Packed batches: the kernels read each sequence's rows from the offsets and clamp
    // them to the tensors' row counts.
    let (rows_q, rows_k, lse_stride, cu_q, cu_k) = match problem.packed {
        None => (
            shape.seqlen_q,
            shape.seqlen_k,
            [
                (shape.heads_q * shape.seqlen_q) as u64,
                shape.seqlen_q as u64,
            ],
            0,
            0,
        ),
        Some(p) => (
            p.total_q,
            p.total_k,
            [0, p.total_q as u64],
            p.cu_seqlens_q,
            p.cu_seqlens_k,
        ),
    };
    let scaling = ScoreScaling::new(problem.scale, problem.softcap);
    FwdArgs {
        q: q.ptr,
        k: k.ptr,
        v: v.ptr,
        o: o.ptr,
        lse: lse.map_or(0, |l| l.ptr),
        q_stride: strides(q),
        k_stride: strides(k),
        v_stride: strides(v),
        o_stride: strides(o),
        seqlen_q: rows_q as u32,
        seqlen_k: rows_k as u32,
        heads_q: shape.heads_q as u32,
        group: shape.group() as u32,
        scale_log2: scaling.scale_log2,
        scale: scaling.scale,
        softcap_pre: scaling.softcap_pre,
        pad: 0,
        q_blocks: shape.seqlen_q.div_ceil(cfg.tiling().block_m as usize) as u32,
        batch: shape.batch as u32,
        cu_seqlens_q: cu_q,
        cu_seqlens_k: cu_k,
        lse_stride,
        tile_counter: 0,
        tail_heads: 0,
        o_by_tma: 0,
        window_left: problem.window.map_or(WINDOW_UNBOUNDED, |w| w.left),
        window_right: problem.window.map_or(0, |w| w.right),
        seqused_k: problem.seqused_k.unwrap_or(0),
        block_table: problem.pages.map_or(0, |p| p.block_table),
        table_stride: problem.pages.map_or(0, |p| p.table_stride),
        page_shift: problem.pages.map_or(0, |p| p.page_shift),
        max_pages: problem.pages.map_or(0, |p| p.max_pages),
        min_queries: match problem.packed.map(|p| p.runs) {
            Some(Runs::Long(n)) => n as u32,
            _ => 0,
        },
        // The sm90 launch sets the divisors once the schedule is known.
        ..FwdArgs::default()
    }
}

/// The sm80 path's launch shape: one block per (query tile, head, batch). (The sm90a
/// path's comes from [`Attention::launch_scheduled`].)
fn sm80_grid(problem: &FwdProblem, cfg: &FwdConfig) -> LaunchDims {
    let shape = problem.shape;
    let tiling = cfg.tiling();
    let q_blocks = shape.seqlen_q.div_ceil(tiling.block_m as usize);
    LaunchDims {
        grid: (q_blocks as u32, shape.heads_q as u32, shape.batch as u32),
        block: (tiling.threads, 1, 1),
        dynamic_smem: tiling.smem_bytes,
    }
}

/// (batch, sequence, head) strides in elements.
fn strides(t: &TensorView) -> [u64; 3] {
    [
        t.strides[0] as u64,
        t.strides[1] as u64,
        t.strides[2] as u64,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::draw::Draw;
    use crate::kernels::attention::all_fwd_configs;

    #[test]
    fn plain_launches_are_asked_for_by_any_value_but_zero() {
        use std::ffi::OsStr;
        assert!(!no_pdl(None));
        assert!(!no_pdl(Some(OsStr::new(""))));
        assert!(!no_pdl(Some(OsStr::new("0"))));
        assert!(no_pdl(Some(OsStr::new("1"))));
        assert!(no_pdl(Some(OsStr::new("yes"))));
    }

    /// Random q, k, v, o and LSE ([`Draw`]: shapes from edge values to 2^63, strides
    /// contiguous in either order or drawn, pointers null, misaligned or at the end of the
    /// address space, every dtype, odd softmax scales): validation answers each with a
    /// problem or an error, never a panic, and every problem it accepts plans, on each
    /// architecture and path choice, onto a listed kernel at or above its head dim, or
    /// gets a refusal.
    #[test]
    fn validation_and_plans_of_random_inputs_never_panic() {
        let listed = all_fwd_configs();
        let mut r = Draw::new(0xA77E_4710);
        let (mut accepted, mut planned) = (0, 0);
        for i in 0..20_000 {
            r.start(i % 2 == 0);
            let (b, hkv, d) = (r.size(), r.size(), r.head_dim());
            let hq = if r.chance(0.8) {
                hkv.saturating_mul(r.pick(&[1, 4, 8]))
            } else {
                r.size()
            };
            let (sq, sk) = (r.size(), r.size());
            let dtype = r.dtype();
            let view = |r: &mut Draw, shape| {
                if r.chance(0.9) {
                    r.view(dtype, shape)
                } else {
                    r.any_view(shape)
                }
            };
            let q = view(&mut r, [b, sq, hq, d]);
            let k = view(&mut r, [b, sk, hkv, d]);
            let v = view(&mut r, [b, sk, hkv, d]);
            let o = view(&mut r, [b, sq, hq, d]);
            let lse = r.chance(0.5).then(|| LseView { ptr: r.ptr() });
            let params = AttentionParams {
                softmax_scale: r.softmax_scale(),
                causal: r.chance(0.5),
                ..Default::default()
            };
            let arch = r.pick(&[(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)]);
            let sms = r.pick(&[1, 108, 132]);
            let choice = r.pick(&[PathChoice::Best, PathChoice::Sm80]);
            let run = std::panic::catch_unwind(|| {
                let Ok(problem) = validate_fwd(&q, &k, &v, &o, lse.as_ref(), &params) else {
                    return (0, 0);
                };
                let Ok(cfg) = plan_problem(arch, sms, choice, &problem) else {
                    return (1, 0);
                };
                assert!(listed.contains(&cfg), "{}", cfg.id());
                let kd = cfg.head_dim as usize;
                assert!(kd >= d && cfg.padded == (kd != d), "{}", cfg.id());
                (1, 1)
            });
            match run {
                Ok((a, p)) => {
                    accepted += a;
                    planned += p;
                }
                Err(_) => panic!(
                    "draw {i}: q {q:?}\nk {k:?}\nv {v:?}\no {o:?}\nlse {lse:?} {params:?} \
                     sm_{}{} {sms} SMs {choice:?}",
                    arch.0, arch.1
                ),
            }
        }
        println!("accepted {accepted}, planned {planned}");
        assert!(accepted > 1000 && planned > 1000, "{accepted} {planned}");
    }

    #[test]
    fn gpus_below_sm80_get_no_path() {
        assert!(path_for_arch((7, 5)).is_err());
        let shape = AttnShape::square(1, 8, 512, 64);
        assert!(dispatch((7, 0), 40, HalfType::F16, &shape, false, 0.125).is_err());
        assert!(dispatch_sm80((7, 0), 40, HalfType::F16, &shape, false).is_err());
        for arch in [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)] {
            assert_eq!(path_for_arch(arch), Ok(Path::Sm80), "{arch:?}");
        }
        // sm_90a kernels run on sm_90 only.
        assert_eq!(path_for_arch((9, 0)), Ok(Path::Sm90));
    }

    #[test]
    fn hopper_takes_the_sm90_path_for_every_head_dim() {
        for d in [32, 64, 96, 128, 192, 256] {
            let shape = AttnShape::square(2, 16, 4096, d);
            let cfg = dispatch((9, 0), 132, HalfType::Bf16, &shape, true, 0.125).unwrap();
            let want = match sm90::HEAD_DIMS.contains(&(d as u32)) {
                true => (d as u32, false),
                false => (sm90::padded_head_dim(d).unwrap().0, true),
            };
            assert_eq!(sm90::padded_head_dim(d), Some(want), "d{d}");
            assert_eq!(cfg.path, Path::Sm90, "d{d}");
            assert_eq!((cfg.head_dim, cfg.padded), want, "d{d}");
            let forced = dispatch_sm80((9, 0), 132, HalfType::Bf16, &shape, true).unwrap();
            assert_eq!(
                (forced.path, forced.head_dim, forced.padded),
                (Path::Sm80, d as u32, false),
                "d{d}: the sm80 path stays selectable"
            );
            assert_eq!(
                dispatch((8, 9), 58, HalfType::Bf16, &shape, true, 0.125)
                    .unwrap()
                    .path,
                Path::Sm80
            );
        }
    }

    /// The public dispatch takes hand-built shapes too: a head dim of 2^32 + 64 is not 64,
    /// and sizes whose work-item count overflows saturate (no panic, no sm90 kernel).
    #[test]
    fn hand_built_shapes_never_wrap() {
        let wide = AttnShape {
            head_dim: (1 << 32) + 64,
            ..AttnShape::square(1, 8, 512, 64)
        };
        for arch in [(9, 0), (8, 0)] {
            assert!(dispatch(arch, 132, HalfType::F16, &wide, false, 0.1).is_err());
            assert!(dispatch_sm80(arch, 132, HalfType::F16, &wide, false).is_err());
        }
        let huge = AttnShape {
            batch: usize::MAX / 2,
            heads_kv: 0,
            ..AttnShape::square(1, 8, 512, 128)
        };
        assert_eq!(huge.group(), 8);
        assert_eq!(work_items(&huge, 128), usize::MAX);
        let cfg = dispatch((9, 0), 132, HalfType::F16, &huge, false, 0.1).unwrap();
        assert_eq!(cfg.path, Path::Sm80);
    }

    /// Head dim 256 (and the head dims padded onto it) takes 64-key tiles on Hopper for
    /// short key ranges only: up to 512 keys, or 1024 with a causal mask, on the
    /// two-consumer kernel; never on the sm80 path or other head dims.
    #[test]
    fn head_dim_256_takes_64_key_tiles_for_short_key_ranges() {
        let narrow = |d: usize, s: usize, causal: bool| {
            let shape = AttnShape::square(32, 8, s, d);
            let cfg = dispatch((9, 0), 132, HalfType::F16, &shape, causal, 0.06).unwrap();
            assert_eq!((cfg.path, cfg.block_m), (Path::Sm90, 128), "d{d} s{s}");
            if cfg.narrow_keys {
                assert_eq!(sm90::Shape::of(&cfg).block_n, 64);
            }
            cfg.narrow_keys
        };
        for d in [256, 200] {
            assert!(narrow(d, 512, false) && narrow(d, 512, true), "d{d}");
            assert!(!narrow(d, 1024, false) && narrow(d, 1024, true), "d{d}");
            assert!(!narrow(d, 1025, true) && !narrow(d, 2048, true), "d{d}");
        }
        for d in [64, 128, 192] {
            assert!(!narrow(d, 512, true), "d{d}");
        }
        // A grid of 64-row tiles (one wave), and the sm80 path on sm_89.
        let small = AttnShape::square(1, 8, 512, 256);
        let cfg = dispatch((9, 0), 132, HalfType::F16, &small, true, 0.06).unwrap();
        assert_eq!((cfg.block_m, cfg.narrow_keys), (64, false));
        let sm80 = dispatch(
            (8, 9),
            58,
            HalfType::F16,
            &AttnShape::square(32, 8, 512, 256),
            true,
            0.06,
        );
        assert!(!sm80.unwrap().narrow_keys);
    }

    /// The sm90 kernels fold the scale into the exponent wherever `s·scale·log2 e` cannot
    /// overflow: every usual scale, f16 up to ~1e26, never bf16 beyond `ln 2`; the
    /// split-keys kernels and the sm80 path never.
    #[test]
    fn the_scale_folds_where_it_cannot_overflow() {
        let shape = AttnShape::square(4, 32, 4096, 128);
        let fold = |dtype, scale| {
            let cfg = dispatch((9, 0), 132, dtype, &shape, false, scale).unwrap();
            assert_eq!(cfg.path, Path::Sm90);
            cfg.fold_scale
        };
        for dtype in [HalfType::F16, HalfType::Bf16] {
            assert!(fold(dtype, 1.0 / 128f32.sqrt()));
            assert!(fold(dtype, 0.69));
            assert!(!fold(dtype, 1e30));
        }
        assert!(fold(HalfType::F16, 1.0) && fold(HalfType::F16, 1e20));
        assert!(!fold(HalfType::Bf16, 0.7) && !fold(HalfType::Bf16, 1.0));
        // 2·128·65504²·c must stay below f32::MAX.
        let edge = f32::MAX as f64 / (2.0 * 128.0 * 65504f64 * 65504f64) / std::f64::consts::LOG2_E;
        assert!(fold(HalfType::F16, (edge * 0.999) as f32));
        assert!(!fold(HalfType::F16, (edge * 1.001) as f32));
        // A split-keys pick (64-row tiles, D64, 2048 keys) and the sm80 path stay unfolded.
        let split = AttnShape::square(1, 2, 2048, 64);
        let cfg = dispatch((9, 0), 132, HalfType::F16, &split, false, 0.125).unwrap();
        assert!(cfg.split_keys && !cfg.fold_scale);
        let cfg = dispatch((8, 9), 58, HalfType::F16, &shape, false, 0.125).unwrap();
        assert!(cfg.path == Path::Sm80 && !cfg.fold_scale);
    }

    #[test]
    fn work_items_beyond_31_bits_take_the_sm80_path() {
        // 256 query tiles x 65535 heads x 65535 batches.
        let shape = AttnShape::square(65535, 65535, 256 * 128, 128);
        let cfg = dispatch((9, 0), 132, HalfType::F16, &shape, false, 0.125).unwrap();
        assert_eq!(cfg.path, Path::Sm80);
        let small = AttnShape::square(4, 16, 4096, 128);
        let cfg = dispatch((9, 0), 132, HalfType::F16, &small, false, 0.125).unwrap();
        assert_eq!(cfg.path, Path::Sm90);
    }

    #[test]
    fn dispatch_covers_exactly_the_catalog() {
        let catalog = crate::kernels::attention::all_fwd_configs();
        let mut chosen = std::collections::HashSet::new();
        for dtype in [HalfType::F16, HalfType::Bf16] {
            for d in 1..=512 {
                for causal in [false, true] {
                    // Four wide grids, and small ones (two heads) that take 64-row tiles.
                    let shapes = [(4, 32), (1, 2)].into_iter().flat_map(|(b, h)| {
                        [1, 512, 1024, 4096, 8192].map(|s| AttnShape::square(b, h, s, d))
                    });
                    for shape in shapes {
                        // A usual scale folds; 1e30 folds for neither dtype.
                        let picks = [
                            dispatch((9, 0), 132, dtype, &shape, causal, 0.125),
                            dispatch((9, 0), 132, dtype, &shape, causal, 1e30),
                            dispatch_sm80((9, 0), 132, dtype, &shape, causal),
                        ];
                        for pick in picks {
                            match pick {
                                Ok(cfg) => {
                                    // With a key window, the plan takes the windowed kernel;
                                    // with a soft cap, the soft-capping one.
                                    let capped = [cfg.softcapped(), cfg.windowed().softcapped()];
                                    for cfg in [cfg, cfg.windowed()].into_iter().chain(capped) {
                                        assert!(
                                            catalog.contains(&cfg),
                                            "{cfg:?} not in the catalog"
                                        );
                                        chosen.insert(cfg);
                                    }
                                }
                                Err(_) => assert!(padded_head_dim(d).is_none()),
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(
            chosen.len(),
            catalog.len(),
            "some catalog kernels are never chosen"
        );
    }

    /// A multiple of 8 with no kernel of its own runs the next larger kernel, padded: an
    /// sm90 one on Hopper, an sm80 one elsewhere; anything else has no kernel.
    #[test]
    fn head_dims_without_a_kernel_run_padded() {
        for (arch, sms) in [((9, 0), 132), ((8, 0), 108), ((8, 9), 58)] {
            for (d, sm80_kernel, sm90_kernel) in [
                (8, 64, 64),
                (40, 64, 64),
                (72, 96, 128),
                (80, 96, 128),
                (112, 128, 128),
                (160, 192, 192),
                (200, 256, 256),
                (248, 256, 256),
            ] {
                for causal in [false, true] {
                    let shape = AttnShape::square(2, 16, 1024, d);
                    let cfg = dispatch(arch, sms, HalfType::F16, &shape, causal, 0.1).unwrap();
                    let want = match arch {
                        (9, 0) => (Path::Sm90, sm90_kernel),
                        _ => (Path::Sm80, sm80_kernel),
                    };
                    assert_eq!(
                        (cfg.path, cfg.head_dim, cfg.padded, cfg.causal),
                        (want.0, want.1, true, causal),
                        "{d} on {arch:?}"
                    );
                    assert!(cfg.id().contains("_padded"), "{}", cfg.id());
                    assert!(!cfg.split_keys && cfg.block_m != 192, "{}", cfg.id());
                    assert!(all_fwd_configs().contains(&cfg), "{}", cfg.id());
                    let sm80 = dispatch_sm80(arch, sms, HalfType::F16, &shape, causal).unwrap();
                    assert_eq!((sm80.head_dim, sm80.padded), (sm80_kernel, true), "{d}");
                }
            }
            for d in [64, 128, 192, 256] {
                let shape = AttnShape::square(2, 16, 1024, d);
                let cfg = dispatch(arch, sms, HalfType::F16, &shape, false, 0.1).unwrap();
                assert!(!cfg.padded && cfg.head_dim as usize == d, "{cfg:?}");
            }
            for d in [0, 4, 12, 100, 264, 512] {
                let shape = AttnShape::square(2, 16, 1024, d);
                assert!(
                    dispatch(arch, sms, HalfType::F16, &shape, false, 0.1).is_err(),
                    "{d}"
                );
            }
        }
    }

    /// A packed batch at a padded head dim takes the padded sm90 kernel on Hopper, as a
    /// dense one does (its direct stores check the columns); the sm80 path stays
    /// selectable.
    #[test]
    fn packed_batches_at_padded_head_dims_take_the_padded_sm90_kernel() {
        for d in [40, 80, 96, 160, 200] {
            let dense = FwdProblem {
                shape: AttnShape::square(4, 16, 1024, d),
                dtype: HalfType::F16,
                scale: 0.1,
                causal: true,
                window: None,
                packed: None,
                softcap: None,
                seqused_k: None,
                pages: None,
            };
            let packed = FwdProblem {
                packed: Some(crate::host::validate::Packed {
                    cu_seqlens_q: 0x1000,
                    cu_seqlens_k: 0x2000,
                    total_q: 4096,
                    total_k: 4096,
                    runs: Runs::All,
                }),
                ..dense
            };
            let sm90 = sm90::padded_head_dim(d).unwrap();
            for problem in [&dense, &packed] {
                let cfg = plan_problem((9, 0), 132, PathChoice::Best, problem).unwrap();
                assert_eq!((cfg.path, (cfg.head_dim, cfg.padded)), (Path::Sm90, sm90));
                let cfg = plan_problem((9, 0), 132, PathChoice::Sm80, problem).unwrap();
                let sm80 = padded_head_dim(d).unwrap();
                assert_eq!((cfg.path, (cfg.head_dim, cfg.padded)), (Path::Sm80, sm80));
            }
        }
    }

    #[test]
    fn small_grids_get_the_narrow_tile() {
        let pick = |b, h, s| {
            dispatch_sm80(
                (9, 0),
                132,
                HalfType::F16,
                &AttnShape::square(b, h, s, 64),
                false,
            )
        };
        assert_eq!(pick(2, 8, 512).unwrap().block_m, BLOCK_M_NARROW); // 64 wide blocks
        assert_eq!(pick(4, 32, 4096).unwrap().block_m, BLOCK_M_WIDE); // 4096 wide blocks
        assert_eq!(pick(1, 8, 1024).unwrap().block_m, BLOCK_M_NARROW); // 64 < 132
        assert_eq!(pick(1, 16, 2048).unwrap().block_m, BLOCK_M_WIDE); // 256
    }

    /// Hopper takes the one-consumer 64-row kernel exactly when its grid fits one wave of
    /// the SMs, and the two-consumer 128-row kernel otherwise.
    #[test]
    fn sm90_takes_narrow_tiles_while_they_fit_one_wave() {
        let pick = |b, h, s, d| {
            let shape = AttnShape::square(b, h, s, d);
            let cfg = dispatch((9, 0), 132, HalfType::Bf16, &shape, false, 0.125).unwrap();
            assert_eq!(cfg.path, Path::Sm90);
            assert_eq!(cfg.tiling().block_m, cfg.block_m);
            assert_eq!(cfg.tiling().threads, 128 + 2 * cfg.block_m);
            cfg.block_m
        };
        assert_eq!(pick(2, 8, 512, 64), 64); // 128 narrow items
        assert_eq!(pick(1, 16, 512, 128), 64); // 128
        assert_eq!(pick(1, 2, 4224, 256), 64); // 132
        assert_eq!(pick(1, 2, 4225, 256), sm90::BLOCK_M); // 134 narrow, 68 wide
        assert_eq!(pick(8, 32, 1024, 64), sm90::BLOCK_M);
        // On a smaller GPU the same problem is a larger grid.
        let shape = AttnShape::square(2, 8, 512, 64);
        assert_eq!(sm90_block_m(&shape, 128, false), 64);
        assert_eq!(sm90_block_m(&shape, 127, false), sm90::BLOCK_M);
    }

    /// A window or a soft cap shrinks a 192-row pick to 128-row tiles: where that doubles
    /// the work items past the sm90 kernels' 31-bit numbering, the call takes the sm80
    /// path instead.
    #[test]
    fn shrunk_tiles_stay_within_the_work_item_numbering() {
        use crate::host::tensor::KeyWindow;
        let problem = |heads: usize, window, softcap| FwdProblem {
            shape: AttnShape {
                batch: 32768,
                seqlen_q: 150,
                seqlen_k: 8192,
                heads_q: heads,
                heads_kv: 1,
                head_dim: 64,
            },
            dtype: HalfType::F16,
            scale: 0.125,
            causal: true,
            window,
            packed: None,
            softcap,
            seqused_k: None,
            pages: None,
        };
        let window = Some(KeyWindow {
            left: 100,
            right: 0,
        });
        // 2^30 (batch, head) pairs: one 192-row tile each, two 128-row ones.
        let plain = plan_problem((9, 0), 132, PathChoice::Best, &problem(32768, None, None));
        assert_eq!(plain.map(|c| (c.path, c.block_m)), Ok((Path::Sm90, 192)));
        for (window, softcap) in [(window, None), (None, Some(30.0)), (window, Some(30.0))] {
            let cfg = plan_problem(
                (9, 0),
                132,
                PathChoice::Best,
                &problem(32768, window, softcap),
            )
            .unwrap();
            assert_eq!(cfg.path, Path::Sm80, "{window:?} {softcap:?}");
            assert_eq!(
                (cfg.window, cfg.softcap),
                (window.is_some(), softcap.is_some())
            );
            // Half the pairs: the sm90 path's 128-row tiles again.
            let half = plan_problem(
                (9, 0),
                132,
                PathChoice::Best,
                &problem(16384, window, softcap),
            );
            assert_eq!(half.map(|c| (c.path, c.block_m)), Ok((Path::Sm90, 128)));
        }
    }

    /// A packed batch is judged by its mean keys per sequence: 32 sequences of 100 keys
    /// (3200 rows of K) do not take the 192-row tile, 4 of 3000 do.
    #[test]
    fn packed_batches_dispatch_by_their_keys_per_sequence() {
        use super::super::validate::Packed;
        let problem = |seqs: usize, keys: usize| FwdProblem {
            shape: AttnShape {
                batch: seqs,
                seqlen_q: 4096,
                seqlen_k: seqs * keys,
                heads_q: 32,
                heads_kv: 8,
                head_dim: 64,
            },
            dtype: HalfType::F16,
            scale: 0.125,
            causal: false,
            window: None,
            packed: Some(Packed {
                cu_seqlens_q: 0x1000,
                cu_seqlens_k: 0x2000,
                total_q: 4096,
                total_k: seqs * keys,
                runs: Runs::All,
            }),
            softcap: None,
            seqused_k: None,
            pages: None,
        };
        let pick = |p: &FwdProblem| {
            let shape = dispatch_shape(p);
            dispatch((9, 0), 132, p.dtype, &shape, p.causal, 0.125)
                .unwrap()
                .block_m
        };
        let short = problem(32, 100);
        assert_eq!(dispatch_shape(&short).seqlen_k, 100);
        assert_eq!(pick(&short), sm90::BLOCK_M);
        assert_eq!(pick(&problem(4, 3000)), 192);
        let dense = FwdProblem {
            packed: None,
            ..short
        };
        assert_eq!(dispatch_shape(&dense), dense.shape);
    }

    /// The sm90 kernel the dispatch picks on an H200 for `[batch, heads, Sq, Sk, head
    /// dim]`, its tiling checked against its configuration: a producer warpgroup and
    /// one consumer warpgroup per 64 rows, or two on a split-keys tile.
    fn sm90_pick([b, h, sq, sk, d]: [usize; 5], causal: bool) -> FwdConfig {
        let shape = AttnShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
            heads_q: h,
            heads_kv: h,
            head_dim: d,
        };
        let cfg = dispatch((9, 0), 132, HalfType::F16, &shape, causal, 0.125).unwrap();
        assert_eq!(cfg.path, Path::Sm90);
        let t = cfg.tiling();
        assert_eq!(t.block_m, cfg.block_m);
        let consumers = if cfg.split_keys { 2 } else { cfg.block_m / 64 };
        assert_eq!(t.threads, 128 * (1 + consumers));
        cfg
    }

    /// Head dim 64 takes three consumer warpgroups from 2048 keys without a mask (8192
    /// with a causal one) and a full wave of 192-row tiles; other head dims and shorter
    /// key ranges keep two.
    #[test]
    fn sm90_takes_three_consumers_at_d64_on_long_unmasked_keys() {
        let pick = |b, h, sq, sk, d, causal| sm90_pick([b, h, sq, sk, d], causal).block_m;
        assert_eq!(pick(4, 32, 4096, 4096, 64, false), 192);
        assert_eq!(pick(1, 32, 16384, 16384, 64, false), 192);
        assert_eq!(pick(8, 32, 512, 2048, 64, false), 192); // 3 x 256 items
        assert_eq!(pick(4, 32, 4096, 4096, 64, true), sm90::BLOCK_M);
        assert_eq!(pick(2, 32, 8192, 8192, 64, true), 192);
        assert_eq!(pick(1, 32, 16384, 16384, 64, true), 192);
        assert_eq!(pick(2, 32, 8192, 8191, 64, true), sm90::BLOCK_M);
        assert_eq!(pick(4, 32, 4096, 2047, 64, false), sm90::BLOCK_M);
        assert_eq!(pick(4, 16, 4096, 4096, 128, false), sm90::BLOCK_M);
        // 22 x 6 = 132 items of 192 rows fill a wave; 131 do not.
        assert_eq!(pick(1, 6, 4224, 4224, 64, false), 192);
        assert_eq!(pick(1, 6, 4032, 4224, 64, false), sm90::BLOCK_M);
    }

    /// The 64-row grids at head dim 64 take the split-keys kernel from
    /// [`SPLIT_MIN_KEYS`] keys, causal or not; other head dims and shorter key ranges keep
    /// the one-consumer kernel, and wide grids never split.
    #[test]
    fn sm90_splits_keys_of_small_d64_grids_with_long_key_ranges() {
        let pick = |b, h, sq, sk, d, causal| {
            let cfg = sm90_pick([b, h, sq, sk, d], causal);
            (cfg.block_m, cfg.split_keys)
        };
        for causal in [false, true] {
            assert_eq!(pick(1, 2, 4096, 4096, 64, causal), (64, true));
            assert_eq!(pick(1, 8, 1024, 1024, 64, causal), (64, true));
            assert_eq!(pick(1, 8, 1024, 1023, 64, causal), (64, false));
            assert_eq!(pick(2, 8, 512, 512, 64, causal), (64, false)); // the reference shape
            assert_eq!(pick(1, 2, 4096, 4096, 128, causal), (64, false));
            assert_eq!(pick(1, 2, 4096, 4096, 256, causal), (64, false));
            assert_eq!(pick(8, 32, 1024, 1024, 64, causal), (sm90::BLOCK_M, false));
        }
    }

    #[test]
    fn sm90_causal_grids_take_items_from_a_counter_beyond_one_wave() {
        let schedule = |b, h, s, causal| {
            let shape = AttnShape::square(b, h, s, 128);
            let cfg = dispatch((9, 0), 132, HalfType::F16, &shape, causal, 0.125).unwrap();
            assert_eq!(cfg.path, Path::Sm90);
            let sched = sm90_schedule(&shape, cfg.tiling().block_m, causal, 132);
            (sched.blocks, sched.counter, sched.tail_heads)
        };
        // 16 query tiles of 128 rows x 16 heads x 8 batches = 2048 work items: a fixed
        // stride without a mask; causal, a counter, and the last ceil(264 / 16) = 17
        // head-batches spread tile by tile.
        assert_eq!(schedule(8, 16, 2048, false), (132, false, 0));
        assert_eq!(schedule(8, 16, 2048, true), (132, true, 17));
        // 128 query tiles a head: the tail is 3 heads; never more heads than there are.
        assert_eq!(schedule(1, 16, 16384, true), (132, true, 3));
        assert_eq!(schedule(1, 2, 16384, true), (132, true, 2));
        // At most one wave of items: one block each, no counter, either way (here 64-row
        // tiles: 5 of them x 2 heads).
        assert_eq!(schedule(1, 2, 300, false), (10, false, 0));
        assert_eq!(schedule(1, 2, 300, true), (10, false, 0));
        assert_eq!(schedule(1, 4, 4224, true), (132, false, 0));
        assert_eq!(schedule(1, 4, 4225, true), (132, true, 4));
    }
}
