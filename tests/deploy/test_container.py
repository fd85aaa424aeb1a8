"""The CPU image (deploy/Dockerfile) run the way the manifests run it, with podman.

One scheduler container and two worker containers on the host network, configured from the
ConfigMap sources of the ``cpu-demo`` overlay (``deploy/k8s/base/*.env`` merged with the
overlay's), as uid 10001 with no capabilities and, for the scheduler, a read-only root
filesystem. Ports are the services' own announcements (several runs share a host); the probes
are the manifests' probes run against them. Then:

- the image's user, exposed ports and stop signal are the manifests' (uid 10001, every
  containerPort, SIGTERM);
- the manifests' readiness and liveness probes pass on every container;
- workload rows through the scheduler's OpenAI front equal Hugging Face's greedy output computed
  in this process, while one worker container is killed (SIGKILL) with requests in flight on it:
  no request is lost or changed;
- ``/metrics`` scraped from the scheduler and the surviving worker parse and carry the contract's
  families, labelled with the worker ids the pods would give;
- ``podman stop`` (SIGTERM) on the scheduler and the surviving worker while a request streams:
  the request completes and each container exits 0 within the grace period.

The image is built by ``make images`` (deploy/build_images.sh); the test skips without podman or
the image (under CI it fails instead).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.e2e import SUBSET, SUBSET_MAX_TOKENS, hf_texts
from tests.support.metrics_scrape import scrape, total
from tests.support.polling import wait_until
from tests.support.tools import require
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.metrics import METRIC_SPECS, metric_spec

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/k8s"
IMAGE = os.environ.get("ZEROBUBBLE_IMAGE", "localhost/zerobubble:0.1.0")
# The same podman invocation as deploy/build_images.sh: runc and cgroupfs work on hosts whose
# cgroup layout crun refuses, and podman's default ulimits exceed what some hosts allow.
PODMAN = shlex.split(os.environ.get("PODMAN", "podman --runtime runc --cgroup-manager=cgroupfs"))
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]
MODEL = "smollm2-135m"
START_TIMEOUT_S = 240.0


@dataclass(slots=True)
class Container:
    """A running container and the ports its service announced (``ZEROBUBBLE_<WHAT>_PORT=n``)."""

    name: str
    ports: dict[str, int] = field(default_factory=dict)

    def logs(self) -> str:
        out = subprocess.run([*PODMAN, "logs", self.name], capture_output=True, text=True, timeout=30)
        return out.stdout + out.stderr

    def state(self) -> tuple[bool, int]:
        """(running, exit code)."""
        out = podman("inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}", self.name)
        running, code = out.split()
        return running == "true", int(code)


def podman(*args: str, timeout: float = 120.0) -> str:
    out = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"podman {' '.join(args)}: {out.stderr}"
    return out.stdout.strip()


def overlay_env(role: str) -> dict[str, str]:
    """The ConfigMap a pod of ``role`` gets in cpu-demo: base values merged with the overlay's."""
    env: dict[str, str] = {}
    for path in (K8S / "base" / f"{role}.env", K8S / "overlays/cpu-demo" / f"{role}.env"):
        for line in path.read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                key, value = line.split("=", 1)
                env[key.strip()] = value.strip()
    return env


def manifest_container(role: str) -> dict[str, Any]:
    """The container spec of ``role`` in deploy/k8s/base/<role>.yaml."""
    for doc in yaml.safe_load_all((K8S / "base" / f"{role}.yaml").read_text()):
        if doc and doc["kind"] in ("Deployment", "StatefulSet"):
            return dict(doc["spec"]["template"]["spec"]["containers"][0])
    raise AssertionError(f"no workload in {role}.yaml")


def run_container(
    name: str, args: list[str], env: dict[str, str], wait_for: tuple[str, ...], read_only: bool
) -> Container:
    """``podman run`` as the manifests' securityContext asks, then wait for the port lines."""
    flags = ["--detach", "--name", name, "--network", "host", "--user", "10001:10001"]
    flags += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", *ULIMITS]
    # read-only: the scheduler's readOnlyRootFilesystem; podman then mounts a tmpfs on /tmp, as the
    # manifests mount an emptyDir there.
    flags += ["--read-only"] if read_only else ["--tmpfs", "/tmp"]
    for key, value in env.items():
        flags += ["--env", f"{key}={value}"]
    podman("run", *flags, IMAGE, *args)
    container = Container(name)

    def announced() -> bool:
        logs = container.logs()
        for key, value in re.findall(r"^ZEROBUBBLE_(\w+)_PORT=(\d+)$", logs, re.M):
            container.ports[key] = int(value)
        running, code = container.state()
        assert running, f"{name} exited with {code}:\n{logs[-4000:]}"
        return all(w in container.ports for w in wait_for)

    wait_until(announced, START_TIMEOUT_S, f"{name} to announce {wait_for}", poll=0.5)
    return container


def grpc_probe(port: int, service: str) -> bool:
    """kubelet's gRPC probe: grpc.health.v1 Check, SERVING."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def tcp_probe(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        sock.settimeout(3)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def run_probes(role: str, container: Container, port_of: dict[int, int]) -> None:
    """Every probe of the manifest's container, against the port the service announced in place
    of the manifest's (``port_of``: manifest port -> announced port; named ports resolved)."""
    spec = manifest_container(role)
    named = {p["name"]: p["containerPort"] for p in spec["ports"]}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = spec.get(kind)
        if probe is None:
            continue
        if "grpc" in probe:
            port = port_of[probe["grpc"]["port"]]
            service = probe["grpc"].get("service", "")
            what = f"{container.name}'s {kind} ({service or 'overall'})"
            wait_until(lambda port=port, service=service: grpc_probe(port, service), 60, what)
        else:
            target = probe["tcpSocket"]["port"]
            port = port_of[named.get(target, target)]
            assert tcp_probe(port), f"{container.name}'s {kind}: nothing listens on {port}"


@pytest.fixture(scope="module")
def podman_ready() -> None:
    require("podman")
    require("runc")
    exists = subprocess.run([*PODMAN, "image", "exists", IMAGE], capture_output=True)
    if exists.returncode != 0:
        message = f"image {IMAGE} not built: run `make images` (deploy/build_images.sh)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}. CI builds it before the tests: a skipped test counts as missing.")
        pytest.skip(message)


@dataclass(slots=True)
class Deployment:
    scheduler: Container
    workers: list[Container]
    started_s: float
    killed: int | None = None  # the worker container the kill test killed


@pytest.fixture(scope="module")
def deployment(podman_ready: None) -> Iterator[Deployment]:
    prefix = f"zb-test-{os.getpid()}-{secrets.token_hex(3)}"
    names: list[str] = []
    token = secrets.token_hex(16)
    start = time.monotonic()
    try:
        workers = []
        for i in range(2):
            names.append(f"{prefix}-worker-{i}")
            env = overlay_env("worker") | {
                # The pod's name (downward API) and the Secret's token, as worker.yaml sets them.
                "ZEROBUBBLE_WORKER_ID": f"zerobubble-worker-{i}",
                "ZEROBUBBLE_AUTH_TOKEN": token,
                # Host network: loopback only, ports chosen by the kernel and announced.
                "ZEROBUBBLE_HOST": "127.0.0.1",
                "ZEROBUBBLE_PORT": "0",
                "ZEROBUBBLE_METRICS_PORT": "0",
                # Two workers and the test share the machine's cores.
                "ZEROBUBBLE_NUM_THREADS": "1",
            }
            workers.append(run_container(names[-1], ["worker"], env, ("WORKER", "METRICS"), read_only=False))
        names.append(f"{prefix}-scheduler")
        env = overlay_env("scheduler") | {
            "ZEROBUBBLE_WORKERS": ",".join(f"127.0.0.1:{w.ports['WORKER']}" for w in workers),
            "ZEROBUBBLE_WORKER_AUTH_TOKEN": token,
            "ZEROBUBBLE_HOST": "127.0.0.1",
            "ZEROBUBBLE_PORT": "0",
            "ZEROBUBBLE_HTTP_PORT": "0",
            "ZEROBUBBLE_METRICS_PORT": "0",
        }
        scheduler = run_container(names[-1], ["scheduler"], env, ("SCHEDULER", "HTTP", "METRICS"), read_only=True)
        yield Deployment(scheduler, workers, time.monotonic() - start)
    finally:
        for name in names:
            subprocess.run([*PODMAN, "rm", "--force", "--time", "0", name], capture_output=True, timeout=120)


def num_workers(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        return int(stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10).num_workers)


def test_image_declares_the_manifests_user_ports_and_stop_signal(podman_ready: None) -> None:
    """runAsNonRoot needs a numeric non-root USER; the pods' container ports should be exposed."""
    config = json.loads(podman("image", "inspect", "--format", "{{json .Config}}", IMAGE))
    assert config["User"] == "10001:10001", config["User"]
    for role in ("scheduler", "worker"):
        manifest = manifest_container(role)
        docs = yaml.safe_load_all((K8S / "base" / f"{role}.yaml").read_text())
        pod = next(d for d in docs if d and d["kind"] in ("Deployment", "StatefulSet"))["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsUser"] == 10001
        for port in manifest["ports"]:
            assert f"{port['containerPort']}/tcp" in config["ExposedPorts"], (role, port)
    assert config.get("StopSignal", "SIGTERM") == "SIGTERM"


def test_probes_of_the_manifests_pass(deployment: Deployment) -> None:
    for worker in deployment.workers:
        run_probes("worker", worker, {50061: worker.ports["WORKER"], 9091: worker.ports["METRICS"]})
    sched = deployment.scheduler
    run_probes(
        "scheduler", sched, {50051: sched.ports["SCHEDULER"], 8000: sched.ports["HTTP"], 9090: sched.ports["METRICS"]}
    )
    wait_until(lambda: num_workers(sched.ports["SCHEDULER"]) == 2, 60, "the scheduler to connect to both workers")
    print(f"containers serving {deployment.started_s:.1f} s after the first podman run")


# Content deltas streamed over all rows before a worker is killed: the rows are admitted and
# decoding, far from their SUBSET_MAX_TOKENS.
KILL_AFTER_TOKENS = 4


async def stream_chat(sdk: openai.AsyncOpenAI, row: dict[str, Any], on_delta: Callable[[], None]) -> tuple[str, str]:
    """One greedy chat completion, streamed; ``on_delta`` is called at each content delta."""
    text, reason = "", ""
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=row["messages"], max_tokens=SUBSET_MAX_TOKENS, temperature=0, stream=True
    )
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                text += choice.delta.content
                on_delta()
            if choice.finish_reason:
                reason = choice.finish_reason
    return text, reason


def inflight_plans(deployment: Deployment) -> list[float]:
    """Plans the scheduler has in flight to each worker container (its own per-worker gauge)."""
    samples = scrape(deployment.scheduler.ports["METRICS"])
    return [
        total(samples, "zerobubble_inflight_steps", worker=f"zerobubble-worker-{i}")
        for i in range(len(deployment.workers))
    ]


def test_greedy_rows_survive_a_killed_worker_container(
    deployment: Deployment, smollm2_dir: Path, grounded_rows: list[dict[str, Any]]
) -> None:
    rows = [grounded_rows[i] for i in SUBSET]
    reference = hf_texts(smollm2_dir, rows, SUBSET_MAX_TOKENS)
    base_url = f"http://127.0.0.1:{deployment.scheduler.ports['HTTP']}/v1"
    wait_until(lambda: num_workers(deployment.scheduler.ports["SCHEDULER"]) == 2, 60, "both workers connected")

    async def run() -> list[tuple[str, str]]:
        streamed = 0
        enough = asyncio.Event()

        def on_delta() -> None:
            nonlocal streamed
            streamed += 1
            if streamed >= KILL_AFTER_TOKENS:
                enough.set()

        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as sdk:
            tasks = [asyncio.create_task(stream_chat(sdk, row, on_delta)) for row in rows]
            await asyncio.wait_for(enough.wait(), 240)
            # The worker with the most plans in flight (routing may give one worker every row):
            # killing it loses steps it was computing, not only an idle connection.
            plans = inflight_plans(deployment)
            deadline = time.monotonic() + 10
            while max(plans) == 0 and time.monotonic() < deadline:  # a moment between two plans
                await asyncio.sleep(0.02)
                plans = inflight_plans(deployment)
            deployment.killed = plans.index(max(plans))
            assert plans[deployment.killed] > 0, f"no plan in flight to any worker: {plans}"
            podman("kill", "--signal", "KILL", deployment.workers[deployment.killed].name)
            assert not all(t.done() for t in tasks), "every request ended before the kill"
            return list(await asyncio.gather(*tasks))

    ours = asyncio.run(run())
    assert deployment.killed is not None
    assert not deployment.workers[deployment.killed].state()[0], "the killed worker container still runs"
    differ = [f"row {i}: containers {a!r}\n        HF {b!r}" for i, (a, b) in enumerate(zip(ours, reference)) if a != b]
    assert not differ, "\n".join(differ)


def survivor(deployment: Deployment) -> Container:
    """The worker container the kill spared (the second when the kill test did not run)."""
    return deployment.workers[1 - deployment.killed if deployment.killed is not None else 1]


def family_of(sample: str) -> str | None:
    """The contract family of a sample (``X_bucket`` -> ``X``; ``X_created`` too)."""
    spec = metric_spec(sample) or metric_spec(sample.removesuffix("_created") + "_total")
    spec = spec or metric_spec(sample.removesuffix("_created"))
    return spec.name if spec is not None else None


def test_metrics_scraped_from_the_containers(deployment: Deployment) -> None:
    sched = scrape(deployment.scheduler.ports["METRICS"])
    names = {family_of(s.name) for s in sched}
    # A front's series exist while one is attached; this scheduler has none.
    missing = [s.name for s in METRIC_SPECS if "front" not in s.labels and s.name not in names]
    assert not missing, f"the scheduler container does not export {missing}"
    assert total(sched, "zerobubble_generation_tokens_total") > 0
    worker = survivor(deployment)
    own = [s for s in scrape(worker.ports["METRICS"]) if s.name.startswith("zerobubble_")]
    assert own and all(family_of(s.name) for s in own), "the worker exports series outside the contract"
    worker_id = f"zerobubble-worker-{deployment.workers.index(worker)}"
    assert {s.labels.get("worker") for s in own if "worker" in s.labels} == {worker_id}
    assert total(own, "zerobubble_worker_step_duration_seconds_count") > 0


# Long enough that the request is still running when SIGTERM arrives, whatever the host's speed.
DRAIN_MAX_TOKENS = 96


def test_sigterm_drains_a_running_request_and_exits_cleanly(
    deployment: Deployment, grounded_rows: list[dict[str, Any]]
) -> None:
    """``podman stop`` sends the image's STOPSIGNAL (SIGTERM) and waits the grace period, as the
    kubelet does at a rollout or node drain. Stopping the scheduler and the worker together while
    a request streams: both stop taking requests, the running one still completes, and each
    container exits 0 before the grace period ends (a SIGKILL after it would read 137)."""
    base_url = f"http://127.0.0.1:{deployment.scheduler.ports['HTTP']}/v1"
    containers = [survivor(deployment), deployment.scheduler]
    row = grounded_rows[SUBSET[0]]

    async def run() -> tuple[str, str | None]:
        first = asyncio.Event()
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as sdk:
            stream = await sdk.chat.completions.create(
                model=MODEL, messages=row["messages"], max_tokens=DRAIN_MAX_TOKENS, temperature=0, stream=True
            )

            async def read() -> tuple[str, str | None]:
                text, reason = "", None
                async for chunk in stream:
                    for choice in chunk.choices:
                        if choice.delta.content:
                            text += choice.delta.content
                            first.set()
                        reason = choice.finish_reason or reason
                return text, reason

            reading = asyncio.create_task(read())
            await asyncio.wait_for(first.wait(), 120)
            stops = [asyncio.to_thread(podman, "stop", "--time", "60", c.name, timeout=90) for c in containers]
            stopping = asyncio.gather(*stops)
            await asyncio.sleep(0)
            assert not reading.done(), "the request ended before SIGTERM"
            result = await reading
            await stopping
            return result

    started = time.monotonic()
    text, reason = asyncio.run(run())
    assert reason in ("length", "stop") and text, (reason, text)
    for container in containers:
        running, code = container.state()
        assert not running and code == 0, f"{container.name} exited {code}:\n{container.logs()[-4000:]}"
    assert time.monotonic() - started < 55, "the containers took the whole grace period to stop"
    # The scheduler's shutdown log counts the requests it drained: the SIGTERM came mid-request.
    drained = re.search(r"draining (\d+) requests", deployment.scheduler.logs())
    assert drained and int(drained.group(1)) >= 1, deployment.scheduler.logs()[-4000:]
