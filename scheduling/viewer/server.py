"""Serve (or export) the step-log viewer for one replay directory, or several side by side.

The page is one HTML file with its CSS and JavaScript inlined (no CDN: nothing outside is
reachable, and an exported file must work alone). Served, it fetches ``data.json`` from this
server; exported, the same JSON is embedded in a ``<script type="application/json">`` element.

Routes: ``/`` (the page), ``/data.json`` (what :func:`scheduling.viewer.data.load_run` returns),
``/summary.json`` (the run's own file; with several runs, a JSON list of their files). The server binds 127.0.0.1 only: a step log is nobody
else's business, and no page here needs to be reachable from another host.
"""
from __future__ import annotations

import json
import sys
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

from scheduling.viewer.data import load_runs

ASSETS = Path(__file__).parent
HOST = "127.0.0.1"


def render_page(data: dict[str, Any] | None = None) -> str:
    """The page: CSS and JS inlined; ``data`` embedded when given (export), else fetched (served)."""
    html = (ASSETS / "index.html").read_text(encoding="utf-8")
    css = (ASSETS / "viewer.css").read_text(encoding="utf-8")
    js = (ASSETS / "viewer.js").read_text(encoding="utf-8")
    # NOTE: "</" inside a <script> element would end it early; "<\/" is the same JSON string.
    payload = "" if data is None else json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return (html.replace("/*__CSS__*/", css)
                .replace("/*__DATA__*/", payload)
                .replace("/*__JS__*/", js.replace("</script", "<\\/script")))


def _as_list(run_dirs: str | Path | Sequence[str | Path]) -> list[Path]:
    return [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]


def export_html(run_dirs: str | Path | Sequence[str | Path], out_file: str | Path) -> Path:
    """Write one self-contained HTML file with the run's (or runs') data embedded."""
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_page(load_runs(_as_list(run_dirs))), encoding="utf-8")
    return out


# Host headers a page on 127.0.0.1 is reached by. Anything else is a DNS-rebinding attempt (a
# hostile page that points its own name at 127.0.0.1 to read the data from the user's browser).
ALLOWED_HOSTS = ("127.0.0.1", "localhost")
IDLE_TIMEOUT_S = 30  # a connection that sends nothing for this long is closed (no thread held forever)


class _Handler(BaseHTTPRequestHandler):
    """GET-only handler over an already-loaded run (loaded once: the files do not change).

    Refuses a request whose Host is not 127.0.0.1/localhost (403), closes idle connections after
    IDLE_TIMEOUT_S, and reports a client that went away as one line on stderr, not a traceback.
    """

    timeout = IDLE_TIMEOUT_S

    def __init__(self, *args, page: bytes, data: bytes, summary: bytes, **kw) -> None:
        self._routes = {"/": (page, "text/html; charset=utf-8"), "/index.html": (page, "text/html; charset=utf-8"),
                        "/data.json": (data, "application/json"), "/summary.json": (summary, "application/json")}
        super().__init__(*args, **kw)

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
        if host not in ALLOWED_HOSTS:
            self.send_error(403, "this viewer answers only to 127.0.0.1 and localhost")
            return
        route = self._routes.get(self.path.split("?", 1)[0])
        if route is None:
            self.send_error(404, "not found")
            return
        body, ctype = route
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            print(f"gpubench view: a client closed its connection before {self.path} was sent", file=sys.stderr)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the CLI prints the URL once
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """One line per failed connection (a client that went away, a timed-out idle socket)."""
        err = sys.exc_info()[1]
        print(f"gpubench view: connection from {client_address[0]} ended: {type(err).__name__}: {err}", file=sys.stderr)


class ViewerServer:
    """A viewer for one run (or several side by side) on 127.0.0.1 in a background thread.
    ``port=0`` picks a free port.

    Use as a context manager, or ``start()`` / ``stop()``; ``url`` is the page's address.
    """

    def __init__(self, run_dirs: str | Path | Sequence[str | Path], port: int = 0) -> None:
        dirs = _as_list(run_dirs)
        data = load_runs(dirs)
        summaries = [(d / "summary.json").read_bytes() for d in dirs]
        summary = summaries[0] if len(dirs) == 1 else b"[" + b",".join(summaries) + b"]"
        handler = partial(_Handler, page=render_page(None).encode("utf-8"),
                          data=json.dumps(data, separators=(",", ":")).encode("utf-8"),
                          summary=summary)
        self.httpd = _Server((HOST, port), handler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"

    def start(self) -> "ViewerServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gpubench-viewer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "ViewerServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
