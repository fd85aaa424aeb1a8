#!/usr/bin/env python
"""A random-weight Qwen3-MoE-shaped model sized for a small CPU, written as a Hugging Face
directory for the mixture-of-experts benchmarks (issue 54):

    python scripts/bench_moe.py --out models/qwen3-moe-1b        # ~1.0B total, ~0.2B active, bfloat16
    zerobubble serve --model models/qwen3-moe-1b --dtype bfloat16 ...

The shape is Qwen3-30B-A3B's scaled down (8 of 64 experts per token instead of 8 of 128, 18
layers): a decode token reads the attention, the router, its 8 experts per layer and the
lm_head, about a fifth of the weights. The embedded SmolLM2's tokenizer and chat template come
with it (tests/support/tiny_models.py), so the shipped workloads run unchanged. It prints the
total and active parameters and the bytes a decode token must read at least (the active floor),
the line a measured decode rate is set against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Runnable as `python scripts/bench_moe.py` from a checkout that is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The sizes of a Qwen3-MoE model (heads of hidden / heads, q/k norms, untied lm_head, every
    layer sparse)."""

    layers: int = 18
    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 4
    experts: int = 64
    top_k: int = 8
    expert_intermediate: int = 256


def parameter_counts(shape: MoeShape, vocab: int) -> tuple[int, int]:
    """(total, active per decode token) parameters; active counts the lm_head, not the embedding
    (one row of it is read)."""
    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    attention = shape.hidden * (q + 2 * kv) + q * shape.hidden + 2 * head_dim + 2 * shape.hidden
    expert = 3 * shape.hidden * shape.expert_intermediate
    router = shape.experts * shape.hidden
    total = shape.layers * (attention + router + shape.experts * expert) + 2 * vocab * shape.hidden + shape.hidden
    active = shape.layers * (attention + router + shape.top_k * expert) + vocab * shape.hidden + shape.hidden
    return total, active


def qwen3_moe_config(shape: MoeShape, vocab: int, tokenizer_config: dict[str, Any]) -> Any:
    """The Hugging Face config of ``shape`` with the tokenizer's vocabulary and special tokens."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=4 * shape.hidden,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.expert_intermediate, norm_topk_prob=True, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        bos_token_id=tokenizer_config.get("bos_token_id"), eos_token_id=tokenizer_config.get("eos_token_id"),
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> tuple[Path, MoeShape, str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    for field in dataclasses.fields(MoeShape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    args = parser.parse_args(argv)
    shape = MoeShape(**{f.name: getattr(args, f.name) for f in dataclasses.fields(MoeShape)})
    return args.out, shape, args.dtype


def main(argv: list[str] | None = None) -> None:
    import torch

    from tests.support.tiny_models import tokenizer_vocab_size, write_tiny_model
    from zerobubble.worker_svc.model_loader import resolve_model

    out, shape, dtype = parse_args(argv)
    tokenizer_dir = resolve_model("smollm2-135m")
    vocab = tokenizer_vocab_size(tokenizer_dir)
    total, active = parameter_counts(shape, vocab)
    width = 2 if dtype == "bfloat16" else 4
    print(f"{shape}\ntotal {total / 1e9:.3f}B parameters, active {active / 1e9:.3f}B per decode token")
    print(f"active floor: {active * width / 1e6:.0f} MB read per decode token ({dtype} weights)")
    config = qwen3_moe_config(shape, vocab, json.loads((tokenizer_dir / "config.json").read_text()))
    write_tiny_model(out, config, tokenizer_dir, seed=0, dtype=getattr(torch, dtype))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
