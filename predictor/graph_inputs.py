"""A graph-engine step's inputs: its shape (what a CUDA graph is captured for) and the static device
buffers it reads (predictor.graph_model fills them; predictor.graph_attention reads them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepShape:
    """What a step's code depends on besides buffer contents: the key a CUDA graph is captured for."""
    num_tokens: int
    num_seqs: int
    num_decode: int
    max_query: int
    max_kv: int
    uniform_decode: bool   # every decode has the same length (no length mask)
    decode_first_row: int  # caller index of the first decode; -1 when the decode rows are not contiguous
    prefill: tuple         # per prefill sequence: (caller row, token start, token end, kv length)
    decode_max_kv: int = 0  # the longest decode's length (its keys and the new token)

    @property
    def decode_only(self) -> bool:
        return self.num_decode == self.num_seqs


class StaticInputs:
    """Device buffers sized once for the largest step; a step fills prefixes of them."""

    def __init__(self, *, max_tokens: int, max_seqs: int, blocks_per_seq: int, device):
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.slot_mapping = torch.zeros(max_tokens, **i64)
        self.seq_lens = torch.zeros(max_seqs, **i32)
        self.query_start = torch.zeros(max_seqs + 1, **i32)
        self.block_table = torch.zeros(max_seqs, blocks_per_seq, **i32)
        self.last_token_idx = torch.zeros(max_seqs, **i64)
        self.max_tokens, self.max_seqs, self.blocks_per_seq = max_tokens, max_seqs, blocks_per_seq
