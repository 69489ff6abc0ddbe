"""The e2e plumbing itself: a plain vLLM server, the router in front of it (bench-serve's
reference for P/D's floor), and the router in PD mode with vLLM's built-in ExampleConnector
(KV through files). This proves servers, router and fixtures work; it does not exercise
hixl_connector.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections import deque
from pathlib import Path

import pytest

from hixl_connector.tools.demo import processes
from hixl_connector.tools.demo.client import Generation, chat, complete, metric_total, read_metrics
from hixl_connector.tools.demo.processes import (
    ManagedProcess,
    ProcessFailed,
    free_port,
    free_port_range,
)
from hixl_connector.tools.demo.servers import (
    SERVED_MODEL_NAME,
    VLLM_PORT_SPAN,
    VllmServer,
    start_plain_router,
    start_vllm_server,
    vllm_server_env,
)
from hixl_connector.tools.demo.tiny_model import STAMP_NAME, build_tiny_model

from .harness import (
    CHAT_MESSAGES,
    MAX_TOKENS,
    PDLauncher,
    e2e_prompts,
    example_connector_config,
    external_prompt_tokens,
    risky_prompt_length,
    settled,
)


def _prompt_length(generation: Generation) -> int:
    assert generation.prompt_token_ids is not None, "server did not return prompt_token_ids"
    return len(generation.prompt_token_ids)


def test_plain_server_outputs_are_deterministic(
    plain_server: VllmServer, reference_outputs: dict[str, Generation]
) -> None:
    print(f"plain server healthy after {plain_server.healthy_after_s:.1f} s")
    for prompt in e2e_prompts():
        first = reference_outputs[prompt]
        n_prompt = _prompt_length(first)
        assert 64 <= n_prompt <= 256, n_prompt
        assert not risky_prompt_length(n_prompt), f"prompt of {n_prompt} tokens: pick another"
        assert len(first.token_ids) == MAX_TOKENS
        # Scaled-up random weights: greedy output must not collapse to one repeated token.
        assert len(set(first.token_ids)) > 4, first.token_ids
        again = complete(
            plain_server.url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, stream=True
        )
        assert again.token_ids == first.token_ids
        assert again.prompt_token_ids == first.prompt_token_ids
        assert again.text == first.text

    first_chat = reference_outputs["chat"]
    assert not risky_prompt_length(_prompt_length(first_chat))
    again_chat = chat(
        plain_server.url, CHAT_MESSAGES, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, stream=True
    )
    assert again_chat.token_ids == first_chat.token_ids
    assert again_chat.text == first_chat.text
    assert len(first_chat.token_ids) == MAX_TOKENS


def test_plain_router_relays_the_plain_server(
    plain_server: VllmServer, reference_outputs: dict[str, Generation], tmp_path: Path
) -> None:
    def served() -> float:
        return metric_total(read_metrics(plain_server.url), "vllm:request_success_total")

    before = served()
    prompt = e2e_prompts()[0]
    router = start_plain_router([plain_server.url], tmp_path)
    with router:
        router.wait_healthy()
        for stream in (False, True):
            got = complete(
                router.url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, stream=stream
            )
            assert got.token_ids == reference_outputs[prompt].token_ids, f"stream={stream}"
    # The router served both from the plain server.
    assert settled(served, lambda total: total >= before + 2) == before + 2


def test_router_pd_with_example_connector_matches_plain(
    pd_factory: PDLauncher, reference_outputs: dict[str, Generation], tmp_path: Path
) -> None:
    storage = tmp_path / "kv_files"
    storage.mkdir()
    config = example_connector_config(storage)
    pd = pd_factory(config, config)
    print(f"P/D/router healthy after (s): {pd.timings_s}")
    p_before, d_before = read_metrics(pd.prefill.url), read_metrics(pd.decode.url)
    loaded_before = external_prompt_tokens(pd.decode.url)

    prompts = e2e_prompts()
    for index, prompt in enumerate(prompts):
        # Alternate plain and streamed requests: the router must relay both.
        got = complete(
            pd.url, prompt, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, stream=index % 2 == 1
        )
        assert got.token_ids == reference_outputs[prompt].token_ids, f"prompt {index}"
        print(f"router completion {index}: {got.latency_s * 1000:.0f} ms")
    for stream in (False, True):
        got = chat(
            pd.url, CHAT_MESSAGES, model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, stream=stream
        )
        assert got.token_ids == reference_outputs["chat"].token_ids, f"chat stream={stream}"
        print(f"router chat stream={stream}: {got.latency_s * 1000:.0f} ms")

    n_requests = len(prompts) + 2
    p_after, d_after = read_metrics(pd.prefill.url), read_metrics(pd.decode.url)
    # The router sends each request to P with max_tokens=1, then in full to D.
    p_generated = metric_total(p_after, "vllm:generation_tokens_total") - metric_total(
        p_before, "vllm:generation_tokens_total"
    )
    assert p_generated == n_requests
    d_generated = metric_total(d_after, "vllm:generation_tokens_total") - metric_total(
        d_before, "vllm:generation_tokens_total"
    )
    assert d_generated == n_requests * MAX_TOKENS
    # D loaded prompt KV written by P (not a silent recompute): files exist and D counted
    # externally transferred prompt tokens.
    assert any(storage.rglob("*.safetensors")), "P stored no KV files"
    loaded = external_prompt_tokens(pd.decode.url) - loaded_before
    assert loaded > 0, "D transferred no prompt tokens from P"
    print(f"D loaded {loaded:.0f} prompt tokens through the connector")


def test_bad_kv_transfer_config_fails_fast_with_log(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = start_vllm_server(
        tiny_model_dir,
        tmp_path,
        "bad",
        core=1,
        kv_transfer_config={"kv_connector": "NoSuchConnector", "kv_role": "kv_both"},
    )
    try:
        with pytest.raises(ProcessFailed) as failure:
            server.wait_healthy(120.0)
    finally:
        server.stop()
    message = str(failure.value)
    assert "exited while waiting" in message
    assert "NoSuchConnector" in message  # the log tail explains why


def test_a_failure_names_the_root_cause_buried_above_the_tail(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "try:\n    raise OSError('the root cause')\n"
        "except OSError:\n    import traceback; traceback.print_exc()\n"
        "for i in range(100): print('wrapper line', i)\n"
        "sys.exit(1)\n"
    )
    process = ManagedProcess("buried", [sys.executable, "-c", script], tmp_path / "b.log")
    with process.start(), pytest.raises(ProcessFailed) as failure:
        process.wait_until(lambda: False, 30.0, "nothing")
    message = str(failure.value)
    assert "OSError: the root cause" in message
    assert "wrapper line 99" in message  # the tail as well


def _is_running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has already exited


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    child_pid_file = tmp_path / "child.pid"
    process = ManagedProcess(
        "group", ["bash", "-c", f"sleep 60 & echo $! > {child_pid_file}; wait"], tmp_path / "g.log"
    )
    with process.start():
        process.wait_until(child_pid_file.exists, 10.0, "child pid file")
        child_pid = int(child_pid_file.read_text())
        assert _is_running(child_pid)
    assert not process.alive()
    deadline = time.monotonic() + 5.0
    while _is_running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_running(child_pid), "a grandchild outlived stop()"


_HEALTHY_AFTER_A_CHILD = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
open(sys.argv[2], "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_niced_server_starts_at_full_priority_and_its_group_yields_once_healthy(
    tmp_path: Path,
) -> None:
    port, child_pid_file = free_port(), tmp_path / "child.pid"
    argv = [sys.executable, "-c", _HEALTHY_AFTER_A_CHILD, str(port), str(child_pid_file)]
    server = VllmServer("niced", argv, tmp_path / "n.log", port, {}, nice_when_serving=10)
    with server.start():
        server.wait_until(
            lambda: child_pid_file.exists() and child_pid_file.read_text(), 30.0, "pid"
        )
        child_pid = int(child_pid_file.read_text())
        assert server.pid is not None
        starting = os.getpriority(os.PRIO_PROCESS, server.pid)
        server.wait_healthy(30.0)
        ours = os.getpriority(os.PRIO_PROCESS, os.getpid())
        assert starting == ours
        serving = min(19, ours + 10)  # by 10 from the caller's
        assert os.getpriority(os.PRIO_PROCESS, server.pid) == serving
        assert os.getpriority(os.PRIO_PROCESS, child_pid) == serving  # what it spawned


def test_no_pick_lands_on_a_port_picked_before_or_in_a_vllm_port_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing binds these ports, as nothing binds a server's side channel before its model
    # loads: only the record of what was picked keeps the next picks off them. The draws are
    # steered onto every taken port first; each pick must pass them by.
    monkeypatch.setattr(processes, "_PICKED", deque(maxlen=256))
    window = int(vllm_server_env()["VLLM_PORT"])
    side_channel = free_port_range(2)
    taken = [*range(window, window + VLLM_PORT_SPAN), side_channel, side_channel + 1]
    fresh = free_port_range(4)
    processes._PICKED.pop()  # free, and not picked yet
    draws = iter(taken + [fresh] + taken + [fresh, fresh + 1] + taken + [fresh + 3])
    monkeypatch.setattr(processes.random, "randrange", lambda *_: next(draws))
    assert free_port() == fresh
    assert free_port_range(2) == fresh + 1  # not fresh: a range may not overlap a pick
    assert free_port() == fresh + 3


def _file_digests(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def test_tiny_model_builds_are_byte_identical_and_idempotent(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    second = build_tiny_model(tmp_path / "second")
    first_digests = _file_digests(tiny_model_dir)
    assert "model.safetensors" in first_digests and "tokenizer.json" in first_digests
    assert _file_digests(second) == first_digests
    stamp_mtime = (second / STAMP_NAME).stat().st_mtime_ns
    assert build_tiny_model(second) == second  # already built: nothing rewritten
    assert (second / STAMP_NAME).stat().st_mtime_ns == stamp_mtime
