"""The "ascend" back-end's own checks (hixl_connector/datadist/ascend/checked_classes.py), over
the llm_datadist STAND-IN: each mistake CANN silently accepts (test_ascend_standin_rules.py shows
the stand-in accepting it too) raises at the call instead, naming what is wrong."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

with standin_helpers_importable():
    from harness import standin_on_path
    from standin_client import init_client, link, raises, register, running_peer

    from hixl_connector.datadist import load_backend

PEER_CLUSTER = 7101
CLIENT_CLUSTER = 7102


@pytest.fixture(scope="module")
def api(standin_fabric: str) -> Iterator[Any]:
    with standin_on_path():
        yield load_backend("ascend")


@pytest.fixture
def client(api: Any) -> Iterator[Any]:
    dd = init_client(api, CLIENT_CLUSTER)
    yield dd
    dd.finalize()


def test_config_attribute_that_is_not_an_option_raises(api: Any) -> None:
    config = api.LLMConfig()
    with pytest.raises(AttributeError, match="'hixl_transport'.*options:.*sync_kv_timeout"):
        config.hixl_transport = "tcp"  # the native engine's option, not CANN's
    with pytest.raises(AttributeError, match="'sync_kv_timout'"):
        config.sync_kv_timout = 9000
    config.sync_kv_timeout = 9000
    assert config.generate_options()["llm.SyncKvCacheWaitTime"] == "9000"


def test_init_drops_native_keys_and_refuses_other_foreign_ones(api: Any) -> None:
    config = api.LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = True
    options = config.generate_options()
    dd = api.LLMDataDist(api.LLMRole.DECODER, CLIENT_CLUSTER)
    raises(api, "LLM_PARAM_INVALID", lambda: dd.init({**options, "custom.key": "1"}), "custom.key")
    dd.init({**options, "hixl.transport": "tcp"})
    dd.finalize()


@pytest.mark.parametrize("listen", ["localhost:0", "::1:0", "[::1]:0", "127.1:0", "10.0.0.5"])
def test_listen_address_must_be_an_ipv4_literal(api: Any, listen: str) -> None:
    action = lambda: init_client(api, CLIENT_CLUSTER, listen)  # noqa: E731
    raises(api, "LLM_PARAM_INVALID", action, re.escape(listen) + ".*<IPv4 address>:<port>")


def test_reused_blocks_cache_key_raises_llm_failed(api: Any, client: Any) -> None:
    register(api, client, CLIENT_CLUSTER, 0)
    action = lambda: register(api, client, CLIENT_CLUSTER, 0)  # noqa: E731
    raises(api, "LLM_FAILED", action, r"BlocksCacheKey\(7102, 0\) is registered already")
    register(api, client, CLIENT_CLUSTER, 1)  # a distinct model_id is fine


def test_key_is_free_again_after_unregister(api: Any, client: Any) -> None:
    cache, _ = register(api, client, CLIENT_CLUSTER, 0)
    client.cache_manager.unregister_cache(cache.cache_id)
    register(api, client, CLIENT_CLUSTER, 0)


def test_address_count_must_match_the_tensors(api: Any, client: Any) -> None:
    desc = api.CacheDesc(4, [8, 64], api.DataType.DT_UINT8)
    manager = client.cache_manager
    action = lambda: manager.register_blocks_cache(desc, [4096, 8192])  # noqa: E731
    raises(api, "LLM_PARAM_INVALID", action, "2 addresses for 4 tensors")


def test_pull_blocks_refuses_what_cann_ignores(api: Any, client: Any) -> None:
    cache, _ = register(api, client, CLIENT_CLUSTER, 0)
    key = api.BlocksCacheKey(PEER_CLUSTER, 0)
    pull = client.cache_manager.pull_blocks
    with pytest.raises(TypeError, match="tensor_num_per_layr"):
        pull(key, cache, [1], [1], tensor_num_per_layr=4)
    raises(api, "LLM_PARAM_INVALID", lambda: pull(key, cache, [1, 2], [1]), "size 2 != ")
    empty = range(3, 1)
    action = lambda: pull(key, cache, [1], [1], src_layer_range=empty)  # noqa: E731
    raises(api, "LLM_PARAM_INVALID", action, "empty or reversed")
    assert sys.modules["llm_datadist"].calls()[-1] != "pull_blocks"  # none reached CANN


def test_registration_after_link_raises(api: Any, client: Any) -> None:
    register(api, client, CLIENT_CLUSTER, 0)
    with running_peer(PEER_CLUSTER) as (_, port):
        link(api, client, PEER_CLUSTER, port)
        action = lambda: register(api, client, CLIENT_CLUSTER, 1)  # noqa: E731
        raises(api, "LLM_PARAM_INVALID", action, "after link_clusters")


def test_push_mode_stays_refused_on_the_ascend_back_end(api: Any) -> None:
    """CANN has no write grants: push mode is refused at registration, naming the fix."""
    import torch

    from hixl_connector.connector.config import HixlConfig
    from hixl_connector.connector.endpoints import RankAddress
    from hixl_connector.connector.kv.layout import describe_kv_caches
    from hixl_connector.connector.kv.registered_kv import register_kv

    config = HixlConfig.from_dict({"backend": "ascend", "transfer_mode": "push"}, "e")
    layout = describe_kv_caches({"layer": torch.zeros(8, 64)}, 8)
    with pytest.raises(ValueError, match="'push' needs the native engine's write grants.*'pull'"):
        register_kv(config, layout, RankAddress(CLIENT_CLUSTER, 0, 26000), False, True)
