"""Where a command goes: the routing decision, as a pure function.

The downlink (router/downlink.py) gathers what the router knows about the
device at that moment -- its live session, whether that session subscribes
to the command's topic, whether the device was ever seen, whether a gateway
answers -- into a `View`, asks `decide` what to do, and carries the
`Decision` out.  No I/O happens here, so every case is a unit test
(tests/unit/router/test_routing.py) and a change of policy is a change of
this file.

The policy, in the order it is applied:

1. a command without a device or topic, or whose topic is a filter, or
   whose response topic the device could not publish to, is dead-lettered
   with the reason; so is one whose expiry (x-fedgate-expires-at) passed;
2. a command that came back from a region whose gateway did not take it
   in time (contract.DOWNLINK_RETURN_AFTER_MS): if presence still puts the
   device there and that gateway does not answer, the session died with
   the gateway -- it is ended, and the command goes on as for a device
   that is offline; a returned broadcast copy is not sent round again;
3. a device connected and subscribed to the topic: sent to its region only;
   connected but not subscribed yet: held (parked) until it subscribes,
   since MQTT would drop it -- a retained command is kept as desired state
   only, replayed to that connection when it subscribes;
4. a device never seen that the registry (router/registry.py) does not
   know: dead-lettered with the reason -- no device will ever take it;
5. a retained command (desired state) for a device not connected: nothing
   more -- the desired state is replayed when it subscribes anywhere;
6. a device seen before or registered, or any device when unknown devices
   are parked: parked until it comes back;
7. a device never seen when the registry cannot say (no gateway answers):
   broadcast to every region.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from backend import contract as c
from gateways.mqtt_plugin import NO_PROPERTIES, Mqtt5Properties
from router.presence import Session

UNKNOWN_DEVICE_CHOICES = ("broadcast", "park")


class Action(enum.Enum):
    SEND = "routed"
    HOLD = "held"
    PARK = "parked"
    BROADCAST = "broadcast"
    DESIRED = "desired"
    DEADLETTER = "deadlettered"


@dataclass(frozen=True)
class Command:
    """A device-bound message as it arrived on the commands queue."""

    device: str
    topic: str
    retain: bool = False
    #: the region whose gateway sent this command back untaken (None: a new command)
    returned_from: str | None = None
    #: it was one region's copy of a broadcast
    broadcast_copy: bool = False
    #: epoch seconds after which it is not delivered (None: it waits as long as parking does)
    expires_at: float | None = None
    #: what an MQTT 5 device gets with it: response topic, correlation data, content type
    properties: Mqtt5Properties = NO_PROPERTIES


@dataclass(frozen=True)
class View:
    """What the router knows about the command's device when it decides."""

    session: Session | None
    #: whether that session subscribes to the command's topic (True when not known)
    subscribed: bool = True
    #: the device was seen connected, or has parked or desired state
    known: bool = False
    #: whether the registry has the device (None: not asked, or no gateway answered)
    registered: bool | None = None
    #: "broadcast" or "park": what a command for a device never seen does
    unknown_device: str = "broadcast"
    #: for a returned command whose session is at that region: whether its gateway answers
    gateway_answers: bool = True
    #: the time of the decision, epoch seconds (for the command's expiry)
    now: float = 0.0


@dataclass(frozen=True)
class Decision:
    action: Action
    #: the region to send to (SEND) or that holds the device (HOLD)
    region: str | None = None
    #: why (DEADLETTER), for the dead-letter record
    reason: str = ""
    #: keep the command as the device's desired state before anything else
    store_desired: bool = False
    #: a session that ended unseen with its gateway: presence forgets it first
    end_session: Session | None = None

    def outcome(self) -> str:
        """What the router reports it did: "routed:<region>", "parked", ..."""
        if self.action in (Action.SEND, Action.HOLD):
            return f"{self.action.value}:{self.region}"
        return self.action.value


def invalid(device: str, topic: str, response_topic: str | None = None) -> str:
    """Why a command cannot be routed at all ("" when it can)."""
    if not device:
        return f"command without the {c.DEVICE_HEADER} header"
    if not topic:
        return f"command without the {c.TOPIC_HEADER} header"
    if any(ch in topic for ch in "+#") or "\x00" in topic:
        return f"topic {topic!r} is a filter, not a topic"
    if response_topic is not None:
        own = f"devices/{device}/"
        if not response_topic.startswith(own) or len(response_topic) == len(own):
            # the gateway would refuse the answer: a device publishes under its own topics only
            return f"response topic {response_topic!r} is not under {own}, where the device may publish"
        if any(ch in response_topic for ch in "+#") or "\x00" in response_topic:
            return f"response topic {response_topic!r} is a filter, not a topic"
    return ""


def expired(cmd: Command, now: float) -> str:
    """Why a command is no longer delivered ("" while it still is)."""
    if cmd.expires_at is None or cmd.expires_at > now:
        return ""
    late = now - cmd.expires_at
    return f"expired before it reached the device ({c.EXPIRES_AT_HEADER} passed {late:.1f}s ago)"


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic filter matching ("+" one level, "#" the rest)."""
    f, t = topic_filter.split("/"), topic.split("/")
    for i, part in enumerate(f):
        if part == "#":
            return True
        if i >= len(t) or (part != "+" and part != t[i]):
            return False
    return len(f) == len(t)


def must_ask_gateway(cmd: Command, session: Session | None) -> bool:
    """Whether deciding needs `View.gateway_answers`: a command came back from the region
    presence still puts the device in."""
    return cmd.returned_from is not None and session is not None and session.region == cmd.returned_from


def decide(cmd: Command, view: View) -> Decision:
    """What to do with one command (see the module docstring for the policy)."""
    why = invalid(cmd.device, cmd.topic, cmd.properties.response_topic) or expired(cmd, view.now)
    if why:
        return Decision(Action.DEADLETTER, reason=why)
    if cmd.returned_from is not None:
        return _decide_returned(cmd, view)
    session = view.session
    store = cmd.retain
    if session is not None and not view.subscribed:
        if cmd.retain:
            # MQTT would drop it now; the desired state is replayed to this very connection
            # when it subscribes (sending it now would mark it replayed, and it never came)
            return Decision(Action.DESIRED, store_desired=True)
        return Decision(Action.HOLD, region=session.region)
    if session is not None:
        return Decision(Action.SEND, region=session.region, store_desired=store)
    if not view.known and view.registered is False:
        return Decision(Action.DEADLETTER, reason=f"device {cmd.device!r} is not registered")
    if cmd.retain:
        # desired state is replayed when the device subscribes: parking it too would deliver twice
        return Decision(Action.DESIRED, store_desired=True)
    if view.known or view.registered or view.unknown_device == "park":
        return Decision(Action.PARK)
    return Decision(Action.BROADCAST)


def _decide_returned(cmd: Command, view: View) -> Decision:
    region = cmd.returned_from
    session, ended = view.session, None
    if must_ask_gateway(cmd, session) and not view.gateway_answers:
        session, ended = None, view.session
    if cmd.broadcast_copy and session is None:
        # the other regions had their copies; a device nobody has seen gets no second round
        return Decision(
            Action.DEADLETTER,
            reason=(
                f"broadcast copy not taken by region {region} within "
                f"{c.DOWNLINK_RETURN_AFTER_MS // 1000}s (its gateway is down)"
            ),
            end_session=ended,
        )
    if cmd.retain:
        # its desired state was kept when it was first routed
        if session is not None and session.region == region:
            return Decision(Action.SEND, region=region, end_session=ended)
        return Decision(Action.DESIRED, end_session=ended)
    fresh = dataclasses.replace(cmd, retain=False, returned_from=None, broadcast_copy=False)
    again = decide(fresh, dataclasses.replace(view, session=session))
    return Decision(again.action, again.region, again.reason, end_session=ended)
