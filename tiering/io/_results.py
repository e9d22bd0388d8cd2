"""What reads into new arrays return: the array, and the :class:`IoReport` of how it was filled."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ._stats import IoReport

__all__ = ["BatchResult", "ReadResult"]


@dataclass(frozen=True)
class ReadResult:
    """An array that a call filled, and the :class:`IoReport` of how."""

    array: Any
    report: IoReport


class BatchResult(Mapping[Any, Any]):
    """``{path: array}`` for :meth:`GpuDirectStorage.load_models_batch`, with ``reports``."""

    def __init__(self, arrays: dict[Any, Any], reports: dict[Any, IoReport]) -> None:
        self._arrays = arrays
        self.reports = reports

    def __getitem__(self, key: Any) -> Any:
        return self._arrays[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)
