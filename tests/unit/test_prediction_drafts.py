"""Drafts from a predicted output (`worker_svc/proposers/prediction.py`) against a plain
Python reference of the same rule, over random sequences that follow, leave and rejoin their
predictions."""

from __future__ import annotations

import random

import pytest
import torch

from zerobubble.worker_svc.proposers.prediction import PredictionDrafts
from zerobubble.worker_svc.slot_table import DeviceState

BLOCK_SIZE = 4
NUM_SLOTS = 4
MAX_BLOCKS = 64
K = 5
MATCH_LEN = 8
MIN_MATCH = 2
NEAR = 6


def lookup(seq: list[int]) -> list[int]:
    """Prompt lookup: the longest (4 down to 2) suffix of ``seq`` found earlier, the latest
    occurrence; the tokens after it."""
    for n in range(4, 1, -1):
        starts = [i for i in range(len(seq) - n) if seq[i : i + n] == seq[-n:]]
        if starts:
            return seq[starts[-1] + n : starts[-1] + n + K]
    return []


def reference(seq: list[int], pred: list[int], anchor: int, anchor_total: int) -> tuple[list[int], int, int, bool]:
    """(drafts, anchor, anchor_total, from the prediction) after one proposal, written as the
    rule reads."""
    total = len(seq)

    def run(e: int) -> int:
        n = 0
        while n < MATCH_LEN and e - n >= 0 and n < total and pred[e - n] == seq[total - 1 - n]:
            n += 1
        return n

    expected = anchor + (total - anchor_total)
    if 0 <= expected < len(pred) - 1 and run(expected) >= 1:
        aligned = expected
    else:
        ends = [e for e in range(len(pred) - 1) if run(e) >= MIN_MATCH or (anchor < e <= anchor + NEAR and run(e) >= 1)]
        if not ends:
            return lookup(seq), anchor, anchor_total, False
        aligned = max(ends, key=lambda e: (run(e), e > anchor, -e))
    return pred[aligned + 1 : aligned + 1 + K], aligned, total, True


def _state() -> DeviceState:
    num_blocks = NUM_SLOTS * MAX_BLOCKS
    state = DeviceState.allocate(NUM_SLOTS, MAX_BLOCKS, K, num_blocks, BLOCK_SIZE, torch.device("cpu"))
    # Slot s owns blocks s * MAX_BLOCKS ..., scattered through the pages in reverse.
    for s in range(NUM_SLOTS):
        state.block_table[s] = torch.arange(MAX_BLOCKS) * NUM_SLOTS + (NUM_SLOTS - 1 - s)
    return state


def _store(state: DeviceState, slot: int, seq: list[int]) -> None:
    """``seq`` as the slot's history (all but its last token) and last token."""
    for pos, token in enumerate(seq[:-1]):
        block = int(state.block_table[slot, pos // BLOCK_SIZE])
        state.history[block, pos % BLOCK_SIZE] = token
    state.seq_len[slot] = len(seq) - 1
    state.last_token[slot] = seq[-1]


def _continue(rng: random.Random, seq: list[int], pred: list[int], aligned: int | None) -> list[int]:
    """A few more output tokens: mostly the prediction's continuation, sometimes an insertion,
    a deletion (a jump ahead) or a changed token."""
    n = rng.randint(1, K + 1)
    choice = rng.random()
    if aligned is None or choice < 0.2:
        return [rng.randrange(6) for _ in range(n)]
    start = aligned + 1 + (rng.randint(1, 6) if choice < 0.35 else 0)
    out = pred[start : start + n] or [rng.randrange(6)]
    if choice > 0.85:
        out[rng.randrange(len(out))] = rng.randrange(6)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_drafts_follow_the_reference_over_random_edits(seed):
    rng = random.Random(seed)
    state = _state()
    drafts = PredictionDrafts(NUM_SLOTS, K, torch.device("cpu"), MATCH_LEN, MIN_MATCH, NEAR)
    # A small vocabulary: runs of the prediction recur, so ties and re-synchronising happen.
    preds = [[rng.randrange(6) for _ in range(rng.randint(20, 90))] for _ in range(NUM_SLOTS)]
    prompts = [[rng.randrange(6) for _ in range(rng.randint(1, 12))] for _ in range(NUM_SLOTS)]
    seqs = [list(p) for p in prompts]
    anchors = [(-1, len(p)) for p in prompts]
    aligned: list[int | None] = [None] * NUM_SLOTS
    for slot in range(NUM_SLOTS):
        drafts.admit(slot, preds[slot], len(prompts[slot]))
    num_drafted = 0
    for _ in range(40):
        for slot in range(NUM_SLOTS):
            seqs[slot] += _continue(rng, seqs[slot], preds[slot], aligned[slot])
            _store(state, slot, seqs[slot])
        state.num_drafts.zero_()
        state.drafts.fill_(-1)
        rows = sorted(rng.sample(range(NUM_SLOTS), rng.randint(1, NUM_SLOTS)))
        drafts.propose(torch.tensor(rows, dtype=torch.int32), state, BLOCK_SIZE)
        for slot in rows:
            want, anchor, total, predicted = reference(seqs[slot], preds[slot], *anchors[slot])
            n = int(state.num_drafts[slot])
            assert state.drafts[slot, :n].tolist() == want
            assert bool(drafts.active[slot]) == (predicted and bool(want))
            anchors[slot] = (anchor, total)
            aligned[slot] = anchor if predicted and want else None
            num_drafted += n
    assert num_drafted > 100  # the walk really drafted


def test_a_row_without_a_match_keeps_the_proposers_drafts():
    state = _state()
    drafts = PredictionDrafts(NUM_SLOTS, K, torch.device("cpu"), MATCH_LEN, MIN_MATCH, NEAR)
    drafts.admit(0, [10, 11, 12, 13, 14, 15], 3)
    _store(state, 0, [1, 2, 3, 7])  # the output's first token is not the prediction's
    state.drafts[0, :2] = torch.tensor([42, 43])
    state.num_drafts[0] = 2
    drafts.propose(torch.tensor([0], dtype=torch.int32), state, BLOCK_SIZE)
    assert state.drafts[0, :2].tolist() == [42, 43] and int(state.num_drafts[0]) == 2
    assert not bool(drafts.active[0])
    # Once the output reaches the prediction, its drafts replace the proposer's.
    _store(state, 0, [1, 2, 3, 7, 10])
    drafts.propose(torch.tensor([0], dtype=torch.int32), state, BLOCK_SIZE)
    assert state.drafts[0, : int(state.num_drafts[0])].tolist() == [11, 12, 13, 14, 15]
    assert bool(drafts.active[0])


def test_an_unaligned_row_drafts_by_prompt_lookup_over_its_own_sequence():
    """Where the prediction gives nothing, the row's sequence does: the tokens after the
    latest earlier occurrence of its last tokens (the quoted file of an edit request)."""
    state = _state()
    drafts = PredictionDrafts(NUM_SLOTS, K, torch.device("cpu"), MATCH_LEN, MIN_MATCH, NEAR)
    drafts.admit(2, [30, 31, 32], 9)
    _store(state, 2, [1, 2, 3, 4, 5, 6, 9, 9, 9, 1, 2, 3])
    drafts.propose(torch.tensor([2], dtype=torch.int32), state, BLOCK_SIZE)
    assert state.drafts[2, : int(state.num_drafts[2])].tolist() == [4, 5, 6, 9, 9]
    assert not bool(drafts.active[2])


def test_a_longer_prediction_grows_the_buffer_and_a_new_request_clears_the_slot():
    drafts = PredictionDrafts(NUM_SLOTS, K, torch.device("cpu"))
    drafts.admit(1, list(range(300)), 5)
    assert drafts.tokens.shape[1] >= 300 and drafts.tokens[1, :300].tolist() == list(range(300))
    drafts.admit(1, [7, 8], 5)
    assert drafts.tokens[1, :3].tolist() == [7, 8, -1] and int(drafts.length[1]) == 2
    drafts.admit(1, [], 5)
    assert int(drafts.length[1]) == 0


def test_a_suffix_continuation_keeps_what_the_tokens_since_its_anchor_follow() -> None:
    """Suffix decoding (`replace`): a continuation anchored where the sequence is drafts from its
    start; one anchored a step behind drafts from after the tokens that step produced when they
    follow it, and by prompt lookup when they do not; its drafts are not the client's."""
    state = _state()
    drafts = PredictionDrafts(NUM_SLOTS, K, torch.device("cpu"), MATCH_LEN, MIN_MATCH, NEAR, dynamic=True)
    seq = [1, 2, 3, 4, 1, 2, 3, 9]
    continuation = [20, 21, 22, 23, 24, 25, 26, 27]
    cases = {
        0: (seq, len(seq), continuation[:K]),  # anchored at the current length
        1: (seq + [20, 21], len(seq), continuation[2 : 2 + K]),  # two tokens since, following it
        2: (seq + [1, 2, 3], len(seq), lookup(seq + [1, 2, 3])),  # left it: prompt lookup
    }
    for slot, (tokens, _, _) in cases.items():
        drafts.admit(slot, [], num_prompt_tokens=4)
        _store(state, slot, tokens)
    slots = list(cases)
    drafts.replace(slots, [continuation] * len(slots), [a for _, a, _ in cases.values()], state, BLOCK_SIZE)
    for slot, (_, _, want) in cases.items():
        assert state.drafts[slot, : int(state.num_drafts[slot])].tolist() == want, slot
    assert not drafts.drafted(torch.tensor(slots, dtype=torch.int32)).any()
