"""`gpubench kvcomm eval`: can agent B import agent A's KV cache instead of re-encoding A's text?
`gpubench kvcomm serve-exchange`: how much of B's prompt does a serving backend's prefix cache serve,
and what does that save in B's time to first token?"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

from common import argtypes
from common.clihelp import DefaultsHelpFormatter, DeprecatedAlias
from common.errors import KVCommError

DEFAULT_TASKS = "handoff,handoff2"  # the tasks the 135M model answers at >= 0.8 as text, no answer prefix
DEFAULT_PROTOCOLS = "text,kv-rerotated,kv-own-anchored-once,placebo"


def register(sub) -> None:
    """Add `kvcomm` with its `eval`, `serve-exchange` and `ttft` sub-commands."""
    kv = sub.add_parser("kvcomm", help="KV-cache communication between agents (evaluation on a real model)",
                        description="KV-cache communication between agents.")
    kv_sub = kv.add_subparsers(dest="kvcomm_command", metavar="SUBCOMMAND")
    kv.set_defaults(func=lambda _args: (kv.print_help(), 2)[1])
    _register_eval(kv_sub)
    _register_serve_exchange(kv_sub)
    _register_ttft(kv_sub)
    from kvcomm import vllm_ttft

    vllm_ttft.register(kv_sub)


def _register_eval(kv_sub) -> None:
    from kvcomm.names import DEFAULT_ANCHOR_EXAMPLES, DEFAULT_BOUNDARY_K, DEFAULT_RATIO, PROTOCOLS, TASK_NAMES as TASKS

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
                   help="comma-separated protocols; kv-blend and remote-prefill+blend take one run per --ratio value, "
                        "kv-rerotated+boundary and kv-anchored+boundary one per --boundary-k value")
    p.add_argument("--n", type=argtypes.positive_int, default=200, help="examples per task")
    p.add_argument("--out", required=True, type=Path, help="run directory, e.g. results/kvcomm/NAME/")
    p.add_argument("--seed", type=int, default=0, help="task seed")
    p.add_argument("--ratio", default=str(DEFAULT_RATIO), help="kv-blend recompute ratio(s), comma-separated")
    p.add_argument("--boundary-k", default=str(DEFAULT_BOUNDARY_K),
                   help="tokens recomputed at the start of each imported chunk (kv-anchored+boundary: of each "
                        "later sender's), comma-separated")
    p.add_argument("--anchor-examples", type=argtypes.positive_int, default=DEFAULT_ANCHOR_EXAMPLES,
                   help="kv-anchored(+boundary), kv-own-anchored(-once): examples its anchor pool is built from; kv-layers: "
                        "examples its shared layers are chosen on (another seed's, never scored)")
    # --max-tokens as in `gpubench vllm generate` and vLLM's SamplingParams; the HF spelling stays an alias.
    p.add_argument("--max-tokens", type=argtypes.positive_int, default=5, dest="max_new_tokens",
                   help="answer tokens decoded (greedy)")
    p.add_argument("--max-new-tokens", action=DeprecatedAlias, canonical="--max-tokens", type=argtypes.positive_int,
                   dest="max_new_tokens")
    p.add_argument("--threads", type=argtypes.positive_int, default=1, help="torch CPU threads")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (out_dir, files written, rows, and per task and protocol: "
                        "n, em, rel_em, speedup_median, goal) instead of the table; progress stays on stderr")
    p.set_defaults(func=cmd_eval)


def _register_serve_exchange(kv_sub) -> None:
    from kvcomm.exchange import COLD_MODES, EXCHANGE_TASKS
    from kvcomm.load import LOAD_FLAG

    x = kv_sub.add_parser(
        "serve-exchange", help="prefix-cache hit rate and TTFT saving of a two-agent exchange on a serving backend",
        description="Agent A reads a shared document and writes a note; agent B's prompt starts with the same "
                    "system prompt and document, then A's note and a question. B's time to first token (streamed) "
                    "is measured with A's prefix in the backend's prefix cache (warm) and with the cache emptied "
                    "(cold), once per repeat, with the backend's own cached-token counts. Backends: vllm (starts "
                    "vLLM's server on 127.0.0.1 from `gpubench vllm setup`'s environment), hf (the model in this "
                    "process), http (any OpenAI-compatible server at --url). Writes summary.json and COMMAND into "
                    f"--out; the run is flagged when the load average exceeds {LOAD_FLAG} (plus the backend's own "
                    "threads while it runs).",
        formatter_class=DefaultsHelpFormatter)
    x.add_argument("--client", choices=("vllm", "hf", "http"), default="vllm", help="serving backend")
    x.add_argument("--url", help="the OpenAI-compatible server (--client http only), e.g. http://127.0.0.1:8000")
    x.add_argument("--model", default=None,
                   help="vllm/hf: model to load (default smollm2-135m); http: served model name (default: the "
                        "server's first)")
    x.add_argument("--task", default="drift", help=f"exchange content: {', '.join(EXCHANGE_TASKS)}")
    x.add_argument("--repeats", type=int, default=20, help="exchanges measured")
    x.add_argument("--warmup", type=int, default=1, help="unmeasured exchanges first")
    x.add_argument("--seed", type=int, default=0, help="task seed")
    x.add_argument("--max-tokens-a", type=int, default=48, help="tokens agent A writes")
    x.add_argument("--max-tokens-b", type=int, default=8, help="tokens agent B writes")
    x.add_argument("--cold", choices=COLD_MODES, default="auto",
                   help="how B's cold request misses: reset the prefix cache, or salt the prompt's start "
                        "(auto: reset when the backend can)")
    x.add_argument("--threads", type=int, default=2, help="vllm: engine OpenMP threads; hf: torch threads")
    x.add_argument("--block-size", type=int, default=None,
                   help="vllm: KV block size in tokens (default 128); http: the server's block size, if known "
                        "(for the most cacheable tokens)")
    x.add_argument("--port", type=int, default=None, help="vllm: port on 127.0.0.1 (default: a free one)")
    x.add_argument("--out", required=True, type=Path, help="output directory, e.g. results/kvcomm/serve-exchange/")
    x.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    x.add_argument("--json", action="store_true",
                   help="print summary.json's object on stdout instead of the headline; progress stays on stderr")
    x.set_defaults(func=cmd_serve_exchange)


def _register_ttft(kv_sub) -> None:
    from kvcomm.load import LOAD_FLAG
    from kvcomm.names import DEFAULT_BOUNDARY_K, DEFAULT_RATIO

    t = kv_sub.add_parser(
        "ttft", help="agent B's time to first token against the number of tokens it imports, per protocol",
        description="A sender writes an L-token message in its own chat; agent B takes it in, with its own "
                    "prefix cached, under each protocol, for every L in --lengths. Rounds are interleaved (every "
                    "protocol once per round, rotated order, after an untimed warm-up) and the speedup is the "
                    "median over rounds of TTFT(text) / TTFT(protocol) in the same round. Writes rows.jsonl, "
                    "summary.json/.md, ttft.png and COMMAND into a new --out; a run is flagged when the 1-minute "
                    f"load average exceeds {LOAD_FLAG} before it (plus its own threads while it runs), and so is "
                    "each row whose rounds ran under that load: the table printed and summary.md mark its "
                    "figures * and give the load average and CPU share beside them.",
        formatter_class=DefaultsHelpFormatter)
    t.add_argument("--model", default="smollm2-135m", help="smollm2-135m or an HF model directory")
    t.add_argument("--lengths", default="128,512,2048", help="imported tokens, comma-separated")
    t.add_argument("--protocols", default="text,kv-rerotated,kv-own-anchored-once,kv-blend",
                   help="comma-separated protocols (text is required: the speedup's reference)")
    t.add_argument("--ratio", default=str(DEFAULT_RATIO), help="kv-blend recompute ratio(s), comma-separated")
    t.add_argument("--boundary-k", default=str(DEFAULT_BOUNDARY_K),
                   help="tokens recomputed at the start of the imported message, comma-separated")
    t.add_argument("--senders", type=argtypes.positive_int, default=1,
                   help="split each imported length over this many senders' messages (B composes them)")
    t.add_argument("--anchor-examples", type=argtypes.positive_int, default=8,
                   help="kv-anchored(+boundary) with --senders > 1: exchanges of another seed in the anchor pool")
    t.add_argument("--repeats", type=argtypes.positive_int, default=7, help="timed rounds per length")
    t.add_argument("--seed", type=int, default=0, help="message seed")
    t.add_argument("--threads", type=argtypes.positive_int, default=1, help="torch CPU threads")
    t.add_argument("--out", required=True, type=Path, help="a new output directory, e.g. results/kvcomm/ttft/")
    t.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    t.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (the command, out_dir, files written, the contention state "
                        "and summary.json's per-length summary) instead of the table; progress stays on stderr")
    t.set_defaults(func=cmd_ttft)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_protocols(protocols: str, ratios: str, boundary_ks: str, anchor_examples: int | None = None) -> tuple:
    """ProtocolSpecs for the comma lists (one per ratio / k for the parameterized protocols)."""
    from kvcomm.names import DEFAULT_ANCHOR_EXAMPLES, protocol_features
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
    anchors = anchor_examples or DEFAULT_ANCHOR_EXAMPLES
    for name in _csv(protocols):
        f = protocol_features(ProtocolSpec(name).name)  # an unknown name: ProtocolSpec's one line
        # one spec per value of each parameter the protocol's features use
        for r in (ratio_values if f.blend else [ProtocolSpec.ratio]):
            for k in (k_values if f.boundary else [ProtocolSpec.boundary_k]):
                specs.append(ProtocolSpec(name, ratio=r, boundary_k=k,
                                          anchor_examples=anchors if f.anchored or f.boundary or f.layer_share
                                          else DEFAULT_ANCHOR_EXAMPLES))
    if not specs:
        raise KVCommError("no protocols given")
    if "text" not in [s.name for s in specs]:
        raise KVCommError("--protocols must include 'text': accuracy and speedup are reported relative to it")
    return tuple(dict.fromkeys(specs))


def cmd_eval(args) -> int:
    """Run (or resume) the evaluation and write the reports."""
    from kvcomm.eval_report import write_reports
    from kvcomm.evaluate import EvalConfig, run_eval
    from kvcomm.tasks import check_task

    if args.n < 1:
        raise KVCommError(f"--n must be >= 1 (got {args.n})")
    tasks = tuple(check_task(t) for t in _csv(args.tasks))
    if not tasks:
        raise KVCommError(f"--tasks names no task (got {args.tasks!r})")
    specs = parse_protocols(args.protocols, args.ratio, args.boundary_k, args.anchor_examples)
    _check_model(args.model)  # before run_eval creates --out
    cfg = EvalConfig(model=args.model, tasks=tasks, protocols=specs, n=args.n, out_dir=args.out, seed=args.seed,
                     max_new_tokens=args.max_new_tokens, num_threads=args.threads)
    rows = run_eval(cfg, progress=not args.no_progress)
    rows = rows[rows["task"].isin(tasks) & rows["protocol"].isin([s.label for s in specs]) & (rows["index"] < args.n)]
    command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["kvcomm"] else \
        _command_from_args(args)
    summary = write_reports(args.out, rows, command, [s.label for s in specs])
    if getattr(args, "json", False):
        import json
        import math

        def num(v):
            return float(v) if isinstance(v, (int, float)) and math.isfinite(float(v)) else (None if isinstance(v, float) else v)

        cols = ("task", "protocol", "n", "em", "retention", "retention_lo", "retention_hi", "num_text_right",
                "agree_text", "agree_lo", "agree_hi", "ci_level", "rel_em", "rel_em_lo", "rel_em_hi", "mcnemar_p",
                "kl_median", "text_above_chance", "speedup_median", "recompute_fraction", "goal")
        doc = {"out_dir": str(args.out),
               "files": [str(args.out / n) for n in ("results.jsonl", "summary.csv", "summary.md", "summary.png", "COMMAND")],
               "num_rows": int(len(rows)),
               "summary": [{c: num(r[c]) for c in cols if c in summary.columns} for r in summary.to_dict("records")]}
        print(json.dumps(doc, indent=2, allow_nan=False))
        return 0
    # plain print: a rich Console wraps wide tables at 80 columns when stdout is not a terminal
    print(summary[["task", "protocol", "n", "em", "retention", "retention_lo", "agree_text", "mcnemar_p", "kl_median",
                   "speedup_median", "recompute_fraction", "goal"]].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print(f"wrote {args.out}/summary.md, summary.csv, summary.png, COMMAND")
    return 0


def _check_model(spec: str) -> None:
    """The UnknownModelError load_model would raise, before anything is written."""
    from common.errors import UnknownModelError, suggest
    from kvcomm.models import KNOWN_NAMES

    if spec.lower() not in KNOWN_NAMES and not Path(spec).exists():
        raise UnknownModelError(f"unknown model '{spec}'{suggest(spec, KNOWN_NAMES)}; "
                                f"known: {', '.join(KNOWN_NAMES)}, or a config/model path")


def _command_from_args(args) -> str:
    """The equivalent command line (when called in-process, e.g. from tests)."""
    parts = ["gpubench", "kvcomm", "eval", "--model", args.model, "--tasks", args.tasks, "--protocols", args.protocols,
             "--n", str(args.n), "--out", str(args.out), "--seed", str(args.seed), "--ratio", args.ratio,
             "--boundary-k", args.boundary_k, "--max-tokens", str(args.max_new_tokens)]
    return " ".join(shlex.quote(p) for p in parts)


def cmd_serve_exchange(args) -> int:
    """Check the arguments, start the backend, measure, write summary.json and COMMAND."""
    import os

    from common.outdir import locked
    from kvcomm.exchange import ExchangeConfig, headline, run_exchange, write_outputs

    cfg = ExchangeConfig(task=args.task, repeats=args.repeats, seed=args.seed, max_tokens_a=args.max_tokens_a,
                         max_tokens_b=args.max_tokens_b, cold=args.cold, warmup=args.warmup)
    cfg.check()
    if args.threads < 1:
        raise KVCommError(f"--threads must be >= 1 (got {args.threads})")
    if args.client == "http" and not args.url:
        raise KVCommError("--client http needs --url (the OpenAI-compatible server, e.g. http://127.0.0.1:8000)")
    if args.client != "http" and args.url:
        raise KVCommError(f"--url is for --client http; --client {args.client} starts its own backend")
    if args.client != "vllm" and args.port is not None:
        raise KVCommError("--port is for --client vllm")
    if args.client == "hf" and args.block_size is not None:
        raise KVCommError("--block-size is for --client vllm or http (the in-process cache is token-granular)")
    if args.client == "http" and args.block_size is not None and args.block_size < 1:
        raise KVCommError(f"--block-size must be >= 1 (got {args.block_size})")
    if args.client == "vllm":
        from vllmref.settings import EngineSettings

        args.block_size = 128 if args.block_size is None else args.block_size
        EngineSettings(block_size=args.block_size, threads=args.threads).check()  # before the slow start
    command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) \
        if sys.argv[1:3] == ["kvcomm", "serve-exchange"] else _exchange_command_from_args(args)

    def progress(msg: str) -> None:
        if not args.no_progress:
            print(f"serve-exchange: {msg}", file=sys.stderr, flush=True)

    if args.out.exists() and not args.out.is_dir():
        raise KVCommError(f"--out {args.out}: exists and is not a directory")
    load_before = os.getloadavg()[0]  # before the backend adds its own load
    if args.client != "http":
        progress(f"starting the {args.client} backend (load average {load_before:.2f})")
    with _make_client(args) as client, locked(args.out):  # a backend that is not there leaves no --out behind
        summary = run_exchange(client, cfg, load_before=load_before, progress=progress)
        write_outputs(args.out, summary, command)
    if args.json:
        import json

        print(json.dumps({"command": command, **summary}, indent=1))  # what summary.json holds
        return 0
    print(headline(summary))
    if summary["load"]["flagged"]:
        print("FLAGGED, not for quoting: " + "; ".join(summary["load"]["flags"]))
    print(f"wrote {args.out}/summary.json, COMMAND")
    return 0


def _make_client(args):
    if args.client == "http":
        from kvcomm.clients.openai_http import OpenAIHTTPClient

        return OpenAIHTTPClient(args.url, args.model, block_size=args.block_size)
    if args.client == "hf":
        from kvcomm.clients.hf import HFClient

        return HFClient(args.model or "smollm2-135m", threads=args.threads)
    from kvcomm.clients.vllm import VllmClient

    return VllmClient(args.model or "smollm2-135m", threads=args.threads, block_size=args.block_size, port=args.port)


def _exchange_command_from_args(args) -> str:
    parts = ["gpubench", "kvcomm", "serve-exchange", "--client", args.client]
    if args.url:
        parts += ["--url", args.url]
    if args.model:
        parts += ["--model", args.model]
    parts += ["--task", args.task, "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--seed", str(args.seed),
              "--max-tokens-a", str(args.max_tokens_a), "--max-tokens-b", str(args.max_tokens_b), "--cold", args.cold,
              "--threads", str(args.threads)]
    if args.block_size is not None:
        parts += ["--block-size", str(args.block_size)]
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


def cmd_ttft(args) -> int:
    """Check the arguments, time the sweep, write the outputs into a new --out."""
    import os

    from common.outdir import locked
    from kvcomm.models import load_model
    from kvcomm.ttft import ROWS_FILE, TtftConfig, contention_lines, markdown_table, run_sweep, write_outputs

    try:
        lengths = tuple(int(v) for v in _csv(args.lengths))
    except ValueError:
        raise KVCommError(f"--lengths must be comma-separated token counts (got {args.lengths!r})") from None
    cfg = TtftConfig(model=args.model, lengths=lengths, protocols=parse_protocols(args.protocols, args.ratio,
                     args.boundary_k, args.anchor_examples), repeats=args.repeats, seed=args.seed,
                     num_threads=args.threads, num_senders=args.senders, anchor_examples=args.anchor_examples)
    cfg.check()
    _check_model(args.model)
    if (args.out / ROWS_FILE).exists():
        raise KVCommError(f"{args.out} already holds a ttft run ({ROWS_FILE}); timings are not resumed: "
                          f"choose a new --out or remove that one")
    with locked(args.out, "kvcomm ttft directory"):
        load_before = os.getloadavg()[0]
        model, tokenizer = load_model(args.model)
        if tokenizer is None:
            raise KVCommError(f"model '{args.model}' has no tokenizer: the messages are text")
        say = None if args.no_progress else (lambda text: print(f"kvcomm ttft: {text}", file=sys.stderr, flush=True))
        rows = run_sweep(cfg, model, tokenizer, progress=say)
        command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["kvcomm"] else \
            " ".join(shlex.quote(p) for p in ["gpubench", "kvcomm", "ttft", "--model", args.model, "--lengths",
                                              args.lengths, "--protocols", args.protocols, "--ratio", args.ratio,
                                              "--boundary-k", args.boundary_k, "--senders", str(args.senders),
                                              "--anchor-examples", str(args.anchor_examples), "--repeats", str(args.repeats),
                                              "--out", str(args.out)])
        summary, state = write_outputs(args.out, cfg, rows, command, load_before)
    if args.json:
        import json

        files = [str(args.out / n) for n in (ROWS_FILE, "summary.json", "summary.md", "ttft.png", "COMMAND")]
        print(json.dumps({"command": command, "out_dir": str(args.out), "files": files, "contention": state,
                          "summary": summary}, indent=1))
        return 0
    print(markdown_table(summary), end="")
    for line in contention_lines(state):
        print(line)
    print(f"wrote {args.out}/rows.jsonl, summary.json, summary.md, ttft.png, COMMAND")
    return 0
