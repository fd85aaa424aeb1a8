"""Self-distillation data for an EAGLE head: the target's own answers and hidden states.

Conversations come from the shipped workloads (``zerobubble/workloads/*.jsonl``) and from user
turns the instruct model writes itself: its chat template is rendered up to where a user turn's
text begins and the model samples the rest of the turn. The target then answers each one
greedily, and the workload rows that are trained on get ``num_sampled_answers`` more answers
sampled at ``answer_temperature`` (the head learns the target's distribution at every position,
so any text the target could write teaches it). Every position's hidden state after the final norm is
kept (float32): what the head reads and learns to predict.

Our own forward generates, in the dtype the target serves in (``--dtype auto``), rows batched
with a paged KV cache: a head then trains on the hidden states and greedy choices serving will
show it, and a CPU writes several times more tokens per second than Hugging Face's ``generate``.

Samples are cached one file each under the output folder (written atomically), so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import zerobubble
from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.worker_svc.model import CausalLM, allocate_kv_cache
from zerobubble.worker_svc.model_loader import LoadedModel, load_model

logger = logging.getLogger(__name__)

WORKLOADS = Path(zerobubble.__file__).resolve().parent / "workloads"
# A marker rendered in place of a user turn's text, to find where that text begins.
_USER_MARKER = "\x00USER\x00"
BLOCK_SIZE = 16
NUCLEUS_CANDIDATES = 256
SELF_PREFIX = "self-"  # the key of a self-written conversation


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages to answer; ``held_out`` ones are kept for evaluation, never trained on."""

    key: str
    messages: list[dict[str, str]]
    held_out: bool


@dataclass(frozen=True, slots=True)
class Sample:
    """One answered conversation: tokens ``[T]``, hidden states ``[T, H]`` float32, and where the answer starts."""

    input_ids: torch.Tensor
    hidden: torch.Tensor
    answer_start: int


@dataclass(frozen=True, slots=True)
class DistillSettings:
    """How much data to make."""

    num_self_written: int = 3200
    max_new_tokens: int = 192
    max_user_tokens: int = 64
    num_sampled_answers: int = 8  # sampled answers per trained workload row, beside the greedy one
    answer_temperature: float = 0.7
    batch_size: int = 64  # conversations answered together (and user turns written together)
    dtype: str = "auto"  # the target's dtype, as --dtype names it (auto: as the worker resolves it)
    held_out_every: int = 6  # every n-th conversation (by a hash of its key) is held out
    # Only the first self-written turns can be held out, so the held-out set keeps its size
    # however many turns are written; every later one is trained on.
    held_out_self: int = 64
    seed: int = 0


def _held_out(key: str, every: int) -> bool:
    return zlib.crc32(key.encode()) % every == 0


def workload_conversations(settings: DistillSettings, folder: Path = WORKLOADS) -> list[Conversation]:
    """Every row of the shipped workloads, tagged by file and line."""
    found = []
    for path in sorted(folder.glob("*.jsonl")):
        for line_no, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                key = f"{path.stem}-{line_no:04d}"
                messages = json.loads(line)["messages"]
                found.append(Conversation(key, messages, _held_out(key, settings.held_out_every)))
    return found


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a first user turn's text begins."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _USER_MARKER}], tokenize=False)
    return list(tokenizer(text[: text.index(_USER_MARKER)], add_special_tokens=False).input_ids)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampled rather than greedy choices: temperature, then the nucleus of mass ``top_p``."""

    temperature: float = 1.0
    top_p: float = 0.95


@dataclass(slots=True)
class _Batch:
    """Rows generated together: their tokens so far, KV blocks and captured hidden states."""

    tokens: list[list[int]]
    done: list[bool]
    hidden: torch.Tensor  # [B, max_len, H] float32: row b's final hidden state at each position
    block_tables: torch.Tensor  # [B, blocks_per_row] int32
    kv_caches: Any


def _new_batch(loaded: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> _Batch:
    model = loaded.model
    assert isinstance(model, CausalLM)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    per_row = -(-max_len // BLOCK_SIZE)
    kv = allocate_kv_cache(loaded.hf_config, len(prompts) * per_row, BLOCK_SIZE, model.dtype, model.device)
    return _Batch(
        tokens=[list(p) for p in prompts],
        done=[False] * len(prompts),
        hidden=torch.zeros(len(prompts), max_len, model.spec.hidden_size),
        block_tables=torch.arange(len(prompts) * per_row, dtype=torch.int32).view(len(prompts), per_row),
        kv_caches=kv,
    )


def _forward_rows(loaded: LoadedModel, batch: _Batch, rows: list[int], starts: list[int]) -> torch.Tensor:
    """Feed each row in ``rows`` its tokens from ``starts[i]`` on; returns the last fed token's hidden states.

    Every fed position's hidden state is kept in ``batch.hidden``.
    """
    model = loaded.model
    assert isinstance(model, CausalLM)
    lengths = [len(batch.tokens[r]) - s for r, s in zip(rows, starts)]
    ends = list(itertools.accumulate(lengths))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    row_of = torch.repeat_interleave(torch.tensor(rows), torch.tensor(lengths))
    tables = batch.block_tables[rows]
    seq_lens = torch.tensor([s + n for s, n in zip(starts, lengths)], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *ends], dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=max(lengths),
        max_seq_len=int(seq_lens.max()),
        slot_mapping=(batch.block_tables[row_of, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE),
    )
    ids = torch.tensor([t for r, s in zip(rows, starts) for t in batch.tokens[r][s:]], dtype=torch.long)
    hidden = model(ids, positions, meta, batch.kv_caches)
    batch.hidden[row_of, positions] = hidden.float()
    return hidden[torch.tensor(ends) - 1]


def _choose(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator) -> list[int]:
    """Greedy, or sampled at ``sampling``'s temperature from its nucleus (top-p).

    The nucleus is taken among the ``NUCLEUS_CANDIDATES`` most likely tokens: sorting the whole
    vocabulary for every row costs more than the step's forward on a CPU.
    """
    if sampling is None:
        return logits.argmax(-1).tolist()
    probs = (logits.float() / sampling.temperature).softmax(-1)
    top_probs, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    outside = top_probs.cumsum(-1) - top_probs >= sampling.top_p
    picked = torch.multinomial(top_probs.masked_fill(outside, 0.0), 1, generator=generator)
    return order.gather(-1, picked).squeeze(-1).tolist()


def generate(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> list[Sample]:
    """Continue ``prompts`` together with our own forward; each sample ends at its first EOS or the limit.

    Every token of a sample, its last included, is fed once (a finished row takes one more step
    for its final token), so ``hidden`` holds the final norm's output at every position: what the
    head reads at serving time, in the model's own dtype.
    """
    model = loaded.model
    assert isinstance(model, CausalLM)
    stops = set(loaded.eos_token_ids)
    batch = _new_batch(loaded, prompts, max_new_tokens)
    generator = torch.Generator().manual_seed(seed)
    rows, starts = list(range(len(prompts))), [0] * len(prompts)
    while rows:
        last = _forward_rows(loaded, batch, rows, starts)
        live = [i for i, r in enumerate(rows) if not batch.done[r]]
        chosen = _choose(model.compute_logits(last[live]), sampling, generator) if live else []
        for i, token in zip(live, chosen):
            r = rows[i]
            batch.tokens[r].append(token)
            new = len(batch.tokens[r]) - len(prompts[r])
            batch.done[r] = token in stops or new >= max_new_tokens
        # A row finished now stays for one step more, to feed its final token.
        rows = [rows[i] for i in live]
        starts = [len(batch.tokens[r]) - 1 for r in rows]
    return [
        Sample(
            input_ids=torch.tensor(t, dtype=torch.int32),
            hidden=batch.hidden[i, : len(t)].clone(),
            answer_start=len(prompts[i]),
        )
        for i, t in enumerate(batch.tokens)
    ]


def save_sample(path: Path, sample: Sample) -> None:
    """Write atomically: a reader never sees half a sample, and an interrupted run redoes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"input_ids": sample.input_ids, "hidden": sample.hidden, "answer_start": sample.answer_start}, tmp)
    os.replace(tmp, path)


def load_sample(path: Path) -> Sample:
    data = torch.load(path, weights_only=True)
    return Sample(data["input_ids"], data["hidden"], int(data["answer_start"]))


def sample_path(out_dir: Path, conv: Conversation) -> Path:
    return out_dir / ("held_out" if conv.held_out else "train") / f"{conv.key}.pt"


def self_written_conversations(
    loaded: LoadedModel, tokenizer: Any, settings: DistillSettings, out_dir: Path
) -> list[Conversation]:
    """User turns the model writes itself (temperature 1, top-p 0.95), cached in
    ``self_written.jsonl`` so reruns reuse them."""
    cache = out_dir / "self_written.jsonl"
    turns = [json.loads(line) for line in cache.read_text().splitlines()] if cache.exists() else []
    prefix = user_turn_prefix(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    with cache.open("a") as f, tqdm(total=settings.num_self_written, initial=len(turns), desc="user turns") as bar:
        while len(turns) < settings.num_self_written:
            count = min(settings.batch_size, settings.num_self_written - len(turns))
            # Seeded by the first turn's index: a resumed run writes the batches it had not.
            seed = settings.seed + len(turns)
            samples = generate(loaded, [prefix] * count, settings.max_user_tokens, Sampling(), seed)
            written = [
                str(tokenizer.decode(s.input_ids[len(prefix) :].tolist(), skip_special_tokens=True)).strip()
                for s in samples
            ]
            turns += written
            f.write("".join(json.dumps(text) + "\n" for text in written))
            f.flush()
            bar.update(count)
    convs = []
    for i, text in enumerate(turns[: settings.num_self_written]):
        key = f"{SELF_PREFIX}{i:04d}"
        if text:  # an empty turn (the model ended at once) teaches nothing
            held_out = i < settings.held_out_self and _held_out(key, settings.held_out_every)
            convs.append(Conversation(key, [{"role": "user", "content": text}], held_out))
    return convs


def answer_variants(convs: list[Conversation], settings: DistillSettings) -> list[tuple[Conversation, int]]:
    """``(conversation, variant)`` pairs to answer: variant 0 is greedy, the others sampled.

    Only trained workload rows get sampled answers: they are the only prompts with documents and
    code (the self-written turns are many already), and held-out answers stay the greedy text
    serving would produce.
    """
    extra = settings.num_sampled_answers
    return [(c, v) for c in convs for v in range(1 + (0 if c.held_out or c.key.startswith(SELF_PREFIX) else extra))]


def variant_path(out_dir: Path, conv: Conversation, variant: int) -> Path:
    path = sample_path(out_dir, conv)
    return path if variant == 0 else path.with_name(f"{conv.key}-s{variant}.pt")


def build_dataset(model_dir: Path, out_dir: Path, settings: DistillSettings) -> list[Conversation]:
    """Answer every conversation not cached yet under ``out_dir``; returns all conversations."""
    from transformers import AutoTokenizer

    from zerobubble.worker_svc.server import resolve_dtype

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    loaded = load_model(str(model_dir), resolve_dtype(settings.dtype, torch.device("cpu")), "cpu")
    convs = workload_conversations(settings)
    logger.info("writing up to %d user turns with the model itself", settings.num_self_written)
    convs += self_written_conversations(loaded, tokenizer, settings, out_dir)
    todo = [(c, v) for c, v in answer_variants(convs, settings) if not variant_path(out_dir, c, v).exists()]
    prompts = {c.key: render_prompt(tokenizer, c.messages) for c, _ in todo}
    # Similar lengths together, so a batch's rows end together; greedy and sampled answers apart.
    todo.sort(key=lambda cv: len(prompts[cv[0].key]))
    started, answered = time.monotonic(), 0
    with tqdm(total=len(todo), desc="distilling", unit="answer") as bar:
        for sampling in (None, Sampling(settings.answer_temperature, 1.0)):
            part = [(c, v) for c, v in todo if (v > 0) == (sampling is not None)]
            for i in range(0, len(part), settings.batch_size):
                group = part[i : i + settings.batch_size]
                prompt_ids = [prompts[c.key] for c, _ in group]
                answers = generate(loaded, prompt_ids, settings.max_new_tokens, sampling, settings.seed + i)
                for (conv, variant), sample in zip(group, answers):
                    save_sample(variant_path(out_dir, conv, variant), sample)
                    answered += len(sample.input_ids) - sample.answer_start
                bar.update(len(group))
                bar.set_postfix(tok_s=f"{answered / (time.monotonic() - started):.0f}")
    logger.info(
        "%d conversations (%d answers now: %d answer tokens in %.0f s) in %s",
        len(convs), len(todo), answered, time.monotonic() - started, out_dir,
    )  # fmt: skip
    return convs
