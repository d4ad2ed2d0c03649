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
flashcore's split-KV decode kernels). A call that comes with a mask (padded batches,
sliding-window layers, chunked prefill against a cache), a dtype other than float16 or
bfloat16, a head dim flashcore has no kernel for (or value's differing from query's), a
score bias (`position_bias`: T5-style models), a `scaling` that is not a positive float32
(zero, negative, NaN, or outside float32's range), a causal call with more queries than
keys, tensors off the GPU (a model on the CPU), or inputs that require gradients with
autograd on (flashcore is forward only) is computed by transformers' own SDPA path
instead, with a warning the first time, so results stay right. `stats` counts both.

Causal alignment. With no mask, transformers' SDPA path aligns a causal call top-left:
query i sees keys 0..=i. A prompt written into a longer preallocated cache (StaticCache:
Sk > Sq, the slots past the prompt still empty) depends on that, so such calls run on the
first Sq keys, where flashcore's bottom-right alignment is the same mask.

Attention sinks (`s_aux`, as gpt-oss passes them) change the softmax itself; flashcore
has no kernel for them and neither does SDPA, so such calls raise NotImplementedError
rather than dropping them.

FP8 ("fcore-fp8", `register(fp8=True)`): the same rules, but the calls flashcore serves
go to flashcore.attention_fp8 (q, k and v quantized to e4m3 on the GPU at every call,
then the FP8 kernel; an sm_89 or newer GPU). A head dim the FP8 kernels lack (only 64,
128 and 256 have them) runs on flashcore's 16-bit kernel instead, counted in
`stats["flashcore"]`; FP8 calls are counted in `stats["flashcore_fp8"]`. Every decode step
quantizes the whole cache again: this backend is for measuring FP8 attention's effect on
a model (perplexity, generations), not for fast decoding. Set FLASHCORE_FP8_SMOOTH_K=1
to quantize with K smoothing, FLASHCORE_FP8_HADAMARD_SEED=<seed> to rotate q and k.
"""

import os
import warnings

import torch

from .fp8 import FP8_HEAD_DIMS, launch_fp8
from .ops import _needs_grad, forward_head_dim, launch, softmax_scale

NAME = "fcore"
FP8_NAME = "fcore-fp8"

# Calls served by flashcore (16-bit and FP8) and calls handed to SDPA, by reason.
stats = {"flashcore": 0, "flashcore_fp8": 0, "sdpa": {}}

_warned = set()


def _fallback(reason, module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stats["sdpa"][reason] = stats["sdpa"].get(reason, 0) + 1
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashcore: {reason}: these attention calls run on transformers' SDPA path", stacklevel=3)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


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
    if dropout and module.training:
        raise NotImplementedError("flashcore: attention dropout in training is not supported (forward only)")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "flashcore: attention sinks (s_aux) are not supported; use attn_implementation='eager' for this model"
        )
    sdpa_kwargs = dict(kwargs, dropout=dropout, scaling=scaling, is_causal=is_causal)

    def fallback(reason):
        return _fallback(reason, module, query, key, value, attention_mask, **sdpa_kwargs)

    if attention_mask is not None:
        return fallback("an explicit attention mask")
    if kwargs.get("position_bias") is not None:
        return fallback("a position bias")
    if _needs_grad((query, key, value)):
        return fallback("inputs that require gradients (flashcore is forward only)")
    if not _on_gpu(query, key, value):
        return fallback(f"tensors on {query.device} (flashcore runs on CUDA devices)")
    if query.dtype not in (torch.float16, torch.bfloat16):
        return fallback(f"dtype {query.dtype}")
    if not forward_head_dim(query.shape[-1]) or value.shape[-1] != query.shape[-1]:
        return fallback(f"head dims {query.shape[-1]} (query) and {value.shape[-1]} (value)")
    if scaling is not None:
        try:
            softmax_scale("flashcore", scaling)
        except ValueError:
            # 0, negative, NaN, or outside float32 (below 1.4e-45 it would reach the C ABI
            # as 0, its "default scale"): SDPA takes what flashcore cannot.
            return fallback(f"scaling {scaling}")
    # As SDPA: the module says whether it is causal unless the caller does, and one query
    # token sees the whole cache.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and query.shape[2] > 1
    sq, sk = query.shape[2], key.shape[2]
    if causal and sk > sq:
        # SDPA's causal mask is top-left aligned: the queries see only the first Sq keys
        # (a prompt in a longer preallocated cache), where bottom-right is the same mask.
        key, value = key[:, :, :sq], value[:, :, :sq]
    elif causal and sk < sq:
        return fallback("a causal call with more queries than keys (top-left alignment)")
    if fp8 and query.shape[-1] in FP8_HEAD_DIMS:
        stats["flashcore_fp8"] += 1
        # [B, S, H, D] views in, [B, Sq, Hq, D] contiguous out, as transformers wants it.
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        smooth_k, seed = _fp8_options()
        out, _ = launch_fp8(q, k, v, causal, _scale(scaling), "bshd", False, smooth_k, seed)
        return out, None
    stats["flashcore"] += 1
    out, _ = launch(query, key, value, causal, _scale(scaling), "bhsd", "bshd", False)
    return out, None


def _on_gpu(*tensors):
    """Whether every tensor is on a CUDA device, where flashcore's op runs."""
    return all(t.is_cuda for t in tensors)


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
