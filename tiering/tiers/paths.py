"""Relpath validation and tierd's temp-file naming.

A relpath names a file independently of its tier. It is accepted only in one normal form, so
that two spellings can never name the same file and no spelling can leave a tier root.
"""

from __future__ import annotations

import re

from tiering.errors import InvalidPath

__all__ = [
    "MAX_COMPONENT_BYTES",
    "MAX_RELPATH_CHARS",
    "COMPRESSED_DIR",
    "RESERVED_DIR",
    "TEMP_SUFFIX",
    "is_reserved",
    "is_temp_name",
    "packed_relpath",
    "split_relpath",
    "validate_relpath",
]

MAX_RELPATH_CHARS = 1024
MAX_COMPONENT_BYTES = 255  # NAME_MAX on Linux filesystems
MAX_DEPTH = 64
TEMP_SUFFIX = ".tierd-tmp"
#: The top-level directory of a tier root where tierd keeps this host's copies of files whose
#: origin is a shared tier (see tiering.copies.hostcopies): never a file of the tier.
RESERVED_DIR = ".tierd-copies"
#: The top-level directory of a tier (a directory tier's root, an object tier's prefix) where
#: tierd keeps the files it stored compressed (``.tierd-compressed/<relpath>``, see
#: tiering.tiers._compressed): beside the plain files, so where a file is says what it is,
#: never its first bytes, and other tools never take a container for the file.
COMPRESSED_DIR = ".tierd-compressed"
_RESERVED = (RESERVED_DIR, COMPRESSED_DIR)
# Every temp file tierd creates: ".<anything>.tierd-tmp". Nothing else is ever deleted as a temp.
_TEMP_RE = re.compile(r"^\.[A-Za-z0-9_.-]+\.tierd-tmp$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_temp_name(name: str) -> bool:
    """True for a file name in tierd's own temp namespace."""
    return bool(_TEMP_RE.match(name))


def is_reserved(relpath: str) -> bool:
    """True for a path inside (or naming) one of the reserved top-level directories."""
    return relpath.split("/", 1)[0] in _RESERVED


def packed_relpath(path: str) -> str | None:
    """The relpath a path of a tier root names inside its ``.tierd-compressed`` directory (a
    directory tier keeps its containers there under their relpaths), or None."""
    head, _, rest = path.partition("/")
    return rest or None if head == COMPRESSED_DIR else None


def validate_relpath(relpath: object) -> str:
    """Return ``relpath`` if it is a normal relative path, else raise :class:`InvalidPath`.

    Rules: a non-empty string of at most 1024 characters; no NUL or control characters;
    no U+FFFD (undecodable bytes); not absolute; no empty, ``.`` or ``..`` components; each
    component at most 255 bytes in UTF-8;
    at most 64 levels deep; no component in tierd's temp namespace (``*.tierd-tmp``); not
    under the reserved top-level directories ``.tierd-copies`` and ``.tierd-compressed``.
    """
    if not isinstance(relpath, str) or not relpath:
        raise InvalidPath("path must be a non-empty string")
    if len(relpath) > MAX_RELPATH_CHARS:
        raise InvalidPath(f"path is longer than {MAX_RELPATH_CHARS} characters")
    if _CONTROL.search(relpath):
        raise InvalidPath("path contains NUL or control characters")
    if "\ufffd" in relpath:
        # What a lossy decoder makes of bytes that are not UTF-8 (Starlette decodes %ff%fe so):
        # kept, two different byte strings would name one file.
        raise InvalidPath(
            "path is not valid UTF-8 (it holds U+FFFD, the mark of undecodable bytes)"
        )
    if relpath.startswith("/"):
        raise InvalidPath("path must be relative to the tier root, not absolute")
    parts = relpath.split("/")
    if len(parts) > MAX_DEPTH:
        raise InvalidPath(f"path is deeper than {MAX_DEPTH} levels")
    for part in parts:
        if part in ("", ".", ".."):
            raise InvalidPath(
                f"path {relpath!r} is not normal: no empty, '.' or '..' components allowed"
            )
        try:
            encoded = part.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidPath("path is not valid UTF-8") from exc
        if len(encoded) > MAX_COMPONENT_BYTES:
            raise InvalidPath(f"path component longer than {MAX_COMPONENT_BYTES} bytes")
        if part.endswith(TEMP_SUFFIX):
            raise InvalidPath(f"names ending in {TEMP_SUFFIX!r} are reserved for tierd")
    if parts[0] in _RESERVED:
        raise InvalidPath(f"the top-level directory {parts[0]!r} is reserved for tierd")
    return relpath


def split_relpath(relpath: str) -> tuple[list[str], str]:
    """Validated ``relpath`` as (directory components, file name)."""
    parts = validate_relpath(relpath).split("/")
    return parts[:-1], parts[-1]
