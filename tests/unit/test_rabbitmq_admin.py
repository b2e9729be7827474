"""The management API client against a local HTTP stand-in: what it sends, in how many requests."""

from __future__ import annotations

from backend.devices import device_users, password_hash
from backend.rabbitmq_admin import RabbitAdmin
from tests.unit.cloud.fakes import fake_management_api


def test_a_large_fleet_is_imported_a_few_hundred_users_per_request_with_their_permissions():
    hashes = {f"pump-{i:04d}": password_hash("s") for i in range(1200)}
    with fake_management_api() as api:
        RabbitAdmin(api.url, "fedgate-admin", "pw").import_users(device_users(hashes))
        bodies = [b for m, p, b in api.requests if m == "POST" and p == "/api/definitions"]
    assert [len(b["users"]) for b in bodies] == [500, 500, 200]
    for b in bodies:
        names = {u["name"] for u in b["users"]}
        assert {p["user"] for p in b["permissions"]} == names
        assert {p["user"] for p in b["topic_permissions"]} == names
    assert sorted(u["name"] for b in bodies for u in b["users"]) == sorted(hashes)


def test_queue_depths_are_read_from_a_nodes_prometheus_endpoint():
    import http.server
    import threading

    from backend.rabbitmq_admin import AdminError, prometheus_queue_messages

    body = (
        b"# TYPE rabbitmq_detailed_queue_messages gauge\n"
        b'rabbitmq_detailed_queue_messages_ready{vhost="/",queue="federation: amq.topic -> b:t"} 7\n'
        b'rabbitmq_detailed_queue_messages{vhost="/",queue="federation: amq.topic -> b:t"} 9\n'
        b'rabbitmq_detailed_queue_messages{vhost="/",queue="q \\"quoted\\""} 2\n'
    )
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert prometheus_queue_messages(url) == {"federation: amq.topic -> b:t": 9, 'q "quoted"': 2}
        assert asked[0].startswith("/metrics/detailed?family=queue_coarse_metrics")
    finally:
        server.shutdown()
        server.server_close()
    try:
        prometheus_queue_messages(url, timeout=1)
    except AdminError as e:
        assert e.retriable
    else:
        raise AssertionError("a node that does not answer is an AdminError")


def test_a_cluster_client_moves_on_to_the_next_node_when_one_does_not_answer_and_stays_there():
    import socket

    with socket.socket() as s:  # a port nothing listens on: a dead node
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with fake_management_api() as api:
        admin = RabbitAdmin([dead, api.url], "fedgate-admin", "pw", timeout=2)
        assert admin.get("connections") == []
        assert admin.base_url == api.url, "the node that answered is asked first from now on"
        admin.get("queues")
    assert [p for m, p, _ in api.requests] == ["/api/connections", "/api/queues"]


def test_a_cluster_client_names_every_node_it_could_not_reach():
    import pytest

    from backend.rabbitmq_admin import AdminError

    with pytest.raises(AdminError, match="127.0.0.1:1.*127.0.0.1:2") as e:
        RabbitAdmin(["http://127.0.0.1:1", "http://127.0.0.1:2"], "u", "p", timeout=1).get("overview")
    assert e.value.retriable


def test_over_https_the_client_trusts_only_the_nodes_ca_and_checks_the_name_their_certificates_carry(
    tmp_path,
):
    """A cloud node's management API behind a load balancer: the URL dials the balancer's
    address, the certificate names the nodes (gw-<region>.<domain>)."""
    import http.server
    import ssl
    import threading

    import pytest

    from backend.rabbitmq_admin import AdminError
    from infra.local.tls import LocalCA

    ca = LocalCA(tmp_path / "tls")
    cert = ca.node_cert("gw-eu", "gw-eu.fleet.example")
    other_ca = LocalCA(tmp_path / "other").ensure_ca()

    class Overview(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"cluster_name": "gateways eu"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Overview)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert.cert, cert.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}"
    try:
        name = "gw-eu.fleet.example"
        by_file = RabbitAdmin(url, "fedgate-router", "pw", ca_file=str(ca.ca_cert), server_name=name)
        assert by_file.get("overview") == {"cluster_name": "gateways eu"}
        by_pem = RabbitAdmin(url, "fedgate-router", "pw", ca_pem=ca.ca_cert.read_text(), server_name=name)
        assert by_pem.get("overview") == {"cluster_name": "gateways eu"}
        # the name checked is server_name, not the address dialled
        with pytest.raises(AdminError, match="certificate"):
            RabbitAdmin(url, "u", "pw", ca_file=str(ca.ca_cert), server_name="gw-us.fleet.example").get(
                "overview"
            )
        # a certificate of another CA is refused, as is the system's trust for this one
        with pytest.raises(AdminError, match="certificate"):
            RabbitAdmin(url, "u", "pw", ca_file=str(other_ca), server_name=name).get("overview")
        with pytest.raises(AdminError, match="certificate"):
            RabbitAdmin(url, "u", "pw").get("overview")
    finally:
        server.shutdown()
        server.server_close()
