"""The rehearsal's instances' network: one network namespace per instance behind a bridge.

Each instance has its own network stack, as an EC2 instance does: its own address on a
subnet of the rehearsal's (eth0), its own loopback, its own ports, so every node listens on
RabbitMQ's default ports (5672, 15672, 25672, epmd 4369) and names itself after its address.
The bridge holds the subnet's first address: this machine's side, where the metadata
service stand-in listens and from where the checks reach the nodes.  Traffic stays between
these namespaces and this machine.  Needs root (ip netns, from iproute2).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from backend.errors import FedgateError


class HostsError(FedgateError):
    """The instances' network could not be made (not root, no iproute2, a name in use)."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise HostsError(f"`{' '.join(argv)}`: {done.stderr.strip()}")
    return done


#: `ip netns exec` mounts the files of /etc/netns/<namespace>/ over /etc/ for its command:
#: an instance's own /etc/hosts, as a VPC's DNS would answer it
NETNS_ETC = Path("/etc/netns")


@dataclass(frozen=True)
class Host:
    """One instance: its namespace and its private address."""

    netns: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this instance's network."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def resolve(self, names: dict[str, list[str]]) -> None:
        """Inside this instance, each name resolves to its addresses (an internal load
        balancer's DNS name to the nodes behind it), through its own /etc/hosts."""
        etc = NETNS_ETC / self.netns
        etc.mkdir(parents=True, exist_ok=True)
        # its own host name too (the namespace keeps this machine's), as a VPC resolves ip-10-…
        lines = ["127.0.0.1 localhost", f"{self.address} {socket.gethostname()}"]
        lines += [f"{a} {name}" for name, addrs in names.items() for a in addrs]
        (etc / "hosts").write_text("\n".join(lines) + "\n")


class HostNetwork:
    """`with HostNetwork("fgrh", "10.254.80.0/24", 3) as net:` -- net.hosts, net.gateway;
    everything made is removed when the block ends, also after a failure."""

    def __init__(self, prefix: str, subnet: str, count: int, services: int = 0):
        self.prefix = prefix
        self.subnet = ipaddress.ip_network(subnet)
        if self.subnet.version != 4 or self.subnet.num_addresses < 32 or count > 10 or services > 10:
            raise HostsError(f"subnet {subnet}: an IPv4 subnet of 32 addresses or more, 10 hosts of a kind")
        if len(prefix) > 8 or not prefix.isalnum():
            raise HostsError(f"prefix {prefix!r}: at most 8 letters or digits (interface names)")
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[0])
        self.bridge = f"{prefix}-br"
        #: the RabbitMQ nodes (.11, .12, ...)
        self.hosts = [Host(f"{prefix}-n{i + 1}", str(addresses[10 + i])) for i in range(count)]
        #: the fedgate services' instances, the routers (.21, .22, ...)
        self.services = [Host(f"{prefix}-s{i + 1}", str(addresses[20 + i])) for i in range(services)]
        self.all_hosts = self.hosts + self.services

    def start(self) -> None:
        if os.geteuid() != 0:
            raise HostsError("the rehearsal's instances are network namespaces, which need root")
        if shutil.which("ip") is None:
            raise HostsError("`ip` (iproute2) is missing")
        self.stop()  # what a killed rehearsal left behind
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, host in enumerate(self.all_hosts):
                veth = f"{self.prefix}-v{i + 1}"
                _ip("netns", "add", host.netns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                _ip("link", "set", veth, "master", self.bridge, "up")
                _ip("addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0", netns=host.netns)
                _ip("link", "set", "eth0", "up", netns=host.netns)
                _ip("link", "set", "lo", "up", netns=host.netns)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Remove the namespaces (their veths go with them) and the bridge; safe twice.
        Whatever still runs in a namespace is the rehearsal's, left by a failure: killed."""
        for host in self.all_hosts:
            left = _ip("netns", "pids", host.netns, check=False).stdout.split()
            for pid in left:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        # a veth whose namespace is gone but not yet freed by the kernel (its TCP sockets
        # still closing) would keep its name: deleting this end removes both
        for i in range(len(self.all_hosts)):
            _ip("link", "del", f"{self.prefix}-v{i + 1}", check=False)
        for host in self.all_hosts:
            _ip("netns", "del", host.netns, check=False)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> HostNetwork:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
