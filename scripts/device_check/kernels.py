"""1. ``kernels``: every Triton kernel against its torch twin on random inputs."""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from device_check.common import FAIL, PASS, SKIP, Compare, Context, near_tie_draws, tensors_close


def check_fused_kernels(case: Callable[..., None], dev: torch.device, gen: torch.Generator, small: bool) -> None:
    """The decoder layer's fused kernels (kernels/fused.py) against their twins, float32."""
    from zerobubble.kernels.fused import add_rms_norm, clamped_swiglu_mul, gelu_tanh_mul, qk_norm_rope, silu_mul

    num_tokens, hidden, heads, head_dim, inter = (5, 96, 6, 16, 160) if small else (64, 2048, 24, 128, 6144)
    x, residual = (torch.randn(num_tokens, hidden, generator=gen).to(dev) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(dev)
    case("add_rms_norm", lambda impl: add_rms_norm(x, residual, weight, 1e-6, impl=impl))
    qkv = torch.randn(num_tokens, (heads + 4) * head_dim, generator=gen).to(dev)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dev)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dev)
    norm = torch.randn(heads, head_dim, generator=gen).to(dev)
    case("qk_norm_rope", lambda impl: qk_norm_rope(qkv, cos, sin, norm, heads, head_dim, 1e-6, impl=impl))
    gate_up = torch.randn(num_tokens, 2 * inter, generator=gen).to(dev)
    case("silu_mul", lambda impl: silu_mul(gate_up, impl=impl))
    case("gelu_tanh_mul", lambda impl: gelu_tanh_mul(gate_up, impl=impl))
    # gpt-oss's limit lowered to 1.5 so that it clamps unit-scale inputs.
    case("clamped_swiglu_mul", lambda impl: clamped_swiglu_mul(gate_up, impl, alpha=1.702, limit=1.5))
    check_token_mask(case, dev, gen, small)
    check_moe_kernels(case, dev, gen, small)


def check_moe_kernels(case: Callable[..., None], dev: torch.device, gen: torch.Generator, small: bool) -> None:
    """The routed experts' grouped product (kernels/moe.py) against its twin over a ragged load:
    half the experts idle, one with 40 % of the rows; decode-sized and prefill-sized, float32
    and bfloat16 (the twin on the same bfloat16 inputs)."""
    from zerobubble.kernels.moe import grouped_linear

    num_experts, hidden, outputs = (8, 96, 80) if small else (128, 256, 192)
    for rows, dtype in itertools.product((40, 160) if small else (512, 2048), (torch.float32, torch.bfloat16)):
        heavy = torch.full((rows * 2 // 5,), 3)
        spread = torch.randint(0, num_experts // 2, (rows - len(heavy),), generator=gen)
        counts = torch.bincount(torch.cat((heavy, spread)), minlength=num_experts)
        offsets = torch.cat((torch.zeros(1, dtype=torch.long), counts.cumsum(0))).to(dev)
        x = torch.randn(rows, hidden, generator=gen).to(dtype).to(dev)
        weight = (torch.randn(num_experts, outputs, hidden, generator=gen) * hidden**-0.5).to(dtype).to(dev)
        name = f"grouped_linear rows={rows} {str(dtype)[6:]}"
        tol = 1e-4 if dtype == torch.float32 else 3e-2  # bfloat16: a rounding step of outputs near 1
        compare = functools.partial(_first_close, tol=tol)
        case(name, lambda impl, x=x, w=weight, offsets=offsets: grouped_linear(x, w, offsets, impl=impl), compare)


def _first_close(ref: tuple, out: tuple, tol: float) -> tuple[bool, str]:
    return tensors_close(ref[0], out[0], atol=tol, rtol=tol)


def check_token_mask(case: Callable[..., None], dev: torch.device, gen: torch.Generator, small: bool) -> None:
    """The grammar-mask kernel (kernels/token_mask.py) against its twin: masked rows of the logits."""
    from zerobubble.kernels.token_mask import apply_token_bitmask

    num_rows, vocab = (6, 100) if small else (256, 151_936)
    logits = torch.randn(num_rows, vocab, generator=gen).to(dev)
    rows = torch.randperm(num_rows, generator=gen)[: num_rows // 2].to(dev)
    bitmask = torch.randint(-(2**31), 2**31, (len(rows), -(-vocab // 32)), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).to(dev)

    def masked(impl: str) -> torch.Tensor:
        out = logits.clone()
        apply_token_bitmask(out, rows, bitmask, impl=impl)  # type: ignore[arg-type]
        return out

    case("apply_token_bitmask", masked)


def _rand_ints(gen: torch.Generator, dev: torch.device, lo: int, hi: int, *shape: int) -> torch.Tensor:
    """Random int32 values in [lo, hi) drawn on the CPU from ``gen`` (reproducible), on ``dev``."""
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32).to(dev)


@dataclass(frozen=True, slots=True)
class _KernelShape:
    """The sizes of the kernel cases' batch: tiny in a dry run, a real model's otherwise."""

    num_reqs: int
    block_size: int
    num_blocks: int
    max_blocks: int  # block-table columns
    k: int  # draft slots per decode row
    vocab: int


@dataclass(slots=True)
class _KernelBatch:
    """The random state and batch every kernel case shares (drawn once, in a fixed order)."""

    dev: torch.device
    gen: torch.Generator
    shape: _KernelShape
    block_table: torch.Tensor
    seq_len: torch.Tensor
    last_token: torch.Tensor
    drafts: torch.Tensor
    num_drafts: torch.Tensor
    history: torch.Tensor
    req_slots: torch.Tensor
    is_decode: torch.Tensor
    q_lens: torch.Tensor

    def ints(self, lo: int, hi: int, *shape: int) -> torch.Tensor:
        return _rand_ints(self.gen, self.dev, lo, hi, *shape)

    def flat_batch(self, lens: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        """``lens[r]`` query tokens for request r after its context: (query_start_loc, tokens,
        each token's position)."""
        dev = self.dev
        num = int(lens.sum())
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(torch.int32).to(dev)
        pos = self.seq_len[self.req_slots.long()].repeat_interleave(lens.to(dev), output_size=num).long()
        return starts, num, pos + torch.cat([torch.arange(int(n)) for n in lens]).to(dev)


def _kernel_batch(dev: torch.device, gen: torch.Generator, small: bool) -> _KernelBatch:
    """Distinct blocks per slot; contexts that fit their tables; a mix of prefill and decode rows."""
    num_reqs, block_size, num_blocks = (3, 4, 48) if small else (16, 16, 1024)
    max_blocks, k, vocab = (6, 3, 64) if small else (48, 3, 32000)
    num_slots = num_reqs + 2
    perm = torch.randperm(num_blocks, generator=gen)[: num_slots * max_blocks].view(num_slots, max_blocks)
    block_table = perm.to(torch.int32).to(dev)
    seq_len = _rand_ints(gen, dev, 1, (max_blocks - 2) * block_size, num_slots)
    last_token = _rand_ints(gen, dev, 0, vocab, num_slots)
    drafts = _rand_ints(gen, dev, 0, vocab, num_slots, k)
    num_drafts = _rand_ints(gen, dev, 0, k + 1, num_slots)
    history = _rand_ints(gen, dev, 0, 8, num_blocks, block_size)  # small alphabet: n-grams repeat
    req_slots = torch.randperm(num_slots, generator=gen)[:num_reqs].to(torch.int32).to(dev)
    is_decode = (torch.arange(num_reqs) % 2 == 0).to(dev)
    q_lens = torch.where(is_decode.cpu(), 1 + k, torch.tensor(block_size + 3))
    return _KernelBatch(
        dev,
        gen,
        _KernelShape(num_reqs, block_size, num_blocks, max_blocks, k, vocab),
        block_table,
        seq_len,
        last_token,
        drafts,
        num_drafts,
        history,
        req_slots,
        is_decode,
        q_lens,
    )


def _kernel_case(ctx: Context, section: str) -> Callable[..., None]:
    """``case(name, run, compare=None)``: one record comparing ``run("torch")`` with ``run("triton")``."""

    def case(name: str, run: Callable[[str], Any], compare: Compare | None = None) -> None:
        """The torch twin's outputs against Triton's: every one close (`tensors_close`), or ``compare``."""
        started = time.perf_counter()
        try:
            ref, out = run("torch"), run("triton")
            ref = ref if isinstance(ref, tuple) else (ref,)
            out = out if isinstance(out, tuple) else (out,)
            if compare is not None:
                ok, detail = compare(ref, out)
            else:
                results = [tensors_close(a, b) for a, b in zip(ref, out)]
                ok, detail = all(r[0] for r in results), "; ".join(r[1] for r in results)
            ctx.add(section, name, PASS if ok else FAIL, detail)
        except Exception as exc:  # a kernel that fails to compile is a finding, not a crash
            ctx.add(section, name, FAIL, f"{type(exc).__name__}: {exc}")
        ctx.finish_last(started)

    return case


def _check_step_kernels(case: Callable[..., None], b: _KernelBatch) -> None:
    """The kernels that prepare a step's inputs and fold its results back into the state."""
    from zerobubble.kernels.inputs import assemble_inputs
    from zerobubble.kernels.ngram import ngram_propose
    from zerobubble.kernels.seq_lens import update_state
    from zerobubble.kernels.slot_mapping import compute_slot_mapping

    dev, num_reqs, k = b.dev, b.shape.num_reqs, b.shape.k
    qsl, num_tokens, positions = b.flat_batch(b.q_lens)
    prefill_ids = b.ints(0, b.shape.vocab, num_tokens)
    tables = b.block_table[b.req_slots.long()]
    case("slot_mapping", lambda impl: compute_slot_mapping(qsl, positions, tables, b.shape.block_size, impl=impl))

    def assemble(impl: str) -> tuple:
        hist = b.history.clone()
        out = assemble_inputs(
            b.req_slots,
            qsl,
            b.is_decode,
            prefill_ids,
            b.seq_len,
            b.last_token,
            b.drafts,
            b.num_drafts,
            b.block_table,
            hist,
            b.shape.block_size,
            impl=impl,
        )
        return (*out, hist)

    case("assemble_inputs", assemble)

    accepted, sampled = b.ints(0, k + 1, num_reqs), b.ints(0, b.shape.vocab, num_reqs)

    def update(impl: str) -> tuple:
        state = [b.seq_len.clone(), b.last_token.clone(), b.num_drafts.clone()]
        update_state(
            b.req_slots,
            b.is_decode,
            b.q_lens.to(torch.int32).to(dev),
            accepted,
            torch.ones(num_reqs, dtype=torch.bool, device=dev),
            sampled,
            *state,
            impl=impl,
        )
        return tuple(state)

    case("update_state", update)
    case(
        "ngram_propose",
        lambda impl: ngram_propose(
            b.req_slots, b.seq_len, b.last_token, b.block_table, b.history, b.shape.block_size, 2, 4, k, impl=impl
        ),
    )


def _check_sampling_kernels(case: Callable[..., None], b: _KernelBatch, cuda: bool) -> None:
    """Keyed random numbers, draft acceptance and rejection sampling."""
    from zerobubble.kernels.keyed_random import keyed_uniform
    from zerobubble.kernels.verify import count_accepted, rejection_sample

    dev, gen, num_reqs, k, vocab = b.dev, b.gen, b.shape.num_reqs, b.shape.k, b.shape.vocab
    seeds = torch.randint(0, 2**62, (num_reqs,), generator=gen).to(dev)
    pos = b.seq_len[b.req_slots.long()].long()
    case("keyed_uniform", lambda impl: keyed_uniform(seeds, pos, vocab, impl=impl))
    targets = b.ints(0, vocab, num_reqs, k + 1)
    fed, num_fed = b.drafts[b.req_slots.long()], b.num_drafts[b.req_slots.long()]
    case("count_accepted", lambda impl: count_accepted(targets, fed, num_fed, impl=impl))
    p = torch.softmax(torch.randn(num_reqs, k + 1, vocab, generator=gen), -1).to(dev)
    q = torch.softmax(torch.randn(num_reqs, k, vocab, generator=gen), -1).to(dev)
    draft_tok = torch.multinomial(q.view(-1, vocab).cpu(), 1, generator=gen).view(num_reqs, k).to(dev)
    fed_rs = b.num_drafts[b.req_slots.long()]
    case(
        "rejection_sample",
        lambda impl: rejection_sample(p, q, draft_tok, fed_rs, seeds, pos, impl=impl),
        # The interpreter computes log and division exactly, as torch does; CUDA does not.
        compare=near_tie_draws if cuda else None,
    )


def _attention_outputs(
    impl: str,
    b: _KernelBatch,
    cfg: Any,
    dtype: torch.dtype,
    lens: torch.Tensor,
    batch: tuple,
    softcap: float = 0.0,
    sinks: bool = False,
) -> tuple:
    """``write_kv_cache`` then ``paged_attention`` over random caches (seeded: the same for each
    impl): the attention output and both caches; ``sinks``: gpt-oss's, spread over the scores' range."""
    from zerobubble.kernels.attention import AttentionMetadata, paged_attention, write_kv_cache
    from zerobubble.kernels.slot_mapping import compute_slot_mapping
    from zerobubble.worker_svc.model import allocate_kv_cache

    dev = b.dev
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    qsl, num_tokens, positions = batch
    torch.manual_seed(3)
    ((k_cache, v_cache),) = allocate_kv_cache(cfg, b.shape.num_blocks, b.shape.block_size, dtype, dev)
    k_cache.copy_(torch.randn(k_cache.shape, dtype=dtype).to(dev))
    v_cache.copy_(torch.randn(v_cache.shape, dtype=dtype).to(dev))
    new_k = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype).to(dev)
    new_v = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype).to(dev)
    q_in = torch.randn(num_tokens, heads, head_dim, dtype=dtype).to(dev)
    slots = compute_slot_mapping(qsl, positions, b.block_table[b.req_slots.long()], b.shape.block_size)
    write_kv_cache(new_k, new_v, k_cache, v_cache, slots, impl=impl)
    ends = (positions.view(-1)[qsl[1:].long() - 1] + 1).to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=ends,
        block_tables=b.block_table[b.req_slots.long()],
        max_query_len=int(lens.max()),
        max_seq_len=b.shape.max_blocks * b.shape.block_size,
        slot_mapping=slots,
    )
    sink_logits = torch.linspace(-2.0, 3.0, heads).to(dev) if sinks else None
    out = paged_attention(q_in, k_cache, v_cache, meta, head_dim**-0.5, impl=impl, softcap=softcap, sinks=sink_logits)
    return out, k_cache, v_cache


def _check_attention_kernels(ctx: Context, section: str, b: _KernelBatch, small: bool) -> None:
    """``write_kv_cache`` + ``paged_attention`` on a mixed batch and on decodes alone, float32 and
    bfloat16, and on the mixed batch with Gemma 2's soft-capped scores and with gpt-oss's sinks."""
    from transformers import LlamaConfig

    heads, kv_heads, head_dim = (4, 2, 16) if small else (16, 8, 128)
    cfg = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=1,
        vocab_size=b.shape.vocab,
        intermediate_size=64,
    )
    # The mixed batch runs the attention kernel's prefill tiles; decode rows alone, its small ones.
    decodes = torch.full_like(b.q_lens, 1 + b.shape.k)
    batches = {"": (b.q_lens, 0.0, False), " decodes": (decodes, 0.0, False)}
    batches[" soft-capped"] = (b.q_lens, 2.0, False)  # a cap that bites on unit-scale scores
    batches[" sinks"], batches[" decodes sinks"] = (b.q_lens, 0.0, True), (decodes, 0.0, True)
    for (batch_name, (lens, softcap, sinks)), dtype in itertools.product(
        batches.items(), (torch.float32, torch.bfloat16)
    ):
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        batch = b.flat_batch(lens)
        name = f"write_kv_cache + paged_attention {str(dtype)[6:]}{batch_name}"
        started = time.perf_counter()
        try:
            ref = _attention_outputs("torch", b, cfg, dtype, lens, batch, softcap, sinks)
            out = _attention_outputs("triton", b, cfg, dtype, lens, batch, softcap, sinks)
            results = [tensors_close(x, y, atol=tol, rtol=tol) for x, y in zip(ref, out)]
            ok = all(r[0] for r in results)
            ctx.add(section, name, PASS if ok else FAIL, "; ".join(r[1] for r in results))
        except Exception as exc:
            ctx.add(section, name, FAIL, f"{type(exc).__name__}: {exc}")
        ctx.finish_last(started)


def check_kernels(ctx: Context) -> None:
    """Each Triton kernel against its torch twin on the same random inputs."""
    from zerobubble.kernels._triton import HAS_TRITON

    section = "kernels"
    if not HAS_TRITON:
        ctx.add(section, "triton", SKIP, "triton is not installed")
        return
    gen = torch.Generator().manual_seed(1)
    batch = _kernel_batch(ctx.device, gen, ctx.dry_run)
    case = _kernel_case(ctx, section)
    _check_step_kernels(case, batch)
    _check_sampling_kernels(case, batch, ctx.cuda)
    check_fused_kernels(case, ctx.device, gen, ctx.dry_run)
    _check_attention_kernels(ctx, section, batch, ctx.dry_run)
