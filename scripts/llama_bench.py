#!/usr/bin/env python3
"""Time per generated token of a random-weight Llama (built from a config: no download)
with transformers' SDPA attention and with flashcore's backend, same weights, same prompt.

    python3 scripts/llama_bench.py [--json OUT.json]

For each model size and backend: greedy generation of --new tokens after a --prompt token
prompt (batch --batch), timed end to end with CUDA events after a warm-up generation; the
prefill is timed separately (one forward over the prompt), and the per-token figure is
(generate time - prefill time) / new tokens. With --pad F the prompts are left-padded as
generate() pads a batch of prompts of different lengths (sequence b of B gets
round(F * prompt * b / (B - 1)) padding tokens), so every attention call comes with a
mask. Also reports how many greedy tokens each backend generates before its first difference from SDPA's, with transformers' eager
attention as the noise reference. Needs the flashcore package (the wheel, or python/ on sys.path with
FLASHCORE_LIB set).
"""

import argparse
import json
import statistics
import sys

import torch

CONFIGS = {
    # name: (hidden, intermediate, layers, heads, kv heads)
    "small (2 layers, d512)": (512, 1024, 2, 8, 2),
    "1B-class (16 layers, d2048, GQA 32:8)": (2048, 8192, 16, 32, 8),
}


def build(hidden, inter, layers, heads, kv_heads, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        initializer_range=0.05, pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def timed(fn, reps):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), out


def host_overhead_us(n=2000):
    """Host time per call (no sync; the GPU keeps up) of flashcore.attention and of SDPA on
    one decode step of the 1B-class model: what a launch-bound decode loop pays per layer."""
    import flashcore
    import time

    F = torch.nn.functional
    q = torch.randn(1, 32, 1, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 4096, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = {}
    for name, fn in (
        ("flashcore.attention", lambda: flashcore.attention(q, k, v)),
        ("sdpa (enable_gqa)", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
    ):
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out[name] = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pad", type=float, default=0.0, help="left padding of the last sequence, a fraction of --prompt")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dtype", default="bf16", choices=["f16", "bf16"])
    p.add_argument("--json")
    args = p.parse_args()

    import flashcore
    from flashcore import transformers_backend

    name = flashcore.register_transformers()
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    rows = []
    for label, cfg in CONFIGS.items():
        model = build(*cfg, dtype)
        ids = torch.randint(1, 32000, (args.batch, args.prompt), device="cuda")
        mask = torch.ones_like(ids)
        for b in range(1, args.batch):
            mask[b, : round(args.pad * args.prompt * b / (args.batch - 1))] = 0
        ids = ids.masked_fill(mask == 0, 0)  # the pad token
        res = {"model": label, "prompt": args.prompt, "new_tokens": args.new, "batch": args.batch, "dtype": args.dtype,
               "pad": args.pad}
        tokens = {}
        for backend in ("sdpa", "eager", name):
            model.set_attn_implementation(backend)
            transformers_backend.stats["flashcore"] = 0
            transformers_backend.stats["sdpa"].clear()
            with torch.no_grad():
                gen = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=args.new,  # noqa: E731
                                             min_new_tokens=args.new, do_sample=False)
                gen()  # warm-up (kernels loaded, allocator primed)
                prefill_ms, _ = timed(lambda: model(ids, attention_mask=mask), args.reps)
                total_ms, out = timed(gen, args.reps)
            tokens[backend] = out
            res[backend] = {
                "prefill_ms": prefill_ms,
                "generate_ms": total_ms,
                "ms_per_token": (total_ms - prefill_ms) / args.new,
                "flashcore_calls": transformers_backend.stats["flashcore"],
                "sdpa_fallbacks": dict(transformers_backend.stats["sdpa"]),
            }
        res["same_tokens"] = bool(torch.equal(tokens["sdpa"], tokens[name]))
        # Tokens before the first difference from SDPA's; eager's is the noise reference
        # (random weights leave near-ties that any change of summation order can flip).
        for other in ("eager", name):
            differ = (tokens["sdpa"][:, args.prompt:] != tokens[other][:, args.prompt:]).any(dim=0).nonzero()
            res[f"identical_prefix_{other}"] = int(differ[0]) if len(differ) else args.new
        res["speedup_per_token"] = res["sdpa"]["ms_per_token"] / res[name]["ms_per_token"]
        res["speedup_prefill"] = res["sdpa"]["prefill_ms"] / res[name]["prefill_ms"]
        rows.append(res)
        del model
        torch.cuda.empty_cache()

    print(f"Llama (random weights) greedy generation, {args.dtype}, batch {args.batch}, prompt {args.prompt}, "
          f"left padding up to {args.pad:.0%}, {args.new} new tokens; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"| model | prefill SDPA ms | prefill {name} ms | ms/token SDPA | ms/token {name} | "
          "per-token speedup | greedy tokens equal to SDPA's: ours (eager's) | fallbacks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, o = r["sdpa"], r[name]
        print(f"| {r['model']} | {s['prefill_ms']:.2f} | {o['prefill_ms']:.2f} | {s['ms_per_token']:.3f} | "
              f"{o['ms_per_token']:.3f} | {r['speedup_per_token']:.2f}x | {r['identical_prefix_' + name]}/{args.new} ({r['identical_prefix_eager']}) | "
              f"{o['sdpa_fallbacks'] or 'none'} |")
    with torch.no_grad():
        host = host_overhead_us()
    print("host time per call, B1 Hq32 Hkv8 Sq1 Sk4096 D64 bf16: "
          + ", ".join(f"{k} {v:.1f} us" for k, v in host.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "host_us_per_call": host}, f, indent=1)
    return 0 if all(r[name]["sdpa_fallbacks"] == {} for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
