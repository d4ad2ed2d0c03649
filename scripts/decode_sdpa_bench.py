#!/usr/bin/env python3
"""Decode-attention baseline: PyTorch SDPA (cuDNN and flash backends) against a long KV cache.

Usage:
    python3 decode_sdpa_bench.py [--json OUT.json] [--iters 100] [--sq 1]
                                 [--shapes 1x8192,1x32768,16x8192,64x4096] [--read-gib 4]

Measures torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
non-causal, fp16, restricted to one backend at a time (torch.nn.attention.sdpa_kernel(
[SDPBackend.CUDNN_ATTENTION] / [SDPBackend.FLASH_ATTENTION])), on q [B, Hq, Sq, D] and
k, v [B, Hkv, Skv, D] (contiguous, random normal), Hq=32, Hkv=8, D=128, Sq=1 by default.

Timing: 10 warm-up calls, then one pair of CUDA events around each of --iters (>= 50)
calls, queued behind a GPU sleep so host launch overhead is not timed (the sleep is
lengthened and the run repeated when it ran out before the host had queued everything);
the figure is the median. Calls rotate over enough input copies that the K+V bytes of
all copies together exceed 3x the L2 cache, so every call reads K/V from HBM.
gbps = K+V bytes (2 * B * Hkv * Skv * D * 2) / median time.

"graph": the same at B=1, Skv=8192 with each call captured in a torch.cuda.CUDAGraph
(one graph per input copy, after warm-up on a side stream), timing graph.replay().

"read_gbps": the GPU's read bandwidth in the same run: read-only reductions over one
--read-gib GiB fp16 random buffer (sum into fp32, amax, max over an int32 view); the
best of the variants, bytes / median time.

JSON (--json): {"device", "torch", "read_gbps", "read_variants": {name: gbps},
"shapes": [{"batch", "heads_q", "heads_kv", "head_dim", "seqlen_q", "seqlen_k", "kv_bytes",
"sdpa_cudnn": {"us", "gbps"} | {"error"}, "sdpa_flash": ...}],
"graph": {"batch", "seqlen_k", "sdpa_cudnn": {"us"} | {"error"}, "sdpa_flash": ...}}
"""

import argparse
import json
import math
import statistics
import sys

DEFAULT_SHAPES = "1x8192,1x32768,16x8192,64x4096"
BACKENDS = (("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_flash", "FLASH_ATTENTION"))
WARMUP = 10
GRAPH_SHAPE = (1, 8192)


def first_line(e):
    s = f"{type(e).__name__}: {e}".strip()
    return s.splitlines()[0][:300] if s else type(e).__name__


def parse_shapes(text):
    shapes = []
    for item in text.split(","):
        if item.strip():
            b, s = item.lower().split("x")
            shapes.append((int(b), int(s)))
    if not shapes:
        raise ValueError("no shapes")
    return shapes


def time_calls(torch, call, iters, n_sets, per_call_us=150.0):
    """Median milliseconds of call(i), i = 0..iters-1, one pair of CUDA events per call."""
    for i in range(WARMUP):
        call(i % n_sets)
    torch.cuda.synchronize()
    sleep = getattr(torch.cuda, "_sleep", None)
    for _attempt in range(4):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        slept = torch.cuda.Event()
        if sleep is not None:
            # ~2 GHz SM clock: keep the GPU busy while the host queues every call.
            sleep(int(min(iters * per_call_us * 1e-6, 2.0) * 2e9))
        slept.record()
        for i in range(iters):
            starts[i].record()
            call(i % n_sets)
            ends[i].record()
        covered = sleep is None or not slept.query()  # sleep still running: no host gaps
        torch.cuda.synchronize()
        if covered:
            break
        per_call_us *= 3
    else:
        print("  warning: GPU sleep ran out before the host queued every call", flush=True)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def make_sets(torch, b, hq, hkv, sq, skv, d, l2_bytes):
    kv_bytes = 2 * b * hkv * skv * d * 2
    n_sets = max(2, math.floor(3 * l2_bytes / kv_bytes) + 1)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.float16, generator=gen)
        k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.float16, generator=gen)
        v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.float16, generator=gen)
        sets.append((q, k, v))
    return sets, kv_bytes


def bench_eager(torch, backend, sets, iters):
    from torch.nn.attention import sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel([backend]):
        return time_calls(torch, lambda i: sdpa(*sets[i], enable_gqa=True), iters, len(sets))


def bench_graph(torch, backend, sets, iters):
    from torch.nn.attention import sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel([backend]):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                sdpa(*sets[i % len(sets)], enable_gqa=True)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graphs, outs = [], []  # one graph per input copy, so replays rotate inputs too
        for q, k, v in sets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=graphs[0].pool() if graphs else None):
                outs.append(sdpa(q, k, v, enable_gqa=True))
            graphs.append(g)
    torch.cuda.synchronize()
    return time_calls(torch, lambda i: graphs[i].replay(), iters, len(graphs), per_call_us=50.0)


def read_bandwidth(torch, gib, iters):
    n = int(gib * 2**30) // 2
    n -= n % 2  # even, for the int32 view
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    variants = {
        "sum_f16_to_f32": lambda i: torch.sum(x, dtype=torch.float32),
        "amax_f16": lambda i: torch.amax(x),
        "max_i32_view": lambda i: x.view(torch.int32).max(),
    }
    out = {}
    for name, fn in variants.items():
        try:
            ms = time_calls(torch, fn, iters, 1)
            out[name] = x.numel() * 2 / (ms * 1e-3) / 1e9
        except Exception as e:  # noqa: BLE001
            print(f"  read variant {name}: {first_line(e)}", flush=True)
    del x
    torch.cuda.empty_cache()
    return out


def measure(torch, fn, backend, sets, iters):
    try:
        return {"us": fn(torch, backend, sets, iters) * 1e3}
    except Exception as e:  # noqa: BLE001 - record every failure, keep going
        return {"error": first_line(e)}
    finally:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass


def fmt(r, with_gbps=True):
    if "error" in r:
        return f"error: {r['error'][:100]}"
    return f"{r['us']:9.2f} us" + (f" {r['gbps']:7.0f} GB/s" if with_gbps else "")


def run(args):
    try:
        import torch
        from torch.nn.attention import SDPBackend
    except Exception as e:  # noqa: BLE001
        print(f"decode_sdpa_bench: cannot import torch: {first_line(e)}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("decode_sdpa_bench: torch sees no CUDA device", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 * 2**20
    device = torch.cuda.get_device_name(0)
    print(f"decode_sdpa_bench: {device}, L2 {l2_bytes / 2**20:.0f} MiB, torch {torch.__version__}, "
          f"cuda {torch.version.cuda}, cudnn {torch.backends.cudnn.version()}", flush=True)
    hq, hkv, d, sq = args.heads_q, args.heads_kv, args.head_dim, args.sq

    variants = read_bandwidth(torch, args.read_gib, args.iters)
    read_gbps = max(variants.values()) if variants else None
    print("read bandwidth: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in variants.items()), flush=True)
    result = {"device": device, "torch": torch.__version__, "read_gbps": read_gbps,
              "read_variants": variants, "shapes": [], "graph": {}}

    print(f"{'shape':<28} {'cuDNN':>22}   {'flash':>22}", flush=True)
    for b, skv in parse_shapes(args.shapes):
        rec = {"batch": b, "heads_q": hq, "heads_kv": hkv, "head_dim": d, "seqlen_q": sq,
               "seqlen_k": skv, "kv_bytes": 2 * b * hkv * skv * d * 2}
        try:
            sets, _ = make_sets(torch, b, hq, hkv, sq, skv, d, l2_bytes)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory
            sets, err = None, first_line(e)
        for key, enum in BACKENDS:
            if sets is None:
                rec[key] = {"error": err}
                continue
            rec[key] = measure(torch, bench_eager, getattr(SDPBackend, enum), sets, args.iters)
            if "us" in rec[key]:
                rec[key]["gbps"] = rec["kv_bytes"] / (rec[key]["us"] * 1e-6) / 1e9
        del sets
        torch.cuda.empty_cache()
        result["shapes"].append(rec)
        name = f"B{b} Hq{hq} Hkv{hkv} Sq{sq} Skv{skv} D{d}"
        print(f"{name:<28} {fmt(rec['sdpa_cudnn']):>22}   {fmt(rec['sdpa_flash']):>22}", flush=True)

    b, skv = GRAPH_SHAPE
    graph = result["graph"] = {"batch": b, "seqlen_k": skv}
    sets, kv_bytes = make_sets(torch, b, hq, hkv, sq, skv, d, l2_bytes)
    for key, enum in BACKENDS:
        r = graph[key] = measure(torch, bench_graph, getattr(SDPBackend, enum), sets, args.iters)
        extra = f" ({kv_bytes / (r['us'] * 1e-6) / 1e9:.0f} GB/s)" if "us" in r else ""
        print(f"CUDA graph B{b} Skv{skv} {key}: {fmt(r, False)}{extra}", flush=True)
    del sets
    torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"decode_sdpa_bench: wrote {args.json}")
    ok = any("us" in r.get(k, {}) for r in result["shapes"] for k, _ in BACKENDS)
    return 0 if ok else 1


def compare_fp8(ours, by_shape, peak, graph):
    """An e4m3 cache reads half the bytes: its figures are step times against SDPA's on
    the 16-bit cache of the same shape, and the bandwidth of what it does read (codes
    and scales)."""
    print(f"{'shape':<26} {'layout':<10} {'ours us':>8} {'cuDNN us':>8} {'flash us':>8} "
          f"{'x cuDNN':>7} {'x flash':>7} {'GB/s':>6} {'/read':>6} {'splits':>6}")
    for r in ours:
        if r.get("graph"):
            continue
        peer = by_shape.get((r["batch"], r["seqlen_k"]), {})
        cud = peer.get("sdpa_cudnn", {}).get("us", float("nan"))
        fla = peer.get("sdpa_flash", {}).get("us", float("nan"))
        layout = "contiguous" if r["page"] == 0 else f"page {r['page']}"
        shape = f"B{r['batch']} Hq{r['heads_q']} Hkv{r['heads_kv']} Skv{r['seqlen_k']}"
        print(f"{shape:<26} {layout:<10} {r['us']:>8.1f} {cud:>8.1f} {fla:>8.1f} "
              f"{cud / r['us']:>7.2f} {fla / r['us']:>7.2f} {r['gbps']:>6.0f} "
              f"{r['gbps'] / peak:>6.2f} {r['splits']:>6}")
    for r in ours:
        if r.get("graph"):
            cud = graph.get("sdpa_cudnn", {}).get("us", float("nan"))
            fla = graph.get("sdpa_flash", {}).get("us", float("nan"))
            print(f"CUDA graph B1 Skv8192 (e4m3 cache): ours {r['us']:.1f} us, cuDNN (f16) "
                  f"{cud:.1f} us, flash (f16) {fla:.1f} us")
    return 0


def compare(ours_path, sdpa_path):
    """Prints flashcore's decode figures (`flashcore decode --json`) beside this script's
    SDPA figures from the same run: GB/s of K+V, ratios, fraction of the read bandwidth."""
    with open(ours_path) as f:
        ours = json.load(f)
    with open(sdpa_path) as f:
        sdpa = json.load(f)
    peak = sdpa.get("read_gbps") or float("nan")
    print(f"read bandwidth (same run): {peak:.0f} GB/s")
    print(f"{'shape':<26} {'layout':<10} {'ours GB/s':>9} {'cuDNN':>7} {'flash':>7} "
          f"{'/cuDNN':>7} {'/flash':>7} {'/read':>6} {'splits':>6}")
    by_shape = {(r["batch"], r["seqlen_k"]): r for r in sdpa["shapes"]}
    if any(r.get("kv_dtype") == "e4m3" for r in ours):
        return compare_fp8(ours, by_shape, peak, sdpa.get("graph", {}))
    for r in ours:
        if r.get("graph"):
            continue
        peer = by_shape.get((r["batch"], r["seqlen_k"]), {})
        cud = peer.get("sdpa_cudnn", {}).get("gbps", float("nan"))
        fla = peer.get("sdpa_flash", {}).get("gbps", float("nan"))
        layout = "contiguous" if r["page"] == 0 else f"page {r['page']}"
        shape = f"B{r['batch']} Hq{r['heads_q']} Hkv{r['heads_kv']} Skv{r['seqlen_k']}"
        print(f"{shape:<26} {layout:<10} {r['gbps']:>9.0f} {cud:>7.0f} {fla:>7.0f} "
              f"{r['gbps'] / cud:>7.2f} {r['gbps'] / fla:>7.2f} {r['gbps'] / peak:>6.2f} "
              f"{r['splits']:>6}")
    g = sdpa.get("graph", {})
    for r in ours:
        if r.get("graph"):
            cud = g.get("sdpa_cudnn", {}).get("us", float("nan"))
            fla = g.get("sdpa_flash", {}).get("us", float("nan"))
            print(f"CUDA graph B1 Skv8192: ours {r['us']:.1f} us, cuDNN {cud:.1f} us, "
                  f"flash {fla:.1f} us")
    return 0


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        return compare(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--iters", type=int, default=100, help="timed calls per measurement (>= 50)")
    p.add_argument("--sq", type=int, default=1, help="query tokens per sequence (Sq)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BATCHxSEQLEN_K")
    p.add_argument("--heads-q", type=int, default=32)
    p.add_argument("--heads-kv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--read-gib", type=float, default=4.0, help="GiB read by the bandwidth probe")
    args = p.parse_args()
    if args.iters < 50:
        p.error("--iters must be >= 50")
    try:
        parse_shapes(args.shapes)
    except ValueError as e:
        p.error(f"--shapes: {e} (expected e.g. 1x8192,16x8192)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
