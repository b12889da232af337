"""``sjf``, ``srtf``, ``las`` and ``jitserve``: who runs first and who is preempted, on hand-built traces (real engine, one
running request at a time, a constant step cost)."""
from types import SimpleNamespace

import pytest

from common.errors import ConfigError
from scheduling.policies import make_policy
from tests.conftest import job, run_engine, turn_dicts


def first_scheduled(jobs, policy, params=None):
    _, res = run_engine(jobs, 2000, policy, params, 0.01, max_num_seqs=1)
    return {(t["job_id"], t["turn"]): t["first_scheduled_s"] for t in turn_dicts(res)}


# "a" and "b" each run a first turn (50 and 5 output tokens), call a tool, and come back while the
# blocker "x" runs; "a" comes back first. When "x" finishes, both second turns wait.
SJF_SCENARIO = [
    job("a", [(16, 50, 0.2), (16, 5, 0)]),
    job("b", [(16, 5, 0.75), (16, 5, 0)], arrival=0.001),
    job("x", [(16, 100, 0)], arrival=0.6),
]


def test_sjf_serves_the_turn_its_job_history_says_is_short_first_fcfs_by_arrival():
    fcfs = first_scheduled(SJF_SCENARIO, "fcfs")
    sjf = first_scheduled(SJF_SCENARIO, "sjf")
    x_done = fcfs[("x", 0)] + 1.0
    assert fcfs[("a", 1)] < fcfs[("b", 1)] and min(fcfs[("a", 1)], fcfs[("b", 1)]) >= x_done - 0.05
    assert sjf[("b", 1)] < sjf[("a", 1)]  # b's earlier turn made 5 tokens, a's 50


def test_srtf_orders_fresh_turns_as_sjf_does():
    assert first_scheduled(SJF_SCENARIO, "srtf") == first_scheduled(SJF_SCENARIO, "sjf")


def test_srtf_preempts_the_turn_with_the_most_left_where_sjf_preempts_the_longest():
    # "long" (200 tokens) has made ~185 when "mid" (60) arrives; 15 blocks of 16 tokens cannot hold
    # both to their ends. sjf's victim is the longer turn, nearly done, and its 185 tokens are
    # recomputed; srtf's is "mid", with ~55 tokens left against ~15.
    jobs = [job("long", [(16, 200, 0)]), job("mid", [(16, 60, 0)], arrival=1.85)]
    preempted = {}
    for name in ("sjf", "srtf"):
        _, res = run_engine(jobs, 15, name, {"oracle": True}, 0.01)
        preempted[name] = {t["job_id"]: t["num_preemptions"] for t in turn_dicts(res)}
    assert preempted["sjf"] == {"long": 1, "mid": 0}
    assert preempted["srtf"] == {"long": 0, "mid": 1}


def test_srtf_keys_a_turn_by_what_it_has_left_at_least_one_token():
    pol = make_policy("srtf", {"oracle": True})

    def req(out, generated, index):
        return SimpleNamespace(output_tokens=out, num_output=generated, turn=0, run_pos=index,
                               job_state=SimpleNamespace(index=index, job=SimpleNamespace(arrival_s=0.0)))

    near_done, fresh, past = req(100, 95, 0), req(30, 0, 1), req(10, 12, 2)
    assert pol.remaining(near_done) == 5 and pol.remaining(fresh) == 30 and pol.remaining(past) == 1
    assert pol.preemption_victim([near_done, fresh, past]) is fresh
    assert fresh.queue_key[0] == 30  # the victim waits keyed by what it had left


def test_sjf_without_history_uses_the_prior_and_the_oracle_knows_the_length():
    jobs = [job("x", [(16, 60, 0)]), job("long", [(16, 40, 0)], arrival=0.05), job("short", [(16, 4, 0)], arrival=0.06)]
    est = first_scheduled(jobs, "sjf")  # nothing has finished when both arrive: the prior for both, then arrival
    oracle = first_scheduled(jobs, "sjf", {"oracle": True})
    assert est[("long", 0)] < est[("short", 0)]
    assert oracle[("short", 0)] < oracle[("long", 0)]


# "a" has had a long first turn (800 prompt + 50 output tokens scheduled: level 2 of 400-token
# quanta) and comes back while "x" runs; "c", a new job, arrives after it.
LAS_SCENARIO = [
    job("a", [(800, 50, 0.2), (16, 5, 0)]),
    job("x", [(16, 100, 0)], arrival=0.6),
    job("c", [(16, 5, 0)], arrival=0.8),
]


def test_las_serves_the_job_with_the_least_attained_service_first():
    fcfs = first_scheduled(LAS_SCENARIO, "fcfs")
    las = first_scheduled(LAS_SCENARIO, "las")
    assert fcfs[("a", 1)] < fcfs[("c", 0)]
    assert las[("c", 0)] < las[("a", 1)]
    # a quantum larger than a's service puts both on level 0: arrival order again
    coarse = first_scheduled(LAS_SCENARIO, "las", {"quantum_tokens": 100_000})
    assert coarse[("a", 1)] < coarse[("c", 0)]


def test_the_victim_is_the_running_request_the_order_puts_last():
    running = [SimpleNamespace(queue_key=(1, 0.0), run_pos=0), SimpleNamespace(queue_key=(3, 0.5), run_pos=1),
               SimpleNamespace(queue_key=(3, 0.5), run_pos=2), SimpleNamespace(queue_key=(2, 9.0), run_pos=3)]
    for name in ("sjf", "las", "jitserve"):
        assert make_policy(name).preemption_victim(running) is running[2]
    # srtf keys the running turns again by what they have left (test_srtf_keys_...)


def test_order_policies_survive_a_pool_that_forces_preemption():
    jobs = [job(f"j{i}", [(300, 40, 0.1), (40, 20, 0)], arrival=0.02 * i) for i in range(6)]
    for name in ("sjf", "srtf", "las", "jitserve"):
        _, res = run_engine(jobs, 40, name, None, 0.01)  # 40 blocks: not every job fits at once
        turns = turn_dicts(res)
        assert len(turns) == 12 and sum(t["num_preemptions"] for t in turns) > 0, name


@pytest.mark.parametrize("name, params, message", [
    ("sjf", {"prior_output_tokens": 0}, "prior_output_tokens must be a whole number >= 1"),
    ("sjf", {"oracle": "yes"}, "oracle must be true or false"),
    ("srtf", {"prior_output_tokens": -1}, "srtf prior_output_tokens must be a whole number >= 1"),
    ("srtf", {"oracle": 1}, "srtf oracle must be true or false"),
    ("las", {"quantum_tokens": 2.5}, "quantum_tokens must be a whole number"),
    ("jitserve", {"ttft_s": 0}, "ttft_s must be a finite number > 0"),
    ("continuum", {"order": "lifo"}, "continuum order must be one of arrival, sjf, las, jitserve"),
])
def test_bad_parameters_are_one_clear_error(name, params, message):
    with pytest.raises(ConfigError, match=message):
        make_policy(name, params)


# "x" holds the only running slot for ~3 s. "late" arrived at once and has waited past its 2 s TTFT
# target by the time "x" finishes; "fresh" arrived at 2.5 s and can still meet it.
JIT_SCENARIO = [
    job("x", [(16, 300, 0)]),
    job("late", [(16, 8, 0)], arrival=0.05),
    job("fresh", [(16, 8, 0)], arrival=2.5),
]


def test_jitserve_serves_the_turn_that_can_still_meet_its_slo_before_the_one_that_cannot():
    fcfs = first_scheduled(JIT_SCENARIO, "fcfs")
    jit = first_scheduled(JIT_SCENARIO, "jitserve")
    assert fcfs[("late", 0)] < fcfs[("fresh", 0)]
    assert jit[("fresh", 0)] < jit[("late", 0)]
    # with a TTFT target that "late" still meets, both are live: the shorter service goes first,
    # which is again "late" (same size, arrived first)
    loose = first_scheduled(JIT_SCENARIO, "jitserve", {"ttft_s": 60.0})
    assert loose[("late", 0)] < loose[("fresh", 0)]


def test_jitserve_puts_the_larger_gain_per_second_first():
    from scheduling.engine.request import JobState, Request
    from scheduling.policies import make_policy

    pol = make_policy("jitserve")
    short_job, long_job = job("s", [(16, 4, 0)]), job("l", [(16, 4, 0)])
    short, long_ = (Request(JobState(j, i), 0, i, 0.0, 16) for i, j in enumerate((short_job, long_job)))
    pol.expected_output = lambda r: 4.0 if r is short else 400.0  # what the job histories would say
    # no engine attached: the step and the prefill cost 0.01 s each; both meet every target
    assert pol.priority(short, 0.1) > pol.priority(long_, 0.1)
    # a long turn that would finish past the tool-turn deadline earns nothing
    tool_job = job("t", [(16, 400, 1.0), (16, 4, 0)])
    tool_turn = Request(JobState(tool_job, 2), 0, 2, 0.0, 16)
    pol.expected_output = lambda r: 2000.0  # 2000 x 0.01 s = 20 s > the 10 s deadline
    assert pol.priority(tool_turn, 0.1) < 1e-12 < pol.priority(long_, 0.1)


def test_jitserve_ranking_loop_ranks_as_priority_does():
    """``before_admission`` inlines ``priority``'s arithmetic for speed: on a queue that mixes live and
    late turns, tool and streamed turns, jobs with and without history, it keys each request by
    exactly ``-priority`` and orders the queue by it."""
    import random

    from scheduling.engine.request import JobState, Request
    from scheduling.policies.jitserve import RankedQueue

    rng = random.Random(7)
    pol = make_policy("jitserve", {"ttft_s": 1.0, "tool_turn_s": 3.0, "tpot_s": 0.008})
    pol.queue = RankedQueue()
    for i in range(40):
        turns = [(rng.randint(1, 4000), rng.randint(1, 300), 0.5) for _ in range(rng.randint(1, 3))]
        js = JobState(job(f"j{i}", turns, system=rng.choice((0, 64))), i)
        t = rng.randrange(len(turns))
        pol.queue.items.append(Request(js, t, i, rng.uniform(7.0, 10.0), turns[t][0]))
        if rng.random() < 0.5:  # a job whose earlier turns finished
            pol._job_max[i] = rng.randint(1, 900)
    pol._out_sum, pol._out_count = 3000, 20
    pol._tpot_sum, pol._tpot_count = 0.2, 20  # a 0.01 s step: streamed turns miss TPOT, long tool turns their deadline
    now = 10.0
    pol.before_admission(now)
    keys = [-pol.priority(r, now) for r in pol.queue.items]
    assert [r.queue_key[0] for r in pol.queue.items] == keys
    assert keys == sorted(keys) and len(set(keys)) > 10  # live and discounted turns both present
    assert min(keys) < -1.0 and max(keys) > -1e-6


def test_continuum_pins_first_then_orders_by_the_queue_orders_key():
    # SJF_SCENARIO and a new job "n" arriving while "x" runs: when "x" finishes, a's and b's second
    # turns (their jobs pinned with a long TTL) and n's first turn wait. The running mean of the
    # finished turns (50 and 5 tokens) is n's estimate: 27.5, between b's 5 and a's 50.
    jobs = [*SJF_SCENARIO, job("n", [(16, 5, 0)], arrival=0.8)]
    pinned = {"ttl_rule": "fixed", "ttl_s": 10.0}
    sjf = first_scheduled(jobs, "sjf")
    assert sjf[("b", 1)] < sjf[("n", 0)] < sjf[("a", 1)]
    arrival = first_scheduled(jobs, "continuum", pinned)  # Continuum's own order: pinned, then job arrival
    assert arrival[("a", 1)] < arrival[("b", 1)] < arrival[("n", 0)]
    both = first_scheduled(jobs, "continuum", {**pinned, "order": "sjf"})  # pinned first, SJF within
    assert both[("b", 1)] < both[("a", 1)] < both[("n", 0)]
    unpinned = first_scheduled(jobs, "continuum", {"ttl_rule": "fixed", "ttl_s": 0.0, "order": "sjf"})
    assert unpinned[("b", 1)] < unpinned[("n", 0)] < unpinned[("a", 1)]  # no pin: SJF alone
    las = first_scheduled(jobs, "continuum", {**pinned, "order": "las"})
    assert max(las[("a", 1)], las[("b", 1)]) < las[("n", 0)]  # n has attained nothing, but is not pinned
    jit = first_scheduled(jobs, "continuum", {**pinned, "order": "jitserve"})  # re-ranked, pins kept first
    assert max(jit[("a", 1)], jit[("b", 1)]) < jit[("n", 0)]


def test_continuum_with_an_order_is_a_sweep_variant(tmp_path):
    from tests.gpubench.conftest import run_cli

    out = tmp_path / "sweep"
    proc = run_cli("sweep", "--policies", "continuum", "continuum@order=jitserve", "--skus", "l40s", "--jps", "2",
                   "--jobs", "30", "--workers", "1", "--no-progress", "--no-plots", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    import pandas as pd

    rows = pd.read_csv(out / "sweep.csv")
    assert set(rows["policy"]) == {"continuum", "continuum@order=jitserve"} and (rows["error"].isna()).all()
