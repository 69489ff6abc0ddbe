"""The Ascend keys of kv_connector_extra_config, the ready configs/ascend files, and how the
back-end is chosen (no CANN needed)."""

from __future__ import annotations

import importlib.util
import json
import string
from pathlib import Path

import pytest

from hixl_connector.connector.config import HixlConfig
from hixl_connector.datadist.backend import resolve_backend

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "ascend"


def test_ascend_keys_default_and_validate() -> None:
    config = HixlConfig.from_dict({}, "e")
    assert (config.ascend_local_comm_res, config.ascend_hccs) == ("", True)
    hixlcs = HixlConfig.from_dict({"ascend_local_comm_res": '{"version":"1.3"}'}, "e")
    assert hixlcs.ascend_local_comm_res == '{"version":"1.3"}'
    for bad in ("1.3", "[1]", 3):
        with pytest.raises(ValueError, match="ascend_local_comm_res"):
            HixlConfig.from_dict({"ascend_local_comm_res": bad}, "e")
    with pytest.raises(ValueError, match="ascend_hccs"):
        HixlConfig.from_dict({"ascend_hccs": "yes"}, "e")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_ready_configs_validate(path: Path) -> None:
    text = string.Template(path.read_text()).substitute(P_HOST_IP="10.0.0.1", D_HOST_IP="10.0.0.2")
    transfer = json.loads(text)
    config = HixlConfig.from_dict(transfer["kv_connector_extra_config"], "engine")
    assert config.backend == "ascend" and config.engine_port > 0
    assert config.lease_s > config.pull_timeout_s >= 33.0  # CANN's RDMA retry budget
    producer = transfer["kv_role"] == "kv_producer"
    assert config.cluster_id_base == (1024 if producer else 2048)  # distinct for P and D


def test_auto_picks_native_unless_the_kv_cache_is_on_an_npu() -> None:
    assert resolve_backend("auto", "cpu") == "native"
    assert resolve_backend("native", "npu") == "native"
    assert resolve_backend("ascend", "cpu") == "ascend"
    if importlib.util.find_spec("torch_npu") is None:  # then NPU tensors cannot exist here
        assert resolve_backend("auto", "npu") == "native"
    with pytest.raises(ValueError, match="unknown datadist backend"):
        resolve_backend("cuda")
