"""How much prompt-lookup speculation can gain on a workload, whatever the engine.

Generates each row greedily with Hugging Face (the reference output), then replays it step by
step with a plain-Python n-gram proposer (longest suffix of ``--ngram-max`` down to
``--ngram-min`` tokens, most recent earlier match, up to ``k`` drafts). Printed per kind: output
tokens per decode step (= the speed-up over no speculation if verifying drafts were free) and
the share of steps that had any draft. Our measured ngram ÷ none ratio can only approach this.

    python scripts/ngram_ceiling.py --kinds code-edit open-chat --limit 4 --k 3 5
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.hf_baseline import prompt_ids, resolve_model_dir  # noqa: E402
from zerobubble.bench import load_dataset  # noqa: E402


def propose(history: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Drafts after the most recent earlier occurrence of the longest matching suffix."""
    for n in range(min(n_max, len(history) - 1), n_min - 1, -1):
        suffix = history[-n:]
        for end in range(len(history) - 2, n - 2, -1):  # the window must end before the last token
            if history[end - n + 1 : end + 1] == suffix:
                return history[end + 1 : end + 1 + k]
    return []


def replay(prompt: list[int], output: list[int], n_min: int, n_max: int, k: int) -> tuple[int, int]:
    """(decode steps, steps with drafts) to emit ``output[1:]`` (output[0] comes from the prefill)."""
    seq = prompt + output
    pos = len(prompt)  # index of the last emitted token
    steps = drafted = 0
    while pos < len(seq) - 1:
        drafts = propose(seq[: pos + 1], n_min, n_max, k)
        accepted = 0
        while accepted < len(drafts) and pos + 1 + accepted < len(seq) and seq[pos + 1 + accepted] == drafts[accepted]:
            accepted += 1
        steps += 1
        drafted += bool(drafts)
        pos += accepted + 1
    return steps, drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, default=ROOT.parent / "shared" / "workloads" / "grounded.jsonl")
    parser.add_argument("--kinds", nargs="+", default=["code-edit", "open-chat", "grounded-qa"])
    parser.add_argument("--limit", type=int, default=4, help="rows per kind (bench_matrix spec uses 4)")
    parser.add_argument("--k", type=int, nargs="+", default=[3])
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    results = {}
    for kind in args.kinds:
        pairs = []
        for row in load_dataset(args.dataset, kind=kind, limit=args.limit):
            ids = prompt_ids(tokenizer, row)
            with torch.inference_mode():
                out = model.generate(torch.tensor([ids]), max_new_tokens=row.max_tokens, do_sample=False)
            pairs.append((list(ids), out[0, len(ids) :].tolist()))
        for k in args.k:
            steps = drafted = tokens = 0
            for prompt, output in pairs:
                s, d = replay(prompt, output, args.ngram_min, args.ngram_max, k)
                steps, drafted, tokens = steps + s, drafted + d, tokens + len(output) - 1
            results[f"{kind} k={k}"] = {"tokens_per_step": tokens / steps, "steps_with_drafts": drafted / steps}
            print(
                f"{kind:<12} k={k}: {tokens / steps:.2f} tokens/step, drafts in {drafted / steps:.0%} of steps",
                flush=True,
            )
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
