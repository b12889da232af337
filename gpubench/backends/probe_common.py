"""What the probes of both backends (CPU here, CUDA in ``gpubench.backends.cuda``) plan with:
sizes and host facts, ``--set`` options, and STREAM's byte counting."""
from __future__ import annotations

import math

# STREAM's work table: arrays moved per element (BabelStream's "weight"); bytes per repetition are
# these x n x the element size, the write-allocate read of the destination not counted (stream.c).
STREAM_KERNEL_ARRAYS = {"copy": 2, "scale": 2, "add": 3, "triad": 3}


def stream_bytes(kernel: str, n_elements: int, word_bytes: int = 8) -> int:
    """Bytes one repetition of a STREAM ``kernel`` moves (STREAM convention, no write-allocate)."""
    return STREAM_KERNEL_ARRAYS[kernel] * n_elements * word_bytes


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None if unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cold_pool_bytes(llc: int) -> int:
    """Bytes of the rotating pool cold-cache probes stream from: 2x the last-level cache (so no
    repetition finds its data in cache), at least 4 MiB, at most 1/16 of the free memory."""
    pool = max(2 * int(llc), 4 << 20)
    avail = mem_available_bytes()
    return min(pool, avail // 16) if avail else pool


def llc_bytes(device: dict) -> int:
    """The last-level cache size recorded in the manifest's device properties (read from sysfs)."""
    return int(device.get("properties", {}).get("llc_bytes") or 32 * 1024 * 1024)


def geometric(lo: float, hi: float, factor: float, align: int = 1) -> list[int]:
    """Sizes lo, lo*factor, ... up to and including hi (each rounded to `align`, deduplicated)."""
    if lo <= 0 or hi < lo or factor <= 1:
        raise ValueError(f"bad sweep lo={lo} hi={hi} factor={factor}")
    n = int(math.floor(math.log(hi / lo) / math.log(factor) + 1e-9))
    out: list[int] = []
    for i in range(n + 1):
        v = max(align, int(round(lo * factor**i / align)) * align)
        if not out or v > out[-1]:
            out.append(v)
    top = max(align, int(hi) // align * align)
    if out[-1] < top:
        out.append(top)
    return out


# Every `--set PROBE.NAME=VALUE` a probe reads (CPU and CUDA backends): a misspelled key was
# ignored, so a run meant to be tiny measured at full size. Text options; the rest are numbers > 0.
SET_OPTIONS = {
    "stream": ("min_array_bytes", "max_array_bytes", "num_reps", "debug_corrupt"),
    "l2": ("min_bytes", "max_bytes", "factor", "flush_bytes", "warm_bytes_per_rep", "num_reps"),
    "launch": ("max_count", "num_reps"),
    "peak": ("iters", "num_reps", "target_s"),
    "gemm": ("max_m", "max_square", "shape_scale", "num_reps", "budget_s", "droop_budget_s"),
    "torch_ops": ("size_scale", "max_m", "max_rows", "num_threads", "dtypes", "families", "linear_passes"),
    "vllm_ops": ("size_scale", "max_m", "max_batch", "num_threads", "dtypes", "engine_steps", "attention",
                 "linear_passes"),
}
TEXT_SET_OPTIONS = {"stream.debug_corrupt", "torch_ops.dtypes", "torch_ops.families", "vllm_ops.dtypes",
                    "vllm_ops.engine_steps", "vllm_ops.attention"}


def opt(cfg, probe: str, name: str, default):
    """cfg.options["<probe>.<name>"] (from `--set probe.name=value`) converted to default's type."""
    key = f"{probe}.{name}"
    if key not in cfg.options:
        return default
    v = cfg.options[key]
    if default is None or isinstance(v, type(default)):
        return v
    if isinstance(default, bool):
        return str(v).lower() in ("1", "true", "yes", "on")
    return type(default)(float(v)) if isinstance(default, int) else type(default)(v)


def dtypes_option(cfg, probe: str, allowed: tuple, default: str = "fp32") -> tuple:
    """``--set <probe>.dtypes=a,b`` as a tuple; ConfigError naming the choices for an unknown one."""
    dtypes = tuple(d for d in str(opt(cfg, probe, "dtypes", default)).split(",") if d)
    for d in dtypes:
        if d not in allowed:
            from common.errors import ConfigError

            raise ConfigError(f"{probe}.dtypes: unknown dtype '{d}' (choose from: {', '.join(allowed)})")
    return dtypes


def torch_unavailable_reason() -> str | None:
    """Why torch cannot be imported (a probe family that needs it is skipped with this), or None."""
    try:
        import torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: skip with its reason
        return f"torch not importable ({type(exc).__name__}: {exc})"
    return None
