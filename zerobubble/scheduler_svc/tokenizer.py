"""Scheduler-side tokenizer: the `tokenizers` library plus a jinja2 chat template.

The scheduler needs no model files: the worker ships `tokenizer.json` and the chat template in
`WorkerInfo`. This module must stay free of torch and transformers so that the scheduler service
starts fast and runs on machines without them.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders
from tokenizers.decoders import DecodeStream

from zerobubble.api import worker_pb2

logger = logging.getLogger(__name__)


def _raise_exception(message: str) -> None:
    """Template helper: chat templates call this to reject a conversation they cannot render."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Template filter: jinja2's own `tojson` escapes HTML, which chat templates do not want."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Template helper some templates use to print today's date."""
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way Hugging Face renders them.

    The sandbox matters because templates come from model repositories (untrusted code);
    `trim_blocks`/`lstrip_blocks` matter because templates are written assuming them, and the
    token ids must match what the model was trained on.
    """
    return compile_environment().from_string(source)


def compile_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment chat templates compile in (see `compile_chat_template`)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class Tokenizer:
    """Text <-> token ids for the scheduler, and chat-template rendering."""

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str = "",
        bos_token: str = "",
        eos_token: str = "",
    ) -> None:
        """Build from the contents of a `tokenizer.json` and a jinja2 chat template string."""
        self._tok = HFTokenizer.from_str(tokenizer_json)
        self._chat_template_source = chat_template
        self._chat_template = compile_chat_template(chat_template) if chat_template else None
        self.template_takes_tools = bool(chat_template) and _reads_variable(chat_template, "tools")
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Per skip_special_tokens: each id's bytes, when decoding is context-free (see
        # `byte_pieces`), and the text of each that is whole, valid UTF-8 on its own (None
        # otherwise); None when decoding is not context-free. Built on first use.
        self._byte_tables: dict[bool, tuple[list[bytes], list[str | None]] | None] = {}

    @classmethod
    def from_worker_info(cls, info: worker_pb2.WorkerInfo) -> Tokenizer:
        """Build from what a worker reports in `Describe`."""
        return cls(info.tokenizer_json, info.chat_template, info.bos_token, info.eos_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can be used."""
        return self._chat_template is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without special tokens (chat templates carry their own)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def render_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of a conversation; `ValueError` without a template or when it fails.
        ``tools`` (OpenAI function tools) reach the template as Hugging Face passes them."""
        if self._chat_template is None:
            raise ValueError("the model has no chat template; send a raw prompt instead")
        try:
            return self._chat_template.render(
                messages=[dict(m) for m in messages],
                tools=None if tools is None else [dict(t) for t in tools],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.exceptions.TemplateError as exc:
            # A template rejecting a conversation (e.g. roles out of order) is the client's error.
            raise ValueError(f"chat template error: {exc}") from exc

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation (as `transformers`' `apply_chat_template`)."""
        return self.encode(self.render_chat_template(messages, add_generation_prompt))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; invalid UTF-8 becomes U+FFFD."""
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(
        self, context_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> Callable[[int], str | None]:
        """An incremental decoder of one output stream that starts after ``context_ids``: each
        call takes the next id and returns the text it completes (None while nothing new
        renders, e.g. inside a multi-byte character). See `zerobubble.scheduler_svc.detokenizer`.

        Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) decode each id to fixed bytes
        whatever surrounds it, so their stream is a table lookup and an incremental UTF-8
        decoder (as llama.cpp's token pieces), skipped for the ids whose bytes are whole
        characters after whole characters (their text is a second table): several times faster
        per token than the library's `DecodeStream` (docs/benchmarks/host.md), which decodes a
        window of ids twice per token and serves the other tokenizers.
        """
        tables = self._byte_tables_for(skip_special_tokens)
        if tables is not None:
            return byte_stream(*tables)
        return self.window_stream_decoder(context_ids, skip_special_tokens)

    def window_stream_decoder(
        self, context_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> Callable[[int], str | None]:
        """`stream_decoder` through the library's `DecodeStream`, for any tokenizer."""
        stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        tok = self._tok
        return lambda token_id: stream.step(tok, token_id)

    def byte_pieces(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """The bytes each id decodes to, when decoding is a plain concatenation of them: the
        decoder is exactly `ByteLevel` (a `Sequence` of decoders may strip or replace text
        depending on position). None otherwise, or when a vocabulary entry is not byte-level.

        Regular ids map their characters through the byte-level alphabet; added tokens decode
        to their literal content (empty when special and skipped), as `decode` renders them.
        """
        tables = self._byte_tables_for(skip_special_tokens)
        return tables[0] if tables is not None else None

    def _byte_tables_for(self, skip_special_tokens: bool) -> tuple[list[bytes], list[str | None]] | None:
        """`byte_pieces` and each piece's text when whole, valid UTF-8 (see `_byte_tables`)."""
        if skip_special_tokens in self._byte_tables:
            return self._byte_tables[skip_special_tokens]
        pieces: list[bytes] | None = None
        if isinstance(self._tok.decoder, decoders.ByteLevel):
            pieces = []
            to_byte = _byte_level_alphabet()
            added = self._tok.get_added_tokens_decoder()
            for token_id in range(self.vocab_size):
                token = added.get(token_id)
                if token is not None:
                    skipped = token.special and skip_special_tokens
                    pieces.append(b"" if skipped else token.content.encode())
                    continue
                piece = self._tok.id_to_token(token_id)
                if piece is None or any(c not in to_byte for c in piece):
                    logger.info("token id %d is not byte-level: streaming with DecodeStream", token_id)
                    pieces = None
                    break
                pieces.append(bytes(to_byte[c] for c in piece))
        tables = (pieces, [_whole_text(piece) for piece in pieces]) if pieces is not None else None
        self._byte_tables[skip_special_tokens] = tables
        return tables

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form), or None when out of range."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary string, or None when unknown."""
        return self._tok.token_to_id(token)


def _reads_variable(template_source: str, name: str) -> bool:
    """Whether a chat template reads the variable ``name`` (False when it does not parse: then
    it fails later, where the failure is reported)."""
    try:
        return name in jinja2.meta.find_undeclared_variables(compile_environment().parse(template_source))
    except jinja2.exceptions.TemplateError:
        return False


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character standing for each byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the code points from
    256 upwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    num_others = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + num_others)
            num_others += 1
    return {c: b for b, c in chars.items()}


def _whole_text(piece: bytes) -> str | None:
    """The text of bytes that are whole, valid UTF-8 characters; None otherwise."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return None


def byte_stream(pieces: list[bytes], texts: list[str | None]) -> Callable[[int], str | None]:
    """A stream step over per-id bytes: the text the id completes, None while the bytes end
    inside a character. ``texts[i]`` is ``pieces[i]`` decoded when that is whole, valid UTF-8.

    Text goes out only once every byte so far is decoded, as `DecodeStream` does: the
    detokenizer then counts all ids up to this one as rendered (its flush re-decodes only the
    ids after). Invalid UTF-8 becomes U+FFFD as a full decode renders it (both replace each
    maximal invalid subsequence by one U+FFFD).
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    held = ""
    pending = False  # bytes of an unfinished character are in the decoder

    def step(token_id: int) -> str | None:
        nonlocal held, pending
        if not pending:
            # Most ids of most text: whole characters after whole characters, so the text is
            # the piece's own and the incremental decoder (two Python-level calls) is skipped.
            text = texts[token_id]
            if text is not None:
                return text or None
        text = held + decoder.decode(pieces[token_id])
        pending = bool(decoder.getstate()[0])
        if pending:
            held = text
            return None
        held = ""
        return text or None

    return step
