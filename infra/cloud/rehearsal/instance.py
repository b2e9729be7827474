"""One instance of the rehearsal: cloud-init's files and commands, then RabbitMQ, in its own
network namespace.

The instance's file system is Debian 13's root that `make setup` builds (the release the
module's nodes install) with the instance's own folders mounted where the node looks for
them: /etc/rabbitmq, /var/lib/rabbitmq, /var/log/rabbitmq, and /usr/local/sbin (the node-name
script cloud-init writes there, and a `systemctl` that starts the broker the way the
package's unit would, in the foreground).

cloud-init's commands run in order; each is one this file knows how to carry out here, and
an unknown one stops the rehearsal (the module changed: teach the rehearsal).  The last one,
the module's own guarded start (no node name, or another RabbitMQ release: not started),
runs as it is, inside the instance.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from backend.errors import FedgateError
from backend.polling import wait_until
from infra.cloud.rehearsal.hosts import Host
from infra.cloud.rehearsal.render import CloudConfig
from infra.local.broker import EPMD, RABBITMQ_BIN

#: the instance's folders, mounted at the same path in the Debian root (/usr/local/*/fedgate:
#: the gateway's own plugin, its sources and what the node compiles them into)
MOUNTED = (
    "/etc/rabbitmq",
    "/var/lib/rabbitmq",
    "/var/log/rabbitmq",
    "/usr/local/sbin",
    "/usr/local/src/fedgate",
    "/usr/local/lib/fedgate",
)
ENV_FILE = "/etc/rabbitmq/rabbitmq-env.conf"

# Mounts the instance's folders into the root and runs the command there (chroot), with the
# environment systemd gives the package's unit: HOME is rabbitmq's (the cookie's folder).
_ENTER = """set -e
root=$1; dir=$2; mounts=$3; shift 3
mount --rbind /proc "$root/proc"
mount --rbind /dev "$root/dev"
for m in $mounts; do mkdir -p "$root$m"; mount --bind "$dir$m" "$root$m"; done
exec chroot "$root" env -i HOME=/var/lib/rabbitmq LANG=C.UTF-8 \\
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
"""

#: `systemctl` inside the instance: `start rabbitmq-server` runs the broker in the
#: foreground (the rehearsal holds its process group); anything else is refused.
_SYSTEMCTL = f"""#!/bin/sh
# the cloud rehearsal's systemctl: only what the module's start command asks of it
if [ "$1 $2" = "start rabbitmq-server" ]; then exec {RABBITMQ_BIN}/rabbitmq-server; fi
echo "rehearsal systemctl: '$*' is not rehearsed" >&2
exit 1
"""


class InstanceError(FedgateError):
    """An instance could not boot its node; the message names the instance and the step."""


class Instance:
    def __init__(self, host: Host, folder: Path, root: Path, cloud: CloudConfig):
        self.host = host
        self.dir = folder
        self.root = root
        self.cloud = cloud
        self.proc: subprocess.Popen[bytes] | None = None
        self.epmd: subprocess.Popen[bytes] | None = None
        self.log = folder / "boot.log"

    @property
    def name(self) -> str:
        return self.host.netns

    def node_name(self) -> str | None:
        """The NODENAME the node-name script wrote, None before it ran."""
        env = self.dir / ENV_FILE.lstrip("/")
        for line in env.read_text().splitlines() if env.exists() else []:
            if line.startswith("NODENAME="):
                return line.split("=", 1)[1]
        return None

    # --- cloud-init --------------------------------------------------------------

    def write_files(self, conf: Callable[[str], str]) -> None:
        """cloud-init's write_files into the instance's folder; `conf` may change
        rabbitmq.conf (the rehearsal's peer discovery)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        for m in MOUNTED:
            (self.dir / m.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for f in self.cloud.files.values():
            dest = self.dir / f.path.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            content = conf(f.content) if f.path == "/etc/rabbitmq/rabbitmq.conf" else f.content
            dest.write_text(content)
            dest.chmod(int(f.permissions, 8))
        systemctl = self.dir / "usr/local/sbin/systemctl"
        systemctl.write_text(_SYSTEMCTL)
        systemctl.chmod(0o755)

    def run_commands(self, imds_url: str) -> None:
        """cloud-init's runcmd, in order; the last (the start) leaves the broker running."""
        for cmd in self.cloud.runcmd:
            self._run(cmd, imds_url)

    def _run(self, cmd: tuple[str, ...], imds_url: str) -> None:
        match cmd:
            case ("rm", "-f", path):
                (self.dir / path.lstrip("/")).unlink(missing_ok=True)
            case ("rm", "-rf", path):
                shutil.rmtree(self.dir / path.lstrip("/"), ignore_errors=True)
            case ("systemctl", "stop" | "daemon-reload", *_) | ("systemctl", "daemon-reload"):
                pass  # nothing runs yet; no unit files are rehearsed
            case ("chown", *_):
                pass  # the rehearsal's node runs as root
            case ("install", *opts, src, dest) if "-m" in opts:
                mode = opts[opts.index("-m") + 1]
                target = self.dir / dest.lstrip("/")
                shutil.copyfile(self.dir / src.lstrip("/"), target)
                target.chmod(int(mode, 8))
            case (script, env_file) if script.startswith("/usr/local/sbin/"):
                # the node-name script, with this machine's curl, from inside the instance's
                # network: the metadata service sees the instance's address
                done = subprocess.run(
                    self.host.command(
                        ["sh", str(self.dir / script.lstrip("/")), str(self.dir / env_file.lstrip("/"))]
                    ),
                    env={**os.environ, "FEDGATE_IMDS_URL": imds_url},
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                if done.returncode != 0:
                    raise InstanceError(f"{self.name}: {script} failed: {done.stderr.strip()}")
            case ("sh", "-c", start) if "systemctl start rabbitmq-server" in start:
                self._start(start)
            case ("sh", "-c", script):
                # any other shell step (compiling a plugin) runs inside the instance, to its end
                step = self._spawn(["sh", "-c", script])
                if step.wait(timeout=300) != 0:
                    raise InstanceError(
                        f"{self.name}: cloud-init command failed (see {self.log}): {script[:200]}"
                    )
            case _:
                raise InstanceError(
                    f"{self.name}: cloud-init command {list(cmd)} is not rehearsed "
                    "(infra/cloud/rehearsal/instance.py)"
                )

    def _start(self, start: str) -> None:
        # Erlang's port mapper first, as its own service (Debian's epmd.service on a node):
        # started by the broker instead, it would daemonize out of the rehearsal's reach
        self.epmd = self._spawn([str(EPMD)])
        self.proc = self._spawn(["sh", "-c", start])

    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        """`argv` inside the instance (its network, its folders in the Debian root), in a
        session of its own: stop() signals its whole process group."""
        command = self.host.command(
            ["sh", "-c", _ENTER, "fedgate-instance", str(self.root), str(self.dir), " ".join(MOUNTED), *argv]
        )
        with self.log.open("ab") as out:
            return subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    # --- lifecycle ---------------------------------------------------------------

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """The instance dies at once: SIGKILL to everything it runs."""
        for proc in (self.proc, self.epmd):
            signal_group(proc, signal.SIGKILL)
        for proc in (self.proc, self.epmd):
            if proc is not None:
                proc.wait(timeout=30)

    def stop(self, timeout: float = 60) -> None:
        """The broker first, with SIGTERM as a shutdown would (SIGKILL after `timeout`),
        then epmd.  Safe twice."""
        for proc in (self.proc, self.epmd):
            _stop_group(proc, timeout)


def signal_group(proc: subprocess.Popen[bytes] | None, sig: signal.Signals) -> bool:
    """Signal `proc`'s process group; False when none of it is left."""
    if proc is None:
        return False
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return False
    return True


def _group_left(proc: subprocess.Popen[bytes]) -> bool:
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_group(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    if proc is None or not signal_group(proc, signal.SIGTERM):
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=30)
    # what the leader leaves behind in its group (port programs) gets a moment, then SIGKILL
    wait_until(lambda: not _group_left(proc), 10, 0.2)
    signal_group(proc, signal.SIGKILL)
