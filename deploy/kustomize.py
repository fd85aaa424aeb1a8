"""Render the subset of kustomize that ``deploy/k8s`` uses, so the checker needs no kubectl.

Supported kustomization fields: ``resources`` (files and kustomization directories),
``components``, ``namespace``, ``labels``, ``commonLabels``, ``images``, ``replicas``,
``patches`` (strategic merge by kind/name, or JSON 6902 with a ``target``),
``configMapGenerator`` and ``generatorOptions``. Anything else is an error rather than being
skipped: a field this renderer ignored would be validated as if it had no effect, while
``kubectl apply -k`` would apply it.

Generated ConfigMaps get a content-hash suffix and every pod-spec reference to them is
rewritten, as kustomize does, so that a config change rolls the pods. The suffix is computed
over the final data (after overlay merges); it is not byte-identical to kustomize's.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES: tuple[str, ...] = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS: frozenset[str] = frozenset({
    "apiVersion", "kind", "metadata", "resources", "components", "namespace", "labels",
    "commonLabels", "images", "replicas", "patches", "configMapGenerator", "generatorOptions",
})
# Kinds the namespace transformer must leave alone.
CLUSTER_SCOPED: frozenset[str] = frozenset({
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PriorityClass", "StorageClass", "PersistentVolume", "APIService", "RuntimeClass",
    "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "IngressClass",
})
WORKLOAD_KINDS: frozenset[str] = frozenset({
    "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job",
})
# Strategic-merge keys of the list fields our patches touch (from the Kubernetes API's
# x-kubernetes-patch-merge-key). Lists not named here are replaced wholesale, as in kustomize.
MERGE_KEYS: dict[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "env": "name", "imagePullSecrets": "name", "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey", "resourceClaims": "name",
}
# Internal marker on generated ConfigMaps; removed before the render is returned.
_HASH_MARK = "zerobubble.internal/name-suffix-hash"


class KustomizeError(Exception):
    """A kustomization this renderer cannot build; the message names the file at fault."""


def render(directory: Path) -> list[Obj]:
    """Build the kustomization in ``directory`` into what ``kubectl kustomize`` would emit."""
    objects = _build(directory.resolve(), [], "Kustomization")
    return _finalize(objects)


def object_id(obj: Obj) -> tuple[str, str, str]:
    """(kind, namespace, name): the identity kustomize uses to match patches and detect clashes."""
    meta = obj.get("metadata") or {}
    return (str(obj.get("kind")), str(meta.get("namespace", "")), str(meta.get("name")))


def _load_kustomization(directory: Path) -> tuple[Path, Obj]:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            if not isinstance(data, dict):
                raise KustomizeError(f"{path}: expected a mapping")
            return path, data
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def _inside(base: Path, rel: str, what: str, kfile: Path) -> Path:
    """Resolve a file reference, refusing ones outside the kustomization root.

    kustomize's default load restrictions reject them; accepting them here would let the check
    pass on a tree that ``kubectl apply -k`` refuses.
    """
    path = (base / rel).resolve()
    if not path.is_relative_to(base):
        raise KustomizeError(f"{kfile}: {what} {rel!r} is outside the kustomization directory")
    if not path.is_file():
        raise KustomizeError(f"{kfile}: {what} {rel!r} does not exist")
    return path


def load_documents(path: Path) -> list[Obj]:
    """The Kubernetes objects of a multi-document YAML file (empty documents skipped)."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as exc:
        raise KustomizeError(f"{path}: invalid YAML: {exc}") from exc
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict) or not doc.get("kind") or not doc.get("apiVersion"):
            raise KustomizeError(f"{path}: document {i} is not a Kubernetes object")
        if not (doc.get("metadata") or {}).get("name"):
            raise KustomizeError(f"{path}: document {i} ({doc['kind']}) has no metadata.name")
    return docs


def _build(directory: Path, inherited: list[Obj], expected_kind: str) -> list[Obj]:
    kfile, k = _load_kustomization(directory)
    kind = k.get("kind", "Kustomization")
    if kind != expected_kind:
        raise KustomizeError(f"{kfile}: kind {kind!r} used where a {expected_kind} is expected")
    unknown = sorted(set(k) - SUPPORTED_FIELDS)
    if unknown:
        raise KustomizeError(
            f"{kfile}: unsupported kustomization field(s) {unknown}; deploy/kustomize.py "
            "renders only the subset it documents")

    objects = list(inherited)
    for res in k.get("resources") or []:
        path = (directory / res).resolve()
        if path.is_dir():
            objects.extend(_build(path, [], "Kustomization"))
        else:
            objects.extend(load_documents(_inside(directory, res, "resource", kfile)))
    objects = _generate_configmaps(directory, kfile, k, objects)
    for comp in k.get("components") or []:
        path = (directory / comp).resolve()
        if not path.is_dir():
            raise KustomizeError(f"{kfile}: component {comp!r} is not a directory")
        objects = _build(path, objects, "Component")
    for patch in k.get("patches") or []:
        _apply_patch(directory, kfile, patch, objects)
    if k.get("namespace"):
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    for entry in k.get("labels") or []:
        _add_labels(obj_list=objects, pairs=entry.get("pairs") or {},
                    selectors=bool(entry.get("includeSelectors", False)),
                    templates=bool(entry.get("includeTemplates", False)))
    if k.get("commonLabels"):
        _add_labels(objects, k["commonLabels"], selectors=True, templates=True)
    for image in k.get("images") or []:
        _set_image(objects, image, kfile)
    for rep in k.get("replicas") or []:
        targets = [o for o in objects if o["kind"] in WORKLOAD_KINDS
                   and o["metadata"]["name"] == rep.get("name")]
        if not targets:
            raise KustomizeError(f"{kfile}: replicas entry {rep.get('name')!r} matches no workload")
        for obj in targets:
            obj.setdefault("spec", {})["replicas"] = int(rep["count"])

    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        oid = object_id(obj)
        if oid in seen:
            raise KustomizeError(f"{kfile}: duplicate object {'/'.join(oid)}")
        seen.add(oid)
    return objects


def _parse_env_file(path: Path) -> dict[str, str]:
    data: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise KustomizeError(f"{path}:{lineno}: expected KEY=VALUE")
        data[key.strip()] = value
    return data


def _generate_configmaps(directory: Path, kfile: Path, k: Obj, objects: list[Obj]) -> list[Obj]:
    defaults = k.get("generatorOptions") or {}
    for gen in k.get("configMapGenerator") or []:
        name = gen.get("name")
        if not name:
            raise KustomizeError(f"{kfile}: configMapGenerator entry without a name")
        data: dict[str, str] = {}
        for env in ([gen["env"]] if gen.get("env") else []) + list(gen.get("envs") or []):
            data.update(_parse_env_file(_inside(directory, env, "env file", kfile)))
        for literal in gen.get("literals") or []:
            key, sep, value = str(literal).partition("=")
            if not sep:
                raise KustomizeError(f"{kfile}: literal {literal!r} is not KEY=VALUE")
            data[key] = value
        for spec in gen.get("files") or []:
            key, sep, rel = str(spec).partition("=")
            if not sep:
                key, rel = Path(spec).name, spec
            data[key] = _inside(directory, rel, "file", kfile).read_text()

        options = {**defaults, **(gen.get("options") or {})}
        behavior = gen.get("behavior", "create")
        existing = [o for o in objects if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"] == name
                    and (not gen.get("namespace")
                         or o["metadata"].get("namespace") == gen["namespace"])]
        if behavior == "create":
            if existing:
                raise KustomizeError(f"{kfile}: ConfigMap {name!r} already exists; "
                                     "use behavior: merge or replace")
            cm: Obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
                       "data": data}
            if gen.get("namespace"):
                cm["metadata"]["namespace"] = gen["namespace"]
            objects.append(cm)
        elif behavior in ("merge", "replace"):
            if len(existing) != 1:
                raise KustomizeError(f"{kfile}: behavior {behavior} needs exactly one existing "
                                     f"ConfigMap {name!r}, found {len(existing)}")
            cm = existing[0]
            cm["data"] = {**(cm.get("data") or {}), **data} if behavior == "merge" else data
        else:
            raise KustomizeError(f"{kfile}: unknown configMapGenerator behavior {behavior!r}")

        meta = cm["metadata"]
        if options.get("labels"):
            meta["labels"] = {**(meta.get("labels") or {}), **options["labels"]}
        annotations = {**(meta.get("annotations") or {}), **(options.get("annotations") or {})}
        if behavior == "create" or "disableNameSuffixHash" in options:
            annotations[_HASH_MARK] = "false" if options.get("disableNameSuffixHash") else "true"
        meta["annotations"] = annotations
        if options.get("immutable"):
            cm["immutable"] = True
    return objects


def _matches_target(obj: Obj, target: Obj) -> bool:
    api = str(obj.get("apiVersion", ""))
    group, _, version = api.rpartition("/")
    meta = obj["metadata"]
    checks = {
        "kind": obj["kind"], "name": meta["name"], "namespace": meta.get("namespace", ""),
        "group": group, "version": version,
    }
    for key, value in target.items():
        if key == "labelSelector":
            labels = meta.get("labels") or {}
            for term in str(value).split(","):
                k, _, v = term.partition("=")
                if labels.get(k.strip()) != v.strip():
                    return False
        elif key in checks:
            if checks[key] != value:
                return False
        else:
            raise KustomizeError(f"unsupported patch target field {key!r}")
    return True


def _apply_patch(directory: Path, kfile: Path, entry: Obj, objects: list[Obj]) -> None:
    if "path" in entry:
        source = str(_inside(directory, entry["path"], "patch", kfile))
        body = yaml.safe_load(Path(source).read_text())
    elif "patch" in entry:
        source = f"{kfile} (inline patch)"
        body = yaml.safe_load(entry["patch"])
    else:
        raise KustomizeError(f"{kfile}: patch entry needs 'path' or 'patch'")
    target = entry.get("target")

    if isinstance(body, list):
        if not target:
            raise KustomizeError(f"{source}: a JSON 6902 patch needs a target")
        hits = [o for o in objects if _matches_target(o, target)]
        if not hits:
            raise KustomizeError(f"{source}: target {target} matches no object")
        for obj in hits:
            patched = apply_json6902(obj, body, source)
            obj.clear()
            obj.update(patched)
        return
    if not isinstance(body, dict):
        raise KustomizeError(f"{source}: a patch is a mapping (strategic merge) or a list (6902)")
    if not target:
        meta = body.get("metadata") or {}
        target = {"kind": body.get("kind"), "name": meta.get("name")}
        if meta.get("namespace"):
            target["namespace"] = meta["namespace"]
    hits = [o for o in objects if _matches_target(o, target)]
    if not hits:
        raise KustomizeError(f"{source}: strategic merge patch for {target} matches no object")
    for obj in hits:
        keep = (obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace"))
        patched = strategic_merge(obj, body)
        # A patch applied through a target must not rename what it patches.
        patched["kind"], patched["metadata"]["name"] = keep[0], keep[1]
        if keep[2] is not None:
            patched["metadata"]["namespace"] = keep[2]
        obj.clear()
        obj.update(patched)


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Kubernetes strategic merge: maps merge, keyed lists merge by key, ``null`` deletes a key.

    ``$patch: delete`` on a keyed list item removes it; ``$patch: replace`` on a map replaces it.
    """
    if isinstance(patch, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        merged: dict[str, Any] = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in patch.items():
            if key == "$patch":
                continue
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = _strip_directives(value)
        return merged
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field, base + patch)
        if key is None:
            return _strip_directives(patch)
        result: list[Any] = copy.deepcopy(base)
        added: list[Any] = []
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise KustomizeError(f"list {field!r} item {item!r} lacks merge key {key!r}")
            index = next((i for i, cur in enumerate(result) if cur.get(key) == item[key]), None)
            if item.get("$patch") == "delete":
                if index is not None:
                    del result[index]
            elif index is None:
                added.append(_strip_directives(item))
            else:
                result[index] = strategic_merge(result[index], item, field)
        # kustomize puts items new to the list before the existing ones; doing the same keeps
        # our output comparable with `kubectl kustomize` object for object.
        return added + result
    return copy.deepcopy(patch)


def _merge_key(field: str, items: list[Any]) -> str | None:
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    if field == "ports":
        # Container ports merge on containerPort, Service ports on port.
        return "containerPort" if all("containerPort" in i for i in items) else "port"
    return MERGE_KEYS.get(field)


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items()
                if k != "$patch" and v is not None}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value
                if not (isinstance(v, dict) and v.get("$patch") == "delete")]
    return copy.deepcopy(value)


def _pointer(path: str, source: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"{source}: JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], source: str, path: str) -> Any:
    for part in parts:
        try:
            doc = doc[int(part)] if isinstance(doc, list) else doc[part]
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            raise KustomizeError(f"{source}: path {path!r} does not exist") from exc
    return doc


def apply_json6902(obj: Obj, ops: list[Obj], source: str) -> Obj:
    """Apply RFC 6902 ``add``/``remove``/``replace``/``test`` operations to a copy of ``obj``."""
    doc = copy.deepcopy(obj)
    for op in ops:
        kind, path = op.get("op"), str(op.get("path", ""))
        parts = _pointer(path, source)
        if not parts:
            raise KustomizeError(f"{source}: operations on the whole document are not supported")
        parent = _walk(doc, parts[:-1], source, path)
        last = parts[-1]
        if kind == "test":
            if _walk(doc, parts, source, path) != op.get("value"):
                raise KustomizeError(f"{source}: test failed at {path!r}")
        elif kind == "add":
            value = copy.deepcopy(op.get("value"))
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), value)
            else:
                parent[last] = value
        elif kind in ("remove", "replace"):
            _walk(doc, parts, source, path)  # both require the target to exist
            if kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            else:
                parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(
                    op.get("value"))
        else:
            raise KustomizeError(f"{source}: unsupported JSON 6902 op {kind!r}")
    return doc


def pod_template(obj: Obj) -> Obj | None:
    """The pod template of a workload (``spec`` of its pods' metadata+spec), or None."""
    if obj.get("kind") in WORKLOAD_KINDS:
        return (obj.get("spec") or {}).get("template")
    if obj.get("kind") == "CronJob":
        return ((obj.get("spec") or {}).get("jobTemplate") or {}).get("spec", {}).get("template")
    return None


def containers(pod_spec: Obj) -> Iterator[Obj]:
    """Every container of a pod spec, init containers included."""
    yield from pod_spec.get("initContainers") or []
    yield from pod_spec.get("containers") or []


def _add_labels(obj_list: Iterable[Obj], pairs: dict[str, str], selectors: bool,
                templates: bool) -> None:
    for obj in obj_list:
        meta = obj["metadata"]
        meta["labels"] = {**(meta.get("labels") or {}), **pairs}
        spec = obj.get("spec") or {}
        template = pod_template(obj)
        if template is not None and (templates or selectors):
            tmeta = template.setdefault("metadata", {})
            tmeta["labels"] = {**(tmeta.get("labels") or {}), **pairs}
        if not selectors:
            continue
        if obj["kind"] in WORKLOAD_KINDS or obj["kind"] == "PodDisruptionBudget":
            sel = spec.setdefault("selector", {})
            sel["matchLabels"] = {**(sel.get("matchLabels") or {}), **pairs}
        elif obj["kind"] == "Service":
            spec["selector"] = {**(spec.get("selector") or {}), **pairs}


def _split_image(ref: str) -> tuple[str, str]:
    """("registry/name", "[:tag][@digest]") of an image reference."""
    at = ref.find("@")
    name, digest = (ref[:at], ref[at:]) if at >= 0 else (ref, "")
    colon = name.rfind(":")
    if colon > name.rfind("/"):
        return name[:colon], name[colon:] + digest
    return name, digest


def _set_image(objects: Iterable[Obj], entry: Obj, kfile: Path) -> None:
    if not entry.get("name"):
        raise KustomizeError(f"{kfile}: images entry without a name")
    for obj in objects:
        template = pod_template(obj)
        if template is None:
            continue
        for container in containers(template.get("spec") or {}):
            name, suffix = _split_image(str(container.get("image", "")))
            if name != entry["name"]:
                continue
            new_name = entry.get("newName", name)
            if entry.get("digest"):
                suffix = "@" + entry["digest"]
            elif entry.get("newTag") is not None:
                suffix = f":{entry['newTag']}"
            container["image"] = new_name + suffix


def _config_hash(cm: Obj) -> str:
    canonical = json.dumps({"kind": cm["kind"], "name": cm["metadata"]["name"],
                            "data": cm.get("data") or {}}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def _configmap_refs(pod_spec: Obj) -> Iterator[tuple[Obj, str]]:
    """(mapping, key) pairs holding a ConfigMap name inside a pod spec."""
    for container in containers(pod_spec):
        for src in container.get("envFrom") or []:
            if "configMapRef" in src:
                yield src["configMapRef"], "name"
        for env in container.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("configMapKeyRef")
            if ref:
                yield ref, "name"
    for volume in pod_spec.get("volumes") or []:
        if "configMap" in volume:
            yield volume["configMap"], "name"
        for src in (volume.get("projected") or {}).get("sources") or []:
            if "configMap" in src:
                yield src["configMap"], "name"


def _finalize(objects: list[Obj]) -> list[Obj]:
    renames: dict[tuple[str, str], str] = {}
    for obj in objects:
        meta = obj["metadata"]
        annotations = meta.get("annotations") or {}
        mark = annotations.pop(_HASH_MARK, None)
        if not annotations:
            meta.pop("annotations", None)
        if mark == "true":
            new_name = f"{meta['name']}-{_config_hash(obj)}"
            renames[(meta.get("namespace", ""), meta["name"])] = new_name
            meta["name"] = new_name
    if renames:
        for obj in objects:
            template = pod_template(obj)
            if template is None:
                continue
            namespace = obj["metadata"].get("namespace", "")
            for holder, key in _configmap_refs(template.get("spec") or {}):
                holder[key] = renames.get((namespace, holder.get(key, "")), holder.get(key))
    return objects


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
