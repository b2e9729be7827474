"""The router parts' lifecycle shape, and what the router asks the gateways (with fake clients)."""

import asyncio

import pytest

from backend.rabbitmq_admin import AdminError
from router.gateways import CLEAN_QUEUE_OWNED_AFTER_S, Gateways
from router.lifecycle import Lifecycle, LifecycleError, State
from router.presence import Session
from router.subscriptions import Subscriptions


class Part(Lifecycle):
    def __init__(self, fail_start=False):
        super().__init__()
        self.fail_start = fail_start
        self.calls = []

    async def _start(self):
        self.calls.append("start")
        if self.fail_start:
            raise RuntimeError("half-way")

    async def _stop(self):
        self.calls.append("stop")


def test_stop_is_safe_twice_and_before_start_and_after_a_failed_start():
    async def scenario():
        p = Part()
        async with p:
            assert p.state is State.RUNNING
        await p.stop()
        assert p.calls == ["start", "stop"]
        never = Part()
        await never.stop()
        assert never.calls == [] and never.state is State.STOPPED
        with pytest.raises(LifecycleError):
            await never.start()  # a stopped part is not revived
        failed = Part(fail_start=True)
        with pytest.raises(RuntimeError):
            await failed.start()
        await failed.stop()  # stops what the half-done start left
        assert failed.calls == ["start", "stop"]

    asyncio.run(scenario())


class FakeGateway:
    def __init__(self, answers=True, queues=None):
        self.answers, self.queues, self.asked = answers, queues or {}, []

    def request_with_headers(self, method, path, headers, body=None, *, timeout=None):
        self.asked.append(path)
        if not self.answers:
            raise AdminError("connection refused", retriable=True)

    def request(self, method, path, body=None, *, timeout=None):
        return self.request_with_headers(method, path, {}, body, timeout=timeout)

    def get(self, path):
        name = path.split("/")[2]
        if name not in self.queues:
            raise AdminError("not found", status=404)
        info, bindings = self.queues[name]
        return bindings if path.endswith("/bindings") else info

    def connections(self):
        return []


def test_whether_a_gateway_answers_is_asked_once_per_few_seconds():
    dead = FakeGateway(answers=False)
    gw = Gateways({"local-eu": dead, "local-us": FakeGateway()})

    async def scenario():
        assert await gw.answers("local-eu") is False
        assert await gw.answers("local-eu") is False
        assert await gw.answers("local-us") is True
        assert await gw.answers("local-gone") is False

    asyncio.run(scenario())
    assert dead.asked == ["overview"]  # the second question came from the cache


def test_a_persistent_sessions_kept_subscriptions_are_read_a_clean_sessions_once_it_is_settled():
    """A clean session's queue just after its connection opened may still be the previous
    connection's; CLEAN_QUEUE_OWNED_AFTER_S later it is this one's, and its bindings count (a
    binding event lost with a gateway node would otherwise hold the device's commands until
    they expire)."""
    s = Session("d1", "local-eu", "n", "c", 1_000_000)  # connected at t=1000 s
    just_opened, settled = 1000.5, 1000 + CLEAN_QUEUE_OWNED_AFTER_S
    kept = FakeGateway(
        queues={
            "mqtt-subscription-d1qos1": (
                {"auto_delete": False},
                [
                    {"source": "", "routing_key": "x"},
                    {"source": "amq.topic", "routing_key": "devices.d1.commands.#"},
                ],
            )
        }
    )
    clean = FakeGateway(queues={"mqtt-subscription-d1qos0": ({"auto_delete": True}, [])})
    # RabbitMQ 4.0: a clean session's queues are exclusive (durable, not auto-delete)
    clean_40 = FakeGateway(
        queues={
            "mqtt-subscription-d1qos1": (
                {"auto_delete": False, "exclusive": True},
                [{"source": "amq.topic", "routing_key": "devices.d1.commands.#"}],
            )
        }
    )

    async def scenario():
        assert await Gateways({"local-eu": kept}).kept_filters(s, just_opened) == ["devices/d1/commands/#"]
        assert await Gateways({"local-eu": clean}).kept_filters(s, just_opened) == []
        assert await Gateways({"local-eu": clean_40}).kept_filters(s, just_opened) == []
        assert await Gateways({"local-eu": clean_40}).kept_filters(s, settled) == ["devices/d1/commands/#"]
        assert await Gateways({}).kept_filters(s, settled) is None

    asyncio.run(scenario())


def test_subscriptions_per_connection():
    subs = Subscriptions()
    assert subs.covers("c1", "devices/d1/commands/x")  # not seen open: counts as subscribed
    subs.opened("c1")
    assert not subs.covers("c1", "devices/d1/commands/x")
    subs.add("c1", ["devices/d1/commands/#"])
    assert subs.covers("c1", "devices/d1/commands/x")
    assert not subs.covers("c1", "devices/d1/config")
    assert subs.ask_due("c1", 10, now=0) and not subs.ask_due("c1", 10, now=9.9)
    assert subs.ask_due("c1", 10, now=10), "asked again once the interval passed"
    subs.mark_replayed("c1", "devices/d1/config")
    assert subs.replayed("c1", "devices/d1/config")
    subs.forget("c1")
    assert not subs.replayed("c1", "devices/d1/config") and subs.ask_due("c1", 10, now=11)
