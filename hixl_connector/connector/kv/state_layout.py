"""Where a hybrid state model's states lie in vLLM's KV memory, for the engine.

With the hybrid KV-cache manager, layer i of every KV-cache group lies in one buffer (a block
id belongs to one group at a time), and a state layer's block is its conv state, then its ssm
state. Platforms place them differently in that buffer:
- vLLM (CPU, GPU): in pages of the attention page's size, block by block: conv state from the
  page's byte 0, then ssm state, then padding;
- vllm-ascend (0.16 and later): in planes: all blocks' conv states from the buffer's byte 0,
  then all their ssm states (the same bytes as the attention layers' K), then V.
Each buffer is registered once more, from the state's first byte, in units that make each
part whole (``StatePart``), and, where TP sizes may differ, each rank's slice of it
(``state_shards``): a read names the state's units of a block and never padding, another
block's state or the attention layout's heads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.mapping.state_groups import (
    StateBytes,
    StatePart,
    block_units,
    is_state_spec,
    placed_runs,
    placed_units,
    state_bytes,
    state_length,
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
# (first unit of P's state, first unit of D's, count), counted from each state's start.
ShardRun = tuple[int, int, int]
# Each state group's parts: (group, its StateParts).
GroupParts = tuple[tuple[int, tuple[StatePart, ...]], ...]
# (offset from the state's first byte, stride between blocks, bytes a block) of a part.
BytePart = tuple[int, int, int]


@dataclass(frozen=True)
class AttentionTensors:
    """The attention layers' registered tensors, in registration order: their bases, their
    bytes a block, and how many make a layer."""

    addrs: tuple[int, ...]
    block_bytes: tuple[int, ...]
    per_layer: int


@dataclass(frozen=True)
class Sharding:
    """How TP divides this engine's states: its TP size, and a Mamba2 model's ``n_groups``
    (the model config's; None for a model without)."""

    tp_size: int = 1
    n_groups: int | None = None


@dataclass(frozen=True)
class StateLayout:
    regions: tuple[int, ...]  # where each registered buffer's states begin, in layer order
    region_units: int  # the units each region registers
    unit_bytes: int
    group_parts: GroupParts  # where each state group's state of a block lies (StatePart)
    # Each state layer's parts as block-major byte views ([num_blocks, part bytes]); never
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
    # Where an attention block's KV (the layer's tensors, K then V) lies in a region, where
    # it lies in the states' buffers beside them (vllm-ascend's planes): it is then read
    # through the regions and not registered on its own. Empty on vLLM's pages.
    kv_parts: tuple[StatePart, ...] = ()

    @property
    def group_units(self) -> tuple[tuple[int, int], ...]:
        """(state group, units of its state in a block)."""
        return tuple((group, state_length(parts)) for group, parts in self.group_parts)

    def parts(self, group: int) -> tuple[StatePart, ...]:
        parts = dict(self.group_parts).get(group)
        if parts is None:
            raise ValueError(f"KV-cache group {group} holds no state")
        return parts

    def units(self, group: int, block: int) -> list[int]:
        """The units of the state of ``group`` in block ``block`` of every region, in state
        order."""
        return block_units(self.parts(group), [block])

    def slot_units(self, slots: Iterable[tuple[int, int]]) -> list[int]:
        """The units of the states of ``slots``, (group, block) each, in order."""
        return [unit for group, block in slots for unit in self.units(group, block)]

    def shard_runs(self, group: int, p_tp: int, d_rank: int) -> dict[int, list[ShardRun]]:
        """Per P rank of a P engine of ``p_tp``, where this rank's state of ``group`` lies
        in that rank's state and in this rank's, counted in units from each state's start:
        the whole state between equal TP sizes, else this rank's slices of P's. Raises
        ShardMismatch where the state cannot move between the two TP sizes."""
        units = state_length(self.parts(group))
        unit = self.unit_bytes
        runs: dict[int, list[ShardRun]] = {}
        for piece in self._slices(units, dict(self.shards).get(group), p_tp, d_rank):
            run = (piece.src // unit, piece.dst // unit, piece.nbytes // unit)
            runs.setdefault(piece.p_rank, []).append(run)
        return runs

    def reads(
        self,
        slots: Iterable[StateSlot],
        p_tp: int,
        p_parts: Mapping[int, Sequence[StatePart]],
        d_rank: int,
    ) -> dict[int, tuple[list[int], list[int]]]:
        """Per P rank, the units of its states and of this rank's they land in, for the state
        slots of a request read from a P engine of ``p_tp`` whose states lie in ``p_parts``
        (per group, from its handshake; shard_runs). Raises ShardMismatch where the states
        cannot be read between the two TP sizes, ValueError where P's parts do not hold them."""
        reads: dict[int, tuple[list[int], list[int]]] = {}
        for group, p_block, d_block in slots:
            theirs, ours = p_parts.get(group), self.parts(group)
            if theirs is None:
                raise ValueError(f"the prefill engine holds no state of KV-cache group {group}")
            for p_rank, runs in self.shard_runs(group, p_tp, d_rank).items():
                src, dst = reads.setdefault(p_rank, ([], []))
                for p_first, d_first, count in runs:
                    src.extend(placed_units(theirs, p_block, p_first, count))
                    dst.extend(placed_units(ours, d_block, d_first, count))
        return reads

    def writes(
        self, slots: Iterable[tuple[int, int]], p_tp: int, d_rank: int
    ) -> dict[int, list[tuple[int, int, int, int]]]:
        """Push mode: per P rank, (state group, first unit counted from the start of that
        rank's state of the group, first unit here, count) of each run it writes into this
        rank's state slots ``slots``, (group, block) each (shard_runs), a run for each of
        this rank's parts it lands in. Raises ShardMismatch where the states cannot move
        between the two TP sizes."""
        writes: dict[int, list[tuple[int, int, int, int]]] = {}
        for group, d_block in slots:
            ours = self.parts(group)
            for p_rank, runs in self.shard_runs(group, p_tp, d_rank).items():
                out = writes.setdefault(p_rank, [])
                for p_first, d_first, count in runs:
                    for first, n in placed_runs(ours, d_block, d_first, count):
                        out.append((group, p_first, first, n))
                        p_first += n
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
        and the units the states are registered in (where they lie is each side's own: the
        handshake's ``state_parts``)."""
        return {
            "kv_state": list(self.described),
            "kv_state_conv_layout": _conv_state_layout(),
            "kv_state_regions": len(self.regions),
            "kv_state_unit_bytes": self.unit_bytes,
            "kv_state_planes": bool(self.kv_parts),
        }


def state_without_kv(p_rank: int, engine_id: str) -> str:
    """Why a D rank cannot take its state from P rank ``p_rank``: it takes none of that rank's
    KV heads (KV heads replicated over TP ranks), so it holds no lease or grant there."""
    return (
        f"this rank's state lies on prefill rank {p_rank} of engine {engine_id}, whose KV it "
        "does not take (KV heads replicated over TP ranks): run TP sizes whose KV heads and "
        "states divide alike"
    )


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
    attention: AttentionTensors,
    num_blocks: int,
    sharding: Sharding | None = None,
) -> StateLayout | None:
    """The state layers of ``kv_caches`` (``specs``: state_layer_specs) of ``num_blocks``
    blocks, each in a buffer of an attention layer (``attention``: the registered tensors);
    None for a model without state. Refuses a state the engine cannot move whole."""
    if not specs:
        return None
    sharding = sharding or Sharding()
    parts: dict[int, StateBytes] = {}
    group_specs: dict[int, Any] = {}
    placed: dict[int, tuple[BytePart, ...]] = {}
    extents: dict[int, int] = {}  # the base of each buffer's states: bytes they reach
    order: dict[int, int] = {}  # the base of each buffer's states: its first attention layer
    beside: dict[int, tuple[BytePart, ...]] = {}  # ... and the KV in it, on planes
    views: list[Any] = []
    for name, (group, spec) in specs.items():
        sizes = [int(getattr(dtype, "itemsize", 0)) for dtype in spec.dtypes]
        layer = state_bytes([tuple(shape) for shape in spec.shapes], sizes)
        parts[group], group_specs[group] = layer, spec
        tensors = _state_tensors(kv_caches[name])
        base, byte_parts, extent = _placed(name, tensors, layer, num_blocks)
        _check_memory(name, tensors, base, extent)
        if placed.setdefault(group, byte_parts) != byte_parts:
            raise ValueError(
                f"state layer {name} lies in its buffer as {byte_parts} (offset, stride, bytes), "
                f"another layer of KV-cache group {group} as {placed[group]}"
            )
        order[base], beside[base] = _anchor(name, base, extent, attention)
        extents[base] = max(
            extents.get(base, 0), extent, *(o + s * num_blocks for o, s, _ in beside[base])
        )
        _check_memory(name, tensors, base, extents[base])
        views.extend(_byte_view(tensor) for tensor in tensors)
    if len(set(beside.values())) != 1:
        raise ValueError(
            f"the attention layers lie in the states' buffers as {sorted(set(beside.values()))} "
            "(offset, stride, bytes); the connector registers every such buffer alike"
        )
    kv_parts = beside.popitem()[1]
    if len(set(extents.values())) != 1:
        raise ValueError(
            f"the buffers that hold state layers reach {sorted(set(extents.values()))} bytes; "
            "the connector registers every such buffer alike"
        )
    extent = extents.popitem()[1]
    shards, unshardable = _shards(group_specs, parts, sharding)
    pieces_of = dict(shards)
    numbers = [
        n for byte_parts in (*placed.values(), kv_parts) for part in byte_parts for n in part
    ]
    unit = math.gcd(extent, *numbers, *(granule_bytes(pieces) for pieces in pieces_of.values()))
    return StateLayout(
        regions=tuple(sorted(order, key=order.__getitem__)),
        region_units=extent // unit,
        unit_bytes=unit,
        group_parts=tuple(
            (g, tuple(StatePart(o // unit, s // unit, n // unit) for o, s, n in placed[g]))
            for g in sorted(placed)
        ),
        views=tuple(views),
        described=tuple(_describe(group_specs[g], pieces_of.get(g)) for g in sorted(group_specs)),
        tp_size=sharding.tp_size,
        shards=shards,
        unshardable=unshardable,
        kv_parts=tuple(StatePart(o // unit, s // unit, n // unit) for o, s, n in kv_parts),
    )


def _state_tensors(entry: Any) -> list[Any]:
    """A state layer's tensors: vLLM hands over one view of the whole state, or its parts
    (conv, ssm)."""
    return list(entry) if isinstance(entry, (tuple, list)) else [entry]


def _placed(
    name: str, tensors: Sequence[Any], layer: StateBytes, num_blocks: int
) -> tuple[int, tuple[BytePart, ...], int]:
    """Where a state layer lies: the address of its first byte, its parts from there
    (adjacent tensors of one stride merged: a block's state contiguous in a page is one
    part), and the bytes its blocks reach from that address."""
    found = []
    for tensor in tensors:
        shape, size = list(tensor.shape), int(tensor.element_size())
        if not shape or int(shape[0]) != num_blocks or not tensor[0].is_contiguous():
            raise ValueError(
                f"state layer {name}: a part of shape {shape} and strides "
                f"{list(tensor.stride())} is not {num_blocks} blocks of contiguous bytes"
            )
        found.append(
            (int(tensor.data_ptr()), int(tensor.stride(0)) * size, tensor[0].numel() * size)
        )
    sizes = tuple(nbytes for _, _, nbytes in found)
    if sizes not in (layer.parts, (layer.nbytes,)):
        raise ValueError(
            f"state layer {name}: parts of {list(sizes)} bytes a block; its MambaSpec's shapes "
            f"and dtypes make {list(layer.parts)}"
        )
    base = min(address for address, _, _ in found)
    merged: list[BytePart] = []
    for address, stride, nbytes in found:
        offset = address - base
        if merged and merged[-1][1] == stride and sum(merged[-1][::2]) == offset:
            merged[-1] = (merged[-1][0], stride, merged[-1][2] + nbytes)
        else:
            merged.append((offset, stride, nbytes))
    for _offset, stride, nbytes in merged:
        if stride < nbytes:
            raise ValueError(
                f"state layer {name}: blocks of {nbytes} bytes only {stride} bytes apart"
            )
    extent = max(offset + (num_blocks - 1) * stride + nbytes for offset, stride, nbytes in merged)
    return base, tuple(merged), extent


def _check_memory(name: str, tensors: Sequence[Any], base: int, extent: int) -> None:
    """The bytes registered for state layer ``name``'s buffer are memory its tensors lie in:
    nothing outside what vLLM allocated is ever read or written."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = int(storage.data_ptr())
        if not start <= base <= base + extent <= start + int(storage.nbytes()):
            raise ValueError(
                f"state layer {name}: its buffer's states and KV reach bytes {base:#x} to "
                f"{base + extent:#x}, beyond the memory they lie in"
            )


def _anchor(
    name: str, base: int, extent: int, attention: AttentionTensors
) -> tuple[int, tuple[BytePart, ...]]:
    """The first attention tensor in the buffer state layer ``name``, at ``base``, lies in
    (regions follow the layers' order on both sides), and where that layer's KV lies from
    ``base``: nowhere where it starts there (vLLM's pages: it registers on its own), else in
    planes beside the states (vllm-ascend)."""
    for index, address in enumerate(attention.addrs):
        if base <= address < base + extent:
            first = index - index % attention.per_layer
            layer = range(first, first + attention.per_layer)
            if attention.addrs[first] == base:
                return index, ()
            return index, tuple(
                (attention.addrs[i] - base, attention.block_bytes[i], attention.block_bytes[i])
                for i in layer
            )
    raise ValueError(
        f"state layer {name} lies in no buffer of an attention layer; the connector moves "
        "state only beside attention (a hybrid model, hybrid KV-cache manager on)"
    )


def _byte_view(tensor: Any) -> Any:
    """``tensor``'s blocks as bytes: [num_blocks, block bytes], its blocks' stride apart."""
    import torch

    storage = tensor.untyped_storage()
    offset = int(tensor.data_ptr()) - int(storage.data_ptr())
    size = int(tensor.element_size())
    as_bytes = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    shape = (int(tensor.shape[0]), int(tensor[0].numel()) * size)
    return as_bytes.as_strided(shape, (int(tensor.stride(0)) * size, 1), offset)


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


def _conv_state_layout() -> str:
    """vLLM's conv state layout (SD or DS; VLLM_SSM_CONV_STATE_LAYOUT): it orders the
    bytes of every conv state."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    except ImportError:  # a vLLM that has one layout
        return "SD"
    return str(get_conv_state_layout())
