"""How a RabbitMQ node process (and its epmd) is started: the one module that knows.

fedgate runs RabbitMQ 4.0 from Debian 13's packages (`rabbitmq_release =
"4.0"`).  Where that release comes from depends on the host:

- on Debian 13 the system's own `rabbitmq-server` is 4.0: nodes run it
  directly, as any Debian package;
- on Debian 12 `make setup` builds a minimal Debian 13 root once
  (infra/setup/rabbitmq4.sh, in the cache folder), and each node runs
  inside it: `unshare --mount` gives the node a private mount namespace,
  /proc, /dev and the folders it needs (the federation's state folder) are
  bound into the root there, and `chroot` runs the node.  The host's
  network is shared, so ports work as on the host; the mounts vanish with
  the process.  Every step `exec`s, so the pid the driver records is the
  node's own and SIGTERM reaches RabbitMQ directly (bubblewrap would stay
  in between as a monitor that does not pass signals on).

`rabbitmq_release = "3.10"` runs Debian 12's own package as before (the
settings' `rabbitmq_bin_dir`).

Other programs of the same Debian 13 release run the same way
(`debian13_runtime(cache_dir).command(...)`, `check_program`): the
benchmarks' baseline broker is the root's Mosquitto, whatever release the
nodes run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from backend.errors import FedgateError

RELEASES = ("4.0", "3.10")
#: Where a Debian root keeps RabbitMQ's scripts and Erlang's port mapper.
RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
EPMD = Path("/usr/bin/epmd")
ERLC = Path("/usr/bin/erlc")
#: The benchmarks' baseline broker, from the same Debian 13 release (rabbitmq4.sh puts it in the root).
MOSQUITTO = Path("/usr/sbin/mosquitto")

# Mounts the node's folders into the root and chroots; each argument is passed
# positionally, so no path is ever parsed by the shell.
_ENTER_ROOT = """set -e
root=$1; n=$2; shift 2
mount --rbind /proc "$root/proc"
mount --rbind /dev "$root/dev"
while [ "$n" -gt 0 ]; do
  mkdir -p "$root$1"; mount --bind "$1" "$root$1"; shift; n=$((n - 1))
done
exec chroot "$root" "$@"
"""


class BrokerRuntimeError(FedgateError):
    """The RabbitMQ release asked for is not installed here (make setup installs it)."""


def debian_major(path: Path = Path("/etc/debian_version")) -> int:
    try:
        return int(path.read_text().split(".")[0])
    except (OSError, ValueError):
        return 0


@dataclass(frozen=True)
class BrokerRuntime:
    """Where the RabbitMQ release's programs are, and how to run one of them."""

    release: str
    #: a Debian 13 root the node runs in (None: the host's own packages)
    root: Path | None
    #: rabbitmq-server and friends, as the node sees them (inside the root if any)
    bin_dir: Path

    def installed_version(self) -> str | None:
        """The RabbitMQ version the package holds (from its lib folder), None if missing."""
        lib = (self.root or Path("/")) / str(self.bin_dir.parent / "lib").lstrip("/")
        found = sorted(p.name.removeprefix("rabbitmq_server-") for p in lib.glob("rabbitmq_server-*"))
        return found[-1] if found else None

    def check(self, who: str) -> None:
        """Fail at once, naming `who`, when the release's programs are not there."""
        where = (self.root or Path("/")) / str(self.bin_dir / "rabbitmq-server").lstrip("/")
        if not where.exists():
            how = (
                "run `make setup` (it builds RabbitMQ 4.0's Debian 13 root)"
                if self.root is not None
                else f"install Debian's rabbitmq-server {self.release} (make setup installs 4.0 only)"
                if self.release == "3.10"
                else "run `make setup` (installs Debian's rabbitmq-server)"
            )
            raise BrokerRuntimeError(f"{who}: {where} not found; {how}")
        self._check_can_enter_root(who, f"RabbitMQ {self.release}")

    def host_path(self, program: Path) -> Path:
        """Where `program` (a path as the node sees it) is in this host's file system."""
        return (self.root or Path("/")) / str(program).lstrip("/")

    def check_program(self, who: str, program: Path) -> None:
        """Like check(), for another program of the release (e.g. MOSQUITTO)."""
        where = self.host_path(program)
        if not where.exists():
            how = (
                "run `make setup` (it builds the Debian 13 root with it)"
                if self.root is not None
                else f"install Debian's package holding {program} (make setup installs it)"
            )
            raise BrokerRuntimeError(f"{who}: {where} not found; {how}")
        self._check_can_enter_root(who, program.name)

    def _check_can_enter_root(self, who: str, what: str) -> None:
        if self.root is not None:
            if os.geteuid() != 0:
                raise BrokerRuntimeError(
                    f"{who}: {what} runs in a Debian 13 root here, which needs root "
                    "(a private mount namespace); run as root, or on Debian 13"
                )
            if not shutil.which("unshare") or not shutil.which("chroot"):
                raise BrokerRuntimeError(f"{who}: unshare and chroot (util-linux, coreutils) are missing")

    def command(self, program: Path, args: list[str], shared: list[Path]) -> list[str]:
        """argv that runs `program` (a path as the node sees it) with `args`; `shared` are
        host folders the program reads or writes (bound at the same path in the root)."""
        argv = [str(program), *args]
        if self.root is None:
            return argv
        folders = [str(p.resolve()) for p in shared]
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            _ENTER_ROOT,
            "fedgate-node",
            str(self.root),
            str(len(folders)),
            *folders,
            *argv,
        ]

    def package_plugins_dir(self) -> Path:
        """The package's own plugins folder, as the node sees it."""
        version = self.installed_version()
        return self.bin_dir.parent / "lib" / f"rabbitmq_server-{version}" / "plugins"

    def build_plugin(self, source: Path, dest: Path) -> Path:
        """Compile an Erlang plugin of fedgate's (`source`/<app>.app and `source`/src/*.erl)
        with this release's own compiler and headers into `dest`/<app>-<vsn>/ebin, a folder
        RabbitMQ loads plugins from.  A plugin must be built by the Erlang that runs it; a
        build newer than its sources is kept.  Returns the plugin's folder."""
        (app_file,) = source.glob("*.app")
        vsn = re.search(r'\{vsn,\s*"([^"]+)"\}', app_file.read_text())
        if vsn is None:
            raise BrokerRuntimeError(f"{app_file}: no {{vsn, ...}}")
        folder = dest / f"{app_file.stem}-{vsn.group(1)}"
        ebin = folder / "ebin"
        sources = [app_file, *sorted((source / "src").glob("*.erl"))]
        built = [ebin / app_file.name, *(ebin / f"{s.stem}.beam" for s in sources[1:])]
        newest = max(s.stat().st_mtime for s in sources)
        if all(b.exists() and b.stat().st_mtime >= newest for b in built):
            return folder
        ebin.mkdir(parents=True, exist_ok=True)
        erlc = ERLC if self.root is not None else Path(shutil.which("erlc") or ERLC)
        argv = self.command(
            erlc, ["-o", str(ebin.resolve()), *(str(s.resolve()) for s in sources[1:])], [source, dest]
        )
        env = {**os.environ, "ERL_LIBS": str(self.package_plugins_dir())}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise BrokerRuntimeError(f"compiling {source.name}: {(done.stderr or done.stdout).strip()}")
        shutil.copyfile(app_file, ebin / app_file.name)
        return folder

    def rabbitmq(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def epmd(self) -> Path:
        if self.root is None:
            return Path(shutil.which("epmd") or EPMD)
        return EPMD


def broker_runtime(release: str, cache_dir: Path, rabbitmq_bin_dir: Path) -> BrokerRuntime:
    """The runtime of a release on this host (see the module docstring)."""
    if release == "3.10" or (release == "4.0" and debian_major() >= 13):
        return BrokerRuntime(release, None, rabbitmq_bin_dir)
    if release == "4.0":
        return BrokerRuntime(release, cache_dir / "rabbitmq-4.0" / "root", RABBITMQ_BIN)
    raise BrokerRuntimeError(f"rabbitmq_release: one of {', '.join(RELEASES)}, got {release!r}")


def debian13_runtime(cache_dir: Path) -> BrokerRuntime:
    """Debian 13's programs on this host, whichever release the nodes run: the system's own on
    Debian 13, the cached root on Debian 12 (which holds the benchmarks' Mosquitto too)."""
    return broker_runtime("4.0", cache_dir, RABBITMQ_BIN)
