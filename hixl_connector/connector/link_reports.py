"""D's workers tell D's scheduler which prefill engines they read in place.

Only a read that is a one-sided copy out of this host's memory (a same-host link:
``process_vm_readv`` ends whatever P does, stopped or dead) may feed the forward of the step
that needs it (sync_loads): a read over the network waits on the peer, and a step that
waited on it would stall every decode on this engine. Which links are of which kind only the
workers know (their PeerRegistry owns link state), so each step every worker reports what
changed, through vLLM's KVConnectorWorkerMetadata (vLLM aggregates the TP ranks' reports),
and the scheduler keeps its picture from those reports alone.

Pure data and bookkeeping: no engine, no I/O, nothing the scheduler half may not import.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from hixl_connector.connector.endpoints import RemoteEndpoint

# Engines a worker remembers having reported; beyond this many the least recently read is
# forgotten (reported again at its next read): engines come and go over a long run.
MAX_REPORTED_ENGINES = 4096

_Value = TypeVar("_Value")


def put_newest(
    engines: dict[RemoteEndpoint, _Value], remote: RemoteEndpoint, value: _Value
) -> None:
    """Sets ``remote`` as the most recent entry of ``engines`` (insertion order: oldest
    first), forgetting the oldest beyond MAX_REPORTED_ENGINES."""
    engines.pop(remote, None)
    engines[remote] = value
    while len(engines) > MAX_REPORTED_ENGINES:
        del engines[next(iter(engines))]


@dataclass(frozen=True)
class LinkReport:
    """One step's changes: D rank -> {prefill engine: True when that rank now reads every P
    rank it reads of it in place, False when it no longer does}."""

    ranks: Mapping[int, Mapping[RemoteEndpoint, bool]] = field(default_factory=dict)

    def aggregate(self, other: LinkReport) -> LinkReport:
        """vLLM merges the TP ranks' reports; each rank reports only its own links."""
        merged = {rank: dict(changes) for rank, changes in self.ranks.items()}
        for rank, changes in other.ranks.items():
            merged.setdefault(rank, {}).update(changes)
        return LinkReport(merged)


class LinkReporter:
    """A worker's side: records how each read's links turned out (any thread) and hands the
    changes to vLLM once a step (``take``)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._reported: dict[RemoteEndpoint, bool] = {}  # insertion order: oldest first
        self._changes: dict[RemoteEndpoint, bool] = {}
        self._lock = threading.Lock()

    def read(self, remote: RemoteEndpoint, in_place: bool) -> None:
        """A read from ``remote`` went through every link it needed; ``in_place``: all of
        them same-host."""
        self._note(remote, in_place)

    def lost(self, remote: RemoteEndpoint) -> None:
        """A link to ``remote`` broke (or was replaced): nothing from it is read in place
        until a read proves a link again."""
        self._note(remote, False)

    def take(self) -> LinkReport | None:
        with self._lock:
            changes, self._changes = self._changes, {}
        return LinkReport({self._rank: changes}) if changes else None

    def _note(self, remote: RemoteEndpoint, in_place: bool) -> None:
        with self._lock:
            known = self._reported.get(remote)
            put_newest(self._reported, remote, in_place)
            if known is not in_place:
                self._changes[remote] = in_place
