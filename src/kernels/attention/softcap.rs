//! Logit soft-capping (Gemma 2, Grok; FlashAttention's `softcap`): a score
//! `x = q·k · scale` becomes `cap · tanh(x / cap)` before the mask and the softmax.
//!
//! The kernels keep `t = tanh(q·k · pre)`, `pre = scale / cap`, in the score's register
//! and run the softmax with `cap` where the softmax scale goes ([`ScoreScaling`]):
//! `exp2(t · cap·log2 e − m)` is the capped score's exponential, and the log-sum-exp comes
//! out in the capped scores' units with no change to the epilogue. `|t| ≤ 1`, so the
//! folded exponent ([`FwdConfig::fold_scale`](super::FwdConfig::fold_scale)) cannot
//! overflow whatever the inputs.
//!
//! `tanh` is MUFU's (`tanh.approx.f32`, as FlashAttention's kernels take it): one more
//! special-function operation per score beside the exponential. Its error (about 2^-11
//! of `t`) is that of rounding `t` to f16: against float64 the f16 outputs of capped calls
//! are as close as uncapped ones (`bench/RESULTS.md`). Measured and not kept: the exact
//! `1 − 2 / (1 + 2^(2x·log2 e))` (an `ex2` and a reciprocal, both MUFU) ran 15–25%
//! slower for the same output error; `tanh.approx.f16x2` is one MUFU operation per half
//! on sm_90; more exponentials on the FMA pipe (one in 2 to 8) gained nothing.

use super::rows::Slab;
use crate::ptx::{F32, Kernel, Reg};

/// Replaces every score of `tiles` by `tanh(score · pre)`.
pub fn cap_scores(k: &mut Kernel, tiles: &Slab, pre: Reg<F32>) {
    for tile in tiles {
        for &v in tile {
            k.mul_to(v, v, pre);
            k.tanh_to(v, v);
        }
    }
}

/// The factors a kernel's arguments carry for a call's scores: softmax scale `scale`,
/// soft-capped at `cap` or not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreScaling {
    /// What multiplies the kernel's score in the log-sum-exp: `scale`, or `cap` when the
    /// scores are capped (the kernel's score is then `tanh(q·k · pre)`).
    pub scale: f32,
    /// `scale · log2 e`: the exponent's factor.
    pub scale_log2: f32,
    /// `scale / cap`, the factor inside the `tanh`; 0 without a cap.
    pub softcap_pre: f32,
}

impl ScoreScaling {
    /// For softmax scale `scale` and an optional cap (both checked finite and positive by
    /// the host, with `scale / cap` a normal float and `cap · log2 e` finite).
    pub fn new(scale: f32, softcap: Option<f32>) -> ScoreScaling {
        let log2e = std::f32::consts::LOG2_E;
        match softcap {
            None => ScoreScaling {
                scale,
                scale_log2: scale * log2e,
                softcap_pre: 0.0,
            },
            Some(cap) => ScoreScaling {
                scale: cap,
                scale_log2: cap * log2e,
                softcap_pre: (scale as f64 / cap as f64) as f32,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capped_scores_take_the_cap_as_their_scale() {
        let plain = ScoreScaling::new(0.125, None);
        assert_eq!(plain.scale, 0.125);
        assert_eq!(plain.softcap_pre, 0.0);
        let capped = ScoreScaling::new(0.125, Some(50.0));
        assert_eq!(capped.scale, 50.0);
        assert_eq!(capped.scale_log2, 50.0 * std::f32::consts::LOG2_E);
        assert_eq!(capped.softcap_pre, 0.0025);
        // cap · tanh(x · pre) against cap · tanh(x · scale / cap) for a raw score x.
        let x = 37.0f64;
        let kernel = capped.scale as f64 * (x * capped.softcap_pre as f64).tanh();
        let want = 50.0 * (x * 0.125 / 50.0).tanh();
        assert!((kernel - want).abs() < 1e-6, "{kernel} vs {want}");
    }

    #[test]
    fn cap_scores_emits_a_product_and_a_tanh_per_score() {
        let mut k = Kernel::new("t");
        let pre = k.mov(0.5f32);
        let tiles: Slab = (0..2)
            .map(|_| std::array::from_fn(|_| k.mov(1f32)))
            .collect();
        cap_scores(&mut k, &tiles, pre);
        let ptx = k.finish().expect("builds").entry;
        assert_eq!(ptx.matches("tanh.approx.f32").count(), 8, "{ptx}");
        let products = ptx.lines().filter(|l| l.trim_start().starts_with("mul"));
        assert_eq!(products.count(), 8, "{ptx}");
    }
}
