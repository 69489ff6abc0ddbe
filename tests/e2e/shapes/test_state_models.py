"""A hybrid state model (Nemotron-H: Mamba2 layers beside attention, an fp32 ssm state beside
a bf16 conv state in one page) P/D behind the real vllm-router, pulled.

P computes the prompt but its last token, and D loads that many tokens' KV with P's state
after them, then computes the last token itself: NixlConnector does the same. The oracle is
therefore NixlConnector's P/D on the same prompts (a plain server computes the last token in
its prefill, not as a decode step). Beside it: the bytes read per request are the attention
KV of N-1 tokens plus the state's bytes, never its page's padding; corrupting only the state
after the read, or not reading it at all, changes the outputs, so the state, and not only the
attention KV, carried the prompt; and a plain server agrees on most tokens.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from hixl_connector.connector.vllm_interface import REPORTS_FAILED_RECEIVES
from hixl_connector.tools.demo.servers import RouterProcess, VllmServer
from hixl_connector.tools.demo.tiny_model import build_tiny_model

from ..harness import (
    MAX_TOKENS,
    NamedFleet,
    PDLauncher,
    ProcessRegistry,
    external_prompt_tokens,
    hixl_connector_config,
    pulled,
    token_prompt,
    wait_for_pulls,
    wait_kv_idle,
)
from .named_fleets import NIXL_CONFIG, greedy, nixl_env, serve_named_fleet

# One-token prompts load nothing (D computes them); the others cross block boundaries.
LENGTHS = (1, 2, 17, 64, 97, 160)
PROMPTS = {n: token_prompt(n, seed=3000 + n) for n in LENGTHS}
# In bf16, as the model is saved; the state's prefix cache ("align") is not read: every
# server runs without prefix caching.
SERVER_ARGS = ("--dtype", "bfloat16", "--no-enable-prefix-caching")
# Nemotron-H's two Mamba2 layers, each a state group of its own beside the attention layer:
# a conv state of (kernel 4 - 1) x (inner 256 + 2 groups x state 64) in bf16, then an ssm
# state of 8 heads x 32 x 64 in fp32.
STATE_GROUPS = 2
STATE_BYTES = 3 * (256 + 2 * 2 * 64) * 2 + 8 * 32 * 64 * 4
# Attention bytes per token: 2 KV heads x (K and V of 32) in bf16.
ATTENTION_TOKEN_BYTES = 2 * 2 * 32 * 2


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, e2e_log_dir: Path, process_registry: ProcessRegistry
) -> Iterator[NamedFleet]:
    if not REPORTS_FAILED_RECEIVES:
        pytest.skip("this vLLM refuses the hybrid manager with the connector")
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("the state model oracle needs NIXL (bash .ci/setup installs it)")
    model = build_tiny_model(tmp_path_factory.mktemp("nemotron_h") / "model", "nemotron-h")
    launcher = PDLauncher(model, e2e_log_dir / "state_models", process_registry)

    def start_servers() -> dict[str, VllmServer]:
        configs = {
            "plain": None,
            "p_hixl": hixl_connector_config("prefill"),
            "d_hixl": hixl_connector_config("decode"),
            "d_corrupt": hixl_connector_config("decode", test_state_control="corrupt"),
            "d_skip": hixl_connector_config("decode", test_state_control="skip"),
            "p_nixl": NIXL_CONFIG,
            "d_nixl": NIXL_CONFIG,
        }
        return {
            name: launcher.server(name, config, args=SERVER_ARGS, env=nixl_env(name))
            for name, config in configs.items()
        }

    pairs = {
        "hixl": ("p_hixl", "d_hixl"),
        "corrupt": ("p_hixl", "d_corrupt"),
        "skip": ("p_hixl", "d_skip"),
        "nixl": ("p_nixl", "d_nixl"),
    }
    yield from serve_named_fleet(launcher, start_servers, pairs)


def generate(router: RouterProcess, n: int) -> list[int]:
    return greedy(router.url, PROMPTS[n], MAX_TOKENS)


def attention_block_size(server: VllmServer) -> int:
    """The attention block size vLLM chose: it raises it until an attention page holds a
    state page (the log names it)."""
    log = server.log_path.read_text(errors="replace")
    marker = "Setting attention block size to "
    assert marker in log, "vLLM did not say which attention block size it chose"
    return int(log.split(marker)[1].split()[0])


def test_token_identical_to_nixl_with_the_state_read(fleet: NamedFleet) -> None:
    decode = fleet.servers["d_hixl"]
    reference = {n: generate(fleet.routers["nixl"], n) for n in LENGTHS}
    # Varied outputs: the random weights do not collapse to one repeated token.
    assert all(len(set(tokens)) >= MAX_TOKENS // 5 for tokens in reference.values())
    block_size = attention_block_size(decode)
    pulls, blocks, nbytes = pulled(decode)
    external = external_prompt_tokens(decode.url)
    for n in LENGTHS:
        assert generate(fleet.routers["hixl"], n) == reference[n], f"{n}-token prompt differs"
        if n == 1:  # D computes a one-token prompt: nothing to read
            continue
        now = wait_for_pulls(decode, pulls + 1)
        # N-1 tokens of attention KV, and the state slot of each state group: its state's
        # bytes, not the page (padded up to the attention page) they lie in.
        token_blocks = math.ceil((n - 1) / block_size)
        assert now[1] - blocks == token_blocks + STATE_GROUPS, f"{n}-token prompt: blocks"
        page = block_size * ATTENTION_TOKEN_BYTES
        assert page > STATE_BYTES
        read = token_blocks * page + STATE_GROUPS * STATE_BYTES
        assert now[2] - nbytes == read, f"{n}-token prompt: bytes"
        pulls, blocks, nbytes = now
    # vLLM's own count of the prompt tokens that came through the connector: all but the
    # last of each prompt (a one-token prompt: none).
    loaded = external_prompt_tokens(decode.url) - external
    assert loaded == sum(n - 1 for n in LENGTHS)
    wait_kv_idle(fleet.servers["p_hixl"])
    wait_kv_idle(decode)


def test_the_state_carried_the_prompt_corrupted_or_missing_it_changes_the_output(
    fleet: NamedFleet,
) -> None:
    for control in ("corrupt", "skip"):
        decode = fleet.servers[f"d_{control}"]
        pulls = pulled(decode)[0]
        differ = [
            n
            for n in (64, 97, 160)
            if generate(fleet.routers[control], n) != generate(fleet.routers["nixl"], n)
        ]
        assert differ == [64, 97, 160], f"{control}: only {differ} changed"
        assert wait_for_pulls(decode, pulls + 3)[0] == pulls + 3


def test_a_plain_server_agrees_on_most_tokens(fleet: NamedFleet) -> None:
    """D computes the last prompt token as a decode step and a plain server in its prefill:
    the last bits differ, and the tiny random model may amplify that, but the first token
    and most of the rest agree."""
    plain = fleet.servers["plain"]
    for n in (17, 64, 160):
        pd, alone = generate(fleet.routers["hixl"], n), greedy(plain.url, PROMPTS[n], MAX_TOKENS)
        assert pd[0] == alone[0], f"{n}-token prompt: first token differs"
