"""flashcore as an attention implementation of Hugging Face transformers.

    import flashcore
    name = flashcore.register_transformers()          # "fcore"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)
    # or: model.set_attn_implementation(name)

The name does not contain "flash": transformers takes such names for FlashAttention builds
and tries to import them.

What runs where. Masks are built exactly as for "sdpa" (the same mask function is
registered under this name), so transformers hands over no mask whenever SDPA would run
with `is_causal` alone: a prompt without padding, or a decode step without padding. Those
calls, prefill and KV-cache decode alike, go to flashcore (causal for a prompt; a single
query token sees the whole cache). A call that comes with a mask (padded batches,
sliding-window layers, chunked prefill against a cache), a dtype other than float16 or
bfloat16, or a head dim flashcore has no kernel for is computed by transformers' own SDPA
path instead, with a warning the first time, so results stay right. `stats` counts both.
"""

import warnings

import torch

from .ops import HEAD_DIMS, launch

NAME = "fcore"

# Calls served by flashcore and calls handed to SDPA, by reason.
stats = {"flashcore": 0, "sdpa": {}}

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
    if dropout and module.training:
        raise NotImplementedError("flashcore: attention dropout in training is not supported (forward only)")
    sdpa_kwargs = dict(kwargs, dropout=dropout, scaling=scaling, is_causal=is_causal)
    if attention_mask is not None:
        return _fallback("an explicit attention mask", module, query, key, value, attention_mask, **sdpa_kwargs)
    if query.dtype not in (torch.float16, torch.bfloat16):
        return _fallback(f"dtype {query.dtype}", module, query, key, value, attention_mask, **sdpa_kwargs)
    if query.shape[-1] not in HEAD_DIMS:
        return _fallback(f"head dim {query.shape[-1]}", module, query, key, value, attention_mask, **sdpa_kwargs)
    # As SDPA: the module says whether it is causal unless the caller does; with no mask,
    # transformers only gets here with Sq == 1 or Sq == Sk, where bottom-right alignment
    # and SDPA's top-left one agree.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and query.shape[2] > 1
    stats["flashcore"] += 1
    out, _ = launch(query, key, value, causal, float(scaling) if scaling else 0.0, "bhsd", "bshd", False)
    return out, None


def register(name=NAME):
    """Registers flashcore with transformers' attention and mask interfaces under `name`
    and returns it, for `attn_implementation=name` or `model.set_attn_implementation(name)`."""
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
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
