"""Caches the engine owns (``allocate_cache`` and its kin in the LLM-DataDist v2 API): memory
taken from the pool ``LLMConfig.mem_pool_cfg`` (Placement.DEVICE) or ``host_mem_pool_cfg``
(Placement.HOST) configures. The native engine has no device memory, so both pools are memory
of this process: anonymous mappings, page-aligned, released when their cache is deallocated
and its registration gone."""

from __future__ import annotations

import ctypes
import json
import mmap
from dataclasses import dataclass, field

from hixl_connector.datadist.api.llm_types import CacheDesc, Placement
from hixl_connector.datadist.api.status import LLMException, LLMStatusCode, raise_if_false

POOL_OPTIONS = {Placement.DEVICE: "llm.MemPoolConfig", Placement.HOST: "llm.HostMemPoolConfig"}


def pool_sizes(options: dict[str, str]) -> dict[Placement, int]:
    """The configured pools' sizes in bytes ({"memory_size": N} each)."""
    sizes: dict[Placement, int] = {}
    for placement, key in POOL_OPTIONS.items():
        raw = options.get(key, "")
        if not raw:
            continue
        try:
            size = json.loads(raw)["memory_size"]
        except (ValueError, KeyError, TypeError) as exc:
            raise LLMException(
                f'option {key}={raw!r} must be JSON {{"memory_size": <bytes>}}',
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            ) from exc
        raise_if_false(
            isinstance(size, int) and size > 0, f"{key} memory_size {size!r} must be > 0"
        )
        sizes[placement] = size
    return sizes


@dataclass
class Allocation:
    placement: Placement
    maps: list[mmap.mmap]
    nbytes: int
    keys: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def addrs(self) -> list[int]:
        return [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in self.maps]

    def release(self) -> None:
        for m in self.maps:
            m.close()
        self.maps = []


class Pools:
    """Bytes in use per pool, and the mappings of every allocated cache by its id."""

    def __init__(self, options: dict[str, str]) -> None:
        self._sizes = pool_sizes(options)
        self._used = dict.fromkeys(self._sizes, 0)
        self.allocations: dict[int, Allocation] = {}

    def check_placement(self, desc: CacheDesc) -> None:
        raise_if_false(
            desc.placement in self._sizes,
            "you should config memory pool firstly and then set placement that matches it.",
        )

    def take(self, desc: CacheDesc) -> Allocation:
        """Memory for every tensor of ``desc`` (LLM_OUT_OF_MEMORY when the pool is short)."""
        placement = Placement(desc.placement)
        nbytes = desc.size * desc.num_tensors
        free = self._sizes[placement] - self._used[placement]
        raise_if_false(
            nbytes <= free,
            f"{POOL_OPTIONS[placement]} has {free} bytes free, {nbytes} requested",
            status_code=LLMStatusCode.LLM_OUT_OF_MEMORY,
        )
        maps = [mmap.mmap(-1, max(desc.size, 1)) for _ in range(desc.num_tensors)]
        self._used[placement] += nbytes
        return Allocation(placement, maps, nbytes)

    def give_back(self, allocation: Allocation) -> None:
        """After the allocation's registration is gone: nothing can reach its memory."""
        allocation.release()
        self._used[allocation.placement] -= allocation.nbytes
