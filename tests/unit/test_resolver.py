"""The resolver's choice: the nearest healthy gateway (the probe and the failover run
against real gateways in tests/integration/test_regions.py)."""

from __future__ import annotations

import pytest

from fedgate.resolver import Endpoint, NearestHealthyResolver, NoHealthyGatewayError


def test_the_nearest_healthy_gateway_wins() -> None:
    near, far, dead = (Endpoint(r, "127.0.0.1", p) for r, p in (("eu", 1), ("us", 2), ("ap", 3)))
    latency = {near: 0.010, far: 0.080, dead: None}
    resolver = NearestHealthyResolver([far, dead, near], probe=latency.__getitem__)
    assert resolver.resolve() == near
    assert [ep for ep, _ in resolver.rank()] == [near, far]
    assert resolver.resolve(exclude=[near]) == far
    with pytest.raises(NoHealthyGatewayError, match="no healthy gateway"):
        resolver.resolve(exclude=[near, far])
