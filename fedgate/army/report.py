"""The army's report: the counts of a run, its text, and whether it kept its promises.

Lost means promised and missing: a reading the gateway acknowledged that
Kafka does not have, a command the backend confirmed that its device never
got.  The uplink latency is given after the plan's warm-up (latency_ms) and
over the whole run (latency_all_ms).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from fedgate.army.plan import ArmyPlan
from fedgate.army.verify import CommandSender, KafkaVerifier
from fedgate.stats import percentile, percentiles, quantiles


def _p50_by_third(samples: list[tuple[float, float]], start_ms: float, end_ms: float) -> list[float | None]:
    """The median latency of each third of [start_ms, end_ms), by send time."""
    thirds: list[list[float]] = [[], [], []]
    span = max(end_ms - start_ms, 1e-3)
    for lat, sent in samples:
        if start_ms <= sent < end_ms:
            thirds[min(2, int(3 * (sent - start_ms) / span))].append(lat)
    return [percentile(t, 0.50) for t in thirds]


def all_back_after_kill_s(last_connects_s: list[float], killed_at: float | None) -> float | None:
    """How long after the gateway's kill (`killed_at`, seconds into the run) the last device
    connected, from each worker's last connect (seconds into the run; 0 for a worker whose
    devices all connected before it began): 0 if none connected after it, None without a kill."""
    if killed_at is None or not last_connects_s:
        return None
    return round(max(0.0, max(last_connects_s) - killed_at), 1)


def build_report(
    plan: ArmyPlan,
    regions: list[str],
    done: dict[int, dict[str, Any]],
    failed: dict[int, str],
    verifier: KafkaVerifier,
    commands: CommandSender | None,
    ticks: dict[int, dict[str, int]],
    killed_at: float | None,
    t0: float,
) -> dict[str, Any]:
    acked = {d: seqs for w in done.values() for d, seqs in w["acked"].items()}
    # (latency, send time) of the readings sent after the warm-up (plan.warmup_s)
    warm_from_ms = (t0 + plan.warmup_s) * 1000
    after_warmup = [
        (lat, sent)
        for lat, sent in zip(verifier.latency_ms, verifier.sent_ms, strict=True)
        if sent >= warm_from_ms
    ]
    lost = sum(len(set(seqs) - set(verifier.seen.get(d, []))) for d, seqs in acked.items())
    in_kafka = sum(len(v) for v in verifier.seen.values())
    distinct = sum(len(set(v)) for v in verifier.seen.values())
    received = {d: n for w in done.values() for d, n in w["commands"].items()}
    sent_cmds = commands.confirmed if commands else {}
    lost_cmds = sorted(x for d, ns in sent_cmds.items() for x in set(ns) - set(received.get(d, [])))
    cmd_lost = len(lost_cmds)
    cmd_received = sum(len(v) for v in received.values())
    cmd_distinct = sum(len(set(v)) for v in received.values())
    total_acked = sum(len(v) for v in acked.values())
    connect_all_s = max((w["connect_all_s"] for w in done.values()), default=0.0)

    def tick(name: str) -> int:
        return sum(t.get(name, 0) for t in ticks.values())

    return {
        "plan": {k: v for k, v in asdict(plan).items() if v is not None},
        "regions": regions,
        "workers_failed": failed,
        "uplink": {
            "sent": tick("sent"),
            "acked": total_acked,
            "unacked": sum(w["unacked"] for w in done.values()),
            "skipped_while_disconnected": tick("skipped"),
            "in_kafka": in_kafka,
            "lost": lost,
            "duplicated": in_kafka - distinct,
            "acked_per_s": round(total_acked / plan.duration_s, 1),
            # after the warm-up (plan.warmup_s), and over the whole run
            "latency_ms": percentiles([lat for lat, _ in after_warmup]),
            "latency_all_ms": percentiles(verifier.latency_ms),
            # the median of each third of the run after the warm-up, by send time: a latency
            # that grows from third to third is a queue building up, not a steady state
            "latency_p50_by_third_ms": _p50_by_third(
                after_warmup, warm_from_ms, (t0 + plan.duration_s) * 1000
            ),
            # the latency after the warm-up at 1%, 2%, ... 100%: the CDF
            "latency_cdf_ms": quantiles([lat for lat, _ in after_warmup]),
        },
        "downlink": {
            "sent": commands.total if commands else 0,
            "received": cmd_received,
            "lost": cmd_lost,
            "duplicated": cmd_received - cmd_distinct,
            # an earlier run's commands the router sent again (their acknowledgement never came)
            "stale_from_earlier_runs": tick("stale_commands"),
            # when the lost ones were sent, seconds into the run (the first 50)
            "lost_sent_at_s": [round(commands.sent_at[n] - t0, 2) for n in lost_cmds[:50]]
            if commands
            else [],
            # and which they were (device, number in the command's body), to look them up in
            # the router's command outcomes
            "lost_first": [[d, n] for n in lost_cmds[:50] for d, ns in sent_cmds.items() if n in ns],
            "latency_ms": percentiles([x for w in done.values() for x in w["downlink_ms"]]),
        },
        "connections": {
            "devices": plan.devices,
            "connects": tick("connects"),
            # every device connected within this long (paced by plan.connect_rate; 0 means unpaced)
            "connect_all_s": round(connect_all_s, 2),
            "connect_per_s": round(plan.devices / connect_all_s, 1) if connect_all_s else None,
            "connect_ms": percentiles([x for w in done.values() for x in w["connect_ms"]]),
            "refused": tick("refused"),
            # SUBACKs of the devices' command subscriptions (plan.command_qos), granted and refused
            "subscribed": tick("subscribed"),
            "subscribe_refused": tick("subscribe_refused"),
            "connect_errors": tick("connect_errors"),
            "drops": tick("drops"),
            "reconnects": tick("reconnects"),
            "roamed": tick("roamed"),
            "storm_dropped": tick("storm_dropped"),
            "gateway_killed_at_s": killed_at,
            # the last device back this long after the kill (DNS TTL + health check, then backoff)
            "all_back_after_kill_s": all_back_after_kill_s(
                [w["last_connect_s"] for w in done.values()], killed_at
            ),
            # how the devices found their gateway: DNS questions (one per client network and
            # worker per TTL), unanswered ones, and where the devices were connected at the end
            "dns_questions": tick("dns_questions"),
            "dns_errors": tick("dns_errors"),
            "connected_at_end": dict(
                sorted(
                    sum((Counter(w.get("connected_at_end", {})) for w in done.values()), Counter()).items()
                )
            ),
        },
        "errors": [e for w in done.values() for e in w["errors"]][:20]
        + (commands.errors[:5] if commands else []),
    }


def to_text(r: dict[str, Any]) -> str:
    up, down, conn = r["uplink"], r["downlink"], r["connections"]
    lat, dl, cm = up["latency_ms"], down["latency_ms"], conn["connect_ms"]
    lines = [
        f"army: {conn['devices']} devices over {', '.join(r['regions'])}, "
        f"{r['plan']['rate']:g} readings/s offered for {r['plan']['duration_s']:g} s",
        f"  uplink    sent {up['sent']}, acked {up['acked']} ({up['acked_per_s']}/s), "
        f"in Kafka {up['in_kafka']}, "
        f"lost {up['lost']}, duplicated {up['duplicated']}, unacked {up['unacked']}; "
        f"device -> Kafka p50 {lat['p50']} p95 {lat['p95']} p99 {lat['p99']} max {lat['max']} ms",
        f"  downlink  sent {down['sent']}, received {down['received']}, lost {down['lost']}, "
        f"duplicated {down['duplicated']}; backend -> device p50 {dl['p50']} p99 {dl['p99']} ms",
        f"  connect   {conn['connects']} connects ({conn['connect_per_s']}/s while connecting; "
        f"p50 {cm['p50']} p99 {cm['p99']} ms), refused {conn['refused']}, errors {conn['connect_errors']}, "
        f"drops {conn['drops']}, reconnects {conn['reconnects']}, roamed {conn['roamed']}",
        f"  gateways  connected at the end {conn['connected_at_end']}"
        + (
            f"; found by DNS: {conn['dns_questions']} questions, {conn['dns_errors']} unanswered"
            if conn["dns_questions"] or conn["dns_errors"]
            else ""
        ),
    ]
    if r["workers_failed"]:
        lines.append(f"  workers failed: {r['workers_failed']}")
    for e in r["errors"][:5]:
        lines.append(f"  error: {e}")
    return "\n".join(lines)


def ok(r: dict[str, Any]) -> bool:
    """Nothing promised was lost, and every worker finished."""
    return not r["workers_failed"] and r["uplink"]["lost"] == 0 and r["downlink"]["lost"] == 0
