#!/usr/bin/env python3
"""cuBLAS baselines for flashcore's Hopper GEMM, and the comparison table.

Usage:
    python3 gemm_bench.py [--json OUT.json] [--m 8192 --n 8192 --k 8192] [--iters 30]
    python3 gemm_bench.py --compare ours.json cublas.json

Measures, on random normal inputs (never zeros), C = A @ B.T with A [M, K] and B [N, K]
row-major, as flashcore's kernel computes it:
    bf16, f16: torch.matmul (cuBLAS)
    e4m3:      torch._scaled_mm (cuBLASLt FP8, bf16 out, unit scales)
Timing: CUDA events around each call after warm-up, median of --iters calls.
TFLOP/s = 2*M*N*K / median time. The JSON records match `flashcore gemm --json`:
    {"op": "gemm", "m", "n", "k", "dtype", "backend": "cublas", "median_ms", "tflops"}
"""

import argparse
import json
import statistics
import sys


def time_ms(fn, iters):
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def measure(m, n, k, iters):
    import torch

    dev = "cuda"
    records = []
    for name, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(n, k, device=dev, dtype=dtype)
        ms = time_ms(lambda: torch.matmul(a, b.t()), iters)
        records.append((name, ms))
    a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0, device=dev)
    try:
        ms = time_ms(
            lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            iters,
        )
        records.append(("e4m3", ms))
    except Exception as e:  # an older torch without this signature
        print(f"torch._scaled_mm failed: {e}", file=sys.stderr)
    out = []
    for name, ms in records:
        tflops = 2.0 * m * n * k / (ms * 1e9)
        out.append(
            {
                "op": "gemm",
                "m": m,
                "n": n,
                "k": k,
                "dtype": name,
                "backend": "cublas",
                "median_ms": ms,
                "tflops": tflops,
                "device": torch.cuda.get_device_name(),
            }
        )
        print(f"cublas {name:<5} {m}x{n}x{k}: {ms:.4f} ms, {tflops:.1f} TFLOP/s")
    return out


def compare(ours_path, theirs_path):
    ours = {(r["m"], r["n"], r["k"], r["dtype"]): r for r in json.load(open(ours_path))}
    theirs = {(r["m"], r["n"], r["k"], r["dtype"]): r for r in json.load(open(theirs_path))}
    print("| M N K | dtype | flashcore TFLOP/s | cuBLAS TFLOP/s | ratio |")
    print("|---|---|---|---|---|")
    for key in sorted(ours):
        o = ours[key]
        t = theirs.get(key)
        ratio = f"{o['tflops'] / t['tflops']:.3f}" if t else "-"
        tt = f"{t['tflops']:.1f}" if t else "-"
        print(f"| {key[0]} {key[1]} {key[2]} | {key[3]} | {o['tflops']:.1f} | {tt} | {ratio} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--k", type=int, default=8192)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--compare", nargs=2)
    a = p.parse_args()
    if a.compare:
        compare(*a.compare)
        return
    records = measure(a.m, a.n, a.k, a.iters)
    if a.json:
        json.dump(records, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
