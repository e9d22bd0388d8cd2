"""Models as a unit: Hugging Face model directories found in the catalog, shown, loaded,
prefetched and pinned whole.

A model is a directory that directly holds safetensors weights (the rules, and the checks of
an index, are :mod:`tiering.io.hfmodel`'s); its files are the files directly in it (weights,
index, config, tokenizer), never those of its subdirectories, which may be models of their
own. The catalog is the only source: a model is found by its records, not by listing a tier.

Loads reuse the safetensors load (:mod:`tiering.serving.safetensors`): the shards are opened
once, their headers checked against each other and the weight map before any budget is
reserved, and then loaded concurrently into one lease per shard; on any error nothing stays
leased. A prefetch is one job over every file of the model. A pin pins every file in one
catalog transaction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

from sqlalchemy import ColumnElement, select

from tiering.catalog import FileRecord, FileState
from tiering.engine import Engine
from tiering.errors import InvalidModel, ModelNotFound, Unavailable
from tiering.io import Device, GdsFile, ModelLayout
from tiering.io.hfmodel import (
    MAX_INDEX_BYTES,
    check_unique_tensors,
    is_index,
    is_weights,
    layout,
    model_name,
    select_tensors,
)
from tiering.io.safetensors import parse_header
from tiering.io.target import LoadTarget
from tiering.serving.context import LoadContext
from tiering.serving.devices import place
from tiering.serving.jobs import Job, JobTable
from tiering.serving.prefetch import start_prefetch
from tiering.serving.safetensors import TensorsLoaded
from tiering.serving.sharded import DeviceLoaded, load_devices
from tiering.tiers.paths import validate_relpath

__all__ = ["ModelInfo", "ModelSummary", "Models", "model_info", "model_names", "summarize"]


def _after(prefix: str) -> str | None:
    """The least string above every string that starts with ``prefix`` (None: none is)."""
    for i in range(len(prefix) - 1, -1, -1):
        if ord(prefix[i]) < 0x10FFFF:
            return prefix[:i] + chr(ord(prefix[i]) + 1)
    return None


def _under(prefix: str) -> list[ColumnElement[bool]]:
    """SQL conditions for "relpath starts with ``prefix``": a range of the relpath index,
    exact and case-sensitive (SQLite's LIKE is neither)."""
    conds: list[ColumnElement[bool]] = [FileRecord.relpath >= prefix]
    upper = _after(prefix)
    if upper is not None:
        conds.append(FileRecord.relpath < upper)
    return conds


@dataclass(frozen=True)
class ModelSummary:
    """A model's numbers, as the list shows them. Heat and tiers are those of its weights."""

    name: str
    files: int
    total_bytes: int
    weight_files: int
    weight_bytes: int
    tiers: dict[str, int]  # tier → bytes of weights there, fastest first
    heat_sum: float
    heat_max: float
    pinned_tier: str | None  # where every file is pinned, if all are pinned to one tier
    pinned_files: int
    has_index: bool


@dataclass(frozen=True)
class ModelInfo:
    """A model and the records of the files directly in its directory, by relpath."""

    name: str
    files: tuple[FileRecord, ...]

    def file_name(self, rec: FileRecord) -> str:
        return rec.relpath[len(self.name) + 1 :]

    @property
    def weights(self) -> list[FileRecord]:
        return [r for r in self.files if is_weights(self.file_name(r))]

    def role(self, rec: FileRecord) -> str:
        """``weights``, ``index`` or ``other`` (config, tokenizer, ...)."""
        name = self.file_name(rec)
        return "weights" if is_weights(name) else "index" if is_index(name) else "other"


def model_names(engine: Engine, prefix: str | None = None) -> list[str]:
    """Every model's name in ``engine``'s catalog (starting with ``prefix``), sorted."""
    q = select(FileRecord.relpath).where(
        FileRecord.relpath.like("%.safetensors"), FileRecord.state != FileState.MISSING
    )
    if prefix:
        q = q.where(*_under(prefix))
    with engine.catalog.db.read() as s:
        relpaths = list(s.scalars(q))
    found = set()
    for rel in relpaths:
        name = model_name(rel)
        if name is not None and name.startswith(prefix or ""):
            found.add(name)
    return sorted(found)


def model_info(engine: Engine, name: str) -> ModelInfo:
    """The records of the files directly in directory ``name`` (a model or not)."""
    with engine.catalog.db.read() as s:
        recs = list(
            s.scalars(select(FileRecord).where(*_under(name + "/")).order_by(FileRecord.relpath))
        )
    cut = len(name) + 1
    return ModelInfo(name, tuple(r for r in recs if "/" not in r.relpath[cut:]))


def summarize(engine: Engine, info: ModelInfo) -> ModelSummary:
    """A model's totals; heat (decayed to now) and tiers are those of its weights."""
    weights = info.weights
    heats = [engine.heat(r) for r in weights]
    per_tier: dict[str, int] = {}
    for r in weights:
        per_tier[r.tier] = per_tier.get(r.tier, 0) + r.size
    order = {t.name: t.rank for t in engine.tiers}
    pins = {r.pinned_tier for r in info.files}
    return ModelSummary(
        name=info.name,
        files=len(info.files),
        total_bytes=sum(r.size for r in info.files),
        weight_files=len(weights),
        weight_bytes=sum(r.size for r in weights),
        tiers=dict(sorted(per_tier.items(), key=lambda kv: order.get(kv[0], len(order)))),
        heat_sum=sum(heats),
        heat_max=max(heats, default=0.0),
        pinned_tier=next(iter(pins)) if len(pins) == 1 else None,
        pinned_files=sum(r.pinned_tier is not None for r in info.files),
        has_index=any(info.role(r) == "index" for r in info.files),
    )


class Models:
    """The model operations of a :class:`~tiering.serving.Loader` (``loader.models``)."""

    def __init__(self, ctx: LoadContext, jobs: JobTable) -> None:
        self._ctx = ctx
        self._jobs = jobs

    # -- finding models ----------------------------------------------------------------------
    def names(self, prefix: str | None = None) -> list[str]:
        """Every model's name (starting with ``prefix``), sorted."""
        return model_names(self._ctx.engine, prefix)

    def page(
        self, *, prefix: str | None = None, after: str | None = None, limit: int = 100
    ) -> tuple[list[ModelInfo], bool]:
        """Up to ``limit`` models after the name ``after``, by name, and whether more follow."""
        names = [n for n in self.names(prefix) if after is None or n > after]
        return [model_info(self._ctx.engine, n) for n in names[:limit]], len(names) > limit

    def get(self, name: str) -> ModelInfo:
        """One model and its files.

        Raises
        ------
        InvalidPath
            ``name`` is not a relpath.
        ModelNotFound
            No directory of that name directly holds safetensors weights.
        """
        validate_relpath(name)
        info = model_info(self._ctx.engine, name)
        if not any(r.state != FileState.MISSING for r in info.weights):
            raise ModelNotFound(
                f"no model {name!r}: no directory of that name directly holds "
                "*.safetensors weights",
                model=name,
            )
        return info

    def summary(self, info: ModelInfo) -> ModelSummary:
        return summarize(self._ctx.engine, info)

    def layout(self, name: str) -> tuple[ModelInfo, ModelLayout]:
        """A model and where its tensors are; its index (if any) read and checked.

        Raises
        ------
        InvalidModel
            An index that does not validate (named, with the problem).
        """
        info = self.get(name)
        live = {info.file_name(r): r for r in info.files if r.state != FileState.MISSING}
        return info, layout(name, live.keys(), lambda index: self._read_small(live[index]))

    def _read_small(self, rec: FileRecord) -> bytes:
        if rec.size > MAX_INDEX_BYTES:
            raise InvalidModel(
                f"{rec.relpath} is {rec.size} bytes, over the {MAX_INDEX_BYTES} byte limit "
                "of an index",
                path=rec.relpath,
            )
        ctx = self._ctx
        with ctx.open(rec.id, ctx.storage(ctx.device("cpu"))) as (f, _id):
            return f.read_bytes(f.size(), 0)

    # -- acting on a model -------------------------------------------------------------------
    @overload
    def load(
        self,
        name: str,
        *,
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        device: str | Device = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        wait: bool = True,
    ) -> TensorsLoaded: ...

    @overload
    def load(
        self,
        name: str,
        *,
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        device: LoadTarget,
        ttl_s: float | None = None,
        shared: bool = False,
        wait: bool = True,
    ) -> list[DeviceLoaded]: ...

    def load(
        self,
        name: str,
        *,
        names: Sequence[str] | None = None,
        prefix: str | None = None,
        device: str | Device | LoadTarget = "cpu",
        ttl_s: float | None = None,
        shared: bool = False,
        wait: bool = True,
    ) -> TensorsLoaded | list[DeviceLoaded]:
        """Load a model's tensors (all, the ``names`` given, or those starting with
        ``prefix``) into one lease per shard, the shards concurrently.

        ``device`` is one device, or a :class:`~tiering.io.target.LoadTarget`: several
        devices, or a tensor-parallel sharding, as for
        :meth:`tiering.serving.Loader.load_safetensors` (one entry per device is returned).

        ``shared``: read-only leases, handed out again from resident shards (see
        :meth:`tiering.serving.Loader.load`). ``wait``: as for
        :meth:`tiering.serving.Loader.load_safetensors`.

        Raises
        ------
        ModelNotFound, InvalidPath
        InvalidModel
            A bad index; a tensor in two shards; a weight map entry its shard does not hold.
        InvalidInput
            Both ``names`` and ``prefix``; a name not in the model; a prefix no name has.
        InvalidSharding, InvalidDevice
            As for :meth:`tiering.serving.Loader.load_safetensors`.
        InsufficientSpace
            Over the device's lease budget.
        """
        target = LoadTarget.of(device)
        info, lay = self.layout(name)
        by_name = {info.file_name(r): r for r in info.files}
        refs: list[int | str] = [by_name[s].id for s in lay.shards]
        out = load_devices(
            self._ctx,
            refs,
            place(self._ctx, target),
            names=None,
            ttl_s=ttl_s,
            shared=shared,
            select=self._selector(lay, names, prefix),
            wait=wait,
        )
        return out if isinstance(device, LoadTarget) else out[0].loaded

    @staticmethod
    def _selector(
        lay: ModelLayout, names: Sequence[str] | None, prefix: str | None
    ) -> Callable[[Sequence[GdsFile]], Sequence[str] | None]:
        def choose(shards: Sequence[GdsFile]) -> Sequence[str] | None:
            headers = {
                shard: parse_header(shard, f.size(), f.read_bytes).tensors
                for shard, f in zip(lay.shards, shards, strict=True)
            }
            try:
                check_unique_tensors(headers, lay.weight_map)
            except InvalidModel as exc:
                raise InvalidModel(
                    f"model {lay.name!r}: {exc.message}", model=lay.name, **exc.details
                ) from exc
            available = [t for tensors in headers.values() for t in tensors]
            return select_tensors(available, names=names, prefix=prefix)

        return choose

    def prefetch(
        self,
        name: str,
        *,
        target: str,
        device: str | Device | None = None,
        ttl_s: float | None = None,
    ) -> Job:
        """Warm every file of a model with one job (targets as for
        :meth:`tiering.serving.Loader.prefetch`)."""
        info = self.get(name)
        files: list[int | str] = [r.id for r in info.files if r.state != FileState.MISSING]
        return start_prefetch(
            self._ctx, self._jobs, files, target=target, device=device, ttl_s=ttl_s
        )

    def pin(self, name: str, tier: str | None = None) -> ModelInfo:
        """Pin every file of a model to ``tier``, in one transaction (all or none).

        The default tier is the one holding most of the model's weight bytes (the faster on a
        tie), so a model split across tiers is pinned whole to one of them, never file by file
        where each happens to be.

        Raises
        ------
        TierNotFound
        FileBusy
            A file is being migrated to another tier; nothing is pinned.
        """
        engine = self._ctx.engine
        info = self.get(name)
        if tier is None:
            summary = self.summary(info)
            tier = max(summary.tiers, key=lambda t: summary.tiers[t])  # dicts keep rank order
        engine.tiers.get(tier)
        recs = engine.journal.pin_many([r.id for r in info.files], tier)
        if any(r.tier != tier for r in recs):
            self._wake()
        return self.get(name)

    def unpin(self, name: str) -> ModelInfo:
        """Remove the pins of every file of a model, in one transaction."""
        info = self.get(name)
        self._ctx.engine.journal.pin_many([r.id for r in info.files], None)
        return self.get(name)

    def _wake(self) -> None:
        try:
            scheduler = self._ctx.engine.scheduler
        except Unavailable:
            return
        if scheduler.running:
            scheduler.wake()
