"""EAGLE head training mechanics on a tiny random-weight target's self-distilled samples."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
pytest.importorskip("transformers")

from tests.support.tiny_eagle import HIDDEN, VOCAB, tiny_config, tiny_head, tiny_samples, tiny_target  # noqa: E402
from zerobubble.tools.eagle_data import Sample  # noqa: E402
from zerobubble.tools.eagle_train import (  # noqa: E402
    CHECKPOINT,
    TrainSettings,
    batches,
    chain_pass,
    eagle_loss,
    make_batch,
    train,
    unrolled_predictions,
)
from zerobubble.worker_svc.eagle import load_head  # noqa: E402


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    return tiny_samples(tiny_target(), count=8)


def test_batch_rows_pair_next_token_with_current_hidden() -> None:
    ids = torch.arange(10, 16, dtype=torch.int32)
    hidden = torch.arange(6.0)[:, None].expand(6, HIDDEN)
    short = Sample(ids[:4], hidden[:4], answer_start=3)
    batch = make_batch([Sample(ids, hidden, answer_start=3), short])
    # Row t: token t+1 with hidden t, predicting hidden t+1 (whose logits choose token t+2).
    assert batch.input_ids[0].tolist() == [11, 12, 13, 14]
    assert batch.hidden[0, :, 0].tolist() == [0, 1, 2, 3]
    assert batch.target_hidden[0, :, 0].tolist() == [1, 2, 3, 4]
    # Only rows predicting an answer token (index >= 3) count; padding never does.
    assert batch.mask.tolist() == [[False, True, True, True], [False, True, False, False]]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_chain_pass_over_real_hidden_states_is_the_heads_forward(model_type: str) -> None:
    head = tiny_head(model_type)
    g = torch.Generator().manual_seed(5)
    ids, hidden = torch.randint(0, 97, (2, 11), generator=g), torch.randn(2, 11, HIDDEN, generator=g)
    with torch.no_grad():
        want, _ = head(ids, hidden)
        got = chain_pass(head, ids, hidden, [], [])
    assert torch.allclose(got, want, atol=1e-5)


def test_unrolled_passes_are_the_drafting_chain_over_the_real_tokens(samples: list[Sample]) -> None:
    head = tiny_head("qwen3")
    batch = make_batch(samples[:2])
    with torch.no_grad():
        passes = unrolled_predictions(head, batch.input_ids, batch.hidden, 3)
        for row, p in ((0, 4), (1, 9), (0, 15)):
            # The chain after row p, as drafting runs it: real rows 0..p, then one row at a time
            # over the cache, each fed the previous row's prediction and the real next token.
            ids, hidden = batch.input_ids[row : row + 1], batch.hidden[row : row + 1]
            out, cache = head(ids[:, : p + 1], hidden[:, : p + 1])
            predicted = out[:, -1:]
            assert torch.allclose(passes[0][row, p], predicted[0, 0], atol=1e-5)
            for d in (1, 2):
                predicted, cache = head(ids[:, p + d : p + d + 1], predicted, start=p + d, cache=cache)
                assert torch.allclose(passes[d][row, p + d], predicted[0, 0], atol=1e-5), (row, p, d)


def test_later_passes_train_the_head_through_their_own_rows(samples: list[Sample]) -> None:
    head = tiny_head()
    batch = make_batch(samples[:2])
    rows = head.shared.lm_head
    loss, metrics = eagle_loss(head, batch, TrainSettings(unroll=2, noise=0.0), rows)
    loss.backward()
    assert set(metrics) == {"vloss", "ploss", "acc", "acc1", "acc2"}
    assert head.fc.weight.grad is not None and head.layers[0].self_attn.k_proj.weight.grad is not None
    # Without unrolling the loss is pass 0's alone.
    settings = TrainSettings(unroll=0, noise=0.0)
    single, _ = eagle_loss(head, batch, settings, rows)
    want = metrics["vloss"] + settings.token_weight * metrics["ploss"]
    assert single.item() == pytest.approx(want, rel=1e-5)


def test_the_token_loss_is_the_cross_entropy_against_the_targets_distribution_over_the_draft_vocabulary(
    samples: list[Sample],
) -> None:
    head = tiny_head()
    batch = make_batch(samples[:2])
    vocab = torch.arange(0, VOCAB, 2)
    rows = head.shared.lm_head[vocab]
    settings = TrainSettings(unroll=0, noise=0.0, hidden_weight=0.0, token_weight=1.0)
    with torch.no_grad():
        loss, metrics = eagle_loss(head, batch, settings, rows)
        predicted, _ = head(batch.input_ids, batch.hidden)
    # torch's own cross-entropy with probability targets: the target's softmax over the same ids.
    logits = F.linear(predicted[batch.mask], rows)
    target = F.linear(batch.target_hidden[batch.mask], rows)
    assert loss.item() == pytest.approx(F.cross_entropy(logits, target.softmax(-1)).item(), rel=1e-5)
    agree = (logits.argmax(-1) == target.argmax(-1)).float().mean().item()
    assert metrics["acc"] == pytest.approx(agree)


def test_training_lowers_the_loss_and_resumes(samples: list[Sample], tmp_path: Path) -> None:
    settings = TrainSettings(steps=30, batch_tokens=64, lr=3e-3, warmup=2, checkpoint_every=10, noise=0.0)
    head = tiny_head()
    batch = make_batch(samples)
    with torch.no_grad():
        before = eagle_loss(head, batch, settings, head.shared.lm_head)[0].item()
    metrics = train(head, samples, tmp_path, settings, tiny_config().to_dict(), torch.arange(VOCAB))
    with torch.no_grad():
        after = eagle_loss(head, batch, settings, head.shared.lm_head)[0].item()
    assert metrics["step"] == 30
    assert after < 0.7 * before
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 30
    # A longer run picks the checkpoint up instead of starting over.
    resumed = tiny_head(seed=9)
    longer = dataclasses.replace(settings, steps=35)
    more = train(resumed, samples, tmp_path, longer, tiny_config().to_dict(), torch.arange(VOCAB))
    assert more["step"] == 35
    saved = load_head(tmp_path, tiny_config(), resumed.shared, torch.float32)
    assert torch.equal(saved.fc.weight, resumed.fc.weight.to(torch.bfloat16).float())


def test_bfloat16_products_train_a_float32_head_as_float32_ones_do(samples: list[Sample], tmp_path: Path) -> None:
    """Autocast computes the products in bfloat16; the weights, their optimizer and the losses
    stay float32, and the loss falls about as far as in float32 training."""
    settings = TrainSettings(steps=30, batch_tokens=64, lr=3e-3, warmup=2, checkpoint_every=10, noise=0.0)
    batch = make_batch(samples)
    after = {}
    for bf16 in (False, True):
        head = tiny_head()
        with torch.no_grad():
            before = eagle_loss(head, batch, settings, head.shared.lm_head)[0].item()
        train(head, samples, tmp_path / str(bf16), dataclasses.replace(settings, bf16=bf16),
              tiny_config().to_dict(), torch.arange(VOCAB))  # fmt: skip
        assert all(p.dtype == torch.float32 for p in head.parameters())
        with torch.no_grad():
            after[bf16] = eagle_loss(head, batch, settings, head.shared.lm_head)[0].item() / before
    # Same seeds, same batches: only the products' rounding tells the runs apart.
    assert after[True] != after[False]
    assert after[True] < 0.7 and abs(after[True] - after[False]) < 0.1, after


def test_batches_cover_every_sample_once_within_the_token_budget() -> None:
    g = torch.Generator().manual_seed(6)
    lengths = torch.randint(5, 60, (50,), generator=g).tolist()
    samples = [Sample(torch.zeros(n, dtype=torch.int32), torch.zeros(n, HIDDEN), 2) for n in lengths]
    epoch = batches(samples, 128, random.Random(0), pool=16)
    assert sorted(id(s) for b in epoch for s in b) == sorted(id(s) for s in samples)
    for b in epoch:
        assert len(b) == 1 or max(len(s.input_ids) for s in b) * len(b) <= 128
    # Sorting within pools packs more rows per batch than the shuffled order alone would.
    padded = sum(max(len(s.input_ids) for s in b) * len(b) for b in epoch)
    unsorted = sum(max(len(s.input_ids) for s in b) * len(b) for b in batches(samples, 128, random.Random(0), pool=1))
    assert padded < unsorted
