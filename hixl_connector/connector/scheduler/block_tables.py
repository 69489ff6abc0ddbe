"""The block tables of the requests P prefills for a remote decode, as vLLM's model runner
keeps them: from each step's scheduler output (a new request's whole table; a running one's
appended blocks; a resumed one's table anew). P's scheduler computes a lease word over a
prompt's blocks in the step that computes the prompt's end, before vLLM hands it the
request's blocks in ``request_finished``.

Where vLLM later drops a block (a sliding window that moved on), its table in
``request_finished`` differs from this one; P then hands out no params (prefill_side).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

BlockTable = tuple[tuple[int, ...], ...]


class BlockTables:
    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}

    def follow(self, request_id: str) -> None:
        self._tables.setdefault(request_id, [])

    def forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def __getitem__(self, request_id: str) -> BlockTable:
        return tuple(tuple(group) for group in self._tables[request_id])

    def update(self, scheduler_output: Any) -> None:
        """Follows one step's allocations of the requests followed."""
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._tables:
                self._tables[new.req_id] = _groups(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = resumed_ids(cached)
        for request_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            table = self._tables.get(request_id)
            if table is None or new_blocks is None:
                continue
            if request_id in resumed:
                self._tables[request_id] = _groups(new_blocks)
            else:
                for group, blocks in zip(table, new_blocks, strict=False):
                    group.extend(blocks)
                table.extend(list(blocks) for blocks in new_blocks[len(table) :])


def resumed_ids(cached: Any) -> set[str]:
    """The cached requests that resumed from preemption this step (their tables anew)."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is not None:
        return set(resumed)
    flags: Iterable[bool] = getattr(cached, "resumed_from_preemption", ())
    return {rid for rid, flag in zip(cached.req_ids, flags, strict=False) if flag}


def _groups(block_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(group) for group in block_ids]
