"""HixlConfig: defaults, validation messages, derived ids and ports."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.connector.config import (
    CLUSTER_ID_SPACE,
    MIN_AUTH_TOKEN_CHARS,
    RENAMED_KEYS,
    HixlConfig,
    TransferMode,
    derived_cluster_id_base,
)
from hixl_connector.connector.endpoints import CLUSTER_ID_STEP, rank_address
from hixl_connector.connector.stats import RENAMED_COUNTERS

ENV_TOKEN = "env-token-0123456789abcdef0123456789"
KEY_TOKEN = "key-token-0123456789abcdef0123456789"


@pytest.mark.parametrize(
    ("extra", "connections"),
    [
        ({"transfer_threads": 8}, 8),
        ({"transfer_threads": 40}, 16),
        ({"transfer_threads": 8, "tcp_connections": 3}, 3),
    ],
)
def test_tcp_connections_follow_the_transfer_threads(extra: dict, connections: int) -> None:
    assert HixlConfig.from_dict(extra, "engine-a").tcp_connections == connections


@pytest.mark.parametrize("key", ["test_corrupt_received_kv", "test_state_control"])
def test_the_tests_controls_are_no_user_keys(key: str) -> None:
    with pytest.raises(ValueError, match=f"unknown kv_connector_extra_config key '{key}'"):
        HixlConfig.from_dict({key: 1}, "e")


def test_a_renamed_key_still_works_and_names_its_new_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, "hixl_connector.connector.config"):
        config = HixlConfig.from_dict({"load_in_step_bytes": 0}, "e")
    assert config.sync_load_bytes == 0
    assert "'load_in_step_bytes' is now 'sync_load_bytes'" in caplog.text
    # The old name is checked as the new one is.
    with pytest.raises(ValueError, match="'sync_load_bytes'"):
        HixlConfig.from_dict({"load_in_step_bytes": -1}, "e")


def test_a_setting_given_under_both_names_is_refused() -> None:
    with pytest.raises(ValueError, match="give only 'sync_load_bytes'"):
        HixlConfig.from_dict({"load_in_step_bytes": 0, "sync_load_bytes": 0}, "e")


def test_every_renamed_key_and_counter_is_in_the_changelog() -> None:
    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    for old, new in {**RENAMED_KEYS, **RENAMED_COUNTERS}.items():
        assert f"`{old}`" in changelog and f"`{new}`" in changelog


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIXL_AUTH_TOKEN", raising=False)
    config = HixlConfig.from_dict({}, "engine-a")
    assert (config.side_channel_host, config.side_channel_port) == ("127.0.0.1", 5701)
    assert (config.engine_host, config.engine_port) == ("127.0.0.1", 0)
    assert (config.backend, config.transport) == ("auto", "auto")
    assert config.transfer_mode is TransferMode.PULL
    assert (config.pull_timeout_s, config.handshake_timeout_s) == (30.0, 5.0)
    assert config.push_timeout_s == config.pull_timeout_s
    assert (config.transfer_threads, config.tcp_connections) == (2, 2)
    assert (config.lease_s, config.heartbeat_s) == (30.0, 5.0)
    assert config.auth_token == ""
    assert config.cluster_id_base == derived_cluster_id_base("engine-a")
    assert {f.name for f in dataclasses.fields(HixlConfig)} == {
        "side_channel_host", "side_channel_port", "engine_host", "engine_port", "backend",
        "transport", "transfer_mode", "pull_timeout_s", "push_timeout_s", "handshake_timeout_s",
        "link_idle_s",
        "transfer_threads", "tcp_connections", "server_handshakes", "server_connections", "lease_s",
        "heartbeat_s", "auth_token", "cluster_id_base", "sync_load_bytes",
        "ascend_local_comm_res", "ascend_hccs",
    }  # fmt: skip
    assert (config.server_handshakes, config.server_connections) == (1024, 4096)
    assert config.sync_load_bytes == 1 << 20
    assert config.link_idle_s == 300.0


@pytest.mark.parametrize(
    ("extra", "idle_s"),
    [
        ({"link_idle_s": 0}, 0.0),
        ({"link_idle_s": 31}, 31.0),
        ({"pull_timeout_s": 200}, 400.0),  # twice a pull's bound where that is longer
        ({"pull_timeout_s": 1, "link_idle_s": 1.5}, 1.5),
        ({"push_timeout_s": 250}, 500.0),  # twice a push's bound where that is longer
    ],
)
def test_link_idle_s(extra: dict[str, float], idle_s: float) -> None:
    assert HixlConfig.from_dict(extra, "e").link_idle_s == idle_s


def test_push_timeout_s_is_pull_timeout_s_unless_set() -> None:
    assert HixlConfig.from_dict({"pull_timeout_s": 12}, "e").push_timeout_s == 12.0
    config = HixlConfig.from_dict({"pull_timeout_s": 12, "push_timeout_s": 3}, "e")
    assert (config.pull_timeout_s, config.push_timeout_s) == (12.0, 3.0)
    with pytest.raises(ValueError, match="'link_idle_s' must be .*push_timeout_s \\(40\\)"):
        HixlConfig.from_dict({"push_timeout_s": 40, "link_idle_s": 35}, "e")
    with pytest.raises(ValueError, match="'push_timeout_s' must be"):
        HixlConfig.from_dict({"push_timeout_s": 0}, "e")


@pytest.mark.parametrize("value", [30, 10, -1, True, "300", float("nan")])
def test_a_link_may_not_close_under_a_read(value: object) -> None:
    with pytest.raises(ValueError, match="'link_idle_s' must be"):
        HixlConfig.from_dict({"link_idle_s": value}, "e")


def test_explicit_values_and_derived_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIXL_AUTH_TOKEN", ENV_TOKEN)
    config = HixlConfig.from_dict(
        {"side_channel_host": "10.1.2.3", "lease_s": 12, "transport": "tcp", "engine_port": 0},
        "engine-a",
    )
    assert config.engine_host == "10.1.2.3"  # follows side_channel_host
    assert config.heartbeat_s == 2.0  # lease_s / 6
    assert config.auth_token == ENV_TOKEN
    assert HixlConfig.from_dict({"auth_token": KEY_TOKEN}, "e").auth_token == KEY_TOKEN
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lease_s = 1.0  # type: ignore[misc]


def test_short_token_is_refused_naming_the_key_and_the_recipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HIXL_AUTH_TOKEN", raising=False)
    short = "s" * (MIN_AUTH_TOKEN_CHARS - 1)
    with pytest.raises(ValueError) as info:
        HixlConfig.from_dict({"auth_token": short}, "e")
    message = str(info.value)
    assert "'auth_token'" in message and f"at least {MIN_AUTH_TOKEN_CHARS}" in message
    assert "secrets.token_hex(32)" in message
    assert short not in message  # a secret, even a bad one, stays out of logs
    exact = "s" * MIN_AUTH_TOKEN_CHARS
    assert HixlConfig.from_dict({"auth_token": exact}, "e").auth_token == exact
    assert HixlConfig.from_dict({"auth_token": ""}, "e").auth_token == ""  # auth off


def test_short_token_from_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HIXL_AUTH_TOKEN", "s3cret")
    with pytest.raises(ValueError, match="HIXL_AUTH_TOKEN.*'auth_token'.*secrets.token_hex"):
        HixlConfig.from_dict({}, "e")
    # The key wins over the environment, so an explicit good (or empty) token is accepted.
    assert HixlConfig.from_dict({"auth_token": KEY_TOKEN}, "e").auth_token == KEY_TOKEN
    assert HixlConfig.from_dict({"auth_token": ""}, "e").auth_token == ""


def test_unknown_key_is_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        HixlConfig.from_dict({"lease_seconds": 3}, "e")
    message = str(info.value)
    assert "'lease_seconds'" in message
    assert "lease_s" in message and "side_channel_port" in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("side_channel_port", 0),
        ("side_channel_port", 70000),
        ("side_channel_port", "5701"),
        ("side_channel_port", True),
        ("engine_port", -1),
        ("side_channel_host", ""),
        ("side_channel_host", 5),
        ("backend", "cuda"),
        ("transport", "rdma"),
        ("transfer_mode", "write"),
        ("transfer_mode", True),
        ("pull_timeout_s", 0),
        ("pull_timeout_s", float("nan")),
        ("pull_timeout_s", 0.0001),
        ("handshake_timeout_s", 3e6),
        ("handshake_timeout_s", -1.0),
        ("transfer_threads", 0),
        ("tcp_connections", 1.5),
        ("tcp_connections", 17),
        ("lease_s", "30"),
        ("heartbeat_s", 0),
        ("auth_token", None),
        ("cluster_id_base", -1),
        ("sync_load_bytes", -1),
        ("sync_load_bytes", 1.5),
        ("sync_load_bytes", 2**31),
        ("ascend_hccs", "yes"),
    ],
)
def test_bad_value_names_key_and_value(key: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        HixlConfig.from_dict({key: value}, "e")
    assert repr(key) in str(info.value)
    assert repr(value) in str(info.value)


def test_heartbeat_must_be_shorter_than_lease() -> None:
    with pytest.raises(ValueError, match="heartbeat_s.*lease_s"):
        HixlConfig.from_dict({"lease_s": 6, "heartbeat_s": 6}, "e")


def test_engine_id_required() -> None:
    with pytest.raises(ValueError, match="engine_id"):
        HixlConfig.from_dict({}, "")


def test_derived_cluster_id_base_is_stable_and_aligned() -> None:
    bases = {derived_cluster_id_base(f"engine-{i}") for i in range(200)}
    assert len(bases) > 190  # distinct engines rarely share a window
    for base in bases:
        assert base % CLUSTER_ID_STEP == 0 and 0 <= base < CLUSTER_ID_SPACE
    assert derived_cluster_id_base("x") == derived_cluster_id_base("x")


def test_rank_ids_and_ports() -> None:
    config = HixlConfig.from_dict({"cluster_id_base": 2048, "side_channel_port": 6000}, "e")
    assert rank_address(config, 0, 0, 2).cluster_id == 2048
    assert rank_address(config, 1, 1, 2).cluster_id == 2048 + 3
    assert rank_address(config, 2, 0, 4).cluster_id == 2048 + 8
    assert rank_address(config, 1, 1, 2).side_channel_port == 6003
    with pytest.raises(ValueError, match="tp_rank 2 is out of range"):
        rank_address(config, 0, 2, 2)
    with pytest.raises(ValueError, match="65535"):
        rank_address(HixlConfig.from_dict({"side_channel_port": 65535}, "e"), 0, 1, 2)


def test_from_vllm_config_reads_extra_config() -> None:
    from vllm.config import KVTransferConfig, VllmConfig

    kv = KVTransferConfig(
        kv_connector="HixlConnector",
        kv_connector_module_path="hixl_connector.connector.facade",  # VllmConfig resolves it
        kv_role="kv_consumer",
        engine_id="engine-z",
        kv_connector_extra_config={"side_channel_port": 6200},
    )
    config = HixlConfig.from_vllm_config(VllmConfig(kv_transfer_config=kv))
    assert config.side_channel_port == 6200
    assert config.cluster_id_base == derived_cluster_id_base("engine-z")
    with pytest.raises(ValueError, match="kv_transfer_config"):
        HixlConfig.from_vllm_config(VllmConfig())


def test_connection_limit_matches_the_engines() -> None:
    # The scheduler half repeats the engine's limit rather than import the engine's package.
    from hixl_connector.connector.config import MAX_TCP_CONNECTIONS
    from hixl_connector.datadist.api.config import MAX_TCP_CONNECTIONS as ENGINE_LIMIT

    assert MAX_TCP_CONNECTIONS == ENGINE_LIMIT
    HixlConfig.from_dict({"tcp_connections": ENGINE_LIMIT}, "e")


def test_listener_caps_match_the_engines_and_are_checked() -> None:
    from hixl_connector.connector import config as connector
    from hixl_connector.datadist.api import config as engine

    for name in (
        "DEFAULT_SERVER_HANDSHAKES",
        "DEFAULT_SERVER_CONNECTIONS",
        "MAX_SERVER_CONNECTIONS",
    ):
        assert getattr(connector, name) == getattr(engine, name), name
    config = HixlConfig.from_dict({"server_connections": 20000, "server_handshakes": 64}, "e")
    assert (config.server_connections, config.server_handshakes) == (20000, 64)
    # A link holds one control and up to 16 data connections: a smaller cap fits no link.
    with pytest.raises(ValueError, match="'server_connections'"):
        HixlConfig.from_dict({"server_connections": 16}, "e")
    with pytest.raises(ValueError, match="'server_handshakes'"):
        HixlConfig.from_dict({"server_handshakes": 0}, "e")


def test_the_auth_token_variable_is_the_engines() -> None:
    from hixl_connector.connector.config import AUTH_TOKEN_ENV
    from hixl_connector.datadist.native.llm_datadist import AUTH_TOKEN_ENV as ENGINE_VARIABLE

    assert AUTH_TOKEN_ENV == ENGINE_VARIABLE


def connector_vllm_config(role: str, engine_id: str) -> Any:
    """vLLM's own config of a server running the connector in ``role``."""
    from vllm.config import KVTransferConfig, VllmConfig

    kv = KVTransferConfig(
        kv_connector="HixlConnector",
        kv_connector_module_path="hixl_connector.connector.facade",
        kv_role=role,
        engine_id=engine_id,
    )
    return VllmConfig(kv_transfer_config=kv)


@pytest.mark.parametrize(
    ("name", "flag"),
    [
        ("pipeline_parallel_size", "--pipeline-parallel-size 1"),
        ("decode_context_parallel_size", "--decode-context-parallel-size 1"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size 1"),
    ],
)
def test_pipeline_and_context_parallelism_are_refused_at_start(name: str, flag: str) -> None:
    vllm_config = connector_vllm_config("kv_producer", "engine-pp")
    HixlConfig.from_vllm_config(vllm_config)  # TP and DP sizes alone are fine
    setattr(vllm_config.parallel_config, name, 2)
    with pytest.raises(ValueError, match=f"{name}=2.*{flag}"):
        HixlConfig.from_vllm_config(vllm_config)


def test_sleep_mode_is_refused_at_start() -> None:
    """vLLM on CPU refuses sleep mode in its own ModelConfig, so a stand-in model config
    carries the flag here: the connector's check reads only enable_sleep_mode."""
    from hixl_connector.connector.facade import HixlConnector

    vllm_config = connector_vllm_config("kv_consumer", "engine-sleep")
    vllm_config.model_config = dataclasses.make_dataclass("M", [("enable_sleep_mode", bool)])(False)
    HixlConfig.from_vllm_config(vllm_config)
    vllm_config.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="without --enable-sleep-mode"):
        HixlConfig.from_vllm_config(vllm_config)
    assert HixlConnector.supports_sleep_mode(vllm_config.kv_transfer_config) is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"engine_host": "prefill-0.example"}, "'prefill-0.example': the transfer engine"),
        ({"engine_host": "::1"}, "got '::1'"),
        ({"side_channel_host": "localhost"}, "follows side_channel_host 'localhost'"),
        ({"engine_host": "127.1"}, "'engine_host' must be an IPv4 address such as 10.0.0.5"),
    ],
)
def test_engine_host_must_be_an_ipv4_address(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HixlConfig.from_dict(extra, "e")
    for backend in ("native", "ascend"):  # neither engine links by host name or IPv6
        with pytest.raises(ValueError, match=message):
            HixlConfig.from_dict({**extra, "backend": backend}, "e")
    # The side channel itself takes host names and IPv6 when the engine has its own address.
    config = HixlConfig.from_dict({"side_channel_host": "::1", "engine_host": "127.0.0.1"}, "e")
    assert (config.side_channel_host, config.engine_host) == ("::1", "127.0.0.1")


@pytest.mark.parametrize("host", ["::1", "fd00::5", "localhost", "prefill-0.example", "10.0.0.5"])
def test_side_channel_host_takes_addresses_and_host_names(host: str) -> None:
    config = HixlConfig.from_dict({"side_channel_host": host, "engine_host": "10.0.0.5"}, "e")
    assert config.side_channel_host == host


@pytest.mark.parametrize("host", ["[::1]", "prefill-0:5701", "bad host", "-p0", "p..0"])
def test_side_channel_host_refuses_what_zeromq_cannot_reach(host: str) -> None:
    expected = re.escape("'side_channel_host' must be an IPv4 address, an IPv6 address without ")
    with pytest.raises(ValueError, match=expected + ".*" + re.escape(repr(host))):
        HixlConfig.from_dict({"side_channel_host": host, "engine_host": "10.0.0.5"}, "e")


def test_tensor_parallelism_across_nodes_is_refused_at_start() -> None:
    """vLLM's own config of an engine whose TP ranks span two nodes: refused naming it, where
    it once failed later opening another node's shared memory."""
    vllm_config = connector_vllm_config("kv_consumer", "engine-nodes")
    parallel = vllm_config.parallel_config
    parallel.tensor_parallel_size, parallel.nnodes = 2, 2
    assert parallel.nnodes_within_dp == 2
    with pytest.raises(ValueError, match="tensor parallelism across nodes .* --nnodes 2"):
        HixlConfig.from_vllm_config(vllm_config)
    # Data-parallel ranks on two nodes, TP within each: fine.
    parallel.tensor_parallel_size, parallel.data_parallel_size = 1, 2
    parallel.data_parallel_size_local = 1
    assert parallel.nnodes_within_dp == 1
    HixlConfig.from_vllm_config(vllm_config)
