"""How many new calls a second a `grpc.aio` server takes in while its event loop is busy.

    python scripts/grpc_accept.py --busy-ms 0 0.5 1 3 6

A server here answers each `Generate` call with one message; a client process keeps
`--clients` calls open at all times, each sending its next call as soon as the last one ended.
Every turn of the server's loop also runs `--busy-ms` of other work (one callback that spins),
as a scheduler's loop runs its planning, result handling and client streams. Reported: calls
completed a second, loop turns a second, and turns per call.

grpc's asyncio server takes new calls in one at a time (its accept loop awaits each before
asking for the next), and each takes several turns of the loop to come in. So while every turn
of the loop is long, the server takes in new calls at a fraction of the turn rate however many
clients are waiting (2026-12-04, 2-core VM: about five turns per call; 1 ms of other work in
every turn capped it at 190 calls a second, 3 ms at 68). A service whose loop runs long turns
back to back (a scheduler with hundreds of streams written per step and no idle moment) would
admit new requests no faster than that. The scheduler's loop is not there yet: under
`scripts/bench_sim.py churn` at 256 clients it ran 5-11 thousand turns a second, median
0.01 ms (every turn of the standard library's loop timed).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from zerobubble.api import generate_pb2, generate_pb2_grpc  # noqa: E402

# The client process: `--clients` calls kept open; prints calls completed per second.
CLIENT = """
import asyncio, sys, time
sys.path.insert(0, sys.argv[4])
import grpc
from zerobubble.api import generate_pb2, generate_pb2_grpc

async def main(target, num_clients, seconds):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        done, stop = [0], asyncio.Event()

        async def client():
            while not stop.is_set():
                async for _ in stub.Generate(generate_pb2.GenerateRequest()):
                    pass
                done[0] += 1

        tasks = [asyncio.create_task(client()) for _ in range(num_clients)]
        await asyncio.sleep(1.0)  # every client has a call open
        start, count = time.perf_counter(), done[0]
        await asyncio.sleep(seconds)
        rate = (done[0] - count) / (time.perf_counter() - start)
        stop.set()
        await asyncio.gather(*tasks)
    print(rate)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
"""


class OneMessage(generate_pb2_grpc.GenerationServicer):
    """Answers every call with one message."""

    async def Generate(self, request, context):
        yield generate_pb2.GenerateResponse(token_ids=[1])


async def measure(busy_ms: float, num_clients: int, seconds: float) -> dict:
    """Calls a second and loop turns a second with `busy_ms` of other work in every turn."""
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(OneMessage(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    loop = asyncio.get_running_loop()
    turns = [0]
    spinning = [True]

    def other_work() -> None:
        # One callback per turn: it schedules itself again, so it runs once in every turn.
        turns[0] += 1
        end = time.perf_counter() + busy_ms / 1000
        while time.perf_counter() < end:
            pass
        if spinning[0]:
            loop.call_soon(other_work)

    loop.call_soon(other_work)
    try:
        started, turns0 = time.perf_counter(), turns[0]
        client = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLIENT,
            f"127.0.0.1:{port}",
            str(num_clients),
            str(seconds),
            str(ROOT),
            stdout=subprocess.PIPE,
        )
        out, _ = await client.communicate()
        turns_per_s = (turns[0] - turns0) / (time.perf_counter() - started)
    finally:
        spinning[0] = False
        await server.stop(None)
    if client.returncode != 0:
        raise RuntimeError(f"the client process failed ({client.returncode})")
    calls_per_s = float(out.decode().split()[-1])
    return {"busy_ms": busy_ms, "calls_per_s": calls_per_s, "turns_per_s": turns_per_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy-ms", type=float, nargs="+", default=[0.0, 0.5, 1.0, 3.0, 6.0])
    parser.add_argument("--clients", type=int, default=64, help="calls the client keeps open")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--event-loop", choices=("asyncio", "uvloop"), default="asyncio")
    args = parser.parse_args()
    if args.event_loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    for busy_ms in args.busy_ms:
        r = asyncio.run(measure(busy_ms, args.clients, args.seconds))
        per_call = r["turns_per_s"] / r["calls_per_s"] if r["calls_per_s"] else float("inf")
        print(
            f"other work {busy_ms:g} ms per turn: {r['calls_per_s']:.0f} calls/s, "
            f"{r['turns_per_s']:.0f} turns/s, {per_call:.1f} turns per call",
            flush=True,
        )


if __name__ == "__main__":
    main()
