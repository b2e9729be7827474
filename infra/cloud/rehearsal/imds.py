"""A stand-in of EC2's instance metadata service, IMDSv2 only, as the nodes use it.

A session token for a PUT with a TTL header; metadata only with that token (IMDSv1's
plain GET is refused, as the launch template's `http_tokens = required` makes EC2 do).
`local-ipv4` is the address the request came from: each instance is told its own, and an
`instance-id` made of it.
"""

from __future__ import annotations

import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType


class MetadataService:
    """`with MetadataService(host, port) as imds:` -- imds.url until the block ends."""

    def __init__(self, host: str, port: int):
        self.token = secrets.token_urlsafe(24)
        #: (method, path, caller's address) of every request, in order
        self.requests: list[tuple[str, str, str]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 -- http.server's name
                service.requests.append(("PUT", self.path, self.client_address[0]))
                if self.path == "/latest/api/token" and self.headers.get(
                    "X-aws-ec2-metadata-token-ttl-seconds"
                ):
                    self._answer(200, service.token)
                else:
                    self._answer(400)

            def do_GET(self) -> None:  # noqa: N802
                service.requests.append(("GET", self.path, self.client_address[0]))
                if self.headers.get("X-aws-ec2-metadata-token") != service.token:
                    self._answer(401)
                elif self.path == "/latest/meta-data/local-ipv4":
                    self._answer(200, self.client_address[0])
                elif self.path == "/latest/meta-data/instance-id":
                    # one id per address, as stable as an instance's
                    self._answer(
                        200, "i-" + "".join(f"{int(b):02x}" for b in self.client_address[0].split("."))
                    )
                else:
                    self._answer(404)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="imds", daemon=True)

    def __enter__(self) -> MetadataService:
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
