"""The EAGLE-1 head's mechanics on a tiny random-weight Llama target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.tiny_eagle import HIDDEN, VOCAB, tiny_config, tiny_head, tiny_shared, tiny_target  # noqa: E402
from zerobubble.worker_svc.eagle import (  # noqa: E402
    EAGLE1,
    EAGLE3,
    SPECULATORS,
    HeadFormatError,
    check_fits,
    detect_format,
    head_layout,
    init_from_target_layer,
    load_head,
    save_head,
)
from zerobubble.worker_svc.model import model_spec  # noqa: E402


def test_weight_names_are_eagle1_layout() -> None:
    names = set(tiny_head().state_dict())
    assert "fc.weight" in names and "fc.bias" in names
    assert "layers.0.self_attn.q_proj.weight" in names
    assert "layers.0.post_attention_layernorm.weight" in names
    assert "layers.0.mlp.down_proj.weight" in names
    # EAGLE-1's first layer has no input norm, and the shared embedding / lm_head are not the head's.
    assert not any("input_layernorm" in n for n in names)
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_fc_reads_embedding_first_then_hidden() -> None:
    head = tiny_head()
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.bias.zero_()
        head.fc.weight[:, :HIDDEN] = torch.eye(HIDDEN)  # pass the embedding half through
    ids = torch.tensor([[3, 5]])
    hidden = torch.randn(1, 2, HIDDEN)
    embeds = torch.nn.functional.embedding(ids, head.shared.embed)
    fused = head.fc(torch.cat((embeds, hidden), dim=-1))
    assert torch.allclose(fused, embeds)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_forward_is_causal_and_cache_matches_full(model_type: str) -> None:
    head = tiny_head(model_type)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 7), generator=g)
    hidden = torch.randn(2, 7, HIDDEN, generator=g)
    with torch.no_grad():
        full, _ = head(ids, hidden)
        # Changing a later row leaves earlier outputs alone.
        changed = hidden.clone()
        changed[:, 5:] += 1.0
        partial, _ = head(ids, changed)
        assert torch.allclose(full[:, :5], partial[:, :5], atol=1e-6)
        assert not torch.allclose(full[:, 5:], partial[:, 5:])
        # Prefix then one token at a time over the cache gives the same rows.
        out, cache = head(ids[:, :4], hidden[:, :4])
        rows = [out]
        for t in range(4, 7):
            step, cache = head(ids[:, t : t + 1], hidden[:, t : t + 1], start=t, cache=cache)
            rows.append(step)
    assert torch.allclose(torch.cat(rows, dim=1), full, atol=1e-5)


def test_logits_use_the_shared_lm_head() -> None:
    head = tiny_head()
    hidden = torch.randn(3, HIDDEN)
    assert torch.allclose(head.logits(hidden), hidden @ head.shared.lm_head.T)


def test_detect_format() -> None:
    assert detect_format({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}) == EAGLE1
    assert detect_format({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000}) == EAGLE3
    assert detect_format({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}) == EAGLE3
    assert detect_format({"speculators_config": {"algorithm": "eagle3"}}) == SPECULATORS


def test_formats_that_cannot_be_loaded_here_are_named() -> None:
    spec = model_spec(tiny_config())
    eagle3 = {
        "draft_vocab_size": 10,
        "hidden_size": HIDDEN,
        "vocab_size": VOCAB,
        "eagle_aux_hidden_state_layer_ids": [0, 1],
    }
    with pytest.raises(HeadFormatError, match="eagle-3 heads are served, not trained here"):
        check_fits(eagle3, spec)
    with pytest.raises(HeadFormatError, match="speculators heads of algorithm 'None' are not supported"):
        head_layout({"speculators_config": {}}, spec)
    with pytest.raises(HeadFormatError, match="without auxiliary hidden states"):
        head_layout(eagle3 | {"eagle_config": {"use_aux_hidden_state": False}}, spec)


def test_mismatched_head_is_refused_naming_the_mismatch() -> None:
    spec = model_spec(tiny_config())
    with pytest.raises(HeadFormatError, match=r"hidden_size 64 != target's 32"):
        check_fits({"hidden_size": 64, "vocab_size": VOCAB}, spec)
    with pytest.raises(HeadFormatError, match=r"vocab_size 50 != target's 97"):
        check_fits({"hidden_size": HIDDEN, "vocab_size": 50}, spec)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    head = tiny_head()
    config = tiny_config()
    save_head(head, tmp_path, config.to_dict())
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["num_hidden_layers"] == 1 and written["hidden_size"] == HIDDEN
    loaded = load_head(tmp_path, config, head.shared, torch.float32)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).float()), name


def test_load_refuses_a_head_for_another_target(tmp_path: Path) -> None:
    save_head(tiny_head(), tmp_path, tiny_config().to_dict())
    other = tiny_config()
    other.hidden_size = 48
    with pytest.raises(HeadFormatError, match="hidden_size 32 != target's 48"):
        load_head(tmp_path, other, tiny_shared(), torch.float32)


def test_init_from_target_layer_copies_that_layer_but_its_input_norm() -> None:
    state = tiny_target().state_dict()
    head = tiny_head()
    init_from_target_layer(head, state, layer=1)
    for name, tensor in head.layers[0].state_dict().items():
        assert torch.equal(tensor, state[f"model.layers.1.{name}"]), name
    assert head.layers[0].input_layernorm is None
