"""6. ``served``: the real worker and scheduler processes, sync and async, at 16 / 64 / 256 requests."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from device_check.common import FAIL, PASS, SKIP, Context
from device_check.models import qwen3_1p7b_config, repetitive_prompts, write_random_model_dir


def served_pairs(
    ctx: Context, worker: Any, n: int, windows: tuple[int, ...], args: argparse.Namespace, name: str, via: str
) -> None:
    """Sync and async schedulers alternating in front of `worker` with N requests (`bench_sim.run`),
    the clients direct or through a front; one record of the pairs' figures."""
    import bench_sim

    runs: dict[str, list[dict]] = {}
    out_of_time = False
    for window in windows:
        if ctx.time_left() < 20:
            out_of_time = True
            break
        mode = "async" if window > 1 else "sync"
        try:
            figures = bench_sim.run(worker, n, window, 0.0, args, via=via)
            runs.setdefault(mode, []).append(figures)
        except Exception as exc:
            tail = "".join(worker.log[-20:])
            ctx.add("served", f"{name} {mode}", FAIL, f"{type(exc).__name__}: {exc}; {tail}")
    values: dict[str, Any] = {}
    for mode, figures in runs.items():
        values[f"{mode}_tok_s"] = [round(f["tokens_per_s"], 1) for f in figures]
        values[f"{mode}_ms_per_step"] = [round(f["ms_per_step"], 2) for f in figures]
        values[f"{mode}_clients_ms_per_step"] = [round(f["clients_ms_per_step"], 2) for f in figures]
        values[f"{mode}_worker_idle"] = [round(f["worker_idle_fraction"], 4) for f in figures]
        values[f"{mode}_scheduler_cpu_ms_per_step"] = [round(f["cpu_ms_per_step"]["scheduler"], 2) for f in figures]
        if f"{mode}_acceptance" not in values and figures[0]["acceptance_rate"] is not None:
            values[f"{mode}_acceptance"] = round(figures[0]["acceptance_rate"], 3)
    pairs = list(zip(values.get("async_tok_s", []), values.get("sync_tok_s", [])))
    values["async_over_sync"] = [round(a / s, 3) for a, s in pairs]
    if pairs:
        ctx.add(
            "served", name, PASS, "async ÷ sync per pair " + ", ".join(map(str, values["async_over_sync"])), **values
        )
    elif out_of_time:
        ctx.add("served", name, SKIP, "out of time (--time-budget)")
    else:
        ctx.add("served", name, FAIL, "no pair ran")


def check_served(ctx: Context) -> None:
    """The whole stack on this device: `zerobubble worker` on the GPU and `zerobubble scheduler`
    processes, gRPC between them and to the clients, a Qwen3-1.7B-shaped random model in
    bfloat16 with n-gram k = 3 and without, N requests decoding at once. Sync and async
    schedulers alternate in front of one worker (`bench_sim.py`'s steady-state window), so
    each pair is measured side by side; the worker's idle share comes from its CUDA events."""

    cfg = qwen3_1p7b_config(ctx.dry_run or not ctx.cuda)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    sizes = (2,) if ctx.dry_run else (16, 64, 256)
    windows = (1, 2) if ctx.dry_run else (1, 2, 1, 2)  # interleaved: A B A B
    args = _bench_args(ctx, cfg, sizes)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = write_random_model_dir(Path(tmp) / "qwen3-1.7b-random", cfg, ctx.device, dtype)
        ctx.add("served", "model written", PASS, f"{time.perf_counter() - started:.1f} s")
        # CUDA graphs on before off (eager steps are bound by launching kernels), the project's
        # point (n-gram) first.
        configs = [("ngram", False)] if not ctx.cuda else [(s, g) for g in (True, False) for s in ("ngram", "none")]
        for spec, graphs in configs:
            _check_served_config(ctx, model_dir, spec, graphs, sizes, windows, args)


def _bench_args(ctx: Context, cfg: Any, sizes: tuple[int, ...]) -> argparse.Namespace:
    """`bench_sim.run`'s settings: repetitive prompts, EOS ignored, two fronts."""
    prompt_len, max_tokens = (16, 12) if ctx.dry_run else (256, 192)
    return argparse.Namespace(
        max_tokens=max_tokens,
        stream_interval=1,
        event_loop="auto",
        prompt_token_ids=repetitive_prompts(max(sizes), prompt_len, cfg.vocab_size, 11),
        # Through fronts: two, as the gpu overlay runs, but each on a port of its own with the
        # clients' connections dealt out evenly (`bench_sim.py --via front-ports`): over the
        # scheduler's own shared port the kernel splits 8 connections 6:2 or worse about a
        # third of the time, and one loaded front is not what this measures.
        num_fronts=2,
        connections=8,
        settle=0.0,  # the window opens at the last first token, as in the first H200 run
    )


def _check_served_config(
    ctx: Context,
    model_dir: Path,
    spec: str,
    graphs: bool,
    sizes: tuple[int, ...],
    windows: tuple[int, ...],
    args: argparse.Namespace,
) -> None:
    """One worker process (`spec`, CUDA graphs on or off) and the pairs measured in front of it."""
    from zerobubble.tools.launch import start_worker

    label = f"spec={spec} graphs={graphs}"
    started = time.perf_counter()
    if ctx.time_left() < 60:
        ctx.add("served", label, SKIP, "out of time (--time-budget)")
        return
    memory = {"gpu_memory_utilization": 0.4} if ctx.cuda else {"kv_cache_memory_gb": 0.05}
    try:
        worker = start_worker(
            model=str(model_dir),
            device=ctx.device.type,
            dtype="bfloat16" if ctx.cuda else "float32",
            spec_method=spec,
            num_spec_tokens=3,
            max_num_seqs=max(sizes),
            max_model_len=1024,
            cuda_graphs=graphs,
            log_level="warning",
            **memory,
        )
    except Exception as exc:
        ctx.add("served", f"{label} worker", FAIL, f"{type(exc).__name__}: {exc}"[-3000:])
        return
    ctx.add("served", f"{label} worker started", PASS, f"{time.perf_counter() - started:.1f} s")
    try:
        # Eager steps are bound by kernel launches: 256 rows show nothing 64 do not. With
        # graphs, each size also through a `zerobubble front` (the clients' calls out of
        # the scheduler's loop).
        for n in sizes if graphs or not ctx.cuda else sizes[:2]:
            for via in ("direct", "front-ports") if graphs or not ctx.cuda else ("direct",):
                name = f"{label} n={n}" + (" via fronts" if via == "front-ports" else "")
                served_pairs(ctx, worker, n, windows, args, name, via)
    finally:
        worker.stop()
    ctx.finish_last(started)
