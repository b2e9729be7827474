"""How a RabbitMQ node is started (infra/local/broker.py), checked without starting one."""

import subprocess
from pathlib import Path

import pytest

from infra.local import processes
from infra.local.broker import RABBITMQ_BIN, BrokerRuntime, BrokerRuntimeError, broker_runtime


def test_the_hosts_own_package_runs_directly():
    rt = BrokerRuntime("3.10", None, Path("/usr/lib/rabbitmq/bin"))
    assert rt.command(rt.rabbitmq("rabbitmq-server"), [], shared=[Path("/tmp")]) == [
        "/usr/lib/rabbitmq/bin/rabbitmq-server"
    ]


def test_a_debian_13_root_runs_the_node_chrooted_in_its_own_mount_namespace(tmp_path):
    rt = BrokerRuntime("4.0", tmp_path / "root", RABBITMQ_BIN)
    state = tmp_path / "state with space"
    argv = rt.command(rt.epmd, ["-port", "21000"], shared=[state])
    assert argv[:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    # the paths travel as arguments, never through the shell's parser
    assert argv[-6:] == [str(tmp_path / "root"), "1", str(state), "/usr/bin/epmd", "-port", "21000"]


def test_the_entry_script_mounts_each_shared_folder_and_execs(tmp_path):
    rt = BrokerRuntime("4.0", tmp_path / "root", RABBITMQ_BIN)
    argv = rt.command(Path("/bin/true"), [], shared=[tmp_path / "a", tmp_path / "b"])
    script = argv[7]
    # dry run: the same script with mount and chroot replaced by echo
    dry = (
        script.replace("mount ", "echo mount ").replace("exec chroot", "echo chroot").replace("mkdir -p", ":")
    )
    out = subprocess.run(["sh", "-c", dry, *argv[8:]], capture_output=True, text=True, check=True).stdout
    root = str(tmp_path / "root")
    assert out.splitlines() == [
        f"mount --rbind /proc {root}/proc",
        f"mount --rbind /dev {root}/dev",
        f"mount --bind {tmp_path / 'a'} {root}{tmp_path / 'a'}",
        f"mount --bind {tmp_path / 'b'} {root}{tmp_path / 'b'}",
        f"chroot {root} /bin/true",
    ]


def test_a_missing_release_is_named_with_what_to_run(tmp_path):
    empty_root = BrokerRuntime("4.0", tmp_path / "root", RABBITMQ_BIN)
    with pytest.raises(BrokerRuntimeError, match=r"gw-x: .*rabbitmq-server not found; run `make setup`"):
        empty_root.check("gw-x")
    assert empty_root.installed_version() is None
    with pytest.raises(BrokerRuntimeError, match="one of 4.0, 3.10"):
        broker_runtime("3.9", tmp_path, Path("/x"))


def test_the_installed_version_is_read_from_the_package(tmp_path):
    (tmp_path / "root/usr/lib/rabbitmq/lib/rabbitmq_server-4.0.5").mkdir(parents=True)
    assert BrokerRuntime("4.0", tmp_path / "root", RABBITMQ_BIN).installed_version() == "4.0.5"


def test_a_started_node_process_is_known_as_a_child_until_forgotten(tmp_path):
    """Node.exited() asks this first: while a node's start chain execs (unshare, sh, chroot,
    the server script), /proc/<pid>/environ reads empty and its marker cannot be seen."""
    proc = processes.spawn(
        ["sh", "-c", "exec sh -c 'exec sleep 5'"],
        env={"PATH": "/usr/bin:/bin"},
        node_marker="unit-chain",
        log_path=tmp_path / "out.log",
        cwd=tmp_path,
    )
    assert processes.is_child(proc.pid) and processes.exit_code(proc.pid) is None
    proc.kill()
    processes.forget(proc.pid)
    assert not processes.is_child(proc.pid)
