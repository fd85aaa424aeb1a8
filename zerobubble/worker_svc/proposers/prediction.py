"""Drafts from a request's predicted output (OpenAI's Predicted Outputs).

A client that expects its reply to repeat a known text (the file being edited, the document
being revised) sends it as `prediction`; its tokens become that request's drafts, beside (and
before) whatever the worker's proposer drafts. Verification is unchanged, so the output is
exactly what it is without the prediction.

Per state slot the device keeps the prediction's tokens and an *anchor*: the prediction index
the sequence's last token was aligned with when drafts were last made, and the sequence length
then. After a step the row has grown by ``g`` tokens; if the output followed the prediction,
its last token now sits at ``anchor + g`` (a *continuation*, checked by that one token). If not,
the proposer re-synchronises: the longest run (up to ``match_len``) of the sequence's last
tokens found in the prediction, at least ``min_match`` long (one token within ``near`` after
the anchor), preferring the first such place after the anchor, so that an edit in the middle
of a file costs a few steps, not the rest of the file. The drafts are the prediction's tokens
after the aligned position; a row not aligned drafts by prompt lookup over its own sequence
(an edit request quotes what it edits), with the same budget.

With suffix decoding (``dynamic``) every slot has a prediction: the client's, or else the
continuations the scheduler sends in plans (`replace`), each anchored at the sequence length it
was computed from, one step or more behind the device; the same alignment keeps the part of it
the tokens produced since still follow. Only the client's count as prediction drafts in
results (`drafted`); a continuation's are the proposer's.

Everything runs as whole-batch tensor operations with static shapes and no host read, so it
fits an accelerator step as the n-gram proposer does (`kernels/ngram.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from zerobubble.kernels._triton import KernelImpl
from zerobubble.kernels.ngram import ngram_propose
from zerobubble.worker_svc import staging
from zerobubble.worker_svc.slot_table import DeviceState

# The prediction buffer's first width (tokens); it doubles when a longer prediction arrives.
_MIN_WIDTH = 64


class PredictionDrafts:
    """Every state slot's predicted output on the device, and the drafts made from it."""

    def __init__(
        self,
        num_slots: int,
        max_drafts: int,
        device: torch.device,
        match_len: int = 8,
        min_match: int = 2,
        near: int = 16,
        dynamic: bool = False,
        kernels: KernelImpl = None,
    ) -> None:
        """``max_drafts``: the most drafts a row gets (the scheduler plans at most that many
        slots); ``match_len``: the longest run of tokens compared when re-synchronising;
        ``min_match``: the shortest run that re-synchronises, except within ``near`` tokens
        after the previous alignment, where one token does; ``dynamic``: every slot drafts from
        its buffer, which the scheduler's continuations fill where the client gave none;
        ``kernels``: the prompt lookup's implementation (the model's: "cpp" where the compiled
        CPU kernels serve it)."""
        self.max_drafts = max_drafts
        self.kernels = kernels
        self.dynamic = dynamic
        self.match_len = match_len
        self.min_match = min_match
        self.near = near
        self.device = device
        i32, i64 = torch.int32, torch.int64
        self.tokens = torch.full((num_slots, _MIN_WIDTH), -1, dtype=i32, device=device)
        self.length = torch.zeros(num_slots, dtype=i64, device=device)
        self.anchor = torch.full((num_slots,), -1, dtype=i64, device=device)
        self.anchor_total = torch.zeros(num_slots, dtype=i64, device=device)
        # The slot's current drafts came from its prediction (what a result reports per row).
        self.active = torch.zeros(num_slots, dtype=torch.bool, device=device)
        # The slot's buffer holds the client's prediction (not a suffix continuation).
        self.client = torch.zeros(num_slots, dtype=torch.bool, device=device)

    def admit(self, slot: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """A request (new or resumed) takes ``slot``, with its prediction (empty: none).

        Its first output token is expected at prediction index 0: the anchor is index -1 at the
        prompt's length. A resumed request keeps that guess, checked by the continuation test.
        """
        n = len(token_ids)
        self._fit(n)
        row = self.tokens[slot]
        row.fill_(-1)
        if n:
            staging.write(row[:n], token_ids)
        # Filled in place: `t[i] = number` is a blocking copy of a host scalar on CUDA.
        self.length[slot].fill_(n)
        self.anchor[slot].fill_(-1)
        self.anchor_total[slot].fill_(num_prompt_tokens)
        self.active[slot].fill_(False)
        self.client[slot].fill_(n > 0)

    def _fit(self, n: int) -> None:
        """Widen the buffer (to a power of two) if it holds fewer than ``n`` tokens a slot."""
        if n > self.tokens.shape[1]:
            width = max(_MIN_WIDTH, 1 << (n - 1).bit_length())
            grown = torch.full((self.tokens.shape[0], width), -1, dtype=torch.int32, device=self.device)
            grown[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = grown

    def replace(
        self,
        slots: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        anchors: Sequence[int],
        state: DeviceState,
        block_size: int,
    ) -> None:
        """New continuations for ``slots`` (suffix decoding): slot i's tokens after its first
        ``anchors[i]`` are expected to be ``token_ids[i]``. Their drafts are made again at once,
        aligned with where each sequence is now, so the step about to run feeds them. Staged
        uploads only: nothing is read back."""
        width = max(len(t) for t in token_ids)
        self._fit(width)
        rows = np.full((len(slots), self.tokens.shape[1]), -1, dtype=np.int32)
        for i, tokens in enumerate(token_ids):
            rows[i, : len(tokens)] = tokens
        dev = self.device
        idx = staging.to_device(list(slots), torch.long, dev)
        self.tokens[idx] = staging.to_device(rows.reshape(-1), torch.int32, dev).view(rows.shape)
        self.length[idx] = staging.to_device([len(t) for t in token_ids], torch.int64, dev)
        # Index -1 at the anchor: the token after the anchor is expected at index 0. (A scalar
        # goes into the kernel: `t[idx] = number` would copy it from pageable host memory.)
        self.anchor.index_fill_(0, idx, -1)
        self.anchor_total[idx] = staging.to_device(list(anchors), torch.int64, dev)
        self.active.index_fill_(0, idx, False)
        self.propose(idx.to(torch.int32), state, block_size)

    def drafted(self, slots: torch.Tensor) -> torch.Tensor:
        """``[S]`` bool: whether each slot's current drafts came from its client's prediction (a copy)."""
        idx = slots.long()
        return self.active[idx] & self.client[idx]

    def propose(self, slots: torch.Tensor, state: DeviceState, block_size: int) -> None:
        """Drafts for ``slots`` (rows that just sampled and have a prediction): the
        prediction's where it is aligned with the output, else the longest earlier match of
        the output's last tokens in the row's own sequence (prompt lookup, which finds the text
        an edit request quotes), else the proposer's as they are."""
        idx = slots.long()
        k = self.max_drafts
        aligned, found, total = self._align(idx, state, block_size)
        length = self.length[idx]
        num = torch.where(found, (length - 1 - aligned).clamp(0, k), 0)
        cols = torch.arange(k, device=idx.device)
        src = (aligned[:, None] + 1 + cols[None, :]).clamp(max=self.tokens.shape[1] - 1)
        from_prediction = torch.where(cols[None, :] < num[:, None], self.tokens[idx].gather(1, src), -1)
        lookup, num_lookup = ngram_propose(
            slots, state.seq_len, state.last_token, state.block_table, state.history, block_size, 2, 4, k,
            self.kernels,
        )  # fmt: skip
        use = num > 0
        fallback = ~use & (num_lookup > 0)
        drafts = torch.where(use[:, None], from_prediction, lookup)
        take = use | fallback
        state.drafts[idx, :k] = torch.where(take[:, None], drafts.to(torch.int32), state.drafts[idx, :k])
        state.num_drafts[idx] = torch.where(
            use, num.to(torch.int32), torch.where(fallback, num_lookup, state.num_drafts[idx])
        )
        self.active[idx] = use
        self.anchor[idx] = torch.where(found, aligned, self.anchor[idx])
        self.anchor_total[idx] = torch.where(found, total, self.anchor_total[idx])

    def _align(self, idx: torch.Tensor, state: DeviceState, block_size: int) -> tuple[torch.Tensor, ...]:
        """Each row's prediction index aligned with its last token, whether one was found, and
        the row's sequence length."""
        pred = self.tokens[idx].long()  # [R, P]
        width = pred.shape[1]
        length = self.length[idx]
        anchor = self.anchor[idx]
        total = state.seq_len[idx].long() + 1  # the sequence: its history and its last token
        suffix = _suffix_lengths(pred, _sequence_tail(state, idx, total, self.match_len, block_size))
        ends = torch.arange(width, device=pred.device)[None, :]
        # A continuation: the output's last token is the prediction's at the expected index
        # (-1: the sequence has not grown since a suffix continuation was anchored at it).
        expected = anchor + (total - self.anchor_total[idx])
        at_expected = suffix.gather(1, expected.clamp(0, width - 1)[:, None])[:, 0]
        follows = ((expected >= 0) & (expected < length - 1) & (at_expected >= 1)) | (expected == -1)
        # Re-synchronising: one token in common is enough just after the anchor, where the
        # output resumes after a short edit; elsewhere `min_match`. The longest run wins, then
        # the first place after the anchor, then the first place.
        after = ends > anchor[:, None]
        near = after & (ends <= anchor[:, None] + self.near)
        eligible = ((suffix >= self.min_match) | (near & (suffix >= 1))) & (ends < length[:, None] - 1)
        key = suffix * (2 * width) + after * width + (width - 1 - ends)
        best_key, best_end = torch.where(eligible, key, -1).max(dim=1)
        aligned = torch.where(follows, expected, best_end)
        return aligned, follows | (best_key >= 0), total


def _sequence_tail(state: DeviceState, idx: torch.Tensor, total: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """``[R, n]`` the last ``n`` tokens of each row's sequence (its history pages, then its last
    sampled token), -2 before the sequence's start (it matches no prediction token)."""
    pos = total[:, None] - n + torch.arange(n, device=idx.device)[None, :]
    held = state.seq_len[idx].long()[:, None]
    in_history = (pos >= 0) & (pos < held)
    table = state.block_table[idx]
    col = (pos.clamp(min=0) // block_size).clamp(max=table.shape[1] - 1)
    block = torch.where(in_history, table.gather(1, col).long(), 0)
    from_history = state.history.view(-1)[block * block_size + pos.clamp(min=0) % block_size].long()
    last = state.last_token[idx].long()[:, None].expand(-1, n)
    return torch.where(pos == held, last, torch.where(in_history, from_history, -2))


def _suffix_lengths(pred: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """``[R, P]``: for each prediction index e, how many of the sequence's last tokens (up to
    ``tail``'s width) equal the prediction's tokens ending at e, in order."""
    n = tail.shape[1]
    running = torch.ones_like(pred, dtype=torch.bool)
    suffix = torch.zeros_like(pred)
    for j in range(n):
        earlier = pred if j == 0 else torch.nn.functional.pad(pred[:, :-j], (j, 0), value=-1)
        running &= earlier == tail[:, n - 1 - j, None]
        suffix += running
    return suffix
