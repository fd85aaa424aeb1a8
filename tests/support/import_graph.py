"""The project's import graph, read from source with `ast` (nothing is imported).

Every `import` counts, including those inside functions: a lazy import still makes one module
depend on another. Used by tests/unit/test_layering.py and printable for notes:
`python -m tests.support.import_graph [ROOT]`.
"""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterable
from pathlib import Path

# Import name -> folder: one package, its services and kernels as subpackages.
PACKAGES = {"zerobubble": "zerobubble"}


def module_name(folder: Path, package: str, path: Path) -> str:
    """`zerobubble/api/rpc.py` -> `zerobubble.api.rpc`; a package's `__init__` is the package."""
    parts = [package, *path.relative_to(folder).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def python_files(folder: Path) -> list[Path]:
    """`*.py` under `folder`."""
    return sorted(Path(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(".py"))


def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    return {
        module_name(root / folder, package, p): p
        for package, folder in PACKAGES.items()
        for p in python_files(root / folder)
    }


def _resolve(name: str, modules: Iterable[str]) -> str | None:
    """The longest project module that `name` is or lies inside."""
    known = set(modules)
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(root: Path, name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in `path` (external imports are left out)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports the module pkg.mod when there is one.
            targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
            targets.append(base)
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != name:
                out.add(resolved)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> project modules it imports."""
    modules = project_modules(root)
    return {name: imports_of(root, name, path, modules) for name, path in modules.items()}


def imports_anything(root: Path, name: str, external: str) -> bool:
    """Whether module `name` imports the external top-level package `external` directly."""
    tree = ast.parse(project_modules(root)[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == external for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == external:
            return True
    return False


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
    graph = import_graph(root)
    for name in sorted(graph):
        print(f"{name} -> {', '.join(sorted(graph[name])) or '-'}")
    print("cycles:", cycles(graph) or "none")


if __name__ == "__main__":
    main()
