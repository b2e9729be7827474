"""A PostgreSQL server of its own, for the tables' shared Iceberg catalog where the cloud keeps
it in a database (RDS PostgreSQL): the tests and the cloud rehearsal start one.

Debian's server binaries (package postgresql, `make setup`), a cluster made by initdb in a
folder of its own, listening on the given address only, its one user a password login
(SCRAM) as RDS's master user is.  PostgreSQL refuses to run as root: as root the cluster
belongs to Debian's `postgres` user.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

from backend.errors import FedgateError
from infra.local.ports import free_port


class PostgresError(FedgateError):
    """The server could not be made or started; the message says which step, with its log."""


def server_bin() -> Path:
    """The newest installed PostgreSQL's bin folder."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise PostgresError("PostgreSQL's server is not installed: run `make setup` (package postgresql)")
    return Path(found[-1]).parent


class PostgresServer:
    """`with PostgresServer() as pg:` -- pg.jdbc_uri, pg.user, pg.password until the block ends."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        user: str = "fedgate",
        database: str = "fedgate",
        password: str = "",
    ):
        self.host = host
        self.port = port or free_port(host)
        self.user = user
        self.database = database
        self.password = password or secrets.token_urlsafe(18)
        self.dir: Path | None = None

    @property
    def jdbc_uri(self) -> str:
        return f"jdbc:postgresql://{self.host}:{self.port}/{self.database}"

    def _run(self, argv: list[str], step: str) -> None:
        as_owner = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run(
            [*as_owner, *argv],
            env={**os.environ, "PGPASSWORD": self.password},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            log = self.dir / "server.log" if self.dir else None
            more = log.read_text()[-2000:] if log and log.exists() else ""
            raise PostgresError(f"PostgreSQL {step}: {(done.stderr or done.stdout).strip()[-2000:]}\n{more}")

    def start(self) -> None:
        bin_dir = server_bin()
        # not under a root-only folder (pytest's tmp): the server's user must reach it
        self.dir = Path(tempfile.mkdtemp(prefix="fedgate-postgres-"))
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.dir, owner.pw_uid, owner.pw_gid)
        pwfile = self.dir / "pwfile"
        pwfile.write_text(self.password + "\n")
        if os.geteuid() == 0:
            os.chown(pwfile, owner.pw_uid, owner.pw_gid)
        data = self.dir / "data"
        try:
            self._run(
                [str(bin_dir / "initdb"), "-D", str(data), "-U", self.user, f"--pwfile={pwfile}",
                 "--auth=scram-sha-256", "-E", "UTF8", "--no-instructions"],
                "initdb",
            )  # fmt: skip
            pwfile.unlink()
            # a password login from any address it listens on (only `host`), as RDS takes one
            # from whatever its security group admits; initdb allows loopback only
            with (data / "pg_hba.conf").open("a") as hba:
                hba.write("host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n")
            options = f"-h {self.host} -p {self.port} -k {self.dir}"
            self._run(
                [str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(self.dir / "server.log"),
                 "-w", "-t", "60", "start"],
                "start",
            )  # fmt: skip
            self._run(
                [
                    str(bin_dir / "createdb"),
                    "-h",
                    self.host,
                    "-p",
                    str(self.port),
                    "-U",
                    self.user,
                    self.database,
                ],
                "createdb",
            )
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """A fast shutdown (clients disconnected), then the folder goes.  Safe twice."""
        if self.dir is None:
            return
        data = self.dir / "data"
        if (data / "postmaster.pid").exists():
            # the folder goes below either way
            with contextlib.suppress(PostgresError):
                self._run([str(server_bin() / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"], "stop")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
