"""How `fedgate` fails: one line on stderr saying what failed and what to do, and the exit code
`fedgate --help` documents for it -- against a federation on record whose nodes do not listen."""

import importlib.metadata
import os
import re
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend import contract as c
from backend.command_outcomes import CommandEnd, Outcome
from fedgate import cli
from fedgate.failures import explain
from infra.device_registry import DeviceRegistry

ROOT = Path(__file__).resolve().parents[2]

UNREACHABLE, REFUSED, TIMED_OUT = 4, 5, 6
TOPIC = c.device_command_topic("pump-1", "open")


def closed_ports(n):
    """Ports nothing listens on: the kernel's choice of free ones, bound and let go."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def listening():
    """A port the kernel accepts connections on and nothing answers: enough for a TCP check."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def federation_on_record(tmp_path, monkeypatch, *, amqp, kafka, router):
    """The settings of a federation whose backend, Kafka and router are at these ports; pump-1
    registered. `env` runs a fedgate process against it."""
    config = tmp_path / "fedgate.toml"
    config.write_text(
        f'[ports]\n"backend.amqp" = {amqp}\n"kafka.bootstrap" = {kafka}\n"router-0.metrics" = {router}\n'
    )
    env = {
        "FEDGATE_STATE_DIR": str(tmp_path / "state"),
        "FEDGATE_CLOUD_STATE_DIR": str(tmp_path / "cloud"),
        "FEDGATE_CONFIG": str(config),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FEDGATE_DEBUG", raising=False)
    DeviceRegistry(tmp_path / "state" / "devices.json").add(["pump-1"])
    outside = {k: v for k, v in os.environ.items() if not k.startswith("FEDGATE_")}
    return SimpleNamespace(amqp=amqp, kafka=kafka, router=router, env={**outside, **env})


@pytest.fixture
def stopped(tmp_path, monkeypatch):
    """A federation on record with nothing listening at its ports: every node stopped."""
    amqp, kafka, router = closed_ports(3)
    return federation_on_record(tmp_path, monkeypatch, amqp=amqp, kafka=kafka, router=router)


def fedgate(fed, *args):
    """`fedgate ARGS` as a person runs it: its own process, its own stderr."""
    return subprocess.run(
        [sys.executable, "-m", "fedgate.cli", *args],
        cwd=ROOT,
        env=fed.env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line(err):
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert err.startswith("fedgate: "), err
    return err


def test_send_with_the_backend_down_names_it_in_one_line_and_exits_unreachable(stopped):
    out = fedgate(stopped, "send", "pump-1", TOPIC, "{}")
    err = one_line(out.stderr)
    assert out.returncode == UNREACHABLE, err
    assert f"the backend at 127.0.0.1:{stopped.amqp} cannot be reached (Connection refused)" in err
    assert "`fedgate up`" in err, "says what to do"
    assert "fedgate-admin:" not in err, "the URL's password stays out"


def test_send_wait_before_the_device_id_reads_the_device_not_seconds(stopped):
    a = cli.parse_args(["send", "--wait", "pump-1", TOPIC, "{}"])
    assert (a.device, a.topic, a.payload, cli._wait_seconds(a)) == ("pump-1", TOPIC, "{}", 30.0)
    # as a person types it, against a federation that is down: the node is named, not the seconds
    out = fedgate(stopped, "send", "--wait", "pump-1", TOPIC, "{}")
    err = one_line(out.stderr)
    assert out.returncode == UNREACHABLE, err
    assert "seconds" not in err and f"Kafka at 127.0.0.1:{stopped.kafka} cannot be reached" in err


def test_the_older_wait_seconds_are_still_read_as_the_timeout():
    for tail in (["--wait", "20"], ["--wait=20"], ["--wait", "--timeout", "20"], ["--timeout", "20"]):
        a = cli.parse_args(["send", "pump-1", TOPIC, "{}", *tail])
        assert (a.device, cli._wait_seconds(a)) == ("pump-1", 20.0), tail
    assert cli._wait_seconds(cli.parse_args(["command", "abc", "--wait", "7.5"])) == 7.5
    # after `--` everything is an argument, numbers too
    a = cli.parse_args(["send", "--wait", "--", "42", TOPIC, "{}"])
    assert (a.device, cli._wait_seconds(a)) == ("42", 30.0)


def test_command_with_kafka_down_says_so_instead_of_nothing_on_record(stopped):
    out = fedgate(stopped, "command", "0123456789abcdef")
    err = one_line(out.stderr)  # librdkafka's own lines would make it several
    assert out.returncode == UNREACHABLE, err
    assert f"Kafka at 127.0.0.1:{stopped.kafka} cannot be reached" in err and "nothing on record" not in err


def test_presence_with_the_router_down_exits_unreachable(stopped, capsys):
    assert cli.main(["presence"]) == UNREACHABLE
    err = one_line(capsys.readouterr().err)
    assert f"presence: the router at 127.0.0.1:{stopped.router} cannot be reached" in err


def test_an_unregistered_device_and_a_command_too_large_are_refused(stopped, capsys):
    assert cli.main(["send", "ghost-1", c.device_command_topic("ghost-1", "x"), "{}"]) == REFUSED
    err = one_line(capsys.readouterr().err)
    assert "device 'ghost-1' is not registered (fedgate devices add ghost-1)" in err
    assert cli.main(["send", "pump-1", TOPIC, "x" * (c.MAX_COMMAND_BYTES + 1)]) == REFUSED
    err = one_line(capsys.readouterr().err)
    assert "over the limit" in err and "send a reference to the data" in err


def test_a_wrong_kill_gateway_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["army", "--kill-gateway", "eu@x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fedgate army") and "Traceback" not in err
    assert "argument --kill-gateway: 'eu@x': REGION@SECONDS" in err
    assert cli.parse_args(["army", "--kill-gateway", "local-eu@15"]).kill_gateway == ("local-eu", 15.0)
    assert cli.parse_args(["army", "--kill-gateway", "local-eu"]).kill_gateway == ("local-eu", 10.0)


def test_output_read_by_a_reader_that_went_away_stops_quietly(stopped):
    """`fedgate status | head -3`: head leaves after its lines, the pipe closes, and fedgate
    says nothing more (it printed "did not expect this failure: BrokenPipeError" before)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before fedgate writes its first line
    try:
        out = subprocess.run(
            [sys.executable, "-m", "fedgate.cli", "status"],
            cwd=ROOT,
            env=stopped.env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert out.returncode == 141, out.stderr
    assert out.stderr == ""


def test_a_broken_pipe_to_a_node_is_still_named_as_a_failure():
    """Only standard output's reader going away is quiet: a peer's closed socket, while the
    output is still read, is a failure `explain` names."""
    probe = "from fedgate.failures import output_closed; print(output_closed(BrokenPipeError(32, 'x')))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout == "False\n", out.stderr
    code, line = explain(BrokenPipeError(32, "Broken pipe"), "send")
    assert code == UNREACHABLE and "cannot be reached (Broken pipe)" in line, line


def test_version_is_the_installed_distributions(stopped):
    out = fedgate(stopped, "--version")
    assert out.returncode == 0, out.stderr
    fedgate_version = importlib.metadata.version("fedgate")
    spark = importlib.metadata.version("pyspark")
    # the engines a bug report needs, read from what runs them (settings, pyspark, the jars' pom)
    assert re.fullmatch(
        rf"fedgate {re.escape(fedgate_version)} \(RabbitMQ 4\.0, Kafka \d+\.\d+\.\d+, "
        rf"Spark {re.escape(spark)}, Iceberg \d+\.\d+\.\d+; Python 3\.\d+\.\d+\)\n",
        out.stdout,
    ), out.stdout


def test_command_wait_that_runs_out_exits_timed_out(tmp_path, monkeypatch, capsys):
    from backend import command_outcomes

    parked = [Outcome("parked", 1_700_000_000_000, reason="device offline", router="router-0")]
    monkeypatch.setattr(command_outcomes, "read_outcomes", lambda *a, wait_s: parked)
    with listening() as kafka:
        amqp, router = closed_ports(2)
        federation_on_record(tmp_path, monkeypatch, amqp=amqp, kafka=kafka, router=router)
        assert cli.main(["command", "abc", "--wait", "--timeout", "1"]) == TIMED_OUT
    out, err = capsys.readouterr()
    assert "parked" in out, "the steps so far are shown"
    assert "command abc: no final outcome within 1 s" in one_line(err)


def test_send_wait_ends_timed_out_or_failed_for_a_dead_lettered_command(tmp_path, monkeypatch, capsys):
    from backend import command_outcomes

    parked = Outcome("parked", 1_700_000_000_000, reason="device offline", router="router-0")
    dead = Outcome("deadlettered", 1_700_000_002_000, reason="expired while parked", router="router-0")
    ends = iter([CommandEnd("c1", "", [parked]), CommandEnd("c2", "deadlettered", [parked, dead])])
    monkeypatch.setattr(command_outcomes, "follow", lambda *a, **kw: next(ends))
    with listening() as kafka:
        amqp, router = closed_ports(2)
        federation_on_record(tmp_path, monkeypatch, amqp=amqp, kafka=kafka, router=router)
        assert cli.main(["send", "pump-1", TOPIC, "{}", "--wait", "--timeout", "2"]) == TIMED_OUT
        err = one_line(capsys.readouterr().err)
        assert "command c1: no outcome within 2 s" in err and "fedgate command c1 --wait" in err
        assert cli.main(["send", "pump-1", TOPIC, "{}", "--wait"]) == 1
        assert "command c2 was dead-lettered: expired while parked" in one_line(capsys.readouterr().err)


def test_an_unexpected_failure_is_one_line_and_fedgate_debug_adds_the_traceback(stopped, monkeypatch, capsys):
    def broken(ctx, args):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "cmd_regions", broken)
    assert cli.main(["regions"]) == 1
    err = one_line(capsys.readouterr().err)
    assert "regions: RuntimeError: boom" in err and "FEDGATE_DEBUG=1" in err

    out = fedgate(SimpleNamespace(env={**stopped.env, "FEDGATE_DEBUG": "1"}), "send", "pump-1", TOPIC, "{}")
    assert out.returncode == UNREACHABLE
    assert "Traceback" in out.stderr, "debugging shows where it failed"
    assert out.stderr.splitlines()[-1].startswith("fedgate: send: the backend at "), "the line still ends it"


def test_help_and_the_operations_guide_document_the_same_exit_codes():
    epilog = cli.build_parser().format_help().split("exit codes:")[1]
    in_help = {int(n) for n in re.findall(r"^  (\d+) ", epilog, re.M)}
    guide = (ROOT / "docs" / "operations.md").read_text().split("### Exit codes")[1].split("\n#")[0]
    in_guide = {int(n) for n in re.findall(r"^\| (\d+) \|", guide, re.M)}
    assert in_help == in_guide == {0, 1, 2, 3, 4, 5, 6, 130, 141}
