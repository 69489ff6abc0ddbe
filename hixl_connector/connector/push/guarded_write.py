"""Why push mode never decodes wrong KV, in one place: grants, layers, the push word, revoke.

A request's push is, for each P rank that holds KV heads D reads (as a pull would read them:
tp_mapping), one ``Writer`` on D: the grants D gave that P rank's cluster for those heads of
the request's blocks, and one push word of D's own. P writes the blocks' layers under the
grants, then its lease word into the push word; D decodes once every writer's word is set.

The argument, for the native engine (push mode refuses other back-ends at start):

1. **The word is last, and only after every write landed** (P: ``request_push``). A request's
   writes run in order on one serial queue (``SerialJobs``), the word last, and only when
   every write before it succeeded; each write returns only once its bytes landed in D.
   So a set word means every block of that writer landed.
2. **The word vouches for P's blocks** (P). It is written while P's lease is pinned, so the
   blocks cannot be freed under the writes. A layer written before the lease existed came
   from blocks the running request owned; had the request ended otherwise (aborted: its
   blocks freed and reused), it gets no lease, so no word: D gives up, and what was written
   is never decoded.
3. **Nothing lands outside a grant** (D's engine). Every write names its grant, and D's
   engine refuses one into a unit that grant does not hold, so a write meant for another
   request (an earlier one that used these blocks, or a P that restarted since) never lands
   here. Grant ids start at random, so a new start of either side reissues none. The word
   is granted last (``grant_writer``), so P cannot set it before it may write the blocks.
4. **Nothing lands after D lets go** (D). D revokes a request's grants before it reports the
   request, ok or failed (``revoke_writer``); a revoke returns only once no write under the
   grant is in flight and refuses every later one. A same-host write is copied in by D's
   engine over its transfer threads and holds its grant until every thread is done with
   it, so this holds for each thread's bytes alike. Once vLLM may free or reuse a block
   (after the report), nothing writes it. The word's slot is freed only after its grant
   was revoked, so a word P sets late never passes for another request's.
5. **D does not wait forever** (D: ``receiver``). It gives up after ``push_timeout_s``, or
   sooner where P says it gave up or P is gone (``status``); giving up is revoking first,
   as in 4.

Checked by ``tests/engine/test_native_grants.py`` (3 and 4, with many threads),
``tests/engine/test_layered_push.py`` (1 and 2) and ``tests/unit/test_request_push.py``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from hixl_connector.connector.kv.registered_kv import RegisteredCache, RegisteredKV
from hixl_connector.connector.kv.word_memory import WordMemory
from hixl_connector.connector.peers.registry import Peer
from hixl_connector.connector.push.registration import HeadRun

logger = logging.getLogger(__name__)

# How long a revoke waits for a write under way before it tries again.
REVOKE_WAIT_S = 1.0


@dataclass
class Writer:
    """One P rank registered with for a request: what it may write here, and its word."""

    peer: Peer
    grants: list[int] = field(default_factory=list)  # every grant it holds, the word's last
    cache_grants: tuple[int, ...] = ()  # of them, each registered KV cache's, in order
    state_grant: int = 0  # of them, the state units' (where it writes states)
    slot: int | None = None  # None: it writes nothing here (a replica nobody reads)


class PushWords:
    """D's push words: a slot per writer of a request awaited now, cleared when taken."""

    def __init__(self, memory: WordMemory) -> None:
        self._memory = memory
        self._lock = threading.Lock()
        self._free = list(range(len(memory) - 1, -1, -1))

    def take(self) -> int:
        """A free slot, its word cleared; raises RuntimeError when every one is taken."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {len(self._memory)} push words are taken")
            slot = self._free.pop()
        self._memory.zero(slot, 1)
        return slot

    def is_set(self, slot: int) -> bool:
        """Whether P wrote the word at ``slot``."""
        return bool(self._memory.read(slot, 1)[0])

    def free(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


def grant_writer(
    kv: RegisteredKV,
    words: PushWords,
    writer: Writer,
    blocks: Sequence[int],
    heads: Sequence[HeadRun],
    sliced: bool,
    state_units: Sequence[int] = (),
) -> None:
    """Grants ``writer`` the KV heads ``heads`` of ``blocks`` in every registered KV cache
    (their slices, where ``sliced``: P's blocks are smaller) and ``state_units`` of the
    registered state, then a cleared push word, last."""
    cluster_id = writer.peer.cluster_id
    parts = (kv.slices,) if sliced and kv.slices is not None else kv.caches
    # No blocks (D holds the prompt's KV, and takes a state alone): no grant to make.
    for part in parts if blocks else ():
        units = granted_units(blocks, heads, kv.caches[0].units_per_block, part)
        writer.grants.append(kv.grant(cluster_id, part, units))
    writer.cache_grants = tuple(writer.grants)
    if state_units:
        if kv.state is None:
            raise ValueError("this engine registered no state: its model has none")
        writer.state_grant = kv.grant(cluster_id, kv.state, state_units)
        writer.grants.append(writer.state_grant)
    writer.slot = words.take()
    assert kv.push_words is not None
    writer.grants.append(kv.grant(cluster_id, kv.push_words, [writer.slot]))


def revoke_writer(kv: RegisteredKV, words: PushWords, writer: Writer) -> None:
    """Revokes every grant ``writer`` still holds (each only once), then frees its word.
    Raises the engine's LLM_TIMEOUT error while a write under a grant is still under way
    (its blocks are not D's yet: try again)."""
    timeout = kv.api.LLMStatusCode.LLM_TIMEOUT
    while writer.grants:
        try:
            kv.revoke(writer.grants[-1], REVOKE_WAIT_S)
        except Exception as e:
            if getattr(e, "status_code", None) == timeout:
                raise
            # Not a grant any more (the engine closed): nothing can write under it.
            logger.warning("hixl: grant %d: %s", writer.grants[-1], e)
        writer.grants.pop()
    if writer.slot is not None:
        words.free(writer.slot)
        writer.slot = None


def granted_units(
    blocks: Sequence[int], heads: Sequence[HeadRun], units_per_block: int, part: RegisteredCache
) -> list[int]:
    """The units of ``part`` that hold KV heads ``heads`` (their ``dst``) of ``blocks``, in
    blocks of ``units_per_block`` heads: the heads themselves, or every slice of them where
    ``part`` registers the KV in slices (``part.units_per_block`` slices a block)."""
    per_head = part.units_per_block // units_per_block
    return [
        (block * units_per_block + head) * per_head + piece
        for block in blocks
        for run in heads
        for head in range(run.dst, run.dst + run.count)
        for piece in range(per_head)
    ]
