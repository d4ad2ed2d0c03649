//! End-to-end checks and timing of the forward kernel on a GPU: random inputs, poisoned
//! outputs, a run, and the comparison with the float64 [reference](mod@crate::reference).
//! Used by the GPU tests, the `flashcore run` / `bench` commands and the benches. The FP8
//! path is checked the same way from the same 16-bit inputs: quantized on the GPU
//! ([`Attention::quantize_fp8`]), then [`Attention::forward_fp8`], against float64
//! attention on the 16-bit values ([`check_forward_fp8`], [`time_fp8`]).
//!
//! Test and benchmark tooling, not the library's API: the uploads and downloads here go
//! through cudarc's safe API, which leaves the device's primary context current on the
//! calling thread.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::error::{Error, Result};
use crate::host::attention::Attention;
use crate::host::decode::Workspace;
use crate::host::device::driver_err;
use crate::host::fp8::Fp8Operands;
use crate::host::quantize::{Fp8Layout, QuantizeOptions, validate_quantize_inputs};
use crate::host::tensor::{AttentionParams, DType, LseView, TensorView, Window};
use crate::host::timing::{Backlog, TimingStats, median_ms, median_ms_queued};
use crate::host::validate::validate_fwd;
use crate::kernels::attention::{FwdConfig, HalfType};
use crate::reference::{self, Rng};
use crate::shape::AttnShape;

/// How a tensor is laid out in memory (the logical shape is always `[B, S, H, D]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[B, S, H, D]`, as FlashAttention takes it.
    Bshd,
    /// `[B, H, S, D]`, as PyTorch SDPA takes it.
    Bhsd,
}

/// One forward problem, as the checks and benchmarks run it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FwdCase {
    pub shape: AttnShape,
    pub dtype: HalfType,
    pub causal: bool,
    /// A key window around each row's diagonal (none by default).
    pub window: Window,
    /// Logit soft-capping ([`AttentionParams::softcap`]).
    pub softcap: Option<f32>,
    /// The softmax scale; `None`: `1/sqrt(head_dim)`.
    pub softmax_scale: Option<f32>,
    pub layout: Layout,
    /// Run this kernel configuration instead of the one the dispatch picks.
    pub kernel: Option<FwdConfig>,
}

/// The project's benchmark shapes, (B, H, S, D), self-attention; each is run causal and not.
pub const BENCH_SHAPES: [(usize, usize, usize, usize); 4] = [
    (2, 8, 512, 64),
    (4, 32, 4096, 64),
    (8, 16, 2048, 128),
    (1, 16, 16384, 128),
];

/// The environment variable that sets the seed of the GPU tests' random inputs: decimal or
/// `0x` hexadecimal.
pub const SEED_VAR: &str = "FLASHCORE_SEED";

/// The GPU tests' seed when [`SEED_VAR`] is unset: fixed, so every run draws the same
/// inputs and a failure is reproducible.
pub const DEFAULT_SEED: u64 = 0xF1A5_C0DE;

/// A seed as [`SEED_VAR`] takes it: decimal, or hexadecimal after `0x`/`0X`; surrounding
/// whitespace is ignored. `None` for anything else (empty, negative, too large).
pub fn parse_seed(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) if !hex.is_empty() && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            u64::from_str_radix(hex, 16).ok()
        }
        Some(_) => None,
        None if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) => t.parse().ok(),
        None => None,
    }
}

/// The random inputs of one GPU test run: the run's seed ([`SEED_VAR`], else
/// [`DEFAULT_SEED`]) and, drawn from it in order, one seed per case.
///
/// Every failure message should carry [`TestSeeds::replay`]: running the same test again
/// with `FLASHCORE_SEED` set to the run's seed draws the same inputs for every case.
///
/// ```
/// let mut seeds = flashcore::check::TestSeeds::new(7);
/// let mut rng = seeds.next_case(); // pass to DeviceCase::new / check_forward
/// let line = format!("case failed ({})", seeds.replay(&rng));
/// # let _ = (&mut rng, line);
/// ```
#[derive(Debug, Clone)]
pub struct TestSeeds {
    run: u64,
    cases: Rng,
}

impl TestSeeds {
    /// The seeds of a run starting from `run`.
    pub fn new(run: u64) -> TestSeeds {
        TestSeeds {
            run,
            cases: Rng::new(run),
        }
    }

    /// The run's seed from [`SEED_VAR`], or [`DEFAULT_SEED`] when it is unset or empty.
    ///
    /// Errors: [`Error::InvalidArgument`] when the variable is set to something that is not
    /// a seed (rather than silently running with another one).
    pub fn from_env() -> Result<TestSeeds> {
        Self::from_var(std::env::var(SEED_VAR).ok().as_deref())
    }

    fn from_var(value: Option<&str>) -> Result<TestSeeds> {
        match value.map(str::trim) {
            None | Some("") => Ok(Self::new(DEFAULT_SEED)),
            Some(v) => parse_seed(v).map(Self::new).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{SEED_VAR}={v:?} is not a seed (decimal, or hexadecimal after 0x)"
                ))
            }),
        }
    }

    /// The run's seed: what [`SEED_VAR`] must be set to for a replay.
    pub fn run_seed(&self) -> u64 {
        self.run
    }

    /// The generator of the next case, seeded from the run's sequence.
    pub fn next_case(&mut self) -> Rng {
        Rng::new(self.cases.next_u64())
    }

    /// `case seed 0x..; replay: FLASHCORE_SEED=0x..`, for the failure message of the case
    /// drawn with `case`.
    pub fn replay(&self, case: &Rng) -> String {
        format!(
            "case seed {:#x}; replay: {SEED_VAR}={:#x}",
            case.seed(),
            self.run
        )
    }
}

/// The Hopper forward's benchmark grid, `(B, Hq, Hkv, S, D)`: D in {64, 128, 256} with
/// H = 2048 / D and B · S = 16384 for S from 512 to 16384; GQA B4 Hq32 Hkv8 S4096 D128;
/// the reference shape B2 H8 S512 D64 first. (`scripts/sdpa_bench.py --shapes hopper`
/// measures the same list.)
pub fn hopper_bench_shapes() -> Vec<(usize, usize, usize, usize, usize)> {
    let mut v = vec![(2, 8, 8, 512, 64), (4, 32, 8, 4096, 128)];
    for d in [64, 128, 256] {
        for s in [512, 1024, 2048, 4096, 8192, 16384] {
            v.push((16384 / s, 2048 / d, 2048 / d, s, d));
        }
    }
    v
}

/// The head dims without an sm90 kernel of their own (on Hopper they run a larger one,
/// padded, or their own sm80 kernel), `(B, Hq, Hkv, S, D)`: D in {32, 40, 80, 96, 112,
/// 160, 192} at H = 16 and B · S = 16384 for S 2048 and 8192. (`scripts/sdpa_bench.py
/// --shapes padded` measures the same list.)
pub fn padded_bench_shapes() -> Vec<(usize, usize, usize, usize, usize)> {
    let mut v = Vec::new();
    for d in [32, 40, 80, 96, 112, 160, 192] {
        for s in [2048, 8192] {
            v.push((16384 / s, 16, 16, s, d));
        }
    }
    v
}

impl std::fmt::Display for FwdCase {
    /// `B2 H8 S512 D64 f16 causal [B, H, S, D]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mask = if self.causal { "causal" } else { "full" };
        let layout = match self.layout {
            Layout::Bshd => "[B, S, H, D]",
            Layout::Bhsd => "[B, H, S, D]",
        };
        write!(f, "{} {} {mask} {layout}", self.shape, self.dtype.name())?;
        if self.window != Window::FULL {
            let side = |s: Option<u32>| s.map_or("-1".to_string(), |s| s.to_string());
            let (l, r) = (side(self.window.left), side(self.window.right));
            write!(f, " window ({l}, {r})")?;
        }
        if let Some(cap) = self.softcap {
            write!(f, " softcap {cap}")?;
        }
        if let Some(scale) = self.softmax_scale {
            write!(f, " scale {scale}")?;
        }
        match &self.kernel {
            Some(cfg) => write!(f, " {}", cfg.id()),
            None => Ok(()),
        }
    }
}

impl FwdCase {
    /// FLOPs of the visible (query, key) pairs.
    pub fn flops(&self) -> f64 {
        self.shape.flops_in_window(self.causal, self.window)
    }

    /// The call's options: this case's scale, masking and soft cap.
    pub fn params(&self) -> AttentionParams {
        AttentionParams {
            softmax_scale: self.softmax_scale,
            causal: self.causal,
            window: self.window,
            softcap: self.softcap,
        }
    }

    /// Bytes of Q, K, V and O.
    pub fn bytes(&self) -> usize {
        self.shape.io_bytes(2)
    }

    /// What a forward call on this case would be refused for (dtype, empty dimensions,
    /// head dim, head ratio, the size limits), found before anything is allocated: its
    /// tensors laid out one after another from a made-up address, as [`validate_fwd`]
    /// sees them. Tensors past the address space are [`Error::InvalidArgument`] too.
    /// [`DeviceCase::new`] and [`DeviceCase::for_timing`] check this first, so no size is
    /// multiplied, and nothing is drawn or uploaded, for a case no kernel would take.
    pub fn validate(&self) -> Result<()> {
        let ([q, k, v, o], lse) = self.made_up_views()?;
        validate_fwd(&q, &k, &v, &o, Some(&lse), &self.params()).map(|_| ())
    }

    /// [`FwdCase::validate`] for the FP8 path: a key window or a soft cap, which the FP8
    /// forward refuses, and what quantizing this case's inputs with `options` would be
    /// refused for ([`validate_quantize_inputs`]: FP8 head dims, sizes, the workspace's
    /// layout).
    pub fn validate_fp8(&self, options: &QuantizeOptions) -> Result<()> {
        let ([q, k, v, _], _) = self.made_up_views()?;
        crate::host::fp8::fp8_masking(&self.params(), self.shape.seqlen_q, self.shape.seqlen_k)?;
        validate_quantize_inputs(&q, &k, &v, options).map(|_| ())
    }

    /// Views of Q, K, V, O and LSE laid out one after another from a made-up address,
    /// 256-byte aligned; [`Error::InvalidArgument`] where they pass the address space.
    fn made_up_views(&self) -> Result<([TensorView; 4], LseView)> {
        let s = &self.shape;
        let too_large = || {
            Error::InvalidArgument(format!(
                "the tensors of {} pass the address space",
                self.shape
            ))
        };
        let mut at = 1u64 << 16;
        let mut place = |dims: &[usize], elem: usize| -> Result<u64> {
            let bytes = dims
                .iter()
                .try_fold(elem, |n, &d| n.checked_mul(d))
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(too_large)?;
            let ptr = at;
            at = at
                .checked_add(bytes)
                .and_then(|end| end.checked_next_multiple_of(256))
                .ok_or_else(too_large)?;
            Ok(ptr)
        };
        let (b, d) = (s.batch, s.head_dim);
        let (q_dims, kv_dims) = (
            [b, s.seqlen_q, s.heads_q, d],
            [b, s.seqlen_k, s.heads_kv, d],
        );
        let q = self.view(place(&q_dims, 2)?, s.seqlen_q, s.heads_q);
        let k = self.view(place(&kv_dims, 2)?, s.seqlen_k, s.heads_kv);
        let v = self.view(place(&kv_dims, 2)?, s.seqlen_k, s.heads_kv);
        let o = self.view(place(&q_dims, 2)?, s.seqlen_q, s.heads_q);
        let lse = LseView {
            ptr: place(&[b, s.heads_q, s.seqlen_q], 4)?,
        };
        Ok(([q, k, v, o], lse))
    }

    fn view(&self, ptr: u64, seqlen: usize, heads: usize) -> TensorView {
        let dtype = DType::from(self.dtype);
        let (b, d) = (self.shape.batch, self.shape.head_dim);
        match self.layout {
            Layout::Bshd => TensorView::bshd(ptr, dtype, b, seqlen, heads, d),
            Layout::Bhsd => TensorView::bhsd(ptr, dtype, b, seqlen, heads, d),
        }
    }

    /// Host data between logical `[B, S, H, D]` order and this case's memory order
    /// (`to_memory` chooses the direction).
    fn relayout(&self, data: &[u16], seqlen: usize, heads: usize, to_memory: bool) -> Vec<u16> {
        match self.layout {
            Layout::Bshd => data.to_vec(),
            Layout::Bhsd => {
                let (b, d) = (self.shape.batch, self.shape.head_dim);
                permute(data, b, seqlen, heads, d, !to_memory)
            }
        }
    }
}

/// `[B, S, H, D] -> [B, H, S, D]`, or back with `inverse`.
fn permute(x: &[u16], b: usize, s: usize, h: usize, d: usize, inverse: bool) -> Vec<u16> {
    let mut out = vec![0u16; x.len()];
    for bi in 0..b {
        for si in 0..s {
            for hi in 0..h {
                let bshd = ((bi * s + si) * h + hi) * d;
                let bhsd = ((bi * h + hi) * s + si) * d;
                let (from, to) = if inverse { (bhsd, bshd) } else { (bshd, bhsd) };
                out[to..to + d].copy_from_slice(&x[from..from + d]);
            }
        }
    }
    out
}

/// A case's tensors on the device, with the host copies of the inputs.
pub struct DeviceCase {
    pub case: FwdCase,
    stream: Arc<CudaStream>,
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
    /// Exact input values, `[B, S, H, D]`.
    host: [Vec<f64>; 3],
    pub seed: u64,
}

impl DeviceCase {
    /// Draws fresh N(0, 1) inputs and uploads them; O and LSE are poisoned (NaN).
    pub fn new(stream: &Arc<CudaStream>, case: FwdCase, rng: &mut Rng) -> Result<DeviceCase> {
        case.validate()?;
        let c = &case;
        let n_q = c.shape.batch * c.shape.seqlen_q * c.shape.heads_q * c.shape.head_dim;
        let n_kv = c.shape.batch * c.shape.seqlen_k * c.shape.heads_kv * c.shape.head_dim;
        let (q_bits, q) = reference::random_half(rng, n_q, c.dtype);
        let (k_bits, k) = reference::random_half(rng, n_kv, c.dtype);
        let (v_bits, v) = reference::random_half(rng, n_kv, c.dtype);
        let upload = |bits: &[u16], s, h| {
            stream
                .clone_htod(&c.relayout(bits, s, h, true))
                .map_err(driver_err("cuMemcpyHtoD"))
        };
        let dev = DeviceCase {
            q: upload(&q_bits, c.shape.seqlen_q, c.shape.heads_q)?,
            k: upload(&k_bits, c.shape.seqlen_k, c.shape.heads_kv)?,
            v: upload(&v_bits, c.shape.seqlen_k, c.shape.heads_kv)?,
            o: stream
                .clone_htod(&vec![reference::poison(c.dtype); n_q])
                .map_err(driver_err("cuMemcpyHtoD"))?,
            lse: stream
                .clone_htod(&vec![
                    f32::NAN;
                    c.shape.batch * c.shape.heads_q * c.shape.seqlen_q
                ])
                .map_err(driver_err("cuMemcpyHtoD"))?,
            stream: stream.clone(),
            host: [q, k, v],
            seed: rng.seed(),
            case,
        };
        Ok(dev)
    }

    /// Inputs for timing only: N(0, 1) values (never zeros) tiled from a small random
    /// pool at random offsets, so large cases upload in milliseconds instead of drawing
    /// 10^8 normals on the host. There is no float64 copy: [`DeviceCase::reference`]
    /// must not be called on such a case.
    pub fn for_timing(
        stream: &Arc<CudaStream>,
        case: FwdCase,
        rng: &mut Rng,
    ) -> Result<DeviceCase> {
        case.validate()?;
        const POOL: usize = 1 << 16;
        let (pool, _) = reference::random_half(rng, POOL, case.dtype);
        let mut fill = |n: usize| -> Vec<u16> {
            let at = (rng.next_u64() % POOL as u64) as usize;
            (0..n).map(|i| pool[(at + i) % POOL]).collect()
        };
        let c = &case.shape;
        let n_q = c.batch * c.seqlen_q * c.heads_q * c.head_dim;
        let n_kv = c.batch * c.seqlen_k * c.heads_kv * c.head_dim;
        let (q, k, v) = (fill(n_q), fill(n_kv), fill(n_kv));
        let up = |x: &[u16]| stream.clone_htod(x).map_err(driver_err("cuMemcpyHtoD"));
        Ok(DeviceCase {
            q: up(&q)?,
            k: up(&k)?,
            v: up(&v)?,
            o: up(&vec![reference::poison(case.dtype); n_q])?,
            lse: stream
                .clone_htod(&vec![f32::NAN; c.batch * c.heads_q * c.seqlen_q])
                .map_err(driver_err("cuMemcpyHtoD"))?,
            stream: stream.clone(),
            host: [Vec::new(), Vec::new(), Vec::new()],
            seed: rng.seed(),
            case,
        })
    }

    /// The views of Q, K, V, O and LSE.
    pub fn views(&self) -> ([TensorView; 4], LseView) {
        let c = &self.case;
        let ptr = |s: &CudaSlice<u16>| s.device_ptr(&self.stream).0;
        let lse = LseView {
            ptr: self.lse.device_ptr(&self.stream).0,
        };
        (
            [
                c.view(ptr(&self.q), c.shape.seqlen_q, c.shape.heads_q),
                c.view(ptr(&self.k), c.shape.seqlen_k, c.shape.heads_kv),
                c.view(ptr(&self.v), c.shape.seqlen_k, c.shape.heads_kv),
                c.view(ptr(&self.o), c.shape.seqlen_q, c.shape.heads_q),
            ],
            lse,
        )
    }

    /// Poisons O and the LSE again (as [`DeviceCase::new`] leaves them), so that a later
    /// run's unwritten elements show instead of an earlier run's values.
    pub fn poison(&mut self) -> Result<()> {
        let o = vec![reference::poison(self.case.dtype); self.o.len()];
        let lse = vec![f32::NAN; self.lse.len()];
        self.stream
            .memcpy_htod(&o, &mut self.o)
            .map_err(driver_err("cuMemcpyHtoD"))?;
        self.stream
            .memcpy_htod(&lse, &mut self.lse)
            .map_err(driver_err("cuMemcpyHtoD"))
    }

    /// One forward call on this case's stream, LSE included.
    pub fn run(&self, attn: &Attention, params: &AttentionParams) -> Result<()> {
        let ([q, k, v, o], lse) = self.views();
        let stream = self.stream.cu_stream();
        // SAFETY: the views point into this case's own device buffers, sized for them and
        // alive as long as `self`, on the stream the buffers were made with.
        unsafe {
            match &self.case.kernel {
                None => attn.forward(&q, &k, &v, &o, Some(&lse), params, stream),
                Some(cfg) => {
                    attn.forward_with_config(cfg, &q, &k, &v, &o, Some(&lse), params, stream)
                }
            }
        }
    }

    /// The output as `[B, Sq, Hq, D]` bits and the LSE.
    pub fn download(&self) -> Result<(Vec<u16>, Vec<f32>)> {
        let o = self
            .stream
            .clone_dtoh(&self.o)
            .map_err(driver_err("cuMemcpyDtoH"))?;
        let lse = self
            .stream
            .clone_dtoh(&self.lse)
            .map_err(driver_err("cuMemcpyDtoH"))?;
        self.stream
            .synchronize()
            .map_err(driver_err("cuStreamSynchronize"))?;
        Ok((
            self.case
                .relayout(&o, self.case.shape.seqlen_q, self.case.shape.heads_q, false),
            lse,
        ))
    }

    /// Quantizes this case's Q, K and V into `ws` with `options` (on this case's stream),
    /// for [`DeviceCase::run_fp8`].
    pub fn quantize_fp8(
        &self,
        attn: &Attention,
        options: &QuantizeOptions,
        ws: &mut Fp8Workspace,
    ) -> Result<()> {
        let ([q, k, v, _], _) = self.views();
        ws.operands = None;
        // SAFETY: the views point into this case's own device buffers and the workspace
        // into `ws`'s, both alive as long as `self` and `ws` and made with this stream.
        let ops = unsafe {
            attn.quantize_fp8(&q, &k, &v, options, ws.workspace, self.stream.cu_stream())
        }?;
        ws.operands = Some(ops);
        Ok(())
    }

    /// The FP8 forward from the operands in `ws` (quantized there by
    /// [`DeviceCase::quantize_fp8`]) into this case's O and LSE, on its stream.
    pub fn run_fp8(
        &self,
        attn: &Attention,
        ws: &Fp8Workspace,
        params: &AttentionParams,
    ) -> Result<()> {
        let ops = ws.operands.as_ref().ok_or_else(|| {
            Error::InvalidArgument("run_fp8: nothing was quantized into this workspace".into())
        })?;
        let ([_, _, _, o], lse) = self.views();
        // SAFETY: the operands lie in `ws`'s buffer, O and the LSE in this case's; both
        // are alive as long as the borrows and were made with this stream.
        unsafe { attn.forward_fp8(ops, &o, Some(&lse), params, self.stream.cu_stream()) }
    }

    /// The float64 reference for this case's inputs, computed on all cores.
    pub fn reference(&self, scale: f64) -> reference::RefOutput {
        parallel_reference(&self.case, &self.host, scale)
    }
}

/// The reference, one (batch, head) per task: heads are independent, and GQA only
/// selects which K/V head a query head reads.
fn parallel_reference(c: &FwdCase, host: &[Vec<f64>; 3], scale: f64) -> reference::RefOutput {
    let (sq, sk, d) = (c.shape.seqlen_q, c.shape.seqlen_k, c.shape.head_dim);
    let group = c.shape.heads_q / c.shape.heads_kv;
    let one = AttnShape {
        batch: 1,
        seqlen_q: sq,
        seqlen_k: sk,
        heads_q: 1,
        heads_kv: 1,
        head_dim: d,
    };
    let slice = |x: &[f64], b: usize, s: usize, heads: usize, h: usize| -> Vec<f64> {
        (0..s)
            .flat_map(|i| x[((b * s + i) * heads + h) * d..][..d].iter().copied())
            .collect()
    };
    let pairs: Vec<(usize, usize)> = (0..c.shape.batch)
        .flat_map(|b| (0..c.shape.heads_q).map(move |h| (b, h)))
        .collect();
    let workers = std::thread::available_parallelism().map_or(4, |n| n.get());
    let results: Vec<((usize, usize), reference::RefOutput)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let pairs = &pairs;
                let one = &one;
                scope.spawn(move || {
                    pairs
                        .iter()
                        .skip(w)
                        .step_by(workers)
                        .map(|&(b, h)| {
                            let q = slice(&host[0], b, sq, c.shape.heads_q, h);
                            let k = slice(&host[1], b, sk, c.shape.heads_kv, h / group);
                            let v = slice(&host[2], b, sk, c.shape.heads_kv, h / group);
                            (
                                (b, h),
                                reference::attention_f64_with(
                                    one,
                                    &q,
                                    &k,
                                    &v,
                                    &reference::RefParams {
                                        scale,
                                        causal: c.causal,
                                        window: c.window,
                                        softcap: c.softcap.map(f64::from),
                                    },
                                ),
                            )
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("reference worker panicked"))
            .collect()
    });
    let mut out = vec![0.0; c.shape.batch * sq * c.shape.heads_q * d];
    let mut lse = vec![0.0; c.shape.batch * c.shape.heads_q * sq];
    for ((b, h), r) in results {
        for i in 0..sq {
            out[((b * sq + i) * c.shape.heads_q + h) * d..][..d]
                .copy_from_slice(&r.out[i * d..][..d]);
        }
        lse[(b * c.shape.heads_q + h) * sq..][..sq].copy_from_slice(&r.lse);
    }
    reference::RefOutput { out, lse }
}

/// A device workspace for the FP8 operands of one case, and the operands quantized into
/// it (see [`DeviceCase::quantize_fp8`]).
pub struct Fp8Workspace {
    _buf: CudaSlice<u8>,
    workspace: Workspace,
    operands: Option<Fp8Operands>,
}

impl Fp8Workspace {
    /// A zeroed workspace of the size [`Fp8Layout::new`] gives for `shape` and `options`,
    /// its start aligned to [`Fp8Layout::ALIGN`].
    pub fn new(
        stream: &Arc<CudaStream>,
        shape: &AttnShape,
        options: &QuantizeOptions,
    ) -> Result<Fp8Workspace> {
        let bytes = Fp8Layout::new(shape, options)?.bytes;
        let buf = stream
            .alloc_zeros::<u8>(bytes + Fp8Layout::ALIGN)
            .map_err(driver_err("cuMemAlloc"))?;
        let ptr = buf
            .device_ptr(stream)
            .0
            .next_multiple_of(Fp8Layout::ALIGN as u64);
        Ok(Fp8Workspace {
            _buf: buf,
            workspace: Workspace { ptr, bytes },
            operands: None,
        })
    }

    /// The operands last quantized into this workspace.
    pub fn operands(&self) -> Option<&Fp8Operands> {
        self.operands.as_ref()
    }
}

/// What one checked run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CheckResult {
    /// Relative L2 error of O against float64 (+∞ on NaN or unwritten elements).
    pub out_err: f64,
    /// Relative L2 error of the LSE.
    pub lse_err: f64,
    /// Output elements still holding the poison pattern (never written).
    pub unwritten: usize,
    pub seed: u64,
}

impl CheckResult {
    /// The issue's bounds on O (2e-3 for fp16, 1.6e-2 for bf16), [`LSE_TOLERANCE`] on the
    /// LSE, every element written.
    pub fn passes(&self, dtype: HalfType) -> bool {
        self.unwritten == 0 && self.out_err <= tolerance(dtype) && self.lse_err <= LSE_TOLERANCE
    }
}

/// The kernel configuration the dispatch picks for `case` on `attn`'s device (with its
/// path choice).
pub fn planned_kernel(attn: &Attention, case: &FwdCase) -> Result<FwdConfig> {
    // The checks and benchmarks run with the default scale, which the dispatch weighs
    // (whether the sm90 kernels fold it into the exponent).
    let params = case.params();
    let masking = params.masking(case.shape.seqlen_q, case.shape.seqlen_k)?;
    let problem = crate::host::validate::FwdProblem {
        shape: case.shape,
        dtype: case.dtype,
        scale: params.scale_for(case.shape.head_dim),
        causal: masking.causal,
        window: masking.window,
        softcap: params.softcap,
        packed: None,
        seqused_k: None,
        pages: None,
    };
    attn.plan(&problem)
}

/// Relative L2 bound against float64 for a dtype.
pub fn tolerance(dtype: HalfType) -> f64 {
    match dtype {
        HalfType::F16 => 2e-3,
        HalfType::Bf16 => 1.6e-2,
    }
}

/// Relative L2 bound on a 16-bit forward's LSE against float64, either dtype: the LSE is
/// f32 arithmetic on the same 16-bit inputs the reference reads (at most 1.1e-5 over
/// the 5791 checks of the 16-bit GPU suites on the H200, soft caps and splits included),
/// so O's bf16 bound (1.6e-2) would let a tail tile's rows trade LSEs unseen.
pub const LSE_TOLERANCE: f64 = 1e-4;

/// Relative L2 bound on the FP8 path's O against float64 attention on the 16-bit inputs:
/// rounding Q, K and V to E4M3 (3 mantissa bits) costs about 4.6% on normal inputs, P's
/// rounding and the per-block scales a little more (5-5.5% in all); 8% leaves room for
/// the options and for shapes whose rows see few keys.
pub const FP8_TOLERANCE: f64 = 0.08;

/// Bound on the FP8 path's LSE error: the root mean square of its absolute error (natural
/// log units, the relative error of each row's sum of exponentials) over the rows that see
/// a key. A row's LSE is off by about its scores' error, 0.03-0.04 on normal inputs of
/// one key and less the more keys it averages over. (A relative measure would not do: the
/// LSE of a row of one key is its score, which may be near 0.)
pub const FP8_LSE_TOLERANCE: f64 = 0.1;

/// What one checked FP8 run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8CheckResult {
    /// Relative L2 error of O against float64 on the 16-bit inputs (+∞ on NaN or
    /// unwritten elements).
    pub out_err: f64,
    /// RMS absolute error of the LSE over rows that see a key (+∞ on NaN, or when a row
    /// that sees no key has a finite LSE).
    pub lse_err: f64,
    /// Output elements still holding the poison pattern (never written).
    pub unwritten: usize,
    pub seed: u64,
}

impl Fp8CheckResult {
    /// [`FP8_TOLERANCE`] on O, [`FP8_LSE_TOLERANCE`] on the LSE, every element written.
    pub fn passes(&self) -> bool {
        self.unwritten == 0 && self.out_err <= FP8_TOLERANCE && self.lse_err <= FP8_LSE_TOLERANCE
    }
}

/// The root mean square of `got − want` over the finite entries of `want`; a non-finite
/// entry of `want` must be matched exactly, and a NaN or infinite `got` elsewhere makes
/// the result +∞.
pub fn rms_abs_error(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut sum, mut n) = (0.0f64, 0usize);
    for (&g, &w) in got.iter().zip(want) {
        if !w.is_finite() {
            if g != w {
                return f64::INFINITY;
            }
            continue;
        }
        if !g.is_finite() {
            return f64::INFINITY;
        }
        sum += (g - w) * (g - w);
        n += 1;
    }
    if n == 0 { 0.0 } else { (sum / n as f64).sqrt() }
}

/// Runs `case` once through the FP8 path on fresh random 16-bit inputs (of `case.dtype`,
/// which O gets too): quantized on the GPU with `options`, then the FP8 forward, compared
/// with float64 attention on the 16-bit values. Check with [`Fp8CheckResult::passes`].
pub fn check_forward_fp8(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    case: FwdCase,
    options: &QuantizeOptions,
    rng: &mut Rng,
) -> Result<Fp8CheckResult> {
    let dev = DeviceCase::new(stream, case, rng)?;
    let mut ws = Fp8Workspace::new(stream, &case.shape, options)?;
    let params = case.params();
    dev.quantize_fp8(attn, options, &mut ws)?;
    dev.run_fp8(attn, &ws, &params)?;
    let (o_bits, lse) = dev.download()?;
    let poison = reference::poison(case.dtype);
    let unwritten = o_bits.iter().filter(|&&b| b == poison).count();
    let want = dev.reference(params.scale_for(case.shape.head_dim) as f64);
    let got = reference::half_bits_to_f64(&o_bits, case.dtype);
    let lse: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
    Ok(Fp8CheckResult {
        out_err: reference::rel_l2(&got, &want.out),
        lse_err: rms_abs_error(&lse, &want.lse),
        unwritten,
        seed: dev.seed,
    })
}

/// Times the FP8 path on `case`: the quantizer (Q, K and V with `options`) and the FP8
/// forward, each the median of `iters` calls after warm-up, queued behind GPU work (as
/// [`median_ms_queued`] does), rotating over enough input sets that together they exceed
/// twice the L2 cache. Returns (quantize, forward).
pub fn time_fp8(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    case: FwdCase,
    options: &QuantizeOptions,
    iters: usize,
    rng: &mut Rng,
) -> Result<(TimingStats, TimingStats)> {
    let cases = timing_sets(attn, stream, case, rng)?;
    let mut workspaces = (0..cases.len())
        .map(|_| Fp8Workspace::new(stream, &case.shape, options))
        .collect::<Result<Vec<_>>>()?;
    let params = case.params();
    let mut next = 0;
    // SAFETY: `stream` is a live cudarc stream of the device's context (the one every
    // case's and workspace's buffers were made with), alive for the whole call; the
    // calls enqueue on it.
    let quantize = unsafe {
        median_queued(attn, stream, iters, || {
            next = (next + 1) % cases.len();
            cases[next].quantize_fp8(attn, options, &mut workspaces[next])
        })
    }?;
    for (c, ws) in cases.iter().zip(&mut workspaces) {
        c.quantize_fp8(attn, options, ws)?;
    }
    // SAFETY: as above.
    let forward = unsafe {
        median_queued(attn, stream, iters, || {
            next = (next + 1) % cases.len();
            cases[next].run_fp8(attn, &workspaces[next], &params)
        })
    }?;
    if !(quantize.median_ms.is_finite() && forward.median_ms.is_finite()) {
        return Err(Error::InvalidArgument(
            "timing produced no finite sample".into(),
        ));
    }
    Ok((quantize, forward))
}

/// Runs `case` once on fresh random inputs and compares with the reference.
pub fn check_forward(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    case: FwdCase,
    rng: &mut Rng,
) -> Result<CheckResult> {
    let dev = DeviceCase::new(stream, case, rng)?;
    let params = case.params();
    dev.run(attn, &params)?;
    let (o_bits, lse) = dev.download()?;
    let poison = reference::poison(case.dtype);
    let unwritten = o_bits.iter().filter(|&&b| b == poison).count();
    let want = dev.reference(params.scale_for(case.shape.head_dim) as f64);
    let got = reference::half_bits_to_f64(&o_bits, case.dtype);
    let lse: Vec<f64> = lse.iter().map(|&x| x as f64).collect();
    Ok(CheckResult {
        out_err: reference::rel_l2(&got, &want.out),
        lse_err: reference::rel_l2(&lse, &want.lse),
        unwritten,
        seed: dev.seed,
    })
}

/// Enough copies of `case`'s inputs (at most 64) to exceed twice the L2 cache together,
/// so timed calls rotating over them read from memory.
fn timing_sets(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    case: FwdCase,
    rng: &mut Rng,
) -> Result<Vec<DeviceCase>> {
    let l2 = attn.device().l2_bytes() as usize;
    let sets = (2 * l2).div_ceil(case.bytes().max(1)).clamp(1, 64);
    (0..sets)
        .map(|_| DeviceCase::for_timing(stream, case, rng))
        .collect()
}

/// The bytes cleared per pass of the backlog the timings queue ahead of their calls.
const BACKLOG_BYTES: usize = 256 << 20;

/// Median of `iters` calls of `f` after 3 warm-up calls, each bracketed by its own event
/// pair, with GPU work queued ahead of the timed calls as the SDPA scripts queue theirs
/// ([`median_ms_queued`], a backlog [`Backlog::covering`] the calls). Where the backlog's
/// memory cannot be had, the calls are timed without it.
///
/// # Safety
///
/// `stream` must be a live stream of `attn`'s device context, alive for the whole call,
/// and whatever `f` enqueues must be valid work on it.
unsafe fn median_queued(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    iters: usize,
    f: impl FnMut() -> Result<()>,
) -> Result<TimingStats> {
    let ctx = attn.device().context();
    let Ok(busy) = stream.alloc_zeros::<u8>(BACKLOG_BYTES) else {
        // SAFETY: this function's contract.
        return unsafe { median_ms(ctx, stream.cu_stream(), 3, iters, f) };
    };
    let backlog = Backlog::covering(busy.device_ptr(stream).0, BACKLOG_BYTES, iters);
    // SAFETY: this function's contract; `busy` is live memory of the stream's context,
    // used by nothing else, and outlives the timing (dropped after it).
    let stats = unsafe { median_ms_queued(ctx, stream.cu_stream(), backlog, 3, iters, f) };
    drop(busy);
    stats
}

/// Times `case`: median of `iters` forward calls after warm-up, each call bracketed by
/// its own event pair and queued behind GPU work (as [`median_ms_queued`] does), rotating
/// over enough input sets that together they exceed twice the L2 cache.
pub fn time_forward(
    attn: &Attention,
    stream: &Arc<CudaStream>,
    case: FwdCase,
    iters: usize,
    rng: &mut Rng,
) -> Result<TimingStats> {
    let cases = timing_sets(attn, stream, case, rng)?;
    let params = case.params();
    let mut next = 0;
    // SAFETY: `stream` is a live cudarc stream of the device's context (the one every
    // case's buffers were made with), alive for the whole call; `run` enqueues on it.
    let stats = unsafe {
        median_queued(attn, stream, iters, || {
            next = (next + 1) % cases.len();
            cases[next].run(attn, &params)
        })
    }?;
    if !stats.median_ms.is_finite() {
        return Err(Error::InvalidArgument(
            "timing produced no finite sample".into(),
        ));
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_abs_error_skips_rows_without_keys_but_checks_them() {
        let inf = f64::NEG_INFINITY;
        assert_eq!(rms_abs_error(&[1.0, inf, 3.0], &[1.0, inf, 3.0]), 0.0);
        let e = rms_abs_error(&[1.1, inf, 2.9], &[1.0, inf, 3.0]);
        assert!((e - 0.1).abs() < 1e-12, "{e}");
        assert_eq!(rms_abs_error(&[1.0, 0.0], &[1.0, inf]), f64::INFINITY);
        assert_eq!(rms_abs_error(&[f64::NAN, 0.0], &[1.0, 0.0]), f64::INFINITY);
        assert_eq!(rms_abs_error(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rms_abs_error(&[inf], &[inf]), 0.0);
    }

    #[test]
    fn seeds_parse_as_decimal_or_hex() {
        assert_eq!(parse_seed("0"), Some(0));
        assert_eq!(parse_seed("123"), Some(123));
        assert_eq!(parse_seed(" 42\n"), Some(42));
        assert_eq!(parse_seed("0x1F"), Some(31));
        assert_eq!(parse_seed("0XfF"), Some(255));
        assert_eq!(parse_seed("0xffffffffffffffff"), Some(u64::MAX));
        assert_eq!(parse_seed("18446744073709551615"), Some(u64::MAX));
        for bad in [
            "",
            "0x",
            "-1",
            "+1",
            "1e3",
            "0x1g",
            "seed",
            "18446744073709551616",
            "0x10000000000000000",
        ] {
            assert_eq!(parse_seed(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_run_seed_decides_every_case() {
        let run = |seed| {
            let mut s = TestSeeds::new(seed);
            (0..4).map(|_| s.next_case().next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let cases = run(7);
        assert!(
            cases.windows(2).all(|w| w[0] != w[1]),
            "cases repeat inputs"
        );

        assert_eq!(TestSeeds::from_var(None).unwrap().run_seed(), DEFAULT_SEED);
        assert_eq!(
            TestSeeds::from_var(Some(" ")).unwrap().run_seed(),
            DEFAULT_SEED
        );
        assert_eq!(TestSeeds::from_var(Some("0x10")).unwrap().run_seed(), 16);
        let e = TestSeeds::from_var(Some("abc")).unwrap_err();
        assert!(e.to_string().contains("FLASHCORE_SEED=\"abc\""), "{e}");

        let mut s = TestSeeds::new(0xab);
        let case = s.next_case();
        assert_eq!(
            s.replay(&case),
            format!("case seed {:#x}; replay: FLASHCORE_SEED=0xab", case.seed())
        );
    }
}
