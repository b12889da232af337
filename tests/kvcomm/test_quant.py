"""8-bit KV quantization: per-group error bound, compression at the default group size, and the
effect of a round trip on SmolLM2's next-token logits.

Stated tolerances: per group |x − x̂| <= (max − min)/510 + 2 ulp(max|x|) (fp32 reconstruction);
SmolLM2 round trip: same greedy token, max |Δlogit| < 0.25 (logits span ~±16), total variation of
the next-token distribution < 0.05 (measured: 0.06 and 0.006 on a 66-token context).
"""
from __future__ import annotations

import pytest
import torch

from common.errors import KVCommError
from kvcomm.cache import continue_from, prefill
from kvcomm.quant import DEFAULT_GROUP_SIZE, PARAM_DTYPE, dequantize, dequantize_groups, quant_report, quantize, quantize_groups

from .conftest import random_ids

EPS32 = float(torch.finfo(torch.float32).eps)


def _check_bound(x: torch.Tensor, group_size: int) -> None:
    """Recompute every group's range independently and check the reconstruction against it."""
    qt = quantize_groups(x, group_size)
    back = dequantize_groups(qt)
    n = x.shape[-1]
    for start in range(0, n, group_size):
        g, gb = x[..., start: start + group_size].float(), back[..., start: start + group_size].float()
        bound = (g.amax(-1) - g.amin(-1)) / 510 + 2 * EPS32 * g.abs().amax(-1)
        err = (g - gb).abs().amax(-1)
        assert bool((err <= bound).all()), f"group at {start}: max excess {float((err - bound).max())}"


@pytest.mark.parametrize("group_size", [1, 7, 32, 128])
def test_error_bound_per_group(group_size):
    g = torch.Generator().manual_seed(group_size)
    # channels with large offsets and small ranges (what slow-rotating key channels look like),
    # a constant row, and a last group shorter than group_size (n = 300)
    x = torch.randn(3, 5, 300, generator=g) * torch.logspace(-3, 1, 5)[None, :, None]
    x = x + torch.tensor([0.0, 50.0, -20.0, 3.0, 1000.0])[None, :, None]
    x[0, 0] = 2.5
    _check_bound(x, group_size)
    qt = quantize_groups(x, group_size)
    assert qt.payload.dtype == torch.uint8 and qt.scale.dtype == PARAM_DTYPE and qt.zero.dtype == PARAM_DTYPE
    assert torch.equal(dequantize_groups(qt)[0, 0], x[0, 0])  # a constant group is exact


def test_cache_round_trip_bound_and_layout(tiny_llama):
    ids = random_ids(140, tiny_llama.config.vocab_size)
    cache, _ = prefill(tiny_llama, ids, positions=torch.arange(10, 150))
    q = quantize(cache, group_size=64)
    back = dequantize(q)
    assert torch.equal(back.positions, cache.positions) and torch.equal(back.token_ids, cache.token_ids)
    for k, kb, v, vb in zip(cache.keys, back.keys, cache.values, back.values):
        assert kb.shape == k.shape and vb.shape == v.shape
        # keys: per (head, channel) over 64-token groups; values: per token over all kv channels
        for t0 in range(0, 140, 64):
            kg, kbg = k[:, :, t0: t0 + 64], kb[:, :, t0: t0 + 64]
            bound = (kg.amax(2) - kg.amin(2)) / 510 + 2 * EPS32 * kg.abs().amax(2)
            assert bool(((kg - kbg).abs().amax(2) <= bound).all())
        vt, vbt = v.permute(0, 2, 1, 3).flatten(2), vb.permute(0, 2, 1, 3).flatten(2)
        bound = (vt.amax(-1) - vt.amin(-1)) / 510 + 2 * EPS32 * vt.abs().amax(-1)
        assert bool(((vt - vbt).abs().amax(-1) <= bound).all())


def test_bf16_cache_stays_bf16(tiny_qwen2):
    cache, _ = prefill(tiny_qwen2, random_ids(20, tiny_qwen2.config.vocab_size))
    back = dequantize(quantize(cache.to(torch.bfloat16)))
    assert back.dtype == torch.bfloat16 and back.keys[0].shape == cache.keys[0].shape


def test_tiny_round_trip_keeps_next_token(tiny_model):
    ids = random_ids(40, tiny_model.config.vocab_size, seed=3)
    cache, _ = prefill(tiny_model, ids[:-1])
    _, ref = continue_from(tiny_model, cache, ids[-1:])
    _, got = continue_from(tiny_model, dequantize(quantize(cache)), ids[-1:])
    assert int(got.argmax(-1)) == int(ref.argmax(-1))
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_bad_group_size():
    with pytest.raises(KVCommError, match="group size"):
        quantize_groups(torch.zeros(4, 8), 0)


@pytest.mark.model
def test_smollm2_compression_at_default_group_size(smollm2):
    """256 tokens (two whole key groups of the default 128): payload + fp32 scales + fp32 zeros."""
    model, _ = smollm2
    cache, _ = prefill(model, random_ids(256, model.config.vocab_size, seed=7))
    q = quantize(cache)
    layers, kv_dim, tokens = 30, 3 * 64, 256
    key_bytes = kv_dim * tokens + kv_dim * (tokens // DEFAULT_GROUP_SIZE) * 8
    value_bytes = kv_dim * tokens + tokens * 8  # one group per token (all 192 kv channels)
    assert q.nbytes == layers * (key_bytes + value_bytes)
    report = quant_report(cache, q)
    assert report.ratio_vs_fp32 >= 3.75 and report.ratio_vs_bf16 >= 1.85
    assert report.ratio_vs_fp32 == pytest.approx(cache.nbytes / q.nbytes)
    assert 0 < report.mse_keys < 1e-3 and 0 < report.mse_values < 1e-3


@pytest.mark.model
def test_smollm2_round_trip_changes_next_token_logits_little(smollm2):
    model, tok = smollm2
    text = "Agent A found that the warehouse in Lyon stores 42 crates of copper wire, shipped every Tuesday. " * 3
    ids = torch.tensor(tok(text)["input_ids"])
    cache, _ = prefill(model, ids[:-1])
    _, ref = continue_from(model, cache, ids[-1:])
    _, got = continue_from(model, dequantize(quantize(cache)), ids[-1:])
    assert int(got.argmax(-1)) == int(ref.argmax(-1))
    assert float((got - ref).abs().max()) < 0.25
    tv = 0.5 * float((ref[0, -1].softmax(-1) - got[0, -1].softmax(-1)).abs().sum())
    assert tv < 0.05
