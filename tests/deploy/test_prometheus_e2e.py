"""A real Prometheus scrapes a live scheduler and worker; every query we ship is run against it.

One worker (embedded SmolLM2, n-gram speculation) and one scheduler run on loopback; a Prometheus
from the Debian package scrapes both every second with the labels a Kubernetes scrape adds
(namespace, pod) and evaluates the alert rules of ``deploy/prometheus``. After a warm-up request
and a few real generations, the tests query Prometheus's HTTP API at one fixed instant ``t1``
(data at a past instant never changes, so the tests do not depend on each other's order):

- every family of DESIGN.md's table arrives with exactly its labels;
- ``rate(zerobubble_generation_tokens_total[...])`` matches the tokens the clients received;
- every dashboard panel, autoscaler query, alert expression and README query parses and returns
  the shape its consumer expects;
- killing the worker (the provoked condition) puts ``ZerobubbleWorkerDown`` in pending, while
  ``ZerobubbleSchedulerDown`` (not provoked) stays inactive.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from tests.support.prometheus_server import PrometheusServer, ScrapeJob, start_prometheus
from tests.support.servers import Service, start_scheduler, start_worker, wait_serving
from tests.support.tools import require
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.client import Completion, build_request, complete
from zerobubble.metrics import METRIC_SPECS, metric_spec

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy/prometheus/zerobubble-rules.yaml"
DASHBOARD = REPO / "deploy/k8s/components/monitoring/dashboards/zerobubble.json"
ADAPTER = REPO / "deploy/prometheus/prometheus-adapter-values.yaml"
HPA = REPO / "deploy/k8s/components/autoscaling/hpa.yaml"
README = REPO / "README.md"

NAMESPACE = "zerobubble-e2e"
SCHED_JOB = "zerobubble-scheduler"
WORKER_JOB = "zerobubble-worker"
# Labels a scrape adds to every series (job and instance by Prometheus, the rest by our config
# as a Kubernetes ServiceMonitor would).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod"})
SCRAPE_S = 1.0
# Grafana's $__rate_interval is four scrape intervals: 1m at the ServiceMonitor's 15s.
RATE_INTERVAL = "1m"

COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2,"


@dataclass(frozen=True, slots=True)
class Scenario:
    """The traffic of one run: an optional warm-up before t0, then requests sent together."""

    warmup: list[dict[str, Any]]
    requests: list[dict[str, Any]]


SCENARIOS: dict[str, Scenario] = {
    # The default suite: one request on a repetitive prompt, so n-gram drafts are accepted at
    # every position; the counters' baseline is the 0 the scheduler exports before traffic.
    "quick": Scenario(warmup=[], requests=[dict(prompt=COUNTING, max_tokens=16)]),
    # The slow suite: a warm-up moves the baseline off zero, then more requests than the
    # scheduler admits at once (some wait), repetitive and free text, ending by length or EOS.
    "full": Scenario(
        warmup=[dict(prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=8)],
        requests=[
            dict(prompt=COUNTING, max_tokens=32),
            dict(prompt="The cat sat on the mat. The dog sat on the log. The cat sat on the", max_tokens=24),
            dict(messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32),
            dict(prompt="def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return", max_tokens=24),
            dict(prompt="red, green, blue, red, green, blue, red, green,", max_tokens=24),
            dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24),
        ],
    ),
}


async def _generate(target: str, requests: list[dict[str, Any]]) -> tuple[str, list[Completion]]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        info = await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=30)
        done = await asyncio.gather(*[complete(stub, build_request(**r), timeout=180) for r in requests])
    return info.model, list(done)


def _alert_states(prom: PrometheusServer) -> dict[str, str]:
    """alert name -> state (inactive / pending / firing) from the rules API."""
    groups = prom.api("rules", type="alert")["groups"]
    return {r["name"]: r["state"] for g in groups for r in g["rules"]}


def _scrape_services(prom: PrometheusServer, scheduler: Service, worker: Service) -> None:
    """Point Prometheus at both services' metrics, labelled as a Kubernetes scrape would, and
    wait until both targets are up."""
    prom.set_targets(
        ScrapeJob(
            SCHED_JOB,
            [f"127.0.0.1:{scheduler.ports['METRICS']}"],
            {"namespace": NAMESPACE, "pod": "zerobubble-scheduler-0"},
        )
    )
    prom.set_targets(
        ScrapeJob(
            WORKER_JOB,
            [f"127.0.0.1:{worker.ports['METRICS']}"],
            {"namespace": NAMESPACE, "pod": "zerobubble-worker-0"},
        )
    )
    prom.wait_targets_up(2)


def _warm_up(prom: PrometheusServer, target: str, scenario: Scenario, counter: str) -> tuple[int, float]:
    """Send the scenario's warm-up and wait until its tokens are scraped: (its tokens, when that
    baseline was first scraped), returning once two more samples of it precede t0."""
    generated = f"sum({counter})"
    warm = asyncio.run(_generate(target, scenario.warmup))[1] if scenario.warmup else []
    warm_tokens = sum(len(c.token_ids) for c in warm)
    prom.wait_until(lambda: prom.scalar_sum(generated) == warm_tokens, 30, f"{generated} == {warm_tokens}")
    # When the baseline was first scraped: a rate window that starts later sees only the
    # requests below. Two more samples of it before t0 keep one inside such a window.
    (recent,) = prom.query(f"{counter}[1m]")["result"]
    baseline_since = min(float(t) for t, v in recent["values"] if float(v) == warm_tokens)
    time.sleep(max(0.0, baseline_since + 2.5 * SCRAPE_S - time.time()))
    return warm_tokens, baseline_since


def _provoke_worker_down(prom: PrometheusServer, worker: Service) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The provoked condition: the worker process dies, its scrape fails. (Alert states once
    ZerobubbleWorkerDown has left inactive, the active alerts.)"""
    worker.kill()
    prom.wait_until(
        lambda: _alert_states(prom).get("ZerobubbleWorkerDown") != "inactive",
        30,
        "ZerobubbleWorkerDown leaving inactive",
    )
    return _alert_states(prom), prom.api("alerts")["alerts"]


def _print_phases(
    param: str, started: float, phases: list[tuple[str, float]], failed_scrapes: list[tuple[dict[str, str], float]]
) -> None:
    """How long each phase of the setup took, and the failed scrapes (seen with ``-s``)."""
    marks = [started] + [t for _, t in phases]
    print(
        f"prometheus e2e setup ({param}): "
        + ", ".join(f"{name} {t - prev:.1f}s" for (name, t), prev in zip(phases, marks))
        + f"; failed scrapes {failed_scrapes}"
    )


@pytest.fixture(scope="module", params=["quick", pytest.param("full", marks=pytest.mark.slow)])
def live(request: pytest.FixtureRequest, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Services, Prometheus and one round of traffic; then the worker is killed (provoked alert)."""
    require("prometheus")
    scenario = SCENARIOS[request.param]
    started = time.monotonic()
    # Prometheus starts (seconds) while the worker loads its model.
    prom = start_prometheus(
        tmp_path_factory.mktemp("prometheus"), [SCHED_JOB, WORKER_JOB], [RULES], interval_s=SCRAPE_S
    )
    phases = [("prometheus", time.monotonic())]
    worker = scheduler = None
    try:
        worker = start_worker(
            kv_cache_memory_gb=0.2, max_num_seqs=8, metrics_port=0, spec_method="ngram", num_spec_tokens=3
        )
        # One front, as the gpu overlay runs it: its load series reach Prometheus too.
        scheduler = start_scheduler([worker], max_num_seqs=4, fronts=1)
        wait_serving(scheduler.target)
        phases.append(("services", time.monotonic()))
        _scrape_services(prom, scheduler, worker)
        phases.append(("targets up", time.monotonic()))
        counter = f'zerobubble_generation_tokens_total{{job="{SCHED_JOB}"}}'
        generated = f"sum({counter})"
        warm_tokens, baseline_since = _warm_up(prom, scheduler.target, scenario, counter)
        phases.append(("warm-up", time.monotonic()))
        t0 = time.time()
        model, completions = asyncio.run(_generate(scheduler.target, scenario.requests))
        streamed = sum(len(c.token_ids) for c in completions)
        phases.append(("generation", time.monotonic()))
        prom.wait_until(
            lambda: prom.scalar_sum(generated) == warm_tokens + streamed, 30, f"{generated} == {warm_tokens + streamed}"
        )
        time.sleep(1.5 * SCRAPE_S)
        t1 = time.time()
        before_kill = prom.api("rules")["groups"]
        span = f"{math.ceil(t1 - t0) + 10}s"
        failed_scrapes = prom.vector(f"sum by (job) (count_over_time(up[{span}]) - sum_over_time(up[{span}]))", at=t1)
        phases.append(("scraped", time.monotonic()))
        after_kill, active_alerts = _provoke_worker_down(prom, worker)
        phases.append(("alert pending", time.monotonic()))
        _print_phases(request.param, started, phases, failed_scrapes)
        yield dict(
            prom=prom,
            model=model,
            completions=completions,
            warm_tokens=warm_tokens,
            streamed=streamed,
            baseline_since=baseline_since,
            t0=t0,
            t1=t1,
            rules=before_kill,
            after_kill=after_kill,
            active_alerts=active_alerts,
        )
    finally:
        prom.stop()
        for service in (scheduler, worker):
            if service is not None:
                service.stop()


# --- families and labels --------------------------------------------------------------------------


def _series(live: dict[str, Any], job: str) -> list[dict[str, str]]:
    prom: PrometheusServer = live["prom"]
    return prom.api(
        "series",
        **{"match[]": f'{{__name__=~"zerobubble_.+", job="{job}"}}'},
        start=f"{live['t0']:.3f}",
        end=f"{live['t1']:.3f}",
    )


def _family_labels(series: list[dict[str, str]]) -> dict[str, set[frozenset[str]]]:
    """sample name -> the label-name sets it was seen with (``__name__`` left out)."""
    seen: dict[str, set[frozenset[str]]] = {}
    for s in series:
        seen.setdefault(s["__name__"], set()).add(frozenset(k for k in s if k != "__name__"))
    return seen


def _sample_names(spec: Any) -> list[str]:
    if spec.kind == "histogram":
        return [spec.name + suffix for suffix in ("_bucket", "_sum", "_count")]
    return [spec.name]


def _expected_labels(name: str) -> frozenset[str]:
    spec = metric_spec(name)
    assert spec is not None, name
    return frozenset(spec.labels) | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())


def test_every_design_family_arrives_with_its_labels(live: dict[str, Any]) -> None:
    sched = _family_labels(_series(live, SCHED_JOB))
    for spec in METRIC_SPECS:
        for name in _sample_names(spec):
            assert name in sched, f"Prometheus has no {name} from the scheduler"
            assert sched[name] == {_expected_labels(name)}, (name, sched[name])
    # Nothing outside the contract (prometheus_client's *_created timestamps aside).
    extra = {n for n in sched if metric_spec(n) is None and not n.endswith("_created")}
    assert not extra, extra


def test_the_worker_exports_its_own_figures(live: dict[str, Any]) -> None:
    worker = _family_labels(_series(live, WORKER_JOB))
    for spec in (s for s in METRIC_SPECS if "worker" in s.labels):
        for name in _sample_names(spec):
            assert worker.get(name) == {_expected_labels(name)}, (name, worker.get(name))


def test_label_values_name_the_model_and_one_worker(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    window = dict(start=f"{live['t0']:.3f}", end=f"{live['t1']:.3f}")
    models = prom.api("label/model/values", **{"match[]": '{__name__=~"zerobubble_.+"}'}, **window)
    assert models == [live["model"]]
    # The scheduler labels a worker's figures with the id the worker uses for its own.
    workers = prom.api("label/worker/values", **{"match[]": '{__name__=~"zerobubble_.+"}'}, **window)
    assert len(workers) == 1, workers


# --- counters against what the clients saw --------------------------------------------------------


def test_generation_rate_agrees_with_the_tokens_received(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    counter = f'zerobubble_generation_tokens_total{{job="{SCHED_JOB}"}}'
    t0, t1, streamed = live["t0"], live["t1"], live["streamed"]
    assert all(c.finish_reason in ("max_tokens", "eos") for c in live["completions"])
    # The counter itself, read back from Prometheus's storage, is exact.
    assert prom.scalar_sum(f"sum({counter})", at=t0) == live["warm_tokens"]
    assert prom.scalar_sum(f"sum({counter})", at=t1) == live["warm_tokens"] + streamed
    # A window that starts after the baseline was first scraped and before t0 holds samples of
    # the flat baseline, then of the requests, then of the flat total: its raw increase is
    # exactly `streamed`. rate() extrapolates that towards the window's edges, never beyond
    # them, so rate * W lies between `streamed` and `streamed * W / (last - first sample time)`
    # whatever the scrape jitter.
    window = math.floor(t1 - live["baseline_since"])
    raw = prom.query(f"{counter}[{window}s]", at=t1)
    assert raw["resultType"] == "matrix" and len(raw["result"]) == 1, raw
    samples = [(float(t), float(v)) for t, v in raw["result"][0]["values"]]
    assert samples[0][1] == live["warm_tokens"] and samples[-1][1] == live["warm_tokens"] + streamed
    span = samples[-1][0] - samples[0][0]
    assert span > window / 2, f"too few scrapes: {len(samples)} samples over {span:.1f}s"
    low, high = streamed / window, streamed / span
    rate = prom.scalar_sum(f"sum(rate({counter}[{window}s]))", at=t1)
    assert rate is not None and low * 0.999 <= rate <= high * 1.001, (rate, low, high, samples)
    increase = prom.scalar_sum(f"sum(increase({counter}[{window}s]))", at=t1)
    assert increase is not None
    assert streamed * 0.999 <= increase <= streamed * window / span * 1.001, (increase, streamed)


def test_accepted_tokens_per_position_add_up(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    job = f'job="{SCHED_JOB}"'
    per_pos = prom.vector(
        f"sum by (position) (zerobubble_spec_decode_num_accepted_tokens_per_pos_total{{{job}}})", at=live["t1"]
    )
    total = prom.scalar_sum(f"sum(zerobubble_spec_decode_num_accepted_tokens_total{{{job}}})", at=live["t1"])
    assert total and total > 0, "n-gram speculation accepted nothing on repetitive prompts"
    assert sum(v for _, v in per_pos) == total
    # A draft token is accepted only if every earlier one was: counts fall with position.
    counts = [v for _, v in sorted(per_pos, key=lambda s: int(s[0]["position"]))]
    assert counts == sorted(counts, reverse=True), counts


# --- every expression we ship ---------------------------------------------------------------------


def _dashboard_targets() -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every panel target, nested rows included."""
    out: list[tuple[str, str, str]] = []

    def walk(panels: list[Any]) -> None:
        for panel in panels:
            for target in panel.get("targets") or []:
                out.append((panel.get("title", ""), target["expr"], target.get("legendFormat", "")))
            walk(panel.get("panels") or [])

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def _grafana(expr: str, model: str) -> str:
    """Substitute the dashboard's variables as Grafana would for our namespace and job."""
    return (
        expr.replace("$namespace", NAMESPACE)
        .replace("$job", SCHED_JOB)
        .replace("$model", model)
        .replace("$__rate_interval", RATE_INTERVAL)
    )


def test_every_dashboard_panel_returns_its_series(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    targets = _dashboard_targets()
    assert len(targets) > 20
    for title, expr, legend in targets:
        samples = prom.vector(_grafana(expr, live["model"]), at=live["t1"])
        assert samples, f"panel {title!r}: {expr} returned no data"
        # The legend names exactly the labels the panel's series carry ({{worker}} per worker,
        # none for a single summed line).
        wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        for labels, _ in samples:
            assert set(labels) - {"__name__"} == wanted, (title, expr, labels)


def test_dashboard_variables_list_our_namespace_job_and_model(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    expected = {"namespace": NAMESPACE, "job": SCHED_JOB, "model": live["model"]}
    for variable in (v for v in templating if v["type"] == "query"):
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
        assert match, variable["definition"]
        selector, label = _grafana(match[1], live["model"]), match[2]
        values = prom.api(
            f"label/{label}/values", **{"match[]": selector}, start=f"{live['t0']:.3f}", end=f"{live['t1']:.3f}"
        )
        assert expected[variable["name"]] in values, (variable["name"], values)


def test_autoscaler_queries_return_one_value_per_namespace(live: dict[str, Any]) -> None:
    # prometheus-adapter lists series with seriesQuery, then runs metricsQuery with the HPA's
    # selector and namespace as <<.LabelMatchers>> and the namespace as <<.GroupBy>>.
    prom: PrometheusServer = live["prom"]
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]["external"]
    hpa = yaml.safe_load(HPA.read_text())
    published = {rule["name"]["as"]: rule for rule in rules}
    for metric in hpa["spec"]["metrics"]:
        external = metric["external"]["metric"]
        rule = published[external["name"]]
        assert prom.api(
            "series", **{"match[]": rule["seriesQuery"]}, start=f"{live['t0']:.3f}", end=f"{live['t1']:.3f}"
        ), rule["seriesQuery"]
        matchers = {**external["selector"]["matchLabels"], "namespace": NAMESPACE}
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])
        assert series, rule["seriesQuery"]
        expr = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series[0])
            .replace("<<.LabelMatchers>>", ",".join(f'{k}="{v}"' for k, v in sorted(matchers.items())))
            .replace("<<.GroupBy>>", "namespace")
        )
        samples = prom.vector(expr, at=live["t1"])
        assert [labels for labels, _ in samples] == [{"namespace": NAMESPACE}], (expr, samples)
        value = samples[0][1]
        if external["name"] == "zerobubble_num_requests_waiting":
            assert value == 0  # every request had finished by t1
        else:
            assert 0 <= value <= 1, (expr, value)


def _as_bool(expr: str) -> str:
    """The alert expression with each filtering comparison turned into a 0/1 one.

    A filter drops the samples that do not meet the threshold, so a healthy system returns
    nothing; with ``bool`` every series the alert watches comes back, which shows the
    selectors and joins match live data.
    """
    return re.sub(r"\s(==|!=|>=|<=|>|<)\s", r" \1 bool ", expr)


def test_every_alert_expression_selects_live_series(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) == 12
    for rule in rules:
        samples = prom.vector(_as_bool(rule["expr"]), at=live["t1"])
        assert samples, f"{rule['alert']}: {_as_bool(rule['expr'])} selects no series"
        # Every label the alert's annotations print must be on each series it can fire for.
        used = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule.get("annotations", {}))))
        for labels, value in samples:
            assert used <= set(labels), (rule["alert"], used, labels)
            assert value in (0.0, 1.0), (rule["alert"], labels, value)


def test_prometheus_evaluated_every_rule_without_error(live: dict[str, Any]) -> None:
    rules = [rule for group in live["rules"] for rule in group["rules"]]
    assert len(rules) == 12
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule


def _readme_blocks(language: str) -> list[str]:
    text = README.read_text()
    section = text[text.index("\n## Metrics\n") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_readme_scrape_config_and_queries(live: dict[str, Any]) -> None:
    prom: PrometheusServer = live["prom"]
    (config,) = _readme_blocks("yaml")
    jobs = yaml.safe_load(config)["scrape_configs"]
    assert [job["job_name"] for job in jobs] == [SCHED_JOB]
    (block,) = _readme_blocks("promql")
    throughput, acceptance, idle = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    [(labels, tokens_per_s)] = prom.vector(throughput, at=live["t1"])
    assert labels == {"model": live["model"]} and tokens_per_s > 0
    per_pos = prom.vector(acceptance, at=live["t1"])
    assert {labels["position"] for labels, _ in per_pos} == {"0", "1", "2"}
    rates = [v for _, v in sorted(per_pos, key=lambda s: int(s[0]["position"]))]
    assert all(0 <= r <= 1 for r in rates) and rates == sorted(rates, reverse=True), rates
    fractions = prom.vector(idle, at=live["t1"])
    assert len(fractions) == 1 and 0 <= fractions[0][1] <= 1, fractions


# --- alerts ---------------------------------------------------------------------------------------


def test_a_killed_worker_makes_its_alert_pending(live: dict[str, Any]) -> None:
    assert live["after_kill"]["ZerobubbleWorkerDown"] in ("pending", "firing")
    (alert,) = [a for a in live["active_alerts"] if a["labels"]["alertname"] == "ZerobubbleWorkerDown"]
    assert alert["labels"]["job"] == WORKER_JOB and alert["labels"]["pod"] == "zerobubble-worker-0"
    assert alert["labels"]["namespace"] == NAMESPACE
    assert alert["annotations"]["summary"] == (f"zerobubble worker {NAMESPACE}/zerobubble-worker-0 is not scraped")


def test_alerts_not_provoked_stay_inactive(live: dict[str, Any]) -> None:
    states = live["after_kill"]
    assert states["ZerobubbleSchedulerDown"] == "inactive"
    assert states["ZerobubbleRequestErrors"] == "inactive"
    assert states["ZerobubbleQueueBacklog"] == "inactive"
