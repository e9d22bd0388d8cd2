"""A throwaway PostgreSQL server: Debian's binaries (``/usr/lib/postgresql/<v>/bin``) run in a
temp directory on a free loopback port, for ``tierd bench catalog`` and for the tests'
fixtures (tests/pg_support.py), which import it from here.

initdb refuses to run as root, so as root the server runs as the ``postgres`` user (``setpriv``,
which also asks the kernel to stop the server if its parent dies: no server outlives the
process that started it). Authentication is ``trust`` on loopback. On start, a database built
by the migrations becomes the template of every :meth:`PgServer.create_database`
(``CREATE DATABASE ... TEMPLATE`` copies files, no SQL), so a new database costs a few
milliseconds, not an Alembic run. :func:`why_no_postgresql` says why a server cannot be run
here (binaries, ``postgres`` user or psycopg missing), so that callers can skip, saying which.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "TEMPLATE",
    "NoScratchDatabase",
    "PgServer",
    "find_bindir",
    "require_postgresql",
    "scratch_database",
    "why_no_postgresql",
]


def require_postgresql(url: str | None, unavailable: type[Exception]) -> None:
    """Refuse a ``--catalog-url`` that is not PostgreSQL (or not a catalog URL at all) with
    ``unavailable``, the calling bench's own error; None (a throwaway server) passes."""
    from tiering.catalog.backends import backend_of

    if url is None:
        return
    try:
        backend = backend_of(url)
    except ValueError as exc:
        raise unavailable(str(exc)) from exc
    if backend != "postgresql":
        raise unavailable("--catalog-url must be postgresql+psycopg://...")


#: The migrated database each new database is copied from.
TEMPLATE = "tierd_template"


def find_bindir() -> Path | None:
    """The newest Debian PostgreSQL server's bin directory, or None."""
    versions = [Path(p).parent.parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    found = sorted((int(v.name), v) for v in versions if v.name.isdigit())
    return found[-1][1] / "bin" if found else None


def why_no_postgresql() -> str | None:
    """Why a PostgreSQL server cannot be run here, or None when it can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]')"
    if find_bindir() is None:
        return "PostgreSQL's server is not installed (apt-get install postgresql)"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root, and there is no 'postgres' user to run initdb as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scratch(durable: bool) -> str | None:
    """Where a server's directory goes: a throwaway one (``durable=False``) in memory where the
    host has /dev/shm, as a measured one stays on the disk. Each database made from a template
    is a few hundred files, and on ext4 their inodes cost the tests more CPU than their SQL."""
    shm = "/dev/shm"
    if durable or not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        return None
    st = os.statvfs(shm)  # a container's is 64 MiB by default: too small for a cluster
    return shm if st.f_bavail * st.f_frsize >= 2 << 30 else None


class PgServer:
    """One PostgreSQL server in a temp directory, listening on 127.0.0.1.

    ``durable=False`` (tests) turns fsync and synchronous commit off: a test database never
    needs to survive a power cut. A measurement wants ``durable=True``.
    """

    def __init__(self, *, durable: bool = False, cluster: Path | None = None) -> None:
        bindir = find_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL's server is not installed (apt-get install postgresql)")
        self.bindir = bindir
        self.durable = durable
        #: A stopped cluster, template included, to start from: a copy, not initdb and the
        #: migrations (tests that need a server of their own pay a second less each).
        self.cluster = cluster
        self.root = Path(tempfile.mkdtemp(prefix="tierd-pg-", dir=_scratch(durable)))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._admin: Any = None

    # -- running the binaries ----------------------------------------------------------------
    def _as_owner(self, *argv: str, pdeathsig: bool = False) -> list[str]:
        cmd = ["setpriv"]
        if os.geteuid() == 0:
            cmd += ["--reuid=postgres", "--regid=postgres", "--init-groups"]
        if pdeathsig:
            # SIGINT is PostgreSQL's fast shutdown: it rolls back and stops at once.
            cmd += ["--pdeathsig", "INT"]
        return [*cmd, "--", *argv]

    def start(self) -> PgServer:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self.root.chmod(0o700)
        data = self.root / "data"
        if self.cluster is not None:
            # cp -a keeps the owner (postgres, when run as root) and the 0700 PostgreSQL asks.
            subprocess.run(["cp", "-a", str(self.cluster), str(data)], check=True)
        else:
            self._initdb(data)
        for _ in range(3):  # another process may take the free port before the server does
            self.port = _free_port()
            if self._launch(data):
                break
        else:
            raise RuntimeError(f"PostgreSQL did not start; its log:\n{self.log_tail()}")
        import psycopg

        self._admin = psycopg.connect(self._conninfo("postgres"), autocommit=True)
        if self.cluster is None:
            self._admin.execute(f"CREATE DATABASE {TEMPLATE}")
            from tiering.catalog.db import upgrade

            upgrade(self.url(TEMPLATE))
        return self

    def save_cluster(self, dest: Path) -> None:
        """Stop the server (a clean, fast shutdown) and copy its cluster to ``dest``, for
        :class:`PgServer` ``(cluster=dest)``; the server stays stopped."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=30)
            self.proc = None
        subprocess.run(["cp", "-a", str(self.root / "data"), str(dest)], check=True)

    def _initdb(self, data: Path) -> None:
        subprocess.run(
            self._as_owner(
                str(self.bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ),
            check=True,
            capture_output=True,
            cwd=self.root,
        )

    def _launch(self, data: Path) -> bool:
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.root),
            "max_connections": "300",
            "shared_buffers": "64MB",
            "logging_collector": "off",
        }
        if not self.durable:
            settings |= {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
        args = [str(self.bindir / "postgres"), "-D", str(data)]
        for k, v in settings.items():
            args += ["-c", f"{k}={v}"]
        log = (self.root / "server.log").open("ab")
        self.proc = subprocess.Popen(
            self._as_owner(*args, pdeathsig=True), stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        import psycopg

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                psycopg.connect(self._conninfo("postgres"), connect_timeout=2).close()
                return True
            except psycopg.OperationalError:
                time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        return False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.root / "server.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    # -- databases ---------------------------------------------------------------------------
    def _conninfo(self, dbname: str) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"

    def url(self, dbname: str) -> str:
        """The SQLAlchemy URL tierd takes for database ``dbname``."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{dbname}"

    def socket_url(self, dbname: str) -> str:
        """:meth:`url` over the server's Unix socket: reached from any network namespace."""
        return f"postgresql+psycopg://postgres@/{dbname}?host={self.root}&port={self.port}"

    def create_database(self, *, migrated: bool = True) -> str:
        """A new database (at the schema's head, or empty); returns its name."""
        name = f"t_{uuid.uuid4().hex[:16]}"
        template = TEMPLATE if migrated else "template0"
        self._admin.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
        return name

    def drop_database(self, name: str) -> None:
        """Drop ``name``, ending any session a test left open on it."""
        self._admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def execute(self, dbname: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement on ``dbname`` from another connection (another writer) and commit;
        the rows it returned."""
        import psycopg

        with psycopg.connect(self._conninfo(dbname), autocommit=True) as conn:
            cur = conn.execute(sql, params)
            return list(cur.fetchall()) if cur.description else []

    def stop(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGQUIT)  # immediate shutdown
                self.proc.wait(timeout=30)
        self.proc = None
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NoScratchDatabase(Exception):
    """No scratch database can be created on the server a URL names (why in the message)."""


@contextlib.contextmanager
def scratch_database(url: str) -> Iterator[str]:
    """A new, empty database on ``url``'s server, dropped afterwards (sessions left on it
    included); yields its URL. A bench writes there and nowhere else, so an existing catalog
    is never touched. The URL's role needs CREATEDB."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.pool import NullPool

    from tiering.catalog.backends import redact

    name = f"tierd_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except DBAPIError as exc:
        admin.dispose()
        raise NoScratchDatabase(
            f"cannot create a scratch database on {redact(url)} (the bench needs CREATEDB; it "
            f"never writes into an existing catalog): {exc.orig}"
        ) from exc
    try:
        yield make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with contextlib.suppress(DBAPIError), admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
