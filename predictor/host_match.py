"""Which host a calibration describes, whether the run it came from was quiet, and refusing to apply
it elsewhere.

A calibration's efficiencies are properties of one machine: the ``cpu`` SKU takes its peak and core
count from whichever host runs the prediction, so a calibration fitted on an AMD EPYC and applied on
an Intel Xeon silently predicts the wrong machine. ``fit`` records the host (``meta.host``: for a
CPU the model name, logical CPUs, widest vector ISA, ISA flags, last-level cache, BLAS; for a GPU
the device name and driver), and ``predict``/``evaluate`` compare it with the host they run on (for
the ``cpu`` SKU) or with the SKU asked for (GPUs), refusing a mismatch with one line unless forced.

Contention: a probe run taken while other work held the cores measures the other work. ``fit``
refuses a run whose 1-minute load exceeded the core count by more than one, or whose probes got
under :data:`MIN_CPU_SHARE` of the CPU they asked for, unless told to accept it; then the
calibration is marked (``meta.contended``) and ``predict`` warns.
"""
from __future__ import annotations

from common.errors import ConfigError

# A measurement that got less than this share of the CPU time it asked for was shared with other
# work (the same threshold as vLLM engine-step rows: predictor.vllm_profile).
MIN_CPU_SHARE = 0.8

CPU_IDENTITY_KEYS = ("model_name", "num_cpus", "vector_bits", "isa_flags", "llc_bytes")


def is_contended(*, load_1m: float | None, num_cpus: int, cpu_share: float | None = None) -> bool:
    """The one contention rule: load above the core count + 1, or a CPU share under MIN_CPU_SHARE."""
    return bool((load_1m is not None and load_1m > num_cpus + 1)
                or (cpu_share is not None and cpu_share < MIN_CPU_SHARE))


def identity_from_device(device: dict) -> dict:
    """The host identity of a run manifest's ``device`` block."""
    if device.get("backend") == "cpu":
        p = device.get("properties") or {}
        return {"backend": "cpu", "model_name": p.get("model_name"), "num_cpus": p.get("num_cpus"),
                "vector_bits": p.get("vector_bits"), "isa_flags": sorted(p.get("flags") or []),
                "llc_bytes": p.get("llc_bytes"), "blas": p.get("blas")}
    return {"backend": device.get("backend"), "name": device.get("name"), "driver": device.get("driver")}


def current_cpu_identity() -> dict:
    """This host, in the shape of :func:`identity_from_device`."""
    from gpubench.hostinfo import host_cpu

    h = host_cpu()
    return {"backend": "cpu", "model_name": h.model_name, "num_cpus": h.num_cpus, "vector_bits": h.vector_bits,
            "isa_flags": sorted(h.flags), "llc_bytes": h.llc_bytes}


def mismatches(recorded: dict, current: dict) -> list[str]:
    """``key: recorded != current`` for every CPU identity key that differs."""
    return [f"{k} {recorded.get(k)!r} != {current.get(k)!r}" for k in CPU_IDENTITY_KEYS
            if recorded.get(k) != current.get(k)]


def check_calibration_host(cal, sku_id: str, *, force: bool = False) -> list[str]:
    """Refuse (ConfigError, one line) a calibration that describes another machine than the one
    predicted for; return warnings (contended run, no host recorded, forced mismatch).

    ``cpu``: the calibration's recorded host must be this host. A GPU SKU: the calibration must be
    for that SKU (its recorded device is then reported only).
    """
    meta = cal.meta or {}
    host = meta.get("host")
    warnings = []
    if meta.get("contended"):
        warnings.append(f"calibration fitted from a run taken under contention ({meta['contended']}): "
                        "its efficiencies describe a shared machine")
    if cal.sku != sku_id:
        problem = f"the calibration is for SKU '{cal.sku}', not '{sku_id}'"
        if not force:
            raise ConfigError(f"{problem}; fit one on that hardware, or pass --force-calibration")
        warnings.append(problem + " (forced)")
        return warnings
    if sku_id != "cpu":
        return warnings
    if not host:
        warnings.append("the calibration records no host (fitted before hosts were recorded): "
                        "it may describe another CPU; refit it with `gpubench fit`")
        return warnings
    diff = mismatches(host, current_cpu_identity())
    if diff:
        problem = f"the calibration describes another CPU ({'; '.join(diff)})"
        if not force:
            raise ConfigError(f"{problem}; run `gpubench run --device cpu` and `gpubench fit` on this host, "
                              "or pass --force-calibration")
        warnings.append(problem + " (forced)")
    return warnings


def calibration_for(path, sku_id: str | None, *, force: bool = False):
    """The calibration at ``path`` for predicting ``sku_id`` (None: the calibration's own SKU), and
    the warnings to print: loaded, checked against the machine (check_calibration_host) and, when
    ``force`` let another GPU SKU's calibration through, retargeted to ``sku_id``
    (calibration_model.retarget)."""
    from predictor.calibration_model import Calibration, retarget

    cal = Calibration.load(path)
    sku_id = sku_id or cal.sku
    warnings = check_calibration_host(cal, sku_id, force=force)
    if cal.sku != sku_id:  # forced: check_calibration_host refuses it otherwise
        cal = retarget(cal, sku_id)
    return cal, warnings


def calibration_for_command(path, sku: str | None, *, force: bool = False):
    """``calibration_for`` as the commands use it: ``sku`` as the user named it (an id or alias; None:
    the calibration's own), each warning printed on stderr."""
    import sys

    from gpubench import skus as sku_table

    cal, warnings = calibration_for(path, sku_table.get(sku).id if sku else None, force=force)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    return cal


def run_contention(run) -> str | None:
    """Why a probe run counts as contended (None when quiet): the load at its start and at the end
    of each probe against its logical CPUs, and the CPU share its rows recorded (CPU runs)."""
    manifest = run.manifest
    device = manifest.get("device") or {}
    if device.get("backend") != "cpu":
        return None
    props = device.get("properties") or {}
    ncpu = int(props.get("num_cpus") or 1)
    threads = int(props.get("omp_threads") or ncpu)
    loads = []
    start = (manifest.get("telemetry") or {}).get("loadavg_at_start")
    if start:
        loads.append(float(start[0]))
    for info in (manifest.get("probes") or {}).values():
        if isinstance(info, dict) and info.get("loadavg_1m_at_end") is not None:
            loads.append(float(info["loadavg_1m_at_end"]))
    load = max(loads) if loads else None
    shares = []
    for name, frame in run.frames.items():
        if "proc_cpu_util" in frame.columns and "threads" in frame.columns:
            util = (frame["proc_cpu_util"] / frame["threads"].clip(lower=1)).dropna()
            if len(util):
                shares.append((name, float(util.median())))
    worst = min(shares, key=lambda s: s[1]) if shares else None
    if not is_contended(load_1m=load, num_cpus=ncpu, cpu_share=worst[1] if worst else None):
        return None
    parts = []
    if load is not None and load > ncpu + 1:
        parts.append(f"1-minute load up to {load:.1f} on {ncpu} CPUs")
    if worst and worst[1] < MIN_CPU_SHARE:
        parts.append(f"probe {worst[0]} got {worst[1]:.0%} of the CPU its {threads} threads asked for")
    return "; ".join(parts)
