"""The rows of a plan and of a result, whichever of their two wire forms carries them.

A `StepPlan` carries its decode rows in columns (`DecodeColumns`) and prefill chunks as one
`ScheduledRequest` each; a `StepResult` carries most rows in columns (`RowColumns`) and the
rest (logprobs wanted, or an error) as one `RequestResult` each. At 256 rows a message per row
cost each side about half a millisecond a step to build and read. Readers take both forms
through `plan_rows` and `result_rows`; writers fill the columns with `add_decode_columns` and
`add_row_columns`. Nothing here imports torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zerobubble.request_options import SamplingOptions, from_worker_sampling


@dataclass(slots=True)
class PlanRow:
    """One request's row of a plan, read once into plain Python values (the fields of
    ``ScheduledRequest``; a decode row from the columns has no tokens, is not new and samples)."""

    req_id: str
    token_ids: Sequence[int] = ()
    num_draft_slots: int = 0
    new_block_ids: Sequence[int] = ()
    is_new: bool = False
    num_cached_tokens: int = 0
    sample: bool = True
    sampling: SamplingOptions | None = None  # where the row carries a `SamplingParams` message


@dataclass(slots=True)
class DecodeColumnLists:
    """A plan's ``DecodeColumns`` read once into lists: row i is ``req_ids[i]`` with
    ``num_draft_slots[i]`` draft slots and the next ``num_new_blocks[i]`` of ``new_block_ids``."""

    req_ids: list[str]
    num_draft_slots: list[int]
    num_new_blocks: list[int]
    new_block_ids: list[int]


def decode_columns(plan: Any) -> DecodeColumnLists:
    """A plan's decode columns as lists, checked to line up.

    Raises:
        ValueError: the columns do not line up or a row gains a negative number of blocks (a
            broken scheduler); nothing of the plan can be trusted then.
    """
    dec = plan.decodes
    cols = DecodeColumnLists(
        list(dec.req_ids), list(dec.num_draft_slots), list(dec.num_new_blocks), list(dec.new_block_ids)
    )
    num_rows = len(cols.req_ids)
    if (
        len(cols.num_draft_slots) != num_rows
        or len(cols.num_new_blocks) != num_rows
        or sum(cols.num_new_blocks) != len(cols.new_block_ids)
    ):
        raise ValueError(
            f"decode columns do not line up: {num_rows} request ids, {len(cols.num_draft_slots)} draft "
            f"counts, {len(cols.num_new_blocks)} block counts for {len(cols.new_block_ids)} block ids"
        )
    if num_rows and min(cols.num_new_blocks) < 0:
        i = next(i for i, n in enumerate(cols.num_new_blocks) if n < 0)
        raise ValueError(f"request {cols.req_ids[i]}: {cols.num_new_blocks[i]} new blocks")
    return cols


def column_rows(cols: DecodeColumnLists) -> list[PlanRow]:
    """The decode rows of `decode_columns` one `PlanRow` each."""
    rows: list[PlanRow] = []
    start = 0
    block_ids = cols.new_block_ids
    for req_id, num_drafts, n in zip(cols.req_ids, cols.num_draft_slots, cols.num_new_blocks):
        if n:
            rows.append(PlanRow(req_id, (), num_drafts, block_ids[start : start + n]))
            start += n
        else:
            rows.append(PlanRow(req_id, (), num_drafts))
    return rows


def message_rows(plan: Any) -> list[PlanRow]:
    """The rows a plan carries as ``ScheduledRequest`` messages (prefill chunks, new requests)."""
    return [
        PlanRow(
            e.req_id,
            e.token_ids,
            e.num_draft_slots,
            e.new_block_ids,
            e.is_new,
            e.num_cached_tokens,
            e.sample,
            from_worker_sampling(e.sampling) if e.HasField("sampling") else None,
        )
        for e in plan.requests
    ]


def plan_rows(plan: Any) -> list[PlanRow]:
    """Every row of a ``StepPlan`` in the order the worker runs them: the decode columns,
    then the ``requests`` messages.

    Raises:
        ValueError: as `decode_columns`.
    """
    return column_rows(decode_columns(plan)) + message_rows(plan)


def plan_req_ids(plan: Any) -> list[str]:
    """The request ids a plan schedules (both forms), without reading anything else."""
    return [*plan.decodes.req_ids, *(e.req_id for e in plan.requests)]


def add_decode_columns(
    plan: Any,
    req_ids: Sequence[str],
    num_draft_slots: Sequence[int],
    num_new_blocks: Sequence[int],
    new_block_ids: Sequence[int],
) -> None:
    """Append decode rows to a ``StepPlan``'s columns (see `DecodeColumns`)."""
    per_row = {"req_ids": req_ids, "num_draft_slots": num_draft_slots, "num_new_blocks": num_new_blocks}
    _extend_columns(plan.decodes, per_row, num_new_blocks, "new_block_ids", new_block_ids)


@dataclass(frozen=True, slots=True)
class ContinuationRow:
    """One row of a plan's ``Continuations``: ``req_id`` continues, after its first ``anchor``
    tokens, with ``token_ids`` (empty: it has no continuation any more)."""

    req_id: str
    anchor: int
    token_ids: Sequence[int]


def add_continuations(
    plan: Any, req_ids: Sequence[str], anchors: Sequence[int], token_ids: Sequence[Sequence[int]]
) -> None:
    """Append suffix-decoding continuations to a ``StepPlan`` (see `Continuations`)."""
    num_tokens = [len(t) for t in token_ids]
    flat = [token for tokens in token_ids for token in tokens]
    per_row = {"req_ids": req_ids, "anchors": anchors}
    _extend_columns(plan.continuations, {**per_row, "num_tokens": num_tokens}, num_tokens, "token_ids", flat)


def continuation_rows(plan: Any) -> list[ContinuationRow]:
    """A plan's continuations, one row each.

    Raises:
        ValueError: the columns do not line up, or an anchor or count is negative.
    """
    cols = plan.continuations
    req_ids, anchors, counts = list(cols.req_ids), list(cols.anchors), list(cols.num_tokens)
    token_ids = list(cols.token_ids)
    if len(anchors) != len(req_ids) or len(counts) != len(req_ids) or sum(counts) != len(token_ids):
        raise ValueError(f"continuation columns do not line up: {len(req_ids)} request ids")
    if req_ids and min(*anchors, *counts) < 0:
        raise ValueError("continuations: a negative anchor or token count")
    rows = []
    start = 0
    for req_id, anchor, n in zip(req_ids, anchors, counts):
        rows.append(ContinuationRow(req_id, anchor, token_ids[start : start + n]))
        start += n
    return rows


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
    prediction_drafts: bool = False  # the drafts verified came from the request's prediction


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
    for req_id, flag in zip(cols.req_ids, _prediction_flags(cols)):
        if flag:
            rows[req_id].prediction_drafts = True
    for r in result.results:
        rows[r.req_id] = RowResult(
            list(r.token_ids),
            r.num_draft_tokens,
            r.num_accepted,
            r.logprobs,
            r.top_logprobs,
            r.error,
            r.prediction_drafts,
        )
    return rows


def _prediction_flags(cols: Any) -> Sequence[bool]:
    """A ``RowColumns``' per-row prediction flags: empty unless some row had a prediction, and
    empty too when the column does not line up with the rows (it then flags nothing)."""
    flags = cols.prediction_drafts
    return flags if len(flags) == len(cols.req_ids) else ()


def add_row_columns(
    result: Any,
    req_ids: Sequence[str],
    num_tokens: Sequence[int],
    token_ids: Sequence[int],
    num_draft_tokens: Sequence[int],
    prediction_drafts: Sequence[bool] | None = None,
) -> None:
    """Append rows to a ``StepResult``'s columns: row i has ``num_tokens[i]`` of ``token_ids``
    (in row order) and ``num_draft_tokens[i]`` verified drafts, from its prediction where
    ``prediction_drafts[i]`` (None: no row's were).

    Raises:
        ValueError: the columns are of unequal lengths.
    """
    per_row: dict[str, Sequence[Any]] = {
        "req_ids": req_ids,
        "num_tokens": num_tokens,
        "num_draft_tokens": num_draft_tokens,
    }
    if prediction_drafts is not None:
        per_row["prediction_drafts"] = prediction_drafts
    _extend_columns(result.rows, per_row, num_tokens, "token_ids", token_ids)


def _extend_columns(
    cols: Any, per_row: dict[str, Sequence[Any]], counts: Sequence[int], flat_name: str, flat: Sequence[int]
) -> None:
    """Append rows to a columns message: each of ``per_row`` has one entry per row, and the
    array ``flat_name`` gets ``counts[i]`` entries of ``flat`` for row i."""
    if any(len(values) != len(counts) for values in per_row.values()) or sum(counts) != len(flat):
        raise ValueError(f"columns of unequal lengths for {type(cols).__name__}")
    for name, values in per_row.items():
        getattr(cols, name).extend(values)
    getattr(cols, flat_name).extend(flat)


@dataclass(slots=True)
class SpeculationCounts:
    """What a result's rows verified: the proposer's drafts (rows with drafts, drafts, accepted)
    and, apart, the drafts taken from requests' predictions (drafts, accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_prediction_draft_tokens: int = 0
    num_prediction_accepted: int = 0


def speculation_counts(result: Any) -> SpeculationCounts:
    """The drafts a result's rows verified and accepted.

    Read straight from the columns: this runs for every step on the worker, over every row.
    """
    cols = result.rows
    flags = _prediction_flags(cols)
    # (drafts, accepted, from the prediction) of each row: a column row's accepted drafts are
    # its tokens but the last.
    rows = itertools.chain(
        zip(cols.num_draft_tokens, [n - 1 for n in cols.num_tokens], flags or itertools.repeat(False)),
        ((r.num_draft_tokens, r.num_accepted, r.prediction_drafts) for r in result.results),
    )
    counts = SpeculationCounts()
    for n, accepted, predicted in rows:
        if n <= 0:
            continue
        if predicted:
            counts.num_prediction_draft_tokens += n
            counts.num_prediction_accepted += accepted
        else:
            counts.num_drafts += 1
            counts.num_draft_tokens += n
            counts.num_accepted += accepted
    return counts
