//! FP8 (E4M3) forward attention with per-block scales: operands, checks, dispatch and
//! launch. The data contract (layouts, scale semantics) is
//! [`crate::kernels::attention::fp8`]'s.
//!
//! Hopper runs the sm90a kernel (TMA + wgmma e4m3); Ada and later GPUs, Hopper when the
//! caller asks for the fallback ([`PathChoice::Sm80`]), and Hopper calls whose views TMA
//! cannot describe (a stride of 2^40 bytes or more) run the sm89 one (`mma.sync` e4m3).
//! GPUs below sm_89 have no FP8 tensor cores: a typed error.

use std::ffi::c_void;

use cudarc::driver::sys::CUstream;

use super::attention::{Attention, PathChoice, kernel_head_dim, work_items};
use super::device::ContextScope;
use super::launch::{LaunchDims, launch};
use super::tensor::{AttentionParams, DType, LseView, TensorView};
use super::validate::{
    LSE_ALIGN, TENSOR_ALIGN, byte_range_of, check_heads_and_sizes, check_no_self_overlap,
    check_not_empty, check_pointer, check_scale, check_strides, head_dim_in, lse_byte_range,
    overlaps,
};
use crate::error::{Error, Result};
use crate::kernels::attention::fp8::{
    Fp8Args, Fp8Config, Fp8Path, HEAD_DIMS, scale_blocks, vt_min_pitch, vt_min_pitch_checked,
};
use crate::kernels::attention::{FwdArgs, HalfType, sm90, sm90_fp8};
use crate::ptx::SmemLayout;
use crate::shape::AttnShape;
use crate::tma::{TensorMap, TiledMap, TmaType};

/// [`HEAD_DIMS`] as the text [`Error::UnsupportedHeadDim`] carries.
pub const FP8_HEAD_DIMS_TEXT: &str = "64, 128, 256";

/// `Vᵀ8`: e4m3 `[B, Hkv, D, pitch]`, keys contiguous and permuted in groups of 16 (see
/// [`crate::kernels::attention::fp8`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VtView {
    /// Device address of `vt[0, 0, 0, 0]`, 16-byte aligned.
    pub ptr: u64,
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Keys (Sk): the row's first `seqlen` positions' keys are real.
    pub seqlen: usize,
    /// (batch, head, row) strides in elements (bytes); the row stride is the pitch, a
    /// multiple of 16 and at least `seqlen` rounded up to 16.
    pub strides: [usize; 3],
}

impl VtView {
    /// A contiguous `[B, H, D, pitch]` tensor with the smallest pitch for `seqlen` keys.
    /// Sizes too large to address saturate (as [`TensorView::bshd`]'s do), so that
    /// validation refuses the view rather than this constructor wrapping.
    pub fn contiguous(
        ptr: u64,
        batch: usize,
        heads: usize,
        head_dim: usize,
        seqlen: usize,
    ) -> Self {
        let pitch = vt_min_pitch_checked(seqlen).unwrap_or(usize::MAX);
        let row = head_dim.saturating_mul(pitch);
        VtView {
            ptr,
            batch,
            heads,
            head_dim,
            seqlen,
            strides: [heads.saturating_mul(row), row, pitch],
        }
    }

    pub fn pitch(&self) -> usize {
        self.strides[2]
    }

    /// The bytes `[B, H, D, pitch]` spans, or `None` on overflow.
    pub fn byte_range(&self) -> Option<(u64, u64)> {
        let last = [self.batch, self.heads, self.head_dim]
            .iter()
            .zip(&self.strides)
            .try_fold(0usize, |acc, (&n, &st)| {
                acc.checked_add(n.checked_sub(1)?.checked_mul(st)?)
            })?;
        let bytes = last.checked_add(self.pitch())?;
        Some((self.ptr, self.ptr.checked_add(bytes as u64)?))
    }
}

/// The FP8 inputs of one forward call: codes and per-block scales (device pointers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Operands {
    /// e4m3 `[B, Sq, Hq, D]` ([`DType::E4m3`]).
    pub q: TensorView,
    /// e4m3 `[B, Sk, Hkv, D]`.
    pub k: TensorView,
    pub vt: VtView,
    /// f32 `[B, Hq, ceil(Sq/128)]`, contiguous.
    pub q_scale: u64,
    /// f32 `[B, Hkv, ceil(Sk/128)]`, contiguous.
    pub k_scale: u64,
    /// f32 `[B, Hkv, ceil(Sk/128)]`, contiguous.
    pub v_scale: u64,
    /// f32 `[B, Hq, Sq]` added (times the softmax scale) to each row's LSE, e.g. the
    /// quantizer's `q · mean_k` with K smoothing; `None` adds nothing.
    pub lse_shift: Option<u64>,
}

/// A validated FP8 problem.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Problem {
    pub shape: AttnShape,
    pub out: HalfType,
    pub scale: f32,
    pub causal: bool,
}

/// Checks an FP8 forward call; the order follows [`super::validate`]'s: dtypes, empty
/// dimensions, shapes, head dim, head ratio, sizes, softmax scale, pointers, strides and
/// extents, then that the outputs overlap nothing.
pub fn validate_fp8(
    ops: &Fp8Operands,
    o: &TensorView,
    lse: Option<&LseView>,
    params: &AttentionParams,
) -> Result<Fp8Problem> {
    let (q, k, vt) = (&ops.q, &ops.k, &ops.vt);
    for (name, t) in [("q", q), ("k", k)] {
        if t.dtype != DType::E4m3 {
            return Err(Error::UnsupportedDType(format!(
                "{name} is {}; the FP8 path takes e4m3 codes",
                t.dtype
            )));
        }
    }
    let out = o.dtype.half_type().ok_or_else(|| {
        Error::UnsupportedDType(format!("o is {}; the FP8 path writes f16 or bf16", o.dtype))
    })?;
    for (name, t) in [("q", q), ("k", k), ("o", o)] {
        check_not_empty(name, t)?;
    }
    if o.shape != q.shape {
        return Err(Error::ShapeMismatch(format!(
            "o has shape {:?} but q has {:?}; they must be equal",
            o.shape, q.shape
        )));
    }
    let (batch, seqlen_q, heads_q, head_dim) = (q.batch(), q.seqlen(), q.heads(), q.head_dim());
    let (seqlen_k, heads_kv) = (k.seqlen(), k.heads());
    if k.batch() != batch || k.head_dim() != head_dim {
        return Err(Error::ShapeMismatch(format!(
            "k has shape {:?}, q {:?}: batch and head_dim must agree",
            k.shape, q.shape
        )));
    }
    let vt_shape = [vt.batch, vt.heads, vt.head_dim, vt.seqlen];
    if vt_shape != [batch, heads_kv, head_dim, seqlen_k] {
        return Err(Error::ShapeMismatch(format!(
            "vt is [B, Hkv, D, Sk] = {vt_shape:?}; k implies {:?}",
            [batch, heads_kv, head_dim, seqlen_k]
        )));
    }
    if !head_dim_in(&HEAD_DIMS, head_dim) {
        return Err(Error::UnsupportedHeadDim(head_dim, FP8_HEAD_DIMS_TEXT));
    }
    check_heads_and_sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_k)?;
    check_scale(params)?;

    for (name, ptr) in [("q", q.ptr), ("k", k.ptr), ("vt", vt.ptr), ("o", o.ptr)] {
        check_pointer(name, ptr, TENSOR_ALIGN)?;
    }
    let scales = [
        ("q_scale", ops.q_scale),
        ("k_scale", ops.k_scale),
        ("v_scale", ops.v_scale),
    ];
    for (name, ptr) in scales {
        check_pointer(name, ptr, 4)?;
    }
    if let Some(p) = ops.lse_shift {
        check_pointer("lse_shift", p, 4)?;
    }
    if let Some(l) = lse {
        check_pointer("lse", l.ptr, LSE_ALIGN)?;
    }

    for (name, t) in [("q", q), ("k", k), ("o", o)] {
        check_strides(name, t)?;
    }
    let pitch = vt.pitch();
    if (pitch as u64) < vt_min_pitch(seqlen_k as u64) || !pitch.is_multiple_of(16) {
        return Err(Error::BadStrides {
            tensor: "vt",
            reason: format!(
                "pitch {pitch} must be a multiple of 16 and at least {}",
                vt_min_pitch(seqlen_k as u64)
            ),
        });
    }
    for (dim, n, st) in [
        ("batch", batch, vt.strides[0]),
        ("head", heads_kv, vt.strides[1]),
    ] {
        if n > 1 && !st.is_multiple_of(16) {
            return Err(Error::BadStrides {
                tensor: "vt",
                reason: format!("{dim} stride {st} is not a multiple of 16 bytes"),
            });
        }
    }
    let vt_range = vt.byte_range().ok_or_else(|| Error::BadStrides {
        tensor: "vt",
        reason: "overflows 64-bit addressing".into(),
    })?;
    let f32_range = |name: &'static str, ptr: u64, n: usize| -> Result<(u64, u64)> {
        n.checked_mul(4)
            .and_then(|b| ptr.checked_add(b as u64))
            .map(|end| (ptr, end))
            .ok_or_else(|| Error::BadStrides {
                tensor: name,
                reason: "overflows 64-bit addressing".into(),
            })
    };
    let q_blocks = scale_blocks(seqlen_q as u32) as usize;
    let kv_blocks = scale_blocks(seqlen_k as u32) as usize;
    // The kernels index the scales in 32 bits (`(b·H + h)·blocks + block`); batches
    // broadcast by a zero stride can pass every extent check and still wrap it.
    for (name, heads, blocks) in [
        ("q_scale", heads_q, q_blocks),
        ("k_scale", heads_kv, kv_blocks),
    ] {
        if batch
            .checked_mul(heads)
            .and_then(|n| n.checked_mul(blocks))
            .is_none_or(|n| n > u32::MAX as usize)
        {
            return Err(Error::InvalidArgument(format!(
                "{name} would hold {batch}·{heads}·{blocks} per-block scales; the FP8 kernels \
                 index fewer than 2^32"
            )));
        }
    }
    let mut inputs = vec![
        ("q", byte_range_of("q", q)?),
        ("k", byte_range_of("k", k)?),
        ("vt", vt_range),
        (
            "q_scale",
            f32_range("q_scale", ops.q_scale, batch * heads_q * q_blocks)?,
        ),
        (
            "k_scale",
            f32_range("k_scale", ops.k_scale, batch * heads_kv * kv_blocks)?,
        ),
        (
            "v_scale",
            f32_range("v_scale", ops.v_scale, batch * heads_kv * kv_blocks)?,
        ),
    ];
    if let Some(p) = ops.lse_shift {
        let n = batch * heads_q * seqlen_q;
        inputs.push(("lse_shift", f32_range("lse_shift", p, n)?));
    }
    let o_range = byte_range_of("o", o)?;
    check_no_self_overlap("o", o)?;
    let lse_range = match lse {
        Some(l) => Some(lse_byte_range(l, batch, heads_q, seqlen_q)?),
        None => None,
    };
    for (name, r) in &inputs {
        for (out, range) in [("o", Some(o_range)), ("lse", lse_range)] {
            if let Some(range) = range
                && overlaps(range, *r)
            {
                return Err(Error::InvalidArgument(format!(
                    "{out}'s memory [{:#x}, {:#x}) overlaps {name}'s [{:#x}, {:#x})",
                    range.0, range.1, r.0, r.1
                )));
            }
        }
    }
    if let Some(lr) = lse_range
        && overlaps(lr, o_range)
    {
        return Err(Error::InvalidArgument("lse overlaps o".into()));
    }
    let masking = fp8_masking(params, seqlen_q, seqlen_k)?;
    Ok(Fp8Problem {
        shape: AttnShape {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
        },
        out,
        scale: params.scale_for(head_dim),
        causal: masking.causal,
    })
}

/// The FP8 kernel family of a GPU: sm90a on Hopper (unless the caller chose the
/// fallback), sm89 on Ada and later; none below sm_89.
pub fn fp8_path_for(arch: (i32, i32), choice: PathChoice) -> Result<Fp8Path, String> {
    match arch {
        (9, 0) if choice == PathChoice::Best => Ok(Fp8Path::Sm90),
        (major, minor) if (major, minor) >= (8, 9) => Ok(Fp8Path::Sm89),
        (major, minor) => Err(format!(
            "sm_{major}{minor} has no FP8 tensor cores (FP8 needs sm_89 or later)"
        )),
    }
}

/// The FP8 configuration of `problem` on a GPU of architecture `arch`: the family
/// [`fp8_path_for`] gives, except that problems the sm90a kernel cannot take (a head dim
/// it has no kernel for, work items beyond the 31 bits its persistent loop counts in) run
/// on the sm89 kernel.
pub fn dispatch_fp8(
    arch: (i32, i32),
    choice: PathChoice,
    problem: &Fp8Problem,
) -> Result<Fp8Config, String> {
    let head_dim = kernel_head_dim(&problem.shape)?;
    // `validate_fp8` refuses these first; a problem built by hand might not have been.
    if !HEAD_DIMS.contains(&head_dim) {
        return Err(format!(
            "no FP8 kernel for head dim {head_dim} (FP8 takes {FP8_HEAD_DIMS_TEXT})"
        ));
    }
    let path = match fp8_path_for(arch, choice)? {
        Fp8Path::Sm90
            if !sm90_fp8::HEAD_DIMS.contains(&head_dim)
                || work_items(&problem.shape, sm90_fp8::BLOCK_M) >= 1 << 31 =>
        {
            Fp8Path::Sm89
        }
        p => p,
    };
    Ok(Fp8Config {
        path,
        out: problem.out,
        head_dim,
        causal: problem.causal,
    })
}

/// The argument block of a validated problem (pointers of Q8 and K8 included; the sm90
/// kernel reads them through tensor maps instead).
pub(crate) fn fp8_args(
    problem: &Fp8Problem,
    cfg: &Fp8Config,
    ops: &Fp8Operands,
    o: &TensorView,
    lse: Option<&LseView>,
) -> Fp8Args {
    let shape = problem.shape;
    let st = |t: &TensorView| {
        [
            t.strides[0] as u64,
            t.strides[1] as u64,
            t.strides[2] as u64,
        ]
    };
    let base = FwdArgs {
        q: ops.q.ptr,
        k: ops.k.ptr,
        v: 0,
        o: o.ptr,
        lse: lse.map_or(0, |l| l.ptr),
        q_stride: st(&ops.q),
        k_stride: st(&ops.k),
        v_stride: [0; 3],
        o_stride: st(o),
        seqlen_q: shape.seqlen_q as u32,
        seqlen_k: shape.seqlen_k as u32,
        heads_q: shape.heads_q as u32,
        group: shape.group() as u32,
        scale_log2: problem.scale * std::f32::consts::LOG2_E,
        scale: problem.scale,
        softcap_pre: 0.0,
        pad: 0,
        q_blocks: shape.seqlen_q.div_ceil(cfg.tiling().block_m as usize) as u32,
        batch: shape.batch as u32,
        cu_seqlens_q: 0,
        cu_seqlens_k: 0,
        lse_stride: [
            (shape.heads_q * shape.seqlen_q) as u64,
            shape.seqlen_q as u64,
        ],
        tile_counter: 0,
        tail_heads: 0,
        o_by_tma: 0,
        window_left: 0,
        window_right: 0,
        seqused_k: 0,
        block_table: 0,
        table_stride: 0,
        page_shift: 0,
        max_pages: 0,
        min_queries: 0,
        // The sm90 launch sets the divisors once the schedule is known.
        ..FwdArgs::default()
    };
    Fp8Args {
        base,
        vt: ops.vt.ptr,
        vt_stride: ops.vt.strides.map(|s| s as u64),
        q_scale: ops.q_scale,
        k_scale: ops.k_scale,
        v_scale: ops.v_scale,
        lse_shift: ops.lse_shift.unwrap_or(0),
        q_scale_blocks: scale_blocks(shape.seqlen_q as u32),
        kv_scale_blocks: scale_blocks(shape.seqlen_k as u32),
    }
}

impl Attention {
    /// The FP8 configuration `problem` runs with on this device.
    pub fn plan_fp8(&self, problem: &Fp8Problem) -> Result<Fp8Config> {
        let head_dim = problem.shape.head_dim;
        if !head_dim_in(&HEAD_DIMS, head_dim) {
            return Err(Error::UnsupportedHeadDim(head_dim, FP8_HEAD_DIMS_TEXT));
        }
        let arch = self.device().compute_capability();
        dispatch_fp8(arch, self.path_choice(), problem).map_err(|why| Error::UnsupportedGpu {
            name: format!("{} ({why})", self.device().name()),
            major: arch.0,
            minor: arch.1,
        })
    }

    /// `o = softmax(q kᵀ · scale) v` from FP8 operands with per-block scales, on `stream`;
    /// writes `lse` (natural log, `[B, Hq, Sq]`) when given. Checked first: on error
    /// nothing is launched or written. Asynchronous. Besides the tensor rules, each scale
    /// array must hold fewer than 2^32 scales (`B·H·ceil(S / 128)`, which the kernels index
    /// in 32 bits; only batches broadcast by zero strides reach it):
    /// [`Error::InvalidArgument`] otherwise.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]: every pointer in `ops`, `o` and `lse` is device
    /// memory of this device's context, live for the extents described until the kernel
    /// has run, and nothing else writes the inputs or touches the outputs meanwhile.
    pub unsafe fn forward_fp8(
        &self,
        ops: &Fp8Operands,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_fp8(ops, o, lse, params)?;
        let cfg = self.plan_fp8(&problem)?;
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.launch_fp8(&problem, &cfg, ops, o, lse, stream) }
    }

    /// Launches `cfg` on a validated problem.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward_fp8`]; `problem` must come from validating these views.
    pub(crate) unsafe fn launch_fp8(
        &self,
        problem: &Fp8Problem,
        cfg: &Fp8Config,
        ops: &Fp8Operands,
        o: &TensorView,
        lse: Option<&LseView>,
        stream: CUstream,
    ) -> Result<()> {
        // The sm90a kernel reads Q8, K8 and Vᵀ8 through tensor maps; a view TMA cannot
        // describe runs on the sm89 kernel instead, as the 16-bit forward falls back to
        // its sm80 one. The driver encodes tensor maps only where a context is current.
        let _scope = ContextScope::enter(self.device().context())?;
        let (cfg, maps) = match cfg.path {
            Fp8Path::Sm90 => match sm90_maps_or_fallback(cfg, ops)? {
                Some(maps) => (*cfg, Some(maps)),
                None => (sm89_fallback(cfg), None),
            },
            Fp8Path::Sm89 => (*cfg, None),
        };
        let cfg = &cfg;
        let tiling = cfg.tiling();
        let kernel = self.load(cfg.id_static(), tiling.smem_bytes, || cfg.generate())?;
        let mut args = fp8_args(problem, cfg, ops, o, lse);
        let shape = problem.shape;
        match maps {
            None => {
                let dims = LaunchDims {
                    grid: (
                        shape.seqlen_q.div_ceil(tiling.block_m as usize) as u32,
                        shape.heads_q as u32,
                        shape.batch as u32,
                    ),
                    block: (tiling.threads, 1, 1),
                    dynamic_smem: tiling.smem_bytes,
                };
                let mut params = [(&mut args as *mut Fp8Args).cast::<c_void>()];
                // SAFETY: the kernel's one parameter is the by-value `Fp8Args` block, which
                // `args` is and which outlives the call; validate_fp8 checked every pointer
                // and extent, and this function's contract makes them live memory of this
                // context and `stream` a stream of it.
                unsafe { launch(&kernel, &dims, stream, &mut params) }
            }
            Some(maps) => {
                let operands = super::attention::Sm90Operands {
                    inputs: maps,
                    output: super::attention::sm90_output_map(o, false, sm90::MapColumns::Blocked)?,
                    head_dim: None,
                };
                // SAFETY: `args` is the kernel's `Fp8Args` block and `maps` cover exactly
                // the validated extents of Q8, K8 and Vᵀ8 (out-of-bounds box parts are
                // zero-filled by the hardware); the kernel writes only O's and the LSE's
                // validated extents; this function's contract makes them live memory of
                // this context and `stream` a stream of it.
                unsafe {
                    self.launch_scheduled(
                        &kernel, &shape, tiling, cfg.causal, &mut args, operands, stream,
                    )
                }
            }
        }
    }
}

/// The sm89 configuration that stands in for `cfg` (same output type, head dim and mask).
fn sm89_fallback(cfg: &Fp8Config) -> Fp8Config {
    Fp8Config {
        path: Fp8Path::Sm89,
        ..*cfg
    }
}

/// The sm90a kernel's tensor maps, or `None` where a view cannot be described to TMA (a
/// stride of 2^40 bytes or more, which validation's 16-byte rule leaves as the only
/// limit) or the driver refuses a map: the caller then runs the sm89 kernel. All three
/// maps are checked before any is encoded.
fn sm90_maps_or_fallback(cfg: &Fp8Config, ops: &Fp8Operands) -> Result<Option<[TensorMap; 3]>> {
    let specs = sm90_map_specs(cfg, ops);
    if specs.iter().any(|(map, ptr)| map.validate(*ptr).is_err()) {
        return Ok(None);
    }
    let [(q, q_ptr), (k, k_ptr), (vt, vt_ptr)] = specs;
    let encoded = || -> Result<[TensorMap; 3]> {
        Ok([q.encode(q_ptr)?, k.encode(k_ptr)?, vt.encode(vt_ptr)?])
    };
    match encoded() {
        Ok(maps) => Ok(Some(maps)),
        Err(e) if e.is_map_refusal() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The sm90a FP8 kernel's tensor maps, with the address each describes: Q8 and K8 as 5-D
/// `{inner, seq, d/inner, heads, batch}` views whose boxes land as `[d/inner][rows][inner]`
/// swizzled tiles (inner = the row's bytes up to 128), and Vᵀ8 as `{keys, d, heads,
/// batch}` with a box of one key tile by every head-dim row.
fn sm90_map_specs(cfg: &Fp8Config, ops: &Fp8Operands) -> [(TiledMap, u64); 3] {
    let shape = sm90_fp8::Shape::of(cfg);
    let rows_map = |t: &TensorView, layout: SmemLayout| {
        let bytes = |dim: usize| {
            if t.shape[dim] == 1 {
                16
            } else {
                t.strides[dim] as u64
            }
        };
        let inner = layout.block_cols() as u64;
        let d = t.shape[3] as u64;
        let dims = [
            inner,
            t.shape[1] as u64,
            d / inner,
            t.shape[2] as u64,
            t.shape[0] as u64,
        ];
        let strides = [bytes(1), inner, bytes(2), bytes(0)];
        let boxes = [inner as u32, layout.rows, (d / inner) as u32, 1, 1];
        let map = TiledMap::new(TmaType::U8, &dims, &strides, &boxes, layout.swizzle);
        (map, t.ptr)
    };
    let vt = &ops.vt;
    let vl = shape.vt_layout();
    let step = |n: usize, st: usize| if n == 1 { 16 } else { st as u64 };
    let dims = [
        vt_min_pitch(vt.seqlen as u64),
        vt.head_dim as u64,
        vt.heads as u64,
        vt.batch as u64,
    ];
    let strides = [
        vt.strides[2] as u64,
        step(vt.heads, vt.strides[1]),
        step(vt.batch, vt.strides[0]),
    ];
    let boxes = [vl.block_cols(), vl.rows, 1, 1];
    [
        rows_map(&ops.q, shape.q_layout()),
        rows_map(&ops.k, shape.k_layout()),
        (
            TiledMap::new(TmaType::U8, &dims, &strides, &boxes, vl.swizzle),
            vt.ptr,
        ),
    ]
}

/// The masking of an FP8 forward call with `params` on sequences of at most `max_q` queries
/// and `max_k` keys ([`AttentionParams::masking`]): the FP8 forward has no key window and no
/// soft cap, and refuses either with [`Error::InvalidArgument`].
pub(crate) fn fp8_masking(
    params: &AttentionParams,
    max_q: usize,
    max_k: usize,
) -> Result<crate::host::tensor::Masking> {
    let masking = params.masking(max_q, max_k)?;
    if params.softcap.is_some() {
        return Err(Error::InvalidArgument(
            "the FP8 forward has no soft-capping (softcap runs on f16 or bf16, or on an e4m3 \
             KV cache through decode)"
                .into(),
        ));
    }
    if masking.window.is_some() {
        return Err(Error::InvalidArgument(
            "the FP8 forward has no key window (sliding-window attention runs on f16 or \
             bf16, or on an e4m3 KV cache through decode)"
                .into(),
        ));
    }
    Ok(masking)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::decode::Workspace;
    use crate::host::draw::Draw;
    use crate::host::quantize::{QuantizeOptions, validate_quantize};
    use crate::kernels::attention::fp8::all_fp8_configs;

    /// Random FP8 operands and 16-bit inputs to quantize (see [`Draw`]; Vᵀ with drawn
    /// pitches and strides, scale pointers anywhere): validation answers each with a
    /// problem or an error, never a panic; each FP8 problem it accepts dispatches, on
    /// each architecture and path choice, to a listed kernel of its head dim, or gets a
    /// refusal.
    #[test]
    fn validation_of_random_fp8_inputs_never_panics() {
        let listed = all_fp8_configs();
        let mut r = Draw::new(0xE43E_E43E);
        let (mut accepted, mut dispatched, mut quantizable) = (0, 0, 0);
        for i in 0..20_000 {
            let tame = i % 2 == 0;
            r.start(tame);
            let (b, hkv, sq, sk) = (r.size(), r.size(), r.size(), r.size());
            let d = if tame {
                r.pick(&[64, 128, 256])
            } else {
                r.head_dim()
            };
            let hq = hkv.saturating_mul(r.pick(&[1, 4, 8]));
            let e4 = if tame || r.chance(0.9) {
                DType::E4m3
            } else {
                r.dtype()
            };
            let mut vt = VtView::contiguous(r.ptr(), b, hkv, d, sk);
            if !tame && r.chance(0.3) {
                vt.strides = [r.size(), r.size(), r.pick(&[0, 16, 17, sk, 1 << 40])];
            }
            let ops = Fp8Operands {
                q: r.view(e4, [b, sq, hq, d]),
                k: r.view(e4, [b, sk, hkv, d]),
                vt,
                q_scale: r.ptr(),
                k_scale: r.ptr(),
                v_scale: r.ptr(),
                lse_shift: r.chance(0.3).then(|| r.ptr()),
            };
            let out = if tame { DType::Bf16 } else { r.dtype() };
            let o = r.view(out, [b, sq, hq, d]);
            let lse = r.chance(0.5).then(|| LseView { ptr: r.ptr() });
            let params = AttentionParams {
                softmax_scale: r.softmax_scale(),
                causal: r.chance(0.5),
                ..Default::default()
            };
            let arch = r.pick(&[(8, 0), (8, 9), (9, 0), (10, 0)]);
            let choice = r.pick(&[PathChoice::Best, PathChoice::Sm80]);
            let dtype = r.dtype();
            let (q16, k16, v16) = (
                r.view(dtype, [b, sq, hq, d]),
                r.view(dtype, [b, sk, hkv, d]),
                r.view(dtype, [b, sk, hkv, d]),
            );
            let options = QuantizeOptions {
                smooth_k: r.chance(0.5),
                hadamard_seed: r.chance(0.5).then_some(7),
            };
            let workspace = Workspace {
                ptr: r.ptr(),
                bytes: r.pick(&[0, 1 << 20, 1 << 34, usize::MAX]),
            };
            let run = std::panic::catch_unwind(|| {
                let mut c = (0, 0, 0);
                if let Ok(p) = validate_fp8(&ops, &o, lse.as_ref(), &params) {
                    c.0 = 1;
                    if let Ok(cfg) = dispatch_fp8(arch, choice, &p) {
                        c.1 = 1;
                        assert!(listed.contains(&cfg), "{}", cfg.id());
                        assert_eq!(cfg.head_dim as usize, d);
                    }
                }
                if validate_quantize(&q16, &k16, &v16, &options, &workspace).is_ok() {
                    c.2 = 1;
                }
                c
            });
            match run {
                Ok(c) => {
                    accepted += c.0;
                    dispatched += c.1;
                    quantizable += c.2;
                }
                Err(_) => panic!(
                    "draw {i}: {ops:?}\no {o:?} lse {lse:?} {params:?} sm_{}{} {choice:?}\n\
                     q {q16:?}\nk {k16:?}\nv {v16:?}\n{options:?} {workspace:?}",
                    arch.0, arch.1
                ),
            }
        }
        println!("accepted {accepted}, dispatched {dispatched}, quantizable {quantizable}");
        assert!(
            accepted > 500 && dispatched > 500 && quantizable > 100,
            "{accepted} {dispatched} {quantizable}"
        );
    }

    fn problem(d: usize, batch: usize, heads: usize, seqlen: usize) -> Fp8Problem {
        Fp8Problem {
            shape: AttnShape::square(batch, heads, seqlen, d),
            out: HalfType::Bf16,
            scale: 0.1,
            causal: false,
        }
    }

    /// 2^32 + 64 is not 64: the head dim is compared without narrowing to u32.
    #[test]
    fn head_dims_past_u32_are_refused() {
        const HUGE_D: usize = (1 << 32) + 64;
        let tb = 1u64 << 40;
        let ops = Fp8Operands {
            q: TensorView::bshd(tb, DType::E4m3, 1, 1, 1, HUGE_D),
            k: TensorView::bshd(2 * tb, DType::E4m3, 1, 1, 1, HUGE_D),
            vt: VtView::contiguous(3 * tb, 1, 1, HUGE_D, 1),
            q_scale: 4 * tb,
            k_scale: 4 * tb + 256,
            v_scale: 4 * tb + 512,
            lse_shift: None,
        };
        let o = TensorView::bshd(5 * tb, DType::F16, 1, 1, 1, HUGE_D);
        assert!(matches!(
            validate_fp8(&ops, &o, None, &AttentionParams::default()),
            Err(Error::UnsupportedHeadDim(HUGE_D, _))
        ));
        // The public dispatch does not narrow it onto 64 either, nor plan head dims no
        // FP8 kernel has (80 would divide by zero in the sm89 generator) on any path.
        for arch in [(9, 0), (8, 9)] {
            for d in [HUGE_D, 32, 80, 96, 192] {
                for choice in [PathChoice::Best, PathChoice::Sm80] {
                    assert!(
                        dispatch_fp8(arch, choice, &problem(d, 1, 1, 1)).is_err(),
                        "{d}"
                    );
                }
            }
        }
        // Sizes past the address space saturate rather than wrap.
        let vt = VtView::contiguous(tb, 2, usize::MAX / 2, 128, 300);
        assert_eq!(vt.strides[0], usize::MAX);
        assert_eq!(vt.byte_range(), None);
    }

    /// A batch broadcast by zero strides passes every extent check; its scale count
    /// (`B·Hkv·⌈Sk/128⌉`) past 2^32 would wrap the kernels' 32-bit scale index, so it is
    /// refused. One block fewer is taken.
    #[test]
    fn scale_counts_past_u32_are_refused() {
        let tb = 1u64 << 44;
        let (seqlen_k, d) = (1usize << 25, 64);
        let call = |batch: usize| {
            let ops = Fp8Operands {
                q: TensorView::bshd(tb, DType::E4m3, batch, 1, 1, d),
                k: TensorView::strided(2 * tb, DType::E4m3, [batch, seqlen_k, 1, d], [0, d, d, 1]),
                vt: {
                    let mut vt = VtView::contiguous(3 * tb, batch, 1, d, seqlen_k);
                    vt.strides[0] = 0;
                    vt
                },
                q_scale: 4 * tb,
                k_scale: 5 * tb,
                v_scale: 6 * tb,
                lse_shift: None,
            };
            let o = TensorView::bshd(7 * tb, DType::F16, batch, 1, 1, d);
            validate_fp8(&ops, &o, None, &AttentionParams::default())
        };
        // 2^25 keys are 2^18 scale blocks: 2^14 batches reach exactly 2^32.
        assert!(call((1 << 14) - 1).is_ok());
        match call(1 << 14) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("k_scale"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn views_tma_cannot_describe_run_on_the_sm89_kernel() {
        let (b, h, s, d) = (2, 4, 300, 128);
        let e4 = |ptr| TensorView::bshd(ptr, DType::E4m3, b, s, h, d);
        let mut ops = Fp8Operands {
            q: e4(0x1000_0000),
            k: e4(0x2000_0000),
            vt: VtView::contiguous(0x3000_0000, b, h, d, s),
            q_scale: 0x4000_0000,
            k_scale: 0x4100_0000,
            v_scale: 0x4200_0000,
            lse_shift: None,
        };
        let cfg = dispatch_fp8((9, 0), PathChoice::Best, &problem(d, b, h, s)).unwrap();
        assert_eq!(cfg.path, Fp8Path::Sm90);
        // A batch stride of 2^40 bytes passes validation's 16-byte rule, but no tensor
        // map holds it: no maps, so the launch takes the sm89 kernel. 16 bytes less
        // passes the maps' own checks (the driver has the last word); the ordinary
        // stride gets maps (encoding them needs the driver, absent on CPU machines).
        ops.k.strides[0] = 1 << 40;
        assert!(matches!(sm90_maps_or_fallback(&cfg, &ops), Ok(None)));
        ops.k.strides[0] = (1 << 40) - 16;
        let specs = sm90_map_specs(&cfg, &ops);
        assert!(specs.iter().all(|(map, ptr)| map.validate(*ptr).is_ok()));
        ops.k.strides[0] = s * h * d;
        // Encoding needs a current context (without one the driver refuses every map):
        // device 0's where the machine has a GPU; a machine without a driver gets
        // NoDriver.
        let gpu = crate::host::device::device_count().unwrap_or(0) > 0;
        let device = gpu.then(|| crate::host::device::Device::new(0).expect("device 0"));
        if let Some(device) = &device {
            device
                .context()
                .bind_to_thread()
                .expect("a current context");
        }
        // (A driver without a device has no context to encode in.)
        if device.is_some() || !crate::host::device::driver_present() {
            match sm90_maps_or_fallback(&cfg, &ops) {
                Ok(Some(_)) | Err(Error::NoDriver) => {}
                other => panic!("a describable view gave {other:?}"),
            }
        }
        ops.vt.strides[1] = 1 << 40;
        assert!(matches!(sm90_maps_or_fallback(&cfg, &ops), Ok(None)));
        let fallback = sm89_fallback(&cfg);
        assert_eq!(fallback.path, Fp8Path::Sm89);
        assert_eq!(
            (fallback.out, fallback.head_dim, fallback.causal),
            (cfg.out, cfg.head_dim, cfg.causal)
        );
    }

    #[test]
    fn fp8_runs_on_sm89_and_later_and_hopper_takes_sm90a_where_it_can() {
        let best = PathChoice::Best;
        let p = problem(128, 4, 16, 4096);
        assert_eq!(dispatch_fp8((9, 0), best, &p).unwrap().path, Fp8Path::Sm90);
        assert_eq!(
            dispatch_fp8((9, 0), PathChoice::Sm80, &p).unwrap().path,
            Fp8Path::Sm89
        );
        for arch in [(8, 9), (10, 0), (12, 0)] {
            assert_eq!(dispatch_fp8(arch, best, &p).unwrap().path, Fp8Path::Sm89);
        }
        for arch in [(8, 0), (8, 6), (7, 5)] {
            assert!(dispatch_fp8(arch, best, &p).is_err(), "{arch:?}");
        }
        // Every FP8 head dim has an sm90a kernel; too many work items for its 31-bit
        // loop go to the sm89 one.
        for d in [64, 128, 256] {
            let p = problem(d, 4, 16, 4096);
            assert_eq!(dispatch_fp8((9, 0), best, &p).unwrap().path, Fp8Path::Sm90);
        }
        let huge = problem(128, 65535, 65535, 256 * 128);
        assert_eq!(
            dispatch_fp8((9, 0), best, &huge).unwrap().path,
            Fp8Path::Sm89
        );
    }
}
