"""The architecture as a checked fact: floors of the import graph, no cycles, no torch upstairs.

Floors, bottom up: the ground floor (`zerobubble` minus its roof and its services: wire stubs,
rpc helpers, settings, metrics, the client); the two services (`zerobubble.scheduler_svc`,
`zerobubble.worker_svc` over `zerobubble.kernels`), which never import each other; the roof (`zerobubble.entrypoints`,
`zerobubble.tools`, `zerobubble.__main__`), which nothing below imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.import_graph import cycles, import_graph, imports_anything, project_modules, python_files

ROOT = Path(__file__).resolve().parents[2]
ROOF = ("zerobubble.entrypoints", "zerobubble.tools", "zerobubble.__main__")
SCHEDULER, WORKER, KERNELS = "zerobubble.scheduler_svc", "zerobubble.worker_svc", "zerobubble.kernels"
SERVICES = (SCHEDULER, WORKER, KERNELS)
BARE_NAMES = ("scheduler_svc", "worker_svc", "kernels")


def _in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _ground(graph: dict[str, set[str]]) -> list[str]:
    return [n for n in graph if _in(n, ("zerobubble",)) and not _in(n, ROOF + SERVICES)]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT)


def test_the_graph_sees_the_known_edges(graph: dict[str, set[str]]) -> None:
    # Guards the parser itself: if these vanished, the other tests would pass vacuously.
    assert "zerobubble.scheduler_svc.scheduler" in graph["zerobubble.scheduler_svc.router"]
    assert "zerobubble.worker_svc.runner" in graph["zerobubble.worker_svc.server"]
    assert "zerobubble.worker_svc.server" in graph["zerobubble.entrypoints.cli"]  # a lazy import counts
    assert "zerobubble.kernels.attention" in graph["zerobubble.worker_svc.model"]
    assert "zerobubble.config" in graph["zerobubble.scheduler_svc.scheduler"]


def test_no_top_level_name_of_ours_but_zerobubble() -> None:
    """The services import as `zerobubble.*` only: a bare `import kernels` would find Hugging
    Face's distribution, and a bare `scheduler_svc` would load a second copy of every module."""
    bare = []
    for folder in ("zerobubble", "scheduler_svc", "worker_svc", "kernels", "deploy", "scripts", "tests"):
        for path in python_files(ROOT / folder):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                bare += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in BARE_NAMES]
    assert bare == []


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_nothing_below_the_roof_imports_it(graph: dict[str, set[str]]) -> None:
    offenders = {name: sorted(d for d in deps if _in(d, ROOF)) for name, deps in graph.items() if not _in(name, ROOF)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_ground_floor_imports_no_service(graph: dict[str, set[str]]) -> None:
    ground = _ground(graph)
    assert ground, "no ground-floor modules found"
    assert {
        n: sorted(d for d in graph[n] if _in(d, SERVICES)) for n in ground if any(_in(d, SERVICES) for d in graph[n])
    } == {}


def test_services_do_not_import_each_other(graph: dict[str, set[str]]) -> None:
    pairs = [
        (SCHEDULER, (WORKER, KERNELS)),
        (WORKER, (SCHEDULER,)),
        (KERNELS, (SCHEDULER, WORKER)),
    ]
    bad = [(n, d) for side, forbidden in pairs for n in graph if _in(n, (side,)) for d in graph[n] if _in(d, forbidden)]
    # The kernels import nothing of the project's outside themselves.
    bad += [(n, d) for n in graph if _in(n, (KERNELS,)) for d in graph[n] if not _in(d, (KERNELS,))]
    assert bad == []


def test_scheduler_side_never_imports_torch(graph: dict[str, set[str]]) -> None:
    # Transitively: everything the scheduler service and the ground floor reach.
    start = [n for n in graph if _in(n, (SCHEDULER,))] + _ground(graph)
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
    for name, file in project_modules(ROOT).items():
        rel = file.relative_to(ROOT)
        wanted = f"`{rel.parent}/`" if rel.name == "__init__.py" else f"`{rel}`"
        if wanted not in table and not (name.startswith("zerobubble.api.") and "`zerobubble/api/`" in table):
            missing.append(wanted)
    assert missing == []


def test_test_modules_share_helpers_through_tests_support() -> None:
    """Shared test code lives in tests/support/ and is imported from there, never from another
    test module or by a helper's private name; no helper module lies loose beside the tests."""
    import ast

    loose = sorted(p.name for p in (ROOT / "tests").glob("*.py") if p.name not in ("__init__.py", "conftest.py"))
    bad = []
    for path in python_files(ROOT / "tests"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests"):
                if not (node.module or "").startswith("tests.support"):
                    bad.append(f"{path.name}: from {node.module}")
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert (loose, bad) == ([], [])
