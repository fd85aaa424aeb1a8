"""Scheduler-side tokenizer: the `tokenizers` library plus a jinja2 chat template.

The scheduler needs no model files: the worker ships `tokenizer.json` and the chat template in
`WorkerInfo`. This module must stay free of torch and transformers so that the scheduler service
starts fast and runs on machines without them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


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
        self.bos_token = bos_token
        self.eos_token = eos_token

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

    def render_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation; `ValueError` without a template or when it fails."""
        if self._chat_template is None:
            raise ValueError("the model has no chat template; send a raw prompt instead")
        try:
            return self._chat_template.render(
                messages=[dict(m) for m in messages],
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
        renders, e.g. inside a multi-byte character). See `scheduler_svc.detokenizer`."""
        stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        tok = self._tok
        return lambda token_id: stream.step(tok, token_id)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form), or None when out of range."""
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary string, or None when unknown."""
        return self._tok.token_to_id(token)
