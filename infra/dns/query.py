"""One DNS question, as a device's stub resolver asks it: from the device's own address (the
server's answer depends on the client network it comes from)."""

from __future__ import annotations

from dataclasses import dataclass

import dns.exception
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype


class DnsQueryError(ConnectionError):
    """No address came back: no answer, an error code, or an empty answer."""


@dataclass(frozen=True)
class DnsServer:
    host: str
    port: int


def ask_server(
    server: DnsServer, name: str, source: str | None, timeout: float = 2.0
) -> tuple[list[str], int]:
    """An A question for `name` to `server`, from `source`: (addresses, TTL)."""
    query = dns.message.make_query(name, dns.rdatatype.A)
    try:
        reply = dns.query.udp(query, server.host, port=server.port, source=source, timeout=timeout)
    except (dns.exception.Timeout, OSError) as e:
        raise DnsQueryError(f"DNS server {server.host}:{server.port} did not answer {name}: {e}") from e
    if reply.rcode() != dns.rcode.NOERROR:
        raise DnsQueryError(f"{name}: {dns.rcode.to_text(reply.rcode())} from {server.host}:{server.port}")
    answers = [rrset for rrset in reply.answer if rrset.rdtype == dns.rdatatype.A]
    addresses = [rr.address for rrset in answers for rr in rrset]
    if not addresses:
        raise DnsQueryError(f"{name}: no address in the answer of {server.host}:{server.port}")
    return addresses, min(rrset.ttl for rrset in answers)
