"""The service pays each GPU's one-time costs at start (tiering.serving.warmup)."""

from __future__ import annotations

import pytest

from tests.conftest import LiveServer, _gpu_present


def _gpu() -> bool:
    # CUDA, not GDS proper (GpuDirectStorage.is_available()): the warm-up's own test.
    return _gpu_present()


def test_a_host_without_a_gpu_warms_nothing(server: LiveServer) -> None:
    if _gpu():
        pytest.skip("this host has a GPU: the GPU test below covers it")
    loader = server.server.config.app.state.loader  # type: ignore[attr-defined]
    assert loader.warm() == {}


@pytest.mark.gpu
def test_every_visible_gpu_is_warmed_at_start(server: LiveServer) -> None:
    if not _gpu():
        pytest.skip("needs a CUDA GPU")
    loader = server.server.config.app.state.loader  # type: ignore[attr-defined]
    warmed = loader.warm()
    assert "cuda:0" in warmed and warmed["cuda:0"] > 0
