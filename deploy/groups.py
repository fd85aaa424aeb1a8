"""Checks of tensor-parallel workers in rendered manifests (part of ``python -m deploy.check``).

A worker split over devices is a group of ranks: the ranks of one pod, one per GPU, or a
LeaderWorkerSet's pods (https://lws.sigs.k8s.io), each pod a node of ranks. What a wrong
manifest costs here is a group that never forms (too few GPUs for the ranks, node ranks that
collide) or, worse, one that forms with strangers: the rendezvous and the collectives carry no
authentication, so nothing but the network may admit anyone else to them. This module checks:

- ``--tensor-parallel-size`` = ``--nnodes`` x each pod's ``nvidia.com/gpu`` limit;
- ``--nnodes`` equals the LeaderWorkerSet's group size, and ``--node-rank`` and
  ``--master-addr`` come from the variables the controller sets per pod;
- a group of pods has a NetworkPolicy that admits only the set's own pods to every port but gRPC
  and metrics (the ranks of one pod meet through a private file and talk over loopback or shared
  memory, so nothing of theirs is reachable from outside the pod).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from deploy.manifests import Obj, object_id, pod_templates

LWS_KIND = "LeaderWorkerSet"
# Set on every pod by the LeaderWorkerSet controller (and by our templates, so the checks see it).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GPU_RESOURCE = "nvidia.com/gpu"
# Ports of a worker that anyone may reach: gRPC checks the worker token, metrics are public.
OPEN_PORT_NAMES = frozenset({"grpc", "metrics"})
_VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def group_size(obj: Obj) -> int:
    """Pods per group of a LeaderWorkerSet (1 for any other workload)."""
    if obj.get("kind") != LWS_KIND:
        return 1
    return int(((obj.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size", 1))


def is_leader(obj: Obj, template: Obj) -> bool:
    """Whether pods of ``template`` are their group's leader (index 0): every pod of a built-in
    workload, a LeaderWorkerSet's leader template (its worker template when it has none)."""
    if obj.get("kind") != LWS_KIND:
        return True
    group = (obj.get("spec") or {}).get("leaderWorkerTemplate") or {}
    return group.get("leaderTemplate") is template or "leaderTemplate" not in group


def template_variables(obj: Obj, template: Obj) -> dict[str, str]:
    """Stand-ins for the variables a LeaderWorkerSet's controller puts first in the environment
    of ``template``'s containers (a leader's, or the first other pod's), by name."""
    if obj.get("kind") != LWS_KIND:
        return {}
    _, namespace, name = object_id(obj)
    return {
        "LWS_GROUP_SIZE": str(group_size(obj)),
        "LWS_WORKER_INDEX": "0" if is_leader(obj, template) else "1",
        "LWS_LEADER_ADDRESS": f"{name}-0.{name}.{namespace}",
    }


def expand(value: str, variables: dict[str, str]) -> str:
    """Kubernetes' ``$(NAME)`` expansion of an env value; an unknown name stays as written."""
    return _VARIABLE.sub(lambda m: variables.get(m[1], m[0]), value)


def _gpus(container: Obj) -> int:
    return int(((container.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE, 0))


def check_worker_group(config: Any, obj: Obj, template: Obj, container: Obj, raw_node_rank: str | None) -> list[str]:
    """Problems of one worker container's group settings (``config``: its parsed WorkerConfig;
    ``raw_node_rank``: ZEROBUBBLE_NODE_RANK as the manifest writes it)."""
    problems: list[str] = []
    size, nnodes, kind = config.tensor_parallel_size, config.nnodes, obj.get("kind")
    gpus = _gpus(container)
    if gpus and gpus * nnodes != size:
        problems.append(
            f"ZEROBUBBLE_TENSOR_PARALLEL_SIZE={size} over {nnodes} pod(s) runs {size / nnodes:g} ranks per pod, "
            f"one per GPU, but the pod's {GPU_RESOURCE} limit is {gpus}"
        )
    if nnodes != group_size(obj):
        problems.append(
            f"ZEROBUBBLE_NNODES={nnodes} but the {kind} runs groups of {group_size(obj)} pod(s)"
            + ("; use $(LWS_GROUP_SIZE)" if kind == LWS_KIND else "; a group of pods needs a LeaderWorkerSet")
        )
    if nnodes > 1:
        if "$(LWS_WORKER_INDEX)" not in (raw_node_rank or ""):
            problems.append(
                f"ZEROBUBBLE_NODE_RANK={raw_node_rank!r}: every pod of a group needs its own, $(LWS_WORKER_INDEX)"
            )
        pod_containers = (template.get("spec") or {}).get("containers") or []
        ports = {int(p["containerPort"]) for c in pod_containers for p in c.get("ports") or []}
        if is_leader(obj, template) and config.master_port not in ports:
            problems.append(
                f"ZEROBUBBLE_MASTER_PORT={config.master_port} is not a container port of the leader: "
                "the other pods join its rendezvous there"
            )
    return problems


def _labels(obj: Obj, template: Obj) -> dict[str, str]:
    labels = dict((template.get("metadata") or {}).get("labels") or {})
    if obj.get("kind") == LWS_KIND:
        labels[LWS_NAME_LABEL] = object_id(obj)[2]
    return labels


def _selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A podSelector's matchLabels against pod labels; an empty selector selects every pod."""
    match = (selector or {}).get("matchLabels") or {}
    return all(labels.get(k) == v for k, v in match.items())


def _only_the_set(peer: Obj, own: list[dict[str, str]], others: list[dict[str, str]]) -> bool:
    """Whether a NetworkPolicy peer admits pods of the set and no other workload's pods."""
    if set(peer) != {"podSelector"} or not (peer["podSelector"] or {}).get("matchLabels"):
        return False  # an IP block, another namespace or every pod of this one
    return all(_selects(peer["podSelector"], labels) for labels in own) and not any(
        _selects(peer["podSelector"], labels) for labels in others
    )


def _opens_ranks(rule: Obj) -> bool:
    """Whether an ingress rule admits to a port other than gRPC and metrics (no ports: all)."""
    ports = rule.get("ports") or []
    return not ports or any(p.get("port") not in OPEN_PORT_NAMES or "endPort" in p for p in ports)


def check_network_policies(objects: Sequence[Obj]) -> list[str]:
    """Problems of the NetworkPolicies around each LeaderWorkerSet whose groups span pods."""
    problems: list[str] = []
    workloads = [(o, t) for o in objects for t in pod_templates(o)]
    for lws in (o for o in objects if o.get("kind") == LWS_KIND and group_size(o) > 1):
        _, ns, name = object_id(lws)
        own = [_labels(lws, t) for t in pod_templates(lws)]
        others = [_labels(o, t) for o, t in workloads if o is not lws and object_id(o)[1] == ns]
        policies = [
            p
            for p in objects
            if p.get("kind") == "NetworkPolicy"
            and object_id(p)[1] == ns
            and all(_selects((p.get("spec") or {}).get("podSelector"), labels) for labels in own)
            and "Ingress" in ((p.get("spec") or {}).get("policyTypes") or ["Ingress"])
        ]
        if not policies:
            problems.append(
                f"{LWS_KIND} {ns}/{name}: groups of {group_size(lws)} pods meet on an unauthenticated rendezvous "
                "and collectives, but no NetworkPolicy limits who reaches its pods"
            )
        for policy in policies:
            for i, rule in enumerate((policy.get("spec") or {}).get("ingress") or []):
                peers = rule.get("from") or [{}]
                if _opens_ranks(rule) and not all(_only_the_set(peer, own, others) for peer in peers):
                    problems.append(
                        f"NetworkPolicy {ns}/{object_id(policy)[2]}: ingress[{i}] admits pods other than "
                        f"{LWS_KIND} {name}'s own to ports besides gRPC and metrics (its rendezvous and collectives)"
                    )
    return problems
