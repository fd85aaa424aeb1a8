"""One forward step of a model over N tensor-parallel CPU ranks, timed in process: the median
decode step per rank and the collectives' share of it (shared-memory all-reduces and the
logits' all-gather, the waiting for the other ranks included).

    python scripts/bench_tensor_parallel.py --model DIR --size 2 --rows 1 16

Size 1 runs one process on every core; size N runs N spawned ranks of one thread each, their
collectives through shared memory as a worker's local ranks do. No scheduler, no plans: what
the split costs the forward itself (the served comparison is scripts/bench_peer.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerobubble.kernels.attention import AttentionMetadata  # noqa: E402
from zerobubble.kernels.slot_mapping import compute_slot_mapping  # noqa: E402
from zerobubble.worker_svc.model import allocate_kv_cache  # noqa: E402
from zerobubble.worker_svc.model_loader import LoadedModel, load_model  # noqa: E402
from zerobubble.worker_svc.parallel import TensorParallel, init_tensor_parallel, leave  # noqa: E402

BLOCK_SIZE, CONTEXT, WARMUP = 16, 100, 20


def decode_steps(loaded: LoadedModel, rows: int, num_steps: int) -> list[float]:
    """Seconds of each of ``num_steps`` decode steps of ``rows`` rows (greedy choice included)."""
    model = loaded.model
    assert model is not None
    per_row = -(-(CONTEXT + num_steps + 1) // BLOCK_SIZE)
    kv = allocate_kv_cache(loaded.hf_config, per_row * rows, BLOCK_SIZE, model.dtype, "cpu", model.spec.num_kv_heads)
    tables = torch.arange(per_row * rows, dtype=torch.int32).view(rows, per_row)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    seconds = []
    for step in range(num_steps):
        positions = torch.full((rows,), CONTEXT + step)
        seq_lens = (positions + 1).to(torch.int32)
        meta = AttentionMetadata(
            query_start_loc=starts, seq_lens=seq_lens, block_tables=tables, max_query_len=1,
            max_seq_len=int(seq_lens.max()), slot_mapping=compute_slot_mapping(starts, positions, tables, BLOCK_SIZE),
        )  # fmt: skip
        ids = torch.randint(0, 1000, (rows,))
        started = time.perf_counter()
        model.compute_logits(model(ids, positions, meta, kv)).argmax(-1)
        seconds.append(time.perf_counter() - started)
    return seconds


def run_rank(rank: int, size: int, init_file: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1 if size > 1 else os.cpu_count() or 1)
    tp = TensorParallel()
    if size > 1:
        tp = init_tensor_parallel(rank, size, torch.device("cpu"), init_method=f"file://{init_file}", one_machine=True)
    loaded = load_model(args.model, args.dtype, "cpu", tp=tp)
    for rows in args.rows:
        decode_steps(loaded, rows, WARMUP)
        tp.clock.take()
        seconds = decode_steps(loaded, rows, args.steps)
        collective_ms = tp.clock.take() / args.steps * 1e3
        print(
            f"size {size} rank {rank} rows {rows}: median step {statistics.median(seconds) * 1e3:.2f} ms, "
            f"collectives {collective_ms:.2f} ms a step",
            flush=True,
        )
    leave(tp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    for size in args.size:
        with tempfile.TemporaryDirectory() as folder:
            init_file = str(Path(folder) / "rendezvous")
            if size == 1:
                run_rank(0, 1, init_file, args)
            else:
                mp.spawn(run_rank, args=(size, init_file, args), nprocs=size, join=True)


if __name__ == "__main__":
    main()
