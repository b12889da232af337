"""The torch engine laid out as a serving engine runs a step: static buffers, fused kernels, CUDA graphs.

predictor.torch_model is the eager loop: it builds fresh tensors and masks each step, syncs the host
on ``positions.max()``, writes K/V with an advanced-index assignment and launches 7 projection GEMMs
and ~20 elementwise kernels per layer, so a GPU step there is host-bound (an 8B decode at batch 1
took 21-45 ms of wall time for 6.3 ms of kernels). This engine runs the same weights the way vLLM's
GPU model runner does:

- **Static inputs.** Token ids, positions, flat KV slots, sequence lengths, query starts, block
  tables and the rows to sample live in buffers allocated once; a step copies its host-built inputs
  into them with one copy per buffer and never reads a device value back until its sampled tokens.
- **Token-major paged KV** (vLLM's flash layout): per layer ``[num_blocks, block_size, kv_heads,
  head_dim]``; token t's K/V go to flat slot ``slot_mapping[t]`` with one scatter (``index_copy_``
  or the Triton write). Sequence i (the caller's index, stable over steps) owns blocks
  ``[i * blocks_per_seq, (i + 1) * blocks_per_seq)``; :meth:`GraphCausalLM.layout` sets how many
  blocks a sequence gets (the profiler re-lays the cache per grid point, untimed).
- **Fused projections and kernels:** one qkv and one gate_up GEMM per layer (4 GEMMs, as vLLM), and
  predictor.fused_kernels for add+RMSNorm, RoPE, SiLU-and-mul and the cache write.
- **Attention:** ``flash-varlen`` (torch's varlen flash with a block table and per-sequence lengths:
  one call for a mixed batch, causal aligned to each sequence's end) where the installed torch has
  it and it agrees with SDPA on a self-check at start; otherwise ``sdpa``: decodes as one batched
  call over their contiguous rows (a length mask built on the device from the lengths buffer only
  when lengths differ), each prefill chunk its own call, causal to the lower right of its cached
  prefix.
- **CUDA graphs** for decode-only steps: each decode shape (batch, longest context) is captured once,
  on first use, and replayed; sampling (final norm, lm_head on the sampled rows, argmax) is inside
  the graph. Mixed and prefill steps run eagerly with the same code. On the CPU nothing is captured
  and the step runs eagerly: that is how the equality test checks it here.

Timing (predictor.profile): the device step is CUDA events around the replay, the host step wall
clock around input copy + replay + the sampled tokens' copy back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import ConfigError
from predictor.fused_kernels import Kernels, choose
from predictor.graph_attention import AttentionBackend, choose_attention
from predictor.graph_inputs import StaticInputs, StepShape
from predictor.torch_model import TorchCausalLM, random_kv_buffers


class PagedKVCache:
    """Token-major K/V in blocks, one pair of buffers per layer, filled once with random values."""

    def __init__(self, cfg, *, num_blocks: int, block_size: int, dtype: torch.dtype, device, seed: int = 0):
        self.cfg, self.num_blocks, self.block_size = cfg, int(num_blocks), int(block_size)
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        k, v = random_kv_buffers(cfg.num_layers, math.prod(shape), dtype=dtype, device=device, seed=seed)
        self.k, self.v = [t.view(shape) for t in k], [t.view(shape) for t in v]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[slots, kv_heads, head_dim] views of a layer's K and V."""
        return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights as the engine runs them: q/k/v and gate/up fused into one matrix each."""
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    in_norm: torch.Tensor
    post_norm: torch.Tensor


class GraphCausalLM:
    """The engine (see the module docstring). Built from an eager model: the same weights, fused."""

    def __init__(self, eager: TorchCausalLM, cache: PagedKVCache, *, max_tokens: int, max_seqs: int,
                 max_positions: int | None = None, kernels: str = "auto", attention: str = "auto",
                 cuda_graphs: bool = True, free_unfused: bool = False):
        """Buffers for steps of up to ``max_tokens`` tokens over ``max_seqs`` sequences, RoPE tables
        for ``max_positions`` (default: what the cache holds per sequence when split ``max_seqs``
        ways, which is also the first layout). ``free_unfused``: drop the q/k/v and gate/up tensors the
        fused ones copy from ``eager``'s parameters (an 8B model's fused copies are ~10 GB more; the
        eager model cannot run after that)."""
        cfg, P = eager.cfg, eager.params
        if cache.num_slots < max_seqs * cache.block_size:
            raise ConfigError(f"KV cache of {cache.num_slots} slots cannot give {max_seqs} sequences a block each")
        self.cfg, self.cache, self.device, self.dtype = cfg, cache, eager.device, eager.dtype
        self.blocks_per_seq = cache.num_blocks // max_seqs
        self.kernels: Kernels = choose(kernels, self.device)
        self.attention: AttentionBackend = choose_attention(attention, self.device, self.dtype)
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            biases = [P[p + f"self_attn.{n}_proj.bias"] for n in "qkv"] if cfg.attention_bias else None
            self.layers.append(LayerWeights(
                qkv=torch.cat([P[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                qkv_bias=torch.cat(biases) if biases else None, o=P[p + "self_attn.o_proj.weight"],
                gate_up=torch.cat([P[p + "mlp.gate_proj.weight"], P[p + "mlp.up_proj.weight"]]),
                down=P[p + "mlp.down_proj.weight"], in_norm=P[p + "input_layernorm.weight"],
                post_norm=P[p + "post_attention_layernorm.weight"]))
        if free_unfused:
            for i in range(cfg.num_layers):
                for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                    for kind in ("weight", "bias"):
                        P.pop(f"model.layers.{i}.{name}.{kind}", None)
        self.embed, self.final_norm, self.lm_head = P["model.embed_tokens.weight"], P["model.norm.weight"], eager.lm_head()
        inv = eager._inv_freq
        self.max_positions = max_positions or self.blocks_per_seq * cache.block_size
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv)
        self.cos = freqs.cos().to(device=self.device, dtype=self.dtype)
        self.sin = freqs.sin().to(device=self.device, dtype=self.dtype)
        self.inputs = StaticInputs(max_tokens=max_tokens, max_seqs=max_seqs, blocks_per_seq=self.blocks_per_seq,
                                   device=self.device)
        self.next_tokens = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)
        self._graphs: dict[StepShape, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the graphs' shared memory pool, once the first is captured

    # ----------------------------------------------------------------- inputs
    def layout(self, num_seqs: int, max_len: int) -> None:
        """Give each of ``num_seqs`` sequences the blocks for ``max_len`` positions (no KV copy; the
        block table is reallocated and captured graphs dropped when the split changes)."""
        bps = -(-max_len // self.cache.block_size)
        if max_len > self.max_positions or num_seqs * bps > self.cache.num_blocks or num_seqs > self.inputs.max_seqs:
            raise ConfigError(f"{num_seqs} sequences of {max_len} positions do not fit the engine ({self.cache.num_blocks} "
                              f"blocks of {self.cache.block_size}, {self.inputs.max_seqs} sequences, "
                              f"{self.max_positions} positions)")
        if bps != self.blocks_per_seq:
            self.blocks_per_seq = bps
            self.inputs.block_table = torch.zeros(self.inputs.max_seqs, bps, dtype=torch.int32, device=self.device)
            self._graphs.clear()

    def prepare(self, token_ids: list[list[int]], num_cached: list[int]) -> tuple[StepShape, tuple[int, ...]]:
        """Copy a step's inputs into the static buffers; (its shape, internal -> caller order).

        Decodes (one new token after some context) go first, as vLLM orders them."""
        n_seq = len(token_ids)
        if n_seq > self.inputs.max_seqs:
            raise ConfigError(f"a step of {n_seq} sequences; the engine was sized for {self.inputs.max_seqs}")
        is_dec = [len(t) == 1 and c > 0 for t, c in zip(token_ids, num_cached)]
        order = tuple([i for i in range(n_seq) if is_dec[i]] + [i for i in range(n_seq) if not is_dec[i]])
        num_decode = sum(is_dec)
        span = self.blocks_per_seq * self.cache.block_size
        if n_seq * self.blocks_per_seq > self.cache.num_blocks:
            raise ConfigError(f"{n_seq} sequences of {self.blocks_per_seq} blocks each; the cache has "
                              f"{self.cache.num_blocks} (call layout first)")
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        last: list[int] = []
        starts, prefill = [0], []
        for k, i in enumerate(order):
            toks, c = token_ids[i], num_cached[i]
            if c + len(toks) > min(span, self.max_positions):
                raise ConfigError(f"sequence {i} needs {c + len(toks)} positions; the engine holds "
                                  f"{min(span, self.max_positions)} per sequence")
            t0 = len(ids)
            ids.extend(toks)
            pos.extend(range(c, c + len(toks)))
            slots.extend(range(i * span + c, i * span + c + len(toks)))
            lens.append(c + len(toks))
            starts.append(len(ids))
            last.append(len(ids) - 1)
            if k >= num_decode:
                prefill.append((i, t0, len(ids), c + len(toks)))
        T = len(ids)
        if T > self.inputs.max_tokens:
            raise ConfigError(f"a step of {T} tokens; the engine was sized for {self.inputs.max_tokens}")
        dec = list(order[:num_decode])
        contiguous = bool(dec) and dec == list(range(dec[0], dec[0] + num_decode))
        shape = StepShape(T, n_seq, num_decode, max(len(t) for t in token_ids), max(lens),
                          len(set(lens[:num_decode])) <= 1, dec[0] if contiguous else -1, tuple(prefill),
                          decode_max_kv=max(lens[:num_decode], default=0))
        blocks = np.array(order, dtype=np.int64)[:, None] * self.blocks_per_seq + np.arange(self.blocks_per_seq)
        inp = self.inputs
        for buf, host in ((inp.input_ids, ids), (inp.positions, pos), (inp.slot_mapping, slots), (inp.seq_lens, lens),
                          (inp.query_start, starts), (inp.last_token_idx, last)):
            buf[:len(host)].copy_(torch.tensor(host, dtype=buf.dtype), non_blocking=True)
        inp.block_table[:n_seq].copy_(torch.from_numpy(blocks.astype(np.int32)), non_blocking=True)
        return shape, order

    # ----------------------------------------------------------------- the step
    def run(self, shape: StepShape) -> torch.Tensor:
        """Forward and greedy sampling of a prepared step; the next token per internal sequence, on the
        device (a view of a static buffer: read it before the next step). A decode shape on a GPU is
        captured on first use and replayed after."""
        if not (self.use_graphs and shape.decode_only):
            self._forward(shape)
        else:
            graph = self._graphs.get(shape)
            if graph is None:
                graph = self._graphs[shape] = self._capture(shape)
            graph.replay()
        return self.next_tokens[:shape.num_seqs]

    def step(self, token_ids: list[list[int]], num_cached: list[int]) -> list[int]:
        """One step end to end: the next token of each sequence, in the caller's order."""
        shape, order = self.prepare(token_ids, num_cached)
        nxt = self.run(shape).tolist()
        out = [0] * len(order)
        for k, i in enumerate(order):
            out[i] = nxt[k]
        return out

    @torch.inference_mode()
    def step_logits(self, token_ids: list[list[int]], num_cached: list[int]) -> torch.Tensor:
        """Logits of each sequence's last new token, in the caller's order (eager; for checks)."""
        shape, order = self.prepare(token_ids, num_cached)
        logits = self._forward(shape, return_logits=True)
        res = torch.empty_like(logits)
        res[torch.tensor(order, device=logits.device)] = logits
        return res

    def _capture(self, shape: StepShape) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream first (kernel selection, Triton compiles, lazy inits), as
        # torch's own make_graphed_callables does, then capture into one pool shared by all shapes.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(shape)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(shape)
        self._pool = graph.pool()
        return graph

    @torch.inference_mode()
    def _forward(self, shape: StepShape, *, return_logits: bool = False) -> torch.Tensor:
        cfg, kn, inp = self.cfg, self.kernels, self.inputs
        T, S = shape.num_tokens, shape.num_seqs
        q_dim, kv_dim, eps = cfg.q_dim, cfg.kv_dim, cfg.rms_norm_eps
        positions = inp.positions[:T]
        residual = self.embed[inp.input_ids[:T]]
        h = kn.rms_norm(residual, self.layers[0].in_norm, eps)
        out = residual  # replaced by every layer's MLP output; the first layer's norm reads the embedding
        for i, w in enumerate(self.layers):
            if i:
                h = kn.add_rms_norm(out, residual, w.in_norm, eps)
            qkv = F.linear(h, w.qkv, w.qkv_bias)
            q = qkv[:, :q_dim].view(T, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_dim:q_dim + kv_dim].view(T, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_dim + kv_dim:].view(T, cfg.num_kv_heads, cfg.head_dim)
            kn.rope_(q, k, positions, self.cos, self.sin)
            k_cache, v_cache = self.cache.flat(i)
            kn.write_kv_(k, v, k_cache, v_cache, inp.slot_mapping[:T])
            a = self.attention.forward(q, self.cache.k[i], self.cache.v[i], inp, shape, self.blocks_per_seq)
            h = kn.add_rms_norm(F.linear(a, w.o), residual, w.post_norm, eps)
            out = F.linear(kn.silu_and_mul(F.linear(h, w.gate_up)), w.down)
        last = inp.last_token_idx[:S]
        final = kn.add_rms_norm(out[last], residual[last].clone(), self.final_norm, eps)
        logits = F.linear(final, self.lm_head)
        if return_logits:
            return logits
        torch.argmax(logits, dim=-1, out=self.next_tokens[:S])
        return self.next_tokens[:S]
