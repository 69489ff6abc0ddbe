"""P and D in separate network namespaces, TCP transport over a veth pair the test makes.

Cases: a baseline across the link; an impaired link (netem delay and loss, or where the
kernel lacks netem a token bucket with a short queue: delay and tail drops), still
token-identical, only slower; the link cut in the middle of a pull (bounded failure,
nothing leaked) and restored (the next request works); listeners bound to the configured
address only.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hixl_connector.tools.demo.client import metric_total, read_metrics

from .deployments import (
    LEASE_S,
    PULL_DELAY_S,
    PULL_TIMEOUT_S,
    short_lease_pair,
)
from .fault_harness import (
    FaultReport,
    Servers,
    in_namespaces,
    leftover,
    plain,
    prefill_leg,
    run_decode,
    token_prompt,
    wait_for,
    wait_idle,
)
from .netns import NetnsBed

MARGIN_S = 3.0
IDLE_TIMEOUT_S = LEASE_S + 10.0


@pytest.fixture(scope="module")
def pd(model_dir: Path, log_dir: Path, net: NetnsBed) -> Iterator[Servers]:
    servers = in_namespaces(model_dir, log_dir / "netns", short_lease_pair("tcp"), net)
    try:
        servers.start("prefill", "decode")
        yield servers
    finally:
        servers.stop_all()


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
    wait_idle(pd["prefill"], IDLE_TIMEOUT_S)
    wait_idle(pd["decode"], IDLE_TIMEOUT_S)
    fault_report.record(
        "netns + TCP: impaired P-D link (delay and loss)",
        f"{applied}: token-identical, only slower: mean pull {clean:.1f} ms clean vs "
        f"{slowed:.1f} ms impaired; {dropped} packets dropped on the link",
        None,
        leftover(pd["prefill"], pd["decode"]),
    )


def test_link_cut_mid_pull_then_restored(
    pd: Servers, net: NetnsBed, fault_report: FaultReport
) -> None:
    timed_two_legs(pd, seed=30)  # D is linked to P over the data link
    prompt = token_prompt(200, seed=31)
    params = prefill_leg(pd["prefill"], prompt)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_decode, pd["decode"], prompt, params, 60.0)
        time.sleep(PULL_DELAY_S / 3)
        net.set_data_link(False)
        cut_at = time.monotonic()
        try:
            result = future.result(timeout=PULL_TIMEOUT_S + 30)
        finally:
            time.sleep(0.5)
            net.set_data_link(True)
    detected = result.finished_at - cut_at
    assert result.failed, "a pull over a cut link must not succeed"
    assert detected < PULL_DELAY_S + PULL_TIMEOUT_S + MARGIN_S
    wait_idle(pd["prefill"], IDLE_TIMEOUT_S)
    wait_idle(pd["decode"], IDLE_TIMEOUT_S)
    fault_report.record(
        "netns + TCP: link cut mid-pull",
        "D's read times out (pull_timeout_s) and the request fails; P's lease expires",
        detected,
        leftover(pd["prefill"], pd["decode"]),
    )
    restored_at = time.monotonic()
    timed_two_legs(pd, seed=32)
    fault_report.record(
        "netns + TCP: link restored",
        "D drops the broken link, links again; the next request is token-identical",
        time.monotonic() - restored_at,
        leftover(pd["prefill"], pd["decode"]),
    )
