"""One interface over the places a model can answer from: in-process, any OpenAI-compatible server, vLLM.

``ModelClient.complete(prompt_or_messages, max_tokens, temperature=0)`` returns a :class:`Completion`:
the text, the prompt's token count, how many of those tokens the backend's prefix cache served
(``cached_prompt_tokens``; ``None`` when the backend does not say), the time to the first generated
token (``ttft_s``, measured on the client's clock from the request to the first streamed token) and
the whole request's time (``total_s``).

Backends (imported lazily: the HTTP client needs only the standard library):

- :class:`kvcomm.clients.hf.HFClient`: a transformers model in this process (``kvcomm.models``), with
  its own token-granular prefix cache (the longest common prefix with a recent request is reused);
- :class:`kvcomm.clients.openai_http.OpenAIHTTPClient`: any OpenAI-compatible server (streaming SSE;
  reads ``usage.prompt_tokens_details.cached_tokens``, the server's ``/metrics`` prefix-cache
  counters and ``POST /reset_prefix_cache`` when the server has them);
- :class:`kvcomm.clients.vllm.VllmClient`: starts vLLM's server on 127.0.0.1 (``vllmref.server``)
  with prefix caching and cached-token reporting on, and talks to it with the HTTP client.

A prompt is either a string (a plain completion) or a list of chat messages
(``{"role": ..., "content": ...}``) that the backend formats with the model's chat template.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Union

from common.errors import KVCommError

Message = Mapping[str, str]
Prompt = Union[str, Sequence[Message]]


@dataclass(frozen=True)
class Completion:
    """One request's answer and timing.

    Attributes:
        text: the generated text.
        prompt_tokens: tokens in the prompt as the backend counted them (``None`` if not reported).
        completion_tokens: tokens generated (``None`` if not reported).
        cached_prompt_tokens: prompt tokens served from the backend's prefix cache (``None`` when the
            backend cannot say; 0 is a real "nothing was cached").
        ttft_s: request sent -> first generated token received.
        total_s: request sent -> last byte of the answer received.
    """

    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_prompt_tokens: int | None
    ttft_s: float
    total_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrefixCounters:
    """A backend's cumulative prefix-cache counters, in tokens (vLLM: ``vllm:prefix_cache_queries``
    and ``vllm:prefix_cache_hits``). The difference of two readings is the traffic in between."""

    queries: float
    hits: float

    def __sub__(self, other: "PrefixCounters") -> "PrefixCounters":
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits)


def check_prompt(prompt: Prompt) -> None:
    """One-line KVCommError for a prompt that is neither a string nor a list of role/content messages."""
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, Sequence) or not prompt:
        raise KVCommError("a prompt is a string or a non-empty list of chat messages")
    for m in prompt:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise KVCommError(f"a chat message needs string 'role' and 'content' fields, got {m!r:.80}")


def check_request(max_tokens: int, temperature: float) -> None:
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise KVCommError(f"max_tokens must be an integer >= 1 (got {max_tokens!r})")
    if not temperature >= 0:
        raise KVCommError(f"temperature must be >= 0 (got {temperature!r})")


class ModelClient(ABC):
    """A model that answers prompts and, where it can, says what its prefix cache served.

    Attributes:
        kind: ``"hf"``, ``"http"``, ``"vllm"``.
        model: the model's name as the backend knows it.
        block_size: granularity of prefix-cache hits in tokens (vLLM: the KV block size; the in-process
            client: 1), ``None`` when unknown.
        threads: CPU threads the backend computes with, when known (for its CPU share).
    """

    kind: str = ""
    model: str = ""
    block_size: int | None = None
    threads: int | None = None

    @abstractmethod
    def complete(self, prompt: Prompt, max_tokens: int, temperature: float = 0.0) -> Completion:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (greedy at temperature 0)."""

    def tokenize(self, prompt: Prompt) -> list[int] | None:
        """The prompt's token ids as the backend would feed them (chat template applied), or ``None``."""
        return None

    def reset_prefix_cache(self) -> bool:
        """Empty the backend's prefix cache; ``False`` when the backend has no way to."""
        return False

    def prefix_counters(self) -> PrefixCounters | None:
        """The backend's cumulative prefix-cache counters, or ``None`` when it has none."""
        return None

    def cpu_seconds(self) -> float | None:
        """CPU time the backend has used so far (all its threads/processes), or ``None`` when unknown."""
        return None

    def describe(self) -> dict:
        """What a result file records about the backend."""
        return {"kind": self.kind, "model": self.model, "block_size": self.block_size, "threads": self.threads}

    def close(self) -> None:
        """Release what the client holds (a server it started, a model)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Completion", "Message", "ModelClient", "PrefixCounters", "Prompt", "check_prompt", "check_request"]
