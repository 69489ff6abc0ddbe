"""The stand-in's fabric: which memory each registered cache is, and what an Ascend link mode
lets a link and a pull do with it (``ascend_memory_rules.md`` in the project's references).

Not CANN: the hardware knows each buffer's memory kind; here every buffer is host memory, so
a registration's ``Placement`` is taken at its word, and host memory counts as
``aclrtMallocHost`` memory only when it came from ``malloc_host`` below. Each engine writes
its registrations to a small table file that its peers read when they link (the hardware
learns the peer's memory during the link), so a rule can see both sides.

The link mode comes from ``HIXL_STANDIN_FABRIC`` (read at ``init``):

- ``hccs-a2``: device to device only; device bases 2 MB aligned, else the link fails;
- ``hccs-a3``: also a local host buffer to or from remote device memory, never remote host
  memory; device bases 2 MB aligned, else the link fails;
- ``roce``: every direction; registered host memory that did not come from
  ``aclrtMallocHost`` fails the link.

In every mode a pull between host and device memory needs a device memory pool of at least
100 MB (``LLMConfig.mem_pool_cfg``), else it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .status import LLMStatusCode

FABRIC_ENV = "HIXL_STANDIN_FABRIC"
TABLE_DIR_ENV = "HIXL_STANDIN_TABLE_DIR"
MODES = ("hccs-a2", "hccs-a3", "roce")
DEFAULT_MODE = "hccs-a2"  # the strictest: what passes here passes on every fabric
HCCS_ALIGNMENT_BYTES = 2 * 1024 * 1024
MIN_POOL_BYTES = 100 * 1024 * 1024

_pinned_lock = threading.Lock()
_pinned: dict[int, np.ndarray] = {}  # base address -> the memory malloc_host handed out


def mode() -> str:
    value = os.environ.get(FABRIC_ENV, DEFAULT_MODE)
    if value not in MODES:
        raise ValueError(f"{FABRIC_ENV}={value!r}: the stand-in's link modes are {MODES}")
    return value


def malloc_host(nbytes: int) -> np.ndarray:
    """STAND-IN for ``aclrtMallocHost``: page-locked host memory, the only host memory RoCE
    links. Keep the array alive while it is registered; ``free_host`` releases it."""
    memory = np.zeros(nbytes, np.uint8)
    with _pinned_lock:
        _pinned[memory.ctypes.data] = memory
    return memory


def free_host(memory: np.ndarray) -> None:
    with _pinned_lock:
        _pinned.pop(memory.ctypes.data, None)


def _is_pinned(addr: int, nbytes: int) -> bool:
    with _pinned_lock:
        return any(
            base <= addr and addr + nbytes <= base + memory.nbytes
            for base, memory in _pinned.items()
        )


@dataclass(frozen=True)
class Memory:
    """What the fabric knows of one registered cache."""

    device: bool  # registered as Placement.DEVICE
    aligned: bool  # every base 2 MB aligned
    pinned: bool  # host memory, all of it from aclrtMallocHost

    def describe(self) -> str:
        if self.device:
            return "device memory" + ("" if self.aligned else " at a base not 2 MB aligned")
        return "host memory" + (" from aclrtMallocHost" if self.pinned else " (plain)")


def memory_of(device: bool, addrs: list[int], tensor_bytes: int) -> Memory:
    return Memory(
        device=device,
        aligned=all(addr % HCCS_ALIGNMENT_BYTES == 0 for addr in addrs),
        pinned=not device and all(_is_pinned(addr, tensor_bytes) for addr in addrs),
    )


def pool_bytes(options: dict[str, str]) -> int:
    """The device pool ``llm.MemPoolConfig`` configures ({"memory_size": bytes}), 0 if none."""
    text = options.get("llm.MemPoolConfig")
    if not text:
        return 0
    try:
        return int(json.loads(text).get("memory_size", 0))
    except (ValueError, AttributeError):
        return 0


def link_refusal(link_mode: str, memories: list[Memory]) -> str | None:
    """Why a link between engines that registered ``memories`` (both sides) fails, if it does."""
    for memory in memories:
        if link_mode.startswith("hccs") and memory.device and not memory.aligned:
            return f"{link_mode}: {memory.describe()} (HCCS needs 2 MB-aligned device bases)"
        if link_mode == "roce" and not memory.device and not memory.pinned:
            return f"roce: {memory.describe()} is registered (RDMA links aclrtMallocHost memory)"
    return None


def pull_refusal(
    link_mode: str, remote: Memory, local: Memory, pool: int
) -> tuple[LLMStatusCode, str] | None:
    """Why reading ``remote`` memory into ``local`` memory fails, if it does."""
    route = f"{remote.describe()} of the peer into {local.describe()}"
    if link_mode == "hccs-a2" and not (remote.device and local.device):
        return (
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            f"hccs-a2 moves device to device only: {route}",
        )
    if link_mode == "hccs-a3" and not remote.device:
        return (
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            f"hccs-a3 moves no remote host memory: {route}",
        )
    if remote.device != local.device and pool < MIN_POOL_BYTES:
        return (
            LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            f"a pull between host and device needs a device memory pool of at least 100 MB "
            f"(mem_pool_cfg; configured: {pool} bytes): {route}",
        )
    return None


def _table_dir() -> Path:
    configured = os.environ.get(TABLE_DIR_ENV)
    path = (
        Path(configured)
        if configured
        else Path(tempfile.gettempdir()) / f"hixl-standin-fabric-{os.getuid()}"
    )
    path.mkdir(parents=True, exist_ok=True)
    return path


class Table:
    """This engine's registrations as its peers see them: a file per cluster id."""

    def __init__(self, cluster_id: int) -> None:
        self._path = _table_dir() / f"{cluster_id}.json"
        self._by_model: dict[int, Memory] = {}

    def add(self, model_id: int, memory: Memory) -> None:
        self._by_model[model_id] = memory
        body = {"pid": os.getpid(), "caches": {m: asdict(v) for m, v in self._by_model.items()}}
        partial = self._path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(body))
        partial.replace(self._path)  # a reader sees the old table or the new one

    def memories(self) -> list[Memory]:
        return list(self._by_model.values())

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            if json.loads(self._path.read_text()).get("pid") == os.getpid():
                self._path.unlink()


def peer_table(cluster_id: int) -> dict[int, Memory] | None:
    """The registrations of the live engine under ``cluster_id``; None if there is none."""
    try:
        body: dict[str, Any] = json.loads((_table_dir() / f"{cluster_id}.json").read_text())
        os.kill(int(body["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return None
    return {int(m): Memory(**v) for m, v in body["caches"].items()}
