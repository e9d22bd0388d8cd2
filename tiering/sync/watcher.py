"""Live sync: the catalog follows changes made to tier roots from outside tierd.

A watchdog observer (inotify where the kernel has it, polling otherwise) reports events on every
tier root. Events only mark relpaths as *dirty*; a worker thread reconciles a relpath once it has
been quiet for ``settle_s``, so a file still being written is never hashed half-way and a burst of
events costs one reconcile. Reconciling compares disk with the catalog (see
``tiering.sync.scan``), so
tierd's own writes, which the catalog already records, come out as no change at all; tierd's temp
files are never looked at, and files with an open migration are left to the mover and looked at
again after it finishes.

An inotify queue overflow (events were lost) or a restart of the observer triggers a full
reconcile, paced to ``reconcile_files_per_s`` so it does not stall loads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from watchdog.events import (
    DirDeletedEvent,
    DirMovedEvent,
    FileAttribEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserver

from tiering.catalog import Catalog, FileState
from tiering.errors import IntegrityError, TierdError
from tiering.integrity import DamageLog
from tiering.sync.scan import ScanReport, owned_by_this_host, reconcile_paths, scan
from tiering.tiers import Tier, Tiers
from tiering.tiers.paths import is_reserved, is_temp_name, packed_relpath

__all__ = ["TierWatcher", "WatcherStatus"]

log = logging.getLogger(__name__)

# Reads generate open/close-nowrite events; asking only for these keeps tierd's own loads silent.
_EVENTS = [
    FileCreatedEvent,
    FileModifiedEvent,
    FileAttribEvent,
    FileClosedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    DirDeletedEvent,
    DirMovedEvent,
]


@dataclass
class WatcherStatus:
    backend: str = "none"
    reason: str | None = None
    healthy: bool = False
    events: int = 0
    pending: int = 0
    overflows: int = 0
    restarts: int = 0
    last_event_at: float | None = None
    last_reconcile_at: float | None = None
    last_full_reconcile_at: float | None = None
    last_full_reconcile_reason: str | None = None
    last_full_reconcile_seconds: float | None = None
    applied: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("adopted", "changed", "moved", "missing", "renamed", "conflicts"), 0
        )
    )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _OverflowSpy(logging.Handler):
    """watchdog rebuilds its watches on IN_Q_OVERFLOW but tells handlers nothing, only its log;
    this turns that log record into a full reconcile."""

    def __init__(self, watcher: TierWatcher) -> None:
        super().__init__(logging.WARNING)
        self.watcher = watcher

    def emit(self, record: logging.LogRecord) -> None:
        if "overflow" in record.getMessage().lower():
            self.watcher.overflowed()


def _temp_only(event: FileSystemEvent) -> bool:
    """Whether every path of ``event`` is a temp file's: a move makes a dozen such events, and
    waking the worker for each cost the server's GIL (issue 43)."""
    paths = (event.src_path, event.dest_path) if event.dest_path else (event.src_path,)
    return all(is_temp_name(os.path.basename(os.fsdecode(p))) for p in paths)


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: TierWatcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.watcher._on_event(event)


class TierWatcher:
    """Watches every tier root and keeps the catalog in line with it.

    Parameters
    ----------
    settle_s:
        How long a relpath must be quiet before it is reconciled.
    backend:
        ``"auto"`` (inotify, else polling with a logged reason), ``"inotify"`` or ``"polling"``.
    poll_interval_s:
        Interval of the polling backend.
    reconcile_files_per_s:
        Pace of full reconciles (after an overflow or a restart, and the periodic ones).
    remote_reconcile_s:
        Interval of the full reconcile that stands in for events on tiers that have none
        (object stores have no inotify), paced like the others. Only when such a tier exists.
    """

    def __init__(
        self,
        catalog: Catalog,
        tiers: Tiers,
        *,
        settle_s: float = 1.0,
        backend: str = "auto",
        poll_interval_s: float = 1.0,
        reconcile_files_per_s: float | None = 20_000,
        remote_reconcile_s: float = 300.0,
        damage: DamageLog | None = None,
    ) -> None:
        if backend not in ("auto", "inotify", "polling"):
            raise ValueError(f"unknown watch backend {backend!r}")
        self.catalog = catalog
        self.tiers = tiers
        self.damage = damage or DamageLog()
        self.settle_s = settle_s
        self.backend = backend
        self.poll_interval_s = poll_interval_s
        self.reconcile_files_per_s = reconcile_files_per_s
        self._ours = owned_by_this_host(catalog)
        self._status = WatcherStatus()
        self._cond = threading.Condition()
        self._dirty: dict[str, float] = {}  # relpath -> monotonic time it becomes due
        self._renames: list[tuple[str, str, str]] = []  # (tier, old relpath, new relpath)
        self._prefixes: dict[tuple[str, str], float] = {}  # (tier, dir relpath) -> due
        self._full_reason: str | None = None
        self._stopping = False
        self._observer: BaseObserver | None = None
        self._worker: threading.Thread | None = None
        self._spy = _OverflowSpy(self)
        watched = ((t, t.watch_root()) for t in tiers)
        self._local = [(t, root) for t, root in watched if root is not None]
        self._roots = sorted(
            ((str(root.resolve()), t) for t, root in self._local), key=lambda rt: -len(rt[0])
        )
        self.remote_reconcile_s = remote_reconcile_s
        self._has_remote = len(self._local) < len(tiers)
        self._next_remote = time.monotonic() + remote_reconcile_s

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        logging.getLogger("watchdog.observers.inotify_c").addHandler(self._spy)
        logging.getLogger("watchdog.observers.inotify").addHandler(self._spy)
        self._start_observer()
        self._worker = threading.Thread(target=self._run, name="tierd-watcher", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._worker is not None:
            self._worker.join()
            self._worker = None
        self._stop_observer()
        logging.getLogger("watchdog.observers.inotify_c").removeHandler(self._spy)
        logging.getLogger("watchdog.observers.inotify").removeHandler(self._spy)
        self._status.healthy = False

    def _start_observer(self) -> None:
        observer: BaseObserver
        reason = None
        if self.backend == "polling":
            observer, name = PollingObserver(timeout=self.poll_interval_s), "polling"
            reason = "polling asked for by configuration"
        else:
            try:
                from watchdog.observers.inotify import InotifyObserver

                observer, name = InotifyObserver(), "inotify"
            except (ImportError, OSError) as exc:
                if self.backend == "inotify":
                    raise
                reason = f"inotify unavailable ({exc}); polling every {self.poll_interval_s}s"
                log.warning("file watcher: %s", reason)
                observer, name = PollingObserver(timeout=self.poll_interval_s), "polling"
        handler = _Handler(self)
        try:
            for _tier, root in self._local:
                observer.schedule(handler, str(root), recursive=True, event_filter=_EVENTS)
            observer.start()
        except OSError as exc:
            # e.g. fs.inotify.max_user_watches too low for the tree: fall back, say why.
            observer.stop()
            if name == "polling" or self.backend == "inotify":
                raise
            reason = f"inotify failed to watch the tiers ({exc}); polling instead"
            log.warning("file watcher: %s", reason)
            observer, name = PollingObserver(timeout=self.poll_interval_s), "polling"
            for _tier, root in self._local:
                observer.schedule(handler, str(root), recursive=True, event_filter=_EVENTS)
            observer.start()
        self._observer = observer
        self._status.backend, self._status.reason, self._status.healthy = name, reason, True

    def _stop_observer(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join()
            self._observer = None

    # -- inputs ------------------------------------------------------------------------------
    def request_full_reconcile(self, reason: str) -> None:
        """Reconcile every tier (paced) as soon as the worker is free."""
        with self._cond:
            self._full_reason = reason
            self._cond.notify_all()

    def overflowed(self) -> None:
        self._status.overflows += 1
        log.warning("file watcher lost events (queue overflow): reconciling every tier")
        self.request_full_reconcile("event queue overflow")

    def status(self) -> WatcherStatus:
        with self._cond:
            self._status.pending = len(self._dirty) + len(self._renames) + len(self._prefixes)
            self._status.healthy = bool(
                self._observer is not None
                and self._observer.is_alive()
                and self._worker is not None
                and self._worker.is_alive()
            )
            return WatcherStatus(**self._status.as_dict())

    def _locate(self, path: str | bytes) -> tuple[Tier, str] | None:
        p = os.fsdecode(path)
        for root, tier in self._roots:
            if p.startswith(root + os.sep):
                rel = p[len(root) + 1 :]
                packed = packed_relpath(rel)  # a container of the tier's: the file it holds
                if packed is not None:
                    return tier, packed
                # The copies directory holds caches of other tiers' files, not the tier's own.
                return None if is_reserved(rel) else (tier, rel)
        return None

    def _on_event(self, event: FileSystemEvent) -> None:
        if not event.is_directory and _temp_only(event):
            return  # a writer's temp file (a move's, an upload's): the worker would drop it
        src = self._locate(event.src_path)
        dest = self._locate(event.dest_path) if event.dest_path else None
        now = time.monotonic()
        due = now + self.settle_s
        with self._cond:
            self._status.events += 1
            self._status.last_event_at = time.time()
            if event.is_directory:
                # Files inside a directory moved or deleted as a whole send no events of their
                # own (moves *within* a watch do, as sub-events): look at what the catalog has
                # under it. A directory moved in arrives as created sub-events.
                for loc in (src, dest):
                    if loc is not None and loc[1]:
                        self._prefixes[(loc[0].name, loc[1])] = due
            else:
                for loc in (src, dest):
                    if loc is not None and not is_temp_name(Path(loc[1]).name):
                        self._dirty[loc[1]] = due
                if (
                    isinstance(event, FileMovedEvent)
                    and src is not None
                    and dest is not None
                    and src[0] is dest[0]
                    and not is_temp_name(Path(src[1]).name)
                    and not is_temp_name(Path(dest[1]).name)
                ):
                    self._renames.append((src[0].name, src[1], dest[1]))
            self._cond.notify_all()

    # -- the worker --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    if self._full_reason is not None:
                        break
                    now = time.monotonic()
                    if self._has_remote and now >= self._next_remote:
                        self._next_remote = now + self.remote_reconcile_s
                        self._full_reason = "periodic reconcile of the object-store tiers"
                        break
                    dues = list(self._dirty.values()) + list(self._prefixes.values())
                    if dues and min(dues) <= now:
                        break
                    wait = min(dues) - now if dues else 1.0
                    self._cond.wait(timeout=max(0.01, min(wait, 1.0)))
                    self._check_observer()
                if self._stopping:
                    return
                full, self._full_reason = self._full_reason, None
                now = time.monotonic()
                due_paths = [p for p, t in self._dirty.items() if t <= now]
                due_prefixes = [k for k, t in self._prefixes.items() if t <= now]
                renames, self._renames = self._renames, []
                for p in due_paths:
                    del self._dirty[p]
                for k in due_prefixes:
                    del self._prefixes[k]
            try:
                if full is not None:
                    self._full_reconcile(full)
                else:
                    self._apply(renames, due_paths, due_prefixes)
            except Exception:
                log.exception("file watcher failed to reconcile; retrying shortly")
                with self._cond:
                    retry = time.monotonic() + max(self.settle_s, 1.0)
                    for p in due_paths:
                        self._dirty.setdefault(p, retry)
                    self._renames[:0] = renames

    def _check_observer(self) -> None:
        """Called with the lock held: a dead observer is restarted, and events it may have
        missed are made up for with a full reconcile."""
        if self._stopping or self._observer is None or self._observer.is_alive():
            return
        log.warning("file watcher's observer stopped; restarting it")
        self._status.restarts += 1
        self._stop_observer()
        try:
            self._start_observer()
        except OSError as exc:
            self._status.healthy = False
            self._status.reason = f"cannot restart the observer: {exc}"
            return
        self._full_reason = "observer restart"

    def _apply(
        self,
        renames: list[tuple[str, str, str]],
        paths: list[str],
        prefixes: list[tuple[str, str]],
    ) -> None:
        settled_before = time.time() - self.settle_s
        for tier, old, new in renames:
            rec = self.catalog.find(old)
            if rec is None or not self._ours(rec):
                continue  # nothing to rename, or another host's record: reconciled below
            try:
                if self.catalog.rename(old, new, tier) is not None:
                    self._status.applied["renamed"] += 1
                    log.info("renamed in tier %s: %s -> %s", tier, old, new)
            except TierdError as exc:
                log.warning("could not record rename %s -> %s: %s", old, new, exc)
        wanted = set(paths)
        for tier_name, prefix in prefixes:
            after = 0
            while True:
                page = self.catalog.page(tier=tier_name, prefix=prefix + "/", after_id=after)
                if not page:
                    break
                wanted.update(r.relpath for r in page if r.state != FileState.MISSING)
                after = page[-1].id
        # A file whose mtime is younger than the settle time is still being written by someone
        # who does not close it between writes: look again later.
        young = {p for p in wanted if self._mtime_after(p, settled_before)}
        if young:
            with self._cond:
                due = time.monotonic() + self.settle_s
                for p in young:
                    self._dirty.setdefault(p, due)
        report = reconcile_paths(
            self.catalog, self.tiers, sorted(wanted - young), damage=self.damage
        )
        self._count(report)
        # A moving file is looked at again once its move is over; a damaged one is not (it
        # stays quarantined until it changes, and a change is an event of its own).
        moving = [p for p in report.skipped if report.reasons.get(p) == "moving"]
        if moving:
            with self._cond:
                due = time.monotonic() + self.settle_s
                for p in moving:
                    self._dirty.setdefault(p, due)
        self._status.last_reconcile_at = time.time()

    def _mtime_after(self, relpath: str, when: float) -> bool:
        for tier in self.tiers:
            try:
                st = tier.stat(relpath) if relpath else None
            except IntegrityError:
                continue  # damaged: the reconcile says so
            if st is not None and st.mtime_ns / 1e9 > when:
                return True
        return False

    def _full_reconcile(self, reason: str) -> None:
        t0 = time.monotonic()
        report = scan(
            self.catalog,
            self.tiers,
            max_files_per_s=self.reconcile_files_per_s,
            damage=self.damage,
        )
        self._count(report)
        self._status.last_full_reconcile_at = self._status.last_reconcile_at = time.time()
        self._status.last_full_reconcile_reason = reason
        self._status.last_full_reconcile_seconds = time.monotonic() - t0
        log.info(
            "full reconcile (%s) took %.2fs: %s", reason, time.monotonic() - t0, report.summary()
        )

    def _count(self, report: ScanReport) -> None:
        a = self._status.applied
        a["adopted"] += len(report.adopted)
        a["changed"] += len(report.changed)
        a["moved"] += len(report.moved)
        a["missing"] += len(report.missing)
        a["conflicts"] += len(report.conflicts)
        a["renamed"] += len(report.renamed)
