"""flashcore as transformers' attention implementation in small random Llama, Mistral,
Gemma 2 and Gemma 3 models (built from a config: no download): logits and greedy
generation against SDPA (Gemma 2, whose logit soft-capping SDPA drops: against eager
attention), sliding-window layers included."""

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
    for key in ("flashcore", "flashcore_padded", "flashcore_window"):
        transformers_backend.stats[key] = 0
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


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_padded_batches_run_on_flashcore(seed, grad_mode):
    # Left-padded prompts (as generate() pads them) and the cached decode steps after
    # them run as variable-length calls over each sequence's own tokens; the logits of
    # every real token match SDPA's, and no call goes to SDPA. Under inference_mode the
    # masks are inference tensors, which have no version counter to cache their plans by.
    name = flashcore.register_transformers()
    model = small_llama(torch.float16)
    ids = torch.randint(1, 1000, (3, 100), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    mask[2, :60] = 0
    steps = torch.randint(1, 1000, (3, 16), device="cuda")
    results = {}
    with getattr(torch, grad_mode)():
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


# ---- sliding-window layers ----------------------------------------------------------------


def small_mistral(dtype, window):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA 4:1, head dim 64
        max_position_embeddings=2048,
        initializer_range=0.05,
        sliding_window=window,
        pad_token_id=0,
        eos_token_id=None,
    )
    return MistralForCausalLM(config).to(device="cuda", dtype=dtype).eval()


def run_prompts_and_steps(model, ids, mask, steps, short):
    """Logits of a padded prompt's real tokens, then of each cached decode step after it
    (the lengths growing past the window), of the prompt unpadded, and of a prompt of
    `short` tokens (shorter than the window: transformers passes no mask)."""
    out = model(ids, attention_mask=mask, use_cache=True)
    logits, cache, m = [out.logits[mask.bool()].float()], out.past_key_values, mask
    for t in range(steps.shape[1]):
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
        out = model(steps[:, t : t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits[:, -1].float())
    logits.append(model(ids).logits.float())
    logits.append(model(ids[:, :short]).logits.float())
    return logits


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_sliding_window_layers_match_sdpa_on_flashcore(dtype, seed, monkeypatch):
    # Mistral with a window of 16 keys, 64-token prompts (one left-padded), 24 decode steps
    # against its sliding-window cache: every sliding-window call runs on flashcore's
    # windowed kernels (masks checked to be exactly the window), none on SDPA, and the
    # logits match SDPA's, which applies the masks as they are.
    name = flashcore.register_transformers()
    model = small_mistral(dtype, 16)
    ids = torch.randint(1, 1000, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    steps = torch.randint(1, 1000, (2, 24), device="cuda")
    windows = []  # the window_size of each variable-length launch
    real = transformers_backend.launch_varlen
    monkeypatch.setattr(transformers_backend, "launch_varlen", lambda *a: windows.append(a[10]) or real(*a))
    results = {}
    with torch.no_grad():
        for backend in ("sdpa", name):
            model.set_attn_implementation(backend)
            reset_stats()
            results[backend] = run_prompts_and_steps(model, ids, mask, steps, short=12)
    assert windows == [(15, 0)] * (2 * (1 + 24 + 1))
    stats = transformers_backend.stats
    tolerance = 5e-3 if dtype == torch.float16 else 2e-2
    labels = ["padded prompt"] + [f"step {t}" for t in range(24)] + ["prompt", "short prompt"]
    for label, ours, ref in zip(labels, results[name], results["sdpa"]):
        err = rel_l2(ours, ref)
        assert err <= tolerance, f"{label}: logits rel L2 vs SDPA {err:.2e}"
    print(f"{dtype}: sliding window 16, stats {stats}")
    assert stats["sdpa"] == {}
    # Two layers: the prompts and steps come with masks (the window hides keys there), the
    # short prompt without one.
    assert stats["flashcore_padded"] == 2 * (1 + 24 + 1)
    assert stats["flashcore_window"] == stats["flashcore"] == 2 * (1 + 24 + 1 + 1)


def test_greedy_generation_with_a_sliding_window_matches_sdpa(seed):
    # generate() with left-padded prompts past the window: the same greedy tokens as SDPA,
    # but where SDPA's own top two are tied within the backends' noise.
    name = flashcore.register_transformers()
    model = small_mistral(torch.float16, 16)
    ids = torch.randint(1, 1000, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        tokens_sdpa = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
        model.set_attn_implementation(name)
        reset_stats()
        tokens_ours = model.generate(ids, attention_mask=mask, max_new_tokens=32, do_sample=False)
    assert transformers_backend.stats["sdpa"] == {}
    assert transformers_backend.stats["flashcore_window"] == 2 * 32
    differ = (tokens_ours != tokens_sdpa).any(dim=0).nonzero()
    same = 32 if len(differ) == 0 else int(differ[0]) - ids.shape[1]
    print(f"greedy tokens identical to SDPA's for {same} of 32 steps")
    if same < 32:
        # Teacher-forced along SDPA's tokens up to the first difference: a near-tie there.
        with torch.no_grad():
            prefix = tokens_sdpa[:, : ids.shape[1] + same]
            pmask = torch.cat([mask, torch.ones_like(prefix[:, ids.shape[1] :])], dim=1)
            model.set_attn_implementation("sdpa")
            ref = model(prefix, attention_mask=pmask).logits[:, -1].float()
            model.set_attn_implementation(name)
            ours = model(prefix, attention_mask=pmask).logits[:, -1].float()
        noise = (ours - ref).abs().max().item()
        top2 = ref.topk(2, dim=-1).values
        assert bool(((top2[:, 0] - top2[:, 1]) <= 4 * noise).any()), "left SDPA's path without a tie"


def test_alternating_sliding_and_full_layers(seed):
    # Gemma 3's text model alternates sliding-window layers (sliding_window passed) and
    # full ones (none): each kind runs on flashcore with its own mask, the logits match
    # SDPA's, prompt and cached steps alike.
    try:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    except ImportError:
        pytest.skip("this transformers has no Gemma 3")
    config = Gemma3TextConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=2048,
        initializer_range=0.05,
        pad_token_id=0,
        eos_token_id=None,
    )
    name = flashcore.register_transformers()
    model = Gemma3ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 1000, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :21] = 0
    steps = torch.randint(1, 1000, (2, 8), device="cuda")
    results = {}
    with torch.no_grad():
        for backend in ("sdpa", name):
            model.set_attn_implementation(backend)
            reset_stats()
            results[backend] = run_prompts_and_steps(model, ids, mask, steps, short=12)
    stats = transformers_backend.stats
    for i, (ours, ref) in enumerate(zip(results[name], results["sdpa"])):
        err = rel_l2(ours, ref)
        assert err <= 2e-2, f"call {i}: logits rel L2 vs SDPA {err:.2e}"
    print(f"Gemma 3: stats {stats}")
    assert stats["sdpa"] == {}
    calls = 1 + 8 + 1 + 1  # per layer
    assert stats["flashcore"] == 4 * calls
    assert stats["flashcore_window"] == 2 * calls  # the two sliding-window layers


def test_a_mask_other_than_the_layers_window_stays_right_through_the_fallback(seed):
    # A sliding-window layer handed a mask of another window (or none): SDPA computes it.
    import torch.nn.functional as F

    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 4
    q = torch.randn(2, 8, 40, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 2, 40, 64, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    i, j = torch.arange(40, device="cuda")[:, None], torch.arange(40, device="cuda")[None]
    mask = ((j <= i) & (j > i - 16)).expand(2, 1, 40, 40)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    reset_stats()
    with torch.no_grad():
        out, _ = transformers_backend.attention_forward(module, q, k, v, mask, sliding_window=16)
        assert transformers_backend.stats["flashcore_window"] == 1 and transformers_backend.stats["sdpa"] == {}
        assert rel_l2(out, want.transpose(1, 2)) <= 1e-3
        with pytest.warns(UserWarning, match="mask other than padding"):
            out, _ = transformers_backend.attention_forward(module, q, k, v, mask, sliding_window=17)
    assert len(transformers_backend.stats["sdpa"]) == 1
    assert rel_l2(out, want.transpose(1, 2)) <= 1e-3


# ---- logit soft-capping: Gemma 2 --------------------------------------------------------------


def small_gemma2(dtype, softcap):
    """A random-weight Gemma 2: sliding-window layers of 16 keys alternating with full ones,
    every layer's scores capped at `softcap` (the final logits at 30, as Gemma 2's)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=softcap,
        max_position_embeddings=2048,
        initializer_range=0.05,
        pad_token_id=0,
        eos_token_id=None,
    )
    return Gemma2ForCausalLM(config).to(device="cuda", dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("softcap", [50.0, 0.5], ids=["cap50", "cap0.5"])
def test_gemma2_matches_eager_attention_on_flashcore(dtype, softcap, seed, monkeypatch):
    # Gemma 2 passes softcap on every layer and sliding_window on alternate ones: a
    # left-padded prompt, cached decode steps past the window, the prompt unpadded and a
    # short one all run on flashcore (capped; windowed on the sliding layers), none on
    # SDPA, and the logits match transformers' eager attention, which caps (its SDPA path
    # would drop the cap). A cap of 0.5 bends these scores: eager attention without it is
    # far from both.
    name = flashcore.register_transformers()
    model = small_gemma2(dtype, softcap)
    ids = torch.randint(1, 1000, (2, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :21] = 0
    steps = torch.randint(1, 1000, (2, 8), device="cuda")
    caps = []  # the softcap of each flashcore launch (after the window)
    real_launch, real_varlen = transformers_backend.launch, transformers_backend.launch_varlen
    monkeypatch.setattr(transformers_backend, "launch", lambda *a: caps.append(a[9]) or real_launch(*a))
    monkeypatch.setattr(transformers_backend, "launch_varlen", lambda *a: caps.append(a[11]) or real_varlen(*a))
    results = {}
    with torch.no_grad():
        for backend in ("eager", name):
            model.set_attn_implementation(backend)
            reset_stats()
            results[backend] = run_prompts_and_steps(model, ids, mask, steps, short=12)
    stats = transformers_backend.stats
    tolerance = 5e-3 if dtype == torch.float16 else 2e-2
    for i, (ours, ref) in enumerate(zip(results[name], results["eager"])):
        err = rel_l2(ours, ref)
        assert err <= tolerance, f"call {i}: logits rel L2 vs eager {err:.2e}"
    print(f"Gemma 2, softcap {softcap}, {dtype}: stats {stats}")
    assert stats["sdpa"] == {}
    calls = 1 + 8 + 1 + 1  # per layer
    assert stats["flashcore"] == 4 * calls and stats["flashcore_window"] == 2 * calls
    assert caps == [softcap] * (4 * calls)
    if softcap == 0.5:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
            model.set_attn_implementation("eager")
            uncapped = run_prompts_and_steps(model, ids, mask, steps, short=12)
        off = min(rel_l2(u, ref) for u, ref in zip(uncapped, results["eager"]))
        assert off > 3 * tolerance, f"the cap changes the logits by only {off:.2e}"


def test_softcapped_calls_through_the_fallback_keep_their_cap(seed):
    # A soft-capped call handed a mask flashcore does not take (per head) runs on explicit
    # capped attention; one it takes runs on flashcore; both give the capped attention.
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(2, 8, 40, 64, device="cuda", dtype=torch.bfloat16) * 3
    k = torch.randn(2, 2, 40, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    i, j = torch.arange(40, device="cuda")[:, None], torch.arange(40, device="cuda")[None]
    causal = (j <= i).expand(2, 1, 40, 40)
    s = (q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2)) / 8
    s = torch.tanh(s / 2.0) * 2.0
    want = (s.masked_fill(~causal, float("-inf")).softmax(-1) @ v.double().repeat_interleave(4, 1)).transpose(1, 2)
    reset_stats()
    with torch.no_grad():
        out, _ = transformers_backend.attention_forward(module, q, k, v, causal, softcap=2.0)
        assert transformers_backend.stats["flashcore_padded"] == 1 and transformers_backend.stats["sdpa"] == {}
        assert rel_l2(out, want) <= 2e-2
        out, _ = transformers_backend.attention_forward(module, q, k, v, None, softcap=2.0)
        assert rel_l2(out, want) <= 2e-2
        with pytest.warns(UserWarning, match="softcap"):
            out, _ = transformers_backend.attention_forward(module, q, k, v, causal.expand(2, 8, 40, 40), softcap=2.0)
    assert len(transformers_backend.stats["sdpa"]) == 1
    assert rel_l2(out, want) <= 2e-2


def test_attention_calls_compile_to_one_graph(monkeypatch):
    """Under torch.compile(fullgraph=True) the backend's checks trace: the GPU's compute
    capability (read from get_device_properties, which compile folds to a constant, on a
    device not seen before) and a fallback (whose warning compile cannot trace, so it is
    left out there)."""
    monkeypatch.setattr(transformers_backend, "_capabilities", {})
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 4  # what SDPA's path reads for GQA
    q = torch.randn(1, 8, 64, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)

    def step(q, k, v):
        served, _ = transformers_backend.attention_forward(module, q, k, v, None)
        dropped, _ = transformers_backend.attention_forward(module, q, k, v, None, dropout=0.1)
        return served, dropped

    with torch.no_grad():
        served, dropped = torch.compile(step, fullgraph=True)(q, kv, kv)
        want = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    assert rel_l2(served.transpose(1, 2), want) < 5e-3
    assert dropped.shape == served.shape and torch.isfinite(dropped).all()
