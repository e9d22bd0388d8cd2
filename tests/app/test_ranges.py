"""HTTP ``Range`` parsing, checked against RFC 9110's single-range rules written plainly."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.ranges import parse_range
from tiering.errors import InvalidRange


def reference(header: str, size: int) -> tuple[int, int] | None:
    """RFC 9110 single byte-range semantics, written plainly."""
    if not header.startswith("bytes="):
        return None
    spec = header[len("bytes=") :]
    if "," in spec or spec.count("-") != 1:
        return None
    first, last = spec.split("-")
    if not (first.isdigit() or first == "") or not (last.isdigit() or last == ""):
        return None
    if not first.isascii() or not last.isascii():
        return None
    if first == "":
        if last == "" or int(last) == 0 or size == 0:
            return None
        return max(0, size - int(last)), size
    a = int(first)
    if last and int(last) < a:
        return None
    if a >= size:
        return None
    return a, size if last == "" else min(int(last) + 1, size)


@given(
    size=st.integers(0, 10_000),
    first=st.one_of(st.none(), st.integers(0, 12_000)),
    last=st.one_of(st.none(), st.integers(0, 12_000)),
)
def test_range_matches_reference(size: int, first: int | None, last: int | None) -> None:
    header = f"bytes={'' if first is None else first}-{'' if last is None else last}"
    expected = reference(header, size)
    if expected is None:
        with pytest.raises(InvalidRange):
            parse_range(header, size)
    else:
        start, end = parse_range(header, size)
        assert (start, end) == expected
        assert 0 <= start < end <= size


@given(st.text(max_size=40), st.integers(0, 1000))
def test_range_garbage_is_invalid_range_or_valid(header: str, size: int) -> None:
    try:
        start, end = parse_range(header, size)
    except InvalidRange as exc:
        assert exc.details["size"] == size
    else:
        assert reference(header.strip(), size) == (start, end)
