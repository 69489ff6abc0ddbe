"""D links a prefill rank only when its handshake announces the cluster id that P's
kv_transfer_params name for that rank (``remote_cluster_id`` + rank)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.metadata import RemoteEndpoint
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.handshake import (
    SCHEMA_VERSION,
    HandshakePayload,
    compatibility_hash,
)
from hixl_connector.connector.peers.registry import UNLINK_BOUND_S, Peer, PeerError, PeerRegistry
from hixl_connector.connector.peers.side_channel import SideChannelError, SideChannelServer
from hixl_connector.datadist.config import LLMClusterInfo
from hixl_connector.datadist.status import LLMStatusCode

FIELDS = {
    "model": "tiny",
    "dtype": "float32",
    "kv_layout": "cpu",
    "kv_split": "heads",
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_size": 16,
    "unit_token_bytes": 64,
    "tensors_per_layer": 2,
    "num_tensors": 4,
}
P_RANK_ONE_CLUSTER = 9001  # P's rank 1; its rank 0 is 9000


def payload(engine_id: str, tp_rank: int, cluster_id: int) -> HandshakePayload:
    return HandshakePayload(
        schema_version=SCHEMA_VERSION,
        compatibility_hash=compatibility_hash(FIELDS),
        compatibility=dict(FIELDS),
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=2,
        cluster_id=cluster_id,
        engine_host="127.0.0.1",
        engine_port=7000,
        num_blocks=8,
        units_per_block=1,
        block_sizes=[16],
        slice_bytes=0,
        incarnation=0,
    )


class LinkRecorder:
    """The datadist calls PeerRegistry makes, all successful."""

    def __init__(self) -> None:
        self.linked: list[int] = []

    def link_clusters(self, infos: list[Any], timeout_ms: int) -> tuple[Any, list[Any]]:
        self.linked += [info.remote_cluster_id for info in infos]
        return LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS]

    def unlink_clusters(self, infos: list[Any], timeout_ms: int, force: bool) -> None:
        pass


@pytest.fixture
def prefill_rank_one() -> Iterator[int]:
    """A side channel serving the handshake of P's rank 1; yields its port."""
    context = zmq.Context()
    answer = {"payload": payload("prefill", 1, P_RANK_ONE_CLUSTER).to_dict()}
    me = Destination("prefill", 1, 0)
    server = SideChannelServer(context, "127.0.0.1", 0, {"handshake": lambda _: answer}, lambda: me)
    try:
        yield server.port
    finally:
        server.close()
        context.term()


@pytest.mark.parametrize(
    ("remote_cluster_id", "error"),
    [(P_RANK_ONE_CLUSTER - 1, None), (P_RANK_ONE_CLUSTER, "has cluster id 9001, .* say 9002")],
)
def test_params_must_name_the_cluster_id_the_handshake_announces(
    prefill_rank_one: int, remote_cluster_id: int, error: str | None
) -> None:
    context = zmq.Context()
    datadist = LinkRecorder()
    api: Any = SimpleNamespace(LLMClusterInfo=LLMClusterInfo, LLMStatusCode=LLMStatusCode)
    config = HixlConfig.from_dict({"handshake_timeout_s": 2.0}, "decode")
    peers = PeerRegistry(
        api, datadist, context, payload("decode", 0, 1), config, lambda _: False, lambda _: None
    )
    # P's rank 0 listens one port below: D finds rank 1 at remote_port + 1.
    remote = RemoteEndpoint("prefill", "127.0.0.1", prefill_rank_one - 1, 2, remote_cluster_id)
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
        context.term()


def test_a_restarted_prefill_is_another_peer_and_params_of_its_last_start_are_refused() -> None:
    """P restarts at the same address under the same engine id: its handshake announces a new
    incarnation. Params from before the restart cannot link it; params of the new start
    replace the old link (counted)."""
    context = zmq.Context()
    before = dataclasses.replace(payload("prefill", 1, P_RANK_ONE_CLUSTER), incarnation=0xA)
    answer = {"payload": before.to_dict()}
    serving = {"now": Destination("prefill", 1, 0xA)}
    handlers = {"handshake": lambda _: answer}
    server = SideChannelServer(context, "127.0.0.1", 0, handlers, lambda: serving["now"])
    datadist = LinkRecorder()
    api: Any = SimpleNamespace(LLMClusterInfo=LLMClusterInfo, LLMStatusCode=LLMStatusCode)
    config = HixlConfig.from_dict({"handshake_timeout_s": 2.0}, "decode")
    recorded: list[str] = []
    local = payload("decode", 0, 1)
    peers = PeerRegistry(api, datadist, context, local, config, lambda _: False, recorded.append)
    port, cluster = server.port - 1, P_RANK_ONE_CLUSTER - 1
    old = RemoteEndpoint("prefill", "127.0.0.1", port, 2, cluster, incarnation=0xA)
    new = RemoteEndpoint("prefill", "127.0.0.1", port, 2, cluster, incarnation=0xB)
    try:
        first = peers.get(old.rank(1))
        answer["payload"] = dataclasses.replace(before, incarnation=0xB).to_dict()
        serving["now"] = Destination("prefill", 1, 0xB)
        peers.mark_broken(first)  # a read over the old link failed: P is gone
        refused = "for engine prefill rank 1 incarnation a, this is .* incarnation b .*restarted"
        with pytest.raises(SideChannelError, match=refused):
            peers.get(old.rank(1))
        assert peers.linked(new.rank(1)) is None  # not linked until a read asks for it
        assert peers.get(new.rank(1)).payload.incarnation == 0xB
        assert (len(peers._peers), len(peers._locks)) == (1, 0)  # the old start's link is gone
        assert recorded == ["peer_restarts"]
        assert datadist.linked == [P_RANK_ONE_CLUSTER, P_RANK_ONE_CLUSTER]
    finally:
        peers.close()
        server.close()
        context.term()


class SlowUnlinks(LinkRecorder):
    """Each unlink waits ``wait_s`` for a goodbye that never comes (a dead peer)."""

    def __init__(self, wait_s: float) -> None:
        super().__init__()
        self.wait_s = wait_s
        self.unlinked: list[int] = []

    def unlink_clusters(self, infos: list[Any], timeout_ms: int, force: bool) -> None:
        time.sleep(self.wait_s)
        self.unlinked += [info.remote_cluster_id for info in infos]


@pytest.mark.parametrize(("wait_s", "bound_s"), [(0.5, 1.5), (30.0, UNLINK_BOUND_S + 1.0)])
def test_shutdown_unlinks_every_peer_at_once_within_a_bound(wait_s: float, bound_s: float) -> None:
    """Twelve linked peers that never say goodbye: shutdown takes one unlink's wait, not
    twelve; and an unlink that hangs is left behind after the bound."""
    context = zmq.Context()
    datadist = SlowUnlinks(wait_s)
    api: Any = SimpleNamespace(LLMClusterInfo=LLMClusterInfo, LLMStatusCode=LLMStatusCode)
    config = HixlConfig.from_dict({"handshake_timeout_s": 2.0}, "decode")
    peers = PeerRegistry(
        api, datadist, context, payload("decode", 0, 1), config, lambda _: False, lambda _: None
    )
    for i in range(12):
        remote = RemoteEndpoint(f"p{i}", "127.0.0.1", 7000 + i, 1, 100 * i, incarnation=1)
        target = remote.rank(0)
        peers._peers[target.key] = Peer(
            f"p{i}", 100 * i, payload(f"p{i}", 0, 100 * i), peers.client_for(target)
        )
    started = time.monotonic()
    peers.close()
    took = time.monotonic() - started
    assert took < bound_s, f"shutdown took {took:.1f} s"
    if wait_s < UNLINK_BOUND_S:
        assert sorted(datadist.unlinked) == [100 * i for i in range(12)]
    context.term()
