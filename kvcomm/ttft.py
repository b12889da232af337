"""`gpubench kvcomm ttft`: agent B's time to first token against the length of what it imports.

For each imported length L, a sender writes an L-token message (an access log) in its own chat, and
B's prompt holds B's system prompt, that message and a short question. B's prefix (system prompt
and header) is cached, as a serving engine would keep it; what is timed is ``protocols.receive``:
taking in the message and the question, under each protocol:

- ``text``: B prefills the message's tokens and the question;
- ``kv-rerotated``: B appends the sender's KV re-rotated to its positions, prefills the question;
- ``kv-rerotated+boundary k``: the same, recomputing the first k message tokens;
- ``remote-prefill`` (was ``kv-reencoded``): as kv-rerotated, with the span the sender re-encoded in B's frame;
- ``kv-blend r``: CacheBlend, recomputing the share r of imported tokens that deviate most;
- ``kv-anchored`` (``+boundary k``), with ``--senders S`` > 1: the length split over S senders, each
  later sender's re-encoded span offset from a pool of ``--anchor-examples`` exchanges of the same
  shape and another seed (built before the rounds; the neighbour search is B's time), the first k
  tokens of each later span recomputed. With one sender every reencoded protocol is remote-prefill.

Repetitions are interleaved (every protocol once per round, in a rotated order, after an untimed
warm-up round), and the speedup is the median over rounds of TTFT(text) / TTFT(protocol) taken in
the same round, so that a shared machine's drift cancels in the ratio. The 1-minute load average
is sampled every round and the process's CPU share (CPU seconds / wall seconds) measured over the
timed rounds; a run is flagged in every output when the load before it exceeded ``kvcomm.load.LOAD_FLAG``, or
the load during it ``LOAD_FLAG`` plus its own threads.
"""
from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common.errors import KVCommError
from kvcomm.load import LOAD_FLAG, load_flags
from kvcomm.names import E2E_LINK_GBS

ROWS_FILE = "rows.jsonl"
QUESTION = "Which code was set last in the log above? Reply with the code only."


@dataclass(frozen=True)
class TtftConfig:
    """One sweep: imported lengths, protocols (``ProtocolSpec``s, text first), timed rounds."""

    model: str
    lengths: tuple[int, ...]
    protocols: tuple
    repeats: int = 7
    seed: int = 0
    num_threads: int = 1
    num_senders: int = 1  # the imported length split over this many senders' messages
    anchor_examples: int = 8  # kv-anchored(+boundary) with several senders: exchanges of another seed in its pool

    def check(self) -> None:
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise KVCommError(f"--lengths must be positive token counts (got {list(self.lengths)})")
        if self.repeats < 1:
            raise KVCommError(f"--repeats must be >= 1 (got {self.repeats})")
        if self.num_senders < 1:
            raise KVCommError(f"--senders must be >= 1 (got {self.num_senders})")
        if any(n < self.num_senders for n in self.lengths):
            raise KVCommError(f"every length must give each of the {self.num_senders} senders a token "
                              f"(got {list(self.lengths)})")
        if "text" not in [p.name for p in self.protocols]:
            raise KVCommError("--protocols must include 'text': the speedup is TTFT(text) / TTFT(protocol)")
        if any(p.features.placebo for p in self.protocols):
            raise KVCommError("placebo has no TTFT of its own (B computes everything, then adds noise): "
                              "it belongs to kvcomm eval, not kvcomm ttft")


def _message(tokenizer, num_tokens: int, rng: random.Random, agent: str = "A"):
    """A sender's message (an access log) and its ids, exactly ``num_tokens`` tokens."""
    from kvcomm.agent_tasks import access_log
    from kvcomm.example import AgentMessage
    from kvcomm.tasks import SENDER_SYSTEM

    log = access_log(rng, [("main door", "4821")], num_routine=8)
    ids: list[int] = []
    while len(ids) < num_tokens:  # a log long enough, then cut to the exact token count
        log += "\n" + access_log(rng, [("main door", str(rng.randint(1000, 9999)))], num_routine=8)
        ids = tokenizer(log, add_special_tokens=False)["input_ids"]
    ids = list(ids[:num_tokens])
    message = AgentMessage(agent=agent, system_prompt=SENDER_SYSTEM.format(agent=agent),
                           instruction="Copy today's access log for the other agents.", text=tokenizer.decode(ids))
    return message, ids


def exchange(model, tokenizer, length: int, num_senders: int, rng: random.Random):
    """``num_senders`` messages of ``length`` tokens in all (the first ones one longer where it does not
    divide), each encoded in its sender's chat: ``(layout, senders)``."""
    from kvcomm.example import Example
    from kvcomm.layout import encode_sender_ids, receiver_layout_ids, sender_layout

    base, extra = divmod(length, num_senders)
    agents = ["A"] if num_senders == 1 else [f"A{i + 1}" for i in range(num_senders)]
    messages, ids, senders = [], [], []
    for i, agent in enumerate(agents):
        message, msg_ids = _message(tokenizer, base + (1 if i < extra else 0), rng, agent)
        prefix_ids, _, suffix_ids = sender_layout(tokenizer, message)
        messages.append(message)
        ids.append(msg_ids)
        senders.append(encode_sender_ids(model, agent, prefix_ids, msg_ids, suffix_ids))
    example = Example(task="ttft", index=length, messages=tuple(messages), question=QUESTION, answer="")
    return receiver_layout_ids(tokenizer, example, ids), senders


def _calibrated(model, tokenizer, cfg: TtftConfig, length: int, rope) -> dict:
    """What the protocols prepare before the rounds (not B's time), on ``cfg.anchor_examples``
    exchanges of this shape from another seed (what is timed is the search over a pool of that size;
    the messages timed are never in it): ``{"own": pool, "reencoded": pool, "layers": shared layers}``
    for those the protocols use (kv-anchored's only with two or more senders: nothing to offset)."""
    from kvcomm.calibration import anchor_pool, shared_layers
    from kvcomm.names import ANCHOR_SEED_OFFSET

    features = [p.features for p in cfg.protocols]
    wanted = {"own" for f in features if f.anchored and not f.reencoded}
    wanted |= {"reencoded" for f in features if f.anchored and f.reencoded and cfg.num_senders > 1}
    wanted |= {"layers" for f in features if f.layer_share}
    made: dict = {}
    for what in sorted(wanted):
        rng = random.Random(cfg.seed + ANCHOR_SEED_OFFSET + length)  # the same exchanges for each
        exchanges = (exchange(model, tokenizer, length, cfg.num_senders, rng) for _ in range(cfg.anchor_examples))
        made[what] = (shared_layers(model, exchanges, rope) if what == "layers"
                      else anchor_pool(model, exchanges, rope, own=what == "own"))
    return made


def run_sweep(cfg: TtftConfig, model, tokenizer, *, progress=None) -> list[dict]:
    """Every (length, round, protocol) timing as a row; ``progress(text)`` after each length."""
    import torch

    from kvcomm.layout import receiver_prefix, reencode_in_receiver_frame
    from kvcomm.models import rope_info
    from kvcomm.protocols import receive

    torch.set_num_threads(cfg.num_threads)
    rope = rope_info(model)
    rng = random.Random(cfg.seed)
    rows: list[dict] = []
    for length in cfg.lengths:
        layout, senders = exchange(model, tokenizer, length, cfg.num_senders, rng)
        prefix = receiver_prefix(model, layout)
        if any(p.ships_reencoded for p in cfg.protocols):
            senders = reencode_in_receiver_frame(model, layout, senders)
        calibrated = _calibrated(model, tokenizer, cfg, length, rope)
        specs = list(cfg.protocols)

        def pool_of(spec):
            return calibrated.get("reencoded" if spec.features.reencoded else "own") if spec.features.anchored else None

        def layers_of(spec):
            return calibrated["layers"] if spec.features.layer_share else None

        for spec in specs:  # warm-up round, untimed
            receive(model, spec, layout, senders, prefix, rope, pool_of(spec), layers_of(spec))
        moved = _moved_bytes(tokenizer, senders)
        first_row = len(rows)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for rnd in range(cfg.repeats):
            order = specs[rnd % len(specs):] + specs[:rnd % len(specs)]
            load = os.getloadavg()[0]
            sender_extra_s = 0.0
            if any(p.ships_reencoded for p in specs):  # the senders' extra prefill, timed in every round
                t0 = time.perf_counter()
                senders = reencode_in_receiver_frame(model, layout, senders)
                sender_extra_s = time.perf_counter() - t0
            for spec in order:
                anchors = pool_of(spec)
                rec = receive(model, spec, layout, senders, prefix, rope, anchors, layers_of(spec))
                extra = sender_extra_s if spec.ships_reencoded else 0.0
                nbytes = moved["text_utf8" if spec.name == "text" else "bf16"]
                if spec.features.layer_share:  # only the shared layers' K/V move
                    nbytes = nbytes * len(layers_of(spec)) // model.config.num_hidden_layers
                rows.append({"num_imported": rec.num_imported, "round": rnd, "protocol": spec.label,
                             "ttft_s": rec.prefill_s, "num_recomputed": rec.num_recomputed,
                             "num_prompt_tokens": len(layout.ids), "loadavg_1m": load, "num_senders": cfg.num_senders,
                             "anchor_tokens": anchors.num_tokens if anchors is not None and spec.features.anchored else 0,
                             "sender_extra_s": extra, "moved_bytes": nbytes,
                             "e2e_s": extra + nbytes / (E2E_LINK_GBS * 1e9) + rec.prefill_s})
        share = (time.process_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
        for row in rows[first_row:]:
            row["cpu_share"] = share
        if progress is not None:
            progress(f"{layout.num_imported} imported tokens: {cfg.repeats} rounds, CPU share {share:.2f}")
    return rows


def _moved_bytes(tokenizer, senders) -> dict:
    """What the messages take on the wire: their K/V in bf16 and their text in UTF-8."""
    elements = sum(t.numel() for snd in senders for t in (*snd.cache.keys, *snd.cache.values))
    text = sum(len(tokenizer.decode(list(snd.message_ids)).encode("utf-8")) for snd in senders)
    return {"bf16": 2 * elements, "text_utf8": text}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (imported length, protocol): TTFT median and quartiles, paired speedup vs text, recompute share."""
    out = []
    for length in sorted({r["num_imported"] for r in rows}):
        at = [r for r in rows if r["num_imported"] == length]
        text = {r["round"]: r["ttft_s"] for r in at if r["protocol"] == "text"}
        for label in dict.fromkeys(r["protocol"] for r in at):
            mine = [r for r in at if r["protocol"] == label]
            ttft = [r["ttft_s"] for r in mine]
            ratios = [text[r["round"]] / r["ttft_s"] for r in mine if r["round"] in text and r["ttft_s"] > 0]
            q = statistics.quantiles(ttft, n=4) if len(ttft) > 1 else [ttft[0]] * 3
            rq = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            e2e_text = {r["round"]: r["e2e_s"] for r in at if r["protocol"] == "text" and "e2e_s" in r}
            e2e = [e2e_text[r["round"]] / r["e2e_s"] for r in mine if r["round"] in e2e_text and r.get("e2e_s")]
            out.append({"num_imported": length, "protocol": label, "rounds": len(mine),
                        "ttft_median_s": statistics.median(ttft), "ttft_p25_s": q[0], "ttft_p75_s": q[2],
                        "speedup_median": statistics.median(ratios), "speedup_p25": rq[0], "speedup_p75": rq[2],
                        "e2e_speedup_median": statistics.median(e2e) if e2e else None,
                        "recompute_fraction": sum(r["num_recomputed"] for r in mine) / max(1, length * len(mine)),
                        "loadavg_1m_max": max(r["loadavg_1m"] for r in mine),
                        "cpu_share": mine[0].get("cpu_share")})
    return out


def markdown_table(summary: list[dict]) -> str:
    """The per-length table; a row taken under contention (its ``flagged``) has its TTFT and speedup
    marked `` *`` and its load and CPU share beside them."""
    from common.mdtable import markdown_table as layout

    header = ["imported tokens", "protocol", "rounds", "B's TTFT median ms [IQR]", "speedup vs text, median [IQR]",
              f"end to end vs text, median ({E2E_LINK_GBS:g} GB/s link)", "recomputed / imported", "load avg max",
              "CPU share"]
    rows = []
    for s in summary:
        mark = " *" if s.get("flagged") else ""
        share = s.get("cpu_share")
        rows.append([s["num_imported"], s["protocol"], s["rounds"],
                     f"{1e3 * s['ttft_median_s']:.1f} [{1e3 * s['ttft_p25_s']:.1f}, {1e3 * s['ttft_p75_s']:.1f}]{mark}",
                     f"{s['speedup_median']:.2f}x [{s['speedup_p25']:.2f}, {s['speedup_p75']:.2f}]{mark}",
                     "not recorded" if s.get("e2e_speedup_median") is None else f"{s['e2e_speedup_median']:.2f}x{mark}",
                     f"{s['recompute_fraction']:.3f}", f"{s['loadavg_1m_max']:.2f}",
                     "-" if share is None else f"{share:.2f}"])
    return layout(header, rows) + "\n"


def contention(summary: list[dict], rows: list[dict], load_before: float, num_threads: int) -> dict:
    """The run's contention state (load before and during, CPU share, the run's flags, how many
    summary rows are flagged); marks each summary row's ``flagged`` by the one rule of
    ``kvcomm.load`` applied to the load during that row's rounds."""
    for s in summary:
        s["flagged"] = bool(load_flags(load_before, [s["loadavg_1m_max"]], num_threads))
    flags = load_flags(load_before, [r["loadavg_1m"] for r in rows], num_threads)
    shares = [s["cpu_share"] for s in summary if s.get("cpu_share") is not None]
    return {"loadavg_1m_before": load_before, "loadavg_1m_max": max(r["loadavg_1m"] for r in rows),
            "cpu_share_min": min(shares) if shares else None, "cpu_share_max": max(shares) if shares else None,
            "load_flag": LOAD_FLAG, "num_threads": num_threads, "flagged": bool(flags), "flags": flags,
            "flagged_rows": sum(s["flagged"] for s in summary), "num_rows": len(summary)}


def contention_lines(c: dict) -> list[str]:
    """``contention``'s state in words: what the console and summary.md print under the table."""
    share = "-" if c["cpu_share_min"] is None else f"{c['cpu_share_min']:.2f}-{c['cpu_share_max']:.2f}"
    lines = [f"contention: load average (1 min) {c['loadavg_1m_before']:.2f} before, up to {c['loadavg_1m_max']:.2f} "
             f"during (flagged above {c['load_flag']} before, {c['load_flag']} + {c['num_threads']} thread(s) during); "
             f"CPU share {share}"]
    if c["flagged"]:
        lines.append(f"FLAGGED, not for quoting: {'; '.join(c['flags'])}; {c['flagged_rows']} of {c['num_rows']} "
                     f"rows flagged (marked *)")
    else:
        lines.append(f"not flagged: 0 of {c['num_rows']} rows taken under contention")
    return lines


def figure(summary: list[dict]):
    """TTFT and speedup against imported length, one line per protocol (the unsaved figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    from common.plotaxes import plain_log_ticks

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(s["protocol"] for s in summary):
        mine = [s for s in summary if s["protocol"] == label]
        x = [s["num_imported"] for s in mine]
        left.errorbar(x, [1e3 * s["ttft_median_s"] for s in mine], marker="o", label=label, capsize=3,
                      yerr=[[1e3 * (s["ttft_median_s"] - s["ttft_p25_s"]) for s in mine],
                            [1e3 * (s["ttft_p75_s"] - s["ttft_median_s"]) for s in mine]])
        line, = right.plot(x, [s["speedup_median"] for s in mine], marker="o", label=label)
        e2e = [s.get("e2e_speedup_median") for s in mine]
        # end to end where it parts from B's own speedup (a sender's extra prefill): dashed, same colour
        if all(v is not None for v in e2e) and any(abs(v - s["speedup_median"]) > 0.05 * s["speedup_median"]
                                                   for v, s in zip(e2e, mine)):
            right.plot(x, e2e, marker="x", ls="--", color=line.get_color(), label=f"{label}, end to end")
    left.set(xscale="log", yscale="log", xlabel="imported tokens", ylabel="B's TTFT, ms (median, IQR)",
             title="receiver time to first token")
    # TTFT often spans less than a decade, where a log axis has no major tick inside: its minor
    # ticks carry the labels, as plain numbers.
    plain_log_ticks(left.yaxis)
    right.axhline(1.5, color="gray", ls="--", lw=1, label="1.5x")
    right.set(xscale="log", xlabel="imported tokens", ylabel="TTFT(text) / TTFT(protocol), median of rounds",
              title="speedup over re-reading the text (dashed: end to end)")
    lengths = sorted({s["num_imported"] for s in summary})
    for ax in (left, right):
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())  # the lengths run are the x ticks, nothing between
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(summary: list[dict], path: Path) -> None:
    """ttft.png: see ``figure``."""
    fig = figure(summary)
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: Path, cfg: TtftConfig, rows: list[dict], command: str,
                  load_before: float) -> tuple[list[dict], dict]:
    """rows.jsonl, summary.json/.md, ttft.png and COMMAND (command, then '#' notes), each atomically;
    returns the summary (each row with its ``flagged``) and the run's ``contention`` state."""
    from common.outdir import write_text_atomic
    from gpubench.hostinfo import host_cpu

    summary = summarize(rows)
    state = contention(summary, rows, load_before, cfg.num_threads)
    flags = state["flags"]
    cpu = host_cpu()
    meta = {"created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
            "cpu_model": cpu.model_name, "num_cpus": os.cpu_count(), "config": {**asdict(cfg), "protocols":
            [p.label for p in cfg.protocols]}, "loadavg_1m_before": load_before, "flagged": bool(flags), "flags": flags,
            "contention": state}
    out_dir = Path(out_dir)
    write_text_atomic(out_dir / ROWS_FILE, "".join(json.dumps(r) + "\n" for r in rows))
    write_text_atomic(out_dir / "summary.json", json.dumps({"command": command, **meta, "summary": summary}, indent=1) + "\n")
    write_text_atomic(out_dir / "summary.md", f"<!-- generated by: {command} -->\n" + markdown_table(summary)
                      + "\n" + "".join(f"{line}\n\n" for line in contention_lines(state)))
    plot(summary, out_dir / "ttft.png")
    notes = [f"measured {meta['created_utc']} on {meta['host']} ({meta['cpu_model']}, {meta['num_cpus']} CPUs), "
             f"{cfg.model}, {cfg.num_threads} torch thread(s), {cfg.repeats} interleaved rounds per length",
             f"load average 1 min: {load_before:.2f} before, up to {state['loadavg_1m_max']:.2f} during; "
             f"CPU share {state['cpu_share_min']:.2f}-{state['cpu_share_max']:.2f}",
             ("FLAGGED, not for quoting: " + "; ".join(flags)) if flags else "not flagged (load below the threshold)"]
    write_text_atomic(out_dir / "COMMAND", command.strip() + "\n" + "".join(f"# {n}\n" for n in notes))
    return summary, state
