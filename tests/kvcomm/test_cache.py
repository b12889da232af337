"""KVCache container, the transformers adapter, prefill/continue_from (tiny random models + SmolLM2)."""
from __future__ import annotations

import pytest
import torch

from common.errors import KVCommError
from kvcomm.cache import KVCache, continue_from, greedy_generate, hf_cache_kwargs, prefill

from .conftest import random_ids


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_prefill_matches_model_forward(tiny_model):
    ids = random_ids(24, tiny_model.config.vocab_size)
    cache, logits = prefill(tiny_model, ids)
    with torch.no_grad():
        ref = tiny_model(ids[None], use_cache=True)
    assert cache.num_tokens == 24 and cache.num_layers == tiny_model.config.num_hidden_layers
    assert torch.equal(cache.positions, torch.arange(24)) and torch.equal(cache.token_ids, ids)
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    own = KVCache.from_hf(ref.cache)
    assert _max_diff(cache.keys, own.keys) < 1e-5 and _max_diff(cache.values, own.values) < 1e-5


def test_continue_from_equals_one_prefill(tiny_model):
    ids = random_ids(30, tiny_model.config.vocab_size, seed=1)
    full, full_logits = prefill(tiny_model, ids)
    head, _ = prefill(tiny_model, ids[:17])
    head_copy = head.clone()
    joined, tail_logits = continue_from(tiny_model, head, ids[17:])
    torch.testing.assert_close(tail_logits, full_logits[:, 17:], atol=1e-5, rtol=1e-5)
    assert _max_diff(joined.keys, full.keys) < 1e-5 and _max_diff(joined.values, full.values) < 1e-5
    assert torch.equal(joined.positions, full.positions) and torch.equal(joined.token_ids, ids)
    # the input cache is not modified
    assert head.num_tokens == 17 and _max_diff(head.keys, head_copy.keys) == 0.0
    # last_only: the last row alone (what a receiver's prefill needs), the same cache
    last, last_logits = continue_from(tiny_model, head, ids[17:], last_only=True)
    assert last_logits.shape == (1, 1, full_logits.shape[-1])
    torch.testing.assert_close(last_logits[0, 0], full_logits[0, -1], atol=1e-5, rtol=1e-5)
    assert _max_diff(last.keys, joined.keys) == 0.0


def test_slice_concat_round_trip(tiny_llama):
    ids = random_ids(20, tiny_llama.config.vocab_size, seed=2)
    cache, _ = prefill(tiny_llama, ids, positions=torch.arange(100, 120))
    parts = [cache.slice(0, 5), cache.slice(5, 13), cache.slice(13)]
    assert [p.num_tokens for p in parts] == [5, 8, 7]
    assert parts[1].positions.tolist() == list(range(105, 113))
    back = KVCache.concat(parts)
    assert _max_diff(back.keys, cache.keys) == 0.0 and _max_diff(back.values, cache.values) == 0.0
    assert torch.equal(back.positions, cache.positions) and torch.equal(back.token_ids, ids)
    assert cache.next_position == 120
    assert cache.nbytes == 2 * sum(k.numel() * 4 for k in cache.keys)
    assert cache.to(torch.bfloat16).dtype == torch.bfloat16


def test_adapter_round_trip_is_lossless(tiny_qwen2):
    cache, _ = prefill(tiny_qwen2, random_ids(9, tiny_qwen2.config.vocab_size, seed=3))
    hf = cache.to_hf(tiny_qwen2)
    assert hf.get_seq_length() == 9
    back = KVCache.from_hf(hf, positions=cache.positions)
    assert _max_diff(back.keys, cache.keys) == 0.0 and _max_diff(back.values, cache.values) == 0.0


def test_toolkit_cache_continues_generation_like_the_models_own(tiny_model):
    """A cache stitched from toolkit pieces drives transformers' own generate() to the same tokens."""
    ids = random_ids(26, tiny_model.config.vocab_size, seed=4)
    a, _ = prefill(tiny_model, ids[:10])
    b, _ = continue_from(tiny_model, a, ids[10:25])
    stitched = KVCache.concat([b.slice(0, 10), b.slice(10)])
    gen_kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  pad_token_id=0)
    with torch.no_grad():
        own = tiny_model.generate(ids[None], **gen_kw)
        ours = tiny_model.generate(ids[None], **hf_cache_kwargs(stitched.to_hf(tiny_model)), **gen_kw)
    assert own.sequences.tolist() == ours.sequences.tolist()
    for x, y in zip(own.logits, ours.logits):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    # and our own greedy loop agrees with generate()
    tokens, final, rows = greedy_generate(tiny_model, stitched, ids[25:], 8)
    assert tokens == own.sequences[0, 26:].tolist()
    assert final.num_tokens == 26 + 7 and final.positions.tolist() == list(range(33))


def test_bad_inputs_raise_kvcomm_error(tiny_llama):
    cache, _ = prefill(tiny_llama, random_ids(6, tiny_llama.config.vocab_size))
    with pytest.raises(KVCommError, match="positions"):
        KVCache(keys=cache.keys, values=cache.values, positions=torch.arange(5))
    with pytest.raises(KVCommError, match="positions for 3 tokens"):
        prefill(tiny_llama, [5, 6, 7], positions=[0, 1])
    with pytest.raises(KVCommError, match="batch 1"):
        prefill(tiny_llama, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(KVCommError, match="at least one"):
        KVCache.concat([])
    with pytest.raises(KVCommError, match="max_new_tokens"):
        greedy_generate(tiny_llama, cache, [5], 0)


@pytest.mark.model
def test_smollm2_toolkit_cache_continues_like_own_cache(smollm2):
    model, tok = smollm2
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = torch.tensor(tok(prompt)["input_ids"])
    n = ids.numel()
    first, _ = prefill(model, ids[: n // 2])
    second, _ = continue_from(model, first, ids[n // 2: n - 1])
    stitched = KVCache.concat([second.slice(0, 3), second.slice(3)])
    gen_kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        own = model.generate(ids[None], **gen_kw)
        ours = model.generate(ids[None], **hf_cache_kwargs(stitched.to_hf(model)), **gen_kw)
    assert own.sequences.tolist() == ours.sequences.tolist()
    for x, y in zip(own.logits, ours.logits):
        torch.testing.assert_close(x, y, atol=2e-3, rtol=1e-3)
    assert "Rome" in tok.decode(own.sequences[0, n:])
