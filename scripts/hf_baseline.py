#!/usr/bin/env python
"""Hugging Face continuous-batching baseline for ``zerobubble bench``, and the comparison of the two.

Runs the same rows as ``zerobubble bench`` (same loader, same ``--kind``/``--limit``/
``--max-tokens-cap``) through transformers' continuous-batching engine, greedy, in one process:

    python scripts/hf_baseline.py --dataset data.jsonl --json hf.json
    python scripts/hf_baseline.py --compare ours.json --hf-results hf.json   # no model run
    python scripts/hf_baseline.py --dataset data.jsonl --compare ours.json   # run, then compare

Why the manager rather than ``model.generate_batch``: in transformers 5.24 ``generate_batch``
takes one ``max_new_tokens`` for the whole batch, so rows with smaller limits would generate
tokens nobody asked for and the baseline would look slower than it is. We drive the same engine
through ``continuous_batching_context_manager`` (exactly what ``generate_batch`` wraps:
workload hints, warmup, ``add_request``, ``get_result``) and give each request its own
``max_new_tokens``. Warmup is excluded from ``wall_s``, as the server is warm when benchmarked.

Rows that ask for a temperature are still run greedy here (the baseline measures the engine,
not sampling) and are marked ``sampled`` so the comparison leaves them out of token agreement.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Runnable as `python scripts/hf_baseline.py` from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zerobubble.bench import BenchRow, load_dataset  # noqa: E402

logger = logging.getLogger("hf_baseline")

DEFAULT_MODEL = "smollm2-135m"


def resolve_model_dir(spec: str) -> Path:
    """A Hugging Face directory for ``spec`` through the worker's own resolver, so both sides
    load the very same files (the embedded GGUF is converted once and cached)."""
    from zerobubble.worker_svc.model_loader import resolve_model

    return Path(resolve_model(spec))


def prompt_ids(tokenizer: Any, row: BenchRow) -> list[int]:
    """Prompt token ids: chat template with the generation prompt for messages, plain encoding for text."""
    if row.messages is not None:
        encoded = tokenizer.apply_chat_template(
            row.messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])
    return list(tokenizer(row.prompt)["input_ids"])


def eos_ids_of(generation_config: Any) -> list[int]:
    """EOS ids from a GenerationConfig, whose field may be an int, a list or unset."""
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def run_hf(rows: Sequence[BenchRow], model_dir: Path, *, device: str, dtype: str) -> dict[str, Any]:
    """Generate every row with HF continuous batching; returns the report (bench's shape)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    torch_device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        dtype, torch.bfloat16 if torch_device == "cuda" else torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(torch_device).eval()
    eos_ids = eos_ids_of(model.generation_config) or (
        [int(model.config.eos_token_id)] if model.config.eos_token_id is not None else []
    )
    inputs = [prompt_ids(tokenizer, row) for row in rows]
    max_new = max(row.max_tokens for row in rows)
    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos_ids or None,
        pad_token_id=model.generation_config.pad_token_id,
    )
    results, wall_s = _generate_all(model, generation_config, rows, inputs, eos_ids)
    requests = [
        _request_report(row, ids, results.get(f"row-{row.index}"), tokenizer, eos_ids) for row, ids in zip(rows, inputs)
    ]
    output_tokens = sum(len(r["token_ids"]) for r in requests)
    return {
        "engine": "transformers continuous batching",
        "transformers_version": transformers.__version__,
        "model_dir": str(model_dir),
        "device": torch_device,
        "dtype": str(torch_dtype).removeprefix("torch."),
        "eos_token_ids": eos_ids,
        "num_requests": len(requests),
        "num_errors": sum(1 for r in requests if r["finish_reason"] == "error"),
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(requests) / wall_s if wall_s > 0 else 0.0,
        "requests": requests,
    }


def _generate_all(
    model: Any, generation_config: Any, rows: Sequence[BenchRow], inputs: list[list[int]], eos_ids: list[int]
) -> tuple[dict[str, Any], float]:
    """Every row through one continuous-batching manager; its results by request id and the
    wall time from the first request added to the last result."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    max_new = generation_config.max_new_tokens
    hints = WorkloadHints(
        max_prompt_length=max(len(ids) for ids in inputs), max_generated_length=max_new, num_requests=len(rows)
    )
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
        generation_config=generation_config, block=True, timeout=5, workload_hints=hints
    ) as manager:
        started = time.perf_counter()
        for row, ids in zip(rows, inputs):
            manager.add_request(
                ids, request_id=f"row-{row.index}", max_new_tokens=row.max_tokens, eos_token_id=eos_ids or -1
            )
        while len(results) < len(rows):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                logger.error("HF generation loop stopped with %d of %d requests done", len(results), len(rows))
                break
        wall_s = time.perf_counter() - started
    return results, wall_s


def _request_report(row: BenchRow, ids: list[int], result: Any, tokenizer: Any, eos_ids: list[int]) -> dict[str, Any]:
    """One request's entry of the report (bench's shape); `result` None: it never finished."""
    tokens = list(result.generated_tokens) if result is not None else []
    error = "missing result" if result is None else (result.error or "")
    return {
        "index": row.index,
        "kind": row.kind,
        "token_ids": tokens,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "finish_reason": "error" if error else ("eos" if tokens and tokens[-1] in eos_ids else "max_tokens"),
        "num_prompt_tokens": len(ids),
        "sampled": bool(row.temperature),
        **({"error": error} if error else {}),
    }


def strip_trailing_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """Token ids without a final EOS: engines differ on whether they report it."""
    return list(tokens[:-1]) if tokens and tokens[-1] in eos_ids else list(tokens)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix); None when equal."""
    for position, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_reports(ours: Mapping[str, Any], hf: Mapping[str, Any]) -> dict[str, Any]:
    """Throughput ratio (ours ÷ HF) and per-request greedy token agreement, matched by dataset index."""
    eos_ids = list(hf.get("eos_token_ids", []))
    hf_by_index = {r["index"]: r for r in hf["requests"]}
    compared, agreeing = 0, 0
    mismatches: list[dict[str, Any]] = []
    for mine in ours["requests"]:
        theirs = hf_by_index.get(mine["index"])
        if theirs is None or theirs.get("sampled") or "error" in (mine["finish_reason"], theirs["finish_reason"]):
            continue
        compared += 1
        a = strip_trailing_eos(mine["token_ids"], eos_ids)
        b = strip_trailing_eos(theirs["token_ids"], eos_ids)
        position = first_divergence(a, b)
        if position is None:
            agreeing += 1
        else:
            mismatches.append(
                {"index": mine["index"], "first_divergence": position, "ours_len": len(a), "hf_len": len(b)}
            )
    hf_tps = hf["output_tokens_per_s"]
    return {
        "ours_output_tokens_per_s": ours["output_tokens_per_s"],
        "hf_output_tokens_per_s": hf_tps,
        "throughput_ratio": ours["output_tokens_per_s"] / hf_tps if hf_tps > 0 else None,
        "compared": compared,
        "agreeing": agreeing,
        "mismatches": mismatches,
    }


def format_comparison(result: Mapping[str, Any]) -> str:
    """The lines ``--compare`` prints."""
    ratio = result["throughput_ratio"]
    lines = [
        f"throughput   ours {result['ours_output_tokens_per_s']:.1f} tok/s, "
        f"HF {result['hf_output_tokens_per_s']:.1f} tok/s, ratio ours/HF "
        + ("n/a" if ratio is None else f"{ratio:.2f}x"),
        f"token ids    {result['agreeing']}/{result['compared']} greedy requests agree",
    ]
    for mismatch in result["mismatches"][:10]:
        lines.append(
            f"  row {mismatch['index']}: first divergence at token {mismatch['first_divergence']} "
            f"(ours {mismatch['ours_len']} tokens, HF {mismatch['hf_len']})"
        )
    if len(result["mismatches"]) > 10:
        lines.append(f"  ... and {len(result['mismatches']) - 10} more")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", help="JSONL dataset, as for `zerobubble bench`")
    parser.add_argument("--kind", default="", help="only rows of this kind")
    parser.add_argument("--limit", type=int, default=0, help="first N rows after --kind (0 = all)")
    parser.add_argument("--max-tokens-cap", type=int, default=0, help="cap every row's max_tokens (0 = off)")
    parser.add_argument(
        "--model-dir",
        default=DEFAULT_MODEL,
        help="Hugging Face directory, .gguf, or 'smollm2-135m' (the embedded model)",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16"),
        help="auto = float32 on CPU, bfloat16 on CUDA (as the worker)",
    )
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--json", default="", help="write the HF report here")
    parser.add_argument("--compare", default="", help="a `zerobubble bench --json` report to compare with")
    parser.add_argument("--hf-results", default="", help="with --compare: an earlier HF report instead of running")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the baseline and/or the comparison; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.hf_results:
        hf = json.loads(Path(args.hf_results).read_text(encoding="utf-8"))
    else:
        if not args.dataset:
            print("error: --dataset is required unless --hf-results is given", file=sys.stderr)
            return 2
        rows = load_dataset(args.dataset, kind=args.kind, limit=args.limit, max_tokens_cap=args.max_tokens_cap)
        if not rows:
            print("error: no rows selected", file=sys.stderr)
            return 2
        if args.num_threads > 0:
            import torch

            torch.set_num_threads(args.num_threads)
        hf = run_hf(rows, resolve_model_dir(args.model_dir), device=args.device, dtype=args.dtype)
        print(
            f"HF baseline  {hf['num_requests']} requests, {hf['output_tokens']} output tokens in "
            f"{hf['wall_s']:.2f} s: {hf['output_tokens_per_s']:.1f} tok/s ({hf['device']}, {hf['dtype']})"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(hf, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.compare:
        ours = json.loads(Path(args.compare).read_text(encoding="utf-8"))
        print(format_comparison(compare_reports(ours, hf)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
