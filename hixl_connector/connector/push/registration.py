"""Push mode's D -> P message: "write this request's blocks here", validated on arrival.

A D rank sends one ``push_register`` to the P rank it mirrors, on P's side channel, once it
has allocated the request's blocks and granted them to P's cluster. It names the request by
the base id P's request shares with D's (vllm-router sends both legs with one X-Request-Id),
which prompt positions land in which of D's blocks, the grant of each of D's registered KV
caches (in registration order), a word of D's that P writes last, under its own grant (D
takes the blocks as written once that word is set), and how long D waits. No positions: D
takes nothing (a local prefix hit, or the request ended first), and P frees its blocks at
once.

Where the TP sizes differ, a D rank registers with every P rank it mirrors a KV head of
(tp_mapping), naming which of P's heads land in which of its own (``heads``, against its
``units_per_block``), its rank, and how many D ranks register with that P rank
(``consumers``: P frees once every one of them was pushed); a P rank nobody reads (a
replica) hears from one D rank with no positions.

Where P's blocks are smaller (``slices``: ``ratio`` of P's blocks make one of D's), D grants
its KV caches registered in slices instead (one grant), and says where the slices of each KV
head of P's ``ratio`` blocks land in its block (block_slices.SliceRun, probed from D's
kernels): P writes every slice straight into place, as a pulling D reads it.

Under vLLM's hybrid KV-cache manager a request has blocks in each KV-cache group (a
sliding-window group only those still in its window): ``groups`` says how many of the
positions and blocks, in order, belong to each group. Layers of different groups share
D's registered KV caches, so one grant per cache covers the blocks of every group.

A hybrid state model's state groups have no positions (``groups`` counts 0 for them): D
names, in runs of units of the state registration, which of P's state of each group land
where in its own state slots (``state_runs``: [group, first unit counted from the start of
P's state, first unit of D's, count]; the whole state between equal TP sizes, else this D
rank's slices of the P rank's, state_layout.shard_runs), grants those units (``state_grant``),
and says how many prompt tokens the state must hold (``num_tokens``, N−1: P refuses a prompt
it computed whole). P writes them from its own slot of each group after the prompt was
computed (a state layer is final only after P's last chunk) and before the word.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hixl_connector.connector.limits import (
    MAX_BLOCK_SIZE,
    MAX_CLUSTER_ID,
    MAX_KV_CACHE_GROUPS,
    MAX_STATE_UNIT,
    check_field,
)
from hixl_connector.connector.mapping.block_slices import SliceRun

MESSAGE_TYPE = "push_register"
MAX_PUSH_BLOCKS = 1 << 20
MAX_REQUEST_ID_CHARS = 1024
MAX_GRANT = 2**63 - 1
# D's wait for a push is its push_timeout_s (config.MAX_TIMEOUT_S at most).
MAX_WAIT_S = (2**31 - 1) // 1000
# Runs of slices of one KV head of a D block: a block of MAX_BLOCK_SIZE tokens at most.
MAX_SLICE_RUNS = 4096
# Runs of a request's state units: a run per piece of a state (conv parts, ssm) and group.
MAX_STATE_RUNS = 16 * MAX_KV_CACHE_GROUPS
MAX_UNITS_PER_BLOCK = 65536  # KV heads of a block on one rank
MAX_RANKS = 65535


@dataclass(frozen=True)
class HeadRun:
    """KV heads ``[src, src + count)`` of P's blocks land at ``[dst, dst + count)`` of D's."""

    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class StateRun:
    """``count`` units of the state of KV-cache group ``group``: from unit ``src`` of P's state
    of that group, counted from the state's start (wherever P's parts place it), to unit
    ``dst`` of D's state registration, onwards in one part of D's."""

    group: int
    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class Slices:
    """P's blocks are ``ratio`` times smaller than D's: ``runs`` rebuild one KV head of a D
    block from the same head of ``ratio`` consecutive P blocks."""

    ratio: int
    runs: tuple[SliceRun, ...]

    def to_list(self) -> list[Any]:
        return [self.ratio, [[r.part, r.src, r.dst, r.count] for r in self.runs]]

    @classmethod
    def from_list(cls, where: str, value: Any) -> Slices:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"{where} field 'slices' must be [ratio, runs]")
        ratio, runs = value
        check_field(where, "slices ratio", ratio, int, 2, MAX_BLOCK_SIZE)
        if not isinstance(runs, (list, tuple)) or not 0 < len(runs) <= MAX_SLICE_RUNS:
            raise ValueError(
                f"{where} field 'slices' must name 1 to {MAX_SLICE_RUNS} runs of slices"
            )
        parsed = _runs(where, "slices", runs, ("part", ratio), MAX_BLOCK_SIZE)
        return cls(ratio, tuple(SliceRun(*run) for run in parsed))


@dataclass(frozen=True)
class PushRegistration:
    request: str  # the base request id (metadata.base_request_id)
    cluster_id: int  # D rank's cluster id: where P pushes
    positions: tuple[int, ...]  # prompt block positions P writes ...
    blocks: tuple[int, ...]  # ... into these blocks of D's
    grants: tuple[int, ...]  # D's grant for each of its registered KV caches
    word: tuple[int, int]  # (slot, grant) of D's push word, written last
    wait_s: float  # how long D waits for the push: P forgets the registration after that
    slices: Slices | None = None  # P's blocks are smaller: grants and blocks are D's slices
    # P's KV heads (units of a block) that land in D's blocks of ``units_per_block`` units;
    # () for every unit, the same on both sides.
    heads: tuple[HeadRun, ...] = ()
    units_per_block: int = 0
    rank: int = 0  # D's TP rank ...
    consumers: int = 1  # ... of this many that register with this P rank
    # How many of ``positions`` (and ``blocks``) belong to each KV-cache group, in order;
    # () for one group.
    groups: tuple[int, ...] = ()
    # The units of P's state slots P writes into D's, under ``state_grant``, with the state
    # after ``num_tokens`` prompt tokens (P refuses a state that holds another number).
    state_runs: tuple[StateRun, ...] = ()
    state_grant: int = 0
    num_tokens: int = 0

    def group_positions(self) -> tuple[tuple[int, ...], ...]:
        """``positions`` split by KV-cache group."""
        counts = self.groups or (len(self.positions),)
        ends = list(itertools.accumulate(counts))
        return tuple(self.positions[end - n : end] for end, n in zip(ends, counts, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {
            "slices": self.slices.to_list() if self.slices is not None else None,
            "heads": [[h.src, h.dst, h.count] for h in self.heads],
            "units_per_block": self.units_per_block,
            "rank": self.rank,
            "consumers": self.consumers,
            "groups": list(self.groups),
            "state_runs": [[r.group, r.src, r.dst, r.count] for r in self.state_runs],
            "state_grant": self.state_grant,
            "num_tokens": self.num_tokens,
            "type": MESSAGE_TYPE,
            "request": self.request,
            "cluster_id": self.cluster_id,
            "positions": list(self.positions),
            "blocks": list(self.blocks),
            "grants": list(self.grants),
            "word": list(self.word),
            "wait_s": self.wait_s,
        }

    @classmethod
    def from_dict(cls, data: Any) -> PushRegistration:
        where = "push registration"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(data).__name__}")
        request = check_field(where, "request", data, str)
        if len(request) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"{where} request id is longer than {MAX_REQUEST_ID_CHARS}")
        positions = _ints(where, "positions", data.get("positions"), MAX_PUSH_BLOCKS, 2**31)
        blocks = _ints(where, "blocks", data.get("blocks"), MAX_PUSH_BLOCKS, 2**31)
        if len(positions) != len(blocks):
            raise ValueError(f"{where} has {len(positions)} positions for {len(blocks)} blocks")
        grants = _ints(where, "grants", data.get("grants"), 4 * MAX_KV_CACHE_GROUPS, MAX_GRANT)
        word = _ints(where, "word", data.get("word"), 2, MAX_GRANT)
        if len(word) != 2:
            raise ValueError(f"{where} word must be [slot, grant], got {word!r}")
        if blocks and not grants:
            raise ValueError(f"{where} grants no cache for its {len(blocks)} blocks")
        wait_s = data.get("wait_s")
        if (
            isinstance(wait_s, bool)
            or not isinstance(wait_s, (int, float))
            or not 0 < wait_s <= MAX_WAIT_S
        ):
            raise ValueError(f"{where} field 'wait_s' must be seconds in (0, {MAX_WAIT_S}]")
        slices = data.get("slices")
        if slices is not None:
            slices = Slices.from_list(where, slices)
            if len(grants) != 1:
                raise ValueError(f"{where} grants {len(grants)} caches, in slices there is 1")
        heads = data.get("heads", [])
        if not isinstance(heads, (list, tuple)) or len(heads) > MAX_UNITS_PER_BLOCK:
            raise ValueError(f"{where} field 'heads' must be a list of [src, dst, count] runs")
        runs = []
        for run in heads:
            numbers = _ints(where, "heads run", run, 3, MAX_UNITS_PER_BLOCK)
            if len(numbers) != 3 or numbers[2] < 1:
                raise ValueError(f"{where} heads run {run!r} must be [src, dst, count >= 1]")
            runs.append(HeadRun(*numbers))
        units = check_field(where, "units_per_block", data, int, 0, MAX_UNITS_PER_BLOCK)
        if runs and not units:
            raise ValueError(f"{where} names heads, but no units_per_block")
        groups = _ints(where, "groups", data.get("groups", []), MAX_KV_CACHE_GROUPS, 2**31)
        if groups and sum(groups) != len(positions):
            raise ValueError(
                f"{where} splits {sum(groups)} positions by KV-cache group, it has {len(positions)}"
            )
        if len(groups) > 1 and slices is not None:
            raise ValueError(f"{where} names {len(groups)} KV-cache groups and slices")
        state_runs = data.get("state_runs", [])
        if not isinstance(state_runs, (list, tuple)) or len(state_runs) > MAX_STATE_RUNS:
            raise ValueError(
                f"{where} field 'state_runs' must be a list of at most {MAX_STATE_RUNS} "
                "[group, src, dst, count] runs"
            )
        group = ("group", MAX_KV_CACHE_GROUPS)
        states = [
            StateRun(*run) for run in _runs(where, "state_runs", state_runs, group, MAX_STATE_UNIT)
        ]
        state_grant = data.get("state_grant", 0)
        check_field(where, "state_grant", state_grant, int, 0, MAX_GRANT)
        num_tokens = data.get("num_tokens", 0)
        check_field(where, "num_tokens", num_tokens, int, 0, 2**31)
        if states and not (state_grant and num_tokens):
            raise ValueError(f"{where} names state runs without a state_grant and num_tokens")
        return cls(
            request=request,
            cluster_id=check_field(where, "cluster_id", data, int, 0, MAX_CLUSTER_ID),
            positions=positions,
            blocks=blocks,
            grants=grants,
            word=(word[0], word[1]),
            wait_s=float(wait_s),
            slices=slices,
            heads=tuple(runs),
            units_per_block=units,
            rank=check_field(where, "rank", data, int, 0, MAX_RANKS),
            consumers=check_field(where, "consumers", data, int, 1, MAX_RANKS),
            groups=groups,
            state_runs=tuple(states),
            state_grant=state_grant,
            num_tokens=num_tokens,
        )


def _runs(
    where: str, field: str, runs: Any, first: tuple[str, int], high: int
) -> list[tuple[int, ...]]:
    """The [first, src, dst, count] runs of ``field``, ints up to ``high``: the first
    (named and bounded by ``first``) below its bound, the count at least 1."""
    what, below = first
    parsed: list[tuple[int, ...]] = []
    for run in runs:
        numbers = _ints(where, f"{field} run", run, 4, high)
        if len(numbers) != 4 or numbers[0] >= below or numbers[3] < 1:
            raise ValueError(
                f"{where} {field} run {run!r} must be [{what} < {below}, src, dst, count >= 1]"
            )
        parsed.append(numbers)
    return parsed


def _ints(where: str, name: str, value: Any, most: int, high: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > most:
        raise ValueError(f"{where} field {name!r} must be a list of at most {most} ints")
    for item in value:
        check_field(where, name, item, int, 0, high)
    return tuple(value)
