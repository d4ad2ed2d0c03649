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
    /// The batch index of Q, K, V and O that holds the sequence: `b`, or 0 when packed.
    pub tensor_batch: Reg<U32>,
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

/// The sequence of batch entry `batch`; its used keys ([`FwdArgs::seqused_k`]) where
/// `reads_used` (see [`FwdConfig::reads_used_keys`](super::FwdConfig::reads_used_keys)).
pub fn sequence(k: &mut Kernel, args: ParamBytes, batch: Reg<U32>, reads_used: bool) -> Sequence {
    let seqlen_q = k.load_param_at::<S32>(args, offset_of!(FwdArgs, seqlen_q));
    let seqlen_k = k.load_param_at::<S32>(args, offset_of!(FwdArgs, seqlen_k));
    let cu_q = k.load_param_at::<U64>(args, offset_of!(FwdArgs, cu_seqlens_q));
    let seq = Sequence {
        tensor_batch: k.mov(batch),
        q_start: k.mov(0i32),
        k_start: k.mov(0i32),
        seqlen_q,
        seqlen_k,
        packed: k.setp(Cmp::Ne, cu_q, 0u64),
    };
    k.if_(seq.packed, |k| {
        let cu_k = k.load_param_at::<U64>(args, offset_of!(FwdArgs, cu_seqlens_k));
        let entry = k.mul_wide_u32(batch, 4u32);
        for (cu, start, len) in [
            (cu_q, seq.q_start, seq.seqlen_q),
            (cu_k, seq.k_start, seq.seqlen_k),
        ] {
            // `len` holds the packed row count here.
            let (first, end) = clamped_offsets(k, cu, entry, |_| len);
            k.mov_to(start, first);
            k.sub_to(len, end, first);
        }
        k.mov_to(seq.tensor_batch, 0u32);
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
