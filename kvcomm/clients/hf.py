"""The in-process backend: a transformers model (``kvcomm.models.load_model``) behind ``ModelClient``.

Prefix cache: after each request the client keeps the KV cache of the whole sequence it fed (prompt
and generated tokens, with their token ids), the ``max_entries`` most recent ones. A new prompt
reuses the longest common token prefix with any of them (token-granular, ``block_size`` 1; at least
one prompt token is always computed, so the first token's logits are fresh) and prefills only the
rest (``kvcomm.cache.continue_from``). The reused K/V are the very tensors the model computed for
those tokens at those positions, so the answer is the one a full prefill gives (up to float
summation order). ``cached_prompt_tokens`` is the number of prompt tokens reused.

Timing is this process's clock: ``ttft_s`` covers tokenization, the prefill of the uncached tokens
and the first token's argmax (or sample); ``total_s`` the whole decode.
"""
from __future__ import annotations

import time

import torch

from common.errors import KVCommError
from kvcomm.clients import Completion, ModelClient, PrefixCounters, Prompt, check_prompt, check_request


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D id tensors."""
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


class HFClient(ModelClient):
    """A causal LM in this process.

    Args:
        model: a ``kvcomm.models.load_model`` spec (``"smollm2-135m"``, an HF directory, ...) or a
            ``(model, tokenizer)`` pair already loaded.
        prefix_cache: reuse cached prefixes (off: every request is a full prefill, cached 0).
        max_entries: sequences kept for reuse.
        threads: torch intra-op threads while a request runs (``None``: leave torch's setting).
        seed: seed of sampling at temperature > 0.
    """

    kind = "hf"
    block_size = 1

    def __init__(self, model="smollm2-135m", *, prefix_cache: bool = True, max_entries: int = 4,
                 threads: int | None = None, seed: int = 0):
        if isinstance(model, tuple):
            self._model, self._tok = model
            self.model = getattr(getattr(self._model, "config", None), "name_or_path", "") or type(self._model).__name__
        else:
            from kvcomm.models import load_model

            self._model, self._tok = load_model(model)
            self.model = str(model)
        if self._tok is None:
            raise KVCommError(f"{self.model}: the in-process client needs a model with a tokenizer")
        if max_entries < 1:
            raise KVCommError(f"max_entries must be >= 1 (got {max_entries})")
        self.prefix_cache, self.max_entries = prefix_cache, max_entries
        self.threads = threads
        self._entries: list = []  # KVCache objects, most recent last
        self._generator = torch.Generator().manual_seed(seed)
        self._queries = 0
        self._hits = 0

    def tokenize(self, prompt: Prompt) -> list[int]:
        check_prompt(prompt)
        if isinstance(prompt, str):
            return list(self._tok(prompt)["input_ids"])
        if not getattr(self._tok, "chat_template", None):
            raise KVCommError(f"{self.model}: its tokenizer has no chat template; send a plain string prompt")
        ids = self._tok.apply_chat_template([dict(m) for m in prompt], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _best_entry(self, ids: torch.Tensor):
        best, best_len = None, 0
        for entry in self._entries:
            n = common_prefix(entry.token_ids, ids)
            if n > best_len:
                best, best_len = entry, n
        return best, min(best_len, ids.numel() - 1)

    def _pick(self, logits: torch.Tensor, temperature: float) -> int:
        if temperature == 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))

    @torch.no_grad()
    def complete(self, prompt: Prompt, max_tokens: int, temperature: float = 0.0) -> Completion:
        from kvcomm.cache import continue_from, greedy_generate, prefill

        check_request(max_tokens, temperature)
        previous = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            t0 = time.perf_counter()
            ids = torch.tensor(self.tokenize(prompt), dtype=torch.long)
            if ids.numel() == 0:
                raise KVCommError("the prompt has no tokens")
            entry, reuse = self._best_entry(ids) if self.prefix_cache else (None, 0)
            if reuse > 0:
                assert entry is not None  # reuse > 0 only with an entry
                cache, logits = continue_from(self._model, entry.slice(0, reuse), ids[reuse:])
            else:
                cache, logits = prefill(self._model, ids)
            first = self._pick(logits[0, -1], temperature)
            ttft = time.perf_counter() - t0
            eos = self._tok.eos_token_id
            tokens = [first]
            if max_tokens > 1 and first != eos:
                if temperature == 0:
                    more, cache, _ = greedy_generate(self._model, cache, [first], max_tokens - 1, eos_token_id=eos)
                    tokens += more
                else:
                    more, cache = self._sample(cache, first, max_tokens - 1, temperature, eos)
                    tokens += more
            total = time.perf_counter() - t0
        finally:
            torch.set_num_threads(previous)
        self._queries += int(ids.numel())
        self._hits += reuse
        if self.prefix_cache:
            self._entries = (self._entries + [cache])[-self.max_entries:]
        text = self._tok.decode([t for t in tokens if t != eos], skip_special_tokens=True)
        return Completion(text=text, prompt_tokens=int(ids.numel()), completion_tokens=len(tokens),
                          cached_prompt_tokens=reuse, ttft_s=ttft, total_s=total)

    def _sample(self, cache, first: int, n: int, temperature: float, eos):
        from kvcomm.cache import continue_from

        out, token = [], first
        for _ in range(n):
            cache, logits = continue_from(self._model, cache, [token])
            token = self._pick(logits[0, -1], temperature)
            out.append(token)
            if token == eos:
                break
        return out, cache

    def reset_prefix_cache(self) -> bool:
        self._entries = []
        return True

    def prefix_counters(self) -> PrefixCounters:
        return PrefixCounters(queries=float(self._queries), hits=float(self._hits))

    def cpu_seconds(self) -> float:
        return time.process_time()

    def describe(self) -> dict:
        return super().describe() | {"threads": self.threads or torch.get_num_threads()}

    def close(self) -> None:
        self._entries = []
