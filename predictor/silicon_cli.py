"""``gpubench silicon``: score the step model's kernel prices against GPU kernels measured on real silicon
(the aiconfigurator-core wheel's tables, an optional extra)."""
from __future__ import annotations

import sys
from pathlib import Path

from common.clihelp import DefaultsHelpFormatter
from common.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser(
        "silicon", help="score the GPU step model's kernel prices against kernels measured on 9 real GPUs",
        description="Read the kernel latencies NVIDIA's aiconfigurator collectors measured on real GPUs (the "
                    "aiconfigurator-core wheel: pip install 'gpubench[reference]'; nothing is copied into this "
                    "repository) and score what the step model charges for each kernel: every projection GEMM of "
                    "the shipped model configs at every measured M (exact, or interpolated along N/K, with the "
                    "interpolation's own leave-one-out error), decode attention by batch x context and prefill "
                    "attention by tokens, for the default pricing (published, else spec) and for each "
                    "--calibration (retargeted to each GPU with --force-calibration: nothing of the target is "
                    "measured then); only a --calibration from `fit --from-silicon`, --fit-from and --learned-from were fitted on "
                    "tables. Writes silicon.csv.gz, summary.csv, "
                    "interpolation.csv, steps.csv (decode steps composed from the measured kernels, against the "
                    "model and against aiconfigurator's own step estimate), silicon.md, one <system>.png per GPU and COMMAND into --out.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--systems", default="all",
                   help="comma-separated aiconfigurator systems (see --list), or 'all' with a gpubench SKU")
    p.add_argument("--framework", default="vllm", choices=("vllm", "sglang", "trtllm"),
                   help="whose tables: the kernels that framework runs (vLLM 0.24 on most GPUs, 0.14 on A100)")
    p.add_argument("--calibration", action="append", type=Path, default=[],
                   help="a calibration.json from `gpubench fit` to score beside the default pricing (repeatable)")
    p.add_argument("--force-calibration", action="store_true",
                   help="retarget a calibration to the GPUs it was not taken on (transfer)")
    p.add_argument("--fit-from", default=None, choices=("vllm", "sglang", "trtllm"),
                   help="also score, on each GPU, a calibration fitted from that GPU's own tables of this framework "
                        "(`gpubench fit --from-silicon`): held out when it is not --framework, in-sample when it is")
    p.add_argument("--learned-from", default=None, metavar="SYSTEM",
                   help="also score a learned baseline: random forests trained on SYSTEM's tables of --framework and "
                        "spec-scaled to each GPU (the transfer a learned model makes; needs scikit-learn)")
    p.add_argument("--out", type=Path, default=None, help="output directory (required unless --list)")
    p.add_argument("--list", action="store_true", help="list the systems, their SKUs and table versions, and exit")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (out_dir, files, MAPE / median / p90 / signed per system, predictor "
                        "and kind) instead of the Markdown")
    p.set_defaults(func=_silicon)


def _systems(arg: str) -> list[str]:
    from predictor import silicon_tables as st

    have = st.systems()
    if arg == "all":
        return [s for s in have if s in st.SYSTEM_SKUS]
    names = [s.strip() for s in arg.split(",") if s.strip()]
    for s in names:
        if s not in have:
            raise ConfigError(f"--systems: no measured tables for '{s}' (have: {', '.join(have)})")
        if s not in st.SYSTEM_SKUS:
            raise ConfigError(f"--systems: '{s}' has tables but no gpubench SKU to price it with "
                              f"(priced: {', '.join(st.SYSTEM_SKUS)})")
    return names


def _list(framework: str, *, as_json: bool = False) -> int:
    from predictor import silicon_tables as st

    rows: list[dict] = []
    for s in st.systems():
        ts = st.table_set(s, framework)
        rows.append({"system": s, "sku": st.SYSTEM_SKUS.get(s), "framework": framework, "version": ts.version,
                     "tables": [k for k in ("gemm", "decode", "prefill") if getattr(ts, k) is not None]})
    if as_json:
        import json

        print(json.dumps({"wheel": st.wheel_version(), "data_root": str(st.data_root()), "systems": rows}, indent=2))
        return 0
    print(f"aiconfigurator-core {st.wheel_version()} at {st.data_root()}")
    for r in rows:
        print(f"  {r['system']:<22} sku={r['sku'] or '-':<9} {framework} {r['version']:<12} {' '.join(r['tables']) or '-'}")
    return 0


def _predictors(args, systems: list[str]) -> list:
    """The default pricing, each --calibration (loaded once, checked and retargeted to each GPU's SKU,
    each warning said once) and, with --fit-from, each GPU's own fit."""
    from predictor import silicon_tables as st
    from predictor.calibration_model import Calibration, retarget
    from predictor.host_match import check_calibration_host
    from predictor.silicon_score import Predictor

    skus = [st.SYSTEM_SKUS[s] for s in systems]
    preds = [Predictor("default")]
    for path in args.calibration:
        cal = Calibration.load(path)
        if cal.backend == "cpu":
            raise ConfigError(f"--calibration {path}: a CPU calibration cannot price GPU kernels")
        warnings = [w for sku in skus for w in check_calibration_host(cal, sku, force=args.force_calibration)]
        for line in dict.fromkeys(warnings):
            print(f"warning: {line}", file=sys.stderr)
        source = "silicon fit" if str(cal.meta.get("from", "")).startswith("silicon") else "probes"
        preds.append(Predictor(f"{cal.sku} {source}",
                               calibration={sku: cal if cal.sku == sku else retarget(cal, sku) for sku in skus}))
    if args.fit_from:
        from predictor.silicon_fit import fit_from_silicon

        own = {st.SYSTEM_SKUS[s]: fit_from_silicon(st.table_set(s, args.fit_from)) for s in systems}
        held = "in-sample" if args.fit_from == args.framework else "held out"
        preds.append(Predictor(f"own {args.fit_from} fit ({held})", calibration=own))
    return preds


def _silicon(args) -> int:
    from predictor import silicon_tables as st

    if args.list:
        return _list(args.framework, as_json=args.json)
    if args.out is None:
        raise ConfigError("--out is required (an output directory; --list only lists)")
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out}: exists and is not a directory")
    systems = _systems(args.systems)
    table_sets = [st.table_set(s, args.framework) for s in systems]
    for ts in table_sets:
        if ts.gemm is None and ts.decode is None:
            raise ConfigError(f"{ts.system} has no {args.framework} GEMM or attention tables (see --list)")
    preds = _predictors(args, systems)
    from predictor import silicon_report
    from predictor.silicon_score import score_tables

    learned = _learned(args.learned_from, args.framework)
    score = score_tables(table_sets, preds, progress=lambda line: print(line, file=sys.stderr))
    if learned is not None:
        from predictor.silicon_learned import add_learned

        add_learned(score, learned)
    from predictor.silicon_aic import add_aiconfigurator

    add_aiconfigurator(score)
    command = silicon_report.command_line(systems=systems, framework=args.framework,
                                          calibrations=[str(c) for c in args.calibration], force=args.force_calibration,
                                          fit_from=args.fit_from, learned_from=args.learned_from, out=str(args.out))
    text, summary, files = silicon_report.write(score, str(args.out), command, wheel=st.wheel_version())
    if not args.json:
        print(text)
        return 0
    import json

    pooled = summary[summary["regime"] == "all"]
    doc = {"out_dir": str(args.out), "files": [str(f) for f in files], "num_rows": int(len(score.rows)),
           "scores": [{k: (float(v) if k.endswith("pct") else (int(v) if k == "n" else v)) for k, v in r.items()}
                      for r in pooled.drop(columns=["regime"]).to_dict("records")],
           "composed_steps": _steps_json(score.steps)}
    print(json.dumps(doc, indent=2, allow_nan=False))
    return 0


def _steps_json(steps) -> list[dict]:
    """Per (system, predictor): composed decode steps scored, MAPE, p90 and mean signed error."""
    if not len(steps):
        return []
    g = steps.groupby(["system", "step", "predictor"], sort=False)
    return [{"system": system, "step": step, "predictor": pred, "n": int(len(s)), "mape_pct": float(s["ape_pct"].mean()),
             "p90_ape_pct": float(s["ape_pct"].quantile(0.9)), "signed_pct": float(s["signed_pct"].mean())}
            for (system, step, pred), s in g]


def _learned(system: str | None, framework: str):
    """The learned baseline of ``system`` (validated before any scoring), or None."""
    if system is None:
        return None
    import importlib.util

    from predictor import silicon_tables as st

    if system not in st.systems():
        raise ConfigError(f"--learned-from: no measured tables for '{system}' (have: {', '.join(st.systems())})")
    if system not in st.SYSTEM_SKUS:
        raise ConfigError(f"--learned-from: '{system}' has no gpubench SKU whose spec could scale its forest")
    if importlib.util.find_spec("sklearn") is None:
        raise ConfigError("--learned-from needs scikit-learn: pip install 'gpubench[baselines]'")
    from predictor.silicon_learned import LearnedBaseline

    return LearnedBaseline(st.table_set(system, framework))
