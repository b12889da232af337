"""GpuAttention: one layer's attention on a GPU, priced per part of the batch and per sequence.

A mixed batch's decodes and prefill chunks each get their own max(t_c, t_m), and a decode batch
whose longest sequence cannot spread over the SMs (split-KV decoding gives every sequence the same
number of splits) is bound by that sequence. Separate from predictor.step because it is the one
op StepModel prices from the batch's sequences rather than from its feature totals; the model
holds one, built at set-up, and calls its bound ``price`` once per ``predict_time``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from predictor.ops import OpGraph

# NOTE(predictor): split-KV decode attention (FlashDecoding; FlashAttention's num_splits heuristic):
# one CTA per (sequence, KV head, split); one split count for the whole batch, chosen to fill the
# SMs once the batch's own CTAs fill less than 80 % of them, at most one split per 128-token KV
# tile and 128 splits.
ATTN_SPLIT_FILL = 0.8
ATTN_SPLIT_KV_TILE = 128
ATTN_MAX_SPLITS = 128
# A CTA streams at most about twice its SM's fair share of DRAM bandwidth (memory-bound kernels
# reach peak bandwidth with roughly half of the SMs busy), so a decode batch whose longest sequence
# has few CTAs is bound by that sequence, not by the batch's total bytes.
SM_BANDWIDTH_SHARE = 2.0


@dataclass(frozen=True)
class AttentionOverheads:
    """What an attention kernel costs beyond its FLOPs and bytes (0 unless a calibration measured it):
    ``fixed_s`` once per call (one kernel serves a mixed batch's decodes and prefill chunks),
    ``seq_s`` per sequence of the batch, ``token_s`` per new token of a prefill chunk."""

    fixed_s: float = 0.0
    seq_s: float = 0.0
    token_s: float = 0.0


class GpuAttention:
    """The attention op of ``graph`` on ``num_sms`` SMs.

    Args:
        graph: the op graph (its "attention" op's coefficients).
        num_sms: the GPU's SMs.
        num_kv_heads: the model's KV heads (one CTA per sequence, KV head and split).
        flops_per_s: every op's rate (StepModel's, with eta_c but no eta_cluster).
        mem_bytes_per_s: the streaming bandwidth B * eta_max.
        overheads: the kernel's fixed, per-sequence and per-prefill-token times.
    """

    def __init__(self, graph: OpGraph, num_sms: int, num_kv_heads: int, flops_per_s: np.ndarray,
                 mem_bytes_per_s: float, *, overheads: AttentionOverheads = AttentionOverheads()):
        g = graph
        i = g.names.index("attention")
        self.index = i
        self._attn_flops = tuple(g.flops[i])
        self._attn_bytes = tuple(g.bytes[i])
        self._attn_rate = float(flops_per_s[i])
        self._mem_bytes_per_s = mem_bytes_per_s
        self._num_sms = num_sms
        # KV bytes one cached token costs one layer's attention (K and V of every KV head)
        self._kv_bytes_per_token = float(g.kv_read_bytes[i, 4])
        self._kv_heads = max(1, int(num_kv_heads))
        self.overheads = overheads

    def splits(self, num_seqs, max_tokens):
        """Split-KV count of a decode batch (numpy arrays or floats; see ATTN_SPLIT_FILL)."""
        sms = self._num_sms
        ctas = np.maximum(np.asarray(num_seqs, dtype=np.float64) * self._kv_heads, 1.0)
        tiles = np.maximum(np.ceil(np.asarray(max_tokens, dtype=np.float64) / ATTN_SPLIT_KV_TILE), 1.0)
        fill = np.minimum(np.minimum(np.ceil(sms / ctas), tiles), ATTN_MAX_SPLITS)
        return np.where(ctas >= ATTN_SPLIT_FILL * sms, 1.0, np.maximum(fill, 1.0))

    def longest_sequence_bytes(self, num_seqs, max_tokens):
        """Bytes the decode attention behaves as if it streamed when its longest sequence (of
        ``max_tokens`` KV tokens) sets the time: that sequence's CTAs, at SM_BANDWIDTH_SHARE times
        their SMs' share of the bandwidth, against the whole device."""
        splits = self.splits(num_seqs, max_tokens)
        per_cta = np.asarray(max_tokens, dtype=np.float64) * self._kv_bytes_per_token / (self._kv_heads * splits)
        return per_cta * self._num_sms / SM_BANDWIDTH_SHARE

    def overhead_s(self, num_seqs, num_prefill_tokens):
        """The per-sequence and per-prefill-token part of the overheads (floats or numpy arrays)."""
        return self.overheads.seq_s * num_seqs + self.overheads.token_s * num_prefill_tokens

    def price(self, decode: tuple, prefill: tuple, max_decode_tokens: float) -> tuple:
        """(t_c, t_m, t) of one layer's attention, per call.

        ``decode`` and ``prefill`` are the (T, S, A, C) feature sums of the batch's decode
        sequences (one new token) and of its prefill chunks. Each part gets its own
        max(t_c, t_m): a prefill chunk's compute does not hide the decodes' KV reads. The decode
        part's memory time is at least its longest sequence's (``longest_sequence_bytes``). ``t``
        holds the kernel's fixed time once, and its time per sequence and per prefill token.
        """
        fc, bc, rate, bw = self._attn_flops, self._attn_bytes, self._attn_rate, self._mem_bytes_per_s
        t_c = t_m = t = 0.0
        for part, is_decode in ((decode, True), (prefill, False)):
            if part[1] == 0:
                continue
            flops = fc[1] * part[0] + fc[2] * part[1] + fc[3] * part[2] + fc[4] * part[3]
            nbytes = bc[1] * part[0] + bc[2] * part[1] + bc[3] * part[2] + bc[4] * part[3]
            if is_decode:
                nbytes = max(nbytes, float(self.longest_sequence_bytes(part[1], max_decode_tokens)))
            part_c, part_m = flops / rate, nbytes / bw
            t_c += part_c
            t_m += part_m
            t += max(part_c, part_m) + self.overhead_s(part[1], 0.0 if is_decode else part[0])
        return t_c, t_m, t + self.overheads.fixed_s
