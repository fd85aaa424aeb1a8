"""Host-built step inputs onto the device without stalling the host, and results back.

A ``torch.tensor(values, device="cuda")`` copies from pageable memory: CUDA stages it through a
driver buffer and the call returns only once the copy ran, i.e. after every kernel queued before
it: the host waits for the previous step. Here values are written into page-locked (pinned) host
memory and copied with ``non_blocking=True``, which only enqueues the copy. Each upload gets a
fresh pinned tensor from torch's caching host allocator, which records the copy's stream and does
not hand the block out again before the copy has run, so a later step can never overwrite values
an earlier, still-queued copy has yet to read.

On the CPU the values are already where they are used: a plain tensor, no copy. Any other device
is treated as an accelerator (the sync-free test runs the step path on a fake ``meta`` device).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# What a step builds on the host: Python lists, or numpy arrays gathered from per-slot arrays.
HostValues = Sequence[int] | Sequence[float] | Sequence[bool] | np.ndarray


def is_accelerator(device: torch.device) -> bool:
    """Whether tensors on ``device`` live apart from the host (reading them would synchronise)."""
    return device.type != "cpu"


# numpy's twin of each dtype a step builds on the host.
_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.bool: np.bool_, torch.float32: np.float32}


def cpu_tensor(values: HostValues, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a new 1-D CPU tensor.

    Through numpy: ``torch.tensor`` of a short list or array costs 3-6 µs (three dispatched
    ops), ``from_numpy`` of a fresh array 1-2 µs, and a step makes a dozen of them.
    """
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype)
    return torch.from_numpy(np.array(values, dtype=np_dtype))


def to_device(values: HostValues, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, through pinned memory and an async copy."""
    if not is_accelerator(device):
        return cpu_tensor(values, dtype)
    out = torch.empty(len(values), dtype=dtype, device=device)
    write(out, values)
    return out


def write(dst: torch.Tensor, values: HostValues) -> None:
    """``dst[:] = values`` for a 1-D device view (a block-table row), without a sync."""
    if not is_accelerator(dst.device):
        dst.copy_(cpu_tensor(values, dst.dtype))
        return
    host = torch.empty(len(values), dtype=dst.dtype, pin_memory=True)
    host.copy_(cpu_tensor(values, dst.dtype))
    dst.copy_(host, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying ``t`` into fresh pinned host memory; valid once the stream reaches it.

    The caller records an event after it (on the stream the copy was issued on) and waits for
    that event on another thread before reading the values.
    """
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
