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

    num_self_written: int = 64
    max_new_tokens: int = 192
    max_user_tokens: int = 64
    batch_size: int = 16  # conversations answered together
    held_out_every: int = 6  # every n-th conversation (by a hash of its key) is held out
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
def write_user_turn(model: Any, tokenizer: Any, prefix: list[int], seed: int, max_tokens: int) -> str:
    """A user turn sampled from the instruct model itself (temperature 1, top-p 0.95)."""
    torch.manual_seed(seed)
    out = model.generate(
        torch.tensor([prefix]),
        max_new_tokens=max_tokens,
        do_sample=True,
        top_p=0.95,
        temperature=1.0,
        pad_token_id=tokenizer.eos_token_id,
    )
    return str(tokenizer.decode(out[0, len(prefix) :], skip_special_tokens=True)).strip()


@torch.no_grad()
def answer_batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> list[Sample]:
    """The target's greedy answers to ``prompts`` and its last hidden states over each whole sequence.

    Generation is batched (left-padded): on a CPU one row at a time is dominated by per-step
    overhead. The hidden states come from one unpadded forward per sequence.
    """
    eos = tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos)
    samples = []
    for i, prompt in enumerate(prompts):
        new = out[i, width:].tolist()
        new = new[: new.index(eos) + 1] if eos in new else new  # finished rows are padded with EOS
        seq = torch.tensor(prompt + new)
        # `model.model` is the decoder without lm_head: its output is after the final norm.
        hidden = model.model(seq[None]).last_hidden_state[0].float()
        samples.append(Sample(input_ids=seq.to(torch.int32), hidden=hidden, answer_start=len(prompt)))
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
    with cache.open("a") as f:
        for i in range(len(turns), settings.num_self_written):
            text = write_user_turn(model, tokenizer, prefix, settings.seed + i, settings.max_user_tokens)
            turns.append(text)
            f.write(json.dumps(text) + "\n")
            f.flush()
    convs = []
    for i, text in enumerate(turns[: settings.num_self_written]):
        key = f"self-{i:04d}"
        if text:  # an empty turn (the model ended at once) teaches nothing
            held_out = _held_out(key, settings.held_out_every)
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
    with tqdm(total=len(todo), desc="distilling", unit="conv") as bar:
        for i in range(0, len(todo), settings.batch_size):
            group = todo[i : i + settings.batch_size]
            answers = answer_batch(model, tokenizer, [prompts[c.key] for c in group], settings.max_new_tokens)
            for conv, sample in zip(group, answers):
                save_sample(sample_path(out_dir, conv), sample)
            bar.update(len(group))
    logger.info("%d conversations (%d answered now) in %s", len(convs), len(todo), out_dir)
    return convs
