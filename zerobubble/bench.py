"""``zerobubble bench``: replay a JSONL dataset against a server, closed-loop at a fixed
concurrency or open-loop at a Poisson request rate.

Two backends send the same rows: ``grpc`` (our scheduler's ``Generate``) and ``openai`` (any
OpenAI-compatible HTTP server: ours, vLLM, llama.cpp's ``llama-server``; see
:mod:`zerobubble.bench_openai`), so peers are measured with the same tool and figures.
``zerobubble bench plot`` (:mod:`zerobubble.bench_plot`) draws several reports side by side.

Each dataset row is one request: ``messages`` (chat, template applied by the server) or
``prompt`` (raw text), ``max_tokens``, and optionally ``kind`` (for ``--kind`` filtering),
``temperature``, ``seed``, ``ignore_eos``, ``schema`` (a JSON schema the reply must follow; not
sent under ``--no-constraints``) and ``prediction`` (text the reply is expected to repeat, sent as
the request's predicted output; not sent under ``--no-prediction``, so one workload compares
both). Rows are greedy unless they say otherwise.
``--dataset`` takes a path or the bare name of a workload shipped in ``zerobubble/workloads/``:
``grounded`` (48 chat rows of code edits, grounded questions and open chat), ``structured`` (the
same rows, each with a JSON schema), ``edits`` (36 code edits and document revisions whose
replies repeat most of the text being edited, each with that text as its prediction; written by
``scripts/make_edits_workload.py``) and ``agentic`` (24 tool-calling loops of a coding agent,
the embedded model's own turns included, whose last request asks for a file or turns already
in the conversation; written by ``scripts/make_agentic_workload.py``).

Throughput and latencies are measured here, on the client. Each reply's accepted and rejected
prediction tokens are the server's counts (gRPC: the final message; OpenAI:
``usage.completion_tokens_details``, None where absent). Speculation, prediction-draft and
worker-idle figures (gRPC backend only) come from the difference of two reads of
``ModelInfo.stats``, the server's cumulative counters, so they include any other traffic the
server handled meanwhile: benchmark an otherwise idle server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.client import (
    ChannelSettings,
    Completion,
    build_request,
    complete,
    format_rpc_error,
    open_channels,
    wait_connected,
)

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)
# Workloads installed with the package, so a benchmark needs nothing outside it.
WORKLOADS_DIR = Path(__file__).resolve().parent / "workloads"


@dataclasses.dataclass(slots=True)
class BenchRow:
    """One dataset row; ``index`` is its position in the file, kept through filtering."""

    index: int
    kind: str
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    temperature: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    schema: dict[str, Any] | None = None  # structured output: the JSON schema the reply must follow
    prediction: str | None = None  # predicted output: text the reply is expected to repeat in large part


def parse_row(obj: Any, index: int) -> BenchRow:
    """Validate one decoded JSON row.

    Raises:
        ValueError: the row lacks an input or ``max_tokens``, has both inputs, or a field has the
            wrong type.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"row {index}: expected a JSON object, got {type(obj).__name__}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise ValueError(f"row {index}: needs exactly one of 'prompt' and 'messages'")
    messages = obj.get("messages")
    if has_messages and not (
        isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    ):
        raise ValueError(f"row {index}: 'messages' must be a list of {{role, content}} objects")
    max_tokens = obj.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"row {index}: 'max_tokens' must be a positive integer, got {max_tokens!r}")
    temperature = obj.get("temperature")
    seed = obj.get("seed")
    schema = obj.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise ValueError(f"row {index}: 'schema' must be a JSON object (a JSON schema)")
    prediction = obj.get("prediction")
    if prediction is not None and not isinstance(prediction, str):
        raise ValueError(
            f"row {index}: 'prediction' must be a string (the text the reply is expected to repeat), "
            f"got {type(prediction).__name__}"
        )
    return BenchRow(
        index=index,
        kind=str(obj.get("kind", "")),
        max_tokens=max_tokens,
        prompt=str(obj["prompt"]) if has_prompt else None,
        messages=[{"role": str(m["role"]), "content": str(m["content"])} for m in messages or []]
        if has_messages
        else None,
        temperature=float(temperature) if temperature is not None else None,
        seed=int(seed) if seed is not None else None,
        ignore_eos=bool(obj.get("ignore_eos", False)),
        schema=schema,
        prediction=prediction,
    )


def select_rows(
    rows: Sequence[BenchRow],
    *,
    kind: str = "",
    limit: int = 0,
    max_tokens_cap: int = 0,
    constraints: bool = True,
    predictions: bool = True,
) -> list[BenchRow]:
    """Apply ``--kind``, then ``--limit``, then ``--max-tokens-cap`` (empty/0 = off); without
    ``constraints`` or ``predictions`` the rows lose their schema or prediction, so the same
    requests run with and without them. ``rows`` is left as is."""
    chosen = [row for row in rows if not kind or row.kind == kind]
    if limit > 0:
        chosen = chosen[:limit]
    if max_tokens_cap > 0:
        chosen = [dataclasses.replace(row, max_tokens=min(row.max_tokens, max_tokens_cap)) for row in chosen]
    dropped: dict[str, Any] = {}
    if not constraints:
        dropped["schema"] = None
    if not predictions:
        dropped["prediction"] = None
    return [dataclasses.replace(row, **dropped) for row in chosen] if dropped else chosen


def shipped_workloads() -> list[str]:
    """Names of the workloads in :data:`WORKLOADS_DIR` (``grounded`` for ``grounded.jsonl``)."""
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl"))


def resolve_dataset(spec: str | Path) -> Path:
    """The file a ``--dataset`` value stands for.

    An existing file is itself. A bare name (no directory, no suffix) that is not a file here
    names a shipped workload; ``FileNotFoundError`` lists the shipped names when there is none
    of that name. Anything else is returned as a path for the caller to open.
    """
    path = Path(spec)
    if path.is_file() or path.name != str(spec) or path.suffix:
        return path
    shipped = WORKLOADS_DIR / f"{spec}.jsonl"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(
        f"dataset {str(spec)!r}: no such file and no shipped workload of that name "
        f"(shipped: {', '.join(shipped_workloads()) or 'none'})"
    )


def load_dataset(
    path: str | Path,
    *,
    kind: str = "",
    limit: int = 0,
    max_tokens_cap: int = 0,
    constraints: bool = True,
    predictions: bool = True,
) -> list[BenchRow]:
    """Read a JSONL dataset (blank lines skipped) and select rows as ``bench`` does (:func:`select_rows`).

    ``path`` may also be a shipped workload's name (:func:`resolve_dataset`). Shared with
    ``scripts/hf_baseline.py`` so both sides run exactly the same requests.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is not valid JSON or not a valid row (the message names it).
    """
    path = resolve_dataset(path)
    rows: list[BenchRow] = []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: invalid JSON: {exc}") from exc
            rows.append(parse_row(obj, len(rows)))
    return select_rows(
        rows, kind=kind, limit=limit, max_tokens_cap=max_tokens_cap, constraints=constraints, predictions=predictions
    )


def row_request(row: BenchRow) -> generate_pb2.GenerateRequest:
    """The request a row stands for; greedy when the row gives no temperature, constrained to
    the row's schema when it has one, with its prediction as the predicted output."""
    request = build_request(
        prompt=row.prompt,
        messages=row.messages,
        max_tokens=row.max_tokens,
        temperature=row.temperature if row.temperature is not None else 0.0,
        seed=row.seed,
        ignore_eos=row.ignore_eos,
        prediction=row.prediction,
    )
    if row.schema is not None:
        request.constraint.json_schema = json.dumps(row.schema)
    return request


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks; None when empty.

    Same definition as numpy's default, so figures compare with other tools' reports.
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def stats_delta(before: generate_pb2.ServerStats, after: generate_pb2.ServerStats) -> generate_pb2.ServerStats:
    """Field-wise ``after - before`` of the server's cumulative counters (every field, so new
    counters added to the proto are carried without touching this)."""
    delta = generate_pb2.ServerStats()
    for descriptor in generate_pb2.ServerStats.DESCRIPTOR.fields:
        setattr(delta, descriptor.name, getattr(after, descriptor.name) - getattr(before, descriptor.name))
    return delta


def acceptance_rate(delta: generate_pb2.ServerStats) -> float | None:
    """Accepted ÷ proposed draft tokens; None when nothing was drafted (speculation off)."""
    if delta.num_draft_tokens <= 0:
        return None
    return delta.num_accepted_tokens / delta.num_draft_tokens


def mean_accepted_length(delta: generate_pb2.ServerStats) -> float | None:
    """Tokens emitted per decode step that carried drafts: the bonus token plus accepted drafts."""
    if delta.num_drafts <= 0:
        return None
    return 1.0 + delta.num_accepted_tokens / delta.num_drafts


def idle_fraction(delta: generate_pb2.ServerStats) -> float | None:
    """Share of worker time spent waiting for a plan (the bubble); None when the workers did nothing."""
    total = delta.worker_idle_s + delta.worker_busy_s
    if total <= 0:
        return None
    return delta.worker_idle_s / total


def prediction_acceptance(delta: generate_pb2.ServerStats) -> float | None:
    """Accepted ÷ verified drafts taken from requests' predictions; None when none were drafted."""
    if delta.num_prediction_draft_tokens <= 0:
        return None
    return delta.num_prediction_accepted_tokens / delta.num_prediction_draft_tokens


def total_or_none(values: Sequence[int | None]) -> int | None:
    """The sum of the counts the server gave; None when it gave none."""
    given = [v for v in values if v is not None]
    return sum(given) if given else None


def time_per_output_token(completion: Completion) -> float | None:
    """Decode time per token after the first, which credits speculation's multi-token messages."""
    if completion.ttft_s is None or completion.output_len < 2:
        return None
    return (completion.e2e_s - completion.ttft_s) / (completion.output_len - 1)


def request_record(row: BenchRow, completion: Completion) -> dict[str, Any]:
    """The per-request entry of the JSON report."""
    record: dict[str, Any] = {
        "index": row.index,
        "kind": row.kind,
        "token_ids": completion.token_ids,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "ttft_s": completion.ttft_s,
        "e2e_s": completion.e2e_s,
        "itl_s": completion.itl,
        "num_prompt_tokens": completion.num_prompt_tokens,
        "num_output_tokens": completion.output_len,
        "with_prediction": row.prediction is not None,
        "accepted_prediction_tokens": completion.num_accepted_prediction_tokens,
        "rejected_prediction_tokens": completion.num_rejected_prediction_tokens,
    }
    if completion.error:
        record["error"] = completion.error
    return record


def server_figures(delta: generate_pb2.ServerStats | None) -> dict[str, Any]:
    """What the server counted over the run (None each without its stats, e.g. over HTTP)."""
    if delta is None:
        keys = ("acceptance_rate", "mean_accepted_length", "worker_idle_fraction", "grammar_s_per_token")
        return dict.fromkeys((*keys, "server_stats"))
    grammar = delta.grammar_s > 0 and delta.num_generation_tokens > 0
    return {
        "acceptance_rate": acceptance_rate(delta),
        "mean_accepted_length": mean_accepted_length(delta),
        "worker_idle_fraction": idle_fraction(delta),
        "grammar_s_per_token": delta.grammar_s / delta.num_generation_tokens if grammar else None,
        "server_stats": {d.name: getattr(delta, d.name) for d in generate_pb2.ServerStats.DESCRIPTOR.fields},
    }


def summarize(
    rows: Sequence[BenchRow],
    completions: Sequence[Completion],
    *,
    wall_s: float,
    concurrency: int,
    delta: generate_pb2.ServerStats | None = None,
    model_info: generate_pb2.ModelInfoResponse | None = None,
    request_rate: float = 0.0,
    backend: str = "grpc",
    model: str = "",
) -> dict[str, Any]:
    """The benchmark report (the ``--json`` file): totals, percentiles, server figures, requests.

    Latency figures cover requests that did not fail; token counts cover everything received.
    Without ``delta`` (a server with no stats, e.g. over HTTP) the server figures are None.
    """
    ok = [c for c in completions if c.finish_reason != "error"]
    output_tokens = sum(c.output_len for c in completions)
    series: dict[str, list[float]] = {
        "ttft": [c.ttft_s for c in ok if c.ttft_s is not None],
        "itl": [gap for c in ok for gap in c.itl],
        "e2e": [c.e2e_s for c in ok],
        "tpot": [t for c in ok if (t := time_per_output_token(c)) is not None],
    }
    report: dict[str, Any] = {
        "backend": backend,
        "model": model_info.model if model_info is not None else model,
        "spec_method": model_info.spec_method if model_info is not None else "",
        "num_spec_tokens": model_info.num_spec_tokens if model_info is not None else 0,
        "max_inflight_steps": model_info.max_inflight_steps if model_info is not None else 0,
        "concurrency": concurrency,
        "request_rate": request_rate,
        "num_requests": len(completions),
        "num_errors": len(completions) - len(ok),
        "finish_reasons": dict(Counter(c.finish_reason for c in completions)),
        "output_tokens": output_tokens,
        "prompt_tokens": sum(c.num_prompt_tokens for c in completions),
        "wall_s": wall_s,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(completions) / wall_s if wall_s > 0 else 0.0,
    }
    for name in ("ttft", "itl"):
        for q in PERCENTILES:
            report[f"{name}_p{q}_s"] = percentile(series[name], q)
    report["e2e_p50_s"] = percentile(series["e2e"], 50)
    report["tpot_p50_s"] = percentile(series["tpot"], 50)
    report.update(server_figures(delta))
    report.update(prediction_figures(rows, completions, delta))
    report["requests"] = [request_record(row, c) for row, c in zip(rows, completions)]
    return report


def prediction_figures(
    rows: Sequence[BenchRow], completions: Sequence[Completion], delta: generate_pb2.ServerStats | None
) -> dict[str, Any]:
    """The report's predicted-output figures: requests sent with a prediction; the tokens of it
    the replies say were accepted and rejected (None where no reply said); the server's drafts
    taken from predictions over the run, those accepted and the ratio (None without stats, the
    ratio also without such drafts)."""
    return {
        "num_prediction_requests": sum(row.prediction is not None for row in rows),
        "accepted_prediction_tokens": total_or_none([c.num_accepted_prediction_tokens for c in completions]),
        "rejected_prediction_tokens": total_or_none([c.num_rejected_prediction_tokens for c in completions]),
        "server_prediction_draft_tokens": delta.num_prediction_draft_tokens if delta is not None else None,
        "server_prediction_accepted_tokens": delta.num_prediction_accepted_tokens if delta is not None else None,
        "prediction_acceptance": prediction_acceptance(delta) if delta is not None else None,
    }


def format_prediction(report: Mapping[str, Any]) -> str | None:
    """The summary's prediction line; None when no request carried one and no reply counted any."""
    accepted, rejected = report.get("accepted_prediction_tokens"), report.get("rejected_prediction_tokens")
    if not report.get("num_prediction_requests") and not accepted and not rejected:
        return None
    if accepted is None and rejected is None:
        counts = "n/a (the server reports no counts)"
    else:
        counts = f"{accepted or 0} tokens accepted, {rejected or 0} rejected"
    line = f"prediction   {report.get('num_prediction_requests', 0)} requests with one: {counts}"
    if report.get("prediction_acceptance") is not None:
        line += (
            f"; server drafted {report['server_prediction_draft_tokens']} tokens from predictions, "
            f"acceptance {report['prediction_acceptance']:.3f}"
        )
    return line


def format_summary(report: Mapping[str, Any]) -> str:
    """The human-readable report ``bench`` prints."""

    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value * 1000:.1f} ms"

    def ratio(value: float | None, fmt: str = "{:.3f}") -> str:
        return "n/a" if value is None else fmt.format(value)

    spec = "off (no drafts)" if report.get("server_stats") is not None else "n/a (server reports no stats)"
    if report["acceptance_rate"] is not None:
        spec = (
            f"acceptance {ratio(report['acceptance_rate'])}, "
            f"mean accepted length {ratio(report['mean_accepted_length'], '{:.2f}')}"
        )
    lines = [
        f"model        {report['model'] or '?'} via {report.get('backend', 'grpc')} (spec "
        f"{report['spec_method'] or '?'}, inflight steps {report['max_inflight_steps'] or '?'})",
        f"requests     {report['num_requests']} ({report['num_errors']} errors) at concurrency "
        f"{report['concurrency']}"
        + (f", {report['request_rate']:g} req/s Poisson" if report.get("request_rate") else "")
        + f" in {report['wall_s']:.2f} s",
        f"throughput   {report['output_tokens_per_s']:.1f} output tok/s, {report['requests_per_s']:.2f} req/s "
        f"({report['output_tokens']} output tokens)",
        "TTFT         " + "  ".join(f"p{q} {ms(report[f'ttft_p{q}_s'])}" for q in PERCENTILES),
        "ITL          " + "  ".join(f"p{q} {ms(report[f'itl_p{q}_s'])}" for q in PERCENTILES),
        f"e2e          p50 {ms(report['e2e_p50_s'])}   TPOT p50 {ms(report['tpot_p50_s'])}",
        f"speculation  {spec}",
        f"worker idle  {ratio(report['worker_idle_fraction'], '{:.1%}')}",
    ]
    if (prediction := format_prediction(report)) is not None:
        lines.append(prediction)
    if report.get("grammar_s_per_token") is not None:
        lines.append(f"grammar      {report['grammar_s_per_token'] * 1e6:.0f} us of worker CPU per output token")
    return "\n".join(lines)


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """Yield a function that advances a tqdm bar, or does nothing when disabled or tqdm is missing.

    Only on a terminal: in CI logs a bar is noise.
    """
    if not (enabled and sys.stdout.isatty()):
        yield lambda: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield lambda: None
        return
    with tqdm(total=total, unit="req", desc="bench") as bar:
        yield lambda: bar.update(1)


async def _run_one(stub: generate_pb2_grpc.GenerationStub, row: BenchRow, timeout: float | None) -> Completion:
    """One request; a failed call becomes an ``error`` completion so the run goes on."""
    try:
        return await complete(stub, row_request(row), timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        logger.warning("request %d failed: %s", row.index, format_rpc_error(exc))
        return Completion(finish_reason="error", error=format_rpc_error(exc))


def arrival_times(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Start offsets (s) of a Poisson process at ``request_rate`` per second; all 0 when the rate
    is 0 (closed loop). Seeded, so two runs (or two servers) see the same arrivals."""
    if request_rate <= 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(request_rate)
    return times


async def drive(
    rows: Sequence[BenchRow],
    send: Callable[[BenchRow], Awaitable[Completion]],
    concurrency: int,
    *,
    request_rate: float = 0.0,
    progress: bool = False,
) -> tuple[list[Completion], float]:
    """Send every row with at most ``concurrency`` in flight, each no earlier than its arrival
    time (:func:`arrival_times`); returns the completions in dataset order and the wall time.

    Closed loop (rate 0): the first ``concurrency`` rows start together and each next row starts
    as soon as a slot frees. Open loop: a row that arrives while all slots are busy waits for one,
    and that wait counts in its latency, as it would for a real client.

    Raises:
        ValueError: ``concurrency`` < 1 or a negative rate.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if request_rate < 0:
        raise ValueError(f"request rate must be >= 0, got {request_rate}")
    completions: list[Completion | None] = [None] * len(rows)
    arrivals = arrival_times(len(rows), request_rate)
    slots = asyncio.Semaphore(concurrency)
    with progress_bar(len(rows), progress) as advance:
        started = time.perf_counter()

        async def one(position: int, row: BenchRow) -> None:
            delay = started + arrivals[position] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                completions[position] = await send(row)
            advance()

        if request_rate > 0:
            await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
        else:
            # Closed loop in dataset order: `concurrency` workers over one iterator.
            pending = iter(enumerate(rows))

            async def worker() -> None:
                for position, row in pending:  # one event loop: next() needs no lock
                    completions[position] = await send(row)
                    advance()

            await asyncio.gather(*(worker() for _ in range(min(concurrency, max(len(rows), 1)))))
        wall_s = time.perf_counter() - started
    finished = [c for c in completions if c is not None]
    assert len(finished) == len(rows), "every row gets a completion (failures included)"
    return finished, wall_s


async def run_bench_async(
    target: str | ChannelSettings,
    rows: Sequence[BenchRow],
    concurrency: int,
    *,
    progress: bool = False,
    request_timeout: float | None = None,
    connect_timeout: float = 10.0,
    request_rate: float = 0.0,
    num_connections: int = 1,
) -> dict[str, Any]:
    """Run ``rows`` against a scheduler over gRPC and return the report (see :func:`summarize`).

    ``num_connections`` > 1 spreads the requests round-robin over that many connections of
    their own, as that many client processes would (a scheduler's fronts share its port by
    connection; one connection reaches one front).

    Raises:
        ValueError: ``concurrency`` or ``num_connections`` < 1.
        grpc.aio.AioRpcError: the server is unreachable or ``ModelInfo`` fails.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    if num_connections < 1:
        raise ValueError(f"connections must be at least 1, got {num_connections}")
    settings = ChannelSettings(target=target) if isinstance(target, str) else target
    async with open_channels(settings, num_connections) as channels:
        for channel in channels:
            await wait_connected(channel, connect_timeout)
        stubs = [generate_pb2_grpc.GenerationStub(channel) for channel in channels]
        turn = itertools.count()
        info_before = await stubs[0].ModelInfo(generate_pb2.ModelInfoRequest())
        completions, wall_s = await drive(
            rows,
            lambda row: _run_one(stubs[next(turn) % len(stubs)], row, request_timeout),
            concurrency,
            request_rate=request_rate,
            progress=progress,
        )
        info_after = await stubs[0].ModelInfo(generate_pb2.ModelInfoRequest())
    return summarize(
        rows,
        completions,
        wall_s=wall_s,
        concurrency=concurrency,
        request_rate=request_rate,
        delta=stats_delta(info_before.stats, info_after.stats),
        model_info=info_after,
    )
