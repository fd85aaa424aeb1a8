"""Incremental detokenization with stop strings, one instance per request.

Two kinds of text are held back from the client:

- bytes of a UTF-8 character split across tokens (decoding them alone gives U+FFFD), until the
  token that completes the character arrives;
- a tail that could still grow into a stop string, until it either does (then the text is cut
  right before the stop string) or cannot any more.

Decoding a short window of ids instead of the whole output keeps each step O(1); the window
starts a few tokens before the new ones because tokenizers such as SentencePiece render a token
differently at the start of a string (leading-space handling), so new text is taken as the
difference between decoding `[prefix_offset:]` and `[prefix_offset:read_offset]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# How many prompt tokens give the first output tokens their left context.
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`."""
        ...


class StreamStep(Protocol):
    """One request's incremental decoder in native code (the tokenizers library's
    `DecodeStream`): the same window-difference rule as `Detokenizer.append`, in one call."""

    def __call__(self, token_id: int) -> str | None:
        """Text completed by ``token_id`` (None: nothing new renders yet)."""
        ...


class Detokenizer:
    """Turns a request's output ids into streamed text deltas and detects stop strings."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """`stop` strings must be non-empty; text is cut right before the first one that appears."""
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._ids: list[int] = list(prompt_ids[-_NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # A native stream decoder when the tokenizer offers one (about 3x cheaper per token);
        # the offsets above are kept either way, for `flush` and for falling back.
        make_stream = getattr(tokenizer, "stream_decoder", None)
        self._stream: StreamStep | None = (
            make_stream(self._ids, skip_special_tokens) if make_stream is not None else None
        )
        # With stop strings: the decoded text not yet dropped, i.e. the last `_num_kept_chars`
        # characters already emitted (a stop string may begin in them) and everything held back
        # after them. It stays as short as the longest stop string plus what is held, so a token
        # costs the same at the end of a long output as at its start (appending to the whole
        # output copied it: O(n^2) per request). Without stop strings nothing is kept.
        self._text = ""
        self._num_emitted_chars = 0  # leading characters of `_text` already emitted
        self._num_kept_chars = max((len(s) for s in self._stop), default=1) - 1
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been seen (nothing more is emitted then)."""
        return self._stopped

    def append(self, token_id: int) -> tuple[str, bool]:
        """Add one output token; returns (text safe to stream now, whether a stop string hit)."""
        if self._stopped:
            return "", True
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                new_text = self._stream(token_id)
            except Exception:
                # The native decoder refuses windows whose text does not extend the previous
                # one (`InvalidPrefix`); the Python rule takes over from the same offsets.
                self._stream = None
                new_text = self._window_text()
        else:
            new_text = self._window_text()
        if new_text is None:
            return "", False
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if not self._stop:
            return new_text, False  # most requests: nothing is held back
        self._text += new_text
        return self._release(final=False)

    def _window_text(self) -> str | None:
        """New text of the ids after `_read_offset`, decoded with the tokens before them."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith(_REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            # An incomplete UTF-8 character (or a token that renders as nothing yet): wait.
            return None
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text still held back, for when the request finishes for another reason than a stop."""
        if self._stopped:
            return ""
        # Bytes that never completed a character are emitted as U+FFFD, as a full decode would.
        tail = self._decode(self._ids[self._prefix_offset :])
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        self._prefix_offset = self._read_offset = len(self._ids)
        if not self._stop:
            return tail[len(prefix_text) :]
        self._text += tail[len(prefix_text) :]
        text, _ = self._release(final=True)
        return text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, final: bool) -> tuple[str, bool]:
        """Emit what can no longer be part of a stop string; cut at a stop string."""
        stop_at = self._find_stop()
        if stop_at is not None:
            self._stopped = True
            self._text = self._text[:stop_at]
            end = stop_at
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._num_held_chars()
        # The hold-back guarantees a stop string never starts before what was already emitted.
        end = max(end, self._num_emitted_chars)
        new_text = self._text[self._num_emitted_chars : end]
        # Drop emitted text no stop string could still start in.
        num_dropped = end - self._num_kept_chars
        if num_dropped > 0:
            self._text = self._text[num_dropped:]
            end -= num_dropped
        self._num_emitted_chars = end
        return new_text, self._stopped

    def _find_stop(self) -> int | None:
        """Start of the earliest stop string that could have been completed by the new text."""
        best: int | None = None
        for stop in self._stop:
            # Occurrences ending in already-searched text were found earlier.
            start = max(0, self._num_emitted_chars - len(stop) + 1)
            idx = self._text.find(stop, start)
            if idx >= 0 and (best is None or idx < best):
                best = idx
        return best

    def _num_held_chars(self) -> int:
        """Length of the longest text tail that is a proper prefix of some stop string."""
        num_held = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text)), num_held, -1):
                if self._text.endswith(stop[:n]):
                    num_held = n
                    break
        return num_held
