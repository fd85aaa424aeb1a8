"""Which product runs each linear weight, chosen by timing the candidates on this machine.

The fastest product for a weight depends on the CPU (AVX-512 BF16 or not, AMX tiles or not,
memory bandwidth), the thread count, the weight's shape and the number of rows: the compiled
block product streams a weight at the memory's speed for a few rows, oneDNN's packed product
uses AMX for wide batches where the CPU has it, torch's int8 product is faster than the compiled
one on some CPUs and slower on others. So for each weight shape of the loaded model and each row
bucket (`zerobubble.kernels.linear.ROW_BUCKETS`), `LinearChooser` times every candidate
(`zerobubble.kernels.linear.candidates`) on random values of that shape, alternating them, and
keeps the fastest; the default plan keeps its bucket unless another is at least ``MIN_GAIN``
faster, so a choice is never a loss against the default by noise.

A product over another layout of the weight than the one-row choice's is taken only if it is
``MIN_GAIN_SECOND_LAYOUT`` faster, since the weight is then kept twice.

Choices are cached in a JSON file beside the compiled kernels (`cache_path`), keyed by the CPU
model and flags, torch's version and thread count, the compiled kernels' build, and the weight's
shape, dtype and quantization: the first start on a machine measures (a few seconds for a small
model), later ones read. ``--cpu-linear`` forces one product (where it can run a weight) or the
default plan without measuring.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerobubble.kernels import cpu
from zerobubble.kernels._triton import KernelImpl
from zerobubble.kernels.linear import BUCKET_ROWS, PRODUCTS, ROW_BUCKETS, candidates, default_plan, lay_out

logger = logging.getLogger(__name__)

# A bucket leaves the default plan only for a product this much faster there.
MIN_GAIN = 1.05
# A product over a second layout of the weight (twice its memory) must be this much faster.
MIN_GAIN_SECOND_LAYOUT = 1.25
# Each candidate is timed at least this many times per bucket, and until this much time went by.
MIN_REPS = 3
MAX_REPS = 25
SECONDS_PER_CANDIDATE = 0.03
# --cpu-linear's values besides the product names.
AUTO, DEFAULT = "auto", "default"
CHOICES = (AUTO, DEFAULT, *PRODUCTS)
CACHE_FILE = "zerobubble-linear-choice.json"


def bucket_names() -> tuple[str, ...]:
    """``("1", "2-4", "5-16", "17-64", "65+")``: the buckets as the log names them."""
    lows = (1, *(b + 1 for b in ROW_BUCKETS))
    return tuple(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in zip(lows, ROW_BUCKETS)) + (f"{lows[-1]}+",)


def machine_key(impl: KernelImpl) -> str:
    """What a measured choice holds for: this CPU and its flags, torch, the thread count and the
    compiled kernels' build (their name changes with their source and compiler flags)."""
    parts = [cpu.cpu_model(), cpu.cpu_flags(), torch.__version__, str(torch.get_num_threads())]
    if impl == "cpp":
        parts.append(cpu.library_name())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_path() -> Path:
    """The choices' file, beside the compiled kernels (torch's extension cache)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / CACHE_FILE


def machine_is_busy() -> bool:
    """Whether other work keeps this process's cores busy (the last minute's load average, less
    this process, above half of them), so that timings would measure the contention."""
    return os.getloadavg()[0] - 1.0 > 0.5 * cpu.num_cores()


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Adds ``entry`` under ``key``, atomically (processes starting together each write whole files)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache(path)
        data[key] = entry
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(data, tmp, indent=1, sort_keys=True)
        os.replace(tmp.name, path)
    except OSError as exc:  # a read-only home: the choice is measured again next start
        logger.debug("could not cache the linear products' choice in %s: %s", path, exc)


def time_products(
    weight: torch.Tensor, quantization: str, names: tuple[str, ...], rows: tuple[int, ...] = BUCKET_ROWS
) -> dict[str, list[float]]:
    """The fastest of several runs, in milliseconds, of each product in ``names`` over a random
    weight like ``weight`` at each row count of ``rows``. The products alternate, so all see the
    same machine; the fastest run is the one least disturbed by other work on it."""
    gen = torch.Generator().manual_seed(0)
    sample = (torch.randn(weight.shape, generator=gen) * 0.02).to(weight.dtype)
    laid = {name: lay_out(sample, quantization, (name,)) for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    for num_rows in rows:
        x = torch.randn(num_rows, weight.shape[1], generator=gen).to(weight.dtype)
        samples: dict[str, list[float]] = {name: [] for name in names}
        # Warm-up (first-call allocation, oneDNN's primitive creation), and a check that the
        # candidates agree: a product broken on this CPU must fail here, not serve.
        first = PRODUCTS[names[0]].run(x, laid[names[0]], None).float()
        for name in names[1:]:
            got = PRODUCTS[name].run(x, laid[name], None).float()
            if not torch.allclose(got, first, rtol=0.05, atol=0.05 * float(first.abs().max())):
                raise RuntimeError(f"the {name} and {names[0]} products disagree on a {tuple(weight.shape)} weight")
        started = time.perf_counter()
        while True:
            for name in names:
                begin = time.perf_counter()
                PRODUCTS[name].run(x, laid[name], None)
                samples[name].append(time.perf_counter() - begin)
            reps, spent = len(samples[names[0]]), time.perf_counter() - started
            if reps >= MAX_REPS or (reps >= MIN_REPS and spent >= SECONDS_PER_CANDIDATE * len(names)):
                break
        for name in names:
            times[name].append(min(samples[name]) * 1e3)
    return times


def pick_plan(times: dict[str, list[float]], default: tuple[str, ...]) -> tuple[str, ...]:
    """Per bucket the fastest product over the default's layout, where it beats the default's
    product by ``MIN_GAIN``; or, where one over another layout beats that by
    ``MIN_GAIN_SECOND_LAYOUT`` (the weight is then kept in both), that one."""
    primary = PRODUCTS[default[0]].layout
    plan = []
    for bucket, baseline in enumerate(default):
        speed = {name: per_bucket[bucket] for name, per_bucket in times.items()}
        same = min((name for name in speed if PRODUCTS[name].layout == primary), key=speed.__getitem__)
        chosen = same if speed[baseline] > MIN_GAIN * speed[same] else baseline
        other = min(speed, key=speed.__getitem__)
        if PRODUCTS[other].layout != primary and speed[chosen] > MIN_GAIN_SECOND_LAYOUT * speed[other]:
            chosen = other
        plan.append(chosen)
    return tuple(plan)


@dataclass(slots=True)
class Choice:
    """One weight shape's plan and the times it was chosen from (ms per bucket), if measured."""

    plan: tuple[str, ...]
    times: dict[str, list[float]]
    default: tuple[str, ...]  # the default plan it was chosen against
    num_weights: int = 0  # weights of the loaded model(s) with this shape, dtype and quantization


@dataclass(slots=True, eq=False)
class LinearChooser:
    """Picks each linear weight's products (`zerobubble.kernels.linear.PlanChooser`): by timing
    on this machine (``mode="auto"``, cached by `cache_path`), the default plan (``"default"``),
    or one product forced wherever it can run (a `PRODUCTS` name); `report` logs what it chose."""

    mode: str = AUTO
    impl: KernelImpl = None
    path: Path | None = None  # the cache file; None: cache_path()
    # Timing on a machine busy with other work measures the scheduler, not the products: then the
    # default plan serves and nothing is cached (tests measure regardless).
    measure_when_busy: bool = False
    choices: dict[tuple[Any, ...], Choice] = field(default_factory=dict)
    measure_seconds: float = 0.0
    skipped_busy: bool = False  # some shape kept the default plan because the machine was busy

    def __post_init__(self) -> None:
        if self.mode not in CHOICES:
            raise ValueError(f"unknown CPU linear product {self.mode!r} (known: {', '.join(CHOICES)})")

    def __call__(
        self, weight: torch.Tensor, quantization: str, names: tuple[str, ...], default: tuple[str, ...]
    ) -> tuple[str, ...]:
        shape_key = (tuple(weight.shape), str(weight.dtype), quantization, names)
        choice = self.choices.get(shape_key)
        if choice is None:
            choice = self.choices[shape_key] = self._choose(weight, quantization, names, default)
        choice.num_weights += 1
        return choice.plan

    def _choose(
        self, weight: torch.Tensor, quantization: str, names: tuple[str, ...], default: tuple[str, ...]
    ) -> Choice:
        # float32 is the exactness reference: its default plan's 1-4 row product is Hugging
        # Face's own (MKL's gemv over the plain weight), whatever another product would save.
        if self.mode == DEFAULT or weight.device.type != "cpu" or weight.dtype == torch.float32:
            return Choice(default, {}, default)
        if self.mode != AUTO:
            return Choice((self.mode,) * len(default) if self.mode in names else default, {}, default)
        path = self.path or cache_path()
        out, inputs = weight.shape
        key = f"{machine_key(self.impl)}/{out}x{inputs}/{str(weight.dtype).removeprefix('torch.')}/{quantization}"
        key += "/" + ",".join(names)
        cached = _read_cache(path).get(key)
        if isinstance(cached, dict) and _valid(cached.get("plan"), names, len(default)):
            return Choice(tuple(cached["plan"]), cached.get("times", {}), default)
        if not self.measure_when_busy and machine_is_busy():
            self.skipped_busy = True
            return Choice(default, {}, default)
        started = time.perf_counter()
        times = time_products(weight, quantization, names)
        self.measure_seconds += time.perf_counter() - started
        plan = pick_plan(times, default)
        _write_cache(path, key, {"plan": list(plan), "times": times, "cpu": cpu.cpu_model()})
        return Choice(plan, times, default)

    def report(self) -> list[str]:
        """One line per weight shape chosen for: its plan per bucket and, where measured, how much
        faster than the default plan's product; logged at INFO."""
        labels = bucket_names()
        lines = []
        for (shape, dtype, quantization, _names), choice in self.choices.items():
            parts = []
            for bucket, (label, name, baseline) in enumerate(zip(labels, choice.plan, choice.default)):
                gain = ""
                if choice.times and name != baseline:
                    gain = f" ({choice.times[baseline][bucket] / choice.times[name][bucket]:.2f}x {baseline})"
                parts.append(f"{label}: {name}{gain}")
            where = f"{shape[0]}x{shape[1]} {dtype.removeprefix('torch.')} {quantization} (x{choice.num_weights})"
            lines.append(f"{where}: {', '.join(parts)}")
        how = f"measured in {self.measure_seconds:.1f} s" if self.measure_seconds else f"mode {self.mode}, no timing"
        if self.mode == AUTO and not self.measure_seconds:
            how = f"read from {self.path or cache_path()}"
        if self.skipped_busy:
            how += f"; the default plan where not cached: the machine is busy (load {os.getloadavg()[0]:.1f})"
        logger.info("CPU linear products (%s):\n  %s", how, "\n  ".join(lines))
        return lines


def _valid(plan: object, names: tuple[str, ...], num_buckets: int) -> bool:
    return isinstance(plan, list) and len(plan) == num_buckets and all(name in names for name in plan)


def warn_if_int8_is_slower(chooser: LinearChooser, impl: KernelImpl) -> float | None:
    """With int8 weights: the one-row products of the model's int8 weights against the same
    shapes in the model's 16-bit dtype, each as chosen here; a warning says by how much int8 is
    slower where it is. The ratio int8 / 16-bit, None when nothing was timed."""
    int8_ms = wide_ms = 0.0
    wide = LinearChooser(chooser.mode, impl, chooser.path, chooser.measure_when_busy)
    dtype = torch.bfloat16
    for (shape, dtype_name, quantization, _names), choice in list(chooser.choices.items()):
        if quantization != "int8" or not choice.times:
            continue
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        weight = torch.empty(shape, dtype=dtype)
        names = candidates(weight, "none", True, impl)
        wide_plan = wide(weight, "none", names, default_plan(names, dtype))
        wide_times = wide.choices[(tuple(shape), str(dtype), "none", names)].times
        if not wide_times:
            return None
        int8_ms += choice.num_weights * choice.times[choice.plan[0]][0]
        wide_ms += choice.num_weights * wide_times[wide_plan[0]][0]
    if not wide_ms:
        return None
    ratio = int8_ms / wide_ms
    if ratio > 1.0:
        logger.warning(
            "--quantization int8 is slower than %s on this CPU (%s): its one-row products take %.2f ms a "
            "step against %.2f ms (%.2fx); --quantization none is faster here",
            str(dtype).removeprefix("torch."), cpu.cpu_model(), int8_ms, wide_ms, ratio,
        )  # fmt: skip
    return ratio
