"""How many devices the scale benchmark asks one gateway node to hold, and where they dial from."""

from __future__ import annotations

import resource

from bench import scale_bench


def test_a_machine_whose_descriptor_ceiling_is_below_the_fleet_holds_fewer_and_says_why(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 20_000))

    def refuse(_, limits):  # as the kernel does without CAP_SYS_RESOURCE
        if limits[1] > 20_000:
            raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    held, why = scale_bench.devices_to_hold(100_000)
    assert held == 20_000 - scale_bench.NODE_DESCRIPTORS
    assert why is not None and "20,000 descriptors" in why and "not 100,000" in why


def test_a_machine_that_may_raise_the_ceiling_holds_them_all(monkeypatch):
    raised = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 20_000))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: raised.append(limits))
    assert scale_bench.devices_to_hold(100_000) == (100_000, None)
    want = 100_000 + scale_bench.NODE_DESCRIPTORS
    assert raised == [(want, want)], "the hard limit its children inherit"


def test_devices_dial_from_several_addresses_each_with_ports_to_spare():
    assert scale_bench.source_address(0) == "127.0.0.2"
    assert scale_bench.source_address(scale_bench.PER_SOURCE - 1) == "127.0.0.2"
    assert scale_bench.source_address(scale_bench.PER_SOURCE) == "127.0.0.3"
    assert scale_bench.PER_SOURCE < 28_000, "one address has ~28,000 ephemeral ports towards the gateway"
