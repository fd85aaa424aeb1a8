"""Kubernetes objects as ``kubectl apply -k`` sends them: rendering and walking.

Overlays are rendered with ``kubectl kustomize``, the kustomize built into kubectl, so what the
checker validates is byte for byte what ``kubectl apply -k`` would apply (ConfigMap hash
suffixes included). kubectl is the one tool every operator of these manifests already has.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

DEFAULT_KUBECTL = "kubectl"
WORKLOAD_KINDS: frozenset[str] = frozenset(
    {
        "Deployment",
        "StatefulSet",
        "DaemonSet",
        "ReplicaSet",
        "Job",
    }
)


class RenderError(Exception):
    """An overlay that could not be rendered; the message says why (missing tool, bad file)."""


def find_kubectl(kubectl: str = DEFAULT_KUBECTL) -> str:
    """The path of ``kubectl``, or a :class:`RenderError` that names the missing tool."""
    path = shutil.which(kubectl)
    if path is None:
        raise RenderError(
            f"{kubectl!r} not found on PATH: overlays are rendered with `kubectl kustomize` "
            "(exactly what `kubectl apply -k` sends); install kubectl "
            "(https://kubernetes.io/docs/tasks/tools/) or pass --kubectl PATH"
        )
    return path


def render(overlay: Path, kubectl: str = DEFAULT_KUBECTL, timeout: float = 120.0) -> list[Obj]:
    """Every object ``kubectl apply -k overlay`` would send, in kustomize's output order."""
    command = [find_kubectl(kubectl), "kustomize", str(overlay)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RenderError(f"{kubectl} kustomize {overlay}: {exc}") from exc
    if proc.returncode != 0:
        raise RenderError(f"{kubectl} kustomize {overlay} failed: {proc.stderr.strip()}")
    try:
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    except yaml.YAMLError as exc:
        raise RenderError(f"{kubectl} kustomize {overlay} printed invalid YAML: {exc}") from exc


def object_id(obj: Obj) -> tuple[str, str, str]:
    """(kind, namespace, name): how kustomize and the API server tell objects apart."""
    meta = obj.get("metadata") or {}
    return (str(obj.get("kind")), str(meta.get("namespace", "")), str(meta.get("name")))


def pod_templates(obj: Obj) -> list[Obj]:
    """The pod templates (metadata + spec) of a workload: one for the built-in kinds, a
    LeaderWorkerSet's leader and worker templates (the worker's alone when it has no leader
    template of its own), none for other kinds."""
    spec = obj.get("spec") or {}
    if obj.get("kind") in WORKLOAD_KINDS:
        return [spec["template"]] if spec.get("template") else []
    if obj.get("kind") == "CronJob":
        template = ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template")
        return [template] if template else []
    if obj.get("kind") == "LeaderWorkerSet":
        group = spec.get("leaderWorkerTemplate") or {}
        return [group[key] for key in ("leaderTemplate", "workerTemplate") if group.get(key)]
    return []


def containers(pod_spec: Obj) -> Iterator[Obj]:
    """Every container of a pod spec, init containers included."""
    yield from pod_spec.get("initContainers") or []
    yield from pod_spec.get("containers") or []


def walk_strings(value: Any, visit: Callable[[str], None]) -> None:
    """Call ``visit`` on every string inside a nested structure of dicts and lists."""
    if isinstance(value, str):
        visit(value)
    elif isinstance(value, dict):
        for v in value.values():
            walk_strings(v, visit)
    elif isinstance(value, list):
        for v in value:
            walk_strings(v, visit)
