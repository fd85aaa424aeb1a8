"""The architecture as a checked fact: floors of the import graph, no cycles, no torch upstairs.

Floors, bottom up: the ground floor (`zerobubble` minus its roof: wire stubs, rpc helpers,
settings, metrics, the client); the two services (`scheduler_svc`, `worker_svc` over
`kernels`), which never import each other; the roof (`zerobubble.entrypoints`,
`zerobubble.tools`, `zerobubble.__main__`), which nothing below imports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import cycles, import_graph, imports_anything

ROOT = Path(__file__).resolve().parent.parent
ROOF = ("zerobubble.entrypoints", "zerobubble.tools", "zerobubble.__main__")


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def test_the_graph_sees_the_known_edges(graph: dict[str, set[str]]) -> None:
    # Guards the parser itself: if these vanished, the other tests would pass vacuously.
    assert "scheduler_svc.scheduler" in graph["scheduler_svc.router"]
    assert "worker_svc.runner" in graph["worker_svc.server"]
    assert "worker_svc.server" in graph["zerobubble.entrypoints.cli"]  # a lazy import counts
    assert "zerobubble.config" in graph["scheduler_svc.scheduler"]


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_nothing_below_the_roof_imports_it(graph: dict[str, set[str]]) -> None:
    offenders = {name: sorted(d for d in deps if _in(d, ROOF)) for name, deps in graph.items() if not _in(name, ROOF)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_ground_floor_imports_no_service(graph: dict[str, set[str]]) -> None:
    services = ("scheduler_svc", "worker_svc", "kernels")
    ground = [n for n in graph if _in(n, ("zerobubble",)) and not _in(n, ROOF)]
    assert ground, "no ground-floor modules found"
    assert {
        n: sorted(d for d in graph[n] if _in(d, services)) for n in ground if any(_in(d, services) for d in graph[n])
    } == {}


def test_services_do_not_import_each_other(graph: dict[str, set[str]]) -> None:
    pairs = [
        ("scheduler_svc", ("worker_svc", "kernels")),
        ("worker_svc", ("scheduler_svc",)),
        ("kernels", ("scheduler_svc", "worker_svc", "zerobubble")),
    ]
    bad = [(n, d) for side, forbidden in pairs for n in graph if _in(n, (side,)) for d in graph[n] if _in(d, forbidden)]
    assert bad == []


def test_scheduler_side_never_imports_torch(graph: dict[str, set[str]]) -> None:
    # Transitively: everything the scheduler service and the ground floor reach.
    start = [n for n in graph if _in(n, ("scheduler_svc",)) or (_in(n, ("zerobubble",)) and not _in(n, ROOF))]
    seen, todo = set(start), list(start)
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    assert sorted(n for n in seen if imports_anything(ROOT, n, "torch")) == []


def test_internals_package_map_lists_every_module(graph: dict[str, set[str]]) -> None:
    """docs/INTERNALS.md's package map names every module by its path (packages as `dir/`;
    the generated stubs are covered by `zerobubble/api/`)."""
    text = (ROOT / "docs" / "INTERNALS.md").read_text()
    table = text[text.index("## Package map") :]
    table = table[: table.index("\n## ", 3)]
    missing = []
    for name in graph:
        path = name.replace(".", "/")
        is_package = (ROOT / path / "__init__.py").is_file()
        wanted = f"`{path}/`" if is_package else f"`{path}.py`"
        if wanted not in table and not (name.startswith("zerobubble.api.") and "`zerobubble/api/`" in table):
            missing.append(wanted)
    assert missing == []


def test_test_modules_share_helpers_through_helper_modules() -> None:
    """Tests import shared code from helper modules (tests/*.py without `test_`), never from
    another test module or a helper's private name."""
    import ast

    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                if node.module.split(".")[1].startswith("test_"):
                    bad.append(f"{path.name}: from {node.module}")
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []
