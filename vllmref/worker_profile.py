"""``python -m vllmref.worker_profile SPEC OUT``: real vLLM engine steps over scripted scenarios.

Runs inside the vLLM environment. The spec holds the engine settings (see :mod:`vllmref.engine`)
and a list of scenarios; each scenario is a set of requests sent to one engine, and *every* engine
step it causes is recorded by the recording scheduler (the batch the real scheduler chose: tokens
per request and the context each had before the step), so a row's composition is read from vLLM,
never assumed. The prefix cache is reset between scenarios so that they do not share blocks.

Scenario: ``{"name": str, "requests": [request, ...]}``; request::

    {"name": "r0", "prompt": [["shared", "P", 512], ["unique", 64]], "max_tokens": 8,
     "after_step": 0, "after_finish": null}

``prompt`` segments are token ids drawn from a seeded generator: ``shared`` segments with the
same key are identical (prefix-cache hits), ``unique`` segments are fresh. A request is added
before the scenario's ``after_step``-th engine step, or once the request named ``after_finish``
has finished. Output records (JSONL): one ``{"kind": "step", ...}`` per engine step, one
``{"kind": "request", ...}`` per finished request (with vLLM's own ``num_cached_tokens``), one
``{"kind": "engine", ...}`` with the settings the engine really runs with. With a ``reference``
entry in the spec (``{"ref_n", "ref_k", "ref_reps", "pool_bytes"}``), the cold torch GEMV every
probe row times beside itself is timed right before each engine step (outside the step's own
interval) and goes into that step's record as ``ref_times_s``, so a row says which machine phase it
was taken in: on a shared VM the host's speed moves by 10-20 % within seconds, so a reference timed
once per scenario (also written, as ``{"kind": "reference", "scenario", "times_s"}``) is too far
from most of the scenario's steps to say their phase.
"""
from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable


def prompt_ids(segments: list, *, seed: int, vocab_size: int, counter: list[int]) -> list[int]:
    ids: list[int] = []
    for seg in segments:
        if seg[0] == "shared":
            rng = random.Random(f"{seed}:shared:{seg[1]}")
            length = int(seg[2])
        else:
            counter[0] += 1
            rng = random.Random(f"{seed}:unique:{counter[0]}")
            length = int(seg[1])
        # Ids from the lower half of the vocabulary: never a special token of the real tokenizer.
        ids.extend(rng.randrange(3, vocab_size // 2) for _ in range(length))
    return ids


def run_scenario(engine, scenario: dict, *, seed: int, vocab_size: int, out, counter: list[int],
                 time_reference: Callable[[], list[float]] | None = None) -> int:
    """Send the scenario's requests and step the engine until they finish; one record per step.

    ``time_reference``, when given, is called before every engine step and its times go into the
    step's record (``ref_times_s``)."""
    from vllm import SamplingParams

    from vllmref import hooks
    from vllmref.engine import write_record

    pending = list(scenario["requests"])
    finished: set[str] = set()
    sent: dict[str, float] = {}
    step = 0
    num_steps = 0
    while pending or engine.has_unfinished_requests():
        ready = [r for r in pending if (r.get("after_finish") is None and step >= int(r.get("after_step", 0)))
                 or (r.get("after_finish") is not None and r["after_finish"] in finished)]
        for r in ready:
            pending.remove(r)
            req_id = f"{scenario['name']}/{r['name']}"
            ids = prompt_ids(r["prompt"], seed=seed, vocab_size=vocab_size, counter=counter)
            params = SamplingParams(max_tokens=int(r["max_tokens"]), min_tokens=int(r["max_tokens"]),
                                    temperature=0.0, ignore_eos=True, detokenize=False)
            engine.add_request(req_id, {"prompt_token_ids": ids}, params)
            sent[req_id] = time.perf_counter()
        if not engine.has_unfinished_requests():
            if pending and not ready:
                waiting_on = {r.get("after_finish") for r in pending}
                raise SystemExit(f"scenario {scenario['name']}: requests wait on {waiting_on}, which never finish")
            continue
        reference = {"ref_times_s": time_reference()} if time_reference is not None else {}
        outputs = engine.step()
        step += 1
        for rec in hooks.drain():
            num_steps += 1
            write_record(out, {"kind": "step", "scenario": scenario["name"], "scenario_step": step, **rec,
                               **reference})
        for o in outputs:
            if o.finished:
                finished.add(o.request_id.split("/", 1)[1])
                write_record(out, {"kind": "request", "scenario": scenario["name"], "req_id": o.request_id,
                                   "num_prompt_tokens": len(o.prompt_token_ids or ()),
                                   "num_output_tokens": len(o.outputs[0].token_ids),
                                   "num_cached_tokens": o.num_cached_tokens})
    return num_steps


def main(spec_path: str, out_path: str) -> int:
    from vllmref.engine import build_engine, engine_facts, progress, write_record

    spec = json.loads(open(spec_path).read())
    t0 = time.perf_counter()
    engine = build_engine(spec["engine"])
    facts = engine_facts(engine)
    vocab_size = int(spec["vocab_size"])
    seed = int(spec["engine"].get("seed", 0))
    counter = [0]
    with open(out_path, "a") as out:  # appended: the parent resumes from what an interrupted run wrote
        write_record(out, {"kind": "engine", **facts, "start_s": time.perf_counter() - t0})
        scenarios = spec["scenarios"]
        reference = spec.get("reference")
        time_reference = None
        if reference:
            from vllmref.worker_ops import _State, reference_gemv_times

            reference_state = _State()

            def time_reference() -> list[float]:
                return reference_gemv_times(reference_state, reference)
        for i, scenario in enumerate(scenarios):
            engine.reset_prefix_cache()
            if time_reference is not None:
                write_record(out, {"kind": "reference", "scenario": scenario["name"], "times_s": time_reference()})
            n = run_scenario(engine, scenario, seed=seed, vocab_size=vocab_size, out=out, counter=counter,
                             time_reference=time_reference)
            write_record(out, {"kind": "scenario_done", "scenario": scenario["name"], "num_steps": n})
            progress(f"{i + 1}/{len(scenarios)} {scenario['name']} ({n} steps)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
