"""How many gateway nodes and army processes the scale benchmark asks for, and where devices dial from."""

from __future__ import annotations

import resource

from bench import scale_bench


def test_a_machine_whose_descriptor_ceiling_is_below_the_fleet_spreads_it_over_a_cluster(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 20_000))

    def refuse(_, limits):  # as the kernel does without CAP_SYS_RESOURCE
        if limits[1] > 20_000:
            raise ValueError("not allowed to raise maximum limit")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    plan = scale_bench.cluster_plan("full")
    assert plan.ceiling == 20_000 and plan.per_node == 20_000 - scale_bench.NODE_DESCRIPTORS
    assert plan.nodes == 6, "100,000 devices of 19,500 a node at most"
    assert plan.processes == 6 and plan.processes * (20_000 - scale_bench.WORKER_DESCRIPTORS) >= 100_000


def test_a_machine_that_may_raise_the_ceiling_holds_them_on_one_node(monkeypatch):
    raised = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 20_000))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: raised.append(limits))
    plan = scale_bench.cluster_plan("full")
    assert (plan.nodes, plan.processes) == (1, scale_bench.PROCESSES["full"])
    want = 100_000 + scale_bench.NODE_DESCRIPTORS
    assert raised == [(want, want)], "the hard limit its children inherit"


def test_the_quick_run_checks_a_cluster_of_two():
    plan = scale_bench.cluster_plan("quick")
    assert plan.devices == 1_000 and plan.nodes == 2 and plan.per_node == 500


def test_devices_dial_from_several_addresses_each_with_ports_to_spare():
    assert scale_bench.source_address(0) == "127.0.0.2"
    assert scale_bench.source_address(scale_bench.PER_SOURCE - 1) == "127.0.0.2"
    assert scale_bench.source_address(scale_bench.PER_SOURCE) == "127.0.0.3"
    assert scale_bench.PER_SOURCE < 28_000, "one address has ~28,000 ephemeral ports towards the gateway"
