"""The metric families of DESIGN.md, as a scrape shows them: names, types, labels, isolation."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zerobubble.metrics import (
    FINISHED_REASONS,
    METRIC_NAMES,
    ServiceMetrics,
    metric_spec,
    start_metrics_server,
)

# Copied from DESIGN.md on purpose rather than derived from zerobubble.metrics: the names are a
# public contract, and a rename in the code must break this test.
CONTRACT: dict[str, tuple[str, frozenset[str]]] = {
    "zerobubble_num_requests_running": ("gauge", frozenset({"model"})),
    "zerobubble_num_requests_waiting": ("gauge", frozenset({"model"})),
    "zerobubble_kv_cache_usage_ratio": ("gauge", frozenset({"model", "worker"})),
    "zerobubble_prompt_tokens_total": ("counter", frozenset({"model"})),
    "zerobubble_generation_tokens_total": ("counter", frozenset({"model"})),
    "zerobubble_prefix_cache_queries_total": ("counter", frozenset({"model"})),
    "zerobubble_prefix_cache_hits_total": ("counter", frozenset({"model"})),
    "zerobubble_request_success_total": ("counter", frozenset({"model", "finished_reason"})),
    "zerobubble_num_preemptions_total": ("counter", frozenset({"model"})),
    "zerobubble_time_to_first_token_seconds": ("histogram", frozenset({"model"})),
    "zerobubble_inter_token_latency_seconds": ("histogram", frozenset({"model"})),
    "zerobubble_e2e_request_latency_seconds": ("histogram", frozenset({"model"})),
    "zerobubble_request_queue_time_seconds": ("histogram", frozenset({"model"})),
    "zerobubble_spec_decode_num_drafts_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_spec_decode_num_draft_tokens_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_spec_decode_num_accepted_tokens_total":
        ("counter", frozenset({"model", "worker"})),
    "zerobubble_spec_decode_num_accepted_tokens_per_pos_total":
        ("counter", frozenset({"model", "worker", "position"})),
    "zerobubble_worker_step_duration_seconds": ("histogram", frozenset({"model", "worker"})),
    "zerobubble_worker_idle_seconds_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_inflight_steps": ("gauge", frozenset({"model", "worker"})),
    "zerobubble_placeholder_tokens_rolled_back_total": ("counter", frozenset({"model"})),
}


def _record_everything(m: ServiceMetrics, worker: str = "w0") -> None:
    m.set_queues(running=3, waiting=5)
    m.set_kv_usage(worker, 0.25)
    m.set_inflight(worker, 2)
    m.record_step(worker, forward_s=0.004, idle_s=0.0005, num_drafts=2, num_draft_tokens=8,
                  num_accepted=5, accepted_per_pos=[2, 2, 1, 0])
    m.record_finished("eos", ttft_s=0.05, e2e_s=1.2, queue_s=0.01, num_prompt_tokens=17,
                      num_generation_tokens=40)
    m.observe_inter_token(0.02)
    m.add_rolled_back(3)
    m.add_preemptions(1)
    m.add_prefix_cache(queries=16, hits=8)


def _scrape(m: ServiceMetrics) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Exported sample name -> (family type, labels, value) of every sample."""
    samples: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    text = generate_latest(m.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((family.type, dict(s.labels), s.value))
    return samples


def _value(samples: dict[str, list[tuple[str, dict[str, str], float]]], name: str,
           **labels: str) -> float:
    matches = [v for _, lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


def test_metric_names_match_the_contract() -> None:
    assert sorted(METRIC_NAMES) == sorted(CONTRACT)


def test_scrape_has_every_family_with_type_and_labels() -> None:
    m = ServiceMetrics(model="smollm2-135m")
    _record_everything(m)
    samples = _scrape(m)
    for name, (kind, labels) in CONTRACT.items():
        exported = name + "_count" if kind == "histogram" else name
        assert exported in samples, f"{exported} missing from the scrape"
        for family_type, sample_labels, _ in samples[exported]:
            assert family_type == kind, (name, family_type)
            assert set(sample_labels) == labels, (name, sample_labels)
            assert sample_labels["model"] == "smollm2-135m"
        if kind == "histogram":
            buckets = [lab for _, lab, _ in samples[name + "_bucket"]]
            assert {"+Inf"} < {b["le"] for b in buckets}, name
        spec = metric_spec(name)
        assert spec is not None and spec.kind == kind, name


def test_recorded_values_land_in_the_right_series() -> None:
    m = ServiceMetrics(model="m")
    _record_everything(m)
    s = _scrape(m)
    assert _value(s, "zerobubble_num_requests_waiting") == 5
    assert _value(s, "zerobubble_num_requests_running") == 3
    assert _value(s, "zerobubble_kv_cache_usage_ratio", worker="w0") == 0.25
    assert _value(s, "zerobubble_inflight_steps", worker="w0") == 2
    assert _value(s, "zerobubble_spec_decode_num_accepted_tokens_total", worker="w0") == 5
    assert _value(s, "zerobubble_spec_decode_num_draft_tokens_total", worker="w0") == 8
    assert _value(s, "zerobubble_spec_decode_num_drafts_total", worker="w0") == 2
    per_pos = {lab["position"]: v for _, lab, v in
               s["zerobubble_spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {"0": 2, "1": 2, "2": 1, "3": 0}
    assert _value(s, "zerobubble_worker_idle_seconds_total", worker="w0") == pytest.approx(0.0005)
    assert _value(s, "zerobubble_worker_step_duration_seconds_count", worker="w0") == 1
    assert _value(s, "zerobubble_request_success_total", finished_reason="eos") == 1
    assert _value(s, "zerobubble_prompt_tokens_total") == 17
    assert _value(s, "zerobubble_generation_tokens_total") == 40
    assert _value(s, "zerobubble_prefix_cache_hits_total") == 8
    assert _value(s, "zerobubble_prefix_cache_queries_total") == 16
    assert _value(s, "zerobubble_placeholder_tokens_rolled_back_total") == 3
    assert _value(s, "zerobubble_num_preemptions_total") == 1
    assert _value(s, "zerobubble_time_to_first_token_seconds_sum") == pytest.approx(0.05)
    assert _value(s, "zerobubble_inter_token_latency_seconds_count") == 1


def test_series_exist_at_zero_before_anything_happens() -> None:
    # Alerts with rate() and absent() need the series from the first scrape on.
    s = _scrape(ServiceMetrics(model="m"))
    reasons = {lab["finished_reason"]: v for _, lab, v in s["zerobubble_request_success_total"]}
    assert reasons == {r: 0 for r in FINISHED_REASONS}
    assert _value(s, "zerobubble_num_requests_waiting") == 0
    assert _value(s, "zerobubble_time_to_first_token_seconds_count") == 0
    assert "zerobubble_kv_cache_usage_ratio" not in s  # no worker seen yet


def test_two_instances_do_not_share_state() -> None:
    a = ServiceMetrics(model="m")
    b = ServiceMetrics(model="m")
    _record_everything(a)
    sb = _scrape(b)
    assert _value(sb, "zerobubble_prompt_tokens_total") == 0
    assert _value(sb, "zerobubble_num_requests_waiting") == 0
    assert "zerobubble_inflight_steps" not in sb
    assert _value(_scrape(a), "zerobubble_prompt_tokens_total") == 17


def test_finished_reason_accepts_proto_names_and_rejects_unknown() -> None:
    m = ServiceMetrics(model="m")
    m.record_finished("FINISH_REASON_MAX_TOKENS", ttft_s=None, e2e_s=1.0, queue_s=0.0,
                      num_prompt_tokens=1, num_generation_tokens=1)
    s = _scrape(m)
    assert _value(s, "zerobubble_request_success_total", finished_reason="max_tokens") == 1
    # No token was streamed: TTFT must not be invented.
    assert _value(s, "zerobubble_time_to_first_token_seconds_count") == 0
    with pytest.raises(ValueError, match="finished_reason"):
        m.record_finished("timeout", None, 1.0, 0.0, 1, 1)


def test_invalid_figures_are_rejected() -> None:
    m = ServiceMetrics(model="m")
    with pytest.raises(ValueError):
        m.set_kv_usage("w0", 1.5)
    with pytest.raises(ValueError):
        m.add_prefix_cache(queries=1, hits=2)
    with pytest.raises(ValueError):
        m.record_step("w0", 0.01, 0.0, num_drafts=1, num_draft_tokens=2, num_accepted=3)


def test_forget_worker_drops_its_series() -> None:
    m = ServiceMetrics(model="m")
    _record_everything(m, worker="w0")
    _record_everything(m, worker="w1")
    m.forget_worker("w0")
    s = _scrape(m)
    for name in ("zerobubble_kv_cache_usage_ratio", "zerobubble_inflight_steps",
                 "zerobubble_spec_decode_num_accepted_tokens_per_pos_total",
                 "zerobubble_worker_step_duration_seconds_count"):
        assert {lab["worker"] for _, lab, _ in s[name]} == {"w1"}, name
    assert m.workers() == ["w1"]
    m.forget_worker("never-seen")  # a no-op, not an error


def test_metrics_server_serves_the_registry_on_a_free_port() -> None:
    m = ServiceMetrics(model="m")
    m.set_queues(running=1, waiting=7)
    server = start_metrics_server(m, port=0, host="127.0.0.1")
    try:
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'zerobubble_num_requests_waiting{model="m"} 7.0' in body
    finally:
        server.stop()
