//! Which keys a query block visits, and the mask on the tiles that need one.
//!
//! Keys are visited in tiles of `block_n`; only tiles that cross the sequence end or
//! (causal) the diagonal need masking, so a kernel runs a masked loop over those and an
//! unmasked loop over the rest. Causal masking is aligned bottom-right: query row i sees
//! key j iff `j <= i + (Sk − Sq)`.
//!
//! Index arithmetic is exact for every length validation accepts: tile counts are
//! computed in 64 bits, row limits with saturating adds, so nothing wraps near 2^31.
//! Tiles need not be a power of two keys wide (the sm90 path's d256 tile has 80).

use super::rows::{Rows, Slab};
use crate::ptx::{Cmp, Kernel, Reg, S32, S64, U32};

/// The key tiles a query block visits, `0..end`, of which `mask_from..end` need a mask.
#[derive(Debug, Clone, Copy)]
pub struct KeyTiles {
    pub end: Reg<S32>,
    pub mask_from: Reg<S32>,
}

/// `floor(max(x, 0) / d)` in 64 bits: a shift for a power-of-two `d`, a division
/// otherwise. (Every caller clamps its result at 0, and a clamped negative numerator gives
/// the same answer, so only non-negative numerators need dividing.)
fn floor_div64(k: &mut Kernel, x: Reg<S64>, d: u32) -> Reg<S64> {
    let x = k.max(x, 0i64);
    if d.is_power_of_two() {
        k.shr(x, d.trailing_zeros())
    } else {
        k.div(x, i64::from(d))
    }
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
    // Row + offset + 1 may exceed 2^31 − 1 for rows past Sq (never stored): saturate
    // instead of wrapping into a negative limit.
    let row = k.add_sat(m_start, rows.row0);
    let row = k.add_sat(row, Rows::offset(slab, half) as i32);
    let diag = k.add_sat(row, offset);
    let diag = k.add_sat(diag, 1i32);
    k.min(seqlen_k, diag)
}

/// Sets to −∞ the scores of keys a row must not see: keys at or past `seqlen_k` and,
/// with `causal_offset`, keys past the row's diagonal. `first_key` is the tile's first
/// key, `m_start` the block's first query row.
pub fn apply_mask(
    k: &mut Kernel,
    rows: &Rows,
    scores: &[Slab],
    first_key: Reg<S32>,
    m_start: Reg<S32>,
    seqlen_k: Reg<S32>,
    causal_offset: Option<Reg<S32>>,
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
            for (nt, tile) in tiles.iter().enumerate() {
                for j in 0..2 {
                    let masked = k.setp(Cmp::Le, room, (nt * 8 + j) as i32);
                    let v = tile[2 * half + j];
                    k.selp_to(v, f32::NEG_INFINITY, v, masked);
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
