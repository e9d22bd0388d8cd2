"""HTTP ``Range`` header parsing (RFC 9110 §14), single ranges only."""

from __future__ import annotations

import re

from tiering.errors import InvalidRange

__all__ = ["parse_range", "reply_range"]

_RANGE = re.compile(r"^bytes=([0-9]*)-([0-9]*)$")


def parse_range(header: str, size: int) -> tuple[int, int]:
    """The half-open byte interval ``[start, end)`` a ``Range`` header asks of a ``size``-byte file.

    Raises
    ------
    InvalidRange
        For anything but one satisfiable range: malformed, multiple ranges, or starting at or
        past the end. The error carries ``size`` for the ``Content-Range: bytes */size`` reply.
    """
    m = _RANGE.match(header.strip())
    if m is None:
        raise InvalidRange(
            f"unsupported Range {header[:100]!r}: send one range as bytes=start-end, "
            "bytes=start- or bytes=-suffix",
            size=size,
        )
    first, last = m.groups()
    if first == "" and last == "":
        raise InvalidRange("Range bytes=- names no bytes", size=size)
    if first == "":
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise InvalidRange(f"suffix range of {suffix} bytes of a {size}-byte file", size=size)
        return max(0, size - suffix), size
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if last != "" and int(last) < start:
        raise InvalidRange(f"Range end {last} is before its start {start}", size=size)
    if start >= size:
        raise InvalidRange(
            f"Range starts at {start}, past the end of a {size}-byte file", size=size
        )
    return start, end


def reply_range(header: str | None, size: int, headers: dict[str, str]) -> tuple[int, int, int]:
    """``[start, end)`` and the status of a reply to ``Range`` ``header`` (None: the whole file,
    200; one range: 206 with its ``Content-Range``), with ``Content-Length`` set in ``headers``.
    Raises :class:`InvalidRange` as :func:`parse_range` does."""
    if header is None:
        start, end, status = 0, size, 200
    else:
        start, end = parse_range(header, size)
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    headers["Content-Length"] = str(end - start)
    return start, end, status
