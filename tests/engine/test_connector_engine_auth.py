"""The connector's config is the one source of the auth token: an explicit empty
``auth_token`` means no auth for the engine too, even with HIXL_AUTH_TOKEN set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hixl_connector.connector.config import AUTH_TOKEN_ENV, HixlConfig
from hixl_connector.connector.endpoints import rank_address
from hixl_connector.connector.kv.layout import describe_kv_caches
from hixl_connector.connector.kv.registered_kv import register_kv

from .datadist_harness import Peer

ENV_TOKEN = "environment-token-0123456789abcdef0123"


def test_an_explicit_empty_token_links_to_a_peer_without_auth(
    peer_factory: Callable[..., Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    peer = peer_factory(41)  # serves without a token
    monkeypatch.setenv(AUTH_TOKEN_ENV, ENV_TOKEN)
    config = HixlConfig.from_dict({"auth_token": "", "backend": "native"}, "decode-auth")
    assert config.auth_token == ""
    kv = torch.zeros(2, 8, 2, 16, 64)
    layout = describe_kv_caches({f"l{i}": kv[i] for i in range(2)}, 8, 2)
    engine = register_kv(
        config, layout, rank_address(config, 0, 0, 1), producer=False, consumer=True
    )
    try:
        api: Any = engine.api
        info = api.LLMClusterInfo()
        info.remote_cluster_id = peer.cluster_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", peer.port)
        ok = api.LLMStatusCode.LLM_SUCCESS
        # An engine that had taken the environment's token would fail the peer's challenge.
        assert engine.datadist.link_clusters([info], 5000) == (ok, [ok])
        engine.datadist.unlink_clusters([info], 3000)
    finally:
        engine.datadist.finalize()
