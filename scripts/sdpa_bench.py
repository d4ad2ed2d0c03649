#!/usr/bin/env python3
"""PyTorch SDPA baseline for flashcore, and the comparison table.

Usage:
    python3 sdpa_bench.py [--json OUT.json] [--dtype f16,bf16] [--backends flash,cudnn]
                          [--iters 50] [--budget-s 0.5] [--shapes small|all|hopper|padded]
    python3 sdpa_bench.py --compare ours.json sdpa.json

Measures torch.nn.functional.scaled_dot_product_attention restricted to one backend at a
time (torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION / CUDNN_ATTENTION)) on:

    B2 H8  S512   D64   non-causal
    B4 H32 S4096  D64   causal and non-causal
    B8 H16 S2048  D128  causal and non-causal
    B1 H16 S16384 D128  causal and non-causal

Inputs are random normal, layout [B, H, S, D], contiguous. Timing: one pair of CUDA events
around every call, after warm-up, with the launches queued behind a GPU sleep so host
overhead is not timed; the median over `iters` calls (at most --iters, fewer when the
shape is slow, aiming at --budget-s seconds per measurement, never fewer than 10). Calls
rotate over enough input sets that their total size exceeds twice the L2 cache, so small
shapes are not timed out of L2.

FLOPs = 4 * D * B * H * (visible (query, key) pairs). Non-causal: Sq * Sk pairs. Causal
(bottom-right aligned, as flashcore: row i sees keys j <= i + Sk - Sq):
sum over i in [0, Sq) of clamp(i + Sk - Sq + 1, 0, Sk) pairs, i.e. about half.
TFLOP/s = FLOPs / median time / 1e12.

JSON schema (a file is a JSON list of records; the Rust side writes the same records with
backend "flashcore"; unknown extra fields are ignored by --compare):

    {
      "batch":     int,               # B
      "heads":     int,               # Hq
      "kv_heads":  int,               # Hkv (== heads here; GQA when smaller)
      "seqlen_q":  int,               # Sq
      "seqlen_k":  int,               # Sk
      "head_dim":  int,               # D
      "causal":    bool,              # bottom-right aligned causal mask
      "dtype":     "f16" | "bf16",
      "backend":   "flash" | "cudnn" | "flashcore",
      "median_ms": float | null,      # null when "error" is set
      "tflops":    float | null,      # flops / (median_ms * 1e-3) / 1e12
      "flops":     int,               # optional: the FLOP count used
      "iters":     int,               # optional: timed calls
      "rel_err":   float | null,      # optional (flashcore): ||O - O_ref||_2 / ||O_ref||_2 against
                                      # float64; null where O has unwritten or non-finite elements
      "device":    str,               # optional: GPU name
      "error":     str                # optional: why there is no figure
    }

Records are matched in --compare on (batch, heads, kv_heads, seqlen_q, seqlen_k,
head_dim, causal, dtype). --compare also accepts the spellings heads_q / heads_kv and
dtype "float16" / "bfloat16" (see ALIASES), so older files still line up.
"""

import argparse
import json
import math
import statistics
import sys
import time

# (batch, heads, kv_heads, seqlen, head_dim, causal variants)
SHAPES = [
    (2, 8, 8, 512, 64, (False,)),
    (4, 32, 32, 4096, 64, (False, True)),
    (8, 16, 16, 2048, 128, (False, True)),
    (1, 16, 16, 16384, 128, (False, True)),
]


def hopper_shapes():
    """The Hopper forward's benchmark grid: D in {64, 128, 256} with H = 2048 / D and
    B * S = 16384 for S from 512 to 16384, causal and not; GQA B4 Hq32 Hkv8 S4096 D128;
    the reference shape B2 H8 S512 D64. `flashcore bench --shapes hopper` runs the same."""
    shapes = [(2, 8, 8, 512, 64, (False, True)), (4, 32, 8, 4096, 128, (False, True))]
    for d in (64, 128, 256):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            shapes.append((16384 // s, 2048 // d, 2048 // d, s, d, (False, True)))
    return shapes

def padded_shapes():
    """The head dims without an sm90 kernel of their own: D in {32, 40, 80, 96, 112, 160,
    192} at H = 16 and B * S = 16384 for S 2048 and 8192, causal and not.
    `flashcore bench --shapes padded` runs the same."""
    return [(16384 // s, 16, 16, s, d, (False, True))
            for d in (32, 40, 80, 96, 112, 160, 192) for s in (2048, 8192)]


BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
KEY_FIELDS = ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "causal", "dtype")


def visible_pairs(seqlen_q, seqlen_k, causal):
    """(query, key) pairs the mask lets through, bottom-right aligned when causal."""
    if not causal:
        return seqlen_q * seqlen_k
    off = seqlen_k - seqlen_q
    return sum(min(seqlen_k, max(0, i + off + 1)) for i in range(seqlen_q))


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal):
    return 4 * head_dim * batch * heads * visible_pairs(seqlen_q, seqlen_k, causal)


def first_line(e):
    s = f"{type(e).__name__}: {e}".strip()
    return s.splitlines()[0][:300] if s else type(e).__name__


# ---- measuring ----------------------------------------------------------------------------


def measure(torch, sdpa, backend_enum, b, h, hkv, sq, sk, d, causal, dtype, args, l2_bytes):
    """Returns (median_ms, iters); raises on any failure."""
    from torch.nn.attention import sdpa_kernel

    dev = "cuda"
    elem = torch.tensor([], dtype=dtype).element_size()
    set_bytes = (b * h * sq * d + 2 * b * hkv * sk * d) * elem
    n_sets = max(1, math.ceil(2 * l2_bytes / set_bytes))
    n_sets = min(n_sets, max(1, int(4e9 // set_bytes)))  # at most ~4 GB of inputs
    gen = torch.Generator(device=dev)
    gen.manual_seed(1234)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, h, sq, d, device=dev, dtype=dtype, generator=gen)
        k = torch.randn(b, hkv, sk, d, device=dev, dtype=dtype, generator=gen)
        v = torch.randn(b, hkv, sk, d, device=dev, dtype=dtype, generator=gen)
        sets.append((q, k, v))

    kwargs = {}
    if hkv != h:
        kwargs["enable_gqa"] = True
    if causal and sq != sk:
        from torch.nn.attention.bias import causal_lower_right

        kwargs["attn_mask"] = causal_lower_right(sq, sk)
    elif causal:
        kwargs["is_causal"] = True

    sleep = getattr(torch.cuda, "_sleep", None)

    with sdpa_kernel(backend_enum):
        # Warm-up (also surfaces "no available kernel" errors) and a first estimate.
        for i in range(3):
            q, k, v = sets[i % n_sets]
            sdpa(q, k, v, **kwargs)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n_est = 5
        for i in range(n_est):
            q, k, v = sets[i % n_sets]
            sdpa(q, k, v, **kwargs)
        torch.cuda.synchronize()
        est_s = (time.perf_counter() - t0) / n_est

        iters = args.iters
        if est_s > 0:
            iters = min(iters, max(10, math.ceil(args.budget_s / est_s)))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        if sleep is not None:
            # Keep the GPU busy while the host queues every call: ~60 us of host time per
            # call at ~1.5 GHz, so the events time the kernels, not the Python overhead.
            sleep(int(min(iters * 60e-6, 0.05) * 1.5e9))
        for i in range(iters):
            q, k, v = sets[i % n_sets]
            starts[i].record()
            sdpa(q, k, v, **kwargs)
            ends[i].record()
        torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    del sets
    return statistics.median(times), iters


def run_bench(args):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend
    except Exception as e:  # noqa: BLE001
        print(f"sdpa_bench: cannot import torch: {first_line(e)}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("sdpa_bench: torch sees no CUDA device", file=sys.stderr)
        return 1

    dtypes = [x.strip() for x in args.dtype.split(",") if x.strip()]
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 * 1024 * 1024
    device = torch.cuda.get_device_name(0)
    print(
        f"sdpa_bench: {device}, L2 {l2_bytes / 2**20:.0f} MiB, torch {torch.__version__}, "
        f"cuda {torch.version.cuda}, cudnn {torch.backends.cudnn.version()}",
        flush=True,
    )
    torch.backends.cuda.matmul.allow_tf32 = False

    shapes = {"small": SHAPES[:1], "all": SHAPES, "hopper": hopper_shapes(),
              "padded": padded_shapes()}[args.shapes]
    backends = [x.strip() for x in args.backends.split(",") if x.strip()]
    records = []
    for dname, b, h, hkv, s, d, causal in (
        (dn, b, h, hkv, s, d, c)
        for dn in dtypes
        for b, h, hkv, s, d, causals in shapes
        for c in causals
    ):
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[dname]
        if True:
            for name in backends:
                rec = {
                    "batch": b,
                    "heads": h,
                    "kv_heads": hkv,
                    "seqlen_q": s,
                    "seqlen_k": s,
                    "head_dim": d,
                    "causal": causal,
                    "dtype": dname,
                    "backend": name,
                    "median_ms": None,
                    "tflops": None,
                    "flops": attention_flops(b, h, s, s, d, causal),
                    "device": device,
                }
                try:
                    if name not in BACKENDS:
                        raise ValueError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
                    enum = getattr(SDPBackend, BACKENDS[name])
                    ms, iters = measure(
                        torch, F.scaled_dot_product_attention, enum, b, h, hkv, s, s, d, causal,
                        dtype, args, l2_bytes,
                    )
                    rec["median_ms"] = ms
                    rec["iters"] = iters
                    rec["tflops"] = rec["flops"] / (ms * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 - record every failure, keep going
                    rec["error"] = first_line(e)
                finally:
                    try:
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001
                        rec.setdefault("error", first_line(e))
                    torch.cuda.empty_cache()
                records.append(rec)
                if "error" in rec:
                    fig = f"error: {rec['error']}"
                else:
                    fig = f"{rec['median_ms']:9.4f} ms  {rec['tflops']:7.1f} TFLOP/s  ({rec['iters']} iters)"
                print(f"  {shape_name(rec):<24} {'causal' if causal else '      '}  {name:<6} {fig}", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
            f.write("\n")
        print(f"sdpa_bench: wrote {len(records)} records to {args.json}")
    ok = sum(1 for r in records if "error" not in r)
    print(f"sdpa_bench: {ok}/{len(records)} measurements ok")
    return 0 if ok > 0 else 1


# ---- comparing ----------------------------------------------------------------------------


def shape_name(r):
    s = f"B{r.get('batch')} H{r.get('heads')}"
    if r.get("kv_heads") not in (None, r.get("heads")):
        s += f" KV{r.get('kv_heads')}"
    if r.get("seqlen_q") == r.get("seqlen_k"):
        s += f" S{r.get('seqlen_q')}"
    else:
        s += f" Sq{r.get('seqlen_q')} Sk{r.get('seqlen_k')}"
    return s + f" D{r.get('head_dim')}"


def load_records(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        print(f"compare: {path}: missing", file=sys.stderr)
        return []
    except (OSError, ValueError) as e:
        print(f"compare: {path}: unreadable ({first_line(e)})", file=sys.stderr)
        return []
    if isinstance(data, dict):  # tolerate {"records": [...]} or {"results": [...]}
        data = data.get("records") or data.get("results") or []
    return [normalize(r) for r in data if isinstance(r, dict)]


# Other spellings --compare accepts for the key fields (first match wins).
ALIASES = {
    "heads": ("heads_q", "num_heads", "nheads", "h"),
    "kv_heads": ("heads_kv", "num_kv_heads", "nheads_kv", "hkv"),
    "seqlen_q": ("seqlen", "sq"),
    "seqlen_k": ("seqlen", "sk"),
    "head_dim": ("headdim", "d"),
    "batch": ("b", "batch_size"),
}
DTYPES = {"fp16": "f16", "float16": "f16", "half": "f16", "bfloat16": "bf16"}


def normalize(r):
    """The record with the canonical key fields filled in from known aliases."""
    r = dict(r)
    for field, alts in ALIASES.items():
        if r.get(field) is None:
            for a in alts:
                if r.get(a) is not None:
                    r[field] = r[a]
                    break
    if r.get("kv_heads") is None:
        r["kv_heads"] = r.get("heads")
    if r.get("seqlen_k") is None:
        r["seqlen_k"] = r.get("seqlen_q")
    r["causal"] = bool(r.get("causal"))
    r["dtype"] = DTYPES.get(r.get("dtype"), r.get("dtype"))
    return r


def key_of(r):
    return tuple(r.get(f) for f in KEY_FIELDS)


def tflops_of(r):
    if r is None or r.get("error"):
        return None
    t = r.get("tflops")
    if isinstance(t, (int, float)) and t > 0:
        return float(t)
    ms, flops = r.get("median_ms"), r.get("flops")
    if isinstance(ms, (int, float)) and ms > 0 and isinstance(flops, (int, float)):
        return flops / (ms * 1e-3) / 1e12
    return None


def compare(ours_path, sdpa_path):
    ours = load_records(ours_path)
    sdpa = load_records(sdpa_path)
    table = {}  # key -> {backend: record}
    order = []
    for r in ours + sdpa:
        k = key_of(r)
        if k not in table:
            table[k] = {}
            order.append(k)
        table[k][str(r.get("backend", "?"))] = r

    def cell(r, t):
        if r is None:
            return "-"
        if t is None:
            return "err"
        return f"{t:.1f}"

    def ratio(a, b):
        return f"{a / b:.2f}" if a is not None and b else "-"

    has_err = any("rel_err" in r for r in ours)
    head = ["shape", "causal", "dtype", "ours TF/s", "flash TF/s", "cuDNN TF/s", "ours/flash", "ours/cuDNN"]
    if has_err:
        head.append("rel_err")
    rows = []
    ratios = {"flash": [], "cudnn": []}
    errors = []
    for k in order:
        by = table[k]
        # Ours: "flashcore" (the best path) or a named one such as "flashcore-sm80".
        o = next((r for b, r in by.items() if b.startswith("flashcore")), None)
        fl, cu = by.get("flash"), by.get("cudnn")
        to, tf, tc = tflops_of(o), tflops_of(fl), tflops_of(cu)
        if to and tf:
            ratios["flash"].append(to / tf)
        if to and tc:
            ratios["cudnn"].append(to / tc)
        rec = dict(zip(KEY_FIELDS, k))
        row = [shape_name(rec), "yes" if rec["causal"] else "no", str(rec["dtype"]),
               cell(o, to), cell(fl, tf), cell(cu, tc), ratio(to, tf), ratio(to, tc)]
        if has_err:
            e = o.get("rel_err") if o else None
            row.append(f"{e:.2e}" if isinstance(e, (int, float)) else "-")
        rows.append(row)
        for name, r in (("ours", o), ("flash", fl), ("cudnn", cu)):
            if r is not None and r.get("error"):
                errors.append(f"{shape_name(rec)}{' causal' if rec['causal'] else ''} {name}: {r['error']}")

    widths = [max(len(x) for x in col) for col in zip(head, *rows)] if rows else [len(x) for x in head]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
    )
    for e in errors:
        print(f"error: {e}"[:240])
    print(fmt(head))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))
    geo = []
    for name, label in (("flash", "ours/flash"), ("cudnn", "ours/cuDNN")):
        v = ratios[name]
        if v:
            geo.append(f"{label} geomean {math.exp(sum(map(math.log, v)) / len(v)):.2f} over {len(v)}")
    print("; ".join(geo) if geo else "no shape has both figures")
    return 0 if rows else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records to this file")
    p.add_argument("--dtype", default="f16", help="comma list of: f16, bf16")
    p.add_argument("--backends", default="flash,cudnn", help="comma list of: flash, cudnn")
    p.add_argument("--iters", type=int, default=50, help="most timed calls per measurement")
    p.add_argument("--budget-s", type=float, default=0.5, help="aimed seconds per measurement")
    p.add_argument("--shapes", choices=["all", "small", "hopper", "padded"], default="all")
    p.add_argument("--compare", nargs=2, metavar=("OURS_JSON", "SDPA_JSON"),
                   help="print the comparison table of two record files and exit")
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.iters < 1:
        p.error("--iters must be >= 1")
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
