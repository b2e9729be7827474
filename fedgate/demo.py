"""`fedgate demo`: bring the local federation up and show it at work.

The scene, with real MQTT devices (paho-mqtt) in both regions:

1. every device connects to its region's gateway and subscribes to its own
   command topic -- the first of each region over MQTT 3.1.1 at QoS 1, the
   second over MQTT 5 at QoS 0, acknowledging each command itself; a
   wildcard "monitor" on each gateway watches every command that reaches
   that gateway;
2. the devices publish telemetry at QoS 1 and the backend shows it arriving,
   tagged with the region it came from;
3. the backend hands one command to the router (as `fedgate send` does); the
   router finds the device's gateway from presence and sends it through that
   region's downlink: that device, and no other device or gateway, receives it;
   then an MQTT 5 device in the other region is asked for its firmware
   (`fedgate send --wait`): its answer, by response topic and correlation
   data, is what the sender gets;
4. the router has bridged the telemetry into Kafka: a Kafka consumer reads
   it back, keyed by device, with the region in a header (and an MQTT 5
   device's user properties);
5. a summary of what was checked; the federation is left running.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from backend import contract as c
from backend.amqp import Tap, send_and_wait, send_command
from backend.command_outcomes import Outcome, read_outcomes
from backend.kafka_read import read_records
from backend.polling import wait_until
from fedgate.devices import SimDevice, publish_properties
from fedgate.dns_resolver import resolver_for
from infra.local.driver import LocalFederation

READINGS_PER_DEVICE = 5
DEVICES_PER_REGION = 2


#: what the MQTT 5 devices tag their readings with, and answer when asked for their firmware
DEVICE_TAGS = {"unit": "celsius", "fw": "2.1.0"}


#: How long a step waits for what it expects before it says FAIL (the Spark tables: four
#: times this).  What arrives in time ends the wait at once; a demo on a busy machine (the
#: test suite's, a laptop that is also building) waits for its engines, not a fixed pace.
STEP_TIMEOUT_S = 60.0


def _device_ids(region: str) -> list[str]:
    short = region.removeprefix("local-")
    return [f"{short}-thermo-{i}" for i in range(1, DEVICES_PER_REGION + 1)]


def _steps_on_record(
    ep: dict[str, Any], command_id: str, until: str, timeout: float = STEP_TIMEOUT_S
) -> list[Outcome]:
    """The command's steps in Kafka once the last is `until` (or what there is after `timeout`)."""
    steps: list[Outcome] = []

    def ended() -> bool:
        nonlocal steps
        steps = read_outcomes(ep["kafka"]["bootstrap"], command_id)
        return bool(steps) and steps[-1].outcome == until

    wait_until(ended, timeout, 0.3)
    return steps


def _speaks_mqtt5(dev_id: str) -> bool:
    return not dev_id.endswith("-1")


def _firmware(stop: threading.Event, devices: list[SimDevice]) -> None:
    """What an MQTT 5 device's own code does with its commands: acknowledge each (it subscribed
    at QoS 0) and answer those that name a response topic."""
    done: dict[str, int] = {d.device_id: 0 for d in devices}
    while not stop.wait(0.05):
        for d in devices:
            for r in d.received[done[d.device_id] :]:
                d.ack(r)
                if r.prop("ResponseTopic"):
                    d.reply(r, {"firmware": DEVICE_TAGS["fw"], "uptime_s": 42})
                done[d.device_id] += 1


def wait_for_presence(ep: dict[str, Any], device: str, region: str, timeout: float = STEP_TIMEOUT_S) -> None:
    """Wait until the router has seen the device connect (presence events take milliseconds)."""
    url = f"{ep['router']['metrics']}/presence?device={device}"

    def seen() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                found = json.load(r)["devices"]
        except OSError:
            return False
        return bool(found) and found[0]["region"] == region

    wait_until(seen, timeout, 0.1)


def read_kafka(
    bootstrap: str, topic: str, run_id: str, expect: int, timeout: float = STEP_TIMEOUT_S
) -> list[dict[str, Any]]:
    """This run's records of a topic, in partition order, with key and region header."""

    def this_run(msg: Any, headers: dict[str, str]) -> bool:
        try:
            return bool(json.loads(msg.value()).get("run") == run_id)
        except (ValueError, AttributeError):
            return False

    return [
        {
            "key": (msg.key() or b"").decode(),
            "seq": json.loads(msg.value()).get("seq"),
            "region": headers.get(c.KAFKA_REGION_HEADER, ""),
            "user_properties": {
                k.removeprefix(c.KAFKA_USER_PROPERTY_PREFIX): v
                for k, v in headers.items()
                if k.startswith(c.KAFKA_USER_PROPERTY_PREFIX)
            },
        }
        for msg, headers in read_records(bootstrap, topic, this_run, expect, timeout)
    ]


def spark_tables(
    fed: LocalFederation,
    run_id: str,
    sent: int,
    devices: int,
    say: Callable[[str], None],
    timeout: float = 4 * STEP_TIMEOUT_S,
) -> list[tuple[bool, str]]:
    """Wait until this run's readings are rows of telemetry_raw, then show them queried."""
    from spark import query

    settings = fed.spark_settings()
    with query.session(settings) as spark:
        count_sql = f"SELECT count(*) FROM telemetry_raw WHERE fields['run'] = '{run_id}'"
        rows = 0

        def landed() -> bool:
            nonlocal rows
            rows = spark.sql(count_sql).first()[0]  # type: ignore[index]
            return rows >= sent

        wait_until(landed, timeout, 2)
        columns, result = query.run_sql(
            spark,
            f"""SELECT device, region, count(*) AS readings,
                       round(avg(numeric_fields['temp_c']), 2) AS avg_temp_c,
                       max(numeric_fields['temp_c']) AS max_temp_c,
                       percentile(latency_ms, 0.5) AS p50_latency_ms
                FROM telemetry_raw WHERE fields['run'] = '{run_id}'
                GROUP BY device, region ORDER BY device""",
        )
        say("   fedgate query \"SELECT device, region, count(*), avg(numeric_fields['temp_c']) ... \"")
        for line in query.format_table(columns, result).splitlines():
            say("   " + line)
        return [
            (rows == sent, f"spark: {rows}/{sent} readings in telemetry_raw, each once"),
            (
                len(result) == devices and all(r[2] == READINGS_PER_DEVICE for r in result),
                "spark: every device's readings counted in the query",
            ),
        ]


def run_demo(fed: LocalFederation, progress: Callable[[str], None] = print) -> int:
    fed.up()
    ep = fed.endpoints()
    host, url = ep["host"], ep["backend"]["url"]
    admin_user, admin_pass = ep["admin"]["user"], ep["admin"]["password"]
    regions = sorted(ep["gateways"])
    # each device logs in as itself; re-running the demo issues its devices new secrets
    secrets = fed.add_devices([d for r in regions for d in _device_ids(r)], rotate=True)
    checks: list[tuple[bool, str]] = []

    def say(text: str = "") -> None:
        print(text, flush=True)

    say()
    say("== fedgate demo " + "=" * 60)
    say(f"backend + {len(regions)} gateway regions ({', '.join(regions)}) + Kafka, all on {host}")

    run_id = uuid.uuid4().hex[:8]
    stop_firmware = threading.Event()
    devices: dict[str, SimDevice] = {}
    monitors: dict[str, SimDevice] = {}
    with Tap(url, c.TELEMETRY_EXCHANGE) as tap:
        try:
            # 1. devices connect where they live: each asks DNS for mqtt.<domain> from its own
            #    address, in its region's client network, and connects to what it is answered
            answered: dict[str, SimDevice] = {}
            for region in regions:
                for dev_id in _device_ids(region):
                    five = _speaks_mqtt5(dev_id)
                    resolver = resolver_for(ep, region, dev_id)
                    d = SimDevice.nearest(dev_id, resolver, dev_id, secrets[dev_id], mqtt5=five).connect()
                    d.subscribe(c.device_command_topic(dev_id, "#"), qos=0 if five else 1)
                    devices[dev_id] = d
                    answered[region] = d
                # the operator's view of every command: a device may only see its own
                gw = ep["gateways"][region]
                mon = SimDevice(
                    f"monitor-{region}", gw["address"], gw["mqtt"], admin_user, admin_pass
                ).connect()
                mon.subscribe("devices/+/commands/#")
                monitors[region] = mon
            dns_ep = ep["dns"]
            say(
                f"\n1. {len(devices)} devices connected; * MQTT 5, commands at QoS 0 and acknowledged,"
                " the others MQTT 3.1.1.  Each asked the DNS server "
                f"{dns_ep['host']}:{dns_ep['port']} for {dns_ep['name']} from its region's network:"
            )
            for region in regions:
                d = answered[region]
                say(
                    f"   {region:10} from {dns_ep['client_networks'][region]:16} answered {d.host} "
                    f"({d.region}): "
                    + ", ".join(x + ("*" if _speaks_mqtt5(x) else "") for x in _device_ids(region))
                )
            firmware = threading.Thread(
                target=_firmware,
                args=(stop_firmware, [d for k, d in devices.items() if _speaks_mqtt5(k)]),
                daemon=True,
            )
            firmware.start()

            # 2. telemetry up
            sent = 0
            for i in range(READINGS_PER_DEVICE):
                for dev_id, d in devices.items():
                    reading = {
                        "run": run_id,
                        "device": dev_id,
                        "seq": i,
                        "temp_c": round(20 + 0.5 * i, 1),
                        "ts": int(time.time() * 1000),  # send time, ms: Spark measures latency from it
                    }
                    props = publish_properties(user=DEVICE_TAGS) if _speaks_mqtt5(dev_id) else None
                    d.publish(c.device_telemetry_topic(dev_id), reading, qos=1, properties=props)
                    sent += 1
            got = tap.drain(expect=sent, timeout=STEP_TIMEOUT_S)
            per_region = Counter(m.region for m in got)
            say(f"\n2. devices published {sent} readings at QoS 1 (each PUBACKed by its gateway);")
            say(f"   the backend exchange {c.TELEMETRY_EXCHANGE} received {len(got)}:")
            for region in regions:
                devs = Counter(m.device for m in got if m.region == region)
                say(
                    f"   from {region:10} {per_region.get(region, 0):3} messages  "
                    + "  ".join(f"{k}:{v}" for k, v in sorted(devs.items()))
                )
            ok_tags = all(m.region is not None and m.device in _device_ids(m.region) for m in got)
            checks.append(
                (len(got) == sent, f"uplink: {len(got)}/{sent} device messages reached the backend")
            )
            checks.append(
                (
                    ok_tags and len(got) > 0,
                    "uplink: every message tagged with the region of its gateway",
                )
            )

            # 3. one command down
            target_region = regions[0]
            target = _device_ids(target_region)[0]
            topic = c.device_command_topic(target, "set-interval")
            wait_for_presence(ep, target, target_region)
            send_command(url, target, topic, json.dumps({"interval_s": 10}))
            say(f"\n3. the backend handed {topic} to the router ({c.COMMANDS_EXCHANGE});")
            say(
                f"   the router knows {target} is at {target_region} and sent it through "
                f"{c.downlink_exchange(target_region)}:"
            )
            time.sleep(0.5)
            devices[target].wait_for(1, timeout=STEP_TIMEOUT_S)
            time.sleep(1.0)  # give a misrouted copy time to show up
            for dev_id, d in devices.items():
                mark = "received it" if d.received else "-"
                say(f"   {dev_id:16} {mark}")
            for region, mon in monitors.items():
                say(f"   gateway {region:10} saw {len(mon.received)} command(s)")
            others = [d for k, d in devices.items() if k != target and d.received]
            checks.append(
                (
                    len(devices[target].received) == 1,
                    f"downlink: {target} received the command once",
                )
            )
            checks.append((not others, "downlink: no other device received it"))
            checks.append(
                (
                    all(not m.received for r, m in monitors.items() if r != target_region),
                    f"downlink: no gateway but {target_region}'s saw it",
                )
            )
            echo = tap.drain(timeout=1.5)
            checks.append((not echo, "downlink: the command did not echo back into telemetry"))
            command_id = c.message_id(topic, json.dumps({"interval_s": 10}).encode())
            steps = _steps_on_record(ep, command_id, "routed")
            say(f"   `fedgate command {command_id}` shows what the router did with it:")
            for step in steps:
                say(f"   {step.line()}")
            checks.append(
                (
                    # the end: a demo run before this one on the same federation sent the same
                    # command (the same id), and its steps are on record before these
                    [(s.outcome, s.region) for s in steps][-2:]
                    == [("accepted", ""), ("routed", target_region)],
                    f"downlink: the command's steps are on record in Kafka (routed at {target_region})",
                )
            )

            # 3b. a question, and its answer
            asked_region = regions[-1]
            asked = next(d for d in _device_ids(asked_region) if _speaks_mqtt5(d))
            wait_for_presence(ep, asked, asked_region)
            _, reply = send_and_wait(
                url, asked, c.device_command_topic(asked, "firmware"), "{}", timeout_s=STEP_TIMEOUT_S
            )
            answer = json.loads(reply.payload) if reply is not None else None
            say(
                f"   then `fedgate send {asked} .../commands/firmware --wait --answer` asked the MQTT 5 "
                "device,"
            )
            say(
                f"   which answered on its response topic: {answer} "
                f"(via {reply.region}, {reply.after_s:.2f} s)"
                if reply is not None
                else f"   which did not answer within {STEP_TIMEOUT_S:.0f} s"
            )
            checks.append(
                (
                    answer is not None and answer.get("firmware") == DEVICE_TAGS["fw"],
                    f"downlink: {asked} (MQTT 5) answered the sender's question",
                )
            )
        finally:
            stop_firmware.set()
            for d in [*devices.values(), *monitors.values()]:
                d.close()

    # 4. telemetry in Kafka
    records = read_kafka(ep["kafka"]["bootstrap"], c.KAFKA_TELEMETRY_TOPIC, run_id, expect=sent)
    say(
        f"\n4. the routers bridged the telemetry into Kafka: {len(records)} records of this run in "
        "topic telemetry.telemetry"
    )
    by_region = Counter(r["region"] for r in records)
    for region in regions:
        say(
            f"   region {region:10} {by_region.get(region, 0):3} records, keys "
            + ", ".join(sorted({r["key"] for r in records if r["region"] == region}))
        )
    checks.append((len(records) == sent, f"kafka: {len(records)}/{sent} readings stored, keyed by device"))
    in_order = all(
        [r["seq"] for r in records if r["key"] == dev] == list(range(READINGS_PER_DEVICE)) for dev in devices
    )
    checks.append((in_order, "kafka: every device's readings in the order it sent them"))
    tagged = {r["key"] for r in records if r["user_properties"] == DEVICE_TAGS}
    say(f"   MQTT 5 devices' user properties arrived as headers mqtt.user.*: {sorted(tagged)}")
    checks.append(
        (
            tagged == {d for d in devices if _speaks_mqtt5(d)},
            "kafka: the MQTT 5 devices' user properties arrived as record headers",
        )
    )

    # 5. Spark tables
    if fed.settings.spark:
        say("\n5. the Spark job turned the records into tables; a query over this run's readings:")
        checks += spark_tables(fed, run_id, sent, len(devices), say)

    # 6. summary
    say("\n6. summary")
    for ok, text in checks:
        say(f"   {'PASS' if ok else 'FAIL'}  {text}")
    backend_mgmt = ep["backend"]["management"]
    say("\nThe federation keeps running. Explore it:")
    say("   fedgate status                 nodes, ports, connections, queue depths (make status)")
    say(
        f"   http://{host}:{backend_mgmt}/   backend management UI, user {ep['admin']['user']}, "
        f"password in {fed.secrets_file}"
    )
    say("   fedgate devices add my-sensor  a device of your own: its MQTT user and secret (shown once)")
    if ep.get("tls"):
        first = ep["gateways"][regions[0]]
        say(
            f"   MQTT over TLS: {first['address']}:{first['mqtts']} ({regions[0]}), CA {ep['tls']['ca']}, "
            f"e.g. mosquitto_pub --cafile <CA> -p {first['mqtts']} -u my-sensor -P <secret> ..."
        )
    say(
        f"   Kafka bootstrap: {ep['kafka']['bootstrap']}  "
        "(topics telemetry.*, fedgate.deadletter, fedgate.command.outcomes, ...)"
    )
    say("   fedgate presence               which device is where (make presence)")
    say("   fedgate send DEVICE TOPIC MSG  a command to a device, wherever it is; prints its id")
    say("   fedgate command ID             what the router did with that command, step by step")
    say("   make console                   the fleet console in your browser (fedgate console)")
    if ep.get("prometheus"):
        say(f"   Prometheus: {ep['prometheus']}  (every node's metrics; alerts: {ep['prometheus']}/alerts)")
    say("Stop it with: make down")
    return 0 if all(ok for ok, _ in checks) else 1
