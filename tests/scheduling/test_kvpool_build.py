"""The engine's block pool is the compiled one; a broken build is an error, never a silent swap
for the Python reference (which would leave CI testing another implementation than the one used)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = "import scheduling.engine.kv_cache as k; print(k.COMPILED, k.BlockPool.__module__, k.PURE_PYTHON_REASON)"


def test_the_compiled_pool_is_in_use():
    if os.environ.get("GPUBENCH_PURE_PYTHON") == "1":
        pytest.skip("GPUBENCH_PURE_PYTHON=1 asks for the Python pool")
    from scheduling import _kvpool
    from scheduling.engine import kv_cache

    assert kv_cache.COMPILED and kv_cache.PURE_PYTHON_REASON is None
    assert kv_cache.BlockPool is _kvpool.BlockPool and kv_cache.HashLRU is _kvpool.HashLRU


def _copy_package(tmp_path: Path, so: bytes | None) -> dict:
    pkg = tmp_path / "scheduling"
    shutil.copytree(REPO / "scheduling", pkg, ignore=shutil.ignore_patterns("_kvpool*.so", "__pycache__"))
    if so is not None:
        built = sorted((REPO / "scheduling").glob("_kvpool*.so"))
        assert built, "the compiled pool is not built (pip install -e .)"
        (pkg / built[0].name).write_bytes(so)
    env = {k: v for k, v in os.environ.items() if k != "GPUBENCH_PURE_PYTHON"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")])
    return env


def test_a_broken_build_fails_instead_of_falling_back(tmp_path):
    env = _copy_package(tmp_path, so=b"\x7fELF not really a shared object")
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert p.returncode != 0 and "the compiled block pool does not import" in p.stderr, (p.stdout, p.stderr[-1500:])
    assert "GPUBENCH_PURE_PYTHON=1" in p.stderr
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env={**env, "GPUBENCH_PURE_PYTHON": "1"})
    assert p.returncode == 0 and p.stdout.split()[:2] == ["False", "scheduling.engine.kv_cache"], p.stderr[-1500:]


def test_a_missing_build_warns(tmp_path):
    env = _copy_package(tmp_path, so=None)
    # An editable install maps scheduling._kvpool to the checkout's build: hide it as if never built.
    hide = ("import sys\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'scheduling._kvpool':\n"
            "            raise ModuleNotFoundError(name)\n"
            "sys.meta_path.insert(0, Hide())\n")
    p = subprocess.run([sys.executable, "-W", "always", "-c", hide + PROBE], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and p.stdout.split()[:2] == ["False", "scheduling.engine.kv_cache"], p.stderr[-1500:]
    assert "RuntimeWarning" in p.stderr and "not built" in p.stderr
