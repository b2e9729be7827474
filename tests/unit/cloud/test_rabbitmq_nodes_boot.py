"""How a rabbitmq-nodes node boots into its cluster: the node-name script against a stand-in
instance metadata service (IMDSv2), and the module, copied alone, planned against moto: the
rendered rabbitmq.conf, the order of cloud-init's commands and the cluster size it accepts."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra.cloud.toolchain import Toolchain

from .conftest import TERRAFORM_DIR, init_root, module_errors, run_tf

SCRIPT = TERRAFORM_DIR / "modules" / "rabbitmq-nodes" / "files" / "rabbitmq-nodename.sh"
TOKEN = "AQAEAFakeTokenOfTheStandIn=="
REGION = "eu-west-1"


class FakeImds:
    """IMDSv2 as EC2 answers it: a token for a PUT with a TTL header; metadata only with that token."""

    def __init__(self, local_ipv4: str) -> None:
        self.local_ipv4 = local_ipv4
        self.requests: list[tuple[str, str]] = []
        self.url = ""


@pytest.fixture
def imds() -> Iterator[FakeImds]:
    fake = FakeImds("10.40.1.23")

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: str = "") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            fake.requests.append(("PUT", self.path))
            if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                self._answer(200, TOKEN)
            else:
                self._answer(400)

        def do_GET(self) -> None:
            fake.requests.append(("GET", self.path))
            if self.headers.get("X-aws-ec2-metadata-token") != TOKEN:
                self._answer(401)  # IMDSv1 is off (http_tokens = required)
            elif self.path == "/latest/meta-data/local-ipv4":
                self._answer(200, fake.local_ipv4)
            else:
                self._answer(404)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def _run_script(env_file: Path, imds_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(SCRIPT), str(env_file)],
        env={"PATH": "/usr/bin:/bin", "FEDGATE_IMDS_URL": imds_url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_node_is_named_after_its_private_address_from_imdsv2(tmp_path: Path, imds: FakeImds) -> None:
    env_file = tmp_path / "rabbitmq-env.conf"
    # as Terraform writes it for a gateway, plus a stale name the script must replace
    env_file.write_text(
        "# written by the rabbitmq-nodes Terraform module\n"
        'SERVER_ADDITIONAL_ERL_ARGS="+MMmcs 0"\n'
        'PLUGINS_DIR="/usr/local/lib/fedgate/rabbitmq-plugins:/usr/lib/rabbitmq/plugins"\n'
        "NODENAME=rabbit@ip-10-40-1-23\n"
    )
    done = _run_script(env_file, imds.url)
    assert done.returncode == 0, done.stderr
    assert imds.requests[:2] == [("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/local-ipv4")]
    assert env_file.read_text().splitlines() == [
        "# written by the rabbitmq-nodes Terraform module",
        'SERVER_ADDITIONAL_ERL_ARGS="+MMmcs 0"',
        'PLUGINS_DIR="/usr/local/lib/fedgate/rabbitmq-plugins:/usr/lib/rabbitmq/plugins"',
        "NODENAME=rabbit@10.40.1.23",
        "USE_LONGNAME=true",
    ]
    # RabbitMQ's scripts source the file with sh: what they see
    seen = subprocess.run(
        ["sh", "-c", f'. "{env_file}" && echo "$NODENAME $USE_LONGNAME $SERVER_ADDITIONAL_ERL_ARGS"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert seen == "rabbit@10.40.1.23 true +MMmcs 0"

    # a second run (cloud-init re-run by hand) leaves one name
    assert _run_script(env_file, imds.url).returncode == 0
    assert env_file.read_text().count("NODENAME=") == 1


def test_a_node_without_an_address_is_not_named(tmp_path: Path, imds: FakeImds) -> None:
    env_file = tmp_path / "rabbitmq-env.conf"
    env_file.write_text('SERVER_ADDITIONAL_ERL_ARGS="+MMmcs 0"\n')
    imds.local_ipv4 = "<html>captive portal</html>"
    done = _run_script(env_file, imds.url)
    assert done.returncode == 1 and "not an IPv4 address" in done.stderr
    assert env_file.read_text() == 'SERVER_ADDITIONAL_ERL_ARGS="+MMmcs 0"\n'

    # no metadata service at all: the retries end in a failure, not in a node without a name
    done = _run_script(env_file, "http://127.0.0.1:9")
    assert done.returncode != 0 and "NODENAME" not in env_file.read_text()


# --- the module alone, planned against moto ------------------------------------------------------

#: The module once per case the tests plan, by name: its inputs.  The accepted ones in one
#: root, the refused in another: one plan each answers all their cases.
ACCEPTED = {
    "five": {"node_count": 5},
    "one_opt_in": {"node_count": 1, "allow_single_node": "true"},
    "fds_200000": {"node_count": 3, "max_fds": 200000},
    "fds_65536": {"node_count": 3, "max_fds": 65536},
}
REFUSED = {
    "two": {"node_count": 2},
    "two_opt_in": {"node_count": 2, "allow_single_node": "true"},
    "one": {"node_count": 1},
}

NODES_MODULE = """
module "{name}" {{
  source = "../rabbitmq-nodes"

  name               = "boot"
  rabbitmq_conf      = "cluster_name = boot\\n"
  enabled_plugins    = "[rabbitmq_management]."
  erlang_cookie      = "cookie"
  erl_args           = "+MMmcs 0"
  instance_type      = "t3.small"
  subnet_ids         = ["subnet-0123456789abcdef0"]
  security_group_ids = ["sg-0123456789abcdef0"]
{inputs}
}}
"""


def root_module(cases: dict[str, dict[str, object]]) -> str:
    blocks = ["# written by the test: the rabbitmq-nodes module, copied alone, its network made up"]
    for name, inputs in cases.items():
        lines = "\n".join(f"  {key} = {value}" for key, value in inputs.items())
        blocks.append(NODES_MODULE.format(name=name, inputs=lines))
    return "\n".join(blocks)


@pytest.fixture(scope="module")
def module_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module folder copied on its own (nothing else of the repository)."""
    base = tmp_path_factory.mktemp("alone")
    shutil.copytree(
        TERRAFORM_DIR / "modules" / "rabbitmq-nodes",
        base / "rabbitmq-nodes",
        ignore=shutil.ignore_patterns(".terraform*"),
    )
    return base


@pytest.fixture(scope="module")
def cloud_configs(toolchain: Toolchain, module_copy: Path, moto_url: str) -> dict[str, dict[str, Any]]:
    """Each accepted case's cloud-init, by module name, from one plan against moto."""
    root = init_root(toolchain, module_copy / "accepted", root_module(ACCEPTED), moto_url, REGION)
    plan = run_tf(toolchain, root, "plan", "-input=false", "-no-color", "-out=tfplan")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    shown = json.loads(run_tf(toolchain, root, "show", "-json", "-no-color", "tfplan").stdout)
    configs = {}
    for module in shown["planned_values"]["root_module"]["child_modules"]:
        template = next(r for r in module["resources"] if r["type"] == "aws_launch_template")["values"]
        assert template["metadata_options"][0]["http_tokens"] == "required"
        configs[module["address"].removeprefix("module.")] = yaml.safe_load(
            base64.b64decode(template["user_data"]).decode()
        )
    return configs


@pytest.fixture(scope="module")
def refused(toolchain: Toolchain, module_copy: Path, moto_url: str) -> subprocess.CompletedProcess[str]:
    root = init_root(toolchain, module_copy / "refused", root_module(REFUSED), moto_url, REGION)
    return run_tf(toolchain, root, "plan", "-input=false", "-no-color")


@pytest.mark.terraform
@pytest.mark.slow
def test_the_cluster_settings_and_the_boot_order(cloud_configs: dict[str, dict[str, Any]]) -> None:
    cloud_config = cloud_configs["five"]
    files = {f["path"]: f for f in cloud_config["write_files"]}

    conf = files["/etc/rabbitmq/rabbitmq.conf"]["content"].splitlines()
    for line in (
        "cluster_formation.peer_discovery_backend = aws",
        "cluster_formation.aws.use_autoscaling_group = true",
        "cluster_formation.aws.use_private_ip = true",
        "cluster_formation.target_cluster_size_hint = 5",
        "cluster_formation.node_cleanup.interval = 60",
        "cluster_formation.node_cleanup.only_log_warning = false",
        "quorum_queue.continuous_membership_reconciliation.enabled = true",
        "quorum_queue.continuous_membership_reconciliation.target_group_size = 5",
        "quorum_queue.continuous_membership_reconciliation.auto_remove = true",
    ):
        assert line in conf

    # the script the node runs is the module's own file, unchanged
    script = files["/usr/local/sbin/fedgate-rabbitmq-nodename"]
    assert script["content"] == SCRIPT.read_text() and script["permissions"] == "0755"
    assert files["/usr/sbin/policy-rc.d"]["content"].endswith("exit 101\n")

    runcmd = [" ".join(cmd) for cmd in cloud_config["runcmd"]]
    first = {what: next(i for i, cmd in enumerate(runcmd) if what in cmd) for what in (
        "rm -f /usr/sbin/policy-rc.d",
        "systemctl stop rabbitmq-server",
        "fedgate-rabbitmq-nodename /etc/rabbitmq/rabbitmq-env.conf",
        "/var/lib/rabbitmq/.erlang.cookie",
        "chown -R rabbitmq:rabbitmq /etc/rabbitmq",
        "rm -rf /var/lib/rabbitmq/mnesia",
        "systemctl start rabbitmq-server",
    )}  # fmt: skip
    # the env file is complete (and owned by rabbitmq) before the broker's first start
    assert list(first.values()) == sorted(first.values())
    assert first["systemctl start rabbitmq-server"] == len(runcmd) - 1
    start = cloud_config["runcmd"][-1][2]
    assert start.startswith("grep -q '^NODENAME=rabbit@' /etc/rabbitmq/rabbitmq-env.conf ||")


@pytest.mark.terraform
@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "accepted"),
    [("two", False), ("two_opt_in", False), ("one", False), ("one_opt_in", True)],
    ids=["2", "2-opt-in", "1", "1-opt-in"],
)
def test_a_cluster_keeps_a_majority_through_the_loss_of_a_node_unless_one_node_is_asked_for(
    cloud_configs: dict[str, dict[str, Any]],
    refused: subprocess.CompletedProcess[str],
    case: str,
    accepted: bool,
) -> None:
    if accepted:
        assert case in cloud_configs, "the module was not planned"
        return
    assert refused.returncode != 0, "a plan of refused node counts was accepted"
    mine = module_errors(refused.stderr, case)
    assert len(mine) == 1, refused.stderr
    assert "node_count: at least 3, so that a majority survives the loss of a node" in mine[0]


@pytest.mark.terraform
@pytest.mark.slow
def test_a_descriptor_limit_above_erlangs_port_limit_raises_that_too(
    cloud_configs: dict[str, dict[str, Any]],
) -> None:
    """Each device's socket is an Erlang port, which RabbitMQ's scripts cap at 65,536 unless
    ERL_MAX_PORTS says otherwise: a gateway given 200,000 descriptors gets as many ports."""
    files = {f["path"]: f["content"] for f in cloud_configs["fds_200000"]["write_files"]}
    assert "LimitNOFILE=200000" in files["/etc/systemd/system/rabbitmq-server.service.d/fedgate.conf"]
    env = files["/etc/rabbitmq/rabbitmq-env.conf"]
    # RabbitMQ's scripts source the file with sh and leave an ERL_MAX_PORTS they find alone
    seen = subprocess.run(
        ["sh", "-c", f"{env}\nsh -c 'echo $ERL_MAX_PORTS'"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert seen == "200000", "exported, so that the emulator the scripts start sees it"

    files = {f["path"]: f["content"] for f in cloud_configs["fds_65536"]["write_files"]}
    assert "ERL_MAX_PORTS" not in files["/etc/rabbitmq/rabbitmq-env.conf"], "the scripts' own 65,536"
