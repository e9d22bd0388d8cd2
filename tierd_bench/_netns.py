"""The network of ``tierd bench fleet --netns``: the origin and every host in a network
namespace of its own, each joined by a veth pair to one bridge in this (the root) namespace,
each link shaped by ``tc`` tbf.

- the origin's link sends at ``origin_bps`` (its egress cap: what a bucket behind a NAT gateway
  or one busy prefix gives a whole fleet) and receives at ``host_bps``;
- each host's link sends and receives at ``host_bps`` (its NIC).

The bridge has the network's first address, so the bench (in the root namespace) reaches every
host and the origin through it; the hosts reach each other the same way. PostgreSQL stays in
the root namespace and is reached over its Unix socket, which no network namespace hides.

Names carry this process's id (``tfb<pid>...``), so two runs never collide, and a run that was
killed before it could clean up is swept by the next one (its pid is gone). Everything is
removed on exit, whatever happened; a SIGTERM is turned into an exception while the network
exists, so that ``kill`` cleans up as Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

__all__ = ["Net", "Place", "network", "sweep_leftovers", "why_no_netns"]

_PREFIX = "tfb"
# A /24 inside 10.0.0.0/8 that no route of this host uses yet is picked at random.
_TRIES = 64


@dataclass(frozen=True)
class Place:
    """Where one process runs: the command prefix that enters its namespace, and its address."""

    wrap: tuple[str, ...]
    address: str


@dataclass(frozen=True)
class Net:
    """A started network: the origin's place, each host's, the bridge's address, the rates."""

    origin: Place
    hosts: list[Place]
    gateway: str
    origin_bps: int
    host_bps: int
    description: str


def why_no_netns() -> str | None:
    """Why the namespaces cannot be made here (not root, no ``ip`` or ``tc``), or None."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    return None


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _quiet(*argv: str) -> None:
    with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
        _run(*argv)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> list[str]:
    """Remove the namespaces and bridges of earlier runs whose process is gone; their names."""
    gone = []
    names = re.findall(rf"^({_PREFIX}(\d+)\S*)", _run("ip", "netns", "list"), re.M)
    links = re.findall(rf"^\d+: ({_PREFIX}(\d+)[a-z]\w*)[:@]", _run("ip", "-o", "link"), re.M)
    for name, pid in names:
        if not _alive(int(pid)):
            _quiet("ip", "netns", "del", name)
            gone.append(name)
    for name, pid in links:
        if not _alive(int(pid)):
            _quiet("ip", "link", "del", name)
            gone.append(name)
    return gone


def _subnet() -> ipaddress.IPv4Network:
    used = [
        ipaddress.ip_network(w, strict=False)
        for w in re.findall(r"(\d+\.\d+\.\d+\.\d+/\d+)", _run("ip", "-4", "addr", "show"))
    ]
    used += [
        ipaddress.ip_network(w)
        for w in re.findall(r"^(\d+\.\d+\.\d+\.\d+/\d+)", _run("ip", "-4", "route"), re.M)
    ]
    for _ in range(_TRIES):
        net = ipaddress.IPv4Network(
            f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(256)}.0/24"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the bench's bridge")


def _shape(ns: tuple[str, ...], dev: str, bps: int) -> None:
    """tbf at ``bps`` on ``dev``'s egress. The bucket holds 10 ms at the rate and at least
    two 64 KiB GSO packets, so that big segments pass and the rate is what it says."""
    burst = max(bps // 8 // 100, 128 * 1024)
    _run(
        *ns,
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        f"{bps}bit",
        "burst",
        str(burst),
        "latency",
        "50ms",
    )


#: The per-connection pacer's buckets: a class for each even client port of a window of 8,192
#: (bits 1-12 of the port, in two u32 hash levels of 256 and 16). Linux's ``connect()`` takes
#: even ports first, each a small random step after the last one to the same server, so the
#: connections open at once never share a bucket. A hash on the port's low byte alone put 64
#: connections in about 57 buckets (measured), and connections that share a bucket share its
#: rate: a load of many GETs then ran at the pace of its busiest bucket, a half or a third of
#: what S3 gives. (Bits 1-14, 16,384 classes, took 17 s to set up against 0.8 s for these.)
_LOW_BUCKETS, _HIGH_BUCKETS = 256, 16


def _pace(ns: tuple[str, ...], dev: str, per_flow_bps: int) -> None:
    """Each TCP connection leaving ``dev`` at most ``per_flow_bps``, as S3 serves each
    connection, whatever the size of its requests (nginx's own ``limit_rate`` is per request
    and lets a request's first second of bytes go at once).

    The kernel's per-flow pacer (``fq maxrate``) is not built on these machines, nor the
    ``flow`` classifier, so: an HTB class per bucket, and u32 hashes on the destination port
    (the client's ephemeral port) sending each connection to a bucket of its own
    (:data:`_LOW_BUCKETS`).
    """
    burst = str(max(per_flow_bps // 8 // 100, 256 * 1024))  # 10 ms, and whole GSO packets
    rate = " ".join(
        (
            "rate",
            f"{per_flow_bps}bit",
            "ceil",
            f"{per_flow_bps}bit",
            "burst",
            burst,
            "cburst",
            burst,
        )
    )
    # The word at offset 20 of the IP header is the TCP ports: source << 16 | destination. u32
    # shifts a masked key down by its mask's lowest bit: ports' bits 1-8, then 9-12.
    high_mask = (_HIGH_BUCKETS - 1) << 9
    lines = [
        f"qdisc add dev {dev} root handle 1: htb default 1 r2q 1000",
        f"class add dev {dev} parent 1: classid 1:1 htb rate 100gbit",  # not TCP: unpaced
        f"filter add dev {dev} parent 1: prio 1 handle 2: protocol ip u32 divisor {_LOW_BUCKETS}",
    ]
    for low in range(_LOW_BUCKETS):
        table = 3 + low
        lines.append(
            f"filter add dev {dev} parent 1: prio 1 handle {table:x}: protocol ip u32 "
            f"divisor {_HIGH_BUCKETS}"
        )
        for high in range(_HIGH_BUCKETS):
            classid = 0x100 + low * _HIGH_BUCKETS + high
            lines.append(f"class add dev {dev} parent 1: classid 1:{classid:x} htb {rate}")
            lines.append(
                f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht {table:x}:{high:x}: "
                f"match u32 0 0 flowid 1:{classid:x}"
            )
        lines.append(
            f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 2:{low:x}: "
            f"match u32 0 0 hashkey mask {high_mask:#010x} at 20 link {table:x}:"
        )
    lines.append(
        f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 800:: match ip protocol 6 "
        f"0xff hashkey mask 0x000001fe at 20 link 2:"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".tc") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        _run(*ns, "tc", "-batch", f.name)


class _Terminated(Exception):
    """SIGTERM while the network existed: unwinds like Ctrl-C, so everything is removed."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    def raise_(signum: int, frame: FrameType | None) -> None:
        raise _Terminated("terminated by SIGTERM")

    try:
        old = signal.signal(signal.SIGTERM, raise_)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def network(
    hosts: int,
    origin_bps: int,
    host_bps: int,
    say: Callable[[str], None] = lambda s: None,
    *,
    per_flow_bps: int | None = None,
) -> Iterator[Net]:
    """The origin and ``hosts`` hosts in namespaces of their own on one bridge (see the
    module docstring); everything removed on exit. ``per_flow_bps``: the origin paces each
    connection to that rate instead (:func:`_pace`), with no cap of its own."""
    reason = why_no_netns()
    if reason is not None:
        raise RuntimeError(reason)
    swept = sweep_leftovers()
    if swept:
        say(f"removed leftovers of earlier runs: {', '.join(swept)}")
    tag = f"{_PREFIX}{os.getpid()}"
    bridge = f"{tag}b"
    made: list[str] = []
    with _sigterm_unwinds():
        try:
            subnet = _subnet()
            addrs = [str(a) for a in subnet.hosts()]
            gateway = addrs[0]
            _run("ip", "link", "add", bridge, "type", "bridge")
            _run("ip", "link", "set", bridge, "up")
            _run("ip", "addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", bridge)
            places = []
            for i, name in enumerate(["o", *(f"h{j}" for j in range(hosts))]):
                ns, veth = f"{tag}{name}", f"{tag}v{name}"
                _run("ip", "netns", "add", ns)
                made.append(ns)
                inside = ("ip", "netns", "exec", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "link", "set", veth, "master", bridge, "up")
                addr = addrs[i + 1]
                _run(*inside, "ip", "addr", "add", f"{addr}/{subnet.prefixlen}", "dev", "eth0")
                _run(*inside, "ip", "link", "set", "eth0", "up")
                _run(*inside, "ip", "link", "set", "lo", "up")
                if name == "o" and per_flow_bps:
                    _pace(inside, "eth0", per_flow_bps)
                else:
                    _shape(inside, "eth0", origin_bps if name == "o" else host_bps)
                _shape((), veth, host_bps)  # towards the namespace: its NIC's receive rate
                places.append(Place(inside, addr))
            sends = (
                f"each origin connection at {per_flow_bps / 1e6:g} Mbit/s (tc htb, u32 hash)"
                if per_flow_bps
                else f"origin sends at {origin_bps / 1e6:g} Mbit/s"
            )
            desc = (
                f"network namespaces on bridge {bridge} ({subnet}); tc tbf: {sends}, "
                f"each host link {host_bps / 1e6:g} Mbit/s both ways"
            )
            say(desc)
            yield Net(places[0], places[1:], gateway, origin_bps, host_bps, desc)
        finally:
            for ns in made:
                # Deleting a veth end deletes the pair at once; a namespace's deletion would
                # take its pair too, but later, in the kernel's own time.
                _quiet("ip", "link", "del", ns.replace(tag, f"{tag}v", 1))
                _quiet("ip", "netns", "del", ns)
            _quiet("ip", "link", "del", bridge)
