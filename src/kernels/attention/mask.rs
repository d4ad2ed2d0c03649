//! Which keys a query block visits, and the mask on the tiles that need one.
//!
//! Keys are visited in tiles of `block_n`; only tiles that cross the sequence end or
//! (causal) the diagonal need masking, so a kernel runs a masked loop over those and an
//! unmasked loop over the rest. Causal masking is aligned bottom-right: query row i sees
//! key j iff `j <= i + (Sk − Sq)`. A key window (FlashAttention's `window_size`) bounds
//! each row's keys on both sides of that diagonal: windowed kernels rebase a query tile's
//! keys past the tiles no row's window reaches ([`windowed_keys`]) and mask both sides.
//!
//! Index arithmetic is exact for every length validation accepts: tile counts are
//! computed in 64 bits, row limits with saturating adds, so nothing wraps near 2^31.
//! Tiles need not be a power of two keys wide (the sm90 path's d256 tile has 80).

use std::mem::offset_of;

use super::FwdArgs;
use super::rows::{Rows, Slab};
use super::sequence::Sequence;
use crate::ptx::{Cmp, Kernel, ParamBytes, Reg, S32, S64, U32, U64};

/// The key tiles a query block visits, `0..end`, of which `mask_from..end` need a mask.
#[derive(Debug, Clone, Copy)]
pub struct KeyTiles {
    pub end: Reg<S32>,
    pub mask_from: Reg<S32>,
}

/// `floor(max(x, 0) / d)` in 64 bits: a shift for a power-of-two `d`, a multiplication
/// by its reciprocal otherwise. (Every caller clamps its result at 0, and a clamped
/// negative numerator gives the same answer, so only non-negative numerators need
/// dividing.) ptxas turns a 64-bit `div` into a call of a division routine even for a
/// constant divisor, about a hundred instructions; the tiles of 80 and 112 keys would pay
/// it on every work item.
fn floor_div64(k: &mut Kernel, x: Reg<S64>, d: u32) -> Reg<S64> {
    let x = k.max(x, 0i64);
    if d.is_power_of_two() {
        return k.shr(x, d.trailing_zeros());
    }
    // Numerators here stay below 2^34; the clamp only makes the reciprocal's bound hold
    // by construction.
    let x = k.min(x, (1i64 << RECIPROCAL_BITS) - 1);
    let q = k.mul_hi(x.cast::<U64>(), reciprocal(d));
    q.cast::<S64>()
}

/// Numerators below `2^RECIPROCAL_BITS` divide exactly by [`reciprocal`].
const RECIPROCAL_BITS: u32 = 48;

/// `m` with `floor(x / d) == (x · m) >> 64` for every `x < 2^RECIPROCAL_BITS`, for a `d`
/// that is not a power of two, at most 2^16.
///
/// With `l = ceil(log2 d)`, `s = RECIPROCAL_BITS + l` and `M = ceil(2^s / d)`, write
/// `M · d = 2^s + e` with `0 <= e < d`; then `x · M / 2^s = x / d + x · e / (d · 2^s)`,
/// and the second term is below `1 / d`, too little to carry `x / d` past the next
/// integer. `m = M · 2^(64 − s)` is below `2^(65 − l)`, so it fits 64 bits for `l >= 1`.
fn reciprocal(d: u32) -> u64 {
    assert!(
        !d.is_power_of_two() && d > 2 && d <= 1 << 16,
        "reciprocal of {d}"
    );
    let l = 32 - (d - 1).leading_zeros();
    let s = RECIPROCAL_BITS + l;
    let m = (1u128 << s).div_ceil(u128::from(d));
    u64::try_from(m << (64 - s)).expect("the reciprocal fits 64 bits")
}

/// `ceil(max(x, 0) / d)` in 64 bits.
fn ceil_div64(k: &mut Kernel, x: Reg<S64>, d: u32) -> Reg<S64> {
    let x = k.max(x, 0i64);
    let t = k.add(x, i64::from(d) - 1);
    floor_div64(k, t, d)
}

/// `clamp(x, lo, hi)` as an `s32` (the bounds are `s32` values, so the result fits).
fn clamp_to_s32(k: &mut Kernel, x: Reg<S64>, lo: Reg<S64>, hi: Reg<S64>) -> Reg<S32> {
    let x = k.max(x, lo);
    let x = k.min(x, hi);
    k.cvt_s32_s64(x)
}

/// The key tiles of the query block starting at row `m_start` (`block_m` rows), for
/// `seqlen_k` keys in tiles of `block_n`; `causal_offset` is `Sk − Sq` when causal. A
/// block past its sequence's last query (packed batches size the grid by the longest
/// sequence) visits none.
pub fn key_tiles(
    k: &mut Kernel,
    seqlen_q: Reg<S32>,
    seqlen_k: Reg<S32>,
    m_start: Reg<S32>,
    block_m: u32,
    block_n: u32,
    causal_offset: Option<Reg<S32>>,
) -> KeyTiles {
    let tiles = visited_tiles(k, seqlen_k, m_start, block_m, block_n, causal_offset);
    let live = k.setp(Cmp::Lt, m_start, seqlen_q);
    KeyTiles {
        end: k.selp(tiles.end, 0i32, live),
        mask_from: tiles.mask_from,
    }
}

fn visited_tiles(
    k: &mut Kernel,
    seqlen_k: Reg<S32>,
    m_start: Reg<S32>,
    block_m: u32,
    block_n: u32,
    causal_offset: Option<Reg<S32>>,
) -> KeyTiles {
    let sk = k.cvt_s64_s32(seqlen_k);
    let total = ceil_div64(k, sk, block_n);
    let full = floor_div64(k, sk, block_n);
    let Some(offset) = causal_offset else {
        return KeyTiles {
            end: k.cvt_s32_s64(total),
            mask_from: k.cvt_s32_s64(full),
        };
    };
    let zero = k.mov::<S64>(0i64);
    let m = k.cvt_s64_s32(m_start);
    let off = k.cvt_s64_s32(offset);
    let diag0 = k.add(m, off);
    // The block's last row sees keys up to m_start + block_m − 1 + offset.
    let seen_by_last = k.add(diag0, i64::from(block_m));
    let end = ceil_div64(k, seen_by_last, block_n);
    let end = clamp_to_s32(k, end, zero, total);
    // The first tile holding a key the block's first row cannot see.
    let seen_by_first = k.add(diag0, 1i64);
    let diag = floor_div64(k, seen_by_first, block_n);
    let mask_from = clamp_to_s32(k, diag, zero, full);
    KeyTiles { end, mask_from }
}

/// A windowed kernel's view of one query tile's keys ([`FwdConfig::window`]): its
/// sequence rebased to start at the first key tile any of the tile's rows sees, so that
/// the key loops, the loads and the masks run over tiles `0..end` as in a causal kernel.
///
/// [`FwdConfig::window`]: super::FwdConfig::window
#[derive(Debug, Clone, Copy)]
pub struct WindowedKeys {
    /// The sequence with `k_start` moved on by the skipped keys and `seqlen_k` less them.
    pub seq: Sequence,
    /// Row `i` sees rebased keys up to `i + offset` (the causal offset, moved by the
    /// window's right side and the skipped keys).
    pub offset: Reg<S32>,
    /// Row `i` sees rebased keys from `i + low` on.
    pub low: Reg<S32>,
}

/// The keys of the query tile starting at row `m_start` of `seq` under the window of
/// the argument block ([`FwdArgs::window_left`], [`FwdArgs::window_right`]): the first
/// key any of its rows sees is `m_start + Sk − Sq − left`, and the tiles of `block_n`
/// keys wholly before it are skipped (a whole number of tiles, so that the rebased
/// tiles are the sequence's own and its end stays where TMA and the tails expect it).
/// In 64 bits, clamped into 32: the sides are at most 2^30 and the lengths below 2^31.
///
/// [`FwdArgs::window_left`]: super::FwdArgs::window_left
/// [`FwdArgs::window_right`]: super::FwdArgs::window_right
pub fn windowed_keys(
    k: &mut Kernel,
    args: ParamBytes,
    seq: Sequence,
    m_start: Reg<S32>,
    block_n: u32,
) -> WindowedKeys {
    let left = k.load_param_at::<U32>(args, offset_of!(FwdArgs, window_left));
    let right = k.load_param_at::<U32>(args, offset_of!(FwdArgs, window_right));
    let left = k.cvt_u64_u32(left).cast::<S64>();
    let right = k.cvt_u64_u32(right).cast::<S64>();
    let sk = k.cvt_s64_s32(seq.seqlen_k);
    let sq = k.cvt_s64_s32(seq.seqlen_q);
    let diag0 = k.sub(sk, sq);
    let m = k.cvt_s64_s32(m_start);
    let first = k.add(m, diag0);
    let first = k.sub(first, left);
    let skipped = floor_div64(k, first, block_n);
    let skipped = k.mul(skipped, i64::from(block_n));
    let skipped = k.min(skipped, sk);
    let (lo, hi) = (
        k.mov::<S64>(i64::from(i32::MIN)),
        k.mov::<S64>(i64::from(i32::MAX)),
    );
    let offset = k.add(diag0, right);
    let offset = k.sub(offset, skipped);
    let low = k.sub(diag0, left);
    let low = k.sub(low, skipped);
    let skipped = k.cvt_s32_s64(skipped);
    WindowedKeys {
        seq: Sequence {
            k_start: k.add(seq.k_start, skipped),
            seqlen_k: k.sub(seq.seqlen_k, skipped),
            ..seq
        },
        offset: clamp_to_s32(k, offset, lo, hi),
        low: clamp_to_s32(k, low, lo, hi),
    }
}

/// A windowed query tile's key tiles that cut some row's window on the left, `0..n`
/// (with [`WindowedKeys`]' rebased keys): those holding a key before the first key the
/// tile's last row sees, `m_start + block_m − 1 + low`. At most `end`. The tiles from
/// `n` up to the causal ones need no mask.
pub fn window_head_tiles(
    k: &mut Kernel,
    m_start: Reg<S32>,
    (block_m, block_n): (u32, u32),
    low: Reg<S32>,
    end: Reg<S32>,
) -> Reg<S32> {
    let m = k.cvt_s64_s32(m_start);
    let low = k.cvt_s64_s32(low);
    let first = k.add(m, low);
    let first = k.add(first, i64::from(block_m) - 1);
    let n = ceil_div64(k, first, block_n);
    let zero = k.mov::<S64>(0i64);
    let end = k.cvt_s64_s32(end);
    clamp_to_s32(k, n, zero, end)
}

/// One past the last key the thread's row `(slab, half)` sees: `seqlen_k`, and with
/// `causal_offset` at most its diagonal plus one (negative for a row that sees no key).
pub fn row_key_limit(
    k: &mut Kernel,
    rows: &Rows,
    (slab, half): (usize, usize),
    m_start: Reg<S32>,
    seqlen_k: Reg<S32>,
    causal_offset: Option<Reg<S32>>,
) -> Reg<S32> {
    let Some(offset) = causal_offset else {
        return seqlen_k;
    };
    let row = k.add_sat(m_start, rows.row0);
    let row = k.add_sat(row, Rows::offset(slab, half) as i32);
    causal_key_limit(k, row, seqlen_k, offset)
}

/// One past the last key query row `row` sees under a causal mask shifted by
/// `causal_offset` (bottom-right alignment): `min(seqlen_k, row + offset + 1)`, negative
/// for a row that sees no key.
pub fn causal_key_limit(
    k: &mut Kernel,
    row: Reg<S32>,
    seqlen_k: Reg<S32>,
    causal_offset: Reg<S32>,
) -> Reg<S32> {
    // Row + offset + 1 may exceed 2^31 − 1 for rows past Sq (never stored): saturate
    // instead of wrapping into a negative limit.
    let diag = k.add_sat(row, causal_offset);
    let diag = k.add_sat(diag, 1i32);
    k.min(seqlen_k, diag)
}

/// Sets to −∞ the scores of keys a row must not see: keys at or past `seqlen_k`, with
/// `causal_offset` keys past the row's diagonal, and with `low` (a window's) keys before
/// the row's index plus `low`. `first_key` is the tile's first key, `m_start` the
/// block's first query row.
#[allow(clippy::too_many_arguments)]
pub fn apply_mask(
    k: &mut Kernel,
    rows: &Rows,
    scores: &[Slab],
    first_key: Reg<S32>,
    m_start: Reg<S32>,
    seqlen_k: Reg<S32>,
    causal_offset: Option<Reg<S32>>,
    low: Option<Reg<S32>>,
) {
    let first_col = k.add(first_key, rows.col);
    for (slab, tiles) in scores.iter().enumerate() {
        for half in 0..2 {
            let mut limit = row_key_limit(k, rows, (slab, half), m_start, seqlen_k, causal_offset);
            if causal_offset.is_some() {
                limit = k.max(limit, 0i32);
            }
            // Column j of tile nt is first_col + 8·nt + j: masked when that is >= limit.
            let room = k.sub(limit, first_col);
            // ... or, in a window, when it is below the row's first key.
            let before = low.map(|low| {
                let row = k.add_sat(m_start, rows.row0);
                let row = k.add_sat(row, Rows::offset(slab, half) as i32);
                let first = k.add_sat(row, low);
                k.sub_sat(first, first_col)
            });
            for (nt, tile) in tiles.iter().enumerate() {
                for j in 0..2 {
                    let c = (nt * 8 + j) as i32;
                    let masked = k.setp(Cmp::Le, room, c);
                    let v = tile[2 * half + j];
                    k.selp_to(v, f32::NEG_INFINITY, v, masked);
                    if let Some(before) = before {
                        let early = k.setp(Cmp::Gt, before, c);
                        k.selp_to(v, f32::NEG_INFINITY, v, early);
                    }
                }
            }
        }
    }
}

/// The block's query tile index: blocks run in launch order, so with causal masking the
/// heaviest (last) query blocks go first.
pub fn query_block(k: &mut Kernel, block: Reg<U32>, blocks: Reg<U32>, causal: bool) -> Reg<U32> {
    if causal {
        let last = k.sub(blocks, 1u32);
        k.sub(last, block)
    } else {
        block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `mul.hi.u64` computes.
    fn mul_hi(x: u64, m: u64) -> u64 {
        ((u128::from(x) * u128::from(m)) >> 64) as u64
    }

    #[test]
    fn reciprocals_divide_exactly_below_their_bound() {
        let top = (1u64 << RECIPROCAL_BITS) - 1;
        // Every divisor a tile could have, and the largest allowed.
        let divisors = (3..=1024u32).chain([65535, 65536 - 3]);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for d in divisors.filter(|d| !d.is_power_of_two()) {
            let m = reciprocal(d);
            let d64 = u64::from(d);
            // Around 0, around multiples of d near 2^34 and near the bound, and random.
            let mut xs = vec![0, 1, d64 - 1, d64, d64 + 1, top, top - 1];
            for base in [1u64 << 34, top - d64 * 3] {
                let q = base / d64 * d64;
                xs.extend([q - 1, q, q + 1, q + d64 - 1]);
            }
            for _ in 0..200 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                xs.push(state & top);
            }
            for x in xs {
                assert_eq!(mul_hi(x, m), x / d64, "{x} / {d}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "reciprocal of 64")]
    fn powers_of_two_take_the_shift() {
        reciprocal(64);
    }
}
