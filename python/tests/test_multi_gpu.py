"""flashcore with tensors on a second GPU (cuda:1) while torch's current device is cuda:0:
a transformers model placed on cuda:1 or split across two GPUs. Checks the forward
(against float64 on the CPU), its stream, calls alternating between the GPUs from one
thread and from two, the variable-length call, merge, append_kv and a split-KV decode on a
contiguous and a paged cache, the transformers backend against SDPA, and that tensors on
two devices are refused. Needs two CUDA GPUs: every test skips otherwise."""

import math
import threading

import pytest
import torch

import flashcore
from flashcore import serving, transformers_backend

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # rel L2 against float64 (test_gpu.py's)
MODEL_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}  # logits vs SDPA (test_transformers_gpu.py's)
DEV0, DEV1 = torch.device("cuda", 0), torch.device("cuda", 1)
DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])


@pytest.fixture(autouse=True)
def current_device_is_0():
    """Every test runs with cuda:0 current, and flashcore must leave it so."""
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0, "torch's current device changed"


def rel_l2(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def reference(q, k, v, causal):
    """Float64 O and LSE on the CPU for [B, H, S, D] inputs, bottom-right causal, GQA by head count."""
    q, k, v = (t.detach().cpu().double() for t in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    s = (q @ k.repeat_interleave(hq // hkv, dim=1).transpose(-1, -2)) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    o = (p @ v.repeat_interleave(hq // hkv, dim=1)) / torch.where(l > 0, l, torch.ones_like(l))
    return o, (m + torch.log(l)).squeeze(-1)


def assert_close(o, o_ref, dtype, what="output"):
    assert torch.isfinite(o).all(), f"{what}: non-finite values"
    err = rel_l2(o, o_ref)
    assert err <= TOLERANCE[dtype], f"{what}: rel L2 {err:.2e}"


def poison(device, *shapes_dtypes):
    """NaN in the blocks `device`'s allocator hands out next: an unwritten output shows."""
    blocks = [torch.full(s, math.nan, dtype=dt, device=device) for s, dt in shapes_dtypes]
    del blocks


def make(device, b, hq, hkv, sq, sk, d, dtype):
    return tuple(torch.randn(b, h, s, d, device=device, dtype=dtype) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))


def garbage(*shape, dtype):
    """+-200 on cuda:1: cache rows no call may read, which no kernel reading them could hide."""
    return torch.where(torch.rand(*shape, device=DEV1) < 0.5, 200.0, -200.0).to(dtype)


@DTYPES
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("sq, sk", [(113, 113), (113, 300)])
def test_forward_on_the_second_gpu(dtype, causal, d, sq, sk, seed):
    q, k, v = make(DEV1, 2, 8, 2, sq, sk, d, dtype)  # GQA 4:1
    poison(DEV1, ((2, 8, sq, d), dtype), ((2, 8, sq), torch.float32))
    on_dev0 = torch.cuda.memory_allocated(DEV0)
    o, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    assert torch.cuda.current_device() == 0
    assert o.device == DEV1 and lse.device == DEV1
    assert torch.cuda.memory_allocated(DEV0) == on_dev0, "the call allocated on cuda:0"
    o_ref, lse_ref = reference(q, k, v, causal)
    assert_close(o, o_ref, dtype)
    assert (lse.cpu().double() - lse_ref).abs().max().item() <= 1e-2


def test_runs_on_the_current_stream_of_the_tensors_gpu(seed):
    # cuda:1's current stream is a side stream, cuda:0 the current device: the call must
    # queue behind q2, written on that side stream after a long sleep.
    q, k, v = make(DEV1, 2, 8, 2, 1024, 1024, 128, torch.float16)
    expected = flashcore.attention(q * 2, k, v)
    side = torch.cuda.Stream(DEV1)
    side.wait_stream(torch.cuda.current_stream(DEV1))
    with torch.cuda.device(1), torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms
        q2 = q * 2
        with torch.cuda.device(0):
            assert torch.cuda.current_stream(DEV1) == side and torch.cuda.current_device() == 0
            o = flashcore.attention(q2, k, v)
    side.synchronize()
    assert torch.equal(o, expected)


def test_calls_alternate_between_the_gpus(seed):
    # Each round's configuration on cuda:0, then on cuda:1 (96: a head dim new to this file):
    # kernels loaded for one device must never be launched on the other.
    for r in range(6):
        dtype, d, causal = (torch.float16, torch.bfloat16)[r % 2], (64, 96, 128)[r % 3], r >= 3
        for device in (DEV0, DEV1):
            q, k, v = make(device, 1, 8, 2, 113, 200, d, dtype)
            o = flashcore.attention(q, k, v, causal=causal)
            assert o.device == device and torch.cuda.current_device() == 0
            assert_close(o, reference(q, k, v, causal)[0], dtype, f"round {r} on {device}")


def test_two_threads_one_gpu_each(seed):
    # Each thread passes its GPU's tensors and sets nothing; both start at once, so the
    # first calls (head dims new to this file) make and load kernels on both at once.
    configs = [(192, torch.float16), (256, torch.bfloat16), (32, torch.float16)]
    inputs = {dev: [make(dev, 2, 8, 2, 113, 300, d, dt) for d, dt in configs] for dev in (DEV0, DEV1)}
    results, errors, barrier = {}, [], threading.Barrier(2)

    def work(dev):
        try:
            barrier.wait()
            results[dev] = [flashcore.attention(*qkv, causal=True) for _ in range(4) for qkv in inputs[dev]]
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(dev,)) for dev in (DEV0, DEV1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for dev in (DEV0, DEV1):
        torch.cuda.synchronize(dev)
        refs = [reference(*qkv, True)[0] for qkv in inputs[dev]]
        for i, o in enumerate(results[dev]):
            assert o.device == dev
            assert_close(o, refs[i % len(configs)], configs[i % len(configs)][1], f"call {i} on {dev}")



@DTYPES
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_on_the_second_gpu(dtype, causal, seed):
    lens = [(113, 113), (7, 300), (300, 64), (1, 1)]  # (queries, keys) per sequence
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in zip(*lens))
    q = torch.randn(int(cu_q[-1]), 8, 128, device=DEV1, dtype=dtype)
    k, v = (torch.randn(int(cu_k[-1]), 2, 128, device=DEV1, dtype=dtype) for _ in range(2))
    poison(DEV1, (q.shape, dtype))
    o = flashcore.attention_varlen(q, k, v, cu_q.to(DEV1), cu_k.to(DEV1), 300, causal=causal,
                                   host_cu_seqlens_q=cu_q, host_cu_seqlens_k=cu_k)
    assert o.device == DEV1 and o.shape == q.shape
    as_bhsd = lambda t: t.transpose(0, 1).unsqueeze(0)  # noqa: E731
    for b in range(len(lens)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o_ref, _ = reference(as_bhsd(q[rows]), as_bhsd(k[keys]), as_bhsd(v[keys]), causal)
        assert_close(as_bhsd(o[rows]), o_ref, dtype, f"sequence {b}")


def test_merge_on_the_second_gpu(seed):
    q, k, v = make(DEV1, 2, 8, 2, 37, 1033, 128, torch.float16)
    shards = zip(k.split([700, 333], 2), v.split([700, 333], 2))
    parts = [flashcore.attention(q, ks, vs, return_lse=True) for ks, vs in shards]
    out = flashcore.merge([o for o, _ in parts], [lse for _, lse in parts], layout="bhsd")
    assert out.device == DEV1
    assert_close(out, reference(q, k, v, False)[0], torch.float16)


@DTYPES
@pytest.mark.parametrize("page", [0, 16], ids=["contiguous", "page16"])
def test_append_then_split_kv_decode_on_the_second_gpu(dtype, page, seed):
    b, hq, hkv, d, capacity, snew = 2, 32, 8, 128, 4096, 3
    lens = [capacity - snew, 777]  # full after the append; a short one
    keys = torch.randn(b, capacity, hkv, d, device=DEV1, dtype=dtype)  # each sequence's logical cache
    values = torch.randn_like(keys)
    for i, n in enumerate(lens):
        for t in (keys, values):
            t[i, n:] = garbage(capacity - n, hkv, d, dtype=dtype)
    table, k_cache, v_cache = None, keys.clone(), values.clone()
    if page:  # a pool holding the sequences in shuffled pages among spare garbage pages
        pool = b * capacity // page + 5
        table = torch.randperm(pool, device=DEV1)[: b * capacity // page].view(b, -1).int()
        k_cache, v_cache = garbage(pool, page, hkv, d, dtype=dtype), garbage(pool, page, hkv, d, dtype=dtype)
        for cache, logical in ((k_cache, keys), (v_cache, values)):
            cache[table.flatten().long()] = logical.view(-1, page, hkv, d)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV1)
    host = dict(host_seqlens=lens, host_block_table=None if table is None else table.cpu())

    k_new, v_new = (torch.randn(b, snew, hkv, d, device=DEV1, dtype=dtype) for _ in range(2))
    flashcore.append_kv(k_cache, v_cache, seqlens, k_new, v_new, block_table=table, **host)
    for i, n in enumerate(lens):
        keys[i, n : n + snew], values[i, n : n + snew] = k_new[i], v_new[i]
    got = [t if table is None else t[table.flatten().long()].view(b, capacity, hkv, d) for t in (k_cache, v_cache)]
    assert torch.equal(got[0], keys) and torch.equal(got[1], values), "append_kv wrote the wrong rows"
    assert seqlens.tolist() == lens

    seqlens += snew
    q = torch.randn(b, snew, hq, d, device=DEV1, dtype=dtype)
    poison(DEV1, ((b, snew, hq, d), dtype), ((b, hq, snew), torch.float32))
    o, lse = flashcore.decode(q, k_cache, v_cache, seqlens, block_table=table, causal=True, return_lse=True)
    assert o.device == DEV1 and lse.device == DEV1
    plan = (1, dtype, tuple(q.shape), k_cache.dtype, tuple(k_cache.shape), None if table is None else table.shape[1])
    assert serving._workspace_sizes.get(plan, 0) > 0, "one split: the split-KV path and its merge did not run"
    for i, n in enumerate(seqlens.tolist()):
        o_ref, lse_ref = reference(q[i : i + 1].transpose(1, 2), keys[i : i + 1, :n].transpose(1, 2),
                                   values[i : i + 1, :n].transpose(1, 2), True)
        assert_close(o[i : i + 1].transpose(1, 2), o_ref, dtype, f"sequence {i}")
        assert (lse[i : i + 1].cpu().double() - lse_ref).abs().max().item() <= 1e-2



def small_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2,  # GQA 4:1, head dim 64
        max_position_embeddings=2048, initializer_range=0.05,  # spread-out logits: few greedy ties
        pad_token_id=0, eos_token_id=None,  # generate exactly max_new_tokens
    )
    return LlamaForCausalLM(config).to(dtype=dtype).eval()


def to_device(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(y, device) for y in x)
    if isinstance(x, dict):
        return {key: to_device(y, device) for key, y in x.items()}
    return x


def place(model, placement):
    """The model on cuda:1, or split: embeddings and layer 0 on cuda:0, layer 1, the final
    norm and the head on cuda:1, with hooks moving what crosses (as accelerate's device_map
    does). Returns the device the input ids go to."""
    if placement == "cuda1":
        model.to(DEV1)
        return DEV1
    model.to(DEV0)
    for module in (model.model.layers[1], model.model.norm, model.lm_head):
        module.to(DEV1)
    model.model.layers[1].register_forward_pre_hook(lambda m, a, kw: (to_device(a, DEV1), to_device(kw, DEV1)),
                                                    with_kwargs=True)
    model.lm_head.register_forward_hook(lambda m, a, out: out.to(DEV0))
    return DEV0


def reset_stats():
    stats = transformers_backend.stats
    stats["flashcore"] = stats["flashcore_fp8"] = stats["flashcore_padded"] = 0
    stats["sdpa"].clear()
    transformers_backend._warned.clear()


def assert_same_greedy_tokens(ref, ours, prompt, tol):
    """generate() outputs of SDPA (ref) and flashcore: each row's new tokens equal, or parting
    only at a step where SDPA's top two logits lie within the noise between the two backends
    (what test_transformers_gpu.py accepts), with close logits up to there."""
    new_ref, new_ours = ref.sequences[:, prompt:].cpu(), ours.sequences[:, prompt:].cpu()
    logits_ref, logits_ours = (torch.stack(g.logits, 1).float().cpu() for g in (ref, ours))
    for row in range(new_ref.shape[0]):
        differ = (new_ref[row] != new_ours[row]).nonzero()
        steps = new_ref.shape[1] if len(differ) == 0 else int(differ[0]) + 1  # same inputs up to there
        a, b = logits_ours[row, :steps], logits_ref[row, :steps]
        assert rel_l2(a, b) <= tol, f"row {row}: logits of the first {steps} steps differ"
        if len(differ):
            top2 = b[-1].topk(2).values
            assert (top2[0] - top2[1]).item() <= 4 * (a - b).abs().max().item(), (
                f"row {row} left SDPA's tokens at step {steps - 1}, where SDPA's choice was clear")


@pytest.mark.parametrize("placement", ["cuda1", "split"])
@DTYPES
def test_transformers_model_on_the_second_gpu(placement, dtype, seed):
    pytest.importorskip("transformers")
    name = flashcore.register_transformers()
    model = small_llama(dtype)
    device = place(model, placement)
    ids = torch.randint(1, 1000, (2, 60), device=device)
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding, as generate() pads the shorter of two prompts
    ids[1, :17] = 0  # the pad token
    gen = dict(attention_mask=mask, max_new_tokens=32, do_sample=False, output_logits=True,
               return_dict_in_generate=True)
    out = {}
    with torch.no_grad():
        for backend in ("sdpa", name):
            model.set_attn_implementation(backend)
            reset_stats()
            logits = model(ids[:1]).logits  # no padding: the forward
            padded = model(ids, attention_mask=mask).logits[mask.bool()]  # variable length
            out[backend] = (logits, padded, model.generate(ids, **gen))
    stats = transformers_backend.stats  # of flashcore's run
    print(f"{placement} {dtype}: stats {stats}")
    assert torch.cuda.current_device() == 0
    assert stats["sdpa"] == {}, "calls went to SDPA"
    assert stats["flashcore"] >= 2 * (1 + 1 + 32) and stats["flashcore_padded"] >= 2 * (1 + 1)
    (logits_s, padded_s, gen_s), (logits_f, padded_f, gen_f) = out["sdpa"], out[name]
    tol = MODEL_TOLERANCE[dtype]
    assert rel_l2(logits_f, logits_s) <= tol and rel_l2(padded_f, padded_s) <= tol
    assert_same_greedy_tokens(gen_s, gen_f, ids.shape[1], tol)



def test_tensors_on_two_gpus_are_refused(seed):
    q, k, v = make(DEV1, 1, 8, 2, 64, 64, 64, torch.float16)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashcore.attention(q.to(DEV0), k, v)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]  # [S, H, D]
    cu = torch.tensor([0, 64], dtype=torch.int32, device=DEV1)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashcore.attention_varlen(*packed, cu.to(DEV0), cu, 64)
    o, lse = flashcore.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashcore.merge([o, o], [lse.to(DEV0), lse.to(DEV0)], layout="bhsd")
    # A cache on cuda:1 and new tokens, a query or lengths on cuda:0: refused, the cache untouched.
    k_cache, v_cache = (torch.randn(1, 128, 2, 64, device=DEV1, dtype=torch.float16) for _ in range(2))
    seqlens = torch.tensor([64], dtype=torch.int32, device=DEV1)
    saved = [t.clone() for t in (k_cache, v_cache, seqlens)]
    new = torch.randn(1, 1, 2, 64, device=DEV1, dtype=torch.float16)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashcore.append_kv(k_cache, v_cache, seqlens, new.to(DEV0), new)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashcore.append_kv(k_cache, v_cache, seqlens.to(DEV0), new, new)
    with pytest.raises(ValueError, match="one CUDA device"):
        flashcore.decode(q.transpose(1, 2)[:, :1].to(DEV0), k_cache, v_cache, seqlens)
    torch.cuda.synchronize(DEV1)
    assert all(torch.equal(a, b) for a, b in zip(saved, (k_cache, v_cache, seqlens))), "a refused call wrote"
