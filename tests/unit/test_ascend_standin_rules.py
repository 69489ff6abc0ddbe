"""The "ascend" back-end against the llm_datadist STAND-IN (tests/ascend_standin/): each rule of
LLM-DataDist that the connector must keep raises as CANN does when it is broken.

This proves the back-end's API use and the rules, on host memory; not the NPU/HCCS/RoCE path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

STANDIN_DIR = Path(__file__).resolve().parents[1] / "ascend_standin"
sys.path.insert(0, str(STANDIN_DIR))
from harness import free_port, standin_on_path, start, stop  # noqa: E402
from standin_peer import BLOCK_BYTES, NUM_BLOCKS, NUM_TENSORS, block_value  # noqa: E402

from hixl_connector.connector.blocks import chunk_pairs  # noqa: E402
from hixl_connector.datadist import ascend, load_backend  # noqa: E402

sys.path.remove(str(STANDIN_DIR))
PEER_CLUSTER = 7001
CLIENT_CLUSTER = 7002


@pytest.fixture(scope="module")
def api() -> Iterator[Any]:
    with standin_on_path():
        yield load_backend("ascend")


@pytest.fixture(scope="module")
def peer(api: Any) -> Iterator[tuple[Any, int]]:
    port = free_port()
    script = str(STANDIN_DIR / "standin_peer.py")
    proc, _ = start(
        [sys.executable, script, "--cluster-id", str(PEER_CLUSTER), "--port", str(port)]
    )
    yield proc, port
    stop(proc)


@pytest.fixture
def client(api: Any) -> Iterator[Any]:
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.transfer_backend = "hixl"
    config.listen_ip_info = "127.0.0.1:0"
    config.sync_kv_timeout = 5000
    dd = api.LLMDataDist(api.LLMRole.DECODER, CLIENT_CLUSTER)
    dd.init(config.generate_options())
    yield dd
    dd.finalize()


def _register(api: Any, dd: Any, model_id: int, accessible: bool | None = True) -> Any:
    tensors = [np.zeros(NUM_BLOCKS * BLOCK_BYTES, np.uint8) for _ in range(NUM_TENSORS)]
    desc = api.CacheDesc(NUM_TENSORS, [NUM_BLOCKS, BLOCK_BYTES], api.DataType.DT_UINT8)
    cache = dd.cache_manager.register_blocks_cache(
        desc,
        [t.ctypes.data for t in tensors],
        api.BlocksCacheKey(CLIENT_CLUSTER, model_id),
        remote_accessible=accessible,
    )
    return cache, tensors


def _link(api: Any, dd: Any, port: int) -> None:
    info = api.LLMClusterInfo()
    info.remote_cluster_id = PEER_CLUSTER
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    status, per_cluster = dd.link_clusters([info], 5000)
    assert status == api.LLMStatusCode.LLM_SUCCESS, (status, per_cluster)


def _raises(api: Any, code: str, action: Callable[[], Any]) -> None:
    with pytest.raises(api.LLMException) as info:
        action()
    assert info.value.status_code == getattr(api.LLMStatusCode, code), info.value


def test_backend_is_the_standin_without_native_extensions(api: Any, client: Any) -> None:
    assert api.BACKEND_NAME == "ascend" and api.PROFILE.name == "ascend"
    assert sys.modules["llm_datadist"].STANDIN
    assert not hasattr(client, "listen_port") and not hasattr(client, "engine_stats")
    assert not hasattr(client.cache_manager, "pull_blocks_async")
    with pytest.raises(AttributeError):
        api.LLMConfig().hixl_transport = "tcp"


def test_second_llmdatadist_raises_llm_failed(api: Any, client: Any) -> None:
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    second = api.LLMDataDist(api.LLMRole.DECODER, CLIENT_CLUSTER + 1)
    _raises(api, "LLM_FAILED", lambda: second.init(config.generate_options()))


def test_key_reuse_raises(api: Any, client: Any) -> None:
    _register(api, client, 0)
    _raises(api, "LLM_FAILED", lambda: _register(api, client, 0))
    _register(api, client, 1)  # a distinct model_id is fine


def test_pull_lands_in_the_documented_order(api: Any, client: Any, peer: Any) -> None:
    cache, tensors = _register(api, client, 0)
    _link(api, client, peer[1])
    client.cache_manager.pull_blocks(
        api.BlocksCacheKey(PEER_CLUSTER, 0), cache, [3, 4, 9], [0, 1, 2], tensor_num_per_layer=2
    )
    for t, tensor in enumerate(tensors):
        blocks = tensor.reshape(NUM_BLOCKS, BLOCK_BYTES)
        assert [int(blocks[d][0]) for d in (0, 1, 2)] == [block_value(t, s) for s in (3, 4, 9)]
        assert int(blocks[3].max()) == 0
    calls = sys.modules["llm_datadist"].calls()
    assert calls[-5:] == [
        "LLMDataDist",
        "init",
        "register_blocks_cache",
        "link_clusters",
        "pull_blocks",
    ]


def test_destination_not_remote_accessible_raises_param(api: Any, client: Any, peer: Any) -> None:
    cache, _ = _register(api, client, 0, accessible=False)
    _link(api, client, peer[1])
    key = api.BlocksCacheKey(PEER_CLUSTER, 0)
    _raises(
        api, "LLM_PARAM_INVALID", lambda: client.cache_manager.pull_blocks(key, cache, [1], [1])
    )


def test_registration_after_link_is_not_remotely_usable(api: Any, client: Any, peer: Any) -> None:
    from harness import ask

    early, _ = _register(api, client, 0)
    _link(api, client, peer[1])
    late, _ = _register(api, client, 1)  # CANN accepts it, but not for remote access
    manager = client.cache_manager
    key = api.BlocksCacheKey(PEER_CLUSTER, 0)
    _raises(api, "LLM_PARAM_INVALID", lambda: manager.pull_blocks(key, late, [1], [1]))
    assert ask(peer[0], "late") == "ok"  # the peer registers model_id 1 after our link
    late_key = api.BlocksCacheKey(PEER_CLUSTER, 1)
    _raises(api, "LLM_KV_CACHE_NOT_EXIST", lambda: manager.pull_blocks(late_key, early, [1], [1]))


def test_request_over_the_limit_raises_param_and_chunks_fit(
    api: Any, client: Any, peer: Any
) -> None:
    cache, tensors = _register(api, client, 0)
    _link(api, client, peer[1])
    count = 70_000  # alternating ids: every pair is its own run, the worst case
    src = [(i % 2) * 5 for i in range(count)]
    dst = [(i % 2) * 7 for i in range(count)]
    key = api.BlocksCacheKey(PEER_CLUSTER, 0)
    manager = client.cache_manager
    _raises(api, "LLM_PARAM_INVALID", lambda: manager.pull_blocks(key, cache, src, dst))
    chunk = ascend.max_pairs_per_pull(NUM_TENSORS)
    chunks = chunk_pairs(src, dst, chunk)
    assert len(chunks) == 2
    for src_chunk, dst_chunk in chunks:
        manager.pull_blocks(key, cache, list(src_chunk), list(dst_chunk))
    blocks = tensors[1].reshape(NUM_BLOCKS, BLOCK_BYTES)
    assert int(blocks[7][0]) == block_value(1, 5) and int(blocks[0][0]) == block_value(1, 0)


def test_hccs_alignment_check_names_the_key() -> None:
    two_mb = ascend.HCCS_ALIGNMENT_BYTES
    ascend.check_hccs_alignment([two_mb, 7 * two_mb], "cache model_id 0")
    with pytest.raises(ValueError, match="ascend_hccs"):
        ascend.check_hccs_alignment([two_mb, two_mb + 4096], "cache model_id 0")


def test_chunk_limit_fits_the_request_buffer() -> None:
    for num_tensors in (1, 2, 64, 160):
        pairs = ascend.max_pairs_per_pull(num_tensors)
        size = 16 * (num_tensors + 2 * pairs)
        assert size + ascend.REQUEST_HEADER_RESERVE_BYTES <= ascend.REQUEST_LIMIT_BYTES
        assert pairs > 60_000
