"""P's side of the scheduler half: a prefill for a remote decode gets a lease word in the step
that computes its prompt's end (the workers publish it before that step's forward); once it
finished, its blocks stay with vLLM (delay-free) under that lease and the
``kv_transfer_params`` D needs leave the engine; the slot returns once every rank reported
the lease finished. Why this order is safe: leases.guarded_read."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.endpoints import RemoteEndpoint, rank_address
from hixl_connector.connector.leases.guarded_read import lease_word
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID, blocks_for_tokens
from hixl_connector.connector.mapping.kv_groups import blocks_left_behind
from hixl_connector.connector.mapping.state_groups import (
    NO_STATE,
    StateGroups,
    state_slot,
    tokens_to_load,
)
from hixl_connector.connector.metadata import PromptBlocks, SendSpec, WordSpec
from hixl_connector.connector.peers.incarnation import IncarnationFile, incarnation_path
from hixl_connector.connector.scheduler.block_tables import BlockTable, BlockTables, resumed_ids
from hixl_connector.connector.transfer_params import build_remote_decode_params

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LEASE_ID_MODULUS = 2**64


@dataclass(frozen=True)
class _Published:
    """A lease word the workers publish (or published) for a prompt that has not finished."""

    lease_id: int
    slot: int
    word: int
    blocks: BlockTable  # the prompt's blocks of each group, as the word covers them

    @property
    def spec(self) -> WordSpec:
        return WordSpec(self.slot, self.word)


class PrefillSide:
    def __init__(
        self,
        config: HixlConfig,
        engine_id: str,
        dp_rank: int,
        tp_size: int,
        group_block_sizes: Sequence[int],
        num_blocks: int,
        group_windows: Sequence[int] = (),
        states: StateGroups = NO_STATE,
        block_hashes: Callable[[], tuple[int, int] | None] = lambda: None,
    ) -> None:
        self._group_block_sizes = tuple(group_block_sizes)
        # A hybrid state model's state groups: P stops before the prompt's last token.
        self._states = states
        # (hash block size, lookahead tokens) where vLLM's requests drop the block hashes of
        # the tokens they lose (0.34); None before.
        self._block_hashes = block_hashes
        self._group_windows = tuple(group_windows) or (0,) * len(self._group_block_sizes)
        self._mode = config.transfer_mode
        self._push = config.pushes
        # P announces rank 0's port and cluster id; D finds rank r at position r from there.
        rank_zero = rank_address(config, dp_rank, 0, tp_size)
        # This start of the engine: in every lease word, in the params and (through the lease
        # words file) in every rank's handshake, so nothing of an earlier start passes.
        self.incarnation = secrets.randbits(64) or 1
        self._endpoint = RemoteEndpoint(
            engine_id=engine_id,
            host=config.side_channel_host,
            port=rank_zero.side_channel_port,
            tp_size=tp_size,
            cluster_id=rank_zero.cluster_id,
            incarnation=self.incarnation,
        )
        # A random start keeps a restarted P engine from reissuing ids D still holds.
        self._next_lease_id = secrets.randbits(32)
        # request_id -> (lease id, slot), until the workers report it in finished_sending.
        self.leased: dict[str, tuple[int, int]] = {}
        self._to_send: list[SendSpec] = []
        # Remote-decode prompts: their length while they prefill, their tables, and the word
        # of each whose end was computed (until it finishes).
        self._prompt_lengths: dict[str, int] = {}
        self._tables = BlockTables()
        self.published: dict[str, _Published] = {}
        self._to_publish: list[WordSpec] = []
        self._to_clear: list[WordSpec] = []
        self._not_pushed: list[str] = []  # push mode: finished without a lease
        # One slot per lease in every rank's lease words (as many as blocks: a lease holds
        # a block at least).
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._write_incarnation(engine_id, dp_rank, tp_size)

    def follow(self, request: Request) -> None:
        """A request to prefill for a remote decode (``do_remote_decode``)."""
        if self._states:
            _stop_before_last_token(request, self._block_hashes())
        self._prompt_lengths[request.request_id] = request.num_prompt_tokens
        self._tables.follow(request.request_id)

    def step(self, scheduler_output: SchedulerOutput) -> tuple[list[WordSpec], list[WordSpec]]:
        """This step's word changes for the workers, (clears, publications): a word for each
        followed prompt the step computes to its end, over its blocks as vLLM holds them;
        the clears of words whose prompt will not lease (preempted or finished otherwise)."""
        self._tables.update(scheduler_output)
        # A followed request that comes back new or resumed was preempted: its blocks went.
        cached = scheduler_output.scheduled_cached_reqs
        returned = {new.req_id for new in scheduler_output.scheduled_new_reqs}
        returned |= resumed_ids(cached)
        for request_id in returned & self.published.keys():
            self._unpublish(request_id)
        computed = {
            new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs
        }
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, done in computed.items():
            length = self._prompt_lengths.get(request_id)
            if length is None or request_id in self.published:
                continue
            if done + scheduled.get(request_id, 0) >= length:
                self._publish(request_id, length)
        clears, self._to_clear = self._to_clear, []
        publications, self._to_publish = self._to_publish, []
        return clears, publications

    def lease(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keeps the prompt's blocks of every group under the lease its word was published
        for: (delay the free, the params for D)."""
        request_id = request.request_id
        self.forget(request_id)
        published = self.published.pop(request_id, None)
        # A sliding-window group holds the null block where its blocks left the window:
        # offered as such, never leased, and D never reads it.
        prompt_blocks = self._prompt_blocks(block_ids, request.num_prompt_tokens)
        if published is None:
            logger.warning("request %s: no lease word was published; D will compute it", request_id)
            return self._no_lease(request_id)
        if not _still_held(published.blocks, prompt_blocks):
            # The word names a block vLLM no longer holds for the request: no params may
            # name it, and a D computing the prompt is correct.
            self._clear(published)
            logger.warning(
                "request %s: its blocks changed after its prompt was computed; D will compute it",
                request_id,
            )
            return self._no_lease(request_id)
        leased = tuple(b for group in prompt_blocks for b in group if b != NULL_BLOCK_ID)
        if not leased:
            self._clear(published)
            return self._no_lease(request_id)
        lease_id, slot, word = published.lease_id, published.slot, published.word
        self.leased[request_id] = (lease_id, slot)
        # Push mode: the blocks go to the workers too, for a D that registers its own, and
        # the tokens P computed (a state holds that many).
        pushed, tokens = (prompt_blocks, request.num_prompt_tokens) if self._push else ((), 0)
        self._to_send.append(SendSpec(request_id, lease_id, slot, word, pushed, tokens))
        # The params name the blocks the word covers: D reads none that vLLM let go.
        return True, build_remote_decode_params(
            self._endpoint,
            request_id,
            published.blocks,
            request.num_prompt_tokens,
            (lease_id, slot),
            self._group_block_sizes,
            self._mode.value,
        )

    def drop(self, request_id: str) -> None:
        """A followed request finished without a lease (aborted, or not deliverable): its
        word, if published, is cleared."""
        self.forget(request_id)
        self._unpublish(request_id)
        self._no_lease(request_id)

    def _no_lease(self, request_id: str) -> tuple[bool, None]:
        """Push mode: a D may wait for this prompt's push; the workers tell it none comes."""
        if self._push:
            self._not_pushed.append(request_id)
        return False, None

    def take_not_pushed(self) -> list[str]:
        not_pushed, self._not_pushed = self._not_pushed, []
        return not_pushed

    def forget(self, request_id: str) -> None:
        self._prompt_lengths.pop(request_id, None)
        self._tables.forget(request_id)

    def _publish(self, request_id: str, num_prompt_tokens: int) -> None:
        blocks = self._prompt_blocks(self._tables[request_id], num_prompt_tokens)
        # A sliding-window group needs none of the blocks its window left behind; vLLM
        # lets them go once the prompt is computed, so the word never names them.
        behind = [
            blocks_left_behind(num_prompt_tokens, window, size)
            for window, size in zip(self._group_windows, self._group_block_sizes, strict=True)
        ]
        blocks = tuple(
            (NULL_BLOCK_ID,) * n + group[n:] for group, n in zip(blocks, behind, strict=True)
        )
        if not self._free_slots:  # cannot happen: every lease holds a block of its own
            logger.error("request %s: no free lease slot; D will compute it", request_id)
            return
        lease_id = self._new_lease_id()
        word = lease_word(lease_id, blocks, self.incarnation)
        published = _Published(lease_id, self._free_slots.pop(), word, blocks)
        self.published[request_id] = published
        self._to_publish.append(published.spec)

    def _unpublish(self, request_id: str) -> None:
        published = self.published.pop(request_id, None)
        if published is not None:
            self._clear(published)

    def _clear(self, published: _Published) -> None:
        """The workers clear the word before any later publication (same step or later), so
        its slot may go to the next lease now."""
        self._to_clear.append(published.spec)
        self._free_slots.append(published.slot)

    def prefilling(self, scheduler_output: SchedulerOutput) -> list[PromptBlocks]:
        """Push mode: the prompts this step computes to their end, so that the workers write
        each layer to a D that registered as soon as it is computed. Only requests the step
        schedules for the first time: a prompt prefilled in chunks is written once finished."""
        if not self._push:
            return []
        scheduled = scheduler_output.num_scheduled_tokens
        prompts = []
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids
            if prompt is None or not new.block_ids:
                continue
            if new.num_computed_tokens + scheduled.get(new.req_id, 0) < len(prompt):
                continue
            blocks = self._prompt_blocks(new.block_ids, len(prompt))
            prompts.append(PromptBlocks(new.req_id, blocks))
        return prompts

    def _prompt_blocks(
        self, block_ids: Sequence[Sequence[int]], num_prompt_tokens: int
    ) -> tuple[tuple[int, ...], ...]:
        """Each group's blocks that hold the prompt. D needs the prompt's KV only; blocks past
        it hold P's generated tokens (when the router asked P for more than one) and must not
        be offered. A state group offers the slot of its state after the prompt alone."""
        return tuple(
            self._state_block(group, num_prompt_tokens, block_size)
            if index in self._states
            else tuple(group[: blocks_for_tokens(num_prompt_tokens, block_size)])
            for index, (group, block_size) in enumerate(
                zip(block_ids, self._group_block_sizes, strict=True)
            )
        )

    def _state_block(
        self, row: Sequence[int], num_prompt_tokens: int, block_size: int
    ) -> tuple[int, ...]:
        """The slot of a state group's row that holds the state after the prompt; none
        where the row holds no state (a preempted request's, freed)."""
        try:
            return (row[state_slot(len(row), num_prompt_tokens, block_size, self._states)],)
        except ValueError:
            return ()

    def finished_sending(self, request_id: str) -> None:
        """Every rank cleared the lease's word before reporting it: the slot is free."""
        lease = self.leased.pop(request_id, None)
        if lease is not None:
            self._free_slots.append(lease[1])

    def take_sends(self) -> list[SendSpec]:
        """The leases taken since the last step, for the workers to hold."""
        sends, self._to_send = self._to_send, []
        return sends

    def _write_incarnation(self, engine_id: str, dp_rank: int, tp_size: int) -> None:
        """Into every TP rank's incarnation file, which the workers created when they
        registered their KV caches, before vLLM built this scheduler."""
        for rank in range(tp_size):
            nonce = IncarnationFile.open(incarnation_path(engine_id, dp_rank, rank))
            nonce.unlink()  # mapped by every process that uses it now
            nonce.nonce = self.incarnation  # the workers' handshakes announce it
            nonce.close()

    def _new_lease_id(self) -> int:
        lease_id = self._next_lease_id
        self._next_lease_id = (lease_id + 1) % LEASE_ID_MODULUS
        return lease_id


# Set in a truncated request's params, so that a preempted request is truncated once.
TRUNCATED = "_p_side_truncated"


def _stop_before_last_token(request: Request, block_hashes: tuple[int, int] | None) -> None:
    """A state model's prompt, truncated to what P computes for D (state_groups.tokens_to_load),
    and P asked for one token, as NixlConnector does (its flag is this one). Left whole: a
    one-token prompt, a request truncated before (preempted), and one that skips reading the
    prefix cache (prompt logprobs), which D computes whole."""
    params = request.kv_transfer_params
    keep = tokens_to_load(request.num_prompt_tokens, True)
    # Whether vLLM reads no KV from a connector for it: 0.34 names it skip_reading_external_kv
    # (prompt logprobs and skip_reading_prefix_cache alike), 0.32 and 0.33
    # skip_reading_prefix_cache.
    skips_cache = getattr(request, "skip_reading_external_kv", None)
    if skips_cache is None:
        skips_cache = getattr(request, "skip_reading_prefix_cache", False)
    if params is None or params.get(TRUNCATED) or keep < 1 or skips_cache:
        return
    dropped = request.num_prompt_tokens - keep
    if request.prompt_token_ids is not None:
        del request.prompt_token_ids[-dropped:]
    elif request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:-dropped]
    else:
        return
    del request._all_token_ids[-dropped:]
    request.num_prompt_tokens = keep
    request.max_tokens = 1
    truncate_hashes = getattr(request, "truncate_block_hashes", None)
    if truncate_hashes is not None and block_hashes is not None:
        # A full block's hash must not name the token P no longer has (prefix caching).
        truncate_hashes(*block_hashes)
    params[TRUNCATED] = True


def _still_held(published: BlockTable, held: BlockTable) -> bool:
    """Whether vLLM still holds every block a word names, where the word names it (a block
    the word leaves out may be held or gone)."""
    return len(published) == len(held) and all(
        len(words) == len(ids)
        and all(p in (NULL_BLOCK_ID, h) for p, h in zip(words, ids, strict=True))
        for words, ids in zip(published, held, strict=True)
    )
