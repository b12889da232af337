"""Output directories that two runs cannot share by accident, and files that are whole or absent.

``locked(dir)``: an advisory lock (``fcntl.flock`` on ``dir/.gpubench.lock``, which records the
holder's PID and command) held while a command writes into ``dir``. A second command on the same
directory gets one line naming the holder instead of interleaving its rows with the first's (two
sweeps on one ``--out`` used to lose finished cells; two ``run --resume`` doubled rows). The lock
goes away with the process, so a killed run never leaves a stale one.

``write_command(dir, command)``: the directory's ``COMMAND`` file says how to regenerate it (its
first line); a rerun of that same command keeps the notes below it (when and at what load the
committed figures were taken), a different command replaces the file.

``refuse_committed(path, option)``: a path that holds files a git checkout tracks (the repository's
own committed results) is refused unless ``GPUBENCH_REGENERATE=1`` says the user means to
regenerate them, so re-running a documented command cannot silently rewrite committed figures (or,
for `run --out`, add a run among them: the committed runs' COMMAND lines put the env in front).

``write_text_atomic(path, text)``: a temporary file in the same directory, fsync, rename, fsync of
the directory: a crash or a full disk leaves the old file or the new one, never a truncated one.
Missing parent directories of the file are created (an output path like ``runs/c.json`` works in a
fresh directory, as ``locked`` creates an output directory's parents).

``check_output_file(path, option)``: before any work, a ConfigError (one line) when a file output
could not be written afterwards (a directory there, a file where a parent directory should be, no
write permission); missing parents are fine, the writer creates them. Nothing is created here, so
refused or failed commands leave nothing behind; input paths never go through it.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path
from typing import Iterator

from common.errors import ConfigError

LOCK_NAME = ".gpubench.lock"
REGENERATE_ENV = "GPUBENCH_REGENERATE"


@contextlib.contextmanager
def locked(directory: str | os.PathLike, what: str = "output directory") -> Iterator[Path]:
    """Hold ``directory``'s lock (creating the directory) for the body; ConfigError if another
    process holds it."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{d}: exists and is not a directory (the {what} must be one)")
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
            raise ConfigError(f"{d}: {what} in use by {holder}; wait for it to finish or use another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"PID {os.getpid()} ({' '.join(sys.argv[:3])})\n".encode(), 0)
        yield d
    finally:
        os.close(fd)  # releases the lock


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` (a file a command will write) checked before the command spends its time: ConfigError
    naming ``option`` when it could not be written later. Creates nothing."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{option} {p} is a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"{option} {p}: file is not writable")
    ancestor = p.parent
    while not ancestor.exists() and ancestor != ancestor.parent:  # the nearest existing ancestor
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"{option} {p}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {p}: directory {ancestor} is not writable")
    return p


def committed_files(path: str | os.PathLike) -> list[str]:
    """The files under ``path`` (a file or a directory) that a git checkout tracks; [] when the path
    does not exist, is in no checkout, or git is not installed."""
    import shutil
    import subprocess

    p = Path(path).absolute()
    if not p.exists() or shutil.which("git") is None:
        return []
    where = p if p.is_dir() else p.parent
    proc = subprocess.run(["git", "-C", str(where), "ls-files", "-z", "--full-name", "--", str(p)], capture_output=True, timeout=30)
    if proc.returncode != 0:  # not inside a work tree
        return []
    return [f for f in proc.stdout.decode("utf-8", "replace").split("\0") if f]


def refuse_committed(path: str | os.PathLike, option: str, hint: str | None = None) -> None:
    """ConfigError when ``path`` holds committed files and the user did not ask to regenerate them
    (``hint``: what to do instead, when the default advice does not fit the command)."""
    if os.environ.get(REGENERATE_ENV) == "1":
        return
    files = committed_files(path)
    if files:
        hint = hint or f"set {REGENERATE_ENV}=1 to regenerate them in place, or choose another path"
        raise ConfigError(f"{option} {path}: holds {len(files)} file(s) committed to this checkout (e.g. {files[0]}); "
                          f"{hint}")


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see the old content or the new, never a part."""
    if not isinstance(text, str):
        raise TypeError(f"write_text_atomic({path}): expected str, got {type(text).__name__}")
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """``write_text_atomic`` for bytes (a PNG, ...)."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a directory should be: name the path asked for
        raise OSError(e.errno, e.strerror or str(e), str(p)) from None
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:  # name the file the user asked for (a full disk's error names none)
        raise OSError(e.errno, e.strerror or str(e), str(p)) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(p.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return p


def write_command(directory: str | os.PathLike, command: str) -> Path:
    """Write ``directory/COMMAND`` for ``command``, keeping the file's notes when its first line is
    already this command (a rerun), replacing it otherwise."""
    path = Path(directory) / "COMMAND"
    command = command.strip()
    if path.is_file():
        existing = path.read_text(encoding="utf-8", errors="replace")
        if existing.splitlines()[:1] == [command]:
            return path
    return write_text_atomic(path, command + "\n")
