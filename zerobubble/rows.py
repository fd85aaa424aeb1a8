"""The rows of a plan and of a result: read once into Python values, and built from them.

A `StepPlan` carries its rows in columns (`PlanRows`), and so does a `StepResult`
(`ResultRows`): at 256 rows a message per row cost each side about half a millisecond a step to
build and read. Each direction has one reader and one builder, used once at each boundary:
`read_plan` (or `plan_rows`) and `PlanBuilder` for plans, `result_rows` and `ResultBuilder` for
results. Nothing here imports torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, from_worker_sampling


@dataclass(slots=True)
class PlanRow:
    """One request's row of a plan as plain Python values (a decode row has no tokens)."""

    req_id: str
    token_ids: Sequence[int] = ()
    num_draft_slots: int = 0
    new_block_ids: Sequence[int] = ()
    is_new: bool = False
    num_cached_tokens: int = 0
    sample: bool = True
    sampling: SamplingOptions | None = None  # set on new rows


@dataclass(slots=True)
class DecodeColumnLists:
    """A plan's leading decode rows as lists: row i is ``req_ids[i]`` with ``num_draft_slots[i]``
    draft slots and the next ``num_new_blocks[i]`` of ``new_block_ids``."""

    req_ids: list[str]
    num_draft_slots: list[int]
    num_new_blocks: list[int]
    new_block_ids: list[int]


@dataclass(frozen=True, slots=True)
class NewRow:
    """What a new (or resumed) row carries besides its chunk."""

    num_cached_tokens: int = 0  # through a prefix-cache hit
    sampling: worker_pb2.SamplingParams = field(default_factory=worker_pb2.SamplingParams)


@dataclass(slots=True)
class PlanColumns:
    """A plan's rows as lists, one per `PlanRows` array: read from a plan by `read_plan`
    (checked to line up), or filled row by row with `add` and written with `write`."""

    req_ids: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_draft_slots: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    unsampled_rows: list[int] = field(default_factory=list)
    new_rows: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    sampling: list[worker_pb2.SamplingParams] = field(default_factory=list)

    def add(
        self,
        req_id: str,
        token_ids: Sequence[int] = (),
        *,
        num_draft_slots: int = 0,
        new_block_ids: Sequence[int] = (),
        sample: bool = True,
        new: NewRow | None = None,
    ) -> None:
        """Append one row (a decode row has no ``token_ids``; ``new`` marks a new row)."""
        i = len(self.req_ids)
        self.req_ids.append(req_id)
        self.num_tokens.append(len(token_ids))
        self.token_ids.extend(token_ids)
        self.num_draft_slots.append(num_draft_slots)
        self.num_new_blocks.append(len(new_block_ids))
        self.new_block_ids.extend(new_block_ids)
        if not sample:
            self.unsampled_rows.append(i)
        if new is not None:
            self.new_rows.append(i)
            self.num_cached_tokens.append(new.num_cached_tokens)
            self.sampling.append(new.sampling)

    def write(self, rows: worker_pb2.PlanRows) -> None:
        """Append these rows to a plan's ``rows``, after the ones it holds."""
        base = len(rows.req_ids)
        rows.req_ids.extend(self.req_ids)
        rows.num_tokens.extend(self.num_tokens)
        rows.token_ids.extend(self.token_ids)
        rows.num_draft_slots.extend(self.num_draft_slots)
        rows.num_new_blocks.extend(self.num_new_blocks)
        rows.new_block_ids.extend(self.new_block_ids)
        rows.unsampled_rows.extend([base + i for i in self.unsampled_rows])
        rows.new_rows.extend([base + i for i in self.new_rows])
        rows.num_cached_tokens.extend(self.num_cached_tokens)
        rows.sampling.extend(self.sampling)

    def num_leading_decodes(self) -> int:
        """How many rows from the first are plain decodes: no token ids, not new, sampling."""
        # The first row with tokens, found without a Python step per row.
        end = next(itertools.compress(itertools.count(), self.num_tokens), len(self.num_tokens))
        for marked in (self.new_rows, self.unsampled_rows):
            if marked:  # ascending: the first is the lowest
                end = min(end, marked[0])
        return end

    def leading_decodes(self) -> DecodeColumnLists:
        """The plan's leading decode rows (`num_leading_decodes`) as columns."""
        n = self.num_leading_decodes()
        if n == len(self.req_ids):  # a plan of decodes only, most plans: no copies
            return DecodeColumnLists(self.req_ids, self.num_draft_slots, self.num_new_blocks, self.new_block_ids)
        counts = self.num_new_blocks[:n]
        return DecodeColumnLists(self.req_ids[:n], self.num_draft_slots[:n], counts, self.new_block_ids[: sum(counts)])

    def rows(self, start: int = 0) -> list[PlanRow]:
        """The rows from ``start`` on, one `PlanRow` each."""
        if start >= len(self.req_ids):
            return []
        new = {row: j for j, row in enumerate(self.new_rows)}
        unsampled = set(self.unsampled_rows)
        token_start, block_start = sum(self.num_tokens[:start]), sum(self.num_new_blocks[:start])
        rows: list[PlanRow] = []
        for i in range(start, len(self.req_ids)):
            token_stop, block_stop = token_start + self.num_tokens[i], block_start + self.num_new_blocks[i]
            j = new.get(i)
            rows.append(
                PlanRow(
                    self.req_ids[i],
                    self.token_ids[token_start:token_stop],
                    self.num_draft_slots[i],
                    self.new_block_ids[block_start:block_stop],
                    j is not None,
                    self.num_cached_tokens[j] if j is not None else 0,
                    i not in unsampled,
                    from_worker_sampling(self.sampling[j]) if j is not None else None,
                )
            )
            token_start, block_start = token_stop, block_stop
        return rows


def read_plan(plan: worker_pb2.StepPlan) -> PlanColumns:
    """A plan's rows as lists, checked to line up.

    Raises:
        ValueError: the columns do not line up, a count is negative or a row index list is not
            ascending within the rows (a broken scheduler); nothing of the plan can be trusted.
    """
    r = plan.rows
    cols = PlanColumns(
        list(r.req_ids),
        list(r.num_tokens),
        list(r.token_ids),
        list(r.num_draft_slots),
        list(r.num_new_blocks),
        list(r.new_block_ids),
        list(r.unsampled_rows),
        list(r.new_rows),
        list(r.num_cached_tokens),
        list(r.sampling),
    )
    error = _plan_columns_error(cols)
    if error is not None:
        raise ValueError(f"plan rows: {error}")
    return cols


def _plan_columns_error(cols: PlanColumns) -> str | None:
    """Why a plan's columns cannot be read as rows (None: they can)."""
    num_rows = len(cols.req_ids)
    per_row = (cols.num_tokens, cols.num_draft_slots, cols.num_new_blocks)
    if any(len(values) != num_rows for values in per_row):
        return f"{num_rows} request ids but {[len(values) for values in per_row]} counts"
    counts = (cols.num_tokens, cols.num_new_blocks, cols.num_cached_tokens)
    if any(values and min(values) < 0 for values in counts):
        return "a negative token, block or cached-token count"
    if sum(cols.num_tokens) != len(cols.token_ids) or sum(cols.num_new_blocks) != len(cols.new_block_ids):
        return "the token or block counts do not add up to the ids given"
    for marked in (cols.new_rows, cols.unsampled_rows):
        if marked and (marked[0] < 0 or marked[-1] >= num_rows or any(a >= b for a, b in itertools.pairwise(marked))):
            return "row indices not ascending within the rows"
    if len(cols.num_cached_tokens) != len(cols.new_rows) or len(cols.sampling) != len(cols.new_rows):
        num_new = len(cols.new_rows)
        return f"{num_new} new rows, {len(cols.num_cached_tokens)} cached counts, {len(cols.sampling)} samplings"
    return None


def plan_rows(plan: worker_pb2.StepPlan) -> list[PlanRow]:
    """Every row of a ``StepPlan``, in plan order, one `PlanRow` each.

    Raises:
        ValueError: as `read_plan`.
    """
    return read_plan(plan).rows()


def plan_req_ids(plan: worker_pb2.StepPlan) -> list[str]:
    """The request ids a plan schedules, without reading anything else."""
    return list(plan.rows.req_ids)


@dataclass(slots=True)
class PlanBuilder:
    """A plan's rows while they are built. `write` puts the decode rows (`add_decode`) first,
    where the worker takes them as whole columns, then the other rows (`add`) in the order
    they were added."""

    decodes: DecodeColumnLists = field(default_factory=lambda: DecodeColumnLists([], [], [], []))
    others: PlanColumns = field(default_factory=PlanColumns)

    def add_decode(self, req_id: str, num_draft_slots: int, new_block_ids: Sequence[int] = ()) -> None:
        """A decode row: 1 + ``num_draft_slots`` tokens from the worker's own state.

        Most rows of most plans: four appends, not a general row's dozen checks.
        """
        decodes = self.decodes
        decodes.req_ids.append(req_id)
        decodes.num_draft_slots.append(num_draft_slots)
        decodes.num_new_blocks.append(len(new_block_ids))
        if new_block_ids:
            decodes.new_block_ids.extend(new_block_ids)

    def add(
        self,
        req_id: str,
        token_ids: Sequence[int] = (),
        *,
        num_draft_slots: int = 0,
        new_block_ids: Sequence[int] = (),
        sample: bool = True,
        new: NewRow | None = None,
    ) -> None:
        """Any row, written after the decode rows (see `PlanColumns.add`)."""
        self.others.add(
            req_id, token_ids, num_draft_slots=num_draft_slots, new_block_ids=new_block_ids, sample=sample, new=new
        )

    def __len__(self) -> int:
        return len(self.decodes.req_ids) + len(self.others.req_ids)

    def write(self, plan: worker_pb2.StepPlan) -> None:
        """Append the rows to ``plan.rows`` (which holds none yet)."""
        rows, decodes = plan.rows, self.decodes
        rows.req_ids.extend(decodes.req_ids)
        rows.num_tokens.extend([0] * len(decodes.req_ids))
        rows.num_draft_slots.extend(decodes.num_draft_slots)
        rows.num_new_blocks.extend(decodes.num_new_blocks)
        rows.new_block_ids.extend(decodes.new_block_ids)
        self.others.write(rows)


@dataclass(frozen=True, slots=True)
class ContinuationRow:
    """One row of a plan's ``Continuations``: ``req_id`` continues, after its first ``anchor``
    tokens, with ``token_ids`` (empty: it has no continuation any more)."""

    req_id: str
    anchor: int
    token_ids: Sequence[int]


def add_continuations(
    plan: worker_pb2.StepPlan, req_ids: Sequence[str], anchors: Sequence[int], token_ids: Sequence[Sequence[int]]
) -> None:
    """Append suffix-decoding continuations to a ``StepPlan`` (see `Continuations`).

    Raises:
        ValueError: the arguments are of unequal lengths.
    """
    if len(anchors) != len(req_ids) or len(token_ids) != len(req_ids):
        raise ValueError(f"continuations: {len(req_ids)} request ids, {len(anchors)} anchors, {len(token_ids)} texts")
    cols = plan.continuations
    cols.req_ids.extend(req_ids)
    cols.anchors.extend(anchors)
    cols.num_tokens.extend([len(t) for t in token_ids])
    cols.token_ids.extend([token for tokens in token_ids for token in tokens])


def continuation_rows(plan: worker_pb2.StepPlan) -> list[ContinuationRow]:
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


# One emitted position's most likely tokens, most likely first, and their logprobs.
TopLogprobs = tuple[list[int], list[float]]


@dataclass(slots=True)
class RowResult:
    """One request's row of a step result as plain Python values.

    ``token_ids`` are the accepted drafts followed by the sampled token (empty for a prefill
    chunk that did not sample, or a failed row); ``logprobs`` and ``top_logprobs`` have one
    entry per token where the request asked for them, else none.
    """

    token_ids: list[int]
    num_draft_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    error: str = ""
    prediction_drafts: bool = False  # the drafts verified came from the request's prediction

    @property
    def num_accepted(self) -> int:
        """Drafts accepted: the tokens but the last (the sampled one)."""
        return max(len(self.token_ids) - 1, 0)


def result_rows(result: worker_pb2.StepResult) -> dict[str, RowResult]:
    """Every row of a ``StepResult`` by request id.

    Never raises: columns of unequal lengths or too few ids (a broken worker) give short rows
    or rows without their logprobs, which the scheduler refuses or reads as none.
    """
    cols = result.rows
    token_ids = list(cols.token_ids)
    rows: list[RowResult] = []
    start = 0
    for num_tokens, num_drafts in zip(cols.num_tokens, cols.num_draft_tokens):
        stop = start + max(num_tokens, 0)
        rows.append(RowResult(token_ids[start:stop], num_drafts))
        start = stop
    for row, flag in zip(rows, _prediction_flags(cols)):
        row.prediction_drafts = flag
    _read_logprobs(cols, rows)
    _read_top_logprobs(cols, rows)
    for i, error in zip(cols.error_rows, cols.errors):
        if 0 <= i < len(rows):
            rows[i].error = error
    return dict(zip(cols.req_ids, rows))


def _listed(rows: list[RowResult], indices: Sequence[int]) -> list[RowResult]:
    """The rows ``indices`` names, those out of range left out."""
    return [rows[i] for i in indices if 0 <= i < len(rows)]


def _read_logprobs(cols: worker_pb2.ResultRows, rows: list[RowResult]) -> None:
    """Give each row of ``logprob_rows`` its logprobs, one per token."""
    logprobs = list(cols.logprobs)
    start = 0
    for row in _listed(rows, cols.logprob_rows):
        stop = start + len(row.token_ids)
        if stop > len(logprobs):
            return
        row.logprobs = logprobs[start:stop]
        start = stop


def _read_top_logprobs(cols: worker_pb2.ResultRows, rows: list[RowResult]) -> None:
    """Give each row of ``top_logprob_rows`` its candidates, one `TopLogprobs` per token."""
    counts = list(cols.num_top_logprobs)
    ids, logprobs = list(cols.top_token_ids), list(cols.top_logprobs)
    position = start = 0
    for row in _listed(rows, cols.top_logprob_rows):
        tops: list[TopLogprobs] = []
        for n in counts[position : position + len(row.token_ids)]:
            stop = start + max(n, 0)
            tops.append((ids[start:stop], logprobs[start:stop]))
            start = stop
        if len(tops) < len(row.token_ids) or start > min(len(ids), len(logprobs)):
            return
        row.top_logprobs = tops
        position += len(tops)


def _prediction_flags(cols: worker_pb2.ResultRows) -> Sequence[bool]:
    """A result's per-row prediction flags: empty unless some row had a prediction, and empty
    too when the column does not line up with the rows (it then flags nothing)."""
    flags = cols.prediction_drafts
    return flags if len(flags) == len(cols.req_ids) else ()


@dataclass(slots=True)
class ResultBuilder:
    """A step result's rows while they are built, one `add` or `add_error` per row; `write`
    puts them in the result's ``rows``."""

    # Built in lists, handed to the message in one extend each: appending to a repeated field
    # one value at a time costs several times a list append.
    req_ids: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    prediction_drafts: list[bool] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprob_rows: list[int] = field(default_factory=list)
    num_top_logprobs: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    error_rows: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(
        self,
        req_id: str,
        token_ids: Sequence[int] = (),
        num_draft_tokens: int = 0,
        *,
        prediction_drafts: bool = False,
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[tuple[Sequence[int], Sequence[float]]] | None = None,
    ) -> None:
        """A row that ran: its tokens, drafts verified, and, where the request asked for them,
        one logprob and one list of candidates per token.

        Raises:
            ValueError: logprobs or candidates not one per token.
        """
        if logprobs is not None or top_logprobs is not None:
            self._add_logprobs(req_id, len(token_ids), logprobs, top_logprobs)
        self.req_ids.append(req_id)
        self.num_tokens.append(len(token_ids))
        self.token_ids.extend(token_ids)
        self.num_draft_tokens.append(num_draft_tokens)
        self.prediction_drafts.append(prediction_drafts)

    def _add_logprobs(
        self,
        req_id: str,
        num_tokens: int,
        logprobs: Sequence[float] | None,
        top_logprobs: Sequence[tuple[Sequence[int], Sequence[float]]] | None,
    ) -> None:
        """The logprobs of the row `add` is adding, checked before anything is appended."""
        if (logprobs is not None and len(logprobs) != num_tokens) or (
            top_logprobs is not None and len(top_logprobs) != num_tokens
        ):
            raise ValueError(f"request {req_id}: logprobs or top logprobs not one per token ({num_tokens} tokens)")
        if top_logprobs is not None and any(len(ids) != len(values) for ids, values in top_logprobs):
            raise ValueError(f"request {req_id}: candidate ids and logprobs of unequal lengths")
        i = len(self.req_ids)
        if logprobs is not None:
            self.logprob_rows.append(i)
            self.logprobs.extend(logprobs)
        if top_logprobs is not None:
            self.top_logprob_rows.append(i)
            for ids, values in top_logprobs:
                self.num_top_logprobs.append(len(ids))
                self.top_token_ids.extend(ids)
                self.top_logprobs.extend(values)

    def add_error(self, req_id: str, error: str) -> None:
        """A row that failed (``error`` non-empty): nothing of it ran."""
        self.error_rows.append(len(self.req_ids))
        self.errors.append(error)
        self.add(req_id)

    def write(self, result: worker_pb2.StepResult) -> None:
        """Append the rows to ``result.rows`` (which holds none yet)."""
        cols = result.rows
        cols.req_ids.extend(self.req_ids)
        cols.num_tokens.extend(self.num_tokens)
        cols.token_ids.extend(self.token_ids)
        cols.num_draft_tokens.extend(self.num_draft_tokens)
        if any(self.prediction_drafts):
            cols.prediction_drafts.extend(self.prediction_drafts)
        cols.logprob_rows.extend(self.logprob_rows)
        cols.logprobs.extend(self.logprobs)
        cols.top_logprob_rows.extend(self.top_logprob_rows)
        cols.num_top_logprobs.extend(self.num_top_logprobs)
        cols.top_token_ids.extend(self.top_token_ids)
        cols.top_logprobs.extend(self.top_logprobs)
        cols.error_rows.extend(self.error_rows)
        cols.errors.extend(self.errors)


@dataclass(slots=True)
class SpeculationCounts:
    """What a result's rows verified: the proposer's drafts (rows with drafts, drafts, accepted)
    and, apart, the drafts taken from requests' predictions (drafts, accepted)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_prediction_draft_tokens: int = 0
    num_prediction_accepted: int = 0


def speculation_counts(cols: worker_pb2.ResultRows) -> SpeculationCounts:
    """The drafts a result's rows verified and accepted.

    Read straight from the columns: this runs for every step on the worker, over every row. A
    row's accepted drafts are its tokens but the last.
    """
    flags = _prediction_flags(cols) or itertools.repeat(False)
    counts = SpeculationCounts()
    for n, num_tokens, predicted in zip(cols.num_draft_tokens, cols.num_tokens, flags):
        if n <= 0:
            continue
        accepted = max(num_tokens - 1, 0)
        if predicted:
            counts.num_prediction_draft_tokens += n
            counts.num_prediction_accepted += accepted
        else:
            counts.num_drafts += 1
            counts.num_draft_tokens += n
            counts.num_accepted += accepted
    return counts
