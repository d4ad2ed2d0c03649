"""Variable-length batches on torch tensors, packed without padding (FlashAttention's
`flash_attn_varlen_func` layout): prefill of prompts of different lengths in one launch,
and a serving step's new queries against a KV cache in one call.

    o = flashcore.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, causal=True)
    o = flashcore.attention_varlen(..., causal=True, window_size=(w - 1, 0))  # sliding window of w keys
    o = flashcore.attention_varlen(..., causal=True, softcap=50.0)  # Gemma 2's logit soft-capping
    o = flashcore.decode_varlen(q, k_cache, v_cache, seqlens, cu_seqlens_q, max_seqlen_q, causal=True)

q [total_q, Hq, D], k and v [total_k, Hkv, D]; sequence b is rows
cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q (and of o) and cu_seqlens_k[b]:cu_seqlens_k[b + 1]
of k and v (int32 offsets on the GPU). decode_varlen takes its keys from a cache as
flashcore.decode does (seqlens, optionally a block table), in place of k, v and
cu_seqlens_k. Each is a `torch.library` custom op (`torch.ops.flashcore.attention_varlen`,
`.decode_varlen`) whose fake implementation applies flashcore's own rules through
flashcore_check_forward_varlen (or its _window, _ex spellings) and
flashcore_check_decode_varlen; in plain eager mode it is called directly.
"""

import math
from typing import Optional

import torch

from . import _capi
from .ops import _ALIGN, _aligned, _context, _current_stream, softcap_arg, window_arg
from .serving import (
    _STAND_IN,
    _cache_at_stand_ins,
    _cache_in_place,
    _check_cache_call,
    _check_device,
    _check_no_grad,
    _check_tensor,
    _desc,
    _describe_scales,
    _host_arrays,
    _host_int32,
    _plain_eager,
    _prepare_host,
    _scale_arg,
    _static,
    _workspace,
    _workspace_bytes,
)


# The longest sequence flashcore takes (the C ABI's limit on max_seqlen_q): checked here,
# since the C struct's int64 would wrap a larger Python int.
_MAX_SEQLEN = 2**25


def _check_max_seqlen(fn, max_seqlen_q):
    """An int from 1 to 2^25; under torch.compile a symbolic one (dynamic shapes) is taken
    as it is and checked by the real call, so that each new value does not recompile."""
    if isinstance(max_seqlen_q, torch.SymInt):
        return
    if not isinstance(max_seqlen_q, int) or isinstance(max_seqlen_q, bool) or not 1 <= max_seqlen_q <= _MAX_SEQLEN:
        raise ValueError(f"flashcore.{fn}: max_seqlen_q must be an int from 1 to 2^25, got {max_seqlen_q!r}")


def _packed(t, ptr=None):
    """A [rows, H, D] tensor as the C ABI's packed [1, rows, H, D] view."""
    return _desc((1, *t.shape), (0, *t.stride()), t.dtype, t.data_ptr() if ptr is None else ptr)


def _stand_in(t, ptr):
    """`_packed(t)` at a stand-in address, no rows described as one: every check but "not
    empty" still applies to a call with nothing to launch. (Heads or a head dim of 0 stay
    0, which the checks refuse, as the library refuses them with rows.)"""
    d = _packed(t, ptr)
    d.shape[1] = max(d.shape[1], 1)
    return d


def _ready(t):
    """`t`, or a contiguous copy when the kernels cannot read its layout in place (last dim
    not contiguous, or another stride not a multiple of 16 bytes)."""
    n, st, size = t.shape, t.stride(), t.element_size()
    ok = (n[2] <= 1 or st[2] == 1) and all(n[i] <= 1 or (st[i] * size) % _ALIGN == 0 for i in range(2))
    return t if ok else t.contiguous()


def _plain_ints(*values):
    """Whether every value is a plain int (not a torch.SymInt)."""
    return all(type(x) is int for x in values)


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
    the host offsets when given. Symbolic sizes, strides, batch or bound (torch.compile's
    dynamic shapes) leave the checks to the real call: read here they would specialize the
    graph on each value and recompile for every new one."""
    if not _static(q, k, v, o) or not _plain_ints(batch, max_seqlen_q, *window):
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
    if q.shape[0] == 0 or k.shape[0] == 0:
        # No rows: nothing to launch; flashcore's rules still apply to what was passed.
        # With no keys, every query row sees none: zeros, and an LSE of -inf.
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
    max_seqlen_q: at least the longest query sequence (it sizes the launch), at most 2^25
        (as are total_q and total_k).
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
    kernels refuse, ValueError/TypeError for misuse of this function,
    NotImplementedError for inputs that need derivatives.
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
    _check_max_seqlen(fn, max_seqlen_q)
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


# ---- a serving batch in one call: packed queries against a KV cache ---------------------------


def _check_decode_varlen(q, k_cache, v_cache, block_table, o, return_lse, batch, max_seqlen_q, scale, causal,
                         k_scale=None, v_scale=None, window=_capi.NO_WINDOW, softcap=_capi.NO_SOFTCAP, host_cu_q=None):
    """flashcore_check_decode_varlen at stand-in addresses (fake tensors have none), with
    the host offsets when given; the host lengths and block table are the real call's.
    For an empty q (nothing to compute, which is no error) empty dimensions are described
    as 1, so that every other rule still applies. Symbolic values are left to the real
    call, as in `_check`."""
    if not _static(q, k_cache, v_cache, block_table, o, k_scale, v_scale) or not _plain_ints(
        batch, max_seqlen_q, *window
    ):
        return
    empty = q.numel() == 0
    # Described as one row, an empty q would hold an offset of 1.
    if host_cu_q is not None and q.shape[0] == 0 and int(host_cu_q.abs().max()) != 0:
        raise ValueError("flashcore.decode_varlen: host_cu_seqlens_q reaches past q's 0 rows")
    cache = _cache_at_stand_ins(k_cache, v_cache, block_table, empty)
    _capi.library().check_decode_varlen(
        _stand_in(q, 1 * _STAND_IN) if empty else _packed(q, 1 * _STAND_IN),
        cache,
        _describe_scales(k_scale, v_scale, (8 * _STAND_IN, 9 * _STAND_IN), empty),
        10 * _STAND_IN,
        max(batch, 1) if empty else batch,
        max_seqlen_q,
        _capi.host_ptr(host_cu_q.data_ptr()) if host_cu_q is not None else None,
        None,
        None,
        _stand_in(o, 2 * _STAND_IN) if empty else _packed(o, 2 * _STAND_IN),
        7 * _STAND_IN if return_lse else 0,
        scale,
        causal,
        window,
        softcap,
    )


@torch.library.custom_op("flashcore::decode_varlen", mutates_args=(), device_types="cuda")
def _decode_varlen_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    block_table: Optional[torch.Tensor],
    host_seqlens: Optional[torch.Tensor],
    host_block_table: Optional[torch.Tensor],
    host_cu_seqlens_q: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    return_lse: bool,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A serving batch against a KV cache with flashcore: packed queries [total_q, Hq, D],
    sequence b's at rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] (scale 0: 1/sqrt(D); k_scale,
    v_scale: an FP8 cache's scales; window_left, window_right: the key window, -1 for no
    bound; softcap: the logit soft cap, 0 for none). Returns (o, lse): o [total_q, Hq, D]
    contiguous, lse float32 [Hq, total_q] when return_lse, else empty."""
    return _decode_varlen(q, k_cache, v_cache, seqlens, cu_seqlens_q, max_seqlen_q, block_table, host_seqlens,
                          host_block_table, host_cu_seqlens_q, causal, scale, return_lse, k_scale, v_scale,
                          window_left, window_right, softcap)


def _decode_varlen(q, k_cache, v_cache, seqlens, cu_q, max_seqlen_q, block_table, host_seqlens, host_block_table,
                   host_cu_q, causal, scale, return_lse, k_scale=None, v_scale=None, window_left=-1, window_right=-1,
                   softcap=0.0):
    """The op's CUDA implementation (also called directly in plain eager mode)."""
    window = (window_left, window_right)
    o, lse = _outputs(q, return_lse)
    batch = seqlens.shape[0]
    if q.numel() == 0:
        # Nothing to compute; flashcore's rules still apply to what was passed.
        _check_decode_varlen(q, k_cache, v_cache, block_table, o, return_lse, batch, max_seqlen_q, scale, causal,
                             k_scale, v_scale, window, softcap, host_cu_q)
        return o, lse
    q = _aligned(q)
    index = q.get_device()
    lib = _capi.library()
    ctx = _context(index)
    q_desc = _packed(q)
    cache = _cache_in_place(k_cache, v_cache, seqlens, block_table)
    scales = _describe_scales(k_scale, v_scale)
    ws_bytes = _workspace_bytes(
        index, q, k_cache, block_table,
        lambda: lib.decode_varlen_workspace_bytes(ctx, q_desc, cache, scales, cu_q.data_ptr(), batch, max_seqlen_q),
        batch, max_seqlen_q,
    )
    workspace, ws_ptr = _workspace(ws_bytes, q.device)
    lens_ptr, table_ptr = _host_arrays(host_seqlens, host_block_table)
    lib.decode_varlen(
        ctx,
        q_desc,
        cache,
        scales,
        cu_q.data_ptr(),
        batch,
        max_seqlen_q,
        _capi.host_ptr(host_cu_q.data_ptr()) if host_cu_q is not None else None,
        lens_ptr,
        table_ptr,
        _packed(o),
        lse.data_ptr() if return_lse else 0,
        scale,
        causal,
        ws_ptr,
        ws_bytes,
        _current_stream(index),
        window,
        softcap,
    )
    del workspace  # freed in stream order: later work on this stream runs after the kernels
    return o, lse


@_decode_varlen_op.register_fake
def _decode_varlen_fake(q, k_cache, v_cache, seqlens, cu_q, max_seqlen_q, block_table, host_seqlens, host_block_table,
                        host_cu_q, causal, scale, return_lse, k_scale=None, v_scale=None, window_left=-1,
                        window_right=-1, softcap=0.0):
    o, lse = _outputs(q, return_lse)
    # The host copies are fake here too (no data): the real call checks them.
    _check_decode_varlen(q, k_cache, v_cache, block_table, o, return_lse, seqlens.shape[0], max_seqlen_q, scale,
                         causal, k_scale, v_scale, (window_left, window_right), softcap)
    return o, lse


def decode_varlen(
    q,
    k_cache,
    v_cache,
    seqlens,
    cu_seqlens_q,
    max_seqlen_q,
    *,
    block_table=None,
    causal=False,
    scale=None,
    return_lse=False,
    host_seqlens=None,
    host_block_table=None,
    host_cu_seqlens_q=None,
    k_scale=None,
    v_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
):
    """A serving step in one call: each sequence's new queries (decode tokens, speculative
    drafts, prompt chunks) packed one after another, attending to a KV cache as `decode`
    attends (FlashAttention's varlen call with seqused_k and a block table).

    q: [total_q, Hq, D], float16 or bfloat16; sequence b's queries are rows
        cu_seqlens_q[b]:cu_seqlens_q[b + 1], n_b of them, query i at position
        seqlens[b] - n_b + i of its sequence (bottom-right aligned, as `decode`'s).
        Hq a multiple of Hkv; D as for `decode`. Last dim contiguous, other strides
        multiples of 16 bytes (else copied).
    k_cache, v_cache, seqlens, block_table, k_scale, v_scale: the cache, as for `decode`
        (B = seqlens.shape[0] sequences: contiguous [B, capacity, Hkv, D], or page pools
        with a [B, max_pages] block table; an FP8 cache with its scales).
    cu_seqlens_q: int32 [B + 1] on the GPU, contiguous: the query offsets.
    max_seqlen_q: at least the longest n_b (it sizes the launch), 1 to 2^25. Up to 16 the
        split-KV decode kernels run; past it, on Hopper where the forward kernels read the
        cache (16-bit, contiguous or pages of 16 or more), the sequences of more than 16
        queries go to the forward kernels and the others to the decode kernels, split on
        the GPU (a captured graph stays right as the mix changes).
    causal, scale, window_size, softcap: as for `decode`, per sequence. A query before
        its sequence's first position (n_b > seqlens[b]) sees no key: zeros, LSE -inf.
    return_lse: also return the float32 [Hq, total_q] log-sum-exp.
    host_seqlens, host_block_table: optional host copies, checked as `decode` checks them.
    host_cu_seqlens_q: optional host copy of the offsets (a CPU tensor or a sequence of
        ints), checked first: from 0 or more, non-decreasing, ending inside q, none longer
        than max_seqlen_q. Without it the kernels clamp the offsets to q's rows and each
        run to max_seqlen_q.

    Returns o ([total_q, Hq, D], contiguous; rows no sequence covers are left
    uninitialised), or (o, lse). The workspace (from torch's allocator) depends on the
    shapes, max_seqlen_q and the GPU only. Inference only. Raises FlashcoreError with
    flashcore's message for anything the kernels refuse, ValueError/TypeError for misuse
    of this function, NotImplementedError for inputs that need derivatives.
    """
    fn = "decode_varlen"
    _check_tensor(fn, "q", q, 3)
    _check_tensor(fn, "cu_seqlens_q", cu_seqlens_q, 1)
    # (Any other seqlens is refused by the metadata checks, with their message.)
    batch = seqlens.shape[0] if isinstance(seqlens, torch.Tensor) and seqlens.dim() == 1 else -1
    _check_cache_call(fn, batch, [("q", q)], k_cache, v_cache, seqlens, block_table, k_scale, v_scale,
                      [("cu_seqlens_q", cu_seqlens_q)])
    if cu_seqlens_q.dtype != torch.int32:
        raise ValueError(f"flashcore.{fn}: cu_seqlens_q must be torch.int32, got {cu_seqlens_q.dtype}")
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"flashcore.{fn}: cu_seqlens_q has {cu_seqlens_q.shape[0]} entries for a batch of {batch} (B + 1 needed)"
        )
    if cu_seqlens_q.stride(0) != 1:
        raise ValueError(f"flashcore.{fn}: cu_seqlens_q must be contiguous, got stride {cu_seqlens_q.stride(0)}")
    _check_max_seqlen(fn, max_seqlen_q)
    scale = _scale_arg(fn, scale)
    window = window_arg(f"flashcore.{fn}", window_size)
    softcap = softcap_arg(f"flashcore.{fn}", softcap)
    host_seqlens, host_block_table = _prepare_host(fn, batch, block_table, host_seqlens, host_block_table)
    host_cu_q = None
    if host_cu_seqlens_q is not None:
        host_cu_q = _host_int32(fn, "host_cu_seqlens_q", host_cu_seqlens_q, (batch + 1,))
    q = _ready(q)
    args = (q, k_cache, v_cache, seqlens, cu_seqlens_q, max_seqlen_q, block_table, host_seqlens, host_block_table,
            host_cu_q, bool(causal), scale, bool(return_lse), k_scale, v_scale, *window, softcap)
    if _plain_eager(args[:5] + (block_table,) + args[13:15]):
        o, lse = _decode_varlen(*args)
    else:
        o, lse = torch.ops.flashcore.decode_varlen(*args)
    return (o, lse) if return_lse else o
