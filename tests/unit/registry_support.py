"""What the PeerRegistry unit tests share: handshake payloads, a prefill rank's side channel
serving one, and a datadist that records the link calls (the registry's bookkeeping is under
test here; the real engine's links are in test_peer_churn.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import zmq

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.link_reports import LinkReporter
from hixl_connector.connector.peers.envelope import Destination
from hixl_connector.connector.peers.handshake import (
    SCHEMA_VERSION,
    HandshakePayload,
    compatibility_hash,
)
from hixl_connector.connector.peers.registry import PeerRegistry
from hixl_connector.connector.peers.side_channel import SideChannelServer
from hixl_connector.datadist.api.cluster_info import LLMClusterInfo
from hixl_connector.datadist.api.status import LLMStatusCode

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


def payload(
    engine_id: str, tp_rank: int, cluster_id: int, tp_size: int = 2, incarnation: int = 0
) -> HandshakePayload:
    return HandshakePayload(
        schema_version=SCHEMA_VERSION,
        compatibility_hash=compatibility_hash(FIELDS),
        compatibility=dict(FIELDS),
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        cluster_id=cluster_id,
        engine_host="127.0.0.1",
        engine_port=7000,
        num_blocks=8,
        units_per_block=2 // tp_size,
        block_sizes=[16],
        slice_bytes=0,
        state_parts=[],
        kv_parts=[],
        incarnation=incarnation,
    )


class LinkRecorder:
    """The datadist calls PeerRegistry makes, all successful."""

    def __init__(self) -> None:
        self.linked: list[int] = []
        self.unlinked: list[tuple[int, bool]] = []  # (cluster id, force)

    def link_clusters(self, infos: list[Any], timeout_ms: int) -> tuple[Any, list[Any]]:
        self.linked += [info.remote_cluster_id for info in infos]
        return LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS]

    def unlink_clusters(self, infos: list[Any], timeout_ms: int, force: bool) -> None:
        self.unlinked += [(info.remote_cluster_id, force) for info in infos]


API: Any = SimpleNamespace(LLMClusterInfo=LLMClusterInfo, LLMStatusCode=LLMStatusCode)


def make_registry(
    datadist: Any,
    context: zmq.Context,
    record: Callable[[str], None] = lambda _: None,
    links: LinkReporter | None = None,
    in_place: bool = False,
    **config: Any,
) -> PeerRegistry:
    """D rank 0's registry, with ``config`` as kv_connector_extra_config; ``in_place``: its
    links read in place (same-host)."""
    settings = HixlConfig.from_dict({"handshake_timeout_s": 2.0, **config}, "decode")
    local = payload("decode", 0, 1)
    links = links or LinkReporter(0)
    return PeerRegistry(API, datadist, context, local, settings, lambda _: in_place, record, links)


class PrefillRank:
    """A prefill rank's side channel answering the handshake with ``announced`` (which a
    test may change, as a restart would)."""

    def __init__(self, context: zmq.Context, announced: HandshakePayload) -> None:
        self.announced = announced
        handlers = {"handshake": lambda _: {"payload": self.announced.to_dict()}}
        self.server = SideChannelServer(context, "127.0.0.1", 0, handlers, self._serving)

    def _serving(self) -> Destination:
        me = self.announced
        return Destination(me.engine_id, me.tp_rank, me.incarnation)

    def restart(self, **changes: Any) -> None:
        self.announced = dataclasses.replace(self.announced, **changes)

    @property
    def port(self) -> int:
        return int(self.server.port)

    def close(self) -> None:
        self.server.close()
