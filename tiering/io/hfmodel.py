"""Hugging Face model directories: which files are a model's weights, and whether its index
and shards agree. Pure functions of names and bytes: no CUDA, no catalog, no I/O of their own.

A *model* is a directory that directly holds safetensors weights (``*.safetensors``); its name
is the directory's relpath, e.g. ``models/llama-3-8b``. Its weights are either

- every ``*.safetensors`` file in it, in name order, when it has no index; or
- the shards that its index names, where it has one: ``model.safetensors.index.json``
  (transformers' name), or else the one ``*.safetensors.index.json`` it holds (diffusers'
  ``diffusion_pytorch_model.safetensors.index.json``, for one). Weights the index does not
  name are not part of the model, as for ``from_pretrained`` (some repositories ship a
  ``consolidated.safetensors`` beside the shards).

An index is JSON: ``{"metadata": {...}, "weight_map": {tensor: shard file}}``. It is checked
here before anything is read: JSON, its shape, shard names that stay inside the directory,
every shard present, and no tensor mapped twice to different shards (``json`` keeps the last
of two equal keys silently; this module does not). Once the shards' headers are read,
:func:`check_unique_tensors` checks that no tensor is in two shards and that every tensor
lies where the weight map says. Every problem is an :class:`~tiering.errors.InvalidModel`
that names it: the server answers it with a 422.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tiering.errors import InvalidInput, InvalidModel

__all__ = [
    "CANONICAL_INDEX",
    "INDEX_SUFFIX",
    "MAX_INDEX_BYTES",
    "WEIGHTS_SUFFIX",
    "ModelLayout",
    "check_unique_tensors",
    "find_index",
    "is_index",
    "is_weights",
    "layout",
    "model_name",
    "parse_index",
    "select_tensors",
]

WEIGHTS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"
CANONICAL_INDEX = "model.safetensors.index.json"
#: The index of a 1-trillion-parameter model is a few MiB; more is a mistake or an attack.
MAX_INDEX_BYTES = 64 << 20
# How many names an error message lists before it says "and N more".
_SHOW = 5


def is_weights(name: str) -> bool:
    """Whether a file name is safetensors weights."""
    return name.endswith(WEIGHTS_SUFFIX) and name != WEIGHTS_SUFFIX


def is_index(name: str) -> bool:
    """Whether a file name is a safetensors index."""
    return name.endswith(INDEX_SUFFIX) and name != INDEX_SUFFIX


def model_name(relpath: str) -> str | None:
    """The model a file of weights makes its directory: the directory's relpath, or None
    when ``relpath`` is no weights file or lies at a tier's root (a model is a directory)."""
    directory, _, base = relpath.rpartition("/")
    return directory if directory and is_weights(base) else None


def _names(items: Iterable[str]) -> str:
    items = list(items)
    shown = ", ".join(items[:_SHOW])
    return shown + (f" and {len(items) - _SHOW} more" if len(items) > _SHOW else "")


@dataclass(frozen=True)
class ModelLayout:
    """Where a model's tensors are.

    Attributes
    ----------
    name:
        The model's name (its directory's relpath).
    shards:
        The weight files to load, relative to the model's directory, in load order.
    weight_map:
        Tensor name → shard file, from the index; None for a model without one.
    index_file:
        The index's file name, or None.
    """

    name: str
    shards: tuple[str, ...]
    weight_map: Mapping[str, str] | None = field(default=None, hash=False)
    index_file: str | None = None

    @property
    def tensor_count(self) -> int | None:
        """Tensors the index names (None without an index: only the headers know)."""
        return None if self.weight_map is None else len(self.weight_map)


class _Object(dict[str, Any]):
    """A JSON object that remembers keys given twice with different values."""

    clashes: list[tuple[str, Any, Any]]


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    obj.clashes = []
    for key, value in pairs:
        if key in obj and obj[key] != value:
            obj.clashes.append((key, obj[key], value))
        obj[key] = value
    return obj


def _bad_shard_name(shard: object) -> str | None:
    """Why ``shard`` cannot be a shard's file name, or None when it can."""
    if not isinstance(shard, str):
        return f"{shard!r} is not a string"
    if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
        return f"{shard!r} is not a file name in the model's directory"
    if not is_weights(shard):
        return f"{shard!r} is not a {WEIGHTS_SUFFIX} file"
    return None


def parse_index(
    data: bytes, *, present: Collection[str], index_file: str = CANONICAL_INDEX
) -> dict[str, str]:
    """Validate a safetensors index and return its weight map (tensor → shard file name).

    Parameters
    ----------
    data:
        The index file's bytes.
    present:
        Names of the files in the model's directory; every shard must be one of them.
    index_file:
        The index's name, for messages.

    Raises
    ------
    InvalidModel
        Bytes that are not UTF-8 JSON, or too many of them; no ``weight_map`` object, or an
        empty one; a shard name that is not a ``.safetensors`` file in the directory; a tensor
        mapped to two shards; a shard that is not present (named, with how many tensors the
        map puts in it).
    """
    if len(data) > MAX_INDEX_BYTES:
        raise InvalidModel(
            f"{index_file} is {len(data)} bytes, over the {MAX_INDEX_BYTES} byte limit",
            index_file=index_file,
        )
    try:
        doc = json.loads(data.decode("utf-8-sig"), object_pairs_hook=_object)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidModel(
            f"{index_file} is not UTF-8 JSON ({exc})", index_file=index_file
        ) from exc
    except RecursionError as exc:
        raise InvalidModel(f"{index_file} nests too deeply", index_file=index_file) from exc
    if not isinstance(doc, _Object):
        raise InvalidModel(f"{index_file} is not a JSON object", index_file=index_file)
    if any(key == "weight_map" for key, _, _ in doc.clashes):
        raise InvalidModel(f"{index_file} has two different weight maps", index_file=index_file)
    wmap = doc.get("weight_map")
    if not isinstance(wmap, _Object):
        got = "nothing" if wmap is None else type(wmap).__name__
        raise InvalidModel(
            f"{index_file}: weight_map must be an object of tensor name → shard file, got {got}",
            index_file=index_file,
        )
    if not wmap:
        raise InvalidModel(f"{index_file}: weight_map names no tensor", index_file=index_file)
    if wmap.clashes:
        tensor, first, second = wmap.clashes[0]
        raise InvalidModel(
            f"{index_file}: tensor {tensor!r} is mapped twice, to {first!r} and to {second!r}",
            index_file=index_file,
            tensor=tensor,
            shards=[first, second],
        )
    metadata = doc.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidModel(f"{index_file}: metadata must be an object", index_file=index_file)
    for tensor, shard in wmap.items():
        why = _bad_shard_name(shard)
        if why is not None:
            raise InvalidModel(
                f"{index_file}: tensor {tensor!r} maps to {why}",
                index_file=index_file,
                tensor=tensor,
            )
    counts: dict[str, int] = {}
    for shard in wmap.values():
        counts[shard] = counts.get(shard, 0) + 1
    have = set(present)
    missing = {s: n for s, n in sorted(counts.items()) if s not in have}
    if missing:
        listed = _names(f"{s} ({n} tensor{'s' if n != 1 else ''})" for s, n in missing.items())
        raise InvalidModel(
            f"{index_file} names {len(missing)} shard(s) that are not in the model: {listed}",
            index_file=index_file,
            missing=missing,
        )
    return dict(wmap)


def find_index(files: Collection[str]) -> str | None:
    """The index of a directory holding ``files``: ``model.safetensors.index.json``, else the
    only ``*.safetensors.index.json``; None without one.

    Raises
    ------
    InvalidModel
        Several indexes and none of them ``model.safetensors.index.json``: which one is the
        model is not for tierd to guess.
    """
    if CANONICAL_INDEX in files:
        return CANONICAL_INDEX
    found = sorted(f for f in files if is_index(f))
    if len(found) > 1:
        raise InvalidModel(
            f"several indexes and none is {CANONICAL_INDEX}: {_names(found)}", indexes=found
        )
    return found[0] if found else None


def layout(name: str, files: Collection[str], read_index: Callable[[str], bytes]) -> ModelLayout:
    """The layout of model ``name`` whose directory directly holds ``files`` (file names).

    With an index (see :func:`find_index`), ``read_index(file_name)`` gives its bytes, which
    :func:`parse_index` checks; the shards are the files it names. Without one, the shards are
    every ``*.safetensors`` file, in name order.

    Raises
    ------
    InvalidModel
        No weights, or an index that does not validate; the message starts with the model.
    """
    try:
        index = find_index(files)
        if index is None:
            shards = tuple(sorted(f for f in files if is_weights(f)))
            if not shards:
                raise InvalidModel(f"no {WEIGHTS_SUFFIX} weights")
            return ModelLayout(name, shards)
        wmap = parse_index(read_index(index), present=files, index_file=index)
    except InvalidModel as exc:
        raise InvalidModel(f"model {name!r}: {exc.message}", model=name, **exc.details) from exc
    return ModelLayout(name, tuple(sorted(set(wmap.values()))), MappingProxyType(wmap), index)


def check_unique_tensors(
    headers: Mapping[str, Iterable[str]], weight_map: Mapping[str, str] | None
) -> None:
    """Check the tensors that the shards' headers hold against each other and the weight map.

    Parameters
    ----------
    headers:
        Shard file name → the tensor names in its header, for every shard of the layout.
    weight_map:
        The layout's weight map (None: there is no index, so only the first check applies).

    Raises
    ------
    InvalidModel
        A tensor in two shards (naming it and both shards); a weight map entry whose tensor
        is not in the header of the shard it names (naming it, and where it is, if anywhere).
        Entries naming a shard not in ``headers`` are not checked here.
    """
    owner: dict[str, str] = {}
    for shard, names in headers.items():
        for tensor in names:
            first = owner.setdefault(tensor, shard)
            if first != shard:
                raise InvalidModel(
                    f"tensor {tensor!r} is in two shards: {first} and {shard}",
                    tensor=tensor,
                    shards=[first, shard],
                )
    if weight_map is None:
        return
    wrong = [
        (tensor, shard, owner.get(tensor))
        for tensor, shard in weight_map.items()
        if shard in headers and owner.get(tensor) != shard
    ]
    if wrong:
        tensor, shard, actual = wrong[0]
        where = f"it is in {actual}" if actual is not None else "no shard has it"
        more = f" ({len(wrong)} entries are wrong)" if len(wrong) > 1 else ""
        raise InvalidModel(
            f"the weight map puts tensor {tensor!r} in {shard}, but that shard's header does "
            f"not hold it: {where}{more}",
            tensor=tensor,
            shard=shard,
            wrong=len(wrong),
        )


def select_tensors(
    available: Sequence[str], *, names: Sequence[str] | None = None, prefix: str | None = None
) -> list[str] | None:
    """The tensors to load: ``names``, the ones starting with ``prefix``, or None for all.

    Raises
    ------
    InvalidInput
        Both ``names`` and ``prefix``; a name that is not in ``available``; a prefix that no
        name starts with.
    """
    if names is not None and prefix is not None:
        raise InvalidInput("give names or prefix, not both")
    if names is not None:
        have = set(available)
        unknown = [n for n in names if n not in have]
        if unknown:
            raise InvalidInput(
                f"{len(unknown)} tensor(s) not in the model: {_names(map(repr, unknown))}",
                missing=unknown[:100],
            )
        return list(dict.fromkeys(names))
    if prefix is not None:
        chosen = [n for n in available if n.startswith(prefix)]
        if not chosen:
            raise InvalidInput(f"no tensor name starts with {prefix!r}", prefix=prefix)
        return chosen
    return None
