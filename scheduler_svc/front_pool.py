"""`zerobubble scheduler --fronts N` (and `serve --fronts N`): the scheduler's own fronts.

N `zerobubble front` processes share the client port (`--host`:`--port`, `SO_REUSEPORT`: the
kernel spreads client connections over them) and relay to this scheduler, which then listens
for them on loopback only. They get the scheduler's client TLS and token; secrets travel in
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
from dataclasses import fields

from zerobubble.config import FrontConfig, SchedulerServiceConfig, allowed_cores, env_name

logger = logging.getLogger(__name__)


def front_settings(cfg: SchedulerServiceConfig, scheduler_port: int, port: int) -> FrontConfig:
    """The settings of one front of `cfg`'s scheduler (listening on loopback at `scheduler_port`)."""
    cores = ""
    if cfg.loop_cores:
        rest = allowed_cores(cfg.cpu_affinity) - cfg.loop_core_set()
        cores = ",".join(map(str, sorted(rest)))
    return FrontConfig(
        log_level=cfg.log_level,
        host=cfg.host,
        port=port,
        scheduler=f"127.0.0.1:{scheduler_port}",
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
        auth_token=cfg.auth_token,
        scheduler_auth_token=cfg.auth_token,
        event_loop=cfg.event_loop,
        cpu_affinity=cores or cfg.cpu_affinity,
        drain_timeout=cfg.drain_timeout,
        reuse_port=True,
    )


def _pump(proc: subprocess.Popen, port_line: list[str], announced: threading.Event) -> None:
    """Pass a front's output on to ours; catch the line that announces its port."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ZEROBUBBLE_FRONT_PORT="):
            port_line.append(line.strip())
            announced.set()
            continue  # the scheduler announces the client port itself
        sys.stdout.write(line)
        sys.stdout.flush()
    announced.set()


class FrontPool:
    """The scheduler's front processes: started, kept running, stopped."""

    def __init__(self, cfg: SchedulerServiceConfig, scheduler_port: int) -> None:
        self.cfg = cfg
        self.scheduler_port = scheduler_port
        self.port = cfg.port
        self.procs: list[subprocess.Popen] = []
        self._stopping = False

    def _spawn(self, port: int) -> tuple[subprocess.Popen, int]:
        settings = front_settings(self.cfg, self.scheduler_port, port)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.update({env_name(f.name): str(getattr(settings, f.name)) for f in fields(FrontConfig)})
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerobubble", "front"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        port_line: list[str] = []
        announced = threading.Event()
        threading.Thread(target=_pump, args=(proc, port_line, announced), daemon=True).start()
        if not announced.wait(60) or not port_line:
            proc.kill()
            raise RuntimeError(f"a front process did not start (exit code {proc.poll()})")
        return proc, int(port_line[0].split("=", 1)[1])

    async def start(self) -> int:
        """Start the fronts; the client port they share (the first one picks it for --port 0)."""
        proc, self.port = await asyncio.to_thread(self._spawn, self.cfg.port)
        self.procs.append(proc)
        for _ in range(self.cfg.fronts - 1):
            proc, _port = await asyncio.to_thread(self._spawn, self.port)
            self.procs.append(proc)
        logger.info("%d front processes on %s:%d", len(self.procs), self.cfg.host, self.port)
        return self.port

    async def supervise(self, interval_s: float = 1.0) -> None:
        """Start again any front that exited (until `stop`)."""
        while not self._stopping:
            await asyncio.sleep(interval_s)
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None and not self._stopping:
                    logger.warning("front process %d exited with %s: starting it again", proc.pid, proc.returncode)
                    try:
                        self.procs[i], _port = await asyncio.to_thread(self._spawn, self.port)
                    except RuntimeError as exc:
                        logger.error("%s", exc)

    async def stop(self) -> None:
        """SIGTERM every front (each lets its calls finish for --drain-timeout), then wait."""
        self._stopping = True
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
