"""The architecture page's layout against the tree and the README's layout block.

``ARCHITECTURE.md`` lives beside the repository (``../shared/``), not in it: where a checkout
has it, every folder and document its "Layout of the repository" names must exist, and every
room it names inside ``connector/`` must be a room of the README's layout block too. Where
it is absent (a clean clone, CI), the test says so and skips.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT.parent / "shared" / "ARCHITECTURE.md"
CONNECTOR_ROOMS = ("scheduler", "worker", "kv", "leases", "push", "mapping", "peers")


def _code_block(text: str, heading: str) -> str:
    section = text[text.index(heading) :]
    start = section.index("```\n") + 4
    return section[start : section.index("```", start)]


def _architecture_layout() -> str:
    if not ARCHITECTURE.exists():
        pytest.skip(f"{ARCHITECTURE} is outside this checkout")
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
    for room in CONNECTOR_ROOMS:
        assert f"{room}/" in layout, room
        assert (ROOT / "hixl_connector" / "connector" / room).is_dir(), room
    for folder in ("datadist", "tools"):
        assert f"{folder}/" in layout and (ROOT / "hixl_connector" / folder).is_dir()
    for package in ("native", "ascend"):
        assert (ROOT / "hixl_connector" / "datadist" / package).is_dir()
    native_rooms = re.search(r"native/src/\s+(.*?) beside", layout)
    assert native_rooms is not None
    for room in native_rooms.group(1).split():
        assert (ROOT / "native" / "src" / room.rstrip("/")).is_dir(), room
    for document in re.findall(r"([a-z_]+\.md)", layout):
        if document != "README.md":
            assert (ROOT / "docs" / document).exists(), document
    for top in ("pyproject.toml", "README.md", ".ci", "configs", "native", "tests"):
        assert top in layout and (ROOT / top).exists(), top
