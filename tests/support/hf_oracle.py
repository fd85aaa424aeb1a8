"""Hugging Face greedy generation as a reference for our outputs (a helper module, not a test).

``hf_greedy`` runs ``generate`` one prompt at a time (no padding, so it is exact), greedy, stopping
at EOS, and caches each prompt's continuation on disk, keyed by the model's weight-file metadata,
the transformers and torch versions and the prompt. A greedy continuation of N tokens is the first
N of a longer one, so one entry serves every ``max_new_tokens`` up to the longest computed (or any,
once it ended at EOS). The cache lives beside the converted model in the user's cache
(``~/.cache/zerobubble/hf-oracle``; ``ZEROBUBBLE_ORACLE_CACHE`` moves it), so a fresh clone on the
same machine does not run Hugging Face again for answers it already has. ``report_divergence``
explains a mismatch: where it starts and how close Hugging Face's top two logits were there (a
near-tie is float noise, a wide gap is a bug).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from zerobubble.worker_svc.model_loader import write_atomic

logger = logging.getLogger(__name__)

ORACLE_CACHE_DIR = Path(os.environ.get("ZEROBUBBLE_ORACLE_CACHE", Path.home() / ".cache" / "zerobubble" / "hf-oracle"))


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations (new tokens only, ending with the EOS token when one stopped it)."""
    model_dir = Path(model_dir)
    return [_greedy_one(model_dir, prompt, max_new_tokens) for prompt in prompts]


def _greedy_one(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    cache_file = ORACLE_CACHE_DIR / f"{_cache_key(model_dir, prompt)}.json"
    if cache_file.is_file():
        entry = json.loads(cache_file.read_text())
        if entry["max_new_tokens"] >= max_new_tokens or entry["stopped"]:
            return entry["outputs"][:max_new_tokens]
    from transformers import GenerationConfig

    model = load_hf_model(model_dir)
    eos_ids = _eos_token_ids(model)
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids or None,
        pad_token_id=eos_ids[0] if eos_ids else 0,
    )
    with torch.inference_mode():
        input_ids = torch.tensor([prompt], dtype=torch.long)
        generated = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
        )
    output = generated[0, len(prompt) :].tolist()
    stopped = len(output) < max_new_tokens or bool(output and output[-1] in eos_ids)
    write_atomic(cache_file, json.dumps({"max_new_tokens": max_new_tokens, "stopped": stopped, "outputs": output}))
    return output


def report_divergence(model_dir: str | Path, prompt: list[int], ours: list[int], ref: list[int]) -> str:
    """Describe where ``ours`` first departs from ``ref`` and Hugging Face's top-2 logit gap there."""
    position = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    if position == len(ours) == len(ref):
        return f"no divergence: {len(ours)} identical tokens"
    model = load_hf_model(Path(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:position]], dtype=torch.long)).logits[0, -1].float()
    top = logits.topk(2)
    (first_id, second_id), (first_logit, second_logit) = top.indices.tolist(), top.values.tolist()

    def describe(tokens: list[int]) -> str:
        if position >= len(tokens):
            return "<end>"
        return f"{tokens[position]} (HF logit {logits[tokens[position]].item():.4f})"

    return (
        f"first divergence at output position {position} (sequence position {len(prompt) + position}): "
        f"ours {describe(ours)}, reference {describe(ref)}; HF top-2 there: {first_id} ({first_logit:.4f}) "
        f"vs {second_id} ({second_logit:.4f}), gap {first_logit - second_logit:.3e}"
    )


def _cache_key(model_dir: Path, prompt: list[int]) -> str:
    import transformers

    files = sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"])
    key: dict[str, Any] = {
        "files": [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()],
        "model_dir": str(model_dir.resolve()),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt": prompt,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=2)
def load_hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    logger.info("loading Hugging Face reference model from %s", model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _eos_token_ids(model: Any) -> list[int]:
    found: list[int] = []
    for source in (model.generation_config, model.config):
        value = getattr(source, "eos_token_id", None)
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in found:
                found.append(token)
    return found
