"""The shipped `structured` workload: every row's schema is a valid JSON Schema that compiles
against the embedded model's tokenizer, and `zerobubble bench` sends it as the request's
constraint (or not, with --no-constraints)."""

from __future__ import annotations

import json

import jsonschema

from zerobubble.bench import load_dataset, row_request
from zerobubble.request_options import Constraint
from zerobubble.structured import GrammarChecker, to_grammar


def test_every_row_carries_a_schema_that_compiles(smollm2_dir):
    rows = load_dataset("structured")
    grounded = load_dataset("grounded")
    assert len(rows) == len(grounded) == 48
    tokenizer = (smollm2_dir / "tokenizer.json").read_text()
    checker = GrammarChecker(tokenizer, [2])
    for row, twin in zip(rows, grounded):
        assert row.schema is not None and row.kind == twin.kind and row.max_tokens == twin.max_tokens
        jsonschema.Draft202012Validator.check_schema(row.schema)
        checker.check(to_grammar(Constraint("json_schema", json.dumps(row.schema))), "schema")
        request = row_request(row)
        assert json.loads(request.constraint.json_schema) == row.schema


def test_no_constraints_sends_the_same_rows_unconstrained(tmp_path):
    from zerobubble.entrypoints.cli import build_parser

    args = build_parser(env={}).parse_args(["bench", "--dataset", "structured", "--no-constraints"])
    assert args.constraints is False
    assert build_parser(env={}).parse_args(["bench", "--dataset", "structured"]).constraints is True
