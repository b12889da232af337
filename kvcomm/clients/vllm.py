"""vLLM as a ``ModelClient``: its OpenAI-compatible server, started on 127.0.0.1 for the client's lifetime.

The server comes from the reference environment (``gpubench vllm setup``; :func:`vllmref.server.serve`)
with what a prefix-reuse measurement needs, all read from vLLM 0.32's own source:

- ``--enable-prefix-caching`` (``serve`` always passes it): full KV blocks of ``--block-size`` tokens
  are hashed by their token prefix and reused by later requests, so a hit is a multiple of the block
  size and at least one prompt token is always computed;
- ``--enable-prompt-tokens-details``: each response's final usage carries
  ``usage.prompt_tokens_details.cached_tokens`` (the request's prefix-cache hit, in tokens);
- ``VLLM_SERVER_DEV_MODE=1``: adds ``POST /reset_prefix_cache``, which empties the cache (the cold
  condition of a measurement);
- ``GET /metrics`` always has the counters ``vllm:prefix_cache_queries_total`` and
  ``vllm:prefix_cache_hits_total`` (tokens looked up / tokens found, over all requests).

Requests go through :class:`kvcomm.clients.openai_http.OpenAIHTTPClient`; ``cpu_seconds`` is the CPU
time of the server's process tree (the API server and its engine-core process).
"""
from __future__ import annotations

import contextlib

from kvcomm.clients import Completion, ModelClient, PrefixCounters, Prompt
from kvcomm.clients.openai_http import OpenAIHTTPClient


class VllmClient(ModelClient):
    """Starts the server in ``__init__`` (one-line ``VllmEnvError`` when the environment is missing or
    the server does not come up) and stops it in :meth:`close`.

    Args:
        model: the model to serve (``smollm2-135m``: the converted real model).
        threads: OpenMP threads of the engine.
        block_size: KV block size in tokens (a multiple of 32 on the CPU).
        port: port on 127.0.0.1 (default: a free one).
        timeout_s: the HTTP client's read timeout.
    """

    kind = "vllm"

    def __init__(self, model: str = "smollm2-135m", *, threads: int = 2, block_size: int = 128,
                 port: int | None = None, timeout_s: float = 300.0, startup_timeout_s: float = 240.0):
        from vllmref import VLLM_VERSION, server
        from vllmref.settings import EngineSettings

        EngineSettings(block_size=block_size, threads=threads).check()
        self.threads, self.block_size, self.vllm_version = threads, block_size, VLLM_VERSION
        self._stack = contextlib.ExitStack()
        try:
            self.server = self._stack.enter_context(server.serve(
                model, port=port, threads=threads, block_size=block_size, startup_timeout_s=startup_timeout_s,
                prompt_tokens_details=True, dev_endpoints=True))
            self.http = OpenAIHTTPClient(self.server.base_url, self.server.model, timeout_s=timeout_s,
                                         block_size=block_size, threads=threads, server_pid=self.server.pid)
        except BaseException:
            self._stack.close()
            raise
        self.model = self.server.model

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def complete(self, prompt: Prompt, max_tokens: int, temperature: float = 0.0) -> Completion:
        return self.http.complete(prompt, max_tokens, temperature)

    def tokenize(self, prompt: Prompt) -> list[int] | None:
        return self.http.tokenize(prompt)

    def reset_prefix_cache(self) -> bool:
        return self.http.reset_prefix_cache()

    def prefix_counters(self) -> PrefixCounters | None:
        return self.http.prefix_counters()

    def cpu_seconds(self) -> float | None:
        return self.http.cpu_seconds()

    def describe(self) -> dict:
        return super().describe() | {"base_url": self.base_url, "vllm_version": self.vllm_version,
                                     "server_flags": ["--enable-prefix-caching", "--enable-prompt-tokens-details",
                                                      f"--block-size {self.block_size}", "VLLM_SERVER_DEV_MODE=1"]}

    def close(self) -> None:
        self._stack.close()
