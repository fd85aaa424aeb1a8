"""EAGLE draft heads: a one-layer decoder that reads the target's last hidden state and proposes tokens.

An EAGLE-1 head (the original layout) fuses, per position ``t``, the embedding of token ``x[t+1]``
with the target's last hidden state ``h[t]`` (embedding first, then hidden) through
``fc: Linear(2H -> H)``, runs one decoder layer of the target's architecture whose first input
norm is absent, and predicts ``h[t+1]``. The target's embedding and lm_head are shared, not
copied: the head's own weights are ``fc.*`` and ``layers.0.*`` only.

An EAGLE-3 head fuses three target layers' inputs instead (``fc: Linear(3H -> H)``), feeds its
layer the embedding and that state side by side (q/k/v over ``2H``), ends in a norm and drafts
over its own reduced vocabulary (``lm_head [D, H]`` and ``d2t``, each draft id's offset to the
target's id).

This module holds the plain-torch EAGLE-1 forward over a batch of sequences (training and
offline evaluation) and reads every served format's ``config.json`` (EAGLE-1, EAGLE-3 and the
speculators format: `head_layout`), checking that a head fits its target; serving is
`zerobubble.worker_svc.proposers.eagle`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.kernels.fused import rms_norm_twin
from zerobubble.worker_svc.model import ModelSpec, model_spec, rope_tables

logger = logging.getLogger(__name__)

EAGLE1 = "eagle-1"
EAGLE3 = "eagle-3"
SPECULATORS = "speculators"  # read as the layout its algorithm names (EAGLE-1 or EAGLE-3)

# The one-layer cache of a head: keys and values ``[B, Hkv, S, D]``.
LayerCache = tuple[torch.Tensor, torch.Tensor]


class HeadFormatError(ValueError):
    """A head whose format we cannot load, or whose shapes do not fit the target."""


def detect_format(config: dict[str, Any]) -> str:
    """The head format a ``config.json`` describes: ``eagle-1``, ``eagle-3`` or ``speculators``."""
    if "speculators_config" in config:
        return SPECULATORS
    architectures = " ".join(config.get("architectures") or [])
    if "draft_vocab_size" in config or "eagle_config" in config or "Eagle3" in architectures:
        return EAGLE3
    return EAGLE1


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """A head's ``config.json`` read into one shape whatever its format.

    ``layer_config`` is the head's decoder layer as a Llama config (EAGLE-3; EAGLE-1 heads use
    the target's own architecture). ``aux_layers`` are the target layers whose inputs an
    EAGLE-3 head fuses, in layer order (Hugging Face's ``hidden_states`` indices: 0 is the
    embedding); empty for EAGLE-1.
    """

    layout: str
    layer_config: dict[str, Any]
    draft_vocab_size: int
    aux_layers: tuple[int, ...] = ()
    norm_before_residual: bool = False


def head_layout(config: dict[str, Any], target: ModelSpec) -> HeadLayout:
    """The layout of a head with ``config``, checked against ``target``: a head of another
    format, or whose shapes do not fit, raises `HeadFormatError` naming each mismatch."""
    fmt = detect_format(config)
    if fmt == SPECULATORS:
        algorithm = str(
            (config.get("speculators_config") or {}).get("algorithm") or config.get("speculators_model_type")
        )
        layer_config = dict(config.get("transformer_layer_config") or {})
        if algorithm == "eagle3":
            return _eagle3_layout(config, layer_config, target)
        if algorithm != "eagle":
            raise HeadFormatError(f"speculators heads of algorithm {algorithm!r} are not supported (eagle, eagle3 are)")
        # EAGLE-1/HASS: the EAGLE-1 layout, unless the extra norms of its TTT variant are on.
        if config.get("layernorms"):
            raise HeadFormatError("speculators eagle heads with layernorms: true are not supported")
        _check_shapes(layer_config, target, layer_config.get("hidden_size"))
        return HeadLayout(EAGLE1, layer_config, draft_vocab_size=target.vocab_size)
    if fmt == EAGLE3:
        return _eagle3_layout(config, config, target)
    _check_shapes(config, target, config.get("hidden_size"))
    return HeadLayout(EAGLE1, config, draft_vocab_size=target.vocab_size)


def _eagle3_layout(config: dict[str, Any], layer_config: dict[str, Any], target: ModelSpec) -> HeadLayout:
    """An EAGLE-3 head's layout: its own Llama layer, a draft vocabulary and three target layers."""
    eagle_config = config.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise HeadFormatError("EAGLE-3 heads without auxiliary hidden states are not supported")
    target_hidden = config.get("target_hidden_size") or layer_config.get("target_hidden_size")
    _check_shapes(layer_config, target, target_hidden or layer_config.get("hidden_size"), optional_split=False)
    ids = (
        config.get("eagle_aux_hidden_state_layer_ids")
        or eagle_config.get("eagle_aux_hidden_state_layer_ids")
        or layer_config.get("eagle_aux_hidden_state_layer_ids")
        # vLLM's default for a target that names none: early, middle and late.
        or (2, target.num_layers // 2, target.num_layers - 3)
    )
    aux = tuple(sorted(int(i) for i in ids))
    if len(set(aux)) != len(aux) or not all(0 <= i < target.num_layers for i in aux):
        raise HeadFormatError(
            f"eagle_aux_hidden_state_layer_ids {list(ids)} must be distinct layers of the target's "
            f"{target.num_layers} (0 to {target.num_layers - 1})"
        )
    draft_vocab_size = int(config.get("draft_vocab_size") or layer_config.get("draft_vocab_size") or target.vocab_size)
    if not 0 < draft_vocab_size <= target.vocab_size:
        raise HeadFormatError(f"draft_vocab_size {draft_vocab_size} is not within the target's {target.vocab_size}")
    norm_before_residual = bool(config.get("norm_before_residual", layer_config.get("norm_before_residual", False)))
    return HeadLayout(EAGLE3, layer_config, draft_vocab_size, aux, norm_before_residual)


def _check_shapes(config: dict[str, Any], target: ModelSpec, hidden: Any, optional_split: bool = True) -> None:
    """Refuse a head whose hidden or vocabulary size differs from ``target``'s (and, for an
    EAGLE-1 head, whose layer takes the target's attention split, one that states another)."""
    mismatches = [
        f"{key} {got!r} != target's {want!r}"
        for key, got, want in (
            ("hidden_size", hidden, target.hidden_size),
            ("vocab_size", config.get("vocab_size"), target.vocab_size),
        )
        if got != want
    ]
    if optional_split:
        optional = (
            ("num_attention_heads", target.num_q_heads),
            ("num_key_value_heads", target.num_kv_heads),
            ("head_dim", target.head_dim),
        )
        mismatches += [
            f"{key} {config[key]!r} != target's {want!r}"
            for key, want in optional
            if config.get(key) is not None and config[key] != want
        ]
    if mismatches:
        raise HeadFormatError("head does not fit the target: " + "; ".join(mismatches))


def check_fits(head_config: dict[str, Any], target: ModelSpec) -> None:
    """Refuse a head that this module's EAGLE-1 `EagleHead` cannot load for ``target``."""
    layout = head_layout(head_config, target)
    if layout.layout != EAGLE1:
        raise HeadFormatError(f"{layout.layout} heads are served, not trained here (EagleHead is EAGLE-1)")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half`` RoPE; ``cos``/``sin`` are ``[S, D]`` (halves repeated)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Norm(nn.Module):
    """An RMSNorm weight under Hugging Face's name (``<norm>.weight``)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class _Attention(nn.Module):
    """The attention projections (and Qwen3's per-head q/k norms) under Hugging Face's names."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        hidden, head_dim = spec.hidden_size, spec.head_dim
        q_size, kv_size = spec.num_q_heads * head_dim, spec.num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=spec.o_bias)
        self.q_norm = _Norm(head_dim) if spec.qk_norm else None
        self.k_norm = _Norm(head_dim) if spec.qk_norm else None


class _Mlp(nn.Module):
    """SwiGLU under Hugging Face's names."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        hidden, inter = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=spec.mlp_bias)
        self.up_proj = nn.Linear(hidden, inter, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HeadLayer(nn.Module):
    """One decoder layer of the target's architecture with Hugging Face weight names.

    ``first`` drops the input norm, as EAGLE-1 does: ``fc``'s output goes straight to attention.
    """

    def __init__(self, spec: ModelSpec, first: bool) -> None:
        super().__init__()
        self.spec = spec
        self.input_layernorm = None if first else _Norm(spec.hidden_size)
        self.self_attn = _Attention(spec)
        self.mlp = _Mlp(spec)
        self.post_attention_layernorm = _Norm(spec.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LayerCache | None = None
    ) -> tuple[torch.Tensor, LayerCache]:
        """``x [B, S, H]`` at the positions of ``cos``/``sin`` after ``cache``'s; returns output and new cache."""
        spec, attn = self.spec, self.self_attn
        batch, seq, _ = x.shape
        eps = spec.rms_norm_eps
        normed = x if self.input_layernorm is None else rms_norm_twin(x, self.input_layernorm.weight, eps)

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(batch, seq, n, spec.head_dim).transpose(1, 2)

        q = heads(attn.q_proj(normed), spec.num_q_heads)
        k = heads(attn.k_proj(normed), spec.num_kv_heads)
        v = heads(attn.v_proj(normed), spec.num_kv_heads)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = rms_norm_twin(q, attn.q_norm.weight, eps), rms_norm_twin(k, attn.k_norm.weight, eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
        # A lone query (a drafting step over a cache) sees every key; a block of queries is
        # causal over its own keys (training, prefill), which needs no cache in front of it.
        causal = seq > 1
        if causal and cache is not None:
            raise ValueError("a multi-token block after a cache is not supported")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        hidden = x + attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
        normed = rms_norm_twin(hidden, self.post_attention_layernorm.weight, eps)
        return hidden + self.mlp(normed), (k, v)


@dataclass(slots=True)
class SharedWeights:
    """The target's embedding ``[V, H]`` and lm_head ``[V, H]`` the head reads (never trains)."""

    embed: torch.Tensor
    lm_head: torch.Tensor


class EagleHead(nn.Module):
    """An EAGLE-1 head over a Llama/Qwen-family target; see the module docstring for the layout."""

    rope_cos: torch.Tensor  # [max_positions, D]: (cos, cos)
    rope_sin: torch.Tensor  # [max_positions, D]: (sin, sin)

    def __init__(self, hf_config: Any, shared: SharedWeights, fc_bias: bool = True) -> None:
        super().__init__()
        self.spec = model_spec(hf_config)
        hidden = self.spec.hidden_size
        for name, tensor in (("embedding", shared.embed), ("lm_head", shared.lm_head)):
            if tuple(tensor.shape) != (self.spec.vocab_size, hidden):
                raise HeadFormatError(
                    f"target {name} has shape {tuple(tensor.shape)}, head expects {(self.spec.vocab_size, hidden)}"
                )
        # A plain attribute, not a parameter or buffer: shared with the target, out of state_dict.
        self.shared = shared
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([HeadLayer(self.spec, first=True)])
        cos, sin = rope_tables(hf_config, self.spec.head_dim, self.spec.max_position_embeddings)
        self.register_buffer("rope_cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("rope_sin", torch.cat((sin, sin), dim=-1), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        start: int = 0,
        cache: LayerCache | None = None,
    ) -> tuple[torch.Tensor, LayerCache]:
        """Predicted next hidden states ``[B, S, H]`` for tokens ``x[t+1]`` ``[B, S]`` and ``h[t]`` ``[B, S, H]``.

        ``start`` is the position of the first row (the cache's length when there is one).
        """
        embeds = F.embedding(input_ids, self.shared.embed).to(hidden.dtype)
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        seq = input_ids.shape[1]
        cos = self.rope_cos[start : start + seq].to(x.dtype)
        sin = self.rope_sin[start : start + seq].to(x.dtype)
        new_cache: LayerCache | None = None
        for layer in self.layers:
            x, new_cache = layer(x, cos, sin, cache)
        assert new_cache is not None
        return x, new_cache

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits through the target's lm_head (EAGLE-1 hidden states are already final-normed)."""
        return F.linear(hidden, self.shared.lm_head.to(hidden.dtype))


def init_from_target_layer(head: EagleHead, target_state: dict[str, torch.Tensor], layer: int) -> None:
    """Start the head's decoder layer from the target's layer ``layer`` (its input norm excepted).

    Not EAGLE's recipe, which starts from random weights; kept for experiments. On SmolLM2-135M
    it starts far worse than random weights (the late layer adds outputs at the residual
    stream's scale, not the final-normed hidden state's) and was still behind after 30 steps.
    """
    prefix = f"model.layers.{layer}."
    own = head.layers[0].state_dict()
    wanted = {name: target_state[prefix + name] for name in own if prefix + name in target_state}
    missing = sorted(set(own) - set(wanted))
    if missing:
        raise KeyError(f"target has no {prefix}{missing[0]} (and {len(missing) - 1} more)")
    head.layers[0].load_state_dict({k: v.float() for k, v in wanted.items()})


def head_config(target_config: dict[str, Any], fc_bias: bool) -> dict[str, Any]:
    """The EAGLE-1 ``config.json`` of a head for a target with ``target_config``."""
    config = {k: v for k, v in target_config.items() if not k.startswith("_")}
    config.update(num_hidden_layers=1, bias=fc_bias)
    return config


def save_head(head: EagleHead, out_dir: Path, target_config: dict[str, Any]) -> None:
    """Write ``model.safetensors`` (bfloat16) and ``config.json`` in the EAGLE-1 layout."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in head.state_dict().items()}
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = head_config(target_config, fc_bias=head.fc.bias is not None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    logger.info("saved EAGLE-1 head to %s", out_dir)


def load_head(head_dir: Path, target_hf_config: Any, shared: SharedWeights, dtype: torch.dtype) -> EagleHead:
    """Load an EAGLE-1 head from ``head_dir`` for the target; raises :class:`HeadFormatError`."""
    from safetensors.torch import load_file

    config = json.loads((head_dir / "config.json").read_text())
    check_fits(config, model_spec(target_hf_config))
    state: dict[str, torch.Tensor] = {}
    for path in sorted(head_dir.glob("*.safetensors")):
        state.update(load_file(str(path)))
    # Some releases ship the embedding too; it is the target's, so it is not read.
    state = {k: v for k, v in state.items() if k.startswith(("fc.", "layers."))}
    head = EagleHead(target_hf_config, shared, fc_bias="fc.bias" in state)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise HeadFormatError(f"head {str(head_dir)!r}: missing weights {missing}, unexpected weights {unexpected}")
    return head.to(dtype)


DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
DRAFT_VOCAB_KEY = "draft_token_ids"


def draft_vocab(answers: list[torch.Tensor], size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` token ids a head drafts from, sorted: ``always`` (end-of-sequence ids), then
    the tokens of ``answers`` by frequency, then the lowest ids not yet taken (byte-level BPE
    vocabularies number their merges by frequency in the tokenizer's corpus).

    Drafting from a subset makes the head's logits a ``[size, H]`` product instead of the whole
    vocabulary's, which on a small target costs more than the head's layer itself; a draft
    outside the subset is never proposed, so it only costs acceptance where one was due.
    """
    counts = torch.bincount(torch.cat(answers).long()) if answers else torch.zeros(0, dtype=torch.long)
    by_frequency = [int(t) for t in torch.argsort(counts, descending=True, stable=True) if counts[t] > 0]
    chosen = list(dict.fromkeys(always + by_frequency))[:size]
    taken = set(chosen)
    next_id = 0
    while len(chosen) < size:
        if next_id not in taken:
            chosen.append(next_id)
        next_id += 1
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def load_draft_vocab(head_dir: Path) -> torch.Tensor | None:
    """The head's draft vocabulary from its folder, or None when it drafts over the whole one."""
    from safetensors.torch import load_file

    path = head_dir / DRAFT_VOCAB_FILE
    return load_file(str(path))[DRAFT_VOCAB_KEY].to(torch.int64) if path.is_file() else None


def save_draft_vocab(head_dir: Path, token_ids: torch.Tensor) -> None:
    """Write the head's draft vocabulary beside its weights (read by the serving head)."""
    from safetensors.torch import save_file

    save_file({DRAFT_VOCAB_KEY: token_ids.to(torch.int64).contiguous()}, str(head_dir / DRAFT_VOCAB_FILE))
