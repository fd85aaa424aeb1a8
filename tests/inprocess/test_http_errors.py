"""The HTTP front's own answers, in process over ASGI: auth, no ready worker, bad JSON shapes.

The app is the real one over a real servicer and router; the router has no worker, which is
exactly the state these answers are about (401 comes before any routing, 503 is "no worker").
The answers that need a real worker are in tests/services/test_http_api.py; a refused multi-prompt
request runs against the simulated worker of tests/support/sim_link.py.
"""

from __future__ import annotations

import asyncio
import typing

import httpx
import pytest

from tests.support import openai_table
from tests.support.polling import wait_until_async
from tests.support.sim_link import NUM_BLOCKS, sim_stub
from zerobubble.config import SchedulerServiceConfig
from zerobubble.scheduler_svc import worker_link
from zerobubble.scheduler_svc.http_api import build_app
from zerobubble.scheduler_svc.openai_protocol import ChatCompletionBody, CompletionBody, build_requests, openai_param
from zerobubble.scheduler_svc.router import Router
from zerobubble.scheduler_svc.scheduler import SchedulerConfig
from zerobubble.scheduler_svc.server import GenerationServicer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def call(method: str, path: str, token: str = "", **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        router = Router(SchedulerConfig(), 2, None, None)
        app = build_app(GenerationServicer(SchedulerServiceConfig(), router), auth_token=token)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
        assert param in error["message"], error
    return error


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/completions"])
def test_a_missing_or_wrong_token_is_401(path: str) -> None:
    method = "GET" if path == "/v1/models" else "POST"
    assert_error(call(method, path, token="s3cret", json=CHAT), 401)
    wrong = call(method, path, token="s3cret", json=CHAT, headers={"Authorization": "Bearer nope"})
    assert "bearer token" in assert_error(wrong, 401)["message"]


def test_the_right_token_passes_auth_and_health_needs_none() -> None:
    # Past auth, the next answer is 503: there is no worker.
    ok = call("GET", "/v1/models", token="s3cret", headers={"Authorization": "Bearer s3cret"})
    assert_error(ok, 503)
    assert call("GET", "/version", token="s3cret").status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")],
)
def test_no_ready_worker_is_503(method: str, path: str) -> None:
    body = CHAT if path.endswith("chat/completions") else {"model": "m", "prompt": "hi"}
    assert "no worker" in assert_error(call(method, path, json=body), 503)["message"]


def test_version_and_unknown_route() -> None:
    assert call("GET", "/version").json()["version"]
    assert_error(call("GET", "/v1/nothing"), 404)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "max_tokens": 1.5}, "max_tokens"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({"model": "m"}, "messages"),
        ({**CHAT, "messages": [{"content": "no role"}]}, "messages.0.role"),
        ({**CHAT, "n": 0}, "n"),
        ({**CHAT, "typical_p": 0}, "typical_p"),
        ({**CHAT, "typical_p": "0.5"}, "typical_p"),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "logit_bias": {"hello": 1.0}}, "logit_bias"),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
        ({**CHAT, "tool_choice": "required"}, "tool_choice"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice"),
        ({**CHAT, "temprature": 0}, "temprature"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**CHAT, "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
        ({**CHAT, "seed": 2**63}, "seed"),
        ({**CHAT, "seed": -(2**63) - 1}, "seed"),
        ({**CHAT, "prediction": "hello"}, "prediction"),
        ({**CHAT, "prediction": {"type": "text", "content": "hello"}}, "prediction.type"),
        ({**CHAT, "prediction": {"type": "content"}}, "prediction.content"),
        ({**CHAT, "prediction": {"type": "content", "content": 5}}, "prediction.content"),
        ({**CHAT, "prediction": {"type": "content", "content": [{"type": "image_url"}]}}, "prediction.content[0]"),
        ({**CHAT, "modalities": ["audio"]}, "modalities"),
        ({**CHAT, "store": True}, "store"),
        ({**CHAT, "reasoning_effort": "high"}, "reasoning_effort"),
        ({**CHAT, "metadata": {"k": 1}}, "metadata.k"),
    ],
)
def test_bad_chat_bodies_are_400_naming_the_field(body: dict, param: str) -> None:
    # Decided by the JSON shape alone, so they come before the "no worker" 503.
    assert_error(call("POST", "/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "hi", "echo": True, "logprobs": 1}, "logprobs"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": [1.5]}, "prompt"),
        ({"model": "m", "prompt": "hi", "logprobs": True}, "logprobs"),
        ({"model": "m", "prompt": "hi", "best_of": 3, "n": 2}, "best_of"),
        ({"model": "m", "prompt": "hi", "suffix": "end"}, "suffix"),
        ({"model": "m", "prompt": "hi", "seed": 2**64}, "seed"),
        ({"model": "m", "prompt": "hi", "typical_p": 1.5}, "typical_p"),
        ({"model": "m", "prompt": "hi", "stream_options": {}}, "stream_options"),
        ({"model": "m", "prompt": "hi", "max_completion_tokens": 4}, "max_completion_tokens"),
        ({"model": "m", "prompt": "hi", "prediction": {"type": "content", "content": [{"text": "x"}]}}, "prediction"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(body: dict, param: str) -> None:
    error = call("POST", "/v1/completions", json=body)
    assert error.status_code == 400, error.text
    assert error.json()["error"]["param"].startswith(param)


def test_invalid_json_is_400() -> None:
    response = call("POST", "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_openai_fields_map_onto_the_proto() -> None:
    body = ChatCompletionBody.model_validate(
        {
            **CHAT,
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": -1,
            "stop": "END",
            "n": 3,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logprobs": True,
            "top_logprobs": 4,
            "logit_bias": {"42": -100},
            "top_k": -1,
            "min_p": 0.1,
            "typical_p": 0.7,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [5],
        }
    )
    (request,) = build_requests(body, "chatcmpl-1")
    s, st = request.sampling, request.stopping
    assert request.model == "m" and request.request_id == "chatcmpl-1"
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "hi")]
    assert st.max_tokens == 7 and st.min_tokens == 2 and st.ignore_eos
    assert list(st.stop) == ["END"] and list(st.stop_token_ids) == [5]
    assert s.temperature == 0.5 and s.top_p == pytest.approx(0.9) and s.top_k == 0
    assert s.seed == 2**64 - 1 and s.n == 3 and dict(s.logit_bias) == {42: -100.0}
    assert s.presence_penalty == 0.5 and s.frequency_penalty == -0.5
    assert s.min_p == pytest.approx(0.1) and s.repetition_penalty == pytest.approx(1.2)
    assert s.typical_p == pytest.approx(0.7)
    assert request.response.logprobs and request.response.top_logprobs == 4
    # OpenAI's default temperature is 1, not our gRPC default of greedy.
    (default,) = build_requests(ChatCompletionBody.model_validate(CHAT), "x")
    assert default.sampling.temperature == 1.0 and not default.stopping.HasField("max_tokens")


def test_completion_prompts_map_to_one_request_each() -> None:
    text, ids = (
        build_requests(CompletionBody.model_validate({"prompt": p, "logprobs": 2}), "c") for p in ("hello", [1, 2, 3])
    )
    assert text[0].prompt == "hello" and list(ids[0].token_ids.ids) == [1, 2, 3]
    assert text[0].response.logprobs and text[0].response.top_logprobs == 2
    many = build_requests(CompletionBody.model_validate({"prompt": ["a", "b"]}), "c")
    assert [r.prompt for r in many] == ["a", "b"] and [r.request_id for r in many] == ["c-0", "c-1"]


def test_validator_messages_name_the_openai_field() -> None:
    chat = ChatCompletionBody.model_validate({**CHAT, "max_completion_tokens": 5})
    assert openai_param("sampling.temperature: must be >= 0, got -1.0", chat) == (
        "temperature",
        "temperature: must be >= 0, got -1.0",
    )
    assert openai_param("stopping.max_tokens: must be > 0", chat)[0] == "max_completion_tokens"
    assert openai_param("stopping.stop[1]: must be 1 to 256 characters", chat)[0] == "stop[1]"
    assert openai_param("input: prompt is 9000 tokens", chat)[0] == "messages"
    assert openai_param("messages[2].role: unknown role 'x'", chat)[0] == "messages[2].role"
    completion = CompletionBody.model_validate({"prompt": [1]})
    assert openai_param("token_ids: 99999 is outside the vocabulary", completion)[0] == "prompt"


def test_http_port_flag_on_serve_and_scheduler_with_env_fallback() -> None:
    from zerobubble.entrypoints.cli import build_parser

    for command in ("serve", "scheduler"):
        assert build_parser(env={}).parse_args([command]).http_port == 8000
        assert build_parser(env={"ZEROBUBBLE_HTTP_PORT": "-1"}).parse_args([command]).http_port == -1
        assert build_parser(env={}).parse_args([command, "--http-port", "0"]).http_port == 0
    assert not hasattr(build_parser(env={}).parse_args(["worker"]), "http_port")


@pytest.mark.parametrize(
    "second_prompt,status,param",
    [([5, 6, 7], 429, None), ([1, 10**8], 400, "prompt")],
    ids=["queue-full", "bad-token-id"],
)
def test_a_refused_later_prompt_withdraws_every_sequence_of_the_call(
    monkeypatch, second_prompt, status: int, param: str | None
) -> None:
    """/v1/completions with two prompts and n = 2: the first prompt's two sequences are queued,
    the second prompt is refused (the waiting queue is full by then, or a bad token id). The
    client gets the error object, and no sequence of the call stays queued or runs afterwards:
    every block of the worker is free again."""
    monkeypatch.setattr(worker_link.worker_pb2_grpc, "WorkerStub", sim_stub([]))

    async def scenario() -> tuple[httpx.Response, list[int]]:
        router = Router(SchedulerConfig(max_waiting=2, max_num_batched_tokens=32), max_inflight_steps=2)
        servicer = GenerationServicer(SchedulerServiceConfig(), router)
        router.on_events = servicer.on_events
        await router.start(["sim:1"])
        try:
            link = router.links[0]
            await wait_until_async(lambda: link.ready, 10, "the link to be ready")
            app = build_app(servicer)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                body = {"model": "toy", "prompt": [[1, 2, 3, 4], second_prompt], "n": 2, "max_tokens": 90}
                response = await client.post("/v1/completions", json=body)
            loads = [link.sched.num_unfinished()]
            await asyncio.sleep(0.3)  # ticks that would admit a leaked sequence
            loads += [link.sched.num_unfinished(), link.sched.block_pool.num_free, len(servicer.streams)]
            return response, loads
        finally:
            await router.close()

    response, (queued, unfinished_later, num_free, num_streams) = asyncio.run(scenario())
    assert_error(response, status, param)
    assert (queued, unfinished_later, num_streams) == (0, 0, 0)
    assert num_free == NUM_BLOCKS


def declared(model: type[ChatCompletionBody] | type[CompletionBody]) -> set[str]:
    """The top-level parameters a request model takes, as the wire spells them."""
    return {field.alias or name for name, field in model.model_fields.items()}


@pytest.mark.parametrize(("endpoint", "model"), [("chat", ChatCompletionBody), ("completions", CompletionBody)])
def test_the_request_models_declare_exactly_the_documented_parameters(endpoint: str, model: type) -> None:
    """A field added to a model without a row in docs/openai-api.md (or a row without a field)
    fails here; the rows' requests run in tests/services/test_openai_params.py."""
    assert declared(model) == openai_table.parameters(endpoint)


def test_the_documented_parameters_cover_the_openai_sdk() -> None:
    """Every parameter the installed `openai` SDK can send has a row: a new OpenAI parameter is
    decided in the table before a client can send it (and get "unknown parameter")."""
    from openai.types import completion_create_params as legacy
    from openai.types.chat import completion_create_params as chat

    for endpoint, params in (
        ("chat", chat.CompletionCreateParamsBase),
        ("completions", legacy.CompletionCreateParamsBase),
    ):
        sent = set(typing.get_type_hints(params)) | {"stream"}  # stream is on the subclasses
        assert sent <= openai_table.parameters(endpoint), sorted(sent - openai_table.parameters(endpoint))


def test_every_refused_example_is_400_naming_it_before_any_worker() -> None:
    """Refusals are decided by the body alone: without a worker they still come before the 503."""
    bases = {"chat": CHAT, "completions": {"model": "m", "prompt": "hi"}}
    for row in openai_table.rows():
        for endpoint in row.endpoints:
            response = call(
                "POST", f"/v1/{endpoint.replace('chat', 'chat/completions')}", json={**bases[endpoint], **row.example}
            )
            if row.status == "refused":
                assert_error(response, 400, row.name)
            else:
                assert_error(response, 503)


def test_a_prediction_maps_onto_the_proto_as_text() -> None:
    parts = {"type": "content", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}
    for prediction, text in ((parts, "Hello there"), ({"type": "content", "content": "Hi"}, "Hi")):
        (request,) = build_requests(ChatCompletionBody.model_validate({**CHAT, "prediction": prediction}), "p")
        assert request.prediction.text == text
        (completion,) = build_requests(CompletionBody.model_validate({"prompt": "a", "prediction": prediction}), "p")
        assert completion.prediction.text == text
    (none,) = build_requests(ChatCompletionBody.model_validate(CHAT), "p")
    assert not none.HasField("prediction")
