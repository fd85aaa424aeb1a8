"""EAGLE self-distillation data on a tiny random-weight target: batched answers and user turns."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.tiny_eagle import VOCAB, tiny_target  # noqa: E402
from zerobubble.worker_svc.eagle_data import (  # noqa: E402
    DistillSettings,
    answer_batch,
    self_written_conversations,
    write_user_turns,
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


def test_batched_answers_equal_greedy_answers_one_at_a_time() -> None:
    target = tiny_target()
    eos = Tok.eos_token_id  # the third prompt's greedy answer is EOS at once; the others run to the limit
    prompts = [[1, 7, 9, 11, 3], [4, 8], [6, 6, 10, 12, 14, 20, 30]]
    samples = answer_batch(target, Tok(), prompts, max_new_tokens=12)
    alone = [
        target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0]
        for p in prompts
    ]
    steps = max(len(a) - len(p) for a, p in zip(alone, prompts))
    assert [len(a) - len(p) for a, p in zip(alone, prompts)] == [12, 12, 1]
    for prompt, sample, full in zip(prompts, samples, alone):
        # A token generated at the batch's last step is dropped: its hidden state was never
        # computed (generation stops before feeding it back); an answer that ended earlier is whole.
        kept = full if len(full) - len(prompt) < steps else full[:-1]
        assert sample.input_ids.tolist() == kept.tolist()
        assert sample.answer_start == len(prompt)
        with torch.no_grad():
            hidden = target.model(full[None]).last_hidden_state[0]
        assert torch.allclose(sample.hidden, hidden[: len(kept)], atol=1e-5)


def test_user_turns_are_written_together_and_seeded() -> None:
    target = tiny_target()
    turns = write_user_turns(target, Tok(), [1, 2, 3], seed=7, count=5, max_tokens=6)
    assert len(turns) == 5
    assert turns == write_user_turns(target, Tok(), [1, 2, 3], seed=7, count=5, max_tokens=6)
    assert turns != write_user_turns(target, Tok(), [1, 2, 3], seed=8, count=5, max_tokens=6)


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
