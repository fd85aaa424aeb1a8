"""EAGLE head training mechanics on a tiny random-weight target's self-distilled samples."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.tiny_eagle import HIDDEN, tiny_config, tiny_head, tiny_samples, tiny_target  # noqa: E402
from zerobubble.worker_svc.eagle import load_head  # noqa: E402
from zerobubble.worker_svc.eagle_data import Sample, answer_batch  # noqa: E402
from zerobubble.worker_svc.eagle_train import CHECKPOINT, TrainSettings, eagle_loss, make_batch, train  # noqa: E402


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    return tiny_samples(tiny_target(), count=8)


def test_batch_rows_pair_next_token_with_current_hidden() -> None:
    ids = torch.arange(10, 16, dtype=torch.int32)
    hidden = torch.arange(6.0)[:, None].expand(6, HIDDEN)
    short = Sample(ids[:4], hidden[:4], answer_start=3)
    batch = make_batch([Sample(ids, hidden, answer_start=3), short])
    # Row t: token t+1 with hidden t, predicting hidden t+1 and token t+2.
    assert batch.input_ids[0].tolist() == [11, 12, 13, 14]
    assert batch.hidden[0, :, 0].tolist() == [0, 1, 2, 3]
    assert batch.target_hidden[0, :, 0].tolist() == [1, 2, 3, 4]
    assert batch.target_ids[0].tolist() == [12, 13, 14, 15]
    # Only rows predicting an answer token (index >= 3) count; padding never does.
    assert batch.mask.tolist() == [[False, True, True, True], [False, True, False, False]]


def test_training_lowers_the_loss_and_resumes(samples: list[Sample], tmp_path: Path) -> None:
    settings = TrainSettings(steps=30, batch_tokens=64, lr=3e-3, warmup=2, checkpoint_every=10, noise=0.0)
    head = tiny_head()
    batch = make_batch(samples)
    with torch.no_grad():
        before = eagle_loss(head, batch, settings)[0].item()
    metrics = train(head, samples, tmp_path, settings, tiny_config().to_dict())
    with torch.no_grad():
        after = eagle_loss(head, batch, settings)[0].item()
    assert metrics["step"] == 30
    assert after < 0.7 * before
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 30
    # A longer run picks the checkpoint up instead of starting over.
    resumed = tiny_head(seed=9)
    more = train(resumed, samples, tmp_path, dataclasses.replace(settings, steps=35), tiny_config().to_dict())
    assert more["step"] == 35
    saved = load_head(tmp_path, tiny_config(), resumed.shared, torch.float32)
    assert torch.equal(saved.fc.weight, resumed.fc.weight.to(torch.bfloat16).float())


def test_batched_answers_equal_greedy_answers_one_at_a_time() -> None:
    target = tiny_target()
    eos = 5

    class Tok:
        eos_token_id = eos

    prompts = [[1, 7, 9, 11, 3], [4, 8], [6, 6, 10, 12, 14, 20, 30]]
    samples = answer_batch(target, Tok(), prompts, max_new_tokens=12)
    for prompt, sample in zip(prompts, samples):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos)[0].tolist()  # fmt: skip
        assert sample.input_ids.tolist() == alone
        assert sample.answer_start == len(prompt)
        with torch.no_grad():
            hidden = target.model(torch.tensor([alone])).last_hidden_state[0]
        assert torch.allclose(sample.hidden, hidden, atol=1e-5)
