"""One-shot accelerator check: everything a GPU run must confirm, in one command.

``scripts/device_check.sh OUT_DIR`` (or ``python scripts/device_check.py OUT_DIR``) runs, on CUDA:

1. ``kernels``: every Triton kernel compiled for CUDA against its torch twin on random inputs;
2. ``families``: our forward against Hugging Face's for Llama, Qwen2, Qwen3 and Mistral (tiny
   random configs), float32 and bfloat16;
3. ``service``: greedy output of the real service (``zerobubble serve``, gRPC on loopback) on a
   tiny random Llama against Hugging Face ``generate`` on the same device;
4. ``sync_free``: steady-state steps (n-gram and EAGLE-head decodes, prefill chunks) under
   ``torch.cuda.set_sync_debug_mode("error")``, so any host synchronisation raises;
5. ``throughput``: async ÷ sync and n-gram ÷ none at 2 / 8 / 16 prompts on a Qwen3-1.7B-shaped
   random-weight model in bfloat16 (and an EAGLE-1 head of that shape, random weights: its
   drafts are rarely accepted, so its rows show the head's cost, not its gain), CUDA graphs on
   and off, with the GPU busy fraction measured from CUDA events (the share of the run's GPU timeline covered by steps);
6. ``served``: the same model behind the real services (a ``zerobubble worker`` process on the
   device, sync and async ``zerobubble scheduler`` processes alternating in front of it, gRPC
   clients) at 16 / 64 / 256 requests, n-gram on and off, CUDA graphs on and off.

Nothing is downloaded: models are random weights of the named shapes, and tokenizers are
generated word-level vocabularies. It writes ``device_check.json`` and ``device_check.md`` to
OUT_DIR. ``--dry-run`` runs the same code on the CPU at tiny shapes (Triton under its
interpreter); parts that need CUDA are reported as skipped. A default-suite test runs it.

It is meant to run once, unattended, on a machine lent for minutes, so whatever happens it
leaves a report: each section runs in a process of its own (a CUDA error that poisons the
context, or a hang, costs that section only), the report is rewritten after every section, the
whole run keeps to ``--time-budget`` seconds (a section still running then is stopped and
reported, later ones are reported as skipped), and SIGTERM writes what was found before exiting.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerobubble.request_options import SamplingOptions, StoppingOptions
from zerobubble.tools.launch import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
# Runnable as `python scripts/device_check.py` from a checkout that is not pip-installed.
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # bench_sim, for the `served` section
# Triton decides between compiling and interpreting when a kernel is defined, so the interpreter
# must be chosen before `kernels` is imported (only the CPU dry run uses it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

logger = logging.getLogger("device_check")

PASS, FAIL, SKIP = "pass", "fail", "skip"


class OutOfTime(BaseException):
    """SIGTERM (the wrapper's timeout) arrived: stop here and write what was found.

    A `BaseException`, so the sections' own ``except Exception`` do not swallow it.
    """


@dataclass(slots=True)
class Record:
    """One line of the report."""

    section: str
    name: str
    status: str
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(slots=True)
class Context:
    """What every section gets: the device, the shapes to use, where to write."""

    device: torch.device
    dry_run: bool
    out_dir: Path
    records: list[Record] = field(default_factory=list)
    deadline: float = float("inf")  # time.perf_counter() by which the sections must be done
    part_file: Path | None = None  # a section's own process: its records so far, after each

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def add(self, section: str, name: str, status: str, detail: str = "", **values: Any) -> None:
        self.records.append(Record(section, name, status, detail, values))
        logger.info("%-10s %-40s %s %s", section, name, status.upper(), detail)
        self._save_part()

    def finish_last(self, started: float) -> None:
        """Time the latest record from ``started`` (and save it again with its time)."""
        self.records[-1].seconds = time.perf_counter() - started
        self._save_part()

    def _save_part(self) -> None:
        if self.part_file is not None:  # the parent reads them even if this process is killed
            _write_atomic(self.part_file, json.dumps([asdict(r) for r in self.records]))


# ----------------------------------------------------------------------------------- helpers


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4) -> tuple[bool, str]:
    if a.shape != b.shape:
        return False, f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    if not a.is_floating_point():
        diff = int((a != b).sum())
        return diff == 0, f"{diff} of {a.numel()} differ"
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    ok = bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol))
    return ok, f"max abs diff {err:.2e}"


Compare = Callable[[tuple, tuple], tuple[bool, str]]


def _near_tie_draws(ref: tuple, out: tuple) -> tuple[bool, str]:
    """``rejection_sample``'s (tokens, accepted counts) of the torch twin and the kernel on CUDA.

    Triton's float32 log and division are approximate there; a draw is an exponential race
    whose winner has a tiny -log(u), so a near tie may go to the other token. The acceptance
    counts must agree; at most 1/32 of the tokens may differ.
    """
    (ref_tokens, ref_accepted), (tokens, num_accepted) = ref, out
    num_diff = int((tokens != ref_tokens).sum())
    same_counts = bool(torch.equal(num_accepted, ref_accepted))
    ok = same_counts and num_diff <= max(1, tokens.numel() // 32)
    return ok, f"accepted counts {'equal' if same_counts else 'DIFFER'}; {num_diff} of {tokens.numel()} tokens differ"


def word_tokenizer_json(vocab_size: int) -> str:
    """A real `tokenizers` JSON whose ids 0..vocab_size-1 are the words ``t0``, ``t1``, ...

    Random-weight models emit any id of their vocabulary; every one of them must detokenize.
    The last id is the EOS token.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab["<eos>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


def random_state_dict(hf_config: Any, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the shapes Hugging Face's class for ``hf_config`` declares.

    Built on the target device without instantiating the HF module, so a 1.7B-parameter model
    costs a second, not a minute of CPU initialisation.
    """
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {
            name: (tuple(p.shape), name.endswith("norm.weight"))
            for name, p in AutoModelForCausalLM.from_config(hf_config).state_dict().items()
        }
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, (shape, is_norm) in shapes.items():
        if is_norm:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        else:
            out[name] = 0.02 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        out[name] = out[name].to(dtype)
    return out


def write_model_dir(path: Path, hf_model: Any, vocab_size: int) -> Path:
    """A Hugging Face directory the worker can load: weights, config, generated tokenizer."""
    hf_model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, vocab_size)
    return path


def write_random_model_dir(path: Path, hf_config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Path:
    """A Hugging Face directory of random weights of ``hf_config``'s shape, written without
    instantiating the HF module (`random_state_dict`), so a 1.7B model takes seconds."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    weights = {name: t.contiguous().cpu() for name, t in random_state_dict(hf_config, device, dtype, seed).items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(path)
    _write_tokenizer(path, hf_config.vocab_size)
    return path


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    (path / "tokenizer.json").write_text(word_tokenizer_json(vocab_size))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))


def in_memory_model(hf_config: Any, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A `LoadedModel` with random weights of ``hf_config``'s shape (no files)."""
    from zerobubble.worker_svc.model import build_model
    from zerobubble.worker_svc.model_loader import LoadedModel

    model = build_model(hf_config, dtype, device)
    model.load_weights(random_state_dict(hf_config, device, dtype, seed))
    return LoadedModel(
        name="random",
        path=Path("."),
        hf_config=hf_config,
        model=model,
        tokenizer_file=Path("tokenizer.json"),
        eos_token_ids=[hf_config.vocab_size - 1],
        max_model_len=int(hf_config.max_position_embeddings),
    )


def tiny_config(family: str, **overrides: Any) -> Any:
    """A 2-layer random config of one family (the families of tests/inprocess/test_model_families.py)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    common.update(overrides)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[family]
    extra = {"mistral": dict(sliding_window=24), "qwen3": dict(head_dim=16)}.get(family, {})
    return cls(**common, **extra)


def qwen3_1p7b_config(dry_run: bool) -> Any:
    """Qwen3-1.7B's shape (28 layers, hidden 2048, 16/8 heads of 128, vocab 151936); tiny in a dry run."""
    from transformers import Qwen3Config

    if dry_run:
        return Qwen3Config(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
        )
    return Qwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


# ----------------------------------------------------------------------------------- 1. kernels


def check_fused_kernels(case: Callable[..., None], dev: torch.device, gen: torch.Generator, small: bool) -> None:
    """The decoder layer's fused kernels (kernels/fused.py) against their twins, float32."""
    from zerobubble.kernels.fused import add_rms_norm, qk_norm_rope, silu_mul

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
    check_token_mask(case, dev, gen, small)


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


@dataclass(slots=True)
class _KernelBatch:
    """The random state and batch every kernel case shares (drawn once, in a fixed order)."""

    dev: torch.device
    gen: torch.Generator
    num_reqs: int
    block_size: int
    num_blocks: int
    max_blocks: int
    k: int
    vocab: int
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
        num_reqs,
        block_size,
        num_blocks,
        max_blocks,
        k,
        vocab,
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
        """The torch twin's outputs against Triton's: every one close (`_close`), or ``compare``."""
        started = time.perf_counter()
        try:
            ref, out = run("torch"), run("triton")
            ref = ref if isinstance(ref, tuple) else (ref,)
            out = out if isinstance(out, tuple) else (out,)
            if compare is not None:
                ok, detail = compare(ref, out)
            else:
                results = [_close(a, b) for a, b in zip(ref, out)]
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

    dev, num_reqs, k = b.dev, b.num_reqs, b.k
    qsl, num_tokens, positions = b.flat_batch(b.q_lens)
    prefill_ids = b.ints(0, b.vocab, num_tokens)
    case(
        "slot_mapping",
        lambda impl: compute_slot_mapping(qsl, positions, b.block_table[b.req_slots.long()], b.block_size, impl=impl),
    )

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
            b.block_size,
            impl=impl,
        )
        return (*out, hist)

    case("assemble_inputs", assemble)

    accepted, sampled = b.ints(0, k + 1, num_reqs), b.ints(0, b.vocab, num_reqs)

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
            b.req_slots, b.seq_len, b.last_token, b.block_table, b.history, b.block_size, 2, 4, k, impl=impl
        ),
    )


def _check_sampling_kernels(case: Callable[..., None], b: _KernelBatch, cuda: bool) -> None:
    """Keyed random numbers, draft acceptance and rejection sampling."""
    from zerobubble.kernels.keyed_random import keyed_uniform
    from zerobubble.kernels.verify import count_accepted, rejection_sample

    dev, gen, num_reqs, k, vocab = b.dev, b.gen, b.num_reqs, b.k, b.vocab
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
        compare=_near_tie_draws if cuda else None,
    )


def _attention_outputs(
    impl: str, b: _KernelBatch, cfg: Any, dtype: torch.dtype, lens: torch.Tensor, batch: tuple
) -> tuple:
    """``write_kv_cache`` then ``paged_attention`` over random caches (seeded: the same for each
    impl): the attention output and both caches."""
    from zerobubble.kernels.attention import AttentionMetadata, paged_attention, write_kv_cache
    from zerobubble.kernels.slot_mapping import compute_slot_mapping
    from zerobubble.worker_svc.model import allocate_kv_cache

    dev = b.dev
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    qsl, num_tokens, positions = batch
    torch.manual_seed(3)
    ((k_cache, v_cache),) = allocate_kv_cache(cfg, b.num_blocks, b.block_size, dtype, dev)
    k_cache.copy_(torch.randn(k_cache.shape, dtype=dtype).to(dev))
    v_cache.copy_(torch.randn(v_cache.shape, dtype=dtype).to(dev))
    new_k = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype).to(dev)
    new_v = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype).to(dev)
    q_in = torch.randn(num_tokens, heads, head_dim, dtype=dtype).to(dev)
    slots = compute_slot_mapping(qsl, positions, b.block_table[b.req_slots.long()], b.block_size)
    write_kv_cache(new_k, new_v, k_cache, v_cache, slots, impl=impl)
    ends = (positions.view(-1)[qsl[1:].long() - 1] + 1).to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=ends,
        block_tables=b.block_table[b.req_slots.long()],
        max_query_len=int(lens.max()),
        max_seq_len=b.max_blocks * b.block_size,
        slot_mapping=slots,
    )
    out = paged_attention(q_in, k_cache, v_cache, meta, head_dim**-0.5, impl=impl)
    return out, k_cache, v_cache


def _check_attention_kernels(ctx: Context, section: str, b: _KernelBatch, small: bool) -> None:
    """``write_kv_cache`` + ``paged_attention`` on a mixed batch and on decodes alone, float32 and
    bfloat16."""
    from transformers import LlamaConfig

    heads, kv_heads, head_dim = (4, 2, 16) if small else (16, 8, 128)
    cfg = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        num_hidden_layers=1,
        vocab_size=b.vocab,
        intermediate_size=64,
    )
    # The mixed batch runs the attention kernel's prefill tiles; decode rows alone, its small ones.
    batches = {"": b.q_lens, " decodes": torch.full_like(b.q_lens, 1 + b.k)}
    for (batch_name, lens), dtype in itertools.product(batches.items(), (torch.float32, torch.bfloat16)):
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        batch = b.flat_batch(lens)
        name = f"write_kv_cache + paged_attention {str(dtype)[6:]}{batch_name}"
        started = time.perf_counter()
        try:
            ref = _attention_outputs("torch", b, cfg, dtype, lens, batch)
            out = _attention_outputs("triton", b, cfg, dtype, lens, batch)
            results = [_close(x, y, atol=tol, rtol=tol) for x, y in zip(ref, out)]
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


# ----------------------------------------------------------------------------------- 2. families


def check_families(ctx: Context) -> None:
    """Our paged forward vs Hugging Face's on a prompt and continued decodes, per family and dtype."""
    from transformers import AutoModelForCausalLM

    from zerobubble.kernels.attention import AttentionMetadata
    from zerobubble.kernels.slot_mapping import compute_slot_mapping
    from zerobubble.worker_svc.model import allocate_kv_cache, build_model

    dev = ctx.device
    block_size, num_blocks, length = 16, 64, 40
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
                    kv = allocate_kv_cache(cfg, num_blocks, block_size, dtype, dev)
                    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(6))[None, :8]
                    table = table.to(torch.int32).to(dev)
                    logits = []
                    # A prefill chunk, a second chunk on top of it, then single-token decodes.
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
                    got = torch.cat(logits)
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


# ----------------------------------------------------------------------------------- 3. service


def _hf_greedy(hf: Any, cfg: Any, prompts: list[list[int]], max_tokens: int, device: torch.device) -> list[list[int]]:
    """Hugging Face ``generate``'s greedy continuation of each prompt (the last token id is EOS)."""
    from transformers import GenerationConfig

    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=GenerationConfig(
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=cfg.vocab_size - 1,
                    pad_token_id=cfg.vocab_size - 1,
                ),
            )
            expected.append(out[0, len(prompt) :].tolist())
    return expected


def _serve_command(ctx: Context, model_dir: Path, port: int, spec: str, graphs: bool) -> list[str]:
    """The `zerobubble serve` command line for one service check."""
    cmd = [
        sys.executable,
        "-m",
        "zerobubble",
        "serve",
        "--model",
        str(model_dir),
        "--device",
        ctx.device.type,
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--metrics-port",
        "-1",
        "--http-port",
        "-1",
        "--spec-method",
        spec,
        "--max-num-seqs",
        "8",
        "--log-level",
        "warning",
        "--cuda-graphs" if graphs else "--no-cuda-graphs",
    ]
    if ctx.device.type == "cpu":
        cmd += ["--kv-cache-memory-gb", "0.05"]
    else:
        cmd += ["--gpu-memory-utilization", "0.1"]  # ~12 GB of KV on an H200: plenty, quick to set up
    return cmd


def _served_greedy(
    ctx: Context, proc: subprocess.Popen, port: int, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """The server's greedy tokens for each prompt, once it is ready (fails at once if it died)."""
    import asyncio

    import grpc

    from zerobubble.client import build_request, complete

    async def run() -> list[list[int]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            deadline = time.monotonic() + min(90.0, max(ctx.time_left(), 5.0))
            while True:  # ready, or fail at once if the server died
                try:
                    await asyncio.wait_for(channel.channel_ready(), 1)
                    break
                except asyncio.TimeoutError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the server did not come up") from None
            done = await asyncio.gather(
                *(
                    complete(
                        channel,
                        build_request(token_ids=p, max_tokens=max_tokens, temperature=0.0),
                        timeout=60,
                    )
                    for p in prompts
                )
            )
            return [list(c.token_ids) for c in done]

    return asyncio.run(run())


def _check_one_server(
    ctx: Context,
    cmd: list[str],
    log_path: Path,
    name: str,
    port: int,
    prompts: list[list[int]],
    max_tokens: int,
    expected: list[list[int]],
) -> None:
    """Start one server, compare its greedy tokens with ``expected``, stop it: one record."""
    # The server's output goes to a file: a pipe nobody reads while it runs can fill and block it.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    num_prompts = len(prompts)
    try:
        got = _served_greedy(ctx, proc, port, prompts, max_tokens)
        mismatches = [i for i in range(num_prompts) if got[i] != expected[i]]
        ctx.add(
            "service",
            name,
            FAIL if mismatches else PASS,
            f"{num_prompts - len(mismatches)}/{num_prompts} prompts identical"
            + (f"; first differing prompt {mismatches[0]}" if mismatches else ""),
        )
    except Exception as exc:
        _stop(proc)  # its last words are in the log then
        output = log_path.read_text(errors="replace")[-2000:]
        ctx.add("service", name, FAIL, f"{type(exc).__name__}: {exc}; server output: {output}")
    finally:
        _stop(proc)


def check_service(ctx: Context) -> None:
    """Greedy tokens of `zerobubble serve` on this device against Hugging Face `generate`."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config("llama", vocab_size=512)
    torch.manual_seed(7)
    hf = LlamaForCausalLM(cfg).eval()
    max_tokens = 24
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (int(n),), generator=gen).tolist() for n in (5, 17, 33, 60)]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "tiny-llama", hf, cfg.vocab_size)
        hf = hf.to(ctx.device)
        expected = _hf_greedy(hf, cfg, prompts, max_tokens, ctx.device)
        port = free_port()
        # The dry run starts one server (the n-gram path covers the plain one's code as well);
        # on CUDA each spec runs with CUDA graphs off and on (pure decode steps replay graphs).
        specs = ("ngram",) if ctx.dry_run else ("none", "ngram")
        for spec, graphs in [(s, g) for s in specs for g in ((False, True) if ctx.cuda else (False,))]:
            cmd = _serve_command(ctx, model_dir, port, spec, graphs)
            log_path = ctx.out_dir / f"service-{spec}{'-graphs' if graphs else ''}.log"
            name = f"greedy vs HF, spec={spec}" + (", cuda_graphs=True" if graphs else "")
            _check_one_server(ctx, cmd, log_path, name, port, prompts, max_tokens, expected)
            ctx.finish_last(started)
            started = time.perf_counter()


# --------------------------------------------------------------------------- 4/5. steps driven


def _stop(proc: subprocess.Popen) -> None:
    """Terminate a server (kill it if it does not end within 15 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_scheduler(runner: Any, vocab_size: int) -> Any:
    """The real scheduler, configured from the runner as a worker link is from `Describe`,
    with a word-level tokenizer."""
    from zerobubble.tools.in_process import make_scheduler as in_process_scheduler

    return in_process_scheduler(runner, tokenizer=_word_tokenizer(vocab_size), max_num_batched_tokens=2048)


@functools.cache
def _word_tokenizer(vocab_size: int) -> Any:
    """One tokenizer per vocabulary size: Qwen3's 151936 words take seconds to build, and the
    throughput section drives dozens of runs."""
    from zerobubble.scheduler_svc.tokenizer import Tokenizer

    return Tokenizer(word_tokenizer_json(vocab_size))


@dataclass(slots=True)
class RunStats:
    """One driven workload."""

    output_tokens: int = 0
    wall_s: float = 0.0
    num_steps: int = 0
    gpu_busy_fraction: float | None = None


def drive(
    runner: Any, prompts: list[list[int]], max_tokens: int, window: int, around_step: Callable[[int], Any] | None = None
) -> RunStats:
    """Serve ``prompts`` (greedy, ignore EOS) keeping up to ``window`` plans ahead of results.

    This is the worker link's loop without gRPC: plan until the window is full, execute each
    plan at once, then hand the oldest result back. ``window=1`` is the synchronous baseline.
    On CUDA each step is bracketed by events; the busy fraction is the sum of the steps'
    GPU-timeline spans over the whole run's span (gaps are the device waiting for the host).
    ``around_step(i)`` returns a context manager wrapped around the i-th execute.
    """
    import contextlib

    scheduler = make_scheduler(runner, runner.loaded.hf_config.vocab_size)
    runner.reset()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(
            f"r{i}",
            prompt,
            SamplingOptions(temperature=0.0, seed=i),
            StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
        )
    stats = RunStats()
    cuda = runner.device.type == "cuda"
    events: list[tuple[Any, Any]] = []
    inflight: deque = deque()
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    while scheduler.has_unfinished() or inflight:
        while len(inflight) < window:
            plan = scheduler.schedule()
            if plan is None:
                break
            guard = around_step(stats.num_steps) if around_step else contextlib.nullcontext()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            with guard:
                inflight.append(runner.execute(plan))
            if cuda:
                end.record()
                events.append((begin, end))
            stats.num_steps += 1
        if not inflight:
            raise RuntimeError("scheduler stalled with unfinished requests and nothing in flight")
        result = inflight.popleft().materialize(0.0, runner.num_proposed)
        if result.error:
            raise RuntimeError(result.error)
        for event in scheduler.on_step_result(result):
            stats.output_tokens += len(event.token_ids)
    if cuda:
        torch.cuda.synchronize()
        busy = sum(b.elapsed_time(e) for b, e in events)
        span = events[0][0].elapsed_time(events[-1][1]) if events else 0.0
        stats.gpu_busy_fraction = busy / span if span > 0 else None
    stats.wall_s = time.perf_counter() - started
    return stats


def random_eagle_head(loaded: Any, seed: int = 1) -> Any:
    """A random-weight EAGLE-1 head at ``loaded``'s shape, in its dtype and on its device."""
    from zerobubble.worker_svc.eagle import head_config
    from zerobubble.worker_svc.proposers.eagle import serving_head

    cfg = loaded.hf_config
    one_layer = random_state_dict(cfg, loaded.model.device, loaded.model.dtype, seed)
    state = {
        name.removeprefix("model."): tensor
        for name, tensor in one_layer.items()
        if name.startswith("model.layers.0.") and "input_layernorm" not in name
    }
    gen = torch.Generator(device=loaded.model.device).manual_seed(seed)
    fc = torch.randn(cfg.hidden_size, 2 * cfg.hidden_size, generator=gen, device=loaded.model.device)
    state["fc.weight"] = (fc * (2 * cfg.hidden_size) ** -0.5).to(loaded.model.dtype)
    return serving_head(head_config(cfg.to_dict(), fc_bias=False), state, loaded)


def random_eagle3_head(loaded: Any, seed: int = 2, draft_vocab_size: int = 32000) -> Any:
    """A random-weight EAGLE-3 head (speculators format) at ``loaded``'s shape: three captured
    layers, a Llama layer over ``2 hidden`` inputs, its own lm_head over a draft vocabulary."""
    from zerobubble.worker_svc.proposers.eagle import serving_head

    cfg, device, dtype = loaded.hf_config, loaded.model.device, loaded.model.dtype
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    vocab = min(draft_vocab_size, cfg.vocab_size)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * shape[-1] ** -0.5).to(dtype)

    def norm() -> torch.Tensor:
        return torch.ones(hidden, device=device, dtype=dtype)

    aux = sorted({0, layers // 2, layers - 1})  # three layers where the target has them
    p = "layers.0."
    state = {
        "fc.weight": rand(hidden, len(aux) * hidden),
        p + "input_layernorm.weight": norm(),
        p + "hidden_norm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": rand(cfg.intermediate_size, hidden),
        p + "mlp.up_proj.weight": rand(cfg.intermediate_size, hidden),
        p + "mlp.down_proj.weight": rand(hidden, cfg.intermediate_size),
        "norm.weight": norm(),
        "lm_head.weight": rand(vocab, hidden),
        "d2t": torch.zeros(vocab, dtype=torch.int64),  # the first `vocab` target ids
    }
    layer = {
        "hidden_size": hidden,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    config = {
        "speculators_config": {"algorithm": "eagle3"},
        "transformer_layer_config": layer,
        "draft_vocab_size": vocab,
        "eagle_aux_hidden_state_layer_ids": aux,
    }
    return serving_head(config, state, loaded)


def build_runner(loaded: Any, spec: str, cuda_graphs: bool, num_blocks: int, max_num_seqs: int = 16) -> Any:
    """A runner over an already loaded model (several runners may share one model); ``eagle``
    and ``eagle3`` draft with a random-weight head of that layout."""
    from zerobubble.worker_svc.proposers import build_proposer
    from zerobubble.worker_svc.runner import ModelRunner, RunnerConfig

    heads = {"eagle": random_eagle_head, "eagle3": random_eagle3_head}
    draft_model = heads[spec](loaded) if spec in heads else None
    proposer = build_proposer("eagle" if spec in heads else spec, 3, draft_model=draft_model)
    config = RunnerConfig(
        num_blocks=num_blocks,
        block_size=16,
        max_num_seqs=max_num_seqs,
        max_model_len=1024,
        num_spec_tokens=3 if proposer is not None else 0,
        cuda_graphs=cuda_graphs,
    )
    return ModelRunner(loaded, config, proposer)


def repetitive_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts with repeated phrases, so prompt lookup finds drafts as it does on code and chat."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        phrases = [torch.randint(0, vocab_size - 1, (8,), generator=gen).tolist() for _ in range(4)]
        order = torch.randint(0, 4, (length // 8 + 1,), generator=gen).tolist()
        out.append([t for i in order for t in phrases[i]][:length])
    return out


def check_sync_free(ctx: Context) -> None:
    """Steady-state steps may not synchronise the host with the device (CUDA only)."""
    if not ctx.cuda:
        ctx.add("sync_free", "set_sync_debug_mode('error') around steps", SKIP, "needs CUDA")
        return
    import contextlib

    cfg = tiny_config("llama", vocab_size=512, max_position_embeddings=2048)
    loaded = in_memory_model(cfg, ctx.device, torch.bfloat16)
    prompts = repetitive_prompts(6, 100, cfg.vocab_size, 9)
    for spec in ("none", "ngram", "eagle", "eagle3"):
        for graphs in (False, True):
            name = f"spec={spec} cuda_graphs={graphs}"
            started = time.perf_counter()
            try:
                runner = build_runner(loaded, spec, graphs, num_blocks=512)
                drive(runner, prompts, 8, 2)  # warm-up: allocator, Triton compiles, graphs

                @contextlib.contextmanager
                def strict(step: int):
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        yield
                    finally:
                        torch.cuda.set_sync_debug_mode("default")

                stats = drive(runner, prompts, 48, 2, around_step=strict)
                ctx.add("sync_free", name, PASS, f"{stats.num_steps} steps without a host sync")
            except Exception as exc:
                ctx.add(
                    "sync_free", name, FAIL, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
                )
            ctx.finish_last(started)


def _throughput_runners(
    ctx: Context, loaded: Any, graph_modes: tuple[bool, ...], num_blocks: int
) -> dict[tuple[bool, str], Any]:
    """A runner per (CUDA graphs, spec method); one that fails to build is reported and left out."""
    runners = {}
    for graphs in graph_modes:
        for spec in ("none", "ngram", "eagle"):
            try:
                runners[graphs, spec] = build_runner(loaded, spec, graphs, num_blocks)
            except Exception as exc:
                ctx.add("throughput", f"runner spec={spec} cuda_graphs={graphs}", FAIL, f"{type(exc).__name__}: {exc}")
    return runners


def _measure_windows(
    ctx: Context, runner: Any, prompts: list[list[int]], max_tokens: int, windows: tuple[int, ...], name: str
) -> dict[str, list[tuple[float, float | None, int]]]:
    """(tokens/s, GPU busy fraction, steps) of each run, by mode (sync: window 1, async: 2)."""
    rates: dict[str, list[tuple[float, float | None, int]]] = {}
    for window in windows:
        try:
            stats = drive(runner, prompts, max_tokens, window)
        except Exception as exc:
            ctx.add("throughput", f"{name} window={window}", FAIL, f"{type(exc).__name__}: {exc}")
            continue
        key = "async" if window == 2 else "sync"
        rates.setdefault(key, []).append((stats.output_tokens / stats.wall_s, stats.gpu_busy_fraction, stats.num_steps))
    return rates


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _throughput_values(table: dict[str, dict[str, float | None]], num_prompts: int, graphs: bool) -> dict[str, Any]:
    """One report line's figures: each configuration's tokens/s and GPU busy fraction, and the
    ratios between them (None where a configuration is missing)."""
    entries = {
        (spec, mode): table.get(f"n={num_prompts} spec={spec} graphs={graphs} {mode}") or {}
        for spec in ("none", "ngram", "eagle")
        for mode in ("sync", "async")
    }
    values: dict[str, Any] = {}
    for (spec, mode), entry in entries.items():
        values[f"{spec}_{mode}_tok_s"] = entry.get("tok_s")
        values[f"{spec}_{mode}_gpu_busy"] = entry.get("gpu_busy")
    values["async_over_sync_none"] = _ratio(values["none_async_tok_s"], values["none_sync_tok_s"])
    values["async_over_sync_ngram"] = _ratio(values["ngram_async_tok_s"], values["ngram_sync_tok_s"])
    values["ngram_over_none_async"] = _ratio(values["ngram_async_tok_s"], values["none_async_tok_s"])
    values["ngram_over_none_sync"] = _ratio(values["ngram_sync_tok_s"], values["none_sync_tok_s"])
    values["async_over_sync_eagle"] = _ratio(values["eagle_async_tok_s"], values["eagle_sync_tok_s"])
    return values


def check_throughput(ctx: Context) -> None:
    """async ÷ sync and n-gram ÷ none at 2 / 8 / 16 prompts, CUDA graphs on and off."""
    cfg = qwen3_1p7b_config(ctx.dry_run or not ctx.cuda)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    loaded = in_memory_model(cfg, ctx.device, dtype)
    prompt_len, max_tokens = (16, 4) if ctx.dry_run else (256, 128)
    # The dry run exercises the code, not the machine: one run per configuration.
    windows = (1, 2) if ctx.dry_run else (1, 2, 1, 2)  # interleaved: A B A B
    # Blocks of 16 tokens for 16 prompts of prompt + output + draft slack, and spare.
    num_blocks = 16 * -(-(prompt_len + max_tokens + 32) // 16) + 64
    graph_modes = (False, True) if ctx.cuda else (False,)
    if not ctx.cuda:
        ctx.add("throughput", "cuda_graphs=True", SKIP, "CUDA graphs need CUDA")
    runners = _throughput_runners(ctx, loaded, graph_modes, num_blocks)
    table: dict[str, dict[str, float | None]] = {}
    out_of_time: set[tuple[int, bool]] = set()  # (prompts, graphs) with a workload skipped
    for num_prompts in (2, 8, 16):
        prompts = repetitive_prompts(num_prompts, prompt_len, cfg.vocab_size, num_prompts)
        for (graphs, spec), runner in list(runners.items()):
            name = f"n={num_prompts} spec={spec} graphs={graphs}"
            if ctx.time_left() < 20:
                ctx.add("throughput", name, SKIP, "out of time (--time-budget)")
                out_of_time.add((num_prompts, graphs))
                continue
            try:
                drive(runner, prompts[:2], 4, 2)  # warm-up at this shape
            except Exception as exc:
                # Most likely the first CUDA graph replays: drop this runner, keep the others.
                ctx.add("throughput", f"{name} warm-up", FAIL, f"{type(exc).__name__}: {exc}")
                del runners[graphs, spec]
                continue
            for key, runs in _measure_windows(ctx, runner, prompts, max_tokens, windows, name).items():
                busy = [r[1] for r in runs if r[1] is not None]
                table[f"{name} {key}"] = {
                    "tok_s": max(r[0] for r in runs),
                    "gpu_busy": max(busy) if busy else None,
                    "steps": runs[0][2],
                }
    for num_prompts in (2, 8, 16):
        for graphs in graph_modes:
            values = _throughput_values(table, num_prompts, graphs)
            if all(v is not None for k, v in values.items() if k.endswith("tok_s")):
                status, detail = PASS, "measured"
            elif (num_prompts, graphs) in out_of_time:
                status, detail = SKIP, "out of time before every configuration ran"
            else:
                status, detail = FAIL, "some configurations failed"
            ctx.add("throughput", f"{num_prompts} prompts, cuda_graphs={graphs}", status, detail, **values)


def served_pairs(
    ctx: Context, worker: Any, n: int, windows: tuple[int, ...], args: argparse.Namespace, name: str, via: str
) -> None:
    """Sync and async schedulers alternating in front of `worker` with N requests (`bench_sim.run`),
    the clients direct or through a front; one record of the pairs' figures."""
    import bench_sim

    runs: dict[str, list[dict]] = {}
    out_of_time = False
    for window in windows:
        if ctx.time_left() < 20:
            out_of_time = True
            break
        mode = "async" if window > 1 else "sync"
        try:
            figures = bench_sim.run(worker, n, window, 0.0, args, via=via)
            runs.setdefault(mode, []).append(figures)
        except Exception as exc:
            tail = "".join(worker.log[-20:])
            ctx.add("served", f"{name} {mode}", FAIL, f"{type(exc).__name__}: {exc}; {tail}")
    values: dict[str, Any] = {}
    for mode, figures in runs.items():
        values[f"{mode}_tok_s"] = [round(f["tokens_per_s"], 1) for f in figures]
        values[f"{mode}_ms_per_step"] = [round(f["ms_per_step"], 2) for f in figures]
        values[f"{mode}_clients_ms_per_step"] = [round(f["clients_ms_per_step"], 2) for f in figures]
        values[f"{mode}_worker_idle"] = [round(f["worker_idle_fraction"], 4) for f in figures]
        values[f"{mode}_scheduler_cpu_ms_per_step"] = [round(f["cpu_ms_per_step"]["scheduler"], 2) for f in figures]
        if f"{mode}_acceptance" not in values and figures[0]["acceptance_rate"] is not None:
            values[f"{mode}_acceptance"] = round(figures[0]["acceptance_rate"], 3)
    pairs = list(zip(values.get("async_tok_s", []), values.get("sync_tok_s", [])))
    values["async_over_sync"] = [round(a / s, 3) for a, s in pairs]
    if pairs:
        ctx.add(
            "served", name, PASS, "async ÷ sync per pair " + ", ".join(map(str, values["async_over_sync"])), **values
        )
    elif out_of_time:
        ctx.add("served", name, SKIP, "out of time (--time-budget)")
    else:
        ctx.add("served", name, FAIL, "no pair ran")


def check_served(ctx: Context) -> None:
    """The whole stack on this device: `zerobubble worker` on the GPU and `zerobubble scheduler`
    processes, gRPC between them and to the clients, a Qwen3-1.7B-shaped random model in
    bfloat16 with n-gram k = 3 and without, N requests decoding at once. Sync and async
    schedulers alternate in front of one worker (`bench_sim.py`'s steady-state window), so
    each pair is measured side by side; the worker's idle share comes from its CUDA events."""

    from zerobubble.tools.launch import start_worker

    cfg = qwen3_1p7b_config(ctx.dry_run or not ctx.cuda)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    prompt_len, max_tokens = (16, 12) if ctx.dry_run else (256, 192)
    sizes = (2,) if ctx.dry_run else (16, 64, 256)
    windows = (1, 2) if ctx.dry_run else (1, 2, 1, 2)  # interleaved: A B A B
    args = argparse.Namespace(
        max_tokens=max_tokens,
        stream_interval=1,
        event_loop="auto",
        prompt_token_ids=repetitive_prompts(max(sizes), prompt_len, cfg.vocab_size, 11),
        # Through fronts: two, as the gpu overlay runs, but each on a port of its own with the
        # clients' connections dealt out evenly (`bench_sim.py --via front-ports`): over the
        # scheduler's own shared port the kernel splits 8 connections 6:2 or worse about a
        # third of the time, and one loaded front is not what this measures.
        num_fronts=2,
        connections=8,
        settle=0.0,  # the window opens at the last first token, as in the first H200 run
    )
    memory = {"gpu_memory_utilization": 0.4} if ctx.cuda else {"kv_cache_memory_gb": 0.05}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = write_random_model_dir(Path(tmp) / "qwen3-1.7b-random", cfg, ctx.device, dtype)
        ctx.add("served", "model written", PASS, f"{time.perf_counter() - started:.1f} s")
        # CUDA graphs on before off (eager steps are bound by launching kernels), the project's
        # point (n-gram) first.
        configs = [("ngram", False)] if not ctx.cuda else [(s, g) for g in (True, False) for s in ("ngram", "none")]
        for spec, graphs in configs:
            label = f"spec={spec} graphs={graphs}"
            started = time.perf_counter()
            if ctx.time_left() < 60:
                ctx.add("served", label, SKIP, "out of time (--time-budget)")
                continue
            try:
                worker = start_worker(
                    model=str(model_dir),
                    device=ctx.device.type,
                    dtype="bfloat16" if ctx.cuda else "float32",
                    spec_method=spec,
                    num_spec_tokens=3,
                    max_num_seqs=max(sizes),
                    max_model_len=1024,
                    cuda_graphs=graphs,
                    log_level="warning",
                    **memory,
                )
            except Exception as exc:
                ctx.add("served", f"{label} worker", FAIL, f"{type(exc).__name__}: {exc}"[-3000:])
                continue
            ctx.add("served", f"{label} worker started", PASS, f"{time.perf_counter() - started:.1f} s")
            try:
                # Eager steps are bound by kernel launches: 256 rows show nothing 64 do not. With
                # graphs, each size also through a `zerobubble front` (the clients' calls out of
                # the scheduler's loop).
                for n in sizes if graphs or not ctx.cuda else sizes[:2]:
                    for via in ("direct", "front-ports") if graphs or not ctx.cuda else ("direct",):
                        name = f"{label} n={n}" + (" via fronts" if via == "front-ports" else "")
                        served_pairs(ctx, worker, n, windows, args, name, via)
            finally:
                worker.stop()
            ctx.finish_last(started)


# Imported by the service but not among the packages a GPU machine is said to have: bring their
# wheels (`pip download --no-deps` these, well under 64 MiB together) and `pip install` them there.
EXTRA_MODULES = {
    "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection",
    "jinja2": "jinja2 markupsafe",
    "safetensors": "safetensors",
}


# What the other sections import from this project; a failure here (say, the committed gRPC
# stubs need a newer protobuf than the machine has) explains the failures that follow it.
PROJECT_MODULES = (
    "zerobubble.api.worker_pb2",
    "zerobubble.worker_svc.runner",
    "zerobubble.scheduler_svc.scheduler",
    "zerobubble.rpc",
)


def check_environment(ctx: Context) -> None:
    """The packages the other sections need, with the wheels to bring for any that is missing;
    the versions the run used; whether this project's modules import here."""
    import importlib
    import importlib.metadata
    import importlib.util

    for module, wheels in EXTRA_MODULES.items():
        found = importlib.util.find_spec(module) is not None
        ctx.add(
            "environment",
            module,
            PASS if found else FAIL,
            "" if found else f"missing: pip download --no-deps {wheels}, then pip install them here",
        )
    versions = {}
    for dist in ("torch", "triton", "grpcio", "protobuf", "transformers", "tokenizers", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "absent"
    ctx.add("environment", "versions", PASS, ", ".join(f"{k} {v}" for k, v in versions.items()), **versions)
    for module in PROJECT_MODULES:
        try:
            importlib.import_module(module)
            ctx.add("environment", f"import {module}", PASS)
        except Exception as exc:
            ctx.add("environment", f"import {module}", FAIL, f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------- roofline

# Peak memory bandwidth in GB/s (vendors' figures), matched against torch's device name; other
# devices get a measured device-to-device copy.
KNOWN_BANDWIDTH_GBPS = {
    "H200": 4800.0, "H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0,
    "A10G": 600.0, "A10": 600.0,
}  # fmt: skip


def device_bandwidth(device: torch.device) -> tuple[float, str]:
    """``(bytes per second, where the figure comes from)`` for ``device``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, gbps in KNOWN_BANDWIDTH_GBPS.items():
            if key in name:
                return gbps * 1e9, f"{name}: vendor figure"
    src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    synchronize(device)
    # A copy reads and writes every byte.
    return 2 * 5 * src.numel() / (time.perf_counter() - started), f"{device}: measured copy"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_bytes(hf_config: Any, dtype: torch.dtype, batch: int, context: int) -> int:
    """Bytes a decode step must read at least: every weight once (the embedding's rows aside,
    a tied embedding once as the lm_head) and each row's K and V of its whole context."""
    from zerobubble.worker_svc.model import model_spec

    spec = model_spec(hf_config)
    size = torch.empty((), dtype=dtype).element_size()
    q, kv = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = spec.hidden_size * (q + 2 * kv) + q * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size
    weights = spec.num_layers * per_layer + spec.vocab_size * spec.hidden_size
    kv_cache = 2 * spec.num_layers * batch * context * kv
    return (weights + kv_cache) * size


def decode_step(loaded: Any, batch: int, context: int, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    """One greedy decode step of ``batch`` rows with ``context`` tokens cached each."""
    from zerobubble.kernels.attention import AttentionMetadata
    from zerobubble.kernels.slot_mapping import compute_slot_mapping
    from zerobubble.worker_svc.model import allocate_kv_cache
    from zerobubble.worker_svc.sampler import SamplingTensors, sample

    block_size = 16
    blocks_per_row = -(-(context + 1) // block_size)
    kv_caches = allocate_kv_cache(loaded.hf_config, batch * blocks_per_row, block_size, dtype, device)
    tables = torch.randperm(batch * blocks_per_row).view(batch, blocks_per_row).to(torch.int32).to(device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32, device=device),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=context + 1,
        slot_mapping=compute_slot_mapping(qsl, positions, tables, block_size),
    )
    ids = torch.randint(0, loaded.hf_config.vocab_size, (batch,), device=device)
    zeros = torch.zeros(batch, device=device)
    params = SamplingTensors(zeros, zeros.int(), zeros + 1, zeros.long(), positions, all_greedy=True, any_filter=False)
    model = loaded.model
    return lambda: sample(model.compute_logits(model(ids, positions, meta, kv_caches)), params)


def timed_ms(step: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median ms of ``step``; on CUDA, of its CUDA graph's replays (as the worker runs decodes)."""
    for _ in range(3):
        step()
    synchronize(device)
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        step = graph.replay
        step()
    times = []
    for _ in range(reps):
        synchronize(device)
        started = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def top_kernels(step: Callable[[], Any], device: torch.device, num: int = 10) -> list[str]:
    """The ``num`` kernels (or CPU ops) with the most time per eager step, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    reps = 3
    with profile(activities=activities) as prof:
        for _ in range(reps):
            step()
        synchronize(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:num]
    return [f"{e.key[:60]}: {getattr(e, key) / reps:.0f} us x{e.count // reps}" for e in events]


def check_roofline(ctx: Context) -> None:
    """Decode ms per step at 16 / 64 / 256 rows against the memory-bandwidth floor, and the
    kernels that take the time."""
    cfg = qwen3_1p7b_config(ctx.dry_run or not ctx.cuda)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    loaded = in_memory_model(cfg, ctx.device, dtype)
    bandwidth, source = device_bandwidth(ctx.device)
    batches, context = ((2, 4), 32) if ctx.dry_run else ((16, 64, 256), 512)
    for batch in batches:
        name = f"decode batch={batch} context={context}"
        if ctx.time_left() < 20:
            ctx.add("roofline", name, SKIP, "out of time (--time-budget)")
            continue
        started = time.perf_counter()
        try:
            step = decode_step(loaded, batch, context, ctx.device, dtype)
            ms = timed_ms(step, ctx.device, 5 if ctx.dry_run else 50)
            floor_ms = decode_bytes(cfg, dtype, batch, context) / bandwidth * 1e3
            ratio = ms / floor_ms
            limit = 2.5 if batch >= 256 else 2.0
            kernels = top_kernels(step, ctx.device)
            status = (PASS if ratio <= limit else FAIL) if ctx.cuda else SKIP
            detail = f"{ms:.2f} ms vs floor {floor_ms:.2f} ms ({ratio:.2f}x, target <= {limit}x; {source})"
            if not ctx.cuda:
                detail += "; the floor targets are for GPUs"
            ctx.add("roofline", name, status, detail, ms=ms, floor_ms=floor_ms, ratio=ratio, top_kernels=kernels)
        except Exception as exc:
            ctx.add("roofline", name, FAIL, f"{type(exc).__name__}: {exc}")
        ctx.finish_last(started)


SECTIONS: dict[str, Callable[[Context], None]] = {
    "environment": check_environment,
    "kernels": check_kernels,
    "families": check_families,
    "service": check_service,
    "sync_free": check_sync_free,
    "roofline": check_roofline,
    "throughput": check_throughput,
    "served": check_served,  # last: what the budget leaves (its eager half is the least news)
}


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


# Sections whose measured rows get a table of their own, with these columns.
VALUE_TABLES = {
    "throughput": [
        "none_sync_tok_s",
        "none_async_tok_s",
        "ngram_sync_tok_s",
        "ngram_async_tok_s",
        "async_over_sync_none",
        "async_over_sync_ngram",
        "ngram_over_none_async",
        "eagle_sync_tok_s",
        "eagle_async_tok_s",
        "async_over_sync_eagle",
        "none_async_gpu_busy",
        "ngram_async_gpu_busy",
        "eagle_async_gpu_busy",
        "none_sync_gpu_busy",
    ],
    "served": [
        "sync_tok_s",
        "async_tok_s",
        "async_over_sync",
        "sync_worker_idle",
        "async_worker_idle",
        "sync_ms_per_step",
        "async_ms_per_step",
        "async_clients_ms_per_step",
        "async_scheduler_cpu_ms_per_step",
        "async_acceptance",
    ],
}


def markdown(ctx: Context, meta: dict[str, Any]) -> str:
    """The report as markdown: environment, one table of checks, one table per measured section."""
    lines = [
        f"# device check ({'dry run, ' if ctx.dry_run else ''}{meta['device_name']})"
        + ("" if meta.get("complete", True) else " — incomplete: out of time"),
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, {meta['when']}, {meta['total_s']:.0f} s"
        f" (budget {meta['time_budget_s']:.0f} s)",
        "",
        "| section | check | status | detail |",
        "|---|---|---|---|",
    ]
    for r in ctx.records:
        if r.section not in VALUE_TABLES or r.status != PASS or not r.values:
            lines.append(f"| {r.section} | {r.name} | {r.status.upper()} | {r.detail.replace('|', '/')[:300]} |")
    for section, cols in VALUE_TABLES.items():
        rows = [r for r in ctx.records if r.section == section and r.status == PASS and r.values]
        if rows:
            lines += ["", f"| {section} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for r in rows:
                lines.append(f"| {r.name} | " + " | ".join(_fmt(r.values.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def run_in_process(name: str, ctx: Context) -> None:
    """One section here; an exception it raises becomes a record (in its own process too)."""
    try:
        SECTIONS[name](ctx)
    except Exception as exc:  # one broken section must not hide the others' findings
        tb = traceback.format_exc()[-3000:]
        ctx.add(name, "section", FAIL, f"{type(exc).__name__}: {exc}", traceback=tb)


def run_section(name: str, ctx: Context, args: argparse.Namespace) -> None:
    """One section in a process of its own (``--part``); its records join ``ctx``.

    A section that outlives the time left is killed; the records it wrote before stay.
    """
    part = ctx.out_dir / f".part-{name}.json"
    part.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), str(ctx.out_dir), "--only", name, "--part", str(part)]
    cmd += ["--time-budget", f"{max(ctx.time_left(), 1.0):.0f}"] + (["--dry-run"] if args.dry_run else [])
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT)
    killed = False
    try:
        # A little grace past the budget: the section's own loops stop at its deadline.
        proc.wait(timeout=max(ctx.time_left(), 1.0) + 15)
    except subprocess.TimeoutExpired:
        killed = True
    finally:  # also on SIGTERM (OutOfTime): stop the section, keep what it found
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if part.exists():
            ctx.records.extend(Record(**r) for r in json.loads(part.read_text()))
            part.unlink()
    if killed:
        ctx.add(name, "section", FAIL, "stopped: still running when the time budget ran out")
    elif proc.returncode != 0:
        ctx.add(name, "section", FAIL, f"its process exited with {proc.returncode} (output above in the log)")


def write_report(ctx: Context, meta: dict[str, Any], started: float) -> bool:
    """Write device_check.json and .md as they stand (after every section); True when all pass."""
    meta["total_s"] = time.perf_counter() - started
    # Sections skipped for time (or cut by SIGTERM) leave the run incomplete, not failed.
    meta["complete"] = not any(r.status == SKIP and "out of time" in r.detail for r in ctx.records) and not any(
        r.section == "run" for r in ctx.records
    )
    failed = [r for r in ctx.records if r.status == FAIL]
    report = dict(meta, ok=not failed, records=[asdict(r) for r in ctx.records])
    _write_atomic(ctx.out_dir / "device_check.json", json.dumps(report, indent=2))
    _write_atomic(ctx.out_dir / "device_check.md", markdown(ctx, meta))
    return not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder for device_check.json and device_check.md")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU; CUDA-only parts are skipped")
    parser.add_argument("--only", default="", help="comma-separated sections (default: all): " + ", ".join(SECTIONS))
    parser.add_argument(
        "--time-budget",
        type=float,
        default=420.0,
        help="seconds for all sections: one still running then is stopped, later ones are skipped",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each section in a process of its own (a CUDA error or a hang costs that section only)",
    )
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)  # a section's process: records here
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.dry_run
    ctx = Context(
        device=torch.device("cuda" if cuda else "cpu"),
        dry_run=args.dry_run or not cuda,
        out_dir=args.out_dir,
        deadline=started + args.time_budget,
        part_file=args.part,
    )
    if not cuda and not args.dry_run:
        logger.warning("no CUDA device: running the dry run instead")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    selected = [s for s in args.only.split(",") if s] or list(SECTIONS)
    if args.part is not None:  # one section, in its own process, for the parent's report
        for name in selected:
            run_in_process(name, ctx)
        return 0

    def on_term(signum: int, frame: Any) -> None:
        raise OutOfTime

    signal.signal(signal.SIGTERM, on_term)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    meta: dict[str, Any] = dict(
        device_name=torch.cuda.get_device_name(0) if cuda else "cpu",
        torch=torch.__version__,
        triton=triton_version,
        python=platform.python_version(),
        when=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        dry_run=ctx.dry_run,
        time_budget_s=args.time_budget,
    )
    try:
        for name in selected:
            section_started = time.perf_counter()
            if ctx.time_left() < 10:
                ctx.add(name, "section", SKIP, "out of time (--time-budget)")
            elif args.isolate:
                run_section(name, ctx, args)
            else:
                run_in_process(name, ctx)
            logger.info("section %s took %.1f s", name, time.perf_counter() - section_started)
            write_report(ctx, meta, started)
    except OutOfTime:
        ctx.add("run", "SIGTERM", FAIL, "terminated (the wrapper's timeout): the report holds what was found")
    ok = write_report(ctx, meta, started)
    num_failed = sum(r.status == FAIL for r in ctx.records)
    logger.info("%d checks, %d failed; report in %s", len(ctx.records), num_failed, args.out_dir)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
