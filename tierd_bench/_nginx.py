"""Debian's nginx as an S3-like origin: a generated configuration in a temp directory, started
as a non-daemon subprocess on a free loopback port and stopped after.

It serves a directory path-style (``/bucket/key``) with GET, HEAD and Range (nginx's static
files), ``limit_rate`` per connection when a rate is given. S3's other requests are answered
just enough for tierd's object tier: static ListObjectsV2 pages per prefix (1,000 keys a page,
as S3 pages), an empty ``?uploads`` list, and WebDAV PUT/DELETE (for tierd's start-up probe and
a promotion's source removal). There are no multipart uploads: no demotion.

nginx sends a strong ETag ``"<mtime hex>-<size hex>"`` and honours ``If-Match`` (with
``Range``) on static files, which is all tierd's pinned reads need. Its WebDAV DELETE ignores
``If-Match``: a conditional delete is unconditional here.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from tiering.tiers.paths import COMPRESSED_DIR

__all__ = [
    "NGINX",
    "NginxServer",
    "OriginUnavailable",
    "bytes_sent",
    "nginx_etag",
    "publish_listing",
    "require",
    "serve",
]

# TIERD_NGINX: another nginx binary (e.g. one unpacked with dpkg -x on a machine without apt).
NGINX = Path(os.environ.get("TIERD_NGINX", "/usr/sbin/nginx"))
BUCKET = "tierd-bench"
_PAGE = 1000  # keys per ListObjectsV2 page, as S3 gives


class OriginUnavailable(RuntimeError):
    """The origin asked for cannot run here (nginx not installed, moto missing, a bad URL)."""


@dataclass(frozen=True)
class NginxServer:
    endpoint: str
    bucket: str
    served: Path  # the directory served as ``/``: objects are ``served/bucket/key``
    access_log: Path
    version: str


def publish_listing(served: Path, bucket: str, prefix: str) -> None:
    """Write the static ListObjectsV2 pages of ``prefix/`` (one path segment) from the files
    under ``served/bucket/prefix`` (see :func:`_conf`)."""
    lists = served.parent / ".tierd-list"
    for old in lists.glob(f"list.{prefix}.*.xml"):
        old.unlink()
    # The prefix's own pages, and those of its ``.tierd-compressed/`` directory (where an
    # object tier keeps what it stored compressed, listed by a second request).
    for name, sub in ((prefix, prefix), (f"{prefix}.z", f"{prefix}/{COMPRESSED_DIR}")):
        base = served / bucket / sub
        entries = []
        if base.is_dir():
            for path in sorted(base.rglob("*")):
                if path.is_file() and not path.name.startswith("."):
                    entries.append((f"{sub}/{path.relative_to(base).as_posix()}", path.stat()))
        entries.sort()
        pages = [entries[i : i + _PAGE] for i in range(0, len(entries), _PAGE)] or [[]]
        for n, page in enumerate(pages):
            more = n + 1 < len(pages)
            (lists / f"list.{name}.{n}.xml").write_text(
                _list_xml(bucket, f"{sub}/", page, f"p{n + 1}" if more else None)
            )


_LINE = re.compile(r'^\S+ \S+ "\S+ (\S+) [^"]*" \d{3} \d+ "[^"]*" \S+ (\d+)$')


def bytes_sent(access_log: Path, bucket: str, prefix: str = "") -> int:
    """Bytes nginx sent (``$bytes_sent``: headers and body) for requests of objects under
    ``prefix/`` in ``bucket`` (every object of it when ``prefix`` is empty), from its log."""
    want = f"/{bucket}/{prefix}/" if prefix else f"/{bucket}/"
    total = 0
    with contextlib.suppress(FileNotFoundError), access_log.open() as f:
        for line in f:
            m = _LINE.match(line.rstrip("\n"))
            if m is not None and m.group(1).startswith(want):
                total += int(m.group(2))
    return total


def nginx_etag(st: os.stat_result) -> str:
    """The ETag nginx sends for a static file: ``"<mtime hex>-<size hex>"``."""
    return f'"{int(st.st_mtime):x}-{st.st_size:x}"'


def _list_xml(bucket: str, prefix: str, page: list[tuple[str, Any]], token: str | None) -> str:
    items = []
    for key, st in page:
        when = dt.datetime.fromtimestamp(int(st.st_mtime), dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
        items.append(
            f"<Contents><Key>{escape(key)}</Key><LastModified>{when}.000Z</LastModified>"
            f"<ETag>{escape(nginx_etag(st))}</ETag><Size>{st.st_size}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
        )
    more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>{token}</NextContinuationToken>"
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
        f"<KeyCount>{len(page)}</KeyCount><MaxKeys>{_PAGE}</MaxKeys>"
        + (more if token else "<IsTruncated>false</IsTruncated>")
        + "".join(items)
        + "</ListBucketResult>\n"
    )


_EMPTY_UPLOADS = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    '<ListMultipartUploadsResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    "<Bucket>{bucket}</Bucket><IsTruncated>false</IsTruncated></ListMultipartUploadsResult>\n"
)


def _conf(
    tmp: Path, listen: str, port: int, bucket: str, rate: int | None, buffered_log: bool
) -> str:
    """nginx's whole configuration: everything it writes stays in ``tmp``.

    ``GET /bucket?...`` (a listing) is answered from ``tmp/.tierd-list``: the prefix (one path
    segment and a slash) and the page (``continuation-token=pN``) pick the file; a prefix with
    no file (or of another shape) gets an empty page, ``?uploads`` an empty list of multipart
    uploads.
    """
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers read root's temp dirs
    temps = "\n".join(
        f"    {kind}_temp_path {tmp / kind};" for kind in ("client_body", "proxy", "fastcgi")
    )
    return f"""# generated by tierd bench object-store
{user}daemon off;
master_process on;
worker_processes auto;
pid {tmp / "nginx.pid"};
error_log {tmp / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
{temps}
    uwsgi_temp_path {tmp / "uwsgi"};
    scgi_temp_path {tmp / "scgi"};
    log_format tierd '$connection $connection_requests "$request" $status $body_bytes_sent '
                     '"$http_range" $request_time $bytes_sent';
    access_log {tmp / "access.log"} tierd{" buffer=256k flush=1s" if buffered_log else ""};
    default_type application/octet-stream;
    sendfile on;
    tcp_nopush on;
    tcp_nodelay on;
    keepalive_timeout 75s;
    keepalive_requests 1000000;
    server_tokens off;
    map $arg_prefix $tierd_list {{
        default "none";
        "~*^(?<tierd_lp>[A-Za-z0-9._-]+)%2F$" $tierd_lp;
        "~*^(?<tierd_lz>[A-Za-z0-9._-]+)%2F\\.tierd-compressed%2F$" "$tierd_lz.z";
    }}
    map $args $tierd_page {{
        default "0";
        "~(^|&)continuation-token=p(?<tierd_pg>[0-9]+)(&|$)" $tierd_pg;
    }}
    server {{
        listen {listen}:{port};
        root {tmp / "served"};
        limit_rate {rate or 0};
        client_max_body_size 0;
        location = /{bucket} {{
            if ($args ~ "(^|&)uploads(=|&|$)") {{ rewrite ^ /.tierd-list/uploads.xml? last; }}
            rewrite ^ /.tierd-list/list.$tierd_list.$tierd_page.xml? last;
        }}
        location /.tierd-list/ {{
            internal;
            root {tmp};
            default_type application/xml;
            try_files $uri /.tierd-list/list.none.0.xml;
        }}
        location /{bucket}/ {{
            dav_methods PUT DELETE;
            create_full_put_path on;
            dav_access user:rw group:r all:r;
        }}
    }}
}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(address: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((address, port), 0.2):
        return True
    return False


def require(kind: str) -> None:
    """Raise :class:`OriginUnavailable`, naming the package, where nginx is not installed."""
    if not NGINX.exists():
        raise OriginUnavailable(
            f"origin {kind!r} needs Debian's nginx at {NGINX}: apt-get install nginx"
        )


@contextlib.contextmanager
def serve(
    kind: str,
    rate: int | None,
    parent: Path | None,
    *,
    listen: str = "127.0.0.1",
    wrap: Sequence[str] = (),
    buffered_log: bool = True,
) -> Iterator[NginxServer]:
    """nginx on a free port of ``listen`` (run under the command prefix ``wrap``, such as
    ``ip netns exec NS``), ``rate`` bytes/s per connection (None: no cap), in a temp directory
    under ``parent``; stopped and removed on exit. ``buffered_log=False`` writes each access
    line as its request ends, so :func:`bytes_sent` is exact as soon as the client is done."""
    require(kind)
    tmp = Path(tempfile.mkdtemp(prefix="tierd-nginx-", dir=parent))
    proc: subprocess.Popen[bytes] | None = None
    try:
        for sub in ("served", ".tierd-list"):
            (tmp / sub).mkdir()
        (tmp / "served" / BUCKET).mkdir()
        (tmp / ".tierd-list" / "uploads.xml").write_text(_EMPTY_UPLOADS.format(bucket=BUCKET))
        (tmp / ".tierd-list" / "list.none.0.xml").write_text(_list_xml(BUCKET, "", [], None))
        for attempt in range(5):  # a free port can be taken before nginx binds it: retry
            port = _free_port()
            conf = tmp / "nginx.conf"
            conf.write_text(_conf(tmp, listen, port, BUCKET, rate, buffered_log))
            cmd = [*wrap, str(NGINX), "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 10
            while (
                proc.poll() is None and not _answers(listen, port) and time.monotonic() < deadline
            ):
                time.sleep(0.02)
            if proc.poll() is None and _answers(listen, port):
                break
            err = _stop(proc)
            proc = None
            if attempt == 4 or "Address already in use" not in err:
                raise OriginUnavailable(f"nginx did not start: {err.strip()[-500:]}")
        yield NginxServer(
            f"http://{listen}:{port}", BUCKET, tmp / "served", tmp / "access.log", _version()
        )
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes]) -> str:
    """Stop nginx (SIGTERM: a fast shutdown of master and workers); its standard error."""
    if proc.poll() is None:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return (err or b"").decode(errors="replace")


def _version() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([str(NGINX), "-v"], capture_output=True, timeout=10).stderr
        return out.decode().strip().rpartition("/")[2]
    return "?"
