"""D links a prefill rank only when its handshake announces the cluster id that P's
kv_transfer_params name for that rank (``remote_cluster_id`` + rank)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from registry_support import LinkRecorder, PrefillRank, make_registry, payload

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.peers.compatibility import PeerError
from hixl_connector.connector.peers.registry import UNLINK_BOUND_S, Peer
from hixl_connector.connector.peers.side_channel import SideChannelError

P_RANK_ONE_CLUSTER = 9001  # P's rank 1; its rank 0 is 9000


@pytest.fixture
def prefill_rank_one(context: zmq.Context) -> Iterator[PrefillRank]:
    """A side channel serving the handshake of P's rank 1."""
    rank = PrefillRank(context, payload("prefill", 1, P_RANK_ONE_CLUSTER))
    yield rank
    rank.close()


@pytest.mark.parametrize(
    ("remote_cluster_id", "error"),
    [(P_RANK_ONE_CLUSTER - 1, None), (P_RANK_ONE_CLUSTER, "has cluster id 9001, .* say 9002")],
)
def test_params_must_name_the_cluster_id_the_handshake_announces(
    context: zmq.Context,
    prefill_rank_one: PrefillRank,
    remote_cluster_id: int,
    error: str | None,
) -> None:
    datadist = LinkRecorder()
    peers = make_registry(datadist, context)
    # P's rank 0 listens one port below: D finds rank 1 at remote_port + 1.
    port = prefill_rank_one.port - 1
    remote = RemoteEndpoint("prefill", "127.0.0.1", port, 2, remote_cluster_id)
    try:
        if error is None:
            assert peers.get(remote.rank(1)).cluster_id == P_RANK_ONE_CLUSTER
            assert datadist.linked == [P_RANK_ONE_CLUSTER]
        else:
            with pytest.raises(PeerError, match=error):
                peers.get(remote.rank(1))
            assert datadist.linked == []
    finally:
        peers.close()


def test_a_restarted_prefill_is_another_peer_and_params_of_its_last_start_are_refused(
    context: zmq.Context, prefill_rank_one: PrefillRank
) -> None:
    """P restarts at the same address under the same engine id: its handshake announces a new
    incarnation. Params from before the restart cannot link it; params of the new start
    replace the old link (counted)."""
    prefill_rank_one.restart(incarnation=0xA)
    datadist = LinkRecorder()
    recorded: list[str] = []
    peers = make_registry(datadist, context, recorded.append)
    port, cluster = prefill_rank_one.port - 1, P_RANK_ONE_CLUSTER - 1
    old = RemoteEndpoint("prefill", "127.0.0.1", port, 2, cluster, incarnation=0xA)
    new = RemoteEndpoint("prefill", "127.0.0.1", port, 2, cluster, incarnation=0xB)
    try:
        first = peers.get(old.rank(1))
        prefill_rank_one.restart(incarnation=0xB)
        peers.drop(first)  # a read over the old link failed: P is gone
        assert peers.linked(old.rank(1)) is None  # forgotten at once
        refused = "for engine prefill rank 1 incarnation a, this is .* incarnation b .*restarted"
        with pytest.raises(SideChannelError, match=refused):
            peers.get(old.rank(1))
        assert peers.linked(new.rank(1)) is None  # not linked until a read asks for it
        assert peers.get(new.rank(1)).payload.incarnation == 0xB
        assert (len(peers._peers), len(peers._locks)) == (1, 0)  # the old start's link is gone
        assert datadist.linked == [P_RANK_ONE_CLUSTER, P_RANK_ONE_CLUSTER]
        assert datadist.unlinked == [(P_RANK_ONE_CLUSTER, True)]
    finally:
        peers.close()


class SlowUnlinks(LinkRecorder):
    """Each unlink waits ``wait_s`` for a goodbye that never comes (a dead peer), or until
    ``release``: the test ends the threads it left behind, so none outlives it."""

    def __init__(self, wait_s: float) -> None:
        super().__init__()
        self.wait_s = wait_s
        self.release = threading.Event()

    def unlink_clusters(self, infos: list, timeout_ms: int, force: bool) -> None:
        self.release.wait(self.wait_s)
        super().unlink_clusters(infos, timeout_ms, force)


@pytest.mark.parametrize(("wait_s", "bound_s"), [(0.5, 1.5), (30.0, UNLINK_BOUND_S + 1.0)])
def test_shutdown_unlinks_every_peer_at_once_within_a_bound(
    context: zmq.Context, wait_s: float, bound_s: float
) -> None:
    """Twelve linked peers that never say goodbye: shutdown takes one unlink's wait, not
    twelve; and an unlink that hangs is left behind after the bound."""
    datadist = SlowUnlinks(wait_s)
    peers = make_registry(datadist, context)
    for i in range(12):
        remote = RemoteEndpoint(f"p{i}", "127.0.0.1", 7000 + i, 1, 100 * i, incarnation=1)
        target = remote.rank(0)
        announced = payload(f"p{i}", 0, 100 * i)
        peers._peers[target.key] = Peer(target, announced, peers.client_for(target))
    started = time.monotonic()
    peers.close()
    took = time.monotonic() - started
    assert took < bound_s, f"shutdown took {took:.1f} s"
    if wait_s < UNLINK_BOUND_S:
        assert sorted(datadist.unlinked) == [(100 * i, False) for i in range(12)]
    datadist.release.set()
    for thread in threading.enumerate():
        if thread.name == "hixl-unlink":
            thread.join(timeout=5.0)
