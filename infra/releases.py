"""The engines' releases that `make setup` fetches, read from the Maven poms it resolves
them with (infra/setup/*-pom.xml): each version is written in one place, its pom."""

from __future__ import annotations

import re
from pathlib import Path

POMS = Path(__file__).resolve().parent / "setup"


def pom_property(pom: str, name: str) -> str:
    """The value of property `name` in infra/setup/`pom`."""
    text = (POMS / pom).read_text()
    found = re.search(rf"<{re.escape(name)}>([^<]+)</{re.escape(name)}>", text)
    if found is None:
        raise LookupError(f"{POMS / pom}: no <{name}> property")
    return found.group(1).strip()


#: Apache Kafka, whose jars the local brokers run (LocalSettings.kafka_version's default)
KAFKA_RELEASE = pom_property("kafka-pom.xml", "kafka.version")
#: Apache Iceberg's Spark runtime, which the Spark job and `fedgate query` load
ICEBERG_RELEASE = pom_property("spark-pom.xml", "iceberg.version")
