"""fsspec's own abstract test suite (``fsspec.tests.abstract``) against a live tierd.

The copy, get, put, open and pipe mixins run as fsspec's own backends run them (its memory and
local filesystems subclass the same mixins with their fixtures), against a real uvicorn serving
tierd on loopback with both tokens configured (``fsspec_server``, shared with
``test_fsspec.py``); the filesystem holds the admin token, as the suite's clean-ups delete.
Each mixin works in its own directory.

What does not apply, and how it is left out: tierd catalogs files, not directories, so a
directory exists exactly while a file is below it. The suite's parts that need a directory to
exist on its own (``mkdir`` of a target before copying into it, an empty source directory
copied as such, an emptied directory still listed) are the ones fsspec gates on its
``supports_empty_directories`` fixture, the switch it made for object stores: with it False,
the suite keeps each target directory alive with a ``dummy`` file and expects ``ls`` of a
directory whose files were all removed to raise ``FileNotFoundError``. Every other test runs
as written, so nothing is left out here; ``test_nothing_is_skipped`` holds that.

Suite time: the three ``*_glob_edge_cases`` tests take ~35 parameter sets each (fsspec's glob
expansion against ``find``, a tree made and removed each time: a third of a CPU-minute in
all). By default a fixed eighth of their sets runs, chosen by a hash of the test's name so
every run picks the same ones; ``--runslow`` runs them all.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest

fsspec = pytest.importorskip("fsspec")
from fsspec.tests.abstract import (  # noqa: E402
    AbstractCopyTests,
    AbstractFixtures,
    AbstractGetTests,
    AbstractOpenTests,
    AbstractPipeTests,
    AbstractPutTests,
)

from tests.client.conftest import ADMIN  # noqa: E402
from tests.conftest import LiveServer  # noqa: E402
from tierd_client.fsspec import TierdFileSystem  # noqa: E402

MIXINS = [
    AbstractCopyTests,
    AbstractGetTests,
    AbstractPutTests,
    AbstractOpenTests,
    AbstractPipeTests,
]


@pytest.fixture(scope="module")
def tierd_fs(fsspec_server: LiveServer) -> TierdFileSystem:
    return TierdFileSystem(url=fsspec_server.url, token=ADMIN, skip_instance_cache=True)


@pytest.fixture(autouse=True)
def _an_eighth_of_the_glob_edge_cases(request: pytest.FixtureRequest) -> None:
    node = request.node
    if (
        node.originalname.endswith("_glob_edge_cases")
        and zlib.crc32(node.name.encode()) % 8
        and not request.config.getoption("--runslow")
    ):
        pytest.skip("suite time: an eighth of the glob edge cases runs (--runslow: all)")


class TierdFixtures(AbstractFixtures):  # type: ignore[misc]  # fsspec is untyped
    @pytest.fixture
    def fs(self, tierd_fs: TierdFileSystem) -> TierdFileSystem:
        return tierd_fs

    @pytest.fixture
    def fs_join(self) -> Callable[..., str]:
        return lambda *parts: "/".join(parts)

    @pytest.fixture
    def fs_path(self, request: pytest.FixtureRequest) -> str:
        # Each class in its own directory; each test's scenario is removed by its fixture.
        return f"abstract/{request.cls.__name__}"

    @pytest.fixture
    def supports_empty_directories(self) -> bool:
        return False  # see the module's docstring


class TestTierdCopy(AbstractCopyTests, TierdFixtures):  # type: ignore[misc]
    pass


class TestTierdGet(AbstractGetTests, TierdFixtures):  # type: ignore[misc]
    pass


class TestTierdPut(AbstractPutTests, TierdFixtures):  # type: ignore[misc]
    pass


class TestTierdOpen(AbstractOpenTests, TierdFixtures):  # type: ignore[misc]
    pass


class TestTierdPipe(AbstractPipeTests, TierdFixtures):  # type: ignore[misc]
    pass


def test_nothing_is_skipped(request: pytest.FixtureRequest) -> None:
    """Every test of every mixin is collected here, and none carries a skip: the docstring's
    claim that nothing is left out stays true when fsspec adds or marks tests. (Collected
    afresh, so the check holds whatever ``-k`` selected.)"""
    module = request.node.parent
    classes = [c for c in module.collect() if isinstance(c, pytest.Class)]
    items = [f for c in classes for f in c.collect() if isinstance(f, pytest.Function)]
    for mixin in MIXINS:
        wanted = {n for n in dir(mixin) if n.startswith("test_")}
        got = {i.originalname for i in items if issubclass(i.cls, mixin)}
        assert wanted and wanted == got, mixin.__name__
    skipped = [
        i.name for i in items if any(i.iter_markers("skip")) or any(i.iter_markers("skipif"))
    ]
    assert not skipped
