"""D: which remote prefills are read in the step that computes their first token.

vLLM loads a request's KV either asynchronously (the request waits in WAITING_FOR_REMOTE_KVS
while the others decode, and its first token comes in the step after the KV landed) or in
the step that computes its first token (a synchronous load: the read lands before that
step's forward, which waits for it). The second saves a whole step of TTFT and costs that
step the read's time, so it pays for small reads only, and only where the step cannot end up
waiting on a peer. A read goes in the step when
- its KV on this rank is at most ``sync_load_bytes`` (a same-host read that small is
  copied on the step thread anyway);
- every D rank reported that it reads every P rank it needs of that engine in place
  (link_reports): a same-host, one-sided copy that ends whatever P does. A read over the
  network always loads asynchronously: a synchronous load that did not land has no way back
  to waiting in vLLM, only to invalid blocks, so a slow peer would stall the step or fail
  the request. The first request from each P engine therefore loads asynchronously and
  links it;
- the model has one KV-cache group: vLLM reports a failed synchronous load as invalid block
  ids, which it cannot map back to requests across several groups.
A failed synchronous read is reported as the request's invalid blocks, so vLLM's
kv_load_failure_policy applies as to any failed load.

Pure bookkeeping of the scheduler half: no engine, no I/O.
"""

from __future__ import annotations

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.link_reports import LinkReport, put_newest
from hixl_connector.connector.mapping.blocks import blocks_for_tokens


class SyncLoads:
    def __init__(self, limit_bytes: int, block_bytes: int, block_size: int, ranks: int) -> None:
        """``block_bytes``: the bytes one block holds on this rank, every layer together
        (0 when they are unknown: nothing is read in the step); ``ranks``: this engine's
        TP size (every rank must read in place)."""
        self._limit_bytes = limit_bytes
        self._block_bytes = block_bytes
        self._block_size = block_size
        self._ranks = ranks
        # Engine -> the D ranks that read it in place; insertion order: oldest first.
        self._in_place: dict[RemoteEndpoint, set[int]] = {}
        # Requests chosen to read in the step, until allocated: tokens of their local hit.
        self._chosen: dict[str, int] = {}

    def wanted(self, remote: RemoteEndpoint, num_computed: int, num_tokens: int) -> bool:
        """Whether the KV of prompt tokens [num_computed, num_tokens) from ``remote`` is
        read in the step that computes the first token."""
        if not self._block_bytes or num_tokens - num_computed < 2:
            return False
        if len(self._in_place.get(remote, ())) < self._ranks:
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

    def forget(self, request_id: str) -> None:
        """The request ended before it was allocated."""
        self._chosen.pop(request_id, None)

    def report(self, report: LinkReport) -> None:
        """What the workers learned of their links in a step."""
        for rank, changes in report.ranks.items():
            for remote, in_place in changes.items():
                ranks = self._in_place.pop(remote, set())
                if in_place:
                    ranks.add(rank)
                else:
                    ranks.discard(rank)
                if ranks:
                    put_newest(self._in_place, remote, ranks)

    def in_place_engines(self) -> int:
        """P engines read in place by every rank."""
        return sum(len(ranks) >= self._ranks for ranks in self._in_place.values())
