/*
 * forward.c - flashcore's C API end to end: one causal fp16 forward pass
 * (B=1, H=2, S=128, D=64), checked against a float64 CPU reference; the same inputs with
 * options as one struct (flashcore_forward_ex: a sliding window and logit soft-capping),
 * checked likewise; then, on an sm_89 or newer GPU, the inputs quantized to FP8 on the GPU
 * (flashcore_quantize_fp8) and the FP8 forward (flashcore_forward_fp8), checked against
 * the first reference.
 *
 * Device memory comes from the CUDA driver, loaded with dlopen("libcuda.so.1"): no CUDA
 * toolkit or cuda.h is needed to build this. On a machine without the driver the program
 * prints "no GPU: skipped" and exits 0.
 *
 * Build: scripts/build-c-example.sh (or make -C examples/c).
 * Exit status: 0 passed or skipped, 1 failed.
 */
#include <dlfcn.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "flashcore.h"

/* ---- the few driver API entry points used, declared by hand ----------------------------- */

typedef int CUresult; /* CUDA_SUCCESS == 0 */
typedef int CUdevice;
typedef void *CUcontext;
typedef uint64_t CUdeviceptr;

static struct {
    CUresult (*cuInit)(unsigned int flags);
    CUresult (*cuDeviceGet)(CUdevice *dev, int ordinal);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice dev);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice dev);
    CUresult (*cuCtxSetCurrent)(CUcontext ctx);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuMemAlloc)(CUdeviceptr *dptr, size_t bytes);
    CUresult (*cuMemFree)(CUdeviceptr dptr);
    CUresult (*cuMemcpyHtoD)(CUdeviceptr dst, const void *src, size_t bytes);
    CUresult (*cuMemcpyDtoH)(void *dst, CUdeviceptr src, size_t bytes);
    CUresult (*cuMemsetD8)(CUdeviceptr dst, unsigned char value, size_t bytes);
} cu;

static int load_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen(libcuda.so.1) failed: %s\n", dlerror());
        return -1;
    }
    struct {
        const char *name;
        void **slot;
    } syms[] = {
        {"cuInit", (void **)&cu.cuInit},
        {"cuDeviceGet", (void **)&cu.cuDeviceGet},
        {"cuDevicePrimaryCtxRetain", (void **)&cu.cuDevicePrimaryCtxRetain},
        {"cuDevicePrimaryCtxRelease_v2", (void **)&cu.cuDevicePrimaryCtxRelease},
        {"cuCtxSetCurrent", (void **)&cu.cuCtxSetCurrent},
        {"cuCtxSynchronize", (void **)&cu.cuCtxSynchronize},
        {"cuMemAlloc_v2", (void **)&cu.cuMemAlloc},
        {"cuMemFree_v2", (void **)&cu.cuMemFree},
        {"cuMemcpyHtoD_v2", (void **)&cu.cuMemcpyHtoD},
        {"cuMemcpyDtoH_v2", (void **)&cu.cuMemcpyDtoH},
        {"cuMemsetD8_v2", (void **)&cu.cuMemsetD8},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        /* dlsym returns an object pointer; copying it into the function-pointer slot
         * through memcpy is the portable way (POSIX guarantees the sizes match). */
        void *f = dlsym(lib, syms[i].name);
        if (!f) {
            fprintf(stderr, "libcuda has no %s\n", syms[i].name);
            return -1;
        }
        memcpy(syms[i].slot, &f, sizeof f);
    }
    return 0;
}

#define CU_CHECK(call)                                                                      \
    do {                                                                                    \
        CUresult r_ = (call);                                                               \
        if (r_ != 0) {                                                                      \
            fprintf(stderr, "%s:%d: %s failed: CUresult %d\n", __FILE__, __LINE__, #call,   \
                    r_);                                                                    \
            goto done;                                                                      \
        }                                                                                   \
    } while (0)

/* ---- fp16 conversion ------------------------------------------------------------------- */

/* float32 -> IEEE binary16, round to nearest even; handles subnormals, inf and NaN. */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t mant = x & 0x7fffffu;
    if (exp == 0xffu) /* inf or NaN (keep NaN quiet) */
        return (uint16_t)(sign | 0x7c00u | (mant ? 0x200u : 0u));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) /* overflow */
        return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) { /* subnormal half (or zero) */
        if (e < -10)
            return sign;
        mant |= 0x800000u; /* implicit bit */
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u)))
        half++; /* may carry into the exponent, up to inf: correct */
    return (uint16_t)(sign | half);
}

/* IEEE binary16 -> double, exactly. */
static double f16_to_f64(uint16_t h) {
    int sign = (h >> 15) & 1;
    int exp = (h >> 10) & 0x1f;
    int mant = h & 0x3ff;
    double v;
    if (exp == 0)
        v = ldexp((double)mant, -24);
    else if (exp == 31)
        v = mant ? NAN : INFINITY;
    else
        v = ldexp((double)(mant | 0x400), exp - 25);
    return sign ? -v : v;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

/* Uniform in [-1, 1) (xorshift64*). */
static float uniform(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    uint64_t r = rng_state * 0x2545f4914f6cdd1dull;
    return (float)((double)(r >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}

/* ---- the example ----------------------------------------------------------------------- */

enum { B = 1, H = 2, S = 128, D = 64 };
#define N_ELEMS ((size_t)B * S * H * D)
#define TOLERANCE 1e-2
/* FP8: relative L2 error of O (E4M3 keeps 3 mantissa bits: about 5% on such inputs). */
#define FP8_TOLERANCE 8e-2

/* Contiguous [B, S, H, D]: element (b, s, h, d) at ((b*S + s)*H + h)*D + d. */
static size_t at(int b, int s, int h, int d) {
    return (((size_t)b * S + (size_t)s) * H + (size_t)h) * D + (size_t)d;
}

static FlashcoreTensor bshd(CUdeviceptr ptr) {
    FlashcoreTensor t;
    memset(&t, 0, sizeof t);
    t.ptr = ptr;
    t.dtype = FLASHCORE_F16;
    t.shape[0] = B;
    t.shape[1] = S;
    t.shape[2] = H;
    t.shape[3] = D;
    t.strides[0] = (int64_t)S * H * D;
    t.strides[1] = (int64_t)H * D;
    t.strides[2] = D;
    t.strides[3] = 1;
    return t;
}

/* The float64 reference of a causal call (Sq == Sk: row i sees keys 0..i) at softmax
 * scale `scale`, each row seeing only the window_left keys before its own (window_left < 0:
 * every key up to it) and each scaled score x capped to softcap * tanh(x / softcap)
 * (softcap 0: none), as flashcore_forward_ex runs it. Writes the largest absolute errors of
 * o and lse against it to *o_err and *lse_err (NaN counts as the largest), and the reference
 * O to ref unless it is NULL. Returns -1 when out of memory. */
static int check_causal(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *o,
                        const float *lse, double scale, int window_left, double softcap, double *ref,
                        double *o_err, double *lse_err) {
    double *p = malloc(S * sizeof(double));
    if (!p)
        return -1;
    double max_err = 0.0, max_lse_err = 0.0;
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            for (int i = 0; i < S; i++) {
                int first = (window_left < 0 || i <= window_left) ? 0 : i - window_left;
                double m = -INFINITY;
                for (int j = first; j <= i; j++) {
                    double s = 0.0;
                    for (int d = 0; d < D; d++)
                        s += f16_to_f64(q[at(b, i, h, d)]) * f16_to_f64(k[at(b, j, h, d)]);
                    s *= scale;
                    p[j] = softcap > 0.0 ? softcap * tanh(s / softcap) : s;
                    if (p[j] > m)
                        m = p[j];
                }
                double l = 0.0;
                for (int j = first; j <= i; j++) {
                    p[j] = exp(p[j] - m);
                    l += p[j];
                }
                for (int d = 0; d < D; d++) {
                    double acc = 0.0;
                    for (int j = first; j <= i; j++)
                        acc += p[j] * f16_to_f64(v[at(b, j, h, d)]);
                    if (ref)
                        ref[at(b, i, h, d)] = acc / l;
                    double err = fabs(f16_to_f64(o[at(b, i, h, d)]) - acc / l);
                    if (!(err <= max_err)) /* NaN counts as the largest error */
                        max_err = isnan(err) ? INFINITY : err;
                }
                double lse_err = fabs((double)lse[((size_t)b * H + (size_t)h) * S + (size_t)i] - (m + log(l)));
                if (!(lse_err <= max_lse_err))
                    max_lse_err = isnan(lse_err) ? INFINITY : lse_err;
            }
        }
    }
    free(p);
    *o_err = max_err;
    *lse_err = max_lse_err;
    return 0;
}

int main(void) {
    int status = 1;
    FlashcoreContext *ctx = NULL;
    CUdevice dev = 0;
    int ctx_retained = 0;
    CUdeviceptr dq = 0, dk = 0, dv = 0, dout = 0, dlse = 0, dws = 0;
    uint16_t *q = NULL, *k = NULL, *v = NULL, *o = NULL;
    float *lse = NULL;
    double *ref = NULL; /* the float64 reference O, [B, S, H, D] */

    printf("flashcore %s\n", flashcore_version());

    int32_t rc = flashcore_create(0, &ctx);
    if (rc == FLASHCORE_ERROR_NO_DRIVER || rc == FLASHCORE_ERROR_NO_DEVICE) {
        printf("%s: %s\nno GPU: skipped\n", flashcore_error_name(rc), flashcore_last_error());
        return 0;
    }
    if (rc != FLASHCORE_SUCCESS) {
        fprintf(stderr, "flashcore_create: %s: %s\n", flashcore_error_name(rc), flashcore_last_error());
        return 1;
    }

    /* flashcore uses the device's primary context; allocate in the same one. */
    if (load_driver() != 0)
        goto done;
    CUcontext cuctx = NULL;
    CU_CHECK(cu.cuInit(0));
    CU_CHECK(cu.cuDeviceGet(&dev, 0));
    CU_CHECK(cu.cuDevicePrimaryCtxRetain(&cuctx, dev));
    ctx_retained = 1;
    CU_CHECK(cu.cuCtxSetCurrent(cuctx));

    size_t bytes = N_ELEMS * sizeof(uint16_t);
    size_t lse_bytes = (size_t)B * H * S * sizeof(float);
    q = malloc(bytes);
    k = malloc(bytes);
    v = malloc(bytes);
    o = malloc(bytes);
    lse = malloc(lse_bytes);
    ref = malloc(N_ELEMS * sizeof(double));
    if (!q || !k || !v || !o || !lse || !ref) {
        fprintf(stderr, "out of host memory\n");
        goto done;
    }
    for (size_t i = 0; i < N_ELEMS; i++) {
        q[i] = f32_to_f16(uniform());
        k[i] = f32_to_f16(uniform());
        v[i] = f32_to_f16(uniform());
    }

    CU_CHECK(cu.cuMemAlloc(&dq, bytes));
    CU_CHECK(cu.cuMemAlloc(&dk, bytes));
    CU_CHECK(cu.cuMemAlloc(&dv, bytes));
    CU_CHECK(cu.cuMemAlloc(&dout, bytes));
    CU_CHECK(cu.cuMemAlloc(&dlse, lse_bytes));
    CU_CHECK(cu.cuMemcpyHtoD(dq, q, bytes));
    CU_CHECK(cu.cuMemcpyHtoD(dk, k, bytes));
    CU_CHECK(cu.cuMemcpyHtoD(dv, v, bytes));
    /* Poison the outputs (0xffff is an fp16 NaN, 0xffffffff a float NaN). */
    CU_CHECK(cu.cuMemsetD8(dout, 0xff, bytes));
    CU_CHECK(cu.cuMemsetD8(dlse, 0xff, lse_bytes));

    FlashcoreTensor tq = bshd(dq), tk = bshd(dk), tv = bshd(dv), to = bshd(dout);
    rc = flashcore_forward(ctx, &tq, &tk, &tv, &to, dlse, 0.0f, 1, NULL);
    if (rc != FLASHCORE_SUCCESS) {
        fprintf(stderr, "flashcore_forward: %s: %s\n", flashcore_error_name(rc), flashcore_last_error());
        goto done;
    }
    CU_CHECK(cu.cuCtxSynchronize());
    CU_CHECK(cu.cuMemcpyDtoH(o, dout, bytes));
    CU_CHECK(cu.cuMemcpyDtoH(lse, dlse, lse_bytes));

    /* A bad call is refused with a code and a message, and launches nothing. */
    FlashcoreTensor bad = tq;
    bad.dtype = 42;
    rc = flashcore_forward(ctx, &bad, &tk, &tv, &to, 0, 0.0f, 1, NULL);
    if (rc != FLASHCORE_ERROR_UNSUPPORTED_DTYPE) {
        fprintf(stderr, "bad dtype: expected FLASHCORE_ERROR_UNSUPPORTED_DTYPE, got %s\n",
                flashcore_error_name(rc));
        goto done;
    }
    printf("bad dtype refused as expected: %s\n", flashcore_last_error());

    /* float64 reference of every row: causal, Sq == Sk, so row i sees keys 0..i. */
    double max_err = 0.0, max_lse_err = 0.0;
    if (check_causal(q, k, v, o, lse, 1.0 / sqrt((double)D), -1, 0.0, ref, &max_err, &max_lse_err) != 0)
        goto done;
    printf("B%d H%d S%d D%d fp16 causal: max abs error %.3e (O), %.3e (LSE); tolerance %.0e\n", B, H,
           S, D, max_err, max_lse_err, TOLERANCE);
    if (max_err > TOLERANCE || max_lse_err > TOLERANCE) {
        fprintf(stderr, "FAILED: error above tolerance\n");
        goto done;
    }

    /* The options as one struct (flashcore_forward_ex): causal, a sliding window of 32
     * keys (each row sees itself and the 31 before it), and logit soft-capping as Gemma 2
     * and Grok use it (each scaled score x becomes softcap * tanh(x / softcap)), at a scale
     * where the cap bends the scores. Options always start from
     * FLASHCORE_ATTENTION_OPTIONS_INIT (no option at all, and struct_size, which versions
     * the struct); all zeros would be refused. */
    FlashcoreAttentionOptions opts = FLASHCORE_ATTENTION_OPTIONS_INIT;
    opts.softmax_scale = 0.5f;
    opts.causal = 1;
    opts.window_left = 31;
    opts.window_right = 0;
    opts.softcap = 2.0f;
    CU_CHECK(cu.cuMemsetD8(dout, 0xff, bytes));
    CU_CHECK(cu.cuMemsetD8(dlse, 0xff, lse_bytes));
    rc = flashcore_forward_ex(ctx, &tq, &tk, &tv, &to, dlse, &opts, NULL);
    if (rc != FLASHCORE_SUCCESS) {
        fprintf(stderr, "flashcore_forward_ex: %s: %s\n", flashcore_error_name(rc), flashcore_last_error());
        goto done;
    }
    CU_CHECK(cu.cuCtxSynchronize());
    CU_CHECK(cu.cuMemcpyDtoH(o, dout, bytes));
    CU_CHECK(cu.cuMemcpyDtoH(lse, dlse, lse_bytes));
    if (check_causal(q, k, v, o, lse, opts.softmax_scale, (int)opts.window_left, opts.softcap, NULL, &max_err,
                     &max_lse_err) != 0)
        goto done;
    printf("B%d H%d S%d D%d fp16 causal, window of 32 keys, softcap %.1f: max abs error %.3e (O), "
           "%.3e (LSE); tolerance %.0e\n",
           B, H, S, D, (double)opts.softcap, max_err, max_lse_err, TOLERANCE);
    if (max_err > TOLERANCE || max_lse_err > TOLERANCE) {
        fprintf(stderr, "FAILED: error above tolerance (flashcore_forward_ex)\n");
        goto done;
    }
    /* A cap must be positive (0 is none): a negative one is refused, nothing launched. */
    opts.softcap = -2.0f;
    rc = flashcore_check_forward_ex(&tq, &tk, &tv, &to, dlse, &opts);
    if (rc != FLASHCORE_ERROR_INVALID_ARGUMENT) {
        fprintf(stderr, "negative softcap: expected FLASHCORE_ERROR_INVALID_ARGUMENT, got %s\n",
                flashcore_error_name(rc));
        goto done;
    }
    printf("negative softcap refused as expected: %s\n", flashcore_last_error());
    /* Options not started from FLASHCORE_ATTENTION_OPTIONS_INIT (struct_size 0) are refused
     * too, not read as a window of one key. */
    FlashcoreAttentionOptions zeros;
    memset(&zeros, 0, sizeof zeros);
    rc = flashcore_check_forward_ex(&tq, &tk, &tv, &to, dlse, &zeros);
    if (rc != FLASHCORE_ERROR_INVALID_ARGUMENT) {
        fprintf(stderr, "zeroed options: expected FLASHCORE_ERROR_INVALID_ARGUMENT, got %s\n",
                flashcore_error_name(rc));
        goto done;
    }
    printf("zeroed options refused as expected: %s\n", flashcore_last_error());

    /* FP8: the same inputs quantized on the GPU into a workspace, then the FP8 forward. */
    size_t ws_bytes = 0;
    rc = flashcore_fp8_workspace_bytes(&tq, &tk, &tv, NULL, &ws_bytes);
    if (rc != FLASHCORE_SUCCESS) {
        fprintf(stderr, "flashcore_fp8_workspace_bytes: %s: %s\n", flashcore_error_name(rc),
                flashcore_last_error());
        goto done;
    }
    CU_CHECK(cu.cuMemAlloc(&dws, ws_bytes));
    FlashcoreFp8Operands ops;
    rc = flashcore_quantize_fp8(ctx, &tq, &tk, &tv, NULL, dws, ws_bytes, &ops, NULL);
    if (rc == FLASHCORE_ERROR_UNSUPPORTED_GPU) {
        printf("fp8: %s: skipped\nok\n", flashcore_last_error());
        status = 0;
        goto done;
    }
    if (rc != FLASHCORE_SUCCESS) {
        fprintf(stderr, "flashcore_quantize_fp8: %s: %s\n", flashcore_error_name(rc), flashcore_last_error());
        goto done;
    }
    CU_CHECK(cu.cuMemsetD8(dout, 0xff, bytes));
    rc = flashcore_forward_fp8(ctx, &ops, &to, 0, 0.0f, 1, NULL);
    if (rc != FLASHCORE_SUCCESS) {
        fprintf(stderr, "flashcore_forward_fp8: %s: %s\n", flashcore_error_name(rc), flashcore_last_error());
        goto done;
    }
    CU_CHECK(cu.cuCtxSynchronize());
    CU_CHECK(cu.cuMemcpyDtoH(o, dout, bytes));
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < N_ELEMS; i++) {
        double e = f16_to_f64(o[i]) - ref[i];
        num += e * e;
        den += ref[i] * ref[i];
    }
    double rel = sqrt(num / den);
    printf("B%d H%d S%d D%d e4m3 (quantized on the GPU) causal: relative L2 error %.3e (O); "
           "tolerance %.0e\n",
           B, H, S, D, rel, FP8_TOLERANCE);
    if (!(rel <= FP8_TOLERANCE)) { /* NaN fails too */
        fprintf(stderr, "FAILED: fp8 error above tolerance\n");
        goto done;
    }
    printf("ok\n");
    status = 0;

done:
    if (dq)
        cu.cuMemFree(dq);
    if (dk)
        cu.cuMemFree(dk);
    if (dv)
        cu.cuMemFree(dv);
    if (dout)
        cu.cuMemFree(dout);
    if (dlse)
        cu.cuMemFree(dlse);
    if (dws)
        cu.cuMemFree(dws);
    flashcore_destroy(ctx);
    if (ctx_retained)
        cu.cuDevicePrimaryCtxRelease(dev);
    free(q);
    free(k);
    free(v);
    free(o);
    free(lse);
    free(ref);
    return status;
}
