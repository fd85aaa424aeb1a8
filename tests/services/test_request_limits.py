"""Every field of both client APIs, tried out of range, of the wrong type and absurdly large,
against a real worker (SmolLM2) and a real scheduler on loopback.

The only answers accepted: a 4xx OpenAI error object naming the field (or the body), or a
success; over gRPC, INVALID_ARGUMENT naming the field, or a success. After each case the service
still answers a normal request: a bad field never costs anyone else their service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from tests.support.servers import Service, serving
from zerobubble.api import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.timeout(900)

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The sea is", "max_tokens": 2, "temperature": 0}
HUGE_INT = 10**400  # no float holds it; JSON carries it as it is
HUGE_TEXT = "x" * 2_000_000

# Field -> (out of range, wrong type, absurdly large), for the fields both endpoints take.
COMMON: dict[str, tuple[Any, Any, Any]] = {
    "model": ("no-such-model", 5, HUGE_TEXT),
    "max_tokens": (0, "2", 1_000_000_000_000),
    "temperature": (-1, "0.5", HUGE_INT),
    "top_p": (1.5, "1", HUGE_INT),
    "seed": (-(2**80), 1.5, HUGE_INT),
    "stop": ([""], 5, ["x"] * 100_000),
    "n": (0, "2", HUGE_INT),
    "presence_penalty": (2.5, "1", -HUGE_INT),
    "frequency_penalty": (-3, [1], HUGE_INT),
    "logit_bias": ({"10": 101}, ["10"], {str(i): 1 for i in range(100_000)}),
    "user": ("", 5, HUGE_TEXT),
    "stream": (2, "yes", [True] * 1000),
    "stream_options": ({"include_usage": 2}, "x", {"include_usage": True, "extra": HUGE_TEXT}),
    "top_k": (-2, 1.5, HUGE_INT),
    "min_p": (1.5, "0", HUGE_INT),
    "repetition_penalty": (0, "1", HUGE_INT),
    "min_tokens": (-1, "1", HUGE_INT),
    "ignore_eos": (2, "true", [True] * 1000),
    "stop_token_ids": ([-1], "1", list(range(100_000))),
    # Structured output: each refused with its own name (a bad schema, regex or grammar, a text
    # past the limit), or served.
    "response_format": ({"type": "json_schema"}, "json", {"type": "json_schema", "json_schema": {"schema": HUGE_TEXT}}),
    "structured_outputs": ({"regex": "a(b"}, "x", {"regex": "a" * 300_000}),
    "guided_json": ({"type": "foo"}, 5, HUGE_TEXT),
    "guided_regex": ("a(b", 5, "a" * 300_000),
    "guided_choice": ([], "x", ["x"] * 100_000),
    "guided_grammar": ("start: nope", 5, HUGE_TEXT),
    "prediction": ({"type": "text", "content": "x"}, "x", {"type": "content", "content": HUGE_TEXT}),
}
CHAT_ONLY: dict[str, tuple[Any, Any, Any]] = {
    "messages": ([], "hi", [{"role": "user", "content": HUGE_TEXT}]),
    "max_completion_tokens": (0, "1", HUGE_INT),
    "logprobs": (2, "yes", [True] * 1000),
    "top_logprobs": (21, "1", HUGE_INT),
    "tools": ([{"type": "function"}], "x", [{}] * 10_000),
    "tool_choice": ("maybe", 5, {"type": "function", "function": {"name": HUGE_TEXT}}),
    "parallel_tool_calls": (2, "yes", [True] * 1000),
    "modalities": (["video"], "text", ["text"] * 100_000),
    "store": (True, "no", [False] * 1000),
    "reasoning_effort": ("high", 5, HUGE_TEXT),
    "metadata": ({"k": 1}, "x", {str(i): "v" * 100 for i in range(10_000)}),
    "service_tier": ("flex", 5, HUGE_TEXT),
}
COMPLETION_ONLY: dict[str, tuple[Any, Any, Any]] = {
    "prompt": ([], 5, [1_000_000_000_000]),
    "logprobs": (-1, "1", HUGE_INT),
    "echo": (2, "yes", True),
    "suffix": ("", 5, HUGE_TEXT),
    "best_of": (0, "2", HUGE_INT),
}
KINDS = ("out_of_range", "wrong_type", "absurd")


def cases(path: str, fields: dict[str, tuple[Any, Any, Any]]) -> list[Any]:
    api = "chat" if "chat" in path else "completions"
    return [
        pytest.param(path, name, value, id=f"{api}-{name}-{kind}")
        for name, values in fields.items()
        for kind, value in zip(KINDS, values)
    ]


HTTP_CASES = cases("/v1/chat/completions", {**COMMON, **CHAT_ONLY}) + cases(
    "/v1/completions", {**COMMON, **COMPLETION_ONLY}
)


@pytest.fixture(scope="module")
def scheduler(smollm2_dir) -> Iterator[Service]:
    with serving(dict(kv_cache_memory_gb=0.25, max_num_seqs=4), max_num_seqs=4) as sched:
        yield sched


@pytest.fixture(scope="module")
def http(scheduler: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{scheduler.ports['HTTP']}", timeout=120) as client:
        yield client


def assert_refused_or_served(reply: httpx.Response, field: str) -> None:
    """A 4xx error object naming ``field`` (or the body), or a completion."""
    assert reply.status_code < 500, reply.text[:500]
    body = reply.json() if not reply.text.startswith("data:") else None
    if reply.status_code == 200:
        assert body is None or body["choices"], reply.text[:500]
        return
    error = body["error"] if body is not None else {}
    assert set(error) == {"message", "type", "param", "code"}, reply.text[:500]
    assert error["message"] and error["type"].endswith("_error"), error
    if reply.status_code == 400:
        assert error["param"].split(".")[0].split("[")[0] in (field, "body"), error


def assert_still_serving(http: httpx.Client) -> None:
    reply = http.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1, reply.text


@pytest.mark.parametrize(("path", "field", "value"), HTTP_CASES)
def test_every_http_field_out_of_range_is_a_named_4xx_or_served(http, path: str, field: str, value: Any) -> None:
    base = CHAT if path.endswith("chat/completions") else COMPLETION
    assert_refused_or_served(http.post(path, json={**base, field: value}), field)
    assert_still_serving(http)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param("[" * 5000 + "]" * 5000, id="nested-arrays"),
        pytest.param('{"model": "m", "messages": ' + "[" * 5000 + "]" * 5000 + "}", id="nested-in-a-field"),
        pytest.param('{"max_tokens": ' + "9" * 5000 + "}", id="integer-of-5000-digits"),
        pytest.param('{"temperature": NaN, "messages": []}', id="nan"),
        pytest.param("[1, 2, 3]", id="not-an-object"),
        pytest.param("{", id="not-json"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_malformed_body_is_a_400_naming_it(http, path: str, content: str) -> None:
    reply = http.post(path, content=content, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text[:500]
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert_still_serving(http)


# gRPC: field path -> values that are out of range or absurdly large for it (the proto's types
# decide the wrong-type cases away; the widest value each type carries is the absurd one).
INT32_MAX, UINT64_MAX, FLOAT_MAX = 2**31 - 1, 2**64 - 1, 3.4e38
GRPC_FIELDS: dict[str, list[Any]] = {
    "sampling.temperature": [-1.0, FLOAT_MAX, float("inf"), float("nan")],
    "sampling.top_k": [-1, -(2**31), INT32_MAX],
    "sampling.top_p": [0.0, -1.0, FLOAT_MAX, float("nan")],
    "sampling.seed": [UINT64_MAX],
    "sampling.presence_penalty": [2.5, -FLOAT_MAX, float("nan")],
    "sampling.frequency_penalty": [-2.5, FLOAT_MAX, float("inf")],
    "sampling.repetition_penalty": [0.0, -1.0, FLOAT_MAX, float("inf")],
    "sampling.min_p": [-0.1, 1.5, float("nan")],
    "sampling.logit_bias": [{10: 101.0}, {-1: 1.0}, {INT32_MAX: 1.0}, {i: 1.0 for i in range(100_000)}],
    "sampling.n": [-1, 17, INT32_MAX],
    "stopping.max_tokens": [0, -1, INT32_MAX],
    "stopping.min_tokens": [-1, INT32_MAX],
    "stopping.stop": [[""], ["x"] * 100_000, ["x" * 1_000_000]],
    "stopping.stop_token_ids": [[-1], [INT32_MAX], list(range(100_000))],
    "stopping.ignore_eos": [True],
    "response.logprobs": [True],
    "response.top_logprobs": [-1, 21, INT32_MAX],
    "request_id": ["x" * 1_000_000],
    "model": ["no-such-model", "m" * 1_000_000],
    "prompt": ["", "x" * 2_000_000],
    "messages": [[], [("robot", "hi")], [("user", "x")] * 100_000, [("user", "x" * 2_000_000)]],
    "token_ids": [[], [-1], [INT32_MAX], [1] * 1_000_000],
    "constraint.json_schema": ['{"type": "foo"}', "{not json", "[]", "x" * 1_000_000],
    "constraint.regex": ["", "a(b", "a" * 300_000],
    "constraint.grammar": ["", "start: nope", "x" * 1_000_000],
    "constraint.choice": [[], [""], ["x"] * 100_000],
}


def grpc_request(field: str, value: Any) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(prompt="The sea is")
    request.stopping.max_tokens = 2
    if field in ("prompt", "request_id", "model"):
        setattr(request, field, value)
    elif field == "messages":
        request.messages.SetInParent()
        for role, content in value:
            request.messages.messages.add(role=role, content=content)
    elif field == "token_ids":
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(value)
    elif field == "constraint.choice":
        request.constraint.choice.SetInParent()
        request.constraint.choice.choices.extend(value)
    else:
        group, name = field.split(".")
        target = getattr(request, group)
        container = getattr(target, name)
        if isinstance(value, dict):
            container.update(value)
        elif isinstance(value, list):
            container.extend(value)
        else:
            setattr(target, name, value)
    return request


async def generate(target: str, request: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateResponse]:
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        return [reply async for reply in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)]


@pytest.mark.parametrize(
    ("field", "value"),
    [pytest.param(f, v, id=f"{f}-{i}") for f, values in GRPC_FIELDS.items() for i, v in enumerate(values)],
)
def test_every_grpc_field_out_of_range_is_invalid_argument_or_served(scheduler, http, field: str, value: Any) -> None:
    try:
        replies = asyncio.run(generate(scheduler.target, grpc_request(field, value)))
    except grpc.aio.AioRpcError as exc:
        # NOT_FOUND: a model that is not served, the one refusal that is not about a range.
        allowed = {grpc.StatusCode.INVALID_ARGUMENT} | ({grpc.StatusCode.NOT_FOUND} if field == "model" else set())
        assert exc.code() in allowed, (exc.code(), exc.details())
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            named = field.split(".")[-1] if field.startswith("sampling.") or field.startswith("stopping.") else field
            assert named in (exc.details() or "") or "input" in (exc.details() or ""), exc.details()
    else:
        assert replies[-1].finish_reason != generate_pb2.FINISH_REASON_ERROR, replies[-1].error
    assert_still_serving(http)
