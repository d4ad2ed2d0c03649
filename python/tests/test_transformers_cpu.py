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
