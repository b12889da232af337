"""Prefix reuse between two agents on a serving backend: B's time to first token with A's prefix cached vs cold.

The exchange (one per repeat, example i of the ``drift`` or ``multihop`` task, the same seeded
documents as ``gpubench kvcomm eval``): both agents share one system prompt and one document (the
day's access log; the two registers), as agents of one workflow reading the same case file do.

1. agent A gets ``[system, user: document + A's instruction]`` and writes a note (greedy, up to
   ``max_tokens_a`` tokens);
2. agent B gets ``[system, user: document + A's note + the question]``: its prompt starts with the
   very tokens A's prompt started with, so a server with prefix caching can serve that prefix from
   the KV blocks A's request left behind (**warm**);
3. B's same prompt again with nothing cached (**cold**): by default the backend's prefix cache is
   emptied first (vLLM's ``POST /reset_prefix_cache``; the in-process client drops its entries);
   ``cold="salt"`` instead puts a unique tag at the start of the system prompt (for a server that
   cannot reset; a few more tokens and a different prefix, so nothing matches).

Each repeat empties the cache before A (reset mode), so A always starts cold and B warm reuses
exactly what A left. The warm-cold pair is measured back to back; the saving is the paired
difference. Per request we record the backend's own report of cached tokens
(``usage.prompt_tokens_details.cached_tokens``) and, around each B request, the difference of the
server's cumulative prefix-cache counters (vLLM: ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total``): the hit rate is hits / queries in tokens. When the backend can
tokenize, the shared prefix (longest common token prefix of A's and B's prompts) and the most a
block cache can serve of it (whole blocks, leaving at least one token to compute) are recorded too.

Host state: the 1-minute load average before the backend starts and at every repeat, and the
backend's CPU share over each repeat (its CPU seconds / (wall seconds x its threads); the server's
whole process tree for vLLM, this process for the in-process model). A run is **flagged** when the
load before it exceeded :data:`LOAD_FLAG` or the load during it exceeded :data:`LOAD_FLAG` plus the
backend's own threads (its busy threads count in the load average): timings from such a run are
not for quoting.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common.errors import KVCommError, suggest
from kvcomm.load import LOAD_FLAG, load_flags

SCHEMA = "kvcomm-serve-exchange/1"
EXCHANGE_TASKS = ("drift", "multihop")
COLD_MODES = ("auto", "reset", "salt")

SHARED_SYSTEM = ("You are one of the agents of a team working on the same case file. Every agent reads the "
                 "same document below; do only your own part and keep it short.")
_A_PART = {
    "drift": "Agent A, your part: write a short note for the other agents with the current code of every "
             "storage item that appears in the log.",
    "multihop": "Agent A, your part: list the facts of these registers that the other agents need.",
}
_B_PART = ("Agent B, your part: agent A read the same document and wrote the note below. Answer the question "
           "from the document and the note. Reply with the answer only.\nNote from agent A: {note}\nQuestion: {question}")


@dataclass(frozen=True)
class ExchangePrompts:
    """One exchange's prompts (chat messages) and the question's known answer."""

    task: str
    index: int
    document: str
    question: str
    answer: str

    @property
    def a_messages(self) -> list[dict]:
        return [{"role": "system", "content": SHARED_SYSTEM},
                {"role": "user", "content": f"{self.document}\n\n{_A_PART[self.task]}"}]

    def b_messages(self, note: str, salt: str = "") -> list[dict]:
        return [{"role": "system", "content": f"{salt}{SHARED_SYSTEM}"},
                {"role": "user", "content": f"{self.document}\n\n" + _B_PART.format(note=note.strip(),
                                                                                    question=self.question)}]


def check_exchange_task(task: str) -> str:
    if task not in EXCHANGE_TASKS:
        raise KVCommError(f"--task {task!r}: the exchange runs {', '.join(EXCHANGE_TASKS)}{suggest(task, EXCHANGE_TASKS)}")
    return task


def exchange_prompts(task: str, index: int, seed: int = 0) -> ExchangePrompts:
    """The exchange built on example ``index`` of ``kvcomm.tasks`` task ``task`` (seeded alike)."""
    import random

    from kvcomm.tasks import TASKS

    ex = TASKS[check_exchange_task(task)](random.Random(f"{task}:{seed}:{index}"), index)
    if task == "drift":
        # "Here is today's access log.\n\n<log>\n\nWrite a short note ...": the document is all but the ask
        document = ex.messages[0].instruction.rsplit("\n\n", 1)[0]
    else:
        # each sender's "Read this register ...\n\n<register>": the shared document holds both registers
        document = "\n\n".join(m.instruction.split("\n\n", 1)[1] for m in ex.messages)
    return ExchangePrompts(task=task, index=index, document=document, question=ex.question, answer=ex.answer)


@dataclass(frozen=True)
class ExchangeConfig:
    """What to measure.

    Args:
        task: ``drift`` (a ~515-token log) or ``multihop`` (two short registers).
        repeats: exchanges measured (examples 0..repeats-1).
        seed: task seed.
        max_tokens_a: tokens agent A may write.
        max_tokens_b: tokens agent B may write (its TTFT is the figure; a few suffice).
        cold: ``auto`` (reset when the backend can, else salt), ``reset`` or ``salt``.
        warmup: unmeasured exchanges first (the server's first requests are slower).
    """

    task: str = "drift"
    repeats: int = 20
    seed: int = 0
    max_tokens_a: int = 48
    max_tokens_b: int = 8
    cold: str = "auto"
    warmup: int = 1

    def check(self) -> None:
        check_exchange_task(self.task)
        if self.cold not in COLD_MODES:
            raise KVCommError(f"--cold {self.cold!r}: use one of {', '.join(COLD_MODES)}")
        for name in ("repeats", "max_tokens_a", "max_tokens_b"):
            if getattr(self, name) < 1:
                raise KVCommError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if self.warmup < 0:
            raise KVCommError(f"--warmup must be >= 0 (got {self.warmup})")


def _counters_after(client, before, timeout_s: float = 2.0):
    """The counters once they include the request just finished (the server may publish them a moment
    after the stream ends); the last reading if they do not move within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = client.prefix_counters()
        if now is None or before is None or now.queries != before.queries or time.monotonic() > deadline:
            return now
        time.sleep(0.02)


def _timed(client, messages, max_tokens: int) -> dict:
    before = client.prefix_counters()
    c = client.complete(messages, max_tokens=max_tokens, temperature=0.0)
    after = _counters_after(client, before)
    row = {"ttft_s": c.ttft_s, "total_s": c.total_s, "prompt_tokens": c.prompt_tokens,
           "completion_tokens": c.completion_tokens, "cached_tokens": c.cached_prompt_tokens, "text": c.text}
    if before is not None and after is not None:
        delta = after - before
        row |= {"counter_queries": delta.queries, "counter_hits": delta.hits}
    return row


def _max_block_hit(shared: int, prompt_len: int, block_size: int | None) -> int:
    usable = min(shared, prompt_len - 1)  # the last prompt token is always computed
    if not block_size or block_size <= 1:
        return max(usable, 0)
    return max(usable, 0) // block_size * block_size


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def resolve_cold(client, cold: str) -> str:
    """``reset`` or ``salt``; ``reset`` on a backend that cannot is a one-line error."""
    if cold == "salt":
        return "salt"
    if client.reset_prefix_cache():
        return "reset"
    if cold == "reset":
        raise KVCommError(f"--cold reset: the {client.kind} backend at {client.describe().get('base_url', client.model)} "
                          f"has no prefix-cache reset (vLLM needs VLLM_SERVER_DEV_MODE=1); use --cold salt")
    return "salt"


def run_exchange(client, cfg: ExchangeConfig, *, load_before: float | None = None,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Measure ``cfg.repeats`` exchanges on ``client``; returns the summary (see :func:`summarize`)."""
    cfg.check()
    cold = resolve_cold(client, cfg.cold)
    threads = client.threads or 0
    say = progress or (lambda _msg: None)

    def one(index: int, measured: bool) -> dict:
        ex = exchange_prompts(cfg.task, index, cfg.seed)
        load = os.getloadavg()[0]
        cpu0, w0 = client.cpu_seconds(), time.perf_counter()
        if cold == "reset":
            client.reset_prefix_cache()
        a = _timed(client, ex.a_messages, cfg.max_tokens_a)
        b_messages = ex.b_messages(a["text"])
        warm = _timed(client, b_messages, cfg.max_tokens_b)
        salt = ""
        if cold == "reset":
            client.reset_prefix_cache()
        else:
            salt = f"[request {uuid.uuid4().hex[:12]}] "
        cold_row = _timed(client, ex.b_messages(a["text"], salt), cfg.max_tokens_b)
        wall, cpu1 = time.perf_counter() - w0, client.cpu_seconds()
        row: dict[str, Any] = {"index": index, "measured": measured, "loadavg_1m": load, "wall_s": wall,
               "cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0, "a": a, "b_warm": warm, "b_cold": cold_row,
               "answer": ex.answer, "b_answer_found": ex.answer.lower() in warm["text"].lower()}
        row["cpu_share"] = (row["cpu_s"] / (wall * threads)) if row["cpu_s"] is not None and threads else None
        tok_a, tok_b = client.tokenize(ex.a_messages), client.tokenize(b_messages)
        if tok_a is not None and tok_b is not None:
            shared = _common_prefix(tok_a, tok_b)
            row |= {"shared_prefix_tokens": shared, "b_prompt_tokens_tokenized": len(tok_b),
                    "max_cacheable_tokens": _max_block_hit(shared, len(tok_b), client.block_size)}
        return row

    for k in range(cfg.warmup):
        say(f"warm-up exchange {k + 1}/{cfg.warmup}")
        one(1_000_000 + k, measured=False)  # an index no measured repeat uses
    rows = []
    for i in range(cfg.repeats):
        row = one(i, measured=True)
        rows.append(row)
        w, c = row["b_warm"], row["b_cold"]
        say(f"repeat {i + 1}/{cfg.repeats}: B TTFT warm {1e3 * w['ttft_s']:.0f} ms, cold {1e3 * c['ttft_s']:.0f} ms; "
            f"cached {w['cached_tokens']}/{w['prompt_tokens']} tokens; load {row['loadavg_1m']:.2f}")
    return summarize(rows, client=client.describe(), cfg=cfg, cold_mode=cold, load_before=load_before)


def _stats(values) -> dict | None:
    v = sorted(float(x) for x in values if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not v:
        return None
    q = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else [v[0]] * 3
    return {"n": len(v), "median": statistics.median(v), "p25": q[0], "p75": q[2], "min": v[0], "max": v[-1]}


def _ratio(num, den) -> float | None:
    num = [x for x in num if x is not None]
    den = [x for x in den if x is not None]
    if not num or len(num) != len(den) or sum(den) == 0:
        return None
    return sum(num) / sum(den)


def summarize(rows: list[dict], *, client: dict, cfg: ExchangeConfig, cold_mode: str,
              load_before: float | None) -> dict:
    """The summary: TTFT warm/cold/saving statistics, hit rates, load, and every repeat's row."""
    warm = [r["b_warm"] for r in rows]
    cold = [r["b_cold"] for r in rows]
    ttft_w = [w["ttft_s"] for w in warm]
    ttft_c = [c["ttft_s"] for c in cold]
    saving = [c - w for w, c in zip(ttft_w, ttft_c)]
    med_w, med_c = statistics.median(ttft_w), statistics.median(ttft_c)
    threads = client.get("threads") or 0
    loads = [r["loadavg_1m"] for r in rows]
    flags = load_flags(load_before, loads, threads, whose="the backend's")
    hit_rate = {
        "b_warm_usage": _ratio([w["cached_tokens"] for w in warm], [w["prompt_tokens"] for w in warm]),
        "b_warm_counters": _ratio([w.get("counter_hits") for w in warm], [w.get("counter_queries") for w in warm]),
        "b_cold_usage": _ratio([c["cached_tokens"] for c in cold], [c["prompt_tokens"] for c in cold]),
        "b_cold_counters": _ratio([c.get("counter_hits") for c in cold], [c.get("counter_queries") for c in cold]),
        "a_counters": _ratio([r["a"].get("counter_hits") for r in rows], [r["a"].get("counter_queries") for r in rows]),
        "of_cacheable": _ratio([w["cached_tokens"] for w in warm], [r.get("max_cacheable_tokens") for r in rows]),
    }
    return {
        "schema": SCHEMA,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "num_cpus": os.cpu_count(),
        "client": client, "config": asdict(cfg), "cold_mode": cold_mode,
        "ttft_warm_s": _stats(ttft_w), "ttft_cold_s": _stats(ttft_c), "ttft_saving_s": _stats(saving),
        "ttft_cold_over_warm": _stats([c / w for w, c in zip(ttft_w, ttft_c) if w > 0]),
        "ttft_saving_fraction": 1.0 - med_w / med_c if med_c > 0 else None,
        "hit_rate": hit_rate,
        "b_cached_tokens": _stats([w["cached_tokens"] for w in warm]),
        "b_prompt_tokens": _stats([w["prompt_tokens"] for w in warm]),
        "shared_prefix_tokens": _stats([r.get("shared_prefix_tokens") for r in rows]),
        "b_answer_found": sum(r["b_answer_found"] for r in rows) / len(rows),
        "load": {"loadavg_1m_before": load_before, "loadavg_1m_during": _stats(loads),
                 "cpu_share": _stats([r["cpu_share"] for r in rows]), "flag_threshold": LOAD_FLAG,
                 "flagged": bool(flags), "flags": flags},
        "rows": rows,
    }


def headline(summary: dict) -> str:
    """One paragraph for stdout and COMMAND notes."""
    w, c, s = summary["ttft_warm_s"], summary["ttft_cold_s"], summary["ttft_saving_s"]
    hr = summary["hit_rate"]
    rate = hr["b_warm_counters"] if hr["b_warm_counters"] is not None else hr["b_warm_usage"]
    rate_s = "n/a" if rate is None else f"{100 * rate:.1f} %"
    frac = summary["ttft_saving_fraction"]
    return (f"B TTFT median warm {1e3 * w['median']:.1f} ms (IQR {1e3 * w['p25']:.1f}-{1e3 * w['p75']:.1f}), "
            f"cold {1e3 * c['median']:.1f} ms (IQR {1e3 * c['p25']:.1f}-{1e3 * c['p75']:.1f}); paired saving median "
            f"{1e3 * s['median']:.1f} ms ({'n/a' if frac is None else f'{100 * frac:.0f} %'} of cold); "
            f"prefix-cache hit rate of B's prompt {rate_s}; n = {w['n']}")


def write_outputs(out_dir: Path, summary: dict, command: str) -> None:
    """summary.json and COMMAND (the command, then notes as '#' lines), each written atomically."""
    from common.outdir import write_text_atomic

    out_dir = Path(out_dir)
    write_text_atomic(out_dir / "summary.json", json.dumps({"command": command, **summary}, indent=1) + "\n")
    load = summary["load"]
    share = load["cpu_share"]
    notes = [f"measured {summary['created_utc']} on {summary['host']} ({summary['num_cpus']} CPUs), backend "
             f"{summary['client']['kind']} {summary['client']['model']}, cold = {summary['cold_mode']}",
             headline(summary),
             f"load average 1 min: {'n/a' if load['loadavg_1m_before'] is None else format(load['loadavg_1m_before'], '.2f')} before, "
             f"{load['loadavg_1m_during']['median']:.2f} median during; backend CPU share median "
             f"{'n/a' if share is None else format(share['median'], '.2f')}",
             ("FLAGGED, not for quoting: " + "; ".join(load["flags"])) if load["flagged"] else "not flagged (load below the threshold)"]
    write_text_atomic(out_dir / "COMMAND", command.strip() + "\n" + "".join(f"# {n}\n" for n in notes))
