"""What the shape tests with fleets of their own (MLA, speculative decoding, hybrid) share:
starting a NamedFleet, the NIXL oracle's servers (configured as bench-serve's
``NIXL_CONFIG``), and greedy completions."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from hixl_connector.tools.demo.client import complete
from hixl_connector.tools.demo.processes import free_port
from hixl_connector.tools.demo.servers import SERVED_MODEL_NAME, VllmServer

from ..harness import NamedFleet, Pair, PDLauncher


def nixl_env(name: str) -> dict[str, str]:
    """The environment of server ``name``: a NIXL server (its name says "nixl") gets a side
    channel port of its own."""
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} if "nixl" in name else {}


def start_named(
    launcher: PDLauncher,
    configs: Mapping[str, Mapping[str, Any] | None],
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
) -> dict[str, VllmServer]:
    """A server per name with its --kv-transfer-config (None: a plain server), all with
    ``args`` and ``env``; a NIXL server gets its side channel port (nixl_env)."""
    return {
        name: launcher.server(name, config, args=args, env={**(env or {}), **nixl_env(name)})
        for name, config in configs.items()
    }


def serve_named_fleet(
    launcher: PDLauncher,
    start_servers: Callable[[], dict[str, VllmServer]],
    pairs: Mapping[str, Pair],
) -> Iterator[NamedFleet]:
    """A fixture's body: the servers ``start_servers`` starts and a router per named (P, D)
    pair (P: a name, or several), everything ``launcher`` started stopped at the end."""
    with launcher:
        servers = start_servers()
        yield NamedFleet(servers, launcher.pairs(servers, pairs))


def greedy(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy completion's token ids of ``prompt`` at ``url``."""
    return complete(url, prompt, model=SERVED_MODEL_NAME, max_tokens=max_tokens).token_ids
