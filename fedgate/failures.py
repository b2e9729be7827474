"""How a failed `fedgate` command ends: one line on stderr, and an exit code a script can act on.

main() (fedgate/cli.py) catches every failure and asks `explain` for both. A command raises
Unreachable, Refused, TimedOut or Usage itself when it knows better than the exception it
caught what failed and what to do; every other exception -- fedgate's own errors, pika's,
aio-pika's, Kafka's, urllib's, a socket's -- is mapped here and nowhere else. EXIT_CODES is
the table `fedgate --help` prints; docs/operations.md repeats it.
"""

from __future__ import annotations

import contextlib
import errno
import select
import socket
import sys
import textwrap
import urllib.error
from collections.abc import Iterator, Sequence
from enum import IntEnum
from typing import Any
from urllib.parse import urlsplit

from backend.errors import FedgateError
from backend.rabbitmq_admin import AdminError
from infra.local.settings import SettingsError


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    NOT_RUNNING = 3
    UNREACHABLE = 4
    REFUSED = 5
    TIMED_OUT = 6
    INTERRUPTED = 130
    OUTPUT_CLOSED = 141


EXIT_CODES: tuple[tuple[Exit, str], ...] = (
    (Exit.OK, "done"),
    (
        Exit.FAILED,
        "failed, and the line says why: a command dead-lettered, nothing on record for a command id, "
        "a gateway that did not take a device change, anything acknowledged lost in `army`, "
        "an error of fedgate's",
    ),
    (Exit.USAGE, "usage: a wrong argument or setting; nothing was done"),
    (Exit.NOT_RUNNING, "`status`: a node of the federation is not running"),
    (
        Exit.UNREACHABLE,
        "unreachable: a node of the federation (a broker, Kafka, a router's HTTP port) "
        "cannot be reached or does not answer",
    ),
    (
        Exit.REFUSED,
        "refused: the federation refused it (an unregistered device, a command too large, a login)",
    ),
    (Exit.TIMED_OUT, "timed out: what --wait waited for did not happen within --timeout"),
    (Exit.INTERRUPTED, "interrupted (Ctrl-C, SIGTERM)"),
    (
        Exit.OUTPUT_CLOSED,
        "its output's reader went away (`fedgate status | head`): it stopped writing, quietly, "
        "as a tool stopped by SIGPIPE does",
    ),
)

DEBUG_ENV = "FEDGATE_DEBUG"

#: What a refusal that is not about a login has the person do.
REFUSED_HINT = "`fedgate status` shows whether the federation is whole; -v adds the traceback"
UP_HINT = "is the federation up? `fedgate status` names what is down, `fedgate up` starts it"
LOGIN_HINT = "FEDGATE_STATE_DIR must be the federation's state folder (its secrets.json holds the passwords)"


def exit_codes_help() -> str:
    """The exit codes as `fedgate --help` ends: one row each, wrapped under its meaning."""
    rows = [
        textwrap.fill(meaning, 100, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
        for code, meaning in EXIT_CODES
    ]
    return (
        "exit codes:\n"
        + "\n".join(rows)
        + f"\n\nA failure is one line on stderr: what failed, and what to do. -v (or {DEBUG_ENV}=1) "
        "adds its traceback."
    )


class Failure(FedgateError):
    """A failure whose line its raiser wrote: what failed, then what to do (main puts the
    command's name before it)."""

    code = Exit.FAILED

    def __init__(self, what: str, todo: str = ""):
        super().__init__(f"{what}: {todo}" if todo else what)


class Usage(Failure):
    code = Exit.USAGE


class Unreachable(Failure):
    code = Exit.UNREACHABLE


class Refused(Failure):
    code = Exit.REFUSED


class TimedOut(Failure):
    code = Exit.TIMED_OUT


#: The attribute `reaching` names the endpoint in, on the exception that passes through it.
_ENDPOINT = "fedgate_endpoint"


def address(url: str) -> str:
    """host:port of a URL, without the credentials it may carry; "host:port" lists as they are."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


@contextlib.contextmanager
def reaching(service: str, urls: str | Sequence[str]) -> Iterator[None]:
    """Names the service and its address in the line `explain` writes for a failure within:
    pika's and urllib's connection errors do not say where they tried."""
    try:
        yield
    except Exception as e:
        if not hasattr(e, _ENDPOINT):
            where = ", ".join(address(u) for u in ([urls] if isinstance(urls, str) else urls))
            with contextlib.suppress(AttributeError):  # an exception with __slots__ stays unnamed
                setattr(e, _ENDPOINT, f"{service} at {where}")
        raise


def require_listening(service: str, bootstrap: str, timeout: float = 3.0) -> None:
    """Unreachable unless one of `bootstrap`'s "host:port" accepts a TCP connection.

    librdkafka retries an unreachable bootstrap in the background without raising, and
    writes each attempt to stderr itself: the kernel is asked first."""
    reasons = []
    for hostport in bootstrap.split(","):
        host, _, port = hostport.strip().rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return
        except OSError as e:
            reasons.append(e.strerror or str(e) or type(e).__name__)
    raise Unreachable(f"{service} at {bootstrap} cannot be reached ({'; '.join(reasons)})", UP_HINT)


def output_closed(exc: BaseException) -> bool:
    """Whether `exc` is standard output's reader having gone (`fedgate status | head`) rather
    than a socket's peer: then there is nothing to say and nowhere to say it.  Python ignores
    SIGPIPE, so a write to the closed pipe raises instead of ending the process; restoring the
    signal would end it on a broker's closed socket too."""
    if not isinstance(exc, BrokenPipeError):
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poll = select.poll()
    poll.register(fd, 0)  # POLLERR is always reported: a pipe's once its reader closed it
    return any(events & select.POLLERR for _, events in poll.poll(0))


def explain(exc: BaseException, command: str) -> tuple[Exit, str]:
    """The exit code and the one line, after "fedgate: ", for a command's failure."""
    code, line = _explain(exc, command)
    return code, " ".join(line.split())


def _explain(exc: BaseException, command: str) -> tuple[Exit, str]:
    if isinstance(exc, Failure):
        return exc.code, f"{command}: {exc}"
    if isinstance(exc, SettingsError):
        return Exit.USAGE, f"settings: {exc}"
    if isinstance(exc, AdminError) and exc.status in (401, 403):
        return Exit.REFUSED, f"{command}: {exc}: {LOGIN_HINT}"
    if isinstance(exc, AdminError) and exc.status is None and exc.retriable:
        return Exit.UNREACHABLE, f"{command}: {exc}: {UP_HINT}"
    if isinstance(exc, FedgateError):
        return Exit.FAILED, f"error: {exc}"
    kafka = _kafka(exc)
    known = kafka or _connection(exc)
    if known is None:
        return Exit.FAILED, (
            f"{command}: {type(exc).__name__}: {exc}: fedgate did not expect this failure; "
            f"{DEBUG_ENV}=1 shows where it happened"
        )
    code, reason, todo = known
    where = "Kafka" if kafka else getattr(exc, _ENDPOINT, "a node of the federation")
    if code == Exit.UNREACHABLE:
        return code, f"{command}: {where} cannot be reached ({reason}): {todo}"
    if code == Exit.REFUSED:
        return code, f"{command}: {where} refused it ({reason}): {todo}"
    return code, f"{command}: {where} failed ({reason}): {todo}"


#: What the socket says when no route leads to the node (a refused or timed-out connect are
#: ConnectionRefusedError and TimeoutError).
_NO_ROUTE = (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN)


def _loaded(module: str) -> Any:
    """A third-party module if this process imported it: none other can have raised its errors,
    and the CLI does not pay for importing it to find that out."""
    return sys.modules.get(module)


def _kafka(exc: BaseException) -> tuple[Exit, str, str] | None:
    ck = _loaded("confluent_kafka")
    if ck is None or not isinstance(exc, ck.KafkaException):
        return None
    err = exc.args[0] if exc.args else None
    if not isinstance(err, ck.KafkaError):
        return Exit.FAILED, str(exc), REFUSED_HINT
    e = ck.KafkaError
    if err.code() in (e._TRANSPORT, e._ALL_BROKERS_DOWN, e._RESOLVE, e._TIMED_OUT, e.REQUEST_TIMED_OUT):
        return Exit.UNREACHABLE, err.str(), UP_HINT
    if err.code() in (
        e._AUTHENTICATION,
        e.SASL_AUTHENTICATION_FAILED,
        e.TOPIC_AUTHORIZATION_FAILED,
        e.GROUP_AUTHORIZATION_FAILED,
        e.CLUSTER_AUTHORIZATION_FAILED,
    ):
        return Exit.REFUSED, err.str(), LOGIN_HINT
    if err.code() == e.MSG_SIZE_TOO_LARGE:
        return Exit.REFUSED, err.str(), REFUSED_HINT
    return Exit.FAILED, err.str(), REFUSED_HINT


def _connection(exc: BaseException) -> tuple[Exit, str, str] | None:
    """pika's, aio-pika's, urllib's and the socket's ways of saying that a node cannot be
    reached or refused what was asked; None for anything else."""
    p = _loaded("pika.exceptions")
    if p is not None:
        if isinstance(
            exc, p.ProbableAuthenticationError | p.ProbableAccessDeniedError | p.AuthenticationError
        ):
            return Exit.REFUSED, _pika_reason(exc) or "login refused", LOGIN_HINT
        if isinstance(exc, p.ConnectionClosedByBroker | p.ChannelClosedByBroker):
            return Exit.REFUSED, f"{exc.reply_code} {exc.reply_text}", REFUSED_HINT
        if isinstance(exc, p.UnroutableError | p.NackError):
            return Exit.REFUSED, "the broker did not take the message", REFUSED_HINT
        if isinstance(exc, p.AMQPConnectionError):
            return Exit.UNREACHABLE, _pika_reason(exc) or type(exc).__name__, UP_HINT
    a = _loaded("aiormq.exceptions")
    if a is not None:
        if isinstance(exc, a.ProbableAuthenticationError | a.AuthenticationError | a.ConnectionNotAllowed):
            return Exit.REFUSED, str(exc) or "login refused", LOGIN_HINT
        if isinstance(exc, a.ChannelAccessRefused | a.ChannelNotFoundEntity | a.ChannelPreconditionFailed):
            return Exit.REFUSED, str(exc), REFUSED_HINT
    if isinstance(exc, urllib.error.HTTPError):
        # it answered: a 4xx is a refusal, anything else a failure of the node's own
        if exc.code in (401, 403):
            return Exit.REFUSED, f"HTTP {exc.code} {exc.reason}", LOGIN_HINT
        code = Exit.REFUSED if 400 <= exc.code < 500 else Exit.FAILED
        return code, f"HTTP {exc.code} {exc.reason}", REFUSED_HINT
    if isinstance(exc, urllib.error.URLError):
        return Exit.UNREACHABLE, _os_reason(exc.reason), UP_HINT
    r = _loaded("requests.exceptions")
    if r is not None and isinstance(exc, r.ConnectionError | r.Timeout):
        return Exit.UNREACHABLE, str(exc), UP_HINT
    if isinstance(exc, OSError) and (
        isinstance(exc, ConnectionError | TimeoutError | socket.gaierror) or exc.errno in _NO_ROUTE
    ):
        return Exit.UNREACHABLE, _os_reason(exc), UP_HINT
    return None


def _os_reason(reason: object) -> str:
    if isinstance(reason, OSError):
        return reason.strerror or str(reason) or type(reason).__name__
    return str(reason)


def _pika_reason(exc: BaseException) -> str:
    """The socket's reason under pika's connection-workflow wrappers (their str() is empty)."""
    seen: object = exc
    for _ in range(5):
        if isinstance(seen, OSError):
            return _os_reason(seen)
        inner = getattr(seen, "exception", None) or (getattr(seen, "exceptions", None) or [None])[-1]
        if inner is None and isinstance(seen, BaseException) and seen.args:
            inner = seen.args[0] if isinstance(seen.args[0], BaseException) else None
        if inner is None:
            break
        seen = inner
    return str(seen)
