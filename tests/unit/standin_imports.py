"""Where the llm_datadist STAND-IN lives (tests/ascend_standin/, ``STANDIN_DIR``: also what a
test puts on a child process's PYTHONPATH), and how a unit test imports its helpers.

The stand-in's folder is on ``sys.path`` only for those imports: left there, it would make
every later ``import llm_datadist`` of the session find the stand-in, where a test means to
choose it (``harness.standin_on_path``) or to see that CANN is not installed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parents[1] / "ascend_standin"


@contextmanager
def standin_helpers_importable() -> Iterator[None]:
    """The stand-in's helper modules (``harness``, ``worker_harness``, ``standin_client``,
    ``standin_peer``) importable by name while the block runs."""
    sys.path.insert(0, str(STANDIN_DIR))
    try:
        yield
    finally:
        sys.path.remove(str(STANDIN_DIR))
