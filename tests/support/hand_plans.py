"""Hand-built `StepPlan`s for runner tests that decide exactly what each step carries: rows
written as `PlanRow`s, in the order given."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, to_worker_sampling
from zerobubble.rows import NewRow, PlanBuilder, PlanRow

K = 3  # draft slots of a full decode unless a test says otherwise
BLOCKS_PER_REQUEST = 8


def add_rows(plan: worker_pb2.StepPlan, rows: Iterable[PlanRow]) -> None:
    """Append ``rows`` to ``plan`` in order; a new row without sampling gets the defaults."""
    builder = PlanBuilder()
    for row in rows:
        new = None
        if row.is_new:
            sampling = row.sampling if row.sampling is not None else SamplingOptions()
            new = NewRow(row.num_cached_tokens, to_worker_sampling(sampling, sampling.num_prompt_tokens))
        builder.add(
            row.req_id,
            row.token_ids,
            num_draft_slots=row.num_draft_slots,
            new_block_ids=row.new_block_ids,
            sample=row.sample,
            new=new,
        )
    builder.write(plan)


def make_plan(step_id: int, rows: Iterable[PlanRow], finished: Sequence[str] = ()) -> worker_pb2.StepPlan:
    """A plan of ``rows`` in order, with finish notices for ``finished``."""
    plan = worker_pb2.StepPlan(step_id=step_id, finished_req_ids=finished)
    add_rows(plan, rows)
    return plan


class Plans:
    """Hand-built plans: block ids per request, new/prefill/decode entries."""

    def __init__(self, k: int) -> None:
        self.k = k  # draft slots of a full decode (0 without a proposer)
        self.step_id = 0
        self.next_block = 0

    def new(
        self,
        req_id: str,
        tokens: list[int],
        *,
        sample: bool,
        temperature: float = 0.0,
        logprobs: bool = False,
        prediction: list[int] | None = None,
    ) -> PlanRow:
        blocks = list(range(self.next_block, self.next_block + BLOCKS_PER_REQUEST))
        self.next_block += BLOCKS_PER_REQUEST
        # A random row also carries every logits control: penalties, min-p, logit bias, top-N.
        options = SamplingOptions(
            temperature=temperature,
            top_k=20 if temperature else 0,
            top_p=0.9 if temperature else 1.0,
            seed=7,
            logprobs=logprobs,
            presence_penalty=0.5 if temperature else 0.0,
            frequency_penalty=0.3 if temperature else 0.0,
            repetition_penalty=1.2 if temperature else 0.0,
            min_p=0.05 if temperature else 0.0,
            logit_bias={3: 2.0, 7: -1.0} if temperature else {},
            top_logprobs=2 if logprobs else 0,
            prediction_token_ids=prediction or [],
            num_prompt_tokens=len(tokens),
        )
        return PlanRow(req_id, tokens, new_block_ids=blocks, is_new=True, sample=sample, sampling=options)

    @staticmethod
    def chunk(req_id: str, tokens: list[int]) -> PlanRow:
        return PlanRow(req_id, tokens)

    def decode(self, req_id: str, num_draft_slots: int = K) -> PlanRow:
        return PlanRow(req_id, num_draft_slots=min(num_draft_slots, self.k))

    def plan(self, *rows: PlanRow, finished: tuple[str, ...] = ()) -> worker_pb2.StepPlan:
        self.step_id += 1
        return make_plan(self.step_id, rows, finished)
