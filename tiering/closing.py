"""One ``with`` shape for everything tierd opens: ``__enter__`` returns the object itself and
``__exit__`` calls its ``close()``.

Sources, writers, open files, storages, leases, moves and the client's buffers each spelled the
same two methods out; they inherit them here instead, so a class only says what closing means.
It sits at the bottom of the house (rank 1) because every room, and the client, opens things.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Closing"]


class Closing:
    """Mixin: a context manager whose exit is ``self.close()``; subclasses define ``close``."""

    def close(self) -> None:  # pragma: no cover - every subclass says what closing means
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
