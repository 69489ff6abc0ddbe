"""P and D in separate network namespaces, TCP transport over a veth pair the test makes.

Cases: listeners bound to the configured address only; an impaired link (netem delay and
loss, or where the kernel lacks netem a token bucket with a short queue: delay and tail
drops), still token-identical, only slower; then the faults that land in the middle of a
read. For those P's side of the link is slowed (``reading``) so that D's read, the one
engine batch it always is (lease word, blocks, word), takes about two seconds, and the
fault lands once a block's worth of it crossed the link and before any read landed: the
link cut and restored, the client gone, P frozen, P killed and restarted, P killed with
reads queued behind, and last D killed. Every wait is bounded, vLLM's KV usage on both
sides returns to idle, and each case records a reliability row.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hixl_connector.tools.demo.client import metric_total, read_metrics
from hixl_connector.tools.netns import NetnsBed

from .deployments import (
    HANDSHAKE_TIMEOUT_S,
    LEASE_S,
    PULL_TIMEOUT_S,
    short_lease_pair,
)
from .fault_harness import (
    FaultReport,
    LegResult,
    Servers,
    both_idle,
    hixl_counter,
    in_namespaces,
    leftover,
    plain,
    prefill_leg,
    run_decode,
    token_prompt,
    two_legs_identical,
    wait_for,
    wait_idle,
)

# A failed receive reaches the client one engine step after the read gave up; a reset
# from a killed P waits behind what P's slowed link still holds.
MARGIN_S = 3.0
# P's side of the link while a fault lands mid-read: a 160-token prompt's blocks (5 of
# 32 KiB) take about 2 s, under PULL_TIMEOUT_S, so an unfaulted read would succeed.
MID_READ_RATE = "640kbit"
# A read is under way once this much crossed the slowed link: more than any message of the
# side channel, about a block of the prompt's KV (a fifth of it).
UNDER_WAY_BYTES = 32 * 1024
# How long the client that leaves mid-read waits for D's answer.
CLIENT_WAIT_S = 0.5
QUEUED_BEHIND_KILL = 10


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path, net: NetnsBed) -> Iterator[Servers]:
    with in_namespaces(model_dir, log_dir / "netns", short_lease_pair("tcp"), net) as servers:
        servers.start("prefill", "decode")
        yield servers


# What an impaired link adds to a 200-token read at least: netem's 20 ms delay each way, or
# the token bucket's 4 Mbit/s for its bytes (about 460 ms measured).
IMPAIRED_AT_LEAST_MS = 20.0


def timed_two_legs(pd: Servers, seed: int) -> float:
    prompt = token_prompt(200, seed)
    expected = plain(pd["prefill"], prompt)
    started = time.monotonic()
    result = run_decode(pd["decode"], prompt, prefill_leg(pd["prefill"], prompt), 60.0)
    assert result.error is None, result.error
    assert result.tokens == expected
    return result.finished_at - started


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP listener in the network namespace of ``pid``.

    Read from /proc/<pid>/net (that namespace's view); only P runs in its namespace.
    """
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            if table == "tcp":
                ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                ip = socket.inet_ntop(socket.AF_INET6, words)
            found.append((ip, int(port, 16)))
    return found


def test_listeners_bind_the_configured_address_only(pd: Servers, net: NetnsBed) -> None:
    """No wildcard listener; the side channel and the engine listen on 10.77.X.1 only."""
    side_port = pd.config("prefill")["side_channel_port"]
    pid = pd["prefill"].pid
    assert pid is not None
    listening = listening_sockets(pid)
    assert not [a for a in listening if a[0] in ("0.0.0.0", "::")], listening
    assert (net.p_ip, side_port) in listening
    on_data_link = [a for a in listening if a[0] == net.p_ip]
    assert len(on_data_link) >= 2, f"side channel and engine on {net.p_ip}: {listening}"


def mean_pull_ms(pd: Servers, work: Callable[[], list[float]]) -> float:
    """Mean pull time on D (its own histogram) over the requests ``work`` sends."""

    def totals() -> tuple[float, float]:
        samples = read_metrics(pd["decode"].url)
        return (
            metric_total(samples, "vllm:hixl_pull_seconds_sum"),
            metric_total(samples, "vllm:hixl_pull_seconds_count"),
        )

    seconds, count = totals()
    sent = len(work())
    # D's metrics reach its API server a step after the pull.
    wait_for(lambda: totals()[1] >= count + sent, 10.0, "D's pull histogram")
    seconds2, count2 = totals()
    return (seconds2 - seconds) / (count2 - count) * 1000


def test_impaired_link_still_correct(pd: Servers, net: NetnsBed, fault_report: FaultReport) -> None:
    timed_two_legs(pd, seed=20)  # linked before measuring
    clean = mean_pull_ms(pd, lambda: [timed_two_legs(pd, seed=21 + i) for i in range(2)])
    applied = net.degrade()
    try:
        slowed = mean_pull_ms(pd, lambda: [timed_two_legs(pd, seed=23 + i) for i in range(3)])
        dropped = net.dropped_packets()
    finally:
        net.restore()
    wait_idle(pd["prefill"])
    wait_idle(pd["decode"])
    # The impairment took effect: the reads crossed it (each pays its delay or rate at least
    # once), and it dropped packets they had to retransmit.
    assert slowed > clean + IMPAIRED_AT_LEAST_MS, (clean, slowed)
    assert dropped > 0
    fault_report.record(
        "netns + TCP: impaired P-D link (delay and loss)",
        f"{applied}: token-identical, only slower: mean pull {clean:.1f} ms clean vs "
        f"{slowed:.1f} ms impaired; {dropped} packets dropped on the link",
        None,
        leftover(pd["prefill"], pd["decode"]),
    )


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(QUEUED_BEHIND_KILL + 2) as executor:
        yield executor


@contextmanager
def reading(
    pd: Servers, net: NetnsBed, pool: ThreadPoolExecutor, prompts: list[list[int]]
) -> Iterator[list[tuple[Future[LegResult], dict[str, Any]]]]:
    """D's reads of ``prompts`` (prefilled first) under way over the slowed link, each with
    its kv_transfer_params: P's blocks are crossing the link (UNDER_WAY_BYTES of them) and no
    read has landed. The link is whole again after the block."""
    legs = [prefill_leg(pd["prefill"], prompt) for prompt in prompts]
    landed = hixl_counter(pd["decode"], "pulls")
    net.throttle(MID_READ_RATE)
    try:
        futures = [
            pool.submit(run_decode, pd["decode"], prompt, params, 60.0)
            for prompt, params in zip(prompts, legs, strict=True)
        ]
        wait_for(lambda: net.sent_bytes() >= UNDER_WAY_BYTES, 30.0, "D's reads under way")
        assert hixl_counter(pd["decode"], "pulls") == landed, "a read landed before the fault"
        yield list(zip(futures, legs, strict=True))
    finally:
        net.restore()


def test_link_cut_mid_read_then_restored(
    pd: Servers, net: NetnsBed, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    timed_two_legs(pd, seed=30)  # D is linked to P over the data link
    with reading(pd, net, pool, [token_prompt(160, seed=31)]) as [(future, _)]:
        net.set_data_link(False)
        cut_at = time.monotonic()
        try:
            result = future.result(timeout=PULL_TIMEOUT_S + 30)
        finally:
            time.sleep(0.5)
            net.set_data_link(True)
    detected = result.finished_at - cut_at
    assert result.failed, "a read over a cut link must not succeed"
    assert detected < PULL_TIMEOUT_S + MARGIN_S
    fault_report.record(
        "netns + TCP: link cut mid-read",
        "D's read times out (pull_timeout_s) and the request fails; P's lease expires",
        detected,
        both_idle(pd),
    )
    restored_at = time.monotonic()
    timed_two_legs(pd, seed=32)
    fault_report.record(
        "netns + TCP: link restored",
        "D dropped the broken link at once, links again; the next request is token-identical",
        time.monotonic() - restored_at,
        leftover(pd["prefill"], pd["decode"]),
    )


def test_client_gone_mid_read_frees_prefill_promptly(
    pd: Servers, net: NetnsBed, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    prompt = token_prompt(160, seed=5)
    params = prefill_leg(pd["prefill"], prompt)
    net.throttle(MID_READ_RATE)
    try:
        result = run_decode(pd["decode"], prompt, params, CLIENT_WAIT_S)
        assert result.failed, "the client should have given up"
        detected = wait_idle(pd["prefill"])
    finally:
        net.restore()
    assert detected < LEASE_S, "P waited for lease expiry instead of being told"
    fault_report.record(
        "netns + TCP: client disconnects from D mid-read",
        "vLLM aborts the request and its rejection cleanup makes D send 'release': P frees "
        "at once; the read still in flight finds its lease word cleared (stale), nothing "
        "decodes",
        detected,
        both_idle(pd),
    )
    two_legs_identical(pd, seed=40)


def test_prefill_frozen_mid_read(
    pd: Servers, net: NetnsBed, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    with reading(pd, net, pool, [token_prompt(160, seed=6)]) as [(future, _)]:
        pd.kill("prefill", signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            result = future.result(timeout=PULL_TIMEOUT_S + 30)
        finally:
            pd.kill("prefill", signal.SIGCONT)
    detected = result.finished_at - stopped_at
    assert result.failed, "a read from a frozen P must not succeed"
    assert detected < PULL_TIMEOUT_S + MARGIN_S
    left = both_idle(pd)
    two_legs_identical(pd, seed=60)
    fault_report.record(
        "netns + TCP: P frozen (SIGSTOP) mid-read",
        "D's read times out (pull_timeout_s), the request fails; after SIGCONT P's lease "
        "expires and later requests work",
        detected,
        left,
    )


def test_prefill_killed_mid_read_then_restarted(
    pd: Servers, net: NetnsBed, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    timed_two_legs(pd, seed=33)  # D is linked to P before the read (the case stands alone)
    prompt = token_prompt(160, seed=7)
    failed = hixl_counter(pd["decode"], "failed_pulls")
    with reading(pd, net, pool, [prompt]) as [(future, params)]:
        pd.kill("prefill", signal.SIGKILL)
        killed_at = time.monotonic()
        result = future.result(timeout=PULL_TIMEOUT_S + 30)
    detected = result.finished_at - killed_at
    assert result.failed, "a read from a dead P must not succeed"
    assert detected < PULL_TIMEOUT_S + MARGIN_S
    assert hixl_counter(pd["decode"], "failed_pulls") == failed + 1
    wait_idle(pd["decode"])
    fault_report.record(
        "netns + TCP: P killed (SIGKILL) mid-read",
        "D's read fails (connection reset), the request fails with an error",
        detected,
        leftover(pd["decode"]) + "; P: process gone",
    )

    restart_s = pd.restart("prefill")
    began = time.monotonic()
    handshakes = hixl_counter(pd["decode"], "failed_handshakes")
    new_params = prefill_leg(pd["prefill"], prompt)
    assert new_params["remote_incarnation"] != params["remote_incarnation"]
    assert new_params["remote_port"] == params["remote_port"]
    result = run_decode(pd["decode"], prompt, new_params, 60.0)
    assert result.error is None, result.error
    assert result.tokens == plain(pd["prefill"], prompt)
    assert hixl_counter(pd["decode"], "failed_handshakes") == handshakes
    fault_report.record(
        "netns + TCP: P restarted at the same address",
        "D dropped the old link when the read failed; it handshakes with the new start and "
        f"links again: the first request is token-identical (P restart took {restart_s:.0f} s)",
        result.finished_at - began,
        both_idle(pd),
    )


def test_reads_queued_behind_a_killed_prefill_all_end_within_one_timeout(
    pd: Servers, net: NetnsBed, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    timed_two_legs(pd, seed=34)  # D is linked to P before the reads (the case stands alone)
    # Twelve reads under way: two moving (one per transfer thread), ten queued behind them.
    reads_under_way = QUEUED_BEHIND_KILL + 2
    # Seeds no other prompt of this module uses: a prefix D already holds would be read in
    # part only, and could land before the kill.
    prompts = [token_prompt(120, seed=100 + i) for i in range(reads_under_way)]
    with reading(pd, net, pool, prompts) as reads:
        pd.kill("prefill", signal.SIGKILL)
        killed_at = time.monotonic()
        results = [future.result(timeout=60) for future, _ in reads]
    ended = max(result.finished_at for result in results) - killed_at
    assert all(result.failed for result in results), "a read from a dead P must not succeed"
    # Each ends when the reset reaches it, or its read or D's next handshake times out:
    # never a timeout each, one after another.
    bound = PULL_TIMEOUT_S + HANDSHAKE_TIMEOUT_S + MARGIN_S
    assert ended < bound, f"the last ended {ended:.1f} s after"
    wait_idle(pd["decode"])
    fault_report.record(
        f"netns + TCP: P killed (SIGKILL) with {reads_under_way} reads under way on D",
        "two moving, the rest queued behind them: every one fails once the reset arrives "
        "(none waits out a timeout of its own, none after another)",
        ended,
        leftover(pd["decode"]) + "; P: process gone",
    )
    pd.restart("prefill")
    two_legs_identical(pd, seed=70)


def test_decode_killed_mid_read(
    pd: Servers, net: NetnsBed, pool: ThreadPoolExecutor, fault_report: FaultReport
) -> None:
    expired = hixl_counter(pd["prefill"], "expired_leases")
    with reading(pd, net, pool, [token_prompt(160, seed=8)]) as [(future, _)]:
        pd.kill("decode", signal.SIGKILL)
        killed_at = time.monotonic()
        wait_idle(pd["prefill"])
        detected = time.monotonic() - killed_at
    assert future.result(timeout=30).failed
    assert hixl_counter(pd["prefill"], "expired_leases") == expired + 1
    fault_report.record(
        "netns + TCP: D killed (SIGKILL) mid-read",
        "heartbeats stop, P's lease expires and its blocks return to the free pool",
        detected,
        leftover(pd["prefill"]) + "; D: process gone",
    )
