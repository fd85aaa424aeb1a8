"""Random-weight model directories of any Hugging Face family, servable by our worker.

A family we cannot download is tested on a tiny model built from its own Hugging Face config
class with random weights; transformers' forward over the same directory is the oracle. The
directory borrows the embedded SmolLM2's tokenizer (and chat template), so the shipped workload
rows tokenize as they do for the real model, and the config's vocabulary is that tokenizer's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

# Files of the embedded model's directory that make a directory servable beside its weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_tiny_model(
    out_dir: Path,
    config: Any,
    tokenizer_dir: Path,
    seed: int = 0,
    init_std: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a random-weight model of ``config`` (an HF ``PretrainedConfig``, its ``vocab_size``
    set to the tokenizer's) with ``tokenizer_dir``'s tokenizer files into ``out_dir``.

    ``init_std`` overrides the config's ``initializer_range``: tiny models with the default
    0.02 have nearly flat logits, where greedy choices hang on rounding; a larger spread makes
    the argmax clear while staying well-conditioned. ``dtype``: the weights' (a benchmark's
    larger model in bfloat16 takes half the memory and disk).
    """
    from transformers import AutoModelForCausalLM

    if init_std is not None:
        config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file() and not (name == "generation_config.json" and (out_dir / name).exists()):
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    """Entries of the tokenizer's vocabulary, added tokens included: a config's ``vocab_size``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
