"""Structured output on the worker: a grammar matcher per constrained request, advanced with
the request's real tokens, and the token masks of each step's sampled slots.

The worker holds every real token one step before the scheduler hears of it, so the grammar
lives here: no step waits on a network round trip for a mask. A step's masks are filled on the
host after its forward was launched (on an accelerator the forward runs meanwhile); only its
sampling waits for them. For each constrained row the mask of slot 0 follows the tokens of
every earlier step; each draft the grammar allows is consumed tentatively to fill the mask of
the next slot, and the first draft it forbids ends the row's verified drafts there (the result
reports the shorter count, so the scheduler reconciles exactly what was verified). The
tentative drafts are rolled back; the tokens the step really emits advance the matcher when
the next step that samples the request needs it (`RequestGrammar.catch_up`).

Grammars arrive as llguidance grammar text (`SamplingParams.grammar`, compiled from the
client's constraint by the scheduler, `zerobubble.structured`). Each distinct text is compiled
once, on a thread of its own when the plan that brings it is read, never on the step thread;
a request's matcher is a copy of the compiled one.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerobubble.api import worker_pb2
from zerobubble.kernels.token_mask import BITS, apply_token_bitmask, forbidden_bias
from zerobubble.request_options import SamplingOptions
from zerobubble.worker_svc import staging

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestGrammar:
    """One constrained request's matcher and what it has not consumed yet."""

    matcher: Any  # llguidance.LLMatcher
    num_prompt_tokens: int
    num_seen: int  # prompt + output tokens fed through prefill chunks (host count)
    sampled: bool = False  # a token has been sampled since admission
    # The step result whose emitted tokens the matcher has not consumed: (result, sampled row).
    pending: tuple[Any, int] | None = None
    error: str = ""  # the matcher refused a real token: the request ends with this error

    def catch_up(self) -> None:
        """Consume the tokens of the last step that sampled this request (waiting for its
        host copy, which was started before any later step was launched)."""
        if self.pending is None:
            return
        result, row = self.pending
        self.pending = None
        if result.ready is not None:
            result.ready.synchronize()
        outputs = result.outputs
        num_emitted = int(outputs.num_accepted[row]) + 1
        self.consume(outputs.tokens[row, :num_emitted].tolist())

    def consume(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_stopped():
                return  # the grammar ended: tokens past its end (EOS ignored) change nothing
            if not self.matcher.consume_token(token):
                # Only a bug or a parser limit gets here (every sampled token was masked).
                self.error = f"the grammar refused token {token}: {self.matcher.get_error()}"
                logger.error("%s", self.error)
                return


@dataclass(slots=True)
class GrammarInputs:
    """What a step's masks need from the device, copied to the host before the forward: each
    constrained row's fed drafts and how many of them are real."""

    rows: list[int]  # indices into the step's sampled rows
    grammars: list[RequestGrammar]
    drafts: torch.Tensor  # [C, K] host
    num_real: torch.Tensor  # [C] host
    ready: Any = None  # a CUDA event after the copy; None when already on the host


@dataclass(slots=True)
class StepMasks:
    """A step's masks for its constrained rows: the allowed tokens of each slot that may emit a
    token (``gather``: index into the step's ``[G, vocab]`` logits; slots past a row's verified
    drafts are never emitted and left alone), and each row's verified drafts after the
    grammar's check. The masks are either llguidance's packed bitmask on an accelerator (applied
    there by one kernel) or, for a CPU step, a 0 / -inf bias unpacked on the host."""

    gather: torch.Tensor  # [M] int64, device
    masks: torch.Tensor  # [M, words] int32 bitmask (accelerator), or [M, vocab] float32 bias (CPU)
    rows: torch.Tensor  # [C] int64 sampled-row index, device
    num_verified: torch.Tensor  # [C] int32, device
    errors: dict[int, str] = field(default_factory=dict)  # sampled row -> its grammar's error

    def apply(
        self, logits: torch.Tensor, num_verified: torch.Tensor, in_place: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits with every forbidden token at -inf, and ``num_verified`` cut where a
        draft was forbidden. ``in_place`` False leaves ``logits`` as they were (a row wants the
        model's log-probs)."""
        out = logits if in_place else logits.clone()
        if self.masks.dtype == torch.int32:
            apply_token_bitmask(out, self.gather, self.masks)
        else:
            out.index_add_(0, self.gather, self.masks.to(out.dtype))
        verified = num_verified.index_copy(0, self.rows, self.num_verified.to(num_verified.dtype))
        return out, verified


def host_mask_bias(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """The 0 / -inf bias of a bitmask, unpacked on the host: numpy unpacks bits in C, faster on
    a CPU than the kernel's torch twin (`kernels/token_mask.py`), which it equals."""
    forbidden = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return forbidden_bias(torch.from_numpy(forbidden))


class GrammarCompiler:
    """Compiles each distinct grammar text once, on its own thread, and hands each request a
    fresh copy of the compiled matcher."""

    def __init__(
        self, tokenizer_file: Path, eos_token_ids: list[int], vocab_size: int, max_compiled: int = 256
    ) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._tokenizer_args = (tokenizer_file, eos_token_ids, vocab_size)
        self._tokenizer: Future | None = None  # loaded with the first grammar (about 0.2 s)
        # Compiled grammars by text, oldest first; the least recently started are dropped past
        # `max_compiled` (a request holds its own copy, so dropping one breaks nothing).
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self.max_compiled = max_compiled
        self._lock = threading.Lock()

    @staticmethod
    def _load_tokenizer(path: Path, eos_token_ids: list[int], vocab_size: int) -> Any:
        import llguidance

        return llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=eos_token_ids or None)

    def _compile(self, grammar: str) -> Any:
        import llguidance

        assert self._tokenizer is not None
        matcher = llguidance.LLMatcher(self._tokenizer.result(), grammar)
        if matcher.is_error():
            # The scheduler checked it against the same tokenizer: this is a bug, not input.
            raise ValueError(f"grammar does not compile: {matcher.get_error()}")
        return matcher

    def prefetch(self, plan: worker_pb2.StepPlan) -> None:
        """Start compiling the grammars a just-received plan brings (its new rows')."""
        for sampling in plan.rows.sampling:  # one per new row
            if sampling.grammar:
                self._future(sampling.grammar)

    def _future(self, grammar: str) -> Future:
        # The plan reader (event loop) and the step thread both ask.
        with self._lock:
            future = self._compiled.get(grammar)
            if future is not None:
                self._compiled.move_to_end(grammar)
                return future
            if self._tokenizer is None:
                self._tokenizer = self._executor.submit(self._load_tokenizer, *self._tokenizer_args)
            future = self._compiled[grammar] = self._executor.submit(self._compile, grammar)
            if len(self._compiled) > self.max_compiled:
                self._compiled.popitem(last=False)
            return future

    def error(self, grammar: str) -> str | None:
        """Why ``grammar`` does not compile (waiting for its compilation), or None."""
        exc = self._future(grammar).exception()
        return None if exc is None else str(exc)

    def start(self, sampling: SamplingOptions, num_cached_tokens: int) -> RequestGrammar:
        """A new request's grammar state (its text compiled, if `prefetch` has not already)."""
        matcher = self._future(sampling.grammar).result().deep_copy()
        return RequestGrammar(matcher, sampling.num_prompt_tokens, num_cached_tokens)


def copy_inputs(
    rows: list[int], grammars: list[RequestGrammar], drafts: torch.Tensor, num_real: torch.Tensor
) -> GrammarInputs:
    """Start the host copy of the constrained rows' fed drafts (``drafts`` ``[S, K]`` and their
    real counts ``[S]``, on the device) before the forward is launched."""
    index = staging.to_device(rows, torch.long, drafts.device)
    picked = [drafts.index_select(0, index), num_real.index_select(0, index)]
    if not staging.is_accelerator(drafts.device):
        return GrammarInputs(rows, grammars, picked[0], picked[1])
    host = [staging.to_host(t) for t in picked]
    # Blocking: `fill_masks` sleeps while the forward runs instead of spinning a core.
    ready = torch.cuda.Event(blocking=True) if drafts.device.type == "cuda" else None
    if ready is not None:
        ready.record()
    return GrammarInputs(rows, grammars, host[0], host[1], ready)


def fill_masks(
    inputs: GrammarInputs,
    num_cols: np.ndarray,
    base: np.ndarray,
    vocab_size: int,
    history: Callable[[int, int, int], list[int]],
    device: torch.device,
) -> StepMasks:
    """The masks of every sampled slot of the constrained rows (``num_cols``/``base``: each
    sampled row's real slots and first gathered slot). ``history(row, start, end)`` reads a
    row's tokens back from the device when a resumed request must replay its outputs."""
    if inputs.ready is not None:
        inputs.ready.synchronize()
    drafts, num_real = inputs.drafts.tolist(), inputs.num_real.tolist()
    num_slots = int(sum(num_cols[row] for row in inputs.rows))
    words = -(-vocab_size // BITS)
    bitmask = np.full((num_slots, words), -1, dtype=np.int32)
    gather: list[int] = []
    verified: list[int] = []
    errors: dict[int, str] = {}
    for c, (row, grammar) in enumerate(zip(inputs.rows, inputs.grammars)):
        if not grammar.sampled:
            grammar.sampled = True
            if grammar.num_seen > grammar.num_prompt_tokens:  # resumed: its outputs so far
                grammar.consume(history(row, grammar.num_prompt_tokens, grammar.num_seen))
        grammar.catch_up()
        if grammar.error:
            errors[row] = grammar.error
        num_allowed = _fill_row(grammar.matcher, bitmask, len(gather), drafts[c][: num_real[c]])
        # Only slots up to the first forbidden draft can emit a token.
        gather.extend(range(int(base[row]), int(base[row]) + num_allowed + 1))
        verified.append(num_allowed)
    used = bitmask[: len(gather)]
    if staging.is_accelerator(device):  # 32 times fewer bytes to copy; applied there by a kernel
        masks = staging.to_device(used.reshape(-1), torch.int32, device).view(len(gather), words)
    else:
        masks = host_mask_bias(used, vocab_size)
    return StepMasks(
        gather=staging.to_device(gather, torch.long, device),
        masks=masks,
        rows=staging.to_device(inputs.rows, torch.long, device),
        num_verified=staging.to_device(verified, torch.int32, device),
        errors=errors,
    )


def _fill_row(matcher: Any, bitmask: np.ndarray, first: int, drafts: list[int]) -> int:
    """Fill the masks of one row's slots from ``first`` on: slot 0 from the matcher's state,
    slot j + 1 after draft j, while the grammar allows the drafts. Returns how many drafts it
    allowed (the row's verified drafts); the matcher is left as it was."""
    from llguidance.numpy import fill_next_token_bitmask

    fill_next_token_bitmask(matcher, bitmask, first)
    num_allowed = num_consumed = 0
    for j, token in enumerate(drafts):
        word = bitmask[first + j, token // BITS]
        if not (int(word) >> (token % BITS)) & 1:
            break
        # A complete grammar stops the matcher by itself; the EOS it then allows is consumed
        # without being recorded, so it must not be rolled back either.
        if not matcher.is_stopped():
            if not matcher.consume_token(token):
                break
            num_consumed += 1
        num_allowed += 1
        fill_next_token_bitmask(matcher, bitmask, first + j + 1)
    if num_consumed:
        matcher.rollback(num_consumed)
    return num_allowed
