"""The native extension is used only when it was built from the bindings this package speaks."""

from __future__ import annotations

import sys
import types

import pytest

import hixl_connector
from hixl_connector.datadist.native.llm_datadist import NATIVE_ABI_VERSION, load_native


def test_the_built_extension_has_the_expected_abi() -> None:
    assert load_native().ABI_VERSION == NATIVE_ABI_VERSION


@pytest.mark.parametrize("abi", [NATIVE_ABI_VERSION - 1, NATIVE_ABI_VERSION + 1, None])
def test_a_stale_extension_is_refused_naming_the_rebuild(
    monkeypatch: pytest.MonkeyPatch, abi: int | None
) -> None:
    stale = types.ModuleType("hixl_connector._native")
    if abi is not None:
        stale.ABI_VERSION = abi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hixl_connector._native", stale)
    monkeypatch.setattr(hixl_connector, "_native", stale, raising=False)
    with pytest.raises(ImportError, match=r"stale build: .*ABI_VERSION .*bash \.ci/setup"):
        load_native()
