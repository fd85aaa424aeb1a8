"""EAGLE proposer: a one-layer head that reads the target's final hidden states drafts k tokens.

The head (an EAGLE-1 layout, see `zerobubble.worker_svc.eagle`) has one entry per position ``t``:
the fusion ``fc(embed(x[t+1]) ⊕ h[t])`` of the next token and the target's hidden state there,
run through one decoder layer that predicts ``h[t+1]``, whose logits (the target's lm_head) give
``x[t+2]``. Its K/V live in a paged cache of their own, one layer deep, indexed by the SAME block
tables as the target's (entry ``t`` at position ``t``'s slot), so no second allocator exists.

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

import zerobubble
from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.linear import LinearWeight, linear
from zerobubble.worker_svc.eagle import DRAFT_VOCAB_KEY, HeadFormatError, check_fits
from zerobubble.worker_svc.model import (
    CausalLM,
    allocate_kv_cache,
    build_model,
    layer_input,
    layer_weights,
    model_spec,
)
from zerobubble.worker_svc.model_loader import LoadedModel, ModelLoadError, cache_dir
from zerobubble.worker_svc.proposers.chain import ChainCache, draft_chain

logger = logging.getLogger(__name__)

# `--draft-model` names that resolve to a head shipped in the package or made by
# scripts/train_eagle.py into the model cache.
BUILTIN_HEADS = {"smollm2-135m-eagle": "smollm2-135m"}
PACKAGED_HEADS = Path(zerobubble.__file__).resolve().parent / "heads"


@dataclass(slots=True, eq=False)
class ServingHead:
    """An EAGLE-1 head laid out for the paged forward: ``fc`` and one layer over the target's
    embedding and lm_head."""

    hf_config: Any  # the target's config, one layer deep (the head's KV cache shape)
    layer_model: CausalLM  # one layer, no embedding or final norm of its own
    fc: LinearWeight  # [hidden, 2 hidden]
    fc_bias: torch.Tensor | None
    target: CausalLM
    # The ids the head drafts from (`zerobubble.worker_svc.eagle.draft_vocab`) and the target's
    # lm_head rows for them; None: the whole vocabulary through the target's lm_head.
    draft_ids: torch.Tensor | None = None
    draft_lm_head: LinearWeight | None = None

    def fuse(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``fc(embed(tokens) ⊕ hidden)``: the head's layer input for each entry."""
        assert self.target.embed is not None
        return linear(torch.cat((F.embedding(tokens, self.target.embed), hidden), dim=-1), self.fc, self.fc_bias)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` of predicted hidden states; ids outside the draft
        vocabulary get -inf (the sampler then never draws them)."""
        if self.draft_ids is None or self.draft_lm_head is None:
            return self.target.compute_logits(features)
        vocab = self.layer_model.spec.vocab_size
        full = torch.full((features.shape[0], vocab), float("-inf"), dtype=torch.float32, device=features.device)
        return full.index_copy_(1, self.draft_ids, linear(features, self.draft_lm_head).float())


def resolve_head(spec: str) -> Path:
    """The head folder for ``--draft-model``: a built-in name (packaged, else in the model cache,
    where scripts/train_eagle.py writes it) or a directory."""
    if spec in BUILTIN_HEADS:
        for folder in (PACKAGED_HEADS / spec, cache_dir() / "models" / spec):
            if (folder / "config.json").is_file():
                return folder
        raise ModelLoadError(
            f"EAGLE head {spec!r} not found in {PACKAGED_HEADS} or {cache_dir() / 'models'}: "
            "make it with `python scripts/train_eagle.py`"
        )
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--draft-model {spec!r}: no EAGLE head directory with a config.json there")
    return path


def load_serving_head(spec: str, target: LoadedModel) -> ServingHead:
    """Load the EAGLE head ``spec`` for ``target`` in its dtype and device; a head that does not
    fit the target is refused with the mismatch named (`ModelLoadError`)."""
    from safetensors.torch import load_file

    folder = resolve_head(spec)
    head_json = json.loads((folder / "config.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    try:
        head = serving_head(head_json, state, target)
    except (HeadFormatError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"EAGLE head {str(folder)!r}: {exc}") from exc
    logger.info("loaded EAGLE-1 head %s for %s", folder, target.name)
    return head


def serving_head(head_json: dict[str, Any], state: dict[str, torch.Tensor], target: LoadedModel) -> ServingHead:
    """The head with config ``head_json`` and weights ``state`` (EAGLE-1 names) over ``target``;
    raises `HeadFormatError` (or ``KeyError``/``ValueError`` for a missing or misshapen weight)."""
    assert target.model is not None, "the target's weights first"
    check_fits(head_json, model_spec(target.hf_config))
    hf_config = copy.deepcopy(target.hf_config)
    hf_config.num_hidden_layers = 1
    hf_config.intermediate_size = int(head_json.get("intermediate_size", hf_config.intermediate_size))
    # Full attention, as the head is trained (worker_svc/eagle.py), whatever the target's window.
    hf_config.sliding_window = None
    if getattr(hf_config, "layer_types", None) is not None:
        hf_config.layer_types = ["full_attention"]
    model = target.model
    layer_model = build_model(hf_config, model.dtype, model.device, model.prepack)
    take, take_optional, weight = layer_model.weight_readers(state)
    hidden = layer_model.spec.hidden_size
    has_norm = "layers.0.input_layernorm.weight" in state
    layer_model.layers = [layer_weights(layer_model.spec, take, take_optional, weight, "layers.0.", has_norm)]
    fc = weight(take("fc.weight", (hidden, 2 * hidden)))
    fc_bias = take_optional("fc.bias", (hidden,), "fc.bias" in state)
    head = ServingHead(hf_config, layer_model, fc, fc_bias, model)
    if DRAFT_VOCAB_KEY not in state:
        return head
    ids = state[DRAFT_VOCAB_KEY].to(torch.int64)
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= layer_model.spec.vocab_size:
        raise HeadFormatError(f"{DRAFT_VOCAB_KEY} is empty or holds ids outside the target's vocabulary")
    if ids.unique().numel() != ids.numel():
        raise HeadFormatError(f"{DRAFT_VOCAB_KEY} repeats ids")
    rows = _lm_head_rows(model)
    if rows is None:
        logger.warning("the target's lm_head is kept packed only: the head drafts over the whole vocabulary")
        return head
    head.draft_ids = ids.to(model.device)
    head.draft_lm_head = weight(rows.index_select(0, head.draft_ids).contiguous())
    return head


def _lm_head_rows(model: CausalLM) -> torch.Tensor | None:
    """The target's plain ``[vocab, hidden]`` lm_head (the embedding when tied), when kept."""
    if model.spec.tie_word_embeddings:
        return model.embed
    return model.lm_head.dense if model.lm_head is not None else None


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
        """Write the step's entries (each fed token with the hidden state before it)."""
        self._hidden = hidden
        if batch.num_tokens == 0:
            return
        st, bs = self.runner.state, self.runner.config.block_size
        starts = batch.meta.query_start_loc[:-1].long()
        slots = batch.req_slots.long()
        before = hidden.roll(1, 0)
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
        normed, _ = layer_input(layer, self.head.fuse(batch.input_ids, before), None, model.spec.rms_norm_eps)
        model.write_kv(layer, normed, cos, sin, self.kv_caches[0], slot_mapping)
        # Rows that did not sample carry their last fed hidden state into their next chunk.
        ends = batch.meta.query_start_loc[1:].long() - 1
        self.carry[slots] = hidden[ends]
        self.has_carry.index_fill_(0, slots, True)

    def propose(self, slots: torch.Tensor, batch: Any) -> None:
        st, idx = self.runner.state, slots.long()
        hidden, self._hidden = self._hidden, None
        assert hidden is not None, "observe first"
        # The carry of a sampled row: the hidden state of its last accepted position.
        starts = batch.meta.query_start_loc.long()[batch.sampled.rows_t.long()]
        accepted_at = starts + st.seq_len[idx].long() - 1 - batch.positions[starts].long()
        features = hidden[accepted_at]
        self.carry[idx] = features

        def forward(j: int, token: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            nonlocal features
            out, residual = self.head.layer_model.run_layers(self.head.fuse(token, features), pos, meta, self.kv_caches)
            features = out if residual is None else out + residual
            return self.head.logits(features)

        cache = ChainCache(self.head.layer_model.rope_cos.shape[0], self.scratch_block, kv_offset=1)
        probs = draft_chain(self.runner, slots, batch, self.k, cache, forward, self.has_draft_probs)
        if probs is not None:
            self.probs[idx] = probs

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        return self.probs[slots.long(), :k]
