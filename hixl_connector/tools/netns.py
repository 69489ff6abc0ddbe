"""P, D and the router each in their own network namespace, made and removed by a test or a
benchmark (needs root).

Layout (X derived from the test's pid so parallel runs do not collide):
- data link: ``hxd<X>p`` in the P namespace (10.77.X.1) <-> ``hxd<X>d`` in the D namespace
  (10.77.X.2): the side channel and the TCP transport run over it, and tests cut it or add
  delay and loss on it (netem, or tbf plus nftables random drops where the kernel has no
  netem);
- management network 10.78.X.0/24: a bridge in a namespace of its own (so no host firewall
  filters it) joins the root namespace (.1), P (.2), D (.3) and the router (.4). HTTP runs
  over it: the router reaches P and D, and the test reaches all three, while the data link is
  cut or impaired.
Only interfaces this module creates are touched; ``remove`` deletes the namespaces, which
deletes every interface in them and their peers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

LOSS_TABLE = "hixl_loss"  # nftables table of the random-loss rule, inside the test's namespaces
HOLE_TABLE = "hixl_hole"  # nftables table that black-holes one of P's ports


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no ip/tc)."""


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


@dataclass(frozen=True)
class NetnsBed:
    tag: int

    @property
    def ns_p(self) -> str:
        return f"hxf{self.tag}p"

    @property
    def ns_d(self) -> str:
        return f"hxf{self.tag}d"

    @property
    def ns_router(self) -> str:
        return f"hxf{self.tag}r"

    @property
    def ns_fabric(self) -> str:
        """Holds the management bridge."""
        return f"hxf{self.tag}m"

    @property
    def data_p(self) -> str:
        return f"hxd{self.tag}p"

    @property
    def data_d(self) -> str:
        return f"hxd{self.tag}d"

    @property
    def p_ip(self) -> str:
        return f"10.77.{self.tag}.1"

    @property
    def d_ip(self) -> str:
        return f"10.77.{self.tag}.2"

    @property
    def p_http(self) -> str:
        return f"10.78.{self.tag}.2"

    @property
    def d_http(self) -> str:
        return f"10.78.{self.tag}.3"

    @property
    def router_http(self) -> str:
        return f"10.78.{self.tag}.4"

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def in_ns(self, ns: str, *argv: str) -> None:
        _run(*self.exec_prefix(ns), *argv)

    def create(self) -> None:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            raise NetnsUnavailable("network namespace tests need root, ip and tc")
        for ns in (self.ns_p, self.ns_d, self.ns_router, self.ns_fabric):
            _run("ip", "netns", "add", ns)
            self.in_ns(ns, "ip", "link", "set", "lo", "up")
        _run(
            "ip", "link", "add", self.data_p, "netns", self.ns_p,
            "type", "veth", "peer", "name", self.data_d, "netns", self.ns_d,
        )  # fmt: skip
        for ns, dev, ip in (
            (self.ns_p, self.data_p, self.p_ip),
            (self.ns_d, self.data_d, self.d_ip),
        ):
            self.in_ns(ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            self.in_ns(ns, "ip", "link", "set", dev, "up")
        self._management_network()

    def _management_network(self) -> None:
        bridge = f"hxb{self.tag}"
        self.in_ns(self.ns_fabric, "ip", "link", "add", bridge, "type", "bridge")
        self.in_ns(self.ns_fabric, "ip", "link", "set", bridge, "up")
        members = (
            ("h", None, 1),
            ("p", self.ns_p, 2),
            ("d", self.ns_d, 3),
            ("r", self.ns_router, 4),
        )
        for side, ns, host in members:
            port, end = f"hxm{self.tag}{side}0", f"hxm{self.tag}{side}1"
            _run("ip", "link", "add", port, "netns", self.ns_fabric,
                 "type", "veth", "peer", "name", end, *(("netns", ns) if ns else ()))  # fmt: skip
            self.in_ns(self.ns_fabric, "ip", "link", "set", port, "master", bridge, "up")
            prefix = self.exec_prefix(ns) if ns else []
            _run(*prefix, "ip", "addr", "add", f"10.78.{self.tag}.{host}/24", "dev", end)
            _run(*prefix, "ip", "link", "set", end, "up")

    def set_data_link(self, up: bool) -> None:
        self.in_ns(self.ns_p, "ip", "link", "set", self.data_p, "up" if up else "down")

    def degrade(self) -> str:
        """Impairs the data link both ways; returns what was applied.

        netem delay + random loss where the kernel has sch_netem. Otherwise a token bucket
        (tbf) at 4 Mbit/s with a 24 KiB queue gives queueing delay (and tail drops whenever
        a burst overflows it), and an nftables rule drops 2 % of the packets leaving each
        end at random, which TCP must retransmit.
        """
        try:
            self._qdisc("netem", "delay", "20ms", "loss", "2%")
            return "netem delay 20 ms, loss 2 %"
        except RuntimeError as e:
            if "unknown" not in str(e):
                raise
        if not shutil.which("nft"):
            raise NetnsUnavailable("no sch_netem in this kernel and no nft for random loss")
        self._qdisc("tbf", "rate", "4mbit", "burst", "8kb", "limit", "24kb")
        for ns, dev in ((self.ns_p, self.data_p), (self.ns_d, self.data_d)):
            self.in_ns(ns, "nft", "add", "table", "inet", LOSS_TABLE)
            self.in_ns(ns, "nft", "add", "chain", "inet", LOSS_TABLE, "out",
                       "{ type filter hook output priority 0; policy accept; }")  # fmt: skip
            self.in_ns(ns, "nft", "add", "rule", "inet", LOSS_TABLE, "out", "oifname", dev,
                       "numgen", "random", "mod", "100", "<", "2", "counter", "drop")  # fmt: skip
        return "tbf 4 Mbit/s with a 24 KiB queue, and 2 % random loss (nftables; no sch_netem)"

    def throttle(self, rate: str, burst: str = "4kb", limit: str = "4mb") -> None:
        """Slows what P sends over the data link to ``rate`` (a token bucket with a queue
        deep enough that nothing is dropped): a read of P's blocks takes seconds, with no
        hook in either engine. A fast rate needs a ``burst`` of at least what it sends in
        one timer tick (a few ms). ``restore`` lifts it."""
        self.in_ns(
            self.ns_p, "tc", "qdisc", "add", "dev", self.data_p, "root",
            "tbf", "rate", rate, "burst", burst, "limit", limit,
        )  # fmt: skip

    def sent_bytes(self) -> int:
        """Bytes P has sent over the data link since ``throttle`` slowed it (the count of the
        queue it added)."""
        return _sum_after(self._qdisc_stats(self.ns_p, self.data_p), "Sent")

    def _qdisc_stats(self, ns: str, dev: str) -> str:
        """``tc -s qdisc show`` of ``dev`` in ``ns``: each queue's counts."""
        return subprocess.run(
            [*self.exec_prefix(ns), "tc", "-s", "qdisc", "show", "dev", dev],
            capture_output=True, text=True, timeout=20,
        ).stdout  # fmt: skip

    def dropped_packets(self) -> int:
        """Packets the impairment dropped: qdisc drops plus the random-loss rule's count."""
        total = 0
        for ns, dev in ((self.ns_p, self.data_p), (self.ns_d, self.data_d)):
            rules = subprocess.run(
                [*self.exec_prefix(ns), "nft", "list", "table", "inet", LOSS_TABLE],
                capture_output=True, text=True, timeout=20,
            ).stdout if shutil.which("nft") else ""  # fmt: skip
            total += _sum_after(self._qdisc_stats(ns, dev), "(dropped")
            total += _sum_after(rules, "packets")
        return total

    def black_hole(self, port: int) -> None:
        """Drops every packet to and from P's ``port`` in P's namespace, silently (no reset):
        a peer whose data path went silent while its other ports keep answering."""
        ns = self.ns_p
        self.in_ns(ns, "nft", "add", "table", "inet", HOLE_TABLE)
        for chain, hook, match in (("in", "input", "dport"), ("out", "output", "sport")):
            self.in_ns(ns, "nft", "add", "chain", "inet", HOLE_TABLE, chain,
                       f"{{ type filter hook {hook} priority 0; policy accept; }}")  # fmt: skip
            self.in_ns(ns, "nft", "add", "rule", "inet", HOLE_TABLE, chain,
                       "tcp", match, str(port), "counter", "drop")  # fmt: skip

    def clear_black_hole(self) -> None:
        subprocess.run(
            [*self.exec_prefix(self.ns_p), "nft", "delete", "table", "inet", HOLE_TABLE],
            capture_output=True, timeout=20,
        )  # fmt: skip

    def restore(self) -> None:
        for ns, dev in ((self.ns_p, self.data_p), (self.ns_d, self.data_d)):
            subprocess.run(
                [*self.exec_prefix(ns), "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True, timeout=20,
            )  # fmt: skip
            if shutil.which("nft"):
                subprocess.run(
                    [*self.exec_prefix(ns), "nft", "delete", "table", "inet", LOSS_TABLE],
                    capture_output=True, timeout=20,
                )  # fmt: skip

    def _qdisc(self, *spec: str) -> None:
        for ns, dev in ((self.ns_p, self.data_p), (self.ns_d, self.data_d)):
            self.in_ns(ns, "tc", "qdisc", "add", "dev", dev, "root", *spec)

    def remove(self) -> None:
        for ns in (self.ns_p, self.ns_d, self.ns_router, self.ns_fabric):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        # Normally gone with its peer in the fabric namespace already.
        subprocess.run(["ip", "link", "del", f"hxm{self.tag}h1"], capture_output=True, timeout=20)


def _sum_after(text: str, marker: str) -> int:
    """The sum of the numbers that follow ``marker`` in ``text`` (tc's and nft's counts)."""
    words = text.split()
    pairs = zip(words, words[1:], strict=False)
    return sum(int(after.rstrip(",")) for word, after in pairs if word == marker)


def make_bed() -> NetnsBed:
    """A bed under a tag no other run's namespaces use (a failed create removes what it
    made, by name: it must not be another run's)."""
    taken = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    names = {line.split()[0] for line in taken.stdout.splitlines() if line.strip()}
    free = [tag for tag in range(20, 220) if not {f"hxf{tag}{end}" for end in "pdrm"} & names]
    if not free:
        raise NetnsUnavailable("every network-namespace tag of this module is in use")
    bed = NetnsBed(tag=free[os.getpid() % len(free)])
    try:
        bed.create()
    except Exception:
        bed.remove()
        raise
    return bed
