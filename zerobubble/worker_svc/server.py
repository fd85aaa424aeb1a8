"""The worker service: executes the scheduler's plans on one model replica.

Plans arrive on one `Execute` bidi stream and run strictly in order on a dedicated thread. While a
step runs, the next plans are already queued (async scheduling), and the host copy of the
previous step's results happens on another thread, so the device never waits for the host.
The time the step thread spends waiting for a plan while requests are live is the bubble; it is
reported with every result. Each stream is a `zerobubble.worker_svc.step_loop.StepLoop`; this module builds
the runner from the flags and serves `Describe` and `Execute`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from zerobubble import rpc
from zerobubble.api import worker_pb2, worker_pb2_grpc
from zerobubble.config import ConfigError, WorkerConfig, available_cores
from zerobubble.kernels._triton import HAS_TRITON
from zerobubble.worker_svc.faults import NO_FAULTS, FaultInjector, faults_from_env
from zerobubble.worker_svc.model import kv_cache_bytes_per_block
from zerobubble.worker_svc.model_loader import LoadedModel, load_model
from zerobubble.worker_svc.parallel import SINGLE, STOP, PlanChannel, RankLost, TensorParallel, leave
from zerobubble.worker_svc.proposers import build_proposer
from zerobubble.worker_svc.ranks import (
    EXIT_RANK_LOST,
    LocalRanks,
    Rendezvous,
    die_with_parent,
    follow,
    join_group,
    rank_spec,
    rendezvous_for,
)
from zerobubble.worker_svc.runner import ModelRunner, RunnerConfig, worker_info
from zerobubble.worker_svc.sampler import PEAK_BYTES_PER_LOGIT
from zerobubble.worker_svc.simulated import LagNgramProposer, SimulatedDevice
from zerobubble.worker_svc.step_loop import END, StepLoop

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device ``--device name`` means for a worker's rank ``local_rank`` on its machine
    (each tensor-parallel rank has a GPU of its own: cuda:local_rank)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and local_rank > 0:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512-BF16 or AMX-BF16), which oneDNN uses."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The activations', weights' and KV cache's dtype for ``--dtype name`` on ``device``.

    ``auto`` on a CPU is bfloat16 where the CPU computes in it natively (half the bytes per
    token of float32) and float32 elsewhere. On CUDA it is bfloat16 where the GPU computes in
    it natively (compute capability 8.0, Ampere, and later); before that float16, as bfloat16
    there is emulated (slow) and Triton does not compile it. An explicit bfloat16 on such a GPU
    is refused for the same reason.
    """
    by_name = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if device.type != "cuda":
        if name != "auto":
            return by_name[name]
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    major, minor = torch.cuda.get_device_capability(device)
    native_bf16 = major >= 8
    if name == "auto":
        if not native_bf16:
            logger.info("--dtype auto: float16 (this GPU has no native bfloat16)")
        return torch.bfloat16 if native_bf16 else torch.float16
    if name == "bfloat16" and not native_bf16:
        raise ValueError(
            f"--dtype bfloat16 needs a GPU of compute capability 8.0 or later, this one is {major}.{minor}: "
            "use --dtype float16 (or auto)"
        )
    return by_name[name]


def step_reserve_bytes(cfg: WorkerConfig, loaded: LoadedModel) -> int:
    """Accelerator memory the KV budget leaves for a full step's logits and sampler.

    Every running sequence samples 1 + k rows at once, so at the defaults (256 sequences, k = 3,
    a 152k vocabulary) that is 7.5 GB: more than the 10 % that `--gpu-memory-utilization 0.9`
    leaves on a 24 GB card, where a full batch sampling with top-p would run out of memory
    after the KV cache had taken the rest.
    """
    num_rows = cfg.max_num_seqs * (1 + cfg.num_draft_tokens)
    return num_rows * loaded.hf_config.vocab_size * PEAK_BYTES_PER_LOGIT


def kv_capacity_blocks(
    cfg: WorkerConfig,
    loaded: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    draft: Any = None,
    num_kv_heads: int = 0,
) -> int:
    """KV blocks that fit: a memory budget on CPU; on CUDA, `--gpu-memory-utilization` of the
    device less what is in use (the weights) and a full step's logits and sampler
    (`step_reserve_bytes`). A draft model keeps a cache of its own shape block for block beside
    the target's, as does an EAGLE head (one layer); ``draft``: either, anything with an ``hf_config``.
    ``num_kv_heads``: the target's KV heads on this tensor-parallel rank (0: all of them); the
    draft stays whole on every rank."""
    per_block = kv_cache_bytes_per_block(loaded.hf_config, cfg.block_size, dtype, num_kv_heads)
    if draft is not None:
        per_block += kv_cache_bytes_per_block(draft.hf_config, cfg.block_size, dtype)
    reserve = 0
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = step_reserve_bytes(cfg, loaded)
        budget = free - (1 - cfg.gpu_memory_utilization) * total - reserve
    else:
        budget = cfg.kv_cache_memory_gb * (1 << 30)
    num_blocks = int(budget // per_block)
    if num_blocks < 2:
        hint = (
            f" after {reserve / 2**30:.2f} GiB for a step of {cfg.max_num_seqs} sequences' logits "
            "(lower --max-num-seqs or raise --gpu-memory-utilization)"
            if reserve
            else ""
        )
        raise ValueError(
            f"KV budget too small: {max(budget, 0) / 2**20:.1f} MiB{hint} holds {max(num_blocks, 0)} blocks "
            f"of {per_block} bytes"
        )
    if reserve:
        logger.info("KV cache: %d blocks; %.2f GiB left for a full step's logits", num_blocks, reserve / 2**30)
    return num_blocks


def build_runner(
    cfg: WorkerConfig, faults: FaultInjector = NO_FAULTS, tp: TensorParallel = SINGLE
) -> tuple[ModelRunner, LoadedModel]:
    """Load the model (and draft model) and size the KV cache; ``faults``: what a test injects;
    ``tp``: this process's tensor-parallel rank (its shard of the layers; the leader's runner
    sends each plan to the other ranks)."""
    if cfg.simulated:
        # The host path runs small ops only; a parallel team would just spin on shared cores.
        torch.set_num_threads(cfg.num_threads if cfg.num_threads > 0 else 1)
        return build_simulated_runner(cfg, faults)
    device = resolve_device(cfg.device, tp.local_rank)
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    elif tp.size > 1 and device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the machine's cores: one thread each
    if device.type == "cuda" and not HAS_TRITON:
        # The attention's torch twin for accelerators gathers every token's whole context:
        # fine for the tests' fake device, out of memory at once at real lengths on a GPU.
        raise ConfigError("--device cuda needs triton (Linux CUDA builds of torch bring it): pip install triton")
    dtype = resolve_dtype(cfg.dtype, device)
    loaded = load_model(
        cfg.model,
        dtype,
        device,
        cfg.prepack_weights,
        quantization=cfg.quantization,
        cpu_kernels=cfg.cpu_kernels,
        cpu_linear=cfg.cpu_linear,
        tp=tp,
    )
    draft = _load_drafter(cfg, loaded, dtype, device)
    proposer = build_proposer(
        cfg.spec_method, cfg.num_spec_tokens, cfg.ngram_min, cfg.ngram_max, draft, cfg.draft_acceptance
    )
    assert loaded.model is not None
    # Every rank the same capacity: the scheduler plans one set of block ids for all of them.
    num_blocks = tp.agree_min(kv_capacity_blocks(cfg, loaded, device, dtype, draft, loaded.model.spec.num_kv_heads))
    runner = ModelRunner(
        loaded,
        runner_config(
            cfg,
            loaded,
            num_blocks,
            cfg.num_spec_tokens if proposer is not None else 0,
            cuda_graphs=cfg.cuda_graphs and device.type == "cuda",
        ),
        proposer,
        faults=faults,
        channel=PlanChannel(tp) if tp.size > 1 and tp.is_leader else None,
    )
    logger.info(
        "worker ready: model=%s device=%s (tensor-parallel rank %d of %d) dtype=%s quantization=%s "
        "blocks=%d x %d spec=%s k=%d prediction k=%d", loaded.name, device, tp.rank, tp.size, dtype,
        cfg.quantization, num_blocks, cfg.block_size, cfg.spec_method, runner.num_proposed, cfg.num_prediction_tokens,
    )  # fmt: skip
    return runner, loaded


def _load_drafter(cfg: WorkerConfig, loaded: LoadedModel, dtype: torch.dtype, device: torch.device) -> Any:
    """The draft model (``--spec-method draft``) or EAGLE head (``eagle``) ``--draft-model`` names."""
    if cfg.spec_method == "draft":
        return load_model(
            cfg.draft_model,
            dtype,
            device,
            cfg.prepack_weights,
            quantization=cfg.draft_quantization,
            cpu_kernels=cfg.cpu_kernels,
            cpu_linear=cfg.cpu_linear,
        )
    if cfg.spec_method == "eagle":
        from zerobubble.worker_svc.proposers.eagle import load_serving_head

        return load_serving_head(cfg.draft_model, loaded, cfg.draft_quantization)
    return None


def runner_config(
    cfg: WorkerConfig, loaded: LoadedModel, num_blocks: int, num_spec_tokens: int, cuda_graphs: bool = False
) -> RunnerConfig:
    """The runner's settings from the worker's flags and the model (``--max-model-len`` caps
    the model's own limit)."""
    max_model_len = loaded.max_model_len
    if cfg.max_model_len > 0:
        max_model_len = min(max_model_len, cfg.max_model_len)
    return RunnerConfig(
        num_blocks=num_blocks,
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=max_model_len,
        num_spec_tokens=num_spec_tokens,
        num_prediction_tokens=cfg.num_prediction_tokens,
        cuda_graphs=cuda_graphs,
    )


def build_simulated_runner(cfg: WorkerConfig, faults: FaultInjector = NO_FAULTS) -> tuple[ModelRunner, LoadedModel]:
    """A runner on a simulated device (`worker_svc/simulated.py`): the model's config and
    tokenizer, no weights; KV capacity as if the cache were allocated on the CPU."""
    loaded = load_model(cfg.model, weights=False)
    num_spec_tokens = cfg.num_draft_tokens
    special = json.loads(tokenizer_fields(loaded.path)["tokenizer_json"]).get("added_tokens", [])
    simulator = SimulatedDevice(
        cfg.simulate_device_ms,
        cfg.simulate_acceptance_rate,
        loaded.hf_config.vocab_size,
        [t["id"] for t in special if t.get("special")] + loaded.eos_token_ids,
        num_spec_tokens,
    )
    proposer = LagNgramProposer(num_spec_tokens, cfg.ngram_min) if cfg.speculative else None
    num_blocks = kv_capacity_blocks(cfg, loaded, torch.device("cpu"), resolve_dtype(cfg.dtype, torch.device("cpu")))
    runner = ModelRunner(
        loaded, runner_config(cfg, loaded, num_blocks, num_spec_tokens), proposer, simulator, faults=faults
    )
    logger.info(
        "worker ready on a SIMULATED device (%.1f ms per step, acceptance rate %.2f): "
        "model=%s blocks=%d x %d spec=%s k=%d",
        cfg.simulate_device_ms,
        cfg.simulate_acceptance_rate,
        loaded.name,
        num_blocks,
        cfg.block_size,
        cfg.spec_method,
        num_spec_tokens,
    )
    return runner, loaded


def tokenizer_fields(model_dir: Path) -> dict[str, str]:
    """What the scheduler needs to tokenize without model files: tokenizer.json, chat template,
    BOS/EOS strings (from the HF directory's tokenizer files)."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template_path = model_dir / "chat_template.jinja"
    template = template_path.read_text() if template_path.is_file() else config.get("chat_template") or ""

    def token_str(value) -> str:
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    return dict(
        tokenizer_json=(model_dir / "tokenizer.json").read_text(),
        chat_template=template if isinstance(template, str) else "",
        bos_token=token_str(config.get("bos_token")),
        eos_token=token_str(config.get("eos_token")),
    )


# Exit status of a worker whose device failed: its supervisor (Kubernetes) restarts it.
EXIT_DEVICE_FAULT = 70


def device_thread() -> ThreadPoolExecutor:
    """The one thread that runs every torch computation of a worker: loading, then all steps.

    Why one thread for all of it: on CPU, torch's OpenMP keeps a thread team per calling thread,
    and while the team of a thread that ran parallel ops stays alive, parallel regions started
    from another thread ran ~30% slower (decode batch 16: 89 ms on the loading thread, 116 ms on
    a fresh one). So the model is built on the thread that will later run it, and the asyncio
    loop (gRPC) and the result copier never run parallel torch ops.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="device")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """`Execute` runs plans in order on the device thread; `Describe` reports model facts and capacity."""

    def __init__(
        self,
        runner: ModelRunner,
        loaded: LoadedModel,
        cfg: WorkerConfig,
        metrics=None,
        device: ThreadPoolExecutor | None = None,
    ) -> None:
        self.device = device or device_thread()
        self.runner = runner
        self.loaded = loaded
        self.cfg = cfg
        self.metrics = metrics
        self.worker_id = cfg.worker_id or f"{socket.gethostname()}:{cfg.port}"
        self.tokenizer_fields = tokenizer_fields(loaded.path)
        self._stream_lock = asyncio.Lock()
        self._generation = 0  # a new Execute stream supersedes the old one
        # Shutdown: no new streams; the open one is told (a step_id 0 notice, then a flag on
        # every result) so the scheduler sends no new requests and closes it once it is done.
        self.draining = False
        self.num_streams = 0
        self._notify: list = []  # puts an item into the open stream's result queue

    async def on_device(self, function: Any, *args: Any) -> Any:
        """``function(*args)`` on the device thread, where a tensor-parallel leader's messages
        to its ranks go out in step order."""
        return await asyncio.wrap_future(self.device.submit(function, *args))

    async def Describe(self, request, context) -> worker_pb2.WorkerInfo:
        if self.draining:  # a scheduler must not (re)connect to a worker that is leaving
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        model = self.loaded.model
        if model is None:
            device, dtype = f"simulated ({self.cfg.simulate_device_ms:g} ms per step)", "none"
        else:
            device, dtype = str(model.device), str(model.dtype).removeprefix("torch.")
        return worker_info(
            self.runner,
            worker_id=self.worker_id,
            model=self.loaded.name,
            device=device,
            dtype=dtype,
            **self.tokenizer_fields,
        )

    def device_fault(self, exc: BaseException) -> None:
        """The device failed (see `is_device_fault`): nothing more can run in this process.

        Exit at once, leaving the step unanswered: the scheduler sees the stream end and moves
        this worker's requests, with their confirmed tokens, to another worker (an error answer
        would end them with ERROR instead), and the supervisor restarts the worker.
        """
        status = EXIT_RANK_LOST if isinstance(exc, RankLost) else EXIT_DEVICE_FAULT
        logger.critical("device fault, exiting (status %d): %s", status, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def start_draining(self) -> None:
        """SIGTERM: refuse new streams and tell the open one (see `draining` in worker.proto)."""
        self.draining = True
        for notify in self._notify:
            notify(worker_pb2.StepResult(step_id=0, draining=True))

    async def Execute(self, request_iterator, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        self._generation += 1
        generation = self._generation
        # End the open stream now, even if its scheduler is idle and sends no plan that would
        # let it notice (a restarted scheduler must not wait for a stream nobody feeds).
        for notify in list(self._notify):
            notify(END)
        async with self._stream_lock:  # the previous stream (if any) has fully stopped
            if generation != self._generation:
                return
            async for result in self._execute(request_iterator, context, generation):
                yield result

    async def _execute(self, request_iterator, context, generation: int):
        """One stream's plans through a `StepLoop`; its answers, with the worker's metrics."""
        steps = StepLoop(self.runner, self.device_fault, lambda: generation == self._generation)
        steps.start_copier()
        await self.on_device(self.runner.reset)
        logger.info("scheduler stream %d opened", generation)
        self._notify.append(steps.deliver)
        self.num_streams += 1
        if self.draining:
            steps.deliver(worker_pb2.StepResult(step_id=0, draining=True))
        stepping = asyncio.wrap_future(self.device.submit(steps.run_steps))
        reader = asyncio.create_task(steps.read_plans(request_iterator))
        try:
            async for item in steps.answers():
                item.draining = self.draining
                if item.step_id != 0 and self.metrics is not None:  # step_id 0: a draining notice
                    if not item.error:
                        self.metrics.record_step_result(self.worker_id, item)
                    self.metrics.set_inflight(self.worker_id, steps.num_inflight)
                    self.metrics.set_kv_usage(self.worker_id, self.runner.kv_usage())
                yield item
        finally:
            reader.cancel()
            steps.plans.put(END)
            await stepping
            steps.stop_copier()
            await self.on_device(self.runner.reset)
            self._notify.remove(steps.deliver)
            self.num_streams -= 1
            logger.info("scheduler stream %d closed", generation)
            channel = self.runner.channel
            if channel is not None and channel.messages:
                logger.info(
                    "plans handed to the other tensor-parallel ranks so far: %d, %.0f us each on average",
                    channel.messages,
                    1e6 * channel.total_s / channel.messages,
                )


def bind_cpu_cores(cfg: WorkerConfig, device: ThreadPoolExecutor) -> None:
    """Put the step thread (and the torch threads it starts) on `--cpu-cores`, this thread on the rest.

    On a CPU the model and the host share cores: while a step runs, the gRPC thread receiving the
    next plan, the result copier and the scheduler preempt its torch threads, and an OpenMP
    parallel region waits for its slowest thread. Apart, the step keeps its cores and the host
    work of an async window really overlaps it. Threads started later inherit their creator's
    mask, so this runs before the model loads and before gRPC starts its threads.
    """
    cores = available_cores(cfg.cpu_cores, "--cpu-cores")  # within --cpu-affinity, bound by now
    available = os.sched_getaffinity(0)
    device.submit(os.sched_setaffinity, 0, cores).result()  # 0: the calling thread on Linux
    if cfg.num_threads == 0:
        device.submit(torch.set_num_threads, len(cores)).result()
    rest = available - cores
    if rest:
        os.sched_setaffinity(0, rest)
    logger.info("step thread on cores %s, the rest of the worker on %s", sorted(cores), sorted(rest) or "the same")


async def serve_worker(cfg: WorkerConfig) -> None:
    """Run the worker service until SIGTERM or SIGINT; with `--tensor-parallel-size`, as the
    group's leader, its other ranks on this machine started first and stopped last."""
    device = device_thread()
    if cfg.cpu_cores:
        bind_cpu_cores(cfg, device)
    ranks = None
    tp = SINGLE
    if cfg.tensor_parallel_size > 1:
        rendezvous = rendezvous_for(cfg)
        ranks = LocalRanks.start(cfg, rendezvous)
        tp = await asyncio.wrap_future(device.submit(join_group, cfg, 0, rendezvous, resolve_device(cfg.device)))
        tp.plan_fds = ranks.plan_fds
    try:
        await serve_leader(cfg, device, tp)
    except BaseException:
        if ranks is not None:  # they may be anywhere in their start-up: no message would reach them
            ranks.stopping = True
            ranks.kill()
        raise
    if ranks is not None:
        ranks.stopping = True  # before STOP goes out: their exits that follow are no loss
        await asyncio.wrap_future(device.submit(stop_ranks, tp))
        ranks.stop()


def stop_ranks(tp: TensorParallel) -> None:
    """The leader's last message: the other ranks leave their loop and exit."""
    try:
        PlanChannel(tp).send(STOP)
        leave(tp)
    except RankLost as exc:
        logger.warning("stopping the tensor-parallel ranks: %s", exc)


async def serve_leader(cfg: WorkerConfig, device: ThreadPoolExecutor, tp: TensorParallel) -> None:
    """The gRPC service of a worker (of a tensor-parallel group, its leader)."""
    faults = faults_from_env(os.environ)
    runner, loaded = await asyncio.get_running_loop().run_in_executor(device, build_runner, cfg, faults, tp)
    metrics = None
    if cfg.metrics_port >= 0:
        from zerobubble.metrics import ServiceMetrics, start_metrics_server

        metrics = ServiceMetrics(model=loaded.name, role="worker")
        port = start_metrics_server(metrics, cfg.metrics_port, cfg.host)
        logger.info("worker metrics on :%d/metrics", port)
        # Announced like the gRPC port, so tests and launchers can find a port picked with 0.
        rpc.announce_port("METRICS", port)
    servicer = WorkerServicer(runner, loaded, cfg, metrics, device)
    interceptors = None
    if cfg.auth_token:
        interceptors = [rpc.BearerAuthInterceptor(cfg.auth_token, SERVICE_NAME, {"Execute": "stream_stream"})]
    server = grpc.aio.server(options=rpc.SERVER_OPTIONS, interceptors=interceptors)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = rpc.add_health_and_reflection(server, [SERVICE_NAME])
    creds = rpc.server_credentials(cfg.tls_cert or None, cfg.tls_key or None, cfg.tls_client_ca or None)
    port = rpc.bind(server, cfg.host, cfg.port, creds)
    if servicer.worker_id.endswith(":0"):
        servicer.worker_id = f"{socket.gethostname()}:{port}"
    if metrics is not None:
        metrics.add_worker(servicer.worker_id, runner.num_proposed)
        metrics.set_tensor_parallel_size(servicer.worker_id, tp.size)
    # Before the port is announced: whoever reads it may signal the process at once.
    stop = asyncio.Event()
    rpc.install_stop_signals(stop)
    await server.start()
    await rpc.set_serving(health, [SERVICE_NAME], True)
    logger.info("worker %s listening on %s:%d", servicer.worker_id, cfg.host, port)
    # The port line is parsed by `zerobubble serve` when it starts a local worker.
    rpc.announce_port("WORKER", port)
    await stop.wait()
    # Probes and the scheduler see it first; the scheduler lets its requests here finish and
    # then closes the stream, or the drain timeout ends it (the scheduler moves the rest).
    await rpc.set_serving(health, [SERVICE_NAME], False)
    servicer.start_draining()
    logger.info("shutting down: draining for up to %.0fs", cfg.drain_timeout)
    deadline = time.monotonic() + cfg.drain_timeout
    while servicer.num_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await rpc.graceful_stop(server, health, [SERVICE_NAME], grace_s=1.0)


def run_worker(cfg: WorkerConfig) -> None:
    """Entry point of `zerobubble worker` (on node k > 0 of a tensor-parallel group: that
    node's ranks, serving nothing)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.node_rank > 0:
        rendezvous = rendezvous_for(cfg)
        ranks = LocalRanks.start(cfg, rendezvous)
        try:
            run_follower(cfg, 0, rendezvous)
        finally:
            ranks.stop()
        return
    rpc.run_service(serve_worker(cfg), cfg.event_loop, cfg.cpu_affinity)


def run_follower(cfg: WorkerConfig, local_rank: int, rendezvous: Rendezvous, plan_fd: int = -1) -> None:
    """A tensor-parallel rank other than the leader: join, load its shard, run the leader's
    plans (from ``plan_fd``, else over the group) until it stops. A lost group or a device
    fault exits the process."""
    tp = join_group(cfg, local_rank, rendezvous, resolve_device(cfg.device, local_rank))
    if plan_fd >= 0:
        tp.plan_fds = (plan_fd,)
    try:
        runner, _ = build_runner(cfg, faults_from_env(os.environ), tp)
        follow(runner, PlanChannel(tp), _exit_on_fault)
    except RankLost as exc:
        _exit_on_fault(exc)
    leave(tp)


def _exit_on_fault(exc: BaseException) -> None:
    status = EXIT_RANK_LOST if isinstance(exc, RankLost) else EXIT_DEVICE_FAULT
    logger.critical("tensor-parallel rank exiting (status %d): %s", status, exc)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_rank() -> None:
    """Entry point of a rank the leader started on its machine (`ranks.LocalRanks.start`)."""
    spec = rank_spec(sys.argv)
    cfg = spec.config
    die_with_parent(spec.parent_pid)
    # The leader decides when its ranks end (its STOP, or their death with it); a terminal's
    # Ctrl-C or a signal to the process group is the leader's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = cfg.node_rank * (cfg.tensor_parallel_size // cfg.nnodes) + spec.local_rank
    logging.basicConfig(
        level=cfg.log_level.upper(), format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_follower(cfg, spec.local_rank, spec.rendezvous, spec.plan_fd)
