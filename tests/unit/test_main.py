"""``python -m hixl_connector``: the tools' commands, and a clear word where they are not
installed (the runtime install leaves them out)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from hixl_connector import __main__ as entry


def test_a_command_whose_tools_are_not_installed_says_how_to_get_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.import_module

    def without_tools(name: str, *args: Any) -> Any:
        if name.startswith("hixl_connector.tools"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *args)

    monkeypatch.setattr(entry.importlib, "import_module", without_tools)
    assert entry.main(["demo"]) == 2
    assert "HIXL_TOOLS=1" in capsys.readouterr().err


def test_unknown_commands_list_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main(["nope"]) == 2
    usage = capsys.readouterr().out
    assert all(name in usage for name in entry.COMMANDS)
