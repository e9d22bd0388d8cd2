"""Tensor-parallel sharding arithmetic: which slice of which tensor each rank gets, and the
byte ranges of a safetensors file that hold it. Pure functions, no I/O, no CUDA.

A spec splits tensors across ``world_size`` ranks::

    {"world_size": 2, "rules": [{"pattern": "*.q_proj.weight", "dim": 0}], "strict": false}

The first rule whose ``fnmatch`` pattern matches a tensor's name says the dimension to split;
a tensor no rule matches is replicated (every rank gets all of it). ``strict`` makes a pattern
that matches none of the loaded tensors an error (a typo in a pattern otherwise silently
replicates the weights it meant to split).

Uneven sizes follow ``torch.chunk``: with ``n`` elements along the split dimension,
``chunk = ceil(n / world_size)`` and rank ``k`` gets ``[k * chunk, min(n, (k + 1) * chunk))``.
The last ranks may get fewer elements, or none: ``n = 5`` over 4 ranks gives 2, 2, 1, 0
(``torch.chunk`` then returns only 3 chunks; rank 3's slice is empty, shape ``(0, ...)``).
A world size larger than the dimension is refused rather than handing out empty slices to
most ranks.

A slice along dimension 0 is one contiguous byte range of the tensor. Along dimension
``d > 0`` it is ``prod(shape[:d])`` row segments of ``(stop - start) * prod(shape[d+1:])``
elements each, one per outer index; :meth:`TensorSlice.byte_ranges` lists them (adjacent ones
merged), and :meth:`TensorSlice.whole_range` gives the alternative, one read of the whole tensor
to slice after.

The checks run once, where the values are made: :func:`parse_sharding` checks a spec's own
fields, :func:`check_rank` a rank (both by :class:`~tiering.io.target.LoadTarget`, where a
request is parsed), and :func:`split` the spec against the tensors it splits, as it computes
every rank's slices. A load takes those slices and asks nothing more of this module.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiering.errors import InvalidSharding

__all__ = [
    "MAX_WORLD_SIZE",
    "ShardRule",
    "ShardingSpec",
    "TensorSlice",
    "check_rank",
    "check_spec",
    "chunk_bounds",
    "parse_sharding",
    "slice_of",
    "split",
]

#: Far above any host's GPU count; bounds the arithmetic a request can ask for.
MAX_WORLD_SIZE = 1024
#: A safetensors shape has at most this many dimensions in practice; bounds ``dim``.
MAX_DIM = 63
MAX_RULES = 256


@dataclass(frozen=True)
class ShardRule:
    """Split tensors whose name matches ``pattern`` (``fnmatch``) along ``dim``."""

    pattern: str
    dim: int


@dataclass(frozen=True)
class ShardingSpec:
    """A checked spec; make one with :func:`parse_sharding`."""

    world_size: int
    rules: tuple[ShardRule, ...]
    strict: bool = False

    def rule_for(self, name: str) -> ShardRule | None:
        """The first rule matching ``name``; None: the tensor is replicated."""
        for rule in self.rules:
            if fnmatch.fnmatchcase(name, rule.pattern):
                return rule
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rules": [{"pattern": r.pattern, "dim": r.dim} for r in self.rules],
            "strict": self.strict,
        }


def _int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSharding(f"{what} must be an integer, got {value!r}", field=what)
    if not lo <= value <= hi:
        raise InvalidSharding(f"{what} must be in [{lo}, {hi}], got {value}", field=what)
    return value


def parse_sharding(doc: ShardingSpec | Mapping[str, Any]) -> ShardingSpec:
    """Check a spec given as JSON (a mapping) and return it as a :class:`ShardingSpec`.

    Raises
    ------
    InvalidSharding
        A missing or mistyped field, ``world_size`` < 1, a negative ``dim``, an empty
        pattern, or an unknown key.
    """
    if isinstance(doc, ShardingSpec):
        doc = doc.to_json()
    if not isinstance(doc, Mapping):
        raise InvalidSharding(f"sharding must be an object, got {type(doc).__name__}")
    unknown = set(doc) - {"world_size", "rules", "strict"}
    if unknown:
        raise InvalidSharding(f"sharding has unknown field(s): {', '.join(sorted(unknown))}")
    if "world_size" not in doc:
        raise InvalidSharding("sharding needs world_size", field="world_size")
    world = _int(doc["world_size"], "world_size", 1, MAX_WORLD_SIZE)
    raw_rules = doc.get("rules", [])
    if not isinstance(raw_rules, Sequence) or isinstance(raw_rules, str | bytes):
        raise InvalidSharding("sharding.rules must be a list", field="rules")
    if len(raw_rules) > MAX_RULES:
        raise InvalidSharding(f"{len(raw_rules)} rules is over the limit of {MAX_RULES}")
    rules = []
    for i, r in enumerate(raw_rules):
        if not isinstance(r, Mapping) or set(r) != {"pattern", "dim"}:
            raise InvalidSharding(
                f"rules[{i}] must be an object with pattern and dim, got {r!r}", field="rules"
            )
        pattern = r["pattern"]
        if not isinstance(pattern, str) or not pattern:
            raise InvalidSharding(f"rules[{i}].pattern must be a non-empty string")
        rules.append(ShardRule(pattern, _int(r["dim"], f"rules[{i}].dim", 0, MAX_DIM)))
    strict = doc.get("strict", False)
    if not isinstance(strict, bool):
        raise InvalidSharding(f"sharding.strict must be a boolean, got {strict!r}")
    return ShardingSpec(world, tuple(rules), strict)


def check_rank(spec: ShardingSpec, rank: int) -> int:
    """``rank`` if it is one of the spec's ranks, else InvalidSharding."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < spec.world_size:
        raise InvalidSharding(
            f"rank must be in [0, {spec.world_size}) for world_size {spec.world_size}, "
            f"got {rank!r}",
            rank=str(rank),
        )
    return rank


def check_spec(spec: ShardingSpec, tensors: Mapping[str, Sequence[int]]) -> None:
    """Check ``spec`` against the tensors it will split (name → shape).

    Raises
    ------
    InvalidSharding
        A pattern that matches none of ``tensors`` (when strict); a matched tensor whose
        shape has no dimension ``dim``; a world size larger than that dimension.
    """
    used: set[int] = set()
    for name in sorted(tensors):
        shape = tuple(tensors[name])
        for i, rule in enumerate(spec.rules):
            if fnmatch.fnmatchcase(name, rule.pattern):
                used.add(i)
                _check_tensor(spec, name, shape, rule)
                break
    if spec.strict:
        # A later rule shadowed by an earlier one for every tensor also counts as unused.
        unmatched = [
            r.pattern
            for i, r in enumerate(spec.rules)
            if i not in used and not any(fnmatch.fnmatchcase(n, r.pattern) for n in tensors)
        ]
        if unmatched:
            raise InvalidSharding(
                f"sharding pattern(s) match no tensor (strict): {', '.join(unmatched[:10])}",
                patterns=", ".join(unmatched[:10]),
            )


def _check_tensor(spec: ShardingSpec, name: str, shape: tuple[int, ...], rule: ShardRule) -> None:
    if rule.dim >= len(shape):
        raise InvalidSharding(
            f"tensor {name!r} of shape {list(shape)} has no dimension {rule.dim} "
            f"(pattern {rule.pattern!r})",
            tensor=name,
            dim=rule.dim,
        )
    if spec.world_size > shape[rule.dim]:
        raise InvalidSharding(
            f"world_size {spec.world_size} is larger than dimension {rule.dim} "
            f"({shape[rule.dim]}) of tensor {name!r}",
            tensor=name,
            dim=rule.dim,
        )


def chunk_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s chunk of ``n`` elements (``torch.chunk``'s rule)."""
    if world_size < 1 or not 0 <= rank < world_size or n < 0:
        raise InvalidSharding(f"no chunk {rank} of {n} over {world_size} ranks")
    chunk = -(-n // world_size)
    start = min(n, rank * chunk)
    return start, min(n, start + chunk)


@dataclass(frozen=True)
class TensorSlice:
    """One rank's part of one tensor, and the bytes of the file that hold it.

    ``dim`` None: replicated (the whole tensor). ``offset`` is the slice's index in the full
    tensor (zero but along ``dim``); ``shape`` its shape; ``full_shape`` the tensor's.
    """

    name: str
    dim: int | None
    start: int
    stop: int
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    full_shape: tuple[int, ...]
    itemsize: int

    @classmethod
    def whole(cls, name: str, shape: Sequence[int], itemsize: int) -> TensorSlice:
        """All of a tensor (a replicated one, or a load without sharding)."""
        full = tuple(shape)
        return cls(name, None, 0, 0, full, (0,) * len(full), full, itemsize)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def segment_bytes(self) -> int:
        """Bytes of one contiguous row segment of the slice in the file."""
        if self.dim is None:
            return self.nbytes
        return (self.stop - self.start) * math.prod(self.full_shape[self.dim + 1 :]) * self.itemsize

    def byte_ranges(self, begin: int) -> list[tuple[int, int]]:
        """``(file_offset, nbytes)`` of the slice's bytes, in order, for a tensor whose data
        starts at ``begin``; adjacent ranges are merged. Empty slices have none."""
        if self.nbytes == 0:
            return []
        if self.dim is None:
            return [(begin, self.nbytes)]
        inner = math.prod(self.full_shape[self.dim + 1 :]) * self.itemsize
        row = self.full_shape[self.dim] * inner
        outer = math.prod(self.full_shape[: self.dim])
        seg = (self.stop - self.start) * inner
        first = begin + self.start * inner
        if seg == row:  # the whole dimension: the rows touch, one range
            return [(first, seg * outer)]
        return [(first + o * row, seg) for o in range(outer)]

    def whole_range(self, begin: int) -> tuple[int, int]:
        """``(file_offset, nbytes)`` of the one read that holds the slice: the whole tensor, to
        be cut with :meth:`cut_whole` (for dim 0 and replicated tensors, exactly the slice)."""
        if self.dim is None or self.dim == 0:
            ranges = self.byte_ranges(begin)
            return ranges[0] if ranges else (begin, 0)
        return begin, math.prod(self.full_shape) * self.itemsize

    def cut_whole(self, whole: Any) -> Any:
        """The slice's bytes (a strided view) from a flat ``uint8`` array (NumPy or CuPy) that
        holds what :meth:`whole_range` read; copy it into place with ``dst[...] = view``."""
        if self.dim is None or self.dim == 0:
            return whole.reshape(-1)
        inner = math.prod(self.full_shape[self.dim + 1 :]) * self.itemsize
        outer = math.prod(self.full_shape[: self.dim])
        rows = whole.reshape(outer, self.full_shape[self.dim] * inner)
        return rows[:, self.start * inner : self.stop * inner]


def slice_of(
    spec: ShardingSpec, name: str, shape: Sequence[int], itemsize: int, rank: int
) -> TensorSlice:
    """``rank``'s slice of tensor ``name`` (checked as :func:`check_spec` does)."""
    check_rank(spec, rank)
    rule = spec.rule_for(name)
    if rule is not None:
        _check_tensor(spec, name, tuple(shape), rule)
    return _slice(spec, name, tuple(shape), itemsize, rank)


def _slice(
    spec: ShardingSpec, name: str, full: tuple[int, ...], itemsize: int, rank: int
) -> TensorSlice:
    """``rank``'s slice of a tensor the spec was checked against."""
    rule = spec.rule_for(name)
    if rule is None:
        return TensorSlice.whole(name, full, itemsize)
    start, stop = chunk_bounds(full[rule.dim], spec.world_size, rank)
    part = full[: rule.dim] + (stop - start,) + full[rule.dim + 1 :]
    offset = tuple(start if i == rule.dim else 0 for i in range(len(full)))
    return TensorSlice(name, rule.dim, start, stop, part, offset, full, itemsize)


def split(
    spec: ShardingSpec | None,
    tensors: Mapping[str, tuple[Sequence[int], int]],
    ranks: Sequence[int | None],
) -> list[dict[str, TensorSlice]]:
    """Every rank's slice of every tensor (name → ``(shape, itemsize)``), by rank in the order
    of ``ranks``; the spec is checked against the tensors once, here (:func:`check_spec`).

    A rank ``None`` (or no spec) gets every tensor whole: the replicas of a load without
    sharding. The ranks themselves were checked where the spec was parsed.
    """
    if spec is not None:
        check_spec(spec, {name: shape for name, (shape, _size) in tensors.items()})
    return [
        {
            name: TensorSlice.whole(name, shape, size)
            if spec is None or rank is None
            else _slice(spec, name, tuple(shape), size, rank)
            for name, (shape, size) in tensors.items()
        }
        for rank in ranks
    ]
