"""Puts ``tests/support`` (the test-only connector) on the path of the tests and of every
process they start, and turns off hypothesis's per-example deadline: these machines are
shared and noisy, and no test here is about speed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import settings

settings.register_profile("shared-machines", deadline=None)
settings.load_profile("shared-machines")

SUPPORT = str(Path(__file__).resolve().parent / "support")
sys.path.insert(0, SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SUPPORT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
)
