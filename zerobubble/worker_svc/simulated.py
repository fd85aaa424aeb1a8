"""A simulated accelerator (`--simulate-device-ms MS`): the worker's whole host path, no model.

The runner still decodes plans, admits rows, keeps slots and block tables, assembles inputs,
writes the token history pages, corrects sequence lengths, runs its proposer's bookkeeping and
builds results. What a GPU would compute is replaced by:

- **time**: each step occupies a simulated device for MS milliseconds on a timeline of its own.
  The step thread only "launches" the step (as with CUDA, it does not wait); the result copy
  waits in `time.sleep` until the step's end, which holds the GIL no longer than a CUDA event
  wait and uses no core. A step launched while the device is still busy queues behind it; the
  gap between the end of one step and the start of the next is the device's idle time, which
  the worker reports as its bubble (`idle_s`).
- **tokens**: a deterministic function of (seed, sequence), `next_tokens`. With probability
  `acceptance_rate` the token at position p repeats the token at p - `COPY_LAG` (text copied from
  earlier, as in code edits and quoting); otherwise it is a "fresh" token hashed from
  (seed, p, previous token). Greedy rows use seed 0, so greedy output depends on the prompt only
  and is identical sync or async, with or without speculation. Special tokens (EOS included)
  are never produced, so requests end at `max_tokens` or a stop string.
- **drafts**: `LagNgramProposer`, prompt lookup at the one offset where the token function
  repeats text: if the last `ngram_min` tokens equal those `COPY_LAG` positions earlier, the k
  tokens that followed them are proposed. Where the full lookup would find a match it finds the
  same one (barring chance repeats), in O(batch) instead of the O(tokens held) of the device
  kernel it stands for. Once a match exists, each draft is accepted with probability
  `acceptance_rate` given the previous one was, so a row with k = 3 drafts accepts
  `r + r^2 + r^3` of them on average.

The token function and the drafts are computed in numpy, on views of the runner's CPU tensors.
They stand for device work, which costs a GPU's host no more than a few launches; as torch ops
on small CPU tensors (about a hundred a step, several microseconds of dispatch each) they would
have charged a third of the worker's step logic to the host path that `bench_sim.py` measures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zerobubble.kernels.verify import count_accepted
from zerobubble.worker_svc.batch import StepBatch
from zerobubble.worker_svc.grammar import StepMasks
from zerobubble.worker_svc.result_copy import StepTiming
from zerobubble.worker_svc.slot_table import DeviceState
from zerobubble.worker_svc.step import Logits
from zerobubble.worker_svc.verification import StepOutputs, fed_drafts

logger = logging.getLogger(__name__)

COPY_LAG = 32
"""A copied token repeats the one this many positions earlier (more than any draft width)."""
_MASK32 = 0xFFFFFFFF


def _hash32(x: np.ndarray) -> np.ndarray:
    """A cheap avalanche of 32-bit words held in int64 (multiplier < 2**31: no overflow).

    The token function stands for device work, so it is kept to a few ops; it needs to be
    deterministic and well mixed, not the sampler's counter-based noise.
    """
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


@dataclass(slots=True)
class SimulatedEvent:
    """Stands for the CUDA event after a step's result copy: ready at the step's end."""

    done_at: float

    def synchronize(self) -> None:
        delay = self.done_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def history_tokens(state: DeviceState, block_size: int, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Tokens at ``positions`` (< the slot's written length) of the requests in ``slots``."""
    positions = np.maximum(positions, 0)
    blocks = state.block_table.numpy()[slots, positions // block_size].astype(np.int64)
    return state.history.numpy().reshape(-1)[blocks * block_size + positions % block_size].astype(np.int64)


class SimulatedDevice:
    """The simulated accelerator of one runner (a `StepDevice`): its timeline and its token function."""

    def __init__(
        self, device_ms: float, acceptance_rate: float, vocab_size: int, special_ids: list[int], max_draft_tokens: int
    ) -> None:
        if device_ms < 0:
            raise ValueError(f"--simulate-device-ms must be >= 0, got {device_ms}")
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"--simulate-acceptance-rate must be in [0, 1], got {acceptance_rate}")
        if max_draft_tokens + 2 > COPY_LAG:
            raise ValueError(f"a simulated device supports at most {COPY_LAG - 2} draft tokens")
        self.device_s = device_ms / 1000.0
        self.acceptance_rate = acceptance_rate
        self.allowed = np.ones(vocab_size, dtype=bool)
        self.allowed[[i for i in special_ids if 0 <= i < vocab_size]] = False
        self.allowed_ids = self.allowed.nonzero()[0]
        self.busy_until = 0.0
        self.live = False  # requests were live when the device finished its last step
        self.state: DeviceState | None = None  # the runner's, once bound
        self.block_size = 0

    def bind(self, state: DeviceState, block_size: int) -> None:
        """Attach to the runner's device state (the history pages the token function reads)."""
        self.state = state
        self.block_size = block_size

    def run_model(self, batch: StepBatch) -> Logits:
        """Nothing to compute ahead of the tokens: the token function stands for both."""
        return Logits(None)

    def sample(
        self, batch: StepBatch, logits: Logits, masks: StepMasks | None, prediction_drafts: torch.Tensor | None
    ) -> StepOutputs:
        """The token function's tokens, verified against the drafts fed as the target's are."""
        s = batch.sampled
        assert s is not None and self.state is not None
        draft_tokens, num_verified = fed_drafts(batch, self.state)
        tokens = s.spread(self.next_tokens(batch))
        if s.layout.width > 1:
            num_accepted = count_accepted(tokens, draft_tokens, num_verified)
        else:
            num_accepted = torch.zeros(len(s.rows), dtype=torch.int32)
        # The token function is certain of its tokens: log-probability 0.
        logprobs = torch.zeros(tokens.shape) if s.want_logprobs else None
        return StepOutputs(tokens, num_accepted, num_verified, logprobs)

    def timing(self, start: float, logits: Logits, grammar_s: float, live: bool) -> StepTiming:
        """The step occupies the device timeline for `device_s` after the one before it; the
        result copy waits for its end."""
        begin = max(time.perf_counter(), self.busy_until)
        idle_s = begin - self.busy_until if self.live else 0.0
        self.busy_until = begin + self.device_s
        self.live = live
        return StepTiming(self.device_s, idle_s=idle_s, grammar_s=grammar_s, ready=SimulatedEvent(self.busy_until))

    def interrupted(self) -> None:
        pass  # a cut step never reached the timeline

    def reset(self) -> None:
        self.live = False

    def next_tokens(self, batch: StepBatch) -> torch.Tensor:
        """The token after every sampled slot (``[G]`` int64), from the sequence up to it."""
        s = batch.sampled
        assert s is not None and self.state is not None
        positions = s.positions.numpy()  # absolute position of each new token
        previous = batch.input_ids.numpy()[s.layout.gather.numpy()].astype(np.int64)
        seeds = np.where(s.sampling.temperature.numpy() > 0, s.sampling.seeds.numpy(), 0)
        # The previous token keys the hash too: the function reads the sequence, not a counter.
        key = (seeds ^ (seeds >> 32)) & _MASK32
        h = _hash32(key ^ _hash32(positions & _MASK32 ^ _hash32(previous)))
        slots = np.repeat(s.slots.numpy().astype(np.int64), s.layout.num_cols.numpy())
        source = history_tokens(self.state, self.block_size, slots, positions - COPY_LAG)
        copy = (positions >= COPY_LAG) & ((h & 0xFFFF) < int(self.acceptance_rate * 65536))
        copy &= self.allowed[source]
        fresh = self.allowed_ids[((h >> 16) * len(self.allowed_ids)) >> 16]
        return torch.from_numpy(np.where(copy, source, fresh))


class LagNgramProposer:
    """N-gram drafts for the simulated device's token function (see the module docstring)."""

    method = "ngram"
    has_draft_probs = False
    num_lookahead_slots = 0  # proposals are read from history; nothing is written

    def __init__(self, num_spec_tokens: int, ngram_min: int) -> None:
        self.k = num_spec_tokens
        self.ngram_min = ngram_min
        self.state: DeviceState | None = None  # the runner's, once bound
        self.block_size = 0
        # Where `propose` reads the history, relative to the last token's position: the
        # suffix's n - 1 tokens before the last, the n tokens COPY_LAG earlier, and the k that
        # followed those.
        back = np.arange(ngram_min)
        self._offsets = np.concatenate([-back[1:], -back - COPY_LAG, np.arange(1, num_spec_tokens + 1) - COPY_LAG])

    def bind(self, runner: Any) -> None:
        self.state, self.block_size = runner.state, runner.config.block_size

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        pass  # all state lives in the runner's history pages

    def observe(self, batch: object, hidden: torch.Tensor) -> None:
        pass

    def propose(self, slots: torch.Tensor, batch: object = None) -> None:
        st = self.state
        assert st is not None
        idx = slots.numpy().astype(np.int64)
        last_pos = st.seq_len.numpy()[idx].astype(np.int64)  # position of the last sampled token
        last = st.last_token.numpy()[idx].astype(np.int64)
        n, k, offsets = self.ngram_min, self.k, self._offsets
        # Everything read from the history in one gather (it stands for one device kernel).
        pos = last_pos[:, None] + offsets[None, :]
        tokens = history_tokens(st, self.block_size, np.repeat(idx, len(offsets)), pos.reshape(-1))
        tokens = tokens.reshape(len(idx), len(offsets))
        suffix = np.concatenate([last[:, None], tokens[:, : n - 1]], axis=1)  # at last_pos - i, i < n
        match = (last_pos >= COPY_LAG + n - 1) & (suffix == tokens[:, n - 1 : 2 * n - 1]).all(axis=1)
        # The state tensors live on the CPU here: their numpy views write through.
        st.drafts.numpy()[idx, :k] = tokens[:, 2 * n - 1 :]
        st.num_drafts.numpy()[idx] = np.where(match, k, 0)

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        raise NotImplementedError("n-gram drafts have no distribution")
