//! Random and extreme arguments through every `flashcore_check_*` entry point of the C
//! ABI (no GPU needed; the attention checks in their `_window` and `_ex` spellings too,
//! with key windows from sliding ones to the edges of int64, soft caps from Gemma 2's
//! to the edges of float and options' `struct_size`s of every other value, which must be
//! refused): each starts from a call that is
//! valid, changes up to three of its fields to values from the edges of their types
//! (zero, negative, 2^31, 2^63, NaN, misaligned or overlapping pointers, unknown dtype
//! codes, ...), and must answer with one of the documented codes. A panic inside flashcore (caught at the boundary as
//! `FLASHCORE_ERROR_PANIC`) fails the test with the arguments that caused it; so does a
//! valid starting call that is refused, which would mean the generator, not the checks,
//! decides what gets tested.
//!
//! CI runs it in a debug build as well (`.ci/run`, step `overflow`), where integer
//! overflow panics: an unchecked size computation shows up there, not only wrong sizes.
//! It complements the library's own `*never_panic*` unit tests, which draw views through
//! the Rust validators and plans; this one goes through the C structs and covers the
//! merge, the append and the quantizer's checks too.

use flashcore::error::RETURN_CODES;
use flashcore::ffi::{
    FLASHCORE_BF16, FLASHCORE_E4M3, FLASHCORE_ERROR_PANIC, FLASHCORE_F16, FLASHCORE_F32,
    FLASHCORE_SUCCESS, FlashcoreAttentionOptions, FlashcoreFp8Operands, FlashcoreKvCache,
    FlashcoreKvScales, FlashcoreQuantizeOptions, FlashcoreTensor, FlashcoreVarlen,
    flashcore_check_append_kv, flashcore_check_append_kv_fp8kv, flashcore_check_decode,
    flashcore_check_decode_ex, flashcore_check_decode_fp8kv, flashcore_check_decode_fp8kv_ex,
    flashcore_check_decode_fp8kv_window, flashcore_check_decode_varlen,
    flashcore_check_decode_window, flashcore_check_forward, flashcore_check_forward_ex,
    flashcore_check_forward_fp8, flashcore_check_forward_varlen, flashcore_check_forward_varlen_ex,
    flashcore_check_forward_varlen_window, flashcore_check_forward_window, flashcore_check_merge,
    flashcore_check_quantize_fp8, flashcore_last_error,
};
use std::ffi::CStr;
use std::ptr;

/// Calls per entry point and seed.
const ROUNDS: usize = 1500;
const SEEDS: [u64; 3] = [0x5eed_0001, 0x5eed_0002, 0xfeed_beef_cafe_f00d];

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
    fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }
}

/// Integers from the edges: what a 64-bit field of the ABI can hold that a shape or a
/// stride should not.
const EDGE_I64: [i64; 22] = [
    0,
    1,
    -1,
    2,
    3,
    7,
    8,
    15,
    16,
    17,
    255,
    65_535,
    65_536,
    1 << 25,
    (1 << 25) + 1,
    (1 << 31) - 1,
    1 << 31,
    1 << 32,
    1 << 40,
    1 << 62,
    i64::MAX,
    i64::MIN,
];

/// Device addresses from the edges: null, unaligned, near the top of the address space.
const EDGE_PTR: [u64; 9] = [
    0,
    1,
    4,
    8,
    1 << 40,
    1 << 63,
    u64::MAX,
    u64::MAX - 15,
    u64::MAX - 255,
];

const DTYPE_CODES: [i32; 8] = [
    FLASHCORE_F16,
    FLASHCORE_BF16,
    FLASHCORE_F32,
    FLASHCORE_E4M3,
    0,
    -1,
    99,
    i32::MIN,
];

const SCALES: [f32; 9] = [
    0.0,
    -0.125,
    0.125,
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::MIN_POSITIVE,
    f32::MAX,
    1e-40,
];

/// A contiguous `[b, s, h, d]` view at `ptr` (the strides wrap where the sizes are
/// already edge values: the checks must refuse those views either way).
fn bshd(ptr: u64, dtype: i32, [b, s, h, d]: [i64; 4]) -> FlashcoreTensor {
    let hd = h.wrapping_mul(d);
    FlashcoreTensor {
        ptr,
        dtype,
        shape: [b, s, h, d],
        strides: [s.wrapping_mul(hd), hd, d, 1],
    }
}

/// Device addresses of separate 16 GiB regions, so that valid calls never overlap.
fn region(i: u64) -> u64 {
    (i + 1) << 34
}

/// Changes one field of `t` to an edge value.
fn mutate_tensor(rng: &mut Rng, t: &mut FlashcoreTensor) {
    match rng.below(6) {
        0 => t.ptr = rng.pick(&EDGE_PTR),
        1 => t.ptr = t.ptr.wrapping_add(rng.pick(&[2, 8, 16, 1 << 33])),
        2 => t.dtype = rng.pick(&DTYPE_CODES),
        3 => t.shape[rng.below(4) as usize] = rng.pick(&EDGE_I64),
        4 => t.strides[rng.below(4) as usize] = rng.pick(&EDGE_I64),
        _ => {
            // A plausible but wrong size: off by one, doubled, halved.
            let i = rng.below(4) as usize;
            let x = t.shape[i];
            t.shape[i] = rng.pick(&[
                x.wrapping_add(1),
                x.wrapping_sub(1),
                x.wrapping_mul(2),
                x / 2,
            ]);
        }
    }
}

/// Gives every view in `ts` head dim `d` (contiguous strides again): what reaches the
/// head-dim rules, where changing one view's would stop at the shapes' agreement.
fn set_head_dim(ts: &mut [FlashcoreTensor], d: i64) {
    for t in ts {
        let [b, s, h, _] = t.shape;
        *t = bshd(t.ptr, t.dtype, [b, s, h, d]);
    }
}

/// Head dims with no kernel, or none at all.
const BAD_HEAD_DIMS: [i64; 7] = [0, 4, 12, 260, 264, 1 << 20, -8];

/// The code's name, or a failure for a code the ABI does not document.
fn code_name(rc: i32) -> &'static str {
    RETURN_CODES
        .iter()
        .find(|c| c.code == rc)
        .map(|c| c.name)
        .unwrap_or_else(|| panic!("undocumented return code {rc}"))
}

fn last_error() -> String {
    // SAFETY: flashcore_last_error never returns null and the string lives until the
    // next flashcore call on this thread.
    unsafe { CStr::from_ptr(flashcore_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Checks one answer: a documented code, no panic; `valid` calls must pass.
fn judge(what: &str, valid: bool, rc: i32, args: &dyn std::fmt::Debug) {
    let name = code_name(rc);
    assert_ne!(
        rc,
        FLASHCORE_ERROR_PANIC,
        "{what} panicked: {}\nwith {args:#?}",
        last_error()
    );
    if valid {
        assert_eq!(
            rc,
            FLASHCORE_SUCCESS,
            "{what} refused a valid call with {name}: {}\nwith {args:#?}",
            last_error()
        );
    }
}

/// How many fields to change: none for one call in four (which must then pass).
fn mutations(rng: &mut Rng) -> usize {
    rng.pick(&[0, 1, 1, 1, 2, 2, 3])
}

fn head_dim(rng: &mut Rng) -> i64 {
    rng.pick(&[8, 32, 64, 80, 96, 128, 192, 256])
}

fn dtype16(rng: &mut Rng) -> i32 {
    rng.pick(&[FLASHCORE_F16, FLASHCORE_BF16])
}

/// A key window for a call that is causal or not, or none (`None`: the plain spelling):
/// FlashAttention's `(left, right)`, negative sides unbounded, from sliding windows to
/// sides past every sequence and the edges of int64. Never a right side above 0 with
/// causal masking, which the checks refuse.
fn window(rng: &mut Rng, causal: bool) -> Option<(i64, i64)> {
    if rng.chance(3) {
        return None;
    }
    let left = rng.pick(&[-1, 0, 1, 15, 4095, 1 << 40, i64::MAX, i64::MIN]);
    let right = if causal {
        rng.pick(&[-1, 0, i64::MIN])
    } else {
        rng.pick(&[-1, 0, 7, 1 << 40, i64::MAX, i64::MIN])
    };
    Some((left, right))
}

/// A window from the edges of int64, whatever the call's causal masking says.
fn any_window(rng: &mut Rng) -> Option<(i64, i64)> {
    Some((rng.pick(&EDGE_I64), rng.pick(&EDGE_I64)))
}

/// A soft cap for the `_ex` spelling, or none (`None`: the plain or `_window` spelling):
/// none (0 of either sign), Gemma 2's and Grok's, small and large ones, all valid at every
/// head dim's default scale.
fn softcap(rng: &mut Rng) -> Option<f32> {
    if rng.chance(2) {
        return None;
    }
    Some(rng.pick(&[0.0, -0.0, 50.0, 30.0, 5.0, 1e-3, 1e6]))
}

/// Soft caps from the edges of float: negative, not finite, so small or so large that the
/// scale's ratio to them is no normal float.
const EDGE_SOFTCAPS: [f32; 10] = [
    -1.0,
    -50.0,
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::MIN_POSITIVE,
    1e-40,
    f32::from_bits(1),
    3e38,
    f32::MAX,
];

/// `struct_size`s the library must refuse: below the first version's 32 bytes, not a
/// multiple of 8, or above this library's size (a newer header's), up to the edges of u32.
const EDGE_STRUCT_SIZES: [u32; 16] = [
    0,
    1,
    4,
    8,
    16,
    24,
    28,
    31,
    33,
    36,
    40,
    48,
    64,
    1 << 16,
    1 << 31,
    u32::MAX,
];

/// A `struct_size` other than this library's: an edge, a small one or any u32.
fn other_struct_size(rng: &mut Rng) -> u32 {
    let size = match rng.below(3) {
        0 => rng.pick(&EDGE_STRUCT_SIZES),
        1 => rng.below(129) as u32,
        _ => rng.next() as u32,
    };
    if size == FlashcoreAttentionOptions::SIZE {
        0
    } else {
        size
    }
}

/// The options of an `_ex` call: its scale and causal flag, its window (none: −1, −1),
/// its soft cap and its `struct_size` (this library's: [`FlashcoreAttentionOptions::SIZE`]).
fn options(
    scale: f32,
    causal: i32,
    window: Option<(i64, i64)>,
    cap: f32,
    struct_size: u32,
) -> FlashcoreAttentionOptions {
    let (window_left, window_right) = window.unwrap_or((-1, -1));
    FlashcoreAttentionOptions {
        struct_size,
        softmax_scale: scale,
        causal,
        window_left,
        window_right,
        softcap: cap,
    }
}

/// Checks one answer of an `_ex` spelling on top of [`judge`]: options of another size
/// than this library's are never accepted.
fn judge_size(what: &str, struct_size: u32, rc: i32, args: &dyn std::fmt::Debug) {
    if struct_size != FlashcoreAttentionOptions::SIZE {
        assert_ne!(
            rc, FLASHCORE_SUCCESS,
            "{what}_ex accepted options of struct_size {struct_size}\nwith {args:#?}"
        );
    }
}

#[test]
fn forward_checks_answer_every_argument_with_a_code() {
    for seed in SEEDS {
        let mut rng = Rng(seed);
        for _ in 0..ROUNDS {
            let (b, hkv) = (rng.pick(&[1, 2, 3, 16]), rng.pick(&[1, 2, 8]));
            let hq = hkv * rng.pick(&[1, 4, 8]);
            let (sq, sk) = (
                rng.pick(&[1, 17, 113, 1024, 4097]),
                rng.pick(&[1, 17, 113, 1024, 4097]),
            );
            let (d, dt) = (head_dim(&mut rng), dtype16(&mut rng));
            let mut t = [
                bshd(region(0), dt, [b, sq, hq, d]),
                bshd(region(1), dt, [b, sk, hkv, d]),
                bshd(region(2), dt, [b, sk, hkv, d]),
                bshd(region(3), dt, [b, sq, hq, d]),
            ];
            let mut lse = if rng.chance(2) { region(4) } else { 0 };
            let mut scale = 0.0f32;
            let mut causal = rng.below(2) as i32;
            let mut window = window(&mut rng, causal != 0);
            let mut softcap = softcap(&mut rng);
            let mut size = FlashcoreAttentionOptions::SIZE;
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(12) {
                    0 => lse = rng.pick(&[2, region(0), region(3) + 64, u64::MAX - 3]),
                    1 => scale = rng.pick(&SCALES),
                    2 => causal = rng.pick(&[-1, 2, i32::MAX]),
                    3 => set_head_dim(&mut t, rng.pick(&BAD_HEAD_DIMS)),
                    4 => window = any_window(&mut rng),
                    5 => softcap = Some(rng.pick(&EDGE_SOFTCAPS)),
                    6 => {
                        // Through the _ex spelling (no cap, if none was drawn).
                        size = other_struct_size(&mut rng);
                        softcap.get_or_insert(0.0);
                    }
                    _ => {
                        let i = rng.below(4) as usize;
                        mutate_tensor(&mut rng, &mut t[i]);
                    }
                }
            }
            // SAFETY: every pointer argument points at a live struct of its type.
            let rc = unsafe {
                match (softcap, window) {
                    (Some(cap), _) => flashcore_check_forward_ex(
                        &t[0],
                        &t[1],
                        &t[2],
                        &t[3],
                        lse,
                        &options(scale, causal, window, cap, size),
                    ),
                    (None, None) => {
                        flashcore_check_forward(&t[0], &t[1], &t[2], &t[3], lse, scale, causal)
                    }
                    (None, Some((left, right))) => flashcore_check_forward_window(
                        &t[0], &t[1], &t[2], &t[3], lse, scale, causal, left, right,
                    ),
                }
            };
            let args = (t, lse, scale, causal, window, softcap, size);
            judge("flashcore_check_forward", n == 0, rc, &args);
            judge_size("flashcore_check_forward", size, rc, &args);
        }
    }
}

#[test]
fn varlen_checks_answer_every_argument_with_a_code() {
    for seed in SEEDS {
        let mut rng = Rng(seed ^ 1);
        for _ in 0..ROUNDS {
            let batch = rng.pick(&[1usize, 2, 5, 33]);
            let mut cu_q = vec![0i32];
            let mut cu_k = vec![0i32];
            for _ in 0..batch {
                let (lq, lk) = (
                    rng.pick(&[0, 1, 7, 100, 513]),
                    rng.pick(&[0, 1, 7, 100, 513]),
                );
                cu_q.push(cu_q.last().unwrap() + lq);
                cu_k.push(cu_k.last().unwrap() + lk);
            }
            let max_q = cu_q.windows(2).map(|w| w[1] - w[0]).max().unwrap().max(1) as i64;
            let (total_q, total_k) = (
                i64::from(*cu_q.last().unwrap()).max(1),
                i64::from(*cu_k.last().unwrap()).max(1),
            );
            let (hkv, d, dt) = (rng.pick(&[1, 4]), head_dim(&mut rng), dtype16(&mut rng));
            let hq = hkv * rng.pick(&[1, 2]);
            let mut t = [
                bshd(region(0), dt, [1, total_q, hq, d]),
                bshd(region(1), dt, [1, total_k, hkv, d]),
                bshd(region(2), dt, [1, total_k, hkv, d]),
                bshd(region(3), dt, [1, total_q, hq, d]),
            ];
            let mut varlen = FlashcoreVarlen {
                cu_seqlens_q: region(5),
                cu_seqlens_k: region(6),
                batch: batch as i64,
                max_seqlen_q: max_q,
            };
            let mut lse = if rng.chance(2) { region(4) } else { 0 };
            let mut host = rng.chance(2);
            let mut softcap = softcap(&mut rng);
            let mut size = FlashcoreAttentionOptions::SIZE;
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(11) {
                    6 => softcap = Some(rng.pick(&EDGE_SOFTCAPS)),
                    7 => {
                        size = other_struct_size(&mut rng);
                        softcap.get_or_insert(0.0);
                    }
                    0 => varlen.batch = rng.pick(&EDGE_I64),
                    1 => varlen.max_seqlen_q = rng.pick(&EDGE_I64),
                    2 => varlen.cu_seqlens_q = rng.pick(&[0, 2, region(3), region(0) + 16]),
                    3 => varlen.cu_seqlens_k = rng.pick(&[0, 6, region(5), region(4)]),
                    4 => lse = rng.pick(&[2, region(3), region(5)]),
                    5 if !cu_q.is_empty() => {
                        // Host offsets that decrease, start below 0 or run past the tensors.
                        host = true;
                        let i = rng.below(cu_q.len() as u64) as usize;
                        let v = rng.pick(&[-1, i32::MIN, i32::MAX, 1 << 25]);
                        if rng.chance(2) {
                            cu_q[i] = v
                        } else {
                            cu_k[i] = v
                        }
                    }
                    _ => {
                        let i = rng.below(4) as usize;
                        mutate_tensor(&mut rng, &mut t[i]);
                    }
                }
            }
            // The host arrays must hold batch + 1 entries whenever they are passed.
            let fits = host && varlen.batch >= 0 && (varlen.batch as usize) < cu_q.len();
            let (hq_ptr, hk_ptr) = if fits {
                (cu_q.as_ptr(), cu_k.as_ptr())
            } else {
                (ptr::null(), ptr::null())
            };
            let causal = rng.below(2) as i32;
            let window = window(&mut rng, causal != 0);
            // SAFETY: the structs are live; the host arrays hold batch + 1 entries when
            // passed.
            let rc = unsafe {
                match (softcap, window) {
                    (Some(cap), _) => flashcore_check_forward_varlen_ex(
                        &t[0],
                        &t[1],
                        &t[2],
                        &t[3],
                        lse,
                        &varlen,
                        hq_ptr,
                        hk_ptr,
                        &options(0.0, causal, window, cap, size),
                    ),
                    (None, None) => flashcore_check_forward_varlen(
                        &t[0], &t[1], &t[2], &t[3], lse, &varlen, hq_ptr, hk_ptr, 0.0, causal,
                    ),
                    (None, Some((left, right))) => flashcore_check_forward_varlen_window(
                        &t[0], &t[1], &t[2], &t[3], lse, &varlen, hq_ptr, hk_ptr, 0.0, causal,
                        left, right,
                    ),
                }
            };
            let args = (t, varlen, lse, fits, &cu_q, &cu_k, window, softcap, size);
            judge("flashcore_check_forward_varlen", n == 0, rc, &args);
            judge_size("flashcore_check_forward_varlen", size, rc, &args);
        }
    }
}

/// A cache, the host copies of its lengths and block table, and its scales.
struct CacheCase {
    cache: FlashcoreKvCache,
    /// An e4m3 cache's scales: float32 `[outer, rows, Hkv, 1]`, the cache's own first
    /// three dimensions (unused with a 16-bit cache).
    scales: FlashcoreKvScales,
    seqlens: Vec<i32>,
    table: Vec<i32>,
}

/// A valid cache for `batch` sequences with room for `room` more tokens each: contiguous,
/// or paged (16 to 256 tokens a page, every sequence on pages of its own, shuffled), of
/// e4m3 codes with their scales when `fp8`, else of the 16-bit `dtype`.
fn cache_case(
    rng: &mut Rng,
    [batch, hkv, d]: [i64; 3],
    (dtype, fp8): (i32, bool),
    room: i64,
) -> CacheCase {
    let capacity = rng.pick(&[64i64, 1000, 4096]);
    let seqlens: Vec<i32> = (0..batch)
        .map(|_| rng.below((capacity - room + 1) as u64) as i32)
        .collect();
    // (outer, rows) of the tensors, the block table's address, pages per sequence.
    let (outer, rows, block_table, max_pages, table) = if rng.chance(2) {
        (batch, capacity, 0, 0, Vec::new())
    } else {
        let page = rng.pick(&[16i64, 64, 256]);
        let max_pages = (capacity + page - 1) / page;
        let pages = batch * max_pages;
        let mut table: Vec<i32> = (0..pages as i32).collect();
        for i in (1..table.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            table.swap(i, j);
        }
        (pages, page, region(13), max_pages, table)
    };
    let codes = if fp8 { FLASHCORE_E4M3 } else { dtype };
    let cache = FlashcoreKvCache {
        k: bshd(region(10), codes, [outer, rows, hkv, d]),
        v: bshd(region(11), codes, [outer, rows, hkv, d]),
        seqlens: region(12),
        block_table,
        max_pages,
        table_stride: max_pages,
    };
    let scales = FlashcoreKvScales {
        k_scale: bshd(region(20), FLASHCORE_F32, [outer, rows, hkv, 1]),
        v_scale: bshd(region(21), FLASHCORE_F32, [outer, rows, hkv, 1]),
    };
    CacheCase {
        cache,
        scales,
        seqlens,
        table,
    }
}

/// A head dim a cache may have: one of the FP8 kernels' for e4m3 codes.
fn cache_head_dim(rng: &mut Rng, fp8: bool) -> i64 {
    if fp8 {
        rng.pick(&[64, 128, 256])
    } else {
        head_dim(rng)
    }
}

/// Changes one field of an e4m3 cache's scales.
fn mutate_scales(rng: &mut Rng, scales: &mut FlashcoreKvScales) {
    let t = if rng.chance(2) {
        &mut scales.k_scale
    } else {
        &mut scales.v_scale
    };
    mutate_tensor(rng, t);
}

fn mutate_cache(rng: &mut Rng, c: &mut CacheCase) {
    match rng.below(7) {
        0 => c.cache.seqlens = rng.pick(&[0, 2, region(10)]),
        1 => c.cache.block_table = rng.pick(&[0, 2, region(11) + 32, region(13)]),
        2 => c.cache.max_pages = rng.pick(&EDGE_I64),
        3 => c.cache.table_stride = rng.pick(&EDGE_I64),
        4 if !c.seqlens.is_empty() => {
            let i = rng.below(c.seqlens.len() as u64) as usize;
            c.seqlens[i] = rng.pick(&[-1, i32::MIN, i32::MAX, 5000, 1 << 20]);
        }
        5 if !c.table.is_empty() => {
            let i = rng.below(c.table.len() as u64) as usize;
            let j = rng.below(c.table.len() as u64) as usize;
            c.table[i] = rng.pick(&[-1, i32::MIN, i32::MAX, c.table[j]]);
        }
        _ => {
            let t = if rng.chance(2) {
                &mut c.cache.k
            } else {
                &mut c.cache.v
            };
            mutate_tensor(rng, t);
        }
    }
}

/// The host copies to pass with `c`: both, lengths only (contiguous), or none; null
/// wherever the arrays could not hold what the cache's own fields say they hold.
fn host_arrays(rng: &mut Rng, c: &CacheCase, batch: i64) -> (*const i32, *const i32) {
    let k = &c.cache;
    let paged = k.block_table != 0 || k.max_pages != 0 || k.table_stride != 0;
    let lengths_fit = batch >= 0 && batch as usize <= c.seqlens.len();
    let table_fits = !paged
        || (batch >= 1
            && k.max_pages >= 0
            && k.table_stride >= 0
            && (batch - 1)
                .checked_mul(k.table_stride)
                .and_then(|x| x.checked_add(k.max_pages))
                .is_some_and(|n| n as usize <= c.table.len()));
    if !lengths_fit || !table_fits || rng.chance(3) {
        return (ptr::null(), ptr::null());
    }
    let table = if paged && !c.table.is_empty() {
        c.table.as_ptr()
    } else {
        ptr::null()
    };
    (c.seqlens.as_ptr(), table)
}

/// What a decode call against a cache starts from: an e4m3 cache one time in three,
/// 1 to 8 sequences, 1 or 8 KV heads each serving 1 or 4 query heads, a head dim of the
/// cache's kind, a 16-bit dtype, and a valid cache (no room needed beyond the lengths).
struct DecodeDraw {
    fp8: bool,
    batch: i64,
    hq: i64,
    d: i64,
    dt: i32,
    c: CacheCase,
}

impl DecodeDraw {
    fn new(rng: &mut Rng) -> DecodeDraw {
        let fp8 = rng.chance(3);
        let batch = rng.pick(&[1i64, 3, 8]);
        let hkv = rng.pick(&[1i64, 8]);
        let hq = hkv * rng.pick(&[1, 4]);
        let d = cache_head_dim(rng, fp8);
        let dt = dtype16(rng);
        let c = cache_case(rng, [batch, hkv, d], (dt, fp8), 0);
        DecodeDraw {
            fp8,
            batch,
            hq,
            d,
            dt,
            c,
        }
    }
}

#[test]
fn decode_checks_answer_every_argument_with_a_code() {
    for seed in SEEDS {
        let mut rng = Rng(seed ^ 2);
        for _ in 0..ROUNDS {
            let sq = rng.pick(&[1i64, 5, 16]);
            let DecodeDraw {
                fp8,
                batch,
                hq,
                d,
                dt,
                mut c,
            } = DecodeDraw::new(&mut rng);
            let mut q = bshd(region(0), dt, [batch, sq, hq, d]);
            let mut o = bshd(region(3), dt, [batch, sq, hq, d]);
            let mut lse = if rng.chance(2) { region(4) } else { 0 };
            let mut scale = 0.0f32;
            let mut softcap = softcap(&mut rng);
            let mut size = FlashcoreAttentionOptions::SIZE;
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(11) {
                    6 => softcap = Some(rng.pick(&EDGE_SOFTCAPS)),
                    7 => {
                        size = other_struct_size(&mut rng);
                        softcap.get_or_insert(0.0);
                    }
                    0 => mutate_tensor(&mut rng, &mut q),
                    1 => mutate_tensor(&mut rng, &mut o),
                    2 => lse = rng.pick(&[2, region(0), region(12)]),
                    3 => scale = rng.pick(&SCALES),
                    4 if fp8 => mutate_scales(&mut rng, &mut c.scales),
                    5 => {
                        let mut views = [q, o, c.cache.k, c.cache.v];
                        set_head_dim(&mut views, rng.pick(&BAD_HEAD_DIMS));
                        [q, o, c.cache.k, c.cache.v] = views;
                    }
                    _ => mutate_cache(&mut rng, &mut c),
                }
            }
            let (hs, ht) = host_arrays(&mut rng, &c, q.shape[0]);
            let causal = rng.below(2) as i32;
            let window = window(&mut rng, causal != 0);
            // SAFETY: the structs are live; the host arrays hold what the cache's fields
            // say (host_arrays passes null otherwise).
            let rc = unsafe {
                match (fp8, window) {
                    (true, _) if softcap.is_some() => flashcore_check_decode_fp8kv_ex(
                        &q,
                        &c.cache,
                        &c.scales,
                        hs,
                        ht,
                        &o,
                        lse,
                        &options(scale, causal, window, softcap.unwrap_or_default(), size),
                    ),
                    (false, _) if softcap.is_some() => flashcore_check_decode_ex(
                        &q,
                        &c.cache,
                        hs,
                        ht,
                        &o,
                        lse,
                        &options(scale, causal, window, softcap.unwrap_or_default(), size),
                    ),
                    (true, None) => flashcore_check_decode_fp8kv(
                        &q, &c.cache, &c.scales, hs, ht, &o, lse, scale, causal,
                    ),
                    (true, Some((left, right))) => flashcore_check_decode_fp8kv_window(
                        &q, &c.cache, &c.scales, hs, ht, &o, lse, scale, causal, left, right,
                    ),
                    (false, None) => {
                        flashcore_check_decode(&q, &c.cache, hs, ht, &o, lse, scale, causal)
                    }
                    (false, Some((left, right))) => flashcore_check_decode_window(
                        &q, &c.cache, hs, ht, &o, lse, scale, causal, left, right,
                    ),
                }
            };
            let args = (
                q, c.cache, c.scales, o, lse, scale, fp8, window, softcap, size,
            );
            judge("flashcore_check_decode", n == 0, rc, &args);
            judge_size("flashcore_check_decode", size, rc, &args);
        }
    }
}

/// The packed serving call: each sequence's queries (0 to 40 of them: decode steps, drafts
/// and prompt chunks) one after another in q and o, against a cache of `batch`
/// sequences. Beside the decode call's fields, the offsets' device address, the batch and
/// the bound are drawn from the edges, and host offsets that decrease, start below 0, run
/// past q or exceed the bound.
#[test]
fn decode_varlen_checks_answer_every_argument_with_a_code() {
    for seed in SEEDS {
        let mut rng = Rng(seed ^ 6);
        for _ in 0..ROUNDS {
            let DecodeDraw {
                fp8,
                batch,
                hq,
                d,
                dt,
                mut c,
            } = DecodeDraw::new(&mut rng);
            let mut cu = vec![0i32];
            for _ in 0..batch {
                let n = rng.pick(&[0, 1, 4, 16, 40]);
                cu.push(cu.last().unwrap() + n);
            }
            let longest = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap();
            let total = i64::from(*cu.last().unwrap()).max(1);
            let mut q = bshd(region(0), dt, [1, total, hq, d]);
            let mut o = bshd(region(3), dt, [1, total, hq, d]);
            let mut lse = if rng.chance(2) { region(4) } else { 0 };
            let mut cu_ptr = region(5);
            let mut count = batch;
            let mut bound = i64::from(longest.max(1)) + rng.pick(&[0, 1, 100]);
            let mut host_cu = rng.chance(2);
            let mut scale = 0.0f32;
            let mut cap = softcap(&mut rng).unwrap_or_default();
            let mut size = FlashcoreAttentionOptions::SIZE;
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(14) {
                    0 => mutate_tensor(&mut rng, &mut q),
                    1 => mutate_tensor(&mut rng, &mut o),
                    2 => lse = rng.pick(&[2, region(0), region(5), region(12)]),
                    3 => scale = rng.pick(&SCALES),
                    4 if fp8 => mutate_scales(&mut rng, &mut c.scales),
                    5 => cap = rng.pick(&EDGE_SOFTCAPS),
                    6 => size = other_struct_size(&mut rng),
                    7 => count = rng.pick(&EDGE_I64),
                    8 => bound = rng.pick(&EDGE_I64),
                    9 => cu_ptr = rng.pick(&[0, 2, region(3), region(4), region(12), u64::MAX - 3]),
                    10 => {
                        // Host offsets that decrease, start below 0 or run past q.
                        host_cu = true;
                        let i = rng.below(cu.len() as u64) as usize;
                        cu[i] =
                            rng.pick(&[-1, i32::MIN, i32::MAX, cu[i].saturating_add(1), 1 << 25]);
                    }
                    11 => {
                        let mut views = [q, o, c.cache.k, c.cache.v];
                        set_head_dim(&mut views, rng.pick(&BAD_HEAD_DIMS));
                        [q, o, c.cache.k, c.cache.v] = views;
                    }
                    _ => mutate_cache(&mut rng, &mut c),
                }
            }
            // The host offsets must hold batch + 1 entries whenever they are passed.
            let cu_fits = host_cu && count >= 0 && (count as usize) < cu.len();
            let hcu = if cu_fits { cu.as_ptr() } else { ptr::null() };
            let (hs, ht) = host_arrays(&mut rng, &c, count);
            let causal = rng.below(2) as i32;
            let window = window(&mut rng, causal != 0);
            let scales: *const FlashcoreKvScales = if fp8 { &c.scales } else { ptr::null() };
            let opts = options(scale, causal, window, cap, size);
            // SAFETY: the structs are live; the host arrays hold what the call's own
            // fields say they hold (null otherwise).
            let rc = unsafe {
                flashcore_check_decode_varlen(
                    &q, &c.cache, scales, cu_ptr, count, bound, hcu, hs, ht, &o, lse, &opts,
                )
            };
            let args = (
                q, o, c.cache, c.scales, fp8, lse, cu_ptr, count, bound, &cu, cu_fits, opts,
            );
            judge("flashcore_check_decode_varlen", n == 0, rc, &args);
            judge_size("flashcore_check_decode_varlen", size, rc, &args);
        }
    }
}

#[test]
fn append_checks_answer_every_argument_with_a_code() {
    for seed in SEEDS {
        let mut rng = Rng(seed ^ 3);
        for _ in 0..ROUNDS {
            let fp8 = rng.chance(3);
            let batch = rng.pick(&[1i64, 3, 8]);
            let (hkv, new) = (rng.pick(&[1i64, 8]), rng.pick(&[1i64, 7, 64]));
            let d = cache_head_dim(&mut rng, fp8);
            let dt = dtype16(&mut rng);
            let mut c = cache_case(&mut rng, [batch, hkv, d], (dt, fp8), new);
            let mut k_new = bshd(region(1), dt, [batch, new, hkv, d]);
            let mut v_new = bshd(region(2), dt, [batch, new, hkv, d]);
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(6) {
                    0 => mutate_tensor(&mut rng, &mut k_new),
                    1 => mutate_tensor(&mut rng, &mut v_new),
                    2 if fp8 => mutate_scales(&mut rng, &mut c.scales),
                    _ => mutate_cache(&mut rng, &mut c),
                }
            }
            let (hs, ht) = host_arrays(&mut rng, &c, k_new.shape[0]);
            // SAFETY: as in the decode test.
            let rc = unsafe {
                if fp8 {
                    flashcore_check_append_kv_fp8kv(&c.cache, &c.scales, &k_new, &v_new, hs, ht)
                } else {
                    flashcore_check_append_kv(&c.cache, &k_new, &v_new, hs, ht)
                }
            };
            judge(
                "flashcore_check_append_kv",
                n == 0,
                rc,
                &(c.cache, c.scales, k_new, v_new, fp8, &c.seqlens),
            );
        }
    }
}

#[test]
fn merge_checks_answer_every_argument_with_a_code() {
    for seed in SEEDS {
        let mut rng = Rng(seed ^ 4);
        for _ in 0..ROUNDS {
            let (b, s, h, d) = (
                rng.pick(&[1i64, 4]),
                rng.pick(&[1i64, 16, 1000]),
                rng.pick(&[1i64, 32]),
                head_dim(&mut rng),
            );
            let dt = rng.pick(&[FLASHCORE_F16, FLASHCORE_BF16, FLASHCORE_F32]);
            let mut parts = bshd(region(0), dt, [b, s, h, d]);
            let mut count = rng.pick(&[1i64, 2, 16]);
            let mut shard_stride = b * s * h * d;
            let mut lse_parts = region(1);
            let mut out = bshd(
                region(2),
                rng.pick(&[FLASHCORE_F16, FLASHCORE_BF16, FLASHCORE_F32]),
                [b, s, h, d],
            );
            let mut out_lse = if rng.chance(2) { region(3) } else { 0 };
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(8) {
                    0 => count = rng.pick(&EDGE_I64),
                    1 => shard_stride = rng.pick(&EDGE_I64),
                    2 => lse_parts = rng.pick(&[0, 2, region(0), region(2)]),
                    3 => out_lse = rng.pick(&[2, region(1), region(2)]),
                    4 | 5 => mutate_tensor(&mut rng, &mut parts),
                    _ => mutate_tensor(&mut rng, &mut out),
                }
            }
            // SAFETY: the structs are live.
            let rc = unsafe {
                flashcore_check_merge(&parts, count, shard_stride, lse_parts, &out, out_lse)
            };
            judge(
                "flashcore_check_merge",
                n == 0,
                rc,
                &(parts, count, shard_stride, lse_parts, out, out_lse),
            );
        }
    }
}

#[test]
fn fp8_checks_answer_every_argument_with_a_code() {
    for seed in SEEDS {
        let mut rng = Rng(seed ^ 5);
        for _ in 0..ROUNDS {
            let (b, hkv) = (rng.pick(&[1i64, 2]), rng.pick(&[1i64, 8]));
            let hq = hkv * rng.pick(&[1, 4]);
            let (sq, sk, d) = (
                rng.pick(&[1i64, 130, 1024]),
                rng.pick(&[1i64, 130, 1024]),
                rng.pick(&[64i64, 128, 256]),
            );
            let dt = dtype16(&mut rng);

            // The quantizer's inputs.
            let mut t = [
                bshd(region(0), dt, [b, sq, hq, d]),
                bshd(region(1), dt, [b, sk, hkv, d]),
                bshd(region(2), dt, [b, sk, hkv, d]),
            ];
            let mut options = FlashcoreQuantizeOptions {
                smooth_k: rng.below(2) as i32,
                hadamard: rng.below(2) as i32,
                hadamard_seed: rng.next(),
            };
            let mut workspace = region(3);
            let mut bytes = 1usize << 33;
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(6) {
                    0 => workspace = rng.pick(&[0, 16, region(0), region(2) + 256]),
                    1 => bytes = rng.pick(&[0, 1, 255, usize::MAX]),
                    2 => options.smooth_k = rng.pick(&[-1, 2, i32::MIN]),
                    _ => {
                        let i = rng.below(3) as usize;
                        mutate_tensor(&mut rng, &mut t[i]);
                    }
                }
            }
            // SAFETY: the structs are live.
            let rc = unsafe {
                flashcore_check_quantize_fp8(&t[0], &t[1], &t[2], &options, workspace, bytes)
            };
            judge(
                "flashcore_check_quantize_fp8",
                n == 0,
                rc,
                &(t, options, workspace, bytes),
            );

            // The forward's operands, as the quantizer lays them out (V^T pitch: Sk
            // rounded up to 16).
            let pitch = (sk + 15) / 16 * 16;
            let mut ops = FlashcoreFp8Operands {
                q: bshd(region(4), FLASHCORE_E4M3, [b, sq, hq, d]),
                k: bshd(region(5), FLASHCORE_E4M3, [b, sk, hkv, d]),
                vt: region(6),
                vt_shape: [b, hkv, d, sk],
                vt_strides: [hkv * d * pitch, d * pitch, pitch],
                q_scale: region(7),
                k_scale: region(8),
                v_scale: region(9),
                lse_shift: 0,
            };
            let mut o = bshd(region(10), dt, [b, sq, hq, d]);
            let mut lse = if rng.chance(2) { region(11) } else { 0 };
            let mut scale = 0.0f32;
            let n = mutations(&mut rng);
            for _ in 0..n {
                match rng.below(10) {
                    0 => ops.vt = rng.pick(&EDGE_PTR),
                    1 => ops.vt_shape[rng.below(4) as usize] = rng.pick(&EDGE_I64),
                    2 => ops.vt_strides[rng.below(3) as usize] = rng.pick(&EDGE_I64),
                    3 => ops.q_scale = rng.pick(&[0, 2, region(4)]),
                    4 => ops.lse_shift = rng.pick(&[2, region(11), region(12)]),
                    5 => scale = rng.pick(&SCALES),
                    6 => lse = rng.pick(&[2, region(10)]),
                    7 => mutate_tensor(&mut rng, &mut o),
                    8 => mutate_tensor(&mut rng, &mut ops.q),
                    _ => mutate_tensor(&mut rng, &mut ops.k),
                }
            }
            let causal = rng.below(2) as i32;
            // SAFETY: the structs are live.
            let rc = unsafe { flashcore_check_forward_fp8(&ops, &o, lse, scale, causal) };
            judge(
                "flashcore_check_forward_fp8",
                n == 0,
                rc,
                &(ops, o, lse, scale, causal),
            );
        }
    }
}

/// Options of any `struct_size` but this library's are `FLASHCORE_ERROR_INVALID_ARGUMENT`
/// from every `_ex` check of an otherwise valid call, saying why; the library reads their
/// `struct_size` only, so sizes below 32 come as a lone 4-byte field here (nothing past it
/// is there to read).
#[test]
fn ex_checks_refuse_options_of_every_other_size() {
    /// A `struct_size` and nothing after it: all a refused size lets the library read.
    #[repr(C, align(8))]
    struct SizeOnly(u32);

    let mut rng = Rng(SEEDS[0] ^ 7);
    let t = |i, s| bshd(region(i), FLASHCORE_F16, [1, s, 2, 64]);
    let (q, k, v, o) = (t(0, 48), t(1, 80), t(2, 80), t(3, 48));
    let (cu_q, cu_k) = ([0i32, 16, 48], [0i32, 30, 80]);
    let varlen = FlashcoreVarlen {
        cu_seqlens_q: region(5),
        cu_seqlens_k: region(6),
        batch: 2,
        max_seqlen_q: 32,
    };
    let (dq, dout) = (
        bshd(region(0), FLASHCORE_BF16, [2, 1, 8, 128]),
        bshd(region(3), FLASHCORE_BF16, [2, 1, 8, 128]),
    );
    let c16 = cache_case(&mut rng, [2, 2, 128], (FLASHCORE_BF16, false), 0);
    let c8 = cache_case(&mut rng, [2, 2, 128], (FLASHCORE_BF16, true), 0);
    // Each check's name, code and message (read right after it: the next call may
    // overwrite it).
    let checks = |opts: *const FlashcoreAttentionOptions| {
        let answer = |name: &'static str, rc: i32| (name, rc, last_error());
        // SAFETY: every struct pointer points at a live local; the host offsets hold
        // batch + 1 entries; no cache host arrays; `opts` points at live options, or at a
        // lone struct_size of a size the library refuses (all it may then read).
        unsafe {
            [
                answer(
                    "flashcore_check_forward_ex",
                    flashcore_check_forward_ex(&q, &k, &v, &o, region(4), opts),
                ),
                answer(
                    "flashcore_check_forward_varlen_ex",
                    flashcore_check_forward_varlen_ex(
                        &q,
                        &k,
                        &v,
                        &o,
                        0,
                        &varlen,
                        cu_q.as_ptr(),
                        cu_k.as_ptr(),
                        opts,
                    ),
                ),
                answer(
                    "flashcore_check_decode_ex",
                    flashcore_check_decode_ex(
                        &dq,
                        &c16.cache,
                        ptr::null(),
                        ptr::null(),
                        &dout,
                        0,
                        opts,
                    ),
                ),
                answer(
                    "flashcore_check_decode_fp8kv_ex",
                    flashcore_check_decode_fp8kv_ex(
                        &dq,
                        &c8.cache,
                        &c8.scales,
                        ptr::null(),
                        ptr::null(),
                        &dout,
                        0,
                        opts,
                    ),
                ),
            ]
        }
    };
    // This library's size: every call is valid, capped or not.
    for cap in [0.0, 50.0] {
        let opts = options(0.0, 1, Some((15, 0)), cap, FlashcoreAttentionOptions::SIZE);
        for (name, rc, message) in checks(&opts) {
            assert_eq!(rc, FLASHCORE_SUCCESS, "{name}: {message}");
        }
    }
    let sizes = EDGE_STRUCT_SIZES
        .into_iter()
        .chain((0..ROUNDS).map(|_| other_struct_size(&mut rng)));
    for size in sizes {
        let full = options(0.0, 1, Some((15, 0)), 50.0, size);
        let size_only = SizeOnly(size);
        let opts: *const FlashcoreAttentionOptions = if size < 32 {
            (&raw const size_only).cast()
        } else {
            &full
        };
        for (name, rc, message) in checks(opts) {
            assert_eq!(
                code_name(rc),
                "FLASHCORE_ERROR_INVALID_ARGUMENT",
                "{name} with struct_size {size}: {message}"
            );
            let why = if size > FlashcoreAttentionOptions::SIZE && size.is_multiple_of(8) {
                "options from a newer flashcore header than this library"
            } else {
                "FLASHCORE_ATTENTION_OPTIONS_INIT"
            };
            assert!(
                message.starts_with(&format!(
                    "{name}: invalid argument: opts.struct_size is {size}"
                )) && message.contains(why),
                "{message}"
            );
        }
    }
}

/// Null struct pointers are refused as such by every entry point, never dereferenced.
#[test]
fn null_structs_are_refused() {
    let t = bshd(region(0), FLASHCORE_F16, [1, 16, 1, 64]);
    let opts = options(0.0, 1, Some((15, 0)), 50.0, FlashcoreAttentionOptions::SIZE);
    let cache = FlashcoreKvCache {
        k: t,
        v: t,
        seqlens: region(1),
        block_table: 0,
        max_pages: 0,
        table_stride: 0,
    };
    // SAFETY: null is what is being tested; everything else is live.
    let codes = unsafe {
        [
            flashcore_check_forward(ptr::null(), &t, &t, &t, 0, 0.0, 0),
            flashcore_check_forward_varlen(
                &t,
                &t,
                &t,
                &t,
                0,
                ptr::null(),
                ptr::null(),
                ptr::null(),
                0.0,
                0,
            ),
            flashcore_check_decode(&t, ptr::null(), ptr::null(), ptr::null(), &t, 0, 0.0, 0),
            flashcore_check_forward_window(&t, &t, ptr::null(), &t, 0, 0.0, 1, 15, 0),
            flashcore_check_forward_varlen_window(
                &t,
                &t,
                &t,
                &t,
                0,
                ptr::null(),
                ptr::null(),
                ptr::null(),
                0.0,
                1,
                15,
                0,
            ),
            flashcore_check_decode_window(
                &t,
                ptr::null(),
                ptr::null(),
                ptr::null(),
                &t,
                0,
                0.0,
                1,
                15,
                0,
            ),
            flashcore_check_decode_fp8kv_window(
                ptr::null(),
                ptr::null(),
                ptr::null(),
                ptr::null(),
                ptr::null(),
                &t,
                0,
                0.0,
                1,
                15,
                0,
            ),
            flashcore_check_forward_ex(&t, &t, &t, &t, 0, ptr::null()),
            flashcore_check_forward_ex(&t, ptr::null(), &t, &t, 0, &opts),
            flashcore_check_forward_varlen_ex(
                &t,
                &t,
                &t,
                &t,
                0,
                ptr::null(),
                ptr::null(),
                ptr::null(),
                &opts,
            ),
            flashcore_check_decode_ex(&t, ptr::null(), ptr::null(), ptr::null(), &t, 0, &opts),
            flashcore_check_decode_fp8kv_ex(
                &t,
                &cache,
                ptr::null(),
                ptr::null(),
                ptr::null(),
                &t,
                0,
                ptr::null(),
            ),
            flashcore_check_append_kv(ptr::null(), &t, &t, ptr::null(), ptr::null()),
            flashcore_check_merge(ptr::null(), 1, 0, 0, &t, 0),
            flashcore_check_quantize_fp8(&t, ptr::null(), &t, ptr::null(), 0, 0),
            flashcore_check_forward_fp8(ptr::null(), &t, 0, 0.0, 0),
        ]
    };
    for rc in codes {
        assert_eq!(code_name(rc), "FLASHCORE_ERROR_NULL_ARGUMENT");
    }
}
