"""The benchmark's report: the printed table and the PNG bar chart, from its JSON figures."""

from __future__ import annotations

from typing import Any

COLUMNS: tuple[str, ...] = (
    *("transport", "block", "GB/s", "memcpy GB/s", "ratio", "bare ratio", "of bare"),
    *("req ms", "1 blk us", "8 blk us", "push ratio", "push 1 blk us"),
    "peak int. KiB (cli/srv)",
)


def _row(transport: str, name: str, f: dict[str, Any]) -> tuple[str, ...]:
    return (
        transport,
        name.removeprefix("block"),
        f"{f['request_gbps']:.2f}",
        f"{f['memcpy_gbps']:.2f}",
        f"{f['ratio_to_memcpy']:.2f}",
        f"{f['bare_ratio_to_memcpy']:.2f}",
        f"{f['ratio_to_bare']:.2f}",
        f"{f['request_ms_p50']:.1f}",
        f"{f['one_block_us_p50']:.0f}",
        f"{f['eight_blocks_us_p50']:.0f}",
        f"{f['push_ratio_to_memcpy']:.2f}",
        f"{f['push_one_block_us_p50']:.0f}",
        f"{f['client_peak_internal_bytes'] >> 10}/{f['server_peak_internal_bytes'] >> 10}",
    )


def format_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    head = (
        f"pull_blocks, Llama-8B layout ({cfg['tensors']} tensors, bf16), {cfg['request_tokens']}"
        f"-token request, {cfg['pool_bytes'] >> 20} MiB pool/side, {cfg['threads']} threads"
    )
    rows = [COLUMNS]
    for transport, blocks in report["transports"].items():
        rows += [_row(transport, name, f) for name, f in blocks.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.append(
        f"planning 128 blocks x 64 tensors: {report['plan_us_128_blocks_x_64_tensors']:.1f} us"
    )
    lines.append(
        "ratio: GB/s over memcpy GB/s at the same thread count; bare ratio: the transport's "
        "bare reference (cma: process_vm_readv; tcp: loopback sockets, as many connections) "
        "over memcpy; of bare: the engine over it; push ratio: push_blocks of the same request "
        "over memcpy"
    )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["block16", "block128"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {
        t: [report["transports"][t][n]["request_gbps"] for n in names] for t in report["transports"]
    }
    for transport, blocks in report["transports"].items():
        series[f"bare {transport}"] = [blocks[n]["bare_gbps"] for n in names]
    series["memcpy (limit)"] = [report["memcpy_gbps"][n] for n in names]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(names))])
    ax.set_xticklabels(["16-token blocks", "128-token blocks"])
    ax.set_ylabel("GB/s")
    ax.set_title(f"pull_blocks, {report['config']['request_tokens']}-token request")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(series), fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
