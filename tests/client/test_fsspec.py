"""tierd's fsspec filesystem against a live tierd: registration, listings, ranged and
read-ahead reads (requests counted with httpx's event hooks on the filesystem's own client),
a file replaced while open, uploads, deletes and their token, and bad input.

fsspec's own abstract suite runs in ``test_fsspec_abstract.py``; these are what it does not
cover. One server serves both (``fsspec_server``); each test works in a directory of its own.
"""

from __future__ import annotations

import errno
import importlib.metadata
import os
import pickle
import signal
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

fsspec = pytest.importorskip("fsspec")

from tests.client.conftest import ADMIN, DATA  # noqa: E402
from tests.conftest import LiveServer, disk_snapshot, free_port  # noqa: E402
from tierd_client import NotFound  # noqa: E402
from tierd_client.fsspec import TierdFile, TierdFileSystem  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KiB = 1024


@pytest.fixture
def server(fsspec_server: LiveServer) -> LiveServer:
    return fsspec_server


@pytest.fixture
def admin_fs(server: LiveServer) -> TierdFileSystem:
    return TierdFileSystem(url=server.url, token=ADMIN, skip_instance_cache=True)


@pytest.fixture
def data_fs(server: LiveServer) -> TierdFileSystem:
    """The data token alone (no TIERD_ADMIN_TOKEN in the environment: deletes are refused)."""
    return TierdFileSystem(url=server.url, token=DATA, skip_instance_cache=True)


@pytest.fixture
def base(request: pytest.FixtureRequest, admin_fs: TierdFileSystem) -> Iterator[str]:
    """A directory of this test's own, emptied afterwards."""
    name = f"t/{request.node.name}".replace("[", "-").replace("]", "")
    yield name
    if admin_fs.exists(name):
        admin_fs.rm(name, recursive=True)


class Requests:
    """Every request a filesystem sends, with the status it got (httpx's event hooks)."""

    def __init__(self, fs: TierdFileSystem) -> None:
        self.sent: list[tuple[str, str, httpx.Headers, int]] = []
        fs.remote.http.event_hooks = {"response": [self._seen]}

    def _seen(self, resp: httpx.Response) -> None:
        req = resp.request
        self.sent.append((req.method, req.url.path, req.headers, resp.status_code))

    def content(self) -> list[tuple[httpx.Headers, int]]:
        """The content reads: request headers and status."""
        return [(h, s) for m, p, h, s in self.sent if m == "GET" and p.endswith("/content")]

    def clear(self) -> None:
        self.sent.clear()


def catalog(fs: TierdFileSystem) -> dict[str, tuple[Any, ...]]:
    """What the catalog holds, without the heat a read changes."""
    return {
        n: (e["id"], e["size"], e["checksum"], e["generation"])
        for n, e in fs.find("", detail=True).items()
    }


def payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 7 + seed) % 251 for i in range(n))


# -- registration ---------------------------------------------------------------------------
def test_the_entry_point_registers_the_protocol(
    server: LiveServer, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["fsspec.specs"]
    assert declared == {"tierd": "tierd_client.fsspec:TierdFileSystem"}
    installed = importlib.metadata.entry_points(group="fsspec.specs", name="tierd")
    assert [e.value for e in installed] == [declared["tierd"]], "pip install -e . to refresh"
    assert fsspec.get_filesystem_class("tierd") is TierdFileSystem

    TierdFileSystem(url=server.url, token=DATA).pipe_file(f"{base}/config.json", b'{"a": 1}')
    # As a user would: the server and token from the environment, the protocol from the URL.
    monkeypatch.setenv("TIERD_URL", server.url)
    monkeypatch.setenv("TIERD_DATA_TOKEN", DATA)
    TierdFileSystem.clear_instance_cache()
    try:
        with fsspec.open(f"tierd://{base}/config.json", "rt") as f:
            assert f.read() == '{"a": 1}'
        fs, path = fsspec.core.url_to_fs(f"tierd://{base}/config.json")
        assert isinstance(fs, TierdFileSystem) and path == f"{base}/config.json"
        assert fs.url == server.url
        assert fsspec.filesystem("tierd", url=server.url, token=DATA).cat(path) == b'{"a": 1}'
    finally:
        TierdFileSystem.clear_instance_cache()


def test_the_filesystem_pickles(admin_fs: TierdFileSystem, base: str) -> None:
    # Dask and friends ship filesystems to workers: the copy connects on its own.
    admin_fs.pipe_file(f"{base}/x", b"xyz")
    copy = pickle.loads(pickle.dumps(admin_fs))
    assert copy.remote is not admin_fs.remote
    assert copy.cat_file(f"{base}/x") == b"xyz"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_worker_gets_its_own_connections(admin_fs: TierdFileSystem, base: str) -> None:
    # A DataLoader worker forked with the filesystem in hand must not share the parent's
    # pooled socket (two processes' requests would interleave on it).
    admin_fs.pipe_file(f"{base}/f", b"abc")
    assert admin_fs.cat_file(f"{base}/f") == b"abc"  # the parent now holds a connection
    parents = id(admin_fs.remote.http)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only, never through pytest
        code = 1
        try:
            own = id(admin_fs.remote.http) != parents
            code = 0 if own and admin_fs.cat_file(f"{base}/f") == b"abc" else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked reader hung")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert id(admin_fs.remote.http) == parents and admin_fs.cat_file(f"{base}/f") == b"abc"


# -- listings -------------------------------------------------------------------------------
def test_ls_and_info_imply_directories(admin_fs: TierdFileSystem, base: str) -> None:
    fs = admin_fs
    fs.pipe({f"{base}/m/config.json": b"{}", f"{base}/m/w/a.bin": b"abcd", f"{base}/m2": b"z"})
    listed = fs.ls(f"tierd://{base}/m")
    assert [(e["name"], e["type"], e["size"]) for e in listed] == [
        (f"{base}/m/config.json", "file", 2),
        (f"{base}/m/w", "directory", 0),
    ]
    record = listed[0]
    assert record["tier"] == "nvme" and record["checksum"].startswith("xxh3")
    assert {"id", "heat", "access_count", "generation", "state"} <= set(record)
    # m2 shares m's first letters: a prefix listing must not confuse them.
    assert fs.ls(base, detail=False) == [f"{base}/m", f"{base}/m2"]
    assert fs.ls(f"/{base}/m2/", detail=False) == [f"{base}/m2"]  # a file lists itself
    assert fs.info(f"{base}/m/w")["type"] == "directory"
    assert fs.info("")["type"] == "directory"
    assert fs.isfile(f"{base}/m/w/a.bin") and fs.isdir(f"{base}/m") and not fs.isfile(base)
    assert fs.find(base, maxdepth=2) == [f"{base}/m/config.json", f"{base}/m2"]
    assert fs.du(base) == 7
    for missing in (f"{base}/nope", f"{base}/m/w/a.bin/deeper", f"{base}/m/conf"):
        with pytest.raises(FileNotFoundError):
            fs.ls(missing)
        with pytest.raises(FileNotFoundError):
            fs.info(missing)
        assert not fs.exists(missing)
    # mkdir has nothing to do, and makes nothing: a directory needs a file below it.
    fs.makedirs(f"{base}/empty", exist_ok=True)
    assert not fs.exists(f"{base}/empty")


def test_ukey_and_times_follow_the_bytes(admin_fs: TierdFileSystem, base: str) -> None:
    path = f"{base}/f"
    admin_fs.pipe_file(path, b"one")
    key = admin_fs.ukey(path)
    assert admin_fs.ukey(path) == key
    created = admin_fs.created(path)
    admin_fs.pipe_file(path, b"two")  # same size, other bytes
    assert admin_fs.ukey(path) != key
    assert admin_fs.created(path) == created and admin_fs.modified(path) >= created
    with pytest.raises(IsADirectoryError):
        admin_fs.ukey(base)


# -- reads ------------------------------------------------------------------------------------
RANGES = [
    (None, None),
    (0, 1),
    (10, 20),
    (-10, None),
    (None, -10),
    (-1000, 5),
    (990, 5000),
    (999, None),
    (1000, None),
    (500, 400),
    (5, 5),
]


@pytest.mark.parametrize(("start", "end"), RANGES)
def test_cat_file_reads_a_range_in_one_request(
    admin_fs: TierdFileSystem, base: str, start: int | None, end: int | None
) -> None:
    data = payload(1000)
    admin_fs.pipe_file(f"{base}/f", data)
    seen = Requests(admin_fs)
    assert admin_fs.cat_file(f"{base}/f", start, end) == data[start:end]
    reads = seen.content()
    if not data[start:end]:
        assert reads == []  # an empty range asks the server nothing
        return
    assert len(reads) == 1
    headers, status = reads[0]
    if data[start:end] == data:
        assert "range" not in headers and status == 200
    else:
        lo, hi, _ = slice(start, end).indices(len(data))
        assert headers["range"] == f"bytes={lo}-{hi - 1}" and status == 206


def test_cat_ranges_looks_each_file_up_once(admin_fs: TierdFileSystem, base: str) -> None:
    a, b = payload(300), payload(300, seed=1)
    admin_fs.pipe({f"{base}/a": a, f"{base}/b": b})
    seen = Requests(admin_fs)
    paths = [f"{base}/a", f"{base}/b", f"{base}/a", f"{base}/nope"]
    got = admin_fs.cat_ranges(paths, [0, 10, 100, 0], [10, 20, 110, 1])
    assert got[:3] == [a[:10], b[10:20], a[100:110]]
    assert isinstance(got[3], FileNotFoundError)
    lookups = [p for m, p, _, _ in seen.sent if p.endswith("/lookup")]
    assert len(lookups) == 3 and len(seen.content()) == 3


def test_open_reads_ahead_in_blocks(admin_fs: TierdFileSystem, base: str) -> None:
    block = 64 * KiB
    data = os.urandom(4 * block + 123)
    admin_fs.pipe_file(f"{base}/f", data)
    assert TierdFile.DEFAULT_BLOCK_SIZE == 16 << 20
    seen = Requests(admin_fs)
    got = bytearray()
    with admin_fs.open(f"{base}/f", block_size=block) as f:
        assert f.size == len(data) and f.details["id"] > 0
        while piece := f.read(1000):  # small reads, as a parser makes them
            got += piece
    assert bytes(got) == data
    reads = seen.content()
    # One lookup at open, then a block per request, not one per read() (there were 263).
    assert [p for m, p, _, _ in seen.sent if not p.endswith("/content")] == ["/v1/files/lookup"]
    assert 4 <= len(reads) <= 6
    assert all(status == 206 for _, status in reads)
    etag = reads[0][0].get("if-range")
    assert etag is None  # the first block learns the version...
    assert len({h["if-range"] for h, _ in reads[1:]}) == 1  # ...and every later one pins it


def test_a_file_replaced_while_open_is_never_mixed(admin_fs: TierdFileSystem, base: str) -> None:
    block = 16 * KiB
    old, new = payload(3 * block), payload(3 * block, seed=1)  # same size, other bytes
    path = f"{base}/f"
    admin_fs.pipe_file(path, old)
    with admin_fs.open(path, block_size=block, cache_type="readahead") as f:
        assert f.read(block) == old[:block]
        admin_fs.pipe_file(path, new)  # the same file (same id), new bytes
        with pytest.raises(OSError) as info:
            f.read()
        assert info.value.errno == errno.ESTALE
    assert admin_fs.cat_file(path) == new  # a fresh open sees the new version

    # Another size: refused too (Content-Range no longer names the size opened).
    admin_fs.pipe_file(path, old)
    with admin_fs.open(path, block_size=block) as f:
        f.read(10)
        admin_fs.pipe_file(path, old[: 2 * block])
        with pytest.raises(OSError) as info:
            f.seek(2 * block + 5)
            f.read(10)
        assert info.value.errno == errno.ESTALE

    # Replaced between the open and the first read (no ETag known yet): the size opened is
    # checked against the reply's Content-Range, so a longer file is not cut to the old size.
    admin_fs.pipe_file(path, old)
    with admin_fs.open(path, block_size=block) as f:
        admin_fs.pipe_file(path, old + b"more")
        with pytest.raises(OSError) as info:
            f.read()
        assert info.value.errno == errno.ESTALE


def test_get_file_streams_one_request(admin_fs: TierdFileSystem, base: str, tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 5)
    admin_fs.pipe_file(f"{base}/big.bin", data)
    seen = Requests(admin_fs)
    sizes: list[int] = []
    callback = fsspec.callbacks.Callback(hooks={"s": lambda size, value, **_: sizes.append(value)})
    admin_fs.get_file(f"{base}/big.bin", str(tmp_path / "new" / "big.bin"), callback=callback)
    assert (tmp_path / "new" / "big.bin").read_bytes() == data
    # The whole file in one plain GET (an open file would send Range requests).
    assert [(h.get("range"), s) for h, s in seen.content()] == [(None, 200)]
    assert callback.size == len(data) and sizes[-1] == len(data)


# -- writes -----------------------------------------------------------------------------------
def test_writes_stream_through_uploads(data_fs: TierdFileSystem, base: str, tmp_path: Path) -> None:
    fs = data_fs
    local = tmp_path / "w.bin"
    local.write_bytes(os.urandom((1 << 20) * 2 + 7))
    seen = Requests(fs)
    fs.put_file(str(local), f"{base}/w.bin", tier="hdd")
    assert [(m, s) for m, _, _, s in seen.sent] == [("PUT", 201)]  # one request, streamed
    assert fs.info(f"{base}/w.bin")["tier"] == "hdd"
    assert fs.cat_file(f"{base}/w.bin") == local.read_bytes()

    # A file opened for writing spools beyond its block size and uploads once, on close.
    big = os.urandom(100 * KiB)
    seen.clear()
    with fs.open(f"{base}/o.bin", "wb", block_size=16 * KiB) as f:
        for i in range(0, len(big), 3000):
            f.write(big[i : i + 3000])
        assert not fs.exists(f"{base}/o.bin")
    assert [m for m, p, _, _ in seen.sent if m == "PUT"] == ["PUT"]
    assert fs.cat_file(f"{base}/o.bin") == big

    with pytest.raises(FileExistsError):
        fs.pipe_file(f"{base}/o.bin", b"x", mode="create")
    with pytest.raises(FileExistsError):
        fs.open(f"{base}/o.bin", "xb")
    with pytest.raises(FileExistsError):
        fs.put_file(str(local), f"{base}/o.bin", mode="create")
    assert fs.cat_file(f"{base}/o.bin") == big
    with pytest.raises(NotImplementedError):
        fs.open(f"{base}/o.bin", "ab")


def test_a_transaction_uploads_at_its_end_or_not_at_all(
    data_fs: TierdFileSystem, base: str
) -> None:
    with data_fs.transaction:
        with data_fs.open(f"{base}/t", "wb") as f:
            f.write(b"later")
        assert not data_fs.exists(f"{base}/t")
    assert data_fs.cat_file(f"{base}/t") == b"later"

    with pytest.raises(RuntimeError), data_fs.transaction:
        with data_fs.open(f"{base}/u", "wb") as f:
            f.write(b"never")
        raise RuntimeError("abandon")
    assert not data_fs.exists(f"{base}/u")


# -- deletes --------------------------------------------------------------------------------
def test_rm_needs_the_admin_token(
    server: LiveServer, admin_fs: TierdFileSystem, data_fs: TierdFileSystem, base: str
) -> None:
    files = {f"{base}/d/{n}": n.encode() for n in ("a", "b", "sub/c", "z")}
    data_fs.pipe(files)
    before, on_disk = catalog(admin_fs), disk_snapshot(server.settings.data_dir)
    with pytest.raises(PermissionError):
        data_fs.rm(f"{base}/d", recursive=True)
    with pytest.raises(PermissionError):
        data_fs.rm_file(f"{base}/d/a")
    assert catalog(admin_fs) == before and disk_snapshot(server.settings.data_dir) == on_disk

    # Every path is checked first: one bad path among good ones deletes nothing.
    with pytest.raises(IsADirectoryError):
        admin_fs.rm([f"{base}/d/z", f"{base}/d/sub"])  # a directory needs recursive=True
    with pytest.raises(FileNotFoundError):
        admin_fs.rm([f"{base}/d/z", f"{base}/d/a-nope"])
    assert catalog(admin_fs) == before and disk_snapshot(server.settings.data_dir) == on_disk

    admin_fs.rm(f"{base}/d/a")
    assert admin_fs.ls(f"{base}/d", detail=False) == [f"{base}/d/{n}" for n in ("b", "sub", "z")]
    admin_fs.rm(f"{base}/d", recursive=True)
    assert not admin_fs.exists(f"{base}/d")
    with pytest.raises(FileNotFoundError):
        admin_fs.ls(f"{base}/d")  # gone with its last file


# -- bad input ------------------------------------------------------------------------------
BAD_PATHS = [
    ("a/../b", "not normal"),
    ("a//b", "not normal"),
    ("x.tierd-tmp", "reserved"),
    ("bad\x00name", "control"),
    ("x" * 1025, "longer than"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_PATHS, ids=[r for _, r in BAD_PATHS])
def test_bad_paths_get_clear_errors_and_change_nothing(
    server: LiveServer, admin_fs: TierdFileSystem, base: str, bad: str, reason: str
) -> None:
    admin_fs.pipe_file(f"{base}/keep", b"k")
    before, on_disk = catalog(admin_fs), disk_snapshot(server.settings.data_dir)
    path = f"{base}/{bad}"
    with pytest.raises(OSError) as info:
        admin_fs.pipe_file(path, b"data")
    assert info.value.errno == errno.EINVAL and reason in str(info.value)
    with pytest.raises(OSError) as info, admin_fs.open(path, "wb") as f:
        f.write(b"data")
    assert info.value.errno == errno.EINVAL
    # A path tierd could never hold names no file.
    with pytest.raises(FileNotFoundError, match=reason):
        admin_fs.cat_file(path)
    assert not admin_fs.exists(path)
    assert catalog(admin_fs) == before and disk_snapshot(server.settings.data_dir) == on_disk


def test_files_and_directories_do_not_overlap(
    server: LiveServer, admin_fs: TierdFileSystem, base: str
) -> None:
    admin_fs.pipe({f"{base}/f": b"file", f"{base}/d/e": b"below"})
    before, on_disk = catalog(admin_fs), disk_snapshot(server.settings.data_dir)
    with pytest.raises(NotADirectoryError) as info:
        admin_fs.pipe_file(f"{base}/f/g", b"x")  # a file as a parent
    assert info.value.errno == errno.ENOTDIR and "not a directory" in str(info.value)
    for mode in ("overwrite", "create"):  # a file over a directory (was a 500)
        with pytest.raises(FileExistsError, match="is a directory"):
            admin_fs.pipe_file(f"{base}/d", b"x", mode=mode)
    with pytest.raises(IsADirectoryError):
        admin_fs.open(f"{base}/d")
    assert catalog(admin_fs) == before and disk_snapshot(server.settings.data_dir) == on_disk


def test_other_errors_stay_clear(server: LiveServer, admin_fs: TierdFileSystem, base: str) -> None:
    with pytest.raises(NotFound, match="no tier named 'nope'") as info:
        admin_fs.pipe_file(f"{base}/x", b"x", tier="nope")  # bad input, not a missing file
    assert info.value.code == "tier_not_found" and not admin_fs.exists(f"{base}/x")
    with pytest.raises(FileNotFoundError):
        admin_fs.open(f"{base}/missing")
    wrong = TierdFileSystem(url=server.url, token="wrong", skip_instance_cache=True)
    with pytest.raises(PermissionError):
        wrong.ls(base)
    nowhere = TierdFileSystem(url=f"http://127.0.0.1:{free_port()}", skip_instance_cache=True)
    with pytest.raises(ConnectionError) as conn:
        nowhere.cat_file("a")
    assert isinstance(conn.value.__cause__, httpx.HTTPError)


def test_fsspec_is_optional_for_the_client() -> None:
    # The client imports without fsspec; only tierd_client.fsspec needs it.
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['fsspec'] = None\n"
        "import tierd_client\n"
        "try:\n"
        "    import tierd_client.fsspec\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert "pip install 'tierd[fsspec]'" in done.stdout, done.stderr
