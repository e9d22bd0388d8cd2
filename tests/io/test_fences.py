"""Fences without a GPU: what a fence with nothing queued does, and the importing side's checks
of a handle (the copies themselves, their event and a second process waiting on it are
tests/serving/test_fences_gpu.py's, on the GPU machine)."""

from __future__ import annotations

import pytest

from tiering.errors import InvalidInput
from tiering.io import Device
from tiering.io.fences import Fence, wait_ready


def test_a_fence_is_for_gpu_copies() -> None:
    with pytest.raises(InvalidInput, match="GPU memory"):
        Fence(Device("cpu"))


def test_a_fence_that_queued_nothing_has_landed_at_its_seal() -> None:
    fence = Fence(Device("cuda", 0))
    assert fence.pending and fence.handle() is None  # not sealed: no event yet
    fence.seal()
    assert not fence.pending and fence.handle() is None and fence.seconds == 0.0
    seen: list[Fence] = []
    fence.then(seen.append)  # landed: runs at once
    assert seen == [fence]
    fence.wait()  # and again: nothing to wait for
    with pytest.raises(RuntimeError, match="sealed"):
        fence.queued(object(), lambda ok: None)


def test_a_fence_waited_on_before_its_seal_seals_itself() -> None:
    # A load that failed half-way waits for what it queued; with nothing queued, no event.
    fence = Fence(Device("cuda", 0))
    fence.wait()
    assert not fence.pending


def test_handles_without_an_event_need_no_wait() -> None:
    wait_ready([{"kind": "cuda_ipc", "offset": 0}, {"kind": "shm", "name": "tierd-x"}])
    wait_ready([])


@pytest.mark.parametrize(
    "ready",
    [
        {"kind": "cuda_ipc_event"},  # no handle
        {"kind": "cuda_ipc_event", "event_handle": "not base64!"},
        {"kind": "cuda_ipc_event", "event_handle": "AAAA", "device_index": "zero"},
        "an event",
    ],
)
def test_a_malformed_ready_event_is_refused(ready: object) -> None:
    with pytest.raises(InvalidInput, match="ready_event"):
        wait_ready([{"kind": "cuda_ipc", "ready_event": ready}])
