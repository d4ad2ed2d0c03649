//! The end of a forward block: O divided by the row sums, written to global memory as
//! 16-bit pairs, and the log-sum-exp.
//!
//! `LSE = ln(l) + m·scale`, computed as `ln2·log2(l) + m·scale` so that it overflows only
//! when the true value does (the FP8 kernels' `m` is in log2 units: see [`LseForm`]). A row that saw no key (l = 0) gets O = 0 and LSE = −∞.
//! Row indices are unsigned and the LSE index is 64-bit: rows past `Sq` (the padding of
//! the last block) are compared, never wrapped, and `(b·Hq + h)·Sq + row` may exceed 2^32.
//! Packed batches put a sequence's rows after its first query row `q_start`, in O and in
//! the `[Hq, total_q]` LSE alike.

use std::mem::offset_of;

use super::FwdArgs;
use super::rows::{Rows, Slab, half_of};
use super::sequence::Sequence;
use super::softmax::OnlineSoftmax;
use crate::ptx::{Cmp, F32, Half2, Kernel, ParamBytes, Reg, S32, U32, U64};

/// The per-block inputs of [`store_output`].
#[derive(Debug, Clone, Copy)]
pub struct OutputBlock {
    pub batch: Reg<U32>,
    pub head: Reg<U32>,
    /// The block's first query row, counted from the sequence's first.
    pub m_start: Reg<S32>,
    pub seq: Sequence,
}

/// How a row's log-sum-exp follows from its softmax state (`m`, `l`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LseForm {
    /// `m` is the row's largest raw score and `l` sums `exp2((s − m)·scale·log2 e)`:
    /// `LSE = m·scale + ln l` (the 16-bit kernels).
    RawMax,
    /// `m` is in log2 units and every probability summed into `l` carries the factor
    /// `2^p_shift_log2` (the FP8 kernels): `LSE = ln 2·(m + log2 l − p_shift_log2)`. When
    /// the argument block's u64 at byte `row_shift` is not 0, it points to an f32 array
    /// indexed like the LSE whose entry, times `scale`, is added to the row's LSE.
    Log2 { p_shift_log2: f32, row_shift: usize },
}

/// Normalises `o` by the row sums, stores the rows that exist (`row < Sq`) and, when the
/// caller passed an LSE pointer, the log-sum-exp of each row.
pub fn store_output<H: Half2>(
    k: &mut Kernel,
    args: ParamBytes,
    rows: &Rows,
    o: &[Slab],
    softmax: &OnlineSoftmax,
    at: OutputBlock,
) {
    store_output_as::<H>(k, args, rows, o, softmax, at, LseForm::RawMax);
}

/// [`store_output`] for a softmax state of the given [`LseForm`].
pub fn store_output_as<H: Half2>(
    k: &mut Kernel,
    args: ParamBytes,
    rows: &Rows,
    o: &[Slab],
    softmax: &OnlineSoftmax,
    at: OutputBlock,
    form: LseForm,
) {
    k.comment("Epilogue: O / l to global memory, and the log-sum-exp.");
    let field = |k: &mut Kernel, off: usize| k.load_param_at::<U64>(args, off);
    let o_ptr = field(k, offset_of!(FwdArgs, o));
    let o_batch = field(k, offset_of!(FwdArgs, o_stride));
    let o_seq = field(k, offset_of!(FwdArgs, o_stride) + 8);
    let o_head = field(k, offset_of!(FwdArgs, o_stride) + 16);
    let lse_ptr = field(k, offset_of!(FwdArgs, lse));
    let lse_batch = field(k, offset_of!(FwdArgs, lse_stride));
    let lse_head = field(k, offset_of!(FwdArgs, lse_stride) + 8);
    let scale = k.load_param_at::<F32>(args, offset_of!(FwdArgs, scale));
    let seqlen_q = at.seq.seqlen_q;
    let b = k.cvt_u64_u32(at.seq.tensor_batch);
    let h = k.cvt_u64_u32(at.head);
    let q_start = k.cvt_u64_u32(at.seq.q_start.cast::<U32>());
    let elems = k.mul(b, o_batch);
    let elems = k.mad(h, o_head, elems);
    let elems = k.mad(q_start, o_seq, elems);
    let col = k.cvt_u64_u32(rows.col.cast::<U32>());
    let elems = k.add(elems, col);
    let bytes = k.shl(elems, 1);
    let o_base = k.add(o_ptr, bytes);
    // lse[batch·lse_batch + head·lse_head + q_start + row], in 64 bits.
    let lse_b = k.cvt_u64_u32(at.batch);
    let lse_row0 = k.mad(lse_b, lse_batch, q_start);
    let lse_row0 = k.mad(h, lse_head, lse_row0);
    let want_lse = k.setp(Cmp::Ne, lse_ptr, 0u64);
    let lse_lane = k.setp(Cmp::Eq, rows.col, 0i32);
    let want_lse = k.and_pred(want_lse, lse_lane);
    let m_start = at.m_start.cast::<U32>();
    // The per-row LSE shift, read only for rows whose LSE is stored.
    let row_shift = match form {
        LseForm::RawMax => None,
        LseForm::Log2 { row_shift, .. } => {
            let ptr = field(k, row_shift);
            let given = k.setp(Cmp::Ne, ptr, 0u64);
            Some((ptr, k.and_pred(want_lse, given)))
        }
    };

    for (slab, tiles) in o.iter().enumerate() {
        for half in 0..2 {
            let sum = softmax.row_sum(k, slab, half);
            let empty = k.setp(Cmp::Eq, sum, 0f32);
            let inv = k.rcp(sum);
            let inv = k.selp(0f32, inv, empty);
            let row = k.add(m_start, rows.row0.cast::<U32>());
            let row = k.add(row, Rows::offset(slab, half));
            let inside = k.setp(Cmp::Lt, row, seqlen_q.cast::<U32>());
            let row64 = k.cvt_u64_u32(row);
            let offset = k.mul(row64, o_seq);
            let offset = k.shl(offset, 1);
            let addr = k.add(o_base, offset);
            let words: Vec<Reg<H>> = tiles
                .iter()
                .map(|acc| {
                    let [lo, hi] = half_of(acc, half);
                    let lo = k.mul(lo, inv);
                    let hi = k.mul(hi, inv);
                    k.pack_half2::<H>(lo, hi)
                })
                .collect();
            k.guarded(inside, true, |k| {
                for (nt, w) in words.iter().enumerate() {
                    k.st_global(addr, (nt * 16) as i32, *w);
                }
            });
            let log_sum = k.lg2(sum);
            let max = softmax.max[slab][half];
            let lse = match form {
                LseForm::RawMax => {
                    let log_sum = k.mul(log_sum, std::f32::consts::LN_2);
                    k.mad(max, scale, log_sum)
                }
                LseForm::Log2 { p_shift_log2, .. } => {
                    let log2_lse = k.add(max, log_sum);
                    let log2_lse = k.sub(log2_lse, p_shift_log2);
                    k.mul(log2_lse, std::f32::consts::LN_2)
                }
            };
            let lse = k.selp(f32::NEG_INFINITY, lse, empty);
            let store = k.and_pred(want_lse, inside);
            let index = k.add(lse_row0, row64);
            let offset = k.shl(index, 2);
            let lse_addr = k.add(lse_ptr, offset);
            if let Some((shift_ptr, wanted)) = row_shift {
                // −∞ (a row that saw no key) plus a finite shift stays −∞.
                let load = k.and_pred(wanted, inside);
                let shift_addr = k.add(shift_ptr, offset);
                k.guarded(load, true, |k| {
                    let shift = k.ld_global::<F32>(shift_addr, 0);
                    k.mad_to(lse, shift, scale, lse);
                });
            }
            k.guarded(store, true, |k| k.st_global(lse_addr, 0, lse));
        }
    }
}
