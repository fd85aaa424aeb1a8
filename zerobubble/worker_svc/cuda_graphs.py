"""CUDA graphs for decode-only steps.

A small model's decode step is bound by kernel launches: tens of layers, each a dozen kernels,
each a few microseconds of host time. Replaying a captured graph launches them all at once. A
graph fixes every shape, so one is captured at start-up per (padded batch size, row width):
batch sizes are rounded up to a bucket (`batch_buckets`), and every row of a decode step has
``1 + num_draft_slots`` tokens, so one width per draft count the scheduler may give.

Only pure-decode plans with one row width replay (`choose_graph`); prefill chunks and mixed
steps run eagerly. Padding rows (`padding_rows`) are decodes of ``width`` tokens at positions
``0..width-1`` whose K/V go to scratch blocks the scheduler never hands out, so they disturb no
request; their outputs are dropped.

The decisions and the padding are plain functions (tested on the CPU); `DecodeGraphs` is the
thin layer around them. On a device without CUDA graphs (the CPU tests) it runs the very same
padded static-buffer forward eagerly (``capture=False``), which checks that padding changes
nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from zerobubble.kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Padded batch sizes: 1, 2, 4, 8, then every multiple of 8, up to ``max_num_seqs`` (included)."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be >= 1")
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return tuple(sizes)


def draft_widths(num_spec_tokens: int) -> tuple[int, ...]:
    """Row widths a decode may have: 1 + 0..K draft slots (the scheduler trims near limits)."""
    return tuple(range(1, num_spec_tokens + 2))


@dataclass(frozen=True, slots=True)
class GraphKey:
    """One captured graph: ``num_rows`` decode rows (padded) of ``width`` tokens each."""

    num_rows: int
    width: int


def choose_graph(
    row_widths: Sequence[int], is_decode: Sequence[bool], buckets: Sequence[int], widths: Sequence[int]
) -> GraphKey | None:
    """The graph to replay for a step, or None to run it eagerly.

    Replay iff every row is a decode, all rows have the same width, that width was captured,
    and a bucket holds all rows (the smallest such bucket).
    """
    if not row_widths or not all(is_decode):
        return None
    width = row_widths[0]
    if any(w != width for w in row_widths) or width not in widths:
        return None
    num_rows = len(row_widths)
    bucket = next((b for b in sorted(buckets) if b >= num_rows), None)
    return GraphKey(bucket, width) if bucket is not None else None


def num_scratch_blocks(max_width: int, block_size: int) -> int:
    """KV blocks reserved for padding rows (one padding row's positions ``0..width-1``)."""
    return -(-max_width // block_size)


@dataclass(slots=True)
class Padding:
    """Host values of the padding rows ``num_real..key.num_rows-1`` (flat tokens after the real ones)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_table_row: list[int]  # the same table for every padding row


def padding_rows(key: GraphKey, num_real: int, block_size: int, first_scratch_block: int, max_blocks: int) -> Padding:
    """Inputs that turn ``num_real`` decode rows into ``key.num_rows`` rows of ``key.width``.

    Each padding row is a fresh ``width``-token sequence at positions ``0..width-1``: it writes
    its K/V into the scratch blocks and attends only to them.
    """
    if not 0 <= num_real <= key.num_rows:
        raise ValueError(f"{num_real} rows do not fit graph {key}")
    num_pad = key.num_rows - num_real
    offsets = list(range(key.width))
    num_scratch = num_scratch_blocks(key.width, block_size)
    table = [first_scratch_block + i for i in range(num_scratch)]
    table += [first_scratch_block] * (max_blocks - num_scratch)
    return Padding(
        input_ids=[0] * (num_pad * key.width),
        positions=offsets * num_pad,
        slot_mapping=[table[p // block_size] * block_size + p % block_size for p in offsets] * num_pad,
        seq_lens=[key.width] * num_pad,
        block_table_row=table,
    )


@dataclass(slots=True)
class _Graph:
    """Static buffers of one key, the captured graph (None when emulated) and its output."""

    input_ids: torch.Tensor  # [B*w] int64
    positions: torch.Tensor  # [B*w] int64
    slot_mapping: torch.Tensor  # [B*w] int64
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    meta: AttentionMetadata
    pad_ids: torch.Tensor  # padding values for every possible number of real rows:
    pad_positions: torch.Tensor  # row r's values sit at [r*w, (r+1)*w) like the buffers
    pad_slots: torch.Tensor
    pad_seq_lens: torch.Tensor
    pad_tables: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    output: torch.Tensor | None = None  # the captured forward's output buffer


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """Captures ``forward`` (ids, positions, meta -> one output row per token) per `GraphKey`
    and replays it for pure-decode steps."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        buckets: Sequence[int],
        widths: Sequence[int],
        block_size: int,
        first_scratch_block: int,
        max_blocks: int,
        capture: bool,
    ) -> None:
        self.forward = forward
        self.device = device
        self.buckets = tuple(buckets)
        self.widths = tuple(widths)
        self.block_size = block_size
        self.first_scratch_block = first_scratch_block
        self.max_blocks = max_blocks
        self.capture = capture
        self.graphs: dict[GraphKey, _Graph] = {}
        self._pool: Any = None  # the graphs' shared memory pool (an opaque handle)
        self.num_replays = 0

    def choose(self, row_widths: Sequence[int], is_decode: Sequence[bool]) -> GraphKey | None:
        """See `choose_graph`."""
        return choose_graph(row_widths, is_decode, self.buckets, self.widths)

    def _buffers(self, key: GraphKey) -> _Graph:
        dev, b, w = self.device, key.num_rows, key.width
        # Every row padding: a step with n real rows takes the tail [n*w:] / [n:] of these.
        pad = padding_rows(key, 0, self.block_size, self.first_scratch_block, self.max_blocks)
        pad_ids = torch.tensor(pad.input_ids, dtype=torch.int64, device=dev)
        pad_positions = torch.tensor(pad.positions, dtype=torch.int64, device=dev)
        pad_slots = torch.tensor(pad.slot_mapping, dtype=torch.int64, device=dev)
        pad_seq_lens = torch.tensor(pad.seq_lens, dtype=torch.int32, device=dev)
        pad_tables = torch.tensor([pad.block_table_row] * b, dtype=torch.int32, device=dev)
        seq_lens, tables, slots = pad_seq_lens.clone(), pad_tables.clone(), pad_slots.clone()
        qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * w
        return _Graph(
            input_ids=pad_ids.clone(),
            positions=pad_positions.clone(),
            slot_mapping=slots,
            seq_lens=seq_lens,
            block_tables=tables,
            meta=AttentionMetadata(
                query_start_loc=qsl,
                seq_lens=seq_lens,
                block_tables=tables,
                max_query_len=w,
                max_seq_len=self.max_blocks * self.block_size,
                slot_mapping=slots,
            ),
            pad_ids=pad_ids,
            pad_positions=pad_positions,
            pad_slots=pad_slots,
            pad_seq_lens=pad_seq_lens,
            pad_tables=pad_tables,
        )

    def capture_all(self) -> None:
        """Build the buffers of every key; capture the graphs (largest first, one memory pool)."""
        keys = [GraphKey(b, w) for b in sorted(self.buckets, reverse=True) for w in self.widths]
        for key in keys:
            g = self._buffers(key)
            if self.capture:
                # Warm-up on a side stream (allocator, Triton compiles), then capture.
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self.forward(g.input_ids, g.positions, g.meta)
                torch.cuda.current_stream().wait_stream(stream)
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph, pool=self._pool):
                    g.output = self.forward(g.input_ids, g.positions, g.meta)
                self._pool = cuda_graph.pool()
                g.graph = cuda_graph
            self.graphs[key] = g
        logger.info(
            "decode graphs %s: %d (batch sizes %s x widths %s)",
            "captured" if self.capture else "emulated",
            len(keys),
            self.buckets,
            self.widths,
        )

    def run(
        self,
        key: GraphKey,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        block_table_rows: torch.Tensor,
    ) -> torch.Tensor:
        """The forward's output for the step's ``T = rows * width`` tokens (``[T, ...]``), through graph ``key``.

        ``block_table_rows``: ``[rows, max_blocks]`` full block-table rows of the step's requests.
        Device-to-device copies only: real rows first, then the padding tail.
        """
        g = self.graphs[key]
        self.num_replays += 1
        num_tokens = input_ids.shape[0]
        num_rows = num_tokens // key.width
        for buf, real, pad in (
            (g.input_ids, input_ids, g.pad_ids),
            (g.positions, positions, g.pad_positions),
            (g.slot_mapping, meta.slot_mapping, g.pad_slots),
        ):
            buf[:num_tokens].copy_(real, non_blocking=True)
            buf[num_tokens:].copy_(pad[num_tokens:], non_blocking=True)
        for buf, real, pad in (
            (g.seq_lens, meta.seq_lens, g.pad_seq_lens),
            (g.block_tables, block_table_rows, g.pad_tables),
        ):
            buf[:num_rows].copy_(real, non_blocking=True)
            buf[num_rows:].copy_(pad[num_rows:], non_blocking=True)
        if g.graph is None:  # emulated: the same forward on the same padded buffers
            return self.forward(g.input_ids, g.positions, g.meta)[:num_tokens]
        g.graph.replay()
        assert g.output is not None
        return g.output[:num_tokens]
