"""Compile every Triton kernel for NVIDIA GPUs here, without a GPU (CI runs it: `make test`).

The CPU interpreter checks what the kernels compute; it cannot tell whether they compile.
This script drives the device check's kernel section (`scripts/device_check/kernels.py`: every
kernel, at the shapes of a real model: head_dim 128, a 32k vocabulary) on the CPU with each
launch intercepted: the launch
records its argument types and constexprs instead of running, and every distinct launch is then
compiled ahead of time, to PTX and with the wheel's own `ptxas` to a cubin, for Ampere (sm_80)
and Hopper (sm_90). Needs no CUDA driver.

    python scripts/compile_kernels.py [--json OUT.json]

Prints one line per kernel variant and target; exits 1 if any fails to compile, or if a kernel
defined in `kernels/` was never launched (the drive would then no longer cover it).
"""

from __future__ import annotations

import os

# Compiled kernels, not interpreted ones: decided when the kernel modules are imported.
os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

TARGETS = ((80, "Ampere"), (90, "Hopper"))
_POINTER_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def arg_type(value: Any) -> str:
    """Triton's signature type of a runtime argument."""
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


Launch = tuple[Any, dict[str, str], dict[str, Any], dict[str, Any]]


def record_launches() -> list[Launch]:
    """Make every `JITFunction` launch record (kernel, signature, constexprs, launch options)
    instead of running."""
    from triton.runtime.jit import JITFunction

    import zerobubble.kernels._triton
    import zerobubble.kernels.attention
    import zerobubble.kernels.moe

    launches: list[Launch] = []

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        # Launch options (num_warps, num_stages, ...) are not the kernel's parameters.
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in self.arg_names}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        for param, (name, value) in zip(self.params, bound.arguments.items()):
            if param.is_constexpr:
                signature[name] = "constexpr"
                constexprs[name] = value
            else:
                signature[name] = arg_type(value)
        launches.append((self, signature, constexprs, options))

    JITFunction.run = run  # type: ignore[method-assign]
    # The host wrappers accept CPU tensors for Triton only under the interpreter; here the
    # launch never runs, so let them through. The attention kernel widens its dot operands
    # under the interpreter, and so does the grouped expert product: compile the tensor-core
    # variants a GPU runs.
    zerobubble.kernels._triton.is_interpreted = lambda kernel: True  # type: ignore[assignment]
    zerobubble.kernels.attention.is_interpreted = lambda kernel: False  # type: ignore[assignment]
    zerobubble.kernels.moe.is_interpreted = lambda kernel: False  # type: ignore[assignment]
    return launches


def resource_usage(cuobjdump: Path, cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack bytes (register spills) of a cubin, read by the wheel's
    `cuobjdump`; empty where it cannot be run."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run(
                [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True, timeout=60
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
    usage = dict(re.findall(r"\b(REG|STACK):(\d+)", out))
    if not usage:
        return {}
    return {"registers": int(usage["REG"]), "stack_bytes": int(usage["STACK"])}


def defined_kernels() -> set[str]:
    """Names of the launchable kernels in `kernels/` (jitted functions whose names end in _kernel)."""
    import importlib

    from triton.runtime.jit import JITFunction

    names = set()
    for path in sorted((ROOT / "zerobubble" / "kernels").glob("*.py")):
        module = importlib.import_module(f"zerobubble.kernels.{path.stem}")
        names |= {n for n, v in vars(module).items() if isinstance(v, JITFunction) and n.endswith("_kernel")}
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here as well")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9 warns when unset; this is its default
    import triton
    from device_check.common import Context
    from device_check.kernels import check_kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = record_launches()
    with tempfile.TemporaryDirectory() as out:
        ctx = Context(device=torch.device("cpu"), dry_run=False, out_dir=Path(out))
        check_kernels(ctx)  # its comparisons fail (nothing ran); only the launches count
    variants: dict[str, Launch] = {}
    for kernel, signature, constexprs, options in launches:
        key = f"{kernel.__name__}({constexprs}; {signature}; {options})"
        variants.setdefault(key, (kernel, signature, constexprs, options))
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    results: list[dict[str, Any]] = []
    for kernel, signature, constexprs, options in variants.values():
        for arch, arch_name in TARGETS:
            started = time.perf_counter()
            entry: dict[str, Any] = {
                "kernel": kernel.__name__,
                "target": f"sm_{arch}",
                "constexprs": constexprs,
                "options": options,
            }
            try:
                source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
                compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
                entry.update(
                    ok=True, mma="mma" in compiled.asm["ptx"], **resource_usage(cuobjdump, compiled.asm["cubin"])
                )
            except Exception as exc:  # every failure is reported, not only the first
                entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc).strip()[:2000]}")
            entry["seconds"] = round(time.perf_counter() - started, 2)
            results.append(entry)
            shown = ", ".join(f"{k}={v}" for k, v in {**constexprs, **options}.items() if k.isupper() or k in options)
            if entry["ok"]:
                registers, stack = entry.get("registers", "?"), entry.get("stack_bytes", "?")
                status = f"ok, {registers} registers, {stack} bytes of stack (spills)"
            else:
                status = "FAILED " + entry["error"].splitlines()[0]
            print(f"{kernel.__name__:28s} sm_{arch} ({arch_name}) [{shown}]: {status}", flush=True)
    missing = sorted(defined_kernels() - {r["kernel"] for r in results})
    for name in missing:
        print(f"{name:28s} never launched by device_check's kernel section", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "missing": missing}, indent=2, default=str))
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} of {len(results)} compiled; {len(missing)} kernels not covered", flush=True)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
