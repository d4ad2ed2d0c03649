"""flashcore.attention on a GPU: against float64 and SDPA over a grid of shapes, dtypes,
layouts and GQA ratios; views read in place; streams; torch.compile; CUDA graphs."""

import math

import pytest
import torch
import torch.nn.functional as F

import flashcore
from flashcore import FlashcoreError

from conftest import requires_gpu

pytestmark = requires_gpu

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # relative L2 against float64


def rel_l2(a, b):
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def reference(q, k, v, causal, scale=None):
    """Float64 O and LSE for [B, H, S, D] inputs, bottom-right causal, GQA by head count."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p @ vv) / torch.where(l > 0, l, torch.ones_like(l))
    return o, (m + torch.log(l)).squeeze(-1)


def poison_allocator(*shapes_dtypes):
    """Fills blocks the caching allocator will hand out next with NaN, so an output element
    the kernel leaves unwritten shows up."""
    blocks = [torch.full(s, math.nan, dtype=dt, device="cuda") for s, dt in shapes_dtypes]
    del blocks


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
    q48, k48, v48 = make(1, 4, 4, 64, 64, 48, torch.float16)
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_HEAD_DIM"):
        flashcore.attention(q48, k48, v48)
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


def test_cuda_graph_capture_and_replay(seed):
    q, k, v = make(2, 8, 8, 512, 512, 64, torch.float16)
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
