"""FP8 (E4M3) attention from PyTorch: 16-bit q, k, v quantized on the GPU to e4m3 with
one float32 scale per block of 128 rows, then flashcore's FP8 forward, output in q's dtype.

    o = flashcore.attention_fp8(q, k, v, causal=True)          # [B, H, S, D], like attention
    ops = flashcore.quantize_fp8(q, k, v)                      # the operands, as tensors
    o = flashcore.forward_fp8(ops, causal=True)                # attention on them, reusable

`attention_fp8` is one `torch.library` custom op, `torch.ops.flashcore.attention_fp8`,
with a fake implementation (flashcore's checks on the shapes): one opaque node under
`torch.compile`. Its quantizer workspace comes from torch's caching allocator on the
current stream, so it also replays inside CUDA graphs.

Needs an sm_89 or newer GPU (Ada, Hopper and later); older ones raise FlashcoreError
FLASHCORE_ERROR_UNSUPPORTED_GPU. Head dims 64, 128 and 256. Accuracy: E4M3 keeps 3
mantissa bits; against float64 attention, o is off by about 5% (relative L2) on normal
inputs, most of it from rounding q, k and v.
"""

import math

import torch

from . import _capi
from .ops import _aligned, _bshd_sizes_strides, _context, _current_stream, _describe, _empty_outputs
from .ops import _plain_eager, check_arguments, kernel_ready, softmax_scale, stand_in_empty

# The head dims the FP8 kernels take (HEAD_DIMS in src/kernels/attention/fp8.rs).
FP8_HEAD_DIMS = (64, 128, 256)

# Rows (of q) and keys (of k and v) that share one scale.
SCALE_BLOCK = 128


def _seed_to_op(seed):
    """A seed in [0, 2^64) as the op's int64 argument (two's complement)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _seed_from_op(seed):
    return seed + (1 << 64) if seed < 0 else seed


def _check_seed(fn, hadamard_seed):
    if hadamard_seed is None:
        return None
    if isinstance(hadamard_seed, bool) or not isinstance(hadamard_seed, int):
        raise TypeError(f"{fn}: hadamard_seed must be an int or None, got {type(hadamard_seed).__name__}")
    if not 0 <= hadamard_seed < 1 << 64:
        raise ValueError(f"{fn}: hadamard_seed must be in [0, 2^64), got {hadamard_seed}")
    return hadamard_seed


def _describe_inputs(q, k, v, layout, ptrs=None):
    """FlashcoreTensors of q, k, v (at `ptrs`, or their own addresses)."""
    ptrs = ptrs or (q.data_ptr(), k.data_ptr(), v.data_ptr())
    return [_describe(t, layout, p) for t, p in zip((q, k, v), ptrs)]


def _check_fp8_descriptors(q, k, v, layout, options):
    """flashcore's checks of a quantization on the tensors' sizes and strides, with stand-in
    addresses (fake tensors have none) far apart; returns the workspace size it needs."""
    dims = [x for t in (q, k, v) for x in (*t.shape, *t.stride())]
    if not all(type(x) is int for x in dims):
        return 0  # symbolic sizes or strides: the real call checks (as ops._check_descriptors)
    descs = _describe_inputs(q, k, v, layout, ptrs=[(i + 1) << 44 for i in range(3)])
    stand_in_empty(descs)
    return _capi.library().fp8_workspace_bytes(*descs, options)


# ---- the operator -------------------------------------------------------------------------


@torch.library.custom_op("flashcore::attention_fp8", mutates_args=(), device_types="cuda")
def _attention_fp8_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    layout: str,
    return_lse: bool,
    smooth_k: bool,
    hadamard: bool,
    hadamard_seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, v quantized to e4m3 (K smoothed, Q and K rotated when asked; the seed is the
    unsigned seed in two's complement), then softmax(q kᵀ · scale) v from them (scale 0:
    1/sqrt(D)). Returns (o, lse): o contiguous in `layout`, of q's dtype; lse float32
    [B, H, S] when return_lse, else empty."""
    return _forward_fp8(q, k, v, causal, scale, layout, return_lse, smooth_k, hadamard, hadamard_seed)


def _options(smooth_k, hadamard, hadamard_seed):
    return _capi.quantize_options(smooth_k, _seed_from_op(hadamard_seed) if hadamard else None)


def _forward_fp8(q, k, v, causal, scale, layout, return_lse, smooth_k, hadamard, hadamard_seed):
    """The op's CUDA implementation (also called directly in eager mode)."""
    o, lse = _empty_outputs(q, layout, layout, return_lse)
    options = _options(smooth_k, hadamard, hadamard_seed)
    (b, sq, hq, _), _ = _bshd_sizes_strides(q, layout)
    (_, sk, _, _), _ = _bshd_sizes_strides(k, layout)
    if b == 0 or sq == 0 or hq == 0 or sk == 0:
        # Nothing to launch; flashcore's rules still apply to what was passed.
        _check_fp8_descriptors(q, k, v, layout, options)
        if o.numel():
            o.zero_()  # no keys: each row's output is zero and its LSE is -inf
        if lse.numel():
            lse.fill_(-math.inf)
        return o, lse
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    # The workspace goes back to torch's allocator on return: later work on this stream
    # is ordered after the forward that reads it.
    descriptor, _workspace = _quantize(q, k, v, layout, options)
    _forward_from(descriptor, q.get_device(), o, lse if return_lse else None, layout, scale, causal)
    return o, lse


@_attention_fp8_op.register_fake
def _attention_fp8_fake(q, k, v, causal, scale, layout, return_lse, smooth_k, hadamard, hadamard_seed):
    o, lse = _empty_outputs(q, layout, layout, return_lse)
    _check_fp8_descriptors(q, k, v, layout, _options(smooth_k, hadamard, hadamard_seed))
    return o, lse


# ---- operands as tensors --------------------------------------------------------------------


class Fp8Operands:
    """FP8 operands on the GPU, views of one workspace (`workspace`, uint8) that they keep
    alive; `descriptor` is their FlashcoreFp8Operands for the C ABI.

    q: float8_e4m3fn [B, Sq, Hq, D]      k: float8_e4m3fn [B, Sk, Hkv, D]
    vt: float8_e4m3fn [B, Hkv, D, pitch], V transposed, keys permuted in groups of 16
        (see include/flashcore.h), pitch = Sk rounded up to 16
    q_scale: float32 [B, Hq, ceil(Sq / 128)]    k_scale, v_scale: float32 [B, Hkv, ceil(Sk / 128)]
    lse_shift: float32 [B, Hq, Sq] with K smoothing, else None
    dtype: the 16-bit dtype they were quantized from (forward_fp8's default output dtype)

    A value is its code times its block's scale: `q.float() * q_scale[..., s // 128]`.
    """

    def __init__(self, descriptor, workspace, dtype):
        self.descriptor = descriptor
        self.workspace = workspace
        self.dtype = dtype
        base = workspace.data_ptr()
        e4m3 = getattr(torch, "float8_e4m3fn", None)

        def view(ptr, shape, dtype):
            n = math.prod(shape) * (4 if dtype is torch.float32 else 1)
            flat = workspace[ptr - base : ptr - base + n]
            if dtype is torch.float32:
                return flat.view(torch.float32).view(shape)
            return (flat.view(e4m3) if e4m3 is not None else flat).view(shape)

        d = descriptor
        b, sq, hq, dim = (d.q.shape[i] for i in range(4))
        _, sk, hkv, _ = (d.k.shape[i] for i in range(4))
        pitch = d.vt_strides[2]
        self.q = view(d.q.ptr, (b, sq, hq, dim), e4m3)
        self.k = view(d.k.ptr, (b, sk, hkv, dim), e4m3)
        self.vt = view(d.vt, (b, hkv, dim, pitch), e4m3)
        self.q_scale = view(d.q_scale, (b, hq, -(-sq // SCALE_BLOCK)), torch.float32)
        self.k_scale = view(d.k_scale, (b, hkv, -(-sk // SCALE_BLOCK)), torch.float32)
        self.v_scale = view(d.v_scale, (b, hkv, -(-sk // SCALE_BLOCK)), torch.float32)
        self.lse_shift = view(d.lse_shift, (b, hq, sq), torch.float32) if d.lse_shift else None

    @property
    def shape(self):
        """(B, Sq, Hq, Sk, Hkv, D)."""
        b, sq, hq, dim = self.q.shape
        return b, sq, hq, self.k.shape[1], self.k.shape[2], dim

    def __repr__(self):
        b, sq, hq, sk, hkv, dim = self.shape
        shift = ", lse_shift" if self.lse_shift is not None else ""
        return f"Fp8Operands(B={b}, Sq={sq}, Hq={hq}, Sk={sk}, Hkv={hkv}, D={dim}, from {self.dtype}{shift})"


def _quantize(q, k, v, layout, options):
    """flashcore_quantize_fp8 on kernel-ready CUDA tensors into a fresh workspace: the
    operands' FlashcoreFp8Operands and the workspace (uint8) they lie in."""
    lib = _capi.library()
    descs = _describe_inputs(q, k, v, layout)
    ws_bytes = lib.fp8_workspace_bytes(*descs, options)
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device)
    index = q.get_device()
    descriptor = lib.quantize_fp8(
        _context(index), *descs, options, workspace.data_ptr(), ws_bytes, _current_stream(index)
    )
    return descriptor, workspace


def _forward_from(descriptor, index, o, lse, layout, scale, causal):
    """flashcore_forward_fp8 on device `index` from the operands `descriptor` describes into
    `o` (in `layout`) and `lse` (or None)."""
    _capi.library().forward_fp8(
        _context(index),
        descriptor,
        _describe(o, layout, o.data_ptr()),
        lse.data_ptr() if lse is not None else 0,
        scale,
        causal,
        _current_stream(index),
    )


# ---- the public functions -------------------------------------------------------------------


def attention_fp8(
    q, k, v, *, causal=False, scale=None, return_lse=False, layout="bhsd", smooth_k=False, hadamard_seed=None
):
    """Scaled dot-product attention, forward, in FP8: q, k and v are quantized on the GPU to
    e4m3 with per-block scales, then flashcore's FP8 kernel computes the attention.

    q: [B, Hq, Sq, D] and k, v: [B, Hkv, Sk, D] for layout="bhsd", or [B, S, H, D] for
    layout="bshd". float16 or bfloat16 on one CUDA device of sm_89 or newer; D in 64, 128,
    256; Hq a multiple of Hkv.

    causal, scale, return_lse: as flashcore.attention (the LSE is that of the unquantized
        scores' formula, with K smoothing's shift added back).
    smooth_k: subtract K's per-channel mean over the sequence before quantizing it (keys
        of real models carry such offsets; they cost E4M3 precision). Exact in real
        arithmetic: the softmax does not see a per-row constant.
    hadamard_seed: None, or a seed in [0, 2^64): rotate q and k by a random-sign Hadamard
        transform along D before quantizing (spreads outlier channels; q kᵀ is unchanged).

    Returns o in q's layout and dtype (contiguous), or (o, lse). Accuracy against float64
    attention: about 5% relative L2 on normal inputs, while each row's largest logit
    (scale times score) stays below about 1.2e7 in magnitude (beyond, see flashcore.h's
    flashcore_forward_fp8); never NaN or infinite for finite inputs below about 1e35 in
    magnitude (the rotation and the key mean sum in float32; O's sums overflow where V's
    values times the keys' count pass float32), and non-finite inputs make only the
    outputs that read them non-finite, as in 16-bit attention. Runs on the current stream; works
    under torch.compile and in CUDA graphs. Inference only. Raises FlashcoreError for what
    the library refuses, ValueError/TypeError for misuse of this function,
    NotImplementedError for inputs that need derivatives.
    """
    fn = "flashcore.attention_fp8"
    scale = check_arguments(fn, q, k, v, layout, scale)
    seed = _check_seed(fn, hadamard_seed)
    o, lse = launch_fp8(q, k, v, bool(causal), scale, layout, bool(return_lse), bool(smooth_k), seed)
    return (o, lse) if return_lse else o


def launch_fp8(q, k, v, causal, scale, layout, return_lse, smooth_k, hadamard_seed):
    """The op on kernel-ready copies of whichever inputs are not (see ops.kernel_ready),
    called directly in plain eager mode (as ops.launch does); arguments already checked
    (scale 0: 1/sqrt(D); hadamard_seed None or in [0, 2^64)). Returns (o, lse)."""
    q, k, v = (t if kernel_ready(t) else t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
    hadamard = hadamard_seed is not None
    args = (causal, scale, layout, return_lse, smooth_k, hadamard, _seed_to_op(hadamard_seed or 0))
    if _plain_eager(q, k, v):
        return _forward_fp8(q, k, v, *args)
    return torch.ops.flashcore.attention_fp8(q, k, v, *args)


def quantize_fp8(q, k, v, *, layout="bhsd", smooth_k=False, hadamard_seed=None):
    """q, k, v (as attention_fp8 takes them: CUDA, float16 or bfloat16, `layout`) quantized
    to FP8 operands on the GPU, on the current stream: an Fp8Operands of tensor views of one
    fresh workspace. Use them with forward_fp8 as often as q, k, v stay the same (the keys
    and values of a prompt, say). The workspace belongs to the current stream, as any
    tensor torch allocates there: a forward_fp8 on another stream must be ordered after
    the quantizer, and the operands kept alive until it has run, as torch asks of any
    tensor used across streams (wait_stream, record_stream). Eager only (not a
    torch.library op)."""
    fn = "flashcore.quantize_fp8"
    check_arguments(fn, q, k, v, layout, None)
    seed = _check_seed(fn, hadamard_seed)
    if q.device.type != "cuda":
        raise ValueError(f"{fn}: q, k and v must be CUDA tensors, got {q.device}")
    q, k, v = (_aligned(t) if kernel_ready(t) else t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
    descriptor, workspace = _quantize(q, k, v, layout, _capi.quantize_options(smooth_k, seed))
    return Fp8Operands(descriptor, workspace, q.dtype)


def forward_fp8(ops, *, causal=False, scale=None, return_lse=False, layout="bhsd", out_dtype=None):
    """Attention from FP8 operands (quantize_fp8's), on the current stream: o in `layout`
    ([B, Hq, Sq, D] for "bhsd", [B, Sq, Hq, D] for "bshd"), contiguous, of `out_dtype`
    (float16 or bfloat16; None: the dtype the operands were quantized from), or (o, lse).
    causal, scale, return_lse: as attention_fp8."""
    fn = "flashcore.forward_fp8"
    if not isinstance(ops, Fp8Operands):
        raise TypeError(f"{fn}: ops must be the Fp8Operands of flashcore.quantize_fp8, got {type(ops).__name__}")
    from .ops import LAYOUTS

    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    out_dtype = ops.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"{fn}: out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    if scale is None:
        scale = 0.0
    else:
        scale = softmax_scale(fn, scale)
    b, sq, hq, _, _, dim = ops.shape
    device = ops.workspace.device
    o = torch.empty((b, sq, hq, dim) if layout == "bshd" else (b, hq, sq, dim), dtype=out_dtype, device=device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=device) if return_lse else None
    _forward_from(ops.descriptor, device.index, o, lse, layout, scale, bool(causal))
    return (o, lse) if return_lse else o
