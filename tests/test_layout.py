"""The layout is part of the design: rooms by concern, imports flowing one way, small modules.

These tests read the source with :mod:`ast` rather than importing it, so they see every import:
top-level ones, ones inside functions (lazy imports of optional or heavy modules) and ones under
``if TYPE_CHECKING:``. A lazy import still couples two modules, so it counts.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "tiering", "tierd_client", "tierd_bench")
MAX_LINES = 500

# Rooms of ``tiering`` from the bottom up. A module may import its own room and rooms of a
# strictly lower rank; rooms of equal rank stay independent of each other.
RANKS: dict[str, int] = {
    "tiering.errors": 0,
    "tiering.config": 1,
    "tiering.checksum": 1,
    "tiering.periodic": 1,
    # The one ``with`` shape (``__enter__``/``__exit__`` → ``close()``) that every room uses.
    "tiering.closing": 1,
    # Damage found in stored bytes: what reads, moves and scans record, and /readyz shows.
    "tiering.integrity": 1,
    # Ranges of remote bytes: the one interface tiers implement and the data path reads.
    "tiering.ranges": 1.5,
    # tierd's compressed file format: below the tiers that store it.
    "tiering.codec": 1.5,
    "tiering.tiers": 2,
    "tiering.catalog": 3,
    "tiering.io": 3,
    "tiering.moves": 4,
    "tiering.sync": 5,
    "tiering.placement": 5,
    "tiering.fleet": 5,
    # Caches of bytes whose authority is elsewhere: they carry out placement's decisions.
    "tiering.copies": 5.5,
    "tiering.engine": 6,
    "tiering.serving": 7,
    # The benchmark harness: its own package above the library, which never imports it.
    "tierd_bench": 8,
    # The client: above the data path whose buffer hand-off it shares, below everything that
    # needs the server's dependencies. ``tierd_bench`` drives it for the REST benchmark.
    "tierd_client": 3.5,
}
# What the client may reach in ``tiering``: the buffer hand-off and dtypes of ``tiering.io``,
# which import only numpy and the standard library (CUDA libraries lazily).
CLIENT_MAY_IMPORT = {
    "tiering.io",
    "tiering.errors",
    "tiering.config",
    "tiering.tiers",
    "tiering.closing",
}
SERVER_ONLY = ("fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "watchdog")


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


@functools.cache
def _source(name: str) -> str:
    return MODULES[name].read_text()


@functools.cache
def _tree(name: str) -> ast.Module:
    """Each module parsed once for the whole file's tests (read-only: no test changes it)."""
    return ast.parse(_source(name), str(MODULES[name]))


@functools.cache
def _imports(name: str, path: Path) -> tuple[str, ...]:
    return tuple(_walk_imports(name, path))


def _walk_imports(name: str, path: Path) -> Iterator[str]:
    """Every module ``name`` imports, absolute, wherever in the file the import sits."""
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                # ``from pkg import submodule`` imports the submodule itself.
                sub = f"{mod}.{alias.name}"
                yield sub if sub in MODULES else mod


@functools.cache
def _graph() -> dict[str, set[str]]:
    return {
        name: {m for m in _imports(name, path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tiering" else parts[0]


def test_layout_parser_sees_lazy_and_type_checking_imports() -> None:
    # Guard the guard: if _imports missed these, the tests below could not fail.
    imports = set(_imports("tiering.placement.policy", MODULES["tiering.placement.policy"]))
    assert "tiering.catalog.db" in imports
    assert "tiering.moves" in _graph()["tiering.engine.scheduler"]


def test_no_module_is_over_about_500_lines() -> None:
    sizes = {n: len(_source(n).splitlines()) for n in MODULES}
    big = {n: lines for n, lines in sizes.items() if lines > MAX_LINES}
    assert not big, f"split these by responsibility: {big}"


# A module past this many lines is split where its ideas split, or says in its docstring why it
# is kept whole (a line beginning "Kept whole past 450 lines:"): the cap is no target to pack to.
WHOLE_LINES = 450


def test_a_module_past_450_lines_says_why_it_is_whole() -> None:
    unexplained = sorted(
        n
        for n in MODULES
        if len(_source(n).splitlines()) > WHOLE_LINES
        and "Kept whole past 450 lines:" not in (ast.get_docstring(_tree(n)) or "")
    )
    assert not unexplained, f"split these where their ideas split, or say why not: {unexplained}"


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _none_found(modules: Iterable[str], check: Callable[[str], list[str]], why: str) -> None:
    """Run ``check`` on every module and fail once, naming each module and what it found: one
    test per rule, not per module (1,800 test items cost every xdist worker its collection)."""
    found = {m: f for m in sorted(modules) if (f := check(m))}
    assert not found, why + ":\n" + "\n".join(f"  {m}: {f}" for m, f in found.items())


def test_every_tiering_module_belongs_to_a_ranked_room() -> None:
    unranked = {_room(m) for m in MODULES if m.startswith("tiering.") and _room(m) not in RANKS}
    assert not unranked, f"give these rooms a rank in RANKS: {sorted(unranked)}"


def _upward_imports(module: str) -> list[str]:
    here = _room(module)
    wrong = []
    for target in _graph()[module]:
        there = _room(target)
        if there == here:
            continue
        if there == "app":
            wrong.append(f"{target} (tiering and the client never import app)")
        elif here == "tierd_client" and there not in CLIENT_MAY_IMPORT:
            wrong.append(f"{target} (the client installs without the server)")
        elif RANKS.get(there, 99) >= RANKS.get(here, -1):
            wrong.append(f"{target} (rank {RANKS.get(there)} is not below {RANKS.get(here)})")
    return wrong


def test_imports_flow_down() -> None:
    below_app = [m for m in MODULES if not m.startswith("app")]
    _none_found(below_app, _upward_imports, "these import upward or sideways")


def _web_stack_imports(module: str) -> list[str]:
    third_party = {m.split(".")[0] for m in _imports(module, MODULES[module])}
    client_side = module.startswith("tierd_client") or _room(module) in CLIENT_MAY_IMPORT
    return sorted(third_party & set(SERVER_ONLY if client_side else SERVER_ONLY[:3]))


def test_engine_and_client_never_import_the_web_stack() -> None:
    below_app = [m for m in MODULES if not m.startswith("app")]
    _none_found(below_app, _web_stack_imports, "the engine or the client imports the web stack")


def test_the_library_never_imports_the_bench() -> None:
    # The bench ships as its own package (``tierd bench`` loads it): tiering and the client
    # stay free of its harness and peers.
    wrong = sorted(
        f"{m} -> {t}"
        for m in MODULES
        if m.startswith(("tiering", "tierd_client"))
        for t in _graph()[m]
        if _room(t) == "tierd_bench"
    )
    assert not wrong, wrong


# -- callers ask a tier what it can do, never what it is -------------------------------------
# The tier kinds' names. A ``.kind`` compared with one of them outside ``tiering.tiers`` is a
# branch on the backend, where a capability (``Tier.capabilities``) or a method belongs.
TIER_KINDS = {"directory", "object", "memory"}
# Modules that parse the configured kind (configuration, not a tier): they may compare it.
KIND_PARSERS = {
    "tiering.config": "parses TierConfig.kind",
    "app.settings": "validates the configured tiers (a memory tier first, a url for object)",
    "app.api.openapi": "lists the configured storage tiers (settings), not Tier objects",
}
TIER_CLASSES = {"DirectoryTier", "ObjectTier", "DirectorySource", "ObjectSource"}


def _tier_type_checks(tree: ast.AST, *, may_parse_kind: bool) -> Iterator[str]:
    """Where ``tree`` branches on what a tier is: a ``.kind`` compared with a tier kind's
    name, a ``local_root`` read, a ``.fd`` compared (a source's "is it local?"), or an
    ``isinstance`` with a backend's class."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            attrs = {s.attr for s in sides if isinstance(s, ast.Attribute)}
            consts = {
                c.value
                for s in sides
                for c in ([s] if not isinstance(s, ast.Tuple | ast.List | ast.Set) else s.elts)
                if isinstance(c, ast.Constant)
            }
            if "kind" in attrs and consts & TIER_KINDS and not may_parse_kind:
                yield f"line {node.lineno}: .kind compared with {sorted(consts & TIER_KINDS)}"
            if "fd" in attrs:
                yield f"line {node.lineno}: .fd compared (ask Source.local_file())"
        elif isinstance(node, ast.Attribute) and node.attr == "local_root":
            yield f"line {node.lineno}: local_root (ask Tier.capabilities / watch_root())"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & TIER_CLASSES:
                yield f"line {node.lineno}: isinstance with {sorted(named & TIER_CLASSES)}"


def test_tier_type_check_finder_finds_them() -> None:
    # Guard the guard: each form it looks for is found, and a capability question is not.
    src = (
        "if t.kind == 'object': pass\n"
        "if 'directory' != tier.kind: pass\n"
        "if t.kind in ('object', 'x'): pass\n"
        "r = t.local_root\n"
        "if src.fd >= 0: pass\n"
        "if isinstance(t, tiers.ObjectTier): pass\n"
        "if t.capabilities.shared or dev.kind == 'cuda': pass\n"
    )
    found = list(_tier_type_checks(ast.parse(src), may_parse_kind=False))
    assert [f.split(":")[0] for f in found] == [f"line {n}" for n in range(1, 7)], found


def test_no_module_outside_tiers_asks_what_a_tier_is() -> None:
    outside = [m for m in MODULES if _room(m) != "tiering.tiers" and m != "tiering.tiers"]
    _none_found(
        outside,
        lambda m: list(_tier_type_checks(_tree(m), may_parse_kind=m in KIND_PARSERS)),
        "these branch on a tier's kind",
    )


# -- the formatter's output is the code --------------------------------------------------------
# ``# fmt: skip`` keeps an aligned table aligned; anything else is a module packing lines to meet
# the size cap. So every one says why, in a comment of its own after it on the same line:
# ``x = (...)  # fmt: skip  # aligned table: one row per tier kind``.
def _unexplained_fmt_skips(source: str) -> Iterator[str]:
    for number, line in enumerate(source.splitlines(), 1):
        for directive in ("fmt: skip", "fmt: off"):
            if directive not in line:
                continue
            reason = line.split(directive, 1)[1].strip().lstrip("#").strip()
            if not reason:
                yield f"line {number}: {line.strip()}"


def test_fmt_skip_finder_finds_them() -> None:
    # Guard the guard: a bare directive is found; one with its reason after it is not.
    src = (
        "x = [1,2]  # fmt: skip\n"
        "y = [1,2]  # fmt: skip  # aligned table: columns are the point\n"
        "z = [1,2]  # fmt: skip #\n"
        "# fmt: off\n"
    )
    assert [f.split(":")[0] for f in _unexplained_fmt_skips(src)] == ["line 1", "line 3", "line 4"]


def test_every_fmt_skip_says_why() -> None:
    _none_found(
        MODULES,
        lambda m: list(_unexplained_fmt_skips(_source(m))),
        "split at a seam, or say why on the line",
    )


# -- functions small enough to read at once ------------------------------------------------------
MAX_FUNCTION_LINES = 80


def _long_functions(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                yield f"{node.name} ({lines} lines, line {node.lineno})"


def test_long_function_finder_finds_them() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    src = f"def long():\n{body}def short():\n    pass\n"
    assert [f.split(" ")[0] for f in _long_functions(ast.parse(src))] == ["long"]


def test_no_function_is_over_80_lines() -> None:
    _none_found(
        MODULES,
        lambda m: list(_long_functions(_tree(m))),
        "break these up where their concerns split",
    )


# -- rooms talk through public faces -----------------------------------------------------------
# A leading underscore means "this room only": a module of another room imports neither a
# ``_private`` module nor a ``_private`` name, and calls or reads no ``_private`` member of an
# object that another room's code defines. ``app`` and each ``tiering`` room are rooms; so are
# the client and the bench.
#
# Members are found by name, as the AST cannot know an object's class: ``obj._name`` (``obj`` not
# ``self``/``cls``) is reaching across when ``_name`` is defined only in other rooms of tierd
# (a method, or for a read an attribute assigned), never in the reader's own. A private of the
# standard library or a dependency (``os._exit``) is no room's and is not flagged here.
#
# Where one is truly needed it is listed here with the reason: (module, what it reaches) -> why.
_PROFILE = (
    "the REST profile (tierd bench rest/models) times each step of the client's "
    "load_state_dict apart (request, reply, opens, tensors, wait), so it calls the steps"
)
PRIVATE_REACH_ALLOWED: dict[tuple[str, str], str] = {
    ("tierd_bench._restprofile", "from tierd_client._buffers import Tensors"): _PROFILE,
    (
        "tierd_bench._restprofile",
        "from tierd_client._exceptions import error_from_response",
    ): _PROFILE,
    ("tierd_bench._restprofile", "from tierd_client._loads import parse_target"): _PROFILE,
    ("tierd_bench._restprofile", "from tierd_client._loads import safetensors_body"): _PROFILE,
    ("tierd_bench._restprofile", "from tierd_client._state_dict import _wrap"): _PROFILE,
    ("tierd_bench._restprofile", "from tierd_client._exceptions import NotFound"): _PROFILE,
    ("tierd_bench._restprofile", "api._open_all"): _PROFILE,
    ("tierd_bench._restprofile", "api._http"): _PROFILE,
}


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


@functools.cache
def _defined_privates() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """Per room: the private names it defines as functions/classes, and those it assigns."""
    defs: dict[str, set[str]] = {}
    stores: dict[str, set[str]] = {}
    for name in MODULES:
        room = _room(name)
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defs.setdefault(room, set()).add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                stores.setdefault(room, set()).add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                stores.setdefault(room, set()).add(node.id)
    return {
        room: (frozenset(defs.get(room, ())), frozenset(stores.get(room, ())))
        for room in set(defs) | set(stores)
    }


def _private_reaches(module: str, tree: ast.AST) -> Iterator[str]:
    here = _room(module)
    defined = _defined_privates()
    own_defs, own_stores = defined.get(here, (frozenset(), frozenset()))
    other_defs = set().union(*(d for r, (d, _) in defined.items() if r != here))
    other_stores = set().union(*(s for r, (_, s) in defined.items() if r != here))
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    is_pkg = MODULES[module].name == "__init__.py" if module in MODULES else False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                known = alias.name in MODULES and _room(alias.name) != here
                if known and _private(alias.name.split(".")):
                    yield f"line {node.lineno}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                target = sub if sub in MODULES else mod
                if target not in MODULES or _room(target) == here:
                    continue
                if _private(target.split(".")) or _private([alias.name]):
                    yield f"line {node.lineno}: from {mod} import {alias.name}"
        elif isinstance(node, ast.Attribute) and _private([node.attr]):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if isinstance(node.ctx, ast.Store):
                continue
            is_call = id(node) in calls
            if node.attr in own_defs or (not is_call and node.attr in own_stores):
                continue
            if node.attr in other_defs or (not is_call and node.attr in other_stores):
                yield f"line {node.lineno}: {ast.unparse(node)}"


def test_private_reach_finder_finds_them() -> None:
    # Guard the guard: each form is found in a module of another room, and none in io's own.
    src = (
        "from tiering.io._storage import GpuDirectStorage\n"
        "import tiering.codec._format\n"
        "from tiering.io._file import GdsFile as _G\n"
        "f._rows(True)\n"
        "n = storage._pools\n"
        "self._fan_out = None\n"
        "os._exit(1)\n"
    )
    found = [f.split(":")[0] for f in _private_reaches("tiering.serving.sharded", ast.parse(src))]
    assert sorted(found) == ["line 1", "line 2", "line 3", "line 4", "line 5"], found
    in_io = [f.split(":")[0] for f in _private_reaches("tiering.io.sharding", ast.parse(src))]
    assert in_io == ["line 2"], in_io  # io's own privates are io's; codec's are not


def test_rooms_reach_each_other_only_through_public_faces() -> None:
    _none_found(
        MODULES,
        lambda m: [
            f
            for f in _private_reaches(m, _tree(m))
            if (m, f.split(": ", 1)[1]) not in PRIVATE_REACH_ALLOWED
        ],
        "these reach into another room's privates",
    )


# -- no module hands itself to the modules it imports --------------------------------------------
# ``register(cli, sys.modules[__name__])`` is an import cycle the import graph cannot see: the
# registered module calls back into the one that imported it.
def _self_handoffs(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and ast.unparse(node.value) == "sys.modules"
            and ast.unparse(node.slice) == "__name__"
        ):
            yield f"line {node.lineno}: {ast.unparse(node)}"


def test_self_handoff_finder_finds_them() -> None:
    src = "register(cli, sys.modules[__name__])\nx = sys.modules['json']\n"
    assert [f.split(":")[0] for f in _self_handoffs(ast.parse(src))] == ["line 1"]


def test_no_module_hands_itself_to_another() -> None:
    _none_found(
        MODULES,
        lambda m: list(_self_handoffs(_tree(m))),
        "import a shared helper module instead",
    )
