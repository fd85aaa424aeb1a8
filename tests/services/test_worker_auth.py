"""The worker API is closed: `Execute`/`Describe` need the scheduler's worker token.

Real processes on loopback: a worker started with ZEROBUBBLE_AUTH_TOKEN and a scheduler with
ZEROBUBBLE_WORKER_AUTH_TOKEN. A stranger (no token, wrong token) gets UNAUTHENTICATED on both
methods while a client stream is running, and that stream is untouched (a stranger's `Execute`
used to supersede the scheduler's stream and reset the worker); health stays open for probes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.servers import start_scheduler, start_worker, wait_serving
from zerobubble.api import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from zerobubble.client import build_request, complete

pytestmark = pytest.mark.timeout(300)

WORKER_TOKEN = "worker-s3cret"


@pytest.fixture(scope="module")
def closed_cluster(smollm2_dir):
    worker = start_worker(kv_cache_memory_gb=0.1, max_num_seqs=4, env={"ZEROBUBBLE_AUTH_TOKEN": WORKER_TOKEN})
    scheduler = start_scheduler([worker], env={"ZEROBUBBLE_WORKER_AUTH_TOKEN": WORKER_TOKEN})
    try:
        wait_serving(scheduler.target)
        yield scheduler, worker
    finally:
        scheduler.stop()
        worker.stop()


def stranger_calls(target: str, metadata) -> list:
    """A peer that reached the port: Describe, then an Execute stream with a plan, then health.

    The blocking client, on purpose: grpc.aio's `call.write` races the server's immediate
    refusal, and when it loses it replaces the call's status with a client-side INTERNAL
    (about 1 stranger in 15 under load). The blocking client sends the plan from its request
    iterator and reports the status the server sent.
    """
    codes: list = []
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            stub.Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=metadata)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
        try:
            for _ in stub.Execute(iter([worker_pb2.StepPlan(step_id=1)]), metadata=metadata, timeout=10):
                break
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
        health = health_pb2_grpc.HealthStub(channel)
        codes.append(health.Check(health_pb2.HealthCheckRequest(), timeout=10).status)
    return codes


def test_strangers_are_refused_and_the_running_stream_is_untouched(closed_cluster):
    scheduler, worker = closed_cluster

    async def scenario():
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            first = asyncio.Event()
            request = build_request(prompt="Count from one to fifty: one, two,", max_tokens=12, ignore_eos=True)
            task = asyncio.create_task(
                complete(stub, request, timeout=120, on_response=lambda r: first.set() if r.token_ids else None)
            )
            await first.wait()
            strangers = (None, (("authorization", "Bearer wrong"),))
            refused = [await asyncio.to_thread(stranger_calls, worker.target, md) for md in strangers]
            done = await task
            reference = await complete(stub, request, timeout=120)
        return refused, done, reference

    refused, done, reference = asyncio.run(scenario())
    for codes in refused:
        assert codes == [
            grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.UNAUTHENTICATED,
            health_pb2.HealthCheckResponse.SERVING,
        ], codes
    assert done.finish_reason == "max_tokens", (done.finish_reason, done.error)
    assert done.token_ids == reference.token_ids  # greedy: the stream went on undisturbed
    assert "scheduler stream 2 opened" not in "".join(worker.log)


def test_scheduler_without_the_worker_token_is_refused(closed_cluster, caplog):
    """A scheduler with no or the wrong worker token never gets a worker (and says why)."""
    _, worker = closed_cluster
    wrong = start_scheduler([worker], env={"ZEROBUBBLE_WORKER_AUTH_TOKEN": "nope"})
    try:
        with pytest.raises(TimeoutError):
            wait_serving(wrong.target, timeout=4)
    finally:
        wrong.stop()
    assert "refused our token" in "".join(wrong.log)


def test_a_new_stream_supersedes_an_idle_one(closed_cluster):
    """A restarted scheduler (here: a peer with the token) gets the worker at once even though
    the current scheduler's stream is idle and sends nothing that would end it; the current
    scheduler then reconnects and serves again."""
    scheduler, worker = closed_cluster

    async def scenario():
        md = (("authorization", f"Bearer {WORKER_TOKEN}"),)
        async with grpc.aio.insecure_channel(worker.target) as channel:
            call = worker_pb2_grpc.WorkerStub(channel).Execute(metadata=md)
            await call.write(worker_pb2.StepPlan(step_id=1))
            result = await asyncio.wait_for(call.read(), 20)
            call.cancel()
        async with grpc.aio.insecure_channel(scheduler.target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            for _ in range(100):
                try:
                    done = await complete(stub, build_request(prompt="Hello", max_tokens=3), timeout=60)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.2)  # between its link's reconnect attempts
        return result, done

    result, done = asyncio.run(scenario())
    assert result.step_id == 1 and not result.error
    assert done.finish_reason in ("max_tokens", "eos"), (done.finish_reason, done.error)
