"""pull_cache and push_cache between real processes over both transports: one row of a
contiguous cache, byte for byte, with layer ranges and the documented refusals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hixl_connector.datadist import LLMException, LLMStatusCode

from . import datadist_peer as layout

NT, ROW, ROWS = layout.NUM_TENSORS, layout.CONTIG_ROW_BYTES, layout.CONTIG_ROWS
CONTIG = layout.make_tensors("contig", NT, ROWS * ROW)


class Rows:
    def __init__(self, client: Any, peer: Any, transport: str) -> None:
        self.client, self.peer, self.api = client, peer, client.api
        self.cm = client.dd.cache_manager
        desc = self.api.CacheDesc(
            NT, [ROWS, ROW], self.api.DataType.DT_UINT8, self.api.Placement.HOST
        )
        self.tensors = [np.zeros(ROWS * ROW, np.uint8) for _ in range(NT)]
        self.cache = self.cm.register_cache(
            desc, [t.ctypes.data for t in self.tensors], remote_accessible=True
        )
        self.mine = [layout.tensor_bytes(5, transport, t, ROWS * ROW) for t in range(NT)]
        self.source = self.cm.register_cache(
            desc, [t.ctypes.data for t in self.mine], remote_accessible=True
        )
        self.contig = peer.caches["contig"]

    def key(self, row: int, cache_id: int | None = None) -> Any:
        return self.api.CacheKeyByIdAndIndex(self.peer.cluster_id, cache_id or self.contig, row)

    def row(self, t: int, i: int) -> np.ndarray:
        return self.tensors[t][i * ROW : (i + 1) * ROW]


@pytest.fixture(scope="module", params=["cma", "tcp"])
def rows(
    request: pytest.FixtureRequest, peer_factory: Any, client_factory: Any, datadist_backend: str
) -> Iterator[Rows]:
    if datadist_backend != "native":
        pytest.skip("CANN's pull_cache needs its own pool set-up")
    peer = peer_factory(41 if request.param == "cma" else 42)
    client = client_factory(cluster_id=4100, hixl_transport=request.param)
    r = Rows(client, peer, request.param)
    ok = LLMStatusCode.LLM_SUCCESS
    assert client.link(peer) == (ok, [ok])
    assert client.dd.peer_transport(peer.cluster_id) == request.param
    yield r
    client.unlink(peer)


def test_pull_cache_row_by_id(rows: Rows) -> None:
    rows.cm.pull_cache(rows.key(1), rows.cache, batch_index=0)
    rows.cm.pull_cache(rows.key(0), rows.cache, batch_index=1, size=64)
    for t in range(NT):
        assert np.array_equal(rows.row(t, 0), CONTIG[t][ROW : 2 * ROW])
        assert np.array_equal(rows.row(t, 1)[:64], CONTIG[t][:64])
        assert not rows.row(t, 1)[64:].any()


def test_pull_cache_layer_ranges(rows: Rows) -> None:
    for t in rows.tensors:
        t[:] = 0
    rows.cm.pull_cache(
        rows.key(0), rows.cache, 0, src_layer_range=range(1, 2), dst_layer_range=range(0, 1)
    )
    for t in range(NT):  # tensors 2, 3 (layer 1) of the peer's row 0 land on tensors 0, 1
        want = CONTIG[t + 2][:ROW] if t < 2 else np.zeros(ROW, np.uint8)
        assert np.array_equal(rows.row(t, 0), want), t


def _code(call: Any) -> LLMStatusCode:
    with pytest.raises(LLMException) as info:
        call()
    return info.value.status_code


def test_pull_cache_refusals(rows: Rows) -> None:
    cm, cache, param = rows.cm, rows.cache, LLMStatusCode.LLM_PARAM_INVALID
    assert _code(lambda: cm.pull_cache(rows.key(0), cache, 0, size=ROW + 1)) == param
    assert _code(lambda: cm.pull_cache(rows.key(ROWS), cache, 0)) == param
    assert _code(lambda: cm.pull_cache(rows.key(0), cache, ROWS)) == param
    missing = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert _code(lambda: cm.pull_cache(rows.key(0, cache_id=99), cache, 0)) == missing
    with pytest.raises(TypeError):  # remote cache access takes ids only
        cm.pull_cache(rows.api.CacheKey(rows.peer.cluster_id, 7), cache, 0)


def test_push_cache_row_then_read_back(rows: Rows) -> None:
    rows.cm.push_cache(rows.key(0), rows.source, src_batch_index=1)
    rows.cm.push_cache(
        rows.key(1), rows.source, 0, src_layer_range=range(3, 4), dst_layer_range=range(0, 1)
    )
    rows.cm.pull_cache(rows.key(0), rows.cache, 0)
    rows.cm.pull_cache(rows.key(1), rows.cache, 1)
    for t in range(NT):
        assert np.array_equal(rows.row(t, 0), rows.mine[t][ROW : 2 * ROW]), t
        want = rows.mine[t + 6][:ROW] if t < 2 else CONTIG[t][ROW : 2 * ROW]
        assert np.array_equal(rows.row(t, 1), want), t


def test_push_cache_refusals(rows: Rows) -> None:
    cm, src, param = rows.cm, rows.source, LLMStatusCode.LLM_PARAM_INVALID
    assert _code(lambda: cm.push_cache(rows.key(0), src, 0, size=64)) == param
    assert _code(lambda: cm.push_cache(rows.key(ROWS), src, 0)) == param
    assert _code(lambda: cm.push_cache(rows.key(0), src, ROWS)) == param
    assert _code(lambda: cm.push_cache(rows.key(0), src, 0, src_layer_range=range(2, 2))) == param
    missing = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert _code(lambda: cm.push_cache(rows.key(0, cache_id=99), src, 0)) == missing
    with pytest.raises(TypeError):
        cm.push_cache(rows.api.BlocksCacheKey(rows.peer.cluster_id, 0), src)
