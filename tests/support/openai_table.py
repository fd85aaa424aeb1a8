"""The parameter tables of docs/openai-api.md, read for the tests that hold the HTTP API to them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"
STATUSES = ("implemented", "refused", "ignored")
# Section headings of the doc and the endpoints their rows apply to.
SECTIONS = {
    "Both endpoints": ("chat", "completions"),
    "Chat completions only": ("chat",),
    "Completions only": ("completions",),
}


@dataclass(frozen=True)
class Row:
    """One parameter's row: its status and the fields a request adds to show it."""

    name: str
    status: str
    example: dict[str, Any]
    endpoints: tuple[str, ...]


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _code(cell: str) -> str:
    assert cell.startswith("`") and cell.endswith("`"), cell
    return cell[1:-1]


def rows(doc: Path = DOC) -> list[Row]:
    """Every parameter row of the doc's tables, each checked for shape."""
    found: list[Row] = []
    endpoints: tuple[str, ...] | None = None
    for line in doc.read_text().splitlines():
        if line.startswith("## "):
            endpoints = SECTIONS.get(line[3:].strip())
        elif endpoints is not None and line.startswith("| `"):
            name, status, example, _notes = _cells(line)
            row = Row(_code(name), status, json.loads(_code(example)), endpoints)
            assert row.status in STATUSES, line
            assert row.name in row.example, f"{row.name}: its example does not set it"
            found.append(row)
    return found


def parameters(endpoint: str) -> set[str]:
    """The parameters the doc lists for ``endpoint`` ("chat" or "completions")."""
    return {row.name for row in rows() if endpoint in row.endpoints}
