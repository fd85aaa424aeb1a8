"""EAGLE-3 heads, in both weight-name conventions, served over the runner's paged caches.

The oracle is an EAGLE-3 forward written here in plain torch from the published layout (the
vLLM and speculators references): Hugging Face's ``hidden_states`` of the target give the three
captured layers' inputs, ``fc`` fuses them, the head's layer attends causally over all entries
(token embedding ⊕ state, normed apart, q/k/v over both), a final norm, its own lm_head over a
draft vocabulary mapped by ``d2t``. After every step of a chunked-prefill, prefix-cache run the
drafts in the runner's state must equal this chain over the same tokens: a wrong captured
layer, norm, residual, carried state or slot changes them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from tests.support.drafting import (
    SEEDED,
    VOCAB,
    Eagle3Shape,
    K,
    drafts_after_every_step,
    drive,
    hf_greedy,
    loaded_model,
    prompts_sharing_a_prefix,
    runner_and_scheduler,
    tiny_hf,
)
from tests.support.options import split_options
from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.request_options import StoppingOptions
from zerobubble.worker_svc.eagle import HeadFormatError
from zerobubble.worker_svc.model import allocate_kv_cache, build_model
from zerobubble.worker_svc.model_loader import LoadedModel
from zerobubble.worker_svc.proposers.eagle import EagleProposer, serving_head

NUM_LAYERS = 8  # vLLM's default captured layers (2, L // 2, L - 3) are distinct from 8 on
SHAPE = Eagle3Shape.of(tiny_hf(0).config, draft_vocab=96)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + SHAPE.eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``x [heads, S, D]`` rotated with Hugging Face's rotate-half convention at the head's base."""
    dim = SHAPE.head_dim
    inv = 1.0 / (SHAPE.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.cat([positions.float()[:, None] * inv[None]] * 2, dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * angles.cos() + rotated * angles.sin()


class ReferenceHead:
    """The EAGLE-3 forward in plain torch (module docstring); ``w`` holds ``layers.0.`` names."""

    def __init__(self, hf: LlamaForCausalLM, w: dict[str, torch.Tensor], aux: list[int], norm_first: bool) -> None:
        self.hf, self.w, self.aux, self.norm_first = hf, w, sorted(aux), norm_first
        self.embed = hf.model.embed_tokens.weight.detach()
        self.ids = torch.arange(SHAPE.draft_vocab) + w["d2t"]

    def layer(self, tokens: list[int], states: torch.Tensor) -> torch.Tensor:
        """Every entry's predicted state (before the final norm), causally over all entries."""
        w, p = self.w, "layers.0."
        normed_state = _rms(states, w[p + "hidden_norm.weight"])
        x = torch.cat((_rms(self.embed[tokens], w[p + "input_layernorm.weight"]), normed_state), dim=-1)
        residual = normed_state if self.norm_first else states
        seq, pos = len(tokens), torch.arange(len(tokens))

        def heads(name: str, n: int) -> torch.Tensor:
            return (x @ w[p + f"self_attn.{name}_proj.weight"].T).view(seq, n, SHAPE.head_dim).transpose(0, 1)

        q, k, v = (
            _rope(heads("q", SHAPE.heads), pos),
            _rope(heads("k", SHAPE.kv_heads), pos),
            heads("v", SHAPE.kv_heads),
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = attn.transpose(0, 1).reshape(seq, -1) @ w[p + "self_attn.o_proj.weight"].T + residual
        m = _rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        return h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

    def chain(self, ids: list[int], num: int) -> list[int]:
        """The greedy drafts after ``ids``: entries ``(x[t+1], fc(captured[t]))``, then drafts
        fed back with the head's own predicted states."""
        with torch.inference_mode():
            hs = self.hf.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            states = torch.cat([hs[i][0] for i in self.aux], dim=-1)[:-1] @ self.w["fc.weight"].T
            tokens = ids[1:]
            drafts: list[int] = []
            for _ in range(num):
                predicted = self.layer(tokens, states)[-1]
                logits = _rms(predicted, self.w["norm.weight"]) @ self.w["lm_head.weight"].T
                drafts.append(int(self.ids[int(logits.argmax())]))
                tokens, states = tokens + drafts[-1:], torch.cat((states, predicted[None]))
        return drafts


def _proposer(target: LoadedModel, config: dict, state: dict[str, torch.Tensor]) -> EagleProposer:
    return EagleProposer(serving_head(config, state, target), K)


# (config, weight-name prefix, captured layers as the head will read them)
FORMATS = {
    "eagle3-release": (SHAPE.release_config(), "midlayer.", [2, 4, 5]),
    "speculators": (SHAPE.speculators_config([6, 1, 3], norm_before_residual=True), "layers.0.", [1, 3, 6]),
}


def test_the_target_returns_the_captured_layers_inputs_after_its_last_hidden_state() -> None:
    hf = tiny_hf(0, num_layers=NUM_LAYERS)
    model = build_model(hf.config, torch.float32, "cpu")
    model.load_weights(hf.state_dict())
    model.capture_layers = (0, 3, 7)
    ids = torch.tensor(prompts_sharing_a_prefix(0, 1)["r0"])
    n, block_size = len(ids), 4
    num_blocks = -(-n // block_size)
    meta = AttentionMetadata(  # one request's prefill over blocks 0, 1, ...
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        slot_mapping=torch.arange(n),
    )
    caches = allocate_kv_cache(hf.config, num_blocks, block_size, torch.float32, "cpu")
    out = model(ids, torch.arange(n), meta, caches)
    with torch.inference_mode():
        hs = hf.model(ids[None], output_hidden_states=True).hidden_states
        logits = hf.lm_head(hs[-1][0])
    assert out.shape == (len(ids), 4 * SHAPE.hidden)
    for part, want in zip(out.split(SHAPE.hidden, dim=-1), (hs[-1], hs[0], hs[3], hs[7])):
        torch.testing.assert_close(part, want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(model.compute_logits(out), logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_drafts_equal_the_plain_torch_eagle3_chain(fmt: str) -> None:
    config, prefix, aux = FORMATS[fmt]
    hf = tiny_hf(0, num_layers=NUM_LAYERS)
    weights = SHAPE.weights(11, prefix)
    runner, scheduler = runner_and_scheduler(hf, _proposer(loaded_model(hf), config, weights))
    canonical = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
    reference = ReferenceHead(hf, canonical, aux, norm_first=fmt == "speculators")
    compared, agreed = drafts_after_every_step(runner, scheduler, prompts_sharing_a_prefix(2, 4), reference.chain)
    assert compared > 20 and agreed >= compared - 1, (agreed, compared)  # one near-tie at most


@pytest.mark.parametrize("window", [1, 2])
def test_output_with_an_eagle3_head_equals_the_unspeculated_output(window: int) -> None:
    """Greedy equals Hugging Face, and seeded sampling with every control (keyed acceptance)
    equals the runner without speculation, sync and async."""
    hf = tiny_hf(1, num_layers=NUM_LAYERS)
    config, prefix, _ = FORMATS["speculators"]
    weights = SHAPE.weights(12, prefix)
    prompts = prompts_sharing_a_prefix(3, 3)
    runner, scheduler = runner_and_scheduler(hf, _proposer(loaded_model(hf), config, weights))
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, None, StoppingOptions(max_tokens=14, ignore_eos=True))
    outputs, drafted, _ = drive(runner, scheduler, window)
    assert drafted > 30
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(hf, prompt, 14), rid

    def seeded(proposer: EagleProposer | None) -> dict[str, list[int]]:
        runner, scheduler = runner_and_scheduler(hf, proposer)
        for rid, prompt in prompts.items():
            scheduler.add_request(rid, prompt, *split_options(dict(SEEDED, max_tokens=12, seed=7 + len(prompt))))
        return drive(runner, scheduler, window)[0]

    assert seeded(_proposer(loaded_model(hf), config, weights)) == seeded(None)


def test_heads_that_do_not_fit_are_refused_naming_the_field() -> None:
    hf = tiny_hf(0, num_layers=NUM_LAYERS)
    target = loaded_model(hf)
    weights = SHAPE.weights(13)
    cases = [
        (
            SHAPE.speculators_config([1, 3, 8]),
            HeadFormatError,
            r"layer_ids \[1, 3, 8\] must be distinct layers of the target's 8",
        ),
        (SHAPE.speculators_config([1, 3, 3]), HeadFormatError, "must be distinct"),
        (SHAPE.release_config(target_hidden_size=48), HeadFormatError, "hidden_size 48 != target's 64"),
        (SHAPE.release_config(draft_vocab_size=VOCAB + 1), HeadFormatError, "draft_vocab_size 259 is not within"),
        (SHAPE.speculators_config([1, 2, 3]) | {"speculators_config": {"algorithm": "mlp"}}, HeadFormatError, "'mlp'"),
    ]
    for config, error, message in cases:
        with pytest.raises(error, match=message):
            serving_head(config, weights, target)
    with pytest.raises(HeadFormatError, match="d2t: ids outside the target's vocabulary of 258"):
        serving_head(SHAPE.release_config(), weights | {"d2t": weights["d2t"] + VOCAB}, target)
    with pytest.raises(KeyError, match="d2t"):
        serving_head(SHAPE.release_config(), {k: v for k, v in weights.items() if k != "d2t"}, target)
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(64, 192\), expected \(64, 128\)"):
        serving_head(SHAPE.speculators_config([1, 3]), weights, target)
