"""The "ascend" backend: CANN's own ``llm_datadist`` package with its HIXL transfer back-end.

The only module that imports ``llm_datadist`` and ``torch_npu``. Everything the API offers is
CANN's, except project adaptations: ``LLMConfig``, ``LLMDataDist`` and its ``cache_manager``
carry the project's checks where CANN silently accepts a mistake (``checked_classes.py``;
``init`` also drops the native engine's ``hixl.*`` option keys), and
``pull_blocks_batch_async`` is emulated by calling ``pull_blocks`` for each pull in turn on a
thread (CANN has neither a batch nor an asynchronous pull).

It also states what the connector must respect on Ascend (``ASCEND_PROFILE``, consulted by
``hixl_connector.connector.kv.registered_kv``): the KV cache is in NPU memory and registers
as ``Placement.DEVICE`` (a KV cache in host memory is refused: HCCS carries none, and RoCE
only ``aclrtMallocHost`` memory), the device id is the one holding it, HCCS wants 2 MB-aligned
bases, and one ``pull_blocks`` request must fit CANN's request buffer (reference section 6.2),
so long block lists are pulled in chunks.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hixl_connector.datadist.api.llm_types import BlocksPull
from hixl_connector.datadist.api.pull_handle import ThreadPullHandle
from hixl_connector.datadist.ascend.checked_classes import checked_classes
from hixl_connector.datadist.profile import Backend, BackendProfile

API_NAMES = (
    "LLMDataDist",
    "LLMConfig",
    "LlmConfig",
    "LLMRole",
    "LLMClusterInfo",
    "LLMStatusCode",
    "LLMException",
    "Status",
    "DataType",
    "CacheDesc",
    "Cache",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
    "Placement",
    "Memtype",
    "RegisterMemStatus",
)

# CANN's pull_blocks request: ~header + 16 B x (dst tensors + 2 x runs), at most 2 MiB with
# enable_remote_cache_accessible (which the hixl back-end forces), 112 KiB without it.
REQUEST_LIMIT_BYTES = 2 * 1024 * 1024
REQUEST_LIMIT_BYTES_NOT_ACCESSIBLE = 112 * 1024
REQUEST_ENTRY_BYTES = 16
# The header's exact size is not published; this leaves a wide margin for it.
REQUEST_HEADER_RESERVE_BYTES = 4096
HCCS_ALIGNMENT_BYTES = 2 * 1024 * 1024


class BackendUnavailableError(ImportError):
    """The requested backend's packages cannot be imported here."""


def import_cann() -> Any:
    try:
        return importlib.import_module("llm_datadist")
    except ImportError as exc:
        raise BackendUnavailableError(
            "the 'ascend' datadist backend needs CANN's `llm_datadist` package (shipped with the "
            f"CANN toolkit, used with torch_npu); it cannot be imported here: {exc}"
        ) from exc


def _torch_npu() -> Any | None:
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # any failure to import means "no NPU runtime here"
        return None


def ascend_available() -> bool:
    """True when both torch_npu and llm_datadist import."""
    if _torch_npu() is None:
        return False
    try:
        importlib.import_module("llm_datadist")
    except Exception:
        return False
    return True


def max_pairs_per_pull(num_tensors: int, limit_bytes: int = REQUEST_LIMIT_BYTES) -> int:
    """Most (src, dst) pairs one pull_blocks request may carry, assuming no pair merges with
    its neighbour (every pair its own run): the worst case, so any list of that length fits."""
    room = limit_bytes - REQUEST_HEADER_RESERVE_BYTES - REQUEST_ENTRY_BYTES * num_tensors
    pairs = room // (2 * REQUEST_ENTRY_BYTES)
    if pairs < 1:
        raise ValueError(
            f"{num_tensors} KV tensors leave no room for block pairs in a pull_blocks request "
            f"of {limit_bytes} bytes"
        )
    return pairs


def device_id_of(tensor: Any) -> int:
    """The device that holds ``tensor``; for host tensors, the process's current NPU (0 when
    no NPU runtime is present, as with host memory only)."""
    index = getattr(tensor.device, "index", None)
    if tensor.device.type != "cpu" and index is not None:
        return int(index)
    torch_npu = _torch_npu()
    if torch_npu is not None:
        return int(torch_npu.npu.current_device())
    return 0


def check_hccs_alignment(addrs: list[int], what: str) -> None:
    """HCCS reads device memory only from 2 MB-aligned bases (reference section 8, rule 5)."""
    misaligned = [addr for addr in addrs if addr % HCCS_ALIGNMENT_BYTES]
    if misaligned:
        raise ValueError(
            f"{what}: {len(misaligned)} of {len(addrs)} KV tensor bases are not 2 MB aligned "
            f"(first: {misaligned[0]:#x}); HCCS transfers need 2 MB-aligned device memory. "
            "Allocate the KV cache 2 MB aligned, or set kv_connector_extra_config "
            "'ascend_hccs': false when P and D are linked over RoCE only"
        )


def npu_memory(device: Any) -> bool:
    if device.type == "npu":
        return True
    raise ValueError(
        f"the 'ascend' datadist back-end moves a KV cache in NPU memory (HCCS carries no host "
        f"memory, RoCE only aclrtMallocHost memory), but this one lives on {device}; use "
        "kv_connector_extra_config 'backend': 'native' for a KV cache in host memory"
    )


def played_npu_memory(device: Any) -> bool:
    """Under the project's stand-in for CANN (``tests/ascend_standin``: no NPU), host tensors
    play NPU memory, as the stand-in plays device memory with host memory."""
    return device.type == "cpu" or npu_memory(device)


def describe_link(datadist: Any, remote_cluster_id: int) -> str:
    """CANN does not say which fabric a link took; the stand-in names its link mode."""
    mode = getattr(datadist, "fabric", None)
    if mode is not None:
        return f"stand-in for CANN (no NPU), link mode {mode}"
    return "CANN HIXL: HCCS within a server (A2) or supernode (A3), RoCE beyond"


ASCEND_PROFILE = BackendProfile(
    name="ascend",
    registers_as_device=npu_memory,
    transfer_backend="hixl",
    native_options=False,
    device_id_of=device_id_of,
    check_device_alignment=check_hccs_alignment,
    max_pairs_per_pull=max_pairs_per_pull,
    describe_link=describe_link,
)


def pull_blocks_batch_async(cache_manager: Any, pulls: Sequence[BlocksPull]) -> ThreadPullHandle:
    def run() -> None:
        for pull in pulls:
            cache_manager.pull_blocks(
                pull.src_cache_key, pull.dst_cache, pull.src_blocks, pull.dst_blocks, **pull.kwargs
            )

    return ThreadPullHandle(run)


def load() -> Backend:
    cann = import_cann()
    names = {name: getattr(cann, name) for name in API_NAMES if hasattr(cann, name)}
    standin = getattr(cann, "STANDIN", False)  # CANN's package has no such mark
    return Backend(
        BACKEND_NAME="ascend",
        PROFILE=replace(ASCEND_PROFILE, registers_as_device=played_npu_memory)
        if standin
        else ASCEND_PROFILE,
        pull_blocks_batch_async=pull_blocks_batch_async,
        **{**names, **checked_classes(cann)},
    )
