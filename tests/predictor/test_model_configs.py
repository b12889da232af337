import json
import os
from pathlib import Path

import pytest

from common.errors import ConfigError, UnknownModelError
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
    from common.model_config import from_dict

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


# Qwen3-4B's public config.json (dims only): head_dim 128 differs from hidden / heads = 80.
QWEN3_4B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560,
            "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
            "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06}


def _cache_snapshot(hub, repo_folder, revision, config, mtime):
    snap = hub / repo_folder / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    os.utime(snap, (mtime, mtime))
    return snap


def test_hf_id_not_shipped_is_read_from_the_local_hf_cache_newest_snapshot(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    _cache_snapshot(hub, "models--Qwen--Qwen3-4B", "0ld", dict(QWEN3_4B, num_hidden_layers=2), mtime=1_000_000)
    _cache_snapshot(hub, "models--Qwen--Qwen3-4B", "n3w", QWEN3_4B, mtime=2_000_000)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE wins
    c = load_model_config("Qwen/Qwen3-4B")
    assert (c.name, c.model_type, c.num_layers, c.hidden_size, c.head_dim) == ("Qwen3-4B", "qwen3", 36, 2560, 128)
    assert c.qk_norm and not c.attention_bias and c.tie_word_embeddings
    assert load_model_config("qwen/qwen3-4b").num_layers == 36  # the hub's ids ignore case
    # A shipped config's id still resolves to the shipped config, whatever the cache holds.
    _cache_snapshot(hub, "models--Qwen--Qwen3-8B", "abc", dict(QWEN3_4B, num_hidden_layers=3), mtime=2_000_000)
    assert load_model_config("Qwen/Qwen3-8B").name == "qwen3-8b"


def test_hf_cache_falls_back_to_hf_home_hub(tmp_path, monkeypatch):
    _cache_snapshot(tmp_path / "hfhome" / "hub", "models--Qwen--Qwen3-4B", "abc", QWEN3_4B, mtime=1_000_000)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert load_model_config("Qwen/Qwen3-4B").num_layers == 36


def test_hf_id_missing_from_the_cache_is_one_config_error_naming_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as err:
        load_model_config("acme/Widget-7B")
    msg = str(err.value)
    assert "\n" not in msg and "not in the local Hugging Face cache" in msg
    assert str(tmp_path / "hub" / "models--acme--Widget-7B") + "/snapshots/*/config.json" in msg
    assert "qwen3-8b" in msg and "config.json" in msg and "nothing is downloaded" in msg


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 3, "num_key_value_heads": 3}, "hidden_size 128 is not divisible by num_attention_heads 3"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"num_key_value_heads": 8}, "num_attention_heads 4 is not a multiple of num_key_value_heads 8"),
])
def test_predict_refuses_heads_that_do_not_divide_in_one_line(tmp_path, change, message):
    """Such configs used to be accepted silently and priced with a truncated head size."""
    from tests.conftest import gpubench

    raw = json.loads((Path(__file__).parents[2] / "common/model_configs/tiny-llama.json").read_text())
    raw.pop("head_dim")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**raw, **change}))
    out = gpubench("predict", "--model", str(cfg), "--sku", "h100-sxm")
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
