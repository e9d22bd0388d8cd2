"""Conditional requests on a file's content (RFC 9110 section 13): its ``ETag`` is the hex of
its checksum (``xxh3_128``), its ``Last-Modified`` the mtime the catalog recorded.

- A read with ``If-None-Match`` naming the current ETag (or ``*``), or, without it, an
  ``If-Modified-Since`` not older than the file, is a 304 without a body (nothing read, no
  access counted). ``If-Match`` naming another version (or any version of a file whose ETag is
  unknown, or a weak tag: its comparison is strong) is a 412; ``*`` matches any file.
- An upload's ``If-Match`` is the version the file being replaced must be now (a 412 before a
  byte is written otherwise; ``*``: it must exist); ``If-None-Match: *`` asks that it not
  exist (a 412 if it does). Both still hold when the bytes are published: a version another
  upload published meanwhile is a 412 then, and nothing is published. A ``checksum`` sent
  with the bytes is checked before they are published (a 400 ``checksum_mismatch`` and nothing
  written otherwise).
"""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime, parsedate_to_datetime

from starlette.datastructures import Headers

from tiering.checksum import ALGORITHM, hex_digest

__all__ = ["etag", "last_modified", "read_precondition", "upload_precondition"]

QUOTE = '"'


def etag(checksum: str | None) -> str | None:
    return f'"{hex_digest(checksum)}"' if checksum else None


def last_modified(mtime_ns: int) -> str:
    return format_datetime(datetime.fromtimestamp(mtime_ns // 10**9, UTC), usegmt=True)


def _tags(value: str, *, weak: bool) -> list[str]:
    """The entity tags of an ``If-Match``/``If-None-Match`` list, or ``["*"]``. ``weak``: a
    weak tag (``W/"..."``) counts as its opaque tag (``If-None-Match``'s weak comparison);
    else it matches nothing (``If-Match``'s strong comparison, RFC 9110 13.1.1), and is left
    out."""
    out = []
    for part in value.split(","):
        tag = part.strip()
        if tag.startswith("W/"):
            if not weak:
                continue
            tag = tag[2:]
        if tag:
            out.append(tag)
    return out


def read_precondition(headers: Headers, current: str | None, mtime_ns: int) -> int | None:
    """304 or 412 for a read of the version ``current`` (its ETag; None where it is not known)
    modified at ``mtime_ns``, or None to serve it. ``*`` matches the file whatever its ETag:
    it exists."""
    if_match = headers.get("if-match")
    if if_match is not None:
        tags = _tags(if_match, weak=False)
        if "*" not in tags and (current is None or current not in tags):
            return 412
    if_none = headers.get("if-none-match")
    if if_none is not None:
        tags = _tags(if_none, weak=True)
        return 304 if "*" in tags or (current is not None and current in tags) else None
    since = headers.get("if-modified-since")
    if since is not None:
        try:
            when = parsedate_to_datetime(since)
        except (TypeError, ValueError):
            return None  # an unparsable date is ignored (RFC 9110 13.1.3)
        if when.tzinfo is not None and mtime_ns // 10**9 <= when.timestamp():
            return 304
    return None


def upload_precondition(headers: Headers) -> tuple[list[str] | None, bool]:
    """The versions ``If-Match`` lets an upload replace (checksums, or ``["*"]``: any, but the
    file must exist), or None; and whether ``If-None-Match: *`` asks that it not exist."""
    allowed = None
    if_match = headers.get("if-match")
    if if_match is not None:
        tags = _tags(if_match, weak=False)
        allowed = ["*"] if "*" in tags else [f"{ALGORITHM}:{t.strip(QUOTE)}" for t in tags]
    return allowed, "*" in _tags(headers.get("if-none-match") or "", weak=True)
