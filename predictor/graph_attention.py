"""Attention for the graph engine (predictor.graph_model) over its token-major paged KV cache.

Two backends with one call, ``forward(q, k_blocks, v_blocks, inputs, shape, blocks_per_seq)`` ->
``[num_tokens, heads * head_dim]``; both read lengths, block tables and query starts from the
engine's static buffers, so neither syncs the host and both can be captured in a CUDA graph.

- ``flash-varlen``: ``torch.nn.attention.varlen.varlen_attn`` with a block table and per-sequence
  lengths (``seqused_k``): one call for decodes, chunked prefills and prefills together, causal
  aligned to each sequence's last key, as vLLM's FlashAttention backend calls its varlen kernel.
  Only where the installed torch has that entry point with ``block_table`` and ``seqused_k`` (its
  schema is read at start), on a CUDA device, in fp16/bf16, and where a self-check on a small mixed
  batch agrees with ``sdpa``; otherwise the engine falls back and says why.
- ``sdpa``: decodes share one ``scaled_dot_product_attention`` call over their sequences'
  contiguous rows (no mask when their lengths are equal, so the flash kernels stay eligible; a
  length mask built on the device otherwise), and each prefill chunk gets its own call, causal to
  the lower right of its cached prefix (``causal_lower_right``, which keeps the fused kernels
  eligible where a boolean mask would not).
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from common.errors import ConfigError
from predictor.graph_inputs import StaticInputs, StepShape

BACKENDS = ("flash-varlen", "sdpa")


class AttentionBackend:
    name = "?"
    fallback_reason = ""  # why a better backend was not taken ("" when none was passed over)

    def forward(self, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, inp: StaticInputs,
                shape: StepShape, blocks_per_seq: int) -> torch.Tensor:
        raise NotImplementedError


class SdpaAttention(AttentionBackend):
    name = "sdpa"

    def forward(self, q, k_blocks, v_blocks, inp, shape, blocks_per_seq):
        from torch.nn.attention.bias import causal_lower_right

        T, H, d = q.shape
        span = blocks_per_seq * k_blocks.shape[1]
        rows = k_blocks.shape[0] // blocks_per_seq
        k_seq = k_blocks[:rows * blocks_per_seq].reshape(rows, span, *k_blocks.shape[2:])  # [rows, span, kvh, d]
        v_seq = v_blocks[:rows * blocks_per_seq].reshape(rows, span, *v_blocks.shape[2:])
        out = torch.empty(T, H, d, dtype=q.dtype, device=q.device)
        nd = shape.num_decode
        if nd:
            L = shape.decode_max_kv
            if shape.decode_first_row >= 0:
                r0 = shape.decode_first_row
                kd, vd = k_seq[r0:r0 + nd, :L], v_seq[r0:r0 + nd, :L]
            else:  # decodes on scattered rows: gather (the grid never does this; the tests do)
                idx = inp.block_table[:nd, 0].long() // blocks_per_seq
                kd, vd = k_seq[idx, :L], v_seq[idx, :L]
            mask = None
            if not shape.uniform_decode:
                mask = (torch.arange(L, device=q.device)[None, :] < inp.seq_lens[:nd, None])[:, None, None, :]
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for row, t0, t1, kv_len in shape.prefill:
            n = t1 - t0
            qi = q[t0:t1].transpose(0, 1).unsqueeze(0)
            ki, vi = k_seq[row:row + 1, :kv_len].transpose(1, 2), v_seq[row:row + 1, :kv_len].transpose(1, 2)
            if n == kv_len:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal_lower_right(n, kv_len), enable_gqa=True)
            out[t0:t1] = o[0].transpose(0, 1)
        return out.view(T, H * d)


class FlashVarlenAttention(AttentionBackend):
    name = "flash-varlen"

    def __init__(self):
        from torch.nn.attention.varlen import varlen_attn

        self._attn = varlen_attn

    def forward(self, q, k_blocks, v_blocks, inp, shape, blocks_per_seq):
        T, H, d = q.shape
        S = shape.num_seqs
        o = self._attn(q, k_blocks, v_blocks, inp.query_start[:S + 1], None, shape.max_query, shape.max_kv,
                       window_size=(-1, 0), enable_gqa=q.shape[1] != k_blocks.shape[2], seqused_k=inp.seq_lens[:S],
                       block_table=inp.block_table[:S])
        return o.reshape(T, H * d)


def varlen_schema_problem() -> str:
    """Why the installed torch's varlen flash entry point cannot serve a paged mixed batch ("" if it can)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    params = inspect.signature(varlen_attn).parameters
    missing = [p for p in ("block_table", "seqused_k", "window_size") if p not in params]
    return f"varlen_attn of torch {torch.__version__} lacks {', '.join(missing)}" if missing else ""


def choose_attention(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``auto``: flash-varlen where it can run and passes its self-check, else sdpa with the reason kept."""
    if name not in ("auto", *BACKENDS):
        raise ConfigError(f"--attention '{name}': use auto, {' or '.join(BACKENDS)}")
    if name == "sdpa":
        return SdpaAttention()
    why = varlen_schema_problem()
    if not why and device.type != "cuda":
        why = f"flash kernels run on CUDA devices only (this is {device.type})"
    if not why and dtype not in (torch.float16, torch.bfloat16):
        why = f"flash kernels take fp16/bf16 (this is {str(dtype).removeprefix('torch.')})"
    if not why:
        why = _self_check(FlashVarlenAttention(), device, dtype)
    if why and name == "flash-varlen":
        raise ConfigError(f"--attention flash-varlen: {why}")
    if why:
        backend = SdpaAttention()
        backend.fallback_reason = why
        return backend
    return FlashVarlenAttention()


def _self_check(flash: FlashVarlenAttention, device, dtype) -> str:
    """Run both backends on one small mixed batch (2 decodes of unequal length, a chunked prefill and a
    fresh prefill); "" when flash agrees with SDPA, else why not."""
    g = torch.Generator(device="cpu").manual_seed(0)
    block, bps, H, kvh, d = 16, 4, 4, 2, 64
    kb = torch.randn(4 * bps, block, kvh, d, generator=g).to(device=device, dtype=dtype)
    vb = torch.randn(4 * bps, block, kvh, d, generator=g).to(device=device, dtype=dtype)
    # rows 0, 1 decode at lengths 40 and 23; row 2 prefills 5 tokens after 30 cached; row 3 prefills 9
    lens, new = [40, 23, 35, 9], [1, 1, 5, 9]
    starts = [0, 1, 2, 7, 16]
    inp = StaticInputs(max_tokens=16, max_seqs=4, blocks_per_seq=bps, device=device)
    inp.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    inp.query_start.copy_(torch.tensor(starts, dtype=torch.int32))
    inp.block_table.copy_((torch.arange(4)[:, None] * bps + torch.arange(bps)).to(torch.int32))
    shape = StepShape(16, 4, 2, max(new), max(lens), False, 0, ((2, 2, 7, 35), (3, 7, 16, 9)), decode_max_kv=40)
    q = torch.randn(16, H, d, generator=g).to(device=device, dtype=dtype)
    try:
        got = flash.forward(q, kb, vb, inp, shape, bps)
    except Exception as e:  # any failure of the optional kernel means: use the fallback
        return f"varlen flash failed its self-check ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    want = SdpaAttention().forward(q, kb, vb, inp, shape, bps)
    err = float((got.float() - want.float()).abs().max())
    return "" if err <= 2e-2 else f"varlen flash disagrees with SDPA on its self-check (max |diff| {err:.3g})"
