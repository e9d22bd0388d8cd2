"""Relpath validation and Range parsing, exhaustively with Hypothesis."""

from __future__ import annotations

import os.path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.ranges import parse_range
from tiering.errors import InvalidPath, InvalidRange
from tiering.tiers.paths import is_temp_name, validate_relpath

component = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
    min_size=1,
    max_size=40,
)


@given(st.lists(component, min_size=1, max_size=8))
def test_accepted_paths_stay_beneath_the_root(parts: list[str]) -> None:
    relpath = "/".join(parts)
    try:
        validate_relpath(relpath)
    except InvalidPath:
        return
    root = "/tier/root"
    joined = os.path.normpath(os.path.join(root, relpath))
    assert joined.startswith(root + "/")
    assert ".." not in relpath.split("/") and "\x00" not in relpath
    assert os.path.normpath(relpath) == relpath  # only normal forms are accepted


@given(st.text(max_size=300))
def test_validation_never_crashes(text: str) -> None:
    try:
        assert validate_relpath(text) == text
    except InvalidPath as exc:
        assert exc.code == "invalid_path" and exc.message


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "/abs",
        "..",
        "a/..",
        "../a",
        "a/../b",
        ".",
        "a/./b",
        "a//b",
        "a/",
        "nul\x00",
        "tab\tname",
        "x" * 256,
        "é" * 128,
        "a/" * 64 + "b",
        ".x.tierd-tmp",
        "d/.w-12.tierd-tmp",
    ],
)
def test_rejected(bad: str) -> None:
    with pytest.raises(InvalidPath):
        validate_relpath(bad)


@pytest.mark.parametrize("good", ["a", "a/b/c.bin", ".hidden", "..dots", "sp ace", "é" * 127])
def test_accepted(good: str) -> None:
    assert validate_relpath(good) == good


def test_temp_names() -> None:
    assert is_temp_name(".w-abc.tierd-tmp") and is_temp_name(".12.34.tierd-tmp")
    assert not is_temp_name("x.tierd-tmp") and not is_temp_name(".x.tierd-tmp.bak")


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
