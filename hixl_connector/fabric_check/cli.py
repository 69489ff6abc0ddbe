"""The command line of ``python -m hixl_connector check``.

Same host (the default): starts the prefill side as a child process on ``--p-device`` and
reads from it here on ``--d-device``. Two hosts: ``check --serve HOST:PORT`` on P's host,
then ``check --connect HOST:PORT`` on D's. Exit status 0 when every read was verified.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import socket
import subprocess
import sys
from typing import Any

from hixl_connector.connector.config import HixlConfig
from hixl_connector.fabric_check.fixes import fix_for
from hixl_connector.fabric_check.probe import ProbeShape
from hixl_connector.fabric_check.read import CheckFailure, ReadReport, read
from hixl_connector.fabric_check.serve import serve

READY_TIMEOUT_S = 180.0  # the prefill side imports torch (and torch_npu) first
STOP_TIMEOUT_S = 15.0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hixl_connector check",
        description="link a prefill and a decode back-end as the connector does, run guarded "
        "reads of probe blocks, verify them, and print the fabric, the placements, the "
        "bandwidth and a fix for any failure",
    )
    parser.add_argument(
        "--kv-transfer-config",
        default="{}",
        help="the --kv-transfer-config vLLM is given, as JSON or @FILE: its "
        "kv_connector_extra_config (backend, ascend_hccs, ascend_local_comm_res, engine_host, "
        "timeouts) configures both sides",
    )
    parser.add_argument(
        "--backend", choices=("auto", "native", "ascend"), help="default: the config's, or auto"
    )
    parser.add_argument(
        "--host",
        help="this host's engine address (default: the config's engine_host, or 127.0.0.1; "
        "on Ascend the NIC's, never 127.0.0.1)",
    )
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--serve", metavar="HOST:PORT", help="be the prefill side only")
    side.add_argument("--connect", metavar="HOST:PORT", help="be the decode side only")
    parser.add_argument("--p-device", default="", help="e.g. npu:0 or cpu (default: picked)")
    parser.add_argument("--d-device", default="", help="e.g. npu:1 or cpu (default: picked)")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--reads", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    if args.blocks < 2 or args.block_kib < 1 or args.reads < 1:
        parser.error("--blocks must be >= 2, --block-kib and --reads >= 1")
    return args


def default_devices(backend: str) -> tuple[str, str]:
    """Two NPUs where the ascend back-end runs on an NPU host, else host memory."""
    from hixl_connector.datadist.backend import resolve_backend

    if resolve_backend(backend, None) == "ascend":
        try:
            import torch
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)

            count = int(torch.npu.device_count())
        except Exception:
            count = 0
        if count:
            return "npu:0", f"npu:{min(1, count - 1)}"
    return "cpu", "cpu"


def extra_config(text: str) -> dict[str, Any]:
    """The kv_connector_extra_config of a --kv-transfer-config given as JSON or @FILE."""
    if text.startswith("@"):
        with open(text[1:]) as source:
            text = source.read()
    config = json.loads(text)
    extra = config.get("kv_connector_extra_config", {}) if isinstance(config, dict) else None
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    return extra


def settle(args: argparse.Namespace) -> None:
    """Fills --backend and --host from the config where they were not given."""
    extra = extra_config(args.kv_transfer_config)
    args.extra = extra
    args.backend = args.backend or str(extra.get("backend", "auto"))
    args.host = args.host or str(extra.get("engine_host", "127.0.0.1"))


def config_for(args: argparse.Namespace, port: int, side: str) -> HixlConfig:
    extra = {**args.extra, "backend": args.backend, "engine_host": args.host, "engine_port": port}
    return HixlConfig.from_dict(extra, f"fabric-check-{side}")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def run_serve(args: argparse.Namespace, shape: ProbeShape, device: str) -> int:
    host, port = address(args.serve)
    args.host = host
    try:
        return serve(config_for(args, port or free_port(host), "p"), shape, device)
    except Exception as e:
        print(json.dumps({"stage": "prefill", "error": str(e), "fix": fix_for("register", e)}))
        return 1


def start_prefill(args: argparse.Namespace, device: str) -> tuple[subprocess.Popen[str], Any]:
    command = [
        sys.executable, "-m", "hixl_connector", "check",
        "--serve", f"{args.host}:{free_port(args.host)}",
        "--backend", args.backend, "--kv-transfer-config", args.kv_transfer_config,
        "--p-device", device, "--blocks", str(args.blocks), "--block-kib", str(args.block_kib),
    ]  # fmt: skip
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], READY_TIMEOUT_S)
    line = child.stdout.readline() if ready else ""
    return child, json.loads(line) if line else {"stage": "prefill", "error": "no answer"}


def stop(child: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError, ValueError):
        if child.stdin is not None:
            child.stdin.close()
    try:
        child.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(STOP_TIMEOUT_S)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        settle(args)
    except (OSError, ValueError) as e:
        print(f"python -m hixl_connector check: {e}", file=sys.stderr)
        return 2
    shape = ProbeShape(args.blocks, args.block_kib * 1024)
    p_default, d_default = default_devices(args.backend)
    if args.serve:
        return run_serve(args, shape, args.p_device or p_default)
    result: dict[str, Any] = {
        "backend": args.backend,
        "devices": {"prefill": args.p_device or p_default, "decode": args.d_device or d_default},
    }
    child = None
    try:
        if args.connect:
            peer = address(args.connect)
        else:
            child, ready = start_prefill(args, result["devices"]["prefill"])
            if "port" not in ready:
                result.update(ok=False, **ready)
                return finish(result, args.json)
            peer = (args.host, int(ready["port"]))
            result["placements_prefill"] = ready["placements"]
        config = config_for(args, free_port(args.host), "d")
        report = read(config, shape, result["devices"]["decode"], peer, args.reads)
        result.update(ok=True, **summary(report, shape, args.reads))
    except CheckFailure as e:
        result.update(ok=False, stage=e.stage, error=str(e.error), fix=fix_for(e.stage, e.error))
    except Exception as e:
        result.update(ok=False, stage="config", error=str(e), fix=fix_for("config", e))
    finally:
        if child is not None:
            stop(child)
    return finish(result, args.json)


def summary(report: ReadReport, shape: ProbeShape, reads: int) -> dict[str, Any]:
    guard_us = sorted(report.guard_seconds)[len(report.guard_seconds) // 2] * 1e6
    return {
        "fabric": report.fabric,
        "placements_decode": report.placements,
        "reads": reads,
        "read_bytes": report.read_bytes,
        "blocks": shape.num_blocks,
        "median_gbps": round(report.median_gbps, 3),
        "best_gbps": round(report.best_gbps, 3),
        "guard_us": round(guard_us, 1),
    }


def finish(result: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(result))
        return 0 if result.get("ok") else 1
    devices = result["devices"]
    print(f"hixl_connector check: backend {result['backend']}")
    print(f"  prefill on {devices['prefill']}, decode on {devices['decode']}")
    if "fabric" in result:
        print(f"  fabric: {result['fabric']}")
    for side in ("prefill", "decode"):
        placements = result.get(f"placements_{side}")
        if placements:
            listed = ", ".join(f"{what} {where}" for what, where in placements.items())
            print(f"  {side} registered: {listed}")
    if result.get("ok"):
        print(
            f"  {result['reads']} guarded reads of {result['blocks']} blocks "
            f"({result['read_bytes'] / 2**20:.1f} MiB each): every byte verified, the lease "
            "word vouched for each, a read under an unpublished word refused"
        )
        print(
            f"  bandwidth: {result['median_gbps']:.2f} GB/s median, {result['best_gbps']:.2f} "
            f"GB/s best; the guard's two word reads alone: {result['guard_us']:.0f} us"
        )
        print("PASS")
        return 0
    print(f"FAIL at {result.get('stage')}: {result.get('error')}")
    print(f"  fix: {result.get('fix')}")
    return 1
