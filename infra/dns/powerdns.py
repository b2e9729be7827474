"""A PowerDNS Authoritative server that serves one zone (infra/dns/zone.py) from a folder of
its own: its configuration, the zone file and its control socket.  Debian's `pdns-server`
and `pdns-backend-bind` (`make setup` installs them); the zone is read by the bind backend, so
a change is a rewritten file and a `bind-reload-now`, with no database.  What the zone answers
follows the MQTT health checks of infra/dns/health.py; infra/dns/serve.py runs both."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from infra.dns.zone import ZoneSpec, zone_file

PDNS_SERVER = Path("/usr/sbin/pdns_server")
PDNS_CONTROL = Path("/usr/bin/pdns_control")
#: A Unix socket's path holds 107 bytes at most (sun_path, its NUL the 108th)
MAX_SOCKET_PATH = 107
CONTROL_SOCKET = "pdns.controlsocket"


class PowerDNSError(RuntimeError):
    pass


def missing() -> str | None:
    """Why PowerDNS cannot run here, or None."""
    for program in (PDNS_SERVER, PDNS_CONTROL):
        if not program.exists():
            return (
                f"{program} not found: run `make setup` (installs Debian's pdns-server and pdns-backend-bind)"
            )
    if not Path("/usr/lib/x86_64-linux-gnu/pdns/libbindbackend.so").exists() and not list(
        Path("/usr/lib").glob("*/pdns/libbindbackend.so")
    ):
        return "PowerDNS's bind backend is missing: install pdns-backend-bind (`make setup` does)"
    return None


@dataclass
class PowerDNS:
    """The server's files under `folder`; `argv()` runs it in the foreground."""

    folder: Path
    spec: ZoneSpec
    address: str = "127.0.0.1"
    port: int = 5353
    #: its webserver's port, for Prometheus's scrape of /metrics (0: no webserver)
    webserver_port: int = 0

    @property
    def socket_dir(self) -> Path:
        """Where the control socket is: the server's folder, or, when that path is too long for
        a Unix socket (a deep state dir), a short folder in the temporary directory named
        after it -- the same for every process that reads this folder's pdns.conf."""
        if len(str(self.folder / CONTROL_SOCKET)) <= MAX_SOCKET_PATH:
            return self.folder
        digest = hashlib.sha256(str(self.folder.resolve()).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"fedgate-pdns-{digest}"

    def remove_socket_dir(self) -> None:
        """The short socket folder, if one was used, once the server has stopped."""
        if self.socket_dir != self.folder:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    @property
    def zone_path(self) -> Path:
        return self.folder / f"{self.spec.domain}.zone"

    def write(self, serial: int = 1) -> None:
        """(Re)write the configuration and the zone."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(mode=0o700, exist_ok=True)
        (self.folder / "named.conf").write_text(
            f'zone "{self.spec.domain}" {{ type master; file "{self.zone_path}"; }};\n'
        )
        self._write_zone(self.spec, serial)
        (self.folder / "pdns.conf").write_text(
            "\n".join(
                [
                    "launch=bind",
                    f"bind-config={self.folder / 'named.conf'}",
                    f"local-address={self.address}",
                    f"local-port={self.port}",
                    "enable-lua-records=yes",
                    # the answer must follow a health change at once: no packet cache
                    "cache-ttl=0",
                    "negquery-cache-ttl=0",
                    "query-cache-ttl=0",
                    "zone-cache-refresh-interval=0",
                    f"socket-dir={self.socket_dir}",
                    "guardian=no",
                    "daemon=no",
                    "disable-syslog=yes",
                    "log-timestamp=yes",
                    *(
                        [
                            "webserver=yes",
                            f"webserver-address={self.address}",
                            f"webserver-port={self.webserver_port}",
                            # who may read /metrics: this host (its Prometheus)
                            "webserver-allow-from=127.0.0.0/8,::1",
                        ]
                        if self.webserver_port
                        else ["webserver=no"]
                    ),
                    "security-poll-suffix=",
                    "",
                ]
            )
        )

    def argv(self) -> list[str]:
        return [str(PDNS_SERVER), f"--config-dir={self.folder}"]

    def _write_zone(self, spec: ZoneSpec, serial: int) -> None:
        # whole or not at all: the server may read the file while it is being written
        tmp = self.zone_path.with_name(self.zone_path.name + ".new")
        tmp.write_text(zone_file(spec, serial))
        tmp.replace(self.zone_path)

    def reload(self, spec: ZoneSpec, serial: int) -> None:
        """Serve `spec` from now on (a region added or removed, a gateway's health changed):
        the zone rewritten, then read again by the running server."""
        self.spec = spec
        self._write_zone(spec, serial)
        control = shutil.which("pdns_control") or str(PDNS_CONTROL)
        done = subprocess.run(
            [control, f"--config-dir={self.folder}", "bind-reload-now", spec.domain],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if done.returncode != 0 or "parsed into memory" not in done.stdout:
            raise PowerDNSError(f"reloading {spec.domain}: {(done.stdout + done.stderr).strip()}")
