"""flashcore's FP8 attention on a GPU (sm_89 or newer): attention_fp8 against float64
attention on the 16-bit inputs over shapes, dtypes, layouts, masks and quantizer options;
quantize_fp8's operands against the inputs they came from; forward_fp8 on them; views;
torch.compile and CUDA graphs; the transformers backend's FP8 name in a small Llama."""

import math

import pytest
import torch

import flashcore
from flashcore import FlashcoreError

from conftest import poison_allocator, requires_gpu

pytestmark = requires_gpu

# Relative L2 of O against float64 on the 16-bit inputs: rounding q, k and v to E4M3 costs
# about 4.6% on normal inputs, P's rounding a little more (5-5.5% in all).
OUT_BOUND = 0.08
# RMS absolute error of the LSE (natural log) over rows that see a key: about the scores'
# error, 0.03-0.04 for a row of one key, less the more keys a row averages over.
LSE_BOUND = 0.1

# Stored position p of a group of 16 keys of Vt holds key VT_KEY_ORDER[p] of the group.
VT_KEY_ORDER = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]


def fp8_capable():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not fp8_capable(), reason="FP8 needs an sm_89 or newer GPU")


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


def make(b, hq, hkv, sq, sk, d, dtype, layout="bhsd"):
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
    if layout == "bshd":  # real [B, S, H, D] memory
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v


def to_bhsd(t, layout):
    return t if layout == "bhsd" else t.transpose(1, 2)


def check(o, lse, q, k, v, causal, layout="bhsd", scale=None):
    """O and the LSE against float64 on the 16-bit inputs; rows that see no key exact."""
    qb, kb, vb, ob = (to_bhsd(t, layout) for t in (q, k, v, o))
    sq, sk = qb.shape[2], kb.shape[2]
    o_ref, lse_ref = reference(qb, kb, vb, causal, scale)
    first = max(0, sq - sk) if causal else 0  # rows before it see no key
    assert not torch.isnan(ob).any(), "NaN in o"
    assert torch.isfinite(ob).all()
    assert (ob[:, :, :first] == 0).all()
    err = rel_l2(ob, o_ref)
    assert err < OUT_BOUND, f"o: rel L2 {err:.3e}"
    if lse is not None:
        assert (lse[:, :, :first] == -math.inf).all()
        diff = lse[:, :, first:].double() - lse_ref[:, :, first:]
        rms = diff.pow(2).mean().sqrt().item() if diff.numel() else 0.0
        assert rms < LSE_BOUND, f"lse: rms error {rms:.3e}"
    return err


CASES = [
    # b, hq, hkv, sq, sk, d
    (2, 8, 8, 1, 1, 64),
    (2, 4, 4, 17, 17, 128),
    (1, 8, 2, 113, 300, 128),
    (2, 8, 1, 300, 113, 64),
    (1, 8, 8, 1, 1023, 256),
    (1, 32, 4, 16, 4097, 128),
    (1, 16, 2, 1024, 1024, 128),
]

OPTIONS = {
    "plain": dict(),
    "smooth_k": dict(smooth_k=True),
    "hadamard": dict(hadamard_seed=0x5EED),
    "both": dict(smooth_k=True, hadamard_seed=2**64 - 1),
}


@needs_fp8
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_fp8_matches_float64(case, dtype, layout, causal, seed):
    b, hq, hkv, sq, sk, d = case
    q, k, v = make(b, hq, hkv, sq, sk, d, dtype, layout)
    poison_allocator((q.shape, dtype), ((b, hq, sq), torch.float32))
    o, lse = flashcore.attention_fp8(q, k, v, causal=causal, layout=layout, return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and o.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    err = check(o, lse, q, k, v, causal, layout)
    print(f"rel L2 {err:.3e}")


@needs_fp8
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("case", [(1, 8, 2, 113, 300, 128), (2, 4, 4, 257, 257, 64), (1, 4, 2, 100, 1000, 256)],
                         ids=lambda c: "B{}Hq{}Hkv{}Sq{}Sk{}D{}".format(*c))
def test_options_keep_attention_and_its_lse(options, case, seed):
    b, hq, hkv, sq, sk, d = case
    q, k, v = make(b, hq, hkv, sq, sk, d, torch.bfloat16)
    # Keys with a per-channel offset, as real models' have: what K smoothing removes.
    k = k + 3 * torch.randn(d, device="cuda", dtype=k.dtype)
    for causal in (False, True):
        poison_allocator((q.shape, q.dtype), ((b, hq, sq), torch.float32))
        o, lse = flashcore.attention_fp8(q, k, v, causal=causal, return_lse=True, **options)
        o_ref, lse_ref = reference(q, k, v, causal)
        # Unsmoothed offset keys round coarser (about 10% on a CPU model of the path, 5%
        # smoothed): allow them more, as the quantizer's own tests do.
        err = rel_l2(o, o_ref)
        bound = OUT_BOUND if options.get("smooth_k") else 0.15
        assert err < bound, f"o: rel L2 {err:.3e}"
        first = max(0, sq - sk) if causal else 0
        rms = (lse[:, :, first:].double() - lse_ref[:, :, first:]).pow(2).mean().sqrt().item()
        assert rms < (LSE_BOUND if options.get("smooth_k") else 0.3), f"lse: rms error {rms:.3e}"
        assert not torch.isnan(o).any()


@needs_fp8
def test_quantize_fp8_operands_hold_the_inputs(seed):
    b, hq, hkv, sq, sk, d = 2, 8, 2, 300, 1001, 128
    q, k, v = make(b, hq, hkv, sq, sk, d, torch.float16)
    ops = flashcore.quantize_fp8(q, k, v)
    e4m3 = torch.float8_e4m3fn
    pitch = 1008
    assert ops.q.shape == (b, sq, hq, d) and ops.q.dtype == e4m3
    assert ops.k.shape == (b, sk, hkv, d) and ops.vt.shape == (b, hkv, d, pitch) and ops.vt.dtype == e4m3
    assert ops.q_scale.shape == (b, hq, 3) and ops.k_scale.shape == (b, hkv, 8) and ops.v_scale.shape == (b, hkv, 8)
    assert ops.q_scale.dtype == torch.float32 and ops.lse_shift is None and ops.dtype == torch.float16
    assert ops.shape == (b, sq, hq, sk, hkv, d)
    assert "Sk=1001" in repr(ops)
    assert (ops.q_scale > 0).all() and (ops.k_scale > 0).all() and (ops.v_scale > 0).all()

    def rows(codes, scales, s):  # [B, S, H, D] codes, [B, H, blocks] scales
        per_row = scales.repeat_interleave(128, dim=2)[:, :, :s]  # [B, H, S]
        return codes.float() * per_row.transpose(1, 2)[..., None]

    q8 = rows(ops.q, ops.q_scale, sq)
    k8 = rows(ops.k, ops.k_scale, sk)
    assert rel_l2(q8, q.transpose(1, 2)) < 0.04
    assert rel_l2(k8, k.transpose(1, 2)) < 0.04
    # Vt: undo the key permutation inside each group of 16, drop the padding keys.
    order = torch.tensor(VT_KEY_ORDER, device="cuda")
    key_of_position = (torch.arange(pitch, device="cuda") // 16) * 16 + order.repeat(pitch // 16)
    vt = torch.empty(b, hkv, d, pitch, device="cuda")
    vt[..., key_of_position] = ops.vt.float()
    v_scale = ops.v_scale.repeat_interleave(128, dim=2)[:, :, :pitch]  # [B, H, pitch]
    v8 = (vt * v_scale[:, :, None, :])[..., :sk]  # [B, H, D, Sk]
    assert rel_l2(v8, v.transpose(2, 3)) < 0.04
    assert (vt[..., sk:] == 0).all(), "padding keys of Vt are not zero"

    smooth = flashcore.quantize_fp8(q, k, v, smooth_k=True, hadamard_seed=9)
    assert smooth.lse_shift is not None and smooth.lse_shift.shape == (b, hq, sq)
    assert torch.isfinite(smooth.lse_shift).all()


@needs_fp8
def test_forward_fp8_reuses_operands_and_equals_attention_fp8(seed):
    q, k, v = make(2, 8, 2, 333, 444, 128, torch.bfloat16)
    ops = flashcore.quantize_fp8(q, k, v)
    outputs = ((q.shape, q.dtype), ((2, 8, 333), torch.float32))
    for causal in (False, True):
        poison_allocator(*outputs)
        direct, lse = flashcore.attention_fp8(q, k, v, causal=causal, return_lse=True)
        poison_allocator(*outputs)
        again, lse2 = flashcore.forward_fp8(ops, causal=causal, return_lse=True)
        # The same kernels on the same bits (no K smoothing: nothing summed by atomics).
        assert torch.equal(direct, again) and torch.equal(lse, lse2)
        bshd = flashcore.forward_fp8(ops, causal=causal, layout="bshd")
        assert bshd.shape == (2, 333, 8, 128) and torch.equal(bshd.transpose(1, 2), direct)
    f16 = flashcore.forward_fp8(ops, out_dtype=torch.float16)
    assert f16.dtype == torch.float16
    check(f16, None, q, k, v, False)
    with pytest.raises(ValueError, match="out_dtype"):
        flashcore.forward_fp8(ops, out_dtype=torch.float32)
    # Through the registered op (the torch.compile / dispatcher path): the same result.
    via_op = torch.ops.flashcore.attention_fp8(q, k, v, False, 0.0, "bhsd", True, False, False, 0)
    direct = flashcore.attention_fp8(q, k, v, return_lse=True)
    assert torch.equal(via_op[0], direct[0]) and torch.equal(via_op[1], direct[1])


@needs_fp8
def test_views_and_unaligned_inputs(seed):
    b, s, h, d = 2, 333, 8, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)  # a fused projection
    q, k, v = qkv.unbind(2)  # [B, S, H, D] views with a row stride of 3*H*D
    poison_allocator(((b, s, h, d), torch.bfloat16))
    o = flashcore.attention_fp8(q, k, v, causal=True, layout="bshd")
    check(o, None, q, k, v, True, "bshd")
    v2 = torch.randn(1 + 4 * 200 * 128, device="cuda", dtype=torch.float16)[1:].view(1, 4, 200, 128)  # 2 B in
    q2 = torch.randn(1, 4, 200, 256, device="cuda", dtype=torch.float16)[..., ::2]  # head dim stride 2
    k2 = torch.randn(1, 4, 200, 128, device="cuda", dtype=torch.float16)
    poison_allocator(((1, 4, 200, 128), torch.float16))
    o2 = flashcore.attention_fp8(q2, k2, v2)
    check(o2, None, q2, k2, v2, False)


@needs_fp8
def test_empty_problems_and_errors():
    q, k, v = make(1, 4, 4, 5, 9, 64, torch.float16)
    o, lse = flashcore.attention_fp8(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert (o == 0).all() and (lse == -math.inf).all()
    assert flashcore.attention_fp8(q[:, :, :0], k, v).shape == (1, 4, 0, 64)
    q96, k96, v96 = make(1, 4, 4, 64, 64, 96, torch.float16)
    with pytest.raises(FlashcoreError) as e:
        flashcore.attention_fp8(q96, k96, v96)
    assert e.value.name == "FLASHCORE_ERROR_UNSUPPORTED_HEAD_DIM" and "64, 128, 256" in str(e.value)
    with pytest.raises(FlashcoreError, match="UNSUPPORTED_DTYPE"):
        flashcore.attention_fp8(q, k.bfloat16(), v.bfloat16())
    with pytest.raises(FlashcoreError, match="HEAD_RATIO"):
        flashcore.attention_fp8(make(1, 6, 4, 64, 64, 64, torch.float16)[0], k[:, :, :5], v[:, :, :5])


@needs_fp8
def test_runs_on_the_current_stream(seed):
    q, k, v = make(2, 8, 2, 1024, 1024, 128, torch.float16)
    expected = flashcore.attention_fp8(q * 2, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms: q2 is written long after this is queued
        q2 = q * 2
        o = flashcore.attention_fp8(q2, k, v)  # must wait for q2: same stream
    side.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(o, expected)


@needs_fp8
def test_torch_compile_and_cuda_graphs(seed):
    q, k, v = make(2, 8, 2, 256, 256, 64, torch.float16, "bshd")

    def f(q, k, v):
        return flashcore.attention_fp8(q, k, v, causal=True, layout="bshd") * 2

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)

    static = [t.clone() for t in (q, k, v)]
    f(*static)  # load the kernels before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(*static)
    q3, k3, v3 = make(2, 8, 2, 256, 256, 64, torch.float16, "bshd")
    for dst, src in zip(static, (q3, k3, v3)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, f(q3, k3, v3))


@needs_fp8
def test_transformers_fp8_backend_runs_a_small_llama(seed):
    pytest.importorskip("transformers")
    from flashcore import transformers_backend
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        initializer_range=0.05, pad_token_id=0, eos_token_id=None,
    )
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 1000, (2, 100), device="cuda")
    name = flashcore.register_transformers(fp8=True)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits
        model.set_attn_implementation(name)
        transformers_backend.stats["flashcore_fp8"] = 0
        transformers_backend.stats["sdpa"].clear()
        ours = model(ids).logits
        assert transformers_backend.stats["flashcore_fp8"] == 2  # one prefill call per layer
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    err = rel_l2(ours, ref)
    print(f"FP8 logits rel L2 vs SDPA {err:.3e}; stats {transformers_backend.stats}")
    assert not torch.isnan(ours).any()
    # FP8 attention in both layers moves this random-weight model's logits by about 9%
    # (relative L2; measured with a CPU model of the FP8 path in place of SDPA).
    assert err < 0.2
    assert tokens.shape == (2, 108)
    assert transformers_backend.stats["sdpa"] == {}
    assert transformers_backend.stats["flashcore_fp8"] == 2 + 2 * 8  # prefill, then 7 decode steps, 2 layers
