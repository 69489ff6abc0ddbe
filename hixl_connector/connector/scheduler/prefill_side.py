"""P's side of the scheduler half: a finished prefill's blocks stay with vLLM (delay-free)
under a fresh lease, published in every TP rank's lease word before the ``kv_transfer_params``
D needs leave the engine; the slot returns once every rank reported the lease finished."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.leases.guarded_read import LeaseWords, lease_word, words_path
from hixl_connector.connector.mapping.blocks import NULL_BLOCK_ID, blocks_for_tokens
from hixl_connector.connector.metadata import PromptBlocks, RemoteEndpoint, SendSpec
from hixl_connector.connector.peers.rank_addresses import rank_address
from hixl_connector.connector.transfer_params import build_remote_decode_params

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

LEASE_ID_MODULUS = 2**64


class PrefillSide:
    def __init__(
        self,
        config: HixlConfig,
        engine_id: str,
        dp_rank: int,
        tp_size: int,
        group_block_sizes: Sequence[int],
    ) -> None:
        self._group_block_sizes = tuple(group_block_sizes)
        self._push = config.transfer_mode == "push"
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
        self._words = self._map_lease_words(engine_id, dp_rank, tp_size)
        self._free_slots = list(range(min(w.slots for w in self._words) - 1, -1, -1))

    def lease(
        self, request: Request, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keeps the prompt's blocks of every group under a fresh lease: (delay the free,
        the params for D)."""
        request_id = request.request_id
        # A sliding-window group holds the null block where its blocks left the window:
        # offered as such, never leased, and D never reads it.
        prompt_blocks = self._prompt_blocks(block_ids, request.num_prompt_tokens)
        leased = tuple(b for group in prompt_blocks for b in group if b != NULL_BLOCK_ID)
        if not leased:
            return False, None
        if not self._free_slots:  # cannot happen: every lease holds a block of its own
            logger.error("request %s: no free lease slot; D will compute it", request_id)
            return False, None
        slot = self._free_slots.pop()
        lease_id = self._new_lease_id()
        word = lease_word(lease_id, prompt_blocks, self.incarnation)
        # Published before kv_transfer_params leave the engine: D can check it at once.
        for rank_words in self._words:
            rank_words.publish(slot, word)
        self.leased[request_id] = (lease_id, slot)
        # Push mode: the blocks go to the workers too, for a D that registers its own.
        pushed = prompt_blocks if self._push else ()
        self._to_send.append(SendSpec(request_id, lease_id, slot, word, pushed))
        return True, build_remote_decode_params(
            self._endpoint,
            request_id,
            prompt_blocks,
            request.num_prompt_tokens,
            (lease_id, slot),
            self._group_block_sizes,
            "push" if self._push else "pull",
        )

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
        be offered."""
        return tuple(
            tuple(group[: blocks_for_tokens(num_prompt_tokens, block_size)])
            for group, block_size in zip(block_ids, self._group_block_sizes, strict=True)
        )

    def finished_sending(self, request_id: str) -> None:
        """Every rank cleared the lease's word before reporting it: the slot is free."""
        lease = self.leased.pop(request_id, None)
        if lease is not None:
            self._free_slots.append(lease[1])

    def take_sends(self) -> list[SendSpec]:
        """The leases taken since the last step, for the workers to hold."""
        sends, self._to_send = self._to_send, []
        return sends

    def _map_lease_words(self, engine_id: str, dp_rank: int, tp_size: int) -> list[LeaseWords]:
        """Every TP rank's lease words: the workers created them when they registered their
        KV caches, before vLLM built this scheduler."""
        words = [LeaseWords.open(words_path(engine_id, dp_rank, rank)) for rank in range(tp_size)]
        for rank_words in words:  # mapped by every process that uses them now
            rank_words.unlink()
            rank_words.incarnation = self.incarnation  # the workers' handshakes announce it
        return words

    def _new_lease_id(self) -> int:
        lease_id = self._next_lease_id
        self._next_lease_id = (lease_id + 1) % LEASE_ID_MODULUS
        return lease_id
