"""The backend and probe contract every device implements: one backend per device, probes that
only plan and measure, and one generic runner for all of them (BabelStream's layout).

A **backend** (``cpu``, ``cuda``) says what the device is (``device_info`` for the manifest), how to
read its telemetry (``telemetry_source``) and which probes it offers (``probes``). A **probe** only
knows how to plan its measurements and take one; the runner (``gpubench.runner``, with its worker
process ``gpubench.probe_worker``) does everything else generically, for every backend:

    plan(cfg) ─► [MeasurementSpec(key, params), ...]
        for each spec whose key is not yet in <probe>.jsonl (resume):
            with Sampler(backend.telemetry_source()):       # telemetry around the measurement
                fields = probe.measure(spec)                # times_s + probe fields + valid
            row = {key, probe, backend, timer} | fields | stats.summarize(times_s)
                  | probe.derive(row, summary) | telemetry.aggregate(...)
            RunWriter.append(probe, row)                    # flushed + fsynced
        manifest.probes[name] = done | failed(reason) | skipped(reason)

Synchronization rule: ``measure`` is blocking. Every time it returns was taken on the device's own
clock around the timed region only (``steady_clock`` on the CPU, CUDA events on a GPU), after the
work finished; the runner never times anything itself.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpubench.telemetry import TelemetrySource


@dataclass(frozen=True)
class ProbeConfig:
    """What a probe's ``plan`` may depend on.

    Attributes:
        quick: coarser sweeps, fewer repetitions (``gpubench run --quick``); must stay valid figures.
        num_reps: repetitions per measurement (>= 10 by default; the first is discarded by the stats).
        device: the backend's ``device_info()`` (properties read at run time: caches, SM count, ...).
        options: probe-specific overrides (tests use them for tiny sizes), e.g. ``{"max_bytes": ...}``.
    """

    quick: bool = False
    num_reps: int = 10
    device: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MeasurementSpec:
    """One measurement a probe will take.

    Attributes:
        key: stable id, unique within the probe, ``<family>_<variant>_<dtype>_<size>`` style
            (``stream_triad_fp64_268435456``). ``--resume`` skips keys already on disk, so a key
            must be the same across runs with the same config.
        params: probe-specific arguments passed back to ``measure`` (sizes, dtype, mode, ...).
        label: short human text for progress bars.
        row_keys: when one measurement yields several rows (STREAM's four kernels come from one
            run of the kernel sequence, so its golden check covers all four), the keys of those
            rows; empty means the single row ``key``. ``--resume`` skips the spec only when every
            row key is on disk, and appends only the missing rows.
    """

    key: str
    params: dict = field(default_factory=dict)
    label: str = ""
    row_keys: tuple = ()

    @property
    def keys(self) -> tuple:
        """The row keys this measurement writes."""
        return self.row_keys or (self.key,)


class Probe(abc.ABC):
    """One probe family (``stream``, ``l2``, ``launch``, ``peak``, ``gemm``) on one backend.

    Subclasses set ``name`` (the ``<probe>.jsonl`` stem), ``description`` and ``timer``
    (``steady_clock``, ``cuda_events`` or ``host_clock``), and may set ``time_budget_s``: the runner
    kills the worker running a probe that overruns it and records the probe as failed. A probe
    too slow for a quick sanity run sets ``quick_leaves_out`` to the sentence saying what a run
    without it lacks: ``--quick`` then skips it unless ``--probes`` names it.
    """

    name: str = ""
    description: str = ""
    timer: str = "steady_clock"
    time_budget_s: float = 600.0
    quick_leaves_out: str = ""

    def supported(self, backend: "Backend") -> tuple[bool, str]:
        """(True, "") if the probe can run on this backend, else (False, reason).

        An unsupported probe is recorded as ``skipped`` with the reason, never as failed.
        """
        return True, ""

    @abc.abstractmethod
    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        """The measurements to take, in order. Pure: no device work, no timing."""

    def notes(self, cfg: ProbeConfig) -> list[str]:
        """Lines for the manifest's probe entry: parts left out and why (``torch not importable``)."""
        return []

    @abc.abstractmethod
    def measure(self, spec: MeasurementSpec) -> dict[str, Any] | list[dict[str, Any]]:
        """Take one measurement (blocking) and return its row fields.

        A spec with ``row_keys`` returns a list of row dicts, each with its ``key``.

        Must return ``times_s`` (every repetition in seconds, raw, first included) and ``valid``
        (the golden-value / checksum check passed), plus the probe-specific fields of
        docs/results-schema.md (``bytes`` or ``flops`` per repetition when the probe has them).
        A failed check returns ``valid=False`` (and ideally ``invalid_reason``); it never raises,
        so the row is kept and reported as invalid.
        """

    def derive(self, row: dict, summary: dict) -> dict[str, Any]:
        """Fields computed from the measured row and its ``stats.summarize`` output.

        Default: GB/s from ``bytes`` and TFLOP/s from ``flops`` at the median and min time.
        """
        from common.stats import rates

        return rates(summary, bytes_moved=row.get("bytes"), flops=row.get("flops"))


class Backend(abc.ABC):
    """A device that probes run on.

    Attributes:
        name: ``cpu`` or ``cuda``.
        index: device index (``None`` for the CPU).
    """

    name: str = ""
    index: int | None = None

    @property
    def spec(self) -> str:
        """The ``--device`` string that recreates this backend in a worker process (``cpu``, ``cuda:0``)."""
        return self.name if self.index is None else f"{self.name}:{self.index}"

    @abc.abstractmethod
    def device_name(self) -> str:
        """Human name read from the device (CPU model name, GPU name from the driver)."""

    @abc.abstractmethod
    def device_info(self) -> dict:
        """The manifest's ``device`` field: ``{backend, name, index, driver, cuda_runtime, properties}``.

        ``properties`` are read at run time (docs/results-schema.md lists them per backend).
        """

    @abc.abstractmethod
    def telemetry_source(self) -> "TelemetrySource":
        """A fresh telemetry source for this device (fields it cannot read are None with a reason)."""

    @abc.abstractmethod
    def probes(self) -> dict[str, Probe]:
        """Probe name -> probe, in the order a full run takes them."""

    def default_sku(self) -> str:
        """The SKU id ``gpubench run`` uses when ``--sku`` is not given (``cpu``, or the detected GPU)."""
        return self.name

    def hidden_probes(self) -> dict[str, Probe]:
        """Debug probes (``debug_*``) not in a default run; only run when named in ``--probes``."""
        return {}
