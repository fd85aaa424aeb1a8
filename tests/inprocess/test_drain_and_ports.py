"""Shutdown and ports: SIGTERM drains (health NOT_SERVING, no admission, running requests finish
within --drain-timeout, the rest end CANCELLED); a used port is an error, not a shared socket;
both services' registries carry process and GC collectors.

The scheduler runs in-process with its real gRPC client API; its worker is the SimWorker
harness of tests/unit/test_reliability.py, answering each step after a short delay.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from tests.support.sim_link import FakeChannel, SimCall, sim_stub
from zerobubble import rpc
from zerobubble.api import generate_pb2, generate_pb2_grpc, worker_pb2
from zerobubble.client import build_request, complete
from zerobubble.config import SchedulerServiceConfig
from zerobubble.metrics import ServiceMetrics
from zerobubble.scheduler_svc import worker_link
from zerobubble.scheduler_svc.server import serve_scheduler

STEP_S = 0.03


class SlowSimCall(SimCall):
    """Answers every plan `STEP_S` after it was sent, in order (a worker taking time)."""

    async def write(self, plan: worker_pb2.StepPlan) -> None:
        result = self.worker.execute(plan)
        asyncio.get_running_loop().call_later(STEP_S, self.results.put_nowait, result)


SlowStub = sim_stub(call=SlowSimCall, name="slow")


def test_sigterm_drains_running_requests_then_cancels_the_rest(monkeypatch) -> None:
    monkeypatch.setattr(worker_link.worker_pb2_grpc, "WorkerStub", SlowStub)
    monkeypatch.setattr(worker_link.rpc, "aio_channel", FakeChannel)
    cfg = SchedulerServiceConfig(host="127.0.0.1", port=0, metrics_port=-1, http_port=-1, drain_timeout=0.6)

    async def scenario():
        stop, ready, bound = asyncio.Event(), asyncio.Event(), []
        server = asyncio.create_task(serve_scheduler(cfg, ["slow:1"], ready, stop, bound))
        await ready.wait()
        target = f"127.0.0.1:{bound[-1][1]}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            while (
                await health.Check(health_pb2.HealthCheckRequest())
            ).status != health_pb2.HealthCheckResponse.SERVING:
                await asyncio.sleep(0.02)
            started = {"short": asyncio.Event(), "long": asyncio.Event()}

            def go(name: str, max_tokens: int):
                request = build_request(token_ids=[97, 98, 99, 32, 120], max_tokens=max_tokens, ignore_eos=True, seed=7)
                return asyncio.create_task(
                    complete(
                        stub, request, timeout=30, on_response=lambda r: started[name].set() if r.token_ids else None
                    )
                )

            short, long = go("short", 12), go("long", 120)
            await started["short"].wait()
            await started["long"].wait()
            stop.set()  # what SIGTERM does (rpc.install_stop_signals)
            await asyncio.sleep(0.1)
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await complete(stub, build_request(token_ids=[97], max_tokens=2), timeout=10)
            results = await asyncio.gather(short, long)
        await asyncio.wait_for(server, 10)
        return status, refused.value, results

    status, refused, (short, long) = asyncio.run(scenario())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
    assert short.finish_reason == "max_tokens" and len(short.token_ids) == 12
    assert long.finish_reason == "cancelled", (long.finish_reason, long.error)
    assert 0 < len(long.token_ids) < 120


def test_a_second_server_on_a_used_port_fails_clearly() -> None:
    async def scenario():
        first = grpc.aio.server(options=rpc.SERVER_OPTIONS)
        port = rpc.bind(first, "127.0.0.1", 0, None)
        await first.start()
        second = grpc.aio.server(options=rpc.SERVER_OPTIONS)
        try:
            with pytest.raises(OSError, match="in use"):
                rpc.bind(second, "127.0.0.1", port, None)
        finally:
            await first.stop(None)

    asyncio.run(scenario())


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_registries_carry_process_and_gc_collectors(role: str) -> None:
    text = generate_latest(ServiceMetrics(model="m", role=role).registry).decode()
    assert "process_resident_memory_bytes" in text
    assert "python_gc_collections_total" in text


def test_client_deadline_frees_blocks_and_a_stalled_reader_gets_everything(monkeypatch) -> None:
    """A deadline aborts the request and returns its KV blocks; a client that stops reading
    does not hold up another stream, and when it reads again it gets every token exactly once
    (the events waiting behind a blocked write go out merged, see `merge_pending`)."""
    from tests.support.metrics_scrape import scrape, total

    monkeypatch.setattr(worker_link.worker_pb2_grpc, "WorkerStub", SlowStub)
    monkeypatch.setattr(worker_link.rpc, "aio_channel", FakeChannel)
    cfg = SchedulerServiceConfig(host="127.0.0.1", port=0, metrics_port=0, http_port=-1, drain_timeout=0.1)

    def request(max_tokens: int):
        return build_request(token_ids=[120, 121, 122, 32, 97], max_tokens=max_tokens, ignore_eos=True, seed=11)

    async def scenario():
        stop, ready, bound = asyncio.Event(), asyncio.Event(), []
        server = asyncio.create_task(serve_scheduler(cfg, ["slow:1"], ready, stop, bound))
        await ready.wait()
        ports = dict(bound)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            while True:
                try:
                    await stub.ModelInfo(generate_pb2.ModelInfoRequest(), timeout=5)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as expired:
                await complete(stub, request(100), timeout=0.3)
            await asyncio.sleep(0.2)
            kv = total(await asyncio.to_thread(scrape, ports["metrics"]), "zerobubble_kv_cache_usage_ratio")
            reference = await complete(stub, request(60), timeout=30)
            stalled = stub.Generate(request(60), timeout=30)
            first = await stalled.read()  # then it stops reading
            other = await complete(
                stub, build_request(token_ids=[97, 98], max_tokens=20, ignore_eos=True, seed=3), timeout=30
            )
            await asyncio.sleep(1.0)  # the stalled request finishes meanwhile
            replies = [first]
            while (reply := await stalled.read()) is not grpc.aio.EOF:
                replies.append(reply)
        stop.set()
        await asyncio.wait_for(server, 10)
        return expired.value, kv, reference, replies, other

    expired, kv, reference, replies, other = asyncio.run(scenario())
    assert expired.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert kv == 0.0
    assert other.finish_reason == "max_tokens" and len(other.token_ids) == 20
    tokens = [t for r in replies for t in r.token_ids]
    assert tokens == reference.token_ids and len(tokens) == 60
    assert replies[-1].num_output_tokens == 60
