"""The fleet console's web server: the page (static/) and its one API, /api/fleet (fleet.py),
behind the federation's admin credentials (HTTP Basic), on loopback unless told otherwise.

    fedgate console [--host 127.0.0.1] [--port <port base + 7>]

The page asks /api/fleet every 2 s and redraws; the server builds the view at most once a
second whatever the number of pages open.  SIGTERM or Ctrl-C stops it.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fedgate.console.fleet import CommandTail, fleet_view

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
    "/icon.svg": ("icon.svg", "image/svg+xml"),
    # what a browser asks for on its own
    "/favicon.ico": ("icon.svg", "image/svg+xml"),
}
#: the federation's offset of the console's default port (infra/local/layout.py keeps +7 free)
CONSOLE_OFFSET = 7


class CachedView:
    """fleet_view at most once per `max_age_s`, shared by every request."""

    def __init__(self, build: Callable[[], dict[str, Any]], max_age_s: float = 1.0):
        self.build = build
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._at = 0.0
        self._view: dict[str, Any] = {}

    def get(self) -> dict[str, Any]:
        with self._lock:
            if time.monotonic() - self._at >= self.max_age_s:
                self._view = self.build()
                self._at = time.monotonic()
            return self._view


class Console:
    """The server, its view of the fleet and the command tail; start() serves in a thread."""

    def __init__(self, endpoints: dict[str, Any], user: str, password: str, host: str, port: int):
        self.commands = CommandTail(endpoints["kafka"]["bootstrap"])
        self.view = CachedView(lambda: fleet_view(endpoints, self.commands))
        expected = base64.b64encode(f"{user}:{password}".encode()).decode()
        console = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "fedgate-console"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("%s " + format, self.address_string(), *args)

            def do_GET(self) -> None:  # noqa: N802
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Basic {expected}".encode()):
                    self.send_response(HTTPStatus.UNAUTHORIZED)
                    self.send_header("WWW-Authenticate", 'Basic realm="fedgate console", charset="UTF-8"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = self.path.split("?", 1)[0]
                if path == "/api/fleet":
                    body, ctype = json.dumps(console.view.get()).encode(), "application/json"
                elif path in FILES:
                    name, ctype = FILES[path]
                    body = (STATIC / name).read_bytes()
                else:
                    self.send_error(HTTPStatus.NOT_FOUND)
                    return
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", "default-src 'self'")
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="console-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Console:
        self.commands.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.commands.stop()
