"""KV policies on hand-checkable scenarios (real engine, constant step cost), TTL rules, factory."""
import math

import pytest

from common.errors import ConfigError
from scheduling.engine import Engine, EngineConfig
from scheduling.engine.step_cost import ConstantStepCost
from scheduling.policies import ContinuumParams, make_policy, param_names
from scheduling.policies.continuum import ContinuumPolicy
from tests.conftest import job, run_engine, turn_dicts


def run(jobs, num_blocks, policy, params=None, cost=0.01, **cfg):
    e, res = run_engine(jobs, num_blocks, policy, params, cost, **cfg)
    return e, turn_dicts(res), res


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
    assert pol.ctx.estimate_prefill_s(16384) == 2.0
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

    from scheduling.engine import kv_cache
    from scheduling.policies.cpu_offload import CPUOffloadParams, HostBlockPool

    lru = kv_cache.HashLRU if impl == "compiled" else kv_cache.PyHashLRU
    if impl == "compiled":
        assert kv_cache.COMPILED
    rng = random.Random(0)
    for trial in range(200):
        cap = rng.randint(0, 30)
        pol = HostBlockPool(CPUOffloadParams())
        pol.capacity_blocks = cap
        pol._pool = lru(cap)
        pol._block_bytes, pol._bytes_per_s = 1, 1e9
        ref: dict = {}
        for _ in range(10):
            chain = list(dict.fromkeys(rng.randint(-80, 80) * 7919 ** 3 for _ in range(rng.randint(0, 60))))
            n = rng.randint(0, len(chain))
            req = SimpleNamespace(num_cached_blocks=n, job_state=SimpleNamespace(hashes=chain), first_scheduled_s=0.0)
            stored = pol.num_stored_blocks
            pol.store(req, 0.0)
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


# --- honest offload costs -------------------------------------------------------------------------
def test_lazy_store_holds_gpu_blocks_until_the_copy_ends_eager_overlaps_it():
    # Job a alone: 100 full blocks of 2 MiB stored after turn 0, 2 more after turn 1. Each copy
    # takes the per-transfer latency plus bytes over 80 % of the 64 GB/s link.
    alone = TTL_SCENARIO[:1]
    copy_s = 2 * 50e-6 + 102 * 16 * 131072 / (64e9 * 0.8)
    _, _, lazy = run(alone, 250, "cpu-offload", {"store": "lazy"})
    _, _, eager = run(alone, 250, "cpu-offload", {"store": "eager"})
    assert lazy.policy_stats["store_link_busy_s"] == pytest.approx(copy_s)
    assert eager.policy_stats["store_link_busy_s"] == pytest.approx(copy_s)
    # lazy copies at the finish: the blocks are held past it; eager started with the turn's first
    # step (the turn ran 17 steps of 10 ms > the 8 ms copy): nothing is left to wait for.
    assert lazy.policy_stats["delayed_frees"] == 2 and eager.policy_stats["delayed_frees"] == 0


def test_store_costs_make_a_slow_link_or_an_undersized_pool_worse_than_no_offload():
    # A GPU pool the workload fits in: fcfs never preempts. Offload adds nothing to recover, only
    # link time; stores that hold blocks (slow link) or rewrite a thrashing pool cost JCT.
    jobs = workload(n=6, turns=6, gap_s=0.3)

    def mean_jct(policy, params=None):
        res = run(jobs, 200, policy, params)[2]
        return sum(j.jct_s for j in res.job_records()) / len(res.jobs), res

    fcfs_jct, _ = mean_jct("fcfs")
    slow_jct, slow = mean_jct("cpu-offload", {"store": "lazy", "link_gbs": 0.2})
    tiny_jct, tiny = mean_jct("cpu-offload", {"cpu_gib": 0.01, "link_gbs": 0.2})
    big_jct, _ = mean_jct("cpu-offload")
    assert big_jct == pytest.approx(fcfs_jct, rel=0.05)  # a fast link: (almost) free
    assert slow_jct > 2 * fcfs_jct and slow.policy_stats["delayed_frees"] > 0
    # 5 blocks of pool: every turn re-stores its whole history (the pool evicted it)
    assert tiny.policy_stats["pool_stored_blocks"] > 5 * slow.policy_stats["pool_stored_blocks"]
    assert tiny_jct > slow_jct


def test_cpu_offload_load_pays_the_per_transfer_latency():
    _, turns, _ = run(TTL_SCENARIO, 250, "cpu-offload", {"cpu_gib": 1.0, "link_gbs": 1.0, "transfer_latency_s": 0.5})
    a1 = next(t for t in turns if t["job_id"] == "a" and t["turn"] == 1)
    assert a1["pool_hit_tokens"] > 0
    assert a1["ttft_s"] >= 0.5 + 52 * 16 * 131072 / 0.8e9


def test_offload_params_are_checked():
    for bad in ({"store": "sometimes"}, {"cpu_gib": 0}, {"link_efficiency": 1.5}, {"link_gbs": -1},
                {"transfer_latency_s": float("nan")}):
        with pytest.raises(ConfigError):
            make_policy("cpu-offload", bad)


def test_continuum_offload_pins_like_continuum_and_reloads_from_the_host_after_expiry():
    # Pin long enough: a's whole prefix stays on the GPU (as continuum). Pin too short: the pin
    # expires, c evicts a's blocks, and a's turn 1 loads them from the host pool (as cpu-offload).
    _, pinned, _ = run(TTL_SCENARIO, 250, "continuum-offload", {"ttl_rule": "fixed", "ttl_s": 5.0})
    _, expired, res = run(TTL_SCENARIO, 250, "continuum-offload", {"ttl_rule": "fixed", "ttl_s": 0.2})
    _, cont_expired, _ = run(TTL_SCENARIO, 250, "continuum", {"ttl_rule": "fixed", "ttl_s": 0.2})
    a1 = {name: next(t for t in turns if t["job_id"] == "a" and t["turn"] == 1)
          for name, turns in (("pinned", pinned), ("expired", expired), ("continuum", cont_expired))}
    assert a1["pinned"]["hit_tokens"] == 1600 and a1["pinned"]["pool_hit_tokens"] == 0
    assert a1["continuum"]["hit_tokens"] == 784 and a1["continuum"]["pool_hit_tokens"] == 0
    assert a1["expired"]["hit_tokens"] == 784 and a1["expired"]["pool_hit_tokens"] == 1600 - 784
    assert res.policy_stats["num_pin_expired"] == 1 and res.policy_stats["pool_loaded_blocks"] == 51
    assert set(param_names("continuum-offload")) == set(param_names("continuum")) | set(param_names("cpu-offload"))


def test_a_policy_sees_only_its_context_not_the_engine():
    # The engine attaches each policy to a PolicyContext of four things; no policy module imports
    # the engine, so a policy cannot reach its running list, queue or heap.
    import dataclasses
    import pathlib

    from scheduling.policies import POLICY_NAMES
    from scheduling.policies.base import PolicyContext

    assert [f.name for f in dataclasses.fields(PolicyContext)] == ["config", "push", "free_blocks", "estimate_prefill_s"]
    for name in POLICY_NAMES:
        pol = make_policy(name)
        Engine([], EngineConfig(num_gpu_blocks=64), pol, ConstantStepCost(1.0))
        assert isinstance(pol.ctx, PolicyContext), name
    for path in pathlib.Path("scheduling/policies").glob("*.py"):
        assert "scheduling.engine.loop import" not in path.read_text(), path
