"""What an army run does (ArmyPlan) and the devices it runs with (DeviceSpec).

Plain data, shared by the parent and the worker processes (a WorkerConfig
carries them to each spawned worker, pickled).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ArmyPlan:
    devices: int = 1000
    #: telemetry messages per second, the whole army together
    rate: float = 1000.0
    duration_s: float = 30.0
    processes: int = 2
    #: regions devices call home, round robin; empty: every gateway of the federation
    regions: list[str] = field(default_factory=list)
    #: commands per second sent through the router, spread over the devices
    commands_per_s: float = 0.0
    qos: int = 1
    #: QoS of each device's command subscription; None: the device subscribes to nothing
    #: (an idle connection, as the benchmark's memory figure needs it).  At QoS 0 (fedgate's
    #: choice, docs/router.md) each device acknowledges its commands on devices/<id>/acks
    command_qos: int | None = 0
    #: MQTT persistent sessions: the gateway keeps a device's subscription while it is away
    persistent_sessions: bool = False
    tls: bool = False
    prefix: str = "army"
    #: new connections per second while the army connects
    connect_rate: float = 1000.0
    #: seconds into the run: drop every device's connection at once
    storm_at_s: float | None = None
    #: seconds into the run: this share of the devices moves to another region
    roam_at_s: float | None = None
    roam_share: float = 0.2
    #: (region, seconds into the run): that region's gateway is killed
    kill_gateway: tuple[str, float] | None = None
    #: how long to wait for stragglers (Kafka, command receipts) after the run
    drain_timeout_s: float = 60.0
    #: seconds at the start of the run left out of the latency percentiles (latency_all_ms has them)
    warmup_s: float = 0.0
    #: after the drain, how long to wait for a duplicate before counting (split between the
    #: devices' commands and Kafka's records)
    settle_s: float = 3.0
    payload_pad: int = 0

    def validate(self) -> ArmyPlan:
        if self.devices < 1 or self.processes < 1 or self.duration_s <= 0 or self.rate < 0:
            raise ValueError("devices, processes and duration must be positive, rate not negative")
        if self.settle_s < 0 or self.warmup_s < 0:
            raise ValueError("settle_s and warmup_s: not negative")
        if self.qos not in (0, 1):
            raise ValueError("qos: 0 or 1")
        if self.command_qos not in (None, 0, 1):
            raise ValueError("command_qos: 0, 1 or None")
        if not 0 <= self.roam_share <= 1:
            raise ValueError("roam_share: between 0 and 1")
        return self


@dataclass(frozen=True)
class DeviceSpec:
    device_id: str
    secret: str
    #: (region, host, port), home first: where a device that knows its gateways (a target
    #: without DNS: the benchmarks' baseline) connects, then fails over to
    endpoints: tuple[tuple[str, str, int], ...] = ()
    #: (region, client network), home first: a device that finds its gateway by DNS
    #: (fedgate/army/resolving.py) asks from its address in the first; roaming moves it to the next
    networks: tuple[tuple[str, str], ...] = ()
    #: which address of an answer with several (a region's gateway cluster) it dials
    pick: int = 0
    #: the address a device with endpoints dials from ("": the kernel's choice); one source
    #: address has ~28,000 ports towards one gateway, so a larger army spreads its devices over
    #: several (the whole of 127.0.0.0/8 is this machine's)
    source: str = ""

    def __post_init__(self) -> None:
        if not (self.endpoints or self.networks):
            raise ValueError(f"{self.device_id}: neither endpoints nor client networks")
