import json

import pytest

from gpubench.errors import ConfigError, UnknownModelError
from predictor import available_models, load_model_config


@pytest.mark.parametrize("name,params_b", [
    ("llama-3.1-8b", 8.030), ("llama-3.1-70b", 70.554), ("llama-3.2-1b", 1.236),
    ("qwen2.5-7b", 7.616), ("mistral-7b", 7.248), ("smollm2-135m", 0.1345),
])
def test_param_counts_match_published(name, params_b):
    assert load_model_config(name).param_count() / 1e9 == pytest.approx(params_b, rel=1e-3)


def test_llama8b_bf16_weights_16_06_gb():
    assert load_model_config("llama-3.1-8b").weight_bytes(2) / 1e9 == pytest.approx(16.06, abs=0.01)


def test_kv_bytes_per_token():
    c = load_model_config("llama-3.1-8b")  # 2 (K,V) x 32 layers x 8 kv heads x 128 x 2 bytes
    assert c.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2


def test_unknown_model_suggests():
    with pytest.raises(UnknownModelError, match="did you mean"):
        load_model_config("llama-3.1-8")


def test_path_and_errors(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{}")
    with pytest.raises(ConfigError, match="model_type"):
        load_model_config(p)
    p.write_text('{"model_type": "llama",\n "hidden_size": 64,,}')
    with pytest.raises(ConfigError, match=r"config.json:2: malformed JSON"):
        load_model_config(p)
    good = json.loads(open(load_model_config.__globals__["config_path"]("tiny-llama")).read())
    del good["vocab_size"]
    p.write_text(json.dumps(good))
    with pytest.raises(ConfigError, match="missing field 'vocab_size'"):
        load_model_config(p)
    assert "smollm2-135m" in available_models()


@pytest.mark.parametrize("name,params_b", [("qwen3-8b", 8.1907), ("qwen3-0.6b", 0.5960), ("mixtral-8x7b", 46.7028)])
def test_new_family_param_counts_match_published(name, params_b):
    # Qwen3-8B "8.2B", Qwen3-0.6B "0.6B (0.44B non-embedding)", Mixtral-8x7B 46.7B total
    assert load_model_config(name).param_count() / 1e9 == pytest.approx(params_b, rel=1e-4)


def test_qwen3_head_dim_qk_norm_and_no_bias():
    c = load_model_config("Qwen/Qwen3-8B")  # the HF id resolves to the shipped config
    assert (c.name, c.model_type, c.hidden_size, c.num_heads, c.head_dim) == ("qwen3-8b", "qwen3", 4096, 32, 128)
    assert c.qk_norm and not c.attention_bias and not c.is_moe
    small = load_model_config("qwen3-0.6b")
    # head_dim is the config's, not hidden / heads (1024 / 16 = 64)
    assert (small.hidden_size, small.num_heads, small.head_dim, small.q_dim, small.kv_dim) == (1024, 16, 128, 2048, 1024)
    # one layer: q,k,v,o + q_norm and k_norm weights (head_dim each) + MLP + two norms
    attn = 1024 * (2048 + 2 * 1024) + 2048 * 1024
    assert small.layer_params() == attn + 2 * 128 + 3 * 1024 * 3072 + 2 * 1024
    assert small.tie_word_embeddings and small.lm_head_params() == 0


def test_mixtral_experts_and_active_params():
    c = load_model_config("mistralai/Mixtral-8x7B-v0.1")
    assert (c.name, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("mixtral-8x7b", 8, 2, 14336)
    expert = 3 * 4096 * 14336
    assert c.expert_params() == expert
    attn = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    assert c.layer_params() == attn + 8 * 4096 + 8 * expert + 2 * 4096  # router + 8 experts + norms
    assert c.active_layer_params() == c.layer_params() - 6 * expert
    # "12.9B active parameters": two experts per layer, plus embeddings and lm_head
    active = c.num_layers * c.active_layer_params() + 2 * 32000 * 4096 + 4096
    assert active / 1e9 == pytest.approx(12.879, rel=1e-3)


QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
             "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "tie_word_embeddings": False}


def test_qwen3_moe_fields_and_errors(tmp_path):
    from predictor.config import from_dict

    c = from_dict(QWEN3_MOE)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.qk_norm) == (128, 8, 768, True)
    assert c.expert_params() == 3 * 2048 * 768  # moe_intermediate_size, not intermediate_size
    with pytest.raises(ConfigError, match="missing field 'num_experts'"):
        from_dict({k: v for k, v in QWEN3_MOE.items() if k != "num_experts"})
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(200\) exceeds the number of experts \(128\)"):
        from_dict({**QWEN3_MOE, "num_experts_per_tok": 200})
    with pytest.raises(ConfigError, match="dense layers"):
        from_dict({**QWEN3_MOE, "mlp_only_layers": [0]})
    mixtral = json.loads(open(load_model_config.__globals__["config_path"]("mixtral-8x7b")).read())
    del mixtral["num_local_experts"]
    with pytest.raises(ConfigError, match="missing field 'num_local_experts'"):
        from_dict(mixtral)
