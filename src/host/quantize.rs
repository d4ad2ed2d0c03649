//! FP8 quantization on the GPU: 16-bit Q, K and V to the [`Fp8Operands`] that
//! [`Attention::forward_fp8`] takes, written into one device workspace the caller
//! provides. The kernels are [`crate::kernels::quantize`]'s; their results are bit for
//! bit [`crate::quant`]'s. On Hopper, the Hadamard option rotates Q and K on the tensor
//! cores ([`crate::kernels::quantize_sm90`], where a view TMA can describe, which
//! validation leaves as every view but those with strides of 2^40 bytes and more): the
//! same values to f32 rounding, so a code can differ by one step.
//!
//! # Workspace ([`Fp8Layout`])
//!
//! One region after another, each starting on a [`Fp8Layout::ALIGN`]-byte boundary:
//!
//! | region           | contents                                                          |
//! |------------------|-------------------------------------------------------------------|
//! | `q`              | e4m3 `[B, Sq, Hq, D]`, contiguous                                 |
//! | `k`              | e4m3 `[B, Sk, Hkv, D]`, contiguous                                |
//! | `vt`             | e4m3 `[B, Hkv, D, pitch]`, pitch = Sk rounded up to 16            |
//! | `q_scale`        | f32 `[B, Hq, ceil(Sq/128)]`                                       |
//! | `k_scale`        | f32 `[B, Hkv, ceil(Sk/128)]`                                      |
//! | `v_scale`        | f32 `[B, Hkv, ceil(Sk/128)]`                                      |
//! | `k_mean`         | f32 `[B, Hkv, D]` (K smoothing only)                              |
//! | `k_mean_tickets` | u32 `[B, Hkv]`, the key mean's scratch (smoothing and Hadamard)   |
//! | `lse_shift`      | f32 `[B, Hq, Sq]` (K smoothing only)                              |
//! | `k_mean_rotated` | f32 `[B, Hkv, D]`, `k_mean` rotated (smoothing and Hadamard only) |
//!
//! # Launches
//!
//! Without K smoothing: Q, K, V, one kernel each (on Hopper with the Hadamard option,
//! Q's and K's are persistent: one wave of blocks). With it: the mean is zeroed
//! (`cuMemsetD32Async`, the tickets with it) and K's mean accumulated first (and, with the
//! Hadamard option, rotated into `k_mean_rotated` by the last block of each head to
//! finish, in the same kernel), then Q (which writes `lse_shift` from the unrotated
//! rows), K (minus the mean: subtracted before the butterflies, or its rotation after
//! the tensor cores'), V. All on the caller's stream, in that order, so a CUDA graph can
//! capture them.
//!
//! Scales are per block of 128 rows, the FP8 path's scheme. The CPU quantizer's
//! per-tensor granularity ([`crate::quant::Granularity::PerTensor`]) has no GPU kernel:
//! it would need a pass over each tensor for its amax before the quantizing one (two
//! thirds more memory traffic), for scales the FP8 kernels read the same way.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUstream};

use super::attention::{Attention, sm90_map};
use super::decode::Workspace;
use super::device::{ContextScope, check};
use super::fp8::{FP8_HEAD_DIMS_TEXT, Fp8Operands, VtView};
use super::launch::{LaunchDims, launch};
use super::tensor::{DType, TensorView};
use super::validate::{
    TENSOR_ALIGN, byte_range_of, check_heads_and_sizes, check_not_empty, check_pointer,
    check_strides, head_dim_in, overlaps,
};
use crate::error::{Error, Result};
use crate::kernels::attention::HalfType;
use crate::kernels::attention::fp8::{HEAD_DIMS, SCALE_BLOCK, scale_blocks, vt_min_pitch_checked};
use crate::kernels::quantize::{QuantArgs, QuantConfig, QuantKind, Smoothing};
use crate::kernels::quantize_sm90::RotateConfig;
use crate::quant::HadamardSigns;
use crate::shape::AttnShape;
use crate::tma::TensorMap;

/// The quantizer's options; each is off by default and leaves `softmax(Q Kᵀ) V`
/// unchanged (see [`crate::quant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuantizeOptions {
    /// Subtract K's per-channel mean over the sequence before quantizing K; the
    /// operands then carry `lse_shift` so the attention's log-sum-exp stays exact.
    pub smooth_k: bool,
    /// Rotate Q and K by a random-sign Hadamard transform along the head dim, the signs
    /// drawn from this seed ([`HadamardSigns::from_seed`]).
    pub hadamard_seed: Option<u64>,
}

/// A piece of the workspace: `bytes` bytes from `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub offset: usize,
    pub bytes: usize,
}

/// Where the quantizer's outputs go in its workspace (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Layout {
    pub q: Region,
    pub k: Region,
    pub vt: Region,
    pub q_scale: Region,
    pub k_scale: Region,
    pub v_scale: Region,
    /// K smoothing only.
    pub k_mean: Option<Region>,
    /// K smoothing with the Hadamard option only: one u32 per (batch, KV head), zeroed
    /// with `k_mean` (the kernel's tickets: which block rotates the finished mean).
    pub k_mean_tickets: Option<Region>,
    /// K smoothing only.
    pub lse_shift: Option<Region>,
    /// K smoothing with the Hadamard option only.
    pub k_mean_rotated: Option<Region>,
    /// Keys per row of `Vᵀ8` (Sk rounded up to 16).
    pub vt_pitch: usize,
    /// The workspace's size: the end of the last region.
    pub bytes: usize,
}

impl Fp8Layout {
    /// Alignment of every region (and of the workspace).
    pub const ALIGN: usize = 256;

    /// The layout for a problem's sizes. Errors: [`Error::InvalidArgument`] when the
    /// sizes overflow.
    pub fn new(shape: &AttnShape, options: &QuantizeOptions) -> Result<Fp8Layout> {
        let &AttnShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
        } = shape;
        let too_large = || {
            Error::InvalidArgument(format!(
                "the FP8 operands of {shape:?} overflow the address space"
            ))
        };
        let product = |dims: &[usize]| {
            dims.iter()
                .try_fold(1usize, |acc, &n| acc.checked_mul(n))
                .ok_or_else(too_large)
        };
        let vt_pitch = vt_min_pitch_checked(sk).ok_or_else(too_large)?;
        let mut end = 0usize;
        let mut take = |bytes: usize| -> Result<Region> {
            let offset = end
                .checked_next_multiple_of(Self::ALIGN)
                .ok_or_else(too_large)?;
            end = offset.checked_add(bytes).ok_or_else(too_large)?;
            Ok(Region { offset, bytes })
        };
        // In usize: a length past u32 must not wrap to a small scale region.
        let q_blocks = sq.div_ceil(SCALE_BLOCK as usize);
        let kv_blocks = sk.div_ceil(SCALE_BLOCK as usize);
        let q = take(product(&[b, sq, hq, d])?)?;
        let k = take(product(&[b, sk, hkv, d])?)?;
        let vt = take(product(&[b, hkv, d, vt_pitch])?)?;
        let q_scale = take(product(&[b, hq, q_blocks, 4])?)?;
        let k_scale = take(product(&[b, hkv, kv_blocks, 4])?)?;
        let v_scale = take(product(&[b, hkv, kv_blocks, 4])?)?;
        let both = options.smooth_k && options.hadamard_seed.is_some();
        // The tickets right after the mean: one memset zeroes both.
        let (k_mean, k_mean_tickets, lse_shift) = if options.smooth_k {
            let mean = take(product(&[b, hkv, d, 4])?)?;
            let tickets = if both {
                Some(take(product(&[b, hkv, 4])?)?)
            } else {
                None
            };
            (Some(mean), tickets, Some(take(product(&[b, hq, sq, 4])?)?))
        } else {
            (None, None, None)
        };
        let k_mean_rotated = if both {
            Some(take(product(&[b, hkv, d, 4])?)?)
        } else {
            None
        };
        Ok(Fp8Layout {
            q,
            k,
            vt,
            q_scale,
            k_scale,
            v_scale,
            k_mean,
            k_mean_tickets,
            lse_shift,
            k_mean_rotated,
            vt_pitch,
            bytes: end,
        })
    }

    /// What each call zeroes before the key mean's kernel: `k_mean`, and the tickets
    /// after it where there are any (the alignment gap between them too, which nothing
    /// else uses).
    pub fn zeroed_span(&self) -> Option<Region> {
        let mean = self.k_mean?;
        let end = self.k_mean_tickets.unwrap_or(mean);
        Some(Region {
            offset: mean.offset,
            bytes: end.offset + end.bytes - mean.offset,
        })
    }

    /// The operands this layout puts in a workspace at `base`.
    pub fn operands(&self, base: u64, shape: &AttnShape) -> Fp8Operands {
        // Saturating: an address past the end of the space fails validation's extent
        // checks with a typed error rather than wrapping to a valid-looking one.
        let at = |r: Region| base.saturating_add(r.offset as u64);
        let s = shape;
        Fp8Operands {
            q: TensorView::bshd(
                at(self.q),
                DType::E4m3,
                s.batch,
                s.seqlen_q,
                s.heads_q,
                s.head_dim,
            ),
            k: TensorView::bshd(
                at(self.k),
                DType::E4m3,
                s.batch,
                s.seqlen_k,
                s.heads_kv,
                s.head_dim,
            ),
            vt: VtView::contiguous(at(self.vt), s.batch, s.heads_kv, s.head_dim, s.seqlen_k),
            q_scale: at(self.q_scale),
            k_scale: at(self.k_scale),
            v_scale: at(self.v_scale),
            lse_shift: self.lse_shift.map(at),
        }
    }
}

/// A validated quantization call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizeProblem {
    pub shape: AttnShape,
    pub input: HalfType,
    pub options: QuantizeOptions,
    pub layout: Fp8Layout,
}

/// Checks a quantization call: dtypes, empty dimensions, shapes, head dim, head ratio,
/// sizes, pointers, strides and extents, then the workspace (non-null, aligned, large
/// enough, apart from the inputs). Nothing here touches the driver.
pub fn validate_quantize(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    options: &QuantizeOptions,
    workspace: &Workspace,
) -> Result<QuantizeProblem> {
    let problem = validate_quantize_inputs(q, k, v, options)?;
    let (shape, layout) = (problem.shape, problem.layout);
    check_pointer("workspace", workspace.ptr, Fp8Layout::ALIGN as u64)?;
    if workspace.bytes < layout.bytes {
        return Err(Error::InvalidArgument(format!(
            "the workspace has {} bytes; quantizing {shape:?} needs {} (Fp8Layout::new)",
            workspace.bytes, layout.bytes
        )));
    }
    let used = workspace
        .ptr
        .checked_add(layout.bytes as u64)
        .map(|end| (workspace.ptr, end))
        .ok_or_else(|| Error::BadStrides {
            tensor: "workspace",
            reason: "the workspace overflows 64-bit addressing".into(),
        })?;
    // validate_quantize_inputs checked that these ranges exist.
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        let r = byte_range_of(name, t)?;
        if overlaps(used, r) {
            return Err(Error::InvalidArgument(format!(
                "the workspace [{:#x}, {:#x}) overlaps {name}'s memory [{:#x}, {:#x})",
                used.0, used.1, r.0, r.1
            )));
        }
    }
    Ok(problem)
}

/// Checks the inputs of a quantization call: everything [`validate_quantize`] checks but
/// the workspace. The result's layout says how large a workspace the call needs.
pub fn validate_quantize_inputs(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    options: &QuantizeOptions,
) -> Result<QuantizeProblem> {
    let input = q.dtype.half_type().ok_or_else(|| {
        Error::UnsupportedDType(format!("q is {}; the quantizer reads f16 or bf16", q.dtype))
    })?;
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(Error::UnsupportedDType(format!(
            "q, k and v must share one dtype, got {}, {} and {}",
            q.dtype, k.dtype, v.dtype
        )));
    }
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_not_empty(name, t)?;
    }
    if v.shape != k.shape {
        return Err(Error::ShapeMismatch(format!(
            "v has shape {:?} but k has {:?}; they must be equal",
            v.shape, k.shape
        )));
    }
    let [batch, seqlen_q, heads_q, head_dim] = q.shape;
    let [_, seqlen_k, heads_kv, _] = k.shape;
    if k.batch() != batch || k.head_dim() != head_dim {
        return Err(Error::ShapeMismatch(format!(
            "k has shape {:?}, q {:?}: batch and head_dim must agree",
            k.shape, q.shape
        )));
    }
    if !head_dim_in(&HEAD_DIMS, head_dim) {
        return Err(Error::UnsupportedHeadDim(head_dim, FP8_HEAD_DIMS_TEXT));
    }
    check_heads_and_sizes(batch, heads_q, heads_kv, seqlen_q, seqlen_k)?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_pointer(name, t.ptr, TENSOR_ALIGN)?;
    }
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        check_strides(name, t)?;
    }
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        byte_range_of(name, t)?;
    }
    let shape = AttnShape {
        batch,
        seqlen_q,
        seqlen_k,
        heads_q,
        heads_kv,
        head_dim,
    };
    let layout = Fp8Layout::new(&shape, options)?;
    Ok(QuantizeProblem {
        shape,
        input,
        options: *options,
        layout,
    })
}

/// The (batch, seq, head) strides of a view, in elements.
fn strides3(t: &TensorView) -> [u64; 3] {
    [
        t.strides[0] as u64,
        t.strides[1] as u64,
        t.strides[2] as u64,
    ]
}

/// One kernel launch of a quantization call, ready to go.
struct Step {
    config: QuantConfig,
    args: QuantArgs,
    grid: (u32, u32, u32),
    /// A rows step that may run on the tensor cores instead (Hopper, the Hadamard option).
    rotate: Option<Rotated>,
}

/// The tensor-core form of a rows step.
#[derive(Debug, Clone, Copy)]
struct Rotated {
    config: RotateConfig,
    /// The input, which the kernel's tensor map describes.
    view: TensorView,
    /// The mean it reads in place of the plain step's: K's rotated mean for keys (the
    /// plain kernel subtracts the mean before rotating, this one after).
    mean: u64,
}

/// The kernel a step launches: its plain configuration, or on Hopper the rotated one
/// with the input's tensor map where TMA can describe the view.
enum Launch {
    Plain,
    Rotated(RotateConfig, TensorMap),
}

/// The launches of a validated call, in order (the mean's zeroing aside), with the
/// workspace at `base`.
fn plan_steps(
    p: &QuantizeProblem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    base: u64,
) -> Vec<Step> {
    let s = p.shape;
    let l = &p.layout;
    let at = |r: Region| base + r.offset as u64;
    let d = s.head_dim as u64;
    let signs = p
        .options
        .hadamard_seed
        .map(|seed| HadamardSigns::from_seed(seed, s.head_dim).words())
        .unwrap_or_default();
    let hadamard = p.options.hadamard_seed.is_some();
    let config = |kind| QuantConfig {
        kind,
        input: p.input,
        head_dim: s.head_dim as u32,
    };
    let mean = l.k_mean.map_or(0, at);
    let mean_rotated = l.k_mean_rotated.map_or(0, at);
    let kv_blocks = scale_blocks(s.seqlen_k as u32);
    let (smooth_q, smooth_k) = if p.options.smooth_k {
        (Smoothing::Query, Smoothing::Key)
    } else {
        (Smoothing::None, Smoothing::None)
    };
    let rows_of = |t: &TensorView, codes: Region, scales: Region, smoothing| {
        let [b, seqlen, heads, _] = t.shape;
        let cfg = config(QuantKind::Rows {
            smoothing,
            hadamard,
        });
        let blocks = scale_blocks(seqlen as u32);
        let rotate = hadamard.then_some(Rotated {
            config: RotateConfig {
                input: p.input,
                head_dim: s.head_dim as u32,
                smoothing,
            },
            view: *t,
            mean: match smoothing {
                Smoothing::Key => mean_rotated,
                _ => mean,
            },
        });
        Step {
            rotate,
            config: cfg,
            args: QuantArgs {
                src: t.ptr,
                src_stride: strides3(t),
                dst: at(codes),
                dst_stride: [(seqlen * heads) as u64 * d, heads as u64 * d, d],
                scales: at(scales),
                mean,
                lse_shift: l.lse_shift.map_or(0, at),
                seqlen: seqlen as u32,
                heads: heads as u32,
                group: (heads / s.heads_kv) as u32,
                mean_heads: s.heads_kv as u32,
                scale_blocks: blocks,
                inv_seqlen: 0.0,
                hadamard_signs: signs,
                batch: b as u32,
                _pad: 0,
                tickets: 0,
            },
            grid: (blocks, heads as u32, b as u32),
        }
    };
    let mut steps = Vec::new();
    if p.options.smooth_k {
        // With the Hadamard option the same kernel rotates the finished mean into
        // `k_mean_rotated` (on every GPU: the butterfly kernels rotate after subtracting
        // and do not read it, but the workspace holds the same everywhere).
        let rotate = l.k_mean_rotated.is_some();
        let cfg = config(QuantKind::KeyMean { rotate });
        steps.push(Step {
            rotate: None,
            config: cfg,
            args: QuantArgs {
                src: k.ptr,
                src_stride: strides3(k),
                dst: mean_rotated,
                tickets: l.k_mean_tickets.map_or(0, at),
                hadamard_signs: signs,
                mean,
                seqlen: s.seqlen_k as u32,
                heads: s.heads_kv as u32,
                group: 1,
                mean_heads: s.heads_kv as u32,
                scale_blocks: kv_blocks,
                inv_seqlen: (1.0 / s.seqlen_k as f64) as f32,
                ..QuantArgs::default()
            },
            grid: (
                (s.seqlen_k as u32).div_ceil(cfg.rows_per_block()),
                s.heads_kv as u32,
                s.batch as u32,
            ),
        });
    }
    steps.push(rows_of(q, l.q, l.q_scale, smooth_q));
    steps.push(rows_of(k, l.k, l.k_scale, smooth_k));
    let pitch = l.vt_pitch as u64;
    let cfg = config(QuantKind::Vt);
    steps.push(Step {
        rotate: None,
        config: cfg,
        args: QuantArgs {
            src: v.ptr,
            src_stride: strides3(v),
            dst: at(l.vt),
            dst_stride: [s.heads_kv as u64 * d * pitch, d * pitch, pitch],
            scales: at(l.v_scale),
            seqlen: s.seqlen_k as u32,
            heads: s.heads_kv as u32,
            group: 1,
            mean_heads: s.heads_kv as u32,
            scale_blocks: kv_blocks,
            ..QuantArgs::default()
        },
        grid: (
            (l.vt_pitch as u32).div_ceil(cfg.rows_per_block()),
            s.heads_kv as u32,
            s.batch as u32,
        ),
    });
    steps
}

impl Attention {
    /// Quantizes 16-bit `q` (`[B, Sq, Hq, D]`), `k` and `v` (`[B, Sk, Hkv, D]`, any
    /// strides with the head dim contiguous and the others multiples of 16 bytes) to
    /// e4m3 with per-block scales, into `workspace` (laid out as [`Fp8Layout::new`] says;
    /// 256-byte aligned), on `stream`; returns the operands of
    /// [`Attention::forward_fp8`]. Needs an sm_89 or later GPU.
    ///
    /// Everything is checked before anything is launched: on error nothing runs and
    /// nothing is written. Asynchronous.
    ///
    /// # Safety
    ///
    /// The views' pointers and the workspace must be device memory of this device's
    /// context, valid for the extents described until the kernels have run, with nothing
    /// else writing the inputs or touching the workspace meanwhile; `stream` must be null
    /// or a live stream of this context.
    pub unsafe fn quantize_fp8(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        options: &QuantizeOptions,
        workspace: Workspace,
        stream: CUstream,
    ) -> Result<Fp8Operands> {
        let problem = validate_quantize(q, k, v, options, &workspace)?;
        let arch = self.device().compute_capability();
        if arch < (8, 9) {
            return Err(Error::UnsupportedGpu {
                name: format!(
                    "{} (the e4m3 conversion needs sm_89 or later)",
                    self.device().name()
                ),
                major: arch.0,
                minor: arch.1,
            });
        }
        let steps = plan_steps(&problem, q, k, v, workspace.ptr);
        let hopper = arch == (9, 0);
        // The driver encodes tensor maps only where a context is current.
        let _scope = ContextScope::enter(self.device().context())?;
        // A view the driver will not map runs the plain kernels; any other failure is the
        // call's.
        let launches = steps
            .iter()
            .map(|st| match st.rotate {
                Some(r) if hopper => match sm90_map(&r.view, SCALE_BLOCK) {
                    Ok(map) => Ok(Launch::Rotated(r.config, map)),
                    Err(e) if e.is_map_refusal() => Ok(Launch::Plain),
                    Err(e) => Err(e),
                },
                _ => Ok(Launch::Plain),
            })
            .collect::<Result<Vec<Launch>>>()?;
        // Every kernel is loaded before the first launch, so a load error launches
        // nothing.
        let kernels = steps
            .iter()
            .zip(&launches)
            .map(|(st, how)| match how {
                Launch::Plain => {
                    let cfg = st.config;
                    self.load(&cfg.id(), cfg.smem_bytes(), || cfg.generate())
                }
                Launch::Rotated(rc, _) => self.load(&rc.id(), rc.smem_bytes(), || rc.generate()),
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(span) = problem.layout.zeroed_span() {
            self.zero_f32(workspace.ptr + span.offset as u64, span.bytes / 4, stream)?;
        }
        let sms = self.device().sm_count();
        for ((step, kernel), how) in steps.iter().zip(&kernels).zip(&launches) {
            let mut args = step.args;
            match how {
                Launch::Plain => {
                    let dims = LaunchDims {
                        grid: step.grid,
                        block: (step.config.threads(), 1, 1),
                        dynamic_smem: step.config.smem_bytes(),
                    };
                    let mut params = [(&mut args as *mut QuantArgs).cast::<c_void>()];
                    // SAFETY: the kernel's one parameter is the by-value `QuantArgs`,
                    // which `args` is and which outlives the call. validate_quantize
                    // checked the inputs' pointers and extents (the kernels read rows
                    // below `seqlen` only) and that the workspace holds the layout, apart
                    // from them; the kernels write only their regions of it. This
                    // function's contract makes the memory live and `stream` valid.
                    unsafe { launch(kernel, &dims, stream, &mut params) }?;
                }
                Launch::Rotated(rc, map) => {
                    if let Some(r) = step.rotate {
                        args.mean = r.mean;
                    }
                    // Persistent: one wave of resident blocks at most, each walking the
                    // items.
                    let (x, y, z) = step.grid;
                    let items = u64::from(x) * u64::from(y) * u64::from(z);
                    let wave = u64::from(sms.max(1)) * u64::from(rc.blocks_per_sm());
                    let dims = LaunchDims {
                        grid: (items.min(wave) as u32, 1, 1),
                        block: (rc.threads(), 1, 1),
                        dynamic_smem: rc.smem_bytes(),
                    };
                    let mut map = *map;
                    let mut params = [
                        (&mut args as *mut QuantArgs).cast::<c_void>(),
                        (&mut map as *mut TensorMap).cast::<c_void>(),
                    ];
                    // SAFETY: the kernel's parameters are the by-value `QuantArgs` and the
                    // by-value 128-byte tensor map of the step's input, which these point
                    // at and which outlive the call. The map covers exactly the validated
                    // view (TMA reads nothing outside it); the codes and scales go to the
                    // workspace regions validate_quantize checked, rows below `seqlen`
                    // only. This function's contract makes the memory live and `stream`
                    // valid.
                    unsafe { launch(kernel, &dims, stream, &mut params) }?;
                }
            }
        }
        Ok(problem.layout.operands(workspace.ptr, &problem.shape))
    }

    /// Sets `count` f32 at `ptr` to +0, ordered on `stream`.
    fn zero_f32(&self, ptr: u64, count: usize, stream: CUstream) -> Result<()> {
        let _scope = ContextScope::enter(self.device().context())?;
        // SAFETY: the context is current; `ptr .. ptr + 4·count` is a region of the
        // validated workspace (4-byte aligned) and `stream` is the caller's, null or live
        // by `quantize_fp8`'s contract.
        check("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(ptr, 0, count, stream)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1 << 30;

    fn views(b: usize, sq: usize, sk: usize, hq: usize, hkv: usize, d: usize) -> [TensorView; 3] {
        [
            TensorView::bshd(GB, DType::F16, b, sq, hq, d),
            TensorView::bshd(2 * GB, DType::F16, b, sk, hkv, d),
            TensorView::bshd(3 * GB, DType::F16, b, sk, hkv, d),
        ]
    }

    fn workspace() -> Workspace {
        Workspace {
            ptr: 4 * GB,
            bytes: 1 << 29,
        }
    }

    fn check(
        views: &[TensorView; 3],
        opts: &QuantizeOptions,
        ws: Workspace,
    ) -> Result<QuantizeProblem> {
        validate_quantize(&views[0], &views[1], &views[2], opts, &ws)
    }

    #[test]
    fn layout_regions_are_aligned_and_disjoint() {
        let shape = AttnShape {
            batch: 2,
            seqlen_q: 129,
            seqlen_k: 17,
            heads_q: 8,
            heads_kv: 2,
            head_dim: 64,
        };
        let plain = Fp8Layout::new(&shape, &QuantizeOptions::default()).unwrap();
        assert_eq!(plain.k_mean, None);
        assert_eq!(plain.lse_shift, None);
        assert_eq!(plain.vt_pitch, 32);
        assert_eq!(plain.q.bytes, 2 * 129 * 8 * 64);
        assert_eq!(plain.vt.bytes, 2 * 2 * 64 * 32);
        assert_eq!(plain.q_scale.bytes, 2 * 8 * 2 * 4);
        assert_eq!(plain.k_scale.bytes, 2 * 2 * 4);
        let smooth = QuantizeOptions {
            smooth_k: true,
            hadamard_seed: Some(1),
        };
        let full = Fp8Layout::new(&shape, &smooth).unwrap();
        assert_eq!(full.k_mean.unwrap().bytes, 2 * 2 * 64 * 4);
        assert_eq!(full.lse_shift.unwrap().bytes, 2 * 8 * 129 * 4);
        assert_eq!(full.k_mean_rotated.unwrap().bytes, 2 * 2 * 64 * 4);
        assert_eq!(full.k_mean_tickets.unwrap().bytes, 2 * 2 * 4);
        // One memset: the mean, then the tickets right after it.
        let span = full.zeroed_span().unwrap();
        assert_eq!(span.offset, full.k_mean.unwrap().offset);
        assert_eq!(
            span.bytes,
            (2 * 2 * 64 * 4usize).next_multiple_of(Fp8Layout::ALIGN) + 2 * 2 * 4
        );
        let smooth_only = QuantizeOptions {
            smooth_k: true,
            hadamard_seed: None,
        };
        let smoothed = Fp8Layout::new(&shape, &smooth_only).unwrap();
        assert_eq!(smoothed.k_mean_rotated, None);
        assert_eq!(smoothed.k_mean_tickets, None);
        assert_eq!(smoothed.zeroed_span(), smoothed.k_mean);
        assert_eq!(plain.zeroed_span(), None);
        let regions = [
            full.q,
            full.k,
            full.vt,
            full.q_scale,
            full.k_scale,
            full.v_scale,
            full.k_mean.unwrap(),
            full.k_mean_tickets.unwrap(),
            full.lse_shift.unwrap(),
            full.k_mean_rotated.unwrap(),
        ];
        for pair in regions.windows(2) {
            assert!(pair[0].offset + pair[0].bytes <= pair[1].offset);
        }
        for r in regions {
            assert_eq!(r.offset % Fp8Layout::ALIGN, 0);
        }
        assert_eq!(
            full.bytes,
            full.k_mean_rotated.unwrap().offset + 2 * 2 * 64 * 4
        );
        let ops = full.operands(4 * GB, &shape);
        assert_eq!(ops.q.ptr, 4 * GB);
        assert_eq!(ops.q.dtype, DType::E4m3);
        assert_eq!(ops.vt.pitch(), 32);
        assert_eq!(
            ops.lse_shift,
            Some(4 * GB + full.lse_shift.unwrap().offset as u64)
        );
        // Lengths past u32 size their scale regions in full, not wrapped.
        let long = AttnShape {
            batch: 1,
            seqlen_q: (1 << 32) + 1,
            seqlen_k: 1,
            heads_q: 1,
            heads_kv: 1,
            head_dim: 64,
        };
        let layout = Fp8Layout::new(&long, &QuantizeOptions::default()).unwrap();
        assert_eq!(layout.q_scale.bytes, ((1 << 25) + 1) * 4);
        let huge = AttnShape {
            batch: usize::MAX / 2,
            ..shape
        };
        assert!(matches!(
            Fp8Layout::new(&huge, &smooth),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn the_operands_are_what_forward_fp8_accepts() {
        use crate::host::fp8::validate_fp8;
        use crate::host::tensor::AttentionParams;
        let shape = AttnShape {
            batch: 2,
            seqlen_q: 300,
            seqlen_k: 1001,
            heads_q: 8,
            heads_kv: 2,
            head_dim: 128,
        };
        for smooth_k in [false, true] {
            let options = QuantizeOptions {
                smooth_k,
                hadamard_seed: None,
            };
            let ops = Fp8Layout::new(&shape, &options)
                .unwrap()
                .operands(4 * GB, &shape);
            let o = TensorView::bshd(GB, DType::Bf16, 2, 300, 8, 128);
            let problem = validate_fp8(&ops, &o, None, &AttentionParams::default()).unwrap();
            assert_eq!(problem.shape, shape);
            assert_eq!(ops.lse_shift.is_some(), smooth_k);
        }
    }

    #[test]
    fn accepts_strided_views_and_plans_the_launches_in_order() {
        let opts = QuantizeOptions {
            smooth_k: true,
            hadamard_seed: Some(7),
        };
        let mut v = views(2, 300, 1000, 8, 2, 128);
        v[0] = TensorView::bhsd(GB, DType::Bf16, 2, 300, 8, 128);
        v[1].dtype = DType::Bf16;
        v[2].dtype = DType::Bf16;
        let p = check(&v, &opts, workspace()).unwrap();
        assert_eq!(p.input, HalfType::Bf16);
        let steps = plan_steps(&p, &v[0], &v[1], &v[2], 4 * GB);
        let kinds: Vec<_> = steps.iter().map(|s| s.config.kind).collect();
        assert_eq!(
            kinds,
            [
                QuantKind::KeyMean { rotate: true },
                QuantKind::Rows {
                    smoothing: Smoothing::Query,
                    hadamard: true
                },
                QuantKind::Rows {
                    smoothing: Smoothing::Key,
                    hadamard: true
                },
                QuantKind::Vt
            ]
        );
        let l = &p.layout;
        let (mean, rotated_mean, tickets) = (
            4 * GB + l.k_mean.unwrap().offset as u64,
            4 * GB + l.k_mean_rotated.unwrap().offset as u64,
            4 * GB + l.k_mean_tickets.unwrap().offset as u64,
        );
        assert_eq!(steps[0].grid, (2, 2, 2), "1000 keys in slabs of 512");
        // The key mean accumulates into the mean, and its last block per head rotates
        // it into the rotated mean.
        assert_eq!(
            (steps[0].args.mean, steps[0].args.dst, steps[0].args.tickets),
            (mean, rotated_mean, tickets)
        );
        assert_eq!(steps[1].grid, (3, 8, 2));
        assert_eq!(steps[1].args.group, 4);
        assert_eq!(steps[1].args.src_stride, [8 * 300 * 128, 128, 300 * 128]);
        assert_eq!(steps[3].grid, (8, 2, 2), "pitch 1008 in blocks of 128");
        assert_eq!(steps[3].args.dst_stride[2], 1008);
        for step in &steps[0..3] {
            assert_eq!(
                step.args.hadamard_signs,
                HadamardSigns::from_seed(7, 128).words()
            );
        }
        // On the tensor cores Q reads the mean (for lse_shift) and K the rotated one;
        // the butterfly kernels both read the mean.
        let rotate: Vec<_> = steps
            .iter()
            .map(|s| s.rotate.map(|r| (r.config.smoothing, r.view.ptr, r.mean)))
            .collect();
        assert_eq!(
            rotate,
            [
                None,
                Some((Smoothing::Query, v[0].ptr, mean)),
                Some((Smoothing::Key, v[1].ptr, rotated_mean)),
                None
            ]
        );
        assert_eq!((steps[1].args.mean, steps[2].args.mean), (mean, mean));
        let rotated = QuantizeOptions {
            smooth_k: false,
            hadamard_seed: Some(7),
        };
        let p = check(&v, &rotated, workspace()).unwrap();
        assert_eq!(p.layout.k_mean_rotated, None);
        let steps = plan_steps(&p, &v[0], &v[1], &v[2], 4 * GB);
        let rotate: Vec<_> = steps
            .iter()
            .map(|s| s.rotate.map(|r| (r.config, r.view.ptr)))
            .collect();
        let cfg = RotateConfig {
            input: HalfType::Bf16,
            head_dim: 128,
            smoothing: Smoothing::None,
        };
        assert_eq!(rotate, [Some((cfg, v[0].ptr)), Some((cfg, v[1].ptr)), None]);
        let plain = check(&v, &QuantizeOptions::default(), workspace()).unwrap();
        let steps = plan_steps(&plain, &v[0], &v[1], &v[2], 4 * GB);
        assert_eq!(steps.len(), 3);
        assert!(steps.iter().all(|s| s.rotate.is_none()));
        assert!(
            steps
                .iter()
                .all(|s| s.args.mean == 0 && s.args.lse_shift == 0)
        );
    }

    #[test]
    fn refuses_bad_input_with_typed_errors() {
        let opts = QuantizeOptions::default();
        let ok = views(2, 64, 80, 4, 2, 64);
        check(&ok, &opts, workspace()).unwrap();
        // 2^32 + 64 is not 64 (the head dim is compared without narrowing to u32).
        const HUGE_D: usize = (1 << 32) + 64;
        let tb = 1u64 << 40;
        let huge = [1, 2, 3].map(|i| TensorView::bshd(i * tb, DType::F16, 1, 1, 1, HUGE_D));
        assert!(matches!(
            validate_quantize_inputs(&huge[0], &huge[1], &huge[2], &opts),
            Err(Error::UnsupportedHeadDim(HUGE_D, _))
        ));
        let with = |f: &dyn Fn(&mut [TensorView; 3])| {
            let mut v = ok;
            f(&mut v);
            check(&v, &opts, workspace())
        };
        assert!(matches!(
            with(&|v| v[0].dtype = DType::F32),
            Err(Error::UnsupportedDType(_))
        ));
        assert!(matches!(
            with(&|v| v[2].dtype = DType::Bf16),
            Err(Error::UnsupportedDType(_))
        ));
        assert!(matches!(
            with(&|v| v[1].dtype = DType::E4m3),
            Err(Error::UnsupportedDType(_))
        ));
        assert!(matches!(
            with(&|v| v[1].shape[1] = 0),
            Err(Error::EmptyDimension { tensor: "k", .. })
        ));
        assert!(matches!(
            with(&|v| v[2].shape[1] = 81),
            Err(Error::ShapeMismatch(_))
        ));
        assert!(matches!(
            with(&|v| *v = views(2, 64, 80, 4, 2, 96)),
            Err(Error::UnsupportedHeadDim(96, _))
        ));
        assert!(matches!(
            with(&|v| *v = views(2, 64, 80, 3, 2, 64)),
            Err(Error::HeadRatio { hq: 3, hkv: 2 })
        ));
        assert!(matches!(
            with(&|v| v[0].ptr = 0),
            Err(Error::NullPointer("q"))
        ));
        assert!(matches!(
            with(&|v| v[2].ptr += 8),
            Err(Error::Misaligned { tensor: "v", .. })
        ));
        assert!(matches!(
            with(&|v| v[1].strides[3] = 2),
            Err(Error::BadStrides { tensor: "k", .. })
        ));
        assert!(matches!(
            with(&|v| v[0].strides[1] = 4 * 64 + 4),
            Err(Error::BadStrides { tensor: "q", .. })
        ));
        assert!(matches!(
            with(&|v| v[0].shape[1] = crate::host::validate::MAX_SEQLEN + 1),
            Err(Error::InvalidArgument(_))
        ));
        // The workspace: null, misaligned, too small, over an input.
        let bad = |ws: Workspace| check(&ok, &opts, ws);
        assert!(matches!(
            bad(Workspace {
                ptr: 0,
                ..workspace()
            }),
            Err(Error::NullPointer("workspace"))
        ));
        assert!(matches!(
            bad(Workspace {
                ptr: 4 * GB + 16,
                ..workspace()
            }),
            Err(Error::Misaligned {
                tensor: "workspace",
                ..
            })
        ));
        let needed = Fp8Layout::new(&check(&ok, &opts, workspace()).unwrap().shape, &opts)
            .unwrap()
            .bytes;
        assert!(
            bad(Workspace {
                bytes: needed,
                ..workspace()
            })
            .is_ok()
        );
        assert!(matches!(
            bad(Workspace {
                bytes: needed - 1,
                ..workspace()
            }),
            Err(Error::InvalidArgument(ref m)) if m.contains("needs")
        ));
        assert!(matches!(
            bad(Workspace {
                ptr: 2 * GB,
                ..workspace()
            }),
            Err(Error::InvalidArgument(ref m)) if m.contains("overlaps k")
        ));
        // A workspace running past the end of the address space: a range past it.
        assert!(matches!(
            bad(Workspace {
                ptr: u64::MAX - 255,
                bytes: usize::MAX,
            }),
            Err(Error::BadStrides {
                tensor: "workspace",
                ..
            })
        ));
        // Smoothing needs room for the mean and lse_shift too.
        let smooth = QuantizeOptions {
            smooth_k: true,
            hadamard_seed: None,
        };
        assert!(
            validate_quantize(
                &ok[0],
                &ok[1],
                &ok[2],
                &smooth,
                &Workspace {
                    bytes: needed,
                    ..workspace()
                }
            )
            .is_err()
        );
    }
}
