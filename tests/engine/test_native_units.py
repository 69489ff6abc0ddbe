"""Native engine pieces checked without a peer: the planner's runs, option and bind errors,
the transfer pool under throwing work and when its threads cannot start, and the HMAC
primitives (the references and self-tests come from the bench module)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl_connector import _native, _native_bench
from hixl_connector.connector.mapping.runs import runs_of


def test_plan_runs() -> None:
    assert _native_bench.plan_runs([3, 4, 5], [10, 11, 12]) == [(3, 10, 3)]
    assert _native_bench.plan_runs([5, 4, 3], [12, 11, 10]) == [(5, 12, 1), (4, 11, 1), (3, 10, 1)]
    assert _native_bench.plan_runs(np.array([1, 2, 7, 8], np.uint64), np.array([0, 1, 2, 3])) == [
        (1, 0, 2),
        (7, 2, 2),
    ]
    assert _native_bench.plan_runs([], []) == []
    assert _native_bench.time_plan(list(range(128)), list(range(128)), 64, 3) > 0


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60))
def test_the_native_planner_merges_runs_by_the_connectors_rule(
    pairs: list[tuple[int, int]],
) -> None:
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    python = [(s, d, n) for _, s, d, n in runs_of((0, s, d) for s, d in pairs)]
    assert _native_bench.plan_runs(src, dst) == python


def test_engine_options_and_bind_errors() -> None:
    with pytest.raises(ValueError):
        _native.Engine(1, transport="rdma")
    with pytest.raises(ValueError):
        _native.Engine(1, tcp_connections=0)
    with pytest.raises(ValueError, match=r"\[1, 16\]"):
        _native.Engine(1, tcp_connections=17)
    with pytest.raises(ValueError, match="one link must fit"):
        _native.Engine(1, server_connections=16)  # a link holds up to 1 + 16 connections
    with pytest.raises(ValueError, match="server_handshakes"):
        _native.Engine(1, server_handshakes=0)
    with pytest.raises(ValueError, match="server_threads"):
        _native.Engine(1, server_threads=65)
    with pytest.raises(ValueError):
        _native.Engine(1, listen_port=0)  # listening needs an explicit host
    with pytest.raises(ValueError, match="at least 32 characters"):
        _native.Engine(1, auth_token="short-token")  # guessable offline from one handshake
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}"):
            _native.Engine(1, listen_host="127.0.0.1", listen_port=port)
    engine = _native.Engine(1, listen_host="127.0.0.1", listen_port=0)
    assert engine.listen_port > 0 and engine.cluster_id == 1
    engine.close()


def test_thread_pool_survives_throwing_tasks_and_shares() -> None:
    """A task or pull share that throws (std::bad_alloc, say) must not end the process, hang
    a caller, or leave a share running after run_shares returned."""
    result = _native_bench.thread_pool_selftest()
    assert result["rethrown"] == 1  # the caller got the share's exception
    assert result["shares_run_after_return"] == 0
    # 1 ms shares: the 5 before the throw and the few in flight ran, the rest were skipped.
    assert result["shares_run_before_failure_or_in_flight"] < 32
    assert result["second_call_shares"] == 64  # the pool is intact
    assert result["task_after_throwing_task_ran"] == 1
    assert result["task_failures"] == 1


def test_hmac_sha256_known_vectors() -> None:
    assert _native_bench.sha256(b"abc").hex().startswith("ba7816bf8f01cfea")
    # RFC 4231 test cases 1 and 2.
    assert _native_bench.hmac_sha256(b"\x0b" * 20, b"Hi There").hex() == (
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
    )
    assert _native_bench.hmac_sha256(b"Jefe", b"what do ya want for nothing?").hex() == (
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    )
    # RFC 4231 case 6: a key longer than the block size is hashed first.
    assert (
        _native_bench.hmac_sha256(
            b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First"
        ).hex()
        == "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
    )


# Runs in its own interpreter: caps the address space so that only a few 8 MiB thread stacks
# fit, asks for 64 transfer threads, and reports what the failure left behind.
THREAD_START_FAILURE = """
import json, os, resource
from hixl_connector import _native

def threads():
    return len(os.listdir("/proc/self/task"))

before = threads()
with open("/proc/self/status") as status:
    vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, ((vm_kib << 10) + (48 << 20), hard))
try:
    _native.Engine(1, transfer_threads=64)
    error = ""
except RuntimeError as exc:
    error = str(exc)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
after = threads()
engine = _native.Engine(2, transfer_threads=2)  # the process is still fine
engine.close()
print(json.dumps({"error": error, "before": before, "after": after}))
"""


def test_a_thread_pool_that_cannot_start_stops_its_threads_and_says_so() -> None:
    """Thread creation failing part-way must neither terminate the process nor leave the
    threads already started running: the Engine constructor raises a clear error."""
    proc = subprocess.run(
        [sys.executable, "-c", THREAD_START_FAILURE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert re.fullmatch(
        r"cannot start the engine: cannot start transfer thread (\d+) of 64 "
        r"\(the \d+ started were stopped\): .+",
        result["error"],
    ), result["error"]
    assert result["after"] == result["before"]  # every started thread was joined
