"""A client for any OpenAI-compatible server, on the standard library only (``http.client``).

Every completion is streamed (``"stream": true`` with ``stream_options.include_usage``), so the time
to the first token is measured on this side: the clock starts after the TCP connection is open, just
before the request is sent, and stops when the first server-sent event carrying generated text
arrives (a role-only chat delta does not count; a stream that generates no text at all takes the
first event with a ``finish_reason``). ``total_s`` stops at the end of the stream.

What the server may report, each read only when present:

- ``usage.prompt_tokens_details.cached_tokens`` in the final usage event (vLLM: with
  ``--enable-prompt-tokens-details``): the prompt tokens served by its prefix cache;
- ``GET /metrics`` (Prometheus text): the cumulative token counters ``vllm:prefix_cache_queries_total``
  and ``vllm:prefix_cache_hits_total``;
- ``POST /reset_prefix_cache`` (vLLM with ``VLLM_SERVER_DEV_MODE=1``): empty the prefix cache;
- ``POST /tokenize``: the prompt's token ids as the server will feed them.

Errors are one line (:class:`common.errors.KVCommError`): a server that is not there (connection
refused), a timeout, an HTTP error status (with the server's own message), a stream that is not SSE.
"""
from __future__ import annotations

import http.client
import json
import os
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from common.errors import KVCommError
from kvcomm.clients import Completion, ModelClient, PrefixCounters, Prompt, check_prompt, check_request

PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels summed over: one engine here) of a Prometheus
    text exposition; comments and unparsable lines are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name, rest = line[:brace], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def process_tree_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and its live descendants (Linux ``/proc``), or ``None``."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except (OSError, ValueError, AttributeError):
        return None
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            continue  # exited while we looked
        fields = raw[raw.rfind(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
        try:
            parent[int(entry)] = int(fields[1])
            cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        except (IndexError, ValueError):
            continue
    if pid not in cpu:
        return None
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu[p] for p in tree)


class OpenAIHTTPClient(ModelClient):
    """Streams completions from ``base_url`` (``http://host:port``, with or without ``/v1``).

    Args:
        base_url: where the server listens.
        model: the model name to send; default: the first of ``GET /v1/models``.
        timeout_s: socket timeout of every read (a server that says nothing for this long is an error).
        block_size: the server's prefix-cache granularity in tokens, when the caller knows it.
        threads: the server's CPU threads, when the caller knows it.
        server_pid: the server's process id, when it runs on this machine (for its CPU seconds).
    """

    kind = "http"

    def __init__(self, base_url: str, model: str | None = None, *, timeout_s: float = 300.0,
                 block_size: int | None = None, threads: int | None = None, server_pid: int | None = None):
        parts = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise KVCommError(f"--url {base_url!r}: use http://HOST:PORT (an OpenAI-compatible server)")
        try:
            port = parts.port
        except ValueError:
            raise KVCommError(f"--url {base_url!r}: the port is not a number 1-65535") from None
        self._scheme, self._host = parts.scheme, parts.hostname
        self._port = port or (443 if parts.scheme == "https" else 80)
        path = parts.path.rstrip("/")
        self._root = path[:-3] if path.endswith("/v1") else path  # /v1/... and /metrics live under it
        self.base_url = f"{parts.scheme}://{parts.netloc}{self._root}"
        self.timeout_s = float(timeout_s)
        self.block_size, self.threads, self.server_pid = block_size, threads, server_pid
        self.model = model or self._first_model()

    # ---- transport ---------------------------------------------------------------------------------
    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.timeout_s)
        try:
            conn.connect()
        except ConnectionRefusedError:
            raise KVCommError(f"cannot reach {self.base_url}: connection refused (is the server running?)") from None
        except socket.timeout:
            raise KVCommError(f"cannot reach {self.base_url}: no connection within {self.timeout_s:.0f} s") from None
        except OSError as exc:
            raise KVCommError(f"cannot reach {self.base_url}: {_one_line(exc.strerror or exc)}") from None
        return conn

    def _send(self, conn, method: str, path: str, body: dict | None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "text/event-stream, application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.request(method, self._root + path, body=data, headers=headers)
            return conn.getresponse()
        except socket.timeout:
            raise KVCommError(f"{self.base_url}{path}: no answer within {self.timeout_s:.0f} s") from None
        except (http.client.HTTPException, OSError) as exc:
            raise KVCommError(f"{self.base_url}{path}: the connection failed: {_one_line(exc) or type(exc).__name__}") from None

    def _http_error(self, path: str, resp, raw: bytes) -> KVCommError:
        message = raw.decode("utf-8", "replace")
        try:
            obj = json.loads(message)
            err = obj.get("error", obj) if isinstance(obj, dict) else obj
            if isinstance(err, dict):
                message = err.get("message") or err.get("detail") or json.dumps(err)
            elif isinstance(err, str):
                message = err
        except ValueError:
            pass
        return KVCommError(f"{self.base_url}{path}: HTTP {resp.status} {resp.reason}: {_one_line(message) or 'no message'}")

    def _json(self, method: str, path: str, body: dict | None = None, *, missing_ok: bool = False):
        """The JSON (or text) answer of a non-streamed call; ``None`` on 404/405 when ``missing_ok``."""
        conn = self._connect()
        try:
            resp = self._send(conn, method, path, body)
            try:
                raw = resp.read()
            except (socket.timeout, http.client.HTTPException, OSError) as exc:
                raise KVCommError(f"{self.base_url}{path}: reading the answer failed: {_one_line(exc)}") from None
            if missing_ok and resp.status in (404, 405):
                return None
            if resp.status != 200:
                raise self._http_error(path, resp, raw)
            text = raw.decode("utf-8", "replace")
            if "json" not in (resp.getheader("Content-Type") or ""):
                return text
            try:
                return json.loads(text)
            except ValueError:
                raise KVCommError(f"{self.base_url}{path}: the answer is not JSON: {_one_line(text, 120)}") from None
        finally:
            conn.close()

    def _first_model(self) -> str:
        listing = self._json("GET", "/v1/models")
        try:
            return str(listing["data"][0]["id"])
        except (TypeError, KeyError, IndexError):
            raise KVCommError(f"{self.base_url}/v1/models lists no model; pass the model name") from None

    # ---- ModelClient -------------------------------------------------------------------------------
    def complete(self, prompt: Prompt, max_tokens: int, temperature: float = 0.0) -> Completion:
        check_prompt(prompt)
        check_request(max_tokens, temperature)
        chat = not isinstance(prompt, str)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        body["messages" if chat else "prompt"] = prompt if isinstance(prompt, str) else [dict(m) for m in prompt]
        conn = self._connect()
        try:
            t0 = time.perf_counter()
            resp = self._send(conn, "POST", path, body)
            if resp.status != 200:
                raise self._http_error(path, resp, resp.read())
            return self._read_stream(path, resp, t0, chat)
        finally:
            conn.close()

    def _read_stream(self, path: str, resp, t0: float, chat: bool) -> Completion:
        pieces: list[str] = []
        usage: dict | None = None
        first_text = first_finish = None
        events = 0
        try:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line or line.startswith(":") or not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event:/id: fields
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    event = json.loads(payload)
                except ValueError:
                    raise KVCommError(f"{self.base_url}{path}: a stream event is not JSON: {_one_line(payload, 120)}") from None
                events += 1
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    err = event["error"]
                    raise KVCommError(f"{self.base_url}{path}: the server failed mid-stream: "
                                      f"{_one_line(err.get('message', err) if isinstance(err, dict) else err)}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        pieces.append(text)
                        if first_text is None:
                            first_text = now
                    if choice.get("finish_reason") and first_finish is None:
                        first_finish = now
        except socket.timeout:
            raise KVCommError(f"{self.base_url}{path}: the stream stalled for {self.timeout_s:.0f} s") from None
        except (http.client.HTTPException, OSError) as exc:
            raise KVCommError(f"{self.base_url}{path}: the stream broke: {_one_line(exc) or type(exc).__name__}") from None
        t_end = time.perf_counter()
        if events == 0:
            raise KVCommError(f"{self.base_url}{path}: the answer has no server-sent events (is it an OpenAI-compatible server?)")
        first = first_text if first_text is not None else first_finish if first_finish is not None else t_end
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Completion(text="".join(pieces), prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
                          completion_tokens=_int_or_none(usage.get("completion_tokens")),
                          cached_prompt_tokens=_int_or_none(cached), ttft_s=first - t0, total_s=t_end - t0)

    def tokenize(self, prompt: Prompt) -> list[int] | None:
        check_prompt(prompt)
        body: dict[str, Any] = {"model": self.model}
        if isinstance(prompt, str):
            body["prompt"] = prompt
        else:
            body |= {"messages": [dict(m) for m in prompt], "add_generation_prompt": True}
        try:
            answer = self._json("POST", "/tokenize", body, missing_ok=True)
        except KVCommError:
            return None  # a server without (or with a different) tokenize route: the caller goes without
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache``; retried briefly while the server still holds blocks."""
        for attempt in range(20):
            answer = self._json("POST", "/reset_prefix_cache", missing_ok=True)
            if answer is None:
                return False
            if not isinstance(answer, dict) or answer.get("success", True):
                return True
            time.sleep(0.05 * (attempt + 1))
        raise KVCommError(f"{self.base_url}/reset_prefix_cache: the server kept refusing to reset (blocks in use)")

    def prefix_counters(self) -> PrefixCounters | None:
        text = self._json("GET", "/metrics", missing_ok=True)
        if not isinstance(text, str):
            return None
        values = parse_prometheus(text)

        def get(name: str) -> float | None:
            return values.get(f"{name}_total", values.get(name))

        queries, hits = get(PREFIX_QUERIES), get(PREFIX_HITS)
        if queries is None or hits is None:
            return None
        return PrefixCounters(queries=queries, hits=hits)

    def cpu_seconds(self) -> float | None:
        return process_tree_cpu_seconds(self.server_pid) if self.server_pid else None

    def describe(self) -> dict:
        return super().describe() | {"base_url": self.base_url}


def _int_or_none(value) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
