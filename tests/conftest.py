"""Factories that test files of several directories share: the ``gpubench`` command in a
subprocess, and the scheduling engine's jobs and runs. Helpers of one directory stay in that
directory's conftest.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def gpubench(*args: str, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    """``python -m gpubench ARGS`` with this checkout first on PYTHONPATH (so the subprocess runs
    the code under test, not another installed copy); output captured as text."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "gpubench", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


def job(job_id, turns, *, system=0, group=None, arrival=0.0):
    """A job from ``(input, output, tool_s)`` turns: every turn but the last ends in a bash call of
    ``tool_s`` seconds; ``group`` (the prefix-sharing group) defaults to the job's id."""
    from scheduling.workload.traces import Job, Turn

    ts = tuple(Turn(i, o, "bash" if k < len(turns) - 1 else None, g if k < len(turns) - 1 else 0.0)
               for k, (i, o, g) in enumerate(turns))
    return Job(job_id, group or job_id, system, ts, arrival)


def run_engine(jobs, num_blocks, policy="fcfs", params=None, cost=0.01, **cfg):
    """``(engine, result)`` of the real engine over ``jobs`` with ``num_blocks`` GPU blocks, a step
    cost (a constant in seconds, or a StepCost) and EngineConfig fields; the block pool's
    invariants are checked after the run."""
    from scheduling.engine import Engine, EngineConfig
    from scheduling.engine.step_cost import ConstantStepCost
    from scheduling.policies import make_policy

    e = Engine(jobs, EngineConfig(num_gpu_blocks=num_blocks, **cfg), make_policy(policy, params),
               ConstantStepCost(cost) if isinstance(cost, float) else cost)
    res = e.run()
    e.pool.check_invariants()
    return e, res


def turn_dicts(res):
    """The result's turn records as dicts keyed by TURN_COLUMNS."""
    return [t._asdict() for t in res.turn_records()]
