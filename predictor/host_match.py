"""Which host a calibration describes, whether the run it came from was quiet, and refusing to apply
it elsewhere.

A calibration's efficiencies are properties of one machine: the ``cpu`` SKU takes its peak and core
count from whichever host runs the prediction, so a calibration fitted on an AMD EPYC and applied on
an Intel Xeon silently predicts the wrong machine. ``fit`` records the host (``meta.host``: for a
CPU the model name, logical CPUs, widest vector ISA, ISA flags, last-level cache, BLAS; for a GPU
the device name and driver), and ``predict`` compares it with the host it runs on (for the ``cpu``
SKU) or with the SKU asked for (GPUs), refusing a mismatch with one line unless forced.

A CPU's record also holds what its spec is made of (cores, vector width, FMA units, clock, caches,
memory): ``fit`` and ``evaluate`` price the CPU a run recorded, not the one they run on
(:func:`recorded_cpu_spec`), so a committed calibration and its scores regenerate on any host.
``evaluate`` then checks the rows against the calibration's device, not against this host.

Contention: a probe run taken while other work held the cores measures the other work. ``fit``
refuses a run that gpubench.contention judges contended (the judgement `show` and `compare` print
too; re-exported here) unless told to accept it; then the calibration is marked
(``meta.contended``) and ``predict`` warns.
"""
from __future__ import annotations

from common.errors import ConfigError
from gpubench.contention import MIN_CPU_SHARE, is_contended, run_contention

__all__ = ["MIN_CPU_SHARE", "is_contended", "run_contention", "check_calibration_host", "calibration_for",
           "calibration_for_command", "identity_from_device", "current_cpu_identity", "mismatches",
           "recorded_cpu_spec", "calibration_cpu_spec", "spec_for_calibration"]

CPU_IDENTITY_KEYS = ("model_name", "num_cpus", "vector_bits", "isa_flags", "llc_bytes")
# recorded beside the identity (not compared: a hypervisor's clock moves between boots of one VM) so
# that the spec of the recorded CPU can be rebuilt anywhere
CPU_SPEC_KEYS = ("num_physical_cores", "fma_units_per_core", "clock_mhz", "clock_source", "caches",
                 "mem_total_bytes")


def identity_from_device(device: dict) -> dict:
    """The host identity of a run manifest's ``device`` block."""
    if device.get("backend") == "cpu":
        p = device.get("properties") or {}
        return {"backend": "cpu", "model_name": p.get("model_name"), "num_cpus": p.get("num_cpus"),
                "vector_bits": p.get("vector_bits"), "isa_flags": sorted(p.get("flags") or []),
                "llc_bytes": p.get("llc_bytes"), "blas": p.get("blas"),
                **{k: p[k] for k in CPU_SPEC_KEYS if k in p}}
    return {"backend": device.get("backend"), "name": device.get("name"), "driver": device.get("driver")}


def current_cpu_identity() -> dict:
    """This host, in the shape of :func:`identity_from_device`."""
    from gpubench.hostinfo import host_cpu

    h = host_cpu()
    return {"backend": "cpu", "model_name": h.model_name, "num_cpus": h.num_cpus, "vector_bits": h.vector_bits,
            "isa_flags": sorted(h.flags), "llc_bytes": h.llc_bytes}


def recorded_cpu_spec(host: dict | None):
    """The HardwareSpec of the CPU ``host`` (a calibration's ``meta.host``, or
    :func:`identity_from_device` of a run) records, or None when it does not record the whole spec
    (a calibration fitted before the record held it): the caller then prices this host."""
    from gpubench import skus
    from gpubench.hostinfo import HostCPU
    from predictor.hardware import HardwareSpec

    if not host or host.get("backend") != "cpu" or any(k not in host for k in CPU_SPEC_KEYS):
        return None
    cpu = HostCPU.from_dict({**host, "flags": host["isa_flags"]})
    return HardwareSpec.from_sku(skus.cpu_sku(cpu, memory_bytes=host["mem_total_bytes"]))


def calibration_cpu_spec(calibration):
    """:func:`recorded_cpu_spec` of a CPU calibration (a path or a Calibration); None for None, a GPU
    calibration, or one fitted before the record held the whole spec."""
    from pathlib import Path

    from predictor.calibration_model import Calibration

    if calibration is None:
        return None
    cal = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
    return recorded_cpu_spec((cal.meta or {}).get("host")) if cal.backend == "cpu" else None


def spec_for_calibration(sku: str, calibration):
    """The device a calibration (a path or a Calibration) prices on ``sku``: for ``cpu``, the CPU the
    calibration records whole, wherever this runs (``evaluate``: the rows were measured where the
    calibration's probes ran; a replay of another machine's calibration is that machine's); else,
    and for a calibration that records no whole CPU, the SKU (``cpu``: this host)."""
    from predictor.hardware import HardwareSpec

    recorded = calibration_cpu_spec(calibration) if sku == "cpu" else None
    return recorded or HardwareSpec.from_sku(sku)



def mismatches(recorded: dict, current: dict) -> list[str]:
    """``key: recorded != current`` for every CPU identity key that differs."""
    return [f"{k} {recorded.get(k)!r} != {current.get(k)!r}" for k in CPU_IDENTITY_KEYS
            if recorded.get(k) != current.get(k)]


def check_calibration_host(cal, sku_id: str, *, force: bool = False, recorded_host_priced: bool = False) -> list[str]:
    """Refuse (ConfigError, one line) a calibration that describes another machine than the one
    predicted for; return warnings (contended run, no host recorded, forced mismatch).

    ``cpu``: the calibration's recorded host must be this host, unless ``recorded_host_priced`` (evaluate:
    it prices the CPU the calibration records whole, :func:`spec_for_calibration`, and checks the rows against
    it). A GPU SKU: the calibration must be for that SKU (its recorded device is then reported only).
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
    if recorded_host_priced and recorded_cpu_spec(host) is not None:
        return warnings
    diff = mismatches(host, current_cpu_identity())
    if diff:
        problem = f"the calibration describes another CPU ({'; '.join(diff)})"
        if not force:
            raise ConfigError(f"{problem}; run `gpubench run --device cpu` and `gpubench fit` on this host, "
                              "or pass --force-calibration")
        warnings.append(problem + " (forced)")
    return warnings


def calibration_for(path, sku_id: str | None, *, force: bool = False, recorded_host_priced: bool = False):
    """The calibration at ``path`` for predicting ``sku_id`` (None: the calibration's own SKU), and
    the warnings to print: loaded, checked against the machine (check_calibration_host) and, when
    ``force`` let another GPU SKU's calibration through, retargeted to ``sku_id``
    (calibration_model.retarget)."""
    from predictor.calibration_model import Calibration, retarget

    cal = Calibration.load(path)
    sku_id = sku_id or cal.sku
    warnings = check_calibration_host(cal, sku_id, force=force, recorded_host_priced=recorded_host_priced)
    if cal.sku != sku_id:  # forced: check_calibration_host refuses it otherwise
        cal = retarget(cal, sku_id)
    return cal, warnings


def calibration_for_command(path, sku: str | None, *, force: bool = False, recorded_host_priced: bool = False):
    """``calibration_for`` as the commands use it: ``sku`` as the user named it (an id or alias; None:
    the calibration's own), each warning printed on stderr."""
    cal, warnings = calibration_and_warnings(path, sku, force=force, recorded_host_priced=recorded_host_priced)
    print_warnings(warnings)
    return cal


def calibration_and_warnings(path, sku: str | None, *, force: bool = False, recorded_host_priced: bool = False):
    """``calibration_for_command`` without the printing: for a command that validates the rest of its
    input first, so that bad input is one line, not a warning and then the error."""
    from gpubench import skus as sku_table

    return calibration_for(path, sku_table.get(sku).id if sku else None, force=force,
                           recorded_host_priced=recorded_host_priced)


def print_warnings(warnings: list[str]) -> None:
    import sys

    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
