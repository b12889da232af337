"""``gpubench view RUN_DIR [RUN_DIR ...]``: draw a replay's step log in the browser (or export one
HTML file); several runs are drawn side by side (one summary table, their curves overlaid)."""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from common import argtypes
from common.clihelp import DefaultsHelpFormatter
from common.errors import GpubenchError


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``view`` sub-command."""
    p = sub.add_parser(
        "view", help="draw a replay's step log (batch mix, KV pressure, preemptions, per-job timelines), "
                     "or several runs side by side",
        description="Serve a self-contained page on 127.0.0.1 that draws the step log of a "
                    "`gpubench replay --out DIR` directory, or export it as one HTML file. Given several "
                    "directories (e.g. FCFS and Continuum on the same jobs), the page shows their summary "
                    "metrics in one table and overlays their curves, each labelled by its run.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("run_dirs", metavar="RUN_DIR", type=Path, nargs="+",
                   help="replay output directories (summary.json, steps.csv, ...); two or more are compared")
    p.add_argument("--port", type=argtypes.port, default=0, help="port on 127.0.0.1 (0: a free one)")
    p.add_argument("--no-open", action="store_true", help="do not open a browser; just print the URL")
    p.add_argument("--export", metavar="FILE.html", type=Path, default=None,
                   help="write one HTML file with the data embedded, then exit (no server)")
    p.add_argument("--max-jobs", type=argtypes.positive_int, default=80, help="jobs drawn in the per-job timeline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export or serve; serving blocks until Ctrl-C."""
    from scheduling.viewer import data as data_mod
    from scheduling.viewer.server import ViewerServer, render_page

    if args.export is not None:
        page = render_page(data_mod.load_runs(args.run_dirs, max_jobs=args.max_jobs))
        args.export.parent.mkdir(parents=True, exist_ok=True)
        args.export.write_text(page, encoding="utf-8")
        print(f"wrote {args.export} ({len(page.encode('utf-8')) / 1e6:.1f} MB)")
        return 0
    if not 0 <= args.port <= 65535:
        raise GpubenchError(f"--port must be 0..65535, got {args.port}")
    try:
        server = ViewerServer(args.run_dirs, port=args.port)
    except OSError as err:
        raise GpubenchError(f"cannot listen on 127.0.0.1:{args.port} ({err.strerror or err})") from None
    # Ctrl-C must stop the server even when the shell started us with SIGINT ignored (a background
    # job of a non-interactive shell inherits SIG_IGN, and Python then installs no handler); SIGTERM
    # stops it the same way.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server.start()
    print(f"viewer for {', '.join(map(str, args.run_dirs))} at {server.url}  (Ctrl-C to stop)", flush=True)
    if not args.no_open:
        import webbrowser

        webbrowser.open(server.url)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 0
    finally:
        server.stop()
