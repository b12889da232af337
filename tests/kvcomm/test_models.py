"""Model loading: tiny seeded configs, config/dir paths, unknown names, rope_info, the real SmolLM2."""
from __future__ import annotations

import json

import pytest
import torch

from common.errors import GpubenchError, UnknownModelError
from kvcomm.models import TINY_CONFIGS, load_model, rope_info


def test_tiny_models_are_seeded_and_distinct(tiny_llama, tiny_qwen2):
    a = tiny_llama
    b, tok = load_model("tiny-llama")
    c, _ = load_model("tiny-llama", seed=1)
    assert tok is None and not b.training
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    q = tiny_qwen2
    assert q.config.model_type == "qwen2" and q.model.layers[0].self_attn.q_proj.bias is not None
    assert a.config.num_key_value_heads < a.config.num_attention_heads  # GQA


def test_config_file_and_model_dir(tmp_path, tiny_llama):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_CONFIGS["tiny-llama"]))
    from_file, _ = load_model(cfg)
    assert torch.equal(from_file.lm_head.weight, tiny_llama.lm_head.weight)  # same seed, same config
    tiny_llama.save_pretrained(tmp_path / "saved")
    from_dir, tok = load_model(tmp_path / "saved")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(from_dir(ids).logits, tiny_llama(ids).logits)
    assert tok is None


def test_unknown_name_is_a_user_error():
    with pytest.raises(UnknownModelError, match="did you mean: tiny-llama") as err:
        load_model("tiny-lama")
    assert isinstance(err.value, GpubenchError)


def test_rope_info_reads_the_models_own_inv_freq(tiny_qwen2):
    info = rope_info(tiny_qwen2)
    expected = 1.0 / (1e6 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    torch.testing.assert_close(info.inv_freq, expected)
    assert (info.rotary_dim, info.head_dim, info.rope_type, info.attention_scaling) == (32, 32, "default", 1.0)


@pytest.mark.model
def test_smollm2_shape_and_answer(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    info = rope_info(model)
    assert info.rotary_dim == 64 and info.rope_type == "default"
    torch.testing.assert_close(info.inv_freq, 1.0 / (1e5 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)))
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        token = int(model(ids).logits[0, -1].argmax())
    assert "Paris" in tok.decode([token])
