"""``gpubench slo predict`` and ``gpubench slo check``: the analytical SLO model (scheduling.slo.model)
on its own, and against the replays of a sweep."""
from __future__ import annotations

import argparse
import sys

from common.clihelp import DefaultsHelpFormatter
from common.errors import ConfigError
from scheduling.slo.spec import add_slo_option

# The rates `slo predict --max-rate` searches between (jobs/s).
MIN_RATE, MAX_RATE = 0.01, 100.0


def register(sub) -> None:
    p = sub.add_parser("slo", help="predict agent SLO attainment without replaying (and check it against replays)",
                       description="The analytical SLO model of agent jobs on one engine (docs/slo.md): from the "
                                   "predictor's step time, the engine's limits and the jobs' arrival rate, TTFT/TPOT "
                                   "percentiles, attainment of an SLO per kind, per turn and per job, goodputs, and "
                                   "the largest rate at which a target attainment holds; no step is simulated.",
                       formatter_class=DefaultsHelpFormatter)
    s = p.add_subparsers(dest="slo_command", metavar="SUBCOMMAND", required=True)
    pr = s.add_parser("predict", help="attainment at one rate, or the largest rate at a target attainment",
                      formatter_class=DefaultsHelpFormatter,
                      description="Predict what `gpubench replay` of the same jobs would measure under fcfs.")
    _workload_options(pr)
    pr.add_argument("--jps", type=float, default=None, help="Poisson job arrivals per second (required without --max-rate)")
    pr.add_argument("--max-rate", action="store_true",
                    help=f"find the largest jobs/s (searched in {MIN_RATE:g}-{MAX_RATE:g}) at which the attainment of "
                         "the turns (or jobs, --of) reaches --target")
    pr.add_argument("--target", type=float, default=None, help="--max-rate: attainment to hold, in (0, 1) (default 0.9)")
    pr.add_argument("--of", choices=("turn", "job"), default=None, help="--max-rate: whose attainment (default turn)")
    pr.add_argument("--json", action="store_true", help="print one JSON object")
    pr.set_defaults(func=cmd_predict)
    ch = s.add_parser("check", help="the model against a sweep's replays, or against replay directories (live vLLM too)",
                      formatter_class=DefaultsHelpFormatter,
                      description="--sweep: for every cell of one policy in a `gpubench sweep` directory (sweep.csv "
                                  "and spec.json), predict the replay with the model and put it beside what the replay "
                                  "measured: turn attainment of the sweep's SLO, TTFT p50/p90, TPOT p50, mean JCT. "
                                  "--replays: the same for `gpubench replay` directories, the simulator's or live "
                                  "vLLM's; directories whose commands differ only in --out are takes of one setting, "
                                  "and the model stands beside their mean and range. Writes check.csv, check.md, "
                                  "attainment_vs_jps.png (and curve.csv: the model over rates) and COMMAND into --out.")
    what = ch.add_mutually_exclusive_group(required=True)
    what.add_argument("--sweep", help="a sweep output directory")
    what.add_argument("--replays", nargs="+", metavar="DIR", help="replay output directories (fcfs)")
    ch.add_argument("--policy", default="fcfs", help="--sweep: the sweep's policy to check (the model prices fcfs)")
    ch.add_argument("--sku", default=None, help="--replays: the SKU whose predictor prices the steps (a live "
                                                "replay records none: cpu for this host's engine)")
    ch.add_argument("--calibration", default=None, help="--replays: calibration.json for the predictor")
    ch.add_argument("--step-cost", choices=("predictor", "take"), default="predictor",
                    help="--replays: the step times the model runs on: the predictor's, or (a diagnostic, never a "
                         "prediction) those each setting's first take recorded, which separates the model's error "
                         "from the predictor's")
    add_slo_option(ch, default_text="the SLO the first replay recorded; a sweep's own columns with --sweep")
    ch.add_argument("--out", required=True, help="output directory")
    ch.add_argument("--json", action="store_true",
                    help="print one JSON object (out_dir, files, cells, the attainment errors) instead of check.md")
    ch.set_defaults(func=cmd_check)


def _workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sku", default="h100-sxm", help="GPU SKU")
    p.add_argument("--model", default="llama-3.1-8b", help="model name or config.json")
    p.add_argument("--jobs", type=int, default=400, dest="num_jobs", help="synthetic SWE-agent jobs (or the first N of --trace)")
    p.add_argument("--trace", default=None, help="jobs file instead of synthetic jobs")
    p.add_argument("--seed", type=int, default=0, help="seed of the jobs and arrivals")
    p.add_argument("--calibration", default=None, help="calibration.json for the predictor")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override the KV pool size")
    add_slo_option(p)


def _jobs(args, jps: float):
    from scheduling.workload.traces import with_poisson_arrivals

    if args.trace:
        from scheduling.workload.trace_files import load_trace

        base = load_trace(args.trace, seed=args.seed)[: args.num_jobs]
    else:
        from scheduling.workload.trace_synth import synthetic_jobs

        base = synthetic_jobs(args.num_jobs, args.seed)
    return with_poisson_arrivals(base, jps, args.seed)


def cmd_predict(args: argparse.Namespace) -> int:
    import json

    from scheduling.slo import parse_slo
    from scheduling.slo.model import engine_limits_and_cost, max_rate, predict

    slo = parse_slo(args.slo)
    if args.num_jobs < 1:
        raise ConfigError("--jobs must be >= 1")
    target: float = 0.9 if args.target is None else float(args.target)
    of: str = args.of or "turn"
    if args.max_rate:
        if args.jps is not None:
            raise ConfigError("--jps goes without --max-rate (the search picks the rates)")
        if not 0 < target < 1:
            raise ConfigError(f"--target must be in (0, 1), got {target}")
    else:
        if args.jps is None or args.jps <= 0:
            raise ConfigError("--jps (> 0) is required without --max-rate")
        if args.target is not None or args.of is not None:
            raise ConfigError("--target and --of go with --max-rate")
    lim, cost = engine_limits_and_cost(args.sku, args.model, args.calibration, args.num_gpu_blocks)
    if args.max_rate:
        rate, pred = max_rate(lambda jps: _jobs(args, jps), lim, cost, slo, target=target, of=of,
                              lo=MIN_RATE, hi=MAX_RATE, progress=lambda line: print(line, file=sys.stderr))
        doc = {"max_jps": rate, "target": target, "of": of, "at_max": pred.attainment if pred else None,
               "at_search_limit": rate is not None and rate >= MAX_RATE}
    else:
        jps: float = args.jps or 0.0  # > 0: checked above
        pred = predict(_jobs(args, jps), lim, cost, slo)
        doc = {"jps": jps, "attainment": pred.attainment, "percentiles": pred.percentiles}
    doc.update(sku=args.sku, model=args.model, jobs=args.num_jobs, seed=args.seed, slo=slo.to_dict())
    if args.json:
        print(json.dumps(doc, indent=2, default=float))
        return 0
    print(_predict_text(doc, slo))
    return 0


def _predict_text(doc: dict, slo) -> str:
    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    head = f"{doc['sku']} · {doc['model']} · {doc['jobs']} jobs (seed {doc['seed']}) · SLO {slo.describe()}"
    if "max_jps" in doc:
        r = doc["max_jps"]
        if r is None:
            return f"{head}\nno rate reaches {doc['target']:.0%} {doc['of']} attainment (the lowest tried misses it)"
        a = doc["at_max"]
        if doc.get("at_search_limit"):
            return (f"{head}\n{doc['target']:.0%} of {doc['of']}s meet the SLO even at {r:.3g} jobs/s, the search's "
                    f"upper bound: the largest rate is at least that (turns {pct(a['turn'])}, jobs {pct(a['job'])})")
        return (f"{head}\nlargest rate with {doc['target']:.0%} of {doc['of']}s meeting the SLO: {r:.3g} jobs/s "
                f"(turns {pct(a['turn'])}, jobs {pct(a['job'])}, job goodput {a['job_goodput_per_s']:.3g}/s, "
                f"token goodput {a['token_goodput_per_s']:.0f} tok/s)")
    a, p = doc["attainment"], doc["percentiles"]
    return (f"{head} · {doc['jps']:g} jobs/s (predicted, not replayed)\n"
            f"  turns meeting the SLO {pct(a['turn'])}, jobs {pct(a['job'])}; ttft {pct(a['ttft'])}, tpot {pct(a['tpot'])}, "
            f"tool turn {pct(a['tool_turn'])}, job deadline {pct(a['job_deadline'])}\n"
            f"  goodput {a['job_goodput_per_s']:.3g} jobs/s, {a['token_goodput_per_s']:.0f} tok/s; TTFT p50/p90 "
            f"{p['ttft_p50_s']:.3g}/{p['ttft_p90_s']:.3g} s, TPOT p50/p90 {p['tpot_p50_s']:.3g}/{p['tpot_p90_s']:.3g} s, "
            f"mean JCT {p['jct_mean_s']:.0f} s")


def cmd_check(args: argparse.Namespace) -> int:
    from pathlib import Path

    out = Path(args.out)
    if args.replays:
        return _check_replays(args, out)
    if args.sku or args.calibration or args.slo or args.step_cost != "predictor":
        raise ConfigError("--sku, --calibration, --slo and --step-cost go with --replays (a sweep's cells carry their own)")
    from scheduling.slo.check import run_check

    df = run_check(args.sweep, args.policy, args.out, argv=sys.argv[1:],
                   progress=lambda line: print(line, file=sys.stderr))
    err = df["attainment_error_pp"].abs()
    return _print_check(args, out, df, err, ("check.csv", "check.md", "attainment_vs_jps.png", "COMMAND"),
                        cells=int(len(df)), share_within_3pp=float((err <= 3).mean()))


def _print_check(args: argparse.Namespace, out, df, err, files: tuple, **counts) -> int:
    """check.md, or with --json one object: the files, the counts, the errors and every row."""
    import json

    if not args.json:
        print((out / "check.md").read_text())
        return 0
    print(json.dumps({"out_dir": str(out), "files": [str(out / n) for n in files], **counts,
                      "mae_pp": float(err.mean()), "max_error_pp": float(err.max()), "rows": df.to_dict("records")},
                     indent=2, default=float))
    return 0


def _check_replays(args: argparse.Namespace, out) -> int:

    from scheduling.slo.check_replays import run_check_replays

    df, _ = run_check_replays(args.replays, args.out, sku=args.sku, calibration=args.calibration, slo_text=args.slo,
                              step_cost=args.step_cost, argv=sys.argv[1:],
                              progress=lambda line: print(line, file=sys.stderr))
    err = df["turn_error_pp"].abs()
    return _print_check(args, out, df, err, ("check.csv", "curve.csv", "check.md", "attainment_vs_jps.png", "COMMAND"),
                        settings=int(len(df)), within_5pp=int((err <= 5).sum()))
