"""What `gpubench run` shows on stderr while it measures: progress bars on a terminal, plain one-line
records elsewhere (a CI log, `2>log`), where bars redrawn with carriage returns show nothing useful.

Both take the runner's callbacks (gpubench.runner.execute): ``on_start(writer, line, todo)`` once,
then ``on_event(probe, event)`` with the workers' ``plan`` and ``row`` events and the runner's own
``probe_start`` and ``probe_end``. A plain record names the probe's place in the run (``[i/n]``,
over the probes left to run), the probe and its elapsed time::

    [1/7] stream: started, 24 measurements
    [1/7] stream: 12/24 measurements, 10.0 s
    [1/7] stream: done in 14.5 s, 24 rows
"""
from __future__ import annotations

import sys
import time

PLAIN_EVERY_S = 10.0  # a plain record of a probe's progress at most this often (start and end always)


class PlainProgress:
    """One line per record, flushed as written (no carriage returns, no colour)."""

    def __init__(self, stream=None, every_s: float = PLAIN_EVERY_S):
        self.stream = sys.stderr if stream is None else stream
        self.every_s = every_s
        self.todo: list[str] = []
        self.t0: dict[str, float] = {}
        self.done: dict[str, int] = {}
        self.total: dict[str, int] = {}
        self.last: dict[str, float] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def _say(self, name: str, text: str) -> None:
        where = f"[{self.todo.index(name) + 1}/{len(self.todo)}] " if name in self.todo else ""
        print(f"{where}{name}: {text}", file=self.stream, flush=True)

    def _elapsed(self, name: str) -> float:
        return time.monotonic() - self.t0.get(name, time.monotonic())

    def on_start(self, writer, line: str, todo: list) -> None:
        self.todo = list(todo)
        print(line, file=self.stream, flush=True)
        print(f"run dir: {writer.run_dir}", file=self.stream, flush=True)

    def on_event(self, name: str, ev: dict) -> None:
        kind = ev.get("event")
        now = time.monotonic()
        if kind == "probe_start":
            self.t0[name] = self.last[name] = now
        elif kind == "plan":
            self.done[name], self.total[name] = int(ev.get("done", 0)), int(ev.get("total", 0))
            already = f" ({self.done[name]} already on disk)" if self.done[name] else ""
            self._say(name, f"started, {self.total[name]} measurements{already}")
        elif kind == "row":
            self.done[name] = self.done.get(name, 0) + 1
            if now - self.last.get(name, now) >= self.every_s:
                self.last[name] = now
                bad = "" if ev.get("valid", True) else " (last one INVALID)"
                self._say(name, f"{self.done[name]}/{self.total.get(name, '?')} measurements, "
                                f"{self._elapsed(name):.1f} s{bad}")
        elif kind == "probe_end":
            status, reason = ev.get("status"), ev.get("reason")
            if status == "skipped":
                self._say(name, f"skipped - {reason}")
                return
            text = f"{status} in {ev.get('wall_s', self._elapsed(name)):.1f} s, {ev.get('num_rows', 0)} rows"
            self._say(name, text + (f" - {reason}" if reason else ""))


class BarProgress:
    """rich progress bars on the terminal's stderr, one per probe."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.err = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[label]}"), TimeElapsedColumn(), console=self.err)
        self.tasks: dict = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def on_start(self, writer, line: str, todo: list) -> None:
        self.err.print(line)
        self.err.print(f"run dir: {writer.run_dir}")

    def on_event(self, name: str, ev: dict) -> None:
        if ev.get("event") == "plan":
            self.tasks[name] = self.progress.add_task(name, total=ev["total"], completed=ev["done"], label="")
        elif ev.get("event") == "row" and name in self.tasks:
            self.progress.update(self.tasks[name], advance=1,
                                 label=("" if ev["valid"] else "INVALID ") + ev.get("label", ""))


def progress_for_stderr() -> PlainProgress | BarProgress:
    """Bars when stderr is a terminal, plain records otherwise."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return BarProgress() if tty else PlainProgress()
