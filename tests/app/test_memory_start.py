"""A memory tier the host cannot honour is a clear error at ``tierd serve`` start, naming the
numbers and the fix, never a traceback (RELIABILITY.md row 21): over RLIMIT_MEMLOCK (the server
runs as ``nobody``, or as root without CAP_IPC_LOCK, under the usual 8 MiB limit) and over the
host's RAM;
and a memory tier configured anywhere but first is a configuration error."""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

MiB = 1 << 20


@pytest.fixture
def open_dir() -> Iterator[Path]:
    # Not under pytest's tmp_path: its parents are root's alone, and the server runs as nobody.
    d = Path(tempfile.mkdtemp(prefix="tierd-memlock-", dir="/tmp"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _config(d: Path, quota: int, *, first: bool = True) -> Path:
    ram = f'[[tiers]]\nname = "ram"\nkind = "memory"\nquota_bytes = {quota}\n'
    disk = f'[[tiers]]\nname = "nvme"\npath = "{d / "nvme"}"\n'
    f = d / "tierd.toml"
    f.write_text(
        f'port = 0\ncatalog_url = "sqlite:///{d / "catalog.db"}"\n'
        + (ram + disk if first else disk + ram)
    )
    f.chmod(0o644)
    return f


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)  # leaves CAP_IPC_LOCK behind with root


def _without_ipc_lock() -> None:
    # Out of the bounding set before exec: the new program runs as root without CAP_IPC_LOCK.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 14, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_IPC_LOCK
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


_CODE = "import sys\nfrom app import main\nsys.argv[0] = 'tierd'\nsys.exit(main())"


def _limited() -> Callable[[], None]:
    """How the server loses the right to lock memory freely: as ``nobody`` where that user can
    run this interpreter, else as root without CAP_IPC_LOCK (e.g. a venv under a 0700 /root)."""
    try:
        ok = (
            subprocess.run(
                [sys.executable, "-c", "import app"], preexec_fn=_as_nobody, timeout=60, check=False
            ).returncode
            == 0
        )
    except OSError:
        ok = False
    drop = _as_nobody if ok else _without_ipc_lock

    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (8 * MiB, 8 * MiB))
        drop()

    return preexec


def _serve(config: Path, *, limited: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _CODE, "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited() if limited else None,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        cwd=config.parent,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="drops its right to lock memory: needs root")
def test_a_memory_tier_over_the_memlock_limit_is_refused_at_start(open_dir: Path) -> None:
    r = _serve(_config(open_dir, 64 * MiB), limited=True)
    out = " ".join((r.stdout + r.stderr).split())  # rich wraps its lines
    assert r.returncode == 1, out
    assert "cannot start" in out and "RLIMIT_MEMLOCK" in out, out
    assert str(64 * MiB) in out and str(8 * MiB) in out  # the numbers
    assert "LimitMEMLOCK=infinity" in out and "memlock -1" in out  # and the fix
    assert "Traceback" not in out
    assert not (open_dir / "catalog.db").exists()  # refused before anything was created


def test_a_memory_tier_over_the_hosts_ram_is_refused_at_start(open_dir: Path) -> None:
    r = _serve(_config(open_dir, 1 << 60), limited=False)
    out = " ".join((r.stdout + r.stderr).split())  # rich wraps its lines
    assert r.returncode == 1 and "over this host's memory" in out and "Traceback" not in out


def test_a_memory_tier_must_be_listed_first(open_dir: Path) -> None:
    r = _serve(_config(open_dir, 64 * MiB, first=False), limited=False)
    out = " ".join((r.stdout + r.stderr).split())  # rich wraps its lines
    assert r.returncode == 2 and "must be listed first" in out and "Traceback" not in out
