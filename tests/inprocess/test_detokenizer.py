"""Tokenizer (chat templates) and incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.sim_worker import EOS_ID, make_toy_tokenizer, make_toy_tokenizer_json
from zerobubble.scheduler_svc.detokenizer import Detokenizer
from zerobubble.scheduler_svc.tokenizer import Tokenizer

TOY = make_toy_tokenizer()


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir: Path) -> Tokenizer:
    """Our tokenizer over the embedded SmolLM2 files (converted once by the session fixture)."""
    return Tokenizer(
        (smollm2_dir / "tokenizer.json").read_text(),
        (smollm2_dir / "chat_template.jinja").read_text(),
        "<|im_start|>",
        "<|im_end|>",
    )


class _PythonOnly:
    """A decoder without a native stream: the detokenizer's Python window rule alone."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens)


class _StreamGivesUp(_PythonOnly):
    """A native stream that raises from its fourth token on (as `DecodeStream` does on a window
    whose text does not extend the previous one): the Python rule must take over seamlessly."""

    def stream_decoder(self, context_ids: Sequence[int], skip_special_tokens: bool = True):
        step = self.tokenizer.stream_decoder(context_ids, skip_special_tokens)
        num_calls = [0]

        def flaky(token_id: int) -> str | None:
            num_calls[0] += 1
            if num_calls[0] > 3:
                raise RuntimeError("InvalidPrefix")
            return step(token_id)

        return flaky


class _WindowStream(_PythonOnly):
    """The library's `DecodeStream` even where a byte table would serve (the path of tokenizers
    that are not byte-level)."""

    def stream_decoder(self, context_ids: Sequence[int], skip_special_tokens: bool = True):
        return self.tokenizer.window_stream_decoder(context_ids, skip_special_tokens)


DECODERS = {
    "native": lambda t: t,
    "window": _WindowStream,
    "python": _PythonOnly,
    "native-then-python": _StreamGivesUp,
}


def _stream(tokenizer: Any, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[list[str], bool]:
    detok = Detokenizer(tokenizer, prompt, stop)
    chunks: list[str] = []
    for token_id in ids:
        text, stopped = detok.append(token_id)
        chunks.append(text)
        if stopped:
            return chunks, True
    chunks.append(detok.flush())
    return chunks, False


# ------------------------------------------------------------------------------ tokenizer


def test_toy_tokenizer_round_trip_and_specials() -> None:
    ids = TOY.encode("hé €")
    assert ids == list("hé €".encode())
    assert TOY.decode(ids + [EOS_ID]) == "hé €"
    assert TOY.decode([EOS_ID], skip_special_tokens=False) == "<|eos|>"
    assert TOY.id_to_token(EOS_ID) == "<|eos|>" and TOY.token_to_id("<|eos|>") == EOS_ID


def test_chat_template_renders_with_hf_conventions() -> None:
    ids = TOY.apply_chat_template([{"role": "user", "content": "hi"}])
    assert TOY.decode(ids, skip_special_tokens=False) == ("<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n")
    no_prompt = TOY.apply_chat_template([{"role": "user", "content": "hi"}], False)
    assert TOY.decode(no_prompt, skip_special_tokens=False) == "<|bos|>user\nhi<|eos|>\n"


def test_chat_template_errors_are_value_errors() -> None:
    strict = Tokenizer(
        make_toy_tokenizer_json(),
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x",
    )
    with pytest.raises(ValueError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "a"}])
    with pytest.raises(ValueError):
        Tokenizer(make_toy_tokenizer_json()).apply_chat_template([{"role": "user", "content": "a"}])


def test_chat_template_is_sandboxed() -> None:
    evil = Tokenizer(make_toy_tokenizer_json(), "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="unsafe|access"):
        evil.render_chat_template([{"role": "user", "content": "a"}])


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir: Path) -> Any:
    """transformers' tokenizer for the same directory (tests may import transformers)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi there 👋"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Write  two\nlines, ünïcödé 世界."},
        ],
        [{"role": "user", "content": ""}],
    ],
)
def test_chat_template_matches_transformers(
    messages: list[dict[str, str]], hf_tokenizer: Any, smol_tokenizer: Tokenizer
) -> None:
    hf = hf_tokenizer
    ours = smol_tokenizer
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if not isinstance(expected, list):
            expected = list(expected["input_ids"])
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected


def test_smollm_encode_decode_match_transformers(hf_tokenizer: Any, smol_tokenizer: Tokenizer) -> None:
    hf = hf_tokenizer
    ours = smol_tokenizer
    text = "  Hello, wörld! 😀 日本語 <|im_end|> tab\tend"
    ids = ours.encode(text)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------- detokenizer


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"),
        max_size=40,
    )
)
@pytest.mark.parametrize("decoder", DECODERS)
def test_streamed_text_equals_full_decode_and_never_splits_a_character(text: str, decoder: str) -> None:
    ids = TOY.encode(text)  # one token per byte: every multi-byte character is split
    chunks, stopped = _stream(DECODERS[decoder](TOY), [104, 105], ids, [])
    assert not stopped
    assert "".join(chunks) == TOY.decode(ids) == text
    assert all("\ufffd" not in c for c in chunks)


@pytest.mark.parametrize("decoder", DECODERS)
def test_incomplete_character_at_the_end_is_flushed_like_decode(decoder: str) -> None:
    ids = list("aé".encode())[:-1]
    chunks, _ = _stream(DECODERS[decoder](TOY), [], ids, [])
    assert "".join(chunks) == TOY.decode(ids) == "a\ufffd"


def test_special_tokens_are_skipped_or_kept() -> None:
    ids = [104, EOS_ID, 105]
    assert "".join(_stream(TOY, [], ids, [])[0]) == "hi"
    detok = Detokenizer(TOY, [], [], skip_special_tokens=False)
    assert "".join(detok.append(t)[0] for t in ids) + detok.flush() == "h<|eos|>i"


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("text", ["😀👍🏽 fine", "日本語のテキスト", "naïve café — ok", " a  b\n\nc"])
def test_smollm_incremental_matches_decode(text: str, decoder: str, smol_tokenizer: Tokenizer) -> None:
    tok = smol_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode(text)
    chunks, _ = _stream(DECODERS[decoder](tok), prompt, ids, [])
    assert "".join(chunks) == tok.decode(ids)
    assert all("\ufffd" not in c for c in chunks)


def _expected_stop(tokenizer: Tokenizer, ids: list[int], stop: list[str]) -> tuple[str, bool]:
    """Naive reference: after each token, cut at the earliest stop string in the full text."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return tokenizer.decode(ids), False


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab cé", max_size=30),
    stop=st.lists(st.text(alphabet="ab cé", min_size=1, max_size=4), min_size=1, max_size=3),
)
@pytest.mark.parametrize("decoder", DECODERS)
def test_stop_strings_cut_and_are_never_partially_streamed(text: str, stop: list[str], decoder: str) -> None:
    ids = TOY.encode(text)
    chunks, stopped = _stream(DECODERS[decoder](TOY), [], ids, stop)
    expected, expect_stop = _expected_stop(TOY, ids, stop)
    assert stopped == expect_stop
    assert "".join(chunks) == expected
    # The client never sees a stop string, not even one later cut.
    streamed = ""
    for chunk in chunks:
        streamed += chunk
        assert not any(s in streamed for s in stop)


def test_text_that_might_start_a_stop_string_is_held_until_decided() -> None:
    detok = Detokenizer(TOY, [], ["world"])
    got = [detok.append(t)[0] for t in TOY.encode("hello wor")]
    assert "".join(got) == "hello "
    assert detok.append(ord("k")) == ("work", False)  # "work" cannot become "world" any more
    assert detok.append(ord("w")) == ("", False)
    assert detok.flush() == "w"


def test_held_text_is_released_by_flush() -> None:
    detok = Detokenizer(TOY, [], ["world"])
    assert "".join(detok.append(t)[0] for t in TOY.encode("hello wor")) == "hello "
    assert detok.flush() == "wor"


def test_nothing_after_a_stop() -> None:
    detok = Detokenizer(TOY, [], ["b"])
    assert detok.append(ord("a")) == ("a", False)
    assert detok.append(ord("b")) == ("", True)
    assert detok.append(ord("c")) == ("", True)
    assert detok.flush() == ""


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        Detokenizer(TOY, [], [""])


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=16), skip=st.booleans())
def test_byte_table_stream_equals_full_decode_of_any_ids(ids: list[int], skip: bool, smol_tokenizer: Tokenizer) -> None:
    """Any ids at all, special ones and invalid UTF-8 included: the byte-table stream renders
    what a full decode renders (the flush decodes what is still held)."""
    tok = smol_tokenizer
    assert tok.byte_pieces(skip) is not None  # SmolLM2 is byte-level BPE: the table serves it
    detok = Detokenizer(tok, [], [], skip_special_tokens=skip)
    text = "".join(detok.append(t)[0] for t in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=skip)


def test_tokenizers_that_are_not_byte_level_stream_through_decode_stream() -> None:
    """A decoder chain (here a Metaspace tokenizer's, as Llama 2 and Mistral have) renders an
    id differently by position: no byte table, the window decoder serves it, correctly."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    tok = Tokenizer(hf.to_str())
    assert tok.byte_pieces() is None
    ids = [1, 2, 3]
    chunks, _ = _stream(tok, [], ids, [])
    assert "".join(chunks) == tok.decode(ids) == "hello world!"
