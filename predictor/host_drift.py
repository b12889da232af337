"""How far this host's memory speed is, right now, from the phase a CPU calibration was taken in.

Why: on a shared VM the same host streams memory at different rates from one hour or day to the
next, and a CPU step is mostly weight streaming. Two probe runs of one VM a day apart timed the
probes' cold reference GEMV (1024 x 1024, M = 1, weights from a pool twice the last-level cache)
at 309 and 266 us, and each calibration then mispredicted the other day's step rows by 23-33 %
(held-out decode MAPE), against 7-9 % for the rows taken with it. The calibration keeps its probe
run's median reference (``cpu_ops[dtype].phase_spread.reference_median_s``); timing the same GEMV
now, the same way (one thread, thread CPU time, a fresh cold weight each repetition), says whether
the host is still in that phase. Nothing is rescaled: the reference tracks the host's drift only
in part (scaling each prediction by it took those cross-day errors to 12-23 %, and on rows taken
with their probe run it made them no better), so a drift is reported, and the fix is a new probe
run. The probe run's own p10..p90 of the reference is shown beside it for scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import ConfigError

# Reference GEMVs timed now: ROUNDS rounds of the probes' repetitions (7 each, the first of a round
# discarded as the probes do), about two seconds in all. On the 2-vCPU VM one round's median moves
# by 10-15 % from one round to the next (the host's own second-scale phase), so one second's worth
# read 266 to 313 us in three calls a minute apart.
ROUNDS = 100
# Beyond this the host is called drifted: a CPU step is mostly weight streaming, so its time moves
# about one for one with the reference, and 10 % is as much as the predictor's own held-out error.
# (The same VM drifted by 14 % between two days, and by 10-20 % within minutes on a busy afternoon.)
DRIFT_TOLERANCE = 0.10


@dataclass(frozen=True)
class HostDrift:
    """The reference GEMV now against the calibration's probe run (seconds, medians)."""

    dtype: str
    reference_now_s: float
    reference_calibration_s: float
    num_timed: int
    # The probe run's own spread of the reference (p10, p90 over its median), for scale.
    calibration_p10: float = 1.0
    calibration_p90: float = 1.0

    @property
    def ratio(self) -> float:
        """Now / then: above 1 the host streams slower than when it was calibrated."""
        return self.reference_now_s / self.reference_calibration_s

    @property
    def drifted(self) -> bool:
        return abs(self.ratio - 1.0) > DRIFT_TOLERANCE

    def line(self) -> str:
        speed = "slower" if self.ratio > 1 else "faster"
        return (f"host drift ({self.dtype}): the probes' cold reference GEMV takes {self.reference_now_s * 1e6:.0f} us "
                f"now against {self.reference_calibration_s * 1e6:.0f} us in the calibration's probe run "
                f"(x{self.ratio:.3f}: memory {abs(self.ratio - 1):.0%} {speed}; the probe run itself spanned "
                f"x{self.calibration_p10:.2f}..x{self.calibration_p90:.2f})")

    def warning(self) -> str:
        return (f"this host's memory phase is {abs(self.ratio - 1):.0%} off the calibration's (more than "
                f"{DRIFT_TOLERANCE:.0%}): CPU step predictions may be off by about as much; run "
                "`gpubench run --device cpu` and `gpubench fit` again to calibrate the host as it is now")

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "reference_now_s": self.reference_now_s,
                "reference_calibration_s": self.reference_calibration_s, "ratio": self.ratio,
                "num_timed": self.num_timed, "drifted": self.drifted, "tolerance": DRIFT_TOLERANCE,
                "calibration_p10": self.calibration_p10, "calibration_p90": self.calibration_p90}


def calibration_phase(cal, dtype: str) -> dict:
    """The probe run's reference GEMV a CPU calibration recorded: ``reference_median_s`` and its
    ``p10``/``p90`` over that median (ConfigError without them)."""
    if cal.backend != "cpu":
        raise ConfigError("--check-drift is for CPU calibrations (a GPU's probes time no reference GEMV)")
    tables = cal.cpu_ops.get(dtype)
    spread = (tables.d.get("phase_spread") or {}) if tables is not None else {}
    ref = spread.get("reference_median_s")
    if not ref or not np.isfinite(ref) or ref <= 0:
        raise ConfigError(f"the calibration records no reference GEMV for {dtype} (fit it from a run with the "
                          "torch_ops probe)")
    return {"reference_median_s": float(ref), "p10": float(spread.get("p10", 1.0)), "p90": float(spread.get("p90", 1.0))}


def measure_drift(cal, dtype: str, rounds: int = ROUNDS) -> HostDrift:
    """Time the probes' cold reference GEMV now, one thread, and compare it with ``cal``'s."""
    import torch

    from gpubench.backends.cpu.probes.torch_ops_measure import reference_times
    from predictor.profile import reference_pool_elements

    then = calibration_phase(cal, dtype)
    pool = reference_pool_elements("cpu")
    assert pool is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the probes time it: one thread's CPU time
    try:
        times = [t for _ in range(rounds) for t in reference_times(dtype, pool)[1:]]
    finally:
        torch.set_num_threads(threads)
    return HostDrift(dtype=dtype, reference_now_s=float(np.median(times)),
                     reference_calibration_s=then["reference_median_s"], num_timed=len(times),
                     calibration_p10=then["p10"], calibration_p90=then["p90"])
