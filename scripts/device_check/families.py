"""2. ``families``: our forward against Hugging Face's, per model family and dtype."""

from __future__ import annotations

import time
from typing import Any

import torch

from device_check.common import FAIL, PASS, Context
from device_check.models import tiny_config


def check_families(ctx: Context) -> None:
    """Our paged forward vs Hugging Face's on a prompt and continued decodes, per family and dtype."""
    from transformers import AutoModelForCausalLM

    from zerobubble.worker_svc.model import build_model

    dev = ctx.device
    length = 40
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        cfg = tiny_config(family)
        torch.manual_seed(4)
        hf: Any = None
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{family} {str(dtype)[6:]}"
            started = time.perf_counter()
            try:
                if hf is None:
                    hf = AutoModelForCausalLM.from_config(cfg).to(dev).eval()
                ref_model = hf.to(dtype)
                ours = build_model(cfg, dtype, dev)
                ours.load_weights(ref_model.state_dict())
                ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(5)).to(dev)
                with torch.inference_mode():
                    ref = ref_model(ids[None]).logits[0].float()
                    got = _paged_logits(ours, cfg, ids, dtype, dev)
                tol = 5e-2 if dtype == torch.bfloat16 else 2e-4
                scale = ref.abs().max().item()
                err = (got - ref).abs().max().item() / max(scale, 1e-6)
                agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
                ok = err <= tol
                ctx.add(
                    "families",
                    name,
                    PASS if ok else FAIL,
                    f"max |diff| / max |logit| = {err:.1e} (tolerance {tol:.0e}); argmax agreement {agree:.3f}",
                    rel_err=err,
                    argmax_agreement=agree,
                )
            except Exception as exc:
                ctx.add("families", name, FAIL, f"{type(exc).__name__}: {exc}")
            ctx.finish_last(started)


def _paged_logits(ours: Any, cfg: Any, ids: torch.Tensor, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """Our forward's logits for every position of ``ids``: a prefill chunk, a second chunk on
    top of it, then single-token decodes, over a paged cache of scattered blocks."""
    from zerobubble.kernels.attention import AttentionMetadata
    from zerobubble.kernels.slot_mapping import compute_slot_mapping
    from zerobubble.worker_svc.model import allocate_kv_cache

    block_size, num_blocks = 16, 64
    kv = allocate_kv_cache(cfg, num_blocks, block_size, dtype, dev)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6))[None, :8]
    table = table.to(torch.int32).to(dev)
    logits = []
    for lo, hi in ((0, 25), (25, 36), (36, 37), (37, 38), (38, 39), (39, 40)):
        qsl = torch.tensor([0, hi - lo], dtype=torch.int32, device=dev)
        pos = torch.arange(lo, hi, device=dev)
        seq_lens = torch.tensor([hi], dtype=torch.int32, device=dev)
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=table,
            max_query_len=hi - lo,
            max_seq_len=8 * block_size,
            slot_mapping=compute_slot_mapping(qsl, pos, table, block_size),
        )
        logits.append(ours.compute_logits(ours(ids[lo:hi], pos, meta, kv)))
    return torch.cat(logits)
