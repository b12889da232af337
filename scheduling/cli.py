"""``gpubench replay``: replay an agent trace through the engine under one KV policy.

Also registers ``gpubench sweep`` from :mod:`scheduling.sweep_cli` when that module exists.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable

from common import argtypes
from common.clihelp import DefaultsHelpFormatter, DeprecatedAlias, add_deprecated_flag
from common.errors import ConfigError
from scheduling.cluster.options import add_cluster_options, cluster_fields
from scheduling.policies import POLICY_NAMES
from scheduling.replay_table import print_summary
from scheduling.slo.spec import add_slo_option

# CLI option -> (policy, parameter name). Defaults live in the policies' parameter dataclasses.
POLICY_OPTIONS = {
    "ttl_rule": ("continuum", "ttl_rule"),
    "ttl_s": ("continuum", "ttl_s"),
    "tool_mean_threshold_s": ("continuum", "tool_mean_threshold_s"),
    "eta": ("continuum", "eta"),
    "prior_mean_s": ("continuum", "prior_mean_s"),
    "cpu_gib": ("cpu-offload", "cpu_gib"),
    "offload_link_gbs": ("cpu-offload", "link_gbs"),
    "offload_store": ("cpu-offload", "store"),
    "offload_transfer_latency_ms": ("cpu-offload", "transfer_latency_s"),
    "lmcache_chunk_tokens": ("lmcache", "chunk_tokens"),
    "lmcache_cpu_gib": ("lmcache", "cpu_gib"),
    "lmcache_store_chunk_ms": ("lmcache", "store_chunk_s"),
    "lmcache_retrieve_chunk_ms": ("lmcache", "retrieve_chunk_s"),
}


def add_policy_options(p: argparse.ArgumentParser) -> None:
    """Policy parameters (each applies to one policy; unset means the policy's default)."""
    g = p.add_argument_group("continuum options (also continuum-offload)")
    g.add_argument("--ttl-rule", choices=("fixed", "tool-mean", "expected-benefit"), default=None,
                   help="how long to pin a job's KV across a tool call (default: expected-benefit)")
    g.add_argument("--ttl-s", type=float, default=None, help="TTL of the fixed and tool-mean rules (default 2.0)")
    g.add_argument("--tool-mean-threshold-s", type=float, default=None,
                   help="tool-mean: pin only tools whose mean duration is at most this (default 2.0)")
    g.add_argument("--eta", type=float, default=None, help="expected-benefit: weight of queueing delay (default 1.0)")
    g.add_argument("--prior-mean-s", type=float, default=None,
                   help="exponential prior of tool time with few samples (default 1.0)")
    g = p.add_argument_group("cpu-offload options (also continuum-offload)")
    g.add_argument("--cpu-gib", type=float, default=None, help="host DRAM pool in GiB (default 8, vLLM's)")
    g.add_argument("--offload-link-gbs", type=float, default=None, help="host link GB/s per direction (default: the SKU's)")
    g.add_argument("--offload-store", choices=("eager", "lazy"), default=None,
                   help="eager: copy a turn's blocks to the host while it runs; lazy: at its finish (default eager)")
    g.add_argument("--offload-transfer-latency-ms", type=float, default=None,
                   help="fixed cost of one load or store transfer (default 0.05)")
    g = p.add_argument_group("lmcache options")
    g.add_argument("--lmcache-chunk-tokens", type=int, default=None, help="chunk size in tokens (default 256)")
    g.add_argument("--lmcache-cpu-gib", type=float, default=None,
                   help="CPU tier in GiB (default 5, LMCache max_local_cpu_size, which counts 1024^3 bytes)")
    g.add_argument("--lmcache-store-chunk-ms", type=float, default=None, help="per-chunk store cost (default 0.5)")
    g.add_argument("--lmcache-retrieve-chunk-ms", type=float, default=None,
                   help="per-chunk retrieve cost (default 0.2)")


def policy_params_from_args(args: argparse.Namespace, policy: str) -> dict:
    """The parameters set on the command line for ``policy``; an option of another policy is an error."""
    params = {}
    for opt, (owner, name) in POLICY_OPTIONS.items():
        value = getattr(args, opt, None)
        if value is None:
            continue
        if owner != policy and not (policy == "continuum-offload" and owner in ("continuum", "cpu-offload")):
            raise ConfigError(f"--{opt.replace('_', '-')} applies to policy '{owner}', not '{policy}'")
        params[name] = value / 1e3 if opt.endswith("_ms") else value
    return params


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--sku", default="h100-sxm", help="GPU SKU (default h100-sxm; see gpubench skus)")
    g.add_argument("--model", default=None,
                   help="model name or config.json path (default llama-3.1-8b; smollm2-135m with --engine vllm)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's share of GPU memory (0.9)")
    g.add_argument("--activation-reserve-gib", type=float, default=2.0,
                   help="memory kept for activations and CUDA graphs (default 2 GiB)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step (default: what `vllm serve` picks for the SKU: 16384 on >= 160 GiB, "
                        "8192 on H100/H200, 2048 on A100/L40S; 4096 with --engine vllm, its CPU default)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="most running requests (default: vllm serve's for the SKU: 1024 on H100/H200/B200, 256 otherwise)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default 16, vLLM's GPU default; 128 with --engine vllm, its CPU default)")
    g.add_argument("--num-gpu-blocks", type=int, default=None, help="override the computed KV pool size")
    g.add_argument("--step-cost", default="predictor",
                   help="'predictor' (predictor.StepModel, default), 'constant:SECONDS', or 'measured:DIR': the step times "
                        "a replay recorded in DIR/steps.csv (e.g. a live vLLM run; a diagnostic, not a prediction)")
    g.add_argument("--calibration", default=None, help="calibration.json from gpubench fit (default: published)")
    g.add_argument("--step-jitter", type=float, default=0.0, metavar="CV",
                   help="multiply each step's time by a random factor of mean 1 and this coefficient of variation, "
                        "in [0, 1], as a real engine's steps vary (default 0: none); rerun with other --jitter-seed "
                        "values for the spread a timing-dependent router gives")
    g.add_argument("--jitter-seed", type=int, default=0, help="seed of --step-jitter's draws (default 0)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="predict steps without CUDA graphs")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="add the host's per-step time to the device's instead of overlapping them "
                        "(vLLM V1 schedules step n+1 while step n runs, on GPUs by default)")


def register(sub) -> None:
    p = sub.add_parser(
        "replay", help="replay agent jobs through a vLLM-like engine under a KV policy",
        description="Replay multi-turn agent jobs (a trace file or a synthetic workload with Poisson arrivals) "
                    "through a simulated vLLM V1 engine whose step times come from the predictor, under one "
                    "KV-cache policy, or (--engine vllm) through a real vLLM engine in real time; write "
                    "summary.json, steps.csv, turns.csv and jobs.csv to --out.",
        formatter_class=DefaultsHelpFormatter)
    # --jobs as in `gpubench sweep` and `gpubench trace`: N synthetic jobs, or the first N of --trace.
    p.add_argument("--trace", help="jobs file (JSONL of the job schema, or SWE-smith parquet/JSONL)")
    p.add_argument("--jobs", type=int, metavar="N", default=None, dest="num_jobs",
                   help="without --trace: generate N synthetic SWE-agent jobs; with --trace: replay its first N jobs")
    p.add_argument("--synthetic", action=DeprecatedAlias, canonical="--jobs", type=int, dest="num_jobs")
    p.add_argument("--preset", default="swe", choices=("swe", "swe-long", "scaled-cpu"),
                   help="synthetic agent: swe (calibrated to public SWE-smith statistics: ~43 turns, ~142K "
                        "prompt tokens per job), swe-long (contexts of tens of thousands of tokens) or scaled-cpu "
                        "(3-8 short turns, ~1 s tool gaps: what a real engine on 2 cores replays in minutes)")
    p.add_argument("--engine", default="sim", choices=("sim", "vllm"),
                   help="sim: the discrete-event simulator; vllm: send the jobs to a real vLLM engine in real time "
                        "(closed loop, prefix caching on; set it up with `gpubench vllm setup`)")
    p.add_argument("--threads", type=int, default=2, help="--engine vllm: OpenMP threads of the engine")
    p.add_argument("--kv-dir", default="auto",
                   help="--engine vllm with --prefill-replicas: where the pair's engines exchange KV files: auto "
                        "(RAM: /dev/shm when it is a tmpfs; else the system temp dir), disk (the system temp dir), "
                        "or a directory")
    p.add_argument("--policy", default="fcfs", choices=POLICY_NAMES,
                   help="KV-cache policy, or a queue order (sjf, srtf, las, jitserve); --engine vllm: fcfs, sjf or las (priorities)")
    p.add_argument("--jps", type=float, default=None,
                   help="Poisson job arrivals per second (required without --trace; with --trace it "
                        "replaces the trace's arrival times)")
    p.add_argument("--seed", type=argtypes.seed, default=0,
                   help="seed of the synthetic jobs, of SWE-smith tool durations and of the arrivals")
    p.add_argument("--out", required=True, help="output directory")
    add_slo_option(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_deprecated_flag(p, "--quiet", "--no-progress", dest="no_progress")
    p.add_argument("--set", action="append", default=[], metavar="[POLICY.]KEY=VALUE", dest="assignments",
                   help="a policy parameter (continuum.ttl_s=5) or an engine setting (max_num_seqs=128) as "
                        "`gpubench sweep --set` takes it, so a sweep cell replays with the same words; "
                        "repeatable; applied after the dedicated options below")
    p.add_argument("--json", action="store_true", help="print the summary (config and metrics) as JSON, not a table")
    p.add_argument("--no-step-log", action="store_true",
                   help="keep no per-step log (steps.csv gets its header only; `gpubench view` needs the log)")
    p.add_argument("--trace-out", metavar="FILE.json", default=None,
                   help="also write the replay as a Chrome trace (open in ui.perfetto.dev or chrome://tracing): "
                        "one track per job (queued, prefill, decode, tool call), one of engine steps, KV counters")
    add_engine_options(p)
    add_policy_options(p)
    add_cluster_options(p)
    p.set_defaults(func=cmd_replay)
    try:
        from scheduling import sweep_cli
    except ModuleNotFoundError as exc:
        if exc.name != "scheduling.sweep_cli":
            raise
    else:
        sweep_cli.register(sub)


def load_jobs(args: argparse.Namespace):
    """Jobs from --trace (its first --jobs N when given) or N synthetic ones, with Poisson arrivals
    at --jps when given."""
    from scheduling.workload import trace_files, trace_synth, traces

    if args.num_jobs is not None and args.num_jobs < 1:
        raise ConfigError(f"--jobs needs at least 1 job, got {args.num_jobs}")
    if args.trace is None:
        if args.num_jobs is None:
            raise ConfigError("give the jobs: --trace FILE, or --jobs N --jps RATE for synthetic ones")
        if args.jps is None:
            raise ConfigError("synthetic jobs (--jobs without --trace) need --jps (job arrivals per second)")
        jobs = trace_synth.synthetic_jobs(args.num_jobs, seed=args.seed, params=trace_synth.PRESETS[getattr(args, "preset", "swe")]())
    else:
        jobs = trace_files.load_trace(args.trace, seed=args.seed)  # seeds SWE-smith tool durations too
        if args.num_jobs is not None:
            jobs = jobs[: args.num_jobs]
    if args.jps is not None:
        if not args.jps > 0:
            raise ConfigError(f"--jps must be > 0, got {args.jps}")
        jobs = traces.with_poisson_arrivals(jobs, args.jps, seed=args.seed)
    return jobs


def config_from_args(args: argparse.Namespace):
    from scheduling.experiments.replay import ReplayConfig

    fields = dict(
        sku=args.sku, model=args.model or "llama-3.1-8b", policy=args.policy, policy_params=policy_params_from_args(args, args.policy),
        gpu_memory_utilization=args.gpu_memory_utilization, activation_reserve_gib=args.activation_reserve_gib,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        num_gpu_blocks=args.num_gpu_blocks, step_cost=args.step_cost, calibration=args.calibration,
        step_jitter=args.step_jitter, jitter_seed=args.jitter_seed,
        cuda_graphs=not args.no_cuda_graphs, async_scheduling=not args.no_async_scheduling, seed=args.seed,
        record_steps=not getattr(args, "no_step_log", False), block_size=args.block_size or 16)
    fields.update(cluster_fields(args))
    apply_assignments(fields, getattr(args, "assignments", []))
    return ReplayConfig(**fields)  # checks itself (one line naming the field) and resolves SKU and model


# Fields --set may not change: the command line's own options and the outputs own them.
_NOT_SETTABLE = ("policy", "policy_params", "seed", "record_steps")


def apply_assignments(fields: dict, assignments: list[str]) -> None:
    """Apply ``--set`` items to the ReplayConfig ``fields`` in place, read as `gpubench sweep --set`
    reads them: ``POLICY.KEY=VALUE`` a parameter of the replayed policy, ``KEY=VALUE`` a ReplayConfig field."""
    import dataclasses

    from scheduling.experiments.replay import ReplayConfig
    from scheduling.experiments.sweep import parse_assignments

    if not assignments:
        return
    policy = fields["policy"]
    policy_params, replay_params = parse_assignments(assignments, POLICY_NAMES)
    settable = sorted(f.name for f in dataclasses.fields(ReplayConfig) if f.name not in _NOT_SETTABLE)
    for key, value in replay_params.items():
        if key not in settable:
            raise ConfigError(f"--set {key}=...: unknown engine setting (known: {', '.join(settable)}; "
                              f"a policy parameter is POLICY.KEY=VALUE)")
        fields[key] = value
    for owner, params in policy_params.items():
        if owner != policy and not (policy == "continuum-offload" and owner in ("continuum", "cpu-offload")):
            raise ConfigError(f"--set {owner}.{next(iter(params))}=...: a parameter of policy '{owner}', "
                              f"not of the replayed '{policy}'")
        fields["policy_params"] = {**fields["policy_params"], **params}


def cmd_replay(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from scheduling.experiments.replay import kv_pool_note, run_replay, write_outputs

    if args.engine == "vllm":
        return cmd_replay_live(args)
    if args.kv_dir != "auto":
        raise ConfigError("--kv-dir is where a live pair's engines exchange KV files (--engine vllm); the simulator "
                          "prices the link with --kv-link file --kv-file-rate")
    from scheduling.slo import parse_slo

    trace_path = check_trace_out(args)
    slo = parse_slo(args.slo)
    config = config_from_args(args)
    jobs = load_jobs(args)
    console = Console(stderr=True)
    if args.no_progress:
        result = run_replay(jobs, config, slo=slo)
    else:
        with Progress(TextColumn("[bold]replay[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("jobs  sim {task.fields[sim_s]:.0f} s"), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task(f"{config.policy} on {config.sku}", total=len(jobs), sim_s=0.0)

            def progress(done: int, total: int, sim_s: float) -> None:
                bar.update(task, completed=done, sim_s=sim_s)

            result = run_replay(jobs, config, progress=progress, slo=slo)
    command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    out = write_outputs(result, args.out, command=command)
    write_trace_out(result, trace_path)
    if getattr(args, "json", False):
        import json

        doc = {"out": str(out), "config": config.to_dict(), "metrics": result.summary}
        if trace_path is not None:
            doc["trace"] = str(trace_path)
        print(json.dumps(doc, default=str, indent=2))
    else:
        print_summary(result.summary, config, out, trace_path)
    note = kv_pool_note(result.summary)
    if note:  # on stderr: --json's stdout stays JSON
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    return 0


def check_trace_out(args: argparse.Namespace):
    """--trace-out's path (None without it), refused before the replay runs when it cannot be written."""
    if getattr(args, "trace_out", None) is None:
        return None
    from scheduling.viewer.trace_export import check_trace_path

    if getattr(args, "no_step_log", False):
        raise ConfigError("--trace-out draws the engine steps from the step log; drop --no-step-log")
    return check_trace_path(args.trace_out)


def write_trace_out(result, trace_path) -> None:
    if trace_path is not None:
        from scheduling.viewer.trace_export import trace_of_result, write_trace

        write_trace(trace_of_result(result), trace_path)


def cmd_replay_live(args: argparse.Namespace) -> int:
    """``replay --engine vllm``: the jobs through a real vLLM engine, in real time."""
    from rich.console import Console

    from scheduling.experiments.live import LiveReplayConfig, run_live_replay, validate
    from scheduling.experiments.replay import write_outputs
    from scheduling.slo import parse_slo
    from vllmref import env

    trace_path = check_trace_out(args)
    if args.assignments:
        raise ConfigError("--set changes the simulator's settings; --engine vllm takes its dedicated options")
    if args.step_jitter or args.jitter_seed:
        raise ConfigError("--step-jitter imitates a real engine's step noise in the simulator; --engine vllm has its own")
    if (args.kv_link != "auto" or args.kv_link_gbs is not None or args.kv_link_latency_s is not None or args.kv_layerwise
            or args.kv_reserve != "before" or args.pd_prefix_caching != "both" or args.kv_file_rate is not None):
        raise ConfigError("--kv-link*, --kv-layerwise, --kv-reserve and --pd-prefix-caching shape the simulator's link; "
                          "a live prefill/decode pair moves KV through vLLM's ExampleConnector (files, whole prompts)")

    def given(value, default):
        return default if value is None else value
    fields = dict(model=args.model or "smollm2-135m", block_size=given(args.block_size, 128),
                  num_gpu_blocks=given(args.num_gpu_blocks, 64),
                  max_num_batched_tokens=given(args.max_num_batched_tokens, 4096),
                  max_num_seqs=given(args.max_num_seqs, 256), threads=args.threads, seed=args.seed, policy=args.policy)
    cluster = {k: v for k, v in cluster_fields(args).items()
               if k in ("replicas", "router", "router_params", "stats_interval_s", "prefix_ttl_s", "prefill_replicas",
                        "pd_threshold_tokens")}
    if args.max_outstanding is not None:
        raise ConfigError("--max-outstanding is the simulator's (a live replay refuses no turn)")
    if args.kv_dir != "auto":
        if not args.prefill_replicas:
            raise ConfigError("--kv-dir is where a live prefill/decode pair exchanges KV: add --prefill-replicas P")
        env.kv_exchange_parent(args.kv_dir)  # a bad directory: one line now
        cluster["kv_dir"] = args.kv_dir
    if args.replicas > 1 or args.prefill_replicas:
        from scheduling.cluster.pd import check_pd_settings
        from scheduling.cluster.routers import make_router
        from scheduling.experiments.live_cluster import LiveClusterConfig, run_live_cluster

        check_pd_settings(args.policy, args.prefill_replicas, kv_link="auto", kv_reserve="before",
                          pd_threshold_tokens=args.pd_threshold_tokens, pd_prefix_caching="both", kv_link_gbs=None)
        make_router(args.router, args.replicas, cluster["router_params"])  # a bad router or parameter: one line now
        config: LiveReplayConfig = LiveClusterConfig(**fields, **cluster)
        run: Callable = run_live_cluster
    else:
        config, run = LiveReplayConfig(**fields), run_live_replay
    jobs = load_jobs(args)
    validate(config, jobs)
    env.require_env()
    console = Console(stderr=True)
    console.print(f"live replay: {len(jobs)} jobs, {sum(j.num_turns for j in jobs)} turns through vLLM "
                  f"({config.model}, {config.num_gpu_blocks} blocks of {config.block_size}) in real time")

    def progress(line: str) -> None:
        if not args.no_progress:
            console.print(f"  {line}")

    result = run(jobs, config, progress=progress, slo=parse_slo(args.slo))
    command = "gpubench " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else None
    out = write_outputs(result, args.out, command=command)
    write_trace_out(result, trace_path)
    print_summary(result.summary, config, out, trace_path)
    return 0
