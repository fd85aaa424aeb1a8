"""Multi-process tensor-parallel tests: what each spawned rank runs, and the batch it runs.

A rank joins the group (gloo over a rendezvous file, one torch thread), loads its shard of a
model directory through the worker's loader (`load_model(..., tp=...)`: only its slices read
from the files) and runs `schedule_logits`, a mixed schedule of prefill chunks, verification
rows and decodes; rank 0 saves the logits for the test process to compare with size 1.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.multiprocessing as mp

from zerobubble.kernels.attention import AttentionMetadata
from zerobubble.kernels.slot_mapping import compute_slot_mapping
from zerobubble.tools.launch import child_processes
from zerobubble.worker_svc.model import allocate_kv_cache
from zerobubble.worker_svc.model_loader import LoadedModel, load_model
from zerobubble.worker_svc.parallel import PLAN, RESET, STOP, PlanChannel, init_tensor_parallel, leave
from zerobubble.worker_svc.ranks import RANK_CODE

BLOCK_SIZE = 4
# Request lengths, and per step the number of tokens each request runs (0 = idle this step).
SEQ_LENS = [31, 10, 41, 7]
SCHEDULE = [
    [6, 7, 17, 4],  # first prefill chunks
    [19, 1, 13, 1],  # chunks on top of earlier context beside decodes
    [1, 1, 3, 1],  # decodes and a 3-token verification row
    [4, 0, 7, 0],  # multi-token rows only, some requests idle
    [1, 1, 1, 1],  # a pure decode batch
]


def schedule_logits(loaded: LoadedModel, seed: int = 3) -> list[torch.Tensor]:
    """Per request, the logits of every token it ran through `SCHEDULE` (token ids drawn with
    ``seed``), its KV blocks scattered over the cache."""
    model = loaded.model
    assert model is not None
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 1000, (n,), generator=generator) for n in SEQ_LENS]
    per_request = -(-max(SEQ_LENS) // BLOCK_SIZE)
    num_blocks = per_request * len(SEQ_LENS)
    kv = allocate_kv_cache(loaded.hf_config, num_blocks, BLOCK_SIZE, model.dtype, "cpu", model.spec.num_kv_heads)
    tables = torch.randperm(num_blocks, generator=generator).view(len(SEQ_LENS), -1).to(torch.int32)
    done, out = [0] * len(SEQ_LENS), [[] for _ in SEQ_LENS]
    for step in SCHEDULE:
        running = [r for r, n in enumerate(step) if n > 0]
        q_lens = [step[r] for r in running]
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        positions = torch.cat([torch.arange(done[r], done[r] + step[r]) for r in running])
        seq_lens = torch.tensor([done[r] + step[r] for r in running], dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=starts,
            seq_lens=seq_lens,
            block_tables=tables[running],
            max_query_len=max(q_lens),
            max_seq_len=int(seq_lens.max()),
            slot_mapping=compute_slot_mapping(starts, positions, tables[running], BLOCK_SIZE),
        )
        ids = torch.cat([tokens[r][done[r] : done[r] + step[r]] for r in running])
        logits = model.compute_logits(model(ids, positions, meta, kv))
        for i, r in enumerate(running):
            out[r].append(logits[starts[i] : starts[i + 1]])
            done[r] += step[r]
    return [torch.cat(chunks) for chunks in out]


def rank_logits(
    rank: int,
    size: int,
    init_file: Path,
    model_dir: str,
    dtype: str,
    quantization: str,
    out: Path,
    expert_parallel: bool = False,
) -> None:
    """A spawned rank: its shard of ``model_dir`` (a mixture of experts' experts placed whole
    with ``expert_parallel``) through `schedule_logits`; rank 0 saves them."""
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, size, torch.device("cpu"), init_method=f"file://{init_file}")
    tp.expert_parallel = expert_parallel
    try:
        loaded = load_model(model_dir, dtype, "cpu", quantization=quantization, tp=tp)
        logits = schedule_logits(loaded)
        if rank == 0:
            torch.save(logits, out)
    finally:
        leave(tp)


def sharded_logits(
    model_dir: Path, size: int, tmp_path: Path, quantization: str = "none", expert_parallel: bool = False
) -> list[torch.Tensor]:
    """`schedule_logits` of ``model_dir`` in float32 over ``size`` spawned ranks (`rank_logits`)."""
    out = tmp_path / "logits.pt"
    args = (size, tmp_path / "rendezvous", str(model_dir), "float32", quantization, out, expert_parallel)
    mp.spawn(rank_logits, args=args, nprocs=size, join=True)
    logits: list[torch.Tensor] = torch.load(out)
    return logits


def whole_logits(model_dir: Path, quantization: str = "none") -> list[torch.Tensor]:
    """`schedule_logits` of ``model_dir`` in float32 on one rank: the sharded ones' oracle."""
    return schedule_logits(load_model(str(model_dir), "float32", "cpu", quantization=quantization))


def rank_children(pid: int) -> list[int]:
    """Pids of the tensor-parallel ranks a worker process ``pid`` started (`LocalRanks`)."""
    return child_processes(pid, RANK_CODE.encode())


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# Messages of the plan channel test: a decode plan's size, one past the inline buffer, none.
CHANNEL_MESSAGES = [(PLAN, b"p" * 100), (PLAN, bytes(range(256)) * 400), (RESET, b""), (STOP, b"")]


def channel_echo(rank: int, size: int, init_file: Path, out: Path) -> None:
    """Rank 0 sends `CHANNEL_MESSAGES`; the others receive until STOP, the last saving what came."""
    tp = init_tensor_parallel(rank, size, torch.device("cpu"), init_method=f"file://{init_file}")
    try:
        channel = PlanChannel(tp)
        if rank == 0:
            for kind, payload in CHANNEL_MESSAGES:
                channel.send(kind, payload)
            return
        received = [channel.receive()]
        while received[-1][0] != STOP:
            received.append(channel.receive())
        if rank == size - 1:
            out.write_bytes(pickle.dumps(received))
    finally:
        leave(tp)
