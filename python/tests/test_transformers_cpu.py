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


def _reference_launch(calls):
    """flashcore's documented forward on the CPU (bottom-right causal, GQA by head count),
    standing in for the GPU launch so the backend's routing can be checked here."""
    import math

    import torch

    def launch(q, k, v, causal, scale, layout, out_layout, return_lse):
        assert (layout, out_layout, return_lse) == ("bhsd", "bshd", False)
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        b, h, sq, d = q.shape
        sk = k.shape[2]
        k = k.repeat_interleave(h // k.shape[1], 1).double()
        v = v.repeat_interleave(h // v.shape[1], 1).double()
        s = (q.double() @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(d))
        if causal:
            i, j = torch.arange(sq)[:, None], torch.arange(sk)[None]
            s = s.masked_fill(j > i + sk - sq, -math.inf)
        return (s.softmax(-1) @ v).to(q.dtype).transpose(1, 2).contiguous(), None

    return launch


def _use_reference_launch(monkeypatch, calls):
    """The backend's flashcore path on CPU tensors, through `_reference_launch`."""
    monkeypatch.setattr(transformers_backend, "launch", _reference_launch(calls))
    monkeypatch.setattr(transformers_backend, "_on_gpu", lambda *tensors: True)


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
    assert calls and all(k[2] == 10 and causal for _, k, causal in calls), calls
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
    neither flashcore nor SDPA computes, are refused."""
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


@pytest.mark.parametrize("scaling", [1e-46, -0.125, float("nan"), float("inf"), 1e39, 0.0])
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
