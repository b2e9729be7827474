"""Starting and stopping the local federation's OS processes, leaving none behind.

Every process the local driver starts carries an environment marker,
``FEDGATE_NODE_ID=<state dir>::<node>``, inherited by all its children
(Erlang's helper processes, the JVM's).  Liveness and clean-up go by that
marker, not by pid alone: a stale pid file can never make fedgate signal a
stranger's process, and ``down`` finds every child even if a wrapper script
exited early.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from backend.polling import wait_until

MARKER_VAR = "FEDGATE_NODE_ID"

#: Node processes this Python process started and has not yet waited for.
#: Held here, not on short-lived objects, so that a node's Popen is never
#: garbage-collected while the node runs.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def marker(state_dir: Path, node: str) -> str:
    """The marker of `node`'s processes; with node "", the prefix of every node's of the state
    dir.  A node's ends in "::" so that it is no prefix of another's (backend, backend-2)."""
    return f"{state_dir.resolve()}::{node}::" if node else f"{state_dir.resolve()}::"


def _read_environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return b""


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # the state field follows the parenthesised command name
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def marked_pids(prefix: str) -> list[int]:
    """Live (non-zombie) pids whose environment carries a marker starting with `prefix`."""
    needle = f"{MARKER_VAR}={prefix}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        if pid == os.getpid():
            continue
        for var in _read_environ(pid).split(b"\0"):
            if var.startswith(needle):
                if not _is_zombie(pid):
                    found.append(pid)
                break
    return sorted(found)


def set_descriptor_limit(want: int) -> int:
    """This process's descriptor limit set to `want`, its hard limit raised with it where this
    process may (root with CAP_SYS_RESOURCE), else as near as its hard limit lets; returns the
    limit it got.  The processes it starts inherit it."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
        return want
    except (ValueError, OSError):
        # not allowed to raise the hard limit: keep the one we have
        got = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (got, hard))
        return got


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGKILL when the process that started it dies, however it
    dies (a SIGKILL of a supervisor or a runner must not leave its service behind)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def sigterm_as_interrupt(signum: int, frame: object) -> None:
    """A SIGTERM handler: the same clean-up as Ctrl-C, so that a command stopped half-way stops
    the nodes it started (they run in sessions of their own, out of reach of its signal)."""
    raise KeyboardInterrupt


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    node_marker: str,
    log_path: Path,
    cwd: Path,
    max_fds: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start a node process in its own session, stdout/stderr appended to `log_path`."""
    full_env = {**env, MARKER_VAR: node_marker}

    def before_exec() -> None:
        if max_fds:
            set_descriptor_limit(max_fds)

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            env=full_env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=before_exec,
        )
    _CHILDREN[proc.pid] = proc
    return proc


def exit_code(pid: int) -> int | None:
    """Exit code of a node process this process started, None while it runs or if not ours."""
    proc = _CHILDREN.get(pid)
    return None if proc is None else proc.poll()


def is_child(pid: int) -> bool:
    """Whether `pid` is a node process this process started (and has not forgotten)."""
    return pid in _CHILDREN


def forget(pid: int, timeout: float = 5.0) -> None:
    """Wait for (reap) a stopped child so it leaves no zombie."""
    proc = _CHILDREN.pop(pid, None)
    if proc is not None:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _CHILDREN[pid] = proc


def stop_child(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM a child this process started, and SIGKILL it if it is still there after `grace`."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def signal_pids(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_marked(prefix: str, *, primary: Sequence[int] = (), grace: float = 30.0) -> list[int]:
    """Stop every process carrying `prefix`, gracefully first.

    SIGTERM goes to the `primary` pids (the node's own process: RabbitMQ and
    Kafka shut down cleanly on it, children follow).  What is still alive
    after `grace` seconds gets SIGKILL.  Returns the pids that had to be
    killed.
    """
    targets = list(primary) or marked_pids(prefix)
    signal_pids(targets, signal.SIGTERM)
    if wait_until(lambda: _gone(prefix), grace, 0.1):
        return []
    stragglers = marked_pids(prefix)
    signal_pids(stragglers, signal.SIGKILL)
    wait_until(lambda: _gone(prefix), 5, 0.05)
    return stragglers


def kill_marked(prefix: str, wait: float = 10.0) -> None:
    """SIGKILL every process carrying `prefix` at once; return once they are gone (a JVM
    with a large heap takes a moment to exit, and holds its ports until it has), or after
    `wait` seconds."""
    signal_pids(marked_pids(prefix), signal.SIGKILL)
    wait_until(lambda: _gone(prefix), wait, 0.05)


def _gone(prefix: str) -> bool:
    """No process carries `prefix` any more (exit statuses collected first)."""
    _reap_children()
    return not marked_pids(prefix)


def _reap_children() -> None:
    """Collect exit statuses of our node children so they do not linger as zombies."""
    for proc in list(_CHILDREN.values()):
        proc.poll()


def pid_alive(pid: int, node_marker: str) -> bool:
    """True if `pid` runs and is the process started for `node_marker`."""
    if pid <= 0 or _is_zombie(pid):
        return False
    env = _read_environ(pid)
    return f"{MARKER_VAR}={node_marker}".encode() in env.split(b"\0")


def rss_bytes(pids: Iterable[int]) -> int:
    """Resident memory of the given processes, summed (0 for those gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total
