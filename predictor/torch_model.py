"""A compact Llama/Mistral/Qwen2 forward in torch, laid out like a serving engine's step.

Why not ``transformers``: its ``forward``/``generate`` pads the batch and allocates a growing
cache, so a timed call measures allocation and padding, not an engine step. This module runs one
step over a *flattened* batch (vLLM's varlen layout) against a *preallocated* KV cache:

    tokens   | s0: 1 new | s1: 1 new | s2: n2 new (chunked prefill) | s3: n3 new |
             '---- decode group -----''-------------- prefill seqs --------------'
    KV cache per layer: one flat buffer viewed as [num_seqs, kv_heads, max_len, head_dim];
    sequence i's new K/V are written at positions c_i .. c_i+n_i-1 of row i.

Decode sequences (1 new token, some context) are placed first and share one batched
``scaled_dot_product_attention`` call (a key-padding mask when their lengths differ); each prefill
sequence gets its own call, causal over its new tokens plus its cached context. Linear layers run
once over all tokens. Weights use HuggingFace parameter names, so a ``LlamaForCausalLM``
``state_dict`` loads as is; ``tests/predictor/test_profile_torch_model.py`` checks logits against
transformers on the same weights.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.errors import ConfigError
from common.model_config import ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (float32, [head_dim/2]) with the config's scaling applied.

    Supports no scaling, "default", "linear" and "llama3" (Llama 3.1/3.2). Other types change
    attention itself (yarn, longrope, dynamic) and are refused rather than silently ignored.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(rs["factor"])
    if kind == "llama3":
        factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ConfigError(f"{cfg.name}: rope_scaling type '{kind}' is not supported by the step profiler "
                      f"(supported: default, linear, llama3)")


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names (as in transformers' LlamaForCausalLM/Qwen2ForCausalLM) and shapes."""
    h, q, kv, ff = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


@dataclass(frozen=True)
class StepInputs:
    """Tensors of one step, built from Python lists by :meth:`TorchCausalLM.prepare` (timed).

    ``order`` maps internal sequence index -> caller's index (decodes are moved first). A
    sequence's KV cache row is its caller index, stable across steps; the decode group reads its
    rows as one view when they are contiguous (the profiler puts decodes first), else gathers them.
    """
    token_ids: torch.Tensor          # [T] int64, flattened new tokens
    positions: torch.Tensor          # [T] int64
    seq_rows: torch.Tensor           # [T] int64, cache row of each token
    last_token_idx: torch.Tensor     # [num_seqs] int64, index into the T tokens
    num_decode: int                  # decodes occupy tokens [0, num_decode)
    decode_rows: slice | torch.Tensor  # their cache rows: a slice when contiguous, else an index
    decode_len: int                  # max context+1 over the decode group
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, decode_len] bool, None if all equal
    prefill: tuple                   # per prefill seq: (row, tok_start, tok_end, kv_len, mask|None)
    order: tuple[int, ...]


def random_kv_buffers(num_layers: int, numel: int, *, dtype: torch.dtype, device, seed: int
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V buffers of ``numel`` elements per layer, filled with random values (never zeros, so
    attention reads real numbers). One random block is copied everywhere: filling GBs from the RNG
    would take minutes on a CPU. Shared by the eager engine's cache and the graph engine's."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    block = torch.randn(min(numel, 1 << 20), generator=gen).to(device=device, dtype=dtype)
    k = [torch.empty(numel, dtype=dtype, device=device) for _ in range(num_layers)]
    v = [torch.empty(numel, dtype=dtype, device=device) for _ in range(num_layers)]
    for buf in k + v:
        for start in range(0, numel, block.numel()):
            n = min(block.numel(), numel - start)
            buf[start:start + n].copy_(block[:n])
    return k, v


class KVCache:
    """Preallocated K/V per layer, allocated and filled once so that steps never time allocation.

    One flat buffer per layer holds ``capacity_tokens`` tokens; :meth:`layout` views it as
    ``[num_seqs, kv_heads, max_len, head_dim]``. Cached context is random (never zeros), so the
    attention reads real values.
    """

    def __init__(self, cfg: ModelConfig, *, capacity_tokens: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", seed: int = 0):
        self.cfg = cfg
        self.capacity_tokens = int(capacity_tokens)
        numel = self.capacity_tokens * cfg.kv_dim
        self.k, self.v = random_kv_buffers(cfg.num_layers, numel, dtype=dtype, device=device, seed=seed)
        self.num_seqs = 0
        self.max_len = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def layout(self, num_seqs: int, max_len: int) -> None:
        """Use the buffers as ``num_seqs`` rows of ``max_len`` positions (no copy, no allocation)."""
        if num_seqs * max_len > self.capacity_tokens:
            raise ConfigError(f"KV cache holds {self.capacity_tokens} tokens; a step needs "
                              f"{num_seqs} x {max_len} = {num_seqs * max_len}")
        self.num_seqs, self.max_len = num_seqs, max_len

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_seqs, self.cfg.num_kv_heads, self.max_len, self.cfg.head_dim)
        n = self.num_seqs * self.max_len * self.cfg.kv_dim
        return self.k[layer][:n].view(shape), self.v[layer][:n].view(shape)


class TorchCausalLM:
    """Llama-family decoder with random (or loaded) weights, run one engine step at a time."""

    def __init__(self, cfg: ModelConfig, *, dtype: str = "fp32", device: str = "cpu", seed: int = 0,
                 init_std: float = 0.02):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype '{dtype}' not supported (use {', '.join(DTYPES)})")
        if cfg.is_moe or cfg.qk_norm:
            raise ConfigError(f"{cfg.name}: the step profiler's torch model is Llama/Mistral/Qwen2 only "
                              f"({cfg.model_type} has {'routed experts' if cfg.is_moe else 'q/k norms'})")
        self.cfg, self.dtype_name, self.dtype = cfg, dtype, DTYPES[dtype]
        self.device = torch.device(device)
        # Drawn on the model's device: an 8B model's 8e9 normal draws take over a minute on one CPU
        # thread and well under a second on a GPU (the CPU stream, and so CPU weights, are unchanged).
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.params: dict[str, torch.Tensor] = {}
        for name, shape in hf_param_shapes(cfg).items():
            t = torch.randn(shape, generator=gen, device=self.device)
            t = 1.0 + 0.1 * t if name.endswith("norm.weight") else init_std * t
            self.params[name] = t.to(dtype=self.dtype)
        inv_freq = rope_inv_freq(cfg)
        self._inv_freq = inv_freq
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._rope_len = 0

    # ----------------------------------------------------------------- weights
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy weights from a transformers state_dict (same names); missing names raise."""
        for name in self.params:
            if name not in state:
                raise ConfigError(f"state_dict lacks '{name}'")
            self.params[name] = state[name].detach().to(device=self.device, dtype=self.dtype).clone()

    def lm_head(self) -> torch.Tensor:
        return self.params["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]

    def _rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_pos, head_dim], grown on demand (call :meth:`reserve` before timing)."""
        if max_pos > self._rope_len:
            n = max(max_pos, 2 * self._rope_len)
            freqs = torch.outer(torch.arange(n, dtype=torch.float32), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = emb.cos().to(device=self.device, dtype=self.dtype)
            self._sin = emb.sin().to(device=self.device, dtype=self.dtype)
            self._rope_len = n
        assert self._cos is not None and self._sin is not None  # positions start at 0, so max_pos >= 1 built them
        return self._cos, self._sin

    def reserve(self, max_pos: int) -> None:
        """Build RoPE tables up to ``max_pos`` now, outside any timed region."""
        self._rope_tables(max_pos)

    # ----------------------------------------------------------------- step
    def prepare(self, token_ids: list[list[int]], num_cached: list[int]) -> StepInputs:
        """Flatten a batch into step tensors; decodes go first (vLLM orders them the same way).

        Args:
            token_ids: per sequence, the ids of its new tokens (>= 1 each).
            num_cached: per sequence, tokens already in its KV cache row.
        """
        n_seq = len(token_ids)
        is_dec = [len(t) == 1 and c > 0 for t, c in zip(token_ids, num_cached)]
        order = tuple([i for i in range(n_seq) if is_dec[i]] + [i for i in range(n_seq) if not is_dec[i]])
        num_decode = sum(is_dec)
        flat: list[int] = []
        pos: list[int] = []
        rows, last, prefill = [], [], []
        for k, i in enumerate(order):
            toks, c, row = token_ids[i], num_cached[i], i
            start = len(flat)
            flat.extend(toks)
            pos.extend(range(c, c + len(toks)))
            rows.extend([row] * len(toks))
            last.append(len(flat) - 1)
            if k >= num_decode:
                kv_len = c + len(toks)
                mask = None
                if c > 0:  # causal over new tokens, full view of the cached prefix
                    q_pos = torch.arange(c, kv_len, device=self.device)[:, None]
                    mask = torch.arange(kv_len, device=self.device)[None, :] <= q_pos
                prefill.append((row, start, len(flat), kv_len, mask))
        dec_lens = [num_cached[i] + 1 for i in order[:num_decode]]
        decode_len = max(dec_lens, default=0)
        decode_mask = None
        if num_decode and min(dec_lens) != decode_len:
            lens = torch.tensor(dec_lens, device=self.device)
            decode_mask = (torch.arange(decode_len, device=self.device)[None, :] < lens[:, None])[:, None, None, :]
        as_t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        dec = list(order[:num_decode])
        contiguous = dec == list(range(dec[0], dec[0] + num_decode)) if dec else True
        decode_rows = slice(dec[0] if dec else 0, (dec[0] if dec else 0) + num_decode) if contiguous else as_t(dec)
        return StepInputs(as_t(flat), as_t(pos), as_t(rows), as_t(last), num_decode, decode_rows, decode_len,
                          decode_mask, tuple(prefill), order)

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # Same arithmetic as transformers' LlamaRMSNorm: variance in fp32, back to dtype, times w.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def _attention(self, layer: int, q: torch.Tensor, inp: StepInputs, cache: KVCache) -> torch.Tensor:
        """q [T, heads, d] -> attention output [T, heads*d]; K/V already written to the cache."""
        cfg = self.cfg
        kc, vc = cache.rows(layer)
        out = torch.empty(q.shape[0], cfg.num_heads, cfg.head_dim, dtype=q.dtype, device=q.device)
        nd = inp.num_decode
        if nd:
            qd = q[:nd].unsqueeze(2)  # [nd, heads, 1, d]
            L = inp.decode_len
            r = inp.decode_rows
            o = F.scaled_dot_product_attention(qd, kc[r, :, :L], vc[r, :, :L], attn_mask=inp.decode_mask,
                                               enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for row, t0, t1, kv_len, mask in inp.prefill:
            qi = q[t0:t1].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
            o = F.scaled_dot_product_attention(qi, kc[row:row + 1, :, :kv_len], vc[row:row + 1, :, :kv_len],
                                               attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out[t0:t1] = o[0].transpose(0, 1)
        return out.view(q.shape[0], -1)

    @torch.inference_mode()
    def forward(self, inp: StepInputs, cache: KVCache) -> torch.Tensor:
        """Hidden states of each sequence's last token after the final norm, [num_seqs, hidden]."""
        cfg, P = self.cfg, self.params
        cos_t, sin_t = self._rope_tables(int(inp.positions.max()) + 1)
        cos, sin = cos_t[inp.positions].unsqueeze(1), sin_t[inp.positions].unsqueeze(1)
        x = P["model.embed_tokens.weight"][inp.token_ids]
        T = x.shape[0]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = self._rms(x, P[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = F.linear(h, P[p + "self_attn.q_proj.weight"], P.get(p + "self_attn.q_proj.bias"))
            k = F.linear(h, P[p + "self_attn.k_proj.weight"], P.get(p + "self_attn.k_proj.bias"))
            v = F.linear(h, P[p + "self_attn.v_proj.weight"], P.get(p + "self_attn.v_proj.bias"))
            q = self._rotate(q.view(T, cfg.num_heads, cfg.head_dim), cos, sin)
            k = self._rotate(k.view(T, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            kc, vc = cache.rows(i)
            kc[inp.seq_rows, :, inp.positions] = k
            vc[inp.seq_rows, :, inp.positions] = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            a = self._attention(i, q, inp, cache)
            x = x + F.linear(a, P[p + "self_attn.o_proj.weight"])
            h = self._rms(x, P[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            g = F.linear(h, P[p + "mlp.gate_proj.weight"])
            u = F.linear(h, P[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(g) * u, P[p + "mlp.down_proj.weight"])
        return self._rms(x[inp.last_token_idx], P["model.norm.weight"], cfg.rms_norm_eps)

    @torch.inference_mode()
    def step_logits(self, token_ids: list[list[int]], num_cached: list[int], cache: KVCache) -> torch.Tensor:
        """Logits of each sequence's last new token, in the caller's order (for checks, untimed)."""
        inp = self.prepare(token_ids, num_cached)
        out = self.logits(self.forward(inp, cache))
        res = torch.empty_like(out)
        res[torch.tensor(inp.order, device=out.device)] = out
        return res

    @torch.inference_mode()
    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(last_hidden, self.lm_head())

    @torch.inference_mode()
    def sample(self, last_hidden: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        """Greedy next token per sequence, in the caller's sequence order."""
        nxt = torch.argmax(self.logits(last_hidden), dim=-1)
        inv = torch.empty(len(order), dtype=torch.int64, device=nxt.device)
        inv[torch.tensor(order, device=nxt.device)] = torch.arange(len(order), device=nxt.device)
        return nxt[inv]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (a no-op on the CPU, where every op is blocking)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
