"""The checks of the local federation's settings (LocalSettings.validate), apart from the
fields they check so that infra/local/settings.py stays one page of fields."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

from backend.contract import InvalidRegionError, validate_region
from infra.local.layout import GATEWAY_EXTRA_PORTS, GATEWAY_STRIDE, gateway_extra_stride
from infra.local.settings import (
    MAX_KAFKA_BROKERS,
    PORT_BLOCK,
    PROFILE_KAFKA_BROKERS,
    LocalSettings,
    SettingsError,
)
from router.settings import RouterSettingsError, router_table


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def check_settings(self: LocalSettings) -> LocalSettings:
    """LocalSettings.validate: each field's check, the first wrong one named."""
    try:
        for r in self.regions:
            validate_region(r)
    except InvalidRegionError as e:
        raise SettingsError(f"regions: {e}") from e
    if len(set(self.regions)) != len(self.regions):
        raise SettingsError(f"regions: duplicate region in {list(self.regions)}")
    if not 1024 <= self.port_base <= 65535 - 1000:
        raise SettingsError(f"port_base: {self.port_base} must be in 1024..64535")
    low, high = ephemeral_port_range()
    if self.port_base + PORT_BLOCK > low and self.port_base <= high:
        # Outgoing connections take their local port from this range: a
        # node could find its port taken between the check and its boot.
        raise SettingsError(
            f"port_base: {self.port_base}..{self.port_base + PORT_BLOCK} overlaps the kernel's ephemeral "
            f"port range {low}-{high}; pick a port_base below {low - PORT_BLOCK}"
        )
    for key, port in self.ports.items():
        if "." not in key:
            raise SettingsError(f"ports: key {key!r} must look like '<node>.<port name>'")
        if not isinstance(port, int) or not 1 <= port <= 65535:
            raise SettingsError(f"ports: {key} = {port!r} is not a TCP port")
    for name in ("rabbitmq_memory_mb", "kafka_heap_mb", "gateway_max_fds", "mqtt_tcp_buffer"):
        if getattr(self, name) <= 0:
            raise SettingsError(f"{name}: must be positive, got {getattr(self, name)}")
    if not 0 <= self.routers <= self.uplink_shards:
        raise SettingsError(f"routers: 0 to uplink_shards ({self.uplink_shards}), got {self.routers}")
    try:
        router_table(self.router, env={})
    except RouterSettingsError as e:
        raise SettingsError(f"router.{e}") from e
    if self.profile not in PROFILE_KAFKA_BROKERS:
        raise SettingsError(f"profile: one of {sorted(PROFILE_KAFKA_BROKERS)}, got {self.profile!r}")
    extra_ports = len(self.regions) * gateway_extra_stride(self.gateway_nodes)
    if self.gateway_cluster_nodes < 0 or self.gateway_nodes > 1 and extra_ports > GATEWAY_EXTRA_PORTS:
        most = GATEWAY_EXTRA_PORTS // GATEWAY_STRIDE // len(self.regions) + 1
        raise SettingsError(
            f"gateway_cluster_nodes: 0 (the profile's) to {most} with {len(self.regions)} region(s), "
            f"got {self.gateway_cluster_nodes}"
        )
    if not 0 <= self.kafka_brokers <= MAX_KAFKA_BROKERS:
        raise SettingsError(
            f"kafka_brokers: 0 (the profile's) to {MAX_KAFKA_BROKERS}, got {self.kafka_brokers}"
        )
    if self.spark not in (0, 1):
        raise SettingsError(f"spark: 0 or 1, got {self.spark}")
    if self.rabbitmq_release not in ("4.0", "3.10"):
        raise SettingsError(f"rabbitmq_release: '4.0' or '3.10', got {self.rabbitmq_release!r}")
    if self.boot_timeout <= 0:
        raise SettingsError("boot_timeout: must be positive")
    if self.spark_boot_timeout <= 0:
        raise SettingsError("spark_boot_timeout: must be positive")
    for name in ("cloud_admin_cidrs", "cloud_backend_cidrs"):
        for cidr in getattr(self, name):
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as e:
                raise SettingsError(f"{name}: {cidr!r} is not a CIDR block") from e
    if not 1 <= self.cloud_backend_amqp_port <= 65535:
        raise SettingsError(f"cloud_backend_amqp_port: {self.cloud_backend_amqp_port} is not a TCP port")
    if self.cloud_node_count < 3:
        raise SettingsError("cloud_node_count: at least 3 (a majority of the cluster survives one lost node)")
    block = self.address_block.split(".")
    if len(block) != 2 or block[0] != "127" or not (block[1].isdigit() and 0 <= int(block[1]) <= 255):
        raise SettingsError(f"gateway_addresses: 127.X with X in 0..255, got {self.gateway_addresses!r}")
    for name in ("mqtt_port", "mqtts_port"):
        if not 1 <= getattr(self, name) <= 65535:
            raise SettingsError(f"{name}: {getattr(self, name)} is not a TCP port")
    if self.dns_ttl < 0 or self.health_check_interval < 1:
        raise SettingsError("dns_ttl: 0 or more; health_check_interval: 1 or more (seconds)")
    if self.prometheus_scrape_interval_s < 0:
        raise SettingsError("prometheus_scrape_interval_s: 0 (no Prometheus) or more (seconds)")
    if not re.fullmatch(r"[0-9]+(ms|s|m|h|d|w|y)", self.prometheus_retention):
        raise SettingsError(
            f"prometheus_retention: a Prometheus duration (7d, 12h), got {self.prometheus_retention!r}"
        )
    return self
