"""Faults a test puts into a running node from inside, where no signal reaches."""

from __future__ import annotations

import os
import subprocess

from infra.local.driver import LocalFederation
from infra.local.nodes import RabbitNode, runtime_of


def rabbitmq_eval(fed: LocalFederation, node: str, expr: str, timeout: float = 180.0) -> str:
    """`rabbitmqctl eval expr` on one RabbitMQ node of `fed` (its own Erlang, cookie and
    epmd: the environment the node runs with); its output.  A CLI's BEAM on a loaded CI
    machine took over 60 s to answer."""
    return rabbitmqctl(fed, node, ["eval", expr], timeout)


def rabbitmqctl(fed: LocalFederation, node: str, args: list[str], timeout: float = 180.0) -> str:
    """`rabbitmqctl args` on one RabbitMQ node of `fed`; its output."""
    rabbit = fed.node(node)
    assert isinstance(rabbit, RabbitNode), f"{node} is not a RabbitMQ node"
    _, env, _ = rabbit.command()
    runtime = runtime_of(fed.settings)
    argv = runtime.command(
        runtime.rabbitmq("rabbitmqctl"),
        ["-n", rabbit.erlang_node, *args],
        shared=[fed.settings.state_dir],
    )
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"rabbitmqctl {' '.join(args)[:80]} on {node}: {done.stderr or done.stdout}"
    return done.stdout.strip()


#: What RabbitMQ 4.0.5 does itself when a node's federation supervisor starts before it has
#: seen its peers': every record of the exchange links' mirrored supervisor deleted,
#: cluster-wide (rabbitmq-server 0adbd040be fixed it in 2026).  The links run on; when their
#: node dies, no other node takes them over (router/link_keeper.py).
LOSE_EXCHANGE_LINK_RECORDS = "rabbit_db_msup:delete_all(rabbit_federation_exchange_link_sup_sup)."
