//! A warp-specialized Hopper GEMM, `C = scale · A·Bᵀ`: the proof (and worked example) of the
//! sm_90a building blocks, kept as a test and benchmark kernel, not a public API promise.
//!
//! A is `[M, K]` and B is `[N, K]`, both row-major (K contiguous: both operands are
//! K-major), f16/bf16 or e4m3; C is `[M, N]` row-major, f16/bf16 (bf16 for e4m3 inputs),
//! accumulated in f32. Each block is persistent: it walks output tiles of 128 x 256
//! (grouped 8 tile-rows at a time so concurrent blocks share A and B in L2) with three
//! warpgroups:
//!
//! ```text
//! producer (warpgroup 0, 40 registers)     consumers (warpgroups 1, 2; 232 registers)
//! for each tile, for each k-tile:          for each tile:
//!     acquire a stage (EMPTY)                  for each k-tile:
//!     expect A + B bytes on FULL                   wait FULL
//!     TMA A[128 x 128 B], B[256 x 128 B]           4 x wgmma m64n256 (own 64 rows of A)
//!                                                  commit; wait for the previous k-tile;
//!                                                  release its stage (EMPTY)
//!                                              store the 64 x 256 accumulator to C
//! ```
//!
//! A k-tile is 128 bytes of K (64 f16/bf16 or 128 e4m3 elements): one 128-byte swizzled
//! row per tile row, four k16 (k32 for e4m3) steps of 32 bytes. Tiles at the edges of
//! M, N and K arrive zero-filled from TMA; the epilogue stores only rows < M and
//! columns < N.

use std::mem::offset_of;

use crate::ptx::{
    Acc, Bf16x2, CachePolicy, Cmp, E4m3x4, F16x2, F32, Half2, InFlight, KMajor, Kernel, KernelText,
    Module, N256, ParamBytes, PtxError, PtxType, Reg, RingBarriers, S32, ScaleD, Smem, SmemAddr,
    SmemLayout, SmemPlan, Special, StageRing, Swizzle, Target, TileSlot, TmaDesc, U32, U64, WgmmaD,
    WgmmaInput,
};

/// Output tile rows per block (two consumer warpgroups of 64).
pub const BLOCK_M: u32 = 128;
/// Output tile columns per block: one m64n256 wgmma per k-step.
pub const BLOCK_N: u32 = 256;
/// Bytes of K per stage: one 128-byte swizzled row.
pub const BLOCK_K_BYTES: u32 = 128;
/// Stages in the shared-memory ring (48 KiB each).
pub const STAGES: u32 = 4;
/// Threads per block: a producer warpgroup and two consumer warpgroups.
pub const THREADS: u32 = 384;
/// Registers per thread after reallocation: 128·40 + 256·232 = 64512 <= 65536.
pub const PRODUCER_REGS: u32 = 40;
pub const CONSUMER_REGS: u32 = 232;
/// Tile rows per group of the rasterization (see `tile_coords`).
pub const GROUP_M: u32 = 8;

/// Input element type (and so the output's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GemmType {
    F16,
    Bf16,
    /// FP8 e4m3 inputs, bf16 output.
    E4m3,
}

impl GemmType {
    pub fn name(self) -> &'static str {
        match self {
            GemmType::F16 => "f16",
            GemmType::Bf16 => "bf16",
            GemmType::E4m3 => "e4m3",
        }
    }

    /// Bytes per input element.
    pub fn in_bytes(self) -> u32 {
        match self {
            GemmType::E4m3 => 1,
            _ => 2,
        }
    }
}

/// One GEMM kernel configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GemmConfig {
    pub dtype: GemmType,
}

/// The by-value argument block.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GemmArgs {
    /// C's device address and row pitch in elements.
    pub c: u64,
    pub ldc: u64,
    pub m: u32,
    pub n: u32,
    pub tiles_m: u32,
    pub tiles_n: u32,
    pub k_tiles: u32,
    /// Multiplies the result (the FP8 dequantisation scale; 1 otherwise).
    pub scale: f32,
}

impl GemmArgs {
    pub const SIZE: usize = std::mem::size_of::<GemmArgs>();
}

/// Where everything lives in shared memory.
#[derive(Debug, Clone, Copy)]
pub struct GemmSmem {
    pub a: TileSlot,
    pub b: TileSlot,
    pub ring: RingBarriers,
}

impl GemmConfig {
    pub fn id(&self) -> String {
        format!(
            "gemm_sm90a_{}_m{BLOCK_M}n{BLOCK_N}k{}_s{STAGES}",
            self.dtype.name(),
            self.k_elems()
        )
    }

    /// K elements per stage.
    pub fn k_elems(&self) -> u32 {
        BLOCK_K_BYTES / self.dtype.in_bytes()
    }

    pub fn a_layout(&self) -> SmemLayout {
        SmemLayout::new(
            BLOCK_M,
            self.k_elems(),
            self.dtype.in_bytes(),
            Swizzle::B128,
        )
    }

    pub fn b_layout(&self) -> SmemLayout {
        SmemLayout::new(
            BLOCK_N,
            self.k_elems(),
            self.dtype.in_bytes(),
            Swizzle::B128,
        )
    }

    /// The shared-memory plan (its size is the launch's dynamic shared memory).
    pub fn smem(&self) -> (SmemPlan, GemmSmem) {
        let mut plan = SmemPlan::new();
        let a = plan.tile(self.a_layout(), STAGES);
        let b = plan.tile(self.b_layout(), STAGES);
        let ring = RingBarriers::plan(&mut plan, STAGES);
        (plan, GemmSmem { a, b, ring })
    }

    /// Bytes both TMA copies of a stage deliver.
    pub fn stage_bytes(&self) -> u32 {
        self.a_layout().bytes() + self.b_layout().bytes()
    }

    pub fn generate(&self) -> Result<Module, PtxError> {
        let kernel = match self.dtype {
            GemmType::F16 => build::<F16x2, F16x2>(self)?,
            GemmType::Bf16 => build::<Bf16x2, Bf16x2>(self)?,
            GemmType::E4m3 => build::<E4m3x4, Bf16x2>(self)?,
        };
        let mut m = Module::new(Target::Sm90a);
        m.push(kernel)?;
        Ok(m)
    }
}

/// Every GEMM configuration (one per input type).
pub fn all_gemm_configs() -> Vec<GemmConfig> {
    [GemmType::F16, GemmType::Bf16, GemmType::E4m3]
        .into_iter()
        .map(|dtype| GemmConfig { dtype })
        .collect()
}

fn arg<T: PtxType>(k: &mut Kernel, args: ParamBytes, offset: usize) -> Reg<T> {
    k.load_param_at::<T>(args, offset)
}

/// Output tile `(tm, tn)` of linear tile index `tile`: tiles run down a group of
/// [`GROUP_M`] tile-rows, then across, so the blocks in flight together read a few rows
/// of A and a few columns of B many times from L2.
fn tile_coords(
    k: &mut Kernel,
    tile: Reg<U32>,
    tiles_m: Reg<U32>,
    tiles_n: Reg<U32>,
) -> (Reg<U32>, Reg<U32>) {
    let per_group = k.mul(tiles_n, GROUP_M);
    let group = k.div(tile, per_group);
    let first_m = k.mul(group, GROUP_M);
    let rows_left = k.sub(tiles_m, first_m);
    let size = k.min(rows_left, GROUP_M);
    let in_group = k.rem(tile, per_group);
    let down = k.rem(in_group, size);
    let tm = k.add(first_m, down);
    let tn = k.div(in_group, size);
    (tm, tn)
}

/// The kernel's shared state: parameters, shared memory and the ring.
struct Gemm {
    args: ParamBytes,
    tmap_a: TmaDesc,
    tmap_b: TmaDesc,
    smem: Smem,
    slots: GemmSmem,
    tiles_m: Reg<U32>,
    tiles_n: Reg<U32>,
    k_tiles: Reg<S32>,
}

impl Gemm {
    /// `for tile in (blockIdx.x..tiles).step_by(gridDim.x) { body(tm, tn) }`.
    fn for_each_tile(&self, k: &mut Kernel, body: impl FnOnce(&mut Kernel, Reg<U32>, Reg<U32>)) {
        let first = k.special(Special::CtaidX);
        let stride = k.special(Special::NctaidX);
        let tiles = k.mul(self.tiles_m, self.tiles_n);
        let (tiles_m, tiles_n) = (self.tiles_m, self.tiles_n);
        k.for_stride(
            first.cast::<S32>(),
            tiles.cast::<S32>(),
            stride.cast(),
            |k, tile| {
                let (tm, tn) = tile_coords(k, tile.cast(), tiles_m, tiles_n);
                body(k, tm, tn);
            },
        );
    }
}

fn build<E: WgmmaInput, O: Half2>(cfg: &GemmConfig) -> Result<KernelText, PtxError> {
    let mut k = Kernel::new(&cfg.id());
    k.max_threads(THREADS).min_blocks_per_sm(1);
    let args = k.param_bytes("args", GemmArgs::SIZE, 8);
    let tmap_a = k.tensor_map_param("tmap_a");
    let tmap_b = k.tensor_map_param("tmap_b");
    let (plan, slots) = cfg.smem();
    let smem = k.shared_memory(&plan);
    let tid = k.special(Special::TidX);

    k.comment("One thread initialises the ring; everyone waits for it.");
    let first_thread = k.setp(Cmp::Eq, tid, 0u32);
    // FULL: the producer's one arrival plus the bytes; EMPTY: one arrival per consumer warp.
    k.if_(first_thread, |k| slots.ring.init(k, &smem, 1, 8));
    k.sync_threads();

    let g = Gemm {
        args,
        tmap_a,
        tmap_b,
        smem,
        slots,
        tiles_m: arg::<U32>(&mut k, args, offset_of!(GemmArgs, tiles_m)),
        tiles_n: arg::<U32>(&mut k, args, offset_of!(GemmArgs, tiles_n)),
        k_tiles: arg::<S32>(&mut k, args, offset_of!(GemmArgs, k_tiles)),
    };
    let warpgroup = k.shr(tid, 7);
    let producer = k.setp(Cmp::Eq, warpgroup, 0u32);
    k.if_else(
        producer,
        |k| produce(k, cfg, &g, tid),
        |k| consume::<E, O>(k, cfg, &g, tid),
    );
    k.finish()
}

/// Warpgroup 0: one elected thread of its first warp streams A and B tiles through the
/// ring; the other warps only hand their registers back.
fn produce(k: &mut Kernel, cfg: &GemmConfig, g: &Gemm, tid: Reg<U32>) {
    k.comment("Producer: TMA loads of A and B into the stage ring.");
    k.setmaxnreg_dec(PRODUCER_REGS);
    k.elected_thread_of_warp_0(tid, |k| {
        let mut ring = g.slots.ring.producer(k, g.smem);
        let k_elems = cfg.k_elems() as i32;
        g.for_each_tile(k, |k, tm, tn| {
            let row_a = k.mul(tm, BLOCK_M).cast::<S32>();
            let row_b = k.mul(tn, BLOCK_N).cast::<S32>();
            k.for_range(0i32, g.k_tiles, 1, |k, kt| {
                ring.fill(k, cfg.stage_bytes(), |k, ring, full| {
                    let a = ring.slot(k, g.slots.a);
                    let b = ring.slot(k, g.slots.b);
                    let col = k.mul(kt, k_elems);
                    k.tma_load(a, g.tmap_a, [col, row_a], full);
                    // B is re-read by every tile-row of the group: keep it in L2.
                    k.tma_load_hint(b, g.tmap_b, [col, row_b], full, CachePolicy::EvictLast);
                });
            });
        });
    });
}

/// Warpgroups 1 and 2: each computes its 64 rows of every tile.
fn consume<E: WgmmaInput, O: Half2>(k: &mut Kernel, cfg: &GemmConfig, g: &Gemm, tid: Reg<U32>) {
    k.comment("Consumers: wgmma on each stage, release it, store the tile.");
    k.setmaxnreg_inc(CONSUMER_REGS);
    let ct = k.sub(tid, 128u32);
    let consumer = k.shr(ct, 7);
    let in_wg = k.and(ct, 127u32);
    let lane = k.and(ct, 31u32);
    let leader = k.setp(Cmp::Eq, lane, 0u32);
    let mut read = g.slots.ring.consumer(k, g.smem);
    let mut release = g.slots.ring.consumer(k, g.smem);
    // Each consumer multiplies its own 64 rows of the A tile: 64 rows of 128 bytes, a
    // whole number of swizzle atoms, so a plain byte offset.
    let a_rows = k.mul(consumer, cfg.a_layout().logical_offset(64, 0));
    g.for_each_tile(k, |k, tm, tn| {
        read.wait_full(k);
        let acc = k.acc::<N256>();
        let f0 = mma_stage::<E>(k, cfg, g, &read, a_rows, acc, ScaleD::Zero);
        k.wgmma_commit();
        read.advance(k);
        let f = k.for_range_carry(1i32, g.k_tiles, 1, f0, |k, _kt, f| {
            read.wait_full(k);
            // The accumulator arrives over the loop's back edge: fence before chaining
            // onto it (CUTLASS's warpgroup_arrive per k-block; ptxas would insert it).
            k.wgmma_fence();
            let f = mma_stage::<E>(k, cfg, g, &read, a_rows, f, ScaleD::Accumulate);
            k.wgmma_commit();
            // The previous k-tile's group is done: its stage can be refilled.
            k.wgmma_wait(1);
            k.guarded(leader, true, |k| release.release(k));
            release.advance(k);
            read.advance(k);
            f
        });
        k.wgmma_wait(0);
        k.guarded(leader, true, |k| release.release(k));
        release.advance(k);
        let acc = k.wgmma_retire(f);
        store_tile::<O>(k, g, &acc, tm, tn, consumer, in_wg);
    });
}

/// One k-tile of wgmmas on the ring's current stage, into `d`: four k-steps of 32 bytes,
/// A from the consumer's rows (`a_rows` bytes into the A tile), all of B.
fn mma_stage<E: WgmmaInput>(
    k: &mut Kernel,
    cfg: &GemmConfig,
    g: &Gemm,
    ring: &StageRing,
    a_rows: Reg<U32>,
    d: impl WgmmaD<N256>,
    first: ScaleD,
) -> InFlight<N256> {
    let a_at = ring.slot(k, g.slots.a);
    let a_at: SmemAddr = k.smem_offset(a_at, a_rows);
    let b_at = ring.slot(k, g.slots.b);
    let a = k.smem_desc::<KMajor>(a_at, &cfg.a_layout());
    let b = k.smem_desc::<KMajor>(b_at, &cfg.b_layout());
    let mut f = k.wgmma_ss::<E, N256, KMajor, KMajor>(d, a, b, first);
    for step in 1..BLOCK_K_BYTES / 32 {
        let a = k.desc_advance(a, 32 * step);
        let b = k.desc_advance(b, 32 * step);
        f = k.wgmma_ss::<E, N256, KMajor, KMajor>(f, a, b, ScaleD::Accumulate);
    }
    f
}

/// Stores a consumer's 64 x 256 accumulator (times the scale) to C as 16-bit pairs, rows
/// < M and columns < N only.
fn store_tile<O: Half2>(
    k: &mut Kernel,
    g: &Gemm,
    acc: &Acc<N256>,
    tm: Reg<U32>,
    tn: Reg<U32>,
    consumer: Reg<U32>,
    in_wg: Reg<U32>,
) {
    k.comment("Epilogue: the accumulator to C.");
    let c = arg::<U64>(k, g.args, offset_of!(GemmArgs, c));
    let ldc = arg::<U64>(k, g.args, offset_of!(GemmArgs, ldc));
    let m = arg::<U32>(k, g.args, offset_of!(GemmArgs, m));
    let n = arg::<U32>(k, g.args, offset_of!(GemmArgs, n));
    let scale = arg::<F32>(k, g.args, offset_of!(GemmArgs, scale));
    // Thread (warp w, g = lane/4, c = lane%4) holds rows 16w + g (+8) of the consumer's 64,
    // columns 8j + 2c (+1).
    let warp = k.shr(in_wg, 5);
    let lane = k.and(in_wg, 31u32);
    let quad = k.shr(lane, 2);
    let pair = k.and(lane, 3u32);
    let row0 = k.mad(tm, BLOCK_M, quad);
    let row0 = k.mad(consumer, 64u32, row0);
    let row0 = k.mad(warp, 16u32, row0);
    let col0 = k.mul(tn, BLOCK_N);
    let col0 = k.mad(pair, 2u32, col0);
    let tiles = acc.tiles();
    for half in 0..2u32 {
        let row = k.add(row0, 8 * half);
        let row_ok = k.setp(Cmp::Lt, row, m);
        let row64 = k.cvt_u64_u32(row);
        let col64 = k.cvt_u64_u32(col0);
        let elem = k.mad(row64, ldc, col64);
        let byte = k.shl(elem, 1);
        let addr = k.add(c, byte);
        for (j, t) in tiles.iter().enumerate() {
            let col = k.add(col0, 8 * j as u32);
            let col_ok = k.setp(Cmp::Lt, col, n);
            let ok = k.and_pred(row_ok, col_ok);
            let lo = k.mul(t[2 * half as usize], scale);
            let hi = k.mul(t[2 * half as usize + 1], scale);
            let w = k.pack_half2::<O>(lo, hi);
            k.guarded(ok, true, |k| k.st_global(addr, 16 * j as i32, w));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_fits_and_stages_are_whole_atoms() {
        for cfg in all_gemm_configs() {
            let (plan, s) = cfg.smem();
            assert!(
                plan.bytes() <= 232_448,
                "{}: {} bytes",
                cfg.id(),
                plan.bytes()
            );
            assert!(cfg.a_layout().is_valid() && cfg.b_layout().is_valid());
            assert_eq!(cfg.a_layout().col_blocks(), 1, "one 128-byte block of K");
            assert_eq!(s.a.stride % 1024, 0);
            assert_eq!(cfg.stage_bytes(), 3 * 16384);
            assert_eq!(128 * PRODUCER_REGS + 256 * CONSUMER_REGS, 64512);
        }
    }

    #[test]
    fn every_config_generates() {
        for cfg in all_gemm_configs() {
            let ptx = cfg.generate().expect("generates").to_ptx();
            assert!(ptx.contains(".target sm_90a"));
            assert!(ptx.contains("setmaxnreg.inc.sync.aligned.u32 232;"));
        }
    }
}
