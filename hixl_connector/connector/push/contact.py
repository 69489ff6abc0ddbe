"""D side of push mode: which prefill engine serves the address the router named.

The router names P by the identity of P's last push answer, which it keeps until P's next
one, so after a restart it can name an engine that is gone. D learns P's engine id, cluster
id and start from a first-contact handshake (naming no incarnation) and keeps them per
address until a push with that P fails.

A P found gone (no answer to a first contact, a registration or a status question) is
judged so for every request that reached this rank before: each of them fails at once
rather than waiting out a timeout of its own behind the others. A request that arrives
later contacts P again. First contacts of one address run one at a time; other addresses
never wait on them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.peers.handshake import SCHEMA_VERSION, HandshakePayload
from hixl_connector.connector.peers.registry import PeerRegistry
from hixl_connector.connector.peers.side_channel import SideChannelTimeout

logger = logging.getLogger(__name__)


# A P judged gone is remembered this long, for requests that reached D before the verdict
# (none waits longer than config.MAX_TIMEOUT_S for its push), and for this many addresses.
LOST_KEEP_S = 3600.0
MAX_LOST = 4096


class PushRefused(RuntimeError):
    """This deployment cannot take the request's KV by push."""


class PeerLost(RuntimeError):
    """The P this request waits on was found gone after the request arrived."""


@dataclass
class _Turn:
    """One first contact at a time per address; ``users`` counts threads holding or awaiting
    it (the entry goes with the last)."""

    lock: threading.Lock
    users: int = 0


class PrefillEndpoints:
    """P engines by (engine id, host, port) as first contact found them."""

    def __init__(self, peers: PeerRegistry) -> None:
        self._peers = peers
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str, int], RemoteEndpoint] = {}
        self._lost: dict[tuple[str, str, int], tuple[float, str]] = {}  # (when, why)
        self._turns: dict[tuple[str, str, int], _Turn] = {}

    def get(self, remote: RemoteEndpoint, fresh: bool, since: float) -> tuple[RemoteEndpoint, bool]:
        """P's engine as this rank knows it, and whether it was learned now: by a first
        contact where none is known for this address yet, or ``fresh``. Raises PeerLost
        where P was found gone at or after ``since`` (monotonic: when the request came)."""
        key = _key(remote)
        with self._turn(key):
            self.raise_if_lost(remote, since)
            with self._lock:
                endpoint = None if fresh else self._known.get(key)
            if endpoint is not None:
                return endpoint, False
            try:
                endpoint = self._first_contact(remote)
            except SideChannelTimeout as e:
                reason = f"no answer to a first contact: {e}"
                self.lost(remote, reason)
                raise PeerLost(f"prefill engine at {remote.host}:{remote.port}: {reason}") from e
            with self._lock:
                self._known[key] = endpoint
            return endpoint, True

    def forget(self, remote: RemoteEndpoint) -> None:
        """A failure with this P: the next request learns its start again (P restarted?)."""
        with self._lock:
            self._known.pop(_key(remote), None)

    def lost(self, remote: RemoteEndpoint, reason: str) -> None:
        """P was found gone now: every request that came before fails (raise_if_lost)."""
        now = time.monotonic()
        key = _key(remote)
        with self._lock:
            self._known.pop(key, None)
            self._lost.pop(key, None)
            self._lost[key] = (now, reason)
            old = [k for k, (when, _) in self._lost.items() if now - when > LOST_KEEP_S]
            for k in old + list(self._lost)[: max(0, len(self._lost) - MAX_LOST)]:
                self._lost.pop(k, None)

    def raise_if_lost(self, remote: RemoteEndpoint, since: float) -> None:
        """Raises PeerLost where P was found gone at or after ``since``."""
        with self._lock:
            verdict = self._lost.get(_key(remote))
        if verdict is not None and verdict[0] >= since:
            ago = time.monotonic() - verdict[0]
            raise PeerLost(
                f"prefill engine at {remote.host}:{remote.port} was found gone {ago:.1f} s "
                f"ago, after this request came: {verdict[1]}"
            )

    @contextlib.contextmanager
    def _turn(self, key: tuple[str, str, int]) -> Iterator[None]:
        with self._lock:
            turn = self._turns.setdefault(key, _Turn(threading.Lock()))
            turn.users += 1
        try:
            with turn.lock:
                yield
        finally:
            with self._lock:
                turn.users -= 1
                if turn.users == 0:
                    del self._turns[key]

    def _first_contact(self, remote: RemoteEndpoint) -> RemoteEndpoint:
        """Whoever serves P's side channel now, by a handshake naming no incarnation. The
        router's picture of P may be older than P's start, but the router sent P's leg to
        that same address, so the engine there is the one prefilling the request."""
        client = self._peers.client_for(remote.rank(0))
        try:
            reply = client.request({"type": "handshake", "schema": SCHEMA_VERSION})
        finally:
            client.close()
        payload = HandshakePayload.from_dict(reply.get("payload"))
        if payload.tp_rank != 0:
            raise PushRefused(
                f"{remote.host}:{remote.port} serves rank {payload.tp_rank} of engine "
                f"{payload.engine_id}, not rank 0"
            )
        if payload.engine_id != remote.engine_id:
            logger.info(
                "hixl: %s:%d now serves prefill engine %s (the router named %s)",
                remote.host,
                remote.port,
                payload.engine_id,
                remote.engine_id,
            )
        return replace(
            remote,
            engine_id=payload.engine_id,
            cluster_id=payload.cluster_id,
            incarnation=payload.incarnation,
        )


def _key(remote: RemoteEndpoint) -> tuple[str, str, int]:
    return (remote.engine_id, remote.host, remote.port)
