"""``python -m vllmref.worker_generate SPEC OUT``: one greedy completion (the set-up check)."""
from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> int:
    from vllm import SamplingParams

    from vllmref.engine import build_engine

    spec = json.loads(open(spec_path).read())
    engine = build_engine({"model": spec["model"], "max_num_seqs": 4, "max_model_len": 2048,
                           "max_num_batched_tokens": 2048, "enable_prefix_caching": False})
    engine.add_request("0", spec["prompt"], SamplingParams(max_tokens=int(spec["max_tokens"]), temperature=0.0))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                text = out.outputs[0].text
    with open(out_path, "w") as f:
        f.write(json.dumps({"text": text}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
