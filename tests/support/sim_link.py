"""A `WorkerLink`'s far end without processes: an `Execute` call answered by `SimWorker`.

Scheduler-side supervision tests (reset, re-queue, reconnect, deadlines, drain) patch these in
for the gRPC channel and stub, so a link's whole life runs in milliseconds.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from tests.support.sim_worker import EOS_ID, TOY_CHAT_TEMPLATE, SimWorker, make_toy_tokenizer_json
from zerobubble.api import worker_pb2

BLOCK_SIZE = 4
NUM_BLOCKS = 200


def toy_info(name: str, max_model_len: int = 128) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(
        worker_id=name,
        model="toy",
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        vocab_size=258,
        eos_token_ids=[EOS_ID],
        max_num_seqs=8,
        spec_method="ngram",
        num_spec_tokens=3,
        tokenizer_json=make_toy_tokenizer_json(),
        chat_template=TOY_CHAT_TEMPLATE,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
    )


class SimCall:
    """The scheduler's end of one `Execute` stream, answered by a fresh `SimWorker`
    (a real worker resets its state when a new stream supersedes the old one)."""

    def __init__(self, max_model_len: int) -> None:
        self.worker = SimWorker(NUM_BLOCKS, BLOCK_SIZE, max_model_len)
        self.results: asyncio.Queue = asyncio.Queue()

    async def write(self, plan: worker_pb2.StepPlan) -> None:
        self.results.put_nowait(self.worker.execute(plan))

    async def read(self):
        return await self.results.get()

    def cancel(self) -> None:
        self.results.put_nowait(grpc.aio.EOF)


def sim_stub(
    describes: list[float] | None = None, max_model_len: int = 128, call: type[SimCall] = SimCall, name: str = "sim"
):
    """A `WorkerStub` class whose `Execute` calls are `call`s; `describes` collects the times of
    its `Describe` calls (each (re)connection of a link makes one)."""

    class Stub:
        def __init__(self, channel) -> None:
            pass

        async def Describe(self, request, timeout=None, metadata=None):
            if describes is not None:
                describes.append(time.monotonic())
            return toy_info(name, max_model_len)

        def Execute(self, metadata=None):
            return call(max_model_len)

    return Stub


class FakeChannel:
    """Stands in for the gRPC channel: the stub reads which worker it is from `address`."""

    def __init__(self, address: str, *args, **kwargs) -> None:
        self.address = address

    async def close(self, grace=None) -> None:
        pass
