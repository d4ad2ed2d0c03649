/*
 * flashcore.h - C interface of flashcore: FlashAttention forward kernels generated at run
 * time as PTX and launched through the CUDA driver (libcuda, loaded at run time).
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
 */
#ifndef FLASHCORE_H
#define FLASHCORE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element types (FlashcoreTensor.dtype) ------------------------------------------- */

#define FLASHCORE_F16 1  /* IEEE binary16 */
#define FLASHCORE_BF16 2 /* bfloat16 */
#define FLASHCORE_F32 3  /* float32: describable, but no kernel takes it */

/* ---- return codes -------------------------------------------------------------------- */
/* (src/error.rs holds the table these lines are checked against: values, names, comments) */

#define FLASHCORE_SUCCESS 0                    /* the call succeeded */
#define FLASHCORE_ERROR_NO_DRIVER 1            /* libcuda could not be loaded */
#define FLASHCORE_ERROR_NO_DEVICE 2            /* no device with that ordinal */
#define FLASHCORE_ERROR_UNSUPPORTED_GPU 3      /* below sm_80: no kernel path */
#define FLASHCORE_ERROR_SHAPE_MISMATCH 4       /* tensors disagree on a dimension */
#define FLASHCORE_ERROR_BAD_STRIDES 5          /* unusable or negative stride */
#define FLASHCORE_ERROR_EMPTY_DIMENSION 6      /* a dimension is zero */
#define FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM 7 /* head_dim not in 32, 64, 96, 128, 192, 256 */
#define FLASHCORE_ERROR_UNSUPPORTED_DTYPE 8    /* not f16/bf16, mixed, or unknown code */
#define FLASHCORE_ERROR_HEAD_RATIO 9           /* q heads not a multiple of k/v heads */
#define FLASHCORE_ERROR_NULL_POINTER 10        /* a tensor's device pointer is 0 */
#define FLASHCORE_ERROR_MISALIGNED 11          /* device pointer not aligned (16 B; lse 4 B) */
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
    int32_t dtype;      /* FLASHCORE_F16, FLASHCORE_BF16 or FLASHCORE_F32 */
    int64_t shape[4];   /* [batch, seq, heads, head_dim] */
    int64_t strides[4]; /* in elements; strides[3] must be 1 */
} FlashcoreTensor;

/* Forward attention on one device: owns the kernels loaded for it. Opaque. */
typedef struct FlashcoreContext FlashcoreContext;

/* ---- functions ----------------------------------------------------------------------- */

/* Opens device `device_ordinal` (driver ordinal, as CUDA_VISIBLE_DEVICES maps it) and
 * creates a context on it. On success *out is the new context; on failure *out is NULL.
 * Returns FLASHCORE_ERROR_NO_DRIVER on a machine without the NVIDIA driver. */
int32_t flashcore_create(int32_t device_ordinal, FlashcoreContext **out);

/* Destroys a context and unloads its kernels. NULL is a no-op. Work already queued on a
 * stream must have finished. */
void flashcore_destroy(FlashcoreContext *ctx);

/* o = softmax(q k^T * scale) v, asynchronously on `stream`.
 *
 *   q: [B, Sq, Hq, D]    k, v: [B, Sk, Hkv, D]    o: [B, Sq, Hq, D] (written)
 *   all of one dtype (f16 or bf16), D in {32, 64, 96, 128, 192, 256}, Hq a multiple of Hkv (GQA/MQA),
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
 * JIT-loads its kernel (milliseconds); later calls only launch and allocate nothing, so
 * they can be captured in a CUDA graph. A context may be shared by threads. */
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
