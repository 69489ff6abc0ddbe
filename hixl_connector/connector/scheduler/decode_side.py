"""D's side of the scheduler half: asks vLLM for a request's remote tokens, asynchronously or,
for a small read every worker reads in place, in the step that computes the first token
(``sync_loads``, fed by the workers' link reports); turns each allocation into one
``RecvSpec`` (or a ``ReleaseSpec`` when there is nothing to pull), and lists the remote
requests that begin and stop waiting, so the workers renew P's leases meanwhile.

Protocol errors (params that cannot drive a pull, or P offering fewer blocks than D
allocated) are never turned into a silent local recompute: the request still parks in
WAITING_FOR_REMOTE_KVS and gets a ``RecvSpec`` with ``error`` set and no remote blocks, which
the worker reports as failed, so vLLM's ``kv_load_failure_policy`` decides.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hixl_connector.connector.endpoints import UNKNOWN_ENDPOINT, RemoteEndpoint
from hixl_connector.connector.leases.guarded_read import lease_word
from hixl_connector.connector.link_reports import LinkReport
from hixl_connector.connector.mapping.kv_groups import (
    Unfilled,
    blocks_to_fill,
    remote_blocks_to_read,
)
from hixl_connector.connector.mapping.state_groups import NO_STATE, StateGroups, tokens_to_load
from hixl_connector.connector.metadata import PushRecvSpec, RecvSpec, ReleaseSpec, WaitingRead
from hixl_connector.connector.scheduler.misconfig import Misconfigurations
from hixl_connector.connector.scheduler.sync_loads import SyncLoads
from hixl_connector.connector.transfer_params import (
    OWN_PARAMS,
    InvalidTransferParams,
    RemotePrefill,
    base_request_id,
    is_push_identity,
    parse_push_identity,
    parse_remote_prefill,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Asked:
    """A request's kv_transfer_params as D reads them: parsed once, read by every later hook."""

    pushed: bool  # push mode: the params name P only, and P writes the KV here
    prefill: RemotePrefill | None = None  # pull: what to read, under which lease
    writer: RemoteEndpoint | None = None  # push: the prefill engine that writes
    error: str = ""  # the params cannot drive a transfer: why


@dataclass
class DecodeStep:
    """What D's side hands the workers for one step."""

    to_recv: list[RecvSpec]
    to_push_recv: list[PushRecvSpec]
    to_release: list[ReleaseSpec]
    to_cancel: list[str]
    waiting: list[WaitingRead]
    done_waiting: list[str]


class DecodeSide:
    def __init__(
        self,
        loads: SyncLoads,
        group_block_sizes: Sequence[int],
        misconfigured: Misconfigurations,
        push: bool = False,
        states: StateGroups = NO_STATE,
    ) -> None:
        self.loads = loads  # which reads go in the step that computes the first token
        self._group_block_sizes = tuple(group_block_sizes)
        # A hybrid state model's state groups: D loads all but the prompt's last token.
        self._states = states
        self._misconfigured = misconfigured
        self._push = push
        # Requests whose RecvSpec went out and whose KV has not been reported yet.
        self.receiving: set[str] = set()
        # Requests waiting for their KV, from on_new_request until it arrived (or never will);
        # the workers learn of the changes only (take_step).
        self.waiting: dict[str, WaitingRead] = {}
        self._began_waiting: dict[str, WaitingRead] = {}
        self._done_waiting: list[str] = []
        self._to_recv: list[RecvSpec] = []
        self._to_push_recv: list[PushRecvSpec] = []
        self._to_release: list[ReleaseSpec] = []
        self._to_cancel: list[str] = []
        # Each request's parsed params, from its first hook until request_finished.
        self._asked: dict[str, _Asked] = {}

    def on_new_request(self, request_id: str, params: dict[str, Any]) -> None:
        """A request that asks for remote prefill: its lease is renewed while it waits."""
        asked = self._ask(request_id, params)
        if asked.pushed:
            return  # no lease to renew: P holds its blocks until it wrote them here
        prefill = asked.prefill
        if prefill is None:
            # The request fails when it is allocated (RecvSpec with an error), not here:
            # the scheduler cannot fail a request on its own.
            logger.error("request %s: %s", request_id, asked.error)
            if not any(key in params for key in OWN_PARAMS):
                self._misconfigured.note("foreign_params", request_id, ", ".join(OWN_PARAMS))
            return
        read = WaitingRead(request_id, prefill.remote, prefill.remote_request_id, prefill.lease_id)
        self.waiting[request_id] = self._began_waiting[request_id] = read

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self._states:
            # The state after all but the last token, read asynchronously (a read in the
            # step reads one group); this step's forward computes the last token.
            count = tokens_to_load(request.num_prompt_tokens, True) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        count = request.num_prompt_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        waiting = self.waiting.get(request.request_id)
        remote = waiting.remote if waiting is not None else None
        if self.loads.choose(
            request.request_id, remote, num_computed_tokens, request.num_prompt_tokens
        ):
            # Read before this step's forward, which computes the last prompt token itself
            # (for its logits) and so the first output token.
            return count - 1, False
        return count, True

    def update_state_after_alloc(
        self, request: Request, params: dict[str, Any], blocks: KVCacheBlocks, external: int
    ) -> None:
        # One transfer per request: a second call (after the load) must not pull again.
        params["do_remote_prefill"] = False
        request_id = request.request_id
        local_hit = self.loads.allocated(request_id)
        synchronous = local_hit is not None
        tokens = tokens_to_load(request.num_prompt_tokens, bool(self._states))
        asked = self._ask(request_id, params)
        try:
            unfilled = blocks_to_fill(
                blocks.blocks, local_hit, self._group_block_sizes, tokens, self._states
            )
        except ValueError as exc:  # a state row without the slot of the state read
            self._fail_later(
                request_id, asked.prefill, (), f"request {request_id}: {exc}", synchronous
            )
            return
        if asked.pushed:
            self._push_recv(request_id, asked, unfilled, external, tokens)
            return
        local = tuple(block for _, group_blocks in unfilled for block in group_blocks)
        prefill = asked.prefill
        if prefill is None:
            self._stop_waiting(request_id)
            if external > 0:
                self._fail_later(request_id, None, local, asked.error, synchronous)
            else:
                logger.error(
                    "request %s: nothing to pull, P not notified: %s", request_id, asked.error
                )
            return
        if external <= 0:
            self._release(request_id, prefill)
            return
        try:
            remote, ratio = remote_blocks_to_read(
                prefill, tokens, unfilled, self._group_block_sizes, self._states
            )
        except ValueError as exc:
            self._fail_later(
                request_id, prefill, local, f"request {request_id}: {exc}", synchronous
            )
            return
        if synchronous:  # its KV is there once this step's forward starts: no lease to renew
            self._stop_waiting(request_id)
        else:
            self.receiving.add(request_id)
        self._to_recv.append(
            RecvSpec(
                request_id=request_id,
                remote_request_id=prefill.remote_request_id,
                lease_id=prefill.lease_id,
                remote=prefill.remote,
                local_block_ids=tuple(
                    block
                    for index, (_, group) in enumerate(unfilled)
                    if index not in self._states
                    for block in group
                ),
                remote_block_ids=tuple(
                    block
                    for index, group in enumerate(remote)
                    if index not in self._states
                    for block in group
                ),
                state_block_ids=tuple(
                    (index, p_block, d_block)
                    for index in self._states.indices
                    for p_block, d_block in zip(remote[index], unfilled[index][1], strict=True)
                ),
                blocks_per_block=ratio,
                lease_slot=prefill.lease_slot,
                lease_word=lease_word(
                    prefill.lease_id, prefill.block_ids, prefill.remote.incarnation
                ),
                synchronous=synchronous,
            )
        )

    def report(self, links: LinkReport) -> None:
        self.loads.report(links)

    def finished_recving(self, request_id: str) -> None:
        self._stop_waiting(request_id)
        self.receiving.discard(request_id)

    def request_finished(self, request: Request) -> bool:
        """Ends what D holds for the request; True when it was still to read remote KV
        (then P is told to free its blocks, and P's side has nothing to do)."""
        request_id = request.request_id
        self._stop_waiting(request_id)
        self.loads.forget(request_id)
        asked = self._asked.pop(request_id, None)
        if request_id in self.receiving:
            # Aborted while its KV is on the way: the worker skips the read if it has not
            # started and tells P now. vLLM keeps the blocks until the worker reports it.
            self._to_cancel.append(request_id)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return False
        # Finished before its blocks were allocated (e.g. aborted): P still leases the
        # blocks, so tell it to free them now rather than at lease expiry.
        params["do_remote_prefill"] = False
        asked = asked or self._parse(params)
        if asked.pushed:
            self._push_recv(request_id, asked, [], 0)
        elif asked.prefill is not None:
            self._release(request_id, asked.prefill)
        else:
            logger.error(
                "request %s: cannot release its remote blocks: %s", request_id, asked.error
            )
        return True

    def take_step(self) -> DecodeStep:
        step = DecodeStep(
            self._to_recv,
            self._to_push_recv,
            self._to_release,
            self._to_cancel,
            list(self._began_waiting.values()),
            self._done_waiting,
        )
        self._to_recv, self._to_release, self._to_cancel = [], [], []
        self._to_push_recv = []
        self._began_waiting, self._done_waiting = {}, []
        return step

    def _ask(self, request_id: str, params: dict[str, Any]) -> _Asked:
        """The request's params, parsed at its first hook."""
        asked = self._asked.get(request_id)
        if asked is None:
            asked = self._asked[request_id] = self._parse(params)
        return asked

    def _parse(self, params: dict[str, Any]) -> _Asked:
        # Push mode: params that name P only (a concurrent leg) make P write the KV here.
        pushed = self._push and is_push_identity(params)
        try:
            if pushed:
                return _Asked(True, writer=parse_push_identity(params))
            return _Asked(False, prefill=parse_remote_prefill(params))
        except InvalidTransferParams as exc:
            return _Asked(pushed, error=str(exc))

    def _push_recv(
        self,
        request_id: str,
        asked: _Asked,
        unfilled: Sequence[Unfilled],
        external: int,
        num_tokens: int = 0,
    ) -> None:
        """P writes the unfilled blocks (none: P frees its own at once), a state model's
        states holding ``num_tokens`` prompt tokens."""
        if external <= 0:
            unfilled = ()
        local = tuple(block for _, group_blocks in unfilled for block in group_blocks)
        remote = asked.writer
        if remote is None:
            if external > 0:
                self._fail_later(request_id, None, local, asked.error, False)
            else:
                logger.error(
                    "request %s: nothing to receive, P not told: %s", request_id, asked.error
                )
            return
        # A state group's slot is no prompt position: P writes its own slot's state there.
        token_groups = [
            group if i not in self._states else ((), ()) for i, group in enumerate(unfilled)
        ]
        positions = tuple(p for group_positions, _ in token_groups for p in group_positions)
        groups = tuple(len(group_positions) for group_positions, _ in token_groups)
        states = tuple(
            (index, block)
            for index, (_, blocks) in enumerate(unfilled)
            if index in self._states
            for block in blocks
        )
        if external > 0:
            self.receiving.add(request_id)
        base = base_request_id(request_id)
        token_blocks = tuple(block for _, group_blocks in token_groups for block in group_blocks)
        loaded = num_tokens if states else 0
        spec = PushRecvSpec(
            request_id, base, remote, positions, token_blocks, groups, states, loaded
        )
        self._to_push_recv.append(spec)

    def _stop_waiting(self, request_id: str) -> None:
        if self.waiting.pop(request_id, None) is None:
            return
        if self._began_waiting.pop(request_id, None) is None:  # the workers know of it
            self._done_waiting.append(request_id)

    def _release(self, request_id: str, prefill: RemotePrefill) -> None:
        self._stop_waiting(request_id)
        self._to_release.append(
            ReleaseSpec(request_id, prefill.remote_request_id, prefill.lease_id, prefill.remote)
        )

    def _fail_later(
        self,
        request_id: str,
        prefill: RemotePrefill | None,
        local: tuple[int, ...],
        error: str,
        synchronous: bool,
    ) -> None:
        """Hands the request to the workers to fail: vLLM applies kv_load_failure_policy."""
        logger.error("refusing the remote prefill of request %s: %s", request_id, error)
        self._stop_waiting(request_id)
        self._to_recv.append(
            RecvSpec(
                request_id=request_id,
                remote_request_id=prefill.remote_request_id if prefill else "",
                lease_id=prefill.lease_id if prefill else 0,
                remote=prefill.remote if prefill else UNKNOWN_ENDPOINT,
                local_block_ids=local,
                remote_block_ids=(),
                error=error,
                synchronous=synchronous,
            )
        )
