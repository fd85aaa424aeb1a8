"""The EAGLE proposer over the runner's paged caches, checked against two oracles.

1. A head that copies a one-layer target: ``fc`` passes the token embedding through (the hidden
   state is ignored) and the head's layer is the target's layer with unit-RMS embeddings, so
   the head's entry ``t`` (token ``t + 1`` at rotary position ``t``) attends exactly as the
   target's token at ``t + 1`` does, and its greedy drafts are the target's own continuation
   whenever the head's K/V are at the right slots. Nearly every draft must be accepted, and the
   output must equal Hugging Face's greedy tokens.
2. The plain-torch head (`zerobubble.worker_svc.eagle.EagleHead`) walked offline over the same
   tokens and Hugging Face's hidden states (`zerobubble.tools.eagle_eval.EagleDrafter`):
   the drafts the runner proposes after every step equal it, which checks the carried hidden
   states across prefill chunks and verification as well.

Keyed acceptance makes seeded output independent of the drafts: with every sampling control on,
the output equals the unspeculated one, sync and async, batched and alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.support.drafting import (
    SEEDED,
    VOCAB,
    K,
    copying_target_and_head,
    drafts_after_every_step,
    drive,
    eagle_head,
    hf_greedy,
    loaded_model,
    prompts_sharing_a_prefix,
    runner_and_scheduler,
    tiny_hf,
)
from tests.support.options import split_options
from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.tools.eagle_data import Sample
from zerobubble.tools.eagle_eval import EagleDrafter
from zerobubble.worker_svc.eagle import (
    DRAFT_VOCAB_KEY,
    EagleHead,
    HeadFormatError,
    SharedWeights,
    draft_vocab,
    head_config,
)
from zerobubble.worker_svc.model_loader import LoadedModel, ModelLoadError
from zerobubble.worker_svc.proposers.eagle import EagleProposer, resolve_head, serving_head


def _proposer(
    target: LoadedModel, state: dict[str, torch.Tensor], acceptance: str = "keyed", quantization: str = "none"
) -> EagleProposer:
    return EagleProposer(eagle_head(target, state, quantization), K, acceptance)


def _random_head(hf: LlamaForCausalLM, seed: int) -> EagleHead:
    torch.manual_seed(seed)
    embed = hf.model.embed_tokens.weight.detach()
    head = EagleHead(hf.config, SharedWeights(embed=embed, lm_head=hf.lm_head.weight.detach()))
    with torch.no_grad():  # sharper than the default init: drafts far from ties
        for p in head.parameters():
            p.mul_(3.0)
    return head.eval()


def _as_speculators(hf: LlamaForCausalLM, state: dict[str, torch.Tensor]) -> EagleProposer:
    """The same EAGLE-1 head in the speculators format: its config and weight names."""
    config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "speculators_config": {"algorithm": "eagle", "verifier": {"name_or_path": "tiny"}},
        "transformer_layer_config": hf.config.to_dict() | {"num_hidden_layers": 1},
        "layernorms": False,
        "fusion_bias": "fc.bias" in state,
    }
    renamed = {k.replace("fc.", "fusion_fc.").replace("layers.0.", "transformer."): v for k, v in state.items()}
    return EagleProposer(serving_head(config, renamed, loaded_model(hf)), K)


@pytest.mark.parametrize("window, fmt", [(1, "eagle-1"), (2, "eagle-1"), (2, "speculators")])
def test_a_head_copying_its_target_drafts_the_targets_greedy_continuation(window: int, fmt: str) -> None:
    hf, state = copying_target_and_head()
    proposer = _as_speculators(hf, state) if fmt == "speculators" else _proposer(loaded_model(hf), state)
    runner, scheduler = runner_and_scheduler(hf, proposer)
    prompts = prompts_sharing_a_prefix(1, 5)
    max_tokens = {rid: 12 + 5 * i for i, rid in enumerate(prompts)}
    for rid, prompt in prompts.items():
        scheduler.add_request(rid, prompt, None, StoppingOptions(max_tokens=max_tokens[rid], ignore_eos=True))
    outputs, drafted, accepted = drive(runner, scheduler, window)
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(hf, prompt, max_tokens[rid]), rid
    assert drafted > 50 and accepted >= 0.9 * drafted, (accepted, drafted)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_bfloat16_target_on_the_compiled_kernels_drafts_its_greedy_continuation(cpu_kernels, quantization) -> None:
    """The served default on a CPU with native bfloat16: the head's layer, its fusion and its
    draft vocabulary's lm_head run in the compiled kernels' bfloat16 products, which take only
    bfloat16 input (the chain casts back the float32 residual sum those kernels keep). With
    ``--draft-quantization int8`` the head's weights are int8 blocks and it drafts as well."""
    hf, state = copying_target_and_head()
    # Tied, as SmolLM2 is: the lm_head's rows stay at hand, so the draft ids get a product of
    # their own (an untied lm_head is kept in blocks only, and the head drafts through it).
    hf.config.tie_word_embeddings = True
    state[DRAFT_VOCAB_KEY] = torch.arange(VOCAB)

    def target() -> LoadedModel:
        return loaded_model(hf, torch.bfloat16, kernels="cpp")

    proposer = _proposer(target(), state, quantization=quantization)
    weight_dtype = torch.int8 if quantization == "int8" else torch.bfloat16
    for weight in (proposer.head.lm_head, proposer.head.fc, proposer.head.layer_model.layers[0].mlp.down_weight):
        assert weight is not None and weight.blocks is not None and weight.blocks.dtype == weight_dtype
    prompts = prompts_sharing_a_prefix(1, 4)

    def run(eagle: bool) -> tuple[dict[str, list[int]], int, int]:
        runner, scheduler = runner_and_scheduler(target(), proposer if eagle else None)
        for rid, prompt in prompts.items():
            scheduler.add_request(rid, prompt, None, StoppingOptions(max_tokens=16, ignore_eos=True))
        return drive(runner, scheduler, 2)

    baseline, _, _ = run(False)
    outputs, drafted, accepted = run(True)
    assert drafted > 30 and accepted >= 0.8 * drafted, (accepted, drafted)
    # Verifying 1 + k tokens rounds differently from one at a time in bfloat16: a near-tie may
    # flip, so most rows, not all, must equal the unspeculated greedy output.
    same = sum(outputs[rid] == baseline[rid] for rid in prompts)
    assert same >= len(prompts) - 1, (outputs, baseline)


def test_drafts_equal_the_offline_chain_of_the_same_head() -> None:
    """After every step (chunked prefill: a 24-token budget; prefix-cache hits) the drafts in
    the runner's state equal the plain-torch head's chain over Hugging Face's hidden states."""
    hf = tiny_hf(0)
    head = _random_head(hf, 7)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    runner, scheduler = runner_and_scheduler(hf, _proposer(loaded_model(hf), state))

    def expected(ids: list[int], num: int) -> list[int]:
        tokens = torch.tensor(ids)
        with torch.inference_mode():
            hidden = hf.model(tokens[None]).last_hidden_state[0]
        # A drafter per call: it caches its rows by the sample's id, which a new sample may reuse.
        return EagleDrafter(head)(Sample(input_ids=tokens, hidden=hidden, answer_start=0), len(ids) - 2, num)

    compared, agreed = drafts_after_every_step(runner, scheduler, prompts_sharing_a_prefix(2, 4), expected)
    assert compared > 20 and agreed >= compared - 1, (agreed, compared)  # one near-tie at most


def test_keyed_acceptance_gives_the_unspeculated_seeded_output() -> None:
    """A perturbed copying head (drafts accepted and rejected): seeded sampling with every
    control emits exactly the tokens of the runner without speculation, sync or async, batched
    or alone."""
    hf, state = copying_target_and_head(noise=0.3)
    prompts = {rid: prompt * 2 for rid, prompt in prompts_sharing_a_prefix(3, 3).items()}

    def run(eagle: bool, window: int, req_ids: list[str]) -> tuple[dict[str, list[int]], int, int]:
        runner, scheduler = runner_and_scheduler(hf, _proposer(loaded_model(hf), state) if eagle else None)
        for rid in req_ids:
            options = dict(SEEDED, max_tokens=16, seed=100 + int(rid[1:]))
            scheduler.add_request(rid, prompts[rid], *split_options(options))
        return drive(runner, scheduler, window)

    baseline, _, _ = run(False, 1, list(prompts))
    for window in (1, 2):
        outputs, drafted, accepted = run(True, window, list(prompts))
        assert outputs == baseline, window
        assert 0 < accepted < drafted, (accepted, drafted)
    assert run(True, 2, ["r1"])[0]["r1"] == baseline["r1"]


def test_a_head_that_does_not_fit_its_target_is_refused_naming_the_mismatch() -> None:
    hf, state = copying_target_and_head()
    target = loaded_model(hf)
    wrong = head_config(hf.config.to_dict(), fc_bias=False) | {"hidden_size": 48}
    with pytest.raises(HeadFormatError, match="hidden_size 48 != target's 64"):
        serving_head(wrong, state, target)
    other_split = head_config(hf.config.to_dict(), fc_bias=False) | {"num_key_value_heads": 4}
    with pytest.raises(HeadFormatError, match="num_key_value_heads 4 != target's 2"):
        serving_head(other_split, state, target)
    ttt = {"speculators_config": {"algorithm": "eagle"}, "transformer_layer_config": {}, "layernorms": True}
    with pytest.raises(HeadFormatError, match="layernorms: true are not supported"):
        serving_head(ttt, state, target)
    with pytest.raises(KeyError, match="fc.weight"):
        without_fc = {k: v for k, v in state.items() if k != "fc.weight"}
        serving_head(head_config(hf.config.to_dict(), fc_bias=False), without_fc, target)


def test_greedy_sampling_options_are_respected() -> None:
    """Default options sample greedily: the copying head's run equals Hugging Face (window 2)."""
    hf, state = copying_target_and_head()
    runner, scheduler = runner_and_scheduler(hf, _proposer(loaded_model(hf), state))
    prompt = prompts_sharing_a_prefix(4, 1)["r0"]
    scheduler.add_request("r0", prompt, SamplingOptions(), StoppingOptions(max_tokens=24, ignore_eos=True))
    outputs, _, _ = drive(runner, scheduler, 2)
    assert outputs["r0"] == hf_greedy(hf, prompt, 24)


def test_draft_vocabulary_keeps_eos_then_frequent_tokens_then_low_ids() -> None:
    answers = [torch.tensor([9, 9, 9, 5, 5, 7]), torch.tensor([5, 11])]
    ids = draft_vocab(answers, 6, always=[200])
    # 200 (EOS) first, then 5, 9, 7, 11 by frequency (ties by id), then the lowest free id.
    assert ids.tolist() == [0, 5, 7, 9, 11, 200]
    assert draft_vocab(answers, 3, always=[200]).tolist() == [5, 9, 200]


def test_a_draft_vocabulary_limits_the_heads_logits_to_its_ids() -> None:
    """Inside the subset the head's logits equal the full lm_head's; outside they are -inf, so
    a draft is never drawn there."""
    hf, state = copying_target_and_head()
    target = loaded_model(hf)
    subset = torch.tensor([3, 17, 40, 41, 200, 256])
    full = _proposer(target, state).head
    limited = _proposer(target, {**state, DRAFT_VOCAB_KEY: subset}).head
    features = torch.randn(5, hf.config.hidden_size)
    want, got = full.logits(features), limited.logits(features)
    torch.testing.assert_close(got[:, subset], want[:, subset])
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(got[:, outside]).all()
    with pytest.raises(HeadFormatError, match="outside the target's vocabulary"):
        _proposer(target, {**state, DRAFT_VOCAB_KEY: torch.tensor([1, VOCAB])})
    with pytest.raises(HeadFormatError, match="empty"):
        _proposer(target, {**state, DRAFT_VOCAB_KEY: torch.tensor([], dtype=torch.int64)})
    with pytest.raises(HeadFormatError, match="repeated ids"):
        _proposer(target, {**state, DRAFT_VOCAB_KEY: torch.tensor([3, 3, 7])})


def test_head_names_resolve_to_the_model_cache_and_bad_ones_are_named(tmp_path, monkeypatch) -> None:
    """A built-in name is the folder `make eagle-head` trains into the model cache; before it is
    made, the error says how to make it."""
    monkeypatch.setenv("ZEROBUBBLE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match="make eagle-head"):
        resolve_head("smollm2-135m-eagle")
    made = tmp_path / "models" / "smollm2-135m-eagle"
    made.mkdir(parents=True)
    (made / "config.json").write_text("{}")
    assert resolve_head("smollm2-135m-eagle") == made
    with pytest.raises(ModelLoadError, match="no EAGLE head directory"):
        resolve_head(str(tmp_path / "missing"))
