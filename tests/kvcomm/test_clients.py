"""The serving clients: the HTTP client against a small OpenAI-compatible server started here on
127.0.0.1 (streamed SSE over chunked HTTP/1.1, usage with cached tokens, /metrics, /reset_prefix_cache,
/tokenize), the `serve-exchange` command end to end against it, and the in-process client on SmolLM2.

The server below is a real HTTP server with a real (word-level, block-granular) prefix cache: its
time to the first token grows with the prompt words it did not have cached, so a measurement that
mixes up warm and cold requests fails.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from common.errors import KVCommError
from kvcomm.clients import PrefixCounters
from kvcomm.clients.openai_http import OpenAIHTTPClient, parse_prometheus
from tests.conftest import gpubench

REPO = Path(__file__).resolve().parents[2]
BLOCK = 4               # the small server's cache block, in words
BASE_S = 0.03           # its fixed time to the first token
PER_WORD_S = 0.002      # and per uncached prompt word
TOKEN_GAP_S = 0.01      # between streamed tokens


class _PrefixServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, report_cached: bool = True):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.report_cached = report_cached
        self.seen: list[list[str]] = []
        self.queries = self.hits = 0
        self.vocab: dict[str, int] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def lookup(self, words: list[str]) -> int:
        """Cached words for this prompt (whole blocks of the longest common prefix, never all of it)."""
        with self.lock:
            best = 0
            for old in self.seen:
                n = 0
                for a, b in zip(old, words):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            cached = min(best, len(words) - 1) // BLOCK * BLOCK
            self.seen.append(words)
            self.queries += len(words)
            self.hits += cached
            return cached


def _words(body: dict) -> list[str]:
    if "messages" in body:
        return " ".join(f"<{m['role']}> {m['content']}" for m in body["messages"]).split()
    return body["prompt"].split()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def do_GET(self):
        srv = self.server
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": "tiny-words", "object": "model"}]})
        if self.path == "/metrics":
            text = (f"# HELP vllm:prefix_cache_queries Prefix cache queries.\n# TYPE vllm:prefix_cache_queries counter\n"
                    f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny-words"}} {float(srv.queries)}\n'
                    f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny-words"}} {float(srv.hits)}\n'
                    f'vllm:prefix_cache_hits_created{{engine="0",model_name="tiny-words"}} 1.7e9\n')
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return None
        return self._json(404, {"detail": "Not Found"})

    def do_POST(self):
        srv = self.server
        body = self._body()
        if self.path == "/reset_prefix_cache":
            with srv.lock:
                srv.seen.clear()
            return self._json(200, {"success": True})
        if self.path == "/tokenize":
            with srv.lock:
                ids = [srv.vocab.setdefault(w, len(srv.vocab)) for w in _words(body)]
            return self._json(200, {"tokens": ids, "count": len(ids)})
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self._json(404, {"detail": "Not Found"})
        if body.get("model") != "tiny-words":
            return self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                              "type": "NotFoundError", "code": 404}})
        if body.get("max_tokens", 16) > 1000:
            return self._json(400, {"error": {"message": "max_tokens is too large:\n1001 > 1000",
                                              "type": "BadRequestError", "code": 400}})
        chat = self.path.endswith("chat/completions")
        words = _words(body)
        cached = srv.lookup(words)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()

        def event(obj) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        if chat:  # a role-only first delta, sent before any token exists (it must not count as the first token)
            event({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        time.sleep(BASE_S + PER_WORD_S * (len(words) - cached))
        n = body.get("max_tokens", 16)
        for i in range(n):
            if i:
                time.sleep(TOKEN_GAP_S)
            text = f"tok{i} "
            finish = "length" if i == n - 1 else None
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            event({"object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(words), "completion_tokens": n, "total_tokens": len(words) + n}
            if srv.report_cached:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            event({"choices": [], "usage": usage})
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        return None


def _start(report_cached: bool = True) -> _PrefixServer:
    srv = _PrefixServer(report_cached)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture()
def prefix_server():
    srv = _start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHARED = [{"role": "system", "content": "You are one agent of a team. " * 10}]


def _chat(question: str) -> list[dict]:
    return SHARED + [{"role": "user", "content": question}]


# ---- the HTTP client ---------------------------------------------------------------------------------
def test_stream_text_usage_and_cached_tokens(prefix_server):
    client = OpenAIHTTPClient(prefix_server.url)
    assert client.model == "tiny-words"  # the server's first model
    first = client.complete(_chat("Name a colour."), max_tokens=3)
    assert first.text == "tok0 tok1 tok2 " and first.completion_tokens == 3
    words = len(_words({"messages": _chat("Name a colour.")}))
    assert first.prompt_tokens == words and first.cached_prompt_tokens == 0
    second = client.complete(_chat("Name a fruit."), max_tokens=3)
    shared = len(_words({"messages": SHARED})) + 1  # the system words and "<user>"
    assert second.cached_prompt_tokens == shared // BLOCK * BLOCK > 0


def test_ttft_is_the_first_token_not_the_role_delta(prefix_server):
    client = OpenAIHTTPClient(prefix_server.url)
    c = client.complete(_chat("Name a colour."), max_tokens=4)
    words = c.prompt_tokens
    expected_first = BASE_S + PER_WORD_S * words
    # the role-only delta arrives at once; the first token only after the (simulated) prefill
    assert c.ttft_s >= expected_first * 0.95
    assert c.total_s >= c.ttft_s + 3 * TOKEN_GAP_S * 0.95
    warm = client.complete(_chat("Name a fruit."), max_tokens=4)
    assert warm.ttft_s < c.ttft_s  # fewer uncached words: an earlier first token


def test_plain_completion_endpoint(prefix_server):
    client = OpenAIHTTPClient(prefix_server.url + "/v1", "tiny-words")
    assert client.base_url == prefix_server.url
    c = client.complete("one two three four five six", max_tokens=2)
    assert c.text == "tok0 tok1 " and c.prompt_tokens == 6 and c.cached_prompt_tokens == 0
    assert c.ttft_s >= BASE_S + 6 * PER_WORD_S - 1e-3


def test_cached_tokens_are_none_when_the_server_does_not_report_them():
    srv = _start(report_cached=False)
    try:
        c = OpenAIHTTPClient(srv.url).complete("a b c", max_tokens=1)
        assert c.cached_prompt_tokens is None and c.prompt_tokens == 3
    finally:
        srv.shutdown()
        srv.server_close()


def test_counters_reset_and_tokenize(prefix_server):
    client = OpenAIHTTPClient(prefix_server.url)
    c0 = client.prefix_counters()
    assert c0 == PrefixCounters(queries=0.0, hits=0.0)
    client.complete(_chat("Name a colour."), max_tokens=1)
    client.complete(_chat("Name a fruit."), max_tokens=1)
    delta = client.prefix_counters() - c0
    assert delta.queries == 2 * len(_words({"messages": _chat("x y z")}))
    assert delta.hits > 0 and delta.hits % BLOCK == 0
    assert client.reset_prefix_cache() is True
    after_reset = client.complete(_chat("Name a fruit."), max_tokens=1)
    assert after_reset.cached_prompt_tokens == 0
    ids_a, ids_b = client.tokenize(_chat("Name a colour.")), client.tokenize(_chat("Name a fruit."))
    assert len(ids_a) == len(_words({"messages": _chat("Name a colour.")})) and ids_a[:-2] == ids_b[:-2]


def test_prometheus_parsing_sums_labels_and_skips_created():
    text = ('# HELP x\nvllm:prefix_cache_hits_total{engine="0"} 128.0\nvllm:prefix_cache_hits_total{engine="1"} 64\n'
            'vllm:prefix_cache_hits_created{engine="0"} 1.7e9\nplain_metric 3\nbroken{a="1"}\n')
    values = parse_prometheus(text)
    assert values["vllm:prefix_cache_hits_total"] == 192.0 and values["plain_metric"] == 3.0
    assert "broken" not in values


def test_connection_refused_is_one_line():
    port = _free_port()
    with pytest.raises(KVCommError) as err:
        OpenAIHTTPClient(f"http://127.0.0.1:{port}", "m").complete("hi", max_tokens=1)
    msg = str(err.value)
    assert "connection refused" in msg and f"127.0.0.1:{port}" in msg and "\n" not in msg


def test_http_errors_carry_the_servers_message_on_one_line(prefix_server):
    client = OpenAIHTTPClient(prefix_server.url)
    with pytest.raises(KVCommError) as err:
        client.complete("hi", max_tokens=1001)
    assert "HTTP 400" in str(err.value) and "max_tokens is too large: 1001 > 1000" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(KVCommError, match="does not exist"):
        OpenAIHTTPClient(prefix_server.url, "no-such-model").complete("hi", max_tokens=1)
    with pytest.raises(KVCommError, match="max_tokens must be"):
        client.complete("hi", max_tokens=0)
    with pytest.raises(KVCommError, match="role"):
        client.complete([{"content": "no role"}], max_tokens=1)
    with pytest.raises(KVCommError, match="http://HOST:PORT"):
        OpenAIHTTPClient("ftp://127.0.0.1:1", "m")


def test_a_server_that_does_not_stream_sse_is_one_line():
    class Plain(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            data = b"<html>not an API</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(KVCommError, match="no server-sent events"):
            OpenAIHTTPClient(f"http://127.0.0.1:{srv.server_address[1]}", "m").complete("hi", max_tokens=1)
    finally:
        srv.shutdown()
        srv.server_close()


# ---- serve-exchange end to end (against the small server) ----------------------------------------------
def test_serve_exchange_cli_measures_warm_and_cold(prefix_server, tmp_path):
    out = tmp_path / "run"
    proc = gpubench("kvcomm", "serve-exchange", "--client", "http", "--url", prefix_server.url, "--block-size", str(BLOCK),
                    "--task", "drift",
                    "--repeats", "2", "--warmup", "0", "--max-tokens-a", "3", "--max-tokens-b", "2", "--out", str(out),
                    timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "repeat 2/2" in proc.stderr and "B TTFT median warm" in proc.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["schema"] == "kvcomm-serve-exchange/1" and s["cold_mode"] == "reset"
    assert s["client"]["kind"] == "http" and s["client"]["model"] == "tiny-words"
    for row in s["rows"]:
        w, c = row["b_warm"], row["b_cold"]
        assert row["a"]["cached_tokens"] == 0  # the cache was emptied before A
        assert w["cached_tokens"] == row["max_cacheable_tokens"] > 0 and w["cached_tokens"] % BLOCK == 0
        assert c["cached_tokens"] == 0 and c["counter_hits"] == 0
        assert w["counter_hits"] == w["cached_tokens"] and w["counter_queries"] == w["prompt_tokens"]
        assert w["ttft_s"] < c["ttft_s"]
        assert row["shared_prefix_tokens"] > row["b_prompt_tokens_tokenized"] / 2  # the log dominates B's prompt
    assert s["ttft_saving_s"]["median"] > 0 and 0 < s["ttft_saving_fraction"] < 1
    assert 0.5 < s["hit_rate"]["b_warm_counters"] == s["hit_rate"]["b_warm_usage"] < 1
    assert s["hit_rate"]["b_cold_usage"] == 0 and s["hit_rate"]["of_cacheable"] == 1.0
    load = s["load"]
    assert load["loadavg_1m_before"] >= 0 and load["loadavg_1m_during"]["n"] == 2 and load["flag_threshold"] == 1.5
    assert load["flagged"] == (load["loadavg_1m_before"] > 1.5 or load["loadavg_1m_during"]["max"] > 1.5)
    lines = (out / "COMMAND").read_text().splitlines()
    assert lines[0].startswith("gpubench kvcomm serve-exchange --client http --url ") and "--block-size 4" in lines[0]
    assert lines[1:] and all(line.startswith("# ") for line in lines[1:])
    assert not list(out.glob(".*.tmp"))


def test_serve_exchange_json_is_the_summary_on_stdout(prefix_server, tmp_path):
    out = tmp_path / "run"
    proc = gpubench("kvcomm", "serve-exchange", "--client", "http", "--url", prefix_server.url, "--block-size", str(BLOCK),
                    "--repeats", "1", "--warmup", "0", "--max-tokens-a", "2", "--max-tokens-b", "2", "--out", str(out),
                    "--json", timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == json.loads((out / "summary.json").read_text())
    assert "repeat 1/1" in proc.stderr  # progress stays on stderr


def test_serve_exchange_salt_mode_misses_without_a_reset(prefix_server, tmp_path):
    from kvcomm.exchange import ExchangeConfig, run_exchange

    client = OpenAIHTTPClient(prefix_server.url)
    s = run_exchange(client, ExchangeConfig(task="multihop", repeats=1, warmup=0, max_tokens_a=2, max_tokens_b=1,
                                            cold="salt"))
    row = s["rows"][0]
    assert s["cold_mode"] == "salt" and row["b_warm"]["cached_tokens"] > 0 and row["b_cold"]["cached_tokens"] == 0


def test_serve_exchange_bad_input_is_one_line(tmp_path):
    port = _free_port()
    cases = ((["--client", "http", "--url", f"http://127.0.0.1:{port}"], "connection refused"),
             (["--client", "http"], "needs --url"),
             (["--task", "keycode"], "the exchange runs drift, multihop"),
             (["--repeats", "0"], "--repeats must be >= 1"),
             (["--client", "hf", "--url", "http://127.0.0.1:1"], "--url is for --client http"),
             (["--block-size", "48"], "multiple of 32"))
    for args, needle in cases:
        proc = gpubench("kvcomm", "serve-exchange", *args, "--out", str(tmp_path / "x"), timeout=300, cwd=REPO)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (args, proc.stderr)
    assert not (tmp_path / "x").exists()


# ---- the in-process client (SmolLM2) ---------------------------------------------------------------
@pytest.mark.model
def test_hf_client_reuses_the_common_prefix_and_answers_the_same(smollm2):
    from kvcomm.clients.hf import HFClient
    from kvcomm.exchange import exchange_prompts

    ex = exchange_prompts("multihop", 0)
    cached, fresh = HFClient(smollm2), HFClient(smollm2, prefix_cache=False)
    a = cached.complete(ex.a_messages, max_tokens=4)
    assert a.cached_prompt_tokens == 0 and a.completion_tokens == 4 and 0 < a.ttft_s <= a.total_s
    b_messages = ex.b_messages(a.text)
    ids_a, ids_b = cached.tokenize(ex.a_messages), cached.tokenize(b_messages)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    b = cached.complete(b_messages, max_tokens=4)
    assert b.cached_prompt_tokens == shared > 100 and b.prompt_tokens == len(ids_b)
    reference = fresh.complete(b_messages, max_tokens=4)
    assert reference.cached_prompt_tokens == 0 and reference.text == b.text
    assert cached.prefix_counters() == PrefixCounters(queries=len(ids_a) + len(ids_b), hits=shared)
    assert cached.reset_prefix_cache() and cached.complete(b_messages, max_tokens=1).cached_prompt_tokens == 0


@pytest.mark.model
def test_hf_exchange_cold_is_a_full_prefill(smollm2):
    from kvcomm.clients.hf import HFClient
    from kvcomm.exchange import ExchangeConfig, run_exchange

    s = run_exchange(HFClient(smollm2), ExchangeConfig(task="multihop", repeats=1, warmup=0, max_tokens_a=4,
                                                       max_tokens_b=1))
    row = s["rows"][0]
    assert s["cold_mode"] == "reset" and s["client"]["block_size"] == 1
    assert row["b_warm"]["cached_tokens"] == row["shared_prefix_tokens"] == row["max_cacheable_tokens"] > 100
    assert row["b_cold"]["cached_tokens"] == 0 and row["b_cold"]["counter_hits"] == 0
    assert row["cpu_s"] is None or row["cpu_s"] >= 0
