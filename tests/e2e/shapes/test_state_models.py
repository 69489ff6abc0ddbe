"""Hybrid state models (Mamba2, Gated DeltaNet, short convolutions: a state per request
beside attention) P/D behind the real vllm-router, pulled and pushed, between equal TP sizes
and (Gated DeltaNet) between TP 1 and 2 both ways, and 2P1D at concurrency 4.

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
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from hixl_test_connector import STATE_CONTROLS, state_control_id

from hixl_connector.connector.vllm_interface import REPORTS_FAILED_RECEIVES
from hixl_connector.tools.bench_serve import NIXL_CONFIG
from hixl_connector.tools.demo.client import (
    PREFILL_LEG_PARAMS,
    Generation,
    complete,
    metric_total,
    read_metrics,
    send_leg,
)
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME, VllmServer
from hixl_connector.tools.demo.tiny_model import build_tiny_model

from ..harness import (
    BLOCK_SIZE,
    MAX_TOKENS,
    NamedFleet,
    Pair,
    PDLauncher,
    ProcessRegistry,
    external_prompt_tokens,
    hixl_connector_config,
    hixl_counter,
    pulled,
    token_prompt,
    wait_for_pulls,
    wait_kv_idle,
)
from .named_fleets import greedy, nixl_env, serve_named_fleet, start_named

# One-token prompts load nothing (D computes them); the others cross block boundaries.
LENGTHS = (1, 2, 17, 64, 97, 160)
PROMPTS = {n: token_prompt(n, seed=3000 + n) for n in LENGTHS}
# In bf16, as the models are saved.
BF16 = ("--dtype", "bfloat16")
# How far the first output token's logprob may lie from a plain server's (bf16 rounding of
# the last prompt token, computed as a decode step here and in the prefill there).
FIRST_LOGPROB_TOLERANCE = 0.1
LOGPROBS = {"logprobs": 1}
# vLLM's conv-state layout in which each TP rank's channels are contiguous.
CHANNELS_FIRST = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
# P at TP 1 and D at TP 2, and back, pulled and pushed: (P, D). The TP-2 server is in push
# mode, as P and as D (a push-mode D pulls from a pull-mode P): vllm-router pushes from it
# once it answered a first time, so P at TP 2 pulled gets the two legs vllm-router sends
# before that (DIRECT_PAIRS), straight from the test.
TP_PAIRS = {
    "tp12": ("p_hixl", "pd_tp2"),
    "tp21": ("pd_tp2", "d_hixl"),
    "push_tp12": ("p_push", "pd_tp2"),
    "push_tp21": ("pd_tp2", "d_hixl"),
}
DIRECT_PAIRS = {"tp21"}
# NIXL's pairs of the same TP sizes: the oracles (both TP sizes shape the sums).
NIXL_TP_PAIRS = {"nixl_tp12": ("p_nixl", "pd_nixl_tp2"), "nixl_tp21": ("pd_nixl_tp2", "d_nixl")}
DECODE_RANKS = {"pd_tp2": 2}
# 2P1D: a P in pull mode and one in push mode behind one router, feeding one D.
TWO_PREFILLS = ("p_hixl", "p_push")
# A TP-2 decode of these models steps at a few tokens a second on 2 cores: its pair is
# compared on fewer prompts and tokens (a misplaced slice parts from the first token).
TP2_DECODE_LENGTHS = (2, 64, 160)
TP2_DECODE_TOKENS = 8


@dataclass(frozen=True)
class StateModel:
    """A tiny hybrid state model and the bytes a read of it moves."""

    architecture: str
    state_groups: int  # state slots a request has: one per state group
    regions: int  # the shared buffers: layers per KV-cache group
    state_bytes: int  # one state layer's state: conv state, then ssm state (in bf16, fp32)
    attention_token_bytes: int  # one attention layer's KV of one token
    oracle: str  # the P/D pair D's outputs must equal: NIXL's, where NIXL moves this state
    # vLLM's default, prefix caching of the state ("align"), or none; vLLM 0.32's CPU Mamba2
    # kernel fails a prefill that crosses a block with prefix caching on.
    prefix_caching: bool = True
    # Whether its fleet reads the state between TP sizes (state_shards): its servers then run
    # the DS conv layout, and TP-2 servers join it. Gated DeltaNet's does; Mamba2's runs the
    # SD layout (vLLM's default) between equal TP sizes, and its TP slices are tested over
    # vLLM's own shapes and buffers (tests/unit/test_state_layout.py), for CI's time.
    divides: bool = False

    @property
    def server_args(self) -> tuple[str, ...]:
        return BF16 if self.prefix_caching else (*BF16, "--no-enable-prefix-caching")


MODELS = {
    # Mamba2: 2 state layers (a group each) beside 1 attention layer; conv state of
    # (kernel 4 - 1) x (inner 256 + 2 groups x state 64) in bf16, ssm state 8 heads x 32 x 64
    # in fp32; attention: 2 KV heads x (K and V of 32) in bf16.
    "mamba2": StateModel(
        "nemotron-h", 2, 1, 3 * 512 * 2 + 8 * 32 * 64 * 4, 2 * 2 * 32 * 2, "nixl", False
    ),
    # Gated DeltaNet: 2 linear-attention layers (one group) beside 2 attention layers; conv
    # state of 3 x (2 x 128 keys + 256 values) in bf16, recurrent state 4 value heads x 64 x 64
    # in fp32; attention: 2 KV heads x (K and V of 64) in bf16.
    "gdn": StateModel(
        "qwen3-next", 1, 2, 3 * 512 * 2 + 4 * 64 * 64 * 4, 2 * 2 * 64 * 2, "nixl", divides=True
    ),
    # Short convolutions: 2 conv layers (one group) beside 2 attention layers; conv state of
    # (L_cache 3 - 1) x 128 in bf16, no ssm state; attention: 1 KV head x (K and V of 128).
    # NIXL does not move short-conv state: the oracle is a plain server.
    "short_conv": StateModel("lfm2", 1, 2, 2 * 128 * 2, 1 * 2 * 128 * 2, "plain"),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test runs per model, the TP-pair tests per model whose state divides between
    TP sizes (sorted alike, so each model's fleet starts once)."""
    names = sorted(MODELS)
    if "tp_pair" in metafunc.fixturenames:
        names = [name for name in names if MODELS[name].divides]
    metafunc.parametrize("model", names, indirect=True, scope="module")


@pytest.fixture(scope="module")
def model(request: pytest.FixtureRequest) -> StateModel:
    return MODELS[request.param]


@pytest.fixture(scope="module")
def fleet(
    model: StateModel,
    tmp_path_factory: pytest.TempPathFactory,
    e2e_log_dir: Path,
    process_registry: ProcessRegistry,
) -> Iterator[NamedFleet]:
    if not REPORTS_FAILED_RECEIVES:
        pytest.skip("this vLLM refuses the hybrid manager with the connector")
    if model.oracle == "nixl" and importlib.util.find_spec("nixl") is None:
        pytest.skip("the state model oracle needs NIXL (bash .ci/setup installs it)")
    name = model.architecture
    model_dir = build_tiny_model(tmp_path_factory.mktemp(name) / "model", name)
    launcher = PDLauncher(model_dir, e2e_log_dir / f"state_{name}", process_registry)

    def start_servers() -> dict[str, VllmServer]:
        configs = {
            "plain": None,
            "p_hixl": hixl_connector_config("prefill"),
            "p_push": hixl_connector_config("prefill", transfer_mode="push"),
            # Push mode, which pulls from a P in pull mode too. The controls are per
            # request (state_control_id): one D serves them all.
            "d_hixl": hixl_connector_config(
                "decode", transfer_mode="push", test_state_control=True
            ),
        }
        if model.oracle == "nixl":
            configs |= {"p_nixl": NIXL_CONFIG, "d_nixl": NIXL_CONFIG}
        env = CHANNELS_FIRST if model.divides else {}
        servers = start_named(launcher, configs, model.server_args, env)
        if model.divides:  # prefill and decode both, for the TP pairs both ways
            both = hixl_connector_config("decode", ranks=2, transfer_mode="push")
            both["kv_role"] = "kv_both"
            for name, config in (("pd_tp2", both), ("pd_nixl_tp2", NIXL_CONFIG)):
                env = CHANNELS_FIRST | nixl_env(name)
                servers[name] = launcher.server(name, config, tp=2, args=model.server_args, env=env)
        return servers

    pairs: dict[str, Pair] = {
        "hixl": ("p_hixl", "d_hixl"),
        "push": ("p_push", "d_hixl"),
        "2p1d": (TWO_PREFILLS, "d_hixl"),
    }
    if model.oracle == "nixl":
        pairs["nixl"] = ("p_nixl", "d_nixl")
    if model.divides:
        pairs |= {name: tp for name, tp in TP_PAIRS.items() if name not in DIRECT_PAIRS}
        pairs |= NIXL_TP_PAIRS
    yield from serve_named_fleet(launcher, start_servers, pairs)


def oracle(
    fleet: NamedFleet,
    model: StateModel,
    prompt: list[int],
    pair: str = "hixl",
    max_tokens: int = MAX_TOKENS,
) -> list[int]:
    """The oracle's output for ``prompt`` of the P/D pair ``pair``: NIXL's of the same TP
    sizes, or a plain server's."""
    if model.oracle == "plain":
        return greedy(fleet.servers["plain"].url, prompt, max_tokens)
    nixl = f"nixl_{pair.removeprefix('push_')}" if pair in TP_PAIRS else "nixl"
    return greedy(fleet.routers[nixl].url, prompt, max_tokens)


def attention_block_size(server: VllmServer) -> int:
    """The attention block size vLLM chose: it raises the configured one until an attention
    page holds a state page, and says so."""
    log = server.log_path.read_text(errors="replace")
    marker = "Setting attention block size to "
    return int(log.split(marker)[1].split()[0]) if marker in log else BLOCK_SIZE


def test_token_identical_to_the_oracle_with_the_state_read(
    fleet: NamedFleet, model: StateModel
) -> None:
    moved_as_the_oracle(fleet, model, "hixl", PROMPTS)


@pytest.mark.parametrize("tp_pair", sorted(TP_PAIRS))
def test_token_identical_to_the_oracle_with_the_state_moved_between_tp_sizes(
    fleet: NamedFleet, model: StateModel, tp_pair: str
) -> None:
    """P at TP 1 and D at TP 2, and back, pulled and pushed: each D rank gets its slices of
    each conv sub-projection and its heads of the ssm state from the P rank holding them
    (read by D, or written by P where D said), so the D ranks together receive the state's
    bytes once, as between equal TP sizes."""
    names = TP_PAIRS[tp_pair]
    slow = DECODE_RANKS.get(names[1], 1) > 1
    lengths = TP2_DECODE_LENGTHS if slow else LENGTHS
    seed = 11000 if tp_pair.startswith("push_") else 12000  # D caches what it received
    prompts = {n: token_prompt(n, seed=seed + n) for n in lengths}
    tokens = TP2_DECODE_TOKENS if slow else MAX_TOKENS
    moved_as_the_oracle(fleet, model, tp_pair, prompts, names, tokens)


def test_token_identical_to_the_oracle_with_the_state_pushed(
    fleet: NamedFleet, model: StateModel
) -> None:
    """P writes the tokens' KV and, once its prompt was computed, the state into D's slots.
    Prompts of its own: D caches what it received, and a prompt it holds is not moved."""
    prompts = {n: token_prompt(n, seed=9000 + n) for n in LENGTHS}
    moved_as_the_oracle(fleet, model, "push", prompts)


def moved_as_the_oracle(
    fleet: NamedFleet,
    model: StateModel,
    pair: str,
    prompts: dict[int, list[int]],
    names: tuple[str, str] | None = None,
    max_tokens: int = MAX_TOKENS,
) -> None:
    """Through the router of ``pair`` (P and D named ``names``, by default ``p_<pair>`` and
    ``d_hixl``), or its two legs sent directly (DIRECT_PAIRS), every prompt's output is the
    oracle's, and D's ranks together received the attention KV of N-1 tokens and the
    state's bytes of each state slot, never the padding of its page. A push pair's router
    has learnt that P pushes (a first request), and every prompt that moves anything is
    pushed; a pull pair's, none."""
    p_name, d_name = names or (f"p_{pair}", "d_hixl")
    prefill, decode = fleet.servers[p_name], fleet.servers[d_name]
    ranks = DECODE_RANKS.get(d_name, 1)
    expected = {n: oracle(fleet, model, prompt, pair, max_tokens) for n, prompt in prompts.items()}
    # Varied outputs: the random weights do not collapse to one repeated token.
    assert all(len(set(tokens)) >= max_tokens // 5 for tokens in expected.values())
    pushes = pair.startswith("push")
    if pushes:  # vllm-router pushes from P once P answered it a first time
        first = pulled(decode)[0]
        greedy(fleet.routers[pair].url, token_prompt(3, seed=len(pair)), 1)
        wait_for_pulls(decode, first + ranks)
    block_size = attention_block_size(decode)
    moves, blocks, nbytes = pulled(decode)
    external = external_prompt_tokens(decode.url)
    receives = hixl_counter(decode, "push_receives")
    for n, prompt in prompts.items():
        if pair in DIRECT_PAIRS:
            output = legs(fleet, (p_name, d_name), prompt, max_tokens)
        else:
            output = greedy(fleet.routers[pair].url, prompt, max_tokens)
        assert output == expected[n], f"{pair}: {n}-token prompt differs"
        if n == 1:  # D computes a one-token prompt: nothing to move
            continue
        now = wait_for_pulls(decode, moves + ranks)
        # N-1 tokens of attention KV, and the state slot of each state group: its state's
        # bytes, not the page (padded up to the attention page) they lie in.
        token_blocks = math.ceil((n - 1) / block_size)
        assert now[1] - blocks == (token_blocks + model.state_groups) * ranks, f"{n}: blocks"
        page = block_size * model.attention_token_bytes
        assert page > model.state_bytes
        moved = (token_blocks * page + model.state_groups * model.state_bytes) * model.regions
        assert now[2] - nbytes == moved, f"{pair}: {n}-token prompt: bytes"
        moves, blocks, nbytes = now
    # vLLM's own count of the prompt tokens that came through the connector: all but the
    # last of each prompt (a one-token prompt: none).
    loaded = external_prompt_tokens(decode.url) - external
    assert loaded == sum(n - 1 for n in prompts)
    pushed = hixl_counter(decode, "push_receives") - receives
    assert pushed == (ranks * sum(n > 1 for n in prompts) if pushes else 0), f"{pair}: pushes"
    wait_kv_idle(prefill)
    wait_kv_idle(decode)


def test_with_prefix_caching_a_repeated_prompt_reads_nothing_d_holds(
    fleet: NamedFleet, model: StateModel
) -> None:
    """With prefix caching of the state, D caches what it read: the state after a whole
    block, and that block's KV. A prompt one token longer than a block, sent again, hits
    both, so D reads nothing and computes the last token from its own state. Without it,
    the prompt is read again."""
    decode = fleet.servers["d_hixl"]
    block_size = attention_block_size(decode)
    prompt = token_prompt(block_size + 1, seed=4000)
    url = fleet.routers["hixl"].url
    pulls = pulled(decode)[0]
    first = greedy(url, prompt, MAX_TOKENS)
    wait_for_pulls(decode, pulls + 1)
    hits = prefix_cache_hits(decode)
    assert greedy(url, prompt, MAX_TOKENS) == first
    wait_kv_idle(fleet.servers["p_hixl"])  # D answered P: read, or released
    if model.prefix_caching:
        assert prefix_cache_hits(decode) - hits >= block_size
        assert pulled(decode)[0] == pulls + 1, "a repeated prompt was read again"
    else:
        wait_for_pulls(decode, pulls + 2)


def prefix_cache_hits(server: VllmServer) -> float:
    return metric_total(read_metrics(server.url), "vllm:prefix_cache_hits_total")


def test_two_prefills_one_pulled_one_pushing_feed_one_decode_at_concurrency_4(
    fleet: NamedFleet, model: StateModel
) -> None:
    """2P1D behind one router, requests at once: a P in pull mode and a P in push mode feed
    one D, each request's state landing in its own slot. Every output is the oracle's, both
    P prefilled, D received pushes (from the P that pushes, once the router learnt it does)
    as well as reads, and P and D hold no block afterwards."""
    lengths = [n for n in LENGTHS if n > 1] * 2
    prompts = [token_prompt(n, seed=13000 + i) for i, n in enumerate(lengths)]
    expected = [oracle(fleet, model, prompt) for prompt in prompts]
    prefills = [fleet.servers[name] for name in TWO_PREFILLS]
    decode = fleet.servers["d_hixl"]
    served = [prefilled(prefill) for prefill in prefills]
    receives, moves = hixl_counter(decode, "push_receives"), pulled(decode)[0]
    url = fleet.routers["2p1d"].url
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda prompt: greedy(url, prompt, MAX_TOKENS), prompts))
    for prompt, tokens, want in zip(prompts, outputs, expected, strict=True):
        assert tokens == want, f"{len(prompt)}-token prompt differs under concurrency"
    for prefill, before in zip(prefills, served, strict=True):
        assert prefilled(prefill) > before, f"{prefill.name} prefilled nothing"
    assert wait_for_pulls(decode, moves + len(prompts))[0] == moves + len(prompts)
    assert hixl_counter(decode, "push_receives") > receives, "nothing was pushed"
    for server in (*prefills, decode):
        wait_kv_idle(server)


def prefilled(server: VllmServer) -> float:
    return metric_total(read_metrics(server.url), "vllm:request_success_total")


def test_the_state_carried_the_prompt_corrupted_or_missing_it_changes_the_output(
    fleet: NamedFleet, model: StateModel
) -> None:
    """Each control on prompts of its own: D caches what it read (prefix caching), and a
    corrupted state must not be what a later test's prompt hits. The legs go to P and D as
    vllm-router sends them, under an X-Request-Id of the test's (the router makes its own);
    without a control, the same legs give the oracle's output."""
    pairs = {"hixl": ("p_hixl", "d_hixl")}
    if model.divides:  # P at TP 2: D reads its state in slices from both P ranks
        pairs["tp21"] = TP_PAIRS["tp21"]
    for seed, (pair, names) in enumerate(pairs.items()):
        for offset, control in enumerate(("", *STATE_CONTROLS)):
            lengths = (64, 97, 160)
            base = 5000 + 1000 * offset + 10000 * seed
            prompts = [token_prompt(n, seed=base + n) for n in lengths]
            expected = [oracle(fleet, model, prompt, pair) for prompt in prompts]
            outputs = pull_directly(fleet, prompts, control, names)
            same = [len(p) for p, o, e in zip(prompts, outputs, expected, strict=True) if o == e]
            if control:
                assert not same, f"{pair} {control}: the {same}-token prompts did not change"
            else:
                assert len(same) == len(prompts), f"{pair}: the legs without a control differ"


def pull_directly(
    fleet: NamedFleet, prompts: list[list[int]], control: str, names: tuple[str, str]
) -> list[list[int]]:
    """D's outputs of ``prompts``, each pulled from P under state ``control`` (or none); P
    and D named ``names``."""
    decode = fleet.servers[names[1]]
    ranks = DECODE_RANKS.get(names[1], 1)
    pulls = pulled(decode)[0]
    outputs = [legs(fleet, names, prompt, MAX_TOKENS, control) for prompt in prompts]
    moved = pulls + len(prompts) * ranks
    assert wait_for_pulls(decode, moved)[0] == moved
    return outputs


def legs(
    fleet: NamedFleet, names: tuple[str, str], prompt: list[int], max_tokens: int, control: str = ""
) -> list[int]:
    """D's output of ``prompt`` from the two legs vllm-router sends a P/D pair in pull mode
    (P's, then D's with P's answer), under an X-Request-Id of the test's (the router makes
    its own) that asks for state ``control`` (or none); P and D named ``names``."""
    prefill, decode = (fleet.servers[name] for name in names)
    unique = uuid.uuid4().hex
    request_id = state_control_id(control, unique) if control else unique
    ids = {"model": SERVED_MODEL_NAME, "request_id": request_id}
    answer = send_leg(prefill.url, prompt, PREFILL_LEG_PARAMS, max_tokens=1, **ids)
    assert answer.kv_transfer_params, f"P answered no kv_transfer_params: {answer.raw}"
    params = answer.kv_transfer_params
    return send_leg(decode.url, prompt, params, max_tokens=max_tokens, **ids).token_ids


def test_a_plain_server_agrees_on_the_first_token_and_its_logprob(
    fleet: NamedFleet, model: StateModel
) -> None:
    """D computes the last prompt token as a decode step and a plain server in its prefill:
    in bf16 the last bits differ (later tokens may then part), but the first token is the
    same and its logprob within FIRST_LOGPROB_TOLERANCE (the README states it)."""
    plain = fleet.servers["plain"].url
    for n in (17, 64, 160):
        pd, alone = (
            complete(url, PROMPTS[n], model=SERVED_MODEL_NAME, max_tokens=4, extra=LOGPROBS)
            for url in (fleet.routers["hixl"].url, plain)
        )
        assert pd.token_ids[0] == alone.token_ids[0], f"{n}-token prompt: first token differs"
        gap = abs(first_logprob(pd) - first_logprob(alone))
        assert gap <= FIRST_LOGPROB_TOLERANCE, f"{n}-token prompt: logprobs {gap:.4f} apart"


def first_logprob(generation: Generation) -> float:
    return float(generation.raw[0]["choices"][0]["logprobs"]["token_logprobs"][0])
