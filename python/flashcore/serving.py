"""flashcore's serving calls on torch tensors: decode against a KV cache, appending new
tokens' keys and values to it, and merging partial attention results by their
log-sum-exp.

    o = flashcore.decode(q, k_cache, v_cache, seqlens)                        # contiguous cache
    o = flashcore.decode(q, k_pool, v_pool, seqlens, block_table=table)       # paged cache
    o = flashcore.decode(q, k_cache, v_cache, seqlens, causal=True, window_size=(w - 1, 0))  # sliding window
    o = flashcore.decode(q, k_cache, v_cache, seqlens, causal=True, softcap=50.0)  # logit soft-capping
    flashcore.append_kv(k_cache, v_cache, seqlens, k_new, v_new); seqlens += k_new.shape[1]
    o, lse = flashcore.merge(o_parts, lse_parts, return_lse=True)

    # FP8 cache (sm_89+): e4m3 codes and one float32 scale per (position, KV head) row.
    k8 = torch.empty(B, capacity, Hkv, D, dtype=torch.float8_e4m3fn, device="cuda")  # v8 too
    k_scale = torch.empty(B, capacity, Hkv, dtype=torch.float32, device="cuda")      # v_scale too
    flashcore.append_kv(k8, v8, seqlens, k_new, v_new, k_scale=k_scale, v_scale=v_scale)  # 16-bit in
    o = flashcore.decode(q, k8, v8, seqlens, k_scale=k_scale, v_scale=v_scale)    # 16-bit q, o

Tensors are in FlashAttention's [B, S, H, D] order (q [B, Sq, Hq, D], caches
[B, capacity, Hkv, D] or page pools [pages, page_size, Hkv, D]), as flash_attn_with_kvcache
takes them. Each function is a `torch.library` custom op (`torch.ops.flashcore.decode`,
`.append_kv`, `.merge`) with a fake implementation that applies flashcore's own argument
rules (through the C ABI's flashcore_check_* calls), so it is one opaque node under
`torch.compile`; in plain eager mode the implementation is called directly (no dispatcher
overhead). Calls run on torch's current stream, allocate what they need (outputs, decode's
split workspace) from torch's allocator and can be captured in CUDA graphs once the
configuration has run once (its first call generates and loads the kernels).

The lengths (`seqlens`) and the block table live on the GPU and are read by the kernels
when they run: a captured graph keeps working as the lengths grow. Whatever they hold, the
kernels never read or write outside the cache (lengths are clamped to the capacity, pages
outside the pool are skipped). Host copies (`host_seqlens`, `host_block_table`: CPU
tensors or sequences of ints), when given, are checked first and turn such values into a
FlashcoreError before anything runs.

An FP8 cache holds torch.float8_e4m3fn codes in k_cache and v_cache and, in k_scale and
v_scale, float32 scales shaped like the cache's first three dimensions ([B, capacity, Hkv],
or [pages, page_size, Hkv] for a paged pool): a cached value is its code times the scale
of its (position, KV head) row. append_kv writes both from 16-bit new tokens (scale = the
row's largest finite magnitude / 448; an infinite or NaN value gets the NaN code); decode
reads them with 16-bit queries. decode also takes
scales that repeat (expanded views): one per KV head, k_scale = s.view(1, 1, Hkv).expand(
*k_cache.shape[:3]), per sequence and head of a contiguous cache (FlashAttention-3's
descales, s[:, None, :].expand(...)), or one for the whole cache, and one tensor for both
k_scale and v_scale; append_kv refuses those. Head dims 64, 128 and 256, GPUs of sm_89 and newer (FlashcoreError UNSUPPORTED_GPU on older ones).
"""

import operator
from typing import Optional

import torch

from . import _capi
from .ops import _ALIGN, _DTYPE_CODES, LAYOUTS, _aligned, _bshd_sizes_strides, _context, _current_stream
from .ops import _dispatch_mode_active, _needs_grad, kernel_ready, softcap_arg, softmax_scale, window_arg

_Tensor = torch.Tensor

# Stand-in device addresses of the fake (meta) checks, far apart so that only a real
# overlap of two arguments (none can have one) could collide.
_STAND_IN = 1 << 44

# The workspace's alignment (flashcore_decode's contract).
_WORKSPACE_ALIGN = 256

# The element types of the serving calls' tensors: the forward's, and FP8 cache codes.
_FP8 = getattr(torch, "float8_e4m3fn", None)
_CODES = dict(_DTYPE_CODES)
if _FP8 is not None:
    _CODES[_FP8] = _capi.FLASHCORE_E4M3


# ---- descriptors ----------------------------------------------------------------------------


def _desc(sizes, strides, dtype, ptr):
    return _capi.tensor(ptr, _CODES.get(dtype, -1), sizes, strides)


def _describe(t, ptr=None, at_least_one=False):
    """A 4-d [B, S, H, D]-ordered tensor as a FlashcoreTensor; `at_least_one` describes empty
    dimensions as 1 (so the checks other than "not empty" run on them)."""
    sizes = [max(n, 1) for n in t.shape] if at_least_one else t.shape
    return _desc(sizes, t.stride(), t.dtype, t.data_ptr() if ptr is None else ptr)


def _describe_scale(t, ptr=None, at_least_one=False):
    """An FP8 cache's scales, [outer, rows, Hkv] (or [outer, rows, Hkv, 1]), as the 4-d
    FlashcoreTensor [outer, rows, Hkv, 1] the C ABI takes (the last dim's stride unused)."""
    sizes = [*t.shape[:3], 1]
    sizes = [max(n, 1) for n in sizes] if at_least_one else sizes
    return _desc(sizes, [*t.stride()[:3], 1], t.dtype, t.data_ptr() if ptr is None else ptr)


def _describe_scales(k_scale, v_scale, ptrs=(None, None), at_least_one=False):
    """A FlashcoreKvScales for an FP8 cache's scales, or None for a 16-bit cache (no scales)."""
    if k_scale is None:
        return None
    return _capi.describe_scales(
        _describe_scale(k_scale, ptrs[0], at_least_one), _describe_scale(v_scale, ptrs[1], at_least_one)
    )


def _table_layout(block_table):
    """(max_pages, table_stride) of a [B, max_pages] block table."""
    rows, max_pages = block_table.shape
    stride = block_table.stride(0) if rows > 1 else max_pages  # one row: its stride is unused
    return max_pages, stride


def _describe_cache(k_desc, v_desc, seqlens_ptr, block_table, block_table_ptr):
    if block_table is None:
        return _capi.describe_cache(k_desc, v_desc, seqlens_ptr)
    max_pages, stride = _table_layout(block_table)
    return _capi.describe_cache(k_desc, v_desc, seqlens_ptr, block_table_ptr, max_pages, stride)


def _cache_at_stand_ins(k_cache, v_cache, block_table, at_least_one=False):
    """The cache's FlashcoreKvCache at the fake checks' stand-in addresses (3 to 6)."""
    return _describe_cache(
        _describe(k_cache, 3 * _STAND_IN, at_least_one),
        _describe(v_cache, 4 * _STAND_IN, at_least_one),
        5 * _STAND_IN,
        block_table,
        6 * _STAND_IN,
    )


def _cache_in_place(k_cache, v_cache, seqlens, block_table):
    """The cache's FlashcoreKvCache at the tensors' own addresses."""
    return _describe_cache(
        _describe(k_cache),
        _describe(v_cache),
        seqlens.data_ptr(),
        block_table,
        block_table.data_ptr() if block_table is not None else 0,
    )


def _workspace(nbytes, device):
    """(tensor, address): `nbytes` of workspace from torch's allocator (graph-safe, on the
    current stream) at a `_WORKSPACE_ALIGN`-aligned address; (None, 0) for none. The
    caller keeps the tensor alive past its launch."""
    if not nbytes:
        return None, 0
    workspace = torch.empty(nbytes + _WORKSPACE_ALIGN, dtype=torch.uint8, device=device)
    return workspace, -(-workspace.data_ptr() // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN


def _static(*tensors):
    """Whether every size and stride is a plain int (not symbolic: then the real call checks)."""
    return all(
        isinstance(x, int) for t in tensors if t is not None for x in (*t.shape, *t.stride())
    )


def _host_arrays(host_seqlens, host_block_table):
    """Pointers to the prepared host tensors (see `_prepare_host`), or None."""
    return (
        _capi.host_ptr(host_seqlens.data_ptr()) if host_seqlens is not None else None,
        _capi.host_ptr(host_block_table.data_ptr()) if host_block_table is not None else None,
    )


# ---- argument checks that are Python's (flashcore's own rules are the library's) ----------


def _check_tensor(fn, name, t, dim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flashcore.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"flashcore.{fn}: {name} must be {dim}-d, got shape {tuple(t.shape)}")


def _check_device(fn, named):
    device = named[0][1].device
    if device.type not in ("cuda", "meta") or any(t.device != device for _, t in named):
        got = ", ".join(f"{n} on {t.device}" for n, t in named)
        raise ValueError(f"flashcore.{fn}: the tensors must be on one CUDA device, got {got}")


def _check_no_grad(fn, tensors):
    if _needs_grad(tensors):
        raise NotImplementedError(
            f"flashcore.{fn} has no backward pass (nor forward-mode derivative): call it "
            "under torch.no_grad() (or torch.inference_mode()), on tensors that neither "
            "require grad nor carry a forward-mode tangent"
        )


def _scale_arg(fn, scale):
    if scale is None:
        return 0.0  # flashcore's default, 1/sqrt(D)
    return softmax_scale(f"flashcore.{fn}", scale)


def _check_metadata(fn, batch, k_cache, v_cache, seqlens, block_table):
    """What the C ABI cannot see: the metadata tensors' dtype, extent and layout (it gets
    their addresses only)."""
    _check_tensor(fn, "k_cache", k_cache, 4)
    _check_tensor(fn, "v_cache", v_cache, 4)
    _check_tensor(fn, "seqlens", seqlens, 1)
    if seqlens.dtype != torch.int32:
        raise ValueError(f"flashcore.{fn}: seqlens must be torch.int32, got {seqlens.dtype}")
    if seqlens.shape[0] != batch:
        raise ValueError(f"flashcore.{fn}: seqlens has {seqlens.shape[0]} entries for a batch of {batch}")
    if batch > 1 and seqlens.stride(0) != 1:
        raise ValueError(f"flashcore.{fn}: seqlens must be contiguous, got stride {seqlens.stride(0)}")
    if block_table is not None:
        _check_tensor(fn, "block_table", block_table, 2)
        if block_table.dtype != torch.int32:
            raise ValueError(f"flashcore.{fn}: block_table must be torch.int32, got {block_table.dtype}")
        if block_table.shape[0] != batch:
            raise ValueError(
                f"flashcore.{fn}: block_table has {block_table.shape[0]} rows for a batch of {batch}"
            )
        if block_table.shape[1] == 0:
            # (No pages would describe the cache to the C ABI as a contiguous one.)
            raise ValueError(f"flashcore.{fn}: block_table has no pages per sequence")
        if block_table.shape[1] > 1 and block_table.stride(1) != 1:
            raise ValueError(
                f"flashcore.{fn}: block_table's rows must be contiguous, got strides {block_table.stride()}"
            )


def _check_cache_call(fn, batch, inputs, k_cache, v_cache, seqlens, block_table, k_scale, v_scale, metadata=()):
    """What every call on a cache checks in Python: the metadata and the scales, then that
    `inputs` (named tensors: queries or new tokens), the cache, its metadata (and any more
    named `metadata`) share one CUDA device, and that no gradient is asked for. Returns the
    scales, () for a 16-bit cache."""
    _check_metadata(fn, batch, k_cache, v_cache, seqlens, block_table)
    _check_scales(fn, k_cache, k_scale, v_scale)
    scales = () if k_scale is None else (k_scale, v_scale)
    named = [*inputs, ("k_cache", k_cache), ("v_cache", v_cache), ("seqlens", seqlens), *metadata]
    if block_table is not None:
        named.append(("block_table", block_table))
    named += list(zip(("k_scale", "v_scale"), scales))
    _check_device(fn, named)
    _check_no_grad(fn, (*(t for _, t in inputs), k_cache, v_cache, *scales))
    return scales


def _check_scales(fn, k_cache, k_scale, v_scale):
    """What the C ABI cannot say in Python's terms: an FP8 cache comes with its scales, both
    of them, each 3-d (or 4-d with a last dim of 1). Their dtype, shape, strides and memory
    are the library's rules."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"flashcore.{fn}: give both k_scale and v_scale, or neither")
    if k_scale is None:
        if _FP8 is not None and k_cache.dtype == _FP8:
            raise ValueError(
                f"flashcore.{fn}: an FP8 (float8_e4m3fn) cache needs its scales: k_scale and v_scale, float32 "
                f"shaped like the cache's first three dimensions {tuple(k_cache.shape[:3])}"
            )
        return
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flashcore.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.dim() == 3 or (t.dim() == 4 and t.shape[3] == 1)):
            raise ValueError(
                f"flashcore.{fn}: {name} must be [outer, rows, Hkv] (or [outer, rows, Hkv, 1]), got shape "
                f"{tuple(t.shape)}"
            )


def _host_int32(fn, name, x, shape):
    """A host copy of device metadata (a CPU tensor or a sequence of ints) as a contiguous
    int32 CPU tensor of `shape`; ValueError for anything else.

    Values are checked against int32's range before any narrowing: a wrapped value
    (2^32 + 3 as 3) would pass the library's checks as another, valid entry. A tensor's
    values cannot be read while torch.compile traces (its data is fake there), so a
    tensor that would need narrowing is refused then; an int32 one needs no check. NumPy
    arrays are taken as the CPU tensors they convert to. Every tensor made here is made
    on the CPU whatever torch's default device is: the library reads it on the host."""
    if not isinstance(x, torch.Tensor) and hasattr(x, "__array_interface__"):
        x = torch.as_tensor(x, device="cpu")
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"flashcore.{fn}: {name} must be a CPU tensor (a host copy), got {x.device}")
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise ValueError(f"flashcore.{fn}: {name} must hold integers, got {x.dtype}")
        if x.dtype != torch.int32:
            if torch.compiler.is_compiling() or _dispatch_mode_active():
                raise ValueError(
                    f"flashcore.{fn}: under torch.compile (or a dispatch mode) {name} must be an int32 "
                    f"CPU tensor or a sequence of ints: the values of a {x.dtype} tensor cannot be "
                    "checked against int32's range while tracing"
                )
            # As Python ints: torch has no min/max for every integer type (uint64, say).
            _check_int32_range(fn, name, x.flatten().tolist())
            x = x.to(torch.int32)
    else:
        values = _flat_ints(fn, name, x)
        _check_int32_range(fn, name, values)
        if values:
            x = torch.tensor(x, dtype=torch.int32, device="cpu")
        else:  # no entries: a shape of no elements takes it (torch.tensor([]) is float)
            x = torch.empty(shape if 0 in shape else (0,), dtype=torch.int32, device="cpu")
    if tuple(x.shape) != shape:
        raise ValueError(f"flashcore.{fn}: {name} has shape {tuple(x.shape)}, expected {shape}")
    return x.contiguous()


def _flat_ints(fn, name, x):
    """The Python ints of a (nested) sequence, read without making a tensor."""
    out = []
    stack = [x]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
            continue
        if isinstance(item, bool) or not hasattr(item, "__index__"):
            raise ValueError(f"flashcore.{fn}: {name} must hold integers, got {item!r}")
        out.append(operator.index(item))
    return out


def _check_int32_range(fn, name, values):
    if values and (min(values) < -(2**31) or max(values) >= 2**31):
        raise ValueError(f"flashcore.{fn}: {name} holds values outside int32 (the device copy's type)")


def _prepare_host(fn, batch, block_table, host_seqlens, host_block_table):
    """Host copies as contiguous CPU int32 tensors laid out as the C ABI reads them: lengths
    [batch], the block table [batch, table_stride] (the device table's row stride)."""
    if host_seqlens is None and host_block_table is None:
        return None, None
    if host_seqlens is None:
        raise ValueError(f"flashcore.{fn}: host_block_table needs host_seqlens")
    if host_block_table is not None and block_table is None:
        raise ValueError(f"flashcore.{fn}: host_block_table is given for a contiguous cache (no block_table)")
    if host_block_table is None and block_table is not None:
        raise ValueError(f"flashcore.{fn}: a paged cache's host_seqlens need host_block_table too")

    lens = _host_int32(fn, "host_seqlens", host_seqlens, (batch,))
    table = None
    if host_block_table is not None:
        max_pages, stride = _table_layout(block_table)
        t = _host_int32(fn, "host_block_table", host_block_table, (batch, max_pages))
        if stride <= max_pages:  # (shorter: the call refuses the device table's stride)
            table = t
        else:
            table = torch.zeros(batch, stride, dtype=torch.int32, device="cpu")
            table[:, :max_pages] = t
    return lens, table


def _plain_eager(tensors):
    if torch.compiler.is_compiling() or _dispatch_mode_active():
        return False
    return all(t is None or type(t) is _Tensor for t in tensors) and tensors[0].is_cuda


# ---- decode -----------------------------------------------------------------------------------


def _decode_outputs(q, return_lse):
    b, sq, hq, _ = q.shape
    o = q.new_empty(q.shape)
    lse = q.new_empty((b, hq, sq) if return_lse else (0,), dtype=torch.float32)
    return o, lse


def _check_decode(q, k_cache, v_cache, block_table, o, return_lse, scale, causal, k_scale=None, v_scale=None,
                  window=_capi.NO_WINDOW, softcap=_capi.NO_SOFTCAP):
    """flashcore_check_decode on the tensors' sizes and strides at stand-in addresses (fake
    tensors have none); host metadata is the real call's. For an empty q (nothing to
    compute, which is no error) empty dimensions are described as 1, so that every other
    rule still applies."""
    if not _static(q, k_cache, v_cache, block_table, o, k_scale, v_scale):
        return
    empty = q.numel() == 0
    cache = _cache_at_stand_ins(k_cache, v_cache, block_table, empty)
    _capi.library().check_decode(
        _describe(q, 1 * _STAND_IN, empty),
        cache,
        None,
        None,
        _describe(o, 2 * _STAND_IN, empty),
        7 * _STAND_IN if return_lse else 0,
        scale,
        causal,
        scales=_describe_scales(k_scale, v_scale, (8 * _STAND_IN, 9 * _STAND_IN), empty),
        window=window,
        softcap=softcap,
    )


# Workspace bytes by what a decode call's plan depends on: the device, q's dtype and shape,
# the cache's dtype and shape, the block table's width (and, for packed queries, the batch
# and max_seqlen_q). Filled by successful queries only, and bounded: a server whose packed
# batches differ at every step would otherwise add a key per step for ever.
_workspace_sizes = {}
_WORKSPACE_SIZES_KEPT = 4096


def _workspace_bytes(index, q, k_cache, block_table, query, *more):
    """The workspace bytes `query()` returns for this plan key, asked once per key."""
    key = (
        index, q.dtype, tuple(q.shape), k_cache.dtype, tuple(k_cache.shape),
        None if block_table is None else block_table.shape[1], *more,
    )
    n = _workspace_sizes.get(key)
    if n is None:
        n = query()
        if len(_workspace_sizes) >= _WORKSPACE_SIZES_KEPT:
            _workspace_sizes.clear()  # (asked again as needed: one library query each)
        _workspace_sizes[key] = n
    return n


@torch.library.custom_op("flashcore::decode", mutates_args=(), device_types="cuda")
def _decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    block_table: Optional[torch.Tensor],
    host_seqlens: Optional[torch.Tensor],
    host_block_table: Optional[torch.Tensor],
    causal: bool,
    scale: float,
    return_lse: bool,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode against a KV cache with flashcore (scale 0: 1/sqrt(D); k_scale, v_scale: an
    FP8 cache's scales; window_left, window_right: the key window around each query's
    position, -1 for no bound; softcap: the logit soft cap, 0 for none). Returns (o, lse):
    o [B, Sq, Hq, D] contiguous, lse float32 [B, Hq, Sq] when return_lse, else empty."""
    return _decode(q, k_cache, v_cache, seqlens, block_table, host_seqlens, host_block_table, causal, scale, return_lse,
                   k_scale, v_scale, window_left, window_right, softcap)


def _decode(q, k_cache, v_cache, seqlens, block_table, host_seqlens, host_block_table, causal, scale, return_lse,
            k_scale=None, v_scale=None, window_left=-1, window_right=-1, softcap=0.0):
    """The op's CUDA implementation (also called directly in plain eager mode)."""
    window = (window_left, window_right)
    o, lse = _decode_outputs(q, return_lse)
    if q.numel() == 0:
        # Nothing to compute; flashcore's rules still apply to what was passed.
        _check_decode(q, k_cache, v_cache, block_table, o, return_lse, scale, causal, k_scale, v_scale, window,
                      softcap)
        return o, lse
    q = _aligned(q)
    index = q.get_device()
    lib = _capi.library()
    ctx = _context(index)
    q_desc = _describe(q)
    cache = _cache_in_place(k_cache, v_cache, seqlens, block_table)
    scales = _describe_scales(k_scale, v_scale)
    ws_bytes = _workspace_bytes(index, q, k_cache, block_table,
                                lambda: lib.decode_workspace_bytes(ctx, q_desc, cache, scales))
    workspace, ws_ptr = _workspace(ws_bytes, q.device)
    lens_ptr, table_ptr = _host_arrays(host_seqlens, host_block_table)
    lib.decode(
        ctx,
        q_desc,
        cache,
        lens_ptr,
        table_ptr,
        _describe(o),
        lse.data_ptr() if return_lse else 0,
        scale,
        causal,
        ws_ptr,
        ws_bytes,
        _current_stream(index),
        scales=scales,
        window=window,
        softcap=softcap,
    )
    del workspace  # freed in stream order: later work on this stream runs after the kernels
    return o, lse


@_decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, seqlens, block_table, host_seqlens, host_block_table, causal, scale, return_lse,
                 k_scale=None, v_scale=None, window_left=-1, window_right=-1, softcap=0.0):
    o, lse = _decode_outputs(q, return_lse)
    _check_decode(q, k_cache, v_cache, block_table, o, return_lse, scale, causal, k_scale, v_scale,
                  (window_left, window_right), softcap)
    return o, lse


def decode(
    q,
    k_cache,
    v_cache,
    seqlens,
    *,
    block_table=None,
    causal=False,
    scale=None,
    return_lse=False,
    host_seqlens=None,
    host_block_table=None,
    k_scale=None,
    v_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
):
    """Attention of new query tokens against a KV cache: decode steps (split-KV decode), or
    a prompt chunk after a cached prefix (chunked prefill).

    q: [B, Sq, Hq, D], Sq >= 1 new tokens per sequence (up to 16 run on the split-KV
        decode kernels; more on the forward kernels where they read the cache: 16-bit,
        contiguous or, on Hopper, pages of 16 or more); float16 or bfloat16; D a multiple
        of 8 up to 256 (80, say, runs the 96 kernel padded); Hq a multiple of Hkv (GQA/MQA
        by head count).
    k_cache, v_cache: q's dtype, or torch.float8_e4m3fn codes with k_scale and v_scale (an
        FP8 cache: D in 64, 128, 256, a GPU of sm_89 or newer; q either 16-bit dtype).
        Contiguous cache (block_table None): [B, capacity, Hkv, D].
        Paged cache: pools [pages, page_size, Hkv, D], page_size a power of two from 1 to
        1024. The cache is read in place: last dim contiguous, other strides multiples of
        16 bytes (else FlashcoreError BAD_STRIDES). Capacity at most 2^30.
    seqlens: int32 [B] on the GPU: each sequence's length, counting the Sq new tokens
        (append them first): query i of Sq is position seqlens[b] - Sq + i.
    block_table: None, or int32 [B, max_pages] on the GPU (rows contiguous): position p of
        sequence b is row p % page_size of page block_table[b, p // page_size]; the
        capacity is max_pages * page_size.
    causal: query i sees keys 0 ..= seqlens[b] - Sq + i; without it every query sees all
        seqlens[b] keys. A row that sees no key (a length of 0, say) gives zeros (LSE -inf).
    scale: the softmax scale; None for 1/sqrt(D). Must be finite and positive.
    return_lse: also return the float32 [B, Hq, Sq] natural-log log-sum-exp of each row.
    host_seqlens, host_block_table: optional host copies of seqlens and block_table (CPU
        tensors or sequences of ints): checked against the capacity and the pool (no page
        named twice within one sequence) before anything runs. A paged cache takes both or
        neither (one alone raises ValueError). Under torch.compile pass int32 CPU
        tensors: a wider one's values cannot be range-checked while tracing, and a list's
        ints are read as constants of the graph (a recompile for every new value).
    k_scale, v_scale: an FP8 cache's scales (required with one, refused without): float32
        [B, capacity, Hkv] (contiguous) or [pages, page_size, Hkv] (paged), the caches'
        first three dimensions ([..., 1] 4-d tensors are taken too; any strides): each
        cached value is its code times the scale of its (position, KV head) row, as
        append_kv writes them (finite and not negative).
    window_size: (left, right), local (sliding-window) attention as flashcore.attention
        takes it: query i, at position p = seqlens[b] - Sq + i, sees keys p - left ..=
        p + right (-1: no bound; causal=True with right > 0 raises FlashcoreError). A
        sliding window of w keys (Mistral, Gemma) is causal=True, window_size=(w - 1, 0):
        each new token sees itself and the w - 1 positions before it. The split count
        (and workspace) is the windowless call's.
    softcap: logit soft-capping as flashcore.attention takes it (each scaled score x
        becomes softcap · tanh(x / softcap); 0.0 or None: no cap), with 16-bit and FP8
        caches alike. The split count (and workspace) is the uncapped call's.

    Returns o ([B, Sq, Hq, D], contiguous), or (o, lse). The split count (and so the
    workspace, taken from torch's allocator) depends on the shapes and the GPU only, never
    on the lengths, so a CUDA graph of a decode step stays right as sequences grow.
    Inference only. Raises FlashcoreError with flashcore's message for anything the
    kernels refuse, ValueError/TypeError for misuse of this function,
    NotImplementedError for inputs that need derivatives.
    """
    _check_tensor("decode", "q", q, 4)
    _check_cache_call("decode", q.shape[0], [("q", q)], k_cache, v_cache, seqlens, block_table, k_scale, v_scale)
    scale = _scale_arg("decode", scale)
    window = window_arg("flashcore.decode", window_size)
    softcap = softcap_arg("flashcore.decode", softcap)
    host_seqlens, host_block_table = _prepare_host(
        "decode", q.shape[0], block_table, host_seqlens, host_block_table
    )
    if not kernel_ready(q):
        q = q.clone(memory_format=torch.contiguous_format)
    args = (q, k_cache, v_cache, seqlens, block_table, host_seqlens, host_block_table, bool(causal), scale,
            bool(return_lse), k_scale, v_scale, *window, softcap)
    if _plain_eager(args[:5] + args[10:12]):
        o, lse = _decode(*args)
    else:
        o, lse = torch.ops.flashcore.decode(*args)
    return (o, lse) if return_lse else o


# ---- append -----------------------------------------------------------------------------------


def _check_append(k_cache, v_cache, block_table, k_new, v_new, k_scale=None, v_scale=None):
    if not _static(k_cache, v_cache, block_table, k_new, v_new, k_scale, v_scale):
        return
    empty = k_new.numel() == 0  # nothing to write: the other rules still apply
    cache = _cache_at_stand_ins(k_cache, v_cache, block_table, empty)
    _capi.library().check_append_kv(
        cache, _describe(k_new, 1 * _STAND_IN, empty), _describe(v_new, 2 * _STAND_IN, empty), None, None,
        scales=_describe_scales(k_scale, v_scale, (8 * _STAND_IN, 9 * _STAND_IN), empty),
    )


@torch.library.custom_op(
    "flashcore::append_kv", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"), device_types="cuda"
)
def _append_op(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    block_table: Optional[torch.Tensor],
    host_seqlens: Optional[torch.Tensor],
    host_block_table: Optional[torch.Tensor],
    k_scale: Optional[torch.Tensor],
    v_scale: Optional[torch.Tensor],
) -> None:
    """Writes k_new, v_new into the caches at each sequence's length (not advanced); an FP8
    cache's codes and scales (k_scale, v_scale) from 16-bit new tokens."""
    _append(k_cache, v_cache, seqlens, k_new, v_new, block_table, host_seqlens, host_block_table, k_scale, v_scale)


def _append(k_cache, v_cache, seqlens, k_new, v_new, block_table, host_seqlens, host_block_table, k_scale=None,
            v_scale=None):
    """The op's CUDA implementation (also called directly in plain eager mode)."""
    if k_new.numel() == 0:
        _check_append(k_cache, v_cache, block_table, k_new, v_new, k_scale, v_scale)
        return
    k_new, v_new = _aligned(k_new), _aligned(v_new)
    index = k_cache.get_device()
    lib = _capi.library()
    cache = _cache_in_place(k_cache, v_cache, seqlens, block_table)
    lens_ptr, table_ptr = _host_arrays(host_seqlens, host_block_table)
    lib.append_kv(
        _context(index), cache, _describe(k_new), _describe(v_new), lens_ptr, table_ptr, _current_stream(index),
        scales=_describe_scales(k_scale, v_scale),
    )


@_append_op.register_fake
def _append_fake(k_cache, v_cache, seqlens, k_new, v_new, block_table, host_seqlens, host_block_table, k_scale,
                 v_scale):
    _check_append(k_cache, v_cache, block_table, k_new, v_new, k_scale, v_scale)


def append_kv(
    k_cache,
    v_cache,
    seqlens,
    k_new,
    v_new,
    *,
    block_table=None,
    host_seqlens=None,
    host_block_table=None,
    k_scale=None,
    v_scale=None,
):
    """Writes new tokens' keys and values into a KV cache, in place.

    k_new[b, j] and v_new[b, j] ([B, Snew, Hkv, D], the cache's dtype, Hkv and D) go to
    position seqlens[b] + j of sequence b, with seqlens[b] as the GPU holds it when the
    kernel runs (so a captured graph appends wherever the sequence has got to). The lengths
    are NOT advanced: add Snew to seqlens afterwards (before a decode that should see the
    new tokens), e.g. `seqlens += Snew`.

    k_cache, v_cache, seqlens, block_table: as for `decode` (written in place: the caches
    must be readable by the kernels as they are; they are never copied).
    host_seqlens, host_block_table: optional host copies of the lengths before the append
        and of the block table, checked first: seqlens[b] + Snew must not exceed the
        capacity, every page it reaches must lie in the pool (none named twice within
        one sequence), and no sequence's new tokens may land on rows of a shared page
        that another sequence holds (a position below its length) or writes in the same
        call.
    k_scale, v_scale: an FP8 cache's scales, as for `decode` (written in place too). The
        cache's k and v are then torch.float8_e4m3fn and k_new, v_new float16 or bfloat16
        (one dtype for both): each new (position, KV head) row of D values is quantized on
        the GPU with the scale max|x| / 448 over its finite values (1 for a row of
        zeros), codes rounded to the nearest e4m3 value (an infinite or NaN value gets
        the NaN code).

    Positions past the capacity (and pages outside the pool) are never written, whatever
    the device metadata holds. Snew <= capacity and B·Snew·Hkv·D/8 <= 2146435039. Returns
    None. Raises FlashcoreError with flashcore's message for anything the kernels refuse,
    ValueError/TypeError for misuse, NotImplementedError for inputs that need derivatives.
    """
    _check_tensor("append_kv", "k_new", k_new, 4)
    _check_tensor("append_kv", "v_new", v_new, 4)
    batch = k_new.shape[0]
    scales = _check_cache_call("append_kv", batch, [("k_new", k_new), ("v_new", v_new)], k_cache, v_cache, seqlens,
                               block_table, k_scale, v_scale)
    host_seqlens, host_block_table = _prepare_host("append_kv", batch, block_table, host_seqlens, host_block_table)
    k_new, v_new = (t if kernel_ready(t) else t.clone(memory_format=torch.contiguous_format) for t in (k_new, v_new))
    args = (k_cache, v_cache, seqlens, k_new, v_new, block_table, host_seqlens, host_block_table, k_scale, v_scale)
    if _plain_eager(args[:6] + args[8:]):
        _append(*args)
        # What the op's own wrapper does for its mutated arguments: autograd sees the writes.
        # One tensor at a time (torch 2.4 takes no sequence), and none made under
        # inference_mode (which have no version counter).
        bump = getattr(torch.autograd.graph, "increment_version", None)
        if bump is not None:
            for t in (k_cache, v_cache, *scales):
                if not t.is_inference():
                    bump(t)
    else:
        torch.ops.flashcore.append_kv(*args)


# ---- merge ------------------------------------------------------------------------------------


def _part_sizes_strides(o_parts, layout):
    """Logical [B, S, H, D] sizes and strides of one shard of a 5-d [N, ...] stack."""
    n, st = tuple(o_parts.shape[1:]), o_parts.stride()[1:]
    if layout == "bshd":
        return n, st
    return (n[0], n[2], n[1], n[3]), (st[0], st[2], st[1], st[3])


def _merge_outputs(o_parts, out_dtype, layout, return_lse):
    _, b, x, y, d = o_parts.shape
    s, h = (x, y) if layout == "bshd" else (y, x)
    out = o_parts.new_empty((b, x, y, d), dtype=out_dtype)
    lse = o_parts.new_empty((b, h, s) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _check_merge(o_parts, out, layout, return_lse):
    if not _static(o_parts, out):
        return
    sizes, strides = _part_sizes_strides(o_parts, layout)
    out_sizes, out_strides = _bshd_sizes_strides(out, layout)
    low = 1 if out.numel() == 0 else 0  # nothing to merge: the other rules still apply
    _capi.library().check_merge(
        _desc([max(n, low) for n in sizes], strides, o_parts.dtype, 1 * _STAND_IN),
        o_parts.shape[0],
        o_parts.stride(0),
        2 * _STAND_IN,
        _desc([max(n, low) for n in out_sizes], out_strides, out.dtype, 3 * _STAND_IN),
        4 * _STAND_IN if return_lse else 0,
    )


@torch.library.custom_op("flashcore::merge", mutates_args=(), device_types="cuda")
def _merge_op(
    o_parts: torch.Tensor,
    lse_parts: torch.Tensor,
    out_dtype: torch.dtype,
    layout: str,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges attention over disjoint key shards by their LSE. Returns (out, lse)."""
    return _merge(o_parts, lse_parts, out_dtype, layout, return_lse)


def _merge(o_parts, lse_parts, out_dtype, layout, return_lse):
    """The op's CUDA implementation (also called directly in plain eager mode)."""
    out, lse = _merge_outputs(o_parts, out_dtype, layout, return_lse)
    if out.numel() == 0 or o_parts.shape[0] == 0:
        _check_merge(o_parts, out, layout, return_lse)  # no shards: FlashcoreError
        return out, lse
    if o_parts.data_ptr() % _ALIGN:
        o_parts = o_parts.clone(memory_format=torch.contiguous_format)  # a view starting mid-row
    index = o_parts.get_device()
    sizes, strides = _part_sizes_strides(o_parts, layout)
    out_sizes, out_strides = _bshd_sizes_strides(out, layout)
    _capi.library().merge(
        _context(index),
        _desc(sizes, strides, o_parts.dtype, o_parts.data_ptr()),
        o_parts.shape[0],
        o_parts.stride(0),
        lse_parts.data_ptr(),
        _desc(out_sizes, out_strides, out.dtype, out.data_ptr()),
        lse.data_ptr() if return_lse else 0,
        _current_stream(index),
    )
    return out, lse


@_merge_op.register_fake
def _merge_fake(o_parts, lse_parts, out_dtype, layout, return_lse):
    out, lse = _merge_outputs(o_parts, out_dtype, layout, return_lse)
    _check_merge(o_parts, out, layout, return_lse)
    return out, lse


def _parts_ready(o_parts):
    """Whether the kernels can read the stack in place as far as its strides go: each shard
    kernel-ready, the shard stride a multiple of 16 bytes when there is more than one.
    Strides only, so that torch.compile traces it; the start address is `_merge`'s concern."""
    n = o_parts.shape[0]
    if n == 0:
        return True
    if n > 1 and (o_parts.stride(0) * o_parts.element_size()) % _ALIGN:
        return False
    return kernel_ready(o_parts[0])


def merge(o_parts, lse_parts, *, out_dtype=None, return_lse=False, layout="bshd"):
    """Merges attention results over N disjoint key shards into attention over all their keys:
    out = sum_i exp(lse_i - lse) * o_i with lse = log(sum_i exp(lse_i)) (split-KV,
    context-parallel or ring attention). A shard whose row has LSE -inf (it saw no key)
    counts for nothing; a row no shard saw gives zeros (and LSE -inf). A row's LSE of +inf
    or NaN in any shard makes that row's output and LSE NaN: FlashAttention-2's forward
    marks a row that saw no key with +inf, so map those to -inf before merging its shards.

    o_parts: [N, B, S, H, D] (layout="bshd", decode's and FlashAttention's order) or
        [N, B, H, S, D] (layout="bhsd", flashcore.attention's default), float16, bfloat16
        or float32, D a multiple of 8 up to 256; or a list of N such 4-d tensors
        (stacked first). Read in place when each shard is kernel-ready and the shard
        stride is a multiple of 16 bytes, else copied.
    lse_parts: float32 [N, B, H, S] (as flashcore.attention(..., return_lse=True) and
        decode return them, stacked), or a list of N [B, H, S] tensors.
    out_dtype: float16, bfloat16 or float32; None for o_parts' dtype.
    return_lse: also return the merged float32 [B, H, S] LSE.

    Returns out (o_parts' shard shape in `layout`, contiguous), or (out, lse). Inference
    only. Raises FlashcoreError with flashcore's message for anything the kernel refuses,
    ValueError/TypeError for misuse of this function,
    NotImplementedError for inputs that need derivatives.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"flashcore.merge: layout must be one of {LAYOUTS}, got {layout!r}")
    # Lists are stacked, but not promoted: every shard must be of one dtype (torch.stack
    # would turn f16 beside f32 into f32, and with it the default output dtype).
    for name, parts in (("o_parts", o_parts), ("lse_parts", lse_parts)):
        if isinstance(parts, (list, tuple)):
            if not parts:
                raise ValueError(f"flashcore.merge: {name} is an empty list; at least one shard is needed")
            if not all(isinstance(t, torch.Tensor) for t in parts):
                raise TypeError(f"flashcore.merge: {name} must be a tensor or a list of tensors")
            if len({t.dtype for t in parts}) > 1:
                raise ValueError(
                    f"flashcore.merge: the shards of {name} must share one dtype, got "
                    f"{sorted({str(t.dtype) for t in parts})}"
                )
            # What torch.stack would refuse with a RuntimeError.
            if len({tuple(t.shape) for t in parts}) > 1:
                raise ValueError(
                    f"flashcore.merge: the shards of {name} must share one shape, got "
                    f"{[tuple(t.shape) for t in parts]}"
                )
            if len({t.device for t in parts}) > 1:
                raise ValueError(
                    f"flashcore.merge: the shards of {name} must be on one device, got "
                    f"{[str(t.device) for t in parts]}"
                )
    if isinstance(o_parts, (list, tuple)):
        o_parts = torch.stack(o_parts)
    if isinstance(lse_parts, (list, tuple)):
        lse_parts = torch.stack(lse_parts)
    _check_tensor("merge", "o_parts", o_parts, 5)
    _check_tensor("merge", "lse_parts", lse_parts, 4)
    _check_device("merge", [("o_parts", o_parts), ("lse_parts", lse_parts)])
    _check_no_grad("merge", (o_parts, lse_parts))
    if lse_parts.dtype != torch.float32:
        raise ValueError(f"flashcore.merge: lse_parts must be torch.float32, got {lse_parts.dtype}")
    n, b, x, y, _ = o_parts.shape
    s, h = (x, y) if layout == "bshd" else (y, x)
    if tuple(lse_parts.shape) != (n, b, h, s):
        raise ValueError(
            f"flashcore.merge: lse_parts has shape {tuple(lse_parts.shape)}, expected [N, B, H, S] = "
            f"{(n, b, h, s)} for o_parts of shape {tuple(o_parts.shape)} ({layout})"
        )
    out_dtype = o_parts.dtype if out_dtype is None else out_dtype
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"flashcore.merge: out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if not _parts_ready(o_parts):
        o_parts = o_parts.clone(memory_format=torch.contiguous_format)
    lse_parts = lse_parts.contiguous()
    args = (o_parts, lse_parts, out_dtype, layout, bool(return_lse))
    if _plain_eager(args[:2]):
        out, lse = _merge(*args)
    else:
        out, lse = torch.ops.flashcore.merge(*args)
    return (out, lse) if return_lse else out
