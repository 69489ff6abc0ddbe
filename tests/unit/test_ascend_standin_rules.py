"""The llm_datadist STAND-IN (tests/ascend_standin/) behaves as CANN's Python layer does, and
raises as CANN's documented C++ rules do; the "ascend" back-end runs over it.

What CANN silently accepts, the stand-in accepts too (so a test sees what Ascend would do);
the project's own refusals of those mistakes are tested in test_ascend_checks.py. This proves
the back-end's API use and the rules, on host memory; not the NPU/HCCS/RoCE path.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

with standin_helpers_importable():
    from harness import standin_on_path
    from standin_client import (
        first_bytes,
        init_client,
        link,
        raises,
        register,
        running_peer,
    )
    from standin_peer import NUM_TENSORS, block_value

    from hixl_connector.connector.mapping.blocks import chunk_pairs
    from hixl_connector.datadist import load_backend
    from hixl_connector.datadist.ascend import cann as ascend

PEER_CLUSTER = 7001
CLIENT_CLUSTER = 7002
TWICE_PEER_CLUSTER = 7003


@pytest.fixture(scope="module")
def standin(standin_fabric: str) -> Iterator[Any]:
    """CANN's package as the stand-in plays it, without the back-end's checks, in each of
    the Ascend link modes."""
    with standin_on_path() as module:
        yield module


@pytest.fixture(scope="module")
def api(standin: Any) -> Any:
    return load_backend("ascend")


@pytest.fixture(scope="module")
def peer(api: Any) -> Iterator[tuple[Any, int]]:
    with running_peer(PEER_CLUSTER) as running:
        yield running


@pytest.fixture
def client(api: Any) -> Iterator[Any]:
    dd = init_client(api, CLIENT_CLUSTER)
    yield dd
    dd.finalize()


@pytest.fixture
def raw_client(standin: Any) -> Iterator[Any]:
    dd = init_client(standin, CLIENT_CLUSTER)
    yield dd
    dd.finalize()


def test_backend_is_the_standin_without_native_extensions(api: Any, client: Any) -> None:
    assert api.BACKEND_NAME == "ascend" and api.PROFILE.name == "ascend"
    assert sys.modules["llm_datadist"].STANDIN
    assert not hasattr(client, "listen_port") and not hasattr(client, "engine_stats")
    assert not hasattr(client.cache_manager, "pull_blocks_batch_async")


def test_second_llmdatadist_raises_llm_failed(api: Any, client: Any) -> None:
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    second = api.LLMDataDist(api.LLMRole.DECODER, CLIENT_CLUSTER + 1)
    raises(api, "LLM_FAILED", lambda: second.init(config.generate_options()))


def test_config_stores_unknown_attributes_and_forwards_any_option(standin: Any) -> None:
    config = standin.LLMConfig()
    config.sync_kv_timout = 9000  # misspelt: stored, never an option
    config.hixl_transport = "tcp"  # the native engine's, not CANN's
    config.device_id = 0
    config.enable_cache_manager = True
    assert config.hixl_transport == "tcp" and config.sync_kv_timout == 9000
    options = config.generate_options()
    assert "llm.SyncKvCacheWaitTime" not in options
    assert not [key for key in options if key.startswith("hixl.")]
    dd = standin.LLMDataDist(standin.LLMRole.DECODER, CLIENT_CLUSTER)
    dd.init({**options, "custom.key": "1", "hixl.transport": "tcp"})  # forwarded, not refused
    dd.finalize()


@pytest.mark.parametrize("listen", ["::1:0", "[::1]:0"])
def test_ipv6_listen_address_fails_init(standin: Any, listen: str) -> None:
    action = lambda: init_client(standin, CLIENT_CLUSTER, listen)  # noqa: E731
    raises(standin, "LLM_PARAM_INVALID", action, match='format should be "ip:port"')


def test_host_name_in_cluster_info_raises_without_a_status(standin: Any) -> None:
    info = standin.LLMClusterInfo()
    with pytest.raises(RuntimeError, match="Can not parse ip str:prefill-0") as caught:
        info.append_remote_ip_info("prefill-0", 26000)
    assert not hasattr(caught.value, "status_code")  # the connector would see a broken link
    info.append_remote_ip_info("10.0.0.5", 26000)
    assert info.remote_ip_info_list == [(0x0500000A, 26000)]  # little-endian, as CANN


def test_same_key_twice_names_the_newest_cache(standin: Any, raw_client: Any) -> None:
    cache, tensors = register(standin, raw_client, CLIENT_CLUSTER, 0)
    with running_peer(TWICE_PEER_CLUSTER, "--same-key-twice") as (_, port):
        link(standin, raw_client, TWICE_PEER_CLUSTER, port)
        key = standin.BlocksCacheKey(TWICE_PEER_CLUSTER, 0)
        raw_client.cache_manager.pull_blocks(key, cache, [3, 4], [0, 1])
    assert first_bytes(tensors[2], [0, 1]) == [block_value(2, s) + 1 for s in (3, 4)]


def test_misspelt_pull_keyword_is_ignored_as_cann_does(
    standin: Any, raw_client: Any, peer: Any
) -> None:
    """CANN reads pull_blocks keywords with dict.get: tensor_num_per_layr=4 is dropped, the
    default of 2 tensors per layer applies, and layer 0 is tensors 0 and 1 only."""
    cache, tensors = register(standin, raw_client, CLIENT_CLUSTER, 0)
    link(standin, raw_client, PEER_CLUSTER, peer[1])
    layer0 = {"src_layer_range": range(0, 1), "dst_layer_range": range(0, 1)}
    key = standin.BlocksCacheKey(PEER_CLUSTER, 0)
    raw_client.cache_manager.pull_blocks(key, cache, [3], [0], tensor_num_per_layr=4, **layer0)
    assert [first_bytes(t, [0])[0] for t in tensors] == [block_value(0, 3), block_value(1, 3), 0, 0]
    assert standin.pull_kwargs()[-1] == (
        "dst_layer_range",
        "src_layer_range",
        "tensor_num_per_layr",
    )
    # An empty layer range means all layers, as in CANN.
    raw_client.cache_manager.pull_blocks(key, cache, [5], [1], src_layer_range=range(2, 2))
    assert [first_bytes(t, [1])[0] for t in tensors] == [block_value(t, 5) for t in range(4)]


def test_pull_lands_in_the_documented_order(api: Any, client: Any, peer: Any) -> None:
    cache, tensors = register(api, client, CLIENT_CLUSTER, 0)
    link(api, client, PEER_CLUSTER, peer[1])
    client.cache_manager.pull_blocks(
        api.BlocksCacheKey(PEER_CLUSTER, 0), cache, [3, 4, 9], [0, 1, 2], tensor_num_per_layer=2
    )
    for t, tensor in enumerate(tensors):
        assert first_bytes(tensor, [0, 1, 2]) == [block_value(t, s) for s in (3, 4, 9)]
        assert first_bytes(tensor, [3]) == [0]
    calls = sys.modules["llm_datadist"].calls()
    assert calls[-5:] == [
        "LLMDataDist",
        "init",
        "register_blocks_cache",
        "link_clusters",
        "pull_blocks",
    ]


def test_destination_not_remote_accessible_raises_param(api: Any, client: Any, peer: Any) -> None:
    cache, _ = register(api, client, CLIENT_CLUSTER, 0, accessible=False)
    link(api, client, PEER_CLUSTER, peer[1])
    key = api.BlocksCacheKey(PEER_CLUSTER, 0)
    raises(api, "LLM_PARAM_INVALID", lambda: client.cache_manager.pull_blocks(key, cache, [1], [1]))


def test_registration_after_link_is_not_remotely_usable(
    standin: Any, raw_client: Any, peer: Any
) -> None:
    from harness import ask

    early, _ = register(standin, raw_client, CLIENT_CLUSTER, 0)
    link(standin, raw_client, PEER_CLUSTER, peer[1])
    late, _ = register(standin, raw_client, CLIENT_CLUSTER, 1)  # CANN accepts it, but not for
    manager = raw_client.cache_manager  # remote access
    key = standin.BlocksCacheKey(PEER_CLUSTER, 0)
    raises(standin, "LLM_PARAM_INVALID", lambda: manager.pull_blocks(key, late, [1], [1]))
    assert ask(peer[0], "late") == "ok"  # the peer registers model_id 1 after our link
    late_key = standin.BlocksCacheKey(PEER_CLUSTER, 1)
    raises(
        standin, "LLM_KV_CACHE_NOT_EXIST", lambda: manager.pull_blocks(late_key, early, [1], [1])
    )


def test_request_over_the_limit_raises_param_and_chunks_fit(
    api: Any, client: Any, peer: Any
) -> None:
    cache, tensors = register(api, client, CLIENT_CLUSTER, 0)
    link(api, client, PEER_CLUSTER, peer[1])
    count = 70_000  # alternating ids: every pair is its own run, the worst case
    src = [(i % 2) * 5 for i in range(count)]
    dst = [(i % 2) * 7 for i in range(count)]
    key = api.BlocksCacheKey(PEER_CLUSTER, 0)
    manager = client.cache_manager
    raises(api, "LLM_PARAM_INVALID", lambda: manager.pull_blocks(key, cache, src, dst))
    chunk = ascend.max_pairs_per_pull(NUM_TENSORS)
    chunks = chunk_pairs(src, dst, chunk)
    assert len(chunks) == 2
    for src_chunk, dst_chunk in chunks:
        manager.pull_blocks(key, cache, list(src_chunk), list(dst_chunk))
    assert first_bytes(tensors[1], [7, 0]) == [block_value(1, 5), block_value(1, 0)]


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
