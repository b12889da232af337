"""RoPE re-rotation: exact relative-position property on tiny models (full, partial rotary, llama3
scaling, yarn, GQA) and on SmolLM2; per-token Δ; dynamic / longrope exact below their switch point and
refused past it.

Tolerance: the model forms its own angle m·θ in fp32, so its keys at position m carry an error of
about m·θ·2^-24·|k|; we allow 1e-5 + 8·eps32·s·max|K| (s = the shift).
"""
from __future__ import annotations

import pytest
import torch
from transformers import GPTNeoXConfig, LlamaConfig

from common.errors import KVCommError
from kvcomm.cache import KVCache, prefill
from kvcomm.models import TINY_CONFIGS, load_model, rope_info
from kvcomm.rope import check_relative, reposition, rerotate

from .conftest import random_ids

EPS32 = float(torch.finfo(torch.float32).eps)
_LLAMA_BASE = {k: v for k, v in TINY_CONFIGS["tiny-llama"].items() if k not in ("model_type", "rope_theta")}


def _assert_same_kv(shifted: KVCache, rerotated: KVCache, shift: int) -> None:
    scale = max(float(k.abs().max()) for k in shifted.keys)
    atol = 1e-5 + 8 * EPS32 * shift * scale
    for layer, (k1, k2, v1, v2) in enumerate(zip(shifted.keys, rerotated.keys, shifted.values, rerotated.values)):
        assert float((k1 - k2).abs().max()) <= atol, f"K differs at layer {layer}"
        assert float((v1 - v2).abs().max()) <= atol, f"V differs at layer {layer}"
    assert torch.equal(shifted.positions, rerotated.positions)


def _check_chunk_property(model, shift: int, num_tokens: int = 24, seed: int = 0) -> None:
    """A chunk encoded alone at [s, s+n) == the chunk encoded at [0, n) re-rotated by s (K and V, every layer)."""
    ids = random_ids(num_tokens, model.config.vocab_size, seed=seed)
    at_shift, _ = prefill(model, ids, positions=torch.arange(shift, shift + num_tokens))
    at_zero, _ = prefill(model, ids)
    _assert_same_kv(at_shift, rerotate(at_zero, shift, rope_info(model)), shift)


@pytest.mark.parametrize("shift", [1, 37, 900])
def test_chunk_at_offset_equals_rerotated_chunk(tiny_model, shift):
    _check_chunk_property(tiny_model, shift)


def test_rerotation_is_needed(tiny_llama):
    """Guard against a vacuous property: without re-rotation the keys really differ."""
    ids = random_ids(16, tiny_llama.config.vocab_size)
    at_shift, _ = prefill(tiny_llama, ids, positions=torch.arange(50, 66))
    at_zero, _ = prefill(tiny_llama, ids)
    assert float((at_shift.keys[0] - at_zero.keys[0]).abs().max()) > 0.1


def test_partial_rotary_gpt_neox():
    config = GPTNeoXConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=256, rotary_pct=0.25, max_position_embeddings=4096,
                           initializer_range=0.1)
    model, _ = load_model(config)
    info = rope_info(model)
    assert (info.rotary_dim, info.head_dim) == (8, 32)
    _check_chunk_property(model, 123)
    # dims past the rotary dim pass through untouched
    keys = torch.randn(1, 4, 5, 32)
    assert torch.equal(rerotate(keys, 9, info)[..., 8:], keys[..., 8:])


def test_llama3_scaled_inv_freq():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model, _ = load_model(LlamaConfig(rope_parameters=rope, **_LLAMA_BASE))
    info = rope_info(model)
    default = 1.0 / (500000.0 ** (torch.arange(0, 32, 2, dtype=torch.float32) / 32))
    assert info.rope_type == "llama3" and not torch.allclose(info.inv_freq, default)  # really rescaled
    _check_chunk_property(model, 300)


def test_per_token_delta_and_composition():
    info_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 6, 16, generator=g)
    deltas = torch.tensor([0, 3, -2, 100, 7, 1])
    per_token = rerotate(keys, deltas, info_freq)
    for t, d in enumerate(deltas.tolist()):
        one = rerotate(keys[:, :, t: t + 1], d, info_freq)
        torch.testing.assert_close(per_token[:, :, t: t + 1], one, atol=1e-6, rtol=0)
    torch.testing.assert_close(per_token[:, :, :1], keys[:, :, :1], atol=0, rtol=0)  # Δ = 0 is the identity
    there_and_back = rerotate(rerotate(keys, 250, info_freq), -250, info_freq)
    torch.testing.assert_close(there_and_back, keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(rerotate(rerotate(keys, 5, info_freq), 6, info_freq),
                               rerotate(keys, 11, info_freq), atol=1e-5, rtol=0)
    # norms are preserved (a rotation) and bf16 keys come back as bf16
    torch.testing.assert_close(per_token.norm(dim=-1), keys.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert rerotate(keys.to(torch.bfloat16), 3, info_freq).dtype == torch.bfloat16


def test_layer0_keys_at_arbitrary_positions(tiny_qwen2):
    """Layer-0 keys depend only on token and position: per-token Δ reproduces any position layout."""
    ids = random_ids(10, tiny_qwen2.config.vocab_size, seed=5)
    positions = torch.tensor([0, 4, 5, 9, 30, 31, 32, 60, 61, 90])
    scattered, _ = prefill(tiny_qwen2, ids, positions=positions)
    contiguous, _ = prefill(tiny_qwen2, ids)
    moved = reposition(contiguous, positions, tiny_qwen2)
    torch.testing.assert_close(moved.keys[0], scattered.keys[0], atol=1e-5, rtol=0)
    assert torch.equal(moved.positions, positions)


def _chunk_error(model, shift: int, num_tokens: int = 24) -> float:
    """Largest |K| difference between a chunk encoded at [shift, shift + n) and the chunk encoded at
    [0, n) re-rotated by ``shift``, over every layer."""
    ids = random_ids(num_tokens, model.config.vocab_size, seed=0)
    at_shift, _ = prefill(model, ids, positions=torch.arange(shift, shift + num_tokens))
    moved = rerotate(prefill(model, ids)[0], shift, rope_info(model))
    return max(float((a - b).abs().max()) for a, b in zip(at_shift.keys, moved.keys))


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("shift", [37, 900])
def test_yarn_rerotates_as_exactly_as_the_default_rope(shift):
    # yarn rescales inv_freq once and multiplies cos/sin by a constant: a rotation commutes with it
    yarn, _ = load_model(LlamaConfig(rope_parameters=_YARN, **_LLAMA_BASE))
    default, _ = load_model(LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_LLAMA_BASE))
    info = rope_info(yarn)
    assert info.rope_type == "yarn" and info.attention_scaling > 1.0 and info.switch_position is None
    _check_chunk_property(yarn, shift)
    # the measured error is fp32 rounding, the size the default rope's is (a wrong scale would be ~|K|)
    yarn_err, default_err = _chunk_error(yarn, shift), _chunk_error(default, shift)
    assert yarn_err <= 4 * default_err + 1e-6, (yarn_err, default_err)


def _longrope_params(head_dim: int) -> dict:
    half = head_dim // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 1024,
            "short_factor": [1.0 + 0.05 * i for i in range(half)], "long_factor": [2.0 + 0.3 * i for i in range(half)]}


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_switching_ropes_rerotate_exactly_below_their_switch_point_and_refuse_past_it(rope_type):
    head_dim = _LLAMA_BASE["hidden_size"] // _LLAMA_BASE["num_attention_heads"]
    params = (_longrope_params(head_dim) if rope_type == "longrope"
              else {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    model, _ = load_model(LlamaConfig(rope_parameters=params, **_LLAMA_BASE))
    info = rope_info(model)
    switch = 1024 if rope_type == "longrope" else _LLAMA_BASE["max_position_embeddings"]
    assert info.rope_type == rope_type and info.switch_position == switch
    num_tokens = 24
    _check_chunk_property(model, switch - num_tokens, num_tokens)  # the last token lands on switch - 1
    cache, _ = prefill(model, [5, 6, 7])
    with pytest.raises(KVCommError, match=f"{rope_type}' switches inv_freq past sequence length {switch}"):
        rerotate(cache, switch - 2, info)  # the last token would land on switch
    with pytest.raises(KVCommError, match="needs the cache's positions"):
        rerotate(cache.keys[0], 4, info.inv_freq, rope_type=rope_type)  # a bare tensor: positions unknown
    # past the switch the model's own keys really use other frequencies: re-rotating there would be wrong
    ids = random_ids(num_tokens, model.config.vocab_size, seed=0)
    past, _ = prefill(model, ids, positions=torch.arange(switch + 10, switch + 10 + num_tokens))
    forced = rerotate(prefill(model, ids)[0].keys[0], switch + 10, info.inv_freq)  # default type: unchecked
    assert float((past.keys[0] - forced).abs().max()) > 1e-3


def test_refuses_unknown_rope_and_bad_shapes():
    with pytest.raises(KVCommError, match="not known to be relative"):
        check_relative("mrope")
    with pytest.raises(KVCommError, match="one Δ per token"):
        rerotate(torch.zeros(1, 1, 4, 8), torch.tensor([1, 2]), torch.ones(4))
    with pytest.raises(KVCommError, match="exceeds head_dim"):
        rerotate(torch.zeros(1, 1, 4, 8), 1, torch.ones(8))


@pytest.mark.model
def test_smollm2_chunk_at_offset_equals_rerotated_chunk(smollm2):
    model, tok = smollm2
    ids = torch.tensor(tok("Alice keeps the red key in the blue box under the stairs.")["input_ids"])
    shift = 211
    at_shift, _ = prefill(model, ids, positions=torch.arange(shift, shift + ids.numel()))
    at_zero, _ = prefill(model, ids)
    assert at_zero.num_layers == 30 and at_zero.keys[0].shape[1] == 3  # GQA: 3 KV heads
    _assert_same_kv(at_shift, rerotate(at_zero, shift, model), shift)
