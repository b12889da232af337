"""The results store: one run = one directory ``<root>/<sku>/<UTC timestamp>-<host>/``.

Layout::

    manifest.json     schema version, package version, git commit, command line, host, device,
                      SKU, device properties read at run time, probe list with status
    <probe>.jsonl     one flat JSON object per measurement, appended and flushed as it is taken

Rows of every probe share the fields listed in docs/results-schema.md (``key`` identifies a
measurement within its probe; ``--resume`` skips keys already present).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common.errors import ResultsFormatError
from common.jsonio import iter_jsonl, read_json
from gpubench import __version__

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
PROBE_STATUSES = ("pending", "running", "done", "failed", "skipped")


def utc_stamp(now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return now.strftime("%Y%m%dT%H%M%SZ")


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path or os.path.dirname(__file__),
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _atomic_write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


class RunWriter:
    """Appends rows to a run directory; every row is flushed and fsynced before append() returns."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.manifest = read_manifest(self.run_dir)

    @classmethod
    def create(cls, root: str | os.PathLike, *, sku: str, host: str, device: dict, probes: list[str],
               argv: list[str] | None = None, extra: dict | None = None) -> "RunWriter":
        run_dir = Path(root) / sku / f"{utc_stamp()}-{host}"
        n = 1
        while run_dir.exists():
            n += 1
            run_dir = Path(root) / sku / f"{utc_stamp()}-{host}-{n}"
        run_dir.mkdir(parents=True)
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "package_version": __version__,
            "git_commit": git_commit(),
            "command": list(argv if argv is not None else sys.argv),
            "created_utc": utc_stamp(),
            "host": host,
            "sku": sku,
            "device": device,
            "probes": {p: {"status": "pending"} for p in probes},
        }
        if extra:
            manifest.update(extra)
        _atomic_write_json(run_dir / MANIFEST, manifest)
        return cls(run_dir)

    def path(self, probe: str) -> Path:
        return self.run_dir / f"{probe}.jsonl"

    def append(self, probe: str, row: dict) -> None:
        line = json.dumps(row, default=_json_default, allow_nan=True)
        with open(self.path(probe), "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def measured_keys(self, probe: str) -> set[str | None]:
        """Keys of complete rows already on disk; a torn last line (killed mid-write) is dropped."""
        p = self.path(probe)
        if not p.exists():
            return set()
        self._drop_torn_tail(p)
        return {r.get("key") for r in read_rows(p)}

    @staticmethod
    def _drop_torn_tail(p: Path) -> None:
        data = p.read_bytes()
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            with open(p, "r+b") as f:
                f.truncate(cut)

    def set_probe_status(self, probe: str, status: str, reason: str | None = None, **info) -> None:
        if status not in PROBE_STATUSES:
            raise ValueError(f"status {status!r} not in {PROBE_STATUSES}")
        self.manifest = read_manifest(self.run_dir)
        entry = self.manifest["probes"].setdefault(probe, {})
        entry["status"] = status
        entry["updated_utc"] = utc_stamp()
        if reason is not None:
            entry["reason"] = reason
        elif "reason" in entry and status in ("running", "done"):
            entry.pop("reason")
        entry.update(info)
        _atomic_write_json(self.run_dir / MANIFEST, self.manifest)


def read_manifest(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / MANIFEST
    if not Path(run_dir).is_dir():
        raise ResultsFormatError(f"{run_dir}: not a run directory")
    if not path.exists():
        raise ResultsFormatError(f"{path}: missing (not a gpubench run directory)")
    m = read_json(path, error=ResultsFormatError, what="a run manifest")
    if not isinstance(m, dict):
        raise ResultsFormatError(f"{path}: a manifest is a JSON object, got {type(m).__name__}")
    for k in ("schema_version", "probes", "sku"):
        if k not in m:
            raise ResultsFormatError(f"{path}: manifest has no '{k}' field")
    if isinstance(m["schema_version"], bool) or not isinstance(m["schema_version"], int):
        raise ResultsFormatError(f"{path}: field 'schema_version' must be an integer, got {m['schema_version']!r}")
    if not isinstance(m["sku"], str) or not m["sku"].strip():
        raise ResultsFormatError(f"{path}: field 'sku' must be a SKU id, got {m['sku']!r}")
    from common.errors import UnknownSKUError
    from gpubench import skus

    try:
        skus.get(m["sku"])
    except UnknownSKUError as e:
        raise ResultsFormatError(f"{path}: field 'sku': {e}") from None
    if "device" in m and not isinstance(m["device"], dict):
        raise ResultsFormatError(f"{path}: field 'device' must be an object, got {type(m['device']).__name__}")
    if not isinstance(m["probes"], dict):
        raise ResultsFormatError(f"{path}: field 'probes' must be an object, got {type(m['probes']).__name__}")
    if m["schema_version"] > SCHEMA_VERSION:
        raise ResultsFormatError(f"{path}: schema_version {m['schema_version']} is newer than this gpubench ({SCHEMA_VERSION})")
    return m


def read_rows(path: str | os.PathLike, *, torn_tail_ok: bool = False) -> list[dict]:
    """Rows of one JSONL file; ResultsFormatError naming file and line for anything malformed.
    ``torn_tail_ok``: a last line without its newline (a writer killed mid-row) is left out."""
    rows = []
    seen: dict[str, int] = {}
    numeric: dict[str, int] = {}
    for lineno, row in iter_jsonl(path, error=ResultsFormatError, objects_only=True, torn_tail_ok=torn_tail_ok):
        if "key" not in row:
            raise ResultsFormatError(f"{path}:{lineno}: row has no 'key' field")
        if row["key"] in seen:
            # Two writers on one run (e.g. two `run --resume`) measured it twice: figures would
            # silently average over both.
            raise ResultsFormatError(f"{path}:{lineno}: row {row['key']!r} duplicates line {seen[row['key']]} "
                                     "(was the run resumed twice at once?); remove one of them")
        seen[row["key"]] = lineno
        for field, value in row.items():  # a number in one row is a number (or null) in every row
            is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
            if is_num:
                numeric.setdefault(field, lineno)
            elif value is not None and field in numeric:
                raise ResultsFormatError(f"{path}:{lineno}: field {field!r} must be a number, got {value!r:.60} "
                                         f"(a number on line {numeric[field]})")
        rows.append(row)
    return rows


@dataclass
class Run:
    """A loaded run: the manifest and one DataFrame per probe that wrote rows."""

    run_dir: Path
    manifest: dict
    frames: dict

    def __getitem__(self, probe: str):
        return self.frames[probe]

    def __contains__(self, probe: str) -> bool:
        return probe in self.frames

    @property
    def sku(self) -> str:
        return self.manifest["sku"]

    @property
    def backend(self) -> str:
        return self.manifest.get("device", {}).get("backend", "cpu")


def load(run_dir: str | os.PathLike) -> Run:
    """Load a run directory into pandas DataFrames (one per ``<probe>.jsonl``)."""
    import pandas as pd

    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    frames = {probe: pd.DataFrame(read_rows(p)) for probe, p in rows_files(run_dir).items()}
    return Run(run_dir=run_dir, manifest=manifest, frames=frames)


def rows_files(run_dir: str | os.PathLike) -> dict[str, Path]:
    """Each probe's rows file in a run directory: ``<probe>.jsonl``, or ``<probe>.jsonl.gz`` as a
    committed run keeps its large ones (``gzip -9``). A probe with both is refused: which one
    holds its rows would be a guess."""
    files: dict[str, Path] = {}
    for p in sorted(Path(run_dir).glob("*.jsonl")) + sorted(Path(run_dir).glob("*.jsonl.gz")):
        probe = p.name.removesuffix(".gz").removesuffix(".jsonl")
        if probe in files:
            raise ResultsFormatError(f"{run_dir}: probe {probe!r} has both {files[probe].name} and {p.name}; "
                                     "keep one")
        files[probe] = p
    return files


def load_many(run_dirs) -> Run:
    """Several runs of one device as one: each probe's rows from the run that measured it.

    A GPU session may be cut short, or one probe may fail on one machine and pass on another of the
    same kind: ``gpubench fit A B`` then takes, say, stream and l2 from B and the rest from A. The
    runs must name the same SKU, backend and device (a GPU's name, a CPU's model); a probe with rows
    in two of them is refused rather than mixed, so every fitted parameter has one source run. The
    merged manifest is the first run's, with each probe's entry from the run whose rows it holds and
    ``merged_from`` listing the runs; ``run_dir`` is a label naming them all.
    """
    seen: dict = {}
    for d in run_dirs:
        key = Path(d).resolve()
        if key in seen:
            raise ResultsFormatError(f"{d}: given twice (as {seen[key]} too); pass each run once")
        seen[key] = d
    runs = [load(d) for d in run_dirs]
    if len(runs) == 1:
        return runs[0]
    first = runs[0]

    def identity(run: Run) -> tuple:
        dev = run.manifest.get("device") or {}
        props = dev.get("properties") or {}
        return (run.sku, dev.get("backend", "cpu"), dev.get("name") or props.get("model_name"))

    for run in runs[1:]:
        if identity(run) != identity(first):
            raise ResultsFormatError(f"{run.run_dir}: measured {identity(run)[2]!r} (SKU {run.sku}), but "
                                     f"{first.run_dir} measured {identity(first)[2]!r} (SKU {first.sku}); "
                                     "runs fitted together must be of one device")
    frames: dict = {}
    owner: dict = {}
    for run in runs:
        for probe, frame in run.frames.items():
            if not len(frame):
                continue
            if probe in owner:
                raise ResultsFormatError(f"probe '{probe}' has rows in both {owner[probe].run_dir} and {run.run_dir}; "
                                         "pass runs that each hold different probes")
            frames[probe], owner[probe] = frame, run
    manifest = json.loads(json.dumps(first.manifest))
    for probe, run in owner.items():
        manifest["probes"][probe] = run.manifest["probes"].get(probe, {})
    manifest["merged_from"] = [str(r.run_dir) for r in runs]
    return Run(run_dir=Path(" + ".join(str(r.run_dir) for r in runs)), manifest=manifest, frames=frames)
