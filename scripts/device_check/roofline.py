"""``roofline``: decode steps against the memory-bandwidth floor of their bytes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from device_check.common import FAIL, PASS, SKIP, Context
from device_check.models import in_memory_model, qwen3_1p7b_config, qwen3_30b_a3b_config

# Peak memory bandwidth in GB/s (vendors' figures), matched against torch's device name; other
# devices get a measured device-to-device copy.
KNOWN_BANDWIDTH_GBPS = {
    "H200": 4800.0, "H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0,
    "A10G": 600.0, "A10": 600.0,
}  # fmt: skip


def device_bandwidth(device: torch.device) -> tuple[float, str]:
    """``(bytes per second, where the figure comes from)`` for ``device``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, gbps in KNOWN_BANDWIDTH_GBPS.items():
            if key in name:
                return gbps * 1e9, f"{name}: vendor figure"
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    synchronize(device)
    # A copy reads and writes every byte.
    return 2 * 5 * src.numel() / (time.perf_counter() - started), f"{device}: measured copy"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_bytes(hf_config: Any, dtype: torch.dtype, batch: int, context: int) -> int:
    """Bytes a decode step must read at least: every weight once (the embedding's rows aside,
    a tied embedding once as the lm_head) and each row's K and V of its whole context."""
    from zerobubble.worker_svc.model import model_spec

    spec = model_spec(hf_config)
    size = torch.empty((), dtype=dtype).element_size()
    q, kv = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = spec.hidden_size * (q + 2 * kv) + q * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size
    weights = spec.num_layers * per_layer + spec.vocab_size * spec.hidden_size
    kv_cache = 2 * spec.num_layers * batch * context * kv
    return (weights + kv_cache) * size


def decode_step(loaded: Any, batch: int, context: int, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """One greedy decode step of ``batch`` rows with ``context`` tokens cached each."""
    from zerobubble.kernels.attention import AttentionMetadata
    from zerobubble.kernels.slot_mapping import compute_slot_mapping
    from zerobubble.worker_svc.model import allocate_kv_cache
    from zerobubble.worker_svc.sampler import SamplingTensors, sample

    block_size = 16
    blocks_per_row = -(-(context + 1) // block_size)
    kv_caches = allocate_kv_cache(loaded.hf_config, batch * blocks_per_row, block_size, dtype, device)
    tables = torch.randperm(batch * blocks_per_row).view(batch, blocks_per_row).to(torch.int32).to(device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context + 1,
        slot_mapping=compute_slot_mapping(qsl, positions, tables, block_size),
    )
    ids = torch.randint(0, loaded.hf_config.vocab_size, (batch,), device=device)
    zeros = torch.zeros(batch, device=device)
    params = SamplingTensors(zeros, zeros.int(), zeros + 1, zeros.long(), positions, all_greedy=True, any_filter=False)
    model = loaded.model
    return lambda: sample(model.compute_logits(model(ids, positions, meta, kv_caches)), params)


def timed_ms(step: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median ms of ``step``; on CUDA, of its CUDA graph's replays (as the worker runs decodes)."""
    for _ in range(3):
        step()
    synchronize(device)
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        step = graph.replay
        step()
    times = []
    for _ in range(reps):
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def top_kernels(step: Callable[[], Any], device: torch.device, num: int = 10) -> list[str]:
    """The ``num`` kernels (or CPU ops) with the most time per eager step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    reps = 3
    with profile(activities=activities) as prof:
        for _ in range(reps):
            step()
        synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:num]
    return [f"{e.key[:60]}: {getattr(e, key) / reps:.0f} us x{e.count // reps}" for e in events]


def moe_decode_bytes(hf_config: Any, dtype: torch.dtype, batch: int, context: int, experts_read: int) -> int:
    """Bytes a mixture of experts' decode step must read at least: `decode_bytes` with, in place
    of each layer's MLP, its router and the ``experts_read`` experts (over all layers) the
    step's tokens chose."""
    from zerobubble.worker_svc.model import model_spec

    spec = model_spec(hf_config)
    assert spec.moe is not None
    size = torch.empty((), dtype=dtype).element_size()
    dense_mlp = 3 * spec.hidden_size * spec.intermediate_size
    router = spec.moe.num_experts * spec.hidden_size
    expert = 3 * spec.hidden_size * spec.moe.intermediate_size
    layers = spec.num_layers * (router - dense_mlp) + experts_read * expert
    return decode_bytes(hf_config, dtype, batch, context) + layers * size


def experts_read(step: Callable[[], Any]) -> int:
    """Experts with at least one token, summed over the layers, in one run of ``step`` (eager:
    each layer's routing is counted as it is made, which needs the module's `route` wrapped)."""
    import zerobubble.worker_svc.moe as moe_layer

    route, counts = moe_layer.route, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        routing = route(*args, **kwargs)
        counts.append((routing.offsets.diff() > 0).sum())
        return routing

    moe_layer.route = counting
    try:
        step()
    finally:
        moe_layer.route = route
    return int(sum(int(c) for c in counts))


def check_roofline(ctx: Context) -> None:
    """Decode ms per step at 16 / 64 / 256 rows against the memory-bandwidth floor, and the
    kernels that take the time: a dense Qwen3-1.7B shape, then a Qwen3-30B-A3B-shaped layer
    stack whose floor counts the experts the step read."""
    batches, context = ((2, 4), 32) if ctx.dry_run else ((16, 64, 256), 512)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    for label, cfg in (("", qwen3_1p7b_config(ctx.dry_run or not ctx.cuda)),
                       ("moe ", qwen3_30b_a3b_config(ctx.dry_run or not ctx.cuda))):  # fmt: skip
        _roofline_rows(ctx, label, cfg, dtype, batches, context)


def _roofline_rows(ctx: Context, label: str, cfg: Any, dtype: torch.dtype, batches: tuple, context: int) -> None:
    loaded = in_memory_model(cfg, ctx.device, dtype)
    bandwidth, source = device_bandwidth(ctx.device)
    for batch in batches:
        name = f"{label}decode batch={batch} context={context}"
        if ctx.time_left() < 20:
            ctx.add("roofline", name, SKIP, "out of time (--time-budget)")
            continue
        started = time.perf_counter()
        try:
            step = decode_step(loaded, batch, context, ctx.device, dtype)
            read = experts_read(step) if label else 0
            ms = timed_ms(step, ctx.device, 5 if ctx.dry_run else 50)
            floor_bytes = (
                moe_decode_bytes(cfg, dtype, batch, context, read)
                if label
                else decode_bytes(cfg, dtype, batch, context)
            )
            floor_ms = floor_bytes / bandwidth * 1e3
            ratio = ms / floor_ms
            limit = 2.5 if batch >= 256 else 2.0
            kernels = top_kernels(step, ctx.device)
            status = (PASS if ratio <= limit else FAIL) if ctx.cuda else SKIP
            detail = f"{ms:.2f} ms vs floor {floor_ms:.2f} ms ({ratio:.2f}x, target <= {limit}x; {source})"
            if not ctx.cuda:
                detail += "; the floor targets are for GPUs"
            if label:
                detail += f"; {read / cfg.num_hidden_layers:.0f} of {cfg.num_experts} experts read a layer"
            values = dict(ms=ms, floor_ms=floor_ms, ratio=ratio, top_kernels=kernels, experts_read=read)
            ctx.add("roofline", name, status, detail, **values)
        except Exception as exc:
            ctx.add("roofline", name, FAIL, f"{type(exc).__name__}: {exc}")
        ctx.finish_last(started)
