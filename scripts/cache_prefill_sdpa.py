"""PyTorch SDPA (cuDNN and FlashAttention-2 backends) on the shapes of a prefill chunk
against a KV cache, for `flashcore decode --seqlen-q Sq` to be read beside.

    python3 scripts/cache_prefill_sdpa.py B:SQ:SKV ...   (Hq 32, Hkv 8, D 128, f16)

SDPA gets q [B, 32, Sq, 128] against contiguous K/V [B, 8, Skv, 128] with enable_gqa, not
causal: its is_causal aligns a short query block top-left, while a cache's new queries
sit at its end. Each call is timed by its own CUDA event pair, median of 50 after 5
warm-up calls.
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_us(fn, n=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main(specs):
    for spec in specs:
        b, sq, skv = map(int, spec.split(":"))
        q = torch.randn(b, 32, sq, 128, device="cuda", dtype=torch.float16)
        k = torch.randn(b, 8, skv, 128, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        flops = 4 * b * 32 * sq * skv * 128
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    us = median_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                print(f"B{b} Sq{sq} Skv{skv} {name} not causal {us:.1f} us {flops / us / 1e6:.1f} TFLOP/s")
            except RuntimeError as e:
                print(f"B{b} Sq{sq} Skv{skv} {name}: {str(e)[:100]}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["1:1024:8192"])
