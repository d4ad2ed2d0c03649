"""flashcore: FlashAttention-class forward attention kernels for NVIDIA GPUs, for PyTorch.

    import flashcore
    o = flashcore.attention(q, k, v, causal=True)             # [B, H, S, D]; causal bottom-right
    o, lse = flashcore.attention(q, k, v, return_lse=True, layout="bshd")
    o = flashcore.attention(q, k, v, causal=True, window_size=(4095, 0))  # sliding window: 4096 keys
    o = flashcore.attention(q, k, v, causal=True, softcap=50.0)  # logit soft-capping (Gemma 2)
    name = flashcore.register_transformers()                  # attn_implementation=name

    # FP8 (e4m3, sm_89+): quantized on the GPU, per-block scales; o in q's dtype.
    o = flashcore.attention_fp8(q, k, v, causal=True)         # smooth_k=, hadamard_seed=
    ops = flashcore.quantize_fp8(q, k, v)                     # the operands, reusable ...
    o = flashcore.forward_fp8(ops, causal=True)               # ... by the FP8 forward
    name = flashcore.register_transformers(fp8=True)          # "fcore-fp8"

    # Serving (flashcore.serving): [B, S, H, D] tensors, int32 lengths on the GPU.
    flashcore.append_kv(k_cache, v_cache, seqlens, k_new, v_new)  # at each length ...
    seqlens += k_new.shape[1]                                     # ... then advance them
    o = flashcore.decode(q, k_cache, v_cache, seqlens)            # block_table=... if paged
    o = flashcore.merge(o_parts, lse_parts)                       # shards merged by LSE
    o = flashcore.decode(q, k8, v8, seqlens, k_scale=ks, v_scale=vs)  # FP8 cache (sm_89+):
    # float8_e4m3fn codes, float32 scales [B, capacity, Hkv]; append_kv(..., k_scale=, v_scale=)
    o = flashcore.attention_varlen(q, k, v, cu_q, cu_k, max_q)    # packed prompts, no padding
    o = flashcore.decode_varlen(q, k_cache, v_cache, seqlens, cu_q, max_q)  # a packed serving step

The kernels are generated at run time and loaded through the CUDA driver; the wheel
carries libflashcore.so (the C ABI, include/flashcore.h) and this package calls it through
ctypes. No CUDA toolkit is needed, only the NVIDIA driver and a GPU of sm_80 or newer.
"""

from ._capi import FlashcoreError
from .fp8 import FP8_HEAD_DIMS, Fp8Operands, attention_fp8, forward_fp8, quantize_fp8
from .ops import HEAD_DIMS, LAYOUTS, attention, forward_head_dim
from .serving import append_kv, decode, merge
from .varlen import attention_varlen, decode_varlen
from . import transformers_backend  # imports no transformers; register_transformers() does

__version__ = "0.1.0"

__all__ = [
    "FP8_HEAD_DIMS",
    "FlashcoreError",
    "Fp8Operands",
    "HEAD_DIMS",
    "LAYOUTS",
    "append_kv",
    "attention",
    "attention_fp8",
    "attention_varlen",
    "decode",
    "decode_varlen",
    "forward_fp8",
    "forward_head_dim",
    "library_version",
    "merge",
    "quantize_fp8",
    "register_transformers",
]


def library_version():
    """The version libflashcore.so reports (equal to __version__ in a consistent install)."""
    from . import _capi

    return _capi.library().version


def register_transformers(name=None, fp8=False):
    """Makes flashcore an attention implementation of transformers under `name` (returned):
    its 16-bit attention under "fcore" by default, or with fp8=True its FP8 attention
    (flashcore.attention_fp8) under "fcore-fp8". See flashcore.transformers_backend for
    what runs where."""
    return transformers_backend.register(name, fp8=fp8)
