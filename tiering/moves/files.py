"""Reads, uploads and deletes of single files, each safe against a migration of the same file.

A read keeps the fd it opened whatever then happens to the path, and looks again when a switch
moved the file between reading its record and opening it. An upload writes through
its tier's :class:`~tiering.tiers.Writer` and records the file in the catalog last. A delete
unlinks under the catalog's write lock. Uploads that replace a file, and deletes, hold the
file's guard (see :class:`~tiering.moves.concurrency.FileGuards`) so they cannot land between a
migration's switch and its source unlink.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import nullcontext

from tiering.catalog import Catalog, FileRecord, FileState, NewFile
from tiering.catalog.journal import refuse_other_host
from tiering.errors import (
    AlreadyExists,
    ChecksumMismatch,
    FileBusy,
    FileNotFound,
    InsufficientSpace,
    IntegrityError,
    InvalidInput,
    PathConflict,
    PreconditionFailed,
    TooLarge,
)
from tiering.moves.concurrency import FileGuards
from tiering.tiers import Aborting, Source, Stat, Tier, Tiers, Writer
from tiering.tiers.paths import validate_relpath

__all__ = ["READ_CHUNK", "Content", "FileOps", "Upload"]

READ_CHUNK = 1 << 20

#: Bytes that may still be written to a tier, not counting the file an upload replaces.
Room = Callable[[Tier, FileRecord | None], int]


class Content:
    """An open file being served: bytes come from this source, whatever happens to the path
    (a local fd, or an object read at the ETag it was opened with).

    ``on_damage(content, exc)`` is told when a read finds the stored bytes damaged (a
    container's chunk that fails its digest) before the error goes on to the reader: the
    engine quarantines the file (see :mod:`tiering.integrity`)."""

    def __init__(self, record: FileRecord, source: Source) -> None:
        self.record = record
        self.source = source
        self.on_damage: Callable[[Content, IntegrityError], None] | None = None

    @property
    def size(self) -> int:
        return self.source.size

    def iter_range(self, start: int, end: int, chunk: int = READ_CHUNK) -> Iterator[bytes]:
        """Bytes ``[start, end)`` in chunks; closes the source when exhausted or closed."""
        try:
            pos = start
            while pos < end:
                buf = bytearray(min(chunk, end - pos))
                n = self.readinto(memoryview(buf), pos)
                if not n:
                    break
                yield bytes(buf) if n == len(buf) else bytes(buf[:n])
                pos += n
        finally:
            self.close()

    def readinto(self, view: memoryview, offset: int) -> int:
        """The source's bytes at ``offset``; damage found is told to ``on_damage``, then
        raised."""
        try:
            return self.source.readinto(view, offset)
        except IntegrityError as exc:
            if self.on_damage is not None:
                self.on_damage(self, exc)
            raise

    def close(self) -> None:
        self.source.close()


class Upload(Aborting):
    """One streamed upload; see :meth:`FileOps.begin_upload`."""

    def __init__(
        self,
        writer: Writer,
        previous: FileRecord | None,
        max_bytes: int,
        *,
        catalog: Catalog,
        tiers: Tiers,
        guards: FileGuards,
        checksum: str | None = None,
        if_match: Collection[str] | None = None,
    ) -> None:
        self._writer = writer
        self._if_match = if_match
        self._previous = previous
        self._max_bytes = max_bytes
        self._checksum = checksum
        self._catalog = catalog
        self._tiers = tiers
        self._guards = guards

    @property
    def size(self) -> int:
        return self._writer.size

    @property
    def replaces(self) -> FileRecord | None:
        """The record this upload overwrites, if any."""
        return self._previous

    def write(self, data: bytes | memoryview) -> None:
        if self._writer.size + len(data) > self._max_bytes:
            raise TooLarge(
                f"upload is larger than max_upload_bytes ({self._max_bytes})",
                limit=self._max_bytes,
            )
        self._writer.write(data)

    def commit(self) -> FileRecord:
        """Publish the bytes, then record them: the catalog commit comes last.

        Replacing a file holds its guard, so the publish cannot land while a migration of the
        same file is between its switch and its source unlink.
        """
        if self._previous is None:
            return self._commit()
        with self._guards.hold(self._previous.id, "overwritten"):
            current = self._catalog.find(self._previous.relpath)
            if self._if_match is not None and not _matches(current, self._if_match):
                # Another upload published a version meanwhile: If-Match names the one this
                # upload was to replace, so it is refused now as it was at the start.
                raise PreconditionFailed(
                    f"{self._previous.relpath!r} was replaced during the upload, and is no "
                    "longer the version If-Match names; nothing was written",
                    path=self._previous.relpath,
                )
            if current is not None and (
                current.state == FileState.MIGRATING or current.tier != self._previous.tier
            ):
                raise FileBusy(
                    f"{self._previous.relpath!r} was migrated during the upload; try again",
                    file_id=self._previous.id,
                )
            return self._commit()

    def _commit(self) -> FileRecord:
        tier = self._writer.tier
        if not tier.capabilities.shared:
            return self._publish_and_record()
        # A shared tier's object: hosts take turns from the bucket's change to the catalog's.
        with self._catalog.db.publish_lock(self._writer.relpath):
            return self._publish_and_record()

    def _publish_and_record(self) -> FileRecord:
        got = self._writer.checksum if self._checksum is not None else None
        if got is not None and got != self._checksum:
            self._writer.abort()
            raise ChecksumMismatch(
                f"{self._writer.relpath!r}: the bytes sent hash to {got}, not {self._checksum}; "
                "nothing was written",
                path=self._writer.relpath,
                expected=self._checksum,
                got=got,
            )
        published = self._writer.publish()
        tier = self._writer.tier
        new = NewFile(
            published.relpath,
            tier.name,
            published.size,
            published.mtime_ns,
            published.checksum,
            published.etag,
            published.stat.codec,
            published.stat.stored_size,
        )
        try:
            # A file found new must still be new: another host may have created it on its
            # own tier meanwhile, and taking its record would orphan its bytes.
            rec = self._catalog.upsert(new, new_only=self._previous is None)
        except BaseException:
            if self._previous is None:
                # Nobody knows these bytes yet: take them back so the failed upload leaves
                # nothing. (An overwrite's bytes stay; scan sees the change and rehashes.)
                tier.remove(published.relpath, version=published.stat.version)
            raise
        if rec is None:
            raise FileBusy(f"{published.relpath!r} is being migrated; try again")
        prev = self._previous
        if prev is not None and prev.tier != tier.name:
            # The record now names the new tier; the old copy is stale. A crash before this
            # unlink leaves a conflict for scan to report, never a lost file.
            self._tiers.get(prev.tier).remove(prev.relpath)
        return rec

    def abort(self) -> None:
        self._writer.abort()


def _matches(rec: FileRecord | None, if_match: Collection[str]) -> bool:
    """Whether the file is a version ``if_match`` names (checksums, or ``"*"``: any)."""
    return rec is not None and ("*" in if_match or rec.checksum in if_match)


class FileOps:
    """Reads, uploads and deletes over one catalog and one set of tiers.

    Parameters
    ----------
    catalog, tiers:
        Where files are recorded and kept.
    guards:
        Shared with the mover (see :class:`~tiering.moves.concurrency.FileGuards`).
    room:
        Bytes that may still be written to a tier, not counting the file an upload replaces
        (free space capped by the tier's quota).
    default_tier:
        Where a new file goes when the caller names no tier (None: the fastest tier).
    max_upload_bytes:
        The largest upload accepted.
    """

    def __init__(
        self,
        catalog: Catalog,
        tiers: Tiers,
        *,
        guards: FileGuards,
        room: Room,
        default_tier: str | None,
        max_upload_bytes: int,
    ) -> None:
        self.catalog = catalog
        self.tiers = tiers
        self.guards = guards
        self.room = room
        self.default_tier = default_tier
        self.max_upload_bytes = max_upload_bytes

    def open_content(self, file_id: int, *, trust_catalog: bool = False) -> Content:
        """Open a file's bytes for reading (counting the access is the caller's job).

        The source keeps reading the bytes it opened if a migration switches the file
        meanwhile (a directory source reads through its fd; an object is only unlinked after the
        switch, and read at its ETag). If the catalog moved the file between our read of
        the record and the open (the source is unlinked only after the switch commits), the
        record is read again; only a record that did not change is reported missing.

        ``trust_catalog``: open with the size, time and ETag the catalog recorded, so a tier
        whose reads are conditional on the ETag sends no request to open (an object tier's
        HEAD: a small load is one request, not two). A file changed or removed behind tierd's
        back then fails at its first read, not here; callers that must fail before they answer
        (a streamed HTTP body) leave it off, and loads, which answer after reading, turn it on.
        """
        rec = self.catalog.get(file_id, cached=True)
        for _ in range(8):
            if rec.state == FileState.MISSING:
                raise FileNotFound(f"file {file_id} ({rec.relpath}) is missing on disk")
            try:
                known = None
                if trust_catalog:
                    known = Stat(
                        rec.size,
                        rec.mtime_ns,
                        rec.etag or "",
                        checksum=rec.checksum,
                        codec=rec.codec,
                        stored_size=rec.stored_size,
                    )
                source = self.tiers.get(rec.tier).open(rec.relpath, etag=rec.etag, known=known)
            except FileNotFound:
                again = self.catalog.get(file_id)
                if (again.tier, again.generation) == (rec.tier, rec.generation):
                    break
                rec = again  # switched to another tier between get and open: look again
                continue
            return Content(rec, source)
        raise FileNotFound(f"file {file_id} is not on disk where the catalog says")

    def begin_upload(
        self,
        relpath: str,
        *,
        tier: str | None = None,
        overwrite: bool = False,
        expected_size: int | None = None,
        checksum: str | None = None,
        if_match: Collection[str] | None = None,
    ) -> Upload:
        """Start a crash-safe upload; write to it, then ``commit()`` (or leave it to abort).

        Every check runs before anything is created, so bad input changes nothing on disk.
        ``checksum`` (``xxh3_128:<hex>``): the bytes must hash to it, or the commit raises
        :class:`~tiering.errors.ChecksumMismatch` and nothing is published. ``if_match``: the
        checksums one of which the file being replaced must have now (an HTTP ``If-Match``;
        ``"*"``: any, but it must exist); otherwise
        :class:`~tiering.errors.PreconditionFailed`, before anything is written.

        Raises
        ------
        InvalidPath, TierNotFound
            Bad input; nothing is created.
        AlreadyExists
            The relpath exists (in any tier) and ``overwrite`` is false.
        Conflict
            The file to replace is on another host's own tier (a shared catalog).
        FileBusy
            The file is being migrated.
        TooLarge, InsufficientSpace
            ``expected_size`` is over ``max_upload_bytes``, or over the tier's free space or quota.
        """
        relpath = validate_relpath(relpath)
        previous = self.catalog.find(relpath)
        if tier is None:
            # An overwrite stays where the file is unless the caller says otherwise.
            tier = previous.tier if previous else self.default_tier
        target = self.tiers.get(tier) if tier else self.tiers.fastest
        if expected_size is not None and expected_size < 0:
            raise InvalidInput("size must not be negative")
        self._may_replace(relpath, previous, overwrite=overwrite, if_match=if_match)
        max_bytes = self.max_upload_bytes
        if expected_size is not None and expected_size > max_bytes:
            raise TooLarge(
                f"upload of {expected_size} bytes is over max_upload_bytes ({max_bytes})",
                limit=max_bytes,
            )
        limit = self.room(target, previous)
        if expected_size is not None and expected_size > limit:
            raise InsufficientSpace(
                f"tier {target.name} has room for {limit} bytes, upload needs {expected_size}",
                tier=target.name,
                free=limit,
            )
        writer = target.writer(relpath, overwrite=overwrite, limit=limit)
        return Upload(
            writer,
            previous,
            max_bytes,
            catalog=self.catalog,
            tiers=self.tiers,
            guards=self.guards,
            checksum=checksum,
            if_match=if_match,
        )

    def _may_replace(
        self,
        relpath: str,
        previous: FileRecord | None,
        *,
        overwrite: bool,
        if_match: Collection[str] | None,
    ) -> None:
        """Refuse an upload that may not write ``relpath`` (see :meth:`begin_upload`)."""
        if if_match is not None and not _matches(previous, if_match):
            raise PreconditionFailed(
                f"{relpath!r} is not at the version If-Match names"
                + ("" if previous is not None else " (it does not exist)")
                + "; nothing was written",
                path=relpath,
            )
        if previous is None:
            self._refuse_clash(relpath)
        else:
            if not overwrite:
                raise AlreadyExists(
                    f"{relpath!r} already exists (id {previous.id}, tier {previous.tier}); "
                    "pass overwrite=true to replace it",
                    path=relpath,
                    file_id=previous.id,
                )
            refuse_other_host(self.catalog.db, previous, "replace")
            if previous.state == FileState.MIGRATING:
                raise FileBusy(f"{relpath!r} is being migrated; try again", file_id=previous.id)

    def _refuse_clash(self, relpath: str) -> None:
        """Refuse a new file beneath a file, or where files sit beneath its name, on any tier:
        relpaths are one namespace, so a move would meet the other one (PathConflict)."""
        parts = relpath.split("/")
        parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
        found = self.catalog.find_many(parents) if parents else {}
        for parent in parents:
            rec = found.get(parent)
            if rec is not None and rec.state != FileState.MISSING:
                raise PathConflict(
                    f"{relpath!r} cannot be created: {parent!r} is a file (id {rec.id}, "
                    f"tier {rec.tier}), not a directory",
                    path=relpath,
                    conflict=parent,
                    file_id=rec.id,
                )
        live = [s for s in FileState.ALL if s != FileState.MISSING]
        below = self.catalog.page(prefix=relpath + "/", states=live, limit=1)
        if below:
            raise PathConflict(
                f"{relpath!r} cannot be created: it is a directory holding files "
                f"({below[0].relpath!r}, tier {below[0].tier})",
                path=relpath,
                conflict=below[0].relpath,
                file_id=below[0].id,
            )

    def delete(self, file_id: int) -> FileRecord:
        """Remove a file's bytes and its record.

        The bytes are unlinked while the catalog's write lock is held, then the deletion
        commits: a busy catalog changes nothing, and a crash in between leaves a ``missing``
        record for scan to report, never a resurrected file. A file on another host's own tier
        is refused (:class:`Conflict`): its bytes are out of this host's reach.
        """
        with self.guards.hold(file_id, "deleted"):
            rec = self.catalog.get(file_id)
            refuse_other_host(self.catalog.db, rec, "delete")
            if rec.state == FileState.MIGRATING:
                raise FileBusy(f"file {file_id} is being migrated; try again", file_id=file_id)
            tier = self.tiers.get(rec.tier)
            unlink = lambda r: tier.remove(r.relpath)  # noqa: E731
            # A shared tier's object: no other host's overwrite lands between unlink and commit.
            shared = tier.capabilities.shared
            with self.catalog.db.publish_lock(rec.relpath) if shared else nullcontext():
                done = self.catalog.delete(file_id, generation=rec.generation, before_commit=unlink)
            if not done:
                raise FileBusy(
                    f"file {file_id} changed while it was being deleted", file_id=file_id
                )
        return rec
