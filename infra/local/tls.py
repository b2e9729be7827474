"""A certificate authority of the local federation's own, and a certificate per node.

Devices check a gateway's certificate against the CA (MQTT over TLS), and the
federation links check the node at the other end (AMQPS with verify_peer).
Everything lives in <state>/tls/, keys readable by their owner only:

    ca.pem, ca.key            the CA (10 years), made once per state folder
    <node>.pem, <node>.key    a node's certificate (2 years), for the host it
                              binds to, 127.0.0.1 and localhost

openssl (Debian's package, which `make setup` installs) does the work.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from string import Template

from backend.errors import FedgateError

CA_DAYS = 3650
NODE_DAYS = 730
CA_SUBJECT = "/O=fedgate/CN=fedgate local CA"


class TlsError(FedgateError):
    pass


def tls_server_name(host: str) -> str:
    """The name a client checks a node's certificate for: TLS's server name indication
    carries host names, not addresses, and every node certificate names localhost."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    return "localhost" if addr.is_loopback else host


#: The TLS listener lines of every node, local and cloud (gateways/templates/tls.conf).
TLS_CONF_TEMPLATE = Path(__file__).resolve().parents[2] / "gateways" / "templates" / "tls.conf"


def tls_listeners_conf(
    host: str, cert: NodeCert, amqps_port: int, management_tls_port: int, mqtts: tuple[str, int] | None
) -> str:
    """rabbitmq.conf lines for the node's TLS listeners: AMQPS (federation links), the management
    API over HTTPS, MQTT over TLS (`mqtts`: its address and port, a gateway's own)."""
    return Template(TLS_CONF_TEMPLATE.read_text()).substitute(
        host=host,
        amqps_port=amqps_port,
        management_tls_port=management_tls_port,
        cacertfile=cert.ca,
        certfile=cert.cert,
        keyfile=cert.key,
        mqtts_listener="" if mqtts is None else f"mqtt.listeners.ssl.1 = {mqtts[0]}:{mqtts[1]}",
    )


@dataclass(frozen=True)
class NodeCert:
    cert: Path
    key: Path
    ca: Path


def _run(args: list[str]) -> None:
    if shutil.which("openssl") is None:
        raise TlsError("openssl is not installed; run `make setup`")
    out = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise TlsError(f"openssl {args[0]} failed: {out.stderr.strip()[-400:]}")


def _new_key(path: Path) -> None:
    _run(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)])
    path.chmod(0o600)


class LocalCA:
    def __init__(self, folder: Path):
        self.folder = folder

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.pem"

    def ensure_ca(self) -> Path:
        """The CA's certificate, made on first use."""
        key = self.folder / "ca.key"
        if self.ca_cert.exists() and key.exists():
            return self.ca_cert
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        _new_key(key)
        _run(
            [
                "req", "-x509", "-new", "-key", str(key), "-sha256", "-days", str(CA_DAYS),
                "-subj", CA_SUBJECT,
                "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                "-out", str(self.ca_cert),
            ]
        )  # fmt: skip
        return self.ca_cert

    def node_cert(self, node: str, host: str, *more: str | None) -> NodeCert:
        """`node`'s certificate for `host` and `more` (addresses or names: a gateway's own address,
        the name devices resolve), and 127.0.0.1, localhost; made on first use."""
        self.ensure_ca()
        cert, key = self.folder / f"{node}.pem", self.folder / f"{node}.key"
        if cert.exists() and key.exists():
            return NodeCert(cert, key, self.ca_cert)
        names = {"DNS:localhost", "IP:127.0.0.1"}
        for name in (host, *(m for m in more if m)):
            try:
                names.add(f"IP:{ipaddress.ip_address(name)}")
            except ValueError:
                names.add(f"DNS:{name}")
        _new_key(key)
        csr = self.folder / f"{node}.csr"
        ext = self.folder / f"{node}.ext"
        ext.write_text(
            "basicConstraints=CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyAgreement\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
            f"subjectAltName={','.join(sorted(names))}\n"
        )
        _run(["req", "-new", "-key", str(key), "-subj", f"/O=fedgate/CN={node}", "-out", str(csr)])
        _run(
            [
                "x509", "-req", "-in", str(csr), "-CA", str(self.ca_cert),
                "-CAkey", str(self.folder / "ca.key"), "-CAcreateserial", "-sha256",
                "-days", str(NODE_DAYS), "-extfile", str(ext), "-out", str(cert),
            ]
        )  # fmt: skip
        csr.unlink()
        ext.unlink()
        return NodeCert(cert, key, self.ca_cert)
