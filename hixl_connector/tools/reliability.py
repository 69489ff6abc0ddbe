"""``python -m hixl_connector reliability``: the fault matrix as a markdown table.

The fault tests (tests/faults) record each case they ran: what happened, how long it took to
be detected (measured in the test) and what was left over (read from vLLM's own KV usage
gauge). This renders those rows, plus the listener exposure of the defaults, and prints the
table or writes it between ``<!-- reliability:begin -->`` and ``<!-- reliability:end -->``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- reliability:begin -->", "<!-- reliability:end -->"
DEFAULT_REPORT = "artifacts/faults/reliability.json"
HOW_TO = (
    "Measured by `pytest tests/faults` (real vLLM CPU servers and router, the engines inside "
    "them, network namespaces; leases of 3 s, pull timeout 3 s; a fault meant to land in "
    "the middle of a read or a push lands there because the test slows P's side of the data "
    "link between the namespaces, with no hook in either engine). "
    "*Detected after*: "
    "from the fault (kill, stop, cut, disconnect, P's answer) to the moment its effect was "
    "seen: the client got the failure or the answer, or P's KV usage was back to idle. "
    "*Left over*: vLLM's own KV usage gauge and request gauges afterwards. The soak runs "
    "every server, the plain one too, with oneDNN's per-shape primitive cache off "
    "(`ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`): with it on, a plain vLLM CPU server grew 352 MiB "
    "over 1000 prompts of varied length, which would hide a leak; with it off a "
    "128 KiB-per-request leak fails the short form. Longer runs: "
    "`--fuzz-examples N` (hostile inputs per target, default 2000) and `--long-faults` "
    "(2000-request soak). Regenerate with `python -m hixl_connector reliability --from "
    f"{DEFAULT_REPORT} --update docs/reliability.md`."
)
EXPOSURE = (
    "| listener | default address | exposure |\n"
    "|---|---|---|\n"
    "| side channel (P: handshake, lease done/release/heartbeat, push registrations) | "
    "`side_channel_host` = 127.0.0.1, port `side_channel_port` + rank | this host only; "
    "set a routable address for multi-host P/D, with `auth_token` (HMAC on every request and "
    "reply; replays and requests for another rank or start refused; hosts' clocks within "
    "30 s) |\n"
    "| engine TCP server (P: KV reads) | `engine_host` = `side_channel_host`, port "
    "`engine_port` (0 = any free) | same address as the side channel; with `auth_token` no "
    "table or byte is served before the HMAC challenge/response; at most "
    "`server_handshakes` (1024) connections in the handshake (5 s each) and "
    "`server_connections` (4096) authenticated, served by a fixed set of event loops; TCP "
    "keepalive on every connection |\n"
    "| return listener (D, push mode only: P's writes) | the address D's link to P leaves "
    "from, any free port; open while D has a link | the same token and checks as the engine "
    "server; a write lands only in blocks D granted to that P for that request |\n"
)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        HOW_TO,
        "",
        "| case | what happens | detected after | left over |",
        "|---|---|---|---|",
    ]
    for row in rows:
        detected = row.get("detected_s")
        when = "n/a" if detected is None else f"{float(detected):.2f} s"
        cells = (_cell(row["case"]), _cell(row["outcome"]), when, _cell(row["leftover"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + EXPOSURE


def update(readme: Path, table: str) -> bool:
    """Replaces the text between the markers; False when they are missing."""
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[: start + len(BEGIN)] + "\n" + table + text[end:])
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hixl_connector reliability")
    parser.add_argument("--from", dest="source", default=DEFAULT_REPORT, help="the tests' JSON")
    parser.add_argument(
        "--update",
        default="",
        help="the page to rewrite between the markers",
    )
    args = parser.parse_args(argv)
    try:
        rows = json.loads(Path(args.source).read_text())["cases"]
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read fault results from {args.source}: {e}", file=sys.stderr)
        return 2
    table = render(rows)
    if not args.update:
        print(table, end="")
        return 0
    if not update(Path(args.update), table):
        print(f"{args.update} has no {BEGIN} ... {END} markers; the table:\n", file=sys.stderr)
        print(table, end="")
        return 1
    print(f"wrote {len(rows)} cases into {args.update}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
