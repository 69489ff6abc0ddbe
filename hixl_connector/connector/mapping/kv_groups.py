"""What the scheduler half knows of vLLM's KV-cache groups: their block sizes, the bytes of
a block, which of a request's blocks a read must fill, and P's blocks that fill them. Pure:
no torch, no engine."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hixl_connector.connector.mapping.block_slices import blocks_per_block
from hixl_connector.connector.mapping.blocks import (
    NULL_BLOCK_ID,
    blocks_for_tokens,
    remote_at_positions,
)
from hixl_connector.connector.mapping.state_groups import (
    ALIGNED_STATE_CACHE,
    NO_STATE,
    NO_STATE_CACHE,
    StateGroups,
    is_state_spec,
    state_groups,
    state_slot,
)
from hixl_connector.connector.transfer_params import RemotePrefill

# (positions, block ids) of one group's blocks to fill; a position is the block's index
# within the request.
Unfilled = tuple[tuple[int, ...], tuple[int, ...]]


def group_block_sizes(vllm_config: Any, kv_cache_config: Any) -> tuple[int, ...]:
    """Tokens per block of each KV-cache group (hybrid models have several groups). A state
    group takes the attention groups' block size: its own (max_model_len without prefix
    caching of the state) says nothing of its one slot, and would make P and D of different
    max_model_len differ; with prefix caching of the state, vLLM aligns it to theirs."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    states = [is_state_spec(group.kv_cache_spec) for group in groups]
    sizes = [int(group.kv_cache_spec.block_size) for group in groups]
    attention = [size for size, state in zip(sizes, states, strict=True) if not state]
    if attention:
        sizes = [attention[0] if state else size for size, state in zip(sizes, states, strict=True)]
    return tuple(sizes) or (int(vllm_config.cache_config.block_size),)


def group_windows(kv_cache_config: Any) -> tuple[int, ...]:
    """Each KV-cache group's sliding window in tokens, where vLLM lets the blocks it left
    behind go (0: it keeps every block). Only a sliding-window group does: with the hybrid
    manager off, a window layer's full-attention spec names its window but keeps all."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return tuple(
        int(getattr(g.kv_cache_spec, "sliding_window", None) or 0)
        if any(c.__name__ == "SlidingWindowSpec" for c in type(g.kv_cache_spec).__mro__)
        else 0
        for g in groups
    )


def blocks_left_behind(num_prompt_tokens: int, window: int, block_size: int) -> int:
    """How many leading blocks of a prompt a sliding-window group no longer needs once the
    prompt is computed: those whose tokens all lie before the window of the prompt's last
    token, which D computes again. vLLM lets them go (the null block takes their place), at
    most one block later. 0 for full attention."""
    if not window:
        return 0
    return max(0, num_prompt_tokens - window) // block_size


def check_movable(kv_cache_config: Any) -> None:
    """Refuses, at start, a model with KV-cache groups the connector cannot move, naming the
    setting to change: it reads attention KV (full, sliding-window, MLA) block by block, and
    the state of a hybrid state model (state_groups) by its slot."""
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = group.kv_cache_spec
        for layer_spec in list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]:
            # A state layer moves by its slot, so only in a group of state layers.
            if is_state_spec(layer_spec) == is_state_spec(spec) and (
                is_state_spec(spec)
                or any(cls.__name__ == "AttentionSpec" for cls in type(layer_spec).__mro__)
            ):
                continue
            layers = ", ".join(group.layer_names[:3]) + (
                ", ..." if len(group.layer_names) > 3 else ""
            )
            raise ValueError(
                f"hixl_connector moves attention KV and Mamba-style state; KV-cache group "
                f"{index} of this model holds {type(layer_spec).__name__} ({layers}), which "
                "it cannot move. Serve this model without P/D disaggregation"
            )
    states = state_groups(kv_cache_config)
    if not states:
        return
    if states.cache_mode not in (NO_STATE_CACHE, ALIGNED_STATE_CACHE):
        raise ValueError(
            f"this hybrid state model runs with mamba_cache_mode {states.cache_mode!r}, which "
            "hixl_connector does not read: use 'none' (--no-enable-prefix-caching) or "
            "'align' (prefix caching on)"
        )


def check_every_layer_registered(kv_cache_config: Any, registered: Iterable[str]) -> None:
    """Refuses, at start, KV-cache layers that vLLM's KV-cache config has and the connector
    was not given: they would never be moved (a speculative draft's layers, say), and D would
    decode on KV it never received. Groups vLLM marks as not transferable are rebuilt by vLLM
    after a load, and skipped."""
    names = set(registered)
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        missing = [name for name in group.layer_names if name not in names]
        if missing:
            shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            draft = " (the speculative draft's)" if getattr(group, "is_eagle_group", False) else ""
            raise ValueError(
                f"KV-cache group {index}{draft} has {len(missing)} layer(s) that vLLM did not "
                f"register with the connector ({shown}): their KV would never be moved. Serve "
                "this model (or this speculative method) without P/D disaggregation"
            )


def one_group_block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block on this rank, every layer together, for a model with one
    KV-cache group; 0 otherwise (and without a KV-cache config)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        return 0
    return int(groups[0].kv_cache_spec.page_size_bytes) * len(groups[0].layer_names)


def blocks_to_fill(
    groups: Sequence[Sequence[Any]],
    local_hit: int | None,
    block_sizes: Sequence[int],
    num_tokens: int,
    states: StateGroups = NO_STATE,
) -> list[Unfilled]:
    """Each group's blocks of a request that its read of ``num_tokens`` prompt tokens
    (state_groups.tokens_to_load) fills: only blocks that hold those tokens, never the slots
    vLLM adds past them (a speculative decoder's lookahead tokens, allocated with a
    synchronous load); of a state group, the slot of its state alone. An asynchronous load
    (``local_hit`` None) fills the blocks vLLM has not cached; vLLM caches a synchronous
    load's blocks at once, so one (of a single group) fills those past the ``local_hit``
    tokens of the local prefix cache."""
    if local_hit is None:
        return [
            _state_slot(group, num_tokens, size, states)
            if index in states
            else _uncached(group[: blocks_for_tokens(num_tokens, size)])
            for index, (group, size) in enumerate(zip(groups, block_sizes, strict=True))
        ]
    (group,) = groups
    size = block_sizes[0]
    end = min(len(group), blocks_for_tokens(num_tokens, size))
    positions = tuple(range(local_hit // size, end))
    return [(positions, tuple(group[p].block_id for p in positions))]


def remote_blocks_to_read(
    prefill: RemotePrefill,
    num_tokens: int,
    unfilled: Sequence[Unfilled],
    block_sizes: tuple[int, ...],
    states: StateGroups = NO_STATE,
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(P's block ids to read, per group, and P blocks per local block) for the
    ``unfilled`` blocks of each group, a read of ``num_tokens`` prompt tokens; raises
    ValueError when P's params cannot fill them."""
    if prefill.num_tokens is not None and prefill.num_tokens < num_tokens:
        raise ValueError(
            f"the prefill side computed {prefill.num_tokens} tokens, this prompt needs "
            f"{num_tokens}: not the same prompt"
        )
    if states and prefill.num_tokens is None:
        raise ValueError(
            "the prefill side's params lack remote_num_tokens: a state is read only when it "
            "is known to hold the tokens this decode side continues from"
        )
    if states and prefill.num_tokens != num_tokens:
        # A state holds every token P computed: it must be the state D continues from.
        raise ValueError(
            f"the prefill side computed the state after {prefill.num_tokens} tokens, this "
            f"decode side continues from the state after {num_tokens}: not the same prompt, "
            "or a prefill side that does not stop before the prompt's last token"
        )
    if len(prefill.block_ids) != len(unfilled):
        raise ValueError(
            f"the prefill side sent {len(prefill.block_ids)} KV-cache groups, this "
            f"engine has {len(unfilled)}: run both with the same model and the same "
            "hybrid KV-cache manager setting"
        )
    # P's block size is checked again at the handshake, against what P registered.
    p_sizes = prefill.block_sizes or block_sizes
    ratio = blocks_per_block(p_sizes, block_sizes)
    prompt_blocks = blocks_for_tokens(num_tokens, p_sizes[0])
    if ratio > 1 and len(prefill.block_ids[0]) < prompt_blocks:
        raise ValueError(
            f"the prefill side offers {len(prefill.block_ids[0])} blocks of "
            f"{p_sizes[0]} tokens for a {num_tokens}-token prompt"
        )
    # Every group is moved with its own block ids; one pull takes them all, since a block
    # id names the same bytes in every registered tensor.
    return tuple(
        _remote_state(offered, positions)
        if index in states
        else remote_at_positions(offered, positions, ratio)
        for index, ((positions, _), offered) in enumerate(
            zip(unfilled, prefill.block_ids, strict=True)
        )
    ), ratio


def _remote_state(offered: Sequence[int], positions: Sequence[int]) -> tuple[int, ...]:
    """P's state slot for D's (P offers its state's slot alone)."""
    if not positions:
        return ()
    if len(offered) != 1 or offered[0] == NULL_BLOCK_ID:
        raise ValueError(
            f"the prefill side offers state blocks {list(offered)}; one state slot expected"
        )
    return (offered[0],)


def _state_slot(group: Sequence[Any], num_tokens: int, size: int, states: StateGroups) -> Unfilled:
    """A state group's slot that holds the state after ``num_tokens`` tokens (none when
    nothing is loaded)."""
    if num_tokens == 0:
        return (), ()
    position = state_slot(len(group), num_tokens, size, states)
    return (position,), (group[position].block_id,)


def _uncached(group: Sequence[Any]) -> Unfilled:
    """The blocks the local prefix cache did not fill (and that the group holds at all: a
    sliding window's dropped blocks are null)."""
    unfilled = [
        (position, block.block_id)
        for position, block in enumerate(group)
        if block.block_hash is None and not block.is_null
    ]
    return tuple(p for p, _ in unfilled), tuple(b for _, b in unfilled)
