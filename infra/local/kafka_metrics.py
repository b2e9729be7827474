"""Each Kafka broker's metrics for the federation's Prometheus: Prometheus's JMX exporter as a
Java agent in the broker's JVM (`make setup` fetches it from Maven Central), serving /metrics on
the broker's `metrics` port.

Only the MBeans an operator's alerts and the console read are exported (`includeObjectNames`):
a broker has thousands (per topic and partition), and reading them all at every scrape would
cost the broker more than its traffic here.
"""

from __future__ import annotations

import json
from pathlib import Path

from infra.local.settings import LocalSettings

#: infra/setup/setup.sh's JMX_EXPORTER_VERSION
JMX_EXPORTER_VERSION = "1.0.1"

#: The MBeans exported, and the names they get (lowercase, Prometheus's conventions).
EXPORTER_CONFIG = {
    "lowercaseOutputName": True,
    "includeObjectNames": [
        "kafka.server:type=ReplicaManager,name=UnderReplicatedPartitions",
        "kafka.server:type=ReplicaManager,name=PartitionCount",
        "kafka.server:type=ReplicaManager,name=LeaderCount",
        "kafka.controller:type=KafkaController,name=OfflinePartitionsCount",
        "kafka.controller:type=KafkaController,name=ActiveControllerCount",
        "kafka.server:type=BrokerTopicMetrics,name=MessagesInPerSec",
        "kafka.server:type=BrokerTopicMetrics,name=BytesInPerSec",
    ],
    "rules": [
        {
            "pattern": "kafka.server<type=ReplicaManager, name=(\\w+)><>Value",
            "name": "kafka_server_replicamanager_$1",
            "type": "GAUGE",
            "help": "Kafka's ReplicaManager $1 (under-replicated partitions, partitions, leaders).",
        },
        {
            "pattern": "kafka.controller<type=KafkaController, name=(\\w+)><>Value",
            "name": "kafka_controller_kafkacontroller_$1",
            "type": "GAUGE",
            "help": "Kafka's controller $1 (1 active controller in the cluster; offline partitions).",
        },
        {
            "pattern": "kafka.server<type=BrokerTopicMetrics, name=(\\w+)PerSec><>Count",
            "name": "kafka_server_brokertopicmetrics_$1_total",
            "type": "COUNTER",
            "help": "Kafka's BrokerTopicMetrics $1 over every topic of this broker.",
        },
    ],
}


def agent_jar(settings: LocalSettings) -> Path:
    folder = settings.cache_dir / "jars" / f"jmx-exporter-{JMX_EXPORTER_VERSION}"
    return folder / f"jmx_prometheus_javaagent-{JMX_EXPORTER_VERSION}.jar"


def agent_args(settings: LocalSettings, node_dir: Path, host: str, port: int | None) -> list[str]:
    """The broker JVM's -javaagent option (its config written into `node_dir`); none for a
    broker without a metrics port (the cloud rehearsal's), when the federation runs no
    Prometheus or the agent was not fetched (the broker runs all the same, its metrics
    missing: `make setup` fetches it)."""
    jar = agent_jar(settings)
    if not port or not settings.prometheus_scrape_interval_s or not jar.exists():
        return []
    config = node_dir / "jmx-exporter.yml"
    config.write_text(json.dumps(EXPORTER_CONFIG, indent=1))  # JSON is YAML too
    return [f"-javaagent:{jar}={host}:{port}:{config}"]
