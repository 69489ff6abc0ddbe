"""The architecture page (docs/architecture.md) and the README's layout block against the tree:
every folder, room and document they name exists, and every room of the connector is named.
test_import_rules.py ranks the rooms as the page does."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CONNECTOR_ROOMS = ("scheduler", "worker", "kv", "leases", "push", "mapping", "peers")


def _code_block(text: str, heading: str) -> str:
    section = text[text.index(heading) :]
    start = section.index("```\n") + 4
    return section[start : section.index("```", start)]


def _architecture_layout() -> str:
    return _code_block(ARCHITECTURE.read_text(), "## Layout of the repository")


def _readme_layout() -> str:
    return _code_block((ROOT / "README.md").read_text(), "## Layout of the code")


def test_the_readme_layout_names_every_room_of_the_connector_and_no_other() -> None:
    connector_block = _readme_layout().split("\n  datadist/")[0]
    rooms = re.findall(r"^    ([a-z_]+)/ ", connector_block, flags=re.MULTILINE)
    on_disk = sorted(
        p.name
        for p in (ROOT / "hixl_connector" / "connector").iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    )
    assert sorted(rooms) == on_disk
    assert set(CONNECTOR_ROOMS) == set(on_disk)


def test_the_architecture_layout_names_only_what_the_tree_has() -> None:
    layout = _architecture_layout()
    ranked = ARCHITECTURE.read_text().split("## The connector's rooms, bottom up")[1]
    for room in CONNECTOR_ROOMS:
        assert f"`{room}`" in ranked, room
        assert (ROOT / "hixl_connector" / "connector" / room).is_dir(), room
    for folder in re.findall(
        r"^hixl_connector/  ([a-z_]+)/|^                 ([a-z_]+)/ ", layout, re.M
    ):
        name = "".join(folder)
        assert (ROOT / "hixl_connector" / name).is_dir(), name
    for package in ("native", "ascend"):
        assert (ROOT / "hixl_connector" / "datadist" / package).is_dir()
    native_rooms = re.search(r"native/src/\s+(.*?) beside", layout)
    assert native_rooms is not None
    for room in native_rooms.group(1).split():
        assert (ROOT / "native" / "src" / room.rstrip("/")).is_dir(), room
    for document in re.findall(r"([a-z_]+\.md)", layout):
        if document not in ("README.md", "CHANGELOG.md"):
            assert (ROOT / "docs" / document).exists(), document
    tests = re.findall(r"([a-z0-9_]+)/ \(", layout.split("\ntests/")[1])
    assert tests and all((ROOT / "tests" / name).is_dir() for name in tests), tests
    top_level = ("pyproject.toml", "README.md", "CHANGELOG.md", ".ci", "configs", "native", "tests")
    for top in top_level:
        assert top in layout and (ROOT / top).exists(), top
