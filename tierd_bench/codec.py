"""``tierd bench codec``: tierd's compressed format on this host's CPU (issue 29).

On a synthetic bf16 checkpoint (Normal(0, 0.02) weights, as trained transformer weights are
distributed, in a safetensors file of a few tensors), it reports:

- the ratio of stored to logical bytes;
- CPU encode and decode in GB/s of logical (model) bytes and of stored bytes, on one core
  and on every core (chunks spread over a thread pool: zstd releases the GIL);
- in the same run, a plain read of the same logical bytes from the page cache, the path a
  compressed tier replaces;
- on a GPU (``--device``), loads into it: plain, decoded on the GPU by nvCOMP, and decoded on
  the host (:mod:`tierd_bench._codec_gpu`).

Every decode is checked equal to the input.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from ._codec_tiers import tier_reads
from ._measure import MiB, default_device, format_size, gbps, timed
from ._origin import OriginUnavailable
from ._report import BenchRow, Report

if TYPE_CHECKING:
    from tiering.codec import Kind

#: Each chunk's kind and stored bytes (as parts), in order.
Chunks = list[tuple["Kind", list[bytes]]]

__all__ = ["OriginUnavailable", "encode_work", "run", "synthetic_bf16"]


def synthetic_bf16(size: int, *, seed: int = 29, tensors: int = 4) -> bytes:
    """A safetensors file of about ``size`` bytes: ``tensors`` bf16 tensors of Normal(0, 0.02)
    values (float32 draws rounded to nearest-even bf16), header padded to 8 bytes."""
    rng = np.random.default_rng(seed)
    per = max(1, size // 2 // tensors)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs = []
    at = 0
    for t in range(tensors):
        f = rng.standard_normal(per, dtype=np.float32) * np.float32(0.02)
        bits = f.view(np.uint32)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
        header[f"layers.{t}.weight"] = {
            "dtype": "BF16",
            "shape": [per],
            "data_offsets": [at, at + 2 * per],
        }
        blobs.append(bf16.tobytes())
        at += 2 * per
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(blobs)


def run(
    size: int = 256 * MiB,
    *,
    repeats: int = 3,
    threads: int | None = None,
    device: str = "cpu",
    origin: str | None = None,
    rate: int | None = 100_000_000,
    connections: int | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> Report:
    """Measure the codec on a ``size``-byte synthetic bf16 checkpoint (see the module); with a
    ``cuda:N`` device (``auto``: one when there is a GPU), also loads into it
    (:mod:`tierd_bench._codec_gpu`); with an ``origin``, loads of it plain and compressed from
    a bucket into the device (:mod:`tierd_bench._codec_objects`)."""
    from tiering.codec import CHUNK, CODEC, LEVEL, encode_bytes

    if size < CHUNK or repeats < 1:
        raise ValueError(f"size must be at least {format_size(CHUNK)}, repeats at least 1")
    cores = threads or os.cpu_count() or 1
    device = default_device() if device == "auto" else device
    setup = {"size_bytes": size, "repeats": repeats, "threads": cores, "codec": CODEC}
    setup["device"] = device
    setup |= {"zstd_level": LEVEL, "chunk_bytes": CHUNK, "weights": "Normal(0, 0.02) bf16"}
    report = Report(
        "codec",
        f"tierd bench codec: {format_size(size)} bf16 checkpoint, CPU, {cores} threads, "
        f"medians of {repeats}",
        setup,
    )
    say("making the checkpoint")
    data = synthetic_bf16(size)
    stored = encode_bytes(data)
    ratio = len(stored) / len(data)
    setup["stored_bytes"] = len(stored)
    report.add(BenchRow("ratio", "stored / logical bytes", ratio, "x", target="<= 0.72"))
    report.rows["ratio"].met = ratio <= 0.72
    _cpu_rows(report, data, stored, cores, repeats, say)
    say("reading through tiers")
    tier_reads(report, data, repeats, say)
    report.compare("read_compressed", "read_raw")
    if device.startswith("cuda"):
        from ._codec_gpu import gpu_rows

        gpu_rows(report, data, device, repeats, say)
    if origin is not None:
        from ._codec_objects import object_rows

        object_rows(
            report,
            data,
            stored,
            device,
            repeats,
            origin=origin,
            rate=rate,
            connections=connections,
            say=say,
        )
    return report


def encode_work(
    data: bytes,
) -> Callable[[ThreadPoolExecutor | None], Chunks]:
    """The work both encode rows time, on this thread (``None``) or spread over a pool: every
    chunk's encoding, the :class:`~tiering.codec.Encoder`'s own step, with its thread's
    compressor (each chunk's count of 2-byte elements taken beforehand, off the clock). It
    returns each chunk's kind and stored bytes, in order, for the bench to check that both
    rows made the same chunks, and the Encoder's."""
    import zstandard

    from tiering.codec import CHUNK, LEVEL, encode_chunk, two_byte_spans

    view = memoryview(data)
    spans = two_byte_spans(data)
    starts = range(0, len(data), CHUNK)
    counts = {s: sum(max(0, min(e, s + CHUNK) - max(b, s)) for b, e in spans) for s in starts}
    local = threading.local()

    def encode_one(start: int) -> tuple[Kind, list[bytes]]:
        cctx = getattr(local, "cctx", None)
        if cctx is None:
            cctx = local.cctx = zstandard.ZstdCompressor(level=LEVEL)
        return encode_chunk(cctx, view[start : start + CHUNK], counts[start])

    def work(pool: ThreadPoolExecutor | None) -> Chunks:
        return list(map(encode_one, starts) if pool is None else pool.map(encode_one, starts))

    return work


def _cpu_rows(
    report: Report,
    data: bytes,
    stored: bytes,
    cores: int,
    repeats: int,
    say: Callable[[str], None],
) -> None:
    """Encode and decode on the CPU, on one core and on ``cores`` threads."""
    from tiering.codec import CHUNK, Container

    starts = range(0, len(data), CHUNK)
    encode = encode_work(data)
    made: dict[str, Chunks] = {}

    out = bytearray(len(data))
    out_view = memoryview(out)

    def decode(pool: ThreadPoolExecutor | None) -> None:
        c = Container.open("bench", lambda n, off: stored[off : off + n], len(stored))
        jobs = [(out_view[s : s + CHUNK], s) for s in starts]
        if pool is None:
            for v, s in jobs:
                c.readinto(v, s)
        else:
            list(pool.map(lambda j: c.readinto(*j), jobs))

    with ThreadPoolExecutor(cores, "tierd-bench-codec") as pool:
        say("encoding")
        t1 = timed(lambda: made.__setitem__("1", encode(None)), repeats)
        tn = timed(lambda: made.__setitem__("n", encode(pool)), repeats)
        say("decoding")
        d1 = timed(lambda: decode(None), repeats)
        dn = timed(lambda: decode(pool), repeats)
    if bytes(out) != data:
        raise AssertionError("the decoded bytes differ from the checkpoint")
    index = Container.open("bench", lambda n, off: stored[off : off + n], len(stored)).index
    if made["1"] != made["n"] or [(k, sum(map(len, p))) for k, p in made["1"]] != [
        (e.kind, e.length) for e in index
    ]:
        raise AssertionError("the encode rows made other chunks than each other or the Encoder")
    for key, label, secs in (
        ("encode_1", "encode, 1 core", t1),
        ("encode_all", f"encode, {cores} threads", tn),
        ("decode_1", "decode, 1 core", d1),
        ("decode_all", f"decode, {cores} threads", dn),
    ):
        note = f"{gbps(len(stored), secs):.2f} GB/s of stored bytes"
        report.add(
            BenchRow(key, f"{label} (model bytes)", gbps(len(data), secs), "GB/s", note=note)
        )
    report.compare("encode_all", "encode_1")
    report.compare("decode_all", "decode_1")
