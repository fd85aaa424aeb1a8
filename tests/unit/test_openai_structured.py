"""OpenAI bodies that constrain the output become one `Constraint` on the `GenerateRequest`,
naming the client's parameter; conflicting or malformed ones are refused by name; a
conversation with tools reaches the chat template the way the template expects."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.sim_worker import make_toy_tokenizer_json
from zerobubble.request_options import from_proto
from zerobubble.scheduler_svc.openai_protocol import ChatCompletionBody, CompletionBody, ParamError, build_requests
from zerobubble.scheduler_svc.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time"}},
]
PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
TOOL_TEMPLATE = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}" + PLAIN_TEMPLATE


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def constraint(body: dict[str, Any], tokenizer: Tokenizer | None = None):
    model = ChatCompletionBody if "messages" in body else CompletionBody
    (request,) = build_requests(model.model_validate(body), "r", tokenizer)
    return from_proto(request.constraint) if request.HasField("constraint") else None


@pytest.mark.parametrize(
    ("fields", "kind", "field_name"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
            "json_schema",
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", "structured_outputs.json"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", "structured_outputs.json"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "structured_outputs.json_object"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar", "structured_outputs.grammar"),
        ({"guided_json": SCHEMA}, "json_schema", "guided_json"),
        ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", "guided_grammar"),
        ({"tools": TOOLS, "tool_choice": "required"}, "grammar", "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "grammar", "tools"),
    ],
)
def test_each_source_becomes_one_constraint_naming_its_parameter(fields: dict, kind: str, field_name: str) -> None:
    found = constraint(chat(**fields))
    assert found is not None
    assert (found.kind, found.field_name) == (kind, field_name)
    if kind == "json_schema":
        assert json.loads(found.value) == SCHEMA
    if kind == "choice":
        assert json.loads(found.value) == ["a", "b"]


@pytest.mark.parametrize(
    "fields",
    [{}, {"response_format": {"type": "text"}}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}],
)
def test_text_auto_and_none_leave_the_output_free(fields: dict) -> None:
    assert constraint(chat(**fields)) is None


def test_completions_take_constraints_too() -> None:
    found = constraint({"prompt": "x", "guided_choice": ["yes", "no"]})
    assert found is not None and found.kind == "choice"


@pytest.mark.parametrize(
    ("fields", "param", "also_named"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "response_format"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.choice",
            "structured_outputs.regex",
        ),
        ({"guided_json": SCHEMA, "structured_outputs": {"grammar": "x"}}, "guided_json", "structured_outputs.grammar"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "guided_regex"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tool_choice": "none"}, "tool_choice", "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "get_weather"),
    ],
)
def test_conflicting_or_malformed_sources_are_refused_by_name(fields: dict, param: str, also_named: str) -> None:
    with pytest.raises(ParamError) as caught:
        constraint(chat(**fields))
    assert caught.value.param == param
    assert param in str(caught.value) and also_named in str(caught.value)


def test_tools_reach_a_template_that_takes_them_as_a_variable() -> None:
    tokenizer = Tokenizer(make_toy_tokenizer_json(), TOOL_TEMPLATE)
    body = ChatCompletionBody.model_validate(chat(tools=TOOLS))
    (request,) = build_requests(body, "r", tokenizer)
    assert request.WhichOneof("input") == "prompt"
    assert request.prompt == "[get_weather][get_time]<user>hi"


def test_a_template_without_tools_gets_a_system_message_and_hermes_history() -> None:
    tokenizer = Tokenizer(make_toy_tokenizer_json(), PLAIN_TEMPLATE)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = ChatCompletionBody.model_validate({"messages": messages, "tools": TOOLS})
    (request,) = build_requests(body, "r", tokenizer)
    sent = [(m.role, m.content) for m in request.messages.messages]
    assert sent[0][0] == "system" and '"name": "get_time"' in sent[0][1]
    assert sent[1] == ("user", "hi")
    assert sent[2] == ("assistant", '<tool_call>\n{"name": "get_weather", "arguments": {"a": 1}}\n</tool_call>')
    assert sent[3] == ("user", "<tool_response>\nsunny\n</tool_response>")


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt() -> None:
    tokenizer = Tokenizer(make_toy_tokenizer_json(), PLAIN_TEMPLATE)
    body = ChatCompletionBody.model_validate(chat(tools=TOOLS, tool_choice="none"))
    (request,) = build_requests(body, "r", tokenizer)
    assert [(m.role, m.content) for m in request.messages.messages] == [("user", "hi")]
