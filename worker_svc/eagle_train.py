"""Training an EAGLE-1 head on self-distilled samples (:mod:`zerobubble.worker_svc.eagle_data`).

Row ``t`` of a sample gives the head token ``x[t+1]`` and the target's hidden state ``h[t]``
(with uniform noise, as EAGLE trains it to tolerate its own imprecise predictions); the head
predicts ``h[t+1]``, whose logits through the shared lm_head should give ``x[t+2]``. EAGLE's loss:
smooth L1 of the predicted against the target's hidden state plus 0.1 x cross-entropy of the
target's token, both over the rows whose predicted token lies in the answer.

A checkpoint (head weights, optimizer, step) is written to the output folder every
``checkpoint_every`` steps and at the end, so a stopped run resumes where it was; the trained head
is then saved as bfloat16 safetensors + config.json in the EAGLE-1 layout.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from zerobubble.worker_svc.eagle import EagleHead, save_head
from zerobubble.worker_svc.eagle_data import Sample

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """Optimizer and schedule; EAGLE's loss weights."""

    steps: int = 600
    batch_tokens: int = 2048  # rows per step, summed over the batch's samples
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    noise: float = 0.2  # width of the uniform noise added to the input hidden states
    hidden_weight: float = 1.0
    token_weight: float = 0.1
    checkpoint_every: int = 50
    max_minutes: float = 0.0  # stop (with a checkpoint) after this long; 0 = no limit
    seed: int = 0


@dataclass(slots=True)
class Batch:
    """Right-padded head inputs and targets ``[B, S(, H)]``; ``mask`` marks rows that count."""

    input_ids: torch.Tensor
    hidden: torch.Tensor
    target_hidden: torch.Tensor
    target_ids: torch.Tensor
    mask: torch.Tensor


def make_batch(samples: list[Sample]) -> Batch:
    """Head rows ``t = 0 .. T-3`` of each sample (the last two have no next token to predict)."""
    rows = max(len(s.input_ids) - 2 for s in samples)
    size = samples[0].hidden.shape[1]
    batch = Batch(
        input_ids=torch.zeros(len(samples), rows, dtype=torch.long),
        hidden=torch.zeros(len(samples), rows, size),
        target_hidden=torch.zeros(len(samples), rows, size),
        target_ids=torch.zeros(len(samples), rows, dtype=torch.long),
        mask=torch.zeros(len(samples), rows, dtype=torch.bool),
    )
    for i, s in enumerate(samples):
        n = len(s.input_ids) - 2
        batch.input_ids[i, :n] = s.input_ids[1 : n + 1]
        batch.hidden[i, :n] = s.hidden[:n]
        batch.target_hidden[i, :n] = s.hidden[1 : n + 1]
        batch.target_ids[i, :n] = s.input_ids[2 : n + 2]
        # Row t predicts token t + 2: count it when that token is part of the answer.
        batch.mask[i, max(0, s.answer_start - 2) : n] = True
    return batch


def eagle_loss(head: EagleHead, batch: Batch, settings: TrainSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss on one batch, and its parts (hidden loss, token loss, top-1 accuracy)."""
    noisy = batch.hidden + (torch.rand_like(batch.hidden) - 0.5) * settings.noise
    predicted, _ = head(batch.input_ids, noisy)
    mask = batch.mask
    hidden_loss = F.smooth_l1_loss(predicted[mask], batch.target_hidden[mask], reduction="none").mean(-1).mean()
    logits = head.logits(predicted[mask])
    token_loss = F.cross_entropy(logits, batch.target_ids[mask])
    loss = settings.hidden_weight * hidden_loss + settings.token_weight * token_loss
    accuracy = (logits.argmax(-1) == batch.target_ids[mask]).float().mean()
    return loss, {"vloss": hidden_loss.item(), "ploss": token_loss.item(), "acc": accuracy.item()}


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random) -> list[list[Sample]]:
    """One epoch of batches: shuffled samples packed up to ``batch_tokens`` padded rows each."""
    order = samples[:]
    rng.shuffle(order)
    out: list[list[Sample]] = []
    current: list[Sample] = []
    for s in order:
        longest = max([len(x.input_ids) for x in current] + [len(s.input_ids)])
        if current and longest * (len(current) + 1) > batch_tokens:
            out.append(current)
            current = []
        current.append(s)
    if current:
        out.append(current)
    return out


def _lr_at(step: int, settings: TrainSettings) -> float:
    # Linear warm-up, then linear decay to a tenth: short runs still end on a small step size.
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    frac = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (1.0 - 0.9 * min(1.0, frac))


def save_checkpoint(path: Path, head: EagleHead, optimizer: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def train(
    head: EagleHead, samples: list[Sample], out_dir: Path, settings: TrainSettings, target_config: dict[str, Any]
) -> dict[str, float]:
    """Train ``head`` (resuming from ``out_dir``'s checkpoint), save it; returns the last step's metrics."""
    out_dir.mkdir(parents=True, exist_ok=True)
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    step = 0
    ckpt = out_dir / CHECKPOINT
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        logger.info("resuming from %s at step %d", ckpt, step)
    rng = random.Random(settings.seed + step)
    torch.manual_seed(settings.seed + step)
    started, metrics = time.monotonic(), dict[str, float]()
    queue: list[list[Sample]] = []
    bar = tqdm(total=settings.steps, initial=step, desc="training", unit="step")
    while step < settings.steps:
        if settings.max_minutes and time.monotonic() - started > settings.max_minutes * 60:
            logger.info("time limit reached at step %d", step)
            break
        queue = queue or batches(samples, settings.batch_tokens, rng)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        loss, metrics = eagle_loss(head, make_batch(queue.pop()), settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{metrics['acc']:.2f}")
        if step % settings.checkpoint_every == 0:
            save_checkpoint(ckpt, head, optimizer, step)
    bar.close()
    save_checkpoint(ckpt, head, optimizer, step)
    save_head(head, out_dir, target_config)
    elapsed = time.monotonic() - started
    metrics.update(step=float(step), seconds=elapsed)
    return metrics
