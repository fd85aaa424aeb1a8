"""EAGLE proposer: a one-layer head that reads the target's hidden states drafts k tokens.

The head (EAGLE-1 or EAGLE-3, see `zerobubble.worker_svc.eagle`) has one entry per position
``t``: the next token ``x[t+1]`` with the head's state ``h[t]`` there (EAGLE-1: the target's last
hidden state; EAGLE-3: ``fc`` over three target layers' inputs, which the target's forward then
returns beside its last hidden state, `CausalLM.capture_layers`), run through one decoder layer
that predicts ``h[t+1]``, whose logits give ``x[t+2]``. Its K/V live in a paged cache of their
own, one layer deep, indexed by the SAME block tables as the target's (entry ``t`` at position
``t``'s slot), so no second allocator exists.

Everything stays on the device, and every shape is known to the host:

- `observe`, right after every target forward: each fed token ``x[p]`` becomes entry ``p - 1``
  with the hidden state before it (the previous fed token's, or for a row's first token the
  row's *carry*: the hidden state of its last valid position, kept per slot from the step
  before). Only the K/V are written; nothing is attended. Entries fed a draft that is then
  rejected are rewritten when their position is fed again, as in the target's cache.
- `propose`, for the rows that sampled: the carry becomes the hidden state of the last accepted
  position (chosen on the device from the corrected sequence length), then the chain
  (`zerobubble.worker_svc.proposers.chain`) runs k one-token steps: the new last token with the
  carry, then each draft with the head's own predicted hidden state, as EAGLE drafts.

A row whose first fed position is 0 has no hidden state before it; its entry ``-1`` goes to the
scratch block, as does the entry before the first token of a prefix-cache hit. Blocks shared
through the prefix cache carry head entries; the one at a block's last position was made with
the token that followed it in the request that wrote it (or is missing, if that request never
fed the next position), so a hit that continues differently drafts from a slightly different
state there (drafts only: verification keeps the output exact).
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.fused import add_rms_norm
from zerobubble.kernels.linear import LinearWeight, linear
from zerobubble.worker_svc.eagle import DRAFT_VOCAB_KEY, EAGLE3, HeadFormatError, HeadLayout, head_layout
from zerobubble.worker_svc.model import (
    CausalLM,
    allocate_kv_cache,
    build_model,
    layer_input,
    layer_weights,
    model_spec,
)
from zerobubble.worker_svc.model_loader import LoadedModel, ModelLoadError, cache_dir
from zerobubble.worker_svc.proposers.chain import ChainCache, draft_chain, over_vocab

logger = logging.getLogger(__name__)

# `--draft-model` names that resolve to a head `make eagle-head` (scripts/train_eagle.py) trains
# into the model cache.
BUILTIN_HEADS = {"smollm2-135m-eagle": "smollm2-135m"}


@dataclass(slots=True, eq=False)
class ServingHead:
    """An EAGLE head laid out for the paged forward over its target.

    EAGLE-1: ``fc`` fuses the token embedding ⊕ the target's last hidden state into the layer's
    input. EAGLE-3: ``fc`` turns the inputs of the target's `aux_layers` into the head's state,
    and the layer takes the embedding ⊕ that state (normed apart, `zerobubble.worker_svc.model.
    layer_input`); a final norm precedes its own lm_head. Either way the head's state for a
    position is ``[hidden]`` wide, which is what the proposer carries between steps.
    """

    hf_config: Any  # the head layer's config, one layer deep (its KV cache's shape)
    layer_model: CausalLM  # one layer, no embedding or final norm of its own
    fc: LinearWeight
    fc_bias: torch.Tensor | None
    target: CausalLM
    embed: torch.Tensor  # [vocab, hidden]: the head's own, else the target's
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose inputs it reads
    final_norm: torch.Tensor | None = None  # EAGLE-3
    # The target ids the head drafts (a draft vocabulary; EAGLE-3's ``d2t``) and the lm_head
    # over them; lm_head None: the target's own, over the whole vocabulary.
    draft_ids: torch.Tensor | None = None
    lm_head: LinearWeight | None = None

    def target_state(self, features: torch.Tensor) -> torch.Tensor:
        """The head's state ``[T, hidden]`` at each position of a target forward's output: the
        last hidden state (EAGLE-1), or ``fc`` over the captured layers' inputs (EAGLE-3)."""
        size = self.target.spec.hidden_size
        if not self.aux_layers:
            return features if features.shape[-1] == size else features.narrow(-1, 0, size)
        captured = features.narrow(-1, size, features.shape[-1] - size).contiguous()
        return linear(captured, self.fc, self.fc_bias)

    def fuse(self, tokens: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The head layer's input for each entry: ``fc(embed(tokens) ⊕ state)`` (EAGLE-1) or
        ``embed(tokens) ⊕ state`` (EAGLE-3, normed by the layer itself)."""
        joined = torch.cat((F.embedding(tokens, self.embed), state), dim=-1)
        return joined if self.aux_layers else linear(joined, self.fc, self.fc_bias)

    def draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Float32 logits of predicted states ``[N, hidden]`` over the draft vocabulary
        (``[N, len(draft_ids)]``), or over the whole vocabulary when the head has none."""
        if self.final_norm is not None:
            model = self.layer_model
            state = add_rms_norm(state, None, self.final_norm, model.spec.rms_norm_eps, model.kernels)[0]
        if self.lm_head is None:
            return self.target.compute_logits(state)
        return linear(state, self.lm_head).float()

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` of predicted states; ids outside the draft vocabulary
        get -inf (the sampler then never draws them)."""
        logits = self.draft_logits(state)
        if self.draft_ids is None:
            return logits
        return over_vocab(logits, self.draft_ids, self.target.spec.vocab_size)


def resolve_head(spec: str) -> Path:
    """The head folder for ``--draft-model``: a built-in name (in the model cache, where
    scripts/train_eagle.py writes it) or a directory."""
    if spec in BUILTIN_HEADS:
        folder = cache_dir() / "models" / spec
        if (folder / "config.json").is_file():
            return folder
        raise ModelLoadError(
            f"EAGLE head {spec!r} not found in {folder.parent}: train it there with `make eagle-head` "
            "(scripts/train_eagle.py, about an hour on a CPU) or pass a head's directory"
        )
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--draft-model {spec!r}: no EAGLE head directory with a config.json there")
    return path


def load_serving_head(spec: str, target: LoadedModel, quantization: str = "none") -> ServingHead:
    """Load the EAGLE head ``spec`` for ``target`` in its dtype and device, its linear weights
    stored with ``quantization``; a head that does not fit the target is refused with the
    mismatch named (`ModelLoadError`)."""
    from safetensors.torch import load_file

    folder = resolve_head(spec)
    head_json = json.loads((folder / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    try:
        head = serving_head(head_json, state, target, quantization)
    except (HeadFormatError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"EAGLE head {str(folder)!r}: {exc}") from exc
    layout = "EAGLE-3" if head.aux_layers else "EAGLE-1"
    logger.info("loaded %s head %s for %s (target layers %s)", layout, folder, target.name, head.aux_layers or "last")
    return head


def serving_head(
    head_json: dict[str, Any], state: dict[str, torch.Tensor], target: LoadedModel, quantization: str = "none"
) -> ServingHead:
    """The head with config ``head_json`` and weights ``state`` over ``target`` (any format of
    `zerobubble.worker_svc.eagle.head_layout`, its weights under any of the names
    `_canonical_name` knows); raises `HeadFormatError` (or ``KeyError``/``ValueError`` for a
    missing or misshapen weight)."""
    assert target.model is not None, "the target's weights first"
    layout = head_layout(head_json, model_spec(target.hf_config))
    state = {_canonical_name(name): tensor for name, tensor in state.items()}
    if layout.layout == EAGLE3:
        return _eagle3_head(layout, state, target.model, quantization)
    head = _eagle1_head(layout.layer_config, state, target, quantization)
    if DRAFT_VOCAB_KEY in state:
        _limit_vocab(head, state[DRAFT_VOCAB_KEY].to(torch.int64), DRAFT_VOCAB_KEY)
    return head


# Other names of the same weights: EAGLE-3 releases call their layer ``midlayer``, the
# speculators format's EAGLE-1 heads ``transformer`` and their fusion ``fusion_fc``.
_RENAMED_PREFIXES = {"midlayer.": "layers.0.", "transformer.": "layers.0.", "fusion_fc.": "fc."}


def _canonical_name(name: str) -> str:
    """One name per weight across the head formats (some conversions add a ``model.`` prefix)."""
    name = name.removeprefix("model.")
    for prefix, canonical in _RENAMED_PREFIXES.items():
        if name.startswith(prefix):
            return canonical + name.removeprefix(prefix)
    return name


def _eagle1_head(
    layer_config: dict[str, Any], state: dict[str, torch.Tensor], target: LoadedModel, quantization: str
) -> ServingHead:
    """An EAGLE-1 head: one layer of the target's architecture (the intermediate size from its
    ``layer_config``), the target's embedding."""
    hf_config = copy.deepcopy(target.hf_config)
    hf_config.num_hidden_layers = 1
    hf_config.intermediate_size = int(layer_config.get("intermediate_size", hf_config.intermediate_size))
    # Full attention, as the head is trained (worker_svc/eagle.py), whatever the target's window.
    hf_config.sliding_window = None
    if getattr(hf_config, "layer_types", None) is not None:
        hf_config.layer_types = ["full_attention"]
    model = target.model
    assert model is not None and model.embed is not None
    layer_model = build_model(
        hf_config, model.dtype, model.device, model.linear.prepack, quantization, model.kernels, model.linear.chooser
    )
    take, take_optional, weight = layer_model.weight_readers(state)
    hidden = layer_model.spec.hidden_size
    has_norm = "layers.0.input_layernorm.weight" in state
    layer_model.layers = [layer_weights(layer_model.spec, take, take_optional, weight, "layers.0.", has_norm)]
    fc = weight(take("fc.weight", (hidden, 2 * hidden)))
    fc_bias = take_optional("fc.bias", (hidden,), "fc.bias" in state)
    return ServingHead(hf_config, layer_model, fc, fc_bias, model, model.embed)


def _eagle3_head(
    layout: HeadLayout, state: dict[str, torch.Tensor], target: CausalLM, quantization: str
) -> ServingHead:
    """An EAGLE-3 head: its own Llama layer over the embedding ⊕ fused target state, a final
    norm and its own lm_head over the draft vocabulary (``d2t``)."""
    from transformers import LlamaConfig

    skip = {"architectures", "model_type", "auto_map", "torch_dtype", "dtype", "transformers_version"}
    hf_config = LlamaConfig(**{k: v for k, v in layout.layer_config.items() if k not in skip and not k.startswith("_")})
    hf_config.num_hidden_layers = 1
    hf_config.vocab_size = target.spec.vocab_size
    # The head drafts at the target's positions, which may run past the head's own table.
    hf_config.max_position_embeddings = max(int(hf_config.max_position_embeddings), target.spec.max_position_embeddings)
    setup = target.linear
    layer_model = build_model(
        hf_config, target.dtype, target.device, setup.prepack, quantization, target.kernels, setup.chooser
    )
    take, take_optional, weight = layer_model.weight_readers(state)
    spec, target_hidden = layer_model.spec, target.spec.hidden_size
    layer_model.layers = [
        layer_weights(spec, take, take_optional, weight, "layers.0.", eagle3=True,
                      norm_before_residual=layout.norm_before_residual)
    ]  # fmt: skip
    if "embed_tokens.weight" in state:
        embed = take("embed_tokens.weight", (spec.vocab_size, spec.hidden_size))
    elif spec.hidden_size == target_hidden and target.embed is not None:
        embed = target.embed
    else:
        raise HeadFormatError(f"hidden_size {spec.hidden_size} != target's {target_hidden} and no embed_tokens")
    fc = weight(take("fc.weight", (spec.hidden_size, len(layout.aux_layers) * target_hidden)))
    fc_bias = take_optional("fc.bias", (spec.hidden_size,), "fc.bias" in state)
    head = ServingHead(
        hf_config, layer_model, fc, fc_bias, target, embed, layout.aux_layers, take("norm.weight", (spec.hidden_size,))
    )
    size = layout.draft_vocab_size
    if "lm_head.weight" in state:
        head.lm_head = weight(take("lm_head.weight", (size, spec.hidden_size)))
    elif size != spec.vocab_size or spec.hidden_size != target_hidden:
        raise KeyError("missing weight 'lm_head.weight'")
    if "d2t" in state:
        offsets = state["d2t"].to(device="cpu", dtype=torch.int64)
        if tuple(offsets.shape) != (size,):
            raise ValueError(f"weight 'd2t' has shape {tuple(offsets.shape)}, expected {(size,)}")
        _limit_vocab(head, torch.arange(size) + offsets, "d2t", own_rows=True)
    elif size != spec.vocab_size:
        raise KeyError(f"missing weight 'd2t' (draft_vocab_size {size} < vocab_size {spec.vocab_size})")
    return head


def _limit_vocab(head: ServingHead, ids: torch.Tensor, what: str, own_rows: bool = False) -> None:
    """Draft over the target ids ``ids`` only: the head's own lm_head rows (``own_rows``, in the
    order of ``ids``) or those rows of the target's lm_head."""
    vocab = head.target.spec.vocab_size
    if ids.numel() == 0:
        raise HeadFormatError(f"{what}: empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise HeadFormatError(f"{what}: ids outside the target's vocabulary of {vocab}")
    if ids.unique().numel() != ids.numel():
        raise HeadFormatError(f"{what}: repeated ids")
    device = head.target.device
    if own_rows:
        head.draft_ids = ids.to(device)
        return
    rows = head.target.head_rows  # the whole vocabulary's rows, also on a tensor-parallel rank
    assert rows is not None, "load the target's weights first"
    head.draft_ids = ids.to(device)
    head.lm_head = head.layer_model.logits_weight(rows.index_select(0, head.draft_ids).contiguous())


class EagleProposer:
    """Drafts with an EAGLE head over the runner's block tables (module docstring)."""

    method = "eagle"

    def __init__(self, head: ServingHead, num_spec_tokens: int, acceptance: str = "keyed") -> None:
        self.head = head
        self.k = num_spec_tokens
        self.has_draft_probs = acceptance == "rejection"
        # The chain writes entries up to seq_len + k - 2: inside the k lookahead slots.
        self.num_lookahead_slots = num_spec_tokens
        self.runner: Any = None  # the ModelRunner (not imported: it imports the proposers)
        self._hidden: torch.Tensor | None = None  # the last target forward's, for `propose`

    def bind(self, runner: Any) -> None:
        cfg = runner.config
        self.runner = runner
        # Set before the runner captures graphs: a captured forward returns these layers too.
        if runner.model is not None:
            runner.model.capture_layers = self.head.aux_layers
        self.head.layer_model.interrupt = runner.model.interrupt
        # One block more than the target: the scratch block that takes writes without room.
        self.scratch_block = cfg.num_blocks
        model = self.head.layer_model
        self.kv_caches = allocate_kv_cache(
            self.head.hf_config, cfg.num_blocks + 1, cfg.block_size, model.dtype, runner.device
        )
        hidden = model.spec.hidden_size
        self.carry = torch.zeros(cfg.max_num_seqs, hidden, dtype=model.dtype, device=runner.device)
        self.has_carry = torch.zeros(cfg.max_num_seqs, dtype=torch.bool, device=runner.device)
        num_slots = cfg.max_num_seqs if self.has_draft_probs else 0
        vocab = model.spec.vocab_size
        self.probs = torch.zeros(num_slots, self.k, vocab, dtype=torch.float32, device=runner.device)

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        # A row admitted past position 0 (a prefix-cache hit) has no hidden state before its
        # first token on record: the entry there is the one the cached block already holds.
        self.has_carry.narrow(0, slot, 1).zero_()  # a device fill: no host scalar is copied

    def observe(self, batch: Any, hidden: torch.Tensor) -> None:
        """Write the step's entries (each fed token with the head's state before it) from the
        target forward's output ``hidden``."""
        states = self._hidden = self.head.target_state(hidden)
        if batch.num_tokens == 0:
            return
        st, bs = self.runner.state, self.runner.config.block_size
        starts = batch.meta.query_start_loc[:-1].long()
        slots = batch.req_slots.long()
        before = states.roll(1, 0)
        before[starts] = self.carry[slots]
        # Entry p - 1's slot: the previous fed token's, or for a row's first token the block
        # table's; the scratch block when there is no hidden state before it (position 0, or
        # the first step of a prefix-cache hit).
        first = batch.positions[starts].long() - 1
        block = st.block_table[slots].gather(1, first.clamp(min=0)[:, None] // bs)[:, 0].long()
        real = (first >= 0) & self.has_carry[slots]
        first_slot = torch.where(real, block * bs + first.clamp(min=0) % bs, self.scratch_block * bs)
        slot_mapping = batch.meta.slot_mapping.roll(1, 0)
        slot_mapping[starts] = first_slot.to(slot_mapping.dtype)
        model = self.head.layer_model
        positions = (batch.positions - 1).clamp(min=0)
        cos, sin = model.rotary(positions)
        layer = model.layers[0]
        fused = self.head.fuse(batch.input_ids, before)
        normed, _ = layer_input(layer, fused, None, model.spec.rms_norm_eps, model.kernels)
        model.write_kv(layer, normed, cos, sin, self.kv_caches[0], slot_mapping)
        # Rows that did not sample carry their last fed hidden state into their next chunk.
        ends = batch.meta.query_start_loc[1:].long() - 1
        self.carry[slots] = states[ends]
        self.has_carry.index_fill_(0, slots, True)

    def propose(self, slots: torch.Tensor, batch: Any) -> None:
        st, idx = self.runner.state, slots.long()
        states, self._hidden = self._hidden, None
        assert states is not None, "observe first"
        # The carry of a sampled row: the head's state at its last accepted position.
        starts = batch.meta.query_start_loc.long()[batch.sampled.rows_t.long()]
        accepted_at = starts + st.seq_len[idx].long() - 1 - batch.positions[starts].long()
        features = states[accepted_at]
        self.carry[idx] = features

        def forward(j: int, token: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            nonlocal features
            out, residual = self.head.layer_model.run_layers(self.head.fuse(token, features), pos, meta, self.kv_caches)
            # The compiled kernels keep a 16-bit model's residual stream in float32: the sum is
            # cast back, as the head's state and its products' input are in the model's dtype.
            features = out if residual is None else (out + residual).to(out.dtype)
            return self.head.draft_logits(features)

        cache = ChainCache(self.head.layer_model.rope.num_positions, self.scratch_block, kv_offset=1)
        probs = draft_chain(
            self.runner, slots, batch, self.k, cache, forward, self.has_draft_probs, self.head.draft_ids
        )
        if probs is not None:
            self.probs[idx] = probs

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        return self.probs[slots.long(), :k]
