"""Walking one directory of a directory tier (its root, or its ``.tierd-compressed`` place):
its files in relpath order, and tierd's temp files in it."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from tiering.errors import InvalidPath
from tiering.tiers._base import WalkEntry
from tiering.tiers.paths import TEMP_SUFFIX, is_reserved, is_temp_name, validate_relpath

__all__ = ["temps_under", "walk_dir"]

log = logging.getLogger(__name__)

#: Why a symbolic link in a tier root is not adopted. tierd opens every path beneath a root
#: without following links (a link could lead outside the tier, or be swapped mid-read), and a
#: link is no file whose bytes a move could carry: copy the files in instead.
SYMLINK = (
    "a symbolic link: tierd takes only regular files (copy the files in, e.g. `cp -L`, or "
    "download a Hugging Face model with `--local-dir` rather than into its cache)"
)


def _sort_key(entry: os.DirEntry[str]) -> str:
    """A directory sorts as its name and ``/``, where the relpaths of its files do."""
    return entry.name + "/" if entry.is_dir(follow_symlinks=False) else entry.name


def walk_dir(root: Path, tier: str, prefix: str, codec: str | None) -> Iterator[WalkEntry]:
    """The regular files under ``root/prefix`` in relpath order (each entry's ``codec`` is
    ``codec``: the place's), skipping temps and the reserved top-level directories; a symbolic
    link is listed with ``skipped`` saying why it is not taken (the scan reports it).

    One directory's entries are listed and sorted at a time (a directory sorts by its name and
    ``/``, so its files come where their relpaths do); the walk holds only those of the
    directories it is inside."""
    try:
        with os.scandir(root / prefix if prefix else root) as it:
            listed = [(_sort_key(e), e) for e in it]
    except FileNotFoundError:
        if prefix or codec is None:
            log.warning("cannot list %s in tier %s: it is gone", prefix or "/", tier)
        return  # (a tier's .tierd-compressed is made with its first container)
    except OSError as exc:
        log.warning("cannot list %s in tier %s: %s", prefix or "/", tier, exc)
        return
    listed.sort(key=lambda ke: ke[0])
    for key, entry in listed:
        rel = f"{prefix}/{entry.name}" if prefix else entry.name
        if key.endswith("/"):
            if not is_reserved(rel):
                yield from walk_dir(root, tier, rel, codec)
            continue
        if entry.is_symlink() and not is_reserved(rel):
            with contextlib.suppress(InvalidPath):
                yield WalkEntry(validate_relpath(rel), 0, 0, skipped=SYMLINK)
            continue
        if not entry.is_file(follow_symlinks=False) or is_temp_name(entry.name):
            continue
        try:
            validate_relpath(rel)
            st = entry.stat(follow_symlinks=False)
        except (InvalidPath, OSError) as exc:
            log.warning("skipping %r in tier %s: %s", rel, tier, exc)
            continue
        yield WalkEntry(rel, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, codec=codec)


def temps_under(root: Path) -> Iterator[tuple[str, str]]:
    """``(relpath, stem)`` of tierd's temp files under ``root``, outside its reserved
    directories (the copies' temps are their reconcile's; the containers' are walked as a
    place of their own)."""
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        if dirpath == str(root):
            dirs[:] = [d for d in dirs if not is_reserved(d)]
        for name in files:
            if is_temp_name(name):
                rel = os.path.relpath(dirpath, root)
                stem = name[1 : -len(TEMP_SUFFIX)]
                yield (stem if rel == "." else f"{rel}/{stem}"), stem
