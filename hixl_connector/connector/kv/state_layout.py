"""Where a hybrid state model's states lie in vLLM's KV memory, for the engine.

With the hybrid KV-cache manager, layer i of every KV-cache group lies in one buffer: the
buffer of an attention layer is also, block by block, the pages of a state layer of each state
group (a block id belongs to one group at a time). A state page holds the layer's conv state
from byte 0, then its ssm state, then padding up to the attention page. The buffers are
registered once more in units that make each state whole (``state_groups.state_unit_bytes``),
so a read names the state's units of a block and never its padding, nor the attention
layout's heads.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class StateLayout:
    regions: tuple[int, ...]  # the registered buffers that hold state layers
    page_bytes: int  # one block of a buffer: the attention page, a state page padded
    unit_bytes: int
    group_units: tuple[tuple[int, int], ...]  # (state group, units of its state in a block)
    # Each state layer's block-major view (the state's bytes of every block); never
    # serialised.
    views: tuple[Any, ...]
    # Per state group, what the handshake compares: the state's parts, dtypes and type.
    described: tuple[str, ...]

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
            "kv_state_page_units": self.page_units,
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
) -> StateLayout | None:
    """The state layers of ``kv_caches`` (``specs``: state_layer_specs), each in a buffer
    of ``registered`` (the attention layers' bases) whose pages are ``page_bytes``; None for a
    model without state. Refuses a state the engine cannot move whole."""
    if not specs:
        return None
    parts: dict[int, StateBytes] = {}
    described: dict[int, str] = {}
    regions: list[int] = []
    views = []
    for name, (group, spec) in specs.items():
        sizes = [int(getattr(dtype, "itemsize", 0)) for dtype in spec.dtypes]
        layer = state_bytes([tuple(shape) for shape in spec.shapes], sizes)
        parts[group] = layer
        described[group] = (
            f"{getattr(spec.mamba_type, 'name', spec.mamba_type)}:"
            f"{[list(s) for s in spec.shapes]}:{[str(d) for d in spec.dtypes]}:"
            f"{spec.mamba_cache_mode}:{spec.num_speculative_blocks}"
        )
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
    unit = state_unit_bytes(page_bytes, [layer.nbytes for layer in parts.values()])
    return StateLayout(
        regions=tuple(sorted(regions, key=list(registered).index)),
        page_bytes=page_bytes,
        unit_bytes=unit,
        group_units=tuple((g, layer.nbytes // unit) for g, layer in sorted(parts.items())),
        views=tuple(views),
        described=tuple(described[g] for g in sorted(described)),
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
