"""The floor of one gRPC message per stream per step: what `bench_sim.py host` would read with
nothing but the transport in the way.

N server-streaming `Generate` calls of the real service definition, over `--connections`
connections dealt out to `--servers` bare server processes (a port each, as `bench_sim.py
--via front-ports`). The servers send one-token replies shaped as a scheduler's decode replies
(a request id, one token, counts): in steps, a reply for every open call at once through a
queue per call as the services hand them over (`steps`), or each call as fast as gRPC takes
them (`free`). No scheduler, no worker, no tokenizer: the servers' and the client's gRPC and
protobuf work per reply and nothing else, on the services' event loop (uvloop where installed),
channel settings and gRPC defaults. Reports, per step (one reply to each of the N streams), the
wall time the clients saw and the CPU of the servers and of the client.

    python scripts/grpc_fanout.py --requests 64 256 --servers 1 2 --repeats 2

Read beside `bench_sim.py host` at the same N: the difference is what the scheduler, the worker
and the fronts' relaying add to the transport's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

# bench_sim first: it sets the services' gRPC defaults, which gRPC reads when it is imported.
# isort: off
from bench_sim import Settling, cpu_seconds, stubs  # this script's folder is on the path
import grpc
from zerobubble.scheduler_svc.front import join_replies
from zerobubble import rpc
from zerobubble.api import generate_pb2, generate_pb2_grpc
from zerobubble.event_loop import run_loop
from zerobubble.tools.launch import launch

# isort: on

SETTLE = 0.1  # the window opens once every stream has this share of its replies


def token_reply(request_id: str, i: int, max_tokens: int) -> generate_pb2.GenerateResponse:
    """The `i`-th one-token reply of a call, the first with the prompt's count and the last with
    its finish reason, as a scheduler's replies carry them."""
    reply = generate_pb2.GenerateResponse(request_id=request_id, token_ids=[i % 50000], num_output_tokens=i + 1)
    if i == 0:
        reply.num_prompt_tokens = 16
    if i + 1 == max_tokens:
        reply.finish_reason = generate_pb2.FINISH_REASON_MAX_TOKENS
    return reply


class FreeFanout(generate_pb2_grpc.GenerationServicer):
    """Each call yields its replies as fast as gRPC takes them: the transport alone."""

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        for i in range(request.stopping.max_tokens):
            yield token_reply(request.request_id, i, request.stopping.max_tokens)


class StepFanout(generate_pb2_grpc.GenerationServicer):
    """Replies come in steps, as from a scheduler: one task puts a reply into the queue of every
    open call, then waits until at most one step is still queued (two plans in flight), and each
    call's coroutine takes its replies from its queue, joining those that queued up into one
    message as the services do. What a front or the scheduler's direct path cannot avoid."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[asyncio.Queue, int]] = {}  # request id -> (queue, max tokens)
        self.num_queued = 0  # replies put and not yet taken, over all calls
        self.step_size = 0  # calls in the latest step
        self.drained = asyncio.Event()
        self.stepper: asyncio.Task | None = None

    async def _steps(self) -> None:
        sent: dict[str, int] = {}
        while self.calls:
            self.step_size = len(self.calls)
            for request_id, (queue, max_tokens) in list(self.calls.items()):
                i = sent.get(request_id, 0)
                queue.put_nowait(token_reply(request_id, i, max_tokens))
                sent[request_id] = i + 1
                if i + 1 == max_tokens:
                    del self.calls[request_id]
            self.num_queued += self.step_size
            if self.num_queued > self.step_size:
                self.drained.clear()
                await self.drained.wait()
            await asyncio.sleep(0)  # let calls that arrived meanwhile register
        self.stepper = None

    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        queue: asyncio.Queue = asyncio.Queue()
        self.calls[request.request_id] = (queue, request.stopping.max_tokens)
        if self.stepper is None:
            self.stepper = asyncio.create_task(self._steps())
        while True:
            replies = [await queue.get()]
            while not queue.empty():
                replies.append(queue.get_nowait())
            self.num_queued -= len(replies)
            if self.num_queued <= self.step_size:
                self.drained.set()
            (reply,) = join_replies(replies)  # one call, one sequence: one message
            yield reply
            if reply.finish_reason:
                return


SERVICERS = {"free": FreeFanout, "steps": StepFanout}


def serve(mode: str) -> None:
    """Serve replies the way `mode` names (`SERVICERS`) until killed; the bound port is
    announced as the services announce theirs (`FANOUT`)."""

    async def main() -> None:
        server = grpc.aio.server(options=rpc.SERVER_OPTIONS)
        generate_pb2_grpc.add_GenerationServicer_to_server(SERVICERS[mode](), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        rpc.announce_port("FANOUT", port)
        await server.wait_for_termination()

    with rpc.tuned_gc():
        run_loop(main(), "auto")


async def drive(
    targets: list[str], num_requests: int, max_tokens: int, server_pids: list[int], args: argparse.Namespace
) -> tuple[float, int, float, float]:
    """Start N calls at once over `--connections` (`bench_sim.stubs`); between the moment every
    stream has `SETTLE` of its replies and the moment the first one ends: (seconds, replies per
    stream, the servers' CPU seconds, this process's CPU seconds)."""
    streams = Settling([0] * num_requests, max(1, int(SETTLE * max_tokens)))
    marks: list[tuple[float, int, float, float]] = []
    stopping = generate_pb2.StoppingCriteria(max_tokens=max_tokens)

    async def mark(event: asyncio.Event) -> None:
        await event.wait()
        servers = sum(cpu_seconds(pid) for pid in server_pids)
        marks.append((time.perf_counter(), sum(streams.counts), servers, time.process_time()))
        if event is streams.first_done and not streams.all_settled.is_set():
            raise RuntimeError("a stream ended before every stream had settled: no window (raise --max-tokens)")

    requests = [generate_pb2.GenerateRequest(request_id=f"r{i}", stopping=stopping) for i in range(num_requests)]
    async with stubs(targets, args) as all_stubs:
        reads = [streams.read(i, all_stubs[i % len(all_stubs)].Generate(r)) for i, r in enumerate(requests)]
        await asyncio.gather(mark(streams.all_settled), mark(streams.first_done), *reads)
    if any(count != max_tokens for count in streams.counts):
        raise RuntimeError(f"a stream ended short of its {max_tokens} replies: {sorted(set(streams.counts))}")
    (t0, n0, s0, c0), (t1, n1, s1, c1) = marks
    return t1 - t0, (n1 - n0) // num_requests, s1 - s0, c1 - c0


def measure(num_requests: int, num_servers: int, mode: str, args: argparse.Namespace) -> dict:
    """One run: fresh server processes, the clients in this process."""
    servers = []
    try:
        for _ in range(num_servers):
            servers.append(launch([sys.executable, __file__, "serve", mode], ("FANOUT",), timeout=60.0))
        targets = [f"127.0.0.1:{server.ports['FANOUT']}" for server in servers]
        # Calls are taken in over many steps while the first ones stream: at 256 calls and
        # 640 replies each the first call ended before the last had its 10 %, and no window.
        max_tokens = args.max_tokens or 256 + num_requests * 4
        pids = [server.proc.pid for server in servers]
        wall, per_stream, server_cpu, client_cpu = run_loop(
            drive(targets, num_requests, max_tokens, pids, args), "auto"
        )
    finally:
        for server in servers:
            server.kill()
    replies = num_requests * per_stream  # a token each
    return {
        "requests": num_requests,
        "servers": num_servers,
        "mode": mode,
        "replies_per_stream": per_stream,
        "ms_per_step": 1e3 * wall / per_stream,
        "server_us_per_reply": 1e6 * server_cpu / replies,
        "client_us_per_reply": 1e6 * client_cpu / replies,
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    p.add_argument("--servers", type=int, nargs="+", default=[1, 2], help="server processes, a port each")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=sorted(SERVICERS),
        default=["steps", "free"],
        help="steps: a step's replies at once, queued per call as the services do; free: each call as fast as it can",
    )
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=0, help="replies per stream (0: 256 + 4 N)")
    p.add_argument("--repeats", type=int, default=2, help="rounds over every configuration, interleaved")
    p.add_argument("--json", type=Path, help="also write every run's figures here (JSON)")
    args = p.parse_args()
    figures: dict[tuple[int, str, int], list[dict]] = {}
    for _ in range(args.repeats):
        for n in args.requests:
            for mode in args.modes:
                for s in args.servers:
                    f = measure(n, s, mode, args)
                    figures.setdefault((n, mode, s), []).append(f)
                    print(
                        f"N {n:4} {mode:5} servers {s}: {f['ms_per_step']:6.2f} ms per step; CPU per reply: "
                        f"servers {f['server_us_per_reply']:5.1f} us, client {f['client_us_per_reply']:5.1f} us",
                        flush=True,
                    )
    if args.json:
        args.json.write_text(json.dumps([f for runs in figures.values() for f in runs], indent=1))
    print("\n| N | replies | servers | ms / step, median (runs) | servers' CPU µs / reply | client's CPU µs / reply |")
    print("|---|---|---|---|---|---|")
    for (n, mode, s), runs in figures.items():
        steps = ", ".join(f"{f['ms_per_step']:.2f}" for f in runs)
        print(
            f"| {n} | {mode} | {s} | {statistics.median(f['ms_per_step'] for f in runs):.2f} ({steps}) | "
            f"{statistics.median(f['server_us_per_reply'] for f in runs):.1f} | "
            f"{statistics.median(f['client_us_per_reply'] for f in runs):.1f} |"
        )


if __name__ == "__main__":
    main()
