"""Random-weight model directories of any Hugging Face family, servable by our worker.

A family we cannot download is tested on a tiny model built from its own Hugging Face config
class with random weights; transformers' forward over the same directory is the oracle. The
directory borrows the embedded SmolLM2's tokenizer (and chat template), so the shipped workload
rows tokenize as they do for the real model, and the config's vocabulary is that tokenizer's.
"""

from __future__ import annotations

import json
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


# A released gpt-oss checkpoint's quantization_config (`mxfp4_checkpoint`).
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
MXFP4_PROJECTIONS = ("gate_up_proj", "down_proj")


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator, scales: tuple[int, int]) -> dict[str, Any]:
    """Blocks ``[*shape, 16]`` of random FP4 code pairs and scales ``shape`` in ``[low, high)``."""
    return {
        "blocks": torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8),
        "scales": torch.randint(*scales, shape, generator=generator, dtype=torch.uint8),
    }


def mxfp4_checkpoint(reference: Path, out: Path, seed: int = 0) -> Path:
    """A released-style MXFP4 copy of the gpt-oss directory ``reference``: its experts replaced
    by random codes and scales, and ``reference`` rewritten with their dequantized values (float32,
    no quantization_config): Hugging Face's reading of the MXFP4 copy."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(reference, out)
    generator = torch.Generator().manual_seed(seed)
    weights, packed_weights = load_file(reference / "model.safetensors"), {}
    for name, tensor in weights.items():
        if not name.endswith(MXFP4_PROJECTIONS):
            packed_weights[name] = tensor.to(torch.bfloat16)  # as released: the rest in bfloat16
            continue
        experts, rows_in, rows_out = tensor.shape  # [E, in, out]
        packed = random_mxfp4((experts, rows_out, rows_in // 32), generator, (122, 126))
        packed_weights.update({f"{name}_{part}": value for part, value in packed.items()})
        weights[name] = convert_moe_packed_tensors(packed["blocks"], packed["scales"], dtype=torch.float32)
    save_file(packed_weights, out / "model.safetensors", metadata={"format": "pt"})
    reference_weights = {n: w.to(torch.bfloat16).float() for n, w in weights.items()}  # the same bfloat16 rest
    save_file(reference_weights, reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    return out
