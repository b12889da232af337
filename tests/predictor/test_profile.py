"""`gpubench profile`: real engine steps of tiny-llama, appended rows, resume, per-op attribution."""
import json
import subprocess
import sys

import pandas as pd
import pytest

from common.errors import ConfigError, ResultsFormatError
from predictor import load_model_config
from predictor.profile import ProfileConfig, run_profile
from predictor.profile_grid import GRIDS, GridPoint, build_grid, step_flops
from predictor.profile_ops import op_kind
from predictor.profile_rows import read_rows, sidecar_path

TINY = load_model_config("tiny-llama")


def test_grid_respects_caps_and_puts_decodes_first():
    spec = GRIDS["default"]
    for name in ("tiny-llama", "smollm2-135m", "llama-3.2-1b"):
        cfg = load_model_config(name)
        pts = build_grid(spec, cfg, dtype_bytes=4)
        assert {p.phase for p in pts} == {"decode", "prefill", "mixed"}
        for p in pts:
            assert p.kv_tokens * cfg.kv_bytes_per_token(4) <= spec.max_kv_bytes
            assert step_flops(cfg, p.batch) <= spec.max_step_gflop * 1e9
            if p.phase == "mixed":  # decodes first: their cache rows form one contiguous view
                assert all(n == 1 for n, _ in p.batch[:-1]) and p.batch[-1][0] > 1
    # The 1B model's grid is cut by the FLOP cap, the tiny one is not.
    assert len(build_grid(spec, load_model_config("llama-3.2-1b"), dtype_bytes=4)) < len(build_grid(spec, TINY, dtype_bytes=4))


def test_step_flops_known_answer():
    # One decode token at context 0: 2 FLOPs per dense weight + attention over 1 key + lm_head.
    dense = TINY.num_layers * TINY.layer_params()
    attn = 4 * TINY.num_layers * TINY.num_heads * TINY.head_dim * 1
    assert step_flops(TINY, [(1, 0)]) == 2 * dense + attn + 2 * TINY.vocab_size * TINY.hidden_size


def test_point_key_is_run_length_encoded():
    assert GridPoint("mixed", ((1, 64),) * 3 + ((16, 32),)).key == "mixed:3x1+64,1x16+32"


@pytest.mark.parametrize("name,kind", [("aten::linear", "linear"), ("aten::addmm", "linear"),
                                       ("aten::scaled_dot_product_attention", "attention"),
                                       ("aten::index_put_", "kv_write"), ("aten::argmax", "sampling"),
                                       ("aten::mul", "elementwise"), ("aten::embedding", "gather")])
def test_op_kinds(name, kind):
    assert op_kind(name) == kind


def test_profile_tiny_llama_rows_resume_and_ops(tmp_path):
    out = tmp_path / "rows.parquet"
    pc = ProfileConfig(model="tiny-llama", grid="quick", ops_subset=2, num_threads=1, max_points=3)
    rows = run_profile(TINY, pc, out)
    assert len(rows) == 3 and out.exists() and not sidecar_path(out).exists()
    df = pd.read_parquet(out)
    assert list(df.phase) == ["decode"] * 3
    for r in df.itertuples():
        assert r.num_repeats >= 5 and len(r.wall_times_s) == r.num_repeats
        assert r.wall_min_s <= r.wall_s <= r.wall_max_s
        assert 0 < r.forward_s < r.wall_s and r.sampling_s > 0  # wall = prep + forward + sampling
        assert r.loadavg_1m_before >= 0 and r.num_threads == 1
        assert r.ref_gemv_s > 0  # the machine phase: the probes' cold reference GEMV, timed before the point
        assert 0 < r.thread_cpu_s <= r.wall_max_s * 1.05 and len(r.thread_cpu_times_s) == r.num_repeats
    assert df.ops_profiled.sum() == 2
    prof = df[df.ops_profiled].iloc[0]
    ops = json.loads(prof.ops_json)
    assert {"linear", "attention", "sampling"} <= set(ops)
    assert prof.op_sum_s == pytest.approx(sum(ops.values()))
    # Resume: a torn sidecar (interrupted mid-write) plus the parquet; only missing points run.
    side = sidecar_path(out)
    side.write_text('{"key": "tiny-llama|cpu|fp32|decode:4x1+512", "half')
    rows = run_profile(TINY, ProfileConfig(model="tiny-llama", grid="quick", ops_subset=0, num_threads=1,
                                           max_points=5), out)
    df2 = pd.read_parquet(out)
    assert len(df2) == 5 and df2.key.is_unique
    pd.testing.assert_series_equal(df2.wall_s.iloc[:3], df.wall_s, check_names=False)  # not re-measured


def test_malformed_sidecar_line_is_a_user_error(tmp_path):
    side = tmp_path / "x.parquet.partial.jsonl"
    side.write_text('not json\n{"key": "a"}\n')
    with pytest.raises(ResultsFormatError, match=r"x.parquet.partial.jsonl:1"):
        read_rows(side)


def test_unknown_grid_is_a_user_error(tmp_path):
    with pytest.raises(ConfigError, match="--grid 'huge'"):
        run_profile(TINY, ProfileConfig(model="tiny-llama", grid="huge"), tmp_path / "r.parquet")


def test_cli_profile_subprocess(tmp_path):
    out = tmp_path / "cli.parquet"
    cmd = [sys.executable, "-m", "gpubench", "profile", "--model", "tiny-llama", "--grid", "quick",
           "--max-points", "2", "--ops-subset", "0", "--threads", "1", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert len(pd.read_parquet(out)) == 2
    bad = subprocess.run(cmd[:-2] + ["--device", "cuda:7", "--out", str(tmp_path / "g.parquet")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "cuda" in bad.stderr


def test_cli_profile_json(tmp_path):
    """--json: one object on stdout (the progress bar is on stderr); a second run extends the file."""
    import json

    out = tmp_path / "rows.parquet"
    cmd = [sys.executable, "-m", "gpubench", "profile", "--model", "tiny-llama", "--grid", "quick",
           "--ops-subset", "0", "--threads", "1", "--out", str(out), "--json"]
    res = subprocess.run(cmd + ["--max-points", "1"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["rows_file"] == str(out) and doc["num_rows"] == doc["num_added"] == 1 and doc["models"] == ["tiny-llama"]
    more = json.loads(subprocess.run(cmd + ["--max-points", "2"], capture_output=True, text=True, timeout=120).stdout)
    assert more["num_rows"] == 2 and more["num_added"] == 1 == len(pd.read_parquet(out)) - 1
    assert sum(more["phases"].values()) == 2


def test_an_interrupted_profile_says_how_to_resume_and_resumes(tmp_path):
    """Ctrl-C during a real profile: exit 130 with one line saying the same command resumes it (not
    `run`'s --resume); the rerun finishes the grid without doubling a row."""
    import signal
    import time

    out = tmp_path / "i.parquet"
    cmd = [sys.executable, "-m", "gpubench", "profile", "--model", "llama-60m", "--grid", "quick",
           "--ops-subset", "0", "--threads", "1", "--max-points", "12", "--out", str(out)]
    # SIGINT at its default in the child: a shell starts a background job with SIGINT ignored, and a
    # Python started with SIGINT ignored installs no KeyboardInterrupt handler, so under
    # `nohup pytest &` the profile ran to the end and exited 0
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    side = sidecar_path(out)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (side.exists() and side.read_text().count("\n") >= 1):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert "run the same command again to resume" in last and "--resume" not in last
    assert not out.exists() and 1 <= len(read_rows(side)) < 12
    assert subprocess.run(cmd, capture_output=True, text=True, timeout=300).returncode == 0
    rows = pd.read_parquet(out)
    assert len(rows) == 12 and rows["key"].is_unique


def test_a_closed_pipe_is_not_an_error(tmp_path):
    """`gpubench profile --list | head -1`: head closes the pipe early; no error line, no traceback."""
    res = subprocess.run(f"{sys.executable} -m gpubench profile --model llama-3.1-8b --device cuda --grid gpu --list "
                         f"| head -1", shell=True, capture_output=True, text=True, timeout=120)
    assert res.stdout == "decode:1x1+64\n"
    assert res.stderr == "", res.stderr


def test_list_json_and_the_grid_a_gpu_gets_by_default(capsys):
    """`profile --list --json` is JSON (it printed plain text); on a GPU with no --grid the GPU grid is
    timed (an 8B model kept 8 of 68 points under the CPU's caps, silently); naming a CPU grid there
    says how many points its caps drop."""
    from gpubench.cli import main

    assert main(["profile", "--model", "llama-3.1-8b", "--device", "cuda", "--list", "--json"]) == 0
    out, err = capsys.readouterr()
    points = json.loads(out)
    assert len(points) == 68 and err == ""
    assert points[0] == {"key": "decode:1x1+64", "phase": "decode", "batch": [[1, 64]]}
    assert main(["profile", "--model", "llama-3.1-8b", "--device", "cuda", "--grid", "default", "--list", "--json"]) == 0
    out, err = capsys.readouterr()
    kept = len(json.loads(out))
    assert kept < 68 and f"drops {68 - kept} points" in err and "--grid gpu" in err
    # the CPU default is unchanged, and says nothing about caps
    assert main(["profile", "--model", "llama-60m", "--list"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "decode:1x1+64" and err == ""
    assert main(["profile", "--engine", "vllm", "--model", "llama-60m", "--grid", "quick", "--list", "--json"]) == 0
    scenarios = json.loads(capsys.readouterr().out)
    assert scenarios and all(set(s) == {"name", "num_requests"} and s["num_requests"] >= 1 for s in scenarios)
