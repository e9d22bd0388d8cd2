"""The S3 origins ``tierd bench object-store`` measures against, each started on loopback by the
bench and stopped after it (or, for ``URL``, an endpoint somebody else runs).

- ``moto``: moto's S3 server (``ThreadedMotoServer``), the whole protocol (PUT, multipart,
  list): promotion, demotion, adoption and loads. A Python server in this process: its
  absolute rates are moto's limit, and it shares this process's GIL with every client.
- ``s3like`` / ``open``: Debian's nginx serving a directory path-style (``/bucket/key``) with
  GET, HEAD and Range; for ``s3like`` each connection is held to the rate (S3 gives about 100
  MB/s per connection and scales with parallel connections), for ``open`` none. Where this
  process may make network namespaces (root, iproute2), ``s3like``'s nginx runs in one and the
  kernel paces each connection (:func:`._netns.network`'s ``per_flow_bps``: 1, 4 and 8 MiB
  GETs on a keep-alive connection measured at 96-101 MB/s against 100); elsewhere nginx's
  ``limit_rate`` does, per request, letting a request's first second of bytes go sooner (an 8
  MiB GET measured at 1.3x a 10 MB/s cap). The bench "puts"
  an object by writing a file into the served directory; a static ListObjectsV2 reply per
  prefix (1,000 keys a page, as S3 pages) lets tierd adopt them, and WebDAV PUT/DELETE let
  tierd's start-up probe and a promotion's source removal pass. No multipart: no demotion.
- ``URL`` (``http(s)://host[:port]/bucket``): an existing endpoint, credentials from the
  standard AWS chain. Everything the bench writes there is under its own run prefix and is
  deleted afterwards.

nginx itself (its configuration, static listings, start and stop) is :mod:`._nginx`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._netns import network, why_no_netns
from ._nginx import OriginUnavailable, publish_listing, require, serve

__all__ = ["ORIGINS", "Origin", "OriginUnavailable", "local_credentials", "open_origin"]

ORIGINS = ("moto", "s3like", "open")
#: The link of a paced origin's namespace: far above any rate the pacer allows, so only the
#: pacer shapes it.
_LINK_BPS = 400_000_000_000
REGION = "us-east-1"
# Credentials of the loopback origins: moto accepts any, nginx ignores signatures.
_KEY, _SECRET = "AKIATIERDBENCH000001", "tierd-bench-secret-not-a-secret-000000000"
_AWS_VARS_TO_HIDE = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


@dataclass
class Origin:
    """A started origin: where it answers, and how the bench puts objects into it."""

    kind: str  # "moto", "s3like", "open" or "url"
    endpoint: str
    bucket: str
    #: Takes S3 writes (multipart uploads): demotion can be measured.
    writable: bool
    #: Per-connection cap in bytes/s (s3like), else None.
    rate: int | None = None
    #: nginx: the directory served as ``/``, and its access log.
    served: Path | None = None
    access_log: Path | None = None
    description: str = ""
    _clients: dict[tuple[int, str], Any] = field(default_factory=dict, repr=False)

    @property
    def nginx(self) -> bool:
        return self.served is not None

    def client(self, *, pool: int = 10, **config: Any) -> Any:
        """A boto3 S3 client for this origin (path-style; unsigned for nginx), closed with it.

        Clients are made once per pool size and settings (making one takes a good part of a
        second) and are thread-safe, so callers share them.
        """
        cache_key = (pool, repr(sorted(config.items())))
        if cache_key in self._clients:
            return self._clients[cache_key]
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        extra: dict[str, Any] = {"signature_version": UNSIGNED} if self.nginx else {}
        cfg = Config(
            s3={"addressing_style": "path"},
            max_pool_connections=pool,
            retries={"mode": "standard", "max_attempts": 3},
            **extra,
            **config,
        )
        client = boto3.session.Session(region_name=REGION).client(
            "s3", endpoint_url=self.endpoint, config=cfg
        )
        self._clients[cache_key] = client
        return client

    def url_of(self, key: str) -> str:
        """The object's plain HTTP URL, path-style."""
        return f"{self.endpoint}/{self.bucket}/{urllib.parse.quote(key)}"

    # -- putting objects (untimed set-up) -----------------------------------------------------
    def put_file(self, key: str, path: Path) -> None:
        """Make ``key`` hold ``path``'s bytes. On nginx a hard link (or copy) into the served
        directory: the same inode always gives the same ETag, so a key put back after a
        promotion removed it is the object the listing names."""
        if self.served is not None:
            dest = self.served / self.bucket / key
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.exists():
                try:
                    os.link(path, dest)
                except OSError:
                    shutil.copy2(path, dest)
            self._publish_listing(key.partition("/")[0])
            return
        from boto3.s3.transfer import TransferConfig

        client = self.client(pool=16)
        client.upload_file(
            str(path),
            self.bucket,
            key,
            Config=TransferConfig(multipart_chunksize=16 << 20, max_concurrency=16),
        )

    def put_many(self, objects: Mapping[str, bytes], threads: int = 32) -> None:
        """Put many small objects at once (a thread pool, joined before returning)."""
        if self.served is not None:
            prefixes = set()
            for key, body in objects.items():
                dest = self.served / self.bucket / key
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(body)
                prefixes.add(key.partition("/")[0])
            for prefix in prefixes:
                self._publish_listing(prefix)
            return
        client = self.client(pool=threads)
        with ThreadPoolExecutor(threads, thread_name_prefix="tierd-bench-put") as pool:
            for f in [
                pool.submit(client.put_object, Bucket=self.bucket, Key=k, Body=v)
                for k, v in objects.items()
            ]:
                f.result()

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under ``prefix/`` (and what it left behind on nginx)."""
        if self.served is not None:
            shutil.rmtree(self.served / self.bucket / prefix, ignore_errors=True)
            self._publish_listing(prefix)
            return
        client = self.client(pool=4)
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{prefix}/"
        )
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
        for up in client.list_multipart_uploads(Bucket=self.bucket, Prefix=f"{prefix}/").get(
            "Uploads", []
        ):
            with contextlib.suppress(Exception):
                client.abort_multipart_upload(
                    Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                )

    def _publish_listing(self, prefix: str) -> None:
        assert self.served is not None
        publish_listing(self.served, self.bucket, prefix)

    def close(self) -> None:
        for c in self._clients.values():
            with contextlib.suppress(Exception):
                c.close()
        self._clients.clear()


@contextlib.contextmanager
def _nginx(
    kind: str,
    rate: int | None,
    parent: Path | None,
    place: tuple[str, Sequence[str]] | None,
    exact_log: bool,
) -> Iterator[Origin]:
    cap = rate if kind == "s3like" else None
    listen, wrap = place or ("127.0.0.1", ())
    buffered = not exact_log
    with serve(kind, cap, parent, listen=listen, wrap=wrap, buffered_log=buffered) as server:
        per = f"{(cap or 0) / 1e6:g} MB/s per connection" if cap else "no cap"
        origin = Origin(
            kind,
            server.endpoint,
            server.bucket,
            writable=False,
            rate=cap,
            served=server.served,
            access_log=server.access_log,
            description=f"nginx {server.version} on {listen}, {per}",
        )
        try:
            yield origin
        finally:
            origin.close()


@contextlib.contextmanager
def _moto() -> Iterator[Origin]:
    try:
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise OriginUnavailable(f"origin 'moto' needs moto[server]: {exc}") from exc
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        from importlib import metadata

        origin = Origin(
            "moto",
            f"http://{host}:{port}",
            f"tierd-bench-{secrets.token_hex(6)}",
            writable=True,
            description=f"moto {metadata.version('moto')} ThreadedMotoServer in this process",
        )
        client = origin.client()
        client.create_bucket(Bucket=origin.bucket)
        try:
            yield origin
        finally:
            # moto keeps objects in this process's memory: give them back.
            with contextlib.suppress(Exception):
                for prefix in _prefixes(client, origin.bucket):
                    origin.delete_prefix(prefix)
                client.delete_bucket(Bucket=origin.bucket)
            origin.close()
    finally:
        server.stop()
        inner = getattr(server, "_server", None)
        if inner is not None:
            inner.server_close()


def _prefixes(client: Any, bucket: str) -> list[str]:
    found = client.list_objects_v2(Bucket=bucket, Delimiter="/").get("CommonPrefixes", [])
    return [p["Prefix"].rstrip("/") for p in found]


@contextlib.contextmanager
def _url(url: str) -> Iterator[Origin]:
    parts = urllib.parse.urlsplit(url)
    bucket = parts.path.strip("/").partition("/")[0]
    if parts.scheme not in ("http", "https") or not parts.hostname or not bucket:
        raise OriginUnavailable(
            f"--origin {url!r}: use moto, s3like, open or http(s)://host[:port]/bucket"
        )
    if parts.username or parts.password:
        raise OriginUnavailable("--origin: credentials come from the AWS chain, not the URL")
    origin = Origin(
        "url",
        f"{parts.scheme}://{parts.netloc}",
        bucket,
        writable=True,
        description=f"{parts.scheme}://{parts.netloc}/{bucket}, AWS credential chain",
    )
    try:
        yield origin
    finally:
        origin.close()


@contextlib.contextmanager
def local_credentials() -> Iterator[dict[str, str]]:
    """Test credentials in the environment while a loopback origin runs (moto wants a signed
    request; tierd's tier resolves the AWS chain), and none of the user's; restored after."""
    saved = {k: os.environ.get(k) for k in _AWS_VARS_TO_HIDE}
    env = {
        "AWS_ACCESS_KEY_ID": _KEY,
        "AWS_SECRET_ACCESS_KEY": _SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_CONFIG_FILE": os.devnull,
    }
    saved |= {k: os.environ.get(k) for k in env}
    for k in _AWS_VARS_TO_HIDE:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def open_origin(
    spec: str,
    *,
    rate: int | None = 100_000_000,
    parent: Path | None = None,
    say: Callable[[str], None] = lambda s: None,
    place: tuple[str, Sequence[str]] | None = None,
    exact_log: bool = False,
) -> Iterator[Origin]:
    """Start the origin ``spec`` names (``moto``, ``s3like``, ``open`` or a URL) and stop it
    after. Loopback origins run with :func:`local_credentials` in the environment.

    ``place`` (nginx only): the address nginx listens on and the command prefix that starts it
    there (a network namespace's ``ip netns exec NS``) instead of loopback; ``exact_log``:
    its access log unbuffered, complete as soon as a client has its bytes (where the log is
    the measure), instead of written in batches (where its writes must not cost the origin)."""
    if place is not None and spec not in ("s3like", "open"):
        raise OriginUnavailable(f"origin {spec!r} runs on loopback only; use s3like or open")
    if spec == "moto":
        with local_credentials(), _moto() as origin:
            say(f"origin: {origin.description} at {origin.endpoint}")
            yield origin
    elif spec in ("s3like", "open"):
        require(spec)  # before a paced origin's namespaces are made for an nginx that is absent
        with contextlib.ExitStack() as stack:
            stack.enter_context(local_credentials())
            # S3 holds each connection to its rate; nginx's limit_rate holds each request,
            # and lets a request's first second of bytes go sooner (GETs of a few MiB run
            # above the rate). Where namespaces can be made, the kernel paces instead.
            paced = spec == "s3like" and rate is not None and place is None
            paced = paced and why_no_netns() is None
            if paced:
                assert rate is not None
                try:
                    net = stack.enter_context(network(0, 0, _LINK_BPS, say, per_flow_bps=8 * rate))
                    place = (net.origin.address, net.origin.wrap)
                except RuntimeError as exc:  # a kernel without HTB or u32: nginx's cap
                    say(f"origin: not paced by the kernel ({exc}); nginx's limit_rate instead")
                    paced = False
            origin = stack.enter_context(
                _nginx(spec, None if paced else rate, parent, place, exact_log)
            )
            if paced:
                origin.rate = rate
                origin.description = origin.description.replace(
                    "no cap", f"{(rate or 0) / 1e6:g} MB/s per connection, paced by tc"
                )
            say(f"origin: {origin.description} at {origin.endpoint}")
            yield origin
    else:
        with _url(spec) as origin:
            say(f"origin: {origin.description}")
            yield origin
