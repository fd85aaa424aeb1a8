"""Structured-output test cases: JSON schemas (nested objects, bounded arrays, enums, `anyOf`,
patterns, bounded numbers, closed objects), regexes and choices, each with a chat prompt.

The schemas are built from a few subjects crossed with the schema features, so that every
feature meets several shapes; every string and array is bounded, so a constrained output always
ends within the tests' token budget.
"""

from __future__ import annotations

import json
from typing import Any

from zerobubble.structured import Constraint, to_grammar

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT = {"type": "string", "maxLength": 16}
YEAR = {"type": "integer", "minimum": 1800, "maximum": 2030}
SCORE = {"type": "number", "minimum": 0, "maximum": 10}
COUNT = {"type": "integer", "minimum": 0, "maximum": 999}
CAPITALIZED = {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}
DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}

SUBJECTS: dict[str, dict[str, Any]] = {
    "person": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "book": {"title": NAME, "year": YEAR},
    "city": {"name": NAME, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
    "movie": {"title": NAME, "rating": SCORE},
    "product": {"name": NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000}},
    "recipe": {"dish": NAME, "minutes": {"type": "integer", "minimum": 1, "maximum": 600}},
    "car": {"make": NAME, "year": YEAR},
    "planet": {"name": NAME, "moons": COUNT},
    "song": {"title": NAME, "seconds": {"type": "integer", "minimum": 1, "maximum": 900}},
    "company": {"name": NAME, "founded": YEAR},
}

ENUMS = {
    "person": ["student", "teacher", "engineer", "artist"],
    "book": ["fiction", "history", "science", "poetry"],
    "city": ["Europe", "Asia", "Africa", "America", "Oceania"],
    "movie": ["comedy", "drama", "action", "horror"],
    "product": ["food", "tool", "toy", "clothing"],
    "recipe": ["easy", "medium", "hard"],
    "car": ["red", "blue", "black", "white"],
    "planet": ["rocky", "gas", "ice"],
    "song": ["pop", "rock", "jazz", "folk"],
    "company": ["tech", "retail", "energy", "finance"],
}


def _closed(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _features(subject: str) -> list[dict[str, Any]]:
    """Five schemas of one subject, one per feature mix."""
    base = SUBJECTS[subject]
    return [
        _closed(dict(base)),
        _closed({**base, "kind": {"enum": ENUMS[subject]}}),
        _closed({**base, "tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
        _closed({**base, "details": _closed({"note": SHORT, "code": {"anyOf": [COUNT, CAPITALIZED]}})}),
        _closed({**base, "label": CAPITALIZED, "date": DATE}),
    ]


def schema_cases() -> list[tuple[str, dict[str, Any]]]:
    """(prompt, schema) pairs: 50 distinct schemas, plus a list of objects and a top-level anyOf."""
    cases = []
    for subject in SUBJECTS:
        for schema in _features(subject):
            cases.append((f"Describe one {subject} as a JSON object.", schema))
    cases.append(
        (
            "List two famous people as JSON.",
            {"type": "array", "items": _closed(SUBJECTS["person"]), "minItems": 1, "maxItems": 2},
        )
    )
    cases.append(
        ("Give me a book or a movie as JSON.", {"anyOf": [_closed(SUBJECTS["book"]), _closed(SUBJECTS["movie"])]})
    )
    return cases


REGEX_CASES = [
    ("What is today's date? Answer as YYYY-MM-DD.", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("Give a phone number.", r"\(\d{3}\) \d{3}-\d{4}"),
    ("Is water wet? Answer yes or no.", r"(yes|no)\."),
    ("Name a color in lowercase letters.", r"[a-z]{3,10}"),
    ("Write an email address for Alice.", r"[a-z]{2,10}@[a-z]{2,10}\.(com|org|net)"),
]

CHOICE_CASES = [
    ("Is the sky blue? Answer Yes or No.", ["Yes", "No"]),
    ("Pick the largest animal.", ["cat", "whale", "mouse"]),
    ("What is the sentiment of 'I love it'?", ["positive", "negative", "neutral"]),
]


def schema_text(schema: dict[str, Any]) -> str:
    return json.dumps(schema)


def grammar_of(kind: str, value: object) -> str:
    text = schema_text(value) if kind == "json_schema" else json.dumps(value) if kind == "choice" else str(value)
    return to_grammar(Constraint(kind, text))
