"""D: which remote prefills are read in the step that computes their first token.

vLLM loads a request's KV either asynchronously (the request waits in WAITING_FOR_REMOTE_KVS
while the others decode, and its first token comes in the step after the KV landed) or in
the step that computes its first token (a synchronous load: the read lands before that
step's forward, which waits for it). The second saves a whole step of TTFT and costs that
step the read's time, so it pays for small reads only. A read goes in the step when
- its KV on this rank is at most ``load_in_step_bytes`` (a same-host read that small is
  copied on the step thread anyway);
- a read from the same P engine succeeded and no read failed since: every P rank it reads
  is then linked, so no handshake holds up the forward (the first request from each P engine
  loads asynchronously and links it);
- the model has one KV-cache group: vLLM reports a failed synchronous load as invalid block
  ids, which it cannot map back to requests across several groups.
A failed in-step read is reported as the request's invalid blocks, so vLLM's
kv_load_failure_policy applies as to any failed load; then every P engine loads
asynchronously again until a read from it succeeds.

Pure bookkeeping of the scheduler half: no engine, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from hixl_connector.connector.blocks import blocks_for_tokens
from hixl_connector.connector.metadata import RemoteEndpoint

# P engines remembered as linked; beyond this many the least recently confirmed is dropped
# (it loads asynchronously once more): engines come and go over a long run.
MAX_LINKED_ENGINES = 4096


class InStepLoads:
    def __init__(self, limit_bytes: int, block_bytes: int, block_size: int) -> None:
        """``block_bytes``: the bytes one block holds on this rank, every layer together
        (0 when they are unknown: nothing is read in the step)."""
        self._limit_bytes = limit_bytes
        self._block_bytes = block_bytes
        self._block_size = block_size
        self._linked: dict[RemoteEndpoint, None] = {}  # insertion order: oldest first
        self._loading: dict[str, RemoteEndpoint] = {}  # async reads not reported yet
        # Requests chosen to read in the step, until allocated: tokens of their local hit.
        self._chosen: dict[str, int] = {}

    def wanted(self, remote: RemoteEndpoint, num_computed: int, num_tokens: int) -> bool:
        """Whether the KV of prompt tokens [num_computed, num_tokens) from ``remote`` is
        read in the step that computes the first token."""
        if not self._block_bytes or remote not in self._linked or num_tokens - num_computed < 2:
            return False
        first_block = num_computed // self._block_size
        blocks = blocks_for_tokens(num_tokens, self._block_size) - first_block
        return blocks * self._block_bytes <= self._limit_bytes

    def choose(
        self, request_id: str, remote: RemoteEndpoint | None, num_computed: int, num_tokens: int
    ) -> bool:
        """``wanted`` (never without a ``remote``), remembered for the request's allocation
        (vLLM may ask again before it allocates: the last answer holds)."""
        if remote is not None and self.wanted(remote, num_computed, num_tokens):
            self._chosen[request_id] = num_computed
            return True
        self._chosen.pop(request_id, None)
        return False

    def allocated(self, request_id: str) -> int | None:
        """The tokens of the local hit of a request chosen to read in the step, now that
        it is allocated; None for an asynchronous read."""
        return self._chosen.pop(request_id, None)

    def loading(self, request_id: str, remote: RemoteEndpoint) -> None:
        """An asynchronous read of ``request_id`` from ``remote`` was handed to the worker."""
        self._loading[request_id] = remote

    def forget(self, request_id: str) -> None:
        """The request ended before its read was reported."""
        self._loading.pop(request_id, None)
        self._chosen.pop(request_id, None)

    def reported(
        self, finished: Iterable[str], failed: Iterable[str], in_step_failed: bool
    ) -> None:
        """What the workers reported for a step: asynchronous reads that ended (those in
        ``failed`` failed), and whether any in-step read failed."""
        failed = set(failed)
        for request_id in finished:
            remote = self._loading.pop(request_id, None)
            if remote is None:
                continue
            self._linked.pop(remote, None)
            if request_id not in failed:  # re-inserted: the most recently confirmed
                self._linked[remote] = None
                while len(self._linked) > MAX_LINKED_ENGINES:
                    del self._linked[next(iter(self._linked))]
        if in_step_failed:
            self._linked.clear()

    def linked_engines(self) -> int:
        return len(self._linked)
