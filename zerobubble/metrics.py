"""Prometheus metric families of zerobubble (DESIGN.md, "Metrics": the names are a public contract).

Every service builds its own :class:`ServiceMetrics`, which owns a private ``CollectorRegistry``.
Nothing is registered at import time, so two services in one process (``zerobubble serve``) or
two tests never see each other's figures.

Labels: every family carries ``model``; figures that belong to one worker (its step timings, its
KV cache, its speculation counts, the plans in flight to it) also carry ``worker``. Request-level
figures do not, because a request is owned by the scheduler, not by the worker that ran it.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from zerobubble.rows import speculation_counts

logger = logging.getLogger(__name__)

# Buckets follow what an LLM server actually sees: a decode step on a GPU takes a few ms, a
# token gap on CPU can reach seconds, and a cold-start TTFT behind a long queue up to a minute.
# Denser buckets where SLOs usually sit (10-500 ms) keep histogram_quantile() precise there.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    60.0,
)
INTER_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
# Suffix continuations: up to `SuffixParams.max_tokens` (32) tokens; 0 is one cleared.
CONTINUATION_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 24, 32, 64)
# Draft slots of a decode row: up to --num-spec-tokens, or --num-prediction-tokens (at most 64).
DRAFT_SLOT_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)
STEP_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
REQUEST_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
)

# Lower-case names of the proto FinishReason values (minus UNSPECIFIED). A closed set keeps the
# label's cardinality bounded and lets dashboards show a zero line for reasons not seen yet.
FINISHED_REASONS: tuple[str, ...] = ("eos", "max_tokens", "stop_sequence", "cancelled", "error")

MODEL_LABELS: tuple[str, ...] = ("model",)
WORKER_LABELS: tuple[str, ...] = ("model", "worker")
FRONT_LABELS: tuple[str, ...] = ("model", "front")


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One family as exported: the sample name a query uses, its type and its label names."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


METRIC_SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "zerobubble_num_requests_running",
        "gauge",
        MODEL_LABELS,
        "Requests currently scheduled (prefilling or decoding).",
    ),
    MetricSpec(
        "zerobubble_num_requests_waiting",
        "gauge",
        MODEL_LABELS,
        "Requests queued for admission, including preempted ones.",
    ),
    MetricSpec(
        "zerobubble_kv_cache_usage_ratio",
        "gauge",
        WORKER_LABELS,
        "Used KV cache blocks divided by all blocks of the worker (0-1).",
    ),
    MetricSpec("zerobubble_prompt_tokens_total", "counter", MODEL_LABELS, "Prompt tokens of finished requests."),
    MetricSpec("zerobubble_generation_tokens_total", "counter", MODEL_LABELS, "Generated tokens of finished requests."),
    MetricSpec(
        "zerobubble_prefix_cache_queries_total", "counter", MODEL_LABELS, "Prompt tokens looked up in the prefix cache."
    ),
    MetricSpec(
        "zerobubble_prefix_cache_hits_total", "counter", MODEL_LABELS, "Prompt tokens found in the prefix cache."
    ),
    MetricSpec(
        "zerobubble_request_success_total", "counter", ("model", "finished_reason"), "Finished requests by stop reason."
    ),
    MetricSpec(
        "zerobubble_num_preemptions_total", "counter", MODEL_LABELS, "Requests preempted to free KV cache blocks."
    ),
    MetricSpec(
        "zerobubble_time_to_first_token_seconds",
        "histogram",
        MODEL_LABELS,
        "Time from arrival to the first streamed token.",
        TTFT_BUCKETS,
    ),
    MetricSpec(
        "zerobubble_inter_token_latency_seconds",
        "histogram",
        MODEL_LABELS,
        "Gap between consecutive streamed tokens of a request (a message carrying n "
        "tokens counts as n gaps, each 1/n of its delay).",
        INTER_TOKEN_BUCKETS,
    ),
    MetricSpec(
        "zerobubble_e2e_request_latency_seconds",
        "histogram",
        MODEL_LABELS,
        "Time from arrival to the last token.",
        REQUEST_BUCKETS,
    ),
    MetricSpec(
        "zerobubble_request_queue_time_seconds",
        "histogram",
        MODEL_LABELS,
        "Time a request waited before it was first scheduled.",
        REQUEST_BUCKETS,
    ),
    MetricSpec(
        "zerobubble_spec_decode_num_drafts_total",
        "counter",
        WORKER_LABELS,
        "Draft sequences verified (one per request and step with drafts).",
    ),
    MetricSpec("zerobubble_spec_decode_num_draft_tokens_total", "counter", WORKER_LABELS, "Draft tokens verified."),
    MetricSpec("zerobubble_spec_decode_num_accepted_tokens_total", "counter", WORKER_LABELS, "Draft tokens accepted."),
    MetricSpec(
        "zerobubble_spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        ("model", "worker", "position"),
        "Draft tokens accepted, by position in the draft (0 = first draft token).",
    ),
    MetricSpec(
        "zerobubble_spec_decode_prediction_draft_tokens_total",
        "counter",
        WORKER_LABELS,
        "Draft tokens taken from requests' predicted outputs and verified (not in the proposer's counts).",
    ),
    MetricSpec(
        "zerobubble_spec_decode_prediction_accepted_tokens_total",
        "counter",
        WORKER_LABELS,
        "Draft tokens taken from requests' predicted outputs and accepted.",
    ),
    MetricSpec(
        "zerobubble_spec_decode_suffix_continuation_tokens",
        "histogram",
        WORKER_LABELS,
        "Suffix decoding: tokens of each continuation the scheduler sent a worker (0: one cleared).",
        CONTINUATION_BUCKETS,
    ),
    MetricSpec(
        "zerobubble_spec_decode_draft_slots",
        "histogram",
        WORKER_LABELS,
        "Draft slots the scheduler planned for each decode row while the worker speculates (0: none; "
        "with --spec-draft-length adaptive, the chosen draft length).",
        DRAFT_SLOT_BUCKETS,
    ),
    MetricSpec(
        "zerobubble_worker_step_duration_seconds",
        "histogram",
        WORKER_LABELS,
        "Device time of one step on a worker.",
        STEP_BUCKETS,
    ),
    MetricSpec(
        "zerobubble_worker_idle_seconds_total",
        "counter",
        WORKER_LABELS,
        "Time a worker spent waiting for its next plan (the bubble).",
    ),
    MetricSpec(
        "zerobubble_grammar_seconds_total",
        "counter",
        WORKER_LABELS,
        "Host time a worker spent filling grammar masks (structured output).",
    ),
    MetricSpec("zerobubble_inflight_steps", "gauge", WORKER_LABELS, "Plans sent to a worker and not answered yet."),
    MetricSpec(
        "zerobubble_worker_collective_seconds_total",
        "counter",
        WORKER_LABELS,
        "Host time a tensor-parallel worker's steps spent in collectives (handing plans to its ranks, all-reduces).",
    ),
    MetricSpec(
        "zerobubble_worker_tensor_parallel_size",
        "gauge",
        WORKER_LABELS,
        "Ranks (devices) a worker's model is split over (1: one device).",
    ),
    MetricSpec(
        "zerobubble_placeholder_tokens_rolled_back_total",
        "counter",
        MODEL_LABELS,
        "Optimistic draft slots undone when results were reconciled.",
    ),
    # Beyond DESIGN.md's table: the fronts (`--fronts`, `zerobubble front`) report their load
    # over their stream, so that the scheduler's one port tells whether they are the limit.
    MetricSpec(
        "zerobubble_front_cpu_seconds_total",
        "counter",
        FRONT_LABELS,
        "CPU time (user + system) of a front process attached to this scheduler.",
    ),
    MetricSpec("zerobubble_front_calls_running", "gauge", FRONT_LABELS, "Client calls open in a front."),
)

# What dashboards, alerts and autoscalers may query (histograms add _bucket/_sum/_count).
METRIC_NAMES: tuple[str, ...] = tuple(spec.name for spec in METRIC_SPECS)
HISTOGRAM_SUFFIXES: tuple[str, ...] = ("_bucket", "_sum", "_count")


def metric_spec(name: str) -> MetricSpec | None:
    """The family a queried sample name belongs to (``X_bucket`` -> histogram ``X``), or None."""
    for spec in METRIC_SPECS:
        if name == spec.name:
            return spec
        if spec.kind == "histogram" and any(name == spec.name + s for s in HISTOGRAM_SUFFIXES):
            return spec
    return None


def normalize_finished_reason(reason: str) -> str | None:
    """``"eos"`` for ``"eos"`` or the proto enum name ``"FINISH_REASON_EOS"``; None if unknown."""
    value = reason.strip().lower().removeprefix("finish_reason_")
    return value if value in FINISHED_REASONS else None


def _counter_name(name: str) -> str:
    # prometheus_client appends _total itself and refuses a name that already carries it.
    return name.removesuffix("_total")


ROLES: tuple[str, ...] = ("scheduler", "worker")


class StepResultLike(Protocol):
    """The fields of ``zerobubble.api.worker_pb2.StepResult`` that metrics read.

    A protocol rather than the proto class, so this module does not import the generated stubs.
    """

    forward_s: float
    idle_s: float
    grammar_s: float
    collective_s: float
    accepted_per_pos: Sequence[int]

    @property
    def rows(self) -> Any: ...  # a ``ResultRows``


@dataclass(slots=True)
class _HttpEndpoint:
    """The ``/metrics`` server of one ServiceMetrics, kept so that it can be stopped."""

    port: int
    server: WSGIServer = field(repr=False)
    thread: threading.Thread = field(repr=False)


class GapHistogram(Histogram):
    """A histogram that accounts many observations under one lock per bucket.

    Tokens confirmed by one step reach a client together, so they share one gap, and one step
    confirms tokens for every running request: observing them one by one took a lock and a
    bucket search per token, a visible share of the scheduler's time at 256 streams.
    """

    def observe_many(self, observations: Iterable[tuple[float, int]]) -> None:
        """Account each ``(amount, count)`` as ``count`` observations of ``amount`` (relies on
        prometheus_client's child layout, ``_sum`` / ``_buckets`` / ``_upper_bounds``:
        ``tests/unit/test_metrics_defs.py`` checks the exposition it produces)."""
        self._raise_if_not_observable()
        bounds = self._upper_bounds
        per_bucket = [0] * len(bounds)
        total = 0.0
        for amount, count in observations:
            if count > 0:
                total += amount * count
                # The first bucket whose upper bound is >= amount (the last one is +Inf).
                per_bucket[bisect.bisect_left(bounds, amount)] += count
        if total:
            self._sum.inc(total)
        for i, count in enumerate(per_bucket):
            if count:
                self._buckets[i].inc(count)


# Families whose exported type is a subclass of their kind's (one `observe_many` per step).
_HISTOGRAM_CLASSES: dict[str, type[Histogram]] = {"zerobubble_inter_token_latency_seconds": GapHistogram}
# A scheduler's own series (by model only), created at zero up front; a worker's (by model and
# worker), created when it is first recorded and removed with it.
_REQUEST_FAMILIES: tuple[str, ...] = tuple(spec.name for spec in METRIC_SPECS if spec.labels == MODEL_LABELS)
_WORKER_FAMILIES: tuple[str, ...] = tuple(spec.name for spec in METRIC_SPECS if spec.labels == WORKER_LABELS)
# A worker's series by draft position too: created per position, removed with the worker.
_PER_POS = "zerobubble_spec_decode_num_accepted_tokens_per_pos_total"


def _family(registry: CollectorRegistry, spec: MetricSpec) -> Counter | Gauge | Histogram:
    """``spec``'s family, registered in ``registry``."""
    if spec.kind == "gauge":
        return Gauge(spec.name, spec.help, spec.labels, registry=registry)
    if spec.kind == "counter":
        return Counter(_counter_name(spec.name), spec.help, spec.labels, registry=registry)
    kind = _HISTOGRAM_CLASSES.get(spec.name, Histogram)
    return kind(spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=registry)


class ServiceMetrics:
    """Every metric family of one service, in a registry of its own.

    ``role`` is ``"scheduler"`` or ``"worker"``. A scheduler creates its request-level series
    with value 0 up front, so ``rate()`` and alert expressions work from the first scrape
    instead of starting with "no data"; a worker owns no requests and exports only the figures
    of its own steps, so it does not show queues that are always zero. Worker-level series
    appear when a worker is first recorded and go away with :meth:`forget_worker`, so a worker
    that was scaled down does not linger on dashboards with its last value.
    """

    __slots__ = (
        "model",
        "role",
        "registry",
        "_families",
        "_fronts",
        "_children",
        "_positions",
        "_lock",
        "_http",
        "_warned",
    )

    def __init__(self, model: str = "", role: str = "scheduler", registry: CollectorRegistry | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.model = model
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry()
        # process_* (RSS, CPU, open fds) and python_gc_*: what a leak or a GC pause shows in.
        # The default registry has them, a private one must add them itself.
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # Every family of `METRIC_SPECS` by its exported name (in their order, which the
        # exposition keeps): the specs are the one list of them, so none is named twice here.
        self._families: dict[str, Counter | Gauge | Histogram] = {
            spec.name: _family(self.registry, spec) for spec in METRIC_SPECS
        }
        # Each attached front's CPU seconds as last reported: the counter grows by the difference.
        self._fronts: dict[str, float] = {}
        # Each series' child by (family name, label values), see `_child`.
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}
        # Positions seen per worker: forget_worker() must know which children to remove.
        self._positions: dict[str, set[str]] = {}
        self._lock = threading.Lock()
        self._http: _HttpEndpoint | None = None
        self._warned: set[str] = set()
        self._init_request_series()

    def family(self, name: str) -> Counter | Gauge | Histogram:
        """The family exported as ``name`` (one of `METRIC_NAMES`); KeyError for another."""
        return self._families[name]

    def _init_request_series(self) -> None:
        if self.role != "scheduler":
            return
        for name in _REQUEST_FAMILIES:
            self._families[name].labels(model=self.model)
        for reason in FINISHED_REASONS:
            self._families["zerobubble_request_success_total"].labels(model=self.model, finished_reason=reason)

    def _child(self, name: str, *values: str) -> Any:
        """``family(name).labels(*values)`` (values in the family's label order), looked up once.

        `labels` takes a lock and checks its values on every call, and the scheduler records
        a dozen series a step and as many per request: at hundreds of requests a second that
        was a few percent of its event loop. Series dropped (`set_model`, `forget_worker`) are
        forgotten here too.
        """
        key = (name, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._families[name].labels(*values)
        return child

    def _warn_once(self, key: str, message: str) -> None:
        # The recording helpers run inside the serving loops: a bad figure from a caller must
        # not raise there and break a stream. It is logged (once per kind, not per step) and
        # recorded in a sanitized form instead.
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.warning("metrics: %s", message)

    def set_model(self, model: str) -> None:
        """Set the ``model`` label once it is known (a scheduler learns it from its workers).

        Call it before traffic: series recorded under the previous name are dropped, not moved.
        """
        if model == self.model:
            return
        for family in self._families.values():
            family.clear()
        with self._lock:
            self._positions.clear()
            self._fronts.clear()
        self._children.clear()
        self.model = model
        self._init_request_series()

    def set_tensor_parallel_size(self, worker: str, size: int) -> None:
        """Publish how many ranks ``worker``'s model is split over (`WorkerInfo`)."""
        self.add_worker(worker)
        self._child("zerobubble_worker_tensor_parallel_size", self.model, worker).set(max(size, 1))

    def add_worker(self, worker: str, num_spec_tokens: int = 0) -> None:
        """Export every series of ``worker`` at zero, draft positions ``0..num_spec_tokens-1`` too.

        A counter that first appears already incremented has no zero sample, so ``rate()``
        over a window that holds its whole life is 0 (and an acceptance ratio 0/0): a short
        burst of traffic would be invisible. Call it when the worker is known, before traffic.
        """
        with self._lock:
            if worker not in self._positions:
                self._positions[worker] = set()
                created = True
            else:
                created = False
            positions = [str(p) for p in range(num_spec_tokens) if str(p) not in self._positions[worker]]
            self._positions[worker].update(positions)
        if created:
            for name in _WORKER_FAMILIES:
                self._families[name].labels(model=self.model, worker=worker)
        for position in positions:
            self._families[_PER_POS].labels(model=self.model, worker=worker, position=position)

    def record_step(
        self,
        worker: str,
        forward_s: float | StepResultLike,
        idle_s: float = 0.0,
        num_drafts: int = 0,
        num_draft_tokens: int = 0,
        num_accepted: int = 0,
        accepted_per_pos: Sequence[int] = (),
        grammar_s: float = 0.0,
        num_prediction_draft_tokens: int = 0,
        num_prediction_accepted: int = 0,
        collective_s: float = 0.0,
    ) -> None:
        """Account one step of ``worker``: its timings and speculation volume.

        ``accepted_per_pos[i]`` is the number of drafts accepted at draft position ``i`` in
        this step; drafts from requests' predictions are counted apart (``num_prediction_*``).
        A ``StepResult`` may be passed in place of ``forward_s`` (the rest is then read from
        it), which is what the worker service does with its own results.
        """
        if not isinstance(forward_s, (int, float)):
            self.record_step_result(worker, forward_s)
            return
        if num_accepted > num_draft_tokens:
            self._warn_once(
                "accepted",
                f"worker {worker} reported num_accepted={num_accepted} > "
                f"num_draft_tokens={num_draft_tokens}; counting the drafts only",
            )
            num_accepted = num_draft_tokens
        self.add_worker(worker)
        model = self.model
        self._child("zerobubble_worker_step_duration_seconds", model, worker).observe(forward_s)
        self._child("zerobubble_worker_idle_seconds_total", model, worker).inc(idle_s)
        self._child("zerobubble_grammar_seconds_total", model, worker).inc(grammar_s)
        if collective_s:
            self._child("zerobubble_worker_collective_seconds_total", model, worker).inc(collective_s)
        self._child("zerobubble_spec_decode_num_drafts_total", model, worker).inc(num_drafts)
        self._child("zerobubble_spec_decode_num_draft_tokens_total", model, worker).inc(num_draft_tokens)
        self._child("zerobubble_spec_decode_num_accepted_tokens_total", model, worker).inc(num_accepted)
        num_prediction_accepted = min(num_prediction_accepted, num_prediction_draft_tokens)
        self._child("zerobubble_spec_decode_prediction_draft_tokens_total", model, worker).inc(
            num_prediction_draft_tokens
        )
        self._child("zerobubble_spec_decode_prediction_accepted_tokens_total", model, worker).inc(
            num_prediction_accepted
        )
        seen = self._positions.get(worker)
        for pos, accepted in enumerate(accepted_per_pos):
            position = str(pos)
            if seen is not None and position not in seen:
                with self._lock:
                    seen.add(position)
            self._child(_PER_POS, model, worker, position).inc(accepted)

    def record_step_result(self, worker: str, result: StepResultLike, inflight: int | None = None) -> None:
        """Account a ``StepResult`` of ``worker``; ``inflight`` also updates its window gauge.

        A draft counts once per request that had drafts verified in the step, as vLLM counts
        ``num_drafts``.
        """
        counts = speculation_counts(result.rows)
        self.record_step(
            worker,
            float(result.forward_s),
            float(result.idle_s),
            num_drafts=counts.num_drafts,
            num_draft_tokens=counts.num_draft_tokens,
            num_accepted=counts.num_accepted,
            accepted_per_pos=[int(n) for n in result.accepted_per_pos],
            grammar_s=float(result.grammar_s),
            collective_s=float(result.collective_s),
            num_prediction_draft_tokens=counts.num_prediction_draft_tokens,
            num_prediction_accepted=counts.num_prediction_accepted,
        )
        if inflight is not None:
            self.set_inflight(worker, inflight)

    def record_finished(
        self,
        reason: str,
        e2e_s: float | None,
        queue_s: float | None,
        num_prompt_tokens: int,
        num_generation_tokens: int,
    ) -> None:
        """Account a request that left the system for ``reason`` (e.g. ``"eos"``).

        TTFT is not observed here but by :meth:`observe_ttft` when the first token streams, so
        the histogram is current while long requests are still running. ``queue_s``
        is None for a request cancelled before it was ever scheduled: it has no queue time, and
        recording its age instead would bend the distribution. ``e2e_s`` is None for a request
        whose client is measured elsewhere (a front's call: :meth:`observe_e2e` when the front
        reports it).
        """
        model = self.model
        finished_reason = normalize_finished_reason(reason)
        if finished_reason is None:
            # A free-form label value would grow the series without bound.
            self._warn_once(
                f"reason:{reason}",
                f"unknown finished_reason {reason!r}, counted as 'error' (known: {', '.join(FINISHED_REASONS)})",
            )
            finished_reason = "error"
        self._child("zerobubble_request_success_total", model, finished_reason).inc()
        if e2e_s is not None:
            self._child("zerobubble_e2e_request_latency_seconds", model).observe(e2e_s)
        if queue_s is not None:
            self._child("zerobubble_request_queue_time_seconds", model).observe(queue_s)
        self._child("zerobubble_prompt_tokens_total", model).inc(num_prompt_tokens)
        self._child("zerobubble_generation_tokens_total", model).inc(num_generation_tokens)

    def observe_ttft(self, seconds: float) -> None:
        """Account the time from a request's arrival to its first streamed token."""
        self._child("zerobubble_time_to_first_token_seconds", self.model).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        """Account the time from a request's arrival to its end, measured where its client is
        (a front); its other figures are accounted by :meth:`record_finished`."""
        self._child("zerobubble_e2e_request_latency_seconds", self.model).observe(seconds)

    def observe_inter_token(self, gaps: Iterable[tuple[float, int]]) -> None:
        """Account each ``(seconds, count)``: ``count`` gaps of ``seconds`` between consecutive
        streamed tokens of one request (tokens confirmed together share the step's gap); one
        call per step for every stream."""
        cast(GapHistogram, self._child("zerobubble_inter_token_latency_seconds", self.model)).observe_many(gaps)

    def set_queues(self, running: int, waiting: int) -> None:
        """Publish the scheduler's queue lengths (the autoscaler reads ``waiting``)."""
        self._child("zerobubble_num_requests_running", self.model).set(running)
        self._child("zerobubble_num_requests_waiting", self.model).set(waiting)

    def set_kv_usage(self, worker: str, ratio: float) -> None:
        """Publish the fraction (0-1) of ``worker``'s KV blocks in use."""
        if not 0.0 <= ratio <= 1.0:
            self._warn_once("kv", f"KV cache usage ratio {ratio} of worker {worker} is outside [0, 1]; clamped")
            ratio = min(max(ratio, 0.0), 1.0)
        self.add_worker(worker)
        self._child("zerobubble_kv_cache_usage_ratio", self.model, worker).set(ratio)

    def set_inflight(self, worker: str, n: int) -> None:
        """Publish how many plans were sent to ``worker`` and not answered yet."""
        self.add_worker(worker)
        self._child("zerobubble_inflight_steps", self.model, worker).set(n)

    def add_suffix_continuations(self, worker: str, counts: Sequence[int]) -> None:
        """Account the suffix continuations sent to ``worker``: ``counts[n]`` of ``n`` tokens."""
        child = self._child("zerobubble_spec_decode_suffix_continuation_tokens", self.model, worker)
        for length, count in enumerate(counts):
            for _ in range(count):
                child.observe(length)

    def add_draft_slots(self, worker: str, counts: Sequence[int]) -> None:
        """Account the decode rows planned for ``worker``: ``counts[n]`` with ``n`` draft slots."""
        child = self._child("zerobubble_spec_decode_draft_slots", self.model, worker)
        for length, count in enumerate(counts):
            for _ in range(count):
                child.observe(length)

    def add_rolled_back(self, n: int) -> None:
        """Account ``n`` optimistic draft slots undone by reconciliation."""
        self._child("zerobubble_placeholder_tokens_rolled_back_total", self.model).inc(n)

    def add_preemptions(self, n: int = 1) -> None:
        """Account ``n`` preempted requests."""
        self._child("zerobubble_num_preemptions_total", self.model).inc(n)

    def add_prefix_cache(self, queries: int, hits: int) -> None:
        """Account a prefix-cache lookup of ``queries`` prompt tokens that found ``hits``."""
        if hits > queries:
            self._warn_once("prefix", f"prefix cache hits={hits} exceed queries={queries}; counting the queries only")
            hits = queries
        self._child("zerobubble_prefix_cache_queries_total", self.model).inc(queries)
        self._child("zerobubble_prefix_cache_hits_total", self.model).inc(hits)

    def forget_worker(self, worker: str) -> None:
        """Drop every series of a worker that left (scaled down, disconnected for good)."""
        with self._lock:
            positions = self._positions.pop(worker, None)
        if positions is None:
            return
        self._children.clear()
        for name in _WORKER_FAMILIES:
            self._families[name].remove(self.model, worker)
        for position in positions:
            self._families[_PER_POS].remove(self.model, worker, position)

    def record_front_load(self, front: str, cpu_seconds: float, num_calls: int) -> None:
        """Account a front's report (`FrontLoad`): its process's CPU time so far and its open calls."""
        with self._lock:
            last = self._fronts.get(front)
            self._fronts[front] = cpu_seconds
        cpu = self._child("zerobubble_front_cpu_seconds_total", self.model, front)
        # The first report counts from zero, as the process did; CPU time never goes back.
        cpu.inc(max(0.0, cpu_seconds - (last or 0.0)))
        self._child("zerobubble_front_calls_running", self.model, front).set(num_calls)

    def forget_front(self, front: str) -> None:
        """Drop the series of a front that detached (stopped, or lost)."""
        with self._lock:
            if self._fronts.pop(front, None) is None:
                return
        self._children.clear()
        for name in ("zerobubble_front_cpu_seconds_total", "zerobubble_front_calls_running"):
            self._families[name].remove(self.model, front)

    def fronts(self) -> list[str]:
        """Fronts that currently have series (for tests and debugging)."""
        with self._lock:
            return sorted(self._fronts)

    def workers(self) -> list[str]:
        """Workers that currently have series (for tests and debugging)."""
        with self._lock:
            return sorted(self._positions)

    def close(self) -> None:
        """Stop the ``/metrics`` server, if one was started, and release its port."""
        endpoint, self._http = self._http, None
        if endpoint is not None:
            endpoint.server.shutdown()
            endpoint.server.server_close()
            endpoint.thread.join(timeout=5)


def start_metrics_server(metrics: ServiceMetrics, port: int = 0, host: str = "0.0.0.0") -> int:
    """Serve ``metrics.registry`` on ``http://host:port/metrics``; returns the bound port.

    ``port=0`` binds a free one. The server runs on a daemon thread until ``metrics.close()``.
    """
    if metrics._http is not None:
        raise RuntimeError(f"metrics are already served on port {metrics._http.port}")
    server, thread = start_http_server(port, addr=host, registry=metrics.registry)
    bound = int(server.server_address[1])
    metrics._http = _HttpEndpoint(port=bound, server=server, thread=thread)
    return bound
