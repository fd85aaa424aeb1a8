"""Tiny random-weight Llama/Qwen3 targets, EAGLE heads over them and self-distilled samples."""

from __future__ import annotations

import torch
import transformers

from zerobubble.tools.eagle_data import Sample
from zerobubble.worker_svc.eagle import EagleHead, SharedWeights

VOCAB, HIDDEN = 97, 32


def tiny_config(model_type: str = "llama") -> transformers.PretrainedConfig:
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[model_type]
    return cls(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


def tiny_shared(seed: int = 0) -> SharedWeights:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    return SharedWeights(embed=embed, lm_head=embed)


def tiny_head(model_type: str = "llama", seed: int = 1) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(tiny_config(model_type), tiny_shared())


def tiny_target() -> transformers.LlamaForCausalLM:
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(tiny_config()).eval()


@torch.no_grad()
def tiny_samples(target: transformers.LlamaForCausalLM, count: int, length: int = 24) -> list[Sample]:
    """Greedy answers of ``target`` to random prompts, with its final-normed hidden states."""
    g = torch.Generator().manual_seed(4)
    samples = []
    for _ in range(count):
        prompt = torch.randint(0, VOCAB, (1, 6), generator=g)
        ids = target.generate(prompt, max_new_tokens=length - 6, min_new_tokens=length - 6, do_sample=False)
        hidden = target.model(ids).last_hidden_state[0]
        samples.append(Sample(input_ids=ids[0].to(torch.int32), hidden=hidden, answer_start=6))
    return samples
