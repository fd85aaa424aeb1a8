"""The documentation speaks of the product and stays inside the repository.

README.md is for users and short; every relative link in it and under docs/ resolves; nothing
names a folder outside the clone; and no file carries the vocabulary of a development log.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 300
SKIP_DIRS = {
    ".git",
    "build",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "node_modules",
}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yaml", ".yml", ".env", ".proto", ".cfg", ".txt", ".json", ""}
# Written so that these lines do not match themselves.
OUTSIDE_THE_REPOSITORY = re.compile(r"\.\." + r"/shared")
LOG_NUMBERING = re.compile(r"\b" + "sess" + r"ions? [0-9]+", re.IGNORECASE)
LOG_PHRASES = re.compile(r"\bthe " + "VM" + r"\b|quiet " + "hour|" + "issue's targets", re.IGNORECASE)
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _repository_files() -> list[Path]:
    """Text files of the clone, without environments, caches and build output."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")]
        files += [Path(folder, n) for n in names if Path(n).suffix in TEXT_SUFFIXES or n == "Makefile"]
    return files


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_short() -> None:
    num_lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert num_lines <= README_MAX_LINES, f"README.md has {num_lines} lines; move detail to docs/"


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in MARKDOWN_LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        # The CPU comparison with llama.cpp gets its page with its measurement.
        if target.endswith("cpu-llamacpp.md"):
            continue
        if not (doc.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert broken == [], f"{doc.relative_to(ROOT)}: links to missing files"


def test_nothing_refers_to_a_folder_outside_the_repository() -> None:
    hits = [
        str(p.relative_to(ROOT))
        for p in _repository_files()
        if OUTSIDE_THE_REPOSITORY.search(p.read_text(encoding="utf-8", errors="replace"))
    ]
    assert hits == []


def test_no_development_log_numbering_anywhere() -> None:
    hits = [
        str(p.relative_to(ROOT))
        for p in _repository_files()
        if LOG_NUMBERING.search(p.read_text(encoding="utf-8", errors="replace"))
    ]
    assert hits == [], "figures carry hardware, date and commit, not the order they were found in"


def test_docs_name_the_hardware_not_the_workplace() -> None:
    hits = [str(p.relative_to(ROOT)) for p in _docs() if LOG_PHRASES.search(p.read_text(encoding="utf-8"))]
    assert hits == []


def test_openai_control_rows_are_current() -> None:
    """docs/openai-api.md's rows of the sampling and stopping controls are generated from the
    request model: a control added there is documented by rerunning the generator."""
    from zerobubble.tools import control_table

    text = control_table.DOC.read_text(encoding="utf-8")
    assert control_table.updated(text) == text, f"stale: run `{control_table.FIX_COMMAND}`"
