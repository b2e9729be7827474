"""HTTPS to a RabbitMQ management API behind a load balancer: trust only the nodes' CA, and
check the name the nodes' certificates carry rather than the address dialled.

A cloud region's management API is reached at its load balancer's DNS name,
while its nodes' certificates name the region (gw-<region>.<domain>): the
name a client checks is then not the URL's host.  urllib checks the URL's host,
so the connection here wraps its socket for `server_name` instead.
"""

from __future__ import annotations

import functools
import http.client
import ssl
import urllib.request
from typing import Any


class _NamedHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection that checks the peer's certificate for `server_name`, whatever
    address it dials (a load balancer's name in front of nodes certified for another)."""

    def __init__(self, *args: Any, server_name: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)  # type: ignore[attr-defined]


class _NamedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext, server_name: str):
        super().__init__(context=context)
        self._tls = context
        self._server_name = server_name

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        conn = functools.partial(_NamedHTTPSConnection, server_name=self._server_name)
        return self.do_open(conn, req, context=self._tls)  # type: ignore[arg-type]


def tls_opener(ca_file: str = "", ca_pem: str = "", server_name: str = "") -> urllib.request.OpenerDirector:
    """An opener that trusts only the nodes' CA and checks certificates for `server_name`
    (or for the URL's host when empty)."""
    context = ssl.create_default_context(cafile=ca_file or None, cadata=ca_pem or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if server_name:
        return urllib.request.build_opener(_NamedHTTPSHandler(context, server_name))
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
