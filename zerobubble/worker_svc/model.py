"""Our decoder forward (Llama/SmolLM, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3/Phi-4 and the
mixtures of experts Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss) over a flat batch and a paged KV cache.

One forward call takes the tokens of many requests at once — prefill chunks and decodes mixed —
as flat ``input_ids [T]`` and ``positions [T]`` plus :class:`~zerobubble.kernels.attention.AttentionMetadata`
describing which request owns which tokens and where its KV blocks are. Logits are computed only
for the rows the caller asks for (:meth:`CausalLM.compute_logits`).

Weights come from a Hugging Face ``*ForCausalLM`` state dict. At load time q/k/v and gate/up
projections are fused into single matrices and the RoPE cos/sin table is precomputed, so a step is
a handful of large matmuls per layer; on CPU their weights are also laid out once for oneDNN
(:mod:`zerobubble.kernels.linear`). RoPE inverse frequencies and attention scaling come from
``transformers``' own RoPE functions, so every scaling variant matches Hugging Face exactly.
The sparse layers of the mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss) run routed
experts in place of the MLP (:mod:`zerobubble.worker_svc.moe`, `feed_forward`); gpt-oss's released
MXFP4 experts are dequantized as each layer reads them (:mod:`zerobubble.worker_svc.mxfp4`).

The families differ only in data read by the one forward (`ModelSpec`, `LayerWeights`): Gemma's
(1 + w) norms are stored as ``w + 1`` at load time, its extra norms after attention and MLP are
optional layer weights, GeGLU is an activation name, soft-capping values and the embedding scale
are numbers; Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are split into the usual names before
loading (`adapt_state_dict`), and its partial rotary becomes a permutation of the q/k head
dimensions with identity rows in the rotary table (`rotary_permutation`); gpt-oss's attention
sinks are a per-layer weight every attention path takes (`AttentionWeights.sinks`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from zerobubble.kernels._triton import KernelImpl, use_triton
from zerobubble.kernels.attention import (
    AttentionMetadata,
    AttentionPlan,
    new_kv_cache,
    paged_attention,
    plan_attention,
    write_kv_cache,
)
from zerobubble.kernels.fused import add_rms_norm, gelu_tanh_mul, qk_norm_rope, silu_mul
from zerobubble.kernels.linear import LinearWeight, PlanChooser, linear, prepare_linear
from zerobubble.worker_svc import mxfp4
from zerobubble.worker_svc.moe import (
    MOE_MODEL_TYPES,
    MoeLayer,
    MoeSpec,
    gated_mlp,
    moe_forward,
    moe_layer_weights,
    moe_spec,
)
from zerobubble.worker_svc.parallel import TensorParallel, row_linear, vocab_shard

logger = logging.getLogger(__name__)

# Leading logits of a 16-bit model recomputed in float32 (`CausalLM.compute_logits`).
EXACT_TOP_LOGITS = 8

SUPPORTED_MODEL_TYPES = (
    frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}) | MOE_MODEL_TYPES
)
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3", "longrope"})
# Hugging Face activation names -> ours; each of ours is a fused gate·up kernel (`ACTIVATIONS`).
_ACTIVATION_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ActMul = Callable[[torch.Tensor, KernelImpl], torch.Tensor]  # gate·up [T, 2 I] -> [T, I]
ACTIVATIONS: dict[str, ActMul] = {
    "silu": silu_mul,
    "gelu_tanh": gelu_tanh_mul,
}
_GEMMA_TYPES = frozenset({"gemma2", "gemma3_text"})
# Multimodal model types served as their language model alone (text in, text out).
TEXT_OF_MULTIMODAL = frozenset({"gemma3"})
# Where a multimodal checkpoint keeps its language model's weights, and our names for them.
_LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",  # as saved (transformers 4 layout, also 5's on disk)
    "model.language_model.": "model.",  # transformers 5 in memory
    "language_model.lm_head.": "lm_head.",
}
# Layer types whose rotary table is their own where a config gives one per type (Gemma 3).
_LOCAL_LAYER_TYPE, _GLOBAL_LAYER_TYPE = "sliding_attention", "full_attention"


def unsupported_model_type(model_type: object) -> str:
    """The one message refusing a model type: it names the type and the supported ones."""
    text_only = ", ".join(f"{t} (text only)" for t in sorted(TEXT_OF_MULTIMODAL))
    return f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}, {text_only})"


def language_config(hf_config: Any) -> Any:
    """The config of the model we run: a multimodal one's language model (`TEXT_OF_MULTIMODAL`:
    Gemma 3's 4B to 27B checkpoints), else the config itself. (Hugging Face's multimodal Gemma 3
    leaves out the final logit soft-cap that its text model applies; Gemma 3's configs set none.)"""
    if getattr(hf_config, "model_type", None) in TEXT_OF_MULTIMODAL:
        return hf_config.text_config
    return hf_config


KVCache = list[tuple[torch.Tensor, torch.Tensor]]
Taker = Callable[[str, tuple[int, ...]], torch.Tensor]
OptionalTaker = Callable[[str, tuple[int, ...], bool], torch.Tensor | None]
WeightMaker = Callable[[torch.Tensor], LinearWeight]


@dataclass(slots=True)
class ModelSpec:
    """The shape facts of a model, read once from its Hugging Face config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_windows: list[int]  # per layer; 0 = full attention
    moe: MoeSpec | None = None  # mixture-of-experts families (zerobubble.worker_svc.moe)
    # The families' differences, read by the one forward (defaults: Llama's).
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    activation: str = "silu"  # a key of ACTIVATIONS
    norm_offset: float = 0.0  # Gemma's norms scale by (offset + w); added to the stored weights at load
    sandwich_norms: bool = False  # Gemma: norms on the attention's and the MLP's outputs too
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden), rounded to the model dtype
    attn_softcap: float = 0.0  # Gemma 2: scores -> cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # Gemma 2: the same on the logits
    rotary_dim: int = 0  # dimensions of each head rotated (Phi: partial_rotary_factor); 0: head_dim
    attention_sinks: bool = False  # gpt-oss: a learned logit per query head joins each softmax
    local_rope: list[bool] = field(default_factory=list)  # per layer: its own rotary table (Gemma 3)


@dataclass(slots=True)
class AttentionWeights:
    """A decoder layer's attention projections, q/k/v fused into one matrix, with what the
    families add to them; apart from the layer's norms so each sublayer's weights read as one."""

    qkv_weight: LinearWeight  # [(Hq + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D]: Qwen3's per-head q and k norms side by side
    o_weight: LinearWeight  # [hidden, Hq D]
    o_bias: torch.Tensor | None
    sinks: torch.Tensor | None = None  # [Hq] float32: gpt-oss's attention sinks


@dataclass(slots=True)
class MlpWeights:
    """A dense layer's gated MLP, gate and up fused into one matrix (a sparse layer has
    `LayerWeights.moe` instead)."""

    gate_up_weight: LinearWeight  # [2 I, hidden]
    gate_up_bias: torch.Tensor | None
    down_weight: LinearWeight  # [hidden, I]
    down_bias: torch.Tensor | None


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's weights: its norms, its attention (`attn`) and its MLP (`mlp`, or
    `moe` in a sparse layer)."""

    input_norm: torch.Tensor | None  # [hidden]; None in an EAGLE-1 head's layer (its input goes in as is)
    attn: AttentionWeights
    post_norm: torch.Tensor  # [hidden]
    mlp: MlpWeights | None  # None in a sparse layer (`moe`)
    # An EAGLE-3 head's layer: its input is the token embedding ⊕ a hidden state ([T, 2 hidden]),
    # normed apart (`input_norm` the embedding, `hidden_norm` the state) before q/k/v; the
    # residual stream starts from the state, normed first when `norm_before_residual`.
    hidden_norm: torch.Tensor | None = None
    norm_before_residual: bool = False
    moe: MoeLayer | None = None  # a sparse layer's router and experts, in place of the dense MLP
    # Gemma's norms of the attention's and the MLP's outputs, before they join the residual stream.
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None


def model_spec(hf_config: Any) -> ModelSpec:
    """Read and check the config of a supported family; raises ``ValueError`` otherwise."""
    hf_config = language_config(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(unsupported_model_type(model_type))
    _refuse_quantized(hf_config)
    num_q_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_q_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_q_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    num_layers = int(hf_config.num_hidden_layers)
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_q_heads)
    return ModelSpec(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=int(hf_config.hidden_size),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        # Qwen2 always has q/k/v biases and never an o_proj bias (Qwen2-MoE: its qkv_bias); the
        # others follow attention_bias.
        qkv_bias=attention_bias or model_type == "qwen2" or bool(getattr(hf_config, "qkv_bias", False)),
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        sliding_windows=_sliding_windows(hf_config, num_layers),
        moe=moe_spec(hf_config, num_layers),
        **_family_traits(hf_config, model_type, head_dim),
    )


def _refuse_quantized(hf_config: Any) -> None:
    """A checkpoint stored quantized has weights our loader reads only in one case, gpt-oss's
    MXFP4 experts (dequantized at load, `zerobubble.worker_svc.mxfp4`); any other (GPTQ, AWQ,
    FP8...) is refused by name, before any weight is read."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    if method == "mxfp4" and getattr(hf_config, "model_type", None) == "gpt_oss":
        return
    raise ValueError(
        f"unsupported quantized checkpoint (quantization_config.quant_method {str(method)!r}): only gpt-oss's "
        "mxfp4 experts are read quantized; serve its unquantized (bfloat16) weights, weight-only int8/int4 "
        "is --quantization"
    )


def _family_traits(hf_config: Any, model_type: str, head_dim: int) -> dict[str, Any]:
    """`ModelSpec`'s fields beyond Llama's: Gemma's norms, scales and caps, partial rotary, and
    per-layer rotary tables; raises ``ValueError`` for a variant the forward does not run."""
    act_name = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None) or "silu"
    if act_name not in _ACTIVATION_NAMES:
        raise ValueError(f"unsupported activation {act_name!r} (supported: {', '.join(sorted(_ACTIVATION_NAMES))})")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise ValueError("unsupported use_bidirectional_attention (only causal models are served)")
    params = _rope_params(hf_config, None)
    per_type = isinstance(params.get(_LOCAL_LAYER_TYPE), dict)
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    partial = float(_rope_params(hf_config, _GLOBAL_LAYER_TYPE if per_type else None).get("partial_rotary_factor", 1.0))
    traits: dict[str, Any] = {
        "activation": _ACTIVATION_NAMES[act_name],
        "rotary_dim": int(head_dim * partial),
        "local_rope": [kind == _LOCAL_LAYER_TYPE for kind in layer_types] if per_type else [],
        "attention_sinks": model_type == "gpt_oss",
    }
    if model_type in _GEMMA_TYPES:
        # Gemma 3's attention ignores attn_logit_softcapping even where its config sets it.
        attn_cap = getattr(hf_config, "attn_logit_softcapping", None) if model_type == "gemma2" else None
        traits.update(
            attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=float(hf_config.hidden_size) ** 0.5,
            attn_softcap=float(attn_cap or 0.0),
            final_softcap=float(getattr(hf_config, "final_logit_softcapping", None) or 0.0),
        )
    return traits


def _sliding_windows(hf_config: Any, num_layers: int) -> list[int]:
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    layer_types = getattr(hf_config, "layer_types", None)
    if window == 0:
        return [0] * num_layers
    if layer_types is None:  # Mistral: one window for every layer
        return [window] * num_layers
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]


def _rope_params(hf_config: Any, layer_type: str | None) -> dict[str, Any]:
    """The config's RoPE parameters (one layer type's where it gives them per type, Gemma 3)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(legacy_scaling, dict):  # transformers 4 configs
        params = {**legacy_scaling, "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    if layer_type is not None:
        return dict(params.get(layer_type) or {})
    return params


def rope_tables(
    hf_config: Any, head_dim: int, num_positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` float32 ``[num_positions, rotary_dim // 2]``, attention scaling folded in;
    ``layer_type`` picks that type's parameters where the config gives them per type.

    ``dynamic`` scaling only changes frequencies past ``max_position_embeddings``, which is also
    our ``max_model_len``, so within range it equals the default table, as in Hugging Face.
    ``longrope`` (Phi-3) switches from its short to its long factors once the sequence passes
    ``original_max_position_embeddings``; Hugging Face decides per forward call from the call's
    last position, which for a decode is the token's own. Here the table switches per position:
    a token at position ``p`` takes the long factors iff ``p >= original``. That is Hugging Face's
    choice for every generated token and every prompt up to ``original`` tokens; a prompt longer
    than that is rotated with the short factors up to ``original`` here, the long ones there.
    """
    params = _rope_params(hf_config, layer_type)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
    positions = torch.arange(num_positions, dtype=torch.int64).float()[:, None]
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_scaling = 1.0
    else:
        # Imported here: transformers costs seconds of start-up and the default needs none of it.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        init = ROPE_INIT_FUNCTIONS[rope_type]
        by_type = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, attention_scaling = init(hf_config, torch.device("cpu"), **by_type)
        if rope_type == "longrope":
            original = int(params.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings)
            long_freq, _ = init(hf_config, torch.device("cpu"), seq_len=original + 1, **by_type)
            inv_freq = torch.where(positions < original, inv_freq.float()[None, :], long_freq.float()[None, :])
    # Same float32 products as Hugging Face's rotary embedding, so the tables match bit for bit.
    freqs = positions * (inv_freq.float() if inv_freq.dim() == 2 else inv_freq.float()[None, :])
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def rotary_tables(hf_config: Any, spec: ModelSpec, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(cos, cos)`` and ``(-sin, sin)`` ``[max_positions, head_dim]`` as
    `zerobubble.kernels.fused.qk_norm_rope` reads them. With partial rotary the dimensions past
    ``rotary_dim`` get cos 1 and sin 0, which leaves them as they are: `rotary_permutation` puts
    the head dimensions Hugging Face passes through there."""
    cos, sin = rope_tables(hf_config, spec.head_dim, spec.max_position_embeddings, layer_type)
    passed = spec.head_dim // 2 - cos.shape[1]
    if passed:
        cos = torch.cat((cos, torch.ones(cos.shape[0], passed)), dim=-1)
        sin = torch.cat((sin, torch.zeros(sin.shape[0], passed)), dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Head dimensions in our order ``[head_dim]`` (entry ``n``: Hugging Face's dimension at our
    ``n``) for partial rotary: Hugging Face rotates pairs ``(i, i + R/2)`` of the first ``R``
    dimensions; ours pairs ``(n, n + D/2)``. The same permutation of q and k leaves every score
    as it was, so only the q/k projection rows (and q/k norms) are permuted, at load time."""
    rot_half = rotary_dim // 2
    passed = torch.arange(rotary_dim, head_dim)
    first, second = passed.chunk(2) if len(passed) else (passed, passed)
    return torch.cat((torch.arange(rot_half), first, torch.arange(rot_half, rotary_dim), second))


@dataclass(frozen=True, slots=True)
class LinearSetup:
    """How a model's linear weights are laid out (zerobubble.kernels.linear): for their CPU
    products or plain (``prepack``), weight-only quantized (``"int8"``, ``"int4"``) or not, and
    what picks each weight's product per row count (zerobubble.kernels.linear_choice; None: the
    default plan)."""

    prepack: bool = True
    quantization: str = "none"
    chooser: PlanChooser | None = None


class StepInterrupted(Exception):
    """A forward stopped between layers because its results can no longer be used."""


@dataclass(slots=True)
class RopeTables:
    """A model's rotary tables on its device in its dtype, as `qk_norm_rope` reads them: the
    global ones and, for a family with per-layer tables, the local layers' (held as one so the
    model keeps one field for them, and whoever replaces them sees they go together)."""

    cos: torch.Tensor  # [max_positions, D]: (cos, cos)
    sin: torch.Tensor  # [max_positions, D]: (-sin, sin), see zerobubble.kernels.fused.qk_norm_rope_twin
    # The tables of the layers with `ModelSpec.local_rope` (Gemma 3's sliding layers), else None.
    local_cos: torch.Tensor | None = None
    local_sin: torch.Tensor | None = None

    @property
    def num_positions(self) -> int:
        """Positions the tables cover (the model's `max_position_embeddings`)."""
        return self.cos.shape[0]


@dataclass(slots=True, eq=False)
class CausalLM:
    """Llama-family decoder with fused projections; call it on a flat batch, then ``compute_logits``."""

    spec: ModelSpec
    dtype: torch.dtype
    device: torch.device
    rope: RopeTables
    linear: LinearSetup = field(default_factory=lambda: LinearSetup())
    # "cpp": the compiled CPU kernels serve the norms, rotation, SiLU, attention and the bfloat16
    # and int8 products (zerobubble.kernels.cpu); None: Triton on CUDA, the torch twins elsewhere.
    kernels: KernelImpl = None
    embed: torch.Tensor | None = None  # [vocab, hidden]
    lm_head: LinearWeight | None = None  # over the embedding itself when tied
    head_rows: torch.Tensor | None = None  # [vocab, hidden] plain lm_head rows (the embedding when tied)
    final_norm: torch.Tensor | None = None
    layers: list[LayerWeights] = field(default_factory=list)
    # Asked before each layer: True stops the forward with `StepInterrupted` (the runner's
    # check that a later plan has already finished every row of the step; see
    # `ModelRunner.note_finished`). A host-side call: it never waits for the device.
    interrupt: Callable[[], bool] | None = None
    # Layers whose input (the residual stream before them; 0: the embedding) `forward` returns
    # too, after the final hidden state: what an EAGLE-3 head drafts from.
    capture_layers: tuple[int, ...] = ()
    # This rank's group when the layers are sharded (`zerobubble.worker_svc.parallel`; `spec`
    # then holds this rank's head and intermediate counts).
    tp: TensorParallel = field(default_factory=TensorParallel)

    @property
    def scale(self) -> float:
        """Softmax scale: ``1/sqrt(head_dim)`` unless the family sets its own."""
        return self.spec.attention_scale or self.spec.head_dim**-0.5

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a Hugging Face ``*ForCausalLM`` state dict in, fusing q/k/v and gate/up.

        Raises ``KeyError`` for a missing tensor and ``ValueError`` for a wrong shape.
        """
        spec, hidden = self.spec, self.spec.hidden_size
        adapted = adapt_state_dict(spec, state_dict)
        # gpt-oss's MXFP4 experts: a rank's down_proj blocks cover its rows from block `first_row // 32`.
        rows = (0, 0) if spec.moe is None else (spec.moe.first_row % mxfp4.BLOCK, spec.moe.intermediate_size)
        take, take_optional, weight = self.weight_readers(mxfp4.dequantized(adapted, self.dtype, self.device, rows))
        self.layers = [
            layer_weights(spec, take, take_optional, weight, f"model.layers.{i}.", index=i)
            for i in range(spec.num_layers)
        ]
        self.embed = take("model.embed_tokens.weight", (spec.vocab_size, hidden))
        self.final_norm = take("model.norm.weight", (hidden,))
        tied = spec.tie_word_embeddings
        head = self.embed if tied else take("lm_head.weight", (spec.vocab_size, hidden))
        start, count = vocab_shard(spec.vocab_size, self.tp)
        self.lm_head = self.logits_weight(head if self.tp.size == 1 else head.narrow(0, start, count).contiguous())
        self.head_rows = head

    def logits_weight(self, rows: torch.Tensor) -> LinearWeight:
        """lm_head rows ``[N, hidden]`` laid out for their product: quantized as the other
        weights, except under int4, whose 4-bit logits cost most of its accuracy (top-1
        agreement 94 % against 99 % with the head unquantized, docs/benchmarks/cpu-llamacpp.md;
        llama.cpp keeps its output matrix at a higher precision too)."""
        setup = self.linear
        quantization = "none" if setup.quantization == "int4" else setup.quantization
        return prepare_linear(rows, setup.prepack, quantization, self.kernels, setup.chooser)

    def weight_readers(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[Taker, OptionalTaker, WeightMaker]:
        """``take(name, shape)`` (checked, in this model's dtype and device), ``take_optional``
        (None when absent by design) and ``weight`` (a linear weight laid out for this model)."""

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in state_dict:
                raise KeyError(f"missing weight {name!r}")
            tensor = state_dict[name]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            return tensor.to(device=self.device, dtype=self.dtype)

        def take_optional(name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
            return take(name, shape) if present else None

        def weight(tensor: torch.Tensor) -> LinearWeight:
            setup = self.linear
            return prepare_linear(tensor, setup.prepack, setup.quantization, self.kernels, setup.chooser)

        return take, take_optional, weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCache,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` (after the final norm) for a flat batch; writes K/V into
        ``kv_caches``. With `capture_layers`, ``[T, (1 + len(capture_layers)) hidden]``: the
        captured layers' inputs follow, in layer order (`compute_logits` reads the first part)."""
        assert self.embed is not None and self.final_norm is not None, "load_weights first"
        captured: list[torch.Tensor] = []
        embeds = F.embedding(input_ids, self.embed)
        if self.spec.embed_scale != 1.0:  # by the scale rounded to the model dtype, as Hugging Face's Gemma
            embeds = embeds * torch.tensor(self.spec.embed_scale, dtype=self.dtype).item()
        hidden, residual = self.run_layers(embeds, positions, meta, kv_caches, captured)
        final = add_rms_norm(hidden, residual, self.final_norm, self.spec.rms_norm_eps, self.kernels)[0]
        return torch.cat([final, *captured], dim=-1) if captured else final

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCache,
        captured: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers over input states ``hidden [T, hidden]``: the last sublayer's output
        and the residual stream before it, not yet added (the final norm fuses that add). The
        inputs of `capture_layers` are appended to ``captured``."""
        if not self.layers:
            raise RuntimeError("CausalLM.forward called before load_weights")
        spec = self.spec
        num_tokens = hidden.shape[0]
        eps = spec.rms_norm_eps
        rotations = self.rotaries(positions)
        plan: AttentionPlan | None = None
        # The torch path's plan reads host values: only on the CPU, where they are host memory.
        if not use_triton(hidden, None) and hidden.device.type == "cpu" and num_tokens > 0:
            # Soft-capped attention runs the torch path on the CPU (the compiled kernel has no cap).
            batched = self.kernels != "cpp" or spec.attn_softcap > 0
            plan = plan_attention(meta, kv_caches[0][0], spec.num_q_heads, batched=batched)
        act_mul = ACTIVATIONS[spec.activation]
        # The residual stream's add is fused into the norm that follows it: `hidden` is a
        # sublayer's output not yet added, `residual` the stream before it.
        residual: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache), window) in enumerate(zip(self.layers, kv_caches, spec.sliding_windows)):
            if self.interrupt is not None and self.interrupt():
                raise StepInterrupted
            normed, residual = layer_input(layer, hidden, residual, eps, self.kernels)
            if captured is not None and i in self.capture_layers:
                captured.append(residual.to(normed.dtype))  # the stream's sum into this layer
            cos, sin = rotations[1 if spec.local_rope and spec.local_rope[i] else 0]
            q = self.write_kv(layer, normed, cos, sin, (k_cache, v_cache), meta.slot_mapping)
            weights = layer.attn
            attn = paged_attention(
                q, k_cache, v_cache, meta, self.scale, self.kernels, sliding_window=window, plan=plan,
                softcap=spec.attn_softcap, sinks=weights.sinks,
            )  # fmt: skip
            hidden = row_linear(attn.reshape(num_tokens, -1), weights.o_weight, weights.o_bias, self.tp)
            hidden = self.output_norm(hidden, layer.attn_out_norm)
            normed, residual = add_rms_norm(hidden, residual, layer.post_norm, eps, self.kernels)
            hidden = feed_forward(layer, normed, act_mul, self.tp, self.kernels)
            hidden = self.output_norm(hidden, layer.mlp_out_norm)
        return hidden, residual

    def output_norm(self, hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output normed before it joins the residual stream (Gemma's post-norms)."""
        if weight is None:
            return hidden
        return add_rms_norm(hidden, None, weight, self.spec.rms_norm_eps, self.kernels)[0]

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables' rows ``(cos, sin)`` ``[T, D]`` at ``positions``."""
        rope = self.rope
        return rope.cos.index_select(0, positions), rope.sin.index_select(0, positions)

    def rotaries(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`rotary`'s rows of each table: the global one, then the local layers' where they have one."""
        rows = [self.rotary(positions)]
        rope = self.rope
        if rope.local_cos is not None and rope.local_sin is not None:
            rows.append((rope.local_cos.index_select(0, positions), rope.local_sin.index_select(0, positions)))
        return rows

    def write_kv(
        self,
        layer: LayerWeights,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """A layer's q/k/v projection of its normed input: writes K/V at ``slot_mapping``, returns q ``[T, Hq, D]``."""
        spec = self.spec
        qk_heads = spec.num_q_heads + spec.num_kv_heads
        attn = layer.attn
        qkv = linear(normed, attn.qkv_weight, attn.qkv_bias)
        # q and k get the same per-head norm and rotation, so they are processed as one tensor.
        qk = qk_norm_rope(qkv, cos, sin, attn.qk_norm, qk_heads, spec.head_dim, spec.rms_norm_eps, self.kernels)
        # narrow, not [] slicing: Python indexing takes a device guard, which a CUDA-less
        # build cannot give even to fake CUDA tensors (tests/inprocess/test_kernel_count.py).
        q, k = qk.split((spec.num_q_heads, spec.num_kv_heads), dim=1)
        kv_size = spec.num_kv_heads * spec.head_dim
        v = qkv.narrow(1, qk_heads * spec.head_dim, kv_size).view(normed.shape[0], spec.num_kv_heads, -1)
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping, self.kernels)
        return q

    __call__ = forward

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` for the selected hidden rows ``[N, hidden]`` (or rows of
        `forward`'s output with captured layers: their first ``hidden`` columns).

        A 16-bit product rounds every logit to 8 significant bits (steps of 1/16 between 8 and
        16), so a near-tie between the leading tokens would be settled by that rounding; the
        leading logits are recomputed in float32 from the same hidden row and weight rows, which
        makes the choice among them float32's (one greedy choice in about 200 differs otherwise).
        """
        assert self.lm_head is not None and self.head_rows is not None, "load_weights first"
        size = self.spec.hidden_size
        if hidden.shape[-1] != size:
            hidden = hidden.narrow(-1, 0, size).contiguous()
        logits = linear(hidden, self.lm_head)
        if self.tp.size > 1:  # this rank's share of the vocabulary (`parallel.vocab_shard`)
            logits = self.tp.gather_columns(logits, self.spec.vocab_size)
        logits = logits.float()
        if hidden.dtype != torch.float32:
            top = logits.topk(min(EXACT_TOP_LOGITS, logits.shape[-1]), dim=-1).indices
            rows = F.embedding(top, self.head_rows).float()  # [N, top, hidden]
            logits.scatter_(1, top, torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1))
        cap = self.spec.final_softcap
        # In float32 whatever the model dtype; monotonic, so the argmax is the uncapped one's.
        return logits if cap <= 0 else torch.tanh(logits / cap) * cap


def feed_forward(
    layer: LayerWeights, normed: torch.Tensor, act_mul: ActMul, tp: TensorParallel, impl: KernelImpl = None
) -> torch.Tensor:
    """A layer's MLP over its normed input: routed experts in a sparse layer (each
    tensor-parallel rank its share of them, `moe_forward`), else the dense gated MLP with the
    model's activation (`ACTIVATIONS`: SwiGLU, Gemma's GeGLU), its down projection row-parallel;
    either ends in one all-reduce over ``tp``."""
    if layer.moe is not None:
        return moe_forward(normed, layer.moe, impl, tp)
    mlp = layer.mlp
    assert mlp is not None
    return gated_mlp(normed, mlp.gate_up_weight, mlp.down_weight, impl, mlp.gate_up_bias, mlp.down_bias, act_mul, tp)


def layer_input(
    layer: LayerWeights, hidden: torch.Tensor, residual: torch.Tensor | None, eps: float, impl: KernelImpl = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's normed input and the residual stream with ``hidden`` added; a layer without an
    input norm (an EAGLE-1 head's) takes the sum as is, an EAGLE-3 head's (`LayerWeights.hidden_norm`)
    takes the embedding ⊕ state ``hidden [T, 2 H]`` of its first layer."""
    if layer.hidden_norm is not None:
        assert residual is None and layer.input_norm is not None, "an EAGLE-3 layer comes first"
        size = layer.hidden_norm.shape[0]
        embeds, state = hidden.narrow(-1, 0, size).contiguous(), hidden.narrow(-1, size, size).contiguous()
        normed_state = add_rms_norm(state, None, layer.hidden_norm, eps, impl)[0]
        normed = torch.cat((add_rms_norm(embeds, None, layer.input_norm, eps, impl)[0], normed_state), dim=-1)
        return normed, normed_state if layer.norm_before_residual else state
    if layer.input_norm is None:
        summed = hidden if residual is None else hidden + residual
        return summed, summed
    return add_rms_norm(hidden, residual, layer.input_norm, eps, impl)


def _qk_norm(spec: ModelSpec, take: Taker, prefix: str) -> torch.Tensor:
    """Qwen3's per-head q and k norm weights, one row per fused q/k head ``[q + kv heads, D]``."""
    q_norm = take(prefix + "self_attn.q_norm.weight", (spec.head_dim,))
    k_norm = take(prefix + "self_attn.k_norm.weight", (spec.head_dim,))
    return torch.cat((q_norm.expand(spec.num_q_heads, -1), k_norm.expand(spec.num_kv_heads, -1))).contiguous()


def _fuse_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The parts concatenated when every one is present (fused biases), else None."""
    present = [p for p in parts if p is not None]
    return torch.cat(present).contiguous() if len(present) == len(parts) else None


def layer_weights(
    spec: ModelSpec,
    take: Taker,
    take_optional: OptionalTaker,
    weight: WeightMaker,
    prefix: str,
    input_norm: bool = True,
    eagle3: bool = False,
    norm_before_residual: bool = False,
    index: int = 0,
) -> LayerWeights:
    """One decoder layer's weights from Hugging Face names under ``prefix``, q/k/v and gate/up
    fused; ``input_norm=False`` for a layer without one (an EAGLE-1 head's), ``eagle3`` for an
    EAGLE-3 head's (q/k/v over ``2 hidden`` inputs, a ``hidden_norm``); ``index``: the layer's
    number (which layers of a mixture of experts are sparse)."""
    hidden, head_dim, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    qkv_in = 2 * hidden if eagle3 else hidden
    q_size, kv_size = spec.num_q_heads * head_dim, spec.num_kv_heads * head_dim
    qkv_shapes = (("q", q_size), ("k", kv_size), ("v", kv_size))
    qkv = torch.cat([take(prefix + f"self_attn.{n}_proj.weight", (size, qkv_in)) for n, size in qkv_shapes])
    sparse = spec.moe is not None and spec.moe.sparse_layers[index]
    gate_up = (
        None if sparse else torch.cat([take(prefix + f"mlp.{n}_proj.weight", (inter, hidden)) for n in ("gate", "up")])
    )
    # Gemma: post_attention_layernorm norms the attention's output, pre_feedforward_layernorm the MLP's input.
    sandwich = spec.sandwich_norms
    mlp_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
    sinks = take_optional(prefix + "self_attn.sinks", (spec.num_q_heads,), spec.attention_sinks)
    attn = AttentionWeights(
        qkv_weight=weight(qkv.contiguous()),
        qkv_bias=_fuse_optional(
            [take_optional(prefix + f"self_attn.{n}_proj.bias", (size,), spec.qkv_bias) for n, size in qkv_shapes]
        ),
        qk_norm=_qk_norm(spec, take, prefix) if spec.qk_norm else None,
        o_weight=weight(take(prefix + "self_attn.o_proj.weight", (hidden, q_size))),
        o_bias=take_optional(prefix + "self_attn.o_proj.bias", (hidden,), spec.o_bias),
        sinks=None if sinks is None else sinks.float(),
    )
    mlp = None
    if gate_up is not None:
        mlp = MlpWeights(
            gate_up_weight=weight(gate_up.contiguous()),
            gate_up_bias=_fuse_optional(
                [take_optional(prefix + f"mlp.{n}_proj.bias", (inter,), spec.mlp_bias) for n in ("gate", "up")]
            ),
            down_weight=weight(take(prefix + "mlp.down_proj.weight", (hidden, inter))),
            down_bias=take_optional(prefix + "mlp.down_proj.bias", (hidden,), spec.mlp_bias),
        )
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight", (hidden,)) if input_norm else None,
        attn=attn,
        post_norm=take(prefix + mlp_norm + ".weight", (hidden,)),
        mlp=mlp,
        hidden_norm=take(prefix + "hidden_norm.weight", (hidden,)) if eagle3 else None,
        norm_before_residual=norm_before_residual,
        moe=moe_layer_weights(spec.moe, hidden, take, weight, prefix) if spec.moe is not None and sparse else None,
        attn_out_norm=take_optional(prefix + "post_attention_layernorm.weight", (hidden,), sandwich),
        mlp_out_norm=take_optional(prefix + "post_feedforward_layernorm.weight", (hidden,), sandwich),
    )


def adapt_state_dict(spec: ModelSpec, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict under the names and in the form `layer_weights` reads: fused
    ``qkv_proj`` / ``gate_up_proj`` (Phi-3) split into views, norm weights with
    `ModelSpec.norm_offset` added (in float32, before any rounding to the model dtype), and q/k
    rows in `rotary_permutation`'s order for partial rotary; a multimodal checkpoint's language
    model under the text model's names (its other weights are left unread)."""
    adapted = {_language_model_name(name): tensor for name, tensor in state_dict.items()}
    q_size, kv_size = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for name, tensor in list(adapted.items()):
        if name.endswith("self_attn.qkv_proj.weight"):
            del adapted[name]
            prefix = name.removesuffix("qkv_proj.weight")
            for part, chunk in zip("qkv", tensor.split((q_size, kv_size, kv_size))):
                adapted[f"{prefix}{part}_proj.weight"] = chunk
        elif name.endswith("mlp.gate_up_proj.weight"):
            del adapted[name]
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            adapted[prefix + "gate_proj.weight"], adapted[prefix + "up_proj.weight"] = gate, up
        elif name.endswith("norm.weight") and spec.norm_offset:
            adapted[name] = tensor.float() + spec.norm_offset
    if spec.rotary_dim and spec.rotary_dim < spec.head_dim:
        order = rotary_permutation(spec.head_dim, spec.rotary_dim)
        for name in list(adapted):
            if any(part in name for part in ("q_proj.", "k_proj.")):
                tensor = adapted[name]
                heads = tensor.shape[0] // spec.head_dim
                adapted[name] = tensor.reshape(heads, spec.head_dim, -1)[:, order].reshape(tensor.shape)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                adapted[name] = adapted[name][order]
    return adapted


def _language_model_name(name: str) -> str:
    """A multimodal checkpoint's language-model weight under the text model's name; others as they are."""
    for prefix, ours in _LANGUAGE_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return name


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    prepack: bool = True,
    quantization: str = "none",
    kernels: KernelImpl = None,
    linear_chooser: PlanChooser | None = None,
) -> CausalLM:
    """An empty :class:`CausalLM` for ``hf_config``; fill it with :meth:`CausalLM.load_weights`.

    ``prepack`` lays the linear weights out for their CPU products, ``quantization`` ("int8",
    "int4") stores them quantized, ``linear_chooser`` picks their products (see
    :mod:`zerobubble.kernels.linear`), ``kernels`` is `CausalLM.kernels`.
    """
    hf_config = language_config(hf_config)
    spec = model_spec(hf_config)
    cos, sin = rotary_tables(hf_config, spec, _GLOBAL_LAYER_TYPE if spec.local_rope else None)
    local_cos, local_sin = rotary_tables(hf_config, spec, _LOCAL_LAYER_TYPE) if spec.local_rope else (None, None)
    device = torch.device(device)
    logger.debug("building %s: %d layers, %d/%d heads of %d, %s on %s", spec.model_type, spec.num_layers,
                 spec.num_q_heads, spec.num_kv_heads, spec.head_dim, dtype, device)  # fmt: skip
    return CausalLM(
        spec=spec,
        dtype=dtype,
        device=device,
        rope=RopeTables(
            cos=cos.to(device=device, dtype=dtype),
            sin=sin.to(device=device, dtype=dtype),
            local_cos=None if local_cos is None else local_cos.to(device=device, dtype=dtype),
            local_sin=None if local_sin is None else local_sin.to(device=device, dtype=dtype),
        ),
        linear=LinearSetup(prepack, quantization, linear_chooser),
        kernels=kernels,
    )


def kv_cache_bytes_per_block(hf_config: Any, block_size: int, dtype: torch.dtype, num_kv_heads: int = 0) -> int:
    """Bytes one KV block takes across all layers (K and V); ``num_kv_heads``: a tensor-parallel
    rank's own (0: the model's)."""
    spec = model_spec(hf_config)
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * (num_kv_heads or spec.num_kv_heads) * spec.head_dim * element_size


def allocate_kv_cache(
    hf_config: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_kv_heads: int = 0,
) -> KVCache:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``, zeroed;
    ``num_kv_heads``: a tensor-parallel rank's own (0: the model's).

    The tensors are strided views (see :func:`zerobubble.kernels.attention.new_kv_cache`): address them by
    index or through their strides, not with ``view``.
    """
    spec = model_spec(hf_config)
    return [
        new_kv_cache(num_blocks, block_size, num_kv_heads or spec.num_kv_heads, spec.head_dim, dtype, device)
        for _ in range(spec.num_layers)
    ]
