//! Float64 CPU reference with the kernels' exact semantics, plus the helpers tests use to
//! make inputs and compare outputs: a deterministic PRNG, f16/bf16 conversions, NaN
//! poison patterns and a relative L2 error.
//!
//! Semantics (FlashAttention's): `out[b, i, h, :] = softmax_j(scale · q[b,i,h,:] · k[b,j,h/g,:])
//! v[b,j,h/g,:]` with `g = Hq / Hkv`. Causal masking is aligned bottom-right: query row `i`
//! sees key `j` iff `j <= i + (Sk − Sq)`. A row that sees no key outputs zeros and has
//! LSE −∞. `lse[b, h, i] = ln Σ_j exp(scale · s_ij)` over the visible keys. With a soft cap
//! `c` every scaled score `x` becomes `c · tanh(x / c)` first, in the LSE too.

use crate::host::tensor::Window;
use crate::kernels::attention::HalfType;
use crate::shape::AttnShape;
use half::{bf16, f16};

/// Output of [`attention_f64`].
#[derive(Debug, Clone, PartialEq)]
pub struct RefOutput {
    /// Contiguous `[B, Sq, Hq, D]`.
    pub out: Vec<f64>,
    /// Contiguous `[B, Hq, Sq]`.
    pub lse: Vec<f64>,
}

/// Forward attention in float64. `q` is contiguous `[B, Sq, Hq, D]`, `k` and `v` are
/// contiguous `[B, Sk, Hkv, D]`.
///
/// # Panics
/// If a slice length does not match `shape`, or `heads_q` is not a multiple of `heads_kv`.
pub fn attention_f64(
    shape: &AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    causal: bool,
) -> RefOutput {
    attention_f64_window(shape, q, k, v, scale, causal, Window::FULL)
}

/// [`attention_f64`] with a key window: row `i` sees the keys of
/// [`AttnShape::visible_range`].
///
/// # Panics
/// As [`attention_f64`].
pub fn attention_f64_window(
    shape: &AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    causal: bool,
    window: Window,
) -> RefOutput {
    let params = RefParams {
        scale,
        causal,
        window,
        softcap: None,
    };
    attention_f64_with(shape, q, k, v, &params)
}

/// What a reference call computes besides its inputs: the kernels' options.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RefParams {
    pub scale: f64,
    pub causal: bool,
    pub window: Window,
    /// Soft-capping: each scaled score `x` becomes `cap · tanh(x / cap)`.
    pub softcap: Option<f64>,
}

/// [`attention_f64`] with every option of [`RefParams`].
///
/// # Panics
/// As [`attention_f64`].
pub fn attention_f64_with(
    shape: &AttnShape,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    params: &RefParams,
) -> RefOutput {
    let &RefParams {
        scale,
        causal,
        window,
        softcap,
    } = params;
    let &AttnShape {
        batch,
        seqlen_q: sq,
        seqlen_k: sk,
        heads_q: hq,
        heads_kv: hkv,
        head_dim: d,
    } = shape;
    assert_eq!(q.len(), shape.q_len(), "q length");
    assert_eq!(k.len(), shape.kv_len(), "k length");
    assert_eq!(v.len(), shape.kv_len(), "v length");
    assert!(
        hkv > 0 && hq.is_multiple_of(hkv),
        "heads_q {hq} not a multiple of heads_kv {hkv}"
    );
    let group = hq / hkv;

    let mut out = vec![0.0; shape.q_len()];
    let mut lse = vec![f64::NEG_INFINITY; shape.lse_len()];
    let mut scores = vec![0.0; sk];
    for b in 0..batch {
        for h in 0..hq {
            let kh = h / group;
            for i in 0..sq {
                let keys = shape.visible_range(i, causal, window);
                let (first, n) = (keys.start, keys.len());
                if n == 0 {
                    continue; // zeros and -inf already in place
                }
                let qo = ((b * sq + i) * hq + h) * d;
                let qrow = &q[qo..qo + d];
                for (j, s) in scores[..n].iter_mut().enumerate() {
                    let ko = ((b * sk + first + j) * hkv + kh) * d;
                    let x = scale * dot(qrow, &k[ko..ko + d]);
                    *s = softcap.map_or(x, |cap| cap * (x / cap).tanh());
                }
                // Subtracting the row max keeps exp() in range for any score magnitude.
                let m = scores[..n]
                    .iter()
                    .copied()
                    .fold(f64::NEG_INFINITY, f64::max);
                let mut sum = 0.0;
                let orow = &mut out[qo..qo + d];
                for (j, &s) in scores[..n].iter().enumerate() {
                    let p = (s - m).exp();
                    sum += p;
                    let vo = ((b * sk + first + j) * hkv + kh) * d;
                    for (o, &x) in orow.iter_mut().zip(&v[vo..vo + d]) {
                        *o += p * x;
                    }
                }
                for o in orow.iter_mut() {
                    *o /= sum;
                }
                lse[(b * hq + h) * sq + i] = m + sum.ln();
            }
        }
    }
    RefOutput { out, lse }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Relative L2 error `‖got − want‖ / ‖want‖`.
///
/// Returns +∞ if the lengths differ, if `got` is NaN or infinite where `want` is finite, or
/// if a non-finite `want` (an LSE of −∞, say) is not matched exactly (NaN matches NaN).
/// Matched non-finite entries contribute nothing. If `want` is all zero the result is the
/// absolute error `‖got‖` (over the finite entries), so zero outputs can still be compared.
pub fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        if !w.is_finite() {
            if g == w || (g.is_nan() && w.is_nan()) {
                continue;
            }
            return f64::INFINITY;
        }
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// SplitMix64: tiny, fast, and statistically fine for test inputs; fully reproducible
/// from its seed so a failing randomized test can be replayed.
#[derive(Debug, Clone)]
pub struct Rng {
    seed: u64,
    state: u64,
}

impl Rng {
    /// A generator that always yields the same sequence for the same seed.
    pub fn new(seed: u64) -> Rng {
        Rng { seed, state: seed }
    }

    /// A generator seeded from the clock and a process-wide counter (so two calls in the
    /// same nanosecond still differ). Print [`Rng::seed`] so a failure can be replayed.
    pub fn from_entropy() -> Rng {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let c = COUNTER.fetch_add(1, Ordering::Relaxed);
        // Mix so consecutive counters give unrelated seeds.
        let seed = Rng::new(nanos ^ c.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64();
        Rng::new(seed)
    }

    /// The seed this generator was created with.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal N(0, 1) by Box-Muller.
    pub fn normal(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the log is finite.
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// f16 NaN with every mantissa bit set. Kernels' own NaNs are canonical (0x7E00), so an
/// output still holding this pattern was never written.
pub const POISON_F16: u16 = 0x7FFF;
/// bf16 NaN with every mantissa bit set (canonical is 0x7FC0); see [`POISON_F16`].
pub const POISON_BF16: u16 = 0x7FFF;

/// The poison pattern for `dtype`.
pub fn poison(dtype: HalfType) -> u16 {
    match dtype {
        HalfType::F16 => POISON_F16,
        HalfType::Bf16 => POISON_BF16,
    }
}

/// Exact values of 16-bit floats given as bits.
pub fn half_bits_to_f64(bits: &[u16], dtype: HalfType) -> Vec<f64> {
    match dtype {
        HalfType::F16 => bits.iter().map(|&b| f16::from_bits(b).to_f64()).collect(),
        HalfType::Bf16 => bits.iter().map(|&b| bf16::from_bits(b).to_f64()).collect(),
    }
}

/// Rounds to the nearest 16-bit float (ties to even) and returns the bits.
pub fn f64_to_half_bits(values: &[f64], dtype: HalfType) -> Vec<u16> {
    match dtype {
        HalfType::F16 => values.iter().map(|&x| f16::from_f64(x).to_bits()).collect(),
        HalfType::Bf16 => values
            .iter()
            .map(|&x| bf16::from_f64(x).to_bits())
            .collect(),
    }
}

/// `n` N(0, 1) draws rounded to `dtype`: the bits to upload, and their exact values for the
/// reference (so rounding of the inputs is not counted as kernel error).
pub fn random_half(rng: &mut Rng, n: usize, dtype: HalfType) -> (Vec<u16>, Vec<f64>) {
    let draws: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
    let bits = f64_to_half_bits(&draws, dtype);
    let values = half_bits_to_f64(&bits, dtype);
    (bits, values)
}

/// Whether any element is a NaN (poison included).
pub fn contains_nan(bits: &[u16], dtype: HalfType) -> bool {
    match dtype {
        HalfType::F16 => bits.iter().any(|&b| f16::from_bits(b).is_nan()),
        HalfType::Bf16 => bits.iter().any(|&b| bf16::from_bits(b).is_nan()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn normals(rng: &mut Rng, n: usize) -> Vec<f64> {
        (0..n).map(|_| rng.normal()).collect()
    }

    /// Inputs for `s`, from a fixed seed.
    fn inputs(s: &AttnShape, seed: u64) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut rng = Rng::new(seed);
        (
            normals(&mut rng, s.q_len()),
            normals(&mut rng, s.kv_len()),
            normals(&mut rng, s.kv_len()),
        )
    }

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let ok = (g == w) || (g - w).abs() <= tol * (1.0 + w.abs());
            assert!(ok, "element {i}: got {g}, want {w}");
        }
    }

    /// Second, independent implementation: explicit 4-d indexing, a full masked score
    /// matrix per (b, h) with -inf entries, a naive softmax without max subtraction, and
    /// P · V as a matrix product.
    fn brute_force(
        s: &AttnShape,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        scale: f64,
        causal: bool,
    ) -> RefOutput {
        let AttnShape {
            batch,
            seqlen_q: sq,
            seqlen_k: sk,
            heads_q: hq,
            heads_kv: hkv,
            head_dim: d,
        } = *s;
        let at = |x: &[f64], seq: usize, heads: usize, b: usize, t: usize, h: usize, e: usize| {
            x[b * seq * heads * d + t * heads * d + h * d + e]
        };
        let mut out = vec![0.0; s.q_len()];
        let mut lse = vec![0.0; s.lse_len()];
        for b in 0..batch {
            for h in 0..hq {
                let kh = h * hkv / hq;
                let mut p = vec![vec![f64::NEG_INFINITY; sk]; sq];
                for (i, row) in p.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        let visible = !causal || (j as i64) <= i as i64 + sk as i64 - sq as i64;
                        if visible {
                            *x = scale
                                * (0..d)
                                    .map(|e| {
                                        at(q, sq, hq, b, i, h, e) * at(k, sk, hkv, b, j, kh, e)
                                    })
                                    .sum::<f64>();
                        }
                    }
                }
                for (i, row) in p.iter_mut().enumerate() {
                    let total: f64 = row.iter().map(|x| x.exp()).sum();
                    lse[b * hq * sq + h * sq + i] = total.ln();
                    for x in row.iter_mut() {
                        *x = if total > 0.0 { x.exp() / total } else { 0.0 };
                    }
                }
                for i in 0..sq {
                    for e in 0..d {
                        out[b * sq * hq * d + i * hq * d + h * d + e] =
                            (0..sk).map(|j| p[i][j] * at(v, sk, hkv, b, j, kh, e)).sum();
                    }
                }
            }
        }
        RefOutput { out, lse }
    }

    #[test]
    fn matches_brute_force() {
        for (s, causal) in [
            (shape(2, 5, 7, 4, 2, 8), false),
            (shape(2, 5, 7, 4, 2, 8), true),
            (shape(1, 7, 3, 3, 1, 5), true),
            (shape(1, 6, 6, 2, 2, 16), true),
            (shape(3, 1, 9, 2, 1, 4), true),
        ] {
            let (q, k, v) = inputs(&s, 42);
            let scale = 0.7;
            let got = attention_f64(&s, &q, &k, &v, scale, causal);
            let want = brute_force(&s, &q, &k, &v, scale, causal);
            assert_close(&got.out, &want.out, 1e-12);
            assert_close(&got.lse, &want.lse, 1e-12);
        }
    }

    #[test]
    fn uniform_scores_average_v() {
        let s = shape(2, 3, 6, 2, 2, 4);
        let (_, k, v) = inputs(&s, 7);
        let q = vec![0.0; s.q_len()];
        let r = attention_f64(&s, &q, &k, &v, 0.5, false);
        for b in 0..2 {
            for i in 0..3 {
                for h in 0..2 {
                    for e in 0..4 {
                        let mean: f64 = (0..6)
                            .map(|j| v[((b * 6 + j) * 2 + h) * 4 + e])
                            .sum::<f64>()
                            / 6.0;
                        let got = r.out[((b * 3 + i) * 2 + h) * 4 + e];
                        assert!((got - mean).abs() < 1e-14, "{got} vs {mean}");
                    }
                    assert!((r.lse[(b * 2 + h) * 3 + i] - 6f64.ln()).abs() < 1e-14);
                }
            }
        }
    }

    #[test]
    fn causal_square_first_row_is_v0() {
        let s = shape(2, 4, 4, 3, 3, 8);
        let (q, k, v) = inputs(&s, 3);
        let r = attention_f64(&s, &q, &k, &v, 0.3, true);
        for b in 0..2 {
            for h in 0..3 {
                let o = ((b * 4) * 3 + h) * 8;
                assert_eq!(&r.out[o..o + 8], &v[o..o + 8]);
                // One visible key: lse is that key's scaled score.
                let sc = 0.3 * dot(&q[o..o + 8], &k[o..o + 8]);
                assert!((r.lse[(b * 3 + h) * 4] - sc).abs() < 1e-14);
            }
        }
    }

    #[test]
    fn causal_bottom_right_alignment() {
        // Sq = 2, Sk = 5: row 0 sees keys 0..=3, row 1 sees all five.
        let s = shape(1, 2, 5, 1, 1, 4);
        let (q, k, v) = inputs(&s, 11);
        let r = attention_f64(&s, &q, &k, &v, 0.5, true);
        let full = attention_f64(&s, &q, &k, &v, 0.5, false);
        let s4 = shape(1, 2, 4, 1, 1, 4);
        let first4 = attention_f64(&s4, &q, &k[..16], &v[..16], 0.5, false);
        assert_eq!(&r.out[..4], &first4.out[..4]);
        assert_eq!(r.lse[0], first4.lse[0]);
        assert_eq!(&r.out[4..], &full.out[4..]);
        assert_eq!(r.lse[1], full.lse[1]);
        // And row 0 really differs from the unmasked result.
        assert!(rel_l2(&r.out[..4], &full.out[..4]) > 1e-6);
    }

    #[test]
    fn fully_masked_rows() {
        // Sq = 5, Sk = 2: offset -3, rows 0..=2 see nothing, row 3 sees key 0.
        let s = shape(1, 5, 2, 2, 1, 4);
        let (q, k, v) = inputs(&s, 5);
        let r = attention_f64(&s, &q, &k, &v, 0.5, true);
        for h in 0..2 {
            for i in 0..3 {
                let o = (i * 2 + h) * 4;
                assert_eq!(&r.out[o..o + 4], &[0.0; 4]);
                assert_eq!(r.lse[h * 5 + i], f64::NEG_INFINITY);
            }
            let o = (3 * 2 + h) * 4;
            assert_eq!(&r.out[o..o + 4], &v[..4]);
            assert!(r.lse[h * 5 + 3].is_finite() && r.lse[h * 5 + 4].is_finite());
        }
        let want = brute_force(&s, &q, &k, &v, 0.5, true);
        assert!(rel_l2(&r.out, &want.out) < 1e-14);
        assert!(rel_l2(&r.lse, &want.lse) < 1e-14);
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv() {
        let (hq, hkv, d, sk) = (8, 2, 8, 6);
        let s = shape(2, 5, sk, hq, hkv, d);
        let (q, k, v) = inputs(&s, 9);
        let repeat = |x: &[f64]| {
            let mut r = Vec::with_capacity(x.len() * 4);
            for bt in 0..2 * sk {
                for h in 0..hq {
                    let o = (bt * hkv + h / 4) * d;
                    r.extend_from_slice(&x[o..o + d]);
                }
            }
            r
        };
        let mha = shape(2, 5, sk, hq, hq, d);
        for causal in [false, true] {
            let g = attention_f64(&s, &q, &k, &v, 0.4, causal);
            let m = attention_f64(&mha, &q, &repeat(&k), &repeat(&v), 0.4, causal);
            assert_eq!(g, m);
        }
    }

    #[test]
    fn lse_is_log_sum_exp() {
        let s = shape(1, 3, 4, 2, 2, 4);
        let (q, k, _) = inputs(&s, 13);
        let v = vec![0.0; s.kv_len()];
        let r = attention_f64(&s, &q, &k, &v, 0.9, false);
        for h in 0..2 {
            for i in 0..3 {
                let qo = (i * 2 + h) * 4;
                let naive: f64 = (0..4)
                    .map(|j| {
                        let ko = (j * 2 + h) * 4;
                        (0.9 * dot(&q[qo..qo + 4], &k[ko..ko + 4])).exp()
                    })
                    .sum::<f64>()
                    .ln();
                assert!((r.lse[h * 3 + i] - naive).abs() < 1e-13);
            }
        }
    }

    #[test]
    fn large_scores_stay_finite() {
        // Scores around ±1e4: exp() without the max subtraction would overflow.
        let s = shape(1, 4, 8, 1, 1, 8);
        let (q, k, v) = inputs(&s, 17);
        let r = attention_f64(&s, &q, &k, &v, 1e4, false);
        assert!(r.out.iter().chain(&r.lse).all(|x| x.is_finite()));
        // The softmax is then nearly one-hot: every output row is close to some V row.
        for i in 0..4 {
            let row = &r.out[i * 8..i * 8 + 8];
            let best = (0..8)
                .map(|j| rel_l2(row, &v[j * 8..j * 8 + 8]))
                .fold(f64::INFINITY, f64::min);
            assert!(best < 1e-6, "row {i}: {best}");
        }
    }

    #[test]
    fn rel_l2_cases() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_l2(&[3.0, 0.0], &[0.0, 4.0]) - 1.25).abs() < 1e-15);
        assert_eq!(rel_l2(&[1.0, f64::NAN], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_l2(&[1.0, f64::INFINITY], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_l2(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        // All-zero reference: absolute norm.
        assert_eq!(rel_l2(&[3.0, 4.0], &[0.0, 0.0]), 5.0);
        assert_eq!(rel_l2(&[], &[]), 0.0);
        // -inf LSE entries must be matched exactly.
        let ninf = f64::NEG_INFINITY;
        assert_eq!(rel_l2(&[ninf, 1.0], &[ninf, 1.0]), 0.0);
        assert_eq!(rel_l2(&[0.0, 1.0], &[ninf, 1.0]), f64::INFINITY);
        assert_eq!(rel_l2(&[f64::NAN, 1.0], &[ninf, 1.0]), f64::INFINITY);
    }

    #[test]
    fn splitmix64_known_values() {
        // Reference outputs of SplitMix64 seeded with 0.
        let mut r = Rng::new(0);
        assert_eq!(r.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(r.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(r.seed(), 0);
    }

    #[test]
    fn rng_is_deterministic_and_distributed() {
        let mut a = Rng::new(123);
        let mut b = Rng::new(123);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut r = Rng::from_entropy();
        println!("rng seed {:#x}", r.seed());
        let n = 200_000;
        let (mut su, mut sn, mut sn2) = (0.0, 0.0, 0.0);
        for _ in 0..n {
            let u = r.uniform();
            assert!((0.0..1.0).contains(&u));
            su += u;
            let x = r.normal();
            assert!(x.is_finite());
            sn += x;
            sn2 += x * x;
        }
        let n = n as f64;
        // Six-sigma bounds: a correct generator essentially never fails these.
        assert!(
            (su / n - 0.5).abs() < 6.0 * (1.0 / 12f64).sqrt() / n.sqrt(),
            "uniform mean"
        );
        assert!((sn / n).abs() < 6.0 / n.sqrt(), "normal mean {}", sn / n);
        assert!(
            (sn2 / n - 1.0).abs() < 6.0 * 2f64.sqrt() / n.sqrt(),
            "normal var {}",
            sn2 / n
        );
        assert_ne!(Rng::from_entropy().seed(), Rng::from_entropy().seed());
    }

    #[test]
    fn half_conversions() {
        for dtype in [HalfType::F16, HalfType::Bf16] {
            let mut rng = Rng::new(1);
            let (bits, vals) = random_half(&mut rng, 1000, dtype);
            assert_eq!(half_bits_to_f64(&bits, dtype), vals);
            assert_eq!(f64_to_half_bits(&vals, dtype), bits);
            assert!(!contains_nan(&bits, dtype));
            // Rounding, not truncation: the values are close to the N(0,1) draws.
            let mut again = Rng::new(1);
            let draws: Vec<f64> = (0..1000).map(|_| again.normal()).collect();
            let eps = if dtype == HalfType::F16 {
                2f64.powi(-11)
            } else {
                2f64.powi(-8)
            };
            for (v, x) in vals.iter().zip(&draws) {
                assert!((v - x).abs() <= eps * x.abs() + 1e-7, "{v} vs {x}");
            }
            let mut poisoned = bits.clone();
            poisoned[500] = poison(dtype);
            assert!(contains_nan(&poisoned, dtype));
            assert!(half_bits_to_f64(&[poison(dtype)], dtype)[0].is_nan());
        }
        assert_eq!(f64_to_half_bits(&[1.0], HalfType::F16), vec![0x3C00]);
        assert_eq!(f64_to_half_bits(&[1.0], HalfType::Bf16), vec![0x3F80]);
        assert_ne!(POISON_F16, f16::NAN.to_bits());
        assert_ne!(POISON_BF16, bf16::NAN.to_bits());
    }
}
