"""The host's part of a step that no GPU work hides: building a step's inputs. A serving engine's
graph replay takes a few milliseconds for an 8B decode, so the input copy must stay a small share of
it. The graph engine (predictor.graph_model) copies Python lists into static buffers; the eager engine
(predictor.torch_model) builds fresh tensors and masks. Both timed here on the CPU for a 64-sequence
decode batch of unequal lengths (the eager engine then also builds a key mask)."""
import os

import pytest
import torch

from common.model_config import load_model_config
from gpubench.results import git_commit
from predictor.graph_model import GraphCausalLM, PagedKVCache
from predictor.torch_model import TorchCausalLM

SEQS = 64
MAX_PREPARE_S = 2e-3  # 2 ms: well under an 8B decode step's ~5-7 ms on an H100-class GPU


def _batch():
    return [[7]] * SEQS, [1000 + 3 * i for i in range(SEQS)]


def _info(benchmark, **kw):
    benchmark.extra_info.update(git_sha=git_commit(), device="cpu (1 thread)", loadavg_1m=os.getloadavg()[0], **kw)


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    cfg = load_model_config("tiny-llama")
    eager = TorchCausalLM(cfg, dtype="fp32")
    cache = PagedKVCache(cfg, num_blocks=SEQS * 80, block_size=16, dtype=torch.float32, device="cpu")
    return eager, GraphCausalLM(eager, cache, max_tokens=SEQS, max_seqs=SEQS)


def test_graph_engine_prepare_64_decodes(benchmark, engines):
    _, graph = engines
    ids, cached = _batch()
    graph.layout(SEQS, max(cached) + 1)
    shape, order = benchmark(graph.prepare, ids, cached)
    assert shape.decode_only and not shape.uniform_decode and len(order) == SEQS
    _info(benchmark, engine="torch-graph", seqs=SEQS)
    assert benchmark.stats.stats.median < MAX_PREPARE_S


def test_eager_engine_prepare_64_decodes(benchmark, engines):
    eager, _ = engines
    ids, cached = _batch()
    inp = benchmark(eager.prepare, ids, cached)
    assert inp.num_decode == SEQS and inp.decode_mask is not None
    _info(benchmark, engine="torch", seqs=SEQS)
