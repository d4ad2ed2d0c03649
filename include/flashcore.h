/*
 * flashcore.h - C interface of flashcore: FlashAttention forward kernels (with a sliding
 * key window in the _window calls; with every option, logit soft-capping included, in the
 * _ex calls), the serving
 * calls (decode against a contiguous or paged KV cache of 16-bit or FP8 values, appending
 * to it, merging partial results by their log-sum-exp) and FP8 (e4m3) attention with its
 * GPU quantizer,
 * generated at run time as PTX and launched through the CUDA driver (libcuda, loaded at
 * run time).
 *
 * Link with -lflashcore (libflashcore.so) or with libflashcore.a plus -lpthread -ldl -lm.
 * Needs an NVIDIA GPU of compute capability 8.0 or newer and its driver at run time only.
 *
 * Conventions:
 *   - Every function that can fail returns FLASHCORE_SUCCESS (0) or one of the
 *     FLASHCORE_ERROR_* codes below; flashcore_last_error() then says why, in words.
 *   - Tensors are views of device memory described by FlashcoreTensor: logical dimensions
 *     [batch, seq, heads, head_dim] in that order whatever the memory order, strides in
 *     ELEMENTS (not bytes). A PyTorch [B, H, S, D] tensor t is passed with
 *     strides = {t.stride(0), t.stride(2), t.stride(1), t.stride(3)}.
 *   - All memory belongs to the device's primary context (the one the CUDA runtime and
 *     PyTorch use). flashcore makes that context current only while one of its calls
 *     runs: every function returns with the calling thread's current CUDA context as it
 *     found it (the caller's own context, another device's, or none), on success and on
 *     every error. A caller that works in a context of its own need not save and restore
 *     it around flashcore calls.
 *   - "On error nothing is launched or written" (said of most calls below) holds for
 *     every argument error and every failure before the call's first launch. A call that
 *     queues several kernels (a decode with its merge, decode_varlen's two kinds of runs,
 *     the FP8 quantizer's passes) can still fail at a later launch (FLASHCORE_ERROR_DRIVER,
 *     a broken context or an exhausted device); what the earlier kernels write then stands.
 */
#ifndef FLASHCORE_H
#define FLASHCORE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element types (FlashcoreTensor.dtype) ------------------------------------------- */

#define FLASHCORE_F16 1  /* IEEE binary16 */
#define FLASHCORE_BF16 2 /* bfloat16 */
#define FLASHCORE_F32 3  /* float32: merge parts and outputs, FP8 KV cache scales */
#define FLASHCORE_E4M3 4 /* FP8 E4M3 (e4m3fn) codes: FlashcoreFp8Operands' q and k, FP8 KV caches */

/* ---- return codes -------------------------------------------------------------------- */
/* (src/error.rs holds the table these lines are checked against: values, names, comments) */

#define FLASHCORE_SUCCESS 0                    /* the call succeeded */
#define FLASHCORE_ERROR_NO_DRIVER 1            /* libcuda could not be loaded */
#define FLASHCORE_ERROR_NO_DEVICE 2            /* no device with that ordinal */
#define FLASHCORE_ERROR_UNSUPPORTED_GPU 3      /* below sm_80 (FP8: sm_89): no kernel path */
#define FLASHCORE_ERROR_SHAPE_MISMATCH 4       /* tensors disagree on a dimension */
#define FLASHCORE_ERROR_BAD_STRIDES 5          /* unusable or negative stride, or a range past the address space */
#define FLASHCORE_ERROR_EMPTY_DIMENSION 6      /* a dimension is zero */
#define FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM 7 /* head_dim has no kernel (forward, decode, merge: a multiple of 8 up to 256; FP8 and e4m3 caches: 64, 128, 256) */
#define FLASHCORE_ERROR_UNSUPPORTED_DTYPE 8    /* not f16/bf16 (FP8: e4m3 codes), mixed, or unknown code */
#define FLASHCORE_ERROR_HEAD_RATIO 9           /* q heads not a multiple of k/v heads */
#define FLASHCORE_ERROR_NULL_POINTER 10        /* a device pointer is 0 (tensor, lse parts, lengths, table, offsets, workspace) */
#define FLASHCORE_ERROR_MISALIGNED 11          /* pointer not aligned (tensors 16 B; lse, scales, lengths, tables, offsets 4 B; decode workspace 256 B) */
#define FLASHCORE_ERROR_INVALID_ARGUMENT 12    /* bad scale, negative shape or ordinal, overlap, too large */
#define FLASHCORE_ERROR_PTX 13                 /* kernel generation failed (a flashcore bug) */
#define FLASHCORE_ERROR_MODULE_LOAD 14         /* the driver's JIT refused the kernel */
#define FLASHCORE_ERROR_DRIVER 15              /* another CUDA driver call failed */
#define FLASHCORE_ERROR_TENSOR_MAP 16          /* a tensor cannot be described to TMA */
#define FLASHCORE_ERROR_NULL_ARGUMENT 100      /* a null host pointer (ctx, tensor struct, out) */
#define FLASHCORE_ERROR_PANIC 101              /* internal panic caught (a flashcore bug) */

/* ---- types --------------------------------------------------------------------------- */

/* A CUDA stream: the driver API's CUstream or the runtime's cudaStream_t (same type).
 * NULL is the legacy default stream of the primary context. */
typedef struct CUstream_st *flashcore_stream;

/* A view of a 4-d device tensor. 80 bytes, 8-byte aligned (4 bytes of padding follow
 * dtype). Logical dimensions [batch, seq, heads, head_dim]; negative values are errors. */
typedef struct FlashcoreTensor {
    uint64_t ptr;       /* device address (CUdeviceptr) of element [0, 0, 0, 0] */
    int32_t dtype;      /* FLASHCORE_F16, FLASHCORE_BF16, FLASHCORE_F32 or FLASHCORE_E4M3 */
    int64_t shape[4];   /* [batch, seq, heads, head_dim] */
    int64_t strides[4]; /* in elements; strides[3] must be 1 */
} FlashcoreTensor;

/* A KV cache of a batch of B sequences. 192 bytes, 8-byte aligned, no padding.
 *
 * Contiguous cache: block_table, max_pages and table_stride all 0; k and v are
 *   [B, capacity, Hkv, D]: position p of sequence b is k[b, p].
 * Paged cache: anything else; k and v are pools [pages, page_size, Hkv, D] (pages at most
 *   2^31 - 1: an int32 table names no more), page_size a power of two from 1 to 1024, and
 *   block_table is a device int32 array [B, max_pages] (4-byte aligned) whose rows are
 *   table_stride (>= max_pages) elements apart: position p of sequence b is row
 *   p % page_size of page block_table[b * table_stride + p / page_size]. The capacity is
 *   max_pages * page_size.
 * Either way k and v share one dtype (f16 or bf16; or FLASHCORE_E4M3 codes, with their
 * FlashcoreKvScales, in the _fp8kv calls) and shape, with pointers 16-byte
 * aligned, strides[3] == 1 and other strides multiples of 16 bytes (strides[1], and
 * paged strides[0], below 4 GiB in bytes where that extent is above 1); the capacity is at
 * most 2^30; seqlens is a device int32 array [B] (4-byte aligned) holding each sequence's
 * length. The lengths and the block table are read by the kernels on the device (so a
 * captured CUDA graph sees them as they are when it replays); whatever they hold, the
 * kernels stay inside the cache: lengths are clamped to [0, capacity], block-table entries
 * outside [0, pages) are never followed. Host copies passed to a call (host_seqlens,
 * host_block_table) turn such values into FLASHCORE_ERROR_INVALID_ARGUMENT first. */
typedef struct FlashcoreKvCache {
    FlashcoreTensor k;     /* keys: [B, capacity, Hkv, D] or pool [pages, page_size, Hkv, D] */
    FlashcoreTensor v;     /* values: k's dtype and shape */
    uint64_t seqlens;      /* device address of int32 [B]: each sequence's length */
    uint64_t block_table;  /* device address of int32 [B, table_stride] (paged), or 0 */
    int64_t max_pages;     /* pages per sequence (paged), or 0 */
    int64_t table_stride;  /* elements between block-table rows, >= max_pages (paged; any with B = 1), or 0 */
} FlashcoreKvCache;

/* The scales of an FP8 KV cache (the _fp8kv serving calls), whose k and v then hold e4m3
 * codes (dtype FLASHCORE_E4M3) of head dim 64, 128 or 256. 160 bytes, 8-byte aligned.
 *
 *   k_scale, v_scale: dtype FLASHCORE_F32, shape the cache's first three dimensions and 1:
 *       [B, capacity, Hkv, 1] (contiguous cache) or [pages, page_size, Hkv, 1] (paged),
 *       so a position's scales live where its codes do: element (i, p, h, 0) is the scale
 *       of row (i, p, h) of k (of v): each value of that row is its code times the scale.
 *       Pointers 4-byte aligned; strides free (in elements, each >= 0; strides[3] is
 *       not used beyond that).
 *       flashcore_append_kv_fp8kv writes one scale per (position, KV head) row, the
 *       row's largest finite magnitude / 448 (the e4m3 maximum), then the row's codes
 *       (an infinite or NaN value gets the NaN code, which decode reads as NaN): its
 *       scales may not have two elements at one address, nor overlap each other or the
 *       codes. A decode only reads them, so its scales may share memory (one tensor for
 *       both) and repeat through zero strides: one per KV head ({0, 0, 1, 1}), per
 *       sequence and KV head of a contiguous cache ({Hkv, 0, 1, 1}, FlashAttention-3's
 *       descales), or one for the whole cache ({0, 0, 0, 0}). Scales are finite and not
 *       negative, as the append writes them. */
typedef struct FlashcoreKvScales {
    FlashcoreTensor k_scale; /* float32 [B, capacity, Hkv, 1] or [pages, page_size, Hkv, 1] */
    FlashcoreTensor v_scale; /* float32, k_scale's shape */
} FlashcoreKvScales;

/* A batch of sequences of different lengths packed without padding (flashcore_forward_varlen):
 * sequence b is query rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and o and key rows
 * cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k and v. The offset arrays are device int32
 * arrays of batch + 1 entries (4-byte aligned), read by the kernel on the device. 32 bytes. */
typedef struct FlashcoreVarlen {
    uint64_t cu_seqlens_q; /* device address of int32 [batch + 1] query offsets */
    uint64_t cu_seqlens_k; /* device address of int32 [batch + 1] key offsets */
    int64_t batch;         /* number of sequences, 1 ..= 65535 */
    int64_t max_seqlen_q;  /* at least the longest query sequence, 1 ..= 2^25 */
} FlashcoreVarlen; /* total_q and total_k (all sequences' rows) are at most 2^25 too */

/* The FP8 operands of flashcore_forward_fp8, as flashcore_quantize_fp8 writes them (or any
 * producer of the same data contract). 256 bytes, 8-byte aligned.
 *
 *   q:  e4m3 codes [B, Sq, Hq, D] (dtype FLASHCORE_E4M3), D in {64, 128, 256}; the
 *       tensor rules of flashcore_forward (16-byte aligned, strides[3] == 1, other strides
 *       multiples of 16 bytes).
 *   k:  e4m3 codes [B, Sk, Hkv, D], likewise.
 *   vt, vt_shape, vt_strides: V transposed, e4m3 [B, Hkv, D, pitch] at device address vt
 *       (16-byte aligned): row (b, h, d) holds the keys' values of channel d, contiguous,
 *       rows vt_strides[2] = pitch elements (bytes) apart, pitch a multiple of 16 and at
 *       least Sk rounded up to 16; vt_strides[0], [1] step batches and heads (multiples of
 *       16). Inside every group of 16 keys, stored position p holds key
 *       {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15}[p] of the group; positions
 *       of keys >= Sk must hold finite values (the quantizer writes zeros).
 *       vt_shape is [B, Hkv, D, Sk].
 *   q_scale: device float32 [B, Hq, ceil(Sq / 128)], contiguous, 4-byte aligned: one scale
 *       per block of 128 rows of one (batch, head); a value is its code times its scale.
 *       q_scale and k_scale must be finite and not negative (amax / 448 is, or 1 for a
 *       block of zeros): the kernels clamp each block pair's product into the normal
 *       floats, so a negative or NaN one gives that pair logits of about 0 (the mean of
 *       its values), not an error; the host never reads the device values.
 *   k_scale, v_scale: device float32 [B, Hkv, ceil(Sk / 128)] each, likewise per 128 keys.
 *   lse_shift: 0, or device float32 [B, Hq, Sq] (4-byte aligned) added, times the softmax
 *       scale, to each row's log-sum-exp (the quantizer's q . mean_k with K smoothing, which
 *       makes the LSE the one of the unsmoothed keys). */
typedef struct FlashcoreFp8Operands {
    FlashcoreTensor q;     /* e4m3 [B, Sq, Hq, D] */
    FlashcoreTensor k;     /* e4m3 [B, Sk, Hkv, D] */
    uint64_t vt;           /* device address of e4m3 V^T [B, Hkv, D, pitch] */
    int64_t vt_shape[4];   /* [B, Hkv, D, Sk] */
    int64_t vt_strides[3]; /* batch, head and row (pitch) strides, in elements (bytes) */
    uint64_t q_scale;      /* device address of float32 [B, Hq, ceil(Sq / 128)] */
    uint64_t k_scale;      /* device address of float32 [B, Hkv, ceil(Sk / 128)] */
    uint64_t v_scale;      /* device address of float32 [B, Hkv, ceil(Sk / 128)] */
    uint64_t lse_shift;    /* device address of float32 [B, Hq, Sq], or 0 */
} FlashcoreFp8Operands;

/* Options of the FP8 quantizer (flashcore_quantize_fp8). All zeros: none. Each leaves
 * softmax(q k^T) v unchanged in exact arithmetic; they change how the rounding falls.
 * 16 bytes. */
typedef struct FlashcoreQuantizeOptions {
    int32_t smooth_k;       /* non-zero: subtract K's per-channel mean over the sequence before
                               quantizing K (helps keys with per-channel offsets); the operands
                               then carry lse_shift */
    int32_t hadamard;       /* non-zero: rotate Q and K by a random-sign Hadamard transform along
                               the head dim (spreads outlier channels) */
    uint64_t hadamard_seed; /* the seed the transform's signs are drawn from (when hadamard) */
} FlashcoreQuantizeOptions;

/* The options of the attention calls' _ex spellings (flashcore_forward_ex,
 * flashcore_forward_varlen_ex, flashcore_decode_ex, flashcore_decode_fp8kv_ex and their
 * checks), which take them in place of softmax_scale and causal: one struct, so that an
 * option added later needs no new spelling of every call. 32 bytes, 8-byte aligned, no
 * padding: struct_size at offset 0, softmax_scale 4, window_left 8, window_right 16,
 * causal 24, softcap 28.
 *
 * Always start from FLASHCORE_ATTENTION_OPTIONS_INIT, then set the options wanted:
 *     FlashcoreAttentionOptions opts = FLASHCORE_ATTENTION_OPTIONS_INIT;
 *     opts.causal = 1;
 *     opts.softcap = 50.0f;
 * The macro is no options, the plain calls' defaults (the default scale, no causal mask,
 * no window, no cap), with struct_size set. All zeros is NOT "no options": its
 * struct_size of 0 is refused (and window sides of 0 would be a window of one key, each
 * row seeing its diagonal key only).
 *
 * Versioning: struct_size is sizeof(FlashcoreAttentionOptions) as the caller's copy of
 * this header has it, which the macro fills in. Options added later go at the end, grow
 * the struct by a multiple of 8 bytes and default to "off" in the macro; the library
 * reads only struct_size bytes (struct_size first, then the rest), so a program built
 * against an older header keeps working with a newer library, the options it does not
 * know at their defaults. The library refuses with FLASHCORE_ERROR_INVALID_ARGUMENT, and
 * reads nothing past struct_size:
 *   - a struct_size below 32 (this first version's size) or not a multiple of 8: the
 *     options were not initialized with FLASHCORE_ATTENTION_OPTIONS_INIT;
 *   - a struct_size above the library's own sizeof(FlashcoreAttentionOptions): options
 *     from a newer header than the library, which would otherwise silently ignore the
 *     options it does not know and give wrong answers.
 *
 *   struct_size:   sizeof(FlashcoreAttentionOptions), from FLASHCORE_ATTENTION_OPTIONS_INIT.
 *   softmax_scale: as flashcore_forward's: 0 for the default 1/sqrt(D); otherwise finite
 *                  and positive.
 *   window_left, window_right: the key window, as flashcore_forward_window takes it (a
 *                  negative side unbounded; causal with window_right > 0 is
 *                  FLASHCORE_ERROR_INVALID_ARGUMENT).
 *   causal:        as flashcore_forward's: non-zero for a causal mask aligned bottom-right.
 *   softcap:       logit soft-capping (Gemma 2, Grok; FlashAttention's softcap): 0 (either
 *                  sign) for none; otherwise each scaled score x = q . k * softmax_scale
 *                  becomes softcap * tanh(x / softcap) before masking and the softmax, and
 *                  lse is the log-sum-exp of the capped scores. A cap must be finite and
 *                  positive, with softmax_scale / softcap a normal float and softcap * log2(e)
 *                  finite: a negative, NaN or infinite one (or one that far from the scale)
 *                  is FLASHCORE_ERROR_INVALID_ARGUMENT. Gemma 2 caps at 50, Grok at 30.
 *                  A capped call runs kernels of its own, generated on first use. The FP8
 *                  forward (flashcore_forward_fp8) has no cap. */
typedef struct FlashcoreAttentionOptions {
    uint32_t struct_size; /* sizeof(FlashcoreAttentionOptions): the struct's version */
    float softmax_scale;  /* 0: 1/sqrt(D); otherwise finite and positive */
    int64_t window_left;  /* keys a row sees before its diagonal; negative: unbounded */
    int64_t window_right; /* keys a row sees after its diagonal; negative: unbounded */
    int32_t causal;       /* non-zero: causal mask, aligned bottom-right */
    float softcap;        /* 0: no cap; > 0: scores become softcap * tanh(score / softcap) */
} FlashcoreAttentionOptions;

/* No options, in this header's size: the initializer every FlashcoreAttentionOptions
 * should start from (struct_size, softmax_scale, window_left, window_right, causal,
 * softcap). */
#define FLASHCORE_ATTENTION_OPTIONS_INIT {(uint32_t)sizeof(FlashcoreAttentionOptions), 0.0f, -1, -1, 0, 0.0f}

/* Attention on one device: owns the kernels loaded for it. Opaque. */
typedef struct FlashcoreContext FlashcoreContext;

/* ---- functions ----------------------------------------------------------------------- */

/* Opens device `device_ordinal` (driver ordinal, as CUDA_VISIBLE_DEVICES maps it) and
 * creates a context on it. On success *out is the new context; on failure *out is NULL.
 * Returns FLASHCORE_ERROR_NO_DRIVER on a machine without the NVIDIA driver.
 * With FLASHCORE_NO_PDL set in the environment (to anything but "" or "0") when the
 * context is created, its decode steps launch their combine plainly rather than
 * programmatically on Hopper, as GPUs before Hopper do. */
int32_t flashcore_create(int32_t device_ordinal, FlashcoreContext **out);

/* Destroys a context and unloads its kernels. NULL is a no-op. No other thread may be
 * inside a call on the context or make one later (the context is freed), work already
 * queued on a stream must have finished, and CUDA graphs that captured the context's
 * calls must not be launched again (their kernels are gone). */
void flashcore_destroy(FlashcoreContext *ctx);

/* o = softmax(q k^T * scale) v, asynchronously on `stream`.
 *
 *   q: [B, Sq, Hq, D]    k, v: [B, Sk, Hkv, D]    o: [B, Sq, Hq, D] (written)
 *   all of one dtype (f16 or bf16), D a multiple of 8 up to 256 (kernels for 32, 64, 96, 128, 192,
 *   256, on Hopper 64, 128, 192, 256; the others run on the next larger one, their extra
 *   columns zero-filled and never written), Hq a multiple of Hkv (GQA/MQA),
 *   pointers 16-byte aligned, strides[3] == 1 and other strides multiples of 16 bytes.
 *   lse:           0, or a device pointer to float32 [B, Hq, Sq] (contiguous) that receives
 *                  the natural-log log-sum-exp of each row's scaled scores.
 *   softmax_scale: 0 for the default 1/sqrt(D); otherwise finite and positive.
 *   causal:        non-zero for a causal mask aligned bottom-right: query i sees key j iff
 *                  j <= i + Sk - Sq. A row that sees no key gets zeros (and lse -inf).
 *   stream:        NULL for the default stream.
 *
 * Size limits: Sq and Sk each at most 2^25 (33554432); B <= 65535 and Hq <= 65535 (they
 * become launch grid dimensions); a larger value is FLASHCORE_ERROR_INVALID_ARGUMENT.
 * Within these limits every index and offset the kernels compute is exact, however large
 * the tensors (offsets are 64-bit), as long as each tensor's byte range fits the 64-bit
 * address space, and the softmax sums keep f32's integer precision even for a row of
 * 2^25 equal scores.
 *
 * All arguments are checked before anything runs; on error nothing is launched or
 * written. The first call for a (dtype, head_dim, causal) configuration generates and
 * JIT-loads its kernel (milliseconds); later calls only launch, with one allocation at
 * most, from the stream-ordered allocator (cuMemAllocAsync) and freed on `stream` behind
 * the launch: a causal Hopper call whose work items outnumber the SMs takes a
 * 4-byte tile counter, zeroed there (where that allocator is unavailable, the call runs
 * one block per work item instead); a call of at most 16 queries per sequence that runs
 * on the split-KV decode kernels (see flashcore_decode; at least 1536 keys, 512 where
 * 128 or more KV heads each serve 4 query heads or more) takes its splits' partial
 * results (where that allocator is unavailable, the forward kernels run the call). Calls
 * can be captured in a CUDA graph (stream-ordered allocations are capturable). A context
 * may be shared by threads. */
int32_t flashcore_forward(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreTensor *k,
                          const FlashcoreTensor *v, const FlashcoreTensor *o, uint64_t lse,
                          float softmax_scale, int32_t causal, flashcore_stream stream);

/* Checks the arguments of a flashcore_forward call (same meaning) against every rule
 * flashcore_forward applies before launching, without a context, a GPU or a driver: the
 * pointers are only checked as numbers (non-null, aligned, not overlapping), never read.
 * Returns FLASHCORE_SUCCESS or the code flashcore_forward would return for them. */
int32_t flashcore_check_forward(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                const FlashcoreTensor *v, const FlashcoreTensor *o, uint64_t lse,
                                float softmax_scale, int32_t causal);

/* Local (sliding-window) attention: flashcore_forward with a key window, FlashAttention's
 * window_size. The same parameters, with window_left and window_right after causal:
 *
 *   window_left, window_right: query row i, whose diagonal is key d = i + Sk - Sq (aligned
 *                  bottom-right, as causal), sees the keys d - window_left ..= d +
 *                  window_right that exist. A negative side (FlashAttention's -1; any
 *                  negative value) is unbounded: -1, -1 is flashcore_forward's call.
 *                  causal is window_right = 0, so causal with window_right > 0 is
 *                  FLASHCORE_ERROR_INVALID_ARGUMENT; with causal a negative window_right
 *                  means 0. The sliding window of w keys of Mistral or Gemma layers (each
 *                  query sees itself and the w - 1 keys before it) is causal with
 *                  window_left = w - 1. A row whose window holds no key gets zeros (and
 *                  lse -inf); lse sums the visible keys only.
 *
 * A window that bounds no row (window_left >= Sk, window_right >= Sq) is the call without
 * it; any other runs kernels of its own, generated on first use like the others, which
 * skip the key tiles no row of a query tile sees. All arguments are checked before
 * anything runs; on error nothing is launched or written. */
int32_t flashcore_forward_window(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreTensor *k,
                                 const FlashcoreTensor *v, const FlashcoreTensor *o, uint64_t lse,
                                 float softmax_scale, int32_t causal, int64_t window_left,
                                 int64_t window_right, flashcore_stream stream);

/* Checks the arguments of a flashcore_forward_window call (same meaning) as
 * flashcore_check_forward does, the window's rule included. Returns FLASHCORE_SUCCESS or the
 * code flashcore_forward_window would return for them. */
int32_t flashcore_check_forward_window(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                       const FlashcoreTensor *v, const FlashcoreTensor *o,
                                       uint64_t lse, float softmax_scale, int32_t causal,
                                       int64_t window_left, int64_t window_right);

/* flashcore_forward with its options as one struct: the same parameters, with `opts` (see
 * FlashcoreAttentionOptions: the scale, causal masking, the key window and the soft cap;
 * start from FLASHCORE_ATTENTION_OPTIONS_INIT) in place of softmax_scale and causal. opts
 * NULL is FLASHCORE_ERROR_NULL_ARGUMENT; a struct_size the library does not read (options
 * not started from the macro, or from a newer header) FLASHCORE_ERROR_INVALID_ARGUMENT.
 * With softcap 0 the call is flashcore_forward_window's with the same scale, causal flag
 * and window. All arguments are checked before anything runs; on error nothing is
 * launched or written. */
int32_t flashcore_forward_ex(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreTensor *k,
                             const FlashcoreTensor *v, const FlashcoreTensor *o, uint64_t lse,
                             const FlashcoreAttentionOptions *opts, flashcore_stream stream);

/* Checks the arguments of a flashcore_forward_ex call (same meaning) as
 * flashcore_check_forward does, the options' rules included. Returns FLASHCORE_SUCCESS or
 * the code flashcore_forward_ex would return for them. */
int32_t flashcore_check_forward_ex(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                   const FlashcoreTensor *v, const FlashcoreTensor *o, uint64_t lse,
                                   const FlashcoreAttentionOptions *opts);

/* Variable-length forward attention over packed sequences (FlashAttention's varlen
 * layout), one launch, no padding; asynchronous on `stream`.
 *
 *   q, o: [1, total_q, Hq, D]    k, v: [1, total_k, Hkv, D]   (batch extent 1; the rules
 *                  of flashcore_forward for dtype, D, heads, pointers and strides, and
 *                  its size limit on Sq and Sk for total_q and total_k: at most 2^25)
 *   lse:           0, or a device pointer to float32 [Hq, total_q] (contiguous).
 *   varlen:        the offsets (see FlashcoreVarlen); each sequence is attended to as a
 *                  flashcore_forward call of its own lengths would (causal: bottom-right per
 *                  sequence; a sequence with queries and no keys gets zeros and lse -inf).
 *                  Query rows no sequence covers are not written.
 *   host_cu_seqlens_q, host_cu_seqlens_k: both NULL, or host copies of the two offset
 *                  arrays (batch + 1 entries each, equal to the device's). Given, they must
 *                  start at 0 or more, never decrease, end within total_q (total_k), and no
 *                  query sequence may exceed max_seqlen_q: otherwise
 *                  FLASHCORE_ERROR_INVALID_ARGUMENT before anything runs. Without them the
 *                  kernel clamps every sequence to the tensors (it never reads or writes
 *                  outside them), query rows past max_seqlen_q are not computed, and
 *                  offsets that decrease give overlapping sequences whose rows of o and
 *                  lse are written by both, in no set order.
 *   softmax_scale, causal, stream: as for flashcore_forward.
 *
 * Each sequence sees only its own keys: rows of k and v that belong to another sequence
 * or to none never reach its output, whatever they hold (NaN and infinities included).
 * All arguments are checked before anything runs; on error nothing is launched or
 * written. Allocations as for flashcore_forward (the decode kernels take packed sequences
 * of at most 16 queries each). */
int32_t flashcore_forward_varlen(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                 const FlashcoreTensor *k, const FlashcoreTensor *v,
                                 const FlashcoreTensor *o, uint64_t lse,
                                 const FlashcoreVarlen *varlen, const int32_t *host_cu_seqlens_q,
                                 const int32_t *host_cu_seqlens_k, float softmax_scale,
                                 int32_t causal, flashcore_stream stream);

/* Checks the arguments of a flashcore_forward_varlen call (same meaning) without a
 * context, a GPU or a driver: device pointers are only checked as numbers; the host
 * offset arrays, when given, are read and checked. Returns FLASHCORE_SUCCESS or the code
 * flashcore_forward_varlen would return for them. */
int32_t flashcore_check_forward_varlen(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                       const FlashcoreTensor *v, const FlashcoreTensor *o,
                                       uint64_t lse, const FlashcoreVarlen *varlen,
                                       const int32_t *host_cu_seqlens_q,
                                       const int32_t *host_cu_seqlens_k, float softmax_scale,
                                       int32_t causal);

/* flashcore_forward_varlen with a key window (see flashcore_forward_window): the same
 * parameters, with window_left and window_right after causal. Each sequence is aligned on
 * its own: query i of a sequence of Sq queries and Sk keys has diagonal key i + Sk - Sq
 * of that sequence and sees its keys d - window_left ..= d + window_right (a negative side
 * unbounded; causal with window_right > 0 is FLASHCORE_ERROR_INVALID_ARGUMENT). All
 * arguments are checked before anything runs; on error nothing is launched or written. */
int32_t flashcore_forward_varlen_window(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                        const FlashcoreTensor *k, const FlashcoreTensor *v,
                                        const FlashcoreTensor *o, uint64_t lse,
                                        const FlashcoreVarlen *varlen, const int32_t *host_cu_seqlens_q,
                                        const int32_t *host_cu_seqlens_k, float softmax_scale,
                                        int32_t causal, int64_t window_left, int64_t window_right,
                                        flashcore_stream stream);

/* Checks the arguments of a flashcore_forward_varlen_window call (same meaning) as
 * flashcore_check_forward_varlen does, the window's rule included. */
int32_t flashcore_check_forward_varlen_window(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                              const FlashcoreTensor *v, const FlashcoreTensor *o,
                                              uint64_t lse, const FlashcoreVarlen *varlen,
                                              const int32_t *host_cu_seqlens_q,
                                              const int32_t *host_cu_seqlens_k, float softmax_scale,
                                              int32_t causal, int64_t window_left, int64_t window_right);

/* flashcore_forward_varlen with its options as one struct (see flashcore_forward_ex): the
 * same parameters, with `opts` in place of softmax_scale and causal. The key window is
 * aligned per sequence as flashcore_forward_varlen_window aligns it; the soft cap applies
 * to every sequence's scores. */
int32_t flashcore_forward_varlen_ex(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                    const FlashcoreTensor *k, const FlashcoreTensor *v,
                                    const FlashcoreTensor *o, uint64_t lse,
                                    const FlashcoreVarlen *varlen, const int32_t *host_cu_seqlens_q,
                                    const int32_t *host_cu_seqlens_k,
                                    const FlashcoreAttentionOptions *opts, flashcore_stream stream);

/* Checks the arguments of a flashcore_forward_varlen_ex call (same meaning) as
 * flashcore_check_forward_varlen does, the options' rules included. */
int32_t flashcore_check_forward_varlen_ex(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                          const FlashcoreTensor *v, const FlashcoreTensor *o,
                                          uint64_t lse, const FlashcoreVarlen *varlen,
                                          const int32_t *host_cu_seqlens_q,
                                          const int32_t *host_cu_seqlens_k,
                                          const FlashcoreAttentionOptions *opts);

/* ---- serving: decode, append, merge -------------------------------------------------- */
/* Host metadata, in the calls that take it: host_seqlens is NULL or a host int32
 * array of B lengths equal to the device's cache->seqlens; host_block_table is NULL or a
 * host int32 array of (B - 1) * table_stride + max_pages entries equal to the device's
 * block table. When host_seqlens is given, each length (plus the new tokens, for an
 * append) must be within the capacity and, for a paged cache, host_block_table must be
 * given too and every page those lengths reach must lie in the pool, no page named twice
 * among one sequence's (an append's new tokens must also not land on rows another
 * sequence's new tokens take); otherwise the call fails with
 * FLASHCORE_ERROR_INVALID_ARGUMENT before anything runs. host_block_table
 * without host_seqlens, or with a contiguous cache, is FLASHCORE_ERROR_INVALID_ARGUMENT. */

/* Decode: o = softmax(q k^T * scale) v for Sq new query tokens per sequence against the
 * cache, asynchronously on `stream`. Query i of Sq is position len - Sq + i of its
 * sequence (the lengths count the new tokens: append them first).
 *
 *   q, o:          [B, Sq, Hq, D], Sq >= 1 (up to 16 run on the split-KV decode kernels;
 *                  more, a prompt chunk after a cached prefix, on the forward kernels
 *                  where they read the cache: 16-bit, contiguous or, on Hopper, paged
 *                  with pages of 16 or more), of the cache's dtype; D a multiple of 8
 *                  up to 256 (one without a kernel of its own, 80 say, runs the next
 *                  larger of 32, 64, 96, 128, 192, 256 padded; an e4m3 cache: 64, 128,
 *                  256); Hq a multiple of Hkv (GQA/MQA); pointers
 *                  16-byte aligned, strides[3] == 1 and other strides multiples of 16 bytes.
 *   cache:         see FlashcoreKvCache; its batch is q's.
 *   host_seqlens, host_block_table: NULL, or host copies (see above).
 *   lse:           0, or a device pointer to float32 [B, Hq, Sq] (contiguous) that receives
 *                  the natural-log log-sum-exp of each row's scaled scores.
 *   softmax_scale: 0 for the default 1/sqrt(D); otherwise finite and positive.
 *   causal:        non-zero: query i sees keys 0 ..= len - Sq + i; zero: all len keys.
 *                  A row that sees no key (a length of 0, say) gets zeros (and lse -inf).
 *   workspace, workspace_bytes: both 0, and a call that needs scratch memory takes it from
 *                  the stream-ordered allocator (cuMemAllocAsync) and frees it on `stream`;
 *                  otherwise a device buffer, 256-byte aligned, of workspace_bytes >=
 *                  flashcore_decode_workspace_bytes(...) bytes, apart from every other
 *                  argument, not used by anything else until the call's kernels have run
 *                  (unused when that size is 0). Pass one for calls captured in a CUDA graph.
 *   stream:        NULL for the default stream.
 *
 * The number of splits of each sequence's keys (and so the workspace size) depends only
 * on the shapes (B, Sq, Hq, Hkv, D), the dtype, the layout, the capacity and the GPU, never
 * on the lengths: a captured graph stays right as sequences grow. Limits: B at most 65535;
 * where the decode kernels run the call (up to 16 queries, or more against a cache the
 * forward kernels cannot read), also Hkv * ceil(Sq * Hq / Hkv / 16) at most 65535 (their
 * grid) and B * Sq * Hq below 2^31 (their partial results' rows). Which kernels run a
 * call depends on the GPU, so flashcore_check_decode leaves those two to the call, which
 * returns FLASHCORE_ERROR_INVALID_ARGUMENT for them before launching anything. All
 * arguments are checked before anything runs; on error nothing is launched or written.
 * The first call of a configuration generates and JIT-loads its kernels. */
int32_t flashcore_decode(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                         const int32_t *host_seqlens, const int32_t *host_block_table,
                         const FlashcoreTensor *o, uint64_t lse, float softmax_scale, int32_t causal,
                         uint64_t workspace, size_t workspace_bytes, flashcore_stream stream);

/* flashcore_decode against a cache that may hold FP8: the same parameters, with `scales`
 * after `cache`. scales NULL: a 16-bit cache, and the call is flashcore_decode's. Else the
 * cache's k and v are e4m3 codes (FLASHCORE_E4M3) with these scales (see
 * FlashcoreKvScales), D in {64, 128, 256}, and q and o are f16 or bf16 (one dtype for
 * both): keys and values are dequantized (code times scale) as they are read. Needs an
 * sm_89 or newer GPU (FLASHCORE_ERROR_UNSUPPORTED_GPU otherwise). An e4m3 cache with scales NULL, or
 * float32 scales with a 16-bit cache, is FLASHCORE_ERROR_INVALID_ARGUMENT; scales not float32 is
 * FLASHCORE_ERROR_UNSUPPORTED_DTYPE, of another shape FLASHCORE_ERROR_SHAPE_MISMATCH. */
int32_t flashcore_decode_fp8kv(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                               const FlashcoreKvScales *scales, const int32_t *host_seqlens,
                               const int32_t *host_block_table, const FlashcoreTensor *o, uint64_t lse,
                               float softmax_scale, int32_t causal, uint64_t workspace,
                               size_t workspace_bytes, flashcore_stream stream);

/* flashcore_decode with a key window (see flashcore_forward_window): the same parameters,
 * with window_left and window_right after causal. Query i of Sq, at position
 * p = len - Sq + i of its sequence, sees the keys p - window_left ..= p + window_right
 * among the sequence's len (a negative side unbounded; -1, -1 is flashcore_decode's call).
 * A sliding window of w keys is causal with window_left = w - 1: each new token sees
 * itself and the w - 1 positions before it. causal with window_right > 0 is
 * FLASHCORE_ERROR_INVALID_ARGUMENT. The splits of the keys, and so the workspace
 * (flashcore_decode_workspace_bytes), are the windowless call's; the kernels skip the key
 * tiles before the first query's window. All arguments are checked before anything runs;
 * on error nothing is launched or written. */
int32_t flashcore_decode_window(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                                const int32_t *host_seqlens, const int32_t *host_block_table,
                                const FlashcoreTensor *o, uint64_t lse, float softmax_scale, int32_t causal,
                                int64_t window_left, int64_t window_right, uint64_t workspace,
                                size_t workspace_bytes, flashcore_stream stream);

/* flashcore_decode_fp8kv with a key window, as flashcore_decode_window takes it: `scales`
 * after `cache`, window_left and window_right after causal (scales NULL: a 16-bit cache,
 * and the call is flashcore_decode_window's). */
int32_t flashcore_decode_fp8kv_window(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                      const FlashcoreKvCache *cache, const FlashcoreKvScales *scales,
                                      const int32_t *host_seqlens, const int32_t *host_block_table,
                                      const FlashcoreTensor *o, uint64_t lse, float softmax_scale,
                                      int32_t causal, int64_t window_left, int64_t window_right,
                                      uint64_t workspace, size_t workspace_bytes, flashcore_stream stream);

/* flashcore_decode with its options as one struct (see flashcore_forward_ex): the same
 * parameters, with `opts` in place of softmax_scale and causal. The key window is read as
 * flashcore_decode_window reads it; the soft cap applies to every query's scores. The
 * splits of the keys, and so the workspace (flashcore_decode_workspace_bytes), are the
 * plain call's. */
int32_t flashcore_decode_ex(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                            const int32_t *host_seqlens, const int32_t *host_block_table,
                            const FlashcoreTensor *o, uint64_t lse, const FlashcoreAttentionOptions *opts,
                            uint64_t workspace, size_t workspace_bytes, flashcore_stream stream);

/* flashcore_decode_fp8kv with its options as one struct, as flashcore_decode_ex takes them:
 * `scales` after `cache`, `opts` in place of softmax_scale and causal (scales NULL: a
 * 16-bit cache, and the call is flashcore_decode_ex's). */
int32_t flashcore_decode_fp8kv_ex(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                  const FlashcoreKvCache *cache, const FlashcoreKvScales *scales,
                                  const int32_t *host_seqlens, const int32_t *host_block_table,
                                  const FlashcoreTensor *o, uint64_t lse,
                                  const FlashcoreAttentionOptions *opts, uint64_t workspace,
                                  size_t workspace_bytes, flashcore_stream stream);

/* The workspace, in bytes, that flashcore_decode needs for these q and cache on the
 * context's device (0: the call runs in one split and needs none) into *out. Validates q
 * and the cache as flashcore_decode does; on failure *out is 0. Reads no device memory.
 * Also 0 for a call with more queries than the decode kernels' partial results can index
 * (2^31 rows), which the forward kernels take; where options (a window) or a tensor the
 * forward kernels cannot describe leave such a call to the decode kernels, the call
 * itself fails with FLASHCORE_ERROR_INVALID_ARGUMENT before launching anything. */
int32_t flashcore_decode_workspace_bytes(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                         const FlashcoreKvCache *cache, size_t *out);

/* The workspace, in bytes, that flashcore_decode_fp8kv needs for these q, cache and scales
 * (scales NULL: flashcore_decode_workspace_bytes), as flashcore_decode_workspace_bytes
 * says it: an FP8 cache's kernels may split differently from a 16-bit one's. */
int32_t flashcore_decode_workspace_bytes_fp8kv(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                               const FlashcoreKvCache *cache,
                                               const FlashcoreKvScales *scales, size_t *out);

/* Checks the arguments of a flashcore_decode call (same meaning) against every rule
 * flashcore_decode applies before launching, except the workspace's (its size depends on
 * the GPU) and the decode kernels' grid and partial rows (whether they run the call
 * depends on the GPU; see flashcore_decode), without a context, a GPU or a driver: device pointers are only checked as
 * numbers; the host arrays, when given, are read and checked against the cache. Returns
 * FLASHCORE_SUCCESS or the code flashcore_decode would return for them. */
int32_t flashcore_check_decode(const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                               const int32_t *host_seqlens, const int32_t *host_block_table,
                               const FlashcoreTensor *o, uint64_t lse, float softmax_scale,
                               int32_t causal);

/* Checks the arguments of a flashcore_decode_fp8kv call (same meaning) as
 * flashcore_check_decode does, the scales' rules included (the GPU's, sm_89 for an FP8
 * cache, excepted). */
int32_t flashcore_check_decode_fp8kv(const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                                     const FlashcoreKvScales *scales, const int32_t *host_seqlens,
                                     const int32_t *host_block_table, const FlashcoreTensor *o,
                                     uint64_t lse, float softmax_scale, int32_t causal);

/* Checks the arguments of a flashcore_decode_window call (same meaning) as
 * flashcore_check_decode does, the window's rule included. */
int32_t flashcore_check_decode_window(const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                                      const int32_t *host_seqlens, const int32_t *host_block_table,
                                      const FlashcoreTensor *o, uint64_t lse, float softmax_scale,
                                      int32_t causal, int64_t window_left, int64_t window_right);

/* Checks the arguments of a flashcore_decode_fp8kv_window call (same meaning) as
 * flashcore_check_decode_fp8kv does, the window's rule included. */
int32_t flashcore_check_decode_fp8kv_window(const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                                            const FlashcoreKvScales *scales, const int32_t *host_seqlens,
                                            const int32_t *host_block_table, const FlashcoreTensor *o,
                                            uint64_t lse, float softmax_scale, int32_t causal,
                                            int64_t window_left, int64_t window_right);

/* Checks the arguments of a flashcore_decode_ex call (same meaning) as
 * flashcore_check_decode does, the options' rules included. */
int32_t flashcore_check_decode_ex(const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                                  const int32_t *host_seqlens, const int32_t *host_block_table,
                                  const FlashcoreTensor *o, uint64_t lse,
                                  const FlashcoreAttentionOptions *opts);

/* Checks the arguments of a flashcore_decode_fp8kv_ex call (same meaning) as
 * flashcore_check_decode_fp8kv does, the options' rules included. */
int32_t flashcore_check_decode_fp8kv_ex(const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                                        const FlashcoreKvScales *scales, const int32_t *host_seqlens,
                                        const int32_t *host_block_table, const FlashcoreTensor *o,
                                        uint64_t lse, const FlashcoreAttentionOptions *opts);

/* A serving batch in one call (decode steps, drafts and prompt chunks together), on
 * `stream`: each sequence's new queries packed one after another in q, attending to the
 * cache as flashcore_decode_fp8kv_ex attends (scales NULL: a 16-bit cache).
 *
 *   q, o:          [1, total_q, Hq, D], the tensor rules of flashcore_decode; total_q <= 2^25.
 *   cu_seqlens_q:  device address of int32 [batch + 1] offsets (4-byte aligned): sequence b's
 *                  queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and o, n_b of
 *                  them, query i at position len_b - n_b + i of its sequence (len_b the
 *                  cache's length, which counts the new tokens); a query before the sequence's
 *                  first position sees no key (zeros, LSE -inf). Rows no sequence covers are
 *                  not written.
 *   batch:         the number of sequences, the cache's batch, 1 ..= 65535.
 *   max_seqlen_q:  at least the longest n_b, 1 ..= 2^25. Up to 16 the decode kernels run;
 *                  past it, on Hopper, the forward kernels where they read the cache (16-bit,
 *                  contiguous or pages of 16 or more), the decode kernels otherwise (then
 *                  with flashcore_decode's limits on their grid and partial rows, for
 *                  batch sequences of max_seqlen_q queries).
 *   host_cu_seqlens_q: NULL, or a host copy of the offsets (batch + 1 entries), checked first:
 *                  from 0 or more, non-decreasing, ending inside q, none longer than
 *                  max_seqlen_q.
 *   host_seqlens, host_block_table, workspace: as for flashcore_decode
 *                  (flashcore_decode_varlen_workspace_bytes sizes the workspace).
 *   lse:           0, or device float32 [Hq, total_q].
 * All arguments are checked before anything runs; on error nothing is launched or written. */
int32_t flashcore_decode_varlen(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                const FlashcoreKvCache *cache, const FlashcoreKvScales *scales,
                                uint64_t cu_seqlens_q, int64_t batch, int64_t max_seqlen_q,
                                const int32_t *host_cu_seqlens_q, const int32_t *host_seqlens,
                                const int32_t *host_block_table, const FlashcoreTensor *o,
                                uint64_t lse, const FlashcoreAttentionOptions *opts,
                                uint64_t workspace, size_t workspace_bytes, flashcore_stream stream);

/* The workspace, in bytes, that flashcore_decode_varlen needs for these arguments on the
 * context's device, with any options (0: none), into *out, as
 * flashcore_decode_workspace_bytes says it for flashcore_decode. Reads no device memory. */
int32_t flashcore_decode_varlen_workspace_bytes(FlashcoreContext *ctx, const FlashcoreTensor *q,
                                                const FlashcoreKvCache *cache,
                                                const FlashcoreKvScales *scales,
                                                uint64_t cu_seqlens_q, int64_t batch,
                                                int64_t max_seqlen_q, size_t *out);

/* Checks the arguments of a flashcore_decode_varlen call (same meaning) as
 * flashcore_check_decode_fp8kv_ex does, the offsets' rules included. */
int32_t flashcore_check_decode_varlen(const FlashcoreTensor *q, const FlashcoreKvCache *cache,
                                      const FlashcoreKvScales *scales, uint64_t cu_seqlens_q,
                                      int64_t batch, int64_t max_seqlen_q,
                                      const int32_t *host_cu_seqlens_q, const int32_t *host_seqlens,
                                      const int32_t *host_block_table, const FlashcoreTensor *o,
                                      uint64_t lse, const FlashcoreAttentionOptions *opts);

/* Appends Snew tokens per sequence, asynchronously on `stream`: k_new[b, j] and
 * v_new[b, j] (j < Snew) go to position len_b + j of sequence b, with len_b the length the
 * device holds in cache->seqlens when the kernel runs. The lengths are NOT advanced: the
 * caller adds Snew to them (before a decode that should see the new tokens).
 *
 *   k_new, v_new:  [B, Snew, Hkv, D] of the cache's dtype, Hkv and D (D a multiple of 8),
 *                  pointers 16-byte aligned, strides[3] == 1 and other strides multiples of
 *                  16 bytes, not overlapping the cache; 1 <= Snew <= capacity (Snew 0:
 *                  FLASHCORE_ERROR_EMPTY_DIMENSION; the Python package returns instead) and
 *                  B * Snew * Hkv * D / 8 <= 2146435039 (2^31 - 2^20 - 33: the kernels
 *                  count 16-byte chunks in 32 bits, with room for their last step).
 *   host_seqlens, host_block_table: NULL, or host copies of the lengths before the append
 *                  (see above): len_b + Snew must not exceed the capacity, and (paged) no
 *                  sequence's new tokens may land on rows of a shared page that another
 *                  sequence holds (a position below its length) or writes in this call.
 *
 * Positions past the capacity, and pages outside the pool, are never written whatever
 * the device metadata holds. All arguments are checked before anything runs. */
int32_t flashcore_append_kv(FlashcoreContext *ctx, const FlashcoreKvCache *cache, const FlashcoreTensor *k_new,
                            const FlashcoreTensor *v_new, const int32_t *host_seqlens,
                            const int32_t *host_block_table, flashcore_stream stream);

/* flashcore_append_kv to a cache that may hold FP8: the same parameters, with `scales`
 * after `cache`. scales NULL: a 16-bit cache, and the call is flashcore_append_kv's. Else
 * the cache holds e4m3 codes with these scales (see FlashcoreKvScales) and k_new, v_new
 * are f16 or bf16 (one dtype for both, either one) of the cache's Hkv and D: each new
 * (position, KV head) row of D values gets the scale max|x| / 448 (1 for a row of zeros)
 * and the codes x / scale rounded to the nearest e4m3 value (saturating), at that
 * position. Needs an sm_89 or newer GPU. The rules and errors of flashcore_append_kv and
 * flashcore_decode_fp8kv apply; k_new and v_new may not overlap the scales either. */
int32_t flashcore_append_kv_fp8kv(FlashcoreContext *ctx, const FlashcoreKvCache *cache,
                                  const FlashcoreKvScales *scales, const FlashcoreTensor *k_new,
                                  const FlashcoreTensor *v_new, const int32_t *host_seqlens,
                                  const int32_t *host_block_table, flashcore_stream stream);

/* Checks the arguments of a flashcore_append_kv call (same meaning) without a context, a
 * GPU or a driver, as flashcore_check_decode does for a decode. */
int32_t flashcore_check_append_kv(const FlashcoreKvCache *cache, const FlashcoreTensor *k_new,
                                  const FlashcoreTensor *v_new, const int32_t *host_seqlens,
                                  const int32_t *host_block_table);

/* Checks the arguments of a flashcore_append_kv_fp8kv call (same meaning) as
 * flashcore_check_append_kv does, the scales' rules included (the GPU's excepted). */
int32_t flashcore_check_append_kv_fp8kv(const FlashcoreKvCache *cache, const FlashcoreKvScales *scales,
                                        const FlashcoreTensor *k_new, const FlashcoreTensor *v_new,
                                        const int32_t *host_seqlens, const int32_t *host_block_table);

/* Merges attention results over `count` disjoint key shards into what attention over all
 * their keys gives, asynchronously on `stream`:
 *   out = sum_i exp(lse_i - lse) * o_i,   lse = log(sum_i exp(lse_i)).
 *
 *   parts:         shard 0's output, [B, S, H, D], f16, bf16 or f32, D a multiple of 8
 *                  up to 256; shard i's is the same view moved i * shard_stride
 *                  elements (shard_stride * element size a multiple of 16 bytes when
 *                  count > 1). Pointer 16-byte aligned, strides[3] == 1 and other strides
 *                  multiples of 16 bytes.
 *   count:         number of shards, >= 1.
 *   lse_parts:     device pointer (4-byte aligned) to float32 [count, B, H, S], contiguous:
 *                  each shard's LSE as flashcore_forward and flashcore_decode write it. A
 *                  shard whose row has LSE -inf (it saw no key) counts for nothing there;
 *                  one whose row has LSE +inf or NaN (no flashcore call writes those)
 *                  makes the merged row NaN. FlashAttention-2's forward marks a row that
 *                  saw no key with +inf: map those to -inf before merging its shards.
 *   out:           [B, S, H, D], f16, bf16 or f32 (any of them, whatever parts' dtype),
 *                  apart from the shards and lse_parts.
 *   out_lse:       0, or a device pointer to float32 [B, H, S] (contiguous) for the merged
 *                  LSE (-inf where every shard's is).
 *
 * B * S * H and count each below 2^31. All arguments are checked before anything runs. */
int32_t flashcore_merge(FlashcoreContext *ctx, const FlashcoreTensor *parts, int64_t count, int64_t shard_stride,
                        uint64_t lse_parts, const FlashcoreTensor *out, uint64_t out_lse,
                        flashcore_stream stream);

/* Checks the arguments of a flashcore_merge call (same meaning) without a context, a GPU
 * or a driver; pointers are only checked as numbers. */
int32_t flashcore_check_merge(const FlashcoreTensor *parts, int64_t count, int64_t shard_stride,
                              uint64_t lse_parts, const FlashcoreTensor *out, uint64_t out_lse);

/* ---- FP8 (e4m3) attention ----------------------------------------------------------------- */
/* Needs an sm_89 or newer GPU (Ada, Hopper and later); on older ones these calls return
 * FLASHCORE_ERROR_UNSUPPORTED_GPU. The usual sequence: flashcore_fp8_workspace_bytes, a
 * device buffer of that size, flashcore_quantize_fp8 into it, flashcore_forward_fp8 on the
 * operands it describes (as often as the 16-bit inputs stay the same). */

/* The workspace, in bytes, that flashcore_quantize_fp8 needs for these q, k, v and options
 * into *out: the operands' size plus 255 bytes, so that a buffer of that size works at any
 * start address. Validates q, k, v as flashcore_quantize_fp8 does (on failure *out is 0).
 * options NULL: every option off. Needs no context, GPU or driver; reads no device memory. */
int32_t flashcore_fp8_workspace_bytes(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                      const FlashcoreTensor *v,
                                      const FlashcoreQuantizeOptions *options, size_t *out);

/* Quantizes 16-bit q, k, v to e4m3 with one float32 scale per block of 128 rows (scale =
 * the largest magnitude of the block's finite elements / 448; 1 for a block of zeros; an
 * infinite or NaN element gets a NaN code and leaves the rest of its block as it would be
 * without it), into a workspace,
 * asynchronously on `stream`, and describes the result in *out for flashcore_forward_fp8.
 *
 *   q: [B, Sq, Hq, D]    k, v: [B, Sk, Hkv, D]   f16 or bf16 (one dtype), D in {64, 128, 256},
 *                  Hq a multiple of Hkv; pointers 16-byte aligned, strides[3] == 1 and other
 *                  strides multiples of 16 bytes (any memory order: [B, H, S, D] too).
 *   options:       NULL for none, or see FlashcoreQuantizeOptions.
 *   workspace, workspace_bytes: a device buffer of at least flashcore_fp8_workspace_bytes(...)
 *                  bytes, apart from q, k and v. The operands are laid out from its first
 *                  256-byte aligned address: q8, k8, V^T8, the three scales (and, with
 *                  smooth_k, K's mean and lse_shift, and with the Hadamard option too a
 *                  u32 per (batch, KV head) of scratch after the mean and the mean rotated
 *                  after lse_shift), each region 256-byte aligned. It must stay allocated, and
 *                  unwritten, as long as the operands are used.
 *   out:           receives the operands (pointers into the workspace); all zeros on failure.
 *   stream:        NULL for the default stream. The kernels (3; with smooth_k 4 and a memset)
 *                  are ordered on it: a forward on the same stream may follow at once.
 *                  The first call of a configuration generates and JIT-loads its kernels;
 *                  later calls only launch and allocate nothing (CUDA graphs can capture them).
 *
 * Sq and Sk at most 2^25, B and Hq at most 65535. All arguments are checked before anything
 * runs; on error nothing is launched and the workspace is not written. */
int32_t flashcore_quantize_fp8(FlashcoreContext *ctx, const FlashcoreTensor *q, const FlashcoreTensor *k,
                               const FlashcoreTensor *v, const FlashcoreQuantizeOptions *options,
                               uint64_t workspace, size_t workspace_bytes, FlashcoreFp8Operands *out,
                               flashcore_stream stream);

/* Checks the arguments of a flashcore_quantize_fp8 call (same meaning) against every rule it
 * applies before launching except the GPU's, without a context, a GPU or a driver: the
 * pointers are only checked as numbers. Returns FLASHCORE_SUCCESS or the code
 * flashcore_quantize_fp8 would return for them. */
int32_t flashcore_check_quantize_fp8(const FlashcoreTensor *q, const FlashcoreTensor *k,
                                     const FlashcoreTensor *v, const FlashcoreQuantizeOptions *options,
                                     uint64_t workspace, size_t workspace_bytes);

/* o = softmax(q k^T * scale) v from FP8 operands (see FlashcoreFp8Operands), asynchronously
 * on `stream`: the scores are dequantized inside the softmax, the probabilities rounded to
 * e4m3 for P V, and the sums kept in float32.
 *
 *   ops:           the operands (flashcore_quantize_fp8's, or your own of the same contract).
 *   o:             [B, Sq, Hq, D], f16 or bf16 (either, whatever the quantized inputs were),
 *                  apart from every operand; the tensor rules of flashcore_forward.
 *   lse:           0, or a device pointer to float32 [B, Hq, Sq] (contiguous) that receives
 *                  each row's natural-log log-sum-exp (with lse_shift added, when given).
 *   softmax_scale, causal, stream: as for flashcore_forward (causal aligned bottom-right).
 *                  There is no _window or _ex spelling: the FP8 kernels have no key window
 *                  and no soft cap (sliding-window and soft-capped attention run on 16-bit
 *                  inputs, or on an FP8 KV cache through flashcore_decode_fp8kv_window and
 *                  flashcore_decode_fp8kv_ex).
 *
 * Range: exact up to FP8's rounding while each row's largest logit (softmax_scale times its
 * largest score) is below about 1.2e7 in magnitude; past that a row's o loses precision
 * (its LSE stays right), and past about 1.5e9 a row can come out as one that saw no key (o
 * zero, LSE -inf). No Q or K scale and no softmax_scale makes an output NaN or infinite.
 * V's scales and lse_shift carry through as values do: a NaN or infinite one (or, from
 * flashcore_quantize_fp8, a NaN or infinite input element) makes the outputs that read it
 * non-finite, as it would in 16-bit attention; and o's f32 sums, which hold probabilities
 * times 256, overflow where a V block's largest magnitude times 256 * Sk passes 3.4e38.
 *
 * Accuracy: E4M3 keeps 3 mantissa bits, so o differs from 16-bit attention by a few percent
 * (relative L2 about 4-5% for normal inputs, most of it from rounding Q, K and V). All
 * arguments are checked before anything runs; on error nothing is launched or written.
 * Besides the tensor rules, B * Hq * ceil(Sq / 128) and B * Hkv * ceil(Sk / 128) (the
 * scale counts, which the kernels index in 32 bits) must be below 2^32, which only batches
 * broadcast through zero strides can reach (FLASHCORE_ERROR_INVALID_ARGUMENT). */
int32_t flashcore_forward_fp8(FlashcoreContext *ctx, const FlashcoreFp8Operands *ops,
                              const FlashcoreTensor *o, uint64_t lse, float softmax_scale,
                              int32_t causal, flashcore_stream stream);

/* Checks the arguments of a flashcore_forward_fp8 call (same meaning) against every rule it
 * applies before launching except the GPU's, without a context, a GPU or a driver: the
 * pointers are only checked as numbers. Returns FLASHCORE_SUCCESS or the code
 * flashcore_forward_fp8 would return for them. */
int32_t flashcore_check_forward_fp8(const FlashcoreFp8Operands *ops, const FlashcoreTensor *o,
                                    uint64_t lse, float softmax_scale, int32_t causal);

/* ---- errors and version ---------------------------------------------------------------- */

/* The message of the last failing flashcore call on this thread, "" if none failed.
 * Valid until the next flashcore call on this thread. Never NULL. */
const char *flashcore_last_error(void);

/* The symbolic name of a return code, e.g. "FLASHCORE_ERROR_BAD_STRIDES", or
 * "FLASHCORE_ERROR_UNKNOWN". A static string. */
const char *flashcore_error_name(int32_t code);

/* The library version, e.g. "0.1.0". A static string. */
const char *flashcore_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHCORE_H */
