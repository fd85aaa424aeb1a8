"""`zerobubble scheduler --fronts N` (and `serve --fronts N`): the scheduler's own fronts.

N `zerobubble front` processes share the client ports (`--host`:`--port` and `--http-port`,
`SO_REUSEPORT`: the kernel spreads client connections over them) and relay to this scheduler,
which then listens for them on loopback only. They get the scheduler's client TLS and token; secrets travel in
their environment, not on their command line. A front that exits is started again. With
`--loop-cores`, the fronts run on the process's other cores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import fields

from zerobubble.config import FrontConfig, SchedulerServiceConfig, allowed_cores, env_name

logger = logging.getLogger(__name__)

READY_WAIT_S = 30.0  # how long the scheduler waits for its fronts to serve before announcing


def front_settings(cfg: SchedulerServiceConfig, scheduler_port: int, port: int, http_port: int) -> FrontConfig:
    """The settings of one front of `cfg`'s scheduler (listening on loopback at `scheduler_port`)."""
    cores = ""
    if cfg.loop_cores:
        rest = allowed_cores(cfg.cpu_affinity) - cfg.loop_core_set()
        cores = ",".join(map(str, sorted(rest)))
    return FrontConfig(
        log_level=cfg.log_level,
        host=cfg.host,
        port=port,
        http_port=http_port,
        scheduler=f"127.0.0.1:{scheduler_port}",
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
        auth_token=cfg.auth_token,
        scheduler_auth_token=cfg.auth_token,
        event_loop=cfg.event_loop,
        cpu_affinity=cores or cfg.cpu_affinity,
        drain_timeout=cfg.drain_timeout,
        reuse_port=True,
        parent_pid=os.getpid(),
    )


def _pump(
    proc: subprocess.Popen, ports: dict[str, int], wanted: int, announced: threading.Event, ready: threading.Event
) -> None:
    """Pass a front's output on to ours; catch the lines that announce its ports (`wanted` of
    them: gRPC, and HTTP where it serves it) and its first readiness."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ZEROBUBBLE_FRONT_READY_PORT="):
            ready.set()
            continue
        if line.startswith(("ZEROBUBBLE_FRONT_PORT=", "ZEROBUBBLE_HTTP_PORT=")):
            key, value = line.strip().split("=", 1)
            ports[key] = int(value)
            if len(ports) == wanted:
                announced.set()
            continue  # the scheduler announces the client ports itself
        # One write per line, past the buffer of sys.stdout: its text layer is not shared
        # safely between threads, and a line of ours (the port lines that launchers read)
        # must not be cut by one of a front's.
        os.write(sys.stdout.fileno(), line.encode())
    announced.set()


def _all_set(events: list[threading.Event], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    return all(event.wait(max(deadline - time.monotonic(), 0.0)) for event in events)


class FrontPool:
    """The scheduler's front processes: started, kept running, stopped."""

    def __init__(self, cfg: SchedulerServiceConfig, scheduler_port: int) -> None:
        self.cfg = cfg
        self.scheduler_port = scheduler_port
        self.port = cfg.port
        self.http_port = cfg.http_port
        self.procs: list[subprocess.Popen] = []
        self._stopping = False
        self._supervising: asyncio.Task | None = None

    def _spawn(self, port: int, http_port: int) -> tuple[subprocess.Popen, int, int, threading.Event]:
        """Start a front; it, its gRPC and HTTP ports, and an event set once it first serves."""
        settings = front_settings(self.cfg, self.scheduler_port, port, http_port)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.update({env_name(f.name): str(getattr(settings, f.name)) for f in fields(FrontConfig)})
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerobubble", "front"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        ports: dict[str, int] = {}
        wanted = 2 if http_port >= 0 else 1
        announced = threading.Event()
        ready = threading.Event()
        threading.Thread(target=_pump, args=(proc, ports, wanted, announced, ready), daemon=True).start()
        if not announced.wait(60) or len(ports) < wanted:
            proc.kill()
            raise RuntimeError(f"a front process did not start (exit code {proc.poll()})")
        return proc, ports["ZEROBUBBLE_FRONT_PORT"], ports.get("ZEROBUBBLE_HTTP_PORT", -1), ready

    async def start(self) -> tuple[int, int]:
        """Start the fronts, kept running until `stop`; the gRPC and HTTP ports they share (-1:
        no HTTP). The first one picks them where they are 0."""
        proc, self.port, self.http_port, ready = await asyncio.to_thread(self._spawn, self.cfg.port, self.cfg.http_port)
        self.procs.append(proc)
        readiness = [ready]
        for _ in range(self.cfg.fronts - 1):
            proc, _port, _http, ready = await asyncio.to_thread(self._spawn, self.port, self.http_port)
            self.procs.append(proc)
            readiness.append(ready)
        logger.info("%d front processes on %s:%d", len(self.procs), self.cfg.host, self.port)
        # The client port is announced once every front serves: the kernel spreads connections
        # over all of them, and one still loading its tokenizer would refuse its share.
        if not await asyncio.to_thread(_all_set, readiness, READY_WAIT_S):
            logger.warning("not every front serves after %.0fs (no worker ready yet?): going on", READY_WAIT_S)
        self._supervising = asyncio.create_task(self._supervise())
        return self.port, self.http_port

    async def _supervise(self, interval_s: float = 1.0) -> None:
        """Start again any front that exited (until `stop`)."""
        while not self._stopping:
            await asyncio.sleep(interval_s)
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and not self._stopping:
                    logger.warning("front process %d exited with %s: starting it again", proc.pid, proc.returncode)
                    try:
                        self.procs[i], *_ = await asyncio.to_thread(self._spawn, self.port, self.http_port)
                    except RuntimeError as exc:
                        logger.error("%s", exc)

    async def stop(self) -> None:
        """SIGTERM every front (each lets its calls finish for --drain-timeout), then wait."""
        self._stopping = True
        if self._supervising is not None:
            self._supervising.cancel()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

        def wait_all() -> None:
            for proc in self.procs:
                try:
                    proc.wait(timeout=self.cfg.drain_timeout + 10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

        await asyncio.to_thread(wait_all)
