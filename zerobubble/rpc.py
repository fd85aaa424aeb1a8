"""gRPC plumbing shared by both services: server options, TLS, health, reflection, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import os
import signal
import sys
import threading
from collections.abc import Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from zerobubble.config import keepalive_options, parse_cores
from zerobubble.event_loop import run_loop

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Plans and results for hundreds of requests fit easily; prompts are validated by our own
# limits (a clear INVALID_ARGUMENT) well below this transport cap.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

SERVER_OPTIONS: list[tuple[str, int]] = [
    # gRPC sets SO_REUSEPORT by default: a second server on a used port would start silently
    # and take half the connections. Off, binding a used port fails (see `bind`).
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Detect dead peers across a real network: ping idle connections, accept client pings.
    *keepalive_options(20_000, 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    *keepalive_options(10_000, 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


# Young-generation allocations between collections (CPython's default is 700). A service
# allocates thousands of short-lived objects per step (protobuf rows, events, lists); at the
# default, collections ran several times per step and the occasional full one stalled the loop
# that must send the next plan before the device runs dry.
GC_GEN0_THRESHOLD = 50_000


@contextlib.contextmanager
def tuned_gc() -> Iterator[None]:
    """A service process's lifetime with the collector tuned: collect less often, and never
    re-scan what exists at start-up.

    `gc.freeze` moves every object alive on entry (the imported modules: torch, protobuf
    descriptors, ...) out of the collector's reach, so the rare full collection scans only what
    the service created since. Measured with a 20 ms simulated device and 64 requests
    (scripts/bench_sim.py bubble, 2026-12-03, before/after interleaved): async worker idle
    1.2–2.3 % -> 0.0–0.4 %, device busy 0.98–0.99 -> 1.00. On exit the frozen objects are handed
    back: native extensions that check for leaks at exit (triton's nanobind) would otherwise
    report every frozen instance.
    """
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
    try:
        yield
    finally:
        gc.unfreeze()


def bind_process(cores: frozenset[int]) -> None:
    """Every thread of this process on `cores`, and so every thread it starts later (a new
    thread inherits its creator's mask); `taskset -a` does the same from outside.

    Why: on a machine the scheduler shares with a worker (and, in a benchmark, with its
    clients), the kernel moves each process's threads across the cores; the scheduler's loop
    then waits behind the others' threads, and hand-offs between threads wake the other core.
    Binding the scheduler to one core and the worker with the benchmark's client to the other
    shortens a step at 256 requests, every process using less CPU per step;
    `keep_loop_thread_on` goes further for the scheduler (docs/benchmarks/host.md, "The
    scheduler's loop on a core of its own").
    """
    for tid in _thread_ids() or [0]:  # no /proc: the calling thread, the only one at start-up
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cores)
    logger.info("process bound to cores %s", sorted(cores))


def _thread_ids() -> list[int]:
    """The native ids of this process's threads (Linux /proc; empty where there is none)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return []


async def keep_loop_thread_on(cores: frozenset[int], interval_s: float = 1.0) -> None:
    """Run the event loop's thread (the caller's) alone on `cores` and every other thread of
    the process on the cores left, for as long as the task runs.

    Why: at hundreds of streams the scheduler's loop thread is its critical path, while gRPC's
    threads (its poller, event engine and timer) wake many times per step to move bytes. On
    the same core they preempt the loop; apart, they run beside it. Threads gRPC starts later
    from the loop's thread inherit its cores until the next sweep, `interval_s` later.
    """
    rest = frozenset(os.sched_getaffinity(0)) - cores
    loop_thread = threading.get_native_id()
    os.sched_setaffinity(0, cores)
    logger.info("event-loop thread on cores %s, the process's other threads on %s", sorted(cores), sorted(rest))
    while True:
        for tid in _thread_ids():
            if tid != loop_thread:
                with contextlib.suppress(ProcessLookupError):
                    if os.sched_getaffinity(tid) != rest:
                        os.sched_setaffinity(tid, rest)
        await asyncio.sleep(interval_s)


def run_service(main: Coroutine[Any, Any, T], event_loop: str, cpu_affinity: str = "") -> T:
    """Run a service's main coroutine to the end, with the collector tuned (:func:`tuned_gc`),
    on the event loop `--event-loop` names ("auto": uvloop where it is installed), in a process
    bound to the cores `--cpu-affinity` names (:func:`bind_process`; empty: any core).

    Why uvloop: with hundreds of client streams a service's loop runs a few callbacks per gRPC
    message, and libuv's loop runs them with less CPU than the standard library's. On the 2-core
    VM (scripts/bench_sim.py host --event-loop asyncio|auto, k = 3, --stream-interval 8, 4 rounds
    interleaved) ms per step went 6.00 -> 5.18 (0.86x) at 256 requests and 2.29 -> 2.14 at 64.
    gRPC's asyncio stack runs on any asyncio loop.
    """
    if cpu_affinity:
        bind_process(parse_cores(cpu_affinity))
    with tuned_gc():
        return run_loop(main, event_loop)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on one service's methods.

    Other services (grpc.health.v1 for probes, reflection) stay open. A refused call never
    reaches the servicer, so e.g. a stranger's `Execute` cannot supersede the current stream.
    `streaming` maps method names to their kind ("unary_stream", "stream_stream"); the rest
    are unary.
    """

    def __init__(self, token: str, service_name: str, streaming: dict[str, str]) -> None:
        self.expected = f"Bearer {token}".encode()
        self.prefix = f"/{service_name}/"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny = {
            "unary_unary": grpc.unary_unary_rpc_method_handler(deny),
            "unary_stream": grpc.unary_stream_rpc_method_handler(deny),
            "stream_stream": grpc.stream_stream_rpc_method_handler(deny),
        }
        self.streaming = streaming

    async def intercept_service(self, continuation, details):
        if not details.method.startswith(self.prefix):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        # Constant-time comparison: an early-exit == leaks how much of a guess was right.
        given = str(metadata.get("authorization", "")).encode()
        if hmac.compare_digest(given, self.expected):
            return await continuation(details)
        method = details.method[len(self.prefix) :]
        return self._deny[self.streaming.get(method, "unary_unary")]


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...] | None:
    """Call metadata that carries `token` (None when there is none)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(
    cert: str | None, key: str | None, client_ca: str | None = None
) -> grpc.ServerCredentials | None:
    """TLS credentials for a server; with `client_ca`, clients must present a cert (mTLS)."""
    if not cert and not key:
        if client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))], root_certificates=_read(client_ca), require_client_auth=client_ca is not None
    )


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS credentials for a client channel (client cert optional, for mTLS)."""
    if not (ca or cert or key):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca), private_key=_read(key), certificate_chain=_read(cert)
    )


def aio_channel(
    target: str, creds: grpc.ChannelCredentials | None = None, server_name: str | None = None
) -> grpc.aio.Channel:
    """An asyncio channel with our message-size and keepalive settings.

    With TLS, `server_name` is the name the server's certificate must carry when it differs
    from the host in `target` (an IP address resolved from that name).
    """
    if creds is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    options: list[tuple[str, int | str]] = list(CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(target, creds, options=options)


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> health.aio.HealthServicer:
    """Register grpc.health.v1 and server reflection; returns the health servicer."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names) + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, services: Iterable[str], serving: bool) -> None:
    """Set the overall ("") and per-service health status."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await health_servicer.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int, creds: grpc.ServerCredentials | None) -> int:
    """Listen on host:port (0 = a free port); returns the bound port."""
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio reports a failed bind this way
        raise OSError(
            f"cannot listen on {address}: the port is in use or the address is not available ({exc})"
        ) from exc
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the port is in use or the address is not available")
    return bound


def announce_port(name: str, port: int) -> None:
    """Print ``ZEROBUBBLE_<NAME>_PORT=<port>``, the line launchers read, in one write: the
    scheduler passes its fronts' output on from another thread, which must not cut it."""
    sys.stdout.write(f"ZEROBUBBLE_{name}_PORT={port}\n")
    sys.stdout.flush()


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGTERM/SIGINT set `stop`, which starts a graceful shutdown."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass


async def graceful_stop(
    server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, services: Iterable[str], grace_s: float
) -> None:
    """Health NOT_SERVING first (load balancers stop routing), then drain streams, then stop."""
    await set_serving(health_servicer, services, False)
    logger.info("shutting down: draining in-flight streams for up to %.0fs", grace_s)
    await server.stop(grace_s)
