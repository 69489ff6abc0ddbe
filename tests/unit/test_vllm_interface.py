"""Which vLLM the connector starts on, and how it reports receives on each (vllm_interface)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector.connector import vllm_interface
from hixl_connector.connector.vllm_interface import (
    NEWEST,
    OLDEST,
    UnsupportedVllm,
    check_supported,
    minor_version,
)

versions = st.tuples(st.integers(0, 3), st.integers(0, 60), st.integers(0, 9))
suffixes = st.sampled_from(["", "+cpu", ".post1", "rc1", ".dev12+g1234abc"])


@given(versions, suffixes, st.integers(1, 4), st.booleans())
def test_supported_range_decides(
    version: tuple[int, int, int], suffix: str, groups: int, reports_failures: bool
) -> None:
    text = ".".join(map(str, version)) + suffix
    inside = OLDEST <= version[:2] <= NEWEST
    safe_groups = groups == 1 or reports_failures
    if inside and safe_groups:
        check_supported(text, groups, reports_failures)
        return
    with pytest.raises(UnsupportedVllm) as refused:
        check_supported(text, groups, reports_failures)
    message = str(refused.value)
    if not inside:
        assert vllm_interface.SUPPORTED_RANGE in message and text in message
    else:
        assert "--disable-hybrid-kv-cache-manager" in message and f"has {groups}" in message


def test_the_versions_users_run() -> None:
    check_supported("0.23.0", 1, False)  # vllm-ascend 0.23.0.post1
    check_supported("0.27.1", 1, False)
    check_supported("0.32.0+cpu", 3, True)
    check_supported("0.33.0", 3, True)
    check_supported("0.34.0", 3, True)
    with pytest.raises(UnsupportedVllm, match="0.23.0 to 0.34.x; this is vLLM 0.22.1"):
        check_supported("0.22.1", 1, False)
    with pytest.raises(UnsupportedVllm, match="this is vLLM 0.35.0"):
        check_supported("0.35.0", 1, True)


def test_a_state_model_is_refused_where_failed_reads_are_reported_by_block_id() -> None:
    """vLLM keeps a state model's state in groups of its own: an older vLLM, which maps a
    failed read's blocks in the first group only, would lose the failure."""
    check_supported("0.32.0+cpu", 3, True, state=True)
    with pytest.raises(UnsupportedVllm, match="vLLM 0.27.1 .* hybrid state model .* 0.32"):
        check_supported("0.27.1", 3, False, state=True)


def test_unreadable_version_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedVllm, match="cannot read the vLLM version 'dev'"):
        minor_version("dev")


def test_this_vllm_is_supported() -> None:
    """The vLLM this suite runs on passes, and its receive reporting is the one detected."""
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    vllm_interface.check_this_vllm(None)
    assert vllm_interface.REPORTS_FAILED_RECEIVES == hasattr(base, "KVConnectorTransferResults")
    newer = minor_version(vllm.__version__) >= (0, 32)
    assert vllm_interface.REPORTS_FAILED_RECEIVES == newer
    assert (vllm_interface.p2p_cache_hit_source() is not None) == newer


def test_kv_cache_access_is_declared_where_vllm_asks() -> None:
    """Both back-ends register the KV cache for remote access: REGISTERS where this vLLM
    has KVCacheAccess (0.34), None where it never asks."""
    from vllm.config import kv_transfer

    from hixl_connector.connector.facade import HixlConnector

    access = getattr(kv_transfer, "KVCacheAccess", None)
    expected = None if access is None else access.REGISTERS
    assert HixlConnector.kv_cache_access(None) == expected


def test_readme_names_the_range_the_code_enforces() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"The connector runs on vLLM {vllm_interface.SUPPORTED_RANGE};" in readme
    assert f"hixl_connector supports vLLM {vllm_interface.SUPPORTED_RANGE}; this is" in readme
