"""The baseline's bridge: MQTT telemetry from one broker into Kafka, at least once.

    python -m bench.baseline_bridge HOST PORT BOOTSTRAP TOPIC

A paho-mqtt subscriber (persistent session, QoS 1, manual acks) and a
confluent-kafka producer with the router's settings.  Each message is
acknowledged to the broker only once Kafka's delivery report came back, so
a bridge that dies loses nothing the broker still holds.  SIGTERM flushes
the producer and exits.
"""

from __future__ import annotations

import signal
import sys
import threading

import paho.mqtt.client as mqtt
from confluent_kafka import Producer

from router.kafka import producer_config

SUBSCRIPTION = "devices/+/telemetry"


def main(host: str, port: int, bootstrap: str, topic: str) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    producer = Producer(producer_config(bootstrap))
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2, client_id="baseline-bridge", clean_session=False, manual_ack=True
    )
    errors = 0

    def on_connect(c: mqtt.Client, userdata: object, flags: object, rc: object, props: object = None) -> None:
        c.subscribe(SUBSCRIPTION, qos=1)
        print("subscribed", SUBSCRIPTION, flush=True)

    def on_message(c: mqtt.Client, userdata: object, msg: mqtt.MQTTMessage) -> None:
        device = msg.topic.split("/")[1]

        def delivered(err: object, record: object, mid: int = msg.mid, qos: int = msg.qos) -> None:
            nonlocal errors
            if err is None:
                c.ack(mid, qos)
            else:  # unacked: the broker sends it again when the bridge reconnects
                errors += 1

        while True:
            try:
                producer.produce(topic, msg.payload, key=device, on_delivery=delivered)
                return
            except BufferError:  # the producer's queue is full: let Kafka catch up
                producer.poll(0.05)

    client.on_connect = on_connect
    client.on_message = on_message
    client.connect(host, port, keepalive=30)
    client.loop_start()
    try:
        while not stop.is_set():
            producer.poll(0.05)
    finally:
        producer.flush(30)
        client.disconnect()
        client.loop_stop()
        print(f"stopped ({errors} delivery errors)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]))
