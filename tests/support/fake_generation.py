"""A stand-in `Generation` server for client-side unit tests of `generate` and `bench`.

It is not a model or a scheduler: it answers with token ids 0, 1, 2, ... two per message (like
accepted drafts), so client code (streaming, concurrency limits, reports, auth) can be tested
against known replies in milliseconds. Integration tests use the real services instead.

A request with a predicted output is answered with counts derived from it, so a test can tell
the prediction crossed the wire: accepted, half the reply's tokens (rounded down); rejected,
the prediction's characters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from zerobubble.api import generate_pb2, generate_pb2_grpc


class FakeGeneration(generate_pb2_grpc.GenerationServicer):
    """Replies ``max_tokens`` tokens (two per message, like accepted drafts) and counts stats."""

    def __init__(self, token: str = "") -> None:
        self.token = token
        self.in_flight = 0
        self.max_in_flight = 0
        self.stats = generate_pb2.ServerStats()

    async def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        if self.token and ("authorization", f"Bearer {self.token}") not in tuple(context.invocation_metadata()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")

    async def Generate(
        self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        await self._check_auth(context)
        if request.WhichOneof("input") == "prompt" and request.prompt == "fail":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "told to fail")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = request.stopping.max_tokens
            for start in range(0, n, 2):
                await asyncio.sleep(0.002)
                ids = list(range(start, min(start + 2, n)))
                self.stats.num_generation_tokens += len(ids)
                self.stats.num_drafts += 1
                self.stats.num_draft_tokens += 2
                self.stats.num_accepted_tokens += len(ids) - 1
                yield generate_pb2.GenerateResponse(
                    request_id="r",
                    text="".join(f"<{i}>" for i in ids),
                    token_ids=ids,
                    num_prompt_tokens=3,
                    num_output_tokens=start + len(ids),
                )
            accepted, rejected = self._prediction_counts(request)
            yield generate_pb2.GenerateResponse(
                request_id="r",
                finish_reason=generate_pb2.FINISH_REASON_MAX_TOKENS,
                num_prompt_tokens=3,
                num_output_tokens=n,
                num_accepted_prediction_tokens=accepted,
                num_rejected_prediction_tokens=rejected,
            )
        finally:
            self.in_flight -= 1

    def _prediction_counts(self, request: generate_pb2.GenerateRequest) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens of a reply, counted in the server's stats too."""
        if not request.HasField("prediction"):
            return 0, 0
        accepted, rejected = request.stopping.max_tokens // 2, len(request.prediction.text)
        self.stats.num_prediction_draft_tokens += accepted + rejected
        self.stats.num_prediction_accepted_tokens += accepted
        return accepted, rejected

    async def ModelInfo(
        self, request: generate_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> generate_pb2.ModelInfoResponse:
        await self._check_auth(context)
        response = generate_pb2.ModelInfoResponse(model="fake", spec_method="ngram", max_inflight_steps=2)
        response.stats.CopyFrom(self.stats)
        return response
