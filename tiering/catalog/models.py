"""SQLAlchemy 2 models of the catalog.

The schema is created only by the Alembic migrations in ``migrations/``; ``Base.metadata`` is
what those migrations target. Times are float seconds since the epoch (UTC), which keeps heat
arithmetic cheap and exact enough.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    Select,
    String,
    Text,
    UniqueConstraint,
    select,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "Base",
    "Copy",
    "FleetJob",
    "FleetTask",
    "HostHeat",
    "HostRow",
    "FileRecord",
    "FileState",
    "Migration",
    "MigrationPhase",
    "PieceHolding",
    "PieceMap",
    "PolicyVersion",
    "owned_file_ids",
]

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class FileState:
    """Values of ``FileRecord.state``."""

    STABLE = "stable"  # bytes are on ``tier`` and match ``checksum``
    MIGRATING = "migrating"  # a migration intent owns the file
    MISSING = "missing"  # the record's bytes vanished from disk
    CONFLICT = "conflict"  # the relpath is present in more than one tier
    QUARANTINED = "quarantined"  # recovery could not decide; nothing was deleted

    ALL = (STABLE, MIGRATING, MISSING, CONFLICT, QUARANTINED)


class FileRecord(Base):
    __tablename__ = "files"
    # Ids are never reused: leases, caches and counted accesses name files by id, and a deleted
    # file's id must not come to name another file.
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    relpath: Mapped[str] = mapped_column(String(4096), unique=True)
    tier: Mapped[str] = mapped_column(String(64), index=True)
    # The host whose own tier ``tier`` is, where it is host-local (a directory: hosts of a fleet
    # each have an ``nvme``); NULL on a shared tier (an object store), which every host reads.
    host: Mapped[str | None] = mapped_column(String(255), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    mtime_ns: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str | None] = mapped_column(String(64), index=True)
    # The object store's version of the bytes (its ETag), where the tier has one: a load or a
    # move of an object whose ETag differs is refused, never served stale.
    etag: Mapped[str | None] = mapped_column(String(256))
    # How the tier stores the bytes: ``codec`` (tiering.codec's name) and the bytes it takes
    # there; NULL for a file stored as it is (its size is ``size``). ``size`` and ``checksum``
    # are always of the logical bytes, what readers get.
    codec: Mapped[str | None] = mapped_column(String(16))
    stored_size: Mapped[int | None] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default=FileState.STABLE, index=True)
    # Bumped by every change of place or content; migrations compare-and-set on it.
    generation: Mapped[int] = mapped_column(Integer, default=0)
    access_count: Mapped[int] = mapped_column(BigInteger, default=0)
    heat: Mapped[float] = mapped_column(Float, default=0.0)
    heat_at: Mapped[float] = mapped_column(Float, default=0.0)
    last_access: Mapped[float | None] = mapped_column(Float)
    pinned_tier: Mapped[str | None] = mapped_column(String(64))
    # Why the file is not stable (conflict with tier X, quarantine reason, ...).
    detail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class PolicyVersion(Base):
    """Every policy ever set; the highest version is in force."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    document: Mapped[str] = mapped_column(Text)  # JSON
    created_at: Mapped[float] = mapped_column(Float)
    author: Mapped[str | None] = mapped_column(String(64))


class MigrationPhase:
    """Values of ``Migration.phase``: the intent journal and the history in one table."""

    COPYING = "copying"  # source authoritative
    SWITCHED = "switched"  # destination authoritative; source may still exist
    DONE = "done"
    ABORTED = "aborted"  # cleaned up; the source stayed authoritative
    FAILED = "failed"  # needs a person; see error

    OPEN = (COPYING, SWITCHED)


class Migration(Base):
    __tablename__ = "migrations"
    __table_args__ = (Index("ix_migrations_phase", "phase"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    file_id: Mapped[int | None] = mapped_column(
        ForeignKey("files.id", ondelete="SET NULL"), index=True
    )
    relpath: Mapped[str] = mapped_column(String(4096))
    src_tier: Mapped[str] = mapped_column(String(64))
    dst_tier: Mapped[str] = mapped_column(String(64))
    temp_name: Mapped[str] = mapped_column(String(255))
    # The host whose mover claimed the move: only its recovery settles the intent, since the
    # move's temp and often one of its sides are on that host's own tiers. NULL: written
    # before hosts were recorded (migration 0006); the first host to recover adopts it.
    host: Mapped[str | None] = mapped_column(String(255))
    phase: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    size: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_copied: Mapped[int] = mapped_column(BigInteger, default=0)
    generation: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)


class Copy(Base):
    """A cached copy of a file's bytes somewhere other than its tier.

    A file's ``tier`` is where its authoritative bytes are; a copy is only ever a cache of
    them, dropped freely, never the only copy. ``host`` names the machine that holds it and
    ``location`` where there: a memory tier's name (pinned host memory), later ``cuda:N`` or
    another host's tier. ``generation`` is the file's when it was copied: a copy of another
    generation is stale. A row is written once the copy is complete and verified, and deleted
    when it is dropped; a host deletes its in-memory rows when it starts, as memory does not
    survive a restart. Deleting the file deletes its copies' rows (ON DELETE CASCADE).
    """

    __tablename__ = "copies"
    __table_args__ = (UniqueConstraint("file_id", "host", "location"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    file_id: Mapped[int] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"), index=True)
    host: Mapped[str] = mapped_column(String(255))
    location: Mapped[str] = mapped_column(String(64))
    generation: Mapped[int] = mapped_column(Integer)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float)


class HostRow(Base):
    """A host sharing the catalog: registered at start, its heartbeat rewritten every few
    seconds. A row is never deleted by another host: one whose heartbeat is old is shown down,
    and its records stay as they were."""

    __tablename__ = "hosts"

    host_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    address: Mapped[str] = mapped_column(String(1024))  # the URL of its REST API
    started_at: Mapped[float] = mapped_column(Float)
    last_heartbeat: Mapped[float] = mapped_column(Float)
    version: Mapped[str] = mapped_column(String(64))
    # JSON: {"tiers": [{"name", "kind", "rank", "shared"}], "gpus": [{"device", "leased_bytes"}]}
    report: Mapped[str] = mapped_column(Text)


class FleetJob(Base):
    """One fleet-wide request: a prefetch of ``spec`` (JSON: the file ids and paths, the model
    asked for, the hosts) to ``target`` on some hosts, each host's part a :class:`FleetTask`."""

    __tablename__ = "fleet_jobs"
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(32))
    spec: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(255))  # the host that took the request
    created_at: Mapped[float] = mapped_column(Float)
    cancelled_at: Mapped[float | None] = mapped_column(Float)


class FleetTask(Base):
    """One host's part of a :class:`FleetJob`, run only by that host.

    ``state`` is ``queued``, ``running``, ``done``, ``failed`` or ``cancelled``. A host claims
    its task (``claimed_by``, ``claim_expires``) and renews the claim while it works; a claim
    past its expiry is as good as none, so a task whose host died is run again when it
    returns (``attempts`` counts the claims)."""

    __tablename__ = "fleet_tasks"
    __table_args__ = (
        UniqueConstraint("job_id", "host"),
        Index("ix_fleet_tasks_host_state", "host", "state"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("fleet_jobs.id", ondelete="CASCADE"))
    host: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    claimed_by: Mapped[str | None] = mapped_column(String(255))
    claim_expires: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    files_total: Mapped[int] = mapped_column(Integer)
    bytes_total: Mapped[int] = mapped_column(BigInteger)
    files_done: Mapped[int] = mapped_column(Integer, default=0)
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)
    error: Mapped[str | None] = mapped_column(Text)  # why the task failed, for a person
    errors: Mapped[str | None] = mapped_column(Text)  # JSON: per-file errors
    sources: Mapped[str | None] = mapped_column(Text)  # JSON: bytes by source (bucket, peers)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class HostHeat(Base):
    """One host's own heat of a file: its decayed access count there. ``files.heat`` is the
    fleet's (every host's accesses add to it), which is the sum of these, decay being linear."""

    __tablename__ = "host_heat"

    file_id: Mapped[int] = mapped_column(
        ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    host: Mapped[str] = mapped_column(String(255), primary_key=True, index=True)
    heat: Mapped[float] = mapped_column(Float)
    heat_at: Mapped[float] = mapped_column(Float)
    access_count: Mapped[int] = mapped_column(BigInteger)
    last_access: Mapped[float | None] = mapped_column(Float)


class PieceMap(Base):
    """The pieces of one generation of a file: each ``piece_size`` bytes (the last shorter),
    ``digests`` their digests (``algorithm``) concatenated in order, ``known`` a bitmap of
    those recorded so far (a piece's digest is written once, by the host that read it from the
    authority, as it lands), ``final`` once that host's whole-file checksum matched. A map of
    an older generation is stale and is deleted when a newer one is opened."""

    __tablename__ = "piece_maps"

    file_id: Mapped[int] = mapped_column(
        ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    generation: Mapped[int] = mapped_column(Integer, primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    piece_size: Mapped[int] = mapped_column(Integer)
    algorithm: Mapped[str] = mapped_column(String(32))
    digests: Mapped[bytes] = mapped_column(LargeBinary)
    known: Mapped[bytes] = mapped_column(LargeBinary)
    final: Mapped[bool] = mapped_column(Boolean)
    recorded_by: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[float] = mapped_column(Float)


class PieceHolding(Base):
    """The pieces of one generation of a file that one host has verified and can serve: a
    bitmap (bit ``i`` of byte ``i // 8``, lowest first) and its count. One row per file and
    host; a newer generation replaces it, and a host deletes its rows of bytes it dropped."""

    __tablename__ = "piece_holdings"
    # The rows holding a claim on the bucket, by its end: a receiver's poll reads the live ones,
    # a range of it however many run-out claims lie before them (0011, 0012).
    __table_args__ = (
        Index(
            "ix_piece_holdings_claims",
            "file_id",
            "origin_until",
            postgresql_where=text("origin_until IS NOT NULL"),
            sqlite_where=text("origin_until IS NOT NULL"),
        ),
    )

    file_id: Mapped[int] = mapped_column(
        ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    host: Mapped[str] = mapped_column(String(255), primary_key=True, index=True)
    generation: Mapped[int] = mapped_column(Integer)
    have: Mapped[bytes] = mapped_column(LargeBinary)
    pieces: Mapped[int] = mapped_column(Integer)
    # The host's claim on reading this generation from the bucket, until then (None: none).
    origin_until: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


def owned_file_ids() -> Select[int | None]:
    """Ids of the files an open migration intent owns (usable as a subquery). Until the intent
    closes, the mover alone may change such a file, or decide what its copies are."""
    return select(Migration.file_id).where(
        Migration.phase.in_(MigrationPhase.OPEN), Migration.file_id.is_not(None)
    )
