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

from scheduling.workload.trace_synth import scaled_cpu_params, synthetic_jobs
from scheduling.workload.traces import Job, Turn, with_poisson_arrivals
from vllmref import env

if not env.is_ready():
    if os.environ.get("CI"):
        raise RuntimeError(f"CI must set up the vLLM environment first: {env.SETUP_HINT}")
    pytest.skip(f"the vLLM environment is not set up: {env.SETUP_HINT}", allow_module_level=True)

from scheduling.experiments.vllm_diff import DiffSettings, run_differentials  # noqa: E402


def scaled(n: int, seed: int, jps: float) -> list[Job]:
    return with_poisson_arrivals(synthetic_jobs(n, seed=seed, params=scaled_cpu_params()), jps, seed=seed)


def burst(n: int, group: str, system_tokens: int, turns: tuple[Turn, ...], t0: float, tag: str = "b",
          gap: float = 0.0) -> list[Job]:
    """``n`` jobs of one prefix group with the same turns, arriving ``gap`` seconds apart from ``t0``."""
    return [Job(f"{tag}{group}{i}", group, system_tokens, turns, t0 + gap * i) for i in range(n)]


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
    # Duplicate blocks (vLLM indexes every copy of a block under its hash). Identical prompts (the whole
    # prompt is the group's) in bursts: the copies of a burst are computed at once.
    "identical-burst": (burst(4, "g", 256, (Turn(0, 12),), 0.0) + burst(4, "g", 256, (Turn(0, 12),), 6.0, "c"),
                        DiffSettings(num_gpu_blocks=160, max_num_batched_tokens=512)),
    # Resent prompts ending on a block boundary: the hit is capped at known tokens - 1, so each resend
    # computes its last block again, a copy of the cached one.
    "boundary-resend": (burst(6, "h", 160, (Turn(0, 5, "bash", 1.0), Turn(16, 4)), 0.0, gap=2.5),
                        DiffSettings(num_gpu_blocks=100, max_num_batched_tokens=256)),
    # Both under pressure: copies evicted one by one and hit again in small pools, with preemption.
    "dup-eviction": (burst(5, "p", 128, (Turn(0, 20, "x", 0.5), Turn(32, 10)), 0.0, gap=0.7)
                     + burst(5, "q", 96, (Turn(0, 30),), 0.3, gap=1.1),
                     DiffSettings(num_gpu_blocks=40, max_num_batched_tokens=256, max_num_seqs=8)),
    "dup-eviction-b32": (burst(8, "r", 192, (Turn(0, 40, "x", 1.0), Turn(0, 20)), 0.0, gap=0.4),
                         DiffSettings(block_size=32, num_gpu_blocks=30, max_num_batched_tokens=512, max_num_seqs=6)),
    "dup-preempt": (burst(6, "s", 64, (Turn(0, 120, "x", 0.5), Turn(0, 60)), 0.0, gap=0.2),
                    DiffSettings(num_gpu_blocks=36, max_num_batched_tokens=256, max_num_seqs=8)),
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
    from scheduling.experiments.vllm_diff import compare_steps, sim_steps

    jobs, settings = CASES["admission-gate"]
    mismatches = compare_steps(sim_steps(jobs, settings, reserve_full_sequence=False), results["admission-gate"].vllm)
    assert mismatches and mismatches[0]["field"] in ("scheduled", "free_blocks", "free_queue")


DUPLICATE_CASES = ("identical-burst", "boundary-resend", "dup-eviction", "dup-eviction-b32", "dup-preempt")


@pytest.mark.parametrize("name", DUPLICATE_CASES)
def test_the_duplicate_block_scenarios_need_vllms_rule(results, name, monkeypatch):
    # A pool that keeps only the first copy of a hash cached (the simulator's rule before it
    # followed vLLM) must diverge from vLLM on each of these scenarios: they do exercise copies.
    from scheduling.engine import kv_manager
    from scheduling.engine.kv_cache import PyBlockPool
    from scheduling.experiments.vllm_diff import compare_steps, sim_steps

    class FirstCopyOnly(PyBlockPool):
        def cache_blocks(self, blocks, hashes, start, stop):
            for k in range(start, stop):
                if self.get_cached_block(hashes[k]) is None:
                    self.cache_block(blocks[k], hashes[k])

    monkeypatch.setattr(kv_manager, "BlockPool", FirstCopyOnly)
    jobs, settings = CASES[name]
    assert compare_steps(sim_steps(jobs, settings), results[name].vllm)


def random_scenario(seed: int) -> tuple[list[Job], DiffSettings]:
    """A small random workload of three prefix groups whose prompts often are the group's alone or
    end on a block boundary (so duplicate blocks are common), in a random pool and budget."""
    import random

    rng = random.Random(seed)
    bs = rng.choice([16, 16, 32])
    system = {"a": 8 * bs, "b": 5 * bs, "c": 3 * bs + 7}
    jobs = []
    for i in range(rng.randint(4, 12)):
        group = rng.choice("abc")
        turns = []
        for k in range(rng.randint(1, 3)):
            new_input = rng.choice([0, 0, bs, rng.randint(1, 3 * bs)]) if k else rng.choice([0, 0, rng.randint(1, 2 * bs)])
            turns.append(Turn(new_input, rng.randint(2, 60), "x", rng.random()))
        turns[-1] = Turn(turns[-1].input_tokens, turns[-1].output_tokens)
        jobs.append(Job(f"r{i}", group, system[group], tuple(turns), round(rng.random() * 6, 1)))
    blocks = max(-(-max(j.total_tokens() for j in jobs) // bs) + 2, rng.randint(20, 120))
    return jobs, DiffSettings(block_size=bs, num_gpu_blocks=blocks, max_num_batched_tokens=rng.choice([128, 256, 512]),
                              max_num_seqs=rng.choice([4, 8, 16]))


def test_random_scenarios_match_step_for_step():
    # 30 random workloads (seeds 1000-1029; with the first-copy-only pool 25 of them diverged).
    cases = [random_scenario(seed) for seed in range(1000, 1030)]
    for seed, res in zip(range(1000, 1030), run_differentials(cases)):
        assert res.mismatches == [] and res.fast_mismatches == [], (seed, res.first(1), res.fast_mismatches[:1])
        assert len(res.sim) == len(res.vllm) > 0
