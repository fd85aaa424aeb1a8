"""`zerobubble serve`: the scheduler plus one local worker in one command.

The worker runs in its own process (its own interpreter, so the model's host work never competes
with the scheduler for the GIL) and the two talk real gRPC over loopback, exactly as they do
across machines. With `--workers`, no local worker is started.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import subprocess
import sys
from dataclasses import fields

from scheduler_svc.server import SchedulerServiceConfig, serve_scheduler
from zerobubble.cli import config_from_args
from zerobubble.launch import command_flags
from worker_svc.config import WorkerConfig

logger = logging.getLogger(__name__)


def worker_command(args: argparse.Namespace) -> list[str]:
    """The `zerobubble worker` command line for the local worker of `serve`."""
    cmd = [sys.executable, "-m", "zerobubble.cli", "worker", "--host", "127.0.0.1",
           "--port", str(getattr(args, "worker_port", 0) or 0), "--metrics-port", "-1",
           "--log-level", getattr(args, "log_level", "INFO") or "INFO"]
    # auth_token is the clients' token on `serve`; the worker gets its own (env, see below).
    skip = {"host", "port", "metrics_port", "tls_cert", "tls_key", "tls_client_ca", "auth_token"}
    options = {f.name: getattr(args, f.name) for f in fields(WorkerConfig)
               if f.name not in skip and hasattr(args, f.name)}
    return cmd + command_flags({name: value for name, value in options.items() if value not in (None, "")})


def start_local_worker(args: argparse.Namespace, token: str,
                       timeout_s: float = 600.0) -> tuple[subprocess.Popen, int]:
    """Start the worker process and wait for the port line it prints once it listens.

    `token` closes its API to everyone but this scheduler; it goes through the environment,
    not the command line, which other local users can read.
    """
    proc = subprocess.Popen(worker_command(args), stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1",
                                 "ZEROBUBBLE_AUTH_TOKEN": token})
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("ZEROBUBBLE_WORKER_PORT="):
            return proc, int(line.strip().split("=", 1)[1])
        sys.stdout.write(line)
    raise SystemExit(f"local worker exited before listening (exit code {proc.wait()})")


def run_serve(args: argparse.Namespace) -> None:
    """Entry point of `zerobubble serve`."""
    cfg = config_from_args(SchedulerServiceConfig, args)
    proc = None
    if cfg.workers:
        addresses = [a.strip() for a in cfg.workers.split(",") if a.strip()]
    else:
        logger.info("starting the local worker (model %s)", args.model)
        cfg.worker_auth_token = secrets.token_urlsafe(24)
        proc, port = start_local_worker(args, cfg.worker_auth_token)
        addresses = [f"127.0.0.1:{port}"]
    try:
        asyncio.run(serve_scheduler(cfg, addresses))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
