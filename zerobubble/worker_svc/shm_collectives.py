"""All-reduce and all-gather over shared memory for the CPU ranks of one machine.

gloo's collectives go through loopback TCP: tens of microseconds to a millisecond per call
(docs/benchmarks/tensor-parallel.md), and a tensor-parallel forward makes two all-reduces per
layer and gathers the vocabulary's logits once, so a small model would spend more time in
collectives than in its products. Ranks on one machine can instead meet in a shared-memory
segment, as vLLM's and SGLang's CPU backends do: each rank copies its part into its own slot,
publishes a sequence number, waits until every rank has published the same one, and reads
every slot — a sum adds them up in rank order, the same additions in the same order on every
rank, so every rank ends with bit-identical sums (what keeps the ranks' sampled tokens
identical); a gather lays them side by side.

Two sets of slots alternate between exchanges: a rank writes exchange ``n``'s part only after
it has seen every rank publish exchange ``n - 1``, i.e. after every rank has finished reading
exchange ``n - 2``'s slots, the set it is about to overwrite. A tensor larger than a slot goes
through in slot-sized pieces. torch.distributed still forms the group (rendezvous, the
segment's name, barriers).

The exchange itself (copy in, publish, wait, sum or copy out) runs in the compiled CPU kernels
(``torch.ops.zerobubble_cpu.shm_all_reduce`` / ``shm_all_gather``, `zerobubble.kernels.cpu`)
where they load: a few microseconds, against some fifty for the same steps as torch ops from
Python, which stay as their twin and serve where the kernels do not (``impl="torch"``). The
compiled exchange publishes with a release store and reads the others' numbers with acquire
loads; it sums 16-bit parts through float32, rounding after each rank's addition, as torch's
adds do, so both paths give the same bits.

The segment lives in ``/dev/shm`` only until every rank has mapped it (the creator unlinks it
then), so a killed group leaves nothing behind. The Python path's plain stores are ordered as
written on x86 (TSO), which its publish-then-read protocol relies on; the compiled CPU kernels
are x86-only too.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

# Each rank's sequence number sits on a cache line of its own, so a rank polling the others'
# does not keep stealing the line that rank writes.
_LINE = 64
_SHM_DIR = "/dev/shm"
# Spins between yields while waiting: ranks on cores of their own answer within a few spins;
# more ranks than cores need the yield to let the awaited rank run at all.
_SPINS_PER_YIELD = 32
# The dtypes the compiled all-reduce sums (others take the Python path).
_SUMMABLE = frozenset((torch.float32, torch.bfloat16, torch.float16))


class SharedMemoryCollectives:
    """Sums and gathers of tensors over the ranks of ``group``, all on this machine."""

    def __init__(self, group: Any, max_bytes: int = 1 << 22, timeout_s: float = 60.0, impl: str = "auto") -> None:
        """``group``: a torch.distributed group whose ranks share this machine; ``max_bytes``:
        one rank's slot (larger tensors go through in pieces); ``timeout_s``: how long an
        exchange waits for a rank before it raises; ``impl``: ``"cpp"`` exchanges in the compiled
        CPU kernels (`zerobubble.kernels.cpu`), ``"torch"`` in Python, ``"auto"`` the compiled
        ones where they load. The two share the protocol and the roundings: ranks may differ."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.seq = 0
        header = self.world_size * _LINE
        self._mapping = _map_segment(group, self.rank, header + 2 * self.world_size * max_bytes)
        # Each rank's sequence number, a cache line apart: the compiled ops take the tensor, the
        # Python twin reads and writes the same memory through numpy (cheaper per element).
        self._counter_view = torch.frombuffer(self._mapping, dtype=torch.int64, count=header // 8)[:: _LINE // 8]
        self._counters = self._counter_view.numpy()
        data = torch.frombuffer(self._mapping, dtype=torch.uint8, offset=header)
        self._slots = data.view(2, self.world_size, max_bytes)
        self._reduce_op, self._gather_op = _compiled_ops(impl)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank must call it with a tensor of the
        same shape and dtype, in the same order."""
        if not tensor.is_contiguous():
            dist.all_reduce(tensor, group=self.group)
            return tensor
        if tensor.nbytes <= self.max_bytes:
            self._reduce(tensor)
            return tensor
        flat = tensor.view(-1)
        piece = self.max_bytes // tensor.element_size()
        for start in range(0, flat.numel(), piece):
            self._reduce(flat[start : start + piece])
        return tensor

    def all_gather(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's ``part`` ``[rows, ...]`` (the same shape and dtype on every rank), stacked
        in rank order: ``[world, rows, ...]``."""
        part = part.contiguous()
        out = part.new_empty((self.world_size, *part.shape))
        row_bytes = part[:1].nbytes
        if part.dim() == 0 or row_bytes > self.max_bytes:
            dist.all_gather_into_tensor(out.view(-1, *part.shape[1:]), part, group=self.group)
            return out
        if part.nbytes <= self.max_bytes:
            self._gather(part, out)
            return out
        rows = self.max_bytes // row_bytes
        for start in range(0, part.shape[0], rows):
            self._gather(part[start : start + rows], out[:, start : start + rows])
        return out

    def _reduce(self, part: torch.Tensor) -> None:
        """Sum ``part`` (contiguous, at most a slot) over the ranks in place, in rank order."""
        self.seq += 1
        if self._reduce_op is not None and part.dtype in _SUMMABLE:
            if not self._reduce_op(part, self._slots, self._counter_view, self.rank, self.seq, self.timeout_s):
                self._raise_late(self.seq)
            return
        flat = part.view(-1)
        slots = self._exchange(flat, self.seq)
        torch.add(slots[0], slots[1], out=flat)
        for r in range(2, self.world_size):
            flat.add_(slots[r])

    def _gather(self, part: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's ``part`` (contiguous, at most a slot) into ``out[r]`` (each contiguous)."""
        self.seq += 1
        if self._gather_op is not None:
            if not self._gather_op(part, self._slots, self._counter_view, out, self.rank, self.seq, self.timeout_s):
                self._raise_late(self.seq)
            return
        slots = self._exchange(part.view(-1), self.seq)
        out.copy_(slots.view(self.world_size, *part.shape))

    def _exchange(self, flat: torch.Tensor, seq: int) -> torch.Tensor:
        """Publish this rank's ``flat`` (at most a slot) as exchange ``seq`` and wait for every
        rank's: the slots ``[world, numel]``, readable until the exchange after next. The compiled
        ops' torch twin."""
        slots = self._slots[seq & 1, :, : flat.nbytes].view(flat.dtype)
        slots[self.rank].copy_(flat)
        self._counters[self.rank] = seq
        self._wait(seq)
        return slots

    def _wait(self, seq: int) -> None:
        """Until every rank has published ``seq``; raises after ``timeout_s``."""
        spins = 0
        deadline = 0.0
        while self._counters.min() < seq:
            spins += 1
            if spins % _SPINS_PER_YIELD == 0:
                os.sched_yield()
                now = time.monotonic()
                if deadline == 0.0:
                    deadline = now + self.timeout_s
                elif now > deadline:
                    self._raise_late(seq)

    def _raise_late(self, seq: int) -> NoReturn:
        """The error of exchange ``seq`` timing out, naming the ranks that did not publish it."""
        late = [r for r in range(self.world_size) if self._counters[r] < seq]
        raise RuntimeError(
            f"tensor-parallel exchange {seq}: rank(s) {late} did not arrive within "
            f"{self.timeout_s:.0f} s (a rank died or hangs)"
        )

    def close(self) -> None:
        """Unmap the segment (every view of it must be gone first)."""
        self._counters = None  # type: ignore[assignment]
        self._counter_view = None  # type: ignore[assignment]
        self._slots = None  # type: ignore[assignment]
        self._mapping.close()


def _compiled_ops(impl: str) -> tuple[Callable[..., bool] | None, Callable[..., bool] | None]:
    """The compiled exchange's all-reduce and all-gather ops for ``impl`` (None, None: Python)."""
    if impl not in ("auto", "cpp", "torch"):
        raise ValueError(f"impl must be 'auto', 'cpp' or 'torch', not {impl!r}")
    if impl == "torch":
        return None, None
    from zerobubble.kernels import cpu

    if not cpu.load():
        if impl == "cpp":
            raise RuntimeError("impl='cpp': the compiled CPU kernels did not build or load")
        return None, None
    # The overloads themselves: calling one skips the packet's overload lookup on every call.
    ops = torch.ops.zerobubble_cpu
    return ops.shm_all_reduce.default, ops.shm_all_gather.default


def _map_segment(group: Any, rank: int, size: int) -> mmap.mmap:
    """The group's shared segment of ``size`` bytes, zeroed: created by the group's first rank,
    mapped by all, then unlinked, so it disappears with the last process that maps it."""
    names: list[str | None] = [f"zerobubble-collectives-{os.getpid()}-{secrets.token_hex(6)}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    path = os.path.join(_SHM_DIR, str(names[0]))
    if rank == 0:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.ftruncate(fd, size)  # a new file reads as zeros: every sequence number starts at 0
    dist.barrier(group=group)
    if rank != 0:
        fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    dist.barrier(group=group)
    if rank == 0:
        os.unlink(path)
    return mapping
