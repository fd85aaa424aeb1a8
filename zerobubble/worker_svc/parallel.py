"""Tensor parallelism: one model spread over the ranks of a torch.distributed process group.

Megatron-style: each rank holds its slice of the query heads and of the KV heads (a
column-parallel fused q/k/v), its slice of the MLP's intermediate rows (a column-parallel fused
gate/up), and the matching columns of o_proj and down_proj (row-parallel), whose partial
products one ``all_reduce`` each sums; their biases are added once, after the sum. A model with
fewer KV heads than ranks gives each rank one KV head, shared by the ranks whose query heads it
serves (vLLM's replication). The lm_head is split over the vocabulary: each rank computes the
logits of its ``ceil(vocab / size)`` entries and one all-gather lays them side by side (on two
CPU ranks of one thread a replicated head read all of its bytes on each rank: a fifth of the
weight bytes of a SmolLM2-sized model's step). Embedding and norms stay whole on every rank (a
lookup reads only the rows of the step's tokens), so every rank ends a forward with the same
hidden states and bit-identical logits, and samples the same tokens.

A mixture of experts' sparse layers split over the same ranks (`expert_shard`): by default every
expert's gate/up rows and down columns as the dense MLP's; with ``expert_parallel``
(--enable-expert-parallel) whole experts, size-th of them per rank. Either way the router is
replicated (every rank routes every token alike), the shared expert is split by rows, and the
layer ends in one all-reduce (`zerobubble.worker_svc.moe.moe_forward`); no tokens move between ranks.

A rank reads only its slice of each sharded weight (`shard_state_dict` over a lazy reader such
as `safetensors`' `safe_open`), never a full copy of the layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerobubble.kernels.linear import LinearWeight, linear
from zerobubble.worker_svc.mxfp4 import block_range
from zerobubble.worker_svc.shm_collectives import SharedMemoryCollectives

logger = logging.getLogger(__name__)

# A collective that waits longer than this means a rank is gone or stuck: it raises, and the
# worker exits (a leader also watches its children and exits sooner, `ranks.LocalRanks.watch`).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


@dataclass(slots=True)
class CollectiveClock:
    """Seconds spent in the model's collectives (host time of the call: on CUDA the launch)."""

    seconds: float = 0.0
    calls: int = 0

    def take(self) -> float:
        """The seconds gathered since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(slots=True, eq=False)
class TensorParallel:
    """This process's place in a tensor-parallel group: its rank, the group's size, the group
    the model's collectives run on (NCCL on CUDA, gloo on the CPU) and a gloo group on the CPU
    for the leader's plans (`zerobubble.worker_svc.ranks`); None groups at size 1."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the rank's place on its machine (its GPU: cuda:local_rank)
    group: Any = None  # dist.ProcessGroup of the model's all-reduces
    cpu_group: Any = None  # dist.ProcessGroup (gloo) of host messages
    clock: CollectiveClock = field(default_factory=CollectiveClock)
    # CPU ranks all on one machine: the model's collectives go through shared memory instead of
    # gloo's loopback TCP (zerobubble.worker_svc.shm_collectives).
    shared: SharedMemoryCollectives | None = None
    # Ranks all on one machine, children of the leader: the plan channel's pipes (the leader's
    # write ends, one per other rank; another rank's read end). Empty: plans go over `cpu_group`.
    plan_fds: tuple[int, ...] = ()
    # Mixtures of experts: each rank holds whole experts, size-th of them (--enable-expert-parallel),
    # rather than every expert's share of intermediate rows (`expert_shard`).
    expert_parallel: bool = False

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place (timed in `clock`)."""
        started = time.perf_counter()
        # try/except rather than `group_errors()`: two all-reduces a layer, and the generator of a
        # context manager costs as much as the shared-memory exchange itself.
        try:
            if self.shared is not None:
                self.shared.all_reduce(tensor)
            else:
                dist.all_reduce(tensor, group=self.group)
        except Exception as exc:
            raise rank_lost(exc) from exc
        self.clock.seconds += time.perf_counter() - started
        self.clock.calls += 1
        return tensor

    def gather_columns(self, part: torch.Tensor, num_columns: int) -> torch.Tensor:
        """``[rows, num_columns]``: every rank's ``part`` ``[rows, c]`` side by side in rank order,
        cut to ``num_columns`` (each rank holds ``c = ceil(num_columns / size)`` columns, the last
        rank's padded to ``c``; see `vocab_shard`)."""
        per_rank = -(-num_columns // self.size)
        if part.shape[1] < per_rank:
            part = F.pad(part, (0, per_rank - part.shape[1]))
        started = time.perf_counter()
        try:
            if self.shared is not None:
                stacked = self.shared.all_gather(part)
            else:
                stacked = part.new_empty((self.size * part.shape[0], *part.shape[1:]))
                dist.all_gather_into_tensor(stacked, part.contiguous(), group=self.group)
        except Exception as exc:
            raise rank_lost(exc) from exc
        self.clock.seconds += time.perf_counter() - started
        self.clock.calls += 1
        rows = part.shape[0]
        stacked = stacked.view(self.size, rows, -1)
        return stacked.permute(1, 0, 2).reshape(rows, -1)[:, :num_columns].contiguous()

    def agree_min(self, value: int) -> int:
        """The least of every rank's ``value`` (a KV capacity each rank measured on its own device)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        with group_errors():
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())


class RankLost(RuntimeError):
    """A collective failed: a rank of the group is gone (or stuck past the timeout). Nothing
    more can run on this group; the worker treats it as a device fault and exits."""


@contextlib.contextmanager
def group_errors() -> Iterator[None]:
    """Any failure of a collective inside becomes `RankLost`."""
    try:
        yield
    except Exception as exc:
        raise rank_lost(exc) from exc


def rank_lost(exc: Exception) -> RankLost:
    """The `RankLost` that a collective's failure ``exc`` becomes."""
    return RankLost(f"tensor-parallel group lost (a rank exited or stopped answering): {exc}")


SINGLE = TensorParallel()


def init_tensor_parallel(
    rank: int,
    size: int,
    device: torch.device,
    init_method: str | None = None,
    store: Any = None,
    local_rank: int = 0,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
    one_machine: bool = False,
    cpu_kernels: bool = True,
) -> TensorParallel:
    """Join the group of ``size`` ranks as ``rank``, meeting at ``init_method`` (``file://``,
    ``tcp://``, ``env://``) or through ``store`` (a ``dist.Store``); the model's collectives
    run on NCCL for a CUDA ``device``, on gloo otherwise (through shared memory when every rank
    is on ``one_machine``, exchanged by the compiled CPU kernels unless ``cpu_kernels`` is off),
    and host messages always on gloo."""
    if size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    options: dict[str, Any] = {"device_id": torch.device("cuda", local_rank)} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, store=store, rank=rank, world_size=size, timeout=timeout, **options
    )
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    shared = None
    if backend == "gloo" and one_machine:
        impl = "auto" if cpu_kernels else "torch"
        shared = SharedMemoryCollectives(dist.group.WORLD, timeout_s=timeout.total_seconds(), impl=impl)
    via = "shared memory" if shared is not None else backend
    logger.info("tensor-parallel rank %d of %d joined (all-reduce over %s, on %s)", rank, size, via, device)
    return TensorParallel(rank, size, local_rank, dist.group.WORLD, cpu_group, shared=shared)


def leave(tp: TensorParallel) -> None:
    """Leave the group (at a clean exit; a dead peer's group is left by the exit itself)."""
    if tp.size > 1 and dist.is_initialized():
        if tp.shared is not None:
            tp.shared.close()
            tp.shared = None
        dist.destroy_process_group()


def row_linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel product: this rank's partial ``x @ weight.T`` summed over the group, the
    bias added once after the sum (size 1: the plain product, bias fused)."""
    if tp.size == 1:
        return linear(x, weight, bias)
    out = tp.all_reduce(linear(x, weight, None))
    return out if bias is None else out + bias


# -- the leader's plans to the other ranks ----------------------------------------------------

# The plan channel's messages.
PLAN, RESET, STOP = 1, 2, 3
_HEADER = struct.Struct("<qq")  # kind, payload bytes
# One broadcast carries the header and a payload up to this size (a decode plan), a larger one
# (prompt tokens) follows apart: on gloo a 4 KiB broadcast costs what a 16-byte one does, 64 KiB twice that.
CHANNEL_BYTES = 4096


@dataclass(slots=True, eq=False)
class PlanChannel:
    """The leader's messages to the other ranks: over pipes when the ranks are the leader's
    children (`TensorParallel.plan_fds`: a write costs microseconds and a waiting rank sleeps in
    the kernel, where a gloo broadcast cost 1.5 ms a plan on the CPU), else broadcast over the
    gloo group (ranks on other machines). `seconds` is the leader's time spent sending."""

    tp: TensorParallel
    buffer: torch.Tensor = field(default_factory=lambda: torch.zeros(CHANNEL_BYTES, dtype=torch.uint8))
    seconds: float = 0.0  # since the last `take_seconds`
    messages: int = 0
    total_s: float = 0.0  # since the start

    def send(self, kind: int, payload: bytes = b"") -> None:
        started = time.perf_counter()
        with group_errors():
            if self.tp.plan_fds:
                message = _HEADER.pack(kind, len(payload)) + payload
                for fd in self.tp.plan_fds:
                    _write_all(fd, message)
            else:
                self._broadcast(kind, payload)
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        self.total_s += elapsed
        self.messages += 1

    def _broadcast(self, kind: int, payload: bytes) -> None:
        view = self.buffer.numpy()
        view[: _HEADER.size] = np.frombuffer(_HEADER.pack(kind, len(payload)), np.uint8)
        inline = len(payload) <= CHANNEL_BYTES - _HEADER.size
        if inline and payload:
            view[_HEADER.size : _HEADER.size + len(payload)] = np.frombuffer(payload, np.uint8)
        dist.broadcast(self.buffer, src=0, group=self.tp.cpu_group)
        if not inline:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.tp.cpu_group)

    def receive(self) -> tuple[int, bytes]:
        """The next message (blocks until the leader sends one)."""
        with group_errors():
            if self.tp.plan_fds:
                fd = self.tp.plan_fds[0]
                kind, size = _HEADER.unpack(_read_exact(fd, _HEADER.size))
                return kind, _read_exact(fd, size)
            dist.broadcast(self.buffer, src=0, group=self.tp.cpu_group)
            view = self.buffer.numpy()
            kind, size = _HEADER.unpack(view[: _HEADER.size].tobytes())
            if size <= CHANNEL_BYTES - _HEADER.size:
                return kind, view[_HEADER.size : _HEADER.size + size].tobytes()
            payload = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self.tp.cpu_group)
        return kind, payload.numpy().tobytes()

    def take_seconds(self) -> float:
        """The sending time gathered since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``; EOFError when the writer is gone first."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            raise EOFError("the leader's plan channel closed")
        data += chunk
    return bytes(data)


# -- which slice of the weights a rank holds ----------------------------------------------------


class MoeShape(Protocol):
    """What sharding reads of `zerobubble.worker_svc.moe.MoeSpec` (a dataclass), which imports
    this module."""

    @property
    def num_experts(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def shared_intermediate_size(self) -> int: ...
    @property
    def interleaved(self) -> bool: ...


class ModelSpec(Protocol):
    """What sharding reads of `zerobubble.worker_svc.model.ModelSpec` (a dataclass), which
    imports this module."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def moe(self) -> MoeShape | None: ...


Spec = TypeVar("Spec", bound=ModelSpec)


class ShardableModel(Protocol[Spec]):
    """What `shard_model` sets on a `zerobubble.worker_svc.model.CausalLM`."""

    spec: Spec
    tp: TensorParallel


@dataclass(frozen=True, slots=True)
class HeadShard:
    """A rank's heads and MLP rows: ``[start, start + count)`` of each."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int
    inter_start: int
    inter_count: int


def head_shard(spec: ModelSpec, tp: TensorParallel) -> HeadShard:
    """The slice of ``spec``'s heads and intermediate rows that ``tp.rank`` holds;
    ``ValueError`` naming the numbers when they do not divide over ``tp.size`` ranks."""
    size, rank = tp.size, tp.rank
    q, kv, inter = spec.num_q_heads, spec.num_kv_heads, spec.intermediate_size
    if q % size:
        raise ValueError(f"tensor-parallel size {size} does not divide the model's {q} attention heads")
    if kv % size and size % kv:
        raise ValueError(
            f"tensor-parallel size {size} and the model's {kv} KV heads: one must divide the other "
            "(more ranks than KV heads replicate each over size / KV heads ranks)"
        )
    if inter % size:
        raise ValueError(f"tensor-parallel size {size} does not divide the model's intermediate size {inter}")
    kv_count = max(kv // size, 1)
    # With fewer KV heads than ranks, size / kv consecutive ranks share one KV head: the one
    # their query heads (consecutive, q / size each) read.
    kv_start = rank * kv_count if kv >= size else rank // (size // kv)
    q_count, inter_count = q // size, inter // size
    return HeadShard(rank * q_count, q_count, kv_start, kv_count, rank * inter_count, inter_count)


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """A rank's part of each sparse layer: of experts ``[expert_start, + expert_count)`` the
    intermediate rows ``[inter_start, + inter_count)`` (tensor parallel: every expert, a slice of
    its rows; expert parallel: whole experts, size-th of them), and the shared expert's rows
    ``[shared_start, + shared_count)`` (tensor parallel in both)."""

    expert_start: int
    expert_count: int
    inter_start: int
    inter_count: int
    shared_start: int
    shared_count: int


def expert_shard(moe: MoeShape, tp: TensorParallel) -> ExpertShard:
    """The experts and rows of ``moe`` that ``tp.rank`` holds (`TensorParallel.expert_parallel`
    picks the placement); ``ValueError`` naming the numbers when they do not divide."""
    size, rank = tp.size, tp.rank
    experts, inter, shared = moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
    if shared % size:
        raise ValueError(f"tensor-parallel size {size} does not divide the model's shared expert size {shared}")
    shared_count = shared // size
    if tp.expert_parallel:
        if experts % size:
            raise ValueError(
                f"--enable-expert-parallel: tensor-parallel size {size} does not divide the model's {experts} experts"
            )
        count = experts // size
        return ExpertShard(rank * count, count, 0, inter, rank * shared_count, shared_count)
    if inter % size:
        raise ValueError(
            f"tensor-parallel size {size} does not divide the model's expert intermediate size {inter} "
            "(--enable-expert-parallel places whole experts instead)"
        )
    count = inter // size
    return ExpertShard(0, experts, rank * count, count, rank * shared_count, shared_count)


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """``(start, count)``: the lm_head rows (vocabulary entries) ``tp.rank`` computes logits for,
    ``ceil(vocab_size / size)`` per rank and the rest on the last (`TensorParallel.gather_columns`
    pads it back)."""
    per_rank = -(-vocab_size // tp.size)
    start = min(tp.rank * per_rank, vocab_size)
    return start, min(per_rank, vocab_size - start)


def shard_spec(spec: Spec, tp: TensorParallel) -> Spec:
    """``spec`` as one rank's layers see it: its own head and intermediate counts."""
    if tp.size == 1:
        return spec
    shard = head_shard(spec, tp)
    moe = spec.moe
    if moe is not None:
        experts = expert_shard(moe, tp)
        moe = dataclasses.replace(  # type: ignore[type-var]
            moe,
            intermediate_size=experts.inter_count,
            shared_intermediate_size=experts.shared_count,
            first_expert=experts.expert_start,
            first_row=experts.inter_start,
            num_local_experts=experts.expert_count,
            # Each rank's partial products are summed: an expert's down bias is added on one.
            adds_down_bias=tp.rank == 0 or tp.expert_parallel,
        )
    return dataclasses.replace(  # type: ignore[type-var]
        spec, num_q_heads=shard.q_count, num_kv_heads=shard.kv_count, intermediate_size=shard.inter_count, moe=moe
    )


def shard_model(model: ShardableModel[Spec], tp: TensorParallel) -> Spec:
    """Make a built, not yet loaded ``model`` ``tp.rank``'s: its spec cut to the rank's heads
    and rows, its collectives on ``tp``. Returns the whole model's spec, which the state dict
    is cut by (`shard_state_dict`, `ShardedStateDict`)."""
    full = model.spec
    model.spec, model.tp = shard_spec(full, tp), tp
    return full


# Per weight name suffix: (dimension cut, which range of `HeadShard`): rows of column-parallel
# weights (and their biases), columns of row-parallel ones.
_CUTS: dict[str, tuple[int, str]] = {
    "self_attn.q_proj.weight": (0, "q"),
    "self_attn.q_proj.bias": (0, "q"),
    "self_attn.k_proj.weight": (0, "kv"),
    "self_attn.k_proj.bias": (0, "kv"),
    "self_attn.v_proj.weight": (0, "kv"),
    "self_attn.v_proj.bias": (0, "kv"),
    "self_attn.o_proj.weight": (1, "q"),
    "self_attn.sinks": (0, "q_heads"),  # gpt-oss: one per query head
    "mlp.gate_proj.weight": (0, "inter"),
    "mlp.gate_proj.bias": (0, "inter"),
    "mlp.up_proj.weight": (0, "inter"),
    "mlp.up_proj.bias": (0, "inter"),
    "mlp.down_proj.weight": (1, "inter"),
    "mlp.shared_expert.gate_proj.weight": (0, "shared"),  # Qwen2-MoE
    "mlp.shared_expert.up_proj.weight": (0, "shared"),
    "mlp.shared_expert.down_proj.weight": (1, "shared"),
}
# The routed experts of a sparse layer, tensor parallel: each expert's rows cut as the dense
# MLP's, under the checkpoints' per-expert names (Qwen's gate/up/down_proj, Mixtral's w1/w3/w2)
# or stacked ones: transformers 5's ``gate_up_proj [E, 2 I, H]`` (gate rows, then up rows: two
# ranges) and ``down_proj [E, H, I]``, gpt-oss's ``gate_up_proj [E, H, 2 I]`` (gate and up columns
# interleaved: one range of pairs), its bias ``[E, 2 I]`` and ``down_proj [E, I, H]``. The down
# bias stays whole (`shard_spec`: added on one rank). Expert parallel cuts the stacked ones by
# expert and reads per-expert names only for the rank's own experts.
_EXPERT_ROWS = re.compile(r"experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$")
_EXPERT_COLUMNS = re.compile(r"experts\.\d+\.(down_proj|w2)\.weight$")
_EXPERT_ID = re.compile(r"experts\.(\d+)\.")
_STACKED = re.compile(r"experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_STACKED_CUTS: dict[tuple[bool, str], tuple[int, str]] = {  # (interleaved, name) -> cut
    (False, "experts.gate_up_proj"): (1, "gate_up_halves"),
    (False, "experts.down_proj"): (2, "expert_inter"),
    (True, "experts.gate_up_proj"): (2, "expert_pairs"),
    (True, "experts.gate_up_proj_bias"): (1, "expert_pairs"),
    (True, "experts.down_proj"): (1, "expert_inter"),
    # Released gpt-oss checkpoints' MXFP4 experts (`zerobubble.worker_svc.mxfp4`), stored
    # [E, out, in / 32, 16] and [E, out, in / 32]: gate/up by output pairs, down by the blocks
    # covering the rank's intermediate rows (cut to them once dequantized).
    (True, "experts.gate_up_proj_blocks"): (1, "expert_pairs"),
    (True, "experts.gate_up_proj_scales"): (1, "expert_pairs"),
    (True, "experts.down_proj_blocks"): (2, "expert_inter_blocks"),
    (True, "experts.down_proj_scales"): (2, "expert_inter_blocks"),
}

# Reads ``name`` cut to ``[start, stop)`` along ``dim`` (None: whole); a lazy file reader reads only that.
SliceReader = Callable[[str, int, int, int], torch.Tensor]


class ShardedStateDict(Mapping[str, torch.Tensor]):
    """A Hugging Face state dict as one rank loads it: the sharded weights cut to its slice
    (read through ``read`` so a file reader reads only that slice), the rest whole."""

    def __init__(self, names: list[str], read: SliceReader, spec: ModelSpec, tp: TensorParallel) -> None:
        self.read = read
        s, d = head_shard(spec, tp), spec.head_dim
        self.ranges = {
            "q": (s.q_start * d, s.q_count * d),
            "q_heads": (s.q_start, s.q_count),
            "kv": (s.kv_start * d, s.kv_count * d),
            "inter": (s.inter_start, s.inter_count),
        }
        self.moe, self.expert_parallel = spec.moe, tp.expert_parallel
        if self.moe is not None:
            e = expert_shard(self.moe, tp)
            self.ranges.update(
                experts=(e.expert_start, e.expert_count),
                expert_inter=(e.inter_start, e.inter_count),
                expert_pairs=(2 * e.inter_start, 2 * e.inter_count),
                expert_inter_blocks=block_range(e.inter_start, e.inter_count),
                shared=(e.shared_start, e.shared_count),
            )
        # Expert parallel: other ranks' experts are not this state dict's (loading iterates it).
        self.names = [name for name in names if self.holds(name)]
        self.known = frozenset(self.names)

    def holds(self, name: str) -> bool:
        """Whether ``name`` is this rank's: all but other ranks' experts under per-expert names."""
        found = _EXPERT_ID.search(name) if self.expert_parallel else None
        if found is None:
            return True
        start, count = self.ranges["experts"]
        return start <= int(found.group(1)) < start + count

    def __contains__(self, name: object) -> bool:
        return name in self.known  # without reading the tensor, as Mapping's would

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.known:
            raise KeyError(name)
        cut = self.cut(name)
        if cut is None:
            return self.read(name, 0, 0, -1)
        dim, what = cut
        if what == "gate_up_halves":  # the gate rows' range, then the same range of the up rows
            assert self.moe is not None
            start, count = self.ranges["expert_inter"]
            starts = (start, self.moe.intermediate_size + start)
            return torch.cat([self.read(name, dim, at, at + count) for at in starts], dim=dim)
        start, count = self.ranges[what]
        return self.read(name, dim, start, start + count)

    def cut(self, name: str) -> tuple[int, str] | None:
        """``(dimension, range name)`` of ``name``'s cut; None: read whole."""
        if not name.startswith("model.layers."):
            return None
        found = next((c for suffix, c in _CUTS.items() if name.endswith(suffix)), None)
        if found is not None or self.moe is None:
            return found
        stacked = _STACKED.search(name)
        if self.expert_parallel:
            return (0, "experts") if stacked else None
        if stacked:
            return _STACKED_CUTS.get((self.moe.interleaved, stacked.group(0)))
        if _EXPERT_ROWS.search(name):
            return 0, "expert_inter"
        return (1, "expert_inter") if _EXPERT_COLUMNS.search(name) else None

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def shard_state_dict(
    state_dict: Mapping[str, torch.Tensor], spec: ModelSpec, tp: TensorParallel
) -> Mapping[str, torch.Tensor]:
    """One rank's view of a whole in-memory state dict (tests; `ShardedStateDict` over files
    reads less)."""
    if tp.size == 1:
        return state_dict

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        tensor = state_dict[name]
        return tensor if stop < 0 else tensor.narrow(dim, start, stop - start).contiguous()

    return ShardedStateDict(list(state_dict), read, spec, tp)
