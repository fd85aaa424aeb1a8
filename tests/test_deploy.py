"""deploy.check passes on the repository and catches what would break a real rollout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy import check as deploy_check
from deploy.kustomize import (
    KustomizeError,
    apply_json6902,
    render,
    strategic_merge,
)

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def _copy_deploy(tmp_path: Path) -> Path:
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return root


def _edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    # If the manifests change under this test, fail here rather than test a no-op edit.
    assert old in text, f"{old!r} not in {rel}"
    path.write_text(text.replace(old, new))


def test_repository_deploy_tree_passes() -> None:
    result = deploy_check.check(DEPLOY, kustomize_cmd=None)
    assert result.problems == []
    assert any("overlays/gpu:" in n and "objects" in n for n in result.notes)


def test_module_entry_point_passes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.check", "--kustomize", "builtin"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "deploy check passed" in proc.stdout


@pytest.mark.skipif(deploy_check.find_kustomize() is None, reason="no kubectl/kustomize here")
def test_builtin_renderer_matches_real_kustomize() -> None:
    result = deploy_check.check(DEPLOY, kustomize_cmd=deploy_check.find_kustomize())
    assert result.problems == []


BROKEN = [
    pytest.param("k8s/base/worker.yaml", "      containers:\n        - name: worker",
                 "      contianers:\n        - name: worker", "cpu-demo",
                 "'contianers' was unexpected", id="misspelled-field"),
    pytest.param("k8s/base/worker.yaml", "failureThreshold: 60", "failureThreshold: sixty",
                 "cpu-demo", "'sixty' is not of type 'integer'", id="wrong-type"),
    pytest.param("k8s/components/monitoring/dashboards/zerobubble.json",
                 "zerobubble_inflight_steps{", "zerobubble_inflight_step{", "gpu",
                 "unknown metric 'zerobubble_inflight_step' (did you mean "
                 "zerobubble_inflight_steps?)", id="unknown-dashboard-metric"),
    pytest.param("prometheus/zerobubble-rules.yaml", 'finished_reason="error"', 'reason="error"',
                 "gpu", "zerobubble_request_success_total has no label 'reason'",
                 id="unknown-label-in-rule"),
    pytest.param("prometheus/zerobubble-rules.yaml", "for: 15m", "for: 15 minutes", "gpu",
                 "does not match", id="bad-rule-duration"),
    pytest.param("k8s/components/monitoring/servicemonitor.yaml", "  endpoints:", "  endpoint:",
                 "gpu", "'endpoint' was unexpected", id="crd-misspelled-field"),
    pytest.param("k8s/overlays/cpu-demo/worker.env", "ZEROBUBBLE_NUM_THREADS=2",
                 "ZEROBUBBLE_NUM_THREADS=2\nZEROBUBBLE_MAX_INFLIGHT=2", "cpu-demo",
                 "ZEROBUBBLE_MAX_INFLIGHT is not a flag of `zerobubble worker`",
                 id="unknown-env-flag"),
    pytest.param("k8s/base/scheduler.env", "ZEROBUBBLE_LOG_LEVEL=info\n", "", "cpu-demo",
                 "--log-level is not reachable", id="unreachable-flag"),
    pytest.param("k8s/overlays/cpu-demo/scheduler.env", "ZEROBUBBLE_MAX_NUM_SEQS=16",
                 "ZEROBUBBLE_MAX_NUM_SEQS=16\nZEROBUBBLE_AUTH_TOKEN=hunter2", "cpu-demo",
                 "holds ZEROBUBBLE_AUTH_TOKEN; secrets belong in a Secret",
                 id="secret-in-configmap"),
    pytest.param("k8s/overlays/cpu-demo/scheduler.env",
                 "zerobubble-worker.zerobubble-demo.svc", "zerobubble-worker.zerobubble.svc",
                 "cpu-demo", "names Service zerobubble/zerobubble-worker, which this overlay "
                 "does not create", id="workers-wrong-namespace"),
    pytest.param("k8s/overlays/cpu-demo/worker.env", "ZEROBUBBLE_DEVICE=cpu",
                 "ZEROBUBBLE_DEVICE=cpu\nZEROBUBBLE_PORT=50062", "cpu-demo",
                 "ZEROBUBBLE_PORT=50062 does not match container port 'grpc'",
                 id="port-mismatch"),
    pytest.param("k8s/base/worker.yaml", "targetPort: metrics", "targetPort: metric",
                 "cpu-demo", "targetPort 'metric'", id="service-target-port"),
    pytest.param("k8s/overlays/cpu-demo/kustomization.yaml", "newTag: 0.1.0", "newTag: latest",
                 "cpu-demo", "is not a pinned registry image", id="unpinned-image"),
    pytest.param("k8s/overlays/gpu/kustomization.yaml", "patches:",
                 "replicas:\n  - name: zerobubble-worker\n    count: 2\npatches:", "gpu",
                 "sets spec.replicas", id="replicas-fight-hpa"),
    pytest.param("k8s/overlays/cpu-demo/kustomization.yaml", "namespace: zerobubble-demo",
                 "namespace: zerobubble-demo\nnamePrefix: demo-", "cpu-demo",
                 "unsupported kustomization field(s) ['namePrefix']", id="unsupported-kustomize"),
    pytest.param("k8s/overlays/cpu-demo/worker.env", "ZEROBUBBLE_DTYPE=float32",
                 "ZEROBUBBLE_DTYPE=float16", "cpu-demo",
                 "`zerobubble worker` rejects its environment: ", id="value-the-cli-rejects"),
    pytest.param("k8s/base/worker.env", "ZEROBUBBLE_LOG_LEVEL=info\n", "", "cpu-demo",
                 "--log-level is not reachable", id="flag-known-only-to-the-cli"),
    pytest.param("k8s/overlays/cpu-demo/scheduler.env", "ZEROBUBBLE_MAX_NUM_SEQS=16",
                 "ZEROBUBBLE_MAX_NUM_SEQS=32", "cpu-demo", "max-num-seqs 32 exceeds the 16",
                 id="scheduler-outruns-worker-slots"),
    pytest.param("k8s/components/tls/worker-tls.yaml",
                 "value: /etc/zerobubble/internal-tls/tls.key", "value: /etc/ssl/tls.key",
                 "gpu-tls", "ZEROBUBBLE_TLS_KEY=/etc/ssl/tls.key is not inside a Secret volume",
                 id="tls-file-not-from-secret"),
    pytest.param("k8s/base/scheduler.yaml", "enableServiceLinks: false",
                 "enableServiceLinks: true", "cpu-demo", "set enableServiceLinks: false",
                 id="service-links"),
]


@pytest.mark.parametrize(("rel", "old", "new", "overlay", "expected"), BROKEN)
def test_broken_manifest_is_reported(tmp_path: Path, rel: str, old: str, new: str,
                                     overlay: str, expected: str) -> None:
    root = _copy_deploy(tmp_path)
    _edit(root, rel, old, new)
    result = deploy_check.check(root, overlays=[overlay], kustomize_cmd=None)
    assert any(expected in p for p in result.problems), "\n".join(result.problems)


def test_rules_file_and_prometheusrule_must_agree(tmp_path: Path) -> None:
    root = _copy_deploy(tmp_path)
    _edit(root, "prometheus/zerobubble-rules.yaml", "> 50", "> 80")
    result = deploy_check.check(root, overlays=["gpu"], kustomize_cmd=None)
    assert any("spec.groups differ from prometheus/zerobubble-rules.yaml" in p
               for p in result.problems), result.problems


def test_every_secret_flag_must_be_reachable_from_some_overlay(tmp_path: Path) -> None:
    root = _copy_deploy(tmp_path)
    shutil.rmtree(root / "k8s" / "overlays" / "gpu-tls")
    result = deploy_check.check(root, kustomize_cmd=None)
    assert any("--tls-client-ca of `zerobubble worker` is not reachable from any overlay" in p
               for p in result.problems), result.problems


def test_main_exits_non_zero_with_a_summary(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy_deploy(tmp_path)
    _edit(root, "k8s/base/worker.yaml", "containerPort: 50061", "containerPort: grpc")
    status = deploy_check.main(["--root", str(root), "--overlay", "cpu-demo",
                                "--kustomize", "builtin"])
    err = capsys.readouterr().err
    assert status == 1
    assert "containerPort: 'grpc' is not of type 'integer'" in err
    assert "deploy check FAILED" in err


def test_external_kustomize_output_is_cross_checked(tmp_path: Path) -> None:
    # A stand-in for `kubectl kustomize` that renders with our renderer but loses an object:
    # the checker must notice the two renderings disagree.
    fake = tmp_path / "fake_kustomize.py"
    fake.write_text(textwrap.dedent(f"""
        import sys, yaml
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from deploy.kustomize import render
        objs = [o for o in render(Path(sys.argv[1])) if o["kind"] != "PodDisruptionBudget"]
        print(yaml.safe_dump_all(objs))
    """))
    result = deploy_check.check(DEPLOY, overlays=["cpu-demo"],
                                kustomize_cmd=[sys.executable, str(fake)])
    assert any("disagree" in p and "PodDisruptionBudget" in p for p in result.problems)


# --- the renderer on its own ---------------------------------------------------------------------

def test_strategic_merge_follows_kubernetes_merge_keys() -> None:
    base: dict[str, Any] = {"spec": {"containers": [
        {"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}],
         "ports": [{"containerPort": 1, "name": "p"}], "readinessProbe": {"grpc": {"port": 1}}},
        {"name": "b", "image": "y"},
    ], "tolerations": [{"key": "k"}]}}
    patch: dict[str, Any] = {"spec": {"containers": [
        {"name": "a", "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "3"}],
         "readinessProbe": {"grpc": None, "tcpSocket": {"port": 1}}},
        {"name": "b", "$patch": "delete"},
    ], "tolerations": [{"key": "other"}]}}
    merged = strategic_merge(base, patch)
    (container,) = merged["spec"]["containers"]
    assert container["image"] == "x"
    assert container["env"] == [{"name": "B", "value": "2"}, {"name": "A", "value": "3"}]
    assert container["readinessProbe"] == {"tcpSocket": {"port": 1}}
    assert container["ports"] == [{"containerPort": 1, "name": "p"}]
    assert merged["spec"]["tolerations"] == [{"key": "other"}]  # no merge key: replaced
    assert base["spec"]["containers"][1]["name"] == "b"  # inputs are not mutated


def test_json6902_operations() -> None:
    doc = {"spec": {"items": [1, 2], "name": "a"}}
    out = apply_json6902(doc, [
        {"op": "test", "path": "/spec/name", "value": "a"},
        {"op": "add", "path": "/spec/items/-", "value": 3},
        {"op": "replace", "path": "/spec/name", "value": "b"},
        {"op": "remove", "path": "/spec/items/0"},
        {"op": "add", "path": "/spec/a~1b", "value": True},
    ], "inline")
    assert out == {"spec": {"items": [2, 3], "name": "b", "a/b": True}}
    with pytest.raises(KustomizeError, match="does not exist"):
        apply_json6902(doc, [{"op": "replace", "path": "/spec/missing", "value": 1}], "inline")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())


def test_generated_configmap_is_hashed_and_references_follow(tmp_path: Path) -> None:
    _write(tmp_path / "base/kustomization.yaml", """
        resources: [deploy.yaml]
        configMapGenerator:
          - name: cfg
            literals: [A=1]
          - name: fixed
            literals: [B=2]
            options: {disableNameSuffixHash: true}
    """)
    _write(tmp_path / "base/deploy.yaml", """
        apiVersion: apps/v1
        kind: Deployment
        metadata: {name: d}
        spec:
          selector: {matchLabels: {app: d}}
          template:
            metadata: {labels: {app: d}}
            spec:
              containers:
                - name: c
                  image: r/i:1
                  envFrom: [{configMapRef: {name: cfg}}]
              volumes: [{name: v, configMap: {name: fixed}}]
    """)
    _write(tmp_path / "overlay/kustomization.yaml", """
        namespace: ns
        resources: [../base]
        configMapGenerator:
          - name: cfg
            behavior: merge
            literals: [A=2]
        patches:
          - target: {kind: Deployment, name: d}
            patch: |
              - op: replace
                path: /spec/template/spec/containers/0/image
                value: r/i:2
    """)
    base = {o["kind"]: o for o in render(tmp_path / "base")}
    overlay = render(tmp_path / "overlay")
    cms = {o["metadata"]["name"].split("-")[0]: o for o in overlay if o["kind"] == "ConfigMap"}
    deployment = next(o for o in overlay if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert cms["cfg"]["data"] == {"A": "2"}
    assert cms["fixed"]["metadata"]["name"] == "fixed"
    assert pod["containers"][0]["envFrom"][0]["configMapRef"]["name"] == \
        cms["cfg"]["metadata"]["name"]
    assert pod["containers"][0]["image"] == "r/i:2"
    assert deployment["metadata"]["namespace"] == "ns"
    # A changed value changes the name, which is what rolls the pods.
    base_ref = base["Deployment"]["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]
    assert base_ref["configMapRef"]["name"] != cms["cfg"]["metadata"]["name"]
    assert "annotations" not in cms["cfg"]["metadata"]  # internal marker removed


def test_files_outside_the_kustomization_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "secret.env", "A=1\n")
    _write(tmp_path / "k/kustomization.yaml", """
        configMapGenerator:
          - name: cfg
            envs: [../secret.env]
    """)
    with pytest.raises(KustomizeError, match="outside the kustomization directory"):
        render(tmp_path / "k")


def test_rendered_overlays_are_plain_yaml_objects() -> None:
    # kubectl apply needs real YAML; anything our renderer leaves behind must serialize.
    for overlay in ("cpu-demo", "gpu", "gpu-tls"):
        objects = render(DEPLOY / "k8s" / "overlays" / overlay)
        assert yaml.safe_load_all(yaml.safe_dump_all(objects))
        assert not any("zerobubble.internal" in str(o) for o in objects)
