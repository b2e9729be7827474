"""The routers' user on a cloud region's gateways: tagged `monitoring`, with an empty
permission on the vhost (gateways/wiring.py), instead of the gateways' administrator.

Against a real gateway: what the router reads through that user (connections, the
subscriptions of every session, a persistent session's queue, whether the gateway
answers), that RabbitMQ refuses it the two administrator calls (a user lookup, closing a
connection) and the router carries on without them, and that the user can neither publish
nor consume nor declare anything."""

from __future__ import annotations

import asyncio
import time

import pika
import pika.exceptions
import pytest

from backend import contract as c
from backend.definitions import NodeDefinitions
from backend.polling import await_until
from backend.rabbitmq_admin import RabbitAdmin
from gateways.wiring import router_monitoring_user
from router.gateways import Gateways
from router.metrics import Metrics
from router.presence import PresenceTable, Session
from router.registry import Registry
from tests.helpers import device

pytestmark = [pytest.mark.integration]

REGION = "local-us"
PASSWORD = "router-monitoring-secret"


@pytest.fixture
def monitoring_gateway(endpoints):
    """local-us's gateway holding the routers' monitoring user, as a cloud region's does; its
    management URL. The user is removed afterwards."""
    url = f"http://{endpoints['host']}:{endpoints['gateways'][REGION]['management']}"
    admin = RabbitAdmin(url, endpoints["admin"]["user"], endpoints["admin"]["password"])
    user, permission = router_monitoring_user(PASSWORD)
    admin.import_users(NodeDefinitions(cluster_name="", users=[user], permissions=[permission]))
    try:
        yield url
    finally:
        admin.delete(f"users/{c.ROUTER_USER}")


def test_the_routers_monitoring_user_reads_presence_and_is_refused_only_what_needs_an_administrator(
    endpoints, monitoring_gateway, uid
):
    dev_id = f"monitored-{uid}"
    d = device(endpoints, REGION, dev_id, clean_session=False)
    try:
        d.subscribe(c.device_command_topic(dev_id, "#"), qos=1)
        metrics = Metrics()
        gateways = Gateways({REGION: RabbitAdmin(monitoring_gateway, c.ROUTER_USER, PASSWORD)}, metrics)

        async def scenario() -> dict:
            listed = await gateways.connections(REGION)
            mine = next(x for x in listed if x.get("user") == dev_id)
            session = Session(
                dev_id, REGION, str(mine.get("node")), str(mine["name"]), int(time.time() * 1000)
            )
            seen = {
                "answers": await gateways.answers(REGION),
                "subscribed": await gateways.subscribed(REGION),
                "kept": await gateways.kept_filters(session),
            }
            registry = Registry(gateways)
            seen["registered"] = await registry.look_up(dev_id)
            seen["registered_again"] = await registry.look_up(f"other-{uid}")
            # an older session of the device, as when it reconnected in another region
            gateways.close_soon(session, PresenceTable())
            await await_until(lambda: not gateways.allows(REGION, "close"), 10, 0.1)
            gateways.stop()
            return seen

        seen = asyncio.run(scenario())
        # everything presence needs, read as a monitoring user
        assert seen["answers"] is True
        assert (
            seen["subscribed"] is not None
            and c.device_command_topic(dev_id, "#") in seen["subscribed"][dev_id]
        )
        assert seen["kept"] == [c.device_command_topic(dev_id, "#")]
        # a user lookup needs an administrator: the registry cannot say, and stops asking
        assert seen["registered"] is None and seen["registered_again"] is None
        assert metrics.get("fedgate_router_gateway_refusals_total", region=REGION, call="users") == 1
        # closing a connection needs one too: refused once, counted, and the device stays connected
        assert not gateways.allows(REGION, "close")
        assert metrics.get("fedgate_router_gateway_refusals_total", region=REGION, call="close") == 1
        assert d.connected
    finally:
        d.close()


def test_the_routers_monitoring_user_can_neither_publish_nor_consume_nor_declare(
    endpoints, monitoring_gateway
):
    params = pika.ConnectionParameters(
        endpoints["host"],
        endpoints["gateways"][REGION]["amqp"],
        credentials=pika.PlainCredentials(c.ROUTER_USER, PASSWORD),
        connection_attempts=1,
    )
    conn = pika.BlockingConnection(params)  # the empty permission: it may open the vhost, nothing more
    try:
        for what, attempt in (
            ("configure", lambda ch: ch.queue_declare("fedgate-router-probe", auto_delete=True)),
            ("write", lambda ch: ch.basic_publish(c.MQTT_EXCHANGE, "devices.x.commands.y", b"{}")),
            ("read", lambda ch: ch.basic_get("fedgate-router-probe")),
        ):
            ch = conn.channel()
            ch.confirm_delivery()  # a refused publish closes the channel before its confirm
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                attempt(ch)
            assert refused.value.reply_code == 403, (what, refused.value)
    finally:
        conn.close()
