"""A local Hugging Face model directory (or safetensors files) as a torch state dict, in-process.

>>> from tiering.io.state_dict import load_state_dict
>>> sd = load_state_dict("/nvme/models/all-MiniLM-L6-v2", device="cuda:0")  # doctest: +SKIP
>>> model.load_state_dict(sd, assign=True)                                   # doctest: +SKIP

The directory's layout (its index, or its ``*.safetensors`` files) is read and checked by
:mod:`tiering.io.hfmodel`, the shards' headers against each other and the index, and the
tensors are loaded by :meth:`GpuDirectStorage.load_safetensors` with ``framework="torch"``:
one allocation per shard, every tensor a view of it, with its exact dtype (bfloat16, float8).

No copy and no lease: ``torch.from_dlpack`` makes each tensor's storage own a reference to the
shard's NumPy or CuPy allocation, so the memory lives exactly as long as some tensor (or a
parameter or view made from one) still uses it. torch is imported only when this is called.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tiering.errors import FileNotFound, InvalidInput

from ._config import GdsConfig
from ._device import Device
from ._storage import GpuDirectStorage
from .hfmodel import check_unique_tensors, layout, select_tensors
from .safetensors import read_header

if TYPE_CHECKING:
    import torch

__all__ = ["load_state_dict", "model_shards"]

PathLike = str | os.PathLike[str]


def model_shards(model: PathLike | Sequence[PathLike]) -> list[Path]:
    """The safetensors files of ``model``, checked: a model directory, one file, or files.

    A directory's weights are what :func:`tiering.io.hfmodel.layout` says (its index's shards,
    or every ``*.safetensors`` file in it); the shards' headers must not share a tensor, and
    must hold every tensor where the index puts it.

    Raises
    ------
    FileNotFound
        No such directory or file.
    InvalidModel
        No weights, a bad index, or shards that disagree with each other or with the index.
    """
    return list(_resolve(model))


def _resolve(model: PathLike | Sequence[PathLike]) -> dict[Path, list[str]]:
    """Shard → the tensor names in its header."""
    if isinstance(model, (str, os.PathLike)):
        root = Path(model)
        if root.is_dir():
            files = [e.name for e in os.scandir(root) if e.is_file()]
            found = layout(str(root), files, lambda name: (root / name).read_bytes())
            headers = {s: list(read_header(root / s).tensors) for s in found.shards}
            check_unique_tensors(headers, found.weight_map)
            return {root / s: names for s, names in headers.items()}
        paths = [root]
    else:
        paths = [Path(p) for p in model]
    for p in paths:
        if not p.is_file():
            raise FileNotFound(f"{p}: no such model directory or safetensors file", path=str(p))
    return {p: list(read_header(p).tensors) for p in paths}


def load_state_dict(
    model: PathLike | Sequence[PathLike],
    device: str | int | Device | None = None,
    *,
    names: Sequence[str] | None = None,
    prefix: str | None = None,
    config: GdsConfig | None = None,
    storage: GpuDirectStorage | None = None,
) -> dict[str, torch.Tensor]:
    """Load a model's tensors (all, ``names``, or those starting with ``prefix``) as torch
    tensors on ``device``, without a copy; see the module docstring.

    Parameters
    ----------
    model:
        A Hugging Face model directory, one ``.safetensors`` file, or a list of them.
    device:
        ``cpu`` (the default) or ``cuda:N``; none with ``storage``, which has its own.
    names, prefix:
        Which tensors (at most one of the two); default all.
    config:
        I/O settings for the storage made for this load.
    storage:
        A :class:`GpuDirectStorage` to load through (its tiers, thread pools and stats), instead
        of one made and closed here.

    Raises
    ------
    FileNotFound, InvalidModel, MalformedFile, InvalidDtype, InvalidInput, InvalidDevice
    """
    try:
        import torch  # noqa: F401  (checked before anything is read)
    except ImportError as exc:
        raise InvalidInput("load_state_dict needs torch installed") from exc
    headers = _resolve(model)
    shards = list(headers)
    available = [n for names_in in headers.values() for n in names_in]
    selected = select_tensors(available, names=names, prefix=prefix)
    if storage is not None:
        if device is not None:
            raise InvalidInput("give device or storage (which has a device), not both")
        return dict(storage.load_safetensors(shards, selected, framework="torch"))
    with GpuDirectStorage("cpu" if device is None else device, config) as gds:
        return dict(gds.load_safetensors(shards, selected, framework="torch"))
