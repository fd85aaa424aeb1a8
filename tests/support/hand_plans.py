"""Hand-built `StepPlan`s for runner tests that decide exactly what each step carries."""

from __future__ import annotations

from zerobubble.api import worker_pb2
from zerobubble.request_options import SamplingOptions, to_worker_sampling

K = 3  # draft slots of a full decode unless a test says otherwise
BLOCKS_PER_REQUEST = 8


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
    ) -> worker_pb2.ScheduledRequest:
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
        )
        sampling = to_worker_sampling(options, len(tokens))
        return worker_pb2.ScheduledRequest(
            req_id=req_id, token_ids=tokens, new_block_ids=blocks, is_new=True, sample=sample, sampling=sampling
        )

    @staticmethod
    def chunk(req_id: str, tokens: list[int]) -> worker_pb2.ScheduledRequest:
        return worker_pb2.ScheduledRequest(req_id=req_id, token_ids=tokens, sample=True)

    def decode(self, req_id: str, num_draft_slots: int = K) -> worker_pb2.ScheduledRequest:
        return worker_pb2.ScheduledRequest(req_id=req_id, num_draft_slots=min(num_draft_slots, self.k))

    def plan(self, *entries: worker_pb2.ScheduledRequest, finished: tuple[str, ...] = ()) -> worker_pb2.StepPlan:
        self.step_id += 1
        return worker_pb2.StepPlan(step_id=self.step_id, requests=list(entries), finished_req_ids=list(finished))
