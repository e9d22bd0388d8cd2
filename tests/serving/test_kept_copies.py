"""A resident copy serves every load of its file, whatever load made it (issue 39, point 3).

A shared model load keeps each shard's tensors (not its header) as a read-only copy. Every other
load of those shards then copies from it: a whole file, a byte range, ``load_safetensors``
(all tensors, or some), ``load_state_dict``, ``models/load``; a shared load of a selection is
handed the same allocation. On ``cpu`` the copies are shared-memory segments, so the proof is
the stats: not one more byte from the page cache, and every load's bytes right. The same
rules on a GPU (source ``gpu``) are in ``test_residency_gpu.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.conftest import wait_for
from tests.serving.conftest import leased

torch = pytest.importorskip("torch")


def _model(tmp_path: Path) -> tuple[dict[str, np.ndarray], list[bytes]]:
    rng = np.random.default_rng(7)
    tensors = {
        "embed.weight": rng.standard_normal((256, 64)).astype(np.float32),
        "layer.0.bias": np.arange(300, dtype=np.int64),
        "layer.1.weight": rng.integers(0, 255, (33, 17), dtype=np.uint8),
        "lm_head.weight": rng.standard_normal((64, 128)).astype(np.float32),
    }
    blobs = []
    for i, names in enumerate(
        (["embed.weight", "layer.0.bias"], ["layer.1.weight", "lm_head.weight"])
    ):
        p = tmp_path / f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in names}, str(p))
        blobs.append(p.read_bytes())
    return tensors, blobs


def _page_cache_bytes(api) -> int:
    return int(api.stats()["by_source"].get("page_cache", {}).get("bytes_transferred", 0))


def test_every_load_of_a_kept_shard_copies_from_it(api, upload, tmp_path):
    tensors, blobs = _model(tmp_path)
    ids = [
        upload(f"models/k/model-0000{i + 1}-of-00002.safetensors", b) for i, b in enumerate(blobs)
    ]
    with api.load_model("models/k", shared=True) as kept:
        one_copy = leased(api)
        read = _page_cache_bytes(api)
        assert read > 0  # the first load read the shards

        # A whole file and a range of one: bytes copied out of the copy and its header.
        with api.load(ids[0]) as whole:
            assert whole.source == "memory" and whole.info["io_path"] == "copy"
            assert np.asarray(whole).tobytes() == blobs[0]
        with api.load(ids[1], offset=5, length=200) as part:
            assert part.info["io_path"] == "copy"
            assert np.asarray(part).tobytes() == blobs[1][5:205]
        # Tensors, all or some, of the shards and of the model, into new buffers.
        with api.load_safetensors(ids) as plain:
            assert not any(b.read_only for b in plain.buffers)
            for k, v in tensors.items():
                assert np.array_equal(plain[k], v), k
        with api.load_safetensors(ids, names=["lm_head.weight"]) as some:
            assert np.array_equal(some["lm_head.weight"], tensors["lm_head.weight"])
        with api.load_model("models/k") as model:
            for k, v in tensors.items():
                assert np.array_equal(model[k], v), k
        sd = api.load_state_dict("models/k")
        for k, v in tensors.items():
            assert torch.equal(sd[k], torch.from_numpy(v)), k
        del sd  # its leases are retired by the client's renewer thread, a moment later
        assert _page_cache_bytes(api) == read  # not one byte more from the files
        # Rows gathered from the file need it whole in host memory: read from the file.
        with api.gather(ids[0], dim=1, dtype="uint8", indices=[0, 1, 9, 200]) as rows:
            assert np.asarray(rows).ravel().tobytes() == bytes(blobs[0][i] for i in (0, 1, 9, 200))

        # A shared load of a selection is handed the kept allocation, at its tensors' offsets.
        wait_for(lambda: leased(api) == one_copy, what="the state dict's leases retired")
        with api.load_safetensors(ids, names=["layer.0.bias", "lm_head.weight"], shared=True) as s:
            assert all(b.reused for b in s.buffers)
            assert leased(api) == one_copy
            assert np.array_equal(s["layer.0.bias"], tensors["layer.0.bias"])
            assert np.array_equal(s["lm_head.weight"], tensors["lm_head.weight"])
        for k, v in tensors.items():  # and the copy is as it was
            assert np.array_equal(kept[k], v), k
    assert leased(api) == 0


def test_a_shard_rewritten_behind_tierds_back_is_read_again(api, upload, tmp_path):
    tensors, blobs = _model(tmp_path)
    ids = [
        upload(f"models/r/model-0000{i + 1}-of-00002.safetensors", b) for i, b in enumerate(blobs)
    ]
    with api.load_model("models/r", shared=True):
        changed = dict(tensors, **{"embed.weight": np.zeros((256, 64), np.float32)})
        p = tmp_path / "new.safetensors"
        save_file({k: changed[k] for k in ("embed.weight", "layer.0.bias")}, str(p))
        new = p.read_bytes()
        assert len(new) == len(blobs[0])  # the same size: only the bytes differ
        rec = api.file(ids[0])
        root = next(t["path"] for t in api.tiers() if t["name"] == rec["tier"])
        os.replace(p, Path(root) / rec["path"])
        assert api.file(ids[0])["generation"] == rec["generation"]  # not noticed yet
        with api.load(ids[0]) as whole:
            assert whole.info["io_path"] != "copy"
            assert np.asarray(whole).tobytes() == new
        with api.load_model("models/r") as model:
            assert np.array_equal(model["embed.weight"], changed["embed.weight"])
            assert np.array_equal(model["lm_head.weight"], tensors["lm_head.weight"])
