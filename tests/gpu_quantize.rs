//! FP8 quantization on the GPU against the CPU quantizer ([`flashcore::quant`]), bit for
//! bit (but for Hopper's tensor-core rotation, see [`compare_rotated`]): codes, scales,
//! `Vᵀ8` with its key permutation and zero padding, K's mean (to a tolerance: its sum order
//! is the atomics') and its rotation, `lse_shift`, smoothing and the Hadamard rotation; f16 and bf16, every FP8 head dim, sequence lengths around the 128-row
//! scale blocks, BSHD and BHSD inputs, blocks of zeros and outliers. The workspace is
//! poisoned first, so a byte the kernels should write and do not shows. Run on an sm_89+
//! GPU with `cargo test --release --test gpu_quantize -- --include-ignored`; on an older
//! GPU the tests say so and pass vacuously.

mod common;

use std::sync::Arc;

use common::{down, ptr, seeds, up};
use cudarc::driver::{CudaSlice, CudaStream};
use flashcore::Error;
use flashcore::host::attention::Attention;
use flashcore::host::decode::Workspace;
use flashcore::host::device::Device;
use flashcore::host::quantize::{Fp8Layout, QuantizeOptions, Region};
use flashcore::host::tensor::{DType, TensorView};
use flashcore::kernels::attention::HalfType;
use flashcore::kernels::attention::fp8::{SCALE_BLOCK, scale_blocks};
use flashcore::kernels::quantize::MEAN_ROW_BLOCKS;
use flashcore::quant::{
    self, Granularity, HadamardSigns, Quantized, RowTransform, dequantize_rows, dequantize_vt,
};
use flashcore::reference::{Rng, attention_f64, f64_to_half_bits, half_bits_to_f64, rel_l2};
use flashcore::shape::AttnShape;

/// What the poisoned workspace holds before the call: 0xFF is e4m3's NaN, which the
/// quantizer's saturating conversion never writes, so an unwritten code cannot pass for
/// a written one (0xCD could: a rotated code one rounding step from the reference's is
/// allowed, and that step can land on it), and four of them are an f32 NaN, which no
/// scale, mean or shift compares equal or close to.
const POISON: u8 = 0xFF;

/// The quantizer and a stream, or `None` (with a note) below sm_89.
fn setup() -> Option<(Attention, Arc<CudaStream>)> {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let stream = device.context().default_stream();
    let arch = device.compute_capability();
    if arch < (8, 9) {
        println!("skipped: sm_{}{} has no e4m3 conversion", arch.0, arch.1);
        return None;
    }
    Some((Attention::new(device).expect("an sm_80+ GPU"), stream))
}

/// How a case's inputs are filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    Random,
    /// Head 0's first scale block of Q, K and V all zeros.
    ZeroBlock,
    /// One element of Q, K and V a thousand times the rest (a block's amax).
    Outlier,
    /// An infinity in head 0's first block of Q, K and V and a NaN in the last head's:
    /// the scales and codes the docs give for non-finite inputs.
    NonFinite,
}

#[derive(Debug, Clone, Copy)]
struct Case {
    dtype: HalfType,
    shape: AttnShape,
    /// Q and V stored `[B, H, S, D]` (K stays `[B, S, H, D]`): strided views.
    bhsd: bool,
    fill: Fill,
    options: QuantizeOptions,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.shape;
        write!(
            f,
            "{} B{} Sq{} Sk{} Hq{} Hkv{} D{} {} {:?} smooth {} hadamard {:?}",
            self.dtype.name(),
            s.batch,
            s.seqlen_q,
            s.seqlen_k,
            s.heads_q,
            s.heads_kv,
            s.head_dim,
            if self.bhsd { "bhsd" } else { "bshd" },
            self.fill,
            self.options.smooth_k,
            self.options.hadamard_seed
        )
    }
}

/// One tensor's inputs: bits in logical `[B, S, H, D]` order and their exact values.
struct Input {
    bits: Vec<u16>,
    values: Vec<f32>,
    dims: [usize; 4],
}

impl Input {
    /// Normal draws plus `offset(channel)`, rounded to `dtype`, then `fill` applied.
    fn new(
        rng: &mut Rng,
        dims: [usize; 4],
        dtype: HalfType,
        fill: Fill,
        offset: impl Fn(usize) -> f64,
    ) -> Input {
        let [b, s, h, d] = dims;
        let mut draws: Vec<f64> = (0..b * s * h * d)
            .map(|i| rng.normal() + offset(i % d))
            .collect();
        let at = |bi: usize, si: usize, hi: usize| ((bi * s + si) * h + hi) * d;
        match fill {
            Fill::Random => {}
            Fill::ZeroBlock => {
                for si in 0..s.min(128) {
                    draws[at(0, si, 0)..at(0, si, 0) + d].fill(0.0);
                }
            }
            Fill::Outlier => {
                let row = if s > 128 { 130.min(s - 1) } else { s / 2 };
                draws[at(0, row, h - 1) + d / 3] = -1000.0;
            }
            Fill::NonFinite => {
                draws[at(0, s / 3, 0) + d / 3] = f64::INFINITY;
                draws[at(0, s / 2, h - 1) + d / 2] = f64::NAN;
            }
        }
        let bits = f64_to_half_bits(&draws, dtype);
        let values = half_bits_to_f64(&bits, dtype)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        Input { bits, values, dims }
    }

    /// The bits in memory order: `[B, S, H, D]`, or `[B, H, S, D]`.
    fn stored(&self, bhsd: bool) -> Vec<u16> {
        let [b, s, h, d] = self.dims;
        if !bhsd {
            return self.bits.clone();
        }
        let mut out = vec![0u16; self.bits.len()];
        for bi in 0..b {
            for si in 0..s {
                for hi in 0..h {
                    let from = ((bi * s + si) * h + hi) * d;
                    let to = ((bi * h + hi) * s + si) * d;
                    out[to..to + d].copy_from_slice(&self.bits[from..from + d]);
                }
            }
        }
        out
    }

    fn view(&self, ptr: u64, dtype: HalfType, bhsd: bool) -> TensorView {
        let [b, s, h, d] = self.dims;
        if bhsd {
            TensorView::bhsd(ptr, DType::from(dtype), b, s, h, d)
        } else {
            TensorView::bshd(ptr, DType::from(dtype), b, s, h, d)
        }
    }
}

/// A case on the device and what the quantizer wrote.
struct Run {
    q: Input,
    k: Input,
    v: Input,
    layout: Fp8Layout,
    /// The workspace after the call, from its (256-byte aligned) start.
    workspace: Vec<u8>,
    /// Q and K were rotated on the tensor cores (Hopper, the Hadamard option): their sums
    /// run in another order than the CPU's butterflies.
    tensor_cores: bool,
}

impl Run {
    fn bytes(&self, r: Region) -> &[u8] {
        &self.workspace[r.offset..r.offset + r.bytes]
    }

    fn f32s(&self, r: Region) -> Vec<f32> {
        self.bytes(r)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// A poisoned workspace of `bytes` bytes (plus room to align it) and its aligned start.
fn poisoned_workspace(s: &Arc<CudaStream>, bytes: usize) -> (CudaSlice<u8>, Workspace) {
    let buf = up(s, &vec![POISON; bytes + Fp8Layout::ALIGN]);
    let start = ptr(s, &buf).next_multiple_of(Fp8Layout::ALIGN as u64);
    (buf, Workspace { ptr: start, bytes })
}

fn run(attn: &Attention, s: &Arc<CudaStream>, rng: &mut Rng, c: &Case) -> Run {
    let sh = c.shape;
    let (b, d) = (sh.batch, sh.head_dim);
    let q = Input::new(
        rng,
        [b, sh.seqlen_q, sh.heads_q, d],
        c.dtype,
        c.fill,
        |_| 0.0,
    );
    // Keys with a per-channel offset, as real models' have: what smoothing removes.
    let bias: Vec<f64> = (0..d).map(|_| 3.0 * rng.normal()).collect();
    let k = Input::new(
        rng,
        [b, sh.seqlen_k, sh.heads_kv, d],
        c.dtype,
        c.fill,
        |ch| bias[ch],
    );
    let v = Input::new(
        rng,
        [b, sh.seqlen_k, sh.heads_kv, d],
        c.dtype,
        c.fill,
        |_| 0.0,
    );
    let q_dev = up(s, &q.stored(c.bhsd));
    let k_dev = up(s, &k.stored(false));
    let v_dev = up(s, &v.stored(c.bhsd));
    let layout = Fp8Layout::new(&sh, &c.options).expect("a layout");
    let (ws_dev, ws) = poisoned_workspace(s, layout.bytes);
    let views = [
        q.view(ptr(s, &q_dev), c.dtype, c.bhsd),
        k.view(ptr(s, &k_dev), c.dtype, false),
        v.view(ptr(s, &v_dev), c.dtype, c.bhsd),
    ];
    // SAFETY: the views and the workspace lie inside the buffers above, which live
    // until the download below (which synchronizes the stream).
    let ops = unsafe {
        attn.quantize_fp8(
            &views[0],
            &views[1],
            &views[2],
            &c.options,
            ws,
            s.cu_stream(),
        )
    }
    .unwrap_or_else(|e| panic!("{c}: {e}"));
    assert_eq!(ops.q.ptr, ws.ptr + layout.q.offset as u64);
    assert_eq!(ops.lse_shift.is_some(), c.options.smooth_k);
    let all = down(s, &ws_dev);
    let skip = (ws.ptr - ptr(s, &ws_dev)) as usize;
    Run {
        q,
        k,
        v,
        layout,
        workspace: all[skip..skip + layout.bytes].to_vec(),
        tensor_cores: attn.device().compute_capability() == (9, 0)
            && c.options.hadamard_seed.is_some(),
    }
}

/// Compares the quantizer's output with the CPU reference; `Err` says what differs.
fn check(c: &Case, r: &Run) -> Result<(), String> {
    let sh = c.shape;
    let d = sh.head_dim;
    let (q_dims, kv_dims) = (r.q.dims, r.k.dims);
    let signs = c
        .options
        .hadamard_seed
        .map(|seed| HadamardSigns::from_seed(seed, d));
    let mean = match r.layout.k_mean {
        Some(region) => {
            let got = r.f32s(region);
            let want = quant::key_mean(&r.k.values, kv_dims);
            let amax = r.k.values.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // f32 sums of at most a few thousand rows, in the atomics' order.
                // Written so that a NaN (an unwritten mean) is never close.
                let close = (g - w).abs() <= 1e-5 * amax.max(1.0);
                if !close {
                    return Err(format!("mean[{i}] = {g}, want {w}"));
                }
            }
            Some(got)
        }
        None => None,
    };
    if let Some(region) = r.layout.k_mean_tickets {
        // Every key-mean block took its (batch, head)'s ticket once, after the zeroing.
        let slab = (SCALE_BLOCK * MEAN_ROW_BLOCKS) as usize;
        let slabs = sh.seqlen_k.div_ceil(slab) as u32;
        let got = r.bytes(region);
        if let Some(i) = (0..got.len() / 4)
            .find(|&i| u32::from_le_bytes(got[4 * i..4 * i + 4].try_into().unwrap()) != slabs)
        {
            return Err(format!("k_mean_tickets[{i}] is not {slabs}"));
        }
    }
    if let (Some(region), Some(mean), Some(signs)) = (r.layout.k_mean_rotated, &mean, &signs) {
        // The butterflies in rotate_row's order: equal.
        let got = r.f32s(region);
        let mut want = mean.clone();
        want.chunks_exact_mut(d)
            .for_each(|row| quant::rotate_row(row, signs));
        if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
            return Err(format!("rotated mean[{i}] = {}, want {}", got[i], want[i]));
        }
    }
    if let (Some(region), Some(mean)) = (r.layout.lse_shift, &mean) {
        let got = r.f32s(region);
        let want = quant::lse_shift(&r.q.values, q_dims, mean, sh.heads_kv);
        // The kernel's order of operations is the reference's: equal (±0 aside).
        if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
            return Err(format!("lse_shift[{i}] = {}, want {}", got[i], want[i]));
        }
    }
    let q_ref = quant::quantize_rows_with(
        &r.q.values,
        q_dims,
        Granularity::PerBlock,
        RowTransform {
            mean: None,
            hadamard: signs.as_ref(),
        },
    );
    let k_ref = quant::quantize_rows_with(
        &r.k.values,
        kv_dims,
        Granularity::PerBlock,
        RowTransform {
            mean: mean.as_deref(),
            hadamard: signs.as_ref(),
        },
    );
    let v_ref = quant::quantize_vt(
        &r.v.values,
        kv_dims,
        r.layout.vt_pitch,
        Granularity::PerBlock,
    );
    let l = &r.layout;
    for (name, want, codes, scales) in [
        ("q", &q_ref, l.q, l.q_scale),
        ("k", &k_ref, l.k, l.k_scale),
        ("vt", &v_ref, l.vt, l.v_scale),
    ] {
        if r.tensor_cores && name != "vt" {
            let input = if name == "q" { &r.q } else { &r.k };
            let largest = input.values.iter().fold(0f32, |m, x| m.max(x.abs()));
            // f32 sums of D terms of at most `largest` (K's mean is subtracted after
            // them), scaled by 1/sqrt(D): each value within D·eps of that, and the
            // scale within that over 448.
            let slack = d as f32 * f32::EPSILON * largest / (d as f32).sqrt() / 448.0;
            compare_rotated(name, want, r.bytes(codes), &r.f32s(scales), slack)?;
        } else {
            compare(name, want, r.bytes(codes), &r.f32s(scales))?;
        }
    }
    // A block of zeros gets scale 1 (and zero codes, compared above).
    if c.fill == Fill::ZeroBlock {
        let first = r.f32s(l.q_scale)[0];
        if first != 1.0 {
            return Err(format!("q's zero block has scale {first}"));
        }
    }
    // A block holding an infinity keeps the scale of its finite elements (its codes,
    // NaN for the infinity, compared above).
    if c.fill == Fill::NonFinite {
        let first = r.f32s(l.q_scale)[0];
        if !first.is_finite() {
            return Err(format!("q's block with an infinity has scale {first}"));
        }
    }
    Ok(())
}

fn compare(name: &str, want: &Quantized, codes: &[u8], scales: &[f32]) -> Result<(), String> {
    if let Some(i) = (0..codes.len()).find(|&i| codes[i] != want.codes[i]) {
        let unwritten = if codes[i] == POISON {
            " (never written)"
        } else {
            ""
        };
        return Err(format!(
            "{name} code {i} is {:#04x}{unwritten}, want {:#04x}",
            codes[i], want.codes[i]
        ));
    }
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits();
    if let Some(i) = (0..scales.len()).find(|&i| !same(scales[i], want.scales[i])) {
        return Err(format!(
            "{name} scale {i} is {}, want {}",
            scales[i], want.scales[i]
        ));
    }
    Ok(())
}

/// [`compare`] for rows rotated on the tensor cores: the f32 sums agree with the CPU's
/// to rounding, so a scale may differ in its last bits (4 ulp, plus `slack`: the sums'
/// rounding bound over 448) and a code by one step (same sign, or both within one step
/// of zero), and only rarely: a value must sit within f32 rounding of a boundary between
/// codes.
fn compare_rotated(
    name: &str,
    want: &Quantized,
    codes: &[u8],
    scales: &[f32],
    slack: f32,
) -> Result<(), String> {
    for (i, (&got, &w)) in scales.iter().zip(&want.scales).enumerate() {
        // Written so that a NaN is never close.
        let close = (got - w).abs() <= 4.0 * f32::EPSILON * w.abs() + slack;
        if !close {
            return Err(format!("{name} scale {i} is {got}, want {w}"));
        }
    }
    let mut differ = 0usize;
    for (i, (&got, &w)) in codes.iter().zip(&want.codes).enumerate() {
        if got == w {
            continue;
        }
        let (mg, mw) = (got & 0x7f, w & 0x7f);
        if mg == 0 && mw == 0 {
            // +0 and −0: a zero sum's sign follows the order of the additions.
            continue;
        }
        let same_sign = (got ^ w) & 0x80 == 0;
        let adjacent = mg.abs_diff(mw) <= 1 && (same_sign || (mg <= 1 && mw <= 1));
        if !adjacent || got == POISON {
            return Err(format!(
                "{name} code {i} is {got:#04x}, want {w:#04x} (more than one step apart)"
            ));
        }
        differ += 1;
    }
    // One in a thousand codes at most (and always one).
    if differ > 1 + codes.len() / 1000 {
        return Err(format!(
            "{name}: {differ} of {} codes one step from the reference",
            codes.len()
        ));
    }
    if differ > 0 {
        println!(
            "{name}: {differ} of {} codes one step from the reference",
            codes.len()
        );
    }
    Ok(())
}

fn run_all(cases: &[Case]) {
    let Some((attn, s)) = setup() else { return };
    let mut seeds = seeds();
    let mut failures = Vec::new();
    for c in cases {
        let mut rng = seeds.next_case();
        let r = run(&attn, &s, &mut rng, c);
        if let Err(why) = check(c, &r) {
            failures.push(format!("{c}: {why} ({})", seeds.replay(&rng)));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from flashcore::quant:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

fn shape(b: usize, sq: usize, sk: usize, hq: usize, hkv: usize, d: usize) -> AttnShape {
    AttnShape {
        batch: b,
        seqlen_q: sq,
        seqlen_k: sk,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
    }
}

const SEQLENS: [usize; 6] = [1, 17, 128, 129, 1023, 4097];

#[test]
#[ignore = "needs a CUDA GPU"]
fn codes_scales_and_vt_match_the_cpu_quantizer_bit_for_bit() {
    let mut cases = Vec::new();
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for d in [64, 128, 256] {
            for (i, &sk) in SEQLENS.iter().enumerate() {
                // Q's length runs through the list in another order, so Sq != Sk.
                let sq = SEQLENS[(i + 2) % SEQLENS.len()];
                cases.push(Case {
                    dtype,
                    shape: shape(2, sq, sk, 4, 2, d),
                    bhsd: i % 2 == 1,
                    fill: Fill::Random,
                    options: QuantizeOptions::default(),
                });
            }
        }
    }
    run_all(&cases);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_blocks_and_outliers() {
    let mut cases = Vec::new();
    for fill in [Fill::ZeroBlock, Fill::Outlier] {
        for (dtype, d, s) in [
            (HalfType::F16, 64, 129),
            (HalfType::Bf16, 128, 300),
            (HalfType::F16, 256, 128),
        ] {
            for (smooth_k, rotate) in [(false, false), (true, true), (false, true)] {
                cases.push(Case {
                    dtype,
                    shape: shape(1, s, s, 2, 2, d),
                    bhsd: false,
                    fill,
                    options: QuantizeOptions {
                        smooth_k,
                        hadamard_seed: rotate.then_some(3),
                    },
                });
            }
        }
    }
    // Non-finite inputs: no option (the key mean and the rotation would spread them).
    for (dtype, d, s) in [(HalfType::F16, 64, 129), (HalfType::Bf16, 128, 300)] {
        cases.push(Case {
            dtype,
            shape: shape(1, s, s, 2, 2, d),
            bhsd: false,
            fill: Fill::NonFinite,
            options: QuantizeOptions::default(),
        });
    }
    run_all(&cases);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn smoothing_and_hadamard_match_the_cpu_reference() {
    let mut cases = Vec::new();
    let mut seed = 0x5EED;
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for d in [64, 128, 256] {
            for (smooth_k, rotate) in [(true, false), (false, true), (true, true)] {
                // 4500 rows: more 128-row items than a wave of the persistent rotated
                // kernels holds (two blocks per SM at D = 64), so blocks loop.
                let lengths = [(17, 1023), (129, 17), (4097, 128), (4500, 4500)];
                for (i, (sq, sk)) in lengths.into_iter().enumerate() {
                    seed += 1;
                    cases.push(Case {
                        dtype,
                        shape: shape(2, sq, sk, 4, 2, d),
                        bhsd: i == 1,
                        fill: Fill::Random,
                        options: QuantizeOptions {
                            smooth_k,
                            hadamard_seed: rotate.then_some(seed),
                        },
                    });
                }
            }
        }
    }
    run_all(&cases);
}

/// Attention in float64 on the dequantized operands, with each option, against attention
/// on the 16-bit inputs: the same output (to FP8's precision), and the same log-sum-exp
/// once `lse_shift` (times the softmax scale) is added back.
#[test]
#[ignore = "needs a CUDA GPU"]
fn options_leave_attention_unchanged() {
    let Some((attn, s)) = setup() else { return };
    let mut seeds = seeds();
    let sh = shape(1, 70, 200, 4, 2, 64);
    let scale = 1.0 / (sh.head_dim as f64).sqrt();
    for options in [
        QuantizeOptions::default(),
        QuantizeOptions {
            smooth_k: true,
            hadamard_seed: None,
        },
        QuantizeOptions {
            smooth_k: false,
            hadamard_seed: Some(11),
        },
        QuantizeOptions {
            smooth_k: true,
            hadamard_seed: Some(12),
        },
    ] {
        let mut rng = seeds.next_case();
        let c = Case {
            dtype: HalfType::Bf16,
            shape: sh,
            bhsd: false,
            fill: Fill::Random,
            options,
        };
        let r = run(&attn, &s, &mut rng, &c);
        let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
        let exact = attention_f64(
            &sh,
            &f64s(&r.q.values),
            &f64s(&r.k.values),
            &f64s(&r.v.values),
            scale,
            false,
        );
        let l = &r.layout;
        let blocks = |s: usize| sh.batch * scale_blocks(s as u32) as usize;
        let q8 = Quantized {
            codes: r.bytes(l.q).to_vec(),
            scales: r.f32s(l.q_scale),
        };
        let k8 = Quantized {
            codes: r.bytes(l.k).to_vec(),
            scales: r.f32s(l.k_scale),
        };
        let v8 = Quantized {
            codes: r.bytes(l.vt).to_vec(),
            scales: r.f32s(l.v_scale),
        };
        assert_eq!(q8.scales.len(), blocks(sh.seqlen_q) * sh.heads_q);
        let got = attention_f64(
            &sh,
            &dequantize_rows(&q8, r.q.dims),
            &dequantize_rows(&k8, r.k.dims),
            &dequantize_vt(&v8, r.v.dims, l.vt_pitch),
            scale,
            false,
        );
        let err = rel_l2(&got.out, &exact.out);
        // E4M3's 3 mantissa bits cost about 2.4% (rms) on every operand: on normal draws
        // the output is off by 4–5% whatever the options. Keys with a 3σ per-channel
        // offset, unsmoothed, round coarser (8–10% on the CPU quantizer, same codes).
        let bound = if options.smooth_k { 0.065 } else { 0.15 };
        assert!(
            err < bound,
            "{c}: output error {err} ({})",
            seeds.replay(&rng)
        );
        let shift = l.lse_shift.map(|region| r.f32s(region));
        let worst = got
            .lse
            .iter()
            .zip(&exact.lse)
            .enumerate()
            .map(|(i, (&lse, &want))| {
                let lse = lse + shift.as_ref().map_or(0.0, |s| scale * s[i] as f64);
                (lse - want).abs()
            })
            // f64::max drops NaN; a NaN here must fail the bound below.
            .fold(0f64, |m, e| {
                if m.is_nan() || e.is_nan() {
                    f64::NAN
                } else {
                    m.max(e)
                }
            });
        // Without smoothing the keys' offset coarsens their codes.
        let tolerance = if options.smooth_k { 0.05 } else { 0.3 };
        assert!(
            worst < tolerance,
            "{c}: log-sum-exp off by {worst} ({})",
            seeds.replay(&rng)
        );
    }
}

/// Bad calls return typed errors before anything runs: the poisoned workspace stays as
/// it was.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_is_refused_and_nothing_written() {
    let Some((attn, s)) = setup() else { return };
    let sh = shape(1, 64, 64, 2, 1, 64);
    let options = QuantizeOptions {
        smooth_k: true,
        hadamard_seed: Some(1),
    };
    let layout = Fp8Layout::new(&sh, &options).unwrap();
    let (ws_dev, ws) = poisoned_workspace(&s, layout.bytes);
    let data = up(&s, &vec![0x3C00u16; 3 * 64 * 2 * 64]);
    let base = ptr(&s, &data);
    let q = TensorView::bshd(base, DType::F16, 1, 64, 2, 64);
    let k = TensorView::bshd(base + 2 * 64 * 2 * 64, DType::F16, 1, 64, 1, 64);
    let v = TensorView::bshd(base + 3 * 64 * 2 * 64, DType::F16, 1, 64, 1, 64);
    let call = |q: &TensorView, k: &TensorView, v: &TensorView, ws: Workspace| {
        // SAFETY: every view that passes validation lies inside `data`, and the
        // workspace inside `ws_dev`; both outlive the download below.
        unsafe { attn.quantize_fp8(q, k, v, &options, ws, s.cu_stream()) }
    };
    let bf = TensorView {
        dtype: DType::Bf16,
        ..v
    };
    assert!(matches!(
        call(&q, &k, &bf, ws),
        Err(Error::UnsupportedDType(_))
    ));
    let small = Workspace {
        bytes: layout.bytes - 1,
        ..ws
    };
    assert!(matches!(
        call(&q, &k, &v, small),
        Err(Error::InvalidArgument(_))
    ));
    let over = Workspace { ptr: base, ..ws };
    assert!(call(&q, &k, &v, over).is_err());
    let odd = TensorView {
        ptr: q.ptr + 2,
        ..q
    };
    assert!(matches!(
        call(&odd, &k, &v, ws),
        Err(Error::Misaligned { .. })
    ));
    let after = down(&s, &ws_dev);
    assert!(
        after.iter().all(|&b| b == POISON),
        "a refused call wrote to the workspace"
    );
    // The same call, valid, writes it.
    call(&q, &k, &v, ws).expect("a valid call");
    let after = down(&s, &ws_dev);
    assert!(after.iter().any(|&b| b != POISON));
}
