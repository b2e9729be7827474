"""Stand-ins at the process and HTTP boundaries: a fake terraform binary and a fake management API."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# A terraform that keeps its "infrastructure" in fake.state next to the root
# module: plan shows changes until an apply happened, apply of a destroy plan
# removes it, output -json prints what FAKE_TF_OUTPUTS holds.  Every call but `version` is
# logged to calls.log, one JSON argv per line.
FAKE_TERRAFORM = r"""#!PYTHON
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
cwd = Path.cwd()
# `version` runs wherever the driver checks the toolchain (the repository), not in a region folder
if args[:1] != ["version"]:
    with open(cwd / "calls.log", "a") as f:
        f.write(json.dumps(args) + "\n")
state = cwd / "fake.state"
if args[:1] == ["version"]:
    print("Terraform v1.11.4\non linux_amd64")
elif args[:1] == ["init"]:
    print("Terraform has been successfully initialized!")
elif args[:1] == ["plan"]:
    destroy = "-destroy" in args
    exists = state.exists()
    if destroy == exists:
        (cwd / "tfplan").write_text("destroy" if destroy else "create")
        print(("Plan: 0 to add, 0 to change, 23 to destroy." if destroy else
               "Plan: 23 to add, 0 to change, 0 to destroy."))
        sys.exit(2)
    print("No changes. Your infrastructure matches the configuration.")
elif args[:1] == ["apply"]:
    if (cwd / "tfplan").read_text() == "destroy":
        state.unlink()
    else:
        state.write_text("applied")
    print("Apply complete!")
elif args[:1] == ["output"]:
    print(os.environ["FAKE_TF_OUTPUTS"])
else:
    sys.exit(f"fake terraform: unexpected {args}")
"""


def write_fake_terraform(path: Path) -> Path:
    path.write_text(FAKE_TERRAFORM.replace("#!PYTHON", "#!" + sys.executable))
    path.chmod(0o755)
    return path


def terraform_calls(region_dir: Path) -> list[list[str]]:
    log = region_dir / "calls.log"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines()]


class FakeManagementApi:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.url = ""

    def paths(self, method: str) -> list[str]:
        return [p for m, p, _ in self.requests if m == method]

    def body(self, method: str, path: str) -> Any:
        return next(b for m, p, b in self.requests if m == method and p == path)


@contextmanager
def fake_management_api() -> Iterator[FakeManagementApi]:
    api = FakeManagementApi()

    class Handler(BaseHTTPRequestHandler):
        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            api.requests.append((self.command, self.path, json.loads(raw) if raw else None))
            if self.command == "GET":
                body = b"[]"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(204)
                self.end_headers()

        do_GET = do_PUT = do_POST = do_DELETE = _handle

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
