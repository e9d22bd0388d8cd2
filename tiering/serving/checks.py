"""Checks of a load request against its file: the dtype, the byte range and the shape.

They run before anything is reserved or allocated, so bad input costs nothing to undo.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiering.errors import InvalidDtype, InvalidInput, InvalidRange

__all__ = ["check_range", "check_shape", "parse_dtype"]


def parse_dtype(spec: str) -> np.dtype[Any]:
    """A plain numeric NumPy dtype in native byte order.

    Raises
    ------
    InvalidDtype
    """
    try:
        dt: np.dtype[Any] = np.dtype(spec)
    # NumPy parses comma strings ("i4,f8") with ast: "," is a SyntaxError, not a TypeError.
    except (TypeError, ValueError, SyntaxError) as exc:
        raise InvalidDtype(f"not a dtype: {spec!r}", dtype=str(spec)) from exc
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise InvalidDtype(f"dtype {spec!r} is not a plain numeric dtype", dtype=str(spec))
    if dt.byteorder not in ("=", "|") and dt.byteorder != np.dtype(dt.name).byteorder:
        raise InvalidDtype(f"dtype {spec!r} is not in this host's byte order", dtype=str(spec))
    return dt


def check_shape(nbytes: int, dt: np.dtype[Any], shape: Sequence[int] | None) -> tuple[int, ...]:
    """The shape of ``nbytes`` of ``dt`` items: ``shape`` (one ``-1`` filled in) or flat.

    Raises
    ------
    InvalidDtype
        ``nbytes`` is not a whole number of items.
    InvalidInput
        ``shape`` does not hold exactly that many items.
    """
    if nbytes % dt.itemsize:
        raise InvalidDtype(
            f"{nbytes} bytes is not a whole number of {dt.name} items ({dt.itemsize} bytes each)",
            dtype=dt.name,
            length=nbytes,
        )
    items = nbytes // dt.itemsize
    if shape is None:
        return (items,)
    dims = [int(d) for d in shape]
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        raise InvalidInput(f"bad shape {list(shape)}: sizes >= 0, at most one -1")
    if -1 in dims:
        rest = math.prod(d for d in dims if d != -1)
        if rest == 0 or items % rest:
            raise InvalidInput(f"shape {dims} does not fit {items} items of {dt.name}")
        dims[dims.index(-1)] = items // rest
    if math.prod(dims) != items:
        raise InvalidInput(
            f"shape {dims} holds {math.prod(dims)} items but the range has {items} "
            f"items of {dt.name}",
            items=items,
        )
    return tuple(dims)


def check_range(offset: int, length: int | None, size: int) -> int:
    """The length of ``[offset, offset + length)`` (``None``: to the end) in a ``size`` file.

    Raises
    ------
    InvalidRange
    """
    if offset < 0 or offset > size:
        raise InvalidRange(f"offset {offset} is outside the {size} byte file", size=size)
    n = size - offset if length is None else length
    if n < 0 or offset + n > size:
        raise InvalidRange(
            f"range [{offset}, {offset + n}) is outside the {size} byte file", size=size
        )
    return n
