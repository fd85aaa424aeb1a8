"""``zerobubble bench`` pieces: statistics, dataset selection, and the client against a fake server.

The fake ``Generation`` servicer below stands in for the scheduler so that the client, the
concurrency limit, auth metadata and the report's shape are checked without loading a model;
the end-to-end benchmark against real services is an integration test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import grpc
import grpc.aio
import pytest

from tests.support.fake_generation import FakeGeneration
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.bench import (
    BenchRow,
    acceptance_rate,
    format_summary,
    idle_fraction,
    load_dataset,
    mean_accepted_length,
    parse_row,
    percentile,
    resolve_dataset,
    row_request,
    run_bench_async,
    select_rows,
    shipped_workloads,
    stats_delta,
    summarize,
)
from zerobubble.client import ChannelSettings, Completion, build_request, complete

ROOT = Path(__file__).resolve().parents[2]


# --- statistics ---------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert math.isclose(percentile(values, 90), 3.7)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_stats_delta_subtracts_every_field() -> None:
    before = generate_pb2.ServerStats(
        num_steps=10,
        num_drafts=4,
        num_draft_tokens=12,
        num_accepted_tokens=5,
        worker_busy_s=1.5,
        worker_idle_s=0.5,
        num_generation_tokens=30,
        num_preemptions=1,
    )
    after = generate_pb2.ServerStats(
        num_steps=30,
        num_drafts=14,
        num_draft_tokens=42,
        num_accepted_tokens=26,
        worker_busy_s=4.0,
        worker_idle_s=0.75,
        num_generation_tokens=90,
        num_preemptions=1,
    )
    delta = stats_delta(before, after)
    assert (delta.num_steps, delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens) == (20, 10, 30, 21)
    assert (delta.num_generation_tokens, delta.num_preemptions) == (60, 0)
    assert math.isclose(delta.worker_busy_s, 2.5) and math.isclose(delta.worker_idle_s, 0.25)


def test_speculation_and_idle_figures() -> None:
    delta = generate_pb2.ServerStats(
        num_drafts=10, num_draft_tokens=30, num_accepted_tokens=21, worker_busy_s=2.5, worker_idle_s=0.25
    )
    assert math.isclose(acceptance_rate(delta), 0.7)
    assert math.isclose(mean_accepted_length(delta), 3.1)  # bonus token + 2.1 accepted drafts per step
    assert math.isclose(idle_fraction(delta), 0.25 / 2.75)


def test_figures_are_none_without_drafts_or_work() -> None:
    empty = generate_pb2.ServerStats()
    assert acceptance_rate(empty) is None
    assert mean_accepted_length(empty) is None
    assert idle_fraction(empty) is None


def test_summarize_counts_tokens_and_leaves_errors_out_of_latencies() -> None:
    rows = [BenchRow(index=i, kind="k", max_tokens=4, prompt="p") for i in range(3)]
    completions = [
        Completion(
            token_ids=[1, 2, 3],
            text="abc",
            finish_reason="max_tokens",
            ttft_s=0.1,
            itl=[0.02, 0.04],
            e2e_s=0.16,
            num_prompt_tokens=5,
        ),
        Completion(token_ids=[4], text="d", finish_reason="eos", ttft_s=0.3, e2e_s=0.3, num_prompt_tokens=6),
        Completion(finish_reason="error", error="UNAVAILABLE: gone", e2e_s=9.0),
    ]
    delta = generate_pb2.ServerStats(
        num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3, worker_busy_s=1.0, worker_idle_s=1.0
    )
    report = summarize(rows, completions, wall_s=2.0, concurrency=2, delta=delta)
    assert report["output_tokens"] == 4 and report["output_tokens_per_s"] == 2.0
    assert report["requests_per_s"] == 1.5 and report["num_errors"] == 1
    assert report["ttft_p50_s"] == pytest.approx(0.2)
    assert report["itl_p50_s"] == pytest.approx(0.03)
    assert report["e2e_p50_s"] == pytest.approx(0.23)  # the failed request's 9 s is not a latency
    assert report["tpot_p50_s"] == pytest.approx(0.03)
    assert report["acceptance_rate"] == 0.5 and report["mean_accepted_length"] == 2.5
    assert report["worker_idle_fraction"] == 0.5
    assert report["finish_reasons"] == {"max_tokens": 1, "eos": 1, "error": 1}
    assert [r["index"] for r in report["requests"]] == [0, 1, 2]
    assert report["requests"][2]["error"] == "UNAVAILABLE: gone"
    assert set(report["requests"][0]) >= {
        "index",
        "kind",
        "token_ids",
        "text",
        "finish_reason",
        "ttft_s",
        "e2e_s",
        "num_prompt_tokens",
    }
    json.dumps(report)  # the --json file must be serialisable as is
    assert "acceptance 0.500" in format_summary(report)


# --- dataset -------------------------------------------------------------------------------------


def write_dataset(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    return path


def test_load_dataset_filters_limits_and_keeps_file_positions(tmp_path: Path) -> None:
    path = write_dataset(
        tmp_path / "d.jsonl",
        [
            {"kind": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            {"kind": "code", "prompt": "def f():", "max_tokens": 300},
            {
                "kind": "chat",
                "messages": [{"role": "user", "content": "yo"}],
                "max_tokens": 500,
                "temperature": 0.7,
                "seed": 11,
            },
            {"kind": "chat", "prompt": "raw", "max_tokens": 4},
        ],
    )
    rows = load_dataset(path)
    assert [r.index for r in rows] == [0, 1, 2, 3]
    assert rows[1].prompt == "def f():" and rows[1].messages is None
    chat = load_dataset(path, kind="chat", limit=2, max_tokens_cap=100)
    assert [(r.index, r.max_tokens) for r in chat] == [(0, 8), (2, 100)]
    assert (chat[1].temperature, chat[1].seed) == (0.7, 11)
    assert load_dataset(path, kind="missing") == []


def test_a_bare_name_loads_the_shipped_workload() -> None:
    rows = load_dataset("grounded")
    assert len(rows) == 48
    assert {r.kind for r in rows} == {"code-edit", "grounded-qa", "open-chat"}
    assert all(r.messages and r.max_tokens > 0 for r in rows)
    assert "grounded" in shipped_workloads()
    assert load_dataset("grounded", kind="open-chat", limit=3) == [r for r in rows if r.kind == "open-chat"][:3]


def test_a_path_still_wins_over_a_shipped_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_dataset(tmp_path / "grounded", [{"prompt": "local", "max_tokens": 2}])
    assert [r.prompt for r in load_dataset("grounded")] == ["local"]
    nested = write_dataset(tmp_path / "sub.jsonl", [{"prompt": "nested", "max_tokens": 3}])
    assert resolve_dataset(str(nested)) == nested
    assert [r.prompt for r in load_dataset(nested)] == ["nested"]


def test_an_unknown_name_lists_the_shipped_workloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="shipped: .*grounded"):
        load_dataset("no-such-workload")
    with pytest.raises(FileNotFoundError):  # a path with a suffix is opened as given
        load_dataset("no-such-file.jsonl")


def test_bench_cli_reports_an_unknown_dataset_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from zerobubble.entrypoints.bench import run_bench
    from zerobubble.entrypoints.cli import build_parser

    monkeypatch.chdir(tmp_path)
    args = build_parser(env={}).parse_args(["bench", "--dataset", "no-such-workload", "--target", "localhost:1"])
    assert run_bench(args) == 2
    shipped = capsys.readouterr().err.split("shipped: ", 1)[1]
    assert "grounded" in shipped and "edits" in shipped


def test_select_rows_does_not_mutate_its_input() -> None:
    rows = [BenchRow(index=0, kind="", max_tokens=50, prompt="x")]
    assert select_rows(rows, max_tokens_cap=10)[0].max_tokens == 10
    assert rows[0].max_tokens == 50


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"max_tokens": 4}, "exactly one"),
        ({"prompt": "a", "messages": [], "max_tokens": 4}, "exactly one"),
        ({"prompt": "a"}, "max_tokens"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"content": "no role"}], "max_tokens": 4}, "messages"),
        (["not", "an", "object"], "JSON object"),
        ({"prompt": "a", "max_tokens": 4, "prediction": 5}, "'prediction' must be a string.*got int"),
        ({"prompt": "a", "max_tokens": 4, "prediction": {"type": "content"}}, "'prediction' must be a string"),
    ],
)
def test_parse_row_rejects_bad_rows(obj: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_row(obj, 7)


def test_invalid_json_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 1}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match=":2: invalid JSON"):
        load_dataset(path)


def test_rows_are_greedy_unless_they_say_otherwise() -> None:
    greedy = row_request(BenchRow(index=0, kind="", max_tokens=5, messages=[{"role": "user", "content": "q"}]))
    assert greedy.WhichOneof("input") == "messages" and greedy.messages.messages[0].content == "q"
    assert greedy.sampling.temperature == 0.0 and not greedy.sampling.HasField("seed")
    assert greedy.stopping.max_tokens == 5
    sampled = row_request(BenchRow(index=0, kind="", max_tokens=5, prompt="q", temperature=0.8, seed=3))
    assert sampled.WhichOneof("input") == "prompt"
    assert sampled.sampling.temperature == pytest.approx(0.8) and sampled.sampling.seed == 3


def test_build_request_needs_exactly_one_input() -> None:
    with pytest.raises(ValueError):
        build_request()
    with pytest.raises(ValueError):
        build_request(prompt="a", token_ids=[1])
    request = build_request(token_ids=[5, 6], stop=["\n"], stop_token_ids=[2], top_k=4, logprobs=True)
    assert list(request.token_ids.ids) == [5, 6] and list(request.stopping.stop) == ["\n"]
    assert request.sampling.top_k == 4 and request.response.logprobs
    assert not request.stopping.HasField("max_tokens") and not request.sampling.HasField("temperature")


# --- predicted outputs -------------------------------------------------------------------------


def prediction_dataset(path: Path) -> Path:
    return write_dataset(
        path,
        [
            {
                "kind": "code-edit",
                "messages": [{"role": "user", "content": "edit"}],
                "max_tokens": 8,
                "prediction": "x = 1\n",
            },
            {"kind": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
        ],
    )


def test_a_rows_prediction_goes_into_its_request_and_no_prediction_drops_it(tmp_path: Path) -> None:
    from zerobubble.entrypoints.bench import load_rows
    from zerobubble.entrypoints.cli import build_parser

    path = prediction_dataset(tmp_path / "p.jsonl")
    parser = build_parser(env={})
    with_rows = load_rows(parser.parse_args(["bench", "--dataset", str(path)]))
    request = row_request(with_rows[0])
    assert request.prediction.WhichOneof("content") == "text" and request.prediction.text == "x = 1\n"
    assert not row_request(with_rows[1]).HasField("prediction")
    without = load_rows(parser.parse_args(["bench", "--dataset", str(path), "--no-prediction"]))
    assert [r.messages for r in without] == [r.messages for r in with_rows]
    assert [r.max_tokens for r in without] == [r.max_tokens for r in with_rows]
    assert not any(row_request(row).HasField("prediction") for row in without)


def test_the_openai_body_carries_the_prediction_in_openais_shape() -> None:
    from zerobubble.bench_openai import request_body

    row = BenchRow(index=0, kind="", max_tokens=5, messages=[{"role": "user", "content": "q"}], prediction="abc")
    path, body = request_body(row, "m")
    assert path == "/chat/completions" and body["prediction"] == {"type": "content", "content": "abc"}
    _, plain = request_body(BenchRow(index=0, kind="", max_tokens=5, messages=[{"role": "user", "content": "q"}]), "m")
    assert "prediction" not in plain


def test_openai_usage_gives_prediction_counts_or_none() -> None:
    from zerobubble.bench_openai import read_usage

    counted = Completion()
    read_usage(
        {
            "prompt_tokens": 9,
            "completion_tokens": 20,
            "completion_tokens_details": {"accepted_prediction_tokens": 12, "rejected_prediction_tokens": 3},
        },
        counted,
    )
    assert (counted.num_prompt_tokens, counted.num_output_tokens) == (9, 20)
    assert (counted.num_accepted_prediction_tokens, counted.num_rejected_prediction_tokens) == (12, 3)
    silent = Completion()
    read_usage({"prompt_tokens": 9, "completion_tokens": 20}, silent)
    assert silent.num_accepted_prediction_tokens is None and silent.num_rejected_prediction_tokens is None


def test_the_report_counts_prediction_tokens_per_request_and_in_total() -> None:
    rows = [
        BenchRow(index=0, kind="k", max_tokens=4, prompt="p", prediction="abc"),
        BenchRow(index=1, kind="k", max_tokens=4, prompt="p"),
    ]
    completions = [
        Completion(token_ids=[1, 2], num_accepted_prediction_tokens=6, num_rejected_prediction_tokens=2),
        Completion(token_ids=[3], num_accepted_prediction_tokens=0, num_rejected_prediction_tokens=0),
    ]
    delta = generate_pb2.ServerStats(num_prediction_draft_tokens=10, num_prediction_accepted_tokens=6)
    report = summarize(rows, completions, wall_s=1.0, concurrency=1, delta=delta)
    assert report["num_prediction_requests"] == 1
    assert (report["accepted_prediction_tokens"], report["rejected_prediction_tokens"]) == (6, 2)
    assert (report["server_prediction_draft_tokens"], report["server_prediction_accepted_tokens"]) == (10, 6)
    assert report["prediction_acceptance"] == pytest.approx(0.6)
    first, second = report["requests"]
    assert first["with_prediction"] and not second["with_prediction"]
    assert (first["accepted_prediction_tokens"], first["rejected_prediction_tokens"]) == (6, 2)
    assert "1 requests with one: 6 tokens accepted, 2 rejected" in format_summary(report)
    assert "acceptance 0.600" in format_summary(report).splitlines()[-1]
    json.dumps(report)


def test_without_counts_the_prediction_figures_are_none() -> None:
    rows = [BenchRow(index=0, kind="k", max_tokens=4, prompt="p", prediction="abc")]
    report = summarize(rows, [Completion(token_ids=[1])], wall_s=1.0, concurrency=1, backend="openai")
    assert report["accepted_prediction_tokens"] is None and report["rejected_prediction_tokens"] is None
    assert report["server_prediction_draft_tokens"] is None and report["prediction_acceptance"] is None
    assert report["requests"][0]["accepted_prediction_tokens"] is None
    assert "1 requests with one: n/a" in format_summary(report)
    plain = summarize(
        [BenchRow(index=0, kind="k", max_tokens=4, prompt="p")], [Completion()], wall_s=1.0, concurrency=1
    )
    assert "prediction" not in format_summary(plain)


def test_bench_over_grpc_sends_predictions_and_reports_the_replies_counts() -> None:
    servicer = FakeGeneration()
    rows = [
        BenchRow(index=0, kind="k", max_tokens=6, prompt="p", prediction="twelve chars"),
        BenchRow(index=1, kind="k", max_tokens=4, prompt="p"),
    ]

    async def body(target: str) -> dict:
        return await run_bench_async(target, rows, concurrency=2)

    report = asyncio.run(with_fake_server(servicer, body))
    first, second = report["requests"]
    # The fake counts half the reply accepted and the prediction's characters rejected.
    assert (first["accepted_prediction_tokens"], first["rejected_prediction_tokens"]) == (3, 12)
    assert (second["accepted_prediction_tokens"], second["rejected_prediction_tokens"]) == (0, 0)
    assert (report["accepted_prediction_tokens"], report["rejected_prediction_tokens"]) == (3, 12)
    assert (report["server_prediction_draft_tokens"], report["server_prediction_accepted_tokens"]) == (15, 3)
    assert report["prediction_acceptance"] == pytest.approx(3 / 15)


# --- client and bench against a fake scheduler ---------------------------------------------------


async def with_fake_server(servicer: FakeGeneration, body) -> object:  # noqa: ANN001 - a coroutine factory
    """Run ``body(target)`` against ``servicer`` served on a free loopback port."""
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        return await body(f"127.0.0.1:{port}")
    finally:
        await server.stop(grace=None)


def test_run_bench_async_keeps_dataset_order_and_concurrency_limit() -> None:
    servicer = FakeGeneration(token="s3cret")
    rows = [BenchRow(index=10 + i, kind="k", max_tokens=1 + i % 5, prompt=f"p{i}") for i in range(12)]
    rows[4] = BenchRow(index=14, kind="k", max_tokens=3, prompt="fail")
    settings = ChannelSettings(target="", auth_token="s3cret")

    async def body(target: str) -> dict:
        settings.target = target
        return await run_bench_async(settings, rows, concurrency=3)

    report = asyncio.run(with_fake_server(servicer, body))
    assert servicer.max_in_flight <= 3
    assert [r["index"] for r in report["requests"]] == [row.index for row in rows]
    failed = report["requests"][4]
    assert failed["finish_reason"] == "error" and failed["error"].startswith("INVALID_ARGUMENT")
    for row, record in zip(rows, report["requests"]):
        if row.prompt != "fail":
            assert record["token_ids"] == list(range(row.max_tokens))
            assert record["finish_reason"] == "max_tokens" and record["num_prompt_tokens"] == 3
    expected_tokens = sum(row.max_tokens for row in rows if row.prompt != "fail")
    assert report["output_tokens"] == expected_tokens == report["server_stats"]["num_generation_tokens"]
    assert report["num_errors"] == 1 and report["model"] == "fake"
    assert report["acceptance_rate"] == pytest.approx(
        report["server_stats"]["num_accepted_tokens"] / report["server_stats"]["num_draft_tokens"]
    )


def test_complete_times_the_stream_and_bearer_token_is_required() -> None:
    servicer = FakeGeneration(token="t")

    async def body(target: str) -> tuple[Completion, grpc.StatusCode]:
        from zerobubble.client import open_channel

        async with open_channel(ChannelSettings(target=target, auth_token="t")) as channel:
            completion = await complete(channel, build_request(prompt="x", max_tokens=5))
        async with open_channel(ChannelSettings(target=target)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await complete(channel, build_request(prompt="x", max_tokens=5))
        return completion, info.value.code()

    completion, code = asyncio.run(with_fake_server(servicer, body))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert completion.token_ids == [0, 1, 2, 3, 4] and completion.text == "<0><1><2><3><4>"
    assert completion.finish_reason == "max_tokens" and completion.num_prompt_tokens == 3
    assert completion.ttft_s is not None and len(completion.itl) == 2  # three token-carrying messages
    assert completion.e2e_s >= completion.ttft_s + sum(completion.itl) - 1e-9


# --- HF baseline comparison (no model run) -------------------------------------------------------


def load_hf_baseline() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_baseline", ROOT / "scripts" / "hf_baseline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_compare_ratio_and_agreement() -> None:
    hf_baseline = load_hf_baseline()
    ours = {
        "output_tokens_per_s": 30.0,
        "requests": [
            {"index": 0, "token_ids": [5, 6, 2], "finish_reason": "eos"},  # agrees up to the EOS
            {"index": 1, "token_ids": [7, 8, 9], "finish_reason": "max_tokens"},
            {"index": 2, "token_ids": [1], "finish_reason": "max_tokens"},  # sampled row: not compared
            {"index": 3, "token_ids": [], "finish_reason": "error"},
        ],
    }
    hf = {
        "output_tokens_per_s": 10.0,
        "eos_token_ids": [2],
        "requests": [
            {"index": 0, "token_ids": [5, 6], "finish_reason": "eos"},
            {"index": 1, "token_ids": [7, 4, 9], "finish_reason": "max_tokens"},
            {"index": 2, "token_ids": [3], "finish_reason": "max_tokens", "sampled": True},
            {"index": 3, "token_ids": [1], "finish_reason": "max_tokens"},
        ],
    }
    result = hf_baseline.compare_reports(ours, hf)
    assert result["throughput_ratio"] == 3.0
    assert (result["agreeing"], result["compared"]) == (1, 2)
    assert result["mismatches"] == [{"index": 1, "first_divergence": 1, "ours_len": 3, "hf_len": 3}]
    assert "1/2 greedy requests agree" in hf_baseline.format_comparison(result)


# --- open-loop arrivals --------------------------------------------------------------------------


def test_arrival_times_are_a_seeded_poisson_process() -> None:
    from zerobubble.bench import arrival_times

    assert arrival_times(5, 0.0) == [0.0] * 5
    times = arrival_times(4000, 20.0)
    assert times == arrival_times(4000, 20.0) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(g >= 0 for g in gaps)
    mean = sum(gaps) / len(gaps)
    # Exponential gaps: mean 1/rate, standard deviation 1/rate; 4000 gaps put the mean within
    # about 0.0008 s of 0.05 (one standard error), so 0.004 is five of them.
    assert abs(mean - 0.05) < 0.004
    assert abs(sum(g > 0.05 for g in gaps) / len(gaps) - math.exp(-1)) < 0.04  # P(gap > mean) = 1/e


def test_open_loop_starts_no_request_before_its_arrival_and_caps_concurrency() -> None:
    from zerobubble.bench import arrival_times, drive

    rows = [BenchRow(index=i, kind="", max_tokens=1, prompt="p") for i in range(12)]
    starts: dict[int, float] = {}
    in_flight = peak = 0

    async def send(row: BenchRow) -> Completion:
        nonlocal in_flight, peak
        starts[row.index] = asyncio.get_running_loop().time()
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return Completion(token_ids=[row.index])

    async def run() -> tuple[list[Completion], float, float]:
        t0 = asyncio.get_running_loop().time()
        done, wall = await drive(rows, send, 2, request_rate=40.0)
        return done, wall, t0

    done, wall, t0 = asyncio.run(run())
    assert [c.token_ids for c in done] == [[i] for i in range(12)]
    arrivals = arrival_times(12, 40.0)
    assert all(starts[i] - t0 >= arrivals[i] - 0.01 for i in range(12))
    assert peak <= 2 and wall >= arrivals[-1]
