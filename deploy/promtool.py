"""The alert rules checked and unit-tested by Prometheus's own ``promtool``.

Our schema and metric-name checks cannot tell whether a rule's PromQL parses or whether an alert
fires when it should; promtool can. It ships with Prometheus (Debian/Ubuntu package
``prometheus``). ``promtool check rules`` parses every rule file (the plain one and the rules
inside each rendered PrometheusRule); ``promtool test rules`` runs the unit tests in
``deploy/prometheus/*.test.yaml``, which must give every alert at least one case where it fires
and one where it stays silent.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEFAULT_PROMTOOL = "promtool"
# The package that provides promtool (and the server) on Debian and Ubuntu.
PACKAGE = "prometheus"


class PromtoolMissing(Exception):
    """promtool is not installed; the message says which package provides it."""


def find_promtool(promtool: str = DEFAULT_PROMTOOL) -> str:
    """The path of ``promtool``, or :class:`PromtoolMissing` naming the package to install."""
    path = shutil.which(promtool)
    if path is None:
        raise PromtoolMissing(
            f"{promtool!r} not found on PATH: install the {PACKAGE!r} package "
            f"(apt-get install {PACKAGE}; `make test` does it when run as root) or a Prometheus "
            "release from https://prometheus.io/download/, or pass --promtool PATH"
        )
    return path


@dataclass(frozen=True, slots=True)
class RuleFile:
    """A rules document to check: where it came from (for messages) and its groups."""

    where: str
    groups: list[Any]


def _run(command: Sequence[str], cwd: Path | None = None) -> tuple[bool, str]:
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=120, cwd=cwd, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def check_rules(promtool: str, files: Sequence[RuleFile]) -> list[str]:
    """``promtool check rules`` on each document; one message per document that fails."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="zerobubble-rules-") as tmp:
        for index, rule_file in enumerate(files):
            path = Path(tmp) / f"rules-{index}.yaml"
            path.write_text(yaml.safe_dump({"groups": rule_file.groups}, sort_keys=False))
            ok, output = _run([promtool, "check", "rules", str(path)])
            if not ok:
                problems.append(
                    f"{rule_file.where}: promtool check rules failed:\n{output.replace(str(path), rule_file.where)}"
                )
    return problems


def run_rule_tests(promtool: str, test_files: Sequence[Path]) -> list[str]:
    """``promtool test rules`` on the unit-test files; the failures as promtool prints them."""
    problems: list[str] = []
    for path in test_files:
        # Rule files named in a test file are relative to it.
        ok, output = _run([promtool, "test", "rules", path.name], cwd=path.parent)
        if not ok:
            problems.append(f"{path.name}: promtool test rules failed:\n{output}")
    return problems


def alert_names(groups: Sequence[Any]) -> list[str]:
    """The alert names defined by rule groups, in file order."""
    return [
        str(rule["alert"])
        for group in groups
        for rule in group.get("rules") or []
        if isinstance(rule, dict) and "alert" in rule
    ]


def untested_alerts(groups: Sequence[Any], test_docs: Sequence[Any]) -> list[str]:
    """One message per alert that lacks a unit-test case where it fires, or one where it does not.

    An alert tested only for firing could be one that fires always; one tested only for silence
    could be one that never fires.
    """
    fires: set[str] = set()
    silent: set[str] = set()
    for doc in test_docs:
        for case in (doc or {}).get("tests") or []:
            for check in case.get("alert_rule_test") or []:
                name = str(check.get("alertname"))
                (fires if check.get("exp_alerts") else silent).add(name)
    problems = []
    for name in alert_names(groups):
        missing = [what for what, seen in (("fires", fires), ("stays silent", silent)) if name not in seen]
        if missing:
            problems.append(f"alert {name} has no promtool test case where it {' or where it '.join(missing)}")
    return problems
