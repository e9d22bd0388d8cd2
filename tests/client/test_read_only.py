"""Read-only buffers in the client: what each interchange protocol says, and that torch still
takes them without a copy. Real shared-memory allocations (tiering.io.buffers), no server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tierd_client import Buffer
from tierd_client._buffers import _mark_read_only
from tiering.io import Device
from tiering.io.buffers import DeviceBuffer, allocate

DATA = np.arange(1000, dtype=np.float32)


@pytest.fixture
def shm() -> Iterator[DeviceBuffer]:
    buf = allocate(Device("cpu"), DATA.nbytes)
    buf.array()[: DATA.nbytes] = DATA.view(np.uint8)
    yield buf
    buf.free()


def _info(buf: DeviceBuffer, read_only: bool) -> dict[str, Any]:
    return {
        "buffer_id": "b1",
        "nbytes": DATA.nbytes,
        "device": "cpu",
        "dtype": "float32",
        "shape": [1000],
        "expires_at": "2030-01-01T00:00:00Z",
        "handle": {**buf.handle(), "read_only": read_only},
        "read_only": read_only,
        "source": "memory",
        "reused": True,
    }


def test_numpy_refuses_writes_to_a_read_only_buffer(shm: DeviceBuffer) -> None:
    b = Buffer(None, _info(shm, True))
    assert b.read_only and b.source == "memory" and b.reused
    a = np.asarray(b)
    assert np.array_equal(a, DATA) and not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 1
    assert b.__array_interface__["data"][1] is True
    assert memoryview(b.array).readonly
    assert not b.view(0, 8, "float32", [2]).flags.writeable
    # DLPack 1.0 consumers are told: NumPy's own import comes back read-only.
    via = np.from_dlpack(b)
    assert not via.flags.writeable and np.array_equal(via, DATA)
    b.close(release=False)


def test_a_plain_buffer_stays_writable(shm: DeviceBuffer) -> None:
    b = Buffer(None, _info(shm, False))
    assert not b.read_only
    np.asarray(b)[0] = 42.0
    assert shm.array()[:4].view(np.float32)[0] == 42.0
    b.close(release=False)


def test_torch_takes_a_read_only_buffer_without_a_copy(shm: DeviceBuffer) -> None:
    torch = pytest.importorskip("torch")
    b = Buffer(None, _info(shm, True))
    t = torch.from_dlpack(b)
    assert t.data_ptr() == b.__array_interface__["data"][0]
    assert torch.equal(t, torch.from_numpy(DATA))
    b.close(release=False)


def test_a_consumer_before_dlpack_1_gets_an_alias(shm: DeviceBuffer) -> None:
    """NumPy will not export a read-only array to a consumer that cannot be told so; the buffer
    exports the same memory writable (torch before DLPack 1.0 does not break)."""
    b = Buffer(None, _info(shm, True))
    with pytest.raises(BufferError):
        np.asarray(b).__dlpack__()
    capsule = b.__dlpack__()  # no max_version: an old consumer
    assert type(capsule).__name__ == "PyCapsule"
    b.close(release=False)


def test_mark_read_only_sets_the_dlpack_flag() -> None:
    class Export:
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __dlpack__(self, **kw: Any) -> Any:
            return _mark_read_only(self.a.__dlpack__(**kw))

        def __dlpack_device__(self) -> Any:
            return self.a.__dlpack_device__()

    src = np.arange(4, dtype=np.int32)
    assert np.from_dlpack(src).flags.writeable  # a writable array exports writable
    out = np.from_dlpack(Export(src))
    assert not out.flags.writeable and out.ctypes.data == src.ctypes.data
    # An unversioned capsule has no flags: it is returned as it is.
    legacy = Export(src).__dlpack__()
    assert type(legacy).__name__ == "PyCapsule"
