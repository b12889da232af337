"""``python -m vllmref.worker_kvfile SPEC OUT``: how fast vLLM's ExampleConnector can move KV here.

The connector's producer writes a request's whole-block prompt KV as one safetensors file per layer
(``safetensors.torch.save_file``, a fresh folder per prompt), and its consumer reads every layer's
file back (``load_file``) and scatters it into the paged cache. This worker does exactly those calls
on tensors of the model's per-layer KV shape (the producer's gather of the request's slots from its
paged cache included, and every file kept until the end, as the connector keeps them), with no
engine, so that the simulator can price a prefill/decode hand-off on this host from a measurement
taken apart from the replay it is compared with. Runs inside the vLLM environment (the same safetensors and torch as the connector).

Spec: ``layers``, ``kv_heads``, ``head_dim``, ``dtype_bytes`` (4: float32), ``block_size``,
``tokens`` (prompt sizes), ``repeats``, ``dir`` (where the files go; the live replay's temporary
directory is on the same filesystem). One record per size: the median and spread of the write and
read seconds over the repeats.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(spec_path: str, out_path: str) -> int:
    import safetensors.torch
    import torch

    spec = json.loads(open(spec_path).read())
    layers, heads, dim, bs = int(spec["layers"]), int(spec["kv_heads"]), int(spec["head_dim"]), int(spec["block_size"])
    dtype = {4: torch.float32, 2: torch.bfloat16}[int(spec["dtype_bytes"])]
    sizes = [int(t) for t in spec["tokens"]]
    blocks = -(-max(sizes) // bs) + 1
    # a producer's and a consumer's paged cache, one tensor per layer, [blocks, 2 x heads, block, dim]
    source = [torch.randn(blocks, 2 * heads, bs, dim).to(dtype) for _ in range(layers)]
    target = [torch.zeros(blocks, 2 * heads, bs, dim, dtype=dtype) for _ in range(layers)]
    times: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in sizes}
    # Sizes interleaved within each repeat, every prompt in a folder of its own, and the files kept
    # until the end, as the connector keeps them (it never deletes): the page cache's dirty data
    # grows through the run as in a replay, and no size sees more of it than the others.
    for rep in range(int(spec["repeats"]) + 1):  # the first round is a warm-up, not kept
        for tokens in sizes:
            slots = torch.arange(tokens) + bs  # past block 0, as a real block table would be
            block_of, offset = slots // bs, slots % bs
            folder = os.path.join(spec["dir"], f"kv-{tokens}-{rep}")
            t = time.perf_counter()
            os.makedirs(folder, exist_ok=True)
            for i in range(layers):  # the producer: gather the request's slots, save the layer
                kv = source[i][block_of, :, offset]
                safetensors.torch.save_file({"kv_cache": kv}, os.path.join(folder, f"layer{i}.safetensors"))
            w = time.perf_counter() - t
            t = time.perf_counter()
            for i in range(layers):  # the consumer: load the layer, scatter it into its slots
                kv = safetensors.torch.load_file(os.path.join(folder, f"layer{i}.safetensors"))["kv_cache"]
                target[i][block_of, :, offset] = kv
            r = time.perf_counter() - t
            if rep:
                times[tokens][0].append(w)
                times[tokens][1].append(r)
    with open(out_path, "a") as out:
        for tokens in sizes:
            writes, reads = times[tokens]
            num_bytes = tokens * layers * 2 * heads * dim * int(spec["dtype_bytes"])
            out.write(json.dumps({"tokens": tokens, "bytes": num_bytes, "repeats": len(writes),
                                  "write_s": statistics.median(writes), "write_min_s": min(writes),
                                  "write_max_s": max(writes), "read_s": statistics.median(reads),
                                  "read_min_s": min(reads), "read_max_s": max(reads)}) + "\n")
            print(f"progress: {tokens} tokens: write {statistics.median(writes) * 1e3:.1f} ms, "
                  f"read {statistics.median(reads) * 1e3:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
