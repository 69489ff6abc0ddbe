"""D side: the prefill ranks this worker reads, each handshaken and linked once; the one
owner of which links exist.

A peer is one TP rank of a prefill engine (a D rank may read several when the TP sizes
differ), keyed by its engine id, incarnation and side-channel address. The first read of a
peer runs the handshake (compatibility.py), then `link_clusters`; later reads reuse the link,
which lives until
- a read over it timed out or lost it (`drop`): the peer is forgotten at once and unlinked
  with force (as LLM-DataDist requires after LLM_TIMEOUT) off the caller's thread; a
  same-host one stays readable in the step for RETIRE_S first, since the scheduler may
  have chosen reads in the step from it before it hears of the drop, and a one-sided copy
  out of this host's memory reads or fails at once;
- no read used it for ``link_idle_s`` (`close_idle`, asked once a step);
- another engine answers at its address (P restarted), or claims its cluster id while it no
  longer answers;
- shutdown (`close`).
What this table holds is linked and nothing else is; every peer it forgets goes into the
scheduler's picture (link_reports) in the same step, so the scheduler's view, this table and
the engine's links agree. The links and unlinks of one address run under that address's
lock, so a new link never races the unlink of the old one (both name one cluster id).

Only `get` handshakes and links, and only the transfer pool calls it; vLLM's step thread looks
peers up with `linked` and `in_place`, which never wait on a peer or on another thread's
handshake.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import PeerRank, RemoteEndpoint
from hixl_connector.connector.link_reports import LinkReporter
from hixl_connector.connector.peers.compatibility import PeerError, check_compatible
from hixl_connector.connector.peers.engine_links import EngineLinks
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.handshake import SCHEMA_VERSION, HandshakePayload
from hixl_connector.connector.peers.side_channel import SideChannelClient, SideChannelError
from hixl_connector.datadist import Backend, DataDist

logger = logging.getLogger(__name__)

# Shutdown unlinks every peer at once and waits this long in all.
UNLINK_BOUND_S = 2.0
# How often close_idle looks for idle peers, at most.
IDLE_CHECK_S = 1.0
# How long a dropped same-host peer still serves reads in the step: the scheduler hears of
# the drop in the next step's report, so a few steps at most are in between.
RETIRE_S = 5.0


@dataclass
class _AddressLock:
    """Serializes links and unlinks at one address; `users` counts threads holding or
    awaiting it."""

    lock: threading.Lock
    users: int = 0


@dataclass
class Peer:
    target: PeerRank
    payload: HandshakePayload
    client: SideChannelClient
    # Reads from it are one-sided copies out of this host's memory (the engine's same-host
    # transport): they end whatever the peer does, so they may feed the step's forward.
    in_place: bool = False
    used_at: float = 0.0  # monotonic: its last lookup or read
    force_unlink: bool = False  # dropped after a failed read: no goodbye to wait for
    unlink_at: float = 0.0  # monotonic, once dropped: when the unlinking thread unlinks it

    @property
    def engine_id(self) -> str:
        return self.payload.engine_id

    @property
    def cluster_id(self) -> int:
        return self.payload.cluster_id


class PeerRegistry:
    def __init__(
        self,
        api: Backend,
        datadist: DataDist,
        context: zmq.Context,
        local: HandshakePayload,
        config: HixlConfig,
        reads_in_place: Callable[[int], bool],
        record: Callable[[str], None],
        links: LinkReporter,
    ) -> None:
        self._engine = EngineLinks(api, datadist, config.engine_host, config.handshake_timeout_s)
        self._reads_in_place = reads_in_place
        self._record = record
        self._links = links
        self._context = context
        self._local = local
        self._config = config
        self._peers: dict[tuple[str, int, str, int], Peer] = {}
        # Forgotten peers not unlinked yet, by address; a thread unlinks them while any are.
        self._dropped: dict[tuple[str, int], list[Peer]] = {}
        self._unlinking = False
        self._next_idle_check = 0.0
        # Addresses come from kv_transfer_params, i.e. clients name them: an entry lives only
        # while a thread uses it, so the table never outgrows the transfer pool.
        self._locks: dict[tuple[str, int], _AddressLock] = {}
        # A peer whose handshake or link just failed: (when, why). Requests queued behind it
        # fail at once instead of each waiting out its own timeout; after one timeout's time
        # a request tries again. Client-named, so old entries are dropped on every lookup.
        self._failures: dict[tuple[str, int, str, int], tuple[float, str]] = {}
        self._guard = threading.Lock()
        # Set at shutdown: every request of this registry's clients gives up at once.
        self._stopping = threading.Event()

    def get(self, target: PeerRank) -> Peer:
        """The peer, handshaken and linked now if it is not yet (the transfer pool only)."""
        key = target.key
        asked = time.monotonic()
        with self._holding(target.address):
            peer = self.linked(target)
            if peer is not None:
                return peer
            self._unlink_dropped_at(target.address)
            self._raise_if_just_failed(key)
            try:
                return self._connect(key, target, asked)
            except Exception as e:
                with self._guard:
                    self._failures[key] = (time.monotonic(), str(e))
                raise

    @contextlib.contextmanager
    def _holding(self, address: tuple[str, int], timeout_s: float = -1) -> Iterator[None]:
        """Holds ``address``'s lock (waits up to ``timeout_s``, or for as long as it takes)."""
        with self._guard:
            entry = self._locks.setdefault(address, _AddressLock(threading.Lock()))
            entry.users += 1
        try:
            if not entry.lock.acquire(timeout=timeout_s):
                raise PeerError(f"{address[0]}:{address[1]} is busy linking or unlinking")
            try:
                yield
            finally:
                entry.lock.release()
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._locks[address]

    def _raise_if_just_failed(self, key: tuple[str, int, str, int]) -> None:
        now = time.monotonic()
        window = self._config.handshake_timeout_s
        with self._guard:
            self._failures = {k: f for k, f in self._failures.items() if now - f[0] < window}
            failure = self._failures.get(key)
        if failure is not None:
            raise PeerError(
                f"prefill engine {key[0]} at {key[2]}:{key[3]} failed {now - failure[0]:.1f} s "
                f"ago ({failure[1]}); not retried for {window:g} s (handshake_timeout_s)"
            )

    def is_linked(self, target: PeerRank) -> bool:
        """True iff a handshake with this engine rank succeeded and its link holds."""
        return self._known(target) is not None

    def linked(self, target: PeerRank) -> Peer | None:
        """The peer if linked (its idle time restarts); never connects."""
        peer = self._known(target)
        if peer is not None:
            peer.used_at = time.monotonic()
        return peer

    def in_place(self, target: PeerRank) -> Peer | None:
        """The peer if its link reads in place, dropped in the last RETIRE_S or not (a
        same-host link reads or fails at once); never connects."""
        with self._guard:
            peer = self._peers.get(target.key)
            if peer is None:
                dropped = self._dropped.get(target.address, ())
                peer = next((p for p in dropped if p.target.key == target.key), None)
        return peer if peer is not None and peer.in_place else None

    def _known(self, target: PeerRank) -> Peer | None:
        with self._guard:
            return self._peers.get(target.key)

    def read_through(self, remote: RemoteEndpoint, peers: Collection[Peer]) -> None:
        """A read of ``remote`` went through ``peers``: the scheduler learns whether that
        engine is read in place (only while every one of them is still linked)."""
        now = time.monotonic()
        with self._guard:
            live = all(self._peers.get(peer.target.key) is peer for peer in peers)
        for peer in peers:
            peer.used_at = now
        self._links.read(remote, live and all(peer.in_place for peer in peers))

    def drop(self, peer: Peer) -> None:
        """A read over ``peer``'s link timed out or lost it: no read finds the peer from now
        on, the scheduler hears of it in this step's report, and the link is unlinked with
        force off this thread (the next read handshakes and links again)."""
        self._forget(peer, force=True)

    def close_idle(self, now: float) -> None:
        """Unlinks the peers no read used for ``link_idle_s`` (asked once a step; looks at
        most once every IDLE_CHECK_S); a later read links again."""
        idle_s = self._config.link_idle_s
        if not idle_s or now < self._next_idle_check:
            return
        self._next_idle_check = now + min(IDLE_CHECK_S, idle_s / 2)
        with self._guard:
            idle = [peer for peer in self._peers.values() if now - peer.used_at > idle_s]
        for peer in idle:
            if self._forget(peer, force=False):
                self._record("idle_unlinks")

    def _forget(self, peer: Peer, force: bool) -> bool:
        with self._guard:
            if self._stopping.is_set() or self._peers.get(peer.target.key) is not peer:
                return False
            del self._peers[peer.target.key]
            peer.force_unlink = force
            peer.unlink_at = time.monotonic() + (RETIRE_S if peer.in_place else 0.0)
            self._dropped.setdefault(peer.target.address, []).append(peer)
            start, self._unlinking = not self._unlinking, True
        self._links.lost(peer.target.remote)
        if start:
            threading.Thread(target=self._unlink_dropped, name="hixl-unlink", daemon=True).start()
        return True

    def _unlink_dropped(self) -> None:
        """Unlinks the forgotten peers as they fall due, an address at a time under its
        lock, until none is left (then the thread ends)."""
        while not self._stopping.is_set():
            with self._guard:
                if not self._dropped:
                    self._unlinking = False
                    return
                due = {a: min(p.unlink_at for p in ps) for a, ps in self._dropped.items()}
            address = min(due, key=due.__getitem__)
            wait_s = due[address] - time.monotonic()
            if wait_s > 0:
                self._stopping.wait(wait_s)
                continue
            with self._holding(address):
                self._unlink_dropped_at(address)
        with self._guard:
            self._unlinking = False

    def _unlink_dropped_at(self, address: tuple[str, int]) -> None:
        """Unlinks the peers forgotten at ``address``; the caller holds its lock."""
        with self._guard:
            peers = self._dropped.pop(address, [])
        for peer in peers:
            self._engine.unlink(peer.payload, peer.force_unlink)
            peer.client.close()

    def notice_client(self, target: PeerRank) -> tuple[SideChannelClient, bool]:
        """The client lease notices to ``target`` go through, and whether the caller owns
        (and closes) it: a linked peer's one persistent client, else a fresh one to an
        address no handshake vouched for."""
        peer = self._known(target)
        if peer is not None:
            return peer.client, False
        return self.client_for(target), True

    def client_for(self, target: PeerRank) -> SideChannelClient:
        """A side-channel client for one handshake or notice, without linking."""
        return SideChannelClient(
            self._context,
            target.remote.host,
            target.port,
            Destination(target.remote.engine_id, target.rank, target.remote.incarnation),
            self._config.handshake_timeout_s,
            self._config.auth_token,
            self._stopping,
        )

    def stop(self) -> None:
        """Handshakes and notices under way give up now (the first step of shutdown)."""
        self._stopping.set()

    def close(self) -> None:
        """Unlinks every peer, all at once: each unlink waits up to a second (engine_links)
        for a peer that may be dead, so shutdown takes about one such wait however many peers
        there are (at most ``UNLINK_BOUND_S``; links still closing then are left to the
        engine's finalize, which closes them all)."""
        self.stop()
        with self._guard:
            peers = list(self._peers.values())
            peers += [peer for dropped in self._dropped.values() for peer in dropped]
            self._peers, self._dropped = {}, {}
        if not peers:
            return
        done = threading.Semaphore(0)

        def close_one(peer: Peer) -> None:
            try:
                self._engine.unlink(peer.payload, peer.force_unlink)
                peer.client.close()
            finally:
                done.release()

        for peer in peers:
            threading.Thread(
                target=close_one, args=(peer,), name="hixl-unlink", daemon=True
            ).start()
        deadline = time.monotonic() + UNLINK_BOUND_S
        for _ in peers:
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                logger.warning("hixl: peers still unlinking after %.1f s are left", UNLINK_BOUND_S)
                return

    def _connect(self, key: tuple[str, int, str, int], target: PeerRank, asked: float) -> Peer:
        """Handshakes and links ``target`` (asked for at ``asked``, which the log shows)."""
        began = time.monotonic()
        client = self.client_for(target)
        try:
            reply = client.request({"type": "handshake", "schema": SCHEMA_VERSION})
            payload = HandshakePayload.from_dict(reply["payload"])
            check_compatible(target, payload, self._local)
            # The handshake proved this engine serves the address now: links to engines it
            # replaced there (P restarted) go first.
            with self._guard:
                stale = [self._peers.pop(k) for k in list(self._peers) if k[2:] == key[2:]]
                clash = [p for p in self._peers.values() if p.cluster_id == payload.cluster_id]
            for old in stale:
                self._record("peer_restarts")
                logger.info(
                    "hixl: prefill engine %s (incarnation %x) at %s:%d replaced by %s "
                    "(incarnation %x)",
                    old.engine_id,
                    old.payload.incarnation,
                    *target.address,
                    payload.engine_id,
                    payload.incarnation,
                )
                self._links.lost(old.target.remote)
                self._engine.unlink(old.payload, force=True)
                old.client.close()
            for other in clash:
                self._claim_cluster_id(other, payload)
            self._engine.link(payload)
        except Exception:
            client.close()
            raise
        peer_id = (payload.engine_id, payload.tp_rank, payload.cluster_id)
        where = f"{payload.engine_host}:{payload.engine_port}"
        took = (time.monotonic() - began, began - asked)
        message = "hixl: linked to prefill engine %s rank %d (cluster %d at %s) in %.2f s, %s"
        logger.info(message, *peer_id, where, took[0], f"begun {took[1]:.2f} s after it was asked")
        in_place = self._reads_in_place(payload.cluster_id)
        peer = Peer(target, payload, client, in_place, used_at=time.monotonic())
        with self._guard:
            self._peers[key] = peer
        return peer

    def _claim_cluster_id(self, other: Peer, payload: HandshakePayload) -> None:
        """``payload``'s engine announces the cluster id ``other`` is linked under: a peer
        that still answers keeps it (pulls address peers by cluster id, so sharing one would
        read the other engine); one that no longer does (stopped, or moved on) is unlinked."""
        if self._still_serves(other):
            raise PeerError(
                f"prefill engines {other.engine_id} and {payload.engine_id} both use "
                f"cluster id {payload.cluster_id}; give each engine its own cluster_id_base"
            )
        logger.info(
            "hixl: prefill engine %s at %s:%d no longer answers; its cluster id %d goes to %s",
            other.engine_id,
            *other.target.address,
            other.cluster_id,
            payload.engine_id,
        )
        self._forget(other, force=True)
        with self._holding(other.target.address, self._config.handshake_timeout_s):
            self._unlink_dropped_at(other.target.address)

    def _still_serves(self, peer: Peer) -> bool:
        """Whether ``peer``'s engine still answers at its address: a connect first (a stopped
        process refuses at once), then a handshake only that engine's start accepts."""
        try:
            timeout_s = self._config.handshake_timeout_s
            socket.create_connection(peer.target.address, timeout=timeout_s).close()
            peer.client.request({"type": "handshake", "schema": SCHEMA_VERSION})
        except (OSError, SideChannelError):
            return False
        return True
