"""up / down / status as an operator uses them, and the failures they must report cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from backend.polling import wait_until
from infra.local.driver import FederationError
from infra.local.nodes import runtime_of
from infra.local.settings import load_settings
from tests.conftest import TEST_PORT_BASE, make_federation, release_override

pytestmark = pytest.mark.integration


def fedgate(
    state_dir: Path, port_base: int, *args: str, regions: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FEDGATE_STATE_DIR": str(state_dir), "FEDGATE_PORT_BASE": str(port_base)}
    if regions is not None:
        env["FEDGATE_REGIONS"] = regions
    return subprocess.run(
        [sys.executable, "-m", "fedgate.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_status_json_gives_every_nodes_role_region_and_ports(federation):
    out = fedgate(federation.state_dir, TEST_PORT_BASE, "status", "--json")
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
    }
    assert nodes["dns"]["ports"] == {"dns": TEST_PORT_BASE + 8}
    answers = json.loads(out.stdout)["dns"]["dns"]
    assert set(answers) == {"local-eu", "local-us"}, "what the DNS server answers each region's devices"
    assert nodes["spark"]["ports"] == {
        "driver": TEST_PORT_BASE + 40,
        "block_manager": TEST_PORT_BASE + 41,
        "connect": TEST_PORT_BASE + 42,
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
    out = fedgate(federation.state_dir, TEST_PORT_BASE, "up")
    assert out.returncode == 0, out.stderr
    assert "already up" in out.stderr
    assert "gw-local-eu" in out.stdout and "running" in out.stdout
    assert {n.name: n.pid() for n in federation.nodes()} == pids, "no node was restarted"


def test_a_port_in_use_is_named_and_nothing_is_started(tmp_path):
    base = TEST_PORT_BASE + 1000
    fed = make_federation(tmp_path / "s", base, regions="local-eu")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 101))  # gw-local-eu's AMQP port
        squatter.listen()
        with pytest.raises(FederationError, match=rf"gw-local-eu: port {base + 101} \(amqp\).*in use"):
            fed.up()
    assert fed.leftover_pids() == []


def release_runtime(
    tmp_path: Path, rabbitmq_server: str | None, kafka_jars: bool = True
) -> dict[str, object]:
    """Settings overrides under which the tests' RabbitMQ release is installed with its
    rabbitmq-server replaced by the script `rabbitmq_server` (None: missing), and Kafka's
    jars present or not.  Where that release runs from the host's own package (3.10; 4.0 on
    Debian 13) the settings' bin folder is replaced; where it runs in a Debian 13 root
    (4.0 on Debian 12), the cache folder is: a hard-linked copy of the real root (nothing
    copied, nothing written through: only the replaced entry is new), and Kafka's jars."""
    real = load_settings(env={}, **release_override())
    runtime = runtime_of(real)
    cache = tmp_path / "cache"
    cache.mkdir()
    if kafka_jars:
        (cache / "jars").symlink_to(real.cache_dir / "jars")
    if runtime.root is None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        if rabbitmq_server is not None:
            (bin_dir / "rabbitmq-server").write_text(rabbitmq_server)
            (bin_dir / "rabbitmq-server").chmod(0o755)
        return {"rabbitmq_bin_dir": bin_dir, "cache_dir": cache}
    root = cache / runtime.root.relative_to(real.cache_dir)
    root.parent.mkdir(parents=True)
    if rabbitmq_server is None:
        return {"cache_dir": cache}  # no root at all: make setup never ran
    subprocess.run(["cp", "-al", str(runtime.root), str(root)], check=True)
    script = root / str(runtime.rabbitmq("rabbitmq-server")).lstrip("/")
    script.unlink()  # a symlink (or a hard link): unlinked, never written through
    script.write_text(rabbitmq_server)
    script.chmod(0o755)
    return {"cache_dir": cache}


def test_a_node_that_fails_to_boot_is_named_with_its_log_and_nothing_is_left(tmp_path):
    """A broken RabbitMQ install: backend exits at once while Kafka and epmd already started."""
    broken = "#!/bin/sh\necho 'cannot start: simulated broken install' >&2\nexit 1\n"
    base = TEST_PORT_BASE + 1200
    fed = make_federation(tmp_path / "s", base, regions="", **release_runtime(tmp_path, broken))
    with pytest.raises(FederationError, match=r"backend failed to boot \(exit code 1\); see (\S+)") as err:
        fed.up()
    logs = [Path(p) for p in str(err.value).rsplit("see ", 1)[1].split(" and ")]
    assert any("simulated broken install" in p.read_text() for p in logs)
    assert fed.leftover_pids() == [], "everything the failed up started is stopped again"


def test_down_leaves_no_process_and_is_a_no_op_when_down(tmp_path):
    base = TEST_PORT_BASE + 1400
    state = tmp_path / "s"
    up = fedgate(state, base, "up", regions="local-eu")
    assert up.returncode == 0, up.stderr
    fed = make_federation(state, base, regions="local-eu")
    assert len(fed.leftover_pids()) > 5  # epmd, two Erlang VMs with helpers, a JVM

    down = fedgate(state, base, "down")
    assert down.returncode == 0, down.stderr
    assert "had to kill" not in down.stderr, "every node stops on SIGTERM"
    assert fed.leftover_pids() == []
    assert not any(n.is_running() for n in fed.nodes())

    again = fedgate(state, base, "down")
    assert again.returncode == 0 and "already down" in again.stderr


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("rabbitmq", r"rabbitmq-server not found; (run `make setup`|install Debian's rabbitmq-server)"),
        ("kafka", r"kafka: Kafka jars missing in .*; run `make setup`"),
    ],
)
def test_a_missing_binary_is_named_before_anything_starts(tmp_path, missing, message):
    server = None if missing == "rabbitmq" else "#!/bin/sh\nexit 1\n"
    override = release_runtime(tmp_path, server, kafka_jars=missing != "kafka")
    fed = make_federation(tmp_path / "s", TEST_PORT_BASE + 1600, regions="local-eu", **override)
    with pytest.raises(FederationError, match=message):
        fed.up()
    assert fed.leftover_pids() == []


def test_sigterm_during_up_leaves_nothing_running(tmp_path):
    """An operator who stops a slow `fedgate up` must not be left with half a federation."""
    base = TEST_PORT_BASE + 1800
    state = tmp_path / "s"
    env = {
        **os.environ,
        "FEDGATE_STATE_DIR": str(state),
        "FEDGATE_PORT_BASE": str(base),
        "FEDGATE_REGIONS": "local-eu",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedgate.cli", "up"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    fed = make_federation(state, base, regions="local-eu")
    booting = 0

    def nodes_booting() -> bool:
        nonlocal booting
        booting = len(fed.leftover_pids())
        return booting >= 3

    wait_until(nodes_booting, 30, 0.2)  # wait until the nodes are booting
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    # checked once `up` is stopped: a signal before any node started leaves nothing behind
    # whatever `up` does with it
    assert booting >= 3, f"{booting} processes of the federation when the signal came: nothing to stop"
    assert proc.returncode == 130, err
    assert "interrupted; stopping what this run started" in err
    assert fed.leftover_pids() == []


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
    status = fedgate(federation.state_dir, TEST_PORT_BASE, "status", "--json")
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
