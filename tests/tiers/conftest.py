"""The ``tier`` fixture: each shared test runs on every storage backend, the way fsspec's
abstract tests run on every filesystem. (The memory tier is no :class:`~tiering.tiers.Tier`:
a cache of copies, with its own tests.) The S3-protocol server and object-tier fixtures come from
``tests.s3``, a plugin of the root conftest."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiering.config import TierConfig
from tiering.tiers import DirectoryTier

# "compressed": a directory tier that writes tierd's compressed format (files that pay);
# "compressed-object": an object tier that does (containers under .tierd-compressed/).
BACKENDS = ["directory", "object", "compressed", "compressed-object"]


@pytest.fixture(params=BACKENDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path, moto_server: str | None) -> Any:
    """A checked, empty tier of each kind. (``moto_server`` is asked for here, not lazily, so
    its session threads start before the leak check counts.)"""
    if request.param in ("object", "compressed-object"):
        make: Callable[..., Any] = request.getfixturevalue("make_object_tier")
        t = make(compression="on" if request.param == "compressed-object" else "off")
    else:
        mode = "on" if request.param == "compressed" else "off"
        t = DirectoryTier(TierConfig("dir", path=tmp_path / "tier", compression=mode), rank=0)
        request.addfinalizer(t.close)
    t.check()
    return t
