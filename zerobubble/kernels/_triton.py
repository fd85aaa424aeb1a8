"""Optional Triton import and the rule for choosing Triton or the torch reference.

Triton decides at ``@triton.jit`` time whether a kernel is compiled or interpreted, so
``TRITON_INTERPRET=1`` must be in the environment before any module that defines kernels is
imported. On CPU only the interpreter works, which is what the kernel tests use.
"""

from __future__ import annotations

from typing import Literal

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs run the torch references
    triton = None
    tl = None
    HAS_TRITON = False

# None: Triton on CUDA, the torch twin elsewhere; "cpp": the compiled CPU kernels
# (zerobubble.kernels.cpu), which a caller asks for explicitly once it has loaded them.
KernelImpl = Literal["torch", "triton", "cpp"] | None


def is_interpreted(kernel: object) -> bool:
    """Whether a ``@triton.jit`` kernel was built by the CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def use_triton(tensor: torch.Tensor, impl: KernelImpl, kernel: object | None = None) -> bool:
    """Decide whether to run the Triton kernel for ``tensor``.

    ``impl=None`` picks Triton for CUDA tensors when Triton is installed and the torch reference
    otherwise; ``"triton"`` or ``"torch"`` forces one. Forcing Triton on CPU tensors needs the
    interpreter, which ``kernel`` (the jitted function) is checked against.
    """
    if impl in ("torch", "cpp"):
        return False
    if impl is None:
        return HAS_TRITON and tensor.is_cuda
    if impl != "triton":
        raise ValueError(f"impl must be None, 'torch', 'triton' or 'cpp', got {impl!r}")
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' requested but triton is not installed")
    if not tensor.is_cuda and kernel is not None and not is_interpreted(kernel):
        raise RuntimeError(
            "impl='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment before the kernels are imported"
        )
    return True


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (Triton block shapes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())
