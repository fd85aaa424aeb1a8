"""Hermes tool calls read out of hand-written outputs, whole and streamed delta by delta, and
conversations with tools rendered for templates that do and do not take a ``tools`` variable."""

from __future__ import annotations

import json

import pytest

from tests.support.sim_worker import make_toy_tokenizer_json
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.scheduler_svc.tool_calls import ToolCallParser, call_text, parse, parse_call, system_prompt

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
TIME = '{"name": "get_time", "arguments": {}}'


def block(inside: str) -> str:
    return f"<tool_call>\n{inside}\n</tool_call>"


def streamed(text: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of ``text`` fed ``size`` characters at a time."""
    parser = ToolCallParser()
    pieces = [parser.feed(text[i : i + size])[0] for i in range(0, len(text), size)]
    content = "".join(pieces) + parser.finish()
    return content or None, [(c.name, c.arguments) for c in parser.calls]


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse(text)
    return content, [(c.name, c.arguments) for c in calls]


def test_text_without_calls_is_content_unchanged() -> None:
    text = "  It is sunny in Paris.\n\nBring <tools> anyway. "
    assert parse(text) == (text, [])


def test_one_call_alone_has_no_content() -> None:
    content, calls = parse(block(WEATHER))
    assert content is None
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "c"}


def test_text_around_calls_is_content_and_every_call_is_read() -> None:
    text = f"Let me check.\n{block(WEATHER)}\n{block(TIME)}\nDone."
    content, calls = whole(text)
    assert content == "Let me check.Done."
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1][1]) == {}


@pytest.mark.parametrize(
    "inside",
    [
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut inside the JSON
        "not json at all",
        '{"arguments": {}}',  # no name
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '["get_weather"]',
    ],
)
def test_a_block_that_is_no_call_stays_content(inside: str) -> None:
    text = f"Sure: {block(inside)} then {block(WEATHER)}"
    content, calls = whole(text)
    assert content is not None and block(inside) in content
    assert [name for name, _ in calls] == ["get_weather"]


def test_an_unfinished_block_at_the_end_is_content() -> None:
    text = 'Calling <tool_call>\n{"name": "get_weather", "argum'
    assert parse(text) == (text, [])


def test_arguments_as_json_text_or_under_parameters_are_read() -> None:
    as_text = parse_call('{"name": "f", "arguments": "{\\"x\\": 1}"}')
    as_parameters = parse_call('{"name": "f", "parameters": {"x": 1}}')
    assert as_text is not None and as_parameters is not None
    assert json.loads(as_text.arguments) == json.loads(as_parameters.arguments) == {"x": 1}


def test_every_call_gets_its_own_id() -> None:
    _, calls = parse(block(WEATHER) + block(WEATHER))
    assert len({c.id for c in calls}) == 2
    assert all(c.id.startswith("call_") for c in calls)
    assert calls[0].to_openai(0) == {"index": 0, **calls[0].to_openai()}
    assert calls[0].to_openai()["type"] == "function"


TEXTS = [
    "plain text, no calls ",
    block(WEATHER),
    f"Let me check.\n{block(WEATHER)}\n{block(TIME)}",
    f"a <tool_call> b {block('{bad json')} c",
    "ends with a partial tag <tool_ca",
    'Calling <tool_call>\n{"name": "get_weather"',
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_streaming_gives_what_the_whole_text_gives(text: str, size: int) -> None:
    assert streamed(text, size) == whole(text)


def test_streamed_content_holds_back_only_what_may_start_a_call() -> None:
    parser = ToolCallParser()
    assert parser.feed("Hello <tool")[0] == "Hello"
    assert parser.feed("s are here")[0] == " <tools are here"
    assert parser.finish() == ""


def test_an_earlier_call_is_written_as_the_model_writes_one() -> None:
    call = parse_call(
        call_text("get_weather", '{"city": "Paris"}').removeprefix("<tool_call>").removesuffix("</tool_call>")
    )
    assert call is not None and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %} CALL {{ c.function.name }}"
    "({{ c.function.arguments.city }}){% endfor %}{% endif %}\n{% endfor %}"
)


def test_a_template_that_takes_tools_renders_them_and_earlier_calls() -> None:
    tokenizer = Tokenizer(make_toy_tokenizer_json(), TOOL_TEMPLATE)
    assert tokenizer.template_takes_tools
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
    ]
    text = tokenizer.render_chat_template(messages, tools=TOOLS)
    assert text.startswith("TOOLS:get_weather;")
    assert "CALL get_weather(Oslo)" in text


def test_a_template_without_tools_is_told_about_them_in_a_system_message() -> None:
    assert not Tokenizer(
        make_toy_tokenizer_json(), "{% for m in messages %}{{ m.content }}{% endfor %}"
    ).template_takes_tools
    text = system_prompt(TOOLS)
    assert json.dumps(TOOLS[0]) in text
    assert "<tool_call>" in text and "</tool_call>" in text
