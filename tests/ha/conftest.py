"""The HA profile's federation (FEDGATE_PROFILE=ha), one for every test of this package.

Sixteen processes (three RabbitMQ nodes per cluster, three Kafka brokers, two routers,
the Spark job) take two cores a minute to boot: the node-loss scenarios and the HA
benchmark's quick run share one.  Package scope: it stops once the package's last test
ran, not at the end of the session: its six RabbitMQ nodes and three brokers need not
idle beside what a worker runs after them (tests/conftest.py LANES)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.local.driver import LocalFederation
from tests.conftest import ROUTER_TABLE, TEST_PORT_BASE, make_federation, running
from tests.helpers import DeviceCredentials

HA_PORT_BASE = TEST_PORT_BASE + 2000
#: The HA federation's Spark job lands a micro-batch every 10 s, not 2: its scenarios count the
#: rows once, at their end, and a commit every 2 s through ten minutes of devices publishing
#: was the job's cost (133 CPU s in r15, beside the other lanes).
HA_SPARK_TRIGGER_S = 10.0


@pytest.fixture(scope="package")
def ha_federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    fed = make_federation(
        tmp_path_factory.mktemp("ha-federation"),
        HA_PORT_BASE,
        profile="ha",
        router=ROUTER_TABLE,
        spark_trigger_s=HA_SPARK_TRIGGER_S,
    )
    with running(fed):
        yield fed


@pytest.fixture
def ha_endpoints(ha_federation: LocalFederation) -> dict:
    return {**ha_federation.endpoints(), "credentials": DeviceCredentials(ha_federation)}
