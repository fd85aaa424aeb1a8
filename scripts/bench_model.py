"""Our forward vs Hugging Face's forward-with-cache on the embedded SmolLM2-135M (``make bench-model``).

For each dtype it times one decode step at several batch sizes with a fixed context (Hugging Face
with a ``DynamicCache`` cropped back after every step, ours over a scattered paged cache), and one
prefill, and prints median step times side by side with the ratio ours/HF. KV contents are random:
timing does not depend on them, and building a real 512-token context for 32 rows would take far
longer than the measurement itself.

A one-row decode step reads every weight once, so the memory bounds it: the table's first lines
give the machine's read bandwidth on the same threads (the fastest of a few passes over a buffer
far larger than the caches) and, per dtype, the step's floor: the bytes of its weights and KV
cache divided by that bandwidth. ``--quantization int8`` times our int8 weights (HF keeps its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Runnable as `python scripts/bench_model.py` from a checkout that is not pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zerobubble.config import WorkerConfig  # noqa: E402
from zerobubble.kernels.attention import AttentionMetadata  # noqa: E402
from zerobubble.kernels.cpu import describe_cpu  # noqa: E402
from zerobubble.kernels.linear import PRODUCTS, LinearWeight  # noqa: E402
from zerobubble.kernels.slot_mapping import compute_slot_mapping  # noqa: E402
from zerobubble.worker_svc.model import CausalLM, LayerWeights, allocate_kv_cache  # noqa: E402
from zerobubble.worker_svc.model_loader import EMBEDDED_MODEL_NAME, load_model  # noqa: E402


@dataclass(slots=True)
class Result:
    """One row of the table."""

    dtype: str
    case: str
    ours_ms: float
    hf_ms: float


def time_pair(
    ours: Callable[[], object],
    hf: Callable[[], object],
    num_warmup: int,
    num_reps: int,
    hf_reset: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """Median wall ms of ``ours`` and ``hf``, alternated so both see the same machine load."""
    ours_times, hf_times = [], []
    for i in range(num_warmup + num_reps):
        for step, times in ((ours, ours_times), (hf, hf_times)):
            started = time.perf_counter()
            step()
            if i >= num_warmup:
                times.append(time.perf_counter() - started)
        if hf_reset is not None:
            hf_reset()
    return statistics.median(ours_times) * 1e3, statistics.median(hf_times) * 1e3


def ours_decode(
    model: CausalLM, hf_config: object, batch: int, context: int, dtype: torch.dtype, block_size: int
) -> Callable[[], object]:
    """A decode step of ``batch`` requests, each with ``context`` tokens already cached."""
    blocks_per_request = -(-(context + 1) // block_size)
    num_blocks = batch * blocks_per_request
    kv_caches = allocate_kv_cache(hf_config, num_blocks, block_size, dtype, "cpu")
    for k_cache, v_cache in kv_caches:
        k_cache.normal_()
        v_cache.normal_()
    # Scattered blocks, as a long-running server's pool would hand them out.
    block_tables = torch.randperm(num_blocks).view(batch, blocks_per_request).to(torch.int32)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    positions = torch.full((batch,), context, dtype=torch.long)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=context + 1,
        slot_mapping=compute_slot_mapping(query_start_loc, positions, block_tables, block_size),
    )
    input_ids = torch.randint(0, model.spec.vocab_size, (batch,))
    return lambda: model.compute_logits(model(input_ids, positions, meta, kv_caches))


def ours_prefill(
    model: CausalLM, hf_config: object, num_tokens: int, dtype: torch.dtype, block_size: int
) -> Callable[[], object]:
    """A fresh prefill of one ``num_tokens`` prompt; logits for its last token only."""
    num_blocks = -(-num_tokens // block_size)
    kv_caches = allocate_kv_cache(hf_config, num_blocks, block_size, dtype, "cpu")
    block_tables = torch.randperm(num_blocks).view(1, num_blocks).to(torch.int32)
    query_start_loc = torch.tensor([0, num_tokens], dtype=torch.int32)
    positions = torch.arange(num_tokens)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        slot_mapping=compute_slot_mapping(query_start_loc, positions, block_tables, block_size),
    )
    input_ids = torch.randint(0, model.spec.vocab_size, (num_tokens,))
    return lambda: model.compute_logits(model(input_ids, positions, meta, kv_caches)[-1:])


def hf_decode(
    hf: torch.nn.Module, batch: int, context: int, dtype: torch.dtype
) -> tuple[Callable[[], object], Callable[[], None]]:
    """Hugging Face's decode step over a ``DynamicCache`` of ``context`` tokens, and its reset."""
    from transformers import DynamicCache

    config = hf.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=config)
    shape = (batch, config.num_key_value_heads, context, head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
    input_ids = torch.randint(0, config.vocab_size, (batch, 1))
    attention_mask = torch.ones(batch, context + 1, dtype=torch.long)
    position_ids = torch.full((batch, 1), context, dtype=torch.long)

    def step() -> object:
        with torch.inference_mode():
            return hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      cache=cache, use_cache=True, logits_to_keep=1).logits  # fmt: skip

    return step, lambda: cache.crop(-1)


def hf_prefill(hf: torch.nn.Module, num_tokens: int) -> Callable[[], object]:
    """Hugging Face's prefill of one prompt into a fresh ``DynamicCache``, last-token logits only."""
    from transformers import DynamicCache

    input_ids = torch.randint(0, hf.config.vocab_size, (1, num_tokens))

    def step() -> object:
        with torch.inference_mode():
            return hf(
                input_ids=input_ids, cache=DynamicCache(config=hf.config), use_cache=True, logits_to_keep=1
            ).logits

    return step


def read_bandwidth_gbs(num_bytes: int = 1 << 30, num_passes: int = 5) -> float:
    """The machine's read bandwidth in GB/s on torch's threads: the fastest of a few reductions
    over a float32 buffer of ``num_bytes`` (a max is a compare per element, so memory bounds it)."""
    buffer = torch.ones(num_bytes // 4)
    best = float("inf")
    for _ in range(num_passes):
        started = time.perf_counter()
        buffer.max()
        best = min(best, time.perf_counter() - started)
    return num_bytes / best / 1e9


def step_bytes(model: CausalLM, kv_caches_bytes: int) -> int:
    """Bytes a one-row decode step must read: every linear weight in the layouts its one-row
    product reads, the norms, and the KV cache of the row's context."""
    tensors: list[torch.Tensor | None] = [model.final_norm]
    for weight in [layer_weight for layer in model.layers for layer_weight in vars_of(layer)] + [model.lm_head]:
        layout = PRODUCTS[weight.plan[0]].layout
        tensors += [getattr(weight, layout), weight.int8_scale if layout in ("int8", "blocks") else None]
        tensors.append(weight.int4_scales_zeros if layout == "int4" else None)
    return kv_caches_bytes + sum(t.numel() * t.element_size() for t in tensors if t is not None)


def vars_of(layer: LayerWeights) -> list[LinearWeight]:
    """The linear weights of a decoder layer: its attention's and its dense MLP's."""
    values = [getattr(layer.attn, f.name) for f in dataclasses.fields(layer.attn)]
    if layer.mlp is not None:
        values += [getattr(layer.mlp, f.name) for f in dataclasses.fields(layer.mlp)]
    return [value for value in values if isinstance(value, LinearWeight)]


def run(
    dtypes: list[str],
    batches: list[int],
    context: int,
    prefill_tokens: int,
    num_reps: int,
    block_size: int,
    prepack: bool = True,
    quantization: str = "none",
) -> list[Result]:
    """Time every case for every dtype."""
    from transformers import AutoModelForCausalLM

    results = []
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth: {bandwidth:.1f} GB/s on {torch.get_num_threads()} threads")
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        loaded = load_model(EMBEDDED_MODEL_NAME, dtype, "cpu", prepack, quantization=quantization)
        hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype).eval()
        for batch in batches:
            hf_step, hf_reset = hf_decode(hf, batch, context, dtype)
            ours_step = ours_decode(loaded.model, loaded.hf_config, batch, context, dtype, block_size)
            ours_ms, hf_ms = time_pair(ours_step, hf_step, 2, num_reps, hf_reset)
            results.append(Result(dtype_name, f"decode batch={batch} ctx={context}", ours_ms, hf_ms))
            print_row(results[-1])
            if batch == 1:
                spec = loaded.model.spec
                kv_bytes = 2 * spec.num_layers * (context + 1) * spec.num_kv_heads * spec.head_dim * dtype.itemsize
                floor_ms = step_bytes(loaded.model, kv_bytes) / bandwidth / 1e6
                print(f"{dtype_name:<9} {'  floor (bytes / bandwidth)':<26} {floor_ms:>10.2f} "
                      f"{'':>10} {ours_ms / floor_ms:>7.2f}x of the floor", flush=True)  # fmt: skip
        ours_step = ours_prefill(loaded.model, loaded.hf_config, prefill_tokens, dtype, block_size)
        ours_ms, hf_ms = time_pair(ours_step, hf_prefill(hf, prefill_tokens), 1, max(3, num_reps // 2))
        results.append(Result(dtype_name, f"prefill {prefill_tokens} tokens", ours_ms, hf_ms))
        print_row(results[-1])
        del hf, loaded
    return results


def print_row(result: Result) -> None:
    """One line of the side-by-side table."""
    print(f"{result.dtype:<9} {result.case:<26} {result.ours_ms:>10.2f} {result.hf_ms:>10.2f} "
          f"{result.ours_ms / result.hf_ms:>8.2f}", flush=True)  # fmt: skip


def main() -> None:
    """Parse flags and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32,bfloat16")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="tokens already cached per decode row")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument(
        "--block-size", type=int, default=WorkerConfig().block_size, help="our KV block size (default: the worker's)"
    )
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions per case (after warmup)")
    parser.add_argument(
        "--threads", type=int, default=0,
        help="torch threads (0 = torch's default); 1 gives stable numbers on a shared machine",
    )  # fmt: skip
    parser.add_argument(
        "--no-prepack",
        action="store_true",
        help="our linears over plain weights (F.linear), as without the worker's --prepack-weights",
    )
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"), help="our weights'")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"SmolLM2-135M on CPU, {torch.get_num_threads()} threads, KV block size {args.block_size}, "
        f"weights {'plain' if args.no_prepack else 'prepacked'} ({args.quantization}), median of {args.reps} "
        f"steps (ms); CPU: {describe_cpu()}"
    )
    print(f"{'dtype':<9} {'case':<26} {'ours':>10} {'HF':>10} {'ours/HF':>8}")
    run(
        [d.strip() for d in args.dtypes.split(",") if d.strip()],
        [int(b) for b in args.batches.split(",")],
        args.context,
        args.prefill_tokens,
        args.reps,
        args.block_size,
        not args.no_prepack,
        args.quantization,
    )


if __name__ == "__main__":
    main()
