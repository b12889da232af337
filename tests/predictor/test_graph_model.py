"""The graph engine (predictor.graph_model) computes what the eager engine computes: the same weights,
fused, over a token-major paged cache, step after step (fp32, on the CPU, where it runs eagerly).

Weights are drawn with a larger spread than the profiler's default (0.15, not 0.02) so that attention
moves the logits: at 0.02 a wrong cache slot changes them by ~1e-5 and no tolerance could tell.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import ConfigError
from common.model_config import from_dict, load_model_config
from predictor.graph_attention import choose_attention
from predictor.graph_model import GraphCausalLM, PagedKVCache
from predictor.torch_model import KVCache, TorchCausalLM

BLOCK, BLOCKS_PER_SEQ, SEQS = 16, 4, 4  # 64 positions per sequence

# (token ids per sequence, cached tokens per sequence) of three consecutive steps
STEPS = [
    ([list(range(1, 6)), list(range(6, 9)), list(range(9, 30)), [30, 31]], [0, 0, 0, 0]),
    # decodes of unequal length (rows 0 and 3), a chunked prefill on a cached prefix (row 1), and
    # row 2 decoding last in the caller's order
    ([[40], list(range(41, 48)), [48], [49]], [5, 3, 21, 2]),
    ([[50], [51], [52], [53]], [6, 10, 22, 3]),  # decode only, unequal lengths
]


def _config(variant: str):
    raw = copy.deepcopy(load_model_config("tiny-llama").raw)
    if variant == "qwen2-bias-untied":
        raw.update(model_type="qwen2", attention_bias=True, tie_word_embeddings=False)
    if variant == "llama3-rope":
        raw["rope_scaling"] = dict(load_model_config("llama-3.2-1b").rope_scaling, original_max_position_embeddings=16)
        raw["rope_theta"] = 500000.0
    return from_dict(raw, name=variant)


def _engines(variant: str, **kw):
    cfg = _config(variant)
    eager = TorchCausalLM(cfg, dtype="fp32", seed=0, init_std=0.15)
    eager_cache = KVCache(cfg, capacity_tokens=SEQS * BLOCK * BLOCKS_PER_SEQ, dtype=torch.float32)
    eager_cache.layout(SEQS, BLOCK * BLOCKS_PER_SEQ)
    paged = PagedKVCache(cfg, num_blocks=SEQS * BLOCKS_PER_SEQ, block_size=BLOCK, dtype=torch.float32, device="cpu")
    return eager, eager_cache, GraphCausalLM(eager, paged, max_tokens=64, max_seqs=SEQS, **kw)


def graph_logits(variant: str, **kw) -> list[torch.Tensor]:
    _, _, graph = _engines(variant, **kw)
    return [graph.step_logits(ids, cached) for ids, cached in STEPS]


@pytest.mark.parametrize("variant", ["tiny-llama", "qwen2-bias-untied", "llama3-rope"])
def test_every_step_matches_the_eager_engine_on_the_same_weights(variant):
    eager, cache, graph = _engines(variant)
    for ids, cached in STEPS:
        want = eager.step_logits(ids, cached, cache)
        torch.testing.assert_close(graph.step_logits(ids, cached), want, atol=1e-4, rtol=1e-4)
        assert graph.step(ids, cached) == want.argmax(-1).tolist()


def test_with_the_triton_kernels_under_the_interpreter_too(tmp_path):
    """The same steps with every fused op in Triton (a child process: Triton decides at import)."""
    pytest.importorskip("triton")
    out = tmp_path / "logits.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, __file__, str(out)], check=True, env=env, timeout=600)
    eager, cache, _ = _engines("qwen2-bias-untied")
    for (ids, cached), got in zip(STEPS, torch.load(out)):
        torch.testing.assert_close(got, eager.step_logits(ids, cached, cache), atol=1e-4, rtol=1e-4)


def test_freeing_the_unfused_weights_keeps_the_engine_exact():
    eager, cache, _ = _engines("qwen2-bias-untied")
    ids, cached = STEPS[0]
    want = eager.step_logits(ids, cached, cache)
    paged = PagedKVCache(eager.cfg, num_blocks=SEQS * BLOCKS_PER_SEQ, block_size=BLOCK, dtype=torch.float32, device="cpu")
    graph = GraphCausalLM(eager, paged, max_tokens=64, max_seqs=SEQS, free_unfused=True)
    assert not any(n.endswith(("q_proj.weight", "up_proj.weight", "v_proj.bias")) for n in eager.params)
    torch.testing.assert_close(graph.step_logits(ids, cached), want, atol=1e-4, rtol=1e-4)


def test_a_decode_shape_is_one_graph_key_whatever_the_tokens():
    _, _, graph = _engines("tiny-llama")
    a, _ = graph.prepare([[5], [6]], [10, 10])
    b, _ = graph.prepare([[7], [8]], [10, 10])
    c, _ = graph.prepare([[7], [8]], [10, 11])
    assert a == b and a.decode_only and a.uniform_decode
    assert c != a and not c.uniform_decode  # unequal lengths: a length mask, another graph


def test_a_step_the_engine_was_not_sized_for_is_one_clear_error():
    _, _, graph = _engines("tiny-llama")
    with pytest.raises(ConfigError, match="sized for 4"):
        graph.prepare([[1]] * 5, [1] * 5)
    with pytest.raises(ConfigError, match="holds 64 per sequence"):
        graph.prepare([[1]], [64])


def test_attention_falls_back_to_sdpa_here_and_says_why():
    auto = choose_attention("auto", torch.device("cpu"), torch.float32)
    assert auto.name == "sdpa" and "CUDA" in auto.fallback_reason
    with pytest.raises(ConfigError, match="--attention flash-varlen: "):
        choose_attention("flash-varlen", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ConfigError, match="use auto"):
        choose_attention("paged", torch.device("cpu"), torch.float32)


if __name__ == "__main__":  # the child of the Triton test, with TRITON_INTERPRET=1 set before Triton loads
    torch.save(graph_logits("qwen2-bias-untied", kernels="triton"), sys.argv[1])
