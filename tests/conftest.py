"""Puts ``tests/support`` (the test-only connector) on the path of the tests and of every
process they start."""

from __future__ import annotations

import os
import sys
from pathlib import Path

SUPPORT = str(Path(__file__).resolve().parent / "support")
sys.path.insert(0, SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SUPPORT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
)
