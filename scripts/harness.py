#!/usr/bin/env python3
"""flashcore next to PyTorch SDPA, through flashcore's C ABI (libflashcore.so via ctypes).

Usage (on a GPU machine with PyTorch; no cargo needed):

    python3 scripts/harness.py --lib target/release/libflashcore.so [--json OUT.json]
                               [--quick] [--budget-s 0.4] [--no-graph] [--package] [--decode]
                               [--kv-dtype e4m3] [--fp8]

The ctypes spelling of the C ABI comes from the Python package (python/flashcore/_capi.py,
installed or from this repository). With --package every flashcore call goes through
flashcore.attention, the torch op a PyTorch user calls (output allocation included), and
the library is the installed wheel's when there is one.

For every case it makes torch tensors in [B, H, S, D] layout (torch.randn, cuda), runs
flashcore_forward on them (the [B, H, S, D] strides passed in flashcore's logical
[B, S, H, D] order, on torch's current stream), and checks O against

  - a float64 reference computed by torch on the GPU (the whole problem when it is small,
    else one batch and two heads: the first and the last, so GQA groups are exercised), and
  - torch.nn.functional.scaled_dot_product_attention (default backend choice; enable_gqa
    for GQA; causal_lower_right for causal with Sq != Sk, comparing only rows that see at
    least one key since backends differ on fully masked rows).

Then it times ours, SDPA restricted to CUDNN_ATTENTION and SDPA restricted to
FLASH_ATTENTION with one method: warm-up; an estimate of the per-call time; then N calls
(N such that a measurement takes about --budget-s seconds, at least 10), one pair of CUDA
events around each call, queued in chunks behind a GPU sleep so that host overhead is not
timed; the median. Calls rotate over enough input copies (at least two) to exceed twice the L2 cache.
A backend that cannot run a case is reported as "n/a" with the reason.

FLOPs = 4 * B * Hq * D * (visible query-key pairs); causal masks are aligned bottom-right
(query i sees key j iff j <= i + Sk - Sq), and the pairs are counted exactly.

Last, a CUDA graph capturing 20 flashcore_forward calls (B2 H8 S512 D64) is replayed and
its per-call time reported next to the eager per-call time.

With --decode it compares decode against a KV cache instead (flashcore_decode, or
flashcore.decode with --package): Sq = 1, Hq 32, Hkv 8, D 128, f16, every sequence's
length the full Skv, for (B, Skv) in 1x8192, 1x32768, 16x8192, 64x4096 (--quick: 1x8192),
each with a contiguous cache [B, Skv, Hkv, D] and a paged one (pages of 16 in a shuffled
pool). SDPA (cuDNN, flash; enable_gqa) gets q and k, v as [B, H, S, D] views of the same
tensors (of the contiguous cache holding the same keys, for the paged case). O is checked
against float64 and SDPA as above; timing is the same method; the figure of merit is
GB/s = K+V bytes / median time.

With --decode --kv-dtype e4m3 the cache flashcore reads is an FP8 one (sm_89+): e4m3 codes
and one float32 scale per (position, KV head), written by flashcore's own append
(flashcore_append_kv_fp8kv, or flashcore.append_kv with --package) from the same 16-bit
keys and values SDPA reads, and decoded by flashcore_decode_fp8kv (flashcore.decode). O is
checked against float64 on the dequantized cache (codes times scales; 2e-2) and on the
original 16-bit data (E4M3's rounding: 8e-2), and against SDPA on the 16-bit data; our GB/s
counts the codes and scales read, SDPA's the 16-bit K and V.

With --fp8 it compares flashcore.attention_fp8 (the Python package: q, k, v quantized to
e4m3 with per-block scales by flashcore_quantize_fp8, then flashcore_forward_fp8; both
timed, output allocation included) with SDPA's 16-bit backends on the same 16-bit
tensors: head dims 64, 128 and 256, causal and not, GQA, Sq > Sk (--quick: two small
cases). O is checked against float64 at 8e-2 relative L2 (E4M3's rounding of q, k and v
alone costs about 5%) and for NaN; the time is flashcore's quantize + attention.

Prints progress to stderr and the table to stdout; --json writes everything, including a
"records" list in the format of scripts/sdpa_bench.py (so `sdpa_bench.py --compare` reads
it; decode records carry "page" and "gbps" instead of "tflops"). Exit status: 0 when every
flashcore call ran and matched the references, 1 when something failed, 2 when the
library, torch or the GPU is unusable.
"""

import argparse
import ctypes
import json
import math
import os
import statistics
import struct
import sys
import time
import warnings

# ---- the C ABI: spelled once, in the package (python/flashcore/_capi.py) -----------------

try:  # the installed package, else the one in this repository
    from flashcore._capi import FLASHCORE_SUCCESS, FlashcoreError, Library, describe, describe_cache, describe_scales
except ImportError:  # none installed, or an older one: this repository's, imported afresh
    for _name in [m for m in sys.modules if m == "flashcore" or m.startswith("flashcore.")]:
        del sys.modules[_name]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from flashcore._capi import FLASHCORE_SUCCESS, FlashcoreError, Library, describe, describe_cache, describe_scales


class Flashcore:
    """A flashcore context on one device, called through the C ABI (ctypes)."""

    def __init__(self, lib_path, device=0):
        self.capi = Library(lib_path)
        self.lib = self.capi.lib
        self.version = self.capi.version
        self.ctx = self.capi.create(device)

    def check(self, rc):
        self.capi.check(rc)

    def close(self):
        if getattr(self, "ctx", None):
            self.capi.destroy(self.ctx)
            self.ctx = None

    @staticmethod
    def describe(t):
        """A [B, H, S, D] torch tensor as a FlashcoreTensor (logical [B, S, H, D])."""
        import torch

        codes = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
        if t.dim() != 4:
            raise ValueError(f"expected a 4-d [B, H, S, D] tensor, got shape {tuple(t.shape)}")
        order = (0, 2, 1, 3)
        return describe(t.data_ptr(), codes.get(t.dtype, -1), [t.size(j) for j in order], [t.stride(j) for j in order])

    def prepare(self, q, k, v, o):
        """Descriptors built once, for calling forward_raw in a loop."""
        return tuple(ctypes.byref(self.describe(t)) for t in (q, k, v, o))

    def forward_raw(self, descs, lse_ptr, scale, causal, stream):
        q, k, v, o = descs
        return self.lib.flashcore_forward(self.ctx, q, k, v, o, lse_ptr, scale, 1 if causal else 0, stream)

    def forward(self, q, k, v, o, lse=None, scale=0.0, causal=False, stream=None):
        import torch

        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        lse_ptr = 0 if lse is None else lse.data_ptr()
        self.check(self.forward_raw(self.prepare(q, k, v, o), lse_ptr, scale, causal, stream))

    @staticmethod
    def describe_bshd(t):
        """A 4-d tensor already in flashcore's logical [B, S, H, D] order as a FlashcoreTensor
        (float8_e4m3fn as FLASHCORE_E4M3)."""
        import torch

        codes = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, getattr(torch, "float8_e4m3fn", None): 4}
        return describe(t.data_ptr(), codes.get(t.dtype, -1), list(t.shape), list(t.stride()))

    @classmethod
    def describe_cache(cls, k, v, seqlens, block_table, k_scale=None, v_scale=None):
        """(FlashcoreKvCache, FlashcoreKvScales or None): scales [outer, rows, Hkv] float32
        described as [outer, rows, Hkv, 1]."""
        if block_table is None:
            cache = describe_cache(cls.describe_bshd(k), cls.describe_bshd(v), seqlens.data_ptr())
        else:
            cache = describe_cache(cls.describe_bshd(k), cls.describe_bshd(v), seqlens.data_ptr(),
                                   block_table.data_ptr(), block_table.shape[1], block_table.stride(0))
        scales = None
        if k_scale is not None:
            scales = describe_scales(*(cls.describe_bshd(t.unsqueeze(-1)) for t in (k_scale, v_scale)))
        return cache, scales

    def prepare_decode(self, q, k, v, seqlens, block_table, o, k_scale=None, v_scale=None):
        """Arguments built once for calling decode_raw in a loop: q, o [B, Sq, Hq, D]; k, v a
        contiguous cache [B, Skv, Hkv, D] or page pools (e4m3 with k_scale, v_scale
        [outer, rows, Hkv]); int32 seqlens [B]; block_table None or int32 [B, max_pages].
        The workspace the plan needs comes from torch. The last element is the output
        tensor (after decode_raw)."""
        import torch

        qd, od = self.describe_bshd(q), self.describe_bshd(o)
        cache, scales = self.describe_cache(k, v, seqlens, block_table, k_scale, v_scale)
        ws_bytes = self.capi.decode_workspace_bytes(self.ctx, qd, cache, scales)
        ws = torch.empty(ws_bytes + 256, dtype=torch.uint8, device=q.device)
        ws_ptr = -(-ws.data_ptr() // 256) * 256 if ws_bytes else 0
        return (ctypes.byref(qd), ctypes.byref(cache), None if scales is None else ctypes.byref(scales),
                ctypes.byref(od), ws_ptr, ws_bytes, (qd, cache, scales, od, ws), o)

    def decode_raw(self, prepared, stream):
        q, cache, scales, o, ws_ptr, ws_bytes, _keep, _out = prepared
        if scales is None:
            return self.lib.flashcore_decode(self.ctx, q, cache, None, None, o, 0, 0.0, 0, ws_ptr, ws_bytes, stream)
        return self.lib.flashcore_decode_fp8kv(self.ctx, q, cache, scales, None, None, o, 0, 0.0, 0, ws_ptr, ws_bytes,
                                               stream)

    def append_kv(self, k, v, seqlens, k_new, v_new, block_table, k_scale=None, v_scale=None):
        """flashcore_append_kv (_fp8kv with scales) on torch's current stream."""
        import torch

        cache, scales = self.describe_cache(k, v, seqlens, block_table, k_scale, v_scale)
        self.capi.append_kv(self.ctx, cache, self.describe_bshd(k_new), self.describe_bshd(v_new), None, None,
                            torch.cuda.current_stream().cuda_stream, scales=scales)


class FlashcorePackage(Flashcore):
    """The same calls made the way a PyTorch user makes them: flashcore.attention (the
    torch.library op, which allocates its output) from the Python package."""

    def __init__(self, lib_path, device=0):
        import flashcore
        from flashcore import _capi

        if not os.path.isfile(_capi.default_lib_path()):
            os.environ[_capi.LIB_ENV] = lib_path  # a source tree, not an installed wheel
        self.attention = flashcore.attention
        self.version = flashcore.library_version()
        self.lib_path = _capi.library().path
        log(f"harness: flashcore package {os.path.dirname(flashcore.__file__)}, library {self.lib_path}")
        self.ctx = None

    def prepare(self, q, k, v, o):
        return (q, k, v)

    def forward_raw(self, descs, lse_ptr, scale, causal, stream):
        q, k, v = descs
        self.attention(q, k, v, causal=causal, scale=scale or None)
        return FLASHCORE_SUCCESS

    def forward(self, q, k, v, o, lse=None, scale=0.0, causal=False, stream=None):
        out, l = self.attention(q, k, v, causal=causal, scale=scale or None, return_lse=True)
        o.copy_(out)
        if lse is not None:
            lse.copy_(l)

    def prepare_decode(self, q, k, v, seqlens, block_table, o, k_scale=None, v_scale=None):
        return [q, k, v, seqlens, block_table, k_scale, v_scale, o]

    def decode_raw(self, prepared, stream):
        import flashcore

        q, k, v, seqlens, block_table, k_scale, v_scale, _ = prepared
        # It allocates its output.
        prepared[-1] = flashcore.decode(q, k, v, seqlens, block_table=block_table, k_scale=k_scale, v_scale=v_scale)
        return FLASHCORE_SUCCESS

    def append_kv(self, k, v, seqlens, k_new, v_new, block_table, k_scale=None, v_scale=None):
        import flashcore

        flashcore.append_kv(k, v, seqlens, k_new, v_new, block_table=block_table, k_scale=k_scale, v_scale=v_scale)


# ---- cases -------------------------------------------------------------------------------

BENCH_SHAPES = [(2, 8, 512, 64), (4, 32, 4096, 64), (8, 16, 2048, 128), (1, 16, 16384, 128)]


class Case:
    def __init__(self, b, hq, hkv, sq, sk, d, causal, dtype):
        self.b, self.hq, self.hkv, self.sq, self.sk, self.d = b, hq, hkv, sq, sk, d
        self.causal, self.dtype = causal, dtype

    def name(self):
        s = f"B{self.b} H{self.hq}"
        if self.hkv != self.hq:
            s += f" KV{self.hkv}"
        s += f" S{self.sq}" if self.sq == self.sk else f" Sq{self.sq} Sk{self.sk}"
        return s + f" D{self.d}"

    def label(self):
        return f"{self.name()} {self.dtype}{' causal' if self.causal else ''}"

    def flops(self):
        return 4 * self.b * self.hq * self.d * visible_pairs(self.sq, self.sk, self.causal)

    def key(self):
        return {
            "batch": self.b, "heads": self.hq, "kv_heads": self.hkv, "seqlen_q": self.sq,
            "seqlen_k": self.sk, "head_dim": self.d, "causal": self.causal, "dtype": self.dtype,
        }


def all_cases(quick):
    if quick:
        return [
            Case(2, 8, 8, 512, 512, 64, True, "f16"),
            Case(1, 4, 2, 200, 300, 128, True, "bf16"),
        ]
    cases = []
    for b, h, s, d in BENCH_SHAPES:
        for causal in (False, True):
            cases.append(Case(b, h, h, s, s, d, causal, "f16"))
    for causal in (False, True):
        cases.append(Case(8, 16, 16, 2048, 2048, 128, causal, "bf16"))
    for causal in (False, True):
        cases.append(Case(4, 32, 8, 4096, 4096, 128, causal, "f16"))
    for causal in (False, True):
        cases.append(Case(2, 16, 16, 1000, 3000, 128, causal, "f16"))
    cases.append(Case(2, 16, 16, 3000, 1000, 128, True, "f16"))  # rows that see no key
    return cases


def visible_pairs(sq, sk, causal):
    """(query, key) pairs the mask lets through: row i sees min(Sk, max(0, i + Sk - Sq + 1))."""
    if not causal:
        return sq * sk
    off = sk - sq
    return sum(min(sk, max(0, i + off + 1)) for i in range(sq))


def first_visible_row(case):
    """The first query row that sees at least one key."""
    return max(0, case.sq - case.sk) if case.causal else 0


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def default_scale(d):
    # flashcore's default: the float32 nearest to 1/sqrt(D).
    return f32(1.0 / math.sqrt(d))


def first_line(e):
    s = f"{type(e).__name__}: {e}".strip()
    return s.splitlines()[0][:300] if s else type(e).__name__


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---- references ----------------------------------------------------------------------------


def sdpa_kwargs(case):
    kw = {}
    if case.hkv != case.hq:
        kw["enable_gqa"] = True
    if case.causal and case.sq != case.sk:
        from torch.nn.attention.bias import causal_lower_right

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "will produce NaNs when seq_len_q > seq_len_kv"
            kw["attn_mask"] = causal_lower_right(case.sq, case.sk)
    elif case.causal:
        kw["is_causal"] = True
    return kw


def reference_f64(torch, case, q, k, v, batches, heads):
    """Float64 O [len(batches), len(heads), Sq, D] and LSE [.., Sq] on the GPU."""
    scale = default_scale(case.d)
    group = case.hq // case.hkv
    o = torch.empty(len(batches), len(heads), case.sq, case.d, dtype=torch.float64, device=q.device)
    lse = torch.empty(len(batches), len(heads), case.sq, dtype=torch.float64, device=q.device)
    rows = max(1, (1 << 26) // case.sk)  # at most 512 MiB of scores at a time
    cols = torch.arange(case.sk, device=q.device)[None, :]
    for bi, b in enumerate(batches):
        for hi, h in enumerate(heads):
            qh = q[b, h].double()
            kh = k[b, h // group].double()
            vh = v[b, h // group].double()
            for r0 in range(0, case.sq, rows):
                r1 = min(case.sq, r0 + rows)
                s = (qh[r0:r1] @ kh.T) * scale
                if case.causal:
                    i = torch.arange(r0, r1, device=q.device)[:, None]
                    s.masked_fill_(cols > i + (case.sk - case.sq), float("-inf"))
                m = s.amax(dim=1, keepdim=True)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                p = torch.exp(s - m)
                l = p.sum(dim=1, keepdim=True)
                out = (p @ vh) / torch.where(l > 0, l, torch.ones_like(l))
                o[bi, hi, r0:r1] = out
                lse[bi, hi, r0:r1] = (m + torch.log(l)).squeeze(1)
                del s, p, out
    return o, lse


def rel_l2(a, b):
    a = a.double()
    b = b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


TOLERANCE = {"f16": 5e-3, "bf16": 3e-2}  # rel L2 vs float64


def check_case(torch, fc, case, q, k, v):
    """Runs ours once and compares; returns a dict of error figures."""
    F = torch.nn.functional
    res = {}
    o = torch.full_like(q, float("nan"))
    lse = torch.full((case.b, case.hq, case.sq), float("nan"), dtype=torch.float32, device=q.device)
    fc.forward(q, k, v, o, lse=lse, causal=case.causal)
    torch.cuda.synchronize()
    r0 = first_visible_row(case)
    res["nonfinite_outputs"] = int((~torch.isfinite(o)).sum().item())
    if r0 > 0:
        res["masked_rows_zero"] = bool((o[:, :, :r0] == 0).all().item())
        res["masked_rows_lse_neg_inf"] = bool((lse[:, :, :r0] == float("-inf")).all().item())

    # float64 on the GPU: everything when small, else one batch and two heads.
    if case.b * case.hq * case.sq * case.sk <= (1 << 26):
        batches, heads = list(range(case.b)), list(range(case.hq))
        res["checked_slice"] = "all"
    else:
        batches, heads = [0], sorted({0, case.hq - 1})
        res["checked_slice"] = f"batch 0, heads {heads}"
    o_ref, lse_ref = reference_f64(torch, case, q, k, v, batches, heads)
    o_sl = o[batches][:, heads]
    res["rel_l2_vs_f64"] = rel_l2(o_sl, o_ref)
    vis_lse = lse[batches][:, heads][:, :, r0:].double()
    res["lse_max_abs_err"] = (vis_lse - lse_ref[:, :, r0:]).abs().max().item()

    # SDPA, default backend choice, rows that see a key.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o_sdpa = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs(case))
        torch.cuda.synchronize()
        res["rel_l2_vs_sdpa"] = rel_l2(o[:, :, r0:], o_sdpa[:, :, r0:])
        res["sdpa_rel_l2_vs_f64"] = rel_l2(o_sdpa[batches][:, heads][:, :, r0:], o_ref[:, :, r0:])
        del o_sdpa
    except Exception as e:  # noqa: BLE001
        res["sdpa_error"] = first_line(e)

    ok = res["nonfinite_outputs"] == 0 and res["rel_l2_vs_f64"] <= TOLERANCE[case.dtype]
    ok = ok and res.get("masked_rows_zero", True) and res.get("masked_rows_lse_neg_inf", True)
    ok = ok and res["lse_max_abs_err"] <= 1e-2
    res["ok"] = bool(ok)
    del o, lse, o_ref, lse_ref
    return res


# ---- timing ------------------------------------------------------------------------------


class Timer:
    """Per-call CUDA-event timing, queued behind a GPU sleep (same method for everyone)."""

    def __init__(self, torch, budget_s):
        self.torch = torch
        self.budget_s = budget_s
        self.sleep = getattr(torch.cuda, "_sleep", None)
        self.cycles_per_s = self._calibrate()

    def _calibrate(self):
        torch = self.torch
        if self.sleep is None:
            return None
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        self.sleep(1000)  # first call may load the kernel
        a.record()
        self.sleep(10_000_000)
        b.record()
        torch.cuda.synchronize()
        ms = a.elapsed_time(b)
        return 10_000_000 / (ms * 1e-3) if ms > 0 else None

    def measure(self, fn, n_sets):
        """fn(i) enqueues one call on the current stream using input set i % n_sets."""
        torch = self.torch
        for i in range(3):
            fn(i % n_sets)
        torch.cuda.synchronize()
        # Estimate GPU time and host time per call.
        n_est = 5
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        for i in range(n_est):
            fn(i % n_sets)
        host_s = (time.perf_counter() - t0) / n_est
        b.record()
        torch.cuda.synchronize()
        gpu_s = a.elapsed_time(b) * 1e-3 / n_est
        per_call = max(gpu_s, host_s, 1e-6)
        iters = max(10, min(20000, int(self.budget_s / per_call)))

        times = []
        chunk = 100
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(chunk)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(chunk)]
        t_start = time.perf_counter()
        i = 0
        while i < iters:
            n = min(chunk, iters - i)
            if self.sleep is not None and self.cycles_per_s:
                # Enough GPU sleep to cover queueing n calls with their events.
                sleep_s = min(0.2, n * (2 * host_s + 20e-6) + 1e-3)
                self.sleep(int(sleep_s * self.cycles_per_s))
            for j in range(n):
                starts[j].record()
                fn((i + j) % n_sets)
                ends[j].record()
            torch.cuda.synchronize()
            times.extend(starts[j].elapsed_time(ends[j]) for j in range(n))
            i += n
            if time.perf_counter() - t_start > 3 * self.budget_s and len(times) >= 10:
                break
        return statistics.median(times), len(times)


def input_sets(torch, case, dtype, l2_bytes, gen):
    elem = torch.tensor([], dtype=dtype).element_size()
    set_bytes = (2 * case.b * case.hq * case.sq + 2 * case.b * case.hkv * case.sk) * case.d * elem
    n_sets = max(2, math.ceil(2 * l2_bytes / set_bytes))
    n_sets = min(n_sets, max(1, int(4e9 // set_bytes)))
    sets = []
    for _ in range(n_sets):
        q = torch.randn(case.b, case.hq, case.sq, case.d, device="cuda", dtype=dtype, generator=gen)
        k = torch.randn(case.b, case.hkv, case.sk, case.d, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(case.b, case.hkv, case.sk, case.d, device="cuda", dtype=dtype, generator=gen)
        o = torch.empty_like(q)
        sets.append((q, k, v, o))
    return sets


def time_ours(torch, fc, timer, case, sets):
    descs = [fc.prepare(q, k, v, o) for q, k, v, o in sets]
    stream = torch.cuda.current_stream().cuda_stream
    failures = []

    def call(i):
        rc = fc.forward_raw(descs[i], 0, 0.0, case.causal, stream)
        if rc != FLASHCORE_SUCCESS and not failures:
            failures.append(rc)

    ms, iters = timer.measure(call, len(sets))
    if failures:
        fc.check(failures[0])
    return ms, iters


def time_sdpa(torch, timer, case, sets, backend_name):
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    kw = sdpa_kwargs(case)
    with sdpa_kernel(backend):
        # One trial call: a backend that cannot run the case says why in warnings.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                F.scaled_dot_product_attention(*sets[0][:3], **kw)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
                why = first_line(e)
                if reasons:
                    why += " | " + " | ".join(dict.fromkeys(reasons))
                raise NotAvailable(why[:600]) from e
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return timer.measure(lambda i: F.scaled_dot_product_attention(*sets[i][:3], **kw), len(sets))


class NotAvailable(Exception):
    pass


# ---- CUDA graph ----------------------------------------------------------------------------


def graph_test(torch, fc, timer):
    case = Case(2, 8, 8, 512, 512, 64, False, "f16")
    res = {"shape": case.name(), "dtype": case.dtype, "causal": case.causal, "calls_per_graph": 20}
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    q = torch.randn(case.b, case.hq, case.sq, case.d, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(case.b, case.hkv, case.sk, case.d, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(case.b, case.hkv, case.sk, case.d, device="cuda", dtype=torch.float16, generator=gen)
    o = torch.empty_like(q)
    descs = fc.prepare(q, k, v, o)
    n_calls = 20

    def eager_burst():
        stream = torch.cuda.current_stream().cuda_stream
        for _ in range(n_calls):
            fc.check(fc.forward_raw(descs, 0, 0.0, case.causal, stream))

    # Eager: the kernel is loaded, then per-call time of back-to-back calls.
    eager_burst()
    torch.cuda.synchronize()
    o_eager = o.clone()
    reps = 50
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        eager_burst()
    b.record()
    torch.cuda.synchronize()
    res["eager_us_per_call"] = a.elapsed_time(b) * 1e3 / (reps * n_calls)
    # The harness's timing method (one pair of events around each queued call).
    res["eager_event_us_per_call"] = timer.measure(
        lambda i: fc.check(fc.forward_raw(descs, 0, 0.0, case.causal, torch.cuda.current_stream().cuda_stream)), 1
    )[0] * 1e3

    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager_burst()  # warm up on the capture stream's kind of stream
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            eager_burst()  # current_stream() is the capture stream here
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        res["graph_matches_eager"] = bool(torch.equal(o, o_eager))
        g.replay()
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        res["graph_us_per_call"] = a.elapsed_time(b) * 1e3 / (reps * n_calls)
    except Exception as e:  # noqa: BLE001
        res["graph_error"] = first_line(e)
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
    return res


# ---- decode --------------------------------------------------------------------------------

DECODE_SHAPES = [(1, 8192), (1, 32768), (16, 8192), (64, 4096)]  # (B, Skv)
DECODE_PAGES = (0, 16)


class DecodeCase:
    """One decode step: Sq = 1 against a cache whose every sequence holds Skv positions."""

    def __init__(self, b, skv, page, hq=32, hkv=8, d=128, dtype="f16", kv="f16"):
        self.b, self.skv, self.page, self.hq, self.hkv, self.d, self.dtype = b, skv, page, hq, hkv, d, dtype
        self.kv = kv  # flashcore's cache: "f16" (the dtype's) or "e4m3" (codes and scales)

    def name(self):
        return f"B{self.b} Hq{self.hq} Hkv{self.hkv} Skv{self.skv} D{self.d}"

    def layout(self):
        return ("contiguous" if self.page == 0 else f"page{self.page}") + (" e4m3" if self.kv == "e4m3" else "")

    def kv_bytes_16(self):
        """Bytes of a 16-bit K and V (what SDPA reads)."""
        return 2 * self.b * self.skv * self.hkv * self.d * 2

    def kv_bytes(self):
        """Bytes of the cache flashcore reads: 16-bit K and V, or e4m3 codes and f32 scales."""
        if self.kv == "e4m3":
            return 2 * self.b * self.skv * self.hkv * (self.d + 4)
        return self.kv_bytes_16()

    def forward_case(self):
        """The same attention as a forward Case (what the references compute)."""
        return Case(self.b, self.hq, self.hkv, 1, self.skv, self.d, False, self.dtype)

    def key(self):
        key = {
            "batch": self.b, "heads": self.hq, "kv_heads": self.hkv, "seqlen_q": 1, "seqlen_k": self.skv,
            "head_dim": self.d, "causal": False, "dtype": self.dtype, "page": self.page,
        }
        if self.kv != "f16":
            key["kv_dtype"] = self.kv
        return key


def all_decode_cases(quick, kv="f16"):
    shapes = DECODE_SHAPES[:1] if quick else DECODE_SHAPES
    return [DecodeCase(b, skv, page, kv=kv) for b, skv in shapes for page in DECODE_PAGES]


def decode_sets(torch, fc, case, dtype, l2_bytes, gen):
    """At least two input sets, whose caches together exceed twice the L2 cache. Each is a
    dict: q, o [B, 1, Hq, D]; k, v the caches the kernels read (contiguous, or pools of shuffled
    pages; e4m3 codes for an FP8 case, with k_scale, v_scale [outer, rows, Hkv] float32,
    quantized by flashcore's append); keys, values the same (16-bit) contents as
    contiguous [B, Skv, Hkv, D]; seqlens; block_table (None when contiguous)."""
    # At least two sets: a cache larger than twice the L2 (B1 Skv 32768, 134 MB) alone in
    # the rotation would be read by every call right after the previous call left part
    # of it in L2.
    n_sets = max(2, math.ceil(2 * l2_bytes / case.kv_bytes()))
    n_sets = min(n_sets, max(1, int(8e9 // (case.kv_bytes_16() * (2 if case.page else 1)))))
    sets = []
    for _ in range(n_sets):
        keys = torch.randn(case.b, case.skv, case.hkv, case.d, device="cuda", dtype=dtype, generator=gen)
        values = torch.randn(case.b, case.skv, case.hkv, case.d, device="cuda", dtype=dtype, generator=gen)
        x = {
            "q": torch.randn(case.b, 1, case.hq, case.d, device="cuda", dtype=dtype, generator=gen),
            "keys": keys, "values": values, "k": keys, "v": values, "block_table": None,
            "seqlens": torch.full((case.b,), case.skv, dtype=torch.int32, device="cuda"),
        }
        x["o"] = torch.empty_like(x["q"])
        if case.page:
            pages = case.b * case.skv // case.page
            perm = torch.randperm(pages, device="cuda", generator=gen)
            x["block_table"] = perm.view(case.b, case.skv // case.page).int()
            x["k"] = torch.empty(pages, case.page, case.hkv, case.d, device="cuda", dtype=dtype)
            x["v"] = torch.empty_like(x["k"])
            x["k"][perm] = keys.view(pages, case.page, case.hkv, case.d)
            x["v"][perm] = values.view(pages, case.page, case.hkv, case.d)
        x["k_scale"] = x["v_scale"] = None
        if case.kv == "e4m3":
            # flashcore's own quantization: every position appended from length 0.
            outer, rows = x["k"].shape[:2]
            x["k"], x["v"] = (torch.empty(outer, rows, case.hkv, case.d, device="cuda", dtype=torch.float8_e4m3fn)
                              for _ in range(2))
            x["k_scale"], x["v_scale"] = (torch.empty(outer, rows, case.hkv, device="cuda", dtype=torch.float32)
                                          for _ in range(2))
            start = torch.zeros_like(x["seqlens"])
            fc.append_kv(x["k"], x["v"], start, keys, values, x["block_table"], x["k_scale"], x["v_scale"])
            torch.cuda.synchronize()
        sets.append(x)
    return sets


def dequantized(torch, case, x, batches):
    """An FP8 set's cache as float32 [len(batches), Skv, Hkv, D] (codes times scales), for
    the sequences `batches`."""
    out = []
    for codes, scales in ((x["k"], x["k_scale"]), (x["v"], x["v_scale"])):
        if case.page:
            pages = x["block_table"][batches].flatten().long()
            codes, scales = codes[pages], scales[pages]
        else:
            codes, scales = codes[batches], scales[batches]
        deq = codes.float() * scales[..., None]
        out.append(deq.reshape(len(batches), case.skv, case.hkv, case.d))
    return out


def bhsd(t):
    """A [B, S, H, D] tensor as the [B, H, S, D] view SDPA takes (no copy)."""
    return t.transpose(1, 2)


def check_decode_case(torch, fc, case, x):
    """Runs ours once on set x and compares with float64 and SDPA; a dict of figures."""
    F = torch.nn.functional
    fcase = case.forward_case()
    x["o"].fill_(float("nan"))
    prepared = fc.prepare_decode(x["q"], x["k"], x["v"], x["seqlens"], x["block_table"], x["o"], x["k_scale"],
                                 x["v_scale"])
    rc = fc.decode_raw(prepared, torch.cuda.current_stream().cuda_stream)
    if rc != FLASHCORE_SUCCESS:
        fc.check(rc)
    torch.cuda.synchronize()
    o = bhsd(prepared[-1])
    q, k, v = bhsd(x["q"]), bhsd(x["keys"]), bhsd(x["values"])
    res = {"nonfinite_outputs": int((~torch.isfinite(o)).sum().item())}
    if case.b * case.hq * case.skv <= (1 << 26):
        batches, heads = list(range(case.b)), list(range(case.hq))
        res["checked_slice"] = "all"
    else:
        batches, heads = [0, case.b - 1] if case.b > 1 else [0], sorted({0, case.hq - 1})
        res["checked_slice"] = f"batches {batches}, heads {heads}"
    o_ref, _ = reference_f64(torch, fcase, q, k, v, batches, heads)
    res["rel_l2_vs_f64"] = rel_l2(o[batches][:, heads], o_ref)
    if case.kv == "e4m3":
        # The kernel's own error: against float64 on the cache as it holds the values.
        kd, vd = (bhsd(t) for t in dequantized(torch, case, x, batches))
        o_deq, _ = reference_f64(torch, fcase, q[batches], kd, vd, list(range(len(batches))), heads)
        res["rel_l2_vs_dequantized_f64"] = rel_l2(o[batches][:, heads], o_deq)
        del kd, vd, o_deq
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o_sdpa = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()
        res["rel_l2_vs_sdpa"] = rel_l2(o, o_sdpa)
        del o_sdpa
    except Exception as e:  # noqa: BLE001
        res["sdpa_error"] = first_line(e)
    if case.kv == "e4m3":
        res["ok"] = bool(
            res["nonfinite_outputs"] == 0 and res["rel_l2_vs_f64"] <= FP8_TOLERANCE
            and res["rel_l2_vs_dequantized_f64"] <= max(FP8_CACHE_TOLERANCE, TOLERANCE[case.dtype])
        )
    else:
        res["ok"] = bool(res["nonfinite_outputs"] == 0 and res["rel_l2_vs_f64"] <= TOLERANCE[case.dtype])
    return res


def time_decode_ours(torch, fc, timer, sets):
    prepared = [fc.prepare_decode(x["q"], x["k"], x["v"], x["seqlens"], x["block_table"], x["o"], x["k_scale"],
                                  x["v_scale"]) for x in sets]
    stream = torch.cuda.current_stream().cuda_stream
    failures = []

    def call(i):
        rc = fc.decode_raw(prepared[i], stream)
        if rc != FLASHCORE_SUCCESS and not failures:
            failures.append(rc)

    ms, iters = timer.measure(call, len(sets))
    if failures:
        fc.check(failures[0])
    return ms, iters


def time_decode_sdpa(torch, timer, sets, backend_name):
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    views = [(bhsd(x["q"]), bhsd(x["keys"]), bhsd(x["values"])) for x in sets]
    with sdpa_kernel(getattr(SDPBackend, backend_name)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                F.scaled_dot_product_attention(*views[0], enable_gqa=True)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
                why = first_line(e)
                if reasons:
                    why += " | " + " | ".join(dict.fromkeys(reasons))
                raise NotAvailable(why[:600]) from e
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return timer.measure(lambda i: F.scaled_dot_product_attention(*views[i], enable_gqa=True), len(sets))


def fmt_us(r):
    if r is None:
        return "-"
    if "us" in r:
        return f"{r['us']:.1f}"
    return "n/a" if "na" in r else "err"


def fmt_speedup(ours, other):
    if ours and other and "us" in ours and "us" in other:
        return f"{other['us'] / ours['us']:.2f}"
    return "-"


def print_decode_table(results):
    head = ["shape", "cache", "ours us", "ours GB/s", "cuDNN us", "flash us", "cuDNN/ours", "flash/ours",
            "err f64", "err SDPA", "ok"]
    rows = []
    for r in results:
        ours = r.get("ours") or {}
        rows.append([
            r["shape"], r["cache"], fmt_us(r.get("ours")), f"{ours['gbps']:.0f}" if "gbps" in ours else "-",
            fmt_us(r.get("cudnn")), fmt_us(r.get("flash")),
            fmt_speedup(r.get("ours"), r.get("cudnn")), fmt_speedup(r.get("ours"), r.get("flash")),
            fmt_err(r.get("check", {}).get("rel_l2_vs_f64")), fmt_err(r.get("check", {}).get("rel_l2_vs_sdpa")),
            "yes" if r.get("ok") else "NO",
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(head), flush=True)
    print("  ".join("-" * w for w in widths), flush=True)
    for row in rows:
        print(line(row), flush=True)
    for r in results:
        for name in ("ours", "cudnn", "flash"):
            x = r.get(name) or {}
            why = x.get("na") or x.get("error")
            if why:
                print(f"  {r['shape']} {r['cache']} {name}: {'n/a' if 'na' in x else 'error'}: {why}"[:300], flush=True)
        if r.get("check", {}).get("sdpa_error"):
            print(f"  {r['shape']} {r['cache']}: SDPA reference: {r['check']['sdpa_error']}"[:300], flush=True)


def run_decode(torch, fc, timer, env, quick, kv="f16"):
    """The decode comparison; returns (results, records, all_ok)."""
    cases = all_decode_cases(quick, kv)
    results, records, all_ok = [], [], True
    for n, case in enumerate(cases, 1):
        log(f"[{n}/{len(cases)}] decode {case.name()} {case.layout()}")
        r = {"shape": case.name(), "cache": case.layout(), "case": case.key(), "kv_bytes": case.kv_bytes()}
        gen = torch.Generator(device="cuda")
        gen.manual_seed(2000 + n)
        sets = None
        try:
            sets = decode_sets(torch, fc, case, torch.float16, env["l2_bytes"], gen)
            r["input_sets"] = len(sets)
            try:
                r["check"] = check_decode_case(torch, fc, case, sets[0])
                r["ok"] = r["check"]["ok"]
            except Exception as e:  # noqa: BLE001
                r["check"] = {"error": first_line(e)}
                r["ok"] = False
            for name, backend in (("ours", None), ("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION")):
                try:
                    if backend is None:
                        ms, iters = time_decode_ours(torch, fc, timer, sets)
                    else:
                        ms, iters = time_decode_sdpa(torch, timer, sets, backend)
                    read = case.kv_bytes() if backend is None else case.kv_bytes_16()  # SDPA reads 16-bit K, V
                    r[name] = {"median_ms": ms, "iters": iters, "us": ms * 1e3, "gbps": read / (ms * 1e6)}
                except NotAvailable as e:
                    r[name] = {"na": str(e)}
                except Exception as e:  # noqa: BLE001
                    r[name] = {"error": first_line(e)}
                try:
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    r[name].setdefault("error", first_line(e))
        except Exception as e:  # noqa: BLE001
            r["error"] = first_line(e)
            r["ok"] = False
        finally:
            sets = None
            torch.cuda.empty_cache()
        if "us" not in (r.get("ours") or {}):
            r["ok"] = False
        all_ok = all_ok and r["ok"]
        for name, backend in (("ours", "flashcore"), ("cudnn", "cudnn"), ("flash", "flash")):
            x = r.get(name) or {"error": r.get("error", "not run")}
            rec = dict(case.key(), backend=backend, device=env["device"], median_ms=x.get("median_ms"),
                       gbps=x.get("gbps"))
            if "na" in x or "error" in x:
                rec["error"] = x.get("na") or x.get("error")
            if name == "ours" and isinstance(r.get("check", {}).get("rel_l2_vs_f64"), float):
                rec["rel_err"] = r["check"]["rel_l2_vs_f64"]
            records.append(rec)
        chk = r.get("check", {})
        log(f"    ours {fmt_us(r.get('ours'))}  cuDNN {fmt_us(r.get('cudnn'))}  flash {fmt_us(r.get('flash'))} us; "
            f"err f64 {fmt_err(chk.get('rel_l2_vs_f64'))}, SDPA {fmt_err(chk.get('rel_l2_vs_sdpa'))}"
            f"{'' if r['ok'] else '  <-- FAILED'}")
        results.append(r)
    return results, records, all_ok


# ---- FP8 -------------------------------------------------------------------------------------

FP8_TOLERANCE = 8e-2  # rel L2 vs float64: E4M3's rounding of q, k and v alone costs ~5%
FP8_CACHE_TOLERANCE = 2e-2  # rel L2 vs float64 on the dequantized FP8 cache (the kernel's own error)


def all_fp8_cases(quick):
    if quick:
        return [
            Case(2, 8, 8, 512, 512, 64, True, "f16"),
            Case(1, 4, 2, 200, 300, 128, True, "bf16"),
        ]
    cases = []
    for b, h, s, d in ((4, 16, 4096, 128), (2, 16, 8192, 128), (4, 32, 4096, 64), (4, 8, 4096, 256)):
        for causal in (False, True):
            cases.append(Case(b, h, h, s, s, d, causal, "f16"))
    for causal in (False, True):
        cases.append(Case(4, 32, 8, 4096, 4096, 128, causal, "bf16"))
    cases.append(Case(2, 16, 16, 3000, 1000, 128, True, "f16"))  # rows that see no key
    return cases


def check_fp8_case(torch, case, q, k, v):
    import flashcore

    o = flashcore.attention_fp8(q, k, v, causal=case.causal, layout="bhsd")
    torch.cuda.synchronize()
    small = case.b * case.hq * case.sq * case.sk <= (1 << 26)
    batches = list(range(case.b)) if small else [0]
    heads = list(range(case.hq)) if small else sorted({0, case.hq - 1})
    want, _ = reference_f64(torch, case, q, k, v, batches, heads)
    got = o[batches][:, heads]
    finite = bool(torch.isfinite(o).all().item())
    err = rel_l2(got, want)
    return {"rel_l2_vs_f64": err, "finite": finite, "ok": finite and err < FP8_TOLERANCE}


def run_fp8(torch, timer, env, quick):
    """The FP8 comparison; returns (results, records, all_ok)."""
    import flashcore

    cases = all_fp8_cases(quick)
    results, records, all_ok = [], [], True
    for n, case in enumerate(cases, 1):
        log(f"[{n}/{len(cases)}] fp8 {case.label()}")
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
        flops = case.flops()
        r = {"shape": case.name(), "case": case.key(), "flops": flops}
        gen = torch.Generator(device="cuda")
        gen.manual_seed(3000 + n)
        sets = None
        try:
            sets = input_sets(torch, case, dtype, env["l2_bytes"], gen)
            r["input_sets"] = len(sets)
            try:
                r["check"] = check_fp8_case(torch, case, *sets[0][:3])
                r["ok"] = r["check"]["ok"]
            except Exception as e:  # noqa: BLE001
                r["check"] = {"error": first_line(e)}
                r["ok"] = False
            for name, backend in (("ours", None), ("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION")):
                try:
                    if backend is None:
                        ms, iters = timer.measure(
                            lambda i: flashcore.attention_fp8(*sets[i][:3], causal=case.causal, layout="bhsd"),
                            len(sets))
                    else:
                        ms, iters = time_sdpa(torch, timer, case, sets, backend)
                    r[name] = {"median_ms": ms, "iters": iters, "tflops": flops / (ms * 1e-3) / 1e12}
                except NotAvailable as e:
                    r[name] = {"na": str(e)}
                except Exception as e:  # noqa: BLE001
                    r[name] = {"error": first_line(e)}
                try:
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    r[name].setdefault("error", first_line(e))
        except Exception as e:  # noqa: BLE001
            r["error"] = first_line(e)
            r["ok"] = False
        finally:
            sets = None
            torch.cuda.empty_cache()
        if "tflops" not in (r.get("ours") or {}):
            r["ok"] = False
        all_ok = all_ok and r["ok"]
        for name, backend in (("ours", "flashcore-fp8"), ("cudnn", "cudnn"), ("flash", "flash")):
            x = r.get(name) or {"error": r.get("error", "not run")}
            rec = dict(case.key(), backend=backend, flops=flops, device=env["device"],
                       median_ms=x.get("median_ms"), tflops=x.get("tflops"))
            if "na" in x or "error" in x:
                rec["error"] = x.get("na") or x.get("error")
            if name == "ours" and isinstance(r.get("check", {}).get("rel_l2_vs_f64"), float):
                rec["rel_err"] = r["check"]["rel_l2_vs_f64"]
            records.append(rec)
        chk = r.get("check", {})
        log(f"    ours {fmt_tf(r.get('ours'))}  cuDNN {fmt_tf(r.get('cudnn'))}  flash {fmt_tf(r.get('flash'))} "
            f"TFLOP/s; err f64 {fmt_err(chk.get('rel_l2_vs_f64'))}{'' if r['ok'] else '  <-- FAILED'}")
        results.append(r)
    return results, records, all_ok


def print_fp8_table(results):
    print("| case | mask | flashcore FP8 (quantize + attention) TFLOP/s | SDPA cuDNN 16-bit | SDPA flash 16-bit "
          "| FP8 / cuDNN | FP8 / flash | rel L2 vs float64 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        c = r["case"]
        chk = r.get("check", {})
        print(f"| {r['shape']} {c['dtype']} | {'causal' if c['causal'] else 'full'} | {fmt_tf(r.get('ours'))} | "
              f"{fmt_tf(r.get('cudnn'))} | {fmt_tf(r.get('flash'))} | {fmt_ratio(r.get('ours'), r.get('cudnn'))} | "
              f"{fmt_ratio(r.get('ours'), r.get('flash'))} | {fmt_err(chk.get('rel_l2_vs_f64'))}"
              f"{'' if r.get('ok') else ' FAILED'} |", flush=True)


# ---- main ----------------------------------------------------------------------------------


def fmt_tf(r):
    if r is None:
        return "-"
    if "tflops" in r:
        return f"{r['tflops']:.1f}"
    return "n/a" if "na" in r else "err"


def fmt_ratio(a, b):
    if a and b and "tflops" in a and "tflops" in b:
        return f"{a['tflops'] / b['tflops']:.2f}"
    return "-"


def fmt_err(x):
    return f"{x:.2e}" if isinstance(x, (int, float)) else "-"


def print_table(results):
    head = ["shape", "dtype", "causal", "ours TF/s", "cuDNN TF/s", "flash TF/s", "ours/cuDNN",
            "ours/flash", "err f64", "err SDPA", "ok"]
    rows = []
    for r in results:
        c = r["case"]
        rows.append([
            r["shape"], c["dtype"], "yes" if c["causal"] else "no",
            fmt_tf(r.get("ours")), fmt_tf(r.get("cudnn")), fmt_tf(r.get("flash")),
            fmt_ratio(r.get("ours"), r.get("cudnn")), fmt_ratio(r.get("ours"), r.get("flash")),
            fmt_err(r.get("check", {}).get("rel_l2_vs_f64")), fmt_err(r.get("check", {}).get("rel_l2_vs_sdpa")),
            "yes" if r.get("ok") else "NO",
        ])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(head), flush=True)
    print("  ".join("-" * w for w in widths), flush=True)
    for row in rows:
        print(line(row), flush=True)
    for r in results:
        for name in ("ours", "cudnn", "flash"):
            x = r.get(name) or {}
            why = x.get("na") or x.get("error")
            label = f"  {r['shape']} {r['case']['dtype']}{' causal' if r['case']['causal'] else ''} {name}"
            if why:
                print(f"{label}: {'n/a' if 'na' in x else 'error'}: {why}"[:300], flush=True)
            elif x.get("note"):
                print(f"{label}: note: {x['note']}", flush=True)
        if r.get("check", {}).get("sdpa_error"):
            print(f"  {r['shape']}: SDPA reference: {r['check']['sdpa_error']}"[:300], flush=True)
    geo = []
    for name, label in (("cudnn", "ours/cuDNN"), ("flash", "ours/flash")):
        v = [r["ours"]["tflops"] / r[name]["tflops"] for r in results
             if "tflops" in (r.get("ours") or {}) and "tflops" in (r.get(name) or {})]
        if v:
            geo.append(f"{label} geomean {math.exp(sum(map(math.log, v)) / len(v)):.2f} over {len(v)}")
    if geo:
        print("; ".join(geo), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", required=True, help="path to libflashcore.so")
    p.add_argument("--json", help="write all results to this file")
    p.add_argument("--quick", action="store_true", help="two small cases only (smoke test)")
    p.add_argument("--budget-s", type=float, default=0.4, help="aimed seconds per timing")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA graph test")
    p.add_argument("--package", action="store_true",
                   help="call flashcore through the Python package's flashcore.attention (the torch op) "
                        "instead of the C ABI directly; no CUDA graph test")
    p.add_argument("--decode", action="store_true",
                   help="compare decode against a KV cache (flashcore_decode / flashcore.decode) instead of "
                        "the forward")
    p.add_argument("--kv-dtype", choices=("f16", "e4m3"), default="f16",
                   help="with --decode: the cache flashcore reads, 16-bit (default) or FP8 (e4m3 codes with "
                        "per-(position, head) scales, quantized by flashcore's append; sm_89+)")
    p.add_argument("--fp8", action="store_true",
                   help="compare flashcore.attention_fp8 (quantize + FP8 attention, through the Python package) "
                        "with SDPA's 16-bit backends")
    args = p.parse_args()
    if args.kv_dtype != "f16" and not args.decode:
        p.error("--kv-dtype applies to --decode")

    try:
        import torch
    except Exception as e:  # noqa: BLE001
        log(f"harness: cannot import torch: {first_line(e)}")
        return 2
    if not torch.cuda.is_available():
        log("harness: torch sees no CUDA device")
        return 2
    torch.cuda.set_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.init()
    try:
        fc = (FlashcorePackage if args.package or args.fp8 else Flashcore)(args.lib, args.device)
    except (OSError, FlashcoreError) as e:
        log(f"harness: cannot use {args.lib}: {first_line(e)}")
        return 2

    props = torch.cuda.get_device_properties(args.device)
    l2_bytes = getattr(props, "L2_cache_size", 0) or 60 * 1024 * 1024
    env = {
        "device": torch.cuda.get_device_name(args.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "flashcore": fc.version,
        "l2_bytes": l2_bytes,
        "budget_s": args.budget_s,
    }
    log(f"harness: {env['device']}, L2 {l2_bytes / 2**20:.0f} MiB, torch {env['torch']}, cuda {env['cuda']}, "
        f"cudnn {env['cudnn']}, flashcore {env['flashcore']}")
    timer = Timer(torch, args.budget_s)

    if args.fp8:
        results, records, all_ok = run_fp8(torch, timer, env, args.quick)
        print(f"flashcore.attention_fp8 (Python package) {env['flashcore']} vs PyTorch SDPA 16-bit on {env['device']} "
              f"(torch {env['torch']}, cuDNN {env['cudnn']}); TFLOP/s = 4*B*Hq*D*visible pairs / median time",
              flush=True)
        print_fp8_table(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "fp8": results, "records": records}, f, indent=1)
                f.write("\n")
            log(f"harness: wrote {args.json}")
        fc.close()
        log(f"harness: {sum(1 for r in results if r.get('ok'))}/{len(results)} FP8 cases ok")
        return 0 if all_ok else 1

    if args.decode:
        results, records, all_ok = run_decode(torch, fc, timer, env, args.quick, args.kv_dtype)
        fp8kv = args.kv_dtype == "e4m3"
        via = "flashcore.decode (Python package)" if args.package else (
            "flashcore_decode_fp8kv (C ABI)" if fp8kv else "flashcore_decode (C ABI)")
        what = ("ours: FP8 cache, GB/s = codes + scales bytes / median time; SDPA: the 16-bit K, V" if fp8kv
                else "GB/s = K+V bytes / median time")
        print(f"{via} {env['flashcore']} vs PyTorch SDPA on {env['device']} (torch {env['torch']}, "
              f"cuDNN {env['cudnn']}); decode Sq=1, {what}", flush=True)
        print_decode_table(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"env": env, "decode": results, "records": records}, f, indent=1)
                f.write("\n")
            log(f"harness: wrote {args.json}")
        fc.close()
        log(f"harness: {sum(1 for r in results if r.get('ok'))}/{len(results)} decode cases ok")
        return 0 if all_ok else 1

    cases = all_cases(args.quick)
    results = []
    records = []
    all_ok = True
    for n, case in enumerate(cases, 1):
        log(f"[{n}/{len(cases)}] {case.label()}")
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[case.dtype]
        flops = case.flops()
        r = {"shape": case.name(), "case": case.key(), "flops": flops}
        gen = torch.Generator(device="cuda")
        gen.manual_seed(1000 + n)
        sets = q = k = v = None
        try:
            sets = input_sets(torch, case, dtype, l2_bytes, gen)
            r["input_sets"] = len(sets)
            q, k, v, _ = sets[0]
            try:
                r["check"] = check_case(torch, fc, case, q, k, v)
                r["ok"] = r["check"]["ok"]
            except Exception as e:  # noqa: BLE001
                r["check"] = {"error": first_line(e)}
                r["ok"] = False
            for name, backend in (("ours", None), ("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION")):
                try:
                    if backend is None:
                        ms, iters = time_ours(torch, fc, timer, case, sets)
                    else:
                        ms, iters = time_sdpa(torch, timer, case, sets, backend)
                    r[name] = {"median_ms": ms, "iters": iters, "tflops": flops / (ms * 1e-3) / 1e12}
                    if name == "cudnn" and case.causal and case.sq != case.sk:
                        # torch's CausalBias has no cuDNN fast path: it materializes the mask.
                        r[name]["note"] = "lower-right causal through a materialized boolean mask"
                except NotAvailable as e:
                    r[name] = {"na": str(e)}
                except Exception as e:  # noqa: BLE001
                    r[name] = {"error": first_line(e)}
                try:
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    r[name].setdefault("error", first_line(e))
        except Exception as e:  # noqa: BLE001
            r["error"] = first_line(e)
            r["ok"] = False
        finally:
            sets = q = k = v = None
            torch.cuda.empty_cache()
        if "tflops" not in (r.get("ours") or {}):
            r["ok"] = False
        all_ok = all_ok and r["ok"]
        for name, backend in (("ours", "flashcore"), ("cudnn", "cudnn"), ("flash", "flash")):
            x = r.get(name) or {"error": r.get("error", "not run")}
            rec = dict(case.key(), backend=backend, flops=flops, device=env["device"],
                       median_ms=x.get("median_ms"), tflops=x.get("tflops"))
            if "iters" in x:
                rec["iters"] = x["iters"]
            if "note" in x:
                rec["note"] = x["note"]
            if "na" in x or "error" in x:
                rec["error"] = x.get("na") or x.get("error")
            if name == "ours" and isinstance(r.get("check", {}).get("rel_l2_vs_f64"), float):
                rec["rel_err"] = r["check"]["rel_l2_vs_f64"]
            records.append(rec)
        chk = r.get("check", {})
        log(f"    ours {fmt_tf(r.get('ours'))}  cuDNN {fmt_tf(r.get('cudnn'))}  flash {fmt_tf(r.get('flash'))} "
            f"TFLOP/s; err f64 {fmt_err(chk.get('rel_l2_vs_f64'))}, SDPA {fmt_err(chk.get('rel_l2_vs_sdpa'))}"
            f"{'' if r['ok'] else '  <-- FAILED'}")
        results.append(r)

    graph = None
    if not args.no_graph and not args.package:
        log("[graph] CUDA graph of 20 flashcore_forward calls, B2 H8 S512 D64")
        try:
            graph = graph_test(torch, fc, timer)
        except Exception as e:  # noqa: BLE001
            graph = {"error": first_line(e)}
        if "graph_error" in graph or "error" in graph or not graph.get("graph_matches_eager", False):
            all_ok = False

    via = "flashcore.attention (Python package)" if args.package else "flashcore (C ABI)"
    print(f"{via} {env['flashcore']} vs PyTorch SDPA on {env['device']} (torch {env['torch']}, "
          f"cuDNN {env['cudnn']}); TFLOP/s = 4*B*Hq*D*visible pairs / median time", flush=True)
    print_table(results)
    if graph is not None:
        if "graph_us_per_call" in graph:
            print(f"CUDA graph, {graph['shape']} f16, 20 calls/graph: {graph['graph_us_per_call']:.2f} us/call "
                  f"replayed vs {graph['eager_us_per_call']:.2f} us/call eager back-to-back "
                  f"({graph['eager_event_us_per_call']:.2f} us/call with per-call events); "
                  f"replay matches eager: {graph.get('graph_matches_eager')}", flush=True)
        else:
            print(f"CUDA graph: failed: {graph.get('graph_error') or graph.get('error')}", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "cases": results, "graph": graph, "records": records}, f, indent=1)
            f.write("\n")
        log(f"harness: wrote {args.json}")
    fc.close()
    n_ok = sum(1 for r in results if r.get("ok"))
    log(f"harness: {n_ok}/{len(results)} cases ok" + ("" if graph is None else
        f"; graph {'ok' if graph.get('graph_matches_eager') else 'FAILED'}"))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
