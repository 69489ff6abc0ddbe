"""The README against the code it documents: "What travels in kv_transfer_params" names
exactly the fields P sends and which are the connector's own, and the misconfiguration table
exactly the kinds the connector counts. A field or kind added without the doc fails here."""

from __future__ import annotations

import re
from pathlib import Path

from hixl_connector.connector.endpoints import RemoteEndpoint
from hixl_connector.connector.scheduler.misconfig import KINDS
from hixl_connector.connector.transfer_params import (
    OWN_PARAMS,
    REQUIRED_PARAMS,
    build_remote_decode_params,
)

README = Path(__file__).resolve().parents[2] / "README.md"
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}


def params_section() -> str:
    text = README.read_text()
    start = text.index("### What travels in `kv_transfer_params`")
    return text[start : text.index("\n## ", start)]


def sent_fields() -> set[str]:
    endpoint = RemoteEndpoint("p", "10.0.0.5", 6000, 1, 7, incarnation=9)
    return set(build_remote_decode_params(endpoint, "r", [[1]], 16, (3, 0), [16]))


def test_every_field_p_sends_is_documented_and_nothing_else() -> None:
    section = params_section()
    named = set(re.findall(r"`([a-z_]+)`", section)) - {"kv_transfer_params"}
    assert named == sent_fields()
    assert set(REQUIRED_PARAMS) <= sent_fields()


def test_the_connectors_own_fields_are_counted_and_listed() -> None:
    section = " ".join(params_section().split())
    match = re.search(r"and (\w+) of its own: (.*?) D refuses", section)
    assert match is not None, "the section no longer says which fields are the connector's own"
    own = re.findall(r"`([a-z_]+)` \(", match[2])
    # OWN_PARAMS (which NixlConnector's params lack), and the optional block size.
    assert set(own) == {*OWN_PARAMS, "remote_block_size"}
    assert NUMBERS[match[1]] == len(own)


def test_every_misconfiguration_kind_is_in_the_table() -> None:
    text = README.read_text()
    start = text.index("| kind | what happened")
    table = text[start : text.index("\n\n", start)]
    assert sorted(re.findall(r"^\| `([a-z_]+)` \|", table, re.M)) == sorted(KINDS)


def test_the_layout_lists_every_module_of_the_connector() -> None:
    """Each room's modules are listed under their folder, each once."""
    readme = README.read_text()
    block = readme[readme.index("## Layout of the code") :]
    block = block[: block.index("  datadist/")]
    listed: list[str] = []
    room = ""
    for line in block.splitlines():
        name = line.strip().split(" ")[0] if line.strip() else ""
        if line.startswith("    ") and not line.startswith("      ") and name.endswith("/"):
            room = name
        elif line.startswith("    ") and not line.startswith("      "):
            room = ""
        if name.endswith(".py"):
            listed.append(room + name)
    package = Path(__file__).resolve().parents[2] / "hixl_connector" / "connector"
    modules = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "__init__.py"
    )
    assert sorted(listed) == modules


def test_every_relative_link_of_the_documents_names_a_file_that_exists() -> None:
    root = README.parent
    broken = []
    for document in [README, root / "CHANGELOG.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if "://" not in target and not (document.parent / target).exists():
                broken.append(f"{document.relative_to(root)} -> {target}")
    assert broken == []


def test_every_module_path_the_protocol_page_names_exists() -> None:
    """docs/protocol.md names modules relative to hixl_connector/connector/ (or the repo)."""
    root = README.parent
    text = (root / "docs" / "protocol.md").read_text()
    missing = [
        path
        for path in sorted(set(re.findall(r"`([\w/]+\.(?:py|cpp|h|md))", text)))
        if not any(
            (base / path).exists()
            for base in (
                root,
                root / "docs",
                root / "hixl_connector" / "connector",
                root / "hixl_connector",
            )
        )
    ]
    assert missing == []
