"""flashcore's forward attention as a PyTorch operator.

`attention()` is the public function. Underneath it is one `torch.library` custom op,
`torch.ops.flashcore.attention`, with a fake (meta) implementation, so the call is one
opaque node under `torch.compile` and replays inside captured CUDA graphs.

The op launches flashcore_forward (or its _window, _ex spellings) on the tensors' own memory (no copies of kernel-ready
views), on torch's current stream of the tensors' device, in that device's primary
context (the one PyTorch uses).
"""

import math
import operator
import struct
import threading

import torch
from torch.autograd.forward_ad import unpack_dual as _unpack_dual

from . import _capi

LAYOUTS = ("bhsd", "bshd")

# The head dims the forward kernels are built for (FWD_HEAD_DIMS in src/kernels/attention).
# The forward also takes every other multiple of 8 up to 256, on the next larger kernel
# with its extra columns zero-filled (padded_head_dim there): see forward_head_dim.
HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def forward_head_dim(d):
    """Whether attention() and attention_varlen() take head dim d: a kernel's
    (HEAD_DIMS) or any other multiple of 8 up to 256 (40, 80, 160, ...)."""
    return d in HEAD_DIMS or (0 < d <= 256 and d % 8 == 0)

_DTYPE_CODES = {
    torch.float16: _capi.FLASHCORE_F16,
    torch.bfloat16: _capi.FLASHCORE_BF16,
    torch.float32: _capi.FLASHCORE_F32,
}

# Byte alignment of pointers and strides the kernels' 16-byte vector accesses need.
_ALIGN = 16


# ---- contexts, one per device ---------------------------------------------------------------

_contexts = {}
_contexts_lock = threading.Lock()


def _context(index):
    """The flashcore context of CUDA device `index` (made on first use, kept)."""
    ctx = _contexts.get(index)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(index)
            if ctx is None:
                ctx = _capi.library().create(index)
                _contexts[index] = ctx
    return ctx


def _current_stream(index):
    """The raw CUstream of torch's current stream on device `index`."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # a few times cheaper
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


# ---- describing torch tensors to the C ABI -------------------------------------------------


def _bshd_sizes_strides(t, layout):
    """Logical [B, S, H, D] sizes and element strides of a 4-d tensor in `layout`."""
    n, st = t.shape, t.stride()
    if layout == "bshd":
        return tuple(n), st
    return (n[0], n[2], n[1], n[3]), (st[0], st[2], st[1], st[3])


def _describe(t, layout, ptr):
    sizes, strides = _bshd_sizes_strides(t, layout)
    return _capi.tensor(ptr, _DTYPE_CODES.get(t.dtype, -1), sizes, strides)


def kernel_ready(t):
    """True when the kernels can read `t` in place as far as its layout goes: last dim
    contiguous, every other stride (of a dimension longer than 1) a multiple of 16 bytes.
    Strides only, so that torch.compile traces it; the start address is the op's concern
    (`_aligned`)."""
    if t.dim() != 4:
        return True  # rejected later, with the shape in the message
    n, st, size = t.shape, t.stride(), t.element_size()
    if n[3] > 1 and st[3] != 1:
        return False
    return all(n[i] <= 1 or (st[i] * size) % _ALIGN == 0 for i in range(3))


def _aligned(t):
    """`t`, or a contiguous copy when its first element is not 16-byte aligned (a view that
    starts mid-row; PyTorch's allocator aligns storages far beyond that)."""
    return t if t.data_ptr() % _ALIGN == 0 else t.clone(memory_format=torch.contiguous_format)


def _empty_outputs(q, layout, out_layout, return_lse, eager=False):
    """o, and lse or an empty stand-in: a new one for the op (whose outputs must be its
    own), one kept per device for an eager call whose caller drops it."""
    (b, s, h, d), _ = _bshd_sizes_strides(q, layout)
    o = q.new_empty((b, s, h, d) if out_layout == "bshd" else (b, h, s, d))
    if return_lse:
        lse = q.new_empty((b, h, s), dtype=torch.float32)
    elif eager:
        lse = _no_lse(q.device)
    else:
        lse = q.new_empty((0,), dtype=torch.float32)
    return o, lse


_no_lses = {}


def _no_lse(device):
    """An empty float32 tensor on `device`, made once."""
    t = _no_lses.get(device)
    if t is None:
        t = _no_lses.setdefault(device, torch.empty((0,), dtype=torch.float32, device=device))
    return t


def _check_descriptors(q, k, v, o, lse, layout, out_layout, scale, causal, window=_capi.NO_WINDOW,
                       softcap=_capi.NO_SOFTCAP):
    """flashcore's own argument checks on the tensors' sizes and strides, with stand-in
    addresses (fake tensors have none): far apart, so only real overlaps could collide."""
    dims = [x for t in (q, k, v, o) for x in (*t.shape, *t.stride())]
    if not all(type(x) is int for x in (*dims, *window)):
        # Symbolic sizes or strides (a view of a tensor with dynamic shape): the real call
        # checks. Read here they would specialize the graph on each value.
        return
    lib = _capi.library()
    descs = [_describe(t, lay, (i + 1) << 44)
             for i, (t, lay) in enumerate(((q, layout), (k, layout), (v, layout), (o, out_layout)))]
    stand_in_empty(descs)
    lib.check_forward(*descs, (5 << 44) if lse.numel() else 0, scale, causal, window, softcap=softcap)


def stand_in_empty(descs):
    """Describes the empty dimensions of a call with nothing to launch (batch, either
    sequence, query heads: `_forward`'s short cut) as 1, in place, so that every other
    check of flashcore's runs on them (descriptors of q, k, v and optionally o, in
    [B, S, H, D] order; torch's strides of an empty tensor hold for extents of 1). Without
    query heads the KV heads stand in as 1 too, so the ratio check passes; an empty
    KV-head count or head dim stays, which the library refuses whatever else is empty, as
    the real call does."""
    no_query_heads = descs[0].shape[2] == 0
    for i, d in enumerate(descs):
        d.shape[0] = max(d.shape[0], 1)
        d.shape[1] = max(d.shape[1], 1)
        if (no_query_heads and d.shape[2] > 0) or (d.shape[2] == 0 and i in (0, 3)):
            d.shape[2] = 1


# ---- the operator -------------------------------------------------------------------------


@torch.library.custom_op("flashcore::attention", mutates_args=(), device_types="cuda")
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    layout: str,
    out_layout: str,
    return_lse: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale) v with flashcore (scale 0: 1/sqrt(D)), each query row seeing
    the keys window_left before its diagonal to window_right after it (-1: no bound), each
    scaled score x capped to softcap · tanh(x / softcap) (0: no cap). Returns (o, lse); lse
    is float32 [B, H, S] when return_lse, else empty. o is contiguous in out_layout."""
    return _forward(q, k, v, causal, scale, layout, out_layout, return_lse, window_left, window_right, softcap)


def _forward(q, k, v, causal, scale, layout, out_layout, return_lse, window_left=-1, window_right=-1, softcap=0.0,
             eager=False):
    """The op's CUDA implementation (also called directly by `launch` in eager mode,
    `eager`)."""
    window = (window_left, window_right)
    o, lse = _empty_outputs(q, layout, out_layout, return_lse, eager)
    n, nk = q.shape, k.shape
    b, sq, hq, sk = (n[0], n[1], n[2], nk[1]) if layout == "bshd" else (n[0], n[2], n[1], nk[2])
    if b == 0 or sq == 0 or hq == 0 or sk == 0:
        # Nothing to launch; flashcore's rules still apply to what was passed.
        _check_descriptors(q, k, v, o, lse, layout, out_layout, scale, causal, window, softcap)
        if o.numel():
            o.zero_()  # no keys: each row's output is zero and its LSE is -inf
        if lse.numel():
            lse.fill_(-math.inf)
        return o, lse
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    index = q.get_device()
    _capi.library().forward(
        _context(index),
        _describe(q, layout, q.data_ptr()),
        _describe(k, layout, k.data_ptr()),
        _describe(v, layout, v.data_ptr()),
        _describe(o, out_layout, o.data_ptr()),
        lse.data_ptr() if return_lse else 0,
        scale,
        causal,
        _current_stream(index),
        window,
        softcap,
    )
    return o, lse


@_attention_op.register_fake
def _attention_fake(q, k, v, causal, scale, layout, out_layout, return_lse, window_left=-1, window_right=-1,
                    softcap=0.0):
    o, lse = _empty_outputs(q, layout, out_layout, return_lse)
    _check_descriptors(q, k, v, o, lse, layout, out_layout, scale, causal, (window_left, window_right), softcap)
    return o, lse


# ---- the public function ----------------------------------------------------------------


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, layout="bhsd", window_size=(-1, -1),
              softcap=0.0):
    """Scaled dot-product attention, forward, with flashcore's kernels.

    q: [B, Hq, Sq, D] and k, v: [B, Hkv, Sk, D] for layout="bhsd" (SDPA's order), or
    [B, S, H, D] for layout="bshd" (FlashAttention's). float16 or bfloat16 on one CUDA
    device; D a multiple of 8 up to 256 (kernels for 32, 64, 96, 128, 192, 256; the others
    run padded on the next larger one); Hq a multiple of Hkv (GQA/MQA by head count).

    causal: query i sees key j iff j <= i + Sk - Sq (aligned bottom-right, as
        FlashAttention and SDPA's `causal_lower_right`; for Sq == Sk the usual mask).
        A row that sees no key gives zeros (and LSE -inf).
    scale: the softmax scale; None for 1/sqrt(D). Must be finite and positive.
    return_lse: also return the float32 [B, Hq, Sq] natural-log log-sum-exp of each row.
    window_size: (left, right), local (sliding-window) attention as FlashAttention's
        window_size: query i, whose diagonal is key d = i + Sk - Sq (bottom-right, as
        causal), sees keys d - left ..= d + right; -1 (any negative value) leaves a side
        unbounded, and (-1, -1) is no window. causal is right = 0: causal=True with
        right > 0 raises FlashcoreError (INVALID_ARGUMENT). A sliding window of w keys
        (Mistral, Gemma: each query sees itself and the w - 1 keys before it) is
        causal=True, window_size=(w - 1, 0). A row whose window holds no key gives zeros
        (and LSE -inf).
    softcap: logit soft-capping as FlashAttention's softcap (Gemma 2 uses 50, Grok 30):
        each scaled score x = q·k · scale becomes softcap · tanh(x / softcap) before
        masking and the softmax, and the LSE is that of the capped scores. 0.0 (or None)
        is no cap. A negative, NaN or infinite cap, or one so far from the scale that
        scale / softcap is no normal float32, raises FlashcoreError (INVALID_ARGUMENT).

    Returns o in q's layout (contiguous), or (o, lse). Views whose strides the kernels can
    read (last dim contiguous, other strides and the start multiples of 16 bytes: slices of
    a packed QKV tensor, transposes) are read in place; other tensors are copied first.
    Runs on the current stream; works under torch.compile and in CUDA graphs (call it
    once before capturing: the first call for a configuration compiles its kernel).
    Inference only: there is no backward. Raises FlashcoreError with flashcore's message
    for anything the kernels refuse, ValueError/TypeError for misuse of this function,
    NotImplementedError for inputs that need derivatives.
    """
    scale = check_arguments("flashcore.attention", q, k, v, layout, scale)
    window = window_arg("flashcore.attention", window_size)
    softcap = softcap_arg("flashcore.attention", softcap)
    o, lse = launch(q, k, v, bool(causal), scale, layout, layout, bool(return_lse), window, softcap)
    return (o, lse) if return_lse else o


def check_arguments(fn, q, k, v, layout, scale):
    """The checks of a public function `fn` on its q, k, v, layout and scale before the
    library sees them; returns the scale as the C ABI takes it (0.0: 1/sqrt(D))."""
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-d ({layout}), got shape {tuple(t.shape)}")
    device = q.device
    if device.type not in ("cuda", "meta") or k.device != device or v.device != device:
        raise ValueError(f"{fn}: q, k and v must be on one CUDA device, got {device}, {k.device} and {v.device}")
    if _needs_grad((q, k, v)):
        raise NotImplementedError(
            f"{fn} has no backward pass (nor forward-mode derivative): call it under "
            "torch.no_grad() (or torch.inference_mode()), on tensors that neither require "
            "grad nor carry a forward-mode tangent"
        )
    if scale is None:
        return 0.0  # flashcore's default, 1/sqrt(D), computed as the Rust API does
    return softmax_scale(fn, scale)


def window_arg(fn, window_size):
    """`window_size`, FlashAttention's (left, right), as the two int64s the C ABI takes
    (a negative side: unbounded, as the library reads it). Sides must be integers that
    int64 holds: a larger Python int would wrap into another, valid-looking window."""
    try:
        left, right = window_size
        sides = (operator.index(left), operator.index(right))
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: window_size must be a pair of ints (left, right), got {window_size!r}") from None
    if isinstance(left, bool) or isinstance(right, bool):
        raise TypeError(f"{fn}: window_size must be a pair of ints (left, right), got {window_size!r}")
    if not all(-(2**63) <= x < 2**63 for x in sides):
        raise ValueError(f"{fn}: window_size's sides must fit int64 (-1: no bound), got {window_size!r}")
    return sides


def softcap_arg(fn, softcap):
    """`softcap`, FlashAttention's logit soft cap, as the float the C ABI takes: 0.0 (and
    None) for no cap. The library judges the rest (a negative, NaN or infinite cap is its
    FlashcoreError), but a non-zero cap that float32 rounds to zero (below about 1.4e-45)
    would reach it as "no cap": refused here."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, (bool, str, bytes)):
        raise TypeError(f"{fn}: softcap must be a float (0.0: no cap), got {softcap!r}")
    try:
        softcap = float(softcap)
    except OverflowError:  # an int past float64's range: the library's refusal of inf
        raise ValueError(f"{fn}: softcap must be finite and positive (0.0: no cap), got {softcap!r}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: softcap must be a float (0.0: no cap), got {softcap!r}") from None
    as_f32 = as_float32(softcap)
    # Comparisons rather than math.isinf/isfinite: under torch.compile a float can be
    # symbolic, which they cannot take.
    if softcap != 0.0 and as_f32 == 0.0:
        raise ValueError(f"{fn}: softcap {softcap} is 0 as a float32, which is no cap; pass 0.0 for none")
    if abs(as_f32) == math.inf and abs(softcap) < math.inf:
        raise ValueError(f"{fn}: softcap must be finite and positive as a float32, got {softcap}")
    return softcap


_FLOAT32_MAX = 3.4028234663852886e38
# Magnitudes float32 rounds to 0 (half its smallest subnormal, a tie that goes to the even
# 0) and to infinity (its largest value plus half an ulp, a tie that goes to the even inf).
_FLOAT32_HALF_SUBNORMAL = 2.0**-150
_FLOAT32_OVERFLOW = 2.0**128 - 2.0**103


def as_float32(x):
    """The Python float `x` rounded to float32, as the C ABI's arguments are: ±inf past its
    range (where struct.pack raises OverflowError), NaN and infinities kept. A symbolic
    float (torch.compile's dynamic shapes) is returned as it is: the library judges its
    value when the call runs."""
    if torch.compiler.is_compiling():
        # A float here may be symbolic (dynamic shapes), which struct and math.isfinite
        # cannot take: float32's rounding to zero and to infinity by comparisons instead.
        if abs(x) <= _FLOAT32_HALF_SUBNORMAL:
            return 0.0 * x
        if abs(x) >= _FLOAT32_OVERFLOW:
            return x * math.inf
        return x
    if not math.isfinite(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def softmax_scale(fn, scale):
    """`scale` as the float32 the C ABI takes: finite and positive there too. A Python
    float below float32's smallest subnormal would round to 0, which the C ABI reads as
    "the default 1/sqrt(D)"; one above its largest would become inf."""
    if isinstance(scale, (bool, str, bytes)):
        raise TypeError(f"{fn}: scale must be a float (None: 1/sqrt(D)), got {scale!r}")
    try:
        scale = float(scale)
    except OverflowError:  # an int past float64's range
        raise ValueError(f"{fn}: scale must be finite and positive as a float32, got {scale!r}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: scale must be a float (None: 1/sqrt(D)), got {scale!r}") from None
    as_f32 = as_float32(scale)
    # The kernels take scale · log2(e) as a float32 too, which the library checks. (NaN
    # fails the first comparison, an infinity the second; comparisons, not math.isfinite,
    # so that a symbolic float under torch.compile can be judged.)
    if not (0.0 < as_f32 and as_f32 * math.log2(math.e) <= _FLOAT32_MAX):
        raise ValueError(
            f"{fn}: scale must be finite and positive as a float32, and times log2(e) too "
            f"(about 1.4e-45 to 2.36e38), got {scale}"
        )
    return scale


def launch(q, k, v, causal, scale, layout, out_layout, return_lse, window=_capi.NO_WINDOW, softcap=_capi.NO_SOFTCAP):
    """The op on kernel-ready copies of whichever inputs are not (see `kernel_ready`);
    `window` is (left, right) as `window_arg` returns it, `softcap` a float as `softcap_arg`
    returns it.

    In plain eager mode (CUDA tensors, nothing tracing or intercepting) the implementation
    is called directly: going through the dispatcher costs a custom op tens of
    microseconds of host time per call, as much as the kernel itself at small sizes.
    Under torch.compile, fake tensors or a dispatch mode, the call is the registered op."""
    q, k, v = (t if kernel_ready(t) else t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
    if _plain_eager(q, k, v):
        return _forward(q, k, v, causal, scale, layout, out_layout, return_lse, *window, softcap, eager=True)
    return torch.ops.flashcore.attention(q, k, v, causal, scale, layout, out_layout, return_lse, *window, softcap)


_Tensor = torch.Tensor


def _plain_eager(q, k, v):
    if torch.compiler.is_compiling() or _dispatch_mode_active():
        return False
    return type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and q.is_cuda


def _needs_grad(tensors):
    """Autograd would want derivatives of these tensors, which flashcore does not have:
    gradients (reverse mode), or tangents (forward mode: a dual tensor of
    torch.autograd.forward_ad, or torch.func.jvp's inputs), which the op would otherwise
    drop without a word (a zero or missing tangent)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return any(_unpack_dual(t).tangent is not None for t in tensors)


def _dispatch_mode_active():
    """A TorchDispatchMode (FakeTensorMode, FlopCounterMode, ...) is intercepting ops, or a
    functorch transform (vmap, grad) is active: its wrapped tensors are plain `Tensor`s to
    `type()`, but have no storage to hand to the library."""
    try:
        return torch._C._len_torch_dispatch_stack() > 0 or torch._C._are_functorch_transforms_active()
    except AttributeError:  # an older torch: take the dispatcher, which is always right
        return True
