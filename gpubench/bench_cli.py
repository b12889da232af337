"""Sub-commands of the bench stage: skus, run, show, compare: their parsers and what each does (what
run, show and compare print is ``bench_output``'s)."""
from __future__ import annotations

import argparse
import sys

from common.clihelp import DeprecatedAlias


def device_probe_names() -> dict[str, list[str]]:
    """``{"cpu": [...], "cuda": [...]}``: the probes a full run takes on each backend, in run order,
    read from the backends' own registries so that help text cannot list a stale set."""
    from gpubench.backends.cpu.probes import cpu_probes
    from gpubench.backends.cuda import CudaBackend

    # CudaBackend.probes only wraps each probe around the backend it is given; no device is opened
    # for the names, so a bare instance (no __init__, which would look for a GPU) is enough.
    cuda_names = list(CudaBackend.probes(object.__new__(CudaBackend)))
    return {"cpu": list(cpu_probes()), "cuda": cuda_names}


class _ProbesOption(argparse._StoreAction):  # argparse has no public hook for a lazily built help
    """``--probes``, whose help lists the registered probes when it is printed, not when the parser
    is built: the CPU registry imports numpy, which every other command and --help can do without."""

    @property
    def help(self):
        names = device_probe_names()
        return (f"comma-separated probes (default: all the device's): on the CPU {','.join(names['cpu'])}; "
                f"on a GPU {','.join(names['cuda'])}")

    @help.setter
    def help(self, _value):  # argparse's constructor assigns help; the property above answers it
        pass


def register(sub) -> None:
    p = sub.add_parser("skus", help="list the SKU table (spec peaks, bandwidth, sources)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--sources", action="store_true", help="also print the source of every figure")
    p.set_defaults(func=cmd_skus)

    r = sub.add_parser(
        "run", help="characterize the device: run its probes (bandwidth, caches, launch, peak, GEMM, ...) into a run directory",
        description="Run the probes, each in its own worker process, into results/<sku>/<UTC>-<host>/ "
                    "(manifest.json + one <probe>.jsonl per probe, appended row by row). A probe that "
                    "crashes or overruns its time budget is recorded as failed; the others still run.")
    r.add_argument("--sku", help="SKU id for the spec peaks (default: the detected device; `cpu` on the CPU)")
    r.add_argument("--device", default="auto", help="auto (a working GPU, else the CPU), cpu, or cuda:N (default: auto)")
    r.add_argument("--probes", action=_ProbesOption)
    # Durations measured: a quick CPU run on the 2-core AMD VM took 41.6 s at load 0.00 (2026-12-06 01:57 UTC: torch_ops
    # 29.6 s, the rest 10 s); vllm_ops, ~90 s alone, is left out of it. docs/cuda.md gives the GPU figure.
    r.add_argument("--quick", action="store_true",
                   help="a sanity run of under a minute: coarser sweeps, and vllm_ops (vLLM's own kernels, ~90 s on a "
                        "2-core CPU) left out unless --probes names it; a couple of minutes on an H100-class GPU")
    r.add_argument("--out", default="gpubench-results",
                   help="results root: the run goes to OUT/<sku>/<UTC>-<host>/ (default: ./gpubench-results, so a "
                        "run from a checkout never lands among its committed results/)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run; keys already measured are skipped")
    r.add_argument("--force", action="store_true",
                   help="accept a GPU --sku that the GPU's name contradicts (never a SKU of another backend: a "
                        "GPU SKU on the CPU is refused; `gpubench predict --sku ID` prices a GPU you do not have)")
    # --repeats as in the kvcomm commands; the short spelling stays a hidden alias.
    r.add_argument("--repeats", type=int, default=10, dest="reps", metavar="N",
                   help="repetitions per measurement (default 10; first discarded)")
    r.add_argument("--reps", action=DeprecatedAlias, canonical="--repeats", type=int, dest="reps")
    r.add_argument("--set", action="append", default=[], metavar="PROBE.NAME=VALUE",
                   help="probe option, e.g. stream.max_array_bytes=1048576, l2.factor=2 (repeatable)")
    r.add_argument("--probe-budget-s", type=float, help="time budget of every probe in seconds (default: per probe)")
    r.add_argument("--json", action="store_true",
                   help="at the end print one JSON object on stdout (run_dir, ok, device, each probe's status and "
                        "row counts, and `show --json`'s summary) instead of the table; progress stays on stderr")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("show", help="headline figures of a run: %% of spec/peak, spread, telemetry, failures")
    s.add_argument("run_dir", metavar="RUN_DIR")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--plots", action="store_true",
                   help="also write PNG plots (bandwidth vs working set, GEMM TFLOP/s vs M, launch cost, torch "
                        "linear GB/s vs M) next to the run, or into --out")
    s.add_argument("--out", metavar="DIR", default=None, help="where --plots writes (default: the run directory)")
    s.set_defaults(func=cmd_show)

    c = sub.add_parser(
        "compare", help="figures of N runs matched by what was measured, against the first run (the baseline)",
        description="Match every figure of the first run (the baseline) in the others by what was measured "
                    "(probe, kernel, dtype, size relative to the cache: 'STREAM triad fp64 at 4x LLC', GEMM shape, "
                    "launch kind), and print each run's value, its speed ratio to the baseline and whether the "
                    "change is beyond the rows' spread. Each run's device (CPU model or GPU, cores, caches) is "
                    "printed; a warning on stderr says when they differ.")
    c.add_argument("runs", nargs="+", metavar="RUN_DIR", help="two or more run directories; the first is the baseline")
    c.add_argument("--all", action="store_true", help="list every matched figure, not only flagged ones")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    c.add_argument("--csv", metavar="FILE", default=None,
                   help="also write one CSV row per figure and run (written atomically; `-` for stdout)")
    c.add_argument("--fail-above", type=float, default=None, metavar="PCT",
                   help="exit 1 when any matched figure of a later run is more than PCT %% worse than the baseline's "
                        "(a regression gate, as pytest-benchmark's --benchmark-compare-fail)")
    c.set_defaults(func=cmd_compare)


def _parse_sets(items) -> dict:
    from common.errors import ConfigError

    out = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set expects PROBE.NAME=VALUE, got '{item}'")
        k, v = (x.strip() for x in item.split("=", 1))
        _check_set(k, v, item)
        out[k] = v
    return out


def _check_set(key: str, value: str, item: str) -> None:
    import math

    from common.errors import ConfigError, suggest
    from gpubench.backends.probe_common import SET_OPTIONS, TEXT_SET_OPTIONS

    known = [f"{p}.{n}" for p, names in SET_OPTIONS.items() for n in names]
    if key not in known:
        raise ConfigError(f"--set {item}: unknown option '{key}'{suggest(key, known)} (known: {', '.join(known)})")
    if key in TEXT_SET_OPTIONS:
        return
    try:
        num = float(value)
    except ValueError:
        num = float("nan")
    if not (math.isfinite(num) and num > 0):
        raise ConfigError(f"--set {item}: '{key}' takes a finite number > 0, got {value!r}")


def cmd_run(args) -> int:
    from common import termtable
    from common.errors import ConfigError
    from gpubench import report
    from gpubench.bench_output import finite_or_none, print_summary
    from gpubench.results import load
    from gpubench.run_progress import progress_for_stderr
    from gpubench.runner import RunRequest, execute

    if args.reps < 2:
        raise ConfigError(f"--repeats must be >= 2 (the first repetition is discarded), got {args.reps}")
    if args.probe_budget_s is not None and not (0 < args.probe_budget_s < float("inf")):
        # NaN used to disable the deadline (a hung probe then ran forever) and 0 was ignored
        raise ConfigError(f"--probe-budget-s must be a finite number of seconds > 0, got {args.probe_budget_s}")
    probes = tuple(p.strip() for p in args.probes.split(",") if p.strip()) if args.probes else None
    req = RunRequest(device=args.device, sku=args.sku, probes=probes, quick=args.quick, out=args.out,
                     resume=args.resume, force=args.force, options=_parse_sets(args.set), num_reps=args.reps,
                     probe_budget_s=args.probe_budget_s, argv=tuple(["gpubench", *sys.argv[1:]]))
    progress = progress_for_stderr()  # bars on a terminal, one-line records in a log
    with progress:
        outcome = execute(req, on_event=progress.on_event, on_start=progress.on_start)
    summary = report.summarize_run(load(outcome.run_dir))
    if getattr(args, "json", False):
        import json
        from dataclasses import asdict

        doc = {"run_dir": str(outcome.run_dir), "ok": outcome.ok, "device": outcome.device_line,
               "probes": [asdict(p) for p in outcome.probes], "summary": summary.to_dict()}
        # Strict JSON for other programs: an undefined figure (NaN spread of one repetition) is null.
        print(json.dumps(finite_or_none(doc), indent=2, default=float, allow_nan=False))
    else:
        print_summary(summary, termtable.console())
        print(f"run dir: {outcome.run_dir}")
    return 0 if outcome.ok else 1


def cmd_show(args) -> int:
    import json

    from common import termtable
    from common.errors import ConfigError
    from gpubench import report
    from gpubench.bench_output import print_summary
    from gpubench.results import load

    if args.out is not None and not args.plots:
        raise ConfigError("--out is where --plots writes: give --plots too")
    run = load(args.run_dir)
    s = report.summarize_run(run)
    plots = []
    if args.plots:
        from gpubench.plots import write_plots

        plots = write_plots(run, args.out)
    if args.json:
        d = s.to_dict()
        if args.plots:
            d["plots"] = [str(p) for p in plots]
        print(json.dumps(d, indent=2, default=float))
        return 0
    print_summary(s, termtable.console())
    for p in plots:
        print(f"wrote {p}")
    return 0


def cmd_compare(args) -> int:
    import json

    from common.errors import ConfigError
    from gpubench import compare
    from gpubench.bench_output import finite_or_none, print_compare, write_compare_csv
    from gpubench.results import load

    if len(args.runs) < 2:
        raise ConfigError(f"compare needs at least two run directories (the first is the baseline), got {len(args.runs)}")
    if args.fail_above is not None and not (0 <= args.fail_above < float("inf")):
        raise ConfigError(f"--fail-above must be a finite percentage >= 0, got {args.fail_above}")
    out = compare.compare_runs([load(r) for r in args.runs])
    regressions = []
    if args.fail_above is not None:
        for f in out["figures"]:
            for run, pct, tainted in zip(out["runs"][1:], f["regression_pct"][1:], f["contended"][1:]):
                if pct is not None and pct > args.fail_above:
                    regressions.append({"id": f["id"], "label": f["label"], "run_dir": run["run_dir"],
                                        "regression_pct": pct, "contended": tainted})
    out["fail_above_pct"] = args.fail_above
    out["regressions"] = regressions
    status = 1 if regressions else 0
    if not out["same_device"]:
        by_text: dict = {}
        for i, r in enumerate(out["runs"]):
            by_text.setdefault(r["device"]["text"], []).append(str(i))
        names = "; ".join(f"{t} (run {', '.join(ix)})" for t, ix in by_text.items())
        print(f"warning: the runs are on {len(by_text)} different devices: {names}; the ratios compare machines, "
              "not a change (run 0 is the baseline)", file=sys.stderr)
    if args.csv:
        write_compare_csv(out, args.csv)
    if args.json:
        print(json.dumps(finite_or_none(out), indent=2, allow_nan=False))
        return status
    if args.csv == "-":
        return status
    print_compare(out, args)
    return status


def cmd_skus(args) -> int:
    import json

    from common import termtable
    from gpubench import skus
    from gpubench.bench_output import skus_table

    entries = [skus.get(i) for i in skus.all_ids()]
    if args.json:
        out = []
        for s in entries:
            d = {k: getattr(s, k) for k in ("id", "name", "arch", "backend", "sm_count", "spec_clock_mhz",
                                            "max_boost_mhz", "memory_gb", "memory_bw_gbs", "l2_mb", "tdp_w",
                                            "host_link_gbs", "nvlink_gbs", "nic_gbs", "s_floor_ms", "clock_droop")}
            d["peak_tflops"] = {dt: s.peak_flops(dt) / 1e12 for dt in s.fma_per_tc_per_clk}
            d["aliases"] = list(s.aliases)
            d["source"] = s.source
            out.append(d)
        print(json.dumps(out, indent=2))
        return 0
    con = termtable.console()
    con.print(skus_table(entries, con.width))
    if args.sources:
        for s in entries:
            print(f"{s.id}:")
            for k, v in s.source.items():
                print(f"  {k}: {v}")
    return 0

