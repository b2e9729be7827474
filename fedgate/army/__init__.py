"""`fedgate army`: thousands of simulated devices against a running federation, counted end to end.

Each device is a real MQTT 3.1.1 client (paho-mqtt) with its own credentials
(`fedgate devices add`), connected to its home region's gateway.  Thousands
of them share one asyncio loop per worker process (paho driven through its
socket callbacks instead of a thread per client), and several worker
processes use every core.  Every device

- publishes telemetry at its share of the offered rate, QoS 1, with a
  sequence number and its send time (ms) in the payload;
- subscribes to its own command topic and records what arrives;
- finds its gateway by DNS from its home region's client network (or, for a
  target without DNS such as the benchmarks' baseline, from its list of
  endpoints) and, when its connection drops, reconnects to what DNS answers
  by then: the next region once the server sees its gateway dead (failover).

The parent process registers the devices, starts the workers, sends
commands through the backend (`fedgate.commands`, confirmed), and counts:
uplink readings are checked against what a Kafka consumer reads back from
the telemetry topic, commands against what the devices received.  Nothing
is assumed: a reading counts as lost when the gateway acknowledged it
(PUBACK) and Kafka does not have it; a command when the backend confirmed
it and the device never got it.

Events, at a time into the run: a reconnect storm (every device's
connection dropped at once), roaming (a share of the devices moves to
another region), and a gateway killed (SIGKILL; its devices fail over).

Where each part lives:

- `plan.py`: what to run (ArmyPlan) and who runs it (DeviceSpec);
- `worker.py`: a worker process, its devices on one asyncio loop;
- `device.py`: one device, a paho client driven by that loop;
- `resolving.py`: how a device finds its gateway by DNS (a cache per client network);
- `verify.py`: the parent's ledgers, what reached Kafka and which commands the
  next hop confirmed;
- `target.py`: what the fleet runs against (Target), fedgate's own federation
  or a benchmark's baseline;
- `run.py`: run_army and run_fleet, the run from connect to count;
- `report.py`: the report built from the counts, its text, and ok().

The percentiles are generic statistics, shared with bench/: `fedgate/stats.py`.
"""

from fedgate.army.plan import ArmyPlan, DeviceSpec
from fedgate.army.report import ok, to_text
from fedgate.army.run import run_army, run_fleet
from fedgate.army.target import Target, federation_target, router_commands
from fedgate.army.verify import CommandOpener, CommandSender, KafkaVerifier, UncheckedVerifier

__all__ = [
    "ArmyPlan",
    "CommandOpener",
    "CommandSender",
    "DeviceSpec",
    "KafkaVerifier",
    "Target",
    "UncheckedVerifier",
    "federation_target",
    "ok",
    "router_commands",
    "run_army",
    "run_fleet",
    "to_text",
]
