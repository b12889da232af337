"""Whether a probe run was taken under contention: the one judgement `fit`, `show` and `compare` share.

A probe run taken while other work held the cores measures the other work as much as the machine.
A CPU run is contended when its 1-minute load (at its start, and at the end of each probe) exceeded
its logical CPUs by more than one, or when the rows of a probe got under :data:`MIN_CPU_SHARE` of the
CPU their threads asked for (median over the probe's rows). A row is flagged when its own share is
under that threshold. Only rows that record both ``proc_cpu_util`` and ``threads`` are judged (the
probes whose threads the measuring process runs itself; ``torch_ops`` and ``vllm_ops`` count their
threads otherwise). GPU runs are not judged (their figures are the device's, not the host's).

``predictor.host_match`` re-exports :func:`is_contended`, :data:`MIN_CPU_SHARE` and
:func:`run_contention` (`fit` refuses a contended run); `show` and `compare` say so and mark the
figures (gpubench.report, gpubench.compare).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.hostload import MIN_CPU_SHARE, is_contended  # noqa: F401 - the one rule, re-exported


@dataclass
class Contention:
    """What :func:`judge_run` found. ``flagged_keys``: probe -> keys of the rows under the share."""

    contended: bool = False
    reason: str | None = None  # why, in words (None when quiet)
    load_1m_max: float | None = None
    num_cpus: int | None = None
    worst_probe: str | None = None
    worst_share: float | None = None
    rows_judged: int = 0
    rows_flagged: int = 0
    flagged_keys: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON form (`show --json`'s ``contention``, each run of `compare --json`)."""
        return {"contended": self.contended, "reason": self.reason, "load_1m_max": self.load_1m_max,
                "num_cpus": self.num_cpus, "worst_probe": self.worst_probe, "worst_cpu_share": self.worst_share,
                "min_cpu_share": MIN_CPU_SHARE, "rows_judged": self.rows_judged, "rows_flagged": self.rows_flagged}

    def is_flagged(self, probe: str, key) -> bool:
        return str(key) in self.flagged_keys.get(probe, ())


def _max_load(manifest: dict) -> float | None:
    loads = []
    start = (manifest.get("telemetry") or {}).get("loadavg_at_start")
    if start:
        loads.append(float(start[0]))
    for info in (manifest.get("probes") or {}).values():
        if isinstance(info, dict) and info.get("loadavg_1m_at_end") is not None:
            loads.append(float(info["loadavg_1m_at_end"]))
    return max(loads) if loads else None


def judge_run(run) -> Contention:
    """The contention judgement of a loaded run (gpubench.results.Run)."""
    manifest = run.manifest
    device = manifest.get("device") or {}
    if device.get("backend") != "cpu":
        return Contention()
    props = device.get("properties") or {}
    ncpu = int(props.get("num_cpus") or 1)
    threads = int(props.get("omp_threads") or ncpu)
    out = Contention(load_1m_max=_max_load(manifest), num_cpus=ncpu)
    shares = []
    for name, frame in run.frames.items():
        if "proc_cpu_util" not in frame.columns or "threads" not in frame.columns:
            continue
        share = frame["proc_cpu_util"] / frame["threads"].clip(lower=1)
        judged = share.notna()
        if not judged.any():
            continue
        shares.append((name, float(share[judged].median())))
        low = judged & (share < MIN_CPU_SHARE)
        out.rows_judged += int(judged.sum())
        out.rows_flagged += int(low.sum())
        if low.any():
            out.flagged_keys[name] = {str(k) for k in frame.loc[low, "key"]}
    if shares:
        out.worst_probe, out.worst_share = min(shares, key=lambda s: s[1])
    load = out.load_1m_max
    out.contended = is_contended(load_1m=load, num_cpus=ncpu, cpu_share=out.worst_share)
    if out.contended:
        parts = []
        if load is not None and load > ncpu + 1:
            parts.append(f"1-minute load up to {load:.1f} on {ncpu} CPUs")
        if out.worst_share is not None and out.worst_share < MIN_CPU_SHARE:
            parts.append(f"probe {out.worst_probe} got {out.worst_share:.0%} of the CPU its {threads} threads asked for")
        out.reason = "; ".join(parts)
    return out


def run_contention(run) -> str | None:
    """Why a probe run counts as contended (None when quiet): :func:`judge_run`'s reason."""
    return judge_run(run).reason
