"""A step result's rows, whichever of its two wire forms carries them.

A `StepResult` carries most rows in columns (`RowColumns`: one message with four arrays) and
the rest (logprobs wanted, or an error) as one `RequestResult` message each. Readers (the
scheduler, tests) take both through `result_rows`; the worker writes the columns with
`add_row_columns`. Neither imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RowResult:
    """One request's row of a step result, read once into plain Python values.

    ``token_ids`` are the accepted drafts followed by the sampled token (empty for a prefill
    chunk that did not sample); ``top_logprobs`` holds one ``TopLogprobs``-like message per
    token when the request asked for them.
    """

    token_ids: list[int]
    num_draft_tokens: int
    num_accepted: int
    logprobs: Sequence[float] = ()
    top_logprobs: Sequence[Any] = ()
    error: str = ""


def result_rows(result: Any) -> dict[str, RowResult]:
    """Every row of a ``StepResult`` by request id, columns and messages alike.

    A column row's accepted drafts are its tokens but the last. Columns of unequal lengths or
    too few token ids (a broken worker) give short rows, which the scheduler refuses as it
    refuses any row with the wrong number of tokens.
    """
    rows: dict[str, RowResult] = {}
    cols = result.rows
    token_ids = list(cols.token_ids)
    start = 0
    for req_id, num_tokens, num_drafts in zip(cols.req_ids, cols.num_tokens, cols.num_draft_tokens):
        stop = start + max(num_tokens, 0)
        rows[req_id] = RowResult(token_ids[start:stop], num_drafts, max(num_tokens - 1, 0))
        start = stop
    for r in result.results:
        rows[r.req_id] = RowResult(
            list(r.token_ids), r.num_draft_tokens, r.num_accepted, r.logprobs, r.top_logprobs, r.error
        )
    return rows


def add_row_columns(
    result: Any,
    req_ids: Sequence[str],
    num_tokens: Sequence[int],
    token_ids: Sequence[int],
    num_draft_tokens: Sequence[int],
) -> None:
    """Append rows to a ``StepResult``'s columns: row i has ``num_tokens[i]`` of ``token_ids``
    (in row order) and ``num_draft_tokens[i]`` verified drafts."""
    if len(req_ids) != len(num_tokens) or len(req_ids) != len(num_draft_tokens) or sum(num_tokens) != len(token_ids):
        raise ValueError("row columns of unequal lengths")
    cols = result.rows
    cols.req_ids.extend(req_ids)
    cols.num_tokens.extend(num_tokens)
    cols.token_ids.extend(token_ids)
    cols.num_draft_tokens.extend(num_draft_tokens)


def speculation_counts(result: Any) -> tuple[int, int, int]:
    """(rows with drafts verified, drafts verified, drafts accepted) over a result's rows.

    Read straight from the columns: this runs for every step on the worker, over every row.
    """
    num_drafts = num_draft_tokens = num_accepted = 0
    cols = result.rows
    for n, num_tokens in zip(cols.num_draft_tokens, cols.num_tokens):
        if n > 0:
            num_drafts += 1
            num_draft_tokens += n
            num_accepted += num_tokens - 1
    for r in result.results:
        n = r.num_draft_tokens
        if n > 0:
            num_drafts += 1
            num_draft_tokens += n
            num_accepted += r.num_accepted
    return num_drafts, num_draft_tokens, num_accepted
