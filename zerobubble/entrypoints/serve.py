"""`zerobubble serve`: the scheduler plus one local worker in one command.

The worker runs in its own process (its own interpreter, so the model's host work never competes
with the scheduler for the GIL) and the two talk real gRPC over loopback, exactly as they do
across machines. With `--workers`, no local worker is started.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from dataclasses import fields

from zerobubble import rpc
from zerobubble.config import SERVE_WORKER_HIDDEN, ServeConfig, WorkerConfig
from zerobubble.scheduler_svc.server import serve_scheduler
from zerobubble.tools.launch import command_flags

logger = logging.getLogger(__name__)


def worker_command(cfg: ServeConfig) -> list[str]:
    """The `zerobubble worker` command line for the local worker of `serve`."""
    options = {f.name: getattr(cfg.worker, f.name) for f in fields(WorkerConfig) if f.name not in SERVE_WORKER_HIDDEN}
    return [
        sys.executable,
        "-m",
        "zerobubble",
        "worker",
        "--host",
        "127.0.0.1",
        "--port",
        str(cfg.worker_port),
        "--metrics-port",
        "-1",
        *command_flags({name: value for name, value in options.items() if value not in (None, "")}),
    ]


def start_local_worker(cfg: ServeConfig) -> tuple[subprocess.Popen, int]:
    """Start the worker process and wait for the port line it prints once it listens.

    Its auth token (`cfg.worker.auth_token`) goes through the environment, not the command
    line, which other local users can read.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ZEROBUBBLE_AUTH_TOKEN": cfg.worker.auth_token}
    proc = subprocess.Popen(worker_command(cfg), stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ZEROBUBBLE_WORKER_PORT="):
            return proc, int(line.strip().split("=", 1)[1])
        sys.stdout.write(line)
    status = proc.wait()
    if status == 2:  # a usage error (a model it cannot serve) that the worker named on stderr
        raise SystemExit(status)
    raise SystemExit(f"local worker exited before listening (exit code {status})")


def run_serve(cfg: ServeConfig) -> None:
    """Entry point of `zerobubble serve`."""
    proc = None
    if cfg.scheduler.workers:
        addresses = cfg.scheduler.worker_addresses()
    else:
        logger.info("starting the local worker (model %s)", cfg.worker.model)
        # A fresh secret per run closes the local worker's API to everyone but this scheduler.
        cfg.worker.auth_token = cfg.scheduler.worker_auth_token = secrets.token_urlsafe(24)
        proc, port = start_local_worker(cfg)
        addresses = [f"127.0.0.1:{port}"]
    try:
        rpc.run_service(serve_scheduler(cfg.scheduler, addresses), cfg.scheduler.event_loop, cfg.scheduler.cpu_affinity)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
