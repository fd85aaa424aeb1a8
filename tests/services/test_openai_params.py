"""Every parameter of docs/openai-api.md against the real HTTP front (SmolLM2 worker, scheduler
process): each row's example gets its status (implemented and ignored: 200; refused: a 400 whose
`param` and message name it), and the behaviour of the parameters decided here: `echo` starts
each choice with its prompt, a `prediction` leaves the greedy output as it is, and the usage
carries OpenAI's completion token details, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from tests.support import openai_table
from tests.support.servers import Service, serving
from zerobubble.api import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.timeout(1200)

MODEL = "smollm2-135m"
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
PROMPT = "The three primary colors are"
BASES = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2, "temperature": 0}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}),
}
DETAILS = {"reasoning_tokens", "audio_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens"}


@pytest.fixture(scope="module")
def scheduler(smollm2_dir) -> Iterator[Service]:
    with serving(dict(kv_cache_memory_gb=0.5, max_num_seqs=8, spec_method="ngram", num_spec_tokens=3)) as sched:
        yield sched


@pytest.fixture(scope="module")
def http(scheduler: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://127.0.0.1:{scheduler.ports['HTTP']}", timeout=300) as client:
        yield client


def events(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a streamed reply, checked to end with [DONE]."""
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", response.text
    return [json.loads(line) for line in lines[:-1]]


CASES = [(row, endpoint) for row in openai_table.rows() for endpoint in row.endpoints]


@pytest.mark.parametrize(("row", "endpoint"), CASES, ids=[f"{e}-{r.name}" for r, e in CASES])
def test_every_documented_parameter_gets_its_status(http, row: openai_table.Row, endpoint: str) -> None:
    path, base = BASES[endpoint]
    response = http.post(path, json={**base, **row.example})
    if row.status == "refused":
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == row.name and row.name in error["message"], error
        return
    assert response.status_code == 200, response.text
    if row.example.get("stream"):
        assert all("error" not in event for event in events(response)), response.text
    else:
        reply = response.json()
        assert reply["choices"] and all(c["finish_reason"] for c in reply["choices"]), reply


def test_unknown_parameters_are_400_naming_them(http) -> None:
    for path, base in BASES.values():
        response = http.post(path, json={**base, "chat_template_kwargs": {"enable_thinking": False}})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs"


def tokenize(scheduler: Service, text: str) -> list[int]:
    async def run() -> list[int]:
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            reply = await generate_pb2_grpc.GenerationStub(channel).Tokenize(generate_pb2.TokenizeRequest(prompt=text))
            return list(reply.token_ids)

    return asyncio.run(run())


def test_echo_starts_each_choice_with_its_prompt(http, scheduler) -> None:
    path, base = BASES["completions"]
    body = {**base, "max_tokens": 6}
    alone = http.post(path, json=body).json()
    plain = alone["choices"][0]["text"]
    ids = tokenize(scheduler, PROMPT)
    echoed = http.post(path, json={**body, "echo": True, "prompt": [PROMPT, PROMPT], "n": 2}).json()
    assert [c["text"] for c in echoed["choices"]] == [PROMPT + plain] * 4
    # Token ids are decoded as they are: the prompt's tokens render its text back.
    from_ids = http.post(path, json={**body, "echo": True, "prompt": ids}).json()
    assert from_ids["choices"][0]["text"] == PROMPT + plain
    streamed = events(http.post(path, json={**body, "echo": True, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in streamed if e["choices"]) == PROMPT + plain
    # The echoed prompt is no completion token.
    assert echoed["usage"]["completion_tokens"] == 4 * alone["usage"]["completion_tokens"]


def test_a_prediction_leaves_the_greedy_output_and_usage_counts_it(http) -> None:
    path, base = BASES["chat"]
    body = {**base, "max_tokens": 16}
    reply = http.post(path, json=body).json()
    text = reply["choices"][0]["message"]["content"]
    details = reply["usage"]["completion_tokens_details"]
    assert set(details) == DETAILS and not any(details.values()), details
    predictions = [
        {"type": "content", "content": text},  # right
        {"type": "content", "content": [{"type": "text", "text": "The sea "}, {"type": "text", "text": "is blue."}]},
        {"type": "content", "content": "Unrelated words entirely, " * 8},  # wrong
    ]
    for i, prediction in enumerate(predictions):
        predicted = http.post(path, json={**body, "prediction": prediction}).json()
        assert predicted["choices"][0]["message"]["content"] == text
        usage = predicted["usage"]
        assert usage["completion_tokens"] == reply["usage"]["completion_tokens"]
        counted = usage["completion_tokens_details"]
        assert set(counted) == DETAILS and counted["accepted_prediction_tokens"] <= usage["completion_tokens"]
        assert counted["reasoning_tokens"] == counted["audio_tokens"] == 0
        if i == 0:
            # The reply itself, predicted: drafted from and accepted for most of its tokens.
            assert counted["accepted_prediction_tokens"] >= usage["completion_tokens"] // 2, counted
    stream = {**body, "prediction": predictions[0], "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(http.post(path, json=stream))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == text
    streamed_details = chunks[-1]["usage"]["completion_tokens_details"]
    assert set(streamed_details) == DETAILS and streamed_details["accepted_prediction_tokens"] > 0


def test_a_prediction_on_completions_sums_over_the_choices(http) -> None:
    path, base = BASES["completions"]
    body = {**base, "max_tokens": 8, "n": 2}
    plain = http.post(path, json=body).json()
    text = plain["choices"][0]["text"]
    predicted = http.post(path, json={**body, "prediction": {"type": "content", "content": text}}).json()
    assert [c["text"] for c in predicted["choices"]] == [text, text]
    usage = predicted["usage"]
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert 0 < usage["completion_tokens_details"]["accepted_prediction_tokens"] <= usage["completion_tokens"]


def test_seeds_at_the_ends_of_the_signed_64_bit_range_are_taken(http) -> None:
    path, base = BASES["chat"]
    for seed in (2**63 - 1, -(2**63)):
        body = {**base, "temperature": 1.0, "seed": seed}
        first, again = (http.post(path, json=body).json() for _ in range(2))
        assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
