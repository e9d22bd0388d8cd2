"""The README's ``bash`` and ``python`` blocks, run as written, in order, against a real
``tierd serve`` (uvicorn on loopback, the embedded default in a fresh directory), as a newcomer
would paste them. Only the port differs: the README's 127.0.0.1:8470 becomes a free one.

A block that needs what this machine may not have says so in an HTML comment on the line
before it, which the reader does not see:

- ``<!-- snippet: skip: <reason> -->``: never run here (a GPU, a fleet, a bucket, Docker, files
  the reader brings); the reason is the skip's;
- ``<!-- snippet: needs torch -->``: run where torch imports.

Every other ``bash`` or ``python`` block runs. ``curl`` fails on an HTTP error here (it is
called with ``--fail-with-body``), so a 4xx in a snippet fails the test with tierd's answer.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tierd_client._tls import tls_context

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"^<!--\s*snippet:\s*(.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Snippet:
    line: int
    lang: str
    code: str
    mark: str | None

    @property
    def id(self) -> str:
        return f"{self.lang}-line{self.line}"

    def skip_reason(self) -> str | None:
        if self.mark is None:
            return None
        if self.mark.startswith("skip:"):
            return self.mark.removeprefix("skip:").strip()
        if self.mark == "needs torch":
            return None if importlib.util.find_spec("torch") else "needs torch"
        raise AssertionError(f"README line {self.line}: unknown snippet mark {self.mark!r}")


def snippets(text: str) -> list[Snippet]:
    """The README's fenced ``bash`` and ``python`` blocks at the top level, with their marks."""
    out: list[Snippet] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, lang = i, fence.group(1)
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        mark = _MARK.match(lines[start - 1]) if start else None
        if lang in ("bash", "python"):
            code = "\n".join(lines[start + 1 : i]) + "\n"
            out.append(Snippet(start + 1, lang, code, mark.group(1) if mark else None))
        i += 1
    return out


SNIPPETS = snippets(README.read_text())


def test_the_readme_has_runnable_snippets_of_both_kinds() -> None:
    runnable = {s.lang for s in SNIPPETS if s.mark is None or not s.mark.startswith("skip:")}
    assert runnable == {"bash", "python"}


@dataclass
class Served:
    cwd: Path
    port: int
    env: dict[str, str]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``tierd serve`` with no configuration, in a directory of its own (./tierd-data), for the
    snippets in order (pytest-xdist's ``--dist loadfile`` runs a file's tests on one worker)."""
    cwd = tmp_path_factory.mktemp("readme")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERD_")}
    env["PYTHONPATH"] = str(REPO)  # this tree's code, in the server and in every snippet
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["TIERD_URL"] = f"http://127.0.0.1:{port}"
    log = (cwd / "serve.log").open("wb")
    tierd = shutil.which("tierd", path=env["PATH"])
    assert tierd, "no tierd command beside this Python: install the project (make does)"
    proc = subprocess.Popen(
        [tierd, "serve", "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(timeout=2, verify=tls_context()) as http:  # one client, one CA load
            while True:
                try:
                    if http.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"tierd serve did not start:\n{_tail(cwd / 'serve.log')}")
                time.sleep(0.1)
        yield Served(cwd, port, env)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        finally:
            log.close()


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs_as_written(snippet: Snippet, served: Served) -> None:
    reason = snippet.skip_reason()
    if reason is not None:
        pytest.skip(f"README line {snippet.line}: {reason}")
    code = snippet.code.replace("127.0.0.1:8470", f"127.0.0.1:{served.port}")
    if snippet.lang == "bash":
        prelude = 'set -euo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n'
        argv = ["bash", "-c", prelude + code]
    else:
        argv = [sys.executable, "-c", code]
    done = subprocess.run(
        argv, cwd=served.cwd, env=served.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (
        f"README line {snippet.line} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        f"\n-- tierd's log --\n{_tail(served.cwd / 'serve.log')}"
    )
