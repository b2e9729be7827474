"""The federation wiring as data: what each node will hold, checked without a broker."""

import re

from backend import contract as c
from backend import uplink_batch
from backend.wiring import AmqpEndpoint, GatewayLink, backend_definitions
from gateways.wiring import gateway_definitions


def _backend(regions=("local-eu", "local-us")):
    links = [GatewayLink(r, AmqpEndpoint("127.0.0.1", 5000 + i), f"pw-{r}") for i, r in enumerate(regions)]
    return backend_definitions(links, admin_password="adm", backend_link_password="bl")


def _gateway(region="local-eu"):
    return gateway_definitions(
        region,
        AmqpEndpoint("127.0.0.1", 6000),
        admin_password="adm",
        backend_link_password="bl",
        gateway_password="gwpw",
    )


def test_backend_pulls_uplink_and_presence_from_every_gateway_on_confirm():
    d = _backend()
    upstreams = {p.name: p.value for p in d.parameters if p.component == "federation-upstream"}
    assert set(upstreams) == {"gw-local-eu", "gw-local-us"}
    for value in upstreams.values():
        assert value["ack-mode"] == "on-confirm"
        assert value["max-hops"] == 1
        assert value["uri"].startswith("amqp://fedgate-backend:bl@127.0.0.1:")
    sets = {p.name: p.value for p in d.parameters if p.component == "federation-upstream-set"}
    assert {e["exchange"] for e in sets["fedgate-uplink"]} == {"amq.topic"}
    assert {e["exchange"] for e in sets["fedgate-presence"]} == {"amq.rabbitmq.event"}
    policies = {p.definition.get("federation-upstream-set"): p.pattern for p in d.policies}
    assert re.match(policies["fedgate-uplink"], c.TELEMETRY_EXCHANGE)
    assert re.match(policies["fedgate-presence"], c.PRESENCE_EXCHANGE)


def test_backend_has_one_downlink_exchange_per_region_and_a_durable_uplink_queue():
    d = _backend()
    names = {x.name for x in d.exchanges}
    assert {"fedgate.downlink.local-eu", "fedgate.downlink.local-us", c.TELEMETRY_EXCHANGE} <= names
    queues = {q.name: q for q in d.queues}
    shards = [queues[c.uplink_shard_queue(i)] for i in range(c.UPLINK_SHARDS)]
    for q in shards:
        assert q.durable and q.arguments == {"x-queue-type": "quorum", "x-single-active-consumer": True}
    x = next(x for x in d.exchanges if x.name == c.UPLINK_EXCHANGE)
    assert x.type == "x-consistent-hash"
    bound = {(b.source, b.destination, b.routing_key) for b in d.bindings}
    assert (c.TELEMETRY_EXCHANGE, c.UPLINK_EXCHANGE, "#") in bound
    assert all((c.UPLINK_EXCHANGE, q.name, "1") in bound for q in shards)


def test_router_input_is_a_quorum_queue_with_a_single_active_consumer():
    d = _backend()
    q = next(q for q in d.queues if q.name == c.COMMANDS_QUEUE)
    assert q.arguments == {"x-queue-type": "quorum", "x-single-active-consumer": True}
    assert (c.COMMANDS_EXCHANGE, c.COMMANDS_QUEUE) in {(b.source, b.destination) for b in d.bindings}


def test_a_command_a_gateway_does_not_take_in_time_returns_to_the_router():
    d = _backend()
    policy = next(p for p in d.policies if p.name == "fedgate-downlink-return")
    assert policy.apply_to == "queues"
    assert policy.definition == {
        "message-ttl": c.DOWNLINK_RETURN_AFTER_MS,
        "dead-letter-exchange": c.COMMANDS_EXCHANGE,
    }
    # the queue a gateway's downlink link declares on the backend, and nothing else
    assert re.match(policy.pattern, "federation: fedgate.downlink.local-eu -> rabbit@gw-local-eu")
    assert not re.match(policy.pattern, c.COMMANDS_QUEUE)
    assert not re.match(policy.pattern, c.uplink_shard_queue(0))


def test_what_the_routers_fail_on_twenty_times_is_dead_lettered_to_the_poison_queue_not_dropped():
    d = _backend()
    policy = next(p for p in d.policies if p.name == "fedgate-poison")
    assert policy.apply_to == "quorum_queues"
    assert policy.definition["delivery-limit"] == c.POISON_DELIVERY_LIMIT
    assert policy.definition["dead-letter-exchange"] == c.POISON_EXCHANGE
    # at least once: the source keeps the message until the poison queue has it
    assert policy.definition["dead-letter-strategy"] == "at-least-once"
    assert policy.definition["overflow"] == "reject-publish"
    for q in (c.COMMANDS_QUEUE, c.ACKS_QUEUE, c.uplink_shard_queue(0), c.uplink_shard_queue(3)):
        assert re.match(policy.pattern, q), q
    for q in (c.POISON_QUEUE, c.router_presence_queue("router-0"), c.uplink_shard_queue(0) + "x"):
        assert not re.match(policy.pattern, q), q
    poison = next(q for q in d.queues if q.name == c.POISON_QUEUE)
    assert poison.arguments == {"x-queue-type": "quorum"}
    assert (c.POISON_EXCHANGE, c.POISON_QUEUE) in {(b.source, b.destination) for b in d.bindings}


def test_router_user_may_publish_only_to_downlinks_and_read_only_its_inputs():
    links = [GatewayLink("local-eu", AmqpEndpoint("h", 1), "p")]
    d = backend_definitions(links, admin_password="a", backend_link_password="b", router_password="r")
    perm = next(p for p in d.permissions if p.user == c.ROUTER_USER)
    assert re.match(perm.write, "fedgate.downlink.local-eu")
    assert not re.match(perm.write, c.TELEMETRY_EXCHANGE)
    for name in (c.uplink_shard_queue(0), c.uplink_shard_queue(3), c.COMMANDS_QUEUE, c.PRESENCE_EXCHANGE):
        assert re.match(perm.read, name), name
    assert not re.match(perm.configure, c.uplink_shard_queue(0))


def test_the_routers_elect_the_one_routing_commands_on_a_queue_they_may_use():
    """router/leadership.py: a token handed to one consumer at a time, as often as leaders die."""
    links = [GatewayLink("local-eu", AmqpEndpoint("h", 1), "p")]
    d = backend_definitions(links, admin_password="a", backend_link_password="b", router_password="r")
    leader = next(q for q in d.queues if q.name == c.LEADER_QUEUE)
    assert leader.arguments["x-single-active-consumer"] is True
    assert leader.arguments["x-queue-type"] == "quorum"
    assert leader.arguments["x-delivery-limit"] == -1  # 4.0's default (20) would drop the token
    assert not any(re.match(p.pattern, c.LEADER_QUEUE) for p in d.policies)
    perm = next(p for p in d.permissions if p.user == c.ROUTER_USER)
    for kind in (perm.read, perm.configure):
        assert re.match(kind, c.LEADER_QUEUE)
    assert re.match(perm.write, c.LEADER_EXCHANGE)  # tokens go in through it
    assert any(b.source == c.LEADER_EXCHANGE and b.destination == c.LEADER_QUEUE for b in d.bindings)


def test_a_gateway_user_on_the_backend_reaches_only_its_own_downlink():
    d = _backend()
    perm = next(p for p in d.permissions if p.user == "gw-local-eu")
    assert re.match(perm.read, "fedgate.downlink.local-eu")
    assert re.match(perm.configure, "federation: fedgate.downlink.local-eu -> local-eu")
    for other in (
        "fedgate.downlink.local-us",
        c.TELEMETRY_EXCHANGE,
        c.uplink_shard_queue(0),
        "federation: fedgate.downlink.local-us -> local-us",
    ):
        assert not re.match(perm.read, other), other
        assert not re.match(perm.configure, other), other


def test_no_guest_anywhere():
    for d in (_backend(), _gateway()):
        assert "guest" not in {u.name for u in d.users}


def test_gateway_pulls_only_its_regions_downlink_with_a_single_binding():
    d = _gateway("local-eu")
    (upstream,) = [p for p in d.parameters if p.component == "federation-upstream"]
    assert upstream.value["exchange"] == "fedgate.downlink.local-eu"
    assert upstream.value["uri"].startswith("amqp://gw-local-eu:gwpw@")
    assert upstream.value["ack-mode"] == "on-confirm"
    assert [(b.source, b.destination, b.routing_key) for b in d.bindings] == [
        (c.GATEWAY_DOWNLINK_EXCHANGE, c.MQTT_EXCHANGE, "#")
    ]
    assert d.cluster_name == "local-eu"


def test_backend_link_user_on_a_gateway_reads_only_the_mqtt_and_event_exchanges():
    d = _gateway()
    perm = next(p for p in d.permissions if p.user == c.BACKEND_LINK_USER)
    assert re.match(perm.read, "amq.topic") and re.match(perm.read, "amq.rabbitmq.event")
    assert not re.match(perm.read, "fedgate.downlink")
    assert not re.match(perm.configure, "amq.topic")


def test_passwords_are_url_encoded_in_upstream_uris():
    ep = AmqpEndpoint("h", 1)
    assert ep.uri("u", "p@ss/w:rd") == "amqp://u:p%40ss%2Fw%3Ard@h:1"


def test_a_tls_link_checks_the_peers_certificate_and_name():
    ep = AmqpEndpoint("127.0.0.1", 5671, tls=True, ca_file="/state/tls/ca.pem", server_name="localhost")
    uri = ep.uri("u", "p")
    assert uri.startswith("amqps://u:p@127.0.0.1:5671?")
    assert "cacertfile=/state/tls/ca.pem" in uri and "verify=verify_peer" in uri
    assert "server_name_indication=localhost" in uri


def test_a_batching_region_federates_its_batches_and_its_gateways_queue_every_device_message():
    links = [
        GatewayLink("local-eu", AmqpEndpoint("127.0.0.1", 5000), "pw", uplink_batching=True),
        GatewayLink("local-us", AmqpEndpoint("127.0.0.1", 5001), "pw"),
    ]
    d = backend_definitions(links, admin_password="adm", backend_link_password="bl")
    sets = {p.name: p.value for p in d.parameters if p.component == "federation-upstream-set"}
    assert {e["upstream"]: e["exchange"] for e in sets["fedgate-uplink"]} == {
        "gw-local-eu": c.UPLINK_BATCHES_EXCHANGE,
        "gw-local-us": c.MQTT_EXCHANGE,
    }
    gw = gateway_definitions(
        "local-eu",
        AmqpEndpoint("127.0.0.1", 6000),
        uplink_batching=True,
        gateway_queue_type="quorum",
        admin_password="adm",
        backend_link_password="bl",
        gateway_password="gwpw",
    )
    (queue,) = [q for q in gw.queues if q.name == c.UPLINK_BATCH_IN_QUEUE]
    assert queue.arguments == {"x-queue-type": "quorum", "x-single-active-consumer": True}
    assert (c.MQTT_EXCHANGE, c.UPLINK_BATCH_IN_QUEUE, "#") in {
        (b.source, b.destination, b.routing_key) for b in gw.bindings
    }
    (link_user,) = [p for p in gw.permissions if p.user == c.BACKEND_LINK_USER]
    assert re.match(link_user.read, c.UPLINK_BATCHES_EXCHANGE), "the backend's link reads the batches"
    assert not re.match(link_user.read, c.MQTT_EXCHANGE), "and no longer the device messages one by one"
    assert not _gateway().queues, "without batching the backend's link declares the gateway's queue"


def test_the_batcher_plugin_reads_and_writes_what_the_wiring_declares():
    from pathlib import Path

    app = (
        Path(__file__).resolve().parents[2] / "gateways/uplink_batcher_plugin/fedgate_uplink_batcher.app"
    ).read_text()
    assert f'{{queue, <<"{c.UPLINK_BATCH_IN_QUEUE}">>}}' in app
    assert f'{{exchange, <<"{c.UPLINK_BATCHES_EXCHANGE}">>}}' in app
    erl = (
        Path(__file__).resolve().parents[2] / "gateways/uplink_batcher_plugin/src/fedgate_uplink_batcher.erl"
    ).read_text()
    assert f'-define(BATCH_CONTENT_TYPE, <<"{uplink_batch.BATCH_CONTENT_TYPE}">>).' in erl, (
        "the router reads them"
    )
    assert f'-define(RECEIVED_FROM, <<"{c.RECEIVED_FROM_HEADER}">>).' in erl
    assert f'-define(BATCH_KEY_PREFIX, "{c.UPLINK_BATCH_KEY_PREFIX}").' in erl
    ack_key = c.mqtt_topic_to_routing_key(c.device_ack_topic("*"))
    assert f'{{pass_through, [<<"{ack_key}">>]}}' in app, (
        "command acks travel alone, as the backend routes them"
    )
