"""`zerobubble front`: client calls relayed to a scheduler over one stream.

Real processes over gRPC on loopback (a worker on the simulated device, a scheduler, a front):
what a client gets through a front must be what it gets from the scheduler directly, message
for message; refusals keep their status and message; a client that leaves frees its request in
the scheduler; a lost scheduler ends the front's calls with UNAVAILABLE instead of hanging them,
and the front attaches again when the scheduler is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.metrics_scrape import scrape, total
from tests.support.polling import wait_until
from tests.support.servers import Service, start_scheduler, start_worker, wait_serving
from tests.support.sim_worker import EOS_ID, make_toy_tokenizer
from zerobubble.api import front_pb2, front_pb2_grpc, generate_pb2, generate_pb2_grpc
from zerobubble.bench import BenchRow, run_bench_async
from zerobubble.client import ChannelSettings, build_request, open_channel, wait_connected
from zerobubble.config import GRPC_EXPERIMENTS_DEFAULT
from zerobubble.scheduler_svc.front import CallText, RelayFrontend, join_replies
from zerobubble.scheduler_svc.submission import RequestError
from zerobubble.tools.launch import front_children, start_front

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def services():
    worker = start_worker(simulate_device_ms=2.0, spec_method="ngram", num_spec_tokens=3, max_num_seqs=32)
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=32, stream_interval=2)
    front = start_front(scheduler)
    try:
        wait_serving(scheduler.target)
        wait_serving(front.target)
        yield worker, scheduler, front
    finally:
        front.stop()
        scheduler.stop()
        worker.stop()


def requests() -> list[generate_pb2.GenerateRequest]:
    """A mix that exercises every reply field: stop strings, n > 1 with seeded sampling,
    logprobs and top logprobs, token-id prompts, --stream-interval's held tokens."""
    chat = [{"role": "user", "content": "Write a long list of rivers and the seas they reach."}]
    return [
        build_request(messages=chat, max_tokens=70),
        build_request(messages=chat, max_tokens=60, stop=[" rivers"]),
        build_request(prompt="Once upon a time", max_tokens=40, temperature=0.8, seed=5, n=3),
        build_request(messages=chat, max_tokens=30, logprobs=True, top_logprobs=2),
        build_request(token_ids=[1, 2, 3, 4, 5, 6, 7, 8], max_tokens=50, ignore_eos=True),
        # Each sequence ends at its own stop-string hit, found in the front; the others go on.
        build_request(prompt="Once upon a time", max_tokens=60, temperature=0.9, seed=11, n=3, stop=["e"]),
    ]


# A channel of its own connection: gRPC otherwise shares one between a process's channels to a
# target, and the kernel could not spread the calls over several fronts.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


async def replies(
    target: str, request: generate_pb2.GenerateRequest, options: list | None = None
) -> list[generate_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        return [r async for r in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)]


def tokens_by_index(messages: list[generate_pb2.GenerateResponse]) -> dict[int, tuple]:
    """Per sequence: its token ids, text, logprobs, top logprobs, finish reason and counts."""
    out: dict[int, tuple] = {}
    for index in sorted({m.index for m in messages}):
        mine = [m for m in messages if m.index == index]
        out[index] = (
            [t for m in mine for t in m.token_ids],
            "".join(m.text for m in mine),
            [round(x, 4) for m in mine for x in m.logprobs],
            [(list(t.token_ids), [round(x, 4) for x in t.logprobs]) for m in mine for t in m.top_logprobs],
            [m.finish_reason for m in mine if m.finish_reason],
            mine[-1].num_output_tokens,
            mine[-1].num_prompt_tokens,
            len({m.request_id for m in mine}),
        )
    return out


def test_a_front_relays_every_reply_as_the_scheduler_sends_it(services) -> None:
    _, scheduler, front = services

    async def both() -> tuple[list, list]:
        # All at once through the front (one stream carries them all), then the same directly.
        via_front = await asyncio.gather(*(replies(front.target, r) for r in requests()))
        direct = await asyncio.gather(*(replies(scheduler.target, r) for r in requests()))
        return via_front, direct

    via_front, direct = asyncio.run(both())
    # The front tokenized those prompts itself, with the workers' tokenizer.
    assert any("tokenizing for" in line for line in front.log)
    for request, got, expected in zip(requests(), via_front, direct):
        assert tokens_by_index(got) == tokens_by_index(expected), request
        finishes = [m.finish_reason for m in got if m.finish_reason]
        assert len(finishes) == max(request.sampling.n, 1)
    stop = tokens_by_index(via_front[1])[0]
    assert stop[4] == [generate_pb2.FINISH_REASON_STOP_SEQUENCE] and " rivers" not in stop[1]
    stops = tokens_by_index(via_front[5])
    ends = [len(seq[0]) for seq in stops.values() if seq[4] == [generate_pb2.FINISH_REASON_STOP_SEQUENCE]]
    assert len(set(ends)) >= 2, f"the n = 3 stop-string request proves nothing: {stops}"


async def attach(
    target: str, request: generate_pb2.GenerateRequest, reads_plain: bool
) -> list[front_pb2.EngineMessage]:
    """One call relayed over a raw `Attach` stream, as a front that tokenizes and detokenizes
    itself sends it; every `EngineMessage` until the call's DONE."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = front_pb2_grpc.FrontGatewayStub(channel)
        info = await stub.Describe(front_pb2.DescribeRequest())
        out: asyncio.Queue = asyncio.Queue()
        submit = front_pb2.FrontMessage(reads_plain=reads_plain)
        submit.submit.add(tag=7, request=request, tokenized_for=info.model, front_detokenizes=True)
        out.put_nowait(submit)

        async def outgoing():
            while True:
                yield await out.get()

        messages = []
        async for message in stub.Attach(outgoing(), timeout=60):
            messages.append(message)
            if 7 in message.done:
                return messages
    raise AssertionError("the stream ended before the call's DONE")


def test_replies_of_tokens_alone_travel_as_plain_rows_to_a_front_that_reads_them(services) -> None:
    """Behind a front that says it `reads_plain`, a sequence's first and last replies, and
    every reply with log-probabilities, come whole; the replies of tokens alone in between as
    plain rows, whose tokens and counts are the whole path's. A front that does not say so
    (an older one) gets every reply whole."""
    _, scheduler, _ = services
    plain_request = build_request(token_ids=[1, 2, 3, 4, 5, 6, 7, 8], max_tokens=40, ignore_eos=True)
    logprobs_request = build_request(token_ids=[1, 2, 3, 4, 5, 6, 7, 8], max_tokens=20, ignore_eos=True, logprobs=True)

    def rebuilt(messages: list[front_pb2.EngineMessage]) -> tuple[list[int], int, int]:
        """The call's tokens in order, its last count, and how many plain rows carried them."""
        tokens: list[int] = []
        num_rows = 0
        for message in messages:
            plain = message.plain
            ends = list(itertools.accumulate(plain.num_tokens))
            rows = [plain.token_ids[end - n : end] for n, end in zip(plain.num_tokens, ends)]
            placed = 0
            for tagged in message.replies:
                tokens.extend(t for row in rows[placed : tagged.num_plain_before] for t in row)
                placed = tagged.num_plain_before
                tokens.extend(tagged.response.token_ids)
            tokens.extend(t for row in rows[placed:] for t in row)
            num_rows += len(rows)
        last = [m for m in messages if m.replies or m.plain.tags][-1]
        count = last.replies[-1].response.num_output_tokens if last.replies else last.plain.num_output_tokens[-1]
        return tokens, count, num_rows

    async def run() -> tuple:
        return (
            await attach(scheduler.target, plain_request, reads_plain=True),
            await attach(scheduler.target, plain_request, reads_plain=False),
            await attach(scheduler.target, logprobs_request, reads_plain=True),
            await replies(scheduler.target, plain_request),
        )

    with_plain, without, with_logprobs, direct = asyncio.run(run())
    direct_tokens = [t for m in direct for t in m.token_ids]
    tokens, count, num_rows = rebuilt(with_plain)
    assert (tokens, count) == (direct_tokens, 40)
    whole = [t.response for m in with_plain for t in m.replies]
    assert num_rows >= 5 and len(whole) == 2, (num_rows, len(whole))
    assert whole[-1].finish_reason == generate_pb2.FINISH_REASON_MAX_TOKENS
    assert set(m.plain.tags[i] for m in with_plain for i in range(len(m.plain.tags))) == {7}
    assert rebuilt(without) == (direct_tokens, 40, 0)
    assert all(len(t.response.logprobs) == len(t.response.token_ids) for m in with_logprobs for t in m.replies)
    assert rebuilt(with_logprobs)[2] == 0


def engine_message(*parts: tuple[int, generate_pb2.GenerateResponse] | tuple[int, int, list[int], int]):
    """An `EngineMessage` of whole replies (tag, reply) and plain rows (tag, index, tokens,
    count), in that order."""
    message = front_pb2.EngineMessage()
    plain = message.plain
    for part in parts:
        if len(part) == 2:
            message.replies.add(tag=part[0], response=part[1], num_plain_before=len(plain.tags))
        else:
            tag, index, token_ids, count = part
            plain.tags.append(tag)
            plain.indexes.append(index)
            plain.num_tokens.append(len(token_ids))
            plain.token_ids.extend(token_ids)
            plain.num_output_tokens.append(count)
    return message


def test_a_front_places_plain_rows_among_whole_replies_in_the_schedulers_order() -> None:
    """`EngineLink` hands each call its plain rows and whole replies in the order the scheduler
    made them (`num_plain_before`), a row as the reply it stands for (its counts and tokens,
    the rest from its sequence's last whole reply); rows of calls it no longer has skipped."""
    from zerobubble.config import FrontConfig
    from zerobubble.scheduler_svc.front import EngineLink

    link = EngineLink(FrontConfig())
    one, two = asyncio.Queue(), asyncio.Queue()
    link.calls = {1: one, 2: two}
    r = generate_pb2.GenerateResponse
    first = r(request_id="r", token_ids=[5], num_prompt_tokens=9, num_output_tokens=1, num_cached_prompt_tokens=4)
    other = r(request_id="r", token_ids=[50], num_prompt_tokens=9, num_output_tokens=1, index=1)
    last = r(
        request_id="r", token_ids=[8], text="z", num_prompt_tokens=9, num_output_tokens=5, num_cached_prompt_tokens=4
    )
    link._dispatch(engine_message((1, first), (2, other)))
    link._dispatch(engine_message((1, 0, [6, 7], 3), (3, 0, [1], 1), (2, 1, [9], 2), (1, last), (1, 0, [10], 6)))
    got_one = [one.get_nowait() for _ in range(one.qsize())]
    kept = {"request_id": "r", "num_prompt_tokens": 9, "num_cached_prompt_tokens": 4}
    assert got_one == [
        first,
        r(token_ids=[6, 7], num_output_tokens=3, **kept),
        last,
        r(token_ids=[10], num_output_tokens=6, **kept),
    ]
    got_two = [two.get_nowait() for _ in range(two.qsize())]
    assert got_two == [other, r(request_id="r", token_ids=[9], num_prompt_tokens=9, num_output_tokens=2, index=1)]


def test_plain_rows_that_queued_up_join_with_the_whole_replies_around_them() -> None:
    """A call whose replies queued up gets, per sequence, every token in order and the last
    count, whether they came as plain rows, whole replies or both in turn."""
    from zerobubble.config import FrontConfig
    from zerobubble.scheduler_svc.front import DONE, EngineLink
    from zerobubble.scheduler_svc.submission import Stream, Submission

    link = EngineLink(FrontConfig())
    relay = RelayFrontend(link)
    queue: asyncio.Queue = asyncio.Queue()
    link.calls = {3: queue}
    streams = tuple(
        Stream(queue=queue, arrival=0.0, num_prompt_tokens=0, deliver=queue.put_nowait, index=i) for i in range(2)
    )
    r = generate_pb2.GenerateResponse
    link._dispatch(
        engine_message(
            (3, r(request_id="q", token_ids=[1], num_prompt_tokens=5, num_output_tokens=1)),
            (3, r(request_id="q", token_ids=[50], num_prompt_tokens=5, num_output_tokens=1, index=1)),
            (3, 0, [2], 2),
            (3, 1, [51, 52], 3),
            (3, 0, [3], 3),
            # Whole amid plain rows: text the scheduler made (a front that does not detokenize),
            # whose tokens before it rendered none yet (a character's first bytes).
            (3, r(request_id="q", token_ids=[4], text="xy", num_prompt_tokens=5, num_output_tokens=4)),
            (3, 0, [5, 6], 6),
            (3, 0, [7], 7),
        )
    )
    link._dispatch(
        engine_message(
            (3, r(request_id="q", token_ids=[53], num_prompt_tokens=5, num_output_tokens=4, index=1, finish_reason=1)),
            (3, r(request_id="q", token_ids=[8], num_prompt_tokens=5, num_output_tokens=8, finish_reason=2)),
        )
    )
    queue.put_nowait(DONE)

    async def run() -> list[generate_pb2.GenerateResponse]:
        return [reply async for reply in relay.responses(Submission("3", streams[0], (), streams))]

    got = asyncio.run(run())
    assert tokens_by_index(got) == {
        0: ([1, 2, 3, 4, 5, 6, 7, 8], "xy", [], [], [2], 8, 5, 1),
        1: ([50, 51, 52, 53], "", [], [], [1], 4, 5, 1),
    }


def test_replies_that_queued_up_go_out_joined_per_sequence() -> None:
    """A call whose client is written to more slowly than tokens come gets them joined: every
    sequence's tokens, text and logprobs in order, its last counts and finish reason."""
    r = generate_pb2.GenerateResponse
    first = r(
        request_id="a", text="Hel", token_ids=[1, 2], logprobs=[-0.5, -0.25], num_output_tokens=2, num_prompt_tokens=7
    )
    other = r(request_id="a", index=1, text="X", token_ids=[5], num_output_tokens=1)
    second = r(request_id="a", text="lo", token_ids=[3], logprobs=[-1.0], num_output_tokens=3, num_prompt_tokens=7)
    first.top_logprobs.add(token_ids=[1, 9], logprobs=[-0.5, -1.0])
    first.top_logprobs.add(token_ids=[2, 9], logprobs=[-0.25, -2.0])
    second.top_logprobs.add(token_ids=[3, 8], logprobs=[-1.0, -1.5])
    last = r(request_id="a", text="!", token_ids=[4], logprobs=[-2.0], num_output_tokens=4, num_prompt_tokens=7)
    last.finish_reason = generate_pb2.FINISH_REASON_MAX_TOKENS
    joined = join_replies([first, other, second, last])
    assert [m.index for m in joined] == [0, 1]
    zero, one = joined
    assert (zero.text, list(zero.token_ids), list(zero.logprobs)) == ("Hello!", [1, 2, 3, 4], [-0.5, -0.25, -1.0, -2.0])
    assert (zero.num_output_tokens, zero.num_prompt_tokens, zero.finish_reason) == (
        4,
        7,
        generate_pb2.FINISH_REASON_MAX_TOKENS,
    )
    assert [list(t.token_ids) for t in zero.top_logprobs] == [[1, 9], [2, 9], [3, 8]]
    assert one == other
    assert join_replies([second]) == [second]


def test_a_stop_string_cuts_a_reply_after_the_token_that_completed_it() -> None:
    """The front's text rules (`CallText`): a reply is cut after the token that completed the
    stop string, its logprobs, top logprobs and count with it, the text before the stop string;
    the token that ended a sequence on EOS renders no text."""
    text = CallText(make_toy_tokenizer(), list(b"hi"), ["cd"])
    reply = generate_pb2.GenerateResponse(token_ids=list(b"abcde"), logprobs=[-1, -2, -3, -4, -5], num_output_tokens=9)
    for token_id in b"abcde":
        reply.top_logprobs.add(token_ids=[token_id], logprobs=[-0.5])
    assert text.fill(reply)
    assert (bytes(reply.token_ids), list(reply.logprobs), reply.text) == (b"abcd", [-1, -2, -3, -4], "ab")
    assert [list(t.token_ids) for t in reply.top_logprobs] == [[t] for t in b"abcd"]
    assert (reply.num_output_tokens, reply.finish_reason) == (8, generate_pb2.FINISH_REASON_STOP_SEQUENCE)
    eos = CallText(make_toy_tokenizer(), list(b"hi"), [])
    last = generate_pb2.GenerateResponse(token_ids=[*b"xy", EOS_ID], finish_reason=generate_pb2.FINISH_REASON_EOS)
    assert not eos.fill(last) and last.text == "xy" and len(last.token_ids) == 3


class _BrokenVocabulary:
    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        raise RuntimeError("no such token")


def test_a_reply_that_cannot_be_detokenized_ends_its_call_with_internal() -> None:
    text = CallText(_BrokenVocabulary(), [1, 2], [])  # type: ignore[arg-type]
    with pytest.raises(RequestError) as info:
        RelayFrontend._fill(text, generate_pb2.GenerateResponse(token_ids=[3]))
    assert info.value.code == grpc.StatusCode.INTERNAL and "no such token" in info.value.message


def test_refusals_keep_the_schedulers_status_and_message(services) -> None:
    _, scheduler, front = services
    bad = [
        build_request(prompt="hi", max_tokens=4, top_p=2.0),
        build_request(prompt="hi", max_tokens=4, n=99),
        generate_pb2.GenerateRequest(prompt="hi", model="no-such-model"),
        # Refused by the front's own tokenization, in the scheduler's words.
        generate_pb2.GenerateRequest(prompt=""),
        build_request(messages=[{"role": "robot", "content": "hi"}], max_tokens=4),
        generate_pb2.GenerateRequest(),
    ]

    async def outcome(target: str, request) -> tuple:
        try:
            await replies(target, request)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()
        return None

    async def run() -> list[tuple]:
        return [(await outcome(front.target, r), await outcome(scheduler.target, r)) for r in bad]

    for via_front, direct in asyncio.run(run()):
        assert via_front is not None and via_front[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert via_front == direct
    # Unary calls pass through too.

    async def unary() -> tuple:
        async with grpc.aio.insecure_channel(front.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            info = await stub.ModelInfo(generate_pb2.ModelInfoRequest())
            tokens = await stub.Tokenize(generate_pb2.TokenizeRequest(prompt="hello world"))
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            direct = await generate_pb2_grpc.GenerationStub(channel).Tokenize(
                generate_pb2.TokenizeRequest(prompt="hello world")
            )
        return info, tokens, direct

    info, tokens, direct = asyncio.run(unary())
    assert info.num_workers == 1 and info.num_spec_tokens == 3
    assert list(tokens.token_ids) == list(direct.token_ids) and tokens.token_ids
    assert list(tokens.tokens) == list(direct.tokens)

    # Tokenize, answered in the front, says what the scheduler says: chat messages through the
    # template, and refusals with the same status and message.
    async def tokenize(target: str, request: generate_pb2.TokenizeRequest) -> tuple:
        async with grpc.aio.insecure_channel(target) as channel:
            try:
                reply = await generate_pb2_grpc.GenerationStub(channel).Tokenize(request)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details()
            return list(reply.token_ids), list(reply.tokens)

    chat = generate_pb2.TokenizeRequest()
    chat.messages.messages.add(role="user", content="hello there")
    for request in (chat, generate_pb2.TokenizeRequest(prompt=""), generate_pb2.TokenizeRequest()):
        via_front, direct = (asyncio.run(tokenize(t, request)) for t in (front.target, scheduler.target))
        assert via_front == direct


class _NoRelay:
    """A scheduler connection that fails the test if a call is relayed through it."""

    async def Tokenize(self, request, metadata=None):
        raise AssertionError("Tokenize was relayed to the scheduler")


class _Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RequestError(code, details)


def test_a_front_that_holds_the_tokenizer_answers_tokenize_itself() -> None:
    from zerobubble.api import worker_pb2
    from zerobubble.config import FrontConfig
    from zerobubble.scheduler_svc.front import EngineLink, FrontServicer

    link = EngineLink(FrontConfig())
    link.tokenizer, link.info = make_toy_tokenizer(), worker_pb2.WorkerInfo(model="toy", vocab_size=300)
    link.unary = _NoRelay()  # type: ignore[assignment]
    relay = RelayFrontend(link)
    relay.ready = True
    servicer = FrontServicer(relay)
    reply = asyncio.run(servicer.Tokenize(generate_pb2.TokenizeRequest(prompt="ab"), _Context()))
    assert list(reply.token_ids) == list(link.tokenizer.encode("ab")) and len(reply.tokens) == len(reply.token_ids)
    with pytest.raises(RequestError) as refused:
        asyncio.run(servicer.Tokenize(generate_pb2.TokenizeRequest(prompt=""), _Context()))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in refused.value.message


def running(scheduler: Service) -> float:
    return total(scrape(scheduler.ports["METRICS"]), "zerobubble_num_requests_running")


def front_series(scheduler: Service) -> dict[str, tuple[float, float]]:
    """The scheduler's series of its attached fronts: by front name, (CPU seconds, open calls)."""
    samples = scrape(scheduler.ports["METRICS"])
    names = {s.labels["front"] for s in samples if s.name.startswith("zerobubble_front_")}
    return {
        name: (
            total(samples, "zerobubble_front_cpu_seconds_total", front=name),
            total(samples, "zerobubble_front_calls_running", front=name),
        )
        for name in names
    }


def front_name(pid: int) -> str:
    return f"{socket.gethostname()}:{pid}"


def test_a_client_that_leaves_frees_its_request_in_the_scheduler(services) -> None:
    _, scheduler, front = services

    async def leave_early() -> int:
        received = 0
        async with grpc.aio.insecure_channel(front.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(build_request(prompt="Count:", max_tokens=5000, ignore_eos=True))
            async for reply in call:
                received += len(reply.token_ids)
                if received >= 10:
                    call.cancel()
                    break
        return received

    assert asyncio.run(leave_early()) >= 10
    wait_until(lambda: running(scheduler) == 0, 10, "the cancelled call's request to leave the scheduler")


def request_figures(scheduler: Service) -> tuple[float, float, float, float]:
    """The scheduler's count of first tokens, of ends and of finished requests, and its summed
    end-to-end seconds."""
    samples = scrape(scheduler.ports["METRICS"])
    return (
        total(samples, "zerobubble_time_to_first_token_seconds_count"),
        total(samples, "zerobubble_e2e_request_latency_seconds_count"),
        total(samples, "zerobubble_request_success_total"),
        total(samples, "zerobubble_e2e_request_latency_seconds_sum"),
    )


def test_the_scheduler_counts_what_a_fronts_clients_saw_once(services) -> None:
    """Calls through a front are timed where their client is: each sequence's first token and
    end are counted once (the front reports them, the scheduler does not time them itself),
    a cancelled call's too, and no end takes longer than its client waited."""
    _, scheduler, front = services
    before = request_figures(scheduler)
    chat = [{"role": "user", "content": "Name three rivers."}]
    calls = [
        build_request(messages=chat, max_tokens=20),
        build_request(prompt="Once upon a time", max_tokens=15, temperature=0.8, seed=3, n=3),
        build_request(token_ids=[5, 6, 7], max_tokens=10, ignore_eos=True),
    ]

    async def timed(request: generate_pb2.GenerateRequest) -> float:
        start = time.monotonic()
        await replies(front.target, request)
        return time.monotonic() - start

    async def cancelled() -> float:
        start = time.monotonic()
        async with grpc.aio.insecure_channel(front.target) as channel:
            call = generate_pb2_grpc.GenerationStub(channel).Generate(
                build_request(prompt="Count:", max_tokens=5000, ignore_eos=True)
            )
            async for reply in call:
                if reply.num_output_tokens >= 5:
                    call.cancel()
                    break
        return time.monotonic() - start

    async def run() -> list[float]:
        return list(await asyncio.gather(*(timed(r) for r in calls), cancelled()))

    waited = asyncio.run(run())
    num_sequences = [1, 3, 1, 1]

    def all_ended() -> bool:
        after = request_figures(scheduler)
        return after[1] - before[1] >= sum(num_sequences) and after[2] - before[2] >= sum(num_sequences)

    wait_until(all_ended, 10, "every sequence's end to be counted")
    time.sleep(0.3)  # anything counted twice would arrive by now
    after = request_figures(scheduler)
    ttft, e2e, finished, e2e_sum = (a - b for a, b in zip(after, before))
    assert (ttft, e2e, finished) == (6, 6, 6)
    assert 0 < e2e_sum <= sum(n * w for n, w in zip(num_sequences, waited))


def test_a_stop_string_found_in_the_front_ends_the_sequence_in_the_scheduler(services) -> None:
    """The front detokenizes and finds stop strings: the sequence it ends there is ended in the
    scheduler too (not run on to max_tokens), counted as a stop with the tokens its client got."""
    _, scheduler, front = services

    def figures() -> tuple[float, float, float]:
        samples = scrape(scheduler.ports["METRICS"])
        return (
            total(samples, "zerobubble_request_success_total", finished_reason="stop_sequence"),
            total(samples, "zerobubble_request_success_total"),
            total(samples, "zerobubble_generation_tokens_total"),
        )

    before = figures()
    request = build_request(
        prompt="Once upon a time", max_tokens=3000, ignore_eos=True, temperature=0.9, seed=11, stop=["e"]
    )
    got = asyncio.run(replies(front.target, request))
    assert got[-1].finish_reason == generate_pb2.FINISH_REASON_STOP_SEQUENCE, "no stop string met: proves nothing"
    num_tokens = sum(len(r.token_ids) for r in got)
    assert num_tokens == got[-1].num_output_tokens < 3000 and "e" not in "".join(r.text for r in got)
    wait_until(lambda: figures()[1] != before[1], 20, "the stopped request to be counted", poll=0.05)
    stops, finished, generated = (a - b for a, b in zip(figures(), before))
    assert (stops, finished, generated) == (1, 1, num_tokens)
    assert running(scheduler) == 0


def front_health(front: Service) -> int:
    with grpc.insecure_channel(front.target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_lost_scheduler_ends_the_fronts_calls_and_the_front_attaches_again() -> None:
    worker = start_worker(simulate_device_ms=5.0, max_num_seqs=8)
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=8)
    port = scheduler.port
    front = start_front(scheduler)
    try:
        wait_serving(front.target)

        async def cut_off() -> tuple:
            got = 0
            async with grpc.aio.insecure_channel(front.target) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                try:
                    async for reply in stub.Generate(build_request(prompt="a", max_tokens=5000, ignore_eos=True)):
                        got += len(reply.token_ids)
                        if got >= 5 and scheduler.proc.poll() is None:
                            scheduler.kill()  # no drain: the stream just breaks
                except grpc.aio.AioRpcError as exc:
                    return got, exc.code()
            return got, None

        got, code = asyncio.run(asyncio.wait_for(cut_off(), 30))
        assert got >= 5 and code == grpc.StatusCode.UNAVAILABLE
        wait_until(
            lambda: front_health(front) == health_pb2.HealthCheckResponse.NOT_SERVING,
            10,
            "the front to report NOT_SERVING without its scheduler",
        )

        async def refused() -> grpc.StatusCode | None:
            try:
                await replies(front.target, build_request(prompt="a", max_tokens=3))
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return None

        assert asyncio.run(refused()) == grpc.StatusCode.UNAVAILABLE
        # The scheduler back on its port: the front attaches again and serves.
        scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=8, port=port)
        wait_serving(front.target, timeout=30)
        done = asyncio.run(replies(front.target, build_request(prompt="a", max_tokens=6, ignore_eos=True)))
        assert sum(len(m.token_ids) for m in done) == 6
    finally:
        front.stop()
        scheduler.stop()
        worker.stop()


def test_tokens_guard_both_hops() -> None:
    """The front checks its clients' token; the scheduler checks the front's."""
    worker = start_worker(simulate_device_ms=1.0, max_num_seqs=4)
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=4, auth_token="engine-secret")
    fronts = [
        start_front(scheduler, auth_token="client-secret", scheduler_auth_token="engine-secret"),
        start_front(scheduler, scheduler_auth_token="wrong"),
    ]
    try:
        wait_serving(fronts[0].target)

        async def call(target: str, token: str) -> grpc.StatusCode | int:
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            try:
                async with grpc.aio.insecure_channel(target) as channel:
                    stub = generate_pb2_grpc.GenerationStub(channel)
                    out = [r async for r in stub.Generate(build_request(prompt="a", max_tokens=4), metadata=metadata)]
                return sum(len(m.token_ids) for m in out)
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        assert asyncio.run(call(fronts[0].target, "client-secret")) == 4
        assert asyncio.run(call(fronts[0].target, "")) == grpc.StatusCode.UNAUTHENTICATED
        # A front without the scheduler's token never attaches: it refuses, it does not hang.
        assert front_health(fronts[1]) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert asyncio.run(call(fronts[1].target, "")) == grpc.StatusCode.UNAVAILABLE
    finally:
        for front in fronts:
            front.stop()
        scheduler.stop()
        worker.stop()


def health_on_own_connection(target: str) -> int:
    """The overall health status as one new connection to `target` hears it."""
    with grpc.insecure_channel(target, options=OWN_CONNECTION) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_a_scheduler_with_fronts_serves_its_clients_through_them() -> None:
    """`--fronts 2`: the announced client port is the fronts' (both listen on it), the
    scheduler's own gRPC is elsewhere, on loopback; the fronts stop with the scheduler. The
    port is announced once both fronts serve, so no connection meets one still starting."""
    worker = start_worker(simulate_device_ms=2.0, max_num_seqs=16)
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=16, fronts=2)
    fronts = front_children(scheduler.proc.pid)
    try:
        statuses = {health_on_own_connection(scheduler.target) for _ in range(16)}
        assert statuses == {health_pb2.HealthCheckResponse.SERVING}
        assert len(fronts) == 2
        # The fronts run with the gRPC runtime defaults the scheduler's CLI set (inherited).
        for pid in fronts:
            environ = dict(
                item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
            )
            assert environ.get("GRPC_EXPERIMENTS") == GRPC_EXPERIMENTS_DEFAULT
        # Both fronts listen on the client port; the scheduler does not.
        assert all(scheduler.port in listening_ports(pid) for pid in fronts)
        assert scheduler.port not in listening_ports(scheduler.proc.pid)

        async def clients() -> list[int]:
            async def one(i: int) -> int:  # each on its own connection: the kernel spreads them
                out = await replies(
                    scheduler.target,
                    build_request(prompt=f"client {i}", max_tokens=12, ignore_eos=True),
                    OWN_CONNECTION,
                )
                return sum(len(m.token_ids) for m in out)

            return await asyncio.gather(*(one(i) for i in range(8)))

        assert asyncio.run(clients()) == [12] * 8

        # Each front reports its load on the scheduler's metrics port: its CPU time (it has
        # tokenized and streamed) and, once its calls are over, none open.
        def settled() -> dict[str, tuple[float, float]] | None:
            series = front_series(scheduler)
            names_match = set(series) == {front_name(pid) for pid in fronts}
            return series if names_match and all(calls == 0 for _, calls in series.values()) else None

        series = wait_until(settled, 10, "both fronts' series with no call open", poll=0.2)
        assert set(series) == {front_name(pid) for pid in fronts}, series
        assert all(cpu > 0 and calls == 0 for cpu, calls in series.values()), series
    finally:
        scheduler.stop()
        worker.stop()
    assert not [pid for pid in fronts if Path(f"/proc/{pid}").exists() and "Z" not in state(pid)]


def test_fronts_do_not_outlive_a_killed_scheduler() -> None:
    """SIGKILL leaves a scheduler no chance to stop its fronts: they stop by themselves, instead
    of holding the client port beside the next scheduler's fronts."""
    worker = start_worker(simulate_device_ms=2.0, max_num_seqs=4)
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=4, fronts=2)
    try:
        wait_serving(scheduler.target)
        fronts = front_children(scheduler.proc.pid)
        assert len(fronts) == 2
        scheduler.kill()
        wait_until(lambda: all(state(pid) == "Z" for pid in fronts), 15, "the fronts to exit", poll=0.2)
    finally:
        scheduler.stop()
        worker.stop()


def state(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def tcp_sockets(pid: int) -> list[tuple[str, int]]:
    """(state, local port) of each TCP socket the process `pid` holds (its sockets' inodes in
    /proc/net/tcp*; state 0A is LISTEN, 01 ESTABLISHED)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    sockets = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                sockets.append((cols[3], int(cols[1].rsplit(":", 1)[1], 16)))
    return sockets


def listening_ports(pid: int) -> set[int]:
    """TCP ports the process `pid` listens on."""
    return {port for state, port in tcp_sockets(pid) if state == "0A"}


def established_on(pid: int, port: int) -> int:
    """Connections the process `pid` holds on its local TCP `port`, established."""
    return sum(1 for state, local in tcp_sockets(pid) if state == "01" and local == port)


def test_a_client_with_connections_of_its_own_reaches_every_front() -> None:
    """gRPC shares one connection between a process's channels to a target, so one client
    process reaches one of a scheduler's fronts; channels opened with connections of their own
    (`open_channel(own_connection=True)`, `zerobubble bench --connections N`) are spread over
    all of them by the kernel."""
    worker = start_worker(simulate_device_ms=2.0, max_num_seqs=16)
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=16, fronts=2)
    try:
        wait_serving(scheduler.target)
        fronts = front_children(scheduler.proc.pid)
        settings = ChannelSettings(scheduler.target)

        async def held(own: bool, num_channels: int = 16) -> list[int]:
            async with contextlib.AsyncExitStack() as stack:
                channels = [
                    await stack.enter_async_context(open_channel(settings, own_connection=own))
                    for _ in range(num_channels)
                ]
                for channel in channels:
                    await wait_connected(channel, 10)
                per_front = [established_on(pid, scheduler.port) for pid in fronts]
                request = build_request(prompt="hello", max_tokens=4, ignore_eos=True)
                for channel in channels:
                    got = [r async for r in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30)]
                    assert sum(len(r.token_ids) for r in got) == 4
                return per_front

        shared, own = asyncio.run(held(False)), asyncio.run(held(True))
        assert sorted(shared) == [0, 1], shared
        assert sum(own) == 16 and min(own) >= 1, own

        rows = [BenchRow(index=i, kind="k", max_tokens=5, prompt=f"row {i}") for i in range(8)]
        report = asyncio.run(run_bench_async(settings, rows, concurrency=4, num_connections=3))
        assert report["num_errors"] == 0 and report["output_tokens"] == 40
    finally:
        scheduler.stop()
        worker.stop()


@pytest.mark.parametrize("stopped", ["front", "scheduler with --fronts"])
def test_stopping_lets_running_calls_through_a_front_finish(stopped: str) -> None:
    """SIGTERM to a front, or to a scheduler with its own fronts: calls already running finish
    whole (the fronts drain before the scheduler does), then the processes exit cleanly."""
    worker = start_worker(simulate_device_ms=5.0, max_num_seqs=8)
    own = stopped != "front"
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=8, fronts=1 if own else 0)
    front = None if own else start_front(scheduler)
    target = scheduler.target if own else front.target
    victim = scheduler if own else front
    try:
        wait_serving(target)

        async def run() -> list[generate_pb2.GenerateResponse]:
            got: list[generate_pb2.GenerateResponse] = []
            async with grpc.aio.insecure_channel(target) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                async for reply in stub.Generate(
                    build_request(prompt="a", max_tokens=150, ignore_eos=True), timeout=60
                ):
                    got.append(reply)
                    if len(got) == 3:
                        victim.proc.send_signal(signal.SIGTERM)
            return got

        got = asyncio.run(run())
        assert sum(len(m.token_ids) for m in got) == 150
        assert got[-1].finish_reason == generate_pb2.FINISH_REASON_MAX_TOKENS
        assert victim.proc.wait(timeout=30) == 0
    finally:
        for service in (front, scheduler, worker):
            if service is not None:
                service.stop()


def test_http_through_fronts_answers_as_the_scheduler_does() -> None:
    """`--fronts 2` serve the OpenAI API too: the same completions (streamed or not), the same
    errors for a refused request, models and health, as a scheduler serving HTTP itself."""
    worker = start_worker(simulate_device_ms=2.0, max_num_seqs=16)
    try:
        chat = {"messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 24, "temperature": 0}
        schema = {"type": "object", "properties": {"river": {"type": "string", "maxLength": 12}}, "required": ["river"]}
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
        bodies = [
            chat,
            {**chat, "n": 2, "temperature": 0.7, "seed": 3, "logprobs": True, "top_logprobs": 2},
            {**chat, "stop": ["e"]},
            # Structured output: the fronts relay the constraint, the scheduler checks it (a
            # simulated device does not enforce it: only the relaying is compared here).
            {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}},
            # A prediction: tokenized by the fronts; the usage's prediction counts relayed.
            {**chat, "prediction": {"type": "content", "content": "The Nile, the Amazon and the Danube."}},
        ]

        def answers(fronts: int) -> tuple:
            # One scheduler at a time on the one worker (a worker serves one scheduler).
            scheduler = start_scheduler([worker], max_num_seqs=16, fronts=fronts)
            try:
                wait_serving(scheduler.target)
                answered = ask_over_http(scheduler, chat, bodies, bad_schema)
                return answered, listening_ports(scheduler.proc.pid), scheduler.ports["HTTP"]
            finally:
                scheduler.stop()

        (itself, own_ports, own_http), (via_fronts, ports, http) = answers(0), answers(2)
        assert via_fronts == itself
        assert via_fronts[5] == 200 and via_fronts[2] == "data: [DONE]"
        # The stop string was met (found by the fronts, which detokenize): cut, and counted.
        stopped_choices, stopped_usage = via_fronts[0][2]
        assert stopped_choices[0]["finish_reason"] == "stop" and stopped_usage["completion_tokens"] < 24
        assert "e" not in stopped_choices[0]["message"]["content"]
        assert [status for status, _ in via_fronts[3]] == [400, 404, 400, 400]
        assert "response_format" in via_fronts[3][3][1]
        # The scheduler itself serves no HTTP then: its fronts do.
        assert own_http in own_ports and http not in ports
    finally:
        worker.stop()


def ask_over_http(scheduler: Service, chat: dict, bodies: list[dict], bad_schema: dict) -> tuple:
    """What a scheduler's HTTP port answers: each body's choices and usage, the streamed text of
    `chat` and its last event, four refusals' status and message, the models and the health."""
    import httpx

    base = f"http://127.0.0.1:{scheduler.ports['HTTP']}"
    with httpx.Client(base_url=base, timeout=60) as client:
        out = []
        for body in bodies:
            reply = client.post("/v1/chat/completions", json=body).json()
            out.append((reply["choices"], reply["usage"]))
        streamed = client.post("/v1/chat/completions", json={**chat, "stream": True}).text
        deltas = [line for line in streamed.splitlines() if line.startswith("data: ")]
        texts = "".join(
            json.loads(d[6:])["choices"][0]["delta"].get("content", "")
            for d in deltas
            if d != "data: [DONE]" and json.loads(d[6:])["choices"]
        )
        refused = [
            (r.status_code, r.json()["error"]["message"])
            for r in (
                client.post("/v1/chat/completions", json={**chat, "top_p": 2}),
                client.post("/v1/chat/completions", json={**chat, "model": "no-such-model"}),
                client.post("/v1/chat/completions", json={"messages": [], "max_tokens": 4}),
                client.post("/v1/chat/completions", json={**chat, "response_format": bad_schema}),
            )
        ]
        models = client.get("/v1/models").json()
        health = client.get("/health").status_code
    return out, texts, deltas[-1], refused, models, health


async def stream_all(
    target: str, calls: list[generate_pb2.GenerateRequest], on_reply
) -> list[list[generate_pb2.GenerateResponse]]:
    """Every call at once over one channel; `on_reply(got)` after each message, with what each
    call has received so far."""
    got: list[list[generate_pb2.GenerateResponse]] = [[] for _ in calls]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def one(i: int) -> None:
            async for reply in stub.Generate(calls[i], timeout=120):
                got[i].append(reply)
                on_reply(got)

        await asyncio.gather(*(one(i) for i in range(len(calls))))
    return got


def test_a_killed_worker_behind_a_front_loses_no_call_and_changes_no_output() -> None:
    """Failover through a front: two workers, one SIGKILLed once every call is under way. The
    scheduler moves the dead worker's requests to the other; through the front each call still
    gets exactly the tokens of a run without the fault, none lost or repeated (each message's
    running count agrees with the tokens delivered)."""
    workers = [
        start_worker(simulate_device_ms=5.0, spec_method="ngram", num_spec_tokens=3, max_num_seqs=16) for _ in range(2)
    ]
    scheduler = start_scheduler(workers, http_port=-1, max_num_seqs=16)
    front = start_front(scheduler)
    num_tokens = 150
    calls = [
        build_request(
            messages=[{"role": "user", "content": f"Question {i}: list some {topic}."}],
            max_tokens=num_tokens,
            ignore_eos=True,
            seed=i,
        )
        for i, topic in enumerate(["rivers", "primes", "poems", "planets", "cities", "colours", "trees", "stars"])
    ]

    try:
        wait_serving(front.target)
        wait_until(lambda: info(front).num_workers >= 2, 30, "the scheduler to connect to both workers")
        reference = asyncio.run(stream_all(front.target, calls, lambda got: None))
        killed_at: list[int] = []

        def kill_when_all_under_way(got: list) -> None:
            counts = [sum(len(r.token_ids) for r in replies) for replies in got]
            if not killed_at and min(counts) >= 5:
                killed_at.extend(counts)
                workers[1].proc.send_signal(signal.SIGKILL)

        faulted = asyncio.run(stream_all(front.target, calls, kill_when_all_under_way))
        workers[1].proc.wait(timeout=10)
        assert killed_at and max(killed_at) < num_tokens, killed_at
        assert "re-queueing" in "".join(scheduler.log), "the killed worker held no request: the test proved nothing"
        assert info(front).num_workers == 1
        for i, (got, expected) in enumerate(zip(faulted, reference)):
            count = 0
            for reply in got:
                count += len(reply.token_ids)
                assert reply.num_output_tokens == count, (i, reply.num_output_tokens, count)
            assert got[-1].finish_reason == generate_pb2.FINISH_REASON_MAX_TOKENS, (i, got[-1].error)
            assert tokens_by_index(got)[0][:2] == tokens_by_index(expected)[0][:2], f"call {i} changed"
            assert count == num_tokens
    finally:
        front.stop()
        scheduler.stop()
        for worker in workers:
            worker.stop()


def info(service: Service) -> generate_pb2.ModelInfoResponse:
    with grpc.insecure_channel(service.target) as channel:
        return generate_pb2_grpc.GenerationStub(channel).ModelInfo(generate_pb2.ModelInfoRequest(), timeout=10)


def test_a_killed_front_is_started_again_and_harms_no_call_of_the_other() -> None:
    """`--fronts 2`, one SIGKILLed while calls stream through both: its clients' calls end with
    UNAVAILABLE instead of hanging, the scheduler aborts what it relayed for it (nothing is left
    running), the other front's calls finish whole, and a new front takes the port again."""
    worker = start_worker(simulate_device_ms=5.0, max_num_seqs=32)
    scheduler = start_scheduler([worker], http_port=-1, max_num_seqs=32, fronts=2)
    num_clients, num_tokens = 12, 400
    try:
        wait_serving(scheduler.target)
        fronts = front_children(scheduler.proc.pid)
        assert len(fronts) == 2
        counts = [0] * num_clients
        killed: list[int] = []

        async def one(i: int) -> tuple:
            async with grpc.aio.insecure_channel(scheduler.target, options=OWN_CONNECTION) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                request = build_request(prompt=f"client {i}", max_tokens=num_tokens, ignore_eos=True)
                try:
                    async for reply in stub.Generate(request, timeout=60):
                        counts[i] += len(reply.token_ids)
                        if not killed and min(counts) >= 5:
                            killed.append(fronts[0])
                            os.kill(fronts[0], signal.SIGKILL)
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), counts[i]
                return "finished", counts[i]

        async def clients() -> list[tuple]:
            return list(await asyncio.gather(*(one(i) for i in range(num_clients))))

        outcomes = asyncio.run(clients())
        assert killed, "the front was never killed"
        lost = [o for o in outcomes if o[0] != "finished"]
        whole = [o for o in outcomes if o[0] == "finished"]
        assert lost and whole, f"every client was on one front: the test proves nothing ({outcomes})"
        assert all(code == grpc.StatusCode.UNAVAILABLE and n < num_tokens for code, n in lost), lost
        assert all(n == num_tokens for _, n in whole), whole
        # The scheduler aborted the dead front's calls: nothing left running.
        wait_until(lambda: running(scheduler) == 0, 10, "the dead front's calls to be aborted")

        # Started again: two fronts, the new one serving too.
        again = wait_fronts_restarted(scheduler, killed=fronts[0])
        assert asyncio.run(short_calls(scheduler.target, num_calls=8, max_tokens=8)) == [8] * 8
        # The killed front's series went with its stream; the new one reports in its place.
        wait_until(
            lambda: set(front_series(scheduler)) == {front_name(pid) for pid in again},
            10,
            "the new front's series in place of the killed one's",
            poll=0.2,
        )
    finally:
        scheduler.stop()
        worker.stop()


def wait_fronts_restarted(scheduler: Service, killed: int) -> list[int]:
    """Wait until the scheduler runs two fronts again, neither of them the killed one, said so
    in its log, and serves again; the fronts' pids."""

    def restarted() -> list[int] | None:
        children = front_children(scheduler.proc.pid)
        return children if len(children) == 2 else None

    again = wait_until(restarted, 30, "the killed front to be started again", poll=0.2)
    assert killed not in again
    assert any("starting it again" in line for line in scheduler.log)
    wait_serving(scheduler.target)
    return again


async def short_calls(target: str, num_calls: int, max_tokens: int) -> list[int]:
    """`num_calls` calls at once, each on a connection of its own; the tokens each received."""

    async def short(i: int) -> int:
        request = build_request(prompt=f"again {i}", max_tokens=max_tokens, ignore_eos=True)
        out = await replies(target, request, OWN_CONNECTION)
        return sum(len(m.token_ids) for m in out)

    return list(await asyncio.gather(*(short(i) for i in range(num_calls))))


def test_a_fronts_load_counts_its_open_calls_and_its_cpu() -> None:
    from zerobubble.config import FrontConfig
    from zerobubble.scheduler_svc.front import EngineLink, _Outgoing

    async def run() -> tuple:
        link = EngineLink(FrontConfig())
        link._out = _Outgoing()  # attached
        empty = link.load()
        tags = [link.open(build_request(prompt=f"p{i}", max_tokens=2))[0] for i in range(3)]
        link.close(tags[0], cancel=True)
        return empty, link.load()

    empty, two = asyncio.run(run())
    assert (empty.num_calls, two.num_calls) == (0, 2)
    assert two.name == front_name(os.getpid()) and two.cpu_seconds >= empty.cpu_seconds > 0
