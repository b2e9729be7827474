"""Ports for servers a test or the cloud rehearsal starts beside the federation's own layout
(infra/local/layout.py lays those out): the kernel picks one that is free now."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
