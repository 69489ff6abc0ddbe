"""A child process with a log file, bounded waits and whole-process-group shutdown.

Every process leads its own process group (``process_group=0``) so that stopping it also
stops whatever it spawned (vLLM's EngineCore, workers), and nothing outlives a test. Not its
own session: where the kernel groups tasks by session (``sched_autogroup_enabled``), each
session gets an equal share of the CPU whatever its tasks' nice values, so a niced server
that busy-steps would take as much as the server it starves.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")


@contextmanager
def signals_as_interrupt() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so a tool killed by it still stops the servers it
    started (its ``finally`` runs)."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# Python 3.10 has no ``process_group``: there the child calls setpgrp before it execs.
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


class ProcessFailed(RuntimeError):
    """A managed process exited or did not become ready in time."""


# Where ports are picked: below the kernel's ephemeral range, from which the OS draws every
# port-0 bind and the source port of every outgoing connection (health polls, side-channel
# clients). A port picked inside it can be taken by such a connection before its server binds
# it; below it, only another explicit pick can race for it.
PICK_FLOOR = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")

# What this process picked lately, one range per pick. A server binds its ports only once it
# is up (a vLLM worker's side channel: after the model loads), so until then they look free to
# the next pick; and vLLM takes its own ports by scanning upward from VLLM_PORT
# (``servers.VLLM_PORT_SPAN``). A later pick must land on neither. Bounded, because the servers
# of old picks have bound their ports or are gone; the bound holds several fleets at once.
_PICKED: deque[range] = deque(maxlen=256)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (IPv4 or IPv6) that was free a moment ago and that this process
    has not picked lately."""
    return free_port_range(1, host)


def free_port_range(count: int, host: str = "127.0.0.1", tries: int = 100) -> int:
    """The first of ``count`` consecutive TCP ports that were free a moment ago and that this
    process has not picked lately (a server whose ranks listen on ``port + rank``)."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = PICK_FLOOR
    for _ in range(tries):
        if ephemeral_low - PICK_FLOOR >= 1000:
            base = random.randrange(PICK_FLOOR, ephemeral_low - count + 1)
        else:  # no room below: the OS picks the first
            base = _bindable_by_the_os(host)
        ports = range(base, base + count)
        if ports[-1] > 65535 or _picked_lately(ports) or not _bindable(host, ports):
            continue
        _PICKED.append(ports)
        return base
    raise ProcessFailed(f"no {count} consecutive free ports found in {tries} tries")


def _picked_lately(ports: range) -> bool:
    return any(ports.start < picked.stop and picked.start < ports.stop for picked in _PICKED)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, ports: range) -> bool:
    family = _family(host)
    with ExitStack() as sockets:
        for port in ports:
            sock = sockets.enter_context(socket.socket(family, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def _bindable_by_the_os(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when a GET on ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def visit_process_group(pgid: int, visit: Callable[[Path], T]) -> dict[int, T]:
    """Calls ``visit(/proc/<pid>)`` for every process of process group ``pgid``; returns
    what it returned, by pid.

    A managed process's group holds all it spawned (vLLM's API server, EngineCore, workers),
    and only /proc lists them. Any of them may end between the listing and the visit: one that
    does (or whose entry turns unreadable) is left out rather than failing the walk, so
    ``visit`` may raise OSError for a process that is gone.
    """
    found: dict[int, T] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.getpgid(pid) == pgid:
                found[pid] = visit(entry)
        except OSError:  # gone meanwhile
            continue
    return found


class ManagedProcess:
    """One child process (and its process group), logging stdout+stderr to ``log_path``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._popen: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen is not None else None

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def start(self) -> ManagedProcess:
        if self._popen is not None:
            raise ProcessFailed(f"{self.name}: already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                **_OWN_PROCESS_GROUP,
            )
        self.started_at = time.monotonic()
        return self

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def first_traceback(self, lines: int = 40) -> str:
        """The log's first traceback: a server's root cause (a vLLM worker's failed start),
        which the wrappers' own tracebacks push out of the tail."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        start = next((i for i, line in enumerate(text) if "Traceback (most recent" in line), None)
        return "" if start is None else "\n".join(text[start : start + lines])

    def describe_failure(self, reason: str, lines: int = 60) -> str:
        first = self.first_traceback()
        cause = f"--- first traceback in {self.log_path} ---\n{first}\n" if first else ""
        return (
            f"{self.name} (pid {self.pid}, rc {self.returncode}): {reason}\n{cause}"
            f"--- last {lines} lines of {self.log_path} ---\n{self.log_tail(lines)}"
        )

    def wait_until(
        self, ready: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5
    ) -> float:
        """Poll ``ready`` until true; return seconds since start. Fails fast if the process dies."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise ProcessFailed(self.describe_failure(f"exited while waiting for {what}"))
            if ready():
                return time.monotonic() - self.started_at
            if time.monotonic() >= deadline:
                raise ProcessFailed(self.describe_failure(f"no {what} within {timeout_s:.0f} s"))
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL after ``grace_s``. Safe to call twice."""
        popen = self._popen
        if popen is None:
            return None
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                popen.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The leader may be gone while children of its group linger.
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return popen.poll()

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
