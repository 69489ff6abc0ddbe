"""Pure tests of the datadist API's argument checks (no engine, no processes).

They walk rows 2-18 of the reference's pull_blocks validation table (6.3) and check that the
first failing row wins, with CANN's exception type and status code.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from hixl_connector.datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMStatusCode,
    Placement,
    load_backend,
)
from hixl_connector.datadist.api.rules import PULL_BLOCKS, PUSH_BLOCKS, RULES, Transfer, check
from hixl_connector.datadist.backend import BackendUnavailableError
from hixl_connector.datadist.native.transfer_args import (
    KIND_BLOCKS,
    KIND_CACHE_ID,
    KIND_CACHE_KEY,
    PullArgs,
)

PARAM = LLMStatusCode.LLM_PARAM_INVALID
NUM_TENSORS, NUM_BLOCKS = 8, 16


def _cache(cache_id: int = 5, blocks: bool = True, num_tensors: int = NUM_TENSORS) -> Cache:
    desc = CacheDesc(num_tensors, [NUM_BLOCKS, 4, 8], DataType.DT_BF16, Placement.HOST)
    return Cache(cache_id, desc, [4096] * num_tensors, None, True, blocks)


DST = _cache()
REGISTERED = {DST.cache_id: DST}


def pull(
    key: Any = None, dst: Any = DST, src: Any = (1,), dst_blocks: Any = (2,), **kwargs: Any
) -> PullArgs:
    key = BlocksCacheKey(9) if key is None else key
    return validate_pull_blocks(key, dst, src, dst_blocks, kwargs)


def validate_pull_blocks(key: Any, dst: Any, src: Any, dst_blocks: Any, kwargs: Any) -> PullArgs:
    transfer = Transfer(PULL_BLOCKS, key, dst, src, dst_blocks, kwargs, registered=REGISTERED)
    return PullArgs.of(check(transfer))


def raises_param(**kwargs: Any) -> LLMException:
    with pytest.raises(LLMException) as info:
        pull(**kwargs)
    assert info.value.status_code == PARAM, info.value
    return info.value


def test_status_codes_have_cann_values() -> None:
    assert LLMStatusCode.LLM_PARAM_INVALID == 1343270917
    assert LLMStatusCode.LLM_KV_CACHE_NOT_EXIST == 1343270914
    assert LLMStatusCode.LLM_TIMEOUT == 1343270938
    assert LLMStatusCode.LLM_LINK_BUSY == 1343270939
    assert LLMStatusCode.LLM_OUT_OF_MEMORY == 1343270940
    assert LLMStatusCode.LLM_FAILED == 4294967295
    assert LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR == 507057
    assert LLMStatusCode.LLM_UNKNOWN_ERROR == -1
    assert LLMException("x").status_code == LLMStatusCode.LLM_SUCCESS
    assert isinstance(LLMException("x"), RuntimeError)


def test_row2_unknown_kwarg_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="src_layer_rang.*allowed"):
        pull(src_layer_rang=range(1))


def test_row3_key_type() -> None:
    with pytest.raises(TypeError):
        pull(key=(9, 0))
    with pytest.raises(TypeError):
        validate_pull_blocks(None, DST, (1,), (2,), {})


def test_row4_dst_cache_type_wins_over_later_rows() -> None:
    with pytest.raises(TypeError):
        pull(dst="cache", dst_blocks=())
    with pytest.raises(TypeError):
        pull(dst=None)


@pytest.mark.parametrize("bad", [None, 3, [1.0], ["1"], {1}])
def test_rows5_6_block_lists(bad: Any) -> None:
    with pytest.raises(TypeError):
        pull(src=bad)
    with pytest.raises(TypeError):
        pull(dst_blocks=bad)


def test_bool_counts_as_int() -> None:
    assert pull(src=[True], dst_blocks=[False]).what == ([True], [False])


def test_row7_dst_must_be_blocks_cache_before_row8() -> None:
    exc = raises_param(dst=_cache(blocks=False), dst_blocks=())
    assert "blocks cache" in str(exc)


def test_row8_dst_blocks_not_empty() -> None:
    assert "dst_blocks" in str(raises_param(dst_blocks=[], tensor_num_per_layer=0))


def test_row9_tensor_num_per_layer_type_and_range() -> None:
    with pytest.raises(TypeError):
        pull(tensor_num_per_layer=2.0)
    with pytest.raises(ValueError):
        pull(tensor_num_per_layer=-1)
    with pytest.raises(ValueError):
        pull(tensor_num_per_layer=2**32)


def test_row10_tensor_num_per_layer_positive_before_row11() -> None:
    assert "tensor_num_per_layer" in str(raises_param(tensor_num_per_layer=0, src=[]))


def test_row11_key_specific_block_rules() -> None:
    assert "src_blocks" in str(raises_param(src=[]))
    assert "src_blocks" in str(raises_param(key=CacheKeyByIdAndIndex(9, 1), src=[1]))
    assert "prefix id" in str(raises_param(key=CacheKey(9, 2**64 - 1), src=[]))
    assert "only one" in str(raises_param(key=CacheKey(9, 1, prefix_id=3), src=[]))


def test_row12_layer_range_type() -> None:
    with pytest.raises(TypeError):
        pull(src_layer_range=[0, 1])
    with pytest.raises(TypeError):
        pull(dst_layer_range=(0, 1), src_layer_range=range(0, 8, 2))


def test_row13_step_before_row14_start() -> None:
    assert "step" in str(raises_param(src_layer_range=range(-1, 3, 2)))
    assert "step" in str(raises_param(dst_layer_range=range(0, 3, 2), src_layer_range=range(-1, 2)))


def test_row14_start_not_negative() -> None:
    assert "start" in str(raises_param(dst_layer_range=range(-1, 2)))


def test_row15_uint32_bounds() -> None:
    with pytest.raises(ValueError):
        pull(src_layer_range=range(2**32 - 1, 2**32 + 1))


@pytest.mark.parametrize("bad", [range(0), range(3, 1), range(-3, -5)])
def test_empty_or_reversed_range_is_rejected_not_all_layers(bad: range) -> None:
    assert "empty or reversed" in str(raises_param(src_layer_range=bad))


def test_row16_block_ids_fit_uint64() -> None:
    with pytest.raises(TypeError):
        pull(src=[-1])
    with pytest.raises(TypeError):
        pull(dst_blocks=[2**64])


def test_row17_unregistered_dst_cache() -> None:
    with pytest.raises(LLMException) as info:
        pull(dst=_cache(cache_id=77))
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_row18_local_checks() -> None:
    assert "out of range" in str(raises_param(dst_blocks=[NUM_BLOCKS]))
    assert "size" in str(raises_param(src=[1, 2], dst_blocks=[3]))
    assert "divide" in str(raises_param(tensor_num_per_layer=3, src_layer_range=range(1)))
    assert "dst_layer_range" in str(raises_param(dst_layer_range=range(3, 5)))


def test_each_rule_is_one_row_of_the_table() -> None:
    checks = [rule.check for rule in RULES]
    assert len(checks) == len(set(checks))
    assert all(rule.calls for rule in RULES)


LOCAL_OUT_OF_RANGE = ([1, 2], [NUM_BLOCKS])  # (remote, local) blocks, two faults


@pytest.mark.parametrize(
    ("remote_and_local", "kwargs", "first_error"),
    [
        (([1], [2]), {"dst_layer_range": range(0, 3, 2), "src_layer_range": range(-1, 2)}, "step"),
        (([1], [2]), {"src_layer_range": range(-3, -5)}, "empty or reversed"),
        (([1], [2]), {"tensor_num_per_layer": 0, "src_layer_range": range(-1, 2)}, "tensor_num"),
        (LOCAL_OUT_OF_RANGE, {}, "out of range"),
    ],
)
def test_pushes_meet_the_shared_rules_in_pull_blocks_order(
    remote_and_local: tuple[list[int], list[int]], kwargs: dict[str, Any], first_error: str
) -> None:
    remote, local = remote_and_local
    for call, src, dst in ((PULL_BLOCKS, remote, local), (PUSH_BLOCKS, local, remote)):
        transfer = Transfer(
            call,
            BlocksCacheKey(9),
            DST,
            src,
            dst,
            kwargs=kwargs,
            registered=REGISTERED,
            remote_cache_accessible=call.push,
        )
        with pytest.raises(LLMException, match=first_error):
            check(transfer)


def test_an_unknown_push_keyword_names_the_only_extension() -> None:
    misspelt = Transfer(
        PUSH_BLOCKS,
        BlocksCacheKey(9),
        DST,
        [1],
        [2],
        {"hixl_write_grnt": 3},
        remote_cache_accessible=True,
    )
    with pytest.raises(
        TypeError, match=r"\['hixl_write_grnt'\]; allowed .* \['hixl_write_grant'\]$"
    ):
        check(misspelt)


def test_the_ascend_back_end_applies_only_the_rows_cann_skips_or_finds_late() -> None:
    not_a_cache = Transfer(PULL_BLOCKS, BlocksCacheKey(9), "not a cache", [1], [2])
    check(not_a_cache, ascend_only=True)  # CANN's own type check, left to CANN
    not_a_list = Transfer(PULL_BLOCKS, BlocksCacheKey(9), None, 3, [1])
    check(not_a_list, ascend_only=True)  # CANN raises its own TypeError for it
    with pytest.raises(TypeError, match="tensor_num_per_layr"):
        check(
            Transfer(PULL_BLOCKS, BlocksCacheKey(9), None, kwargs={"tensor_num_per_layr": 4}), True
        )
    with pytest.raises(LLMException, match="size 2 != dst_blocks size 1"):
        check(Transfer(PULL_BLOCKS, BlocksCacheKey(9), None, [1, 2], [3]), ascend_only=True)


def test_divisibility_only_checked_with_a_range() -> None:
    assert pull(tensor_num_per_layer=3).src_tensors == (0, -1)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_layer_ranges_become_tensor_ranges(n: int) -> None:
    args = pull(src_layer_range=range(1, 3), dst_layer_range=range(0, 2), tensor_num_per_layer=n)
    assert args.src_tensors == (1 * n, 2 * n)
    assert args.dst_tensors == (0, 2 * n)


def test_keys_map_to_native_kinds() -> None:
    blocks = pull(key=BlocksCacheKey(9, 3)).remote
    assert (blocks.kind, blocks.model_id, blocks.cluster_id) == (KIND_BLOCKS, 3, 9)
    by_id = pull(key=CacheKeyByIdAndIndex(9, 4, 1), src=[]).remote
    assert (by_id.kind, by_id.cache_id, by_id.batch_index) == (KIND_CACHE_ID, 4, 1)
    by_key = pull(key=CacheKey(9, 11, 1), src=()).remote
    assert (by_key.kind, by_key.req_id, by_key.model_id) == (KIND_CACHE_KEY, 11, 1)


def test_descriptor_and_key_constructors() -> None:
    desc = CacheDesc(64, [128, 16, 8, 128], DataType.DT_BF16, Placement.HOST)
    assert desc.size == 128 * 16 * 8 * 128 * 2 and desc.batch_size == 128
    assert CacheDesc(1, [2], DataType.DT_FLOAT).placement == Placement.DEVICE
    with pytest.raises(TypeError):
        CacheDesc(1, [2.0], DataType.DT_FLOAT)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        CacheDesc(-1, [2], DataType.DT_FLOAT)
    with pytest.raises(LLMException):
        CacheDesc(1, [2], DataType.DT_FLOAT, batch_dim_index=1)
    assert BlocksCacheKey(prompt_cluster_id=3).cluster_id == 3
    assert BlocksCacheKey(3, 4).model_id == 4
    for bad_call in (
        lambda: BlocksCacheKey(1, 2, 3),
        lambda: BlocksCacheKey(model_id=1),
        lambda: BlocksCacheKey(1, modle_id=2),
    ):
        with pytest.raises(LLMException) as info:
            bad_call()
        assert info.value.status_code == PARAM
    with pytest.raises(TypeError):
        BlocksCacheKey("1")
    assert CacheKey(1, 2).prefix_id == 2**64 - 1
    with pytest.raises(ValueError):
        CacheKey(1, -2)
    with pytest.raises(ValueError):
        CacheKeyByIdAndIndex(1, 2, -1)


def test_config_generates_cann_option_keys() -> None:
    config = LLMConfig()
    assert config.sync_kv_timeout is None and config.generate_options() == {}
    config.device_id = 3
    config.listen_ip_info = "10.0.0.1:26000"
    config.sync_kv_timeout = 5000
    config.enable_cache_manager = True
    config.enable_remote_cache_accessible = True
    config.transfer_backend = "hixl"
    config.local_comm_res = ""
    config.hixl_transport = "tcp"
    config.hixl_tcp_connections = 4
    options = config.generate_options()
    assert options["ge.exec.deviceId"] == "3"
    assert options["llm.listenIpInfo"] == "10.0.0.1:26000"
    assert options["llm.SyncKvCacheWaitTime"] == "5000"
    assert options["llm.EnableCacheManager"] == "1"
    assert options["llm.EnableRemoteCacheAccessible"] == "1"
    assert options["llm.TransferBackend"] == "hixl"
    assert options["llm.LocalCommRes"] == ""
    assert (options["hixl.transport"], options["hixl.tcpConnections"]) == ("tcp", "4")
    with pytest.raises(LLMException, match=r"\[1, 16\]"):
        config.hixl_tcp_connections = 17
    config.hixl_server_handshakes = 64
    config.hixl_server_connections = 20000
    config.hixl_server_threads = 3
    options = config.generate_options()
    assert options["hixl.serverHandshakes"] == "64"
    assert options["hixl.serverConnections"] == "20000"
    assert options["hixl.serverThreads"] == "3"
    with pytest.raises(LLMException, match=r"\[17, "):
        config.hixl_server_connections = 16  # a link holds up to 1 + 16 connections
    with pytest.raises(LLMException, match=r"\[0, 64\]"):
        config.hixl_server_threads = 65
    with pytest.raises(AttributeError, match="'sync_kv_timout'.*sync_kv_timeout"):
        config.sync_kv_timout = 5000  # a misspelled option
    with pytest.raises(LLMException):
        config.sync_kv_timeout = 0
    with pytest.raises(TypeError):
        config.enable_cache_manager = 1  # type: ignore[assignment]
    with pytest.raises(LLMException):
        config.hixl_transport = "rdma"


def test_cluster_info_stores_little_endian_ips() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 5
    info.append_remote_ip_info("127.0.0.1", 26000)
    assert info.remote_ip_info_list == [(0x0100007F, 26000)]
    with pytest.raises(ValueError):
        info.append_local_ip_info("127.0.0.1", 70000)
    with pytest.raises(ValueError):
        info.remote_cluster_id = -1


def test_load_backend() -> None:
    native = load_backend("native")
    assert native.BACKEND_NAME == "native" and native.LLMStatusCode is LLMStatusCode
    assert isinstance(BackendUnavailableError("x"), ImportError)
    with pytest.raises(ValueError):
        load_backend("cuda")
    if importlib.util.find_spec("llm_datadist") is not None:
        return  # on an Ascend host CANN is there; the rest checks a host without it
    with pytest.raises(BackendUnavailableError, match="llm_datadist"):
        load_backend("ascend")
    assert load_backend("auto").BACKEND_NAME == "native"


def test_thread_pull_handle_emulation() -> None:
    from threading import Event

    from hixl_connector.datadist import ThreadPullHandle

    release = Event()
    handle = ThreadPullHandle(lambda: release.wait(5))
    assert handle.poll() is False and handle.wait(0.01) is False
    release.set()
    assert handle.wait(5) is True and handle.done

    def fail() -> None:
        raise LLMException("boom", status_code=LLMStatusCode.LLM_TIMEOUT)

    failing = ThreadPullHandle(fail)
    for _ in range(2):
        with pytest.raises(LLMException) as info:
            failing.wait(5)
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT


def test_import_is_light() -> None:
    """The engine and numpy load on LLMDataDist.init, not on import."""
    import subprocess
    import sys

    code = (
        "import sys, hixl_connector.datadist as d; d.load_backend('native'); "
        "print('hixl_connector._native' in sys.modules, 'numpy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr
