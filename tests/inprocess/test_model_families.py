"""Our paged flat-batch forward against Hugging Face's full-sequence forward, per model family.

Tiny random-weight models (2 layers, hidden 64) of every supported family are built with the
Hugging Face classes; our model loads their state dict and runs a schedule of mixed steps
(prefill chunks continuing earlier chunks, multi-token verification rows, single-token decodes).
Every row's logits must match Hugging Face's at the same position, for a scattered and a
contiguous block layout alike.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.support.hf_oracle import hf_greedy, report_divergence
from zerobubble.kernels._triton import KernelImpl
from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.linear import dequantize_int4, linear, quantize_int4, quantize_int8
from zerobubble.kernels.slot_mapping import compute_slot_mapping
from zerobubble.worker_svc.model import (
    EXACT_TOP_LOGITS,
    CausalLM,
    allocate_kv_cache,
    build_model,
    kv_cache_bytes_per_block,
    rope_tables,
)
from zerobubble.worker_svc.model_loader import load_model

VOCAB = 128
BLOCK_SIZE = 4
NUM_BLOCKS = 48
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)

# Request lengths, and per step the number of tokens each request runs (0 = skipped this step).
SEQ_LENS = [31, 10, 41, 7]
SCHEDULE = [
    [6, 7, 17, 4],  # first prefill chunks, short (batched) and long (looped)
    [19, 1, 13, 1],  # prefill chunks on top of earlier context, mixed with decodes
    [1, 1, 3, 1],  # decodes and a 3-token verification row
    [4, 0, 7, 0],  # short multi-token rows only, some requests idle
    [1, 1, 1, 1],  # a pure decode batch
]


def _llama() -> tuple[LlamaConfig, type[PreTrainedModel]]:
    return LlamaConfig(**COMMON), LlamaForCausalLM


def _llama_tied() -> tuple[LlamaConfig, type[PreTrainedModel]]:
    return LlamaConfig(**COMMON, tie_word_embeddings=True), LlamaForCausalLM


def _llama3_rope() -> tuple[LlamaConfig, type[PreTrainedModel]]:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    return LlamaConfig(**COMMON, rope_parameters=rope, attention_bias=True, mlp_bias=True), LlamaForCausalLM


def _mistral_sliding() -> tuple[MistralConfig, type[PreTrainedModel]]:
    return MistralConfig(**COMMON, sliding_window=8), MistralForCausalLM


def _qwen2() -> tuple[Qwen2Config, type[PreTrainedModel]]:
    return Qwen2Config(**COMMON, tie_word_embeddings=False), Qwen2ForCausalLM


def _qwen2_yarn() -> tuple[Qwen2Config, type[PreTrainedModel]]:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    return Qwen2Config(**COMMON, rope_parameters=rope, tie_word_embeddings=False), Qwen2ForCausalLM


def _qwen3() -> tuple[Qwen3Config, type[PreTrainedModel]]:
    # head_dim deliberately differs from hidden_size // num_attention_heads.
    return Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False), Qwen3ForCausalLM


# Mixtures of experts: 8 experts, so a decode step's few tokens leave some of them idle.
def _qwen3_moe() -> tuple[Qwen3MoeConfig, type[PreTrainedModel]]:
    config = Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                            norm_topk_prob=True, tie_word_embeddings=False)  # fmt: skip
    return config, Qwen3MoeForCausalLM


def _qwen2_moe() -> tuple[Qwen2MoeConfig, type[PreTrainedModel]]:
    # Top-4 without renormalizing, a shared expert, and a dense second layer (mlp_only_layers).
    config = Qwen2MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                            shared_expert_intermediate_size=80, mlp_only_layers=[1],
                            tie_word_embeddings=False)  # fmt: skip
    return config, Qwen2MoeForCausalLM


def _mixtral() -> tuple[MixtralConfig, type[PreTrainedModel]]:
    return MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2), MixtralForCausalLM


def _gpt_oss() -> tuple[GptOssConfig, type[PreTrainedModel]]:
    # Attention sinks and biases, a biased router, experts stored interleaved with the clamped
    # SwiGLU (a limit these weights reach), sliding and full layers alternating with a window the
    # schedule passes, and YaRN as gpt-oss's configs set it (factor 32 over 8 original positions).
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 8}  # fmt: skip
    config = GptOssConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters=rope, swiglu_limit=1.5,
    )  # fmt: skip
    return config, GptOssForCausalLM


def _gemma2() -> tuple[Gemma2Config, type[PreTrainedModel]]:
    # Caps small enough to bite on these weights; the query scale differs from head_dim's.
    return Gemma2Config(
        **COMMON, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
    ), Gemma2ForCausalLM  # fmt: skip


def _gemma3() -> tuple[Gemma3TextConfig, type[PreTrainedModel]]:
    # Sliding and full layers alternate, each with its own RoPE (the full ones linearly scaled).
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
    }
    config = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=20, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters=rope,
        final_logit_softcapping=6.0,
    )  # fmt: skip
    return config, Gemma3ForCausalLM


def _gemma3_multimodal() -> tuple[Gemma3Config, type[PreTrainedModel]]:
    """Gemma 3 as its 4B to 27B checkpoints come: a vision tower beside the language model,
    which is what we serve (text in, text out)."""
    from transformers import SiglipVisionConfig

    text, _ = _gemma3()
    text.final_logit_softcapping = None  # Gemma 3's checkpoints set none (and its multimodal model ignores one)
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    # Image token ids outside the random prompts' range: the prompts are text only.
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB + 3,
        boi_token_index=VOCAB + 1, eoi_token_index=VOCAB + 2,
    )  # fmt: skip
    return config, Gemma3ForConditionalGeneration


def _phi3_longrope() -> tuple[Phi3Config, type[PreTrainedModel]]:
    # Partial rotary (12 of 16 dimensions), LongRoPE switching to its long factors at position 16,
    # and a window.
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.5, 2.0, 1.2, 1.1, 3.0], "long_factor": [2.0, 4.0, 1.5, 6.0, 8.0, 3.0],
            "original_max_position_embeddings": 16}  # fmt: skip
    config = Phi3Config(
        **COMMON, rope_parameters=rope, original_max_position_embeddings=16, sliding_window=12, pad_token_id=0
    )
    return config, Phi3ForCausalLM


def _phi3() -> tuple[Phi3Config, type[PreTrainedModel]]:
    return Phi3Config(**COMMON, pad_token_id=0), Phi3ForCausalLM


FAMILIES: dict[str, Callable[[], tuple[object, type[PreTrainedModel]]]] = {
    "llama": _llama,
    "llama-tied": _llama_tied,
    "llama3-rope-bias": _llama3_rope,
    "mistral-sliding": _mistral_sliding,
    "qwen2": _qwen2,
    "qwen2-yarn": _qwen2_yarn,
    "qwen3": _qwen3,
    "qwen3-moe": _qwen3_moe,
    "qwen2-moe": _qwen2_moe,
    "mixtral": _mixtral,
    "gpt-oss": _gpt_oss,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3-multimodal": _gemma3_multimodal,
    "phi3": _phi3,
    "phi3-longrope": _phi3_longrope,
}
# Families whose Hugging Face forward picks its rotary table per call from the call's last
# position (LongRoPE): their oracle runs one token per call, as Hugging Face's decoding does.
PER_TOKEN_ORACLE = frozenset({"phi3-longrope"})


@dataclass(slots=True)
class Family:
    """A random-weight Hugging Face model, our copy of it, and the oracle logits."""

    config: object
    ours: CausalLM
    tokens: list[torch.Tensor]
    reference: list[torch.Tensor]  # per request: HF logits [len, vocab] over the whole sequence
    hf: PreTrainedModel


def _make_family(
    name: str,
    dtype: torch.dtype = torch.float32,
    kernels: KernelImpl = None,
    saved_to: Path | None = None,
    quantization: str = "none",
) -> Family:
    """``saved_to``: our copy loads the directory Hugging Face saves there (checkpoint names: per
    expert in mixtures of experts) rather than the in-memory state dict (transformers 5's names)."""
    config, model_class = FAMILIES[name]()
    torch.manual_seed(0)
    hf = model_class(config).eval()
    # Default init (std 0.02) gives near-uniform logits; bigger weights make the comparison bite.
    # Norm scales near 1: Gemma's norms scale by (1 + w), so there w is near 0.
    norm_center = 0.0 if config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if "norm" in param_name:
                param.copy_(norm_center + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    tokens = [torch.randint(0, VOCAB, (n,)) for n in SEQ_LENS]
    oracle = _hf_logits_per_token if name in PER_TOKEN_ORACLE else _hf_logits
    reference = [oracle(hf, t) for t in tokens]
    ours = build_model(config, dtype, "cpu", kernels=kernels, quantization=quantization)
    if saved_to is None:
        ours.load_weights(hf.state_dict())
    else:
        from safetensors.torch import load_file

        hf.save_pretrained(saved_to)
        ours.load_weights(load_file(saved_to / "model.safetensors"))
    return Family(config=config, ours=ours, tokens=tokens, reference=reference, hf=hf)


@torch.no_grad()
def _hf_logits(hf: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """Hugging Face's logits ``[len, vocab]`` over the whole sequence in one call."""
    return hf(tokens[None]).logits[0].float()


@torch.no_grad()
def _hf_logits_per_token(hf: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """The same, one token per call over Hugging Face's cache: each token rotated as when decoded."""
    from transformers import DynamicCache

    cache, rows = DynamicCache(config=hf.config), []
    for i in range(len(tokens)):
        out = hf(tokens[None, i : i + 1], cache=cache, use_cache=True)
        cache = out.cache
        rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def _block_tables(layout: str, generator: torch.Generator) -> torch.Tensor:
    blocks_per_request = -(-max(SEQ_LENS) // BLOCK_SIZE) + 1
    num_requests = len(SEQ_LENS)
    if layout == "contiguous":
        ids = torch.arange(num_requests * blocks_per_request)
    else:
        ids = torch.randperm(NUM_BLOCKS, generator=generator)[: num_requests * blocks_per_request]
    return ids.view(num_requests, blocks_per_request).to(torch.int32)


def _run_schedule(family: Family, layout: str) -> list[torch.Tensor]:
    """Run SCHEDULE through our model; returns per request the logits of every token it ran."""
    ours = family.ours
    kv_caches = allocate_kv_cache(family.config, NUM_BLOCKS, BLOCK_SIZE, ours.dtype, "cpu")
    block_tables = _block_tables(layout, torch.Generator().manual_seed(1))
    done = [0] * len(SEQ_LENS)
    logits: list[list[torch.Tensor]] = [[] for _ in SEQ_LENS]
    for step in SCHEDULE:
        running = [r for r, n in enumerate(step) if n > 0]
        ids, positions, q_lens = [], [], []
        for r in running:
            ids.append(family.tokens[r][done[r] : done[r] + step[r]])
            positions.append(torch.arange(done[r], done[r] + step[r]))
            q_lens.append(step[r])
        query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([done[r] + step[r] for r in running], dtype=torch.int32)
        tables = block_tables[running]
        flat_positions = torch.cat(positions)
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=tables,
            max_query_len=max(q_lens),
            max_seq_len=int(seq_lens.max()),
            slot_mapping=compute_slot_mapping(query_start_loc, flat_positions, tables, BLOCK_SIZE),
        )
        hidden = ours(torch.cat(ids), flat_positions, meta, kv_caches)
        step_logits = ours.compute_logits(hidden)
        for i, r in enumerate(running):
            logits[r].append(step_logits[query_start_loc[i] : query_start_loc[i + 1]])
            done[r] += step[r]
    assert done == SEQ_LENS
    return [torch.cat(per_request) for per_request in logits]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_mixed_batch_matches_hf(name: str) -> None:
    family = _make_family(name)
    paged = _run_schedule(family, "paged")
    contiguous = _run_schedule(family, "contiguous")
    for r, reference in enumerate(family.reference):
        assert paged[r].dtype == torch.float32
        torch.testing.assert_close(paged[r], reference, atol=2e-4, rtol=1e-4, msg=f"request {r}")
        torch.testing.assert_close(paged[r], contiguous[r], atol=1e-5, rtol=1e-5, msg=f"request {r} layout")


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "mixtral", "gpt-oss"])
def test_moe_checkpoint_names_load(name: str, tmp_path: Path) -> None:
    """A saved checkpoint keeps each expert's projections apart (Mixtral under ``block_sparse_moe``
    with w1/w3/w2), as the Hub's do; our copy loaded from it gives Hugging Face's logits too."""
    family = _make_family(name, saved_to=tmp_path)
    for r, logits in enumerate(_run_schedule(family, "paged")):
        torch.testing.assert_close(logits, family.reference[r], atol=2e-4, rtol=1e-4, msg=f"request {r}")


def _dequantized(weight: torch.Tensor, quantization: str) -> torch.Tensor:
    """What a weight-only quantized ``[out, in]`` weight stands for (zerobubble.kernels.linear)."""
    if quantization == "int8":
        q, scale = quantize_int8(weight)
        return q.float() * scale[:, None]
    return dequantize_int4(*quantize_int4(weight))


def _dequantized_hf(hf: PreTrainedModel, quantization: str) -> PreTrainedModel:
    """Hugging Face's model over the weights our quantized copy stands for: every projection
    dequantized, each expert's alone; embeddings, norms, routers and biases exact, and the lm_head
    under int4 (`CausalLM.logits_weight`). gpt-oss stores its experts ``[E, in, out]``: their
    rows are its columns."""
    hf = copy.deepcopy(hf)
    transposed = hf.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, param in hf.named_parameters():
            exact = "embed" in name or "norm" in name or name.endswith(("mlp.gate.weight", "mlp.router.weight"))
            if exact or param.dim() == 1 or name.endswith("_bias") or "sinks" in name:
                continue
            if name.startswith("lm_head") and quantization == "int4":
                continue
            stack = param.transpose(1, 2) if transposed and param.dim() == 3 else param
            rows = stack.reshape(-1, stack.shape[-1])  # an expert stack [E, out, in]: E x out rows
            stack.copy_(_dequantized(rows, quantization).reshape(stack.shape))
    return hf


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_are_the_dequantized_model(quantization: str, name: str) -> None:
    """Weight-only int8 and int4 cover the experts too (each expert its own quantized product,
    the router exact): our quantized Qwen3-MoE and gpt-oss give the logits of Hugging Face's
    over the dequantized weights."""
    family = _make_family(name, quantization=quantization)
    layer = family.ours.layers[0].moe
    assert layer is not None and layer.experts.gate_up_each is not None
    assert getattr(layer.experts.gate_up_each[0], quantization) is not None and layer.router.dense is not None
    oracle = _dequantized_hf(family.hf, quantization)
    for r, logits in enumerate(_run_schedule(family, "paged")):
        with torch.no_grad():
            reference = oracle(family.tokens[r][None]).logits[0]
        torch.testing.assert_close(logits, reference, atol=1e-3, rtol=1e-3, msg=f"request {r}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_half_precision_close_to_float32_reference(dtype: torch.dtype) -> None:
    family = _make_family("qwen3", dtype)
    paged = _run_schedule(family, "paged")
    for r, reference in enumerate(family.reference):
        # bf16 keeps ~3 significant digits (fp16 ~4); the argmax rarely flips on random weights.
        assert (paged[r].float() - reference).abs().max() < 0.15 * reference.abs().max()


@pytest.mark.parametrize(
    "name", ["llama", "qwen3", "mistral-sliding", "qwen2-moe", "qwen3-moe", "gemma2", "gemma3", "phi3"]
)
def test_compiled_cpu_kernels_are_as_close_to_hf_as_the_torch_ops(cpu_kernels: None, name: str) -> None:
    """A bfloat16 model on the C++ kernels (norms, rotation, SiLU, paged attention, routed experts) against the
    same model on the torch ops, both against Hugging Face's float32 logits, over prefill chunks,
    decodes and verification rows: no further from the oracle (the kernels keep attention's
    scores, probabilities and sums in float32, where the torch ops round them to bfloat16)."""
    compiled = _run_schedule(_make_family(name, torch.bfloat16, "cpp"), "paged")
    family = _make_family(name, torch.bfloat16)
    ops = _run_schedule(family, "paged")
    for r, reference in enumerate(family.reference):
        scale = reference.abs().max()
        ops_error, compiled_error = ((x.float() - reference).abs().max() / scale for x in (ops[r], compiled[r]))
        assert compiled_error <= 1.2 * ops_error + 0.005, (r, float(compiled_error), float(ops_error))


def test_compiled_cpu_kernels_give_gpt_oss_hf_logits_in_float32(cpu_kernels: None) -> None:
    """gpt-oss on the C++ kernels, its sinks in the compiled attention, in float32: Hugging Face's
    logits. (In bfloat16 this tiny model's expert choices turn on roundings, which moves its
    logits by tenths either way: the comparison above would measure that.)"""
    family = _make_family("gpt-oss", kernels="cpp")
    for r, logits in enumerate(_run_schedule(family, "paged")):
        torch.testing.assert_close(logits, family.reference[r], atol=2e-4, rtol=1e-4, msg=f"request {r}")


@pytest.mark.parametrize("name", ["llama", "llama-tied"])
def test_leading_logits_of_a_16_bit_model_are_float32_products(name: str) -> None:
    """The 16-bit lm_head rounds every logit to 8 significant bits; the leading ones are
    recomputed in float32 from the same hidden row and weight rows (the oracle: a float32
    matmul of both), so the argmax is float32's, and the other logits keep the 16-bit product."""
    family = _make_family(name, torch.bfloat16)
    ours = family.ours
    hidden = torch.randn(12, family.config.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    logits = ours.compute_logits(hidden)
    assert ours.head_rows is not None
    exact = hidden.float() @ ours.head_rows.float().T
    rounded = exact.bfloat16().float()  # what the 16-bit product gives, up to its own accumulation
    assert ours.lm_head is not None
    top = linear(hidden, ours.lm_head).float().topk(EXACT_TOP_LOGITS, dim=-1).indices  # the leading ones
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(1, top, False)
    assert not torch.equal(logits[rest], exact[rest])  # the tail is still the rounded product
    torch.testing.assert_close(logits[rest], rounded[rest], atol=0.05, rtol=2**-7)


def test_gpt_oss_yarn_tables_are_hugging_faces() -> None:
    """gpt-oss's YaRN (factor 32, ``truncate`` off) through transformers' own RoPE functions:
    its rotary embedding's cos and sin, attention scaling folded in, bit for bit."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config, _ = _gpt_oss()
    positions = torch.arange(config.max_position_embeddings)
    want_cos, want_sin = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_tables(config, config.head_dim, config.max_position_embeddings)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    assert float(cos[0, 0]) == pytest.approx(0.1 * math.log(32.0) + 1.0)  # YaRN's attention scaling, at angle 0


def test_kv_cache_sizing() -> None:
    config, _ = _qwen3()
    kv = allocate_kv_cache(config, 3, BLOCK_SIZE, torch.bfloat16, "cpu")
    assert len(kv) == 2 and kv[0][0].shape == (3, BLOCK_SIZE, 2, 32)
    per_block = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv) // 3
    assert kv_cache_bytes_per_block(config, BLOCK_SIZE, torch.bfloat16) == per_block


def _greedy(
    model: CausalLM, hf_config: object, prompts: list[list[int]], max_new_tokens: int, eos: set[int]
) -> list[list[int]]:
    """All prompts prefilled together in one step, then decoded together, one token per step."""
    block_size, blocks_per_request = 16, 8
    kv_caches = allocate_kv_cache(hf_config, len(prompts) * blocks_per_request, block_size, model.dtype, "cpu")
    tables = torch.arange(len(prompts) * blocks_per_request, dtype=torch.int32).flip(0).view(len(prompts), -1)
    sequences = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    computed = [0] * len(prompts)
    while True:
        running = [r for r in range(len(prompts)) if len(outputs[r]) < max_new_tokens and not eos & set(outputs[r])]
        if not running:
            return outputs
        chunks = [sequences[r][computed[r] :] for r in running]
        query_start_loc = torch.tensor(
            [0, *torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()], dtype=torch.int32
        )
        positions = torch.cat([torch.arange(computed[r], len(sequences[r])) for r in running])
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=torch.tensor([len(sequences[r]) for r in running], dtype=torch.int32),
            block_tables=tables[running],
            max_query_len=max(len(c) for c in chunks),
            max_seq_len=max(len(sequences[r]) for r in running),
            slot_mapping=compute_slot_mapping(query_start_loc, positions, tables[running], block_size),
        )
        hidden = model(torch.tensor([t for c in chunks for t in c]), positions, meta, kv_caches)
        next_tokens = model.compute_logits(hidden[query_start_loc[1:].long() - 1]).argmax(-1).tolist()
        for r, token in zip(running, next_tokens):
            computed[r] = len(sequences[r])
            sequences[r].append(token)
            outputs[r].append(token)


def test_smollm2_greedy_matches_hf_generate(smollm2_dir: Path, grounded_rows: list[dict[str, Any]]) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    texts = [row["messages"][-1]["content"] if "messages" in row else row["prompt"] for row in grounded_rows[:3]]
    # Different prompt lengths, so the batched prefill and decodes see ragged rows.
    prompts = [tokenizer.encode(text).ids[: 20 + 9 * i] for i, text in enumerate(texts)]
    max_new_tokens = 12
    reference = hf_greedy(smollm2_dir, prompts, max_new_tokens)
    loaded = load_model(str(smollm2_dir), "float32", "cpu")
    ours = _greedy(loaded.model, loaded.hf_config, prompts, max_new_tokens, set(loaded.eos_token_ids))
    for prompt, got, expected in zip(prompts, ours, reference):
        assert got == expected, report_divergence(smollm2_dir, prompt, got, expected)
