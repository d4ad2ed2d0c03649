//! The sizes of one attention problem, shared by validation, the reference and the checks.

/// Batch, sequence lengths, head counts and head dimension of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttnShape {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Self-attention with one head count and one sequence length.
    pub fn square(batch: usize, heads: usize, seqlen: usize, head_dim: usize) -> AttnShape {
        AttnShape {
            batch,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            heads_q: heads,
            heads_kv: heads,
            head_dim,
        }
    }

    /// Query heads per key/value head (1 for MHA, Hq for MQA; a hand-made shape with no
    /// KV heads counts as one, so this never divides by zero).
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv.max(1)
    }

    /// Elements of Q (and O): `B · Sq · Hq · D`.
    pub fn q_len(&self) -> usize {
        self.batch * self.seqlen_q * self.heads_q * self.head_dim
    }

    /// Elements of K (and V): `B · Sk · Hkv · D`.
    pub fn kv_len(&self) -> usize {
        self.batch * self.seqlen_k * self.heads_kv * self.head_dim
    }

    /// Elements of the LSE: `B · Hq · Sq`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seqlen_q
    }

    /// Keys query row `i` sees: all of them, or with causal masking (aligned bottom-right,
    /// row `i` sees keys `j <= i + Sk − Sq`) a prefix, possibly empty.
    pub fn visible_keys(&self, i: usize, causal: bool) -> usize {
        if causal {
            (i + 1 + self.seqlen_k)
                .saturating_sub(self.seqlen_q)
                .min(self.seqlen_k)
        } else {
            self.seqlen_k
        }
    }

    /// The keys query row `i` sees with causal masking (or not) and `window`
    /// (FlashAttention's `window_size`, bottom-right aligned like causal masking):
    /// `d − left ..= d + right` for the diagonal `d = i + Sk − Sq`, within `0..Sk`, the
    /// right side 0 when causal. Empty when the row sees no key.
    pub fn visible_range(
        &self,
        i: usize,
        causal: bool,
        window: crate::host::tensor::Window,
    ) -> std::ops::Range<usize> {
        let d = i as i128 + self.seqlen_k as i128 - self.seqlen_q as i128;
        let right = if causal {
            Some(0)
        } else {
            window.right.map(i128::from)
        };
        let hi = right.map_or(self.seqlen_k as i128, |r| {
            (d + r + 1).min(self.seqlen_k as i128)
        });
        let lo = window.left.map_or(0, |l| (d - i128::from(l)).max(0));
        let hi = hi.max(lo);
        lo as usize..hi as usize
    }

    /// FLOPs of a forward pass: 2 for each multiply-add of QKᵀ and of PV, over the
    /// visible (query, key) pairs only.
    pub fn flops(&self, causal: bool) -> f64 {
        self.flops_in_window(causal, crate::host::tensor::Window::FULL)
    }

    /// [`AttnShape::flops`] with a key window: over each row's
    /// [`AttnShape::visible_range`].
    pub fn flops_in_window(&self, causal: bool, window: crate::host::tensor::Window) -> f64 {
        let pairs: usize = if window != crate::host::tensor::Window::FULL {
            (0..self.seqlen_q)
                .map(|i| self.visible_range(i, causal, window).len())
                .sum()
        } else if causal {
            (0..self.seqlen_q).map(|i| self.visible_keys(i, true)).sum()
        } else {
            self.seqlen_q * self.seqlen_k
        };
        4.0 * (self.batch * self.heads_q * pairs * self.head_dim) as f64
    }

    /// Bytes of Q, K, V and O, each moved once, for `elem_bytes`-byte elements.
    pub fn io_bytes(&self, elem_bytes: usize) -> usize {
        elem_bytes * 2 * (self.q_len() + self.kv_len())
    }
}

impl std::fmt::Display for AttnShape {
    /// `B2 H8 S512 D64`, or `B2 H8/2 Sq113 Sk1000 D64` when heads or lengths differ.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "B{} H{}", self.batch, self.heads_q)?;
        if self.heads_kv != self.heads_q {
            write!(f, "/{}", self.heads_kv)?;
        }
        if self.seqlen_q == self.seqlen_k {
            write!(f, " S{}", self.seqlen_q)?;
        } else {
            write!(f, " Sq{} Sk{}", self.seqlen_q, self.seqlen_k)?;
        }
        write!(f, " D{}", self.head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_bound_each_rows_keys() {
        use crate::host::tensor::Window;
        // Sq 4, Sk 10: row i's diagonal is key i + 6.
        let s = AttnShape {
            batch: 1,
            seqlen_q: 4,
            seqlen_k: 10,
            heads_q: 1,
            heads_kv: 1,
            head_dim: 8,
        };
        let w = |l, r| Window::from_flash(l, r);
        assert_eq!(s.visible_range(0, false, Window::FULL), 0..10);
        assert_eq!(s.visible_range(0, true, Window::FULL), 0..7);
        assert_eq!(s.visible_range(3, true, w(2, -1)), 7..10);
        assert_eq!(s.visible_range(0, false, w(0, 0)), 6..7);
        assert_eq!(s.visible_range(1, false, w(1, 2)), 6..10);
        assert_eq!(s.visible_range(0, false, w(-1, 1)), 0..8);
        // Causal fixes the right side at 0 whatever the window says.
        assert_eq!(s.visible_range(0, true, w(3, 5)), 3..7);
        // Sq > Sk: row 0's diagonal is key −6, before every key: nothing.
        let tall = AttnShape {
            seqlen_q: 10,
            seqlen_k: 4,
            ..s
        };
        assert!(tall.visible_range(0, true, w(100, 0)).is_empty());
        assert!(tall.visible_range(0, false, w(-1, 2)).is_empty());
        assert_eq!(tall.visible_range(0, false, w(-1, 7)), 0..2);
        assert_eq!(tall.visible_range(9, false, w(1, 0)), 2..4);
        // The counts agree with visible_keys without a window.
        for i in 0..4 {
            assert_eq!(
                s.visible_range(i, true, Window::FULL).len(),
                s.visible_keys(i, true)
            );
        }
    }

    #[test]
    fn causal_pairs_are_counted_bottom_right() {
        let s = AttnShape {
            seqlen_q: 2,
            seqlen_k: 5,
            ..AttnShape::square(1, 1, 0, 8)
        };
        assert_eq!((s.visible_keys(0, true), s.visible_keys(1, true)), (4, 5));
        let tall = AttnShape {
            seqlen_q: 5,
            seqlen_k: 2,
            ..s
        };
        let seen: Vec<usize> = (0..5).map(|i| tall.visible_keys(i, true)).collect();
        assert_eq!(seen, [0, 0, 0, 1, 2]);
        assert_eq!(tall.flops(true), 4.0 * 3.0 * 8.0);
        let sq = AttnShape::square(2, 4, 100, 64);
        assert_eq!(sq.flops(false), 4.0 * 2.0 * 4.0 * 100.0 * 100.0 * 64.0);
        assert_eq!(sq.flops(true), 4.0 * 2.0 * 4.0 * 5050.0 * 64.0);
    }

    #[test]
    fn display_is_compact() {
        assert_eq!(
            AttnShape::square(2, 8, 512, 64).to_string(),
            "B2 H8 S512 D64"
        );
        let g = AttnShape {
            heads_kv: 2,
            seqlen_k: 1000,
            ..AttnShape::square(1, 8, 113, 128)
        };
        assert_eq!(g.to_string(), "B1 H8/2 Sq113 Sk1000 D128");
    }
}
