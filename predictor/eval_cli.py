"""``gpubench profile`` (step rows) and ``gpubench evaluate`` (score the predictor on them)."""
from __future__ import annotations

import sys
from pathlib import Path

from common import argtypes
from common.clihelp import DefaultsHelpFormatter


def register(sub) -> None:
    """Add the ``profile``, ``evaluate`` and ``score-kernels`` sub-commands."""
    _register_profile(sub)
    _register_evaluate(sub)
    _register_score_kernels(sub)


def _register_profile(sub) -> None:
    p = sub.add_parser(
        "profile", help="time real engine steps of a model (ground-truth step rows)",
        description="Run real forward steps (input preparation + forward + greedy sampling + synchronize) of a "
                    "model built from a config with random weights, over a grid of batch, context and phase. "
                    "Rows are appended as measured; rerunning the same command resumes where it stopped.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="shipped config name (e.g. smollm2-135m) or path to a config.json")
    p.add_argument("--engine", default="torch", choices=("torch", "torch-graph", "vllm"),
                   help="torch: our eager engine loop; torch-graph: the same weights as a serving engine runs them "
                        "(static buffers, fused qkv/gate_up and elementwise kernels, varlen flash attention, decode "
                        "steps replayed as CUDA graphs on a GPU; eager on the CPU); vllm: a real vLLM V1 engine (set "
                        "it up with `gpubench vllm setup`); smollm2-135m runs the real converted model, other configs "
                        "random weights")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                   help="weights and KV dtype (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--out", type=Path, help="rows file (.parquet); an existing file is extended (required unless --list)")
    p.add_argument("--grid", default=None, choices=("tiny", "quick", "default", "gpu", "graph"),
                   help="grid of points (default: gpu with --device cuda, else default; tiny: --engine vllm only, a "
                        "CI smoke run; gpu: the default grid with a GPU's memory cap and no FLOP cap that binds, for "
                        "7-8B models on a GPU: the others drop the points over a 2-core CPU's caps, and say how many; "
                        "graph: decode shapes from 1 to 64 sequences at 256-4,096 tokens plus a few prefill and mixed "
                        "points, for --engine torch-graph on a GPU)")
    p.add_argument("--ops-subset", type=argtypes.nonneg_int, default=16, metavar="K",
                   help="also profile per-op times (torch.profiler) at K points spread over the grid; 0: none")
    p.add_argument("--threads", type=argtypes.positive_int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--max-points", type=argtypes.positive_int, default=None, help="stop after the first N grid points")
    v = p.add_argument_group("vLLM engine options (--engine vllm)")
    v.add_argument("--block-size", type=argtypes.positive_int, default=128, help="KV block size (vLLM's CPU default; a multiple of 32)")
    v.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=4096, help="token budget per step (vLLM's CPU default)")
    v.add_argument("--max-num-seqs", type=argtypes.positive_int, default=256, help="most running requests")
    v.add_argument("--retake-contended", type=argtypes.nonneg_int, default=2, metavar="N",
                   help="run a scenario with a step taken under contention (CPU share or load) again, up to N times, "
                        "and keep the take with fewer contended steps; 0: keep the first take")
    v.add_argument("--takes", type=argtypes.positive_int, default=3, metavar="N",
                   help="run the grid N times, each a fresh engine start, and make each row the median of its step "
                        "over them (a vLLM step cannot be repeated in place, and the steps of one scenario run move together)")
    g = p.add_argument_group("graph engine options (--engine torch-graph)")
    g.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"),
                   help="fused elementwise kernels: Triton (auto picks it on a GPU where Triton is installed) or the "
                        "torch fallbacks (auto on the CPU)")
    g.add_argument("--attention", default="auto", choices=("auto", "flash-varlen", "sdpa"),
                   help="auto: torch's varlen flash kernel with a block table where it exists and passes a self-check "
                        "(a GPU, fp16/bf16), else SDPA; the row says which ran and why")
    p.add_argument("--list", action="store_true", help="print the grid points (with --json: a JSON list) and exit")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (rows file, rows in it, rows this run added, contended rows, "
                        "phases and models) instead of the summary line; progress stays on stderr")
    p.set_defaults(func=_profile)


def _register_evaluate(sub) -> None:
    e = sub.add_parser(
        "evaluate", help="score the step predictor and baselines on step rows",
        description="Score the additive and max forms of the step model (with the given calibration, and with "
                    "hardware scales fitted on training rows), a Vidur-style baseline (sum of per-op profiled "
                    "medians) and a random forest on step rows, with held-out splits by batch, context and model. "
                    "Writes CSV and Markdown tables, PNG plots, calibrations and a COMMAND file into --out.",
        formatter_class=DefaultsHelpFormatter)
    e.add_argument("rows", nargs="+", type=Path, help="step-row files written by `gpubench profile`")
    e.add_argument("--calibration", type=Path, default=None,
                   help="calibration.json from `gpubench fit` (default: spec/published tier)")
    e.add_argument("--force-calibration", action="store_true",
                   help="use a calibration that describes another machine (another CPU, or another SKU) anyway")
    e.add_argument("--sku", default="cpu", help="hardware the rows were measured on (SKU id)")
    e.add_argument("--out", required=True, type=Path, help="output directory for tables and plots")
    e.add_argument("--seed", type=argtypes.seed32, default=0, help="random forest seed")
    e.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (out_dir, files written, rows, and the pooled MAPE per split, "
                        "method and phase) instead of the headline")
    e.add_argument("--target", default="wall_s", choices=("wall_s", "thread_cpu_s"),
                   help="measured time to score against: engine-step wall time, or the step thread CPU time")
    e.add_argument("--allow-contended", action="store_true",
                   help="score files that hold rows taken under contention (those rows are dropped)")
    e.set_defaults(func=_evaluate)


def _register_score_kernels(sub) -> None:
    k = sub.add_parser(
        "score-kernels", help="score the step model's device time per op kind against profiled GPU kernel times",
        description="For the GPU step rows that `gpubench profile` ran under torch.profiler (--ops-subset), compare "
                    "the summed kernel time of their linear layers, their attention and all their kernels with the "
                    "step model's device time for the same batch (GEMM ops, attention op, all ops; no launch "
                    "interval or host residual). Nothing is fitted on the rows. Writes kernels.csv, summary.csv, "
                    "kernels.md, kernels.png and COMMAND into --out.",
        formatter_class=DefaultsHelpFormatter)
    k.add_argument("rows", nargs="+", type=Path, help="GPU step-row files written by `gpubench profile --device cuda`")
    k.add_argument("--sku", required=True, help="the GPU the rows were measured on (SKU id, e.g. h200)")
    k.add_argument("--calibration", type=Path, default=None,
                   help="calibration.json from `gpubench fit` of that GPU (default: spec/published tier)")
    k.add_argument("--force-calibration", action="store_true", help="use a calibration of another SKU anyway")
    k.add_argument("--out", required=True, type=Path, help="output directory")
    k.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (out_dir, files written, rows scored, and MAPE / mean signed "
                        "error per kind, pooled and by model) instead of the Markdown table")
    k.set_defaults(func=_score_kernels)


def _profile(args) -> int:
    from common.errors import ConfigError
    from common.model_config import load_model_config
    from predictor.profile import ProfileConfig, run_profile
    from predictor.profile_grid import GRIDS, build_grid, default_grid, num_dropped

    cfg = load_model_config(args.model)
    if args.engine == "vllm":
        args.grid = args.grid or "default"
        return _profile_vllm(args, cfg)
    if args.grid == "tiny":
        raise ConfigError(f"--grid tiny is a vLLM smoke grid; use quick or default with --engine {args.engine}")
    if args.engine != "torch-graph" and (args.kernels != "auto" or args.attention != "auto"):
        raise ConfigError("--kernels and --attention choose the graph engine's kernels; add --engine torch-graph")
    on_gpu = args.device.startswith("cuda")
    args.grid = args.grid or default_grid(args.device)
    dtype_bytes = 2 if (args.dtype or ("bf16" if on_gpu else "fp32")) != "fp32" else 4
    if on_gpu and args.grid not in ("gpu", "graph") and (dropped := num_dropped(GRIDS[args.grid], cfg, dtype_bytes=dtype_bytes)):
        print(f"warning: --grid {args.grid} drops {dropped} points of {cfg.name} over a 2-core CPU's caps "
              f"(KV cache, FLOPs per step); --grid gpu keeps them", file=sys.stderr)
    if args.list:
        points = build_grid(GRIDS[args.grid], cfg, dtype_bytes=dtype_bytes)[: args.max_points]
        if args.json:
            import json

            print(json.dumps([{"key": pt.key, "phase": pt.phase, "batch": [list(s) for s in pt.batch]} for pt in points],
                             indent=2))
            return 0
        for pt in points:
            print(pt.key)
        return 0
    if args.out is None:
        raise ConfigError("profile: --out ROWS.parquet is required (or --list to print the grid)")
    if args.out.suffix != ".parquet":
        raise ConfigError(f"profile: --out must end in .parquet, got '{args.out}'")
    pc = ProfileConfig(model=args.model, device=args.device, dtype=args.dtype, grid=args.grid,
                       ops_subset=args.ops_subset, num_threads=args.threads, max_points=args.max_points,
                       engine=args.engine, kernels=args.kernels, attention=args.attention,
                       command=["gpubench"] + sys.argv[1:] if sys.argv and "gpubench" in sys.argv[0]
                       else ["gpubench", "profile", "--model", args.model, "--engine", args.engine,
                             "--device", args.device,
                             "--grid", args.grid, "--out", str(args.out)])
    before = _num_rows(args.out)
    rows = _with_progress("profile", cfg.name, "", lambda progress: run_profile(cfg, pc, args.out, progress=progress), json_out=args.json)
    if args.json:
        _print_profile_json(args.out, rows, before)
        return 0
    print(f"{len(rows)} rows in {args.out}")
    return 0


def _num_rows(path) -> int:
    """Rows already in a rows file (0 when there is none yet)."""
    if not path.is_file():
        return 0
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def _print_profile_json(out, rows, before: int, contended: int | None = None) -> None:
    import json

    import pandas as pd

    df = rows if isinstance(rows, pd.DataFrame) else pd.read_parquet(out)
    doc = {"rows_file": str(out), "num_rows": int(len(df)), "num_added": int(len(df)) - before,
           "phases": {str(k): int(v) for k, v in df["phase"].value_counts().sort_index().items()} if "phase" in df else {},
           "models": sorted(str(m) for m in df["model"].unique()) if "model" in df else []}
    if contended is not None:
        doc["num_contended"] = int(contended)
    print(json.dumps(doc, indent=2))


def _with_progress(title: str, model: str, first: str, run, *, json_out: bool = False):
    """``run(progress)`` under a progress bar; ``progress(done, total, what)`` moves it. With
    ``json_out`` the bar is on stderr (stdout carries the JSON), and only on a terminal: a bar's
    final line would otherwise make a one-line error two."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True) if json_out else None  # so console is not None exactly when json_out
    with Progress(TextColumn(f"[bold]{title} {{task.fields[model]}}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[point]}"), transient=False, console=console,
                  disable=console is not None and not console.is_terminal) as bar:
        task = bar.add_task(title, total=None, model=model, point=first)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, point=what)

        return run(progress)


def _profile_vllm(args, cfg) -> int:
    from common.errors import ConfigError
    from predictor.vllm_profile import MIN_CPU_SHARE, VLLM_GRIDS, VllmProfileConfig, build_scenarios, contention_summary, run_vllm_profile

    if args.list:
        if args.grid not in VLLM_GRIDS:
            raise ConfigError(f"--grid '{args.grid}': use one of {', '.join(VLLM_GRIDS)} with --engine vllm")
        scenarios = build_scenarios(VLLM_GRIDS[args.grid], cfg, block_size=args.block_size)
        if args.json:
            import json

            print(json.dumps([{"name": s["name"], "num_requests": len(s["requests"])} for s in scenarios], indent=2))
            return 0
        for s in scenarios:
            print(s["name"], len(s["requests"]), "requests")
        return 0
    if args.out is None or args.out.suffix != ".parquet":
        raise ConfigError("profile: --out ROWS.parquet is required (or --list to print the scenarios)")
    pc = VllmProfileConfig(model=args.model, grid=args.grid, threads=2 if args.threads is None else args.threads,
                           block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_num_seqs=args.max_num_seqs, retake_contended=args.retake_contended, takes=args.takes,
                           command=("gpubench", *sys.argv[1:]))
    before = _num_rows(args.out)
    rows = _with_progress("profile vllm", cfg.name, "starting the engine",
                          lambda progress: run_vllm_profile(cfg, pc, args.out, progress=progress), json_out=args.json)
    contended, total = contention_summary(rows)
    if contended:
        print(f"warning: {contended} of {total} steps were taken under contention (CPU share < {MIN_CPU_SHARE} or "
              f"load above the core count + 1): not ground truth; `gpubench evaluate` refuses them unless "
              f"--allow-contended", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        _print_profile_json(args.out, rows, before, contended)
        return 0
    print(f"{total} engine-step rows in {args.out}")
    return 0


def _evaluate(args) -> int:
    from common.errors import ConfigError
    from predictor.evaluate import EvalConfig, run_evaluation

    if args.out.exists() and not args.out.is_dir():  # before the fits, not after them
        raise ConfigError(f"{args.out}: exists and is not a directory (--out is the output directory)")
    loaded = None
    if args.calibration is not None:
        from predictor.host_match import calibration_for_command

        # evaluate prices the CPU the calibration recorded (the rows' machine), not this host
        loaded = calibration_for_command(args.calibration, args.sku, force=args.force_calibration,
                                         recorded_host_priced=True)

    ec = EvalConfig(rows=[str(r) for r in args.rows], calibration=str(args.calibration) if args.calibration else None,
                    sku=args.sku, out=str(args.out), seed=args.seed, target=args.target,
                    allow_contended=args.allow_contended, loaded_calibration=loaded,
                    force_calibration=args.force_calibration)
    summary = run_evaluation(ec)
    if getattr(args, "json", False):
        _print_evaluate_json(args.out)
        return 0
    print(summary)
    return 0


def _score_kernels(args) -> int:
    from predictor.kernel_score import run_score

    calibration = None
    if args.calibration is not None:
        from predictor.host_match import calibration_for_command

        calibration = calibration_for_command(args.calibration, args.sku, force=args.force_calibration)
    score, text, files = run_score([str(r) for r in args.rows], sku=args.sku, calibration=calibration,
                                   calibration_path=str(args.calibration) if args.calibration else None,
                                   force_calibration=args.force_calibration, out=str(args.out))
    for note in score.notes:
        print(f"warning: {note}", file=sys.stderr)
    if not args.json:
        print(text)
        return 0
    import json

    pooled = score.pooled[score.pooled["phase"] == "all"]
    doc = {"out_dir": str(args.out), "files": [str(f) for f in files], "num_rows": int(score.rows["key"].nunique()),
           "mape_pct": {r.kind: float(r.mape_pct) for r in pooled.itertuples()},
           "signed_pct": {r.kind: float(r.signed_pct) for r in pooled.itertuples()},
           "mape_pct_by_model": {k: {r.model: float(r.mape_pct) for r in g.itertuples()}
                                 for k, g in score.by_model.groupby("kind")}}
    print(json.dumps(doc, indent=2, allow_nan=False))
    return 0


def _print_evaluate_json(out) -> None:
    import json
    import math

    import pandas as pd

    met = pd.read_csv(out / "metrics.csv")
    pooled = met[met["fold"] == "pooled"]
    if "rows" in pooled:
        pooled = pooled[pooled["rows"] == "all"]  # every row, not the op-profiled subset
    mape: dict = {}
    for r in pooled.to_dict("records"):
        v = float(r["mape_pct"])
        mape.setdefault(r["split"], {}).setdefault(r["method"], {})[r["phase"]] = v if math.isfinite(v) else None
    names = ("metrics.csv", "predictions.csv", "wilcoxon.csv", "host_residual_fits.csv", "transfer.csv",
             "pred_vs_measured.png", "error_vs_batch.png", "calibration.json", "calibration-rowcal.json",
             "headline.md", "tables.md", "COMMAND")
    doc = {"out_dir": str(out), "files": [str(out / n) for n in names if (out / n).is_file()],
           "num_rows": int(pd.read_csv(out / "predictions.csv", usecols=["key"])["key"].nunique()),
           "mape_pct": mape}
    print(json.dumps(doc, indent=2, allow_nan=False))
