"""Structured output on the real SmolLM2, in-process (real `Scheduler` + `ModelRunner`, results
one or more plans late as over gRPC).

Oracles: `jsonschema` for every schema output, `re.fullmatch` for regexes, membership for
choices; across modes, identity with the synchronous unspeculated run (greedy and seeded), in
every mode of {sync, async} x {no speculation, n-gram, draft model} x {alone, together}.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.support.drive import run_job
from tests.support.structured_cases import CHOICE_CASES, REGEX_CASES, grammar_of, schema_cases
from zerobubble.scheduler_svc.scheduler import SchedulerStats
from zerobubble.scheduler_svc.tokenizer import Tokenizer
from zerobubble.structured import Constraint, to_grammar

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 160


def chat(tokenizer: Tokenizer, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}])


def requests_for(
    tokenizer: Tokenizer, cases: list[tuple[str, str, object]], **params
) -> list[tuple[str, list[int], dict]]:
    """One request per (id, kind, value) case; kind "" is an unconstrained request."""
    out = []
    for i, (question, kind, value) in enumerate(cases):
        options = {"max_tokens": MAX_TOKENS, **params}
        if kind:
            options["grammar"] = grammar_of(kind, value)
        out.append((f"c{i}", chat(tokenizer, question), options))
    return out


def test_every_schema_output_validates(plain_runner, tokenizer):
    """Greedy, async, 16 at a time: every output of the 52 schemas parses and validates, and
    ends because its grammar did (EOS), not at max_tokens."""
    cases = [(q, "json_schema", s) for q, s in schema_cases()]
    assert len({json.dumps(s) for _, _, s in cases}) >= 50
    outputs = run_job(plain_runner, requests_for(tokenizer, cases), window=2, max_num_seqs=16)
    for i, (_, _, schema) in enumerate(cases):
        ids = outputs[f"c{i}"]
        assert len(ids) < MAX_TOKENS, f"case {i} was cut at max_tokens: {tokenizer.decode(ids)!r}"
        jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)


def test_regex_and_choice_outputs_match(plain_runner, tokenizer):
    cases = [(q, "regex", r) for q, r in REGEX_CASES] + [(q, "choice", c) for q, c in CHOICE_CASES]
    for params in ({}, {"temperature": 1.0, "seed": 11}):
        outputs = run_job(plain_runner, requests_for(tokenizer, cases, **params), window=2)
        for i, (_, kind, value) in enumerate(cases):
            text = tokenizer.decode(outputs[f"c{i}"])
            if kind == "regex":
                assert re.fullmatch(str(value), text), (value, text)
            else:
                assert text in value, (value, text)


# Sixteen requests: constrained ones of every kind, and unconstrained ones beside them.
MIXED = [
    *[(q, "json_schema", s) for q, s in schema_cases()[2:50:8]],
    *[(q, "regex", r) for q, r in REGEX_CASES[:3]],
    *[(q, "choice", c) for q, c in CHOICE_CASES],
    ("Write a haiku about the sea.", "", None),
    ("Tell me about Paris.", "", None),
    ("What is a prime number?", "", None),
    ("Say hello in French.", "", None),
]
# (runner, plans in flight) against the synchronous unspeculated run.
MODES = [("plain", 2), ("ngram", 1), ("ngram", 2), ("draft", 1), ("draft", 2)]
# make test's time: the default run checks the async speculative modes (drafts cut by the
# grammar, placeholders in flight); every mode, greedy and seeded, in the slow suite.
ASYNC_SPEC_MODES = [("ngram", 2), ("draft", 2)]


@pytest.mark.parametrize(
    ("name", "modes"),
    [
        pytest.param("greedy", ASYNC_SPEC_MODES, id="greedy-async-spec"),
        pytest.param("greedy", MODES, id="greedy", marks=pytest.mark.slow),
        pytest.param("seeded", MODES, id="seeded", marks=pytest.mark.slow),
    ],
)
def test_constrained_output_is_the_same_in_every_mode(
    plain_runner, ngram_runner, keyed_draft_runner, tokenizer, name, modes
):
    """The same tokens sync and async, without speculation, with n-gram and with draft-model
    drafts (drafts the grammar forbids are cut before verification), sixteen requests together
    and alone; the unconstrained requests beside the constrained ones are unchanged."""
    params = {} if name == "greedy" else {"temperature": 0.9, "seed": 5}
    requests = [
        (req_id, ids, {**options, "max_tokens": 24} if "grammar" not in options else options)
        for req_id, ids, options in requests_for(tokenizer, MIXED, **params)
    ]
    assert len(requests) == 16
    runners = {"plain": plain_runner, "ngram": ngram_runner, "draft": keyed_draft_runner}
    reference = run_job(runners["plain"], requests, window=1)
    for runner_name, window in modes:
        assert run_job(runners[runner_name], requests, window=window) == reference, (runner_name, window)
    for request in (requests[0], requests[6]):
        alone = run_job(runners["ngram"], [request], window=2)
        assert alone[request[0]] == reference[request[0]], ("alone", request[0])


def test_a_preempted_constrained_request_resumes_its_grammar(ngram_runner, tokenizer):
    """Preempted (recompute) and resumed, a constrained request replays its earlier outputs into
    a fresh matcher and ends exactly as when it ran without preemption."""
    cases = [(q, "json_schema", s) for q, s in schema_cases()[:48:6]]
    requests = requests_for(tokenizer, cases)
    reference = run_job(ngram_runner, requests, window=2)
    stats = SchedulerStats()
    squeezed = run_job(ngram_runner, requests, window=2, num_blocks=24, stats=stats)
    assert stats.num_preemptions > 0
    assert squeezed == reference


def test_drafts_the_grammar_forbids_are_cut_and_the_matcher_is_unchanged(smollm2_dir):
    """`_fill_row`: slot 0's mask follows the matcher, each allowed draft fills the next slot's
    mask, the first forbidden draft ends the verified drafts, and the tentative drafts are
    rolled back."""
    import llguidance
    import numpy as np

    from zerobubble.kernels.token_mask import unpack_bitmask
    from zerobubble.worker_svc.grammar import BITS, _fill_row

    tok = llguidance.LLTokenizer((smollm2_dir / "tokenizer.json").read_text())
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    matcher = llguidance.LLMatcher(tok, to_grammar(Constraint("json_schema", json.dumps(schema))))
    good = tok.tokenize_str('{"a":12}')
    forbidden = tok.tokenize_str("hello")[0]
    words = -(-tok.vocab_size // BITS)
    bitmask = np.full((4, words), -1, dtype=np.int32)
    assert _fill_row(matcher, bitmask, 0, [good[0], good[1], forbidden, good[2]]) == 2
    import torch

    allowed = unpack_bitmask(torch.from_numpy(bitmask), tok.vocab_size)
    assert allowed[0, good[0]] and allowed[1, good[1]] and not allowed[2, forbidden]
    assert allowed[3].all()  # past the cut: never emitted, left unmasked
    again = np.full((1, words), -1, dtype=np.int32)
    assert _fill_row(matcher, again, 0, []) == 0
    assert (again[0] == bitmask[0]).all()  # the matcher is where it was


def test_a_grammar_the_worker_cannot_compile_fails_only_its_request(plain_runner, tokenizer):
    """A grammar that reached the worker without the scheduler's check (a client of the worker
    protocol) ends its own request with an error; the request beside it in the same plans runs
    as it would alone."""
    from tests.support.options import split_options
    from zerobubble.tools.in_process import make_scheduler

    good = ("good", chat(tokenizer, "Say hello."), {"max_tokens": 12})
    alone = run_job(plain_runner, [good], window=2)
    scheduler = make_scheduler(plain_runner)
    plain_runner.reset()
    scheduler.add_request(
        "bad", chat(tokenizer, "Say hello."), *split_options({"max_tokens": 12, "grammar": "start: nope"})
    )
    scheduler.add_request(good[0], good[1], *split_options(good[2]))
    outputs: dict[str, list[int]] = {"good": [], "bad": []}
    errors: dict[str, str] = {}
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        result = plain_runner.execute(plan).materialize(0.0, plain_runner.num_proposed)
        assert not result.error
        for event in scheduler.on_step_result(result):
            outputs[event.req_id].extend(event.token_ids)
            if event.error:
                errors[event.req_id] = event.error
    assert outputs["good"] == alone["good"] and "good" not in errors
    assert outputs["bad"] == [] and "grammar does not compile" in errors["bad"]


def test_an_eos_draft_past_a_complete_grammar_rolls_back_nothing_real(smollm2_dir):
    """Once a grammar is complete the matcher stops by itself and takes the end-of-sequence
    token without recording it: a draft of it is allowed (and verified) but must not be rolled
    back, or the matcher would lose a real token."""
    import llguidance
    import numpy as np

    from zerobubble.worker_svc.grammar import BITS, _fill_row

    tok = llguidance.LLTokenizer((smollm2_dir / "tokenizer.json").read_text(), eos_token=2)
    matcher = llguidance.LLMatcher(tok, to_grammar(Constraint("regex", "a(b|c)")))
    [a], [b], [c] = tok.tokenize_str("a"), tok.tokenize_str("b"), tok.tokenize_str("c")
    assert matcher.consume_token(a)
    bitmask = np.full((3, -(-tok.vocab_size // BITS)), -1, dtype=np.int32)
    assert _fill_row(matcher, bitmask, 0, [b, 2]) == 2  # "b" completes it; EOS follows
    assert matcher.consume_token(c) and matcher.is_accepting()  # still right after "a"


def test_a_token_the_grammar_refuses_is_an_error_of_the_request(smollm2_dir):
    """A real token the matcher refuses (only a bug or a parser limit can emit one) is recorded
    as the request's error, which the runner turns into a per-request error result, instead of
    the grammar quietly allowing only EOS from then on."""
    import llguidance

    from zerobubble.worker_svc.grammar import RequestGrammar

    tok = llguidance.LLTokenizer((smollm2_dir / "tokenizer.json").read_text(), eos_token=2)
    grammar = RequestGrammar(llguidance.LLMatcher(tok, to_grammar(Constraint("regex", "a+"))), 0, 0)
    grammar.consume(tok.tokenize_str("a"))
    assert not grammar.error
    grammar.consume(tok.tokenize_str("z"))
    assert "refused" in grammar.error
