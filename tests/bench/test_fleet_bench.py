"""``tierd bench fleet`` end to end, tiny: two real tierd processes on the tests' PostgreSQL
(through ``--catalog-url``, in a scratch database) and moto. Only the result's shape, that every
measure ran and that every host's bytes were checked are asserted, never a speed; and the bench
leaves the server and its directory as it found them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from sqlalchemy.engine import make_url
from typer.testing import CliRunner

from app.cli import cli
from tests.pg_support import PgServer
from tierd_bench import fleetnet
from tierd_bench._netns import network, sweep_leftovers, why_no_netns
from tierd_bench._nginx import OriginUnavailable, bytes_sent, serve
from tierd_bench.fleet import SAMPLE, FleetBenchUnavailable, _write_shard, run

from .test_report import assert_shared_shape

pytest.importorskip("moto.server", reason="moto[server] is not installed")

runner = CliRunner()
ROWS = [
    "hand_s", "fleet_s", "fleet_extra_s", "single_s", "hand_gbps", "fleet_gbps", "single_gbps",
]  # fmt: skip


def _said(output: str) -> str:
    return " ".join(output.replace("│", " ").split())


def _databases(server: PgServer) -> set[str]:
    return {r[0] for r in server.execute("postgres", "SELECT datname FROM pg_database")}


@pytest.mark.slow  # suite time: ~9 CPU-seconds; the namespace test below runs a distribution
def test_two_hosts_by_hand_and_by_a_fleet_job(
    tmp_path: Path, pg_server: PgServer, pg_url: str
) -> None:
    before = _databases(pg_server)
    work, out = tmp_path / "work", tmp_path / "fleet.json"
    work.mkdir()
    args = ["--hosts", "2", "--shards", "2", "--size", "128KiB", "--runs", "1",
            "--poll-interval", "0.2", "--catalog-url", pg_url, "--dir", str(work)]  # fmt: skip
    result = runner.invoke(cli, ["bench", "fleet", *args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(out.read_text())
    assert_shared_shape(doc, "fleet")
    rows, setup = doc["rows"], doc["setup"]
    assert list(rows) == ROWS
    for key in ROWS:
        if key != "fleet_extra_s":  # a difference: either sign is a result
            assert rows[key]["value"] > 0, rows[key]
    assert rows["fleet_s"]["vs"] == "hand_s" and rows["fleet_s"]["ratio"] > 0
    assert rows["fleet_gbps"]["vs"] == "hand_gbps"
    assert rows["hand_gbps"]["vs"] == "single_gbps"
    assert (setup["hosts"], setup["shards"], setup["runs"]) == (2, 2, 1)
    assert setup["size_bytes"] == 128 << 10 and setup["poll_interval_s"] == 0.2
    assert {k: len(v) for k, v in setup["seconds"].items()} == {"hand": 1, "fleet": 1, "single": 1}
    # The bytes check ran after every measure: the warm-up, by hand and fleet on both hosts,
    # and one host alone; each copy compared at both ends, on disk and over REST.
    copies = 2 + 2 * 2 + 2 * 2 + 2
    assert setup["checked"] == {
        "measures": 4,
        "copies": copies,
        "bytes_compared": copies * 4 * SAMPLE,
    }
    assert "scratch database" in setup["postgresql"]
    assert "fleet poll interval 0.2 s" in result.stdout
    assert "fleet: one POST /v1/fleet/prefetch to 2 hosts" in result.stdout
    # The scratch database is gone, the URL's own catalog untouched, the hosts' dirs removed.
    assert _databases(pg_server) == before
    dbname = make_url(pg_url).database
    assert dbname is not None
    assert pg_server.execute(dbname, "SELECT count(*) FROM files") == [(0,)]
    assert pg_server.execute(dbname, "SELECT count(*) FROM hosts") == [(0,)]
    assert list(work.iterdir()) == []


def test_a_shard_is_a_safetensors_file_of_the_size_asked(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for nbytes in (4 * SAMPLE, 4 * SAMPLE + 3, 100_001):
        path = tmp_path / f"s{nbytes}.safetensors"
        shard = _write_shard(path, nbytes, rng)
        data = path.read_bytes()
        assert shard.size == len(data) == nbytes
        assert (shard.head, shard.tail) == (data[:SAMPLE], data[-SAMPLE:])
        weight = load_file(str(path))["weight"]
        assert weight.dtype == np.uint8 and weight.tobytes() == data[-weight.size :]
        assert shard.head != shard.tail  # random bytes: a shifted copy would not match


def test_without_postgresql_it_asks_for_a_catalog_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no setpriv: no throwaway server
    with pytest.raises(FleetBenchUnavailable, match="pass --catalog-url"):
        run(128 << 10, 2, 2, 1, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--catalog-url", "sqlite:///tmp/x.db"], "must be postgresql+psycopg"),
        (["--catalog-url", "mysql://db/x"], "unsupported catalog URL"),
        (["--hosts", "0"], "--hosts"),
        (["--runs", "0"], "--runs"),
        (["--size", "8KiB"], "at least"),
        (["--poll-interval", "0"], "--poll-interval"),
    ],
)
def test_bad_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = runner.invoke(cli, ["bench", "fleet", *args])
    assert result.exit_code == 2 and message in _said(result.output)


# -- the network mode (tierd bench fleet --network) ----------------------------------------------
NET_ROWS = [
    "ceiling_s",
    *(f"{k}_{n}_{u}" for n in (1, 2) for k, u in
      (("warm", "s"), ("warm", "ceiling_x"), ("origin", "x"), ("host", "gbps"))),
    "fault_warm_s",
    "fault_origin_x",
]  # fmt: skip


def _leftovers() -> list[str]:
    """This process's namespaces and links (the bench's names carry its pid)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [w for w in out.split() if w.startswith(f"tfb{os.getpid()}")]


def test_the_access_log_counts_the_bytes_a_client_received(tmp_path: Path) -> None:
    """``bytes_sent`` against a transfer counted on the wire: raw HTTP/1.0 requests, whose
    responses end when nginx closes, so every byte nginx sent is read here."""
    try:
        cm = serve("open", None, tmp_path, buffered_log=False)
        server = cm.__enter__()
    except OriginUnavailable as exc:
        pytest.skip(str(exc))
    try:
        obj = server.served / server.bucket / "pre" / "obj.bin"
        obj.parent.mkdir()
        obj.write_bytes(os.urandom(300_001))
        (server.served / server.bucket / "other.bin").write_bytes(b"x" * 5000)
        host, _, port = server.endpoint.removeprefix("http://").partition(":")
        received = 0
        for path, extra in [
            ("/tierd-bench/pre/obj.bin", ""),
            ("/tierd-bench/pre/obj.bin", "Range: bytes=1000-70999\r\n"),
            ("/tierd-bench/pre/missing.bin", ""),  # a 404's bytes are sent too
            ("/tierd-bench/other.bin", ""),  # not under the prefix: not counted
        ]:
            with socket.create_connection((host, int(port))) as s:
                s.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n{extra}\r\n".encode())
                got = b""
                while chunk := s.recv(1 << 16):
                    got += chunk
            if "pre/" in path:
                received += len(got)
        assert received > 300_001 + 70_000
        assert bytes_sent(server.access_log, server.bucket, "pre") == received
        assert bytes_sent(server.access_log, server.bucket) > received
        assert bytes_sent(server.access_log, server.bucket, "nothing") == 0
    finally:
        cm.__exit__(None, None, None)


def _network_doc(report: Any, counts: tuple[int, ...]) -> dict[str, Any]:
    doc = report.as_dict()
    assert_shared_shape(doc, "fleet-network")
    assert list(doc["rows"]) == [r for r in NET_ROWS if doc["setup"]["netns"] or "ceil" not in r]
    size = doc["setup"]["size_bytes"]
    for n in counts:
        # The bucket sends the model about once however many hosts warm (the others take its
        # pieces from peers), plus headers; the bound on loopback is 1.3x.
        assert 1 <= doc["rows"][f"origin_{n}_x"]["value"] < 1.3
        assert doc["setup"]["origin_bytes"][str(n)][0] >= size
        assert doc["rows"][f"warm_{n}_s"]["value"] > 0
    assert doc["rows"]["warm_2_s"]["vs"] == "warm_1_s"
    # The fault run: the same distribution to 2 hosts, the second killed once the job is a
    # fifth done (or nobody, if it ended first): the origin sent the model once, and at most
    # once more for pieces the killed host had not passed on.
    fault = doc["setup"]["fault"]
    assert fault["hosts"] == 2 and fault["killed"] in ("bench-host-1", None), fault
    assert doc["rows"]["fault_warm_s"]["vs"] == "warm_2_s"
    assert 1 <= doc["rows"]["fault_origin_x"]["value"] < 2.2
    survivors = 1 if fault["killed"] else 2
    # The warm-up's one shard on both hosts, then both shards on 1 host and on 2, then on the
    # fault run's survivors.
    assert doc["setup"]["checked"]["copies"] == 2 + (1 + 2) * 2 + 2 * survivors
    return doc


def test_network_mode_on_loopback(
    tmp_path: Path, pg_url: str, request: pytest.FixtureRequest
) -> None:
    if why_no_netns() is None and not request.config.getoption("--runslow"):
        # Suite time: the namespace test below runs the same distribution, on shaped links.
        pytest.skip("network namespaces are here: the namespace test covers it (--runslow)")
    report = fleetnet.run(
        128 << 10, 2, (1, 2), 1, netns=False, poll_interval=0.2, catalog_url=pg_url,
        directory=tmp_path,
    )  # fmt: skip
    doc = _network_doc(report, (1, 2))
    assert doc["setup"]["netns"] is False and "loopback" in doc["setup"]["network"]
    assert list(tmp_path.iterdir()) == []


# Suite time (~8 s of a worker, hosts, nginx and PostgreSQL at once): network mode runs on
# loopback above, and the namespaces, their pacing and their sweep are tested below.
@pytest.mark.slow
def test_network_mode_in_namespaces(
    tmp_path: Path, pg_server: PgServer, pg_url: str, host_network: None
) -> None:
    reason = why_no_netns()
    if reason is not None:
        pytest.skip(reason)
    if not Path("/usr/sbin/nginx").exists():  # the origin of --network is nginx, nothing else
        pytest.skip("needs nginx (/usr/sbin/nginx; apt-get install nginx)")
    # The hosts are in other network namespaces: they reach PostgreSQL on its Unix socket.
    dbname = make_url(pg_url).database
    assert dbname is not None
    said: list[str] = []
    report = fleetnet.run(
        128 << 10, 2, (1, 2), 1, origin_bps=10**9, host_bps=2 * 10**9, poll_interval=0.2,
        catalog_url=pg_server.socket_url(dbname), directory=tmp_path, say=said.append,
    )  # fmt: skip
    doc = _network_doc(report, (1, 2))
    assert doc["setup"]["netns"] is True and doc["setup"]["origin_bps"] == 10**9
    assert "tc tbf" in doc["setup"]["network"] and "bridge" in doc["setup"]["network"]
    assert doc["rows"]["ceiling_s"]["value"] == pytest.approx((128 << 10) * 8 / 1e9)
    assert _leftovers() == [] and list(tmp_path.iterdir()) == []


def test_the_namespaces_are_removed_when_the_run_fails(host_network: None) -> None:
    reason = why_no_netns()
    if reason is not None:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="mid-run"), network(2, 10**8, 10**9) as net:
        assert len(net.hosts) == 2 and len(_leftovers()) >= 4  # 3 namespaces and a bridge
        raise RuntimeError("mid-run")
    assert _leftovers() == []


def test_the_origin_can_pace_each_connection(host_network: None) -> None:
    """``per_flow_bps``: the origin's link gets an HTB class per bucket at that rate and a u32
    hash of the client's port into them (no cap of the link's own), and connections open at
    once each get a class of their own: connections that shared one would share its rate. The
    rate itself is the bench's to measure, not this test's."""
    reason = why_no_netns()
    if reason is not None:
        pytest.skip(reason)
    conns, reply = 128, 64 << 10  # tierd's connection count: ports spread over 1,000 or more
    with contextlib.ExitStack() as stack:
        try:
            net = stack.enter_context(network(0, 0, 10**10, per_flow_bps=8 * 10**8))
        except RuntimeError as exc:  # HTB or u32 not in this kernel
            pytest.skip(f"this kernel cannot pace per connection: {exc}")
        show = [*net.origin.wrap, "tc"]
        classes = subprocess.run([*show, "class", "show", "dev", "eth0"], capture_output=True,
                                 text=True, check=True).stdout  # fmt: skip
        paced = [line for line in classes.splitlines() if "rate 800Mbit" in line]
        assert len(paced) == 256 * 16
        filters = subprocess.run([*show, "filter", "show", "dev", "eth0"], capture_output=True,
                                 text=True, check=True).stdout  # fmt: skip
        assert "link 2:" in filters and filters.count("flowid 1:") >= 256 * 16
        assert "each origin connection at 800 Mbit/s" in net.description
        # A server in the origin's namespace sends each connection ``reply`` bytes.
        server = subprocess.Popen(
            [*net.origin.wrap, sys.executable, "-c", _SENDER, net.origin.address, str(reply)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        stack.callback(server.kill)
        assert server.stdout is not None
        port = int(server.stdout.readline())
        socks = [socket.create_connection((net.origin.address, port)) for _ in range(conns)]
        for s in socks:
            stack.callback(s.close)
            got = 0
            while got < reply:
                got += len(s.recv(1 << 20))
        stats = subprocess.run([*show, "-s", "class", "show", "dev", "eth0"],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        sent = re.findall(r"class htb 1:(\w+) .*?\n\s*Sent (\d+) bytes", stats)
        used = {cls for cls, n in sent if cls != "1" and int(n) >= reply}
        assert len(used) == conns
    assert _leftovers() == []


#: Listens on the address it is given, prints its port, and sends each connection n bytes.
_SENDER = """
import socket, sys, threading
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
data = bytes(int(sys.argv[2]))
while True:
    c, _ = srv.accept()
    threading.Thread(target=c.sendall, args=(data,), daemon=True).start()
"""


def test_leftovers_of_a_dead_run_are_swept(host_network: None) -> None:
    reason = why_no_netns()
    if reason is not None:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no process now
    name = f"tfb{dead.pid}o"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in sweep_leftovers()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert name not in subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout


def test_without_ip_or_tc_it_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    reason = why_no_netns()
    assert reason is not None and ("root" in reason or "not installed" in reason)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--counts", "0,4"], "--counts"),
        (["--counts", "x"], "--counts"),
        (["--origin-rate", "fast"], "--origin-rate"),
        (["--host-rate", "10bit"], "too slow"),
        (["--origin", "moto"], "access log"),
    ],
)
def test_bad_network_arguments_are_usage_errors(args: list[str], message: str) -> None:
    result = runner.invoke(cli, ["bench", "fleet", "--network", *args])
    assert result.exit_code == 2 and message in _said(result.output)


def test_rates_are_bits_per_second() -> None:
    assert fleetnet.parse_bits("400Mbit") == 400_000_000
    assert fleetnet.parse_bits("2Gbit") == fleetnet.parse_bits("2g") == 2_000_000_000
    assert fleetnet.parse_bits("1.5Mbps") == 1_500_000
