"""CacheBlend: r = 1 is a full prefill, r = 0 is pure re-rotated reuse, recompute counts follow r,
selection follows the value deviation; on tiny Llama/Qwen2 and on SmolLM2.

Tolerances: logits within 1e-4 (tiny) / 2e-3 (SmolLM2, 30 layers) of the reference; K/V within 1e-4.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from common.errors import KVCommError
from kvcomm.blend import blend_prefill, reuse_prefill
from kvcomm.cache import KVCache, continue_from, prefill
from kvcomm.models import TINY_CONFIGS, load_model, rope_info
from kvcomm.rope import reposition

from .conftest import random_ids


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _chunks(model, sizes=(12, 9, 15), query_len=5, seed=0):
    ids = random_ids(sum(sizes) + query_len, model.config.vocab_size, seed=seed)
    chunks = list(torch.split(ids[: sum(sizes)], list(sizes)))
    return chunks, ids[sum(sizes):], [prefill(model, c)[0] for c in chunks]


def test_ratio_one_is_a_full_prefill(tiny_model):
    chunks, query, caches = _chunks(tiny_model)
    full, full_logits = prefill(tiny_model, torch.cat(chunks + [query]))
    for check_layer in (0, 1, 3):
        out = blend_prefill(tiny_model, caches, query, ratio=1.0, check_layer=check_layer)
        torch.testing.assert_close(out.logits, full_logits[:, -5:], atol=1e-4, rtol=1e-4)
        assert _max_diff(out.cache.keys, full.keys) < 1e-4 and _max_diff(out.cache.values, full.values) < 1e-4
    assert out.recomputed_per_layer == [36 + 5] * 4
    assert torch.equal(out.cache.positions, torch.arange(41)) and torch.equal(out.cache.token_ids, full.token_ids)


def test_ratio_zero_is_pure_rerotated_reuse(tiny_model):
    chunks, query, caches = _chunks(tiny_model, seed=1)
    reuse, reuse_logits = reuse_prefill(tiny_model, caches, query)
    out = blend_prefill(tiny_model, caches, query, ratio=0.0)
    torch.testing.assert_close(out.logits, reuse_logits, atol=1e-4, rtol=1e-4)
    assert _max_diff(out.cache.keys, reuse.keys) < 1e-4 and _max_diff(out.cache.values, reuse.values) < 1e-4
    assert out.recomputed_per_layer == [5] * 4 and out.selected_indices.numel() == 0
    # reuse really differs from a full prefill (independently encoded chunks miss cross-attention)
    _, full_logits = prefill(tiny_model, torch.cat(chunks + [query]))
    assert float((reuse_logits - full_logits[:, -5:]).abs().max()) > 1e-2


@pytest.mark.parametrize("ratio", [0.15, 0.5])
def test_recompute_counts_and_selection_follow_deviation(tiny_llama, ratio):
    chunks, query, caches = _chunks(tiny_llama, seed=2)
    out = blend_prefill(tiny_llama, caches, query, ratio=ratio)
    num_keep = round(ratio * 36)
    assert out.recomputed_per_layer == [num_keep + 5] * 4
    assert out.selected_indices.numel() == num_keep
    # the kept tokens are the most deviating ones, and the first chunk (encoded in place) deviates ~0
    kept = out.deviation[out.selected_indices]
    dropped = torch.ones(36, dtype=torch.bool)
    dropped[out.selected_indices] = False
    assert float(kept.min()) >= float(out.deviation[dropped].max())
    assert float(out.deviation[:12].max()) < 1e-6 and float(out.deviation[12:].min()) > 1e-3
    # selected slots hold recomputed K/V; the others keep the re-rotated cached K/V
    reuse, _ = reuse_prefill(tiny_llama, caches, query)
    last = out.cache.keys[-1][0, :, :36]
    other = torch.tensor([i for i in range(36) if i not in set(out.selected_indices.tolist())])
    assert float((last[:, other] - reuse.keys[-1][0, :, other]).abs().max()) < 1e-5
    assert float((last[:, out.selected_indices] - reuse.keys[-1][0, :, out.selected_indices]).abs().max()) > 1e-3


def _independent_deviation(model, prefix_ids, chunks, query, caches, layer: int, which: str = "values"):
    """Per chunk token, Σ_heads,dims (fresh − imported)² at ``layer``, computed without blend.py.

    "Fresh" is what a full prefill of the concatenated sequence holds at that layer (the exact K/V a
    receiver would have computed); "imported" is each chunk's own cache, keys re-rotated to the fused
    positions (values carry no position). Returns [num_chunk_tokens].
    """
    ids = torch.cat([prefix_ids, *chunks, query])
    full, _ = prefill(model, ids)
    start, num_chunk = prefix_ids.numel(), sum(c.numel() for c in chunks)
    placed = []
    for cache in caches:
        placed.append(reposition(cache, start + sum(c.num_tokens for c in placed), rope_info(model)))
    imported = torch.cat([getattr(c, which)[layer] for c in placed], dim=2)
    fresh = getattr(full, which)[layer][:, :, start:start + num_chunk]
    return ((fresh - imported) ** 2).sum(dim=(0, 1, 3))


def _top(deviation: torch.Tensor, num_keep: int) -> set[int]:
    return set(torch.topk(deviation, num_keep).indices.tolist())


@pytest.mark.parametrize("check_layer", [1, 2])
def test_deviation_and_selection_match_an_independent_full_prefill(tiny_model, check_layer):
    """blend's reported deviation is the check layer's value deviation against a full prefill, and it
    selects that deviation's top tokens; ranking by keys, or at another layer, selects other tokens."""
    chunks, query, caches = _chunks(tiny_model, seed=5)
    ratio, num_chunk = 0.25, 36
    num_keep = round(ratio * num_chunk)
    empty = torch.empty(0, dtype=torch.long)
    expected = _independent_deviation(tiny_model, empty, chunks, query, caches, check_layer)
    out = blend_prefill(tiny_model, caches, query, ratio=ratio, check_layer=check_layer)
    torch.testing.assert_close(out.deviation, expected, atol=1e-5, rtol=1e-4)
    assert set(out.selected_indices.tolist()) == _top(expected, num_keep)
    # the comparison can tell the wrong variants apart on this input (else it would prove nothing)
    by_keys = _independent_deviation(tiny_model, empty, chunks, query, caches, check_layer, "keys")
    other_layer = _independent_deviation(tiny_model, empty, chunks, query, caches, 3 - check_layer)
    assert _top(by_keys, num_keep) != _top(expected, num_keep)
    assert _top(other_layer, num_keep) != _top(expected, num_keep)


def test_deviation_behind_a_shared_prefix_matches_an_independent_full_prefill(tiny_qwen2):
    """As the receiver uses it: B's exact prefix, chunks encoded behind their own copy of it."""
    prefix_ids = random_ids(6, tiny_qwen2.config.vocab_size, seed=9)
    prefix, _ = prefill(tiny_qwen2, prefix_ids)
    chunks = [random_ids(n, tiny_qwen2.config.vocab_size, seed=30 + n) for n in (10, 13)]
    # the second chunk is encoded at positions 6.. as well (alone behind the prefix), so it needs re-rotation
    caches = [continue_from(tiny_qwen2, prefix, c)[0].slice(6) for c in chunks]
    query = random_ids(4, tiny_qwen2.config.vocab_size, seed=21)
    expected = _independent_deviation(tiny_qwen2, prefix_ids, chunks, query, caches, 1)
    out = blend_prefill(tiny_qwen2, caches, query, ratio=0.3, prefix=prefix)
    torch.testing.assert_close(out.deviation, expected, atol=1e-5, rtol=1e-4)
    assert set((out.selected_indices - 6).tolist()) == _top(expected, round(0.3 * 23))


def test_shared_prefix(tiny_qwen2):
    """Chunks encoded after a shared prefix: r = 1 is a full prefill, r = 0 is reuse behind the prefix."""
    prefix_ids = random_ids(6, tiny_qwen2.config.vocab_size, seed=9)
    prefix, _ = prefill(tiny_qwen2, prefix_ids)
    chunks = [random_ids(n, tiny_qwen2.config.vocab_size, seed=10 + n) for n in (8, 11)]
    caches = [continue_from(tiny_qwen2, prefix, c)[0].slice(6) for c in chunks]
    query = random_ids(4, tiny_qwen2.config.vocab_size, seed=20)
    _, full_logits = prefill(tiny_qwen2, torch.cat([prefix_ids, *chunks, query]))
    out1 = blend_prefill(tiny_qwen2, caches, query, ratio=1.0, prefix=prefix)
    torch.testing.assert_close(out1.logits, full_logits[:, -4:], atol=1e-4, rtol=1e-4)
    assert out1.recomputed_per_layer == [19 + 4] * 4  # prefix tokens are never recomputed
    _, reuse_logits = reuse_prefill(tiny_qwen2, caches, query, prefix=prefix)
    out0 = blend_prefill(tiny_qwen2, caches, query, ratio=0.0, prefix=prefix)
    torch.testing.assert_close(out0.logits, reuse_logits, atol=1e-4, rtol=1e-4)
    assert float(out1.deviation[:8].max()) < 1e-6  # the first chunk was encoded right behind the prefix


def test_fused_cache_continues_decoding(tiny_llama):
    chunks, query, caches = _chunks(tiny_llama, seed=3)
    out = blend_prefill(tiny_llama, caches, query, ratio=1.0)
    token = int(out.logits[0, -1].argmax())
    _, nxt = continue_from(tiny_llama, out.cache, [token])
    _, ref = prefill(tiny_llama, torch.cat(chunks + [query, torch.tensor([token])]))
    torch.testing.assert_close(nxt[0, -1], ref[0, -1], atol=1e-4, rtol=1e-4)


def test_bad_arguments(tiny_llama):
    chunks, query, caches = _chunks(tiny_llama, sizes=(4,), seed=4)
    with pytest.raises(KVCommError, match="ratio"):
        blend_prefill(tiny_llama, caches, query, ratio=1.5)
    with pytest.raises(KVCommError, match="check layer"):
        blend_prefill(tiny_llama, caches, query, check_layer=4)
    no_ids = KVCache(keys=caches[0].keys, values=caches[0].values, positions=caches[0].positions)
    with pytest.raises(KVCommError, match="token ids"):
        blend_prefill(tiny_llama, [no_ids], query)
    base = {k: v for k, v in TINY_CONFIGS["tiny-llama"].items() if k not in ("model_type", "rope_theta")}
    mrope, _ = load_model(LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **base))
    mrope.model.rotary_emb.rope_type = "mrope"  # a rope type re-rotation does not know
    with pytest.raises(KVCommError, match="mrope"):
        blend_prefill(mrope, [prefill(mrope, [5, 6, 7])[0], prefill(mrope, [8, 9])[0]], [10])


def test_yarn_blend_at_ratio_one_is_a_full_prefill():
    # yarn's attention factor scales the model's cos/sin; re-rotated chunks and the hand-run layers
    # must both carry it for r = 1 to reproduce the model's own prefill
    base = {k: v for k, v in TINY_CONFIGS["tiny-llama"].items() if k not in ("model_type", "rope_theta")}
    yarn, _ = load_model(LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                      "original_max_position_embeddings": 1024}, **base))
    assert rope_info(yarn).attention_scaling > 1.0
    chunks, query, caches = _chunks(yarn, seed=5)
    full, full_logits = prefill(yarn, torch.cat(chunks + [query]))
    out = blend_prefill(yarn, caches, query, ratio=1.0)
    torch.testing.assert_close(out.logits, full_logits[:, -5:], atol=1e-4, rtol=1e-4)
    assert _max_diff(out.cache.keys, full.keys) < 1e-4
    reuse, _ = reuse_prefill(yarn, caches, query)
    assert _max_diff(reuse.keys[:1], full.keys[:1]) < 1e-4  # layer 0 has no cross-chunk context: exact


@pytest.mark.model
def test_smollm2_blend_extremes(smollm2):
    model, tok = smollm2
    texts = ["Document 1: The lighthouse on Skerry Point was built in 1871 by the Harbour Board.",
             "Document 2: Its keeper, Ada Morrow, kept the lamp lit through the storm of 1903.",
             "Question: Who kept the lamp lit in 1903? Answer:"]
    chunk_ids = [torch.tensor(tok(t)["input_ids"]) for t in texts[:2]]
    query = torch.tensor(tok(" " + texts[2])["input_ids"])
    caches = [prefill(model, c)[0] for c in chunk_ids]
    num_context = sum(c.numel() for c in chunk_ids)
    _, full_logits = prefill(model, torch.cat(chunk_ids + [query]))
    q = query.numel()
    out1 = blend_prefill(model, caches, query, ratio=1.0)
    torch.testing.assert_close(out1.logits, full_logits[:, -q:], atol=2e-3, rtol=1e-3)
    _, reuse_logits = reuse_prefill(model, caches, query)
    out0 = blend_prefill(model, caches, query, ratio=0.0)
    torch.testing.assert_close(out0.logits, reuse_logits, atol=2e-3, rtol=1e-3)
    out = blend_prefill(model, caches, query, ratio=0.15)
    assert out.recomputed_per_layer == [round(0.15 * num_context) + q] * 30
    # recomputing 15% of the context moves the query's distribution most of the way back to the full
    # prefill (measured on this input: KL 0.120 at r = 0, 0.039 at r = 0.15, 0.0024 at r = 0.5)
    ref = full_logits[:, -q:]
    assert _kl(ref, out.logits) < 0.5 * _kl(ref, out0.logits)


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of KL(p || q) between the softmax distributions."""
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())
