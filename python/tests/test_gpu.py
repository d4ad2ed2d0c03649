"""flashcore.attention on a GPU: against float64 and SDPA over a grid of shapes, dtypes,
layouts and GQA ratios; views read in place; streams; torch.compile; CUDA graphs."""

import math

import pytest
import torch
import torch.nn.functional as F

import flashcore
from flashcore import FlashcoreError

from conftest import poison_allocator, requires_gpu

pytestmark = requires_gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # relative L2 against float64


def rel_l2(a, b):
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def visible(sq, sk, causal, window=(-1, -1), device="cuda"):
    """[Sq, Sk] bool, the explicit mask: query i, whose diagonal is key d = i + Sk - Sq,
    sees key j iff j <= d (causal) and d - left <= j <= d + right (window_size (left,
    right), a negative side unbounded)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    d = i + (sk - sq)
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        seen &= j <= d
    left, right = window
    if left >= 0:
        seen &= j >= d - left
    if right >= 0:
        seen &= j <= d + right
    return seen


def reference(q, k, v, causal, scale=None, window=(-1, -1), softcap=0.0):
    """Float64 O and LSE for [B, H, S, D] inputs, bottom-right causal, a key window
    (FlashAttention's window_size), the scaled scores x capped to softcap · tanh(x /
    softcap) before masking (0: no cap), GQA by head count; rows that see no key: zeros,
    -inf."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if causal or window != (-1, -1):
        s = s.masked_fill(~visible(sq, sk, causal, window, q.device), -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p @ vv) / torch.where(l > 0, l, torch.ones_like(l))
    return o, (m + torch.log(l)).squeeze(-1)


def make(b, hq, hkv, sq, sk, d, dtype, layout="bhsd"):
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
    if layout == "bshd":  # real [B, S, H, D] memory
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v


def to_bhsd(t, layout):
    return t if layout == "bhsd" else t.transpose(1, 2)


CASES = [
    # b, hq, hkv, sq, sk, d
    (1, 4, 4, 1, 1, 64),
    (2, 4, 4, 17, 17, 128),
    (1, 8, 2, 113, 300, 128),
    (2, 8, 1, 300, 113, 64),
    (1, 8, 8, 1, 1023, 256),
    (1, 32, 4, 16, 4097, 128),
    (1, 4, 4, 1023, 1023, 96),
    (2, 16, 2, 257, 257, 192),
    (1, 16, 2, 2048, 2048, 128),
    # Decode-shaped (up to 16 queries against 1536 keys or more): the split-KV decode kernels.
    (3, 8, 8, 1, 1536, 64),
    # Head dims without a kernel of their own: padded onto the next larger kernel (on Hopper
    # an sm90a one, elsewhere an sm80 one).
    (2, 8, 8, 77, 333, 40),
    (1, 8, 2, 300, 129, 80),
    (2, 4, 4, 1, 17, 160),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_float64_and_sdpa(case, dtype, layout, causal, seed):
    b, hq, hkv, sq, sk, d = case
    q, k, v = make(b, hq, hkv, sq, sk, d, dtype, layout)
    poison_allocator(((b, hq, sq, d), dtype), ((b, hq, sq), torch.float32))
    o, lse = flashcore.attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and o.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32

    qb, kb, vb, ob = (to_bhsd(t, layout) for t in (q, k, v, o))
    o_ref, lse_ref = reference(qb, kb, vb, causal)
    first = max(0, sq - sk) if causal else 0  # rows before it see no key
    assert torch.isfinite(ob).all()
    assert (ob[:, :, :first] == 0).all() and (lse[:, :, :first] == -math.inf).all()
    err = rel_l2(ob, o_ref)
    assert err <= TOLERANCE[dtype], f"rel L2 {err:.2e}"
    assert (lse[:, :, first:].double() - lse_ref[:, :, first:]).abs().max().item() <= 1e-2

    if sq - first > 0:
        mask = None
        if causal and sq != sk:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(sq, sk)
        o_sdpa = F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=causal and sq == sk, attn_mask=mask, enable_gqa=hq != hkv
        )
        assert rel_l2(ob[:, :, first:], o_sdpa[:, :, first:]) <= TOLERANCE[dtype]


def test_eager_fast_path_equals_the_registered_op(seed):
    q, k, v = make(2, 8, 2, 333, 444, 128, torch.bfloat16)
    direct = flashcore.attention(q, k, v, causal=True, return_lse=True)
    via_op = torch.ops.flashcore.attention(q, k, v, True, 0.0, "bhsd", "bhsd", True)
    assert torch.equal(direct[0], via_op[0]) and torch.equal(direct[1], via_op[1])


def test_explicit_scale_and_lse(seed):
    q, k, v = make(1, 4, 2, 100, 200, 64, torch.float16)
    o, lse = flashcore.attention(q, k, v, scale=0.3, return_lse=True)
    o_ref, lse_ref = reference(q, k, v, False, scale=0.3)
    assert rel_l2(o, o_ref) <= TOLERANCE[torch.float16]
    assert (lse.double() - lse_ref).abs().max().item() <= 1e-2


def test_views_are_read_in_place(seed, monkeypatch):
    from flashcore import ops

    b, s, h, d = 2, 333, 8, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)  # a fused projection
    q, k, v = qkv.unbind(2)  # [B, S, H, D] views with a row stride of 3*H*D
    copies = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **kw: copies.append(t.shape) or real_clone(t, *a, **kw))
    o = flashcore.attention(q, k, v, causal=True, layout="bshd")
    monkeypatch.undo()
    assert copies == [], f"copied {copies}"
    assert all(ops.kernel_ready(t) for t in (q, k, v))
    o_ref, _ = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)
    assert rel_l2(o.transpose(1, 2), o_ref) <= TOLERANCE[torch.bfloat16]


def test_unreadable_views_are_copied_and_still_right(seed):
    wide = torch.randn(1, 4, 200, 256, device="cuda", dtype=torch.float16)
    q = wide[..., ::2]  # head dim stride 2
    k = torch.randn(1, 4, 200, 130, device="cuda", dtype=torch.float16)[..., 1:129]  # starts 2 bytes in
    v = torch.randn(1 + 4 * 200 * 128, device="cuda", dtype=torch.float16)[1:].view(1, 4, 200, 128)  # 2 B in
    assert flashcore.ops.kernel_ready(v) and v.data_ptr() % 16 != 0
    o = flashcore.attention(q, k, v)
    o_ref, _ = reference(q, k, v, False)
    assert rel_l2(o, o_ref) <= TOLERANCE[torch.float16]


def test_empty_problems():
    q, k, v = make(1, 4, 4, 5, 9, 64, torch.float16)
    o, lse = flashcore.attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert (o == 0).all() and (lse == -math.inf).all()
    o = flashcore.attention(q[:, :, :0], k, v)
    assert o.shape == (1, 4, 0, 64)


def test_errors_carry_flashcore_messages():
    q, k, v = make(1, 4, 4, 64, 64, 64, torch.float16)
    with pytest.raises(FlashcoreError) as e:
        flashcore.attention(q, k.bfloat16(), v.bfloat16())
    assert e.value.name == "FLASHCORE_ERROR_UNSUPPORTED_DTYPE" and "share one dtype" in str(e.value)
    q6, _, _ = make(1, 6, 4, 64, 64, 64, torch.float16)
    with pytest.raises(FlashcoreError, match="HEAD_RATIO"):
        flashcore.attention(q6, k, v)
    # 44 is no multiple of 8 (48 runs, padded onto the 64 kernel).
    q44, k44, v44 = make(1, 4, 4, 64, 64, 44, torch.float16)
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_HEAD_DIM"):
        flashcore.attention(q44, k44, v44)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashcore.attention(q, k.cpu(), v)


def test_runs_on_the_current_stream(seed):
    q, k, v = make(2, 8, 2, 1024, 1024, 128, torch.float16)
    expected = flashcore.attention(q * 2, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms: q2 is written long after this is queued
        q2 = q * 2
        o = flashcore.attention(q2, k, v)  # must wait for q2: same stream
    side.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(o, expected)


def test_threads_share_a_device(seed):
    """Four threads, each on a stream of its own, call one device's flashcore context at
    once (a kernel no earlier test loaded is wanted by several threads together): forward
    calls of several shapes, each checked against float64 after the threads end."""
    import threading

    shapes = [(1, 8, 2, 113, 300, 64), (2, 4, 4, 257, 257, 128), (1, 8, 8, 1, 1536, 64), (1, 4, 1, 64, 1023, 96)]
    results, errors = [], []
    start = threading.Barrier(4)

    def worker(t):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                start.wait()
                for i in range(6):
                    b, hq, hkv, sq, sk, d = shapes[(t + i) % len(shapes)]
                    dtype = (torch.float16, torch.bfloat16)[(t + i) % 2]
                    causal = i % 3 == 0
                    q, k, v = make(b, hq, hkv, sq, sk, d, dtype)
                    o = flashcore.attention(q, k, v, causal=causal)
                    results.append((t, i, q, k, v, causal, o, stream))
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(results) == 24
    for t, i, q, k, v, causal, o, stream in results:
        stream.synchronize()
        err = rel_l2(o.float(), reference(q, k, v, causal)[0])
        assert err <= TOLERANCE[q.dtype], f"thread {t} call {i}: rel L2 {err:.2e}"


def test_torch_compile(seed):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(512, 3 * 512, device="cuda", dtype=torch.float16)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.proj(x).view(b, s, 3, 8, 64).unbind(2)
            return flashcore.attention(q, k, v, causal=True, layout="bshd").reshape(b, s, 512)

    block = Block()
    x = torch.randn(2, 300, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True)(x)
    assert rel_l2(compiled, eager) <= 1e-3


# B2 H8: 64 query tiles, one block each; B4 H16: 256, which on a Hopper the blocks take
# from a tile counter the call allocates and zeroes on the stream (captured as well).
# B2 Hq32/8 Sq1 Sk4096: a decode-shaped call, which runs on the split-KV decode kernels and
# their merge, with partial results the call allocates on the stream.
@pytest.mark.parametrize(
    "batch,heads,kv_heads,sq,sk", [(2, 8, 8, 512, 512), (4, 16, 16, 512, 512), (2, 32, 8, 1, 4096)]
)
def test_cuda_graph_capture_and_replay(seed, batch, heads, kv_heads, sq, sk):
    q, k, v = make(batch, heads, kv_heads, sq, sk, 64, torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashcore.attention(q, k, v, causal=True)  # warm-up: loads the kernel
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = flashcore.attention(q, k, v, causal=True)
    for _ in range(3):  # new inputs in the captured buffers each time
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, _ = reference(q, k, v, True)
        assert rel_l2(o, o_ref) <= TOLERANCE[torch.float16]


# ---- key windows: sliding-window (local) attention ------------------------------------------------

WINDOW_CASES = [
    # b, hq, hkv, sq, sk, d
    (1, 4, 4, 1, 1, 64),
    (2, 8, 2, 17, 17, 128),
    (1, 8, 2, 113, 300, 64),
    (2, 4, 1, 300, 113, 128),  # Sq > Sk: early rows' windows hold no key
    (1, 8, 8, 1, 1023, 128),
    (1, 16, 2, 1023, 1023, 64),
    (3, 8, 8, 1, 1536, 64),  # decode-shaped: the split-KV decode kernels
    (1, 8, 2, 16, 4097, 128),
]

# (causal, window_size): causal sliding windows (left = keys - 1), windows on one side or
# both without causal masking, one wider than every sequence.
WINDOWS = [
    (True, (0, 0)),
    (True, (1, 0)),
    (True, (16, 0)),
    (True, (100, -1)),
    (False, (100, -1)),
    (False, (-1, 5)),
    (False, (50, 7)),
    (False, (0, 0)),
    (True, (5000, 0)),
]


def check_windowed(o, lse, o_ref, lse_ref, dtype):
    """o [B, H, S, D] and lse [B, H, S] against the float64 reference: rows whose window holds
    no key are zeros with LSE -inf, the others close."""
    assert torch.isfinite(o).all(), "non-finite output"
    blind = torch.isneginf(lse_ref)
    assert (lse[blind] == -math.inf).all(), "a row that sees no key has LSE -inf"
    assert (o[blind] == 0).all(), "a row that sees no key gives zeros"
    err = rel_l2(o, o_ref)
    assert err <= TOLERANCE[dtype], f"rel L2 {err:.2e}"
    if (~blind).any():
        assert (lse[~blind].double() - lse_ref[~blind]).abs().max().item() <= 1e-2


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal, window", WINDOWS, ids=lambda x: str(x).replace(" ", ""))
def test_windows_match_float64_and_an_explicit_mask(case, dtype, causal, window, seed):
    b, hq, hkv, sq, sk, d = case
    q, k, v = make(b, hq, hkv, sq, sk, d, dtype)
    poison_allocator(((b, hq, sq, d), dtype), ((b, hq, sq), torch.float32))
    o, lse = flashcore.attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (b, hq, sq)
    o_ref, lse_ref = reference(q, k, v, causal, window=window)
    check_windowed(o, lse, o_ref, lse_ref, dtype)
    # SDPA in float32 with the window as an explicit boolean mask, on the rows that see a key.
    mask = visible(sq, sk, causal, window)
    seen = mask.any(-1)
    if seen.any():
        o_sdpa = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=hq != hkv
        )
        assert rel_l2(o[:, :, seen], o_sdpa[:, :, seen]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_windows_in_both_layouts_and_as_the_registered_op(layout, seed):
    q, k, v = make(2, 8, 2, 200, 333, 128, torch.bfloat16, layout)
    o = flashcore.attention(q, k, v, causal=True, layout=layout, window_size=(31, 0))
    qb, kb, vb = (to_bhsd(t, layout) for t in (q, k, v))
    o_ref, _ = reference(qb, kb, vb, True, window=(31, 0))
    assert rel_l2(to_bhsd(o, layout), o_ref) <= TOLERANCE[torch.bfloat16]
    via_op, _ = torch.ops.flashcore.attention(q, k, v, True, 0.0, layout, layout, False, 31, 0)
    assert torch.equal(via_op, o)


def test_windows_that_bound_nothing_are_the_plain_call(seed):
    # (-1, -1), any negative sides, and sides past every key (left >= Sk, right >= Sq): the
    # call without a window, bit for bit.
    q, k, v = make(2, 8, 2, 100, 250, 64, torch.float16)
    for causal in (False, True):
        plain = flashcore.attention(q, k, v, causal=causal)
        for window in ((-1, -1), (-5, -100), (250, 100), (2**62, -1)):
            if causal and window[1] > 0:
                window = (window[0], 0)
            assert torch.equal(flashcore.attention(q, k, v, causal=causal, window_size=window), plain), window
    # A right side of 0 without causal masking is causal masking.
    assert torch.equal(flashcore.attention(q, k, v, window_size=(-1, 0)), flashcore.attention(q, k, v, causal=True))


def test_window_errors_launch_nothing(seed):
    q, k, v = make(1, 4, 4, 64, 64, 64, torch.float16)
    with pytest.raises(FlashcoreError) as e:
        flashcore.attention(q, k, v, causal=True, window_size=(16, 1))
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "right side" in str(e.value)
    assert e.value.message.startswith("flashcore_forward_window: ")
    # The FP8 forward has no window: refused there (its functions take no window_size).
    with pytest.raises(TypeError):
        flashcore.attention_fp8(q, k, v, causal=True, window_size=(16, 0))


def test_windows_under_torch_compile_and_cuda_graphs(seed):
    q, k, v = make(2, 8, 2, 128, 512, 128, torch.float16)

    def f(q, k, v):
        return flashcore.attention(q * 2, k, v, causal=True, window_size=(63, 0)) + 1

    with torch.no_grad():
        eager = f(q, k, v)
        compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert rel_l2(compiled, eager) <= 1e-3
    out = flashcore.attention(q, k, v, causal=True, window_size=(63, 0))  # loads the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashcore.attention(q, k, v, causal=True, window_size=(63, 0))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    o_ref, _ = reference(q, k, v, True, window=(63, 0))
    assert rel_l2(captured, o_ref) <= TOLERANCE[torch.float16]
    assert not torch.equal(captured, out)


# ---- serving: decode, append_kv, merge --------------------------------------------------------
#
# Cache positions past a sequence's length, and pool pages no sequence uses, hold +-200: a
# kernel that reads them where it should not fails by far.


def garbage(*shape, dtype):
    return torch.where(torch.rand(*shape, device="cuda") < 0.5, 200.0, -200.0).to(dtype)


class Cache:
    """A KV cache on the GPU with the logical contents of each sequence.

    keys, values: [B, capacity, Hkv, D], position-major per sequence (what decode must see
    for positions below the length; garbage above it). k, v: what the kernels get: copies
    of them (contiguous), or page pools [pages, page, Hkv, D] holding them in shuffled
    pages among spare garbage pages, with block_table [B, capacity / page]."""

    def __init__(self, b, capacity, hkv, d, dtype, lens, page=0):
        self.keys = torch.randn(b, capacity, hkv, d, device="cuda", dtype=dtype)
        self.values = torch.randn(b, capacity, hkv, d, device="cuda", dtype=dtype)
        for i, n in enumerate(lens):
            self.keys[i, n:] = garbage(capacity - n, hkv, d, dtype=dtype)
            self.values[i, n:] = garbage(capacity - n, hkv, d, dtype=dtype)
        self.lens = list(lens)
        self.seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.page = page
        if page == 0:
            self.k, self.v, self.block_table = self.keys.clone(), self.values.clone(), None
            return
        assert capacity % page == 0
        max_pages = capacity // page
        pool_pages = b * max_pages + b * max_pages // 2 + 1
        self.block_table = torch.randperm(pool_pages, device="cuda")[: b * max_pages].view(b, max_pages).int()
        self.k = garbage(pool_pages, page, hkv, d, dtype=dtype)
        self.v = garbage(pool_pages, page, hkv, d, dtype=dtype)
        self.sync_pool()

    def sync_pool(self):
        """Writes the logical contents into the pages the block table names."""
        if self.page:
            b, cap, hkv, d = self.keys.shape
            pages = self.block_table.flatten().long()
            self.k[pages] = self.keys.view(-1, self.page, hkv, d)
            self.v[pages] = self.values.view(-1, self.page, hkv, d)

    def logical(self):
        """(keys, values) as the kernels' memory holds them now: gathered through the table."""
        if self.page == 0:
            return self.k, self.v
        b, cap, hkv, d = self.keys.shape
        pages = self.block_table.flatten().long()
        return self.k[pages].view(b, cap, hkv, d), self.v[pages].view(b, cap, hkv, d)

    def host(self):
        """Host copies of the metadata, as decode/append_kv take them."""
        table = None if self.block_table is None else self.block_table.cpu()
        return dict(host_seqlens=self.seqlens.cpu(), host_block_table=table)


def decode_reference(q, keys, values, lens, causal, scale=None, window=(-1, -1), softcap=0.0):
    """Float64 O [B, Sq, Hq, D] and LSE [B, Hq, Sq] of decode: q [B, Sq, Hq, D]; sequence b
    attends to positions 0 .. lens[b] - 1 of keys[b], values[b] ([capacity, Hkv, D]);
    query i of Sq is position lens[b] - Sq + i, the diagonal of causal masking and of the
    key window; scores capped at softcap (0: none)."""
    b, sq, hq, d = q.shape
    o = torch.zeros(b, sq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64, device=q.device)
    for i, n in enumerate(lens):
        if n == 0:
            continue  # no key: zeros and -inf
        oi, li = reference(
            q[i : i + 1].transpose(1, 2), keys[i : i + 1, :n].transpose(1, 2), values[i : i + 1, :n].transpose(1, 2),
            causal, scale, window, softcap,
        )
        o[i] = oi[0].transpose(0, 1)
        lse[i] = li[0]
    return o, lse


def assert_decode_close(o, lse, o_ref, lse_ref, dtype):
    assert torch.isfinite(o).all(), "non-finite output"
    # Per sequence, the worst: one norm over the batch lets short sequences (whose rows
    # are large) hide a long one's error, and the long ones run the splits and the merge.
    err = max(rel_l2(o[i], o_ref[i]) for i in range(o.shape[0]))
    assert err <= TOLERANCE[dtype], f"rel L2 {err:.2e} (worst sequence)"
    seen = torch.isfinite(lse_ref)
    assert (lse[~seen] == -math.inf).all(), "a row that sees no key has LSE -inf"
    assert (o.transpose(1, 2)[~seen] == 0).all(), "a row that sees no key gives zeros"
    if seen.any():
        assert (lse[seen].double() - lse_ref[seen]).abs().max().item() <= 1e-2


DECODE_CASES = [
    # hq, hkv, d, sq, lens
    (32, 8, 128, 1, (1, 7, 4097, 300)),
    (16, 2, 64, 4, (1000, 16, 0)),
    (8, 8, 256, 16, (33, 500)),
    (8, 1, 96, 2, (3000,)),
    (4, 4, 32, 1, (5, 64)),
    (8, 2, 192, 3, (2, 777)),
    # Prefill chunks after a cached prefix (past 16 queries: the forward kernels where they
    # read the cache), one sequence shorter than its queries.
    (8, 2, 128, 100, (40, 1500)),
    (16, 4, 64, 300, (300, 2000)),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "Hq{}Hkv{}D{}Sq{}lens{}".format(*c[:4], "-".join(map(str, c[4]))))
@pytest.mark.parametrize("page", [0, 16, 64], ids=["contiguous", "page16", "page64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decode_matches_float64(case, page, dtype, causal, seed):
    hq, hkv, d, sq, lens = case
    b = len(lens)
    capacity = -(-(max(lens) + 5) // 64) * 64
    cache = Cache(b, capacity, hkv, d, dtype, lens, page)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    poison_allocator(((b, sq, hq, d), dtype), ((b, hq, sq), torch.float32))
    o, lse = flashcore.decode(
        q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=causal, return_lse=True,
        **cache.host(),
    )
    assert o.shape == q.shape and o.dtype == dtype and o.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    o_ref, lse_ref = decode_reference(q, cache.keys, cache.values, lens, causal)
    assert_decode_close(o, lse, o_ref, lse_ref, dtype)


DECODE_WINDOW_CASES = [
    # hq, hkv, d, sq, lens
    (32, 8, 128, 1, (1, 7, 4097, 300)),
    (16, 2, 64, 4, (1000, 16, 0)),
    (8, 8, 128, 16, (33, 500)),
    (8, 1, 64, 2, (3000,)),
]

DECODE_WINDOWS = [(True, (15, 0)), (True, (0, 0)), (True, (4095, 0)), (False, (100, -1)), (False, (7, 3))]


@pytest.mark.parametrize("case", DECODE_WINDOW_CASES,
                         ids=lambda c: "Hq{}Hkv{}D{}Sq{}lens{}".format(*c[:4], "-".join(map(str, c[4]))))
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal, window", DECODE_WINDOWS, ids=lambda x: str(x).replace(" ", ""))
def test_decode_windows_match_float64(case, page, dtype, causal, window, seed):
    # Garbage past each length and in unused pages, as in test_decode_matches_float64: the
    # window's keys are the only ones that may reach the output.
    hq, hkv, d, sq, lens = case
    b = len(lens)
    capacity = -(-(max(lens) + 5) // 64) * 64
    cache = Cache(b, capacity, hkv, d, dtype, lens, page)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dtype)
    poison_allocator(((b, sq, hq, d), dtype), ((b, hq, sq), torch.float32))
    o, lse = flashcore.decode(
        q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=causal, return_lse=True,
        window_size=window, **cache.host(),
    )
    o_ref, lse_ref = decode_reference(q, cache.keys, cache.values, lens, causal, window=window)
    assert_decode_close(o, lse, o_ref, lse_ref, dtype)
    # Without host copies: the same kernels, the same result.
    again = flashcore.decode(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=causal,
                             window_size=window)
    assert torch.equal(again, o)


def test_decode_window_steps_in_a_cuda_graph(seed):
    # A sliding-window decode step (append, advance, decode) captured once and replayed as
    # the sequences grow past the window: each replay sees the last 64 positions.
    dtype, hq, hkv, d, window = torch.float16, 8, 2, 128, 64
    cache = Cache(2, 512, hkv, d, dtype, (10, 100), 16)
    q = torch.randn(2, 1, hq, d, device="cuda", dtype=dtype)
    k_new = torch.randn(2, 1, hkv, d, device="cuda", dtype=dtype)
    v_new = torch.randn(2, 1, hkv, d, device="cuda", dtype=dtype)

    def step():
        flashcore.append_kv(cache.k, cache.v, cache.seqlens, k_new, v_new, block_table=cache.block_table)
        cache.seqlens.add_(1)
        return flashcore.decode(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=True,
                                window_size=(window - 1, 0))

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(60):
        graph.replay()
    torch.cuda.synchronize()
    lens = cache.seqlens.tolist()
    assert lens == [10 + 61, 100 + 61]
    keys, values = cache.logical()
    o_ref, _ = decode_reference(q, keys, values, lens, True, window=(window - 1, 0))
    assert rel_l2(out, o_ref) <= TOLERANCE[dtype]


def test_decode_views_scale_and_the_registered_op(seed):
    # q a [B, Sq, Hq, D] view of a [B, Hq, Sq, D] tensor; an explicit scale; op == eager.
    cache = Cache(2, 512, 4, 128, torch.bfloat16, (300, 9), 16)
    q = torch.randn(2, 8, 3, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    o, lse = flashcore.decode(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, scale=0.05,
                              causal=True, return_lse=True)
    o_ref, lse_ref = decode_reference(q, cache.keys, cache.values, cache.lens, True, scale=0.05)
    assert_decode_close(o, lse, o_ref, lse_ref, torch.bfloat16)
    via_op = torch.ops.flashcore.decode(q, cache.k, cache.v, cache.seqlens, cache.block_table, None, None, True, 0.05,
                                        True)
    assert torch.equal(via_op[0], o) and torch.equal(via_op[1], lse)


def test_decode_host_metadata_turns_bad_values_into_errors():
    cache = Cache(2, 128, 2, 64, torch.float16, (100, 50), 16)
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.float16)
    args = (q, cache.k, cache.v, cache.seqlens)
    table = cache.block_table.cpu()
    with pytest.raises(FlashcoreError) as e:
        flashcore.decode(*args, block_table=cache.block_table, host_seqlens=[100, 129], host_block_table=table)
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "capacity" in str(e.value)
    bad = table.clone()
    bad[0, 1] = cache.k.shape[0]  # one past the pool
    with pytest.raises(FlashcoreError, match="outside the pool"):
        flashcore.decode(*args, block_table=cache.block_table, host_seqlens=[100, 50], host_block_table=bad)
    # A paged cache's host lengths without its host table: refused before the library.
    with pytest.raises(ValueError, match="need host_block_table too"):
        flashcore.decode(*args, block_table=cache.block_table, host_seqlens=[100, 50])
    # Without host copies the same device values are only clamped: nothing outside the cache.
    cache.seqlens.copy_(torch.tensor([1 << 28, -5], dtype=torch.int32))
    o = flashcore.decode(*args, block_table=cache.block_table)
    torch.cuda.synchronize()
    assert torch.isfinite(o[0]).all() and (o[1] == 0).all()


@pytest.mark.parametrize("page", [0, 16, 1], ids=["contiguous", "page16", "page1"])
def test_append_then_decode(page, seed):
    dtype, hq, hkv, d, snew = torch.float16, 8, 2, 128, 3
    lens = [5, 0, 30]
    cache = Cache(3, 48, hkv, d, dtype, lens, page)
    k_before, v_before = (t.clone() for t in (cache.k, cache.v))
    k_new = torch.randn(3, snew, hkv, d, device="cuda", dtype=dtype)
    v_new = torch.randn(3, snew, hkv, d, device="cuda", dtype=dtype)
    flashcore.append_kv(cache.k, cache.v, cache.seqlens, k_new, v_new, block_table=cache.block_table, **cache.host())
    # Exactly the new rows changed, at each sequence's length; the lengths did not move.
    assert cache.seqlens.tolist() == lens
    for i, n in enumerate(lens):
        cache.keys[i, n : n + snew] = k_new[i]
        cache.values[i, n : n + snew] = v_new[i]
    keys, values = cache.logical()
    assert torch.equal(keys, cache.keys) and torch.equal(values, cache.values)
    if page:  # and nothing else in the pool
        used = torch.zeros(cache.k.shape[0], dtype=torch.bool, device="cuda")
        used[cache.block_table.flatten().long()] = True
        assert torch.equal(cache.k[~used], k_before[~used]) and torch.equal(cache.v[~used], v_before[~used])
    # Advance the lengths: a causal decode of the new tokens sees them.
    cache.seqlens += snew
    new_lens = [n + snew for n in lens]
    q = torch.randn(3, snew, hq, d, device="cuda", dtype=dtype)
    o, lse = flashcore.decode(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=True,
                              return_lse=True)
    o_ref, lse_ref = decode_reference(q, cache.keys, cache.values, new_lens, True)
    assert_decode_close(o, lse, o_ref, lse_ref, dtype)
    # An append that would run past the capacity is refused when the host copies say so.
    host = cache.host()
    host["host_seqlens"] = torch.tensor([5, 46, 30], dtype=torch.int32)
    with pytest.raises(FlashcoreError, match="capacity"):
        flashcore.append_kv(cache.k, cache.v, cache.seqlens, k_new, v_new, block_table=cache.block_table, **host)


@pytest.mark.parametrize(
    "dtype, out_dtype, layout",
    [
        (torch.float16, None, "bshd"),
        (torch.bfloat16, torch.float32, "bshd"),
        (torch.float16, torch.bfloat16, "bhsd"),
    ],
)
def test_merge_of_shards_matches_one_shot_attention(dtype, out_dtype, layout, seed):
    b, sq, hq, hkv, d = 2, 37, 8, 2, 128
    shards = [700, 1, 0, 333]  # an empty shard: LSE -inf, merges as nothing
    q, k, v = make(b, hq, hkv, sq, sum(shards), d, dtype, layout)
    seq_dim = 1 if layout == "bshd" else 2
    outs, lses = [], []
    for part_k, part_v in zip(k.split(shards, seq_dim), v.split(shards, seq_dim)):
        o, lse = flashcore.attention(q, part_k, part_v, layout=layout, return_lse=True)
        outs.append(o)
        lses.append(lse)
    out, lse = flashcore.merge(torch.stack(outs), torch.stack(lses), out_dtype=out_dtype, layout=layout,
                               return_lse=True)
    assert out.dtype == (out_dtype or dtype) and out.shape == q.shape and lse.shape == (b, hq, sq)
    o_ref, lse_ref = reference(to_bhsd(q, layout), to_bhsd(k, layout), to_bhsd(v, layout), False)
    tol = max(TOLERANCE[dtype], TOLERANCE.get(out_dtype, 0.0))
    assert rel_l2(to_bhsd(out, layout), o_ref) <= tol
    assert (lse.double() - lse_ref).abs().max().item() <= 1e-2
    # A list of shards gives the same.
    assert torch.equal(flashcore.merge(outs, lses, out_dtype=out_dtype, layout=layout), out)


def test_decode_step_in_a_cuda_graph(seed):
    # Append one token, advance the lengths, decode: captured once, replayed as the
    # sequences grow. A long capacity, so the decode is split and merges a workspace.
    dtype, b, hq, hkv, d, capacity = torch.float16, 2, 32, 8, 128, 8192
    lens = [3000, 17]
    cache = Cache(b, capacity, hkv, d, dtype, lens, 64)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)
    k_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=dtype)
    v_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=dtype)

    def step():
        flashcore.append_kv(cache.k, cache.v, cache.seqlens, k_new, v_new, block_table=cache.block_table)
        cache.seqlens.add_(1)
        return flashcore.decode(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=True,
                                return_lse=True)

    # Warm-up on copies (the first calls load the kernels), on a side stream.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kp, vp, sl = cache.k.clone(), cache.v.clone(), cache.seqlens.clone()
        flashcore.append_kv(kp, vp, sl, k_new, v_new, block_table=cache.block_table)
        flashcore.decode(q, kp, vp, sl, block_table=cache.block_table, causal=True, return_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    assert cache.seqlens.tolist() == lens, "capture ran the step"
    for _ in range(3):  # new inputs in the captured buffers each time
        for t in (q, k_new, v_new):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        for i, n in enumerate(lens):
            cache.keys[i, n] = k_new[i, 0]
            cache.values[i, n] = v_new[i, 0]
        lens = [n + 1 for n in lens]
        assert cache.seqlens.tolist() == lens
        o_ref, lse_ref = decode_reference(q, cache.keys, cache.values, lens, True)
        assert_decode_close(o, lse, o_ref, lse_ref, dtype)


def test_decode_torch_compile(seed):
    cache = Cache(2, 1024, 2, 64, torch.bfloat16, (1000, 3), 0)
    q = torch.randn(2, 2, 8, 64, device="cuda", dtype=torch.bfloat16)

    def f(q):
        return flashcore.decode(q * 2, cache.k, cache.v, cache.seqlens, causal=True) + 1

    with torch.no_grad():
        eager = f(q)
        compiled = torch.compile(f, fullgraph=True)(q)
    assert rel_l2(compiled, eager) <= 1e-3


# ---- FP8 (e4m3) KV cache ---------------------------------------------------------------------

needs_fp8 = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="an FP8 KV cache needs an sm_89 or newer GPU",
)

FP8_CACHE_TOLERANCE = 2e-2  # rel L2 of O vs attention on the dequantized cache (16-bit kernel error only)
FP8_CACHE_QUANT_TOLERANCE = 8e-2  # vs the unquantized 16-bit cache: E4M3's rounding of K and V


class Fp8Cache:
    """An FP8 KV cache on the GPU holding what a 16-bit `Cache` holds, quantized by
    flashcore.append_kv: codes k, v (the 16-bit cache's shapes: contiguous or a page pool,
    same block table) and float32 scales k_scale, v_scale [outer, rows, Hkv]. Pool pages no
    sequence uses keep finite garbage codes and scales."""

    def __init__(self, b, capacity, hkv, d, dtype, lens, page=0):
        self.ref = Cache(b, capacity, hkv, d, dtype, lens, page)  # keys/values: garbage past lens
        self.block_table, self.page, self.lens = self.ref.block_table, page, list(lens)
        pool = self.ref.k.shape
        self.k, self.v = (torch.randn(pool, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
        self.k_scale, self.v_scale = (torch.rand(pool[:3], device="cuda") * 10 + 1 for _ in range(2))
        # Every position of every sequence, quantized by one append from length 0.
        zeros = torch.zeros(b, dtype=torch.int32, device="cuda")
        flashcore.append_kv(self.k, self.v, zeros, self.ref.keys, self.ref.values, **self.kw())
        self.seqlens = self.ref.seqlens

    def kw(self):
        return dict(block_table=self.block_table, k_scale=self.k_scale, v_scale=self.v_scale)

    def rows(self, i, positions):
        """(outer, row) pool indices of sequence i's positions."""
        p = torch.as_tensor(positions, device="cuda")
        if self.page == 0:
            return torch.full_like(p, i), p
        return self.block_table[i].long()[p // self.page], p % self.page

    def dequantized(self):
        """(keys, values) [B, capacity, Hkv, D] float32 as the cache holds them: codes times scales."""
        b, cap = self.ref.keys.shape[:2]
        out = []
        for codes, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = codes.float() * scales[..., None]
            if self.page:
                x = x[self.block_table.flatten().long()].view(b, cap, *x.shape[2:])
            out.append(x)
        return out


def sdpa_decode(q, keys, values, lens, causal):
    """O [B, Sq, Hq, D] float32 of decode by torch SDPA in float32: sequence b attends to
    positions 0 .. lens[b] - 1 of keys[b], values[b] ([capacity, Hkv, D]); causal: query i
    of Sq is position lens[b] - Sq + i."""
    b, sq, hq, d = q.shape
    o = torch.zeros(b, sq, hq, d, dtype=torch.float32, device=q.device)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        group = hq // keys.shape[2]
        qi = q[i : i + 1].transpose(1, 2).float()
        ki, vi = (t[i : i + 1, :n].transpose(1, 2).float().repeat_interleave(group, dim=1) for t in (keys, values))
        mask = None
        if causal:
            mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (n - sq)
        o[i] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask)[0].transpose(0, 1)
    return o


@needs_fp8
@pytest.mark.parametrize("repeat", ["head", "whole"])
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
def test_fp8_cache_decode_reads_repeated_scales(repeat, page, seed):
    # An FP8 cache quantized with one scale per KV head, or one for the whole cache (a
    # per-tensor cache), passed as expanded views: decode reads them, append_kv refuses them.
    b, hq, hkv, d, capacity, dtype = 3, 16, 4, 128, 4096, torch.float16
    lens = [1, capacity // 2 + 5, 4000]
    ref = Cache(b, capacity, hkv, d, dtype, lens, page)
    pool = ref.k.shape
    codes, scales, logical = [], [], []
    for keys, memory in ((ref.keys, ref.k), (ref.values, ref.v)):
        valid = torch.cat([keys[i, :n] for i, n in enumerate(lens)]).float()  # [rows, Hkv, D]
        amax = valid.abs().amax(dim=(0, 2))
        s = amax / 448 if repeat == "head" else (amax.max() / 448).view(1)
        per_head = s.expand(hkv)
        # Saturated like the kernels' cvt.satfinite: the garbage past each length stays finite or NaN.
        c = (memory.float() / per_head[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        codes.append(c)
        scales.append(s.view(1, 1, -1).expand(*pool[:3]))
        deq = c.float() * per_head[:, None]
        if page:
            deq = deq[ref.block_table.flatten().long()].view(b, capacity, hkv, d)
        logical.append(deq)
    assert scales[0].stride() == ((0, 0, 1) if repeat == "head" else (0, 0, 0))
    kw = dict(block_table=ref.block_table, k_scale=scales[0], v_scale=scales[1])
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)
    poison_allocator(((b, 1, hq, d), dtype))
    o = flashcore.decode(q, codes[0], codes[1], ref.seqlens, **kw, **ref.host())
    assert torch.isfinite(o).all()
    err = rel_l2(o, sdpa_decode(q, logical[0], logical[1], lens, False))
    assert err <= max(FP8_CACHE_TOLERANCE, TOLERANCE[dtype]), f"vs the dequantized cache: rel L2 {err:.2e}"
    err16 = rel_l2(o, sdpa_decode(q, ref.keys, ref.values, lens, False))
    assert err16 <= FP8_CACHE_QUANT_TOLERANCE, f"vs the 16-bit cache: rel L2 {err16:.2e}"
    # An append writes one scale per (position, head): refused, nothing written.
    saved = [t.clone() for t in (codes[0].view(torch.uint8), ref.seqlens)]
    new = torch.randn(b, 1, hkv, d, device="cuda", dtype=dtype)
    with pytest.raises(FlashcoreError, match="k_scale"):
        flashcore.append_kv(codes[0], codes[1], ref.seqlens, new, new, **kw)
    assert torch.equal(saved[0], codes[0].view(torch.uint8)) and torch.equal(saved[1], ref.seqlens)


@needs_fp8
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("capacity", [128, 4096], ids=["cap128", "cap4096"])
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_fp8_cache_append_then_decode(d, capacity, page, dtype, seed):
    # Quantize a 16-bit cache into an FP8 one, append 16-bit tokens, decode them: against
    # SDPA on the dequantized cache (tight) and on the 16-bit data (E4M3's rounding).
    b, hq, hkv, snew = 3, 8, 2, 3
    lens = [0, capacity // 2 + 5, 37]
    causal = d != 128
    cache = Fp8Cache(b, capacity, hkv, d, dtype, lens, page)
    before = [t.clone() for t in (cache.k.view(torch.uint8), cache.v.view(torch.uint8), cache.k_scale, cache.v_scale)]
    k_new = torch.randn(b, snew, hkv, d, device="cuda", dtype=dtype)
    v_new = torch.randn(b, snew, hkv, d, device="cuda", dtype=dtype) * 3
    k_new[0, 1] = 0  # a row of zeros: scale 1, codes 0
    flashcore.append_kv(cache.k, cache.v, cache.seqlens, k_new, v_new, **cache.kw(), **cache.ref.host())
    assert cache.seqlens.tolist() == lens

    # The new rows: scale = the row's largest magnitude / 448, codes within E4M3's rounding
    # (3 mantissa bits; subnormals below 2^-6 of the scale); every other row untouched.
    written = torch.zeros(cache.k.shape[:2], dtype=torch.bool, device="cuda")
    for i, n in enumerate(lens):
        outer, row = cache.rows(i, range(n, n + snew))
        written[outer, row] = True
        for new, codes, scales in ((k_new, cache.k, cache.k_scale), (v_new, cache.v, cache.v_scale)):
            x = new[i].float()  # [Snew, Hkv, D]
            want = x.abs().amax(-1) / 448
            want = torch.where(want > 0, want, torch.ones_like(want))
            got = scales[outer, row]
            assert torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)
            deq = codes[outer, row].float() * got[..., None]
            assert ((deq - x).abs() <= x.abs() / 16 + got[..., None] / 512).all()
        cache.ref.keys[i, n : n + snew] = k_new[i]
        cache.ref.values[i, n : n + snew] = v_new[i]
    outer, row = cache.rows(0, [lens[0] + 1])  # k_new[0, 1], the row of zeros
    assert (cache.k_scale[outer, row] == 1).all() and (cache.k[outer, row].float() == 0).all()
    for old, new in zip(before, (cache.k.view(torch.uint8), cache.v.view(torch.uint8), cache.k_scale, cache.v_scale)):
        assert torch.equal(old[~written], new[~written]), "the append wrote outside its rows"

    cache.seqlens += snew
    new_lens = [n + snew for n in lens]
    q = torch.randn(b, snew, hq, d, device="cuda", dtype=dtype)
    poison_allocator(((b, snew, hq, d), dtype), ((b, hq, snew), torch.float32))
    o, lse = flashcore.decode(q, cache.k, cache.v, cache.seqlens, causal=causal, return_lse=True, **cache.kw())
    assert o.shape == q.shape and o.dtype == dtype and torch.isfinite(o).all()
    keys, values = cache.dequantized()
    err = rel_l2(o, sdpa_decode(q, keys, values, new_lens, causal))
    assert err <= max(FP8_CACHE_TOLERANCE, TOLERANCE[dtype]), f"vs the dequantized cache: rel L2 {err:.2e}"
    _, lse_ref = decode_reference(q, keys, values, new_lens, causal)
    assert (lse.double() - lse_ref).abs().max().item() <= 1e-2
    err16 = rel_l2(o, sdpa_decode(q, cache.ref.keys, cache.ref.values, new_lens, causal))
    assert err16 <= FP8_CACHE_QUANT_TOLERANCE, f"vs the 16-bit cache: rel L2 {err16:.2e}"


@needs_fp8
def test_fp8_cache_errors_graphs_and_the_registered_op(seed):
    cache = Fp8Cache(2, 2048, 2, 128, torch.bfloat16, (1500, 9), 64)
    q = torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, cache.k, cache.v, cache.seqlens)
    o = flashcore.decode(*args, **cache.kw())
    # The op, called directly, and eager agree; so does a 16-bit q of the other type on the same cache.
    via_op = torch.ops.flashcore.decode(q, cache.k, cache.v, cache.seqlens, cache.block_table, None, None, False, 0.0,
                                        False, cache.k_scale, cache.v_scale)
    assert torch.equal(via_op[0], o)
    o16 = flashcore.decode(q.half(), *args[1:], **cache.kw())
    assert o16.dtype == torch.float16 and rel_l2(o16, o) <= 2e-2
    # Host metadata is checked as for a 16-bit cache; the scales are required.
    with pytest.raises(FlashcoreError, match="capacity"):
        flashcore.decode(*args, host_seqlens=[2049, 9], host_block_table=cache.block_table.cpu(), **cache.kw())
    with pytest.raises(ValueError, match="scales"):
        flashcore.decode(*args, block_table=cache.block_table)
    # One decode step (append one token, advance, decode) captured in a CUDA graph and replayed.
    k_new = torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn(2, 1, 2, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        flashcore.append_kv(cache.k, cache.v, cache.seqlens, k_new, v_new, **cache.kw())
        cache.seqlens.add_(1)
        return flashcore.decode(q, cache.k, cache.v, cache.seqlens, causal=True, **cache.kw())

    step()  # the kernels are generated and loaded before capture (capture runs nothing)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    lens = cache.seqlens.tolist()
    assert lens == [1500 + 4, 9 + 4]
    keys, values = cache.dequantized()
    assert rel_l2(out, sdpa_decode(q, keys, values, lens, True)) <= max(FP8_CACHE_TOLERANCE, TOLERANCE[torch.bfloat16])


@needs_fp8
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("causal, window", [(True, (15, 0)), (True, (1000, 0)), (False, (7, 3))],
                         ids=lambda x: str(x).replace(" ", ""))
def test_fp8_cache_decode_windows(page, causal, window, seed):
    # An FP8 cache takes a key window as a 16-bit one does: against float64 attention on
    # the dequantized cache, the window as the reference's mask.
    dtype, b, hq, hkv, d = torch.bfloat16, 3, 8, 2, 128
    lens = [5, 2048 + 5, 1500]
    cache = Fp8Cache(b, 4096, hkv, d, dtype, lens, page)
    q = torch.randn(b, 4, hq, d, device="cuda", dtype=dtype)
    o, lse = flashcore.decode(q, cache.k, cache.v, cache.seqlens, causal=causal, return_lse=True, window_size=window,
                              **cache.kw())
    keys, values = cache.dequantized()
    o_ref, lse_ref = decode_reference(q, keys, values, lens, causal, window=window)
    assert torch.isfinite(o).all()
    err = rel_l2(o, o_ref)
    assert err <= max(FP8_CACHE_TOLERANCE, TOLERANCE[dtype]), f"vs the dequantized cache: rel L2 {err:.2e}"
    seen = torch.isfinite(lse_ref)
    assert (lse[~seen] == -math.inf).all()
    assert (lse[seen].double() - lse_ref[seen]).abs().max().item() <= 1e-2


# ---- variable-length prefill -------------------------------------------------------------------

VARLEN_LENS = [(1, 1), (7, 7), (0, 5), (5, 0), (17, 300), (300, 17), (1023, 1023), (64, 4097)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "heads", [(4, 2, 128), (8, 1, 64), (2, 2, 256), (4, 2, 80)], ids=["gqa2-d128", "mqa-d64", "d256", "gqa2-d80"]
)
def test_varlen_matches_float64_per_sequence(dtype, causal, heads, seed):
    hq, hkv, d = heads
    lens_q = [a for a, _ in VARLEN_LENS]
    lens_k = [b for _, b in VARLEN_LENS]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d, device="cuda", dtype=dtype)
    poison_allocator((q.shape, dtype), ((hq, q.shape[0]), torch.float32))
    o, lse = flashcore.attention_varlen(
        q, k, v, cu_q.cuda(), cu_k.cuda(), max(lens_q), causal=causal, return_lse=True,
        host_cu_seqlens_q=cu_q, host_cu_seqlens_k=cu_k,
    )
    torch.cuda.synchronize()
    for b, (sq, sk) in enumerate(VARLEN_LENS):
        if sq == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        as_bhsd = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
        got = as_bhsd(o[rows])
        assert not got.isnan().any(), (b, sq, sk)
        if sk == 0:
            assert (got == 0).all() and torch.isneginf(lse[:, rows]).all()
            continue
        o_ref, lse_ref = reference(as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]), causal)
        if causal and sq > sk:  # rows that see no key: zeros and -inf, compared apart
            blind = sq - sk
            assert (got[:, :, :blind] == 0).all() and torch.isneginf(lse[:, rows][:, :blind]).all()
            got, o_ref = got[:, :, blind:], o_ref[:, :, blind:]
            lse_got, lse_ref = lse[:, rows][:, blind:], lse_ref[0][:, blind:]
        else:
            lse_got, lse_ref = lse[:, rows], lse_ref[0]
        assert rel_l2(got, o_ref) < TOLERANCE[dtype], (b, sq, sk)
        assert rel_l2(lse_got, lse_ref) < 1e-4, (b, sq, sk)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256, 80, 160])
def test_varlen_sequences_never_see_other_rows(d, causal, seed):
    # Key counts that end inside a tile: the Hopper kernels' TMA tiles run past each
    # sequence's end into the next sequence's rows, or past the last into the rest of a
    # larger buffer. NaN and infinities there must not reach the output, even as 0 * v.
    hq, hkv, lens_q, lens_k, pad = 4, 2, [100, 50], [77, 200], 150
    cu_q = torch.tensor([0, 100, 150], dtype=torch.int32)
    cu_k = torch.tensor([0, 77, 277], dtype=torch.int32)
    q = torch.randn(150, hq, d, device="cuda", dtype=torch.float16)
    as_bhsd = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731

    def check(k, v, sequences):
        # The previous call's O was just freed: its block (holding right answers) must
        # not pass for this call's output.
        poison_allocator(((150, hq, d), torch.float16))
        o = flashcore.attention_varlen(q, k, v, cu_q.cuda(), cu_k.cuda(), 100, causal=causal,
                                       host_cu_seqlens_q=cu_q, host_cu_seqlens_k=cu_k)
        torch.cuda.synchronize()
        for b in sequences:
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
            got = as_bhsd(o[rows])
            want, _ = reference(as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]), causal)
            assert got.isfinite().all(), (d, causal, b)
            assert rel_l2(got, want) < TOLERANCE[torch.float16], (d, causal, b)

    k = torch.randn(277 + pad, hkv, d, device="cuda", dtype=torch.float16)
    v = torch.randn(277 + pad, hkv, d, device="cuda", dtype=torch.float16)
    # Past the last sequence (a buffer larger than the batch, never written): both checked.
    k[277:], v[277:] = float("nan"), float("inf")
    check(k, v, [0, 1])
    # The second sequence's own first values infinite: the first sequence still exact.
    k[277:], v[277:] = 0.0, 0.0
    v[77:90] = float("inf")
    check(k, v, [0])


def test_varlen_errors_and_compile(seed):
    q = torch.randn(300, 4, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(500, 2, 64, device="cuda", dtype=torch.float16)
    cu_q = torch.tensor([0, 100, 300], dtype=torch.int32)
    cu_k = torch.tensor([0, 250, 500], dtype=torch.int32)
    with pytest.raises(FlashcoreError) as e:  # decreasing host offsets
        flashcore.attention_varlen(q, kv, kv, cu_q.cuda(), cu_k.cuda(), 200, host_cu_seqlens_q=[0, 100, 50],
                                   host_cu_seqlens_k=cu_k)
    assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT"
    eager = flashcore.attention_varlen(q, kv, kv, cu_q.cuda(), cu_k.cuda(), 200, causal=True)
    compiled = torch.compile(
        lambda q, k, v, a, b: flashcore.attention_varlen(q, k, v, a, b, 200, causal=True), fullgraph=True
    )
    assert torch.equal(compiled(q, kv, kv, cu_q.cuda(), cu_k.cuda()), eager)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal, window", [(True, (16, 0)), (True, (0, 0)), (False, (50, 7)), (False, (-1, 5)),
                                            (True, (100, -1))], ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("heads", [(4, 2, 128), (8, 1, 64)], ids=["gqa2-d128", "mqa-d64"])
def test_varlen_windows_match_float64_per_sequence(dtype, causal, window, heads, seed):
    # Each sequence's window aligned on its own diagonal, as one attention() call of its
    # lengths would align it.
    check_varlen_per_sequence(dtype, causal, window, heads)


def check_varlen_per_sequence(dtype, causal, window, heads, softcap=0.0, spread_q=False):
    """One packed call over VARLEN_LENS against the float64 reference of each sequence
    alone (a sequence without keys: zeros and LSE -inf); `spread_q` widens q's scores
    (`spread`)."""
    hq, hkv, d = heads
    lens_q = [a for a, _ in VARLEN_LENS]
    lens_k = [b for _, b in VARLEN_LENS]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, device="cuda", dtype=dtype)
    if spread_q:
        q = spread(q)
    k = torch.randn(int(cu_k[-1]), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d, device="cuda", dtype=dtype)
    poison_allocator((q.shape, dtype), ((hq, q.shape[0]), torch.float32))
    o, lse = flashcore.attention_varlen(
        q, k, v, cu_q.cuda(), cu_k.cuda(), max(lens_q), causal=causal, return_lse=True, window_size=window,
        softcap=softcap, host_cu_seqlens_q=cu_q, host_cu_seqlens_k=cu_k,
    )
    torch.cuda.synchronize()
    as_bhsd = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    for b, (sq, sk) in enumerate(VARLEN_LENS):
        if sq == 0:
            continue
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        got, got_lse = as_bhsd(o[rows]), lse[:, rows].unsqueeze(0)
        if sk == 0:
            assert (got == 0).all() and torch.isneginf(got_lse).all()
            continue
        o_ref, lse_ref = reference(as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]), causal, window=window,
                                   softcap=softcap)
        check_windowed(got, got_lse, o_ref, lse_ref, dtype)


# ---- logit soft-capping ---------------------------------------------------------------------------
#
# Inputs scaled so the scaled scores reach about +-SPREAD standard deviations of 4: a cap of 5
# bends most of them, one of 30 or 50 the largest (Gemma 2 caps at 50, Grok at 30).

SOFTCAPS = [0.0, 5.0, 30.0, 50.0]
SOFTCAP_SPREAD = 4.0

SOFTCAP_CASES = [
    # b, hq, hkv, sq, sk, d
    (1, 4, 4, 1, 1, 64),
    (2, 8, 2, 17, 17, 128),
    (1, 8, 2, 113, 300, 64),
    (2, 4, 1, 300, 113, 128),  # Sq > Sk: with causal masking, early rows see no key
    (1, 16, 2, 1023, 1023, 256),
    (3, 8, 8, 1, 1536, 64),  # decode-shaped: the split-KV decode kernels
    (1, 8, 2, 16, 4097, 128),
    (2, 8, 8, 77, 333, 80),  # a head dim run padded on the next larger kernel
]

# (causal, window_size): none, causal, a causal sliding window, a two-sided window.
SOFTCAP_MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (16, 0)), (False, (50, 7))]


def spread(t):
    """q scaled so that the scaled scores (unit variance for randn inputs) have a standard
    deviation of SOFTCAP_SPREAD, in q's dtype."""
    return (t.float() * SOFTCAP_SPREAD).to(t.dtype)


@pytest.mark.parametrize("case", SOFTCAP_CASES, ids=lambda c: "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("causal, window", SOFTCAP_MASKS, ids=lambda x: str(x).replace(" ", ""))
def test_softcaps_match_float64(case, dtype, softcap, causal, window, seed):
    b, hq, hkv, sq, sk, d = case
    q, k, v = make(b, hq, hkv, sq, sk, d, dtype)
    q = spread(q)
    poison_allocator(((b, hq, sq, d), dtype), ((b, hq, sq), torch.float32))
    o, lse = flashcore.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (b, hq, sq)
    o_ref, lse_ref = reference(q, k, v, causal, window=window, softcap=softcap)
    check_windowed(o, lse, o_ref, lse_ref, dtype)
    if softcap == 5.0 and sk > 1:
        # The cap matters at this spread: the uncapped result is far from the capped one.
        uncapped, _ = reference(q, k, v, causal, window=window)
        assert rel_l2(o, uncapped) > 5 * TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_softcaps_in_both_layouts_and_as_the_registered_op(layout, seed):
    q, k, v = make(2, 8, 2, 200, 333, 128, torch.bfloat16, layout)
    q = spread(q)
    o = flashcore.attention(q, k, v, causal=True, layout=layout, window_size=(31, 0), softcap=5.0)
    qb, kb, vb = (to_bhsd(t, layout) for t in (q, k, v))
    o_ref, _ = reference(qb, kb, vb, True, window=(31, 0), softcap=5.0)
    assert rel_l2(to_bhsd(o, layout), o_ref) <= TOLERANCE[torch.bfloat16]
    via_op, _ = torch.ops.flashcore.attention(q, k, v, True, 0.0, layout, layout, False, 31, 0, 5.0)
    assert torch.equal(via_op, o)


def test_no_cap_is_the_plain_call_and_an_explicit_scale_is_capped_after_it(seed):
    # softcap 0.0 (either sign) or None: the call without a cap, bit for bit.
    q, k, v = make(2, 8, 2, 100, 250, 64, torch.float16)
    for causal in (False, True):
        plain = flashcore.attention(q, k, v, causal=causal)
        for none in (0.0, -0.0, None, 0):
            assert torch.equal(flashcore.attention(q, k, v, causal=causal, softcap=none), plain), none
    # The cap applies to the scaled score: q·k · scale, then capped.
    o, lse = flashcore.attention(q, k, v, causal=True, scale=0.5, softcap=3.0, return_lse=True)
    o_ref, lse_ref = reference(q, k, v, True, scale=0.5, softcap=3.0)
    check_windowed(o, lse, o_ref, lse_ref, torch.float16)


def test_softcap_errors_launch_nothing(seed):
    q, k, v = make(1, 4, 4, 64, 64, 64, torch.float16)
    for bad in (-50.0, math.nan, math.inf):
        with pytest.raises(FlashcoreError) as e:
            flashcore.attention(q, k, v, causal=True, softcap=bad)
        assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and "softcap" in str(e.value)
        assert e.value.message.startswith("flashcore_forward_ex: ")
    # The FP8 forward has no cap: its functions take no softcap.
    with pytest.raises(TypeError):
        flashcore.attention_fp8(q, k, v, causal=True, softcap=50.0)


def test_softcaps_under_torch_compile_and_cuda_graphs(seed):
    q, k, v = make(2, 8, 2, 128, 512, 128, torch.float16)

    def f(q, k, v):
        return flashcore.attention(q * 8, k, v, causal=True, window_size=(63, 0), softcap=5.0) + 1

    with torch.no_grad():
        eager = f(q, k, v)
        compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert rel_l2(compiled, eager) <= 1e-3
    out = flashcore.attention(q, k, v, causal=True, softcap=5.0)  # loads the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashcore.attention(q, k, v, causal=True, softcap=5.0)
    q.copy_(spread(torch.randn_like(q)))
    graph.replay()
    torch.cuda.synchronize()
    o_ref, _ = reference(q, k, v, True, softcap=5.0)
    assert rel_l2(captured, o_ref) <= TOLERANCE[torch.float16]
    assert not torch.equal(captured, out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("causal, window", SOFTCAP_MASKS, ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("heads", [(4, 2, 128), (8, 1, 64)], ids=["gqa2-d128", "mqa-d64"])
def test_varlen_softcaps_match_float64_per_sequence(dtype, softcap, causal, window, heads, seed):
    check_varlen_per_sequence(dtype, causal, window, heads, softcap=softcap, spread_q=True)


SOFTCAP_DECODE_CASES = [
    # hq, hkv, d, sq, lens
    (32, 8, 128, 1, (1, 7, 4097, 300)),
    (16, 2, 64, 4, (1000, 16, 0)),
    (8, 8, 256, 16, (33, 500)),
]


@pytest.mark.parametrize("case", SOFTCAP_DECODE_CASES,
                         ids=lambda c: "Hq{}Hkv{}D{}Sq{}lens{}".format(*c[:4], "-".join(map(str, c[4]))))
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("softcap", SOFTCAPS, ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (15, 0))],
                         ids=lambda x: str(x).replace(" ", ""))
def test_decode_softcaps_match_float64(case, page, dtype, softcap, causal, window, seed):
    # Garbage past each length and in unused pages: only the visible keys may reach the
    # output, capped or not.
    hq, hkv, d, sq, lens = case
    b = len(lens)
    capacity = -(-(max(lens) + 5) // 64) * 64
    cache = Cache(b, capacity, hkv, d, dtype, lens, page)
    q = spread(torch.randn(b, sq, hq, d, device="cuda", dtype=dtype))
    poison_allocator(((b, sq, hq, d), dtype), ((b, hq, sq), torch.float32))
    o, lse = flashcore.decode(
        q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=causal, return_lse=True,
        window_size=window, softcap=softcap, **cache.host(),
    )
    o_ref, lse_ref = decode_reference(q, cache.keys, cache.values, lens, causal, window=window, softcap=softcap)
    assert_decode_close(o, lse, o_ref, lse_ref, dtype)
    # Through the registered op: the same kernels, the same result.
    via_op, _ = torch.ops.flashcore.decode(q, cache.k, cache.v, cache.seqlens, cache.block_table, None, None, causal,
                                           0.0, False, None, None, *window, softcap)
    assert torch.equal(via_op, o)


def test_decode_softcap_steps_in_a_cuda_graph(seed):
    # A capped sliding-window decode step captured once and replayed as the sequences grow.
    dtype, hq, hkv, d, window, cap = torch.bfloat16, 8, 2, 128, 64, 5.0
    cache = Cache(2, 512, hkv, d, dtype, (10, 100), 16)
    q = spread(torch.randn(2, 1, hq, d, device="cuda", dtype=dtype))
    k_new = torch.randn(2, 1, hkv, d, device="cuda", dtype=dtype)
    v_new = torch.randn(2, 1, hkv, d, device="cuda", dtype=dtype)

    def step():
        flashcore.append_kv(cache.k, cache.v, cache.seqlens, k_new, v_new, block_table=cache.block_table)
        cache.seqlens.add_(1)
        return flashcore.decode(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, causal=True,
                                window_size=(window - 1, 0), softcap=cap)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    lens = cache.seqlens.tolist()
    assert lens == [10 + 4, 100 + 4]
    keys, values = cache.logical()  # the appended tokens included
    o_ref, _ = decode_reference(q, keys, values, lens, True, window=(window - 1, 0), softcap=cap)
    assert rel_l2(out, o_ref) <= TOLERANCE[dtype]


@needs_fp8
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("softcap", [5.0, 30.0, 50.0], ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (True, (1000, 0)), (False, (7, 3))],
                         ids=lambda x: str(x).replace(" ", ""))
def test_fp8_cache_decode_softcaps(page, softcap, causal, window, seed):
    # An FP8 cache takes a cap as a 16-bit one does: against float64 attention on the
    # dequantized cache, capped.
    dtype, b, hq, hkv, d = torch.bfloat16, 3, 8, 2, 128
    lens = [5, 2048 + 5, 1500]
    cache = Fp8Cache(b, 4096, hkv, d, dtype, lens, page)
    q = spread(torch.randn(b, 4, hq, d, device="cuda", dtype=dtype))
    o, lse = flashcore.decode(q, cache.k, cache.v, cache.seqlens, causal=causal, return_lse=True, window_size=window,
                              softcap=softcap, **cache.kw())
    keys, values = cache.dequantized()
    o_ref, lse_ref = decode_reference(q, keys, values, lens, causal, window=window, softcap=softcap)
    assert torch.isfinite(o).all()
    err = rel_l2(o, o_ref)
    assert err <= max(FP8_CACHE_TOLERANCE, TOLERANCE[dtype]), f"vs the dequantized cache: rel L2 {err:.2e}"
    seen = torch.isfinite(lse_ref)
    assert (lse[~seen] == -math.inf).all()
    assert (lse[seen].double() - lse_ref[seen]).abs().max().item() <= 1e-2


# ---- a serving batch in one call: packed queries against a cache ----------------------------


def packed_offsets(runs, lead=3, tail=2):
    """cu_seqlens_q (a list) of query runs packed after `lead` rows no sequence covers, and
    the number of rows of q with `tail` more after them."""
    cu = [lead]
    for n in runs:
        cu.append(cu[-1] + n)
    return cu, cu[-1] + tail


def assert_packed_close(q, o, lse, cu, keys, values, lens, causal, dtype, window=(-1, -1), softcap=0.0, tol=None):
    """Each sequence's rows of o [total_q, Hq, D] and lse [Hq, total_q] against the float64
    decode of its queries alone."""
    assert torch.isfinite(o[cu[0] : cu[-1]]).all(), "non-finite output"
    for b, n in enumerate(lens):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        o_ref, lse_ref = decode_reference(q[None, lo:hi], keys[b : b + 1], values[b : b + 1], [n], causal,
                                          window=window, softcap=softcap)
        if tol is None:
            assert_decode_close(o[None, lo:hi], lse[None, :, lo:hi], o_ref, lse_ref, dtype)
        else:
            assert rel_l2(o[lo:hi], o_ref[0]) <= tol, f"sequence {b}"


PACKED_CASES = [
    # hq, hkv, d, query runs, lengths, max_seqlen_q
    # Steps, drafts, an empty run, a prompt chunk (past 16: the forward kernels where they
    # read the cache) and a run longer than its sequence.
    (32, 8, 128, (1, 4, 0, 16, 200, 3), (300, 4097, 50, 33, 1500, 2), 256),
    # Runs of at most 16 (the decode kernels only); a sequence of length 0.
    (16, 2, 64, (1, 7, 16, 2), (1, 7, 1000, 0), 16),
    (8, 8, 256, (40, 1), (45, 33), 40),
]


@pytest.mark.parametrize("case", PACKED_CASES,
                         ids=lambda c: "Hq{}Hkv{}D{}runs{}".format(*c[:3], "-".join(map(str, c[3]))))
@pytest.mark.parametrize("page", [0, 16, 64], ids=["contiguous", "page16", "page64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decode_varlen_matches_float64_per_sequence(case, page, dtype, causal, seed):
    hq, hkv, d, runs, lens, max_q = case
    capacity = -(-(max(lens) + 5) // 64) * 64
    cache = Cache(len(lens), capacity, hkv, d, dtype, lens, page)
    cu, total = packed_offsets(runs)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    q = torch.randn(total, hq, d, device="cuda", dtype=dtype)
    poison_allocator(((total, hq, d), dtype), ((hq, total), torch.float32))
    o, lse = flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu_dev, max_q, block_table=cache.block_table,
                                     causal=causal, return_lse=True, host_cu_seqlens_q=cu, **cache.host())
    assert o.shape == q.shape and o.dtype == dtype and o.is_contiguous()
    assert lse.shape == (hq, total) and lse.dtype == torch.float32
    assert_packed_close(q, o, lse, cu, cache.keys, cache.values, lens, causal, dtype)
    # Without host copies: the same kernels, the same result.
    again = flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu_dev, max_q, block_table=cache.block_table,
                                    causal=causal)
    assert torch.equal(again[cu[0] : cu[-1]], o[cu[0] : cu[-1]])


def test_decode_varlen_windows_softcaps_and_the_registered_op(seed):
    dtype, runs, lens = torch.bfloat16, (1, 30, 5), (900, 64, 5000)
    cache = Cache(3, 5056, 2, 128, dtype, lens, 16)
    cu, total = packed_offsets(runs)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    q = torch.randn(total, 8, 128, device="cuda", dtype=dtype)
    for causal, window, softcap in [(True, (15, 0), 0.0), (True, (-1, -1), 30.0), (False, (100, 7), 5.0)]:
        o, lse = flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu_dev, 32, block_table=cache.block_table,
                                         causal=causal, window_size=window, softcap=softcap, return_lse=True)
        assert_packed_close(q, o, lse, cu, cache.keys, cache.values, lens, causal, dtype, window, softcap)
    via_op = torch.ops.flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu_dev, 32, cache.block_table, None,
                                               None, None, False, 0.0, True, None, None, 100, 7, 5.0)
    rows = slice(cu[0], cu[-1])
    assert torch.equal(via_op[0][rows], o[rows]) and torch.equal(via_op[1][:, rows], lse[:, rows])


def test_decode_varlen_host_copies_turn_bad_offsets_into_errors():
    cache = Cache(2, 128, 2, 64, torch.float16, (100, 50), 16)
    q = torch.randn(20, 8, 64, device="cuda", dtype=torch.float16)
    cu = torch.tensor([0, 4, 20], dtype=torch.int32, device="cuda")
    for host, max_q, words in [([0, 4, 20], 8, "max_seqlen_q"), ([0, 12, 4], 16, "decreases"), ([0, 4, 21], 17, "past")]:
        with pytest.raises(FlashcoreError) as e:
            flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu, max_q, block_table=cache.block_table,
                                    host_cu_seqlens_q=host)
        assert e.value.name == "FLASHCORE_ERROR_INVALID_ARGUMENT" and words in e.value.message, (host, e.value)


def test_decode_varlen_step_in_a_cuda_graph_as_the_mix_changes(seed):
    # Captured with one mix of steps and a prompt chunk, replayed with others of the same
    # bound: the kernels read the offsets and lengths when they run.
    dtype, hq, hkv, d, capacity, max_q = torch.float16, 16, 4, 128, 4096, 48
    cache = Cache(3, capacity, hkv, d, dtype, (capacity,) * 3, 64)
    q = torch.randn(64, hq, d, device="cuda", dtype=dtype)
    cu_dev = torch.zeros(4, dtype=torch.int32, device="cuda")
    mixes = [((1, 48, 15), (2000, 3000, 100)), ((16, 17, 31), (17, 4000, 31)), ((0, 2, 48), (1, 2, 4096))]

    def load(runs, lens):
        cu, _ = packed_offsets(runs, lead=0, tail=0)
        cu_dev.copy_(torch.tensor(cu, dtype=torch.int32))
        cache.seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        return cu

    load(*mixes[0])

    def step():
        return flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu_dev, max_q,
                                       block_table=cache.block_table, causal=True, return_lse=True)

    step()  # loads the kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    for runs, lens in mixes:
        cu = load(runs, lens)
        graph.replay()
        torch.cuda.synchronize()
        assert_packed_close(q, o, lse, cu, cache.keys, cache.values, lens, True, dtype)


@needs_fp8
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
def test_decode_varlen_fp8_cache(page, seed):
    # An e4m3 cache: the decode kernels take every run, the long one included.
    dtype, runs, lens = torch.bfloat16, (1, 20, 3), (700, 2000, 3)
    cache = Fp8Cache(3, 2048, 2, 128, dtype, lens, page)
    cu, total = packed_offsets(runs)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    q = torch.randn(total, 8, 128, device="cuda", dtype=dtype)
    poison_allocator(((total, 8, 128), dtype))
    o, lse = flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu_dev, 20, causal=True, return_lse=True,
                                     **cache.kw())
    keys, values = cache.dequantized()
    assert_packed_close(q, o, lse, cu, keys, values, lens, True, dtype, tol=FP8_CACHE_TOLERANCE)


class ServingDraw:
    """A random serving configuration drawn from generator `g`: `b` sequences (from
    `batches`) of random lengths (0 to past 4096) in a cache of pages of 1 to 256 (or
    contiguous), GQA 1 to 8, head dims with and without their own kernels, dtype, causal
    masking, a window, a cap."""

    def __init__(self, g, batches):
        self.g = g
        self.b = self.pick(batches)
        self.hkv, self.group = self.pick([1, 2, 4, 8]), self.pick([1, 2, 4, 8])
        self.hq = self.hkv * self.group
        self.d = self.pick([64, 80, 128, 256])
        self.dtype = self.pick([torch.float16, torch.bfloat16])
        self.page = self.pick([0, 0, 1, 16, 64, 256])
        self.causal = self.pick([False, True])
        self.window = self.pick([(-1, -1), (-1, -1), (63, 0) if self.causal else (40, 9)])
        self.softcap = self.pick([0.0, 0.0, 20.0])
        self.lens = [self.pick([0, 1, 7, 33, 300, 1000, 4097]) for _ in range(self.b)]
        capacity = -(-(max(self.lens) + 1) // 256) * 256
        self.cache = Cache(self.b, capacity, self.hkv, self.d, self.dtype, self.lens, self.page)

    def pick(self, options):
        return options[int(torch.randint(len(options), (1,), generator=self.g))]

    def options(self):
        """The drawn options as the serving calls take them."""
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap)

    def __str__(self):
        return (f"b{self.b} hkv{self.hkv}x{self.group} d{self.d} {self.dtype} page{self.page} causal{self.causal} "
                f"window{self.window} softcap{self.softcap} lens{self.lens}")


@pytest.mark.parametrize("draw", range(24))
def test_decode_varlen_random_batches(draw, seed):
    # Random serving batches (see ServingDraw) with runs that are empty, longer than their
    # sequence or past 16, and rows no sequence covers; against float64 per sequence.
    c = ServingDraw(torch.Generator().manual_seed(seed * 31 + draw), [1, 2, 3, 5, 8])
    runs = [c.pick([0, 1, 1, 2, 5, 16, 17, 40, 200]) for _ in range(c.b)]
    max_q = max(max(runs), 1) + c.pick([0, 0, 3])
    cu, total = packed_offsets(runs, lead=c.pick([0, 2]), tail=c.pick([0, 1]))
    total = max(total, 1)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    # Sometimes the query heads of a fused QKV projection's output, read in place.
    fused = c.pick([False, True])
    qkv = torch.randn(total, c.hq + 2 * c.hkv * fused, c.d, device="cuda", dtype=c.dtype)
    q = qkv[:, : c.hq]
    what = f"fused{fused} {c} runs{runs} max{max_q}"
    poison_allocator(((total, c.hq, c.d), c.dtype), ((c.hq, total), torch.float32))
    cache = c.cache
    o, lse = flashcore.decode_varlen(q, cache.k, cache.v, cache.seqlens, cu_dev, max_q, block_table=cache.block_table,
                                     return_lse=True, host_cu_seqlens_q=cu, **c.options(), **cache.host())
    try:
        assert_packed_close(q, o, lse, cu, cache.keys, cache.values, c.lens, c.causal, c.dtype, c.window, c.softcap)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from e


@pytest.mark.parametrize("draw", range(24))
def test_decode_random_steps(draw, seed):
    # Random decode calls (see ServingDraw) of 1 to 200 queries per sequence (up to 16 on
    # the decode kernels, more on the forward kernels where they read the cache), some
    # more than their sequence's length; against float64.
    c = ServingDraw(torch.Generator().manual_seed(seed * 37 + draw), [1, 2, 3, 6])
    sq = c.pick([1, 2, 5, 16, 17, 40, 200])
    q = torch.randn(c.b, sq, c.hq, c.d, device="cuda", dtype=c.dtype)
    poison_allocator(((c.b, sq, c.hq, c.d), c.dtype), ((c.b, c.hq, sq), torch.float32))
    cache = c.cache
    o, lse = flashcore.decode(q, cache.k, cache.v, cache.seqlens, block_table=cache.block_table, return_lse=True,
                              **c.options(), **cache.host())
    o_ref, lse_ref = decode_reference(q, cache.keys, cache.values, c.lens, c.causal, window=c.window,
                                      softcap=c.softcap)
    try:
        assert_decode_close(o, lse, o_ref, lse_ref, c.dtype)
    except AssertionError as e:
        raise AssertionError(f"sq{sq} {c}: {e}") from e
