"""flashcore as an attention implementation of Hugging Face transformers.

    import flashcore
    name = flashcore.register_transformers()          # "fcore"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)
    # or: model.set_attn_implementation(name)

    name = flashcore.register_transformers(fp8=True)  # "fcore-fp8": FP8 attention

The name does not contain "flash": transformers takes such names for FlashAttention builds
and tries to import them.

What runs where. Masks are built exactly as for "sdpa" (the same mask function is
registered under this name), so transformers hands over no mask whenever SDPA would run
with `is_causal` alone: a prompt without padding, or a decode step without padding. Those
calls, prefill and KV-cache decode alike, go to flashcore (causal for a prompt; a single
query token sees the whole cache; a decode step against 1536 cached keys or more, or 512
with 128 or more KV heads in the batch each serving 4 query heads or more, runs on
flashcore's split-KV decode kernels).

Padded batches go to flashcore too, as variable-length calls (`attention_varlen`). That
takes a boolean mask [B, 1, Sq, Sk] in which each sequence's keys are one run of
positions [s_b, e_b) and each query row sees exactly what a bottom-right causal call over
that run shows it: the last min(Sq, e_b - s_b) rows their part of the run, the others
nothing (left padding, as generate() pads, and a StaticCache's empty slots); for a module
that is not causal, every row the whole run (padding on either side). A causal batch
padded on the right (evaluation batches) is not of that form and runs on SDPA. The backend gathers
the query rows into a packed tensor (a decode step needs no gather), runs the call and
scatters the rows back; keys and values in contiguous tensors are read in place (a
sequence without queries over the rows between two sequences' keys), others gathered
too. A batch of decode steps runs on the split-KV decode kernels. Query rows that see no
key are zeros, as are padding rows transformers lets see every key. Checking a mask costs
a pass over it and one wait for the GPU, once per mask (a model's layers share it), so
this runs only in plain eager mode (not under torch.compile or while a CUDA graph is
captured), and not for FP8. A mask made under torch.inference_mode has no version counter
to tell a refill in place from the same mask, and one that reaches a layer as a new copy
(a model split over GPUs) is another tensor: those are checked on every call.

Sliding-window layers go to flashcore too, on its windowed kernels. transformers passes
`sliding_window=w` to the attention calls of such layers (Mistral's, Gemma 3's local
layers, Qwen2's with use_sliding_window, ...) and builds their masks so that the
query at position p sees the keys at positions p - w < j <= p. A causal call with
`sliding_window` runs with FlashAttention's window_size (w - 1, 0): without a mask
(transformers drops it where the window hides nothing) over the call's keys as above,
prefill and decode steps alike; with a mask, after checking that the mask is exactly that
window over each sequence's run of keys (padding as above, and the keys a sliding-window
cache still holds), as one variable-length call. A mask that differs anywhere (another
window, a window without `sliding_window`) goes to SDPA; so does a module that is not
causal with a mask (a bidirectional window). `stats["flashcore_window"]` counts the
sliding-window calls served. FP8 has no windowed kernel: with "fcore-fp8", a window that
hides keys runs on the 16-bit kernel.

A call that comes with any other mask (a sliding window other than the layer's
`sliding_window`, keys with gaps, per-head or float masks, a sequence that is all
padding made to see every key), a `sliding_window` that is not a positive int, a mask under
torch.compile or graph capture, a dtype other than float16 or bfloat16, a head dim
flashcore has no kernel for (or value's differing from query's), a
score bias (`position_bias`: T5-style models), attention dropout (a model in training mode
with a dropout rate), a `scaling` that is not a positive float32
(zero, negative, NaN, or outside float32's range), a causal call with more queries than
keys, tensors off the GPU (a model on the CPU), a GPU older than sm_80 (with "fcore-fp8", one
older than sm_89 runs the 16-bit kernels), or inputs that require gradients with
autograd on (flashcore is forward only) is computed by transformers' own SDPA path
instead (with a soft cap: explicit attention in PyTorch, see below), with a warning the
first time (outside torch.compile, which cannot trace one), so results stay right.
`stats` counts both. Models whose indexer selects keys for sparse attention (DeepSeek-V3.2's
`indices`, `block_indices`) raise NotImplementedError: they hand the selection over as
such an argument to any implementation but "eager" and "sdpa".

Only models that route attention through transformers' AttentionInterface can use the
registered name; some older ones (Falcon, GPT-J, GPT-Neo) look their implementation up in
tables of their own and raise KeyError for any name they do not list. Packed batches
without padding (DataCollatorWithFlattening: block-diagonal masks, `cu_seq_lens_*`) run
on SDPA, by the mask rule above.

Causal alignment. With no mask, transformers' SDPA path aligns a causal call top-left:
query i sees keys 0..=i. A prompt written into a longer preallocated cache (StaticCache:
Sk > Sq, the slots past the prompt still empty) depends on that, so such calls run on the
first Sq keys, where flashcore's bottom-right alignment is the same mask.

Logit soft-capping (`softcap`, as Gemma 2 passes it on every layer: each scaled score x
becomes softcap · tanh(x / softcap)) runs on flashcore's soft-capping kernels, on each of
the routes above (no mask, padded batches, sliding-window layers, decode steps); a
`softcap` of None or 0 is none, and one that is not a positive, finite number raises
ValueError. SDPA has no soft cap: a capped call that goes to SDPA by the rules above runs
instead on explicit attention in PyTorch (the scores computed in float32, capped, masked as
SDPA would mask them, softmax), with the same warning and the same count in
`stats["sdpa"]`, so the cap is never dropped. FP8 has no soft-capping kernel: with
"fcore-fp8", a capped call runs on the 16-bit kernel (Gemma 2 then runs 16-bit
throughout). A capped call with a position bias raises NotImplementedError (no model
has both).

Attention sinks (`s_aux`, as gpt-oss passes them) change the softmax itself; flashcore has
no kernel for them and transformers' SDPA path would drop them, so such calls raise
NotImplementedError rather than dropping them.

FP8 ("fcore-fp8", `register(fp8=True)`): the same rules, but the calls flashcore serves
go to flashcore.attention_fp8 (q, k and v quantized to e4m3 on the GPU at every call,
then the FP8 kernel; an sm_89 or newer GPU). A head dim the FP8 kernels lack (only 64,
128 and 256 have them) runs on flashcore's 16-bit kernel instead, counted in
`stats["flashcore"]`; FP8 calls are counted in `stats["flashcore_fp8"]`. Every decode step
quantizes the whole cache again: this backend is for measuring FP8 attention's effect on
a model (perplexity, generations), not for fast decoding. Set FLASHCORE_FP8_SMOOTH_K=1
to quantize with K smoothing, FLASHCORE_FP8_HADAMARD_SEED=<seed> to rotate q and k.
"""

import math
import os
import threading
import warnings
import weakref

import torch

from ._capi import NO_WINDOW
from .fp8 import FP8_HEAD_DIMS, launch_fp8
from .ops import _dispatch_mode_active, _needs_grad, forward_head_dim, launch, softcap_arg, softmax_scale
from .serving import _plain_eager
from .varlen import _varlen, attention_varlen

NAME = "fcore"
FP8_NAME = "fcore-fp8"

# Calls served by flashcore (16-bit and FP8; "flashcore_padded" counts the 16-bit calls
# that came with a padding mask, "flashcore_window" the calls of sliding-window layers,
# each also counted in "flashcore" or "flashcore_fp8") and calls handed to SDPA, by reason.
stats = {"flashcore": 0, "flashcore_fp8": 0, "flashcore_padded": 0, "flashcore_window": 0, "sdpa": {}}

# A window side past every sequence flashcore takes (2^30 keys at most) bounds nothing: a
# larger sliding_window is passed as this, within the C ABI's int64.
_UNBOUNDED_SIDE = 1 << 31

_warned = set()

# Keyword arguments by which transformers' sparse-attention models hand an implementation
# other than "eager" and "sdpa" the keys each query may see.
_SPARSE_SELECTIONS = ("indices", "block_indices")


def _warn_once(reason, text):
    """Warns about `reason` the first time, outside torch.compile (Dynamo cannot trace
    `warnings.warn`: under fullgraph=True it would stop the compile)."""
    if reason in _warned or torch.compiler.is_compiling():
        return
    _warned.add(reason)
    warnings.warn(text, stacklevel=4)


def _fallback(reason, module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stats["sdpa"][reason] = stats["sdpa"].get(reason, 0) + 1
    _warn_once(reason, f"flashcore: {reason}: these attention calls run on transformers' SDPA path")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _softcap_fallback(reason, module, query, key, value, attention_mask, scaling, is_causal, softcap, dropout=0.0):
    """What transformers' SDPA path computes for this call, with the scores soft-capped,
    which SDPA cannot do: explicit attention in PyTorch, as transformers' eager attention
    of Gemma 2 computes it (scores in float32, capped, then masked), masked as SDPA masks:
    a boolean or additive mask as given, no mask a top-left causal one where the module is
    causal and there is more than one query. Counted and warned about as `_fallback`."""
    stats["sdpa"][reason] = stats["sdpa"].get(reason, 0) + 1
    _warn_once(
        reason,
        f"flashcore: {reason}: these soft-capped attention calls run on explicit attention in PyTorch "
        "(SDPA has no softcap)",
    )
    group = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(group, dim=1) if group > 1 else key
    v = value.repeat_interleave(group, dim=1) if group > 1 else value
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    sq, sk = s.shape[-2:]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None:
        if causal and sq > 1:
            hidden = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril().logical_not()
            s = s.masked_fill(hidden, -math.inf)
    elif attention_mask.dtype == torch.bool:
        s = s.masked_fill(attention_mask.logical_not(), -math.inf)
    else:
        s = s + attention_mask.float()
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key: zeros
    if dropout:
        p = torch.nn.functional.dropout(p, p=dropout)  # as Gemma 2's eager attention, in training
    out = torch.matmul(p, v.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _softcap_of(softcap):
    """transformers' `softcap` argument as a float for the library: 0.0 for None or 0 (no
    cap); a cap that is not a positive, finite number is refused."""
    if softcap is None or softcap == 0:
        return 0.0
    cap = softcap_arg("flashcore", softcap)
    if not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(f"flashcore: softcap must be a positive, finite number (None or 0: no cap), got {softcap!r}")
    return cap


def attention_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' attention-function contract: query [B, Hq, Sq, D], key and value
    [B, Hkv, Sk, D] (Hkv dividing Hq, not repeated); returns ([B, Sq, Hq, D], None)."""
    return _forward(False, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def attention_forward_fp8(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """attention_forward with FP8 attention (flashcore.attention_fp8's op) where it can run."""
    return _forward(True, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _fp8_options():
    """attention_fp8's quantizer options from FLASHCORE_FP8_SMOOTH_K and
    FLASHCORE_FP8_HADAMARD_SEED (decimal or 0x hex)."""
    smooth_k = os.environ.get("FLASHCORE_FP8_SMOOTH_K", "0").strip().lower() not in ("", "0", "false", "no")
    seed = os.environ.get("FLASHCORE_FP8_HADAMARD_SEED", "").strip()
    seed = int(seed, 0) if seed else None
    if seed is not None and not 0 <= seed < 1 << 64:
        raise ValueError(f"flashcore: FLASHCORE_FP8_HADAMARD_SEED must be in [0, 2^64), got {seed}")
    return smooth_k, seed


def _forward(fp8, module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs):
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "flashcore: attention sinks (s_aux) are not supported; use attn_implementation='eager' for this model"
        )
    for sparse in _SPARSE_SELECTIONS:
        if kwargs.get(sparse) is not None:
            # Models with a top-k indexer (DeepSeek-V3.2, GLM's DSA, ...) put its selection
            # into the mask for "eager" and "sdpa" only, and pass it as this argument to any
            # other implementation: attending to every key would be silently wrong.
            raise NotImplementedError(
                f"flashcore: sparse attention over selected keys ({sparse}) is not supported; use "
                "attn_implementation='sdpa' for this model"
            )
    softcap = _softcap_of(kwargs.get("softcap"))
    sdpa_kwargs = dict(kwargs, dropout=dropout, scaling=scaling, is_causal=is_causal)

    def fallback(reason):
        if softcap:
            return _softcap_fallback(reason, module, query, key, value, attention_mask, scaling, is_causal, softcap,
                                     dropout)
        return _fallback(reason, module, query, key, value, attention_mask, **sdpa_kwargs)

    if dropout:
        # flashcore has no dropout; SDPA applies it whenever it is given (transformers'
        # models give it in training mode only).
        return fallback("attention dropout")

    if kwargs.get("position_bias") is not None:
        if softcap:
            raise NotImplementedError("flashcore: a position bias with logit soft-capping (softcap) is not supported")
        return fallback("a position bias")
    if _needs_grad((query, key, value)):
        return fallback("inputs that require gradients (flashcore is forward only)")
    if not _on_gpu(query, key, value):
        return fallback(f"tensors on {query.device} (flashcore runs on CUDA devices)")
    if key.device != query.device or value.device != query.device:
        # SDPA raises its own error for these.
        return fallback(f"query, key and value on {query.device}, {key.device} and {value.device}")
    if _capability(query.device) < (8, 0):
        # flashcore's kernels start at sm_80 (a T4 or V100 would raise UNSUPPORTED_GPU).
        major, minor = _capability(query.device)
        return fallback(f"a GPU of compute capability {major}.{minor} (flashcore needs 8.0 or newer)")
    if query.dtype not in (torch.float16, torch.bfloat16):
        return fallback(f"dtype {query.dtype}")
    if not forward_head_dim(query.shape[-1]) or value.shape[-1] != query.shape[-1]:
        return fallback(f"head dims {query.shape[-1]} (query) and {value.shape[-1]} (value)")
    if scaling is not None:
        try:
            softmax_scale("flashcore", scaling)
        except (TypeError, ValueError):
            # 0, negative, NaN, or outside float32 (below 1.4e-45 it would reach the C ABI
            # as 0, its "default scale"): SDPA takes what flashcore cannot.
            return fallback(f"scaling {scaling}")
    # As SDPA: the module says whether it is causal unless the caller does, and one query
    # token sees the whole cache.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # A sliding-window layer's window (transformers passes `sliding_window` on those
    # layers): each query sees itself and the sliding_window - 1 positions before it.
    # Only a causal call has one here; a bidirectional window (a module that is not
    # causal) is left to its mask.
    sliding = kwargs.get("sliding_window")
    if sliding is not None:
        if not isinstance(sliding, int) or isinstance(sliding, bool) or sliding < 1:
            return fallback(f"a sliding_window of {sliding!r}")
        if not causal:
            sliding = None
    if attention_mask is not None:
        if fp8:
            return fallback("an explicit attention mask")
        if attention_mask.device != query.device:
            # The mask's plan keeps its offsets on the mask's device; SDPA raises its own
            # error for a mask on another GPU, or moves a CPU mask.
            return fallback(f"an attention mask on {attention_mask.device}, the query on {query.device}")
        if not _may_wait(query.device):
            return fallback("an attention mask under torch.compile or CUDA graph capture")
        plan = _padded_plan(attention_mask, bool(causal), query.shape[0], query.shape[2], key.shape[2], sliding)
        if plan is None:
            # (A causal call is served for left padding only: right padding leaves the
            # padded rows seeing every key, which is no bottom-right aligned batch.)
            if sliding is not None:
                return fallback("an attention mask other than padding and the layer's sliding window "
                                "(right padding, gaps, another window, per-head, float)")
            if causal:
                return fallback("an attention mask other than padding "
                                "(right padding, a sliding window without sliding_window, gaps, per-head, float)")
            return fallback("an attention mask other than padding "
                            "(a bidirectional sliding window, gaps, per-head, float)")
        stats["flashcore"] += 1
        stats["flashcore_padded"] += 1
        stats["flashcore_window"] += sliding is not None
        return plan.run(query, key, value, scaling, softcap), None
    causal = bool(causal) and query.shape[2] > 1
    sq, sk = query.shape[2], key.shape[2]
    if causal and sk > sq:
        # SDPA's causal mask is top-left aligned: the queries see only the first Sq keys
        # (a prompt in a longer preallocated cache), where bottom-right is the same mask.
        key, value = key[:, :, :sq], value[:, :, :sq]
    elif causal and sk < sq:
        return fallback("a causal call with more queries than keys (top-left alignment)")
    # With no mask, a sliding-window layer's call is causal sliding-window attention (as
    # FlashAttention runs it from the same arguments; transformers leaves the mask out
    # where the window hides nothing): a window only where it bounds a row, here where
    # there are more keys than it holds.
    window = NO_WINDOW
    if sliding is not None and key.shape[2] > sliding:
        window = (min(sliding - 1, _UNBOUNDED_SIDE), 0)
    stats["flashcore_window"] += sliding is not None
    # FP8 needs sm_89 (an A100 runs "fcore-fp8" calls on the 16-bit kernels).
    if fp8 and query.shape[-1] in FP8_HEAD_DIMS and window == NO_WINDOW and not softcap and \
            _capability(query.device) >= (8, 9):
        stats["flashcore_fp8"] += 1
        # [B, S, H, D] views in, [B, Sq, Hq, D] contiguous out, as transformers wants it.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        smooth_k, seed = _fp8_options()
        out, _ = launch_fp8(q, k, v, causal, _scale(scaling), "bshd", False, smooth_k, seed)
        return out, None
    stats["flashcore"] += 1
    out, _ = launch(query, key, value, causal, _scale(scaling), "bhsd", "bshd", False, window, softcap)
    return out, None


def launch_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, host_q, host_k, causal, scaling, window=NO_WINDOW, softcap=0.0):
    """flashcore.attention_varlen on packed [rows, H, D] tensors (a seam the CPU tests
    replace with a reference); `window` is its window_size, `softcap` its softcap. In plain
    eager mode its implementation is called directly: the plan made every argument right
    (contiguous tensors, int32 offsets and their host copies on the right devices), and the
    checks would cost as much host time as the launch."""
    if _plain_eager((q, k, v)):
        return _varlen(q, k, v, cu_q, cu_k, max_seqlen_q, host_q, host_k, causal, _scale(scaling), False, *window,
                       softcap)[0]
    return attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, causal=causal, scale=scaling,
                            host_cu_seqlens_q=host_q, host_cu_seqlens_k=host_k, window_size=window, softcap=softcap)


# ---- padded batches ---------------------------------------------------------------------------

# Elements of the mask compared per step when it is checked (bounds the temporaries), and
# the size up to which a mask is copied to the host and checked there (a decode step's:
# fewer launches than on the GPU).
_CHECK_ELEMENTS = 1 << 25
_HOST_CHECK_ELEMENTS = 1 << 18

# Where the keys and values are read in place (_PaddedPlan._in_place): packed rows within
# the library's 2^25, and the 2B - 1 sequences within its 65535.
_IN_PLACE_ROWS = 1 << 25
_IN_PLACE_SEQUENCES = 65535


class _PaddedPlan:
    """A padding mask as a variable-length call: sequence b's keys are positions
    [start_b, end_b) of the padded key axis, its queries the last n_q[b] query rows; with a
    causal sliding window of `window` keys, each query row sees the last `window` of the
    keys its causal row would."""

    def __init__(self, causal, sq, starts, ends, device, window=None):
        import numpy as np  # transformers' own dependency; a few times faster than torch here

        n_k = [max(0, e - s) for s, e in zip(starts, ends)]
        # A causal call's first rows see no key where the run is shorter than Sq; every
        # row of another call sees the whole run.
        n_q = [min(sq, n) if causal else sq for n in n_k]
        batch = len(n_k)
        self.causal = causal
        self.window = NO_WINDOW if window is None else (min(window - 1, _UNBOUNDED_SIDE), 0)
        self.total_q, self.total_k = sum(n_q), sum(n_k)
        self.max_q = max([1, *n_q])
        # Every query row computed (decode steps, prompts without padding in a StaticCache):
        # q and o are the padded tensors' rows in order, with no gather or scatter.
        self.every_row = self.total_q == batch * sq
        n_q, n_k = np.array(n_q, dtype=np.int64), np.array(n_k, dtype=np.int64)
        cu_q, cu_k = np.concatenate([[0], np.cumsum(n_q)]), np.concatenate([[0], np.cumsum(n_k)])
        host = torch.from_numpy(np.concatenate([cu_q, cu_k]).astype(np.int32))
        self.host_q, self.host_k = host[: batch + 1], host[batch + 1 :]
        # The gathers' (batch, row) pairs, made on the host: each sequence's rows are a run,
        # row = the run's first + the rank inside the sequence. One copy to the device for
        # them, one for the offsets.
        firsts_k = np.where(n_k > 0, np.array(starts, dtype=np.int64), 0)
        self._starts, self._counts, self._cu_q = firsts_k, n_k, cu_q
        self._offsets_in_place = {}
        pairs = [] if self.every_row else self._rows(n_q, cu_q, sq - n_q)
        pairs += self._rows(n_k, cu_k, firsts_k)
        rows = torch.from_numpy(np.concatenate(pairs)).to(device)
        cu = host.to(device)
        self.cu_q, self.cu_k = cu[: batch + 1], cu[batch + 1 :]
        nq = 0 if self.every_row else self.total_q
        self.q_rows = None if self.every_row else (rows[:nq], rows[nq : 2 * nq])
        self.k_rows = (rows[2 * nq : 2 * nq + self.total_k], rows[2 * nq + self.total_k :])

    def _in_place(self, key, value):
        """The keys and values read where they are: k and v as packed [rows, Hkv, D] views
        of the contiguous [B, Hkv, Sk, D] tensors (row b·Hkv·Sk + j is position j of batch
        b), with a sequence without queries over the rows between one sequence's run and
        the next, so the offsets stay one after another. No copy of the cache; None where
        that does not apply (the keys are then gathered).
        """
        b, hkv, sk, _ = key.shape
        rows = (b - 1) * hkv * sk + sk
        if not (
            key.is_contiguous()
            and value.is_contiguous()
            and rows <= _IN_PLACE_ROWS
            and 2 * b - 1 <= _IN_PLACE_SEQUENCES
        ):
            return None
        cached = self._offsets_in_place.get((hkv, sk, key.device))
        if cached is None:
            import numpy as np

            first = np.arange(b, dtype=np.int64) * (hkv * sk) + self._starts
            cu_k = np.empty(2 * b, dtype=np.int64)
            cu_k[0::2], cu_k[1::2] = first, first + self._counts
            cu_q = np.empty(2 * b, dtype=np.int64)
            cu_q[0::2], cu_q[1::2] = self._cu_q[:-1], self._cu_q[1:]
            host = torch.from_numpy(np.concatenate([cu_q, cu_k]).astype(np.int32))
            dev = host.to(key.device)
            cached = (dev[: 2 * b], dev[2 * b :], host[: 2 * b], host[2 * b :])
            self._offsets_in_place[(hkv, sk, key.device)] = cached
        d = key.shape[3]
        k = key.as_strided((rows, hkv, d), (d, sk * d, 1))
        v = value.as_strided((rows, hkv, d), (d, sk * d, 1))
        return (k, v, *cached)

    @staticmethod
    def _rows(counts, cu, firsts):
        import numpy as np

        b = np.repeat(np.arange(len(counts)), counts)
        return [b, (firsts - cu[:-1])[b] + np.arange(len(b))]

    def run(self, query, key, value, scaling, softcap=0.0):
        """Attention of query [B, Hq, Sq, D] over key, value [B, Hkv, Sk, D] under the mask
        this plan came from (the scores capped at `softcap`, 0.0: none); returns
        [B, Sq, Hq, D] contiguous."""
        b, h, sq, d = query.shape
        if self.total_q == 0:
            return query.new_zeros((b, sq, h, d))
        q = query.transpose(1, 2)
        q = q.reshape(b * sq, h, d) if self.every_row else q[self.q_rows]
        in_place = self._in_place(key, value)
        if in_place is not None:
            k, v, cu_q, cu_k, host_q, host_k = in_place
        else:
            # [B, S, H, D] views; advanced indexing gathers packed [rows, H, D] copies.
            k = key.transpose(1, 2)[self.k_rows]
            v = value.transpose(1, 2)[self.k_rows]
            cu_q, cu_k, host_q, host_k = self.cu_q, self.cu_k, self.host_q, self.host_k
        o = launch_varlen(q, k, v, cu_q, cu_k, self.max_q, host_q, host_k, self.causal, scaling, self.window, softcap)
        if self.every_row:
            return o.view(b, sq, h, d)
        out = query.new_zeros((b, sq, h, d))
        out[self.q_rows] = o
        return out


# The last masks checked and what they gave (a model's layers pass the same tensor, or two
# that alternate: full and sliding-window layers), by weak reference, so that a prompt's
# mask does not outlive its forward pass.
_plans = {}
_plans_lock = threading.Lock()
_PLANS_KEPT = 4


def _padded_plan(mask, causal, batch, sq, sk, window=None):
    """The variable-length form of a boolean mask [B or 1, 1, Sq, Sk], or None when it has
    none (gaps in a sequence's keys, another dtype or shape, a sliding window other than
    `window`). `window`: None, or with `causal` the number of keys of a sliding window,
    each query row seeing only the last `window` keys its causal row would see (key j at
    absolute position p_j is visible to the query at p iff p - window < p_j <= p, as
    transformers' sliding-window masks say it)."""
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or mask.dim() != 4
        or mask.shape[1] != 1
        or tuple(mask.shape[2:]) != (sq, sk)
        or mask.shape[0] not in (1, batch)
        or mask.device.type != "cuda" and not _CHECK_ON_CPU
    ):
        return None
    if window is not None and not causal:
        return None  # a bidirectional window is no variable-length call of this kind
    if mask.is_inference():
        # Made under torch.inference_mode: no version counter, so a mask written in place
        # since (a static buffer refilled every step) would look unchanged. Checked every
        # call instead.
        return _check_padding(mask[:, 0].expand(batch, sq, sk), causal, batch, sq, sk, window)
    key = (id(mask), mask._version, causal, batch, sq, sk, window)
    with _plans_lock:
        kept = _plans.get(key)
    if kept is not None and kept[0]() is mask:
        return kept[1]
    plan = _check_padding(mask[:, 0].expand(batch, sq, sk), causal, batch, sq, sk, window)
    with _plans_lock:  # threads serving models at once share the cache
        for gone in [k for k, (ref, _) in _plans.items() if ref() is None]:
            del _plans[gone]
        while len(_plans) >= _PLANS_KEPT:
            del _plans[next(iter(_plans))]  # the oldest
        _plans[key] = (weakref.ref(mask), plan)
    return plan


# The CPU tests check masks on CPU tensors; on a real call the mask is on the GPU.
_CHECK_ON_CPU = False


def _check_padding(m, causal, batch, sq, sk, window=None):
    """The plan `m` ([B, Sq, Sk] bool) is the mask of, after comparing every element: on
    the host for a small mask (a decode step's), on its device in chunks otherwise."""
    device = m.device
    if batch * sq * sk <= _HOST_CHECK_ELEMENTS:
        found = _check_on_host(m.cpu().numpy(), causal, sq, sk, window)
        return None if found is None else _PaddedPlan(causal, sq, *found, device, window)
    pos = torch.arange(sk, device=m.device)
    # A causal call's last row, any row of another, sees all of its sequence's keys; with
    # a window, the last row sees the run's end, and the first row that sees any of it
    # (if one does) its start.
    seen = m[:, -1] if causal else m[:, 0]
    first = seen if window is None else m[torch.arange(batch, device=m.device), _first_partial_row(m)]
    start = torch.where(first, pos, sk).amin(1)
    end = torch.where(seen, pos + 1, 0).amax(1)
    ok = torch.ones((), dtype=torch.bool, device=m.device)
    rows = max(1, _CHECK_ELEMENTS // max(1, batch * sk))
    for i0 in range(0, sq, rows):
        i = torch.arange(i0, min(sq, i0 + rows), device=m.device)
        # Row i of a causal call sees keys [start, end - (Sq - 1 - i)), the last `window`
        # of them with a window.
        hi = (end[:, None] - (sq - 1) + i[None, :]) if causal else end[:, None].expand(-1, len(i))
        want = (pos >= start[:, None, None]) & (pos < hi[:, :, None])
        if window is not None:
            want &= pos >= hi[:, :, None] - window
        got = m[:, i0 : i0 + len(i)]
        # Some transformers versions let a row that sees no key see every key instead, so
        # that SDPA's kernels give no NaN there: such rows are padding, zeros here.
        unmasked = got.all(-1) & ~want.any(-1)
        ok &= (torch.eq(got, want).all(-1) | unmasked).all()
    # One wait for the GPU (none when checked on the host): whether the mask matched, and
    # the runs' ends.
    found = torch.cat([ok.view(1).long(), start.long(), end.long()]).tolist()
    if not found[0]:
        return None
    return _PaddedPlan(causal, sq, found[1 : 1 + batch], found[1 + batch :], device, window)


def _first_partial_row(m):
    """Per sequence of `m` ([B, Sq, Sk] bool), the first row that sees some of the keys but
    not all of them (rows that see every key may be padding made visible for SDPA's sake),
    or the last row when none does: under a sliding window, the row whose keys start where
    the sequence's run does."""
    partial = m.any(-1) & ~m.all(-1)
    partial[:, -1] = True
    return partial.int().argmax(1)  # the first of the maxima


def _check_on_host(m, causal, sq, sk, window=None):
    """_check_padding's comparison on a host copy (numpy [B, Sq, Sk] bool): the runs'
    starts and ends, or None."""
    import numpy as np

    seen = m[:, -1] if causal else m[:, 0]
    some = seen.any(1)
    first = seen
    if window is not None:
        partial = m.any(-1) & ~m.all(-1)
        partial[:, -1] = True
        first = m[np.arange(len(m)), partial.argmax(1)]
    start = np.where(first.any(1), first.argmax(1), sk)
    end = np.where(some, sk - seen[:, ::-1].argmax(1), 0)
    pos, i = np.arange(sk), np.arange(sq)
    hi = end[:, None] - (sq - 1) + i[None, :] if causal else np.broadcast_to(end[:, None], (len(end), sq))
    want = (pos >= start[:, None, None]) & (pos < hi[:, :, None])
    if window is not None:
        want &= pos >= hi[:, :, None] - window
    unmasked = m.all(-1) & ~want.any(-1)
    if not ((m == want).all(-1) | unmasked).all():
        return None
    return start.tolist(), end.tolist()


def _may_wait(device):
    """Whether this call may wait for the GPU: plain eager mode, no graph being captured
    on `device`'s current stream (which need not be the current device's).
    """
    if torch.compiler.is_compiling() or _dispatch_mode_active():
        return False
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    if device.index == torch.cuda.current_device():
        return not torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):  # another GPU's stream: switch only then
        return not torch.cuda.is_current_stream_capturing()


def _on_gpu(*tensors):
    """Whether every tensor is on a CUDA device, where flashcore's op runs."""
    return all(t.is_cuda for t in tensors)


# Compute capability by device index, read once per device.
_capabilities = {}


def _capability(device):
    """(major, minor) of a CUDA device. From get_device_properties, which torch.compile
    folds to a constant (get_device_capability it would try to put in the graph)."""
    cap = _capabilities.get(device.index)
    if cap is None:
        props = torch.cuda.get_device_properties(device)
        cap = (props.major, props.minor)
        _capabilities[device.index] = cap
    return cap


def _scale(scaling):
    """The op's scale argument: 0.0 asks for the default 1/sqrt(D) (a `scaling` that is not
    a positive float32 never gets here)."""
    return 0.0 if scaling is None else float(scaling)


def register(name=None, fp8=False):
    """Registers flashcore with transformers' attention and mask interfaces under `name`
    (default "fcore", or "fcore-fp8" with fp8=True: FP8 attention) and returns it, for
    `attn_implementation=name` or `model.set_attn_implementation(name)`."""
    if name is None:
        name = FP8_NAME if fp8 else NAME
    if "flash" in name.lower():
        raise ValueError(
            f"flashcore: the attention implementation name {name!r} contains 'flash'; transformers "
            "would treat it as a FlashAttention build and try to import it"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(
            f"flashcore: registering with transformers needs transformers with AttentionInterface "
            f"and AttentionMaskInterface (4.53 or newer): {e}"
        ) from e
    AttentionInterface.register(name, attention_forward_fp8 if fp8 else attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
