"""deploy.check passes on the repository and catches what would break a real rollout.

Overlays are rendered by ``kubectl kustomize`` and the alert rules are checked by ``promtool``;
tests that need either find it through ``tests.support.tools.require`` (skipped with the package to
install when missing, a failure under CI).
"""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from deploy import check as deploy_check
from deploy import promtool as prom
from tests.support.tools import require

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = "prometheus/zerobubble-rules.yaml"
PROMETHEUS_RULE = "k8s/components/monitoring/prometheusrule.yaml"


@pytest.fixture
def kubectl() -> str:
    return require("kubectl")


@pytest.fixture
def promtool() -> str:
    return require("promtool")


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


@pytest.mark.usefixtures("kubectl")
def test_repository_deploy_tree_passes(promtool: str) -> None:
    result = deploy_check.check(DEPLOY, promtool=promtool)
    assert result.problems == []
    assert any("overlays/gpu:" in n and "objects" in n for n in result.notes)
    assert any("overlays/gpu-multinode:" in n and "objects" in n for n in result.notes)
    # The plain rules file and the PrometheusRule of each of the four monitoring overlays.
    assert any("promtool: 5 rule document(s) checked, 12 alerts unit-tested" in n for n in result.notes), result.notes


@pytest.mark.usefixtures("kubectl")
def test_module_entry_point_passes(promtool: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.check", "--overlay", "cpu-demo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "deploy check passed (rendered with kubectl kustomize" in proc.stdout


def test_what_is_checked_is_what_kubectl_prints(tmp_path: Path, kubectl: str) -> None:
    # A kubectl that renders with the real one and then changes one image: the checker must
    # see the change, i.e. it validates kubectl's output and nothing of its own.
    fake = tmp_path / "kubectl"
    fake.write_text(
        textwrap.dedent(f"""\
        #!{sys.executable}
        import subprocess, sys
        out = subprocess.run([{kubectl!r}, *sys.argv[1:]], capture_output=True, text=True,
                             check=True).stdout
        print(out.replace("ghcr.io/zerobubble/zerobubble:0.1.0", "ghcr.io/x/zerobubble:latest"))
    """)
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    result = deploy_check.check(DEPLOY, overlays=["cpu-demo"], kubectl=str(fake), promtool=None)
    assert any("image 'ghcr.io/x/zerobubble:latest' is not a pinned registry image" in p for p in result.problems), (
        result.problems
    )


def test_generated_configmap_names_are_kubectls(kubectl: str) -> None:
    # The hash suffix kubectl gives a generated ConfigMap is what the pods reference; the
    # checker's objects carry exactly those names.
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "k8s/overlays/cpu-demo")], capture_output=True, text=True, check=True
    ).stdout
    theirs = {d["metadata"]["name"] for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"}
    from deploy.manifests import render

    objects = render(DEPLOY / "k8s/overlays/cpu-demo")
    ours = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    assert ours == theirs and all(len(n.rsplit("-", 1)[-1]) == 10 for n in ours), ours
    refs = {
        src["configMapRef"]["name"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
        for src in c.get("envFrom") or []
        if "configMapRef" in src
    }
    assert refs <= ours, (refs, ours)


def test_missing_tools_are_named(tmp_path: Path) -> None:
    result = deploy_check.check(DEPLOY, kubectl=str(tmp_path / "kubectl"), promtool=str(tmp_path / "promtool"))
    text = "\n".join(result.problems)
    assert "kubectl: " in text and "not found on PATH" in text and "install kubectl" in text
    assert "install the 'prometheus' package" in text
    status = deploy_check.main(["--kubectl", str(tmp_path / "kubectl"), "--promtool", str(tmp_path / "promtool")])
    assert status == 1


BROKEN = [
    pytest.param(
        "k8s/base/worker.yaml",
        "      containers:\n        - name: worker",
        "      contianers:\n        - name: worker",
        "cpu-demo",
        "'contianers' was unexpected",
        id="misspelled-field",
    ),
    pytest.param(
        "k8s/base/worker.yaml",
        "failureThreshold: 60",
        "failureThreshold: sixty",
        "cpu-demo",
        "'sixty' is not of type 'integer'",
        id="wrong-type",
    ),
    pytest.param(
        "k8s/components/monitoring/dashboards/zerobubble.json",
        "zerobubble_inflight_steps{",
        "zerobubble_inflight_step{",
        "gpu",
        "unknown metric 'zerobubble_inflight_step' (did you mean zerobubble_inflight_steps?)",
        id="unknown-dashboard-metric",
    ),
    pytest.param(
        "prometheus/zerobubble-rules.yaml",
        'finished_reason="error"',
        'reason="error"',
        "gpu",
        "zerobubble_request_success_total has no label 'reason'",
        id="unknown-label-in-rule",
    ),
    pytest.param(
        "prometheus/zerobubble-rules.yaml",
        "for: 15m",
        "for: 15 minutes",
        "gpu",
        "does not match",
        id="bad-rule-duration",
    ),
    pytest.param(
        "k8s/components/monitoring/servicemonitor.yaml",
        "  endpoints:",
        "  endpoint:",
        "gpu",
        "'endpoint' was unexpected",
        id="crd-misspelled-field",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/worker.env",
        "ZEROBUBBLE_NUM_THREADS=2",
        "ZEROBUBBLE_NUM_THREADS=2\nZEROBUBBLE_MAX_INFLIGHT=2",
        "cpu-demo",
        "ZEROBUBBLE_MAX_INFLIGHT is not a flag of `zerobubble worker`",
        id="unknown-env-flag",
    ),
    pytest.param(
        "k8s/base/scheduler.env",
        "ZEROBUBBLE_LOG_LEVEL=info\n",
        "",
        "cpu-demo",
        "--log-level is not reachable",
        id="unreachable-flag",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/scheduler.env",
        "ZEROBUBBLE_MAX_NUM_SEQS=16",
        "ZEROBUBBLE_MAX_NUM_SEQS=16\nZEROBUBBLE_AUTH_TOKEN=hunter2",
        "cpu-demo",
        "holds ZEROBUBBLE_AUTH_TOKEN; secrets belong in a Secret",
        id="secret-in-configmap",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/scheduler.env",
        "zerobubble-worker.zerobubble-demo.svc",
        "zerobubble-worker.zerobubble.svc",
        "cpu-demo",
        "names Service zerobubble/zerobubble-worker, which this overlay does not create",
        id="workers-wrong-namespace",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/worker.env",
        "ZEROBUBBLE_DEVICE=cpu",
        "ZEROBUBBLE_DEVICE=cpu\nZEROBUBBLE_PORT=50062",
        "cpu-demo",
        "ZEROBUBBLE_PORT=50062 does not match container port 'grpc'",
        id="port-mismatch",
    ),
    pytest.param(
        "k8s/base/worker.yaml",
        "targetPort: metrics",
        "targetPort: metric",
        "cpu-demo",
        "targetPort 'metric'",
        id="service-target-port",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/kustomization.yaml",
        "newTag: 0.1.0",
        "newTag: latest",
        "cpu-demo",
        "is not a pinned registry image",
        id="unpinned-image",
    ),
    pytest.param(
        "k8s/overlays/gpu/kustomization.yaml",
        "patches:",
        "replicas:\n  - name: zerobubble-worker\n    count: 2\npatches:",
        "gpu",
        "sets spec.replicas",
        id="replicas-fight-hpa",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/kustomization.yaml",
        "  - namespace.yaml",
        "  - namespace.yaml\n  - missing.yaml",
        "cpu-demo",
        "render failed: kubectl kustomize",
        id="kustomize-error",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/worker.env",
        "ZEROBUBBLE_DTYPE=float32",
        "ZEROBUBBLE_DTYPE=float64",
        "cpu-demo",
        "`zerobubble worker` rejects its environment: ",
        id="value-the-cli-rejects",
    ),
    pytest.param(
        "k8s/base/worker.env",
        "ZEROBUBBLE_LOG_LEVEL=info\n",
        "",
        "cpu-demo",
        "--log-level is not reachable",
        id="flag-known-only-to-the-cli",
    ),
    pytest.param(
        "k8s/overlays/cpu-demo/scheduler.env",
        "ZEROBUBBLE_MAX_NUM_SEQS=16",
        "ZEROBUBBLE_MAX_NUM_SEQS=32",
        "cpu-demo",
        "max-num-seqs 32 exceeds the 16",
        id="scheduler-outruns-worker-slots",
    ),
    pytest.param(
        "k8s/components/tls/worker-tls.yaml",
        "value: /etc/zerobubble/internal-tls/tls.key",
        "value: /etc/ssl/tls.key",
        "gpu-tls",
        "ZEROBUBBLE_TLS_KEY=/etc/ssl/tls.key is not inside a Secret volume",
        id="tls-file-not-from-secret",
    ),
    pytest.param(
        "k8s/base/scheduler.yaml",
        "enableServiceLinks: false",
        "enableServiceLinks: true",
        "cpu-demo",
        "set enableServiceLinks: false",
        id="service-links",
    ),
    pytest.param(
        "k8s/overlays/gpu-tp/worker-gpus.yaml",
        'nvidia.com/gpu: "4"',
        'nvidia.com/gpu: "2"',
        "gpu-tp",
        "ZEROBUBBLE_TENSOR_PARALLEL_SIZE=4 over 1 pod(s) runs 4 ranks per pod, one per GPU, but the pod's "
        "nvidia.com/gpu limit is 2",
        id="ranks-without-gpus",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/worker.env",
        "ZEROBUBBLE_TENSOR_PARALLEL_SIZE=16",
        "ZEROBUBBLE_TENSOR_PARALLEL_SIZE=8",
        "gpu-multinode",
        "ZEROBUBBLE_TENSOR_PARALLEL_SIZE=8 over 2 pod(s) runs 4 ranks per pod",
        id="group-ranks-without-gpus",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/leaderworkerset.yaml",
        "value: $(LWS_WORKER_INDEX)",
        'value: "0"',
        "gpu-multinode",
        "every pod of a group needs its own, $(LWS_WORKER_INDEX)",
        id="node-ranks-collide",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/leaderworkerset.yaml",
        "value: $(LWS_GROUP_SIZE)",
        'value: "4"',
        "gpu-multinode",
        "ZEROBUBBLE_NNODES=4 but the LeaderWorkerSet runs groups of 2 pod(s)",
        id="nnodes-not-the-group-size",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/worker.env",
        "ZEROBUBBLE_MASTER_PORT=29500",
        "ZEROBUBBLE_MASTER_PORT=29501",
        "gpu-multinode",
        "ZEROBUBBLE_MASTER_PORT=29501 is not a container port of the leader",
        id="rendezvous-port-closed",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/networkpolicy.yaml",
        "    - from:\n        - podSelector:",
        "    - from:\n        - namespaceSelector: {}\n        - podSelector:",
        "gpu-multinode",
        "ingress[0] admits pods other than LeaderWorkerSet zerobubble-worker's own",
        id="rendezvous-open-to-the-cluster",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/networkpolicy.yaml",
        "        - port: metrics\n",
        "        - port: metrics\n        - port: 29500\n",
        "gpu-multinode",
        "ingress[1] admits pods other than LeaderWorkerSet zerobubble-worker's own",
        id="rendezvous-port-open-to-all",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/kustomization.yaml",
        "  - networkpolicy.yaml\n",
        "",
        "gpu-multinode",
        "but no NetworkPolicy limits who reaches its pods",
        id="group-without-network-policy",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/leaderworkerset.yaml",
        "restartPolicy: RecreateGroupOnPodRestart",
        "restartPolicy: Always",
        "gpu-multinode",
        "spec.leaderWorkerTemplate.restartPolicy: 'Always' is not one of",
        id="lws-bad-enum",
    ),
    pytest.param(
        "k8s/overlays/gpu-multinode/leaderworkerset.yaml",
        "        nodeSelector: *gpuNodes",
        "        nodeSelectr: *gpuNodes",
        "gpu-multinode",
        "LeaderWorkerSet zerobubble/zerobubble-worker: pod ",
        id="lws-pod-template-typo",
    ),
]


@pytest.mark.usefixtures("kubectl")
@pytest.mark.parametrize(("rel", "old", "new", "overlay", "expected"), BROKEN)
def test_broken_manifest_is_reported(tmp_path: Path, rel: str, old: str, new: str, overlay: str, expected: str) -> None:
    root = _copy_deploy(tmp_path)
    _edit(root, rel, old, new)
    result = deploy_check.check(root, overlays=[overlay], promtool=None)
    assert any(expected in p for p in result.problems), "\n".join(result.problems)


@pytest.mark.usefixtures("kubectl")
def test_rules_file_and_prometheusrule_must_agree(tmp_path: Path) -> None:
    root = _copy_deploy(tmp_path)
    _edit(root, "prometheus/zerobubble-rules.yaml", "> 50", "> 80")
    result = deploy_check.check(root, overlays=["gpu"], promtool=None)
    assert any("spec.groups differ from prometheus/zerobubble-rules.yaml" in p for p in result.problems), (
        result.problems
    )


@pytest.mark.usefixtures("kubectl")
def test_every_secret_flag_must_be_reachable_from_some_overlay(tmp_path: Path) -> None:
    root = _copy_deploy(tmp_path)
    shutil.rmtree(root / "k8s" / "overlays" / "gpu-tls")
    result = deploy_check.check(root, promtool=None)
    assert any(
        "--tls-client-ca of `zerobubble worker` is not reachable from any overlay" in p for p in result.problems
    ), result.problems


@pytest.mark.usefixtures("kubectl")
def test_main_exits_non_zero_with_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy_deploy(tmp_path)
    _edit(root, "k8s/base/worker.yaml", "containerPort: 50061", "containerPort: grpc")
    status = deploy_check.main(["--root", str(root), "--overlay", "cpu-demo"])
    err = capsys.readouterr().err
    assert status == 1
    assert "containerPort: 'grpc' is not of type 'integer'" in err
    assert "deploy check FAILED" in err


# --- alert rules with promtool ------------------------------------------------------------------


def _edit_rules(root: Path, old: str, new: str) -> None:
    """Edit the plain rules file and the PrometheusRule alike (they must stay equal)."""
    _edit(root, RULES, old, new)
    _edit(root, PROMETHEUS_RULE, old, new)


@pytest.mark.usefixtures("kubectl")
def test_promql_that_does_not_parse_is_reported(tmp_path: Path, promtool: str) -> None:
    root = _copy_deploy(tmp_path)
    _edit_rules(root, "> 50", "> > 50")
    result = deploy_check.check(root, overlays=["gpu"], promtool=promtool)
    failed = [p for p in result.problems if "promtool check rules failed" in p]
    # The plain file and the PrometheusRule rendered in the gpu overlay, each by name.
    assert any(p.startswith(f"promtool: {RULES}:") for p in failed), result.problems
    assert any("overlays/gpu: PrometheusRule zerobubble/zerobubble" in p for p in failed)


@pytest.mark.usefixtures("kubectl")
def test_an_alert_that_no_longer_fires_as_tested_is_reported(tmp_path: Path, promtool: str) -> None:
    # The backlog test queues 60 requests; with a threshold of 100 the alert stays silent.
    root = _copy_deploy(tmp_path)
    _edit_rules(
        root,
        'zerobubble_num_requests_waiting{job="zerobubble-scheduler"}) > 50',
        'zerobubble_num_requests_waiting{job="zerobubble-scheduler"}) > 100',
    )
    result = deploy_check.check(root, overlays=["cpu-demo"], promtool=promtool)
    assert any("promtool test rules failed" in p and "ZerobubbleQueueBacklog" in p for p in result.problems), (
        result.problems
    )


@pytest.mark.usefixtures("kubectl")
def test_every_alert_needs_a_firing_and_a_silent_test_case(tmp_path: Path, promtool: str) -> None:
    root = _copy_deploy(tmp_path)
    _edit(
        root,
        RULES,
        "  - name: zerobubble.efficiency\n    rules:\n",
        "  - name: zerobubble.efficiency\n    rules:\n"
        "      - alert: ZerobubbleNoTraffic\n"
        "        expr: sum(rate(zerobubble_generation_tokens_total[5m])) == 0\n"
        "        for: 1h\n",
    )
    result = deploy_check.check(root, overlays=["cpu-demo"], promtool=promtool)
    assert (
        "prometheus: alert ZerobubbleNoTraffic has no promtool test case where it fires or where it stays silent"
    ) in result.problems, result.problems


def test_untested_alerts_counts_firing_and_silent_cases_separately() -> None:
    groups = [
        {"name": "g", "rules": [{"alert": "A", "expr": "1"}, {"alert": "B", "expr": "1"}, {"record": "r", "expr": "1"}]}
    ]
    tests = [
        {
            "tests": [
                {
                    "alert_rule_test": [
                        {"alertname": "A", "eval_time": "1m", "exp_alerts": [{"exp_labels": {}}]},
                        {"alertname": "A", "eval_time": "2m", "exp_alerts": []},
                        {"alertname": "B", "eval_time": "1m"},
                    ]
                }
            ]
        }
    ]
    assert prom.untested_alerts(groups, tests) == ["alert B has no promtool test case where it fires"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_images_install_the_services_dependencies(dockerfile: str) -> None:
    """A plain `pip install .` is the light client (grpcio and protobuf only): an image built
    that way has no torch-side or HTTP-side packages and its services fail at start-up."""
    text = (Path(deploy_check.__file__).parent / dockerfile).read_text()
    installs = re.findall(r"pip install\s+\"?\.(?:\[([a-z,]+)\])?\"?(?:\s|$)", text)
    assert len(installs) == 1, installs
    assert {"scheduler", "worker"} <= set(installs[0].split(",")), installs
