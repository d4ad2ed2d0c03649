//! FP8 (E4M3) forward for Hopper (`.target sm_90a`) with per-block scales: the
//! FlashAttention-3 arrangement of [`super::sm90`] (a TMA producer warpgroup, two
//! consumer warpgroups of 64 query rows taking turns at the tensor cores, except at
//! head dim 64: [`Shape::turns`]), with e4m3 wgmma (`QGMMA`) for both products and the
//! data contract of [`super::fp8`].
//!
//! ```text
//! producer                               consumer c (rows 64c..64c+64)
//! load Q8 once                           S = Q8 K8[last]ᵀ; mask; softmax -> P8
//! for n in (0..end).rev():               for n in (0..last).rev():
//!     K ring: TMA K8[n]                      my turn:  S = Q8 K8[n]ᵀ              (SS)
//!     V ring: TMA Vᵀ8[n]                               T = P8 Vᵀ8[n+1], fresh     (RS)
//!                                            O *= rescale, if any row's  (T in flight)
//!                                                 max moved
//!                                            wait S; [mask]; softmax(S · dc[n])
//!                                            wait T; O += v_scale[n+1] · T
//!                                            P8 = e4m3(S)
//!                                        O *= rescale; O += v_scale[0] · P8 Vᵀ8[0]
//!                                        O /= l; store O, LSE
//! ```
//!
//! What differs from the 16-bit kernel:
//! - The scores are dequantized inside the exponent: `dc = q_scale · k_scale[n] ·
//!   scale · log2 e` per tile, `p = exp2(s·dc − m + 8)` in one FMA, so P lands in
//!   `[0, 256]` before it is rounded to E4M3 ([`OnlineSoftmax::update_scaled`]).
//! - A row's running maximum `m` only follows a tile's when that grows it by more than
//!   [`MAX_LAG_LOG2`] (P then reaches up to about 431, still inside E4M3): most tiles
//!   move no row's maximum, and a warp whose rows all kept theirs skips O's rescale,
//!   64 multiplies per thread and tile at head dim 128 (+2–4% there on the H200).
//! - `P·V` runs into a fresh accumulator T per key tile and is added to O in f32 with
//!   V's scale for that tile: the FP8 tensor cores accumulate with fewer bits than f32,
//!   so no sum inside them spans more than one tile. O itself is never a wgmma
//!   accumulator, so its rescale overlaps the tensor cores freely.
//! - V arrives transposed and key-permuted (`Vᵀ8`, K-major: FP8 wgmma cannot
//!   transpose), so the probabilities go from the score fragment to the e4m3 A fragment
//!   with no shuffles ([`pack_probs_e4m3`]).
//! - `P·V` runs in 64-column chunks of O, so T is 32 registers beside O's `d / 2`.
//! - At head dim 256, O's upper 128 columns are parked in shared memory, each thread's
//!   own fragment in its own slots (`Parked`): 128 registers of O beside S, T and P
//!   spilled in every arrangement tried, and the f32 fold (which reads and writes O
//!   anyway) costs one load and one store per four values.
//! - At head dim 256 only O's first 64 columns lag a tile behind as drawn above. The
//!   other 192 ("leading") run right after the softmax, on the P it just made and the
//!   tile's own V, each chunk folded in with the new rescale. Given old P, the
//!   scheduler started every chunk while the scores were still live, and S, the
//!   chunks' T and O did not fit in 240 registers.

use std::mem::offset_of;

use super::epilogue::{LseForm, OutputBlock, store_output_lse, store_output_staged};
use super::fp8::{Fp8Args, Fp8Config, MAX_LAG_LOG2, P_SHIFT_LOG2, SCALE_BLOCK, clamp_dequant};
use super::rows::{Slab, zeroed_slabs};
use super::sm90::{
    Block, ConsumerRoles, ItemLoop, MapColumns, Rings, Role, WorkQueue, advance, divisor,
    produce_items, split_roles,
};
use super::softmax::{OnlineSoftmax, rescale_moved_rows};
use super::{FwdArgs, HalfType, Tiling};
use crate::ptx::{
    Acc, Bf16x2, Cmp, E4m3x4, F16x2, F32, Half2, InFlight, KMajor, Kernel, KernelText, Module, N64,
    N128, ParamBytes, PtxError, RawSlot, Reg, RingBarriers, S32, ScaleD, Smem, SmemAddr, SmemDesc,
    SmemLayout, SmemPlan, Special, StageRing, Swizzle, Target, TileSlot, TmaDesc, U32, U64, WgmmaN,
};

/// Head dimensions with a kernel on this path.
pub const HEAD_DIMS: [u32; 3] = [64, 128, 256];
/// Query rows per block: two consumer warpgroups of 64 (the work-item loop is the
/// 16-bit kernel's).
pub const BLOCK_M: u32 = super::sm90::BLOCK_M;
/// Threads: a producer warpgroup and two consumer warpgroups.
pub const THREADS: u32 = 128 * (1 + CONSUMERS);
/// Consumer warpgroups, taking turns at the tensor cores where [`Shape::turns`].
const CONSUMERS: u32 = 2;
/// Registers per thread after reallocation: 128·24 + 256·240 = 64512 <= 65536.
pub const PRODUCER_REGS: u32 = 24;
pub const CONSUMER_REGS: u32 = 240;
/// K and V stages in flight.
pub const STAGES: u32 = 2;
/// One exponential in how many goes to the FMA pipe ([`OnlineSoftmax::with_fma_exps`];
/// 0: none): one in 32 at head dims 64 and 128, 8–10% faster (H100, same-call A/B,
/// 2026-11-27). Head dim 256 keeps MUFU for all: there the tensor cores set the pace
/// (the gain measured 1–2%), and every share tried but one in 16 spilled.
pub fn fma_exp_every(head_dim: u32) -> usize {
    if head_dim <= 128 { 32 } else { 0 }
}

/// The compile-time shape of one configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub head_dim: u32,
    /// Keys per tile (a divisor of [`SCALE_BLOCK`], so a tile has one K and one V scale).
    pub block_n: u32,
    /// Output columns per `P·V` chunk (T's N).
    pub chunk_n: u32,
    /// Output columns, from the first, whose `P·V` runs a key tile behind the scores,
    /// beside the softmax; the others run after it, on the P it makes (see
    /// `Consumer::step`). A multiple of `chunk_n`.
    pub lagging_cols: u32,
    /// Output columns, from the last, whose f32 accumulators live in shared memory
    /// (`Parked`) rather than in registers: a multiple of `chunk_n`.
    pub parked_cols: u32,
    /// Whether the two consumers take turns at the tensor cores (ping-pong). Turns keep
    /// one consumer's softmax beside the other's products, which pays where the products
    /// take about as long as a softmax (head dims 128 and 256: 1–3% slower without).
    /// At head dim 64 they take half as long, the softmaxes set the pace, and turns
    /// keep the two from ever overlapping on the exponent unit: without them the
    /// kernel is 5–6% faster without a mask and 1–2% causal (H100, same-call A/B,
    /// 2026-11-27).
    pub turns: bool,
}

/// Where everything lives in shared memory.
#[derive(Debug, Clone, Copy)]
pub struct Slots {
    pub q: TileSlot,
    pub k: TileSlot,
    pub vt: TileSlot,
    pub q_ring: RingBarriers,
    pub k_ring: RingBarriers,
    pub v_ring: RingBarriers,
    pub work: WorkQueue,
    /// The consumers' parked O columns, when there are any.
    pub parked: Option<RawSlot>,
    /// O's staging tile for its TMA store, where it fits (not beside the parked
    /// columns at d = 256: that O goes out by direct stores).
    pub o: Option<TileSlot>,
}

/// The parked region's alignment: every access is one `ld`/`st.shared.v4`.
const PARKED_ALIGN: u32 = 16;

/// O's parked columns: each consumer thread keeps its accumulator tiles (four f32 per
/// 8-column tile, as in a wgmma fragment) in slots of its own, tile `j` of consumer
/// thread `t` at byte `(j·256 + t)·16`. A warp's 16-byte accesses are consecutive (no
/// bank conflicts) and no thread touches another's values (no barrier).
#[derive(Clone, Copy)]
struct Parked {
    /// This thread's tile 0.
    at: SmemAddr,
    /// 8-column tiles parked.
    tiles: u32,
}

impl Parked {
    /// Threads of the two consumer warpgroups.
    const THREADS: u32 = THREADS - 128;

    fn bytes(cols: u32) -> u32 {
        cols / 8 * 16 * Self::THREADS
    }

    fn new(k: &mut Kernel, smem: Smem, slot: RawSlot, tid: Reg<U32>, cols: u32) -> Parked {
        let consumer = k.sub(tid, 128u32);
        let own = k.shl(consumer, 4);
        let base = smem.raw(k, slot);
        Parked {
            at: k.smem_offset(base, own),
            tiles: cols / 8,
        }
    }

    fn offset(tile: u32) -> i32 {
        (tile * Self::THREADS * 16) as i32
    }

    fn zero(&self, k: &mut Kernel) {
        let z = k.mov(0f32);
        for j in 0..self.tiles {
            k.st_shared_v4(self.at, Self::offset(j), [z; 4]);
        }
    }

    /// Parked tiles `first..first + t.len()` become `O·factors + v_scale·T`
    /// ([`rescale_add`]).
    fn fold(
        &self,
        k: &mut Kernel,
        first: u32,
        t: &[[Reg<F32>; 4]],
        factors: [Reg<F32>; 2],
        v_scale: Reg<F32>,
    ) {
        for (j, t) in (first..).zip(t) {
            let o = k.ld_shared_v4::<F32>(self.at, Self::offset(j));
            rescale_add(k, &o, t, factors, v_scale);
            k.st_shared_v4(self.at, Self::offset(j), o);
        }
    }

    fn load(&self, k: &mut Kernel) -> Slab {
        (0..self.tiles)
            .map(|j| k.ld_shared_v4::<F32>(self.at, Self::offset(j)))
            .collect()
    }
}

/// `o = o·factors[row half] + v_scale·t` for one accumulator-shaped 8-column tile: a
/// leading column's fold, the softmax's new rescale taken in with the tile's `P·V`.
fn rescale_add(
    k: &mut Kernel,
    o: &[Reg<F32>; 4],
    t: &[Reg<F32>; 4],
    factors: [Reg<F32>; 2],
    v_scale: Reg<F32>,
) {
    for (i, (&o, &t)) in o.iter().zip(t).enumerate() {
        k.mul_to(o, o, factors[i / 2]);
        k.mad_to(o, t, v_scale, o);
    }
}

/// The widest swizzle whose span a row of `bytes` fills.
fn swizzle_for(bytes: u32) -> Swizzle {
    if bytes.is_multiple_of(128) {
        Swizzle::B128
    } else {
        Swizzle::B64
    }
}

impl Shape {
    /// Keys per tile and `P·V` chunk: registers decide (S is `block_n / 2`, O `d / 2`,
    /// T `chunk_n / 2` and P `block_n / 8` per thread, of 240). A whole 128-column T
    /// spilled at d = 128. At d = 256, O's 128 registers beside S, T and P spilled in
    /// every arrangement tried (64-key tiles, 32- and 64-column chunks, P packed before
    /// the last chunks, other register budgets), so half of O is parked and the tiles
    /// stay those of d = 128; and only one chunk lags, since the scheduler overlaps
    /// every lagging chunk with the softmax (48 bytes of spill with all 256 lagging).
    pub fn of(cfg: &Fp8Config) -> Shape {
        Shape {
            head_dim: cfg.head_dim,
            block_n: 128,
            chunk_n: 64,
            lagging_cols: if cfg.head_dim > 128 { 64 } else { cfg.head_dim },
            parked_cols: cfg.head_dim.saturating_sub(128),
            turns: cfg.head_dim > 64,
        }
    }

    /// O's columns held in registers.
    pub fn register_cols(&self) -> u32 {
        self.head_dim - self.parked_cols
    }

    /// The 8-column tiles of O that lag (see [`Shape::lagging_cols`]).
    fn lagging_tiles(&self) -> usize {
        (self.lagging_cols / 8) as usize
    }

    pub fn q_layout(&self) -> SmemLayout {
        SmemLayout::new(BLOCK_M, self.head_dim, 1, swizzle_for(self.head_dim))
    }

    pub fn k_layout(&self) -> SmemLayout {
        SmemLayout::new(self.block_n, self.head_dim, 1, swizzle_for(self.head_dim))
    }

    /// O's staging tile: `BLOCK_M × d` 16-bit elements in 64-column blocks.
    pub fn o_layout(&self) -> SmemLayout {
        SmemLayout::new(BLOCK_M, self.head_dim, 2, Swizzle::B128)
    }

    /// `Vᵀ8`'s tile: head-dim rows of `block_n` keys.
    pub fn vt_layout(&self) -> SmemLayout {
        SmemLayout::new(self.head_dim, self.block_n, 1, swizzle_for(self.block_n))
    }

    pub fn plan(&self) -> (SmemPlan, Slots) {
        let mut plan = SmemPlan::new();
        let slots = Slots {
            q: plan.tile(self.q_layout(), 1),
            k: plan.tile(self.k_layout(), STAGES),
            vt: plan.tile(self.vt_layout(), STAGES),
            q_ring: RingBarriers::plan(&mut plan, 1),
            k_ring: RingBarriers::plan(&mut plan, STAGES),
            v_ring: RingBarriers::plan(&mut plan, STAGES),
            work: WorkQueue::plan(&mut plan, 128 * CONSUMERS),
            parked: (self.parked_cols > 0)
                .then(|| plan.raw(Parked::bytes(self.parked_cols), PARKED_ALIGN)),
            o: (self.parked_cols == 0).then(|| plan.tile(self.o_layout(), 1)),
        };
        (plan, slots)
    }
}

/// Whether `cfg`'s kernel stages O in shared memory for a TMA store (where the tile fits:
/// not beside the parked columns of d = 256, whose O goes out by direct stores).
pub fn stages_output(cfg: &Fp8Config) -> bool {
    Shape::of(cfg).plan().1.o.is_some()
}

pub(crate) fn tiling(cfg: &Fp8Config) -> Tiling {
    let s = Shape::of(cfg);
    Tiling {
        block_m: BLOCK_M,
        block_n: s.block_n,
        threads: THREADS,
        smem_bytes: s.plan().0.bytes(),
    }
}

pub(crate) fn generate(cfg: &Fp8Config) -> Result<Module, PtxError> {
    let s = Shape::of(cfg);
    let kernel = match (cfg.out, s.head_dim) {
        (HalfType::F16, 64) => build::<F16x2, N128, N64, N64>(cfg),
        (HalfType::Bf16, 64) => build::<Bf16x2, N128, N64, N64>(cfg),
        (HalfType::F16, 128) => build::<F16x2, N128, N64, N64>(cfg),
        (HalfType::Bf16, 128) => build::<Bf16x2, N128, N64, N64>(cfg),
        (HalfType::F16, 256) => build::<F16x2, N128, N64, N128>(cfg),
        (HalfType::Bf16, 256) => build::<Bf16x2, N128, N64, N128>(cfg),
        (_, d) => Err(PtxError::BadOperand(format!(
            "no sm90 FP8 forward for head dim {d}"
        ))),
    }?;
    let mut m = Module::new(Target::Sm90a);
    m.push(kernel)?;
    Ok(m)
}

/// What the roles share.
struct Fwd {
    s: Shape,
    causal: bool,
    args: ParamBytes,
    /// Q8, K8, Vᵀ8 and O.
    maps: [TmaDesc; 4],
    smem: Smem,
    slots: Slots,
}

fn build<H, NS, NC, NP>(cfg: &Fp8Config) -> Result<KernelText, PtxError>
where
    H: Half2,
    NS: WgmmaN,
    NC: WgmmaN,
    NP: WgmmaN,
{
    let s = Shape::of(cfg);
    debug_assert_eq!((NS::N, NC::N), (s.block_n, s.chunk_n));
    debug_assert!(s.parked_cols.is_multiple_of(NP::N));
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(THREADS).min_blocks_per_sm(1);
    let args = k.param_bytes("args", Fp8Args::SIZE, 8);
    let maps = [
        k.tensor_map_param("tmap_q"),
        k.tensor_map_param("tmap_k"),
        k.tensor_map_param("tmap_vt"),
        k.tensor_map_param("tmap_o"),
    ];
    let (plan, slots) = s.plan();
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);
    let f = Fwd {
        s,
        causal: cfg.causal,
        args,
        maps,
        smem,
        slots,
    };
    let rings = [&f.slots.q_ring, &f.slots.k_ring, &f.slots.v_ring].map(|r| (r, CONSUMERS));
    split_roles(
        &mut k,
        &f.smem,
        (rings, f.causal.then_some(&f.slots.work)),
        tid,
        |k| produce(k, &f, tid),
        |k| consume::<H, NS, NC, NP>(k, &f, tid),
    );
    k.finish()
}

impl Fwd {
    /// The work items: the 16-bit kernel's persistent loop, with this kernel's tile.
    fn items(&self) -> ItemLoop<'_> {
        ItemLoop {
            args: self.args,
            smem: self.smem,
            queue: &self.slots.work,
            causal: self.causal,
            window: None,
            tile: (BLOCK_M, self.s.block_n),
            used_keys: false,
            // Its launches are dense: no item is empty.
            skip_empty: false,
        }
    }
}

/// Warpgroup 0: one elected thread loads each work item's Q8 and streams K8 and Vᵀ8,
/// last tile first.
fn produce(k: &mut Kernel, f: &Fwd, tid: Reg<U32>) {
    k.comment("Producer: TMA loads of Q8, then K8 and V8 transposed, into their rings.");
    let inputs = (
        [f.maps[0], f.maps[1], f.maps[2]],
        [&f.slots.q_ring, &f.slots.k_ring, &f.slots.v_ring],
    );
    let producer = (tid, PRODUCER_REGS);
    produce_items(k, producer, f.items(), inputs, |k, b, at, rings| {
        let zero = at.zero;
        rings.q.fill(k, f.s.q_layout().bytes(), |k, qr, full| {
            let q_at = qr.slot(k, f.slots.q);
            let coords = [zero, b.m_start, zero, at.head, at.batch];
            k.tma_load(q_at, f.maps[0], coords, full);
        });
        let last = k.sub(b.tiles.end, 1i32);
        k.for_range(last, -1i32, -1, |k, n| {
            let key = k.mul(n, f.s.block_n as i32);
            rings.k.fill(k, f.s.k_layout().bytes(), |k, kr, full| {
                let k_at = kr.slot(k, f.slots.k);
                let coords = [zero, key, zero, at.kv_head, at.kv_batch];
                k.tma_load(k_at, f.maps[1], coords, full);
            });
            rings.v.fill(k, f.s.vt_layout().bytes(), |k, vr, full| {
                let vt_at = vr.slot(k, f.slots.vt);
                k.tma_load(vt_at, f.maps[2], [key, zero, at.kv_head, at.kv_batch], full);
            });
        });
    });
}

/// Where a work item's per-block scales are.
struct Scales {
    /// `q_scale · scale · log2 e` of this query tile.
    q_log2: Reg<F32>,
    /// Index of this (batch, kv head)'s first block in `k_scale` and `v_scale` (the
    /// pointers stay in the parameter space rather than in registers).
    kv_row: Reg<U32>,
}

/// A consumer warpgroup's registers and roles for one work item.
struct Consumer<'a> {
    f: &'a Fwd,
    b: &'a Block,
    roles: ConsumerRoles,
    q: SmemDesc<KMajor>,
    scales: Scales,
    softmax: OnlineSoftmax,
    /// Each row's pending rescale of O, from the last softmax.
    factors: [Reg<F32>; 2],
    /// `v_scale` of the tile whose probabilities are in `p`.
    p_v_scale: Reg<F32>,
    /// P of the last softmax as e4m3 A fragments: `p[j]` covers keys `32j..32j + 32`.
    p: Vec<[Reg<E4m3x4>; 4]>,
    /// O's register columns, unnormalised, in f32: accumulator-shaped 8-column tiles.
    o: Slab,
    /// O's other columns.
    parked: Option<Parked>,
}

/// Warpgroups 1 and 2.
fn consume<H, NS, NC, NP>(k: &mut Kernel, f: &Fwd, tid: Reg<U32>)
where
    H: Half2,
    NS: WgmmaN,
    NC: WgmmaN,
    NP: WgmmaN,
{
    k.comment(if f.s.turns {
        "Consumers: S = Q8 K8^T, softmax, O += v_scale * (P8 V8), in turns."
    } else {
        "Consumers: S = Q8 K8^T, softmax, O += v_scale * (P8 V8), side by side."
    });
    let consumers = (CONSUMERS, f.s.turns);
    let roles = ConsumerRoles::new(k, tid, CONSUMER_REGS, consumers, false);
    let q_at = f.smem.tile(k, f.slots.q, 0);
    let q = roles.q_rows(k, q_at, &f.s.q_layout());
    let ring_barriers = [&f.slots.q_ring, &f.slots.k_ring, &f.slots.v_ring];
    let mut rings = Rings::consumer(k, f.smem, ring_barriers);
    let parked = f
        .slots
        .parked
        .map(|slot| Parked::new(k, f.smem, slot, tid, f.s.parked_cols));
    let stage = f
        .slots
        .o
        .map(|slot| roles.output_stage(f.smem, slot, (f.maps[3], MapColumns::Blocked), false));
    f.items().run(k, Role::Consumer, |k, b| {
        let scales = item_scales(k, f.args, b);
        let c = Consumer {
            f,
            b,
            roles,
            q,
            scales,
            softmax: OnlineSoftmax::new(k, 1)
                .with_fma_exps(fma_exp_every(f.s.head_dim))
                .with_max_rounded_up(),
            factors: [k.mov(1f32), k.mov(1f32)],
            p_v_scale: k.mov(0f32),
            p: (0..f.s.block_n / 32)
                .map(|_| k.regs::<E4m3x4, 4>())
                .collect(),
            o: zeroed_slabs(k, 1, (f.s.register_cols() / 8) as usize).remove(0),
            parked,
        };
        if let Some(parked) = &c.parked {
            parked.zero(k);
        }
        let any = k.setp(Cmp::Gt, b.tiles.end, 0i32);
        k.if_(any, |k| c.attend::<NS, NC, NP>(k, &mut rings));
        let at = OutputBlock {
            batch: b.batch,
            head: b.head,
            m_start: b.m_start,
            seq: b.seq,
        };
        let shift = k.load_param_at::<U64>(f.args, offset_of!(Fp8Args, lse_shift));
        let form = LseForm::Log2 {
            offset: P_SHIFT_LOG2,
            shift,
        };
        let mut o = c.o.clone();
        if let Some(parked) = &c.parked {
            o.extend(parked.load(k));
        }
        let rows = &c.roles.rows;
        match &stage {
            Some(stage) => {
                let by_tma = ConsumerRoles::o_by_tma(k, f.args);
                let stage = (stage, by_tma);
                store_output_staged::<H>(k, f.args, rows, &o, &c.softmax, at, (form, None), stage);
            }
            None => {
                let o = std::slice::from_ref(&o);
                store_output_lse::<H>(k, f.args, rows, o, &c.softmax, at, form);
            }
        }
    });
    if let Some(stage) = &stage {
        stage.drain(k);
    }
}

/// The work item's query scale (folded with `scale·log2 e`) and its K and V scale rows.
fn item_scales(k: &mut Kernel, args: ParamBytes, b: &Block) -> Scales {
    // Read here, not kept in registers across the key loop.
    let scale_log2 = k.load_param_at::<F32>(args, offset_of!(FwdArgs, scale_log2));
    let group = divisor(k, args, offset_of!(FwdArgs, group_div));
    let heads_q = k.load_param_at::<U32>(args, offset_of!(FwdArgs, heads_q));
    let blocks = |k: &mut Kernel, off| k.load_param_at::<U32>(args, off);
    let q_blocks = blocks(k, offset_of!(Fp8Args, q_scale_blocks));
    let kv_blocks = blocks(k, offset_of!(Fp8Args, kv_scale_blocks));
    // q_scale[(b·Hq + h)·q_blocks + m_start / 128]
    let bh = k.mad(b.batch, heads_q, b.head);
    let q_block = k.shr(b.m_start.cast::<U32>(), SCALE_BLOCK.trailing_zeros());
    let q_index = k.mad(bh, q_blocks, q_block);
    let q_ptr = k.load_param_at::<U64>(args, offset_of!(Fp8Args, q_scale));
    let q_at = k.mad_wide_u32(q_index, 4u32, q_ptr);
    let q_scale = k.ld_global::<F32>(q_at, 0);
    // k_scale[(b·Hkv + h / group)·kv_blocks + ..]
    let heads_kv = k.div_fast(heads_q, group);
    let kv_head = k.div_fast(b.head, group);
    let bkv = k.mad(b.batch, heads_kv, kv_head);
    Scales {
        q_log2: k.mul(q_scale, scale_log2),
        kv_row: k.mul(bkv, kv_blocks),
    }
}

impl Consumer<'_> {
    /// The key loop for a block with at least one key tile; leaves O unnormalised.
    fn attend<NS: WgmmaN, NC: WgmmaN, NP: WgmmaN>(&self, k: &mut Kernel, rings: &mut Rings) {
        k.comment("Wait for Q; the last key tile (always masked) starts the pipeline.");
        rings.q.wait_full(k);
        let Rings {
            q: qr,
            k: kr,
            v: vr,
        } = rings;
        let end = self.b.tiles.end;
        let last = k.sub(end, 1i32);

        let dc = self.dequant(k, last);
        let v_scale = self.scale_of(k, offset_of!(Fp8Args, v_scale), last);
        let s = self
            .roles
            .scores_alone(k, kr, |k, kr| self.scores::<NS>(k, kr));
        self.release(k, kr);
        self.mask(k, &s, last);
        self.exponentiate(k, &s, dc);
        k.mov_to(self.p_v_scale, v_scale);
        pack_probs_e4m3(k, &s.tiles(), &self.p);
        self.leading_pv::<NC, NP>(k, vr);

        k.comment("Tiles that cross the sequence end or the diagonal, last to first.");
        let last_masked_end = k.sub(self.b.tiles.mask_from, 1i32);
        let second_last = k.sub(end, 2i32);
        k.for_range(second_last, last_masked_end, -1, |k, n| {
            self.step::<NS, NC, NP>(k, n, true, kr, vr)
        });
        k.comment("The remaining tiles need no mask.");
        let unmasked = k.min(self.b.tiles.mask_from, last);
        let first_unmasked = k.sub(unmasked, 1i32);
        k.for_range(first_unmasked, -1i32, -1, |k, n| {
            self.step::<NS, NC, NP>(k, n, false, kr, vr)
        });
        self.release(k, qr);

        k.comment("The last P V.");
        self.roles.wait_turn(k);
        vr.wait_full(k);
        let t = self.pv::<NC>(k, vr, 0);
        k.wgmma_commit();
        self.roles.pass_turn(k);
        self.rescale_lagging(k);
        self.finish_pv::<NC>(k, t, vr);
    }

    /// Key tile `n`, with `P·V` of tile `n + 1` overlapping its softmax.
    fn step<NS: WgmmaN, NC: WgmmaN, NP: WgmmaN>(
        &self,
        k: &mut Kernel,
        n: Reg<S32>,
        masked: bool,
        kr: &mut StageRing,
        vr: &mut StageRing,
    ) {
        let dc = self.dequant(k, n);
        let v_scale = self.scale_of(k, offset_of!(Fp8Args, v_scale), n);
        self.roles.wait_turn(k);
        kr.wait_full(k);
        let s = self.scores::<NS>(k, kr);
        k.wgmma_commit();
        vr.wait_full(k);
        let t = self.pv::<NC>(k, vr, 0);
        k.wgmma_commit();
        self.roles.pass_turn(k);
        // O is no wgmma's accumulator: its rescale runs beside the tensor cores.
        self.rescale_lagging(k);
        k.wgmma_wait(1);
        let s = k.wgmma_retire(s);
        self.release(k, kr);
        if masked {
            self.mask(k, &s, n);
        }
        self.exponentiate(k, &s, dc);
        self.finish_pv::<NC>(k, t, vr);
        k.mov_to(self.p_v_scale, v_scale);
        pack_probs_e4m3(k, &s.tiles(), &self.p);
        self.leading_pv::<NC, NP>(k, vr);
    }

    /// The online softmax of one tile of scores, dequantized by `dc` inside the
    /// exponent, the running maxima lagging by up to [`MAX_LAG_LOG2`].
    fn exponentiate<NS: WgmmaN>(&self, k: &mut Kernel, s: &Acc<NS>, dc: Reg<F32>) {
        self.softmax.update_scaled(
            k,
            &[s.tiles()],
            dc,
            P_SHIFT_LOG2,
            Some(MAX_LAG_LOG2),
            &[self.factors],
        );
    }

    /// The lagging columns take the rescale of the last softmax, unless it left every
    /// row of this warp at factor 1 (its maxima stayed: [`MAX_LAG_LOG2`]).
    fn rescale_lagging(&self, k: &mut Kernel) {
        let lagging = self.o[..self.f.s.lagging_tiles()].to_vec();
        rescale_moved_rows(k, &lagging, self.factors);
    }

    /// Waits for chunk 0 of `P·V`, adds it to O, runs the other lagging chunks, and
    /// releases the V stage.
    fn finish_pv<NC: WgmmaN>(&self, k: &mut Kernel, t: InFlight<NC>, vr: &mut StageRing) {
        k.wgmma_wait(0);
        let t = k.wgmma_retire(t);
        self.fold_lagging(k, &t, 0);
        let s = &self.f.s;
        for col in (s.chunk_n..s.lagging_cols).step_by(s.chunk_n as usize) {
            let t = self.pv::<NC>(k, vr, col);
            k.wgmma_commit();
            k.wgmma_wait(0);
            let t = k.wgmma_retire(t);
            self.fold_lagging(k, &t, col);
        }
        self.release(k, vr);
    }

    /// The leading columns of `P·V`, for the P just packed, on the V stage now current
    /// (the tile's own: the one before it was just released), each folded in with the
    /// rescale the softmax just made. That P depends on the softmax, so the scheduler
    /// cannot start these products while the scores are still live: beside S, T and
    /// the lagging chunk's T, they would not fit the registers.
    fn leading_pv<NC: WgmmaN, NP: WgmmaN>(&self, k: &mut Kernel, vr: &mut StageRing) {
        let s = &self.f.s;
        if s.lagging_cols == s.head_dim {
            return;
        }
        vr.wait_full(k);
        for col in (s.lagging_cols..s.register_cols()).step_by(s.chunk_n as usize) {
            let t = self.pv::<NC>(k, vr, col);
            k.wgmma_commit();
            k.wgmma_wait(0);
            let t = k.wgmma_retire(t);
            let first = (col / 8) as usize;
            for (o, t) in self.o[first..].iter().zip(&t.tiles()) {
                rescale_add(k, o, t, self.factors, self.p_v_scale);
            }
        }
        let parked = self.parked.as_ref();
        for col in (s.register_cols()..s.head_dim).step_by(NP::N as usize) {
            let t = self.pv::<NP>(k, vr, col);
            k.wgmma_commit();
            k.wgmma_wait(0);
            let t = k.wgmma_retire(t);
            let parked = parked.expect("columns past the registers are parked");
            let first = (col - s.register_cols()) / 8;
            parked.fold(k, first, &t.tiles(), self.factors, self.p_v_scale);
        }
    }

    /// `O[:, col..] += v_scale · T` for lagging columns.
    fn fold_lagging<N: WgmmaN>(&self, k: &mut Kernel, t: &Acc<N>, col: u32) {
        let first = (col / 8) as usize;
        for (o, t) in self.o[first..].iter().zip(t.tiles()) {
            for (&o, t) in o.iter().zip(t) {
                k.mad_to(o, t, self.p_v_scale, o);
            }
        }
    }

    /// `S = Q8 K8ᵀ` on the K ring's current stage (d/32 k-steps, SS).
    fn scores<NS: WgmmaN>(&self, k: &mut Kernel, kr: &StageRing) -> InFlight<NS> {
        let f = self.f;
        let (ql, kl) = (f.s.q_layout(), f.s.k_layout());
        let k_at = kr.slot(k, f.slots.k);
        let kd = k.smem_desc::<KMajor>(k_at, &kl);
        let acc = k.acc::<NS>();
        let mut flying = k.wgmma_ss::<E4m3x4, NS, KMajor, KMajor>(acc, self.q, kd, ScaleD::Zero);
        for step in 1..f.s.head_dim / 32 {
            let q = advance(k, self.q, ql.logical_offset(0, 32 * step));
            let kk = advance(k, kd, kl.logical_offset(0, 32 * step));
            flying = k.wgmma_ss::<E4m3x4, NS, KMajor, KMajor>(flying, q, kk, ScaleD::Accumulate);
        }
        flying
    }

    /// `T = P8 Vᵀ8[chunk]` into a fresh accumulator: output columns
    /// `chunk·chunk_n..+chunk_n`, block_n/32 k-steps (RS, `Vᵀ8` K-major).
    fn pv<NC: WgmmaN>(&self, k: &mut Kernel, vr: &StageRing, col: u32) -> InFlight<NC> {
        let f = self.f;
        let vl = f.s.vt_layout();
        let v_at = vr.slot(k, f.slots.vt);
        let rows = col;
        let vd = k.smem_desc::<KMajor>(v_at, &vl);
        let vd = advance(k, vd, vl.logical_offset(rows, 0));
        let acc = k.acc::<NC>();
        let mut flying = k.wgmma_rs::<E4m3x4, NC, KMajor>(acc, &self.p[0], vd, ScaleD::Zero);
        for (j, p) in self.p.iter().enumerate().skip(1) {
            let v = advance(k, vd, vl.logical_offset(0, 32 * j as u32));
            flying = k.wgmma_rs::<E4m3x4, NC, KMajor>(flying, p, v, ScaleD::Accumulate);
        }
        flying
    }

    /// Key tile `n`'s dequantization factor in the exponent: `q_scale · k_scale[n] ·
    /// scale · log2 e`, clamped ([`clamp_dequant`]).
    fn dequant(&self, k: &mut Kernel, n: Reg<S32>) -> Reg<F32> {
        let k_scale = self.scale_of(k, offset_of!(Fp8Args, k_scale), n);
        let dc = k.mul(k_scale, self.scales.q_log2);
        clamp_dequant(k, dc, self.f.s.head_dim)
    }

    /// Key tile `n`'s entry of the per-block scales at parameter offset `field`.
    fn scale_of(&self, k: &mut Kernel, field: usize, n: Reg<S32>) -> Reg<F32> {
        let tiles_per_block = SCALE_BLOCK / self.f.s.block_n;
        let block = k.shr(n.cast::<U32>(), tiles_per_block.trailing_zeros());
        let index = k.add(self.scales.kv_row, block);
        let base = k.load_param_at::<U64>(self.f.args, field);
        let at = k.mad_wide_u32(index, 4u32, base);
        k.ld_global::<F32>(at, 0)
    }

    fn mask<NS: WgmmaN>(&self, k: &mut Kernel, s: &Acc<NS>, n: Reg<S32>) {
        let scores = [s.tiles()];
        let tile = (n, self.f.s.block_n);
        self.b
            .mask_tile(k, (&self.roles.rows, &scores), tile, self.f.causal);
    }

    fn release(&self, k: &mut Kernel, ring: &mut StageRing) {
        self.roles.release(k, ring);
    }
}

/// Rounds probabilities to e4m3 A fragments: for keys `32j..32j + 32`, score tiles
/// `4j..4j + 4`. Register 0 takes row g's columns {2c, 2c+1} of tiles 4j and 4j + 1,
/// register 1 the same of row g + 8, registers 2 and 3 the same from tiles 4j + 2 and
/// 4j + 3: the MMA reads byte b of register 0 as key `4c + b`, which `Vᵀ8`'s key order
/// ([`super::fp8::VT_KEY_ORDER`]) makes the right one.
pub fn pack_probs_e4m3(k: &mut Kernel, scores: &Slab, p: &[[Reg<E4m3x4>; 4]]) {
    for (quad, dst) in scores.chunks(4).zip(p) {
        for (r, half, pair) in [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)] {
            let a = &quad[2 * pair];
            let b = &quad[2 * pair + 1];
            let lo = k.pack_e4m3x2(a[2 * half], a[2 * half + 1]);
            let hi = k.pack_e4m3x2(b[2 * half], b[2 * half + 1]);
            let word = k.join_b16x2(lo, hi);
            k.mov_to(dst[r], word.cast::<E4m3x4>());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::fp8::{Fp8Path, fp8_configs_on};

    fn sm90_configs() -> impl Iterator<Item = Fp8Config> {
        fp8_configs_on(Fp8Path::Sm90)
    }

    #[test]
    fn tiles_fit_shared_memory_and_scale_blocks() {
        for cfg in sm90_configs() {
            let s = Shape::of(&cfg);
            assert!(SCALE_BLOCK.is_multiple_of(s.block_n), "{cfg:?}");
            assert!(s.head_dim.is_multiple_of(s.chunk_n));
            for l in [s.q_layout(), s.k_layout(), s.vt_layout()] {
                assert!(l.is_valid(), "{cfg:?}: {l:?}");
            }
            assert!(tiling(&cfg).smem_bytes <= 227 * 1024, "{cfg:?}");
        }
    }

    #[test]
    fn every_config_generates() {
        for cfg in sm90_configs() {
            let m = generate(&cfg).unwrap_or_else(|e| panic!("{}: {e}", cfg.id()));
            let ptx = m.to_ptx();
            assert!(ptx.contains("e4m3.e4m3"), "{}", cfg.id());
        }
    }

    /// The consumers take turns at the tensor cores (a named barrier each, waited on and
    /// arrived at around every tile's products) above head dim 64, and run side by side
    /// at 64 with no named barrier at all.
    #[test]
    fn the_consumers_take_turns_above_head_dim_64() {
        for cfg in sm90_configs() {
            let ptx = generate(&cfg).unwrap().to_ptx();
            let named = |op: &str| {
                ptx.lines()
                    .filter(|l| l.contains(op) && l.ends_with(", 256;"))
                    .count()
            };
            let (waits, arrivals) = (named("bar.sync"), named("bar.arrive"));
            assert_eq!(Shape::of(&cfg).turns, cfg.head_dim > 64, "{}", cfg.id());
            if cfg.head_dim > 64 {
                // The first tile, the two loops (masked and not) and the last P V each
                // wait once and arrive once; the last warpgroup lets the first go.
                assert_eq!((waits, arrivals), (4, 5), "{}", cfg.id());
            } else {
                assert_eq!((waits, arrivals), (0, 0), "{}", cfg.id());
            }
        }
    }

    /// A row's running maximum lags its tiles' by at most [`MAX_LAG_LOG2`], which keeps
    /// every scaled probability inside E4M3's range; each softmax compares both row
    /// halves' growth against it, and O's rescale before each `P·V` (the first tile
    /// needs none, the last takes one after the loop) sits behind a warp vote.
    #[test]
    fn the_running_maximum_lags_within_e4m3_range() {
        use crate::kernels::attention::fp8::E4M3_MAX;
        assert!(2f32.powf(P_SHIFT_LOG2 + MAX_LAG_LOG2) < E4M3_MAX);
        let lag = format!("0f{:08X};", MAX_LAG_LOG2.to_bits());
        for cfg in sm90_configs() {
            let ptx = generate(&cfg).unwrap().to_ptx();
            let compares = ptx
                .lines()
                .filter(|l| l.contains("setp.le.f32") && l.ends_with(&lag))
                .count();
            // The first tile's softmax and the two loops' (masked and not).
            assert_eq!(compares, 3 * 2, "{}", cfg.id());
            assert_eq!(ptx.matches("vote.sync.any.pred").count(), 3, "{}", cfg.id());
        }
    }

    /// At head dims 64 and 128 each softmax sends one probability in
    /// [`fma_exp_every`] to the FMA pipe (one `add.rm` each); at 256 none.
    #[test]
    fn one_exponential_in_32_runs_on_the_fma_pipe_below_head_dim_256() {
        for cfg in sm90_configs() {
            let ptx = generate(&cfg).unwrap().to_ptx();
            let count = |op: &str| {
                ptx.lines()
                    .filter(|l| l.trim_start().starts_with(op))
                    .count()
            };
            let (on_fma, on_mufu) = (count("add.rm.f32"), count("ex2.approx"));
            let every = fma_exp_every(cfg.head_dim);
            if every == 0 {
                assert_eq!(on_fma, 0, "{}", cfg.id());
                continue;
            }
            // A thread's scores of a 64 x block_n tile, of which every `every`-th: the
            // first tile's softmax and the two loops' (masked and not).
            let scores = Shape::of(&cfg).block_n as usize / 2;
            assert_eq!(on_fma, 3 * (scores / every), "{}", cfg.id());
            assert!(on_mufu >= 3 * (scores - scores / every), "{}", cfg.id());
        }
    }
}
