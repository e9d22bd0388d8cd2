"""One read of a file for the concurrent loads of this host that ask for the same bytes.

An engine starts one process per GPU, and every process of a replica group asks for the same
shards at about the same moment, each for its own device. Read independently, each of them
reads the whole checkpoint from the page cache or the disk, and on a busy host they share its
cores and memory bandwidth (two H200 processes reading one checkpoint got 20 GB/s each, where
one alone gets 35–40). :class:`SharedReads` makes the first of them the **leader**: it reads
the shard's ranges into its own buffer as it would have. A load that asks for the same ranges
of the same file while that read runs **follows** it: it waits for the bytes to land, then
copies the leader's buffer into its own, device to device (NVLink or PCIe with peer access,
hundreds of GB/s; a copy on the same GPU, a few TB/s) or device to host, and reports that copy
(source ``gpu`` or ``peer``). The leader hands its buffer to its client only once every
follower has copied out of it, so no client's write can reach another's bytes.

"The same bytes" is exact: the file's identity as opened (device, inode, size, times: a
rewritten file is another one) and the same planned reads into a buffer of the same layout.
Only reads that land before they return take part, from a local file; a memory tier's or a
resident copy is a copy already, a remote file pins its own version. A follower whose copy
would cross from host memory to a GPU, or between GPUs that cannot reach each other, reads for
itself. A leader that fails leaves its followers to read for themselves.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from tiering.io import (
    Device,
    GdsFile,
    GpuDirectStorage,
    IoReport,
    TransferRanges,
    import_cupy,
    peer_access,
)
from tiering.io.fences import Fence

__all__ = ["SharedReads"]

log = logging.getLogger(__name__)

Reads = Sequence[tuple[int, int, int]]


class _Read:
    """One leader's read in flight, and the followers copying out of its buffer."""

    def __init__(self, device: Device, dst: Any) -> None:
        self.device = device
        self.dst = dst
        self.ok = False
        self.landed = threading.Event()
        self.followers = 0
        self.cond = threading.Condition()

    def left(self) -> None:
        with self.cond:
            self.followers -= 1
            self.cond.notify_all()


class SharedReads:
    """The reads in flight of one service's loads; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads: dict[tuple[Any, ...], _Read] = {}
        #: Reads a load did not make because it followed another's (for tests and metrics).
        self.followed = 0

    def on(self, storage: GpuDirectStorage) -> TransferRanges:
        """The shard reads of one load into ``storage``'s device, shared with concurrent loads
        (see :meth:`GpuDirectStorage.load_safetensors_raw`'s ``transfer``)."""

        def transfer(f: GdsFile, fd: int, dst: Any, reads: Reads, fence: Fence | None) -> IoReport:
            return self.transfer(storage, f, fd, dst, reads, fence)

        return transfer

    def transfer(
        self,
        storage: GpuDirectStorage,
        f: GdsFile,
        fd: int,
        dst: Any,
        reads: Reads,
        fence: Fence | None,
    ) -> IoReport:
        """``reads`` of ``f`` into ``dst``: read here, or copied from a concurrent load's."""
        key = _key(f, fd, reads)
        if key is None:
            return storage.transfer_ranges(f, fd, dst, reads, fence)
        device = storage.device
        with self._lock:
            lead = self._reads.get(key)
            if lead is not None and _can_follow(lead.device, device):
                lead.followers += 1
            else:
                lead = None
                mine = self._reads[key] = _Read(device, dst)
        if lead is None:
            return self._lead(key, mine, storage, f, fd, dst, reads, fence)
        try:
            return self._follow(lead, storage, f, fd, dst, reads, fence)
        finally:
            lead.left()

    def _lead(
        self,
        key: tuple[Any, ...],
        read: _Read,
        storage: GpuDirectStorage,
        f: GdsFile,
        fd: int,
        dst: Any,
        reads: Reads,
        fence: Fence | None,
    ) -> IoReport:
        ok = False
        try:
            report = storage.transfer_ranges(f, fd, dst, reads, fence)
            ok = True
            return report
        finally:
            with self._lock:  # no follower joins once the bytes are in
                if self._reads.get(key) is read:
                    del self._reads[key]
                followed = read.followers
            if ok and followed and read.device.is_cuda:
                try:  # every byte on the device before a peer copies it
                    _synchronize(read.device)
                except Exception as exc:
                    log.warning("a shared read's device did not synchronise: %s", exc)
                    ok = False
            read.ok = ok
            read.landed.set()
            with read.cond:  # the buffer is the client's only once every follower is out
                read.cond.wait_for(lambda: read.followers == 0)

    def _follow(
        self,
        lead: _Read,
        storage: GpuDirectStorage,
        f: GdsFile,
        fd: int,
        dst: Any,
        reads: Reads,
        fence: Fence | None,
    ) -> IoReport:
        lead.landed.wait()
        if not lead.ok:
            return storage.transfer_ranges(f, fd, dst, reads, fence)
        n = max(at + size for _off, size, at in reads)
        with self._lock:
            self.followed += 1
        held = storage.open_copy(
            lead.dst[:n], lead.device, name=str(f.path), tier=f.tier, rank=f.rank
        )
        with held, held.guard() as copy_fd:
            return storage.transfer_ranges(held, copy_fd, dst, [(0, n, 0)])


def _key(f: GdsFile, fd: int, reads: Reads) -> tuple[Any, ...] | None:
    """The content a read gets: the opened file (a rewrite is another inode or time) and the
    ranges; None for what does not take part (no local descriptor, nothing to read)."""
    if fd < 0 or not reads or f.io_path == "copy":
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, tuple(reads))


def _can_follow(lead: Device, device: Device) -> bool:
    """Whether a copy out of ``lead``'s buffer beats reading: device to device or to host,
    never host memory (pageable) to a GPU, never between GPUs without peer access."""
    if not lead.is_cuda:
        return not device.is_cuda
    if not device.is_cuda or device.index == lead.index:
        return True
    try:
        return peer_access(device.index, lead.index)
    except Exception as exc:  # a copy it cannot make is no reason to fail the load
        log.debug("peer access cuda:%d -> cuda:%d: %s", device.index, lead.index, exc)
        return False


def _synchronize(device: Device) -> None:
    cp = import_cupy()
    with cp.cuda.Device(device.index):
        cp.cuda.runtime.deviceSynchronize()
