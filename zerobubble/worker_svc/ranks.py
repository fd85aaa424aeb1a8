"""A tensor-parallel worker's ranks: started beside the leader, fed its plans, watched.

The leader (rank 0) serves gRPC as a worker of size 1 does; every step it first hands the plan
to the other ranks (`PlanChannel`: the serialized `StepPlan`, over a pipe to each rank on its
machine, broadcast over the gloo group to ranks on other machines),
then all ranks run the same step, and only the leader answers. Since the all-reduced hidden
states, and so the logits, are the same on every rank and sampling is keyed, every rank draws
the same tokens, accepts the same drafts and keeps the same state.

On one machine the leader starts the other ranks as child processes (`LocalRanks`) that meet
it through a private rendezvous file, their collectives on loopback; they die with it
(`die_with_parent`), and a rank that exits ends the leader at once (`LocalRanks.watch`), so the
scheduler's worker-loss path moves the requests. On several machines, node k > 0 runs
`zerobubble worker --node-rank k`, which starts its own ranks the same way and joins node 0's
rendezvous port.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerobubble.api import worker_pb2
from zerobubble.config import WorkerConfig, secret_settings
from zerobubble.worker_svc.parallel import (
    COLLECTIVE_TIMEOUT,
    PLAN,
    RESET,
    STOP,
    PlanChannel,
    TensorParallel,
    init_tensor_parallel,
)
from zerobubble.worker_svc.runner import ModelRunner
from zerobubble.worker_svc.step_loop import DeviceFaultHandler, run_proposer, run_step

logger = logging.getLogger(__name__)

# Exit status of a worker whose tensor-parallel group lost a rank (its supervisor restarts it).
EXIT_RANK_LOST = 71

# -- one machine's ranks ------------------------------------------------------------------------


# What a local rank runs (`python -c`): the worker's settings follow as one JSON argument.
RANK_CODE = "from zerobubble.worker_svc.server import run_rank; run_rank()"


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where a group's ranks meet: a private file (one machine) or node 0's port."""

    file: str = ""
    addr: str = ""
    port: int = 0

    def store(self, rank: int, size: int) -> Any:
        if self.file:
            return dist.FileStore(self.file, size)
        return dist.TCPStore(self.addr, self.port, size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)


def rendezvous_for(cfg: WorkerConfig) -> Rendezvous:
    """A fresh private file on one machine (no port at all); node 0's address and port across machines."""
    if cfg.nnodes > 1:
        return Rendezvous(addr=cfg.master_addr, port=cfg.master_port)
    folder = tempfile.mkdtemp(prefix="zerobubble-tp-")  # mode 0700: only this user's processes meet there
    return Rendezvous(file=str(Path(folder) / "rendezvous"))


def keep_collectives_on_loopback(cfg: WorkerConfig) -> None:
    """One machine's ranks talk over loopback only: their ports carry no authentication."""
    if cfg.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def join_group(cfg: WorkerConfig, local_rank: int, rendezvous: Rendezvous, device: torch.device) -> TensorParallel:
    """This process's rank in the worker's group (rank = node rank x ranks per node + local rank)."""
    keep_collectives_on_loopback(cfg)
    per_node = cfg.tensor_parallel_size // cfg.nnodes
    rank = cfg.node_rank * per_node + local_rank
    store = rendezvous.store(rank, cfg.tensor_parallel_size)
    tp = init_tensor_parallel(
        rank,
        cfg.tensor_parallel_size,
        device,
        store=store,
        local_rank=local_rank,
        one_machine=cfg.nnodes == 1,
        cpu_kernels=cfg.cpu_kernels,
    )
    tp.expert_parallel = cfg.enable_expert_parallel
    return tp


@dataclass(slots=True)
class LocalRanks:
    """The ranks 1.. of this machine, child processes of its first rank."""

    procs: list[subprocess.Popen]
    rendezvous: Rendezvous
    # The write ends of the ranks' plan pipes (`parallel.PlanChannel`) when this machine's first
    # rank is the group's leader (one machine); empty when the plans come from node 0.
    plan_fds: tuple[int, ...] = ()
    stopping: bool = False

    @classmethod
    def start(cls, cfg: WorkerConfig, rendezvous: Rendezvous) -> LocalRanks:
        """Start local ranks 1..per node - 1; each runs ``server.run_rank`` with the worker's
        settings (secrets left out: ranks serve nothing) on the command line, and the read end
        of its plan pipe when this process is the leader."""
        keep_collectives_on_loopback(cfg)
        per_node = cfg.tensor_parallel_size // cfg.nnodes
        secrets = secret_settings()
        settings = {f.name: "" if f.name in secrets else getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        procs, plan_fds = [], []
        for local_rank in range(1, per_node):
            read_fd = -1
            if cfg.nnodes == 1:
                read_fd, write_fd = plan_pipe()
                plan_fds.append(write_fd)
            where = dataclasses.asdict(rendezvous)
            spec = {"config": settings, "local_rank": local_rank, "parent_pid": os.getpid(), "rendezvous": where,
                    "plan_fd": read_fd}  # fmt: skip
            command = [sys.executable, "-c", RANK_CODE, json.dumps(spec)]
            procs.append(subprocess.Popen(command, pass_fds=(read_fd,) if read_fd >= 0 else ()))
            if read_fd >= 0:
                os.close(read_fd)  # the child's now: its exit breaks the pipe for the leader
        logger.info("started tensor-parallel ranks %s (pids %s)", list(range(1, per_node)), [p.pid for p in procs])
        ranks = cls(procs, rendezvous, tuple(plan_fds))
        threading.Thread(target=ranks.watch, name="tp-watch", daemon=True).start()
        return ranks

    def watch(self) -> None:
        """A rank that exits while the worker runs ends the worker: the group cannot step without it."""
        while not self.stopping:
            for local_rank, proc in enumerate(self.procs, start=1):
                status = proc.poll()
                # Status 0 is a rank that left after the leader's STOP, never a loss.
                if status not in (None, 0) and not self.stopping:
                    logger.critical(
                        "tensor-parallel rank %d (pid %d) exited with status %d: the worker cannot step "
                        "without it; exiting (status %d)", local_rank, proc.pid, status, EXIT_RANK_LOST,
                    )  # fmt: skip
                    self.kill()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(EXIT_RANK_LOST)
            time.sleep(0.1)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout: float = 10.0) -> None:
        """At the worker's exit (after `STOP` went out): wait for the ranks, kill any still there."""
        self.stopping = True
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.rendezvous.file:
            with contextlib.suppress(OSError):
                Path(self.rendezvous.file).unlink(missing_ok=True)
                Path(self.rendezvous.file).parent.rmdir()


# Linux prctl: the signal a process gets when its parent thread exits.
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """A started rank never outlives its leader: SIGKILL when the parent exits (Linux), and a
    watch of the parent's pid where prctl is missing or the parent left before it was set."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_PDEATHSIG) unavailable; watching the parent's pid only")

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(EXIT_RANK_LOST)

    if os.getppid() != parent_pid:
        os._exit(EXIT_RANK_LOST)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# A plan pipe's buffer: a long prefill plan fits whole, so the leader never waits on a rank
# still finishing its previous step (Linux caps it at /proc/sys/fs/pipe-max-size, 1 MiB by default).
PLAN_PIPE_BYTES = 1 << 20


def plan_pipe() -> tuple[int, int]:
    """A pipe for one rank's plans, ``(read, write)``, both closed on exec (the read end is
    passed to its rank alone), its buffer enlarged where the system allows."""
    read_fd, write_fd = os.pipe()
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PLAN_PIPE_BYTES)
    return read_fd, write_fd


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What `LocalRanks.start` passes a rank on its command line."""

    config: WorkerConfig
    local_rank: int
    parent_pid: int
    rendezvous: Rendezvous
    plan_fd: int  # the read end of its plan pipe; -1: plans over the gloo group


def rank_spec(argv: list[str]) -> RankSpec:
    spec = json.loads(argv[1])
    return RankSpec(
        WorkerConfig(**spec["config"]), spec["local_rank"], spec["parent_pid"], Rendezvous(**spec["rendezvous"]),
        spec["plan_fd"],
    )  # fmt: skip


def follow(runner: ModelRunner, channel: PlanChannel, on_device_fault: DeviceFaultHandler) -> None:
    """A rank other than the leader: each plan the leader sends, run as the leader's step loop
    runs it (the step, then the drafts after it), until the leader stops; its results are
    dropped (the leader answers)."""
    while True:
        kind, payload = channel.receive()
        if kind == STOP:
            return
        if kind == RESET:
            runner.reset()
            continue
        assert kind == PLAN, kind
        plan = worker_pb2.StepPlan.FromString(payload)
        runner.prefetch_grammars(plan)
        pending = run_step(runner, plan, on_device_fault)
        if not isinstance(pending, worker_pb2.StepResult):
            run_proposer(runner, pending.req_ids, on_device_fault)
