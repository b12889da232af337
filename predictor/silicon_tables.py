"""Measured GPU kernel latencies from the ``aiconfigurator-core`` wheel, read where pip installed them.

NVIDIA's aiconfigurator collectors timed kernels on real GPUs and ship the results as parquet tables
inside that wheel (Apache-2.0), under ``aiconfigurator_core/systems/data/<system>/<op>/<framework>/
<version>/``. gpubench reads them from the installed package (the optional extra ``reference``:
``pip install 'gpubench[reference]'``) and never copies them into its own tree. The package is not
imported (its estimator is not needed to read a parquet file); only its location is looked up.

What is read, and how it is filtered (latencies are in milliseconds in the tables, seconds here):

- GEMM: ``gemm/<fw>/<ver>/gemm_perf.parquet``, rows with ``gemm_dtype == "bfloat16"`` (the plain bf16
  linear of that framework: ``torch.nn.functional.linear`` under vLLM 0.24, ``vllm_default`` under
  0.14, SGLang's and TensorRT-LLM's own labels); (m, n, k) -> latency.
- Decode attention: ``attention/.../generation_attention_perf.parquet``; prefill attention:
  ``context_attention_perf.parquet``. Full attention only (``window_size == 0``), bf16 activations
  and KV cache, beam width 1, and one kernel source per table: the one with the most rows, which is
  the backend the collectors swept fully and the one that framework runs by default on that GPU (FA3
  on Hopper, FlashAttention 2 on Ampere and Ada, FlashInfer's TRT-LLM decode and prefill kernels on
  Blackwell; the others are partial sweeps: FA4, Triton, FlashInfer on Ada).
- The newest version folder of the framework, unless one is named.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from common.errors import ConfigError

WHEEL = "aiconfigurator-core"
PACKAGE = "aiconfigurator_core"
INSTALL_HINT = "pip install 'gpubench[reference]' (the aiconfigurator-core wheel, ~80 MB, from PyPI)"

# aiconfigurator system folder -> gpubench SKU id. A system without one (B60, an Intel GPU) is listed by
# `gpubench silicon --list` but cannot be priced; L4 ships no tables in 0.12.0.
SYSTEM_SKUS = {"a100_sxm": "a100-80", "h100_sxm": "h100-sxm", "h200_sxm": "h200", "b200_sxm": "b200", "l40s": "l40s",
               "b300_sxm": "b300", "gb200": "gb200", "gb300": "gb300", "rtx_pro_6000_server": "rtx-pro-6000"}
FRAMEWORKS = ("vllm", "sglang", "trtllm")
MS = 1e-3


def data_root() -> Path:
    """The wheel's ``systems/data`` folder, or a one-line ConfigError naming the install command."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the measured kernel tables are not installed: {INSTALL_HINT}")
    root = Path(next(iter(spec.submodule_search_locations))) / "systems" / "data"
    if not root.is_dir():
        raise ConfigError(f"{PACKAGE} at {root.parent.parent} has no systems/data folder; reinstall it: {INSTALL_HINT}")
    return root


def wheel_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(WHEEL)
    except PackageNotFoundError:
        return "unknown"


def _version_key(v: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (1, Version(v))
    except InvalidVersion:
        return (0, Version("0"))


@dataclass(frozen=True)
class TableSet:
    """The tables of one system under one framework version (paths; read lazily)."""

    system: str
    framework: str
    version: str
    gemm: Path | None
    decode: Path | None
    prefill: Path | None

    @property
    def sku(self) -> str | None:
        return SYSTEM_SKUS.get(self.system)

    @property
    def label(self) -> str:
        return f"{self.system}/{self.framework}/{self.version}"


def systems(root: Path | None = None) -> list[str]:
    """Systems with at least one table."""
    root = root or data_root()
    return sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.rglob("*.parquet")))


def _newest(folder: Path, version: str | None, table: str) -> str | None:
    """The newest version folder holding ``table`` (a folder may hold only a reuse.yaml that points at
    another version's data, e.g. TensorRT-LLM 1.3.0rc23's GEMMs on B200: skipped, its data is there)."""
    if not folder.is_dir():
        return None
    versions = [p.name for p in folder.iterdir() if (p / table).is_file()]
    if version is not None:
        return version if version in versions else None
    return max(versions, key=_version_key) if versions else None


def table_set(system: str, framework: str = "vllm", version: str | None = None, *, root: Path | None = None) -> TableSet:
    """The GEMM and attention tables of ``system`` under ``framework`` (newest version unless named).
    The GEMM and attention versions are chosen separately (A100's vLLM tables are 0.14 for both;
    B200 has attention under 0.22 and 0.24): each the newest the folder has."""
    root = root or data_root()
    if framework not in FRAMEWORKS:
        raise ConfigError(f"unknown framework '{framework}' (choose from: {', '.join(FRAMEWORKS)})")
    base = root / system
    if not base.is_dir():
        raise ConfigError(f"no measured tables for system '{system}' (have: {', '.join(systems(root))})")
    gv = _newest(base / "gemm" / framework, version, "gemm_perf.parquet")
    av = _newest(base / "attention" / framework, version, "generation_attention_perf.parquet")
    gemm = base / "gemm" / framework / gv / "gemm_perf.parquet" if gv else None
    attn = base / "attention" / framework / av if av else None
    decode = attn / "generation_attention_perf.parquet" if attn else None
    prefill = attn / "context_attention_perf.parquet" if attn else None
    exists = lambda p: p if p is not None and p.is_file() else None  # noqa: E731
    return TableSet(system, framework, gv or av or "-", exists(gemm), exists(decode), exists(prefill))


def read_gemm(ts: TableSet) -> pd.DataFrame:
    """bf16 GEMM rows: m, n, k, latency_s (the median of duplicates, should a grid point repeat)."""
    if ts.gemm is None:
        return pd.DataFrame(columns=["m", "n", "k", "latency_s"])
    df = pd.read_parquet(ts.gemm, columns=["gemm_dtype", "m", "n", "k", "latency"])
    df = df[df["gemm_dtype"] == "bfloat16"]
    out = df.groupby(["m", "n", "k"], as_index=False)["latency"].median()
    out["latency_s"] = out.pop("latency") * MS
    return out.astype({"m": "int64", "n": "int64", "k": "int64"})


def read_attention(path: Path | None) -> tuple[pd.DataFrame, str | None]:
    """Full-attention bf16 rows of one attention table, of its preferred kernel source:
    (batch_size, isl, step, num_heads, num_key_value_heads, head_dim, latency_s), and that source."""
    cols = ["batch_size", "isl", "step", "num_heads", "num_key_value_heads", "head_dim", "latency_s"]
    if path is None:
        return pd.DataFrame(columns=cols), None
    df = pd.read_parquet(path)
    keep = (df["attn_dtype"] == "bfloat16") & (df["kv_cache_dtype"] == "bfloat16")
    for column, full in (("window_size", 0), ("beam_width", 1)):  # older tables (A100's 0.14) lack both
        if column in df:
            keep &= df[column] == full
    df = df[keep]
    counts = df["kernel_source"].value_counts()
    source = str(max(counts.index, key=lambda s: (counts[s], s))) if len(counts) else None
    df = df[df["kernel_source"] == source].copy()
    df["latency_s"] = df["latency"] * MS
    keys = cols[:-1]
    return df.groupby(keys, as_index=False)["latency_s"].median()[cols], source
