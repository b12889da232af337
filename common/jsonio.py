"""Reading JSON and JSON Lines files: run rows, traces, SWE-smith trajectories, profile sidecars,
run manifests, calibrations and model configs alike.

One reader per format, so that every file a user hands gpubench fails the same way: what does not
parse is one error naming the file (and the line), raised as the caller's error class (a run's
rows raise ``ResultsFormatError``, a trace ``TraceFormatError``), never a traceback.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any, Iterator

from common.errors import ConfigError, GpubenchError


def iter_jsonl(path: str | os.PathLike, *, error: type[GpubenchError] = ConfigError, objects_only: bool = False,
               torn_tail_ok: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for every non-blank line of a JSONL file, read as it is iterated.

    Raises ``error`` with ``PATH:LINE: malformed JSON (...)`` for a line that does not parse,
    ``PATH:LINE: expected a JSON object, got T`` for a non-object when ``objects_only``, and
    ``PATH: not UTF-8 text (...)`` for bytes that are not UTF-8.

    A path ending in ``.gz`` is read through gzip (committed runs compress their large rows files).

    Args:
        torn_tail_ok: a last line without its newline is left out. Writers end every row with a
            newline, so such a line is one a killed writer did not finish.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="strict") as f:
            for lineno, line in enumerate(f, 1):
                if torn_tail_ok and not line.endswith("\n"):
                    return  # only the last line can lack its newline
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise error(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
                if objects_only and not isinstance(value, dict):
                    raise error(f"{path}:{lineno}: expected a JSON object, got {type(value).__name__}")
                yield lineno, value
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (gzip.BadGzipFile, EOFError) as e:
        raise error(f"{path}: not a complete gzip file ({e})") from None


def read_json(path: str | os.PathLike, *, error: type[GpubenchError] = ConfigError, what: str = "a JSON file") -> Any:
    """The value of a whole JSON file. Raises ``error`` with ``PATH:LINE: malformed JSON (...)`` when
    it does not parse and ``PATH: not WHAT (not UTF-8 text: ...)`` for bytes that are not UTF-8."""
    try:
        with open(path, encoding="utf-8", errors="strict") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not {what} (not UTF-8 text: {e.reason} at byte {e.start})") from None
