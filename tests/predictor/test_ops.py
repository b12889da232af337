"""Op graph FLOPs and bytes against hand-computed values."""
import numpy as np
import pytest

from common.errors import ConfigError
from predictor import available_models, load_model_config
from predictor.ops import OpGraph, batch_features, decode_features

L8 = dict(h=4096, q=4096, kv=1024, inter=14336, vocab=128256, layers=32, heads=32)


def graph(name="llama-3.1-8b", d=2):
    return OpGraph(load_model_config(name), d)


def totals(g, batch, attr):
    return float(g.totals(batch_features(batch)[None, :], attr)[0])


def op_total(g, batch, name, attr):
    f = batch_features(batch)[None, :]
    i = g.names.index(name)
    return float((f @ getattr(g, attr).T)[0, i] * g.num_calls[i])


def test_llama8b_decode_reads_15_01_gb_of_weights_not_16_06():
    g = graph()
    # 16.06 GB of bf16 parameters, minus the 128256 x 4096 embedding table (the gather reads 1 row),
    # lm_head (untied) read in full: 16,060,522,496 - 1,050,673,152 + 8,192 bytes.
    assert load_model_config("llama-3.1-8b").weight_bytes(2) == 16_060_522_496
    assert totals(g, [(1, 2048)], "weight_read_bytes") == 16_060_522_496 - 128256 * 4096 * 2 + 4096 * 2
    assert totals(g, [(1, 2048)], "weight_read_bytes") / 1e9 == pytest.approx(15.0099, abs=1e-4)
    # batch of 8: only the 7 extra embedding rows are added
    assert totals(g, [(1, 2048)] * 8, "weight_read_bytes") - totals(g, [(1, 2048)], "weight_read_bytes") == 7 * 4096 * 2


@pytest.mark.parametrize("name", available_models())
def test_decode_weight_bytes_every_model(name):
    cfg = load_model_config(name)
    g = OpGraph(cfg, 2)
    embed_table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    # an MoE step of 3 tokens reads only the experts they were routed to: E (1 - (1 - k/E)^3) expected
    unread = 0.0
    if cfg.is_moe:
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        unread = cfg.num_layers * (e - e * (1 - (1 - k / e) ** 3)) * cfg.expert_params()
    expect = (cfg.param_count() - embed_table + 3 * cfg.hidden_size - unread) * 2  # 3 embedding rows gathered
    assert totals(g, [(1, 10)] * 3, "weight_read_bytes") == pytest.approx(expect, rel=1e-12)


def test_llama8b_decode_gemm_flops():
    g = graph()
    # per layer: 2 * 4096 * (6144 qkv + 4096 o + 28672 gate_up) + 2 * 14336 * 4096 down
    per_layer = 2 * 4096 * (6144 + 4096 + 28672 + 14336)
    assert per_layer == 436_207_616
    lm_head = 2 * 4096 * 128256
    gemm = sum(op_total(g, [(1, 2048)], n, "flops") for n in ("qkv_proj", "o_proj", "gate_up", "down", "lm_head"))
    assert gemm == 32 * per_layer + lm_head == 15_009_316_864
    # batch 16: layer GEMMs scale with tokens, lm_head with sequences (16 here too)
    gemm16 = sum(op_total(g, [(1, 2048)] * 16, n, "flops") for n in ("qkv_proj", "o_proj", "gate_up", "down", "lm_head"))
    assert gemm16 == 16 * gemm


def test_attention_flops_and_kv_bytes_decode():
    g = graph()
    c = 1000
    # one query against c cached keys + its own: (c+1) pairs; 4*q FLOPs (QK and PV) + 5 per head (softmax)
    assert op_total(g, [(1, c)], "attention", "flops") == 32 * (c + 1) * (4 * 4096 + 5 * 32)
    kv_token = 2 * 32 * 1024 * 2  # K and V, 32 layers, 8 heads x 128, bf16
    assert op_total(g, [(1, c)], "attention", "kv_read_bytes") == (c + 1) * kv_token
    assert op_total(g, [(1, c)], "attention", "kv_write_bytes") == kv_token
    assert load_model_config("llama-3.1-8b").kv_bytes_per_token(2) == kv_token


def test_prefill_attention_is_causal_and_mixed_batch_adds_up():
    g = graph()
    n = 4096
    assert op_total(g, [(n, 0)], "attention", "flops") == 32 * (n * (n + 1) / 2) * (4 * 4096 + 5 * 32)
    # chunked prefill of 512 over 1000 cached, plus a decode at 2000: pairs add per sequence
    pairs = 512 * 1000 + 512 * 513 / 2 + (2000 + 1)
    assert batch_features([(512, 1000), (1, 2000)]).tolist() == [1, 513, 2, pairs, 1512 + 2001]
    mixed = op_total(g, [(512, 1000), (1, 2000)], "attention", "flops")
    parts = op_total(g, [(512, 1000)], "attention", "flops") + op_total(g, [(1, 2000)], "attention", "flops")
    assert mixed == parts


def test_lm_head_only_last_token_of_each_sequence():
    g = graph()
    # a 1000-token prefill produces logits for 1 token: lm_head M = 1 (sequences), not 1000
    assert op_total(g, [(1000, 0)], "lm_head", "flops") == 2 * 4096 * 128256
    assert op_total(g, [(1000, 0)], "qkv_proj", "flops") == 32 * 1000 * 2 * 4096 * 6144


def test_qwen2_qkv_bias():
    cfg = load_model_config("qwen2.5-7b")
    assert cfg.attention_bias
    g = OpGraph(cfg, 2)
    nqkv = cfg.q_dim + 2 * cfg.kv_dim
    assert op_total(g, [(1, 0)], "qkv_proj", "flops") == cfg.num_layers * (2 * nqkv * cfg.hidden_size + nqkv)
    assert op_total(g, [(1, 0)], "qkv_proj", "weight_read_bytes") == cfg.num_layers * (nqkv * cfg.hidden_size + nqkv) * 2


def test_kernel_counts():
    g = graph()
    # 12 kernels per layer (attention = cache write + attention), embed, final norm, lm_head, sample
    assert g.total_kernels() == 32 * 12 + 4
    assert g.total_cpu_dispatches() > g.total_kernels()  # eager PyTorch splits ops further


def test_decode_features_match_batch_features():
    f = decode_features([4, 1], [4 * 100, 7])
    assert f.tolist() == [batch_features([(1, 100)] * 4).tolist(), batch_features([(1, 7)]).tolist()]


def test_bad_batches():
    for bad, msg in (([], "empty batch"), ([(0, 5)], "num_new_tokens >= 1"), ([(1, -1)], "num_cached_tokens")):
        with pytest.raises(ConfigError, match=msg):
            batch_features(bad)


def test_vectorized_totals_shape():
    g = graph("smollm2-135m", 4)
    f = decode_features(np.arange(1, 65), np.arange(1, 65) * 300)
    assert g.totals(f, "bytes").shape == (64,)
    assert np.all(np.diff(g.totals(f, "bytes")) > 0)


VIEW_OPS = {"aten::slice", "aten::view", "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::select",
            "aten::detach_", "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::item", "aten::expand",
            "aten::reshape", "aten::as_strided", "aten::alias", "aten::t", "aten::permute", "aten::contiguous"}


def test_cpu_dispatch_count_tracks_the_engine_step_model():
    """CPU_DISPATCHES against the aten ops (views excluded) torch.profiler sees in one real engine
    step of the project's torch model (tiny-llama, decode batch 4)."""
    torch = pytest.importorskip("torch")
    tm = pytest.importorskip("predictor.torch_model")
    from torch.profiler import ProfilerActivity, profile

    cfg = load_model_config("tiny-llama")
    model = tm.TorchCausalLM(cfg)
    cache = tm.KVCache(cfg, capacity_tokens=4 * 128, dtype=torch.float32)
    cache.layout(4, 128)
    model.reserve(129)
    batch, cached = [[1], [2], [3], [4]], [100] * 4
    model.step_logits(batch, cached, cache)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.step_logits(batch, cached, cache)
    ops = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    real = sum(1 for name in ops if name not in VIEW_OPS)
    mine = OpGraph(cfg, 4).total_cpu_dispatches()
    assert mine == pytest.approx(real, rel=0.35), (mine, real)


DENSE_OPS = ["embed", "input_norm", "qkv_proj", "rope", "attention", "o_proj", "residual", "post_norm", "gate_up",
             "act_mul", "down", "residual2", "final_norm", "lm_head", "sample"]


def test_dense_graphs_keep_their_ops_and_new_families_only_insert():
    assert graph().names == DENSE_OPS
    assert graph("qwen3-8b").names == DENSE_OPS[:3] + ["qk_norm"] + DENSE_OPS[3:]
    assert graph("mixtral-8x7b").names == DENSE_OPS[:8] + ["router"] + DENSE_OPS[8:]
    assert graph("mixtral-8x7b").expert_index.tolist() == [9, 11]  # gate_up, down
    assert graph().expert_index.size == 0


def test_qwen3_qk_norm_and_projections_use_head_dim():
    cfg = load_model_config("qwen3-0.6b")  # 16 heads x 128 = 2048 wide q, 8 kv heads x 128 = 1024
    g = OpGraph(cfg, 2)
    t = 5
    assert op_total(g, [(t, 0)], "qkv_proj", "flops") == 28 * t * 2 * (2048 + 2 * 1024) * 1024  # no bias
    assert op_total(g, [(t, 0)], "o_proj", "flops") == 28 * t * 2 * 1024 * 2048
    assert op_total(g, [(t, 0)], "qk_norm", "flops") == 28 * t * 4 * (2048 + 1024)
    assert op_total(g, [(t, 0)], "qk_norm", "weight_read_bytes") == 28 * 2 * 128 * 2
    assert op_total(g, [(t, 0)], "qk_norm", "act_read_bytes") == 28 * t * (2048 + 1024) * 2
    assert op_total(g, [(t, 0)], "qk_norm", "act_write_bytes") == 28 * t * (2048 + 1024) * 2
    # attention: 4 * q FLOPs per (query, key) pair, q = heads x head_dim = 2048, not hidden (1024)
    assert op_total(g, [(1, 99)], "attention", "flops") == 28 * 100 * (4 * 2048 + 5 * 16)


def test_expected_active_experts():
    from predictor.ops import expected_active_experts

    assert expected_active_experts(8, 2, 1) == pytest.approx(2.0)  # one token: its top-k
    assert expected_active_experts(8, 2, 3) == pytest.approx(8 * (1 - 0.75 ** 3))  # 4.625
    assert expected_active_experts(8, 2, 200) == pytest.approx(8.0)  # saturated
    t = np.arange(1, 100)
    v = expected_active_experts(128, 8, t)
    assert np.all(v <= np.minimum(128, 8 * t) + 1e-9) and np.all(np.diff(v) > 0)


def mixtral_layer(g, t, attr):
    """Per-layer values (one call) of each MoE op for a decode batch of t sequences."""
    f = batch_features([(1, 50)] * t)[None, :]
    pc = g.per_call(f, attr)[0]
    return {n: float(pc[g.names.index(n)]) for n in ("router", "gate_up", "act_mul", "down")}


@pytest.mark.parametrize("t", [1, 3, 64])
def test_mixtral_moe_layer_flops_and_bytes_by_hand(t):
    g = graph("mixtral-8x7b")
    h, w, e, k, d = 4096, 14336, 8, 2, 2
    active = e * (1 - (1 - k / e) ** t)  # 2 at t = 1, 4.625 at 3, ~8 at 64
    flops = mixtral_layer(g, t, "flops")
    assert flops["router"] == t * 2 * h * e
    assert flops["gate_up"] == t * k * 2 * (2 * w) * h  # T * top_k rows through a [h, 2w] expert
    assert flops["act_mul"] == t * k * 5 * w
    assert flops["down"] == t * k * (2 * w * h + 2 * h)  # the GEMM, then the router-weighted sum
    wr = mixtral_layer(g, t, "weight_read_bytes")
    assert wr["router"] == e * h * d
    assert wr["gate_up"] == pytest.approx(active * 2 * w * h * d, rel=1e-12)
    assert wr["down"] == pytest.approx(active * w * h * d, rel=1e-12)
    read, written = mixtral_layer(g, t, "bytes_read"), mixtral_layer(g, t, "bytes_written")
    assert read["gate_up"] == pytest.approx(active * 2 * w * h * d + t * k * h * d, rel=1e-12)
    assert written["gate_up"] == t * k * 2 * w * d
    assert read["down"] == pytest.approx(active * w * h * d + t * k * w * d, rel=1e-12)
    assert written["down"] == t * h * d
    # the raw coefficient matrices hold the saturated read (all 8 experts)
    i = g.names.index("gate_up")
    assert g.weight_read_bytes[i, 0] == e * 2 * w * h * d


def test_mixtral_decode_step_reads_two_experts_per_layer_at_batch_1():
    cfg = load_model_config("mixtral-8x7b")
    g = OpGraph(cfg, 2)
    # every weight except 6 of 8 experts per layer and the embedding table (one row gathered)
    expect = (cfg.param_count() - 32 * 6 * cfg.expert_params() - 32000 * 4096 + 4096) * 2
    assert totals(g, [(1, 2048)], "weight_read_bytes") == pytest.approx(expect, rel=1e-12)
    assert expect / 1e9 == pytest.approx(25.498, abs=1e-3)
