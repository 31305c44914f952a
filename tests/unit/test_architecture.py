"""No import cycles: the top-level packages of preheat import one another one way only, and the modules of any one
package (``preheat.server.*``, ``preheat.doctor.*``, ...) do too.

import-linter's layers contract (pyproject.toml) lets siblings joined by ``:`` import each other; this test is what
keeps those imports one-way. The graph is grimp's (the library import-linter runs on), built from the source with
every import counted: those inside functions, which run later but still tie the modules together, and those under
``if TYPE_CHECKING:``, which a reader and mypy still need to follow (the knot ``preheat.server`` once was, six
modules around ``ServerState``, was made of nothing else).

One exception, and why: a package's own ``__main__`` (``python -m preheat.peer``) is a command, the layer of cli/:
like cli/ it wires packages together (the seed peer serves compiled artifacts from ``preheat.artifacts``), and since
nothing can import a ``__main__`` module, no import of code that others depend on runs through it. Its imports are
therefore not counted as its package's in the package-level graph; inside its own package it is a module like any
other, and its imports count there.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Set
from itertools import pairwise

import grimp
import pytest

ROOT = "preheat"
Edges = Mapping[str, Set[str]]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # cache_dir=None: grimp's cache is keyed by file times, and a checkout shared by many editors is no place to trust
    # it (a stale entry once reported an import that the file no longer had).
    return grimp.build_graph(ROOT, cache_dir=None)


def member_of(package: str, module: str) -> str | None:
    """The child of ``package`` that ``module`` belongs to (``package`` itself for its ``__init__``), or None when
    ``module`` is outside it."""
    if module == package:
        return package
    if not module.startswith(package + "."):
        return None
    return package + "." + module[len(package) + 1 :].split(".", 1)[0]


def is_nested_main(package: str, module: str) -> bool:
    """Whether ``module`` is the ``__main__`` of a subpackage of ``package`` (see the module docstring)."""
    return module.endswith(".__main__") and module.count(".") > package.count(".") + 1


def child_graph(graph: grimp.ImportGraph, package: str) -> dict[str, set[str]]:
    """The imports among ``package``'s children, each subpackage taken as one node with all its modules."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.find_descendants(package) | {package}:
        source = member_of(package, module)
        if source is None or is_nested_main(package, module):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            target = member_of(package, imported)
            if target is not None and target != source:
                edges[source].add(target)
    return edges


def strongly_connected(edges: Edges) -> list[list[str]]:
    """The groups of nodes that all reach one another, groups of one left out (Tarjan's algorithm, iterative: a
    recursion per module would not fit Python's stack on a larger tree)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
    return groups


def shortest_cycle(edges: Edges, group: Iterable[str]) -> list[str]:
    """One shortest loop through the first node of ``group`` (breadth first, inside the group), start repeated last."""
    members = sorted(group)
    start = members[0]
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for successor in sorted(edges.get(node, ())):
            if successor not in members:
                continue
            if successor == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if successor not in previous:
                previous[successor] = node
                queue.append(successor)
    raise AssertionError(f"{members} is not a strongly connected group")


def example_import(graph: grimp.ImportGraph, package: str, source: str, target: str) -> str:
    """One import behind the edge ``source -> target`` (children of ``package``), as ``module:line: text``."""
    scope = {package} if source == package else graph.find_descendants(source) | {source}
    for module in sorted(scope):
        if is_nested_main(package, module):
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if member_of(package, imported) == target:
                details = graph.get_import_details(importer=module, imported=imported)
                return f"{module}:{details[0]['line_number']}: {details[0]['line_contents']}" if details else module
    return f"{source} -> {target}"


def cycles_in(graph: grimp.ImportGraph, package: str) -> list[str]:
    """Each import cycle among ``package``'s children, as a message that names the loop and one import per step."""
    edges = child_graph(graph, package)
    found = []
    for group in strongly_connected(edges):
        loop = shortest_cycle(edges, group)
        short = [name.rsplit(".", 1)[-1] if name != package else "__init__" for name in loop]
        steps = "\n".join(f"      {example_import(graph, package, a, b)}" for a, b in pairwise(loop))
        found.append(f"{package}: {' -> '.join(short)} (all of {', '.join(group)} reach one another)\n{steps}")
    return found


def packages(graph: grimp.ImportGraph) -> list[str]:
    return sorted(module for module in graph.modules if graph.find_children(module))


def test_top_level_packages_import_each_other_one_way_only(graph: grimp.ImportGraph) -> None:
    found = cycles_in(graph, ROOT)
    assert not found, "top-level packages of preheat import each other:\n" + "\n".join(found)


def test_no_package_has_an_import_cycle_among_its_modules(graph: grimp.ImportGraph) -> None:
    found = [cycle for package in packages(graph) if package != ROOT for cycle in cycles_in(graph, package)]
    assert not found, "import cycles inside packages:\n" + "\n".join(found)


def test_every_package_is_looked_at(graph: grimp.ImportGraph) -> None:
    # A guard on the two tests above: an empty or wrong graph would make them pass without checking anything.
    assert {"preheat.server", "preheat.doctor", "preheat.checkpoint", "preheat.integrations.vllm"} <= set(
        packages(graph)
    )


def test_a_cycle_is_named_with_the_imports_that_close_it() -> None:
    # The checker itself, on a small graph with a loop through a subpackage and a __main__ that imports upward.
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c", "pkg.sub.__main__", "pkg.top"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b", line_number=3, line_contents="from pkg.b import B")
    graph.add_import(importer="pkg.b", imported="pkg.sub.c", line_number=7, line_contents="from pkg.sub.c import C")
    graph.add_import(importer="pkg.sub.c", imported="pkg.a", line_number=9, line_contents="from pkg.a import A")
    graph.add_import(importer="pkg.top", imported="pkg.sub.c", line_number=1, line_contents="import pkg.sub.c")
    graph.add_import(importer="pkg.sub.__main__", imported="pkg.top", line_number=2, line_contents="import pkg.top")

    (found,) = cycles_in(graph, "pkg")
    assert found.startswith("pkg: a -> b -> sub -> a")
    assert "pkg.b:7: from pkg.sub.c import C" in found
    assert "pkg.sub.c:9: from pkg.a import A" in found
    assert "pkg.top" not in found  # sub's __main__ imports top, and top imports sub: a command, not a loop
    assert cycles_in(graph, "pkg.sub") == []

    graph.remove_import(importer="pkg.sub.c", imported="pkg.a")
    assert cycles_in(graph, "pkg") == []
