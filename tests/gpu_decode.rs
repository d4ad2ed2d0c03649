//! Serving kernels on a GPU against the float64 reference: split-KV decode over
//! contiguous and paged caches with ragged lengths, appending to caches, and merging
//! partial results by their LSE. Run on a GPU machine with
//! `cargo test --release --test gpu_decode -- --include-ignored`.
//!
//! Cache positions past a sequence's length, and pool pages no sequence uses, hold large
//! values (±200) and NaN: a kernel that reads them where it should not fails by far, even
//! behind a mask (see [`garbage`]). Outputs are
//! poisoned (NaN) before each call, so an unwritten element fails too.

mod common;

use std::sync::Arc;

use common::{down, loaded_ids, pick, ptr, random_len, random_window, seeds, up};
use cudarc::driver::{CudaSlice, CudaStream};
use flashcore::Error;
use flashcore::check::tolerance;
use flashcore::host::attention::{Attention, PathChoice};
use flashcore::host::decode::{MergeParts, Workspace};
use flashcore::host::decode_varlen::PackedQueries;
use flashcore::host::device::Device;
use flashcore::host::kv_cache::{CacheLayout, HostMetadata, KvCache, KvScales};
use flashcore::host::tensor::{AttentionParams, DType, LseView, TensorView, Window};
use flashcore::kernels::attention::HalfType;
use flashcore::quant;
use flashcore::reference::{
    self, RefParams, Rng, attention_f64, attention_f64_with, half_bits_to_f64, rel_l2,
};
use flashcore::shape::AttnShape;

fn setup() -> (Attention, Arc<CudaStream>) {
    let device = Arc::new(Device::new(0).expect("a CUDA device"));
    let stream = device.context().default_stream();
    (Attention::new(device).expect("an sm_80+ GPU"), stream)
}

fn dtype_of(h: HalfType) -> DType {
    DType::from(h)
}

/// Large values and NaN, in `dtype`, for cache slots no call may read: a key read by
/// mistake moves the result, and a value behind a masked key (weight 0, but 0 · NaN is
/// NaN) poisons it.
fn garbage(rng: &mut Rng, n: usize, dtype: HalfType) -> Vec<u16> {
    let v: Vec<f64> = (0..n)
        .map(|_| match rng.uniform() {
            u if u < 0.25 => f64::NAN,
            u if u < 0.625 => 200.0,
            _ => -200.0,
        })
        .collect();
    reference::f64_to_half_bits(&v, dtype)
}

/// One decode case.
#[derive(Debug, Clone)]
struct Case {
    dtype: HalfType,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    seqlen_q: usize,
    lens: Vec<usize>,
    /// 0: contiguous; otherwise the page size.
    page: usize,
    causal: bool,
    /// A key window around each query's position.
    window: Window,
    /// Logit soft-capping.
    softcap: Option<f32>,
    /// Give the call host copies of the metadata.
    host_check: bool,
    /// Pass a workspace instead of letting the call allocate.
    workspace: bool,
    /// Elements between one row of O's head dim and the next row (a view into a wider
    /// tensor): they must keep their poison.
    o_gap: usize,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} Hq{} Hkv{} D{} Sq{} lens {:?} {}{}",
            self.dtype.name(),
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            self.seqlen_q,
            self.lens,
            if self.page == 0 {
                "contiguous".to_string()
            } else {
                format!("page {}", self.page)
            },
            if self.causal { " causal" } else { "" }
        )?;
        if self.window != Window::FULL {
            write!(f, " window {:?}", self.window)?;
        }
        if let Some(cap) = self.softcap {
            write!(f, " softcap {cap}")?;
        }
        if self.o_gap > 0 {
            write!(f, " o gap {}", self.o_gap)?;
        }
        Ok(())
    }
}

/// A cache on the device with the exact values of what each sequence holds.
struct DeviceCache {
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    seqlens: CudaSlice<i32>,
    table: Option<CudaSlice<i32>>,
    host_table: Vec<i32>,
    host_lens: Vec<i32>,
    /// `keys[b]`, `values[b]`: `[capacity, Hkv, D]` exact values, position-major.
    keys: Vec<Vec<f64>>,
    values: Vec<Vec<f64>>,
    capacity: usize,
    pool_pages: usize,
    max_pages: usize,
}

impl DeviceCache {
    /// Random N(0, 1) keys and values for every sequence up to `capacity` positions.
    fn new(
        s: &Arc<CudaStream>,
        rng: &mut Rng,
        c: &Case,
        capacity: usize,
        lens: &[usize],
    ) -> DeviceCache {
        let (hkv, d, b) = (c.heads_kv, c.head_dim, lens.len());
        let row = hkv * d;
        let mut keys = Vec::new();
        let mut values = Vec::new();
        let mut kb = Vec::new();
        let mut vb = Vec::new();
        for &len in lens {
            let (kbits, kv) = reference::random_half(rng, len * row, c.dtype);
            let (vbits, vv) = reference::random_half(rng, len * row, c.dtype);
            let mut kbits = kbits;
            let mut vbits = vbits;
            kbits.extend(garbage(rng, (capacity - len) * row, c.dtype));
            vbits.extend(garbage(rng, (capacity - len) * row, c.dtype));
            keys.push(kv);
            values.push(vv);
            kb.push(kbits);
            vb.push(vbits);
        }
        let host_lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        if c.page == 0 {
            return DeviceCache {
                k: up(s, &kb.concat()),
                v: up(s, &vb.concat()),
                seqlens: up(s, &host_lens),
                table: None,
                host_table: Vec::new(),
                host_lens,
                keys,
                values,
                capacity,
                pool_pages: 0,
                max_pages: 0,
            };
        }
        // Pages in a shuffled pool with spare pages of garbage between them.
        let max_pages = capacity.div_ceil(c.page);
        let used = b * max_pages;
        let pool_pages = used + used / 2 + 1;
        let mut order: Vec<usize> = (0..pool_pages).collect();
        for i in (1..order.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let page_elems = c.page * row;
        let mut kpool = garbage(rng, pool_pages * page_elems, c.dtype);
        let mut vpool = garbage(rng, pool_pages * page_elems, c.dtype);
        let mut table = vec![-1i32; b * max_pages];
        for seq in 0..b {
            for p in 0..max_pages {
                let page = order[seq * max_pages + p];
                table[seq * max_pages + p] = page as i32;
                for r in 0..c.page {
                    let pos = p * c.page + r;
                    if pos >= capacity {
                        break;
                    }
                    let src = pos * row;
                    let dst = page * page_elems + r * row;
                    kpool[dst..dst + row].copy_from_slice(&kb[seq][src..src + row]);
                    vpool[dst..dst + row].copy_from_slice(&vb[seq][src..src + row]);
                }
            }
        }
        DeviceCache {
            k: up(s, &kpool),
            v: up(s, &vpool),
            seqlens: up(s, &host_lens),
            table: Some(up(s, &table)),
            host_table: table,
            host_lens,
            keys,
            values,
            capacity,
            pool_pages,
            max_pages,
        }
    }

    fn view(&self, s: &Arc<CudaStream>, c: &Case) -> KvCache {
        let dt = dtype_of(c.dtype);
        let (k, v, layout) = match &self.table {
            None => {
                let b = self.keys.len();
                (
                    TensorView::bshd(
                        ptr(s, &self.k),
                        dt,
                        b,
                        self.capacity,
                        c.heads_kv,
                        c.head_dim,
                    ),
                    TensorView::bshd(
                        ptr(s, &self.v),
                        dt,
                        b,
                        self.capacity,
                        c.heads_kv,
                        c.head_dim,
                    ),
                    CacheLayout::Contiguous,
                )
            }
            Some(t) => (
                TensorView::bshd(
                    ptr(s, &self.k),
                    dt,
                    self.pool_pages,
                    c.page,
                    c.heads_kv,
                    c.head_dim,
                ),
                TensorView::bshd(
                    ptr(s, &self.v),
                    dt,
                    self.pool_pages,
                    c.page,
                    c.heads_kv,
                    c.head_dim,
                ),
                CacheLayout::Paged {
                    block_table: ptr(s, t),
                    max_pages: self.max_pages,
                    table_stride: self.max_pages,
                },
            ),
        };
        KvCache {
            k,
            v,
            seqlens: ptr(s, &self.seqlens),
            layout,
            scales: None,
        }
    }

    fn host(&self) -> HostMetadata<'_> {
        HostMetadata {
            seqlens: &self.host_lens,
            block_table: self.table.as_ref().map(|_| self.host_table.as_slice()),
        }
    }
}

/// The float64 reference of a decode case, `[B, Sq, Hq, D]` and `[B, Hq, Sq]`.
fn reference_decode(c: &Case, q: &[f64], cache: &DeviceCache, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let (sq, hq, hkv, d) = (c.seqlen_q, c.heads_q, c.heads_kv, c.head_dim);
    let mut out = Vec::new();
    let mut lse = Vec::new();
    for (b, &len) in c.lens.iter().enumerate() {
        let qb = &q[b * sq * hq * d..(b + 1) * sq * hq * d];
        if len == 0 {
            out.extend(std::iter::repeat_n(0.0, sq * hq * d));
            lse.extend(std::iter::repeat_n(f64::NEG_INFINITY, hq * sq));
            continue;
        }
        let shape = AttnShape {
            batch: 1,
            seqlen_q: sq,
            seqlen_k: len,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
        };
        let n = len * hkv * d;
        let params = RefParams {
            scale,
            causal: c.causal,
            window: c.window,
            softcap: c.softcap.map(f64::from),
        };
        let r = attention_f64_with(
            &shape,
            qb,
            &cache.keys[b][..n],
            &cache.values[b][..n],
            &params,
        );
        out.extend(r.out);
        lse.extend(r.lse);
    }
    (out, lse)
}

/// A case's cache capacity: its longest sequence (at least 1), in whole pages.
fn capacity_for(c: &Case) -> usize {
    c.lens
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(1)
        .next_multiple_of(c.page.max(1))
}

/// The largest relative L2 error of one sequence's output (`[B, ...]`, `batch` equal
/// blocks): over the whole batch, a sequence of one key (its output a V row, exact)
/// would dwarf the longer ones' errors. NaN and infinities stay.
fn worst_sequence_error(got: &[f64], want: &[f64], batch: usize) -> f64 {
    let per = want.len() / batch.max(1);
    (0..batch)
        .map(|i| rel_l2(&got[i * per..][..per], &want[i * per..][..per]))
        .fold(0.0, |m: f64, e| {
            if m.is_nan() || e.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        })
}

/// The largest LSE difference; a row the reference gives −∞ must be −∞ exactly, and any
/// other must be finite: a NaN (an LSE left at its poison) is an infinite error, which
/// the fold keeps (`f64::max` would drop a NaN).
fn lse_error(got: &[f64], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(g, w)| match (w.is_finite(), g == w) {
            (true, _) if g.is_finite() => (g - w).abs(),
            (false, true) => 0.0,
            _ => f64::INFINITY,
        })
        .fold(0.0, f64::max)
}

/// Runs one case; returns (output error, LSE error) or panics with the case.
fn run_case(attn: &Attention, s: &Arc<CudaStream>, rng: &mut Rng, c: &Case) -> (f64, f64) {
    let b = c.lens.len();
    let capacity = capacity_for(c);
    let cache = DeviceCache::new(s, rng, c, capacity, &c.lens);
    let nq = b * c.seqlen_q * c.heads_q * c.head_dim;
    let (q_bits, q) = reference::random_half(rng, nq, c.dtype);
    let dq = up(s, &q_bits);
    // O's rows are `o_gap` elements wider than the head dim.
    let o_row = c.head_dim + c.o_gap;
    let rows = b * c.seqlen_q * c.heads_q;
    let poison = reference::poison(c.dtype);
    let o = up(s, &vec![poison; rows * o_row]);
    let lse = up(s, &vec![f32::NAN; b * c.heads_q * c.seqlen_q]);
    let dt = dtype_of(c.dtype);
    let qv = TensorView::bshd(ptr(s, &dq), dt, b, c.seqlen_q, c.heads_q, c.head_dim);
    let ov = TensorView::strided(
        ptr(s, &o),
        dt,
        [b, c.seqlen_q, c.heads_q, c.head_dim],
        [c.seqlen_q * c.heads_q * o_row, c.heads_q * o_row, o_row, 1],
    );
    let kv = cache.view(s, c);
    let params = c.params();
    let ws_bytes = attn.decode_workspace_bytes(&qv, &kv).expect("plan");
    let ws = c.workspace(s, rng, ws_bytes);
    let workspace = ws.as_ref().map(|(_, w)| *w);
    let host = cache.host();
    // SAFETY: every view points into this function's live device buffers, sized for it.
    unsafe {
        attn.decode(
            &qv,
            &kv,
            c.host_check.then_some(&host),
            &ov,
            Some(&LseView { ptr: ptr(s, &lse) }),
            &params,
            workspace,
            s.cu_stream(),
        )
    }
    .unwrap_or_else(|e| panic!("{c}: {e}"));
    let o_bits = down(s, &o);
    let written = o_bits
        .chunks(o_row)
        .enumerate()
        .flat_map(|(r, row)| row[c.head_dim..].iter().map(move |&x| (r, x)))
        .find(|&(_, x)| x != poison);
    assert_eq!(written, None, "{c}: a column past the head dim was written");
    let o_bits: Vec<u16> = o_bits
        .chunks(o_row)
        .flat_map(|row| row[..c.head_dim].iter().copied())
        .collect();
    let got = half_bits_to_f64(&o_bits, c.dtype);
    let got_lse: Vec<f64> = down(s, &lse).into_iter().map(f64::from).collect();
    let scale = 1.0 / (c.head_dim as f64).sqrt();
    let (want, want_lse) = reference_decode(c, &q, &cache, scale as f32 as f64);
    if got.len() != want.len() {
        return (f64::INFINITY, f64::INFINITY);
    }
    (
        worst_sequence_error(&got, &want, b),
        lse_error(&got_lse, &want_lse),
    )
}

/// A caller's workspace of at least `bytes` as the caller's allocator may hand it over:
/// random words, all-ones (NaN as floats) and zeros. Nothing of it may reach the output.
impl Case {
    /// The case's options as the calls take them (the default scale).
    fn params(&self) -> AttentionParams {
        AttentionParams {
            softmax_scale: None,
            causal: self.causal,
            window: self.window,
            softcap: self.softcap,
        }
    }

    /// The workspace a call of this case passes, `bytes` at a 256-byte aligned address
    /// full of garbage, with the buffer that holds it; none where the case passes none or
    /// the call needs none.
    fn workspace(
        &self,
        s: &Arc<CudaStream>,
        rng: &mut Rng,
        bytes: usize,
    ) -> Option<(CudaSlice<u32>, Workspace)> {
        (self.workspace && bytes > 0).then(|| {
            let buffer = workspace_garbage(s, rng, bytes + 256);
            let ptr = ptr(s, &buffer).next_multiple_of(256);
            (buffer, Workspace { ptr, bytes })
        })
    }
}

fn workspace_garbage(s: &Arc<CudaStream>, rng: &mut Rng, bytes: usize) -> CudaSlice<u32> {
    let words: Vec<u32> = (0..bytes.div_ceil(4))
        .map(|i| match i % 3 {
            0 => rng.next_u64() as u32,
            1 => u32::MAX,
            _ => 0,
        })
        .collect();
    up(s, &words)
}

fn run_all(cases: &[Case]) {
    let (attn, s) = setup();
    run_all_on(&attn, &s, cases);
}

fn run_all_on(attn: &Attention, s: &Arc<CudaStream>, cases: &[Case]) {
    let mut seeds = seeds();
    let mut failures = Vec::new();
    for c in cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let (err, lse_err) = run_case(attn, s, &mut rng, c);
        let line = format!("{c}: out {err:.2e} lse {lse_err:.2e} ({replay})");
        println!("{line}");
        if err.is_nan() || err > tolerance(c.dtype) || lse_err.is_nan() || lse_err > 1e-2 {
            failures.push(line);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[allow(clippy::too_many_arguments)]
fn case(
    dtype: HalfType,
    (heads_q, heads_kv): (usize, usize),
    head_dim: usize,
    seqlen_q: usize,
    lens: &[usize],
    page: usize,
    causal: bool,
) -> Case {
    Case {
        dtype,
        heads_q,
        heads_kv,
        head_dim,
        seqlen_q,
        lens: lens.to_vec(),
        page,
        causal,
        window: Window::FULL,
        host_check: true,
        workspace: false,
        o_gap: 0,
        softcap: None,
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_contiguous_ragged_batches() {
    let mut cases = Vec::new();
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for (heads, sq) in [
            ((8, 8), 1),
            ((32, 8), 1),
            ((16, 2), 4),
            ((8, 1), 16),
            ((4, 4), 16),
        ] {
            cases.push(case(dtype, heads, 128, sq, &[1, 7, 4097, 300], 0, true));
            cases.push(case(dtype, heads, 64, sq, &[1000, 16, 0], 0, false));
        }
    }
    run_all(&cases);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_paged_page_sizes() {
    let mut cases = Vec::new();
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for page in [1, 16, 64, 256] {
            cases.push(case(
                dtype,
                (32, 8),
                128,
                1,
                &[1, 7, 4097, 513],
                page,
                false,
            ));
            cases.push(case(dtype, (8, 2), 128, 5, &[5, 1000, 64], page, true));
        }
    }
    run_all(&cases);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_head_dims_and_long_caches() {
    let mut cases = Vec::new();
    for d in [32, 64, 96, 128, 192, 256] {
        cases.push(case(HalfType::F16, (8, 2), d, 2, &[777, 3, 2048], 16, true));
        cases.push(case(HalfType::Bf16, (4, 4), d, 1, &[1500], 0, false));
    }
    // One long sequence: many splits, GQA 8:1, with a workspace from the caller.
    let mut long = case(HalfType::F16, (8, 1), 128, 1, &[32768], 64, false);
    long.workspace = true;
    cases.push(long);
    let mut long = case(HalfType::Bf16, (16, 2), 128, 16, &[32768, 9], 0, true);
    long.host_check = false;
    cases.push(long);
    run_all(&cases);
}

/// Key windows (FlashAttention's `window_size`) on decode steps: sliding windows behind
/// each query of 1, 64 and 4096 keys, windows on both sides without causal masking, and
/// a right side alone; contiguous and paged caches (pages of 1, 16 and 64), 1 to 16
/// queries, ragged lengths up to 32768 (blocks whose tiles all lie before the window
/// skip them), GQA 1 to 8; then random configurations with random windows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_with_key_windows() {
    let windows = [
        (true, Window::sliding(1)),
        (true, Window::sliding(64)),
        (true, Window::sliding(4096)),
        (false, Window::from_flash(100, 3)),
        (false, Window::from_flash(-1, 2)),
        (false, Window::from_flash(17, -1)),
    ];
    let mut cases = Vec::new();
    for (i, &(causal, window)) in windows.iter().enumerate() {
        for (j, page) in [0, 1, 16, 64].into_iter().enumerate() {
            let dtype = [HalfType::F16, HalfType::Bf16][(i + j) % 2];
            let (heads, sq) = [((32, 8), 1), ((16, 2), 4), ((8, 1), 16), ((4, 4), 7)][(i + j) % 4];
            let lens: &[usize] = if j % 2 == 0 {
                &[1, 7, 4097, 300]
            } else {
                &[32768, 65, 0]
            };
            let mut c = case(dtype, heads, 128, sq, lens, page, causal);
            c.window = window;
            cases.push(c);
        }
    }
    let mut rng = Rng::new(seeds().run_seed().rotate_left(23) ^ 0x51DE);
    for mut c in random_cases(24, &[64, 96, 128, 256]) {
        c.window = random_window(&mut rng, c.causal, 3000);
        cases.push(c);
    }
    run_all(&cases);
}

/// [`decode_with_key_windows`]'s fixed cases on an e4m3 cache.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_fp8_cache_with_key_windows() {
    let mut cases = Vec::new();
    for (i, (causal, window)) in [
        (true, Window::sliding(1)),
        (true, Window::sliding(100)),
        (false, Window::from_flash(50, 5)),
    ]
    .into_iter()
    .enumerate()
    {
        for (j, page) in [0, 16].into_iter().enumerate() {
            let dtype = [HalfType::F16, HalfType::Bf16][(i + j) % 2];
            let mut c = case(dtype, (8, 2), 128, 1 + 5 * j, &[1, 4097, 300], page, causal);
            c.window = window;
            cases.push(c);
        }
    }
    run_all_fp8(&cases);
}

/// Soft-capped scores (Gemma 2's `attn_logit_softcapping`) on every layout: caps of 0.5
/// to 5 (which bend scores of about unit size), with and without causal masking and
/// sliding windows, contiguous and paged caches, 1 to 16 queries, ragged lengths up to
/// 32768 (split across blocks and merged), GQA 1 to 8; then random configurations.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_with_softcap() {
    let mut cases = Vec::new();
    let caps = [0.5f32, 1.0, 2.0, 5.0];
    let masks = [
        (false, Window::FULL),
        (true, Window::FULL),
        (true, Window::sliding(64)),
    ];
    for (i, &(causal, window)) in masks.iter().enumerate() {
        for (j, page) in [0, 16, 64].into_iter().enumerate() {
            let dtype = [HalfType::F16, HalfType::Bf16][(i + j) % 2];
            let (heads, sq) = [((32, 8), 1), ((16, 2), 4), ((8, 1), 16)][(i + j) % 3];
            let lens: &[usize] = if j % 2 == 0 {
                &[1, 7, 4097, 300]
            } else {
                &[32768, 65, 0]
            };
            let mut c = case(dtype, heads, 128, sq, lens, page, causal);
            c.window = window;
            c.softcap = Some(caps[(i + 2 * j) % 4]);
            cases.push(c);
        }
    }
    let mut rng = Rng::new(seeds().run_seed().rotate_left(19) ^ 0x5CA9);
    for mut c in random_cases(16, &[64, 96, 128, 256]) {
        c.softcap = Some(pick(&mut rng, &caps));
        cases.push(c);
    }
    run_all(&cases);
    let fp8: Vec<Case> = cases[..6].to_vec();
    run_all_fp8(&fp8);
}

/// Prefill against a cache (chunked prefill, prefix caching): 17 to 1023 new queries per
/// sequence against contiguous and paged caches, bottom-right aligned, lengths below the
/// query count among them (the queries before the sequence's first position see no key:
/// zeros and LSE −∞), GQA 1 to 8, with and without causal masking, a window and a cap.
/// Contiguous caches and (on Hopper) pages of 16 or more run on the forward kernels,
/// the rest on the decode kernels; then the contiguous cases on the sm80 path's forward
/// kernels, and the first three on an e4m3 cache (decode kernels).
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_long_query_chunks() {
    let mut cases = vec![
        case(HalfType::F16, (8, 2), 128, 17, &[1, 7, 4097, 300], 0, true),
        case(HalfType::Bf16, (16, 2), 64, 113, &[5, 113, 1500], 16, true),
        case(HalfType::F16, (32, 8), 128, 512, &[700, 512], 64, true),
        case(HalfType::Bf16, (4, 1), 256, 1023, &[1100, 3], 1, true),
        case(HalfType::F16, (8, 8), 96, 200, &[2500, 17], 256, false),
    ];
    let mut windowed = case(HalfType::Bf16, (16, 4), 128, 300, &[4000, 299], 16, true);
    windowed.window = Window::sliding(256);
    cases.push(windowed);
    let mut capped = case(HalfType::F16, (8, 1), 128, 64, &[64, 3000], 32, true);
    capped.softcap = Some(2.0);
    cases.push(capped);
    let (attn, s) = setup();
    run_all_on(&attn, &s, &cases);
    let forward = loaded_ids(&attn, "attn_fwd_");
    println!("forward kernels: {forward:?}");
    let hopper = attn.device().compute_capability().0 == 9;
    assert!(
        forward.iter().any(|id| id.contains("sm80") != hopper),
        "no forward kernel ran: {forward:?}"
    );
    let sm80 = setup().0.with_path(PathChoice::Sm80);
    let contiguous: Vec<Case> = cases.iter().filter(|c| c.page == 0).cloned().collect();
    run_all_on(&sm80, &s, &contiguous);
    run_all_fp8(&cases[..3]);
}

/// A prompt chunk past the decode kernels' grid (64 query heads over 8 KV heads, 16400
/// queries: 8 x 8200 blocks of 16 rows, above its 65535) against a contiguous cache runs
/// on the forward kernels, which read the cache on either path; validation used to refuse
/// it for the decode kernels' sake.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_prompt_chunks_past_the_decode_grid() {
    let chunk = case(HalfType::F16, (64, 8), 64, 16400, &[64], 0, false);
    let (attn, s) = setup();
    run_all_on(&attn, &s, &[chunk]);
    let forward = loaded_ids(&attn, "attn_fwd_");
    assert!(!forward.is_empty(), "no forward kernel ran");
}

/// A serving batch whose prompt chunk is past the decode kernels' grid (16400 queries of
/// 64 heads over 8 KV heads) beside decode steps, with a caller's workspace of the size
/// the query gives: on Hopper the forward kernels take the chunk and the decode kernels the
/// steps, whose plan alone sizes the workspace (every run on the decode kernels has none).
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_varlen_chunks_past_the_decode_grid() {
    let (attn, s) = setup();
    if attn.device().compute_capability().0 != 9 {
        println!("skipped: off Hopper the decode kernels take every run");
        return;
    }
    let mut batch = case(HalfType::F16, (64, 8), 64, 16400, &[64, 300, 9], 0, false);
    batch.workspace = true;
    run_all_packed(&attn, &s, &[(batch, vec![16400, 1, 4])], false);
}

/// One sequence's float64 attention: `n` queries (`[n, Hq, D]`) at the end of `len`
/// cached keys; `([n, Hq, D], [Hq, n])`, zeros and −∞ with no keys.
fn reference_sequence(
    c: &Case,
    q: &[f64],
    keys: &[f64],
    values: &[f64],
    len: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (n, hq, hkv, d) = (
        q.len() / (c.heads_q * c.head_dim),
        c.heads_q,
        c.heads_kv,
        c.head_dim,
    );
    if len == 0 {
        return (vec![0.0; n * hq * d], vec![f64::NEG_INFINITY; hq * n]);
    }
    let shape = AttnShape {
        batch: 1,
        seqlen_q: n,
        seqlen_k: len,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
    };
    let params = RefParams {
        scale: (1.0 / (d as f64).sqrt()) as f32 as f64,
        causal: c.causal,
        window: c.window,
        softcap: c.softcap.map(f64::from),
    };
    let r = attention_f64_with(
        &shape,
        q,
        &keys[..len * hkv * d],
        &values[..len * hkv * d],
        &params,
    );
    (r.out, r.lse)
}

/// A serving batch's queries packed over the case's cache (`Attention::decode_varlen`):
/// sequence `b` has `queries[b]` rows of q, after two rows no sequence covers and
/// before three more, which must keep their poison in o and the LSE. `fp8`: the cache as
/// e4m3 codes and scales, against the float64 reference of the dequantized cache.
/// Returns the worst sequence's output error and the LSE error.
fn run_packed_case(
    attn: &Attention,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    c: &Case,
    queries: &[usize],
    fp8: bool,
) -> (f64, f64) {
    let b = c.lens.len();
    assert_eq!(queries.len(), b);
    let cache = DeviceCache::new(s, rng, c, capacity_for(c), &c.lens);
    let fp8_cache = fp8.then(|| Fp8DeviceCache::new(s, c, &cache));
    let (hq, d) = (c.heads_q, c.head_dim);
    let mut cu = vec![2i32];
    for &n in queries {
        cu.push(cu.last().unwrap() + n as i32);
    }
    let total = cu[b] as usize + 3;
    let (q_bits, q) = reference::random_half(rng, total * hq * d, c.dtype);
    let dq = up(s, &q_bits);
    let dcu = up(s, &cu);
    let poison = reference::poison(c.dtype);
    let o = up(s, &vec![poison; total * hq * d]);
    let lse = up(s, &vec![f32::NAN; hq * total]);
    let dt = dtype_of(c.dtype);
    let qv = TensorView::bshd(ptr(s, &dq), dt, 1, total, hq, d);
    let ov = TensorView::bshd(ptr(s, &o), dt, 1, total, hq, d);
    let kv = match &fp8_cache {
        Some(f) => f.view(s, c, &cache),
        None => cache.view(s, c),
    };
    let packed = PackedQueries {
        cu_seqlens_q: ptr(s, &dcu),
        batch: b,
        max_seqlen_q: c.seqlen_q,
        host: c.host_check.then_some(cu.as_slice()),
    };
    let params = c.params();
    let ws_bytes = attn
        .decode_varlen_workspace_bytes(&qv, &kv, &packed)
        .expect("plan");
    let ws = c.workspace(s, rng, ws_bytes);
    let workspace = ws.as_ref().map(|(_, w)| *w);
    let host = cache.host();
    // SAFETY: every view points into this function's live device buffers, sized for it.
    unsafe {
        attn.decode_varlen(
            &qv,
            &kv,
            &packed,
            c.host_check.then_some(&host),
            &ov,
            Some(&LseView { ptr: ptr(s, &lse) }),
            &params,
            workspace,
            s.cu_stream(),
        )
    }
    .unwrap_or_else(|e| panic!("{c} packed {queries:?}: {e}"));
    let got_bits = down(s, &o);
    let got_lse = down(s, &lse);
    let row = hq * d;
    let (first, end) = (cu[0] as usize, cu[b] as usize);
    let untouched = |r: usize| r < first || r >= end;
    let written = (0..total)
        .filter(|&r| untouched(r))
        .any(|r| got_bits[r * row..][..row].iter().any(|&x| x != poison));
    assert!(
        !written,
        "{c} packed {queries:?}: a row no sequence covers was written"
    );
    let lse_written = (0..hq * total).any(|i| untouched(i % total) && !got_lse[i].is_nan());
    assert!(
        !lse_written,
        "{c} packed {queries:?}: an LSE no sequence covers was written"
    );
    let got = half_bits_to_f64(&got_bits, c.dtype);
    let (mut worst, mut worst_lse) = (0.0f64, 0.0f64);
    for (i, (&n, &len)) in queries.iter().zip(&c.lens).enumerate() {
        if n == 0 {
            continue;
        }
        let rows = cu[i] as usize..cu[i + 1] as usize;
        let qs = &q[rows.start * row..rows.end * row];
        let (keys, values) = match &fp8_cache {
            Some(f) => (&f.keys[i], &f.values[i]),
            None => (&cache.keys[i], &cache.values[i]),
        };
        let (want, want_lse) = reference_sequence(c, qs, keys, values, len);
        let err = rel_l2(&got[rows.start * row..rows.end * row], &want);
        let got_l: Vec<f64> = (0..hq * n)
            .map(|j| f64::from(got_lse[(j / n) * total + rows.start + j % n]))
            .collect();
        let lse_err = lse_error(&got_l, &want_lse);
        worst = if err.is_nan() {
            f64::NAN
        } else {
            worst.max(err)
        };
        worst_lse = if lse_err.is_nan() {
            f64::NAN
        } else {
            worst_lse.max(lse_err)
        };
    }
    (worst, worst_lse)
}

/// Runs packed-query cases (a case, each sequence's query count) on `attn`.
fn run_all_packed(attn: &Attention, s: &Arc<CudaStream>, cases: &[(Case, Vec<usize>)], fp8: bool) {
    let mut seeds = seeds();
    let mut failures = Vec::new();
    for (c, queries) in cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let (err, lse_err) = run_packed_case(attn, s, &mut rng, c, queries, fp8);
        let kind = if fp8 { " e4m3 cache" } else { "" };
        let line =
            format!("{c}{kind} packed {queries:?}: out {err:.2e} lse {lse_err:.2e} ({replay})");
        println!("{line}");
        if err.is_nan() || err > tolerance(c.dtype) || lse_err.is_nan() || lse_err > 1e-2 {
            failures.push(line);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Serving batches in one call (`Attention::decode_varlen`): decode steps, drafts and
/// prompt chunks packed together over contiguous caches and pages of 1 to 256, runs
/// longer than their sequences (zeros and LSE −∞ before the first position), empty
/// runs and empty sequences, GQA 1 to 8, causal or not, a window, a cap, with and
/// without host copies and a caller's workspace. Runs of at most 16 take the decode
/// kernels; on Hopper, where the forward kernels read the cache, a batch with longer runs
/// splits between both (asserted), batches whose runs are all long among them (the
/// decode launch then has nothing to do). Then the contiguous cases on the sm80 path
/// (the decode kernels) and four on an e4m3 cache.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_varlen_mixed_batches() {
    let with = |mut c: Case, queries: &[usize], f: &dyn Fn(&mut Case)| {
        c.seqlen_q = queries.iter().copied().max().unwrap_or(1).max(1);
        f(&mut c);
        (c, queries.to_vec())
    };
    let keep = |_: &mut Case| {};
    let f16 = HalfType::F16;
    let bf16 = HalfType::Bf16;
    let cases = vec![
        // Decode-sized runs: the decode kernels.
        with(
            case(f16, (32, 8), 128, 1, &[700, 1, 4097, 9, 0], 0, true),
            &[1, 1, 4, 16, 0],
            &keep,
        ),
        with(
            case(bf16, (8, 2), 64, 1, &[33, 2000, 5], 16, true),
            &[3, 1, 7],
            &keep,
        ),
        with(
            case(f16, (4, 4), 96, 1, &[300, 129], 1, false),
            &[16, 2],
            &|c| c.workspace = true,
        ),
        // Prompt chunks among decode steps: the forward kernels where they read the cache.
        with(
            case(f16, (32, 8), 128, 1, &[1500, 64, 3, 0, 800], 0, true),
            &[300, 1, 5, 0, 17],
            &keep,
        ),
        with(
            case(bf16, (16, 2), 64, 1, &[1024, 513, 4000], 64, true),
            &[1, 113, 1023],
            &keep,
        ),
        with(
            case(f16, (8, 1), 128, 1, &[2049, 40], 16, true),
            &[200, 40],
            &|c| c.host_check = false,
        ),
        with(
            case(bf16, (8, 8), 256, 1, &[90, 700], 256, false),
            &[90, 1],
            &keep,
        ),
        with(
            case(f16, (8, 2), 128, 1, &[3000, 20], 1, true),
            &[100, 20],
            &keep,
        ),
        with(
            case(bf16, (16, 4), 128, 1, &[4000, 260, 1], 32, true),
            &[300, 1, 1],
            &|c| c.window = Window::sliding(256),
        ),
        with(
            case(f16, (8, 1), 128, 1, &[64, 3000], 16, true),
            &[64, 2],
            &|c| {
                c.softcap = Some(2.0);
                c.workspace = true;
            },
        ),
    ];
    let (attn, s) = setup();
    run_all_packed(&attn, &s, &cases, false);
    let decode = loaded_ids(&attn, "attn_decode_");
    let forward = loaded_ids(&attn, "attn_fwd_");
    println!("decode kernels: {decode:?}\nforward kernels: {forward:?}");
    assert!(
        !decode.iter().any(|id| id.ends_with("_packed")),
        "{decode:?}"
    );
    assert!(!decode.is_empty(), "no decode kernel ran");
    if attn.device().compute_capability().0 == 9 {
        let sm90 = forward.iter().any(|id| id.contains("sm90a"));
        assert!(sm90, "no forward kernel ran: {forward:?}");
    }
    let sm80 = setup().0.with_path(PathChoice::Sm80);
    let contiguous: Vec<_> = cases.iter().filter(|c| c.0.page == 0).cloned().collect();
    run_all_packed(&sm80, &s, &contiguous, false);
    if attn.device().compute_capability() >= (8, 9) {
        let picks = [0, 1, 3, 4].map(|i| cases[i].clone());
        run_all_packed(&attn, &s, &picks, true);
    }
}

/// Lengths at the decode tiles' edges (16-key warp shares, 64-key stages).
const EDGES: [usize; 12] = [0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129];

/// One random decode configuration with a head dim from `head_dims`: 1 to 4 sequences,
/// GQA 1 to 8, 1 to 16 queries (one case in ten 17 to 200), contiguous or paged with any
/// page size the API takes
/// (1 to 1024), causal or not, with or without host copies and a caller's workspace.
fn random_case(rng: &mut Rng, head_dims: &[usize]) -> Case {
    let heads_kv = pick(rng, &[1, 2, 4]);
    let group = pick(rng, &[1, 2, 4, 8]);
    let batch = 1 + (rng.next_u64() % 4) as usize;
    let draw = rng.uniform();
    let seqlen_q = if draw < 0.5 {
        1
    } else if draw < 0.9 {
        1 + (rng.next_u64() % 16) as usize
    } else {
        17 + (rng.next_u64() % 184) as usize
    };
    Case {
        dtype: pick(rng, &[HalfType::F16, HalfType::Bf16]),
        heads_q: heads_kv * group,
        heads_kv,
        head_dim: pick(rng, head_dims),
        seqlen_q,
        lens: (0..batch).map(|_| random_len(rng, &EDGES, 6000)).collect(),
        page: if rng.uniform() < 0.4 {
            0
        } else {
            1 << (rng.next_u64() % 11)
        },
        causal: rng.uniform() < 0.5,
        window: Window::FULL,
        host_check: rng.uniform() < 0.5,
        workspace: rng.uniform() < 0.5,
        o_gap: 0,
        softcap: None,
    }
}

/// The configurations of the random tests: drawn from the run's seed (a new
/// `FLASHCORE_SEED` draws new ones), apart from the cases' input seeds.
fn random_cases(count: usize, head_dims: &[usize]) -> Vec<Case> {
    let mut rng = Rng::new(seeds().run_seed().rotate_left(17) ^ 0xC0F16);
    (0..count)
        .map(|_| random_case(&mut rng, head_dims))
        .collect()
}

/// Random configurations across every head dim, GQA ratio, query count, page size and
/// length pattern (see [`random_case`]), against float64.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_random_configurations() {
    run_all(&random_cases(40, &[32, 64, 96, 128, 192, 256]));
}

/// With programmatic launches off, a decode step's combine is the plain merge kernel
/// that GPUs before Hopper run (the decode kernels are the same sm_80 module on every
/// GPU): random configurations against float64, and only plain merges loaded.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_with_plain_launches() {
    let (attn, s) = setup();
    let attn = attn.with_programmatic_launches(false);
    run_all_on(&attn, &s, &random_cases(24, &[32, 64, 80, 128, 256]));
    let merges = loaded_ids(&attn, "attn_merge");
    assert!(
        !merges.is_empty() && merges.iter().all(|id| !id.contains("_pdl")),
        "merges: {merges:?}"
    );
}

/// A second GPU: decode steps of random configurations (contiguous and paged, one
/// split and many with their combine, launched programmatically on Hopper) on device 1,
/// first alone, then while device 0 runs its own from another thread. Skipped, saying
/// so, on a machine with one GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_on_a_second_gpu() {
    let count = flashcore::host::device::device_count().expect("a CUDA driver");
    if count < 2 {
        eprintln!("skipped: {count} CUDA device(s), this test needs two");
        return;
    }
    let on = |ordinal: usize| {
        let device = Arc::new(Device::new(ordinal).expect("a CUDA device"));
        let stream = device.context().default_stream();
        (Attention::new(device).expect("an sm_80+ GPU"), stream)
    };
    let (a1, s1) = on(1);
    run_all_on(&a1, &s1, &random_cases(16, &[64, 128]));
    let split = loaded_ids(&a1, "attn_merge");
    assert!(!split.is_empty(), "no split step ran on device 1");
    let both: Vec<_> = (0..2)
        .map(|ordinal| {
            std::thread::spawn(move || {
                let (attn, s) = on(ordinal);
                run_all_on(&attn, &s, &random_cases(12, &[64, 128, 256]));
            })
        })
        .collect();
    for t in both {
        t.join().expect("a device's thread failed");
    }
}

/// One `Attention` shared by four threads, each with its own stream, from cold: their
/// first steps generate and load the same kernels at once. Every step is checked.
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_attention_serves_four_threads_at_once() {
    let (attn, _) = setup();
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                let s = attn.device().context().new_stream().expect("a stream");
                run_all_on(&attn, &s, &random_cases(12, &[64, 128]));
            });
        }
    });
}

/// The safe decode over cudarc buffers ([`Attention::decode_buffers`]): f16 caches,
/// contiguous and paged, GQA 4, one and four causal queries, ragged lengths with a
/// many-split one, against float64 (with the LSE); then too few lengths and a short
/// block table, refused with nothing written.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_buffers_match_float64_and_refuse_short_metadata() {
    use flashcore::host::buffers::{BlockTable, CacheBuffers, Layout4, Tensor, TensorMut};
    let (attn, s) = setup();
    let mut seeds = seeds();
    let typed = |bits: Vec<u16>| -> CudaSlice<half::f16> {
        let x: Vec<half::f16> = bits.into_iter().map(half::f16::from_bits).collect();
        s.clone_htod(&x).expect("upload")
    };
    let (hq, hkv, d) = (16, 4, 128);
    let params = AttentionParams {
        softmax_scale: None,
        causal: true,
        ..Default::default()
    };
    for page in [0, 64] {
        for sq in [1, 4] {
            let c = case(HalfType::F16, (hq, hkv), d, sq, &[1, 700, 4097], page, true);
            let mut rng = seeds.next_case();
            let replay = seeds.replay(&rng);
            let cache = DeviceCache::new(&s, &mut rng, &c, capacity_for(&c), &c.lens);
            let (k, v) = (typed(down(&s, &cache.k)), typed(down(&s, &cache.v)));
            let b = c.lens.len();
            let n = b * sq * hq * d;
            let (q_bits, q) = reference::random_half(&mut rng, n, HalfType::F16);
            let dq = typed(q_bits);
            let mut o = s.clone_htod(&vec![half::f16::NAN; n]).unwrap();
            let mut lse = s.clone_htod(&vec![f32::NAN; b * hq * sq]).unwrap();
            let kv_layout = match page {
                0 => Layout4::bshd(b, cache.capacity, hkv, d),
                p => Layout4::bshd(cache.pool_pages, p, hkv, d),
            };
            let qo = Layout4::bshd(b, sq, hq, d);
            let cache_buffers = |seqlens, block_table| CacheBuffers {
                k: Tensor::new(&k, kv_layout),
                v: Tensor::new(&v, kv_layout),
                seqlens,
                block_table,
            };
            // The whole table, and all of it but its last entry.
            let entries = cache.host_table.len();
            let views = cache
                .table
                .as_ref()
                .map(|t| (t.slice(0..entries), t.slice(0..entries - 1)));
            let table = |short: bool| {
                views.as_ref().map(|(whole, cut)| BlockTable {
                    data: if short { cut } else { whole },
                    max_pages: cache.max_pages,
                    row_stride: cache.max_pages,
                })
            };
            attn.decode_buffers(
                &s,
                Tensor::new(&dq, qo),
                cache_buffers(&cache.seqlens, table(false)),
                TensorMut::new(&mut o, qo),
                Some(&mut lse),
                &params,
            )
            .unwrap_or_else(|e| panic!("{c}: {e}"));
            let got: Vec<u16> = s
                .clone_dtoh(&o)
                .unwrap()
                .into_iter()
                .map(half::f16::to_bits)
                .collect();
            let got = half_bits_to_f64(&got, HalfType::F16);
            let got_lse: Vec<f64> = s
                .clone_dtoh(&lse)
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect();
            let scale = (1.0 / (d as f64).sqrt()) as f32 as f64;
            let (want, want_lse) = reference_decode(&c, &q, &cache, scale);
            let err = worst_sequence_error(&got, &want, b);
            let lse_err = lse_error(&got_lse, &want_lse);
            println!("{c} through decode_buffers: worst sequence {err:.2e} lse {lse_err:.2e}");
            assert!(
                err <= tolerance(HalfType::F16) && lse_err <= 1e-2,
                "{c}: out {err:.2e} lse {lse_err:.2e} ({replay})"
            );

            // Too few lengths; a block table a row short.
            let mut o = s.clone_htod(&vec![half::f16::NAN; n]).unwrap();
            let two = s.clone_htod(&[1i32, 700]).unwrap();
            let refused = |r: flashcore::Result<()>, what: &str| match r {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
                other => panic!("{what}: {other:?}"),
            };
            refused(
                attn.decode_buffers(
                    &s,
                    Tensor::new(&dq, qo),
                    cache_buffers(&two, table(false)),
                    TensorMut::new(&mut o, qo),
                    None,
                    &params,
                ),
                "seqlens holds 2 elements",
            );
            if page != 0 {
                refused(
                    attn.decode_buffers(
                        &s,
                        Tensor::new(&dq, qo),
                        cache_buffers(&cache.seqlens, table(true)),
                        TensorMut::new(&mut o, qo),
                        None,
                        &params,
                    ),
                    "block_table holds",
                );
            }
            assert!(
                s.clone_dtoh(&o).unwrap().iter().all(|x| x.is_nan()),
                "a refused call wrote"
            );
        }
    }
}

/// The head dims without a decode kernel of their own (the next larger one runs
/// padded): several of each kernel's, contiguous and paged, one split and many (their
/// merge padded too), GQA and MQA, causal speculative rows; O a view into a wider tensor
/// whose columns past the head dim must stay unwritten.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_padded_head_dims() {
    let mut cases = Vec::new();
    for d in [8, 40, 56, 80, 112, 136, 160, 200, 248] {
        cases.push(case(HalfType::F16, (8, 2), d, 2, &[777, 3, 2048], 16, true));
        let mut wide = case(HalfType::Bf16, (4, 4), d, 1, &[1500, 1], 0, false);
        wide.o_gap = 8;
        cases.push(wide);
    }
    // Long sequences: many splits, GQA 8:1, with a workspace from the caller.
    let mut long = case(HalfType::F16, (8, 1), 80, 1, &[32768], 64, false);
    long.workspace = true;
    long.o_gap = 16;
    cases.push(long);
    let mut long = case(HalfType::Bf16, (16, 2), 80, 16, &[32768, 9, 4097], 0, true);
    long.host_check = false;
    cases.push(long);
    cases.push(case(
        HalfType::Bf16,
        (32, 8),
        136,
        1,
        &[8192, 7],
        256,
        false,
    ));
    run_all(&cases);
}

/// Random configurations (as [`decode_random_configurations`]) at head dims that run a
/// padded kernel.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_padded_random_configurations() {
    let dims: Vec<usize> = (8..=248)
        .step_by(8)
        .filter(|d| ![32, 64, 96, 128, 192].contains(d))
        .collect();
    run_all(&random_cases(24, &dims));
}

/// One decode step (kernel and merge) captured in a CUDA graph and replayed with new
/// queries and new lengths each time, as a serving loop replays it while its caches
/// grow: every replay gives its own inputs' answer, from a caller's workspace that
/// starts as garbage.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_graph_replays_follow_new_inputs() {
    let (attn, s) = setup();
    let mut seeds = seeds();
    let mut rng = seeds.next_case();
    let replay = seeds.replay(&rng);
    for page in [0, 16] {
        let mut c = case(HalfType::F16, (32, 8), 128, 1, &[8192, 2500], page, false);
        c.host_check = false;
        // Every position holds real keys, so the lengths may move anywhere up to the
        // capacity between replays.
        let capacity = capacity_for(&c);
        let mut cache = DeviceCache::new(&s, &mut rng, &c, capacity, &[capacity; 2]);
        let b = c.lens.len();
        let nq = b * c.seqlen_q * c.heads_q * c.head_dim;
        let dt = dtype_of(c.dtype);
        let mut dq = up(&s, &vec![0u16; nq]);
        let mut o = up(&s, &vec![reference::poison(c.dtype); nq]);
        let mut lse = up(&s, &vec![f32::NAN; b * c.heads_q]);
        let qv = TensorView::bshd(ptr(&s, &dq), dt, b, 1, c.heads_q, c.head_dim);
        let ov = TensorView::bshd(ptr(&s, &o), dt, b, 1, c.heads_q, c.head_dim);
        let lv = LseView { ptr: ptr(&s, &lse) };
        let kv = cache.view(&s, &c);
        let ws_bytes = attn.decode_workspace_bytes(&qv, &kv).expect("plan");
        assert!(ws_bytes > 0, "{c}: a split plan");
        let ws = workspace_garbage(&s, &mut rng, ws_bytes + 256);
        let workspace = Workspace {
            ptr: ptr(&s, &ws).next_multiple_of(256),
            bytes: ws_bytes,
        };
        s.synchronize().unwrap();
        let side = s.context().new_stream().unwrap();
        side.begin_capture(
            cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        .unwrap();
        // SAFETY: every view points into this function's live device buffers, sized for
        // it; the graph replays on `side` before they are dropped.
        let captured = unsafe {
            attn.decode(
                &qv,
                &kv,
                None,
                &ov,
                Some(&lv),
                &AttentionParams::default(),
                Some(workspace),
                side.cu_stream(),
            )
        };
        let graph = side
            .end_capture(
                cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .unwrap();
        captured.unwrap_or_else(|e| panic!("{c}: {e}"));
        let graph = graph.expect("a captured graph");
        let scale = (1.0 / (c.head_dim as f64).sqrt()) as f32 as f64;
        for (turn, lens) in [[8192, 2500], [8000, 2501], [8192, 1], [4097, 2500]]
            .into_iter()
            .enumerate()
        {
            c.lens = lens.to_vec();
            cache.host_lens = lens.iter().map(|&l| l as i32).collect();
            let (q_bits, q) = reference::random_half(&mut rng, nq, c.dtype);
            s.memcpy_htod(&q_bits, &mut dq).unwrap();
            s.memcpy_htod(&cache.host_lens, &mut cache.seqlens).unwrap();
            s.memcpy_htod(&vec![reference::poison(c.dtype); nq], &mut o)
                .unwrap();
            s.memcpy_htod(&vec![f32::NAN; b * c.heads_q], &mut lse)
                .unwrap();
            s.synchronize().unwrap();
            graph.launch().unwrap();
            side.synchronize().unwrap();
            let got = half_bits_to_f64(&down(&s, &o), c.dtype);
            let got_lse: Vec<f64> = down(&s, &lse).into_iter().map(f64::from).collect();
            let (want, want_lse) = reference_decode(&c, &q, &cache, scale);
            let (err, lse_err) = (rel_l2(&got, &want), lse_error(&got_lse, &want_lse));
            println!("{c}, replay {turn}: out {err:.2e} lse {lse_err:.2e} ({replay})");
            assert!(
                err <= tolerance(c.dtype) && lse_err <= 1e-2,
                "{c}, replay {turn}: out {err:.2e} lse {lse_err:.2e} ({replay})"
            );
        }
    }
}

/// Bad metadata is refused before anything runs: the output keeps its poison.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_metadata_is_refused_and_nothing_written() {
    let (attn, s) = setup();
    let mut rng = Rng::new(7);
    let c = case(HalfType::F16, (8, 2), 64, 1, &[100, 50], 16, false);
    let cache = DeviceCache::new(&s, &mut rng, &c, 128, &c.lens);
    let nq = 2 * 8 * 64;
    let dq = up(&s, &vec![0x3C00u16; nq]);
    let o = up(&s, &vec![reference::poison(c.dtype); nq]);
    let qv = TensorView::bshd(ptr(&s, &dq), DType::F16, 2, 1, 8, 64);
    let ov = TensorView::bshd(ptr(&s, &o), DType::F16, 2, 1, 8, 64);
    let kv = cache.view(&s, &c);
    let p = AttentionParams::default();
    let run = |kv: &KvCache, host: &HostMetadata| {
        // SAFETY: the views point into live buffers of this test.
        unsafe { attn.decode(&qv, kv, Some(host), &ov, None, &p, None, s.cu_stream()) }
    };
    let too_long = [100, 129];
    let e = run(
        &kv,
        &HostMetadata {
            seqlens: &too_long,
            block_table: Some(&cache.host_table),
        },
    );
    assert!(
        matches!(e, Err(Error::InvalidArgument(ref m)) if m.contains("capacity")),
        "{e:?}"
    );
    let mut table = cache.host_table.clone();
    table[1] = cache.pool_pages as i32;
    let e = run(
        &kv,
        &HostMetadata {
            seqlens: &cache.host_lens,
            block_table: Some(&table),
        },
    );
    assert!(
        matches!(e, Err(Error::InvalidArgument(ref m)) if m.contains("outside the pool")),
        "{e:?}"
    );
    table[1] = -3;
    let e = run(
        &kv,
        &HostMetadata {
            seqlens: &cache.host_lens,
            block_table: Some(&table),
        },
    );
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    let mut odd = kv;
    odd.k.shape[1] = 48;
    odd.v.shape[1] = 48;
    let e = run(&odd, &cache.host());
    assert!(
        matches!(e, Err(Error::InvalidArgument(ref m)) if m.contains("power of two")),
        "{e:?}"
    );
    let mut unaligned = kv;
    unaligned.seqlens += 2;
    assert!(matches!(
        run(&unaligned, &cache.host()),
        Err(Error::Misaligned { .. })
    ));
    assert!(
        down(&s, &o)
            .iter()
            .all(|&b| b == reference::poison(c.dtype)),
        "a refused call wrote the output"
    );
}

/// Metadata the host never saw is not followed out of the cache: lengths past the
/// capacity are clamped, entries outside the pool are not read (compute-sanitizer
/// memcheck runs this test clean).
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_metadata_never_leaves_the_cache() {
    let (attn, s) = setup();
    let mut rng = Rng::new(11);
    let c = case(HalfType::Bf16, (4, 4), 128, 1, &[60, 60], 16, false);
    let cache = DeviceCache::new(&s, &mut rng, &c, 64, &c.lens);
    let mut kv = cache.view(&s, &c);
    let bad_lens = up(&s, &[1 << 28, -5]);
    let mut table = cache.host_table.clone();
    table[0] = i32::MAX;
    table[2] = -1;
    let bad_table = up(&s, &table);
    kv.seqlens = ptr(&s, &bad_lens);
    if let CacheLayout::Paged { block_table, .. } = &mut kv.layout {
        *block_table = ptr(&s, &bad_table);
    }
    let nq = 2 * 4 * 128;
    let dq = up(&s, &vec![0x3F80u16; nq]);
    // Sequence 0 reads garbage rows (NaN among them: see below), so its output may be NaN
    // and the NaN poison could not tell "unwritten" from "NaN": the sentinel is bf16's
    // largest finite value instead, which no average of V's rows (at most 200 in
    // magnitude) reaches.
    const SENTINEL: u16 = 0x7F7F;
    let o = up(&s, &vec![SENTINEL; nq]);
    let qv = TensorView::bshd(ptr(&s, &dq), DType::Bf16, 2, 1, 4, 128);
    let ov = TensorView::bshd(ptr(&s, &o), DType::Bf16, 2, 1, 4, 128);
    // SAFETY: the views point into live buffers of this test.
    unsafe {
        attn.decode(
            &qv,
            &kv,
            None,
            &ov,
            None,
            &AttentionParams::default(),
            None,
            s.cu_stream(),
        )
    }
    .expect("launch");
    let out = down(&s, &o);
    // Sequence 1 (length clamped to 0) sees no key: zeros, written over the poison.
    let seq1 = half_bits_to_f64(&out[nq / 2..], HalfType::Bf16);
    assert!(
        seq1.iter().all(|&x| x == 0.0),
        "a sequence of length <= 0 gives zeros"
    );
    // Sequence 0, clamped to the capacity, reads the garbage rows past its host length
    // (and zeros for its two pages outside the pool): every element written.
    assert!(
        out[..nq / 2].iter().all(|&b| b != SENTINEL),
        "sequence 0 left unwritten"
    );
}

/// Appending writes exactly the new rows at each sequence's length, contiguous and paged.
#[test]
#[ignore = "needs a CUDA GPU"]
fn append_writes_the_new_rows_where_they_belong() {
    let (attn, s) = setup();
    let mut rng = Rng::new(3);
    for page in [0, 16, 1] {
        let c = case(HalfType::F16, (4, 2), 64, 3, &[5, 0, 30], page, false);
        let capacity = 48;
        let cache = DeviceCache::new(&s, &mut rng, &c, capacity, &c.lens);
        let kv = cache.view(&s, &c);
        let n = 3 * 3 * 2 * 64;
        let (kb, _) = reference::random_half(&mut rng, n, c.dtype);
        let (vb, _) = reference::random_half(&mut rng, n, c.dtype);
        let (dk, dv) = (up(&s, &kb), up(&s, &vb));
        let kn = TensorView::bshd(ptr(&s, &dk), DType::F16, 3, 3, 2, 64);
        let vn = TensorView::bshd(ptr(&s, &dv), DType::F16, 3, 3, 2, 64);
        let before_k = down(&s, &cache.k);
        // SAFETY: the views point into live buffers of this test.
        unsafe { attn.append_kv(&kv, &kn, &vn, Some(&cache.host()), s.cu_stream()) }
            .unwrap_or_else(|e| panic!("page {page}: {e}"));
        let after_k = down(&s, &cache.k);
        let after_v = down(&s, &cache.v);
        let row = 2 * 64;
        let mut expect_k = before_k.clone();
        for b in 0..3 {
            for j in 0..3 {
                let pos = c.lens[b] + j;
                let at = match (pos.checked_div(page), pos.checked_rem(page)) {
                    (Some(p), Some(r)) => {
                        let pg = cache.host_table[b * cache.max_pages + p] as usize;
                        (pg * page + r) * row
                    }
                    _ => (b * capacity + pos) * row,
                };
                let src = (b * 3 + j) * row;
                expect_k[at..at + row].copy_from_slice(&kb[src..src + row]);
                assert_eq!(
                    &after_v[at..at + row],
                    &vb[src..src + row],
                    "page {page} b{b} j{j}"
                );
            }
        }
        assert!(
            after_k == expect_k,
            "page {page}: K rows other than the new ones changed"
        );
        // A host length that would run past the capacity is refused.
        let lens = [5, 46, 30];
        let host = HostMetadata {
            seqlens: &lens,
            block_table: cache.host().block_table,
        };
        // SAFETY: as above.
        let e = unsafe { attn.append_kv(&kv, &kn, &vn, Some(&host), s.cu_stream()) };
        assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
        if page != 0 {
            continue;
        }
        // Without host copies a negative device length is clamped to 0, as the decode
        // kernels clamp it: sequence 1's rows land at positions 0.. (not shifted down
        // and cut), and a length past the capacity writes nothing.
        let mut device_lens = cache.seqlens.clone();
        s.memcpy_htod(&[20, -2, capacity as i32 + 5], &mut device_lens)
            .expect("upload");
        let odd = KvCache {
            seqlens: ptr(&s, &device_lens),
            ..kv
        };
        let before_v = down(&s, &cache.v);
        // SAFETY: as above; the lengths are a live device buffer of three int32s.
        unsafe { attn.append_kv(&odd, &kn, &vn, None, s.cu_stream()) }
            .unwrap_or_else(|e| panic!("clamped lengths: {e}"));
        let after_v = down(&s, &cache.v);
        let mut expect_v = before_v.clone();
        for (b, first) in [(0, 20), (1, 0)] {
            for j in 0..3 {
                let at = (b * capacity + first + j) * row;
                let src = (b * 3 + j) * row;
                expect_v[at..at + row].copy_from_slice(&vb[src..src + row]);
            }
        }
        assert!(
            after_v == expect_v,
            "clamped lengths: V rows other than the new ones"
        );
    }
}

/// Attention over key shards merged by LSE equals attention over all keys; an empty
/// shard (LSE −∞, output garbage) merges as nothing. Four shards, and 43 of mixed sizes
/// (each of the merge's warps then takes several in turn, its running maximum growing
/// and shrinking as their LSEs do).
#[test]
#[ignore = "needs a CUDA GPU"]
fn merge_of_shards_matches_one_shot_attention() {
    let (attn, s) = setup();
    let mut seeds = seeds();
    let few = vec![700, 1, 0, 333];
    let many: Vec<usize> = (0..43).map(|i| [0, 1, 90, 7, 300, 33][i % 6]).collect();
    // Head dims of a merge kernel, and padded ones (80 on the 96 kernel, 136 on 256).
    for (dtype, out_dtype, shards, d) in [
        (HalfType::F16, DType::F16, &few, 128),
        (HalfType::Bf16, DType::F32, &few, 128),
        (HalfType::F16, DType::Bf16, &few, 128),
        (HalfType::Bf16, DType::Bf16, &many, 128),
        (HalfType::F16, DType::F16, &few, 80),
        (HalfType::Bf16, DType::F32, &few, 136),
        (HalfType::F16, DType::Bf16, &few, 40),
    ] {
        let mut rng = seeds.next_case();
        let (b, sq, hq, hkv) = (2, 37, 8, 2);
        let sk: usize = shards.iter().sum();
        let nq = b * sq * hq * d;
        let (qb, q) = reference::random_half(&mut rng, nq, dtype);
        let (kb, k) = reference::random_half(&mut rng, b * sk * hkv * d, dtype);
        let (vb, v) = reference::random_half(&mut rng, b * sk * hkv * d, dtype);
        let dt = DType::from(dtype);
        let dq = up(&s, &qb);
        let dk = up(&s, &kb);
        let dv = up(&s, &vb);
        let parts = up(&s, &vec![reference::poison(dtype); shards.len() * nq]);
        // NaN poison, but −∞ for the empty shard (as a forward over no keys writes it).
        let rows = b * hq * sq;
        let lse_init: Vec<f32> = (0..shards.len() * rows)
            .map(|i| {
                if shards[i / rows] == 0 {
                    f32::NEG_INFINITY
                } else {
                    f32::NAN
                }
            })
            .collect();
        let lse_parts = up(&s, &lse_init);
        let mut start = 0;
        for (i, &n) in shards.iter().enumerate() {
            let pv = ptr(&s, &parts) + (i * nq * 2) as u64;
            let lv = ptr(&s, &lse_parts) + (i * b * hq * sq * 4) as u64;
            if n == 0 {
                continue;
            }
            let kv_view = |base: u64| {
                TensorView::strided(
                    base + (start * hkv * d * 2) as u64,
                    dt,
                    [b, n, hkv, d],
                    [sk * hkv * d, hkv * d, d, 1],
                )
            };
            let qv = TensorView::bshd(ptr(&s, &dq), dt, b, sq, hq, d);
            let ov = TensorView::bshd(pv, dt, b, sq, hq, d);
            // SAFETY: the views point into live buffers of this test.
            unsafe {
                attn.forward(
                    &qv,
                    &kv_view(ptr(&s, &dk)),
                    &kv_view(ptr(&s, &dv)),
                    &ov,
                    Some(&LseView { ptr: lv }),
                    &AttentionParams::default(),
                    s.cu_stream(),
                )
            }
            .expect("shard forward");
            start += n;
        }
        let out_bytes = out_dtype.size_bytes();
        let out = up(&s, &vec![0xFFu8; nq * out_bytes]);
        let out_lse = up(&s, &vec![f32::NAN; b * hq * sq]);
        let merge = MergeParts {
            o: TensorView::bshd(ptr(&s, &parts), dt, b, sq, hq, d),
            count: shards.len(),
            shard_stride: nq,
            lse: ptr(&s, &lse_parts),
        };
        let ov = TensorView::bshd(ptr(&s, &out), out_dtype, b, sq, hq, d);
        // SAFETY: the views point into live buffers of this test.
        unsafe {
            attn.merge(
                &merge,
                &ov,
                Some(&LseView {
                    ptr: ptr(&s, &out_lse),
                }),
                s.cu_stream(),
            )
        }
        .expect("merge");
        let raw = down(&s, &out);
        let got: Vec<f64> = match out_dtype {
            DType::F32 => raw
                .chunks(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect(),
            _ => {
                let bits: Vec<u16> = raw
                    .chunks(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect();
                half_bits_to_f64(&bits, out_dtype.half_type().unwrap())
            }
        };
        let shape = AttnShape {
            batch: b,
            seqlen_q: sq,
            seqlen_k: sk,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
        };
        let scale = (1.0 / (d as f64).sqrt()) as f32 as f64;
        let want = attention_f64(&shape, &q, &k, &v, scale, false);
        let err = rel_l2(&got, &want.out);
        let got_lse: Vec<f64> = down(&s, &out_lse).into_iter().map(f64::from).collect();
        let lse_err = lse_error(&got_lse, &want.lse);
        println!("merge {dtype:?} -> {out_dtype} d{d}: out {err:.2e} lse {lse_err:.2e}");
        let tol = tolerance(dtype).max(out_dtype.half_type().map_or(0.0, tolerance));
        assert!(
            err <= tol && lse_err < 1e-3,
            "merge {dtype:?} -> {out_dtype} d{d}: {err} {lse_err}"
        );
    }
}

/// Small cases for compute-sanitizer (memcheck, racecheck, synccheck): a paged causal
/// decode with two splits and its merge, a contiguous one with a single split, every
/// head dim's ring.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_small_for_sanitizers() {
    let mut cases = vec![
        case(HalfType::F16, (8, 2), 128, 3, &[1, 7, 300], 16, true),
        case(HalfType::Bf16, (4, 4), 64, 1, &[5, 40], 0, false),
    ];
    cases[0].workspace = true;
    for d in [32, 96, 192, 256] {
        cases.push(case(HalfType::F16, (2, 1), d, 2, &[70, 3], 64, true));
    }
    // Padded kernels: two splits and their padded merge, and single splits storing only
    // the head dim's columns.
    let mut split = case(HalfType::F16, (8, 2), 80, 3, &[1, 7, 300], 16, true);
    split.workspace = true;
    cases.push(split);
    let mut wide = case(HalfType::Bf16, (4, 2), 40, 1, &[5, 40], 0, false);
    wide.o_gap = 8;
    cases.push(wide);
    cases.push(case(HalfType::F16, (2, 1), 136, 2, &[70, 3], 64, true));
    cases.push(case(HalfType::Bf16, (2, 1), 248, 1, &[300, 2], 0, false));
    run_all(&cases);
}

/// Small packed-query cases for compute-sanitizer: a paged decode-sized batch with two
/// splits and the packed merge, a contiguous single split with a run longer than its
/// sequence, and prompt chunks on the forward kernels over a contiguous cache and pages
/// of 16 (the sm90 path's paged loads).
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_varlen_small_for_sanitizers() {
    let mut split = case(HalfType::F16, (8, 2), 128, 3, &[1, 7, 300], 16, true);
    split.workspace = true;
    let short = case(HalfType::Bf16, (4, 4), 64, 5, &[3, 40], 0, true);
    let chunks = case(HalfType::F16, (8, 2), 128, 70, &[300, 2, 90], 0, true);
    let paged = case(HalfType::Bf16, (8, 2), 64, 70, &[300, 2, 90], 16, true);
    let cases = vec![
        (split, vec![3, 1, 2]),
        (short, vec![5, 0]),
        (chunks, vec![70, 1, 33]),
        (paged, vec![70, 1, 33]),
    ];
    let (attn, s) = setup();
    run_all_packed(&attn, &s, &cases, false);
}

/// Small key-window cases for compute-sanitizer: a sliding window skipping most of a
/// paged sequence's tiles, two-sided windows on a contiguous cache, an e4m3 cache.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_windows_small_for_sanitizers() {
    let mut paged = case(HalfType::F16, (8, 2), 128, 3, &[1, 7, 1300], 16, true);
    paged.window = Window::sliding(70);
    paged.workspace = true;
    let mut two_sided = case(HalfType::Bf16, (4, 4), 64, 4, &[5, 700], 0, false);
    two_sided.window = Window::from_flash(100, 2);
    run_all(&[paged.clone(), two_sided]);
    run_all_fp8(&[paged]);
}

/// Rows of `d` values quantized to e4m3 as the append kernel does: scale `amax / 448`,
/// codes `rn(x · 448 / amax)` saturated. Returns the codes, one scale per row and the
/// dequantized values (code × scale, exact in f64).
fn quantize_rows_e4m3(x: &[f64], d: usize) -> (Vec<u8>, Vec<f32>, Vec<f64>) {
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / d);
    let mut deq = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let amax = row
            .iter()
            .fold(0f32, |m, &v| m.max(quant::finite_magnitude(v as f32)));
        let (scale, inv) = quant::block_scale(amax);
        for &v in row {
            let c = quant::quantize_value(v as f32, inv);
            codes.push(c);
            deq.push(f64::from(quant::e4m3_to_f32(c)) * f64::from(scale));
        }
        scales.push(scale);
    }
    (codes, scales, deq)
}

/// An e4m3 copy of a 16-bit [`DeviceCache`], every row of its memory (the slots no call
/// may read included: their ±200 stay large, their NaN become NaN codes) quantized by
/// [`quantize_rows_e4m3`].
struct Fp8DeviceCache {
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    k_scale: CudaSlice<f32>,
    v_scale: CudaSlice<f32>,
    /// The scale views' strides where the scales repeat ([`Repeat`]); `None`: one per
    /// (position, head), laid out as the cache.
    scale_strides: Option<[usize; 4]>,
    /// `keys[b]`, `values[b]`: the dequantized values each sequence holds.
    keys: Vec<Vec<f64>>,
    values: Vec<Vec<f64>>,
}

/// Scales that repeat, as a decode may read them through zero strides: one per KV head,
/// one per sequence and KV head (a contiguous cache; FlashAttention-3's descales), one
/// for the whole cache.
#[derive(Debug, Clone, Copy)]
enum Repeat {
    Head,
    SequenceHead,
    Whole,
}

impl Repeat {
    /// The scale that sequence `b`'s head `h` takes.
    fn index(self, c: &Case, b: usize, h: usize) -> usize {
        match self {
            Repeat::Head => h,
            Repeat::SequenceHead => b * c.heads_kv + h,
            Repeat::Whole => 0,
        }
    }

    /// The `[outer, rows, Hkv, 1]` scale views' strides.
    fn strides(self, c: &Case) -> [usize; 4] {
        match self {
            Repeat::Head => [0, 0, 1, 1],
            Repeat::SequenceHead => [c.heads_kv, 0, 1, 1],
            Repeat::Whole => [0, 0, 0, 0],
        }
    }
}

impl Fp8DeviceCache {
    fn new(s: &Arc<CudaStream>, c: &Case, cache: &DeviceCache) -> Fp8DeviceCache {
        let d = c.head_dim;
        let all = |x: &CudaSlice<u16>| {
            let (codes, scales, _) = quantize_rows_e4m3(&half_bits_to_f64(&down(s, x), c.dtype), d);
            (up(s, &codes), up(s, &scales))
        };
        let (k, k_scale) = all(&cache.k);
        let (v, v_scale) = all(&cache.v);
        let deq = |x: &Vec<Vec<f64>>| -> Vec<Vec<f64>> {
            x.iter().map(|seq| quantize_rows_e4m3(seq, d).2).collect()
        };
        Fp8DeviceCache {
            k,
            v,
            k_scale,
            v_scale,
            scale_strides: None,
            keys: deq(&cache.keys),
            values: deq(&cache.values),
        }
    }

    /// An e4m3 copy of a 16-bit cache with scales that repeat: each the largest magnitude
    /// its sequences' valid rows reach over 448, every row of memory quantized with its
    /// sequence's and head's scale (saturating: the ±200 past each length become ±448
    /// codes, their NaN stay NaN).
    fn repeated(s: &Arc<CudaStream>, c: &Case, cache: &DeviceCache, repeat: Repeat) -> Self {
        let (hkv, d) = (c.heads_kv, c.head_dim);
        let count = match repeat {
            Repeat::Head => hkv,
            Repeat::SequenceHead => cache.keys.len() * hkv,
            Repeat::Whole => 1,
        };
        // Rows of one outer index of the memory: a sequence's, or a page's.
        let outer_rows = if c.page == 0 { cache.capacity } else { c.page };
        let one = |mem: &CudaSlice<u16>, seqs: &Vec<Vec<f64>>| {
            let mut amax = vec![0f32; count];
            for (b, seq) in seqs.iter().enumerate() {
                for (r, row) in seq.chunks(d).enumerate() {
                    let g = repeat.index(c, b, r % hkv);
                    amax[g] = row
                        .iter()
                        .fold(amax[g], |m, &x| m.max(quant::finite_magnitude(x as f32)));
                }
            }
            let scales: Vec<(f32, f32)> = amax.into_iter().map(quant::block_scale).collect();
            let memory = half_bits_to_f64(&down(s, mem), c.dtype);
            let codes: Vec<u8> = memory
                .chunks(d)
                .enumerate()
                .flat_map(|(r, row)| {
                    let g = repeat.index(c, r / (hkv * outer_rows), r % hkv);
                    let inv = scales[g].1;
                    row.iter()
                        .map(move |&x| quant::quantize_value(x as f32, inv))
                })
                .collect();
            let deq: Vec<Vec<f64>> = seqs
                .iter()
                .enumerate()
                .map(|(b, seq)| {
                    seq.chunks(d)
                        .enumerate()
                        .flat_map(|(r, row)| {
                            let (scale, inv) = scales[repeat.index(c, b, r % hkv)];
                            row.iter().map(move |&x| {
                                let code = quant::quantize_value(x as f32, inv);
                                f64::from(quant::e4m3_to_f32(code)) * f64::from(scale)
                            })
                        })
                        .collect()
                })
                .collect();
            let scales: Vec<f32> = scales.iter().map(|p| p.0).collect();
            (up(s, &codes), up(s, &scales), deq)
        };
        let (k, k_scale, keys) = one(&cache.k, &cache.keys);
        let (v, v_scale, values) = one(&cache.v, &cache.values);
        Fp8DeviceCache {
            k,
            v,
            k_scale,
            v_scale,
            scale_strides: Some(repeat.strides(c)),
            keys,
            values,
        }
    }

    /// The 16-bit cache's view with these codes and scales in place of its data.
    fn view(&self, s: &Arc<CudaStream>, c: &Case, cache: &DeviceCache) -> KvCache {
        let base = cache.view(s, c);
        let codes = |t: TensorView, at| TensorView {
            ptr: at,
            dtype: DType::E4m3,
            ..t
        };
        let [outer, rows, hkv, _] = base.k.shape;
        let scale = |at| {
            let t = TensorView::bshd(at, DType::F32, outer, rows, hkv, 1);
            TensorView {
                strides: self.scale_strides.unwrap_or(t.strides),
                ..t
            }
        };
        KvCache {
            k: codes(base.k, ptr(s, &self.k)),
            v: codes(base.v, ptr(s, &self.v)),
            scales: Some(KvScales {
                k: scale(ptr(s, &self.k_scale)),
                v: scale(ptr(s, &self.v_scale)),
            }),
            ..base
        }
    }
}

/// Runs one decode case on an e4m3 copy of its cache. Returns the output's error against
/// the float64 reference on the dequantized cache (the kernel's own arithmetic), the
/// LSE's, and the output's error against the unquantized cache (what FP8 costs).
/// The scales repeat where `repeat` says so ([`Fp8DeviceCache::repeated`]).
fn run_fp8_case(
    attn: &Attention,
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    c: &Case,
    repeat: Option<Repeat>,
) -> (f64, f64, f64) {
    let b = c.lens.len();
    let capacity = capacity_for(c);
    let cache = DeviceCache::new(s, rng, c, capacity, &c.lens);
    let fp8 = match repeat {
        None => Fp8DeviceCache::new(s, c, &cache),
        Some(r) => Fp8DeviceCache::repeated(s, c, &cache, r),
    };
    let nq = b * c.seqlen_q * c.heads_q * c.head_dim;
    let (q_bits, q) = reference::random_half(rng, nq, c.dtype);
    let dq = up(s, &q_bits);
    let o = up(s, &vec![reference::poison(c.dtype); nq]);
    let lse = up(s, &vec![f32::NAN; b * c.heads_q * c.seqlen_q]);
    let dt = dtype_of(c.dtype);
    let qv = TensorView::bshd(ptr(s, &dq), dt, b, c.seqlen_q, c.heads_q, c.head_dim);
    let ov = TensorView::bshd(ptr(s, &o), dt, b, c.seqlen_q, c.heads_q, c.head_dim);
    let kv = fp8.view(s, c, &cache);
    let params = c.params();
    let host = cache.host();
    // SAFETY: every view points into this function's live device buffers, sized for it.
    unsafe {
        attn.decode(
            &qv,
            &kv,
            c.host_check.then_some(&host),
            &ov,
            Some(&LseView { ptr: ptr(s, &lse) }),
            &params,
            None,
            s.cu_stream(),
        )
    }
    .unwrap_or_else(|e| panic!("{c} e4m3 cache: {e}"));
    let got = half_bits_to_f64(&down(s, &o), c.dtype);
    let got_lse: Vec<f64> = down(s, &lse).into_iter().map(f64::from).collect();
    let scale = (1.0 / (c.head_dim as f64).sqrt()) as f32 as f64;
    let (exact, _) = reference_decode(c, &q, &cache, scale);
    let dequantized = DeviceCache {
        keys: fp8.keys.clone(),
        values: fp8.values.clone(),
        ..cache
    };
    let (want, want_lse) = reference_decode(c, &q, &dequantized, scale);
    if got.len() != want.len() {
        return (f64::INFINITY, f64::INFINITY, f64::INFINITY);
    }
    (
        worst_sequence_error(&got, &want, b),
        lse_error(&got_lse, &want_lse),
        rel_l2(&got, &exact),
    )
}

/// FP8 costs at most this much relative L2 against the unquantized cache on N(0, 1)
/// data (per-row E4M3 keeps 3 mantissa bits: about 2-4% in practice).
const FP8_CACHE_VS_EXACT: f64 = 8e-2;

fn run_all_fp8(cases: &[Case]) {
    run_all_fp8_with(cases, None);
}

/// [`run_all_fp8`], with scales that repeat where `repeat` says so.
fn run_all_fp8_with(cases: &[Case], repeat: Option<Repeat>) {
    let (attn, s) = setup();
    if attn.device().compute_capability() < (8, 9) {
        eprintln!("skipped: e4m3 caches need sm_89");
        return;
    }
    let mut seeds = seeds();
    let mut failures = Vec::new();
    for c in cases {
        let mut rng = seeds.next_case();
        let replay = seeds.replay(&rng);
        let (err, lse_err, vs_exact) = run_fp8_case(&attn, &s, &mut rng, c, repeat);
        let line = format!(
            "{c} e4m3 cache (scales {repeat:?}): out {err:.2e} lse {lse_err:.2e} vs \
             unquantized {vs_exact:.2e} ({replay})"
        );
        println!("{line}");
        let bad = |e: f64, bound: f64| e.is_nan() || e > bound;
        if bad(err, tolerance(c.dtype)) || bad(lse_err, 1e-2) || bad(vs_exact, FP8_CACHE_VS_EXACT) {
            failures.push(line);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_fp8_cache_layouts_head_dims_and_ratios() {
    let mut cases = Vec::new();
    for dtype in [HalfType::F16, HalfType::Bf16] {
        // Contiguous ragged batches, GQA 1, 4 and 8, 1 to 16 queries.
        cases.push(case(dtype, (8, 8), 128, 1, &[1, 7, 4097, 300], 0, true));
        cases.push(case(dtype, (32, 8), 128, 1, &[1000, 16, 0], 0, false));
        cases.push(case(dtype, (16, 4), 64, 4, &[33, 2049], 0, true));
        cases.push(case(dtype, (8, 1), 256, 16, &[600, 17], 0, true));
        // Paged, page sizes 1 to 256.
        for page in [1, 16, 64, 256] {
            cases.push(case(
                dtype,
                (32, 8),
                128,
                1,
                &[1, 7, 4097, 513],
                page,
                false,
            ));
            cases.push(case(dtype, (8, 2), 64, 5, &[5, 1000, 64], page, true));
        }
    }
    // One long sequence: many splits.
    cases.push(case(HalfType::F16, (32, 8), 128, 1, &[32768], 64, false));
    cases.push(case(HalfType::Bf16, (8, 1), 128, 2, &[32768, 3], 0, true));
    run_all_fp8(&cases);
}

/// e4m3 caches whose scales repeat through zero strides (one per KV head, per sequence
/// and KV head, or one for the whole cache): contiguous and paged, GQA, several queries,
/// ragged lengths up to a many-split one.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_fp8_cache_with_repeated_scales() {
    for repeat in [Repeat::Head, Repeat::SequenceHead, Repeat::Whole] {
        let mut cases = Vec::new();
        for dtype in [HalfType::F16, HalfType::Bf16] {
            cases.push(case(dtype, (32, 8), 128, 1, &[1, 7, 4097, 300], 0, true));
            cases.push(case(dtype, (16, 4), 64, 4, &[33, 2049], 0, false));
            cases.push(case(dtype, (8, 1), 256, 16, &[600, 17], 0, true));
            if !matches!(repeat, Repeat::SequenceHead) {
                cases.push(case(dtype, (32, 8), 128, 1, &[1, 4097, 513], 16, false));
                cases.push(case(dtype, (8, 2), 64, 5, &[5, 1000, 64], 64, true));
            }
        }
        cases.push(case(HalfType::F16, (32, 8), 128, 1, &[32768], 0, false));
        run_all_fp8_with(&cases, Some(repeat));
    }
}

/// Random configurations (see [`random_case`]) on e4m3 caches, head dims 64, 128, 256.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_fp8_cache_random_configurations() {
    run_all_fp8(&random_cases(24, &[64, 128, 256]));
}

/// Values far apart in magnitude: one outlier row per sequence and rows of zeros. Per-row
/// scales keep the small rows' precision; a row of zeros (scale 1, codes 0) divides by
/// nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_fp8_cache_survives_outliers_and_zero_rows() {
    let (attn, s) = setup();
    if attn.device().compute_capability() < (8, 9) {
        return;
    }
    let c = case(HalfType::F16, (8, 2), 128, 1, &[700, 300], 16, false);
    let mut rng = seeds().next_case();
    let mut cache = DeviceCache::new(&s, &mut rng, &c, 704, &c.lens);
    // Rewrite the sequences' values on the host and in the pool: row 5 of each ×1000
    // (V) and ×30 (K), rows 10..20 zero.
    let row = c.heads_kv * c.head_dim;
    let mut kb = half_bits_to_f64(&down(&s, &cache.k), c.dtype);
    let mut vb = half_bits_to_f64(&down(&s, &cache.v), c.dtype);
    for (b, &len) in c.lens.iter().enumerate() {
        for pos in 0..len {
            let (kf, vf) = match pos {
                5 => (30.0, 1000.0),
                10..20 => (0.0, 0.0),
                _ => continue,
            };
            let page = cache.host_table[b * cache.max_pages + pos / c.page] as usize;
            let at = (page * c.page + pos % c.page) * row;
            for i in 0..row {
                let kv = reference::f64_to_half_bits(&[cache.keys[b][pos * row + i] * kf], c.dtype);
                let vv =
                    reference::f64_to_half_bits(&[cache.values[b][pos * row + i] * vf], c.dtype);
                let (kx, vx) = (
                    half_bits_to_f64(&kv, c.dtype)[0],
                    half_bits_to_f64(&vv, c.dtype)[0],
                );
                cache.keys[b][pos * row + i] = kx;
                cache.values[b][pos * row + i] = vx;
                kb[at + i] = kx;
                vb[at + i] = vx;
            }
        }
    }
    cache.k = up(&s, &reference::f64_to_half_bits(&kb, c.dtype));
    cache.v = up(&s, &reference::f64_to_half_bits(&vb, c.dtype));
    let fp8 = Fp8DeviceCache::new(&s, &c, &cache);
    let b = c.lens.len();
    let nq = b * c.heads_q * c.head_dim;
    let (q_bits, q) = reference::random_half(&mut rng, nq, c.dtype);
    let dq = up(&s, &q_bits);
    let o = up(&s, &vec![reference::poison(c.dtype); nq]);
    let dt = dtype_of(c.dtype);
    let qv = TensorView::bshd(ptr(&s, &dq), dt, b, 1, c.heads_q, c.head_dim);
    let ov = TensorView::bshd(ptr(&s, &o), dt, b, 1, c.heads_q, c.head_dim);
    // SAFETY: every view points into this function's live device buffers, sized for it.
    unsafe {
        attn.decode(
            &qv,
            &fp8.view(&s, &c, &cache),
            None,
            &ov,
            None,
            &AttentionParams::default(),
            None,
            s.cu_stream(),
        )
    }
    .unwrap();
    let got = half_bits_to_f64(&down(&s, &o), c.dtype);
    let scale = (1.0 / (c.head_dim as f64).sqrt()) as f32 as f64;
    let dequantized = DeviceCache {
        keys: fp8.keys.clone(),
        values: fp8.values.clone(),
        ..cache
    };
    let (want, _) = reference_decode(&c, &q, &dequantized, scale);
    let err = rel_l2(&got, &want);
    println!("e4m3 cache with outlier and zero rows: out {err:.2e}");
    assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
    assert!(err <= tolerance(c.dtype), "{err:.2e}");
}

/// Appending 16-bit tokens to an e4m3 cache writes exactly the CPU quantizer's codes and
/// scales at each sequence's next positions, contiguous and paged, and nothing else.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fp8_append_quantizes_rows_where_they_belong() {
    let (attn, s) = setup();
    if attn.device().compute_capability() < (8, 9) {
        return;
    }
    let mut seeds = seeds();
    for dtype in [HalfType::F16, HalfType::Bf16] {
        for (d, page) in [(128, 0), (64, 16), (256, 1), (128, 64)] {
            let mut rng = seeds.next_case();
            let (hkv, new_tokens, lens) = (2usize, 3usize, [0usize, 5, 17, 100]);
            let b = lens.len();
            let capacity = 128usize;
            let row = hkv * d;
            // Pool (or batch) of rows, filled with codes of garbage and scales of 7.
            let max_pages = capacity.checked_div(page).unwrap_or(0);
            let (outer, rows) = if max_pages == 0 {
                (b, capacity)
            } else {
                (b * max_pages + 3, page)
            };
            let n = outer * rows * row;
            let init: Vec<u8> = (0..n).map(|_| (rng.next_u64() % 0x7e) as u8).collect();
            let (k, v) = (up(&s, &init), up(&s, &init));
            let k_scale = up(&s, &vec![7f32; outer * rows * hkv]);
            let v_scale = up(&s, &vec![7f32; outer * rows * hkv]);
            // Page p of sequence b is pool page table[b][p] (reversed order).
            let table: Vec<i32> = (0..b * max_pages)
                .map(|i| (b * max_pages - 1 - i) as i32)
                .collect();
            let dtable = up(&s, &table.iter().map(|&x| x.max(0)).collect::<Vec<_>>());
            let host_lens: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let seqlens = up(&s, &host_lens);
            let layout = if page == 0 {
                CacheLayout::Contiguous
            } else {
                CacheLayout::Paged {
                    block_table: ptr(&s, &dtable),
                    max_pages,
                    table_stride: max_pages,
                }
            };
            let codes =
                |x: &CudaSlice<u8>| TensorView::bshd(ptr(&s, x), DType::E4m3, outer, rows, hkv, d);
            let scales =
                |x: &CudaSlice<f32>| TensorView::bshd(ptr(&s, x), DType::F32, outer, rows, hkv, 1);
            let cache = KvCache {
                k: codes(&k),
                v: codes(&v),
                seqlens: ptr(&s, &seqlens),
                layout,
                scales: Some(KvScales {
                    k: scales(&k_scale),
                    v: scales(&v_scale),
                }),
            };
            let nn = b * new_tokens * row;
            let (kb, kx) = reference::random_half(&mut rng, nn, dtype);
            let (vb, vx) = reference::random_half(&mut rng, nn, dtype);
            let (dk, dv) = (up(&s, &kb), up(&s, &vb));
            let dt = dtype_of(dtype);
            let kn = TensorView::bshd(ptr(&s, &dk), dt, b, new_tokens, hkv, d);
            let vn = TensorView::bshd(ptr(&s, &dv), dt, b, new_tokens, hkv, d);
            let host = HostMetadata {
                seqlens: &host_lens,
                block_table: (page > 0).then_some(table.as_slice()),
            };
            // SAFETY: every view points into this function's live device buffers.
            unsafe { attn.append_kv(&cache, &kn, &vn, Some(&host), s.cu_stream()) }
                .unwrap_or_else(|e| panic!("{dtype:?} d{d} page {page}: {e}"));
            for (name, dev, dev_scale, x) in [("k", &k, &k_scale, &kx), ("v", &v, &v_scale, &vx)] {
                let mut want = init.clone();
                let mut want_scale = vec![7f32; outer * rows * hkv];
                let (qc, qs, _) = quantize_rows_e4m3(x, d);
                for (bi, &len) in lens.iter().enumerate() {
                    for j in 0..new_tokens {
                        let pos = len + j;
                        let slot = if max_pages == 0 {
                            bi * capacity + pos
                        } else {
                            table[bi * max_pages + pos / page] as usize * page + pos % page
                        };
                        for h in 0..hkv {
                            let src = (bi * new_tokens + j) * hkv + h;
                            let dst = slot * hkv + h;
                            want[dst * d..(dst + 1) * d]
                                .copy_from_slice(&qc[src * d..(src + 1) * d]);
                            want_scale[dst] = qs[src];
                        }
                    }
                }
                let got = down(&s, dev);
                let got_scale = down(&s, dev_scale);
                let what = format!("{dtype:?} d{d} page {page} {name}");
                assert!(
                    got == want,
                    "{what}: codes differ from the CPU quantizer's or stray writes"
                );
                assert!(
                    got_scale
                        .iter()
                        .zip(&want_scale)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: scales differ"
                );
            }
            println!("e4m3 append {dtype:?} d{d} page {page}: bit-exact");
        }
    }
}

/// Small e4m3-cache calls for compute-sanitizer: paged with splits, contiguous with
/// one, each head dim.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_fp8_cache_small_for_sanitizers() {
    let cases = vec![
        case(HalfType::F16, (8, 2), 128, 3, &[1, 7, 300], 16, true),
        case(HalfType::Bf16, (4, 4), 64, 1, &[5, 40], 0, false),
        case(HalfType::F16, (2, 1), 256, 2, &[70, 3], 64, true),
    ];
    run_all_fp8(&cases);
}
