"""Host cost per step and the bubble, measured against a simulated device (no model, no GPU).

    python scripts/bench_sim.py host     # host ms per step, zero-time device: 1/16/64/256 requests, k=0 and k=3
    python scripts/bench_sim.py bubble   # device 2/5/10/20 ms x 16/64/256 requests x n-gram on/off: async / sync
    python scripts/bench_sim.py logic    # the scheduler's and worker's step logic alone, one process, no gRPC
    python scripts/bench_sim.py churn    # requests arriving and ending all the time: device busy, host cost per request

`host` and `bubble` run the real services as processes (`zerobubble worker --simulate-device-ms
MS`, `zerobubble scheduler`) and this script as the gRPC client, so a step's figure covers the
whole path: plan -> protobuf -> gRPC -> worker (plan decoding, slots, input assembly, proposer
bookkeeping, result) -> gRPC -> reconcile -> detokenize -> client streams. `logic` takes the
transport away: the scheduler's and the worker's step code in this one process (plans and
results still through protobuf bytes), to tell their cost apart from gRPC's and the streams'.

A run sends N short chat prompts at once, each with the same `max_tokens` (the simulated tokens
never include EOS). Figures cover the steady state only: the window from the moment every
request has streamed its first token (all N are decoding) to the moment the first one finishes;
the scheduler's step and worker counters (`ModelInfo.stats`) are read at both ends. So ms per
step = window / steps in it, throughput = tokens streamed in it / window. The CPU time each
process (scheduler, worker, this client) used in the window is read from /proc at both ends too:
on a machine with fewer cores than busy processes, ms per step is bounded below by their sum
divided by the cores, whatever the critical path. Configurations that
are compared are run back to back (sync, async, sync, async ...) because the machine is shared.

`churn` keeps N requests running the way a serving system sees them: N clients, each sending
its next request the moment its last one ends, with output lengths drawn from
`--output-tokens LO HI` (seeded), so that requests arrive, prefill and finish every step. The
window is `--seconds` long and starts once `--warmup-s` have passed; besides the device's busy
fraction it reports requests per second, the scheduler's CPU per request and as a share of a
core (its loop is one thread: near 1.0, the host is what the device waits for), and what the
clients saw: time to first token of the requests sent in the window and the gaps between a
stream's replies (p50 and p99). Sync and
async runs alternate, as in `bubble`.

`--placement` says where the three processes run: `shared` (the default) lets the kernel move
every thread across all cores; `apart` gives the scheduler's event-loop thread the first core
to itself (`--loop-cores`) and puts every other thread (the scheduler's gRPC threads, the
worker, this client) on the others, as a deployment that gives the scheduler's loop a core of
its own would. `--placement shared apart` measures both, the
runs alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerobubble.config import EVENT_LOOPS, apply_grpc_defaults, parse_cores  # noqa: E402

apply_grpc_defaults(os.environ)  # this client as the services run (before grpc is imported)

from zerobubble.api import generate_pb2, generate_pb2_grpc  # noqa: E402
from zerobubble.bench import BenchRow, percentile  # noqa: E402
from zerobubble.client import ChannelSettings, build_request, open_channel  # noqa: E402
from zerobubble.event_loop import run_loop  # noqa: E402
from zerobubble.request_options import StoppingOptions  # noqa: E402
from zerobubble.rpc import bind_process  # noqa: E402
from zerobubble.tools.launch import (  # noqa: E402
    Service,
    front_children,
    start_front,
    start_scheduler,
    start_worker,
    wait_serving,
)

TOPICS = ("rivers", "compilers", "bread", "volcanoes", "chess", "bridges", "owls", "tides")


def rows(num_requests: int, max_tokens: int) -> list[BenchRow]:
    """Short, distinct chat prompts (about 40 tokens with SmolLM2's template)."""
    return [
        BenchRow(
            index=i,
            kind="sim",
            max_tokens=max_tokens,
            messages=[{"role": "user", "content": f"Request {i}: write a long essay about {TOPICS[i % len(TOPICS)]}."}],
        )
        for i in range(num_requests)
    ]


def steady_requests(num_requests: int, max_tokens: int, args: argparse.Namespace) -> list:
    """The requests of a steady-state run: the chat `rows`, or, where the caller set
    ``args.prompt_token_ids`` (a model without a chat template, as the device check's random
    ones), those prompts in turn, EOS ignored so that every request runs to `max_tokens`."""
    prompts = getattr(args, "prompt_token_ids", None)
    if prompts:
        return [
            build_request(token_ids=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for i in range(num_requests)
        ]
    return [build_request(messages=r.messages, max_tokens=max_tokens) for r in rows(num_requests, max_tokens)]


PLACEMENTS = ("shared", "apart")
ALL_CORES = frozenset(os.sched_getaffinity(0))  # taken before this client binds itself


def placement_cores(placement: str) -> tuple[str, str]:
    """The scheduler's `--loop-cores` and the worker's `--cpu-affinity` (this client's cores
    too) under `placement`."""
    if placement == "shared":
        return "", ""
    cores = sorted(ALL_CORES)
    if len(cores) < 2:
        raise SystemExit("--placement apart needs at least 2 cores")
    # The first core: on the 2-vCPU benchmark host the second one takes the disk's interrupts,
    # and the scheduler (the critical path) ran 10-20 % slower there than on the first.
    return str(cores[0]), ",".join(map(str, cores[1:]))


@contextmanager
def sim_worker(device_ms: float, spec: str, args: argparse.Namespace, placement: str = "shared") -> Iterator[Service]:
    worker = start_worker(
        simulate_device_ms=device_ms,
        spec_method=spec,
        num_spec_tokens=3,
        max_num_seqs=256,
        kv_cache_memory_gb=args.kv_gb,
        simulate_acceptance_rate=args.acceptance_rate,
        event_loop=args.event_loop,
        cpu_affinity=placement_cores(placement)[1],
    )
    try:
        yield worker
    finally:
        worker.stop()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU time of a process (or of its thread `tid`) so far (Linux /proc; 0.0
    where there is none)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU time so far of each thread of a process, by thread id."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return {}
    return {tid: cpu_seconds(pid, tid) for tid in tids}


@dataclass(slots=True)
class Window:
    """What a driver saw in its measuring window: the scheduler's stats at both ends, the tokens
    streamed and requests finished in it, its length, and each process's CPU in it (the process
    and its busiest thread, in seconds)."""

    first: generate_pb2.ServerStats
    last: generate_pb2.ServerStats
    num_tokens: int
    num_finished: int
    wall_s: float
    cpu: dict[str, tuple[float, float]]
    # Client-side latencies in the window (churn only): time to first token of each request
    # sent in it, and the gaps between consecutive replies of a stream.
    ttft_s: list[float] = field(default_factory=list)
    reply_gaps_s: list[float] = field(default_factory=list)


# A client load against a scheduler: (targets, N, the processes' pids, options) -> its window.
Driver = Callable[[list[str], int, dict[str, int], argparse.Namespace], Awaitable[Window]]


def _drive_scheduler(
    worker: Service,
    num_requests: int,
    window: int,
    args: argparse.Namespace,
    placement: str,
    drive: Driver | None,
    via: str,
) -> Window:
    """Start a fresh scheduler (and fronts, per ``via``) in front of `worker`, load it with
    `drive`, stop them: the driver's window."""
    scheduler_cores, client_cores = placement_cores(placement)
    scheduler = start_scheduler(
        [worker],
        max_inflight_steps=window,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        stream_interval=args.stream_interval,
        event_loop=args.event_loop,
        loop_cores=scheduler_cores,
        http_port=-1,  # gRPC only (the HTTP front needs FastAPI, which a GPU image may lack)
        fronts=args.num_fronts if via == "fronts" else 0,
    )
    pids = {"scheduler": scheduler.proc.pid, "worker": worker.proc.pid, "client": os.getpid()}
    for i, pid in enumerate(front_children(scheduler.proc.pid) if via == "fronts" else ()):
        pids[f"front {i + 1}"] = pid
    num_by_hand = {"front": 1, "front-ports": args.num_fronts}.get(via, 0)
    fronts: list[Service] = []
    try:
        wait_serving(scheduler.target)
        for i in range(num_by_hand):
            front = start_front(scheduler, cpu_affinity=client_cores, event_loop=args.event_loop)
            fronts.append(front)
            pids["front" if num_by_hand == 1 else f"front {i + 1}"] = front.proc.pid
        targets = [front.target for front in fronts] or [scheduler.target]
        for target in targets:
            wait_serving(target)
        if client_cores:  # only while it runs: processes started later must not inherit it
            bind_process(parse_cores(client_cores))
        return run_loop((drive or steady_state)(targets, num_requests, pids, args), args.event_loop)
    finally:
        if client_cores:
            bind_process(ALL_CORES)
        for front in fronts:
            front.stop()
        scheduler.stop()


def window_figures(seen: Window, num_requests: int, device_ms: float) -> dict:
    """The figures of a driver's window (per step, per second, per request)."""
    first, last, wall = seen.first, seen.last, seen.wall_s
    steps = last.num_steps - first.num_steps
    if steps <= 0:
        raise RuntimeError("no step in the measuring window")
    idle = last.worker_idle_s - first.worker_idle_s
    busy = last.worker_busy_s - first.worker_busy_s
    drafts = last.num_draft_tokens - first.num_draft_tokens
    generated = last.num_generation_tokens - first.num_generation_tokens
    accepted = last.num_accepted_tokens - first.num_accepted_tokens
    # A row's step yields one sampled token plus its accepted drafts, so a step over all N rows
    # yields N * generated / (generated - accepted) tokens.
    rows_per_step = (generated - accepted) / steps
    full_step_tokens = num_requests * generated / (generated - accepted) if generated > accepted else num_requests
    figures = {
        "ms_per_step": 1000 * wall / steps,
        # The pace of full N-row steps as the clients received their tokens: above ms_per_step
        # when the scheduler runs ahead of the replies' delivery (a front that cannot keep up),
        # so that a cheaper loop does not pass for a cheaper full path. Normalised by a full
        # step's tokens, not the window's: a front far enough behind leaves the scheduler
        # with fewer than N rows (finished there, still streaming here) while its clients
        # drain the backlog, and their pace per short step would flatter it.
        "clients_ms_per_step": 1000 * wall * full_step_tokens / seen.num_tokens if seen.num_tokens else float("inf"),
        "rows_per_step": rows_per_step,
        "tokens_per_s": seen.num_tokens / wall,
        "tokens_per_step": seen.num_tokens / steps,
        "generated_tokens_per_step": generated / steps,
        # Share of the wall time the device was computing: 1.0 is the device-bound rate.
        "device_busy_fraction": steps * device_ms / 1000 / wall,
        "worker_idle_fraction": idle / (idle + busy) if idle + busy > 0 else 0.0,
        "acceptance_rate": (last.num_accepted_tokens - first.num_accepted_tokens) / drafts if drafts else None,
        "num_steps": steps,
        # CPU ms per step of each process in the window (their sum over the cores bounds ms_per_step).
        "cpu_ms_per_step": {name: 1000 * seconds / steps for name, (seconds, _) in seen.cpu.items()},
        # ... and of its busiest thread (one at ms_per_step is the critical path).
        "busiest_thread_ms_per_step": {name: 1000 * seconds / steps for name, (_, seconds) in seen.cpu.items()},
        # The scheduler's CPU as a share of one core (its event loop is one thread).
        "scheduler_core_fraction": seen.cpu["scheduler"][0] / wall,
    }
    if seen.num_finished:
        figures["requests_per_s"] = seen.num_finished / wall
        figures["scheduler_cpu_ms_per_request"] = 1000 * seen.cpu["scheduler"][0] / seen.num_finished
    for name, values in (("ttft", seen.ttft_s), ("reply_gap", seen.reply_gaps_s)):
        if values:
            figures[f"{name}_p50_ms"] = 1000 * percentile(values, 50)
            figures[f"{name}_p99_ms"] = 1000 * percentile(values, 99)
    return figures


def run(
    worker: Service,
    num_requests: int,
    window: int,
    device_ms: float,
    args: argparse.Namespace,
    placement: str = "shared",
    drive: Driver | None = None,
    via: str = "direct",
) -> dict:
    """One run through a fresh scheduler in front of `worker`, loaded by `drive` (default:
    `steady_state`); the figures of its window. ``via="front"``: the clients call a `zerobubble
    front` (on the clients' cores) that relays to the scheduler; ``via="fronts"``: the
    scheduler's own `--fronts` (`--num-fronts`), sharing its port, the clients over
    `--connections` (the kernel spreads them, unevenly at a few); ``via="front-ports"``:
    `--num-fronts` fronts started by hand, a port each, the clients' connections dealt out to
    them evenly."""
    seen = _drive_scheduler(worker, num_requests, window, args, placement, drive, via)
    return window_figures(seen, num_requests, device_ms)


def process_cpu(pids: dict[str, int]) -> dict[str, tuple[float, dict[int, float]]]:
    """Each process's CPU time so far, and that of each of its threads."""
    return {name: (cpu_seconds(pid), thread_cpu_seconds(pid)) for name, pid in pids.items()}


def cpu_between(cpu0: dict, cpu1: dict) -> dict[str, tuple[float, float]]:
    """Per process: its CPU time between two `process_cpu` reads, and that of its busiest
    thread (a process whose busiest thread is busy the whole window is the critical path,
    whatever the cores)."""
    return {
        name: (
            cpu1[name][0] - cpu0[name][0],
            max((t - cpu0[name][1].get(tid, 0.0) for tid, t in cpu1[name][1].items()), default=0.0),
        )
        for name in cpu0
    }


def dealt(targets: list[str], num_connections: int) -> list[str]:
    """The target of each client connection: `num_connections` dealt out to `targets` in turn,
    the same number to each and at least one, so that requests dealt out to the connections in
    turn load every target alike (fronts with a port each)."""
    per_target = -(-num_connections // len(targets))
    return [target for _ in range(per_target) for target in targets]


@contextlib.asynccontextmanager
async def stubs(targets: list[str], args: argparse.Namespace) -> AsyncIterator[list[generate_pb2_grpc.GenerationStub]]:
    """A stub per `--connections` connection (`dealt` over `targets`): one channel, or channels
    with connections of their own (gRPC shares one between a process's channels to a target,
    and a scheduler's fronts share its port by connection)."""
    connections = dealt(targets, args.connections)
    async with contextlib.AsyncExitStack() as stack:
        yield [
            generate_pb2_grpc.GenerationStub(
                await stack.enter_async_context(
                    open_channel(ChannelSettings(target), own_connection=len(connections) > 1)
                )
            )
            for target in connections
        ]


@dataclass(slots=True)
class Settling:
    """What N streams sent at once have received: tokens per stream; `all_settled` once every
    one has `settled_at` of them, `first_done` at the first stream's end."""

    counts: list[int]
    settled_at: int
    num_settled: int = 0
    all_settled: asyncio.Event = field(default_factory=asyncio.Event)
    first_done: asyncio.Event = field(default_factory=asyncio.Event)

    async def read(self, i: int, replies: AsyncIterator[generate_pb2.GenerateResponse]) -> None:
        """Count stream `i`'s replies to its end; a reply carrying an error raises it."""
        counts = self.counts
        async for reply in replies:
            before = counts[i]
            counts[i] = before + len(reply.token_ids)
            if before < self.settled_at <= counts[i]:
                self.num_settled += 1
                if self.num_settled == len(counts):
                    self.all_settled.set()
            if reply.finish_reason:
                if reply.error:
                    raise RuntimeError(reply.error)
                self.first_done.set()


async def steady_state(targets: list[str], num_requests: int, pids: dict[str, int], args: argparse.Namespace) -> Window:
    """Stream N requests sent at once, each `max_tokens` long; the window runs from the moment
    every one has received `--settle` of its tokens (at least its first) to the moment the
    first one ends.

    A front admits calls one loop turn at a time while it streams: at 256 calls the last ones
    started when the scheduler had run far ahead of the first ones' clients, and a window
    opened at the last first token measured the drain of that backlog, not a steady state.
    """
    max_tokens = args.max_tokens or 128 + num_requests // 2
    streams = Settling([0] * num_requests, max(1, int(args.settle * max_tokens)))
    async with stubs(targets, args) as all_stubs:
        stub = all_stubs[0]
        marks: list = []

        async def mark(event: asyncio.Event) -> None:
            await event.wait()
            count = sum(streams.counts)
            info = await stub.ModelInfo(generate_pb2.ModelInfoRequest())
            marks.append((info.stats, count, time.perf_counter(), process_cpu(pids)))

        requests = steady_requests(num_requests, max_tokens, args)
        reads = [streams.read(i, all_stubs[i % len(all_stubs)].Generate(r)) for i, r in enumerate(requests)]
        await asyncio.gather(mark(streams.all_settled), mark(streams.first_done), *reads)
    (first, tokens0, t0, cpu0), (last, tokens1, t1, cpu1) = marks
    if not streams.all_settled.is_set() or last.num_steps <= first.num_steps:
        raise RuntimeError("no steady-state window: raise --max-tokens")
    return Window(first, last, tokens1 - tokens0, 0, t1 - t0, cpu_between(cpu0, cpu1))


async def churn(targets: list[str], num_lanes: int, pids: dict[str, int], args: argparse.Namespace) -> Window:
    """N clients, each sending its next request as soon as its last one ended, output lengths
    uniform in `--output-tokens` (seeded); the window is `--seconds` long, after `--warmup-s`."""
    low, high = args.output_tokens
    tokens, finished = [0], [0]
    ttft: list[float] = []
    gaps: list[float] = []
    measuring = asyncio.Event()
    stop = asyncio.Event()
    async with stubs(targets, args) as all_stubs:
        stub = all_stubs[0]

        async def lane(lane_id: int) -> None:
            rng = random.Random(lane_id)  # each client's lengths are the same from run to run
            num_sent = 0
            while not stop.is_set():
                topic = TOPICS[(lane_id + num_sent) % len(TOPICS)]
                content = f"Client {lane_id}, request {num_sent}: write about {topic}."
                request = build_request(
                    messages=[{"role": "user", "content": content}], max_tokens=rng.randint(low, high)
                )
                num_sent += 1
                timed = measuring.is_set() and not stop.is_set()
                sent_at = time.perf_counter()
                last_at: float | None = None  # when this stream's latest token arrived
                async for reply in all_stubs[lane_id % len(all_stubs)].Generate(request):
                    now = time.perf_counter()
                    tokens[0] += len(reply.token_ids)
                    if measuring.is_set() and not stop.is_set():
                        if last_at is not None:
                            gaps.append(now - last_at)
                        elif timed and reply.token_ids:
                            ttft.append(now - sent_at)
                    if reply.token_ids:
                        last_at = now
                    if reply.finish_reason:
                        if reply.error:
                            raise RuntimeError(reply.error)
                        finished[0] += measuring.is_set()

        async def read() -> tuple:
            info = await stub.ModelInfo(generate_pb2.ModelInfoRequest())
            return info.stats, tokens[0], time.perf_counter(), process_cpu(pids)

        lanes = [asyncio.create_task(lane(i)) for i in range(num_lanes)]
        await asyncio.sleep(args.warmup_s)
        first, tokens0, t0, cpu0 = await read()
        measuring.set()
        await asyncio.sleep(args.seconds)
        last, tokens1, t1, cpu1 = await read()
        num_finished = finished[0]
        stop.set()
        await asyncio.gather(*lanes)
    cpu = cpu_between(cpu0, cpu1)
    return Window(first, last, tokens1 - tokens0, num_finished, t1 - t0, cpu, ttft, gaps)


def reference_loop_ms() -> float:
    """Milliseconds of a fixed single-threaded Python loop (dict and list work, as a scheduler
    does), best of 5: how fast this machine is right now.

    On a shared virtual machine the same code measures 1.5-2x apart from one hour to the next, and every
    process's CPU per step moves with it; printed beside each host figure, this tells a slow
    hour from a slower change.
    """
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        counts: dict[int, int] = {}
        items: list[int] = []
        for i in range(200_000):
            counts[i & 1023] = counts.get(i & 1023, 0) + 1
            items.append(i)
        best = min(best, time.perf_counter() - started)
    return 1e3 * best


def suite_host(args: argparse.Namespace) -> dict:
    out: dict = {}
    placements = args.placement
    for k in args.num_spec_tokens:
        spec = "ngram" if k else "none"
        with ExitStack() as stack:
            workers = {p: stack.enter_context(sim_worker(0.0, spec, args, p)) for p in placements}
            variants = [(p, v) for p in placements for v in args.via]
            for n in args.requests:
                reference_ms = reference_loop_ms()
                runs: dict[tuple[str, str], list[dict]] = {pv: [] for pv in variants}
                for i in range(args.repeats):  # variants alternate: A B, B A, ...
                    for p, v in variants if i % 2 == 0 else variants[::-1]:
                        runs[p, v].append(run(workers[p], n, args.async_inflight, 0.0, args, p, via=v))
                for (p, v), figures in runs.items():
                    label = "/".join(x for x, many in ((p, len(placements) > 1), (v, len(args.via) > 1)) if many)
                    _report_host(out, k, n, label, figures, reference_ms)
    return out


MIN_WINDOW_STEPS = 20  # fewer, and a host window says more about its edges than its steps


def _report_host(out: dict, k: int, n: int, placement: str, figures: list[dict], reference_ms: float) -> None:
    """Keep and print the best of one configuration's host runs.

    A window whose scheduler held fewer than 90 % of the N rows was no steady state (clients
    far behind, the scheduler finishing requests they still read), nor one of fewer than
    `MIN_WINDOW_STEPS` steps (clients so far behind that their last request settled just
    before their first one ended): it is the best only if every run's was such a window.
    """
    key = f"{placement + '/' if placement else ''}k{k}/n{n}"
    steady = [f for f in figures if f["rows_per_step"] >= 0.9 * n and f["num_steps"] >= MIN_WINDOW_STEPS] or figures
    best = min(steady, key=lambda f: f["clients_ms_per_step"])
    out[key] = {
        "all_rows_per_step": [f["rows_per_step"] for f in figures],
        "all_num_steps": [f["num_steps"] for f in figures],
        "reference_loop_ms": reference_ms,
        "ms_per_step": best["ms_per_step"],
        "all_ms_per_step": [f["ms_per_step"] for f in figures],
        "clients_ms_per_step": best["clients_ms_per_step"],
        "all_clients_ms_per_step": [f["clients_ms_per_step"] for f in figures],
        "tokens_per_step": best["tokens_per_step"],
        "generated_tokens_per_step": best["generated_tokens_per_step"],
        "rows_per_step": best["rows_per_step"],
        "acceptance_rate": best["acceptance_rate"],
        "cpu_ms_per_step": best["cpu_ms_per_step"],
        "busiest_thread_ms_per_step": best["busiest_thread_ms_per_step"],
    }
    cpu, busiest = best["cpu_ms_per_step"], best["busiest_thread_ms_per_step"]
    print(
        f"{placement + ' ' if placement else ''}k={k} n={n:4d}: {best['ms_per_step']:.2f} ms/step "
        f"({', '.join(f'{f:.2f}' for f in out[key]['all_ms_per_step'])}), as the clients received them "
        f"{best['clients_ms_per_step']:.2f} ({', '.join(f'{f:.2f}' for f in out[key]['all_clients_ms_per_step'])}), "
        f"{best['tokens_per_step']:.2f} tokens/step received of {best['generated_tokens_per_step']:.2f} generated "
        f"over {best['rows_per_step']:.1f} rows; CPU ms/step "
        + ", ".join(f"{name} {ms:.2f} (busiest thread {busiest[name]:.2f})" for name, ms in cpu.items())
        + f"; reference loop {reference_ms:.1f} ms",
        flush=True,
    )


def device_grid(args: argparse.Namespace) -> Iterator[tuple[str, Service, int, str, float, str]]:
    """Each configuration of a `bubble` or `churn` run, its worker started: the key its figures
    go under, the worker, N, the placement, the device time and the clients' way in."""
    for placement, device_ms in ((p, ms) for p in args.placement for ms in args.device_ms):
        for spec in ["ngram" if k else "none" for k in args.num_spec_tokens]:
            with sim_worker(device_ms, spec, args, placement) as worker:
                for n in args.requests:
                    for via in args.via:
                        key = (
                            f"{placement + '/' if len(args.placement) > 1 else ''}"
                            f"{via + '/' if len(args.via) > 1 else ''}{device_ms:g}ms/{spec}/n{n}"
                        )
                        yield key, worker, n, placement, device_ms, via


def suite_bubble(args: argparse.Namespace) -> dict:
    out: dict = {}
    for key, worker, n, placement, device_ms, via in device_grid(args):
        sync = run(worker, n, 1, device_ms, args, placement, via=via)
        async_ = run(worker, n, args.async_inflight, device_ms, args, placement, via=via)
        out[key] = {
            "sync": sync,
            "async": async_,
            "async_over_sync": async_["tokens_per_s"] / sync["tokens_per_s"],
        }
        print(
            f"{key:>18}: async/sync {out[key]['async_over_sync']:.2f}  "
            f"device busy sync {sync['device_busy_fraction']:.2f} async "
            f"{async_['device_busy_fraction']:.2f}  idle sync "
            f"{sync['worker_idle_fraction']:.3f} async {async_['worker_idle_fraction']:.3f}"
            f"  host {sync['ms_per_step'] - device_ms:.2f} ms",
            flush=True,
        )
    return out


def logic_ms_per_step(num_requests: int, k: int, num_steps: int, inflight: int) -> tuple[float, float]:
    """Scheduler and worker milliseconds per step of the step logic alone, in this process.

    The real `Scheduler` and a runner on a zero-time simulated device, `inflight` plans ahead,
    every plan and result through protobuf bytes as on the wire; no gRPC, no client streams,
    no other process. Measured over `num_steps` steps once all N requests decode.
    """
    import gc
    import random

    from zerobubble.api import worker_pb2
    from zerobubble.config import WorkerConfig
    from zerobubble.tools.in_process import make_scheduler
    from zerobubble.worker_svc.server import build_runner

    runner, _ = build_runner(
        WorkerConfig(
            simulate_device_ms=0.0,
            spec_method="ngram" if k else "none",
            num_spec_tokens=max(k, 1),
            max_num_seqs=max(num_requests, 1),
            kv_cache_memory_gb=16.0,
        )
    )
    sched = make_scheduler(runner, max_num_batched_tokens=8192, max_num_seqs=max(num_requests, 1))
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(1000, 20000) for _ in range(100)]
        sched.add_request(f"{i:032x}", prompt, None, StoppingOptions(max_tokens=runner.config.max_model_len - 200))
    gc.freeze()  # as the services run (zerobubble/rpc.py:tuned_gc)
    gc.set_threshold(50_000, *gc.get_threshold()[1:])
    pending: list = []
    sched_s = worker_s = 0.0
    num_warmup = 30  # admission and the first decodes
    for step in range(num_warmup + num_steps):
        t0 = time.perf_counter()
        plan_bytes = []
        while len(pending) + len(plan_bytes) < inflight:
            plan_bytes.append(sched.schedule().SerializeToString())
        t1 = time.perf_counter()
        for data in plan_bytes:
            pending.append(runner.execute(worker_pb2.StepPlan.FromString(data)))
        result_bytes = pending.pop(0).materialize(0.0, runner.num_proposed).SerializeToString()
        t2 = time.perf_counter()
        sched.on_step_result(worker_pb2.StepResult.FromString(result_bytes))
        t3 = time.perf_counter()
        if step >= num_warmup:
            sched_s += (t1 - t0) + (t3 - t2)
            worker_s += t2 - t1
    gc.unfreeze()
    return 1e3 * sched_s / num_steps, 1e3 * worker_s / num_steps


def suite_logic(args: argparse.Namespace) -> dict:
    out: dict = {}
    for k in args.num_spec_tokens:
        for n in args.requests:
            figures = [logic_ms_per_step(n, k, args.steps, args.async_inflight) for _ in range(args.repeats)]
            sched_ms = min(f[0] for f in figures)
            worker_ms = min(f[1] for f in figures)
            out[f"k{k}/n{n}"] = {"scheduler_ms_per_step": sched_ms, "worker_ms_per_step": worker_ms}
            print(f"k={k} n={n:4d}: scheduler {sched_ms:.2f} ms/step, worker {worker_ms:.2f} ms/step", flush=True)
    return out


def suite_churn(args: argparse.Namespace) -> dict:
    out: dict = {}
    for key, worker, n, placement, device_ms, via in device_grid(args):
        runs: dict[str, list[dict]] = {"sync": [], "async": []}
        for i in range(args.repeats):  # sync, async, async, sync, ...
            for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
                window = 1 if mode == "sync" else args.async_inflight
                runs[mode].append(run(worker, n, window, device_ms, args, placement, churn, via))
        out[key] = runs
        for mode, figures in runs.items():

            def each(fmt: str, figures: list[dict] = figures) -> str:
                # A figure a run has none of (reply gaps of one-token requests) prints as nan.
                return " ".join(fmt.format_map(defaultdict(lambda: math.nan, f)) for f in figures)

            print(
                f"{key:>18} {mode:>5}: device busy {each('{device_busy_fraction:.2f}')}"
                f"  requests/s {each('{requests_per_s:.0f}')}"
                f"  scheduler core {each('{scheduler_core_fraction:.2f}')}"
                f"  scheduler CPU ms/request {each('{scheduler_cpu_ms_per_request:.2f}')}"
                f"  tokens/s {each('{tokens_per_s:.0f}')}"
                f"  TTFT p50/p99 ms {each('{ttft_p50_ms:.0f}/{ttft_p99_ms:.0f}')}"
                f"  reply gap p99 ms {each('{reply_gap_p99_ms:.0f}')}",
                flush=True,
            )
    return out


def _add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The suite and its load: requests, steps, device time, tokens, windows, repeats."""
    parser.add_argument("suite", choices=("host", "bubble", "logic", "churn"))
    parser.add_argument(
        "--requests",
        type=int,
        nargs="+",
        help="running requests (default: host and logic 1 16 64 256, bubble 16 64 256, churn 64 256)",
    )
    parser.add_argument("--steps", type=int, default=400, help="logic suite: steps measured per run")
    parser.add_argument("--device-ms", type=float, nargs="+", help="default: bubble 2 5 10 20, churn 10")
    parser.add_argument(
        "--output-tokens",
        type=int,
        nargs=2,
        default=[32, 160],
        metavar=("LO", "HI"),
        help="churn: each request's max_tokens, uniform in [LO, HI]",
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="churn: the measuring window")
    parser.add_argument("--warmup-s", type=float, default=4.0, help="churn: from the first request to the window")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="per request (0: 640 for host, whose zero-time steps make a short window noisy; 128 + N/2 for "
        "bubble, so that the steady-state window outlasts the admission ramp of N requests)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="host and bubble: the window opens once every request has received this share of its "
        "max_tokens (default 0.25 for host, 0 = its first token for bubble)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="host and logic suites: runs per figure (best kept); churn: runs of each mode (all kept)",
    )


def _add_service_options(parser: argparse.ArgumentParser) -> None:
    """How the services run and are reached: speculation, scheduling, placement, fronts, output."""
    parser.add_argument("--acceptance-rate", type=float, default=0.6)
    parser.add_argument(
        "--num-spec-tokens",
        type=int,
        nargs="+",
        choices=(0, 3),
        default=[0, 3],
        help="without n-gram (0), with k = 3 n-gram drafts (3), or both",
    )
    parser.add_argument(
        "--async-inflight", type=int, default=2, help="the scheduler's --max-inflight-steps in async runs"
    )
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the scheduler's --stream-interval (tokens per client message)"
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="the services' and this client's --event-loop",
    )
    parser.add_argument(
        "--placement",
        nargs="+",
        choices=PLACEMENTS,
        default=["shared"],
        help="host, bubble and churn: shared = every process on any core; apart = the scheduler's event-loop thread "
        "on a core of its own (--loop-cores), every other thread on the others; both = alternate runs",
    )
    parser.add_argument(
        "--via",
        nargs="+",
        choices=("direct", "front", "fronts", "front-ports"),
        default=["direct"],
        help="host, bubble and churn: the clients call the scheduler directly, a `zerobubble front` that relays "
        "to it (on the clients' cores with --placement apart), the scheduler's own --fronts (--num-fronts, one "
        "port: the kernel spreads the connections), or --num-fronts fronts with a port each, the connections "
        "dealt out evenly; several = alternate runs",
    )
    parser.add_argument(
        "--num-fronts",
        type=int,
        default=2,
        help="the scheduler's --fronts with --via fronts; the fronts with --via front-ports",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=1,
        help="the clients' gRPC connections, requests spread over them (fronts share a port by connection)",
    )
    parser.add_argument(
        "--kv-gb",
        type=float,
        default=16.0,
        help="KV budget the simulated worker sizes its block pool with (not allocated)",
    )
    parser.add_argument("--json", type=Path)


def build_parser() -> argparse.ArgumentParser:
    """The command line (options in the order `--help` lists them)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_options(parser)
    _add_service_options(parser)
    return parser


def _apply_defaults(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the suite-dependent defaults and check the ranges (``parser.error`` on a bad one)."""
    if args.requests is None:
        args.requests = {"bubble": [16, 64, 256], "churn": [64, 256]}.get(args.suite, [1, 16, 64, 256])
    if args.device_ms is None:
        args.device_ms = [10.0] if args.suite == "churn" else [2.0, 5.0, 10.0, 20.0]
    low, high = args.output_tokens
    if not 1 <= low <= high:
        parser.error(f"--output-tokens: need 1 <= LO <= HI, got {low} {high}")
    if args.suite == "host" and not args.max_tokens:
        # With 128 + N/2 tokens one run's window at N = 256 was two steps long, and "best of"
        # kept it.
        args.max_tokens = 640
    if args.settle is None:
        args.settle = 0.25 if args.suite == "host" else 0.0
    if not 0 <= args.settle < 1:
        parser.error(f"--settle: need 0 <= S < 1, got {args.settle}")


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    _apply_defaults(parser, args)
    suites = {"host": suite_host, "bubble": suite_bubble, "logic": suite_logic, "churn": suite_churn}
    result = suites[args.suite](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
