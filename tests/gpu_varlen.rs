//! Variable-length forward attention on a GPU against the float64 reference, on both
//! kernel paths: packed sequences of ragged lengths (including empty ones, Sq > Sk and
//! Sq < Sk), causal and not, GQA, every sm90 head dim, with and without host copies of
//! the offsets. Run on a GPU machine with
//! `cargo test --release --test gpu_varlen -- --include-ignored`.
//!
//! Query rows no sequence covers (before the first and after the last) must stay
//! poisoned; key rows there hold ±200, or NaN and ±∞, so a kernel that reads them
//! unmasked fails by far, and one that lets the masked tail of a tile (the sm90 path's
//! TMA tiles run past a sequence's end) reach `0 · v` gives NaN.

mod common;

use std::sync::Arc;

use common::{down, loaded_ids, pick, ptr, random_len, random_window, seeds, up};
use cudarc::driver::{CudaSlice, CudaStream};
use flashcore::Error;
use flashcore::check::{LSE_TOLERANCE, tolerance};
use flashcore::host::attention::{Attention, PathChoice};
use flashcore::host::device::Device;
use flashcore::host::tensor::{AttentionParams, DType, LseView, TensorView, Window};
use flashcore::host::varlen::{Varlen, VarlenHost};
use flashcore::kernels::attention::HalfType;
use flashcore::reference::{self, RefParams, Rng, attention_f64_with, half_bits_to_f64, rel_l2};
use flashcore::shape::AttnShape;

fn setup(path: PathChoice) -> (Attention, Arc<CudaStream>) {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let stream = device.context().default_stream();
    let attn = Attention::new(device).expect("an sm_80+ GPU");
    (attn.with_path(path), stream)
}

/// One packed batch.
#[derive(Debug, Clone)]
struct Case {
    dtype: HalfType,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    /// (query rows, key rows) of each sequence.
    lens: Vec<(usize, usize)>,
    causal: bool,
    /// A key window around each query's diagonal.
    window: Window,
    /// Logit soft-capping.
    softcap: Option<f32>,
    /// Rows before the first sequence and after the last (no sequence covers them).
    gap: usize,
    /// Pass host copies of the offsets.
    host_check: bool,
    /// The gaps' keys and values are NaN and ±∞ rather than ±200: rows no sequence
    /// covers must not reach any output, not even as `0 · v`.
    non_finite_gaps: bool,
    /// O's heads are `head_dim + o_pad` elements apart: the columns past the head dim
    /// must keep their poison.
    o_pad: usize,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} Hq{} Hkv{} D{} lens {:?} gap {}{}{}{}",
            self.dtype.name(),
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            self.lens,
            self.gap,
            if self.non_finite_gaps {
                " (NaN/inf)"
            } else {
                ""
            },
            if self.causal { " causal" } else { "" },
            if self.host_check { " host-checked" } else { "" }
        )?;
        if let Some(cap) = self.softcap {
            write!(f, " softcap {cap}")?;
        }
        if self.window != Window::FULL {
            write!(f, " window {:?}", self.window)?;
        }
        match self.o_pad {
            0 => Ok(()),
            pad => write!(f, " O pitch D+{pad}"),
        }
    }
}

/// The packed tensors of a case, on the device and as exact values.
struct Packed {
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    o: CudaSlice<u16>,
    lse: CudaSlice<f32>,
    cu_q: Vec<i32>,
    cu_k: Vec<i32>,
    cu_q_dev: CudaSlice<i32>,
    cu_k_dev: CudaSlice<i32>,
    /// Per sequence: exact q `[sq, Hq, D]`, k and v `[sk, Hkv, D]`.
    seqs: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)>,
    total_q: usize,
    total_k: usize,
}

impl Packed {
    fn new(s: &Arc<CudaStream>, rng: &mut Rng, c: &Case) -> Packed {
        let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
        let garbage = |rng: &mut Rng, n| {
            let v: Vec<f64> = (0..n)
                .map(|i| match (c.non_finite_gaps, i % 3) {
                    (true, 0) => f64::NAN,
                    (true, 1) => f64::INFINITY,
                    (true, _) => f64::NEG_INFINITY,
                    _ if rng.uniform() < 0.5 => 200.0,
                    _ => -200.0,
                })
                .collect();
            reference::f64_to_half_bits(&v, c.dtype)
        };
        // A gap before the first sequence: random queries nobody computes, keys nobody
        // may read.
        let mut qb = reference::random_half(rng, c.gap * hq * d, c.dtype).0;
        let mut kb = garbage(rng, c.gap * hkv * d);
        let mut vb = garbage(rng, c.gap * hkv * d);
        let (mut cu_q, mut cu_k) = (vec![], vec![]);
        let mut seqs = Vec::new();
        for &(sq, sk) in &c.lens {
            cu_q.push((qb.len() / (hq * d)) as i32);
            cu_k.push((kb.len() / (hkv * d)) as i32);
            let (q_bits, q) = reference::random_half(rng, sq * hq * d, c.dtype);
            let (k_bits, k) = reference::random_half(rng, sk * hkv * d, c.dtype);
            let (v_bits, v) = reference::random_half(rng, sk * hkv * d, c.dtype);
            qb.extend(q_bits);
            kb.extend(k_bits);
            vb.extend(v_bits);
            seqs.push((q, k, v));
        }
        cu_q.push((qb.len() / (hq * d)) as i32);
        cu_k.push((kb.len() / (hkv * d)) as i32);
        // A trailing gap too: the last sequence's tail must not be read from it either.
        qb.extend(reference::random_half(rng, c.gap * hq * d, c.dtype).0);
        kb.extend(garbage(rng, c.gap * hkv * d));
        vb.extend(garbage(rng, c.gap * hkv * d));
        let (total_q, total_k) = (qb.len() / (hq * d), kb.len() / (hkv * d));
        Packed {
            q: up(s, &qb),
            k: up(s, &kb),
            v: up(s, &vb),
            o: up(
                s,
                &vec![reference::poison(c.dtype); total_q * hq * (d + c.o_pad)],
            ),
            lse: up(s, &vec![f32::NAN; hq * total_q]),
            cu_q_dev: up(s, &cu_q),
            cu_k_dev: up(s, &cu_k),
            cu_q,
            cu_k,
            seqs,
            total_q,
            total_k,
        }
    }

    fn views(&self, s: &Arc<CudaStream>, c: &Case) -> [TensorView; 4] {
        let dt = DType::from(c.dtype);
        let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
        [
            TensorView::bshd(ptr(s, &self.q), dt, 1, self.total_q, hq, d),
            TensorView::bshd(ptr(s, &self.k), dt, 1, self.total_k, hkv, d),
            TensorView::bshd(ptr(s, &self.v), dt, 1, self.total_k, hkv, d),
            {
                let pitch = d + c.o_pad;
                let strides = [self.total_q * hq * pitch, hq * pitch, pitch, 1];
                TensorView::strided(ptr(s, &self.o), dt, [1, self.total_q, hq, d], strides)
            },
        ]
    }

    fn varlen(&self, s: &Arc<CudaStream>, c: &Case) -> Varlen<'_> {
        let max_q = c.lens.iter().map(|l| l.0).max().unwrap_or(0).max(1);
        Varlen {
            cu_seqlens_q: ptr(s, &self.cu_q_dev),
            cu_seqlens_k: ptr(s, &self.cu_k_dev),
            batch: c.lens.len(),
            max_seqlen_q: max_q,
            host: c.host_check.then_some(VarlenHost {
                cu_seqlens_q: &self.cu_q,
                cu_seqlens_k: &self.cu_k,
            }),
        }
    }
}

/// Runs one case and returns (out error, lse error); panics on an untouched row written
/// or a covered row left unwritten.
fn run(attn: &Attention, s: &Arc<CudaStream>, rng: &mut Rng, c: &Case) -> (f64, f64) {
    let p = Packed::new(s, rng, c);
    let [q, k, v, o] = p.views(s, c);
    let lse = LseView {
        ptr: ptr(s, &p.lse),
    };
    let params = AttentionParams {
        softmax_scale: None,
        causal: c.causal,
        window: c.window,
        softcap: c.softcap,
    };
    // SAFETY: every view and offset array is a live allocation of this context with the
    // extents given; the default stream orders the call before the downloads.
    unsafe {
        attn.forward_varlen(
            &q,
            &k,
            &v,
            &o,
            Some(&lse),
            &p.varlen(s, c),
            &params,
            std::ptr::null_mut(),
        )
    }
    .unwrap_or_else(|e| panic!("{c}: {e}"));
    let o_bits = down(s, &p.o);
    let lse_got = down(s, &p.lse);

    let (hq, hkv, d) = (c.heads_q, c.heads_kv, c.head_dim);
    let poison = reference::poison(c.dtype);
    // O's heads without their padding columns, which must keep their poison.
    let pitch = d + c.o_pad;
    let o_bits: Vec<u16> = o_bits
        .chunks(pitch)
        .enumerate()
        .flat_map(|(i, head)| {
            assert!(
                head[d..].iter().all(|&x| x == poison),
                "{c}: columns past the head dim written (row {}, head {})",
                i / hq,
                i % hq
            );
            head[..d].to_vec()
        })
        .collect();
    let scale = 1.0 / (d as f64).sqrt();
    let (mut worst, mut lse_g, mut lse_w) = (0.0f64, vec![], vec![]);
    let mut covered = vec![false; p.total_q];
    for (b, &(sq, sk)) in c.lens.iter().enumerate() {
        let start = p.cu_q[b] as usize;
        covered[start..start + sq].fill(true);
        let shape = AttnShape {
            batch: 1,
            seqlen_q: sq,
            seqlen_k: sk,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
        };
        let (qs, ks, vs) = &p.seqs[b];
        let params = RefParams {
            scale,
            causal: c.causal,
            window: c.window,
            softcap: c.softcap.map(f64::from),
        };
        let r = attention_f64_with(&shape, qs, ks, vs, &params);
        let rows = &o_bits[start * hq * d..(start + sq) * hq * d];
        // Each sequence on its own: one with few keys (large, nearly exact outputs)
        // would dwarf a long one's errors in one norm over the batch.
        let e = rel_l2(&half_bits_to_f64(rows, c.dtype), &r.out);
        worst = if worst.is_nan() || e.is_nan() {
            f64::NAN
        } else {
            worst.max(e)
        };
        for h in 0..hq {
            for i in 0..sq {
                lse_g.push(lse_got[h * p.total_q + start + i] as f64);
                lse_w.push(r.lse[h * sq + i]);
            }
        }
    }
    for (row, &cov) in covered.iter().enumerate() {
        if cov {
            continue;
        }
        let bits = &o_bits[row * hq * d..(row + 1) * hq * d];
        assert!(
            bits.iter().all(|&x| x == poison),
            "{c}: row {row} belongs to no sequence but was written"
        );
        for h in 0..hq {
            assert!(
                lse_got[h * p.total_q + row].is_nan(),
                "{c}: lse of row {row} (no sequence) was written"
            );
        }
    }
    (worst, rel_l2(&lse_g, &lse_w))
}

fn run_cases(path: PathChoice, cases: &[Case]) {
    let (attn, s) = setup(path);
    let mut seeds = seeds();
    for c in cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let (out, lse) = run(&attn, &s, &mut rng, c);
        println!("{path:?} {c}: out {out:.2e} lse {lse:.2e}");
        let tol = tolerance(c.dtype);
        assert!(
            out <= tol && lse <= LSE_TOLERANCE,
            "{path:?} {c}: out {out:.2e} lse {lse:.2e} ({replay})"
        );
    }
}

/// Ragged lengths: single tokens, empty sequences on either side, Sq > Sk and Sq < Sk,
/// non-multiples of every tile, a long key sequence, one query against 32768 keys.
fn ragged() -> Vec<(usize, usize)> {
    vec![
        (1, 1),
        (7, 7),
        (0, 5),
        (5, 0),
        (17, 300),
        (113, 113),
        (300, 17),
        (1023, 1023),
        (64, 4097),
        (1, 32768),
        (4097, 64),
    ]
}

fn grid(path: PathChoice, dtype: HalfType) {
    let mut cases = Vec::new();
    for causal in [false, true] {
        for (hq, hkv, d) in [(4, 2, 128), (8, 1, 64), (2, 2, 256)] {
            cases.push(Case {
                dtype,
                heads_q: hq,
                heads_kv: hkv,
                head_dim: d,
                lens: ragged(),
                causal,
                window: Window::FULL,
                gap: 3,
                host_check: true,
                non_finite_gaps: false,
                o_pad: 0,
                softcap: None,
            });
        }
    }
    run_cases(path, &cases);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_ragged_best_path() {
    grid(PathChoice::Best, HalfType::F16);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_ragged_best_path() {
    grid(PathChoice::Best, HalfType::Bf16);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fp16_ragged_sm80_path() {
    grid(PathChoice::Sm80, HalfType::F16);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bf16_ragged_sm80_path() {
    grid(PathChoice::Sm80, HalfType::Bf16);
}

/// Packed batches shaped like decode steps (at most 16 queries a sequence, keys
/// averaging `FORWARD_DECODE_MIN_KEYS` or more, or `FORWARD_DECODE_MIN_KEYS_GQA` with
/// 128 KV heads of 4 query heads or more) run on the decode kernels' packed variants:
/// right for ragged lengths (one query against 32768 keys, sequences with no queries or
/// no keys, causal rows past their keys), GQA 1, 4 and 8, padded head dims, gaps of
/// NaN keys, with and without host copies (which change the splits), LSE included; no
/// forward kernel loaded. An Attention restricted to the sm80 path keeps its forward
/// kernels.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_shaped_batches_run_on_the_decode_kernels() {
    use flashcore::host::decode::{FORWARD_DECODE_MIN_KEYS, FORWARD_DECODE_MIN_KEYS_GQA};
    let min = FORWARD_DECODE_MIN_KEYS;
    let long_keys = [
        vec![(1, min), (1, 32768), (1, 1), (0, 3000), (1, 7)],
        vec![
            (16, 4097),
            (7, 3),
            (5, 0),
            (16, min + 1),
            (3, 4000),
            (13, 129),
        ],
    ];
    let mut cases = Vec::new();
    for (i, (hq, hkv, d)) in [
        (32, 8, 128),
        (8, 8, 64),
        (12, 4, 80),
        (4, 1, 256),
        (16, 2, 32),
    ]
    .into_iter()
    .enumerate()
    {
        for (j, lens) in long_keys.iter().enumerate() {
            for dtype in [HalfType::F16, HalfType::Bf16] {
                for causal in [false, true] {
                    let odd = (i + j + usize::from(causal)) % 2 == 1;
                    cases.push(Case {
                        dtype,
                        heads_q: hq,
                        heads_kv: hkv,
                        head_dim: d,
                        lens: lens.clone(),
                        causal,
                        window: Window::FULL,
                        gap: if odd { 3 } else { 0 },
                        host_check: odd == (dtype == HalfType::F16),
                        non_finite_gaps: odd,
                        o_pad: if d % 64 == 0 { 0 } else { 8 },
                        softcap: None,
                    });
                }
            }
        }
    }
    // Shorter keys where the batch has 128 KV heads or more, each of 4 query heads.
    let gqa = FORWARD_DECODE_MIN_KEYS_GQA;
    let mut seeds = seeds();
    let mut rng = seeds.next_case();
    let mut draw = |n: usize, most_q: u64| -> Vec<(usize, usize)> {
        (0..n)
            .map(|_| {
                let sq = 1 + (rng.next_u64() % most_q) as usize;
                (sq, gqa + (rng.next_u64() % 400) as usize)
            })
            .collect()
    };
    for (hq, hkv, lens, causal) in [
        (32, 8, draw(16, 16), true),
        (32, 8, draw(16, 1), false),
        (8, 1, draw(128, 3), true),
    ] {
        cases.push(Case {
            dtype: HalfType::Bf16,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: 128,
            lens,
            causal,
            window: Window::FULL,
            gap: 2,
            host_check: !causal,
            non_finite_gaps: true,
            o_pad: 0,
            softcap: None,
        });
    }
    let (attn, s) = setup(PathChoice::Best);
    let mut failures = Vec::new();
    for c in &cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let (out, lse) = run(&attn, &s, &mut rng, c);
        let line = format!("{c}: out {out:.2e} lse {lse:.2e} ({replay})");
        println!("{line}");
        let tol = tolerance(c.dtype);
        if !(out <= tol && lse <= LSE_TOLERANCE) {
            failures.push(line);
        }
    }
    assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
    let loaded: Vec<String> = attn.loaded_kernels().into_iter().map(|k| k.0).collect();
    let count = |prefix: &str| {
        loaded
            .iter()
            .filter(|id| id.starts_with(prefix) && id.contains("_packed"))
            .count()
    };
    assert!(
        count("attn_decode") > 0 && count("attn_merge") > 0,
        "loaded: {loaded:?}"
    );
    assert!(
        !loaded.iter().any(|id| id.starts_with("attn_fwd")),
        "loaded: {loaded:?}"
    );

    // Plain launches: the packed merge GPUs before Hopper run (a new Attention, whose
    // kernel cache holds none of the programmatic ones).
    let (plain, s) = setup(PathChoice::Best);
    let plain = plain.with_programmatic_launches(false);
    for c in cases.iter().step_by(4) {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let (out, lse) = run(&plain, &s, &mut rng, c);
        println!("plain launches, {c}: out {out:.2e} lse {lse:.2e} ({replay})");
        let tol = tolerance(c.dtype);
        assert!(
            out <= tol && lse <= LSE_TOLERANCE,
            "plain launches, {c} ({replay})"
        );
    }
    let merges = loaded_ids(&plain, "attn_merge");
    assert!(
        !merges.is_empty()
            && merges
                .iter()
                .all(|id| id.contains("_packed") && !id.contains("_pdl")),
        "merges: {merges:?}"
    );

    // The sm80 path keeps the forward kernels.
    let (sm80, s) = setup(PathChoice::Sm80);
    let mut rng = seeds.next_case();
    let (out, lse) = run(&sm80, &s, &mut rng, &cases[0]);
    assert!(out <= tolerance(cases[0].dtype) && lse <= LSE_TOLERANCE);
    let loaded: Vec<String> = sm80.loaded_kernels().into_iter().map(|k| k.0).collect();
    assert!(
        loaded.iter().all(|id| id.starts_with("attn_fwd")),
        "loaded: {loaded:?}"
    );
}

/// Head dims other than 64, 128 and 256, packed with no gaps, without host copies, on
/// both paths. On Hopper the sm90a path runs 32, 40, 80 and 96 padded onto its 64 and 128
/// kernels and 160 and 200 onto 192 and 256 (its direct stores of O skip the columns
/// past the head dim: O here has 8 more per head, which must keep their poison); the
/// sm80 path has 32, 96 and 192 of its own and pads the rest.
#[test]
#[ignore = "needs a CUDA GPU"]
fn other_head_dims_without_host_copies() {
    let mut cases = Vec::new();
    for d in [32, 40, 80, 96, 160, 192, 200] {
        for causal in [false, true] {
            cases.push(Case {
                dtype: if causal {
                    HalfType::Bf16
                } else {
                    HalfType::F16
                },
                heads_q: 4,
                heads_kv: 1,
                head_dim: d,
                lens: vec![(33, 200), (250, 250), (1, 1), (129, 64)],
                causal,
                window: Window::FULL,
                gap: 0,
                host_check: false,
                non_finite_gaps: false,
                o_pad: 8,
                softcap: None,
            });
        }
    }
    for path in [PathChoice::Best, PathChoice::Sm80] {
        run_cases(path, &cases);
    }
}

/// Many short sequences, as a serving batch of prompts has.
#[test]
#[ignore = "needs a CUDA GPU"]
fn many_short_sequences() {
    let mut seeds = seeds();
    let mut rng = seeds.next_case();
    let lens: Vec<(usize, usize)> = (0..64)
        .map(|_| {
            let n = 1 + (rng.next_u64() % 300) as usize;
            (n, n)
        })
        .collect();
    // At head dim 256 on Hopper the mean key count (under 512) picks 64-key tiles.
    for path in [PathChoice::Best, PathChoice::Sm80] {
        let cases: Vec<Case> = [(false, 128), (true, 128), (false, 256), (true, 256)]
            .into_iter()
            .map(|(causal, head_dim)| Case {
                dtype: HalfType::Bf16,
                heads_q: 8,
                heads_kv: 2,
                head_dim,
                lens: lens.clone(),
                causal,
                window: Window::FULL,
                gap: 0,
                host_check: true,
                non_finite_gaps: false,
                o_pad: 0,
                softcap: None,
            })
            .collect();
        run_cases(path, &cases);
    }
}

/// Work items that hold no query row: sequences without queries first, between and last
/// (in the causal schedule's tail too), and short sequences' empty query tiles beside a
/// long one, with enough heads that causal launches take their items from the counter,
/// whose producers pass the rest of a sequence without queries in one step.
#[test]
#[ignore = "needs a CUDA GPU"]
fn empty_work_items_are_passed_over() {
    let lens = vec![
        (0, 40),
        (0, 0),
        (1100, 1100),
        (70, 70),
        (0, 9),
        (1, 500),
        (300, 300),
        (0, 3000),
        (129, 129),
        (0, 64),
        (0, 1),
    ];
    let cases: Vec<Case> = [
        (false, 64),
        (true, 64),
        (false, 128),
        (true, 128),
        (true, 256),
    ]
    .into_iter()
    .map(|(causal, head_dim)| Case {
        dtype: HalfType::F16,
        heads_q: 16,
        heads_kv: 4,
        head_dim,
        lens: lens.clone(),
        causal,
        window: Window::FULL,
        gap: 2,
        host_check: !causal,
        non_finite_gaps: true,
        o_pad: 0,
        softcap: None,
    })
    .collect();
    run_cases(PathChoice::Best, &cases);
}

/// NaN and ±∞ in the key and value rows after the last sequence (a buffer larger than
/// the batch, never written): every tile that runs past a sequence's end, on every sm90
/// kernel (64-, 128- and 192-row tiles, split keys, head dims 64 to 256), must give
/// those rows weight 0 without computing `0 · v`. Every key count ends inside a tile;
/// the gap (200 rows) covers the whole tail of the last one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn non_finite_rows_after_the_sequences_stay_out() {
    let mut cases = Vec::new();
    for (hq, hkv, d, lens) in [
        (2, 1, 64, vec![(100, 77)]),
        (2, 1, 64, vec![(100, 1100)]),
        (4, 2, 64, vec![(300, 513), (64, 700)]),
        (64, 8, 64, vec![(700, 1100)]),
        (32, 8, 64, vec![(1200, 2100)]),
        (2, 2, 128, vec![(50, 200), (129, 77)]),
        (32, 8, 128, vec![(1000, 513)]),
        (2, 1, 256, vec![(77, 200)]),
        (16, 16, 256, vec![(600, 1100)]),
        // Padded kernels (sm90a: 40 and 80 on the 64 and 128 kernels, 160 on 192).
        (4, 2, 40, vec![(300, 513), (64, 700)]),
        (8, 2, 80, vec![(100, 1100), (129, 77)]),
        (4, 4, 160, vec![(200, 300)]),
    ] {
        for causal in [false, true] {
            cases.push(Case {
                dtype: if causal {
                    HalfType::Bf16
                } else {
                    HalfType::F16
                },
                heads_q: hq,
                heads_kv: hkv,
                head_dim: d,
                lens: lens.clone(),
                causal,
                window: Window::FULL,
                gap: 200,
                host_check: true,
                non_finite_gaps: true,
                o_pad: 0,
                softcap: None,
            });
        }
    }
    for path in [PathChoice::Best, PathChoice::Sm80] {
        run_cases(path, &cases);
    }
}

/// Packed batches with key windows (FlashAttention's `window_size`, per sequence,
/// bottom-right aligned): the ragged grid with sliding windows and two-sided ones on
/// both paths, then decode-shaped batches (up to 16 queries per sequence, which run on
/// the decode kernels) with random windows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn key_windows_in_packed_batches() {
    let mut cases = Vec::new();
    for (i, (causal, window)) in [
        (true, Window::sliding(1)),
        (true, Window::sliding(100)),
        (false, Window::from_flash(64, 64)),
        (false, Window::from_flash(-1, 0)),
        (false, Window::from_flash(300, -1)),
    ]
    .into_iter()
    .enumerate()
    {
        let (hq, hkv, d) = [(4, 2, 128), (8, 1, 64), (2, 2, 256)][i % 3];
        cases.push(Case {
            dtype: [HalfType::F16, HalfType::Bf16][i % 2],
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            lens: ragged(),
            causal,
            window,
            gap: 3,
            host_check: i % 2 == 0,
            non_finite_gaps: i % 2 == 1,
            o_pad: 0,
            softcap: None,
        });
    }
    let mut rng = Rng::new(seeds().run_seed().rotate_left(31) ^ 0x3D17);
    for i in 0..8 {
        let causal = i % 2 == 0;
        let lens = decode_shaped_lens(&mut rng, 1 + i % 4);
        cases.push(Case {
            dtype: [HalfType::F16, HalfType::Bf16][i % 2],
            heads_q: 8,
            heads_kv: [1, 2, 8][i % 3],
            head_dim: [64, 128, 96][i % 3],
            lens,
            causal,
            window: random_window(&mut rng, causal, 2000),
            gap: 1,
            host_check: i % 3 != 0,
            non_finite_gaps: true,
            o_pad: 0,
            softcap: None,
        });
    }
    for path in [PathChoice::Best, PathChoice::Sm80] {
        run_cases(path, &cases);
    }
}

/// Packed batches with soft-capped scores (Gemma 2's `attn_logit_softcapping`), with
/// and without causal masking and key windows: the ragged grid on both paths, then
/// decode-shaped batches, which run on the decode kernels.
#[test]
#[ignore = "needs a CUDA GPU"]
fn softcapped_scores_in_packed_batches() {
    let mut cases = Vec::new();
    let caps = [0.5f32, 2.0, 5.0, 50.0];
    for (i, (causal, window)) in [
        (false, Window::FULL),
        (true, Window::FULL),
        (true, Window::sliding(100)),
        (false, Window::from_flash(64, 64)),
    ]
    .into_iter()
    .enumerate()
    {
        let (hq, hkv, d) = [(4, 2, 128), (8, 1, 64), (2, 2, 256), (4, 1, 96)][i];
        cases.push(Case {
            dtype: [HalfType::F16, HalfType::Bf16][i % 2],
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
            lens: ragged(),
            causal,
            window,
            softcap: Some(caps[i]),
            gap: 3,
            host_check: i % 2 == 0,
            non_finite_gaps: i % 2 == 1,
            o_pad: 0,
        });
    }
    let mut rng = Rng::new(seeds().run_seed().rotate_left(37) ^ 0x5CA9);
    for i in 0..6 {
        let causal = i % 2 == 0;
        let lens = decode_shaped_lens(&mut rng, 1 + i % 4);
        cases.push(Case {
            dtype: [HalfType::F16, HalfType::Bf16][i % 2],
            heads_q: 8,
            heads_kv: [1, 2, 8][i % 3],
            head_dim: [64, 128, 256][i % 3],
            lens,
            causal,
            window: if i % 3 == 0 {
                random_window(&mut rng, causal, 2000)
            } else {
                Window::FULL
            },
            softcap: Some(caps[i % 4]),
            gap: 1,
            host_check: i % 3 != 0,
            non_finite_gaps: true,
            o_pad: 0,
        });
    }
    for path in [PathChoice::Best, PathChoice::Sm80] {
        run_cases(path, &cases);
    }
}

/// `count` sequences shaped like decode steps: 1 to 16 queries each against up to 3000
/// keys (a third at a tile edge).
fn decode_shaped_lens(rng: &mut Rng, count: usize) -> Vec<(usize, usize)> {
    (0..count)
        .map(|_| {
            let sk = random_len(rng, &EDGES, 3000);
            (1 + (rng.next_u64() % 16) as usize, sk)
        })
        .collect()
}

/// Lengths at the tiles' edges (64-row query tiles, 128-key tiles, 192-row tiles).
const EDGES: [usize; 12] = [0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193];

/// Random packed batches (drawn from the run's seed: a new `FLASHCORE_SEED` draws new
/// ones): 1 to 6 sequences with Sq = Sk or not, every head dim, GQA 1 to 8, causal or
/// not, gaps, with and without host copies, on both paths.
#[test]
#[ignore = "needs a CUDA GPU"]
fn random_packed_batches() {
    let mut rng = Rng::new(seeds().run_seed().rotate_left(29) ^ 0x7A21);
    let cases: Vec<Case> = (0..12)
        .map(|_| {
            let heads_kv = pick(&mut rng, &[1, 2]);
            let heads_q = heads_kv * pick(&mut rng, &[1, 2, 4, 8]).min(8 / heads_kv);
            let count = 1 + (rng.next_u64() % 6) as usize;
            let mut lens: Vec<(usize, usize)> = (0..count)
                .map(|_| {
                    let sq = random_len(&mut rng, &EDGES, 1200);
                    let sk = if rng.uniform() < 0.5 {
                        sq
                    } else {
                        random_len(&mut rng, &EDGES, 1200)
                    };
                    (sq, sk)
                })
                .collect();
            // Packed tensors of no rows at all are an empty dimension (refused): some
            // sequence has a query and a key.
            if lens.iter().all(|l| l.0 == 0) {
                lens[0].0 = 1;
            }
            if lens.iter().all(|l| l.1 == 0) {
                lens[0].1 = 1;
            }
            Case {
                dtype: if rng.uniform() < 0.5 {
                    HalfType::F16
                } else {
                    HalfType::Bf16
                },
                heads_q,
                heads_kv,
                head_dim: pick(&mut rng, &[32, 40, 64, 80, 96, 128, 160, 192, 200, 256]),
                lens,
                causal: rng.uniform() < 0.5,
                window: Window::FULL,
                gap: pick(&mut rng, &[0, 1, 5]),
                host_check: rng.uniform() < 0.5,
                non_finite_gaps: rng.uniform() < 0.5,
                o_pad: pick(&mut rng, &[0, 8]),
                softcap: None,
            }
        })
        .collect();
    for path in [PathChoice::Best, PathChoice::Sm80] {
        run_cases(path, &cases);
    }
}

/// A small batch shaped like a decode step, for compute-sanitizer: the decode kernels'
/// packed variants with one split and with several (host copies give the longest
/// sequence as the capacity, which changes the splits), sequences with no queries or no
/// keys, causal rows past their keys, gaps of NaN keys, a padded head dim.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_shaped_varlen_for_sanitizers() {
    let lens = vec![(1, 3000), (16, 5000), (0, 50), (3, 0), (16, 5)];
    let cases: Vec<Case> = [(false, 128, true), (true, 80, false), (true, 256, true)]
        .into_iter()
        .map(|(causal, d, host_check)| Case {
            dtype: if causal {
                HalfType::Bf16
            } else {
                HalfType::F16
            },
            heads_q: 8,
            heads_kv: 2,
            head_dim: d,
            lens: lens.clone(),
            causal,
            window: Window::FULL,
            gap: 4,
            host_check,
            non_finite_gaps: true,
            o_pad: if d % 64 == 0 { 0 } else { 8 },
            softcap: None,
        })
        .collect();
    run_cases(PathChoice::Best, &cases);
}

/// A small batch for compute-sanitizer: tails, gaps, an empty sequence, causal, GQA.
#[test]
#[ignore = "needs a CUDA GPU"]
fn varlen_small_for_sanitizers() {
    for path in [PathChoice::Best, PathChoice::Sm80] {
        let mut cases: Vec<Case> = [
            (false, 128),
            (true, 64),
            (true, 256),
            (true, 80),
            (false, 40),
        ]
        .into_iter()
        .map(|(causal, d)| Case {
            dtype: HalfType::F16,
            heads_q: 4,
            heads_kv: 2,
            head_dim: d,
            lens: vec![(3, 130), (0, 7), (150, 20)],
            causal,
            window: Window::FULL,
            gap: 5,
            host_check: false,
            non_finite_gaps: true,
            o_pad: if d % 64 == 0 { 0 } else { 8 },
            softcap: None,
        })
        .collect();
        // Enough heads for 128-row tiles at head dim 256 (64-key tiles on Hopper, the
        // keys being few): in (100, 100) the last key tile holds the sequence's end,
        // whose V rows past it both consumer warpgroups zero (in a packed batch neither
        // passes the tile by, though the first one's rows see none of it).
        cases.push(Case {
            heads_q: 36,
            heads_kv: 4,
            lens: vec![(100, 100), (3, 130), (150, 20)],
            ..cases[2].clone()
        });
        run_cases(path, &cases);
    }
}

/// Offsets the host checks are refused with nothing written; offsets it cannot check
/// (no host copies) keep the kernels inside the tensors (memcheck runs this test), on
/// the forward kernels and, for a batch shaped like a decode step, the decode kernels.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_offsets() {
    let c = Case {
        dtype: HalfType::F16,
        heads_q: 4,
        heads_kv: 2,
        head_dim: 128,
        lens: vec![(100, 100), (50, 300)],
        causal: true,
        window: Window::FULL,
        gap: 0,
        host_check: true,
        non_finite_gaps: false,
        o_pad: 0,
        softcap: None,
    };
    let (attn, _) = bad_offsets_on(
        &c,
        &[&[0, 120, 100], &[0, 100, 151], &[-3, 100, 150]],
        [[0, i32::MAX, -5], [i32::MIN, -1, i32::MAX], [150, 0, 0]],
        200,
    );
    assert!(
        attn.loaded_kernels()
            .iter()
            .all(|k| k.0.starts_with("attn_fwd"))
    );
    // 17 query rows against 5000 keys: the decode kernels.
    let c = Case {
        lens: vec![(1, 2000), (16, 3000)],
        ..c
    };
    let (attn, _) = bad_offsets_on(
        &c,
        &[&[0, 20, 17], &[0, 1, 18], &[-3, 1, 17]],
        [[0, i32::MAX, -5], [i32::MIN, -1, i32::MAX], [15, 0, 0]],
        16,
    );
    let loaded = attn.loaded_kernels();
    assert!(
        loaded.iter().all(|k| k.0.contains("_packed")),
        "loaded: {loaded:?}"
    );
}

/// Runs `c`'s batch with each of `bad` as the query offsets, checked (refused, nothing
/// written) and unchecked (runs, clamped), then with each of `absurd` as both offsets,
/// unchecked; `max_q` is the calls' `max_seqlen_q`.
fn bad_offsets_on(
    c: &Case,
    bad: &[&[i32]],
    absurd: [[i32; 3]; 3],
    max_q: usize,
) -> (Attention, Arc<CudaStream>) {
    let (attn, s) = setup(PathChoice::Best);
    let mut seeds = seeds();
    let mut rng = seeds.next_case();
    let mut p = Packed::new(&s, &mut rng, c);
    let [q, k, v, o] = p.views(&s, c);
    let params = AttentionParams::default();
    for &cu in bad {
        // Poisoned afresh (the unchecked call below writes o): a refused call must leave
        // every element as it was.
        let before = vec![reference::poison(c.dtype); p.o.len()];
        s.memcpy_htod(&before, &mut p.o).expect("poison o");
        let dev = up(&s, cu);
        let varlen = Varlen {
            cu_seqlens_q: ptr(&s, &dev),
            cu_seqlens_k: ptr(&s, &p.cu_k_dev),
            batch: 2,
            max_seqlen_q: max_q,
            host: Some(VarlenHost {
                cu_seqlens_q: cu,
                cu_seqlens_k: &p.cu_k,
            }),
        };
        // SAFETY: live allocations of this context with the extents given.
        let r = unsafe {
            attn.forward_varlen(&q, &k, &v, &o, None, &varlen, &params, std::ptr::null_mut())
        };
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{cu:?}: {r:?}");
        assert!(down(&s, &p.o) == before, "{cu:?}: a refused call wrote o");
        // Without host copies the same offsets run, clamped to the tensors.
        let unchecked = Varlen {
            host: None,
            ..varlen
        };
        // SAFETY: as above.
        unsafe {
            attn.forward_varlen(
                &q,
                &k,
                &v,
                &o,
                None,
                &unchecked,
                &params,
                std::ptr::null_mut(),
            )
        }
        .unwrap_or_else(|e| panic!("{cu:?} unchecked: {e}"));
        s.synchronize().expect("an unchecked call completes");
    }
    // Absurd device offsets: huge, negative, decreasing.
    for cu in absurd {
        let dev = up(&s, &cu);
        let varlen = Varlen {
            cu_seqlens_q: ptr(&s, &dev),
            cu_seqlens_k: ptr(&s, &dev),
            batch: 2,
            max_seqlen_q: max_q,
            host: None,
        };
        // SAFETY: as above.
        unsafe {
            attn.forward_varlen(&q, &k, &v, &o, None, &varlen, &params, std::ptr::null_mut())
        }
        .unwrap_or_else(|e| panic!("{cu:?}: {e}"));
        s.synchronize()
            .expect("a call with absurd offsets completes");
    }
    (attn, s)
}
