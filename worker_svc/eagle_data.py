"""Self-distillation data for an EAGLE head: the target's own greedy answers and hidden states.

Conversations come from the shipped workloads (``zerobubble/workloads/*.jsonl``) and from user
turns the instruct model writes itself: its chat template is rendered up to where a user turn's
text begins and the model samples the rest of the turn. The target then answers each one
greedily, and one forward over prompt + answer gives, per position, the last hidden state
(after the final norm, float32) the head reads and learns to predict.

Samples are cached one file each under the output folder (written atomically), so an
interrupted run resumes where it stopped. Hugging Face transformers computes the hidden states:
its eager forward over a whole sequence is simpler here than our paged one and is the reference
our forward is tested against.
"""

from __future__ import annotations

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

logger = logging.getLogger(__name__)

WORKLOADS = Path(zerobubble.__file__).resolve().parent / "workloads"
# A marker rendered in place of a user turn's text, to find where that text begins.
_USER_MARKER = "\x00USER\x00"


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

    num_self_written: int = 640
    max_new_tokens: int = 192
    max_user_tokens: int = 64
    batch_size: int = 64  # conversations answered together (and user turns written together)
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


@torch.no_grad()
def write_user_turns(
    model: Any, tokenizer: Any, prefix: list[int], seed: int, count: int, max_tokens: int
) -> list[str]:
    """``count`` user turns sampled together from the instruct model itself (temperature 1, top-p 0.95).

    Every row starts from the same ``prefix``, so the batch needs no padding; the seed fixes the batch.
    """
    torch.manual_seed(seed)
    ids = torch.tensor([prefix] * count)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=True,
        top_p=0.95,
        temperature=1.0,
        pad_token_id=tokenizer.eos_token_id,
    )
    return [str(tokenizer.decode(row[len(prefix) :], skip_special_tokens=True)).strip() for row in out]


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded batch ``[B, width]`` and its attention mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def answer_batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Sample]:
    """The target's greedy answers to ``prompts`` and its last hidden states over each whole sequence.

    Generation is batched (left-padded): on a CPU one row at a time is dominated by per-step
    overhead. The hidden states are the final norm's outputs during generation itself (a hook),
    so no second forward is needed: the prefill gives the prompt's, each step its input token's.
    The last generated token is never fed back, so a sequence still running at the end loses it.
    """
    eos = tokenizer.eos_token_id
    ids, mask = _left_padded(prompts, eos)
    normed: list[torch.Tensor] = []
    # `model.model` is the decoder without lm_head: its final norm's output is what the head reads.
    hook = model.model.norm.register_forward_hook(lambda _m, _i, out: normed.append(out.float()))
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos)
    finally:
        hook.remove()
    hidden = torch.cat(normed, dim=1)  # [B, width + steps - 1, H]: every column but the last
    width = ids.shape[1]
    samples = []
    for i, prompt in enumerate(prompts):
        new = out[i, width:].tolist()
        new = new[: new.index(eos) + 1] if eos in new else new  # finished rows are padded with EOS
        length = min(len(prompt) + len(new), hidden.shape[1] - (width - len(prompt)))
        seq = torch.tensor(prompt + new)[:length]
        rows = hidden[i, width - len(prompt) : width - len(prompt) + length].clone()
        samples.append(Sample(input_ids=seq.to(torch.int32), hidden=rows, answer_start=len(prompt)))
    return samples


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
    model: Any, tokenizer: Any, settings: DistillSettings, out_dir: Path
) -> list[Conversation]:
    """User turns the model writes itself, cached in ``self_written.jsonl`` so reruns reuse them."""
    cache = out_dir / "self_written.jsonl"
    turns = [json.loads(line) for line in cache.read_text().splitlines()] if cache.exists() else []
    prefix = user_turn_prefix(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    with cache.open("a") as f, tqdm(total=settings.num_self_written, initial=len(turns), desc="user turns") as bar:
        while len(turns) < settings.num_self_written:
            count = min(settings.batch_size, settings.num_self_written - len(turns))
            # Seeded by the first turn's index: a resumed run writes the batches it had not.
            seed = settings.seed + len(turns)
            written = write_user_turns(model, tokenizer, prefix, seed, count, settings.max_user_tokens)
            turns += written
            f.write("".join(json.dumps(text) + "\n" for text in written))
            f.flush()
            bar.update(count)
    convs = []
    for i, text in enumerate(turns[: settings.num_self_written]):
        key = f"self-{i:04d}"
        if text:  # an empty turn (the model ended at once) teaches nothing
            held_out = i < settings.held_out_self and _held_out(key, settings.held_out_every)
            convs.append(Conversation(key, [{"role": "user", "content": text}], held_out))
    return convs


def build_dataset(model_dir: Path, out_dir: Path, settings: DistillSettings) -> list[Conversation]:
    """Answer every conversation not cached yet under ``out_dir``; returns all conversations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    convs = workload_conversations(settings)
    logger.info("writing up to %d user turns with the model itself", settings.num_self_written)
    convs += self_written_conversations(model, tokenizer, settings, out_dir)
    todo = [c for c in convs if not sample_path(out_dir, c).exists()]
    prompts = {c.key: render_prompt(tokenizer, c.messages) for c in todo}
    # Similar lengths together, so little of a batch is padding.
    todo.sort(key=lambda c: len(prompts[c.key]))
    started, answered = time.monotonic(), 0
    with tqdm(total=len(todo), desc="distilling", unit="conv") as bar:
        for i in range(0, len(todo), settings.batch_size):
            group = todo[i : i + settings.batch_size]
            answers = answer_batch(model, tokenizer, [prompts[c.key] for c in group], settings.max_new_tokens)
            for conv, sample in zip(group, answers):
                save_sample(sample_path(out_dir, conv), sample)
                answered += len(sample.input_ids) - sample.answer_start
            bar.update(len(group))
            bar.set_postfix(tok_s=f"{answered / (time.monotonic() - started):.0f}")
    logger.info(
        "%d conversations (%d answered now: %d answer tokens in %.0f s) in %s",
        len(convs), len(todo), answered, time.monotonic() - started, out_dir,
    )  # fmt: skip
    return convs
