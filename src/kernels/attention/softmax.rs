//! The online softmax over accumulator rows, with `exp2` and the log2(e)-folded scale.
//!
//! Per row: the running maximum `m` of the raw scores and the running sum `l` of
//! `exp2((s − m)·c)`, `c = scale·log2(e)`. A new tile raises `m` to `m'`, rescales `l` and
//! the output row by `exp2((m − m')·c)`, and turns its scores into `exp2((s − m')·c)`.
//!
//! The difference is taken before the scale is applied: `(s − m)·c` stays finite for
//! every finite score and positive scale, where the fused `s·c − m·c` overflows once
//! `m·c` exceeds the float range (a scale of 1e37, say) and would turn every
//! probability into 0. A row that has only seen masked keys keeps `m = −∞`; 0 stands in
//! for it so that `exp2` gives 0 rather than NaN.
//!
//! The sm90 kernels fold the scale in where no score can overflow that way
//! ([`FwdConfig::fold_scale`](super::FwdConfig::fold_scale), [`super::scale_folds`]):
//! they keep `m` in log2 units ([`OnlineSoftmax::update_scaled`] with `dc = c`) and each
//! score's exponent is one FMA, `s·c − m`, instead of a subtraction and a multiplication.
//!
//! The FP8 kernels ([`OnlineSoftmax::step_e4m3`]) keep `m` in log2 units instead: each
//! key tile has its own dequantisation factor (its K scale block's), so raw scores of
//! different tiles are not comparable, while `s·dc` (the score's true value times
//! `scale·log2 e`) is.

use super::rows::{Slab, half_of};
use crate::ptx::{Cmp, E4m3x4, F32, Half2, Kernel, Reg};

/// Running maximum and (per-thread partial) sum of every row half a thread holds.
#[derive(Debug, Clone)]
pub struct OnlineSoftmax {
    /// `max[slab][half]`: the row's maximum raw score so far (−∞ before any key).
    pub max: Vec<[Reg<F32>; 2]>,
    /// `sum[slab][half]`: this thread's share of the row's sum; the 4 threads of a quad
    /// hold a row together ([`OnlineSoftmax::row_sum`] adds them).
    pub sum: Vec<[Reg<F32>; 2]>,
    /// One probability in `fma_exp_every` of [`OnlineSoftmax::update_scaled`] is
    /// exponentiated on the FMA pipe ([`Kernel::ex2_fma`]) rather than MUFU; 0: none.
    pub fma_exp_every: usize,
    /// Round each tile's maximum in log2 units up (`mul.rp`) rather than to nearest
    /// ([`OnlineSoftmax::with_max_rounded_up`]).
    pub max_rounds_up: bool,
}

/// The maximum of row half `half` of a slab's tiles, over its quad.
fn row_max(k: &mut Kernel, tiles: &Slab, half: usize) -> Reg<F32> {
    let mut tile_max = {
        let [a, b] = half_of(&tiles[0], half);
        k.max(a, b)
    };
    for tile in &tiles[1..] {
        for v in half_of(tile, half) {
            tile_max = k.max(tile_max, v);
        }
    }
    quad_max(k, tile_max)
}

/// The maximum of a row half over its quad (the 4 lanes that hold one row).
fn quad_max(k: &mut Kernel, mut v: Reg<F32>) -> Reg<F32> {
    for lanes in [1, 2] {
        let other = k.shfl_bfly(v, lanes);
        v = k.max(v, other);
    }
    v
}

impl OnlineSoftmax {
    pub fn new(k: &mut Kernel, slabs: usize) -> OnlineSoftmax {
        let ninf = f32::NEG_INFINITY;
        OnlineSoftmax {
            max: (0..slabs).map(|_| [k.mov(ninf), k.mov(ninf)]).collect(),
            sum: (0..slabs).map(|_| [k.mov(0f32), k.mov(0f32)]).collect(),
            fma_exp_every: 0,
            max_rounds_up: false,
        }
    }

    /// For the FP8 kernels, whose maxima in log2 units (`max(S8)·dc`) are products of a
    /// raw score and a per-tile factor: rounded to nearest, such a maximum can sit below
    /// the exact product by half an ulp, and the row's largest probability becomes
    /// `2^(offset + ulp/2)`: past E4M3's 448 once the maximum reaches 2^24, and infinite
    /// (O then NaN) past 2^31. Rounded up, it sits above by less than an ulp, so no
    /// probability exceeds `2^offset` (times the lag's `2^t`); the shortfall is one
    /// factor common to the whole row, which cancels in `O / l` and comes back in the
    /// log-sum-exp (`m + log2 l`). Probabilities stay in E4M3's normal range while the
    /// maximum is below 2^27 in log2 units.
    pub fn with_max_rounded_up(mut self) -> OnlineSoftmax {
        self.max_rounds_up = true;
        self
    }

    /// Sends one exponential in `every` of [`OnlineSoftmax::update_scaled`] to the FMA
    /// pipe ([`Kernel::ex2_fma`]; 0: none), counted over a call's scores row half by
    /// row half: at `every` = 32 and 128-key tiles, the last score of each row half.
    ///
    /// What this buys is a schedule, not MUFU throughput. In the sm90a FP8 kernels (and
    /// the three-consumer 16-bit ones) a tile's exponentials take MUFU about as long as
    /// its products take the tensor cores, and ptxas issues them in bunches that fill
    /// the MIO queue MUFU instructions wait in. One in 32 off MUFU breaks the bunches:
    /// the FP8 kernels ran 8–10% faster at head dims 64 and 128 (ncu: `mio_throttle`
    /// stalls 0.50 → 0.29 per issued instruction), where one in 4 to 6 gained half that
    /// and one in 3 lost (same-call A/B, `bench/RESULTS.md`, "FP8 v4").
    pub fn with_fma_exps(mut self, every: usize) -> OnlineSoftmax {
        self.fma_exp_every = every;
        self
    }

    /// Raises the running maxima to cover `scores`, rescales the sums and the output
    /// rows `o` by `exp2((m − m')·c)`, and returns, per slab and half, the value to
    /// subtract from the scores before scaling (the new maximum, 0 for rows that saw no
    /// key yet).
    fn rescale(
        &self,
        k: &mut Kernel,
        scores: &[Slab],
        o: &[Slab],
        scale_log2: Reg<F32>,
    ) -> Vec<[Reg<F32>; 2]> {
        scores
            .iter()
            .enumerate()
            .map(|(slab, tiles)| {
                std::array::from_fn(|half| {
                    let (usable, rescale) = self.raise_row(k, tiles, slab, half, scale_log2);
                    for acc in &o[slab] {
                        for v in half_of(acc, half) {
                            k.mul_to(v, v, rescale);
                        }
                    }
                    usable
                })
            })
            .collect()
    }

    /// One row half: the tile's maximum over the quad, the new running maximum, the sum
    /// rescaled. Returns the value to subtract from the scores (the new maximum, 0 for a
    /// row that has seen no key) and the output's rescale factor `exp2((m − m')·c)`.
    fn raise_row(
        &self,
        k: &mut Kernel,
        tiles: &Slab,
        slab: usize,
        half: usize,
        scale_log2: Reg<F32>,
    ) -> (Reg<F32>, Reg<F32>) {
        let tile_max = row_max(k, tiles, half);
        let old_max = self.max[slab][half];
        let new_max = k.max(old_max, tile_max);
        let none = k.setp(Cmp::Eq, new_max, f32::NEG_INFINITY);
        let usable = k.selp(0f32, new_max, none);
        let drop = k.sub(old_max, usable);
        let drop = k.mul(drop, scale_log2);
        let rescale = k.ex2(drop);
        k.mov_to(old_max, new_max);
        let sum = self.sum[slab][half];
        k.mul_to(sum, sum, rescale);
        (usable, rescale)
    }

    /// `v ← exp2((v − m)·c)`, added to `tile_sum`.
    fn exp_into(k: &mut Kernel, v: Reg<F32>, m: Reg<F32>, tile_sum: Reg<F32>, c: Reg<F32>) {
        let d = k.sub(v, m);
        let d = k.mul(d, c);
        k.ex2_to(v, d);
        k.add_to(tile_sum, tile_sum, v);
    }

    /// One zeroed partial sum per row half of `slabs` slabs.
    fn tile_sums(k: &mut Kernel, slabs: usize) -> Vec<[Reg<F32>; 2]> {
        (0..slabs).map(|_| [k.mov(0f32), k.mov(0f32)]).collect()
    }

    /// Adds a tile's partial sums to the running sums. Summing each tile on its own
    /// first keeps the running sum exact far longer: probabilities of 1.0 added one by
    /// one stop counting at 2^24 in f32, which a flat row of 2^25 keys would pass.
    fn fold(&self, k: &mut Kernel, tile_sums: &[[Reg<F32>; 2]]) {
        for (sums, tile) in self.sum.iter().zip(tile_sums) {
            for (&sum, &t) in sums.iter().zip(tile) {
                k.add_to(sum, sum, t);
            }
        }
    }

    /// Overwrites every score with `exp2((s − m)·c)`, `m` its row's entry of `maxes`, and
    /// adds the tile's sums to the running sums.
    fn exponentiate(&self, k: &mut Kernel, scores: &[Slab], maxes: &[[Reg<F32>; 2]], c: Reg<F32>) {
        let tile_sums = Self::tile_sums(k, scores.len());
        for ((tiles, maxes), sums) in scores.iter().zip(maxes).zip(&tile_sums) {
            for tile in tiles {
                for ((half, &m), &sum) in maxes.iter().enumerate().zip(sums) {
                    for v in half_of(tile, half) {
                        Self::exp_into(k, v, m, sum, c);
                    }
                }
            }
        }
        self.fold(k, &tile_sums);
    }

    /// Folds one tile of `scores` into the running state: raises the maxima, rescales
    /// the sums and the output rows `o`, and overwrites the scores with their
    /// unnormalised probabilities.
    pub fn step(&self, k: &mut Kernel, scores: &[Slab], o: &[Slab], scale_log2: Reg<F32>) {
        let maxes = self.rescale(k, scores, o, scale_log2);
        self.exponentiate(k, scores, &maxes, scale_log2);
    }

    /// [`OnlineSoftmax::step`] that hands the probabilities over packed as 16-bit A
    /// fragments of the next MMA ([`pack_probs`]), each pair of tiles packed as soon as
    /// it is exponentiated so the f32 scores die early.
    pub fn step_packed<H: Half2>(
        &self,
        k: &mut Kernel,
        scores: &[Slab],
        o: &[Slab],
        scale_log2: Reg<F32>,
    ) -> Vec<Vec<[Reg<H>; 4]>> {
        let maxes = self.rescale(k, scores, o, scale_log2);
        let tile_sums = Self::tile_sums(k, scores.len());
        let p = scores
            .iter()
            .enumerate()
            .map(|(slab, tiles)| {
                tiles
                    .chunks(2)
                    .map(|pair| {
                        for tile in pair {
                            let rows = maxes[slab].iter().zip(&tile_sums[slab]);
                            for (half, (&m, &sum)) in rows.enumerate() {
                                for v in half_of(tile, half) {
                                    Self::exp_into(k, v, m, sum, scale_log2);
                                }
                            }
                        }
                        pack_pair::<H>(k, &pair[0], &pair[1])
                    })
                    .collect()
            })
            .collect();
        self.fold(k, &tile_sums);
        p
    }

    /// The first half of a step for kernels that overlap the softmax with the previous
    /// tile's `P·V`: raises the maxima, rescales the sums, turns the scores into
    /// unnormalised probabilities, and writes into `factors` the factor by which the
    /// output rows must be rescaled ([`rescale_rows`]) before the next `P·V` adds to them.
    pub fn update(
        &self,
        k: &mut Kernel,
        scores: &[Slab],
        scale_log2: Reg<F32>,
        factors: &[[Reg<F32>; 2]],
    ) {
        let maxes: Vec<[Reg<F32>; 2]> = scores
            .iter()
            .enumerate()
            .map(|(slab, tiles)| {
                std::array::from_fn(|half| {
                    let (usable, rescale) = self.raise_row(k, tiles, slab, half, scale_log2);
                    k.mov_to(factors[slab][half], rescale);
                    usable
                })
            })
            .collect();
        self.exponentiate(k, scores, &maxes, scale_log2);
    }

    /// [`OnlineSoftmax::update`] for scores that reach log2 units only through a per-tile
    /// factor `dc > 0` (the FP8 kernels' dequantization scale times `scale·log2 e`): the
    /// running maxima are kept in log2 units, each score becomes
    /// `exp2(s·dc − m + offset)` in one FMA, and `factors` get `exp2(m − m')`.
    /// (`dc > 0` keeps the order of the scores, so a tile's largest raw score times `dc`
    /// is its largest scaled one, and a masked −∞ stays −∞.)
    ///
    /// With `lag = Some(t)`, a row's running maximum only follows a tile's when that
    /// grows it by more than `t` (log2 units): otherwise it stays, the row's factor is
    /// exactly 1 and its probabilities reach up to `2^(offset + t)` rather than
    /// `2^offset`. The sums and O stay consistent with the maximum in use, so the result
    /// is the same; what it saves is O's rescale, which a warp whose factors are all 1
    /// can skip.
    pub fn update_scaled(
        &self,
        k: &mut Kernel,
        scores: &[Slab],
        dc: Reg<F32>,
        offset: f32,
        lag: Option<f32>,
        factors: &[[Reg<F32>; 2]],
    ) {
        let tile_sums = Self::tile_sums(k, scores.len());
        let mut nth = 0;
        for (slab, tiles) in scores.iter().enumerate() {
            for half in 0..2 {
                let (usable, _) =
                    self.raise_row_log2(k, tiles, (slab, half), dc, lag, Some(factors[slab][half]));
                let bias = k.sub(offset, usable);
                let tile_sum = tile_sums[slab][half];
                for tile in tiles {
                    for v in half_of(tile, half) {
                        let x = k.mad(v, dc, bias);
                        nth += 1;
                        if self.fma_exp_every > 0 && nth % self.fma_exp_every == 0 {
                            k.ex2_fma_to(v, x);
                        } else {
                            k.ex2_to(v, x);
                        }
                        k.add_to(tile_sum, tile_sum, v);
                    }
                }
            }
        }
        self.fold(k, &tile_sums);
    }

    /// The whole row's sum (the quad's partial sums added), for slab `slab`, half `half`.
    pub fn row_sum(&self, k: &mut Kernel, slab: usize, half: usize) -> Reg<F32> {
        let mut sum = self.sum[slab][half];
        for lanes in [1, 2] {
            let other = k.shfl_bfly(sum, lanes);
            sum = k.add(sum, other);
        }
        sum
    }
}

/// FP8 scores: the running maximum in log2 units, probabilities rounded to E4M3.
impl OnlineSoftmax {
    /// Folds one tile of raw FP8 scores (`S8 = Q8·K8ᵀ`, f32) into the running state, `max`
    /// in log2 units: with `dequant` = `q_scale·k_scale·scale·log2 e` of this tile (> 0,
    /// so it keeps the order of the scores), the row maximum becomes
    /// `m' = max(m, max(S8)·dequant)`, the sums and the output rows `o` are rescaled by
    /// `exp2(m − m')`, and the probabilities are `p = exp2(S8·dequant − m' + shift)`, in
    /// `[0, 2^shift]`. The sums add the f32 probabilities; what is returned is them
    /// rounded to E4M3 and packed as A fragments of `mma.sync` m16n8k32 ([`pack_e4m3`]),
    /// each group of four tiles as soon as it is exponentiated.
    pub fn step_e4m3(
        &self,
        k: &mut Kernel,
        scores: &[Slab],
        o: &[Slab],
        dequant: Reg<F32>,
        shift: f32,
    ) -> Vec<Vec<[Reg<E4m3x4>; 4]>> {
        // Per row half, `shift − m'`: the exponent's additive term.
        let offsets: Vec<[Reg<F32>; 2]> = scores
            .iter()
            .enumerate()
            .map(|(slab, tiles)| {
                std::array::from_fn(|half| {
                    let (usable, rescale) =
                        self.raise_row_log2(k, tiles, (slab, half), dequant, None, None);
                    for acc in &o[slab] {
                        for v in half_of(acc, half) {
                            k.mul_to(v, v, rescale);
                        }
                    }
                    k.sub(shift, usable)
                })
            })
            .collect();
        let tile_sums = Self::tile_sums(k, scores.len());
        let p = scores
            .iter()
            .zip(&offsets)
            .zip(&tile_sums)
            .map(|((tiles, offsets), sums)| {
                tiles
                    .chunks(4)
                    .map(|group| {
                        for tile in group {
                            for (half, (&offset, &sum)) in offsets.iter().zip(sums).enumerate() {
                                for v in half_of(tile, half) {
                                    let e = k.mad(v, dequant, offset);
                                    k.ex2_to(v, e);
                                    k.add_to(sum, sum, v);
                                }
                            }
                        }
                        pack_e4m3(k, group)
                    })
                    .collect()
            })
            .collect();
        self.fold(k, &tile_sums);
        p
    }

    /// [`OnlineSoftmax::raise_row`] with the maximum in log2 units: the tile's raw
    /// maximum times `dequant` (−∞ stays −∞), and the rescale factor `exp2(m − m')`
    /// (written into `rescale_into` when given).
    fn raise_row_log2(
        &self,
        k: &mut Kernel,
        tiles: &Slab,
        (slab, half): (usize, usize),
        dequant: Reg<F32>,
        lag: Option<f32>,
        rescale_into: Option<Reg<F32>>,
    ) -> (Reg<F32>, Reg<F32>) {
        let tile_max = row_max(k, tiles, half);
        let tile_max = if self.max_rounds_up {
            k.mul_rp(tile_max, dequant)
        } else {
            k.mul(tile_max, dequant)
        };
        let old_max = self.max[slab][half];
        let new_max = k.max(old_max, tile_max);
        let new_max = match lag {
            // Keep the old maximum where the tile grows it by `t` at most (a difference
            // of NaN, −∞ − (−∞), is no small step: the row's first keys always count).
            Some(t) => {
                let step = k.sub(new_max, old_max);
                let small = k.setp(Cmp::Le, step, t);
                k.selp(old_max, new_max, small)
            }
            None => new_max,
        };
        let none = k.setp(Cmp::Eq, new_max, f32::NEG_INFINITY);
        let usable = k.selp(0f32, new_max, none);
        let drop = k.sub(old_max, usable);
        let rescale = match rescale_into {
            Some(d) => {
                k.ex2_to(d, drop);
                d
            }
            None => k.ex2(drop),
        };
        k.mov_to(old_max, new_max);
        let sum = self.sum[slab][half];
        k.mul_to(sum, sum, rescale);
        (usable, rescale)
    }
}

/// The E4M3 A fragment of `mma.sync` m16n8k32 for keys `32t..32t + 32` from the f32
/// accumulator tiles `4t..4t + 3` (`group`), with no data movement between threads.
///
/// Thread `c` of a quad holds columns `2c, 2c + 1` of every 8-key tile, so a register
/// packed from tiles `4t` and `4t + 1` holds keys `2c, 2c + 1, 8 + 2c, 9 + 2c` of the first
/// 16, in byte order, where the MMA reads k = `4c..4c + 3`: the keys arrive permuted
/// within each group of 16, which is why `Vᵀ8` stores key
/// [`VT_KEY_ORDER`](super::fp8::VT_KEY_ORDER)`[p]` at position `p`. Registers: a0 = row g
/// of tiles 4t, 4t + 1; a1 = row g + 8 of the same; a2, a3 = tiles 4t + 2, 4t + 3.
pub fn pack_e4m3(k: &mut Kernel, group: &[[Reg<F32>; 4]]) -> [Reg<E4m3x4>; 4] {
    let word = |k: &mut Kernel, first: &[Reg<F32>; 4], second: &[Reg<F32>; 4], half| {
        let [a, b] = half_of(first, half);
        let lo = k.pack_e4m3x2(a, b);
        let [a, b] = half_of(second, half);
        let hi = k.pack_e4m3x2(a, b);
        k.join_b16x2(lo, hi).cast::<E4m3x4>()
    };
    [
        word(k, &group[0], &group[1], 0),
        word(k, &group[0], &group[1], 1),
        word(k, &group[2], &group[3], 0),
        word(k, &group[2], &group[3], 1),
    ]
}

/// Multiplies each output row by its factor (from [`OnlineSoftmax::update`]).
pub fn rescale_rows(k: &mut Kernel, o: &[Slab], factors: &[[Reg<F32>; 2]]) {
    for (tiles, f) in o.iter().zip(factors) {
        for tile in tiles {
            for (half, &factor) in f.iter().enumerate() {
                for v in half_of(tile, half) {
                    k.mul_to(v, v, factor);
                }
            }
        }
    }
}

/// [`rescale_rows`] on one slab, skipped in a warp where every row's factor is exactly 1:
/// no running maximum moved, as happens on most tiles with a lagging maximum
/// ([`OnlineSoftmax::update_scaled`]'s `lag`). The vote keeps the branch warp-uniform.
pub fn rescale_moved_rows(k: &mut Kernel, o: &Slab, factors: [Reg<F32>; 2]) {
    let [a, b] = factors.map(|f| k.setp(Cmp::Ne, f, 1f32));
    let moved = k.or_pred(a, b);
    let any_moved = k.vote_any(moved);
    k.if_(any_moved, |k| {
        rescale_rows(k, std::slice::from_ref(o), &[factors])
    });
}

/// [`pack_probs`] into registers that already exist (probabilities carried from one
/// loop turn to the next).
pub fn pack_probs_into<H: Half2>(k: &mut Kernel, scores: &Slab, p: &[[Reg<H>; 4]]) {
    for (pair, dst) in scores.chunks(2).zip(p) {
        let (a, b) = (&pair[0], &pair[1]);
        k.pack_half2_to(dst[0], a[0], a[1]);
        k.pack_half2_to(dst[1], a[2], a[3]);
        k.pack_half2_to(dst[2], b[0], b[1]);
        k.pack_half2_to(dst[3], b[2], b[3]);
    }
}

/// A slab of probabilities packed as 16-bit A fragments of the next MMA: `p[t]` covers
/// columns (keys) `16t..16t + 16`. Accumulator tiles 2t and 2t + 1 are exactly that
/// fragment, for `mma.sync` m16n8k16 and for wgmma's register A alike.
pub fn pack_probs<H: Half2>(k: &mut Kernel, scores: &Slab) -> Vec<[Reg<H>; 4]> {
    scores
        .chunks(2)
        .map(|pair| pack_pair::<H>(k, &pair[0], &pair[1]))
        .collect()
}

/// The A fragment of keys `16t..16t + 16` from accumulator tiles `2t` (`a`) and `2t + 1`
/// (`b`): rows g and g + 8 of each, two keys per register.
fn pack_pair<H: Half2>(k: &mut Kernel, a: &[Reg<F32>; 4], b: &[Reg<F32>; 4]) -> [Reg<H>; 4] {
    [
        k.pack_half2::<H>(a[0], a[1]),
        k.pack_half2::<H>(a[2], a[3]),
        k.pack_half2::<H>(b[0], b[1]),
        k.pack_half2::<H>(b[2], b[3]),
    ]
}
