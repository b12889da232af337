"""``python -m vllmref.worker_replay SPEC OUT``: a closed-loop agent replay through a real vLLM engine.

Runs inside the vLLM environment, in real time. Each job's turn k is sent when it arrives (the
job's arrival for turn 0; turn k-1's finish plus its tool gap afterwards, on the wall clock), with
the prompt an agent would send: its prefix group's system prompt, then every earlier input and the
tokens the model *really generated*, then turn k's new input, so vLLM's prefix cache sees what it
would see in production. Output lengths are exact (``min_tokens = max_tokens``, EOS ignored).

Records (JSONL): ``engine`` (settings read back), one ``step`` per engine step (from the recording
scheduler, times relative to the replay's start), one ``turn`` per finished turn (vLLM's own
``num_cached_tokens`` as the hit, and the hit seen by the scheduler at first admission), and a
``metrics`` record with vLLM's Prometheus counters (prefix-cache queries and hits, preemptions).
"""
from __future__ import annotations

import heapq
import json
import random
import sys
import time
from typing import Any


def token_ids(key: str, length: int, *, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(f"{seed}:{key}")
    return [rng.randrange(3, vocab_size // 2) for _ in range(length)]


def vllm_counters(engine) -> dict:
    """vLLM's own counters (summed over label sets): what its /metrics endpoint would report."""
    wanted = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
              "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")
    out: dict[str, Any] = {}  # counter name -> float, and "error" -> str when reading failed
    try:
        for metric in engine.get_metrics():
            name = metric.name
            if name.endswith("_total"):
                name = name[: -len("_total")]
            if name in wanted and hasattr(metric, "value"):
                out[name] = out.get(name, 0.0) + float(metric.value)
    except Exception as e:  # counters are a cross-check, never a reason to lose the replay
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def account_step(rec: dict, state: dict[str, dict]) -> int:
    """Apply one recorded engine step to the turns in flight (``state``: request id -> its record):
    a turn's first scheduling and the prefix hit the scheduler saw then, the tokens scheduled, the
    preemptions. Returns the hit tokens of the turns first scheduled in this step. Shared with the
    live cluster's router loop (scheduling.experiments.live_cluster), which records each replica's
    steps the same way."""
    hit_tokens = 0
    for item in rec["batch"]:
        st = state.get(item["req_id"])
        if st is None:
            continue
        if st["first_scheduled_s"] is None:
            st["first_scheduled_s"] = rec["t_start"]
            st["scheduler_hit_tokens"] = item["num_computed_before"]
            hit_tokens += item["num_computed_before"]
        st["scheduled_tokens"] += item["num_new_tokens"]
    for req_id in rec["preempted"]:
        if req_id in state:
            state[req_id]["num_preemptions"] += 1
    return hit_tokens


class PriorityOrder:
    """The request ``priority`` vLLM's ``priority`` scheduling policy serves (lower first; ties by
    the request's arrival there), set when a turn is sent, with the rules of the simulator's queue
    orders (scheduling.policies.ordering) at their default parameters, from what the client knows
    then:

    - ``sjf``: the turn's expected output, the mean output of the job's finished turns, else the
      mean over every finished turn, else 256 tokens;
    - ``las``: the job's attained service, the tokens the engine scheduled for its finished turns,
      in quanta of 400 tokens.

    The key is scaled by the number of jobs and the job's index added (jobs come in arrival order),
    so that equal keys go by the job's first arrival, as in the simulator.
    """

    PRIOR_OUTPUT_TOKENS = 256
    LAS_QUANTUM_TOKENS = 400

    def __init__(self, name: str, num_jobs: int) -> None:
        if name not in ("sjf", "las"):
            raise ValueError(f"no live priority order {name!r}")
        self.name, self.num_jobs = name, num_jobs
        self.job_out: dict[int, list[int]] = {}
        self.job_scheduled: dict[int, int] = {}
        self.all_out = self.all_count = 0

    def priority(self, j: int) -> int:
        if self.name == "sjf":
            outs = self.job_out.get(j)
            if outs:
                estimate = sum(outs) / len(outs)
            else:
                estimate = self.all_out / self.all_count if self.all_count else self.PRIOR_OUTPUT_TOKENS
            key = int(round(estimate * 1000))  # milli-tokens: a mean keeps its order
        else:
            key = self.job_scheduled.get(j, 0) // self.LAS_QUANTUM_TOKENS
        return key * self.num_jobs + j

    def turn_finished(self, j: int, output_tokens: int, scheduled_tokens: int) -> None:
        self.job_out.setdefault(j, []).append(output_tokens)
        self.all_out += output_tokens
        self.all_count += 1
        self.job_scheduled[j] = self.job_scheduled.get(j, 0) + scheduled_tokens


class _Replay:
    """The replay's state between engine steps: the jobs' token histories, the turns in flight and
    the heap of turns waiting for their arrival time (a job's next turn arrives after its tool time)."""

    def __init__(self, engine, jobs: list[dict], out, *, seed: int, vocab_size: int, order: str = "fcfs"):
        self.engine, self.jobs, self.out = engine, jobs, out
        self.order = PriorityOrder(order, len(jobs)) if order != "fcfs" else None
        self.seed, self.vocab_size = seed, vocab_size
        self.history: dict[int, list[int]] = {}
        self.state: dict[str, dict] = {}
        self.heap = [(float(j.get("arrival_s", 0.0)), i, 0) for i, j in enumerate(jobs)]
        heapq.heapify(self.heap)
        self.jobs_done = 0
        self.step_index = 0

    def _tokens(self, label: str, n: int) -> list[int]:
        return token_ids(label, n, seed=self.seed, vocab_size=self.vocab_size)

    def send_due(self, now: float) -> None:
        """Add every turn whose arrival time has come, its prompt the job's history plus its input."""
        from vllm import SamplingParams

        while self.heap and self.heap[0][0] <= now:
            arrival_s, j, k = heapq.heappop(self.heap)
            job = self.jobs[j]
            if k == 0:
                self.history[j] = self._tokens(f"system:{job['prefix_group']}", int(job["system_tokens"]))
            turn = job["turns"][k]
            prompt = self.history[j] + self._tokens(f"input:{job['job_id']}:{k}", int(turn["input_tokens"]))
            self.history[j] = prompt
            req_id = f"{j}#{k}"
            n_out = int(turn["output_tokens"])
            priority = self.order.priority(j) if self.order else 0
            self.engine.add_request(req_id, {"prompt_token_ids": prompt},
                                    SamplingParams(max_tokens=n_out, min_tokens=n_out, temperature=0.0,
                                                   ignore_eos=True, detokenize=False), priority=priority)
            self.state[req_id] = {"job": j, "turn": k, "arrival_s": arrival_s, "sent_s": now,
                                  "prompt_tokens": len(prompt), "first_scheduled_s": None, "first_token_s": None,
                                  "scheduled_tokens": 0, "num_preemptions": 0, "scheduler_hit_tokens": None,
                                  "priority": priority}

    def record_steps(self, steps: list[dict], t0: float) -> None:
        """One ``step`` record per engine step the hooks saw; the turns' first scheduling and hits."""
        from vllmref.engine import write_record

        for rec in steps:
            self.step_index += 1
            rec["t_start"] -= t0
            rec["t_end"] -= t0
            hit_tokens = account_step(rec, self.state)
            write_record(self.out, {"kind": "step", "step": self.step_index, "num_prefix_hit_tokens": hit_tokens, **rec})

    def finish(self, outputs, end_s: float) -> None:
        """First tokens and finished turns: a ``turn`` record each, and the job's next turn queued."""
        from vllmref.engine import progress, write_record

        for o in outputs:
            st = self.state.get(o.request_id)
            if st is None:
                continue
            generated = o.outputs[0].token_ids
            if st["first_token_s"] is None and len(generated) > 0:
                st["first_token_s"] = end_s
            if not o.finished:
                continue
            j, k = st["job"], st["turn"]
            self.history[j] = self.history[j] + list(generated)
            job = self.jobs[j]
            write_record(self.out, {"kind": "turn", "job_id": job["job_id"], "prefix_group": job["prefix_group"],
                                    "finish_s": end_s, "output_tokens": len(generated),
                                    "hit_tokens": int(o.num_cached_tokens or 0), **{
                                        key: st[key] for key in ("turn", "arrival_s", "sent_s", "prompt_tokens",
                                                                 "first_scheduled_s", "first_token_s",
                                                                 "scheduled_tokens", "num_preemptions",
                                                                 "scheduler_hit_tokens", "priority")}})
            if self.order:
                self.order.turn_finished(j, len(generated), st["scheduled_tokens"])
            del self.state[o.request_id]
            if k + 1 < len(job["turns"]):
                heapq.heappush(self.heap, (end_s + float(job["turns"][k].get("tool_s", 0.0)), j, k + 1))
            else:
                self.jobs_done += 1
                progress(f"{self.jobs_done}/{len(self.jobs)} jobs, {end_s:.1f} s")


def main(spec_path: str, out_path: str) -> int:
    from vllm import SamplingParams

    from vllmref import hooks
    from vllmref.engine import build_engine, engine_facts, write_record

    spec = json.loads(open(spec_path).read())
    seed, vocab_size = int(spec.get("seed", 0)), int(spec["vocab_size"])
    engine = build_engine(spec["engine"])
    # Warm-up outside the replay's clock: the first forward allocates and is slower.
    engine.add_request("warmup", {"prompt_token_ids": token_ids("warmup", 16, seed=seed, vocab_size=vocab_size)},
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    hooks.drain()
    counters_before = vllm_counters(engine)

    with open(out_path, "w") as out:
        replay = _Replay(engine, spec["jobs"], out, seed=seed, vocab_size=vocab_size, order=spec.get("order", "fcfs"))
        write_record(out, {"kind": "engine", **engine_facts(engine)})
        t0 = time.perf_counter()
        while replay.heap or engine.has_unfinished_requests():
            replay.send_due(time.perf_counter() - t0)
            if not engine.has_unfinished_requests():
                if replay.heap:
                    time.sleep(max(0.0, min(replay.heap[0][0] - (time.perf_counter() - t0), 0.05)))
                continue
            outputs = engine.step()
            steps = hooks.drain()
            end_s = (steps[-1]["t_end"] if steps else time.perf_counter()) - t0
            replay.record_steps(steps, t0)
            replay.finish(outputs, end_s)
        after = vllm_counters(engine)
        write_record(out, {"kind": "metrics", "wall_s": time.perf_counter() - t0,
                           **{k: after.get(k, 0.0) - counters_before.get(k, 0.0) for k in after if k != "error"},
                           **({"error": after["error"]} if "error" in after else {})})
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
