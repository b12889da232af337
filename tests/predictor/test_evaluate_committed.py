"""The committed evaluation table regenerates with its COMMAND.

On the kind of machine that measured the committed rows, the regenerated metrics must equal the
committed ones. On another CPU (the ``cpu`` SKU takes its peak and core count from the host, so the
committed rows describe a machine this one is not), the rows and the probe run are regenerated here
with the commands in their COMMAND files, and the evaluation is checked on them: same table, every
figure computed. No host skips the check.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from predictor.evaluate import EvalConfig, evaluate_rows, load_rows

ROOT = Path(__file__).resolve().parents[2]
# evaluation directories: those whose COMMAND runs `gpubench evaluate` (a calibration's directory,
# results/eval/cpu-2t, has a COMMAND too: the fit that made it)
EVAL_DIRS = sorted(p.parent for p in (ROOT / "results" / "eval").glob("*/COMMAND")
                   if any(ln.startswith("gpubench evaluate ") for ln in p.read_text().splitlines()))


def _commands(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def _parse(command: str) -> EvalConfig:
    argv = shlex.split(command)
    assert argv[:2] == ["gpubench", "evaluate"], command
    rows, opts, i = [], {}, 2
    while i < len(argv):
        if argv[i].startswith("--"):
            opts[argv[i][2:]] = argv[i + 1]
            i += 2
        else:
            rows.append(argv[i])
            i += 1
    return EvalConfig(rows=rows, out=opts["out"], sku=opts.get("sku", "cpu"), calibration=opts.get("calibration"),
                      seed=int(opts.get("seed", 0)), target=opts.get("target", "wall_s"))


def _run(command: str, here: Path, *, replace: dict[str, str] | None = None) -> None:
    """One COMMAND line, with results/ paths moved under ``here`` (and ``replace`` applied)."""
    argv = shlex.split(command)
    env = dict(os.environ)
    while argv and "=" in argv[0] and not argv[0].startswith("-"):
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    for old, new in (replace or {}).items():
        argv = [new if a == old else a for a in argv]
    argv = [str(here / a) if a.startswith("results/") else a for a in argv]
    assert argv[0] == "gpubench", command
    proc = subprocess.run([sys.executable, "-m", "gpubench", *argv[1:]], env=env, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])


def _one_take(command: str) -> str:
    """A vLLM rows command with one engine start instead of its takes: on another host the check is
    of the table (every split, method and phase computed), not of its figures, and five starts of
    four models would take ~40 minutes of CI."""
    argv = shlex.split(command)
    if "--takes" in argv:
        argv[argv.index("--takes") + 1] = "1"
    return shlex.join(argv)


def _regenerate_here(ec: EvalConfig, here: Path) -> EvalConfig:
    """The evaluation's rows and calibration, measured on this machine from their COMMAND files."""
    # each row file's command is in the COMMAND next to it (results/steps/, results/vllm-cpu/steps/)
    for command_file in sorted({(ROOT / r).parent / "COMMAND" for r in ec.rows}):
        for line in _commands(command_file):
            if any(r in line for r in ec.rows):
                _run(_one_take(line), here)
    # the probe run behind the calibration: its COMMAND is in probes/ beside the calibration file
    probe_dir = (ROOT / ec.calibration).parent / "probes"
    probe_lines = _commands(probe_dir / "COMMAND")
    run_line = next(ln for ln in probe_lines if " gpubench run " in f" {ln} ")
    fit_line = next(ln for ln in probe_lines if ln.startswith("gpubench fit ") and ec.calibration in ln)
    # one probe run serves every evaluation directory (the torch and the vLLM rows share it): ``here``
    # is the session's, and a second evaluation finds the run, and its row files, already measured
    # (profile resumes and skips the points a file holds)
    probe_runs = here / probe_dir.relative_to(ROOT) / "cpu"
    if not (probe_runs.is_dir() and any(probe_runs.iterdir())):
        _run(run_line, here)
    new_runs = sorted(probe_runs.glob("*"))
    assert len(new_runs) == 1, new_runs
    committed_run = shlex.split(fit_line)[2]
    _run(fit_line, here, replace={committed_run: str(new_runs[0])})
    return EvalConfig(rows=[str(here / r) for r in ec.rows], out=str(here / ec.out), sku=ec.sku,
                      calibration=str(here / ec.calibration), seed=ec.seed, target=ec.target)


def _calibration_host_is_this_one(path: Path) -> bool:
    from predictor.host_match import current_cpu_identity, mismatches

    recorded = (json.loads(path.read_text()).get("meta") or {}).get("host")
    return bool(recorded) and not mismatches(recorded, current_cpu_identity())


@pytest.fixture(scope="module")
def regenerated_root(tmp_path_factory):
    return tmp_path_factory.mktemp("regenerated")


@pytest.mark.skipif(not EVAL_DIRS, reason="no committed evaluation under results/eval/")
@pytest.mark.parametrize("eval_dir", EVAL_DIRS, ids=[p.name for p in EVAL_DIRS])
def test_committed_metrics_regenerate(eval_dir, regenerated_root):
    ec = _parse(_commands(eval_dir / "COMMAND")[-1])
    df = load_rows([str(ROOT / r) for r in ec.rows])
    committed = pd.read_csv(eval_dir / "metrics.csv")
    from predictor.hardware import HardwareSpec

    host = HardwareSpec.from_sku("cpu").name
    # the same machine means the identity the calibration recorded (model name, cores, vector ISA,
    # ISA flags, last-level cache): two VMs of this project's kind report the same CPU model name
    # with different caches, and the roofline forms take the host's cache size as their L2
    same_host = ec.sku != "cpu" or _calibration_host_is_this_one(ROOT / ec.calibration)
    if same_host:
        calibration = str(ROOT / ec.calibration) if ec.calibration else None
        res = evaluate_rows(df, sku=ec.sku, calibration=calibration, target=ec.target, seed=ec.seed)
        regenerated = res.metrics.reset_index(drop=True)
        regenerated = pd.read_csv(pd.io.common.StringIO(regenerated.to_csv(index=False)))  # same dtypes as on disk
        pd.testing.assert_frame_equal(committed, regenerated, rtol=1e-6)
        assert (eval_dir / "headline.md").read_text().split("\n", 1)[1] == res.headline
        return
    # Another CPU: measure the rows and the probes here, then evaluate them the same way.
    here = _regenerate_here(ec, regenerated_root)
    df_here = load_rows(here.rows)
    assert set(df_here.device_name.unique()) and all(host.startswith(str(n)) for n in df_here.device_name.unique())
    res = evaluate_rows(df_here, sku=here.sku, calibration=here.calibration, target=here.target, seed=here.seed)
    metrics = res.metrics.reset_index(drop=True)
    assert list(metrics.columns) == list(committed.columns)
    keys = ["split", "fold", "method", "phase", "rows"]
    assert set(map(tuple, metrics[keys].astype(str).values)) == set(map(tuple, committed[keys].astype(str).values))
    decode = metrics[(metrics.phase == "decode") & (metrics.method == "additive")]
    assert len(decode) and np.isfinite(decode["mape_pct"]).all()
    assert res.headline.strip()
    # the figure, measured here: the probe-only predictor, held out by model, beats the roofline max
    # form on the same rows and stays within 25 % (its goal is 10 %; on this project's hosts the chains
    # so far scored 6.7-19.7 %, and a vLLM row regenerated here is one engine start, not five)
    pooled = metrics[(metrics.split == "by_model") & (metrics.fold == "pooled") & (metrics.phase == "decode")
                     & (metrics.rows == "all")].set_index("method")["mape_pct"]
    assert pooled["cpu_ops"] < pooled["max"] and pooled["cpu_ops"] < 25.0, pooled.to_dict()
