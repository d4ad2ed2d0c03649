//! Variable-length forward attention: a batch of sequences of different lengths packed
//! one after another without padding (FlashAttention's `varlen` layout), in one launch.
//!
//! `q` and `o` are views of batch extent 1, `[1, total_q, Hq, D]`; `k` and `v`
//! `[1, total_k, Hkv, D]`. Sequence `b` is query rows `cu_seqlens_q[b]..cu_seqlens_q[b+1]`
//! and key rows `cu_seqlens_k[b]..cu_seqlens_k[b+1]`, attended to exactly as a dense call
//! with those two lengths would (causal masking aligned bottom-right per sequence; a
//! sequence with queries and no keys gets zeros and LSE −∞). The LSE is float32
//! `[Hq, total_q]`. Query rows no sequence covers are left untouched.
//!
//! A batch shaped like decode steps (at most 16 queries a sequence, with as many keys on
//! average as make a dense call take the decode kernels) runs on the split-KV decode
//! kernels' packed variants and, with several splits, their merge: each K/V byte is read
//! once for its whole query group, and a long sequence is spread over the SMs (one
//! sequence of 32768 keys against one query: 38 µs rather than 246 on an H200). The
//! results are those of the forward kernels, to their tolerances.
//!
//! Checks, after every check of a dense call on the four views (in its order; its size
//! limit on Sq and Sk, 2^25, bounds the packed totals `total_q` and `total_k`, and its
//! message names them `seqlen_q` and `seqlen_k`):
//!
//! 1. the views have batch extent 1 ([`Error::ShapeMismatch`]);
//! 2. at least one sequence ([`Error::EmptyDimension`]), at most 65535, and a longest
//!    query sequence from 1 to 2^25 ([`Error::InvalidArgument`]);
//! 3. the offset arrays: non-null ([`Error::NullPointer`]), 4-byte aligned
//!    ([`Error::Misaligned`]), and not overlapping `o` ([`Error::InvalidArgument`]);
//! 4. the LSE: non-null, 4-byte aligned, overlapping neither the inputs, `o` nor the
//!    offset arrays;
//! 5. with host copies of the offsets: `batch + 1` entries each
//!    ([`Error::ShapeMismatch`]), starting at 0 or more, non-decreasing, ending inside
//!    the tensors, and no query sequence longer than `max_seqlen_q`
//!    ([`Error::InvalidArgument`]).
//!
//! Without host copies the kernels clamp each sequence's rows to the tensors, so no
//! offset makes them touch memory outside the views; but offsets that are not
//! non-decreasing then give empty, truncated or overlapping sequences rather than an
//! error (with `[0, 100, 50, 300]` sequences 0 and 2 both write rows 50..100 of `o` and
//! the LSE, in no set order), and a query sequence longer than `max_seqlen_q` has rows
//! left unwritten or computed as other positions (which depends on the kernels the call
//! takes). Pass host copies to have those refused.
//!
//! Each sequence sees only its own keys. On the sm90 path a sequence's last key tile is
//! read whole through TMA, so it holds the rows that follow the sequence (the next
//! sequence's, or for the last one whatever the tensors hold after it; zero-filled only
//! past the tensors' end); they are masked to probability 0, and the kernel zeroes their
//! V rows in shared memory before `P·V`, so that NaN or infinities there cannot turn
//! `0 · v` into NaN. The sm80 path reads zeros there instead.

use cudarc::driver::sys::CUstream;

use super::attention::Attention;
use super::tensor::{AttentionParams, LseView, TensorView};
use super::validate::{
    FwdProblem, LSE_ALIGN, Packed, Runs, byte_range_of, check_pointer, check_sequence_counts,
    lse_byte_range, overlaps, validate_fwd,
};
use crate::error::{Error, Result};

/// Where the sequences of a packed batch start: device `i32` arrays of `batch + 1`
/// cumulative offsets each (`cu_seqlens_q[b + 1] − cu_seqlens_q[b]` is sequence `b`'s
/// query count), as FlashAttention's variable-length API takes them.
#[derive(Debug, Clone, Copy)]
pub struct Varlen<'a> {
    /// Device address of `i32 [batch + 1]` query offsets.
    pub cu_seqlens_q: u64,
    /// Device address of `i32 [batch + 1]` key offsets.
    pub cu_seqlens_k: u64,
    /// The number of sequences.
    pub batch: usize,
    /// At least the longest query sequence: it sizes the grid.
    pub max_seqlen_q: usize,
    /// Host copies of the two arrays, checked before anything runs when given.
    pub host: Option<VarlenHost<'a>>,
}

/// Host copies of a [`Varlen`]'s offsets, as on the device.
#[derive(Debug, Clone, Copy)]
pub struct VarlenHost<'a> {
    pub cu_seqlens_q: &'a [i32],
    pub cu_seqlens_k: &'a [i32],
}

/// Checks a variable-length forward call; see the module docs for the order of checks.
pub fn validate_varlen(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    o: &TensorView,
    lse: Option<&LseView>,
    varlen: &Varlen,
    params: &AttentionParams,
) -> Result<FwdProblem> {
    let dense = validate_fwd(q, k, v, o, None, params)?;
    let (total_q, total_k) = (dense.shape.seqlen_q, dense.shape.seqlen_k);

    // 1. packed views
    if q.batch() != 1 {
        return Err(Error::ShapeMismatch(format!(
            "packed q, k, v and o have batch extent 1 (cu_seqlens tells the sequences \
             apart), got {}",
            q.batch()
        )));
    }

    // 2. sequence counts
    let batch = varlen.batch;
    check_sequence_counts(batch, varlen.max_seqlen_q)?;

    // 3. offset arrays
    let o_range = byte_range_of("o", o)?;
    let mut cu_ranges = [(0u64, 0u64); 2];
    for (range, (name, ptr)) in cu_ranges.iter_mut().zip([
        ("cu_seqlens_q", varlen.cu_seqlens_q),
        ("cu_seqlens_k", varlen.cu_seqlens_k),
    ]) {
        check_pointer(name, ptr, 4)?;
        // batch <= 65535: the array's end cannot overflow unless ptr is within 256 KiB
        // of 2^64.
        let end = ptr
            .checked_add(4 * (batch as u64 + 1))
            .ok_or_else(|| Error::BadStrides {
                tensor: name,
                reason: format!("{name} at {ptr:#x} overflows 64-bit addressing"),
            })?;
        *range = (ptr, end);
        if overlaps(*range, o_range) {
            return Err(Error::InvalidArgument(format!(
                "o's memory overlaps {name}'s [{ptr:#x}, {end:#x})"
            )));
        }
    }

    // 4. the LSE, [Hq, total_q]
    if let Some(l) = lse {
        check_pointer("lse", l.ptr, LSE_ALIGN)?;
        let lr = lse_byte_range(l, 1, dense.shape.heads_q, total_q)?;
        let views = [("q", q), ("k", k), ("v", v), ("o", o)];
        for (name, t) in views {
            let r = byte_range_of(name, t)?;
            if overlaps(lr, r) {
                return Err(Error::InvalidArgument(format!(
                    "lse's memory [{:#x}, {:#x}) overlaps {name}'s [{:#x}, {:#x})",
                    lr.0, lr.1, r.0, r.1
                )));
            }
        }
        for (name, r) in ["cu_seqlens_q", "cu_seqlens_k"].into_iter().zip(cu_ranges) {
            if overlaps(lr, r) {
                return Err(Error::InvalidArgument(format!(
                    "lse's memory overlaps {name}'s [{:#x}, {:#x})",
                    r.0, r.1
                )));
            }
        }
    }

    // 5. host copies
    if let Some(h) = varlen.host {
        check_offsets("cu_seqlens_q", h.cu_seqlens_q, batch, total_q)?;
        check_offsets("cu_seqlens_k", h.cu_seqlens_k, batch, total_k)?;
        let longest = h
            .cu_seqlens_q
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        if longest > varlen.max_seqlen_q {
            return Err(Error::InvalidArgument(format!(
                "a query sequence of {longest} rows is longer than max_seqlen_q {}",
                varlen.max_seqlen_q
            )));
        }
    }

    let mut shape = dense.shape;
    shape.batch = batch;
    // No sequence is longer than the tensor: a larger bound would only add idle blocks.
    shape.seqlen_q = varlen.max_seqlen_q.min(total_q);
    Ok(FwdProblem {
        shape,
        packed: Some(Packed {
            cu_seqlens_q: varlen.cu_seqlens_q,
            cu_seqlens_k: varlen.cu_seqlens_k,
            total_q,
            total_k,
            runs: Runs::All,
        }),
        ..dense
    })
}

/// `cu` has `batch + 1` entries, from 0 or more, non-decreasing, up to `rows`.
pub(crate) fn check_offsets(name: &str, cu: &[i32], batch: usize, rows: usize) -> Result<()> {
    if cu.len() != batch + 1 {
        return Err(Error::ShapeMismatch(format!(
            "{name} has {} entries for {batch} sequences (needs {})",
            cu.len(),
            batch + 1
        )));
    }
    if cu[0] < 0 {
        return Err(Error::InvalidArgument(format!(
            "{name}[0] is {}, must be 0 or more",
            cu[0]
        )));
    }
    if let Some(b) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::InvalidArgument(format!(
            "{name} decreases: entry {} is {}, entry {} is {}",
            b,
            cu[b],
            b + 1,
            cu[b + 1]
        )));
    }
    let last = cu[batch] as usize;
    if last > rows {
        return Err(Error::InvalidArgument(format!(
            "{name}[{batch}] is {last}, past the tensor's {rows} rows"
        )));
    }
    Ok(())
}

impl Attention {
    /// Variable-length forward attention over packed sequences (see the module docs for
    /// the layout): one launch, no padding. Causal masking, GQA/MQA, the scale and the
    /// kernel path follow [`Attention::forward`]. Writes `lse` (float32 `[Hq, total_q]`)
    /// when given. Every argument is checked first: on error nothing is launched and
    /// nothing written. The call is asynchronous.
    ///
    /// # Safety
    ///
    /// As for [`Attention::forward`]; the offset arrays too must be live device memory
    /// of this device's context until the kernel has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn forward_varlen(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: Option<&LseView>,
        varlen: &Varlen,
        params: &AttentionParams,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_varlen(q, k, v, o, lse, varlen, params)?;
        // SAFETY: this function's contract, passed on unchanged; `problem` validates these
        // views with `varlen`.
        let by_decode =
            unsafe { self.varlen_by_decode(&problem, varlen, [q, k, v, o], lse, stream) };
        if let Some(ran) = by_decode {
            return ran;
        }
        // SAFETY: this function's contract, passed on unchanged.
        unsafe { self.run(&problem, [q, k, v, o], lse, stream) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::draw::Draw;
    use crate::host::tensor::DType;

    const GB: u64 = 1 << 30;

    /// Host offsets for `batch` sequences over `total` rows: non-decreasing from 0 to
    /// `total` (tame), or drawn anyhow (negative, decreasing, past the rows, short).
    fn offsets(r: &mut Draw, batch: usize, total: usize, tame: bool) -> Vec<i32> {
        let n = if tame || r.chance(0.8) {
            batch + 1
        } else {
            r.pick(&[0, 1, batch])
        };
        let mut v: Vec<i32> = (0..n)
            .map(|i| (total.saturating_mul(i) / batch.max(1)).min(i32::MAX as usize) as i32)
            .collect();
        if !tame {
            for x in &mut v {
                if r.chance(0.1) {
                    *x = r.pick(&[-1, 0, 7, i32::MAX, (total as i32).wrapping_add(1)]);
                }
            }
        }
        v
    }

    /// Random packed q, k, v, o with random offsets (see [`Draw`]): validation answers
    /// each with a problem or an error, never a panic; what it accepts counts the rows
    /// the offsets give.
    #[test]
    fn validation_of_random_packed_batches_never_panics() {
        let mut r = Draw::new(0x7A41_E4E4);
        let mut accepted = 0;
        for i in 0..20_000 {
            let tame = i % 2 == 0;
            r.start(tame);
            let batch = r.pick(&[0, 1, 2, 3, 17]);
            let (hkv, d) = (r.size(), r.head_dim());
            let hq = hkv.saturating_mul(r.pick(&[1, 4, 8]));
            let (tq, tk) = (r.size(), r.size());
            let dtype = r.dtype();
            let q = r.view(dtype, [1, tq, hq, d]);
            let k = r.view(dtype, [1, tk, hkv, d]);
            let v = r.view(dtype, [1, tk, hkv, d]);
            let o = r.view(dtype, [1, tq, hq, d]);
            let lse = r.chance(0.5).then(|| LseView { ptr: r.ptr() });
            let (hq_off, hk_off) = (
                offsets(&mut r, batch, tq, tame),
                offsets(&mut r, batch, tk, tame),
            );
            let varlen = Varlen {
                cu_seqlens_q: r.ptr(),
                cu_seqlens_k: r.ptr(),
                batch,
                max_seqlen_q: r.pick(&[0, 1, tq, tq + 5, usize::MAX]),
                host: r.chance(0.7).then_some(VarlenHost {
                    cu_seqlens_q: &hq_off,
                    cu_seqlens_k: &hk_off,
                }),
            };
            let params = AttentionParams {
                softmax_scale: r.softmax_scale(),
                causal: r.chance(0.5),
                ..Default::default()
            };
            let run = std::panic::catch_unwind(|| {
                validate_varlen(&q, &k, &v, &o, lse.as_ref(), &varlen, &params).map(|p| {
                    let packed = p.packed.expect("a packed problem");
                    assert_eq!((packed.total_q, packed.total_k), (tq, tk));
                })
            });
            match run {
                Ok(r) => accepted += usize::from(r.is_ok()),
                Err(_) => panic!(
                    "draw {i}: q {q:?}\nk {k:?}\nv {v:?}\no {o:?}\nlse {lse:?}\n\
                     {varlen:?} {params:?}"
                ),
            }
        }
        assert!(accepted > 1000, "{accepted}");
    }

    /// Packed views at well-separated addresses: 300 query rows, 500 key rows.
    fn views() -> [TensorView; 4] {
        let t = |ptr, s, h| TensorView::bshd(ptr, DType::F16, 1, s, h, 64);
        [
            t(GB, 300, 8),
            t(2 * GB, 500, 2),
            t(3 * GB, 500, 2),
            t(4 * GB, 300, 8),
        ]
    }

    fn varlen<'a>(host: Option<VarlenHost<'a>>) -> Varlen<'a> {
        Varlen {
            cu_seqlens_q: 5 * GB,
            cu_seqlens_k: 5 * GB + 64,
            batch: 3,
            max_seqlen_q: 200,
            host,
        }
    }

    fn check(v: &Varlen, lse: Option<&LseView>) -> Result<FwdProblem> {
        let [q, k, vv, o] = views();
        validate_varlen(&q, &k, &vv, &o, lse, v, &AttentionParams::default())
    }

    #[test]
    fn a_packed_batch_becomes_a_problem_of_its_sequences() {
        let host = VarlenHost {
            cu_seqlens_q: &[0, 100, 100, 300],
            cu_seqlens_k: &[0, 1, 250, 500],
        };
        let p = check(&varlen(Some(host)), None).unwrap();
        assert_eq!(p.shape.batch, 3);
        assert_eq!(p.shape.seqlen_q, 200);
        let packed = p.packed.unwrap();
        assert_eq!((packed.total_q, packed.total_k), (300, 500));
        // A bound past the tensor is cut to it.
        let mut v = varlen(None);
        v.max_seqlen_q = 1 << 20;
        assert_eq!(check(&v, None).unwrap().shape.seqlen_q, 300);
    }

    #[test]
    fn packed_views_need_batch_one() {
        let [q, k, v, o] = views();
        let two = |t: &TensorView| TensorView {
            shape: [2, t.shape[1] / 2, t.shape[2], t.shape[3]],
            strides: [t.shape[1] / 2 * t.strides[1], t.strides[1], t.strides[2], 1],
            ..*t
        };
        let r = validate_varlen(
            &two(&q),
            &two(&k),
            &two(&v),
            &two(&o),
            None,
            &varlen(None),
            &AttentionParams::default(),
        );
        assert!(matches!(r, Err(Error::ShapeMismatch(_))), "{r:?}");
    }

    #[test]
    fn bad_counts_and_pointers_are_refused() {
        let mut v = varlen(None);
        v.batch = 0;
        assert!(matches!(check(&v, None), Err(Error::EmptyDimension { .. })));
        v.batch = 65536;
        assert!(matches!(check(&v, None), Err(Error::InvalidArgument(_))));
        let mut v = varlen(None);
        v.max_seqlen_q = 0;
        assert!(matches!(check(&v, None), Err(Error::InvalidArgument(_))));
        let mut v = varlen(None);
        v.cu_seqlens_k = 0;
        assert!(matches!(
            check(&v, None),
            Err(Error::NullPointer("cu_seqlens_k"))
        ));
        v.cu_seqlens_k = 5 * GB + 2;
        assert!(matches!(check(&v, None), Err(Error::Misaligned { .. })));
        // Offsets inside o's memory: o is written while they are read.
        let mut v = varlen(None);
        v.cu_seqlens_q = 4 * GB + 64;
        assert!(matches!(check(&v, None), Err(Error::InvalidArgument(_))));
        // Offsets whose 4 entries pass the end of the address space: a range past it,
        // BadStrides like every other such range.
        let mut v = varlen(None);
        v.cu_seqlens_k = u64::MAX - 11;
        assert!(matches!(
            check(&v, None),
            Err(Error::BadStrides {
                tensor: "cu_seqlens_k",
                ..
            })
        ));
    }

    #[test]
    fn the_lse_is_hq_by_total_q_and_overlaps_nothing() {
        let v = varlen(None);
        assert!(check(&v, Some(&LseView { ptr: 6 * GB })).is_ok());
        assert!(matches!(
            check(&v, Some(&LseView { ptr: 6 * GB + 2 })),
            Err(Error::Misaligned { .. })
        ));
        // [8, 300] floats end 9600 bytes on: the offsets 9000 bytes on overlap.
        let mut v = varlen(None);
        v.cu_seqlens_q = 6 * GB + 9000;
        assert!(matches!(
            check(&v, Some(&LseView { ptr: 6 * GB })),
            Err(Error::InvalidArgument(_))
        ));
        v.cu_seqlens_q = 6 * GB + 9600;
        assert!(check(&v, Some(&LseView { ptr: 6 * GB })).is_ok());
        assert!(matches!(
            check(&v, Some(&LseView { ptr: 4 * GB })),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn host_offsets_are_checked() {
        let bad: [(&[i32], &[i32], &str); 6] = [
            (&[0, 100, 300], &[0, 1, 250, 500], "too few entries"),
            (&[-1, 100, 100, 300], &[0, 1, 250, 500], "negative start"),
            (&[0, 100, 50, 300], &[0, 1, 250, 500], "decreasing"),
            (&[0, 100, 100, 301], &[0, 1, 250, 500], "past q"),
            (&[0, 100, 100, 300], &[0, 1, 250, 501], "past k"),
            (
                &[0, 0, 0, 201],
                &[0, 1, 250, 500],
                "longer than max_seqlen_q",
            ),
        ];
        for (cq, ck, why) in bad {
            let host = VarlenHost {
                cu_seqlens_q: cq,
                cu_seqlens_k: ck,
            };
            let r = check(&varlen(Some(host)), None);
            assert!(
                matches!(r, Err(Error::ShapeMismatch(_) | Error::InvalidArgument(_))),
                "{why}: {r:?}"
            );
        }
        // Gaps and empty sequences are fine: rows no sequence covers stay untouched.
        let host = VarlenHost {
            cu_seqlens_q: &[5, 5, 100, 250],
            cu_seqlens_k: &[0, 0, 0, 10],
        };
        assert!(check(&varlen(Some(host)), None).is_ok());
    }
}
