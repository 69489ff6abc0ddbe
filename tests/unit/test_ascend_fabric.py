"""The llm_datadist STAND-IN refuses what each Ascend fabric refuses (its fabric.py, from
``ascend_memory_rules.md``), in each link mode, and what CANN's Python refuses at ``init``.

Each attempt is a real peer process serving blocks caches and a decoder engine here that
registers one destination, links and pulls; the outcome is "ok" (the bytes landed) or the
status code CANN answers, at the step where the hardware fails (the link or the pull).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from standin_imports import standin_helpers_importable

with standin_helpers_importable():
    from harness import standin_on_path
    from standin_client import first_bytes, init_client, raises, register, running_peer
    from standin_peer import HOST_MODEL_ID, block_value

PEER_CLUSTER = 7201
CLIENT_CLUSTER = 7202
POOL_BYTES = 100 * 1024 * 1024
BLOCKS = [3, 4, 9]
OK, LINK_FAILED, NOT_CARRIED = "ok", "LLM_LINK_FAILED", "LLM_FEATURE_NOT_ENABLED"


@pytest.fixture(scope="module")
def standin(standin_fabric: str) -> Iterator[Any]:
    with standin_on_path() as module:
        yield module


def attempt(
    standin: Any, peer_flags: tuple[str, ...], model_id: int, local: str, pool: int = 0
) -> str:
    """Links a decoder whose destination is ``local`` memory ("device", "host", "pinned") to
    a standin_peer.py with ``peer_flags`` and pulls its cache ``model_id``: "ok" if the bytes
    landed, else the failing step's status code."""
    with running_peer(PEER_CLUSTER, *peer_flags) as (_, port):
        dd = init_client(standin, CLIENT_CLUSTER, pool=pool)
        try:
            cache, tensors = register(standin, dd, CLIENT_CLUSTER, 0, memory=local)
            info = standin.LLMClusterInfo()
            info.remote_cluster_id = PEER_CLUSTER
            info.append_local_ip_info("127.0.0.1", 0)
            info.append_remote_ip_info("127.0.0.1", port)
            status, _ = dd.link_clusters([info], 5000)
            if status != standin.LLMStatusCode.LLM_SUCCESS:
                return str(status.name)
            key = standin.BlocksCacheKey(PEER_CLUSTER, model_id)
            try:
                dd.cache_manager.pull_blocks(key, cache, BLOCKS, BLOCKS)
            except standin.LLMException as e:
                return str(e.status_code.name)
            assert first_bytes(tensors[1], BLOCKS) == [block_value(1, b) for b in BLOCKS]
            return OK
        finally:
            dd.finalize()


def by_mode(mode: str, a2: str, a3: str, roce: str) -> str:
    return {"hccs-a2": a2, "hccs-a3": a3, "roce": roce}[mode]


def test_device_to_device_reads_on_every_fabric(standin: Any, standin_fabric: str) -> None:
    assert attempt(standin, (), 0, "device") == OK


def test_words_in_plain_host_memory_fail_on_every_fabric(standin: Any, standin_fabric: str) -> None:
    """The guarded read as it was before the words moved beside the KV: P's words and D's
    scratch rows in plain host memory (a /dev/shm file, a ctypes array)."""
    outcome = attempt(standin, ("--host-cache", "plain"), HOST_MODEL_ID, "host", POOL_BYTES)
    assert outcome == by_mode(standin_fabric, NOT_CARRIED, NOT_CARRIED, LINK_FAILED)


def test_remote_host_memory_is_never_carried_by_hccs(standin: Any, standin_fabric: str) -> None:
    """rH2D: the peer's aclrtMallocHost memory into device memory here."""
    flags = ("--host-cache", "pinned")
    assert attempt(standin, flags, HOST_MODEL_ID, "device", POOL_BYTES) == by_mode(
        standin_fabric, NOT_CARRIED, NOT_CARRIED, OK
    )


def test_local_host_from_remote_device_on_a3_and_roce(standin: Any, standin_fabric: str) -> None:
    """rD2H: device memory of the peer into aclrtMallocHost memory here."""
    assert attempt(standin, (), 0, "pinned", POOL_BYTES) == by_mode(
        standin_fabric, NOT_CARRIED, OK, OK
    )


def test_host_and_device_need_the_device_pool(standin: Any, standin_fabric: str) -> None:
    assert attempt(standin, (), 0, "pinned", pool=POOL_BYTES - 1) == NOT_CARRIED


def test_host_to_host_over_roce_needs_aclrtmallochost(standin: Any, standin_fabric: str) -> None:
    pinned = attempt(standin, ("--host-cache", "pinned"), HOST_MODEL_ID, "pinned")
    plain = attempt(standin, ("--host-cache", "pinned"), HOST_MODEL_ID, "host")
    assert (pinned, plain) == by_mode(
        standin_fabric, (NOT_CARRIED,) * 2, (NOT_CARRIED,) * 2, (OK, LINK_FAILED)
    )


def test_misaligned_device_base_fails_the_hccs_link(standin: Any, standin_fabric: str) -> None:
    assert attempt(standin, ("--misaligned",), 0, "device") == by_mode(
        standin_fabric, LINK_FAILED, LINK_FAILED, OK
    )


def _options(standin: Any, **fields: Any) -> dict[str, str]:
    config = standin.LLMConfig()
    config.device_id = 0
    for name, value in fields.items():
        setattr(config, name, value)
    return dict(config.generate_options())


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"enable_cache_manager": True, "transfer_backend": "hixl"},
            "listenIpInfo is not configured",
        ),
        (
            {
                "enable_cache_manager": True,
                "enable_remote_cache_accessible": False,
                "transfer_backend": "hixl",
                "listen_ip_info": "127.0.0.1:0",
            },
            "EnableRemoteCacheAccessible is not enable",
        ),
        (
            {"transfer_backend": "hixl", "listen_ip_info": "127.0.0.1:0"},
            "EnableCacheManager is not configured",
        ),
    ],
    ids=["hixl-without-listen-ip", "hixl-remote-access-off", "hixl-without-cache-manager"],
)
def test_init_refuses_what_canns_python_refuses(
    standin: Any, fields: dict[str, Any], message: str
) -> None:
    dd = standin.LLMDataDist(standin.LLMRole.DECODER, CLIENT_CLUSTER)
    raises(standin, "LLM_PARAM_INVALID", lambda: dd.init(_options(standin, **fields)), message)
    dd.finalize()


def test_without_the_cache_manager_there_is_none(standin: Any) -> None:
    dd = standin.LLMDataDist(standin.LLMRole.DECODER, CLIENT_CLUSTER)
    dd.init(_options(standin))  # CANN's v1 API
    try:
        raises(standin, "LLM_PARAM_INVALID", lambda: dd.cache_manager, "EnableCacheManager")
    finally:
        dd.finalize()
