"""CUDA L2: read bandwidth against working set, warm and cold."""
from __future__ import annotations

import math

from common import errors
from gpubench.backends.base import MeasurementSpec, ProbeConfig
from gpubench.backends.cuda.extension import NUM_WARMUP
from gpubench.backends.cuda.probes.common import CudaProbe, GiB, KiB, MiB, _geometric, device_props, probe_row
from gpubench.backends.probe_common import opt


class L2Probe(CudaProbe):
    """Read bandwidth against working set, 64 KiB .. 8x L2 by x1.25 (4x L2 by x2 with --quick).

    Loads bypass L1 (``ld.global.cg``). ``cold``: before each timed single pass a clean buffer of
    >= 2x L2 is read, so the pass finds none of the set in L2 and no dirty line to write back.
    ``warm``: after an untimed pass, each repetition makes ``passes`` passes over the same set
    (about 4 GiB read, 512 MiB with --quick; the cache is not flushed on purpose). --quick sweeps
    to 4x L2. Bytes = bytes read per repetition. Each repetition's sum is checked.
    """

    name = "l2"
    description = "L2/DRAM read bandwidth vs working set, cold (flushed) and warm"
    timer = "cuda_events"
    time_budget_s = 300.0
    MODES = ("cold", "warm")

    def plan(self, cfg: ProbeConfig) -> list[MeasurementSpec]:
        p = device_props(cfg)
        l2 = int(p.get("l2_bytes") or 0)
        if l2 <= 0:
            raise errors.ConfigError("l2: the device reported no L2 size (cudaDevAttrL2CacheSize)")
        lo = opt(cfg, "l2", "min_bytes", 64 * KiB)
        # --quick caps the sweep at 4x L2 and 512 MiB read per warm repetition: the full settings read
        # ~780 GB on an H200 (100-150 s), more than a short device window can spend on one probe.
        hi = opt(cfg, "l2", "max_bytes", (4 if cfg.quick else 8) * l2)
        warm_bytes = opt(cfg, "l2", "warm_bytes_per_rep", (GiB // 2) if cfg.quick else 4 * GiB)
        reps = max(10, opt(cfg, "l2", "num_reps", cfg.num_reps))
        specs = []
        for ws in _geometric(lo, max(lo, hi), 2.0 if cfg.quick else 1.25, align=4 * KiB):
            for mode in self.MODES:
                passes = 1 if mode == "cold" else max(2, math.ceil(warm_bytes / ws))
                specs.append(MeasurementSpec(
                    key=f"l2_{mode}_fp64_{ws}", params={"mode": mode, "bytes": ws, "passes": passes, "num_reps": reps},
                    label=f"{mode} {ws / MiB:.2f} MiB"))
        return specs

    def measure(self, spec: MeasurementSpec) -> dict:
        p = spec.params
        r = self.ext.l2(self.backend.index, p["bytes"], p["mode"], p["passes"], p["num_reps"], NUM_WARMUP)
        l2 = int(r["l2_bytes"])
        return probe_row(spec.key, r, "cuda_events", mode=p["mode"], dtype="fp64", working_set_bytes=p["bytes"],
                    bytes=int(r["bytes"]), passes=int(r["passes"]), l2_bytes=l2,
                    working_set_over_l2=p["bytes"] / l2 if l2 else None, flush_bytes=int(r["flush_bytes"]),
                    grid=int(r["grid"]), block=int(r["block"]))
