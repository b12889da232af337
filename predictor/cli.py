"""`gpubench fit` (run directory -> calibration.json) and `gpubench predict` (one step's time)."""
from __future__ import annotations

import argparse
import json
import sys

from common.clihelp import DeprecatedAlias
from common.errors import ConfigError

PHASES = ("decode", "prefill", "mixed")


def register(sub) -> None:
    """Add the `fit` and `predict` sub-commands."""
    p = sub.add_parser(
        "fit", help="fit the predictor's efficiency parameters from a gpubench run",
        description="Fit eta_mem (eta_max, x_half) from the stream/l2 cold sweeps, eta_active from `peak`, "
                    "eta_duty from `gemm`, t_launch from `launch`, f_clk from telemetry. Parameters a run "
                    "lacks fall back to published, then spec values; each says which tier it came from.")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="*",
                   help="a run directory (results/<sku>/<stamp>-<host>/); several runs of one device are fitted "
                        "together, each probe from the run that measured it (a probe in two runs is refused)")
    p.add_argument("--from-silicon", metavar="SYSTEM", default=None,
                   help="instead of a run: fit a GPU's calibration from the kernels NVIDIA measured on it (the "
                        "aiconfigurator-core tables, extra 'reference'; systems: `gpubench silicon --list`): GEMM "
                        "fixed time, streaming bandwidth and eta_duty(M) from its GEMMs, the attention floor and "
                        "rate from its attention kernels")
    p.add_argument("--framework", default=None, choices=("vllm", "sglang", "trtllm"),
                   help="with --from-silicon: whose tables (default: vllm)")
    # -o/--out as every other command's output option; --output stays a hidden alias.
    p.add_argument("-o", "--out", default="calibration.json", dest="output", metavar="PATH", help="where to write (default: %(default)s)")
    p.add_argument("--output", action=DeprecatedAlias, canonical="--out", dest="output")
    p.add_argument("--dtype", default=None, help="dtype to calibrate (default: bf16 on GPUs, fp32 on the CPU)")
    p.add_argument("--json", action="store_true", help="print the calibration JSON instead of a table")
    p.add_argument("--allow-contended", action="store_true",
                   help="fit a run taken under contention (load above the core count + 1, or probes that got "
                        "under 80 %% of their CPU) instead of refusing it; the calibration is marked")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print every fit warning in full (default: one or two short lines; they are always in the "
                        "calibration's meta.contended and meta.fit.warnings)")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser(
        "predict", help="predict one forward step's time for a model, batch and context on an SKU",
        description="Predict the time of one forward step (model: docs/predictor.md). Decode: BATCH sequences with CONTEXT "
                    "cached tokens, one new token each. Prefill: BATCH sequences of NEW_TOKENS (default: CONTEXT) "
                    "new tokens, nothing cached. Mixed: BATCH-1 decodes at CONTEXT plus one chunked prefill of "
                    "NEW_TOKENS (default 512) over CONTEXT cached tokens.")
    p.add_argument("--sku", default=None,
                   help="SKU id or alias, or `cpu` for this host (default: the calibration's SKU, else h100-sxm)")
    p.add_argument("--model", default="llama-3.1-8b", help="shipped model name or path to a config.json (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="number of sequences (default: %(default)s)")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per sequence (default: %(default)s)")
    p.add_argument("--phase", choices=PHASES, default="decode", help="step kind (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=None, help="prefill length (prefill: default CONTEXT; mixed: 512)")
    p.add_argument("--batch-json", default=None, metavar="JSON",
                   help="an explicit batch, e.g. '[[512, 1024], [1, 2048]]' (new, cached tokens per sequence); "
                        "overrides --phase/--batch/--context")
    p.add_argument("--calibration", default=None, metavar="FILE", help="calibration.json from `gpubench fit`")
    p.add_argument("--force-calibration", action="store_true",
                   help="use a calibration that describes another machine (another CPU, or another SKU) anyway")
    p.add_argument("--engine", choices=("vllm", "torch", "torch-graph"), default="vllm",
                   help="what runs the step: vllm = vLLM V1 as it runs by default (GPU: CUDA graphs and asynchronous "
                        "scheduling; CPU: its fused projections, its kernels and engine cost when the calibration "
                        "probed them); torch = this project's eager, synchronous loop; torch-graph = its graph engine "
                        "(GPU only: fused kernels, CUDA graphs, synchronous) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: the threads the engine runs with; refused when the calibration's probes ran at another "
                        "count (default: the calibration's)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="GPU, --engine torch: each kernel pays the CUDA-graph node interval instead of the eager "
                        "launch interval (vllm: always)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="GPU, --engine torch: the host's per-step work overlaps the device, so a step takes max(device, "
                        "host) instead of their sum (vllm: always)")
    p.add_argument("--form", choices=("additive", "max"), default="additive", help="step form (default: %(default)s)")
    p.add_argument("--dtype", default=None, help="default: bf16 on GPUs, fp32 on the CPU")
    p.add_argument("--breakdown", action="store_true", help="print the per-op table")
    p.add_argument("--check-drift", action="store_true",
                   help="CPU: time the probes' cold reference GEMV now (about two seconds) and compare it with the "
                        "calibration's probe run; warns when this host's memory phase is more than 10%% off it")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=cmd_predict)


MAX_BATCH = 1_000_000  # far past any engine's max_num_seqs; the batch list is built in memory


def build_batch(phase: str, batch: int, context: int, new_tokens: int | None) -> list[tuple[int, int]]:
    """The (num_new_tokens, num_cached_tokens) list the CLI options describe."""
    if batch < 1:
        raise ConfigError(f"--batch must be >= 1 (got {batch})")
    if batch > MAX_BATCH:
        raise ConfigError(f"--batch must be <= {MAX_BATCH:,} sequences (got {batch:,})")
    if context < 0:
        raise ConfigError(f"--context must be >= 0 (got {context})")
    if new_tokens is not None and new_tokens < 1:
        raise ConfigError(f"--new-tokens must be >= 1 (got {new_tokens})")
    if phase == "decode":
        return [(1, context)] * batch
    if phase == "prefill":
        n = new_tokens or context
        if n < 1:
            raise ConfigError("prefill needs --new-tokens or --context >= 1")
        return [(n, 0)] * batch
    return [(new_tokens or 512, context)] + [(1, context)] * (batch - 1)


def parse_batch_json(text: str) -> list[tuple[int, int]]:
    """``[[num_new_tokens, num_cached_tokens], ...]`` from the command line; ConfigError if malformed."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--batch-json: malformed JSON ({e.msg} at column {e.colno})") from None
    ok = isinstance(raw, list) and raw and all(
        isinstance(s, list) and len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s) for s in raw)
    if not ok:
        raise ConfigError(f"--batch-json: expected a non-empty list of [num_new_tokens, num_cached_tokens] integer pairs, got {text!r}")
    return [(int(n), int(c)) for n, c in raw]


def cmd_predict(args: argparse.Namespace) -> int:
    from predictor.engines import probe_threads, step_model_for_engine
    from predictor.host_match import calibration_and_warnings, print_warnings

    calibration, sku, warnings = args.calibration, args.sku, []
    if calibration is not None:
        calibration, warnings = calibration_and_warnings(calibration, sku, force=args.force_calibration)
        sku = sku or calibration.sku
    if args.check_drift and calibration is None:
        raise ConfigError("--check-drift compares the host with a calibration: pass --calibration")
    model, engine = step_model_for_engine(sku or "h100-sxm", args.model, calibration=calibration, engine=args.engine,
                                          form=args.form, cuda_graphs=args.cuda_graphs,
                                          async_scheduling=args.async_scheduling, dtype=args.dtype, threads=args.threads)
    batch = parse_batch_json(args.batch_json) if args.batch_json else \
        build_batch(args.phase, args.batch, args.context, args.new_tokens)
    pred = model.predict(batch)
    print_warnings(warnings)  # after the input is validated: a refusal is its one line alone
    drift = None
    if args.check_drift:  # after the batch is validated: bad input costs no second of timing
        from predictor.host_drift import measure_drift

        drift = measure_drift(model.calibration, model.dtype)  # one line, before any timing, if it cannot
        print(f"{'warning: ' if drift.drifted else ''}{drift.line()}", file=sys.stderr)
        if drift.drifted:
            print(f"warning: {drift.warning()}", file=sys.stderr)
    overlap = engine.async_scheduling
    threads = probe_threads(model.calibration, model.dtype, engine.engine) if model.hardware.backend == "cpu" else None
    if engine.engine == "vllm" and model.cpu_table is not None and model.cpu_table.linear_engine != "vllm":
        print("note: the calibration has no vLLM kernels (a --quick run leaves vllm_ops out): vLLM's layout is priced "
              "with torch's kernels and no vLLM engine cost", file=sys.stderr)
    total_s = model.predict_time(batch, async_scheduling=True) if overlap else pred.total_s
    if args.json:
        out = pred.to_dict()
        out["total_sync_s"], out["total_s"], out["async_scheduling"] = pred.total_s, total_s, overlap
        if drift is not None:
            out["host_drift"] = drift.to_dict()
        out["request"] = {"sku": model.hardware.sku_id, "model": model.model.name, "dtype": model.dtype,
                          "phase": None if args.batch_json else args.phase, "batch": [list(s) for s in batch],
                          "engine": engine.engine, "threads": threads, "cuda_graphs": model.cuda_graphs,
                          "async_scheduling": overlap}
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    hw = model.hardware
    launch_name = "dispatch" if hw.backend == "cpu" else ("graph nodes" if model.cuda_graphs else "launches")
    unit = "op dispatches" if hw.backend == "cpu" else "kernels"
    what = (f"batch of {pred.num_seqs} ({pred.num_new_tokens} new tokens)" if args.batch_json else
            f"{args.phase} batch {args.batch} context {args.context}"
            f"{'' if args.phase == 'decode' else f' new {pred.num_new_tokens}'}")
    form = f"{pred.form}, async" if overlap else pred.form
    runs_on = f"{engine.engine} engine" + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")
    print(f"{hw.sku_id} {model.model.name} {model.dtype} {what} ({runs_on}): {total_s * 1e3:.3f} ms [{form}]"
          f" = {pred.num_new_tokens / total_s:,.0f} tokens/s")
    print(f"  blocks {pred.blocks_s * 1e3:.3f} ms ({blocks_text(pred)}) | {launch_name} {pred.launch_s * 1e3:.3f} ms "
          f"over {pred.num_kernels} {unit} (adds {pred.launch_added_s * 1e3:.3f}) | host {pred.host_s * 1e3:.3f} ms"
          f"{' (overlapped)' if overlap else ''} | "
          f"sampling {pred.sample_s * 1e3:.3f} ms")
    t = pred.tiers
    print(f"  tiers: B {hw.mem_bw_tier}, eta_mem {t['eta_max']}, f_clk {t['f_clk']}, eta_active {t['eta_active']}, "
          f"eta_duty {t['eta_duty']}, launch {t['t_dispatch_s' if hw.backend == 'cpu' else 't_launch_s']}, host {t['s_floor_ms']}")
    if args.breakdown:
        _print_breakdown(pred, total_s, overlap)
    return 0


def blocks_text(pred) -> str:
    """What the blocks' time is made of, for the headline: its terms, and how they make it."""
    c, m = f"{pred.compute_s * 1e3:.3f}", f"{pred.memory_s * 1e3:.3f}"
    if pred.form == "max":
        return f"max of compute {c}, memory {m}: {pred.bound} bound"
    if pred.form == "cpu_ops":
        return f"the measured op tables, mostly {pred.bound}-bound ops; the roofline's compute {c}, memory {m} for reference"
    return f"sum over ops of max(t_c, t_m), mostly {pred.bound}-bound ops; sums: compute {c}, memory {m}"


BREAKDOWN_TITLE = {
    "additive": "additive form: t = max(t_c, t_m) per op",
    "max": "max form: the step takes max(sum t_c, sum t_m), so each op's t is its t_c when compute wins, else its t_m",
    "cpu_ops": "cpu_ops form: t = the measured op tables; t_c, t_m = the roofline, for reference",
}


def breakdown_rows(pred, total_s: float, overlap: bool) -> tuple[list[str], list[list[str]]]:
    """The per-op table's columns and rows, whose times add up to the headline ``total_s``. With
    ``overlap`` (asynchronous scheduling) the host residual runs beside the device and is not added:
    a ``device`` row sums the ops and launches, the host row says ``overlapped``, and the total row
    is max(device, host), the headline."""
    with_fixed = any(op.t_fixed_s > 0 for op in pred.ops.values())
    cols = ["op", "kind", "calls", "GEMM (M,N,K)", "GFLOP", "MB", "t_c ms", "t_m ms", *(["fixed ms"] if with_fixed else []),
            "t ms", "share", "bound"]
    rows = []
    for op in pred.ops.values():
        mnk = "" if op.gemm_mnk is None else "x".join(str(v) for v in op.gemm_mnk)
        rows.append([op.name, op.kind, str(op.num_calls), mnk, f"{op.flops / 1e9:.3f}", f"{op.bytes / 1e6:.2f}",
                     f"{op.t_c_s * 1e3:.4f}", f"{op.t_m_s * 1e3:.4f}", *([f"{op.t_fixed_s * 1e3:.4f}"] if with_fixed else []),
                     f"{op.t_s * 1e3:.4f}", f"{op.t_s / total_s:.1%}", op.bound])
    blank = [""] * (len(cols) - 4)
    rows.append(["launch (added)", *blank, f"{pred.launch_added_s * 1e3:.4f}", f"{pred.launch_added_s / total_s:.1%}", ""])
    if overlap:
        device_s = pred.total_s - pred.host_s  # the synchronous step less its host term
        rows.append(["device (ops + launches)", *blank, f"{device_s * 1e3:.4f}", f"{device_s / total_s:.1%}", ""])
    host_share = "overlapped" if overlap else f"{pred.host_s / total_s:.1%}"
    rows.append(["host residual", *blank, f"{pred.host_s * 1e3:.4f}", host_share, ""])
    flops = f"{sum(o.flops for o in pred.ops.values()) / 1e9:.3f}"
    nbytes = f"{sum(o.bytes for o in pred.ops.values()) / 1e6:.2f}"
    total_name = "total = max(device, host)" if overlap else "total"
    rows.append([total_name, "", "", "", flops, nbytes, *[""] * (len(cols) - 9), f"{total_s * 1e3:.4f}", "100%", ""])
    return cols, rows


# How each breakdown column gives way on a narrow terminal (common.termtable): the op is kept whole,
# the least telling columns are left out first.
BREAKDOWN_DROP = {"MB": 1, "GFLOP": 2, "GEMM (M,N,K)": 3, "calls": 4, "kind": 5, "bound": 6}


def _print_breakdown(pred, total_s: float, overlap: bool, width: int | None = None) -> None:
    from common import termtable

    cols, rows = breakdown_rows(pred, total_s, overlap)
    specs = [termtable.Col(c, "left" if c in ("op", "kind", "bound") else "right", keep=c == "op",
                           drop=BREAKDOWN_DROP.get(c, 0)) for c in cols]
    con = termtable.console(width)
    con.print(termtable.table(specs, rows, width=con.width,
                              title=f"per-op breakdown ({BREAKDOWN_TITLE.get(pred.form, pred.form)}; times in ms, "
                                    "summed over layers; the rows add up to the total)"))


def cmd_fit(args: argparse.Namespace) -> int:
    argv = ["gpubench", "fit", *sys.argv[2:]] if sys.argv[1:2] == ["fit"] else None
    if args.from_silicon is not None:
        cal = _fit_from_silicon(args, argv)
        sources = f"{args.from_silicon} ({args.framework or 'vllm'} tables)"
    elif not args.run_dir:
        raise ConfigError("fit needs a RUN_DIR, or --from-silicon SYSTEM")
    elif args.framework is not None:
        raise ConfigError("--framework names the tables of --from-silicon; a RUN_DIR has its own")
    else:
        from predictor.calibrate import fit_run

        cal = fit_run(args.run_dir, dtype=args.dtype, argv=argv, allow_contended=args.allow_contended)
        sources = " + ".join(args.run_dir)
    cal.save(args.output)  # first: a path that cannot be written is the one line, not after warnings
    for line in fit_warning_lines(cal.meta, verbose=args.verbose):
        print(f"warning: {line}", file=sys.stderr)
    for probe, lacking in cal.meta.get("fit", {}).get("quick_left_out", {}).items():
        print(f"note: a --quick run left out {probe} ({lacking}); a run without --quick measures it", file=sys.stderr)
    if args.json:
        json.dump(cal.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    from common import termtable

    cols = (termtable.Col("parameter", keep=True), termtable.Col("value", "right"),
            termtable.Col("error", "right", drop=1), termtable.Col("tier", drop=2), termtable.Col("source", wrap=True))
    rows = [[name, f"{p.value:.6g}", "" if p.error is None else f"{p.error:.3g}", p.tier, p.source]
            for block in (cal.params, cal.hardware, cal.host_residual) for name, p in block.items()]
    con = termtable.console()
    con.print(termtable.table(cols, rows, width=con.width,
                              title=f"calibration {cal.sku} {cal.dtype} <- {sources}"))
    print(f"wrote {args.output}")
    return 0


def _fit_from_silicon(args: argparse.Namespace, argv):
    from predictor import silicon_tables as st
    from predictor.silicon_fit import fit_from_silicon

    if args.run_dir:
        raise ConfigError("fit takes RUN_DIRs or --from-silicon, not both")
    if args.dtype not in (None, "bf16"):
        raise ConfigError(f"--from-silicon fits bf16 (the tables' dtype), not --dtype {args.dtype}")
    systems = st.systems()
    if args.from_silicon not in systems:
        raise ConfigError(f"--from-silicon: no measured tables for '{args.from_silicon}' (have: {', '.join(systems)})")
    return fit_from_silicon(st.table_set(args.from_silicon, args.framework or "vllm"), argv=argv)


def fit_warning_lines(meta: dict, *, verbose: bool = False) -> list[str]:
    """What `fit` says of a calibration's warnings: at most two short lines (a contended run; how
    many fitted values look off), or, ``verbose``, each in full. The calibration keeps them all
    (``meta.contended``, ``meta.fit.warnings``)."""
    contended = meta.get("contended")
    checks = list((meta.get("fit") or {}).get("warnings") or [])
    if verbose:
        head = [f"fitted from a run taken under contention ({contended}); the calibration is marked, and predict "
                "will say so"] if contended else []
        return head + checks
    out = []
    if contended:
        out.append("fitted a run taken under contention: the calibration is marked and predict will say so")
    if checks:
        what = "value looks" if len(checks) == 1 else "values look"
        out.append(f"{len(checks)} fitted {what} off{' (as on a busy host)' if contended else ''}: "
                   "--verbose lists them (also in meta.fit.warnings)")
    return out
