"""tierd's data path: files into GPU (``cuda:N``) or host (``cpu``) memory, fast.

Importing this package needs neither CUDA, CuPy nor KvikIO: they are imported when a storage
for a GPU is created, behind a backend chooser (see :class:`GdsConfig`).

>>> from tiering.io import GpuDirectStorage
>>> with GpuDirectStorage("cpu") as gds, gds.open_file(path) as f:  # doctest: +SKIP
...     result = gds.read(f)
...     result.array, result.report.io_path, result.report.gbps
"""

from __future__ import annotations

from ._config import BackendName, GdsConfig, TierIo
from ._copies import CopyFile, peer_access
from ._decode_gpu import available as gpu_decode_available
from ._device import Device, import_cupy, parse_device
from ._file import GdsFile
from ._results import BatchResult, ReadResult
from ._shards import ShardLayout, TransferRanges
from ._stats import SOURCES, GdsStatsSnapshot, IoPath, IoReport, LoadSource, PathStats, Stats
from ._storage import GpuDirectStorage
from ._write import TMP_SUFFIX
from .hfmodel import ModelLayout
from .safetensors import LoadedTensors, SafetensorsHeader, TensorInfo, read_header
from .state_dict import load_state_dict
from .target import LoadTarget

__all__ = [
    "TMP_SUFFIX",
    "BackendName",
    "BatchResult",
    "CopyFile",
    "LoadSource",
    "SOURCES",
    "peer_access",
    "Device",
    "GdsConfig",
    "GdsFile",
    "GdsStatsSnapshot",
    "GpuDirectStorage",
    "IoPath",
    "IoReport",
    "LoadTarget",
    "LoadedTensors",
    "ModelLayout",
    "PathStats",
    "ReadResult",
    "SafetensorsHeader",
    "ShardLayout",
    "Stats",
    "TensorInfo",
    "TierIo",
    "TransferRanges",
    "load_state_dict",
    "gpu_decode_available",
    "import_cupy",
    "parse_device",
    "read_header",
]
