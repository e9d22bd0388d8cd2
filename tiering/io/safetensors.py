"""safetensors: header parsing (no torch needed) and the dtype mapping.

Format: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON mapping tensor names
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), an optional ``"__metadata__"`` string map, then the data.

Dtypes NumPy and CuPy have no type for (BF16, F8_*): returned as their raw bits, ``uint16``
or ``uint8`` arrays of the same shape, so no byte is reinterpreted behind the caller's back.
``LoadedTensors.dtypes`` gives every tensor's safetensors dtype. Two exceptions get the real
type: ``framework="torch"`` (torch has bfloat16 and float8 types, viewed without a copy) and
NumPy output when the ``ml_dtypes`` package is installed.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tiering.errors import InvalidDtype, InvalidInput, MalformedFile
from tiering.tiers import pread_exact

from ._stats import IoReport

__all__ = [
    "DTYPES",
    "Framework",
    "LoadedTensors",
    "SafetensorsHeader",
    "TensorInfo",
    "parse_header",
    "read_header",
    "select_tensors",
]

# safetensors' own limit; a larger length is a corrupt or hostile file.
MAX_HEADER_BYTES = 100_000_000

Framework = Literal["auto", "numpy", "cupy", "torch"]


@dataclass(frozen=True)
class _Dtype:
    storage: str  # NumPy dtype of the bytes as returned without an extension type
    exact: str | None = None  # ml_dtypes / torch name when ``storage`` is only the raw bits


DTYPES: Mapping[str, _Dtype] = {
    "BOOL": _Dtype("bool"),
    "U8": _Dtype("uint8"),
    "I8": _Dtype("int8"),
    "U16": _Dtype("uint16"),
    "I16": _Dtype("int16"),
    "F16": _Dtype("float16"),
    "BF16": _Dtype("uint16", "bfloat16"),
    "U32": _Dtype("uint32"),
    "I32": _Dtype("int32"),
    "F32": _Dtype("float32"),
    "U64": _Dtype("uint64"),
    "I64": _Dtype("int64"),
    "F64": _Dtype("float64"),
    "C64": _Dtype("complex64"),
    "F8_E4M3": _Dtype("uint8", "float8_e4m3fn"),
    "F8_E5M2": _Dtype("uint8", "float8_e5m2"),
    "F8_E8M0": _Dtype("uint8", "float8_e8m0fnu"),
}
"""safetensors dtype → how tierd returns it."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: dtype (safetensors name), shape and absolute byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed and validated header."""

    path: Path
    file_size: int
    data_start: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)


def _fail(path: Path, why: str) -> MalformedFile:
    return MalformedFile(f"{path}: not a valid safetensors file: {why}", path=str(path))


#: The first read of a header takes this much, so a typical header (a few KiB to a few hundred
#: KiB of JSON) costs one request on a remote file, not two.
_FIRST_READ = 256 << 10

ReadAt = Callable[[int, int], bytes]
"""``read(n, offset)``: up to ``n`` bytes at ``offset``, fewer only at the end of the file."""


def read_header(path: str | os.PathLike[str], fd: int | None = None) -> SafetensorsHeader:
    """Read and validate the header of a safetensors file (by path, or through ``fd``).

    Raises
    ------
    MalformedFile
        Truncated or oversized header, bad JSON, a bad entry, or offsets outside the file.
    InvalidDtype
        A dtype tierd does not know.
    """
    own = fd is None
    if fd is None:
        fd = os.open(Path(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        return parse_header(path, size, functools.partial(pread_exact, fd))
    finally:
        if own:
            os.close(fd)


def parse_header(path: str | os.PathLike[str], size: int, read: ReadAt) -> SafetensorsHeader:
    """Read and validate the header of a ``size`` byte safetensors file through ``read``
    (a local file's ``pread``, or ranged reads of a remote one); see :func:`read_header`."""
    p = Path(path)
    head = read(min(size, _FIRST_READ), 0)
    if len(head) < 8:
        raise _fail(p, f"{size} bytes is too short for the 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise _fail(p, f"header length {n} is over the {MAX_HEADER_BYTES} byte limit")
    if 8 + n > size:
        raise _fail(p, f"header of {n} bytes runs past the end of the {size} byte file")
    raw = head[8 : 8 + n]
    if len(raw) < n:
        raw += read(n - len(raw), len(head))
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(p, f"header is not UTF-8 JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _fail(p, "header is not a JSON object")
    data_start = 8 + n
    data_size = size - data_start
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _fail(p, "__metadata__ is not an object")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _entry(p, name, entry, data_start, data_size)
    return SafetensorsHeader(
        p, size, data_start, tensors, {str(k): str(v) for k, v in metadata.items()}
    )


def _entry(p: Path, name: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _fail(p, f"entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise _fail(p, f"entry {name!r} has no dtype")
    if dtype not in DTYPES:
        raise InvalidDtype(
            f"{p}: tensor {name!r} has dtype {dtype!r}, which tierd does not support "
            f"(supported: {', '.join(DTYPES)})",
            dtype=dtype,
        )
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise _fail(p, f"entry {name!r} has a bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise _fail(p, f"entry {name!r} has bad data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise _fail(
            p,
            f"tensor {name!r} spans [{begin}, {end}) outside the {data_size} byte data section",
        )
    expected = math.prod(shape) * np.dtype(DTYPES[dtype].storage).itemsize
    if end - begin != expected:
        raise _fail(
            p,
            f"tensor {name!r} has {end - begin} bytes; shape {shape} of {dtype} needs {expected}",
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


class LoadedTensors(Mapping[str, Any]):
    """``{name: array}`` from one or more shards, plus what it cost.

    Attributes
    ----------
    dtypes:
        Every tensor's safetensors dtype name (``"BF16"``, ...), since raw-bit arrays do not
        carry it (see the module docstring).
    reports:
        One :class:`~tiering.io.IoReport` per shard, by path.
    """

    def __init__(
        self, tensors: dict[str, Any], dtypes: dict[str, str], reports: dict[Path, IoReport]
    ) -> None:
        self._tensors = tensors
        self.dtypes = dtypes
        self.reports = reports

    def __getitem__(self, name: str) -> Any:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.reports.values())

    def __repr__(self) -> str:
        return f"<LoadedTensors {len(self)} tensors from {len(self.reports)} shard(s)>"


def _optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def convert(arr: Any, dtype: str, framework: str) -> Any:
    """Turn a raw-bit array into the framework's array with the best dtype it has."""
    spec = DTYPES[dtype]
    if framework == "torch":
        torch = importlib.import_module("torch")
        t = torch.from_dlpack(arr)
        if spec.exact is not None:
            t = t.view(getattr(torch, spec.exact))
        return t
    if spec.exact is not None and isinstance(arr, np.ndarray):
        ml = _optional("ml_dtypes")
        if ml is not None and hasattr(ml, spec.exact):
            return arr.view(getattr(ml, spec.exact))
    return arr


def select_tensors(
    headers: Sequence[SafetensorsHeader], names: Iterable[str] | None
) -> list[list[str]]:
    """The tensors ``names`` selects (all when None) from each shard, sorted per shard.

    Raises
    ------
    InvalidInput
        A tensor is in two shards, or a name is in none.
    """
    owner: dict[str, Any] = {}
    for h in headers:
        for name in h.tensors:
            if name in owner:
                raise InvalidInput(
                    f"tensor {name!r} is in both {owner[name]} and {h.path}", tensor=name
                )
            owner[name] = h.path
    wanted = set(owner) if names is None else set(names)
    missing = sorted(wanted - owner.keys())
    if missing:
        raise InvalidInput(
            f"tensor(s) not in any shard: {', '.join(missing[:10])}", missing=missing
        )
    return [sorted(n for n in h.tensors if n in wanted) for h in headers]
