"""What the local driver writes into router.toml and spark.toml.

The router and the Spark job read their own settings files; these functions
say what a local federation puts into them (where the backend, Kafka, the
gateways and the warehouse are).  Kept apart from booting so that a change to
a service's settings touches only this file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backend import contract as c
from infra.local.layout import (
    ROLE_BACKEND,
    ROLE_ROUTER,
    SPARK_NODE,
    StateFiles,
    gateway_clusters,
    region_nodes,
)
from infra.local.nodes import Node
from infra.local.services import kafka_bootstrap
from infra.local.settings import LocalSettings


def spark_settings(files: StateFiles) -> Any:
    """Settings for a Spark session next to the job (queries, the demo, tests):
    the job's warehouse, its own ports.  FEDGATE_SPARK_* can point elsewhere."""
    from spark.settings import SparkSettings

    rendered = files.state_dir / "nodes" / SPARK_NODE / "spark.toml"
    if rendered.exists():
        return SparkSettings.load(rendered, driver_port=0, block_manager_port=0, progress_file="")
    return SparkSettings.load(kafka_bootstrap="-", warehouse=str(files.warehouse))


def spark_config(settings: LocalSettings, warehouse: Path, nodes: list[Node], job: Node) -> dict[str, Any]:
    """What spark.toml holds (spark/settings.py reads it)."""
    s = settings
    return {
        "kafka_bootstrap": kafka_bootstrap(nodes),
        "warehouse": str(warehouse),
        "master": s.spark_master,
        "driver_memory": f"{s.spark_driver_memory_mb}m",
        "java_options": s.spark_java_options,
        "bind_host": s.host,
        "driver_port": job.spec.ports["driver"],
        "block_manager_port": job.spec.ports["block_manager"],
        "connect_port": job.spec.ports["connect"],
        "metrics_port": job.spec.ports["metrics"],
        "trigger_s": s.spark_trigger_s,
        "freshness_target_s": s.spark_freshness_target_s,
        "aggregate_interval_s": s.spark_aggregate_interval_s,
        "aggregate_after_rows": s.spark_aggregate_after_rows,
        "compact_interval_s": s.spark_compact_interval_s,
        "jars_dir": str(s.spark_jars),
        "progress_file": str(job.dir / "progress.json"),
        # what the routers write, from the same [router] table (router.topics.kafka_topics)
        "topics": s.router_settings.kafka_topics(),
        "unmatched_topic": s.router_settings.unmatched_topic,
        "deadletter_topic": s.router_settings.deadletter_topic,
        "max_payload_bytes": s.router_settings.max_payload_bytes,
    }


def router_config(
    settings: LocalSettings, secrets: dict[str, Any], nodes: list[Node], router: Node
) -> dict[str, Any]:
    """What router.toml holds: where the backend and Kafka are."""
    sec = secrets
    host = settings.host
    backends = region_nodes((n.spec for n in nodes), ROLE_BACKEND)
    amqp = [f"amqp://{c.ROUTER_USER}:{sec['router']}@{host}:{b.ports['amqp']}/%2F" for b in backends]
    routers = sorted((n for n in nodes if n.spec.role == ROLE_ROUTER), key=lambda n: n.name)
    return {
        # the first backend node, then the others (a cluster): the router moves on when one dies
        "amqp_url": amqp[0],
        "amqp_failover_urls": amqp[1:],
        "kafka_bootstrap": kafka_bootstrap(nodes),
        "kafka_replication": settings.kafka_replication,
        "metrics_host": host,
        "metrics_port": router.spec.ports["metrics"],
        "router_id": router.name,
        "router_index": routers.index(router),
        "router_count": len(routers),
        "uplink_shards": settings.uplink_shards,
        "downlink": True,  # all stand for routing commands; one leads (router/leadership.py)
        **settings.router,  # the [router] table, unchanged: router/settings.py defines and checks it
        # the leader watches the backend's federation links through it (router/link_keeper.py)
        "backend_management": {
            "management_url": [f"http://{host}:{b.ports['management']}" for b in backends],
            "user": c.ADMIN_USER,
            "password": sec["admin"],
        },
        # no [gateways]: the routers read the regions registered in the backend
        # (router/region_watch.py), which the wiring keeps (gateway_tables)
    }


def gateway_tables(settings: LocalSettings, secrets: dict[str, Any], nodes: list[Node]) -> dict[str, Any]:
    """Each region's `[gateways.<region>]` table, as the backend's region registry holds it
    (backend/region_registry.py)."""
    return {
        region: {
            # every node of the region's cluster: the router asks the next when one is down
            "management_url": [f"http://{settings.host}:{s.ports['management']}" for s in members],
            "user": c.ADMIN_USER,
            "password": secrets["admin"],
        }
        for region, members in gateway_clusters(n.spec for n in nodes).items()
    }
