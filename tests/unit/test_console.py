"""The fleet console's server without a federation: nothing without the admin credentials,
the page and its script with them, and a view that names what it could not reach."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest

from fedgate.console.fleet import CommandTail
from fedgate.console.server import STATIC, Console

ENDPOINTS = {
    "kafka": {"bootstrap": "127.0.0.1:1"},
    "gateways": {"local-eu": {"nodes": [{"name": "gw-local-eu", "address": "127.170.1.1"}]}},
    "dns": None,
    # a Prometheus nobody answers for
    "prometheus": "http://127.0.0.1:1",
}


def _get(url: str, user: str | None = None, password: str = "") -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


@pytest.fixture
def console():
    served = Console(ENDPOINTS, "fedgate-admin", "s3cret", "127.0.0.1", 0).start()
    yield served
    served.stop()


def test_nothing_is_served_without_the_admin_credentials(console):
    for path in ("/", "/api/fleet", "/app.js"):
        assert _get(console.url + path)[0] == 401
        assert _get(console.url + path, "fedgate-admin", "wrong")[0] == 401
        assert _get(console.url + path, "someone", "s3cret")[0] == 401
    status, _, headers = _get(console.url + "/")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")


def test_the_page_and_its_script_come_with_a_policy_that_allows_nothing_from_elsewhere(console):
    status, body, headers = _get(console.url + "/", "fedgate-admin", "s3cret")
    assert status == 200 and b'<script src="/app.js"' in body
    assert headers["Content-Security-Policy"] == "default-src 'self'"
    assert _get(console.url + "/app.js", "fedgate-admin", "s3cret")[0] == 200
    assert _get(console.url + "/nope", "fedgate-admin", "s3cret")[0] == 404


def test_a_source_that_does_not_answer_is_named_in_the_view(console):
    status, body, _ = _get(console.url + "/api/fleet", "fedgate-admin", "s3cret")
    view = json.loads(body)
    assert status == 200
    assert any(e.startswith("Prometheus (http://127.0.0.1:1)") for e in view["errors"]), view["errors"]
    # the regions still show, their state not known
    assert [(r["name"], r["state"]) for r in view["regions"]] == [("local-eu", "unknown")]


def test_the_command_list_shows_each_commands_last_step_and_the_region_it_went_to():
    tail = CommandTail("127.0.0.1:1")
    for step in (
        {"command_id": "a", "device": "pump-1", "outcome": "accepted", "region": "", "at": 1},
        {"command_id": "b", "device": "pump-2", "outcome": "accepted", "region": "", "at": 2},
        {"command_id": "a", "device": "pump-1", "outcome": "routed", "region": "local-eu", "at": 3},
        {"command_id": "a", "device": "pump-1", "outcome": "acknowledged", "region": "", "at": 4},
    ):
        tail._add(step)
    first, second = tail.last()
    assert (first["command_id"], first["outcome"], first["region"]) == ("a", "acknowledged", "local-eu")
    assert first["steps"] == ["accepted", "routed", "acknowledged"]
    assert (second["command_id"], second["outcome"]) == ("b", "accepted")


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js here to check the page's script")
def test_the_pages_script_parses():
    """A syntax error leaves the page at "connecting..." (the browser test finds it a minute
    later, as a region that never shows)."""
    checked = subprocess.run(["node", "--check", str(STATIC / "app.js")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


def test_a_quantile_of_no_data_is_left_out_not_sent_as_nan(tmp_path):
    """Prometheus answers NaN for a region's p99 once its readings stopped (a region removed):
    the page's JSON cannot carry it, and the whole view failed to parse in the browser."""
    import http.server
    import threading

    from infra.local.prometheus_node import PrometheusApi

    body = json.dumps(
        {
            "status": "success",
            "data": {
                "resultType": "vector",
                "result": [
                    {"metric": {"region": "local-gk"}, "value": [1, "NaN"]},
                    {"metric": {"region": "local-eu"}, "value": [1, "0.05"]},
                ],
            },
        }
    ).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # noqa: ANN002
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = PrometheusApi(f"http://127.0.0.1:{server.server_address[1]}")
        assert api.by("region:fedgate_reading_latency_seconds:p99_5m", "region") == {"local-eu": 0.05}
    finally:
        server.shutdown()
