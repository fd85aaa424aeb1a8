"""Structured output and tool calls end to end: a real worker (SmolLM2, n-gram speculation) and a
real scheduler (async, 2 steps in flight) driven by the official `openai` client, the gRPC client
and `zerobubble generate`.

The oracles are outside our code: `jsonschema` for schemas and tool arguments, `re.fullmatch`
for regexes and grammars (each grammar here describes a regular language), membership for
choices. Every refusal is a 400 naming the parameter, and once everything ran the scheduler
holds no KV block.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from tests.support.metrics_scrape import wait_all_released
from tests.support.servers import Service, serving
from zerobubble.client import build_request, complete
from zerobubble.request_options import Constraint

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m"
MAX_TOKENS = 48
ASK = [{"role": "user", "content": "Describe a person who lives in Paris."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lyon", "Nice"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def scheduler(smollm2_dir) -> Iterator[Service]:
    with serving(
        dict(kv_cache_memory_gb=0.25, max_num_seqs=8, spec_method="ngram", num_spec_tokens=3),
        max_inflight_steps=2,
        max_num_seqs=8,
    ) as sched:
        yield sched


@pytest.fixture(scope="module")
def client(scheduler: Service) -> openai.OpenAI:
    base_url = f"http://127.0.0.1:{scheduler.ports['HTTP']}/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, stream: bool, messages: list[dict] = ASK, **options: Any) -> tuple[str, str, list]:
    """(content, finish reason, tool calls as (name, arguments)) of one greedy chat completion."""
    options = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **options}
    if not stream:
        choice = client.chat.completions.create(**options).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content or "", choice.finish_reason, calls
    content, reason, calls = [], None, {}
    for chunk in client.chat.completions.create(stream=True, **options):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    return "".join(content), reason, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_output_validates(client: openai.OpenAI, stream: bool) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    text, reason, calls = chat(client, stream, response_format=fmt)
    assert reason == "stop" and calls == []
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_object_output_is_an_object(client: openai.OpenAI, stream: bool) -> None:
    text, reason, _ = chat(client, stream, response_format={"type": "json_object"})
    assert reason == "stop"
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "extra",
    [{"structured_outputs": {"json": PERSON}}, {"guided_json": json.dumps(PERSON)}],
    ids=["structured_outputs", "guided_json_text"],
)
def test_vllm_json_extras_validate(client: openai.OpenAI, extra: dict) -> None:
    text, reason, _ = chat(client, False, extra_body=extra)
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


PHONE = r"\+33 [1-9]( [0-9]{2}){4}"


@pytest.mark.parametrize(
    ("stream", "extra"),
    [(False, {"structured_outputs": {"regex": PHONE}}), (True, {"guided_regex": PHONE})],
    ids=["whole", "streamed"],
)
def test_regex_output_matches_whole(client: openai.OpenAI, stream: bool, extra: dict) -> None:
    question = [{"role": "user", "content": "Give me a phone number in Paris."}]
    text, reason, _ = chat(client, stream, messages=question, extra_body=extra)
    assert reason == "stop"
    assert re.fullmatch(PHONE, text), text


COLORS = ["red", "green", "blue", "dark purple"]


@pytest.mark.parametrize(
    ("stream", "extra"),
    [(False, {"structured_outputs": {"choice": COLORS}}), (True, {"guided_choice": COLORS})],
    ids=["whole", "streamed"],
)
def test_choice_output_is_one_of_the_choices(client: openai.OpenAI, stream: bool, extra: dict) -> None:
    question = [{"role": "user", "content": "What color is the sky?"}]
    text, reason, _ = chat(client, stream, messages=question, extra_body=extra)
    assert reason == "stop"
    assert text in COLORS


# Each grammar describes a regular language, so a regex is its oracle.
LARK = 'start: "Answer: " VERDICT " (" NUM "%)"\nVERDICT: "yes" | "no" | "maybe"\nNUM: /[0-9]{1,2}/\n'
LARK_LANGUAGE = r"Answer: (yes|no|maybe) \([0-9]{1,2}%\)"
GBNF = 'root ::= "Weather: " kind ", " temp "C"\nkind ::= "sunny" | "rainy" | "cloudy"\ntemp ::= [0-9] [0-9]?\n'
GBNF_LANGUAGE = r"Weather: (sunny|rainy|cloudy), [0-9][0-9]?C"


@pytest.mark.parametrize(
    ("stream", "extra", "language"),
    [
        (False, {"structured_outputs": {"grammar": LARK}}, LARK_LANGUAGE),
        (True, {"guided_grammar": GBNF}, GBNF_LANGUAGE),
    ],
    ids=["lark", "gbnf-streamed"],
)
def test_grammar_output_is_in_the_language(client: openai.OpenAI, stream: bool, extra: dict, language: str) -> None:
    text, reason, _ = chat(client, stream, messages=WEATHER_QUESTION, extra_body=extra)
    assert reason == "stop"
    assert re.fullmatch(language, text), text


def test_a_constrained_reply_cut_by_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    text, reason, _ = chat(client, False, max_tokens=4, extra_body={"guided_regex": "[a-z ]{40,60}"})
    assert reason == "length"
    assert re.fullmatch("[a-z ]*", text), text


def test_completions_take_a_constraint(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The year Paris hosted the Olympics:", max_tokens=8, temperature=0,
        extra_body={"guided_regex": "1[89][0-9]{2}"},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch("1[89][0-9]{2}", reply.choices[0].text)


def assert_valid_call(calls: list[tuple[str, str]], name: str | None = None) -> None:
    assert len(calls) == 1, calls
    called, arguments = calls[0]
    (tool,) = [t["function"] for t in TOOLS if t["function"]["name"] == called]
    assert name is None or called == name
    jsonschema.validate(json.loads(arguments), tool["parameters"])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_are_valid_and_stream_the_same(client: openai.OpenAI, tool_choice: Any) -> None:
    options = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False, "max_tokens": 64}
    whole = chat(client, False, messages=WEATHER_QUESTION, **options)
    streamed = chat(client, True, messages=WEATHER_QUESTION, **options)
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    for content, reason, calls in (whole, streamed):
        assert reason == "tool_calls"
        assert content == ""  # no raw <tool_call> text beside the calls
        assert_valid_call(calls, named)
    assert streamed[2] == whole[2]  # greedy: the same call, whole or reassembled from deltas


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    for stream in (False, True):
        content, reason, calls = chat(client, stream, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="none")
        assert calls == [] and reason in ("stop", "length")
        assert content and "<tool_call>" not in content


def test_history_with_tool_calls_and_results_is_accepted(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 21}'},
    ]
    content, reason, calls = chat(client, False, messages=history, tools=TOOLS, max_tokens=16)
    assert reason in ("stop", "length", "tool_calls")
    assert content or calls


PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
ERRORS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structured_outputs.structural_tag"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": PERSON_FORMAT, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a+", "choice": ["a"]}}}, "structured_outputs.choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools"),
]  # fmt: skip


@pytest.mark.parametrize(("options", "param"), ERRORS, ids=[p for _, p in ERRORS])
def test_bad_constraints_are_a_400_naming_the_parameter(client: openai.OpenAI, options: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **options)
    error = caught.value.body
    assert isinstance(error, dict), error
    assert error["param"].replace("[", ".").replace("]", "") == param, error
    assert error["message"].startswith(f"{error['param']}: "), error


def test_a_conflict_names_both_parameters(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=ASK, response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}
        )
    message = caught.value.body["message"]  # type: ignore[index]
    assert "guided_choice" in message and "response_format" in message


def test_grpc_client_takes_a_constraint(scheduler: Service) -> None:
    async def run() -> tuple[str, str, grpc.StatusCode | None]:
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            request = build_request(
                messages=ASK, max_tokens=MAX_TOKENS, constraint=Constraint("json_schema", json.dumps(PERSON))
            )
            done = await complete(channel, request)
            bad = build_request(prompt="x", constraint=Constraint("regex", "[", "my_regex"))
            try:
                await complete(channel, bad)
            except grpc.aio.AioRpcError as exc:
                assert exc.details().startswith("my_regex: "), exc.details()
                return done.text, done.finish_reason, exc.code()
            return done.text, done.finish_reason, None

    text, reason, refused = asyncio.run(run())
    assert reason == "eos"
    jsonschema.validate(json.loads(text), PERSON)
    assert refused == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_command_takes_a_choice(scheduler: Service, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "zerobubble", "generate", "--target", scheduler.target, "--json", "--chat"]
    ask = ["--prompt", "Is the sky blue?", "--max-tokens", "8"]
    out = subprocess.run(
        [*base, *ask, "--choice", "yes,no", "--choice", "maybe"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["text"] in ("yes", "no", "maybe") and reply["finish_reason"] == "eos"
    grammar = tmp_path / "bad.lark"
    grammar.write_text("start: nowhere\n")
    out = subprocess.run([*base, *ask, "--grammar", str(grammar)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "INVALID_ARGUMENT: --grammar: " in out.stderr, out.stderr


def test_nothing_is_left_holding_kv_blocks(client: openai.OpenAI, scheduler: Service) -> None:
    # A constrained stream left early is aborted like any other.
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=MAX_TOKENS, stream=True, response_format={"type": "json_object"}
    )
    next(iter(stream))
    stream.close()
    wait_all_released(scheduler.ports["METRICS"])
