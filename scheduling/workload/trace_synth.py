"""Synthetic software-engineering agents: tool-time models, the generator and its presets, and the
public SWE-smith statistics it is calibrated to.

Separate from :mod:`scheduling.workload.traces`, which owns the job schema and its file format: this module
only makes jobs (seeded, see :func:`synthetic_jobs`) and measures traces (:func:`trace_stats`)
against ``SWE_SMITH_TARGETS``. Its tool-time models also give SWE-smith trajectories, which carry
no timestamps, their tool gaps (:mod:`scheduling.workload.swesmith`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from scheduling.workload.traces import Job, Turn

__all__ = [
    "ToolTimeModel", "DEFAULT_TOOL_MODELS", "LONG_TOOL_MODELS", "DEFAULT_TOOL_MIX", "SyntheticParams",
    "scaled_cpu_params", "long_context_params", "PRESETS", "synthetic_jobs", "SWE_SMITH_TARGETS", "trace_stats",
]

@dataclass(frozen=True)
class ToolTimeModel:
    """Duration of one tool call: a lognormal body mixed with a Pareto tail.

    With probability ``1 - tail_prob`` the duration is lognormal with median ``median_s`` and
    log-standard-deviation ``sigma``; with probability ``tail_prob`` it is Pareto (type I) with
    scale ``tail_scale_s`` and shape ``tail_alpha`` (heavy tail of long tests/builds), clipped at
    ``max_s``.
    """

    median_s: float
    sigma: float
    tail_prob: float = 0.0
    tail_scale_s: float = 30.0
    tail_alpha: float = 1.5
    max_s: float = 900.0

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        body = rng.lognormal(math.log(self.median_s), self.sigma, size=size)
        if self.tail_prob > 0:
            tail = self.tail_scale_s * (1.0 + rng.pareto(self.tail_alpha, size=size))
            body = np.where(rng.random(size) < self.tail_prob, tail, body)
        return np.minimum(body, self.max_s)


# Per-tool duration models. Bodies: lognormal medians between 0.1 and 0.6 s, as public agent traces
# show for tool calls. Tails: a few calls of `test`, `bash` and `python` run for 1-10 minutes (test
# suites, builds, installs); they are rare (0.5-2 % of calls) but hold about half of all tool time,
# the "large share of tool time in calls of 1-10 minutes" the same traces report, while the mean
# call stays near 1 s (so a 43-turn job waits ~45 s on tools, not minutes).
DEFAULT_TOOL_MODELS: dict[str, ToolTimeModel] = {
    "view": ToolTimeModel(median_s=0.10, sigma=0.6),
    "search": ToolTimeModel(median_s=0.25, sigma=0.8, tail_prob=0.005, tail_scale_s=5.0),
    "edit": ToolTimeModel(median_s=0.12, sigma=0.5),
    "bash": ToolTimeModel(median_s=0.40, sigma=1.0, tail_prob=0.005, tail_scale_s=60.0, tail_alpha=1.5, max_s=600.0),
    "test": ToolTimeModel(median_s=0.60, sigma=1.0, tail_prob=0.02, tail_scale_s=60.0, tail_alpha=1.5, max_s=600.0),
    "python": ToolTimeModel(median_s=0.50, sigma=1.0, tail_prob=0.005, tail_scale_s=60.0, tail_alpha=1.5, max_s=600.0),
    "submit": ToolTimeModel(median_s=0.20, sigma=0.4),
}
# The tool models of the long-context agent (`swe-long`): heavier tails (5-15 % of bash/test/python
# calls past 20-30 s, clipped at 15 minutes).
LONG_TOOL_MODELS: dict[str, ToolTimeModel] = {
    **DEFAULT_TOOL_MODELS,
    "search": ToolTimeModel(median_s=0.25, sigma=0.8, tail_prob=0.01, tail_scale_s=5.0),
    "bash": ToolTimeModel(median_s=0.40, sigma=1.2, tail_prob=0.05, tail_scale_s=20.0, tail_alpha=1.3),
    "test": ToolTimeModel(median_s=0.60, sigma=1.3, tail_prob=0.15, tail_scale_s=30.0, tail_alpha=1.2),
    "python": ToolTimeModel(median_s=0.50, sigma=1.2, tail_prob=0.06, tail_scale_s=20.0, tail_alpha=1.3),
}
DEFAULT_TOOL_MIX: dict[str, float] = {
    "view": 0.28, "bash": 0.22, "edit": 0.20, "search": 0.12, "test": 0.10, "python": 0.08,
}


@dataclass(frozen=True)
class SyntheticParams:
    """Distributions of the synthetic software-engineering agent (all seeded; see docs/traces.md).

    The defaults are calibrated to public SWE-smith trajectory statistics (per job: median 43
    turns, ~142K prompt tokens summed over its turns, ~1.1K output tokens, so input:output ~131:1)
    and to public agent traces for tool times (medians 0.1-0.6 s, a heavy tail);
    :func:`long_context_params` is an agent whose contexts reach tens of thousands of tokens.

    Turns per job: negative binomial with mean ``turns_mean`` and dispersion ``turns_dispersion``
    (variance = mean + mean²/dispersion), clipped to [``turns_min``, ``turns_max``].
    System prompt: ``num_prefix_groups`` groups, each with a fixed size drawn uniformly from
    [``system_tokens_min``, ``system_tokens_max``]; a job joins a group uniformly at random.
    Turn 0's input (the task statement): lognormal, median ``task_tokens_median``, sigma ``task_sigma``.
    Later inputs (observations): lognormal, median ``obs_tokens_median``, sigma ``obs_sigma``,
    clipped to [``obs_tokens_min``, ``obs_tokens_max``].
    Outputs: lognormal, median ``out_tokens_median``, sigma ``out_sigma``, clipped to
    [``out_tokens_min``, ``out_tokens_max``].
    Tools: drawn from ``tool_mix`` (weights); durations from ``tool_models`` (per tool name). The
    last turn has no tool; with ``end_with_submit`` the turn before it calls ``submit``.
    """

    turns_mean: float = 47.0
    turns_dispersion: float = 3.0
    turns_min: int = 3
    turns_max: int = 120
    num_prefix_groups: int = 4
    system_tokens_min: int = 600
    system_tokens_max: int = 1400
    task_tokens_median: float = 350.0
    task_sigma: float = 0.5
    obs_tokens_median: float = 36.0
    obs_sigma: float = 1.1
    obs_tokens_min: int = 4
    obs_tokens_max: int = 12000
    out_tokens_median: float = 22.0
    out_sigma: float = 0.6
    out_tokens_min: int = 4
    out_tokens_max: int = 2000
    tool_mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOOL_MIX))
    tool_models: dict[str, ToolTimeModel] = field(default_factory=lambda: dict(DEFAULT_TOOL_MODELS))
    end_with_submit: bool = True

    def __hash__(self) -> int:  # dict fields: hash by value so params can key caches
        return hash(json.dumps(asdict(self), sort_keys=True, default=str))


def scaled_cpu_params() -> SyntheticParams:
    """A software-engineering agent scaled down to what a real engine on 2 CPU cores replays in minutes.

    The shape of the default agent (a shared system prompt per group, a task, then observations and
    short outputs, a tool gap after each turn) at about 1/10 of its size: 3-8 turns, system prompts
    of 256-512 tokens, observations of ~120 tokens, outputs of ~16 tokens, and tool gaps of about a
    second (no minute-long tail: a live replay waits them out in real time). Contexts reach a few
    thousand tokens, so a pool of a few dozen 128-token blocks evicts during tool gaps.
    """
    quick = {name: ToolTimeModel(median_s=median, sigma=0.4, max_s=4.0) for name, median in
             (("view", 0.6), ("search", 0.8), ("edit", 0.6), ("bash", 1.2), ("test", 1.8), ("python", 1.0), ("submit", 0.3))}
    return SyntheticParams(turns_mean=5.0, turns_dispersion=6.0, turns_min=3, turns_max=8, num_prefix_groups=2,
                           system_tokens_min=256, system_tokens_max=512, task_tokens_median=200.0, task_sigma=0.3,
                           obs_tokens_median=120.0, obs_sigma=0.6, obs_tokens_min=16, obs_tokens_max=600,
                           out_tokens_median=16.0, out_sigma=0.4, out_tokens_min=4, out_tokens_max=48,
                           tool_models={**DEFAULT_TOOL_MODELS, **quick})


def long_context_params() -> SyntheticParams:
    """A long-context software-engineering agent: ~5x the default's summed prompt per job.

    System prompts of 2-5K tokens, observations of ~350 tokens (p90 ~1.3K), outputs of ~170
    tokens and heavier tool tails (:data:`LONG_TOOL_MODELS`): contexts reach a median of ~29K
    tokens per job (tails past 100K), the regime of agents that read whole files. This was the
    project's default before the defaults were calibrated to SWE-smith.
    """
    return SyntheticParams(turns_mean=38.0, system_tokens_min=2000, system_tokens_max=5000, task_tokens_median=600.0,
                           obs_tokens_median=350.0, obs_sigma=1.0, obs_tokens_min=20, out_tokens_median=170.0,
                           out_sigma=0.5, out_tokens_min=8, tool_models=dict(LONG_TOOL_MODELS))


PRESETS = {"swe": SyntheticParams, "swe-long": long_context_params, "scaled-cpu": scaled_cpu_params}


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, size: int, lo: int, hi: int) -> np.ndarray:
    vals = rng.lognormal(math.log(median), sigma, size=size)
    return np.clip(np.rint(vals), lo, hi).astype(np.int64)


def synthetic_jobs(n: int, seed: int, params: SyntheticParams | None = None, *, id_prefix: str = "syn") -> list[Job]:
    """``n`` seeded synthetic software-engineering-agent jobs (arrival_s = 0; see with_poisson_arrivals).

    The same (n, seed, params) always gives the same jobs; job i does not depend on n (each job
    draws from its own child stream), so a longer trace extends a shorter one.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    p = params or SyntheticParams()
    group_rng = np.random.default_rng([int(seed), 0])
    group_sizes = group_rng.integers(p.system_tokens_min, p.system_tokens_max + 1, size=p.num_prefix_groups)
    tools = sorted(p.tool_mix)
    weights = np.array([p.tool_mix[t] for t in tools], dtype=float)
    weights /= weights.sum()
    unknown = [t for t in tools + (["submit"] if p.end_with_submit else []) if t not in p.tool_models]
    if unknown:
        raise ValueError(f"tool_mix names tools without a duration model: {unknown}")
    jobs = []
    for i in range(n):
        rng = np.random.default_rng([int(seed), 1, i])
        # Negative binomial via numpy's (r, p) parametrization: mean = r(1-p)/p.
        r = p.turns_dispersion
        prob = r / (r + p.turns_mean)
        num_turns = int(np.clip(rng.negative_binomial(r, prob), p.turns_min, p.turns_max))
        group = int(rng.integers(p.num_prefix_groups))
        inputs = _lognormal_int(rng, p.obs_tokens_median, p.obs_sigma, num_turns, p.obs_tokens_min, p.obs_tokens_max)
        inputs[0] = _lognormal_int(rng, p.task_tokens_median, p.task_sigma, 1, p.obs_tokens_min, p.obs_tokens_max)[0]
        outputs = _lognormal_int(rng, p.out_tokens_median, p.out_sigma, num_turns, p.out_tokens_min, p.out_tokens_max)
        tool_idx = rng.choice(len(tools), size=num_turns, p=weights)
        turn_tools: list[str | None] = [tools[j] for j in tool_idx]
        if p.end_with_submit and num_turns >= 2:
            turn_tools[num_turns - 2] = "submit"
        turn_tools[-1] = None
        durations = np.zeros(num_turns)
        for name in sorted(set(t for t in turn_tools if t is not None)):  # sorted: set order varies by process
            mask = np.array([t == name for t in turn_tools])
            durations[mask] = p.tool_models[name].sample(rng, int(mask.sum()))
        turns = tuple(
            Turn(int(inputs[k]), int(outputs[k]), turn_tools[k], round(float(durations[k]), 6))
            for k in range(num_turns)
        )
        jobs.append(Job(f"{id_prefix}-{seed}-{i:05d}", f"g{group}", int(group_sizes[group]), turns))
    return jobs


# Public SWE-smith trajectory statistics the default agent is calibrated to (per job: turns, prompt
# tokens summed over its turns, output tokens, their ratio) and the public tool-time medians.
SWE_SMITH_TARGETS: dict[str, tuple[float, float]] = {
    # statistic of trace_stats: (low, high) of what the public statistics give
    "turns_median": (40.0, 46.0),                      # ~43 turns per trajectory
    "job_prompt_tokens_median": (125_000.0, 160_000.0),  # ~142K prompt tokens summed per job
    "job_output_tokens_median": (950.0, 1_250.0),      # ~1.1K output tokens per job
    "job_input_to_output_median": (115.0, 150.0),      # ~131 : 1
    "tool_s_median": (0.1, 0.6),                       # tool-call medians 0.1-0.6 s
}


def trace_stats(jobs: Sequence[Job]) -> dict[str, float]:
    """Summary statistics of a trace (turns, tokens, tool times) for docs and sanity checks."""
    turns = np.array([j.num_turns for j in jobs])
    ins = np.array([t.input_tokens for j in jobs for t in j.turns[1:]] or [0])
    outs = np.array([t.output_tokens for j in jobs for t in j.turns])
    gaps = np.array([t.tool_s for j in jobs for t in j.turns if t.tool is not None] or [0.0])
    ctx = np.array([j.total_tokens() for j in jobs])
    total_in = sum(j.system_tokens + sum(t.input_tokens for t in j.turns) for j in jobs)
    prompt_sum = sum(j.prompt_tokens(k) for j in jobs for k in range(j.num_turns))
    long_gap_share = float(gaps[gaps >= 60].sum() / gaps.sum()) if gaps.sum() > 0 else 0.0
    per_job_prompt = np.array([sum(j.prompt_tokens(k) for k in range(j.num_turns)) for j in jobs])
    per_job_output = np.array([sum(t.output_tokens for t in j.turns) for j in jobs])
    per_job_tool = np.array([sum(t.tool_s for t in j.turns) for j in jobs])
    return {
        "num_jobs": len(jobs),
        "turns_median": float(np.median(turns)), "turns_mean": float(turns.mean()),
        "job_prompt_tokens_median": float(np.median(per_job_prompt)),
        "job_output_tokens_median": float(np.median(per_job_output)),
        "job_input_to_output_median": float(np.median(per_job_prompt / per_job_output)),
        "job_tool_s_mean": float(per_job_tool.mean()), "tool_s_mean": float(gaps.mean()),
        "turns_min": int(turns.min()), "turns_max": int(turns.max()),
        "obs_tokens_median": float(np.median(ins)), "obs_tokens_p90": float(np.percentile(ins, 90)),
        "out_tokens_median": float(np.median(outs)), "out_tokens_mean": float(outs.mean()),
        "final_context_median": float(np.median(ctx)), "final_context_p90": float(np.percentile(ctx, 90)),
        "final_context_max": int(ctx.max()),
        "prompt_to_output_ratio": float(prompt_sum / max(1, outs.sum())),
        "new_input_to_output_ratio": float(total_in / max(1, outs.sum())),
        "tool_s_median": float(np.median(gaps)), "tool_s_p90": float(np.percentile(gaps, 90)),
        "tool_s_p99": float(np.percentile(gaps, 99)), "tool_s_max": float(gaps.max()),
        "tool_time_share_ge_60s": long_gap_share,
    }
