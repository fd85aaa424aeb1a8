"""EAGLE self-distillation data on a tiny random-weight target: batched answers and user turns."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.drafting import loaded_model  # noqa: E402
from tests.support.tiny_eagle import VOCAB, tiny_target  # noqa: E402
from zerobubble.tools.eagle_data import (  # noqa: E402
    NUCLEUS_CANDIDATES,
    Conversation,
    DistillSettings,
    Sampling,
    _choose,
    answer_variants,
    generate,
    self_written_conversations,
)


class Tok:
    """A character tokenizer with a one-line chat template, enough for the data functions."""

    eos_token_id = 30

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, **_: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    def __call__(self, text: str, add_special_tokens: bool) -> SimpleNamespace:
        return SimpleNamespace(input_ids=[ord(c) % VOCAB for c in text])

    def decode(self, ids: Any, skip_special_tokens: bool) -> str:
        return " ".join(str(int(i)) for i in ids if int(i) != self.eos_token_id)


def test_batched_answers_equal_hugging_face_greedy_answers_one_at_a_time() -> None:
    target = tiny_target()
    eos = Tok.eos_token_id  # the third prompt's greedy answer is EOS at once; the others run to the limit
    prompts = [[1, 7, 9, 11, 3], [4, 8], [6, 6, 10, 12, 14, 20, 30]]
    samples = generate(loaded_model(target, eos=eos), prompts, max_new_tokens=12)
    alone = [
        target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0]
        for p in prompts
    ]
    assert [len(a) - len(p) for a, p in zip(alone, prompts)] == [12, 12, 1]
    for prompt, sample, full in zip(prompts, samples, alone):
        assert sample.input_ids.tolist() == full.tolist()
        assert sample.answer_start == len(prompt)
        # Every position's final hidden state, the answer's last token included.
        with torch.no_grad():
            hidden = target.model(full[None]).last_hidden_state[0]
        assert sample.hidden.shape == hidden.shape
        assert torch.allclose(sample.hidden, hidden, atol=1e-5)


def test_sampled_rows_are_seeded_and_stay_in_the_vocabulary() -> None:
    loaded = loaded_model(tiny_target(), eos=Tok.eos_token_id)
    prompts = [[1, 2, 3]] * 5

    def written(seed: int) -> list[list[int]]:
        return [s.input_ids.tolist() for s in generate(loaded, prompts, 6, Sampling(), seed)]

    first = written(7)
    assert first == written(7)
    assert first != written(8)
    assert len({tuple(t) for t in first}) > 1  # rows of one batch differ from each other
    assert all(0 <= t < VOCAB for row in first for t in row)


def test_sampling_draws_from_the_renormalized_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    rows = 20_000
    logits = probs.log().expand(rows, -1)
    # top_p 0.9: the mass before token 2 is 0.8 < 0.9, so it is in; before token 3 it is 0.95.
    picks = torch.tensor(_choose(logits, Sampling(1.0, 0.9), torch.Generator().manual_seed(0)))
    counts = torch.bincount(picks, minlength=5).float() / rows
    assert counts[3:].sum() == 0
    expected = probs[:3] / probs[:3].sum()
    # Three standard errors of a binomial share at 20,000 draws is under 0.011.
    assert torch.allclose(counts[:3], expected, atol=0.011)
    # Temperature 0.5 squares the probabilities before renormalizing (the nucleus taken after).
    picks = torch.tensor(_choose(logits, Sampling(0.5, 1.0), torch.Generator().manual_seed(1)))
    counts = torch.bincount(picks, minlength=5).float() / rows
    assert torch.allclose(counts, probs**2 / (probs**2).sum(), atol=0.011)
    assert NUCLEUS_CANDIDATES >= 5
    assert _choose(logits[:2], None, torch.Generator()) == [0, 0]


def test_only_trained_workload_rows_get_sampled_answers() -> None:
    convs = [
        Conversation("grounded-0001", [], held_out=False),
        Conversation("grounded-0002", [], held_out=True),
        Conversation("self-0003", [], held_out=False),
    ]
    pairs = answer_variants(convs, DistillSettings(num_sampled_answers=2))
    assert [(c.key, v) for c, v in pairs] == [
        ("grounded-0001", 0),
        ("grounded-0001", 1),
        ("grounded-0001", 2),
        ("grounded-0002", 0),
        ("self-0003", 0),
    ]


def test_only_the_first_self_written_turns_can_be_held_out(tmp_path: Path) -> None:
    # Cached turns are reused as they are: nothing is generated (no model is needed).
    turns = [f"turn {i}" for i in range(300)] + [""]
    (tmp_path / "self_written.jsonl").write_text("".join(json.dumps(t) + "\n" for t in turns))
    settings = DistillSettings(num_self_written=301, held_out_self=64, held_out_every=6)
    convs = self_written_conversations(None, Tok(), settings, tmp_path)
    assert len(convs) == 300  # the empty turn is dropped
    held = [int(c.key.split("-")[1]) for c in convs if c.held_out]
    assert held and max(held) < 64
    assert all(c.messages == [{"role": "user", "content": turns[int(c.key.split("-")[1])]}] for c in convs)
