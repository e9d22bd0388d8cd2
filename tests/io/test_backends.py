"""The public surface, lazy imports, and the backend chooser's fallbacks and errors."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import tiering.io
from tiering.errors import BackendUnavailable
from tiering.io import GdsConfig, GpuDirectStorage


def test_public_names():
    assert sorted(tiering.io.__all__) == sorted(
        [
            "BackendName",
            "BatchResult",
            "CopyFile",
            "Device",
            "GdsConfig",
            "GdsFile",
            "GdsStatsSnapshot",
            "GpuDirectStorage",
            "IoPath",
            "IoReport",
            "LoadSource",
            "LoadTarget",
            "LoadedTensors",
            "ModelLayout",
            "PathStats",
            "ReadResult",
            "SOURCES",
            "SafetensorsHeader",
            "ShardLayout",
            "Stats",
            "TMP_SUFFIX",
            "TensorInfo",
            "TierIo",
            "TransferRanges",
            "gpu_decode_available",
            "import_cupy",
            "load_state_dict",
            "parse_device",
            "peer_access",
            "read_header",
        ]
    )
    for name in tiering.io.__all__:
        assert hasattr(tiering.io, name)


def test_import_and_cpu_use_need_no_cuda_stack(tmp_path):
    """With cupy, kvikio and torch unimportable, tiering.io imports and reads on cpu."""
    (tmp_path / "f").write_bytes(b"abc")
    code = (
        "import sys\n"
        "for m in ('cupy', 'kvikio', 'torch', 'ml_dtypes'): sys.modules[m] = None\n"
        "from tiering.io import GpuDirectStorage\n"
        "from tiering.errors import BackendUnavailable\n"
        f"g = GpuDirectStorage('cpu')\n"
        f"f = g.open_file({str(tmp_path / 'f')!r})\n"
        "assert g.read(f).array.tobytes() == b'abc'\n"
        "f.close(); g.close()\n"
        "assert not GpuDirectStorage.is_available()\n"
        "try:\n    GpuDirectStorage('cuda:0')\nexcept BackendUnavailable as e:\n"
        "    assert 'pip install' in str(e)\nelse:\n    raise SystemExit('no error')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("backend", ["kvikio", "gds"])
def test_explicit_missing_backend_raises_with_hint(monkeypatch, backend):
    monkeypatch.setitem(sys.modules, "kvikio", None)
    with pytest.raises(BackendUnavailable, match="pip install"):
        GpuDirectStorage("cpu", GdsConfig(backend=backend))


def test_cpu_auto_uses_host_backend():
    with GpuDirectStorage("cpu") as g:
        assert g.backend == "host"
        assert "cpu" in g.backend_reason


@pytest.mark.gpu
def test_cuda_auto_falls_back_to_host_and_says_why(monkeypatch, caplog, tmp_path):
    monkeypatch.setitem(sys.modules, "kvikio", None)
    (tmp_path / "f").write_bytes(b"x" * 5000)
    with caplog.at_level(logging.WARNING, logger="tiering.io"):
        g = GpuDirectStorage("cuda:0")
    with g, g.open_file(tmp_path / "f") as f:
        assert g.backend == "host" and "KvikIO is not installed" in g.backend_reason
        assert any("falling back" in r.getMessage() for r in caplog.records)
        assert g.read(f).report.io_path == "host"


@pytest.mark.gpu
def test_cuda_auto_reports_the_path_that_ran(tmp_path):
    pytest.importorskip("kvikio")
    (tmp_path / "f").write_bytes(b"y" * 10_000)
    with GpuDirectStorage("cuda:0") as g, g.open_file(tmp_path / "f") as f:
        assert g.backend == "kvikio"
        report = g.read(f).report
        # Without nvidia-fs (the H100 test machine) the compat path must be taken and said.
        expected = "gds" if GpuDirectStorage.is_available() else "compat"
        assert report.io_path == expected == f.io_path
        assert g.stats().by_path[expected].bytes_transferred == 10_000


@pytest.mark.gpu
def test_explicit_gds_without_nvidia_fs_raises():
    pytest.importorskip("kvikio")
    if GpuDirectStorage.is_available():
        pytest.skip("this host has GDS")
    with pytest.raises(BackendUnavailable, match="GDS is not available"):
        GpuDirectStorage("cuda:0", GdsConfig(backend="gds"))


@pytest.mark.gpu
def test_the_driver_gives_the_uuid_the_runtime_gives():
    """gpu_uuid asks the driver (cuDeviceGetUuid_v2), not cudaGetDeviceProperties: the same
    16 bytes for every visible device, as nvidia-smi -L prints them."""
    import cupy as cp

    from tiering.io._device import _driver_uuid, gpu_uuid

    for i in range(cp.cuda.runtime.getDeviceCount()):
        raw = cp.cuda.runtime.getDeviceProperties(i)["uuid"]
        want = bytes(raw).hex() if not isinstance(raw, str) else raw.encode("latin-1").hex()
        assert _driver_uuid(i) == want
        assert gpu_uuid(i).replace("-", "")[3:] == want
