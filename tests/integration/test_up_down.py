"""`fedgate up` and `down` from nothing, each on a federation of its own, and the failures
they must report cleanly (a port taken, a node that cannot boot, a binary missing, SIGTERM
during `up`).  test_lifecycle.py has what runs against the session federation; these start
their own, on their own ports (TEST_PORT_BASE + 1000 .. + 1800), in a lane of their own."""

from __future__ import annotations

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
from tests.helpers import run_fedgate

pytestmark = pytest.mark.integration


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
    up = run_fedgate(state, base, "up", regions="local-eu")
    assert up.returncode == 0, up.stderr
    fed = make_federation(state, base, regions="local-eu")
    assert len(fed.leftover_pids()) > 5  # epmd, two Erlang VMs with helpers, a JVM

    down = run_fedgate(state, base, "down")
    assert down.returncode == 0, down.stderr
    assert "had to kill" not in down.stderr, "every node stops on SIGTERM"
    assert fed.leftover_pids() == []
    assert not any(n.is_running() for n in fed.nodes())

    again = run_fedgate(state, base, "down")
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
