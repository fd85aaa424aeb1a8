"""3. ``service``: greedy output of the real service against Hugging Face ``generate``."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from device_check.common import FAIL, PASS, REPO_ROOT, Context, stop_server
from device_check.models import tiny_config, write_model_dir
from zerobubble.tools.launch import free_port


def _hf_greedy(hf: Any, cfg: Any, prompts: list[list[int]], max_tokens: int, device: torch.device) -> list[list[int]]:
    """Hugging Face ``generate``'s greedy continuation of each prompt (the last token id is EOS)."""
    from transformers import GenerationConfig

    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=GenerationConfig(
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=cfg.vocab_size - 1,
                    pad_token_id=cfg.vocab_size - 1,
                ),
            )
            expected.append(out[0, len(prompt) :].tolist())
    return expected


def _serve_command(ctx: Context, model_dir: Path, port: int, spec: str, graphs: bool) -> list[str]:
    """The `zerobubble serve` command line for one service check."""
    cmd = [
        sys.executable,
        "-m",
        "zerobubble",
        "serve",
        "--model",
        str(model_dir),
        "--device",
        ctx.device.type,
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--metrics-port",
        "-1",
        "--http-port",
        "-1",
        "--spec-method",
        spec,
        "--max-num-seqs",
        "8",
        "--log-level",
        "warning",
        "--cuda-graphs" if graphs else "--no-cuda-graphs",
    ]
    if ctx.device.type == "cpu":
        cmd += ["--kv-cache-memory-gb", "0.05"]
    else:
        cmd += ["--gpu-memory-utilization", "0.1"]  # ~12 GB of KV on an H200: plenty, quick to set up
    return cmd


def _served_greedy(
    ctx: Context, proc: subprocess.Popen, port: int, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """The server's greedy tokens for each prompt, once it is ready (fails at once if it died)."""
    import asyncio

    import grpc

    from zerobubble.client import build_request, complete

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            deadline = time.monotonic() + min(90.0, max(ctx.time_left(), 5.0))
            while True:  # ready, or fail at once if the server died
                try:
                    await asyncio.wait_for(channel.channel_ready(), 1)
                    break
                except asyncio.TimeoutError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the server did not come up") from None
            done = await asyncio.gather(
                *(
                    complete(
                        channel,
                        build_request(token_ids=p, max_tokens=max_tokens, temperature=0.0),
                        timeout=60,
                    )
                    for p in prompts
                )
            )
            return [list(c.token_ids) for c in done]

    return asyncio.run(run())


def _check_one_server(
    ctx: Context,
    cmd: list[str],
    log_path: Path,
    name: str,
    port: int,
    prompts: list[list[int]],
    max_tokens: int,
    expected: list[list[int]],
) -> None:
    """Start one server, compare its greedy tokens with ``expected``, stop it: one record."""
    # The server's output goes to a file: a pipe nobody reads while it runs can fill and block it.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    num_prompts = len(prompts)
    try:
        got = _served_greedy(ctx, proc, port, prompts, max_tokens)
        mismatches = [i for i in range(num_prompts) if got[i] != expected[i]]
        ctx.add(
            "service",
            name,
            FAIL if mismatches else PASS,
            f"{num_prompts - len(mismatches)}/{num_prompts} prompts identical"
            + (f"; first differing prompt {mismatches[0]}" if mismatches else ""),
        )
    except Exception as exc:
        stop_server(proc)  # its last words are in the log then
        output = log_path.read_text(errors="replace")[-2000:]
        ctx.add("service", name, FAIL, f"{type(exc).__name__}: {exc}; server output: {output}")
    finally:
        stop_server(proc)


def check_service(ctx: Context) -> None:
    """Greedy tokens of `zerobubble serve` on this device against Hugging Face `generate`."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config("llama", vocab_size=512)
    torch.manual_seed(7)
    hf = LlamaForCausalLM(cfg).eval()
    max_tokens = 24
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (int(n),), generator=gen).tolist() for n in (5, 17, 33, 60)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "tiny-llama", hf, cfg.vocab_size)
        hf = hf.to(ctx.device)
        expected = _hf_greedy(hf, cfg, prompts, max_tokens, ctx.device)
        port = free_port()
        # The dry run starts one server (the n-gram path covers the plain one's code as well);
        # on CUDA each spec runs with CUDA graphs off and on (pure decode steps replay graphs).
        specs = ("ngram",) if ctx.dry_run else ("none", "ngram")
        for spec, graphs in [(s, g) for s in specs for g in ((False, True) if ctx.cuda else (False,))]:
            cmd = _serve_command(ctx, model_dir, port, spec, graphs)
            log_path = ctx.out_dir / f"service-{spec}{'-graphs' if graphs else ''}.log"
            name = f"greedy vs HF, spec={spec}" + (", cuda_graphs=True" if graphs else "")
            _check_one_server(ctx, cmd, log_path, name, port, prompts, max_tokens, expected)
            ctx.finish_last(started)
            started = time.perf_counter()
