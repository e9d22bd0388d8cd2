"""Relpath validation: every accepted path stays beneath its root, exhaustively with Hypothesis."""

from __future__ import annotations

import os.path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.errors import InvalidPath
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
        ".tierd-copies",
        ".tierd-compressed",
        ".tierd-compressed/m.safetensors",
    ],
)
def test_rejected(bad: str) -> None:
    with pytest.raises(InvalidPath):
        validate_relpath(bad)


@pytest.mark.parametrize(
    "good", ["a", "a/b/c.bin", ".hidden", "..dots", "sp ace", "é" * 127, "d/.tierd-compressed/x"]
)
def test_accepted(good: str) -> None:
    assert validate_relpath(good) == good


def test_temp_names() -> None:
    assert is_temp_name(".w-abc.tierd-tmp") and is_temp_name(".12.34.tierd-tmp")
    assert not is_temp_name("x.tierd-tmp") and not is_temp_name(".x.tierd-tmp.bak")
