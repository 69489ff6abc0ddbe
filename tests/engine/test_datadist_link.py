"""LLMDataDist life cycle and links against real peer processes: one instance per process,
link_clusters / unlink_clusters status codes, authentication, a pull timeout (peer stopped with
SIGSTOP) and recovery with unlink(force=True) + link, and a finalized CacheManager."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from hixl_connector.datadist import BlocksPull

from . import datadist_peer as layout
from .datadist_harness import Client, Peer
from .native_peer import stopped

TOKEN = "datadist-link-token-0123456789abcdef"
# As long as a real token, so the refusal comes from the HMAC check, not the length rule.
WRONG_TOKEN = "datadist-link-wrong-token-0123456789abcdef"


# A registered blocks cache of this side, and its tensors.
Local = tuple[Any, list[np.ndarray]]
# What the peer's "kv" cache holds, tensor by tensor.
PEER_KV = layout.make_tensors("kv", layout.NUM_TENSORS, layout.NUM_BLOCKS * layout.BLOCK_BYTES)


def ok(api: Any) -> Any:
    return api.LLMStatusCode.LLM_SUCCESS


def test_one_instance_per_process(api: Any, client_factory: Any) -> None:
    first = client_factory(cluster_id=3000)
    first.dd.init({})  # a repeat init of the same object is a no-op
    second = api.LLMDataDist(api.LLMRole.DECODER, 3001)
    with pytest.raises(api.LLMException, match="Cannot init multiple LLMDataDists") as info:
        second.init({"ge.exec.deviceId": "0", "llm.EnableCacheManager": "1"})
    assert info.value.status_code == api.LLMStatusCode.LLM_FAILED


def test_calls_before_init_raise(api: Any) -> None:
    dd = api.LLMDataDist(api.LLMRole.DECODER, 1)
    with pytest.raises(RuntimeError):
        _ = dd.cache_manager
    with pytest.raises(RuntimeError):
        dd.link_clusters([], 1000)
    with pytest.raises(TypeError):
        api.LLMDataDist(1, 1)
    with pytest.raises(ValueError):
        api.LLMDataDist(api.LLMRole.PROMPT, -1)


def test_link_argument_checks_and_codes(api: Any, peer_factory: Any, client_factory: Any) -> None:
    peer = peer_factory(31)
    client = client_factory(cluster_id=3100)
    codes = api.LLMStatusCode
    info = client.cluster_info(peer)
    with pytest.raises(TypeError):
        client.dd.link_clusters([info], "1000")
    with pytest.raises(ValueError):
        client.dd.link_clusters([info], 2**31)
    with pytest.raises(api.LLMException) as exc:
        client.dd.link_clusters([info], 0)
    assert exc.value.status_code == codes.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        client.dd.link_clusters(info, 1000)
    no_local = api.LLMClusterInfo()
    no_local.remote_cluster_id = peer.cluster_id
    no_local.append_remote_ip_info("127.0.0.1", peer.port)
    with pytest.raises(api.LLMException, match="local_ip_info") as exc:
        client.dd.link_clusters([no_local], 1000)
    assert exc.value.status_code == codes.LLM_PARAM_INVALID
    assert client.dd.link_clusters([], 1000) == (codes.LLM_PARAM_INVALID, [])
    assert client.dd.link_clusters([info] * 17, 1000)[0] == codes.LLM_CLUSTER_NUM_EXCEED_LIMIT
    assert client.dd.unlink_clusters([info], 1000) == (
        codes.LLM_NOT_YET_LINK,
        [codes.LLM_NOT_YET_LINK],
    )
    assert client.link(peer) == (codes.LLM_SUCCESS, [codes.LLM_SUCCESS])
    assert client.link(peer) == (codes.LLM_ALREADY_LINK, [codes.LLM_ALREADY_LINK])
    assert client.unlink(peer) == (codes.LLM_SUCCESS, [codes.LLM_SUCCESS])
    dead = api.LLMClusterInfo()
    dead.remote_cluster_id = 77
    dead.append_local_ip_info("127.0.0.1", 0)
    dead.append_remote_ip_info("127.0.0.1", 1)  # nothing listens on port 1
    assert client.dd.link_clusters([dead], 1000) == (codes.LLM_LINK_FAILED, [codes.LLM_LINK_FAILED])
    wrong_id = client.cluster_info(peer)
    wrong_id.remote_cluster_id = peer.cluster_id + 1
    assert client.dd.link_clusters([wrong_id], 2000)[0] == codes.LLM_LINK_FAILED


def _pull_once(api: Any, client: Client, peer: Peer, cache: Local) -> None:
    """Pulls the peer's blocks 1 and 2 into blocks 3 and 4 of ``cache``; they hold the
    peer's bytes afterwards."""
    registered, tensors = cache
    for tensor in tensors:
        tensor[:] = 0
    key = api.BlocksCacheKey(peer.cluster_id)
    client.dd.cache_manager.pull_blocks(key, registered, [1, 2], [3, 4])
    bb = layout.BLOCK_BYTES
    for tensor, source in zip(tensors, PEER_KV, strict=True):
        assert np.array_equal(tensor[3 * bb : 5 * bb], source[bb : 3 * bb])
        assert not tensor[: 3 * bb].any() and not tensor[5 * bb :].any()


def _cache_linked_to(api: Any, client: Client, peer: Peer) -> Local:
    """A blocks cache of the peer's shape on ``client`` (and its tensors), and ``client``
    linked to ``peer``."""
    cache = client.blocks_cache(layout.NUM_TENSORS, layout.NUM_BLOCKS, layout.BLOCK_SHAPE)
    assert client.link(peer) == (ok(api), [ok(api)])
    return cache


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_unauthenticated_link_refused(
    api: Any, peer_factory: Any, client_factory: Any, transport: str, monkeypatch: Any
) -> None:
    peer = peer_factory(40 if transport == "cma" else 41, auth_token=TOKEN)
    monkeypatch.delenv("HIXL_AUTH_TOKEN", raising=False)
    failed = (api.LLMStatusCode.LLM_LINK_FAILED, [api.LLMStatusCode.LLM_LINK_FAILED])
    assert client_factory(4000, hixl_transport=transport).link(peer) == failed
    assert (
        client_factory(4001, hixl_transport=transport, hixl_auth_token=WRONG_TOKEN).link(peer)
        == failed
    )
    monkeypatch.setenv("HIXL_AUTH_TOKEN", TOKEN)  # the token may come from the environment
    client = client_factory(4002, hixl_transport=transport)
    _pull_once(api, client, peer, _cache_linked_to(api, client, peer))
    client.unlink(peer)


def test_timeout_then_force_unlink_and_relink_recovers(
    api: Any, peer_factory: Any, client_factory: Any
) -> None:
    peer = peer_factory(50)
    timeout_ms = 500
    client = client_factory(5000, hixl_transport="tcp", sync_kv_timeout=timeout_ms)
    cache = _cache_linked_to(api, client, peer)
    codes = api.LLMStatusCode
    _pull_once(api, client, peer, cache)
    with stopped(peer.pid):
        start = time.monotonic()
        with pytest.raises(api.LLMException) as exc:
            _pull_once(api, client, peer, cache)
        elapsed = time.monotonic() - start
        assert exc.value.status_code == codes.LLM_TIMEOUT
        assert elapsed < timeout_ms / 1000 + 1.0
        with pytest.raises(api.LLMException) as exc:  # the link is unusable until rebuilt
            _pull_once(api, client, peer, cache)
        assert exc.value.status_code == codes.LLM_NOT_YET_LINK
    assert client.unlink(peer, force=True) == (codes.LLM_SUCCESS, [codes.LLM_SUCCESS])
    assert client.link(peer) == (codes.LLM_SUCCESS, [codes.LLM_SUCCESS])
    _pull_once(api, client, peer, cache)
    client.unlink(peer)


def test_cma_pull_needs_no_work_from_a_stopped_peer(
    api: Any, peer_factory: Any, client_factory: Any
) -> None:
    """One-sided reads: a stopped peer's registered memory can still be pulled over cma."""
    peer = peer_factory(51)
    client = client_factory(5100, hixl_transport="cma", sync_kv_timeout=500)
    cache = client.blocks_cache(layout.NUM_TENSORS, layout.NUM_BLOCKS, layout.BLOCK_SHAPE)
    with client.linked_over(peer, "cma"), stopped(peer.pid):
        _pull_once(api, client, peer, cache)


def test_finalized_cache_manager(api: Any, peer_factory: Any, client_factory: Any) -> None:
    """Row 1 of table 6.3: a CacheManager outlived by its LLMDataDist."""
    client = client_factory(6000)
    cache, _ = client.blocks_cache(8, 64, (4, 2, 32))
    cm = client.dd.cache_manager
    client.dd.finalize()
    with pytest.raises(api.LLMException) as exc:
        cm.pull_blocks(api.BlocksCacheKey(1), cache, [1], [1], unknown_kwarg=1)
    assert exc.value.status_code == api.LLMStatusCode.LLM_ENGINE_FINALIZED
    with pytest.raises(api.LLMException) as exc:
        cm.register_blocks_cache(cache.cache_desc, [1])
    assert exc.value.status_code == api.LLMStatusCode.LLM_ENGINE_FINALIZED
    again = client_factory(6001)  # after finalize a new instance may init
    assert again.dd.cache_manager is not cm


def test_unlink_during_a_pull_fails_the_pull_fast(
    api: Any, peer_factory: Any, client_factory: Any
) -> None:
    """Row 28: a concurrent unlink ends a running pull (CANN: LLM_LINK_BUSY)."""
    peer = peer_factory(52)
    client = client_factory(5200, hixl_transport="tcp", sync_kv_timeout=20000)
    cache, _ = _cache_linked_to(api, client, peer)
    codes = api.LLMStatusCode
    with stopped(peer.pid):  # the pull cannot finish while the peer is stopped
        key = api.BlocksCacheKey(peer.cluster_id)
        pull = BlocksPull(key, cache, [1], [2])
        handle = api.pull_blocks_batch_async(client.dd.cache_manager, [pull])
        assert handle.wait(0.3) is False
        start = time.monotonic()
        assert client.unlink(peer, force=True, timeout=3000)[0] == codes.LLM_SUCCESS
        with pytest.raises(api.LLMException) as exc:
            handle.wait(5.0)
        assert exc.value.status_code in (codes.LLM_LINK_BUSY, codes.LLM_FAILED)
        assert time.monotonic() - start < 5.0


def test_xpyd_one_call_links_every_prefill_and_each_serves_its_own_bytes(
    api: Any, peer_factory: Any, client_factory: Any
) -> None:
    """HIXL's xPyD sample from one decoder's seat: link_clusters and unlink_clusters with
    two prefill clusters in one call, then a pull from each into blocks of one cache."""
    nb, bb = layout.NUM_BLOCKS, layout.BLOCK_BYTES
    prefills = [peer_factory(61), peer_factory(62)]
    client = client_factory()
    infos = [client.cluster_info(p) for p in prefills]
    assert client.dd.link_clusters(infos, 5000) == (ok(api), [ok(api), ok(api)])
    cache, tensors = client.blocks_cache(layout.NUM_TENSORS, nb, layout.BLOCK_SHAPE)
    cm = client.dd.cache_manager
    for i, peer in enumerate(prefills):
        cm.pull_blocks(api.BlocksCacheKey(peer.cluster_id, 0), cache, [0, 1], [2 * i, 2 * i + 1])
    for t, tensor in enumerate(tensors):
        got, want = tensor.reshape(nb, bb), PEER_KV[t].reshape(nb, bb)
        assert [np.array_equal(got[b], want[s]) for b, s in enumerate([0, 1, 0, 1])] == [True] * 4
        assert not got[4:].any(), "blocks no pull named changed"
    # Each cluster has a link of its own: without 61's, 62 still serves.
    assert client.dd.unlink_clusters(infos[:1], 3000) == (ok(api), [ok(api)])
    with pytest.raises(api.LLMException) as gone:
        cm.pull_blocks(api.BlocksCacheKey(61, 0), cache, [5], [5])
    assert gone.value.status_code == api.LLMStatusCode.LLM_NOT_YET_LINK
    cm.pull_blocks(api.BlocksCacheKey(62, 0), cache, [5], [5])
    assert all(
        np.array_equal(t.reshape(nb, bb)[5], PEER_KV[i].reshape(nb, bb)[5])
        for i, t in enumerate(tensors)
    )
    assert client.dd.unlink_clusters(infos[1:], 3000) == (ok(api), [ok(api)])
    assert client.dd.engine_stats()["open_links"] == 0
    cm.unregister_cache(cache.cache_id)
