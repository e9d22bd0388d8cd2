"""The model operations of the loader in-process, over a real engine (real tiers, an
Alembic-built catalog): which directories are models, and pins that are all or nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import put
from tiering.catalog import FileState
from tiering.engine import Engine
from tiering.errors import FileBusy, InvalidPath, ModelNotFound
from tiering.serving import Loader


@pytest.fixture
def loader(eng: Engine) -> Iterator[Loader]:
    loader = Loader(eng).start()
    yield loader
    loader.stop()


def test_which_directories_are_models(eng: Engine, loader: Loader) -> None:
    for rel in [
        "m_1/model.safetensors",  # LIKE's wildcards in names are plain characters here
        "m%1/model.safetensors",
        "mX1/model.safetensors",
        "deep/a/b/model.safetensors",
        "deep/a/config.json",  # no weights directly in deep/a: not a model
        "top.safetensors",  # at a tier's root: no directory, no model
        "weird/model.SAFETENSORS",  # the suffix is case-sensitive, like relpaths
        "gone/model.safetensors",
    ]:
        put(eng, rel, b"x")
    eng.catalog.set_state([eng.lookup("gone/model.safetensors").id], FileState.MISSING)
    models = loader.models
    assert models.names() == ["deep/a/b", "m%1", "mX1", "m_1"]
    assert models.names("m_") == ["m_1"] and models.names("m%") == ["m%1"]
    assert models.names("deep/") == ["deep/a/b"] and models.names("zzz") == []
    infos, more = models.page(after="m%1", limit=1)
    assert [i.name for i in infos] == ["mX1"] and more
    for name in ["deep/a", "deep", "weird", "gone", "top.safetensors"]:
        with pytest.raises(ModelNotFound):
            models.get(name)
    with pytest.raises(InvalidPath):
        models.get("deep/../m_1")


def test_a_model_pin_is_one_transaction(eng: Engine, loader: Loader) -> None:
    ids = [
        put(eng, f"m/{name}", b"w" * size, tier).id
        for name, size, tier in [
            ("a.safetensors", 300, "nvme"),
            ("b.safetensors", 500, "ssd"),
            ("config.json", 10, "nvme"),
        ]
    ]
    # One file is being moved to hdd: pinning the model anywhere else pins nothing.
    claim = eng.mover.claim(ids[0], "hdd", reason="test")
    try:
        with pytest.raises(FileBusy, match="being migrated to hdd"):
            loader.models.pin("m", "nvme")
        assert [eng.get(i).pinned_tier for i in ids] == [None, None, None]
        # Its destination is fine: the move in flight carries on to where the pin says.
        info = loader.models.pin("m", "hdd")
        assert {r.pinned_tier for r in info.files} == {"hdd"}
    finally:
        eng.mover.run(claim)
    assert eng.get(ids[0]).tier == "hdd"
    # The default tier is the one holding most of the weights' bytes: b's 500 on ssd.
    assert {r.pinned_tier for r in loader.models.pin("m").files} == {"ssd"}
    assert {r.pinned_tier for r in loader.models.unpin("m").files} == {None}
