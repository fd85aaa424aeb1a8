"""Predicted outputs (OpenAI's `prediction`) as drafts, through the real Scheduler and runner.

The oracle is the same request without its prediction: greedy and seeded output must be
identical token for token, sync and async, with no proposer, with n-gram and with an EAGLE head,
with a JSON-schema constraint, and for a prediction wrong from its first token, on rows of the
shipped `edits` workload (every row, in the slow test). That the prediction was used at all is
read from the scheduler's counts of accepted prediction drafts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.support.drive import run_job
from tests.support.structured_cases import grammar_of
from zerobubble.scheduler_svc.scheduler import SchedulerStats
from zerobubble.scheduler_svc.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 48
MODES = [("plain", 1), ("plain", 2), ("ngram", 2), ("eagle", 2), ("draft", 2)]
# Seeded sampling in the default run: async, without and beside a proposer (all: the slow test).
SEEDED_MODES = [("plain", 2), ("ngram", 2)]


EDITS = Path(__file__).resolve().parents[2] / "zerobubble" / "workloads" / "edits.jsonl"


def edit_rows(num_rows: int = 0) -> list[dict]:
    """Rows of the shipped `edits` workload: all, or the first ``num_rows`` code edits and one
    document revision."""
    rows = [json.loads(line) for line in EDITS.read_text().splitlines()]
    if not num_rows:
        return rows
    return [row for row in rows if row["kind"] == "code-edit"][:num_rows] + [
        next(row for row in rows if row["kind"] == "doc-revision")
    ]


def edit_requests(
    tokenizer: Tokenizer, rows: list[dict], max_tokens: int = 0, **params
) -> list[tuple[str, list[int], dict]]:
    """Each row with its prediction (``max_tokens``: a cap), a JSON answer predicting a JSON
    text, and a prediction of unrelated tokens (wrong from the first)."""
    requests = []
    for i, row in enumerate(rows):
        prompt = tokenizer.apply_chat_template(row["messages"])
        limit = min(row["max_tokens"], max_tokens) if max_tokens else row["max_tokens"]
        predicted = {"prediction_token_ids": tokenizer.encode(row["prediction"]), "max_tokens": limit}
        requests.append((f"edit{i}", prompt, predicted))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    question = "Describe a person as JSON with a name and an age."
    requests.append(
        (
            "json",
            tokenizer.apply_chat_template([{"role": "user", "content": question}]),
            {
                "grammar": grammar_of("json_schema", schema),
                "prediction_token_ids": tokenizer.encode(json.dumps({"name": "John", "age": 30})),
            },
        )
    )
    rng = random.Random(0)
    wrong = [rng.randrange(1000, 40000) for _ in range(64)]
    requests.append(("wrong", requests[0][1], {"prediction_token_ids": wrong}))
    return [(req_id, ids, {"max_tokens": MAX_TOKENS, **options, **params}) for req_id, ids, options in requests]


def check_every_mode(
    runners: dict, requests: list[tuple[str, list[int], dict]], modes: list[tuple[str, int]] = MODES
) -> None:
    """Each mode's outputs with the predictions equal the plain runner's without them, and
    some prediction drafts were accepted."""
    reference = run_job(runners["plain"], without_predictions(requests), window=1)
    for runner_name, window in modes:
        stats = SchedulerStats()
        outputs = run_job(runners[runner_name], requests, window=window, stats=stats)
        assert outputs == reference, (runner_name, window)
        assert stats.prediction.num_accepted_tokens > 0, (runner_name, window)
        assert stats.prediction.num_accepted_tokens <= stats.prediction.num_draft_tokens


def without_predictions(requests: list[tuple[str, list[int], dict]]) -> list[tuple[str, list[int], dict]]:
    return [(r, ids, {k: v for k, v in o.items() if k != "prediction_token_ids"}) for r, ids, o in requests]


# Seeded in the slow suite (make test's time): the greedy run covers the same modes.
@pytest.mark.parametrize("name", ["greedy", pytest.param("seeded", marks=pytest.mark.slow)])
def test_output_with_a_prediction_is_the_output_without_it(
    plain_runner, ngram_runner, eagle_runner, keyed_draft_runner, tokenizer, name
):
    params = {} if name == "greedy" else {"temperature": 0.9, "seed": 5}
    requests = edit_requests(tokenizer, edit_rows(2), max_tokens=MAX_TOKENS, **params)
    runners = {"plain": plain_runner, "ngram": ngram_runner, "eagle": eagle_runner, "draft": keyed_draft_runner}
    check_every_mode(runners, requests, MODES if name == "greedy" else SEEDED_MODES)
    # Alone, too.
    alone = run_job(plain_runner, [requests[0]], window=2)
    assert alone["edit0"] == run_job(plain_runner, without_predictions(requests[:1]), window=2)["edit0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_every_edits_row_is_the_same_with_its_prediction(
    plain_runner, ngram_runner, eagle_runner, keyed_draft_runner, tokenizer, name
):
    """Every shipped `edits` row, whole, with its prediction and without, in every mode."""
    params = {} if name == "greedy" else {"temperature": 0.9, "seed": 5}
    requests = edit_requests(tokenizer, edit_rows(), **params)
    runners = {"plain": plain_runner, "ngram": ngram_runner, "eagle": eagle_runner, "draft": keyed_draft_runner}
    check_every_mode(runners, requests)


def test_rejection_sampling_verifies_prediction_drafts_as_certain_tokens(plain_runner, draft_runner, tokenizer):
    """Under `--draft-acceptance rejection` a prediction's draft is a point mass: greedy, it is
    accepted exactly when it is the target's token, so the output is unchanged."""
    requests = edit_requests(tokenizer, edit_rows(1), max_tokens=32)[:1]
    reference = run_job(plain_runner, without_predictions(requests), window=1)
    stats = SchedulerStats()
    assert run_job(draft_runner, requests, window=2, stats=stats) == reference
    assert stats.prediction.num_accepted_tokens > 0


def test_a_prediction_the_output_follows_is_mostly_accepted(plain_runner, tokenizer):
    """The greedy output itself, given back as the prediction, is drafted from nearly all the
    way: few steps, almost every prediction draft accepted, and the same output."""
    requests = without_predictions(edit_requests(tokenizer, edit_rows(2), max_tokens=MAX_TOKENS))[:1]
    reference = run_job(plain_runner, requests, window=2)
    predicted = [(r, ids, {**o, "prediction_token_ids": reference[r]}) for r, ids, o in requests]
    baseline, stats = SchedulerStats(), SchedulerStats()
    run_job(plain_runner, requests[:1], window=2, stats=baseline)
    assert run_job(plain_runner, predicted[:1], window=2, stats=stats) == {"edit0": reference["edit0"]}
    assert stats.prediction.num_accepted_tokens >= 0.9 * (len(reference["edit0"]) - 2)
    assert stats.num_steps_completed <= baseline.num_steps_completed / 3
