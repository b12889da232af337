"""Step rows from a real vLLM engine (``gpubench profile --engine vllm``), in the torch rows' schema.

Scenarios (decode batches, prefills with and without a cached prefix, a prefill joining running
decodes) are sent to an in-process vLLM V1 engine in its own environment (:mod:`vllmref`); every
engine step they cause becomes one row. The batch of a row is what vLLM's scheduler chose (tokens
per request and each request's context before the step), read by a recording scheduler: a decode
scenario's first steps are chunked prefills, and a joining prefill shares its step with decodes,
exactly as the engine ran them. The phase is derived from that batch: ``decode`` (every request
decodes one token), ``prefill`` (none does), ``mixed``.

Timing is the engine-core step (schedule -> forward -> sample -> update) on the host clock;
``process_cpu_s`` is the CPU time of all the engine's threads over the step and ``cpu_share`` =
process_cpu_s / (wall * threads). A row is ``contended`` when its CPU share is below
:data:`MIN_CPU_SHARE` or the 1-minute load average exceeded the core count by more than one: such
rows are not ground truth, and ``gpubench evaluate`` refuses them unless told otherwise.

Takes: a vLLM step cannot be repeated in place (the next step has one more token of context), so
the grid is run ``takes`` times, each take a fresh engine start (another worker process), and a
row is the median of its step over the takes: the same scenario and step index, with the batch the
scheduler chose checked equal (a take whose batch differs at that step is left out of it). The
row keeps every take's time (``wall_times_s``, ``thread_cpu_times_s``), ``num_repeats`` and the
spread. Why takes and not more steps: the steps of one scenario run move together (on the 2-vCPU
VM the same step differs by 13-19 % between engine starts, fast in one scenario and slow in the
next), which more steps of the same run do not average out. A take's contended step is left out
of the median when a quiet take has it.

Retakes: a scenario with a contended row (no quiet take of it) is run again, after the others, up
to ``retake_contended`` times (``takes`` takes each), and its rows are replaced by a retake with
fewer contended steps. A scenario is retaken whole, never step by step: its steps share one
engine's state (the running batch, the KV blocks). Rerunning the command on a complete file
retakes what is still contended.

Resume: the worker appends take t's records to ``<out>.vllm.take<t>.partial.jsonl``; a scenario
with a ``scenario_done`` record there is not run again in that take. At the end all rows go to
``<out>`` (parquet) and the partial files are removed.
"""
from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from common.errors import ConfigError
from common.model_config import ModelConfig
from gpubench.contention import MIN_CPU_SHARE, is_contended  # noqa: F401 - one rule for probes and steps
from predictor.profile import cpu_model_name
from predictor.profile_grid import GridPoint, point_features
from predictor.profile_rows import SCHEMA_VERSION, read_rows, wall_fields, write_parquet
from vllmref.settings import EngineSettings

DTYPE_BYTES = 4  # the reference engine runs float32 on this CPU


@dataclass(frozen=True)
class VllmGrid:
    """Scenarios to send. Scenarios over a cap are dropped so one grid serves small and big models.

    ``max_prefill_gflop``: FLOPs of a scenario's prompt tokens (2 per weight per token), which keeps
    a 1B model's prefills to seconds on 2 cores; ``max_kv_gib``: the KV pool the engine gets.
    """
    name: str
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    decode_steps: int = 8
    max_prefill_gflop: float = 2000.0
    max_kv_gib: int = 2


VLLM_GRIDS = {
    "tiny": VllmGrid("tiny", batch_sizes=(1, 3), contexts=(128,), prefill_tokens=(64,), decode_steps=3),
    "quick": VllmGrid("quick", batch_sizes=(1, 4, 16), contexts=(128, 512), prefill_tokens=(64, 256), decode_steps=6),
    "default": VllmGrid("default", batch_sizes=(1, 2, 4, 8, 16, 32), contexts=(128, 512, 1024, 2048),
                        prefill_tokens=(64, 256, 1024), decode_steps=10),
}


@dataclass(frozen=True)
class VllmProfileConfig(EngineSettings):
    """What ``profile --engine vllm`` runs: the engine settings, a model and a grid."""
    model: str = "smollm2-135m"
    grid: str = "quick"
    retake_contended: int = 2  # times a scenario with a contended step is run again
    takes: int = 3  # engine starts whose steps' median is a row
    command: tuple[str, ...] = ()


def _seg_unique(n: int) -> list:
    return ["unique", n]


def build_scenarios(grid: VllmGrid, cfg: ModelConfig, *, block_size: int) -> list[dict]:
    """The scenarios of ``grid`` that fit its caps, warm-up first."""
    flop_per_token = 2.0 * cfg.num_layers * cfg.layer_params()
    kv_cap = grid.max_kv_gib * (1 << 30)
    kv_per_token = cfg.kv_bytes_per_token(DTYPE_BYTES)

    def fits(prompt_tokens: int, kv_tokens: int) -> bool:
        return (prompt_tokens * flop_per_token <= grid.max_prefill_gflop * 1e9
                and kv_tokens * kv_per_token <= 0.8 * kv_cap)

    out: list[dict] = [{"name": "warmup", "requests": [
        {"name": "w0", "prompt": [_seg_unique(32)], "max_tokens": 4}]}]
    steps = grid.decode_steps
    for b in grid.batch_sizes:
        for c in grid.contexts:
            if fits(b * c, b * (c + steps + block_size)):
                out.append({"name": f"decode-b{b}-c{c}", "requests": [
                    {"name": f"r{i}", "prompt": [_seg_unique(c)], "max_tokens": steps + 1} for i in range(b)]})
    for n in grid.prefill_tokens:
        for c in (0,) + tuple(grid.contexts[:: max(1, len(grid.contexts) - 1)]):
            cached = c // block_size * block_size  # only whole blocks are cached
            if c and not cached:
                continue
            if not fits(n + cached, n + cached + block_size):
                continue
            if not cached:
                out.append({"name": f"prefill-n{n}", "requests": [
                    {"name": "r0", "prompt": [_seg_unique(n)], "max_tokens": 1}]})
                continue
            # The first request fills the prefix; the second hits it and prefills only n tokens.
            out.append({"name": f"prefill-n{n}-cached{cached}", "requests": [
                {"name": "fill", "prompt": [["shared", f"p{n}-{cached}", cached]], "max_tokens": 1},
                {"name": "r0", "prompt": [["shared", f"p{n}-{cached}", cached], _seg_unique(n)], "max_tokens": 1,
                 "after_finish": "fill"}]})
    for b in grid.batch_sizes[1:]:
        for n in grid.prefill_tokens[:2]:
            c = grid.contexts[0]
            if not fits((b - 1) * c + n, (b - 1) * (c + 3 * steps) + n + b * block_size):
                continue
            # b-1 requests reach decode; then a prefill joins them: a mixed chunked-prefill step.
            warm = math.ceil((b - 1) * c / 4096) + 2
            reqs = [{"name": f"d{i}", "prompt": [_seg_unique(c)], "max_tokens": warm + 2 * steps} for i in range(b - 1)]
            reqs += [{"name": f"p{k}", "prompt": [_seg_unique(n)], "max_tokens": 2, "after_step": warm + k * 2}
                     for k in range(max(1, steps // 3))]
            out.append({"name": f"mixed-b{b}-n{n}-c{c}", "requests": reqs})
    return out


def batch_of(step: dict) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``(phase, ((num_new_tokens, num_cached_tokens), ...))`` of a recorded step, decodes first."""
    decodes = [(1, r["num_computed_before"]) for r in step["batch"] if r["decode"]]
    prefills = [(r["num_new_tokens"], r["num_computed_before"]) for r in step["batch"] if not r["decode"]]
    phase = "decode" if not prefills else ("prefill" if not decodes else "mixed")
    return phase, tuple(decodes + prefills)


def reference_median(times_s) -> float:
    """The median of one reference timing's repetitions, the first discarded as the probe rows'
    are; NaN when there is nothing after the first."""
    times = list(times_s or ())
    return float(np.median(times[1:])) if len(times) > 1 else float("nan")


def reference_medians(records: list[dict]) -> dict[str, float]:
    """Per scenario, the median of the reference GEMV timed before it (first repetition discarded,
    as the probe rows' are); the last record of a scenario run twice wins."""
    out = {}
    for rec in records:
        if rec.get("kind") == "reference" and len(rec.get("times_s") or ()) > 1:
            out[rec["scenario"]] = reference_median(rec["times_s"])
    return out


def step_reference(rec: dict, scenario_reference: dict[str, float]) -> float:
    """The machine phase of one step: the reference GEMV timed right before it (a worker that times
    one per step), else the one timed before its scenario (older workers), else NaN."""
    own = reference_median(rec.get("ref_times_s"))
    return own if own == own else scenario_reference.get(rec["scenario"], float("nan"))


def step_rows(records: list[dict], cfg: ModelConfig, static: dict) -> list[dict]:
    """Rows in the torch rows' schema (plus the vLLM fields) from the worker's step records."""
    rows = []
    reference = reference_medians(records)
    threads = static["num_threads"]
    ncpu = os.cpu_count() or 1
    for rec in records:
        if rec.get("kind") != "step" or rec["scenario"] == "warmup":
            continue
        phase, batch = batch_of(rec)
        wall = rec["t_end"] - rec["t_start"]
        if wall <= 0:
            continue
        share = rec["process_cpu_s"] / (wall * threads)
        load = max(rec["loadavg_1m_before"], rec["loadavg_1m_after"])
        point = GridPoint(phase, batch)
        row = {
            "key": f"{cfg.name}|vllm|fp32|{rec['scenario']}|step{rec['scenario_step']}", **static, "phase": phase,
            **point_features(cfg, point, DTYPE_BYTES),
            **wall_fields([wall]),
            "prep_s": float("nan"), "forward_s": float("nan"), "sampling_s": float("nan"),
            "forward_times_s": [], "sampling_times_s": [],
            # One engine thread: its CPU time is the process's (other threads idle), as torch rows count it.
            "thread_cpu_s": rec["process_cpu_s"] if threads == 1 else float("nan"),
            "thread_cpu_times_s": [rec["process_cpu_s"]] if threads == 1 else [],
            "process_cpu_s": rec["process_cpu_s"], "cpu_share": share,
            "ops_profiled": False, "ops_json": "{}", "op_sum_s": float("nan"), "op_sum_cpu_s": float("nan"),
            "op_profile_cpu_over_wall": float("nan"), "num_op_repeats": 0,
            "loadavg_1m_before": rec["loadavg_1m_before"], "loadavg_1m_after": rec["loadavg_1m_after"],
            "contended": is_contended(load_1m=load, num_cpus=ncpu, cpu_share=share),
            "scenario": rec["scenario"], "engine_step": rec["scenario_step"],
            "kv_free_blocks": rec["kv_free_blocks"], "kv_total_blocks": rec["kv_total_blocks"],
            "num_preempted": len(rec["preempted"]),
            # the machine phase the row was taken in (NaN: a worker without the reference)
            "ref_gemv_s": step_reference(rec, reference),
        }
        rows.append(row)
    return rows


def merge_takes(takes: list[list[dict]]) -> list[dict]:
    """One row per step key from the rows of several takes (:func:`step_rows` of each engine start).

    A row is the median over the takes that ran the same batch at that step (the first take's
    batch is the row's; a take whose scheduler chose another batch there is left out), quiet takes
    only when at least one is quiet. Times of every take kept go to ``wall_times_s`` and
    ``thread_cpu_times_s``; the load is the highest of them; ``contended`` only when no take was
    quiet. A key some take lacks (a scenario cut short) is merged from the takes that have it."""
    by_key: dict[str, list[dict]] = {}
    for take in takes:
        for row in take:
            by_key.setdefault(row["key"], []).append(row)
    merged = []
    for samples in by_key.values():
        first = samples[0]
        same = [r for r in samples if r["batch_json"] == first["batch_json"]]
        quiet = [r for r in same if not r["contended"]]
        use = quiet or same
        cpus = [r["thread_cpu_s"] for r in use]
        row = dict(first)
        row.update({
            **wall_fields([r["wall_s"] for r in use]),
            "thread_cpu_s": float(np.median(cpus)),
            "thread_cpu_times_s": [float(c) for c in cpus] if first["thread_cpu_times_s"] else [],
            "process_cpu_s": float(np.median([r["process_cpu_s"] for r in use])),
            "cpu_share": float(np.median([r["cpu_share"] for r in use])),
            "loadavg_1m_before": max(r["loadavg_1m_before"] for r in use),
            "loadavg_1m_after": max(r["loadavg_1m_after"] for r in use),
            "contended": not quiet,
            # takes whose scheduler chose this step's batch: every take on a deterministic scheduler,
            # whether or not a contended one was then left out of the median
            "num_takes_same_batch": len(same),
            "num_preempted": max(r["num_preempted"] for r in use),
            "ref_gemv_s": float(np.median([r["ref_gemv_s"] for r in use])),
            "created_utc": max(r["created_utc"] for r in use),
        })
        merged.append(row)
    return merged


def reference_spec() -> dict:
    """The reference GEMV the probe rows time beside themselves (torch_ops' shape, repetitions and
    cold pool of 2x the last-level cache), for the worker to time before each scenario."""
    from gpubench.backends.cpu.probes.torch_ops_grid import REFERENCE_REPS, REFERENCE_SHAPE
    from gpubench.backends.probe_common import cold_pool_bytes
    from gpubench.hostinfo import host_cpu

    return {"ref_n": REFERENCE_SHAPE[0], "ref_k": REFERENCE_SHAPE[1], "ref_reps": REFERENCE_REPS,
            "pool_bytes": cold_pool_bytes(host_cpu().llc_bytes)}


def _static_fields(cfg: ModelConfig, pc: VllmProfileConfig, grid_name: str, facts: dict, real_weights: bool) -> dict:
    """The fields every row of a vLLM profile shares: what ran, where, with which settings (the
    engine's as it reports them, ``facts``, where it did)."""
    return {
        "schema_version": SCHEMA_VERSION, "model": cfg.name, "device": "cpu", "device_type": "cpu",
        "device_name": cpu_model_name(), "host": platform.node(), "dtype": "fp32", "grid": grid_name,
        "num_threads": pc.threads, "torch_version": facts.get("torch_version"), "timer": "perf_counter",
        "command": " ".join(pc.command), "engine": "vllm", "vllm_version": facts.get("vllm_version"),
        "block_size": facts.get("block_size", pc.block_size),
        "token_budget": facts.get("max_num_batched_tokens", pc.max_num_batched_tokens),
        "max_num_seqs": facts.get("max_num_seqs", pc.max_num_seqs), "real_weights": real_weights,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_vllm_profile(cfg: ModelConfig, pc: VllmProfileConfig, out: Path, *,
                     progress: Callable[[int, int, str], None] | None = None) -> list[dict]:
    """Run the remaining scenarios of the grid in the vLLM worker; write all rows to ``out``."""
    from vllmref import env

    if pc.grid not in VLLM_GRIDS:
        raise ConfigError(f"--grid '{pc.grid}': use one of {', '.join(VLLM_GRIDS)} with --engine vllm")
    pc.check()
    if pc.takes < 1:
        raise ConfigError(f"--takes must be >= 1, got {pc.takes}")
    env.require_env()  # one line before anything starts when it is missing
    model_dir, real_weights, model_name = env.resolve_model(pc.model)
    grid = VLLM_GRIDS[pc.grid]
    scenarios = build_scenarios(grid, cfg, block_size=pc.block_size)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    existing = read_rows(out)
    done_keys = {r["key"] for r in existing}
    in_file = {k.split("|")[3] for k in done_keys if k.count("|") >= 4}
    by_name = {s["name"]: s for s in scenarios}

    def partial(t: int) -> Path:
        return out.with_name(f"{out.name}.vllm.take{t}.partial.jsonl")

    def take(names: list[str], what: str, out_path: Path | None) -> list[dict]:
        """One engine start's records for the warm-up and the scenarios ``names``."""
        chosen = [by_name["warmup"], *(by_name[n] for n in names if n != "warmup")]
        longest = max(sum(seg[-1] for seg in r["prompt"]) + r["max_tokens"] for s in chosen for r in s["requests"])
        spec = {"vocab_size": cfg.vocab_size, "scenarios": chosen, "reference": reference_spec(),
                "engine": pc.engine_spec(model_dir, real_weights=real_weights, longest_tokens=longest)}

        def on_line(line: str) -> None:
            if progress:
                num, _, rest = line.partition(" ")
                progress(int(num.split("/")[0]), len(chosen), f"{what}{rest}")

        return env.run_worker("worker_profile", spec, threads=pc.threads, kv_cache_gib=grid.max_kv_gib,
                              on_line=on_line, out_path=out_path)

    def takes_of(names: list[str], what: str, paths: list[Path] | None) -> list[list[dict]]:
        """``pc.takes`` engine starts over ``names``, each resumed from its partial file (``paths``)."""
        runs = []
        for t in range(pc.takes):
            records = env.read_records(paths[t]) if paths else []
            done = {r["scenario"] for r in records if r.get("kind") == "scenario_done"}
            todo = [n for n in names if n not in done]
            if todo:
                label = f"{what}take {t + 1}/{pc.takes}: " if pc.takes > 1 else what
                records += take(todo, label, paths[t] if paths else None)
            runs.append(records)
        return runs

    todo = [s["name"] for s in scenarios if s["name"] != "warmup" and s["name"] not in in_file]
    runs = takes_of(todo, "", [partial(t) for t in range(pc.takes)]) if todo else []
    facts: dict = next((r for records in runs for r in reversed(records) if r.get("kind") == "engine"), {})
    static = _static_fields(cfg, pc, grid.name, facts, real_weights)

    def rows_of(runs: list[list[dict]], static: dict) -> list[dict]:
        # A scenario cut short by a kill and run again records its steps twice in its take's
        # file: within a take the last run wins (step_rows' order), then the takes are merged.
        return merge_takes([list({r["key"]: r for r in step_rows(records, cfg, static)}.values()) for records in runs])

    rows = existing + [r for r in rows_of(runs, static) if r["key"] not in done_keys]
    # the partial files have served: the rows so far are kept, whatever the retakes do
    write_parquet(rows, out)
    for t in range(pc.takes):
        partial(t).unlink(missing_ok=True)
    for attempt in range(1, pc.retake_contended + 1):
        contended = contended_by_scenario(rows)
        names = sorted(n for n, count in contended.items() if count and n in by_name)
        if not names:
            break
        retaken = rows_of(takes_of(names, f"retake {attempt}/{pc.retake_contended} (contended): ", None),
                          {**static, "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        rows = keep_quieter_takes(rows, retaken)
        write_parquet(rows, out)
    return rows


def contended_by_scenario(rows: list[dict]) -> dict[str, int]:
    """Contended steps per scenario (0 for a quiet one)."""
    out: dict[str, int] = {}
    for r in rows:
        out[r["scenario"]] = out.get(r["scenario"], 0) + bool(r.get("contended"))
    return out


def keep_quieter_takes(rows: list[dict], retaken: list[dict]) -> list[dict]:
    """``rows`` with each scenario of ``retaken`` replaced, whole, where the retake has fewer
    contended steps (a take is kept or dropped as one: its steps share one engine's state)."""
    before, after = contended_by_scenario(rows), contended_by_scenario(retaken)
    better = {n for n, count in after.items() if n in before and count < before[n]}
    return [r for r in rows if r["scenario"] not in better] + [r for r in retaken if r["scenario"] in better]


def contention_summary(rows: list[dict]) -> tuple[int, int]:
    """``(contended rows, rows)``."""
    return sum(1 for r in rows if r.get("contended")), len(rows)
