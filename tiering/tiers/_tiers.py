"""The ordered tiers of one engine, each built by the backend its configuration names."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from tiering.config import STORAGE_KINDS, TierConfig
from tiering.errors import CacheOnlyTier, TierNotFound
from tiering.tiers._base import Tier
from tiering.tiers._directory import DirectoryTier

__all__ = ["KINDS", "Tiers", "make_tier", "overlap"]

#: The backends a storage tier's ``kind`` can name (``"memory"`` is a cache, not a Tier).
KINDS = STORAGE_KINDS


def _place(config: TierConfig) -> tuple[str, tuple[str, ...]] | None:
    """Where a tier keeps its files, as (a store, the path's components): a directory's real
    path (symlinks resolved, as far as it exists), or a bucket's prefix at its endpoint."""
    if config.kind == "directory" and config.path is not None:
        return "", tuple(Path(os.path.realpath(config.path)).parts)
    if config.kind == "object" and config.url is not None:
        bucket, _, prefix = config.url.removeprefix("s3://").partition("/")
        store = f"{config.endpoint_url or 'aws'} {bucket}"
        return store, tuple(p for p in prefix.split("/") if p)
    return None


def overlap(configs: Sequence[TierConfig], *, catalog: Path | None = None) -> str | None:
    """Why these tiers cannot be served together, or None: two whose roots (or a bucket's
    prefixes) are equal or nested would each take the other's files for its own (adopted
    twice; a delete through one name removes the other's file), and a directory tier whose
    root holds the SQLite ``catalog`` would adopt the catalog itself."""
    places = [(c, p) for c in configs if (p := _place(c)) is not None]
    for i, (a, (sa, pa)) in enumerate(places):
        for b, (sb, pb) in places[i + 1 :]:
            if sa != sb:
                continue
            if pa == pb:
                return f"tiers {a.name!r} and {b.name!r} have the same root ({_shown(a)})"
            inner, outer = (a, b) if pa[: len(pb)] == pb else (b, a)
            if pa[: len(pb)] == pb or pb[: len(pa)] == pa:
                return _nested(inner, outer)
    if catalog is not None:
        at = Path(os.path.realpath(catalog)).parts
        for c, (store, parts) in places:
            if store == "" and at[: len(parts)] == parts:
                return _holds_catalog(c, catalog)
    return _by_identity(configs, catalog)


def _ids(path: Path) -> tuple[tuple[int, int] | None, set[tuple[int, int]]]:
    """The identity (st_dev, st_ino) of directory ``path`` (None while it does not exist), and
    those of it and of every directory above it, by its real path."""
    real = Path(os.path.realpath(path))
    own, chain = None, set()
    for q in (real, *real.parents):
        try:
            st = os.stat(q)
        except OSError:
            continue
        chain.add((st.st_dev, st.st_ino))
        own = (st.st_dev, st.st_ino) if q == real else own
    return own, chain


def _by_identity(configs: Sequence[TierConfig], catalog: Path | None) -> str | None:
    """The overlap paths do not show: one directory reached by two names (a bind mount), as
    the same root, or above another root or the catalog reached through the other name."""
    dirs = [(c, *_ids(c.path)) for c in configs if c.kind == "directory" and c.path is not None]
    for i, (a, own_a, chain_a) in enumerate(dirs):
        for b, own_b, chain_b in dirs[i + 1 :]:
            if own_a is not None and own_a == own_b:
                return (
                    f"tiers {a.name!r} and {b.name!r} have the same root ({a.path} and "
                    f"{b.path} are one directory)"
                )
            if own_b is not None and own_b in chain_a:
                return _nested(a, b)
            if own_a is not None and own_a in chain_b:
                return _nested(b, a)
    if catalog is not None:
        chain = _ids(catalog.parent)[1]
        for c, own, _ in dirs:
            if own is not None and own in chain:
                return _holds_catalog(c, catalog)
    return None


def _nested(inner: TierConfig, outer: TierConfig) -> str:
    return (
        f"tier {inner.name!r} ({_shown(inner)}) is inside tier {outer.name!r} "
        f"({_shown(outer)}): tier roots must not nest"
    )


def _holds_catalog(c: TierConfig, catalog: Path) -> str:
    return (
        f"the catalog {catalog} is inside tier {c.name!r} ({_shown(c)}): it would be taken "
        "for a file of the tier; keep it beside the tiers"
    )


def _shown(c: TierConfig) -> str:
    return str(c.path) if c.kind == "directory" else str(c.url)


def make_tier(config: TierConfig, rank: int) -> Tier:
    """The tier ``config`` describes, at ``rank``."""
    if config.kind == "directory":
        return DirectoryTier(config, rank)
    if config.kind == "object":
        # boto3 is imported only by deployments that have an object-store tier.
        from tiering.tiers._object import ObjectTier

        tuning: dict[str, Any] = {}
        if config.part_size is not None:
            tuning["part_size"] = tuning["read_size"] = config.part_size
            tuning["readahead_bytes"] = (config.connections or 64) * config.part_size
        if config.connections is not None:
            tuning["workers"] = config.connections
        tier: Tier = ObjectTier(config, rank, **tuning)
        return tier
    if config.kind == "memory":
        raise ValueError(f"tier {config.name!r} is a memory tier: a cache, built as a MemoryTier")
    raise ValueError(f"tier {config.name!r}: unknown kind {config.kind!r}; one of {KINDS}")


class Tiers:
    """The ordered storage tiers of one engine, fastest first.

    ``caches`` names the memory tier (if any): it is no member (iteration, ``in``), and
    :meth:`get` refuses it with :class:`~tiering.errors.CacheOnlyTier`, so an upload, move or
    pin that names it is a clear error, never "no such tier". Tiers whose roots overlap, or a
    directory tier holding the SQLite ``catalog``, are refused (:func:`overlap`).
    """

    def __init__(
        self,
        configs: tuple[TierConfig, ...] | list[TierConfig],
        *,
        caches: Collection[str] = (),
        catalog: Path | None = None,
    ) -> None:
        names = [c.name for c in configs]
        if not configs:
            raise ValueError("at least one tier is required")
        if len(set(names)) != len(names) or set(names) & set(caches):
            raise ValueError(f"tier names must be unique: {[*caches, *names]}")
        why = overlap(configs, catalog=catalog)
        if why is not None:
            raise ValueError(why)
        self._tiers = [make_tier(c, rank) for rank, c in enumerate(configs)]
        self._by_name = {t.name: t for t in self._tiers}
        self.caches = tuple(caches)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str) -> Tier:
        try:
            return self._by_name[name]
        except KeyError:
            if name in self.caches:
                raise CacheOnlyTier(
                    f"{name} is a memory tier: it holds cached copies of files whose bytes stay "
                    f"on a storage tier, never a file of its own; name one of "
                    f"{', '.join(self._by_name)}",
                    tier=name,
                ) from None
            raise TierNotFound(
                f"no tier named {name!r}; tiers are {', '.join(self._by_name)}", tier=name
            ) from None

    @property
    def fastest(self) -> Tier:
        return self._tiers[0]

    def close(self) -> None:
        for t in self._tiers:
            t.close()
