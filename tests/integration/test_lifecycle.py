"""up / down / status as an operator uses them, and the failures they must report cleanly."""

from __future__ import annotations

import json
import signal

import pytest

from backend.polling import wait_until
from tests.conftest import TEST_PORT_BASE
from tests.helpers import run_fedgate

# every node running, the Spark job among them
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("spark_job")]


def test_status_json_gives_every_nodes_role_region_and_ports(federation):
    out = run_fedgate(federation.state_dir, TEST_PORT_BASE, "status", "--json")
    assert out.returncode == 0, out.stderr
    nodes = {n["name"]: n for n in json.loads(out.stdout)["nodes"]}
    assert {n["role"] for n in nodes.values()} == {
        "epmd",
        "backend",
        "gateway",
        "kafka",
        "router",
        "spark",
        "dns",
        "prometheus",
    }
    assert nodes["dns"]["ports"] == {
        "dns": TEST_PORT_BASE + 8,
        "metrics": TEST_PORT_BASE + 5,
        "webserver": TEST_PORT_BASE + 6,
    }
    assert nodes["prometheus"]["ports"] == {"http": TEST_PORT_BASE + 9}
    answers = json.loads(out.stdout)["dns"]["dns"]
    assert set(answers) == {"local-eu", "local-us"}, "what the DNS server answers each region's devices"
    assert nodes["spark"]["ports"] == {
        "driver": TEST_PORT_BASE + 40,
        "block_manager": TEST_PORT_BASE + 41,
        "connect": TEST_PORT_BASE + 42,
        "metrics": TEST_PORT_BASE + 43,
    }
    assert nodes["router-0"]["ports"]["metrics"] == TEST_PORT_BASE + 30
    for name, region in (("gw-local-eu", "local-eu"), ("gw-local-us", "local-us")):
        gw = nodes[name]
        assert gw["region"] == region and gw["state"] == "running"
        assert {"mqtt", "amqp", "management"} <= set(gw["ports"])
        assert gw["address"] and answers[region] == gw["address"], "a host of its own, which DNS answers"
        assert isinstance(gw["connections"], int)
    # every broker node reports the RabbitMQ it runs: the release the federation was set up with
    release = federation.settings.rabbitmq_release
    for name in ("gw-local-eu", "gw-local-us", "backend"):
        assert nodes[name]["version"].startswith(f"{release}."), nodes[name]
    assert nodes["kafka"]["version"] is None
    assert {"amqp", "management"} <= set(nodes["backend"]["ports"])
    assert nodes["kafka"]["ports"]["bootstrap"] == TEST_PORT_BASE + 10
    assert all(n["state"] == "running" for n in nodes.values())


def test_up_while_up_is_a_no_op_that_prints_the_status_table(federation):
    pids = {n.name: n.pid() for n in federation.nodes()}
    out = run_fedgate(federation.state_dir, TEST_PORT_BASE, "up")
    assert out.returncode == 0, out.stderr
    assert "already up" in out.stderr
    assert "gw-local-eu" in out.stdout and "running" in out.stdout
    assert {n.name: n.pid() for n in federation.nodes()} == pids, "no node was restarted"


def test_up_brings_back_a_crashed_node_without_touching_the_others(federation, endpoints, uid):
    """A gateway killed with SIGKILL: status says so, `up` restarts just that node, traffic flows again."""
    from backend import contract as c
    from backend.amqp import Tap
    from infra.local import processes
    from tests.helpers import device

    victim = federation.node("gw-local-us")
    others = {n.name: n.pid() for n in federation.nodes() if n.name != victim.name}
    processes.signal_pids(processes.marked_pids(victim.marker), signal.SIGKILL)  # gone ones are skipped
    wait_until(lambda: not victim.is_running(), 10, 0.1)
    status = run_fedgate(federation.state_dir, TEST_PORT_BASE, "status", "--json")
    assert status.returncode == 3, "status exits non-zero while a node is down"
    states = {n["name"]: n["state"] for n in json.loads(status.stdout)["nodes"]}
    assert states["gw-local-us"] == "stopped" and states["backend"] == "running"

    federation.up()
    assert victim.is_running()
    assert {n.name: n.pid() for n in federation.nodes() if n.name != victim.name} == others

    dev_id = f"revived-{uid}"
    with Tap(endpoints["backend"]["url"], c.TELEMETRY_EXCHANGE, [f"devices.{dev_id}.#"]) as tap:
        with device(endpoints, "local-us", dev_id) as d:
            d.publish(f"devices/{dev_id}/telemetry", b"{}")
        got = tap.drain(expect=1, timeout=15)
    assert [m.region for m in got] == ["local-us"]
