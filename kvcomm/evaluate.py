"""Evaluate protocols on tasks: measure each (task, example, protocol) into a run directory's rows
(accuracy, receiver TTFT, recomputed tokens); kvcomm.eval_report builds the summaries from them.

One run directory holds::

    results.jsonl   one row per (task, example, protocol), appended and flushed as measured
    config.json     model, seed, tasks, protocols of the run (a rerun must match it to resume)
    summary.csv     one row per (task, protocol): EM/F1 with 95 % bootstrap CIs, EM and F1 relative to
    summary.md      text (paired bootstrap), exact McNemar test on EM vs text, median KL of B's first
                    answer token vs text, median receiver TTFT, paired speedup vs text, recompute
                    share, and the goal verdict (yes / no / n too small to decide; kvcomm.metrics)
    summary.png     accuracy relative to text vs receiver prefill speedup, per protocol and task
    COMMAND         the command line that regenerates the directory

Agreement with text: for every example B's ``text`` reception is computed first and each row stores
``kl_text``, KL(text receiver || this receiver) of the first answer-token distribution over the full
vocabulary (0 for ``text`` itself). Computing it at evaluation time against the same example's text
logits costs nothing extra when text runs anyway, and one untimed text prefill when a resumed run
only lacks other protocols' rows.

Timing: for one example every protocol runs back to back on the same senders and B prefix, so the
paired ratio text_TTFT / protocol_TTFT of that example sees the same machine state; the speedup we
report is the median of those per-example ratios (robust on a shared, noisy machine). TTFT is the
wall time of ``kvcomm.protocols.receive`` (B's fixed prefix cached, see there); decoding is not timed.
"""
from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from common.errors import KVCommError
from common.jsonio import iter_jsonl
from kvcomm.anchors import AnchorPool
from kvcomm.cache import continue_from
from kvcomm.calibration import anchor_pool, shared_layers
from kvcomm.example import extract_answer, score
from kvcomm.layout import encode_sender, receiver_layout, receiver_prefix, reencode_in_receiver_frame
from kvcomm.metrics import first_token_kl
from kvcomm.names import (
    ANCHOR_SEED_OFFSET,  # noqa: F401 - the offset is imported from here too
    canonical,
    canonical_label,
)
from kvcomm.protocols import ProtocolSpec, answer, receive
from kvcomm.tasks import check_task, generate

RESULTS_FILE = "results.jsonl"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate (the CLI's arguments)."""

    model: str
    tasks: tuple[str, ...]
    protocols: tuple[ProtocolSpec, ...]
    n: int
    out_dir: Path
    seed: int = 0
    max_new_tokens: int = 5
    num_threads: int = 1

    def identity(self) -> dict:
        """What must match for a rerun to resume into the same directory."""
        return {"model": self.model, "seed": self.seed, "max_new_tokens": self.max_new_tokens}


@dataclass
class Row:
    """One (task, example, protocol) measurement."""

    task: str
    index: int
    protocol: str
    name: str
    boundary_k: int
    ratio: float
    answer: str
    generated: str
    prediction: str
    em: float
    f1: float  # token F1, or ROUGE-L F1 where scoring == "rouge_l"
    prefill_s: float
    num_imported: int
    num_recomputed: int
    num_prompt_tokens: int
    seam_aligned: bool
    sender_s: float
    kl_text: float = float("nan")  # KL(text || this protocol) of B's first answer token, nats
    drift_tokens: list = field(default_factory=list)  # per sender: message start in its chat minus in B's
    extra: dict = field(default_factory=dict)
    # what handing the messages over moves, summed over senders: their KV in fp32, bf16 and 8-bit
    # (kvcomm.quant, scales and zero points included), and their text as UTF-8 (what `text` sends)
    transfer_bytes: dict = field(default_factory=dict)
    scoring: str = "exact"  # the task's: "exact" (goal on exact match) or "rouge_l" (goal on ROUGE-L)
    # KL(text || this protocol) at the gold answer's first digit (or letter), teacher-forced: the first
    # generated token is a space for every "is 4821" answer, so kl_text there says little; NaN for free text
    kl_answer: float = float("nan")
    gold_logprob: float = float("nan")  # log-probability this protocol gives that gold token, nats
    template: str = ""  # the task template the example came from ("" where a task has one)


# ---- run ----------------------------------------------------------------------------------------
def _read_done(path: Path) -> set[tuple[str, int, str]]:
    done: set[tuple[str, int, str]] = set()
    if not path.exists():
        return done
    # a run killed mid-write leaves at most a torn last line (no newline); anything else is corruption
    for line_no, row in iter_jsonl(path, error=KVCommError, objects_only=True, torn_tail_ok=True):
        try:
            done.add((row["task"], int(row["index"]), canonical_label(row["protocol"])))
        except (KeyError, TypeError, ValueError):
            raise KVCommError(f"{path}:{line_no}: malformed result row (needs task, index and protocol)") from None
    return done


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line (a run killed mid-write) so that appended rows start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _check_config(cfg: EvalConfig) -> None:
    path = cfg.out_dir / CONFIG_FILE
    identity = cfg.identity()
    results = cfg.out_dir / RESULTS_FILE
    has_rows = False
    if results.exists():
        with results.open(encoding="utf-8", errors="replace") as f:
            has_rows = any(line.strip() for line in f)
    if path.exists() and has_rows:
        # Only settings that produced rows bind the directory: a run that failed before its first
        # row (a typo in --model) leaves nothing to protect, and the corrected command goes ahead.
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise KVCommError(f"{path}: unreadable; it describes the rows in {results}: restore it or use another --out") from None
        mismatch = {k: (old.get(k), v) for k, v in identity.items() if old.get(k) != v}
        if mismatch:
            raise KVCommError(f"{cfg.out_dir} holds a run with other settings {mismatch} (old, new): use another --out")
    from common.outdir import write_text_atomic

    write_text_atomic(path, json.dumps({**identity, "tasks": list(cfg.tasks), "protocols": [p.label for p in cfg.protocols],
                                "n": cfg.n}, indent=2) + "\n")


def run_eval(cfg: EvalConfig, model=None, tokenizer=None, *, progress: bool = True) -> pd.DataFrame:
    """Run every (task, example, protocol) not yet in ``results.jsonl``; returns all rows.

    The output directory is locked for the run: two evals on one --out would interleave rows.

    Args:
        model, tokenizer: an already loaded model (tests); loaded from ``cfg.model`` when None.
    """
    from common.outdir import locked

    for task in cfg.tasks:
        check_task(task)
    with locked(cfg.out_dir, "kvcomm run directory"):
        _check_config(cfg)
        results = cfg.out_dir / RESULTS_FILE
        _drop_torn_tail(results)
        done = _read_done(results)
        todo = [(task, ex) for task in cfg.tasks for ex in generate(task, cfg.n, cfg.seed)
                if any((task, ex.index, p.label) not in done for p in cfg.protocols)]
        if todo:
            _run_todo(cfg, todo, done, results, model, tokenizer, progress)
        return load_rows(cfg.out_dir)


def _run_todo(cfg: EvalConfig, todo, done, results: Path, model, tokenizer, progress: bool) -> None:
    import torch

    from kvcomm.models import load_model, rope_info

    torch.set_num_threads(cfg.num_threads)
    if model is None:
        model, tokenizer = load_model(cfg.model)
    if tokenizer is None:
        raise KVCommError(f"model '{cfg.model}' has no tokenizer: the tasks are text")
    rope = rope_info(model)
    pools: dict = {}
    with _progress(progress, len(todo) * len(cfg.protocols)) as advance, results.open("a") as fh:
        for task, ex in todo:
            for row in _run_example(model, tokenizer, rope, cfg, ex, done, pools):
                fh.write(json.dumps(asdict(row)) + "\n")
                fh.flush()
                advance(f"{task} {ex.index} {row.protocol}")




def _exchanges(model, tokenizer, examples) -> Iterable:
    """Calibration examples as B would see them: (layout, the senders' own caches), one by one (run
    under the consumer's no_grad: kvcomm.calibration's builders)."""
    for ex in examples:
        senders = [encode_sender(model, tokenizer, m) for m in ex.messages]
        yield receiver_layout(tokenizer, ex, senders), senders


def _calibrated(model, tokenizer, rope, cfg: EvalConfig, task: str, spec: ProtocolSpec, pools: dict):
    """What ``spec`` prepares on calibration examples of ``task`` (another seed, built once per run):
    ``(an anchor pool or kv-layers' shared layers, build seconds)``; ``(None, 0.0)`` when it needs
    none, as kv-anchored on a single-sender task (nothing to offset)."""
    f = spec.features
    if not (f.anchored or f.layer_share):
        return None, 0.0
    own = not f.reencoded
    key = (task, spec.anchor_examples, "layers" if f.layer_share else own)
    if key not in pools:
        examples = generate(task, spec.anchor_examples, cfg.seed + ANCHOR_SEED_OFFSET)
        t0 = time.perf_counter()
        made: AnchorPool | frozenset[int] | None
        if f.layer_share:
            made = shared_layers(model, _exchanges(model, tokenizer, examples), rope)
        elif own or len(examples[0].messages) > 1:
            made = anchor_pool(model, _exchanges(model, tokenizer, examples), rope, own=own)
        else:
            made = None
        pools[key] = (made, time.perf_counter() - t0)
    return pools[key]


def _run_example(model, tokenizer, rope, cfg: EvalConfig, ex, done, pools: dict | None = None) -> Iterable[Row]:
    pools = {} if pools is None else pools
    t0 = time.perf_counter()
    senders = [encode_sender(model, tokenizer, m) for m in ex.messages]
    sender_s = time.perf_counter() - t0
    layout = receiver_layout(tokenizer, ex, senders)
    if any(s.ships_reencoded and (ex.task, ex.index, s.label) not in done for s in cfg.protocols):
        senders = reencode_in_receiver_frame(model, layout, senders)
    transfer = transfer_bytes(senders, [m.text for m in ex.messages])
    drift = [int(s.cache.positions[0]) - start for s, start in zip(senders, layout.import_starts)]
    prefix = receiver_prefix(model, layout)
    # text first: every other row's KL is measured against this example's text distribution; the
    # placebo last: it matches the KL another protocol had on this example
    specs = sorted(cfg.protocols, key=lambda s: (s.name != "text", s.features.placebo))
    text_logits = None
    kl_seen: dict[str, float] = {}
    for spec in specs:
        if (ex.task, ex.index, spec.label) in done and (spec.name != "text" or text_logits is not None):
            continue
        calibrated, calibrated_s = _calibrated(model, tokenizer, rope, cfg, ex.task, spec, pools)
        anchors = calibrated if isinstance(calibrated, AnchorPool) else None
        if spec.features.placebo:
            rec = _placebo(model, cfg, ex, layout, senders, prefix, rope, text_logits, kl_seen)
        else:
            rec = receive(model, spec, layout, senders, prefix, rope, anchors,
                          shared_layers=calibrated if spec.features.layer_share else None)
        if anchors is not None:  # built once per run and task, before any example: not B's time
            rec.extra["anchor_pool"] = {"examples": anchors.num_examples, "tokens": anchors.num_tokens,
                                        "neighbours": anchors.neighbours, "build_s": calibrated_s}
        if spec.name == "text":
            text_logits, text_answer = rec.last_logits, answer_token_logits(model, tokenizer, rec, ex)
            if (ex.task, ex.index, spec.label) in done:
                continue  # recomputed only as the KL reference of a resumed example
        elif text_logits is None:
            text_rec = receive(model, ProtocolSpec("text"), layout, senders, prefix, rope)
            text_logits, text_answer = text_rec.last_logits, answer_token_logits(model, tokenizer, text_rec, ex)
        mine = answer_token_logits(model, tokenizer, rec, ex)
        kl_seen[spec.label] = first_token_kl(text_logits, rec.last_logits)
        if spec.ships_reencoded:  # the senders' extra prefill, off B's critical path
            rec.extra["sender_reencode_s"] = sum(s.reencode_s for s in senders)
        generated = answer(model, tokenizer, rec, ex.answer_tokens or cfg.max_new_tokens)
        prediction = extract_answer(generated)
        em, f1 = score(ex, prediction)
        yield Row(task=ex.task, index=ex.index, protocol=spec.label, name=spec.name, boundary_k=spec.boundary_k,
                  ratio=spec.ratio, answer=ex.answer, generated=generated, prediction=prediction,
                  em=em, f1=f1, scoring=ex.scoring, template=ex.template,
                  prefill_s=rec.prefill_s, num_imported=rec.num_imported, num_recomputed=rec.num_recomputed,
                  num_prompt_tokens=len(layout.ids), seam_aligned=layout.seam_aligned, sender_s=sender_s,
                  kl_text=kl_seen[spec.label], drift_tokens=drift, extra=rec.extra,
                  transfer_bytes=_shipped(transfer, rec, model.config.num_hidden_layers),
                  kl_answer=first_token_kl(text_answer[0], mine[0]) if mine and text_answer else float("nan"),
                  gold_logprob=float(torch.log_softmax(mine[0].double(), -1)[mine[1]]) if mine else float("nan"))


def _placebo(model, cfg: EvalConfig, ex, layout, senders, prefix, rope, text_logits, kl_seen: dict):
    """The placebo's reception: noise with the KL the matched protocol has on this example (computed
    here, untimed, when the run does not include that protocol)."""
    from kvcomm.placebo import MATCHED_PROTOCOL, placebo_reception

    if text_logits is None:
        text_logits = receive(model, ProtocolSpec("text"), layout, senders, prefix, rope).last_logits
    if MATCHED_PROTOCOL not in kl_seen:
        matched = receive(model, ProtocolSpec(MATCHED_PROTOCOL), layout, senders, prefix, rope)
        kl_seen[MATCHED_PROTOCOL] = first_token_kl(text_logits, matched.last_logits)
    seed = zlib.crc32(f"placebo:{cfg.seed}:{ex.task}:{ex.index}".encode())
    return placebo_reception(model, layout, prefix, text_logits, kl_seen[MATCHED_PROTOCOL], seed)


def answer_token_logits(model, tokenizer, reception, ex) -> tuple | None:
    """(logits over the gold answer's first digit or letter, that token's id), teacher-forced through
    what comes before it in the gold continuation (the space SmolLM2 writes as its own token before
    " 4821"); None for a free-text answer. B's cache is not modified."""
    if ex.scoring != "exact":
        return None
    gold = tokenizer(" " + ex.answer, add_special_tokens=False)["input_ids"]
    first = next((i for i, t in enumerate(gold) if any(c.isalnum() for c in tokenizer.decode([t]))), None)
    if first is None:
        return None
    if first == 0:
        return reception.last_logits, gold[0]
    with reception.scope(model):
        _, logits = continue_from(model, reception.cache, gold[:first], last_only=True)
    return logits[0, -1], gold[first]


def _shipped(transfer: dict, rec, num_layers: int) -> dict:
    """kv-layers ships its shared layers' K/V only: the K/V byte counts scaled by their share (each
    layer's K/V, and its int8 scales, are the same size)."""
    shared = rec.extra.get("shared_layers")
    if shared is None:
        return transfer
    return {k: v if k == "text_utf8" else v * len(shared) // num_layers for k, v in transfer.items()}


def transfer_bytes(senders, texts: list[str]) -> dict:
    """Bytes the senders' messages take on the wire: KV in fp32, bf16 and int8 (kvcomm.quant's
    storage, scales and zero points included), and the message text as UTF-8."""
    from kvcomm.quant import quantize

    elements = sum(t.numel() for s in senders for t in (*s.cache.keys, *s.cache.values))
    return {"fp32": 4 * elements, "bf16": 2 * elements,
            "int8": sum(quantize(s.cache).nbytes for s in senders),
            "text_utf8": sum(len(t.encode("utf-8")) for t in texts)}


class _progress:
    """A rich progress bar (or nothing); ``advance(description)`` per finished measurement."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda _desc: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # on stderr: stdout carries the results (the table, or --json's object); only on a terminal,
        # so that a one-line error stays one line
        console = Console(stderr=True)
        self._bar = Progress(TextColumn("kvcomm eval {task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                             TimeRemainingColumn(), console=console, disable=not console.is_terminal)
        self._bar.start()
        task_id = self._bar.add_task("", total=self.total)
        return lambda desc: self._bar.update(task_id, advance=1, description=desc)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.stop()


def load_rows(out_dir: Path) -> pd.DataFrame:
    """All result rows of a run directory (a torn last line is ignored)."""
    path = Path(out_dir) / RESULTS_FILE
    if not path.exists():
        raise KVCommError(f"no {RESULTS_FILE} in {out_dir}")
    rows = pd.DataFrame([row for _, row in iter_jsonl(path, error=KVCommError, objects_only=True, torn_tail_ok=True)])
    if "protocol" in rows:  # rows written under a protocol's old name read under its current one
        rows["protocol"] = rows["protocol"].map(canonical_label)
        if "name" in rows:
            rows["name"] = rows["name"].map(canonical)
    return rows
