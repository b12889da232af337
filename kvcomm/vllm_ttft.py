"""`gpubench kvcomm vllm-ttft`: agent B on a real vLLM engine, taking in a message as text or as
imported K/V through vLLM's own KV connector.

The exchanges are `kvcomm ttft`'s (a sender's access log of L tokens, B's system prompt, the
question). This project's model (the same SmolLM2 weights vLLM loads) computes what B would import:

- ``text``: nothing; B's engine prefills the whole prompt;
- ``own-kv``: B's own K/V of the whole prompt (what B's engine would compute itself): the identity
  import, which checks that the K/V reach vLLM's cache in its layout (B's tokens must be text's);
- ``kv-rerotated``: the sender's K/V of its message, computed in its own chat and re-rotated to B's
  positions (the protocol `kvcomm ttft` times in this project's engine), B's own K/V elsewhere.

The K/V goes to a KV-consumer engine through vLLM's ExampleConnector (vllmref.kv_import writes the
connector's files, untimed: that is the transfer, its time reported apart); ``text`` runs on an
engine without a connector. Both are ``vllmref.worker_serve`` processes with one OpenMP thread. Each
timed request follows a reset of the engine's prefix cache and an untimed request of B's prefix
(system prompt and header), so B's prefix is cached, as in `kvcomm ttft`. TTFT is from sending the
request to the end of the step that produced its first token. Rounds are interleaved (every
protocol once per round, rotated order, after an untimed warm-up round); the speedup is the median
over rounds of TTFT(text) / TTFT(protocol) in the same round.
"""
from __future__ import annotations

import json
import queue
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common.errors import KVCommError

PROTOCOLS = ("text", "own-kv", "kv-rerotated")
NUM_OUT = 8  # greedy tokens compared with text's
BLOCK_SIZE = 128  # vLLM's CPU default; vllmref.kv_import's layout needs 2 x head_dim


@dataclass(frozen=True)
class VllmTtftConfig:
    lengths: tuple[int, ...]
    repeats: int = 5
    seed: int = 0

    def check(self) -> None:
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise KVCommError(f"--lengths must be positive token counts (got {list(self.lengths)})")
        if self.repeats < 1:
            raise KVCommError(f"--repeats must be >= 1 (got {self.repeats})")


class _Engine:
    """One ``worker_serve`` process and its events, read on a thread."""

    def __init__(self, proc) -> None:
        from vllmref import env

        self.proc = proc
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=env.pump_events, args=(proc, self.events.put), daemon=True).start()

    def send(self, command: dict) -> None:
        from vllmref import env

        env.send_command(self.proc, command)

    def wait(self, kind: str, request_id: str | None = None, timeout_s: float = 900.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ev = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise KVCommError(f"the vLLM engine sent no '{kind}' within {timeout_s:.0f} s") from None
            if ev["ev"] == "exit":
                raise KVCommError(f"the vLLM engine exited (code {ev['code']})")
            if ev["ev"] == kind and (request_id is None or ev.get("id") == request_id):
                return ev

    def request(self, request_id: str, prompt: list[int], n_out: int) -> tuple[float, list[int]]:
        """``(seconds to the first token, greedy tokens)``."""
        t0 = time.perf_counter()
        self.send({"op": "add", "id": request_id, "prompt": prompt, "n_out": n_out})
        first = self.wait("first", request_id)
        done = self.wait("done", request_id)
        return first["t"] - t0, list(done["tokens"])


def _exchanges(cfg: VllmTtftConfig, tmp: Path) -> list[dict]:
    """Per length: B's prompt, its prefix, and the K/V files of ``own-kv`` and ``kv-rerotated``."""
    import safetensors.torch

    from kvcomm.layout import receiver_prefix
    from kvcomm.models import load_model, rope_info
    from kvcomm.protocols import ProtocolSpec, receive
    from kvcomm.ttft import exchange

    model, tokenizer = load_model("smollm2-135m")
    rope, rng, out = rope_info(model), random.Random(cfg.seed), []
    for length in cfg.lengths:
        layout, senders = exchange(model, tokenizer, length, 1, rng)
        prefix = receiver_prefix(model, layout)
        files = {}
        for name, proto in (("own-kv", "text"), ("kv-rerotated", "kv-rerotated")):
            cache = receive(model, ProtocolSpec(proto), layout, senders, prefix, rope).cache
            path = tmp / f"kv-{length}-{name}.safetensors"
            safetensors.torch.save_file({f"{kv}.{i}": t[0].transpose(0, 1).contiguous().float()
                                         for kv, layers in (("k", cache.keys), ("v", cache.values))
                                         for i, t in enumerate(layers)}, str(path))
            files[name] = str(path)
        out.append({"length": layout.num_imported, "prompt": list(layout.ids), "prefix": list(layout.segments[0].ids),
                    "files": files})
    return out


def _engine_spec(exchanges: list[dict]) -> dict:
    from vllmref import env
    from vllmref.settings import max_model_len

    model_dir, real, _ = env.resolve_model("smollm2-135m")
    longest = max(len(x["prompt"]) for x in exchanges) + NUM_OUT
    model_len = max_model_len(longest, BLOCK_SIZE)
    return {"model": str(model_dir), "real_weights": real, "block_size": BLOCK_SIZE, "max_model_len": model_len,
            "max_num_batched_tokens": max(4096, model_len), "num_gpu_blocks": 2 * model_len // BLOCK_SIZE + 2}


def run(cfg: VllmTtftConfig, *, progress=None) -> list[dict]:
    """Every (length, round, protocol) as a row."""
    import os

    from common.model_config import load_model_config
    from vllmref import env

    cfg.check()
    vocab = load_model_config("smollm2-135m").vocab_size
    with tempfile.TemporaryDirectory(prefix="gpubench-kvimport-") as tmp_dir, env.vllmref_path() as pythonpath:
        tmp = Path(tmp_dir)
        exchanges = _exchanges(cfg, tmp)
        engine = _engine_spec(exchanges)
        specs = [{"vocab_size": vocab, "seed": cfg.seed, "engine": engine},
                 {"vocab_size": vocab, "seed": cfg.seed,
                  "engine": engine | {"kv_transfer": {"role": "kv_consumer", "path": str(tmp / "kv")}}}]
        procs = [env.spawn_worker("worker_serve", s, tmp, threads=1, kv_cache_gib=1.0, pythonpath=pythonpath) for s in specs]
        try:
            plain, consumer = (_Engine(p) for p in procs)
            for e in (plain, consumer):
                e.wait("ready")
            rows = _rounds(cfg, exchanges, plain, consumer, progress)
            for e in (plain, consumer):
                e.send({"op": "stop"})
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    load = os.getloadavg()[0]
    for r in rows:
        r["loadavg_1m_end"] = load
    return rows


def _rounds(cfg: VllmTtftConfig, exchanges: list[dict], plain: _Engine, consumer: _Engine, progress) -> list[dict]:
    import os

    rows: list[dict] = []
    for x in exchanges:
        for rnd in range(cfg.repeats + 1):  # round 0 is the warm-up, not kept
            order = list(PROTOCOLS[rnd % 3:] + PROTOCOLS[:rnd % 3])
            load = os.getloadavg()[0]
            for proto in order:
                engine = plain if proto == "text" else consumer
                rid = f"{x['length']}-{rnd}-{proto}"
                engine.send({"op": "reset"})
                engine.wait("reset")
                engine.request(f"{rid}-prefix", x["prefix"], 1)  # B's prefix, cached as a server keeps it
                moved = {"tokens": 0, "bytes": 0, "write_s": 0.0}
                if proto != "text":
                    engine.send({"op": "import", "id": rid, "prompt": x["prompt"], "kv": x["files"][proto]})
                    moved = engine.wait("imported", rid)
                ttft, tokens = engine.request(rid, x["prompt"], NUM_OUT)
                if rnd:
                    rows.append({"num_imported": x["length"], "num_prompt_tokens": len(x["prompt"]), "round": rnd,
                                 "protocol": proto, "ttft_s": ttft, "tokens": tokens, "kv_tokens": moved["tokens"],
                                 "kv_bytes": moved["bytes"], "file_write_s": moved["write_s"], "loadavg_1m": load})
        if progress is not None:
            progress(f"{x['length']} imported tokens: {cfg.repeats} rounds")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per length and protocol: median TTFT, the paired speedup over text, the share of rounds whose
    greedy tokens equal text's, and the connector's file write."""
    out = []
    for length in sorted({r["num_imported"] for r in rows}):
        mine = [r for r in rows if r["num_imported"] == length]
        text = {r["round"]: r for r in mine if r["protocol"] == "text"}
        for proto in PROTOCOLS:
            rs = [r for r in mine if r["protocol"] == proto]
            out.append({"num_imported": length, "protocol": proto, "rounds": len(rs),
                        "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
                        "speedup_vs_text": statistics.median(text[r["round"]]["ttft_s"] / r["ttft_s"] for r in rs),
                        # with the connector's file write (the transfer) on B's path
                        "e2e_speedup_vs_text": statistics.median(text[r["round"]]["ttft_s"] / (r["ttft_s"] + r["file_write_s"])
                                                                 for r in rs),
                        "tokens_equal_text": sum(r["tokens"] == text[r["round"]]["tokens"] for r in rs) / len(rs),
                        "first_token_equal_text": sum(r["tokens"][:1] == text[r["round"]]["tokens"][:1] for r in rs) / len(rs),
                        "kv_bytes": rs[0]["kv_bytes"], "file_write_median_s": statistics.median(r["file_write_s"] for r in rs)})
    return out


def markdown_table(summary: list[dict]) -> str:
    lines = ["| imported tokens | protocol | TTFT median (ms) | speedup vs text (paired) | with the file write | "
             "8 greedy tokens = text's | connector file (MB) | file write median (ms) |", "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['num_imported']} | {s['protocol']} | {s['ttft_median_s'] * 1e3:.1f} | {s['speedup_vs_text']:.2f}x | "
                     f"{s['e2e_speedup_vs_text']:.2f}x | {s['tokens_equal_text']:.0%} | {s['kv_bytes'] / 1e6:.1f} | "
                     f"{s['file_write_median_s'] * 1e3:.1f} |")
    return "\n".join(lines) + "\n"


def register(kv_sub) -> None:
    """`gpubench kvcomm vllm-ttft`."""
    from common import argtypes
    from common.clihelp import DefaultsHelpFormatter

    t = kv_sub.add_parser(
        "vllm-ttft", help="agent B's TTFT on a real vLLM engine, the message as text or as imported K/V (its KV connector)",
        description="kvcomm ttft's exchanges on real vLLM on this CPU: B takes the sender's message as text, as its "
                    "own K/V (the identity import: checks the layout) or as the sender's re-rotated K/V, the K/V "
                    "placed by vLLM's ExampleConnector. Interleaved rounds; the speedup is the median over rounds of "
                    "TTFT(text) / TTFT(protocol) in the same round; the connector's file write is reported apart. "
                    "Needs gpubench vllm setup. Writes rows.jsonl, summary.json, summary.md and COMMAND into a new --out.",
        formatter_class=DefaultsHelpFormatter)
    t.add_argument("--lengths", default="512,2048", help="imported tokens, comma-separated")
    t.add_argument("--repeats", type=argtypes.positive_int, default=5, help="timed rounds per length")
    t.add_argument("--seed", type=argtypes.seed, default=0, help="message seed")
    t.add_argument("--out", required=True, type=Path, help="a new output directory")
    t.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    t.add_argument("--json", action="store_true", help="print the summary as one JSON object instead of the table")
    t.set_defaults(func=cmd)


def cmd(args) -> int:
    import os
    import shlex
    import sys

    from common.outdir import locked, refuse_committed, write_command, write_text_atomic
    from vllmref import env

    try:
        lengths = tuple(int(v) for v in args.lengths.split(",") if v.strip())
    except ValueError:
        raise KVCommError(f"--lengths must be comma-separated token counts (got {args.lengths!r})") from None
    cfg = VllmTtftConfig(lengths=lengths, repeats=args.repeats, seed=args.seed)
    cfg.check()
    refuse_committed(args.out, "--out")
    if (args.out / "rows.jsonl").exists():
        raise KVCommError(f"{args.out} already holds a run (rows.jsonl); timings are not resumed: choose a new --out")
    env.require_env()
    with locked(args.out, "kvcomm vllm-ttft directory"):
        load_before = os.getloadavg()[0]
        say = None if args.no_progress else (lambda text: print(f"kvcomm vllm-ttft: {text}", file=sys.stderr, flush=True))
        rows = run(cfg, progress=say)
        summary = summarize(rows)
        write_text_atomic(args.out / "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        write_text_atomic(args.out / "summary.json", json.dumps({"summary": summary, "loadavg_1m_before": load_before,
                                                                 "loadavg_1m_end": rows[-1]["loadavg_1m_end"]}, indent=1))
        write_text_atomic(args.out / "summary.md", markdown_table(summary))
        write_command(args.out, "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    if args.json:
        print(json.dumps({"out_dir": str(args.out), "summary": summary}, indent=1))
    else:
        print(markdown_table(summary), end="")
        print(f"wrote {args.out}/rows.jsonl, summary.json, summary.md, COMMAND")
    return 0
