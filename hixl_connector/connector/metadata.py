"""What the scheduler half tells the worker half each step: the per-step
``HixlConnectorMetadata`` (pickled by vLLM) and the specs in it. The prefill engines they
name are ``endpoints``.

What P tells D through the router (``kv_transfer_params``) is in ``transfer_params``; the
worker <-> worker messages live beside it: the handshake in ``peers.handshake``, the
done/heartbeat/release notices in ``leases.messages``, push registrations in
``push.registration``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hixl_connector.connector.endpoints import RemoteEndpoint


@dataclass(frozen=True)
class RecvSpec:
    """D: pull ``remote_block_ids`` into ``local_block_ids`` (suffix-trimmed).

    A non-empty ``error`` means the scheduler refused the transfer (unusable params, or P
    offers fewer blocks than D needs). The worker must then report the request in
    ``failed_recving`` (and ``finished_recving``) with that message, pull nothing, and
    send "release" to P when ``remote.engine_id`` is known.

    ``synchronous``: vLLM computes the request's first token in this very step (a synchronous
    load), so the read must have landed before the forward; a failure is reported as the
    request's invalid blocks, and nothing in ``finished_recving``.
    """

    request_id: str
    remote_request_id: str
    lease_id: int
    remote: RemoteEndpoint
    local_block_ids: tuple[int, ...]
    # ``blocks_per_block`` of P's blocks per local block: P's may be smaller (block_slices);
    # NULL_BLOCK_ID where the prompt ends before the last local block does.
    remote_block_ids: tuple[int, ...]
    error: str = ""
    blocks_per_block: int = 1
    # Where P publishes the lease, and the word D must find there around its read.
    lease_slot: int = 0
    lease_word: int = 0
    synchronous: bool = False
    # A hybrid state model's state slots (state_groups): (group, P's block, local block)
    # each; apart from the token blocks above, since a state moves by its own bytes.
    state_block_ids: tuple[tuple[int, int, int], ...] = ()

    @property
    def every_local_block(self) -> tuple[int, ...]:
        """The request's local blocks the read fills, state slots included."""
        return self.local_block_ids + tuple(local for _, _, local in self.state_block_ids)


@dataclass(frozen=True)
class ReleaseSpec:
    """D: nothing to pull (full local prefix hit, or aborted before allocation); free P."""

    request_id: str
    remote_request_id: str
    lease_id: int
    remote: RemoteEndpoint


@dataclass(frozen=True)
class WordSpec:
    """P: lease word ``word`` in slot ``slot`` of every rank's lease words, to publish or to
    clear (leases.guarded_read)."""

    slot: int
    word: int


@dataclass(frozen=True)
class SendSpec:
    """P: keep a request's blocks leased until "done"/"release" from every consumer, or
    expiry. The blocks themselves stay with vLLM (delay-free) and in the lease word."""

    request_id: str
    lease_id: int
    slot: int  # its lease word's slot (leases.guarded_read)
    word: int  # the word published there
    # Push mode: the prompt's blocks of each KV-cache group, by position, for a D that
    # registers its own blocks for this request instead of pulling ...
    block_ids: tuple[tuple[int, ...], ...] = ()
    # ... and the prompt tokens P computed (a state model's state holds that many).
    num_tokens: int = 0


@dataclass(frozen=True)
class PromptBlocks:
    """P, push mode: a prompt the step's forward computes to its end, and its blocks of
    each KV-cache group by position: a D that registered for it is written each layer as
    the forward computes it."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PushRecvSpec:
    """D, push mode: P writes the prompt's blocks at ``positions`` into ``local_block_ids``
    under grants of this rank's, ``groups`` of them in each KV-cache group in order (()
    for one group), and its states into ``state_block_ids``. No blocks: D takes none, so P
    frees its own at once.

    ``remote`` is P as the router names it in a concurrent push (engine id, host, port,
    tp_size): its cluster id and incarnation (0 here) come from P's handshake."""

    request_id: str
    base_request_id: str  # what P's request id shares with D's (base_request_id)
    remote: RemoteEndpoint
    positions: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    groups: tuple[int, ...] = ()
    # A hybrid state model's state slots (state_groups): (group, local block) each, which
    # P fills from its own slot of that group, holding the state after ``num_tokens`` prompt
    # tokens; a state group has no ``positions``.
    state_block_ids: tuple[tuple[int, int], ...] = ()
    num_tokens: int = 0

    @property
    def every_local_block(self) -> tuple[int, ...]:
        """The request's local blocks P writes, state slots included."""
        return self.local_block_ids + tuple(local for _, local in self.state_block_ids)

    @property
    def remote_request_id(self) -> str:
        """How P's logs and digests name the request: by the base both ids share."""
        return self.base_request_id


@dataclass(frozen=True)
class WaitingRead:
    """D: a request waiting for its KV, under P's lease ``lease_id`` of ``remote_request_id``."""

    request_id: str
    remote: RemoteEndpoint
    remote_request_id: str
    lease_id: int


@dataclass
class HixlConnectorMetadata:
    """One step's work for the workers. A plain dataclass, so the scheduler half imports no
    vLLM (and no torch); the connector registers it as vLLM's KVConnectorMetadata."""

    to_recv: list[RecvSpec] = field(default_factory=list)
    to_release: list[ReleaseSpec] = field(default_factory=list)
    to_send: list[SendSpec] = field(default_factory=list)
    # P: lease words the workers clear, then those they publish, before the step's forward.
    to_clear: list[WordSpec] = field(default_factory=list)
    to_publish: list[WordSpec] = field(default_factory=list)
    to_push_recv: list[PushRecvSpec] = field(default_factory=list)
    prefilling: list[PromptBlocks] = field(default_factory=list)
    # P, push mode: prompts that finished without a lease (aborted, not deliverable, their
    # blocks changed): no push will come for them, and a D waiting for one is told so.
    not_pushed: list[str] = field(default_factory=list)
    # D: requests aborted after their RecvSpec: not read if not yet read, P told at once.
    to_cancel: list[str] = field(default_factory=list)
    # D: requests that began waiting for their KV this step (their leases are renewed while
    # they wait), and those that stopped waiting: changes only, so a step costs the same
    # whether ten or thousands of requests wait.
    waiting: list[WaitingRead] = field(default_factory=list)
    done_waiting: list[str] = field(default_factory=list)
    # Nothing was scheduled this step: vLLM runs it only to collect finished transfers.
    idle: bool = False
