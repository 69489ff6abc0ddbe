"""A link's life on D: forgotten the moment a read over it fails, closed when idle, and a
cluster id taken over from an engine that no longer answers; the scheduler hears of each."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import zmq
from registry_support import LinkRecorder, PrefillRank, make_registry, payload

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.link_reports import LinkReporter
from hixl_connector.connector.peers.compatibility import PeerError
from hixl_connector.connector.peers.registry import RETIRE_S

CLUSTER = 4242


def serve(context: zmq.Context, engine_id: str) -> PrefillRank:
    return PrefillRank(context, payload(engine_id, 0, CLUSTER, tp_size=1))


def endpoint(rank: PrefillRank) -> RemoteEndpoint:
    return RemoteEndpoint(rank.announced.engine_id, "127.0.0.1", rank.port, 1, CLUSTER)


def eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def test_a_dropped_peer_is_gone_at_once_reported_and_unlinked_with_force(
    context: zmq.Context,
) -> None:
    prefill = serve(context, "prefill")
    datadist, links = LinkRecorder(), LinkReporter(0)
    peers = make_registry(datadist, context, links=links, in_place=True)
    remote = endpoint(prefill)
    try:
        peer = peers.get(remote.rank(0))
        peers.read_through(remote, [peer])
        first = links.take()
        assert first is not None and first.ranks == {0: {remote: True}}
        peers.drop(peer)
        assert peers.linked(remote.rank(0)) is None
        report = links.take()
        assert report is not None and report.ranks == {0: {remote: False}}
        # A same-host link stays readable for RETIRE_S first.
        eventually(lambda: datadist.unlinked == [(CLUSTER, True)], within_s=RETIRE_S + 5.0)
        peers.drop(peer)  # a second failure of the same read's peers changes nothing
        peers.read_through(remote, [peer])  # a read that went through it before the drop
        late = links.take()
        assert late is None or late.ranks == {0: {remote: False}}
        assert peers.get(remote.rank(0)) is not peer  # the next read links again
        assert datadist.linked == [CLUSTER, CLUSTER]
    finally:
        peers.close()
        prefill.close()


def test_an_idle_link_is_unlinked_and_the_next_read_links_again(context: zmq.Context) -> None:
    prefill = serve(context, "prefill")
    datadist, counted = LinkRecorder(), []
    peers = make_registry(datadist, context, counted.append, pull_timeout_s=0.1, link_idle_s=0.3)
    target = endpoint(prefill).rank(0)
    try:
        peers.get(target)
        now = time.monotonic()
        peers.close_idle(now)
        assert peers.linked(target) is not None
        peers.close_idle(time.monotonic() + 0.5)
        assert peers.linked(target) is None
        eventually(lambda: datadist.unlinked == [(CLUSTER, False)])  # a goodbye: P is alive
        assert counted == ["idle_unlinks"]
        peers.get(target)
        assert datadist.linked == [CLUSTER, CLUSTER]
    finally:
        peers.close()
        prefill.close()


def test_a_cluster_id_passes_on_only_from_an_engine_that_no_longer_answers(
    context: zmq.Context,
) -> None:
    """Two prefill engines announce one cluster id (a stopped P's successor configured
    alike): refused while the first still answers, linked once it stopped."""
    first, second = serve(context, "prefill-a"), serve(context, "prefill-b")
    datadist, links = LinkRecorder(), LinkReporter(0)
    peers = make_registry(datadist, context, links=links, handshake_timeout_s=0.5)
    try:
        peers.get(endpoint(first).rank(0))
        with pytest.raises(PeerError, match="both use cluster id 4242"):
            peers.get(endpoint(second).rank(0))
        first.close()
        time.sleep(0.5)  # the refusal above is remembered for handshake_timeout_s
        started = time.monotonic()
        assert peers.get(endpoint(second).rank(0)).engine_id == "prefill-b"
        assert time.monotonic() - started < 0.5, "a stopped engine refuses a connect at once"
        assert peers.linked(endpoint(first).rank(0)) is None
        assert datadist.unlinked == [(CLUSTER, True)]
        assert datadist.linked == [CLUSTER, CLUSTER]
        report = links.take()
        assert report is not None and report.ranks[0][endpoint(first)] is False
    finally:
        peers.close()
        second.close()
