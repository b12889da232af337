"""The simulator's scheduler against vLLM's real V1 scheduler, step for step (no model needed).

vLLM's ``Scheduler`` + ``KVCacheManager`` run in the vLLM environment with fabricated model
outputs (one sampled token per request that reaches the end of what it knows); the simulator runs
the same jobs with a constant 1 s step. Every step must schedule the same tokens for the same
requests (with the same context before the step), preempt the same requests, leave the same
number of free blocks and the same free queue, block id by block id.
"""
from __future__ import annotations

import os

import pytest

from scheduling.trace_synth import scaled_cpu_params, synthetic_jobs
from scheduling.traces import Job, Turn, with_poisson_arrivals
from vllmref import env

if not env.is_ready():
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must set up the vLLM environment first: {env.SETUP_HINT}")
    pytest.skip(f"the vLLM environment is not set up: {env.SETUP_HINT}", allow_module_level=True)

from scheduling.vllm_diff import DiffSettings, run_differentials  # noqa: E402


def scaled(n: int, seed: int, jps: float) -> list[Job]:
    return with_poisson_arrivals(synthetic_jobs(n, seed=seed, params=scaled_cpu_params()), jps, seed=seed)


CASES = {
    # Six jobs of one prefix group arriving 0.5 s apart: the system prompt's blocks are shared.
    "shared-prefix": ([Job(f"j{i}", "g", 200, (Turn(50 + 7 * i, 6),), 0.5 * i) for i in range(6)],
                      DiffSettings(num_gpu_blocks=200)),
    # Multi-turn agents whose later turns hit their own history.
    "multi-turn": (scaled(4, 1, 0.5), DiffSettings(num_gpu_blocks=400)),
    # Prompts of 1,800-2,100 tokens under a 256-token budget: chunked prefill over many steps.
    "chunked-prefill": ([Job(f"c{i}", f"g{i % 2}", 300, (Turn(1500, 4, "bash", 1.0), Turn(700, 3)), float(i))
                         for i in range(3)], DiffSettings(num_gpu_blocks=600, max_num_batched_tokens=256)),
    # A pool that evicts between turns, in 128-token blocks (vLLM's CPU default).
    "evict-b128": (scaled(10, 6, 2.0), DiffSettings(block_size=128, num_gpu_blocks=20, max_num_batched_tokens=4096,
                                                    max_num_seqs=256)),
    # max_num_seqs caps the running set.
    "max-num-seqs": (scaled(10, 7, 10.0), DiffSettings(num_gpu_blocks=400, max_num_batched_tokens=2048, max_num_seqs=3)),
    # Long outputs outgrow the pool: preemption by recompute, then resume.
    "preempt-resume": ([Job(f"d{i}", "g", 100, (Turn(100 + 10 * i, 300, "bash", 1.0), Turn(50, 100)), 0.3 * i)
                        for i in range(6)], DiffSettings(num_gpu_blocks=100, max_num_batched_tokens=512, max_num_seqs=16)),
    "preempt-resume-b32": ([Job(f"e{i}", f"g{i % 2}", 150, (Turn(80, 250, "bash", 2.0), Turn(40, 120, "x", 0.5),
                                                             Turn(30, 60)), 0.2 * i) for i in range(8)],
                           DiffSettings(block_size=32, num_gpu_blocks=45, max_num_batched_tokens=256, max_num_seqs=16)),
    # Many arrivals at once into a pool the full-sequence admission gate must hold back.
    "admission-gate": (scaled(12, 5, 20.0), DiffSettings(num_gpu_blocks=170, max_num_batched_tokens=1024,
                                                          max_num_seqs=16)),
}


@pytest.fixture(scope="module")
def results():
    names = list(CASES)
    return dict(zip(names, run_differentials([CASES[n] for n in names])))


@pytest.mark.parametrize("name", list(CASES))
def test_every_step_is_identical(results, name):
    res = results[name]
    assert len(res.vllm) > 0 and len(res.sim) == len(res.vllm)
    assert res.mismatches == [], f"{res.num_mismatching_steps} mismatching steps; first: {res.first(2)}"
    # the same with the decode group as replays run it: one decode path, vLLM's steps either way
    assert len(res.sim_fast) == len(res.vllm)
    assert res.fast_mismatches == [], f"decode group: first mismatches {res.fast_mismatches[:2]}"


def test_the_decode_group_takes_part(results):
    # Most steps of every scenario are scheduled with decoding requests in the decode group (3,152
    # of 3,218 when written), so the comparison above covers that path, not only the exact loop.
    for name, res in results.items():
        assert res.num_fast_steps > len(res.vllm) / 3, name


def test_the_scenarios_cover_what_they_claim(results):
    def preemptions(name):
        return sum(len(s.preempted) for s in results[name].vllm)

    def chunked(name):
        return any(n > 1 and before > 0 and [job, turn, n, before] for s in results[name].vllm
                   for job, turn, n, before in s.scheduled if n == 256)

    def hit_turns(name):
        firsts = {}
        for s in results[name].vllm:
            for job, turn, n, before in s.scheduled:
                firsts.setdefault((job, turn), before)
        return sum(1 for v in firsts.values() if v > 0)

    assert preemptions("preempt-resume") > 0 and preemptions("preempt-resume-b32") > 0
    assert chunked("chunked-prefill")
    assert hit_turns("shared-prefix") == 5 and hit_turns("multi-turn") > 4
    assert max(len(s.scheduled) for s in results["max-num-seqs"].vllm) == 3


def test_a_divergence_is_caught(results):
    # Admitting on the first chunk alone (vLLM before scheduler_reserve_full_isl) over-admits here:
    # the comparison must see it.
    from scheduling.vllm_diff import compare_steps, sim_steps

    jobs, settings = CASES["admission-gate"]
    mismatches = compare_steps(sim_steps(jobs, settings, reserve_full_sequence=False), results["admission-gate"].vllm)
    assert mismatches and mismatches[0]["field"] in ("scheduled", "free_blocks", "free_queue")
