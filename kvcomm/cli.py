"""`gpubench kvcomm eval`: can agent B import agent A's KV cache instead of re-encoding A's text?"""
from __future__ import annotations

import argparse

import shlex
import sys
from pathlib import Path

from gpubench import argtypes
from gpubench.clihelp import DefaultsHelpFormatter
from gpubench.errors import KVCommError

DEFAULT_TASKS = "keycode,twoagent"
DEFAULT_PROTOCOLS = "text,kv-verbatim,kv-rerotated,kv-rerotated+boundary,kv-blend"


def register(sub) -> None:
    """Add `kvcomm` with its `eval` sub-command."""
    from kvcomm.names import DEFAULT_BOUNDARY_K, DEFAULT_RATIO, PROTOCOLS, TASK_NAMES as TASKS

    kv = sub.add_parser("kvcomm", help="KV-cache communication between agents (evaluation on a real model)",
                        description="KV-cache communication between agents.")
    kv_sub = kv.add_subparsers(dest="kvcomm_command", metavar="SUBCOMMAND")
    kv.set_defaults(func=lambda _args: (kv.print_help(), 2)[1])

    p = kv_sub.add_parser(
        "eval", help="accuracy and receiver TTFT of text vs KV-import protocols on seeded multi-agent tasks",
        description="Sender agents write notes in their own chats; agent B answers a question from them, "
                    "receiving the notes under each protocol. Writes results.jsonl (one row per task, example "
                    "and protocol; a rerun with the same --out resumes), summary.csv/.md/.png and COMMAND. "
                    f"Protocols: {', '.join(PROTOCOLS)}. Tasks: {', '.join(TASKS)}.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m or an HF model directory")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated task names")
    p.add_argument("--protocols", default=DEFAULT_PROTOCOLS,
                   help="comma-separated protocols; kv-blend takes one run per --ratio value, "
                        "kv-rerotated+boundary one per --boundary-k value")
    p.add_argument("--n", type=argtypes.positive_int, default=200, help="examples per task")
    p.add_argument("--out", required=True, type=Path, help="run directory, e.g. results/kvcomm/NAME/")
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--ratio", default=str(DEFAULT_RATIO), help="kv-blend recompute ratio(s), comma-separated")
    p.add_argument("--boundary-k", default=str(DEFAULT_BOUNDARY_K),
                   help="tokens recomputed at the start of each imported chunk, comma-separated")
    p.add_argument("--max-new-tokens", type=argtypes.positive_int, default=5, help="answer tokens decoded (greedy)")
    p.add_argument("--threads", type=argtypes.positive_int, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_protocols(protocols: str, ratios: str, boundary_ks: str) -> tuple:
    """ProtocolSpecs for the comma lists (one per ratio / k for the parameterized protocols)."""
    from kvcomm.protocols import ProtocolSpec

    try:
        ratio_values = [float(r) for r in _csv(ratios)]
        k_values = [int(k) for k in _csv(boundary_ks)]
    except ValueError as exc:
        raise KVCommError(f"bad --ratio/--boundary-k value: {exc}") from None
    if not all(0.0 <= r <= 1.0 for r in ratio_values):  # also NaN; checked before the model loads
        raise KVCommError(f"--ratio values must be within [0, 1], got {ratios!r}")
    if any(k < 0 for k in k_values):
        raise KVCommError(f"--boundary-k values must be >= 0, got {boundary_ks!r}")
    specs = []
    for name in _csv(protocols):
        if name == "kv-blend":
            specs += [ProtocolSpec(name, ratio=r) for r in ratio_values]
        elif name == "kv-rerotated+boundary":
            specs += [ProtocolSpec(name, boundary_k=k) for k in k_values]
        else:
            specs.append(ProtocolSpec(name))
    if not specs:
        raise KVCommError("no protocols given")
    if "text" not in [s.name for s in specs]:
        raise KVCommError("--protocols must include 'text': accuracy and speedup are reported relative to it")
    return tuple(dict.fromkeys(specs))


def cmd_eval(args) -> int:
    """Run (or resume) the evaluation and write the reports."""
    from kvcomm.evaluate import EvalConfig, run_eval, write_reports
    from kvcomm.tasks import check_task

    if args.n < 1:
        raise KVCommError(f"--n must be >= 1 (got {args.n})")
    tasks = tuple(check_task(t) for t in _csv(args.tasks))
    if not tasks:
        raise KVCommError(f"--tasks names no task (got {args.tasks!r})")
    specs = parse_protocols(args.protocols, args.ratio, args.boundary_k)
    _check_model(args.model)  # before run_eval creates --out
    cfg = EvalConfig(model=args.model, tasks=tasks, protocols=specs, n=args.n, out_dir=args.out, seed=args.seed,
                     max_new_tokens=args.max_new_tokens, num_threads=args.threads)
    rows = run_eval(cfg, progress=not args.no_progress)
    rows = rows[rows["task"].isin(tasks) & rows["protocol"].isin([s.label for s in specs]) & (rows["index"] < args.n)]
    command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["kvcomm"] else \
        _command_from_args(args)
    summary = write_reports(args.out, rows, command, [s.label for s in specs])
    # plain print: a rich Console wraps wide tables at 80 columns when stdout is not a terminal
    print(summary[["task", "protocol", "n", "em", "rel_em", "rel_em_lo", "mcnemar_p", "kl_median", "agree_text",
                   "speedup_median", "recompute_fraction", "goal"]].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"wrote {args.out}/summary.md, summary.csv, summary.png, COMMAND")
    return 0


def _check_model(spec: str) -> None:
    """The UnknownModelError load_model would raise, before anything is written."""
    from gpubench.errors import UnknownModelError, suggest
    from kvcomm.models import KNOWN_NAMES

    if spec.lower() not in KNOWN_NAMES and not Path(spec).exists():
        raise UnknownModelError(f"unknown model '{spec}'{suggest(spec, KNOWN_NAMES)}; "
                                f"known: {', '.join(KNOWN_NAMES)}, or a config/model path")


def _command_from_args(args) -> str:
    """The equivalent command line (when called in-process, e.g. from tests)."""
    parts = ["gpubench", "kvcomm", "eval", "--model", args.model, "--tasks", args.tasks, "--protocols", args.protocols,
             "--n", str(args.n), "--out", str(args.out), "--seed", str(args.seed), "--ratio", args.ratio,
             "--boundary-k", args.boundary_k, "--max-new-tokens", str(args.max_new_tokens)]
    return " ".join(shlex.quote(p) for p in parts)
