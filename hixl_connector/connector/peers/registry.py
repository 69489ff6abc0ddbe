"""D side: the prefill ranks this worker pulls from, each handshaken and linked once.

A peer is one TP rank of a prefill engine (a D rank may read several when the TP sizes
differ), keyed by its engine id (a restarted P engine has a new one) and side-channel address.
The first request for a peer runs the handshake (schema and compatibility check),
then `link_clusters`; later requests reuse the link. A pull that timed out or lost its link
marks the peer broken; the next request unlinks with force and does both steps again, as
LLM-DataDist requires after LLM_TIMEOUT.

Only `get` handshakes and links, and only the transfer pool calls it; vLLM's step thread looks
peers up with `linked` and `in_place`, which never wait on a peer or on another thread's
handshake.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.mapping.block_slices import BlockSizeMismatch, blocks_per_block
from hixl_connector.connector.mapping.tp_mapping import heads_per_rank
from hixl_connector.connector.metadata import PeerRank
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.handshake import (
    SCHEMA_VERSION,
    HandshakePayload,
    describe_mismatch,
)
from hixl_connector.connector.peers.side_channel import SideChannelClient
from hixl_connector.datadist import Backend, DataDist

logger = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """The peer cannot be used: handshake refused, incompatible, or link failed."""


# An unlink waits this long for the peer's goodbye (a dead peer never answers); shutdown
# unlinks every peer at once and waits this long in all.
UNLINK_TIMEOUT_MS = 1000
UNLINK_BOUND_S = 2.0


@dataclass
class _AddressLock:
    """Serializes handshakes to one address; `users` counts threads holding or awaiting it."""

    lock: threading.Lock
    users: int = 0


@dataclass
class Peer:
    engine_id: str
    cluster_id: int
    payload: HandshakePayload
    client: SideChannelClient
    # Reads from it are one-sided copies out of this host's memory (the engine's same-host
    # transport): they end whatever the peer does, so they may feed the step's forward.
    in_place: bool = False
    broken: bool = False


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
    ) -> None:
        self._api = api
        self._reads_in_place = reads_in_place
        self._record = record
        self._datadist = datadist
        self._context = context
        self._local = local
        self._config = config
        self._peers: dict[tuple[str, int, str, int], Peer] = {}
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
        key = target.key
        address = target.address
        with self._guard:
            entry = self._locks.setdefault(address, _AddressLock(threading.Lock()))
            entry.users += 1
        try:
            with entry.lock:  # one handshake at a time per address
                peer = self._peers.get(key)
                if peer is not None and not peer.broken:
                    return peer
                self._raise_if_just_failed(key)
                try:
                    return self._connect(key, target)
                except Exception as e:
                    with self._guard:
                        self._failures[key] = (time.monotonic(), str(e))
                    raise
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
        """True iff a handshake with this engine rank succeeded and still holds."""
        return self.linked(target) is not None

    def linked(self, target: PeerRank) -> Peer | None:
        """The peer if linked and not broken; never connects."""
        peer = self._known(target)
        return peer if peer is not None and not peer.broken else None

    def in_place(self, target: PeerRank) -> Peer | None:
        """The peer if its link reads in place, broken or not (a broken same-host link
        either reads or fails at once); never connects."""
        peer = self._known(target)
        return peer if peer is not None and peer.in_place else None

    def _known(self, target: PeerRank) -> Peer | None:
        with self._guard:
            return self._peers.get(target.key)

    def mark_broken(self, peer: Peer) -> None:
        peer.broken = True

    def notice_client(self, target: PeerRank) -> tuple[SideChannelClient, bool]:
        """The client lease notices to ``target`` go through, and whether the caller owns
        (and closes) it: a linked peer's one persistent client, else a fresh one to an
        address no handshake vouched for."""
        peer = self.linked(target)
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
        """Unlinks every peer, all at once: each unlink waits up to ``UNLINK_TIMEOUT_MS`` for
        a peer that may be dead, so shutdown takes about one such wait however many peers
        there are (at most ``UNLINK_BOUND_S``; links still closing then are left to the
        engine's finalize, which closes them all)."""
        self.stop()
        with self._guard:
            peers, self._peers = list(self._peers.values()), {}
        if not peers:
            return
        done = threading.Semaphore(0)

        def close_one(peer: Peer) -> None:
            try:
                self._unlink(peer, force=False)
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

    def _connect(self, key: tuple[str, int, str, int], target: PeerRank) -> Peer:
        client = self.client_for(target)
        try:
            reply = client.request({"type": "handshake", "schema": SCHEMA_VERSION})
            payload = HandshakePayload.from_dict(reply["payload"])
            self._check_compatible(target, payload)
            # The handshake proved this engine serves the address now: links to engines it
            # replaced there (P restarted), and a broken link to itself, go first.
            with self._guard:
                stale = [self._peers.pop(k) for k in list(self._peers) if k[2:] == key[2:]]
                clash = [p for p in self._peers.values() if p.cluster_id == payload.cluster_id]
            for old in stale:
                if old.payload.incarnation != payload.incarnation:
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
                self._unlink(old, force=True)
                old.client.close()
            if clash:
                # Pulls address peers by cluster id: sharing one would read the other engine.
                raise PeerError(
                    f"prefill engines {clash[0].engine_id} and {payload.engine_id} both use "
                    f"cluster id {payload.cluster_id}; give each engine its own cluster_id_base"
                )
            self._link(payload)
        except Exception:
            client.close()
            raise
        logger.info(
            "hixl: linked to prefill engine %s rank %d (cluster %d at %s:%d)",
            payload.engine_id,
            payload.tp_rank,
            payload.cluster_id,
            payload.engine_host,
            payload.engine_port,
        )
        in_place = self._reads_in_place(payload.cluster_id)
        peer = Peer(payload.engine_id, payload.cluster_id, payload, client, in_place)
        with self._guard:
            self._peers[key] = peer
        return peer

    def _check_compatible(self, target: PeerRank, payload: HandshakePayload) -> None:
        remote = target.remote
        if payload.engine_id != remote.engine_id:
            raise PeerError(
                f"side channel {remote.host}:{target.port} serves engine {payload.engine_id}, "
                f"the request expects {remote.engine_id} (prefill restarted?)"
            )
        if payload.incarnation != remote.incarnation:
            raise PeerError(
                f"prefill engine {payload.engine_id} at {remote.host}:{target.port} was "
                f"restarted: it runs incarnation {payload.incarnation:x}, the request's "
                f"kv_transfer_params come from incarnation {remote.incarnation:x}"
            )
        if payload.compatibility_hash != self._local.compatibility_hash:
            raise PeerError(
                f"prefill engine {payload.engine_id} is incompatible with this decode engine: "
                + describe_mismatch(self._local.compatibility, payload.compatibility)
            )
        if payload.tp_rank != target.rank or payload.tp_size != remote.tp_size:
            raise PeerError(
                f"asked rank {target.rank} of tp_size {remote.tp_size}, got rank "
                f"{payload.tp_rank} of tp_size {payload.tp_size}"
            )
        if payload.cluster_id != target.cluster_id:
            # Pulls address the peer by the handshake's cluster id; params naming another
            # one come from a P configured differently from the one serving this address.
            raise PeerError(
                f"prefill engine {payload.engine_id} rank {payload.tp_rank} has cluster id "
                f"{payload.cluster_id}, its kv_transfer_params say {target.cluster_id} "
                "(remote_cluster_id + rank)"
            )
        # Whether the TP sizes can be mapped at all was settled before the handshake
        # (tp_mapping.check_shardable, in the worker's plan).
        fields = self._local.compatibility
        expected = (
            heads_per_rank(fields["num_kv_heads"], payload.tp_size)
            if fields["kv_split"] == "heads"
            else 1
        )
        if payload.units_per_block != expected:
            raise PeerError(
                f"prefill rank {payload.tp_rank} registered {payload.units_per_block} units "
                f"per block, {expected} expected for tp_size {payload.tp_size}"
            )
        try:
            ratio = blocks_per_block(payload.block_sizes, self._local.block_sizes)
        except BlockSizeMismatch as e:
            raise PeerError(f"prefill engine {payload.engine_id}: {e}") from None
        if ratio > 1 and not (
            payload.slice_bytes and payload.slice_bytes == self._local.slice_bytes
        ):
            raise PeerError(
                f"prefill engine {payload.engine_id} has block_size {payload.block_sizes}, this "
                f"engine {self._local.block_sizes}, and a KV layout ({fields['kv_layout']}, "
                f"slices of {payload.slice_bytes} and {self._local.slice_bytes} bytes) that "
                "cannot assemble larger blocks from smaller ones: use equal block sizes"
            )

    def _link(self, payload: HandshakePayload) -> None:
        api = self._api
        info = self._cluster_info(payload)
        timeout_ms = int(self._config.handshake_timeout_s * 1000)
        status, per_cluster = self._datadist.link_clusters([info], timeout_ms)
        codes = api.LLMStatusCode
        result = per_cluster[0] if per_cluster else status
        # ALREADY_LINK is a failure too: stale links are torn down before linking, so another
        # engine holds this cluster id.
        if status != codes.LLM_SUCCESS or result != codes.LLM_SUCCESS:
            raise PeerError(
                f"link_clusters to cluster {payload.cluster_id} at "
                f"{payload.engine_host}:{payload.engine_port} failed: {status!r} {per_cluster!r}"
            )

    def _cluster_info(self, payload: HandshakePayload) -> Any:
        info = self._api.LLMClusterInfo()
        info.remote_cluster_id = payload.cluster_id
        # Port 0: the local side of a one-sided link needs no listener.
        info.append_local_ip_info(self._config.engine_host, 0)
        info.append_remote_ip_info(payload.engine_host, payload.engine_port)
        return info

    def _unlink(self, peer: Peer, force: bool) -> None:
        info = self._cluster_info(peer.payload)
        try:
            self._datadist.unlink_clusters([info], UNLINK_TIMEOUT_MS, force=force)
        except Exception as e:  # unlinking a dead peer may fail; the link is gone either way
            logger.warning("hixl: unlink of cluster %d failed: %s", peer.cluster_id, e)
