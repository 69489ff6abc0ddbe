"""What vLLM's KV-cache tensors look like to the engine: addresses, block bytes, tensors.

`register_kv_caches` hands over one entry per attention layer (with the hybrid KV-cache
manager, layers of different groups share one buffer: it is registered once). Platforms differ:
- CPU: one tensor per layer, `[num_blocks, kv_heads, block_size, 2 * head_size]`, every layer
  a view into one buffer;
- GPU-style K/V split: one tensor per layer, `[2, num_blocks, ...]`;
- Ascend: a tuple `(k_cache, v_cache)` per layer, `[num_blocks * k, 128, ...]` where a block
  is k of the kernels' 128-token blocks; MLA: `(latent, rope)` parts of different block
  shapes (each part is registered as a cache of its own). A hybrid state model's K lies in
  the same bytes as its states' ssm plane (state_layout).
Whatever the form, each registered tensor must be block-major: block b of tensor t starts at
`addr[t] + b * block_bytes` and is `block_bytes` contiguous bytes. Where KV heads are
contiguous inside a block (CPU: heads are the block's outermost dimension), a block is
`units_per_block` units, one KV head each, so a rank of another TP size can read or fill a
head slice in place. A unit's interior is opaque: only peers with an identical layout may
exchange units (the handshake checks it). Head-major layouts are registered a second time in
slices of ``SLICE_ELEMENTS`` elements, so a decode block can be assembled from smaller
prefill blocks (block_slices).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.kv.state_layout import (
    AttentionTensors,
    Sharding,
    StateLayout,
    describe_state,
)
from hixl_connector.connector.mapping.block_slices import SLICE_ELEMENTS


@dataclass(frozen=True)
class KVLayout:
    tensor_addrs: tuple[int, ...]
    block_bytes: int
    num_blocks: int
    tensors_per_layer: int
    num_layers: int
    dtype: str
    block_shape: tuple[int, ...]
    # Block-major views ([num_blocks, ...]) in registration order: where the KV lives (its
    # device and dtype, for the engine's options and the handshake); never serialised.
    views: tuple[Any, ...]
    # Layers of unlike parts (MLA: latent and rope): bytes per block of each part, in layer
    # order; empty when every tensor has the same block shape.
    part_block_bytes: tuple[int, ...] = ()
    # Each block holds its KV heads one after another (block_shape[0] heads).
    head_major: bool = False
    # Bytes of one slice where the layout is also registered in slices; 0 where it is not.
    slice_bytes: int = 0
    # Each attention layer's name (vLLM's) and the registered layer that holds its KV.
    layer_index: tuple[tuple[str, int], ...] = ()
    # A hybrid state model's states, in the same buffers (state_layout); None without.
    state: StateLayout | None = None

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_addrs)

    @property
    def kv_in_states_buffers(self) -> bool:
        """The KV lies in planes beside a hybrid model's states (vllm-ascend): it is read
        through the states' registration (state_layout) and not registered on its own."""
        return self.state is not None and bool(self.state.kv_parts)

    @property
    def units_per_block(self) -> int:
        """Units (one KV head each) a block of a tensor is registered as; 1 when heads do
        not split a block."""
        return self.block_shape[0] if self.head_major else 1

    @property
    def unit_bytes(self) -> int:
        return self.block_bytes // self.units_per_block

    @property
    def slices_per_unit(self) -> int:
        return self.unit_bytes // self.slice_bytes if self.slice_bytes else 0

    def compatibility_fields(self, block_size: int) -> dict[str, Any]:
        """What must be equal on both sides, per token: block sizes may differ."""
        if self.unit_bytes % block_size or any(b % block_size for b in self.part_block_bytes):
            raise ValueError(
                f"KV blocks of {self.block_bytes} bytes do not hold {block_size} tokens"
            )
        return {
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "tensors_per_layer": self.tensors_per_layer,
            "num_tensors": self.num_tensors,
            "unit_token_bytes": self.unit_bytes // block_size,
            "part_token_bytes": [b // block_size for b in self.part_block_bytes],
            **(self.state.compatibility_fields() if self.state is not None else {}),
        }


def _block_major_views(entry: Any, num_blocks: int) -> list[Any]:
    if isinstance(entry, (tuple, list)):
        return [view for part in entry for view in _block_major_views(part, num_blocks)]
    shape = tuple(entry.shape)
    if shape and shape[0] == num_blocks:
        return [entry]
    if len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
        return [entry[0], entry[1]]
    if len(shape) >= 2 and num_blocks and shape[0] % num_blocks == 0 and entry.is_contiguous():
        # vllm-ascend: its kernels' blocks of 128 tokens, several to one of vLLM's.
        return [entry.view(num_blocks, shape[0] // num_blocks * shape[1], *shape[2:])]
    raise ValueError(
        f"KV cache tensor of shape {list(shape)} has no block dimension of size {num_blocks} "
        "(expected [num_blocks, ...], [2, num_blocks, ...], [num_blocks * k, ...] or a tuple "
        "of such tensors)"
    )


def describe_kv_caches(
    kv_caches: Mapping[str, Any],
    num_blocks: int,
    heads_outermost: int = 0,
    groups_share_buffers: bool = False,
    state_specs: Mapping[str, tuple[int, Any]] | None = None,
    sharding: Sharding | None = None,
) -> KVLayout:
    """Derives the engine's view of vLLM's KV caches; refuses layouts it cannot move.

    ``heads_outermost``: the number of KV heads of this rank when the platform lays each
    block out head-major (the block's first dimension); 0 when heads do not split a block.
    ``groups_share_buffers``: several KV-cache groups (the hybrid manager), whose layers
    share buffers; otherwise a buffer named twice is refused.
    ``state_specs``: a hybrid state model's state layers (state_layout.state_layer_specs),
    which lie in the attention layers' buffers and are described apart; ``sharding``: how TP
    divides them.
    """
    state_specs = state_specs or {}
    if not kv_caches:
        raise ValueError("register_kv_caches got no KV-cache tensors")
    per_layer: list[list[Any]] = []
    seen: dict[tuple[int, ...], tuple[list[tuple[Any, ...]], int]] = {}
    names: list[tuple[str, int]] = []
    for name, entry in kv_caches.items():
        if name in state_specs:
            continue
        layer = _block_major_views(entry, num_blocks)
        starts = tuple(int(view.data_ptr()) for view in layer)
        forms = [(view.dtype, tuple(view.shape)) for view in layer]
        # The hybrid KV-cache manager lays one layer of each group on the same buffer (a
        # block id belongs to one group at a time): register such a buffer once. Any other
        # sharing is left for the overlap check to refuse.
        shared = seen.get(starts)
        if groups_share_buffers and shared is not None and shared[0] == forms:
            names.append((name, shared[1]))
            continue
        seen[starts] = (forms, len(per_layer))
        names.append((name, len(per_layer)))
        per_layer.append(layer)
    counts = {len(layer) for layer in per_layer}
    if len(counts) != 1:
        raise ValueError(f"layers have different numbers of KV tensors: {sorted(counts)}")
    views: list[Any] = [view for layer_views in per_layer for view in layer_views]
    first_layer = per_layer[0]
    part_bytes = [_check_block_major(part) for part in first_layer]
    for layer_views in per_layer[1:]:
        for view, like in zip(layer_views, first_layer, strict=True):
            if view.dtype != like.dtype or tuple(view.shape[1:]) != tuple(like.shape[1:]):
                raise ValueError(
                    f"KV tensors differ: {view.dtype} {list(view.shape)} vs "
                    f"{like.dtype} {list(like.shape)}"
                )
            _check_block_major(view)
    first = views[0]
    # MLA-style layers hold unlike parts (latent, rope): each part becomes its own cache.
    unlike = any(
        part.dtype != first.dtype or tuple(part.shape[1:]) != tuple(first.shape[1:])
        for part in first_layer
    )
    head_major = bool(heads_outermost) and not unlike and len(first_layer) == 1
    if head_major and int(first.shape[1]) != heads_outermost:
        raise ValueError(
            f"KV tensor {list(first.shape)} should hold {heads_outermost} KV heads in "
            "dimension 1 of its head-major blocks"
        )
    unit_elements = 1
    for dim in first.shape[2:]:
        unit_elements *= int(dim)
    sliced = head_major and unit_elements % SLICE_ELEMENTS == 0
    addrs = tuple(int(view.data_ptr()) for view in views)
    tensor_block_bytes = tuple(part_bytes[i % len(part_bytes)] for i in range(len(views)))
    _check_disjoint(addrs, [n * num_blocks for n in tensor_block_bytes])
    tensors_per_layer = len(first_layer)
    return KVLayout(
        tensor_addrs=addrs,
        # With unlike parts: the mean over the parts, so blocks x block_bytes x num_tensors
        # stays the bytes a pull moves.
        block_bytes=sum(part_bytes) // len(part_bytes) if unlike else part_bytes[0],
        num_blocks=num_blocks,
        tensors_per_layer=tensors_per_layer,
        num_layers=len(per_layer),
        dtype=str(first.dtype).removeprefix("torch."),
        block_shape=tuple(int(d) for d in first.shape[1:]),
        views=tuple(views),
        part_block_bytes=tuple(part_bytes) if unlike else (),
        head_major=head_major,
        slice_bytes=SLICE_ELEMENTS * int(first.element_size()) if sliced else 0,
        layer_index=tuple(names),
        state=describe_state(
            kv_caches,
            state_specs,
            AttentionTensors(addrs, tensor_block_bytes, tensors_per_layer),
            num_blocks,
            sharding,
        ),
    )


def _check_block_major(view: Any) -> int:
    block_elems = 1
    for dim in view.shape[1:]:
        block_elems *= int(dim)
    if not view[0].is_contiguous() or int(view.stride(0)) != block_elems:
        raise ValueError(
            f"KV tensor {list(view.shape)} with strides {list(view.stride())} is not "
            "block-major contiguous; the engine moves whole blocks as contiguous bytes"
        )
    return block_elems * int(view.element_size())


def _check_disjoint(addrs: Sequence[int], sizes: Sequence[int]) -> None:
    ordered = sorted(zip(addrs, sizes, strict=True))
    for (lower, size), (upper, _) in zip(ordered, ordered[1:], strict=False):
        if lower + size > upper:
            raise ValueError(
                f"KV tensors at {lower:#x} and {upper:#x} overlap; the same bytes must not "
                "be registered twice"
            )
