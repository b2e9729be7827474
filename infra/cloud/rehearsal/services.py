"""The backend's fedgate services in the rehearsal: the routers the backend module deploys,
installed and started from their rendered cloud-init, carrying traffic into Kafka.

A service instance (network namespace of its own, like the nodes') carries out the
fedgate-service module's cloud-init: its files (router.toml, the systemd unit, the
installer), then the installer itself -- the release wheel from S3 and the secret from
Secrets Manager (moto's, on the rehearsal's network), the instance id from the metadata
service -- then the unit's ExecStart with its EnvironmentFile, as systemd would start it.

What differs from EC2, and is reported: the wheel's dependencies come from this machine's
environment (an instance takes them from PyPI through the NAT gateway; these namespaces reach
no network), the service runs as root on this machine's Python instead of a DynamicUser on
Debian 13's, and the environment overrides of `RehearsalKafka.overrides` (one broker, a
private CA).  The internal load balancer's name resolves, inside each instance, to the nodes
behind it (its /etc/hosts), as the VPC's DNS answers with the balancer's addresses.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from backend.errors import FedgateError
from backend.kafka_security import KafkaSecurity
from infra.cloud.rehearsal.hosts import Host
from infra.cloud.rehearsal.instance import signal_group
from infra.cloud.rehearsal.render import CloudConfig
from infra.local.layout import ROLE_KAFKA, NodeSpec
from infra.local.ports import free_port
from infra.local.services import KafkaNode
from infra.local.settings import LocalSettings
from infra.local.tls import LocalCA

#: what the fedgate-service module's instances hold, mapped into the instance's folder
INSTANCE_PATHS = (
    "/etc/fedgate",
    "/etc/systemd/system",
    "/opt/fedgate",
    "/usr/local/sbin",
    "/var/lib/fedgate-",
)
#: moto's credentials, as the instance profile gives an instance its own
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class ServiceError(FedgateError):
    """A service instance could not install or start its service; the message says which step."""


def systemd_env_file(text: str) -> dict[str, str]:
    """An EnvironmentFile's NAME="value" lines (systemd's quoting), as systemd reads them."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.partition("=")
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        out[name] = value
    return out


@dataclass(frozen=True)
class Unit:
    """What the rehearsal reads of a systemd unit's [Service] section."""

    exec_start: tuple[str, ...]
    environment_file: str
    environment: dict[str, str]
    working_directory: str
    #: who gets the stop signal: control-group (systemd's default: every process of the
    #: unit at once) or mixed / process (the main process; mixed SIGKILLs the rest after it)
    kill_mode: str = "control-group"

    @classmethod
    def parse(cls, text: str) -> Unit:
        values: dict[str, list[str]] = {}
        for line in text.splitlines():
            if "=" in line and not line.lstrip().startswith("#"):
                key, _, value = line.strip().partition("=")
                values.setdefault(key, []).append(value)
        if "ExecStart" not in values:
            raise ServiceError("the unit has no ExecStart")
        env = dict(v.split("=", 1) for v in values.get("Environment", []))
        return cls(
            tuple(shlex.split(values["ExecStart"][0])),
            values.get("EnvironmentFile", [""])[0],
            env,
            values.get("WorkingDirectory", ["/"])[0],
            values.get("KillMode", ["control-group"])[0],
        )


class ServiceInstance:
    """One instance of the fedgate-service module: its cloud-init carried out, then its unit."""

    def __init__(self, host: Host, folder: Path, cloud: CloudConfig, overrides: dict[str, str]):
        self.host = host
        self.dir = folder
        self.cloud = cloud
        self.overrides = overrides
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = folder / "service.log"
        self.unit: Unit | None = None

    @property
    def name(self) -> str:
        return self.host.netns

    def path(self, instance_path: str) -> str:
        """`instance_path` (as the instance sees it) in this machine's folder of the instance."""
        if instance_path.startswith(INSTANCE_PATHS):
            return str(self.dir / instance_path.lstrip("/"))
        return instance_path

    def install(self, moto_url: str, imds_url: str) -> None:
        """cloud-init: write_files, then each runcmd up to the unit's start."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for f in self.cloud.files.values():
            dest = Path(self.path(f.path))
            if str(dest) == f.path:
                raise ServiceError(f"{self.name}: cloud-init writes {f.path}, outside what is rehearsed")
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(f.content)
            dest.chmod(int(f.permissions, 8))
        for cmd in self.cloud.runcmd:
            match cmd:
                case (installer, *args) if installer.endswith("/fedgate-install"):
                    self._install(installer, list(args), moto_url, imds_url)
                case ("systemctl", "daemon-reload"):
                    pass
                case ("systemctl", "enable", "--now", unit):
                    self.unit = Unit.parse(Path(self.path(f"/etc/systemd/system/{unit}")).read_text())
                case _:
                    raise ServiceError(
                        f"{self.name}: cloud-init command {list(cmd)} is not rehearsed "
                        "(infra/cloud/rehearsal/services.py)"
                    )
        if self.unit is None:
            raise ServiceError(f"{self.name}: cloud-init never starts the unit")

    def _install(self, installer: str, args: list[str], moto_url: str, imds_url: str) -> None:
        if "--env-file" in args:
            i = args.index("--env-file") + 1
            args[i] = self.path(args[i])
        argv = [
            sys.executable,
            self.path(installer),
            *args,
            "--prefix",
            self.path("/opt/fedgate"),
            "--endpoint-url",
            moto_url,
            "--imds-url",
            imds_url,
            # the dependencies: this machine's (below), not PyPI's, which no namespace reaches
            "--pip-arg=--no-deps",
        ]
        done = subprocess.run(
            self.host.command(argv),
            env={**os.environ, **AWS_ENV},
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise ServiceError(f"{self.name}: fedgate-install failed: {(done.stderr or done.stdout)[-2000:]}")
        venv_lib = Path(self.path("/opt/fedgate/venv/lib"))
        (packages,) = venv_lib.glob("python3*/site-packages")
        # a path line: this environment's packages after the wheel's own (its .pth files, an
        # editable install of fedgate among them, are not read: the wheel's code runs)
        (packages / "zz-rehearsal-dependencies.pth").write_text(
            "\n".join(p for p in site.getsitepackages() if Path(p).is_dir()) + "\n"
        )

    def env(self) -> dict[str, str]:
        """The environment systemd gives the unit: its Environment=, its EnvironmentFile."""
        assert self.unit is not None
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        env |= {k: self.path(v) for k, v in self.unit.environment.items()}
        if self.unit.environment_file:
            env |= systemd_env_file(Path(self.path(self.unit.environment_file)).read_text())
        return env | self.overrides

    def workdir(self) -> Path:
        """The unit's WorkingDirectory (its StateDirectory, which systemd creates)."""
        assert self.unit is not None
        path = Path(self.path(self.unit.working_directory))
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self) -> None:
        """The unit's ExecStart, in the instance's network, as systemd starts it."""
        assert self.unit is not None
        argv = [self.path(a) for a in self.unit.exec_start]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.host.command(argv),
                env=self.env(),
                cwd=self.workdir(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def running_code(self) -> str:
        """Where the service's package is imported from in the installed environment."""
        assert self.unit is not None
        python, _, module, *_ = self.unit.exec_start
        done = subprocess.run(
            [self.path(python), "-c", f"import {module}; print({module}.__file__)"],
            cwd=self.workdir(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout.strip() or done.stderr.strip()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """The instance is gone at once (SIGKILL), as a terminated instance."""
        # the whole group, also what a main process that already exited left behind
        if signal_group(self.proc, signal.SIGKILL):
            assert self.proc is not None
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 120) -> int | None:
        """SIGTERM as systemd's stop sends it (the unit's KillMode: to the main process, or to
        every process of the unit); SIGKILL to what is left once the main process exited or
        after TimeoutStopSec.  The main process's exit code (None: it had to be killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            mode = self.unit.kill_mode if self.unit else "control-group"
            if mode == "control-group":
                signal_group(self.proc, signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        signal_group(self.proc, signal.SIGKILL)  # what the main process left (mixed)
        return self.proc.returncode


class RehearsalKafka(KafkaNode):
    """The operator's own Kafka (the backend example's kafka_bootstrap): one broker on the
    rehearsal's network, its SASL_SSL listener (SCRAM over TLS, what MSK offers) for the
    routers, with the user the backend module gives them."""

    scram_user: ClassVar[str] = "fedgate"

    @classmethod
    def create(cls, settings: LocalSettings, host: str, folder: Path, password: str) -> RehearsalKafka:
        from dataclasses import replace

        shutil.rmtree(folder, ignore_errors=True)  # an earlier rehearsal's, with its own SCRAM password
        local = replace(settings, host=host, state_dir=folder, tls=True, kafka_brokers=1)
        ports = {p: free_port(host) for p in ("bootstrap", "controller", "sasl")}
        LocalCA(folder / "tls").ensure_ca()
        return cls(NodeSpec("kafka", ROLE_KAFKA, None, ports), local, {"kafka_client": password}, 0)

    @property
    def security(self) -> KafkaSecurity:
        security = self.sasl_security()
        assert security is not None
        return security

    def overrides(self) -> dict[str, str]:
        """What the routers' environment changes of what the module rendered: one broker
        here (MSK has three), its certificate signed by the rehearsal's CA."""
        return {
            "FEDGATE_ROUTER_KAFKA_REPLICATION": "1",
            "FEDGATE_ROUTER_KAFKA_CA_FILE": str(self.local_ca.ca_cert),
        }
