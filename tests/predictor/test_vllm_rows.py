"""Turning the vLLM worker's step records into step rows, and refusing contended rows.

The worker itself is tested against the real engine in tests/vllmref; these check the pure
conversion on records shaped like the worker's.
"""
import json

import pytest

from common.errors import ResultsFormatError
from common.model_config import load_model_config
from predictor.evaluate import load_rows
from predictor.profile_rows import write_parquet
from predictor.vllm_profile import VLLM_GRIDS, batch_of, build_scenarios, step_rows


def record(batch, *, scenario="s", step=1, wall=0.05, cpu=0.05, load=0.5):
    return {"kind": "step", "scenario": scenario, "scenario_step": step, "t_start": 10.0, "t_end": 10.0 + wall,
            "process_cpu_s": cpu, "loadavg_1m_before": load, "loadavg_1m_after": load, "preempted": [],
            "kv_free_blocks": 90, "kv_total_blocks": 100, "kv_cached_blocks": 3, "num_running": len(batch),
            "num_waiting": 0, "batch": [{"req_id": f"r{i}", "num_new_tokens": n, "num_computed_before": c,
                                         "num_prompt_tokens": 64, "decode": d} for i, (n, c, d) in enumerate(batch)]}


def test_batch_of_puts_decodes_first_and_names_the_phase():
    assert batch_of(record([(64, 0, False), (1, 130, True)])) == ("mixed", ((1, 130), (64, 0)))
    assert batch_of(record([(1, 5, True), (1, 9, True)]))[0] == "decode"
    assert batch_of(record([(128, 0, False)]))[0] == "prefill"


def test_step_rows_schema_and_contention_flag():
    cfg = load_model_config("smollm2-135m")
    static = {"num_threads": 1, "model": cfg.name}
    quiet = record([(1, 100, True)] * 4, step=1, wall=0.05, cpu=0.0502)
    busy = record([(1, 101, True)] * 4, step=2, wall=0.05, cpu=0.02)  # the OS gave the core away
    warm = record([(8, 0, False)], scenario="warmup")
    rows = step_rows([quiet, busy, warm], cfg, static)
    assert len(rows) == 2  # the warm-up scenario is not a row
    assert [r["contended"] for r in rows] == [False, True]
    assert rows[0]["num_decode_seqs"] == 4 and rows[0]["context_sum"] == 400 and rows[0]["num_new_tokens"] == 4
    assert rows[0]["thread_cpu_s"] == pytest.approx(0.0502) and rows[0]["cpu_share"] == pytest.approx(1.004)
    assert json.loads(rows[0]["batch_json"]) == [[1, 100]] * 4
    assert rows[0]["key"] != rows[1]["key"]


def test_step_rows_carry_the_reference_gemv_timed_before_their_scenario():
    cfg = load_model_config("smollm2-135m")
    records = [{"kind": "reference", "scenario": "a", "times_s": [9.0, 1.0, 3.0, 2.0]},
               record([(1, 100, True)], scenario="a", step=1),
               {"kind": "reference", "scenario": "b", "times_s": [9.0]},  # only a warm-up: no median
               record([(1, 100, True)], scenario="b", step=1)]
    rows = step_rows(records, cfg, {"num_threads": 1, "model": cfg.name})
    assert rows[0]["ref_gemv_s"] == 2.0  # median of the repetitions after the first
    assert rows[1]["ref_gemv_s"] != rows[1]["ref_gemv_s"]  # NaN


def test_a_steps_own_reference_gemv_wins_over_its_scenarios():
    cfg = load_model_config("smollm2-135m")
    own = record([(1, 100, True)], scenario="a", step=2)
    own["ref_times_s"] = [9.0, 4.0, 6.0, 5.0]  # timed right before this step
    torn = record([(1, 100, True)], scenario="a", step=3)
    torn["ref_times_s"] = [9.0]  # only the discarded first repetition: the scenario's stands in
    records = [{"kind": "reference", "scenario": "a", "times_s": [9.0, 1.0, 3.0, 2.0]},
               record([(1, 100, True)], scenario="a", step=1), own, torn]
    rows = step_rows(records, cfg, {"num_threads": 1, "model": cfg.name})
    assert [r["ref_gemv_s"] for r in rows] == [2.0, 5.0, 2.0]


def test_scenarios_respect_the_caps():
    cfg = load_model_config("llama-3.2-1b")
    names = [s["name"] for s in build_scenarios(VLLM_GRIDS["quick"], cfg, block_size=128)]
    small = [s["name"] for s in build_scenarios(VLLM_GRIDS["quick"], load_model_config("smollm2-135m"), block_size=128)]
    assert names[0] == "warmup" and set(names) < set(small)  # the 1B model drops the heaviest prefills
    assert any(n.startswith("mixed") for n in names) and any("cached" in n for n in names)


def test_evaluate_refuses_contended_rows_unless_allowed(tmp_path):
    cfg = load_model_config("smollm2-135m")
    rows = step_rows([record([(1, 100, True)], step=1), record([(1, 101, True)], step=2, cpu=0.01)], cfg,
                     {"num_threads": 1, "model": cfg.name, "schema_version": 1, "device": "cpu", "device_type": "cpu",
                      "dtype": "fp32"})
    path = tmp_path / "rows.parquet"
    write_parquet(rows, path)
    with pytest.raises(ResultsFormatError, match="1 of 2 rows were taken under contention"):
        load_rows([path])
    df = load_rows([path], allow_contended=True)
    assert len(df) == 1 and not df["contended"].any()


def test_a_retake_replaces_a_scenario_only_when_it_is_quieter():
    from predictor.vllm_profile import contended_by_scenario, keep_quieter_takes

    def rows(scenario, flags, wall):
        return [{"key": f"m|vllm|fp32|{scenario}|step{i}", "scenario": scenario, "contended": f, "wall_s": wall}
                for i, f in enumerate(flags)]

    first = rows("a", [True, False], 1.0) + rows("b", [True, True], 1.0) + rows("c", [False], 1.0)
    retake = rows("a", [False, False], 2.0) + rows("b", [True, True], 2.0)
    kept = keep_quieter_takes(first, retake)
    assert contended_by_scenario(kept) == {"a": 0, "b": 2, "c": 0}
    walls = {r["key"]: r["wall_s"] for r in kept}
    assert sorted(walls) == sorted(r["key"] for r in first)  # every step once
    # a is quieter: replaced whole; b is no quieter: the first take stays whole; c was not retaken
    assert [walls[f"m|vllm|fp32|a|step{i}"] for i in range(2)] == [2.0, 2.0]
    assert [walls[f"m|vllm|fp32|b|step{i}"] for i in range(2)] == [1.0, 1.0]
    assert walls["m|vllm|fp32|c|step0"] == 1.0


def test_takes_merge_into_the_median_of_the_same_batch():
    from predictor.vllm_profile import merge_takes

    cfg = load_model_config("smollm2-135m")
    static = {"num_threads": 1, "model": cfg.name, "created_utc": "t"}

    def take(walls, *, batch=((1, 100, True),) * 2, busy=()):
        return step_rows([record(list(batch), step=i + 1, wall=w, cpu=w * (0.2 if i in busy else 1.0))
                          for i, w in enumerate(walls)], cfg, static)

    merged = merge_takes([take([0.05, 0.04]), take([0.07, 0.02], busy=(1,)), take([0.06, 0.03])])
    assert [r["num_repeats"] for r in merged] == [3, 2]
    first, second = merged
    assert first["wall_s"] == pytest.approx(0.06) and first["thread_cpu_s"] == pytest.approx(0.06)
    assert sorted(first["wall_times_s"]) == pytest.approx([0.05, 0.06, 0.07])
    assert first["wall_min_s"] == pytest.approx(0.05) and first["wall_max_s"] == pytest.approx(0.07)
    assert first["wall_cv"] > 0 and not first["contended"]
    # the contended take's step is left out while quiet takes have it
    assert sorted(second["wall_times_s"]) == pytest.approx([0.03, 0.04]) and not second["contended"]
    # a take whose scheduler chose another batch at that step is not a repeat of it
    other = merge_takes([take([0.05]), take([0.5], batch=((1, 100, True),) * 3)])
    assert other[0]["num_repeats"] == 1 and other[0]["wall_s"] == pytest.approx(0.05)
    # no quiet take: the row stays contended (and is retaken)
    assert merge_takes([take([0.05], busy=(0,)), take([0.06], busy=(0,))])[0]["contended"]


def test_the_headline_states_the_references_own_spread():
    import pandas as pd

    from predictor.eval_report import reference_spread_text

    df = pd.DataFrame({"phase": ["decode", "decode", "prefill"], "thread_cpu_s": [1.0, 2.0, 5.0],
                       "thread_cpu_times_s": [[0.9, 1.0, 1.1], [2.0, 2.0, 2.0], [1.0, 9.0]]})
    line = reference_spread_text(df, "thread_cpu_s")
    # (10 % + 0 % + 10 %) / 3 on the first row, 0 on the second; the prefill row is not a decode row
    assert "3.33 % from its row's median" in line and "2 rows, median 3 repetitions" in line
    single = df.assign(thread_cpu_times_s=[[1.0], [2.0], [5.0]])
    assert reference_spread_text(single, "thread_cpu_s") == ""  # one repetition: no spread to state
    assert reference_spread_text(df, "op_sum_s") == ""
