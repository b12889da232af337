"""The op graph of one forward step (decode, prefill or mixed) of a Llama/Mistral/Qwen2/Qwen3 or
Mixtral/Qwen3-MoE model.

A batch is a list of sequences ``(num_new_tokens, num_cached_tokens)``. Every op's FLOPs and bytes
are *linear* in five batch features, so the graph is stored as coefficient matrices and a whole
array of batches is costed with one matrix product (the scheduler calls this a lot)::

    features = [1, T, S, A, C]
      T = sum(n_i)                      new tokens (rows of every projection GEMM)
      S = number of sequences           (rows of lm_head; sampled tokens)
      A = sum(n_i*c_i + n_i(n_i+1)/2)   query-key pairs of causal attention over cache + new tokens
      C = sum(c_i + n_i)                KV tokens each sequence's attention reads

Per layer (x num_layers):  input_norm, qkv_proj (+bias for qwen2), rope, attention (writes the new
K/V to the cache, reads the whole cache), o_proj, residual, post_norm, gate_up, act_mul, down,
residual2. Once per step: embed (a gather: reads only the T rows it uses), final_norm, lm_head (the
last token of each sequence only, so M = S; the full vocab x hidden matrix is read) and sample.

Qwen3 adds ``qk_norm`` (RMSNorm over each head of q and k) between qkv_proj and rope. A
mixture-of-experts layer adds ``router`` (a hidden -> num_experts GEMM) after post_norm, and its
gate_up / act_mul / down are the experts': each token goes through top_k experts, so their FLOPs
and activations are those of T * top_k rows, and a step reads the weights of each expert that at
least one token was routed to. Under uniform routing a batch of T tokens activates
E * (1 - (1 - k/E)^T) distinct experts in expectation (k at T = 1, E once T is large): not linear
in T, so the coefficient matrices hold the saturated read (every expert) and ``expert_read_fraction``
scales the expert ops' weight bytes to the expectation; ``OpGraph.per_call`` and ``OpGraph.totals``
apply it.

Weights are read once per step, whatever the batch. So a Llama-3.1-8B decode step reads the
16.06 GB of bf16 weights *minus* the 1.05 GB embedding table plus T rows of it: ~15.01 GB.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.model_config import ModelConfig

FEATURES = ("const", "T", "S", "A", "C")
_ONE, _T, _S, _A, _C = range(5)
KINDS = ("gemm", "attention", "elementwise", "embed", "sample")

# NOTE(predictor): eager PyTorch op dispatches per op of a standard HF Llama forward on the CPU
# backend (no fusion, no async queue, so each one costs host time before the op runs):
# RMSNorm = to(fp32), pow, mean, add+rsqrt, mul, mul(weight), to -> 7; q/k/v are three Linear
# calls; rope = (mul, 2 slices, neg, cat, mul, add) for q and for k -> 14; attention = cache
# update (2), reshapes/transposes (4), SDPA (1), output reshape (1) -> 8; SiLU*up = silu, mul.
CPU_DISPATCHES = {
    "embed": 1, "input_norm": 7, "qkv_proj": 3, "rope": 14, "attention": 8, "o_proj": 1,
    "residual": 1, "post_norm": 7, "gate_up": 2, "act_mul": 2, "down": 1, "residual2": 1,
    "final_norm": 7, "lm_head": 2, "sample": 1,
    # Qwen3: the q and k RMSNorms (7 each); MoE: router Linear, softmax, topk, renormalize.
    "qk_norm": 14, "router": 4,
}
# Fused GPU kernels per op (vLLM-style): attention = reshape_and_cache + the attention kernel.
GPU_KERNELS = {"attention": 2}


@dataclass(frozen=True)
class OpSpec:
    """One op of the graph. Coefficient tuples are over FEATURES, per call (one layer).

    ``gemm_nk`` is (N, K) of the op's GEMM and ``m_feature`` the feature that gives its M.
    """

    name: str
    kind: str
    per_layer: bool
    flops: tuple
    weight_read_bytes: tuple
    act_read_bytes: tuple
    act_write_bytes: tuple
    kv_read_bytes: tuple = (0, 0, 0, 0, 0)
    kv_write_bytes: tuple = (0, 0, 0, 0, 0)
    gemm_nk: tuple | None = None
    m_feature: int = _T
    num_kernels: int = 1
    num_cpu_dispatches: int = 1


def _vec(**coef) -> tuple:
    """Coefficient tuple from keyword features, e.g. _vec(T=4096, const=8192)."""
    out = [0.0] * 5
    for k, v in coef.items():
        out[FEATURES.index(k)] = float(v)
    return tuple(out)


def _gemm(name: str, n: int, k: int, d: int, *, bias: bool = False, m: str = "T") -> OpSpec:
    """A projection y[M,N] = x[M,K] @ W[K,N] (+ b): 2MNK FLOPs, weights once, x read, y written."""
    flops = {m: 2 * n * k + (n if bias else 0)}
    return OpSpec(
        name=name, kind="gemm", per_layer=name not in ("lm_head",),
        flops=_vec(**flops),
        weight_read_bytes=_vec(const=(n * k + (n if bias else 0)) * d),
        act_read_bytes=_vec(**{m: k * d}),
        act_write_bytes=_vec(**{m: n * d}),
        gemm_nk=(n, k), m_feature=FEATURES.index(m),
        num_kernels=GPU_KERNELS.get(name, 1), num_cpu_dispatches=CPU_DISPATCHES[name],
    )


def _norm(name: str, h: int, d: int, per_layer: bool) -> OpSpec:
    """RMSNorm over T rows: square, sum, rsqrt, scale, weight -> ~4 FLOPs per element."""
    return OpSpec(name=name, kind="elementwise", per_layer=per_layer, flops=_vec(T=4 * h),
                  weight_read_bytes=_vec(const=h * d), act_read_bytes=_vec(T=h * d),
                  act_write_bytes=_vec(T=h * d), num_cpu_dispatches=CPU_DISPATCHES[name])


def _residual(name: str, h: int, d: int) -> OpSpec:
    """x + f(x): reads two T x h tensors, writes one."""
    return OpSpec(name=name, kind="elementwise", per_layer=True, flops=_vec(T=h),
                  weight_read_bytes=_vec(), act_read_bytes=_vec(T=2 * h * d), act_write_bytes=_vec(T=h * d),
                  num_cpu_dispatches=CPU_DISPATCHES[name])


def expected_active_experts(num_experts: int, top_k: int, num_tokens):
    """Distinct experts a batch of ``num_tokens`` tokens is routed to, in expectation, when each token
    picks ``top_k`` of ``num_experts`` uniformly: E * (1 - (1 - k/E)^T). Arrays broadcast."""
    t = np.maximum(np.asarray(num_tokens, dtype=np.float64), 0.0)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** t)


def _moe_ops(cfg: ModelConfig, d: int) -> list[OpSpec]:
    """router, gate_up, act_mul, down of a mixture-of-experts layer (weights: every expert's).

    Each expert op's GEMM is costed as one of M = T rows and N = top_k x the expert's width (the
    FLOPs of T * top_k rows through one expert); tile quantization per expert is not modelled.
    """
    h, e, k, w = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size

    def expert(name, n, kk, flops, act_read, act_write):
        return OpSpec(name=name, kind="gemm", per_layer=True, flops=_vec(T=flops),
                      weight_read_bytes=_vec(const=e * n * kk * d), act_read_bytes=_vec(T=act_read * d),
                      act_write_bytes=_vec(T=act_write * d), gemm_nk=(k * n, kk), m_feature=_T,
                      num_kernels=GPU_KERNELS.get(name, 1), num_cpu_dispatches=CPU_DISPATCHES[name])

    return [
        _gemm("router", e, h, d),
        # every token's row goes to k experts: k rows of h in, k rows of 2w out
        expert("gate_up", 2 * w, h, k * 2 * 2 * w * h, k * h, k * 2 * w),
        OpSpec(name="act_mul", kind="elementwise", per_layer=True, flops=_vec(T=5 * k * w),
               weight_read_bytes=_vec(), act_read_bytes=_vec(T=2 * k * w * d), act_write_bytes=_vec(T=k * w * d),
               num_cpu_dispatches=CPU_DISPATCHES["act_mul"]),
        # k expert rows per token, their router-weighted sum (2 FLOPs per element) written as one row
        expert("down", h, w, k * (2 * h * w + 2 * h), k * w, h),
    ]


def layer_ops(cfg: ModelConfig, d: int) -> list[OpSpec]:
    """The ops of one decoder layer, in execution order."""
    h, q, kv, hd, inter = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.head_dim, cfg.intermediate_size
    # Qwen3: RMSNorm over each head of q and of k (4 FLOPs per element), one weight of head_dim each.
    qk_norm = [OpSpec(name="qk_norm", kind="elementwise", per_layer=True, flops=_vec(T=4 * (q + kv)),
                      weight_read_bytes=_vec(const=2 * hd * d), act_read_bytes=_vec(T=(q + kv) * d),
                      act_write_bytes=_vec(T=(q + kv) * d), num_cpu_dispatches=CPU_DISPATCHES["qk_norm"])
               ] if cfg.qk_norm else []
    if cfg.is_moe:
        mlp = _moe_ops(cfg, d)
    else:
        mlp = [
            _gemm("gate_up", 2 * inter, h, d),
            # SiLU(gate) * up: ~4 FLOPs for silu and 1 for the product per element; reads 2, writes 1.
            OpSpec(name="act_mul", kind="elementwise", per_layer=True, flops=_vec(T=5 * inter),
                   weight_read_bytes=_vec(), act_read_bytes=_vec(T=2 * inter * d), act_write_bytes=_vec(T=inter * d),
                   num_cpu_dispatches=CPU_DISPATCHES["act_mul"]),
            _gemm("down", h, inter, d),
        ]
    return [
        _norm("input_norm", h, d, True),
        _gemm("qkv_proj", q + 2 * kv, h, d, bias=cfg.attention_bias),
        *qk_norm,
        # rope: rotate q and k (x*cos + rotate_half(x)*sin: 3 FLOPs/element), reads the cos/sin rows.
        OpSpec(name="rope", kind="elementwise", per_layer=True, flops=_vec(T=3 * (q + kv)),
               weight_read_bytes=_vec(), act_read_bytes=_vec(T=(q + kv + hd) * d),
               act_write_bytes=_vec(T=(q + kv) * d), num_cpu_dispatches=CPU_DISPATCHES["rope"]),
        # attention: QK^T and PV are 2*q FLOPs per (query, key) pair each, softmax ~5 per pair and head.
        OpSpec(name="attention", kind="attention", per_layer=True,
               flops=_vec(A=4 * q + 5 * cfg.num_heads),
               weight_read_bytes=_vec(), act_read_bytes=_vec(T=q * d), act_write_bytes=_vec(T=q * d),
               kv_read_bytes=_vec(C=2 * kv * d), kv_write_bytes=_vec(T=2 * kv * d),
               num_kernels=GPU_KERNELS["attention"], num_cpu_dispatches=CPU_DISPATCHES["attention"]),
        _gemm("o_proj", h, q, d),
        _residual("residual", h, d),
        _norm("post_norm", h, d, True),
        *mlp,
        _residual("residual2", h, d),
    ]


def step_ops(cfg: ModelConfig, d: int) -> list[OpSpec]:
    """Every op of a forward step: embed, the layer ops (x num_layers), final norm, lm_head, sample."""
    h, vocab = cfg.hidden_size, cfg.vocab_size
    embed = OpSpec(name="embed", kind="embed", per_layer=False, flops=_vec(),
                   weight_read_bytes=_vec(T=h * d),  # a gather: only the rows of the T tokens
                   act_read_bytes=_vec(T=8), act_write_bytes=_vec(T=h * d),
                   num_cpu_dispatches=CPU_DISPATCHES["embed"])
    lm_head = _gemm("lm_head", vocab, h, d, m="S")  # tied or not, the whole matrix is read
    # greedy sampling: one compare per logit; reads the logits, writes one token id per sequence.
    sample = OpSpec(name="sample", kind="sample", per_layer=False, flops=_vec(S=vocab),
                    weight_read_bytes=_vec(), act_read_bytes=_vec(S=vocab * d), act_write_bytes=_vec(S=8),
                    num_cpu_dispatches=CPU_DISPATCHES["sample"])
    return [embed, *layer_ops(cfg, d), _norm("final_norm", h, d, False), lm_head, sample]


class OpGraph:
    """Coefficient matrices of a model's step ops; ``evaluate`` costs many batches at once.

    Attributes are numpy arrays over ops (length num_ops) or (num_ops, 5) matrices over FEATURES.
    """

    def __init__(self, cfg: ModelConfig, dtype_bytes: int):
        self.model = cfg
        self.dtype_bytes = dtype_bytes
        self.ops = step_ops(cfg, dtype_bytes)
        self.names = [o.name for o in self.ops]
        self.kinds = np.array([o.kind for o in self.ops])
        mat = lambda attr: np.array([getattr(o, attr) for o in self.ops], dtype=np.float64)  # noqa: E731
        self.flops = mat("flops")
        self.weight_read_bytes = mat("weight_read_bytes")
        self.act_read_bytes = mat("act_read_bytes")
        self.act_write_bytes = mat("act_write_bytes")
        self.kv_read_bytes = mat("kv_read_bytes")
        self.kv_write_bytes = mat("kv_write_bytes")
        self.bytes_read = self.weight_read_bytes + self.act_read_bytes + self.kv_read_bytes
        self.bytes_written = self.act_write_bytes + self.kv_write_bytes
        self.bytes = self.bytes_read + self.bytes_written
        self.num_calls = np.array([cfg.num_layers if o.per_layer else 1 for o in self.ops], dtype=np.float64)
        self.num_kernels = np.array([o.num_kernels for o in self.ops], dtype=np.float64)
        self.num_cpu_dispatches = np.array([o.num_cpu_dispatches for o in self.ops], dtype=np.float64)
        self.gemm_index = np.array([i for i, o in enumerate(self.ops) if o.gemm_nk is not None])
        self.gemm_n = np.array([self.ops[i].gemm_nk[0] for i in self.gemm_index], dtype=np.float64)
        self.gemm_k = np.array([self.ops[i].gemm_nk[1] for i in self.gemm_index], dtype=np.float64)
        self.gemm_m_feature = np.array([self.ops[i].m_feature for i in self.gemm_index])
        self.sample_index = self.names.index("sample")
        # MoE: the expert ops and their saturated (every expert) weight bytes per call
        self.expert_index = np.array([self.names.index(n) for n in ("gate_up", "down")] if cfg.is_moe else [],
                                     dtype=np.intp)
        self.expert_weight_bytes = self.weight_read_bytes[self.expert_index, _ONE].copy()

    def expert_read_fraction(self, num_tokens):
        """Share of the experts' weights a step of ``num_tokens`` tokens reads: expected distinct
        experts / num_experts (1.0 for a dense model). Arrays broadcast."""
        if not self.model.is_moe:
            return np.ones_like(np.asarray(num_tokens, dtype=np.float64))
        cfg = self.model
        return expected_active_experts(cfg.num_experts, cfg.num_experts_per_tok, num_tokens) / cfg.num_experts

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def total_kernels(self) -> int:
        """Kernels one step launches on a GPU (eager): sum over ops of calls x kernels."""
        return int(np.dot(self.num_calls, self.num_kernels))

    def total_cpu_dispatches(self) -> int:
        """Framework op dispatches one step pays on the CPU backend."""
        return int(np.dot(self.num_calls, self.num_cpu_dispatches))

    def per_call(self, features: np.ndarray, attr: str) -> np.ndarray:
        """(P, num_ops) values of ``attr`` (flops, bytes, ...) per call, for (P, 5) features; on an
        MoE model the expert ops' weight bytes are the expected distinct experts' (module docstring)."""
        features = np.atleast_2d(np.asarray(features, dtype=np.float64))
        out = features @ getattr(self, attr).T
        if self.expert_index.size and attr in ("weight_read_bytes", "bytes_read", "bytes"):
            unread = 1.0 - self.expert_read_fraction(features[:, _T])
            out[:, self.expert_index] -= unread[:, None] * self.expert_weight_bytes[None, :]
        return out

    def totals(self, features: np.ndarray, attr: str) -> np.ndarray:
        """(P,) step totals of ``attr`` over every op and layer (as ``per_call``)."""
        return self.per_call(features, attr) @ self.num_calls


def batch_features(batch) -> np.ndarray:
    """The (5,) feature vector of one batch: a list of (num_new_tokens, num_cached_tokens).

    Raises ConfigError for an empty batch, a sequence with no new token, or a negative context.
    """
    from common.errors import ConfigError

    arr = np.asarray(batch, dtype=np.float64).reshape(-1, 2) if len(batch) else np.zeros((0, 2))
    if arr.shape[0] == 0:
        raise ConfigError("empty batch: give at least one (num_new_tokens, num_cached_tokens) sequence")
    n, c = arr[:, 0], arr[:, 1]
    if (n < 1).any():
        raise ConfigError(f"every sequence needs num_new_tokens >= 1 (got {int(n.min())})")
    if (c < 0).any():
        raise ConfigError(f"num_cached_tokens must be >= 0 (got {int(c.min())})")
    return np.array([1.0, n.sum(), float(len(n)), (n * c + n * (n + 1) / 2).sum(), (c + n).sum()])


def decode_features(batch_sizes, context_sums) -> np.ndarray:
    """(P, 5) features of P decode steps: B sequences, one new token each, sum of cached tokens.

    For decode T = S = B, A = C = context_sum + B (each query also attends to its own new key).
    """
    b = np.asarray(batch_sizes, dtype=np.float64).reshape(-1)
    ctx = np.broadcast_to(np.asarray(context_sums, dtype=np.float64).reshape(-1), b.shape)
    out = np.empty((b.size, 5))
    out[:, _ONE] = 1.0
    out[:, _T] = b
    out[:, _S] = b
    out[:, _A] = ctx + b
    out[:, _C] = ctx + b
    return out


def batch_sums(batch) -> tuple:
    """One pass over a batch: its features ``(1, T, S, A, C)`` as floats, the same (T, S, A, C) sums
    over its decode sequences (one new token), and the longest decode sequence's KV tokens.
    Raises the ConfigError ``batch_features`` names for an empty or malformed batch."""
    num_new = num_seqs = pairs = kv_tokens = 0
    num_decodes = decode_kv = longest_decode = 0
    for n, c in batch:
        if n < 1 or c < 0:
            batch_features(batch)  # raises the ConfigError that names the problem
        num_new += n
        num_seqs += 1
        pairs += n * c + n * (n + 1) // 2
        kv_tokens += c + n
        if n == 1:
            num_decodes += 1
            decode_kv += c + 1
            longest_decode = max(longest_decode, c + 1)
    if num_seqs == 0:
        batch_features(batch)
    features = (1.0, float(num_new), float(num_seqs), float(pairs), float(kv_tokens))
    decode = (float(num_decodes), float(num_decodes), float(decode_kv), float(decode_kv))
    return features, decode, float(longest_decode)
