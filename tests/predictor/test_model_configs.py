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
