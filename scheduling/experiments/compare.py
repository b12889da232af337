"""Two replays of the same jobs side by side (``gpubench compare-replay SIM LIVE``).

Typically the simulator's replay and a live replay through real vLLM (``replay --engine vllm``),
but any two replay directories of the same jobs work. Turns are matched on ``(job_id, turn)``;
a job or turn present in one only is an error (they are not replays of the same trace).

Per turn: TTFT (first token - arrival), TPOT (finish - first token over output tokens - 1, the
mean inter-token latency of the turn), prefix-hit tokens (the prompt tokens not computed: cached,
or supplied by a host pool or a KV connector), preemptions; per job: JCT. KV usage is
the time-weighted mean share of the pool held by requests over the replay, and its peak. Every
relative error is ``(A - B) / B``: B (the second directory, e.g. live vLLM) is the reference.
Where both are disaggregated (``--prefill-replicas``), the turns prefilled remotely, the KV moved per
remote turn and the transfer time's p50 and p90 are compared too.

A real engine replayed twice does not repeat itself: its step times carry the machine's noise, and
under eviction pressure a turn that arrives one step later finds other blocks cached. So the error
of A against one take of B means little without B's own take-to-take spread. ``with_repeats`` scores
other takes of B (same engine, settings and jobs) against B exactly as A is scored, and says per
metric whether A's difference from B is within the largest difference of a repeat from B.
``with_runs`` does the same on A's side: other runs of the simulator (``--step-jitter`` under other
``--jitter-seed`` values) give the mean of A's paths, the figure to hold against the takes' mean.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from common.errors import ConfigError, ResultsFormatError


@dataclass
class Replay:
    path: Path
    summary: dict
    turns: pd.DataFrame
    jobs: pd.DataFrame
    steps: pd.DataFrame

    @property
    def label(self) -> str:
        cfg = self.summary.get("config", {})
        return "vllm (live)" if cfg.get("engine") == "vllm" else f"sim {cfg.get('sku', '')}".strip()

    @property
    def block_size(self) -> int:
        return int(self.summary.get("config", {}).get("block_size") or 16)


def load_replay(path: str | Path) -> Replay:
    path = Path(path)
    files = {name: path / name for name in ("summary.json", "turns.csv", "jobs.csv", "steps.csv")}
    for name, f in files.items():
        if not f.is_file():
            raise ResultsFormatError(f"{path}: not a replay directory (no {name}; write one with `gpubench replay --out`)")
    try:
        summary = json.loads(files["summary.json"].read_text(encoding="utf-8"))
        turns = pd.read_csv(files["turns.csv"])
        jobs = pd.read_csv(files["jobs.csv"])
        steps = pd.read_csv(files["steps.csv"])
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as e:
        raise ResultsFormatError(f"{path}: unreadable replay output ({type(e).__name__}: {e})") from None
    for frame, cols, name in ((turns, ("job_id", "turn", "arrival_s", "first_token_s", "finish_s", "hit_tokens",
                                       "output_tokens", "num_preemptions"), "turns.csv"),
                              (jobs, ("job_id", "jct_s"), "jobs.csv"),
                              (steps, ("t_s", "dur_s", "kv_used_blocks", "kv_total_blocks"), "steps.csv")):
        missing = [c for c in cols if c not in frame.columns]
        if missing:
            raise ResultsFormatError(f"{path / name}: missing columns {', '.join(missing)}")
    if turns.duplicated(["job_id", "turn"]).any():
        raise ResultsFormatError(f"{path / 'turns.csv'}: a (job_id, turn) appears twice")
    return Replay(path, summary, turns, jobs, steps)


def _tpot(turns: pd.DataFrame) -> pd.Series:
    n = turns["output_tokens"] - 1
    return ((turns["finish_s"] - turns["first_token_s"]) / n).where(n > 0)


def _not_computed(turns: pd.DataFrame) -> pd.Series:
    """The prompt tokens a turn did not compute: its prefix-cache hit, plus what a host pool or a
    KV connector supplied (the simulator keeps that apart as ``pool_hit_tokens``; vLLM's
    ``num_cached_tokens``, a live replay's ``hit_tokens``, counts both)."""
    if "pool_hit_tokens" in turns.columns:
        return turns["hit_tokens"] + turns["pool_hit_tokens"].fillna(0).astype(turns["hit_tokens"].dtype)
    return turns["hit_tokens"]


def _kv_usage(steps: pd.DataFrame) -> tuple[float | None, float | None]:
    if steps.empty:
        return None, None
    share = steps["kv_used_blocks"] / steps["kv_total_blocks"].clip(lower=1)
    weights = steps["dur_s"].clip(lower=0)
    mean = float(np.average(share, weights=weights)) if weights.sum() > 0 else float(share.mean())
    return mean, float(share.max())


def _rel(a, b):
    if a is None or b is None or not np.isfinite(a) or not np.isfinite(b) or b == 0:
        return None
    return (a - b) / b


def compare(a: Replay, b: Replay) -> dict:
    """The comparison of replay ``a`` against reference ``b`` (see the module docstring)."""
    keys_a = set(zip(a.turns["job_id"], a.turns["turn"]))
    keys_b = set(zip(b.turns["job_id"], b.turns["turn"]))
    if keys_a != keys_b:
        only_a, only_b = sorted(keys_a - keys_b)[:3], sorted(keys_b - keys_a)[:3]
        raise ResultsFormatError(f"{a.path} and {b.path} are not replays of the same jobs "
                                 f"(turns only in the first: {only_a or 'none'}; only in the second: {only_b or 'none'})")
    ta = a.turns.assign(ttft_s=a.turns["first_token_s"] - a.turns["arrival_s"], tpot_s=_tpot(a.turns),
                        hit_tokens=_not_computed(a.turns))
    tb = b.turns.assign(ttft_s=b.turns["first_token_s"] - b.turns["arrival_s"], tpot_s=_tpot(b.turns),
                        hit_tokens=_not_computed(b.turns))
    cols = ["job_id", "turn", "prompt_tokens", "ttft_s", "tpot_s", "hit_tokens", "num_preemptions", "arrival_s", "finish_s"]
    joined = ta[cols].merge(tb[cols], on=["job_id", "turn"], suffixes=("_a", "_b"))
    joined["ttft_rel_err"] = (joined["ttft_s_a"] - joined["ttft_s_b"]) / joined["ttft_s_b"]
    joined["hit_diff_tokens"] = joined["hit_tokens_a"] - joined["hit_tokens_b"]
    jobs = a.jobs[["job_id", "jct_s"]].merge(b.jobs[["job_id", "jct_s"]], on="job_id", suffixes=("_a", "_b"))
    block = max(a.block_size, b.block_size)

    def stat(series: pd.Series, how: str) -> float | None:
        s = series.dropna().to_numpy(float)
        if not len(s):
            return None
        return float(np.mean(s)) if how == "mean" else float(np.percentile(s, float(how[1:])))

    rows = []
    for name, col, how in (("JCT mean (s)", "jct", "mean"), ("JCT p50 (s)", "jct", "p50"), ("JCT p90 (s)", "jct", "p90"),
                           ("TTFT mean (s)", "ttft", "mean"), ("TTFT p50 (s)", "ttft", "p50"),
                           ("TTFT p90 (s)", "ttft", "p90"), ("TPOT mean (s)", "tpot", "mean"),
                           ("TPOT p50 (s)", "tpot", "p50")):
        src = jobs if col == "jct" else joined
        va, vb = stat(src[f"{col}_s_a"], how), stat(src[f"{col}_s_b"], how)
        rows.append({"metric": name, "a": va, "b": vb, "rel_err": _rel(va, vb)})
    for name, col in (("prefix-hit tokens (sum)", "hit_tokens"), ("preemptions (sum)", "num_preemptions")):
        va, vb = float(joined[f"{col}_a"].sum()), float(joined[f"{col}_b"].sum())
        rows.append({"metric": name, "a": va, "b": vb, "rel_err": _rel(va, vb)})
    prompt = float(joined["prompt_tokens_b"].sum())
    ha, hb = float(joined["hit_tokens_a"].sum()) / prompt, float(joined["hit_tokens_b"].sum()) / prompt
    rows.append({"metric": "prefix-hit rate", "a": ha, "b": hb, "rel_err": _rel(ha, hb)})
    for label, idx in (("KV usage, time-weighted mean share", 0), ("KV usage, peak share", 1)):
        va, vb = _kv_usage(a.steps)[idx], _kv_usage(b.steps)[idx]
        rows.append({"metric": label, "a": va, "b": vb, "rel_err": _rel(va, vb)})
    rows.append({"metric": "engine steps", "a": float(len(a.steps)), "b": float(len(b.steps)),
                 "rel_err": _rel(float(len(a.steps)), float(len(b.steps)))})
    rows.append({"metric": "step duration mean (s)", "a": stat(a.steps["dur_s"], "mean"), "b": stat(b.steps["dur_s"], "mean"),
                 "rel_err": _rel(stat(a.steps["dur_s"], "mean"), stat(b.steps["dur_s"], "mean"))})
    rows += _transfer_rows(a.turns, b.turns, stat)
    within_block = float((joined["hit_diff_tokens"].abs() <= block).mean())
    return {
        "a": {"path": str(a.path), "label": a.label}, "b": {"path": str(b.path), "label": b.label},
        "num_jobs": int(len(jobs)), "num_turns": int(len(joined)), "block_size": block,
        "metrics": rows,
        "per_turn": {
            "ttft_median_abs_rel_err": stat(joined["ttft_rel_err"].abs(), "p50"),
            "hit_tokens_max_abs_diff": int(joined["hit_diff_tokens"].abs().max()) if len(joined) else 0,
            "turns_hit_within_one_block": within_block,
        },
        "turns": joined,
        "jobs": jobs,
    }


def _transfer_rows(a: pd.DataFrame, b: pd.DataFrame, stat) -> list[dict]:
    """Prefill/decode hand-offs, where both replays are disaggregated: the KV moved and the transfer
    time of the turns prefilled remotely (a live pair's is measured, the simulator's priced)."""
    need = ("prefill_replica", "kv_bytes", "kv_transfer_s")
    if not all(c in t.columns for t in (a, b) for c in need):
        return []
    ra, rb = a[a["prefill_replica"] >= 0], b[b["prefill_replica"] >= 0]
    rows = [{"metric": "turns prefilled remotely", "a": float(len(ra)), "b": float(len(rb)),
             "rel_err": _rel(float(len(ra)), float(len(rb)))}]
    for name, col, how in (("KV moved per remote turn, mean (MB)", "kv_bytes", "mean"),
                           ("KV transfer p50 (s)", "kv_transfer_s", "p50"), ("KV transfer p90 (s)", "kv_transfer_s", "p90")):
        scale = 1e-6 if col == "kv_bytes" else 1.0
        va, vb = stat(ra[col] * scale, how), stat(rb[col] * scale, how)
        rows.append({"metric": name, "a": va, "b": vb, "rel_err": _rel(va, vb)})
    return rows


def _setting_difference(first: Replay, other: Replay) -> tuple[str, object, object] | None:
    """The first recorded setting in which ``other`` differs from ``first`` (name, first's, other's),
    or None. The step jitter's seed is not one: another seed is another take, as a rerun of the engine is."""
    want = dict(first.summary.get("config", {}), jitter_seed=None)
    got = dict(other.summary.get("config", {}), jitter_seed=None)
    differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    return (differ[0], want.get(differ[0]), got.get(differ[0])) if differ else None


def _check_repeats(reference: Replay, repeats: list[Replay], scored: Replay | None) -> None:
    """Repeats must be other takes of the reference: distinct directories, the same settings."""
    seen = {reference.path.resolve(): "the reference"} | ({scored.path.resolve(): "the scored replay"} if scored else {})
    for r in repeats:
        where = seen.get(r.path.resolve())
        if where:
            raise ConfigError(f"--repeat {r.path} is {where} itself: a repeat is another take of the reference")
        seen[r.path.resolve()] = "given twice as --repeat"
        differ = _setting_difference(reference, r)
        if differ:
            k, want, got = differ
            raise ConfigError(f"--repeat {r.path} is not a take of the reference's settings: {k} is "
                              f"{got!r} there and {want!r} in {reference.path}")


def with_repeats(result: dict, reference: Replay, repeats: list[Replay], scored: Replay | None = None) -> dict:
    """``result`` (``compare(scored, reference)``) with the reference's take-to-take spread added.

    Every repeat is scored against the reference as ``compare`` scored the replay. Per metric, over
    all takes (the reference and its repeats): ``takes_min``, ``takes_max``, ``takes_mean``, the
    scored replay's ``rel_err_vs_takes_mean``, and ``within_takes_range``: whether its value lies
    between the lowest and the highest take's, as another take's might (n takes bracket a further
    one with probability (n - 1) / (n + 1)). ``repeat_values`` and ``repeat_rel_errs`` keep each
    repeat's. Per turn: each repeat's share of turns whose hits are within one block of the
    reference's, its largest hit difference and its median |TTFT difference|.
    """
    if not repeats:
        return result
    _check_repeats(reference, repeats, scored)
    takes = [compare(r, reference) for r in repeats]
    for i, row in enumerate(result["metrics"]):
        row["repeat_values"] = [t["metrics"][i]["a"] for t in takes]
        row["repeat_rel_errs"] = [t["metrics"][i]["rel_err"] for t in takes]
        values = [v for v in [row["b"], *row["repeat_values"]] if v is not None]
        if not values:
            row |= {"takes_min": None, "takes_max": None, "takes_mean": None, "rel_err_vs_takes_mean": None,
                    "within_takes_range": None}
            continue
        lo, hi, mean = min(values), max(values), float(np.mean(values))
        row |= {"takes_min": lo, "takes_max": hi, "takes_mean": mean, "rel_err_vs_takes_mean": _rel(row["a"], mean),
                "within_takes_range": None if row["a"] is None else bool(lo - 1e-12 <= row["a"] <= hi + 1e-12)}
    result["reference_repeats"] = [{"path": str(r.path), "per_turn": t["per_turn"]} for r, t in zip(repeats, takes)]
    shares = [t["per_turn"]["turns_hit_within_one_block"] for t in takes]
    result["per_turn"]["hit_within_one_block_within_spread"] = bool(
        result["per_turn"]["turns_hit_within_one_block"] >= min(shares) - 1e-12)
    result["repeat_turns"] = [t["turns"] for t in takes]
    result["repeat_jobs"] = [t["jobs"] for t in takes]
    return result


def with_runs(result: dict, scored: Replay, reference: Replay, runs: list[Replay]) -> dict:
    """``result`` with other runs of the scored replay: per metric ``runs_values`` (the scored
    replay's first), ``runs_mean``, ``runs_min``, ``runs_max`` and ``runs_mean_rel_err``, the mean's
    error against the takes' mean where there are repeats, else against the reference.

    Why: under a router that reads timing, one simulated path is no more the simulator's answer than
    one take is the engine's; the runs' mean against the takes' mean compares the two expectations.
    A run must be the scored replay's settings but for ``jitter_seed``.
    """
    if not runs:
        return result
    seen = {scored.path.resolve()}
    for r in runs:
        if r.path.resolve() in seen:
            raise ConfigError(f"--run {r.path} is given twice or is the scored replay itself")
        seen.add(r.path.resolve())
        differ = _setting_difference(scored, r)
        if differ:
            k, want, got = differ
            raise ConfigError(f"--run {r.path} is not a run of the scored replay's settings (only --jitter-seed may "
                              f"differ): {k} is {got!r} there and {want!r} in {scored.path}")
    others = [compare(r, reference) for r in runs]
    for i, row in enumerate(result["metrics"]):
        values = [v for v in [row["a"], *(o["metrics"][i]["a"] for o in others)] if v is not None]
        mean = float(np.mean(values)) if values else None
        target = row["takes_mean"] if "takes_mean" in row else row["b"]
        row |= {"runs_values": values, "runs_mean": mean, "runs_min": min(values, default=None),
                "runs_max": max(values, default=None), "runs_mean_rel_err": _rel(mean, target)}
    result["runs"] = [str(r.path) for r in runs]
    return result


def _range_cell(row: dict) -> str:
    return "-" if row["takes_min"] is None else f"{_fmt(row['takes_min'])} .. {_fmt(row['takes_max'])}"


def _fmt(v) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000 or (float(v).is_integer() and abs(v) >= 10):
        return f"{v:,.0f}"
    return f"{v:.3f}"


def to_markdown(result: dict) -> str:
    from common.mdtable import markdown_table

    a, b = result["a"]["label"], result["b"]["label"]
    repeats = result.get("reference_repeats") or []
    runs = result.get("runs") or []
    header = ["metric", a, b, "rel. error"]
    if repeats:
        header += [f"{b}, {len(repeats) + 1} takes: range", "rel. error vs the takes' mean", "within the takes' range"]
    if runs:
        target = "the takes' mean" if repeats else b
        header += [f"{a}, {len(runs) + 1} runs: mean (range)", f"runs' mean vs {target}"]
    rows = []
    for r in result["metrics"]:
        row = [r["metric"], _fmt(r["a"]), _fmt(r["b"]), "-" if r["rel_err"] is None else f"{r['rel_err']:+.1%}"]
        if repeats:
            rel = r["rel_err_vs_takes_mean"]
            row += [_range_cell(r), "-" if rel is None else f"{rel:+.1%}",
                    {None: "-", True: "yes", False: "no"}[r["within_takes_range"]]]
        if runs:
            rel = r["runs_mean_rel_err"]
            row += ["-" if r["runs_mean"] is None else f"{_fmt(r['runs_mean'])} ({_fmt(r['runs_min'])} .. {_fmt(r['runs_max'])})",
                    "-" if rel is None else f"{rel:+.1%}"]
        rows.append(row)
    lines = [markdown_table(header, rows)]
    pt = result["per_turn"]
    lines += ["", f"{result['num_jobs']} jobs, {result['num_turns']} turns. Per turn: median |TTFT error| "
              f"{_fmt(pt['ttft_median_abs_rel_err'] * 100 if pt['ttft_median_abs_rel_err'] is not None else None)} %; "
              f"prefix-hit tokens within one block ({result['block_size']} tokens) on "
              f"{pt['turns_hit_within_one_block']:.0%} of turns, largest difference {pt['hit_tokens_max_abs_diff']} tokens."]
    if repeats:
        takes = [rep["per_turn"] for rep in repeats]
        inside = [r["within_takes_range"] for r in result["metrics"] if r["within_takes_range"] is not None]
        shares = ", ".join(f"{t['turns_hit_within_one_block']:.0%}" for t in takes)
        largest = ", ".join(str(t["hit_tokens_max_abs_diff"]) for t in takes)
        ttft = ", ".join(f"{t['ttft_median_abs_rel_err'] * 100:.1f} %" for t in takes if t["ttft_median_abs_rel_err"] is not None)
        hits_inside = pt["hit_within_one_block_within_spread"]
        closeness = "as close to the reference's as" if hits_inside else "further from the reference's than"
        lines += ["", f"{b} against itself ({len(repeats)} other take{'s' if len(repeats) > 1 else ''} of the same jobs "
                  "and settings, each scored against the reference as the replay is): prefix-hit tokens within one "
                  f"block on {shares} of turns, largest difference {largest} tokens; median |TTFT difference| {ttft}. "
                  f"{a} is within the takes' range on {sum(inside)} of {len(inside)} metrics, and its per-turn hits are "
                  f"{closeness} the other takes' are "
                  f"(turns within a block: {pt['turns_hit_within_one_block']:.0%}, "
                  f"{'at least' if hits_inside else 'below'} the lowest take's)."]
    return "\n".join(lines) + "\n"


FRAMES = ("turns", "jobs", "repeat_turns", "repeat_jobs")  # tables: CSV files and the plot, not comparison.json


def write(result: dict, out: str | Path, *, command: str | None = None) -> Path:
    """comparison.json, comparison.md, turns.csv (joined), jobs.csv and comparison.png into ``out``."""
    from common.outdir import write_text_atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {k: v for k, v in result.items() if k not in FRAMES} | {"command": command}
    write_text_atomic(out / "comparison.json", json.dumps(doc, indent=2) + "\n")
    write_text_atomic(out / "comparison.md", (f"<!-- {command} -->\n" if command else "") + to_markdown(result))
    write_text_atomic(out / "turns.csv", result["turns"].to_csv(index=False))
    write_text_atomic(out / "jobs.csv", result["jobs"].to_csv(index=False))
    _plot(result, out / "comparison.png")
    return out


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns, jobs = result["turns"], result["jobs"]
    a, b = result["a"]["label"], result["b"]["label"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (xa, xb, title) in zip(axes, ((turns["ttft_s_b"], turns["ttft_s_a"], "TTFT per turn (s)"),
                                          (jobs["jct_s_b"], jobs["jct_s_a"], "JCT per job (s)"),
                                          (turns["hit_tokens_b"], turns["hit_tokens_a"], "prefix-hit tokens per turn"))):
        ax.scatter(xa, xb, s=18, alpha=0.75, label=a)
        hi = float(max(xa.max(), xb.max(), 1e-9)) * 1.05
        for k, (rt, rj) in enumerate(zip(result.get("repeat_turns", []), result.get("repeat_jobs", []))):
            # another take of B against B: the spread a perfect replay of B would still show
            src, col = (rj, "jct") if title.startswith("JCT") else (rt, "ttft" if title.startswith("TTFT") else "hit")
            ra, rb = (src[f"{col}_s_b"], src[f"{col}_s_a"]) if col != "hit" else (src["hit_tokens_b"], src["hit_tokens_a"])
            ax.scatter(ra, rb, s=14, marker="x", color="grey", alpha=0.7, label=f"{b}, another take" if k == 0 else None)
            hi = max(hi, float(max(ra.max(), rb.max())) * 1.05)
        ax.plot([0, hi], [0, hi], color="grey", lw=1, ls="--")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel(b)
        ax.set_ylabel(a)
        ax.set_title(title)
        if result.get("repeat_turns"):
            ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{a} vs {b}: {result['num_jobs']} jobs, {result['num_turns']} turns (dashed: equal)")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
