#!/usr/bin/env python3
"""What PyTorch offers for soft-capped attention (Gemma 2's attn_logit_softcapping), timed
as sdpa_bench.py times.

Usage:
    python3 softcap_bench.py [--json OUT.json] [--dtype bf16] [--iters 30] [--softcap 50]
                             [--shapes 1x16x8x8192x256,...] [--windows 0,4096] [--no-flex]

For each shape (B x Hq x Hkv x S x D, self-attention, causal) and each window (0: none; W:
a causal sliding window of W keys, FlashAttention's window_size (W - 1, 0)), scores
`x = q.k / sqrt(D)` capped as `cap * tanh(x / cap)`:

    eager          the scores materialized, capped, masked, softmaxed in float32 and
                   multiplied by V: what transformers' eager attention runs for Gemma 2
    flex           torch.nn.attention.flex_attention under torch.compile, the cap as a
                   score_mod and the mask as a block mask (skipped with --no-flex)
    flashcore      flashcore.attention(..., causal=True, window_size=..., softcap=cap)
    sdpa-cudnn     SDPA causal without the cap and without the window: the uncapped
                   problem's fastest PyTorch kernel, for scale (no window: a mask would
                   take it off cuDNN's fast path)
    flashcore-nocap  the same call as flashcore without the cap: what the cap costs

FLOPs count the visible pairs only (4 * D * B * Hq * pairs). Timing: CUDA events around
each call after warm-up, median, inputs rotated over more than twice the L2 cache. Each
backend's output is compared with eager's (max absolute difference) as a sanity check: the
capped backends agree with it to the dtype's rounding, the uncapped ones do not.
"""

import argparse
import json
import math

from window_bench import input_sets, pairs, time_calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--shapes", default="1x16x8x8192x256,1x32x16x8192x128,4x32x8x4096x128")
    p.add_argument("--windows", default="0,4096")
    p.add_argument("--no-flex", action="store_true")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashcore

    flex = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = (torch.compile(flex_attention, dynamic=False), create_block_mask)
        except Exception as e:  # an older torch, or no triton
            print(f"# flex_attention unavailable: {e}")
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    cap = args.softcap
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.dtype}, softcap {cap}")
    records = []
    for shape in args.shapes.split(","):
        b, h, hkv, s, d = (int(x) for x in shape.split("x"))
        # [B, S, H, D] as flashcore takes it; SDPA, flex and eager get [B, H, S, D] views.
        sets = input_sets(torch, (b, h, hkv, s, d), dtype, seed=11, bshd=True)
        scale = 1.0 / math.sqrt(d)
        i = torch.arange(s, device="cuda")
        for w in [int(x) for x in args.windows.split(",")]:
            window = (w - 1, 0) if w > 0 else (-1, -1)

            def visible(qi, kj):
                inside = kj <= qi
                return inside & (kj > qi - w) if w > 0 else inside

            def eager(q, k, v):
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                k = k.repeat_interleave(h // hkv, dim=1)
                v = v.repeat_interleave(h // hkv, dim=1)
                x = torch.matmul(q, k.transpose(-1, -2)) * scale
                x = torch.tanh(x / cap) * cap
                x = x.masked_fill(~visible(i[:, None], i[None, :]), float("-inf"))
                return torch.matmul(torch.softmax(x, dim=-1, dtype=torch.float32).to(dtype), v)

            def ours(softcap):
                return lambda q, k, v: flashcore.attention(
                    q, k, v, causal=True, window_size=window, softcap=softcap, layout="bshd")

            def cudnn(q, k, v):
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=h != hkv)

            runs = [("flashcore", ours(cap)), ("flashcore-nocap", ours(0.0)), ("eager", eager)]
            if w == 0:
                runs.append(("sdpa-cudnn", cudnn))
            if flex is not None:
                compiled, block_mask_of = flex

                def mask_mod(bi, hi, qi, kj):
                    return visible(qi, kj)

                block_mask = block_mask_of(mask_mod, None, None, s, s, device="cuda")

                def score_mod(x, bi, hi, qi, kj):
                    return torch.tanh(x / cap) * cap

                def flex_call(q, k, v):
                    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                    return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                    scale=scale, enable_gqa=h != hkv)

                runs.append(("flex", flex_call))
            flops = 4 * d * b * h * pairs(s, w)
            want = eager(*sets[0]).transpose(1, 2).float()
            for name, call in runs:
                try:
                    got = call(*sets[0])
                    if got.shape != want.shape:  # [B, H, S, D] back to [B, S, H, D]
                        got = got.transpose(1, 2)
                    diff = (got.float() - want).abs().max().item()
                    ms, n = time_calls(torch, call, sets, args.iters)
                except Exception as e:  # out of memory, or a backend that refuses the shape
                    print(f"B{b} H{h}/{hkv} S{s} D{d} window {w or 'none'} {name}: failed "
                          f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})")
                    torch.cuda.empty_cache()
                    continue
                tflops = flops / (ms * 1e9)
                print(f"B{b} H{h}/{hkv} S{s} D{d} window {w or 'none'} {name}: "
                      f"{ms * 1e3:.1f} us, {tflops:.1f} TFLOP/s ({n} calls), "
                      f"max |diff| vs eager {diff:.2e}")
                records.append(dict(batch=b, heads=h, kv_heads=hkv, seqlen=s, head_dim=d,
                                    window=w, softcap=cap, backend=name, median_ms=ms,
                                    tflops=tflops, max_diff=diff))
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
