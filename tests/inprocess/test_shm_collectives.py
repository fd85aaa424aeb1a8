"""The shared-memory all-reduce and all-gather against the sums and stacks they must equal, over
real gloo process groups: the compiled exchange (``impl="cpp"``) and its Python twin."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zerobubble.worker_svc.shm_collectives import SharedMemoryCollectives

# The last one is past max_bytes: it goes through a slot in pieces.
SHAPES = [(1, 576), (7, 64), (3, 5), (128, 576)]
MAX_BYTES = 64 * 1024


@pytest.fixture(params=["cpp", "torch", "mixed"])
def impl(request: pytest.FixtureRequest) -> str:
    """The exchange under test ("mixed": the even ranks compiled, the odd ones Python: the twins
    share the protocol and the roundings); "cpp" needs the compiled kernels built (the ranks then
    load them)."""
    if request.param != "torch":
        request.getfixturevalue("cpu_kernels")
    return str(request.param)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _partial(rank: int, call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=generator).to(dtype)


def _expected(world: int, call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ranks' partials added in rank order, in ``dtype``: what every rank must end with."""
    total = _partial(0, call, shape, dtype) + _partial(1, call, shape, dtype)
    for r in range(2, world):
        total = total + _partial(r, call, shape, dtype)
    return total


def _sums(rank: int, world: int, port: int, out_dir: str, impl: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if impl == "mixed":
        impl = "torch" if rank % 2 else "cpp"
    shared = SharedMemoryCollectives(dist.group.WORLD, max_bytes=MAX_BYTES, impl=impl)
    sums, stacks = [], []
    for call in range(40):  # many calls: both slot sets are reused many times over
        shape = SHAPES[call % len(SHAPES)]
        dtype = torch.float32 if call % 2 else torch.bfloat16
        sums.append(shared.all_reduce(_partial(rank, call, shape, dtype)).clone())
        stacks.append(shared.all_gather(_partial(rank, call, shape, dtype)))
    torch.save((sums, stacks), Path(out_dir) / f"rank{rank}.pt")
    shared.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_rank_ends_with_the_rank_ordered_sum_and_the_stack(tmp_path: Path, world: int, impl: str) -> None:
    before = set(os.listdir("/dev/shm"))
    mp.spawn(_sums, args=(world, _free_port(), str(tmp_path), impl), nprocs=world)
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    sums, stacks = per_rank[0]
    for call, (got, stack) in enumerate(zip(sums, stacks, strict=True)):
        shape = SHAPES[call % len(SHAPES)]
        dtype = torch.float32 if call % 2 else torch.bfloat16
        assert torch.equal(got, _expected(world, call, shape, dtype)), call
        assert torch.equal(stack, torch.stack([_partial(r, call, shape, dtype) for r in range(world)])), call
        for other_sums, other_stacks in per_rank[1:]:
            assert torch.equal(other_sums[call], got), f"ranks disagree at call {call}"
            assert torch.equal(other_stacks[call], stack), f"ranks disagree at call {call}"
    assert not [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("zerobubble-collectives")]


def _one_rank_missing(rank: int, world: int, port: int, out_dir: str, impl: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if impl == "mixed":
        impl = "torch" if rank % 2 else "cpp"
    shared = SharedMemoryCollectives(dist.group.WORLD, max_bytes=MAX_BYTES, timeout_s=0.5, impl=impl)
    if rank == 0:
        try:
            shared.all_reduce(torch.ones(4))
        except RuntimeError as exc:
            (Path(out_dir) / "error.txt").write_text(str(exc))
    dist.barrier()
    shared.close()
    dist.destroy_process_group()


def test_a_rank_that_never_arrives_is_named(tmp_path: Path, impl: str) -> None:
    mp.spawn(_one_rank_missing, args=(2, _free_port(), str(tmp_path), impl), nprocs=2)
    error = (tmp_path / "error.txt").read_text()
    assert "rank(s) [1] did not arrive within 0 s" in error


def test_the_compiled_exchange_checks_before_it_publishes(cpu_kernels: None) -> None:
    """A part it cannot sum or that overflows a slot raises with the counters untouched (the other
    ranks wait on, and time out naming this one, rather than reading a half-written exchange)."""
    slots = torch.zeros(2, 1, 64, dtype=torch.uint8)
    counters = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="sums float32, bfloat16 and float16"):
        torch.ops.zerobubble_cpu.shm_all_reduce(torch.ones(4, dtype=torch.float64), slots, counters, 0, 1, 1.0)
    with pytest.raises(RuntimeError, match="larger than a slot"):
        torch.ops.zerobubble_cpu.shm_all_reduce(torch.ones(17), slots, counters, 0, 1, 1.0)
    assert int(counters[0]) == 0
    one = torch.arange(16, dtype=torch.float32)  # a group of one: its own part back
    assert torch.ops.zerobubble_cpu.shm_all_reduce(one, slots, counters, 0, 1, 1.0)
    assert torch.equal(one, torch.arange(16, dtype=torch.float32)) and int(counters[0]) == 1


def _joined(rank: int, world: int, port: int, out_dir: str, cpu_kernels: bool) -> None:
    from zerobubble.worker_svc.parallel import init_tensor_parallel, leave

    tp = init_tensor_parallel(
        rank, world, torch.device("cpu"), f"tcp://127.0.0.1:{port}", one_machine=True, cpu_kernels=cpu_kernels
    )
    assert tp.shared is not None
    compiled = tp.shared._reduce_op is not None
    summed = tp.all_reduce(torch.full((3,), float(rank + 1)))
    (Path(out_dir) / f"rank{rank}.txt").write_text(f"{compiled} {summed.tolist()}")
    leave(tp)


def test_no_cpu_kernels_reaches_the_collectives(tmp_path: Path, cpu_kernels: None) -> None:
    """`--no-cpu-kernels` keeps a worker's ranks off the compiled exchange too (its Python twin
    sums), though the kernels are built."""
    mp.spawn(_joined, args=(2, _free_port(), str(tmp_path), False), nprocs=2)
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text() == "False [3.0, 3.0, 3.0]"
