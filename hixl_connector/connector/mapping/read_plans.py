"""What a decode rank reads of a prefill engine, worked out once per P shape: which P ranks
and KV heads (by P's TP size, `tp_mapping`), and where P's slices land in this rank's blocks
(by P's block size, `block_slices` with the slice runs probed from the CPU kernels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.mapping.block_slices import SliceRun
from hixl_connector.connector.mapping.tp_mapping import (
    HeadRead,
    RankPlan,
    TPMismatch,
    check_shardable,
    plan_rank,
)


class UnreadableRequest(ValueError):
    """The request's blocks cannot be read from this peer (block sizes, layout): nothing is
    read, the link stays good."""


class ReadPlans:
    """What this rank reads of a P engine, worked out once per P shape: which P ranks and
    heads (by P's TP size), and where P's slices land (by P's block size)."""

    def __init__(
        self,
        compatibility: dict[str, Any],
        tp: tuple[int, int],
        probe: Callable[[int], tuple[SliceRun, ...]],
    ) -> None:
        self._split = compatibility["kv_split"]
        self._kv_layout = compatibility["kv_layout"]
        self._num_kv_heads = compatibility["num_kv_heads"]
        self._tp_rank, self._tp_size = tp
        self._probe = probe
        self._plans: dict[int, RankPlan] = {}  # P's tp_size -> this rank's reads
        self._runs: dict[int, tuple[SliceRun, ...]] = {}  # P's block size -> slice runs

    @property
    def tp_size(self) -> int:
        """This engine's TP size."""
        return self._tp_size

    def rank_plan(self, p_tp: int) -> RankPlan:
        """Which P ranks this rank reads (and which heads), for a P engine of TP ``p_tp``;
        raises TPMismatch when the sizes cannot be mapped."""
        plan = self._plans.get(p_tp)
        if plan is None:
            heads, split = self._num_kv_heads, self._split
            check_shardable(split, self._kv_layout, heads, p_tp, self._tp_size)
            if split == "none":  # whole blocks, from the rank of the same index
                r = self._tp_rank
                plan = RankPlan((HeadRead(r, 0, 0, 1),), (r,), {r: 1})
            else:
                replicated = split == "replicated"
                plan = plan_rank(heads, p_tp, self._tp_size, self._tp_rank, replicated)
            self._plans[p_tp] = plan
        return plan

    def notify_targets(self, remote: RemoteEndpoint) -> dict[int, int]:
        """P rank -> distinct D ranks it waits for, for every P rank this rank notifies.

        When the TP sizes cannot be mapped, every D rank tells every P rank, so P still frees.
        """
        try:
            return self.rank_plan(remote.tp_size).consumers
        except TPMismatch:
            return dict.fromkeys(range(remote.tp_size), self._tp_size)

    def slice_runs(self, p_block_size: int) -> tuple[SliceRun, ...]:
        runs = self._runs.get(p_block_size)
        if runs is None:
            try:
                runs = self._probe(p_block_size)
            except ValueError as e:
                raise UnreadableRequest(str(e)) from None
            self._runs[p_block_size] = runs
        return runs
