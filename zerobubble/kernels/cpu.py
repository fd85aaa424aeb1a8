"""The compiled CPU kernels of the decode path (``csrc/``), built once per machine.

On a CPU the decode step of a small model is as much dispatch as arithmetic: between its matmuls
a layer runs some thirty aten ops on a few rows each, every one paying a few microseconds. The
C++ kernels do each fused step of `zerobubble.kernels.fused` and the paged KV write and
short-row attention of `zerobubble.kernels.attention` in one pass, and the bfloat16 and int8
products of `zerobubble.kernels.linear` at the memory's speed, and the exchange of the
shared-memory collectives (`zerobubble.worker_svc.shm_collectives`), and register as torch
operators (``torch.ops.zerobubble_cpu.*``). The public functions of those modules run them for
``impl="cpp"``; a model asks for that when it loaded them (`zerobubble.worker_svc.model.CausalLM.kernels`).

They are compiled with the host's C++ compiler for the host's instruction set (``-march=native``,
or the level ``$ZEROBUBBLE_CPU_MARCH`` names: the source has AVX-512, AVX2 and plain paths) into
torch's extension cache (``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``), under a
name that changes with the source, the torch version, the CPU and the environment: the first
load on a machine takes about half a minute (``python -m zerobubble.kernels.cpu`` does it ahead
of time), later ones are immediate. Where no compiler works, loading reports why and the torch
twins serve.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# One translation unit per concept (fused steps, attention, products, collectives, the operator
# schemas) and their shared header: the builder compiles the units in parallel.
SOURCE_FILES = sorted(
    path for path in (Path(__file__).resolve().parent / "csrc").iterdir() if path.suffix in (".cpp", ".h")
)
NAMESPACE = "zerobubble_cpu"
# The instruction set the kernels are compiled for: this CPU's own by default; a named level
# (e.g. x86-64-v3: AVX2 and FMA, no AVX-512) builds them for every CPU of that level, as an image
# built on one node for another would need.
MARCH_ENV = "ZEROBUBBLE_CPU_MARCH"


def compile_flags() -> list[str]:
    """The compiler's flags: optimised, OpenMP, for ``$ZEROBUBBLE_CPU_MARCH`` (default ``native``)."""
    return ["-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", "-fopenmp"]


def cpu_flags() -> str:
    """The instruction-set flags of this CPU (``-march=native`` compiles for them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


# The instruction-set extensions that decide which products run fastest (the benchmarks name them).
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it (``/proc/cpuinfo``), else the platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_cpu() -> str:
    """``"AMD EPYC; avx2 fma avx512f avx512_vnni avx512_bf16; 2 cores"``: the model, which of
    `NOTABLE_FLAGS` it has, and the cores this process may use (the benchmarks record it)."""
    flags = set(cpu_flags().split())
    have = " ".join(flag for flag in NOTABLE_FLAGS if flag in flags) or "none of " + " ".join(NOTABLE_FLAGS)
    return f"{cpu_model()}; {have}; {num_cores()} cores"


def num_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def library_name() -> str:
    """The extension's name: one per source, torch version, instruction set and environment (the
    build files name the environment's torch headers, so two environments sharing one name would
    rebuild it each time they alternate)."""
    digest = hashlib.sha256()
    for path in SOURCE_FILES:
        digest.update(path.read_bytes())
    for part in (torch.__version__, cpu_flags(), " ".join(compile_flags()), sys.prefix):
        digest.update(part.encode())
    return f"{NAMESPACE}_{digest.hexdigest()[:12]}"


def is_loaded() -> bool:
    """Whether the operators are registered in this process."""
    try:
        return hasattr(getattr(torch.ops, NAMESPACE), "paged_attention")
    except (AttributeError, RuntimeError):
        return False


def native_bf16() -> bool:
    """Whether the loaded kernels' block product runs on AVX-512 BF16 instructions (compiled for a
    CPU without them, it is a plain loop that no product plan offers)."""
    return bool(torch.ops.zerobubble_cpu.block_linear_is_native())


def _put_ninja_on_path() -> None:
    """torch's extension builder runs ``ninja`` from PATH; a virtual environment that was not
    activated has the `ninja` package's binary beside its interpreter only."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, os.environ.get("PATH", "")))


@functools.cache
def load(verbose: bool = False) -> bool:
    """Compile (when not yet built for this source, torch and CPU) and load the kernels; False,
    with a warning naming the reason, where that fails (no compiler, no OpenMP, another OS)."""
    if is_loaded():
        return True
    from torch.utils.cpp_extension import load as load_extension

    _put_ninja_on_path()
    try:
        load_extension(
            name=library_name(),
            sources=[str(path) for path in SOURCE_FILES if path.suffix == ".cpp"],
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch twins in charge
        logger.warning("the compiled CPU kernels are unavailable, the torch ops serve instead: %s", exc)
        return False
    return is_loaded()


def main() -> None:
    """``python -m zerobubble.kernels.cpu``: build (or find) the kernels; exit 1 if they fail."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ok = load(verbose="-v" in sys.argv[1:])
    print(f"{library_name()}: {'loaded' if ok else 'unavailable'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
