"""What a lower precision costs: teacher-forced agreement and perplexity against float32.

Every row of a workload, its prompt followed by float32's greedy continuation, is run through
the model once in float32 and once in the precision under test (``--dtype bfloat16``,
``--quantization int8``), each position predicting the next token of the same text. Two figures
per precision, over the continuation (what a served request reads): how often its most likely
next token is float32's (top-1 agreement), and its perplexity relative to float32's.

    python -m zerobubble.tools.quality --dataset grounded --limit 0
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.worker_svc.model import CausalLM, allocate_kv_cache
from zerobubble.worker_svc.model_loader import EMBEDDED_MODEL_NAME, LoadedModel, load_model

BLOCK_SIZE = 16


@dataclass(slots=True)
class Quality:
    """One precision against float32 over the same tokens."""

    name: str
    num_tokens: int
    top1_agreement: float  # fraction of positions whose argmax equals float32's
    perplexity: float
    reference_perplexity: float

    @property
    def perplexity_change(self) -> float:
        """Relative change of perplexity against float32 (0.01 = 1 % higher)."""
        return self.perplexity / self.reference_perplexity - 1.0


def row_logits(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    """float32 logits ``[T, vocab]`` of every position of one sequence, prefilled at once."""
    model = loaded.model
    assert isinstance(model, CausalLM)
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    kv_caches = allocate_kv_cache(loaded.hf_config, num_blocks, BLOCK_SIZE, model.dtype, model.device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
    )
    ids = torch.tensor(token_ids, dtype=torch.long)
    return model.compute_logits(model(ids, torch.arange(num_tokens), meta, kv_caches))


def compare(
    name: str, reference: list[torch.Tensor], other: list[torch.Tensor], rows: list[list[int]], starts: list[int]
) -> Quality:
    """Agreement and perplexities over the positions of ``rows`` that predict tokens from
    ``starts[i]`` on (the float32 model's own continuation), from float32's and other logits."""
    agree = total = 0
    nll_ref = nll_other = 0.0
    for ref, oth, ids, start in zip(reference, other, rows, starts):
        ref, oth = ref[start - 1 : -1], oth[start - 1 : -1]  # position p predicts token p + 1
        agree += int((ref.argmax(-1) == oth.argmax(-1)).sum())
        total += ref.shape[0]
        targets = torch.tensor(ids[start:], dtype=torch.long)
        nll_ref += float(torch.nn.functional.cross_entropy(ref, targets, reduction="sum"))
        nll_other += float(torch.nn.functional.cross_entropy(oth, targets, reduction="sum"))
    return Quality(name, total, agree / total, math.exp(nll_other / total), math.exp(nll_ref / total))


def greedy_continuations(
    loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 16
) -> list[list[int]]:
    """Each prompt followed by float32's greedy continuation (Hugging Face's ``generate``, the
    oracle every exactness test uses), up to and including its first EOS: the text a served
    request would read.

    Prompts are generated ``batch_size`` at a time, left-padded: a padded row's logits may differ
    from its unpadded run in the last bits, which can change a near-tied choice. That is harmless
    here: the continuation only supplies realistic text, and both precisions are scored on the
    same tokens.
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    eos = hf.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = min(stops) if stops else 0
    out = []
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
            generated = hf.generate(
                input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
            for ids, row in zip(batch, generated[:, width:].tolist(), strict=True):
                ends = [i for i, token in enumerate(row) if token in stops]
                out.append(ids + (row[: ends[0] + 1] if ends else row))
    return out


def workload_token_rows(loaded: LoadedModel, rows: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    """Each row's prompt through the model's chat template, cut to ``max_tokens``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(loaded.path)
    out = []
    for row in rows:
        if "messages" in row:
            # Any: transformers declares one union (text, ids or a BatchEncoding) for every mode.
            ids: Any = tokenizer.apply_chat_template(row["messages"], tokenize=True, add_generation_prompt=True)
            if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer(row["prompt"])["input_ids"]
        out.append(list(ids)[:max_tokens])
    return out


# name -> (activations dtype, quantization): each as `--dtype auto` runs it on a CPU with native bfloat16.
PRECISIONS = {
    "bfloat16": (torch.bfloat16, "none"),
    "int8": (torch.bfloat16, "int8"),
    "int4": (torch.bfloat16, "int4"),
}


def measure(
    rows: list[dict[str, Any]],
    precisions: list[str],
    max_tokens: int = 512,
    max_new_tokens: int = 64,
    model: str = EMBEDDED_MODEL_NAME,
) -> list[Quality]:
    """Each precision in ``precisions`` (keys of :data:`PRECISIONS`) against float32, teacher-forced
    on each row's prompt and float32's greedy continuation of it, scored on the continuation."""
    reference_model = load_model(model, torch.float32, "cpu")
    prompts = workload_token_rows(reference_model, rows, max_tokens)
    token_rows = greedy_continuations(reference_model, prompts, max_new_tokens)
    starts = [len(p) for p in prompts]
    reference = [row_logits(reference_model, ids) for ids in token_rows]
    del reference_model
    results = []
    for name in precisions:
        dtype, quantization = PRECISIONS[name]
        loaded = load_model(model, dtype, "cpu", quantization=quantization)
        other = [row_logits(loaded, ids) for ids in token_rows]
        results.append(compare(name, reference, other, token_rows, starts))
    return results


def main() -> None:
    from zerobubble.bench import resolve_dataset  # a shipped workload's name, or a path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="grounded", help="workload name or JSONL path")
    parser.add_argument("--limit", type=int, default=0, help="first N rows (0 = all)")
    parser.add_argument("--max-tokens", type=int, default=512, help="longest prompt, in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="float32's continuation, in tokens")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    lines = resolve_dataset(args.dataset).read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    rows = rows[: args.limit] if args.limit > 0 else rows
    results = measure(rows, args.precisions, args.max_tokens, args.max_new_tokens)
    print(f"{len(rows)} rows | precision | tokens | top-1 agreement | perplexity (float32) | change")
    for q in results:
        print(f"| {q.name} | {q.num_tokens} | {q.top1_agreement:.2%} | {q.perplexity:.3f} "
              f"({q.reference_perplexity:.3f}) | {q.perplexity_change:+.2%} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([{**{k: getattr(q, k) for k in q.__slots__}} for q in results], indent=2))


if __name__ == "__main__":
    main()
