"""A simulated device's resolver (fedgate/dns_resolver.py): it keeps an answer for its TTL,
as a device's stub resolver does, and dials what the answer holds."""

from __future__ import annotations

import pytest

from fedgate.dns_resolver import DnsResolver
from fedgate.resolver import Endpoint, NoHealthyGatewayError
from infra.dns.query import DnsQueryError, DnsServer


class Answers:
    """The server's answers, one per question, and a clock the test moves."""

    def __init__(self, *answers: tuple[list[str], int]):
        self.answers = list(answers)
        self.now = 0.0

    def ask(self) -> tuple[list[str], int]:
        if not self.answers:
            raise DnsQueryError("no answer")
        return self.answers.pop(0)


def resolver(a: Answers) -> DnsResolver:
    regions = {"127.0.1.1": "local-eu", "127.0.2.1": "local-us"}
    return DnsResolver(
        DnsServer("127.0.0.1", 5353),
        "mqtt.fedgate.test",
        1883,
        regions=regions,
        ask=a.ask,
        clock=lambda: a.now,
    )


def test_an_answer_is_kept_for_its_ttl_and_asked_again_after():
    a = Answers((["127.0.1.1"], 5), (["127.0.2.1"], 5))
    r = resolver(a)
    assert r.resolve() == Endpoint("local-eu", "127.0.1.1", 1883)
    a.now = 4.9
    assert r.resolve().region == "local-eu" and r.questions == 1, "inside the TTL: no question"
    a.now = 5.0
    assert r.resolve() == Endpoint("local-us", "127.0.2.1", 1883)
    assert r.questions == 2


def test_a_lost_gateway_is_skipped_when_the_answer_holds_another_and_dialled_again_when_not():
    a = Answers((["127.0.1.1", "127.0.2.1"], 5))
    r = resolver(a)
    lost = r.resolve()
    assert r.resolve(exclude=[lost]).host == "127.0.2.1"
    b = Answers((["127.0.1.1"], 5))
    only = resolver(b)
    assert only.resolve(exclude=[only.resolve()]).host == "127.0.1.1", "what DNS gave, until it gives else"


def test_no_answer_is_an_error_a_device_retries_on():
    with pytest.raises(NoHealthyGatewayError):
        resolver(Answers()).resolve()
