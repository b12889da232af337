"""The engine-step torch model is the real architecture: logits match transformers on the same weights."""
import copy

import pytest
import torch

from common.errors import ConfigError
from common.model_config import from_dict
from predictor import load_model_config
from predictor.torch_model import KVCache, TorchCausalLM, rope_inv_freq

transformers = pytest.importorskip("transformers")


def _variants():
    base = load_model_config("tiny-llama").raw
    llama3 = copy.deepcopy(base)  # Llama-3.2 rope scaling on the tiny shape
    llama3["rope_scaling"] = dict(load_model_config("llama-3.2-1b").rope_scaling)
    llama3["rope_scaling"]["original_max_position_embeddings"] = 16  # so the scaling bends short positions
    llama3["rope_theta"] = 500000.0
    qwen = copy.deepcopy(base)  # Qwen2: qkv bias, untied lm_head
    qwen.update(model_type="qwen2", attention_bias=True, tie_word_embeddings=False)
    return {"tiny-llama": base, "llama3-rope": llama3, "qwen2-bias-untied": qwen}


def _hf_model(raw: dict):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[raw["model_type"]]
    kw = {k: v for k, v in raw.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype")}
    hf_cfg = cls[0](**kw)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls[1](hf_cfg).eval()
    # Norm weights start at 1 in transformers; perturb them so a mix-up between the two norms shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("variant", list(_variants()))
def test_logits_match_transformers_prefill_then_mixed_step(variant):
    raw = _variants()[variant]
    cfg = from_dict(raw, name=variant)
    hf = _hf_model(raw)
    ours = TorchCausalLM(cfg, dtype="fp32")
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(1)
    seq_a = torch.randint(0, cfg.vocab_size, (14,), generator=gen).tolist()
    seq_b = torch.randint(0, cfg.vocab_size, (13,), generator=gen).tolist()
    seq_c = torch.randint(0, cfg.vocab_size, (10,), generator=gen).tolist()

    def ref(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0, -1]

    cache = KVCache(cfg, capacity_tokens=3 * 32, dtype=torch.float32)
    cache.layout(3, 32)
    # Step 1: prefills from empty caches (is_causal path), different lengths.
    got = ours.step_logits([seq_a[:12], seq_b[:7], seq_c[:5]], [0, 0, 0], cache)
    for row, want in zip(got, [ref(seq_a[:12]), ref(seq_b[:7]), ref(seq_c[:5])]):
        torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)
    # Step 2: mixed batch -> a decode (1 new token), a chunked prefill over a cached prefix, another decode
    # with a different context length (masked decode group).
    got = ours.step_logits([seq_a[12:13], seq_b[7:12], seq_c[5:6]], [12, 7, 5], cache)
    for row, want in zip(got, [ref(seq_a[:13]), ref(seq_b[:12]), ref(seq_c[:6])]):
        torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)
    # Step 3: all decode, contiguous cache rows (the view path), unequal lengths.
    got = ours.step_logits([seq_a[13:14], seq_b[12:13], seq_c[6:7]], [13, 12, 6], cache)
    for row, want in zip(got, [ref(seq_a), ref(seq_b), ref(seq_c[:7])]):
        torch.testing.assert_close(row, want, rtol=1e-4, atol=1e-4)


def test_sample_returns_caller_order_and_greedy_argmax():
    cfg = load_model_config("tiny-llama")
    model = TorchCausalLM(cfg, dtype="fp32", seed=3)
    cache = KVCache(cfg, capacity_tokens=4 * 16, dtype=torch.float32)
    cache.layout(4, 16)
    toks, cached = [[5, 6, 7], [9], [1, 2], [4]], [0, 3, 0, 8]
    logits = model.step_logits(toks, cached, cache)
    inp = model.prepare(toks, cached)
    assert inp.order == (1, 3, 0, 2)  # decodes first
    assert not isinstance(inp.decode_rows, slice)  # rows 1 and 3: gathered
    nxt = model.sample(model.forward(inp, cache), inp.order)
    assert nxt.tolist() == logits.argmax(-1).tolist()


def test_unsupported_rope_type_is_refused():
    raw = dict(load_model_config("tiny-llama").raw, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError, match="yarn"):
        rope_inv_freq(from_dict(raw))


def test_cache_layout_beyond_capacity_is_a_user_error():
    cfg = load_model_config("tiny-llama")
    cache = KVCache(cfg, capacity_tokens=100, dtype=torch.float32)
    with pytest.raises(ConfigError, match="holds 100 tokens"):
        cache.layout(4, 64)
