"""Variable-length prefill on torch tensors: prompts of different lengths packed without
padding, one launch (FlashAttention's `flash_attn_varlen_func` layout).

    o = flashcore.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=True)
    o = flashcore.attention_varlen(..., causal=True, window_size=(w - 1, 0))  # sliding window of w keys
    o = flashcore.attention_varlen(..., causal=True, softcap=50.0)  # Gemma 2's logit soft-capping

q [total_q, Hq, D], k and v [total_k, Hkv, D]; sequence b is rows
cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (and of o) and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
of k and v (int32 offsets on the GPU). A `torch.library` custom op
(`torch.ops.flashcore.attention_varlen`) whose fake implementation applies flashcore's own
rules through flashcore_check_forward_varlen (or its _window, _ex spellings); in plain
eager mode it is called directly.
"""

import math
from typing import Optional

import torch

from . import _capi
from .ops import _ALIGN, _aligned, _context, _current_stream, softcap_arg, window_arg
from .serving import (
    _STAND_IN,
    _check_device,
    _check_no_grad,
    _check_tensor,
    _desc,
    _host_int32,
    _plain_eager,
    _scale_arg,
    _static,
)


# The longest sequence flashcore takes (the C ABI's limit on max_seqlen_q): checked here,
# since the C struct's int64 would wrap a larger Python int.
_MAX_SEQLEN = 2**25


def _packed(t, ptr=None):
    """A [rows, H, D] tensor as the C ABI's packed [1, rows, H, D] view."""
    return _desc((1, *t.shape), (0, *t.stride()), t.dtype, t.data_ptr() if ptr is None else ptr)


def _stand_in(t, ptr):
    """`_packed(t)` at a stand-in address, empty dimensions described as 1: every check
    but "not empty" still applies to a call with nothing to launch."""
    d = _packed(t, ptr)
    for j in range(4):
        d.shape[j] = max(d.shape[j], 1)
    return d


def _ready(t):
    """`t`, or a contiguous copy when the kernels cannot read its layout in place (last dim
    not contiguous, or another stride not a multiple of 16 bytes)."""
    n, st, size = t.shape, t.stride(), t.element_size()
    ok = (n[2] <= 1 or st[2] == 1) and all(n[i] <= 1 or (st[i] * size) % _ALIGN == 0 for i in range(2))
    return t if ok else t.contiguous()


def _varlen_struct(cu_q_ptr, cu_k_ptr, batch, max_seqlen_q):
    v = _capi.FlashcoreVarlen()
    v.cu_seqlens_q = cu_q_ptr
    v.cu_seqlens_k = cu_k_ptr
    v.batch = batch
    v.max_seqlen_q = max_seqlen_q
    return v


def _outputs(q, return_lse):
    total, hq, _ = q.shape
    o = q.new_empty(q.shape)
    lse = q.new_empty((hq, total) if return_lse else (0,), dtype=torch.float32)
    return o, lse


def _host(name, x, n):
    return None if x is None else _host_int32("attention_varlen", name, x, (n,))


def _check(q, k, v, o, return_lse, batch, max_seqlen_q, scale, causal, host_q=None, host_k=None,
           window=_capi.NO_WINDOW, softcap=_capi.NO_SOFTCAP):
    """flashcore_check_forward_varlen at stand-in addresses (fake tensors have none), with
    the host offsets when given."""
    if not _static(q, k, v, o):
        return
    for name, host, rows in (("host_cu_seqlens_q", host_q, q.shape[0]), ("host_cu_seqlens_k", host_k, k.shape[0])):
        # Described as one row, an empty tensor would hold an offset of 1.
        if host is not None and rows == 0 and int(host.abs().max()) != 0:
            raise ValueError(f"flashcore.attention_varlen: {name} reaches past the tensor's 0 rows")
    _capi.library().check_forward_varlen(
        _stand_in(q, 1 * _STAND_IN),
        _stand_in(k, 2 * _STAND_IN),
        _stand_in(v, 3 * _STAND_IN),
        _stand_in(o, 4 * _STAND_IN),
        5 * _STAND_IN if return_lse else 0,
        _varlen_struct(6 * _STAND_IN, 7 * _STAND_IN, batch, max_seqlen_q),
        _capi.host_ptr(host_q.data_ptr()) if host_q is not None else None,
        _capi.host_ptr(host_k.data_ptr()) if host_k is not None else None,
        scale,
        causal,
        window,
        softcap=softcap,
    )


@torch.library.custom_op("flashcore::attention_varlen", mutates_args=(), device_types="cuda")
def _varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    host_cu_seqlens_q: Optional[torch.Tensor],
    host_cu_seqlens_k: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    return_lse: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed variable-length attention with flashcore (scale 0: 1/sqrt(D); window_left,
    window_right: each sequence's key window, -1 for no bound; softcap: the logit soft cap,
    0 for none). Returns (o, lse): o [total_q, Hq, D] contiguous, lse float32 [Hq, total_q]
    when return_lse, else empty."""
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, host_cu_seqlens_q, host_cu_seqlens_k,
                   causal, scale, return_lse, window_left, window_right, softcap)


def _varlen(q, k, v, cu_q, cu_k, max_seqlen_q, host_q, host_k, causal, scale, return_lse, window_left=-1,
            window_right=-1, softcap=0.0):
    """The op's CUDA implementation (also called directly in plain eager mode)."""
    window = (window_left, window_right)
    o, lse = _outputs(q, return_lse)
    batch = cu_q.shape[0] - 1
    if q.numel() == 0 or k.numel() == 0:
        # Nothing to launch; flashcore's rules still apply to what was passed. With no
        # keys, every query row sees none: zeros, and an LSE of -inf.
        _check(q, k, v, o, return_lse, batch, max_seqlen_q, scale, causal, host_q, host_k, window, softcap)
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    q, k, v = _aligned(q), _aligned(k), _aligned(v)
    index = q.get_device()
    lib = _capi.library()
    lib.forward_varlen(
        _context(index),
        _packed(q),
        _packed(k),
        _packed(v),
        _packed(o),
        lse.data_ptr() if return_lse else 0,
        _varlen_struct(cu_q.data_ptr(), cu_k.data_ptr(), batch, max_seqlen_q),
        _capi.host_ptr(host_q.data_ptr()) if host_q is not None else None,
        _capi.host_ptr(host_k.data_ptr()) if host_k is not None else None,
        scale,
        causal,
        _current_stream(index),
        window,
        softcap,
    )
    return o, lse


@_varlen_op.register_fake
def _varlen_fake(q, k, v, cu_q, cu_k, max_seqlen_q, host_q, host_k, causal, scale, return_lse, window_left=-1,
                 window_right=-1, softcap=0.0):
    o, lse = _outputs(q, return_lse)
    # The host copies are fake here too (no data): the real call checks them.
    _check(q, k, v, o, return_lse, cu_q.shape[0] - 1, max_seqlen_q, scale, causal, window=(window_left, window_right),
           softcap=softcap)
    return o, lse


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    *,
    causal=False,
    scale=None,
    return_lse=False,
    host_cu_seqlens_q=None,
    host_cu_seqlens_k=None,
    window_size=(-1, -1),
    softcap=0.0,
):
    """Attention over a batch of sequences of different lengths packed without padding.

    q: [total_q, Hq, D]; k, v: [total_k, Hkv, D]; float16 or bfloat16, D a multiple of 8
        up to 256 (as attention()), Hq a multiple of Hkv (GQA/MQA); last dim contiguous,
        other strides multiples of 16 bytes.
    cu_seqlens_q, cu_seqlens_k: int32 [B + 1] on the GPU, contiguous: sequence b is query
        rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] and key rows cu_seqlens_k[b]:cu_seqlens_k[b + 1].
    max_seqlen_q: at least the longest query sequence (it sizes the launch), at most 2^25.
    causal: bottom-right aligned per sequence (query i of a sequence of Sq queries and Sk
        keys sees keys j <= i + Sk - Sq); a sequence with queries and no keys gives zeros
        (and an LSE of -inf), a batch with no keys at all (k and v of 0 rows) too.
    scale: the softmax scale; None for 1/sqrt(D).
    return_lse: also return the float32 [Hq, total_q] log-sum-exp.
    host_cu_seqlens_q, host_cu_seqlens_k: optional host copies of the offsets (CPU tensors
        or sequences of ints), both or neither: checked (non-decreasing, inside the tensors,
        no sequence past max_seqlen_q) before anything runs. Without them the kernels clamp
        every sequence to the tensors, and decreasing offsets give overlapping sequences
        whose output rows are written by both, in no set order.
    window_size: (left, right), each sequence's key window as flashcore.attention takes
        it, aligned bottom-right per sequence: query i of a sequence of Sq queries and Sk
        keys, whose diagonal is its key d = i + Sk - Sq, sees that sequence's keys
        d - left ..= d + right (-1: no bound; causal with right > 0 is refused). A sliding
        window of w keys is causal=True, window_size=(w - 1, 0).
    softcap: logit soft-capping as flashcore.attention takes it (each scaled score x
        becomes softcap · tanh(x / softcap); 0.0 or None: no cap), in every sequence.

    Each sequence sees only its own keys: rows of k and v that no sequence covers, or
    that belong to another sequence, never reach its output, whatever they hold (NaN and
    infinities included).

    Returns o ([total_q, Hq, D], contiguous; rows no sequence covers are left
    uninitialised), or (o, lse). Inference only. Raises FlashcoreError for anything the
    kernels refuse, ValueError/TypeError for misuse of this function.
    """
    fn = "attention_varlen"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(fn, name, t, 3)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(fn, name, t, 1)
        if t.dtype != torch.int32:
            raise ValueError(f"flashcore.{fn}: {name} must be torch.int32, got {t.dtype}")
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"flashcore.{fn}: {name} must be contiguous, got stride {t.stride(0)}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] or cu_seqlens_q.shape[0] < 2:
        raise ValueError(
            f"flashcore.{fn}: cu_seqlens_q and cu_seqlens_k must both hold B + 1 >= 2 entries, got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    if not isinstance(max_seqlen_q, int) or isinstance(max_seqlen_q, bool) or not 1 <= max_seqlen_q <= _MAX_SEQLEN:
        raise ValueError(f"flashcore.{fn}: max_seqlen_q must be an int from 1 to 2^25, got {max_seqlen_q!r}")
    _check_device(fn, [("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                       ("cu_seqlens_k", cu_seqlens_k)])
    _check_no_grad(fn, (q, k, v))
    scale = _scale_arg(fn, scale)
    window = window_arg(f"flashcore.{fn}", window_size)
    softcap = softcap_arg(f"flashcore.{fn}", softcap)
    if (host_cu_seqlens_q is None) != (host_cu_seqlens_k is None):
        raise ValueError(f"flashcore.{fn}: give both host_cu_seqlens_q and host_cu_seqlens_k, or neither")
    n = cu_seqlens_q.shape[0]
    host_q = _host("host_cu_seqlens_q", host_cu_seqlens_q, n)
    host_k = _host("host_cu_seqlens_k", host_cu_seqlens_k, n)
    q, k, v = _ready(q), _ready(k), _ready(v)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, host_q, host_k, bool(causal), scale, bool(return_lse),
            *window, softcap)
    if _plain_eager(args[:5]):
        o, lse = _varlen(*args)
    else:
        o, lse = torch.ops.flashcore.attention_varlen(*args)
    return (o, lse) if return_lse else o
