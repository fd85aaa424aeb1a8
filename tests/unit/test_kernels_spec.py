"""Speculative-decoding kernels: torch references vs plain-Python oracles, Triton (interpreted on
CPU) vs the references, and the "no placeholder id reaches the model" guarantees."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from zerobubble.kernels._triton import HAS_TRITON  # noqa: E402
from zerobubble.kernels.inputs import assemble_inputs  # noqa: E402
from zerobubble.kernels.keyed_random import keyed_uniform  # noqa: E402
from zerobubble.kernels.ngram import ngram_propose  # noqa: E402
from zerobubble.kernels.seq_lens import update_state  # noqa: E402
from zerobubble.kernels.verify import count_accepted, rejection_sample  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

BLOCK_SIZE = 4
MAX_BLOCKS = 6
MAX_DRAFTS = 3
VOCAB = 5  # small, so n-grams repeat and drafts often match


@dataclass(slots=True)
class WorkerState:
    """A random worker device state as described in docs/INTERNALS.md."""

    seq_len: torch.Tensor  # [S] int32
    last_token: torch.Tensor  # [S] int32
    drafts: torch.Tensor  # [S, K] int32, -1 beyond num_drafts
    num_drafts: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, M] int32, -1 padded
    history: torch.Tensor  # [NB, BS] int32

    def clone(self) -> WorkerState:
        return WorkerState(
            *(
                t.clone()
                for t in (self.seq_len, self.last_token, self.drafts, self.num_drafts, self.block_table, self.history)
            )
        )


@dataclass(slots=True)
class Step:
    """The per-row inputs of one step over a `WorkerState`."""

    req_slots: torch.Tensor  # [R] int32
    query_start_loc: torch.Tensor  # [R+1] int32
    is_decode: torch.Tensor  # [R] bool
    prefill_ids: torch.Tensor  # [T] int32 (garbage on decode rows)


def random_state(gen: torch.Generator, num_slots: int = 7) -> WorkerState:
    capacity = MAX_BLOCKS * BLOCK_SIZE
    num_blocks = num_slots * MAX_BLOCKS + 5
    seq_len = torch.randint(0, capacity - 2 * (1 + MAX_DRAFTS), (num_slots,), generator=gen)
    # Distinct physical blocks in shuffled order; entries past what a request needs are -1.
    block_table = torch.randperm(num_blocks, generator=gen)[: num_slots * MAX_BLOCKS]
    block_table = block_table.view(num_slots, MAX_BLOCKS).clone()
    needed = (seq_len + 2 * (1 + MAX_DRAFTS)) // BLOCK_SIZE + 1
    block_table[torch.arange(MAX_BLOCKS)[None, :] >= needed[:, None]] = -1
    num_drafts = torch.randint(0, MAX_DRAFTS + 1, (num_slots,), generator=gen)
    drafts = torch.randint(0, VOCAB, (num_slots, MAX_DRAFTS), generator=gen)
    drafts[torch.arange(MAX_DRAFTS)[None, :] >= num_drafts[:, None]] = -1
    return WorkerState(
        seq_len=seq_len.int(),
        last_token=torch.randint(0, VOCAB, (num_slots,), generator=gen).int(),
        drafts=drafts.int(),
        num_drafts=num_drafts.int(),
        block_table=block_table.int(),
        history=torch.randint(0, VOCAB, (num_blocks, BLOCK_SIZE), generator=gen).int(),
    )


def random_step(gen: torch.Generator, state: WorkerState, num_rows: int = 5) -> Step:
    num_slots = state.seq_len.shape[0]
    slots = torch.randperm(num_slots, generator=gen)[:num_rows]
    is_decode = torch.rand(num_rows, generator=gen) < 0.6
    q_lens = torch.where(
        is_decode,
        1 + torch.randint(0, MAX_DRAFTS + 1, (num_rows,), generator=gen),
        torch.randint(1, 1 + MAX_DRAFTS + 3, (num_rows,), generator=gen),
    )
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    num_tokens = int(qsl[-1])
    return Step(slots.int(), qsl, is_decode, torch.randint(0, VOCAB, (num_tokens,), generator=gen).int())


def sequence_of(state: WorkerState, slot: int) -> list[int]:
    """history[0:seq_len] ++ [last_token] read through the block table, one token at a time."""
    tokens = []
    for i in range(int(state.seq_len[slot])):
        block = int(state.block_table[slot, i // BLOCK_SIZE])
        tokens.append(int(state.history[block, i % BLOCK_SIZE]))
    return tokens + [int(state.last_token[slot])]


def run_assemble(state: WorkerState, step: Step, impl: str | None) -> tuple[torch.Tensor, ...]:
    return assemble_inputs(
        step.req_slots,
        step.query_start_loc,
        step.is_decode,
        step.prefill_ids,
        state.seq_len,
        state.last_token,
        state.drafts,
        state.num_drafts,
        state.block_table,
        state.history,
        BLOCK_SIZE,
        impl=impl,
    )


# -- keyed randomness --------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("stream", [0, 1, 2, 3])
def test_keyed_uniform_triton_is_bit_identical(stream: int) -> None:
    gen = torch.Generator().manual_seed(stream)
    seeds = torch.randint(-(2**63), 2**63 - 1, (6,), generator=gen)
    positions = torch.randint(0, 2**40, (6,), generator=gen)
    ref = keyed_uniform(seeds, positions, 1500, stream, impl="torch")
    assert torch.equal(keyed_uniform(seeds, positions, 1500, stream, impl="triton"), ref)


def test_keyed_uniform_is_a_pure_function_of_its_key() -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**63), 2**63 - 1, (64,), generator=gen)
    positions = torch.randint(0, 2**20, (64,), generator=gen)
    u = keyed_uniform(seeds, positions, 300)
    assert u.dtype == torch.float32 and u.shape == (64, 300)
    assert bool((u > 0).all()) and bool((u < 1).all())
    # Independent of batch slot and batch composition, and of the vocabulary size asked for.
    perm = torch.randperm(64, generator=gen)
    assert torch.equal(keyed_uniform(seeds[perm], positions[perm], 300), u[perm])
    assert torch.equal(keyed_uniform(seeds[:3], positions[:3], 50), u[:3, :50])
    # Every key component matters.
    assert not torch.equal(keyed_uniform(seeds, positions, 300, stream=1), u)
    assert not torch.equal(keyed_uniform(seeds, positions + 1, 300), u)
    assert not torch.equal(keyed_uniform(seeds ^ (1 << 40), positions, 300), u)
    assert len(set(u.flatten().tolist())) > 0.99 * u.numel()
    # Roughly uniform: mean and the fraction below 1/4.
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert abs(float((u < 0.25).float().mean()) - 0.25) < 0.01


# -- assemble_inputs ---------------------------------------------------------------------------


def assemble_oracle(state: WorkerState, step: Step) -> tuple[list[int], list[int], list[int]]:
    ids, positions, slots = [], [], []
    qsl = step.query_start_loc.tolist()
    for r, s in enumerate(step.req_slots.tolist()):
        for j in range(qsl[r + 1] - qsl[r]):
            t = qsl[r] + j
            pos = int(state.seq_len[s]) + j
            if not bool(step.is_decode[r]):
                tok = int(step.prefill_ids[t])
            elif j == 0 or j - 1 >= int(state.num_drafts[s]):
                tok = int(state.last_token[s])
            else:
                tok = int(state.drafts[s, j - 1])
            ids.append(tok)
            positions.append(pos)
            slots.append(int(state.block_table[s, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    return ids, positions, slots


@pytest.mark.parametrize("seed", range(4))
def test_assemble_inputs_reference_matches_oracle(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    state = random_state(gen)
    step = random_step(gen, state)
    ids, positions, slots = assemble_oracle(state, step)
    after = state.clone()
    out = run_assemble(after, step, impl="torch")
    assert [t.dtype for t in out] == [torch.int64] * 3
    assert out[0].tolist() == ids and out[1].tolist() == positions and out[2].tolist() == slots
    assert -1 not in ids
    expected_history = state.history.clone()
    expected_history.view(-1)[torch.tensor(slots)] = torch.tensor(ids, dtype=torch.int32)
    assert torch.equal(after.history, expected_history)


@needs_triton
@pytest.mark.parametrize("seed", range(3))
def test_assemble_inputs_triton_matches_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    state = random_state(gen)
    step = random_step(gen, state)
    ref_state, tri_state = state.clone(), state.clone()
    ref = run_assemble(ref_state, step, impl="torch")
    tri = run_assemble(tri_state, step, impl="triton")
    for a, b in zip(ref, tri):
        assert torch.equal(a, b)
    assert torch.equal(ref_state.history, tri_state.history)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_decode_rows_never_feed_invalid_drafts(impl: str) -> None:
    """New/resumed/skipped requests have num_drafts = 0: whatever `drafts` holds (-1 or stale
    ids), the model sees only last_token; drafts beyond num_drafts are never used either."""
    gen = torch.Generator().manual_seed(7)
    state = random_state(gen)
    state.num_drafts[:] = torch.tensor([0, 0, 1, 2, 0, 3, 0], dtype=torch.int32)
    step = Step(
        torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.int32),
        torch.tensor([0, 4, 5, 9, 11, 15, 16, 20], dtype=torch.int32),
        torch.ones(7, dtype=torch.bool),
        torch.zeros(20, dtype=torch.int32),
    )
    expected = []
    for s, n in enumerate([4, 1, 4, 2, 4, 1, 4]):
        valid = min(n - 1, int(state.num_drafts[s]))
        real = state.drafts[s, :valid].tolist()
        expected += [int(state.last_token[s])] + real + [int(state.last_token[s])] * (n - 1 - valid)
    outputs = []
    for garbage in (-1, 123456):
        trial = state.clone()
        # Everything outside the valid prefix is garbage.
        trial.drafts[torch.arange(MAX_DRAFTS)[None, :] >= trial.num_drafts[:, None]] = garbage
        outputs.append(run_assemble(trial, step, impl=impl)[0])
    assert outputs[0].tolist() == expected
    assert torch.equal(outputs[0], outputs[1])


# -- update_state ------------------------------------------------------------------------------


def update_args(gen: torch.Generator, state: WorkerState, step: Step) -> tuple[torch.Tensor, ...]:
    num_rows = step.req_slots.shape[0]
    num_scheduled = (step.query_start_loc[1:] - step.query_start_loc[:-1]).int()
    num_accepted = torch.minimum(torch.randint(0, MAX_DRAFTS + 1, (num_rows,), generator=gen), num_scheduled - 1).int()
    do_sample = step.is_decode | (torch.rand(num_rows, generator=gen) < 0.5)
    sampled_last = torch.randint(0, VOCAB, (num_rows,), generator=gen).int()
    return step.req_slots, step.is_decode, num_scheduled, num_accepted, do_sample, sampled_last


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_update_state_matches_oracle(impl: str) -> None:
    gen = torch.Generator().manual_seed(3)
    state = random_state(gen)
    step = random_step(gen, state)
    args = update_args(gen, state, step)
    expected = state.clone()
    for r, s in enumerate(step.req_slots.tolist()):
        if bool(args[1][r]):
            expected.seq_len[s] += 1 + args[3][r]
        else:
            expected.seq_len[s] += args[2][r]
        if bool(args[4][r]):
            expected.last_token[s] = args[5][r]
        expected.num_drafts[s] = 0
    update_state(*args, state.seq_len, state.last_token, state.num_drafts, impl=impl)
    assert torch.equal(state.seq_len, expected.seq_len)
    assert torch.equal(state.last_token, expected.last_token)
    assert torch.equal(state.num_drafts, expected.num_drafts)


# -- ngram_propose -----------------------------------------------------------------------------


def ngram_oracle(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    length = len(seq)
    for n in range(max_n, min_n - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if seq[start : start + n] == seq[length - n :]:
                return seq[start + n : min(start + n + k, length)]
    return []


def state_from_sequences(sequences: list[list[int]], gen: torch.Generator) -> WorkerState:
    """A state whose slot i holds sequences[i] (the last element becomes last_token)."""
    num_slots = len(sequences)
    max_blocks = max(len(s) for s in sequences) // BLOCK_SIZE + 1
    num_blocks = num_slots * max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=gen)[: num_slots * max_blocks]
    block_table = block_table.view(num_slots, max_blocks).int()
    # Only blocks holding history are allocated (the last token's block may be -1 padding).
    held = torch.tensor([len(s) - 1 for s in sequences])
    needed = (held + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_table[torch.arange(max_blocks)[None, :] >= needed[:, None]] = -1
    history = torch.full((num_blocks, BLOCK_SIZE), -7, dtype=torch.int32)
    for s, seq in enumerate(sequences):
        for i, tok in enumerate(seq[:-1]):
            history[block_table[s, i // BLOCK_SIZE], i % BLOCK_SIZE] = tok
    return WorkerState(
        seq_len=torch.tensor([len(s) - 1 for s in sequences], dtype=torch.int32),
        last_token=torch.tensor([s[-1] for s in sequences], dtype=torch.int32),
        drafts=torch.zeros((num_slots, MAX_DRAFTS), dtype=torch.int32),
        num_drafts=torch.zeros(num_slots, dtype=torch.int32),
        block_table=block_table,
        history=history,
    )


def run_ngram(state: WorkerState, slots: list[int], min_n: int, max_n: int, k: int, impl: str) -> list[list[int]]:
    drafts, num = ngram_propose(
        torch.tensor(slots, dtype=torch.int32),
        state.seq_len,
        state.last_token,
        state.block_table,
        state.history,
        BLOCK_SIZE,
        min_n,
        max_n,
        k,
        impl=impl,
    )
    assert drafts.shape == (len(slots), k) and drafts.dtype == torch.int32
    assert bool((drafts[torch.arange(k)[None, :] >= num[:, None]] == -1).all())
    return [drafts[r, : int(num[r])].tolist() for r in range(len(slots))]


# (sequence, min_n, max_n, k, expected drafts)
NGRAM_CASES = [
    ([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 1, 3, 2, [8, 1]),  # most recent occurrence wins
    ([5, 6, 7, 1, 7, 0, 6, 7], 1, 3, 3, [1, 7, 0]),  # longest n (2: "6 7") beats later "7"
    ([4, 4, 4, 4], 1, 2, 3, [4]),  # overlapping match; may not run past the end
    ([1, 2, 3, 4], 1, 3, 3, []),  # no match
    ([3], 1, 2, 2, []),  # a single token cannot match itself
    ([2, 2], 1, 1, 4, [2]),
    ([1, 2, 1, 2], 3, 3, 2, []),  # "2 1 2" never occurred before: min_n = 3 finds nothing
    ([7, 1, 2, 7, 3, 1, 2], 2, 4, 5, [7, 3, 1, 2]),
    ([9, 8, 9, 8, 9], 2, 2, 3, [8, 9]),  # history fills whole blocks; last token in none
]


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton), "cpp"])
def test_ngram_hand_cases(impl: str, request: pytest.FixtureRequest) -> None:
    if impl == "cpp":
        request.getfixturevalue("cpu_kernels")
    gen = torch.Generator().manual_seed(0)
    sequences = [case[0] for case in NGRAM_CASES]
    state = state_from_sequences(sequences, gen)
    for s, (seq, min_n, max_n, k, expected) in enumerate(NGRAM_CASES):
        assert ngram_oracle(seq, min_n, max_n, k) == expected
        assert run_ngram(state, [s], min_n, max_n, k, impl) == [expected], seq


@pytest.mark.parametrize("seed", range(3))
def test_ngram_reference_matches_oracle(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    state = random_state(gen, num_slots=12)
    slots = torch.randperm(12, generator=gen)[:9].tolist()
    for min_n, max_n, k in [(1, 3, 3), (2, 4, 2), (1, 1, 5)]:
        expected = [ngram_oracle(sequence_of(state, s), min_n, max_n, k) for s in slots]
        assert run_ngram(state, slots, min_n, max_n, k, "torch") == expected


@needs_triton
def test_ngram_triton_matches_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    state = random_state(gen, num_slots=8)
    slots = torch.randperm(8, generator=gen)[:6].tolist()
    for min_n, max_n, k in [(1, 3, 3), (2, 2, 4)]:
        assert run_ngram(state, slots, min_n, max_n, k, "triton") == run_ngram(state, slots, min_n, max_n, k, "torch")


def test_ngram_compiled_matches_twin(cpu_kernels: None) -> None:
    """The compiled CPU kernel against the torch twin (and the oracle): random states, and long
    sequences over a few tokens, where many ends match and the longest, latest one must win."""
    gen = torch.Generator().manual_seed(5)
    state = random_state(gen, num_slots=12)
    slots = torch.randperm(12, generator=gen)[:9].tolist()
    for min_n, max_n, k in [(1, 3, 3), (2, 4, 2), (1, 1, 5), (3, 4, 4)]:
        assert run_ngram(state, slots, min_n, max_n, k, "cpp") == run_ngram(state, slots, min_n, max_n, k, "torch")
    sequences = [torch.randint(0, vocab, (n,), generator=gen).tolist() for vocab, n in ((3, 300), (5, 180), (40, 90))]
    sequences += [[7] * 50, [1, 2] * 40 + [3]]
    state = state_from_sequences(sequences, gen)
    rows = list(range(len(sequences)))
    for min_n, max_n, k in [(1, 4, 3), (2, 4, 8), (4, 6, 2)]:
        compiled = run_ngram(state, rows, min_n, max_n, k, "cpp")
        assert compiled == run_ngram(state, rows, min_n, max_n, k, "torch")
        assert compiled == [ngram_oracle(seq, min_n, max_n, k) for seq in sequences]
    assert run_ngram(state, [], 1, 4, 3, "cpp") == []


# -- count_accepted and rejection_sample -------------------------------------------------------


def random_verify_inputs(gen: torch.Generator, num_rows: int = 9, vocab: int = 3) -> tuple:
    targets = torch.randint(0, vocab, (num_rows, MAX_DRAFTS + 1), generator=gen)
    drafts = torch.randint(0, vocab, (num_rows, MAX_DRAFTS), generator=gen)
    num_drafts = torch.randint(0, MAX_DRAFTS + 1, (num_rows,), generator=gen).int()
    drafts[torch.arange(MAX_DRAFTS)[None, :] >= num_drafts[:, None]] = -1
    return targets, drafts, num_drafts


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_count_accepted_matches_oracle(impl: str) -> None:
    gen = torch.Generator().manual_seed(5)
    targets, drafts, num_drafts = random_verify_inputs(gen, num_rows=40)
    expected = []
    for r in range(40):
        a = 0
        while a < int(num_drafts[r]) and int(drafts[r, a]) == int(targets[r, a]):
            a += 1
        expected.append(a)
    out = count_accepted(targets, drafts, num_drafts, impl=impl)
    assert out.dtype == torch.int32 and out.tolist() == expected


@needs_triton
def test_rejection_sample_triton_matches_reference() -> None:
    gen = torch.Generator().manual_seed(9)
    num_rows, vocab = 12, 37
    target = torch.randn(num_rows, MAX_DRAFTS + 1, vocab, generator=gen).softmax(-1)
    draft = torch.randn(num_rows, MAX_DRAFTS, vocab, generator=gen).softmax(-1)
    # Rows 0-1: identical p and q (everything accepted); row 2: no residual mass at all.
    draft[:2] = target[:2, :MAX_DRAFTS]
    target[2, 0] = 0.0
    target[2, 0, 5] = 1.0
    draft[2, 0] = target[2, 0]
    draft[2, 0, 6] = 1.0  # q >= p everywhere at position 0
    tokens = torch.multinomial(draft.view(-1, vocab), 1, generator=gen).view(num_rows, MAX_DRAFTS)
    tokens[2, 0] = 6
    num_drafts = torch.randint(0, MAX_DRAFTS + 1, (num_rows,), generator=gen).int()
    num_drafts[:3] = MAX_DRAFTS
    tokens[torch.arange(MAX_DRAFTS)[None, :] >= num_drafts[:, None]] = -1
    seeds = torch.randint(0, 2**62, (num_rows,), generator=gen)
    positions = torch.randint(0, 4000, (num_rows,), generator=gen)
    ref = rejection_sample(target, draft, tokens, num_drafts, seeds, positions, impl="torch")
    tri = rejection_sample(target, draft, tokens, num_drafts, seeds, positions, impl="triton")
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    assert ref[1][:2].tolist() == [MAX_DRAFTS, MAX_DRAFTS]
    assert ref[1][2] == 0 and ref[0][2, 0] == 5
    # Keys as the runner passes them: one column of a [R, K+1] spread, a strided view.
    spread_seeds = seeds[:, None].expand(num_rows, MAX_DRAFTS + 1).contiguous()[:, 0]
    spread_positions = positions[:, None].expand(num_rows, MAX_DRAFTS + 1).contiguous()[:, 0]
    assert not spread_seeds.is_contiguous()
    strided = rejection_sample(target, draft, tokens, num_drafts, spread_seeds, spread_positions, impl="triton")
    assert torch.equal(strided[0], ref[0]) and torch.equal(strided[1], ref[1])
