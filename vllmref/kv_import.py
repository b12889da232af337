"""K/V computed elsewhere, written where vLLM's ExampleConnector will load it (runs inside the vLLM
environment): how an agent's imported K/V that is not a shared prefix reaches a real vLLM engine on
this CPU.

The consumer engine looks a request up by its prompt's tokens: a folder named by the connector's own
hash of the prompt's whole blocks (``ExampleConnector._generate_foldername_debug``), holding one
``<layer name>.safetensors`` per attention layer. Those files hold what the connector's ``extract``
takes from the paged cache: per token slot ``t`` of the whole blocks, ``layer[t // block, :, t % block]``
of the per-layer view it is handed. On this CPU build (vLLM 0.32's CPU attention) that view is not
token-major: inside a block each head keeps K dimension-major (``[head_dim, block]``) and then V
token-major (``[block, head_dim]``), so the view's row ``r < head_dim`` of a block holds dimension ``r``
of K across the block's tokens, and each later row two tokens' V (found by comparing a producer's
files with the model's own K/V).
:func:`connector_layout` writes that permutation; it needs ``block_size == 2 x head_dim`` (the view's rows
are the block's slots), which SmolLM2-135M's heads of 64 with vLLM's CPU block of 128 give. A round trip
checks it (tests: B's own K/V imported gives the greedy tokens text gives).
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import torch

LAYER_NAME = "model.layers.{}.self_attn.attn"


def connector_layout(k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[tokens, heads, dim]`` K and V (tokens a whole number of blocks, RoPE applied) as the file's
    ``[tokens, heads, 2 x dim]`` in the CPU view's order."""
    tokens, heads, dim = k.shape
    if block_size != 2 * dim:
        raise ValueError(f"the CPU view's layout is known for block_size == 2 x head_dim ({2 * dim}), not {block_size}")
    if tokens % block_size:
        raise ValueError(f"{tokens} tokens are not whole blocks of {block_size}")
    blocks = tokens // block_size
    # per block and head: K dim-major ([dim, slots]), then V token-major ([slots, dim]) read as
    # dim rows of block_size values; together the view's 2 x dim rows of one block
    kk = k.reshape(blocks, block_size, heads, dim).permute(0, 2, 3, 1)
    vv = v.reshape(blocks, block_size, heads, dim).permute(0, 2, 1, 3).reshape(blocks, heads, dim, block_size)
    rows = torch.cat([kk, vv], dim=2)                      # [blocks, heads, 2 x dim, block_size]
    return rows.permute(0, 2, 1, 3).reshape(tokens, heads, block_size).contiguous()


def write_import(storage_path: str, prompt: list[int], kv_path: str, block_size: int) -> dict:
    """Write the K/V in ``kv_path`` (``k.<layer>``, ``v.<layer>``: ``[tokens, heads, dim]``) for the
    consumer's lookup of ``prompt``; ``{"tokens", "bytes", "write_s"}``."""
    import safetensors.torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    tensors = safetensors.torch.load_file(kv_path)
    layers = sum(1 for name in tensors if name.startswith("k."))
    loaded = (len(prompt) - 1) // block_size * block_size      # what the consumer loads (ReqMeta's count)
    looked_up = (len(prompt) - 2) // block_size * block_size   # what its match check hashes
    if tensors["k.0"].shape[0] < loaded:
        raise ValueError(f"{kv_path} holds {tensors['k.0'].shape[0]} tokens; the prompt's whole blocks are {loaded}")
    fake = SimpleNamespace(_storage_path=storage_path)
    ids = torch.tensor(prompt)
    t = time.perf_counter()
    folder = ExampleConnector._generate_foldername_debug(fake, ids[:loaded], [], create_folder=True)
    ExampleConnector._generate_foldername_debug(fake, ids[:looked_up], [], create_folder=True)  # its match check
    num_bytes = 0
    for i in range(layers):
        data = connector_layout(tensors[f"k.{i}"][:loaded], tensors[f"v.{i}"][:loaded], block_size)
        safetensors.torch.save_file({"kv_cache": data}, os.path.join(folder, f"{LAYER_NAME.format(i)}.safetensors"))
        num_bytes += data.numel() * data.element_size()
    return {"tokens": loaded, "bytes": num_bytes, "write_s": time.perf_counter() - t}
