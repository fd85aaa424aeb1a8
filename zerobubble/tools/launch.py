"""Start the real services as local processes (integration tests and benchmark scripts).

Each service prints a `ZEROBUBBLE_<WHAT>_PORT=<n>` line on stdout once it listens; we read those
instead of guessing free ports, so parallel runs never collide.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class Service:
    """A running service process and the ports it announced."""

    proc: subprocess.Popen
    ports: dict[str, int] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.ports.get("SCHEDULER", self.ports.get("WORKER", self.ports.get("FRONT", 0)))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def free_port() -> int:
    """A loopback port nobody listens on now (for a program that cannot announce its own)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def command_flags(options: dict) -> list[str]:
    """``{"block_size": 32, "prepack_weights": False}`` -> ``["--block-size", "32", "--no-prepack-weights"]``."""
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            out += [flag, str(value)]
    return out


def start(
    command: str,
    wait_for: tuple[str, ...],
    timeout: float = 300.0,
    env: dict | None = None,
    root: Path = ROOT,
    **options,
) -> Service:
    """Start `zerobubble <command>` and wait until it announced every port in `wait_for`; ``root``:
    the checkout whose code runs (another commit's, for a benchmark before and after a change)."""
    cmd = [sys.executable, "-m", "zerobubble", command, *command_flags(options)]
    return launch(cmd, wait_for, timeout, env, root)


def launch(
    cmd: list[str], wait_for: tuple[str, ...], timeout: float = 300.0, env: dict | None = None, root: Path = ROOT
) -> Service:
    """Start `cmd` in ``root``, a process that announces its ports (`rpc.announce_port`), and wait
    until it announced every port in `wait_for`; it is killed if it does not within `timeout` seconds."""
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    service = Service(proc)
    done = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            service.log.append(line)
            if line.startswith("ZEROBUBBLE_") and "_PORT=" in line:
                key, value = line.strip().split("=", 1)
                service.ports[key.removeprefix("ZEROBUBBLE_").removesuffix("_PORT")] = int(value)
                if all(w in service.ports for w in wait_for):
                    done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    if not done.wait(timeout) or not all(w in service.ports for w in wait_for):
        service.kill()
        raise RuntimeError(f"{' '.join(cmd[1:])} did not start:\n" + "".join(service.log[-60:]))
    return service


def start_worker(**options) -> Service:
    options.setdefault("port", 0)
    options.setdefault("host", "127.0.0.1")
    options.setdefault("metrics_port", -1)
    return start("worker", ("WORKER",), **options)


def start_scheduler(workers: list[Service] | list[str], **options) -> Service:
    targets = [w.target if isinstance(w, Service) else w for w in workers]
    options.setdefault("port", 0)
    options.setdefault("host", "127.0.0.1")
    options.setdefault("metrics_port", 0)
    options.setdefault("http_port", 0)  # never the fixed default: tests run side by side
    wait_for = ("SCHEDULER", "METRICS") + (("HTTP",) if options["http_port"] >= 0 else ())
    return start("scheduler", wait_for, workers=",".join(targets), **options)


def start_front(scheduler: Service | str, **options) -> Service:
    """A `zerobubble front` relaying to `scheduler`."""
    options.setdefault("port", 0)
    options.setdefault("host", "127.0.0.1")
    target = scheduler.target if isinstance(scheduler, Service) else scheduler
    return start("front", ("FRONT",), scheduler=target, **options)


def child_processes(pid: int, arg: bytes) -> list[int]:
    """Pids of the processes whose parent is `pid` and that have `arg` among their arguments."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and arg in cmdline:
            out.append(int(entry.name))
    return out


def front_children(pid: int) -> list[int]:
    """Pids of the `zerobubble front` processes whose parent is `pid`."""
    return child_processes(pid, b"front")


def wait_serving(target: str, timeout: float = 120.0) -> None:
    """Block until the service's grpc.health.v1 reports SERVING."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{target} not SERVING after {timeout}s")
