"""Products chosen per weight shape and row bucket (zerobubble/kernels/linear_choice.py): the
choice rule, forced choices, the cache, and a CPU without AVX-512 BF16."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zerobubble.config import CPU_LINEAR_CHOICES
from zerobubble.kernels import cpu, linear_choice
from zerobubble.kernels.linear import (
    BUCKET_ROWS,
    PRODUCTS,
    candidates,
    default_plan,
    linear,
    prepare_linear,
    row_bucket,
)
from zerobubble.kernels.linear_choice import (
    CHOICES,
    MIN_GAIN,
    MIN_GAIN_SECOND_LAYOUT,
    LinearChooser,
    bucket_names,
    pick_plan,
    warn_if_int8_is_slower,
)

NUM_BUCKETS = len(BUCKET_ROWS)


def test_the_flag_offers_every_choice_and_rows_fall_in_their_buckets() -> None:
    assert CPU_LINEAR_CHOICES == CHOICES
    assert bucket_names() == ("1", "2-4", "5-16", "17-64", "65+")
    assert [row_bucket(n) for n in (0, 1, 2, 4, 5, 16, 17, 64, 65, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [row_bucket(n) for n in BUCKET_ROWS] == list(range(NUM_BUCKETS))


def test_a_bucket_leaves_the_default_only_for_a_clear_gain() -> None:
    default = ("blocks",) * NUM_BUCKETS
    # "dense" and "onednn" read other layouts than the default's: a gain below the second
    # layout's bar keeps the default; above it, the faster product is taken for that bucket only.
    times = {
        "blocks": [1.0, 1.0, 1.0, 1.0, 1.0],
        "onednn": [1.2, 0.97, 1.0 / (MIN_GAIN_SECOND_LAYOUT * 1.01), 0.5, 1.1],
        "dense": [2.0, 2.0, 2.0, 2.0, 0.9],
    }
    assert pick_plan(times, default) == ("blocks", "blocks", "onednn", "onednn", "blocks")
    # Within the default's layout a gain of MIN_GAIN suffices; noise below it keeps the default.
    int8_default = ("int8-rows", "int8-rows", "int8-torch", "int8-widened", "int8-widened")
    int8_times = {
        "int8-rows": [1.0, 1.0, 3.0, 9.0, 30.0],
        "int8-torch": [1.0 / (MIN_GAIN * 1.01), 1.0 / (MIN_GAIN * 0.99), 2.0, 5.0, 20.0],
        "int8-widened": [5.0, 5.0, 2.5, 4.0, 10.0],
    }
    chosen = pick_plan(int8_times, int8_default)
    assert chosen == ("int8-torch", "int8-rows", "int8-torch", "int8-widened", "int8-widened")


def test_float32_keeps_its_default_plan_whatever_is_asked(tmp_path: Path) -> None:
    """float32 is the exactness reference: never timed, never forced off its plan."""
    weight = torch.randn(48, 64)
    default = default_plan(candidates(weight), weight.dtype)
    for mode in ("auto", "onednn", "dense"):
        chooser = LinearChooser(mode, None, tmp_path / "choice.json", measure_when_busy=True)
        assert prepare_linear(weight, choose=chooser).plan == default and chooser.measure_seconds == 0
    assert not (tmp_path / "choice.json").exists()


def test_a_forced_product_runs_wherever_it_can_and_the_default_elsewhere() -> None:
    weight = torch.randn(48, 64).bfloat16()
    dense = prepare_linear(weight, choose=LinearChooser("dense"))
    assert dense.plan == ("dense",) * NUM_BUCKETS and dense.packed is None and dense.dense is weight
    x = torch.randn(20, 64).bfloat16()
    assert torch.equal(linear(x, dense), F.linear(x, weight))
    # int4 cannot run a float weight whose quantization is none: the default plan does.
    names = candidates(weight)
    assert prepare_linear(weight, choose=LinearChooser("int4")).plan == default_plan(names, weight.dtype)
    assert prepare_linear(weight, choose=LinearChooser("default")).plan == default_plan(names, weight.dtype)
    with pytest.raises(ValueError, match="unknown CPU linear product 'amx'"):
        LinearChooser("amx")


def test_measured_choices_are_cached_per_machine_and_read_back(tmp_path: Path, cpu_kernels: None) -> None:
    cache = tmp_path / "choice.json"
    weight = torch.randn(40, 64).bfloat16()
    first = LinearChooser("auto", "cpp", cache, measure_when_busy=True)
    plan = prepare_linear(weight, impl="cpp", choose=first).plan
    assert first.measure_seconds > 0
    names = candidates(weight, impl="cpp")
    assert all(name in names for name in plan) and len(plan) == NUM_BUCKETS
    [(key, entry)] = json.loads(cache.read_text()).items()
    assert key.endswith("/40x64/bfloat16/none/" + ",".join(names))
    assert entry["plan"] == list(plan) and set(entry["times"]) == set(names)
    # A second start reads the choice: nothing is timed, the same plan serves.
    second = LinearChooser("auto", "cpp", cache)
    prepared = prepare_linear(weight, impl="cpp", choose=second)
    assert prepared.plan == plan and second.measure_seconds == 0
    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(linear(x, prepared).float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)
    # Another CPU (other flags) is another machine: its choice is measured anew.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "cpu_flags", lambda: "flags : sse2 avx2")
        third = LinearChooser("auto", "cpp", cache, measure_when_busy=True)
        prepare_linear(weight, impl="cpp", choose=third)
    assert third.measure_seconds > 0 and len(json.loads(cache.read_text())) == 2


def test_a_busy_machine_keeps_the_default_plan_and_caches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(linear_choice, "machine_is_busy", lambda: True)
    cache = tmp_path / "choice.json"
    chooser = LinearChooser("auto", None, cache)
    weight = torch.randn(48, 64).bfloat16()
    assert prepare_linear(weight, choose=chooser).plan == default_plan(candidates(weight), weight.dtype)
    assert chooser.skipped_busy and not cache.exists()


def test_a_cpu_without_avx512_bf16_never_offers_the_block_product(
    cpu_kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight = torch.randn(48, 64).bfloat16()
    monkeypatch.setattr(cpu, "native_bf16", lambda: False)
    names = candidates(weight, impl="cpp")
    assert "blocks" not in names and "blocks" not in candidates(weight, "int8", impl="cpp")
    plan = prepare_linear(weight, impl="cpp", choose=LinearChooser("blocks")).plan
    assert plan == default_plan(names, weight.dtype) and "blocks" not in plan
    int8 = prepare_linear(weight, quantization="int8", impl="cpp")
    assert int8.blocks is None and int8.int8 is not None and int8.plan[0] == "int8-rows"


def test_every_product_named_for_a_weight_reads_a_layout_it_keeps(cpu_kernels: None) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for quantization in ("none", "int8", "int4"):
            weight = torch.randn(48, 64).to(dtype)
            for name in candidates(weight, quantization, impl="cpp"):
                prepared = prepare_linear(weight, quantization=quantization, impl="cpp", choose=LinearChooser(name))
                assert getattr(prepared, PRODUCTS[name].layout) is not None, (dtype, quantization, name)


def test_int8_reports_how_it_compares_with_the_16_bit_products(
    tmp_path: Path, cpu_kernels: None, caplog: pytest.LogCaptureFixture
) -> None:
    chooser = LinearChooser("auto", "cpp", tmp_path / "choice.json", measure_when_busy=True)
    for shape in ((64, 128), (128, 64)):
        prepare_linear(torch.randn(shape).bfloat16(), quantization="int8", impl="cpp", choose=chooser)
    with caplog.at_level(logging.INFO, logger="zerobubble.kernels.linear_choice"):
        lines = chooser.report()
        ratio = warn_if_int8_is_slower(chooser, "cpp")
    assert len(lines) == 2 and lines[0].startswith("64x128 bfloat16 int8 (x1): 1: ")
    assert ratio is not None and ratio > 0
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) == (ratio > 1.0)
    # Without timings (a forced product) there is nothing to compare.
    forced = LinearChooser("blocks", "cpp")
    prepare_linear(torch.randn(64, 128).bfloat16(), quantization="int8", impl="cpp", choose=forced)
    assert warn_if_int8_is_slower(forced, "cpp") is None


@pytest.mark.slow
def test_kernels_built_for_avx2_only_match_their_twins(tmp_path: Path) -> None:
    """The kernels compiled for a CPU without AVX-512 (x86-64-v3: AVX2 and FMA) in a process of
    their own: the kernel tests pass there, and no product plan offers the block product."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, cpu.MARCH_ENV: "x86-64-v3", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    tests = ["tests/unit/test_linear.py", "tests/unit/test_fused_kernels.py", "tests/unit/test_attention_kernel.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=root, env=env, text=True,
        capture_output=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    probe = "from zerobubble.kernels import cpu; assert cpu.load(); print(cpu.native_bf16())"
    native = subprocess.run([sys.executable, "-c", probe], cwd=root, env=env, text=True, capture_output=True)
    assert native.stdout.strip() == "False", native.stderr[-2000:]
