"""vLLM's OpenAI-compatible server on 127.0.0.1, started from the reference environment.

``vllm serve`` (the console script) fails in this build (it looks up a distribution named
``vllm``); ``python -m vllm.entrypoints.openai.api_server`` works. The server binds 127.0.0.1
only. :func:`serve` checks the port before anything starts (a port in use is one line), waits for
``/health``, and stops the server (SIGTERM, then SIGKILL) when the ``with`` block ends.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from vllmref import env

HOST = "127.0.0.1"


@dataclass(frozen=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT
    model: str     # the served model name
    pid: int
    log_path: Path


def check_port(port: int) -> None:
    """One-line error when ``port`` on 127.0.0.1 cannot be bound (in use, or not a port)."""
    if not 1 <= port <= 65535:
        raise env.VllmEnvError(f"--port {port}: use 1-65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise env.VllmEnvError(f"port {port} on {HOST} is in use; pick another with --port") from None
            raise env.VllmEnvError(f"cannot bind {HOST}:{port}: {e.strerror}") from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model: str = "smollm2-135m", *, port: int | None = None, threads: int = 2, block_size: int = 128,
          max_model_len: int = 4096, kv_cache_gib: int = 1, startup_timeout_s: float = 240.0,
          prompt_tokens_details: bool = False, dev_endpoints: bool = False) -> Iterator[Server]:
    """Run the server for the ``with`` block; yields where it listens.

    ``prompt_tokens_details``: pass ``--enable-prompt-tokens-details``, so a response's
    ``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens the prefix cache served.
    ``dev_endpoints``: set ``VLLM_SERVER_DEV_MODE=1``, which adds ``POST /reset_prefix_cache`` (and
    vLLM's other development routes; the server still binds 127.0.0.1 only).
    """
    python = env.require_env()
    model_dir, real_weights, name = env.resolve_model(model)
    if not real_weights:
        raise env.VllmEnvError(f"the server needs a model with a tokenizer: {model} has random weights only; "
                               f"use smollm2-135m")
    port = free_port() if port is None else port
    check_port(port)
    log_path = Path(tempfile.mkdtemp(prefix="gpubench-vllm-server-")) / "server.log"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", name, "--host", HOST, "--port", str(port), "--dtype", "float32",
           "--enforce-eager", "--block-size", str(block_size), "--max-model-len", str(max_model_len),
           "--enable-prefix-caching"]
    if prompt_tokens_details:
        cmd.append("--enable-prompt-tokens-details")
    with env.vllmref_path() as pythonpath, open(log_path, "w") as log:
        environ = env.worker_environ(threads=threads, kv_cache_gib=kv_cache_gib, pythonpath=pythonpath)
        environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as vLLM does
        if dev_endpoints:
            environ["VLLM_SERVER_DEV_MODE"] = "1"
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True)
        try:
            _wait_healthy(proc, f"http://{HOST}:{port}", log_path, startup_timeout_s)
            yield Server(f"http://{HOST}:{port}", name, proc.pid, log_path)
        finally:
            _stop(proc)


def _wait_healthy(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
            raise env.VllmEnvError(f"the vLLM server exited ({proc.returncode}) before it was ready: "
                                   f"{(lines[-1] if lines else 'no output')[:300]}; log {log_path}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise env.VllmEnvError(f"the vLLM server was not ready after {timeout_s:.0f} s; log {log_path}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
