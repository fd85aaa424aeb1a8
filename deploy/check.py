"""``python -m deploy.check``: render every Kubernetes overlay and validate it offline.

What a wrong manifest costs is a failed rollout in someone's cluster, so this checks what
``kubectl apply --dry-run=server`` and a first day in production would catch, without either:

- every overlay under ``k8s/overlays`` renders with ``kubectl kustomize``, and what it prints
  (exactly what ``kubectl apply -k`` would send) is what the checks below see;
- every object validates in strict mode against the Kubernetes schemas of ``--k8s-version``
  (``kubernetes-validate``), and Prometheus Operator objects against ``deploy/schemas/``;
- references hold together: Service selectors and target ports, probe ports, the headless
  Service the scheduler dials, HPA and PDB targets, ServiceMonitor ports, ConfigMaps, images;
- every ``ZEROBUBBLE_*`` variable is a flag of the CLI subcommand that reads it, every flag is
  reachable, and secret flags come from Secrets;
- every ``zerobubble_*`` metric in the dashboard, the alert rules and the autoscaler exists in
  ``zerobubble.metrics`` with the labels it is queried by;
- the PrometheusRule object and the plain rules file carry the same rules, ``promtool check
  rules`` accepts both, and ``promtool test rules`` passes unit tests in which every alert both
  fires and stays silent (``deploy/prometheus/*.test.yaml``).

Exit status 0 when everything holds, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import referencing
import yaml

from deploy import promtool as prom
from deploy.groups import check_network_policies, check_worker_group, expand, is_leader, template_variables
from deploy.manifests import (
    DEFAULT_KUBECTL,
    Obj,
    RenderError,
    containers,
    find_kubectl,
    object_id,
    pod_templates,
    render,
    walk_strings,
)
from zerobubble.config import (
    ENV_PREFIX,
    ConfigError,
    SchedulerServiceConfig,
    WorkerConfig,
    check_scheduler_fits_worker,
    env_name,
    flag_name,
    from_env,
    secret_settings,
    service_settings,
)
from zerobubble.metrics import METRIC_NAMES, metric_spec

DEFAULT_ROOT = Path(__file__).resolve().parent
# A version the managed offerings (EKS, GKE, AKS) all still support; native gRPC probes (1.27)
# and unhealthyPodEvictionPolicy (1.31 GA) are both older.
DEFAULT_K8S_VERSION = "1.33"

# The services the manifests run; their flags are read from `zerobubble.config` (cli_flags),
# the module the CLI generates them from, so the checker cannot drift from `--help`.
SERVICES: tuple[str, ...] = ("worker", "scheduler")
# ZEROBUBBLE_* variables that are read by the code rather than the CLI, and what reads them.
NON_FLAG_ENV: dict[str, str] = {
    "ZEROBUBBLE_CACHE_DIR": "zerobubble.worker_svc.model_loader (converted-model cache root)",
}
# Credentials and key material: never in a ConfigMap, which any reader of the namespace sees.
SECRET_FLAGS: frozenset[str] = frozenset(flag_name(n)[2:] for n in secret_settings())
# Labels Prometheus (with the Operator's ServiceMonitor) attaches to every scraped series.
TARGET_LABELS: frozenset[str] = frozenset(
    {
        "job",
        "instance",
        "namespace",
        "pod",
        "service",
        "endpoint",
        "container",
    }
)
METRIC_RE = re.compile(r"(?<![A-Za-z0-9_:])zerobubble_[A-Za-z0-9_]+(?![A-Za-z0-9_:])")
SELECTOR_RE = re.compile(r"(?<![A-Za-z0-9_:])(zerobubble_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
WORKERS_RE = re.compile(r"^dns:///(?P<svc>[a-z0-9-]+)\.(?P<ns>[a-z0-9-]+)\.svc(?:\.[a-z0-9.-]+)?:(?P<port>\d+)$")
RULES_FILE = Path("prometheus") / "zerobubble-rules.yaml"
RULE_TESTS_GLOB = "*.test.yaml"


@dataclass(slots=True)
class Result:
    """What a check run found: problems fail the run, notes are for the operator."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def fail(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")


def _describe(obj: Obj) -> str:
    kind, namespace, name = object_id(obj)
    return f"{kind} {namespace + '/' if namespace else ''}{name}"


def _suggest(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


# --- schemas -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Schemas:
    """The vendored JSON schemas of ``deploy/schemas``, resolvable by ``$id`` from each other."""

    by_file: dict[str, dict[str, Any]]
    registry: referencing.Registry

    @classmethod
    def load(cls, directory: Path) -> Schemas:
        by_file: dict[str, dict[str, Any]] = {}
        resources = []
        for path in sorted(directory.glob("*.json")):
            schema = json.loads(path.read_text())
            jsonschema.Draft202012Validator.check_schema(schema)
            by_file[path.name] = schema
            resources.append((schema["$id"], referencing.Resource.from_contents(schema)))
        return cls(by_file=by_file, registry=referencing.Registry().with_resources(resources))

    def errors(self, filename: str, instance: Any) -> list[str] | None:
        """One message per violation, or None when there is no such schema file."""
        schema = self.by_file.get(filename)
        if schema is None:
            return None
        validator = jsonschema.Draft202012Validator(schema, registry=self.registry)
        found = sorted(validator.iter_errors(instance), key=lambda e: list(map(str, e.path)))
        return [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in found]


def _crd_schema_file(obj: Obj) -> str:
    group_version = str(obj.get("apiVersion", ""))
    return f"{group_version.replace('/', '_')}_{str(obj.get('kind', '')).lower()}.json"


def check_schema(obj: Obj, schemas: Schemas, k8s_version: str, where: str, result: Result) -> None:
    """Validate one object: built-in kinds strictly against Kubernetes, CRDs against ours."""
    try:
        kubernetes_validate.validate(obj, k8s_version, strict=True)
        return
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(map(str, exc.path)) or "<root>"
        result.fail(where, f"{_describe(obj)}: {path}: {exc.message}")
        return
    except kubernetes_validate.SchemaNotFoundError:
        pass
    filename = _crd_schema_file(obj)
    errors = schemas.errors(filename, obj)
    if errors is None:
        result.fail(
            where,
            f"{_describe(obj)}: no schema for {obj.get('apiVersion')} "
            f"{obj.get('kind')} in Kubernetes {k8s_version}; vendor one as "
            f"deploy/schemas/{filename}",
        )
        return
    for message in errors:
        result.fail(where, f"{_describe(obj)}: {message}")
    if not errors:
        for template in pod_templates(obj):
            _check_embedded_template(obj, template, k8s_version, where, result)


def _check_embedded_template(obj: Obj, template: Obj, k8s_version: str, where: str, result: Result) -> None:
    """A custom resource's pod template, strictly against Kubernetes' own PodTemplateSpec."""
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    try:
        kubernetes_validate.validate(wrapped, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(map(str, exc.path)) or "<root>"
        result.fail(where, f"{_describe(obj)}: pod {path}: {exc.message}")


# --- references between objects ----------------------------------------------------------------


def _workloads(objects: Sequence[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objects:
        for template in pod_templates(obj):
            yield obj, template


def _ns(obj: Obj) -> str:
    return str(obj["metadata"].get("namespace", ""))


def _selects(selector: dict[str, str] | None, labels: dict[str, str] | None) -> bool:
    if not selector:
        return False
    return all((labels or {}).get(k) == v for k, v in selector.items())


def _container_ports(template: Obj) -> tuple[set[str], set[int]]:
    names: set[str] = set()
    numbers: set[int] = set()
    for container in containers(template.get("spec") or {}):
        for port in container.get("ports") or []:
            numbers.add(int(port["containerPort"]))
            if port.get("name"):
                names.add(str(port["name"]))
    return names, numbers


def _port_exists(port: Any, names: set[str], numbers: set[int]) -> bool:
    return port in names if isinstance(port, str) else int(port) in numbers


def check_references(objects: Sequence[Obj], where: str, result: Result) -> None:
    """Cross-object consistency that schemas cannot see."""
    refs = _Refs(objects, where, result)
    namespaces = {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
    by_kind = {
        "Service": refs.service,
        "PodDisruptionBudget": refs.disruption_budget,
        "StatefulSet": refs.stateful_set,
        "HorizontalPodAutoscaler": refs.autoscaler,
        "ServiceMonitor": refs.service_monitor,
    }
    for obj in objects:
        ns = _ns(obj)
        if obj["kind"] != "Namespace" and ns and ns not in namespaces:
            result.fail(
                where, f"{_describe(obj)}: namespace {ns!r} is not created by this overlay (add a Namespace object)"
            )
        if obj["kind"] in by_kind:
            by_kind[obj["kind"]](obj, obj.get("spec") or {}, ns, _describe(obj))
    configmaps = {(_ns(o), o["metadata"]["name"]) for o in objects if o["kind"] == "ConfigMap"}
    for obj, template in refs.workloads:
        _check_pod(obj, template, configmaps, where, result)


class _Refs:
    """The reference checks of each kind of object, over one overlay's objects."""

    def __init__(self, objects: Sequence[Obj], where: str, result: Result) -> None:
        self.objects = objects
        self.by_id = {object_id(o): o for o in objects}
        self.workloads = list(_workloads(objects))
        self.where, self.result = where, result

    def _templates(self, ns: str, selector: Any) -> list[Obj]:
        return [
            t for w, t in self.workloads if _ns(w) == ns and _selects(selector, (t.get("metadata") or {}).get("labels"))
        ]

    def service(self, obj: Obj, spec: Obj, ns: str, what: str) -> None:
        matched = self._templates(ns, spec.get("selector"))
        if not matched:
            self.result.fail(self.where, f"{what}: selector {spec.get('selector')} matches no pod template")
        for port in spec.get("ports") or []:
            target = port.get("targetPort", port.get("port"))
            if matched and not all(_port_exists(target, *_container_ports(t)) for t in matched):
                self.result.fail(
                    self.where,
                    f"{what}: targetPort {target!r} of port "
                    f"{port.get('name', port.get('port'))} is not a container port",
                )

    def disruption_budget(self, obj: Obj, spec: Obj, ns: str, what: str) -> None:
        selector = (spec.get("selector") or {}).get("matchLabels")
        if not self._templates(ns, selector):
            self.result.fail(self.where, f"{what}: selector {selector} matches no pod template")

    def stateful_set(self, obj: Obj, spec: Obj, ns: str, what: str) -> None:
        svc = self.by_id.get(("Service", ns, str(spec.get("serviceName"))))
        if svc is None or (svc.get("spec") or {}).get("clusterIP") != "None":
            self.result.fail(
                self.where,
                f"{what}: serviceName {spec.get('serviceName')!r} must name a "
                "headless Service (clusterIP: None) of this overlay",
            )

    def autoscaler(self, obj: Obj, spec: Obj, ns: str, what: str) -> None:
        ref = spec.get("scaleTargetRef") or {}
        target = self.by_id.get((str(ref.get("kind")), ns, str(ref.get("name"))))
        if target is None:
            self.result.fail(self.where, f"{what}: scaleTargetRef {ref.get('kind')}/{ref.get('name')} does not exist")
        elif "replicas" in (target.get("spec") or {}):
            self.result.fail(
                self.where,
                f"{what}: {_describe(target)} sets spec.replicas; every apply "
                "would reset what the autoscaler chose (leave it out)",
            )
        for metric in spec.get("metrics") or []:
            body = metric.get(str(metric.get("type", "")).lower()) or {}
            name = str((body.get("metric") or {}).get("name", ""))
            if name.startswith("zerobubble_") and name not in METRIC_NAMES:
                self.result.fail(
                    self.where, f"{what}: autoscaling metric {name!r} is not exported{_suggest(name, METRIC_NAMES)}"
                )

    def service_monitor(self, obj: Obj, spec: Obj, ns: str, what: str) -> None:
        ns_sel = spec.get("namespaceSelector") or {}
        allowed = None if ns_sel.get("any") else set(ns_sel.get("matchNames") or [ns])
        services = [
            o
            for o in self.objects
            if o["kind"] == "Service"
            and (allowed is None or _ns(o) in allowed)
            and _selects((spec.get("selector") or {}).get("matchLabels"), o["metadata"].get("labels"))
        ]
        if not services:
            self.result.fail(self.where, f"{what}: selector matches no Service")
        port_names = {p.get("name") for s in services for p in (s.get("spec") or {}).get("ports") or []}
        for endpoint in spec.get("endpoints") or []:
            port = endpoint.get("port")
            if port and services and port not in port_names:
                self.result.fail(
                    self.where, f"{what}: endpoint port {port!r} is not a port name of the selected Services"
                )


def _check_pod(obj: Obj, template: Obj, configmaps: set[tuple[str, str]], where: str, result: Result) -> None:
    what = _describe(obj)
    ns = _ns(obj)
    pod = template.get("spec") or {}
    names, numbers = _container_ports(template)
    pod_sc = pod.get("securityContext") or {}
    if pod_sc.get("runAsNonRoot") is not True:
        result.fail(where, f"{what}: pod securityContext.runAsNonRoot must be true")
    if (pod_sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        result.fail(where, f"{what}: pod securityContext.seccompProfile.type must be RuntimeDefault")
    if pod.get("enableServiceLinks") is not False:
        # Service env vars such as ZEROBUBBLE_SCHEDULER_PORT=tcp://... share our flag prefix.
        result.fail(where, f"{what}: set enableServiceLinks: false (service env vars collide with ZEROBUBBLE_* flags)")
    for volume in pod.get("volumes") or []:
        ref = volume.get("configMap")
        if ref and not ref.get("optional") and (ns, ref.get("name")) not in configmaps:
            result.fail(where, f"{what}: volume {volume['name']} uses missing ConfigMap {ref.get('name')!r}")
        if volume.get("secret"):
            result.notes.append(f"{where}: {what} needs Secret {volume['secret']['secretName']}")
    for container in containers(pod):
        cname = f"{what} container {container['name']}"
        image = str(container.get("image", ""))
        has_tag = "@" in image or ":" in image.rsplit("/", 1)[-1]
        if "/" not in image or not has_tag or image.endswith(":latest"):
            result.fail(
                where, f"{cname}: image {image!r} is not a pinned registry image; set it in the overlay's images:"
            )
        sc = container.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            result.fail(where, f"{cname}: securityContext.allowPrivilegeEscalation must be false")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            result.fail(where, f"{cname}: securityContext.capabilities.drop must include ALL")
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(probe_name) or {}
            for handler in ("grpc", "tcpSocket", "httpGet"):
                if handler in probe and not _port_exists(probe[handler].get("port"), names, numbers):
                    result.fail(
                        where,
                        f"{cname}: {probe_name}.{handler}.port {probe[handler].get('port')!r} is not a container port",
                    )
        for src in container.get("envFrom") or []:
            ref = src.get("configMapRef")
            if ref and not ref.get("optional") and (ns, ref.get("name")) not in configmaps:
                result.fail(where, f"{cname}: envFrom uses missing ConfigMap {ref.get('name')!r}")
        for env in container.get("env") or []:
            secret = (env.get("valueFrom") or {}).get("secretKeyRef")
            if secret:
                optional = " (optional)" if secret.get("optional") else ""
                result.notes.append(f"{where}: {cname} reads Secret {secret['name']} key {secret['key']}{optional}")


# --- CLI flags in the environment --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnvValue:
    """Where a container's env var comes from: a literal, a ConfigMap, a Secret, a field."""

    source: str  # "value" | "configmap" | "secret" | "field" | "other"
    value: str | None


def container_env(container: Obj, configmaps: dict[str, Obj]) -> dict[str, EnvValue]:
    """The container's environment as the kubelet builds it (later entries win)."""
    env: dict[str, EnvValue] = {}
    for src in container.get("envFrom") or []:
        prefix = str(src.get("prefix", ""))
        if "configMapRef" in src:
            cm = configmaps.get(src["configMapRef"].get("name"), {})
            for key, value in (cm.get("data") or {}).items():
                env[prefix + key] = EnvValue("configmap", str(value))
        elif "secretRef" in src:
            env[f"{prefix}<all keys of Secret {src['secretRef'].get('name')}>"] = EnvValue("secret", None)
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = EnvValue("value", str(item["value"]))
        else:
            ref = item.get("valueFrom") or {}
            if "configMapKeyRef" in ref:
                cm = configmaps.get(ref["configMapKeyRef"].get("name"), {})
                env[item["name"]] = EnvValue("configmap", (cm.get("data") or {}).get(ref["configMapKeyRef"].get("key")))
            elif "secretKeyRef" in ref:
                env[item["name"]] = EnvValue("secret", None)
            elif "fieldRef" in ref:
                env[item["name"]] = EnvValue("field", None)
            else:
                env[item["name"]] = EnvValue("other", None)
    return env


def _secret_mounts(pod: Obj, container: Obj) -> list[str]:
    secret_volumes = {
        v["name"]
        for v in pod.get("volumes") or []
        if "secret" in v or any("secret" in s for s in (v.get("projected") or {}).get("sources") or [])
    }
    return [
        m["mountPath"].rstrip("/") + "/" for m in container.get("volumeMounts") or [] if m.get("name") in secret_volumes
    ]


def cli_flags() -> dict[str, tuple[str, ...]]:
    """Long flags (without ``--``) of each service command, from `zerobubble.config`."""
    return {service: tuple(flag_name(f.name)[2:] for _, f in service_settings(service)) for service in SERVICES}


def parse_with_cli(service: str, env: dict[str, str]) -> tuple[object | None, str]:
    """The config ``zerobubble <service>`` would build with only ``env`` set, as the container
    starts; or None and the reason (a bad choice, a non-number, a bad flag combination)."""
    cls = {"worker": WorkerConfig, "scheduler": SchedulerServiceConfig}[service]
    try:
        return from_env(cls, env), ""
    except (ConfigError, TypeError) as exc:
        return None, str(exc)


def _stand_in(value: EnvValue) -> str | None:
    # What the kubelet would put there at run time; any non-empty string parses like it.
    if value.source in ("value", "configmap"):
        return value.value
    return {"secret": "from-a-secret", "field": "zerobubble-worker-0"}.get(value.source)


@dataclass(frozen=True)
class _ContainerEnv:
    """One zerobubble container of a workload and the environment its manifests give it."""

    cname: str  # how messages name it
    service: str  # worker or scheduler
    flags: tuple[str, ...]  # the service's long flags
    env: dict[str, EnvValue]  # every variable, ours or not
    pod: Obj
    container: Obj
    configmaps: dict[str, Obj]  # of its namespace, by name
    variables: dict[str, str]  # what the workload's controller sets first in its environment (deploy.groups)

    def ours(self) -> dict[str, EnvValue]:
        return {k: v for k, v in self.env.items() if k.startswith(ENV_PREFIX)}

    def known(self) -> dict[str, str]:
        """The flag each ZEROBUBBLE_* variable of the service sets, by variable."""
        return {env_name(f): f for f in self.flags}


def check_flags(
    objects: Sequence[Obj],
    where: str,
    result: Result,
    reachable: dict[str, set[str]],
    service_flags: dict[str, tuple[str, ...]],
) -> None:
    """ZEROBUBBLE_* variables against the CLI flags; adds what each service can reach."""
    by_id = {object_id(o): o for o in objects}
    parsed: dict[str, list[tuple[str, Any]]] = {}
    for obj, template in _workloads(objects):
        ns = _ns(obj)
        configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap" and _ns(o) == ns}
        pod = template.get("spec") or {}
        for container in containers(pod):
            cname = f"{_describe(obj)} container {container['name']}"
            args = [str(a) for a in container.get("args") or []]
            service = args[0] if args else ""
            env = container_env(container, configmaps)
            if service not in service_flags:
                if ours := sorted(k for k in env if k.startswith(ENV_PREFIX)):
                    result.fail(where, f"{cname}: sets {ours} but its args {args} run no zerobubble worker/scheduler")
                continue
            variables = template_variables(obj, template)
            c = _ContainerEnv(cname, service, service_flags[service], env, pod, container, configmaps, variables)
            _check_no_secrets_in_configmaps(c, where, result)
            _check_env_names(c, where, result, reachable)
            if is_leader(obj, template):  # the other pods of a group serve nothing
                _check_flag_values(service, c.ours(), template, ns, by_id, cname, where, result)
            config = _parse_container_env(c, where, result)
            if config is None:
                continue
            if service == "worker":
                raw_rank = env.get(env_name("node-rank"))
                rank_text = raw_rank.value if raw_rank is not None else None
                for problem in check_worker_group(config, obj, template, container, rank_text):
                    result.fail(where, f"{cname}: {problem}")
            if is_leader(obj, template):
                parsed.setdefault(service, []).append((cname, config))
    for sname, sched in parsed.get("scheduler", []):
        for wname, work in parsed.get("worker", []):
            try:
                check_scheduler_fits_worker(sched, work)
            except ConfigError as exc:
                result.fail(where, f"{sname}: {exc} ({wname})")


def _check_no_secrets_in_configmaps(c: _ContainerEnv, where: str, result: Result) -> None:
    secret_names = {env_name(f) for f in SECRET_FLAGS}
    for src in c.container.get("envFrom") or []:
        name = (src.get("configMapRef") or {}).get("name")
        cm = c.configmaps.get(name, {}) if isinstance(name, str) else {}
        # Checked on the ConfigMap itself: an env entry may shadow the key, but the
        # value is still readable by anyone who can read ConfigMaps.
        for key in sorted(secret_names & set(cm.get("data") or {})):
            result.fail(where, f"{c.cname}: ConfigMap {cm['metadata']['name']} holds {key}; secrets belong in a Secret")


def _check_env_names(c: _ContainerEnv, where: str, result: Result, reachable: dict[str, set[str]]) -> None:
    """Each ZEROBUBBLE_* variable names a flag of the service, from the right kind of source;
    every flag but the secret ones is set."""
    known = c.known()
    for name, value in sorted(c.env.items()):
        if name.startswith("<all keys of Secret"):
            result.fail(
                where,
                f"{c.cname}: envFrom secretRef hides which flags it sets; use env[].valueFrom.secretKeyRef per flag",
            )
            continue
        if not name.startswith(ENV_PREFIX) or name in NON_FLAG_ENV:
            continue
        if name not in known:
            result.fail(
                where, f"{c.cname}: {name} is not a flag of `zerobubble {c.service}`{_suggest(name, list(known))}"
            )
            continue
        flag = known[name]
        reachable.setdefault(c.service, set()).add(flag)
        if flag in SECRET_FLAGS:
            _check_secret_flag(flag, name, value, c.pod, c.container, c.cname, where, result)
        elif value.source == "secret":
            result.fail(where, f"{c.cname}: {name} comes from a Secret but is not secret")
    ours = c.ours()
    for flag in (f for f in c.flags if f not in SECRET_FLAGS and env_name(f) not in ours):
        result.fail(
            where,
            f"{c.cname}: --{flag} is not reachable from the manifests; add {env_name(flag)} to its ConfigMap",
        )


def _parse_container_env(c: _ContainerEnv, where: str, result: Result) -> object | None:
    """The config the container's service builds from its environment (None: it refuses it)."""
    known = c.known()
    values = {
        k: expand(v, c.variables)
        for k, v in ((k, _stand_in(e)) for k, e in c.ours().items() if k in known)
        if v is not None
    }
    config, error = parse_with_cli(c.service, values)
    if config is None:
        result.fail(where, f"{c.cname}: `zerobubble {c.service}` rejects its environment: {error}")
    return config


def _check_secret_flag(
    flag: str, name: str, value: EnvValue, pod: Obj, container: Obj, cname: str, where: str, result: Result
) -> None:
    if value.source == "configmap":
        result.fail(where, f"{cname}: {name} is a secret and must not come from a ConfigMap")
    elif flag in ("auth-token", "worker-auth-token") and value.source != "secret":
        result.fail(where, f"{cname}: {name} must come from a secretKeyRef")
    elif value.source == "value":
        # TLS flags hold file paths; the files themselves must come from a Secret volume.
        mounts = _secret_mounts(pod, container)
        if not any(str(value.value).startswith(m) for m in mounts):
            result.fail(
                where, f"{cname}: {name}={value.value} is not inside a Secret volume mount ({mounts or 'none'})"
            )


def _check_flag_values(
    service: str,
    env: dict[str, EnvValue],
    template: Obj,
    ns: str,
    by_id: dict[tuple[str, str, str], Obj],
    cname: str,
    where: str,
    result: Result,
) -> None:
    _check_listening(env, template, cname, where, result)
    if service != "scheduler":
        return
    workers = env.get(env_name("workers"))
    if workers is None or workers.value is None:
        return
    if not workers.value:
        return  # the config's own rule: parse_with_cli reports it
    _check_workers_target(workers.value, ns, by_id, cname, where, result)


def _check_listening(env: dict[str, EnvValue], template: Obj, cname: str, where: str, result: Result) -> None:
    """The ports flags equal the container ports, and the host is every address."""
    ports = {
        p.get("name"): int(p["containerPort"])
        for c in containers(template.get("spec") or {})
        for p in c.get("ports") or []
    }
    for flag, port_name in (("port", "grpc"), ("metrics-port", "metrics")):
        value = env.get(env_name(flag))
        if value is None or value.value is None:
            continue
        if port_name not in ports or value.value != str(ports[port_name]):
            result.fail(
                where,
                f"{cname}: {env_name(flag)}={value.value} does not match "
                f"container port {port_name!r} ({ports.get(port_name)})",
            )
    host = env.get(env_name("host"))
    if host is not None and host.value not in ("0.0.0.0", "::", "[::]"):
        result.fail(
            where, f"{cname}: {env_name('host')}={host.value}: probes and Services reach the pod IP; listen on 0.0.0.0"
        )


def _check_workers_target(
    workers: str, ns: str, by_id: dict[tuple[str, str, str], Obj], cname: str, where: str, result: Result
) -> None:
    """The scheduler's --workers names a headless worker Service of this overlay, by DNS."""
    match = WORKERS_RE.match(workers)
    if not match:
        result.fail(
            where,
            f"{cname}: {env_name('workers')}={workers!r}: expected "
            "dns:///<headless worker Service>.<namespace>.svc.cluster.local:<port>, so "
            "that scaled workers are discovered",
        )
        return
    svc = by_id.get(("Service", match["ns"], match["svc"]))
    if svc is None:
        result.fail(
            where,
            f"{cname}: {env_name('workers')} names Service "
            f"{match['ns']}/{match['svc']}, which this overlay does not create"
            f"{' (this overlay uses namespace ' + ns + ')' if match['ns'] != ns else ''}",
        )
        return
    spec = svc.get("spec") or {}
    if spec.get("clusterIP") != "None":
        result.fail(
            where,
            f"{cname}: {env_name('workers')} must name a headless Service "
            "(a virtual IP would hide the individual workers)",
        )
    if int(match["port"]) not in {int(p["port"]) for p in spec.get("ports") or []}:
        result.fail(
            where, f"{cname}: {env_name('workers')} port {match['port']} is not a port of Service {match['svc']}"
        )


# --- metrics in dashboards, rules, autoscaling -------------------------------------------------


def check_metric_refs(document: Any, where: str, result: Result) -> None:
    """Every zerobubble_* series in PromQL strings must exist, queried by labels it has."""
    seen: set[str] = set()

    def visit(text: str) -> None:
        for name in METRIC_RE.findall(text):
            if name not in seen and metric_spec(name) is None:
                seen.add(name)
                result.fail(
                    where,
                    f"unknown metric {name!r}"
                    f"{_suggest(name, METRIC_NAMES)}; zerobubble/metrics.py exports "
                    "METRIC_NAMES (histograms add _bucket/_sum/_count)",
                )
        for name, matchers in SELECTOR_RE.findall(text):
            spec = metric_spec(name)
            if spec is None:
                continue
            allowed = set(spec.labels) | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
            for label in MATCHER_RE.findall(matchers):
                if label not in allowed:
                    result.fail(where, f"{name} has no label {label!r} (it has {sorted(spec.labels)})")

    walk_strings(document, visit)


def _dashboards(objects: Sequence[Obj]) -> Iterator[tuple[Obj, str, str]]:
    for obj in objects:
        if obj["kind"] == "ConfigMap" and "grafana_dashboard" in (obj["metadata"].get("labels") or {}):
            for key, text in (obj.get("data") or {}).items():
                yield obj, key, text


def check_dashboard(dashboard: Any, schemas: Schemas, where: str, result: Result) -> None:
    """Grafana dashboard JSON: structure, unique panel ids, metric references."""
    for message in schemas.errors("grafana-dashboard.json", dashboard) or []:
        result.fail(where, message)
    ids: list[Any] = []

    def collect(panels: Sequence[Any]) -> None:
        for panel in panels:
            if isinstance(panel, dict):
                ids.append(panel.get("id"))
                collect(panel.get("panels") or [])

    collect(dashboard.get("panels") or [] if isinstance(dashboard, dict) else [])
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        result.fail(where, f"duplicate panel ids {duplicates}")
    check_metric_refs(dashboard, where, result)


def check_rules_file(root: Path, schemas: Schemas, result: Result) -> list[Any] | None:
    """Validate the plain rules file; returns its groups for comparison with PrometheusRules."""
    path = root / RULES_FILE
    where = str(RULES_FILE)
    if not path.is_file():
        result.fail(where, "missing: the plain Prometheus rules file")
        return None
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        result.fail(where, f"invalid YAML: {exc}")
        return None
    errors = schemas.errors("prometheus-rules-file.json", document)
    for message in errors or []:
        result.fail(where, message)
    if errors:
        return None
    names = [g["name"] for g in document["groups"]]
    for name in sorted({n for n in names if names.count(n) > 1}):
        result.fail(where, f"duplicate rule group {name!r} (Prometheus refuses the file)")
    check_metric_refs(document, where, result)
    return list(document["groups"])


# --- rendering ---------------------------------------------------------------------------------


def render_overlay(overlay: Path, kubectl: str, where: str, result: Result) -> list[Obj] | None:
    """The objects ``kubectl apply -k overlay`` would send, or None (and a problem) if none."""
    try:
        return render(overlay, kubectl)
    except RenderError as exc:
        result.fail(where, f"render failed: {exc}")
        return None


# --- alert rules with promtool -----------------------------------------------------------------


def check_with_promtool(root: Path, rule_files: Sequence[prom.RuleFile], promtool: str, result: Result) -> None:
    """promtool check rules on every rules document, promtool test rules on the unit tests."""
    try:
        command = prom.find_promtool(promtool)
    except prom.PromtoolMissing as exc:
        result.fail("promtool", str(exc))
        return
    for problem in prom.check_rules(command, rule_files):
        result.fail("promtool", problem)
    tests = sorted((root / RULES_FILE.parent).glob(RULE_TESTS_GLOB))
    if not tests:
        result.fail(str(RULES_FILE.parent), f"no promtool unit tests ({RULE_TESTS_GLOB})")
        return
    for problem in prom.run_rule_tests(command, tests):
        result.fail("promtool", problem)
    plain = next((f for f in rule_files if f.where == str(RULES_FILE)), None)
    if plain is not None:
        try:
            docs = [yaml.safe_load(path.read_text()) for path in tests]
        except yaml.YAMLError as exc:
            result.fail(str(RULES_FILE.parent), f"invalid YAML in a rules test: {exc}")
            return
        for problem in prom.untested_alerts(plain.groups, docs):
            result.fail(str(RULES_FILE.parent), problem)
        result.notes.append(
            f"promtool: {len(rule_files)} rule document(s) checked, "
            f"{len(prom.alert_names(plain.groups))} alerts unit-tested in "
            f"{', '.join(p.name for p in tests)}"
        )


# --- driver ------------------------------------------------------------------------------------


def check(
    root: Path = DEFAULT_ROOT,
    overlays: Sequence[str] | None = None,
    k8s_version: str = DEFAULT_K8S_VERSION,
    kubectl: str = DEFAULT_KUBECTL,
    promtool: str | None = prom.DEFAULT_PROMTOOL,
) -> Result:
    """Run every check on the deploy tree at ``root``; ``overlays`` limits which are rendered.

    ``kubectl`` and ``promtool`` name the tools that render the overlays and check the rules;
    a missing tool is reported as a problem that names it. ``promtool=None`` leaves the
    promtool checks out (for callers that test the other checks and want them fast).
    """
    result = Result()
    root = root.resolve()
    try:
        schemas = Schemas.load(root / "schemas")
    except (OSError, ValueError, KeyError, jsonschema.SchemaError) as exc:
        result.fail("schemas", f"cannot load vendored schemas: {exc}")
        return result
    overlay_root = root / "k8s" / "overlays"
    available = (
        sorted(p.name for p in overlay_root.iterdir() if (p / "kustomization.yaml").is_file())
        if overlay_root.is_dir()
        else []
    )
    if not available:
        result.fail(str(overlay_root), "no overlays to render")
        return result
    selected = list(overlays) if overlays else available
    for name in sorted(set(selected) - set(available)):
        result.fail(f"overlays/{name}", f"no such overlay (have {available})")
    rules_groups = check_rules_file(root, schemas, result)
    rule_files = [prom.RuleFile(str(RULES_FILE), rules_groups)] if rules_groups is not None else []
    _check_plain_files(root, schemas, result)
    try:
        service_flags = cli_flags()
    except Exception as exc:  # any import or parser error means the same: no flags to check
        result.fail("zerobubble.config", f"cannot read the settings: {type(exc).__name__}: {exc}")
        return result
    overlay_check = _OverlayCheck(schemas, k8s_version, kubectl, service_flags, rules_groups, result)
    # The "reachable from some overlay" check below needs every overlay's flags.
    flags_complete = overlays is None
    to_render = [n for n in selected if n in available]
    try:
        find_kubectl(kubectl)
    except RenderError as exc:
        result.fail("kubectl", str(exc))
        to_render, flags_complete = [], False
    for name in to_render:
        flags_complete &= overlay_check.run(overlay_root / name, f"overlays/{name}", rule_files)
    if flags_complete:
        _check_secrets_reachable(service_flags, overlay_check.reachable, result)
    if promtool is not None:
        check_with_promtool(root, rule_files, promtool, result)
    return result


def _check_plain_files(root: Path, schemas: Schemas, result: Result) -> None:
    """The Prometheus files besides the rules and the dashboards' JSON, as they lie in the tree."""
    for path in sorted((root / "prometheus").glob("*.yaml")):
        if path.name != RULES_FILE.name:
            try:
                check_metric_refs(yaml.safe_load(path.read_text()), str(path.relative_to(root)), result)
            except yaml.YAMLError as exc:
                result.fail(str(path.relative_to(root)), f"invalid YAML: {exc}")
    for path in sorted((root / "k8s").rglob("*.json")):
        where = str(path.relative_to(root))
        try:
            check_dashboard(json.loads(path.read_text()), schemas, where, result)
        except json.JSONDecodeError as exc:
            result.fail(where, f"invalid JSON: {exc}")


def _check_secrets_reachable(
    service_flags: dict[str, tuple[str, ...]], reachable: dict[str, set[str]], result: Result
) -> None:
    """Secret flags live in opt-in components (TLS), so they need only be reachable somewhere."""
    for service, flags in service_flags.items():
        for flag in sorted(SECRET_FLAGS & set(flags) - reachable.get(service, set())):
            result.fail(
                "overlays",
                f"--{flag} of `zerobubble {service}` is not reachable "
                f"from any overlay (set {env_name(flag)} from a Secret)",
            )


@dataclass
class _OverlayCheck:
    """The checks of one rendered overlay; ``reachable`` gathers each service's flags over all."""

    schemas: Schemas
    k8s_version: str
    kubectl: str
    service_flags: dict[str, tuple[str, ...]]
    rules_groups: Any
    result: Result
    reachable: dict[str, set[str]] = field(default_factory=dict)

    def run(self, path: Path, where: str, rule_files: list[prom.RuleFile]) -> bool:
        """Render and check the overlay at ``path``; whether its flags could all be checked.
        Its PrometheusRules join ``rule_files``."""
        result = self.result
        objects = render_overlay(path, self.kubectl, where, result)
        if objects is None:
            return False
        result.notes.append(f"{where}: {len(objects)} objects")
        complete = self._check_objects(objects, where)
        for obj in objects:
            if obj["kind"] in ("HorizontalPodAutoscaler", "PrometheusRule"):
                check_metric_refs(obj.get("spec"), f"{where}: {_describe(obj)}", result)
            if obj["kind"] == "PrometheusRule":
                groups = (obj.get("spec") or {}).get("groups")
                rule_files.append(prom.RuleFile(f"{where}: {_describe(obj)}", groups or []))
                if self.rules_groups is not None and groups != self.rules_groups:
                    result.fail(
                        where,
                        f"{_describe(obj)}: spec.groups differ from {RULES_FILE}; the two must carry the same rules",
                    )
        for obj, key, text in _dashboards(objects):
            try:
                check_dashboard(json.loads(text), self.schemas, f"{where}: {_describe(obj)} {key}", result)
            except json.JSONDecodeError as exc:
                result.fail(where, f"{_describe(obj)} {key}: invalid JSON: {exc}")
        return complete

    def _check_objects(self, objects: list[Obj], where: str) -> bool:
        """Schemas first, then references and flags; whether the flags could all be checked."""
        result = self.result
        before = len(result.problems)
        for obj in objects:
            check_schema(obj, self.schemas, self.k8s_version, where, result)
        if len(result.problems) > before:
            # The cross-object checks assume well-typed objects; report the schema errors
            # alone rather than a cascade (or a traceback) caused by them.
            result.fail(where, "reference and flag checks skipped until the schema errors above are fixed")
            return False
        try:
            check_references(objects, where, result)
            check_flags(objects, where, result, self.reachable, self.service_flags)
            for problem in check_network_policies(objects):
                result.fail(where, problem)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            result.fail(
                where, f"could not check references ({type(exc).__name__}: {exc}); a field has an unexpected shape"
            )
            return False
        return True


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m deploy.check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", type=Path, default=DEFAULT_ROOT, help="the deploy/ directory to check (default: this one)"
    )
    parser.add_argument(
        "--overlay", action="append", dest="overlays", help="check only this overlay (repeatable; default: all)"
    )
    parser.add_argument(
        "--k8s-version", default=DEFAULT_K8S_VERSION, help=f"Kubernetes schema version (default {DEFAULT_K8S_VERSION})"
    )
    parser.add_argument(
        "--kubectl",
        default=DEFAULT_KUBECTL,
        help="kubectl to render overlays with (`kubectl kustomize`, what "
        "`kubectl apply -k` sends; default: kubectl on PATH)",
    )
    parser.add_argument(
        "--promtool",
        default=prom.DEFAULT_PROMTOOL,
        help="promtool to check and unit-test the alert rules with (Debian "
        f"package {prom.PACKAGE!r}; default: promtool on PATH)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print notes too")
    args = parser.parse_args(argv)

    result = check(args.root, args.overlays, args.k8s_version, args.kubectl, args.promtool)
    if args.verbose:
        for note in result.notes:
            print(f"note: {note}")
    renderer = f"{args.kubectl} kustomize"
    if result.problems:
        for problem in result.problems:
            print(f"error: {problem}", file=sys.stderr)
        print(
            f"deploy check FAILED: {len(result.problems)} problem(s) "
            f"(rendered with {renderer}, Kubernetes {args.k8s_version})",
            file=sys.stderr,
        )
        return 1
    print(
        f"deploy check passed (rendered with {renderer}, Kubernetes {args.k8s_version} "
        f"schemas, {len(METRIC_NAMES)} metric families, alert rules checked and unit-tested "
        f"with {args.promtool})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
