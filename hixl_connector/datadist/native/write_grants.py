"""Write grants, an extension of the native engine (not in CANN's API): with
``LLMConfig.hixl_writes_by_grant`` every remote-accessible blocks cache takes a peer's
``push_blocks`` only into blocks of the grant the push names (its ``hixl_write_grant``
kwarg), granted to that peer's cluster, and once ``revoke_writes`` returns nothing lands
under the grant, not even a write that was under way. A decode side that hands its blocks to
a pushing prefill side can so take them back (abort, timeout) and know they stay as it left
them, also when it grants the same blocks to the same prefill side again for another request:
a late push naming the old grant is refused. The side granting can also sleep until a write
lands (``wait_for_writes``). A mixin of ``CacheManager``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hixl_connector.datadist.api.c_types import (
    check_isinstance,
    check_uint32,
    check_uint64,
    to_int64,
)
from hixl_connector.datadist.api.llm_types import Cache
from hixl_connector.datadist.api.status import check_status

DEFAULT_REVOKE_TIMEOUT_MS = 10_000


class WriteGrantCalls:
    """Needs the host class's ``_engine`` and ``_check_is_inited``."""

    _engine: Any

    def _check_is_inited(self) -> None: ...

    def grant_writes(self, cache: Cache, writer_cluster_id: int, blocks: Sequence[int]) -> int:
        """Lets cluster ``writer_cluster_id`` push into ``blocks`` of ``cache`` (registered
        while ``hixl_writes_by_grant`` was on) with ``push_blocks(..., hixl_write_grant=id)``;
        returns that id, in [1, 2**63) (an engine's first id is random, so a restarted engine
        does not hand out an id a writer may still hold). A block belongs to one grant at a
        time: ``LLM_PARAM_INVALID`` when one is taken or out of range."""
        self._check_is_inited()
        check_isinstance("cache", cache, Cache, allow_none=False)
        check_uint64("writer_cluster_id", writer_cluster_id)
        check_isinstance("blocks", blocks, (list, tuple), int, allow_none=False)
        for block in blocks:
            check_uint64("blocks", block)
        status, message, grant = self._engine.grant_writes(
            to_int64(writer_cluster_id), cache.cache_id, [to_int64(b) for b in blocks]
        )
        check_status(status, "[grant_writes]", f"cache_id = {cache.cache_id}: {message}")
        return int(grant)

    def revoke_writes(self, grant: int, timeout_ms: int = DEFAULT_REVOKE_TIMEOUT_MS) -> None:
        """Withdraws ``grant`` at once and returns when no write under it is in flight;
        ``LLM_TIMEOUT`` when one still is after ``timeout_ms`` (the grant stays withdrawn:
        call again). Revoking a revoked grant returns at once."""
        self._check_is_inited()
        check_uint64("grant", grant)
        check_uint32("timeout_ms", timeout_ms)
        status, message = self._engine.revoke_writes(grant, max(timeout_ms, 1))
        check_status(status, "[revoke_writes]", f"grant = {grant}: {message}")

    def writes_landed(self) -> int:
        """How many peers' writes have landed in this engine so far (each push, and each
        batch of up to 8192 ranges of one, counts once its last byte is in place)."""
        self._check_is_inited()
        return int(self._engine.writes_landed())

    def wait_for_writes(self, seen: int, timeout_ms: int) -> int:
        """Sleeps until ``writes_landed()`` differs from ``seen`` or ``timeout_ms`` passed, and
        returns it: a side expecting a pushed word waits on this instead of polling memory."""
        self._check_is_inited()
        check_uint64("seen", seen)
        check_uint32("timeout_ms", timeout_ms)
        return int(self._engine.wait_for_writes(seen, timeout_ms))
