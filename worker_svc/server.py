"""The worker service: executes the scheduler's plans on one model replica.

Plans arrive on one `Execute` bidi stream and run strictly in order on a dedicated thread. While a
step runs, the next plans are already queued (async scheduling), and the host copy of the
previous step's results happens on another thread, so the device never waits for the host.
The time the step thread spends waiting for a plan while requests are live is the bubble; it is
reported with every result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from kernels._triton import HAS_TRITON
from worker_svc.model import kv_cache_bytes_per_block
from worker_svc.model_loader import LoadedModel, load_model
from worker_svc.proposers import build_proposer
from worker_svc.runner import ModelRunner, PendingResult, RunnerConfig, worker_info
from worker_svc.sampler import PEAK_BYTES_PER_LOGIT
from worker_svc.simulated import LagNgramProposer, SimulatedDevice
from zerobubble import rpc
from zerobubble.api import worker_pb2, worker_pb2_grpc
from zerobubble.config import ConfigError, WorkerConfig, available_cores
from zerobubble.rows import PlanRow, plan_req_ids

logger = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
_END = object()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    cfg: WorkerConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype, draft: LoadedModel | None = None
) -> int:
    """KV blocks that fit: a memory budget on CPU; on CUDA, `--gpu-memory-utilization` of the
    device less what is in use (the weights) and a full step's logits and sampler
    (`step_reserve_bytes`). A draft model keeps a cache of its own shape block for block beside
    the target's."""
    models = (loaded,) if draft is None else (loaded, draft)
    per_block = sum(kv_cache_bytes_per_block(m.hf_config, cfg.block_size, dtype) for m in models)
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


def build_runner(cfg: WorkerConfig) -> tuple[ModelRunner, LoadedModel]:
    """Load the model (and draft model) and size the KV cache."""
    if cfg.simulated:
        # The host path runs small ops only; a parallel team would just spin on shared cores.
        torch.set_num_threads(cfg.num_threads if cfg.num_threads > 0 else 1)
        return build_simulated_runner(cfg)
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    if device.type == "cuda" and not HAS_TRITON:
        # The attention's torch twin for accelerators gathers every token's whole context:
        # fine for the tests' fake device, out of memory at once at real lengths on a GPU.
        raise ConfigError("--device cuda needs triton (Linux CUDA builds of torch bring it): pip install triton")
    dtype = resolve_dtype(cfg.dtype, device)
    loaded = load_model(cfg.model, dtype, device, cfg.prepack_weights, quantization=cfg.quantization)
    draft = load_model(cfg.draft_model, dtype, device, cfg.prepack_weights) if cfg.spec_method == "draft" else None
    proposer = build_proposer(
        cfg.spec_method, cfg.num_spec_tokens, cfg.ngram_min, cfg.ngram_max, draft, cfg.draft_acceptance
    )
    num_blocks = kv_capacity_blocks(cfg, loaded, device, dtype, draft)
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
    )
    logger.info(
        "worker ready: model=%s device=%s dtype=%s quantization=%s blocks=%d x %d spec=%s k=%d",
        loaded.name,
        device,
        dtype,
        cfg.quantization,
        num_blocks,
        cfg.block_size,
        cfg.spec_method,
        runner.num_spec_tokens,
    )
    return runner, loaded


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
        cuda_graphs=cuda_graphs,
    )


def build_simulated_runner(cfg: WorkerConfig) -> tuple[ModelRunner, LoadedModel]:
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
    runner = ModelRunner(loaded, runner_config(cfg, loaded, num_blocks, num_spec_tokens), proposer, simulator)
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

DeviceFaultHandler = Callable[[BaseException], None]


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is the accelerator failing (a kernel fault, after which a CUDA context
    refuses all further work), not one step's bad input or a bug in its host code."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    return "CUDA error" in str(exc)


def run_step(
    runner: ModelRunner, plan: worker_pb2.StepPlan, on_device_fault: DeviceFaultHandler | None = None
) -> PendingResult | worker_pb2.StepResult:
    """Execute one plan; a step that raises becomes an error result and the worker goes on.

    The failed step's requests lose their state (none stays half admitted) and are remembered,
    so plans already sent that hold rows for them answer those rows with a per-request error
    instead of failing as a whole; their co-batched requests in those plans are unaffected.
    A device fault goes to ``on_device_fault`` instead (when given): nothing more can run.
    """
    try:
        return runner.execute(plan)
    except Exception as exc:
        error = fail_step(runner, plan_req_ids(plan), exc, on_device_fault, f"step {plan.step_id}")
        return worker_pb2.StepResult(step_id=plan.step_id, error=error)


def run_proposer(runner: ModelRunner, req_ids: list[str], on_device_fault: DeviceFaultHandler | None = None) -> None:
    """The drafts a step left to make (`ModelRunner.propose_next`), after its result was handed
    on. If they fail, the step's requests fail as a failed step's would (their result already
    went out): later plans answer their rows with a per-request error."""
    try:
        runner.propose_next()
    except Exception as exc:
        fail_step(runner, req_ids, exc, on_device_fault, "the drafts after a step")


def fail_step(
    runner: ModelRunner, req_ids: list[str], exc: Exception, on_device_fault: DeviceFaultHandler | None, what: str
) -> str:
    """What a raising step (or its drafts) does to its requests: a device fault goes to
    ``on_device_fault``; otherwise they lose their state, later rows for them get the returned
    error, and the worker goes on."""
    if on_device_fault is not None and is_device_fault(exc):
        on_device_fault(exc)
    logger.exception("%s failed", what)
    error = f"step failed: {exc}"
    runner.fail_requests(req_ids, error)
    return error


def materialize_result(
    pending: PendingResult, idle_s: float, num_spec_tokens: int, on_device_fault: DeviceFaultHandler | None = None
) -> worker_pb2.StepResult:
    """A step's wire result once its copy is done (on the copier thread), or an error result.

    On CUDA the step thread only launches work, so a fault in a step's kernels (an illegal
    access, a device-side assert) usually surfaces here, at the wait for the copy. Raised on the
    copier thread it would be lost and the step never answered: the scheduler would wait for
    its step deadline while this worker still looked healthy. Answered with an error, the
    scheduler ends the step's requests with ERROR at once. A device fault goes to
    ``on_device_fault`` instead (when given).
    """
    try:
        return pending.materialize(idle_s, num_spec_tokens)
    except Exception as exc:
        if on_device_fault is not None and is_device_fault(exc):
            on_device_fault(exc)
        logger.exception("step %d: reading its result failed", pending.step_id)
        return worker_pb2.StepResult(step_id=pending.step_id, error=f"reading the step's result failed: {exc}")


def run_jobs(jobs: queue.SimpleQueue) -> None:
    """Run each (function, args) from ``jobs`` in order until None; a failing job is logged and
    the next one runs (a copy's own failures are answered by `materialize_result`)."""
    while (job := jobs.get()) is not None:
        function, args = job
        try:
            function(*args)
        except Exception:
            logger.exception("the result copier's job failed")


# Test-only fault injection for the chaos suite (tests/test_chaos.py), never set in manifests:
# every N-th decode row fails (its request ends with ERROR, the rest of its step runs).
TEST_FAULT_ENV = "ZEROBUBBLE_TEST_FAIL_EVERY_NTH_DECODE_ROW"


# Test-only, like the above: the result copy of the worker's N-th step (of each stream) fails
# as CUDA reports a kernel fault.
TEST_DEVICE_FAULT_ENV = "ZEROBUBBLE_TEST_DEVICE_FAULT_AT_STEP"


class InjectedDeviceFault:
    """A step's copy event whose wait raises the error CUDA gives after an illegal access."""

    def synchronize(self) -> None:
        raise RuntimeError(f"CUDA error: an illegal memory access was encountered (injected: {TEST_DEVICE_FAULT_ENV})")


def injected_fault_hook_from_env(env: dict[str, str]):
    """The runner's `test_fault_hook` asked for by `TEST_FAULT_ENV` (None when unset)."""
    every = int(env.get(TEST_FAULT_ENV, "0") or 0)
    if every <= 0:
        return None
    count = [0]

    def hook(plan: worker_pb2.StepPlan, entry: PlanRow | None) -> None:
        if entry is None or entry.token_ids:
            return
        count[0] += 1
        if count[0] % every == 0:
            raise RuntimeError(f"injected test fault (every {every}th decode row)")

    logger.warning("TEST FAULT INJECTION ON: every %dth decode row fails (%s)", every, TEST_FAULT_ENV)
    return hook


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
        self._inflight = 0  # plans received and not yet answered
        # Shutdown: no new streams; the open one is told (a step_id 0 notice, then a flag on
        # every result) so the scheduler sends no new requests and closes it once it is done.
        self.draining = False
        self.num_streams = 0
        self._notify: list = []  # puts an item into the open stream's result queue
        # Test-only (TEST_DEVICE_FAULT_ENV): the step of each stream whose result copy fails.
        self.test_device_fault_at = int(os.environ.get(TEST_DEVICE_FAULT_ENV, "0") or 0)
        if self.test_device_fault_at:
            logger.warning("TEST FAULT INJECTION ON: step %d's result copy fails", self.test_device_fault_at)

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
        logger.critical("device fault, exiting (status %d): %s", EXIT_DEVICE_FAULT, exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_DEVICE_FAULT)

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
            notify(_END)
        async with self._stream_lock:  # the previous stream (if any) has fully stopped
            if generation != self._generation:
                return
            async for result in self._execute(request_iterator, context, generation):
                yield result

    async def _execute(self, request_iterator, context, generation: int):
        loop = asyncio.get_running_loop()
        plans: queue.SimpleQueue = queue.SimpleQueue()  # C-level: no Python lock and condition per plan
        results: asyncio.Queue = asyncio.Queue()
        # The result copier: each step's host copy waits here, off the step thread. A bare
        # thread on a C-level queue: an executor's submit (a Future, its Condition, the pool's
        # locks) costs the caller tens of times the CPU of a SimpleQueue's put, on the step
        # thread's critical path (docs/benchmarks/host.md, "What a message costs").
        copies: queue.SimpleQueue = queue.SimpleQueue()  # (function, args); None ends the thread
        copier = threading.Thread(target=run_jobs, args=(copies,), name="d2h", daemon=True)
        copier.start()
        self.runner.reset()
        logger.info("scheduler stream %d opened", generation)

        def deliver(item) -> None:
            loop.call_soon_threadsafe(results.put_nowait, item)

        def materialize_and_deliver(pending, idle_s: float) -> None:
            deliver(materialize_result(pending, idle_s, self.runner.num_spec_tokens, self.device_fault))

        self._notify.append(deliver)
        self.num_streams += 1
        if self.draining:
            deliver(worker_pb2.StepResult(step_id=0, draining=True))

        num_steps = [0]

        def step_loop() -> None:
            while True:
                live = bool(self.runner.slots)
                t0 = time.perf_counter()
                plan = plans.get()
                # Waiting with live requests is the bubble; waiting with none is just no work.
                idle = time.perf_counter() - t0 if live else 0.0
                if plan is _END:
                    copies.put((deliver, (_END,)))
                    return
                pending = run_step(self.runner, plan, self.device_fault)
                if isinstance(pending, worker_pb2.StepResult):
                    copies.put((deliver, (pending,)))
                    continue
                num_steps[0] += 1
                if num_steps[0] == self.test_device_fault_at:
                    pending.ready = InjectedDeviceFault()
                # The host copy overlaps the next step: it happens on the copier thread.
                copies.put((materialize_and_deliver, (pending, idle)))
                run_proposer(self.runner, pending.req_ids, self.device_fault)

        async def read_plans() -> None:
            try:
                async for plan in request_iterator:
                    if generation != self._generation:
                        break
                    self._inflight += 1
                    # Seen now, not when the plan's turn comes: the step running meanwhile may
                    # be one this plan's finish notices make moot.
                    self.runner.note_finished(plan)
                    plans.put(plan)
            finally:
                plans.put(_END)

        stepping = asyncio.wrap_future(self.device.submit(step_loop))
        reader = asyncio.create_task(read_plans())
        try:
            while True:
                item = await results.get()
                if item is _END:
                    break
                item.draining = self.draining
                if item.step_id == 0:  # a draining notice, not the answer to a plan
                    yield item
                    continue
                self._inflight -= 1
                if self.metrics is not None:
                    if not item.error:
                        self.metrics.record_step_result(self.worker_id, item)
                    self.metrics.set_inflight(self.worker_id, self._inflight)
                    self.metrics.set_kv_usage(self.worker_id, self.runner.kv_usage())
                yield item
        finally:
            reader.cancel()
            plans.put(_END)
            await stepping
            copies.put(None)
            copier.join()
            self.runner.reset()
            self._inflight = 0
            self._notify.remove(deliver)
            self.num_streams -= 1
            logger.info("scheduler stream %d closed", generation)


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
    """Run the worker service until SIGTERM or SIGINT."""
    device = device_thread()
    if cfg.cpu_cores:
        bind_cpu_cores(cfg, device)
    runner, loaded = await asyncio.get_running_loop().run_in_executor(device, build_runner, cfg)
    runner.test_fault_hook = injected_fault_hook_from_env(dict(os.environ))
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
        metrics.add_worker(servicer.worker_id, runner.num_spec_tokens)
    await server.start()
    await rpc.set_serving(health, [SERVICE_NAME], True)
    logger.info("worker %s listening on %s:%d", servicer.worker_id, cfg.host, port)
    # The port line is parsed by `zerobubble serve` when it starts a local worker.
    rpc.announce_port("WORKER", port)
    stop = asyncio.Event()
    rpc.install_stop_signals(stop)
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
    """Entry point of `zerobubble worker`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rpc.run_service(serve_worker(cfg), cfg.event_loop, cfg.cpu_affinity)
