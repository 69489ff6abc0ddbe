"""Fan-in: one prefill rank serves 256 decode ranks over TCP, every one linking at the same
moment and pulling at once, with every byte checked; the prefill rank's threads do not grow
with them (a fixed set of event loops serves every connection), and its threads and
descriptors are back to their baseline after they unlink, and after they are SIGKILLed.

Real processes and sockets: P is datadist_peer.py (LLMDataDist, native engine, default caps);
each D is an LLMDataDist in a process of its own (fan_in_decoders.py forks them), 3
connections each (one control, two data). P's threads and fds are read from /proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .datadist_harness import Peer, start_peer
from .native_peer import READY_TIMEOUT_S, stop_peer_process

DECODERS = 256
CLUSTER = 5100
TOKEN = "fan-in-token-0123456789abcdef0123456789"
SCRIPT = Path(__file__).resolve().parent / "fan_in_decoders.py"
# After the last D unlinked or was killed, P holds nothing of it within this bound.
RELEASE_BOUND_S = 5.0
REPLY_TIMEOUT_S = 180.0


@pytest.fixture(scope="module")
def prefill() -> Iterator[Peer]:
    peer = start_peer(CLUSTER, "native", TOKEN)
    yield peer
    peer.stop()


def threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def back_to(pid: int, baseline: tuple[int, int], bound_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + bound_s
    while (now := threads_and_fds(pid)) != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


class Decoders:
    """The decoders' parent process, driven line by line."""

    def __init__(self, peer: Peer) -> None:
        cmd = [sys.executable, str(SCRIPT), "--count", str(DECODERS)]
        cmd += ["--peer-port", str(peer.port), "--peer-cluster", str(CLUSTER)]
        cmd += ["--auth-token", TOKEN]
        env = {k: v for k, v in os.environ.items() if k != "HIXL_AUTH_TOKEN"}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.pids = self.reply(READY_TIMEOUT_S)["pids"]

    def command(self, word: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        return self.reply(REPLY_TIMEOUT_S)

    def reply(self, timeout_s: float) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        assert line, f"the decoders did not answer within {timeout_s} s"
        return dict(json.loads(line))

    def stop(self) -> None:
        stop_peer_process(self.proc)


def link_and_pull_all(peer: Peer) -> Decoders:
    decoders = Decoders(peer)
    outcome = decoders.command("go")
    assert outcome["errors"] == [], outcome
    assert (outcome["linked"], outcome["verified"]) == (DECODERS, DECODERS), outcome
    return decoders


def test_256_decoders_link_one_prefill_rank_at_once(prefill: Peer) -> None:
    baseline = back_to(prefill.pid, threads_and_fds(prefill.pid), 1.0)
    decoders = link_and_pull_all(prefill)
    try:
        threads, fds = threads_and_fds(prefill.pid)
        # Every link holds its three connections; not one thread more for them.
        assert threads == baseline[0], f"{threads - baseline[0]} threads more with 256 links"
        assert fds >= baseline[1] + 3 * DECODERS, (fds, baseline)
        assert decoders.command("unlink") == {"exited": DECODERS}
    finally:
        decoders.stop()
    assert back_to(prefill.pid, baseline, RELEASE_BOUND_S) == baseline


def test_256_decoders_killed_without_unlinking_leave_nothing(prefill: Peer) -> None:
    baseline = back_to(prefill.pid, threads_and_fds(prefill.pid), 1.0)
    decoders = link_and_pull_all(prefill)
    try:
        assert decoders.command("kill") == {"killed": DECODERS}
    finally:
        decoders.stop()
    assert back_to(prefill.pid, baseline, RELEASE_BOUND_S) == baseline


def test_a_link_to_a_full_server_waits_its_turn() -> None:
    """A P engine whose connection cap (17, its smallest) one link fills answers the next
    link busy, not failed; the connector's link asks again until a slot frees, within its
    bound, and a link that stays busy fails naming the cap's key."""
    import threading

    from hixl_connector import _native
    from hixl_connector.connector.peers.compatibility import PeerError
    from hixl_connector.connector.peers.engine_links import EngineLinks
    from hixl_connector.datadist import load_backend

    from .datadist_harness import Client
    from .native_peer import start_peer as start_native_peer

    full = 49  # a native peer's cluster id tags its bytes: small
    peer = start_native_peer(full, server_connections=17)
    holder = _native.Engine(CLUSTER + 2, transport="tcp", tcp_connections=16)
    api = load_backend("native")
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.hixl_transport = "tcp"
    client = Client(api, api.LLMDataDist(api.LLMRole.DECODER, CLUSTER + 3))
    client.dd.init(config.generate_options())
    try:
        assert holder.link(full, "127.0.0.1", peer.port, 3000) == (0, "")
        target = SimpleNamespace(cluster_id=full, engine_host="127.0.0.1", engine_port=peer.port)
        with pytest.raises(PeerError, match="busy for 500 ms.*'server_connections'"):
            EngineLinks(api, client.dd, "127.0.0.1", 0.5).link(target)  # type: ignore[arg-type]
        freed = threading.Timer(0.5, lambda: holder.unlink(full, 1000, False))
        freed.start()
        started = time.monotonic()
        EngineLinks(api, client.dd, "127.0.0.1", 5.0).link(target)  # type: ignore[arg-type]
        assert 0.4 < time.monotonic() - started < 3.0
        freed.join()
    finally:
        client.dd.finalize()
        holder.close()
        peer.stop()
