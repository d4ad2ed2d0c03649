"""The transformers registration, without a GPU."""

import pytest

transformers = pytest.importorskip("transformers")

import flashcore
from flashcore import transformers_backend


def test_register_puts_flashcore_in_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = flashcore.register_transformers()
    assert name == "fcore" and "flash" not in name
    assert AttentionInterface._global_mapping[name] is transformers_backend.attention_forward
    assert AttentionMaskInterface._global_mapping[name] is sdpa_mask


def test_names_with_flash_are_refused():
    with pytest.raises(ValueError, match="flash"):
        flashcore.register_transformers("my_flash_core")


def test_a_model_accepts_the_name():
    from transformers import LlamaConfig, LlamaForCausalLM

    name = flashcore.register_transformers()
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name


def test_fp8_registers_its_own_name():
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = flashcore.register_transformers(fp8=True)
    assert name == "fcore-fp8"
    assert AttentionInterface._global_mapping[name] is transformers_backend.attention_forward_fp8
    assert AttentionMaskInterface._global_mapping[name] is sdpa_mask
    # The 16-bit name keeps its 16-bit function.
    assert AttentionInterface._global_mapping[flashcore.register_transformers()] is transformers_backend.attention_forward
    assert flashcore.register_transformers("mine", fp8=True) == "mine"
    assert AttentionInterface._global_mapping["mine"] is transformers_backend.attention_forward_fp8
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name


def test_fp8_options_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("FLASHCORE_FP8_SMOOTH_K", raising=False)
    monkeypatch.delenv("FLASHCORE_FP8_HADAMARD_SEED", raising=False)
    assert transformers_backend._fp8_options() == (False, None)
    monkeypatch.setenv("FLASHCORE_FP8_SMOOTH_K", "1")
    monkeypatch.setenv("FLASHCORE_FP8_HADAMARD_SEED", "0x10")
    assert transformers_backend._fp8_options() == (True, 16)
    monkeypatch.setenv("FLASHCORE_FP8_HADAMARD_SEED", "-1")
    with pytest.raises(ValueError, match="HADAMARD_SEED"):
        transformers_backend._fp8_options()


def _visible(sq, sk, causal, window):
    """[Sq, Sk] bool: the keys each query row sees in flashcore's documented forward
    (bottom-right causal; window_size (left, right) around the diagonal i + Sk - Sq, a
    negative side unbounded)."""
    import torch

    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
    diagonal = i + sk - sq
    left, right = window
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        seen &= j <= diagonal
    if left >= 0:
        seen &= j >= diagonal - left
    if right >= 0:
        seen &= j <= diagonal + right
    return seen


def _attend(q, k, v, seen, scale, softcap=0.0):
    """softmax(q kᵀ · scale) v in float64 over the keys `seen` shows each row ([..., Sq,
    Sk] bool), GQA by head count on dim -3, the scaled scores x capped to softcap ·
    tanh(x / softcap) (0: no cap); rows that see no key give zeros."""
    import math

    import torch

    group = q.shape[-3] // k.shape[-3]
    k = k.double().repeat_interleave(group, -3)
    v = v.double().repeat_interleave(group, -3)
    s = (q.double() @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    p = s.masked_fill(~seen, -math.inf).softmax(-1).nan_to_num(0.0)
    return p @ v


def _reference_launch(calls):
    """flashcore's documented forward on the CPU (bottom-right causal, key windows, soft
    caps, GQA by head count), standing in for the GPU launch so the backend's routing can
    be checked here. Each call is recorded as (q's shape, k's shape, causal, window), with
    the soft cap after them when there is one."""

    def launch(q, k, v, causal, scale, layout, out_layout, return_lse, window=(-1, -1), softcap=0.0):
        assert (layout, out_layout, return_lse) == ("bhsd", "bshd", False)
        assert type(softcap) is float
        calls.append((tuple(q.shape), tuple(k.shape), causal, tuple(window)) + ((softcap,) if softcap else ()))
        seen = _visible(q.shape[2], k.shape[2], causal, window)
        return _attend(q, k, v, seen, scale, softcap).to(q.dtype).transpose(1, 2).contiguous(), None

    return launch


def _use_reference_launch(monkeypatch, calls):
    """The backend's flashcore path on CPU tensors, through `_reference_launch`."""
    monkeypatch.setattr(transformers_backend, "launch", _reference_launch(calls))
    monkeypatch.setattr(transformers_backend, "_on_gpu", lambda *tensors: True)
    monkeypatch.setattr(transformers_backend, "_capability", lambda device: (9, 0))


def _one_layer_call(causal):
    """A module, q [1, 2, 8, 64] and k = v (float16, CPU) for one attention call, with the
    backend's SDPA counts and warnings cleared."""
    import torch

    module = torch.nn.Module()
    module.is_causal = causal
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    kv = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    transformers_backend.stats["sdpa"].clear()
    transformers_backend._warned.clear()
    return module, q, kv


def _small_llama(layers=2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return config, LlamaForCausalLM(config).to(torch.float16)


def test_a_prompt_in_a_static_cache_sees_only_itself(monkeypatch):
    """A StaticCache prefill arrives without a mask and with every cache slot as keys
    (Sk > Sq, the slots past the prompt empty): SDPA's top-left causal mask hides them,
    so the backend must too."""
    import torch
    from transformers import StaticCache

    calls = []
    _use_reference_launch(monkeypatch, calls)
    name = flashcore.register_transformers()
    config, model = _small_llama()
    model.eval()
    ids = torch.randint(0, 128, (1, 10))

    def logits(impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            cache = StaticCache(config=config, max_cache_len=32)
            return model(ids, past_key_values=cache, use_cache=True).logits.float()

    want, got = logits("sdpa"), logits(name)
    assert calls and all(k[2] == 10 and causal and w == (-1, -1) for _, k, causal, w in calls), calls
    assert (got - want).abs().max().item() < 2e-2


def test_training_runs_on_sdpa_with_gradients(monkeypatch):
    """flashcore has no backward: inputs that need gradients go to SDPA, so every
    projection still gets its gradient."""
    import torch

    calls = []
    _use_reference_launch(monkeypatch, calls)
    name = flashcore.register_transformers()
    _, model = _small_llama(layers=1)
    model = model.float().train()
    model.set_attn_implementation(name)
    transformers_backend.stats["sdpa"].clear()
    transformers_backend._warned.clear()
    with pytest.warns(UserWarning, match="gradients"):
        loss = model(torch.randint(0, 128, (1, 12)), labels=torch.randint(0, 128, (1, 12))).loss
    loss.backward()
    assert not calls
    assert any("gradients" in reason for reason in transformers_backend.stats["sdpa"])
    attn = model.model.layers[0].self_attn
    assert all(p.weight.grad is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))


def test_score_modifiers_are_never_dropped(monkeypatch):
    """A position bias (T5-style) goes to SDPA, which applies it; attention sinks, which
    neither flashcore nor SDPA computes, are refused; soft caps run on flashcore."""
    import torch

    calls = []
    _use_reference_launch(monkeypatch, calls)
    module, q, kv = _one_layer_call(causal=False)
    bias = torch.randn(1, 2, 8, 8)
    with pytest.warns(UserWarning, match="position bias"):
        out, _ = transformers_backend.attention_forward(module, q, kv, kv, None, position_bias=bias)
    assert not calls and transformers_backend.stats["sdpa"] == {"a position bias": 1}
    s = (q.float() @ kv.float().transpose(-1, -2)) / 8 + bias
    want = (s.softmax(-1) @ kv.float()).transpose(1, 2)
    assert (out.float() - want).abs().max().item() < 1e-2
    with pytest.raises(NotImplementedError, match="sinks"):
        transformers_backend.attention_forward(module, q, kv, kv, None, s_aux=torch.zeros(2))
    # A sparse model's selected keys (DeepSeek-V3.2's indexer), handed over as an argument
    # to every implementation but eager and sdpa: attending to all keys would be wrong.
    for sparse in ("indices", "block_indices"):
        with pytest.raises(NotImplementedError, match=sparse):
            transformers_backend.attention_forward(module, q, kv, kv, None, **{sparse: torch.zeros(1, 8, 2)})
    with pytest.raises(NotImplementedError, match="softcap"):
        transformers_backend.attention_forward(module, q, kv, kv, None, position_bias=bias, softcap=50.0)
    assert not calls
    transformers_backend.attention_forward(module, q, kv, kv, None, softcap=50.0)  # Gemma 2's
    transformers_backend.attention_forward(module, q, kv, kv, None, softcap=None)  # Gemma 3's
    transformers_backend.attention_forward(module, q, kv, kv, None, softcap=0, indices=None)  # (a dense layer's)
    assert calls == [((1, 2, 8, 64), (1, 2, 8, 64), False, (-1, -1), 50.0)] + [
        ((1, 2, 8, 64), (1, 2, 8, 64), False, (-1, -1))] * 2


def test_gpus_before_sm80_run_on_sdpa_and_fp8_needs_sm89(monkeypatch):
    """flashcore's kernels start at sm_80 (a T4 or V100 would raise UNSUPPORTED_GPU): older
    GPUs get SDPA. FP8 starts at sm_89: an A100 runs "fcore-fp8" calls on the 16-bit kernel."""
    calls, fp8_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    monkeypatch.setattr(
        transformers_backend, "launch_fp8", lambda q, *a: fp8_calls.append(tuple(q.shape)) or (q.contiguous(), None)
    )
    module, q, kv = _one_layer_call(causal=True)
    monkeypatch.setattr(transformers_backend, "_capability", lambda device: (7, 5))
    with pytest.warns(UserWarning, match="compute capability 7.5"):
        transformers_backend.attention_forward(module, q, kv, kv, None)
    assert not calls and list(transformers_backend.stats["sdpa"]) == [
        "a GPU of compute capability 7.5 (flashcore needs 8.0 or newer)"]
    monkeypatch.setattr(transformers_backend, "_capability", lambda device: (8, 0))
    transformers_backend.attention_forward_fp8(module, q, kv, kv, None)
    assert len(calls) == 1 and not fp8_calls
    monkeypatch.setattr(transformers_backend, "_capability", lambda device: (8, 9))
    transformers_backend.attention_forward_fp8(module, q, kv, kv, None)
    assert len(calls) == 1 and fp8_calls == [(1, 8, 2, 64)]


def test_fallbacks_do_not_warn_under_torch_compile(monkeypatch):
    """Dynamo cannot trace warnings.warn (under fullgraph=True it stops the compile): a
    fallback while compiling is counted, and warned about only in eager mode."""
    import warnings

    import torch

    module, q, kv = _one_layer_call(causal=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        transformers_backend.attention_forward(module, q, kv, kv, None)
    assert transformers_backend.stats["sdpa"] == {"tensors on cpu (flashcore runs on CUDA devices)": 1}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with pytest.warns(UserWarning, match="cpu"):
        transformers_backend.attention_forward(module, q, kv, kv, None)


def test_cpu_tensors_run_on_sdpa(monkeypatch):
    """flashcore's op runs on CUDA devices only: a model on the CPU gets SDPA, not an
    error from the dispatcher."""
    calls = []
    monkeypatch.setattr(transformers_backend, "launch", _reference_launch(calls))
    module, q, kv = _one_layer_call(causal=True)
    with pytest.warns(UserWarning, match="cpu"):
        out, _ = transformers_backend.attention_forward(module, q, kv, kv, None)
    assert not calls and list(transformers_backend.stats["sdpa"]) == ["tensors on cpu (flashcore runs on CUDA devices)"]
    assert out.shape == (1, 8, 2, 64)


@pytest.mark.parametrize("scaling", [1e-46, -0.125, float("nan"), float("inf"), 1e39, 3e38, 0.0])
def test_scales_flashcore_cannot_take_run_on_sdpa(monkeypatch, scaling):
    """A scale that is not a positive float32 goes to SDPA: one below float32's smallest
    subnormal would reach the C ABI as 0, its "default scale", and others it refuses."""
    calls = []
    _use_reference_launch(monkeypatch, calls)
    module, q, kv = _one_layer_call(causal=False)
    with pytest.warns(UserWarning, match="scaling"):
        transformers_backend.attention_forward(module, q, kv, kv, None, scaling=scaling)
    assert not calls and list(transformers_backend.stats["sdpa"]) == [f"scaling {scaling}"]
    transformers_backend.attention_forward(module, q, kv, kv, None, scaling=0.125)
    assert calls


def test_attention_dropout_runs_on_sdpa(monkeypatch):
    """flashcore has no dropout: a call that asks for it (a model in training mode, GPT-2 or
    BERT by default) runs on SDPA, which applies it, rather than raising or dropping it;
    with a soft cap, on the explicit attention, which applies it too."""
    import torch

    calls = []
    _use_reference_launch(monkeypatch, calls)
    module, q, kv = _one_layer_call(causal=True)
    module.train()
    with pytest.warns(UserWarning, match="attention dropout"):
        out, _ = transformers_backend.attention_forward(module, q, kv, kv, None, dropout=0.5)
    assert not calls and list(transformers_backend.stats["sdpa"]) == ["attention dropout"]
    want, _ = transformers_backend.attention_forward(module, q, kv, kv, None)
    assert calls and out.shape == want.shape and not torch.equal(out, want)
    transformers_backend._warned.clear()
    with pytest.warns(UserWarning, match="attention dropout"):
        capped, _ = transformers_backend.attention_forward(module, q, kv, kv, None, dropout=0.5, softcap=30.0)
    assert capped.shape == want.shape and len(calls) == 1


def _reference_varlen(calls):
    """flashcore.attention_varlen's documented result on CPU tensors (bottom-right causal
    and key windows per sequence, soft caps, GQA by head count, zeros for rows without
    keys), standing in for the GPU launch of the backend's padded-batch route. Each call is
    recorded as (offsets of q, of k, causal, window), with the soft cap after them when
    there is one."""
    import torch

    def launch_varlen(q, k, v, cu_q, cu_k, max_q, host_q, host_k, causal, scaling, window=(-1, -1), softcap=0.0):
        assert torch.equal(cu_q.cpu(), host_q) and torch.equal(cu_k.cpu(), host_k)
        assert type(softcap) is float
        cq, ck = host_q.tolist(), host_k.tolist()
        assert max_q >= max(b - a for a, b in zip(cq, cq[1:]))
        calls.append((cq, ck, causal, tuple(window)) + ((softcap,) if softcap else ()))
        out = torch.zeros_like(q)
        for b in range(len(cq) - 1):
            (q0, q1), (k0, k1) = cq[b : b + 2], ck[b : b + 2]
            if q1 == q0 or k1 == k0:
                continue
            qs, ks, vs = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
            seen = _visible(q1 - q0, k1 - k0, causal, window)
            out[q0:q1] = _attend(qs, ks, vs, seen, scaling, softcap).transpose(0, 1).to(q.dtype)
        return out

    return launch_varlen


def _use_reference_varlen(monkeypatch, calls):
    """The backend's padded-batch route on CPU tensors, through `_reference_varlen`."""
    monkeypatch.setattr(transformers_backend, "launch_varlen", _reference_varlen(calls))
    monkeypatch.setattr(transformers_backend, "_CHECK_ON_CPU", True)
    monkeypatch.setattr(transformers_backend, "_on_gpu", lambda *tensors: True)
    monkeypatch.setattr(transformers_backend, "_capability", lambda device: (9, 0))


def _reset():
    for key in ("flashcore", "flashcore_padded", "flashcore_window"):
        transformers_backend.stats[key] = 0
    transformers_backend.stats["sdpa"].clear()
    transformers_backend._warned.clear()


def test_left_padded_batches_run_as_variable_length_calls(monkeypatch):
    """generate()'s left-padded prompts, and the decode steps after them, are
    variable-length calls over each sequence's own tokens: the logits of every real token
    match SDPA's, and nothing goes to SDPA."""
    import torch

    calls, varlen_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    _use_reference_varlen(monkeypatch, varlen_calls)
    name = flashcore.register_transformers()
    _, model = _small_llama()
    model.eval()
    ids = torch.randint(1, 128, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :7] = 0
    step = torch.randint(1, 128, (3, 1))
    mask2 = torch.cat([mask, torch.ones_like(step)], dim=1)

    def logits(impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            nxt = model(step, attention_mask=mask2, past_key_values=out.past_key_values, use_cache=True)
        return out.logits.float(), nxt.logits.float()

    want, want_step = logits("sdpa")
    _reset()
    got, got_step = logits(name)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() < 2e-2
    assert (got_step - want_step).abs().max().item() < 2e-2
    assert not calls and transformers_backend.stats["sdpa"] == {}
    assert transformers_backend.stats["flashcore_padded"] == transformers_backend.stats["flashcore"] == 4
    # The keys read in place, [B, Hkv=2, Sk, D]: batch b's position j is row 2·Sk·b + j,
    # with a sequence of no queries over the rows between one sequence's keys and the
    # next. The prompt's real rows gathered (9 and 5 of 12 in the padded ones).
    prompt = ([0, 12, 12, 21, 21, 26], [0, 12, 27, 36, 55, 60], True, (-1, -1))
    decode = ([0, 1, 1, 2, 2, 3], [0, 13, 29, 39, 59, 65], True, (-1, -1))
    assert varlen_calls == [prompt, prompt, decode, decode]


def test_masks_other_than_padding_run_on_sdpa(monkeypatch):
    """A mask the variable-length call cannot express exactly (a sliding window, a gap in
    a sequence's keys, a per-head or float mask, right padding under a causal module)
    goes to SDPA; right padding of a module that is not causal does not."""
    import torch
    import torch.nn.functional as F

    calls = []
    _use_reference_launch(monkeypatch, [])
    _use_reference_varlen(monkeypatch, calls)
    module = torch.nn.Module()
    q = torch.randn(2, 2, 8, 64, dtype=torch.float16)
    kv = torch.randn(2, 2, 8, 64, dtype=torch.float16)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None]
    causal = (j <= i).expand(2, 1, 8, 8)
    gap = torch.ones(2, 8, dtype=torch.bool)
    gap[1, 2] = False
    right = torch.ones(2, 8, dtype=torch.bool)
    right[0, 5:] = False
    cases = {
        "sliding window": causal & (j > i - 3),
        "gap": causal & gap[:, None, None, :],
        "per head": causal.expand(2, 2, 8, 8),
        "float": torch.zeros(2, 1, 8, 8, dtype=torch.float16).masked_fill(~causal, -1e4),
        "right padding, causal": causal & right[:, None, None, :],
    }
    module.is_causal = True
    for label, mask in cases.items():
        _reset()
        with pytest.warns(UserWarning, match="mask other than padding"):
            out, _ = transformers_backend.attention_forward(module, q, kv, kv, mask)
        assert not calls, label
        want = F.scaled_dot_product_attention(q.float(), kv.float(), kv.float(), attn_mask=mask.float() if mask.dtype != torch.bool else mask)
        assert (out.float() - want.transpose(1, 2)).abs().max().item() < 1e-2, label

    module.is_causal = False
    _reset()
    mask = right[:, None, None, :].expand(2, 1, 8, 8)
    out, _ = transformers_backend.attention_forward(module, q, kv, kv, mask)
    # Every query row computed: the keys read in place (batch 1 starts at row 2·8).
    assert calls == [([0, 8, 8, 16], [0, 5, 16, 24], False, (-1, -1))] and transformers_backend.stats["sdpa"] == {}
    want = F.scaled_dot_product_attention(q.float(), kv.float(), kv.float(), attn_mask=mask)
    assert (out.float() - want.transpose(1, 2)).abs().max().item() < 1e-2
    # Keys in a tensor that is not contiguous are gathered: the runs packed one after another.
    wide = torch.zeros(2, 2, 8, 128, dtype=torch.float16)[..., :64]
    wide.copy_(kv)
    calls.clear()
    out, _ = transformers_backend.attention_forward(module, q, wide, wide, mask)
    assert calls == [([0, 8, 16], [0, 5, 13], False, (-1, -1))]
    assert (out.float() - want.transpose(1, 2)).abs().max().item() < 1e-2


def test_tensors_on_another_device_than_the_query_go_to_sdpa(monkeypatch):
    """A mask, key or value on another device than the query is SDPA's to refuse (or, a
    CPU mask, to move): a padding plan keeps its offsets on the mask's device."""
    import torch

    reasons, varlen_calls = [], []
    _use_reference_launch(monkeypatch, [])
    _use_reference_varlen(monkeypatch, varlen_calls)
    monkeypatch.setattr(transformers_backend, "_fallback", lambda reason, *a, **k: reasons.append(reason) or (None, None))
    module, q, kv = _one_layer_call(True)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    transformers_backend.attention_forward(module, q, kv, kv, mask.to("meta"))
    transformers_backend.attention_forward(module, q, kv.to("meta"), kv, None)
    transformers_backend.attention_forward(module, q, kv, kv.to("meta"), None)
    assert reasons == [
        "an attention mask on meta, the query on cpu",
        "query, key and value on cpu, meta and cpu",
        "query, key and value on cpu, cpu and meta",
    ]
    # The same call with everything on one device runs on flashcore.
    transformers_backend.attention_forward(module, q, kv, kv, mask)
    assert len(reasons) == 3 and len(varlen_calls) == 1


@pytest.mark.parametrize("where", ["host", "device"])
def test_a_padding_plan_packs_each_run_of_keys(monkeypatch, where):
    """The plan from masks transformers builds: left padding, a StaticCache's empty slots
    (queries at positions 4 to 6 of 10 slots), a sequence that is all padding; and one
    check per mask however many layers pass it. Checked as small masks are (a host copy)
    and as large ones are (torch on the mask's device, a row at a time here)."""
    import torch
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    monkeypatch.setattr(transformers_backend, "_CHECK_ON_CPU", True)
    if where == "device":
        monkeypatch.setattr(transformers_backend, "_HOST_CHECK_ELEMENTS", 0)
        monkeypatch.setattr(transformers_backend, "_CHECK_ELEMENTS", 12)
    pad = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0] * 7]).bool()  # as models pass it
    mask = sdpa_mask(batch_size=3, q_length=3, kv_length=10, q_offset=4, mask_function=causal_mask_function,
                     attention_mask=pad, allow_is_causal_skip=False)
    checks = []
    real = transformers_backend._check_padding
    monkeypatch.setattr(transformers_backend, "_check_padding", lambda *a: checks.append(1) or real(*a))
    plan = transformers_backend._padded_plan(mask, True, 3, 3, 10)
    assert plan is not None and plan.causal
    assert plan.host_q.tolist() == [0, 3, 6, 6] and plan.host_k.tolist() == [0, 5, 12, 12]
    assert plan.every_row is False
    assert [t.tolist() for t in plan.q_rows] == [[0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]]
    assert [t.tolist() for t in plan.k_rows] == [[0] * 5 + [1] * 7, [2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6]]
    assert plan.max_q == 3
    assert transformers_backend._padded_plan(mask, True, 3, 3, 10) is plan and len(checks) == 1
    # A mask made under inference_mode has no version counter: it is checked on every call,
    # so one refilled in place (a static buffer) is read as it is now.
    with torch.inference_mode():
        frozen = mask.clone()
        assert transformers_backend._padded_plan(frozen, True, 3, 3, 10) is not None
        frozen[0].fill_(True)
        assert transformers_backend._padded_plan(frozen, True, 3, 3, 10) is None
    assert len(checks) == 3
    checks.clear()
    checks.append(1)
    # Two masks in turn (full and sliding-window layers) are each checked once.
    other = mask.clone()
    for _ in range(3):
        assert transformers_backend._padded_plan(other, True, 3, 3, 10) is not None
        assert transformers_backend._padded_plan(mask, True, 3, 3, 10) is plan
    assert len(checks) == 2
    # Some transformers versions let rows that see no key see every key (for SDPA's sake):
    # a sequence that is all padding then looks like one that sees everything, which only
    # SDPA computes as the mask says.
    fixed = mask | ~mask.any(-1, keepdim=True)
    assert fixed[2].all() and transformers_backend._padded_plan(fixed, True, 3, 3, 10) is None
    # A non-causal reading of the same mask does not match it.
    assert transformers_backend._padded_plan(mask, False, 3, 3, 10) is None
    # A prompt shorter than the query block: its first rows see nothing.
    short = torch.tensor([[0, 0, 0, 0, 0, 1, 1]]).bool()
    mask = sdpa_mask(batch_size=1, q_length=7, kv_length=7, mask_function=causal_mask_function,
                     attention_mask=short, allow_is_causal_skip=False)
    plan = transformers_backend._padded_plan(mask, True, 1, 7, 7)
    assert plan.host_q.tolist() == [0, 2] and plan.host_k.tolist() == [0, 2]
    assert plan.q_rows[1].tolist() == [5, 6] and plan.k_rows[1].tolist() == [5, 6]
    # The same, its padding rows made to see every key: they stay padding (zeros here).
    fixed = transformers_backend._padded_plan(mask | ~mask.any(-1, keepdim=True), True, 1, 7, 7)
    assert fixed.host_q.tolist() == [0, 2] and fixed.q_rows[1].tolist() == [5, 6]
    mask[0, 0, 6, 6] = False  # edited in place: checked again, and no longer padding
    assert transformers_backend._padded_plan(mask, True, 1, 7, 7) is None


def test_random_masks_are_read_exactly(monkeypatch):
    """Random masks (left padding of any length, all-padding sequences, rows unmasked as
    some transformers versions do, sliding windows, gaps, non-causal readings): a plan is
    made exactly when the mask is the variable-length call's, and its runs are the
    mask's. Compared against the brute-force mask each plan stands for."""
    import random

    import torch

    monkeypatch.setattr(transformers_backend, "_CHECK_ON_CPU", True)
    rng = random.Random(1234)
    made = refused = 0
    for trial in range(300):
        monkeypatch.setattr(transformers_backend, "_HOST_CHECK_ELEMENTS", rng.choice([0, 1 << 18]))
        monkeypatch.setattr(transformers_backend, "_CHECK_ELEMENTS", rng.choice([7, 1 << 25]))
        b, sq = rng.randint(1, 4), rng.randint(1, 6)
        sk = sq + rng.randint(0, 6)
        causal = rng.random() < 0.7
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
        starts = [rng.randint(0, sk) for _ in range(b)]
        m = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
        for s, row in zip(starts, m):
            row[0] = (j >= s) & ((j <= i + sk - sq) if causal else True)
        kind = rng.choice(["plain", "plain", "unmasked", "window", "gap", "flip"])
        if kind == "unmasked":
            m = m | ~m.any(-1, keepdim=True)
        elif kind == "window":
            m = m & (j > i + sk - sq - rng.randint(1, 3))
        elif kind == "gap":
            m[rng.randrange(b), 0, :, rng.randrange(sk)] = False
        elif kind == "flip":
            m[rng.randrange(b), 0, rng.randrange(sq), rng.randrange(sk)] ^= True
        plan = transformers_backend._padded_plan(m, causal, b, sq, sk)
        # What the plan stands for: each sequence's keys [k0, k0 + nk), its last nq rows
        # bottom-right over them (or all of them); every other row sees nothing.
        want = None
        if plan is not None:
            made += 1
            want = torch.zeros(b, sq, sk, dtype=torch.bool)
            cq, ck = plan.host_q.tolist(), plan.host_k.tolist()
            kb, kr = (t.tolist() for t in plan.k_rows)
            for x in range(b):
                nq, nk = cq[x + 1] - cq[x], ck[x + 1] - ck[x]
                keys = [r for bb, r in zip(kb, kr) if bb == x]
                assert len(keys) == nk and keys == list(range(keys[0] if nk else 0, (keys[0] if nk else 0) + nk))
                for t in range(nq):
                    row = sq - nq + t
                    for u in range(nk):
                        want[x, row, keys[u]] = (u <= t + nk - nq) if causal else True
            # The mask, its rows that see every key where the plan's see none (rows
            # unmasked for SDPA's sake) read as padding.
            padding = m[:, 0].all(-1, keepdim=True) & ~want.any(-1, keepdim=True)
            got = m[:, 0] & ~padding
            assert torch.equal(got, want), (trial, kind, causal, starts, m[:, 0].int().tolist())
        else:
            refused += 1
        if kind == "plain":
            assert plan is not None, (trial, causal, starts)
    assert made > 100 and refused > 30, (made, refused)


def test_threads_share_the_mask_checks(monkeypatch):
    """Several threads checking masks at once (models served side by side) each get their
    mask's plan, with the cache of checked masks kept at its size."""
    import threading

    import torch

    monkeypatch.setattr(transformers_backend, "_CHECK_ON_CPU", True)
    errors, plans = [], {}

    def work(t):
        try:
            for n in range(40):
                pad = torch.ones(2, 6, dtype=torch.bool)
                pad[1, : (t + n) % 5] = False
                causal = torch.arange(6)[None, :] <= torch.arange(6)[:, None]  # [query, key]
                mask = pad[:, None, None, :] & causal
                plan = transformers_backend._padded_plan(mask, True, 2, 6, 6)
                plans[(t, n)] = (plan.host_k.tolist(), 6 + 6 - (t + n) % 5)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert all(cu[-1] == total for cu, total in plans.values())
    assert len(transformers_backend._plans) <= transformers_backend._PLANS_KEPT


# ---- sliding-window layers ----------------------------------------------------------------


def _window_plan_mask(plan, b, sq, sk):
    """[B, Sq, Sk] bool: the mask a (causal) plan stands for, built from its offsets and
    key rows by brute force: each sequence's keys [k0, k0 + nk), its last nq rows
    bottom-right over them, each seeing the last `window` keys up to its diagonal."""
    import torch

    left = plan.window[0]
    want = torch.zeros(b, sq, sk, dtype=torch.bool)
    cq, ck = plan.host_q.tolist(), plan.host_k.tolist()
    kb, kr = (t.tolist() for t in plan.k_rows)
    for x in range(b):
        nq, nk = cq[x + 1] - cq[x], ck[x + 1] - ck[x]
        keys = [r for bb, r in zip(kb, kr) if bb == x]
        assert len(keys) == nk and keys == list(range(keys[0] if nk else 0, (keys[0] if nk else 0) + nk))
        for t in range(nq):
            row, diagonal = sq - nq + t, t + nk - nq
            for u in range(nk):
                want[x, row, keys[u]] = u <= diagonal and (left < 0 or u >= diagonal - left)
    return want


def test_random_sliding_window_masks_are_read_exactly(monkeypatch):
    """Random sliding-window masks over left-padded runs of keys (windows of 1 key up to
    more than every key, rows unmasked as some transformers versions do): a plan is made
    with the layer's window exactly when the mask is that window, never for a window one
    key wider or narrower than the mask's, a gap, a flipped element or a window without
    its sliding_window; and the plan stands for the mask element by element."""
    import random

    import torch

    monkeypatch.setattr(transformers_backend, "_CHECK_ON_CPU", True)
    rng = random.Random(4321)
    made = refused = 0
    for trial in range(400):
        monkeypatch.setattr(transformers_backend, "_HOST_CHECK_ELEMENTS", rng.choice([0, 1 << 18]))
        monkeypatch.setattr(transformers_backend, "_CHECK_ELEMENTS", rng.choice([7, 1 << 25]))
        b, sq = rng.randint(1, 4), rng.randint(1, 7)
        sk = sq + rng.randint(0, 9)
        w = rng.randint(1, sk + 2)
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
        starts = [rng.randint(0, sk) for _ in range(b)]
        diagonal = i + sk - sq  # the last key is the last query's position

        def window_mask(keys, starts):
            """The layer's mask with a window of `keys` keys (None: no window) over runs of
            keys from `starts` to the end."""
            m = torch.zeros(len(starts), 1, sq, sk, dtype=torch.bool)
            for s, row in zip(starts, m):
                row[0] = (j >= s) & (j <= diagonal) & ((j > diagonal - keys) if keys else True)
            return m

        m = window_mask(w, starts)
        kind = rng.choice(["plain", "plain", "unmasked", "wider", "narrower", "no kwarg", "gap", "flip"])
        checked_with = w
        if kind == "unmasked":
            m = m | ~m.any(-1, keepdim=True)
        elif kind == "wider":
            checked_with = w + 1  # the mask's window is a key narrower than the layer's
        elif kind == "narrower":
            checked_with = w - 1 if w > 1 else None
        elif kind == "no kwarg":
            checked_with = None
        elif kind == "gap":
            m[rng.randrange(b), 0, :, rng.randrange(sk)] = False
        elif kind == "flip":
            m[rng.randrange(b), 0, rng.randrange(sq), rng.randrange(sk)] ^= True
        plan = transformers_backend._padded_plan(m, True, b, sq, sk, checked_with)
        if plan is None:
            refused += 1
        else:
            made += 1
            assert plan.causal
            assert plan.window == ((-1, -1) if checked_with is None else (checked_with - 1, 0))
            want = _window_plan_mask(plan, b, sq, sk)
            padding = m[:, 0].all(-1, keepdim=True) & ~want.any(-1, keepdim=True)
            got = m[:, 0] & ~padding
            assert torch.equal(got, want), (trial, kind, w, checked_with, starts, m[:, 0].int().tolist())
        if kind == "plain":
            assert plan is not None, (trial, w, starts)
        if kind in ("wider", "narrower", "no kwarg"):
            # A window one key off (or none) is refused unless it makes this very mask over
            # runs starting elsewhere (a row whose window ends the run's start sees the
            # same keys under a wider window over a run that starts later, say): then the
            # plan computes the mask all the same, as checked above.
            same = all(
                any(torch.equal(window_mask(checked_with, [s])[0], m[x]) for s in range(sk + 1)) for x in range(b)
            )
            assert (plan is not None) == same, (trial, kind, w, checked_with, starts)
    assert made > 150 and refused > 60, (made, refused)


@pytest.mark.parametrize("where", ["host", "device"])
def test_transformers_sliding_window_masks_make_window_plans(monkeypatch, where):
    """The masks transformers builds for sliding-window layers (sdpa_mask with its
    sliding-window mask function): a prompt longer than the window, left padding, a
    decode step against a sliding-window cache that keeps the last window - 1 keys (key
    offset), chunks of several queries. Each makes a plan with the window; checked with
    a window one key off, or without one, none."""
    import torch
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    monkeypatch.setattr(transformers_backend, "_CHECK_ON_CPU", True)
    if where == "device":
        monkeypatch.setattr(transformers_backend, "_HOST_CHECK_ELEMENTS", 0)
        monkeypatch.setattr(transformers_backend, "_CHECK_ELEMENTS", 16)
    w = 8
    cases = [
        # batch, q_length, kv_length, q_offset, kv_offset, padding of each sequence
        (2, 20, 20, 0, 0, [0, 0]),
        (3, 20, 20, 0, 0, [0, 5, 14]),
        (3, 1, 8, 24, 17, [0, 0, 0]),  # decode, a DynamicSlidingWindowLayer's keys
        (3, 1, 8, 24, 17, [20, 18, 0]),  # the same, a sequence's padding still in the cache
        (2, 4, 11, 24, 17, [0, 19]),  # a chunk of 4 queries against 7 kept keys
        (2, 1, 25, 24, 0, [0, 3]),  # decode against a full cache: the window's last 8 keys
    ]
    for b, ql, kl, qo, ko, pads in cases:
        pad = torch.ones(b, ko + kl, dtype=torch.bool)
        for x, n in enumerate(pads):
            pad[x, :n] = False
        mask = sdpa_mask(batch_size=b, q_length=ql, kv_length=kl, q_offset=qo, kv_offset=ko,
                         mask_function=sliding_window_causal_mask_function(w), attention_mask=pad,
                         allow_is_causal_skip=False, local_size=w)
        plan = transformers_backend._padded_plan(mask, True, b, ql, kl, w)
        assert plan is not None, (b, ql, kl, qo, ko, pads)
        assert plan.window == (w - 1, 0)
        assert torch.equal(_window_plan_mask(plan, b, ql, kl) | ~mask[:, 0].any(-1, keepdim=True), mask[:, 0]
                           | ~mask[:, 0].any(-1, keepdim=True)), (b, ql, kl, qo, ko, pads)
        # A prompt's rows show where the window starts: one a key wider or narrower, or
        # none, is another mask.
        if ql > w:
            for other in (w - 1, w + 1, None):
                assert transformers_backend._padded_plan(mask, True, b, ql, kl, other) is None, (other, b, ql, kl)
        # A bidirectional reading is none of them.
        assert transformers_backend._padded_plan(mask, False, b, ql, kl, w) is None
    # Keys a decode step sees: the window's last 8 of the full cache, read as a run of 8.
    # One row cannot tell a window of 8 keys from a wider one over a run of 8 (padding
    # before it): either reading attends to those 8 keys.
    pad = torch.ones(1, 25, dtype=torch.bool)
    mask = sdpa_mask(batch_size=1, q_length=1, kv_length=25, q_offset=24,
                     mask_function=sliding_window_causal_mask_function(w), attention_mask=pad,
                     allow_is_causal_skip=False, local_size=w)
    for window in (w, w + 1, None):
        plan = transformers_backend._padded_plan(mask, True, 1, 1, 25, window)
        assert plan.host_k.tolist() == [0, 8] and plan.k_rows[1].tolist() == list(range(17, 25))
    assert transformers_backend._padded_plan(mask, True, 1, 1, 25, w - 1) is None


def _small_mistral(window, layers=2):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
    )
    return config, MistralForCausalLM(config).to(torch.float16)


def test_sliding_window_layers_run_on_flashcore(monkeypatch):
    """A Mistral model with a window of 6 keys: a prompt longer than the window (a mask
    transformers builds for it), a left-padded batch, decode steps against its
    sliding-window cache, and a short prompt (no mask: the window hides nothing) all run
    on flashcore with window_size (5, 0) where the window hides keys; the logits of every
    real token match SDPA's and nothing goes to SDPA."""
    import torch

    calls, varlen_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    _use_reference_varlen(monkeypatch, varlen_calls)
    name = flashcore.register_transformers()
    _, model = _small_mistral(6)
    model.eval()
    ids = torch.randint(1, 128, (3, 14))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :9] = 0
    steps = torch.randint(1, 128, (3, 4))

    def logits(impl):
        model.set_attn_implementation(impl)
        out_logits = []
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            out_logits.append(out.logits[mask.bool()].float())
            m, cache = mask, out.past_key_values
            for t in range(steps.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                out = model(steps[:, t : t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                out_logits.append(out.logits[:, -1].float())
            out_logits.append(model(ids[:, :5]).logits.float())  # shorter than the window: no mask
            out_logits.append(model(ids).logits.float())  # no padding, longer than the window
        return out_logits

    want = logits("sdpa")
    _reset()
    got = logits(name)
    for g, w_ in zip(got, want):
        assert (g - w_).abs().max().item() < 2e-2
    assert transformers_backend.stats["sdpa"] == {}
    # Two layers: the padded prompt, 4 steps, the unpadded long prompt with masks; the
    # short prompt without one.
    assert transformers_backend.stats["flashcore_padded"] == 2 * (1 + 4 + 1)
    assert transformers_backend.stats["flashcore_window"] == transformers_backend.stats["flashcore"] == 2 * 7
    assert {c[3] for c in varlen_calls} == {(5, 0)}
    assert calls == [((3, 4, 5, 32), (3, 2, 5, 32), True, (-1, -1))] * 2


def test_a_sliding_window_without_a_mask_is_causal_local_attention(monkeypatch):
    """Calls of a sliding-window layer that come without a mask: a window as FlashAttention
    reads `sliding_window` (w - 1 keys before each query, none after) wherever it hides
    keys, a prompt and a decode step alike; none where it hides nothing; none for a
    module that is not causal. A sliding_window that is not a positive int goes to SDPA."""
    import torch

    calls = []
    _use_reference_launch(monkeypatch, calls)
    module, q, kv = _one_layer_call(causal=True)  # q [1, 2, 8, 64]
    _reset()
    for window, want in [(3, (2, 0)), (8, (-1, -1)), (9, (-1, -1)), (1, (0, 0))]:
        calls.clear()
        out, _ = transformers_backend.attention_forward(module, q, kv, kv, None, sliding_window=window)
        assert calls == [((1, 2, 8, 64), (1, 2, 8, 64), True, want)], window
        seen = _visible(8, 8, True, (window - 1, 0))  # transformers' mask: p - w < j <= p
        ref = _attend(q, kv, kv, seen, None).transpose(1, 2)
        assert (out.float() - ref).abs().max().item() < 1e-2, window
    # A decode step: one query at the last of 8 keys sees the window's last 3.
    calls.clear()
    step = q[:, :, -1:]
    out, _ = transformers_backend.attention_forward(module, step, kv, kv, None, sliding_window=3)
    assert calls == [((1, 2, 1, 64), (1, 2, 8, 64), False, (2, 0))]
    ref = _attend(step, kv, kv, _visible(1, 8, True, (2, 0)), None).transpose(1, 2)
    assert (out.float() - ref).abs().max().item() < 1e-2
    assert transformers_backend.stats["flashcore_window"] == 5
    # A module that is not causal: its window is its mask's to say (none here).
    module.is_causal = False
    calls.clear()
    transformers_backend.attention_forward(module, q, kv, kv, None, sliding_window=3)
    assert calls == [((1, 2, 8, 64), (1, 2, 8, 64), False, (-1, -1))]
    assert transformers_backend.stats["flashcore_window"] == 5
    module.is_causal = True
    calls.clear()
    for bad in (0, -4, 2.5, True, "3"):
        with pytest.warns(UserWarning, match="sliding_window"):
            transformers_backend.attention_forward(module, q, kv, kv, None, sliding_window=bad)
    assert not calls and len(transformers_backend.stats["sdpa"]) == 5


def test_a_mask_is_checked_against_the_layers_own_window(monkeypatch):
    """With a mask, the layer's `sliding_window` is what the mask must be: the same mask
    under a window one key off, a sliding-window mask without the kwarg, and a causal
    mask whose window would hide keys go to SDPA (which applies the mask as it is)."""
    import torch
    import torch.nn.functional as F

    calls = []
    _use_reference_launch(monkeypatch, [])
    _use_reference_varlen(monkeypatch, calls)
    module, q, kv = _one_layer_call(causal=True)  # q [1, 2, 8, 64]
    i, j = torch.arange(8)[:, None], torch.arange(8)[None]
    window3 = ((j <= i) & (j > i - 3)).expand(1, 1, 8, 8)
    causal = (j <= i).expand(1, 1, 8, 8)
    _reset()
    out, _ = transformers_backend.attention_forward(module, q, kv, kv, window3, sliding_window=3)
    assert calls == [([0, 8], [0, 8], True, (2, 0))] and transformers_backend.stats["flashcore_window"] == 1
    want = F.scaled_dot_product_attention(q.float(), kv.float(), kv.float(), attn_mask=window3)
    assert (out.float() - want.transpose(1, 2)).abs().max().item() < 1e-2
    for mask, window in [(window3, 2), (window3, 4), (window3, None), (causal, 3)]:
        calls.clear()
        transformers_backend._warned.clear()
        with pytest.warns(UserWarning, match="mask other than padding"):
            out, _ = transformers_backend.attention_forward(module, q, kv, kv, mask, sliding_window=window)
        assert not calls, window
        want = F.scaled_dot_product_attention(q.float(), kv.float(), kv.float(), attn_mask=mask)
        assert (out.float() - want.transpose(1, 2)).abs().max().item() < 1e-2
    # A causal mask under a window that hides none of its keys is that window.
    calls.clear()
    transformers_backend.attention_forward(module, q, kv, kv, causal, sliding_window=8)
    assert calls == [([0, 8], [0, 8], True, (7, 0))]


def test_fp8_runs_a_window_that_hides_keys_on_the_16_bit_kernel(monkeypatch):
    """The FP8 kernels have no key window: a sliding-window call whose window hides keys
    runs on the 16-bit kernel with it, one whose window hides nothing on the FP8 kernel."""
    calls, fp8_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    monkeypatch.setattr(
        transformers_backend, "launch_fp8", lambda q, *a: fp8_calls.append(tuple(q.shape)) or (q.contiguous(), None)
    )
    module, q, kv = _one_layer_call(causal=True)
    _reset()
    transformers_backend.stats["flashcore_fp8"] = 0
    transformers_backend.attention_forward_fp8(module, q, kv, kv, None, sliding_window=3)
    assert calls == [((1, 2, 8, 64), (1, 2, 8, 64), True, (2, 0))] and not fp8_calls
    transformers_backend.attention_forward_fp8(module, q, kv, kv, None, sliding_window=8)
    assert len(calls) == 1 and fp8_calls == [(1, 8, 2, 64)]
    assert transformers_backend.stats["flashcore_window"] == 2
    assert transformers_backend.stats["flashcore"] == transformers_backend.stats["flashcore_fp8"] == 1


def test_alternating_sliding_and_full_layers_each_get_their_own(monkeypatch):
    """Gemma 3's text model alternates sliding-window layers (sliding_window passed) and
    full ones (none): the sliding layers run with the window wherever it hides keys, the
    full ones without, prompt and cached steps alike, matching SDPA's logits."""
    import torch

    try:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    except ImportError:
        pytest.skip("this transformers has no Gemma 3")
    calls, varlen_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    _use_reference_varlen(monkeypatch, varlen_calls)
    name = flashcore.register_transformers()
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
    )
    model = Gemma3ForCausalLM(config).to(torch.float16).eval()
    ids = torch.randint(1, 128, (2, 14))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    steps = torch.randint(1, 128, (2, 3))

    def logits(impl):
        model.set_attn_implementation(impl)
        out_logits = []
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            out_logits.append(out.logits[mask.bool()].float())
            m, cache = mask, out.past_key_values
            for t in range(steps.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                out = model(steps[:, t : t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                out_logits.append(out.logits[:, -1].float())
            out_logits.append(model(ids).logits.float())
        return out_logits

    want = logits("sdpa")
    _reset()
    got = logits(name)
    for g, w_ in zip(got, want):
        assert (g - w_).abs().max().item() < 3e-2
    stats = transformers_backend.stats
    assert stats["sdpa"] == {}
    per_layer = 1 + 3 + 1
    assert stats["flashcore"] == 4 * per_layer and stats["flashcore_window"] == 2 * per_layer
    # The padded prompt and the steps: masks for every layer, windowed on the sliding ones.
    assert [c[3] for c in varlen_calls] == [(5, 0), (-1, -1)] * 2 * (1 + 3) + [(5, 0)] * 2
    # The unpadded prompt's full layers: no mask, causal, no window.
    assert [c[2:] for c in calls] == [(True, (-1, -1))] * 2


# ---- logit soft-capping ------------------------------------------------------------------


def _capped_call(causal=True, hq=4, hkv=2, sq=8, sk=8, b=1, spread=8.0):
    """A module and q [b, hq, sq, 64], k = v [b, hkv, sk, 64] (float16, CPU) whose scores
    (q·k / 8, up to about `spread` in magnitude) a cap of a few units bends, with the
    backend's counts and warnings cleared."""
    import torch

    module = torch.nn.Module()
    module.is_causal = causal
    q = (torch.randn(b, hq, sq, 64) * spread**0.5 / 2).to(torch.float16)
    kv = (torch.randn(b, hkv, sk, 64) * spread**0.5 / 2).to(torch.float16)
    _reset()
    return module, q, kv


def test_softcaps_run_on_flashcore_on_every_route(monkeypatch):
    """A soft cap reaches flashcore as a float on each route: a call without a mask (prompt
    and decode step), a sliding-window call, a padded batch (variable-length call); the
    outputs are the capped attention's, far from the uncapped one's."""
    import torch

    calls, varlen_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    _use_reference_varlen(monkeypatch, varlen_calls)
    module, q, kv = _capped_call()
    cap = 2.0
    seen = _visible(8, 8, True, (-1, -1))
    out, _ = transformers_backend.attention_forward(module, q, kv, kv, None, softcap=cap)
    assert calls == [((1, 4, 8, 64), (1, 2, 8, 64), True, (-1, -1), 2.0)]
    want = _attend(q, kv, kv, seen, None, cap).transpose(1, 2)
    uncapped = _attend(q, kv, kv, seen, None).transpose(1, 2)
    assert (out.float() - want).abs().max().item() < 1e-2
    assert (want - uncapped).abs().max().item() > 0.1  # the cap matters here
    # A decode step, a sliding-window layer (window 3 over 8 keys), an integer cap.
    calls.clear()
    transformers_backend.attention_forward(module, q[:, :, -1:], kv, kv, None, softcap=50)
    transformers_backend.attention_forward(module, q, kv, kv, None, sliding_window=3, softcap=cap)
    assert calls == [((1, 4, 1, 64), (1, 2, 8, 64), False, (-1, -1), 50.0),
                     ((1, 4, 8, 64), (1, 2, 8, 64), True, (2, 0), 2.0)]
    # A padded batch: one variable-length call, capped.
    module, q, kv = _capped_call(b=2)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[1, :3] = False
    i, j = torch.arange(8)[:, None], torch.arange(8)[None]
    mask = (j <= i)[None, None] & pad[:, None, None, :]
    out, _ = transformers_backend.attention_forward(module, q, kv, kv, mask, softcap=cap)
    assert [c[2:] for c in varlen_calls] == [(True, (-1, -1), 2.0)]
    want = _attend(q, kv, kv, mask, None, cap).transpose(1, 2)
    real = pad.clone()
    assert (out.float()[real] - want[real]).abs().max().item() < 1e-2
    assert transformers_backend.stats["sdpa"] == {}
    assert transformers_backend.stats["flashcore"] == 1 and transformers_backend.stats["flashcore_padded"] == 1


def test_softcapped_calls_that_go_to_sdpa_keep_their_cap(monkeypatch):
    """SDPA has no soft cap: a capped call that goes to SDPA's path (tensors on the CPU, a
    mask other than padding, inputs that need gradients) runs on explicit capped attention
    instead, masked as SDPA masks (no mask: top-left causal), and warns once per reason."""
    import torch

    calls = []
    monkeypatch.setattr(transformers_backend, "launch", _reference_launch(calls))
    cap = 2.0
    # Tensors on the CPU, no mask: causal top-left (Sq < Sk: the first Sq keys), or none.
    for causal, sq, sk in [(True, 8, 8), (True, 5, 8), (False, 5, 8), (True, 1, 8)]:
        module, q, kv = _capped_call(causal, sq=sq, sk=sk)
        with pytest.warns(UserWarning, match="softcap"):
            out, _ = transformers_backend.attention_forward(module, q, kv, kv, None, softcap=cap)
        assert out.shape == (1, sq, 4, 64) and out.dtype == torch.float16
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
        seen = (j <= i) if causal and sq > 1 else torch.ones(sq, sk, dtype=torch.bool)
        want = _attend(q, kv, kv, seen, None, cap).transpose(1, 2)
        assert (out.float() - want).abs().max().item() < 1e-2, (causal, sq, sk)
        assert list(transformers_backend.stats["sdpa"]) == ["tensors on cpu (flashcore runs on CUDA devices)"]
    assert not calls
    # Masks flashcore does not take: boolean (per head) and additive, an explicit scale.
    monkeypatch.setattr(transformers_backend, "_on_gpu", lambda *tensors: True)
    monkeypatch.setattr(transformers_backend, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(transformers_backend, "_CHECK_ON_CPU", True)
    module, q, kv = _capped_call(hq=2)
    i, j = torch.arange(8)[:, None], torch.arange(8)[None]
    per_head = torch.stack([j <= i, (j <= i) & (j > i - 3)])[None]  # [1, 2, 8, 8]
    additive = torch.zeros(1, 1, 8, 8).masked_fill(~(j <= i), -1e4)
    for mask, seen in [(per_head, per_head), (additive, (j <= i))]:
        _reset()
        with pytest.warns(UserWarning, match="softcap"):
            out, _ = transformers_backend.attention_forward(module, q, kv, kv, mask, scaling=0.1, softcap=cap)
        want = _attend(q, kv, kv, seen, 0.1, cap).transpose(1, 2)
        assert (out.float() - want).abs().max().item() < 1e-2
        assert list(transformers_backend.stats["sdpa"]) == ["an attention mask other than padding "
                                                            "(right padding, a sliding window without "
                                                            "sliding_window, gaps, per-head, float)"]
    assert not calls
    # Inputs that need gradients: the explicit attention has a backward.
    module, q, kv = _capped_call()
    q, kv = q.float().requires_grad_(), kv.float().requires_grad_()
    with pytest.warns(UserWarning, match="softcap"):
        out, _ = transformers_backend.attention_forward(module, q, kv, kv, None, softcap=cap)
    out.sum().backward()
    assert q.grad is not None and kv.grad is not None and not calls


def test_softcaps_flashcore_cannot_take_are_refused(monkeypatch):
    """A cap that is not a positive, finite number is refused (ValueError), never dropped;
    None and 0 are no cap."""
    calls = []
    _use_reference_launch(monkeypatch, calls)
    module, q, kv = _capped_call()
    for bad in (-50.0, float("nan"), float("inf"), -float("inf"), 1e-50):
        with pytest.raises(ValueError, match="softcap"):
            transformers_backend.attention_forward(module, q, kv, kv, None, softcap=bad)
    assert not calls
    for none in (None, 0, 0.0):
        transformers_backend.attention_forward(module, q, kv, kv, None, softcap=none)
    assert calls == [((1, 4, 8, 64), (1, 2, 8, 64), True, (-1, -1))] * 3


def test_fp8_runs_a_softcapped_call_on_the_16_bit_kernel(monkeypatch):
    """The FP8 kernels have no soft cap: a capped call runs on the 16-bit kernel with it,
    an uncapped one on the FP8 kernel."""
    calls, fp8_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    monkeypatch.setattr(
        transformers_backend, "launch_fp8", lambda q, *a: fp8_calls.append(tuple(q.shape)) or (q.contiguous(), None)
    )
    module, q, kv = _capped_call()
    transformers_backend.stats["flashcore_fp8"] = 0
    transformers_backend.attention_forward_fp8(module, q, kv, kv, None, softcap=50.0)
    assert calls == [((1, 4, 8, 64), (1, 2, 8, 64), True, (-1, -1), 50.0)] and not fp8_calls
    transformers_backend.attention_forward_fp8(module, q, kv, kv, None, softcap=None)
    assert len(calls) == 1 and fp8_calls == [(1, 8, 4, 64)]
    assert transformers_backend.stats["flashcore"] == transformers_backend.stats["flashcore_fp8"] == 1


def _small_gemma2(softcap=50.0, layers=4, window=6):
    """A random-weight Gemma 2 (float16, CPU): sliding-window layers of `window` keys
    alternating with full ones, every layer's scores capped at `softcap`."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=window, attn_logit_softcapping=softcap,
        query_pre_attn_scalar=32, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
    )
    return config, Gemma2ForCausalLM(config).to(torch.float16).eval()


@pytest.mark.parametrize("softcap", [50.0, 0.01])
def test_gemma2_runs_on_flashcore_with_its_soft_cap(monkeypatch, softcap):
    """Gemma 2 passes softcap on every layer and sliding_window on alternate ones: a
    left-padded prompt, cached decode steps and an unpadded prompt all run on flashcore,
    capped, windowed on the sliding layers, and match transformers' eager attention (which
    caps; its SDPA path would drop the cap). A cap of 0.01 bends these small random
    scores, so the cap itself is checked, not only its passing."""
    import torch

    calls, varlen_calls = [], []
    _use_reference_launch(monkeypatch, calls)
    _use_reference_varlen(monkeypatch, varlen_calls)
    name = flashcore.register_transformers()
    _, model = _small_gemma2(softcap)
    ids = torch.randint(1, 128, (2, 14))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    steps = torch.randint(1, 128, (2, 3))

    def logits(impl):
        model.set_attn_implementation(impl)
        out_logits = []
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            out_logits.append(out.logits[mask.bool()].float())
            m, cache = mask, out.past_key_values
            for t in range(steps.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
                out = model(steps[:, t : t + 1], attention_mask=m, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                out_logits.append(out.logits[:, -1].float())
            out_logits.append(model(ids).logits.float())
        return out_logits

    want = logits("eager")
    _reset()
    got = logits(name)
    err = max((g - w_).abs().max().item() for g, w_ in zip(got, want))
    print(f"max logit error against eager attention: {err:.2e}")
    assert err < 3e-2
    stats = transformers_backend.stats
    assert stats["sdpa"] == {}
    per_layer = 1 + 3 + 1
    assert stats["flashcore"] == 4 * per_layer and stats["flashcore_window"] == 2 * per_layer
    # Every call capped at the layer's softcap: the padded prompt and the steps as
    # variable-length calls, windowed on the sliding layers; the unpadded prompt's full
    # layers without a mask.
    assert [c[3:] for c in varlen_calls] == [((5, 0), softcap), ((-1, -1), softcap)] * 2 * (1 + 3) + [
        ((5, 0), softcap)] * 2
    assert [c[2:] for c in calls] == [(True, (-1, -1), softcap)] * 2
    if softcap < 1:
        # The cap changes these logits: eager attention without it is elsewhere.
        model.config.attn_logit_softcapping = None
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = logits("eager")
        off = max((u - w_).abs().max().item() for u, w_ in zip(uncapped, want))
        print(f"max logit change without the cap: {off:.2e}")
        assert off > 10 * err
