"""`gpubench profile --engine torch-graph`: the graph engine's rows (host and device step, attention
backend, kernels per step), their own keys, resume, and files that never mix engines."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from common.errors import ConfigError
from predictor import load_model_config
from predictor.profile import ProfileConfig, run_profile
from predictor.profile_graph import kernel_kind

TINY = load_model_config("tiny-llama")


def test_graph_rows_carry_engine_timer_steps_backend_and_kernels_and_resume(tmp_path):
    out = tmp_path / "rows.parquet"
    pc = ProfileConfig(model="tiny-llama", grid="quick", ops_subset=2, num_threads=1, max_points=3, engine="torch-graph")
    rows = run_profile(TINY, pc, out)
    df = pd.read_parquet(out)
    assert len(rows) == 3 and df.key.str.startswith("tiny-llama|torch-graph|cpu|fp32|").all()
    for r in df.itertuples():
        assert r.engine == "torch-graph" and r.timer == "perf_counter" and not r.cuda_graphs  # the CPU: eager
        assert r.host_step_s == r.wall_s and r.wall_min_s <= r.wall_s <= r.wall_max_s
        assert math.isnan(r.device_step_s)  # no device clock apart from the host's
        assert r.attention_backend == "sdpa" and "CUDA" in r.attention_fallback and r.kernels == "torch"
        assert r.kernels_fallback == "Triton kernels compile for CUDA devices (this is cpu)"
        assert 0 < r.prep_s < r.wall_s and r.num_repeats >= 5
    prof = df[df.ops_profiled]
    assert len(prof) == 2 and (prof.kernels_per_step > 0).all()
    assert {"linear", "attention"} <= set(json.loads(prof.ops_json.iloc[0]))
    assert df[~df.ops_profiled].kernels_per_step.isna().all()
    run_profile(TINY, ProfileConfig(**{**pc.__dict__, "max_points": 4, "ops_subset": 0}), out)
    df2 = pd.read_parquet(out)
    assert len(df2) == 4 and df2.key.is_unique
    pd.testing.assert_series_equal(df2.wall_s.iloc[:3], df.wall_s, check_names=False)  # not re-measured


def test_a_rows_file_never_mixes_engines(tmp_path):
    out = tmp_path / "rows.parquet"
    run_profile(TINY, ProfileConfig(model="tiny-llama", grid="quick", ops_subset=0, num_threads=1, max_points=1), out)
    assert pd.read_parquet(out).engine.tolist() == ["torch"]
    with pytest.raises(ConfigError, match="holds rows of the torch engine"):
        run_profile(TINY, ProfileConfig(model="tiny-llama", grid="quick", max_points=1, engine="torch-graph"), out)


def test_the_cli_refuses_graph_options_without_the_graph_engine_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "gpubench", "profile", "--model", "tiny-llama", "--grid", "quick", "--kernels", "triton",
           "--out", str(tmp_path / "r.parquet")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "add --engine torch-graph" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run(cmd + ["--engine", "torch-graph", "--attention", "flash-varlen", "--kernels", "torch"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--attention flash-varlen: " in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r.parquet").exists()


@pytest.mark.parametrize("name, kind", [
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64>>", "attention"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "linear"),
    ("nvjet_tst_64x8_64x16_2x1_v_bz_TNT", "linear"),
    ("triton_poi_fused_add_rms_norm_0", "triton"),
    ("_rms_norm_kernel", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, ArgMaxOps>", "sampling"),
    ("void at::native::index_copy_kernel_impl", "copy"),
])
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind
