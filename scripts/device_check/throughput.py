"""5. ``throughput``: async over sync and n-gram over none, CUDA graphs on and off."""

from __future__ import annotations

from typing import Any

import torch

from device_check.common import FAIL, PASS, SKIP, Context
from device_check.models import build_runner, drive, in_memory_model, qwen3_1p7b_config, repetitive_prompts


def _throughput_runners(
    ctx: Context, loaded: Any, graph_modes: tuple[bool, ...], num_blocks: int
) -> dict[tuple[bool, str], Any]:
    """A runner per (CUDA graphs, spec method); one that fails to build is reported and left out."""
    runners = {}
    for graphs in graph_modes:
        for spec in ("none", "ngram", "eagle"):
            try:
                runners[graphs, spec] = build_runner(loaded, spec, graphs, num_blocks)
            except Exception as exc:
                ctx.add("throughput", f"runner spec={spec} cuda_graphs={graphs}", FAIL, f"{type(exc).__name__}: {exc}")
    return runners


def _measure_windows(
    ctx: Context, runner: Any, prompts: list[list[int]], max_tokens: int, windows: tuple[int, ...], name: str
) -> dict[str, list[tuple[float, float | None, int]]]:
    """(tokens/s, GPU busy fraction, steps) of each run, by mode (sync: window 1, async: 2)."""
    rates: dict[str, list[tuple[float, float | None, int]]] = {}
    for window in windows:
        try:
            stats = drive(runner, prompts, max_tokens, window)
        except Exception as exc:
            ctx.add("throughput", f"{name} window={window}", FAIL, f"{type(exc).__name__}: {exc}")
            continue
        key = "async" if window == 2 else "sync"
        rates.setdefault(key, []).append((stats.output_tokens / stats.wall_s, stats.gpu_busy_fraction, stats.num_steps))
    return rates


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _throughput_values(table: dict[str, dict[str, float | None]], num_prompts: int, graphs: bool) -> dict[str, Any]:
    """One report line's figures: each configuration's tokens/s and GPU busy fraction, and the
    ratios between them (None where a configuration is missing)."""
    entries = {
        (spec, mode): table.get(f"n={num_prompts} spec={spec} graphs={graphs} {mode}") or {}
        for spec in ("none", "ngram", "eagle")
        for mode in ("sync", "async")
    }
    values: dict[str, Any] = {}
    for (spec, mode), entry in entries.items():
        values[f"{spec}_{mode}_tok_s"] = entry.get("tok_s")
        values[f"{spec}_{mode}_gpu_busy"] = entry.get("gpu_busy")
    values["async_over_sync_none"] = _ratio(values["none_async_tok_s"], values["none_sync_tok_s"])
    values["async_over_sync_ngram"] = _ratio(values["ngram_async_tok_s"], values["ngram_sync_tok_s"])
    values["ngram_over_none_async"] = _ratio(values["ngram_async_tok_s"], values["none_async_tok_s"])
    values["ngram_over_none_sync"] = _ratio(values["ngram_sync_tok_s"], values["none_sync_tok_s"])
    values["async_over_sync_eagle"] = _ratio(values["eagle_async_tok_s"], values["eagle_sync_tok_s"])
    return values


def check_throughput(ctx: Context) -> None:
    """async ÷ sync and n-gram ÷ none at 2 / 8 / 16 prompts, CUDA graphs on and off."""
    cfg = qwen3_1p7b_config(ctx.dry_run or not ctx.cuda)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    loaded = in_memory_model(cfg, ctx.device, dtype)
    prompt_len, max_tokens = (16, 4) if ctx.dry_run else (256, 128)
    # The dry run exercises the code, not the machine: one run per configuration.
    windows = (1, 2) if ctx.dry_run else (1, 2, 1, 2)  # interleaved: A B A B
    # Blocks of 16 tokens for 16 prompts of prompt + output + draft slack, and spare.
    num_blocks = 16 * -(-(prompt_len + max_tokens + 32) // 16) + 64
    graph_modes = (False, True) if ctx.cuda else (False,)
    if not ctx.cuda:
        ctx.add("throughput", "cuda_graphs=True", SKIP, "CUDA graphs need CUDA")
    runners = _throughput_runners(ctx, loaded, graph_modes, num_blocks)
    table: dict[str, dict[str, float | None]] = {}
    out_of_time: set[tuple[int, bool]] = set()  # (prompts, graphs) with a workload skipped
    for num_prompts in (2, 8, 16):
        prompts = repetitive_prompts(num_prompts, prompt_len, cfg.vocab_size, num_prompts)
        for (graphs, spec), runner in list(runners.items()):
            name = f"n={num_prompts} spec={spec} graphs={graphs}"
            if ctx.time_left() < 20:
                ctx.add("throughput", name, SKIP, "out of time (--time-budget)")
                out_of_time.add((num_prompts, graphs))
                continue
            try:
                drive(runner, prompts[:2], 4, 2)  # warm-up at this shape
            except Exception as exc:
                # Most likely the first CUDA graph replays: drop this runner, keep the others.
                ctx.add("throughput", f"{name} warm-up", FAIL, f"{type(exc).__name__}: {exc}")
                del runners[graphs, spec]
                continue
            for key, runs in _measure_windows(ctx, runner, prompts, max_tokens, windows, name).items():
                busy = [r[1] for r in runs if r[1] is not None]
                table[f"{name} {key}"] = {
                    "tok_s": max(r[0] for r in runs),
                    "gpu_busy": max(busy) if busy else None,
                    "steps": runs[0][2],
                }
    for num_prompts in (2, 8, 16):
        for graphs in graph_modes:
            values = _throughput_values(table, num_prompts, graphs)
            if all(v is not None for k, v in values.items() if k.endswith("tok_s")):
                status, detail = PASS, "measured"
            elif (num_prompts, graphs) in out_of_time:
                status, detail = SKIP, "out of time before every configuration ran"
            else:
                status, detail = FAIL, "some configurations failed"
            ctx.add("throughput", f"{num_prompts} prompts, cuda_graphs={graphs}", status, detail, **values)
