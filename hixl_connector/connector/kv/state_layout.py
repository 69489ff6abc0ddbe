"""Where a hybrid state model's states lie in vLLM's KV memory, for the engine.

With the hybrid KV-cache manager, layer i of every KV-cache group lies in one buffer: the
buffer of an attention layer is also, block by block, the pages of a state layer of each state
group (a block id belongs to one group at a time). A state page holds the layer's conv state
from byte 0, then its ssm state, then padding up to the attention page. The buffers are
registered once more in units that make each state whole (``state_groups.state_unit_bytes``),
and, where TP sizes may differ, each rank's slice of it (``state_shards``), so a read names
the state's units of a block and never its padding, nor the attention layout's heads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.mapping.state_groups import (
    StateBytes,
    is_state_spec,
    state_bytes,
    state_unit_bytes,
    state_units,
)
from hixl_connector.connector.mapping.state_shards import (
    CHANNELS_FIRST,
    Shard,
    ShardMismatch,
    StateSlice,
    granule_bytes,
    layer_shards,
    state_nbytes,
    state_slices,
)

# (state group, P's block, D's block) of each state slot a read fills.
StateSlot = tuple[int, int, int]
# (first unit in P's state page, first unit in D's, count) of a slice of a state.
PageRun = tuple[int, int, int]


@dataclass(frozen=True)
class Sharding:
    """How TP divides this engine's states: its TP size, and a Mamba2 model's ``n_groups``
    (the model config's; None for a model without)."""

    tp_size: int = 1
    n_groups: int | None = None


@dataclass(frozen=True)
class StateLayout:
    regions: tuple[int, ...]  # the registered buffers that hold state layers
    page_bytes: int  # one block of a buffer: the attention page, a state page padded
    unit_bytes: int
    group_units: tuple[tuple[int, int], ...]  # (state group, units of its state in a block)
    # Each state layer's block-major view (the state's bytes of every block); never
    # serialised.
    views: tuple[Any, ...]
    # Per state group, what the handshake compares: the state's parts (over the whole
    # engine where TP divides it), dtypes and type.
    described: tuple[str, ...]
    tp_size: int = 1
    # Per state group, its pieces as TP divides them (state_shards); empty, with
    # ``unshardable`` saying why, where the states move between equal TP sizes only.
    shards: tuple[tuple[int, tuple[Shard, ...]], ...] = ()
    unshardable: str = ""

    @property
    def page_units(self) -> int:
        return self.page_bytes // self.unit_bytes

    def units(self, group: int, block: int) -> range:
        """The units of the state of ``group`` in block ``block`` of every region."""
        count = dict(self.group_units).get(group)
        if count is None:
            raise ValueError(f"KV-cache group {group} holds no state")
        return state_units(block, self.page_units, count)

    def slot_units(self, slots: Iterable[tuple[int, int]]) -> list[int]:
        """The units of the states of ``slots``, (group, block) each, in order."""
        return [unit for group, block in slots for unit in self.units(group, block)]

    def page_runs(self, group: int, p_tp: int, d_rank: int) -> dict[int, list[PageRun]]:
        """Per P rank of a P engine of ``p_tp``, where this rank's state of ``group`` lies
        in that rank's state page and in this rank's, counted in units from each page's
        start: the whole state between equal TP sizes, else this rank's slices of P's.
        Raises ShardMismatch where the state cannot move between the two TP sizes."""
        units = dict(self.group_units).get(group)
        if units is None:
            raise ValueError(f"KV-cache group {group} holds no state")
        unit = self.unit_bytes
        runs: dict[int, list[PageRun]] = {}
        for piece in self._slices(units, dict(self.shards).get(group), p_tp, d_rank):
            run = (piece.src // unit, piece.dst // unit, piece.nbytes // unit)
            runs.setdefault(piece.p_rank, []).append(run)
        return runs

    def reads(
        self, slots: Iterable[StateSlot], p_tp: int, p_page_units: int, d_rank: int
    ) -> dict[int, tuple[list[int], list[int]]]:
        """Per P rank, the units of its states and of this rank's they land in, for the state
        slots of a request read from a P engine of ``p_tp`` whose pages are ``p_page_units``
        units (page_runs). Raises ShardMismatch where the states cannot be read between the
        two TP sizes."""
        reads: dict[int, tuple[list[int], list[int]]] = {}
        for group, p_block, d_block in slots:
            for p_rank, runs in self.page_runs(group, p_tp, d_rank).items():
                src, dst = reads.setdefault(p_rank, ([], []))
                for p_first, d_first, count in runs:
                    first_src = p_block * p_page_units + p_first
                    first_dst = d_block * self.page_units + d_first
                    src.extend(range(first_src, first_src + count))
                    dst.extend(range(first_dst, first_dst + count))
        return reads

    def writes(
        self, slots: Iterable[tuple[int, int]], p_tp: int, d_rank: int
    ) -> dict[int, list[tuple[int, int, int, int]]]:
        """Push mode: per P rank, (state group, first unit counted from the start of that
        rank's slot of the group, first unit here, count) of each run it writes into this
        rank's state slots ``slots``, (group, block) each (page_runs). Raises ShardMismatch
        where the states cannot move between the two TP sizes."""
        writes: dict[int, list[tuple[int, int, int, int]]] = {}
        for group, d_block in slots:
            first = d_block * self.page_units
            for p_rank, runs in self.page_runs(group, p_tp, d_rank).items():
                writes.setdefault(p_rank, []).extend(
                    (group, p_first, first + d_first, count) for p_first, d_first, count in runs
                )
        return writes

    def check_tp(self, p_tp: int) -> None:
        """Raises ShardMismatch unless the states can be read from a P engine of ``p_tp``."""
        if p_tp != self.tp_size and self.unshardable:
            raise ShardMismatch(self._undivided(p_tp))
        for _, shards in self.shards:
            for shard in shards:
                shard.per_rank(p_tp)

    def _slices(
        self, units: int, shards: tuple[Shard, ...] | None, p_tp: int, d_rank: int
    ) -> tuple[StateSlice, ...]:
        if p_tp == self.tp_size:
            return (StateSlice(d_rank, 0, 0, units * self.unit_bytes),)
        if shards is None:
            raise ShardMismatch(self._undivided(p_tp))
        return state_slices(shards, p_tp, self.tp_size, d_rank)

    def _undivided(self, p_tp: int) -> str:
        return (
            f"prefill tp_size={p_tp} and decode tp_size={self.tp_size} differ: " + self.unshardable
        )

    def moved_bytes(self, units: int) -> int:
        """The bytes a move of ``units`` of every region carries: the states', no padding."""
        return units * self.unit_bytes * len(self.regions)

    def compatibility_fields(self) -> dict[str, Any]:
        """What P and D must agree on for a state read: each group's state, the conv layout
        and the units the pages are registered in."""
        return {
            "kv_state": list(self.described),
            "kv_state_conv_layout": _conv_state_layout(),
            "kv_state_regions": len(self.regions),
            "kv_state_unit_bytes": self.unit_bytes,
        }


def state_layer_specs(kv_cache_config: Any) -> dict[str, tuple[int, Any]]:
    """Each state layer's name: (its KV-cache group, the group's spec)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return {
        name: (index, group.kv_cache_spec)
        for index, group in enumerate(groups)
        if is_state_spec(group.kv_cache_spec)
        for name in group.layer_names
    }


def describe_state(
    kv_caches: Mapping[str, Any],
    specs: Mapping[str, tuple[int, Any]],
    registered: Sequence[int],
    page_bytes: int,
    sharding: Sharding | None = None,
) -> StateLayout | None:
    """The state layers of ``kv_caches`` (``specs``: state_layer_specs), each in a buffer
    of ``registered`` (the attention layers' bases) whose pages are ``page_bytes``; None for a
    model without state. Refuses a state the engine cannot move whole."""
    if not specs:
        return None
    sharding = sharding or Sharding()
    parts: dict[int, StateBytes] = {}
    group_specs: dict[int, Any] = {}
    regions: list[int] = []
    views = []
    for name, (group, spec) in specs.items():
        sizes = [int(getattr(dtype, "itemsize", 0)) for dtype in spec.dtypes]
        layer = state_bytes([tuple(shape) for shape in spec.shapes], sizes)
        parts[group], group_specs[group] = layer, spec
        view = _state_view(name, kv_caches[name], layer, page_bytes)
        base = int(view.data_ptr())
        if base not in registered:
            raise ValueError(
                f"state layer {name} lies in no buffer of an attention layer; the connector "
                "moves state only beside attention (a hybrid model, hybrid KV-cache manager on)"
            )
        if base not in regions:
            regions.append(base)
        views.append(view)
    shards, unshardable = _shards(group_specs, parts, sharding)
    pieces_of = dict(shards)
    unit = state_unit_bytes(page_bytes, [layer.nbytes for layer in parts.values()])
    unit = math.gcd(unit, *(granule_bytes(pieces) for pieces in pieces_of.values()))
    return StateLayout(
        regions=tuple(sorted(regions, key=list(registered).index)),
        page_bytes=page_bytes,
        unit_bytes=unit,
        group_units=tuple((g, layer.nbytes // unit) for g, layer in sorted(parts.items())),
        views=tuple(views),
        described=tuple(_describe(group_specs[g], pieces_of.get(g)) for g in sorted(group_specs)),
        tp_size=sharding.tp_size,
        shards=shards,
        unshardable=unshardable,
    )


def _shards(
    specs: Mapping[int, Any], parts: Mapping[int, StateBytes], sharding: Sharding
) -> tuple[tuple[tuple[int, tuple[Shard, ...]], ...], str]:
    """Each state group's pieces as TP divides them, or none and why not."""
    layout = _conv_state_layout()
    if layout != CHANNELS_FIRST:
        return (), (
            f"the conv state layout is {layout}, in which the TP ranks' channels interleave; "
            f"set VLLM_SSM_CONV_STATE_LAYOUT={CHANNELS_FIRST} on prefill and decode"
        )
    shards = []
    for group, spec in sorted(specs.items()):
        kind = str(getattr(spec.mamba_type, "name", spec.mamba_type))
        try:
            if len(spec.shapes) != 2:
                raise ShardMismatch(f"a {kind} state of {len(spec.shapes)} parts")
            sizes = (int(spec.dtypes[0].itemsize), int(spec.dtypes[1].itemsize))
            conv, ssm = spec.shapes
            pieces = layer_shards(kind, conv, ssm, sizes, sharding.tp_size, sharding.n_groups)
            if state_nbytes(pieces, sharding.tp_size) != parts[group].nbytes:
                raise ShardMismatch(f"a {kind} state of {parts[group].parts} bytes")
        except ShardMismatch as e:
            return (), f"{e}; such a state moves between equal TP sizes only"
        shards.append((group, pieces))
    return tuple(shards), ""


def model_n_groups(hf_config: Any) -> int | None:
    """A Mamba2 model's ``n_groups``, by the names its configs give it; None without."""
    for name in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


def _describe(spec: Any, shards: tuple[Shard, ...] | None) -> str:
    """What P and D must agree on of a state group: its type, its parts over the whole
    engine where TP divides them (else this rank's shapes), dtypes and slots."""
    kind = getattr(spec.mamba_type, "name", spec.mamba_type)
    parts = (
        [[s.item_bytes, s.items, s.replicated] for s in shards]
        if shards is not None
        else [list(shape) for shape in spec.shapes]
    )
    return (
        f"{kind}:{parts}:{[str(d) for d in spec.dtypes]}:"
        f"{spec.mamba_cache_mode}:{spec.num_speculative_blocks}"
    )


def _state_view(name: str, entry: Any, layer: StateBytes, page_bytes: int) -> Any:
    """The layer's state as a block-major view of ``layer.nbytes`` bytes a block, pages of
    ``page_bytes`` apart: vLLM hands over one such view, or its parts (conv, ssm) each a view
    of the same pages."""
    first = entry[0] if isinstance(entry, (tuple, list)) else entry
    stride = int(first.stride(0)) * int(first.element_size())
    block = int(first[0].numel()) * int(first.element_size())
    whole = not isinstance(entry, (tuple, list)) and block == layer.nbytes
    split = isinstance(entry, (tuple, list)) and block == layer.parts[0]
    if stride != page_bytes or not (whole or split):
        raise ValueError(
            f"state layer {name}: {block} bytes a block, {stride} apart; expected the state's "
            f"{layer.parts} bytes at the start of pages of {page_bytes} bytes"
        )
    import torch

    # The layer's pages as bytes: [num_blocks, state bytes], page_bytes apart.
    storage = first.untyped_storage()
    offset = int(first.data_ptr()) - int(storage.data_ptr())
    as_bytes = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return as_bytes.as_strided((int(first.shape[0]), layer.nbytes), (page_bytes, 1), offset)


def _conv_state_layout() -> str:
    """vLLM's conv state layout (SD or DS; VLLM_SSM_CONV_STATE_LAYOUT): it orders the
    bytes of every conv state."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:  # a vLLM that has one layout
        return "SD"
    return str(get_conv_state_layout())
