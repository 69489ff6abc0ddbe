"""One request's push on P: its writes into the blocks D registered for it, and the word
that vouches for them.

Layers P's forward computes while D's registration is here are written as they are
computed (``write_layers``, from ``save_kv_layer``); once the prefill finished
(``finish``), the layers not yet written follow, then P's lease word into D's push word.
D decodes only once it sees that word; why that order keeps D from decoding wrong KV (the
word last, written while the lease is pinned, every write under D's grant) is argued in
``guarded_write``.

A push P gives up on (a write failed, the lease ended first) is reported to ``gave_up``,
which D hears of when it next asks (``push.status``), so it fails the request without
waiting out its own timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor

from hixl_connector.connector.kv.registered_kv import (
    PUSH_WORDS_MODEL_ID,
    STATE_MODEL_ID,
    RegisteredKV,
)
from hixl_connector.connector.kv.state_layout import StateLayout
from hixl_connector.connector.leases.server import LeaseTable
from hixl_connector.connector.mapping.block_slices import slice_ids
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID
from hixl_connector.connector.mapping.tp_mapping import unit_ids
from hixl_connector.connector.metadata import SendSpec
from hixl_connector.connector.push.registration import HeadRun, PushRegistration, Slices
from hixl_connector.connector.push.serial_jobs import SerialJobs
from hixl_connector.connector.push.status import GaveUp

logger = logging.getLogger(__name__)


def source_blocks(
    prompt_blocks: Sequence[Sequence[int]], registration: PushRegistration, num_caches: int
) -> tuple[int, ...]:
    """P's blocks (``prompt_blocks``: each KV-cache group's, by position) at the prompt
    positions D registered, group by group (D's positions, so ``ratio`` of P's blocks each
    where they are smaller, NULL_BLOCK_ID past the prompt's end); raises ValueError where
    D's registration does not fit this engine or this prompt."""
    ratio, caches = 1, num_caches
    if registration.slices is not None:
        ratio, caches = registration.slices.ratio, 1
    if len(registration.grants) != caches:
        raise ValueError(
            f"D granted {len(registration.grants)} KV caches, this engine registers {caches}"
        )
    by_group = registration.group_positions()
    if len(by_group) != len(prompt_blocks):
        raise ValueError(
            f"D registered blocks of {len(by_group)} KV-cache group(s), this engine has "
            f"{len(prompt_blocks)}"
        )
    source: list[int] = []
    for positions, blocks in zip(by_group, prompt_blocks, strict=True):
        beyond = [p for p in positions if p * ratio >= len(blocks)]
        if beyond:
            raise ValueError(
                f"D asks for prompt block {beyond[0] * ratio}, the prompt has {len(blocks)}"
            )
        for p in positions:
            for i in range(p * ratio, (p + 1) * ratio):
                if i < len(blocks) and blocks[i] == NULL_BLOCK_ID:
                    # A sliding-window group dropped it here: never write the null block.
                    raise ValueError(f"D asks for prompt block {i}, which left P's window")
                source.append(blocks[i] if i < len(blocks) else NULL_BLOCK_ID)
    return tuple(source)


def state_pairs(
    send: SendSpec, registration: PushRegistration, state: StateLayout | None
) -> tuple[list[int], list[int]]:
    """The units of P's state slots (``send.block_ids``: P offers a state group's slot
    alone) that D's state runs name, and the units of D's they land in; raises ValueError
    where D's registration does not fit this engine or this prompt, or P's state holds
    another number of tokens than D continues from."""
    if not registration.state_runs:
        return [], []
    if state is None:
        raise ValueError("D names state runs, and this engine's model has no state")
    if send.num_tokens != registration.num_tokens:
        # P computed this prompt whole (prompt logprobs): its state holds the last token,
        # which D computes again.
        raise ValueError(
            f"P's state holds {send.num_tokens} prompt tokens, D continues from "
            f"{registration.num_tokens}"
        )
    prompt_blocks = send.block_ids
    counts = registration.groups
    src: list[int] = []
    dst: list[int] = []
    for run in registration.state_runs:
        group = run.group
        if group >= len(prompt_blocks) or (counts and (group >= len(counts) or counts[group])):
            raise ValueError(f"D names KV-cache group {group} a state group; it is not one here")
        offered = prompt_blocks[group]
        if len(offered) != 1 or offered[0] == NULL_BLOCK_ID:
            raise ValueError(f"P holds no state slot of group {group} for this prompt")
        own = state.units(group, offered[0])
        if run.src < 0 or run.src + run.count > len(own):
            raise ValueError(
                f"D asks for units {run.src} to {run.src + run.count} of the state of group "
                f"{group}, which holds {len(own)} here"
            )
        src.extend(own[run.src : run.src + run.count])
        dst.extend(range(run.dst, run.dst + run.count))
    return src, dst


def head_runs(registration: PushRegistration, p_units: int) -> tuple[tuple[HeadRun, ...], int]:
    """Which of this rank's KV heads (``p_units`` a block) land in which of D's, and D's
    units per block; raises ValueError where a run leaves a block."""
    runs = registration.heads or (HeadRun(0, 0, p_units),)
    d_units = registration.units_per_block or p_units
    for run in runs:
        if run.src + run.count > p_units or run.dst + run.count > d_units:
            raise ValueError(
                f"D's heads run {run} leaves a block of {p_units} KV heads here, {d_units} there"
            )
    return runs, d_units


def pushed_units(
    src: Sequence[int], dst: Sequence[int], runs: Sequence[HeadRun], units: tuple[int, int]
) -> tuple[list[int], list[int]]:
    """Units (KV heads of a block) of P's blocks ``src`` and of D's ``dst`` they land in,
    blocks of ``units`` = (P's, D's) units each."""
    p_units, d_units = units
    moved: tuple[list[int], list[int]] = ([], [])
    for run in runs:
        moved[0].extend(unit_ids(src, p_units, run.src, run.count))
        moved[1].extend(unit_ids(dst, d_units, run.dst, run.count))
    return moved


def pushed_slices(
    src: Sequence[int],
    dst: Sequence[int],
    slices: Slices,
    runs: Sequence[HeadRun],
    units: tuple[int, int],
    head_slices: int,
) -> tuple[list[int], list[int]]:
    """The slices of P's blocks ``src`` (``slices.ratio`` per block of D's ``dst``) and the
    slices of D's they land in, for the KV heads of ``runs``, blocks of ``units`` = (P's,
    D's) heads, each of ``head_slices`` slices here and ``ratio`` times as many there;
    raises ValueError where a slice run leaves its head."""
    dst_slices = slices.ratio * head_slices
    for run in slices.runs:
        if run.src + run.count > head_slices or run.dst + run.count > dst_slices:
            raise ValueError(
                f"D's slice run {run} leaves a KV head of {head_slices} slices here, "
                f"{dst_slices} there"
            )
    p_units, d_units = units
    moved: tuple[list[int], list[int]] = ([], [])
    for head in runs:
        src_unit, dst_unit = (p_units, head.src, head_slices), (d_units, head.dst, dst_slices)
        ids = slice_ids(src, dst, slices.runs, slices.ratio, src_unit, dst_unit, head.count)
        moved[0].extend(ids[0])
        moved[1].extend(ids[1])
    return moved


def layer_ranges(layers: Iterable[int]) -> list[range]:
    """``layers`` as the fewest ascending runs of consecutive layers."""
    runs: list[range] = []
    for layer in sorted(set(layers)):
        if runs and runs[-1].stop == layer:
            runs[-1] = range(runs[-1].start, layer + 1)
        else:
            runs.append(range(layer, layer + 1))
    return runs


class RequestPush:
    """Created once P knows D's registration; ``src`` is what ``source_blocks`` returned for
    it and the prompt's blocks, or () for a push that begins once the prefill finished
    (``finish`` takes the blocks from the finished prefill then)."""

    def __init__(
        self,
        kv: RegisteredKV,
        registration: PushRegistration,
        src: tuple[int, ...],
        num_layers: int,
        pool: Executor,
        record: Callable[[str, int], None],
        gave_up: Callable[[PushRegistration, GaveUp], None],
        state: StateLayout | None = None,
    ) -> None:
        """``gave_up``: told of a push P will not finish, and why; ``state``: where this
        engine's states lie (None: its model has none)."""
        self.registration = registration
        self._kv = kv
        self._state = state
        self._gave_up = gave_up
        self._src = src
        self._num_layers = num_layers
        self._record = record
        self._jobs = SerialJobs(pool)
        # Touched by the jobs only, one at a time.
        self._written: set[int] = set()
        self._error = ""
        self._dropped = threading.Event()  # the prompt finished without a lease

    def write_layers(self, layers: range) -> None:
        """Queues the write of ``layers`` (computed, not yet written) of every block."""
        self._jobs.submit(lambda: self._write_layers(layers))

    def drop(self) -> None:
        """The prompt finished without a lease: layers still queued are not written."""
        self._dropped.set()

    def finish(self, send: SendSpec, leases: LeaseTable, wake: Callable[[], None]) -> None:
        """Queues the rest, after what is queued: the layers not written, then the word;
        then this D rank is done with ``send``'s lease (it ends with the last of them)."""
        self._jobs.submit(lambda: self._finish(send, leases, wake))

    def _write_layers(self, layers: range) -> None:
        if self._error or self._dropped.is_set():
            return  # the request failed or ended already: D gets no word
        try:
            self._write(layers)
            self._written.update(layers)
        except Exception as e:
            self._error = f"layers {layers.start}-{layers.stop - 1}: {e}"

    def _finish(self, send: SendSpec, leases: LeaseTable, wake: Callable[[], None]) -> None:
        if not leases.pin(send.request_id, send.lease_id):
            # Ended meanwhile (expired): its blocks may be another's now.
            self._gave_up(self.registration, GaveUp("P's lease ended before its push", False))
            return
        try:
            self._push_rest(send)
            self._record("pushes", 1)
            if self._written:
                self._record("layered_pushes", 1)
        except Exception as e:
            self._record("failed_pushes", 1)
            logger.error("hixl: push of request %s failed: %s", send.request_id, e)
            codes = self._kv.api.LLMStatusCode
            # LLM-DataDist: after a timeout the link cannot be used again; a link P finds
            # broken is one D must make anew before P can write to it again.
            lost = getattr(e, "status_code", None) in (codes.LLM_TIMEOUT, codes.LLM_NOT_YET_LINK)
            self._gave_up(self.registration, GaveUp(f"P's push failed: {e}", lost))
        finally:
            registration = self.registration
            leases.pushed(
                send.request_id, send.lease_id, registration.consumers, rank=registration.rank
            )
            wake()

    def _push_rest(self, send: SendSpec) -> None:
        if self._error:
            raise RuntimeError(self._error)
        registration = self.registration
        if not registration.blocks and not registration.state_runs:
            return  # this D rank takes nothing: it is done
        states = state_pairs(send, registration, self._state)
        if registration.blocks:  # none: D holds the prompt's KV, and takes a state alone
            self._write_rest(source_blocks(send.block_ids, registration, len(self._kv.caches)))
        if states[0]:
            # A state is final only once the prompt's last chunk ran: written now, whole.
            assert self._kv.state is not None
            grant = registration.state_grant
            self._kv.push(registration.cluster_id, self._kv.state, STATE_MODEL_ID, states, grant)
        # Last: the lease word (set while the lease lives) tells D every block landed.
        assert self._kv.lease_words is not None
        slot, grant = registration.word
        words = ((send.slot,), (slot,))
        self._kv.push(
            registration.cluster_id, self._kv.lease_words, PUSH_WORDS_MODEL_ID, words, grant
        )

    def _write_rest(self, src: tuple[int, ...]) -> None:
        """The layers of blocks ``src`` not written yet."""
        if src != self._src:
            # A push begun only now (src ()), which has written nothing; or, which cannot
            # happen, blocks that changed since the layers were written: all are written again.
            self._src, self._written = src, set()
        missing = [layer for layer in range(self._num_layers) if layer not in self._written]
        if len(missing) == self._num_layers:
            self._write(None)
        else:
            for layers in layer_ranges(missing):
                self._write(layers)

    def _write(self, layers: range | None) -> None:
        """``layers`` (None: all) of every block, in every KV cache, under D's grants."""
        registration = self.registration
        if registration.slices is not None:
            sliced = self._kv.slices
            if sliced is None:
                raise ValueError("D's blocks are larger, and this engine registers no slices")
            p_units = self._kv.caches[0].units_per_block
            runs, d_units = head_runs(registration, p_units)
            pairs = pushed_slices(
                self._src,
                registration.blocks,
                registration.slices,
                runs,
                (p_units, d_units),
                sliced.units_per_block // p_units,
            )
            (grant,) = registration.grants
            self._kv.push(registration.cluster_id, sliced, sliced.model_id, pairs, grant, layers)
            return
        for part, grant in zip(self._kv.caches, registration.grants, strict=True):
            runs, d_units = head_runs(registration, part.units_per_block)
            units = (part.units_per_block, d_units)
            pairs = pushed_units(self._src, registration.blocks, runs, units)
            self._kv.push(registration.cluster_id, part, part.model_id, pairs, grant, layers)
