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


@pytest.fixture(scope="package")
def ha_federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    fed = make_federation(
        tmp_path_factory.mktemp("ha-federation"),
        HA_PORT_BASE,
        profile="ha",
        router=ROUTER_TABLE,
    )
    with running(fed):
        yield fed


@pytest.fixture
def ha_endpoints(ha_federation: LocalFederation) -> dict:
    return {**ha_federation.endpoints(), "credentials": DeviceCredentials(ha_federation)}
