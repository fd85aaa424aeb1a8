"""Training an EAGLE-1 head on self-distilled samples (:mod:`zerobubble.tools.eagle_data`).

Row ``t`` of a sample gives the head token ``x[t+1]`` and the target's hidden state ``h[t]``
(with uniform noise, as EAGLE trains it to tolerate its own imprecise predictions); the head
predicts ``h[t+1]``, whose logits through the shared lm_head should give the target's next
choice. The loss, over the rows whose predicted token lies in the answer: smooth L1 of the
predicted against the target's hidden state (EAGLE's feature loss, which keeps a prediction fit
to be fed back as the next draft's input) plus ``token_weight`` x the cross-entropy against the
target's own distribution at ``t+1`` (as EAGLE-3 and HASS distil it): every position teaches the
whole distribution, not one token, and sampled answers teach as much as greedy ones. Both sets of
logits are taken over the draft vocabulary only, the ids the served head can propose: the full
vocabulary's product would cost most of a step.

Drafting feeds the head its own predictions after the first draft, which teacher forcing never
shows it. So each batch is also unrolled (``unroll`` further passes, as EAGLE-3's training-time
test and HASS do): pass ``d`` feeds row ``t`` the previous pass's prediction of ``h[t]`` and
attends as the ``d+1``-th draft of a chain does (:func:`chain_attention`), with the same targets;
the loss is the mean over the passes.

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

from zerobubble.kernels.fused import rms_norm_twin
from zerobubble.tools.eagle_data import Sample
from zerobubble.worker_svc.eagle import EagleHead, HeadLayer, _rotate, save_head

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True, slots=True)
class TrainSettings:
    """Optimizer and schedule; EAGLE's loss weights."""

    steps: int = 1900
    batch_tokens: int = 2048  # rows per step, summed over the batch's samples
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    noise: float = 0.2  # width of the uniform noise added to the input hidden states
    unroll: int = 2  # further passes fed the head's own predictions (chain positions 2, 3, ...)
    hidden_weight: float = 1.0
    token_weight: float = 1.0
    checkpoint_every: int = 50
    max_minutes: float = 0.0  # stop (with a checkpoint) after this long; 0 = no limit
    seed: int = 0
    # The products in bfloat16 under autocast (weights, optimizer and losses stay float32):
    # on a CPU with native bfloat16 a step takes about 0.6 x the float32 one.
    bf16: bool = False


@dataclass(slots=True)
class Batch:
    """Right-padded head inputs and targets ``[B, S(, H)]``; ``mask`` marks rows that count."""

    input_ids: torch.Tensor
    hidden: torch.Tensor
    target_hidden: torch.Tensor
    mask: torch.Tensor


def make_batch(samples: list[Sample]) -> Batch:
    """Head rows ``t = 0 .. T-3`` of each sample (the last two have no next token to predict)."""
    rows = max(len(s.input_ids) - 2 for s in samples)
    size = samples[0].hidden.shape[1]
    batch = Batch(
        input_ids=torch.zeros(len(samples), rows, dtype=torch.long),
        hidden=torch.zeros(len(samples), rows, size),
        target_hidden=torch.zeros(len(samples), rows, size),
        mask=torch.zeros(len(samples), rows, dtype=torch.bool),
    )
    for i, s in enumerate(samples):
        n = len(s.input_ids) - 2
        batch.input_ids[i, :n] = s.input_ids[1 : n + 1]
        batch.hidden[i, :n] = s.hidden[:n]
        batch.target_hidden[i, :n] = s.hidden[1 : n + 1]
        # Row t predicts token t + 2: count it when that token is part of the answer.
        batch.mask[i, max(0, s.answer_start - 2) : n] = True
    return batch


def _qkv(layer: HeadLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """The first layer's rotated queries, keys and values ``[B, heads, S, D]`` for its input ``x``."""
    spec, attn = layer.spec, layer.self_attn
    batch, seq, _ = x.shape
    out = []
    for proj, heads in ((attn.q_proj, spec.num_q_heads), (attn.k_proj, spec.num_kv_heads), (attn.v_proj, None)):
        out.append(proj(x).view(batch, seq, heads or spec.num_kv_heads, spec.head_dim).transpose(1, 2))
    if attn.q_norm is not None and attn.k_norm is not None:
        out[0] = rms_norm_twin(out[0], attn.q_norm.weight, spec.rms_norm_eps)
        out[1] = rms_norm_twin(out[1], attn.k_norm.weight, spec.rms_norm_eps)
    out[0], out[1] = _rotate(out[0], cos, sin), _rotate(out[1], cos, sin)
    return out


def _shift_rows(t: torch.Tensor, by: int) -> torch.Tensor:
    """``t [B, h, S, D]`` moved ``by`` rows later along S, zeros in front: row r holds row ``r - by``."""
    return t if by == 0 else F.pad(t, (0, 0, by, 0))[:, :, : t.shape[2]]


def chain_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of pass ``d = len(keys) - 1``'s queries as the drafting chain sees its context.

    Row ``t`` of pass ``d`` is the ``d+1``-th draft of a chain started after row ``t - d``: it sees
    pass 0's keys (the target's real hidden states) up to row ``t - d`` and, of each pass ``i``
    in ``1..d``, only the key at row ``t - d + i`` (the chain's own earlier drafts), as EAGLE-3's
    training-time test does. Rows ``t < d`` start no chain; they see row 0, and must not count.
    """
    group = q.shape[1] // keys[0].shape[1]
    d, seq = len(keys) - 1, q.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = [q @ keys[0].repeat_interleave(group, 1).transpose(-1, -2) * scale]
    rows = torch.arange(seq)[:, None]
    visible = (torch.arange(seq)[None, :] <= (rows - d).clamp(min=0)).to(q.device)
    scores[0] = scores[0].masked_fill(~visible, float("-inf"))
    shifted = [(_shift_rows(k, d - i), _shift_rows(v, d - i)) for i, (k, v) in enumerate(zip(keys, values)) if i]
    scores += [(q * k.repeat_interleave(group, 1)).sum(-1, keepdim=True) * scale for k, _ in shifted]
    weights = torch.cat(scores, dim=-1).softmax(-1)
    out = weights[..., :seq] @ values[0].repeat_interleave(group, 1)
    for i, (_, v) in enumerate(shifted):
        out = out + weights[..., seq + i : seq + i + 1] * v.repeat_interleave(group, 1)
    return out


def chain_pass(
    head: EagleHead, input_ids: torch.Tensor, hidden: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    """One pass of the head over rows ``(x[t+1], hidden[t])`` under :func:`chain_attention`.

    Appends this pass's keys and values to ``keys``/``values`` (pass 0's first); returns the predictions.
    """
    if len(head.layers) != 1:
        raise ValueError("chain passes are written for one-layer heads")
    layer: HeadLayer = head.layers[0]  # type: ignore[assignment]
    spec, seq = layer.spec, input_ids.shape[1]
    embeds = F.embedding(input_ids, head.shared.embed).to(hidden.dtype)
    x = head.fc(torch.cat((embeds, hidden), dim=-1))  # the first layer has no input norm
    q, k, v = _qkv(layer, x, head.rope_cos[:seq].to(x.dtype), head.rope_sin[:seq].to(x.dtype))
    keys.append(k)
    values.append(v)
    out = chain_attention(q, keys, values)
    x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(x.shape[0], seq, -1))
    return x + layer.mlp(rms_norm_twin(x, layer.post_attention_layernorm.weight, spec.rms_norm_eps))


def unrolled_predictions(
    head: EagleHead, input_ids: torch.Tensor, hidden: torch.Tensor, passes: int
) -> list[torch.Tensor]:
    """Per pass ``d``, the head's predictions ``[B, S, H]`` when row ``t`` is a chain's ``d+1``-th draft.

    Pass 0 reads ``hidden``; pass ``d`` reads, at row ``t``, pass ``d-1``'s prediction made at row
    ``t-1`` (detached), i.e. its own estimate of ``h[t]``; the tokens stay the real ones.
    """
    predicted, (k, v) = head(input_ids, hidden)
    out, keys, values = [predicted], [k], [v]
    for _ in range(1, passes):
        fed = torch.cat((hidden[:, :1], out[-1][:, :-1].detach()), dim=1)
        out.append(chain_pass(head, input_ids, fed, keys, values))
    return out


def eagle_loss(
    head: EagleHead, batch: Batch, settings: TrainSettings, vocab_rows: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's loss on one batch averaged over the unrolled passes, and pass 0's parts (and each
    pass's agreement with the target's most likely token), logits over ``vocab_rows [D, H]``."""
    noisy = batch.hidden + (torch.rand_like(batch.hidden) - 0.5) * settings.noise
    passes = unrolled_predictions(head, batch.input_ids, noisy, 1 + settings.unroll)
    target_hidden = batch.target_hidden[batch.mask]
    with torch.no_grad():
        target_probs = F.linear(target_hidden, vocab_rows).float().softmax(-1)
        target_choice = target_probs.argmax(-1)
    # Each counted row's index along the sequence: rows before d start no chain of length d + 1.
    row_index = torch.arange(batch.mask.shape[1]).expand_as(batch.mask)[batch.mask]
    total = torch.zeros(())
    metrics: dict[str, float] = {}
    for d, predicted in enumerate(passes):
        keep = row_index >= d
        rows = predicted[batch.mask][keep].float()
        hidden_loss = F.smooth_l1_loss(rows, target_hidden[keep])
        logits = F.linear(rows, vocab_rows).float()
        token_loss = -(target_probs[keep] * logits.log_softmax(-1)).sum(-1).mean()
        total = total + settings.hidden_weight * hidden_loss + settings.token_weight * token_loss
        accuracy = (logits.argmax(-1) == target_choice[keep]).float().mean().item()
        if d == 0:
            metrics.update(vloss=hidden_loss.item(), ploss=token_loss.item(), acc=accuracy)
        else:
            metrics[f"acc{d}"] = accuracy
    return total / len(passes), metrics


def batches(samples: list[Sample], batch_tokens: int, rng: random.Random, pool: int = 64) -> list[list[Sample]]:
    """One epoch of batches: samples packed up to ``batch_tokens`` padded rows each.

    The shuffled samples are taken ``pool`` at a time and sorted by length within a pool, so a
    batch holds similar lengths (little padding) and still differs from epoch to epoch; the
    batches' order is shuffled too.
    """
    order = samples[:]
    rng.shuffle(order)
    order = [s for i in range(0, len(order), pool) for s in sorted(order[i : i + pool], key=lambda s: len(s.input_ids))]
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
    rng.shuffle(out)
    return out


def _lr_at(step: int, settings: TrainSettings, time_used: float = 0.0) -> float:
    """Linear warm-up, then linear decay to a tenth: short runs still end on a small step size.

    The decay follows whichever runs out first, the steps or ``time_used`` (the fraction of
    ``max_minutes`` spent), so a run stopped by the time limit has decayed too.
    """
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    frac = max(time_used, (step - settings.warmup) / max(1, settings.steps - settings.warmup))
    return settings.lr * (1.0 - 0.9 * min(1.0, frac))


def save_checkpoint(path: Path, head: EagleHead, optimizer: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def train(
    head: EagleHead,
    samples: list[Sample],
    out_dir: Path,
    settings: TrainSettings,
    target_config: dict[str, Any],
    vocab: torch.Tensor,
) -> dict[str, float]:
    """Train ``head`` (resuming from ``out_dir``'s checkpoint) to draft from the token ids
    ``vocab``, save it; returns the last step's metrics."""
    vocab_rows = head.shared.lm_head[vocab].float()
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
        time_used = (time.monotonic() - started) / (settings.max_minutes * 60) if settings.max_minutes else 0.0
        if time_used > 1.0:
            logger.info("time limit reached at step %d", step)
            break
        queue = queue or batches(samples, settings.batch_tokens, rng)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings, time_used)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.bf16):
            loss, metrics = eagle_loss(head, make_batch(queue.pop()), settings, vocab_rows)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **{k: f"{v:.2f}" for k, v in metrics.items() if k.startswith("acc")})
        if step % settings.checkpoint_every == 0:
            save_checkpoint(ckpt, head, optimizer, step)
    bar.close()
    save_checkpoint(ckpt, head, optimizer, step)
    save_head(head, out_dir, target_config)
    elapsed = time.monotonic() - started
    metrics.update(step=float(step), seconds=elapsed)
    return metrics
