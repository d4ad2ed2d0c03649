//! Where one batch entry's sequence lies in Q, K, V and O.
//!
//! Dense tensors hold sequence `b` at rows `0..Sq` (`0..Sk`) of batch index `b`, every
//! sequence as long as the argument block says. Packed tensors (the variable-length
//! layout) hold all sequences one after another in batch index 0: sequence `b`'s queries
//! are rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]`, its keys rows
//! `cu_seqlens_k[b]..cu_seqlens_k[b + 1]`, read from device memory by every block. A
//! non-null `cu_seqlens_q` in the argument block selects the packed layout; then its
//! `seqlen_q`/`seqlen_k` hold the packed row counts, and the offsets are clamped to them,
//! so even offsets the host never checked keep every access inside the tensors.
//!
//! Packed queries may also attend to a KV cache rather than to packed keys (a serving
//! batch that mixes decode steps and prompt chunks, FlashAttention's `varlen` call with
//! `seqused_k` and a block table): a null `cu_seqlens_k` leaves each sequence's keys at
//! its own batch index of K and V (or its row of the block table), `seqlen_k` rows of
//! them, the cache's capacity.
//!
//! Either layout may name the keys each sequence uses (`seqused_k`: a KV cache's
//! lengths, with the cache's capacity as `seqlen_k`), also read from device memory and
//! clamped to the sequence's rows. The rows past a sequence's used keys then hold
//! whatever the cache held there, so the sequence counts as packed: nothing past its end
//! is assumed zero.

use std::mem::offset_of;

use super::FwdArgs;
use crate::ptx::{Cmp, Kernel, ParamBytes, Pred, Reg, S32, U32, U64};

/// One sequence's rows and lengths.
#[derive(Debug, Clone, Copy)]
pub struct Sequence {
    /// The batch index of Q and O that holds the sequence: `b`, or 0 when packed.
    pub tensor_batch: Reg<U32>,
    /// The batch index of K and V (and the row of a paged cache's block table) that
    /// holds the sequence's keys: `b`, or 0 when its keys are packed too.
    pub kv_batch: Reg<U32>,
    /// The row of the sequence's first query (and output): 0 unless packed.
    pub q_start: Reg<S32>,
    /// The row of the sequence's first key and value: 0 unless packed.
    pub k_start: Reg<S32>,
    pub seqlen_q: Reg<S32>,
    pub seqlen_k: Reg<S32>,
    /// The launch is packed: the rows after the sequence belong to the next one (or to
    /// none), not to the tensor's end.
    pub packed: Reg<Pred>,
}

impl Sequence {
    /// `Sk − Sq`: query row i sees keys `j <= i + offset` under bottom-right causal masking.
    pub fn causal_offset(&self, k: &mut Kernel) -> Reg<S32> {
        k.sub(self.seqlen_k, self.seqlen_q)
    }
}

/// What a kernel reads of a KV cache it may attend to ([`FwdConfig::cache_reads`]).
///
/// [`FwdConfig::cache_reads`]: super::FwdConfig::cache_reads
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheReads {
    /// Nothing: the keys are the tensors' (dense, or packed with the queries).
    None,
    /// Each sequence's used keys ([`FwdArgs::seqused_k`]).
    UsedKeys,
    /// Those, and keys at their sequence's own batch index under packed queries (a
    /// null `cu_seqlens_k`).
    UnderPackedQueries,
}

/// The sequence of batch entry `batch`, with what the kernel reads of a cache.
pub fn sequence(k: &mut Kernel, args: ParamBytes, batch: Reg<U32>, cache: CacheReads) -> Sequence {
    let reads_used = cache != CacheReads::None;
    let keys_apart = cache == CacheReads::UnderPackedQueries;
    let seqlen_q = k.load_param_at::<S32>(args, offset_of!(FwdArgs, seqlen_q));
    let seqlen_k = k.load_param_at::<S32>(args, offset_of!(FwdArgs, seqlen_k));
    let cu_q = k.load_param_at::<U64>(args, offset_of!(FwdArgs, cu_seqlens_q));
    let tensor_batch = k.mov(batch);
    let seq = Sequence {
        tensor_batch,
        // Only a kernel that serves packed queries over a cache has keys apart from its
        // queries; the others keep one batch register for all four tensors.
        kv_batch: if keys_apart {
            k.mov(batch)
        } else {
            tensor_batch
        },
        q_start: k.mov(0i32),
        k_start: k.mov(0i32),
        seqlen_q,
        seqlen_k,
        packed: k.setp(Cmp::Ne, cu_q, 0u64),
    };
    k.if_(seq.packed, |k| {
        let cu_k = k.load_param_at::<U64>(args, offset_of!(FwdArgs, cu_seqlens_k));
        let entry = k.mul_wide_u32(batch, 4u32);
        // `len` holds the packed row count here.
        let rows = |k: &mut Kernel, cu, start, len| {
            let (first, end) = clamped_offsets(k, cu, entry, |_| len);
            k.mov_to(start, first);
            k.sub_to(len, end, first);
        };
        if !keys_apart {
            rows(k, cu_q, seq.q_start, seq.seqlen_q);
            rows(k, cu_k, seq.k_start, seq.seqlen_k);
            return k.mov_to(seq.tensor_batch, 0u32);
        }
        // Keys in a cache (a null `cu_seqlens_k`) stay at the sequence's batch index:
        // selected rather than branched over (ptxas allocates the kernels' registers
        // better so), the query offsets read in place of the missing key offsets.
        let packed_keys = k.setp(Cmp::Ne, cu_k, 0u64);
        let cu_k = k.selp(cu_k, cu_q, packed_keys);
        let (q_first, q_end) = clamped_offsets(k, cu_q, entry, |_| seq.seqlen_q);
        let (k_first, k_end) = clamped_offsets(k, cu_k, entry, |_| seq.seqlen_k);
        k.mov_to(seq.q_start, q_first);
        // Fewer queries than `min_queries` are another launch's: none here.
        let queries = k.sub(q_end, q_first);
        let most = k.load_param_at::<S32>(args, offset_of!(FwdArgs, min_queries));
        let fewer = k.setp(Cmp::Lt, queries, most);
        k.selp_to(seq.seqlen_q, 0i32, queries, fewer);
        let keys = k.sub(k_end, k_first);
        k.selp_to(seq.k_start, k_first, 0i32, packed_keys);
        k.selp_to(seq.seqlen_k, keys, seq.seqlen_k, packed_keys);
        k.mov_to(seq.tensor_batch, 0u32);
        k.selp_to(seq.kv_batch, 0u32, batch, packed_keys);
    });
    if !reads_used {
        return seq;
    }
    let used = k.load_param_at::<U64>(args, offset_of!(FwdArgs, seqused_k));
    let given = k.setp(Cmp::Ne, used, 0u64);
    k.if_(given, |k| {
        let entry = k.mul_wide_u32(batch, 4u32);
        let at = k.add(used, entry);
        let keys = k.ld_global::<S32>(at, 0);
        let keys = k.max(keys, 0i32);
        k.min_to(seq.seqlen_k, keys, seq.seqlen_k);
        k.mov_to(seq.packed, given);
    });
    seq
}

/// Entries `b` and `b + 1` of a device `i32` offset array `cu` (`entry` = `4·b` bytes in)
/// as `(first, end)`, clamped to `0 <= first <= end <= rows` whatever the array holds, so
/// that offsets the host never checked keep every access inside the tensors. `rows` is
/// asked for once both loads are issued (a parameter load may then sit behind them).
pub fn clamped_offsets(
    k: &mut Kernel,
    cu: Reg<U64>,
    entry: Reg<U64>,
    rows: impl FnOnce(&mut Kernel) -> Reg<S32>,
) -> (Reg<S32>, Reg<S32>) {
    let at = k.add(cu, entry);
    let first = k.ld_global::<S32>(at, 0);
    let end = k.ld_global::<S32>(at, 4);
    let rows = rows(k);
    let first = k.max(first, 0i32);
    let first = k.min(first, rows);
    let end = k.max(end, first);
    let end = k.min(end, rows);
    (first, end)
}
