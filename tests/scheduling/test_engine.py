"""The engine on hand-checkable scenarios and invariants (real engine, constant/table step costs)."""
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest

from common.errors import ConfigError
from scheduling.engine.events import Event
from scheduling.engine.loop import STEP_COLUMNS, Engine, EngineConfig
from scheduling.engine.step_cost import ConstantStepCost, PredictorStepCost, StepCost, TableStepCost
from scheduling.policies import make_policy
from scheduling.workload.trace_synth import long_context_params, synthetic_jobs
from scheduling.workload.traces import with_poisson_arrivals
from tests.conftest import job, run_engine as run, turn_dicts


def small_workload(n=12, seed=3, jps=4.0):
    # The long-context agent's shapes (sigmas, minimums, tool tails), shrunk to a few short turns.
    params = replace(long_context_params(), turns_mean=5, turns_min=2, turns_max=8, system_tokens_min=300,
                     system_tokens_max=600, obs_tokens_median=120, obs_tokens_max=800, out_tokens_median=30,
                     out_tokens_max=80, task_tokens_median=200)
    return with_poisson_arrivals(synthetic_jobs(n, seed=seed, params=params), jps, seed=seed)


# --- hand-checkable preemption scenario ----------------------------------------------------------
# Two 1-turn jobs, 64-token prompts (4 blocks), 100 output tokens: each needs ceil((64+99)/16) = 11
# blocks at its last decode step. Step 1 prefills both; decode step k has computed = 64 + (k-2), so
# a 5th block is needed at step 2, a 6th at step 18, ... With 22 blocks nobody is ever short.
TWO = [job("a", [(64, 100, 0)]), job("b", [(64, 100, 0)])]


def test_no_preemption_when_blocks_suffice():
    _, res = run(TWO, 22)
    assert res.num_preemptions == 0
    assert all(row.break_reason != "no_blocks" and row.num_preemptions == 0 for row in res.step_records())


def test_preemption_exactly_when_blocks_run_out():
    _, res = run(TWO, 21)
    assert res.num_preemptions >= 1
    _, res12 = run(TWO, 12)
    # 12 blocks: both hold 5 after step 2 and 6 after step 18 (used 12); at step 34 "a" needs a 7th
    # -> none is free, the last running request ("b") is preempted and "a" takes one of its blocks.
    first = next(row for row in res12.step_records() if row.num_preemptions)
    assert first.step == 34 and first.num_preemptions == 1 and first.break_reason == "preempted"
    assert all(row.num_preemptions == 0 for row in res12.step_records()[:33])
    b = [t for t in turn_dicts(res12) if t["job_id"] == "b"][0]
    assert b["num_preemptions"] >= 1 and b["recomputed_tokens"] > 0


# --- conservation --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "continuum", "cpu-offload", "lmcache"])
@pytest.mark.parametrize("num_blocks", [400, 5000])
def test_conservation(policy, num_blocks):
    jobs = small_workload()
    e, res = run(jobs, num_blocks, policy, max_num_batched_tokens=512)
    turns = turn_dicts(res)
    assert len(res.jobs) == len(jobs)
    assert len(turns) == sum(len(j.turns) for j in jobs)
    for t in turns:
        # every prompt token of every turn is hit on GPU, loaded from a pool, or prefilled: once
        assert t["hit_tokens"] + t["pool_hit_tokens"] + t["computed_tokens"] == t["prompt_tokens"], t
        if t["num_preemptions"] == 0:
            assert t["recomputed_tokens"] == 0
            assert t["scheduled_tokens"] == t["prompt_tokens"] + t["output_tokens"] - 1 - t["hit_tokens"] - t["pool_hit_tokens"]
    # the step log accounts for exactly the tokens the turns scheduled
    assert sum(r.num_prefill_tokens + r.num_decode_tokens for r in res.step_records()) == sum(t["scheduled_tokens"] for t in turns)
    assert sum(r.num_preemptions for r in res.step_records()) <= res.num_preemptions
    assert all(r.kv_used_blocks <= r.kv_total_blocks for r in res.step_records())  # used <= total
    if num_blocks == 5000:
        assert res.num_preemptions == 0


def test_fast_path_is_identical_to_the_exact_loop():
    jobs = small_workload(n=10, seed=5, jps=8.0)
    for policy in ("fcfs", "continuum", "cpu-offload"):
        _, fast = run(jobs, 300, policy, max_num_batched_tokens=256)
        _, exact = run(jobs, 300, policy, max_num_batched_tokens=256, fast_path=False)
        assert fast.num_preemptions > 0  # the scenario exercises preemption
        assert fast.steps == exact.steps and fast.turns == exact.turns


def test_the_block_bound_before_a_lookup_changes_no_schedule(monkeypatch):
    """Admission's early rejection (``_surely_short``: the free blocks cannot hold the sequence less
    its system prompt) answers as its two gates would after the prefix lookup: each run is the same
    with the bound switched off, and the bound did reject queue heads."""
    from scheduling.engine.admission import Admission

    jobs = small_workload(n=14, seed=6, jps=8.0)
    bound = Admission._surely_short
    rejected = []

    def counted(self, r):
        out = bound(self, r)
        rejected.append(out)
        return out

    for policy in ("fcfs", "jitserve", "continuum"):
        rejected.clear()
        monkeypatch.setattr(Admission, "_surely_short", counted)
        _, fast = run(jobs, 300, policy, max_num_batched_tokens=256)
        monkeypatch.setattr(Admission, "_surely_short", lambda self, r: False)
        _, slow = run(jobs, 300, policy, max_num_batched_tokens=256)
        assert any(rejected), policy  # the scenario exercises the bound
        assert fast.steps == slow.steps and fast.turns == slow.turns, policy


class _ContextCost(TableStepCost):
    """Step time grows with the decode context, so every decode step differs (exact quantum)."""

    def __init__(self):
        super().__init__({1 << 20: 0.0})

    def step_s(self, *, num_prefill_tokens, num_prefill_seqs, prefill_context_tokens, num_decode_seqs,
               decode_context_tokens):
        return 1e-3 + 2e-6 * num_prefill_tokens + 1e-4 * num_decode_seqs + 3e-8 * decode_context_tokens

    decode_quantum = StepCost.decode_quantum


@pytest.mark.parametrize("cost", ["context", "predictor"])
@pytest.mark.parametrize("reserve_full_sequence", [True, False])
def test_inline_decode_run_is_identical_to_stepping_through_events(cost, reserve_full_sequence):
    """The pure-decode loop (taken when the step log is off) changes nothing but speed."""
    jobs = small_workload(n=12, seed=4, jps=4.0)  # long stretches of decode only, and a tight pool
    for policy in ("fcfs", "continuum"):
        results = []
        for record in (True, False):
            c = _ContextCost() if cost == "context" else PredictorStepCost("h100-sxm", "llama-3.1-8b")
            results.append(run(jobs, 200, policy, cost=c, max_num_batched_tokens=256, record_steps=record,
                               reserve_full_sequence=reserve_full_sequence)[1])
        logged, inline = results
        assert logged.num_inline_decode_steps == 0 and inline.num_inline_decode_steps > logged.num_steps / 5
        assert inline.turns == logged.turns and inline.jobs == logged.jobs
        assert (inline.num_steps, inline.num_preemptions, inline.sim_time_s) == \
            (logged.num_steps, logged.num_preemptions, logged.sim_time_s)
        if not reserve_full_sequence:
            # Admitting on the first chunk alone over-admits, so blocks run out and the loop's block
            # check is exercised (vLLM's full-sequence admission gate prevents that here).
            assert logged.num_preemptions > 0


def test_deterministic_for_a_seed():
    a = run(small_workload(seed=7), 600)[1]
    b = run(small_workload(seed=7), 600)[1]
    c = run(small_workload(seed=8), 600)[1]
    assert a.steps == b.steps and a.turns == b.turns
    assert a.turns != c.turns


# --- chunked prefill, budget, max_num_seqs, tool gaps ---------------------------------------------
def test_chunked_prefill_respects_the_token_budget():
    _, res = run([job("a", [(1000, 2, 0)])], 200, max_num_batched_tokens=256)
    prefill = [r.num_prefill_tokens for r in res.step_records() if r.num_prefill_tokens]
    assert prefill == [256, 256, 256, 232]
    assert res.step_records()[0].break_reason == "token_budget"


def test_max_num_seqs_caps_the_batch():
    jobs = [job(f"j{i}", [(32, 5, 0)]) for i in range(5)]
    _, res = run(jobs, 200, max_num_seqs=2)
    assert max(r.num_running for r in res.step_records()) == 2
    assert res.step_records()[0].break_reason == "max_seqs"


def test_next_turn_arrives_after_the_tool_gap_and_hits_its_history():
    # turn 0: 48 + 20 tokens; turn 1 prompt = 48 + 20 + 16 = 84; blocks of turn 0's computed 67 tokens: 4 full
    _, res = run([job("a", [(48, 20, 2.5), (16, 5, 0)])], 100, cost=0.01)
    t0, t1 = turn_dicts(res)
    assert t1["arrival_s"] == pytest.approx(t0["finish_s"] + 2.5)
    assert t1["prompt_tokens"] == 84 and t1["hit_tokens"] == 64 and t1["computed_tokens"] == 20
    # TTFT of turn 0 = one prefill step; the turn then needs 19 more decode steps
    assert t0["ttft_s"] == pytest.approx(0.01) and t0["finish_s"] == pytest.approx(0.20)


def test_shared_system_prompt_hits_across_jobs_of_a_group():
    jobs = [job("a", [(40, 4, 0)], system=320, group="g"), job("b", [(40, 4, 0)], system=320, group="g", arrival=1.0)]
    _, res = run(jobs, 100)
    a, b = turn_dicts(res)
    assert a["hit_tokens"] == 0 and b["hit_tokens"] == 320  # 20 system blocks, then b's own tokens


def test_step_time_from_the_step_cost():
    table = TableStepCost({1: 0.005, 64: 0.01, 8192: 0.2})
    _, res = run([job("a", [(100, 3, 0)])], 50, cost=table)
    assert [r.dur_s for r in res.step_records()] == [0.2, 0.005, 0.005]


def test_request_larger_than_the_pool_is_a_config_error():
    with pytest.raises(ConfigError, match="more than the whole GPU pool"):
        run([job("a", [(1000, 10, 0)])], 10)


# --- event ordering ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Probe(Event):
    tag: str
    log: list
    prio: int
    priority: ClassVar[int] = 0

    def handle(self, engine):
        self.log.append(self.tag)
        return []


def test_event_ties_break_by_priority_then_creation_order():
    e = Engine([], EngineConfig(num_gpu_blocks=4), make_policy("fcfs"), ConstantStepCost(0.01))
    log: list = []

    def probe_cls(p):
        return type(f"P{p}", (Probe,), {"priority": p, "__slots__": ()})

    late, early = probe_cls(3), probe_cls(1)
    e.push(late, 1.0, "late-1", log, 3)
    e.push(early, 1.0, "early-1", log, 1)
    e.push(late, 1.0, "late-2", log, 3)
    e.push(early, 0.5, "first", log, 1)
    e.push(early, 1.0, "early-2", log, 1)
    e.run()
    assert log == ["first", "early-1", "early-2", "late-1", "late-2"]
    # each engine has its own counter: a new engine starts again at 0
    e2 = Engine([], EngineConfig(num_gpu_blocks=4), make_policy("fcfs"), ConstantStepCost(0.01))
    assert next(e2._seq) == 0


def test_tight_pool_with_async_loads_never_waits_on_itself():
    # 160 blocks, 12 jobs, a large host pool: loads are in flight while others run
    # ("waiting_on_load"), and requests holding loaded KV give it back when nothing else can run.
    jobs = small_workload(n=12, seed=3, jps=8.0)
    e, res = run(jobs, 160, "cpu-offload", max_num_batched_tokens=512)
    turns = turn_dicts(res)
    assert len(res.jobs) == len(jobs) and res.num_preemptions > 0
    assert any(r.break_reason == "waiting_on_load" for r in res.step_records())
    assert sum(t["pool_hit_tokens"] for t in turns) > 0
    for t in turns:
        assert t["hit_tokens"] + t["pool_hit_tokens"] + t["computed_tokens"] == t["prompt_tokens"]


@pytest.mark.parametrize("fast_path", [False, True], ids=["exact", "decode-group"])
def test_every_one_token_step_of_a_sampled_request_is_priced_as_a_decode(fast_path):
    """One rule labels a request decode or prefill wherever it is scheduled: a preempted request
    re-admitted with all but its last token hit (it was preempted when its next token needed a new
    block) is a decode, as it is in the running loop. The label is checked against the recorded
    batch alone: an entry of one token, after at least its whole prompt, is a decode."""
    from scheduling.experiments.vllm_diff import DiffSettings, _RecordingEngine
    from scheduling.workload.traces import Job, Turn

    jobs = [Job(f"e{i}", f"g{i % 2}", 150, (Turn(80, 250, "bash", 2.0), Turn(40, 120, "x", 0.5), Turn(30, 60)), 0.2 * i)
            for i in range(8)]  # the differential test's preempt-resume-b32 scenario
    settings = DiffSettings(block_size=32, num_gpu_blocks=45, max_num_batched_tokens=256, max_num_seqs=16)
    config = EngineConfig(num_gpu_blocks=settings.num_gpu_blocks, max_num_batched_tokens=settings.max_num_batched_tokens,
                          max_num_seqs=settings.max_num_seqs, block_size=settings.block_size, fast_path=fast_path,
                          record_steps=True)
    engine = _RecordingEngine(jobs, config, make_policy("fcfs", {}), ConstantStepCost(1.0))
    res = engine.run()
    prompt = {(j.job_id, k): j.prompt_tokens(k) for j in jobs for k in range(j.num_turns)}
    readmitted_decodes = 0
    preempted: set = set()
    last_scheduled: set = set()
    for rec, row in zip(engine.trace, res.steps):
        decodes = [(job, turn) for job, turn, n, before in rec.scheduled if n == 1 and before >= prompt[job, turn]]
        assert row[STEP_COLUMNS.index("num_decode_seqs")] == len(decodes), rec
        readmitted_decodes += sum(1 for key in decodes if key in preempted and key not in last_scheduled)
        preempted |= {tuple(p) for p in rec.preempted}
        last_scheduled = {(job, turn) for job, turn, _, _ in rec.scheduled}
    assert res.num_preemptions > 0 and readmitted_decodes > 0  # the case the rule is about happened
