"""The metric families of DESIGN.md, as a scrape shows them: names, types, labels, isolation."""

from __future__ import annotations

import logging
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zerobubble.api import worker_pb2
from zerobubble.metrics import (
    FINISHED_REASONS,
    METRIC_NAMES,
    ServiceMetrics,
    metric_spec,
    start_metrics_server,
)
from zerobubble.rows import ResultBuilder

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
    "zerobubble_spec_decode_num_accepted_tokens_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_spec_decode_num_accepted_tokens_per_pos_total": ("counter", frozenset({"model", "worker", "position"})),
    "zerobubble_spec_decode_prediction_draft_tokens_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_spec_decode_prediction_accepted_tokens_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_spec_decode_suffix_continuation_tokens": ("histogram", frozenset({"model", "worker"})),
    "zerobubble_spec_decode_draft_slots": ("histogram", frozenset({"model", "worker"})),
    "zerobubble_worker_step_duration_seconds": ("histogram", frozenset({"model", "worker"})),
    "zerobubble_worker_idle_seconds_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_worker_collective_seconds_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_worker_tensor_parallel_size": ("gauge", frozenset({"model", "worker"})),
    "zerobubble_grammar_seconds_total": ("counter", frozenset({"model", "worker"})),
    "zerobubble_inflight_steps": ("gauge", frozenset({"model", "worker"})),
    "zerobubble_placeholder_tokens_rolled_back_total": ("counter", frozenset({"model"})),
}


def _record_everything(m: ServiceMetrics, worker: str = "w0") -> None:
    m.set_queues(running=3, waiting=5)
    m.set_kv_usage(worker, 0.25)
    m.set_inflight(worker, 2)
    m.record_step(
        worker,
        forward_s=0.004,
        idle_s=0.0005,
        num_drafts=2,
        num_draft_tokens=8,
        num_accepted=5,
        accepted_per_pos=[2, 2, 1, 0],
    )
    m.observe_ttft(0.05)
    m.record_finished("eos", e2e_s=1.2, queue_s=0.01, num_prompt_tokens=17, num_generation_tokens=40)
    m.observe_inter_token([(0.02, 1)])
    m.add_rolled_back(3)
    m.add_preemptions(1)
    m.add_prefix_cache(queries=16, hits=8)
    m.add_suffix_continuations(worker, [1, 0, 2])
    m.add_draft_slots(worker, [2, 0, 1, 3])


def _scrape(m: ServiceMetrics) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Exported sample name -> (family type, labels, value) of every sample."""
    samples: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    text = generate_latest(m.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((family.type, dict(s.labels), s.value))
    return samples


def _value(samples: dict[str, list[tuple[str, dict[str, str], float]]], name: str, **labels: str) -> float:
    matches = [v for _, lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, samples.get(name))
    return matches[0]


# Beyond the families every service exports (docs/DESIGN.md, "Metrics"): the fronts' load, reported over their stream.
EXTENSIONS: dict[str, tuple[str, frozenset[str]]] = {
    "zerobubble_front_cpu_seconds_total": ("counter", frozenset({"model", "front"})),
    "zerobubble_front_calls_running": ("gauge", frozenset({"model", "front"})),
}


def test_metric_names_match_the_contract() -> None:
    assert sorted(METRIC_NAMES) == sorted(CONTRACT | EXTENSIONS)


def test_a_fronts_series_count_its_reports_and_go_when_it_detaches() -> None:
    m = ServiceMetrics(model="m")
    m.record_front_load("h:1", cpu_seconds=2.5, num_calls=4)
    m.record_front_load("h:2", cpu_seconds=1.0, num_calls=0)
    m.record_front_load("h:1", cpu_seconds=3.0, num_calls=1)
    s = _scrape(m)
    for name, (kind, labels) in EXTENSIONS.items():
        assert {t for t, _, _ in s[name]} == {kind} and all(set(lab) == labels for _, lab, _ in s[name])
    # The counter holds the front's CPU time (it grows by the difference of two reports).
    assert _value(s, "zerobubble_front_cpu_seconds_total", front="h:1") == pytest.approx(3.0)
    assert _value(s, "zerobubble_front_calls_running", front="h:1") == 1
    m.forget_front("h:1")
    s = _scrape(m)
    assert [lab["front"] for _, lab, _ in s["zerobubble_front_calls_running"]] == ["h:2"]
    assert m.fronts() == ["h:2"]


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
    per_pos = {lab["position"]: v for _, lab, v in s["zerobubble_spec_decode_num_accepted_tokens_per_pos_total"]}
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
    assert _value(s, "zerobubble_spec_decode_suffix_continuation_tokens_count", worker="w0") == 3
    assert _value(s, "zerobubble_spec_decode_suffix_continuation_tokens_sum", worker="w0") == 4
    assert _value(s, "zerobubble_spec_decode_draft_slots_count", worker="w0") == 6
    assert _value(s, "zerobubble_spec_decode_draft_slots_sum", worker="w0") == 11


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
    m.record_finished("FINISH_REASON_MAX_TOKENS", e2e_s=1.0, queue_s=0.0, num_prompt_tokens=1, num_generation_tokens=1)
    # Cancelled while queued: no queue time to record, and no TTFT either.
    m.record_finished("cancelled", 2.0, None, 5, 0)
    s = _scrape(m)
    assert _value(s, "zerobubble_request_success_total", finished_reason="max_tokens") == 1
    assert _value(s, "zerobubble_request_success_total", finished_reason="cancelled") == 1
    # TTFT is observed when the first token streams (observe_ttft), never a second time here.
    assert _value(s, "zerobubble_time_to_first_token_seconds_count") == 0
    assert _value(s, "zerobubble_request_queue_time_seconds_count") == 1
    assert _value(s, "zerobubble_e2e_request_latency_seconds_count") == 2
    assert _value(s, "zerobubble_prompt_tokens_total") == 6


def test_unknown_finished_reason_is_counted_as_error_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    m = ServiceMetrics(model="m")
    with caplog.at_level(logging.WARNING, logger="zerobubble.metrics"):
        m.record_finished("timeout", 1.0, 0.0, 1, 1)
        m.record_finished("FINISH_REASON_UNSPECIFIED", 1.0, 0.0, 1, 1)
    s = _scrape(m)
    # Bounded label values only: no 'timeout' series appears.
    reasons = {lab["finished_reason"] for _, lab, _ in s["zerobubble_request_success_total"]}
    assert reasons == set(FINISHED_REASONS)
    assert _value(s, "zerobubble_request_success_total", finished_reason="error") == 2
    assert "unknown finished_reason 'timeout'" in caplog.text


def test_inconsistent_figures_are_sanitized_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # These run inside the serving loops, where an exception would break a stream.
    m = ServiceMetrics(model="m")
    with caplog.at_level(logging.WARNING, logger="zerobubble.metrics"):
        m.set_kv_usage("w0", 1.5)
        m.add_prefix_cache(queries=1, hits=2)
        for _ in range(3):
            m.record_step("w0", 0.01, 0.0, num_drafts=1, num_draft_tokens=2, num_accepted=3)
    s = _scrape(m)
    assert _value(s, "zerobubble_kv_cache_usage_ratio", worker="w0") == 1.0
    assert _value(s, "zerobubble_prefix_cache_hits_total") == 1
    assert _value(s, "zerobubble_spec_decode_num_accepted_tokens_total", worker="w0") == 6
    assert caplog.text.count("num_accepted=3") == 1
    assert "outside [0, 1]" in caplog.text and "exceed queries" in caplog.text


def test_forget_worker_drops_its_series() -> None:
    m = ServiceMetrics(model="m")
    _record_everything(m, worker="w0")
    _record_everything(m, worker="w1")
    m.forget_worker("w0")
    s = _scrape(m)
    for name in (
        "zerobubble_kv_cache_usage_ratio",
        "zerobubble_inflight_steps",
        "zerobubble_spec_decode_num_accepted_tokens_per_pos_total",
        "zerobubble_worker_step_duration_seconds_count",
    ):
        assert {lab["worker"] for _, lab, _ in s[name]} == {"w1"}, name
    assert m.workers() == ["w1"]
    m.forget_worker("never-seen")  # a no-op, not an error


def test_a_worker_forgotten_and_back_records_into_exported_series() -> None:
    # Series are looked up once and kept: a kept one that forget_worker (or set_model) removed
    # would still count, but into a child nobody exports.
    m = ServiceMetrics(model="m")
    for _ in range(2):
        m.record_step("w0", 0.01, 0.002, num_drafts=1, num_draft_tokens=3, num_accepted=2, accepted_per_pos=[1, 1, 0])
        m.set_inflight("w0", 2)
        m.set_kv_usage("w0", 0.25)
    m.forget_worker("w0")
    m.record_step("w0", 0.01, 0.002, num_drafts=1, num_draft_tokens=3, num_accepted=1, accepted_per_pos=[1, 0, 0])
    m.set_inflight("w0", 1)
    m.set_kv_usage("w0", 0.5)
    s = _scrape(m)
    assert _value(s, "zerobubble_spec_decode_num_accepted_tokens_total", worker="w0") == 1
    assert _value(s, "zerobubble_worker_step_duration_seconds_count", worker="w0") == 1
    assert _value(s, "zerobubble_inflight_steps", worker="w0") == 1
    assert _value(s, "zerobubble_kv_cache_usage_ratio", worker="w0") == 0.5
    per_pos = {lab["position"]: v for _, lab, v in s["zerobubble_spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {"0": 1, "1": 0, "2": 0}
    m.record_finished("eos", 1.0, 0.1, 10, 5)
    m.set_model("n")
    m.record_finished("eos", 1.0, 0.1, 10, 7)
    m.observe_ttft(0.2)
    s = _scrape(m)
    assert _value(s, "zerobubble_generation_tokens_total", model="n") == 7
    assert _value(s, "zerobubble_time_to_first_token_seconds_count", model="n") == 1
    assert {lab["model"] for _, lab, _ in s["zerobubble_generation_tokens_total"]} == {"n"}


def test_a_known_worker_exports_its_counters_at_zero_before_traffic() -> None:
    # rate() needs a zero sample: a series born already incremented reads as flat.
    m = ServiceMetrics(model="m")
    m.add_worker("w0", num_spec_tokens=3)
    s = _scrape(m)
    per_pos = {lab["position"]: v for _, lab, v in s["zerobubble_spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {"0": 0.0, "1": 0.0, "2": 0.0}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        assert _value(s, f"zerobubble_spec_decode_num_{name}_total", worker="w0") == 0.0
    m.record_step("w0", 0.01, num_drafts=1, num_draft_tokens=3, num_accepted=1, accepted_per_pos=[1, 0, 0])
    m.forget_worker("w0")
    assert "zerobubble_spec_decode_num_accepted_tokens_per_pos_total" not in _scrape(m)


def test_metrics_server_serves_the_registry_on_a_free_port() -> None:
    m = ServiceMetrics(model="m")
    m.set_queues(running=1, waiting=7)
    port = start_metrics_server(m, port=0, host="127.0.0.1")
    try:
        assert isinstance(port, int) and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            body = r.read().decode()
        assert 'zerobubble_num_requests_waiting{model="m"} 7.0' in body
        with pytest.raises(RuntimeError, match="already served"):
            start_metrics_server(m, port=0, host="127.0.0.1")
    finally:
        m.close()
    # The port is released: binding it again succeeds.
    again = ServiceMetrics(model="m")
    try:
        assert start_metrics_server(again, port=port, host="127.0.0.1") == port
    finally:
        again.close()


def _step_result() -> worker_pb2.StepResult:
    result = worker_pb2.StepResult(
        step_id=7, forward_s=0.003, idle_s=0.001, accepted_per_pos=[2, 1, 0], grammar_s=0.0002
    )
    rows = ResultBuilder()
    rows.add("a", [1, 2, 3], 3)  # 3 drafts, 2 accepted
    rows.add("b", [4, 5], 3)  # 3 drafts, 1 accepted
    rows.add("c", [6])  # a prefill or a request without drafts
    # Rows with logprobs count the same: d has 3 drafts, 2 accepted; e none; f is a silent chunk.
    rows.add("d", [7, 8, 9], 3, logprobs=[-0.1, -0.2, -0.3])
    rows.add("e", [10], 0)
    rows.add("f")
    rows.add_error("g", "refused")  # a failed row verified nothing
    rows.write(result)
    return result


def test_step_result_is_accounted_from_the_proto() -> None:
    m = ServiceMetrics(model="m")
    m.record_step_result("w0", _step_result(), inflight=2)
    s = _scrape(m)
    assert _value(s, "zerobubble_spec_decode_num_drafts_total", worker="w0") == 3
    assert _value(s, "zerobubble_spec_decode_num_draft_tokens_total", worker="w0") == 9
    assert _value(s, "zerobubble_spec_decode_num_accepted_tokens_total", worker="w0") == 5
    assert _value(s, "zerobubble_inflight_steps", worker="w0") == 2
    assert _value(s, "zerobubble_worker_step_duration_seconds_sum", worker="w0") == pytest.approx(0.003)
    assert _value(s, "zerobubble_grammar_seconds_total", worker="w0") == pytest.approx(0.0002)
    per_pos = {lab["position"]: v for _, lab, v in s["zerobubble_spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {"0": 2, "1": 1, "2": 0}
    assert _value(s, "zerobubble_spec_decode_prediction_draft_tokens_total", worker="w0") == 0


def test_prediction_drafts_are_counted_apart_from_the_proposers() -> None:
    """Rows whose drafts were their prediction's count in the prediction families only."""
    result = worker_pb2.StepResult(step_id=7, forward_s=0.003)
    rows = ResultBuilder()
    rows.add("a", [1, 2, 3], 3)
    rows.add("g", [1, 2, 3, 4, 5], 6, prediction_drafts=True)
    rows.add("d", [0, 1, 2], 3)
    rows.add("h", [3, 4, 5, 6, 7, 8, 9], 8, prediction_drafts=True, logprobs=[-1.0] * 7)
    rows.add("i", [10], 3)
    rows.write(result)
    m = ServiceMetrics(model="m")
    m.record_step_result("w0", result)
    s = _scrape(m)
    assert _value(s, "zerobubble_spec_decode_prediction_draft_tokens_total", worker="w0") == 14
    assert _value(s, "zerobubble_spec_decode_prediction_accepted_tokens_total", worker="w0") == 10
    # a's, d's and i's drafts are the proposer's.
    assert _value(s, "zerobubble_spec_decode_num_drafts_total", worker="w0") == 3
    assert _value(s, "zerobubble_spec_decode_num_draft_tokens_total", worker="w0") == 9
    assert _value(s, "zerobubble_spec_decode_num_accepted_tokens_total", worker="w0") == 4


def test_worker_role_exports_only_its_own_figures() -> None:
    m = ServiceMetrics(model="m", role="worker")
    m.record_step("worker-0", _step_result())  # the worker service passes its StepResult
    s = _scrape(m)
    assert "zerobubble_num_requests_waiting" not in s
    assert "zerobubble_request_success_total" not in s
    assert _value(s, "zerobubble_worker_idle_seconds_total", worker="worker-0") == pytest.approx(0.001)
    with pytest.raises(ValueError, match="role"):
        ServiceMetrics(model="m", role="router")


def test_model_label_can_be_set_once_known() -> None:
    m = ServiceMetrics(model="")  # the scheduler learns the model from its workers
    m.set_model("smollm2-135m")
    m.set_queues(running=0, waiting=2)
    s = _scrape(m)
    assert {lab["model"] for _, lab, _ in s["zerobubble_num_requests_waiting"]} == {"smollm2-135m"}
    assert {lab["model"] for _, lab, _ in s["zerobubble_request_success_total"]} == {"smollm2-135m"}


def test_tokens_sharing_a_gap_count_as_that_many_observations() -> None:
    # observe_inter_token([(gap, n), ...]) must expose exactly what n observations of each gap
    # through prometheus_client's own `observe` would, also after the model label changed (the
    # cached child belongs to the old name), and with gaps on a bucket's bound.
    batched, single = ServiceMetrics(model="a"), ServiceMetrics(model="a")
    batched.observe_inter_token([(0.5, 2)])
    batched.set_model("b")
    single.set_model("b")
    family = "zerobubble_inter_token_latency_seconds"
    gaps = [(0.03, 3), (0.2, 1), (7.0, 2), (0.001, 0), (0.03, 1), (0.0, 2)]
    bounds = batched.family(family)._upper_bounds
    gaps += [(bounds[0], 1), (bounds[-2], 2)]
    batched.observe_inter_token(gaps)
    for gap, n in gaps:
        for _ in range(n):
            single.family(family).labels(model="b").observe(gap)
    got, want = _scrape(batched), _scrape(single)
    for suffix in ("_bucket", "_count", "_sum"):
        by_labels = [{tuple(sorted(lab.items())): v for _, lab, v in s[family + suffix]} for s in (got, want)]
        assert by_labels[0] == pytest.approx(by_labels[1])
    assert _value(got, family + "_count", model="b") == 12
    assert all(lab["model"] == "b" for _, lab, _ in got[family + "_count"])
