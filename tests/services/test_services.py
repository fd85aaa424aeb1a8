"""End to end over real gRPC on loopback with the real SmolLM2: scheduler + worker processes."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.e2e import assert_matches_reference, bench_rows, hf_reference, run_workload
from tests.support.metrics_scrape import metric, wait_all_released
from tests.support.polling import wait_until
from tests.support.servers import start_scheduler, start_worker, wait_serving
from zerobubble.api import generate_pb2_grpc
from zerobubble.client import build_request, complete

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def services(smollm2_dir):
    worker = start_worker(kv_cache_memory_gb=0.5, max_num_seqs=48)
    scheduler = start_scheduler([worker])
    wait_serving(scheduler.target)
    yield scheduler, worker
    scheduler.stop()
    worker.stop()


def run(coro):
    return asyncio.run(coro)


async def one(target: str, timeout: float = 120, on_response=None, **kw):
    async with grpc.aio.insecure_channel(target) as channel:
        return await complete(
            generate_pb2_grpc.GenerationStub(channel), build_request(**kw), timeout=timeout, on_response=on_response
        )


# The workload's last 32 rows: prompts of 37 to 514 tokens, all 32 streams at once.
STREAM_ROWS = slice(16, 48)
STREAM_MAX_TOKENS = 48


def test_greedy_matches_hf_at_32_concurrent_streams(services, smollm2_dir, grounded_rows):
    scheduler, _ = services
    rows = grounded_rows[STREAM_ROWS]
    assert len(rows) == 32
    reference = hf_reference(smollm2_dir, rows, STREAM_MAX_TOKENS)
    report = run_workload(scheduler.target, bench_rows(rows, STREAM_MAX_TOKENS), concurrency=32)
    assert_matches_reference(report, reference, smollm2_dir, rows, min_identical=31)
    # Streamed text equals the detokenized ids.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for r in report["requests"]:
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True)


def test_stop_string_cuts_exactly(services):
    scheduler, _ = services
    full = run(one(scheduler.target, prompt="1, 2, 3, 4, 5,", max_tokens=24))
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = run(one(scheduler.target, prompt="1, 2, 3, 4, 5,", max_tokens=24, stop=[stop]))
    assert cut.finish_reason == "stop_sequence"
    assert cut.text == full.text[: full.text.index(stop)]
    assert stop not in cut.text


def test_cancelled_stream_returns_kv_blocks(services):
    scheduler, _ = services
    metrics_port = scheduler.ports["METRICS"]

    async def cancel_mid_stream():
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(
                build_request(prompt="Tell me a long story about a dragon.", max_tokens=400, ignore_eos=True)
            )
            got = 0
            async for reply in call:
                got += len(reply.token_ids)
                if got >= 5:
                    break
            call.cancel()
            # A second stream that runs to the end while the first is being torn down.
            return await complete(stub, build_request(prompt="Hi", max_tokens=8), timeout=60)

    other = run(cancel_mid_stream())
    assert other.finish_reason in ("eos", "max_tokens")
    wait_all_released(metrics_port)
    assert metric(metrics_port, "zerobubble_request_success_total", finished_reason="cancelled") >= 1


def test_prefix_cache_hits_are_reported_and_outputs_unchanged(services):
    scheduler, _ = services
    metrics_port = scheduler.ports["METRICS"]
    messages = [
        {"role": "system", "content": "You answer in one short sentence. " * 8},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    hits_before = metric(metrics_port, "zerobubble_prefix_cache_hits_total")
    first = run(one(scheduler.target, messages=messages, max_tokens=16))
    second = run(one(scheduler.target, messages=messages, max_tokens=16))
    assert second.num_cached_prompt_tokens > 0
    assert second.token_ids == first.token_ids
    assert metric(metrics_port, "zerobubble_prefix_cache_hits_total") > hits_before


BAD_INPUTS = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens"),
    (dict(prompt="hi", max_tokens=10**6), "max_tokens"),
    (dict(prompt="hello " * 9000), "prompt"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0.0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "role"),
    (dict(token_ids=[10**8]), "token_ids"),
    (dict(prompt="x" * 1_000_001), "prompt"),
    (dict(prompt="hi", presence_penalty=3.0), "sampling.presence_penalty"),
    (dict(prompt="hi", repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(prompt="hi", min_p=2.0), "sampling.min_p"),
    (dict(prompt="hi", typical_p=0.0), "sampling.typical_p"),
    (dict(prompt="hi", logit_bias={10**7: 1.0}), "sampling.logit_bias"),
    (dict(prompt="hi", top_logprobs=21), "response.top_logprobs"),
    (dict(prompt="hi", n=17), "sampling.n"),
    (dict(prompt="hi", n=3, min_p=2.0), "sampling.min_p"),
]


def test_bad_input_gets_invalid_argument_while_others_continue(services):
    scheduler, _ = services

    async def scenario():
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            good = asyncio.create_task(
                complete(stub, build_request(prompt="Count to ten:", max_tokens=32, ignore_eos=True), timeout=120)
            )
            errors = []
            for kwargs, field in BAD_INPUTS:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await complete(stub, build_request(**kwargs), timeout=30)
                errors.append((info.value.code(), info.value.details(), field))
            unknown = build_request(prompt="hi")
            unknown.model = "no-such-model"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await complete(stub, unknown, timeout=30)
            errors.append((info.value.code(), info.value.details(), "model"))
            return await good, errors

    good, errors = run(scenario())
    for code, details, field in errors:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
        assert field in details, (field, details)
    assert good.finish_reason == "max_tokens" and len(good.token_ids) == 32


def test_worker_down_makes_health_not_serving_and_generate_unavailable(smollm2_dir):
    worker = start_worker(kv_cache_memory_gb=0.2)
    scheduler = start_scheduler([worker])
    try:
        wait_serving(scheduler.target)
        worker.kill()
        with grpc.insecure_channel(scheduler.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            wait_until(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                    == health_pb2.HealthCheckResponse.NOT_SERVING
                ),
                30,
                "health NOT_SERVING once the only worker is gone",
                poll=0.2,
            )
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            run(one(scheduler.target, prompt="hi", max_tokens=4, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 10
    finally:
        scheduler.stop()
        worker.stop()


@pytest.mark.slow
def test_preemption_under_tiny_kv_budget_keeps_greedy_outputs(smollm2_dir, grounded_rows):
    # ~64 blocks of 16 tokens for 16 concurrent ~200-token requests: preemption is certain.
    # Slow suite (about 3 minutes): the default suite has the same scenario with n-gram drafts,
    # chunked prefill and two plans in flight (tests/services/test_async_spec_e2e.py).
    worker = start_worker(kv_cache_memory_gb=0.045, max_num_seqs=16)
    scheduler = start_scheduler([worker], max_num_batched_tokens=256)
    try:
        wait_serving(scheduler.target)
        rows = grounded_rows[:16]
        reference = hf_reference(smollm2_dir, rows)
        report = run_workload(scheduler.target, bench_rows(rows), concurrency=16)
        assert report["server_stats"]["num_preemptions"] > 0
        assert_matches_reference(report, reference, smollm2_dir, rows, min_identical=15)
    finally:
        scheduler.stop()
        worker.stop()


def test_n_sequences_and_top_logprobs_stream_with_index(services):
    """n = 3 over gRPC: three sequences on one stream told apart by `index`, each finishing once;
    sequence 0 equals the same seeded request with n = 1; top_logprobs come one per token."""
    scheduler, _ = services
    kw = dict(
        prompt="Write a short poem about the sea.",
        max_tokens=12,
        ignore_eos=True,
        temperature=1.0,
        seed=31337,
        logprobs=True,
        top_logprobs=3,
    )
    finals: list[int] = []

    def on_response(response):
        if response.finish_reason:
            finals.append(response.index)

    many = run(one(scheduler.target, timeout=600, on_response=on_response, n=3, **kw))
    single = run(one(scheduler.target, timeout=600, **kw))
    assert sorted(finals) == [0, 1, 2]
    assert [len(c.token_ids) for c in many.choices] == [12, 12, 12]
    assert many.choices[0].token_ids == single.token_ids == many.token_ids
    assert len({tuple(c.token_ids) for c in many.choices}) == 3
    for c in many.choices:
        assert len(c.top_logprobs) == len(c.logprobs) == 12
        assert all(len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] for top in c.top_logprobs)
        # The sampled token's logprob is at most the most likely one's.
        assert all(lp <= top[0][1] + 1e-5 for lp, top in zip(c.logprobs, c.top_logprobs))


async def constrained(target: str, kind: str, value: object, **kw):
    """One request with ``constraint.<kind>`` set to ``value`` (a message's field, or a list
    for `choice`)."""
    request = build_request(**kw)
    if kind == "choice":
        request.constraint.choice.choices.extend(value)  # type: ignore[arg-type]
    else:
        setattr(request.constraint, kind, value)
    async with grpc.aio.insecure_channel(target) as channel:
        return await complete(generate_pb2_grpc.GenerationStub(channel), request, timeout=120)


def test_constraints_over_grpc_and_their_refusals(services):
    """`GenerateRequest.constraint`: a schema's reply validates and ends with EOS, a regex's
    fullmatches, a choice's is one of them; a schema, regex or grammar that does not compile is
    INVALID_ARGUMENT naming the field, and nothing is left running or holding KV blocks."""
    import json
    import re

    import jsonschema

    scheduler, _ = services
    ask = {"messages": [{"role": "user", "content": "Describe a cat as JSON."}], "max_tokens": 96}
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "legs": {"type": "integer", "maximum": 8}},
        "required": ["name", "legs"],
        "additionalProperties": False,
    }
    reply = run(constrained(scheduler.target, "json_schema", json.dumps(schema), **ask))
    assert reply.finish_reason == "eos"
    jsonschema.validate(json.loads(reply.text), schema)
    reply = run(constrained(scheduler.target, "regex", r"[A-Z][a-z]+ (is|was) \d{1,2}\.", **ask))
    assert re.fullmatch(r"[A-Z][a-z]+ (is|was) \d{1,2}\.", reply.text), reply.text
    reply = run(constrained(scheduler.target, "choice", ["purr", "bark"], **ask))
    assert reply.text in ("purr", "bark")
    reply = run(constrained(scheduler.target, "json_object", True, **{**ask, "max_tokens": 4}))
    assert reply.finish_reason == "max_tokens" and reply.text.startswith("{")
    for kind, value, field in [
        ("json_schema", '{"type": "foo"}', "constraint.json_schema"),
        ("json_schema", "{not json", "constraint.json_schema"),
        ("regex", "a(b", "constraint.regex"),
        ("grammar", "start: undefined_rule", "constraint.grammar"),
        ("choice", [], "constraint.choice"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            run(constrained(scheduler.target, kind, value, **ask))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (kind, value)
        assert refused.value.details().startswith(f"{field}: "), refused.value.details()
    wait_all_released(scheduler.ports["METRICS"])


def test_a_prediction_over_grpc_leaves_the_output_and_counts_its_drafts(services):
    """`GenerateRequest.prediction`, as text and as token ids: the same greedy tokens as without
    it, and the final reply counts its drafts (accepted + rejected); none without one."""
    scheduler, _ = services
    kw = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 32}
    plain = run(one(scheduler.target, **kw))
    assert plain.num_accepted_prediction_tokens == plain.num_rejected_prediction_tokens == 0
    text = run(one(scheduler.target, prediction=plain.text, **kw))
    assert text.token_ids == plain.token_ids
    assert text.num_accepted_prediction_tokens >= len(plain.token_ids) // 2
    request = build_request(**kw)
    request.prediction.token_ids.ids.extend(plain.token_ids)

    async def by_ids():
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            return await complete(generate_pb2_grpc.GenerationStub(channel), request, timeout=120)

    ids = run(by_ids())
    assert ids.token_ids == plain.token_ids and ids.num_accepted_prediction_tokens >= len(plain.token_ids) // 2
