"""`zerobubble generate`'s structured-output flags: at most one, each a constraint named by its
flag (the server's error messages then name the flag)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerobubble.client import request_from_args
from zerobubble.entrypoints.cli import build_parser
from zerobubble.request_options import from_proto

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def constraint_of(*flags: str):
    args = build_parser(env={}).parse_args(["generate", "--prompt", "x", *flags])
    request = request_from_args(args)
    return from_proto(request.constraint) if request.HasField("constraint") else None


def test_no_flag_no_constraint() -> None:
    assert constraint_of() is None


def test_json_schema_as_text_or_file(tmp_path: Path) -> None:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for value in (json.dumps(SCHEMA), str(path)):
        found = constraint_of("--json-schema", value)
        assert found is not None and (found.kind, found.field_name) == ("json_schema", "--json-schema")
        assert json.loads(found.value) == SCHEMA


def test_choices_split_on_commas_and_repeat() -> None:
    found = constraint_of("--choice", "yes,no", "--choice", "maybe")
    assert found is not None and json.loads(found.value) == ["yes", "no", "maybe"]


def test_regex_and_grammar(tmp_path: Path) -> None:
    regex = constraint_of("--regex", "[0-9]+")
    assert regex is not None and (regex.kind, regex.value, regex.field_name) == ("regex", "[0-9]+", "--regex")
    path = tmp_path / "g.lark"
    path.write_text('start: "a"\n')
    grammar = constraint_of("--grammar", str(path))
    assert grammar is not None and (grammar.kind, grammar.value) == ("grammar", 'start: "a"\n')


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--regex", "a", "--choice", "b"), "--regex and --choice"),
        (("--json-schema", "{not json"), "--json-schema: not valid JSON"),
        (("--json-schema", "/no/such/file"), "--json-schema: neither JSON nor a readable file"),
        (("--grammar", "/no/such/file"), "--grammar: cannot read"),
    ],
)
def test_bad_flags_are_clear_errors(flags: tuple[str, ...], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        constraint_of(*flags)
