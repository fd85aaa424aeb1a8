"""Structured output: a request's constraint, the grammar it compiles to, and the check that
refuses a bad one before the request is queued.

A constraint (JSON schema, any JSON object, regex, choice, grammar, or a forced tool call)
becomes one llguidance grammar text here, on the scheduler side, once per request; the worker
only ever sees that text (`SamplingParams.grammar`) and builds a matcher from it
(`zerobubble.worker_svc.grammar`). llguidance needs no torch, so the scheduler can check
grammars against the served model's tokenizer without importing the model runtime.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from zerobubble.request_options import CONSTRAINT_KINDS, Constraint, InvalidRequest, require, shown

__all__ = ["Constraint", "GrammarChecker", "to_grammar", "tool_call_grammar"]

MAX_CONSTRAINT_CHARS = 256_000  # of a schema, regex, grammar or all choices together
MAX_CHOICES = 1024

# JSON is emitted compactly (", " and ": ", no free whitespace): a free whitespace rule lets a
# small model spend its whole budget on newlines, and the compact form is what models emit most.
JSON_OPTIONS = {"whitespace_flexible": False}

# Hermes-style tool calls, the format of Qwen's and SmolLM's chat templates.
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"


def to_grammar(constraint: Constraint) -> str:
    """The llguidance grammar text of ``constraint``; :class:`InvalidRequest` naming its field
    when it is malformed (a schema that is not JSON, an empty choice list, ...). Whether the
    grammar compiles is `GrammarChecker.check`'s question."""
    import llguidance

    name, kind, value = constraint.field, constraint.kind, constraint.value
    require(kind in CONSTRAINT_KINDS, f"{name}: unknown constraint kind {shown(kind)}")
    require(len(value) <= MAX_CONSTRAINT_CHARS, f"{name}: longer than {MAX_CONSTRAINT_CHARS} characters")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_schema":
        return _schema_grammar(value, name)
    if kind == "regex":
        require(bool(value), f"{name}: the regex is empty")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        choices = json.loads(value)
        require(0 < len(choices) <= MAX_CHOICES, f"{name}: must list 1 to {MAX_CHOICES} choices")
        require(all(isinstance(c, str) and c for c in choices), f"{name}: every choice must be a non-empty string")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    require(bool(value.strip()), f"{name}: the grammar is empty")
    try:
        return llguidance.grammar_from("grammar", value)
    except ValueError as exc:
        raise InvalidRequest(f"{name}: {exc}") from exc


def _schema_grammar(text: str, name: str) -> str:
    import llguidance

    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{name}: the schema is not valid JSON ({exc.msg} at character {exc.pos})") from exc
    require(isinstance(schema, (dict, bool)), f"{name}: the schema must be a JSON object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequest(f"{name}: {exc}") from exc


def tool_call_grammar(
    tools: list[dict], name: str | None = None, field_name: str = "tools", parallel: bool = True
) -> Constraint:
    """A grammar constraint forcing Hermes-style tool calls (``<tool_call>\\n{"name": ...,
    "arguments": {...}}\\n</tool_call>``, one or more): of the function ``name``, or of any
    of ``tools`` (OpenAI's ``{"type": "function", "function": {"name", "parameters"}}``);
    several calls only of any tool and ``parallel``."""
    options = []
    for tool in tools:
        function = tool.get("function", {})
        if name is not None and function.get("name") != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.get("name", "")}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    require(bool(options), f"tool_choice: no tool named {shown(name)} in tools")
    # Compact JSON, as for a schema constraint (the options go at the schema's top level).
    schema = json.dumps({**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": JSON_OPTIONS})
    call = f"{json.dumps(TOOL_CALL_OPEN)} %json {schema} {json.dumps(TOOL_CALL_CLOSE)}"
    # A named function is called once; "required" allows several calls, one after another.
    start = "call" if name is not None or not parallel else 'call ("\\n" call)*'
    return Constraint("grammar", f"start: {start}\ncall: {call}\n", field_name)


class GrammarChecker:
    """Checks grammars against one tokenizer, remembering each distinct text's verdict.

    Thread-safe: `check` is meant to run off the event loop (`asyncio.to_thread`), since a
    large grammar can take a while to compile.
    """

    def __init__(self, tokenizer_json: str, eos_token_ids: list[int], max_entries: int = 1024) -> None:
        self.tokenizer_json = tokenizer_json
        self.eos_token_ids = list(eos_token_ids)
        self.max_entries = max_entries
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on the first check
        self._verdicts: OrderedDict[str, str] = OrderedDict()
        self._compiled: OrderedDict[Constraint, str] = OrderedDict()  # checked grammars
        self._lock = threading.Lock()

    def known(self, constraint: Constraint) -> bool:
        """Whether ``constraint`` was compiled and checked already (a hit needs no thread)."""
        with self._lock:
            return constraint in self._compiled

    def compile(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint`` (`to_grammar`, then `check`), remembered per
        constraint; :class:`InvalidRequest` naming its field when it is bad."""
        with self._lock:
            grammar = self._compiled.get(constraint)
        if grammar is not None:
            return grammar
        grammar = to_grammar(constraint)
        self.check(grammar, constraint.field)
        with self._lock:
            self._compiled[constraint] = grammar
            if len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return grammar

    def check(self, grammar: str, field: str) -> None:
        """:class:`InvalidRequest` naming ``field`` if ``grammar`` does not compile."""
        import llguidance

        with self._lock:
            verdict = self._verdicts.get(grammar)
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, eos_token=self.eos_token_ids or None)
            tokenizer = self._tokenizer
        if verdict is None:
            verdict = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
            with self._lock:
                self._verdicts[grammar] = verdict
                if len(self._verdicts) > self.max_entries:
                    self._verdicts.popitem(last=False)
        require(not verdict, f"{field}: {verdict.strip()}")
