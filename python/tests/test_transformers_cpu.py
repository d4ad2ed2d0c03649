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
