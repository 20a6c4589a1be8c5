"""The shape of ffplane's production code: which package imports which, no import circles, no
function too long to read.

Imports between the packages point one way, so each can be read (and replaced) from below:

ffplane_contract → nothing of ffplane (errors, limits, wire formats, settings)
ffplane_runtime  → ffplane_contract (serving, etcd, page tables)
dataserver       → ffplane_contract, ffplane_runtime
statestore       → ffplane_contract, ffplane_runtime
trainer_client   → ffplane_contract, ffplane_runtime.etcd, ffplane_runtime.pagemap (training
                   processes never load the servers' uvicorn plumbing, ffplane_runtime.httpserver)
ffplane_harness  → anything (it starts clusters; nothing imports it but tests, bench, the CLI)

The import graph: a module per file (``pkg/sub/__init__.py`` is ``pkg.sub``); ``import a.b.c``
is an edge to the longest of ``a.b.c``, ``a.b``, ``a`` that is a module; ``from a.b import c`` an
edge to ``a.b.c`` when that is a module, else to ``a.b``; every import statement counts, those
inside functions too (a circle closed by a function-level import is still a circle: the two
modules cannot be read, tested or replaced apart).
"""

from __future__ import annotations

import ast
import functools
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ffplane_contract", "ffplane_runtime", "dataserver", "statestore", "trainer_client", "ffplane_harness")
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "ffplane_contract": (),
    "ffplane_runtime": ("ffplane_contract",),
    "dataserver": ("ffplane_contract", "ffplane_runtime"),
    "statestore": ("ffplane_contract", "ffplane_runtime"),
    "trainer_client": ("ffplane_contract", "ffplane_runtime.etcd", "ffplane_runtime.pagemap"),
    "ffplane_harness": ("ffplane_contract", "ffplane_runtime", "dataserver", "statestore", "trainer_client"),
}
MAX_FUNCTION_LINES = 150  # STYLE.md, habit 14: the largest function of our models is under 190
MAX_ROUTE_MODULE_LINES = 300  # a server's routes, one module per concern: a module past this holds two

Graph = dict[str, dict[str, int]]  # module → each module it imports → the line of the first such import


# --- the import graph ----------------------------------------------------------------------
def module_name(relative: Path) -> str:
    """``dataserver/catalog.py`` → ``dataserver.catalog``; a package's ``__init__.py`` is the package."""
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def production_modules() -> dict[str, Path]:
    """Every module of the production packages, by name, with its file relative to the root."""
    return {module_name(p.relative_to(ROOT)): p.relative_to(ROOT) for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


@functools.cache
def production_trees() -> dict[str, ast.Module]:
    return {name: ast.parse((ROOT / path).read_text(), str(path)) for name, path in production_modules().items()}


@functools.cache
def production_graph() -> Graph:
    return import_graph(production_trees())


def _enclosing_module(name: str, modules: Mapping[str, object]) -> str | None:
    """The longest of ``name``, its parent, its parent's parent ... that is one of ``modules``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.Import | ast.ImportFrom, modules: Mapping[str, object]) -> list[str]:
    """The modules of ``modules`` that ``node`` imports (none for a relative import)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif node.module and not node.level:
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
    else:
        return []
    return [m for m in (_enclosing_module(n, modules) for n in names) if m is not None]


def import_graph(trees: Mapping[str, ast.Module]) -> Graph:
    """Module → the modules (of ``trees``) it imports, each with the line of its first import."""
    graph: Graph = {}
    for module, tree in trees.items():
        edges = graph[module] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, trees):
                    if target != module:
                        edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return graph


def _reachable(graph: Graph, start: str) -> set[str]:
    """The modules ``start`` reaches through one import or more (itself only through a circle)."""
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def circles(graph: Graph) -> list[list[str]]:
    """Every import circle: the sets of modules that each reach all the others (the graph's
    strongly connected components of more than one module), each sorted, in sorted order."""
    reach = {module: _reachable(graph, module) for module in graph}
    found = {tuple(sorted(m for m in reach[start] if start in reach.get(m, ()))) for start in graph if start in reach[start]}
    return [list(circle) for circle in sorted(found)]


def shortest_cycle(graph: Graph, start: str) -> list[str]:
    """One shortest path of imports from ``start`` back to itself: ``[start, ..., start]``."""
    came_from: dict[str, str] = {}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for target in graph.get(module, ()):
            if target == start:
                path = [module]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if target not in came_from:
                came_from[target] = module
                todo.append(target)
    return []


def _allowed(package: str, target: str) -> bool:
    if target.split(".")[0] == package:
        return True
    return any(target == a or target.startswith(a + ".") for a in MAY_IMPORT[package])


# --- function lengths ----------------------------------------------------------------------
def function_lengths(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int, int]]:
    """``(qualified name, line of its def, lines from its def to its last line)`` for every
    function in ``tree``, nested ones and methods too (``Class.method``, ``outer.inner``); a
    function's length includes the functions nested in it."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            yield prefix + node.name, node.lineno, node.end_lineno - node.lineno + 1
            yield from function_lengths(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from function_lengths(node, f"{prefix}{node.name}.")
        else:
            yield from function_lengths(node, prefix)


def production_functions() -> Iterator[tuple[str, str, int, int]]:
    """``(file, qualified name, line, length)`` of every production function."""
    for module, tree in production_trees().items():
        path = production_modules()[module].as_posix()
        for name, line, length in function_lengths(tree):
            yield path, name, line, length


# --- the package layering ------------------------------------------------------------------
def test_every_package_has_its_rule() -> None:
    assert sorted(MAY_IMPORT) == sorted(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_only_down(package: str) -> None:
    modules, graph = production_modules(), production_graph()
    wrong = [
        f"{modules[module]}:{line} imports {target}"
        for module in sorted(graph)
        if module.split(".")[0] == package
        for target, line in sorted(graph[module].items())
        if not _allowed(package, target)
    ]
    assert not wrong, f"imports against the layout ({package} may import {MAY_IMPORT[package]}; tests/test_layout.py):\n" + "\n".join(wrong)


def test_the_check_sees_a_wrong_import() -> None:
    assert not _allowed("dataserver", "trainer_client.batches")
    assert not _allowed("trainer_client", "statestore.durable")
    assert not _allowed("trainer_client", "ffplane_runtime.httpserver")
    assert not _allowed("ffplane_contract", "ffplane_runtime.etcd")
    assert not _allowed("statestore", "ffplane_harness.local_cluster")
    assert _allowed("trainer_client", "ffplane_contract.control")
    assert _allowed("trainer_client", "ffplane_runtime.pagemap")
    assert _allowed("statestore", "ffplane_runtime.httpserver")


def test_production_imports_are_absolute() -> None:
    """The graph above reads absolute imports only; a relative one would hide its edge."""
    relative = [
        f"{production_modules()[module]}:{node.lineno}"
        for module, tree in production_trees().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative, "relative imports (write them absolute):\n" + "\n".join(relative)


# --- import circles ------------------------------------------------------------------------
def _describe(graph: Graph, circle: list[str], where: Mapping[str, object]) -> str:
    cycle = shortest_cycle(graph, circle[0])
    steps = [f"    {a} ({where.get(a, a)}:{graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:])]
    return f"  {', '.join(circle)}:\n" + "\n".join(steps)


def test_no_import_circles() -> None:
    graph = production_graph()
    found = circles(graph)
    assert not found, "import circles (move what both need into a module of its own, or hand it in):\n" + "\n".join(
        _describe(graph, c, production_modules()) for c in found
    )


def _graph(sources: Mapping[str, str]) -> Graph:
    return import_graph({name: ast.parse(source) for name, source in sources.items()})


def test_the_circle_finder_sees_a_planted_circle() -> None:
    graph = _graph(
        {
            "p": "",
            "p.a": "import p.b\n",
            "p.b": "def f():\n    from p import c  # a submodule, imported in a function\n",
            "p.c": "from p.a import name  # a name of p.a: an edge to p.a\n",
            "p.d": "import p.a\nimport os\n",  # reaches the circle, is not in it
            "q": "import q\nfrom q import x\n",  # itself: no circle
        }
    )
    assert graph["p.b"] == {"p.c": 2}
    assert graph["q"] == {}
    assert circles(graph) == [["p.a", "p.b", "p.c"]]
    assert shortest_cycle(graph, "p.a") == ["p.a", "p.b", "p.c", "p.a"]
    assert "p.b (p.b:2) imports p.c" in _describe(graph, ["p.a", "p.b", "p.c"], {})


def test_the_circle_finder_tells_circles_apart_and_passes_a_tree() -> None:
    two = _graph({"a": "import b", "b": "import a", "c": "import d\nimport a", "d": "import c"})
    assert circles(two) == [["a", "b"], ["c", "d"]]
    assert circles(_graph({"a": "import b", "b": "import c", "c": "", "d": "import a, b, c"})) == []


# --- function lengths ----------------------------------------------------------------------
def test_no_function_is_too_long() -> None:
    long = [f"{path}:{line} {name} is {length} lines" for path, name, line, length in production_functions() if length > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into well-named helpers):\n" + "\n".join(long)


def test_each_servers_route_modules_are_small() -> None:
    modules = sorted([*(ROOT / "dataserver" / "routes").glob("*.py"), *(ROOT / "statestore" / "routes").glob("*.py")])
    assert len(modules) >= 6, "the servers' routes live in dataserver/routes and statestore/routes"
    long = [f"{m.relative_to(ROOT)} is {n} lines" for m in modules if (n := len(m.read_text().splitlines())) > MAX_ROUTE_MODULE_LINES]
    assert not long, f"route modules over {MAX_ROUTE_MODULE_LINES} lines (split by concern):\n" + "\n".join(long)


def test_the_length_check_sees_a_planted_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = (
        "def short():\n    pass\n\n"
        f"class C:\n    async def method(self):\n{body.replace('    ', '        ')}\n"
        f"def outer():\n    def inner():\n{body.replace('    ', '        ')}    return inner\n"
    )
    lengths = {name: (line, length) for name, line, length in function_lengths(ast.parse(source))}
    assert lengths["short"] == (1, 2)
    assert lengths["C.method"] == (5, MAX_FUNCTION_LINES + 1)
    assert lengths["outer.inner"][1] == MAX_FUNCTION_LINES + 1
    assert lengths["outer"][1] == MAX_FUNCTION_LINES + 3
    assert [name for name, (_, length) in lengths.items() if length > MAX_FUNCTION_LINES] == ["C.method", "outer", "outer.inner"]
