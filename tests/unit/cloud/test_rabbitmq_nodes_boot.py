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

from .conftest import TERRAFORM_DIR, moto_override, run_tf

SCRIPT = TERRAFORM_DIR / "modules" / "rabbitmq-nodes" / "files" / "rabbitmq-nodename.sh"
TOKEN = "AQAEAFakeTokenOfTheStandIn=="


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

ROOT_MODULE = """# written by the test: the rabbitmq-nodes module, copied alone, its network made up
variable "node_count" {
  type = number
}

variable "allow_single_node" {
  type    = bool
  default = false
}

variable "max_fds" {
  type    = number
  default = null
}

module "nodes" {
  source = "../rabbitmq-nodes"

  name               = "boot"
  rabbitmq_conf      = "cluster_name = boot\\n"
  enabled_plugins    = "[rabbitmq_management]."
  erlang_cookie      = "cookie"
  erl_args           = "+MMmcs 0"
  instance_type      = "t3.small"
  node_count         = var.node_count
  allow_single_node  = var.allow_single_node
  max_fds            = var.max_fds
  subnet_ids         = ["subnet-0123456789abcdef0"]
  security_group_ids = ["sg-0123456789abcdef0"]
}
"""


@pytest.fixture(scope="module")
def alone(toolchain: Toolchain, tmp_path_factory: pytest.TempPathFactory, moto_url: str) -> Path:
    """The module folder copied on its own (nothing else of the repository) beside a root module."""
    base = tmp_path_factory.mktemp("alone")
    shutil.copytree(
        TERRAFORM_DIR / "modules" / "rabbitmq-nodes",
        base / "rabbitmq-nodes",
        ignore=shutil.ignore_patterns(".terraform*"),
    )
    root = base / "root"
    root.mkdir()
    (root / "main.tf").write_text(ROOT_MODULE)
    (root / "moto_override.tf").write_text(moto_override(moto_url, "eu-west-1"))
    init = run_tf(toolchain, root, "init", "-input=false", "-no-color")
    assert init.returncode == 0, init.stderr
    return root


def _plan(toolchain: Toolchain, root: Path, *tf_vars: str) -> subprocess.CompletedProcess[str]:
    return run_tf(toolchain, root, "plan", "-input=false", "-no-color", "-out=tfplan", *tf_vars)


def _cloud_config(toolchain: Toolchain, root: Path) -> dict[str, Any]:
    shown = json.loads(run_tf(toolchain, root, "show", "-json", "-no-color", "tfplan").stdout)
    (module,) = shown["planned_values"]["root_module"]["child_modules"]
    template = next(r for r in module["resources"] if r["type"] == "aws_launch_template")["values"]
    assert template["metadata_options"][0]["http_tokens"] == "required"
    cloud_config: dict[str, Any] = yaml.safe_load(base64.b64decode(template["user_data"]).decode())
    return cloud_config


@pytest.mark.terraform
@pytest.mark.slow
def test_the_cluster_settings_and_the_boot_order(toolchain: Toolchain, alone: Path) -> None:
    plan = _plan(toolchain, alone, "-var=node_count=5")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    cloud_config = _cloud_config(toolchain, alone)
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
    ("tf_vars", "accepted"),
    [
        (["-var=node_count=2"], False),
        (["-var=node_count=2", "-var=allow_single_node=true"], False),
        (["-var=node_count=1"], False),
        (["-var=node_count=1", "-var=allow_single_node=true"], True),
    ],
    ids=["2", "2-opt-in", "1", "1-opt-in"],
)
def test_a_cluster_keeps_a_majority_through_the_loss_of_a_node_unless_one_node_is_asked_for(
    toolchain: Toolchain, alone: Path, tf_vars: list[str], accepted: bool
) -> None:
    plan = _plan(toolchain, alone, *tf_vars)
    assert (plan.returncode == 0) is accepted, plan.stdout[-2000:] + plan.stderr
    if not accepted:
        assert "node_count: at least 3, so that a majority survives the loss of a node" in plan.stderr


@pytest.mark.terraform
@pytest.mark.slow
def test_a_descriptor_limit_above_erlangs_port_limit_raises_that_too(
    toolchain: Toolchain, alone: Path
) -> None:
    """Each device's socket is an Erlang port, which RabbitMQ's scripts cap at 65,536 unless
    ERL_MAX_PORTS says otherwise: a gateway given 200,000 descriptors gets as many ports."""
    plan = _plan(toolchain, alone, "-var=node_count=3", "-var=max_fds=200000")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    files = {f["path"]: f["content"] for f in _cloud_config(toolchain, alone)["write_files"]}
    assert "LimitNOFILE=200000" in files["/etc/systemd/system/rabbitmq-server.service.d/fedgate.conf"]
    env = files["/etc/rabbitmq/rabbitmq-env.conf"]
    # RabbitMQ's scripts source the file with sh and leave an ERL_MAX_PORTS they find alone
    seen = subprocess.run(
        ["sh", "-c", f"{env}\nsh -c 'echo $ERL_MAX_PORTS'"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert seen == "200000", "exported, so that the emulator the scripts start sees it"

    plan = _plan(toolchain, alone, "-var=node_count=3", "-var=max_fds=65536")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    files = {f["path"]: f["content"] for f in _cloud_config(toolchain, alone)["write_files"]}
    assert "ERL_MAX_PORTS" not in files["/etc/rabbitmq/rabbitmq-env.conf"], "the scripts' own 65,536"
