"""Our Llama-family forward (Llama/SmolLM, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

One forward call takes the tokens of many requests at once — prefill chunks and decodes mixed —
as flat ``input_ids [T]`` and ``positions [T]`` plus :class:`~zerobubble.kernels.attention.AttentionMetadata`
describing which request owns which tokens and where its KV blocks are. Logits are computed only
for the rows the caller asks for (:meth:`CausalLM.compute_logits`).

Weights come from a Hugging Face ``*ForCausalLM`` state dict. At load time q/k/v and gate/up
projections are fused into single matrices and the RoPE cos/sin table is precomputed, so a step is
a handful of large matmuls per layer; on CPU their weights are also laid out once for oneDNN
(:mod:`zerobubble.kernels.linear`). RoPE inverse frequencies and attention scaling come from
``transformers``' own RoPE functions, so every scaling variant matches Hugging Face exactly.
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
from zerobubble.kernels.fused import add_rms_norm, qk_norm_rope, silu_mul
from zerobubble.kernels.linear import LinearWeight, PlanChooser, linear, prepare_linear
from zerobubble.worker_svc.parallel import TensorParallel, row_linear

logger = logging.getLogger(__name__)

# Leading logits of a 16-bit model recomputed in float32 (`CausalLM.compute_logits`).
EXACT_TOP_LOGITS = 8

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "llama3"})
_SILU_NAMES = frozenset({"silu", "swish"})

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


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer's weights, with q/k/v and gate/up fused into single matrices."""

    input_norm: torch.Tensor | None  # [hidden]; None in an EAGLE-1 head's layer (its input goes in as is)
    qkv_weight: LinearWeight  # [(Hq + 2 Hkv) D, hidden]
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [Hq + Hkv, D]: Qwen3's per-head q and k norms side by side
    o_weight: LinearWeight  # [hidden, Hq D]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    gate_up_weight: LinearWeight  # [2 I, hidden]
    gate_up_bias: torch.Tensor | None
    down_weight: LinearWeight  # [hidden, I]
    down_bias: torch.Tensor | None
    # An EAGLE-3 head's layer: its input is the token embedding ⊕ a hidden state ([T, 2 hidden]),
    # normed apart (`input_norm` the embedding, `hidden_norm` the state) before q/k/v; the
    # residual stream starts from the state, normed first when `norm_before_residual`.
    hidden_norm: torch.Tensor | None = None
    norm_before_residual: bool = False


def model_spec(hf_config: Any) -> ModelSpec:
    """Read and check the config of a supported family; raises ``ValueError`` otherwise."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
        )
    if getattr(hf_config, "hidden_act", "silu") not in _SILU_NAMES:
        raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r} (only SwiGLU/silu models are supported)")
    num_q_heads = int(hf_config.num_attention_heads)
    num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_q_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_q_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    num_layers = int(hf_config.num_hidden_layers)
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelSpec(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=int(hf_config.hidden_size),
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_q_heads),
        intermediate_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        # Qwen2 always has q/k/v biases and never an o_proj bias; the others follow attention_bias.
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        sliding_windows=_sliding_windows(hf_config, num_layers),
    )


def _sliding_windows(hf_config: Any, num_layers: int) -> list[int]:
    window = int(getattr(hf_config, "sliding_window", None) or 0)
    layer_types = getattr(hf_config, "layer_types", None)
    if window == 0:
        return [0] * num_layers
    if layer_types is None:  # Mistral: one window for every layer
        return [window] * num_layers
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]


def rope_tables(hf_config: Any, head_dim: int, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` float32 ``[num_positions, head_dim // 2]``, attention scaling folded in.

    ``dynamic`` scaling only changes frequencies past ``max_position_embeddings``, which is also
    our ``max_model_len``, so within range it equals the default table, as in Hugging Face.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(legacy_scaling, dict):  # transformers 4 configs
        params = {**legacy_scaling, "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))})")
    if rope_type == "default":
        base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_scaling = 1.0
    else:
        # Imported here: transformers costs seconds of start-up and the default needs none of it.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    # Same float32 products as Hugging Face's rotary embedding, so the tables match bit for bit.
    freqs = torch.arange(num_positions, dtype=torch.int64).float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


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


@dataclass(slots=True, eq=False)
class CausalLM:
    """Llama-family decoder with fused projections; call it on a flat batch, then ``compute_logits``."""

    spec: ModelSpec
    dtype: torch.dtype
    device: torch.device
    rope_cos: torch.Tensor  # [max_positions, D] in dtype: (cos, cos)
    rope_sin: torch.Tensor  # [max_positions, D]: (-sin, sin), see zerobubble.kernels.fused.qk_norm_rope_twin
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
        """Softmax scale ``1/sqrt(head_dim)``."""
        return self.spec.head_dim**-0.5

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a Hugging Face ``*ForCausalLM`` state dict in, fusing q/k/v and gate/up.

        Raises ``KeyError`` for a missing tensor and ``ValueError`` for a wrong shape.
        """
        spec, hidden = self.spec, self.spec.hidden_size
        take, take_optional, weight = self.weight_readers(state_dict)
        self.layers = [
            layer_weights(spec, take, take_optional, weight, f"model.layers.{i}.") for i in range(spec.num_layers)
        ]
        self.embed = take("model.embed_tokens.weight", (spec.vocab_size, hidden))
        self.final_norm = take("model.norm.weight", (hidden,))
        tied = spec.tie_word_embeddings
        head = self.embed if tied else take("lm_head.weight", (spec.vocab_size, hidden))
        self.lm_head = self.logits_weight(head)
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
        hidden, residual = self.run_layers(F.embedding(input_ids, self.embed), positions, meta, kv_caches, captured)
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
        cos, sin = self.rotary(positions)
        plan: AttentionPlan | None = None
        # The torch path's plan reads host values: only on the CPU, where they are host memory.
        if not use_triton(hidden, None) and hidden.device.type == "cpu" and num_tokens > 0:
            plan = plan_attention(meta, kv_caches[0][0], spec.num_q_heads, batched=self.kernels != "cpp")
        # The residual stream's add is fused into the norm that follows it: `hidden` is a
        # sublayer's output not yet added, `residual` the stream before it.
        residual: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache), window) in enumerate(zip(self.layers, kv_caches, spec.sliding_windows)):
            if self.interrupt is not None and self.interrupt():
                raise StepInterrupted
            normed, residual = layer_input(layer, hidden, residual, eps, self.kernels)
            if captured is not None and i in self.capture_layers:
                captured.append(residual.to(normed.dtype))  # the stream's sum into this layer
            q = self.write_kv(layer, normed, cos, sin, (k_cache, v_cache), meta.slot_mapping)
            attn = paged_attention(
                q, k_cache, v_cache, meta, self.scale, self.kernels, sliding_window=window, plan=plan
            )
            hidden = row_linear(attn.reshape(num_tokens, -1), layer.o_weight, layer.o_bias, self.tp)
            normed, residual = add_rms_norm(hidden, residual, layer.post_norm, eps, self.kernels)
            gate_up = linear(normed, layer.gate_up_weight, layer.gate_up_bias)
            hidden = row_linear(silu_mul(gate_up, self.kernels), layer.down_weight, layer.down_bias, self.tp)
        return hidden, residual

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables' rows ``(cos, sin)`` ``[T, D]`` at ``positions``."""
        return self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)

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
        qkv = linear(normed, layer.qkv_weight, layer.qkv_bias)
        # q and k get the same per-head norm and rotation, so they are processed as one tensor.
        qk = qk_norm_rope(qkv, cos, sin, layer.qk_norm, qk_heads, spec.head_dim, spec.rms_norm_eps, self.kernels)
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
        logits = linear(hidden, self.lm_head).float()
        if hidden.dtype == torch.float32:
            return logits
        top = logits.topk(min(EXACT_TOP_LOGITS, logits.shape[-1]), dim=-1).indices
        rows = F.embedding(top, self.head_rows).float()  # [N, top, hidden]
        return logits.scatter_(1, top, torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1))


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


def layer_weights(
    spec: ModelSpec,
    take: Taker,
    take_optional: OptionalTaker,
    weight: WeightMaker,
    prefix: str,
    input_norm: bool = True,
    eagle3: bool = False,
    norm_before_residual: bool = False,
) -> LayerWeights:
    """One decoder layer's weights from Hugging Face names under ``prefix``, q/k/v and gate/up
    fused; ``input_norm=False`` for a layer without one (an EAGLE-1 head's), ``eagle3`` for an
    EAGLE-3 head's (q/k/v over ``2 hidden`` inputs, a ``hidden_norm``)."""
    hidden, head_dim, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    qkv_in = 2 * hidden if eagle3 else hidden
    q_size, kv_size = spec.num_q_heads * head_dim, spec.num_kv_heads * head_dim
    qkv_shapes = (("q", q_size), ("k", kv_size), ("v", kv_size))
    qk_norm = None
    if spec.qk_norm:
        q_norm = take(prefix + "self_attn.q_norm.weight", (head_dim,))
        k_norm = take(prefix + "self_attn.k_norm.weight", (head_dim,))
        qk_norm = torch.cat((q_norm.expand(spec.num_q_heads, -1), k_norm.expand(spec.num_kv_heads, -1))).contiguous()

    def fuse_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
        present = [p for p in parts if p is not None]
        return torch.cat(present).contiguous() if len(present) == len(parts) else None

    qkv = torch.cat([take(prefix + f"self_attn.{n}_proj.weight", (size, qkv_in)) for n, size in qkv_shapes])
    gate_up = torch.cat([take(prefix + f"mlp.{n}_proj.weight", (inter, hidden)) for n in ("gate", "up")])
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight", (hidden,)) if input_norm else None,
        qkv_weight=weight(qkv.contiguous()),
        qkv_bias=fuse_optional(
            [take_optional(prefix + f"self_attn.{n}_proj.bias", (size,), spec.qkv_bias) for n, size in qkv_shapes]
        ),
        qk_norm=qk_norm,
        o_weight=weight(take(prefix + "self_attn.o_proj.weight", (hidden, q_size))),
        o_bias=take_optional(prefix + "self_attn.o_proj.bias", (hidden,), spec.o_bias),
        post_norm=take(prefix + "post_attention_layernorm.weight", (hidden,)),
        gate_up_weight=weight(gate_up.contiguous()),
        gate_up_bias=fuse_optional(
            [take_optional(prefix + f"mlp.{n}_proj.bias", (inter,), spec.mlp_bias) for n in ("gate", "up")]
        ),
        down_weight=weight(take(prefix + "mlp.down_proj.weight", (hidden, inter))),
        down_bias=take_optional(prefix + "mlp.down_proj.bias", (hidden,), spec.mlp_bias),
        hidden_norm=take(prefix + "hidden_norm.weight", (hidden,)) if eagle3 else None,
        norm_before_residual=norm_before_residual,
    )


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
    spec = model_spec(hf_config)
    cos, sin = rope_tables(hf_config, spec.head_dim, spec.max_position_embeddings)
    device = torch.device(device)
    logger.debug("building %s: %d layers, %d/%d heads of %d, %s on %s", spec.model_type, spec.num_layers,
                 spec.num_q_heads, spec.num_kv_heads, spec.head_dim, dtype, device)  # fmt: skip
    return CausalLM(
        spec=spec,
        dtype=dtype,
        device=device,
        rope_cos=torch.cat((cos, cos), dim=-1).to(device=device, dtype=dtype),
        rope_sin=torch.cat((-sin, sin), dim=-1).to(device=device, dtype=dtype),
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
