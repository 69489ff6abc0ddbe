"""``python -m hixl_connector <command> ...``: a dispatcher for the project's tools.

Each command is imported only when it is run, so adding one costs nothing to the others.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module, one-line help); the module exposes main(argv) -> int
COMMANDS = {
    "check": (
        "hixl_connector.fabric_check.cli",
        "link P and D back-ends as the connector does and verify guarded reads (fabric check)",
    ),
    "bench": ("hixl_connector.tools.bench", "benchmark pull_blocks between two processes"),
    "bench-tp": ("hixl_connector.tools.bench_tp", "TP-mismatched pulls vs equal TP, same bytes"),
    "bench-step": (
        "hixl_connector.tools.bench_step",
        "the connector's time per step with thousands of requests waiting for KV",
    ),
    "bench-serve": (
        "hixl_connector.tools.bench_serve",
        "vllm bench serve: plain server vs P/D through the router",
    ),
    "bench-idle": (
        "hixl_connector.tools.bench_idle",
        "D's CPU while requests wait for pushed KV, next to a plain server's",
    ),
    "bench-link": (
        "hixl_connector.tools.bench_link",
        "long prompts over a rate-limited link: pull vs push vs layer by layer (root)",
    ),
    "demo": (
        "hixl_connector.tools.demo.pd_demo",
        "P/D with real vLLM and vllm-router vs a plain server",
    ),
    "soak": (
        "hixl_connector.tools.soak",
        "many requests through router, P and D: no drift, no leak",
    ),
    "reliability": (
        "hixl_connector.tools.reliability",
        "render the fault matrix table into README.md",
    ),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or args[0] not in COMMANDS:
        print("usage: python -m hixl_connector <command> [args]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(COMMANDS[args[0]][0])
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("hixl_connector.tools"):
            raise
        print(
            f"python -m hixl_connector {args[0]}: the tools are not part of this install of "
            "hixl-connector (the runtime alone); install it with HIXL_TOOLS=1 set, as "
            "bash .ci/setup does",
            file=sys.stderr,
        )
        return 2
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
