"""Waiting for reads that write into a caller's memory."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any

__all__ = ["settle"]


def settle(futures: Sequence[Future[Any]]) -> list[Any]:
    """Results of every future, in order; on a failure the others are cancelled or waited for
    (none may still write into a caller's buffer) and the first error is raised."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f in done and f.exception() is not None), None)
    if failed is not None:
        for f in futures:
            f.cancel()
        wait(futures)
        exc = failed.exception()
        assert exc is not None
        raise exc
    return [f.result() for f in futures]
