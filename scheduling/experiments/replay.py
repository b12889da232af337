"""One replay: jobs + :class:`ReplayConfig` -> :class:`ReplayResult` -> an output directory.

``run_replay`` is pure and deterministic: the engine has no randomness (arrivals come with the
jobs, see ``traces.with_poisson_arrivals``), each call builds its own engine, policy and step
cost, and the config is a picklable frozen dataclass, so a process pool or Ray gives the same
result as a loop.

Output directory (read by ``gpubench view``)::

    summary.json   {"config": {...}, "metrics": {...}}
    steps.csv      one row per engine step (engine.STEP_COLUMNS)
    turns.csv      one row per turn (engine.TURN_COLUMNS)
    jobs.csv       one row per job (engine.JOB_COLUMNS)

GPU KV pool: ``(device memory × gpu_memory_utilization − model weights − activation reserve) /
(KV bytes per token × block size)`` blocks, bf16 weights and KV, where device memory is the total
the driver reports (binary MiB: 81,559 MiB on an H100 80GB), as vLLM reads it, not the datasheet's
decimal GB. Token budget and max_num_seqs default to what ``vllm serve`` picks for the SKU's memory
(:func:`vllm_server_defaults`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import pandas as pd

from common.errors import ConfigError
from scheduling.cluster.pd import check_pd_settings
from scheduling.cluster.sim import check_cluster_settings
from scheduling.engine import Engine, EngineConfig
from scheduling.engine.request import BLOCK_SIZE
from scheduling.engine.step_cost import JitteredStepCost, StepCost, make_step_cost
from scheduling.experiments.metrics import frames, summarize
from scheduling.policies import make_policy
from scheduling.slo.spec import DEFAULT_SLO, SLOSpec
from scheduling.workload.traces import Job

if TYPE_CHECKING:
    from gpubench.skus import SKU
    from predictor import ModelConfig
    from scheduling.experiments.live import LiveReplayConfig

GIB = 1 << 30
DTYPE_BYTES = 2  # bf16 weights and KV cache
CPU_DTYPE_BYTES = 4  # the cpu SKU is this host's vLLM, which runs float32 (vllmref.engine says why)


@dataclass(frozen=True)
class ReplayConfig:
    """Everything a replay depends on besides the jobs.

    Args:
        sku, model: hardware and model (names as ``gpubench.skus`` / ``predictor`` know them).
        policy, policy_params: KV policy name and its parameters (see ``scheduling.policies``).
        gpu_memory_utilization: share of GPU memory vLLM may use (vLLM default 0.9).
        activation_reserve_gib: memory kept for activations and CUDA graphs (vLLM profiles it;
            2 GiB is our estimate for 8B-class models at 8192 batched tokens).
        max_num_batched_tokens, max_num_seqs: scheduler limits; None (default) takes what
            ``vllm serve`` picks for the SKU (:func:`vllm_server_defaults`).
        num_gpu_blocks: override the computed pool size (tests, what-if studies).
        step_cost: ``predictor`` (predictor.StepModel, memoized), ``constant:SECONDS`` or
            ``measured:DIR`` (the step times DIR/steps.csv recorded; a diagnostic).
        calibration: calibration.json for the predictor (None: published defaults, then spec).
        step_jitter, jitter_seed: each step's time times a lognormal factor of mean 1 and this
            coefficient of variation, drawn with this seed (0: none); a real engine's step-to-step
            noise, which moves the routes of timing-dependent routers (step_cost.JitteredStepCost).
        cuda_graphs: whether the predicted engine replays decode steps as CUDA graphs.
        async_scheduling: vLLM V1's default on GPUs: the host schedules step n+1 while the device
            runs step n, so the predicted host term overlaps device time (max, not sum).
        seed: the seed the jobs were made with (recorded; the engine itself draws nothing).
        record_steps: keep the step log.
        block_size: tokens per KV block (vLLM's GPU default 16; its CPU build 128).
        replicas: engines behind a router (scheduling.cluster; 1: one engine, no router).
        router, router_params: which router, with its parameters (scheduling.cluster.routers).
        stats_interval_s: how often the router's view of the replicas' load is refreshed (0: fresh).
        prefix_ttl_s: how long the router trusts its record of the prefixes it sent where.
        max_outstanding: turns in flight on a replica beyond which the router refuses one (None: never).
        prefill_replicas: prefill instances in front of the replicas, which then decode only
            (scheduling.cluster.pd; 0: aggregated serving).
        kv_link, kv_link_gbs: the link a turn's KV takes from prefill to decode (``auto``, ``nvlink``,
            ``network``, ``pcie``: the SKU table's bandwidth; kv_link_gbs overrides it; kv_link_latency_s
            the seconds each hand-off costs besides its bytes).
        kv_layerwise: send the KV layer by layer during the prefill (overlapped).
        kv_reserve: ``before``: the decode instance reserves blocks, then pulls (vLLM's NixlConnector);
            ``after``: the prefill instance pushes to a staging buffer.
        pd_threshold_tokens: a turn the decode instance is likely to miss by fewer tokens is
            prefilled there.
        pd_prefix_caching: which side looks prefixes up: both, prefill, decode, none.

    A config checks itself when it is made (one ConfigError naming the field), and resolves its SKU
    and model once: :attr:`sku_spec` and :attr:`model_config` are what every later stage reads, so
    the CLI, a sweep cell and ``run_replay`` neither check nor look the names up again.
    """

    sku: str = "h100-sxm"
    model: str = "llama-3.1-8b"
    policy: str = "fcfs"
    policy_params: dict = field(default_factory=dict)
    gpu_memory_utilization: float = 0.9
    activation_reserve_gib: float = 2.0
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    num_gpu_blocks: int | None = None
    step_cost: str = "predictor"
    calibration: str | None = None
    step_jitter: float = 0.0
    jitter_seed: int = 0
    cuda_graphs: bool = True
    async_scheduling: bool = True
    seed: int = 0
    record_steps: bool = True
    block_size: int = BLOCK_SIZE
    replicas: int = 1
    router: str = "round-robin"
    router_params: dict = field(default_factory=dict)
    stats_interval_s: float = 0.0
    prefix_ttl_s: float = 120.0
    max_outstanding: int | None = None
    prefill_replicas: int = 0
    kv_link: str = "auto"
    kv_link_gbs: float | None = None
    kv_link_latency_s: float | None = None
    kv_file_rate: str | None = None
    kv_layerwise: bool = False
    kv_reserve: str = "before"
    pd_threshold_tokens: int = 0
    pd_prefix_caching: str = "both"

    def __post_init__(self) -> None:
        from gpubench import skus
        from predictor import load_model_config

        _check_engine_fields(self)
        make_policy(self.policy, self.policy_params)  # an unknown policy or parameter: one line now
        check_cluster_settings(self.replicas, self.router, self.router_params, stats_interval_s=self.stats_interval_s,
                               prefix_ttl_s=self.prefix_ttl_s, max_outstanding=self.max_outstanding)
        check_pd_settings(self.policy, self.prefill_replicas, kv_link=self.kv_link, kv_reserve=self.kv_reserve,
                          pd_threshold_tokens=self.pd_threshold_tokens, pd_prefix_caching=self.pd_prefix_caching,
                          kv_link_gbs=self.kv_link_gbs, kv_link_latency_s=self.kv_link_latency_s,
                          kv_file_rate=self.kv_file_rate, kv_layerwise=self.kv_layerwise)
        # Not fields: equality, asdict and the recorded config stay the names.
        object.__setattr__(self, "_sku_spec", skus.get(self.sku))
        object.__setattr__(self, "_model_config", load_model_config(self.model))
        if self.prefill_replicas:
            from scheduling.cluster.pd import kv_link

            if self.kv_link == "file":
                from scheduling.cluster.pd import FileLinks

                FileLinks.load(self.kv_file_rate or "")  # not a measured rate file: one line now
            else:
                kv_link(self.sku_spec, self.kv_link, self.kv_link_gbs, self.kv_link_latency_s)  # a link the SKU lacks

    @property
    def sku_spec(self) -> SKU:
        """The SKU table's entry for :attr:`sku` (resolved once, when the config was made)."""
        return self._sku_spec  # type: ignore[attr-defined]

    @property
    def model_config(self) -> ModelConfig:
        """The model's config for :attr:`model` (resolved once, when the config was made)."""
        return self._model_config  # type: ignore[attr-defined]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ReplayResult:
    config: ReplayConfig | LiveReplayConfig  # a live replay (scheduling.experiments.live) keeps its own config
    summary: dict
    steps: pd.DataFrame
    turns: pd.DataFrame
    jobs: pd.DataFrame
    rejected: pd.DataFrame | None = None  # turns a cluster's router refused (scheduling.cluster.results)


def vllm_server_defaults(s: SKU) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` that ``vllm serve`` (V1, 0.32) picks on one GPU.

    vLLM keys them on the driver-reported memory and the device name: at least 160 GiB (B200)
    16384 / 1024; at least 70 GiB and not an A100 (H100, H200) 8192 / 1024; otherwise (A100s,
    L40S, RTX 5090) 2048 / 256. (Its offline ``LLM`` class uses larger budgets; a replay models a
    server.) The ``cpu`` SKU gets vLLM's CPU defaults of the offline engine the live replay runs.
    """
    if s.backend == "cpu":
        # vLLM's CPU platform defaults for its offline engine (4096 tokens, 256 sequences per
        # socket), which is what `replay --engine vllm` runs and the simulator stands in for.
        return 4096, 256
    memory = s.device_memory_bytes
    if memory >= 160 * GIB:
        return 16384, 1024
    if memory >= 70 * GIB and "a100" not in s.name.lower():
        return 8192, 1024
    return 2048, 256


def kv_pool_blocks(s: SKU, m: ModelConfig, *, gpu_memory_utilization: float = 0.9,
                   activation_reserve_gib: float = 2.0, block_size: int = BLOCK_SIZE) -> tuple[int, int, float]:
    """``(num_gpu_blocks, kv_bytes_per_token, host_link_gbs)`` for an SKU and model.

    Raises:
        ConfigError: the weights and reserve do not leave room for one block.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    dtype_bytes = CPU_DTYPE_BYTES if s.backend == "cpu" else DTYPE_BYTES
    kv_per_token = m.kv_bytes_per_token(dtype_bytes)
    usable = s.device_memory_bytes * gpu_memory_utilization - m.weight_bytes(dtype_bytes) - activation_reserve_gib * GIB
    num_blocks = math.floor(usable / (kv_per_token * block_size)) if usable > 0 else 0
    if num_blocks < 1:
        raise ConfigError(f"{m.name} ({m.weight_bytes(dtype_bytes) / 1e9:.1f} GB of {dtype_bytes * 8}-bit weights) leaves no room for a "
                          f"KV cache on {s.id} ({s.device_memory_bytes / GIB:.1f} GiB × {gpu_memory_utilization})")
    return num_blocks, kv_per_token, float(s.host_link_gbs or 32.0)


def _check_engine_fields(cfg: ReplayConfig) -> None:
    """The engine sizes (from the CLI's options, ``--set`` or a sweep's replay parameters): one ConfigError."""
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "num_gpu_blocks"):
        v = getattr(cfg, name, None)
        if v is None and name != "block_size":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
    for name in ("gpu_memory_utilization", "activation_reserve_gib"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    jitter = cfg.step_jitter
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter <= 1:
        raise ConfigError(f"step_jitter (--step-jitter) is a coefficient of variation in [0, 1], got {jitter!r}")
    if isinstance(cfg.jitter_seed, bool) or not isinstance(cfg.jitter_seed, int) or cfg.jitter_seed < 0:
        raise ConfigError(f"jitter_seed must be an integer >= 0, got {cfg.jitter_seed!r}")
    if cfg.jitter_seed and not jitter:
        raise ConfigError(f"jitter_seed {cfg.jitter_seed} without step_jitter draws nothing: give a jitter too "
                          "(--step-jitter CV; in a sweep, --set step_jitter=CV)")


def engine_config(cfg: ReplayConfig) -> EngineConfig:
    """The engine's sizes for a replay: its pool from the SKU and model, the server's defaults."""
    num_blocks, kv_per_token, link_gbs = kv_pool_blocks(
        cfg.sku_spec, cfg.model_config, gpu_memory_utilization=cfg.gpu_memory_utilization,
        activation_reserve_gib=cfg.activation_reserve_gib, block_size=cfg.block_size)
    token_budget, max_seqs = vllm_server_defaults(cfg.sku_spec)
    return EngineConfig(
        num_gpu_blocks=cfg.num_gpu_blocks if cfg.num_gpu_blocks is not None else num_blocks,
        max_num_batched_tokens=cfg.max_num_batched_tokens or token_budget, max_num_seqs=cfg.max_num_seqs or max_seqs,
        kv_bytes_per_token=kv_per_token, host_link_gbs=link_gbs, record_steps=cfg.record_steps,
        block_size=cfg.block_size)


def _pd_settings(config: ReplayConfig):
    """The disaggregation of a replay config (scheduling.cluster.pd.PDSettings)."""
    from scheduling.cluster.pd import FileLinks, PDSettings, kv_link

    if config.kv_link == "file":  # vLLM's file connector, priced from the host's measured write and read
        files = FileLinks.load(config.kv_file_rate or "")
        link, files_or_none = files.read, files
    else:
        link = kv_link(config.sku_spec, config.kv_link, config.kv_link_gbs, config.kv_link_latency_s)
        files_or_none = None
    return PDSettings(config.prefill_replicas, link, config.kv_layerwise, config.kv_reserve, config.pd_threshold_tokens,
                      config.pd_prefix_caching, files_or_none)


def run_replay(jobs: Sequence[Job], config: ReplayConfig, *, step_cost: StepCost | None = None,
               progress: Callable[[int, int, float], None] | None = None, slo: SLOSpec = DEFAULT_SLO) -> ReplayResult:
    """Replay ``jobs`` under ``config``.

    Args:
        jobs: the workload with arrival times.
        config: see :class:`ReplayConfig`.
        step_cost: an explicit step cost (tests); default built from ``config.step_cost``.
        progress: ``callback(num_jobs_done, num_jobs, sim_time_s)``.
        slo: the targets the summary's SLO figures are scored against (scheduling.slo).
    """
    if not jobs:
        raise ConfigError("no jobs to replay")
    ecfg = engine_config(config)
    policy = make_policy(config.policy, config.policy_params)
    cost = step_cost or make_step_cost(config.step_cost, sku=config.sku, model=config.model,
                                       calibration=config.calibration, cuda_graphs=config.cuda_graphs,
                                       async_scheduling=config.async_scheduling)
    if config.step_jitter:
        cost = JitteredStepCost(cost, config.step_jitter, config.jitter_seed)
    if config.replicas > 1 or config.prefill_replicas:
        return _run_cluster(jobs, config, ecfg, cost, progress, slo)
    res = Engine(jobs, ecfg, policy, cost, progress=progress).run()
    steps, turns, jobs_df = frames(res)
    summary = summarize(res, turns, jobs_df, slo)
    summary["step_cost"] = cost.describe()
    summary["policy_params"] = policy.params()
    return ReplayResult(config=config, summary=summary, steps=steps, turns=turns, jobs=jobs_df)


def _run_cluster(jobs: Sequence[Job], config: ReplayConfig, ecfg: EngineConfig, cost: StepCost, progress,
                 slo: SLOSpec) -> ReplayResult:
    """``config.replicas`` engines behind ``config.router`` (scheduling.cluster)."""
    from scheduling.cluster.results import cluster_block, cluster_frames, count_rejects, merged
    from scheduling.cluster.routers import make_router
    from scheduling.cluster.sim import Cluster

    num_p = config.prefill_replicas
    policies = [make_policy(config.policy, config.policy_params) for _ in range(config.replicas + num_p)]
    router = make_router(config.router, config.replicas, config.router_params, seed=config.seed)
    pd = prefill_router = None
    if num_p:
        pd = _pd_settings(config)
        prefill_router = make_router(config.router, num_p, config.router_params, seed=config.seed + 1)
    res = Cluster(jobs, ecfg, cost, policies, router, stats_interval_s=config.stats_interval_s,
                  prefix_ttl_s=config.prefix_ttl_s, max_outstanding=config.max_outstanding, pd=pd,
                  prefill_router=prefill_router, num_layers=config.model_config.num_layers, progress=progress).run()
    steps, turns, jobs_df, rejected = cluster_frames(res)
    summary = summarize(merged(res), turns, jobs_df, slo)
    num_rejected, num_abandoned = len(rejected), rejected["job_id"].nunique()
    summary["slo_attainment"] = count_rejects(summary["slo_attainment"], num_rejected, num_abandoned)
    if summary["slo_turn_share"] is not None and num_rejected:
        summary["slo_turn_share"] *= len(turns) / (len(turns) + num_rejected)
    summary["step_cost"] = cost.describe()
    summary["policy_params"] = policies[0].params()
    summary["cluster"] = cluster_block(res, turns, router.name, router.params(), pd)
    return ReplayResult(config=config, summary=summary, steps=steps, turns=turns, jobs=jobs_df, rejected=rejected)


def pool_never_filled(metrics: dict) -> bool:
    """True when the run's GPU KV pool never ran short: no cached block evicted, no request short
    of free blocks, no preemption. False too for a summary without these counts (a live replay)."""
    counts = [metrics.get(k) for k in ("kv_evicted_blocks", "kv_block_shortages", "preemptions")]
    return all(isinstance(c, int) for c in counts) and not any(counts)


def kv_pool_note(metrics: dict) -> str | None:
    """One line for a replay whose GPU KV pool never filled (None otherwise): users compared KV
    policies on such runs and found them (nearly) the same, with no hint why."""
    if not pool_never_filled(metrics):
        return None
    return (f"note: the GPU KV pool never filled (peak {metrics.get('kv_peak_blocks', 0):,} of "
            f"{metrics.get('num_gpu_blocks', 0):,} blocks): nothing was evicted, so KV-cache eviction, pinning "
            f"and offload made no difference here; to compare KV policies add jobs (--jobs), raise --jps or "
            f"shrink the pool (--num-gpu-blocks)")


def write_outputs(result: ReplayResult, out_dir: str | Path, *, command: str | None = None) -> Path:
    """Write summary.json, steps.csv, turns.csv, jobs.csv into ``out_dir`` (created)."""
    from common.outdir import locked, write_text_atomic

    out = Path(out_dir)
    with locked(out, "replay directory"):
        # Tables first, the summary last: a directory with a summary.json is complete.
        tables = [("steps.csv", result.steps), ("turns.csv", result.turns), ("jobs.csv", result.jobs)]
        if result.rejected is not None:
            tables.append(("rejected.csv", result.rejected))
        else:  # a replay written here before with a cap on outstanding turns left one: it is not this run's
            (out / "rejected.csv").unlink(missing_ok=True)
        for name, frame in tables:
            write_text_atomic(out / name, frame.to_csv(index=False))
        doc = {"command": command, "config": result.config.to_dict(), "metrics": result.summary}
        write_text_atomic(out / "summary.json", json.dumps(doc, indent=2, default=str) + "\n")
    return out
