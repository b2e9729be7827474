"""Which router reads which uplink shard: the consumer priority each registers with.

Every router registers on every shard queue (a quorum queue with a single
active consumer), and RabbitMQ 4.0 makes the registered consumer of the
highest priority the active one.  Numbered routers (`shard_owner = "index"`,
router i of n) register on their own shards with OWN_SHARD_PRIORITY and on the
others with 0.  Routers nothing numbers -- instances of an autoscaling group
(`shard_owner = "rendezvous"`) -- register with a priority drawn from a hash
of their router id and the shard: each shard goes to the running router with
the highest, to the next highest when that one dies and back when it returns,
with no membership to keep (rendezvous hashing; RabbitMQ's choice of the
highest priority is the only coordination).
"""

from __future__ import annotations

import hashlib

from router.settings import RouterSettings

#: The consumer priority a router registers with on its own uplink shards (0 on the others).
OWN_SHARD_PRIORITY = 10
#: Rendezvous priorities are 1..RENDEZVOUS_PRIORITIES: a tie (RabbitMQ then keeps the consumer
#: that registered first) is one pair of routers in a thousand per shard.
RENDEZVOUS_PRIORITIES = 1000


def rendezvous_priority(router_id: str, shard: int) -> int:
    """The priority `router_id` registers with on `shard` under rendezvous hashing: the same in
    every process and every run, independent across shards."""
    digest = hashlib.sha256(f"{router_id}\x00{shard}".encode()).digest()
    return 1 + int.from_bytes(digest[:8], "big") % RENDEZVOUS_PRIORITIES


def shard_priority(settings: RouterSettings, shard: int) -> int:
    """The consumer priority this router registers with on `shard`."""
    if settings.shard_owner == "rendezvous":
        return rendezvous_priority(settings.router_id, shard)
    return OWN_SHARD_PRIORITY if shard in settings.my_shards else 0
