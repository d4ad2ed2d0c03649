//! The C ABI: an opaque context, the forward call, the serving calls (decode against a KV
//! cache, appending to one, merging partial results by their LSE; the `_fp8kv` spellings
//! of decode and append also take an FP8 cache's scales), FP8 attention (the GPU
//! quantizer and the FP8 forward), a validation-only twin of each call, and error
//! reporting by code and thread-local message. The 16-bit attention calls (forward,
//! varlen, decode) also come in `_window` spellings that take a key window,
//! FlashAttention's `window_size` (sliding-window attention), and in `_ex` spellings that
//! take their options as one struct, [`FlashcoreAttentionOptions`]: the scale, causal
//! masking, the key window and logit soft-capping (and the options added later, with no
//! new spelling of every call: the struct is size-versioned by its `struct_size`).
//! `include/flashcore.h` declares exactly what is here (the `c_header` test checks the two
//! against each other).
//!
//! Rules every entry point follows:
//!
//! - It returns `FLASHCORE_SUCCESS` (0) or an error code: [`Error::code`] for the crate's
//!   errors, [`FLASHCORE_ERROR_NULL_ARGUMENT`] for a null struct/handle pointer and
//!   [`FLASHCORE_ERROR_PANIC`] for an internal panic. No panic crosses the boundary: every
//!   body runs under [`std::panic::catch_unwind`].
//! - On failure it stores a message in a thread-local buffer that
//!   [`flashcore_last_error`] returns; a successful call leaves the buffer alone.
//! - Arguments are fully checked before anything is launched; on error nothing is written.
//! - It returns with the calling thread's current CUDA context as it found it (see
//!   [`ContextScope`](crate::host::device::ContextScope)).

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use cudarc::driver::sys::CUstream;

use crate::error::{Error, RETURN_CODES, return_code};
use crate::host::attention::Attention;
use crate::host::decode::{
    AppendProblem, DecodeProblem, MergeParts, Workspace, validate_append, validate_decode,
    validate_merge,
};
use crate::host::decode_varlen::{PackedQueries, validate_decode_varlen};
use crate::host::device::Device;
use crate::host::fp8::{Fp8Operands, VtView, validate_fp8};
use crate::host::kv_cache::{CacheLayout, HostMetadata, KvCache, KvScales};
use crate::host::quantize::{
    Fp8Layout, QuantizeOptions, validate_quantize, validate_quantize_inputs,
};
use crate::host::tensor::{AttentionParams, DIM_NAMES, DType, LseView, TensorView, Window};
use crate::host::validate::{MAX_GRID_YZ, validate_fwd};
use crate::host::varlen::{Varlen, VarlenHost, validate_varlen};

// ---- constants (mirrored by the #defines of include/flashcore.h) --------------------------
//
// The return codes (`FLASHCORE_SUCCESS`, `FLASHCORE_ERROR_*`) come from the one table in
// `crate::error` ([`RETURN_CODES`]); only the dtype codes are defined here.

/// `FlashcoreTensor::dtype` of IEEE half precision.
pub const FLASHCORE_F16: i32 = 1;
/// `FlashcoreTensor::dtype` of bfloat16.
pub const FLASHCORE_BF16: i32 = 2;
/// `FlashcoreTensor::dtype` of float32 (merge inputs and outputs, FP8 KV cache scales).
pub const FLASHCORE_F32: i32 = 3;
/// `FlashcoreTensor::dtype` of FP8 E4M3 codes (the `q` and `k` of FP8 operands, the `k`
/// and `v` of an FP8 KV cache).
pub const FLASHCORE_E4M3: i32 = 4;

pub use crate::error::codes::*;

/// The element types, by name: the constants above.
const DTYPES: [(&str, i32); 4] = [
    ("FLASHCORE_F16", FLASHCORE_F16),
    ("FLASHCORE_BF16", FLASHCORE_BF16),
    ("FLASHCORE_F32", FLASHCORE_F32),
    ("FLASHCORE_E4M3", FLASHCORE_E4M3),
];

const N_CONSTANTS: usize = DTYPES.len() + RETURN_CODES.len();

/// [`DTYPES`] followed by [`RETURN_CODES`], built at compile time.
const CONSTANTS: [(&str, i32); N_CONSTANTS] = {
    let mut out = [("", 0); N_CONSTANTS];
    let mut i = 0;
    while i < DTYPES.len() {
        out[i] = DTYPES[i];
        i += 1;
    }
    let mut j = 0;
    while j < RETURN_CODES.len() {
        out[i + j] = (RETURN_CODES[j].name, RETURN_CODES[j].code);
        j += 1;
    }
    out
};

/// Every `FLASHCORE_*` constant by name, for the header test and for bindings: the dtypes,
/// then the return codes of [`RETURN_CODES`].
pub const FLASHCORE_CONSTANTS: &[(&str, i32)] = &CONSTANTS;

// ---- types -------------------------------------------------------------------------------

/// A device tensor as C passes it: logical dimensions `[batch, seq, heads, head_dim]`,
/// strides in elements. 80 bytes: 4 bytes of padding follow `dtype`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlashcoreTensor {
    /// Device address (`CUdeviceptr`) of element `[0, 0, 0, 0]`.
    pub ptr: u64,
    /// `FLASHCORE_F16`, `FLASHCORE_BF16`, `FLASHCORE_F32` or `FLASHCORE_E4M3`.
    pub dtype: i32,
    /// `[batch, seq, heads, head_dim]`; negative values are an error.
    pub shape: [i64; 4],
    /// Strides in elements of the same dimensions; negative values are an error.
    pub strides: [i64; 4],
}

/// A KV cache as C passes it: the keys and values, each sequence's length on the device,
/// and (paged caches) the block table. 192 bytes, 8-byte aligned, no padding.
///
/// Contiguous: `block_table`, `max_pages` and `table_stride` all 0; `k`, `v` are
/// `[B, capacity, Hkv, D]`. Paged: anything else; `k`, `v` are pools `[pages, page_size,
/// Hkv, D]` and position `p` of sequence `b` is row `p % page_size` of page
/// `block_table[b · table_stride + p / page_size]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashcoreKvCache {
    /// The keys: `[B, capacity, Hkv, D]` or `[pages, page_size, Hkv, D]`.
    pub k: FlashcoreTensor,
    /// The values, of k's dtype and shape.
    pub v: FlashcoreTensor,
    /// Device address of int32 `[B]`: each sequence's length.
    pub seqlens: u64,
    /// Device address of int32 `[B, table_stride]` (paged), or 0 (contiguous).
    pub block_table: u64,
    /// Pages per sequence: the capacity is `max_pages · page_size` (paged), or 0.
    pub max_pages: i64,
    /// Elements from one block-table row to the next, at least `max_pages` (paged), or 0.
    pub table_stride: i64,
}

/// The dequantization scales of an FP8 (e4m3) KV cache as C passes them (see
/// `flashcore_decode_fp8kv`), the C spelling of [`KvScales`]: float32 views of shape
/// `[B, capacity, Hkv, 1]` (contiguous cache) or `[pages, page_size, Hkv, 1]` (paged),
/// one scale per (position, KV head) of the keys and of the values: a value is its code
/// times its scale. 160 bytes, 8-byte aligned, no padding between fields.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlashcoreKvScales {
    /// The keys' scales: float32 `[B, capacity, Hkv, 1]` or `[pages, page_size, Hkv, 1]`.
    pub k_scale: FlashcoreTensor,
    /// The values' scales, of k_scale's shape.
    pub v_scale: FlashcoreTensor,
}

/// A packed variable-length batch as C passes it (see `flashcore_forward_varlen`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashcoreVarlen {
    /// Device address of int32 `[batch + 1]`: sequence `b`'s query rows are
    /// `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]` of q and o.
    pub cu_seqlens_q: u64,
    /// Device address of int32 `[batch + 1]`: its key rows of k and v.
    pub cu_seqlens_k: u64,
    /// The number of sequences.
    pub batch: i64,
    /// At least the longest query sequence.
    pub max_seqlen_q: i64,
}

/// FP8 operands as C passes them (see `flashcore_forward_fp8`), the C spelling of
/// [`Fp8Operands`]: e4m3 codes of Q and K, e4m3 `Vᵀ`, per-block f32 scales and an
/// optional LSE shift. 256 bytes, 8-byte aligned, no padding between fields.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlashcoreFp8Operands {
    /// e4m3 `[B, Sq, Hq, D]`, dtype `FLASHCORE_E4M3`.
    pub q: FlashcoreTensor,
    /// e4m3 `[B, Sk, Hkv, D]`, dtype `FLASHCORE_E4M3`.
    pub k: FlashcoreTensor,
    /// Device address of e4m3 `Vt` `[B, Hkv, D, pitch]`: keys contiguous, permuted.
    pub vt: u64,
    /// `[batch, heads, head_dim, seqlen]` of `Vt`: `[B, Hkv, D, Sk]`.
    pub vt_shape: [i64; 4],
    /// Strides of `Vt`'s batch, head and row in elements (bytes); the row's is the pitch.
    pub vt_strides: [i64; 3],
    /// Device address of f32 `[B, Hq, ceil(Sq / 128)]`, contiguous.
    pub q_scale: u64,
    /// Device address of f32 `[B, Hkv, ceil(Sk / 128)]`, contiguous.
    pub k_scale: u64,
    /// Device address of f32 `[B, Hkv, ceil(Sk / 128)]`, contiguous.
    pub v_scale: u64,
    /// Device address of f32 `[B, Hq, Sq]` added to each row's LSE (times the softmax
    /// scale), or 0 for none.
    pub lse_shift: u64,
}

/// The FP8 quantizer's options as C passes them (see `flashcore_quantize_fp8`). 16 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlashcoreQuantizeOptions {
    /// Non-zero: subtract K's per-channel mean before quantizing K.
    pub smooth_k: i32,
    /// Non-zero: rotate Q and K by a random-sign Hadamard transform along the head dim.
    pub hadamard: i32,
    /// The seed the Hadamard transform's signs are drawn from (when `hadamard`).
    pub hadamard_seed: u64,
}

/// The options of an attention call as C passes them to the `_ex` entry points
/// (`flashcore_forward_ex`, ...), the C spelling of [`AttentionParams`]: one struct, so
/// that an option added later needs no new spelling of every call. 32 bytes, 8-byte
/// aligned, no padding: `struct_size` at 0, `softmax_scale` 4, `window_left` 8,
/// `window_right` 16, `causal` 24, `softcap` 28.
///
/// Size-versioned: `struct_size` (the first field, read before any other) is
/// `sizeof(FlashcoreAttentionOptions)` as the caller's header has it. An option added
/// later goes at the end and grows the struct by a multiple of 8 bytes; the library reads
/// only `struct_size` bytes, and an option past them keeps its default (what
/// [`new`](Self::new) and the header's `FLASHCORE_ATTENTION_OPTIONS_INIT` give it). A
/// `struct_size` below [`MIN_SIZE`](Self::MIN_SIZE) (this first version's) or not a
/// multiple of 8 is refused, as is one above [`SIZE`](Self::SIZE) (a newer header's
/// options, which this library would otherwise silently ignore): see `read_options`.
///
/// All zeros is not "no options" (its `struct_size` of 0 is refused, and window sides of
/// 0 would be a window of one key, the diagonal): start from [`new`](Self::new), as C
/// starts from `FLASHCORE_ATTENTION_OPTIONS_INIT`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashcoreAttentionOptions {
    /// `sizeof(FlashcoreAttentionOptions)` as the caller's header has it: [`Self::SIZE`].
    pub struct_size: u32,
    /// 0 (either sign): the default `1/sqrt(head_dim)`; otherwise finite and positive.
    pub softmax_scale: f32,
    /// The keys a row sees before its diagonal; negative: unbounded.
    pub window_left: i64,
    /// The keys a row sees after its diagonal; negative: unbounded.
    pub window_right: i64,
    /// Non-zero: causal masking, aligned bottom-right.
    pub causal: i32,
    /// 0 (either sign): no cap; otherwise each scaled score `x` becomes
    /// `softcap · tanh(x / softcap)`, the cap finite and positive.
    pub softcap: f32,
}

// `struct_size` comes first, so that it can be read alone, before the caller's struct is
// known to be as large as this one; the sizes accepted run in whole 8-byte steps from the
// first version's to this one's (no truncation in `SIZE`).
const _: () = {
    assert!(std::mem::offset_of!(FlashcoreAttentionOptions, struct_size) == 0);
    assert!(FlashcoreAttentionOptions::SIZE as usize == size_of::<FlashcoreAttentionOptions>());
    assert!(FlashcoreAttentionOptions::SIZE >= FlashcoreAttentionOptions::MIN_SIZE);
    assert!(FlashcoreAttentionOptions::SIZE.is_multiple_of(8));
    assert!(FlashcoreAttentionOptions::MIN_SIZE.is_multiple_of(8));
};

impl FlashcoreAttentionOptions {
    /// `sizeof(FlashcoreAttentionOptions)` in this library: the largest `struct_size` it
    /// accepts.
    pub const SIZE: u32 = size_of::<FlashcoreAttentionOptions>() as u32;

    /// The size of the struct's first version (32 bytes): the smallest `struct_size`
    /// accepted. It stays 32 when options are added.
    pub const MIN_SIZE: u32 = 32;

    /// No options, the plain calls' defaults, in this library's size: what the header's
    /// `FLASHCORE_ATTENTION_OPTIONS_INIT` gives C, `{sizeof(...), 0.0f, -1, -1, 0, 0.0f}`:
    /// the default scale, no window (both sides unbounded), no causal mask, no cap.
    pub const fn new() -> FlashcoreAttentionOptions {
        FlashcoreAttentionOptions {
            struct_size: Self::SIZE,
            softmax_scale: 0.0,
            window_left: -1,
            window_right: -1,
            causal: 0,
            softcap: 0.0,
        }
    }

    /// The options of a call's spellings without `_ex`: their scale, causal flag and key
    /// window (−1, −1: none), no soft cap.
    fn uncapped(
        softmax_scale: f32,
        causal: i32,
        window_left: i64,
        window_right: i64,
    ) -> FlashcoreAttentionOptions {
        FlashcoreAttentionOptions {
            softmax_scale,
            causal,
            window_left,
            window_right,
            ..FlashcoreAttentionOptions::new()
        }
    }
}

impl Default for FlashcoreAttentionOptions {
    /// [`FlashcoreAttentionOptions::new`]: no options (not all zeros).
    fn default() -> FlashcoreAttentionOptions {
        FlashcoreAttentionOptions::new()
    }
}

/// The opaque handle C holds: attention on one device.
pub struct FlashcoreContext {
    attn: Attention,
}

// The header promises that one context may be used from several threads at once.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<FlashcoreContext>()
};

// ---- errors ------------------------------------------------------------------------------

/// Why an entry point failed: its code and message.
#[derive(Debug)]
struct Failure {
    code: i32,
    message: String,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

fn null_argument(what: &str) -> Failure {
    Failure {
        code: FLASHCORE_ERROR_NULL_ARGUMENT,
        message: format!("{what} is a null pointer"),
    }
}

thread_local! {
    /// The message of the last failing call on this thread.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: String) {
    // A message with an interior NUL would be cut short by C; replace them instead.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // try_with: during thread teardown the slot may be gone; the code still says enough.
    let _ = LAST_ERROR.try_with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = c;
        }
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "(no message)"
    }
}

/// Runs `body` for the entry point `name`: success is 0; a failure or a panic stores its
/// message (prefixed with `name`) for [`flashcore_last_error`] and returns its code.
fn guard(name: &str, body: impl FnOnce() -> Result<(), Failure>) -> i32 {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => FLASHCORE_SUCCESS,
        Ok(Err(f)) => {
            set_last_error(format!("{name}: {}", f.message));
            f.code
        }
        Err(payload) => {
            set_last_error(format!(
                "{name}: internal panic: {}",
                panic_message(payload.as_ref())
            ));
            FLASHCORE_ERROR_PANIC
        }
    }
}

// ---- conversions -------------------------------------------------------------------------

fn dtype_from_code(code: i32, tensor: &str) -> Result<DType, Error> {
    match code {
        FLASHCORE_F16 => Ok(DType::F16),
        FLASHCORE_BF16 => Ok(DType::Bf16),
        FLASHCORE_F32 => Ok(DType::F32),
        FLASHCORE_E4M3 => Ok(DType::E4m3),
        _ => Err(Error::UnsupportedDType(format!(
            "{tensor} has dtype code {code}; expected FLASHCORE_F16 ({FLASHCORE_F16}), \
             FLASHCORE_BF16 ({FLASHCORE_BF16}), FLASHCORE_F32 ({FLASHCORE_F32}) or \
             FLASHCORE_E4M3 ({FLASHCORE_E4M3})"
        ))),
    }
}

/// The C code of an element type.
fn dtype_code(dtype: DType) -> i32 {
    match dtype {
        DType::F16 => FLASHCORE_F16,
        DType::Bf16 => FLASHCORE_BF16,
        DType::F32 => FLASHCORE_F32,
        DType::E4m3 => FLASHCORE_E4M3,
    }
}

/// A [`TensorView`] as C describes it (the inverse of [`tensor_view`]).
fn c_tensor(t: &TensorView) -> FlashcoreTensor {
    FlashcoreTensor {
        ptr: t.ptr,
        dtype: dtype_code(t.dtype),
        shape: t.shape.map(|n| n as i64),
        strides: t.strides.map(|s| s as i64),
    }
}

/// A C tensor as a [`TensorView`]: known dtype code, no negative extent or stride.
fn tensor_view(t: &FlashcoreTensor, tensor: &'static str) -> Result<TensorView, Error> {
    let dtype = dtype_from_code(t.dtype, tensor)?;
    let mut shape = [0usize; 4];
    let mut strides = [0usize; 4];
    for i in 0..4 {
        shape[i] = usize::try_from(t.shape[i]).map_err(|_| {
            Error::InvalidArgument(format!(
                "{tensor}.shape[{i}] ({}) is {}, which is not a valid extent",
                DIM_NAMES[i], t.shape[i]
            ))
        })?;
        strides[i] = usize::try_from(t.strides[i]).map_err(|_| Error::BadStrides {
            tensor,
            reason: format!(
                "strides[{i}] ({}) is {}; strides must be non-negative",
                DIM_NAMES[i], t.strides[i]
            ),
        })?;
    }
    Ok(TensorView::strided(t.ptr, dtype, shape, strides))
}

/// Reads the C tensor behind `t`.
///
/// # Safety
///
/// `t` must be null or point to a readable `FlashcoreTensor`.
unsafe fn read_tensor(
    t: *const FlashcoreTensor,
    tensor: &'static str,
) -> Result<TensorView, Failure> {
    // SAFETY: the caller guarantees `t` is null or valid for reads; `as_ref` handles null.
    let t = unsafe { t.as_ref() }.ok_or_else(|| null_argument(tensor))?;
    Ok(tensor_view(t, tensor)?)
}

/// The tensors of a forward call, read from C.
struct ForwardArgs {
    q: TensorView,
    k: TensorView,
    v: TensorView,
    o: TensorView,
    lse: Option<LseView>,
}

impl ForwardArgs {
    /// Reads the four C tensors; an LSE address of 0 means none.
    ///
    /// # Safety
    ///
    /// Each tensor pointer must be null or point to a readable `FlashcoreTensor`.
    unsafe fn read(
        q: *const FlashcoreTensor,
        k: *const FlashcoreTensor,
        v: *const FlashcoreTensor,
        o: *const FlashcoreTensor,
        lse: u64,
    ) -> Result<ForwardArgs, Failure> {
        // SAFETY: forwarded from the caller's guarantee.
        unsafe {
            Ok(ForwardArgs {
                q: read_tensor(q, "q")?,
                k: read_tensor(k, "k")?,
                v: read_tensor(v, "v")?,
                o: read_tensor(o, "o")?,
                lse: (lse != 0).then_some(LseView { ptr: lse }),
            })
        }
    }
}

/// The forward options: scale 0 (either sign) means the default `1/sqrt(head_dim)`, any
/// other value (NaN and infinities included, which validation rejects) is used as given;
/// the key window as the caller gave it (validation refuses one that contradicts causal
/// masking).
fn params(softmax_scale: f32, causal: i32, window: Window) -> AttentionParams {
    AttentionParams {
        softmax_scale: (softmax_scale != 0.0).then_some(softmax_scale),
        causal: causal != 0,
        window,
        ..Default::default()
    }
}

/// A C `(window_left, window_right)` pair as a [`Window`]: FlashAttention's convention,
/// any negative side unbounded.
fn c_window(window_left: i64, window_right: i64) -> Window {
    Window::from_flash(window_left, window_right)
}

/// The options of an `_ex` call as [`AttentionParams`]: the scale and causal flag as
/// [`params`] reads them, the window as [`c_window`] does, and a soft cap of 0 (either
/// sign) as none; any other cap (negative, NaN and infinities included, which validation
/// rejects) is used as given.
fn c_options(o: &FlashcoreAttentionOptions) -> AttentionParams {
    AttentionParams {
        softcap: (o.softcap != 0.0).then_some(o.softcap),
        ..params(
            o.softmax_scale,
            o.causal,
            c_window(o.window_left, o.window_right),
        )
    }
}

/// Why a caller's `struct_size` is refused, or `None` for one this library reads: from
/// [`MIN_SIZE`](FlashcoreAttentionOptions::MIN_SIZE) to
/// [`SIZE`](FlashcoreAttentionOptions::SIZE), a multiple of 8.
fn options_size_error(struct_size: u32) -> Option<Error> {
    let (first, known) = (
        FlashcoreAttentionOptions::MIN_SIZE,
        FlashcoreAttentionOptions::SIZE,
    );
    if struct_size < first || !struct_size.is_multiple_of(8) {
        Some(Error::InvalidArgument(format!(
            "opts.struct_size is {struct_size}, which is no size of FlashcoreAttentionOptions \
             ({first} bytes or more, a multiple of 8): initialize the options with \
             FLASHCORE_ATTENTION_OPTIONS_INIT"
        )))
    } else if struct_size > known {
        Some(Error::InvalidArgument(format!(
            "opts.struct_size is {struct_size}: options from a newer flashcore header than \
             this library, which knows FlashcoreAttentionOptions of up to {known} bytes and \
             would ignore the options it does not know (use the header of this library)"
        )))
    } else {
        None
    }
}

/// Reads the C options behind `opts` ([`c_options`]), as many bytes as their
/// `struct_size` says: `struct_size` first (4 bytes, the first field), and only when
/// [`options_size_error`] accepts it the rest of those bytes; options past them (a
/// smaller, older struct's) keep [`FlashcoreAttentionOptions::new`]'s defaults. A size
/// refused is `FLASHCORE_ERROR_INVALID_ARGUMENT`, null `opts`
/// `FLASHCORE_ERROR_NULL_ARGUMENT`.
///
/// # Safety
///
/// `opts` must be null or point to a readable, 8-byte aligned `FlashcoreAttentionOptions`
/// of `struct_size` bytes: 4 readable bytes at least (the `struct_size`), and all of
/// `struct_size` when it is a size accepted.
unsafe fn read_options(opts: *const FlashcoreAttentionOptions) -> Result<AttentionParams, Failure> {
    if opts.is_null() {
        return Err(null_argument("opts"));
    }
    // SAFETY: `opts` is not null and the caller guarantees its first 4 bytes, the
    // `struct_size` field (offset 0, asserted at compile time), are readable and aligned;
    // nothing past them is read here.
    let struct_size = unsafe { opts.cast::<u32>().read() };
    if let Some(e) = options_size_error(struct_size) {
        return Err(e.into());
    }
    let mut o = FlashcoreAttentionOptions::new();
    // SAFETY: the caller guarantees `struct_size` readable bytes at `opts`, and
    // `options_size_error` made that size at most `size_of::<FlashcoreAttentionOptions>()`,
    // so the copy stays inside `o` too; a multiple of 8 from 32 up, it covers whole fields
    // (the struct has no padding), each a plain number for which any bytes are a value.
    unsafe {
        std::ptr::copy_nonoverlapping(
            opts.cast::<u8>(),
            (&raw mut o).cast::<u8>(),
            struct_size as usize,
        );
    }
    Ok(c_options(&o))
}

/// A C cache (and, for an e4m3 one, its scales) as a [`KvCache`]: its tensors as
/// [`tensor_view`] reads them, no negative page count or table stride. `block_table`,
/// `max_pages` and `table_stride` all 0 is a contiguous cache; anything else a paged one,
/// whose rules validation then applies (a null block table, no pages, a short row
/// stride). No scales is a 16-bit cache; validation refuses an e4m3 cache without them
/// and scales with a 16-bit one.
fn kv_cache(c: &FlashcoreKvCache, scales: Option<&FlashcoreKvScales>) -> Result<KvCache, Error> {
    let k = tensor_view(&c.k, "k_cache")?;
    let v = tensor_view(&c.v, "v_cache")?;
    let max_pages = usize::try_from(c.max_pages).map_err(|_| {
        Error::InvalidArgument(format!(
            "cache.max_pages is {}, which is not a valid page count",
            c.max_pages
        ))
    })?;
    let table_stride = usize::try_from(c.table_stride).map_err(|_| Error::BadStrides {
        tensor: "block_table",
        reason: format!(
            "table_stride is {}; strides must be non-negative",
            c.table_stride
        ),
    })?;
    let layout = if (c.block_table, max_pages, table_stride) == (0, 0, 0) {
        CacheLayout::Contiguous
    } else {
        CacheLayout::Paged {
            block_table: c.block_table,
            max_pages,
            table_stride,
        }
    };
    Ok(KvCache {
        k,
        v,
        seqlens: c.seqlens,
        layout,
        scales: scales.map(kv_scales).transpose()?,
    })
}

/// C scales as [`KvScales`]: known dtype codes, no negative extent or stride. Validation
/// ([`KvCache::validate`]) does the rest.
fn kv_scales(s: &FlashcoreKvScales) -> Result<KvScales, Error> {
    Ok(KvScales {
        k: tensor_view(&s.k_scale, "k_scale")?,
        v: tensor_view(&s.v_scale, "v_scale")?,
    })
}

/// The dimensions of `Vt` (`FlashcoreFp8Operands::vt_shape`), by name.
const VT_DIM_NAMES: [&str; 4] = ["batch", "heads", "head_dim", "seqlen"];

/// C FP8 operands as [`Fp8Operands`]: known dtype codes, no negative extent or stride; an
/// LSE shift address of 0 means none. Validation ([`validate_fp8`]) does the rest.
fn fp8_operands(c: &FlashcoreFp8Operands) -> Result<Fp8Operands, Error> {
    let q = tensor_view(&c.q, "q")?;
    let k = tensor_view(&c.k, "k")?;
    let mut dims = [0usize; 4];
    for (i, d) in dims.iter_mut().enumerate() {
        *d = usize::try_from(c.vt_shape[i]).map_err(|_| {
            Error::InvalidArgument(format!(
                "vt_shape[{i}] ({}) is {}, which is not a valid extent",
                VT_DIM_NAMES[i], c.vt_shape[i]
            ))
        })?;
    }
    let mut strides = [0usize; 3];
    for (i, st) in strides.iter_mut().enumerate() {
        *st = usize::try_from(c.vt_strides[i]).map_err(|_| Error::BadStrides {
            tensor: "vt",
            reason: format!(
                "vt_strides[{i}] ({}) is {}; strides must be non-negative",
                ["batch", "heads", "row"][i],
                c.vt_strides[i]
            ),
        })?;
    }
    Ok(Fp8Operands {
        q,
        k,
        vt: VtView {
            ptr: c.vt,
            batch: dims[0],
            heads: dims[1],
            head_dim: dims[2],
            seqlen: dims[3],
            strides,
        },
        q_scale: c.q_scale,
        k_scale: c.k_scale,
        v_scale: c.v_scale,
        lse_shift: (c.lse_shift != 0).then_some(c.lse_shift),
    })
}

/// [`Fp8Operands`] as C describes them (the inverse of [`fp8_operands`]).
fn c_fp8_operands(ops: &Fp8Operands) -> FlashcoreFp8Operands {
    let vt = &ops.vt;
    FlashcoreFp8Operands {
        q: c_tensor(&ops.q),
        k: c_tensor(&ops.k),
        vt: vt.ptr,
        vt_shape: [vt.batch, vt.heads, vt.head_dim, vt.seqlen].map(|n| n as i64),
        vt_strides: vt.strides.map(|s| s as i64),
        q_scale: ops.q_scale,
        k_scale: ops.k_scale,
        v_scale: ops.v_scale,
        lse_shift: ops.lse_shift.unwrap_or(0),
    }
}

/// Reads the C FP8 operands behind `ops`.
///
/// # Safety
///
/// `ops` must be null or point to a readable `FlashcoreFp8Operands`.
unsafe fn read_fp8_operands(ops: *const FlashcoreFp8Operands) -> Result<Fp8Operands, Failure> {
    // SAFETY: the caller guarantees `ops` is null or valid for reads; `as_ref` handles null.
    let ops = unsafe { ops.as_ref() }.ok_or_else(|| null_argument("operands"))?;
    Ok(fp8_operands(ops)?)
}

/// The quantizer's options behind `options`; null means every option off.
///
/// # Safety
///
/// `options` must be null or point to a readable `FlashcoreQuantizeOptions`.
unsafe fn read_quantize_options(options: *const FlashcoreQuantizeOptions) -> QuantizeOptions {
    // SAFETY: the caller guarantees `options` is null or valid for reads.
    let o = unsafe { options.as_ref() }.copied().unwrap_or_default();
    QuantizeOptions {
        smooth_k: o.smooth_k != 0,
        hadamard_seed: (o.hadamard != 0).then_some(o.hadamard_seed),
    }
}

/// The three 16-bit inputs of a quantization, read from C.
///
/// # Safety
///
/// Each pointer must be null or point to a readable `FlashcoreTensor`.
unsafe fn read_qkv(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
) -> Result<[TensorView; 3], Failure> {
    // SAFETY: forwarded from the caller's guarantee.
    unsafe {
        Ok([
            read_tensor(q, "q")?,
            read_tensor(k, "k")?,
            read_tensor(v, "v")?,
        ])
    }
}

/// A caller's workspace buffer of `bytes` bytes at `ptr`, its start rounded up to
/// [`Fp8Layout::ALIGN`]: what of it is left (0 bytes when the rounding passes its end).
/// A null pointer, or one the rounding would overflow, stays as it is, for validation to
/// report.
fn aligned_workspace(ptr: u64, bytes: usize) -> Workspace {
    match ptr.checked_next_multiple_of(Fp8Layout::ALIGN as u64) {
        Some(start) if ptr != 0 => Workspace {
            ptr: start,
            bytes: bytes.saturating_sub((start - ptr) as usize),
        },
        _ => Workspace { ptr, bytes },
    }
}

/// Reads the C cache behind `c` and the scales behind `scales` (null: none, a 16-bit
/// cache).
///
/// # Safety
///
/// `c` must be null or point to a readable `FlashcoreKvCache`, `scales` null or point to
/// a readable `FlashcoreKvScales`.
unsafe fn read_cache(
    c: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
) -> Result<KvCache, Failure> {
    // SAFETY: the caller guarantees `c` is null or valid for reads; `as_ref` handles null.
    let c = unsafe { c.as_ref() }.ok_or_else(|| null_argument("cache"))?;
    // SAFETY: the caller guarantees `scales` is null or valid for reads; null is none.
    let scales = unsafe { scales.as_ref() };
    Ok(kv_cache(c, scales)?)
}

/// `len` int32s at the host address `ptr`, or an error when no host array can hold that
/// many or `ptr` is not aligned for them.
///
/// # Safety
///
/// `ptr` must be non-null and, when `len` fits a host array, valid for reads of `len`
/// int32s for `'a`.
unsafe fn host_array<'a>(
    ptr: *const i32,
    len: usize,
    name: &'static str,
) -> Result<&'a [i32], Error> {
    if len.checked_mul(4).is_none_or(|b| b > isize::MAX as usize) {
        return Err(Error::InvalidArgument(format!(
            "{name} would hold {len} entries, more than a host array can"
        )));
    }
    if !ptr.is_aligned() {
        return Err(Error::Misaligned {
            tensor: name,
            ptr: ptr as u64,
            align: 4,
        });
    }
    // SAFETY: `ptr` is non-null and aligned, `len` int32s fit the address space, and the
    // caller guarantees they are readable for `'a`.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// Host copies of a cache's device metadata as C passes them: null pointers for none.
#[derive(Debug, Clone, Copy)]
struct HostArrays {
    seqlens: *const i32,
    block_table: *const i32,
}

impl HostArrays {
    /// The arrays as [`HostMetadata`] for `cache`, already validated for a batch of
    /// `batch` (at least 1): `seqlens` holds `batch` entries, `block_table` `(batch − 1) ·
    /// table_stride + max_pages`. `None` when neither is given; an error for a block table
    /// without lengths or with a contiguous cache.
    ///
    /// # Safety
    ///
    /// Each pointer must be null or valid for reads of that many int32s for `'a`.
    unsafe fn metadata<'a>(
        self,
        cache: &KvCache,
        batch: usize,
    ) -> Result<Option<HostMetadata<'a>>, Error> {
        let table_len = match cache.layout {
            CacheLayout::Contiguous => None,
            CacheLayout::Paged {
                max_pages,
                table_stride,
                ..
            } => Some(
                batch
                    .saturating_sub(1)
                    .saturating_mul(table_stride)
                    .saturating_add(max_pages),
            ),
        };
        if self.seqlens.is_null() {
            if !self.block_table.is_null() {
                return Err(Error::InvalidArgument(
                    "host_block_table is given without host_seqlens".into(),
                ));
            }
            return Ok(None);
        }
        // SAFETY: non-null; the caller guarantees `batch` readable entries.
        let seqlens = unsafe { host_array(self.seqlens, batch, "host_seqlens")? };
        let block_table = match (self.block_table.is_null(), table_len) {
            (true, _) => None,
            (false, None) => {
                return Err(Error::InvalidArgument(
                    "host_block_table is given for a contiguous cache (block_table 0)".into(),
                ));
            }
            (false, Some(len)) => {
                // SAFETY: non-null; the caller guarantees `len` readable entries.
                let table = unsafe { host_array(self.block_table, len, "host_block_table")? };
                Some(table)
            }
        };
        Ok(Some(HostMetadata {
            seqlens,
            block_table,
        }))
    }
}

/// The arguments of a decode call, read from C and validated (all but the workspace,
/// whose size depends on the GPU).
struct DecodeCall<'a> {
    q: TensorView,
    cache: KvCache,
    host: Option<HostMetadata<'a>>,
    o: TensorView,
    lse: Option<LseView>,
    params: AttentionParams,
    problem: DecodeProblem,
}

impl DecodeCall<'_> {
    /// Reads the C arguments and applies the rules on them (an LSE address of 0 means
    /// none, null scales a 16-bit cache); the host metadata is converted, not yet checked
    /// against the cache.
    ///
    /// # Safety
    ///
    /// `q`, `o` null or readable `FlashcoreTensor`s, `cache` null or a readable
    /// `FlashcoreKvCache`, `scales` null or a readable `FlashcoreKvScales`, `opts` null or
    /// a readable `FlashcoreAttentionOptions` (as [`read_options`] reads it);
    /// `host_seqlens` null or `B` readable int32s, `host_block_table` null or
    /// `(B − 1) · table_stride + max_pages` readable int32s (`B` = q's batch), for as long
    /// as the result lives.
    #[allow(clippy::too_many_arguments)]
    unsafe fn read<'a>(
        q: *const FlashcoreTensor,
        cache: *const FlashcoreKvCache,
        scales: *const FlashcoreKvScales,
        host_seqlens: *const i32,
        host_block_table: *const i32,
        o: *const FlashcoreTensor,
        lse: u64,
        opts: *const FlashcoreAttentionOptions,
    ) -> Result<DecodeCall<'a>, Failure> {
        // SAFETY: forwarded from the caller's guarantee.
        let (q, cache, o) = unsafe {
            (
                read_tensor(q, "q")?,
                read_cache(cache, scales)?,
                read_tensor(o, "o")?,
            )
        };
        let lse = (lse != 0).then_some(LseView { ptr: lse });
        // SAFETY: the caller guarantees `opts` is null or readable.
        let params = unsafe { read_options(opts)? };
        let problem = validate_decode(&q, &cache, &o, lse.as_ref(), &params)?;
        let arrays = HostArrays {
            seqlens: host_seqlens,
            block_table: host_block_table,
        };
        // SAFETY: validation made q's batch the cache's; the caller guarantees the host
        // arrays' extents for that batch.
        let host = unsafe { arrays.metadata(&cache, problem.cache.batch)? };
        Ok(DecodeCall {
            q,
            cache,
            host,
            o,
            lse,
            params,
            problem,
        })
    }
}

/// The arguments of an append, read from C and validated.
struct AppendCall<'a> {
    cache: KvCache,
    k_new: TensorView,
    v_new: TensorView,
    host: Option<HostMetadata<'a>>,
    problem: AppendProblem,
}

impl AppendCall<'_> {
    /// Reads the C arguments and applies the rules on them; the host metadata is
    /// converted, not yet checked against the cache.
    ///
    /// # Safety
    ///
    /// As for [`DecodeCall::read`], with `B` the batch of `k_new`.
    unsafe fn read<'a>(
        cache: *const FlashcoreKvCache,
        scales: *const FlashcoreKvScales,
        k_new: *const FlashcoreTensor,
        v_new: *const FlashcoreTensor,
        host_seqlens: *const i32,
        host_block_table: *const i32,
    ) -> Result<AppendCall<'a>, Failure> {
        // SAFETY: forwarded from the caller's guarantee.
        let (cache, k_new, v_new) = unsafe {
            (
                read_cache(cache, scales)?,
                read_tensor(k_new, "k_new")?,
                read_tensor(v_new, "v_new")?,
            )
        };
        let problem = validate_append(&cache, &k_new, &v_new)?;
        let arrays = HostArrays {
            seqlens: host_seqlens,
            block_table: host_block_table,
        };
        // SAFETY: validation made k_new's batch the cache's; the caller guarantees the
        // host arrays' extents for that batch.
        let host = unsafe { arrays.metadata(&cache, problem.cache.batch)? };
        Ok(AppendCall {
            cache,
            k_new,
            v_new,
            host,
            problem,
        })
    }
}

/// The arguments of a merge, read from C (validation is the caller's).
struct MergeCall {
    parts: MergeParts,
    out: TensorView,
    out_lse: Option<LseView>,
}

impl MergeCall {
    /// Reads the C arguments: no negative count or shard stride; an output LSE address of
    /// 0 means none.
    ///
    /// # Safety
    ///
    /// `parts` and `out` must each be null or point to a readable `FlashcoreTensor`.
    unsafe fn read(
        parts: *const FlashcoreTensor,
        count: i64,
        shard_stride: i64,
        lse_parts: u64,
        out: *const FlashcoreTensor,
        out_lse: u64,
    ) -> Result<MergeCall, Failure> {
        // SAFETY: forwarded from the caller's guarantee.
        let (o, out) = unsafe { (read_tensor(parts, "parts")?, read_tensor(out, "out")?) };
        let count = usize::try_from(count).map_err(|_| {
            Error::InvalidArgument(format!("count is {count}, which is not a valid count"))
        })?;
        let shard_stride = usize::try_from(shard_stride).map_err(|_| Error::BadStrides {
            tensor: "parts",
            reason: format!("shard_stride is {shard_stride}; strides must be non-negative"),
        })?;
        Ok(MergeCall {
            parts: MergeParts {
                o,
                count,
                shard_stride,
                lse: lse_parts,
            },
            out,
            out_lse: (out_lse != 0).then_some(LseView { ptr: out_lse }),
        })
    }
}

/// A C varlen description and its optional host copies as a [`Varlen`].
///
/// # Safety
///
/// `v` must be null or point to a readable `FlashcoreVarlen`; each host pointer must be
/// null or valid for reads of `batch + 1` int32s for `'a`.
unsafe fn read_varlen<'a>(
    v: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
) -> Result<Varlen<'a>, Failure> {
    // SAFETY: the caller guarantees `v` is null or valid for reads.
    let v = unsafe { v.as_ref() }.ok_or_else(|| null_argument("varlen"))?;
    let count = |n: i64, what: &str| {
        usize::try_from(n)
            .map_err(|_| Error::InvalidArgument(format!("varlen.{what} is {n}, must be >= 0")))
    };
    let batch = count(v.batch, "batch")?;
    let max_seqlen_q = count(v.max_seqlen_q, "max_seqlen_q")?;
    let host = match (host_cu_seqlens_q.is_null(), host_cu_seqlens_k.is_null()) {
        (true, true) => None,
        // A batch past the grid limit is refused before any offset is read, and no caller
        // holds that many entries: no slice is made over them.
        (false, false) if batch > MAX_GRID_YZ => None,
        (false, false) => {
            let n = batch.saturating_add(1);
            // SAFETY: non-null; the caller guarantees `batch + 1` readable entries each.
            let (q, k) = unsafe {
                (
                    host_array(host_cu_seqlens_q, n, "host_cu_seqlens_q")?,
                    host_array(host_cu_seqlens_k, n, "host_cu_seqlens_k")?,
                )
            };
            Some(VarlenHost {
                cu_seqlens_q: q,
                cu_seqlens_k: k,
            })
        }
        _ => {
            return Err(Error::InvalidArgument(
                "give both host_cu_seqlens_q and host_cu_seqlens_k, or neither".into(),
            )
            .into());
        }
    };
    Ok(Varlen {
        cu_seqlens_q: v.cu_seqlens_q,
        cu_seqlens_k: v.cu_seqlens_k,
        batch,
        max_seqlen_q,
        host,
    })
}

// ---- entry points ------------------------------------------------------------------------

/// Opens device `device_ordinal` and creates a context on it; `*out` receives the handle
/// (null on failure). The context must be released with [`flashcore_destroy`].
///
/// # Safety
///
/// `out` must be null or valid for writing one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_create(
    device_ordinal: i32,
    out: *mut *mut FlashcoreContext,
) -> i32 {
    guard("flashcore_create", || {
        if out.is_null() {
            return Err(null_argument("out"));
        }
        // SAFETY: `out` is non-null and the caller guarantees it is valid for writes.
        unsafe { out.write(std::ptr::null_mut()) };
        let ordinal = usize::try_from(device_ordinal).map_err(|_| {
            Error::InvalidArgument(format!("device ordinal {device_ordinal} is negative"))
        })?;
        let device = Arc::new(Device::new(ordinal)?);
        let ctx = Box::new(FlashcoreContext {
            attn: Attention::new(device)?,
        });
        // SAFETY: as above; ownership of the box passes to the caller.
        unsafe { out.write(Box::into_raw(ctx)) };
        Ok(())
    })
}

/// Destroys a context made by [`flashcore_create`]; null is a no-op.
///
/// # Safety
///
/// `ctx` must be null or a handle from [`flashcore_create`] not destroyed yet, and no other
/// thread may be using it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_destroy(ctx: *mut FlashcoreContext) {
    if ctx.is_null() {
        return;
    }
    guard("flashcore_destroy", || {
        // SAFETY: `ctx` came from Box::into_raw in flashcore_create and is destroyed once
        // (the caller's contract), so re-boxing it and dropping it is sound.
        drop(unsafe { Box::from_raw(ctx) });
        Ok(())
    });
}

// The attention entry points come in three spellings: the original one
// (`flashcore_forward`, ...), a `_window` one that also takes a key window,
// FlashAttention's `window_size` (`window_left`, `window_right` after `causal`; −1, −1:
// none, and then the same call), and an `_ex` one that takes all the options as one
// `FlashcoreAttentionOptions` in place of `softmax_scale` and `causal` (the soft cap
// included; size-versioned, read by `read_options`). All run one shared body on the
// options, which reports under the name the caller used.

/// The body of [`flashcore_forward`], [`flashcore_forward_window`] and
/// [`flashcore_forward_ex`], reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_forward_ex`].
#[allow(clippy::too_many_arguments)]
unsafe fn forward_entry(
    name: &str,
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
    stream: CUstream,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle; only shared access
        // is needed (Attention::forward takes &self).
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees each tensor pointer is null or readable.
        let ForwardArgs { q, k, v, o, lse } = unsafe { ForwardArgs::read(q, k, v, o, lse)? };
        // SAFETY: the caller guarantees `opts` is null or readable.
        let params = unsafe { read_options(opts)? };
        // SAFETY: the C contract of flashcore_forward (header): the pointers are device
        // memory of the context's device valid for the described extents, and `stream` is
        // null or a stream of that context.
        unsafe {
            ctx.attn
                .forward(&q, &k, &v, &o, lse.as_ref(), &params, stream)?;
        }
        Ok(())
    })
}

/// `o = softmax(q kᵀ · scale) v` on `stream`; see `include/flashcore.h` for the contract.
///
/// # Safety
///
/// `ctx` must be null or a live handle from [`flashcore_create`]; `q`, `k`, `v`, `o` null
/// or readable `FlashcoreTensor`s whose device memory (and `lse`'s, when non-zero) is live
/// memory of the context's device for the views' extents until the kernel has run;
/// `stream` null or a live stream of the device's primary context.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    stream: CUstream,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, with these options (a
    // live temporary) and no window.
    unsafe {
        forward_entry(
            "flashcore_forward",
            ctx,
            q,
            k,
            v,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
            stream,
        )
    }
}

/// [`flashcore_forward`] with a key window: query row `i`, whose diagonal is key
/// `i + Sk − Sq`, sees the keys from `window_left` before it to `window_right` after it
/// (a negative side: unbounded); see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_forward`].
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward_window(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        forward_entry(
            "flashcore_forward_window",
            ctx,
            q,
            k,
            v,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
            stream,
        )
    }
}

/// [`flashcore_forward`] with its options as one struct: the scale, causal masking, the
/// key window (as [`flashcore_forward_window`] takes it) and the soft cap; see
/// `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_forward`]; `opts` must be null or point to a readable
/// `FlashcoreAttentionOptions` (its first 4 bytes, `struct_size`, and all `struct_size`
/// bytes when the size is one the library accepts).
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward_ex(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe { forward_entry("flashcore_forward_ex", ctx, q, k, v, o, lse, opts, stream) }
}

/// The body of [`flashcore_check_forward`], [`flashcore_check_forward_window`] and
/// [`flashcore_check_forward_ex`], reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_check_forward_ex`].
#[allow(clippy::too_many_arguments)]
unsafe fn check_forward_entry(
    name: &str,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees each tensor pointer is null or readable.
        let ForwardArgs { q, k, v, o, lse } = unsafe { ForwardArgs::read(q, k, v, o, lse)? };
        // SAFETY: the caller guarantees `opts` is null or readable.
        let params = unsafe { read_options(opts)? };
        validate_fwd(&q, &k, &v, &o, lse.as_ref(), &params)?;
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_forward`] call without a context, a device or a
/// driver: every rule `flashcore_forward` applies before it launches. Nothing is read
/// through the pointers; they are only checked as numbers (non-null, aligned, ranges
/// not overlapping).
///
/// # Safety
///
/// `q`, `k`, `v`, `o` must each be null or point to a readable `FlashcoreTensor`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, with these options (a
    // live temporary) and no window.
    unsafe {
        check_forward_entry(
            "flashcore_check_forward",
            q,
            k,
            v,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
        )
    }
}

/// Checks the arguments of a [`flashcore_forward_window`] call without a context, a device
/// or a driver, as [`flashcore_check_forward`] does (the window's rule included).
///
/// # Safety
///
/// As for [`flashcore_check_forward`].
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward_window(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        check_forward_entry(
            "flashcore_check_forward_window",
            q,
            k,
            v,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
        )
    }
}

/// Checks the arguments of a [`flashcore_forward_ex`] call without a context, a device or
/// a driver, as [`flashcore_check_forward`] does (the options' rules included).
///
/// # Safety
///
/// As for [`flashcore_check_forward`]; `opts` must be null or point to a readable
/// `FlashcoreAttentionOptions` (its first 4 bytes, `struct_size`, and all `struct_size`
/// bytes when the size is one the library accepts).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward_ex(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe { check_forward_entry("flashcore_check_forward_ex", q, k, v, o, lse, opts) }
}

// The serving entry points that read a cache come in two spellings: the original one
// (`flashcore_decode`, ...) for 16-bit caches, and an `_fp8kv` one that also takes the
// scales of an e4m3 cache (null: a 16-bit cache, and then the same call). Both run one
// shared body, which reports under the name the caller used.

/// The body of [`flashcore_decode_workspace_bytes`] and
/// [`flashcore_decode_workspace_bytes_fp8kv`], reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_decode_workspace_bytes_fp8kv`].
unsafe fn decode_workspace_bytes_entry(
    name: &str,
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    out: *mut usize,
) -> i32 {
    guard(name, || {
        if out.is_null() {
            return Err(null_argument("out"));
        }
        // SAFETY: `out` is non-null and the caller guarantees it is valid for writes.
        unsafe { out.write(0) };
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees `q`, `cache` and `scales` are null or readable.
        let (q, cache) = unsafe { (read_tensor(q, "q")?, read_cache(cache, scales)?) };
        let bytes = ctx.attn.decode_workspace_bytes(&q, &cache)?;
        // SAFETY: as above.
        unsafe { out.write(bytes) };
        Ok(())
    })
}

/// The workspace a [`flashcore_decode`] call with these `q` and `cache` needs on the
/// context's device, in bytes, into `*out` (0 when the call runs in one split, and on
/// failure).
///
/// # Safety
///
/// `out` must be null or valid for writing one `size_t`; `ctx` null or a live handle from
/// [`flashcore_create`]; `q` null or a readable `FlashcoreTensor`, `cache` null or a
/// readable `FlashcoreKvCache`. No device memory is read.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_workspace_bytes(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    out: *mut usize,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales.
    unsafe {
        decode_workspace_bytes_entry(
            "flashcore_decode_workspace_bytes",
            ctx,
            q,
            cache,
            std::ptr::null(),
            out,
        )
    }
}

/// [`flashcore_decode_workspace_bytes`] for a cache that may hold FP8: `scales` null (a
/// 16-bit cache) or an e4m3 cache's scales.
///
/// # Safety
///
/// As for [`flashcore_decode_workspace_bytes`]; `scales` must be null or point to a
/// readable `FlashcoreKvScales`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_workspace_bytes_fp8kv(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    out: *mut usize,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe {
        decode_workspace_bytes_entry(
            "flashcore_decode_workspace_bytes_fp8kv",
            ctx,
            q,
            cache,
            scales,
            out,
        )
    }
}

/// The body of [`flashcore_decode`], [`flashcore_decode_fp8kv`] and their `_window` and
/// `_ex` spellings, reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_decode_fp8kv_ex`].
#[allow(clippy::too_many_arguments)]
unsafe fn decode_entry(
    name: &str,
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees the struct pointers are null or readable and the
        // host arrays' extents; the result is dropped before this call returns.
        let call = unsafe {
            DecodeCall::read(
                q,
                cache,
                scales,
                host_seqlens,
                host_block_table,
                o,
                lse,
                opts,
            )?
        };
        let workspace = workspace_arg(workspace, workspace_bytes);
        // SAFETY: the C contract of flashcore_decode (header): the pointers are device
        // memory of the context's device valid for the described extents (the scales' and
        // the workspace's included), and `stream` is null or a stream of that context.
        unsafe {
            ctx.attn.decode(
                &call.q,
                &call.cache,
                call.host.as_ref(),
                &call.o,
                call.lse.as_ref(),
                &call.params,
                workspace,
                stream,
            )?;
        }
        Ok(())
    })
}

/// Decode against a KV cache on `stream`; see `include/flashcore.h` for the contract.
///
/// # Safety
///
/// `ctx` must be null or a live handle from [`flashcore_create`]; `q`, `o` null or
/// readable `FlashcoreTensor`s and `cache` null or a readable `FlashcoreKvCache`, whose
/// device memory (the cache's lengths and block table, and `lse`'s and `workspace`'s when
/// non-zero, included) is live memory of the context's device for the extents described
/// until the kernels have run; `host_seqlens` null or `B` readable int32s,
/// `host_block_table` null or `(B − 1) · table_stride + max_pages` readable int32s;
/// `stream` null or a live stream of the device's primary context.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales, with these
    // options (a live temporary).
    unsafe {
        decode_entry(
            "flashcore_decode",
            ctx,
            q,
            cache,
            std::ptr::null(),
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
            workspace,
            workspace_bytes,
            stream,
        )
    }
}

/// [`flashcore_decode`] against a cache that may hold FP8: `scales` null (a 16-bit cache,
/// the same call) or an e4m3 cache's scales; see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_decode`]; `scales` must be null or point to a readable
/// `FlashcoreKvScales` whose device memory is live memory of the context's device for
/// the extents it describes until the kernels have run.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_fp8kv(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        decode_entry(
            "flashcore_decode_fp8kv",
            ctx,
            q,
            cache,
            scales,
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
            workspace,
            workspace_bytes,
            stream,
        )
    }
}

/// [`flashcore_decode`] with a key window: query `i` of `Sq`, at position `len − Sq + i`,
/// sees the keys from `window_left` before that position to `window_right` after it (a
/// negative side: unbounded); see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_decode`].
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_window(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales, with these
    // options (a live temporary).
    unsafe {
        decode_entry(
            "flashcore_decode_window",
            ctx,
            q,
            cache,
            std::ptr::null(),
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
            workspace,
            workspace_bytes,
            stream,
        )
    }
}

/// [`flashcore_decode_fp8kv`] with a key window, as [`flashcore_decode_window`] takes it;
/// see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_decode_fp8kv`].
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_fp8kv_window(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        decode_entry(
            "flashcore_decode_fp8kv_window",
            ctx,
            q,
            cache,
            scales,
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
            workspace,
            workspace_bytes,
            stream,
        )
    }
}

/// [`flashcore_decode`] with its options as one struct, as [`flashcore_forward_ex`] takes
/// them (the key window as [`flashcore_decode_window`] reads it); see
/// `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_decode`]; `opts` must be null or point to a readable
/// `FlashcoreAttentionOptions` (its first 4 bytes, `struct_size`, and all `struct_size`
/// bytes when the size is one the library accepts).
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_ex(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales.
    unsafe {
        decode_entry(
            "flashcore_decode_ex",
            ctx,
            q,
            cache,
            std::ptr::null(),
            host_seqlens,
            host_block_table,
            o,
            lse,
            opts,
            workspace,
            workspace_bytes,
            stream,
        )
    }
}

/// [`flashcore_decode_fp8kv`] with its options as one struct, as [`flashcore_decode_ex`]
/// takes them; see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_decode_fp8kv`]; `opts` must be null or point to a readable
/// `FlashcoreAttentionOptions` (its first 4 bytes, `struct_size`, and all `struct_size`
/// bytes when the size is one the library accepts).
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_fp8kv_ex(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe {
        decode_entry(
            "flashcore_decode_fp8kv_ex",
            ctx,
            q,
            cache,
            scales,
            host_seqlens,
            host_block_table,
            o,
            lse,
            opts,
            workspace,
            workspace_bytes,
            stream,
        )
    }
}

/// The body of [`flashcore_check_decode`], [`flashcore_check_decode_fp8kv`] and their
/// `_window` and `_ex` spellings, reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_check_decode_fp8kv_ex`].
#[allow(clippy::too_many_arguments)]
unsafe fn check_decode_entry(
    name: &str,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees the struct pointers are null or readable and the
        // host arrays' extents.
        let call = unsafe {
            DecodeCall::read(
                q,
                cache,
                scales,
                host_seqlens,
                host_block_table,
                o,
                lse,
                opts,
            )?
        };
        if let Some(h) = &call.host {
            h.check(&call.cache, &call.problem.cache, 0)?;
        }
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_decode`] call without a context, a device or a
/// driver: every rule `flashcore_decode` applies before it launches except the
/// workspace's (its size depends on the GPU). Device pointers are only checked as
/// numbers; the host arrays, when given, are read and checked against the cache.
///
/// # Safety
///
/// As for [`flashcore_decode`], except that no device memory need exist.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_decode(
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales, with these
    // options (a live temporary).
    unsafe {
        check_decode_entry(
            "flashcore_check_decode",
            q,
            cache,
            std::ptr::null(),
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
        )
    }
}

/// Checks the arguments of a [`flashcore_decode_fp8kv`] call without a context, a device
/// or a driver, as [`flashcore_check_decode`] does (the GPU's rule, sm_89 for an e4m3
/// cache, excepted).
///
/// # Safety
///
/// As for [`flashcore_decode_fp8kv`], except that no device memory need exist.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_decode_fp8kv(
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        check_decode_entry(
            "flashcore_check_decode_fp8kv",
            q,
            cache,
            scales,
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
        )
    }
}

/// Checks the arguments of a [`flashcore_decode_window`] call without a context, a device
/// or a driver, as [`flashcore_check_decode`] does (the window's rule included).
///
/// # Safety
///
/// As for [`flashcore_decode_window`], except that no device memory need exist.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_decode_window(
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales, with these
    // options (a live temporary).
    unsafe {
        check_decode_entry(
            "flashcore_check_decode_window",
            q,
            cache,
            std::ptr::null(),
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
        )
    }
}

/// Checks the arguments of a [`flashcore_decode_fp8kv_window`] call without a context, a
/// device or a driver, as [`flashcore_check_decode_fp8kv`] does (the window's rule
/// included).
///
/// # Safety
///
/// As for [`flashcore_decode_fp8kv_window`], except that no device memory need exist.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_decode_fp8kv_window(
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        check_decode_entry(
            "flashcore_check_decode_fp8kv_window",
            q,
            cache,
            scales,
            host_seqlens,
            host_block_table,
            o,
            lse,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
        )
    }
}

/// Checks the arguments of a [`flashcore_decode_ex`] call without a context, a device or
/// a driver, as [`flashcore_check_decode`] does (the options' rules included).
///
/// # Safety
///
/// As for [`flashcore_decode_ex`], except that no device memory need exist.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_decode_ex(
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales.
    unsafe {
        check_decode_entry(
            "flashcore_check_decode_ex",
            q,
            cache,
            std::ptr::null(),
            host_seqlens,
            host_block_table,
            o,
            lse,
            opts,
        )
    }
}

/// Checks the arguments of a [`flashcore_decode_fp8kv_ex`] call without a context, a
/// device or a driver, as [`flashcore_check_decode_fp8kv`] does (the options' rules
/// included).
///
/// # Safety
///
/// As for [`flashcore_decode_fp8kv_ex`], except that no device memory need exist.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_decode_fp8kv_ex(
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe {
        check_decode_entry(
            "flashcore_check_decode_fp8kv_ex",
            q,
            cache,
            scales,
            host_seqlens,
            host_block_table,
            o,
            lse,
            opts,
        )
    }
}

/// The body of [`flashcore_append_kv`] and [`flashcore_append_kv_fp8kv`], reporting as
/// `name`.
///
/// # Safety
///
/// As for [`flashcore_append_kv_fp8kv`].
#[allow(clippy::too_many_arguments)]
unsafe fn append_entry(
    name: &str,
    ctx: *mut FlashcoreContext,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    k_new: *const FlashcoreTensor,
    v_new: *const FlashcoreTensor,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    stream: CUstream,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees the struct pointers are null or readable and the
        // host arrays' extents; the result is dropped before this call returns.
        let call = unsafe {
            AppendCall::read(cache, scales, k_new, v_new, host_seqlens, host_block_table)?
        };
        // SAFETY: the C contract of flashcore_append_kv (header): the pointers are device
        // memory of the context's device valid for the described extents (the scales'
        // included), and `stream` is null or a stream of that context.
        unsafe {
            ctx.attn.append_kv(
                &call.cache,
                &call.k_new,
                &call.v_new,
                call.host.as_ref(),
                stream,
            )?;
        }
        Ok(())
    })
}

/// Appends `k_new`, `v_new` to `cache` on `stream`; see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_decode`], with `k_new`, `v_new` null or readable
/// `FlashcoreTensor`s of live device memory and `B` their batch.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_append_kv(
    ctx: *mut FlashcoreContext,
    cache: *const FlashcoreKvCache,
    k_new: *const FlashcoreTensor,
    v_new: *const FlashcoreTensor,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    stream: CUstream,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales.
    unsafe {
        append_entry(
            "flashcore_append_kv",
            ctx,
            cache,
            std::ptr::null(),
            k_new,
            v_new,
            host_seqlens,
            host_block_table,
            stream,
        )
    }
}

/// [`flashcore_append_kv`] to a cache that may hold FP8: `scales` null (a 16-bit cache,
/// the same call) or an e4m3 cache's scales, and then 16-bit new tokens are quantized
/// into codes and scales; see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_append_kv`]; `scales` must be null or point to a readable
/// `FlashcoreKvScales` whose device memory is live memory of the context's device for
/// the extents it describes until the kernel has run.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_append_kv_fp8kv(
    ctx: *mut FlashcoreContext,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    k_new: *const FlashcoreTensor,
    v_new: *const FlashcoreTensor,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe {
        append_entry(
            "flashcore_append_kv_fp8kv",
            ctx,
            cache,
            scales,
            k_new,
            v_new,
            host_seqlens,
            host_block_table,
            stream,
        )
    }
}

/// The body of [`flashcore_check_append_kv`] and [`flashcore_check_append_kv_fp8kv`],
/// reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_check_append_kv_fp8kv`].
unsafe fn check_append_entry(
    name: &str,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    k_new: *const FlashcoreTensor,
    v_new: *const FlashcoreTensor,
    host_seqlens: *const i32,
    host_block_table: *const i32,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees the struct pointers are null or readable and the
        // host arrays' extents.
        let call = unsafe {
            AppendCall::read(cache, scales, k_new, v_new, host_seqlens, host_block_table)?
        };
        if let Some(h) = &call.host {
            h.check(&call.cache, &call.problem.cache, call.problem.new_tokens)?;
        }
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_append_kv`] call without a context, a device or
/// a driver: every rule `flashcore_append_kv` applies before it launches. Device pointers
/// are only checked as numbers; the host arrays, when given, are read and checked.
///
/// # Safety
///
/// As for [`flashcore_append_kv`], except that no device memory need exist.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_append_kv(
    cache: *const FlashcoreKvCache,
    k_new: *const FlashcoreTensor,
    v_new: *const FlashcoreTensor,
    host_seqlens: *const i32,
    host_block_table: *const i32,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, without scales.
    unsafe {
        check_append_entry(
            "flashcore_check_append_kv",
            cache,
            std::ptr::null(),
            k_new,
            v_new,
            host_seqlens,
            host_block_table,
        )
    }
}

/// Checks the arguments of a [`flashcore_append_kv_fp8kv`] call without a context, a
/// device or a driver, as [`flashcore_check_append_kv`] does (the GPU's rule, sm_89 for
/// an e4m3 cache, excepted).
///
/// # Safety
///
/// As for [`flashcore_append_kv_fp8kv`], except that no device memory need exist.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_append_kv_fp8kv(
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    k_new: *const FlashcoreTensor,
    v_new: *const FlashcoreTensor,
    host_seqlens: *const i32,
    host_block_table: *const i32,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe {
        check_append_entry(
            "flashcore_check_append_kv_fp8kv",
            cache,
            scales,
            k_new,
            v_new,
            host_seqlens,
            host_block_table,
        )
    }
}

/// Merges attention results over disjoint key shards on `stream`; see
/// `include/flashcore.h` for the contract.
///
/// # Safety
///
/// `ctx` must be null or a live handle from [`flashcore_create`]; `parts` and `out` null
/// or readable `FlashcoreTensor`s whose device memory (the `count` shards, `lse_parts`'
/// `count · B · H · S` floats, and `out_lse`'s when non-zero) is live memory of the
/// context's device until the kernel has run; `stream` null or a live stream of the
/// device's primary context.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_merge(
    ctx: *mut FlashcoreContext,
    parts: *const FlashcoreTensor,
    count: i64,
    shard_stride: i64,
    lse_parts: u64,
    out: *const FlashcoreTensor,
    out_lse: u64,
    stream: CUstream,
) -> i32 {
    guard("flashcore_merge", || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees `parts` and `out` are null or readable.
        let call = unsafe { MergeCall::read(parts, count, shard_stride, lse_parts, out, out_lse)? };
        // SAFETY: the C contract of flashcore_merge (header): the pointers are device
        // memory of the context's device valid for the described extents, and `stream` is
        // null or a stream of that context.
        unsafe {
            ctx.attn
                .merge(&call.parts, &call.out, call.out_lse.as_ref(), stream)?;
        }
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_merge`] call without a context, a device or a
/// driver: every rule `flashcore_merge` applies before it launches. Nothing is read
/// through the device pointers.
///
/// # Safety
///
/// `parts` and `out` must each be null or point to a readable `FlashcoreTensor`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_merge(
    parts: *const FlashcoreTensor,
    count: i64,
    shard_stride: i64,
    lse_parts: u64,
    out: *const FlashcoreTensor,
    out_lse: u64,
) -> i32 {
    guard("flashcore_check_merge", || {
        // SAFETY: the caller guarantees `parts` and `out` are null or readable.
        let call = unsafe { MergeCall::read(parts, count, shard_stride, lse_parts, out, out_lse)? };
        validate_merge(&call.parts, &call.out, call.out_lse.as_ref())?;
        Ok(())
    })
}

/// The body of [`flashcore_forward_varlen`], [`flashcore_forward_varlen_window`] and
/// [`flashcore_forward_varlen_ex`], reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_forward_varlen_ex`].
#[allow(clippy::too_many_arguments)]
unsafe fn forward_varlen_entry(
    name: &str,
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    opts: *const FlashcoreAttentionOptions,
    stream: CUstream,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees each pointer is null or readable.
        let ForwardArgs { q, k, v, o, lse } = unsafe { ForwardArgs::read(q, k, v, o, lse)? };
        // SAFETY: as above.
        let varlen = unsafe { read_varlen(varlen, host_cu_seqlens_q, host_cu_seqlens_k)? };
        // SAFETY: the caller guarantees `opts` is null or readable.
        let params = unsafe { read_options(opts)? };
        // SAFETY: the C contract (header): device memory of the context's device valid
        // for the described extents, `stream` null or a stream of that context.
        unsafe {
            ctx.attn
                .forward_varlen(&q, &k, &v, &o, lse.as_ref(), &varlen, &params, stream)?;
        }
        Ok(())
    })
}

/// Variable-length forward attention over packed sequences, on `stream`; see
/// `include/flashcore.h` for the contract.
///
/// # Safety
///
/// As for [`flashcore_forward`]; `varlen` must be null or a readable `FlashcoreVarlen`
/// whose offset arrays are live device memory of the context's device, and each host
/// pointer null or valid for reads of `varlen.batch + 1` int32s.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward_varlen(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    softmax_scale: f32,
    causal: i32,
    stream: CUstream,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, with these options (a
    // live temporary) and no window.
    unsafe {
        forward_varlen_entry(
            "flashcore_forward_varlen",
            ctx,
            q,
            k,
            v,
            o,
            lse,
            varlen,
            host_cu_seqlens_q,
            host_cu_seqlens_k,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
            stream,
        )
    }
}

/// [`flashcore_forward_varlen`] with a key window, each sequence's aligned bottom-right
/// on its own as [`flashcore_forward_window`] aligns it; see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_forward_varlen`].
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward_varlen_window(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        forward_varlen_entry(
            "flashcore_forward_varlen_window",
            ctx,
            q,
            k,
            v,
            o,
            lse,
            varlen,
            host_cu_seqlens_q,
            host_cu_seqlens_k,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
            stream,
        )
    }
}

/// [`flashcore_forward_varlen`] with its options as one struct, as
/// [`flashcore_forward_ex`] takes them (the key window aligned per sequence, as
/// [`flashcore_forward_varlen_window`] aligns it); see `include/flashcore.h`.
///
/// # Safety
///
/// As for [`flashcore_forward_varlen`]; `opts` must be null or point to a readable
/// `FlashcoreAttentionOptions` (its first 4 bytes, `struct_size`, and all `struct_size`
/// bytes when the size is one the library accepts).
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward_varlen_ex(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    opts: *const FlashcoreAttentionOptions,
    stream: CUstream,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe {
        forward_varlen_entry(
            "flashcore_forward_varlen_ex",
            ctx,
            q,
            k,
            v,
            o,
            lse,
            varlen,
            host_cu_seqlens_q,
            host_cu_seqlens_k,
            opts,
            stream,
        )
    }
}

/// The body of [`flashcore_check_forward_varlen`],
/// [`flashcore_check_forward_varlen_window`] and [`flashcore_check_forward_varlen_ex`],
/// reporting as `name`.
///
/// # Safety
///
/// As for [`flashcore_check_forward_varlen_ex`].
#[allow(clippy::too_many_arguments)]
unsafe fn check_forward_varlen_entry(
    name: &str,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    guard(name, || {
        // SAFETY: the caller guarantees each pointer is null or readable.
        let ForwardArgs { q, k, v, o, lse } = unsafe { ForwardArgs::read(q, k, v, o, lse)? };
        // SAFETY: as above.
        let varlen = unsafe { read_varlen(varlen, host_cu_seqlens_q, host_cu_seqlens_k)? };
        // SAFETY: the caller guarantees `opts` is null or readable.
        let params = unsafe { read_options(opts)? };
        validate_varlen(&q, &k, &v, &o, lse.as_ref(), &varlen, &params)?;
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_forward_varlen`] call without a context, a
/// device or a driver; device pointers are only checked as numbers, the host arrays
/// (when given) are read and checked.
///
/// # Safety
///
/// As for [`flashcore_forward_varlen`], without `ctx` and `stream`.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward_varlen(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    softmax_scale: f32,
    causal: i32,
) -> i32 {
    // SAFETY: the caller's guarantees are the shared body's, with these options (a
    // live temporary) and no window.
    unsafe {
        check_forward_varlen_entry(
            "flashcore_check_forward_varlen",
            q,
            k,
            v,
            o,
            lse,
            varlen,
            host_cu_seqlens_q,
            host_cu_seqlens_k,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, -1, -1),
        )
    }
}

/// Checks the arguments of a [`flashcore_forward_varlen_window`] call without a context, a
/// device or a driver, as [`flashcore_check_forward_varlen`] does (the window's rule
/// included).
///
/// # Safety
///
/// As for [`flashcore_forward_varlen_window`], without `ctx` and `stream`.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward_varlen_window(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    softmax_scale: f32,
    causal: i32,
    window_left: i64,
    window_right: i64,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees, with these options (a live
    // temporary).
    unsafe {
        check_forward_varlen_entry(
            "flashcore_check_forward_varlen_window",
            q,
            k,
            v,
            o,
            lse,
            varlen,
            host_cu_seqlens_q,
            host_cu_seqlens_k,
            &FlashcoreAttentionOptions::uncapped(softmax_scale, causal, window_left, window_right),
        )
    }
}

/// Checks the arguments of a [`flashcore_forward_varlen_ex`] call without a context, a
/// device or a driver, as [`flashcore_check_forward_varlen`] does (the options' rules
/// included).
///
/// # Safety
///
/// As for [`flashcore_forward_varlen_ex`], without `ctx` and `stream`.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward_varlen_ex(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    o: *const FlashcoreTensor,
    lse: u64,
    varlen: *const FlashcoreVarlen,
    host_cu_seqlens_q: *const i32,
    host_cu_seqlens_k: *const i32,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    // SAFETY: forwarded from the caller's guarantees.
    unsafe {
        check_forward_varlen_entry(
            "flashcore_check_forward_varlen_ex",
            q,
            k,
            v,
            o,
            lse,
            varlen,
            host_cu_seqlens_q,
            host_cu_seqlens_k,
            opts,
        )
    }
}

/// The workspace a [`flashcore_quantize_fp8`] call with these inputs and options needs,
/// in bytes, into `*out` (0 on failure): the FP8 layout's size plus `Fp8Layout::ALIGN − 1`
/// bytes, so that a buffer of that size holds the layout whatever its start's alignment.
/// Validates the inputs as `flashcore_quantize_fp8` does; needs no context, device or
/// driver, and reads no device memory.
///
/// # Safety
///
/// `out` must be null or valid for writing one `size_t`; `q`, `k`, `v` null or readable
/// `FlashcoreTensor`s; `options` null (every option off) or a readable
/// `FlashcoreQuantizeOptions`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_fp8_workspace_bytes(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    options: *const FlashcoreQuantizeOptions,
    out: *mut usize,
) -> i32 {
    guard("flashcore_fp8_workspace_bytes", || {
        if out.is_null() {
            return Err(null_argument("out"));
        }
        // SAFETY: `out` is non-null and the caller guarantees it is valid for writes.
        unsafe { out.write(0) };
        // SAFETY: the caller guarantees each tensor pointer is null or readable.
        let [q, k, v] = unsafe { read_qkv(q, k, v)? };
        // SAFETY: the caller guarantees `options` is null or readable.
        let options = unsafe { read_quantize_options(options) };
        let problem = validate_quantize_inputs(&q, &k, &v, &options)?;
        let bytes = problem
            .layout
            .bytes
            .checked_add(Fp8Layout::ALIGN - 1)
            .ok_or_else(|| {
                Error::InvalidArgument("the FP8 workspace overflows the address space".into())
            })?;
        // SAFETY: as above.
        unsafe { out.write(bytes) };
        Ok(())
    })
}

/// Quantizes 16-bit Q, K and V to FP8 operands in a caller's workspace, on `stream`, and
/// describes them in `*out`; see `include/flashcore.h` for the contract.
///
/// # Safety
///
/// `out` must be null or valid for writing one `FlashcoreFp8Operands`; `ctx` null or a
/// live handle from [`flashcore_create`]; `q`, `k`, `v` null or readable
/// `FlashcoreTensor`s and `options` null or a readable `FlashcoreQuantizeOptions`; the
/// tensors' device memory and the workspace's `workspace_bytes` bytes live memory of the
/// context's device until the kernels have run; `stream` null or a live stream of the
/// device's primary context.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_quantize_fp8(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    options: *const FlashcoreQuantizeOptions,
    workspace: u64,
    workspace_bytes: usize,
    out: *mut FlashcoreFp8Operands,
    stream: CUstream,
) -> i32 {
    guard("flashcore_quantize_fp8", || {
        if out.is_null() {
            return Err(null_argument("out"));
        }
        // SAFETY: `out` is non-null and the caller guarantees it is valid for writes; a
        // failing call leaves it all zeros (no usable operands).
        unsafe { out.write(FlashcoreFp8Operands::default()) };
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees each tensor pointer is null or readable.
        let [q, k, v] = unsafe { read_qkv(q, k, v)? };
        // SAFETY: the caller guarantees `options` is null or readable.
        let options = unsafe { read_quantize_options(options) };
        let workspace = aligned_workspace(workspace, workspace_bytes);
        // SAFETY: the C contract of flashcore_quantize_fp8 (header): the tensors and the
        // workspace (of which `workspace` is a part) are device memory of the context's
        // device valid for the described extents, and `stream` is null or a stream of it.
        let ops = unsafe {
            ctx.attn
                .quantize_fp8(&q, &k, &v, &options, workspace, stream)?
        };
        // SAFETY: as above.
        unsafe { out.write(c_fp8_operands(&ops)) };
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_quantize_fp8`] call without a context, a device
/// or a driver: every rule `flashcore_quantize_fp8` applies before it launches except
/// the GPU's (an sm_89 or newer one). Nothing is read through the device pointers.
///
/// # Safety
///
/// `q`, `k`, `v` must each be null or point to a readable `FlashcoreTensor`, `options` be
/// null or point to a readable `FlashcoreQuantizeOptions`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_quantize_fp8(
    q: *const FlashcoreTensor,
    k: *const FlashcoreTensor,
    v: *const FlashcoreTensor,
    options: *const FlashcoreQuantizeOptions,
    workspace: u64,
    workspace_bytes: usize,
) -> i32 {
    guard("flashcore_check_quantize_fp8", || {
        // SAFETY: the caller guarantees each tensor pointer is null or readable.
        let [q, k, v] = unsafe { read_qkv(q, k, v)? };
        // SAFETY: the caller guarantees `options` is null or readable.
        let options = unsafe { read_quantize_options(options) };
        let workspace = aligned_workspace(workspace, workspace_bytes);
        validate_quantize(&q, &k, &v, &options, &workspace)?;
        Ok(())
    })
}

/// `o = softmax(q kᵀ · scale) v` from FP8 operands, on `stream`; see
/// `include/flashcore.h` for the contract.
///
/// # Safety
///
/// `ctx` must be null or a live handle from [`flashcore_create`]; `ops` null or a
/// readable `FlashcoreFp8Operands` and `o` null or a readable `FlashcoreTensor`, whose
/// device memory (and `lse`'s, when non-zero) is live memory of the context's device for
/// the extents described until the kernel has run; `stream` null or a live stream of the
/// device's primary context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_forward_fp8(
    ctx: *mut FlashcoreContext,
    ops: *const FlashcoreFp8Operands,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
    stream: CUstream,
) -> i32 {
    guard("flashcore_forward_fp8", || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees `ops` and `o` are null or readable.
        let (ops, o) = unsafe { (read_fp8_operands(ops)?, read_tensor(o, "o")?) };
        let lse = (lse != 0).then_some(LseView { ptr: lse });
        let params = params(softmax_scale, causal, Window::FULL);
        // SAFETY: the C contract of flashcore_forward_fp8 (header): the pointers are
        // device memory of the context's device valid for the described extents, and
        // `stream` is null or a stream of that context.
        unsafe {
            ctx.attn
                .forward_fp8(&ops, &o, lse.as_ref(), &params, stream)?;
        }
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_forward_fp8`] call without a context, a device or
/// a driver: every rule `flashcore_forward_fp8` applies before it launches except the
/// GPU's (FP8 needs sm_89 or newer). Nothing is read through the device pointers.
///
/// # Safety
///
/// `ops` must be null or point to a readable `FlashcoreFp8Operands`, `o` null or to a
/// readable `FlashcoreTensor`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_forward_fp8(
    ops: *const FlashcoreFp8Operands,
    o: *const FlashcoreTensor,
    lse: u64,
    softmax_scale: f32,
    causal: i32,
) -> i32 {
    guard("flashcore_check_forward_fp8", || {
        // SAFETY: the caller guarantees `ops` and `o` are null or readable.
        let (ops, o) = unsafe { (read_fp8_operands(ops)?, read_tensor(o, "o")?) };
        let lse = (lse != 0).then_some(LseView { ptr: lse });
        let params = params(softmax_scale, causal, Window::FULL);
        validate_fp8(&ops, &o, lse.as_ref(), &params)?;
        Ok(())
    })
}

/// The message of the last failing flashcore call on this thread, `""` if none failed.
/// The pointer stays valid until the next flashcore call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn flashcore_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|slot| match slot.try_borrow() {
            Ok(s) => s.as_ptr(),
            Err(_) => c"".as_ptr(),
        })
        .unwrap_or(c"".as_ptr())
}

/// The symbolic name of a return code (`"FLASHCORE_ERROR_BAD_STRIDES"`), or
/// `"FLASHCORE_ERROR_UNKNOWN"`; a static string.
#[unsafe(no_mangle)]
pub extern "C" fn flashcore_error_name(code: i32) -> *const c_char {
    error_name(code).as_ptr()
}

fn error_name(code: i32) -> &'static CStr {
    return_code(code).map_or(c"FLASHCORE_ERROR_UNKNOWN", |r| r.c_name)
}

const VERSION: &CStr =
    match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => panic!("the package version contains a NUL byte"),
    };

/// The library version, e.g. `"0.1.0"`; a static string.
#[unsafe(no_mangle)]
pub extern "C" fn flashcore_version() -> *const c_char {
    VERSION.as_ptr()
}

// ---- serving batches: packed queries over a cache -------------------------------------

/// The offsets of a packed-query call as C passes them: counts converted (a negative one
/// is [`Error::InvalidArgument`]) and the host copy, when given, as a slice of `batch + 1`
/// entries (none is made past the grid limit, which validation refuses first).
///
/// # Safety
///
/// `host_cu_seqlens_q` must be null or valid for reads of `batch + 1` int32s for `'a`.
unsafe fn read_packed_queries<'a>(
    cu_seqlens_q: u64,
    batch: i64,
    max_seqlen_q: i64,
    host_cu_seqlens_q: *const i32,
) -> Result<PackedQueries<'a>, Failure> {
    let count = |n: i64, what: &str| {
        usize::try_from(n)
            .map_err(|_| Error::InvalidArgument(format!("{what} is {n}, must be >= 0")))
    };
    let batch = count(batch, "batch")?;
    let max_seqlen_q = count(max_seqlen_q, "max_seqlen_q")?;
    let host = if host_cu_seqlens_q.is_null() || batch > MAX_GRID_YZ {
        None
    } else {
        // SAFETY: non-null; the caller guarantees `batch + 1` readable entries.
        Some(unsafe { host_array(host_cu_seqlens_q, batch + 1, "host_cu_seqlens_q")? })
    };
    Ok(PackedQueries {
        cu_seqlens_q,
        batch,
        max_seqlen_q,
        host,
    })
}

/// A C call's workspace: none when both its address and its size are 0.
fn workspace_arg(ptr: u64, bytes: usize) -> Option<Workspace> {
    (ptr != 0 || bytes != 0).then_some(Workspace { ptr, bytes })
}

/// The arguments of a [`flashcore_decode_varlen`] call, read from C and validated (all
/// but the workspace's, whose size depends on the GPU).
struct DecodeVarlenCall<'a> {
    q: TensorView,
    cache: KvCache,
    queries: PackedQueries<'a>,
    o: TensorView,
    lse: Option<LseView>,
    params: AttentionParams,
}

impl DecodeVarlenCall<'_> {
    /// Reads and checks the C arguments, the host metadata (when given) against the
    /// cache.
    ///
    /// # Safety
    ///
    /// As for [`DecodeCall::read`], with `B` = `batch`, and `host_cu_seqlens_q` null or
    /// `batch + 1` readable int32s.
    #[allow(clippy::too_many_arguments)]
    unsafe fn read<'a>(
        q: *const FlashcoreTensor,
        cache: *const FlashcoreKvCache,
        scales: *const FlashcoreKvScales,
        (cu_seqlens_q, batch, max_seqlen_q): (u64, i64, i64),
        [host_cu_seqlens_q, host_seqlens, host_block_table]: [*const i32; 3],
        o: *const FlashcoreTensor,
        lse: u64,
        opts: *const FlashcoreAttentionOptions,
    ) -> Result<DecodeVarlenCall<'a>, Failure> {
        // SAFETY: forwarded from the caller's guarantee.
        let (q, cache, o) = unsafe {
            (
                read_tensor(q, "q")?,
                read_cache(cache, scales)?,
                read_tensor(o, "o")?,
            )
        };
        let lse = (lse != 0).then_some(LseView { ptr: lse });
        // SAFETY: the caller guarantees `opts` is null or readable.
        let params = unsafe { read_options(opts)? };
        // SAFETY: the caller guarantees the host offsets' extent.
        let queries =
            unsafe { read_packed_queries(cu_seqlens_q, batch, max_seqlen_q, host_cu_seqlens_q)? };
        let problem = validate_decode_varlen(&q, &cache, &queries, &o, lse.as_ref(), &params)?;
        let arrays = HostArrays {
            seqlens: host_seqlens,
            block_table: host_block_table,
        };
        // SAFETY: validation made `batch` the cache's; the caller guarantees the host
        // arrays' extents for it.
        let host = unsafe { arrays.metadata(&cache, problem.cache.batch)? };
        if let Some(h) = &host {
            h.check(&cache, &problem.cache, 0)?;
        }
        Ok(DecodeVarlenCall {
            q,
            cache,
            queries,
            o,
            lse,
            params,
        })
    }
}

/// A serving batch in one call: each sequence's queries packed in `q` against a cache;
/// see `include/flashcore.h` for the contract.
///
/// # Safety
///
/// As for [`flashcore_decode_fp8kv_ex`], with q and o `[1, total_q, Hq, D]`, `batch` the
/// cache's batch, `cu_seqlens_q` `batch + 1` live device int32s, and `host_cu_seqlens_q`
/// null or `batch + 1` readable int32s.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_varlen(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    cu_seqlens_q: u64,
    batch: i64,
    max_seqlen_q: i64,
    host_cu_seqlens_q: *const i32,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
    workspace: u64,
    workspace_bytes: usize,
    stream: CUstream,
) -> i32 {
    guard("flashcore_decode_varlen", || {
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees the struct pointers are null or readable and the
        // host arrays' extents; the result is dropped before this call returns.
        let call = unsafe {
            DecodeVarlenCall::read(
                q,
                cache,
                scales,
                (cu_seqlens_q, batch, max_seqlen_q),
                [host_cu_seqlens_q, host_seqlens, host_block_table],
                o,
                lse,
                opts,
            )?
        };
        let workspace = workspace_arg(workspace, workspace_bytes);
        // SAFETY: the C contract of flashcore_decode_varlen (header): the pointers are
        // device memory of the context's device valid for the described extents, and
        // `stream` is null or a stream of that context. The host metadata was checked above.
        unsafe {
            ctx.attn.decode_varlen(
                &call.q,
                &call.cache,
                &call.queries,
                None,
                &call.o,
                call.lse.as_ref(),
                &call.params,
                workspace,
                stream,
            )?;
        }
        Ok(())
    })
}

/// The workspace a [`flashcore_decode_varlen`] call needs, into `*out`; see
/// `include/flashcore.h`.
///
/// # Safety
///
/// `out` must be null or valid for writing one `size_t`; `ctx` null or a live handle;
/// `q` null or a readable `FlashcoreTensor`, `cache` null or a readable
/// `FlashcoreKvCache`, `scales` null or a readable `FlashcoreKvScales`. No device memory
/// is read.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_decode_varlen_workspace_bytes(
    ctx: *mut FlashcoreContext,
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    cu_seqlens_q: u64,
    batch: i64,
    max_seqlen_q: i64,
    out: *mut usize,
) -> i32 {
    guard("flashcore_decode_varlen_workspace_bytes", || {
        if out.is_null() {
            return Err(null_argument("out"));
        }
        // SAFETY: `out` is non-null and the caller guarantees it is valid for writes.
        unsafe { out.write(0) };
        // SAFETY: the caller guarantees `ctx` is null or a live handle; shared access only.
        let ctx = unsafe { ctx.as_ref() }.ok_or_else(|| null_argument("ctx"))?;
        // SAFETY: the caller guarantees `q`, `cache` and `scales` are null or readable; no
        // host offsets are read.
        let (q, cache, queries) = unsafe {
            (
                read_tensor(q, "q")?,
                read_cache(cache, scales)?,
                read_packed_queries(cu_seqlens_q, batch, max_seqlen_q, std::ptr::null())?,
            )
        };
        let bytes = ctx
            .attn
            .decode_varlen_workspace_bytes(&q, &cache, &queries)?;
        // SAFETY: as above.
        unsafe { out.write(bytes) };
        Ok(())
    })
}

/// Checks the arguments of a [`flashcore_decode_varlen`] call without a context, a device
/// or a driver: every rule it applies before launching except the workspace's. Device
/// pointers are only checked as numbers; the host arrays, when given, are read and
/// checked.
///
/// # Safety
///
/// As for [`flashcore_decode_varlen`], except that no device memory need exist.
#[allow(clippy::too_many_arguments)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn flashcore_check_decode_varlen(
    q: *const FlashcoreTensor,
    cache: *const FlashcoreKvCache,
    scales: *const FlashcoreKvScales,
    cu_seqlens_q: u64,
    batch: i64,
    max_seqlen_q: i64,
    host_cu_seqlens_q: *const i32,
    host_seqlens: *const i32,
    host_block_table: *const i32,
    o: *const FlashcoreTensor,
    lse: u64,
    opts: *const FlashcoreAttentionOptions,
) -> i32 {
    guard("flashcore_check_decode_varlen", || {
        // SAFETY: the caller guarantees the struct pointers are null or readable and the
        // host arrays' extents.
        unsafe {
            DecodeVarlenCall::read(
                q,
                cache,
                scales,
                (cu_seqlens_q, batch, max_seqlen_q),
                [host_cu_seqlens_q, host_seqlens, host_block_table],
                o,
                lse,
                opts,
            )?
        };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::device::driver_present;
    use crate::host::tensor::{KeyWindow, WINDOW_UNBOUNDED};
    use crate::ptx::PtxError;
    use std::ptr;

    fn last_error() -> String {
        // SAFETY: flashcore_last_error returns a valid NUL-terminated string that lives
        // until the next flashcore call on this thread; it is copied out at once.
        unsafe { CStr::from_ptr(flashcore_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    fn tensor(dtype: i32) -> FlashcoreTensor {
        FlashcoreTensor {
            ptr: 0x1000,
            dtype,
            shape: [1, 128, 2, 64],
            strides: [128 * 2 * 64, 2 * 64, 64, 1],
        }
    }

    #[test]
    fn varlen_checks_reach_c_with_their_codes() {
        let at = |ptr: u64, rows: i64, heads: i64| FlashcoreTensor {
            ptr,
            dtype: FLASHCORE_F16,
            shape: [1, rows, heads, 64],
            strides: [0, heads * 64, 64, 1],
        };
        let (q, k, v, o) = (
            at(1 << 30, 300, 8),
            at(2 << 30, 500, 2),
            at(3 << 30, 500, 2),
            at(4 << 30, 300, 8),
        );
        let varlen = FlashcoreVarlen {
            cu_seqlens_q: 5 << 30,
            cu_seqlens_k: (5 << 30) + 64,
            batch: 2,
            max_seqlen_q: 200,
        };
        let check = |varlen: &FlashcoreVarlen, hq: *const i32, hk: *const i32| {
            // SAFETY: every pointer is null or points at a live local of 3 int32s.
            unsafe { flashcore_check_forward_varlen(&q, &k, &v, &o, 0, varlen, hq, hk, 0.0, 1) }
        };
        let (cu_q, cu_k) = ([0i32, 100, 300], [0i32, 250, 500]);
        assert_eq!(check(&varlen, ptr::null(), ptr::null()), FLASHCORE_SUCCESS);
        assert_eq!(
            check(&varlen, cu_q.as_ptr(), cu_k.as_ptr()),
            FLASHCORE_SUCCESS
        );
        // One host array without the other.
        assert_eq!(
            check(&varlen, cu_q.as_ptr(), ptr::null()),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        // A decreasing host offset, a negative count, a null varlen.
        let bad = [0i32, 100, 50];
        assert_eq!(
            check(&varlen, bad.as_ptr(), cu_k.as_ptr()),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        let negative = FlashcoreVarlen {
            batch: -1,
            ..varlen
        };
        assert_eq!(
            check(&negative, ptr::null(), ptr::null()),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            check(
                &FlashcoreVarlen { batch: 0, ..varlen },
                ptr::null(),
                ptr::null()
            ),
            FLASHCORE_ERROR_EMPTY_DIMENSION
        );
        // SAFETY: a null varlen is allowed and reported.
        let rc = unsafe {
            flashcore_check_forward_varlen(
                &q,
                &k,
                &v,
                &o,
                0,
                ptr::null(),
                ptr::null(),
                ptr::null(),
                0.0,
                0,
            )
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        // A batch past the grid limit with host arrays: the batch is what is reported,
        // with no slice made over entries the caller cannot have passed.
        for batch in [65536, 1 << 40, 1 << 61] {
            let huge = FlashcoreVarlen { batch, ..varlen };
            assert_eq!(
                check(&huge, cu_q.as_ptr(), cu_k.as_ptr()),
                FLASHCORE_ERROR_INVALID_ARGUMENT
            );
            // SAFETY: the message is a NUL-terminated string this thread owns.
            let msg = unsafe { CStr::from_ptr(flashcore_last_error()) }.to_string_lossy();
            assert!(msg.contains("grid limit"), "{batch}: {msg}");
        }
    }

    #[test]
    fn check_forward_varlen_window_takes_a_window_per_sequence() {
        let at = |ptr: u64, rows: i64, heads: i64| FlashcoreTensor {
            ptr,
            dtype: FLASHCORE_F16,
            shape: [1, rows, heads, 64],
            strides: [0, heads * 64, 64, 1],
        };
        let (q, k, v, o) = (
            at(1 << 30, 300, 8),
            at(2 << 30, 500, 2),
            at(3 << 30, 500, 2),
            at(4 << 30, 300, 8),
        );
        let varlen = FlashcoreVarlen {
            cu_seqlens_q: 5 << 30,
            cu_seqlens_k: (5 << 30) + 64,
            batch: 2,
            max_seqlen_q: 200,
        };
        let (cu_q, cu_k) = ([0i32, 100, 300], [0i32, 250, 500]);
        let check = |causal: i32, left: i64, right: i64| {
            // SAFETY: every pointer points at a live local; the host arrays hold 3 int32s.
            unsafe {
                flashcore_check_forward_varlen_window(
                    &q,
                    &k,
                    &v,
                    &o,
                    0,
                    &varlen,
                    cu_q.as_ptr(),
                    cu_k.as_ptr(),
                    0.0,
                    causal,
                    left,
                    right,
                )
            }
        };
        for (causal, left, right) in [(1, 15, 0), (1, 0, -1), (0, 50, 7), (0, -1, 3), (1, -1, -7)] {
            assert_eq!(
                check(causal, left, right),
                FLASHCORE_SUCCESS,
                "({causal}, {left}, {right}): {}",
                last_error()
            );
        }
        assert_eq!(check(1, 15, 1), FLASHCORE_ERROR_INVALID_ARGUMENT);
        let message = last_error();
        assert!(
            message.starts_with("flashcore_check_forward_varlen_window: ")
                && message.contains("right side"),
            "{message}"
        );
        // Without a window: flashcore_check_forward_varlen's answer.
        let bad = [0i32, 100, 50];
        for host_q in [cu_q, bad] {
            // SAFETY: as above.
            let plain = unsafe {
                flashcore_check_forward_varlen(
                    &q,
                    &k,
                    &v,
                    &o,
                    0,
                    &varlen,
                    host_q.as_ptr(),
                    cu_k.as_ptr(),
                    0.0,
                    1,
                )
            };
            // SAFETY: as above.
            let windowed = unsafe {
                flashcore_check_forward_varlen_window(
                    &q,
                    &k,
                    &v,
                    &o,
                    0,
                    &varlen,
                    host_q.as_ptr(),
                    cu_k.as_ptr(),
                    0.0,
                    1,
                    -1,
                    -1,
                )
            };
            assert_eq!(plain, windowed);
        }
    }

    #[test]
    fn null_pointers_are_null_argument() {
        let t = tensor(FLASHCORE_F16);
        // SAFETY: every pointer is null or points at a live local.
        let rc = unsafe {
            flashcore_forward(ptr::null_mut(), &t, &t, &t, &t, 0, 0.0, 0, ptr::null_mut())
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_forward: ctx is a null pointer");

        // SAFETY: a null `out` is allowed and must be reported, not written.
        let rc = unsafe { flashcore_create(0, ptr::null_mut()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_create: out is a null pointer");

        for name in ["q", "k", "v", "o"] {
            // SAFETY: a null tensor pointer is allowed and reported.
            let r = unsafe { read_tensor(ptr::null(), name) };
            let f = r.expect_err("null tensor accepted");
            assert_eq!(f.code, FLASHCORE_ERROR_NULL_ARGUMENT);
            assert_eq!(f.message, format!("{name} is a null pointer"));
        }
        // SAFETY: destroying null is a documented no-op.
        unsafe { flashcore_destroy(ptr::null_mut()) };
    }

    #[test]
    fn failures_set_the_message_and_success_keeps_it() {
        let rc = guard("flashcore_forward", || {
            // SAFETY: points at a live local.
            unsafe { read_tensor(&tensor(7), "k") }.map(drop)
        });
        assert_eq!(rc, FLASHCORE_ERROR_UNSUPPORTED_DTYPE);
        let msg = last_error();
        assert!(msg.starts_with("flashcore_forward: unsupported dtype: k has dtype code 7"));
        assert!(msg.contains("FLASHCORE_BF16 (2)"), "{msg}");
        assert_eq!(guard("flashcore_forward", || Ok(())), FLASHCORE_SUCCESS);
        assert_eq!(last_error(), msg);
        // Messages are per thread.
        let other = std::thread::spawn(last_error).join().unwrap();
        assert_eq!(other, "");
    }

    #[test]
    fn check_forward_applies_the_forward_rules_without_a_device() {
        let (q, k, v) = (
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
        );
        let mut o = tensor(FLASHCORE_F16);
        o.ptr = 0x10_0000; // past q, k and v, which share [0x1000, 0x11000)
        // SAFETY: every tensor pointer points at a live local.
        let check = |o: &FlashcoreTensor, lse: u64, scale: f32| unsafe {
            flashcore_check_forward(&q, &k, &v, o, lse, scale, 1)
        };
        assert_eq!(check(&o, 0, 0.0), FLASHCORE_SUCCESS, "{}", last_error());
        assert_eq!(check(&o, 0x20_0000, 0.125), FLASHCORE_SUCCESS);

        assert_eq!(check(&o, 0, f32::NAN), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(last_error().starts_with("flashcore_check_forward: "));
        assert_eq!(check(&o, 0x20_0002, 0.0), FLASHCORE_ERROR_MISALIGNED);
        let mut bad = o;
        bad.shape[3] = 48;
        assert_eq!(check(&bad, 0, 0.0), FLASHCORE_ERROR_SHAPE_MISMATCH);
        let mut overlapping = o;
        overlapping.ptr = 0x2000;
        assert_eq!(
            check(&overlapping, 0, 0.0),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("overlaps"), "{}", last_error());
        // SAFETY: a null tensor pointer is allowed and reported.
        let rc = unsafe { flashcore_check_forward(&q, ptr::null(), &v, &o, 0, 0.0, 0) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
    }

    #[test]
    fn check_forward_window_takes_flash_attention_windows() {
        let (q, k, v) = (
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
        );
        let mut o = tensor(FLASHCORE_F16);
        o.ptr = 0x10_0000; // past q, k and v, which share [0x1000, 0x11000)
        let check = |causal: i32, left: i64, right: i64| {
            // SAFETY: every tensor pointer points at a live local.
            unsafe { flashcore_check_forward_window(&q, &k, &v, &o, 0, 0.0, causal, left, right) }
        };
        // Sliding windows (causal, left = keys - 1), two-sided and one-sided windows, none.
        for (causal, left, right) in [
            (1, 15, 0),
            (1, 0, 0),
            (1, 100, -1),
            (0, 50, 7),
            (0, -1, 5),
            (0, 0, 0),
            (0, 1 << 40, 1 << 40),
            (1, -1, -1),
        ] {
            assert_eq!(
                check(causal, left, right),
                FLASHCORE_SUCCESS,
                "({causal}, {left}, {right}): {}",
                last_error()
            );
        }
        // Causal masking sees no key past the diagonal: a right side above 0 contradicts it.
        for right in [1, 7, i64::MAX] {
            assert_eq!(check(1, 15, right), FLASHCORE_ERROR_INVALID_ARGUMENT);
            let message = last_error();
            assert!(
                message.starts_with("flashcore_check_forward_window: ")
                    && message.contains("right side"),
                "{message}"
            );
        }
        // A negative side is unbounded, whatever its value: a causal call's right side too.
        for (left, right) in [(-1, -1), (-2, -5), (i64::MIN, i64::MIN), (15, -9)] {
            assert_eq!(
                check(1, left, right),
                FLASHCORE_SUCCESS,
                "({left}, {right}): {}",
                last_error()
            );
        }
        // Without a window the call is flashcore_check_forward's: the same code and
        // message (but for the name) on good and bad arguments alike.
        let mut d48 = o;
        d48.shape[3] = 48;
        let mut misaligned = o;
        misaligned.ptr += 2;
        for (o, scale) in [(o, 0.0), (o, f32::NAN), (d48, 0.0), (misaligned, 0.0)] {
            // SAFETY: every tensor pointer points at a live local.
            let plain = unsafe { flashcore_check_forward(&q, &k, &v, &o, 0, scale, 1) };
            let plain_message = last_error();
            // SAFETY: as above.
            let windowed =
                unsafe { flashcore_check_forward_window(&q, &k, &v, &o, 0, scale, 1, -1, -1) };
            assert_eq!(plain, windowed);
            if plain != FLASHCORE_SUCCESS {
                assert_eq!(
                    plain_message.strip_prefix("flashcore_check_forward: "),
                    last_error().strip_prefix("flashcore_check_forward_window: ")
                );
            }
        }
        // SAFETY: a null tensor pointer is allowed and reported.
        let rc =
            unsafe { flashcore_check_forward_window(&q, ptr::null(), &v, &o, 0, 0.0, 1, 15, 0) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_forward_window: k is a null pointer"
        );
    }

    #[test]
    fn window_calls_refuse_a_null_context() {
        let t = tensor(FLASHCORE_F16);
        let (q, c) = (query(1, 4, 4 * GB), cache(false));
        let o = FlashcoreTensor { ptr: 5 * GB, ..q };
        let (_, s) = fp8_cache(false);
        let varlen = FlashcoreVarlen {
            cu_seqlens_q: GB,
            cu_seqlens_k: 2 * GB,
            batch: 1,
            max_seqlen_q: 128,
        };
        let (null, stream) = (ptr::null(), ptr::null_mut());
        let refused = |rc: i32, name: &str| {
            assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT, "{name}");
            assert_eq!(last_error(), format!("{name}: ctx is a null pointer"));
        };
        // SAFETY: a null context is allowed and reported; the rest are live locals.
        let rc = unsafe {
            flashcore_forward_window(ptr::null_mut(), &t, &t, &t, &t, 0, 0.0, 1, 15, 0, stream)
        };
        refused(rc, "flashcore_forward_window");
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_forward_varlen_window(
                ptr::null_mut(),
                &t,
                &t,
                &t,
                &t,
                0,
                &varlen,
                null,
                null,
                0.0,
                1,
                15,
                0,
                stream,
            )
        };
        refused(rc, "flashcore_forward_varlen_window");
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_decode_window(
                ptr::null_mut(),
                &q,
                &c,
                null,
                null,
                &o,
                0,
                0.0,
                1,
                15,
                0,
                0,
                0,
                stream,
            )
        };
        refused(rc, "flashcore_decode_window");
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_decode_fp8kv_window(
                ptr::null_mut(),
                &q,
                &c,
                &s,
                null,
                null,
                &o,
                0,
                0.0,
                1,
                15,
                0,
                0,
                0,
                stream,
            )
        };
        refused(rc, "flashcore_decode_fp8kv_window");
    }

    const GB: u64 = 1 << 30;

    /// A contiguous f16 `[B, S, H, D]` tensor at `ptr`.
    fn bshd(ptr: u64, [b, s, h, d]: [i64; 4]) -> FlashcoreTensor {
        FlashcoreTensor {
            ptr,
            dtype: FLASHCORE_F16,
            shape: [b, s, h, d],
            strides: [s * h * d, h * d, d, 1],
        }
    }

    /// Two sequences of capacity 64, 2 KV heads of 64: contiguous, or paged by 16 over a
    /// pool of 8 pages (block table `[2, 4]`).
    fn cache(paged: bool) -> FlashcoreKvCache {
        let shape = if paged {
            [8, 16, 2, 64]
        } else {
            [2, 64, 2, 64]
        };
        FlashcoreKvCache {
            k: bshd(GB, shape),
            v: bshd(2 * GB, shape),
            seqlens: 3 * GB,
            block_table: if paged { 3 * GB + 4096 } else { 0 },
            max_pages: if paged { 4 } else { 0 },
            table_stride: if paged { 4 } else { 0 },
        }
    }

    /// `q` (and `o`) of a decode on [`cache`]: `[2, sq, hq, 64]`.
    fn query(sq: i64, hq: i64, at: u64) -> FlashcoreTensor {
        bshd(at, [2, sq, hq, 64])
    }

    /// flashcore_check_decode on `q` (its `o` at 5 GB) and `c`, with host arrays.
    fn check_decode(
        q: &FlashcoreTensor,
        c: &FlashcoreKvCache,
        lens: Option<&[i32]>,
        table: Option<&[i32]>,
        lse: u64,
        scale: f32,
    ) -> i32 {
        let o = FlashcoreTensor { ptr: 5 * GB, ..*q };
        let ptr_of = |a: Option<&[i32]>| a.map_or(ptr::null(), <[i32]>::as_ptr);
        // SAFETY: every struct pointer points at a live local; the host arrays are null or
        // live slices, which the callers size for the batch and the table.
        unsafe { flashcore_check_decode(q, c, ptr_of(lens), ptr_of(table), &o, lse, scale, 1) }
    }

    #[test]
    fn check_decode_applies_the_decode_rules_without_a_device() {
        let q = query(1, 4, 4 * GB);
        let table: Vec<i32> = (0..8).collect();
        for paged in [false, true] {
            let c = cache(paged);
            let t = paged.then_some(table.as_slice());
            assert_eq!(
                check_decode(&q, &c, None, None, 0, 0.0),
                FLASHCORE_SUCCESS,
                "{}",
                last_error()
            );
            assert_eq!(
                check_decode(&q, &c, Some(&[64, 0]), t, 6 * GB, 0.25),
                FLASHCORE_SUCCESS
            );
            assert_eq!(
                check_decode(&query(16, 8, 4 * GB), &c, None, None, 0, 0.0),
                FLASHCORE_SUCCESS
            );
        }
        let c = cache(true);
        let code =
            |q: &FlashcoreTensor, c: &FlashcoreKvCache| check_decode(q, c, None, None, 0, 0.0);

        // A long prompt chunk passes: the decode kernels' grid is their plan's to apply,
        // where they take the call.
        assert_eq!(
            code(&query(600_000, 4, 4 * GB), &c),
            FLASHCORE_SUCCESS,
            "{}",
            last_error()
        );
        // One typed code for each kind of bad input.
        assert_eq!(
            check_decode(&q, &c, None, None, 0, -1.0),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().starts_with("flashcore_check_decode: "),
            "{}",
            last_error()
        );
        assert_eq!(code(&query(1, 3, 4 * GB), &c), FLASHCORE_ERROR_HEAD_RATIO);
        assert_eq!(
            code(&query(1, 4, 4 * GB + 8), &c),
            FLASHCORE_ERROR_MISALIGNED
        );
        assert_eq!(
            code(&bshd(4 * GB, [3, 1, 4, 64]), &cache(false)),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        // 264: no kernel (80 runs the 96 one padded).
        let mut d264 = cache(false);
        d264.k.shape[3] = 264;
        d264.v.shape[3] = 264;
        assert_eq!(
            code(&bshd(4 * GB, [2, 1, 4, 264]), &d264),
            FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM
        );
        let mut bf = c;
        bf.v.dtype = FLASHCORE_BF16;
        assert_eq!(code(&q, &bf), FLASHCORE_ERROR_UNSUPPORTED_DTYPE);
        let mut odd = c;
        odd.k.shape[1] = 48;
        odd.v.shape[1] = 48;
        assert_eq!(code(&q, &odd), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("power of two"), "{}", last_error());
        let mut no_table = c;
        no_table.block_table = 0;
        assert_eq!(code(&q, &no_table), FLASHCORE_ERROR_NULL_POINTER);
        assert!(
            last_error().contains("block_table is a null pointer"),
            "{}",
            last_error()
        );
        let mut no_pages = c;
        no_pages.max_pages = 0;
        assert_eq!(code(&q, &no_pages), FLASHCORE_ERROR_EMPTY_DIMENSION);
        let mut short = c;
        short.table_stride = 3;
        assert_eq!(code(&q, &short), FLASHCORE_ERROR_BAD_STRIDES);
        let mut negative = c;
        negative.max_pages = -4;
        assert_eq!(code(&q, &negative), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("max_pages is -4"), "{}", last_error());
        negative = c;
        negative.table_stride = -4;
        assert_eq!(code(&q, &negative), FLASHCORE_ERROR_BAD_STRIDES);
        let mut no_lens = c;
        no_lens.seqlens = 0;
        assert_eq!(code(&q, &no_lens), FLASHCORE_ERROR_NULL_POINTER);
        no_lens.seqlens = 3 * GB + 2;
        assert_eq!(code(&q, &no_lens), FLASHCORE_ERROR_MISALIGNED);
        let mut empty = c;
        empty.k.shape[2] = 0;
        empty.v.shape[2] = 0;
        assert_eq!(code(&q, &empty), FLASHCORE_ERROR_EMPTY_DIMENSION);
        let mut dtype = c;
        dtype.k.dtype = 9;
        assert_eq!(code(&q, &dtype), FLASHCORE_ERROR_UNSUPPORTED_DTYPE);
        assert!(
            last_error().contains("k_cache has dtype code 9"),
            "{}",
            last_error()
        );
        assert_eq!(
            check_decode(&q, &c, None, None, 0, f32::NAN),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            check_decode(&q, &c, None, None, 6 * GB + 1, 0.0),
            FLASHCORE_ERROR_MISALIGNED
        );
        // The output may not overlap the cache.
        let o_in_cache = FlashcoreTensor { ptr: GB, ..q };
        let oc = |o: &FlashcoreTensor| {
            // SAFETY: every pointer points at a live local or is null.
            unsafe { flashcore_check_decode(&q, &c, ptr::null(), ptr::null(), o, 0, 0.0, 0) }
        };
        assert_eq!(oc(&o_in_cache), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("overlaps"), "{}", last_error());
        // Null structs.
        // SAFETY: null struct pointers are allowed and reported.
        let rc = unsafe {
            flashcore_check_decode(&q, ptr::null(), ptr::null(), ptr::null(), &q, 0, 0.0, 0)
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_decode: cache is a null pointer"
        );
        assert_eq!(oc(&o_in_cache), FLASHCORE_ERROR_INVALID_ARGUMENT);
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_check_decode(ptr::null(), &c, ptr::null(), ptr::null(), &q, 0, 0.0, 0)
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_check_decode: q is a null pointer");
    }

    #[test]
    fn host_metadata_is_checked_when_given() {
        let q = query(1, 4, 4 * GB);
        let (paged, contiguous) = (cache(true), cache(false));
        let table: Vec<i32> = (0..8).collect();
        let check = |c: &FlashcoreKvCache, lens: Option<&[i32]>, t: Option<&[i32]>| {
            check_decode(&q, c, lens, t, 0, 0.0)
        };
        assert_eq!(
            check(&paged, Some(&[64, 1]), Some(&table)),
            FLASHCORE_SUCCESS
        );
        assert_eq!(check(&contiguous, Some(&[64, 1]), None), FLASHCORE_SUCCESS);
        // A length past the capacity, or negative.
        assert_eq!(
            check(&paged, Some(&[65, 1]), Some(&table)),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("capacity"), "{}", last_error());
        assert_eq!(
            check(&contiguous, Some(&[-1, 1]), None),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        // A page outside the pool, in reach of a length; one past it is not looked at.
        let mut bad = table.clone();
        bad[5] = 8;
        assert_eq!(
            check(&paged, Some(&[64, 17]), Some(&bad)),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("outside the pool"),
            "{}",
            last_error()
        );
        assert_eq!(
            check(&paged, Some(&[64, 16]), Some(&bad)),
            FLASHCORE_SUCCESS
        );
        // Inconsistent host pointers.
        assert_eq!(
            check(&paged, Some(&[1, 1]), None),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("block table"), "{}", last_error());
        assert_eq!(
            check(&paged, None, Some(&table)),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("without host_seqlens"),
            "{}",
            last_error()
        );
        assert_eq!(
            check(&contiguous, Some(&[1, 1]), Some(&table)),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("contiguous"), "{}", last_error());
        // A host array not aligned for int32 is refused before it is read.
        let words = [0u32; 4];
        let unaligned = words.as_ptr().cast::<u8>().wrapping_add(1).cast::<i32>();
        let o = FlashcoreTensor { ptr: 5 * GB, ..q };
        // SAFETY: the structs are live locals; the misaligned host pointer is refused
        // before anything is read through it.
        let rc = unsafe {
            flashcore_check_decode(&q, &contiguous, unaligned, ptr::null(), &o, 0, 0.0, 0)
        };
        assert_eq!(rc, FLASHCORE_ERROR_MISALIGNED);
        assert!(last_error().contains("host_seqlens"), "{}", last_error());
    }

    #[test]
    fn check_append_applies_the_append_rules_without_a_device() {
        let table: Vec<i32> = (0..8).collect();
        let new = bshd(4 * GB, [2, 3, 2, 64]);
        let vnew = FlashcoreTensor { ptr: 5 * GB, ..new };
        let check = |c: &FlashcoreKvCache,
                     k: &FlashcoreTensor,
                     v: &FlashcoreTensor,
                     lens: Option<&[i32]>,
                     t: Option<&[i32]>| {
            let p = |a: Option<&[i32]>| a.map_or(ptr::null(), <[i32]>::as_ptr);
            // SAFETY: the structs are live locals; the host arrays null or sized for B = 2
            // and the [2, 4] table.
            unsafe { flashcore_check_append_kv(c, k, v, p(lens), p(t)) }
        };
        for paged in [false, true] {
            let c = cache(paged);
            let t = paged.then_some(table.as_slice());
            assert_eq!(
                check(&c, &new, &vnew, None, None),
                FLASHCORE_SUCCESS,
                "{}",
                last_error()
            );
            assert_eq!(check(&c, &new, &vnew, Some(&[61, 0]), t), FLASHCORE_SUCCESS);
            // 62 + 3 new tokens pass the capacity of 64.
            assert_eq!(
                check(&c, &new, &vnew, Some(&[62, 0]), t),
                FLASHCORE_ERROR_INVALID_ARGUMENT
            );
            assert!(
                last_error().starts_with("flashcore_check_append_kv: "),
                "{}",
                last_error()
            );
        }
        let c = cache(true);
        let heads = bshd(4 * GB, [2, 3, 4, 64]);
        let vheads = FlashcoreTensor {
            ptr: 5 * GB,
            ..heads
        };
        assert_eq!(
            check(&c, &heads, &vheads, None, None),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        let into_cache = FlashcoreTensor {
            ptr: GB + 64,
            ..new
        };
        assert_eq!(
            check(&c, &into_cache, &vnew, None, None),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("overlaps"), "{}", last_error());
        let bf = FlashcoreTensor {
            dtype: FLASHCORE_BF16,
            ..vnew
        };
        assert_eq!(
            check(&c, &new, &bf, None, None),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        let too_many = bshd(4 * GB, [2, 65, 2, 64]);
        let vtoo_many = FlashcoreTensor {
            ptr: 5 * GB,
            ..too_many
        };
        assert_eq!(
            check(&c, &too_many, &vtoo_many, None, None),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        let mut strided = new;
        strided.strides[3] = 2;
        assert_eq!(
            check(&c, &strided, &vnew, None, None),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        // SAFETY: null struct pointers are allowed and reported.
        let rc =
            unsafe { flashcore_check_append_kv(&c, &new, ptr::null(), ptr::null(), ptr::null()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_append_kv: v_new is a null pointer"
        );
    }

    /// [`cache`] holding e4m3 codes (rows of 64 codes: 64-byte strides), with its scales:
    /// f32 `[outer, rows, 2, 1]` at 6 GB (keys) and 7 GB (values).
    fn fp8_cache(paged: bool) -> (FlashcoreKvCache, FlashcoreKvScales) {
        let mut c = cache(paged);
        c.k.dtype = FLASHCORE_E4M3;
        c.v.dtype = FLASHCORE_E4M3;
        let [outer, rows, heads, _] = c.k.shape;
        let scale = |ptr| FlashcoreTensor {
            ptr,
            dtype: FLASHCORE_F32,
            shape: [outer, rows, heads, 1],
            strides: [rows * heads, heads, 1, 1],
        };
        let scales = FlashcoreKvScales {
            k_scale: scale(6 * GB),
            v_scale: scale(7 * GB),
        };
        (c, scales)
    }

    /// flashcore_check_decode_fp8kv on `q` (its `o` at 5 GB, causal), `c` and `s` (None:
    /// a null pointer), with host arrays.
    fn check_decode8(
        q: &FlashcoreTensor,
        c: &FlashcoreKvCache,
        s: Option<&FlashcoreKvScales>,
        lens: Option<&[i32]>,
        table: Option<&[i32]>,
    ) -> i32 {
        let o = FlashcoreTensor { ptr: 5 * GB, ..*q };
        let ptr_of = |a: Option<&[i32]>| a.map_or(ptr::null(), <[i32]>::as_ptr);
        let s = s.map_or(ptr::null(), ptr::from_ref);
        // SAFETY: every struct pointer points at a live local or is null; the host arrays
        // are null or live slices, which the callers size for the batch and the table.
        unsafe { flashcore_check_decode_fp8kv(q, c, s, ptr_of(lens), ptr_of(table), &o, 0, 0.0, 1) }
    }

    #[test]
    fn check_decode_fp8kv_takes_an_e4m3_cache_with_its_scales() {
        let table: Vec<i32> = (0..8).collect();
        for paged in [false, true] {
            let (c, s) = fp8_cache(paged);
            let t = paged.then_some(table.as_slice());
            for dtype in [FLASHCORE_F16, FLASHCORE_BF16] {
                let q = FlashcoreTensor {
                    dtype,
                    ..query(1, 4, 4 * GB)
                };
                assert_eq!(
                    check_decode8(&q, &c, Some(&s), None, None),
                    FLASHCORE_SUCCESS,
                    "{}",
                    last_error()
                );
                assert_eq!(
                    check_decode8(&q, &c, Some(&s), Some(&[64, 0]), t),
                    FLASHCORE_SUCCESS,
                    "{}",
                    last_error()
                );
                // Host metadata is checked as for a 16-bit cache.
                assert_eq!(
                    check_decode8(&q, &c, Some(&s), Some(&[65, 0]), t),
                    FLASHCORE_ERROR_INVALID_ARGUMENT
                );
                assert!(last_error().contains("capacity"), "{}", last_error());
            }
            assert_eq!(
                check_decode8(&query(16, 8, 4 * GB), &c, Some(&s), None, None),
                FLASHCORE_SUCCESS
            );
            // Scales sliced out of a wider tensor (free strides) are fine.
            let mut wide = s;
            let rows = wide.k_scale.shape[1];
            wide.k_scale.strides = [rows * 16, 16, 1, 1];
            wide.v_scale.strides = [rows * 16, 16, 1, 1];
            assert_eq!(
                check_decode8(&query(1, 4, 4 * GB), &c, Some(&wide), None, None),
                FLASHCORE_SUCCESS,
                "{}",
                last_error()
            );
        }
    }

    #[test]
    fn check_decode_fp8kv_refuses_missing_and_ill_shaped_scales_with_typed_codes() {
        let q = query(1, 4, 4 * GB);
        let (c8, s) = fp8_cache(true);
        let code = |c: &FlashcoreKvCache, s: Option<&FlashcoreKvScales>| {
            check_decode8(&q, c, s, None, None)
        };

        // An e4m3 cache without scales: the Rust API's error, from either spelling.
        assert_eq!(code(&c8, None), FLASHCORE_ERROR_INVALID_ARGUMENT);
        let message = last_error();
        assert!(
            message.starts_with("flashcore_check_decode_fp8kv: ") && message.contains("scales"),
            "{message}"
        );
        assert_eq!(
            check_decode(&q, &c8, None, None, 0, 0.0),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            last_error().strip_prefix("flashcore_check_decode: "),
            message.strip_prefix("flashcore_check_decode_fp8kv: ")
        );
        // Scales with a 16-bit cache.
        assert_eq!(
            code(&cache(true), Some(&s)),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("e4m3"), "{}", last_error());

        // One typed code for each kind of bad scales.
        let with = |f: &dyn Fn(&mut FlashcoreKvScales)| {
            let mut s = s;
            f(&mut s);
            code(&c8, Some(&s))
        };
        assert_eq!(
            with(&|s| s.k_scale.dtype = FLASHCORE_F16),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert!(last_error().contains("k_scale"), "{}", last_error());
        assert_eq!(
            with(&|s| s.v_scale.dtype = 9),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert!(
            last_error().contains("v_scale has dtype code 9"),
            "{}",
            last_error()
        );
        assert_eq!(
            with(&|s| s.v_scale.shape[1] = 8),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        assert!(last_error().contains("v_scale"), "{}", last_error());
        assert_eq!(
            with(&|s| s.k_scale.shape[3] = 64),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        assert_eq!(
            with(&|s| s.k_scale.shape[2] = 1),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        assert_eq!(
            with(&|s| s.k_scale.shape[0] = -1),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("k_scale.shape[0] (batch) is -1"),
            "{}",
            last_error()
        );
        assert_eq!(
            with(&|s| s.v_scale.strides[1] = -2),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        // Repeated scales (zero strides) are read by a decode.
        assert_eq!(
            with(&|s| s.k_scale.strides = [0, 0, 1, 1]),
            FLASHCORE_SUCCESS
        );
        assert_eq!(
            with(&|s| s.v_scale.strides = [0, 0, 0, 0]),
            FLASHCORE_SUCCESS
        );
        assert_eq!(with(&|s| s.k_scale.ptr += 2), FLASHCORE_ERROR_MISALIGNED);
        assert_eq!(with(&|s| s.v_scale.ptr = 0), FLASHCORE_ERROR_NULL_POINTER);
        assert!(last_error().contains("v_scale"), "{}", last_error());
        // Scales inside the codes, or on each other (one tensor for K and V): a decode
        // only reads them.
        assert_eq!(with(&|s| s.k_scale.ptr = GB + 64), FLASHCORE_SUCCESS);
        assert_eq!(with(&|s| s.v_scale = s.k_scale), FLASHCORE_SUCCESS);
        // The output may not overlap the scales.
        let o = FlashcoreTensor { ptr: 6 * GB, ..q };
        // SAFETY: every pointer points at a live local or is null.
        let rc = unsafe {
            flashcore_check_decode_fp8kv(&q, &c8, &s, ptr::null(), ptr::null(), &o, 0, 0.0, 0)
        };
        assert_eq!(rc, FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(last_error().contains("k_scale"), "{}", last_error());

        // An e4m3 cache's own rules: its head dims, 16-bit queries, codes of one type.
        let (mut d96, mut s96) = fp8_cache(false);
        for t in [&mut d96.k, &mut d96.v] {
            *t = FlashcoreTensor {
                dtype: FLASHCORE_E4M3,
                ..bshd(t.ptr, [2, 64, 2, 96])
            };
        }
        s96.k_scale.shape = [2, 64, 2, 1];
        s96.v_scale.shape = [2, 64, 2, 1];
        assert_eq!(
            check_decode8(&bshd(4 * GB, [2, 1, 4, 96]), &d96, Some(&s96), None, None),
            FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM
        );
        let q8 = FlashcoreTensor {
            dtype: FLASHCORE_E4M3,
            ..q
        };
        assert_eq!(
            check_decode8(&q8, &c8, Some(&s), None, None),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        let mut mixed = c8;
        mixed.v.dtype = FLASHCORE_F16;
        assert_eq!(code(&mixed, Some(&s)), FLASHCORE_ERROR_UNSUPPORTED_DTYPE);
    }

    #[test]
    fn the_fp8kv_spellings_without_scales_are_the_16_bit_calls() {
        // The same code and message (but for the name) as the plain calls, on good and bad
        // 16-bit input alike.
        let table: Vec<i32> = (0..8).collect();
        let q = query(1, 4, 4 * GB);
        let mut odd = cache(true);
        odd.k.shape[1] = 48;
        odd.v.shape[1] = 48;
        let mut no_lens = cache(false);
        no_lens.seqlens = 0;
        let (lens_ok, lens_over, t): (&[i32], &[i32], &[i32]) = (&[64, 3], &[65, 3], &table);
        let cases = [
            (q, cache(false), None, None),
            (q, cache(true), Some(lens_ok), Some(t)),
            (q, cache(true), Some(lens_over), Some(t)),
            (query(17, 4, 4 * GB), cache(false), None, None),
            (q, odd, None, None),
            (q, no_lens, None, None),
        ];
        let strip = |m: String, name: &str| m.strip_prefix(name).map(str::to_owned);
        for (q, c, lens, t) in cases {
            let plain = check_decode(&q, &c, lens, t, 0, 0.0);
            let plain_msg = strip(last_error(), "flashcore_check_decode: ");
            let kv8 = check_decode8(&q, &c, None, lens, t);
            let kv8_msg = strip(last_error(), "flashcore_check_decode_fp8kv: ");
            assert_eq!(plain, kv8, "{c:?}");
            if plain != FLASHCORE_SUCCESS {
                assert_eq!(plain_msg, kv8_msg);
            }
        }
        let new = bshd(4 * GB, [2, 3, 2, 64]);
        let vnew = FlashcoreTensor { ptr: 5 * GB, ..new };
        let heads = bshd(4 * GB, [2, 3, 4, 64]);
        for (c, k, lens) in [
            (cache(false), new, None),
            (cache(false), new, Some([62, 0])),
            (cache(false), heads, None),
        ] {
            let lens = lens.as_ref().map_or(ptr::null(), |l| l.as_ptr());
            // SAFETY: the structs are live locals; `lens` null or two int32s (B = 2).
            let plain = unsafe { flashcore_check_append_kv(&c, &k, &vnew, lens, ptr::null()) };
            // SAFETY: as above; null scales.
            let kv8 = unsafe {
                flashcore_check_append_kv_fp8kv(&c, ptr::null(), &k, &vnew, lens, ptr::null())
            };
            assert_eq!(plain, kv8);
        }
    }

    #[test]
    fn decode_windows_resolve_as_flash_attention_reads_them() {
        // [2, 4, 4, 64] queries on a contiguous cache of capacity 64: what the call runs.
        let q = query(4, 4, 4 * GB);
        let (o, c) = (FlashcoreTensor { ptr: 5 * GB, ..q }, cache(false));
        let read = |causal: i32, left: i64, right: i64| {
            // SAFETY: every struct pointer points at a live local; no scales, no host
            // arrays.
            let call = unsafe {
                DecodeCall::read(
                    &q,
                    &c,
                    ptr::null(),
                    ptr::null(),
                    ptr::null(),
                    &o,
                    0,
                    &FlashcoreAttentionOptions::uncapped(0.0, causal, left, right),
                )
            };
            call.map(|call| (call.problem.causal, call.problem.window))
                .map_err(|f| f.code)
        };
        let window = |left, right| Some(KeyWindow { left, right });
        // No window: any negative sides.
        for (left, right) in [(-1, -1), (i64::MIN, -3)] {
            assert_eq!(read(0, left, right), Ok((false, None)));
            assert_eq!(read(1, left, right), Ok((true, None)));
        }
        // A right side of 0 is causal masking; a negative one under causal masking too.
        assert_eq!(read(0, -1, 0), Ok((true, None)));
        assert_eq!(read(1, -1, -9), Ok((true, None)));
        // Sliding windows, and windows on one side or both.
        assert_eq!(read(1, 15, 0), Ok((true, window(15, 0))));
        assert_eq!(read(1, 15, -1), Ok((true, window(15, 0))));
        assert_eq!(read(0, 3, -1), Ok((true, window(3, WINDOW_UNBOUNDED))));
        assert_eq!(read(0, -1, 2), Ok((true, window(WINDOW_UNBOUNDED, 2))));
        assert_eq!(read(0, 0, 0), Ok((true, window(0, 0))));
        // A side no row of these shapes reaches bounds nothing: the capacity's 64 keys to
        // the left, the 4 queries to the right.
        assert_eq!(read(1, 64, 0), Ok((true, None)));
        assert_eq!(read(0, 1 << 40, 4), Ok((false, None)));
        assert_eq!(read(0, 63, 4), Ok((true, window(63, WINDOW_UNBOUNDED))));
        // Causal masking with keys past the diagonal.
        assert_eq!(read(1, 15, 1), Err(FLASHCORE_ERROR_INVALID_ARGUMENT));
    }

    #[test]
    fn check_decode_window_spellings_take_a_window() {
        let table: Vec<i32> = (0..8).collect();
        let (q16, q1) = (query(16, 8, 4 * GB), query(1, 4, 4 * GB));
        let check = |q: &FlashcoreTensor,
                     c: &FlashcoreKvCache,
                     s: Option<&FlashcoreKvScales>,
                     lens: Option<&[i32]>,
                     t: Option<&[i32]>,
                     (causal, left, right): (i32, i64, i64)| {
            let o = FlashcoreTensor { ptr: 5 * GB, ..*q };
            let p = |a: Option<&[i32]>| a.map_or(ptr::null(), <[i32]>::as_ptr);
            // SAFETY: every struct pointer points at a live local or is null; the host
            // arrays are null or sized for B = 2 and the [2, 4] table.
            unsafe {
                match s {
                    None => flashcore_check_decode_window(
                        q,
                        c,
                        p(lens),
                        p(t),
                        &o,
                        0,
                        0.0,
                        causal,
                        left,
                        right,
                    ),
                    Some(s) => flashcore_check_decode_fp8kv_window(
                        q,
                        c,
                        s,
                        p(lens),
                        p(t),
                        &o,
                        0,
                        0.0,
                        causal,
                        left,
                        right,
                    ),
                }
            }
        };
        for paged in [false, true] {
            let t = paged.then_some(table.as_slice());
            let (c8, s8) = fp8_cache(paged);
            for (c, s) in [(cache(paged), None), (c8, Some(&s8))] {
                let name = if s.is_some() {
                    "flashcore_check_decode_fp8kv_window: "
                } else {
                    "flashcore_check_decode_window: "
                };
                for q in [&q1, &q16] {
                    for window in [(1, 15, 0), (1, 0, -1), (0, 7, 3), (0, -1, -1), (1, -4, -4)] {
                        assert_eq!(
                            check(q, &c, s, None, None, window),
                            FLASHCORE_SUCCESS,
                            "{window:?}: {}",
                            last_error()
                        );
                        assert_eq!(
                            check(q, &c, s, Some(&[64, 3]), t, window),
                            FLASHCORE_SUCCESS
                        );
                    }
                    assert_eq!(
                        check(q, &c, s, None, None, (1, 15, 2)),
                        FLASHCORE_ERROR_INVALID_ARGUMENT
                    );
                    let message = last_error();
                    assert!(
                        message.starts_with(name) && message.contains("right side"),
                        "{message}"
                    );
                }
                // The other rules apply as to the plain call: host lengths past the
                // capacity.
                assert_eq!(
                    check(&q1, &c, s, Some(&[65, 3]), t, (1, 15, 0)),
                    FLASHCORE_ERROR_INVALID_ARGUMENT
                );
                assert!(last_error().contains("capacity"), "{}", last_error());
            }
        }
        // Without a window each is its plain spelling, on good and bad input alike.
        let mut odd = cache(true);
        odd.k.shape[1] = 48;
        odd.v.shape[1] = 48;
        for (q, c) in [
            (q1, cache(false)),
            (query(17, 4, 4 * GB), cache(false)),
            (q1, odd),
        ] {
            let plain = check_decode(&q, &c, None, None, 0, 0.0);
            let plain_message = last_error();
            let windowed = check(&q, &c, None, None, None, (1, -1, -1));
            assert_eq!(plain, windowed);
            if plain != FLASHCORE_SUCCESS {
                assert_eq!(
                    plain_message.strip_prefix("flashcore_check_decode: "),
                    last_error().strip_prefix("flashcore_check_decode_window: ")
                );
            }
        }
    }

    #[test]
    fn check_append_fp8kv_quantizes_16_bit_tokens_into_an_e4m3_cache() {
        let table: Vec<i32> = (0..8).collect();
        let check = |c: &FlashcoreKvCache,
                     s: Option<&FlashcoreKvScales>,
                     k: &FlashcoreTensor,
                     v: &FlashcoreTensor,
                     lens: Option<&[i32]>,
                     t: Option<&[i32]>| {
            let p = |a: Option<&[i32]>| a.map_or(ptr::null(), <[i32]>::as_ptr);
            let s = s.map_or(ptr::null(), ptr::from_ref);
            // SAFETY: the structs are live locals or null; the host arrays null or sized
            // for B = 2 and the [2, 4] table.
            unsafe { flashcore_check_append_kv_fp8kv(c, s, k, v, p(lens), p(t)) }
        };
        let new = |dtype| FlashcoreTensor {
            dtype,
            ..bshd(4 * GB, [2, 3, 2, 64])
        };
        let vnew = |dtype| FlashcoreTensor {
            ptr: 5 * GB,
            ..new(dtype)
        };
        for paged in [false, true] {
            let (c, s) = fp8_cache(paged);
            let t = paged.then_some(table.as_slice());
            for dt in [FLASHCORE_F16, FLASHCORE_BF16] {
                assert_eq!(
                    check(&c, Some(&s), &new(dt), &vnew(dt), None, None),
                    FLASHCORE_SUCCESS,
                    "{}",
                    last_error()
                );
                assert_eq!(
                    check(&c, Some(&s), &new(dt), &vnew(dt), Some(&[61, 0]), t),
                    FLASHCORE_SUCCESS
                );
            }
            // 62 + 3 new tokens pass the capacity of 64.
            assert_eq!(
                check(&c, Some(&s), &new(1), &vnew(1), Some(&[62, 0]), t),
                FLASHCORE_ERROR_INVALID_ARGUMENT
            );
            assert!(
                last_error().starts_with("flashcore_check_append_kv_fp8kv: "),
                "{}",
                last_error()
            );
        }
        let (c, s) = fp8_cache(true);
        let f16 = FLASHCORE_F16;
        // An append writes a scale per (position, head): repeated ones are refused, and
        // scales sharing memory with each other or the codes.
        let v_strides = |strides| FlashcoreKvScales {
            v_scale: FlashcoreTensor {
                strides,
                ..s.v_scale
            },
            ..s
        };
        let k_inside_v = FlashcoreKvScales {
            k_scale: FlashcoreTensor {
                ptr: c.v.ptr + 64,
                ..s.k_scale
            },
            ..s
        };
        let shared = FlashcoreKvScales {
            v_scale: s.k_scale,
            ..s
        };
        for (scales, code, words) in [
            (
                v_strides([0, 0, 1, 1]),
                FLASHCORE_ERROR_BAD_STRIDES,
                "v_scale",
            ),
            (
                v_strides([0, 0, 0, 0]),
                FLASHCORE_ERROR_BAD_STRIDES,
                "v_scale",
            ),
            (shared, FLASHCORE_ERROR_INVALID_ARGUMENT, "overlaps"),
            (k_inside_v, FLASHCORE_ERROR_INVALID_ARGUMENT, "overlaps"),
        ] {
            assert_eq!(
                check(&c, Some(&scales), &new(f16), &vnew(f16), None, None),
                code
            );
            assert!(last_error().contains(words), "{}", last_error());
        }
        // New tokens of one 16-bit dtype only.
        for (k, v) in [
            (FLASHCORE_E4M3, FLASHCORE_E4M3),
            (FLASHCORE_F16, FLASHCORE_BF16),
            (FLASHCORE_F32, FLASHCORE_F32),
        ] {
            assert_eq!(
                check(&c, Some(&s), &new(k), &vnew(v), None, None),
                FLASHCORE_ERROR_UNSUPPORTED_DTYPE
            );
        }
        // Missing scales, from either spelling; scales with a 16-bit cache.
        assert_eq!(
            check(&c, None, &new(f16), &vnew(f16), None, None),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("scales"), "{}", last_error());
        // SAFETY: the structs are live locals.
        let rc = unsafe {
            flashcore_check_append_kv(&c, &new(f16), &vnew(f16), ptr::null(), ptr::null())
        };
        assert_eq!(rc, FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert_eq!(
            check(&cache(true), Some(&s), &new(f16), &vnew(f16), None, None),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        // Ill-shaped scales; new tokens onto the scales they are about to write.
        let mut short = s;
        short.k_scale.shape[1] = 8;
        assert_eq!(
            check(&c, Some(&short), &new(f16), &vnew(f16), None, None),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        let onto = FlashcoreTensor {
            ptr: 7 * GB,
            ..vnew(f16)
        };
        assert_eq!(
            check(&c, Some(&s), &new(f16), &onto, None, None),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("v_scale"), "{}", last_error());
        // SAFETY: a null cache is allowed and reported, whatever the scales.
        let rc = unsafe {
            flashcore_check_append_kv_fp8kv(
                ptr::null(),
                &s,
                &new(f16),
                &vnew(f16),
                ptr::null(),
                ptr::null(),
            )
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_append_kv_fp8kv: cache is a null pointer"
        );
    }

    #[test]
    fn fp8kv_calls_refuse_a_null_context_and_null_out() {
        let q = query(1, 4, 4 * GB);
        let (c, s) = fp8_cache(false);
        let o = FlashcoreTensor { ptr: 5 * GB, ..q };
        let null = ptr::null();
        // SAFETY: a null context is allowed and reported; the rest are live locals.
        let rc = unsafe {
            flashcore_decode_fp8kv(
                ptr::null_mut(),
                &q,
                &c,
                &s,
                null,
                null,
                &o,
                0,
                0.0,
                0,
                0,
                0,
                ptr::null_mut(),
            )
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_decode_fp8kv: ctx is a null pointer"
        );
        let new = bshd(4 * GB, [2, 3, 2, 64]);
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_append_kv_fp8kv(
                ptr::null_mut(),
                &c,
                &s,
                &new,
                &o,
                null,
                null,
                ptr::null_mut(),
            )
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_append_kv_fp8kv: ctx is a null pointer"
        );
        let mut bytes = 7usize;
        // SAFETY: as above; `bytes` is a live local.
        let rc = unsafe {
            flashcore_decode_workspace_bytes_fp8kv(ptr::null_mut(), &q, &c, &s, &mut bytes)
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(bytes, 0, "out not cleared on failure");
        assert_eq!(
            last_error(),
            "flashcore_decode_workspace_bytes_fp8kv: ctx is a null pointer"
        );
        // SAFETY: a null `out` is allowed and reported, not written.
        let rc = unsafe {
            flashcore_decode_workspace_bytes_fp8kv(ptr::null_mut(), &q, &c, &s, ptr::null_mut())
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_decode_workspace_bytes_fp8kv: out is a null pointer"
        );
    }

    #[test]
    fn kv_scales_conversion_and_c_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<FlashcoreKvScales>(), 160);
        assert_eq!(align_of::<FlashcoreKvScales>(), 8);
        assert_eq!(offset_of!(FlashcoreKvScales, k_scale), 0);
        assert_eq!(offset_of!(FlashcoreKvScales, v_scale), 80);
        let (c, s) = fp8_cache(true);
        let kv = kv_cache(&c, Some(&s)).unwrap();
        let scales = kv.scales.expect("scales");
        assert_eq!(scales.k.dtype, DType::F32);
        assert_eq!(
            (scales.k.shape, scales.k.strides, scales.v.ptr),
            ([8, 16, 2, 1], [32, 2, 1, 1], 7 * GB)
        );
        assert!(kv.is_fp8());
        assert_eq!(kv_cache(&c, None).unwrap().scales, None);
        let mut bad = s;
        bad.k_scale.strides[2] = -1;
        let e = kv_cache(&c, Some(&bad)).unwrap_err();
        assert!(
            matches!(
                e,
                Error::BadStrides {
                    tensor: "k_scale",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn check_merge_applies_the_merge_rules_without_a_device() {
        let parts = bshd(GB, [2, 5, 4, 128]);
        let mut out = bshd(3 * GB, [2, 5, 4, 128]);
        out.dtype = FLASHCORE_F32;
        out.strides = [5 * 4 * 128, 4 * 128, 128, 1];
        let n = 2 * 5 * 4 * 128;
        let check =
            |parts: &FlashcoreTensor, count: i64, stride: i64, lse: u64, out: &FlashcoreTensor| {
                // SAFETY: both tensor pointers point at live locals.
                unsafe { flashcore_check_merge(parts, count, stride, lse, out, 4 * GB) }
            };
        assert_eq!(
            check(&parts, 3, n, 2 * GB, &out),
            FLASHCORE_SUCCESS,
            "{}",
            last_error()
        );
        assert_eq!(check(&parts, 1, 0, 2 * GB, &out), FLASHCORE_SUCCESS);
        assert_eq!(
            check(&parts, 0, n, 2 * GB, &out),
            FLASHCORE_ERROR_EMPTY_DIMENSION
        );
        assert_eq!(
            check(&parts, -1, n, 2 * GB, &out),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().starts_with("flashcore_check_merge: "),
            "{}",
            last_error()
        );
        assert_eq!(
            check(&parts, 3, -n, 2 * GB, &out),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        assert_eq!(
            check(&parts, 3, 3, 2 * GB, &out),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        assert_eq!(check(&parts, 3, n, 0, &out), FLASHCORE_ERROR_NULL_POINTER);
        assert_eq!(
            check(&parts, 3, n, 2 * GB + 2, &out),
            FLASHCORE_ERROR_MISALIGNED
        );
        let into_parts = FlashcoreTensor {
            ptr: GB + 4096,
            ..out
        };
        assert_eq!(
            check(&parts, 3, n, 2 * GB, &into_parts),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("overlaps"), "{}", last_error());
        let mut longer = out;
        longer.shape[1] = 6;
        assert_eq!(
            check(&parts, 3, n, 2 * GB, &longer),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        // 264: no kernel (80 runs the 96 one padded).
        let d264 = bshd(GB, [2, 5, 4, 264]);
        let o264 = bshd(3 * GB, [2, 5, 4, 264]);
        assert_eq!(
            check(&d264, 1, 0, 2 * GB, &o264),
            FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM
        );
        // SAFETY: null struct pointers are allowed and reported.
        let rc = unsafe { flashcore_check_merge(ptr::null(), 1, 0, 2 * GB, &out, 0) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_merge: parts is a null pointer"
        );
    }

    #[test]
    fn serving_calls_refuse_a_null_context_and_null_out() {
        let (q, c) = (query(1, 4, 4 * GB), cache(false));
        let o = FlashcoreTensor { ptr: 5 * GB, ..q };
        let null = ptr::null();
        // SAFETY: a null context is allowed and reported; the rest are live locals.
        let rc = unsafe {
            flashcore_decode(
                ptr::null_mut(),
                &q,
                &c,
                null,
                null,
                &o,
                0,
                0.0,
                0,
                0,
                0,
                ptr::null_mut(),
            )
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_decode: ctx is a null pointer");
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_append_kv(ptr::null_mut(), &c, &q, &q, null, null, ptr::null_mut())
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_append_kv: ctx is a null pointer");
        // SAFETY: as above.
        let rc = unsafe { flashcore_merge(ptr::null_mut(), &q, 1, 0, GB, &o, 0, ptr::null_mut()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_merge: ctx is a null pointer");
        let mut bytes = 7usize;
        // SAFETY: as above; `bytes` is a live local.
        let rc = unsafe { flashcore_decode_workspace_bytes(ptr::null_mut(), &q, &c, &mut bytes) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(bytes, 0, "out not cleared on failure");
        assert_eq!(
            last_error(),
            "flashcore_decode_workspace_bytes: ctx is a null pointer"
        );
        // SAFETY: a null `out` is allowed and reported, not written.
        let rc =
            unsafe { flashcore_decode_workspace_bytes(ptr::null_mut(), &q, &c, ptr::null_mut()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_decode_workspace_bytes: out is a null pointer"
        );
    }

    #[test]
    fn kv_cache_conversion() {
        let c = kv_cache(&cache(false), None).unwrap();
        assert_eq!(c.layout, CacheLayout::Contiguous);
        assert_eq!(
            (c.k.shape, c.v.ptr, c.seqlens),
            ([2, 64, 2, 64], 2 * GB, 3 * GB)
        );
        let p = kv_cache(&cache(true), None).unwrap();
        assert_eq!(
            p.layout,
            CacheLayout::Paged {
                block_table: 3 * GB + 4096,
                max_pages: 4,
                table_stride: 4
            }
        );
        // Any non-zero paging field makes the cache paged (and validation then says why
        // it is not a usable one).
        let mut half = cache(false);
        half.table_stride = 4;
        assert!(matches!(
            kv_cache(&half, None).unwrap().layout,
            CacheLayout::Paged { block_table: 0, .. }
        ));
        let mut bad = cache(false);
        bad.v.shape[0] = -1;
        let e = kv_cache(&bad, None).unwrap_err();
        assert!(
            e.to_string().contains("v_cache.shape[0] (batch) is -1"),
            "{e}"
        );
    }

    #[test]
    fn kv_cache_layout_is_the_c_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<FlashcoreKvCache>(), 192);
        assert_eq!(align_of::<FlashcoreKvCache>(), 8);
        assert_eq!(offset_of!(FlashcoreKvCache, k), 0);
        assert_eq!(offset_of!(FlashcoreKvCache, v), 80);
        assert_eq!(offset_of!(FlashcoreKvCache, seqlens), 160);
        assert_eq!(offset_of!(FlashcoreKvCache, block_table), 168);
        assert_eq!(offset_of!(FlashcoreKvCache, max_pages), 176);
        assert_eq!(offset_of!(FlashcoreKvCache, table_stride), 184);
    }

    #[test]
    fn tensor_conversion() {
        let good = tensor_view(&tensor(FLASHCORE_BF16), "q").unwrap();
        assert_eq!(good.dtype, DType::Bf16);
        assert_eq!(good.shape, [1, 128, 2, 64]);
        assert_eq!(good.strides, [128 * 2 * 64, 2 * 64, 64, 1]);
        assert_eq!(good.ptr, 0x1000);
        assert_eq!(
            tensor_view(&tensor(FLASHCORE_F32), "q").unwrap().dtype,
            DType::F32
        );

        assert_eq!(
            tensor_view(&tensor(FLASHCORE_E4M3), "q").unwrap().dtype,
            DType::E4m3
        );
        for code in [FLASHCORE_F16, FLASHCORE_BF16, FLASHCORE_F32, FLASHCORE_E4M3] {
            let t = tensor(code);
            assert_eq!(c_tensor(&tensor_view(&t, "q").unwrap()), t);
        }

        for bad in [0, 5, -1, i32::MAX] {
            let e = tensor_view(&tensor(bad), "v").unwrap_err();
            assert_eq!(e.code(), FLASHCORE_ERROR_UNSUPPORTED_DTYPE, "{bad}");
        }

        let mut t = tensor(FLASHCORE_F16);
        t.shape[1] = -5;
        let e = tensor_view(&t, "q").unwrap_err();
        assert_eq!(e.code(), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(e.to_string().contains("q.shape[1] (seqlen) is -5"), "{e}");

        let mut t = tensor(FLASHCORE_F16);
        t.strides[2] = -64;
        let e = tensor_view(&t, "o").unwrap_err();
        assert_eq!(e.code(), FLASHCORE_ERROR_BAD_STRIDES);
        assert!(e.to_string().contains("bad strides for o"), "{e}");
    }

    #[test]
    fn params_mapping() {
        assert_eq!(params(0.0, 0, Window::FULL), AttentionParams::default());
        assert_eq!(params(-0.0, 0, Window::FULL).softmax_scale, None);
        let p = params(0.5, 7, Window::FULL);
        assert_eq!(p.softmax_scale, Some(0.5));
        assert!(p.causal);
        assert!(
            params(f32::NAN, 0, Window::FULL)
                .softmax_scale
                .unwrap()
                .is_nan()
        );
        assert_eq!(params(0.0, 1, c_window(15, 0)).window, Window::sliding(16));
    }

    #[test]
    fn c_windows_are_flash_attentions() {
        // Any negative side is unbounded, -1 or not.
        for (l, r) in [(-1, -1), (-7, i64::MIN), (i64::MIN, -2)] {
            assert_eq!(c_window(l, r), Window::FULL, "({l}, {r})");
        }
        let one_sided = |left, right| Window { left, right };
        assert_eq!(c_window(-1, 0), one_sided(None, Some(0)));
        assert_eq!(c_window(-3, 5), one_sided(None, Some(5)));
        assert_eq!(c_window(100, -1), one_sided(Some(100), None));
        assert_eq!(c_window(4095, 0), Window::sliding(4096));
        // A side past u32 bounds nothing any sequence reaches: it stays a bound that large.
        assert_eq!(c_window(i64::MAX, 3), one_sided(Some(u32::MAX), Some(3)));
    }

    #[test]
    fn create_without_driver_is_no_driver() {
        let mut ctx: *mut FlashcoreContext = ptr::dangling_mut();
        // SAFETY: `ctx` is a valid place for one pointer.
        let rc = unsafe { flashcore_create(-1, &mut ctx) };
        assert_eq!(rc, FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(ctx.is_null(), "out not cleared on failure");
        assert!(last_error().contains("device ordinal -1 is negative"));

        if driver_present() {
            // A GPU machine: a real context, a refused call through it, and its release.
            let count = crate::host::device::device_count().unwrap_or(0);
            // SAFETY: `ctx` is a valid place for one pointer.
            let rc = unsafe { flashcore_create(count as i32, &mut ctx) };
            assert_eq!(rc, FLASHCORE_ERROR_NO_DEVICE, "{}", last_error());
            if count == 0 {
                return;
            }
            // SAFETY: as above.
            let rc = unsafe { flashcore_create(0, &mut ctx) };
            if rc == FLASHCORE_ERROR_UNSUPPORTED_GPU {
                return;
            }
            assert_eq!(rc, FLASHCORE_SUCCESS, "{}", last_error());
            assert!(!ctx.is_null());
            let (good, bad) = (tensor(FLASHCORE_F16), tensor(9));
            // SAFETY: `ctx` is live; the tensors are live locals; nothing is launched
            // because the dtype check fails first.
            let rc = unsafe {
                flashcore_forward(ctx, &bad, &good, &good, &good, 0, 0.0, 1, ptr::null_mut())
            };
            assert_eq!(rc, FLASHCORE_ERROR_UNSUPPORTED_DTYPE);
            assert!(last_error().contains("q has dtype code 9"));
            // SAFETY: `ctx` is live; the tensors are live locals; nothing is launched
            // because causal masking with a right side above 0 is refused first.
            let rc = unsafe {
                flashcore_forward_window(
                    ctx,
                    &good,
                    &good,
                    &good,
                    &good,
                    0,
                    0.0,
                    1,
                    15,
                    1,
                    ptr::null_mut(),
                )
            };
            assert_eq!(rc, FLASHCORE_ERROR_INVALID_ARGUMENT);
            assert!(last_error().contains("right side"), "{}", last_error());
            // The serving calls through a real context: sizes, and refusals before launch.
            let (q, c) = (query(1, 32, 4 * GB), cache(true));
            let mut c = c;
            c.k.shape[2] = 8;
            c.v.shape[2] = 8;
            c.k.strides = [16 * 8 * 64, 8 * 64, 64, 1];
            c.v.strides = c.k.strides;
            let mut bytes = usize::MAX;
            // SAFETY: `ctx` is live; the structs are live locals; no device memory is read.
            let rc = unsafe { flashcore_decode_workspace_bytes(ctx, &q, &c, &mut bytes) };
            assert_eq!(rc, FLASHCORE_SUCCESS, "{}", last_error());
            assert!(bytes < usize::MAX);
            let o = FlashcoreTensor { ptr: GB + 64, ..q };
            let null = ptr::null();
            // SAFETY: `ctx` is live; nothing is launched because `o` overlaps the cache.
            let rc = unsafe {
                flashcore_decode(
                    ctx,
                    &q,
                    &c,
                    null,
                    null,
                    &o,
                    0,
                    0.0,
                    0,
                    0,
                    0,
                    ptr::null_mut(),
                )
            };
            assert_eq!(rc, FLASHCORE_ERROR_INVALID_ARGUMENT, "{}", last_error());
            // SAFETY: `ctx` is live; nothing is launched because count is 0.
            let rc = unsafe { flashcore_merge(ctx, &q, 0, 0, GB, &o, 0, ptr::null_mut()) };
            assert_eq!(rc, FLASHCORE_ERROR_EMPTY_DIMENSION, "{}", last_error());
            // The FP8 calls through a real context: refusals before launch.
            let [fq, fk, mut fv] = quantize_inputs();
            fv.dtype = FLASHCORE_BF16;
            let mut ops = FlashcoreFp8Operands::default();
            // SAFETY: `ctx` is live; nothing is launched because v's dtype differs.
            let rc = unsafe {
                flashcore_quantize_fp8(
                    ctx,
                    &fq,
                    &fk,
                    &fv,
                    ptr::null(),
                    8 * GB,
                    1 << 30,
                    &mut ops,
                    ptr::null_mut(),
                )
            };
            assert_eq!(rc, FLASHCORE_ERROR_UNSUPPORTED_DTYPE, "{}", last_error());
            assert_eq!(ops, FlashcoreFp8Operands::default());
            let (mut ops, o) = fp8_call(false);
            ops.vt_strides[2] = 8;
            // SAFETY: `ctx` is live; nothing is launched because Vt's pitch is too short.
            let rc = unsafe { flashcore_forward_fp8(ctx, &ops, &o, 0, 0.0, 0, ptr::null_mut()) };
            assert_eq!(rc, FLASHCORE_ERROR_BAD_STRIDES, "{}", last_error());
            // SAFETY: `ctx` came from flashcore_create and is destroyed once.
            unsafe { flashcore_destroy(ctx) };
            return;
        }
        ctx = ptr::dangling_mut();
        // SAFETY: as above.
        let rc = unsafe { flashcore_create(0, &mut ctx) };
        assert_eq!(rc, FLASHCORE_ERROR_NO_DRIVER);
        assert!(ctx.is_null());
        let msg = last_error();
        assert!(msg.starts_with("flashcore_create: no CUDA driver"), "{msg}");
    }

    #[test]
    fn panics_become_an_error_code() {
        let rc = guard("flashcore_forward", || panic!("boom {}", 42));
        assert_eq!(rc, FLASHCORE_ERROR_PANIC);
        assert_eq!(last_error(), "flashcore_forward: internal panic: boom 42");
        let rc = guard("flashcore_forward", || std::panic::panic_any(5u8));
        assert_eq!(rc, FLASHCORE_ERROR_PANIC);
        assert!(last_error().ends_with("(no message)"));
    }

    #[test]
    fn error_names_cover_every_code() {
        // One value of every Error variant: its code must be the matching constant.
        let errors = [
            (Error::NoDriver, "FLASHCORE_ERROR_NO_DRIVER"),
            (
                Error::NoDevice {
                    ordinal: 1,
                    count: 0,
                },
                "FLASHCORE_ERROR_NO_DEVICE",
            ),
            (
                Error::UnsupportedGpu {
                    name: "x".into(),
                    major: 7,
                    minor: 5,
                },
                "FLASHCORE_ERROR_UNSUPPORTED_GPU",
            ),
            (
                Error::ShapeMismatch("x".into()),
                "FLASHCORE_ERROR_SHAPE_MISMATCH",
            ),
            (
                Error::BadStrides {
                    tensor: "q",
                    reason: "x".into(),
                },
                "FLASHCORE_ERROR_BAD_STRIDES",
            ),
            (
                Error::EmptyDimension {
                    tensor: "q",
                    dim: "batch",
                },
                "FLASHCORE_ERROR_EMPTY_DIMENSION",
            ),
            (
                Error::UnsupportedHeadDim(48, "x"),
                "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM",
            ),
            (
                Error::UnsupportedDType("x".into()),
                "FLASHCORE_ERROR_UNSUPPORTED_DTYPE",
            ),
            (
                Error::HeadRatio { hq: 3, hkv: 2 },
                "FLASHCORE_ERROR_HEAD_RATIO",
            ),
            (Error::NullPointer("q"), "FLASHCORE_ERROR_NULL_POINTER"),
            (
                Error::Misaligned {
                    tensor: "q",
                    ptr: 1,
                    align: 16,
                },
                "FLASHCORE_ERROR_MISALIGNED",
            ),
            (
                Error::InvalidArgument("x".into()),
                "FLASHCORE_ERROR_INVALID_ARGUMENT",
            ),
            (
                Error::Ptx(PtxError::BadName("x".into())),
                "FLASHCORE_ERROR_PTX",
            ),
            (
                Error::ModuleLoad {
                    kernel: "x".into(),
                    code: "x".into(),
                    log: "x".into(),
                },
                "FLASHCORE_ERROR_MODULE_LOAD",
            ),
            (
                Error::Driver {
                    call: "cuInit",
                    code: "x".into(),
                },
                "FLASHCORE_ERROR_DRIVER",
            ),
            (
                Error::TensorMap(crate::tma::TensorMapError::Rank { rank: 6 }),
                "FLASHCORE_ERROR_TENSOR_MAP",
            ),
        ];
        let value = |name: &str| {
            FLASHCORE_CONSTANTS
                .iter()
                .find(|(n, _)| *n == name)
                .unwrap_or_else(|| panic!("{name} missing from FLASHCORE_CONSTANTS"))
                .1
        };
        for (e, name) in &errors {
            assert_eq!(e.code(), value(name), "{e:?}");
        }

        // Every error code has its own name, and the name is the constant's.
        let mut codes: Vec<i32> = Vec::new();
        for &(name, code) in FLASHCORE_CONSTANTS {
            if name == "FLASHCORE_SUCCESS" || name.starts_with("FLASHCORE_ERROR_") {
                // SAFETY: flashcore_error_name returns a static NUL-terminated string.
                let got = unsafe { CStr::from_ptr(flashcore_error_name(code)) };
                assert_eq!(got.to_str().unwrap(), name);
                assert!(!codes.contains(&code), "code {code} used twice");
                codes.push(code);
            }
        }
        assert_eq!(codes.len(), errors.len() + 3); // + success, null argument, panic
        assert!(codes.iter().all(|&c| c >= 0));
        assert!(
            codes
                .iter()
                .filter(|&&c| c != FLASHCORE_ERROR_NULL_ARGUMENT && c != FLASHCORE_ERROR_PANIC)
                .all(|&c| c < FLASHCORE_ERROR_NULL_ARGUMENT)
        );
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(flashcore_error_name(-3)) };
        assert_eq!(unknown.to_str().unwrap(), "FLASHCORE_ERROR_UNKNOWN");
    }

    #[test]
    fn version_is_the_package_version() {
        // SAFETY: a static NUL-terminated string.
        let v = unsafe { CStr::from_ptr(flashcore_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }

    /// FP8 operands of `[2, 300, 8, 128]` queries and `[2, 1001, 2, 128]` keys as the
    /// quantizer lays them out in a workspace at 8 GB (with an LSE shift when `smooth_k`),
    /// in C, and a bf16 output at 1 GB.
    fn fp8_call(smooth_k: bool) -> (FlashcoreFp8Operands, FlashcoreTensor) {
        use crate::shape::AttnShape;
        let shape = AttnShape {
            batch: 2,
            seqlen_q: 300,
            seqlen_k: 1001,
            heads_q: 8,
            heads_kv: 2,
            head_dim: 128,
        };
        let options = QuantizeOptions {
            smooth_k,
            hadamard_seed: None,
        };
        let ops = Fp8Layout::new(&shape, &options)
            .unwrap()
            .operands(8 * GB, &shape);
        let mut o = bshd(GB, [2, 300, 8, 128]);
        o.dtype = FLASHCORE_BF16;
        (c_fp8_operands(&ops), o)
    }

    fn check_fp8(ops: &FlashcoreFp8Operands, o: &FlashcoreTensor, lse: u64, scale: f32) -> i32 {
        // SAFETY: both struct pointers point at live locals.
        unsafe { flashcore_check_forward_fp8(ops, o, lse, scale, 1) }
    }

    #[test]
    fn fp8_operands_cross_the_abi_unchanged() {
        for smooth_k in [false, true] {
            let (c, _) = fp8_call(smooth_k);
            assert_eq!(c.q.dtype, FLASHCORE_E4M3);
            assert_eq!(c.k.dtype, FLASHCORE_E4M3);
            assert_eq!(c.vt_shape, [2, 2, 128, 1001]);
            assert_eq!(c.vt_strides, [2 * 128 * 1008, 128 * 1008, 1008]);
            assert_eq!(c.lse_shift != 0, smooth_k);
            let ops = fp8_operands(&c).unwrap();
            assert_eq!(ops.lse_shift.is_some(), smooth_k);
            assert_eq!(c_fp8_operands(&ops), c);
        }
        let (mut c, _) = fp8_call(false);
        c.vt_shape[3] = -1;
        let e = fp8_operands(&c).unwrap_err();
        assert_eq!(e.code(), FLASHCORE_ERROR_INVALID_ARGUMENT);
        assert!(e.to_string().contains("vt_shape[3] (seqlen) is -1"), "{e}");
        let (mut c, _) = fp8_call(false);
        c.vt_strides[2] = -16;
        let e = fp8_operands(&c).unwrap_err();
        assert_eq!(e.code(), FLASHCORE_ERROR_BAD_STRIDES);
        assert!(e.to_string().contains("vt_strides[2] (row) is -16"), "{e}");
    }

    #[test]
    fn check_forward_fp8_applies_the_fp8_rules_without_a_device() {
        for smooth_k in [false, true] {
            let (ops, o) = fp8_call(smooth_k);
            assert_eq!(
                check_fp8(&ops, &o, 0, 0.0),
                FLASHCORE_SUCCESS,
                "{}",
                last_error()
            );
            assert_eq!(check_fp8(&ops, &o, 3 * GB, 0.125), FLASHCORE_SUCCESS);
        }
        let (ops, o) = fp8_call(true);
        let code = |f: &dyn Fn(&mut FlashcoreFp8Operands, &mut FlashcoreTensor)| {
            let (mut ops, mut o) = (ops, o);
            f(&mut ops, &mut o);
            check_fp8(&ops, &o, 0, 0.0)
        };
        // Wrong dtypes: 16-bit codes, an e4m3 or f32 output, an unknown code.
        assert_eq!(
            code(&|ops, _| ops.q.dtype = FLASHCORE_F16),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert!(
            last_error().starts_with("flashcore_check_forward_fp8: "),
            "{}",
            last_error()
        );
        assert!(last_error().contains("e4m3 codes"), "{}", last_error());
        assert_eq!(
            code(&|ops, _| ops.k.dtype = FLASHCORE_BF16),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert_eq!(
            code(&|_, o| o.dtype = FLASHCORE_E4M3),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert_eq!(
            code(&|_, o| o.dtype = FLASHCORE_F32),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert_eq!(
            code(&|ops, _| ops.q.dtype = 9),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert!(
            last_error().contains("q has dtype code 9"),
            "{}",
            last_error()
        );
        // Shapes: o against q, Vt against K, a head dim without FP8 kernels.
        assert_eq!(
            code(&|_, o| o.shape[1] = 301),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        assert_eq!(
            code(&|ops, _| ops.vt_shape[3] = 1000),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        assert!(
            last_error().contains("vt is [B, Hkv, D, Sk]"),
            "{}",
            last_error()
        );
        assert_eq!(
            code(&|ops, o| {
                for t in [&mut ops.q, &mut ops.k, o] {
                    t.shape[3] = 96;
                }
                ops.vt_shape[2] = 96;
            }),
            FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM
        );
        assert!(last_error().contains("64, 128, 256"), "{}", last_error());
        assert_eq!(
            code(&|ops, o| {
                ops.q.shape[2] = 3;
                o.shape[2] = 3;
            }),
            FLASHCORE_ERROR_HEAD_RATIO
        );
        // Pointers: null and misaligned codes and scales.
        assert_eq!(code(&|ops, _| ops.vt = 0), FLASHCORE_ERROR_NULL_POINTER);
        assert_eq!(
            code(&|ops, _| ops.k_scale = 0),
            FLASHCORE_ERROR_NULL_POINTER
        );
        assert!(last_error().contains("k_scale"), "{}", last_error());
        assert_eq!(code(&|ops, _| ops.q.ptr += 8), FLASHCORE_ERROR_MISALIGNED);
        assert_eq!(code(&|ops, _| ops.v_scale += 2), FLASHCORE_ERROR_MISALIGNED);
        assert_eq!(
            code(&|ops, _| ops.lse_shift += 1),
            FLASHCORE_ERROR_MISALIGNED
        );
        // Vt's pitch: below Sk rounded up to 16, or not a multiple of 16; negative values.
        assert_eq!(
            code(&|ops, _| ops.vt_strides[2] = 992),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        assert_eq!(
            code(&|ops, _| ops.vt_strides[2] = 1009),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        assert_eq!(
            code(&|ops, _| ops.vt_strides[0] = -1),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        assert_eq!(
            code(&|ops, _| ops.vt_shape[0] = -2),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            code(&|ops, _| ops.k.strides[3] = 2),
            FLASHCORE_ERROR_BAD_STRIDES
        );
        // The output may not overlap an input: the scales here.
        assert_eq!(
            code(&|ops, o| o.ptr = ops.q_scale),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().contains("overlaps q_scale"),
            "{}",
            last_error()
        );
        // The softmax scale and the LSE.
        assert_eq!(
            check_fp8(&ops, &o, 0, f32::NAN),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            check_fp8(&ops, &o, 3 * GB + 2, 0.0),
            FLASHCORE_ERROR_MISALIGNED
        );
        assert_eq!(
            check_fp8(&ops, &o, GB, 0.0),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        // Null structs.
        // SAFETY: null struct pointers are allowed and reported.
        let rc = unsafe { flashcore_check_forward_fp8(ptr::null(), &o, 0, 0.0, 0) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_forward_fp8: operands is a null pointer"
        );
        // SAFETY: as above.
        let rc = unsafe { flashcore_check_forward_fp8(&ops, ptr::null(), 0, 0.0, 0) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_forward_fp8: o is a null pointer"
        );
    }

    /// 16-bit `q` `[2, 300, 8, 128]` at 1 GB, `k`, `v` `[2, 1001, 2, 128]` at 2 and 3 GB.
    fn quantize_inputs() -> [FlashcoreTensor; 3] {
        [
            bshd(GB, [2, 300, 8, 128]),
            bshd(2 * GB, [2, 1001, 2, 128]),
            bshd(3 * GB, [2, 1001, 2, 128]),
        ]
    }

    fn fp8_workspace_bytes(
        [q, k, v]: &[FlashcoreTensor; 3],
        options: Option<&FlashcoreQuantizeOptions>,
    ) -> (i32, usize) {
        let mut bytes = usize::MAX;
        let options = options.map_or(ptr::null(), ptr::from_ref);
        // SAFETY: every pointer is null or points at a live local.
        let rc = unsafe { flashcore_fp8_workspace_bytes(q, k, v, options, &mut bytes) };
        (rc, bytes)
    }

    fn check_quantize(
        [q, k, v]: &[FlashcoreTensor; 3],
        options: &FlashcoreQuantizeOptions,
        workspace: u64,
        bytes: usize,
    ) -> i32 {
        // SAFETY: every pointer points at a live local.
        unsafe { flashcore_check_quantize_fp8(q, k, v, options, workspace, bytes) }
    }

    #[test]
    fn fp8_workspace_bytes_is_the_layout_with_room_to_align_it() {
        use crate::shape::AttnShape;
        let inputs = quantize_inputs();
        let shape = AttnShape {
            batch: 2,
            seqlen_q: 300,
            seqlen_k: 1001,
            heads_q: 8,
            heads_kv: 2,
            head_dim: 128,
        };
        let smooth = FlashcoreQuantizeOptions {
            smooth_k: 1,
            hadamard: 1,
            hadamard_seed: 7,
        };
        for (options, opts) in [
            (None, QuantizeOptions::default()),
            (
                Some(&FlashcoreQuantizeOptions::default()),
                QuantizeOptions::default(),
            ),
            (
                Some(&smooth),
                QuantizeOptions {
                    smooth_k: true,
                    hadamard_seed: Some(7),
                },
            ),
        ] {
            let want = Fp8Layout::new(&shape, &opts).unwrap().bytes + Fp8Layout::ALIGN - 1;
            assert_eq!(
                fp8_workspace_bytes(&inputs, options),
                (FLASHCORE_SUCCESS, want),
                "{}",
                last_error()
            );
        }
        // Bad inputs: an error code, and 0 bytes.
        let mut e4m3 = inputs;
        for t in &mut e4m3 {
            t.dtype = FLASHCORE_E4M3;
        }
        assert_eq!(
            fp8_workspace_bytes(&e4m3, None),
            (FLASHCORE_ERROR_UNSUPPORTED_DTYPE, 0)
        );
        assert!(
            last_error().starts_with("flashcore_fp8_workspace_bytes: "),
            "{}",
            last_error()
        );
        let mut mixed = inputs;
        mixed[2].dtype = FLASHCORE_BF16;
        assert_eq!(
            fp8_workspace_bytes(&mixed, None),
            (FLASHCORE_ERROR_UNSUPPORTED_DTYPE, 0)
        );
        let mut d96 = inputs;
        for t in &mut d96 {
            t.shape[3] = 96;
        }
        assert_eq!(
            fp8_workspace_bytes(&d96, None),
            (FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM, 0)
        );
        let mut null_q = inputs;
        null_q[0].ptr = 0;
        assert_eq!(
            fp8_workspace_bytes(&null_q, None),
            (FLASHCORE_ERROR_NULL_POINTER, 0)
        );
        let (q, k) = (inputs[0], inputs[1]);
        let mut bytes = 5usize;
        // SAFETY: a null tensor pointer is allowed and reported; the rest are live locals.
        let rc =
            unsafe { flashcore_fp8_workspace_bytes(&q, &k, ptr::null(), ptr::null(), &mut bytes) };
        assert_eq!((rc, bytes), (FLASHCORE_ERROR_NULL_ARGUMENT, 0));
        assert_eq!(
            last_error(),
            "flashcore_fp8_workspace_bytes: v is a null pointer"
        );
        // SAFETY: a null `out` is allowed and reported, not written.
        let rc = unsafe { flashcore_fp8_workspace_bytes(&q, &k, &k, ptr::null(), ptr::null_mut()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_fp8_workspace_bytes: out is a null pointer"
        );
    }

    #[test]
    fn check_quantize_applies_the_quantizer_rules_without_a_device() {
        let inputs = quantize_inputs();
        let plain = FlashcoreQuantizeOptions::default();
        let smooth = FlashcoreQuantizeOptions {
            smooth_k: 1,
            ..plain
        };
        let (_, need) = fp8_workspace_bytes(&inputs, Some(&plain));
        let (_, need_smooth) = fp8_workspace_bytes(&inputs, Some(&smooth));
        assert!(need_smooth > need);
        let ws = 8 * GB;
        // The reported size fits at any start: aligned, or rounded up by up to 255 bytes.
        for start in [ws, ws + 1, ws + 16, ws + 255] {
            assert_eq!(
                check_quantize(&inputs, &plain, start, need),
                FLASHCORE_SUCCESS,
                "{start:#x}: {}",
                last_error()
            );
        }
        assert_eq!(
            check_quantize(&inputs, &smooth, ws, need_smooth),
            FLASHCORE_SUCCESS
        );
        // Too small: after the rounding, or for the smoothing's extra regions.
        assert_eq!(
            check_quantize(&inputs, &plain, ws + 1, need - 1),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(
            last_error().starts_with("flashcore_check_quantize_fp8: "),
            "{}",
            last_error()
        );
        assert!(last_error().contains("needs"), "{}", last_error());
        assert_eq!(
            check_quantize(&inputs, &smooth, ws, need),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(
            check_quantize(&inputs, &plain, ws + 17, 16),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        // No workspace, or one over an input.
        assert_eq!(
            check_quantize(&inputs, &plain, 0, need),
            FLASHCORE_ERROR_NULL_POINTER
        );
        assert!(last_error().contains("workspace"), "{}", last_error());
        assert_eq!(
            check_quantize(&inputs, &plain, 2 * GB + 4096, need),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("overlaps k"), "{}", last_error());
        // The inputs' rules.
        let with = |f: &dyn Fn(&mut [FlashcoreTensor; 3])| {
            let mut t = inputs;
            f(&mut t);
            check_quantize(&t, &plain, ws, need)
        };
        assert_eq!(
            with(&|t| t[0].dtype = FLASHCORE_F32),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert_eq!(
            with(&|t| t[1].dtype = FLASHCORE_E4M3),
            FLASHCORE_ERROR_UNSUPPORTED_DTYPE
        );
        assert_eq!(
            with(&|t| t[2].shape[1] = 1000),
            FLASHCORE_ERROR_SHAPE_MISMATCH
        );
        assert_eq!(with(&|t| t[0].shape[2] = 3), FLASHCORE_ERROR_HEAD_RATIO);
        assert_eq!(with(&|t| t[2].ptr += 2), FLASHCORE_ERROR_MISALIGNED);
        assert_eq!(with(&|t| t[1].strides[3] = 2), FLASHCORE_ERROR_BAD_STRIDES);
        assert_eq!(
            with(&|t| t[0].shape[0] = 0),
            FLASHCORE_ERROR_EMPTY_DIMENSION
        );
        assert_eq!(
            with(&|t| t[0].shape[1] = -1),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        // Null options are every option off; null tensors are reported.
        let [q, k, v] = inputs;
        // SAFETY: every pointer is null or points at a live local.
        let rc = unsafe { flashcore_check_quantize_fp8(&q, &k, &v, ptr::null(), ws, need) };
        assert_eq!(rc, FLASHCORE_SUCCESS, "{}", last_error());
        // SAFETY: as above.
        let rc =
            unsafe { flashcore_check_quantize_fp8(ptr::null(), &k, &v, ptr::null(), ws, need) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_quantize_fp8: q is a null pointer"
        );
    }

    #[test]
    fn fp8_calls_refuse_a_null_context_and_null_out() {
        let [q, k, v] = quantize_inputs();
        let (ops, o) = fp8_call(false);
        let mut out = ops; // not zeros: a failure must clear it
        // SAFETY: a null context is allowed and reported; the rest are live locals.
        let rc = unsafe {
            flashcore_quantize_fp8(
                ptr::null_mut(),
                &q,
                &k,
                &v,
                ptr::null(),
                8 * GB,
                1 << 30,
                &mut out,
                ptr::null_mut(),
            )
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_quantize_fp8: ctx is a null pointer"
        );
        assert_eq!(out, FlashcoreFp8Operands::default(), "out not cleared");
        // SAFETY: a null `out` is allowed and reported, not written.
        let rc = unsafe {
            flashcore_quantize_fp8(
                ptr::null_mut(),
                &q,
                &k,
                &v,
                ptr::null(),
                8 * GB,
                1 << 30,
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_quantize_fp8: out is a null pointer"
        );
        // SAFETY: as above.
        let rc =
            unsafe { flashcore_forward_fp8(ptr::null_mut(), &ops, &o, 0, 0.0, 0, ptr::null_mut()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(last_error(), "flashcore_forward_fp8: ctx is a null pointer");
    }

    #[test]
    fn aligned_workspace_rounds_the_start_up() {
        let ws = |ptr, bytes| {
            let w = aligned_workspace(ptr, bytes);
            (w.ptr, w.bytes)
        };
        assert_eq!(ws(4096, 1000), (4096, 1000));
        assert_eq!(ws(4097, 1000), (4352, 745));
        assert_eq!(ws(4097, 100), (4352, 0));
        assert_eq!(ws(0, 1000), (0, 1000));
        assert_eq!(ws(u64::MAX, 1000), (u64::MAX, 1000));
    }

    #[test]
    fn fp8_structs_are_the_c_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<FlashcoreFp8Operands>(), 256);
        assert_eq!(align_of::<FlashcoreFp8Operands>(), 8);
        assert_eq!(offset_of!(FlashcoreFp8Operands, k), 80);
        assert_eq!(offset_of!(FlashcoreFp8Operands, vt), 160);
        assert_eq!(offset_of!(FlashcoreFp8Operands, vt_shape), 168);
        assert_eq!(offset_of!(FlashcoreFp8Operands, vt_strides), 200);
        assert_eq!(offset_of!(FlashcoreFp8Operands, q_scale), 224);
        assert_eq!(offset_of!(FlashcoreFp8Operands, lse_shift), 248);
        assert_eq!(size_of::<FlashcoreQuantizeOptions>(), 16);
        assert_eq!(offset_of!(FlashcoreQuantizeOptions, hadamard), 4);
        assert_eq!(offset_of!(FlashcoreQuantizeOptions, hadamard_seed), 8);
    }

    #[test]
    fn tensor_layout_is_the_c_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<FlashcoreTensor>(), 80);
        assert_eq!(align_of::<FlashcoreTensor>(), 8);
        assert_eq!(offset_of!(FlashcoreTensor, ptr), 0);
        assert_eq!(offset_of!(FlashcoreTensor, dtype), 8);
        assert_eq!(offset_of!(FlashcoreTensor, shape), 16);
        assert_eq!(offset_of!(FlashcoreTensor, strides), 48);
    }

    #[test]
    fn options_layout_is_the_c_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<FlashcoreAttentionOptions>(), 32);
        assert_eq!(align_of::<FlashcoreAttentionOptions>(), 8);
        assert_eq!(offset_of!(FlashcoreAttentionOptions, struct_size), 0);
        assert_eq!(offset_of!(FlashcoreAttentionOptions, softmax_scale), 4);
        assert_eq!(offset_of!(FlashcoreAttentionOptions, window_left), 8);
        assert_eq!(offset_of!(FlashcoreAttentionOptions, window_right), 16);
        assert_eq!(offset_of!(FlashcoreAttentionOptions, causal), 24);
        assert_eq!(offset_of!(FlashcoreAttentionOptions, softcap), 28);
        // The first version is this one: 32 bytes, the smallest size and the largest.
        assert_eq!(FlashcoreAttentionOptions::MIN_SIZE, 32);
        assert_eq!(FlashcoreAttentionOptions::SIZE, 32);
    }

    #[test]
    fn new_options_are_no_options() {
        let o = FlashcoreAttentionOptions::new();
        // FLASHCORE_ATTENTION_OPTIONS_INIT's values (the c_header test checks the macro
        // against new()).
        assert_eq!(
            (
                o.struct_size,
                o.softmax_scale,
                o.window_left,
                o.window_right,
                o.causal,
                o.softcap
            ),
            (32, 0.0, -1, -1, 0, 0.0)
        );
        assert_eq!(FlashcoreAttentionOptions::default(), o);
        assert_eq!(FlashcoreAttentionOptions::uncapped(0.0, 0, -1, -1), o);
        // The plain calls' defaults: default scale, no mask, no window, no cap.
        // SAFETY: `o` is a live local of its size.
        let p = unsafe { read_options(&o) }.unwrap_or_else(|f| panic!("{}", f.message));
        assert_eq!(p, params(0.0, 0, Window::FULL));
        assert_eq!(p, AttentionParams::default());
    }

    #[test]
    fn options_sizes_other_than_this_librarys_are_refused() {
        // Accepted: 32 only (the first version's size is this library's).
        let accepted: Vec<u32> = (0..=1024)
            .filter(|&n| options_size_error(n).is_none())
            .collect();
        assert_eq!(accepted, [32]);
        for n in [u32::MAX, u32::MAX - 7, 1 << 31, 1 << 16] {
            assert!(options_size_error(n).is_some(), "{n}");
        }
        // Too small or not a multiple of 8: not initialized from the macro. Only the
        // struct_size is read: the options here are a lone (8-byte aligned) u32.
        #[repr(C, align(8))]
        struct SizeOnly(u32);
        for n in [0, 1, 4, 8, 16, 24, 31, 33, 36, 39, 41, 60, u32::MAX] {
            let size = SizeOnly(n);
            // SAFETY: `size` is a live, aligned u32 and the sizes here are refused, so no
            // more than its 4 bytes may be read.
            let read = unsafe { read_options((&raw const size).cast()) };
            let f = read.expect_err("refused");
            assert_eq!(f.code, FLASHCORE_ERROR_INVALID_ARGUMENT, "{n}");
            assert!(
                f.message.contains(&format!("opts.struct_size is {n},"))
                    && f.message.contains("FLASHCORE_ATTENTION_OPTIONS_INIT"),
                "{}",
                f.message
            );
        }
        // Larger than this library's, a multiple of 8: a newer header's options. Only the
        // struct_size is read, whatever follows it.
        let mut newer = [0u64; 8];
        for n in [40u32, 48, 64, 1 << 12, u32::MAX - 7] {
            newer[0] = u64::from(n).to_le();
            // SAFETY: `newer` is 64 live, aligned bytes starting with a u32 of `n` (on
            // little-endian targets; a big-endian one would read a size of 0, also refused).
            let read = unsafe { read_options(newer.as_ptr().cast()) };
            let f = read.expect_err("refused");
            assert_eq!(f.code, FLASHCORE_ERROR_INVALID_ARGUMENT, "{n}");
            if cfg!(target_endian = "little") {
                assert!(
                    f.message
                        .contains("options from a newer flashcore header than this library"),
                    "{}",
                    f.message
                );
            }
        }
        // All zeros is no longer "a window of one key": it is refused.
        let zeros = FlashcoreAttentionOptions {
            struct_size: 0,
            softmax_scale: 0.0,
            window_left: 0,
            window_right: 0,
            causal: 0,
            softcap: 0.0,
        };
        // SAFETY: `zeros` is a live local.
        let f = unsafe { read_options(&zeros) }.expect_err("refused");
        assert_eq!(f.code, FLASHCORE_ERROR_INVALID_ARGUMENT);
        // The right size with the rest as given: the options as c_options maps them.
        let o = FlashcoreAttentionOptions {
            struct_size: 32,
            ..options(1, 15, 0, 50.0)
        };
        // SAFETY: `o` is a live local.
        let p = unsafe { read_options(&o) }.unwrap_or_else(|f| panic!("{}", f.message));
        assert_eq!(p, c_options(&o));
        // SAFETY: null is allowed and reported.
        let f = unsafe { read_options(ptr::null()) }.expect_err("null");
        assert_eq!(
            (f.code, f.message.as_str()),
            (FLASHCORE_ERROR_NULL_ARGUMENT, "opts is a null pointer")
        );
    }

    /// Options with a soft cap (0: none) on top of the spellings' without `_ex`.
    fn options(causal: i32, left: i64, right: i64, softcap: f32) -> FlashcoreAttentionOptions {
        FlashcoreAttentionOptions {
            softcap,
            ..FlashcoreAttentionOptions::uncapped(0.0, causal, left, right)
        }
    }

    #[test]
    fn c_options_are_params_with_a_soft_cap() {
        // Without a cap: what the other spellings pass, mapped as they map it.
        for (scale, causal, left, right) in [(0.0, 0, -1, -1), (0.5, 3, 15, 0), (-0.0, 1, -4, 7)] {
            let o = FlashcoreAttentionOptions::uncapped(scale, causal, left, right);
            assert_eq!(
                c_options(&o),
                params(scale, causal, c_window(left, right)),
                "{o:?}"
            );
        }
        // A cap of 0, of either sign, is none; any other value is passed on as given,
        // for validation to judge.
        for zero in [0.0, -0.0] {
            assert_eq!(c_options(&options(1, 15, 0, zero)).softcap, None);
        }
        for cap in [50.0, 5.0, -1.0, f32::INFINITY, f32::MIN_POSITIVE / 4.0] {
            let p = c_options(&options(1, 15, 0, cap));
            assert_eq!(p.softcap, Some(cap));
            assert_eq!((p.causal, p.window), (true, Window::sliding(16)));
        }
        assert!(
            c_options(&options(0, -1, -1, f32::NAN))
                .softcap
                .unwrap()
                .is_nan()
        );
    }

    #[test]
    fn check_forward_ex_takes_the_options() {
        let (q, k, v) = (
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
            tensor(FLASHCORE_F16),
        );
        let mut o = tensor(FLASHCORE_F16);
        o.ptr = 0x10_0000; // past q, k and v, which share [0x1000, 0x11000)
        let check = |opts: &FlashcoreAttentionOptions| {
            // SAFETY: every pointer points at a live local.
            unsafe { flashcore_check_forward_ex(&q, &k, &v, &o, 0, opts) }
        };
        // Gemma 2's caps (50 on every layer, sliding windows on alternate ones), Grok's 30,
        // small and large ones, with and without causal masking and windows.
        for cap in [0.0, -0.0, 50.0, 30.0, 5.0, 1e-3, 1e6, 1e-38, 1e36] {
            for (causal, left, right) in [(1, -1, -1), (1, 4095, 0), (0, -1, -1), (0, 50, 7)] {
                let opts = options(causal, left, right, cap);
                assert_eq!(
                    check(&opts),
                    FLASHCORE_SUCCESS,
                    "{opts:?}: {}",
                    last_error()
                );
            }
        }
        // A cap that is not finite and positive, or so far from the scale (1/8 at head dim
        // 64) that their ratio leaves the normal floats (or the cap times log2 e overflows).
        for cap in [
            -1.0,
            -50.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            f32::from_bits(1),
            1e38,
            f32::MAX,
        ] {
            assert_eq!(
                check(&options(1, -1, -1, cap)),
                FLASHCORE_ERROR_INVALID_ARGUMENT,
                "{cap}"
            );
            let message = last_error();
            assert!(
                message.starts_with("flashcore_check_forward_ex: ") && message.contains("softcap"),
                "{message}"
            );
        }
        // The other options' rules: the window's, the scale's.
        assert_eq!(
            check(&options(1, 15, 1, 50.0)),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("right side"), "{}", last_error());
        let nan_scale = FlashcoreAttentionOptions {
            softmax_scale: f32::NAN,
            ..options(0, -1, -1, 50.0)
        };
        assert_eq!(check(&nan_scale), FLASHCORE_ERROR_INVALID_ARGUMENT);
        // Without a cap the call is flashcore_check_forward_window's: the same code and
        // message (but for the name) on good and bad arguments alike.
        let mut d48 = o;
        d48.shape[3] = 48;
        let mut misaligned = o;
        misaligned.ptr += 2;
        for (o, scale, right) in [
            (o, 0.0, 0),
            (o, f32::NAN, 0),
            (o, 0.0, 3),
            (d48, 0.0, 0),
            (misaligned, 0.0, -1),
        ] {
            // SAFETY: every tensor pointer points at a live local.
            let windowed =
                unsafe { flashcore_check_forward_window(&q, &k, &v, &o, 0, scale, 1, 15, right) };
            let windowed_message = last_error();
            let opts = FlashcoreAttentionOptions::uncapped(scale, 1, 15, right);
            // SAFETY: as above.
            let ex = unsafe { flashcore_check_forward_ex(&q, &k, &v, &o, 0, &opts) };
            assert_eq!(windowed, ex);
            if ex != FLASHCORE_SUCCESS {
                assert_eq!(
                    windowed_message.strip_prefix("flashcore_check_forward_window: "),
                    last_error().strip_prefix("flashcore_check_forward_ex: ")
                );
            }
        }
        // Null options, as a null struct pointer; a null tensor is reported before them.
        // SAFETY: null pointers are allowed and reported.
        let rc = unsafe { flashcore_check_forward_ex(&q, &k, &v, &o, 0, ptr::null()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_forward_ex: opts is a null pointer"
        );
        // SAFETY: as above.
        let rc = unsafe { flashcore_check_forward_ex(&q, ptr::null(), &v, &o, 0, ptr::null()) };
        assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_forward_ex: k is a null pointer"
        );
        // A struct_size other than this library's (32) is refused, whatever the options:
        // not from FLASHCORE_ATTENTION_OPTIONS_INIT, or from a newer header.
        for (struct_size, why) in [
            (0, "FLASHCORE_ATTENTION_OPTIONS_INIT"),
            (24, "FLASHCORE_ATTENTION_OPTIONS_INIT"),
            (36, "FLASHCORE_ATTENTION_OPTIONS_INIT"),
            (40, "newer flashcore header"),
            (u32::MAX - 7, "newer flashcore header"),
        ] {
            let opts = FlashcoreAttentionOptions {
                struct_size,
                ..options(1, 15, 0, 50.0)
            };
            assert_eq!(
                check(&opts),
                FLASHCORE_ERROR_INVALID_ARGUMENT,
                "{struct_size}"
            );
            let message = last_error();
            assert!(
                message.starts_with(&format!(
                    "flashcore_check_forward_ex: invalid argument: opts.struct_size is \
                     {struct_size}"
                )) && message.contains(why),
                "{message}"
            );
        }
    }

    #[test]
    fn check_forward_varlen_ex_takes_the_options() {
        let at = |ptr: u64, rows: i64, heads: i64| FlashcoreTensor {
            ptr,
            dtype: FLASHCORE_BF16,
            shape: [1, rows, heads, 128],
            strides: [0, heads * 128, 128, 1],
        };
        let (q, k, v, o) = (
            at(1 << 30, 300, 8),
            at(2 << 30, 500, 2),
            at(3 << 30, 500, 2),
            at(4 << 30, 300, 8),
        );
        let varlen = FlashcoreVarlen {
            cu_seqlens_q: 5 << 30,
            cu_seqlens_k: (5 << 30) + 64,
            batch: 2,
            max_seqlen_q: 200,
        };
        let (cu_q, cu_k, bad) = ([0i32, 100, 300], [0i32, 250, 500], [0i32, 100, 50]);
        let check = |host_q: &[i32], opts: *const FlashcoreAttentionOptions| {
            // SAFETY: every pointer points at a live local or is null; the host arrays hold
            // 3 int32s.
            unsafe {
                flashcore_check_forward_varlen_ex(
                    &q,
                    &k,
                    &v,
                    &o,
                    0,
                    &varlen,
                    host_q.as_ptr(),
                    cu_k.as_ptr(),
                    opts,
                )
            }
        };
        for cap in [0.0, 50.0, 30.0, 5.0] {
            for (causal, left, right) in [(1, -1, -1), (1, 15, 0), (0, 50, 7)] {
                let opts = options(causal, left, right, cap);
                assert_eq!(
                    check(&cu_q, &opts),
                    FLASHCORE_SUCCESS,
                    "{opts:?}: {}",
                    last_error()
                );
            }
        }
        for cap in [-5.0, f32::NAN, f32::INFINITY] {
            assert_eq!(
                check(&cu_q, &options(1, 15, 0, cap)),
                FLASHCORE_ERROR_INVALID_ARGUMENT
            );
            let message = last_error();
            assert!(
                message.starts_with("flashcore_check_forward_varlen_ex: ")
                    && message.contains("softcap"),
                "{message}"
            );
        }
        // The host offsets are checked under a cap too; null options are refused.
        assert_eq!(
            check(&bad, &options(1, -1, -1, 50.0)),
            FLASHCORE_ERROR_INVALID_ARGUMENT
        );
        assert_eq!(check(&cu_q, ptr::null()), FLASHCORE_ERROR_NULL_ARGUMENT);
        assert_eq!(
            last_error(),
            "flashcore_check_forward_varlen_ex: opts is a null pointer"
        );
        // A struct_size other than this library's is refused.
        for struct_size in [0, 16, 33, 48] {
            let opts = FlashcoreAttentionOptions {
                struct_size,
                ..options(1, -1, -1, 50.0)
            };
            assert_eq!(check(&cu_q, &opts), FLASHCORE_ERROR_INVALID_ARGUMENT);
            assert!(
                last_error().starts_with(
                    "flashcore_check_forward_varlen_ex: invalid argument: opts.struct_size"
                ),
                "{}",
                last_error()
            );
        }
    }

    /// flashcore_check_decode_varlen on packed `[1, rows, 4, 64]` q (o at 5 GB) over
    /// [`cache`], offsets at 6 GB.
    fn check_varlen(
        rows: i64,
        c: &FlashcoreKvCache,
        (batch, max): (i64, i64),
        host: Option<&[i32]>,
        lse: u64,
    ) -> i32 {
        let q = bshd(4 * GB, [1, rows, 4, 64]);
        let o = FlashcoreTensor { ptr: 5 * GB, ..q };
        let opts = FlashcoreAttentionOptions::uncapped(0.0, 1, -1, -1);
        let host = host.map_or(ptr::null(), <[i32]>::as_ptr);
        let (none, scales) = (ptr::null(), ptr::null());
        // SAFETY: the structs are live locals; the host offsets are null or a live slice
        // the callers size for the batch.
        unsafe {
            flashcore_check_decode_varlen(
                &q,
                c,
                scales,
                6 * GB,
                batch,
                max,
                host,
                none,
                none,
                &o,
                lse,
                &opts,
            )
        }
    }

    #[test]
    fn check_decode_varlen_applies_the_packed_rules_without_a_device() {
        for paged in [false, true] {
            let c = cache(paged);
            let ok = check_varlen(40, &c, (2, 16), Some(&[0, 1, 17]), 6 * GB + 64);
            assert_eq!(ok, FLASHCORE_SUCCESS, "{}", last_error());
            assert_eq!(check_varlen(40, &c, (2, 300), None, 0), FLASHCORE_SUCCESS);
        }
        let c = cache(true);
        let cases: [(i64, i64, Option<&[i32]>, i32); 6] = [
            (0, 16, None, FLASHCORE_ERROR_EMPTY_DIMENSION),
            (-1, 16, None, FLASHCORE_ERROR_INVALID_ARGUMENT),
            (2, 0, None, FLASHCORE_ERROR_INVALID_ARGUMENT),
            (2, 16, Some(&[0, 20, 10]), FLASHCORE_ERROR_INVALID_ARGUMENT),
            (2, 16, Some(&[0, 20, 41]), FLASHCORE_ERROR_INVALID_ARGUMENT),
            (2, 16, Some(&[0, 17, 20]), FLASHCORE_ERROR_INVALID_ARGUMENT),
        ];
        for (batch, max, host, code) in cases {
            let got = check_varlen(40, &c, (batch, max), host, 0);
            assert_eq!(got, code, "{batch} {max} {host:?}: {}", last_error());
        }
        assert!(last_error().starts_with("flashcore_check_decode_varlen: "));
        // A contiguous cache of 2 sequences serves no batch of 3.
        let got = check_varlen(40, &cache(false), (3, 16), None, 0);
        assert_eq!(got, FLASHCORE_ERROR_SHAPE_MISMATCH);
        // The LSE over the offsets ([4, 40] floats from 6 GB − 64).
        let got = check_varlen(40, &c, (2, 16), None, 6 * GB - 64);
        assert_eq!(got, FLASHCORE_ERROR_INVALID_ARGUMENT);
        // No context: a typed error, nothing else.
        let mut out = 7usize;
        let q = bshd(4 * GB, [1, 40, 4, 64]);
        // SAFETY: the structs and `out` are live locals; a null context is refused.
        let rc = unsafe {
            flashcore_decode_varlen_workspace_bytes(
                ptr::null_mut(),
                &q,
                &c,
                ptr::null(),
                6 * GB,
                2,
                16,
                &mut out,
            )
        };
        assert_eq!((rc, out), (FLASHCORE_ERROR_NULL_ARGUMENT, 0));
    }

    #[test]
    fn decode_ex_checks_take_the_options() {
        let table: Vec<i32> = (0..8).collect();
        let q = query(4, 8, 4 * GB);
        let o = FlashcoreTensor { ptr: 5 * GB, ..q };
        // What a decode call runs with: the cap reaches the problem, checked.
        let read = |opts: &FlashcoreAttentionOptions| {
            let c = cache(false);
            // SAFETY: every struct pointer points at a live local; no scales, no host
            // arrays.
            let call = unsafe {
                DecodeCall::read(&q, &c, ptr::null(), ptr::null(), ptr::null(), &o, 0, opts)
            };
            call.map(|call| (call.problem.softcap, call.problem.window.is_some()))
                .map_err(|f| f.code)
        };
        assert_eq!(read(&options(1, -1, -1, 0.0)), Ok((None, false)));
        assert_eq!(read(&options(1, 15, 0, -0.0)), Ok((None, true)));
        assert_eq!(read(&options(1, 15, 0, 50.0)), Ok((Some(50.0), true)));
        assert_eq!(read(&options(0, -1, -1, 5.0)), Ok((Some(5.0), false)));
        assert_eq!(
            read(&options(1, -1, -1, -50.0)),
            Err(FLASHCORE_ERROR_INVALID_ARGUMENT)
        );
        for paged in [false, true] {
            let c = cache(paged);
            let lens = [40, 64];
            let table = if paged { table.as_ptr() } else { ptr::null() };
            let check16 = |opts: *const FlashcoreAttentionOptions| {
                // SAFETY: every pointer points at a live local or is null; the host arrays
                // hold 2 lengths and (paged) the 8 entries of the [2, 4] table.
                unsafe { flashcore_check_decode_ex(&q, &c, lens.as_ptr(), table, &o, 0, opts) }
            };
            let (c8, s8) = fp8_cache(paged);
            let check8 = |opts: *const FlashcoreAttentionOptions| {
                // SAFETY: as above.
                unsafe {
                    flashcore_check_decode_fp8kv_ex(&q, &c8, &s8, lens.as_ptr(), table, &o, 0, opts)
                }
            };
            for (name, check) in [
                ("flashcore_check_decode_ex", &check16 as &dyn Fn(_) -> i32),
                ("flashcore_check_decode_fp8kv_ex", &check8),
            ] {
                for cap in [0.0, 50.0, 30.0, 5.0] {
                    for (causal, left, right) in [(1, -1, -1), (1, 15, 0), (0, 7, 3)] {
                        let opts = options(causal, left, right, cap);
                        assert_eq!(
                            check(&opts),
                            FLASHCORE_SUCCESS,
                            "{name} {opts:?}: {}",
                            last_error()
                        );
                    }
                }
                for cap in [-1.0, f32::NAN, f32::NEG_INFINITY, f32::MAX] {
                    assert_eq!(
                        check(&options(1, 15, 0, cap)),
                        FLASHCORE_ERROR_INVALID_ARGUMENT,
                        "{name} {cap}"
                    );
                    let message = last_error();
                    assert!(
                        message.starts_with(&format!("{name}: ")) && message.contains("softcap"),
                        "{message}"
                    );
                }
                assert_eq!(check(ptr::null()), FLASHCORE_ERROR_NULL_ARGUMENT);
                assert_eq!(last_error(), format!("{name}: opts is a null pointer"));
                for struct_size in [0, 28, 40, 1 << 20] {
                    let opts = FlashcoreAttentionOptions {
                        struct_size,
                        ..options(1, 15, 0, 50.0)
                    };
                    assert_eq!(
                        check(&opts),
                        FLASHCORE_ERROR_INVALID_ARGUMENT,
                        "{name} {struct_size}"
                    );
                    let message = last_error();
                    assert!(
                        message.starts_with(&format!(
                            "{name}: invalid argument: opts.struct_size is {struct_size}"
                        )),
                        "{message}"
                    );
                }
            }
        }
    }

    #[test]
    fn ex_calls_refuse_a_null_context() {
        let t = tensor(FLASHCORE_F16);
        let (q, c) = (query(1, 4, 4 * GB), cache(false));
        let o = FlashcoreTensor { ptr: 5 * GB, ..q };
        let (_, s) = fp8_cache(false);
        let varlen = FlashcoreVarlen {
            cu_seqlens_q: GB,
            cu_seqlens_k: 2 * GB,
            batch: 1,
            max_seqlen_q: 128,
        };
        let opts = options(1, 15, 0, 50.0);
        let (null, stream) = (ptr::null(), ptr::null_mut());
        let refused = |rc: i32, name: &str| {
            assert_eq!(rc, FLASHCORE_ERROR_NULL_ARGUMENT, "{name}");
            assert_eq!(last_error(), format!("{name}: ctx is a null pointer"));
        };
        // SAFETY: a null context is allowed and reported; the rest are live locals.
        let rc = unsafe { flashcore_forward_ex(ptr::null_mut(), &t, &t, &t, &t, 0, &opts, stream) };
        refused(rc, "flashcore_forward_ex");
        // SAFETY: as above, the options null too: the context is reported first.
        let rc = unsafe {
            flashcore_forward_ex(ptr::null_mut(), &t, &t, &t, &t, 0, ptr::null(), stream)
        };
        refused(rc, "flashcore_forward_ex");
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_forward_varlen_ex(
                ptr::null_mut(),
                &t,
                &t,
                &t,
                &t,
                0,
                &varlen,
                null,
                null,
                &opts,
                stream,
            )
        };
        refused(rc, "flashcore_forward_varlen_ex");
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_decode_ex(
                ptr::null_mut(),
                &q,
                &c,
                null,
                null,
                &o,
                0,
                &opts,
                0,
                0,
                stream,
            )
        };
        refused(rc, "flashcore_decode_ex");
        // SAFETY: as above.
        let rc = unsafe {
            flashcore_decode_fp8kv_ex(
                ptr::null_mut(),
                &q,
                &c,
                &s,
                null,
                null,
                &o,
                0,
                &opts,
                0,
                0,
                stream,
            )
        };
        refused(rc, "flashcore_decode_fp8kv_ex");
    }
}
