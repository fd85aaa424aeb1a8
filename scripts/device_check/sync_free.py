"""4. ``sync_free``: steady-state steps under ``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import time
import traceback

import torch

from device_check.common import FAIL, PASS, SKIP, Context
from device_check.models import build_runner, drive, in_memory_model, repetitive_prompts, tiny_config


def check_sync_free(ctx: Context) -> None:
    """Steady-state steps may not synchronise the host with the device (CUDA only)."""
    if not ctx.cuda:
        ctx.add("sync_free", "set_sync_debug_mode('error') around steps", SKIP, "needs CUDA")
        return
    import contextlib

    cfg = tiny_config("llama", vocab_size=512, max_position_embeddings=2048)
    loaded = in_memory_model(cfg, ctx.device, torch.bfloat16)
    prompts = repetitive_prompts(6, 100, cfg.vocab_size, 9)
    for spec in ("none", "ngram", "eagle", "eagle3"):
        for graphs in (False, True):
            name = f"spec={spec} cuda_graphs={graphs}"
            started = time.perf_counter()
            try:
                runner = build_runner(loaded, spec, graphs, num_blocks=512)
                drive(runner, prompts, 8, 2)  # warm-up: allocator, Triton compiles, graphs

                @contextlib.contextmanager
                def strict(step: int):
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        yield
                    finally:
                        torch.cuda.set_sync_debug_mode("default")

                stats = drive(runner, prompts, 48, 2, around_step=strict)
                ctx.add("sync_free", name, PASS, f"{stats.num_steps} steps without a host sync")
            except Exception as exc:
                ctx.add(
                    "sync_free", name, FAIL, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
                )
            ctx.finish_last(started)
