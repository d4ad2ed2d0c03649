"""flashcore as transformers' attention implementation in a small random Llama (built from
a config: no download): logits and greedy generation against SDPA."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashcore
from flashcore import transformers_backend

from conftest import requires_gpu

pytestmark = requires_gpu


def small_llama(dtype, hidden_size=512):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden_size,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA 4:1, head dim 64
        max_position_embeddings=2048,
        initializer_range=0.05,  # spread-out logits: greedy ties would make the test flaky
        pad_token_id=0,
        eos_token_id=None,  # generate exactly max_new_tokens
    )
    return LlamaForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def test_a_head_dim_without_its_own_kernel_runs_on_flashcore(seed):
    # Head dim 80 (hidden 640 over 8 heads, as Phi-2's): padded onto the 96 kernel rather
    # than left to SDPA, prefill and cached steps alike.
    name = flashcore.register_transformers()
    model = small_llama(torch.float16, hidden_size=640)
    ids = torch.randint(1, 1000, (2, 100), device="cuda")
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        logits_sdpa = model(ids).logits
        model.set_attn_implementation(name)
        reset_stats()
        logits_ours = model(ids).logits
        out = model(ids[:, :99], use_cache=True)
        model(ids[:, 99:], past_key_values=out.past_key_values, use_cache=True)
    err = rel_l2(logits_ours, logits_sdpa)
    print(f"head dim 80: logits rel L2 vs SDPA {err:.2e}; stats {transformers_backend.stats}")
    assert err <= 5e-3
    assert transformers_backend.stats["sdpa"] == {}
    assert transformers_backend.stats["flashcore"] >= 3 * 2


def reset_stats():
    transformers_backend.stats["flashcore"] = 0
    transformers_backend.stats["sdpa"].clear()
    transformers_backend._warned.clear()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_logits_and_greedy_tokens_match_sdpa(dtype, seed):
    name = flashcore.register_transformers()
    model = small_llama(dtype)
    ids = torch.randint(1, 1000, (2, 100), device="cuda")

    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        logits_sdpa = model(ids).logits
        tokens_sdpa = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        model.set_attn_implementation(name)
        reset_stats()
        logits_ours = model(ids).logits
        tokens_ours = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)

    err = rel_l2(logits_ours, logits_sdpa)
    print(f"{dtype}: logits rel L2 vs SDPA {err:.2e}; stats {transformers_backend.stats}")
    assert err <= (5e-3 if dtype == torch.float16 else 2e-2)
    # Prefill and every decode step (2 layers each) went to flashcore, nothing to SDPA.
    assert transformers_backend.stats["sdpa"] == {}
    assert transformers_backend.stats["flashcore"] >= 2 * (1 + 1 + 63)

    # Greedy decoding, step by step along SDPA's tokens (teacher-forced, KV cache): both
    # backends must pick the same token at every step except where SDPA's own top two
    # are tied within the noise the two backends show (random weights leave near-ties that
    # any change of summation order flips; SDPA's math backend flips them too).
    steps = {}
    with torch.no_grad():
        for backend in ("sdpa", name):
            model.set_attn_implementation(backend)
            out = model(ids, use_cache=True, logits_to_keep=1)  # as generate's prefill
            logits = [out.logits[:, -1].float()]
            cache = out.past_key_values
            for t in range(63):
                nxt = tokens_sdpa[:, ids.shape[1] + t : ids.shape[1] + t + 1]
                out = model(nxt, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits[:, -1].float())
            steps[backend] = torch.stack(logits, dim=1)  # [B, 64, vocab]
    ref, ours = steps["sdpa"], steps[name]
    assert torch.equal(ref.argmax(-1), tokens_sdpa[:, ids.shape[1]:])  # the teacher-forced path is SDPA's
    assert rel_l2(ours, ref) <= (5e-3 if dtype == torch.float16 else 2e-2)
    noise = (ours - ref).abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    tie = (top2[..., 0] - top2[..., 1]) <= 4 * noise
    agree = ours.argmax(-1) == ref.argmax(-1)
    print(f"{dtype}: decode steps agreeing with SDPA {int(agree.sum())}/{agree.numel()}, "
          f"near-ties {int(tie.sum())}, max |logit difference| {noise:.2e}")
    assert bool((agree | tie).all()), "flashcore picked another token where SDPA's choice was clear"

    differ = (tokens_ours != tokens_sdpa).any(dim=0).nonzero()
    same = 64 if len(differ) == 0 else int(differ[0]) - ids.shape[1]
    print(f"{dtype}: free-running greedy tokens identical to SDPA's for {same} of 64 steps")
    if same < 64:
        assert bool(tie[:, same].any()), "free-running generation left SDPA's path at a step without a tie"


def test_padded_batches_run_on_flashcore(seed):
    # Left-padded prompts (as generate() pads them) and the cached decode steps after
    # them run as variable-length calls over each sequence's own tokens; the logits of
    # every real token match SDPA's, and no call goes to SDPA.
    name = flashcore.register_transformers()
    model = small_llama(torch.float16)
    ids = torch.randint(1, 1000, (3, 100), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    mask[2, :60] = 0
    steps = torch.randint(1, 1000, (3, 16), device="cuda")
    results = {}
    with torch.no_grad():
        for backend in ("sdpa", name):
            model.set_attn_implementation(backend)
            reset_stats()
            transformers_backend.stats["flashcore_padded"] = 0
            out = model(ids, attention_mask=mask, use_cache=True)
            logits, cache, m = [out.logits[mask.bool()].float()], out.past_key_values, mask
            for t in range(steps.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                out = model(steps[:, t : t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits[:, -1].float())
            results[backend] = logits
    prompt_err = rel_l2(results[name][0], results["sdpa"][0])
    step_err = rel_l2(torch.stack(results[name][1:]), torch.stack(results["sdpa"][1:]))
    print(f"padded batch: prompt logits rel L2 vs SDPA {prompt_err:.2e}, decode steps {step_err:.2e}; "
          f"stats {transformers_backend.stats}")
    assert prompt_err <= 5e-3 and step_err <= 5e-3
    assert transformers_backend.stats["sdpa"] == {}
    assert transformers_backend.stats["flashcore_padded"] == 2 * (1 + 16)


def test_masks_other_than_padding_stay_right_through_the_fallback(seed):
    # A sliding-window mask is not padding: SDPA computes it.
    import torch.nn.functional as F

    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 4  # SDPA's path repeats the KV heads by it
    q = torch.randn(2, 8, 40, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 2, 40, 64, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    i, j = torch.arange(40, device="cuda")[:, None], torch.arange(40, device="cuda")[None]
    mask = ((j <= i) & (j > i - 16)).expand(2, 1, 40, 40)
    reset_stats()
    with pytest.warns(UserWarning, match="mask other than padding"):
        out, _ = transformers_backend.attention_forward(module, q, k, v, mask)
    assert len(transformers_backend.stats["sdpa"]) == 1
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    assert rel_l2(out, want.transpose(1, 2)) <= 1e-3


@pytest.mark.parametrize("sk", [40, 3000], ids=["forward-kernels", "decode-kernels"])
def test_padded_decode_steps_read_the_cache_in_place(seed, sk, monkeypatch):
    # A left-padded decode step reads the contiguous [B, Hkv, Sk, D] cache where it is
    # (no gathered copy): against SDPA, and against the gathering path on the same
    # cache held in a wider, non-contiguous tensor.
    import torch.nn.functional as F
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 4
    b, hkv, d = 4, 2, 128
    q = torch.randn(b, 4 * hkv, 1, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    pad = torch.ones(b, sk, dtype=torch.bool, device="cuda")
    for x, n in enumerate([0, 7, sk // 2, sk - 1]):
        pad[x, :n] = False
    mask = sdpa_mask(batch_size=b, q_length=1, kv_length=sk, q_offset=sk - 1, mask_function=causal_mask_function,
                     attention_mask=pad, allow_is_causal_skip=False, device="cuda")
    seen = []
    real = transformers_backend.launch_varlen
    monkeypatch.setattr(transformers_backend, "launch_varlen", lambda q_, k_, *a: seen.append(k_.data_ptr()) or real(q_, k_, *a))
    reset_stats()
    with torch.no_grad():
        out, _ = transformers_backend.attention_forward(module, q, k, v, mask)
        wide_k = torch.zeros(b, hkv, sk, 2 * d, device="cuda", dtype=torch.float16)[..., :d]
        wide_v = torch.zeros_like(wide_k)
        wide_k.copy_(k)
        wide_v.copy_(v)
        gathered, _ = transformers_backend.attention_forward(module, q, wide_k, wide_v, mask)
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    assert seen[0] == k.data_ptr() and seen[1] != wide_k.data_ptr()
    assert transformers_backend.stats["sdpa"] == {}
    err, err_gathered = rel_l2(out, want.transpose(1, 2)), rel_l2(gathered, want.transpose(1, 2))
    print(f"Sk {sk}: in place {err:.2e}, gathered {err_gathered:.2e}")
    assert err <= 2e-3 and err_gathered <= 2e-3
