"""Offline acceptance: the step walk, n-gram lookup and the EAGLE chain."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.support.tiny_eagle import HIDDEN, tiny_head, tiny_samples, tiny_target  # noqa: E402
from zerobubble.tools.eagle_data import Sample  # noqa: E402
from zerobubble.tools.eagle_eval import EagleDrafter, ngram_drafter, simulate  # noqa: E402


def _sample(tokens: list[int], answer_start: int) -> Sample:
    return Sample(torch.tensor(tokens, dtype=torch.int32), torch.zeros(len(tokens), HIDDEN), answer_start)


def test_perfect_drafts_advance_k_plus_one_tokens_per_step() -> None:
    sample = _sample(list(range(20)), answer_start=4)

    def oracle(s: Sample, p: int, k: int) -> list[int]:
        return s.input_ids[p + 2 : p + 2 + k].tolist()

    acc = simulate([sample], oracle, k=3)
    # The answer is tokens 4..19: prefill samples 4, then steps from p = 3 until the end.
    assert acc.rates()[0] == 1.0
    assert acc.steps == 4 and acc.tokens == 4 + 4 + 4 + 3


def test_wrong_drafts_advance_one_token_per_step() -> None:
    sample = _sample(list(range(20)), answer_start=4)
    acc = simulate([sample], lambda s, p, k: [-1] * k, k=4)
    assert acc.tokens_per_step == 1.0 and acc.rates() == [0.0] * 4
    assert acc.steps == 20 - 4 - 1


def test_acceptance_stops_at_the_first_mismatch() -> None:
    sample = _sample(list(range(8)), answer_start=4)
    calls: list[int] = []

    def second_wrong(s: Sample, p: int, k: int) -> list[int]:
        calls.append(p)
        drafts = s.input_ids[p + 2 : p + 2 + k].tolist()
        return drafts[:1] + [-1] + drafts[2:]

    acc = simulate([sample], second_wrong, k=3)
    assert calls == [3, 5] and acc.rates() == [1.0, 0.0, 0.0]


def test_ngram_takes_the_longest_most_recent_match() -> None:
    draft = ngram_drafter(min_n=2, max_n=3)
    # ... 1 2 3 [7 8] ... 9 2 3 [5 6] ... 2 3 -> the 2-gram "2 3" last seen before 5 6.
    seq = [1, 2, 3, 7, 8, 9, 2, 3, 5, 6, 4, 2, 3]
    assert draft(_sample(seq, 1), len(seq) - 2, 2) == [5, 6]
    # With "1 2 3" as the suffix, the 3-gram match wins over the more recent 2-gram one.
    seq = [1, 2, 3, 7, 8, 9, 2, 3, 5, 6, 1, 2, 3]
    assert draft(_sample(seq, 1), len(seq) - 2, 2) == [7, 8]
    assert draft(_sample([1, 2, 3, 4], 1), 2, 2) == []


def test_eagle_chain_matches_the_head_over_the_whole_drafted_sequence() -> None:
    head = tiny_head()
    sample = tiny_samples(tiny_target(), count=1)[0]
    p, k = 9, 4
    drafts = EagleDrafter(head)(sample, p, k)
    # Recompute without a cache: real rows 0..p, then each draft with the hidden state the head
    # predicted for the row before it.
    ids = sample.input_ids[1 : p + 2].long()[None]
    hidden = sample.hidden[: p + 1][None]
    with torch.no_grad():
        for i in range(k):
            out, _ = head(ids, hidden)
            token = int(head.logits(out[0, -1]).argmax())
            assert token == drafts[i], i
            ids = torch.cat((ids, torch.tensor([[token]])), dim=1)
            hidden = torch.cat((hidden, out[:, -1:]), dim=1)


def test_an_eagle_chain_with_a_draft_vocabulary_drafts_the_most_likely_of_its_ids() -> None:
    """As the served head does: each draft is the argmax among the draft ids, fed on as itself."""
    head = tiny_head()
    sample = tiny_samples(tiny_target(), count=1)[0]
    p, k = 9, 3
    whole = EagleDrafter(head)(sample, p, k)
    # Leave the first unrestricted draft out, so the restricted chain must differ from there.
    vocab = head.spec.vocab_size
    draft_ids = torch.tensor([t for t in range(vocab) if t != whole[0]])
    drafts = EagleDrafter(head, draft_ids)(sample, p, k)
    ids = sample.input_ids[1 : p + 2].long()[None]
    hidden = sample.hidden[: p + 1][None]
    with torch.no_grad():
        for i in range(k):
            out, _ = head(ids, hidden)
            logits = head.logits(out[0, -1])
            logits[whole[0]] = float("-inf")
            token = int(logits.argmax())
            assert token == drafts[i] and token != whole[0], i
            ids = torch.cat((ids, torch.tensor([[token]])), dim=1)
            hidden = torch.cat((hidden, out[:, -1:]), dim=1)
