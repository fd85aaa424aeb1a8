"""Helpers for end-to-end tests: the grounded workload through our services vs Hugging Face."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from tests.support.hf_oracle import hf_greedy, report_divergence
from zerobubble.bench import BenchRow, parse_row, run_bench_async

# Correctness runs cap every row at this many new tokens so that the whole matrix of
# configurations fits the suite's time budget; `zerobubble bench` runs the full lengths.
TEST_MAX_TOKENS = 64
MIN_IDENTICAL = 46


def bench_rows(rows: list[dict[str, Any]], max_tokens: int = TEST_MAX_TOKENS, **overrides) -> list[BenchRow]:
    """The workload rows as bench rows, capped at `max_tokens`, with field overrides."""
    out = []
    for i, row in enumerate(rows):
        parsed = parse_row(row, i)
        out.append(dataclasses.replace(parsed, max_tokens=min(parsed.max_tokens, max_tokens), **overrides))
    return out


def prompt_ids(model_dir: Path, rows: list[dict[str, Any]]) -> list[list[int]]:
    """Chat-templated prompt ids as Hugging Face's tokenizer makes them (the oracle's input)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [
        list(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for r in rows
    ]


def hf_reference(model_dir: Path, rows: list[dict[str, Any]], max_tokens: int = TEST_MAX_TOKENS) -> list[list[int]]:
    return hf_greedy(model_dir, prompt_ids(model_dir, rows), max_tokens)


@dataclasses.dataclass(slots=True)
class LazyReference:
    """Hugging Face greedy outputs of workload rows, each computed on first use (and cached)."""

    model_dir: Path
    rows: list[dict[str, Any]]

    def get(self, i: int, max_tokens: int = TEST_MAX_TOKENS) -> list[int]:
        """Row `i`'s greedy continuation, at most `max_tokens` long."""
        return hf_reference(self.model_dir, [self.rows[i]], max_tokens)[0]


def run_workload(target: str, rows: list[BenchRow], concurrency: int) -> dict[str, Any]:
    return asyncio.run(run_bench_async(target, rows, concurrency, request_timeout=600))


def assert_matches_reference(
    report: dict[str, Any],
    reference: list[list[int]],
    model_dir: Path,
    rows: list[dict[str, Any]],
    min_identical: int = MIN_IDENTICAL,
) -> int:
    """At least `min_identical` requests token-identical; explains every divergence."""
    ours = [r["token_ids"] for r in report["requests"]]
    assert all(r["finish_reason"] in ("eos", "max_tokens") for r in report["requests"]), [
        r.get("error") for r in report["requests"] if r["finish_reason"] not in ("eos", "max_tokens")
    ]
    differ = [i for i, (a, b) in enumerate(zip(ours, reference)) if a != b]
    if differ:
        prompts = prompt_ids(model_dir, [rows[i] for i in differ])
        notes = [
            f"request {i}: " + report_divergence(model_dir, p, ours[i], reference[i]) for i, p in zip(differ, prompts)
        ]
        print("\n".join(notes))
        assert len(ours) - len(differ) >= min_identical, "\n".join(notes)
    return len(ours) - len(differ)


def hf_texts(model_dir: Path, rows: list[dict[str, Any]], max_tokens: int) -> list[tuple[str, str]]:
    """(text, OpenAI finish reason) of Hugging Face greedy on each row's chat prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    outputs = hf_greedy(model_dir, prompt_ids(model_dir, rows), max_tokens)
    eos = tok.eos_token_id
    return [
        (
            tok.decode(ids, skip_special_tokens=True),
            "stop" if ids and ids[-1] == eos and len(ids) <= max_tokens else "length",
        )
        for ids in outputs
    ]


# Workload rows the HTTP tests (and the container test) send, and their length.
SUBSET = (0, 9, 29, 40)
SUBSET_MAX_TOKENS = 24
