"""Step costs: the quantized memo key, the pure-decode quantum, the per-process shared memo."""
import random
import sys

from scheduling.engine.step_cost import ConstantStepCost, PredictorStepCost, StepCost, TableStepCost, quantize


def test_quantize_rounds_up_at_most_one_32nd_and_is_a_monotone_projection():
    rng = random.Random(1)
    xs = list(range(0, 5000)) + [rng.randrange(1, 1 << 40) for _ in range(20000)]
    for x in xs:
        q = quantize(x)
        assert x <= q <= x + max(0, x) / 32 + 1e-9 if x > 64 else q == x
        assert quantize(q) == q
    xs.sort()
    qs = [quantize(x) for x in xs]
    assert qs == sorted(qs)


def test_decode_quantum_agrees_with_step_s_over_its_whole_range():
    cost = PredictorStepCost("l40s", "llama-3.1-8b")
    for nd, dctx in ((1, 100), (3, 30_000), (64, 1_000_000)):
        seconds, dmax = cost.decode_quantum(nd, dctx)
        assert dmax >= dctx
        for d in (dctx, (dctx + dmax) // 2, dmax):
            assert cost.step_s(num_prefill_tokens=0, num_prefill_seqs=0, prefill_context_tokens=0,
                               num_decode_seqs=nd, decode_context_tokens=d) == seconds
        assert cost.decode_quantum(nd, dmax + 1)[0] >= seconds  # the next key is a longer context
    assert ConstantStepCost(0.5).decode_quantum(4, 10)[0] == 0.5
    assert TableStepCost({8: 1.0, 64: 2.0}).decode_quantum(16, 10**6)[0] == 2.0
    # the base class is exact: valid for that context only
    assert StepCost.decode_quantum(TableStepCost({8: 1.0}), 2, 77) == (1.0, 77)


def test_instances_built_from_names_share_a_memo_that_gives_fresh_answers():
    from predictor import StepModel

    a = PredictorStepCost("a100-80", "llama-3.1-8b")
    b = PredictorStepCost("a100-80", "llama-3.1-8b")
    other = PredictorStepCost("a100-80", "llama-3.1-8b", cuda_graphs=False)
    fresh = PredictorStepCost("a100-80", "llama-3.1-8b",
                              step_model=StepModel.for_names("a100-80", "llama-3.1-8b", cuda_graphs=True))
    kw = dict(num_prefill_tokens=3000, num_prefill_seqs=2, prefill_context_tokens=9000, num_decode_seqs=5,
              decode_context_tokens=50_000)
    t = a.step_s(**kw)
    assert b._memo is a._memo and other._memo is not a._memo and fresh._memo is not a._memo
    assert b.step_s(**kw) == t and b.num_predictor_calls == 0  # warm from a
    assert fresh.step_s(**kw) == t and fresh.num_predictor_calls == 1


def _recorded_steps(tmp_path, rows):
    path = tmp_path / "steps.csv"
    path.write_text("step,dur_s,num_prefill_tokens,num_prefill_seqs,num_decode_seqs\n"
                    + "".join(f"{i},{d},{p},{ps},{ds}\n" for i, (p, ps, ds, d) in enumerate(rows)))
    return tmp_path


def test_measured_step_cost_takes_the_median_of_a_composition_and_scales_the_nearest(tmp_path):
    from scheduling.engine.step_cost import MeasuredStepCost

    rows = [(0, 0, 2, 0.10), (0, 0, 2, 0.30), (0, 0, 2, 0.12),  # median 0.12, not the mean 0.173
            (500, 1, 2, 1.00), (0, 0, 4, 0.20), (0, 0, 3, 0.0)]  # a zero duration is a missing value
    cost = MeasuredStepCost.from_replay_dir(_recorded_steps(tmp_path, rows))
    kw = dict(prefill_context_tokens=0, decode_context_tokens=10)
    assert cost.step_s(num_prefill_tokens=0, num_prefill_seqs=0, num_decode_seqs=2, **kw) == 0.12
    assert cost.decode_quantum(2, 12345) == (0.12, sys.maxsize)  # the context is not keyed
    # same sequence counts, nearest prefill count, scaled by scheduled tokens: 1.0 * 1002 / 502
    assert abs(cost.step_s(num_prefill_tokens=1000, num_prefill_seqs=1, num_decode_seqs=2, **kw) - 1002 / 502) < 1e-12
    # never recorded with 3 decodes (the zero was dropped): the nearest total, 2 or 4 tokens -> 2 (ties: smaller key)
    assert cost.step_s(num_prefill_tokens=0, num_prefill_seqs=0, num_decode_seqs=3, **kw) == 0.12 * 3 / 2
    assert cost.num_recorded_steps == 5 and "5 steps" in cost.describe()


def test_measured_step_cost_refuses_a_directory_without_timed_steps(tmp_path):
    from common.errors import ConfigError
    from scheduling.engine.step_cost import MeasuredStepCost, make_step_cost

    for target, needle in ((tmp_path / "none", "no steps.csv"),
                           (_recorded_steps(tmp_path, [(0, 0, 1, 0.0)]), "no timed steps")):
        try:
            make_step_cost(f"measured:{target}", sku="cpu", model="smollm2-135m")
        except ConfigError as e:
            assert needle in str(e)
        else:
            raise AssertionError(f"{target} accepted")
    (tmp_path / "steps.csv").write_text("step,t_s\n1,0.5\n")
    try:
        MeasuredStepCost.from_replay_dir(tmp_path)
    except ConfigError as e:
        assert "lacks the columns" in str(e)
    else:
        raise AssertionError("a steps.csv without durations accepted")
