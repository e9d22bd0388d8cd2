"""fastsafetensors (0.5) as a peer of ``tierd bench models``, on the same checkpoint in one run.

fastsafetensors is the loader vLLM and SGLang ship for fast starts, so it is the first thing
users compare tierd against. Its ``SafeTensorsFileLoader`` reads whole shards into one device
buffer each (``nogds=True``: ``pread`` through pinned bounce buffers, here 16 threads x 16 MiB,
its defaults, given explicitly) and hands out tensors over it:

- **one device**: every tensor by ``get_tensor`` into this process, once with its default
  O_DIRECT policy (local files bypass the page cache, so a hot cache does not help it) and
  once buffered (``FASTSAFETENSORS_ODIRECT=0``). Quoting only the default on a hot cache would
  flatter tierd; quoting only buffered would hide what users get out of the box.
- **several GPUs** (:func:`rank_tensors`, run by :mod:`._peerranks`): one process per rank
  joined by ``torch.distributed``, each reading its share of the shards (shard ``i`` to rank
  ``i % world``), then ``get_sharded(name, 0)`` (TP: a dim-0 slice each, scattered) or
  ``get_tensor(name)`` (replicas: broadcast) for every tensor, buffered.

The callers check every load's tensors against the files' bytes after the clock stopped.
Optional: without fastsafetensors (``pip install 'tierd[bench]'``) or torch,
:func:`missing` says why and the caller fills the rows with that note.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["PIN", "load_one", "missing", "odirect", "rank_tensors", "torch_bytes", "version"]

Loaded = tuple[dict[str, Any], Callable[[], None]]

PIN = "fastsafetensors==0.5.*"
# No square brackets: the table's renderer (rich) would take "[bench]" for markup.
_INSTALL = "pip install fastsafetensors==0.5.*, in tierd's bench extra"
_THREADS = 16  # fastsafetensors' own defaults, named so the rows say what ran
_BBUF_KB = 16 << 10
_ODIRECT = "FASTSAFETENSORS_ODIRECT"


def missing() -> str | None:
    """Why fastsafetensors cannot run in this process (None: it can)."""
    # Looked up before anything is imported: torch alone takes a second or more to import.
    absent = [n for n in ("fastsafetensors", "torch") if importlib.util.find_spec(n) is None]
    if absent:
        return f"not installed ({_INSTALL}); missing {', '.join(absent)}"
    try:
        importlib.import_module("fastsafetensors")
    except Exception as exc:  # a wheel built for another platform or CUDA fails right here
        return f"fastsafetensors does not import: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def version() -> str:
    return str(getattr(importlib.import_module("fastsafetensors"), "__version__", "?"))


@contextlib.contextmanager
def odirect(direct: bool | None) -> Iterator[None]:
    """``FASTSAFETENSORS_ODIRECT`` while the block runs: ``None`` unset (its default policy,
    O_DIRECT on local disks), ``False`` buffered, ``True`` forced; restored after."""
    saved = os.environ.get(_ODIRECT)
    if direct is None:
        os.environ.pop(_ODIRECT, None)
    else:
        os.environ[_ODIRECT] = "1" if direct else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(_ODIRECT, None)
        else:
            os.environ[_ODIRECT] = saved


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        importlib.import_module("torch").cuda.synchronize(device)


def _loader(pg: Any, device: str) -> Any:
    fst = importlib.import_module("fastsafetensors")
    return fst.SafeTensorsFileLoader(
        pg if pg is not None else fst.SingleGroup(),
        device,
        nogds=True,  # GDS proper (nvidia-fs) is not on the GPU machines: its pread path
        max_threads=_THREADS,
        bbuf_size_kb=_BBUF_KB,
    )


def load_one(paths: Sequence[Path], device: str) -> Loaded:
    """Every tensor of ``paths`` on ``device`` as fastsafetensors gives it to one process
    (device synchronised), and what frees them: ``({name: torch.Tensor}, close)``."""

    def take(fb: Any, keys: list[str]) -> dict[str, Any]:
        tensors = {name: fb.get_tensor(name) for name in keys}
        _sync(device)
        return tensors

    return _copied(_loader(None, device), {0: [str(p) for p in paths]}, take)


def torch_bytes(t: Any) -> Any:
    """A tensor's bytes as a NumPy ``uint8`` array in host memory (any dtype, bf16 too)."""
    torch = importlib.import_module("torch")
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()


def rank_tensors(pg: Any, device: str, files: Mapping[int, list[str]], mode: str) -> Loaded:
    """One rank's round of a several-process load (see :mod:`._peerranks`): rank ``k`` reads
    ``files[k]``, then every tensor, in the same order on every rank (each call is a
    collective), by ``get_sharded(name, 0)`` (``tp``) or ``get_tensor(name)`` (``replicate``)."""

    def take(fb: Any, keys: list[str]) -> dict[str, Any]:
        return {
            name: fb.get_sharded(name, 0) if mode == "tp" else fb.get_tensor(name)
            for name in sorted(keys)
        }

    return _copied(_loader(pg, device), dict(files), take)


def _copied(
    loader: Any, files: dict[int, list[str]], take: Callable[[Any, list[str]], dict[str, Any]]
) -> Loaded:
    """``files`` copied to the device by ``loader``, the tensors ``take`` gets from them (given
    the buffer and the keys), and what frees them; the loader is closed on any failure."""
    try:
        loader.add_filenames(files)
        fb = loader.copy_files_to_device()
    except BaseException:
        loader.close()
        raise
    try:
        tensors = take(fb, list(loader.get_keys()))
    except BaseException:
        fb.close()
        loader.close()
        raise

    def close() -> None:
        tensors.clear()
        fb.close()
        loader.close()

    return tensors, close
