"""``python -m vllmref.worker_serve SPEC``: one real vLLM engine serving requests from a router.

Runs inside the vLLM environment. Where ``worker_replay`` runs a whole closed loop against one
engine, this worker is one replica of several: a router in another process (scheduling's live
cluster replay) decides which replica gets each turn and sends it here. Lines on stdin (JSON):

    {"op": "add", "id": ID, "prompt": [token ids], "n_out": N, "priority": P}
    {"op": "reset"}                                  drop the prefix cache (answered by a "reset" event)
    {"op": "import", "id": ID, "prompt": [ids], "kv": PATH}   a KV consumer: write PATH's K/V where the
                                                     connector will find it for that prompt
                                                     (vllmref.kv_import; answered by "imported")
    {"op": "stop"}

Lines on stdout (JSON, one event each; times are ``time.perf_counter()``, which on Linux is the
system's monotonic clock, the same in every process):

    {"ev": "ready", ...engine facts}            once, after the warm-up
    {"ev": "step", ...}                         each engine step the recording scheduler saw
    {"ev": "load", "t", "waiting", "running", "kv_used_blocks", "kv_total_blocks"}
                                                after each step: what a router scraping this replica's
                                                metrics would read
    {"ev": "first", "id", "t"}                  a request's first token (the end of its step)
    {"ev": "done", "id", "t", "tokens", "cached_tokens"}   a finished request
    {"ev": "kv", "t", "requests": [{"id", "op", "tokens"}], "save_s", "load_s"}
                                                with a KV connector (spec ``engine.kv_transfer``): what
                                                the step stored or loaded, and the seconds its file
                                                I/O took (vllmref.kv_timing)

Output lengths are exact (``min_tokens = max_tokens``, EOS ignored), greedy.
"""
from __future__ import annotations

import importlib
import json
import os
import select
import sys
import time


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def read_commands(buffer: list[str], timeout_s: float) -> tuple[list[dict], bool]:
    """Commands that arrived within ``timeout_s`` (``select`` on stdin); ``(commands, stdin closed)``."""
    ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    if not ready:
        return [], False
    chunk = os.read(sys.stdin.fileno(), 1 << 20).decode()
    if not chunk:
        return [], True
    buffer.append(chunk)
    text = "".join(buffer)
    *lines, rest = text.split("\n")
    buffer[:] = [rest]
    return [json.loads(line) for line in lines if line.strip()], False


def main(spec_path: str) -> int:
    from vllm import SamplingParams

    from vllmref import hooks
    from vllmref.engine import build_engine, engine_facts
    from vllmref.worker_replay import token_ids

    spec = json.loads(open(spec_path).read())
    engine = build_engine(spec["engine"])
    # the connector's file I/O, timed per step (a prefill/decode pair only; it imports vLLM's connector)
    kv_timing = importlib.import_module("vllmref.kv_timing") if spec["engine"].get("kv_transfer") else None
    warm = token_ids("warmup", 16, seed=int(spec.get("seed", 0)), vocab_size=int(spec["vocab_size"]))
    engine.add_request("warmup", {"prompt_token_ids": warm},
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    hooks.drain()
    if kv_timing is not None:
        kv_timing.drain()  # the warm-up's own store
    emit({"ev": "ready", **engine_facts(engine)})
    buffer: list[str] = []
    started: set[str] = set()
    stopping = closed = False
    while True:
        busy = engine.has_unfinished_requests()
        commands, closed = read_commands(buffer, 0.0 if busy else 0.02)
        for c in commands:
            if c["op"] == "stop":
                stopping = True
            elif c["op"] == "reset":  # between timed rounds: nothing cached from the last one
                emit({"ev": "reset", "ok": bool(engine.reset_prefix_cache())})
            elif c["op"] == "import":  # K/V computed elsewhere, placed where the connector loads it
                from vllmref.kv_import import write_import

                kv = spec["engine"]["kv_transfer"]
                emit({"ev": "imported", "id": c["id"], **write_import(kv["path"], c["prompt"], c["kv"],
                                                                       int(spec["engine"].get("block_size", 128)))})
            elif c["op"] == "add":
                n = int(c["n_out"])
                engine.add_request(c["id"], {"prompt_token_ids": c["prompt"]},
                                   SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True,
                                                  detokenize=False), priority=int(c.get("priority", 0)))
        if not engine.has_unfinished_requests():
            if stopping or closed:
                return 0
            continue
        outputs = engine.step()
        steps = hooks.drain()
        end_s = steps[-1]["t_end"] if steps else time.perf_counter()
        for rec in steps:
            emit({"ev": "step", **rec})
        if kv_timing is not None and (kv := kv_timing.drain()) is not None:
            emit({"ev": "kv", "t": end_s, **kv})
        if steps:
            last = steps[-1]
            emit({"ev": "load", "t": end_s, "waiting": last.get("num_waiting", 0), "running": last.get("num_running", 0),
                  "kv_used_blocks": last["kv_total_blocks"] - last["kv_free_blocks"],
                  "kv_total_blocks": last["kv_total_blocks"]})
        for o in outputs:
            generated = o.outputs[0].token_ids
            if o.request_id not in started and len(generated) > 0:
                started.add(o.request_id)
                emit({"ev": "first", "id": o.request_id, "t": end_s})
            if o.finished:
                started.discard(o.request_id)
                emit({"ev": "done", "id": o.request_id, "t": end_s, "tokens": list(generated),
                      "cached_tokens": int(o.num_cached_tokens or 0)})


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
