#!/usr/bin/env python3
"""What PyTorch offers for sliding-window (local) attention, timed as sdpa_bench.py times.

Usage:
    python3 window_bench.py [--json OUT.json] [--dtype f16] [--iters 30]
                            [--shapes 1x32x8x16384x128,...] [--windows 4096,1024]

For each shape (B x Hq x Hkv x S x D, self-attention) and each causal sliding window of W
keys (row i sees keys i - W + 1 ..= i: FlashAttention's window_size (W - 1, 0)):

    sdpa-mask-<backend>  torch SDPA with the window as a boolean attn_mask, on each backend
                         that takes one (efficient, cudnn): what a PyTorch user without
                         a windowed kernel runs
    sdpa-causal-<backend> torch SDPA causal over the whole sequence (flash, cudnn): the
                         work a window saves, for scale
    flashcore            flashcore.attention(..., causal=True, window_size=(W - 1, 0)),
                         when the installed package takes window_size

FLOPs count the window's visible pairs only (4 * D * B * Hq * pairs), for every row; the
causal rows count their own pairs. Timing: CUDA events around each call after warm-up,
median, inputs rotated over more than twice the L2 cache (sdpa_bench.measure's method).
"""

import argparse
import json
import math
import statistics
import time


def pairs(s, window):
    """Visible (query, key) pairs of a causal window of `window` keys (0: no window)."""
    if window <= 0 or window >= s:
        return s * (s + 1) // 2
    # Rows 0 .. window-1 see i + 1 keys; the rest see `window`.
    return window * (window + 1) // 2 + (s - window) * window


def input_sets(torch, shape, dtype, seed, bshd=False):
    """Random (q, k, v) sets of `shape` (B, Hq, Hkv, S, D), [B, H, S, D] (or [B, S, H, D]
    with `bshd`), enough of them to exceed twice the L2 cache (at most 4 GB)."""
    b, h, hkv, s, d = shape
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = (b * h * s * d + 2 * b * hkv * s * d) * 2
    n_sets = max(1, min(math.ceil(2 * l2 / set_bytes), int(4e9 // set_bytes)))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)

    def one(n):
        dims = (b, s, n, d) if bshd else (b, n, s, d)
        return torch.randn(*dims, device="cuda", dtype=dtype, generator=gen)

    return [(one(h), one(hkv), one(hkv)) for _ in range(n_sets)]


def time_calls(torch, call, sets, iters):
    for i in range(3):
        call(*sets[i % len(sets)])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(3):
        call(*sets[i % len(sets)])
    torch.cuda.synchronize()
    est = (time.perf_counter() - t0) / 3
    iters = min(iters, max(10, math.ceil(0.5 / est))) if est > 0 else iters
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(int(min(iters * 60e-6, 0.05) * 1.5e9))
    for i in range(iters):
        starts[i].record()
        call(*sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), iters


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--dtype", default="f16")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--shapes", default="1x32x8x16384x128,4x32x8x4096x128,2x16x16x8192x64")
    p.add_argument("--windows", default="4096,1024")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        import flashcore
    except ImportError:
        flashcore = None
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.dtype}")
    records = []
    for shape in args.shapes.split(","):
        b, h, hkv, s, d = (int(x) for x in shape.split("x"))
        sets = input_sets(torch, (b, h, hkv, s, d), dtype, seed=7)
        gqa = {"enable_gqa": True} if hkv != h else {}
        i = torch.arange(s, device="cuda")

        def sdpa(backend, **kw):
            def call(q, k, v):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, **kw, **gqa)
            return call

        def ours(window_size):
            return lambda q, k, v: flashcore.attention(q, k, v, causal=True, window_size=window_size)

        for w in [int(x) for x in args.windows.split(",")] + [0]:
            flops = 4 * d * b * h * pairs(s, w)
            if w > 0:
                mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
                runs = [("sdpa-mask-efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION, attn_mask=mask)),
                        ("sdpa-mask-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, attn_mask=mask)),
                        ("flashcore", ours((w - 1, 0)))]
            else:
                runs = [("sdpa-causal-flash", sdpa(SDPBackend.FLASH_ATTENTION, is_causal=True)),
                        ("sdpa-causal-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION, is_causal=True)),
                        ("flashcore-causal", ours((-1, -1)))]
            if flashcore is None:
                runs = runs[:2]
            for name, call in runs:
                try:
                    ms, n = time_calls(torch, call, sets, args.iters)
                except Exception as e:  # a backend that refuses the mask or the shape
                    print(f"B{b} H{h}/{hkv} S{s} D{d} window {w or 'none'} {name}: unsupported "
                          f"({str(e).splitlines()[0][:100] if str(e) else type(e).__name__})")
                    continue
                tflops = flops / (ms * 1e9)
                print(f"B{b} H{h}/{hkv} S{s} D{d} window {w or 'none'} {name}: "
                      f"{ms * 1e3:.1f} us, {tflops:.1f} TFLOP/s ({n} calls)")
                records.append(dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d,
                                    window=w, backend=name, median_ms=ms, tflops=tflops))
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
