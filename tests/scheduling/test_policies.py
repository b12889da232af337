"""KV policies on hand-checkable scenarios (real engine, constant step cost), TTL rules, factory."""
import math

import pytest

from gpubench.errors import ConfigError
from scheduling.engine import TURN_COLUMNS, Engine, EngineConfig
from scheduling.policies import ContinuumParams, make_policy, param_names
from scheduling.policies.continuum import ContinuumPolicy
from scheduling.step_cost import ConstantStepCost
from scheduling.traces import Job, Turn


def job(job_id, turns, *, system=0, group=None, arrival=0.0):
    ts = tuple(Turn(i, o, "bash" if k < len(turns) - 1 else None, g if k < len(turns) - 1 else 0.0)
               for k, (i, o, g) in enumerate(turns))
    return Job(job_id, group or job_id, system, ts, arrival)


def run(jobs, num_blocks, policy, params=None, cost=0.01, **cfg):
    e = Engine(jobs, EngineConfig(num_gpu_blocks=num_blocks, **cfg), make_policy(policy, params), ConstantStepCost(cost))
    res = e.run()
    e.pool.check_invariants()
    return e, [dict(zip(TURN_COLUMNS, t)) for t in res.turns], res


# Job "a": a 1600-token prompt, 16 output tokens (1615 computed -> 100 full blocks + 1 partial),
# then a 1 s tool call and a second turn. While "a" waits for its tool, "b" runs and finishes
# (its freed blocks go to the LRU tail *after* a's), then "c" needs 101 blocks. The pool has 250.
# As in vLLM, a freed block without a hash (a's and b's partial last block) goes to the *head* of
# the free queue, a block with one to the tail:
#   fcfs:      free queue = b's partial, a's partial, 48 never-used blocks, a's 100 full (tail
#              first), b's 100 -> c takes 50 + 51 of a's full blocks, a keeps its first 49 ->
#              turn 1 hits 49 * 16 = 784 tokens;
#   continuum: a's 101 blocks are pinned (TTL 5 s > 1 s gap) -> c takes b's blocks instead ->
#              turn 1 hits all 100 full blocks = 1600 tokens.
TTL_SCENARIO = [
    job("a", [(1600, 16, 1.0), (16, 16, 0)]),
    job("b", [(1600, 16, 0)], arrival=0.3),
    job("c", [(1600, 16, 0)], arrival=0.6),
]


def test_continuum_keeps_the_whole_prefix_across_a_short_tool_gap_fcfs_recomputes():
    _, fcfs, _ = run(TTL_SCENARIO, 250, "fcfs")
    _, cont, _ = run(TTL_SCENARIO, 250, "continuum", {"ttl_rule": "fixed", "ttl_s": 5.0})
    a1_fcfs = next(t for t in fcfs if t["job_id"] == "a" and t["turn"] == 1)
    a1_cont = next(t for t in cont if t["job_id"] == "a" and t["turn"] == 1)
    assert a1_cont["hit_tokens"] == 1600 and a1_cont["computed_tokens"] == 1632 - 1600
    assert a1_fcfs["hit_tokens"] == 784 and a1_fcfs["computed_tokens"] == 1632 - 784


def test_continuum_pin_expires_when_the_tool_outlasts_the_ttl():
    _, cont, res = run(TTL_SCENARIO, 250, "continuum", {"ttl_rule": "fixed", "ttl_s": 0.2})
    a1 = next(t for t in cont if t["job_id"] == "a" and t["turn"] == 1)
    assert a1["hit_tokens"] == 784  # pin released at its deadline (0.2 s < 1 s gap): like fcfs
    assert res.policy_stats["num_pin_expired"] == 1 and res.policy_stats["num_pin_hits"] == 0


def workload(n=6, turns=4, gap_s=0.5):
    return [job(f"j{i}", [(400 if k == 0 else 120, 24, gap_s) for k in range(turns)], system=256, group="g",
                arrival=0.2 * i) for i in range(n)]


def test_pool_larger_than_the_workload_makes_policies_equal_up_to_store_costs():
    jobs = workload()
    free_lmcache = {"store_chunk_s": 0.0, "retrieve_chunk_s": 0.0, "store_gbs": math.inf, "retrieve_gbs": math.inf}
    runs = {p: run(jobs, 5000, p)[1] for p in ("fcfs", "continuum", "cpu-offload")}
    runs["lmcache-free"] = run(jobs, 5000, "lmcache", free_lmcache)[1]
    _, lm, lm_res = run(jobs, 5000, "lmcache")
    base = runs["fcfs"]
    for name, turns in runs.items():
        assert [t["hit_tokens"] for t in turns] == [t["hit_tokens"] for t in base], name
        assert [t["finish_s"] for t in turns] == pytest.approx([t["finish_s"] for t in base]), name
    # with real store costs lmcache hits the same tokens; each turn ends within the total store
    # time of its fcfs twin (the stores shift steps, so batching differs slightly)
    assert [t["hit_tokens"] for t in lm] == [t["hit_tokens"] for t in base]
    store_s = lm_res.policy_stats["store_s"]
    assert store_s > 0
    assert max(abs(a["finish_s"] - b["finish_s"]) for a, b in zip(lm, base)) <= store_s


def test_undersized_cpu_pool_thrashes():
    # A GPU pool that cannot keep 6 histories: prefixes are lost during tool gaps; the host pool
    # recovers them when it holds every job's history (~60 blocks each) and fails when it holds
    # only a few jobs' worth (LRU over a cyclic pattern of jobs).
    jobs = workload(n=6, turns=6, gap_s=0.3)
    block_gib = 16 * 131072 / 2**30
    hit = {}
    for gib_blocks in (2000, 60):
        _, turns, res = run(jobs, 140, "cpu-offload", {"cpu_gib": gib_blocks * block_gib})
        miss = sum(t["prompt_tokens"] - t["hit_tokens"] for t in turns)
        hit[gib_blocks] = sum(t["pool_hit_tokens"] for t in turns) / miss
        for t in turns:
            assert t["hit_tokens"] + t["pool_hit_tokens"] + t["computed_tokens"] == t["prompt_tokens"]
    assert hit[2000] > 0.5
    assert hit[60] < 0.5 * hit[2000]


def test_cpu_offload_load_waits_for_the_host_link():
    # The TTL scenario: c evicts 53 of a's GPU blocks; the host pool has them all (1 GiB).
    _, turns, res = run(TTL_SCENARIO, 250, "cpu-offload", {"cpu_gib": 1.0, "link_gbs": 1.0})
    a1 = next(t for t in turns if t["job_id"] == "a" and t["turn"] == 1)
    assert a1["hit_tokens"] == 784 and a1["pool_hit_tokens"] == 1600 - 784
    # 52 blocks x 2 MiB over 1 GB/s ~ 0.109 s of waiting before the first token
    load_s = 52 * 16 * 131072 / 1e9
    assert a1["ttft_s"] >= load_s


def test_lmcache_stores_only_full_chunks_and_retrieves_them():
    _, turns, res = run(TTL_SCENARIO, 250, "lmcache")
    a1 = next(t for t in turns if t["job_id"] == "a" and t["turn"] == 1)
    # a's turn-0 prompt (1600 tokens) -> 6 full 256-token chunks (1536 tokens) stored
    assert a1["hit_tokens"] == 784 and a1["pool_hit_tokens"] == 1536 - 784
    assert res.policy_stats["retrieved_chunks"] == 3  # chunks 3, 4, 5 (tokens 768..1535)


# --- TTL rules -----------------------------------------------------------------------------------
def attached(params):
    pol = ContinuumPolicy(ContinuumParams(**params))
    Engine([], EngineConfig(num_gpu_blocks=8, max_num_batched_tokens=8192), pol, ConstantStepCost(1.0))
    return pol


def observe(pol, tool, durations):
    for d in durations:
        pol._tool_samples.setdefault(tool, __import__("collections").deque(maxlen=256)).append(d)
        pol._tool_sum[tool] = pol._tool_sum.get(tool, 0.0) + d
        pol._tool_count[tool] = pol._tool_count.get(tool, 0) + 1


def test_ttl_fixed_and_tool_mean():
    assert attached({"ttl_rule": "fixed", "ttl_s": 3.0}).ttl_s("bash", 100) == 3.0
    pol = attached({"ttl_rule": "tool-mean", "ttl_s": 2.0, "tool_mean_threshold_s": 1.5})
    assert pol.ttl_s("bash", 100) == 2.0  # no samples: prior mean 1 s <= 1.5
    observe(pol, "bash", [0.2, 0.4])
    observe(pol, "pytest", [30.0, 50.0])
    assert pol.ttl_s("bash", 100) == 2.0 and pol.ttl_s("pytest", 100) == 0.0


def test_ttl_expected_benefit():
    pol = attached({"ttl_rule": "expected-benefit", "min_samples": 5, "prior_mean_s": 1.0})
    # reload of 16384 tokens = 2 budget-sized chunks x 1 s; no queueing seen yet -> V = 2 s
    assert pol.engine.estimate_prefill_s(16384) == 2.0
    # prior (exponential, mean 1 s): argmax F(t)·V − t = ln(V) = 0.693 s
    assert pol.ttl_s("bash", 16384) == pytest.approx(math.log(2.0))
    assert pol.ttl_s("bash", 100) == 0.0  # V = 1 s reload <= prior mean: no pin
    observe(pol, "bash", [0.5, 0.5, 0.5, 0.5, 10.0])
    # candidates: 0.5 -> 0.8·2 − 0.5 = 1.1 ; 10 -> 2 − 10 < 0 ; 0 -> 0
    assert pol.ttl_s("bash", 16384) == 0.5


# --- factory -------------------------------------------------------------------------------------
def test_factory_names_and_parameters():
    assert make_policy("fcfs").name == "fcfs"
    assert make_policy("cpu-offload", {"cpu_gib": 4}).p.cpu_gib == 4
    assert "ttl_rule" in param_names("continuum")
    with pytest.raises(ConfigError, match="unknown policy 'fifo'"):
        make_policy("fifo")
    with pytest.raises(ConfigError, match="no parameter"):
        make_policy("lmcache", {"chunk": 3})
    with pytest.raises(ConfigError, match="takes no parameters"):
        make_policy("fcfs", {"x": 1})
    with pytest.raises(ConfigError, match="unknown TTL rule"):
        make_policy("continuum", {"ttl_rule": "forever"})


@pytest.mark.parametrize("impl", ["compiled", "python"])
def test_cpu_pool_store_equals_block_by_block_lru(impl):
    import random
    from types import SimpleNamespace

    from scheduling import kv_cache
    from scheduling.policies.cpu_offload import CPUOffloadPolicy

    lru = kv_cache.HashLRU if impl == "compiled" else kv_cache.PyHashLRU
    if impl == "compiled":
        assert kv_cache.COMPILED
    rng = random.Random(0)
    for trial in range(200):
        cap = rng.randint(0, 30)
        pol = CPUOffloadPolicy()
        pol._capacity_blocks = cap
        pol._pool = lru(cap)
        ref: dict = {}
        for _ in range(10):
            chain = list(dict.fromkeys(rng.randint(-80, 80) * 7919 ** 3 for _ in range(rng.randint(0, 60))))
            n = rng.randint(0, len(chain))
            req = SimpleNamespace(num_cached_blocks=n, job_state=SimpleNamespace(hashes=chain))
            stored = pol.num_stored_blocks
            pol.on_turn_finish(req, 0.0)
            # net counters: new = not held when the turn ended (even if evicted and re-inserted on the way)
            assert pol.num_stored_blocks - stored == sum(1 for h in chain[:n] if h not in ref)
            for h in chain[:n]:  # the LRU written out: refresh or insert, evict the oldest
                ref.pop(h, None)
                ref[h] = None
                if len(ref) > cap:
                    del ref[next(iter(ref))]
            assert pol._pool.keys() == list(ref), trial
            first = rng.randint(0, len(chain))
            run = 0
            while first + run < len(chain) and chain[first + run] in ref:
                run += 1
            assert pol._pool.count_prefix(chain, first, len(chain)) == run
            if run:
                pol._pool.refresh(chain, first, run)
                for h in chain[first:first + run]:
                    del ref[h]
                    ref[h] = None
                assert pol._pool.keys() == list(ref)
        assert pol.num_stored_blocks - pol.num_evicted_blocks == len(pol._pool)
