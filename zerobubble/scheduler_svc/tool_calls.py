"""Hermes-style tool calls: how a conversation with tools becomes the model's prompt, and how
the calls are read back out of the model's output.

The format is the one Qwen's and Hermes' chat templates teach (and SmolLM2 follows when told):
each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` lines; tool results go back as ``<tool_response>`` blocks. A template that
takes a ``tools`` variable renders the tools itself (`Tokenizer.template_takes_tools`); for one
that does not, the tools and the format are described in a system message, so that even
``tool_choice: "auto"`` has a chance.

One parser (`ToolCallParser`) serves both replies: fed the whole text at once, or delta by delta
while streaming, it gives the same content and the same calls. A block whose JSON does not
parse is not a call: its text stays in the content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zerobubble.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

OPEN_TAG = TOOL_CALL_OPEN.strip()
CLOSE_TAG = TOOL_CALL_CLOSE.strip()

_SYSTEM_PROMPT = (
    "Tools are available to you. Each line between <tools> and </tools> describes one, as JSON:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To use a tool, answer with its name and arguments as a JSON object between <tool_call> and "
    "</tool_call>, one block per use:\n"
    '<tool_call>\n{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    ``arguments`` a JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The reply's tool-call object; with ``index``, a streamed ``delta.tool_calls`` entry."""
        entry: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return entry if index is None else {"index": index, **entry}


def system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text describing ``tools`` (OpenAI function tools) and the call format, for a
    chat template that does not render tools itself."""
    return _SYSTEM_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def call_text(name: str, arguments: Any) -> str:
    """An earlier assistant call as the model would have written it (``arguments``: a JSON
    text or an object)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # kept as the client sent it
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def response_text(content: str) -> str:
    """A tool's result as Hermes-style templates give it back to the model."""
    return f"<tool_response>\n{content}\n</tool_response>"


def parse_call(block: str) -> ToolCall | None:
    """The call a ``<tool_call>`` block's inside stands for; None when it is not one (not JSON,
    no name, arguments that are not an object)."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    # Some fine-tunes write "parameters" where Hermes writes "arguments".
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass(slots=True)
class ToolCallParser:
    """Splits output text into content and tool calls, delta by delta.

    `feed` returns the content that is safe to send (text that cannot be part of a call any
    more) and the calls completed by the delta; `finish` returns what was held back. Whitespace
    next to a call is not content, so a reply of calls alone has none; an output without calls
    comes back unchanged.
    """

    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""  # text not yet classified: a possible opening tag, or an open block
    _inside: bool = False  # the buffer is the inside of an open <tool_call> block
    _space: str = ""  # whitespace held back: content only if more content follows it
    _block_space: str = ""  # the whitespace before the open block, content if it is no call
    _after_call: bool = False  # whitespace now follows a call: not content

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Content safe to send now, and the calls completed by ``text``."""
        self._buffer += text
        out: list[str] = []
        new_calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    break
                block, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG) :]
                self._inside = False
                call = parse_call(block)
                if call is None:  # not a call after all: the block is content
                    self._space = self._block_space
                    out.append(self._content(OPEN_TAG + block + CLOSE_TAG))
                else:
                    new_calls.append(call)
                    self.calls.append(call)
                    self._after_call = True
                continue
            start = self._buffer.find(OPEN_TAG)
            if start < 0:
                keep = _partial_tag_length(self._buffer)
                out.append(self._content(self._buffer[: len(self._buffer) - keep]))
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            out.append(self._content(self._buffer[:start]))
            self._block_space, self._space = self._space, ""
            self._buffer = self._buffer[start + len(OPEN_TAG) :]
            self._inside = True
        return "".join(out), new_calls

    def finish(self) -> str:
        """The content held back at the end of the output (an unfinished block is content)."""
        if self._inside:
            self._space = self._block_space
            self._buffer = OPEN_TAG + self._buffer
        text = self._content(self._buffer)
        if not self.calls:
            text += self._space
        self._buffer, self._inside, self._space = "", False, ""
        return text

    def _content(self, text: str) -> str:
        """``text`` as content, after the held whitespace; its own trailing whitespace is held."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        held, self._space = self._space, text[len(body) :]
        return held + body


def _partial_tag_length(text: str) -> int:
    """Length of the longest end of ``text`` that an opening tag could still start with."""
    for size in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content (None when empty) and tool calls of a whole output."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    content += parser.finish()
    return content or None, parser.calls
