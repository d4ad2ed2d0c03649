//! A serving batch in one call: each sequence's new queries packed one after another
//! (FlashAttention's variable-length layout), attending to a KV cache, contiguous or
//! paged, as [`Attention::decode`] attends. This is the call a server makes for a step
//! that mixes decode tokens, speculative drafts and prompt chunks (FlashAttention's
//! `varlen` call with `seqused_k` and a block table).
//!
//! `q` and `o` are `[1, total_q, Hq, D]`; sequence `b`'s queries are rows
//! `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`, `n_b` of them, and query `i` sits at position
//! `len_b − n_b + i` of its sequence (`len_b` the cache's length, which counts the new
//! tokens): bottom-right aligned, as a decode call's are. The LSE is float32
//! `[Hq, total_q]`. Rows no sequence covers are left untouched; with causal masking a
//! query before its sequence's first position (`n_b > len_b`) sees no key and gets zeros
//! and LSE −∞.
//!
//! Which kernels run depends on the longest query run, `max_seqlen_q`. Up to
//! [`MAX_QUERIES`], the split-KV decode kernels, whose blocks read each sequence's query
//! offsets. Past it, on the sm90 path where the forward kernels read the cache (a 16-bit
//! cache, contiguous or paged with pages of 16 or more: see
//! [`Attention::decode_forward_plan`] and
//! [`FwdConfig::cache_reads`](crate::kernels::attention::FwdConfig::cache_reads)), two
//! launches that split the batch on the device, by each sequence's query count: the
//! decode kernels take the sequences of at most [`MAX_QUERIES`] queries (each K/V byte
//! read once per KV head, the keys split across the SMs) and skip the others, the forward
//! kernels take the others (wide query tiles) and skip those. The split reads nothing on
//! the host, so a captured CUDA graph stays right as the batch's mix changes. Elsewhere
//! (the sm80 path, e4m3 caches, pages below 16) the decode kernels take every sequence.
//!
//! Checks (a call with several faults gets the error of one of them): q's and o's
//! dtypes (as [`Attention::decode`]); q and o not empty, q of batch extent 1 and o of
//! q's shape ([`Error::ShapeMismatch`]); at least one
//! sequence ([`Error::EmptyDimension`]), at most 65535, `max_seqlen_q` from 1 to 2^25,
//! `total_q` at most 2^25 ([`Error::InvalidArgument`]); then the cache, head dims,
//! ratios and options as [`Attention::decode`] checks them for `batch` sequences of
//! `max_seqlen_q` queries (the decode kernels' grid and partial rows are checked by the
//! plan of the runs they take: the short ones where the forward kernels take the others); the pointers of q, o, the LSE and `cu_seqlens_q` (non-null,
//! aligned) and q's and o's strides; o and the LSE apart from every input (the offsets
//! among them) and each other; and with a host copy of the offsets, `batch + 1` entries
//! from 0 or more, non-decreasing, ending inside q, none longer than `max_seqlen_q`.
//! Without it the kernels clamp the offsets to q's rows and each run to `max_seqlen_q`;
//! offsets that go down or overlap then make two sequences write the same rows of o and
//! the LSE (which one's lands is not defined), so pass the host copy where the offsets
//! are not known to be right.

use cudarc::driver::sys::CUstream;

use super::attention::Attention;
use super::decode::{
    DecodeProblem, Workspace, check_lse_pointer, check_output_dtype, check_output_shape,
    check_outputs, check_workspace, decode_dtype, decode_problem_of, plan_decode,
};
use super::kv_cache::{HostMetadata, KvCache};
use super::tensor::{AttentionParams, LseView, TensorView};
use super::validate::{
    MAX_SEQLEN, Packed, Runs, TENSOR_ALIGN, byte_range_of, check_no_self_overlap, check_not_empty,
    check_pointer, check_sequence_counts, check_strides, lse_byte_range,
};
use super::varlen::check_offsets;
use crate::error::{Error, Result};
use crate::kernels::attention::decode::MAX_QUERIES;

/// Where a serving batch's packed queries start: a device `i32` array of `batch + 1`
/// cumulative offsets into q's rows, as FlashAttention's `cu_seqlens_q`.
#[derive(Debug, Clone, Copy)]
pub struct PackedQueries<'a> {
    /// Device address of `i32 [batch + 1]` query offsets.
    pub cu_seqlens_q: u64,
    /// The number of sequences: the cache's batch.
    pub batch: usize,
    /// At least the longest sequence's query count: it sizes the grid and picks the
    /// kernels (see the module docs).
    pub max_seqlen_q: usize,
    /// A host copy of the offsets, checked before anything runs when given.
    pub host: Option<&'a [i32]>,
}

/// The checks of a packed-query call that involve neither o nor the LSE: q's dtype,
/// shape and memory rules, the counts, and the cache for `batch` sequences. Returns the
/// problem (the longest run bounded by q's rows) and `total_q`.
fn packed_query_problem(
    q: &TensorView,
    cache: &KvCache,
    queries: &PackedQueries,
    params: &AttentionParams,
) -> Result<DecodeProblem> {
    let dtype = decode_dtype(q, cache)?;
    check_not_empty("q", q)?;
    let [extent, total_q, heads_q, head_dim] = q.shape;
    if extent != 1 {
        return Err(Error::ShapeMismatch(format!(
            "packed q and o have batch extent 1 (cu_seqlens_q tells the sequences apart), \
             got {extent}"
        )));
    }
    let batch = queries.batch;
    check_sequence_counts(batch, queries.max_seqlen_q)?;
    if total_q > MAX_SEQLEN {
        return Err(Error::InvalidArgument(format!(
            "q's {total_q} packed rows exceed 2^25"
        )));
    }
    // No sequence is longer than q: a larger bound would only add idle blocks.
    let longest = queries.max_seqlen_q.min(total_q);
    let mut problem = decode_problem_of(dtype, [batch, longest, heads_q, head_dim], cache, params)?;
    check_pointer("q", q.ptr, TENSOR_ALIGN)?;
    check_strides("q", q)?;
    byte_range_of("q", q)?;
    check_pointer("cu_seqlens_q", queries.cu_seqlens_q, 4)?;
    problem.packed = Some(Packed {
        cu_seqlens_q: queries.cu_seqlens_q,
        // Null: the keys are the cache's, each sequence's at its own batch index.
        cu_seqlens_k: 0,
        total_q,
        total_k: problem.cache.capacity,
        runs: Runs::All,
    });
    Ok(problem)
}

/// A packed-query problem's two sides, where its longest run is past [`MAX_QUERIES`]:
/// the sequences of at most that many queries (decode steps, drafts) for the decode
/// kernels, the others (prompt chunks) for the forward kernels.
pub(crate) struct SplitRuns {
    pub short: DecodeProblem,
    pub long: DecodeProblem,
}

pub(crate) fn split_runs(problem: &DecodeProblem) -> SplitRuns {
    let side = |seqlen_q, runs| {
        let mut p = *problem;
        p.seqlen_q = seqlen_q;
        p.packed = p.packed.map(|packed| Packed { runs, ..packed });
        p
    };
    SplitRuns {
        short: side(problem.seqlen_q.min(MAX_QUERIES), Runs::Short),
        long: side(problem.seqlen_q, Runs::Long(MAX_QUERIES + 1)),
    }
}

/// Checks a packed-query call over a cache; see the module docs for the order.
pub fn validate_decode_varlen(
    q: &TensorView,
    cache: &KvCache,
    queries: &PackedQueries,
    o: &TensorView,
    lse: Option<&LseView>,
    params: &AttentionParams,
) -> Result<DecodeProblem> {
    check_output_dtype(q, o)?;
    let problem = packed_query_problem(q, cache, queries, params)?;
    check_output_shape(q, o)?;
    check_pointer("o", o.ptr, TENSOR_ALIGN)?;
    check_lse_pointer(lse)?;
    check_strides("o", o)?;
    let o_range = byte_range_of("o", o)?;
    check_no_self_overlap("o", o)?;
    let [total_q, heads_q] = [q.shape[1], q.shape[2]];
    // batch <= 65535: the array's end overflows only within 256 KiB of 2^64.
    let cu = queries.cu_seqlens_q;
    let cu_end = cu
        .checked_add(4 * (queries.batch as u64 + 1))
        .ok_or_else(|| Error::BadStrides {
            tensor: "cu_seqlens_q",
            reason: format!("cu_seqlens_q at {cu:#x} overflows 64-bit addressing"),
        })?;
    let [k, v, k_scale, v_scale, lengths, table] = cache.byte_ranges(queries.batch);
    let inputs = [
        k,
        v,
        k_scale,
        v_scale,
        lengths,
        table,
        Some(("q", byte_range_of("q", q)?)),
        Some(("cu_seqlens_q", (cu, cu_end))),
    ];
    let lse_range = match lse {
        Some(l) => Some(lse_byte_range(l, 1, heads_q, total_q)?),
        None => None,
    };
    check_outputs(&inputs, ("o", o_range), lse_range)?;
    if let Some(host) = queries.host {
        check_offsets("cu_seqlens_q", host, queries.batch, total_q)?;
        let longest = host.windows(2).map(|w| (w[1] - w[0]) as usize).max();
        if let Some(n) = longest.filter(|&n| n > queries.max_seqlen_q) {
            return Err(Error::InvalidArgument(format!(
                "a query sequence of {n} rows is longer than max_seqlen_q {}",
                queries.max_seqlen_q
            )));
        }
    }
    Ok(problem)
}

impl Attention {
    /// A serving batch: each sequence's queries packed in `q` (`[1, total_q, Hq, D]`,
    /// sequence `b` at rows `cu_seqlens_q[b] ..`) against `cache`, into `o` (q's shape)
    /// and `lse` (float32 `[Hq, total_q]`); see the [module docs](self) for the
    /// semantics, the kernels and the checks. `host` and `workspace` are as for
    /// [`Attention::decode`] ([`Attention::decode_varlen_workspace_bytes`] says how
    /// large a workspace the decode kernels need).
    ///
    /// # Safety
    ///
    /// As for [`Attention::decode`], with the offsets' `batch + 1` entries live device
    /// memory too.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn decode_varlen(
        &self,
        q: &TensorView,
        cache: &KvCache,
        queries: &PackedQueries,
        host: Option<&HostMetadata>,
        o: &TensorView,
        lse: Option<&LseView>,
        params: &AttentionParams,
        workspace: Option<Workspace>,
        stream: CUstream,
    ) -> Result<()> {
        let problem = validate_decode_varlen(q, cache, queries, o, lse, params)?;
        if let Some(h) = host {
            h.check(cache, &problem.cache, 0)?;
        }
        if problem.cache.fp8 {
            self.check_fp8_cache_gpu()?;
        }
        let split = split_runs(&problem);
        // The long runs' forward kernel, maps and checks come first: whatever of them fails
        // fails before the short runs launch (and views the maps refuse send every run to
        // the decode kernels, checked as such).
        let forward = match problem.seqlen_q > MAX_QUERIES {
            true => self.prepare_decode_by_forward(&split.long, q, cache, o, lse, params),
            false => None,
        };
        if let Some(forward) = forward {
            let forward = forward?;
            // The short runs on the decode kernels, which skip the long ones...
            let plan = self.decode_plan(&split.short)?;
            if let Some(w) = workspace
                && plan.workspace_bytes > 0
            {
                check_workspace(&w, plan.workspace_bytes, cache, q, o, lse, &split.short)?;
            }
            let short = &split.short;
            // SAFETY: this function's contract; the call was validated above. The decode
            // kernels clamp each sequence's offsets to q's rows and write only the rows of
            // sequences of at most `MAX_QUERIES` queries.
            unsafe { self.run_decode(short, &plan, q, cache, o, lse, workspace, stream)? };
            // ...then the long ones on the forward kernels, which skip the short ones.
            // SAFETY: as above; they write only the rows of the other sequences, and
            // `forward` was prepared for `long` on these views.
            return unsafe { self.launch_decode_by_forward(forward, q, cache, o, lse, stream) };
        }
        let plan = self.decode_plan(&problem)?;
        if let Some(w) = workspace
            && plan.workspace_bytes > 0
        {
            check_workspace(&w, plan.workspace_bytes, cache, q, o, lse, &problem)?;
        }
        // SAFETY: this function's contract; the call was validated above. The decode
        // kernels clamp each sequence's offsets to q's rows and its run to the problem's
        // `seqlen_q`, so they touch no row outside q, o and the LSE.
        unsafe { self.run_decode(&problem, &plan, q, cache, o, lse, workspace, stream) }
    }

    /// The workspace a [`Attention::decode_varlen`] call with these `q`, `cache` and
    /// `queries` needs, in bytes, whatever its options (0 when every plan it may take
    /// has one split). They are checked as that call checks them.
    pub fn decode_varlen_workspace_bytes(
        &self,
        q: &TensorView,
        cache: &KvCache,
        queries: &PackedQueries,
    ) -> Result<usize> {
        let problem = packed_query_problem(q, cache, queries, &AttentionParams::default())?;
        if problem.cache.fp8 {
            self.check_fp8_cache_gpu()?;
        }
        let d = self.device();
        let forward = problem.seqlen_q > MAX_QUERIES
            && self
                .decode_forward_plan(&split_runs(&problem).long, cache)
                .is_some();
        packed_workspace_bytes(&problem, d.sm_count(), d.smem_optin(), forward)
    }
}

/// The workspace of a packed-query problem's decode kernels on a GPU of `sm_count` SMs:
/// the larger of its two plans, every run on the decode kernels or the short runs alone.
/// Which of them a call takes depends on its options (the forward kernels that would take
/// the long runs may not exist for a window or a cap) and on the forward's tensor maps,
/// neither of which the size may depend on. Where every run on the decode kernels has no
/// plan (2^31 partial rows or more: many sequences beside a long prompt chunk) but the
/// forward kernels take the long runs on this GPU (`forward_takes_long`), the size is the
/// short runs': a call whose maps or options leave every run to the decode kernels then
/// fails on that plan before it launches anything.
fn packed_workspace_bytes(
    problem: &DecodeProblem,
    sm_count: u32,
    smem_optin: u32,
    forward_takes_long: bool,
) -> Result<usize> {
    let every_run = plan_decode(problem, sm_count, smem_optin).map(|p| p.workspace_bytes);
    if problem.seqlen_q <= MAX_QUERIES {
        return every_run;
    }
    let short_runs = plan_decode(&split_runs(problem).short, sm_count, smem_optin)?;
    match every_run {
        Ok(bytes) => Ok(bytes.max(short_runs.workspace_bytes)),
        Err(_) if forward_takes_long => Ok(short_runs.workspace_bytes),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::attention::PathChoice;
    use crate::host::decode::decode_forward_plan_on;
    use crate::host::decode::tests::{GB, cache, fp8_cache};
    use crate::host::draw::Draw;
    use crate::host::tensor::DType;
    use crate::kernels::attention::Path;
    use crate::kernels::attention::decode::DecodeLayout;

    const H200: ((i32, i32), u32) = ((9, 0), 132);
    const A100: ((i32, i32), u32) = ((8, 0), 108);

    /// Packed q (and o 1 GB further) of `rows` rows, 8 heads, head dim `d`, at 4 GB.
    fn packed(rows: usize, d: usize) -> [TensorView; 2] {
        let t = |at| TensorView::bshd(at, DType::F16, 1, rows, 8, d);
        [t(4 * GB), t(5 * GB)]
    }

    fn queries(batch: usize, max: usize, host: Option<&[i32]>) -> PackedQueries<'_> {
        PackedQueries {
            cu_seqlens_q: 6 * GB,
            batch,
            max_seqlen_q: max,
            host,
        }
    }

    fn check(
        c: &KvCache,
        rows: usize,
        p: &PackedQueries,
        lse: Option<u64>,
    ) -> Result<DecodeProblem> {
        let [q, o] = packed(rows, c.k.shape[3]);
        let lse = lse.map(|ptr| LseView { ptr });
        let params = AttentionParams::default();
        validate_decode_varlen(&q, c, p, &o, lse.as_ref(), &params)
    }

    #[test]
    fn packed_queries_over_a_cache_become_a_problem_of_its_sequences() {
        for (paged, layout) in [
            (None, DecodeLayout::PackedOverContiguous),
            (Some(16), DecodeLayout::PackedOverPaged),
        ] {
            let c = cache(3, 1024, 2, 64, paged);
            let host: &[i32] = &[0, 1, 301, 305];
            let p = check(&c, 320, &queries(3, 300, Some(host)), Some(7 * GB)).unwrap();
            assert_eq!((p.cache.batch, p.seqlen_q, p.heads_q), (3, 300, 8));
            assert_eq!(p.layout(), layout, "the keys stay the cache's");
            let packed = p.packed.unwrap();
            assert_eq!((packed.cu_seqlens_q, packed.cu_seqlens_k), (6 * GB, 0));
            assert_eq!((packed.total_q, packed.total_k), (320, 1024));
        }
        // A bound past q's rows is cut to them.
        let c = cache(3, 1024, 2, 64, None);
        let p = check(&c, 320, &queries(3, 1 << 20, None), None).unwrap();
        assert_eq!(p.seqlen_q, 320);
    }

    #[test]
    fn bad_packed_queries_are_refused_with_typed_errors() {
        let c = cache(3, 1024, 2, 64, Some(16));
        let ok = queries(3, 16, None);
        assert!(check(&c, 40, &ok, None).is_ok());
        // q of batch extent 2.
        let [q, o] = packed(40, 64);
        let two = |t: TensorView| TensorView::bshd(t.ptr, t.dtype, 2, 20, 8, 64);
        let params = AttentionParams::default();
        let r = validate_decode_varlen(&two(q), &c, &ok, &two(o), None, &params);
        assert!(matches!(r, Err(Error::ShapeMismatch(_))), "{r:?}");
        let r = check(&c, 40, &queries(0, 16, None), None);
        assert!(matches!(r, Err(Error::EmptyDimension { .. })), "{r:?}");
        for (batch, max) in [(65536, 16), (3, 0), (3, (1 << 25) + 1)] {
            let r = check(&c, 40, &queries(batch, max, None), None);
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "{batch} {max}: {r:?}"
            );
        }
        // A contiguous cache of 3 sequences serves no batch of 4.
        let r = check(
            &cache(3, 1024, 2, 64, None),
            40,
            &queries(4, 16, None),
            None,
        );
        assert!(matches!(r, Err(Error::ShapeMismatch(_))), "{r:?}");
        let mut bad = ok;
        bad.cu_seqlens_q = 0;
        assert!(matches!(
            check(&c, 40, &bad, None),
            Err(Error::NullPointer("cu_seqlens_q"))
        ));
        bad.cu_seqlens_q = 6 * GB + 2;
        assert!(matches!(
            check(&c, 40, &bad, None),
            Err(Error::Misaligned { .. })
        ));
        // Offsets whose 4 entries pass the end of the address space.
        bad.cu_seqlens_q = u64::MAX - 11;
        assert!(matches!(
            check(&c, 40, &bad, None),
            Err(Error::BadStrides {
                tensor: "cu_seqlens_q",
                ..
            })
        ));
        // The offsets inside o's memory, or the LSE's ([8, 40] floats: 1280 bytes).
        bad.cu_seqlens_q = 5 * GB + 64;
        assert!(matches!(
            check(&c, 40, &bad, None),
            Err(Error::InvalidArgument(_))
        ));
        bad.cu_seqlens_q = 7 * GB + 1000;
        let r = check(&c, 40, &bad, Some(7 * GB));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
        bad.cu_seqlens_q = 7 * GB + 1280;
        assert!(check(&c, 40, &bad, Some(7 * GB)).is_ok());
        // An LSE over q.
        let r = check(&c, 40, &ok, Some(4 * GB));
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");
    }

    #[test]
    fn host_offsets_are_checked() {
        let c = cache(3, 1024, 2, 64, None);
        let bad: [(&[i32], &str); 5] = [
            (&[0, 10, 20], "too few entries"),
            (&[-1, 10, 20, 30], "negative start"),
            (&[0, 10, 5, 30], "decreasing"),
            (&[0, 10, 20, 41], "past q"),
            (&[0, 17, 20, 30], "longer than max_seqlen_q"),
        ];
        for (host, why) in bad {
            let r = check(&c, 40, &queries(3, 16, Some(host)), None);
            assert!(
                matches!(r, Err(Error::ShapeMismatch(_) | Error::InvalidArgument(_))),
                "{why}: {r:?}"
            );
        }
        // Gaps, empty sequences and rows past the last are fine: they stay untouched.
        let r = check(&c, 40, &queries(3, 16, Some(&[5, 5, 21, 30])), None);
        assert!(r.is_ok(), "{r:?}");
    }

    #[test]
    fn a_batch_with_long_runs_splits_between_the_decode_and_forward_kernels() {
        let c = cache(2, 4096, 2, 128, None);
        let p = check(&c, 2000, &queries(2, 300, None), None).unwrap();
        let split = split_runs(&p);
        let (short, long) = (split.short, split.long);
        assert_eq!((short.seqlen_q, long.seqlen_q), (MAX_QUERIES, 300));
        assert_eq!(short.packed.unwrap().runs, Runs::Short);
        assert_eq!(long.packed.unwrap().runs, Runs::Long(MAX_QUERIES + 1));
        // Both sides keep the keys the cache's.
        for side in [short, long] {
            assert_eq!(side.layout(), DecodeLayout::PackedOverContiguous);
            let packed = side.packed.unwrap();
            assert_eq!((packed.cu_seqlens_k, packed.total_q), (0, 2000));
        }
        let (forward, _) = decode_forward_plan_on(H200, PathChoice::Best, &long, &c).unwrap();
        assert_eq!(forward.packed.unwrap().runs, Runs::Long(MAX_QUERIES + 1));
        // The decode kernels' side is planned as a decode step of 16 queries.
        assert!(decode_forward_plan_on(H200, PathChoice::Best, &short, &c).is_none());
        let plan = crate::host::decode::plan_decode(&short, 132, 227 * 1024).unwrap();
        assert!(
            plan.config.packed_queries && !plan.config.packed,
            "{plan:?}"
        );
        assert!(plan.config.id().ends_with("_pq"), "{plan:?}");
    }

    /// The size asked for without options covers the plan a call takes with any of
    /// them: with some options the forward kernels that would take the long runs do not
    /// read the cache, and then every run takes the decode kernels.
    /// Many sequences beside one long prompt chunk: every run on the decode kernels would
    /// hold 2^31 partial rows (4096 sequences x 65536 queries x 8 heads), which no plan
    /// takes, but on Hopper the forward kernels take the long runs and the short ones
    /// need their own plan only: the size query gives that plan's size there, and the
    /// decode kernels' refusal where nothing else can take the call.
    #[test]
    fn the_workspace_size_of_many_sequences_beside_a_long_chunk() {
        let c = cache(4096, 16, 8, 128, None);
        let q = TensorView::bshd(4 * GB, DType::F16, 1, 65536 + 4095, 8, 128);
        let params = AttentionParams::default();
        let p = packed_query_problem(&q, &c, &queries(4096, 65536, None), &params).unwrap();
        let smem = 227 * 1024;
        assert!(plan_decode(&p, 132, smem).is_err());
        let split = split_runs(&p);
        assert!(decode_forward_plan_on(H200, PathChoice::Best, &split.long, &c).is_some());
        let short = plan_decode(&split.short, 132, smem)
            .unwrap()
            .workspace_bytes;
        assert_eq!(packed_workspace_bytes(&p, 132, smem, true).unwrap(), short);
        let refused = packed_workspace_bytes(&p, 132, smem, false);
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "{refused:?}"
        );
        // A chunk half as long: every run has a plan, and the size covers it.
        let q = TensorView::bshd(4 * GB, DType::F16, 1, 32768 + 4095, 8, 128);
        let p = packed_query_problem(&q, &c, &queries(4096, 32768, None), &params).unwrap();
        let every = plan_decode(&p, 132, smem).unwrap().workspace_bytes;
        for forward in [false, true] {
            let bytes = packed_workspace_bytes(&p, 132, smem, forward).unwrap();
            assert!(bytes >= every, "{bytes} < {every}");
        }
    }

    #[test]
    fn the_workspace_size_covers_every_options_plan() {
        use crate::host::tensor::Window;
        let options = [
            (false, Window::default(), None),
            (true, Window::default(), None),
            (
                true,
                Window {
                    left: Some(63),
                    right: Some(0),
                },
                None,
            ),
            (
                false,
                Window {
                    left: Some(40),
                    right: Some(9),
                },
                None,
            ),
            (false, Window::default(), Some(20.0)),
            (
                true,
                Window {
                    left: Some(63),
                    right: Some(0),
                },
                Some(20.0),
            ),
        ];
        let mut decode_only = 0;
        let heads = [(8, 2), (8, 8), (2, 2)];
        for (d, (hq, hkv)) in [64, 128, 256]
            .into_iter()
            .flat_map(|d| heads.map(|h| (d, h)))
        {
            for paged in [None, Some(16), Some(64)] {
                let c = cache(8, 4352, hkv, d, paged);
                let [q, o] =
                    [4 * GB, 5 * GB].map(|at| TensorView::bshd(at, DType::F16, 1, 300, hq, d));
                for max in [16, 200] {
                    let without = AttentionParams::default();
                    let p = packed_query_problem(&q, &c, &queries(8, max, None), &without).unwrap();
                    let bytes = packed_workspace_bytes(&p, 132, 227 * 1024, false).unwrap();
                    for (causal, window, softcap) in options {
                        let params = AttentionParams {
                            softmax_scale: None,
                            causal,
                            window,
                            softcap,
                        };
                        let p = validate_decode_varlen(
                            &q,
                            &c,
                            &queries(8, max, None),
                            &o,
                            None,
                            &params,
                        )
                        .unwrap();
                        // What the call plans: the short runs alone where the forward
                        // kernels take the long ones, every run otherwise.
                        let split = split_runs(&p);
                        let forward = max > MAX_QUERIES
                            && decode_forward_plan_on(H200, PathChoice::Best, &split.long, &c)
                                .is_some();
                        let taken = if forward { &split.short } else { &p };
                        decode_only += usize::from(max > MAX_QUERIES && !forward);
                        let needs = plan_decode(taken, 132, 227 * 1024).unwrap().workspace_bytes;
                        assert!(
                            needs <= bytes,
                            "d {d} {hq}/{hkv} heads {paged:?} max {max} {params:?}: needs \
                             {needs}, sized {bytes}"
                        );
                    }
                }
            }
        }
        // Some options do leave the long runs to the decode kernels on the sm90 path (a
        // window open on the right over two heads), where the short runs' plan is smaller.
        assert!(decode_only > 0);
    }

    #[test]
    fn long_runs_take_the_forward_kernels_where_they_read_the_cache() {
        let plan = |gpu, max: usize, c: &KvCache| {
            let p = check(c, 2000, &queries(2, max, None), None).unwrap();
            decode_forward_plan_on(gpu, PathChoice::Best, &p, c)
        };
        let contiguous = cache(2, 4096, 2, 128, None);
        assert!(plan(H200, 16, &contiguous).is_none(), "decode-sized runs");
        let (forward, cfg) = plan(H200, 300, &contiguous).unwrap();
        let packed = forward.packed.unwrap();
        assert_eq!((packed.cu_seqlens_k, packed.total_q), (0, 2000));
        assert_eq!((forward.shape.batch, forward.shape.seqlen_q), (2, 300));
        assert_eq!(forward.shape.seqlen_k, 4096);
        assert_eq!(forward.seqused_k, Some(contiguous.seqlens));
        assert_eq!(cfg.path, Path::Sm90);
        // The sm80 path's kernels do not take keys apart from packed queries.
        assert!(plan(A100, 300, &contiguous).is_none());
        let paged = cache(2, 4096, 2, 128, Some(64));
        assert!(plan(H200, 300, &paged).unwrap().0.pages.is_some());
        assert!(plan(A100, 300, &paged).is_none());
        assert!(plan(H200, 300, &cache(2, 4096, 2, 128, Some(8))).is_none());
        assert!(plan(H200, 300, &fp8_cache(2, 4096, 2, 128, None)).is_none());
    }

    /// Random packed-query calls (counts, offsets, pointers, caches, shapes): each gives
    /// a problem or an error, never a panic; an accepted one keeps its offsets' rows.
    #[test]
    fn validation_of_random_packed_queries_never_panics() {
        let mut r = Draw::new(0x51D_C0DE);
        let mut accepted = 0;
        for i in 0..20_000 {
            let tame = i % 2 == 0;
            r.start(tame);
            let batch = r.pick(&[0, 1, 2, 3, 65536]);
            let (hkv, d) = (r.pick(&[1, 2, 8]), r.pick(&[64, 128, 100, 0]));
            let hq = hkv * r.pick(&[1, 4, 3]);
            let rows = r.size();
            let cap = r.pick(&[16, 1024, 1 << 26]);
            let c = match r.pick(&[0, 1, 2]) {
                0 => cache(batch.min(3), cap, hkv, d, None),
                1 => cache(batch.min(3), cap, hkv, d, Some(16)),
                _ => fp8_cache(batch.min(3), cap, hkv, d, Some(16)),
            };
            let dtype = r.dtype();
            let extent = r.pick(&[1, 2]);
            let q = r.view(dtype, [extent, rows, hq, d]);
            let o = r.view(dtype, q.shape);
            let lse = r.chance(0.5).then(|| LseView { ptr: r.ptr() });
            // Even offsets over the rows (any size: in u128, then cut to i32), one
            // decreasing in the wild draws.
            let host: Vec<i32> = (0..=batch.min(4) as u128)
                .map(|j| {
                    let at = (j * rows as u128 / batch.max(1) as u128).min(i32::MAX as u128);
                    at as i32 - i32::from(!tame && j == 1)
                })
                .collect();
            let max = r.pick(&[0, 1, 16, 17, rows, usize::MAX]);
            let p = PackedQueries {
                cu_seqlens_q: r.ptr(),
                batch,
                max_seqlen_q: max,
                host: r.chance(0.5).then_some(host.as_slice()),
            };
            let params = AttentionParams {
                softmax_scale: r.softmax_scale(),
                causal: r.chance(0.5),
                ..Default::default()
            };
            let run = std::panic::catch_unwind(|| {
                validate_decode_varlen(&q, &c, &p, &o, lse.as_ref(), &params).map(|problem| {
                    let packed = problem.packed.expect("packed queries");
                    assert_eq!(packed.total_q, rows);
                    assert!(problem.seqlen_q <= rows);
                    for gpu in [H200, A100] {
                        decode_forward_plan_on(gpu, PathChoice::Best, &problem, &c);
                    }
                })
            });
            match run {
                Ok(r) => accepted += usize::from(r.is_ok()),
                Err(_) => panic!("draw {i}: q {q:?}\no {o:?}\nlse {lse:?}\n{p:?} {c:?}"),
            }
        }
        assert!(accepted > 300, "{accepted}");
    }
}
