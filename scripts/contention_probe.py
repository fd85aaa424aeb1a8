"""Does work beside a step slow it through the GIL or through the cores? The real model's step
time alone and beside a thread that, every `--period-ms`, works `--busy-us` microseconds
either holding the GIL (pure Python) or releasing it (hashlib over 64 KiB, which drops the GIL).

    python scripts/contention_probe.py --rounds 3

If GIL-holding work slowed a step much more than the same amount of GIL-free work, the host
threads of an async worker would be delaying the step through the GIL (and, on a GPU, its kernel
launches); if both slow it alike, it is the cores. Conditions are interleaved (the order reverses
every round); `py-si` repeats the pure-Python case with a 0.5 ms switch interval.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker_svc.server import build_runner  # noqa: E402
from zerobubble.config import WorkerConfig  # noqa: E402
from zerobubble.request_options import StoppingOptions  # noqa: E402
from zerobubble.tools.in_process import make_scheduler  # noqa: E402

BUFFER = os.urandom(1 << 16)


def python_work(us: float) -> None:
    """Busy for `us` microseconds holding the GIL."""
    end = time.perf_counter() + us / 1e6
    n = 0
    while time.perf_counter() < end:
        n += 1


def native_work(us: float) -> None:
    """Busy for `us` microseconds, mostly without the GIL (hashlib releases it for large data)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        hashlib.sha256(BUFFER).digest()


def median_step_ms(runner, num_steps: int) -> float:
    """Median step time of 4 greedy requests decoding with n-gram drafts (after 5 warm-up steps)."""
    sched = make_scheduler(runner, max_num_batched_tokens=512, max_num_seqs=8)
    runner.reset()
    rng = random.Random(1)
    for i in range(4):
        sched.add_request(
            f"r{i}", [rng.randrange(1000, 20000) for _ in range(40)], None, StoppingOptions(max_tokens=2000)
        )
    times = []
    for step in range(num_steps + 5):
        plan = sched.schedule()
        t0 = time.perf_counter()
        result = runner.execute(plan).materialize(0.0, runner.num_spec_tokens)
        if step >= 5:
            times.append(time.perf_counter() - t0)
        sched.on_step_result(result)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--busy-us", type=float, default=400.0)
    p.add_argument("--period-ms", type=float, default=5.0)
    args = p.parse_args()
    runner, _ = build_runner(WorkerConfig(spec_method="ngram", num_spec_tokens=3, kv_cache_memory_gb=0.5))
    work: list[Callable[[float], None] | None] = [None]
    stop = threading.Event()

    def competitor() -> None:
        while not stop.wait(args.period_ms / 1e3):
            fn = work[0]
            if fn is not None:
                fn(args.busy_us)

    threading.Thread(target=competitor, daemon=True).start()
    conditions = [("alone", None, 0.005), ("py", python_work, 0.005), ("native", native_work, 0.005)]
    conditions.append(("py-si", python_work, 0.0005))
    figures: dict[str, list[float]] = {name: [] for name, _, _ in conditions}
    for round_ in range(args.rounds):
        for name, fn, interval in conditions if round_ % 2 == 0 else conditions[::-1]:
            sys.setswitchinterval(interval)
            work[0] = fn
            figures[name].append(median_step_ms(runner, args.steps))
            work[0] = None
            print(f"{name}: {figures[name][-1]:.2f} ms/step", flush=True)
    stop.set()
    sys.setswitchinterval(0.005)
    for name, values in figures.items():
        runs = " ".join(f"{v:.2f}" for v in values)
        print(f"== {name}: {runs}  median {statistics.median(values):.2f} ms/step", flush=True)


if __name__ == "__main__":
    main()
