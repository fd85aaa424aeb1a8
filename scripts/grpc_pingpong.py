"""What one gRPC message costs in Python: a bidi stream between two processes on loopback,
ping-pong (one message each way per round trip), the server and the client each on the asyncio
API or the synchronous one; raw bytes, no protobuf. Reports wall time and each side's CPU per
round trip.

    python scripts/grpc_pingpong.py --rounds 2 --messages 3000 --size 2048

The scheduler's link to a worker is one such stream (a plan out, a result back per step), and
each client stream of the scheduler pays the sending side once per message.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from pathlib import Path

import grpc
from bench_sim import cpu_seconds  # this script's folder is on the path

SERVICE, METHOD = "pingpong.PingPong", "Echo"
NUM_WARMUP = 100


def _handler(echo) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.stream_stream_rpc_method_handler(echo)})


def serve(api: str, port_file: Path) -> None:
    """Echo every message back until killed; the bound port is written to `port_file`."""
    if api == "aio":

        async def echo_async(requests: AsyncIterator[bytes], context) -> AsyncIterator[bytes]:
            async for message in requests:
                yield message

        async def main() -> None:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((_handler(echo_async),))
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            port_file.write_text(str(port))
            await server.wait_for_termination()

        asyncio.run(main())
        return

    def echo(requests: Iterator[bytes], context) -> Iterator[bytes]:
        yield from requests

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_handler(echo),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_file.write_text(str(port))
    server.wait_for_termination()


def ping(api: str, port: int, num_messages: int, size: int) -> tuple[float, float]:
    """(wall s, this process's CPU s) for `num_messages` round trips after a warm-up."""
    message = os.urandom(size)
    method = f"/{SERVICE}/{METHOD}"
    if api == "aio":

        async def main() -> tuple[float, float]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_stream(method)()
                for i in range(NUM_WARMUP + num_messages):
                    if i == NUM_WARMUP:
                        t0, c0 = time.perf_counter(), time.process_time()
                    await call.write(message)
                    await call.read()
                figures = time.perf_counter() - t0, time.process_time() - c0
                await call.done_writing()
                return figures

        return asyncio.run(main())

    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

    def requests() -> Iterator[bytes]:
        while (item := outbox.get()) is not None:
            yield item

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    responses = channel.stream_stream(method)(requests())
    for i in range(NUM_WARMUP + num_messages):
        if i == NUM_WARMUP:
            t0, c0 = time.perf_counter(), time.process_time()
        outbox.put(message)
        next(responses)
    figures = time.perf_counter() - t0, time.process_time() - c0
    outbox.put(None)
    channel.close()
    return figures


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], Path(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--messages", type=int, default=3000)
    p.add_argument("--size", type=int, default=2048, help="bytes per message")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for server_api in ("aio", "sync"):
                for client_api in ("aio", "sync"):
                    port_file = Path(tmp) / f"port-{round_}-{server_api}-{client_api}"
                    server = subprocess.Popen([sys.executable, __file__, "serve", server_api, str(port_file)])
                    try:
                        while not port_file.exists() or not port_file.read_text():
                            time.sleep(0.05)
                        server_cpu = cpu_seconds(server.pid)
                        wall, cpu = ping(client_api, int(port_file.read_text()), args.messages, args.size)
                        server_cpu = cpu_seconds(server.pid) - server_cpu
                    finally:
                        server.kill()
                        server.wait()
                    us = 1e6 / args.messages
                    print(
                        f"server {server_api:4} client {client_api:4}: {wall * us:6.1f} us per round trip, "
                        f"CPU client {cpu * us:6.1f} us, server {server_cpu * us:6.1f} us",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
