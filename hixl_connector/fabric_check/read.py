"""The decode side of the fabric check: probe blocks registered as a D rank registers its KV,
a link to the prefill side, guarded reads of every probe block, each verified."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hixl_connector.connector.config import HixlConfig
from hixl_connector.connector.kv.registered_kv import RegisteredKV
from hixl_connector.connector.leases.guarded_read import verdict
from hixl_connector.connector.peers.engine_links import EngineLinks
from hixl_connector.fabric_check.probe import (
    LEASE_SLOT,
    PREFILL_CLUSTER_ID,
    UNPUBLISHED_SLOT,
    ProbeShape,
    probe_kv,
    probe_values,
    register,
)


class CheckFailure(Exception):
    """A step of the check failed; ``stage`` names it ("register", "link", "read", ...)."""

    def __init__(self, stage: str, error: BaseException) -> None:
        super().__init__(f"{stage}: {error}")
        self.stage = stage
        self.error = error


@dataclass
class ReadReport:
    fabric: str = ""
    placements: dict[str, str] = field(default_factory=dict)
    read_bytes: int = 0
    read_seconds: list[float] = field(default_factory=list)
    guard_seconds: list[float] = field(default_factory=list)

    @property
    def median_gbps(self) -> float:
        return self.read_bytes / statistics.median(self.read_seconds) / 1e9

    @property
    def best_gbps(self) -> float:
        return self.read_bytes / min(self.read_seconds) / 1e9


def read(
    config: HixlConfig, shape: ProbeShape, device: str, peer: tuple[str, int], reads: int
) -> ReadReport:
    """Links the prefill side at ``peer`` and reads every probe block ``reads`` times;
    raises CheckFailure naming the step that failed."""
    report = ReadReport()
    kv = probe_kv(shape, device, fill=False)
    try:
        registered, _ = register(config, kv, shape, prefill=False)
    except Exception as e:
        raise CheckFailure("register", e) from e
    try:
        report.placements = registered.placements()
        links = EngineLinks(
            registered.api, registered.datadist, config.engine_host, config.handshake_timeout_s
        )
        try:
            links.link_to(PREFILL_CLUSTER_ID, *peer)
        except Exception as e:
            raise CheckFailure("link", e) from e
        report.fabric = registered.describe_link(PREFILL_CLUSTER_ID)
        src = list(range(shape.num_blocks))
        dst = src[::-1]  # every block lands somewhere else: nothing passes by staying put
        report.read_bytes = len(src) * shape.block_bytes * len(kv["probe.layer"])
        word = shape.word()
        timeout_s = config.pull_timeout_s
        for _ in range(reads):
            for part in kv["probe.layer"]:
                part.zero_()
            seconds = _guarded_read(registered, LEASE_SLOT, word, (src, dst), timeout_s)
            report.read_seconds.append(seconds)
            _verify(kv["probe.layer"], src, dst, shape.block_bytes)
            report.guard_seconds.append(
                _guarded_read(registered, LEASE_SLOT, word, ([], []), timeout_s)
            )
        try:
            _guarded_read(registered, UNPUBLISHED_SLOT, word, (src[:1], dst[:1]), timeout_s)
        except CheckFailure as e:
            if "refused" not in str(e.error):
                raise
        else:
            raise CheckFailure(
                "guard",
                RuntimeError("a read under a word P never published was vouched for"),
            )
    finally:
        registered.datadist.finalize()
        del kv
    return report


def _guarded_read(
    registered: RegisteredKV,
    slot: int,
    word: int,
    pairs: tuple[Sequence[int], Sequence[int]],
    timeout_s: float,
) -> float:
    """One guarded read as the connector's receiver makes it (word, blocks, word, then the
    words read back and judged); its seconds from submit to the verdict."""
    reads = [(PREFILL_CLUSTER_ID, pairs[0], pairs[1])] if pairs[0] else []
    guarded = registered.guarded_reads()
    pull = guarded.batch([(PREFILL_CLUSTER_ID, slot)], registered.block_pulls(reads, False), 0)
    started = time.perf_counter()
    try:
        handle = registered.submit(pull.pulls)
        if not handle.wait(timeout_s):
            raise TimeoutError(f"the read did not finish within {timeout_s} s")
    except Exception as e:
        raise CheckFailure("read", e) from e
    before, after = guarded.words(pull)
    elapsed = time.perf_counter() - started
    outcome, _ = verdict(word, before, after)
    if outcome != "vouched":
        raise CheckFailure(
            "guard",
            RuntimeError(
                f"lease word {outcome}: expected {word:#018x}, read {before[0]:#018x} before "
                f"the blocks and {after[0]:#018x} after"
            ),
        )
    return elapsed


def _verify(parts: Sequence[Any], src: list[int], dst: list[int], block_bytes: int) -> None:
    for tensor, part in enumerate(parts):
        landed = part.cpu()[torch.tensor(dst)]
        expected = probe_values(tensor, torch.tensor(src), block_bytes)
        wrong = (landed != expected).any(dim=1).nonzero().flatten().tolist()
        if wrong:
            raise CheckFailure(
                "verify",
                RuntimeError(
                    f"{len(wrong)} of {len(src)} blocks of tensor {tensor} landed with wrong "
                    f"bytes (first: P's block {src[wrong[0]]} into block {dst[wrong[0]]})"
                ),
            )
